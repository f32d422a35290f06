"""Model directories: one loader (:func:`load_model`) and one writer (:func:`save_model`) for
every model the project writes.

A model directory holds:

* ``config.json``: the architecture, with a ``model_type`` naming the class that reads it
  (see :data:`MODEL_TYPES`; built in: ``"diffusion_rl.transformer"`` → the token denoiser
  :class:`~diffusion_rl.models.transformer.DiffusionTransformer`, ``"diffusion_rl.flow_dit"``
  → the flow-matching image model :class:`~diffusion_rl.models.dit.FlowDiT`,
  ``"diffusion_rl.flow_video_dit"`` → the image-to-video model
  :class:`~diffusion_rl.models.video_dit.VideoDiT`);
* ``model.safetensors``: the weights;
* ``tokenizer.json``: the :class:`~diffusion_rl.models.tokenizer.CharTokenizer` (token models
  only; its vocabulary and MASK id must match the model's);
* ``diffusion_rl.json`` (:data:`INFO_FILE`): what the model was trained for: ``task``, the
  serving ``sampler`` settings, ``trained_steps``, ... (token models also record
  ``tokenizer``, the tokenizer's name). Optional when loading.

:func:`save_model` writes everything into a staging directory next to the target and then
swaps it in with renames, so an interrupted save leaves the previous directory (or nothing),
never a half-written model. A new architecture is one :func:`register_model_type` call.

Bounded loading: a model directory may come from anyone, so :func:`load_model` checks it
before building anything — each JSON file is at most :data:`MAX_JSON_BYTES`; ``config.json``
validates against the model's config class, whose sizes are integers within the documented
limits (:data:`MODEL_LIMITS`, per model type); the recorded sampler's sizes are within
:data:`SAMPLER_LIMITS` (a token model's ``generation_length`` also below its ``max_seq_len``);
and the memory loading needs (:func:`estimate_load_bytes`: the parameters, counted from the
config alone by :func:`estimate_parameters`, plus the weights file read beside them) must fit
in the memory available (:func:`available_memory`). Any failure is a
:class:`ModelConfigError` (a ``ValueError``) naming the file and the field, or a
:class:`ModelTooLargeError` with the estimate, raised in well under a second.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ValidationError

from .dit import MODEL_TYPE as FLOW_DIT_MODEL_TYPE
from .dit import FlowDiT
from .tokenizer import CharTokenizer
from .transformer import MODEL_TYPE as TRANSFORMER_MODEL_TYPE
from .transformer import DiffusionTransformer
from .video_dit import MODEL_TYPE as VIDEO_DIT_MODEL_TYPE
from .video_dit import VideoDiT

CONFIG_FILE = "config.json"
INFO_FILE = "diffusion_rl.json"
TOKENIZER_FILE = "tokenizer.json"
MAX_JSON_BYTES = 16 << 20
"""The largest ``config.json``, :data:`INFO_FILE` or ``tokenizer.json`` read (16 MiB)."""

SAMPLER_LIMITS: dict[str, int] = {
    "generation_length": 1 << 20,
    "block_size": 1 << 20,
    "steps_per_block": 1 << 20,
    "num_steps": 10_000,
}
"""The largest sizes the ``sampler`` recorded in :data:`INFO_FILE` may hold (each also >= 1)."""


class ModelConfigError(ValueError):
    """A model directory's ``config.json`` or :data:`INFO_FILE` that is not valid JSON, fails
    its checks, or asks for sizes beyond the documented limits; the message names the file and
    the field."""


class ModelTooLargeError(ModelConfigError):
    """A model whose estimated loading memory (``required_bytes``) exceeds the memory this
    machine has available (``available_bytes``)."""

    def __init__(self, message: str, required_bytes: int, available_bytes: int) -> None:
        super().__init__(message)
        self.required_bytes = required_bytes
        self.available_bytes = available_bytes


ModelKind = Literal["token", "flow"]
KINDS: tuple[str, ...] = ("token", "flow")
"""``"token"``: a masked-diffusion token denoiser (with a tokenizer); ``"flow"``: a
flow-matching velocity model (images; no tokenizer)."""


@dataclass(frozen=True)
class ModelType:
    """A registered ``config.json`` ``model_type``: its ``kind`` and the ``loader`` class
    (``loader.from_pretrained(directory)`` reads the model; instances are saved with
    ``model.save_pretrained(directory)``).

    A loader that also has ``config_class`` (the pydantic config ``config.json`` holds, less
    ``model_type``) and ``parameter_count(config)`` (its parameter count from the config
    alone) is checked before it is built (module docstring); the built-in ones have both.
    """

    kind: ModelKind
    loader: type

    @property
    def config_class(self) -> type[BaseModel] | None:
        return getattr(self.loader, "config_class", None)

    @property
    def parameter_count(self) -> Callable[[Any], int] | None:
        return getattr(self.loader, "parameter_count", None)


MODEL_TYPES: dict[str, ModelType] = {}
"""``model_type`` → :class:`ModelType`; extend with :func:`register_model_type`."""


def register_model_type(model_type: str, loader: type, kind: ModelKind) -> None:
    """Make :func:`load_model` read directories whose ``config.json`` says ``model_type`` with
    ``loader.from_pretrained``, and :func:`save_model` accept instances of ``loader``."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {list(KINDS)}, got {kind!r}")
    if not callable(getattr(loader, "from_pretrained", None)):
        raise TypeError(f"loader: {loader!r} has no from_pretrained(directory)")
    MODEL_TYPES[model_type] = ModelType(kind, loader)


