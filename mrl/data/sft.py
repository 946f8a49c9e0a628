"""Supervised examples as token ids with a loss mask on the response (the SFT warm-up and the SFT command).

Layout (the policy's convention: a mask value sits on the token it scores):
    input_ids  [N, T]  prompt tokens, response tokens, the end of the turn, then right padding
    loss_mask  [N, T]  1 on the response tokens and the turn's end (the model must learn to stop), 0 elsewhere
The end of the turn is the template's (`PromptTemplate.turn_end_id`: the chat template's end-of-turn token, e.g.
Llama-3's <|eot_id|>, or EOS for plain prompts). A row longer than `max_length` keeps its first `max_length` tokens
(its response loses its end) and is counted in `num_truncated`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from mrl.config.errors import ConfigError
from mrl.data.templates import PromptTemplate


@dataclass
class SFTBatch:
    input_ids: torch.Tensor  # [N, T] int64
    loss_mask: torch.Tensor  # [N, T] float32
    lengths: torch.Tensor  # [N] real tokens per row
    num_truncated: int = 0  # rows cut to max_length


def build_sft_batch(
    prompts: Sequence[str],
    targets: Sequence[str],
    tokenizer: Any,
    template: PromptTemplate,
    max_length: Optional[int] = None,
) -> SFTBatch:
    """Tokenise (prompt, target) pairs; the target is tokenised on its own so the prompt/response boundary is
    exact (no merge across it), and the end-of-turn token is appended."""
    if len(prompts) != len(targets):
        raise ValueError(f"{len(prompts)} prompts but {len(targets)} targets")
    turn_end = template.turn_end_id(tokenizer)
    if turn_end is None:
        raise ConfigError(
            "the tokenizer has neither an EOS token nor an end-of-turn token of its chat template: SFT "
            "appends one to every target to teach the model to stop",
            key="policy.tokenizer",
            fix="use a tokenizer with eos_token set (tokenizer_config.json's eos_token), or set "
            "policy.tokenizer to one that has it",
        )
    prompt_ids, _ = template.encode(prompts, tokenizer)
    rows, masks, truncated = [], [], 0
    for p_ids, target in zip(prompt_ids, targets):
        r_ids = list(tokenizer(target, add_special_tokens=False)["input_ids"]) + [turn_end]
        row, mask = p_ids + r_ids, [0.0] * len(p_ids) + [1.0] * len(r_ids)
        if max_length is not None and len(row) > max_length:
            row, mask, truncated = row[:max_length], mask[:max_length], truncated + 1
        rows.append(row)
        masks.append(mask)
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, (ids, mask) in enumerate(zip(rows, masks)):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        loss_mask[i, : len(mask)] = torch.tensor(mask)
    return SFTBatch(input_ids, loss_mask, torch.tensor([len(r) for r in rows]), truncated)
