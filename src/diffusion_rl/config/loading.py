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

Any input is answered quickly and in bounded memory and output (:data:`INPUT_LIMITS`): a
config file is at most 256 KiB and a regular file (a directory, FIFO or device is named as
such, never opened) of at most 30 000 YAML tokens; values nest at most 32 deep and number
at most 10 000, aliases and merge keys expanded; an integer has at most 64 digits. Each is refused in one line naming
the file (and line and column, or the key). An error lists at most
:data:`MAX_PROBLEM_LINES` problems (then how many more), each line at most
:data:`MAX_LINE_CHARS` characters, and an unknown key suggests at most three close names.
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


INPUT_LIMITS = {
    "bytes": 256 << 10,  # a config file (the shipped ones are under 8 KiB)
    "tokens": 30_000,  # YAML tokens (the parser reads ~40 000 a second; the shipped: < 1 500)
    "depth": 32,  # nesting of mappings and lists (the shipped configs: 4)
    "values": 10_000,  # keys, values and list items, aliases and merge keys expanded
    "int_digits": 64,  # an integer literal (any LIMITS bound has at most 20)
}
"""Bounds on what a config file or ``--set`` value may be (module docstring)."""
MAX_PROBLEM_LINES = 10
"""Problems listed in one :class:`ConfigError`; the rest are counted."""
MAX_LINE_CHARS = 300
"""The longest line of a :class:`ConfigError` (longer ones are cut, ending in ``...``)."""


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


_INT_TAG = "tag:yaml.org,2002:int"


def _clip(text: Any, limit: int = 60) -> str:
    """``text`` (made a str) cut to ``limit`` characters, ending in ``...`` when cut."""
    text = str(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _int_digits(node: yaml.ScalarNode) -> int:
    """The digits of an integer literal (hexadecimal and octal ones included)."""
    return sum(c.isalnum() for c in node.value)


class _Loader(yaml.SafeLoader):
    """Safe YAML that reads ``1e-3`` as a float and refuses duplicate keys (a later value
    would silently win), and within :data:`INPUT_LIMITS`: nesting (checked while composing,
    before the parser's recursion could overflow), merge-key expansion and integer digits
    (before ``int()`` refuses them without naming the key)."""

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self._depth = 0
        self._merged = 0

    def fetch_more_tokens(self):
        if max(self.flow_level, len(self.indents)) > INPUT_LIMITS["depth"]:  # scanning ahead
            raise yaml.scanner.ScannerError(
                None,
                None,
                f"nested deeper than {INPUT_LIMITS['depth']} levels of mappings and lists",
                self.get_mark(),
            )
        if self.tokens_taken + len(self.tokens) >= INPUT_LIMITS["tokens"]:
            raise yaml.scanner.ScannerError(
                None,
                None,
                f"more than {INPUT_LIMITS['tokens']} YAML tokens (keys, values, brackets): "
                "more than a config holds; data such as prompts belongs in files it names",
                self.get_mark(),
            )
        super().fetch_more_tokens()

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > INPUT_LIMITS["depth"]:
                raise yaml.composer.ComposerError(
                    None,
                    None,
                    f"nested deeper than {INPUT_LIMITS['depth']} levels of mappings and lists",
                    self.peek_event().start_mark,
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def flatten_mapping(self, node):
        super().flatten_mapping(node)
        self._merged += len(node.value)
        if self._merged > INPUT_LIMITS["values"]:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"more than {INPUT_LIMITS['values']} keys (merge keys '<<' expanded)",
                node.start_mark,
            )

    def construct_yaml_int(self, node):
        if _int_digits(node) > INPUT_LIMITS["int_digits"]:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"an integer of {_int_digits(node)} digits; at most "
                f"{INPUT_LIMITS['int_digits']} digits are read",
                node.start_mark,
            )
        return super().construct_yaml_int(node)

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                if (
                    isinstance(key_node, yaml.ScalarNode)
                    and isinstance(value_node, yaml.ScalarNode)
                    and value_node.tag == _INT_TAG
                    and _int_digits(value_node) > INPUT_LIMITS["int_digits"]
                ):  # name the key: "steps: an integer of 100000 digits"
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"{_clip(key_node.value)}: an integer of {_int_digits(value_node)} "
                        f"digits; at most {INPUT_LIMITS['int_digits']} digits are read",
                        value_node.start_mark,
                    )
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
_Loader.add_constructor(_INT_TAG, _Loader.construct_yaml_int)


