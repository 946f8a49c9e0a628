"""Build the environment a config names (`env.kind`), or the named ones of a run with several (`envs`)."""

from __future__ import annotations

from typing import Any

from mrl.environments.base import Environment


def build_environment(cfg: Any) -> Environment:
    """From an `EnvConfig`: "math" starts a pool of verifier actors (needs Ray running), "arith" and "reasoning_gym"
    run in-process, "server" is a resource server played in multi-turn episodes (an example one is started here)."""
    if cfg.kind == "math":
        from mrl.environments.math import MathEnvironment

        return MathEnvironment.from_config(cfg)
    if cfg.kind == "arith":
        from mrl.environments.arith import ArithEnvironment

        return ArithEnvironment()
    if cfg.kind == "reasoning_gym":
        from mrl.environments.reasoning_gym import ReasoningGymEnvironment

        return ReasoningGymEnvironment(partial_credit=cfg.partial_credit)
    if cfg.kind == "server":
        from mrl.environments.server_env import ServerEnvironment

        if cfg.server is None:
            raise ValueError("env.kind=server needs the env.server section (example or url, tool format, limits)")
        return ServerEnvironment(cfg.server)
    raise ValueError(f"unknown env.kind {cfg.kind!r}; use 'math', 'arith', 'reasoning_gym' or 'server'")


def build_run_environment(cfg: Any) -> Environment:
    """The run's environment: the one `env`, or a `MixedEnvironment` over `envs` (each sample scored by the
    environment its problem's source names). An environment that fails to start stops those already started."""
    if not cfg.envs:
        return build_environment(cfg.env)
    from mrl.environments.mixed import MixedEnvironment

    started: dict[str, Environment] = {}
    try:
        for name, env_cfg in cfg.envs.items():
            started[name] = build_environment(env_cfg)
    except BaseException:
        MixedEnvironment(started).shutdown()
        raise
    return MixedEnvironment(started)
