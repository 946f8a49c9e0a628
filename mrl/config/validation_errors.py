"""Pydantic's validation errors as one user-facing ConfigError: each with its dotted key, the value given, and what
is allowed (a `Literal`'s choices, a number's range, a section's keys, with the field's description), an unknown key
with the keys known there and the nearest of them. Also the one rule pydantic's lax mode lacks: true/false is not a
number (it would read `max_num_steps=true` as 1)."""

from __future__ import annotations

import types
import typing
from typing import Any

import annotated_types
from pydantic import BaseModel, ValidationError

from mrl.config.errors import ConfigError, suggest


def errors_from_validation(exc: ValidationError, model: type[BaseModel], given_tree: dict[str, Any]) -> ConfigError:
    """One ConfigError listing every pydantic error with its dotted key, the given value and what is allowed."""
    problems: list[ConfigError] = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        key = ".".join(loc)
        inner = (err.get("ctx") or {}).get("error")
        if isinstance(inner, ConfigError):
            problems.extend(inner.problems or [inner])
        elif err["type"] == "extra_forbidden":
            problems.append(_unknown_key(model, loc, err.get("input")))
        elif err["type"] == "model_type" and loc:
            problems.append(_value_for_section(model, loc, err.get("input")))
        else:
            message = err["msg"].removeprefix("Value error, ")
            given = err.get("input") if loc else None
            problems.append(ConfigError(message, key=key or None, given=given, allowed=_allowed(model, loc)))
    return problems[0] if len(problems) == 1 else ConfigError("", problems=problems)


def _unknown_key(model: type[BaseModel], loc: list[str], given: Any) -> ConfigError:
    parent = _model_at(model, loc[:-1])
    known = sorted(parent.model_fields) if parent else []
    close = suggest(loc[-1], known)
    prefix = ".".join(loc[:-1])
    fix = f"did you mean '{prefix + '.' if prefix else ''}{close}'?" if close else None
    return ConfigError(
        "unknown key",
        key=".".join(loc),
        given=given,
        allowed=f"keys under {prefix or 'the top level'}: {', '.join(known)}",
        fix=fix,
    )


def _value_for_section(model: type[BaseModel], loc: list[str], given: Any) -> ConfigError:
    """A single value where a section (a nested model) belongs: its keys, and the switch to set when it has one."""
    section = _model_at(model, loc)
    keys = sorted(section.model_fields) if section else []
    key = ".".join(loc)
    fix: str | None = None
    if "enabled" in keys and isinstance(given, bool):
        fix = f"{key}.enabled={str(given).lower()}"
    elif keys:
        fix = f"set a key under it, e.g. {key}.{keys[0]}=<value>"
    return ConfigError(
        "is a section, not a single value",
        key=key,
        given=given,
        allowed=f"keys under {key}: {', '.join(keys)}",
        fix=fix,
    )


def takes_number_not_bool(annotation: Any) -> bool:
    """True for an int or float field (Optional or in a union with other non-bool types), which lax pydantic would
    fill from true/false."""
    args = typing.get_args(annotation) if isinstance(annotation, types.UnionType) or _is_union(annotation) else ()
    options = args or (annotation,)
    return bool not in options and any(option in (int, float) for option in options)


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) is typing.Union


def _model_at(model: type[BaseModel], loc: list[str]) -> type[BaseModel] | None:
    """The pydantic model class at a dotted location (list indices skipped), or None."""
    current: Any = model
    for part in loc:
        if part.isdigit():
            continue
        field = current.model_fields.get(part) if isinstance(current, type) and issubclass(current, BaseModel) else None
        if field is None:
            return None
        current = _unwrap(field.annotation)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _unwrap(annotation: Any) -> Any:
    """Optional[X] / list[X] -> X, so nested models can be found."""
    for arg in getattr(annotation, "__args__", ()) or ():
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return annotation


def _allowed(model: type[BaseModel], loc: list[str]) -> str | None:
    """The `Literal` choices, a number's range or a switch's values, with the description of the field at `loc`, when
    there is one."""
    parent = _model_at(model, loc[:-1])
    field = parent.model_fields.get(loc[-1]) if parent and loc else None
    if field is None:
        return None
    choices = getattr(field.annotation, "__args__", ())
    if getattr(field.annotation, "__origin__", None) is not None and str(field.annotation).startswith("typing.Literal"):
        return "one of " + ", ".join(repr(c) for c in choices)
    bounds = [_BOUNDS[type(m)](m) for m in field.metadata if type(m) in _BOUNDS]
    if takes_number_not_bool(field.annotation):
        kind = "an integer" if int in (typing.get_args(field.annotation) or (field.annotation,)) else "a number"
        kind += " " + " and ".join(bounds) if bounds else ""
        return f"{kind} ({field.description})" if field.description else kind
    values = _boolean_kind(field.annotation)
    if values is not None:
        return f"{values} ({field.description})" if field.description else values
    return field.description


def _boolean_kind(annotation: Any) -> str | None:
    """The values a bool field takes ("true or false"), or an Optional[bool] one ("true, false or null"); None for
    any other annotation."""
    if annotation is bool:
        return "true or false"
    if set(typing.get_args(annotation)) == {bool, type(None)}:
        return "true, false or null"
    return None


_BOUNDS = {
    annotated_types.Ge: lambda m: f">= {m.ge}",
    annotated_types.Gt: lambda m: f"> {m.gt}",
    annotated_types.Le: lambda m: f"<= {m.le}",
    annotated_types.Lt: lambda m: f"< {m.lt}",
}
