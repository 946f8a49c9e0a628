"""`mrl score`: per-token log-probabilities and perplexity of texts under the Megatron model, any parallel layout.

Input rows (jsonl), one of:
    {"text": "..."}                                   every token after the first is scored
    {"prompt": "...", "completion": "..."}            only the completion's tokens are scored (the prompt conditions)
    {"input_ids": [...], "num_prompt_tokens": k}      token ids; tokens from position max(k, 1) on are scored
A token-id row may carry "routed_experts": [tokens][layers][k], the experts an engine routed its first tokens to
(vLLM's routed-experts output; a mixture-of-experts policy). The policy then counts, per MoE layer, the tokens whose
top-k expert set it chooses differently (with `policy.moe.router_replay: replay` it also routes them so), and the
summary holds `moe_routing_differs/layer_<i>`: where a diverging run's engine and trainer part, layer by layer.
Output rows (jsonl, same order): {"index", "num_scored_tokens", "token_ids", "logprobs" (one per scored token),
"sum_logprob", "perplexity" = exp(-mean logprob)}. A row that cannot be read is reported with an "error" and skipped
from the batch, never fatal; a file that is not UTF-8 text, or token ids outside the model's vocabulary (ids of
another tokenizer), end the command before any worker starts (mrl/app/preflight.py `check_score_rows`). Useful for
evaluation, and to check a rollout engine's logprobs against the trainer's.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from mrl.data.datasets import not_utf8_error
from mrl.inference.interface import routing_rows
from mrl.model.router_replay import disagreement_metrics
from mrl.policy.interface import RankBatch, TrainablePolicy

ROWS_PER_CALL = 64


@dataclass(frozen=True)
class ScoreRow:
    """One input line: its token ids and first scored position, or the error that made it unusable."""

    index: int
    ids: Optional[list[int]]
    start: int = 0
    error: str = ""
    routing: Optional[torch.Tensor] = None  # [tokens, layers, k] an engine's experts of the first tokens


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


def _routing(row: dict, tokens: int) -> Optional[torch.Tensor]:
    """A row's "routed_experts" as [n, layers, k] int16 (n <= its tokens), or None."""
    if "routed_experts" not in row:
        return None
    if "input_ids" not in row:
        raise ValueError("routed_experts belong to token ids: give the row's input_ids")
    routing = torch.tensor(row["routed_experts"], dtype=torch.int16)
    if routing.dim() != 3 or len(routing) > tokens:
        raise ValueError(
            f"routed_experts must be [tokens][layers][k] for at most the row's {tokens} tokens, got "
            f"shape {list(routing.shape)}"
        )
    return routing


def _read_rows(path: Path, tokenizer: Any, limit: int) -> list[ScoreRow]:
    """Every line's row (unusable ones with their error)."""
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark (Windows editors write one) is not a row
    except UnicodeDecodeError as error:
        raise not_utf8_error(path, "--input", parquet=False) from error
    rows = []
    for index, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            ids, start = _encode(row, tokenizer)
            if len(ids) < 2 or start >= len(ids):
                raise ValueError("nothing to score (fewer than 2 tokens, or no token after the prompt)")
            if len(ids) > limit:
                raise ValueError(f"{len(ids)} tokens exceed policy.max_total_sequence_length={limit}")
            rows.append(ScoreRow(index, ids, start, routing=_routing(row, len(ids))))
        except (ValueError, TypeError, KeyError, RuntimeError) as error:
            rows.append(ScoreRow(index, None, error=str(error)))
    return rows


def _ids(row: ScoreRow) -> list[int]:
    """A readable row's token ids (`score_rows` passes only rows whose ids were read)."""
    assert row.ids is not None, f"row {row.index} is unreadable: {row.error}"
    return row.ids


def _score_batch(policy: TrainablePolicy, batch: list[ScoreRow], pad_id: int) -> list[torch.Tensor]:
    dp = policy.data_parallel_size
    rows = batch + [batch[0]] * (-len(batch) % dp)  # every data-parallel rank needs rows; extras are dropped
    width = max(len(_ids(r)) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width))
    for i, row in enumerate(rows):
        ids[i, : len(_ids(row))] = torch.tensor(_ids(row))
        mask[i, row.start : len(_ids(row))] = 1
    lengths = torch.tensor([len(_ids(r)) for r in rows])
    extra: list[Optional[torch.Tensor]] = [None] * (len(rows) - len(batch))  # extra rows route freshly, uncounted
    routing = routing_rows([r.routing for r in batch] + extra, width)
    logprobs = policy.logprobs(RankBatch(ids, mask, lengths=lengths, routing=routing))  # [B, T]
    return [logprobs[i, row.start : len(_ids(row))] for i, row in enumerate(batch)]


def read_inputs(input_path: str, tokenizer: Any, max_length: int) -> list[ScoreRow]:
    """The rows of the --input file (checked before any worker starts)."""
    source = Path(input_path)
    if not source.is_file():
        raise FileNotFoundError(f"--input {input_path}: no such file")
    return _read_rows(source, tokenizer, max_length)


def score_rows(policy: Any, rows: list[ScoreRow], pad_id: int) -> tuple[dict[int, torch.Tensor], dict[str, float]]:
    """(logprobs of the scored tokens of every readable row by row index, the per-layer routing disagreement of
    the rows that carry routed_experts: {} when none does)."""
    good = [r for r in rows if r.ids is not None]
    scored: dict[int, torch.Tensor] = {}
    counts = None
    for start in range(0, len(good), ROWS_PER_CALL):
        chunk = good[start : start + ROWS_PER_CALL]
        scored.update(zip((r.index for r in chunk), _score_batch(policy, chunk, pad_id)))
        if any(r.routing is not None for r in chunk):
            part = policy.routing_counts()
            counts = part if counts is None else counts + part
        print(f"[mrl score] {min(start + ROWS_PER_CALL, len(good))}/{len(good)} rows", file=sys.stderr)
    return scored, ({} if counts is None else disagreement_metrics(counts))


def write_scores(
    out_path: str, rows: list[ScoreRow], scored: dict[int, torch.Tensor], routing: Optional[dict[str, float]] = None
) -> dict[str, float]:
    """The output file (see the module docstring) and the corpus summary (with the per-layer routing disagreement
    when rows carried routed_experts)."""
    total_lp, total_tokens = 0.0, 0
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    with open(out_path, "w") as out:
        for row in rows:
            if row.ids is None:
                out.write(json.dumps({"index": row.index, "error": row.error}) + "\n")
                continue
            lp = scored[row.index]
            total_lp += float(lp.double().sum())
            total_tokens += len(lp)
            out.write(
                json.dumps(
                    {
                        "index": row.index,
                        "num_scored_tokens": len(lp),
                        "token_ids": row.ids[row.start :],
                        "logprobs": lp.tolist(),
                        "sum_logprob": float(lp.double().sum()),
                        "perplexity": math.exp(-float(lp.double().mean())),
                    }
                )
                + "\n"
            )
    skipped = sum(1 for r in rows if r.ids is None)
    summary = {
        "rows": float(len(rows)),
        "rows_skipped": float(skipped),
        "perplexity": math.exp(-total_lp / total_tokens) if total_tokens else float("nan"),
        **(routing or {}),
    }
    print(
        f"[mrl score] {len(rows) - skipped} rows scored, {skipped} skipped; corpus perplexity "
        f"{summary['perplexity']:.4f} -> {out_path}",
        file=sys.stderr,
    )
    for name, value in (routing or {}).items():
        print(f"[mrl score] {name}: {value:.4f}", file=sys.stderr)
    return summary
