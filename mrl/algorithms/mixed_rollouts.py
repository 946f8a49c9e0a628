"""A run whose environments include resource servers (`envs` with `kind: server` beside single-turn ones): a step's
problems split by environment, each part rolled out its own way, the parts joined into one batch.

    single-turn problems   -> generate_and_score: one engine call, each sample scored by its environment
    a server's problems    -> agent_rollouts: multi-turn episodes against that server, its /verify's reward
    joined                 -> concat_rollouts: whole groups each, so GRPO's groups stay intact; every row tagged with
                              its environment, whose figures per_env_metrics reports (the server's own figures as
                              train/env/<name>/<figure>)

Validation splits the same way: the single-turn problems through `validate` (their samples to val_samples/), each
server's through `validate_episodes`; `val/accuracy` is the mean over every validation sample of both.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Sequence

from mrl.algorithms.agent import agent_rollouts, validate_episodes
from mrl.algorithms.evaluate import Evaluation, validate
from mrl.algorithms.rollout import Rollouts, concat_rollouts, generate_and_score
from mrl.data.datasets import Problem
from mrl.data.tasks import TaskData
from mrl.environments.mixed import MixedEnvironment
from mrl.inference.interface import GenerationBackend, SamplingConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def mixed_rollouts(
    env: MixedEnvironment,
    engine: GenerationBackend,
    tokenizer: "PreTrainedTokenizerBase",
    data: TaskData,
    problems: Sequence[Problem],
    prompts: Sequence[Sequence[int]],
    sampling: SamplingConfig,
) -> tuple[Rollouts, dict[str, float]]:
    """The step's rollouts (see the module docstring) and the servers' figures, each under its environment's name."""
    parts: list[Rollouts] = []
    metrics: dict[str, float] = {}
    single = [i for i, p in enumerate(problems) if p.env not in env.servers]
    if single:
        parts.append(
            generate_and_score(
                engine, env, tokenizer, [problems[i] for i in single], [prompts[i] for i in single], sampling
            )
        )
    for name, server in env.servers.items():
        mine = [i for i, p in enumerate(problems) if p.env == name]
        if not mine:
            continue
        template = data.template_of(problems[mine[0]])
        rollouts, figures = agent_rollouts(
            server, engine, tokenizer, template, [problems[i] for i in mine], [prompts[i] for i in mine], sampling
        )
        rollouts.envs = [name] * len(rollouts.responses)
        parts.append(rollouts)
        metrics |= {_named(key, name): value for key, value in figures.items()}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return concat_rollouts(parts, pad), metrics


def _named(key: str, name: str) -> str:
    """A server's figure under its environment's name: train/env_turns -> train/env/<name>/turns, train/env/x ->
    train/env/<name>/x."""
    prefix, _, figure = key.partition("/")
    figure = figure.removeprefix("env/").removeprefix("env_")
    return f"{prefix}/env/{name}/{figure}"


def validate_mixed(
    cfg: Any, workers: Any, env: MixedEnvironment, data: TaskData
) -> tuple[dict[str, float], Evaluation | None]:
    """Validation metrics of every environment, and the single-turn part's evaluation (its samples; None without
    single-turn validation problems)."""
    single = replace(data, val=[p for p in data.val if p.env not in env.servers])
    evaluation = validate(cfg, workers.engine, env, workers.tokenizer, single) if single.val else None
    metrics = dict(evaluation.metrics) if evaluation else {}
    counted = [(metrics.get("val/accuracy", 0.0), len(evaluation.samples) if evaluation else 0)]
    for name, server in env.servers.items():
        part = replace(data, val=[p for p in data.val if p.env == name])
        figures = validate_episodes(cfg, workers, server, part)
        if not figures:
            continue
        episodes = int(figures.pop("val/episodes"))
        counted.append((figures["val/accuracy"], episodes))
        metrics |= {_named(key, name): value for key, value in figures.items()}
        metrics[f"val/env/{name}/samples"] = float(episodes)
    total = sum(count for _, count in counted)
    if total:
        metrics["val/accuracy"] = sum(accuracy * count for accuracy, count in counted) / total
    return metrics, evaluation


@dataclass(frozen=True)
class _Generator:
    """What validation needs of the workers: the engine and the tokenizer (`mrl eval` has no policy)."""

    engine: GenerationBackend
    tokenizer: Any


def validate_all(
    cfg: Any, engine: GenerationBackend, tokenizer: Any, env: Any, data: TaskData
) -> tuple[dict[str, float], Evaluation | None]:
    """Validation of any run's environment: single-turn samples (`validate`), a resource server's episodes
    (`validate_episodes`), or a mix of both (`validate_mixed`); the metrics and the single-turn part's evaluation
    (None without one)."""
    from mrl.environments.server_env import ServerEnvironment

    generator = _Generator(engine, tokenizer)
    if isinstance(env, ServerEnvironment):
        return validate_episodes(cfg, generator, env, data), None
    if isinstance(env, MixedEnvironment) and env.servers:
        return validate_mixed(cfg, generator, env, data)
    result = validate(cfg, engine, env, tokenizer, data)
    return (result.metrics if result else {}), result
