"""PPO's token-level math against hand-computed values: per-token rewards, GAE over ragged and masked rows (a
multi-turn observation skipped), whitening, the clipped value loss (also as the critic's per-micro-batch loss, whose
pieces add up to the batch's), VAPO's decoupled lambda, distillation's advantages."""

from __future__ import annotations

import pytest
import torch

from mrl.objectives.ppo import (
    OLD_VALUES,
    RETURNS,
    ValueLoss,
    clipped_value_loss,
    distillation_advantages,
    gae,
    ppo_advantages,
    token_rewards,
    whiten,
)

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


def test_the_critics_loss_per_micro_batch_adds_up_to_the_batch_value_loss_and_its_gradient():
    values = torch.tensor([[1.0, 3.0, 0.0], [0.5, -1.0, 2.0]], requires_grad=True)
    old = torch.tensor([[0.0, 2.9, 0.0], [0.5, 0.0, 2.0]])
    returns = torch.tensor([[2.0, 0.0, 5.0], [1.0, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    batch = {"loss_mask": mask, OLD_VALUES: old, RETURNS: returns}
    loss_fn = ValueLoss(clip=0.2)
    whole = clipped_value_loss(values, old, returns, mask, clip=0.2)
    pieces = [loss_fn(values[i : i + 1], {k: v[i : i + 1] for k, v in batch.items()}, 5.0) for i in range(2)]
    total = pieces[0][0] + pieces[1][0]
    assert float(total.detach()) == pytest.approx(float(whole.detach()))
    # row 1 by hand: t0 (0.5-1)^2 = 0.25 both ways; t1 unclipped 0, clipped V = -0.2: (-0.2+1)^2 = 0.64; t2 4 both
    assert float(pieces[1][0].detach()) == pytest.approx(0.5 * (0.25 + 0.64 + 4) / 5)
    # the clip fraction: tokens where the clipped term is the larger, row 0's t0 and row 1's t1 of 5
    assert float(pieces[0][1]["value_clip_fraction"] + pieces[1][1]["value_clip_fraction"]) == pytest.approx(2 / 5)
    (grad,) = torch.autograd.grad(total, values)
    # d/dV of 0.5 * max(...) / 5: the unclipped branch gives (V - R) / 5, the clipped one 0 (V outside the clip)
    want = torch.tensor([[0.0, 3.0, 0.0], [-0.5, 0.0, 2.0]]) / 5
    assert torch.allclose(grad, want)


def test_decoupled_lambda_gives_the_returns_their_own_lambda():
    rewards, values = torch.tensor([1.0, 2.0]), torch.tensor([[9, 9, 0.5, 0.6, 0.7, 9], [9, 0.1, 0.2, 9, 0.3, 9]])
    adv, ret = ppo_advantages(rewards, values, MASK, gamma=0.9, lam=0.8, value_lam=1.0)
    # the advantages with lambda 0.8 (test_gae_by_hand...); the returns with lambda 1: the discounted reward to go
    want_adv = torch.tensor([[0, 0, 0.21712, 0.246, 0.3, 0], [0, 1.01168, 1.294, 0, 1.7, 0]])
    assert torch.allclose(adv, want_adv, atol=1e-6)
    want_ret = torch.tensor([[0, 0, 0.81, 0.9, 1.0, 0], [0, 2 * 0.81, 2 * 0.9, 0, 2.0, 0]])
    assert torch.allclose(ret, want_ret, atol=1e-6)
    same_adv, coupled_ret = ppo_advantages(rewards, values, MASK, gamma=0.9, lam=0.8)  # value_lam None: lam's
    assert torch.equal(same_adv, adv)
    assert torch.allclose(coupled_ret, (want_adv + values) * MASK, atol=1e-6)
