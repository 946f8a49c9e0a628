"""Where a GRPO step's time goes on the real SmolLM2-135M-Instruct, and what each speed setting of its recipe buys.

The run is the GRPO stage of recipes/grpo-smollm2-135m-times-cpu.yaml (6 prompts x 4 samples of times-table
questions, at most 48 new tokens, one optimizer step per step, 2 cores), for --steps steps, as the recipe sets it and
with one setting changed at a time:
  recipe   : as the recipe sets it: both cores for each phase (cluster.omp_num_threads=2: a synchronous step's
             phases never overlap), the samples packed into one pack of at most 4096 tokens
  threads1 : cluster.omp_num_threads=1, one thread per worker
  padded   : policy.sequence_packing.enabled=false, the samples padded to the longest in one micro-batch
  tokens96 : generation.max_new_tokens=96 (the sequence length and the engine's max_model_len raised by 48 with it)
Each is `mrl grpo` in a subprocess from the same seed, so step 1 generates the same samples in every variant (the
engine runs the same weights and seeds); the variants take turns, --rounds times. Per variant: the median over steps
2..N of `timing/step` and its phases (from logs/metrics.jsonl), the mean reward over the steps, and step 1's
`train/loss`: a setting that changes what is learnt changes it beyond float rounding. Figures, not a test: other
load on the machine shows in them. Needs `make real`.

    python benchmarks/real_grpo_settings.py [--steps 6 --rounds 1 --variants recipe,threads1,padded,tokens96]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from mrl.testing.runs import MACHINERY, metrics

os.environ.setdefault("OMP_NUM_THREADS", "1")  # the mrl subprocesses' workers, as in the Makefile
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "grpo-smollm2-135m-times-cpu.yaml"
#: The recipe's GRPO stage (`mrl grpo --config` does not apply a stage's overrides), without validation, checkpoints
#: or the idle-step stop (speed, not learning).
BASE = ["eval.data=null", "checkpointing.enabled=false", *MACHINERY]
VARIANTS = {
    "recipe": [],
    "threads1": ["cluster.omp_num_threads=1"],
    "padded": ["policy.sequence_packing.enabled=false"],
    "tokens96": ["generation.max_new_tokens=96", "policy.max_total_sequence_length=176",
                 "generation.vllm.max_model_len=176"],
}
PHASES = ("step", "generation", "train", "refit")


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=1, help="runs of each variant, the variants taking turns")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma list of " + ", ".join(VARIANTS))
    parser.add_argument("--keep", metavar="DIR", help="write the runs' outputs here and keep them")
    args = parser.parse_args()
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; pick from {', '.join(VARIANTS)}")
    if args.steps < 2 or args.rounds < 1:
        parser.error(f"--steps must be at least 2 and --rounds at least 1, got {args.steps} and {args.rounds}")
    return args


def run_variant(variant: str, steps: int, out_dir: Path) -> list[dict]:
    """`mrl grpo` with the variant's overrides in a subprocess; its step records from logs/metrics.jsonl."""
    command = [sys.executable, "-m", "mrl.cli", "grpo", "--config", str(RECIPE), *BASE, *VARIANTS[variant],
               f"grpo.max_num_steps={steps}", f"run.output_dir={out_dir}"]
    log = out_dir.with_suffix(".log")
    with log.open("w") as sink:
        code = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    if code:
        tail = [line for line in log.read_text().splitlines() if line.strip()][-6:]
        raise RuntimeError(f"mrl grpo exited with {code}; the end of {log}:\n  " + "\n  ".join(tail))
    return [record for record in metrics(out_dir / "logs").values() if "timing/step" in record]


def summarise(runs: list[list[dict]]) -> dict[str, float]:
    """Phase medians over steps 2..N of every run, mean reward over every step, step 1's loss (of the first run)."""
    steady = [r for records in runs for r in records if r["step"] >= 2]
    row = {phase: statistics.median(r.get(f"timing/{phase}", float("nan")) for r in steady) for phase in PHASES}
    row["reward"] = statistics.mean(r["train/reward"] for records in runs for r in records)
    row["loss1"] = next(r for r in runs[0] if r["step"] == 1).get("train/loss", float("nan"))
    row["tokens"] = statistics.mean(r["train/response_length"] for r in steady)
    return row


def main() -> int:
    args = _parse()
    if not (Path(os.environ.get("MRL_REAL_ASSETS", ROOT / ".cache" / "real")) / "smollm2-135m-instruct").is_dir():
        print("needs the real model: run `make real` (or set MRL_REAL_ASSETS)", file=sys.stderr)
        return 2
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="mrl-real-grpo-"))
    root.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[list[dict]]] = {v: [] for v in args.variants}
    for round_ in range(1, args.rounds + 1):
        for variant in args.variants:
            print(f"[bench] round {round_}/{args.rounds}: {variant} ...", file=sys.stderr, flush=True)
            runs[variant].append(run_variant(variant, args.steps, root / f"{variant}-{round_}"))
    print(f"settings: the GRPO stage of {RECIPE.name}, {args.steps} steps x {args.rounds} rounds; medians over "
          f"steps 2..{args.steps}; outputs in {root}")
    print(f"{'variant':10}{'step s':>9}{'gen s':>9}{'train s':>9}{'refit s':>9}{'tokens':>8}{'reward':>8}"
          f"{'step-1 loss':>14}")
    for variant, variant_runs in runs.items():
        r = summarise(variant_runs)
        print(f"{variant:10}{r['step']:9.2f}{r['generation']:9.2f}{r['train']:9.2f}{r['refit']:9.2f}"
              f"{r['tokens']:8.1f}{r['reward']:8.3f}{r['loss1']:14.8f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
