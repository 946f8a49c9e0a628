"""The configuration reference (docs: Reference > Configuration), generated from the schema in mrl/config/schema.py.

`config_reference_markdown()` walks `MrlConfig` in declaration order and writes one section per sub-model (a heading
named by its dotted path, the model's docstring, then a table of its keys: dotted path, type, default, allowed values
from `Literal` choices and `ge`/`gt`/`le`/`lt` bounds, description). The docs build calls it from an MkDocs hook
(docs/hooks/config_reference.py), so the page is made from the schema on every build and never committed: it cannot
drift from the code.
"""

from __future__ import annotations

import html
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from mrl.config.schema import MrlConfig

PAGE_PATH = "reference/config.md"

_INTRO = """\
# Configuration reference

Every key of an mrl configuration: its dotted path, type, default, the values it accepts and what it does. A recipe
YAML sets any of them, and an override on the command line changes one (`policy.optimizer.lr=3e-6`, Hydra's grammar).
Unknown keys are errors, and so are values outside the allowed ones.

!!! note "Generated"
    This page is written from the schema (`mrl/config/schema.py`, root model `MrlConfig`) each time the docs are built;
    it always matches the code it was built from. `mrl config show` prints the defaults as YAML.
"""

_BOUNDS = (
    (annotated_types.Ge, "ge", "≥"),
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Le, "le", "≤"),
    (annotated_types.Lt, "lt", "<"),
)


def config_reference_markdown(root: type[BaseModel] = MrlConfig) -> str:
    """The reference page for `root` as Markdown: an introduction, then one section per sub-model."""
    parts = [_INTRO]
    _section(parts, root, path="", depth=0, intro=None, optional=False, is_list=False)
    return "\n".join(parts).rstrip() + "\n"


def format_default(value: Any) -> str:
    """A default as it is written in YAML (`null`, `true`, `1.0e-06`, `[1]`); strings as they are."""
    if isinstance(value, str):
        return value
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 16).strip()
    return text[: -len("...")].strip() if text.endswith("...") else text


# ----------------------------------------------------------------------------------------------------- the sections
def _section(
    parts: list[str], model: type[BaseModel], path: str, depth: int, intro: str | None, optional: bool, is_list: bool
) -> None:
    leaves: list[tuple[str, FieldInfo]] = []
    children: list[tuple[str, FieldInfo, type[BaseModel], bool, bool]] = []
    for name, field in model.model_fields.items():
        sub, sub_optional, sub_list = _sub_model(field.annotation)
        if sub is None:
            leaves.append((name, field))
        else:
            children.append((name, field, sub, sub_optional, sub_list))

    if path:
        level = "#" * min(depth + 1, 4)
        parts.append(f"{level} `{path}`\n")
        notes = [text for text in (None if optional or is_list else intro, _doc(model)) if text]
        if optional:
            notes.append(
                "An optional section: `null` by default (off); set it to a mapping of the keys below to turn it on."
            )
        if is_list:
            notes.append(f"A list (empty by default); each item is a mapping of the keys below (`{path}[i].key`).")
        parts.extend(f"{_escape(note)}\n" for note in notes)
    if leaves or optional or is_list:
        parts.append("| Key | Type | Default | Allowed | Description |")
        parts.append("| --- | --- | --- | --- | --- |")
    if optional or is_list:  # the section's own key: set as a whole
        key = path.removesuffix("[]")
        kind, default = ("list of mappings", "[]") if is_list else ("mapping or null", "null")
        parts.append(f"| `{key}` | {kind} | `{default}` |  | {_escape(intro or '')} |")
    if leaves:
        for name, field in leaves:
            key = f"{path}.{name}" if path else name
            parts.append(
                "| "
                + " | ".join(
                    (
                        f"`{key}`",
                        _escape(_type_name(field.annotation)),
                        _default_cell(field),
                        _escape(_allowed(field)),
                        _escape(field.description or ""),
                    )
                )
                + " |"
            )
        parts.append("")
    for name, field, sub, sub_optional, sub_list in children:
        sub_path = f"{path}.{name}" if path else name
        if sub_list:
            sub_path += "[]"
        _section(parts, sub, sub_path, depth + 1, field.description, sub_optional, sub_list)


def _sub_model(annotation: Any) -> tuple[type[BaseModel] | None, bool, bool]:
    """(the model, optional?, list of it?) when a field holds a sub-model; (None, ...) for a leaf."""
    optional = False
    if _is_union(annotation):
        args = [a for a in get_args(annotation) if a is not type(None)]
        optional = len(args) < len(get_args(annotation))
        if len(args) != 1:
            return None, False, False
        annotation = args[0]
    if get_origin(annotation) is list:
        (item,) = get_args(annotation) or (Any,)
        if isinstance(item, type) and issubclass(item, BaseModel):
            return item, optional, True
        return None, False, False
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, optional, False
    return None, False, False


def _is_union(annotation: Any) -> bool:
    return get_origin(annotation) in (Union, types.UnionType)


# ------------------------------------------------------------------------------------------------------ the cells
def _type_name(annotation: Any) -> str:
    if _is_union(annotation):
        args = get_args(annotation)
        names = [_type_name(a) for a in args if a is not type(None)]
        return " or ".join(names) + (" or null" if type(None) in args else "")
    origin = get_origin(annotation)
    if origin is Literal:
        kinds = sorted({type(a).__name__ for a in get_args(annotation)})
        return " or ".join(kinds)
    if origin is list:
        (item,) = get_args(annotation) or (Any,)
        return f"list of {_type_name(item)}"
    if annotation is typing.Any:
        return "any"
    return getattr(annotation, "__name__", str(annotation))


def _default_cell(field: FieldInfo) -> str:
    if field.is_required():
        return "*required*"
    value = field.get_default(call_default_factory=True)  # the schema's factories take no arguments
    if value is PydanticUndefined:
        return "*required*"
    return _code(format_default(value))


def _allowed(field: FieldInfo) -> str:
    choices = _literal_choices(field.annotation)
    found = [" or ".join(f"`{c}`" for c in choices)] if choices else []
    for meta in field.metadata:
        for kind, attribute, sign in _BOUNDS:
            if isinstance(meta, kind):
                found.append(f"{sign} {format_default(getattr(meta, attribute))}")
    return ", ".join(found)


def _literal_choices(annotation: Any) -> list[Any]:
    if get_origin(annotation) is Literal:
        return list(get_args(annotation))
    if _is_union(annotation):
        for arg in get_args(annotation):
            if get_origin(arg) is Literal:
                return list(get_args(arg))
    return []


def _doc(model: type[BaseModel]) -> str | None:
    doc = model.__doc__
    if not doc or doc is BaseModel.__doc__ or any(doc is base.__doc__ for base in model.__mro__[1:]):
        return None
    return " ".join(doc.split())


def _code(text: str) -> str:
    """A table cell's code span (an empty string shows as `""`); pipes would split the row, none are expected."""
    assert "|" not in text and "`" not in text, f"a default that does not fit a table cell: {text!r}"
    return f"`{text}`" if text else '`""`'


def _escape(text: str) -> str:
    """Table-safe text: raw `<...>` shown as text, pipes not splitting the row; backtick spans kept."""
    return html.escape(" ".join(text.split()), quote=False).replace("|", "\\|")
