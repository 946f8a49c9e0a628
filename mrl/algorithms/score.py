"""`mrl score`: per-token log-probabilities and perplexity of texts under the Megatron model, any parallel layout.

Input rows (jsonl), one of:
    {"text": "..."}                                   every token after the first is scored
    {"prompt": "...", "completion": "..."}            only the completion's tokens are scored (the prompt conditions)
    {"input_ids": [...], "num_prompt_tokens": k}      token ids; tokens from position max(k, 1) on are scored
Output rows (jsonl, same order): {"index", "num_scored_tokens", "token_ids", "logprobs" (one per scored token),
"sum_logprob", "perplexity" = exp(-mean logprob)}. A row that cannot be read is reported with an "error" and skipped
from the batch, never fatal. Useful for evaluation, and to check a rollout engine's logprobs against the trainer's.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Optional

import torch

from mrl.policy.interface import RankBatch, TrainablePolicy

ROWS_PER_CALL = 64


def _encode(row: Any, tokenizer: Any) -> tuple[list[int], int]:
    """(token ids, index of the first scored token) of one input row; ValueError for an unusable row."""
    if not isinstance(row, dict):
        raise ValueError("a row must be a JSON object")
    if "input_ids" in row:
        ids = [int(t) for t in row["input_ids"]]
        return ids, max(1, int(row.get("num_prompt_tokens", 0)))
    if "prompt" in row and "completion" in row:
        prompt = tokenizer(str(row["prompt"]))["input_ids"]
        completion = tokenizer(str(row["completion"]), add_special_tokens=False)["input_ids"]
        return list(prompt) + list(completion), max(1, len(prompt))
    if "text" in row:
        return list(tokenizer(str(row["text"]))["input_ids"]), 1
    raise ValueError("a row needs 'text', 'prompt' + 'completion', or 'input_ids'")


def _read_rows(path: Path, tokenizer: Any, limit: int) -> list[tuple[int, Optional[list[int]], int, str]]:
    """(index, token ids or None, first scored position, error) of every line."""
    rows = []
    for index, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            ids, start = _encode(json.loads(line), tokenizer)
            if len(ids) < 2 or start >= len(ids):
                raise ValueError("nothing to score (fewer than 2 tokens, or no token after the prompt)")
            if len(ids) > limit:
                raise ValueError(f"{len(ids)} tokens exceed policy.max_total_sequence_length={limit}")
            rows.append((index, ids, start, ""))
        except (ValueError, TypeError, KeyError) as error:
            rows.append((index, None, 0, str(error)))
    return rows


def _score_batch(policy: TrainablePolicy, batch: list[tuple[int, list[int], int, str]],
                 pad_id: int) -> list[torch.Tensor]:
    dp = policy.data_parallel_size
    rows = batch + [batch[0]] * (-len(batch) % dp)  # every data-parallel rank needs rows; extras are dropped
    width = max(len(ids) for _, ids, _, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width))
    for r, (_, tokens, start, _) in enumerate(rows):
        ids[r, : len(tokens)] = torch.tensor(tokens)
        mask[r, start: len(tokens)] = 1
    lengths = torch.tensor([len(tokens) for _, tokens, _, _ in rows])
    logprobs = policy.logprobs(RankBatch(ids, mask, lengths=lengths))  # [B, T]
    return [logprobs[r, start: len(tokens)] for r, (_, tokens, start, _) in enumerate(batch)]


def read_inputs(input_path: str, tokenizer: Any, max_length: int) -> list[tuple[int, Optional[list[int]], int, str]]:
    """The rows of the --input file (checked before any worker starts)."""
    source = Path(input_path)
    if not source.is_file():
        raise FileNotFoundError(f"--input {input_path}: no such file")
    return _read_rows(source, tokenizer, max_length)


def score_rows(policy: TrainablePolicy, rows: list[tuple[int, Optional[list[int]], int, str]],
               pad_id: int) -> dict[int, torch.Tensor]:
    """Logprobs of the scored tokens of every readable row, by row index."""
    good = [r for r in rows if r[1] is not None]
    scored: dict[int, torch.Tensor] = {}
    for start in range(0, len(good), ROWS_PER_CALL):
        chunk = good[start: start + ROWS_PER_CALL]
        scored.update(zip((r[0] for r in chunk), _score_batch(policy, chunk, pad_id)))  # type: ignore[arg-type]
        print(f"[mrl score] {min(start + ROWS_PER_CALL, len(good))}/{len(good)} rows", file=sys.stderr)
    return scored


def write_scores(out_path: str, rows: list[tuple[int, Optional[list[int]], int, str]],
                 scored: dict[int, torch.Tensor]) -> dict[str, float]:
    """The output file (see the module docstring) and the corpus summary."""
    total_lp, total_tokens = 0.0, 0
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    with open(out_path, "w") as out:
        for index, ids, first, error in rows:
            if ids is None:
                out.write(json.dumps({"index": index, "error": error}) + "\n")
                continue
            lp = scored[index]
            total_lp += float(lp.double().sum())
            total_tokens += len(lp)
            out.write(json.dumps({"index": index, "num_scored_tokens": len(lp), "token_ids": ids[first:],
                                  "logprobs": lp.tolist(), "sum_logprob": float(lp.double().sum()),
                                  "perplexity": math.exp(-float(lp.double().mean()))}) + "\n")
    skipped = sum(1 for r in rows if r[1] is None)
    summary = {"rows": float(len(rows)), "rows_skipped": float(skipped),
               "perplexity": math.exp(-total_lp / total_tokens) if total_tokens else float("nan")}
    print(f"[mrl score] {len(rows) - skipped} rows scored, {skipped} skipped; corpus perplexity "
          f"{summary['perplexity']:.4f} -> {out_path}", file=sys.stderr)
    return summary
