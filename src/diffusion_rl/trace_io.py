"""The trace wire format: a :class:`TokenTrace` or :class:`FlowTrace` as one safetensors body.

What the serving engine's rollout route sends and the learner reads (docs/serving.md). The
body is a standard safetensors file, readable by any safetensors reader:

* every tensor field of the trace is one tensor of the same name (``latents``, ``tokens``, ...;
  on the CPU, contiguous, its dtype and shape unchanged); a dict of tensors (a flow trace's
  ``cond`` / ``uncond``) is one tensor per key, named ``cond/KEY``;
* the metadata key ``diffusion_rl.trace`` holds JSON: ``format`` (:data:`FORMAT`), ``kind``
  (``"token"`` or ``"flow"``), the key order of each tensor dict (None for a dict field that
  is None) and the values of every other field (sampler settings, kernel ids, model info,
  weights version, stage, prompts, ...). JSON keeps ints, floats (exactly: shortest repr),
  str, bool, None, lists and str-keyed dicts; tuples are tagged so they come back as tuples;
* optionally (a rollout response, :func:`rollout_to_bytes`) the artefact next to the trace:
  tensors named ``artefact/NAME`` (e.g. ``artefact/images``) and JSON data under the
  metadata's ``artefact`` key (e.g. decoded ``texts``, usage, timings). They are not part of
  the trace: :func:`trace_from_bytes` reads the trace of such a body and leaves them.

Invariants: ``trace_from_bytes(trace_to_bytes(t))`` equals ``t`` field by field
(``torch.equal`` and equal dtype on every tensor, ``==`` on the rest), with the tensors on the
CPU. Reading is bounded (the body at most ``max_bytes``, the JSON header at most
:data:`MAX_HEADER_BYTES`) and validated: the safetensors framing, the format tag, the kind,
the exact set of fields and tensors, and then the trace's own construction checks
(``__post_init__``). Any failure is a :class:`TraceFormatError` (a ``ValueError``) naming what
is wrong; nothing is executed or imported from the body.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Mapping
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as _load_tensors
from safetensors.torch import save as _save_tensors

from .trace import FlowTrace, TokenTrace

__all__ = [
    "FORMAT",
    "MAX_HEADER_BYTES",
    "MAX_TRACE_BYTES",
    "RolloutBody",
    "TraceFormatError",
    "cpu_unshared",
    "rollout_from_bytes",
    "rollout_to_bytes",
    "trace_from_bytes",
    "trace_to_bytes",
]

FORMAT = "diffusion_rl.trace/1"
METADATA_KEY = "diffusion_rl.trace"
KINDS: dict[str, type] = {"token": TokenTrace, "flow": FlowTrace}
MAX_TRACE_BYTES = 1 << 30
"""Default bound on a body read by :func:`trace_from_bytes` (1 GiB)."""
MAX_HEADER_BYTES = 64 << 20
"""Bound on the safetensors JSON header (tensor table and metadata: prompts included)."""
ARTEFACT = "artefact"  # tensors "artefact/NAME" and the metadata's "artefact" JSON
_TENSOR_DICTS = {"cond", "uncond"}  # FlowTrace fields that are dicts of tensors (Conditioning)
_TUPLE, _DICT = "__tuple__", "__dict__"  # tags of the JSON value codec


class TraceFormatError(ValueError):
    """A body that is not a valid trace (framing, format, kind, fields or trace checks)."""


# ------------------------------------------------------------------------- JSON value codec
def _encode(name: str, value: Any) -> Any:
    """``value`` as JSON data that :func:`_decode` turns back into an equal value (tuples
    tagged); anything else than JSON's types and tuples is a ``TypeError`` naming ``name``."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"{name}: {value} cannot be stored (JSON has no NaN or infinity)")
        return value
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(f"{name}[{k}]", v) for k, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(f"{name}[{k}]", v) for k, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{name}: keys must be str to be stored, got {key!r}")
            out[key] = _encode(f"{name}[{key!r}]", item)
        return {_DICT: out} if (_TUPLE in out or _DICT in out) else out
    raise TypeError(
        f"{name}: a {type(value).__name__} cannot be stored in a trace body; keep the field's "
        "values to str, int, float, bool, None, lists, tuples and str-keyed dicts"
    )


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        if len(value) == 1 and _TUPLE in value and isinstance(value[_TUPLE], list):
            return tuple(_decode(v) for v in value[_TUPLE])
        if len(value) == 1 and _DICT in value and isinstance(value[_DICT], dict):
            return {k: _decode(v) for k, v in value[_DICT].items()}
        return {k: _decode(v) for k, v in value.items()}
    return value