register_model_type(TRANSFORMER_MODEL_TYPE, DiffusionTransformer, "token")
register_model_type(FLOW_DIT_MODEL_TYPE, FlowDiT, "flow")
register_model_type(VIDEO_DIT_MODEL_TYPE, VideoDiT, "flow")

MODEL_LIMITS: dict[str, Mapping[str, int | float]] = {
    TRANSFORMER_MODEL_TYPE: DiffusionTransformer.size_limits,
    FLOW_DIT_MODEL_TYPE: FlowDiT.size_limits,
    VIDEO_DIT_MODEL_TYPE: VideoDiT.size_limits,
}
"""``model_type`` → the largest value of each size field its ``config.json`` may hold (the
built-in config classes enforce them: :data:`~diffusion_rl.models.transformer.SIZE_LIMITS`,
:data:`~diffusion_rl.models.dit.SIZE_LIMITS`,
:data:`~diffusion_rl.models.video_dit.VIDEO_SIZE_LIMITS`)."""


@dataclass(frozen=True)
class LoadedModel:
    """What :func:`load_model` read: ``model`` (in eval mode), its ``kind`` (``"token"`` or
    ``"flow"``), ``tokenizer`` (a :class:`CharTokenizer` for token models, ``None`` for flow
    models) and ``info`` (``task``, ``sampler``, ``trained_steps``, ...; ``{}`` when the
    directory has no :data:`INFO_FILE`)."""

    model: Any
    kind: ModelKind
    tokenizer: CharTokenizer | None = None
    info: dict[str, Any] = field(default_factory=dict)


def _known() -> str:
    return f"known model types: {sorted(MODEL_TYPES)}"


def _read_json(path: Path, what: str) -> Any:
    """The JSON value in ``path`` (at most :data:`MAX_JSON_BYTES`); errors give line:col."""
    size = path.stat().st_size
    if size > MAX_JSON_BYTES:
        raise ModelConfigError(
            f"{path}: {size} bytes, more than the {MAX_JSON_BYTES} a {what} may have"
        )
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as error:
        raise ModelConfigError(f"{path}: not valid JSON (not UTF-8 text: {error})") from None
    except json.JSONDecodeError as error:
        raise ModelConfigError(
            f"{path}:{error.lineno}:{error.colno}: not valid JSON: {error.msg}"
        ) from None


