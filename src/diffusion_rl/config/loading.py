"""Reading configs: :class:`ConfigError`, YAML with ``file:line:col`` errors, ``--set``
overrides, merging, validation-error messages with did-you-mean, and
:func:`build_config` / :func:`load_config`. The bottom of the package: it imports no other
config module.

``load_config(path, cls, overrides)`` reads YAML, applies ``key.sub=value`` overrides and
validates; any problem raises :class:`ConfigError`:

* a YAML syntax error or a duplicate key: one line ``configs/x.yaml:12:5: <problem>`` (file,
  line, column); an override whose value does not parse names the ``--set`` item and column;
* anything else: a first line naming the source (``configs/x.yaml: invalid config``), then
  one line per problem, each starting with the dotted key
  (``  optim.lr: expected a finite number, not .nan or .inf (got .inf)``,
  ``  optim.lrr: unknown key; did you mean 'lr'?``).

YAML 1.2 exponents are numbers (``lr: 1e-3`` is a float, not a string).
"""

from __future__ import annotations

import contextlib
import difflib
import re
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

Config = TypeVar("Config", bound=BaseModel)


class ConfigError(ValueError):
    """A config file or override that does not validate."""


# ---------------------------------------------------------------------------------------------
# Problems: the errors validators raise (one line each in a ConfigError)
# ---------------------------------------------------------------------------------------------


def _problem(loc: tuple, message: str, value: Any = None) -> InitErrorDetails:
    return InitErrorDetails(
        type=PydanticCustomError("config", "{message}", {"message": message}),
        loc=loc,
        input=value,
    )


def _raise_problems(owner: str, problems: list[InitErrorDetails]) -> None:
    """Raise the problems as one ValidationError (one line each in a ConfigError)."""
    if problems:
        raise ValidationError.from_exception_data(owner, problems)


def _prefixed(error: ValidationError, prefix: tuple) -> list[InitErrorDetails]:
    """``error``'s problems, their keys under ``prefix``."""
    out = []
    for item in error.errors():
        context = {**(item.get("ctx") or {}), "message": item["msg"]}
        out.append(
            InitErrorDetails(
                type=PydanticCustomError(item["type"], "{message}", context),
                loc=prefix + tuple(item["loc"]),
                input=item.get("input"),
            )
        )
    return out


# ---------------------------------------------------------------------------------------------
# YAML
# ---------------------------------------------------------------------------------------------


# YAML 1.2 floats PyYAML's 1.1 resolver reads as strings: exponents without a dot (1e-3, 5E4).
_EXPONENT_FLOAT = re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")


class _Loader(yaml.SafeLoader):
    """Safe YAML that reads ``1e-3`` as a float and refuses duplicate keys (a later value
    would silently win)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:  # unhashable: the base class reports it
                    continue
                if first is not None:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"duplicate key {key!r} (first given on line {first})",
                        key_node.start_mark,
                    )
                seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


class _Dumper(yaml.SafeDumper):
    """Safe YAML output that quotes every string :class:`_Loader` would read as a number."""


for _cls in (_Loader, _Dumper):
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789"))


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _yaml_problem(error: yaml.YAMLError, text: str) -> tuple[tuple[int, int] | None, str]:
    """((line, column) 1-based, or None when unknown; the problem in one line) of a YAML
    error in ``text``."""
    if isinstance(error, yaml.reader.ReaderError):
        line = text.count("\n", 0, error.position) + 1
        column = error.position - (text.rfind("\n", 0, error.position) + 1) + 1
        code = error.character if isinstance(error.character, int) else ord(error.character)
        return (line, column), f"unacceptable character #x{code:04x} (control characters)"
    mark, problem = getattr(error, "problem_mark", None), getattr(error, "problem", None)
    if mark is None or problem is None:
        return None, _one_line(error)
    context, start = getattr(error, "context", None), getattr(error, "context_mark", None)
    where = ""
    if context:
        at = f" at {start.line + 1}:{start.column + 1}" if start is not None else ""
        where = f" ({_one_line(context)}{at})"
    return (mark.line + 1, mark.column + 1), f"{_one_line(problem)}{where}"


def _read_yaml(path: Path) -> Any:
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise ConfigError(f"config file {path}: cannot be read ({error.strerror})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        column = error.start - (raw.rfind(b"\n", 0, error.start) + 1) + 1
        raise ConfigError(f"{path}:{line}:{column}: not UTF-8 text ({error.reason})") from None
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as error:
        position, problem = _yaml_problem(error, text)
        where = f"{path}:{position[0]}:{position[1]}" if position else str(path)
        raise ConfigError(f"{where}: {problem}") from None


# ---------------------------------------------------------------------------------------------
# --set overrides and merging
# ---------------------------------------------------------------------------------------------


_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any, item: str) -> None:
    keys = dotted.split(".")
    bad = [k for k in keys if not _KEY.fullmatch(k)]
    if bad:
        raise ConfigError(
            f"--set {item!r}: {bad[0]!r} is not a key; expected KEY=VALUE with KEY dotted "
            "names, e.g. optim.lr=3e-4"
        )
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {item!r}: {key!r} was set to a value, not a section")
        node = child
    node[keys[-1]] = value


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    """``["optim.lr=3e-4", "steps=10"]`` → nested dict; values parsed as YAML (lists replace
    whole: ``rewards=[{name: digits}]``)."""
    tree: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. optim.lr=3e-4")
        key, raw = item.split("=", 1)
        try:
            value = yaml.load(raw, Loader=_Loader)  # noqa: S506 (a SafeLoader)
        except yaml.YAMLError as error:
            position, problem = _yaml_problem(error, raw)
            column = f" at column {position[1]}" if position else ""
            raise ConfigError(
                f"--set {item!r}: the value is not valid YAML{column}: {problem}"
            ) from None
        _set_dotted(tree, key.strip(), value, item)
    return tree


def merge_dicts(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra`` on top, section by section (nested dicts merge; any other value
    replaces). Neither input is modified."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_dicts(out[key], value)
        else:
            out[key] = value
    return out


# ---------------------------------------------------------------------------------------------
# Error messages
# ---------------------------------------------------------------------------------------------


def _kind(value: Any) -> str:
    """What a YAML value is, in words: ``a list``, ``a mapping``, ``null``..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return f"a {type(value).__name__}"


