"""Batches the policy tests train on."""

from __future__ import annotations

import torch


def long_tail_batch(
    lengths: list[int], width: int, prompt: int, vocab: int = 200, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [n, width] (pad id 0 past each length), a loss mask on the response tokens (after the first `prompt`
    tokens, at least the last token), and per-sequence advantages broadcast over the tokens; n = len(lengths)."""
    g = torch.Generator().manual_seed(seed)
    n = len(lengths)
    ids = torch.randint(2, vocab, (n, width), generator=g)
    mask = torch.zeros(n, width)
    for i, length in enumerate(lengths):
        ids[i, length:] = 0
        mask[i, min(prompt, length - 1) : length] = 1
    adv = torch.randn(n, generator=g)[:, None].expand(n, width).contiguous()
    return ids, mask, adv
