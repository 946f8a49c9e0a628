"""Helpers of the NeMo Gym tests (tests/gym): skip where its environment is missing, read a server's example rows."""

from __future__ import annotations

import json

import pytest

from mrl.config.errors import ConfigError
from mrl.data.nemo_gym import gym_python, site_packages


def require_gym() -> None:
    """Skip the calling test module, in one line, where NeMo Gym's environment is missing."""
    try:
        gym_python("tests/gym")
    except ConfigError:
        pytest.skip(
            "NeMo Gym's environment (.venv-gym) is missing: make gym-venv builds it where Python 3.12 and the package "
            "registry are at hand (it printed why it did not)",
            allow_module_level=True,
        )


def example_rows(server: str) -> list[dict]:
    """The rows of the example.jsonl a NeMo Gym server ships."""
    path = site_packages(gym_python()) / "resources_servers" / server / "data" / "example.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
