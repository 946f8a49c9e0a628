"""The GPU tier (`make test-gpu`, marker `gpu`): what one GPU can hold, without vLLM or Transformer Engine (each
test that needs more says so and skips); Ray Core comes from the tier's wheelhouse (requirements/gpu-tier.txt) for
the whole run of test_gpu_whole_run.py. On a machine without CUDA the whole tier skips in one line.

Figures: a test records each number it measures with the `figure` fixture (`figure("cuda_ipc.refit_gib_s", 4.2,
"GiB/s")`); they are printed, and written with every test's outcome, the versions and the device to the JSON report
named by MRL_GPU_REPORT (the runner, mrl/testing/gpu_tier.py, sets it)."""

from __future__ import annotations

import json
import os
import platform
import time

import pytest
import torch

NO_CUDA = "no CUDA device here: the GPU tier runs where one is (make test-gpu)"
_FIGURES: dict[str, dict] = {}
_OUTCOMES: dict[str, dict] = {}


def pytest_collection_modifyitems(config, items):
    """A conftest's collection hook sees the whole session's items (`pytest tests -m unit` too): only this folder's
    are the tier's."""
    here = os.path.dirname(__file__)
    tier = [item for item in items if str(item.path).startswith(here + os.sep)]
    for item in tier:
        item.add_marker(pytest.mark.gpu)
    if not torch.cuda.is_available() and tier:
        config.hook.pytest_deselected(items=tier)
        config._mrl_gpu_skipped = len(tier)
        dropped = {id(item) for item in tier}
        items[:] = [item for item in items if id(item) not in dropped]


@pytest.fixture
def figure(request):
    """figure(name, value, unit, **context): one measured number of this test, kept for the report."""

    def record(name: str, value: float, unit: str, **context) -> None:
        _FIGURES[name] = {"value": value, "unit": unit, "test": request.node.nodeid, **context}
        print(f"[figure] {name} = {value:.4g} {unit}" + (f" {context}" if context else ""))

    return record


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        entry = _OUTCOMES.setdefault(report.nodeid, {"outcome": report.outcome, "seconds": 0.0})
        entry["seconds"] = round(entry["seconds"] + report.duration, 3)
        if report.outcome != "passed":
            entry["outcome"] = report.outcome
            entry["message"] = str(report.longrepr)[-2000:]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if getattr(config, "_mrl_gpu_skipped", 0):
        terminalreporter.write_line(f"GPU tier: {config._mrl_gpu_skipped} tests skipped: {NO_CUDA}")


def pytest_sessionfinish(session, exitstatus):
    if getattr(session.config, "_mrl_gpu_skipped", 0) and exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        session.exitstatus = pytest.ExitCode.OK  # a tier that skips cleanly is not a failure
    path = os.environ.get("MRL_GPU_REPORT")
    if path and torch.cuda.is_available():
        with open(path, "w") as f:
            json.dump(_report(int(session.exitstatus)), f, indent=1, default=str)


def _report(exitstatus: int) -> dict:
    import importlib.metadata as md

    def version(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    props = torch.cuda.get_device_properties(0)
    return {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "exitstatus": exitstatus,
            "device": {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                       "multiprocessors": props.multi_processor_count, "capability": f"{props.major}.{props.minor}",
                       "count": torch.cuda.device_count()},
            "versions": {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                         "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                         **{n: version(n) for n in ("megatron-core", "transformers", "pydantic", "ray")}},
            "tests": _OUTCOMES, "figures": _FIGURES}
