"""Printing a config: :func:`config_to_yaml` prints a config with every key (its type and
bounds as comments); loading the printed text gives an equal config.
"""

from __future__ import annotations

import inspect
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel

from ..tasks import TASKS
from .limits import _DERIVED_LIMITS, LIMITS
from .loading import _as_model, _flow, _members, _one_line


def _type_text(annotation: Any) -> str:
    """A short reader's name of a field type: ``int``, ``'fixed' | 'threshold'``, ``float or
    null``, ``[float, float]``..."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin is Literal:
        return " | ".join(_flow(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_text(a) for a in args)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list of {_type_text(args[0])}"
        return "[" + ", ".join(_type_text(a) for a in args) + "]"
    if origin is list:
        return f"list of {_type_text(args[0])}" if args else "list"
    if origin is dict or annotation is dict:
        return "mapping"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return {int: "int", float: "float", str: "str", bool: "bool"}.get(
        annotation, getattr(annotation, "__name__", str(annotation))
    )


_DEVICE_TEXT = "cpu | cuda | cuda:N | mps"
_COMMENTS = {"device": _DEVICE_TEXT, "offload_device": f"{_DEVICE_TEXT} or null"}


def _field_comment(model_cls: type[BaseModel], key: str) -> str:
    """``"int > 0, <= 65536 or null"``: the key's type, bounds and limit."""
    if key in _COMMENTS:
        return _COMMENTS[key]
    field = model_cls.model_fields.get(key)
    if field is None:  # a task setting (TaskSection's extra keys)
        for config_cls, _ in TASKS.values():
            field = config_cls.model_fields.get(key) or field
        if field is None:
            return ""
    bounds = []
    for item in field.metadata:
        for attr, symbol in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            if getattr(item, attr, None) is not None:
                bounds.append(f"{symbol} {getattr(item, attr)}")
    if key in LIMITS and key not in _DERIVED_LIMITS and not any("<" in b for b in bounds):
        bounds.append(f"<= {LIMITS[key]}")
    members = _members(field.annotation)
    optional = type(None) in typing.get_args(field.annotation)
    text = " or ".join(_type_text(m) for m in members)
    if len(members) == 1 and _as_model(members[0]) is not None:
        text = _doc_line(_as_model(members[0]))
    text = " ".join([text, ", ".join(bounds)]).strip()
    return f"{text} or null" if optional else text


def _doc_line(model_cls: type[BaseModel]) -> str:
    """The first sentence of a section class's docstring (inherited ones included)."""
    doc = _one_line((inspect.getdoc(model_cls) or "").split("\n\n")[0]).replace("``", "")
    return doc.split(". ")[0].rstrip(".")


def _emit(model: BaseModel, indent: int, lines: list[str]) -> None:
    pad = "  " * indent
    dumped = model.model_dump(mode="json")
    for key, plain in dumped.items():
        value = getattr(model, key, None)
        if isinstance(value, BaseModel):
            lines.append(f"{pad}{key}:  # {_doc_line(type(value))}".rstrip(" #"))
            _emit(value, indent + 1, lines)
        elif isinstance(value, list) and value and all(isinstance(v, BaseModel) for v in value):
            lines.append(f"{pad}{key}:  # list of: {_doc_line(type(value[0]))}")
            lines += [f"{pad}  - {_flow(item)}" for item in plain]
        else:
            comment = _field_comment(type(model), key)
            lines.append(f"{pad}{key}: {_flow(plain)}" + (f"  # {comment}" if comment else ""))


def config_to_yaml(config: BaseModel) -> str:
    """The effective ``config`` as YAML: every key (defaults included) with its value, its
    type and bounds as a comment, sections under the first line of their docstring.
    ``load_config`` of the text gives a config equal to ``config``."""
    lines = [
        f"# {type(config).__name__}: the effective config, every key (defaults, the config file,",
        "# then --set). Load it with --config; comments give each key's type and bounds.",
    ]
    _emit(config, 0, lines)
    return "\n".join(lines) + "\n"
