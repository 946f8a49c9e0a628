"""The installed `mrl` console script, as a user runs it."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

RECIPES = Path(__file__).parents[3] / "recipes"


def mrl(*args: str) -> subprocess.CompletedProcess:  # noqa: D103
    exe = shutil.which("mrl", path=str(Path(sys.executable).parent)) or shutil.which("mrl")
    if exe is None:
        pytest.fail("the `mrl` console script is not installed (pip install -e .)")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120, env={**os.environ, "NO_COLOR": "1", "OMP_NUM_THREADS": "1"})


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


def test_convert_round_trip_through_the_cli_is_bit_exact(tmp_path):
    from safetensors.torch import load_file

    from mrl.testing.tiny_models import build_tiny_hf_model

    hf = build_tiny_hf_model(tmp_path / "hf", "qwen3", num_kv_heads=2, tied=True)
    to_meg = mrl("convert", "hf-to-megatron", "--hf", str(hf), "--out", str(tmp_path / "meg"), "--tp", "2")
    assert to_meg.returncode == 0, to_meg.stderr[-3000:]
    back = mrl("convert", "megatron-to-hf", "--megatron", str(tmp_path / "meg"), "--out", str(tmp_path / "hf2"))
    assert back.returncode == 0, back.stderr[-3000:]
    original, restored = load_file(str(hf / "model.safetensors")), load_file(str(tmp_path / "hf2" / "model.safetensors"))
    assert original.keys() == restored.keys()
    assert all(torch_equal(original[k], restored[k]) for k in original)
    bad = mrl("convert", "hf-to-megatron", "--hf", str(tmp_path / "missing"), "--out", str(tmp_path / "x"))
    assert bad.returncode == 2 and "--hf: not an HF model folder: there is no such folder" in bad.stderr


def torch_equal(a, b) -> bool:
    import torch

    return a.dtype == b.dtype and torch.equal(a, b)
