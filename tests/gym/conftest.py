"""Real NeMo Gym servers (make test-gym): the environment `make gym-venv` builds, or a skip in one line saying why.

`servers` starts workplace_assistant (multi-turn, 27 tools over CSV-backed email, calendar, CRM...) and
math_with_judge (single turn; math-verify, its LLM judge off) once for a module, from NeMo Gym's own Python."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def servers():
    from mrl.environments.nemo_gym.process import GymServerProcess

    started = {}
    try:
        for server in ("workplace_assistant", "math_with_judge"):
            started[server] = GymServerProcess(server, server, {}, start_timeout_s=120, key=f"envs.{server}.nemo_gym")
        yield started
    finally:
        for process in started.values():
            process.stop()
