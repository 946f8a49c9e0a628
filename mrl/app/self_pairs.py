"""Preference pairs from a model's own answers: chosen = one of its right answers, rejected = one of its wrong answers
to the same question (`python -m mrl.app.self_pairs --samples S --out P --instruction I`).

    mrl eval (eval.num_samples > 1, temperature > 0)  -->  samples.jsonl   (every sample: problem, response, reward)
    samples.jsonl  --pairs_from_samples-->  pairs.jsonl   {"prompt": "<problem> <instruction>", "chosen", "rejected"}

The pairs are what `mrl dpo` reads (`data.train`, `data.val`; mrl.data.preferences). A question the model answers
always right or always wrong gives no pair. Which wrong answer a right one is paired with (`--rejected`):
- `random`: any of them. A model's wrong answers at temperature 1 are mostly rambles it finds unlikely, so it already
  prefers its right answer in most such pairs (SmolLM2-135M-Instruct: 88% of held-out times-table pairs);
- `likeliest`: the wrong answers it finds likeliest first (the highest `mean_logprob` per token, as `mrl eval` wrote
  it): its most confident mistakes, which DPO should push down, and pairs it does not already get right
  (the same model and questions: 73%). The prompt is the user turn the eval gave the model (problem, a space,
the instruction), so DPO's chat template renders the prompt the samples were drawn from. A rejected response that was
cut at max_new_tokens is kept (it is the model's most common failure on some tasks) and ends, in DPO, with the turn end
it never reached.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Optional

from mrl.app.real_assets import write_atomically, write_jsonl

REJECTED = ("random", "likeliest")


def pairs_from_samples(
    samples: Iterable[dict[str, Any]],
    instruction: str,
    max_pairs_per_problem: int = 2,
    seed: int = 0,
    rejected: str = "random",
) -> list[dict[str, str]]:
    """Up to `max_pairs_per_problem` (right, wrong) pairs per question, each sample in at most one pair; questions in
    the order of their first sample. The right answers are taken in random order, the wrong ones in random order or
    likeliest first (`rejected`, see the module doc). Deterministic in `seed`."""
    if max_pairs_per_problem < 1:
        raise ValueError(f"max_pairs_per_problem must be >= 1, got {max_pairs_per_problem}")
    if rejected not in REJECTED:
        raise ValueError(f"rejected must be one of {list(REJECTED)}, got {rejected!r}")
    needed = {"problem_index", "problem", "response", "reward", *(["mean_logprob"] if rejected == "likeliest" else [])}
    by_problem = _by_problem(samples, needed)
    rng = random.Random(seed)
    pairs: list[dict[str, str]] = []
    for group in by_problem.values():
        right = _distinct([s for s in group if s["reward"] > 0.5])
        wrong = _distinct([s for s in group if s["reward"] <= 0.5])
        rng.shuffle(right)
        rng.shuffle(wrong)
        if rejected == "likeliest":
            wrong.sort(key=lambda s: -s["mean_logprob"])  # stable: equal ones stay in their random order
        chosen, lost = [s["response"].strip() for s in right], [s["response"].strip() for s in wrong]
        prompt = f"{group[0]['problem']} {instruction}".strip()
        pairs += [{"prompt": prompt, "chosen": c, "rejected": r} for c, r in zip(chosen, lost)][:max_pairs_per_problem]
    return pairs


def _by_problem(samples: Iterable[dict[str, Any]], needed: set[str]) -> dict[int, list[dict[str, Any]]]:
    """The samples grouped by question, in the order of each question's first sample; each must hold `needed`."""
    by_problem: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for sample in samples:
        missing = needed - set(sample)
        if missing:
            raise ValueError(
                f"a sample lacks {sorted(missing)}: samples.jsonl of `mrl eval` has them (an older one "
                f"may lack mean_logprob: run `mrl eval` again, or pass --rejected random)"
            )
        by_problem[sample["problem_index"]].append(sample)
    return by_problem


def _distinct(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first sample of each distinct non-empty response, in order (the same text twice would make a pair its own
    twin)."""
    first: dict[str, dict[str, Any]] = {}
    for sample in samples:
        first.setdefault(sample["response"].strip(), sample)
    return [sample for text, sample in first.items() if text]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", required=True, help="samples.jsonl written by `mrl eval`")
    parser.add_argument("--out", required=True, help="pairs file to write (jsonl)")
    parser.add_argument("--instruction", default="", help="the data.instruction the eval ran with")
    parser.add_argument("--max-pairs-per-problem", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--rejected",
        choices=REJECTED,
        default="random",
        help="which wrong answers to pair: any (random) or the model's likeliest first",
    )
    args = parser.parse_args(argv)
    with open(args.samples, encoding="utf-8") as f:
        samples = [json.loads(line) for line in f if line.strip()]
    pairs = pairs_from_samples(samples, args.instruction, args.max_pairs_per_problem, args.seed, args.rejected)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(out, write_jsonl(pairs))
    questions = len({s["problem_index"] for s in samples})
    print(f"[mrl] {out}: {len(pairs)} pairs from {len(samples)} samples of {questions} questions", flush=True)
    return 0 if pairs else 1


if __name__ == "__main__":
    sys.exit(main())
