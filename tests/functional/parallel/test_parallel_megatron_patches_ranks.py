"""CPU patches that only matter with 2 ranks: MoE all-to-all split sizes (EP2), gloo's uneven all-gather and the
tied-embedding synchronisation of pipeline stages (PP2)."""

import importlib.util
from pathlib import Path

from mrl.testing.distributed import run_on_ranks


def load_workers():
    spec = importlib.util.spec_from_file_location("parallel_workers", Path(__file__).with_name("parallel_workers.py"))
    workers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(workers)
    return workers


def test_multi_rank_patches_are_needed_and_work():
    results = run_on_ranks(load_workers().megatron_patches_multi_rank, world_size=2, timeout_s=240)
    for rank, result in enumerate(results):
        status, message = result["moe_ep2_without"]
        assert status == "error" and "all_to_all_single" in message, (rank, message)
        status, loss = result["moe_ep2_with"]
        assert status == "ok" and 0.0 < loss < 10.0, (rank, loss)
        status, message = result["gather_without"]
        assert status == "error" and "invalid tensor size" in message, (rank, message)
        # rank 0 gives 3 rows of 1.0, rank 1 gives 5 rows of 2.0, concatenated in rank order
        assert result["gather_with"] == ("ok", [[1.0, 1.0]] * 3 + [[2.0, 2.0]] * 5), rank
        status, message = result["tied_pp2_without"]
        assert status == "error" and ("CUDA" in message or "NVIDIA driver" in message), (rank, message)
        assert result["tied_pp2_with"][0] == "ok", (rank, result["tied_pp2_with"])


def test_distributed_optimizer_resume_with_torch_adam(tmp_path):
    results = run_on_ranks(load_workers().distributed_optimizer_resume, world_size=2, args=(str(tmp_path),),
                           timeout_s=300)
    for rank, result in enumerate(results):
        assert result["groups"] == {"dp": 2, "tp": 1, "dp_ranks": [0, 1]}, rank
        assert result["without"].startswith("KeyError"), (rank, result["without"])
        assert result["distinct_steps"], rank
        assert max(abs(a - b) for a, b in zip(result["uninterrupted"], result["resumed"])) <= 1e-6, (rank, result)
