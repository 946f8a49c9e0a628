"""What several fault tests start from."""

from __future__ import annotations

from pathlib import Path

import pytest

from mrl.testing.runs import RECIPE, SHORT_ARITH, finish, mrl


@pytest.fixture(scope="session")
def warm(tmp_path_factory) -> Path:
    """A policy that is partly right on the 1-digit task (150 SFT steps, an HF folder): GRPO's groups carry signal
    and its weights move, so a run that lost or mixed up weights would show it in its metrics."""
    out = tmp_path_factory.mktemp("sft")
    finish(mrl("sft", "--config", RECIPE, *SHORT_ARITH, f"run.output_dir={out}"))
    return out / "final_hf"
