"""What several fault tests start from."""

from __future__ import annotations

from pathlib import Path

import pytest

from mrl.testing.runs import RECIPE, SHORT_ARITH, Uninterrupted, finish, mrl, warm_grpo_args


@pytest.fixture(scope="session")
def warm(tmp_path_factory) -> Path:
    """A policy that is partly right on the 1-digit task (150 SFT steps, an HF folder): GRPO's groups carry signal
    and its weights move, so a run that lost or mixed up weights would show it in its metrics."""
    out = tmp_path_factory.mktemp("sft")
    finish(mrl("sft", "--config", RECIPE, *SHORT_ARITH, f"run.output_dir={out}"))
    return out / "final_hf"


@pytest.fixture(scope="session")
def sync_reference(warm, tmp_path_factory) -> Uninterrupted:
    """The uninterrupted synchronous GRPO run from `warm` (`warm_grpo_args`), started when a test first asks for it
    (beside that test's own run), shared by the tests whose faulted or resumed run must end with its metrics."""
    out = tmp_path_factory.mktemp("sync-reference")
    return Uninterrupted(warm_grpo_args(warm, out), out)
