"""Peak host memory of the log-probability pass over one long sequence with a large vocabulary: mrl's chunked
log-softmax (`mrl.policy.logprobs.vocab_parallel_logprobs`) against the path it replaced (the logits upcast whole
to fp32, then Megatron's `vocab_parallel_cross_entropy`, which keeps the fp32 softmax for its backward).

The default case is #38's: one 8192-token sequence over Qwen's 151,936-token vocabulary, logits in bf16 as a GPU
model gives them (2.5 GB), at TP 1. Each variant runs in a fresh process; the figure is the peak resident memory
of the pass above the process's memory with the logits already made (Linux's VmHWM, reset through
/proc/self/clear_refs before the pass), for the logprob pass (no gradient) and for a train pass (forward and
backward). The logits are the output layer's: both paths start from them, and they are printed apart.

    python benchmarks/logprob_memory.py [--tokens 8192 --vocab 151936 --dtype bfloat16 --chunk 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "2")

VARIANTS = ("megatron", "chunked")


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size (Linux >= 4.0)


def _megatron_path(logits, targets):
    """The path before chunking (mrl 7bc7ff5, `vocab_parallel_logprobs`): the whole logits upcast to fp32, then
    Megatron's kernel (no temperature, no padding here)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    return -vocab_parallel_cross_entropy(logits.float(), targets)


def measure(variant: str, tokens: int, vocab: int, dtype_name: str, chunk: int, train: bool) -> dict:
    """In this process: make the logits (a chunk at a time, so making them leaves no larger peak), reset the peak,
    run the pass, read the peak."""
    import torch

    from mrl.parallel.groups import init_process_groups
    from mrl.parallel.layout import ParallelDims
    from mrl.policy.logprobs import vocab_parallel_logprobs

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29591"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    init_process_groups(ParallelDims(world_size=1))
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(0)
    logits = torch.empty(1, tokens, vocab, dtype=dtype)
    for first in range(0, tokens, 256):
        logits[0, first:first + 256] = (torch.randn(min(256, tokens - first), vocab, generator=g) * 3).to(dtype)
    targets = torch.randint(0, vocab, (1, tokens), generator=g)
    logits.requires_grad_(train)
    rss_kb = _status_kb("VmRSS")
    _reset_peak()
    start = time.perf_counter()
    with torch.set_grad_enabled(train):
        if variant == "megatron":
            logprobs = _megatron_path(logits, targets)
        else:
            logprobs = vocab_parallel_logprobs(logits, targets, 1.0, vocab, chunk_tokens=chunk)
        if train:
            logprobs.sum().backward()
    seconds = time.perf_counter() - start
    peak_kb = _status_kb("VmHWM")
    return {"variant": variant, "train": train, "logits_gb": logits.numel() * logits.element_size() / 1e9,
            "pass_peak_gb": (peak_kb - rss_kb) * 1024 / 1e9, "seconds": seconds,
            "logprobs": logprobs.detach()[0, :4].tolist()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--chunk", type=int, default=1024, help="policy.logprob_chunk_tokens")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # "variant,train": run one measurement in this process
    args = parser.parse_args()
    if args.one:
        variant, train = args.one.split(",")
        print(json.dumps(measure(variant, args.tokens, args.vocab, args.dtype, args.chunk, train == "1")))
        return
    print(f"one sequence of {args.tokens} tokens, vocabulary {args.vocab}, {args.dtype} logits, chunk {args.chunk}, "
          f"TP 1; peak memory of the pass above the logits themselves")
    results = {}
    for train in (False, True):
        for variant in VARIANTS:
            out = subprocess.run([sys.executable, __file__, "--one", f"{variant},{int(train)}",
                                  "--tokens", str(args.tokens), "--vocab", str(args.vocab), "--dtype", args.dtype,
                                  "--chunk", str(args.chunk)], check=True, capture_output=True, text=True)
            results[variant, train] = json.loads(out.stdout.strip().splitlines()[-1])
        old, new = results["megatron", train], results["chunked", train]
        same = max(abs(a - b) for a, b in zip(old["logprobs"], new["logprobs"]))
        total_old, total_new = old["pass_peak_gb"] + old["logits_gb"], new["pass_peak_gb"] + new["logits_gb"]
        print(f"{'train pass   ' if train else 'logprob pass '} logits {old['logits_gb']:.2f} GB | "
              f"megatron +{old['pass_peak_gb']:.2f} GB ({old['seconds']:.1f} s) | "
              f"chunked +{new['pass_peak_gb']:.2f} GB ({new['seconds']:.1f} s) | "
              f"extra ratio {new['pass_peak_gb'] / old['pass_peak_gb']:.3f}, with the logits "
              f"{total_new:.2f} / {total_old:.2f} GB = {total_new / total_old:.3f} | first logprobs differ by {same:.1e}")


if __name__ == "__main__":
    main()