def _resolve(directory: Path) -> tuple[dict[str, Any], ModelType]:
    """The ``config.json`` of ``directory`` (a JSON object) and its ``model_type``'s entry."""
    if not directory.exists():
        raise FileNotFoundError(
            f"model directory {directory} does not exist (a recipe run writes its model to "
            "OUTPUT_DIR/model when it finishes)"
        )
    if not directory.is_dir():
        raise FileNotFoundError(
            f"{directory} is not a directory; expected a model directory "
            f"({CONFIG_FILE}, model.safetensors, ...)"
        )
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(
            f"model directory {directory}: no {CONFIG_FILE} (is it a saved model? expected "
            f"{CONFIG_FILE} with a model_type; {_known()})"
        )
    try:
        config = _read_json(config_path, "model config")
    except ModelConfigError as error:
        raise ModelConfigError(
            f"{error}; expected a model config object with a model_type; {_known()}"
        ) from None
    if not isinstance(config, dict):
        raise ModelConfigError(
            f"{config_path}: expected a JSON object with a model_type, got "
            f"{type(config).__name__}; {_known()}"
        )
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in MODEL_TYPES:
        what = "no model_type" if model_type is None else f"unknown model_type {model_type!r}"
        raise ModelConfigError(f"{config_path}: {what}; {_known()}")
    return config, MODEL_TYPES[model_type]


def describe_field_error(item: Mapping[str, Any]) -> str:
    """One pydantic error (an item of ``ValidationError.errors()``) as ``"FIELD=VALUE exceeds
    the limit N"``, ``"FIELD: must be > 0 (got -1)"``, ``"missing key FIELD"``, ... — the field
    first, so a caller can prefix the file or replace the field by a flag name."""
    name = ".".join(str(part) for part in item["loc"])
    kind, ctx, value = item["type"], item.get("ctx") or {}, item.get("input")
    if kind == "missing":
        return f"missing key {name}"
    if kind == "extra_forbidden":
        return f"{name}: unknown key; remove it or check its spelling"
    if kind == "less_than_equal" and name:
        return f"{name}={value!r} exceeds the limit {ctx.get('le')}"
    if kind == "too_long":
        return (
            f"{name}: {ctx.get('actual_length')} items, more than the limit {ctx.get('max_length')}"
        )
    comparisons = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<"}
    if kind in comparisons:
        bound = ctx.get("gt", ctx.get("ge", ctx.get("lt")))
        return f"{name}: must be {comparisons[kind]} {bound} (got {value!r})"
    message = str(item["msg"]).removeprefix("Value error, ")
    if not name:  # a model validator: its message already starts with the field
        return message
    if kind == "value_error":
        return f"{name}: {message}"
    return f"{name}: {message[0].lower()}{message[1:]} (got {value!r})"


def _model_config(config: dict[str, Any], entry: ModelType, config_path: Path) -> Any:
    """``config`` validated as ``entry``'s config class (None for a loader without one)."""
    cls = entry.config_class
    if cls is None:
        return None
    data = {k: v for k, v in config.items() if k != "model_type"}
    try:
        return cls.model_validate(data)
    except ValidationError as error:
        items = error.errors()
        more = f" (and {len(items) - 1} more problems)" if len(items) > 1 else ""
        raise ModelConfigError(f"{config_path}: {describe_field_error(items[0])}{more}") from None


