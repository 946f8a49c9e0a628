"""Train-step and logprob throughput of padded, packed and dynamically batched micro-batches on a long-tail batch.

One batch of `--sequences` sequences whose lengths follow a long tail (log-normal around `--median` tokens, capped at
`--max-len`, the longest always present so the padded width is `--max-len`), run through the same tiny Megatron
policy three ways:
  padded : fixed micro-batches of `--rows` rows x max-len tokens (the default path)
  packed : sequence packing, THD packs of at most `--budget` tokens (block-diagonal attention)
  dynamic: dynamic batching, padded micro-batches of rows * longest <= `--budget`
Prints real (non-padding) tokens per second of one optimizer step and of one logprob pass, median over reps, and the
efficiency real / computed tokens. A measurement, not a test: nothing is asserted.

    python benchmarks/packing_throughput.py [--sequences 64 --median 48 --max-len 512 --budget 1024 --reps 3]

Note: on CPU, `TorchCoreAttention` scores every pair of a pack and masks the other sequences out (dense [L, L]);
GPU attention kernels skip those blocks, so packing gains more there.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
MODES = ("padded", "packed", "dynamic")


def long_tail_lengths(count: int, median: int, max_len: int, seed: int = 0) -> list[int]:
    """Log-normal lengths (sigma 0.9) in [8, max_len]; the first is max_len."""
    g = torch.Generator().manual_seed(seed)
    lengths = (torch.randn(count, generator=g) * 0.9 + torch.log(torch.tensor(float(median)))).exp()
    lengths = lengths.round().clamp(8, max_len).long()
    lengths[0] = max_len
    return lengths.tolist()


class PolicyGradientLoss:
    """-(advantage * logprob) over the step's valid tokens (token level)."""

    level = "token"

    def __call__(self, logprobs, data, count):
        return (-logprobs * data["adv"] * data["loss_mask"]).sum() / count, {}


def measure(model_dir: str, lengths: list[int], rows: int, budget: int, reps: int) -> dict:
    """Runs on one rank: median seconds of a train step and of a logprob pass per mode, and the token counts."""
    from megatron.core import parallel_state as ps

    from mrl.config.schema import DynamicBatchingConfig, PackingConfig
    from mrl.parallel.layout import ParallelDims
    from mrl.parallel.groups import init_process_groups
    from mrl.policy.interface import RankBatch, global_count
    from mrl.policy.train_step import StepContext, logprobs_of_batch, train_on_batch
    from mrl.testing.megatron import trainable_from_hf

    init_process_groups(ParallelDims(world_size=1))
    model, optimizer, scheduler, hf_config = trainable_from_hf(model_dir, lr=1e-5, total_steps=10 * reps)

    width, n = max(lengths), len(lengths)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, hf_config["vocab_size"], (n, width), generator=g)
    mask = torch.zeros(n, width)
    for i, length in enumerate(lengths):
        ids[i, length:] = 0
        mask[i, min(4, length - 1):length] = 1
    batch = RankBatch(ids, mask, token_data={"adv": torch.randn(n, 1, generator=g).expand(n, width).contiguous()},
                      lengths=torch.tensor(lengths))
    ctx = StepContext(dp_size=1, cp_rank=0, cp_size=1, cp_group=ps.get_context_parallel_group(), is_last_stage=True,
                      vocab_size=hf_config["vocab_size"])
    loss = PolicyGradientLoss()
    options = {"padded": {}, "packed": dict(packing=PackingConfig(enabled=True, tokens_per_microbatch=budget)),
               "dynamic": dict(dynamic_batching=DynamicBatchingConfig(enabled=True, tokens_per_microbatch=budget))}
    train = {m: lambda o=options[m]: train_on_batch([model], optimizer, scheduler, batch, loss_fn=loss,
                                                     count=global_count(mask, "token"), micro_batch_size=rows,
                                                     ctx=ctx, **o) for m in MODES}
    score = {m: lambda o=options[m]: logprobs_of_batch([model], batch, micro_batch_size=rows, ctx=ctx, **o)
             for m in MODES}
    out: dict = {"counts": {m: train[m]() for m in MODES}}  # warm-up; metrics carry the token counts
    for name, fns in (("train_s", train), ("logprobs_s", score)):
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for _ in range(reps):
            for m in MODES:  # interleaved, so drift of the machine hits every mode alike
                start = time.perf_counter()
                fns[m]()
                times[m].append(time.perf_counter() - start)
        out[name] = {m: statistics.median(t) for m, t in times.items()}
    return out


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--median", type=int, default=48, help="median sequence length (tokens)")
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--rows", type=int, default=8, help="rows per padded micro-batch")
    parser.add_argument("--budget", type=int, default=1024, help="tokens per packed / dynamic micro-batch")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    return parser.parse_args()


def main() -> None:
    args = _parse()
    from mrl.data.packing import dynamic_batches, pack_sequences
    from mrl.testing.distributed import run_on_ranks
    from mrl.testing.tiny_models import build_tiny_hf_model

    lengths = long_tail_lengths(args.sequences, args.median, args.max_len)
    with tempfile.TemporaryDirectory() as root:
        model_dir = str(build_tiny_hf_model(os.path.join(root, "model"), "qwen2", hidden=args.hidden,
                                            heads=args.hidden // 32, num_kv_heads=max(1, args.hidden // 64),
                                            intermediate=2 * args.hidden, layers=args.layers,
                                            max_position_embeddings=max(2048, args.max_len)))
        (result,) = run_on_ranks(measure, world_size=1, args=(model_dir, lengths, args.rows, args.budget, args.reps),
                                 timeout_s=3600)
    real = sum(lengths)
    micro_batches = {"padded": -(-len(lengths) // args.rows), "packed": pack_sequences(lengths, args.budget)
                     .num_micro_batches, "dynamic": dynamic_batches(lengths, args.budget).num_micro_batches}
    print(f"batch: {len(lengths)} sequences, {real} real tokens, lengths median "
          f"{int(statistics.median(lengths))}, mean {real / len(lengths):.0f}, max {max(lengths)}; model hidden "
          f"{args.hidden}, {args.layers} layers, fp32, 1 process; padded micro-batches {args.rows} x {max(lengths)}, "
          f"token budget {args.budget}; median of {args.reps} reps")
    print(f"{'mode':8} {'micro-batches':>13} {'efficiency':>10} {'train tok/s':>12} {'logprob tok/s':>14}")
    for m in MODES:
        counts = result["counts"][m]
        efficiency = counts["packing_real_tokens"] / counts["packing_computed_tokens"]
        print(f"{m:8} {micro_batches[m]:>13} {efficiency:>10.3f} {real / result['train_s'][m]:>12.0f} "
              f"{real / result['logprobs_s'][m]:>14.0f}")
    for m in ("packed", "dynamic"):
        print(f"speed-up {m} / padded: train {result['train_s']['padded'] / result['train_s'][m]:.2f}x, "
              f"logprobs {result['logprobs_s']['padded'] / result['logprobs_s'][m]:.2f}x")


if __name__ == "__main__":
    main()
