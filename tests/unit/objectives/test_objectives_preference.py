"""DPO, IPO, the SFT term and the Bradley-Terry loss against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from mrl.objectives.preference import (CHOSEN, PAIR_ID, REF_LOGPROB_SUM, SCORE_INDEX, SFT_WEIGHT, BradleyTerryLoss,
                                       DPOLoss, pair_rows)

pytestmark = pytest.mark.unit


def batch(order=(0, 1, 2, 3)):
    """Two pairs; rows listed in `order` (chosen of pair 0, rejected of pair 0, chosen of pair 1, rejected of 1).
    Response logprob sums: pair 0: chosen -1 -2 = -3, rejected -4; pair 1: chosen -1, rejected -0.5 -0.5 = -1."""
    logprobs = torch.tensor([[0.0, -1.0, -2.0], [0.0, -4.0, 0.0], [0.0, -1.0, 0.0], [0.0, -0.5, -0.5]])
    mask = torch.tensor([[0.0, 1, 1], [0, 1, 0], [0, 1, 0], [0, 1, 1]])
    seq = {PAIR_ID: torch.tensor([0, 0, 1, 1]), CHOSEN: torch.tensor([1, 0, 1, 0]),
           REF_LOGPROB_SUM: torch.tensor([-3.5, -3.8, -1.2, -0.9]),
           SFT_WEIGHT: torch.tensor([1 / 3, 0, 1 / 3, 0]), SCORE_INDEX: torch.tensor([2, 1, 1, 2])}
    idx = list(order)
    out = {"loss_mask": mask[idx], **{k: v[idx] for k, v in seq.items()}}
    return logprobs[idx].clone().requires_grad_(True), out


# margins h = (s_c - ref_c) - (s_r - ref_r): pair 0: (-3 + 3.5) - (-4 + 3.8) = 0.7; pair 1: (-1 + 1.2) - (-1 + 0.9) = 0.3
H = (0.7, 0.3)


def test_dpo_sigmoid_loss_metrics_and_gradient_by_hand():
    logprobs, data = batch()
    loss, metrics = DPOLoss(beta=0.1)(logprobs, data, global_count=4.0)  # 4 sequences = 2 pairs
    expected = sum(math.log1p(math.exp(-0.1 * h)) for h in H) / 2
    assert float(loss.detach()) == pytest.approx(expected, abs=1e-7)
    assert float(metrics["reward_accuracy"]) == 1.0
    assert float(metrics["chosen_reward"]) == pytest.approx(0.1 * (0.5 + 0.2) / 2)
    assert float(metrics["rejected_reward"]) == pytest.approx(0.1 * (-0.2 - 0.1) / 2)
    assert float(metrics["reward_margin"]) == pytest.approx(0.1 * sum(H) / 2)
    assert float(metrics["preference_accuracy"]) == 0.5  # pair 0: -3 > -4; pair 1: -1 = -1 is not a preference
    loss.backward()
    # dL/dlp of a chosen response token = -beta * sigmoid(-beta h) / P; rejected: the opposite; prompt/pad: 0
    g0, g1 = (-0.1 / (1 + math.exp(0.1 * h)) / 2 for h in H)
    expected_grad = torch.tensor([[0, g0, g0], [0, -g0, 0], [0, g1, 0], [0, -g1, -g1]])
    assert torch.allclose(logprobs.grad, expected_grad, atol=1e-8)


def test_pairs_are_found_in_any_row_order_and_split_pairs_are_errors():
    reference, _ = DPOLoss()(*batch(), global_count=4.0)
    shuffled, _ = DPOLoss()(*batch(order=(3, 0, 2, 1)), global_count=4.0)
    assert float(shuffled.detach()) == pytest.approx(float(reference.detach()))
    logprobs, data = batch(order=(0, 1, 2))  # pair 1 lost its rejected row to another micro-batch
    with pytest.raises(ValueError, match="must stay in one micro-batch"):
        DPOLoss()(logprobs, data, global_count=4.0)


def test_micro_batches_sum_to_the_whole_batch():
    whole, metrics = DPOLoss(beta=0.3)(*batch(), global_count=4.0)
    first, m1 = DPOLoss(beta=0.3)(*batch(order=(0, 1)), global_count=4.0)
    second, m2 = DPOLoss(beta=0.3)(*batch(order=(2, 3)), global_count=4.0)
    assert float((first + second).detach()) == pytest.approx(float(whole.detach()))
    assert float(m1["reward_margin"] + m2["reward_margin"]) == pytest.approx(float(metrics["reward_margin"]))


def test_ipo_uses_mean_logprobs_and_its_squared_loss():
    logprobs, data = batch()
    loss, _ = DPOLoss(beta=0.5, kind="ipo", length_normalize=True)(logprobs, data, global_count=4.0)
    # per-token means: pair 0: chosen -3/2, ref -3.5/2; rejected -4/1, ref -3.8/1 -> h = 0.25 + 0.2 = 0.45
    #                  pair 1: chosen -1/1, ref -1.2/1; rejected -1/2, ref -0.9/2 -> h = 0.2 + 0.05 = 0.25
    expected = ((0.45 - 1.0) ** 2 + (0.25 - 1.0) ** 2) / 2
    assert float(loss.detach()) == pytest.approx(expected, abs=1e-6)


def test_sft_term_adds_the_token_level_nll_of_the_chosen_responses():
    plain, _ = DPOLoss(beta=0.1)(*batch(), global_count=4.0)
    with_sft, metrics = DPOLoss(beta=0.1, sft_alpha=0.5)(*batch(), global_count=4.0)
    nll = (3.0 + 1.0) / 3  # chosen tokens: -1, -2 and -1 over 3 tokens
    assert float(metrics["sft_loss"]) == pytest.approx(nll)
    assert float((with_sft - plain).detach()) == pytest.approx(0.5 * nll)


def test_bradley_terry_reads_the_score_at_the_last_token():
    values = torch.tensor([[9.0, 9.0, 2.0], [9.0, 0.5, 9.0], [9.0, -1.0, 9.0], [9.0, 9.0, 1.0]], requires_grad=True)
    _, data = batch()
    loss, metrics = BradleyTerryLoss()(values, data, global_count=4.0)
    margins = (2.0 - 0.5, -1.0 - 1.0)
    assert float(loss.detach()) == pytest.approx(sum(math.log1p(math.exp(-m)) for m in margins) / 2)
    assert float(metrics["accuracy"]) == 0.5
    loss.backward()
    assert values.grad[0, :2].abs().sum() == 0 and values.grad[0, 2] == pytest.approx(-1 / (1 + math.exp(1.5)) / 2)


def test_pair_rows_returns_chosen_and_rejected_rows_per_pair():
    chosen, rejected = pair_rows({PAIR_ID: torch.tensor([5, 2, 5, 2]), CHOSEN: torch.tensor([0, 1, 1, 0])})
    assert chosen.tolist() == [1, 2] and rejected.tolist() == [3, 0]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="beta"):
        DPOLoss(beta=0.0)
    with pytest.raises(ValueError, match="sigmoid"):
        DPOLoss(kind="hinge")  # type: ignore[arg-type]


@pytest.mark.parametrize("loss_fn", [DPOLoss(beta=0.1, length_normalize=True, sft_alpha=0.5), BradleyTerryLoss()],
                         ids=["dpo", "bradley-terry"])
def test_row_sums_add_over_a_sequences_chunks(loss_fn):
    """Under context parallelism a rank holds some columns of each row (token_column names them): its row sums are
    its part, the parts add up to the whole rows', and the loss from the whole sums is the loss of the whole rows."""
    from mrl.objectives.loss import SEQ_NUM_TOKENS, TOKEN_COLUMN
    from mrl.policy.interface import WholeSequenceLoss

    assert isinstance(loss_fn, WholeSequenceLoss)
    logprobs, data = batch()
    data[SEQ_NUM_TOKENS] = data["loss_mask"].sum(dim=1)  # whole rows' counts, as the train step gives every rank
    whole = loss_fn.row_sums(logprobs, data)
    parts = []
    for columns in ([0, 2], [1]):  # two ranks' chunks, CP-style: not contiguous
        chunk = {**data, "loss_mask": data["loss_mask"][:, columns], TOKEN_COLUMN: torch.tensor(columns).expand(4, -1)}
        parts.append(loss_fn.row_sums(logprobs[:, columns], chunk))
    torch.testing.assert_close(parts[0] + parts[1], whole)
    loss, metrics = loss_fn.from_row_sums(parts[0] + parts[1], data, 4.0)
    expected_loss, expected_metrics = loss_fn(logprobs, data, 4.0)
    torch.testing.assert_close(loss, expected_loss)
    assert metrics.keys() == expected_metrics.keys()
    for name, value in metrics.items():
        torch.testing.assert_close(value, expected_metrics[name])
