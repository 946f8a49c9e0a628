"""The GPU tier (`make test-gpu`, marker `gpu`): what one GPU can hold, without Ray, vLLM or Transformer Engine
(each test that needs more says so and skips). On a machine without CUDA the whole tier skips in one line."""

from __future__ import annotations

import pytest
import torch

NO_CUDA = "no CUDA device here: the GPU tier runs where one is (make test-gpu)"


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.gpu)
    if not torch.cuda.is_available() and items:
        config.hook.pytest_deselected(items=list(items))
        config._mrl_gpu_skipped = len(items)
        items[:] = []


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if getattr(config, "_mrl_gpu_skipped", 0):
        terminalreporter.write_line(f"GPU tier: {config._mrl_gpu_skipped} tests skipped: {NO_CUDA}")


def pytest_sessionfinish(session, exitstatus):
    if getattr(session.config, "_mrl_gpu_skipped", 0) and exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        session.exitstatus = pytest.ExitCode.OK  # a tier that skips cleanly is not a failure
