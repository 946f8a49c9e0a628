"""Engine/trainer mismatch metrics: how far the rollout engine's logprobs are from the policy's, on the same tokens.

With gen = engine logprob and train = policy logprob of each sampled response token, m the response mask:
    token_mult_prob_error = sum(m * exp(|gen - train|)) / sum(m)          1.0 when the engine equals the policy
    gen_kl_error          = sum(m * k3(gen, train)) / sum(m)              k3 estimate of KL(engine || policy)
                            k3 = exp(-x) - 1 + x with x = gen - train     (unbiased on tokens the engine sampled)
    max_abs_logprob_error = max over valid tokens of |gen - train|
The same definitions as the loss metrics of mrl/objectives/loss.py (`GRPOLoss` logs the first two weighted like
its loss); this is the plain token mean the refit check logs every step. A fresh refit in fp32 should give
token_mult_prob_error <= 1.0001; a drifting or stale engine shows here first.
"""

from __future__ import annotations

import torch

from mrl.objectives.loss import kl_penalty


def mismatch_metrics(gen_logprobs: torch.Tensor, train_logprobs: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """gen_logprobs, train_logprobs, mask: [S, T] (mask 1 on response tokens). Token means over valid tokens."""
    if gen_logprobs.shape != train_logprobs.shape or gen_logprobs.shape != mask.shape:
        raise ValueError(
            f"shapes differ: gen {tuple(gen_logprobs.shape)}, train {tuple(train_logprobs.shape)}, "
            f"mask {tuple(mask.shape)}; all three must be [samples, tokens] of the same tokens"
        )
    valid = mask.bool()
    count = int(valid.sum())
    if count == 0:
        return {"token_mult_prob_error": 1.0, "gen_kl_error": 0.0, "max_abs_logprob_error": 0.0, "num_tokens": 0.0}
    gen = gen_logprobs.double()[valid]  # [N] valid tokens only: padding may hold anything
    train = train_logprobs.double()[valid]
    diff = (gen - train).abs()
    return {
        "token_mult_prob_error": float(torch.exp(diff).mean()),
        "gen_kl_error": float(kl_penalty(gen, train, "k3").mean()),
        "max_abs_logprob_error": float(diff.max()),
        "num_tokens": float(count),
    }
