"""Preference losses on chosen/rejected pairs: DPO (sigmoid, IPO, with an optional SFT term) and the reward model's
Bradley-Terry loss. Pure tensor math, called per micro-batch like every `PolicyLoss`.

Notation for pair p with chosen response c and rejected response r (response tokens only, m = loss mask):
    s_y   = sum_t m log pi_theta(y_t | ...)                  sequence log-probability ("sum"), or
          = that sum / n_y                                   its per-token mean ("mean": `length_normalize`)
    ref_y = the same under the frozen reference (computed once per batch, before the step)
    h_p   = (s_c - ref_c) - (s_r - ref_r)                    implicit reward margin / beta
DPO, Rafailov et al. 2023 ("sigmoid"):   l_p = -log sigmoid(beta * h_p)
IPO, Azar et al. 2023 ("ipo"):          l_p = (h_p - 1 / (2 beta))^2          (mean log-probs, as IPO's authors do)
SFT-regularised (RPO, Pang et al. 2024): + alpha * NLL of the chosen tokens, token-level over the step's chosen
                                         tokens (the per-row weight 1 / N_chosen_tokens is the loop's `sft_weight`)
Reward model (Bradley-Terry, Ouyang et al. 2022): r_y = the score at the response's last token,
                                          l_p = -log sigmoid(r_c - r_r)
    L = sum_p l_p / N_pairs  (+ the SFT term)

Normalisation (the `PolicyLoss` contract): `level` is "sequence", so the policy divides by the step's number of
sequences with a response, which is 2 * N_pairs (every pair contributes its chosen and its rejected row); each
micro-batch returns its pairs' sum / N_pairs. A pair is never split: both rows sit in the same micro-batch (the
batch's `group_size` is 2), found here by `pair_id`; a pair split over micro-batches is an error, not a silent
half-pair.

Batch keys (sequence data, [b]): `pair_id` (pairs' global index), `chosen` (1 chosen, 0 rejected),
`ref_logprob_sum` (DPO: the reference's sum of response logprobs), `sft_weight` (DPO with alpha > 0),
`score_index` (reward model: position of the sequence's last token). Metrics are additive like the loss: each
pair's value / N_pairs, so their sum over micro-batches and ranks is the batch mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping

import torch

from mrl.objectives.loss import LOSS_MASK, SEQ_NUM_TOKENS, TOKEN_COLUMN, Level, zero_masked

PAIR_ID = "pair_id"
CHOSEN = "chosen"
REF_LOGPROB_SUM = "ref_logprob_sum"
SFT_WEIGHT = "sft_weight"
SCORE_INDEX = "score_index"

DPOKind = Literal["sigmoid", "ipo"]


def pair_rows(batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen_rows [P], rejected_rows [P]): the row of each pair's chosen and rejected sequence in this micro-batch.
    Raises when a pair lacks one of its rows (split over micro-batches) or has two of a kind."""
    pair_id, chosen = batch[PAIR_ID].long(), batch[CHOSEN].bool()
    order_c = torch.argsort(pair_id[chosen], stable=True)
    order_r = torch.argsort(pair_id[~chosen], stable=True)
    rows = torch.arange(len(pair_id), device=pair_id.device)
    chosen_rows, rejected_rows = rows[chosen][order_c], rows[~chosen][order_r]
    if (
        len(chosen_rows) != len(rejected_rows)
        or not torch.equal(pair_id[chosen_rows], pair_id[rejected_rows])
        or len(torch.unique(pair_id)) != len(chosen_rows)
    ):
        raise ValueError(
            f"micro-batch rows do not form whole chosen/rejected pairs (pair ids {pair_id.tolist()}, "
            f"chosen {chosen.int().tolist()}): a pair must stay in one micro-batch (RankBatch.group_size=2)"
        )
    return chosen_rows, rejected_rows


def _pair_count(global_count: float) -> float:
    return global_count / 2.0  # the policy counts sequences; a pair is two


