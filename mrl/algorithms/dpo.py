"""Direct preference optimisation on Megatron, with sequence packing: for each pair (prompt x, chosen y_c,
rejected y_r), with s_y = sum of the response's token logprobs (mean with `dpo.length_normalize`),
    L_DPO = -log sigmoid(beta * [(s_c - ref_c) - (s_r - ref_r)])            Rafailov et al. 2023 ("sigmoid")
    L_IPO = ([(s_c - ref_c) - (s_r - ref_r)] - 1 / (2 beta))^2               Azar et al. 2023 ("ipo", mean logprobs)
averaged over the step's pairs, + dpo.sft_weight * the token-level NLL of the chosen responses (RPO). Exact
formulas and normalisation: mrl/objectives/preference.py.

Departures and choices, stated:
- The reference is the frozen starting model (the policy's own copy, `reference=True`); its logprobs are computed
  once per batch, before the step, and enter the loss as constants.
- A pair's chosen and rejected rows stay in one micro-batch (and one pack: `RankBatch.group_size = 2`), so packing,
  micro-batching and data parallelism never change the loss (tested: packed = unpacked, TP2 = PP2 = TP1).
- One optimizer step per batch (no PPO-style epochs over the same pairs).
Metrics: train/ and val/ loss, reward_accuracy (implicit reward of chosen > rejected), chosen_reward,
rejected_reward, reward_margin (beta-scaled), preference_accuracy (the policy's own logprob of chosen > rejected:
the checkable preference on the synthetic task), chosen/rejected logprobs.
"""

from __future__ import annotations

import time

import torch

from mrl.algorithms.interfaces import LoopCheckpoints, Workers
from mrl.algorithms.pairs import PairData, masked_batch_dict, pair_batch, train_on_pairs, validation_chunks
from mrl.config.schema import DPOConfig, MrlConfig
from mrl.logging.metrics import MetricsLogger
from mrl.objectives.preference import CHOSEN, REF_LOGPROB_SUM, SFT_WEIGHT, DPOLoss
from mrl.policy.interface import RankBatch, TrainablePolicy

KEY_METRICS = ("train/loss", "train/reward_accuracy", "train/reward_margin", "val/preference_accuracy")
#: Validation pairs per logprobs call.
VAL_PAIRS_PER_CALL = 128


def dpo_loss(section: DPOConfig) -> DPOLoss:
    normalize = section.loss == "ipo" if section.length_normalize is None else section.length_normalize
    return DPOLoss(beta=section.beta, kind=section.loss, length_normalize=normalize, sft_alpha=section.sft_weight)


def add_reference(policy: TrainablePolicy, batch: RankBatch, loss_fn: DPOLoss) -> RankBatch:
    """The frozen reference's sum of response logprobs per row (and the SFT term's row weights)."""
    ref = policy.logprobs(batch, reference=True)  # [2P, T] at token positions, like loss_mask
    batch.seq_data[REF_LOGPROB_SUM] = (ref.double() * batch.loss_mask).sum(dim=1).float()
    if loss_fn.sft_alpha > 0:  # token-level NLL over the step's chosen tokens: each chosen row weighs 1 / N_chosen
        chosen_tokens = (batch.loss_mask.sum(dim=1) * batch.seq_data[CHOSEN]).sum().clamp(min=1)
        batch.seq_data[SFT_WEIGHT] = batch.seq_data[CHOSEN].float() / chosen_tokens
    return batch


def dpo_validation(cfg: MrlConfig, workers: Workers, data: PairData, loss_fn: DPOLoss) -> dict[str, float]:
    """The loss and metrics over every validation pair (no update); {} without validation pairs."""
    if not data.val:
        return {}
    totals: dict[str, float] = {}
    count = 2.0 * len(data.val)  # sequences of the whole validation set: metrics come out as means over pairs
    for pairs, real in validation_chunks(data.val, workers.policy.data_parallel_size, VAL_PAIRS_PER_CALL):
        batch = add_reference(
            workers.policy,
            pair_batch(pairs, workers.tokenizer, data.template, cfg.policy.max_total_sequence_length),
            loss_fn,
        )
        logprobs = workers.policy.logprobs(batch)[: 2 * real]
        with torch.no_grad():
            _, metrics = loss_fn(logprobs, masked_batch_dict(batch, 2 * real), count)
        for key, value in metrics.items():
            totals[key] = totals.get(key, 0.0) + float(value)
    totals["loss"] = totals.pop("dpo_loss")
    return {f"val/{k}": v for k, v in totals.items() if k not in ("sft_loss", "num_pairs")}


def dpo_step(workers: Workers, batch: RankBatch, loss_fn: DPOLoss) -> dict[str, float]:
    """Reference logprobs of the batch, then one optimizer step on it; the step's metrics."""
    t0 = time.perf_counter()
    batch = add_reference(workers.policy, batch, loss_fn)
    t1 = time.perf_counter()
    trained = workers.policy.train(
        batch,
        loss_fn,
    )
    metrics = {f"train/{k}": v for k, v in trained.items()}
    return metrics | {"timing/reference_logprobs": t1 - t0, "timing/train": time.perf_counter() - t1}


def dpo_train(
    cfg: MrlConfig, workers: Workers, data: PairData, logger: MetricsLogger, ckpt: LoopCheckpoints
) -> dict[str, float]:
    """The whole DPO run (resumes from the newest checkpoint when there is one). Returns the last step's metrics."""
    loss_fn = dpo_loss(cfg.dpo)
    return train_on_pairs(
        cfg,
        cfg.dpo,
        workers,
        data,
        logger,
        ckpt,
        step_fn=lambda batch: dpo_step(workers, batch, loss_fn),
        validate=lambda: dpo_validation(cfg, workers, data, loss_fn),
        command="dpo",
    )
