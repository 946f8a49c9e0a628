"""Build the environment a config names (`env.kind`)."""

from __future__ import annotations

from typing import Any

from mrl.environments.base import Environment


def build_environment(cfg: Any) -> Environment:
    """From an `EnvConfig`: "math" starts a pool of verifier actors (needs Ray running), "arith" runs in-process."""
    if cfg.kind == "math":
        from mrl.environments.math import MathEnvironment

        return MathEnvironment.from_config(cfg)
    if cfg.kind == "arith":
        from mrl.environments.arith import ArithEnvironment

        return ArithEnvironment()
    raise ValueError(f"unknown env.kind {cfg.kind!r}; use 'math' or 'arith'")
