"""A minimal policy-gradient loss for the parallel-layout tests: -(advantage * logprob), normalised by the step's
global count, token or sequence level (the contract of mrl.policy.train_step.PolicyLoss)."""

from __future__ import annotations


class PGLoss:
    """-(advantage * logprob) over the loss mask; batch["adv"] holds the advantages [b, T]."""

    def __init__(self, level: str):
        self.level = level

    def __call__(self, logprobs, batch, count):
        per_token = -logprobs * batch["adv"] * batch["loss_mask"]
        if self.level == "token":
            loss = per_token.sum() / count
        else:  # mean over each sequence's tokens (whole-sequence count, also under CP), then over sequences
            loss = (per_token.sum(dim=1) / batch["seq_num_tokens"].clamp(min=1)).sum() / count
        metrics = {"tokens": batch["loss_mask"].sum() / 1.0}
        if "token_entropy" in batch:  # the train step's own pass adds it (mrl.objectives.loss.TOKEN_ENTROPY)
            metrics["entropy_sum"] = (batch["token_entropy"] * batch["loss_mask"]).sum()
        return loss, metrics
