"""Advantages, DAPO overlong shaping and dynamic sampling against values computed by hand."""

import math

import pytest
import torch

from mrl.objectives.advantages import (dynamic_sampling_keep, expand_group_indices, grpo_advantages,
                                       overlong_penalty)


def close(actual: torch.Tensor, expected: list, tol: float = 1e-5) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float32), rtol=tol, atol=tol)


def test_leave_one_out_uses_mean_and_unbiased_std_of_the_other_samples():
    adv = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    # Sample 0: others [0, 0, 0] -> baseline 0, std 0 -> not divided: 1 - 0.
    # Samples 1..3: others [1, 0, 0] -> baseline 1/3, unbiased var ((2/3)^2 + 2 (1/3)^2) / 2 = 1/3.
    std_others = math.sqrt(1.0 / 3.0)
    other = (0.0 - 1.0 / 3.0) / (std_others + 1e-6)
    close(adv, [[1.0, other, other, other]])


def test_plain_grpo_uses_group_mean_and_unbiased_group_std():
    adv = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), leave_one_out=False)
    # mean 0.25; unbiased var (0.75^2 + 3 * 0.25^2) / 3 = 0.25 -> std 0.5
    close(adv, [[0.75 / 0.500001, -0.25 / 0.500001, -0.25 / 0.500001, -0.25 / 0.500001]])


def test_dr_grpo_is_reward_minus_group_mean():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.5, 1.0, 0.0, 0.5]])
    adv = grpo_advantages(rewards, leave_one_out=False, normalize_std=False)
    close(adv, [[0.75, -0.25, -0.25, -0.25], [0.0, 0.5, -0.5, 0.0]])


def test_leave_one_out_without_std():
    adv = grpo_advantages(torch.tensor([[3.0, 1.0, 2.0]]), normalize_std=False)
    close(adv, [[3.0 - 1.5, 1.0 - 2.5, 2.0 - 2.0]])


def test_two_samples_leave_one_out_std_is_undefined_and_not_applied():
    close(grpo_advantages(torch.tensor([[1.0, 0.0]])), [[1.0, -1.0]])


def test_constant_groups_have_zero_advantage():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    for loo in (True, False):
        close(grpo_advantages(rewards, leave_one_out=loo), [[0.0] * 3, [0.0] * 3])


def test_groups_are_independent():
    a = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    b = torch.tensor([[5.0, -2.0, 0.5, 0.0]])
    both = grpo_advantages(torch.cat([a, b]))
    torch.testing.assert_close(both, torch.cat([grpo_advantages(a), grpo_advantages(b)]))


def test_bad_shapes_and_group_sizes_are_clear_errors():
    with pytest.raises(ValueError, match="num_prompts, group_size"):
        grpo_advantages(torch.zeros(4))
    with pytest.raises(ValueError, match="num_generations_per_prompt"):
        grpo_advantages(torch.zeros(3, 1))
    close(grpo_advantages(torch.tensor([[2.0]]), leave_one_out=False), [[0.0]])


def test_overlong_penalty_ramps_linearly_over_the_buffer():
    lengths = torch.tensor([5, 6, 7, 8, 10, 11])
    close(overlong_penalty(lengths, max_length=10, buffer=4), [0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    close(overlong_penalty(lengths, max_length=10, buffer=4, penalty=0.5), [0.0, 0.0, -0.125, -0.25, -0.5, -0.5])
    close(overlong_penalty(lengths, max_length=10, buffer=0), [0.0] * 6)
    with pytest.raises(ValueError, match="overlong_buffer"):
        overlong_penalty(lengths, max_length=10, buffer=11)


def test_dynamic_sampling_keeps_groups_with_reward_spread():
    rewards = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [0.5, 0.2]])
    keep = dynamic_sampling_keep(rewards)
    assert keep.tolist() == [1, 3]
    assert expand_group_indices(keep, 2).tolist() == [2, 3, 6, 7]
