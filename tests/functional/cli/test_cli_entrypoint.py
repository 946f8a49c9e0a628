"""The installed `mrl` console script, as a user runs it."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

RECIPES = Path(__file__).parents[3] / "recipes"


def mrl(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("mrl", path=str(Path(sys.executable).parent)) or shutil.which("mrl")
    if exe is None:
        pytest.fail("the `mrl` console script is not installed (pip install -e .)")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120, env={**os.environ, "NO_COLOR": "1"})


def test_bad_key_exits_2_before_anything_starts():
    proc = mrl("config", "show", "--config", str(RECIPES / "grpo-deepscaler-1.5b-8K.yaml"), "policy.bogus=1")
    assert proc.returncode == 2
    assert "policy.bogus" in proc.stderr and proc.stdout == ""


def test_config_show_merges_inheritance_and_overrides():
    proc = mrl("config", "show", "--config", str(RECIPES / "grpo-deepscaler-1.5b-16K.yaml"), "loss.kl_beta=0.5")
    assert proc.returncode == 0, proc.stderr
    assert "max_total_sequence_length: 16384" in proc.stdout       # the 16K file
    assert "model_name: deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B" in proc.stdout  # inherited from 8K
    assert "kl_beta: 0.5" in proc.stdout
