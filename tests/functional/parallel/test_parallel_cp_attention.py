"""Context parallelism on CPU: GPTModel logits at CP2 (plain batch and THD pack) equal the CP1 logits."""

from pathlib import Path

from mrl.testing.distributed import run_on_ranks

WORKERS = Path(__file__).with_name("parallel_workers.py")


def test_cp2_logits_equal_cp1():
    import importlib.util

    spec = importlib.util.spec_from_file_location("parallel_workers", WORKERS)
    workers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(workers)
    results = run_on_ranks(workers.cp2_logits_equal_cp1, world_size=2, timeout_s=240)
    for rank, result in enumerate(results):
        assert result["shapes"] == ((2, 8, 40), (1, 12, 40)), rank
        assert result["batch_err"] <= 1e-5, (rank, result)
        assert result["pack_err"] <= 1e-5, (rank, result)
