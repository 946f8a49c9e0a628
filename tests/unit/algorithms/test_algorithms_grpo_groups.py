"""Which groups a GRPO step trains on: all of them, or with grpo.dynamic_sampling only those whose rewards differ, as
a [P] mask that the step expands to its [P * G] samples (the step once took the kept groups' indices for that mask
and failed on the first step of every run with dynamic sampling)."""

from __future__ import annotations

import torch

from mrl.algorithms.grpo import _groups_kept


def test_dynamic_sampling_keeps_the_groups_whose_rewards_differ_as_a_mask_over_groups():
    rewards = torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [0.5, 0.0, 0.0, 0.0],
                            [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    kept = _groups_kept(rewards, dynamic_sampling=True)
    assert kept.dtype == torch.bool and kept.tolist() == [True, False, False, True, False, False]
    assert kept.repeat_interleave(4).tolist() == [True] * 4 + [False] * 8 + [True] * 4 + [False] * 8
    assert _groups_kept(rewards, dynamic_sampling=False).tolist() == [True] * 6
    assert _groups_kept(torch.ones(3, 2), dynamic_sampling=True).tolist() == [False] * 3