def _flow(value: Any) -> str:
    """``value`` as one line of flow-style YAML (re-readable by :class:`_Loader`)."""
    text = yaml.dump([value], Dumper=_Dumper, default_flow_style=True, width=10**9)
    return text.strip()[1:-1]


def _shown(value: Any) -> str:
    if isinstance(value, (dict, list, tuple)) and not value:
        return _flow(list(value) if isinstance(value, tuple) else value)
    try:
        text = _flow(value)
    except yaml.YAMLError:
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# pydantic error types → the message shown (context keys in braces)
_MESSAGES = {
    "int_type": "expected an integer",
    "float_type": "expected a number",
    "bool_type": "expected true or false",
    "string_type": "expected a string",
    "finite_number": "expected a finite number, not .nan or .inf",
    "list_type": "expected a list",
    "tuple_type": "expected a list",
    "dict_type": "expected a mapping",
    "greater_than": "expected a value > {gt}",
    "greater_than_equal": "expected a value >= {ge}",
    "less_than": "expected a value < {lt}",
    "less_than_equal": "expected a value <= {le}",
    "literal_error": "expected {expected}",
    "missing": "required key missing",
}
_SECTION_TYPES = ("model_type", "model_attributes_type", "dataclass_type")


def _as_model(annotation: Any) -> type[BaseModel] | None:
    """The model class an annotation holds (through ``X | None``), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        models = [m for m in map(_as_model, typing.get_args(annotation)) if m is not None]
        return models[0] if len(models) == 1 else None
    return None


def _members(annotation: Any) -> list[Any]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(annotation) if a is not type(None)]
    return [annotation]


def _tags(annotation: Any) -> tuple[Any, ...]:
    """The values a section's ``name`` literal allows (its tag in a discriminated union)."""
    model = _as_model(annotation)
    field = model.model_fields.get("name") if model is not None else None
    if field is None or typing.get_origin(field.annotation) is not typing.Literal:
        return ()
    return typing.get_args(field.annotation)


def _walk(cls: type[BaseModel] | None, loc: Sequence[Any]) -> tuple[list[str], Any]:
    """The dotted key parts of an error location (pydantic's union-branch tags dropped) and
    the annotation found at its parent (None when unknown)."""
    shown: list[str] = []
    annotation: Any = cls
    parent: Any = None
    parts = list(loc)
    index = 0
    while index < len(parts):
        part = parts[index]
        parent = annotation
        members = _members(annotation) if annotation is not None else []
        if len(members) > 1 and isinstance(part, str):
            # a union: pydantic names the branch (``float``, ``literal['none']``, or a
            # discriminated union's tag: the ``name`` of a section); skip it. A key of one of
            # the members (a problem a validator placed without the tag) is that member's.
            named = [m for m in members if part in (getattr(m, "__name__", None), *_tags(m))]
            keyed = [m for m in members if part in getattr(_as_model(m), "model_fields", {})]
            if named or not keyed:
                annotation = named[0] if named else None
                index += 1
                continue
            annotation = keyed[0]
        if isinstance(part, int):
            shown.append(str(part))
            item = members[0] if members else None
            annotation = typing.get_args(item)[0] if typing.get_origin(item) is list else None
        else:
            shown.append(str(part))
            model = _as_model(annotation)
            field = model.model_fields.get(part) if model is not None else None
            annotation = field.annotation if field is not None else None
        index += 1
    return shown, parent


