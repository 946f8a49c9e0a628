"""Several environments in one run: each sample scored by the environment its problem names.

    step(message_logs, metadata)    metadata[i]["env"] names sample i's environment (a key of `envs`); the samples
                                    are split by name, each group scored by its environment in one call, and the
                                    results put back in the batch's order
    servers                         the resource-server environments among them: their problems are played in
                                    multi-turn episodes by the agent loop (mrl/algorithms/mixed_rollouts.py), not
                                    scored here

A sample naming no environment, or one this run lacks, is a programming error of the caller (the data loader tags
every problem with its source's environment, and the config check refuses unknown names), so it raises.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from mrl.environments.base import ENV, Environment, EnvironmentStep, Message
from mrl.environments.server_env import ServerEnvironment


class MixedEnvironment:
    """`Environment` over named environments; `shutdown` stops every one."""

    def __init__(self, envs: Mapping[str, Environment]) -> None:
        self.envs = dict(envs)
        self.servers = {name: env for name, env in self.envs.items() if isinstance(env, ServerEnvironment)}

    def step(self, message_logs: Sequence[Sequence[Message]], metadata: Sequence[Mapping[str, Any]]) -> EnvironmentStep:
        groups: dict[str, list[int]] = {}
        for i, meta in enumerate(metadata):
            name = meta.get(ENV)
            if name not in self.envs:
                raise KeyError(f"sample {i} names environment {name!r}; this run has {sorted(self.envs)}")
            if name in self.servers:
                raise TypeError(f"sample {i} is of the resource server {name!r}, whose episodes the agent loop plays")
            groups.setdefault(name, []).append(i)
        rewards = torch.zeros(len(metadata), dtype=torch.float32)
        done = torch.ones(len(metadata), dtype=torch.bool)
        observations: list[dict[str, str]] = [{} for _ in metadata]
        new_meta: list[dict[str, Any]] = [{} for _ in metadata]
        errors, messages = 0, []
        counts: dict[str, float] = {}
        for name, rows in groups.items():
            part = self.envs[name].step([message_logs[i] for i in rows], [metadata[i] for i in rows])
            index = torch.tensor(rows)
            rewards[index] = part.rewards.float()
            done[index] = part.done
            for j, i in enumerate(rows):
                observations[i] = part.observations[j]
                new_meta[i] = dict(part.metadata[j], **{ENV: name})
            errors += part.num_errors
            messages += [f"{name}: {message}" for message in part.error_messages]
            counts |= {f"env/{name}/{key}": value for key, value in part.counts.items()}
        return EnvironmentStep(rewards, observations, done, new_meta, errors, messages, counts)

    def shutdown(self) -> None:
        for env in self.envs.values():
            env.shutdown()
