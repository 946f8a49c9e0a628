"""Memory soak: hundreds of refits and GRPO steps, each process's USS per step and its growth per step.

Part 1, refits: `--refits` refits into one in-process vLLM engine (two weight sets alternating), the engine's USS after
every refit. Part 2, GRPO: `mrl grpo` on the tiny arithmetic recipe for `--steps` steps (its own processes: the
driver, the policy rank, the engine), every process's USS sampled after each logged step. For each series it prints
the USS at a few steps, the change first -> last, and `growth_per_step` (mrl/testing/memory.py: the trimmed mean of
the step-to-step growth, which a steady leak keeps and one-off jumps do not), against what one step moves.

    python benchmarks/memory_soak.py [--refits 300 --steps 200]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
GRPO = ("grpo", "--config", str(ROOT / "recipes" / "arith-tiny-cpu.yaml"), "data.arith.digits=1",
        "data.arith.num_heldout=20", "policy.max_total_sequence_length=12", "generation.max_new_tokens=4",
        "generation.vllm.max_model_len=12", "grpo.val_every=0", "checkpointing.enabled=false", "logger.log_every=1", "grpo.max_num_epochs=1000",
        "grpo.max_idle_steps=0")  # memory, not learning: a random model may score alike for 3 steps


def _report(name: str, series: list[int], step_bytes: int | None) -> None:
    from mrl.testing.memory import growth_per_step

    growth, late = growth_per_step(series), growth_per_step(series[len(series) // 2:])
    marks = sorted({0, len(series) // 4, len(series) // 2, 3 * len(series) // 4, len(series) - 1})
    at = ", ".join(f"{i}: {series[i] / 2**20:.1f}" for i in marks)
    ratio = f" ({growth / step_bytes:.3%} of a step's {step_bytes / 2**20:.2f} MiB)" if step_bytes else ""
    print(f"  {name:<24} USS MiB at step {at}; {(series[-1] - series[0]) / series[0]:+.2%} first -> last; "
          f"growth {growth / 1024:+.2f} KiB per step{ratio}, {late / 1024:+.2f} over the second half (a ramp slows, "
          "a leak does not)", flush=True)


def soak_refits(refits: int) -> None:
    from safetensors.torch import load_file

    from mrl.inference.vllm_backend import VllmBackend, VllmEngineConfig
    from mrl.inference.vllm_extension import process_uss_bytes
    from mrl.testing.tiny_models import build_tiny_hf_model

    with tempfile.TemporaryDirectory() as root:
        kw = dict(family="qwen2", hidden=128, heads=4, num_kv_heads=2, intermediate=256, layers=2)
        paths = [build_tiny_hf_model(os.path.join(root, name), seed=seed, **kw) for seed, name in enumerate("ab")]
        states = [load_file(str(path / "model.safetensors")) for path in paths]
        size = sum(t.numel() * t.element_size() for t in states[0].values())
        engine = VllmBackend(VllmEngineConfig(model_path=str(paths[0]), max_model_len=64, kv_cache_bytes=128 << 20,
                                              refit_bucket_bytes=1 << 20))
        for i in range(5):
            engine.update_weights(states[i % 2].items())
        series = [process_uss_bytes()]
        start = time.perf_counter()
        for i in range(refits):
            engine.update_weights(states[i % 2].items())
            series.append(process_uss_bytes())
        print(f"refits: {refits} in {time.perf_counter() - start:.0f} s", flush=True)
        _report("engine (in-process)", series, size)
        engine.shutdown()


def _processes(driver: int) -> dict[str, int]:
    import psutil

    named = {"driver": driver}
    for child in psutil.Process(driver).children(recursive=True):
        try:
            line = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "WorkerHost" in line or "VllmEngine" in line or "EngineCore" in line:
            named[f"{child.name()[:14]} {child.pid}"] = child.pid
    return named


def _uss(pid: int) -> int | None:
    import psutil

    try:
        return psutil.Process(pid).memory_full_info().uss
    except psutil.Error:
        return None


def soak_grpo(steps: int) -> None:
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.Popen([sys.executable, "-m", "mrl.cli", *GRPO, f"grpo.max_num_steps={steps}",
                                 f"run.output_dir={out}"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        metrics = Path(out) / "logs" / "metrics.jsonl"
        series: dict[str, list[int]] = {}
        seen, start = 0, time.perf_counter()
        while proc.poll() is None:
            time.sleep(0.2)
            rows = metrics.read_text().splitlines() if metrics.exists() else []
            done = [json.loads(row)["step"] for row in rows if row.strip()]
            if done and max(done) > seen:
                seen = max(done)
                for name, pid in _processes(proc.pid).items():
                    value = _uss(pid)
                    if value is not None:
                        series.setdefault(name, []).append(value)
        if proc.returncode != 0:
            raise SystemExit(f"mrl grpo exited with {proc.returncode}")
        print(f"GRPO: {seen} steps in {time.perf_counter() - start:.0f} s (USS sampled after each logged step)")
        for name, values in series.items():
            if len(values) > 10:
                _report(name, values[5:], None)  # after 5 steps of warm-up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--refits", type=int, default=300)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    if args.refits:
        soak_refits(args.refits)
    if args.steps:
        soak_grpo(args.steps)


if __name__ == "__main__":
    main()
