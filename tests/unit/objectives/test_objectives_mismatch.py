"""Mismatch metrics against hand-computed values."""

import math

import pytest
import torch

from mrl.objectives.mismatch import mismatch_metrics


def test_identical_logprobs_give_one_and_zero():
    lp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
    m = mismatch_metrics(lp, lp.clone(), torch.ones(2, 2))
    assert m["token_mult_prob_error"] == 1.0 and m["gen_kl_error"] == 0.0 and m["max_abs_logprob_error"] == 0.0


def test_hand_computed_values_ignore_masked_tokens():
    gen = torch.tensor([[-1.0, -2.0, 99.0]])
    train = torch.tensor([[-1.5, -1.0, -7.0]])
    mask = torch.tensor([[1, 1, 0]])
    m = mismatch_metrics(gen, train, mask)
    # x = gen - train = [0.5, -1.0]; |x| = [0.5, 1.0]; k3 = exp(-x) - 1 + x
    assert m["token_mult_prob_error"] == pytest.approx((math.exp(0.5) + math.exp(1.0)) / 2, rel=1e-12)
    k3 = [math.exp(-0.5) - 1 + 0.5, math.exp(1.0) - 1 - 1.0]
    assert m["gen_kl_error"] == pytest.approx(sum(k3) / 2, rel=1e-12)
    assert m["max_abs_logprob_error"] == pytest.approx(1.0)
    assert m["num_tokens"] == 2


def test_shape_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="same tokens"):
        mismatch_metrics(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
