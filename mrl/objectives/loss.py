"""Policy losses: clipped policy gradient, KL penalty, engine/trainer importance-sampling correction, NLL.

Pure tensor math (no I/O, no process groups). Notation per response token t of sequence b, m = the loss mask:
    lp      log pi_theta(y_t)          logprobs being trained (differentiable)
    old     log pi_old(y_t)            trainer-side logprobs before this step's updates ("prev_logprobs")
    gen     log pi_engine(y_t)         the rollout engine's logprobs of the same tokens ("generation_logprobs")
    ref     log pi_ref(y_t)            the frozen reference ("ref_logprobs")
    A       advantage of the sequence (or of the token)

GRPO objective minimised here (Shao et al. 2024, with DAPO's asymmetric clip and optional dual clip):
    r_t      = exp(lp - old)
    pg_t     = -min(r_t * A, clip(r_t, 1 - clip_low, 1 + clip_high) * A)
    pg_t     = min(pg_t, -c * A)  where A < 0 and dual_clip = c > 1            (Ye et al. 2020, dual-clip PPO)
    kl_t     = k(lp, ref)         k1: x;  k2: x^2 / 2;  k3: exp(-x) - 1 + x;   x = lp - ref   (Schulman's estimators)
    w_t      = 1                                       importance_sampling = "none"
             = min(exp(old - gen), cap)                "tis"    (truncated IS, Yao et al. 2025)
             = exp(old - gen) if low <= . <= high else 0   "icepop" (IcePop, Ring-1T 2025: masked IS)
    loss_t   = w_t * (pg_t + beta * kl_t)
    L        = sum_{b,t} m * loss_t / N_tokens                                   level "token" (DAPO)
             = sum_b [ sum_t m * loss_t / n_b ] / N_sequences                     level "sequence" (GRPO paper)

GSPO (Zheng et al. 2025, Group Sequence Policy Optimization), `ratio_level = "sequence"`: one importance ratio per
sequence, the geometric mean of its token ratios, clipped per sequence (published ranges clip_low 3e-4, clip_high
4e-4), at level "sequence":
    s_b      = exp( sum_t m * (lp - old) / n_b )        n_b = the whole sequence's valid tokens (also under CP)
    r_t      = sg[s_b] * exp(lp - sg[lp])               GSPO-token's form: r_t = s_b in value, d r_t / d lp_t = s_b
    pg_t     as above with r_t; every token of a sequence has the same ratio, so the clip acts per sequence
With sequence-level advantages and level "sequence", sum_t pg_t / n_b has GSPO's value and gradient
(-A_b s_b / n_b per token where unclipped, 0 where clipped). The IS weights w_t and the KL term stay per token.

Normalisation contract (why micro-batching, packing and sharding never change the gradient): a loss object is
called once per micro-batch with the GLOBAL count of the whole step (N_tokens, or N_sequences that have at least
one valid token) and returns `sum over its own tokens / global count`; the sum of its outputs over all
micro-batches and ranks is exactly L. Under context parallelism a rank holds part of a sequence, so sequence level
reads the whole sequence's token count n_b from `batch["seq_num_tokens"]` when given.

Departures, on purpose:
- The log-ratio inside the KL estimators is clamped to +-20 and the estimate to +-10 (one bad token cannot blow up
  the step); the PPO ratio itself is not clamped (the clip and dual clip bound its effect).
- IS weights are computed from the trainer's `old` logprobs (no gradient) and multiply the KL term too: both are
  expectations over the trainer policy estimated with the engine's samples.
- Without `prev_logprobs` the loss is strictly on-policy: old = lp.detach(), so r_t = 1 and the gradient is the
  plain policy gradient (saves a logprob pass when each batch is used for exactly one optimizer step).
- Metrics are weighted like the loss (token level: mean over valid tokens; sequence level: mean of per-sequence
  means), so that they too sum over micro-batches and ranks to the batch value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping, Optional

import torch

Level = Literal["token", "sequence"]
RatioLevel = Literal["token", "sequence"]
KLKind = Literal["k1", "k2", "k3"]
ISKind = Literal["none", "tis", "icepop"]

LOG_RATIO_CLAMP = 20.0
KL_CLAMP = 10.0

# Keys of the batch dict a loss object reads (token data is [b, T], sequence data [b]).
LOSS_MASK = "loss_mask"
ADVANTAGES = "advantages"
PREV_LOGPROBS = "prev_logprobs"
GENERATION_LOGPROBS = "generation_logprobs"
REF_LOGPROBS = "ref_logprobs"
SEQ_NUM_TOKENS = "seq_num_tokens"
SEQ_LOG_RATIO_SUM = "seq_log_ratio_sum"  # [b] sum_t m * (lp - old) over the whole sequence: the train step adds it
#                                         under context parallelism, where a rank holds part of each sequence
TOKEN_ENTROPY = "token_entropy"  # the policy's next-token entropy, added by the train step's own pass (no gradient)
TOKEN_COLUMN = "token_column"  # [b, T] each entry's column in its whole sequence (its position): the train step adds
#                                 it, since a context-parallel rank's rows hold some columns of each sequence


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLKind) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi; [..] -> [..] (same shape)."""
    log_ratio = (logprobs - ref_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if kind == "k1":
        kl = log_ratio
    elif kind == "k2":
        kl = 0.5 * log_ratio.square()
    elif kind == "k3":
        kl = torch.exp(-log_ratio) - 1.0 + log_ratio
    else:
        raise ValueError(f"unknown KL estimator {kind!r}; loss.kl_kind must be one of k1, k2, k3")
    return kl.clamp(-KL_CLAMP, KL_CLAMP)


def token_weights(
    mask: torch.Tensor, level: Level, global_count: float, seq_num_tokens: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Weight of each token in the step's loss, so that `(values * weights).sum()` is this micro-batch's share of the
    batch mean. mask [b, T]; seq_num_tokens [b] = valid tokens of each WHOLE sequence (defaults to mask.sum(1)).
    Returns [b, T] float32 (0 on masked tokens)."""
    mask = mask.float()
    if global_count <= 0:
        return torch.zeros_like(mask)
    if level == "token":
        return mask / global_count
    if level != "sequence":
        raise ValueError(f"unknown loss level {level!r}; loss.level must be 'token' or 'sequence'")
    per_seq = mask.sum(dim=1) if seq_num_tokens is None else seq_num_tokens.float()
    return mask / (per_seq.clamp(min=1).unsqueeze(1) * global_count)


def local_count(mask: torch.Tensor, level: Level) -> float:
    """Valid tokens, or sequences with at least one valid token, of `mask` [b, T]."""
    if level == "token":
        return float(mask.float().sum())
    return float((mask.float().sum(dim=1) > 0).sum())


def sequence_log_ratio_sums(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[b] sum over each row's valid tokens of (lp - old), no gradient: GSPO's sequence log-ratio (the train step
    all-reduces it over the CP group when a rank holds part of each sequence)."""
    with torch.no_grad():
        return zero_masked(logprobs.float() - old_logprobs.float(), mask.bool()).sum(dim=1)


def sequence_ratios(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    mask: torch.Tensor,
    seq_num_tokens: Optional[torch.Tensor] = None,
    seq_log_ratio_sum: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """GSPO's per-token ratio r_t = sg[s_b] * exp(lp - sg[lp]) [b, T], s_b the geometric mean of the sequence's
    token ratios. The whole sequence's log-ratio sum and token count come from the batch under CP, else from
    these rows."""
    if seq_log_ratio_sum is None:
        seq_log_ratio_sum = sequence_log_ratio_sums(logprobs, old_logprobs, mask)
    count = mask.float().sum(dim=1) if seq_num_tokens is None else seq_num_tokens.float()
    mean = (seq_log_ratio_sum.detach().to(logprobs.dtype) / count.to(logprobs.dtype).clamp(min=1)).clamp(
        -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP
    )
    return torch.exp(mean)[:, None] * torch.exp(logprobs - logprobs.detach())


def _clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float, dual_clip: Optional[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate loss and the 'ratio outside the clip range' flags, both [b, T].
    advantages: [b] (broadcast over tokens) or [b, T]."""
    adv = advantages.float().unsqueeze(1) if advantages.dim() == 1 else advantages.float()
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = -torch.minimum(ratio * adv, clipped_ratio * adv)
    if dual_clip is not None:
        # Negative advantage with a huge ratio: the unclipped branch is unbounded; cap the loss at -c * A.
        loss = torch.where(adv < 0, torch.minimum(loss, -dual_clip * adv), loss)
    outside = (ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)
    return loss, outside


def zero_masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # Padding positions may hold anything (even inf); zero them BEFORE any exp so no NaN reaches the gradient.
    return torch.where(mask, values, torch.zeros_like(values))


def clipped_pg_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: Optional[float] = None,
    is_weights: Optional[torch.Tensor] = None,
    level: Level = "token",
) -> torch.Tensor:
    """Clipped PPO/GRPO surrogate averaged over this batch alone (scalar). logprobs, old_logprobs, mask [B, T];
    advantages [B] or [B, T]; is_weights [B, T] (no gradient) multiply each token's loss.
    level "token": mean over all valid tokens; "sequence": mean over tokens within a sequence, then over sequences."""
    mask = mask.bool()
    ratio = torch.exp(zero_masked(logprobs, mask) - zero_masked(old_logprobs, mask))
    loss, _ = _clipped_surrogate(ratio, advantages, clip_low, clip_high, dual_clip)
    if is_weights is not None:
        loss = loss * is_weights.detach()
    weights = token_weights(mask, level, local_count(mask, level))
    return (zero_masked(loss, mask) * weights).sum()


def importance_weights(
    train_logprobs: torch.Tensor,
    gen_logprobs: torch.Tensor,
    kind: ISKind,
    *,
    cap: float = 2.0,
    low: float = 0.5,
    high: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Engine/trainer mismatch correction. Returns (weights, modified), both [b, T]: the weights (no gradient) and
    where they differ from the raw ratio exp(train - gen) (TIS: truncated; ICE-POP: masked to 0)."""
    ratio = torch.exp((train_logprobs - gen_logprobs).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    if kind == "none":
        return torch.ones_like(ratio), torch.zeros_like(ratio, dtype=torch.bool)
    if kind == "tis":
        return ratio.clamp(max=cap), ratio > cap
    if kind == "icepop":
        keep = (ratio >= low) & (ratio <= high)
        return torch.where(keep, ratio, torch.zeros_like(ratio)), ~keep
    raise ValueError(f"unknown importance sampling {kind!r}; loss.importance_sampling must be none, tis or icepop")


@dataclass(frozen=True)
class GRPOLoss:
    """The GRPO policy loss (objective in the module docstring), called per micro-batch as
    `loss, metrics = loss_fn(logprobs [b, T], batch, global_count)`.

    batch: `loss_mask` [b, T]; `advantages` [b] or [b, T]; optional `prev_logprobs`, `generation_logprobs`,
    `ref_logprobs` (needed when kl_beta > 0) [b, T]; optional `seq_num_tokens` [b].
    Returns the scalar loss share and additive metrics (0-dim tensors, detached)."""

    level: Level = "token"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: Optional[float] = None
    ratio_level: RatioLevel = "token"
    kl_beta: float = 0.0
    kl_kind: KLKind = "k3"
    importance_sampling: ISKind = "none"
    is_cap: float = 2.0
    icepop_low: float = 0.5
    icepop_high: float = 2.0

    def __post_init__(self) -> None:
        if self.level not in ("token", "sequence"):
            raise ValueError(f"loss.level must be 'token' or 'sequence', got {self.level!r}")
        if not 0 <= self.clip_low < 1 or self.clip_high < 0:
            raise ValueError(
                f"need 0 <= loss.clip_low < 1 and loss.clip_high >= 0, got {self.clip_low} and {self.clip_high}"
            )
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"loss.dual_clip must be > 1 (or null to disable), got {self.dual_clip}")
        if self.icepop_low >= self.icepop_high:
            raise ValueError(f"loss.icepop_low ({self.icepop_low}) must be below loss.icepop_high ({self.icepop_high})")
        if self.ratio_level not in ("token", "sequence"):
            raise ValueError(f"loss.ratio_level must be 'token' or 'sequence' (GSPO), got {self.ratio_level!r}")
        if self.ratio_level == "sequence" and self.level != "sequence":
            raise ValueError("loss.ratio_level=sequence (GSPO) averages per sequence: it needs loss.level=sequence")

    @property
    def needs_reference(self) -> bool:
        return self.kl_beta > 0

    @property
    def needs_sequence_log_ratio(self) -> bool:
        """Whether the train step must add `SEQ_LOG_RATIO_SUM` where a rank holds part of each sequence (CP)."""
        return self.ratio_level == "sequence"

    def __call__(
        self, logprobs: torch.Tensor, batch: Mapping[str, torch.Tensor], global_count: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = batch[LOSS_MASK].bool()
        lp = zero_masked(logprobs, mask)
        old = zero_masked(batch[PREV_LOGPROBS], mask) if PREV_LOGPROBS in batch else lp.detach()
        if self.ratio_level == "sequence":
            ratio = sequence_ratios(lp, old, mask, batch.get(SEQ_NUM_TOKENS), batch.get(SEQ_LOG_RATIO_SUM))
        else:
            ratio = torch.exp(lp - old)
        pg, outside = _clipped_surrogate(ratio, batch[ADVANTAGES], self.clip_low, self.clip_high, self.dual_clip)
        per_token = pg
        kl = None
        if self.kl_beta > 0:
            if REF_LOGPROBS not in batch:
                raise KeyError(f"loss.kl_beta={self.kl_beta} needs '{REF_LOGPROBS}' in the batch (reference logprobs)")
            kl = kl_penalty(lp, zero_masked(batch[REF_LOGPROBS], mask), self.kl_kind)
            per_token = per_token + self.kl_beta * kl
        gen = zero_masked(batch[GENERATION_LOGPROBS], mask) if GENERATION_LOGPROBS in batch else None
        is_w, modified = torch.ones_like(lp), torch.zeros_like(mask)
        if self.importance_sampling != "none":
            if gen is None:
                raise KeyError(
                    f"loss.importance_sampling={self.importance_sampling} needs "
                    f"'{GENERATION_LOGPROBS}' in the batch (the engine's logprobs)"
                )
            is_w, modified = importance_weights(
                old, gen, self.importance_sampling, cap=self.is_cap, low=self.icepop_low, high=self.icepop_high
            )
            per_token = per_token * is_w
        weights = token_weights(mask, self.level, global_count, batch.get(SEQ_NUM_TOKENS))
        loss = (zero_masked(per_token, mask) * weights).sum()
        metrics = self._metrics(weights, mask, pg * is_w, outside, kl, is_w, modified, old, gen)
        if TOKEN_ENTROPY in batch:
            with torch.no_grad():
                metrics["entropy"] = (zero_masked(batch[TOKEN_ENTROPY].float(), mask) * weights).sum()
        return loss, metrics

    def _metrics(
        self,
        weights: torch.Tensor,
        mask: torch.Tensor,
        pg: torch.Tensor,
        outside: torch.Tensor,
        kl: Optional[torch.Tensor],
        is_w: torch.Tensor,
        modified: torch.Tensor,
        old: torch.Tensor,
        gen: Optional[torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        """Additive metrics: each is weighted like the loss, so summing over micro-batches gives the batch mean."""
        with torch.no_grad():
            mean = lambda values: (zero_masked(values.float(), mask) * weights).sum()  # noqa: E731
            out = {"pg_loss": mean(pg), "clip_fraction": mean(outside), "num_valid_tokens": mask.float().sum()}
            if kl is not None:
                out["kl"] = mean(kl)
            if self.importance_sampling != "none":
                out["is_weight_mean"] = mean(is_w)
                out["is_modified_fraction"] = mean(modified)
            if gen is not None:
                out["token_mult_prob_error"] = mean(torch.exp((gen - old).abs()))
                out["gen_kl_error"] = mean(kl_penalty(gen, old, "k3"))
        return out


@dataclass(frozen=True)
class NLLLoss:
    """Supervised fine-tuning: negative log-likelihood of the masked (response) tokens, with the same global
    normalisation contract as GRPOLoss. batch: `loss_mask` [b, T], optional `seq_num_tokens` [b]."""

    level: Level = "token"

    def __post_init__(self) -> None:
        if self.level not in ("token", "sequence"):
            raise ValueError(f"loss level must be 'token' or 'sequence', got {self.level!r}")

    def __call__(
        self, logprobs: torch.Tensor, batch: Mapping[str, torch.Tensor], global_count: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = batch[LOSS_MASK].bool()
        weights = token_weights(mask, self.level, global_count, batch.get(SEQ_NUM_TOKENS))
        loss = -(zero_masked(logprobs, mask) * weights).sum()
        return loss, {"nll": loss.detach(), "num_valid_tokens": mask.float().sum()}
