"""PPO's token-level math: per-token rewards, generalized advantage estimation over the response tokens only,
advantage whitening, the clipped value loss (as the critic's training loss, `ValueLoss`), and on-policy
distillation's per-token signal. The GRPO loop uses them with `grpo.advantage_estimator: gae` or a `distillation`
section (mrl/algorithms/ppo.py). Tensors [B, T] in the trainer's row layout (a row's prompt, then its response;
`mask` 1 on the tokens the policy generated, 0 on the prompt, on padding and on a multi-turn episode's observations).

    token_rewards     r_t = -kl_coef * kl_t on every response token, + the sequence's reward on its last one
    gae               delta_t = r_t + gamma * V(next) - V(t);  A_t = delta_t + gamma * lam * A(next)
                      "next" is the next response token of the row: masked tokens in between (an observation) are
                      skipped, as if the model's turns were one sequence; after the last one V(next) = 0, A(next) = 0
    returns           A_t + V(t): the value model's target
    whiten            (A - mean) / std over every masked token of the batch (the mean added back with shift_mean)
    value loss        0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2), averaged over masked tokens
    distillation      A_t = teacher logprob_t - student logprob_t (the per-token reverse KL's negative), masked
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch

#: Token data of the critic's training batch: the rollout's values (before the step's updates) and GAE's returns.
OLD_VALUES = "old_values"
RETURNS = "returns"


def token_rewards(
    rewards: torch.Tensor, mask: torch.Tensor, kl: Optional[torch.Tensor] = None, kl_coef: float = 0.0
) -> torch.Tensor:
    """[B, T]: each row's reward [B] on its last response token, minus kl_coef * kl [B, T] on every response token."""
    if rewards.shape != mask.shape[:1]:
        raise ValueError(f"rewards {tuple(rewards.shape)} must hold one value per row of mask {tuple(mask.shape)}")
    out = torch.zeros(mask.shape, dtype=torch.float32)
    if kl is not None and kl_coef:
        out -= kl_coef * kl.float() * mask
    positions = torch.arange(mask.shape[1]).expand_as(mask)
    last = torch.where(mask > 0, positions, torch.full_like(positions, -1)).amax(dim=1)  # [B]; -1: no response
    rows = torch.nonzero(last >= 0).squeeze(1)
    out[rows, last[rows]] += rewards[rows].float()
    return out


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both [B, T] and 0 off the mask (see the module docstring)."""
    if not (rewards.shape == values.shape == mask.shape):
        raise ValueError(f"rewards, values and mask differ in shape: {rewards.shape}, {values.shape}, {mask.shape}")
    advantages = torch.zeros(mask.shape, dtype=torch.float32)
    next_value = torch.zeros(mask.shape[0])
    next_advantage = torch.zeros(mask.shape[0])
    for t in reversed(range(mask.shape[1])):
        on = mask[:, t] > 0
        delta = rewards[:, t].float() + gamma * next_value - values[:, t].float()
        here = delta + gamma * lam * next_advantage
        advantages[:, t] = torch.where(on, here, torch.zeros_like(here))
        next_value = torch.where(on, values[:, t].float(), next_value)
        next_advantage = torch.where(on, here, next_advantage)
    returns = (advantages + values.float()) * (mask > 0)
    return advantages, returns


def whiten(advantages: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Advantages scaled to unit variance over the masked tokens (and centred unless shift_mean=False); 0 off the
    mask. The variance is the unbiased one over the masked tokens."""
    on = mask > 0
    count = on.sum()
    if count < 2:
        return advantages * on
    mean = advantages[on].mean()
    var = ((advantages[on] - mean) ** 2).sum() / (count - 1)
    out = (advantages - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * on


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip: float
) -> torch.Tensor:
    """The clipped value loss (see the module docstring): a scalar, the mean over the masked tokens."""
    unclipped, clipped = _value_errors(values, old_values, returns, clip)
    per_token = 0.5 * torch.maximum(unclipped, clipped)
    on = (mask > 0).to(per_token.dtype)
    return (per_token * on).sum() / on.sum().clamp(min=1)


def _value_errors(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: (V - R)^2 and (V_old + clip(V - V_old, -c, c) - R)^2."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return (values - returns) ** 2, (clipped - returns) ** 2


def distillation_advantages(
    teacher_logprobs: torch.Tensor, student_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """On-policy distillation's per-token advantage: log p_teacher(y_t) - log p_student(y_t) on the student's own
    samples (its expectation over the student's tokens is minus the reverse KL), 0 off the mask."""
    return (teacher_logprobs.float() - student_logprobs.float()) * (mask > 0)


def ppo_advantages(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    value_lam: Optional[float] = None,
    kl: Optional[torch.Tensor] = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) [B, T] of a batch: per-token rewards (`token_rewards`), GAE with `lam` for the policy's
    advantages and `value_lam` (VAPO's decoupled lambda; None = lam) for the critic's returns; the advantages are not
    whitened (the caller whitens them after reading their spread). `values` [B, T]: V of the state before each
    token."""
    per_token = token_rewards(rewards, mask, kl, kl_coef)
    advantages, returns = gae(per_token, values, mask, gamma, lam)
    if value_lam is not None and value_lam != lam:
        _, returns = gae(per_token, values, mask, gamma, value_lam)
    return advantages, returns


@dataclass(frozen=True)
class ValueLoss:
    """The critic's loss per micro-batch (a `mrl.policy.interface.PolicyLoss`): `clipped_value_loss` summed over the
    micro-batch's masked tokens and divided by the step's global token count, so micro-batches and ranks add up to
    the batch mean. `values` [b, T'] are the score head's outputs at the predicting positions, aligned (like the
    batch's shifted token data) with the token each position precedes."""

    clip: float
    level: Literal["token", "sequence"] = "token"

    def __call__(
        self, logprobs: torch.Tensor, batch: dict[str, torch.Tensor], global_count: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        values = logprobs  # a score-head model's trainer hands its values where a language model's logprobs go
        on = (batch["loss_mask"] > 0).to(values.dtype)
        old, target = batch[OLD_VALUES].to(values.dtype), batch[RETURNS].to(values.dtype)
        unclipped_loss, clipped_loss = _value_errors(values, old, target, self.clip)
        per_token = 0.5 * torch.maximum(unclipped_loss, clipped_loss)
        loss = (per_token * on).sum() / global_count
        with torch.no_grad():
            mean = lambda v: (v.to(values.dtype) * on).sum() / global_count  # noqa: E731
            metrics = {
                "value_loss": loss.detach(),
                "value_clip_fraction": mean(clipped_loss > unclipped_loss),
                "value_mean": mean(values),
                "num_valid_tokens": on.sum(),
            }
        return loss, metrics
