"""`policy.speed.grouped_expert_gemm`: the routed experts as two grouped GEMMs (mrl/model/grouped_experts.py) give the
logits and gradients of megatron-core's SequentialMLP loop on the same weights, with every local expert on one rank
and split over two expert-parallel ranks, in fp32 within 1e-5 (the loop's linears go through oneDNN here,
mrl/cpu/megatron_speed.py, torch._grouped_mm through its own kernel: the sums differ in order; measured 1.4e-6 on the
logits, 3e-7 on the gradients)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from mrl.testing.distributed import run_on_ranks
from mrl.testing.tiny_models import build_tiny_hf_model

_spec = importlib.util.spec_from_file_location("parallel_workers", Path(__file__).with_name("parallel_workers.py"))
workers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(workers)


@pytest.mark.parametrize("ep", [1, 2])
def test_grouped_experts_equal_the_sequential_loop(tmp_path, ep):
    model_dir = build_tiny_hf_model(tmp_path / "moe", "qwen3_moe", hidden=64, layers=2, intermediate=128)
    for rank, out in enumerate(run_on_ranks(workers.grouped_experts_equal_sequential, world_size=ep, timeout_s=300,
                                            args=(str(model_dir), ep))):
        # the grouped build took its grouped path (no reason to fall back to the loop)
        assert out["experts"] == (["SequentialMLP: no fallback"], ["GroupedGemmExperts: no fallback"]), (rank, out)
        assert out["expert_grads"] > 0, (rank, out)  # the experts were trained through, not skipped
        assert out["logits"] <= 1e-5 and out["grads"] <= 1e-5, (rank, out)
