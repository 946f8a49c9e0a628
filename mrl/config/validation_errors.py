"""Pydantic's validation errors as one user-facing ConfigError: each with its dotted key, the value given, and what
is allowed (a `Literal`'s choices or the field's description), an unknown key with the keys known there and the
nearest of them."""

from __future__ import annotations

from typing import Any

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
        else:
            problems.append(
                ConfigError(
                    err["msg"], key=key or None, given=err.get("input") if loc else None, allowed=_allowed(model, loc)
                )
            )
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
    """The `Literal` choices or the description of the field at `loc`, when there is one."""
    parent = _model_at(model, loc[:-1])
    field = parent.model_fields.get(loc[-1]) if parent and loc else None
    if field is None:
        return None
    choices = getattr(field.annotation, "__args__", ())
    if getattr(field.annotation, "__origin__", None) is not None and str(field.annotation).startswith("typing.Literal"):
        return "one of " + ", ".join(repr(c) for c in choices)
    return field.description
