"""Group-relative advantages and the reward-level tricks of DAPO. Pure tensor math: no I/O, no Ray, no devices.

GRPO (Shao et al. 2024, DeepSeekMath), for a prompt with G sampled responses and scalar rewards r_1..r_G:

    A_i = (r_i - b_i) / (s_i + eps)        where s_i > 0
    A_i =  r_i - b_i                       where s_i == 0 (a constant group carries no signal to normalise)

    plain GRPO:      b_i = mean(r_1..r_G)            s_i = unbiased std(r_1..r_G)
    leave-one-out:   b_i = mean(r_j, j != i)         s_i = unbiased std(r_j, j != i)   (RLOO baseline)
    Dr.GRPO:         b_i = mean(r_1..r_G), no division (Liu et al. 2025, "Understanding R1-Zero-like training")

The advantage of response i is broadcast to all of its tokens by the loss.

Departures from the papers, on purpose:
- GRPO divides by the population std and by (std + eps) everywhere; we use the unbiased std and leave the
  advantage undivided where the std is exactly 0 (a group whose other samples all agree), so eps never blows a
  tiny difference up into a huge advantage.
- With leave-one-out the std is taken over the same "other" samples as the baseline (NeMo-RL's choice); with
  G = 2 that std is undefined (one sample) and counts as 0, so the advantage is the plain difference.

DAPO (Yu et al. 2025) reward-level pieces:
- overlong shaping:  R_len(L) = 0                                  if L <= L_max - buffer
                              = -penalty * (L - (L_max - buffer)) / buffer   if L_max - buffer < L <= L_max
                              = -penalty                           if L > L_max
  added to the task reward (L = response tokens, L_max = the generation limit).
- dynamic sampling: groups whose rewards are all equal have zero advantage and are dropped. DAPO then samples
  more prompts until the batch is full; here we only return the kept indices and leave refilling to the driver.
"""

from __future__ import annotations

import torch


def grpo_advantages(
    rewards: torch.Tensor, *, leave_one_out: bool = True, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Per-response advantages from rewards [num_prompts, group_size]; returns the same shape (float32)."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_prompts, group_size], got shape {tuple(rewards.shape)}")
    rewards = rewards.float()
    group = rewards.shape[1]
    if leave_one_out:
        if group < 2:
            raise ValueError(
                "leave-one-out needs at least 2 responses per prompt (grpo.num_generations_per_prompt "
                ">= 2); set grpo.leave_one_out=false for a single response"
            )
        baseline, std = _leave_one_out_stats(rewards)  # [P, G] each
    else:
        baseline = rewards.mean(dim=1, keepdim=True).expand_as(rewards)
        std = _unbiased_std(rewards.unsqueeze(1), torch.ones_like(rewards).unsqueeze(1)).expand_as(rewards)
    centered = rewards - baseline
    if not normalize_std:
        return centered
    return torch.where(std > 0, centered / (std + eps), centered)


def _leave_one_out_stats(rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and unbiased std of the OTHER samples of each group, both [P, G]."""
    group = rewards.shape[1]
    others = (1.0 - torch.eye(group, dtype=rewards.dtype)).unsqueeze(0)  # [1, G, G]: row i selects j != i
    values = rewards.unsqueeze(1).expand(-1, group, -1)  # [P, G, G]: row i = the whole group
    mean = (values * others).sum(dim=2) / (group - 1)
    return mean, _unbiased_std(values, others.expand_as(values))


def _unbiased_std(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Unbiased std over the last dim of the entries where weights == 1 (0 with fewer than 2). [..., K] -> [...]"""
    count = weights.sum(dim=-1)
    mean = (values * weights).sum(dim=-1) / count.clamp(min=1)
    var = (((values - mean.unsqueeze(-1)) ** 2) * weights).sum(dim=-1) / (count - 1).clamp(min=1)
    return torch.where(count > 1, var.sqrt(), torch.zeros_like(var))


def overlong_penalty(
    response_lengths: torch.Tensor, *, max_length: int, buffer: int, penalty: float = 1.0
) -> torch.Tensor:
    """DAPO soft overlong punishment for responses of `response_lengths` [N] tokens; returns [N] (<= 0) to add to
    the rewards. `buffer` = 0 turns it off (all zeros)."""
    lengths = response_lengths.float()
    if buffer <= 0:
        return torch.zeros_like(lengths)
    if buffer > max_length:
        raise ValueError(f"grpo.overlong_buffer ({buffer}) must not exceed the response length limit ({max_length})")
    start = max_length - buffer
    ramp = -penalty * (lengths - start).clamp(min=0) / buffer
    return torch.where(lengths > max_length, torch.full_like(lengths, -penalty), ramp)


def dynamic_sampling_keep(rewards: torch.Tensor) -> torch.Tensor:
    """Indices (int64, ascending) of the prompts whose group rewards [num_prompts, group_size] are not all equal."""
    spread = rewards.max(dim=1).values - rewards.min(dim=1).values
    return torch.nonzero(spread != 0, as_tuple=False).flatten()


def expand_group_indices(prompt_indices: torch.Tensor, group_size: int) -> torch.Tensor:
    """Prompt indices -> the indices of their responses in a flat [num_prompts * group_size] batch whose groups are
    contiguous (response j of prompt p sits at p * group_size + j)."""
    offsets = torch.arange(group_size, dtype=torch.long)
    return (prompt_indices.long().unsqueeze(1) * group_size + offsets).flatten()
