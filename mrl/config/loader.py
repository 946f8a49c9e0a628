"""Load a YAML config tree: `defaults:` inheritance, Hydra-grammar overrides, interpolation.

The loader produces a plain dict; `mrl.config.schema.MrlConfig` validates it. Defaults live only in the schema, so a
recipe holds just what it changes.

Inheritance: a file may start with `defaults: base.yaml` or `defaults: [a.yaml, b.yaml]`, resolved relative to the
file. Bases merge left to right, then the file itself on top (dicts merge key by key, anything else replaces).
A base's `expect:` (the figures `mrl check` holds a run of that recipe to) is not inherited: its figures describe
the base's own run, not the new recipe's.

Overrides (Hydra's grammar, parsed with Hydra's own parser):
- `a.b=v`   set a key; whether the key exists is checked against the schema, not the YAML (defaults are not in
            the YAML), so a misspelt key is reported by validation with a suggestion;
- `+a.b=v`  add a key that the YAML does not set yet (an error if it does);
- `++a.b=v` set a key whether or not it is there;
- `~a.b`    remove a key (it falls back to the schema default).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Hashable, Iterable

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mrl.config.errors import ConfigError, not_utf8


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key that a mapping holds twice (PyYAML keeps the last silently: a second
    `policy:` block would drop the first's settings)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if not isinstance(key, Hashable):
                break  # the safe loader's own error names it
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} appears twice (lines {seen[key]} and {line})", key_node.start_mark
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml_tree(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read `path` with its `defaults:` chain merged in; returns a plain dict (interpolations unresolved)."""
    path = Path(path).resolve()
    if path in _seen:
        chain = " -> ".join(str(p.name) for p in (*_seen, path))
        raise ConfigError(f"defaults form a cycle: {chain}", key="defaults")
    if not path.is_file():
        found = "is a folder, not a config file" if path.is_dir() else "not found"
        named_by = f"the defaults: of {_seen[-1]}" if _seen else "the --config path"
        raise ConfigError(f"config file {found}: {path}", fix=f"check {named_by}")
    data = _read_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path.name} must hold a mapping at the top level, got {type(data).__name__}")
    bases = data.pop("defaults", None) or []
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise ConfigError(f"{path.name}: 'defaults' must be a file name or a list of file names", key="defaults")
    merged: dict[str, Any] = {}
    for base in bases:
        inherited = load_yaml_tree(path.parent / base, (*_seen, path))
        inherited.pop("expect", None)  # the base's figures are its own run's
        merged = deep_merge(merged, inherited)
    return deep_merge(merged, data)


def _read_yaml(path: Path) -> Any:
    """The YAML document in `path`; a file that is not UTF-8 text or not YAML is a ConfigError naming the file (the
    parser's own message names "<unicode string>"), with the fix for indentation by tabs."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise not_utf8(
            path,
            what="a YAML config",
            binary_fix="name the recipe's YAML file (with --config, in a defaults: list, or as a stage's config:)",
        ) from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as exc:
        marks = [m for m in (getattr(exc, "context_mark", None), getattr(exc, "problem_mark", None)) if m is not None]
        for mark in marks:
            mark.name = str(path)
        lines = text.splitlines()
        tabbed = [m.line + 1 for m in marks if m.line < len(lines) and "\t" in _indent(lines[m.line])]
        fix = f"indent with spaces, not tabs (line {tabbed[0]})" if tabbed else None
        if not tabbed and marks and "'\\t'" in str(getattr(exc, "problem", "")):  # a tab after the indentation
            fix = f"write spaces for the tab (line {marks[-1].line + 1}, column {marks[-1].column + 1})"
        message = str(exc).replace("\n", "\n    ")
        raise ConfigError(f"{path.name} is not valid YAML: {message}", fix=fix) from None


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """Merge `top` over `base`: nested dicts merge key by key; lists and scalars from `top` replace."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def apply_overrides(tree: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Apply command-line overrides in Hydra's grammar to `tree` (a new dict is returned)."""
    overrides = list(overrides)
    if not overrides:
        return tree
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    cfg = OmegaConf.create(tree)
    parser = OverridesParser.create()
    for text in overrides:
        try:
            (ov,) = parser.parse_overrides([text])
        except OverrideParseException as exc:
            bare_key = "=" not in text and text.replace(".", "").replace("_", "").isalnum()
            raise ConfigError(
                f"cannot parse override '{text}': {exc.message.splitlines()[0]}",
                fix=f"give it a value: {text}=<value> (or ~{text} to drop it)"
                if bare_key
                else "write key=value, +key=value, ++key=value or ~key; a list is key=[1,2] (the whole override "
                "in quotes for the shell when it has spaces: 'key=[1, 2]')",
            ) from None
        key = ov.key_or_group
        if ov.is_sweep_override():
            raise _sweep_error(text, key, ov.value_type)
        present = OmegaConf.select(cfg, key, default=_MISSING, throw_on_missing=False) is not _MISSING
        if ov.is_delete():
            if not present:
                raise ConfigError("cannot delete a key the config does not set", key=key, given=text)
            _delete(cfg, key)
            continue
        if ov.is_add() and present:
            raise ConfigError(
                "'+' adds a key that is not set yet, but this one is",
                key=key,
                given=text,
                fix=f"use {key}=... or ++{key}=...",
            )
        value = ov.value()
        try:
            OmegaConf.update(cfg, key, value, merge=False, force_add=True)
        except OmegaConfBaseException as exc:
            raise ConfigError(f"cannot set: {exc.msg if hasattr(exc, 'msg') else exc}", key=key, given=text) from None
    return OmegaConf.to_container(cfg, resolve=False)  # type: ignore[return-value]  # a DictConfig gives a dict


def _sweep_error(text: str, key: str, kind: Any) -> ConfigError:
    """Hydra's sweep syntax (`k=1,4`, `k=range(1,4)`, `k=choice(a,b)`) asks for one run per value, which mrl does not
    start; a list is written in brackets."""
    from hydra.core.override_parser.types import ValueType

    setting, _, value = text.partition("=")
    if kind == ValueType.SIMPLE_CHOICE_SWEEP and not value.startswith("shuffle("):
        return ConfigError(
            "a comma-separated value is Hydra's sweep (one run per value), which mrl does not run",
            key=key,
            given=text,
            fix=f"write a list in brackets: {setting}=[{value}] (a text with a comma in quotes: "
            f"'{setting}=\"{value}\"')",
        )
    return ConfigError(
        f"{value.partition('(')[0]}(...) is Hydra's sweep (one run per value), which mrl does not run",
        key=key,
        given=text,
        fix=f"give one value, or a list in brackets: {setting}=[a,b]",
    )


def resolve(tree: dict[str, Any]) -> dict[str, Any]:
    """Resolve `${...}` interpolations; a broken reference is a ConfigError naming it."""
    cfg: DictConfig = OmegaConf.create(tree)
    try:
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]  # a DictConfig gives a dict
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or None
        raise ConfigError(f"interpolation failed: {str(getattr(exc, 'msg', exc)).splitlines()[0]}", key=key) from None


class _Missing:
    pass


_MISSING = _Missing()


def _delete(cfg: DictConfig, key: str) -> None:
    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    del parent[leaf]