def _reject_constant(token: str) -> None:
    raise ValueError(f"{token} is not valid JSON here")


# ---------------------------------------------------------------------------------- writing
def trace_to_bytes(trace: TokenTrace | FlowTrace) -> bytes:
    """``trace`` as a safetensors body (module doc). Tensors are copied to the CPU; the
    trace is not changed."""
    return rollout_to_bytes(trace)


def rollout_to_bytes(
    trace: TokenTrace | FlowTrace,
    artefacts: Mapping[str, torch.Tensor] | None = None,
    info: Mapping[str, Any] | None = None,
) -> bytes:
    """``trace`` with the artefact it came with: ``artefacts`` (tensors, stored as
    ``artefact/NAME``) and ``info`` (JSON data: texts, usage, timings, ...). Without them,
    exactly :func:`trace_to_bytes`."""
    kind = next((k for k, cls in KINDS.items() if type(trace) is cls), None)
    if kind is None:
        raise TypeError(f"trace: expected a TokenTrace or FlowTrace, got {type(trace).__name__}")
    owner = type(trace).__name__
    tensors: dict[str, torch.Tensor] = {}
    dicts: dict[str, list[str] | None] = {}
    values: dict[str, Any] = {}
    for spec in dataclasses.fields(trace):
        value = getattr(trace, spec.name)
        if isinstance(value, torch.Tensor):
            tensors[spec.name] = value
        elif spec.name in _TENSOR_DICTS:
            dicts[spec.name] = None if value is None else list(value)
            for key, tensor in (value or {}).items():
                tensors[f"{spec.name}/{key}"] = tensor
        else:
            values[spec.name] = _encode(f"{owner}.{spec.name}", value)
    header = {"format": FORMAT, "kind": kind, "tensor_dicts": dicts, "values": values}
    for name, tensor in (artefacts or {}).items():
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"artefacts: names are non-empty str without '/', got {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"artefacts[{name!r}]: expected a tensor, got {type(tensor).__name__}")
        tensors[f"{ARTEFACT}/{name}"] = tensor
    if info is not None:
        header[ARTEFACT] = _encode("info", dict(info))
    return _save_tensors(
        cpu_unshared(tensors), metadata={METADATA_KEY: json.dumps(header, allow_nan=False)}
    )


