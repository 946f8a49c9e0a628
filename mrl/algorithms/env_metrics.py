"""Metrics of each environment in a run with several (`envs`): the run's figures, split by the environment each row
was scored by.

    <prefix>/env/<name>/reward (train) or /accuracy (val)   mean reward of its samples
    <prefix>/env/<name>/response_length                     mean response tokens
    <prefix>/env/<name>/truncated_fraction                  responses cut at max_new_tokens
    <prefix>/env/<name>/reward_error_fraction               samples whose reward failed (scored 0)
    <prefix>/env/<name>/zero_variance_groups                prompts whose samples all scored alike (nothing to learn)
    <prefix>/env/<name>/samples                             its samples in the batch

Rows are prompt-major (`group_size` consecutive samples per prompt) and a prompt's samples share its environment, so
an environment's rows are whole groups.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mrl.algorithms.rollout import Rollouts


def per_env_metrics(prefix: str, rollouts: "Rollouts", group_size: int) -> dict[str, float]:
    """The figures above for every environment of `rollouts` ({} in a run with one)."""
    out: dict[str, float] = {}
    for name in sorted(set(rollouts.envs)):
        rows = [i for i, env in enumerate(rollouts.envs) if env == name]
        index = torch.tensor(rows)
        rewards = rollouts.rewards[index].float()
        base = f"{prefix}/env/{name}"
        groups = rewards.view(-1, group_size)
        errored = [rollouts.reward_errored[i] for i in rows] if rollouts.reward_errored else []
        out |= {
            f"{base}/{'accuracy' if prefix == 'val' else 'reward'}": float(rewards.mean()),
            f"{base}/response_length": float(rollouts.response_lengths[index].float().mean()),
            f"{base}/truncated_fraction": float(rollouts.truncated[index].float().mean()),
            f"{base}/reward_error_fraction": sum(errored) / len(rows),
            f"{base}/zero_variance_groups": float((groups.amax(dim=1) == groups.amin(dim=1)).float().mean()),
            f"{base}/samples": float(len(rows)),
        }
    return out
