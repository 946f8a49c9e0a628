"""The config's rules for environments: a run with several (`envs` + `data.sources`), each source's rows and
environment, reasoning-gym's task weights. Called by mrl/config/checks.py with its other cross-field rules."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Optional

from mrl.config.errors import ConfigError, suggest

if TYPE_CHECKING:
    from mrl.config.schema import MrlConfig

_ENV_NAME = re.compile(r"[A-Za-z0-9_-]+")


def environment_problems(cfg: "MrlConfig") -> list[ConfigError]:
    """A run with several environments (`envs` + `data.sources`): both or neither, every source naming a known
    environment and one kind of rows, weights that sum to something positive."""
    data, envs = cfg.data, cfg.envs
    if not envs and not data.sources:
        if cfg.env.kind == "nemo_gym" and cfg.env.nemo_gym is None:
            return [
                ConfigError(
                    "a NeMo Gym environment needs its nemo_gym section",
                    key="env.nemo_gym",
                    fix="env.nemo_gym={server: workplace_assistant} (a folder of NeMo Gym's resources_servers)",
                )
            ]
        return []
    if not data.sources:
        return [
            ConfigError(
                "`envs` names environments but no data source uses them",
                key="data.sources",
                fix="add data.sources, one per dataset: {env: NAME, train: FILE, weight: W}",
            )
        ]
    if not envs:
        return [
            ConfigError(
                "data.sources name environments, and `envs` defines none",
                key="envs",
                fix="define each source's environment: envs: {NAME: {kind: arith}}",
            )
        ]
    out = [_env_problem(name, env) for name, env in envs.items()]
    single = [key for key in ("train", "val", "arith") if getattr(data, key) is not None]
    if single:
        out.append(
            ConfigError(
                f"data.{single[0]} and data.sources both give the rows",
                key=f"data.{single[0]}",
                fix=f"move data.{single[0]} into a source of data.sources (or drop data.sources)",
            )
        )
    for i, source in enumerate(data.sources):
        out += _source_problems(f"data.sources[{i}]", source, sorted(envs))
    weights = [source.weight for source in data.sources]
    if sum(weights) <= 0:
        out.append(
            ConfigError(
                "the sources' weights sum to 0: no source would give a training prompt",
                key="data.sources",
                given=weights,
                allowed="weights >= 0 summing to more than 0",
                fix="give the sources to train on a positive weight (e.g. 1 each)",
            )
        )
    used = {source.env for source in data.sources}
    unused = [name for name in envs if name not in used and None not in used]  # rows may name any (data.env_key)
    out += [
        ConfigError(
            f"envs.{name} is named by no data source",
            key=f"envs.{name}",
            fix=f"add a source with env: {name}, or remove envs.{name}",
        )
        for name in unused
    ]
    return [problem for problem in out if problem is not None]


def _env_problem(name: str, env: Any) -> Optional[ConfigError]:
    """What a named environment cannot be: its name must fit a metric name; a server needs its section; no reward
    model (yet)."""
    if not _ENV_NAME.fullmatch(name):
        return ConfigError(
            "an environment's name becomes part of metric names",
            key=f"envs.{name}",
            given=name,
            allowed="letters, digits, '_' and '-'",
            fix="rename it, e.g. envs.my_task",
        )
    if env.kind == "server" and env.server is None:
        return ConfigError(
            "a resource-server environment needs its server section",
            key=f"envs.{name}.server",
            fix=f"envs.{name}.server={{example: guess_number}}, or {{url: http://HOST:PORT}} of a running server",
        )
    if env.kind == "nemo_gym" and env.nemo_gym is None:
        return ConfigError(
            "a NeMo Gym environment needs its nemo_gym section",
            key=f"envs.{name}.nemo_gym",
            fix=f"envs.{name}.nemo_gym={{server: workplace_assistant}} (a folder of NeMo Gym's resources_servers)",
        )
    if env.reward_model is not None:
        return ConfigError(
            "a reward model cannot score one environment of several yet",
            key=f"envs.{name}.reward_model",
            fix="drop it, or train on that environment alone with env.reward_model",
        )
    return None


def _source_problems(key: str, source: Any, names: list[str]) -> list[ConfigError]:
    out = _reasoning_gym_problems(f"{key}.reasoning_gym", source.reasoning_gym)
    if source.env is None and (source.arith is not None or source.reasoning_gym is not None):
        out.append(
            ConfigError(
                "generated rows name no environment",
                key=f"{key}.env",
                fix=f"set {key}.env to one of: {', '.join(names)}",
            )
        )
    elif source.env is not None and source.env not in names:
        near = suggest(source.env, names)
        out.append(
            ConfigError(
                f"no environment named {source.env!r}",
                key=f"{key}.env",
                given=source.env,
                allowed=", ".join(names),
                fix=f"{key}.env={near or names[0]}, or add it to envs",
            )
        )
    files = source.train is not None or source.val is not None
    kinds = [
        kind
        for kind, given in (("files", files), ("arith", source.arith), ("reasoning_gym", source.reasoning_gym))
        if given
    ]
    if len(kinds) != 1:
        out.append(
            ConfigError(
                "a source gives its rows from files (train, val), the arithmetic task or reasoning-gym: one of them",
                key=key,
                given=" and ".join(kinds) or "none",
                fix=f"set {key}.train (and .val), {key}.arith or {key}.reasoning_gym",
            )
        )
    elif source.weight > 0 and files and source.train is None:
        out.append(
            ConfigError(
                "a source with a weight trains on its rows, and this one has no training rows",
                key=f"{key}.weight",
                given=source.weight,
                fix=f"set {key}.train, or {key}.weight=0 (validation only)",
            )
        )
    return out


def _reasoning_gym_problems(key: str, rg: Any) -> list[ConfigError]:
    """The task weights of a reasoning-gym source (names and configs are checked where the rows are generated,
    against the installed package)."""
    if rg is None:
        return []
    weights = list(rg.tasks.values())
    if not weights or min(weights) < 0 or sum(weights) <= 0:
        return [
            ConfigError(
                "reasoning-gym's task weights must be >= 0 and sum to more than 0",
                key=f"{key}.tasks",
                given=dict(rg.tasks),
                fix=f"{key}.tasks={{basic_arithmetic: 1, chain_sum: 1}}: each task to draw with a positive weight",
            )
        ]
    unused = sorted(set(rg.config) - set(rg.tasks))
    if unused:
        return [
            ConfigError(
                f"a config for tasks the source does not draw: {unused}",
                key=f"{key}.config",
                allowed=", ".join(sorted(rg.tasks)),
                fix=f"add them to {key}.tasks, or remove their configs",
            )
        ]
    return []
