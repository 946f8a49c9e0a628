"""PPO's token-level math against hand-computed values (issue 65's first piece): per-token rewards, GAE over ragged and
masked rows (a multi-turn observation skipped), whitening, the clipped value loss, distillation's advantages."""

from __future__ import annotations

import pytest
import torch

from mrl.objectives.ppo import clipped_value_loss, distillation_advantages, gae, token_rewards, whiten

pytestmark = pytest.mark.unit

# Row 0: prompt, prompt, 3 response tokens. Row 1: prompt, 2 response tokens, an observation, 1 response token, pad.
MASK = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 0, 1, 0]], dtype=torch.float32)


def test_the_reward_lands_on_each_rows_last_response_token_and_the_kl_penalty_on_every_one():
    kl = torch.full(MASK.shape, 0.5)
    got = token_rewards(torch.tensor([1.0, 2.0]), MASK, kl, kl_coef=0.2)
    want = torch.tensor([[0, 0, -0.1, -0.1, 0.9, 0], [0, -0.1, -0.1, 0, 1.9, 0]])
    assert torch.allclose(got, want)
    assert token_rewards(torch.tensor([1.0]), torch.zeros(1, 3)).tolist() == [[0.0, 0.0, 0.0]]  # no response
    with pytest.raises(ValueError, match="one value per row"):
        token_rewards(torch.tensor([1.0]), MASK)


def test_gae_by_hand_with_gamma_and_lambda_skipping_the_observation():
    gamma, lam = 0.9, 0.8
    rewards = torch.tensor([[0, 0, 0, 0, 1.0, 0], [0, 0, 0, 0, 2.0, 0]])
    values = torch.tensor([[9, 9, 0.5, 0.6, 0.7, 9], [9, 0.1, 0.2, 9, 0.3, 9]])
    adv, ret = gae(rewards, values, MASK, gamma, lam)
    # row 0, backwards: t4: d=1-0.7=0.3, A=0.3; t3: d=0+0.9*0.7-0.6=0.03, A=0.03+0.72*0.3=0.246;
    # t2: d=0.9*0.6-0.5=0.04, A=0.04+0.72*0.246=0.21712
    # row 1 (t3 is an observation: t2's next is t4): t4: d=2-0.3=1.7, A=1.7; t2: d=0.9*0.3-0.2=0.07,
    # A=0.07+0.72*1.7=1.294; t1: d=0.9*0.2-0.1=0.08, A=0.08+0.72*1.294=1.01168
    want = torch.tensor([[0, 0, 0.21712, 0.246, 0.3, 0], [0, 1.01168, 1.294, 0, 1.7, 0]])
    assert torch.allclose(adv, want, atol=1e-6)
    assert torch.allclose(ret, (want + values) * MASK, atol=1e-6)


def test_gae_with_gamma_and_lambda_1_is_the_return_minus_the_value():
    rewards = token_rewards(torch.tensor([1.0, 0.0]), MASK, torch.full(MASK.shape, 0.25), kl_coef=1.0)
    values = torch.rand(MASK.shape)
    adv, ret = gae(rewards, values, MASK)
    for row in range(2):
        on = MASK[row].nonzero().squeeze(1).tolist()
        for i, t in enumerate(on):
            to_go = sum(float(rewards[row, s]) for s in on[i:])
            assert float(ret[row, t]) == pytest.approx(to_go, abs=1e-6)
            assert float(adv[row, t]) == pytest.approx(to_go - float(values[row, t]), abs=1e-6)


def test_whitening_over_the_masked_tokens_only():
    adv = torch.tensor([[100.0, 1, 2, 3], [100.0, 4, 5, 100]])
    mask = torch.tensor([[0.0, 1, 1, 1], [0, 1, 1, 0]])
    got = whiten(adv, mask)
    values = torch.tensor([1.0, 2, 3, 4, 5])
    mean, std = 3.0, float(values.std())  # unbiased, as whiten's
    assert torch.allclose(got[mask > 0], (values - mean) / std, atol=1e-6)
    assert got[mask == 0].abs().sum() == 0
    assert torch.allclose(whiten(adv, mask, shift_mean=False)[mask > 0], (values - mean) / std + mean, atol=1e-6)


def test_the_value_loss_is_clipped_around_the_old_values_by_hand():
    values = torch.tensor([[1.0, 3.0, 0.0]])
    old = torch.tensor([[0.0, 2.9, 0.0]])
    returns = torch.tensor([[2.0, 0.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    # token 0: unclipped (1-2)^2=1, clipped V=0+0.2=0.2: (0.2-2)^2=3.24 -> 3.24; token 1: (3-0)^2=9, clipped 3.0 -> 9
    assert float(clipped_value_loss(values, old, returns, mask, clip=0.2)) == pytest.approx(0.5 * (3.24 + 9) / 2)


def test_distillation_advantage_is_the_teachers_logprob_minus_the_students_on_the_mask():
    teacher = torch.tensor([[-0.1, -0.5, -2.0]])
    student = torch.tensor([[-0.3, -0.5, -0.2]])
    got = distillation_advantages(teacher, student, torch.tensor([[1.0, 1.0, 0.0]]))
    assert torch.allclose(got, torch.tensor([[0.2, 0.0, 0.0]]))