def _size_problem(data: Any) -> str | None:
    """What makes loaded YAML ``data`` too large (:data:`INPUT_LIMITS`, aliases expanded: a
    structure that refers to itself is too deep), or None. Walks at most the limit."""
    count, stack = 0, [(data, 1)]
    while stack:
        value, depth = stack.pop()
        count += 1
        if count > INPUT_LIMITS["values"]:
            return f"more than {INPUT_LIMITS['values']} values (aliases expanded)"
        if isinstance(value, dict):
            children = [*value.keys(), *value.values()]
        elif isinstance(value, list):
            children = value
        else:
            continue
        if children and depth >= INPUT_LIMITS["depth"]:
            return (
                f"nested deeper than {INPUT_LIMITS['depth']} levels of mappings and lists "
                "(aliases expanded)"
            )
        stack.extend((child, depth + 1) for child in children)
    return None


def _load_yaml(text: str) -> Any:
    """``text`` as YAML, within :data:`INPUT_LIMITS`; ``yaml.YAMLError`` otherwise."""
    data = yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader)
    problem = _size_problem(data)
    if problem is not None:
        raise yaml.YAMLError(problem)
    return data


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


def _not_a_file(path: Path) -> str | None:
    """Why ``path`` is not a regular file to read, or None; ``stat`` only (a FIFO is never
    opened: that would block)."""
    import stat

    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return "does not exist"
    except OSError as error:
        return f"cannot be read ({error.strerror or error})"
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "is a directory, not a regular file"
    if stat.S_ISFIFO(mode):
        return "is a FIFO (named pipe), not a regular file"
    return "is not a regular file (a device or socket)"


