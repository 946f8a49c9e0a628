"""MKL (torch's own CPU matmul) against oneDNN (what `mrl.cpu.megatron_speed` computes Megatron's linear layers
with) at each instruction-set level this CPU can run, at the GEMM shapes of the demo's train step.

Each level runs in a fresh process started with `mrl.cpu.isa.forced_environment(level)` (the libraries
read their caps once), one thread, fp32. Shapes: the demo model's linear layers (SHAPES) on a packed batch of T
tokens: the forward `x @ w^T` [T, k] x [k, n] and the weight gradient `dY^T @ x` [n, T] x [T, k], as Megatron's
linear calls them (oneDNN's through `megatron_speed._onednn_matmul`, rounding and copies included). A time is the median of --reps calls after two warm-up calls; the
ratio MKL / oneDNN above 1 means oneDNN is faster. Figures, not a test: other load on the machine shows in them.

    python benchmarks/cpu_gemm.py [--tokens 1486 --reps 40 --levels avx2,avx512_bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

#: (in, out) of each linear layer of the demo model (recipes/arith-tiny-cpu.yaml: hidden 128, 4 heads of 32 with 4
#: KV heads, SwiGLU MLP of 512, vocabulary 17): Megatron fuses Q, K, V into one GEMM and the MLP's gate and up.
SHAPES = {"qkv": (128, 384), "proj": (128, 128), "fc1": (128, 1024), "fc2": (512, 128), "output": (128, 17)}

_CHILD = """
import json, sys, time, torch
from mrl.cpu.megatron_speed import _onednn_matmul
torch.set_num_threads(1)
tokens, reps, shapes = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])

def median_ms(fn):
    fn(); fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter(); fn(); times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3

rows = {}
g = torch.Generator().manual_seed(0)
for name, (k, n) in shapes.items():
    x, w, dy = (torch.randn(tokens, k, generator=g), torch.randn(n, k, generator=g),
                torch.randn(tokens, n, generator=g))
    rows[name] = {
        "fwd_mkl": median_ms(lambda: torch.matmul(x, w.t())),
        "fwd_onednn": median_ms(lambda: _onednn_matmul(x, w.t())),
        "wgrad_mkl": median_ms(lambda: torch.matmul(dy.t(), x)),
        "wgrad_onednn": median_ms(lambda: _onednn_matmul(dy.t(), x)),
    }
print("ROWS" + json.dumps(rows))
"""


def run_level(level: str | None, tokens: int, reps: int) -> dict:
    from mrl.cpu.isa import FORCE_ENV, detect, forced_environment

    env = {k: v for k, v in os.environ.items() if k != FORCE_ENV}
    env["OMP_NUM_THREADS"] = "1"
    if level and level != detect({}).native:
        env.update(forced_environment(level, env))
    done = subprocess.run([sys.executable, "-c", _CHILD, str(tokens), str(reps), json.dumps(SHAPES)], env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"level {level}: the timing process failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.split("ROWS", 1)[1])


def main() -> None:
    from mrl.cpu.isa import LEVELS, detect

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1486, help="packed tokens of a train step (the benchmark's)")
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--levels", default="", help="comma-separated levels (default: every level this CPU runs)")
    args = parser.parse_args()
    isa = detect({})
    print(isa.summary())
    levels = args.levels.split(",") if args.levels else (
        list(LEVELS[: LEVELS.index(isa.native) + 1]) if isa.native else [None])
    for level in levels:
        rows = run_level(level, args.tokens, args.reps)
        totals = {key: sum(row[key] for row in rows.values()) for key in next(iter(rows.values()))}
        print(f"\nlevel {level or 'native'}: {args.tokens} tokens, 1 thread, median of {args.reps} (ms)")
        print(f"{'GEMM':8} {'fwd MKL':>9} {'fwd oneDNN':>11} {'wgrad MKL':>10} {'wgrad oneDNN':>13}")
        for name, row in {**rows, "total": totals}.items():
            print(f"{name:8} {row['fwd_mkl']:9.3f} {row['fwd_onednn']:11.3f} {row['wgrad_mkl']:10.3f} "
                  f"{row['wgrad_onednn']:13.3f}")
        print(f"MKL / oneDNN: forward {totals['fwd_mkl'] / totals['fwd_onednn']:.2f}x, "
              f"weight gradient {totals['wgrad_mkl'] / totals['wgrad_onednn']:.2f}x")


if __name__ == "__main__":
    main()
