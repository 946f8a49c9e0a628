"""Configuration: YAML with `defaults:` inheritance, Hydra-grammar overrides, one validated pydantic tree."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import yaml
from pydantic import ValidationError

from mrl.config.errors import CONFIG_ERROR_EXIT_CODE, ConfigError
from mrl.config.loader import apply_overrides, deep_merge, load_yaml_tree, resolve
from mrl.config.recipes import find_recipe
from mrl.config.schema import MrlConfig
from mrl.config.validation_errors import errors_from_validation

__all__ = ["CONFIG_ERROR_EXIT_CODE", "ConfigError", "MrlConfig", "load_config", "validate_tree", "to_yaml"]


def validate_tree(tree: dict[str, Any]) -> MrlConfig:
    """Validate a resolved dict against the schema; every problem is reported in one ConfigError."""
    try:
        return MrlConfig.model_validate(tree)
    except ValidationError as exc:
        raise errors_from_validation(exc, MrlConfig, tree) from None


def load_config(path: str | Path | None, overrides: Iterable[str] = ()) -> MrlConfig:
    """Load, override, resolve and validate a config file (None: the schema defaults and the overrides alone); a
    path that names no file may name a shipped recipe (`mrl.config.recipes.find_recipe`).

    The schema defaults are merged under the file before interpolations resolve, so `${run.output_dir}` works
    whether or not the file sets it.
    """
    tree = apply_overrides({} if path is None else load_yaml_tree(find_recipe(path)), overrides)
    return validate_tree(resolve(deep_merge(schema_defaults(), tree)))


def schema_defaults() -> dict[str, Any]:
    """The default tree as plain data (what a recipe that sets nothing would run with)."""
    return MrlConfig().model_dump(mode="json")


def to_yaml(cfg: MrlConfig) -> str:
    """The full tree (defaults included) as YAML, in schema order."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, default_flow_style=False, width=120)
