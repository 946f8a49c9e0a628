"""Test-wide set-up: markers follow the folder (tests/unit -> unit, tests/functional -> functional, tests/runs -> runs,
tests/stages -> stages, tests/real -> real, tests/slurm -> slurm, tests/faults -> faults, tests/gym -> gym)."""
import os

import pytest

# One thread per process: the suite runs several ranks on 2 cores (measured: 0.6 s instead of 14 ms per step).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# vLLM engines eager unless a test says otherwise (generation.vllm.enforce_eager: null reads this): the suite starts
# dozens of engines that live seconds, and compiling one costs 7-20 s.
os.environ.setdefault("MRL_VLLM_ENFORCE_EAGER", "1")


def pytest_configure(config):
    """The dependencies' known-harmless Python warnings (mrl/logging/known_noise.py) are filtered in the test processes
    as in mrl's own: pytest's warning capture replaces a process's filters for each test, so it is handed them."""
    from mrl.logging.known_noise import WARNINGS

    for entry in WARNINGS:
        config.addinivalue_line("filterwarnings", f"ignore:{entry.message}::{entry.source}")


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = item.path.parts
        if "unit" in parts:
            item.add_marker(pytest.mark.unit)
        elif "functional" in parts:
            item.add_marker(pytest.mark.functional)
        elif "runs" in parts:
            item.add_marker(pytest.mark.runs)
        elif "stages" in parts:
            item.add_marker(pytest.mark.stages)
        elif "real" in parts:
            item.add_marker(pytest.mark.real)
        elif "slurm" in parts:
            item.add_marker(pytest.mark.slurm)
        elif "faults" in parts:
            item.add_marker(pytest.mark.faults)
        elif "gym" in parts:
            item.add_marker(pytest.mark.gym)
