"""Scoring one long sequence (default 24K tokens) at CP1 and CP2: time and peak memory, against transformers.

The model is tiny (qwen2, hidden 64, 2 layers, 4 heads, 2 KV heads, fp32) with YaRN x4 over 8192 native positions,
the model of `tests/functional/policy/test_policy_long_context.py`. Each measurement runs in fresh processes on
all cores of the machine's budget (`--cores`, default 2): CP1 one rank of `cores` threads, CP2 two ranks of
cores/2 threads each.
  hf  : transformers `AutoModelForCausalLM(attn_implementation="sdpa")`, one forward under no_grad, log-softmax and
        gather of the next tokens (the bare library a user would score with)
  mrl : `logprobs_of_batch` with packing (the policy's logprob pass: Megatron forward through the flash path of
        `mrl.parallel.attention`, vocab-parallel logprobs), and one `train_on_batch` step (forward + backward + Adam)
Peak memory is the process's max RSS (the largest rank's for CP2), which includes the ~0.5 GB of imported
libraries; "added" subtracts the RSS measured just before the first pass. Times are medians over --reps after
one warm-up. Prints the logprob differences too (mrl vs hf, CP2 vs CP1).

    python benchmarks/long_context.py [--length 24576 --reps 3 --cores 2]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 8192}


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux


def _ids(length: int, vocab: int):
    import torch

    return torch.randint(2, vocab, (1, length), generator=torch.Generator().manual_seed(0))


def _median_time(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def hf_rank(model_dir: str, length: int, reps: int, threads: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = _ids(length, model.config.vocab_size)
    base = _rss_gb()
    out = {}

    def score() -> None:
        with torch.no_grad():
            logits = model(ids).logits
            out["lp"] = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)

    seconds = _median_time(score, reps)
    return {"score_s": seconds, "peak_gb": _rss_gb(), "base_gb": base, "logprobs": out["lp"]}


def mrl_rank(model_dir: str, length: int, reps: int, threads: int, cp: int) -> dict:
    import torch
    from megatron.core import parallel_state as ps

    from mrl.config.schema import PackingConfig
    from mrl.parallel.groups import init_process_groups
    from mrl.parallel.layout import ParallelDims
    from mrl.policy.interface import RankBatch, global_count
    from mrl.policy.train_step import StepContext, logprobs_of_batch, train_on_batch
    from mrl.testing.losses import PGLoss
    from mrl.testing.megatron import trainable_from_hf

    torch.set_num_threads(threads)
    init_process_groups(ParallelDims(cp=cp, world_size=cp))
    model, optimizer, scheduler, hf_config = trainable_from_hf(model_dir, lr=1e-5, total_steps=reps + 1,
                                                               context_parallel=cp)
    ids = _ids(length, hf_config["vocab_size"])
    mask = torch.ones_like(ids, dtype=torch.float32)
    batch = RankBatch(ids, mask, token_data={"adv": torch.ones_like(mask)}, lengths=torch.tensor([length]))
    ctx = StepContext(dp_size=1, cp_rank=ps.get_context_parallel_rank(), cp_size=cp,
                      cp_group=ps.get_context_parallel_group(), is_last_stage=True, vocab_size=hf_config["vocab_size"])
    packing = PackingConfig(enabled=True, tokens_per_microbatch=length)
    base = _rss_gb()
    out = {}

    def score() -> None:
        out["lp"] = logprobs_of_batch([model], batch, micro_batch_size=1, ctx=ctx, packing=packing)

    def train() -> None:
        train_on_batch([model], optimizer, scheduler, batch, loss_fn=PGLoss("token"), count=global_count(mask, "token"),
                       micro_batch_size=1, ctx=ctx, packing=packing)

    score_s = _median_time(score, reps)
    score_peak = _rss_gb()
    train_s = _median_time(train, reps)
    return {"score_s": score_s, "train_s": train_s, "score_peak_gb": score_peak, "peak_gb": _rss_gb(),
            "base_gb": base, "logprobs": out["lp"][:, 1:]}


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=24576, help="tokens (a multiple of 4 for CP2)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--cores", type=int, default=2)
    return parser.parse_args()


def main() -> None:
    args = _parse()
    from mrl.testing.distributed import run_on_ranks
    from mrl.testing.tiny_models import build_tiny_hf_model

    with tempfile.TemporaryDirectory() as root:
        model = str(build_tiny_hf_model(os.path.join(root, "model"), "qwen2", num_kv_heads=2, seed=5,
                                        rope_parameters=YARN, max_position_embeddings=4 * 8192))
        threads = {"OMP_NUM_THREADS": str(args.cores)}
        hf = run_on_ranks(hf_rank, 1, (model, args.length, args.reps, args.cores), timeout_s=1800, env=threads)[0]
        rows = {"hf": hf}
        for cp in (1, 2):
            per_rank = max(1, args.cores // cp)
            results = run_on_ranks(mrl_rank, cp, (model, args.length, args.reps, per_rank, cp), timeout_s=1800,
                                   env={"OMP_NUM_THREADS": str(per_rank)})
            rows[f"mrl CP{cp}"] = {**results[0], "peak_gb": max(r["peak_gb"] for r in results),
                                   "score_peak_gb": max(r["score_peak_gb"] for r in results),
                                   "base_gb": max(r["base_gb"] for r in results)}
    _report(args, rows)


def _report(args: argparse.Namespace, rows: dict) -> None:
    print(f"one sequence of {args.length} tokens, tiny qwen2 (YaRN x4), fp32, {args.cores} cores, median of "
          f"{args.reps}")
    print(f"{'':10} {'score s':>8} {'x hf':>6} {'train step s':>13} {'peak GB (score)':>16} {'peak GB (train)':>16} "
          f"{'added GB':>9}")
    for name, r in rows.items():
        train = f"{r['train_s']:.2f}" if "train_s" in r else "-"
        score_peak = r.get("score_peak_gb", r["peak_gb"])
        print(f"{name:10} {r['score_s']:8.2f} {r['score_s'] / rows['hf']['score_s']:6.2f} {train:>13} "
              f"{score_peak:16.2f} {(r['peak_gb'] if 'train_s' in r else float('nan')):16.2f} "
              f"{r['peak_gb'] - r['base_gb']:9.2f}")
    hf, cp1, cp2 = rows["hf"]["logprobs"], rows["mrl CP1"]["logprobs"], rows["mrl CP2"]["logprobs"]
    print(f"max |mrl CP1 - hf| = {(cp1 - hf).abs().max().item():.2e}   "
          f"max |CP2 - CP1| = {(cp2 - cp1).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