def _read_yaml(path: Path) -> Any:
    limit = INPUT_LIMITS["bytes"]
    try:
        with open(path, "rb") as handle:
            raw = handle.read(limit + 1)
    except OSError as error:
        raise ConfigError(f"config file {path}: cannot be read ({error.strerror})") from None
    if len(raw) > limit:
        raise ConfigError(
            f"config file {path}: larger than {limit >> 10} KiB, the limit of a config file "
            "(INPUT_LIMITS); data such as prompts belongs in files the config names"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        column = error.start - (raw.rfind(b"\n", 0, error.start) + 1) + 1
        raise ConfigError(f"{path}:{line}:{column}: not UTF-8 text ({error.reason})") from None
    try:
        return _load_yaml(text)
    except yaml.YAMLError as error:
        position, problem = _yaml_problem(error, text)
        where = f"{path}:{position[0]}:{position[1]}" if position else str(path)
        raise ConfigError(_clip(f"{where}: {problem}", MAX_LINE_CHARS)) from None


# ---------------------------------------------------------------------------------------------
# --set overrides and merging
# ---------------------------------------------------------------------------------------------


_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any, item: str) -> None:
    keys = dotted.split(".")
    bad = [k for k in keys if not _KEY.fullmatch(k)]
    if bad:
        raise ConfigError(
            f"--set {_clip(item)!r}: {_clip(bad[0])!r} is not a key; expected KEY=VALUE with "
            "KEY dotted names, e.g. optim.lr=3e-4"
        )
    if len(keys) >= INPUT_LIMITS["depth"]:
        raise ConfigError(
            f"--set {_clip(item)!r}: the key nests {len(keys)} levels; at most "
            f"{INPUT_LIMITS['depth'] - 1}"
        )
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(
                f"--set {_clip(item)!r}: {_clip(key)!r} was set to a value, not a section"
            )
        node = child
    node[keys[-1]] = value


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    """``["optim.lr=3e-4", "steps=10"]`` → nested dict; values parsed as YAML (lists replace
    whole: ``rewards=[{name: digits}]``)."""
    tree: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"--set {_clip(item)!r}: expected KEY=VALUE, e.g. optim.lr=3e-4")
        key, raw = item.split("=", 1)
        if len(raw) > INPUT_LIMITS["bytes"]:
            raise ConfigError(
                f"--set {_clip(item)!r}: the value is longer than {INPUT_LIMITS['bytes'] >> 10} "
                "KiB, the limit of a config (INPUT_LIMITS)"
            )
        try:
            value = _load_yaml(raw)
        except yaml.YAMLError as error:
            position, problem = _yaml_problem(error, raw)
            column = f" at column {position[1]}" if position else ""
            message = f"--set {_clip(item)!r}: the value is not valid YAML{column}: {problem}"
            raise ConfigError(_clip(message, MAX_LINE_CHARS)) from None
        _set_dotted(tree, key.strip(), value, item)
    size = _size_problem(tree)
    if size is not None:
        raise ConfigError(f"--set: the overrides together hold {size}")
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
    """``; did you mean 'a'?`` (or ``'a', 'b' or 'c'``: at most three close names), or ''."""
    close = difflib.get_close_matches(_clip(key, 100), list(valid), n=3, cutoff=0.6)
    if not close:
        return ""
    names = [repr(name) for name in close]
    listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
    return f"; did you mean {listed}?"


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
                " (--print-config lists every valid key)" if valid else ""
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
    more: set[tuple] = set()  # the locations of problems past MAX_PROBLEM_LINES keys
    for item in error.errors(include_url=False, include_context=True, include_input=True):
        if len(order) >= MAX_PROBLEM_LINES:  # counted, not described (no did-you-mean)
            more.add(tuple(map(str, item["loc"])))
            continue
        key, message, got = _problem_line(cls, item)
        if key not in messages:
            order.append(key)
            messages[key] = []
        if message not in messages[key]:
            messages[key].append(message)
        inputs.setdefault(key, got)
    lines = [_clip(f"{source}: invalid config", MAX_LINE_CHARS)]
    for key in order:
        got = f" (got {inputs[key]})" if inputs[key] else ""
        # the branches of a union each say "expected ..."; other problems of a key are listed
        union = all(m.startswith("expected") for m in messages[key])
        text = (", or " if union else "; ").join(messages[key])
        lines.append(_clip("  " + _one_line(f"{_clip(key, 120)}: {text}{got}"), MAX_LINE_CHARS))
    if more:
        lines.append(f"  ... and {len(more)} more problems")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Building and loading a config
# ---------------------------------------------------------------------------------------------


def build_config(cls: type[Config], data: dict[str, Any], source: str = "config") -> Config:
    try:
        return cls.model_validate(data)
    except ValidationError as error:
        raise ConfigError(format_validation_error(error, source, cls)) from None


def read_config(
    path: str | Path | None, overrides: list[str] | None = None
) -> tuple[dict[str, Any], str]:
    """The raw config ``path`` (YAML; None = all defaults) with ``overrides`` applied, and
    its source for messages (the file, or ``defaults with --set overrides``): everything
    :func:`load_config` checks before validation (syntax, :data:`INPUT_LIMITS`), without
    the config classes, so without torch (the command line reads a config first)."""
    data: dict[str, Any] = {}
    source = "defaults with --set overrides"
    if path is not None:
        path = Path(path)
        problem = _not_a_file(path)
        if problem is not None:
            raise ConfigError(f"config file {path} {problem}; expected a YAML file")
        loaded = _read_yaml(path)
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(
                f"{path}: expected a mapping of keys at the top level, got {_kind(loaded)}"
            )
        data, source = loaded, str(path)
    return merge_dicts(data, parse_overrides(overrides)), source


def load_config(
    path: str | Path | None, cls: type[Config], overrides: list[str] | None = None
) -> Config:
    """Read ``path`` (YAML; None = all defaults), apply overrides, validate as ``cls``."""
    data, source = read_config(path, overrides)
    return build_config(cls, data, source)
