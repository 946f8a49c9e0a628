"""A step's optimizer updates for a trainable group (GRPO's policy, PPO's critic): one optimizer step per
`rows_per_update` rows of the step's batch, the metrics averaged over them.

Contract: the batch's rows are a multiple of the group's data-parallel size and so is `rows_per_update` (GRPO's
`training_rows` and `_rows_per_update` make them so), so every slice shards evenly; a slice with no loss token is not
trained on. A metric some updates lack is the mean of those that have it (the routing disagreement: the first
update's alone).
"""

from __future__ import annotations

from mrl.policy.interface import PolicyLoss, RankBatch, TrainablePolicy


def train_in_minibatches(
    trainer: TrainablePolicy, batch: RankBatch, loss_fn: PolicyLoss, rows_per_update: int
) -> dict[str, float]:
    """The updates of one step (see the module docstring); their metrics and `optimizer_steps`."""
    steps = [batch.slice(i, i + rows_per_update) for i in range(0, len(batch), rows_per_update)]
    results = [trainer.train(s, loss_fn, temperature=1.0) for s in steps if s.loss_mask.sum() > 0]
    keys = dict.fromkeys(k for r in results for k in r)
    return {k: sum(r[k] for r in results if k in r) / sum(k in r for r in results) for k in keys} | {
        "optimizer_steps": float(len(results))
    }
