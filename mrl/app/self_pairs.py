"""Preference pairs from a model's own answers: chosen = one of its right answers, rejected = one of its wrong answers
to the same question (`python -m mrl.app.self_pairs --samples S --out P --instruction I`).

    mrl eval (eval.num_samples > 1, temperature > 0)  -->  samples.jsonl   (every sample: problem, response, reward)
    samples.jsonl  --pairs_from_samples-->  pairs.jsonl   {"prompt": "<problem> <instruction>", "chosen", "rejected"}

The pairs are what `mrl dpo` reads (`data.train`, `data.val`; mrl.data.preferences). A question the model answers
always right or always wrong gives no pair. The prompt is the user turn the eval gave the model (problem, a space,
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


def pairs_from_samples(samples: Iterable[dict[str, Any]], instruction: str, max_pairs_per_problem: int = 2,
                       seed: int = 0) -> list[dict[str, str]]:
    """Up to `max_pairs_per_problem` (right, wrong) pairs per question, each sample in at most one pair; questions in
    the order of their first sample. Deterministic in `seed` (which right and wrong answers are paired)."""
    if max_pairs_per_problem < 1:
        raise ValueError(f"max_pairs_per_problem must be >= 1, got {max_pairs_per_problem}")
    by_problem: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for sample in samples:
        missing = {"problem_index", "problem", "response", "reward"} - set(sample)
        if missing:
            raise ValueError(f"a sample lacks {sorted(missing)}: samples.jsonl of `mrl eval` has them")
        by_problem[sample["problem_index"]].append(sample)
    rng = random.Random(seed)
    pairs = []
    for group in by_problem.values():
        right = _distinct([s for s in group if s["reward"] > 0.5])
        wrong = _distinct([s for s in group if s["reward"] <= 0.5])
        rng.shuffle(right)
        rng.shuffle(wrong)
        prompt = f"{group[0]['problem']} {instruction}".strip()
        pairs += [{"prompt": prompt, "chosen": c, "rejected": r}
                  for c, r in zip(right, wrong)][:max_pairs_per_problem]
    return pairs


def _distinct(samples: list[dict[str, Any]]) -> list[str]:
    """The distinct non-empty responses, in order (the same text twice would make a pair its own twin)."""
    return list(dict.fromkeys(s["response"].strip() for s in samples if s["response"].strip()))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", required=True, help="samples.jsonl written by `mrl eval`")
    parser.add_argument("--out", required=True, help="pairs file to write (jsonl)")
    parser.add_argument("--instruction", default="", help="the data.instruction the eval ran with")
    parser.add_argument("--max-pairs-per-problem", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    with open(args.samples, encoding="utf-8") as f:
        samples = [json.loads(line) for line in f if line.strip()]
    pairs = pairs_from_samples(samples, args.instruction, args.max_pairs_per_problem, args.seed)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(out, write_jsonl(pairs))
    questions = len({s["problem_index"] for s in samples})
    print(f"[mrl] {out}: {len(pairs)} pairs from {len(samples)} samples of {questions} questions", flush=True)
    return 0 if pairs else 1


if __name__ == "__main__":
    sys.exit(main())