@dataclass(frozen=True)
class DPOLoss:
    """DPO / IPO (+ SFT term) on pairs, `loss, metrics = loss_fn(logprobs [b, T], batch, global_count)`."""

    beta: float = 0.1
    kind: DPOKind = "sigmoid"
    length_normalize: bool = False
    sft_alpha: float = 0.0
    level: Level = "sequence"

    def __post_init__(self) -> None:
        if self.beta <= 0:
            raise ValueError(f"dpo.beta must be > 0, got {self.beta}")
        if self.kind not in ("sigmoid", "ipo"):
            raise ValueError(f"dpo.loss must be 'sigmoid' or 'ipo', got {self.kind!r}")

    def pair_losses(self, margin: torch.Tensor) -> torch.Tensor:
        """[P] loss of each pair from h_p (the margin of log-ratios, before beta)."""
        if self.kind == "ipo":
            return (margin - 1.0 / (2.0 * self.beta)).square()
        return -torch.nn.functional.logsigmoid(self.beta * margin)

    def __call__(
        self, logprobs: torch.Tensor, batch: Mapping[str, torch.Tensor], global_count: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.from_row_sums(self.row_sums(logprobs, batch), batch, global_count)

    def row_sums(self, logprobs: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """[b] each row's sum of response logprobs: additive over a sequence's tokens (a context-parallel rank
        sums its chunks; the policy adds the ranks' sums before `from_row_sums`)."""
        mask = batch[LOSS_MASK].bool()
        return (zero_masked(logprobs, mask) * mask).sum(dim=1)

    def from_row_sums(
        self, sums: torch.Tensor, batch: Mapping[str, torch.Tensor], global_count: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss and metrics from each whole sequence's `row_sums` [b]."""
        num_tokens = batch.get(SEQ_NUM_TOKENS, batch[LOSS_MASK].bool().sum(dim=1))
        policy = sums / num_tokens.clamp(min=1) if self.length_normalize else sums  # [b]
        ref = batch[REF_LOGPROB_SUM].float()
        ref = ref / num_tokens.clamp(min=1) if self.length_normalize else ref
        c, r = pair_rows(batch)
        ratio = policy - ref  # log pi / pi_ref of each sequence (per token when normalised)
        margin = ratio[c] - ratio[r]
        pairs = _pair_count(global_count)
        loss = self.pair_losses(margin).sum() / pairs
        sft = torch.zeros((), device=sums.device)
        if self.sft_alpha > 0:  # the token-level NLL of the chosen rows: each row's sum, weighted
            sft = -(sums * batch[SFT_WEIGHT].float()).sum()
            loss = loss + self.sft_alpha * sft
        return loss, self._metrics(policy, ratio, margin, c, r, pairs, sft)

    def _metrics(
        self,
        policy: torch.Tensor,
        ratio: torch.Tensor,
        margin: torch.Tensor,
        c: torch.Tensor,
        r: torch.Tensor,
        pairs: float,
        sft: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            mean = lambda values: values.float().sum() / pairs  # noqa: E731  (this micro-batch's share)
            return {
                "dpo_loss": mean(self.pair_losses(margin)),
                "reward_accuracy": mean(margin > 0),
                "chosen_reward": mean(self.beta * ratio[c]),
                "rejected_reward": mean(self.beta * ratio[r]),
                "reward_margin": mean(self.beta * margin),
                "preference_accuracy": mean(policy[c] > policy[r]),
                "chosen_logprob": mean(policy[c]),
                "rejected_logprob": mean(policy[r]),
                "sft_loss": sft.detach(),
                "num_pairs": torch.tensor(float(len(c))),
            }


@dataclass(frozen=True)
class BradleyTerryLoss:
    """The reward model's pairwise loss on its scores: `values` [b, T] are the score head's outputs per position."""

    level: Level = "sequence"

    def __call__(
        self, values: torch.Tensor, batch: Mapping[str, torch.Tensor], global_count: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.from_row_sums(self.row_sums(values, batch), batch, global_count)

    def row_sums(self, values: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """[b] the score at each row's `score_index`, found by its token column (`TOKEN_COLUMN`: a
        context-parallel rank holds some columns of each sequence, so its sum is the score or 0)."""
        columns = batch.get(TOKEN_COLUMN)
        if columns is None:  # the whole rows, in order
            columns = torch.arange(values.shape[1], device=values.device)[None, :]
        at = columns == batch[SCORE_INDEX].long().to(columns.device)[:, None]
        return torch.where(at, values, torch.zeros_like(values)).sum(dim=1)

    def from_row_sums(
        self, scores: torch.Tensor, batch: Mapping[str, torch.Tensor], global_count: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss and metrics from each whole sequence's score [b]."""
        c, r = pair_rows(batch)
        margin = scores[c] - scores[r]
        pairs = _pair_count(global_count)
        loss = -torch.nn.functional.logsigmoid(margin).sum() / pairs
        with torch.no_grad():
            mean = lambda v: v.float().sum() / pairs  # noqa: E731
            metrics = {
                "rm_loss": loss.detach(),
                "accuracy": mean(margin > 0),
                "chosen_score": mean(scores[c]),
                "rejected_score": mean(scores[r]),
                "score_margin": mean(margin),
                "num_pairs": torch.tensor(float(len(c))),
            }
        return loss, metrics