def _known_keys(annotation: Any) -> list[str]:
    model = _as_model(annotation)
    if model is None:
        return []
    known = getattr(model, "known_keys", None)
    return known() if callable(known) else list(model.model_fields)


def _did_you_mean(key: Any, valid: Sequence[str]) -> str:
    close = difflib.get_close_matches(str(key), list(valid), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _problem_line(cls: type[BaseModel] | None, item: dict[str, Any]) -> tuple[str, str, str]:
    """(dotted key, message, shown input or '') of one pydantic error."""
    shown, parent = _walk(cls, item["loc"])
    kind, message = item["type"], item["msg"]
    value = item.get("input")
    if kind == "extra_forbidden":
        valid = _known_keys(parent)
        hint = _did_you_mean(shown[-1], valid)
        if not hint:
            hint = "; remove it or check its spelling" + (
                f" (valid keys: {', '.join(valid)})" if valid else ""
            )
        return ".".join(shown), f"unknown key{hint}", ""
    if kind == "union_tag_invalid":  # a section's ``name`` picks its kind: name that key
        context = item.get("ctx") or {}
        key = str(context.get("discriminator", "name")).strip("'")
        expected = context.get("expected_tags", "?")
        message = f"unknown value {context.get('tag')!r}; expected one of {expected}"
        return ".".join([*shown, key]), message, ""
    if kind in _SECTION_TYPES:
        return ".".join(shown), f"expected a mapping of keys, got {_kind(value)}", ""
    if message.startswith(("Value error, ", "Assertion failed, ")):
        message = message.split(", ", 1)[1]
        # "sub.key: problem" raised by a section's validator: name the full dotted key
        head = re.match(r"([A-Za-z_][A-Za-z0-9_]*)((?:\.[A-Za-z0-9_]+)*): ", message)
        if head and (head.group(1) in _known_keys(_walk(cls, item["loc"] + ("",))[1])):
            shown = shown + head.group(0)[:-2].split(".")
            message = message[head.end() :]
        return ".".join(shown) or "(top level)", message, ""
    if kind in _MESSAGES:
        with contextlib.suppress(KeyError):  # a re-raised error may lack the context
            message = _MESSAGES[kind].format(**(item.get("ctx") or {}))
    if kind == "config":
        return ".".join(shown) or "(top level)", message, ""
    if kind == "missing" and isinstance(item["loc"][-1], int):
        message = f"missing item {item['loc'][-1]}: the list is too short"
    got = "" if kind == "missing" else _shown(value)
    return ".".join(shown) or "(top level)", message, got


def format_validation_error(
    error: ValidationError, source: str, cls: type[BaseModel] | None = None
) -> str:
    """``"<source>: invalid config"`` then one line per problem, ``"  <dotted.key>: <what is
    wrong> (got <value>)"``; errors of one key (the branches of ``X | Y``) share a line.
    ``cls`` (the validated class) lets unknown keys suggest the closest valid name."""
    order: list[str] = []
    messages: dict[str, list[str]] = {}
    inputs: dict[str, str] = {}
    for item in error.errors():
        key, message, got = _problem_line(cls, item)
        if key not in messages:
            order.append(key)
            messages[key] = []
        if message not in messages[key]:
            messages[key].append(message)
        inputs.setdefault(key, got)
    lines = [f"{source}: invalid config"]
    for key in order:
        got = f" (got {inputs[key]})" if inputs[key] else ""
        # the branches of a union each say "expected ..."; other problems of a key are listed
        union = all(m.startswith("expected") for m in messages[key])
        text = (", or " if union else "; ").join(messages[key])
        lines.append("  " + _one_line(f"{key}: {text}{got}"))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Building and loading a config
# ---------------------------------------------------------------------------------------------


def build_config(cls: type[Config], data: dict[str, Any], source: str = "config") -> Config:
    try:
        return cls.model_validate(data)
    except ValidationError as error:
        raise ConfigError(format_validation_error(error, source, cls)) from None


def load_config(
    path: str | Path | None, cls: type[Config], overrides: list[str] | None = None
) -> Config:
    """Read ``path`` (YAML; None = all defaults), apply overrides, validate as ``cls``."""
    data: dict[str, Any] = {}
    source = "defaults with --set overrides"
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist")
        if not path.is_file():
            raise ConfigError(f"config file {path} is not a file")
        loaded = _read_yaml(path)
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(
                f"{path}: expected a mapping of keys at the top level, got {_kind(loaded)}"
            )
        data, source = loaded, str(path)
    return build_config(cls, merge_dicts(data, parse_overrides(overrides)), source)