def _check_info(info: dict[str, Any], model_config: Any, info_path: Path) -> None:
    """The recorded sampler's sizes: integers in ``[1, SAMPLER_LIMITS[key]]``, and a token
    model's ``generation_length`` below its ``max_seq_len`` (room for a prompt)."""
    sampler = info.get("sampler")
    if sampler is None:
        return
    if not isinstance(sampler, dict):
        raise ModelConfigError(
            f"{info_path}: sampler: expected a JSON object, got {type(sampler).__name__}"
        )
    for key, limit in SAMPLER_LIMITS.items():
        if key not in sampler:
            continue
        value = sampler[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise ModelConfigError(
                f"{info_path}: sampler.{key}: expected an integer, got "
                f"{type(value).__name__} {value!r}"
            )
        if not 1 <= value <= limit:
            what = f"exceeds the limit {limit}" if value > limit else "must be >= 1"
            raise ModelConfigError(f"{info_path}: sampler.{key}={value} {what}")
    max_seq_len = getattr(model_config, "max_seq_len", None)
    length = sampler.get("generation_length")
    if max_seq_len is not None and length is not None and length >= max_seq_len:
        raise ModelConfigError(
            f"{info_path}: sampler.generation_length={length} leaves no room for a prompt "
            f"within the model's max_seq_len={max_seq_len}"
        )


def _read_info(directory: Path) -> dict[str, Any]:
    path = directory / INFO_FILE
    if not path.is_file():
        return {}
    info = _read_json(path, "model info file")
    if not isinstance(info, dict):
        raise ModelConfigError(f"{path}: expected a JSON object, got {type(info).__name__}")
    return info


def estimate_parameters(config: Mapping[str, Any]) -> int:
    """The parameter count of the model a ``config.json`` object (``config``, with its
    ``model_type``) describes, computed from the sizes alone with the model class's own
    formula (``parameter_count``); nothing is allocated.

    Raises:
        ModelConfigError: unknown ``model_type``, a config that does not validate (the message
            names the field), or a model type registered without a formula.
    """
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ModelConfigError(f"{CONFIG_FILE}: unknown model_type {model_type!r}; {_known()}")
    entry = MODEL_TYPES[model_type]
    if entry.parameter_count is None:
        raise ModelConfigError(f"model_type {model_type!r}: its loader has no parameter_count")
    return entry.parameter_count(_model_config(dict(config), entry, Path(CONFIG_FILE)))


def estimate_load_bytes(num_parameters: int) -> int:
    """Memory that loading a model of ``num_parameters`` needs: the parameters are built in
    the default dtype (float32: 4 bytes each) and ``model.safetensors`` is read beside them
    before being copied in, so twice the parameter bytes."""
    itemsize = torch.empty((), dtype=torch.get_default_dtype()).element_size()
    return 2 * num_parameters * itemsize


def available_memory() -> int | None:
    """Bytes of memory available now: ``MemAvailable`` of ``/proc/meminfo`` (Linux), else the
    physical memory from ``os.sysconf``; None where neither can be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def format_bytes(count: float) -> str:
    """``3.2 TiB``, ``24 GiB``, ``512 B``: binary units, 2 significant digits from KiB up."""
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
    value, unit = float(count), 0
    while value >= 1024 and unit < len(units) - 1:
        value, unit = value / 1024, unit + 1
    return (
        f"{value:.0f} {units[unit]}" if unit == 0 or value >= 10 else f"{value:.1f} {units[unit]}"
    )


def _check_memory(num_parameters: int, config_path: Path) -> None:
    required, available = estimate_load_bytes(num_parameters), available_memory()
    if available is not None and required > available:
        raise ModelTooLargeError(
            f"{config_path}: a model of {num_parameters:,} parameters would need "
            f"~{format_bytes(required)} of memory to load (parameters plus the weights file), "
            f"this machine has {format_bytes(available)} available",
            required,
            available,
        )


def check_model_directory(path: str | Path) -> dict[str, Any]:
    """Every check :func:`load_model` makes before building the model in ``path`` (module
    docstring): returns ``{"model_type", "kind", "config", "info", "num_parameters",
    "load_bytes"}`` (``config`` the validated config object, ``num_parameters`` /
    ``load_bytes`` None for a loader without a formula). Allocates nothing but the JSON."""
    directory = Path(path)
    raw, entry = _resolve(directory)
    config = _model_config(raw, entry, directory / CONFIG_FILE)
    info = _read_info(directory)
    _check_info(info, config, directory / INFO_FILE)
    tokenizer_path = directory / TOKENIZER_FILE
    if entry.kind == "token" and tokenizer_path.is_file():
        size = tokenizer_path.stat().st_size
        if size > MAX_JSON_BYTES:
            raise ModelConfigError(
                f"{tokenizer_path}: {size} bytes, more than the {MAX_JSON_BYTES} a tokenizer "
                "file may have"
            )
    count = (
        None if config is None or entry.parameter_count is None else entry.parameter_count(config)
    )
    if count is not None:
        _check_memory(count, directory / CONFIG_FILE)
    return {
        "model_type": raw["model_type"],
        "kind": entry.kind,
        "config": config,
        "info": info,
        "num_parameters": count,
        "load_bytes": None if count is None else estimate_load_bytes(count),
    }


def _load(directory: Path, entry: ModelType, info: dict[str, Any]) -> LoadedModel:
    model = entry.loader.from_pretrained(directory).eval()
    tokenizer = None
    if entry.kind == "token":
        tokenizer = CharTokenizer.load(directory)
        if tokenizer.vocab_size != model.vocab_size or tokenizer.mask_id != model.mask_token_id:
            raise ValueError(
                f"{directory}: tokenizer (vocab {tokenizer.vocab_size}, mask {tokenizer.mask_id}) "
                f"does not match the model (vocab {model.vocab_size}, mask {model.mask_token_id})"
            )
    else:
        task = getattr(getattr(model, "config", None), "task", None)
        if "task" not in info and task is not None:
            info["task"] = dict(task)
    return LoadedModel(model, entry.kind, tokenizer, info)


def load_model(path: str | Path) -> LoadedModel:
    """The model saved in the model directory ``path`` (see the module docstring), whatever its
    kind: the class is chosen by ``config.json``'s ``model_type`` (:data:`MODEL_TYPES`).

    For a flow model whose info lacks ``task``, ``info["task"]`` is the one recorded in the
    model's config.

    Nothing is built before the directory passed :func:`check_model_directory`.

    Raises:
        FileNotFoundError: ``path`` does not exist, is not a directory, or has no
            ``config.json`` (or a token model has no ``tokenizer.json``).
        ModelTooLargeError: loading would need more memory than is available (the message
            gives the estimate).
        ModelConfigError: (a ``ValueError``) ``config.json`` or the info file is not valid
            JSON (with line:col), too large, the ``model_type`` is missing or unknown (the
            message lists the known ones), a size is not an integer or beyond
            :data:`MODEL_LIMITS` / :data:`SAMPLER_LIMITS` (the message names the field).
        ValueError: the tokenizer does not match the model.
    """
    directory = Path(path)
    checked = check_model_directory(directory)
    return _load(directory, MODEL_TYPES[checked["model_type"]], checked["info"])


def _entry_for(model) -> ModelType:
    for entry in MODEL_TYPES.values():
        if isinstance(model, entry.loader):
            return entry
    classes = sorted({entry.loader.__name__ for entry in MODEL_TYPES.values()})
    raise TypeError(
        f"save_model: model: expected an instance of a registered model class {classes}, "
        f"got {type(model).__name__}"
    )


def _swap_in(staging: Path, directory: Path) -> None:
    """Replace ``directory`` by ``staging``; if the final rename fails, put the previous
    ``directory`` back."""
    retired = directory.with_name(f".{directory.name}.old")
    shutil.rmtree(retired, ignore_errors=True)
    had_previous = directory.exists()
    if had_previous:
        directory.rename(retired)
    try:
        staging.rename(directory)
    except BaseException:
        if had_previous and not directory.exists():
            retired.rename(directory)
        raise
    shutil.rmtree(retired, ignore_errors=True)


def save_model(
    path: str | Path, model, info: dict[str, Any], tokenizer: CharTokenizer | None = None
) -> Path:
    """Write ``model`` (``save_pretrained``), ``tokenizer`` (token models: required; flow
    models: none) and ``info`` into the model directory ``path``, replaced atomically: all of
    it goes into a staging directory beside ``path`` that is then renamed into place. Returns
    ``path``.

    Raises:
        TypeError: ``model`` is not an instance of a registered model class.
        ValueError: a token model without ``tokenizer``, or a flow model with one.
        FileExistsError: ``path`` exists and is not a directory.
    """
    entry = _entry_for(model)
    name = type(model).__name__
    if entry.kind == "token" and tokenizer is None:
        raise ValueError(
            f"save_model: {name} is a token model; pass its tokenizer (tokenizer=...) so the "
            f"directory can be decoded"
        )
    if entry.kind != "token" and tokenizer is not None:
        raise ValueError(f"save_model: {name} is a {entry.kind} model and takes no tokenizer")
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise FileExistsError(f"save_model: {directory} exists and is not a directory")
    directory.parent.mkdir(parents=True, exist_ok=True)
    # The staging directory sits inside a scratch directory beside ``path``, so whatever
    # ``save_pretrained`` puts next to its target (its own staging) is removed with it.
    scratch = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    try:
        staging = scratch / directory.name
        model.save_pretrained(staging)
        record = dict(info)
        if tokenizer is not None:
            tokenizer.save(staging)
            record = {"tokenizer": tokenizer.name, **info}
        (staging / INFO_FILE).write_text(json.dumps(record, indent=2) + "\n")
        _swap_in(staging, directory)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return directory
