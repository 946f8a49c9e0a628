"""Reward-model training on Megatron, with sequence packing: a score head r(x, y) on the decoder (its value at the
response's last token, the end-of-turn token left off: see mrl/app/reward_model.py), trained on preference pairs with
the Bradley-Terry loss (Ouyang et al. 2022)
    L = -log sigmoid(r(x, y_c) - r(x, y_r))       averaged over the step's pairs
(exact normalisation: mrl/objectives/preference.py). The model is an HF `*ForSequenceClassification` folder with one
label: `mrl rm` starting from a language model (an SFT export, say) turns it into one first, with a fresh score head
(mrl/app/reward_model.py), and exports the trained model in that layout (transformers loads it; the GRPO reward-model
environment serves it).

Choices, stated: a pair's two rows share a micro-batch and a pack (`RankBatch.group_size = 2`); no score centring
or margin term; one optimizer step per batch. Metrics: train/ and val/ loss, accuracy (score of chosen > rejected),
chosen_score, rejected_score, score_margin.
"""

from __future__ import annotations

import torch

from mrl.algorithms.interfaces import LoopCheckpoints, Workers
from mrl.algorithms.pairs import PairData, masked_batch_dict, pair_batch, train_on_pairs, validation_chunks
from mrl.config.schema import MrlConfig
from mrl.logging.metrics import MetricsLogger
from mrl.objectives.preference import BradleyTerryLoss
from mrl.policy.interface import RankBatch

KEY_METRICS = ("train/loss", "train/accuracy", "val/accuracy")
#: Validation pairs per scoring call.
VAL_PAIRS_PER_CALL = 128


def rm_validation(cfg: MrlConfig, workers: Workers, data: PairData) -> dict[str, float]:
    """Loss and pair accuracy over every validation pair (no update); {} without validation pairs."""
    if not data.val:
        return {}
    loss_fn = BradleyTerryLoss()
    totals: dict[str, float] = {}
    count = 2.0 * len(data.val)
    for pairs, real in validation_chunks(data.val, workers.policy.data_parallel_size, VAL_PAIRS_PER_CALL):
        batch = pair_batch(
            pairs, workers.tokenizer, data.template, cfg.policy.max_total_sequence_length, turn_end=False
        )
        values = workers.policy.logprobs(batch)[: 2 * real]  # [2n, T] the score at every token
        with torch.no_grad():
            loss, metrics = loss_fn(values, masked_batch_dict(batch, 2 * real), count)
        for key, value in {**metrics, "loss": loss}.items():
            totals[key] = totals.get(key, 0.0) + float(value)
    return {f"val/{k}": v for k, v in totals.items() if k not in ("rm_loss", "num_pairs")}


def rm_step(workers: Workers, batch: RankBatch) -> dict[str, float]:
    """One optimizer step of the Bradley-Terry loss on a batch of pairs; the step's metrics."""
    trained = workers.policy.train(
        batch,
        BradleyTerryLoss(),  # type: ignore[arg-type]  # its first argument is the score head's values, not logprobs
    )
    return {f"train/{k}": v for k, v in trained.items() if k != "rm_loss"}


def rm_train(
    cfg: MrlConfig, workers: Workers, data: PairData, logger: MetricsLogger, ckpt: LoopCheckpoints
) -> dict[str, float]:
    """The whole reward-model run (resumes from the newest checkpoint). Returns the last step's metrics."""
    return train_on_pairs(
        cfg,
        cfg.rm,
        workers,
        data,
        logger,
        ckpt,
        step_fn=lambda batch: rm_step(workers, batch),
        validate=lambda: rm_validation(cfg, workers, data),
        command="rm",
        turn_end=False,
    )
