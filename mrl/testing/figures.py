"""Figures of the learning suites (tests/learning, tests/learn_real): a test hands a line to the `figure` fixture and
the lines are printed together at the end of the run, also from pytest-xdist's test processes (which print nothing
themselves). A suite's conftest imports both names."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest


@pytest.fixture
def figure(record_property) -> Callable[[str], None]:
    """`figure("reward 0.4 -> 0.9")`: a line for the run's summary."""
    return lambda text: record_property("figure", text)


def pytest_terminal_summary(terminalreporter) -> None:
    reports = [r for outcome in ("passed", "failed") for r in terminalreporter.stats.get(outcome, [])]
    lines = [value for report in reports for name, value in report.user_properties if name == "figure"]
    if lines:
        terminalreporter.section("learning figures")
        for line in lines:
            terminalreporter.write_line(line)


def assert_expected_figures(run_dir: Path, recipe: Path) -> None:
    """The run holds every figure its recipe's expect: block sets, as `mrl check RUN_DIR RECIPE` checks them."""
    from mrl.app.check import check_run, report
    from mrl.config import load_config

    cfg = load_config(str(recipe), [])
    results = check_run(run_dir, cfg)
    assert all(result.ok for result in results), report(results, cfg)
