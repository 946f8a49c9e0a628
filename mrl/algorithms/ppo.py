"""PPO's and on-policy distillation's per-token advantages, for GRPO's loop (mrl/algorithms/grpo.py `learn`).

PPO (`grpo.advantage_estimator: gae`; Schulman et al. 2017, GAE of Schulman et al. 2016), on the step's samples:
    V_t      the critic's value of the state before response token t: its score head read at the token before
    r_t      -kl_coef * (log pi_old(y_t) - log pi_ref(y_t)) on every response token, + the sample's reward on its last
    A_t, R_t GAE(gamma, lam) over the response tokens, a multi-turn episode's observations skipped; R_t = A_t + V_t
             with ppo.value_lam (VAPO's decoupled lambda; default lam); A whitened over the step's response tokens
The critic trains first, on R with the clipped value loss (ppo.value_clip around the rollout's V), one optimizer step
per `policy.train_global_batch_size` rows like the policy; then the policy trains on A with GRPO's clipped surrogate
(the `loss` section). The first `ppo.critic_warmup_steps` steps train the critic only: the policy's weights stay.
Reported: train/critic/{value_loss, value_clip_fraction, value_mean, grad_norm, ...}, train/critic/explained_variance
(1 - Var(R - V) / Var(R) over the step's response tokens, before the update) and train/advantage_std (before
whitening).

On-policy distillation (a `distillation` section; Agarwal et al. 2024's on-policy GKD with the reverse KL, as in
Thinking Machines' "On-policy distillation", 2025): the student (the policy) samples, the frozen teacher scores the
sampled tokens, and every response token's advantage is
    A_t = kl_weight * (log p_teacher(y_t) - log p_student(y_t)) + reward_weight * A_grpo(sample)
where log p_student is the trainer's pi_old (a logprob pass of its own) and A_grpo the sample's GRPO advantage. With
the clipped surrogate and one update per step, the gradient is kl_weight times minus the gradient of the per-token
reverse KL(student || teacher) estimated on the student's own tokens (a sampled, not exact, KL: no sum over the
vocabulary). Reported: train/distill/reverse_kl (mean over response tokens of log p_student - log p_teacher) and
train/distill/teacher_logprob.

Departures: PPO and distillation keep every sample with a response token (no group filtering, so
num_generations_per_prompt may be 1); one epoch over the samples; no entropy bonus.
"""

from __future__ import annotations

import torch

from mrl.algorithms.updates import train_in_minibatches
from mrl.config.schema import MrlConfig
from mrl.objectives.loss import ADVANTAGES, PREV_LOGPROBS, REF_LOGPROBS
from mrl.objectives.ppo import OLD_VALUES, RETURNS, ValueLoss, distillation_advantages, ppo_advantages, whiten
from mrl.policy.interface import RankBatch, TrainablePolicy


def needs_old_logprobs(cfg: MrlConfig) -> bool:
    """Whether the step's advantages read pi_old before training (the KL reward, the distillation signal)."""
    return cfg.distillation is not None or needs_reference(cfg)


def needs_reference(cfg: MrlConfig) -> bool:
    """Whether PPO's per-token reward needs the reference policy's logprobs."""
    return cfg.grpo.advantage_estimator == "gae" and cfg.ppo.kl_coef > 0


def token_values(critic: TrainablePolicy, batch: RankBatch) -> torch.Tensor:
    """[N, T] V of the state before each token (the critic's score at the token before; 0 off the loss mask)."""
    scores = critic.logprobs(batch)  # [N, T]: position t reads the hidden state of token t
    values = torch.zeros_like(scores, dtype=torch.float32)
    values[:, 1:] = scores[:, :-1].float()
    return values * (batch.loss_mask > 0)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over the masked tokens (1: the critic predicts the returns; 0: no better than their
    mean; nan when the returns do not vary)."""
    on = mask > 0
    if int(on.sum()) < 2:
        return float("nan")
    target = returns[on].double()
    spread = target.var()
    return float("nan") if spread == 0 else float(1 - (target - values[on].double()).var() / spread)


def gae_step(
    cfg: MrlConfig, critic: TrainablePolicy, batch: RankBatch, rewards: torch.Tensor, rows_per_update: int
) -> dict[str, float]:
    """PPO's advantages into `batch.token_data` (replacing the per-sample ones) and one pass of critic updates on
    the returns; the step's metrics. `rewards` [N]: each row's reward (padding rows have an empty loss mask)."""
    ppo = cfg.ppo
    mask = batch.loss_mask
    values = token_values(critic, batch)
    kl = None
    if ppo.kl_coef > 0:
        kl = (batch.token_data[PREV_LOGPROBS] - batch.token_data[REF_LOGPROBS]) * (mask > 0)
    advantages, returns = ppo_advantages(
        rewards,
        values,
        mask,
        gamma=ppo.gamma,
        lam=ppo.lam,
        value_lam=ppo.value_lam,
        kl=kl,
        kl_coef=ppo.kl_coef,
    )
    on = mask > 0
    m = {
        "train/critic/explained_variance": explained_variance(values, returns, mask),
        "train/advantage_std": float(advantages[on].std()) if int(on.sum()) > 1 else 0.0,
        "train/return_mean": float(returns[on].mean()) if bool(on.any()) else 0.0,
    }
    if ppo.whiten_advantages:
        advantages = whiten(advantages, mask)
    batch.token_data[ADVANTAGES] = advantages
    rows = RankBatch(batch.input_ids, mask, {OLD_VALUES: values, RETURNS: returns}, lengths=batch.lengths)
    trained = train_in_minibatches(critic, rows, ValueLoss(ppo.value_clip), rows_per_update)
    m.update({f"train/critic/{k}": v for k, v in trained.items() if k not in ("loss", "num_valid_tokens", "time_s")})
    return m


def distillation_step(cfg: MrlConfig, teacher: TrainablePolicy, batch: RankBatch) -> dict[str, float]:
    """Distillation's per-token advantages into `batch.token_data` (the teacher's logprobs of the student's tokens
    against the student's pi_old, plus reward_weight times the per-sample advantage already there); the metrics."""
    distill = cfg.distillation
    assert distill is not None, "distillation_step runs with a distillation section"
    mask = batch.loss_mask
    teacher_lp = teacher.logprobs(batch)
    student_lp = batch.token_data[PREV_LOGPROBS]
    signal = distillation_advantages(teacher_lp, student_lp, mask)
    on = mask > 0
    tokens = max(int(on.sum()), 1)
    metrics = {
        "train/distill/reverse_kl": float((-signal).sum()) / tokens,
        "train/distill/teacher_logprob": float((teacher_lp.float() * on).sum()) / tokens,
    }
    reward_part = batch.token_data[ADVANTAGES] * on  # GRPO's per-sample advantage, on the response tokens
    batch.token_data[ADVANTAGES] = distill.kl_weight * signal + distill.reward_weight * reward_part
    return metrics


def in_critic_warmup(cfg: MrlConfig, step: int) -> bool:
    """Whether step `step` trains the critic only."""
    return cfg.grpo.advantage_estimator == "gae" and step <= cfg.ppo.critic_warmup_steps