def cpu_unshared(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` ready for a safetensors body: on the CPU, contiguous, detached, and no two
    sharing storage (safetensors refuses that: a tensor whose storage an earlier one uses,
    e.g. the second name of tied weights, is cloned)."""
    out, seen = {}, set()
    for name, tensor in tensors.items():
        cpu = tensor.detach().to("cpu").contiguous()
        pointer = cpu.untyped_storage().data_ptr()
        if cpu.numel() and pointer in seen:
            cpu = cpu.clone()
        seen.add(cpu.untyped_storage().data_ptr())
        out[name] = cpu
    return out


# ---------------------------------------------------------------------------------- reading
@dataclasses.dataclass(frozen=True)
class RolloutBody:
    """A body read by :func:`rollout_from_bytes`: the trace, the artefact tensors by name
    and the artefact's JSON data (``{}`` when the body carries none)."""

    trace: TokenTrace | FlowTrace
    artefacts: dict[str, torch.Tensor]
    info: dict[str, Any]


def trace_from_bytes(data: bytes, *, max_bytes: int = MAX_TRACE_BYTES) -> TokenTrace | FlowTrace:
    """The trace in ``data`` (a body of :func:`trace_to_bytes` or :func:`rollout_to_bytes`),
    tensors on the CPU.

    Refused with a :class:`TraceFormatError` naming the problem: a body over ``max_bytes``,
    a broken safetensors framing (truncated, corrupt, header over :data:`MAX_HEADER_BYTES`),
    another format or an unknown kind, missing or unexpected fields or tensors, and a trace
    that fails its own validation (the message keeps the field, e.g. ``FlowTrace.sigmas``)."""
    return rollout_from_bytes(data, max_bytes=max_bytes).trace


def rollout_from_bytes(data: bytes, *, max_bytes: int = MAX_TRACE_BYTES) -> RolloutBody:
    """The trace and the artefact of a :func:`rollout_to_bytes` body (read and refused as
    :func:`trace_from_bytes` says)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data: expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) > max_bytes:
        raise TraceFormatError(
            f"trace body: {len(data)} bytes, over the limit of {max_bytes} "
            "(pass a larger max_bytes to read a larger trace)"
        )
    header = _header(data)
    metadata = header.get("__metadata__")
    if not isinstance(metadata, dict) or METADATA_KEY not in metadata:
        raise TraceFormatError(
            f"trace body: no {METADATA_KEY!r} metadata; this is a safetensors file, but not a "
            "trace written by trace_to_bytes"
        )
    try:
        layout = json.loads(metadata[METADATA_KEY], parse_constant=_reject_constant)
    except ValueError as error:
        raise TraceFormatError(
            f"trace body: metadata {METADATA_KEY!r} is not JSON: {error}"
        ) from None
    if not isinstance(layout, dict) or layout.get("format") != FORMAT:
        found = layout.get("format") if isinstance(layout, dict) else layout
        raise TraceFormatError(
            f"trace body: format {found!r}, expected {FORMAT!r} (written by another version?)"
        )
    kind = layout.get("kind")
    if kind not in KINDS:
        raise TraceFormatError(
            f"trace body: unknown kind {kind!r}; expected one of {sorted(KINDS)}"
        )
    cls = KINDS[kind]
    dicts, values = layout.get("tensor_dicts"), layout.get("values")
    if not isinstance(dicts, dict) or not isinstance(values, dict):
        raise TraceFormatError("trace body: metadata lacks the 'tensor_dicts' / 'values' tables")
    names = [f.name for f in dataclasses.fields(cls)]
    listed = {name for name in header if name != "__metadata__"}
    artefact_names = {name for name in listed if name.startswith(f"{ARTEFACT}/")}
    listed -= artefact_names
    artefact_info = layout.get(ARTEFACT, {})
    if not isinstance(artefact_info, dict):
        raise TraceFormatError(f"trace body: metadata {ARTEFACT!r}: expected a JSON object")
    plain = {name for name in listed if "/" not in name}  # tensor fields; "/": a dict's keys
    keyed = set()
    for name, keys in dicts.items():
        if keys is not None and not (
            isinstance(keys, list) and all(isinstance(k, str) for k in keys)
        ):
            raise TraceFormatError(f"trace body: tensor_dicts[{name!r}]: expected a key list")
        keyed |= {f"{name}/{k}" for k in keys or ()}
    given = [*values, *dicts, *plain]
    unknown, missing = set(given) - set(names), set(names) - set(given)
    twice = {name for name in given if given.count(name) > 1}
    problems = [
        f"{what} {sorted(found)}"
        for what, found in (("has unknown fields", unknown), ("lacks", missing), ("repeats", twice))
        if found
    ]
    if problems:
        raise TraceFormatError(
            f"trace body: the body {' and '.join(problems)}; a {cls.__name__} has the fields "
            f"{names}"
        )
    if listed - plain != keyed:
        raise TraceFormatError(
            f"trace body: tensor dict entries {sorted(listed - plain)}, but its key lists "
            f"name {sorted(keyed)}"
        )
    try:
        tensors = _load_tensors(data)
    except SafetensorError as error:
        raise TraceFormatError(f"trace body: not a readable safetensors body: {error}") from None
    fields: dict[str, Any] = {}
    for name in names:
        if name in dicts:
            keys = dicts[name]
            fields[name] = None if keys is None else {k: tensors[f"{name}/{k}"] for k in keys}
        elif name in values:
            fields[name] = _decode(values[name])
        else:
            fields[name] = tensors[name]
    try:
        trace = cls(**fields)
    except (TypeError, ValueError) as error:
        raise TraceFormatError(f"trace body: the decoded trace is invalid: {error}") from error
    artefacts = {name.split("/", 1)[1]: tensors[name] for name in sorted(artefact_names)}
    return RolloutBody(trace, artefacts, _decode(artefact_info))


def _header(data: bytes) -> dict:
    """The safetensors JSON header of ``data``, its framing checked (length prefix within the
    body and :data:`MAX_HEADER_BYTES`; a JSON object)."""
    if len(data) < 8:
        raise TraceFormatError(
            f"trace body: {len(data)} bytes, too short for a safetensors header (truncated?)"
        )
    (size,) = struct.unpack("<Q", data[:8])
    if size > MAX_HEADER_BYTES or size > len(data) - 8:
        raise TraceFormatError(
            f"trace body: header length {size} exceeds the body ({len(data) - 8} bytes after "
            f"the length prefix) or the limit {MAX_HEADER_BYTES}: truncated or not safetensors"
        )
    try:
        header = json.loads(data[8 : 8 + size].decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as error:
        raise TraceFormatError(f"trace body: the safetensors header is not JSON: {error}") from None
    if not isinstance(header, dict):
        raise TraceFormatError("trace body: the safetensors header is not a JSON object")
    return header
