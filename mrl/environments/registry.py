"""Build the environment a config names (`env.kind`), or the named ones of a run with several (`envs`)."""

from __future__ import annotations

from typing import Any

from mrl.environments.base import Environment


def build_environment(cfg: Any, key: str = "env") -> Environment:
    """From an `EnvConfig`: "math" starts a pool of verifier actors (needs Ray running), "arith" and "reasoning_gym"
    run in-process, "code" runs each program in a sandbox pool, "server" is a resource server played in multi-turn
    episodes (an example one is started here), "nemo_gym" a NeMo Gym server (started here from its own Python);
    `key` is the environment's config key (env, envs.<name>), for errors."""
    if cfg.kind == "math":
        from mrl.environments.math import MathEnvironment

        return MathEnvironment.from_config(cfg)
    if cfg.kind == "arith":
        from mrl.environments.arith import ArithEnvironment

        return ArithEnvironment()
    if cfg.kind == "reasoning_gym":
        from mrl.environments.reasoning_gym import ReasoningGymEnvironment

        return ReasoningGymEnvironment(partial_credit=cfg.partial_credit)
    if cfg.kind == "code":
        from mrl.environments.code.environment import CodeEnvironment

        return CodeEnvironment(cfg.code, key=f"{key}.code")
    if cfg.kind == "server":
        from mrl.environments.server_env import ServerEnvironment

        if cfg.server is None:
            raise ValueError("env.kind=server needs the env.server section (example or url, tool format, limits)")
        return ServerEnvironment(cfg.server)
    if cfg.kind == "nemo_gym":
        from mrl.environments.nemo_gym.environment import NemoGymEnvironment

        if cfg.nemo_gym is None:
            raise ValueError("env.kind=nemo_gym needs the env.nemo_gym section (server, config, limits)")
        return NemoGymEnvironment(cfg.nemo_gym, key=f"{key}.nemo_gym")
    raise ValueError(
        f"unknown env.kind {cfg.kind!r}; use 'math', 'arith', 'reasoning_gym', 'code', 'server' or 'nemo_gym'"
    )


def build_run_environment(cfg: Any) -> Environment:
    """The run's environment: the one `env`, or a `MixedEnvironment` over `envs` (each sample scored by the
    environment its problem's source names). An environment that fails to start stops those already started."""
    if not cfg.envs:
        return build_environment(cfg.env)
    from mrl.environments.mixed import MixedEnvironment

    started: dict[str, Environment] = {}
    try:
        for name, env_cfg in cfg.envs.items():
            started[name] = build_environment(env_cfg, key=f"envs.{name}")
    except BaseException:
        MixedEnvironment(started).shutdown()
        raise
    return MixedEnvironment(started)
