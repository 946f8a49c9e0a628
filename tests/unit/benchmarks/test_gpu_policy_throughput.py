"""benchmarks/gpu_policy_throughput.py on CPU at a tiny shape: the three paths (mrl, HF + torch, bare megatron-core)
compute the same model on the same batch (their logprobs agree in fp32), and the FLOP counts behind its MFU are
those of the formulas it names, computed here by hand."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "gpu_policy_throughput.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("gpu_policy_throughput", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_flops_follow_the_named_formulas(bench):
    config = dict(hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                  intermediate_size=16, vocab_size=10)
    # per layer: q 8x8, o 8x8, k 8x4, v 8x4 = 192; MLP 3 x 8 x 16 = 384; output layer 8 x 10 = 80
    n = 2 * (192 + 384) + 80
    flops = bench.flops_per_step(config, [3, 5])
    assert flops["matmul_params"] == n
    assert flops["6n"] == 6 * n * 8
    assert flops["prime_rl"] == 3 * (6 * n + 12 * 2 * 2 * 4 * 3) + 5 * (6 * n + 12 * 2 * 2 * 4 * 5)


def test_the_batch_is_rl_shaped_and_exact(bench):
    ids, mask, adv, lengths = bench.make_batch(1000, 20, 90, vocab=50)
    assert int(lengths.sum()) == 1000 and int(lengths.min()) >= 2 and int(lengths.max()) <= 90
    for row, length in enumerate(lengths.tolist()):
        assert mask[row, length:].sum() == 0 and mask[row, length - 1] == 1  # the response ends the sequence
        assert mask[row, 0] == 0 and (ids[row, length:] == 0).all()
        assert adv[row].unique().numel() == 1


def test_the_three_paths_compute_the_same_logprobs_on_cpu(bench, tmp_path):
    results = bench.main(["--shapes", "tiny", "--step-tokens", "1024", "--micro-tokens", "512", "--min-len", "16",
                          "--max-len", "128", "--precision", "float32", "--reps", "1",
                          "--json", str(tmp_path / "out.json")])
    paths = results[0]["paths"]
    assert set(paths) == {"mrl", "hf", "bare"}
    for name in ("mrl", "bare"):
        assert paths[name]["logprob_vs_hf"]["max"] < 1e-5, name
        assert paths[name]["train_tok_s"] > 0 and paths[name]["logprob_tok_s"] > 0
    assert (tmp_path / "out.json").exists()


def test_a_path_out_of_memory_runs_at_the_largest_budgets_that_fit(bench):
    """`fitted` halves both budgets after each out-of-memory error (a fake path that fits 4,096-token micro-batches),
    names those that did not fit, and gives up in one error when a micro-batch could no longer hold the longest
    sequence."""
    import argparse

    import torch

    args = argparse.Namespace(micro_tokens=16_384, logprob_micro_tokens=32_768, max_len=2048)
    seen = []

    def measure(path, config, state, batch, budgets):
        seen.append((budgets.micro_tokens, budgets.logprob_micro_tokens))
        if budgets.micro_tokens > 4096:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB\nmore lines")
        return {"train_tok_s": 1.0}

    result = bench.fitted("bare", {}, {}, None, args, measure=measure)
    assert seen == [(16_384, 32_768), (8192, 16_384), (4096, 8192)]
    assert result == {"train_tok_s": 1.0, "micro_tokens": 4096, "logprob_micro_tokens": 8192,
                      "too_large": [16_384, 8192]}
    assert args.micro_tokens == 16_384  # the next path starts from the budgets asked
    assert "4096 tokens (8192 in logprob passes): 16384, 8192 did not fit" in bench._budget_note(result, args)

    never = bench.fitted("bare", {}, {}, None, argparse.Namespace(micro_tokens=8192, logprob_micro_tokens=8192,
                                                                  max_len=8192), measure=measure)
    assert never["error"] == ("out of memory at micro-batches of 8192 tokens (the last: CUDA out of memory. "
                              "Tried to allocate 8.00 GiB)")
