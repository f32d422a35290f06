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
  ``tokenizer``, the tokenizer's name). Optional when loading;
* ``manifest.json`` (:mod:`.manifest`): the size and SHA-256 of every other file, written
  last. Optional when loading (a downloaded checkpoint has none).

:func:`save_model` writes everything into a staging directory next to the target and then
swaps it in with renames, so an interrupted save leaves the previous directory (or nothing),
never a half-written model; the manifest is written last, into the staging directory. A new
architecture is one :func:`register_model_type` call.

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

Verified loading: after those checks, and before anything is built, every file is checked
against the directory's ``manifest.json`` (sizes and SHA-256; a mismatch is a
:class:`ManifestMismatchError` naming the file) and every ``*.safetensors`` header must parse
(:class:`ModelFileError` naming the file: empty, truncated, random bytes, a pickle); a
directory without a manifest loads after the header checks, with one warning line saying it
is unverified (:func:`~.manifest.check_model_files`). Weights that do not fit the model
(a missing or reshaped tensor) are a :class:`ModelFileError` naming the weights file, and
weights holding NaN or infinity a :class:`NonFiniteWeightsError` naming the tensor.

Hugging Face token checkpoints (LLaDA, Dream, SDAR: docs/models.md) are read from their own
directories, chosen by ``config.json``'s ``model_type`` (case-insensitive) in
:data:`HF_MODEL_TYPES`, whose adapters are imported only when one is loaded. The same checks
apply (the adapter's ``parameter_count`` validates the family config), plus the loading
safety rules: weights are safetensors only (pickle ``*.bin`` / ``*.pt`` are refused), no code
from the directory is run (a tokenizer that is remote code needs ``trust_remote_code=True``),
and a path that is not a local directory but looks like a Hub id fails at once
(:func:`check_local_directory`: no network, with or without ``HF_HUB_OFFLINE``).
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import torch
from pydantic import BaseModel, ValidationError

from .dit import MODEL_TYPE as FLOW_DIT_MODEL_TYPE
from .dit import FlowDiT
from .flow_pipelines import PIPELINE_MODEL_TYPE, PipelineModel
from .loading import (  # noqa: F401 (re-exported: every loader's shared checks)
    MAX_JSON_BYTES,
    HubIdError,
    ManifestMismatchError,
    ModelConfigError,
    ModelFileError,
    NonFiniteWeightsError,
    check_local_directory,
    refuse_hub_id,
)
from .lora import is_lora_directory, load_lora_model
from .manifest import (
    check_model_files,
    first_non_finite,
    warn_unverified,
    weights_file_name,
    write_manifest,
)
from .tokenizer import CharTokenizer
from .transformer import MODEL_TYPE as TRANSFORMER_MODEL_TYPE
from .transformer import DiffusionTransformer
from .video_dit import MODEL_TYPE as VIDEO_DIT_MODEL_TYPE
from .video_dit import VideoDiT

CONFIG_FILE = "config.json"
INFO_FILE = "diffusion_rl.json"
TOKENIZER_FILE = "tokenizer.json"

SAMPLER_LIMITS: dict[str, int] = {
    "generation_length": 1 << 20,
    "block_size": 1 << 20,
    "steps_per_block": 1 << 20,
    "num_steps": 10_000,
}
"""The largest sizes the ``sampler`` recorded in :data:`INFO_FILE` may hold (each also >= 1)."""


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
    hf: bool = False  # a Hugging Face family (HF_MODEL_TYPES): its own config.json and weights

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
# A trained diffusers pipeline (base pipeline path + LoRA or transformer weights); diffusers is
# imported only when one is loaded (models/flow_pipelines.py, docs/flow_models.md).
register_model_type(PIPELINE_MODEL_TYPE, PipelineModel, "flow")

MODEL_LIMITS: dict[str, Mapping[str, int | float]] = {
    TRANSFORMER_MODEL_TYPE: DiffusionTransformer.size_limits,
    FLOW_DIT_MODEL_TYPE: FlowDiT.size_limits,
    VIDEO_DIT_MODEL_TYPE: VideoDiT.size_limits,
}
"""``model_type`` → the largest value of each size field its ``config.json`` may hold (the
built-in config classes enforce them: :data:`~diffusion_rl.models.transformer.SIZE_LIMITS`,
:data:`~diffusion_rl.models.dit.SIZE_LIMITS`,
:data:`~diffusion_rl.models.video_dit.VIDEO_SIZE_LIMITS`)."""

HF_MODEL_TYPES: dict[str, str] = {
    "llada": "diffusion_rl.models.hf.llada:LLaDADenoiser",
    "dream": "diffusion_rl.models.hf.dream:DreamDenoiser",
    "sdar": "diffusion_rl.models.hf.sdar:SDARDenoiser",
}
"""Hugging Face token families: lower-cased ``config.json`` ``model_type`` → ``"module:Class"``
of the adapter (an :class:`~diffusion_rl.models.hf.common.HFTokenDenoiser`), imported only
when a directory of that type is loaded; extend with :func:`register_hf_family`."""


def register_hf_family(model_type: str, target: str) -> None:
    """Make :func:`load_model` read Hugging Face directories whose ``config.json`` says
    ``model_type`` (any case) with the adapter ``target`` (``"package.module:Class"``)."""
    if not isinstance(target, str) or target.count(":") != 1:
        raise ValueError(f"target: expected 'package.module:Class', got {target!r}")
    HF_MODEL_TYPES[model_type.lower()] = target


def _hf_entry(model_type: str, config_path: Path) -> ModelType:
    """The adapter class of a Hugging Face family, imported now."""
    module_name, class_name = HF_MODEL_TYPES[model_type.lower()].split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name:
            raise
        raise ModelConfigError(
            f"{config_path}: model_type {model_type!r}: its adapter {module_name} is not "
            "available in this installation of diffusion_rl"
        ) from None
    return ModelType("token", getattr(module, class_name), hf=True)


def _hf_class_of(model) -> ModelType | None:
    """The Hugging Face family entry ``model`` is an instance of (adapters already imported)."""
    for target in HF_MODEL_TYPES.values():
        module_name, class_name = target.split(":")
        cls = getattr(sys.modules.get(module_name), class_name, None)
        if cls is not None and isinstance(model, cls):
            return ModelType("token", cls, hf=True)
    return None


@dataclass(frozen=True)
class LoadedModel:
    """What :func:`load_model` read: ``model`` (in eval mode), its ``kind`` (``"token"`` or
    ``"flow"``), ``tokenizer`` (a :class:`CharTokenizer` for built-in token models, an
    :class:`~diffusion_rl.models.hf.HFTokenizer` for Hugging Face ones, ``None`` for flow
    models) and ``info`` (``task``, ``sampler``, ``trained_steps``, ...; ``{}`` when the
    directory has no :data:`INFO_FILE`)."""

    model: Any
    kind: ModelKind
    tokenizer: Any = None
    info: dict[str, Any] = field(default_factory=dict)


def _known() -> str:
    return (
        f"known model types: {sorted(MODEL_TYPES)}; Hugging Face token families (any case): "
        f"{sorted(HF_MODEL_TYPES)}"
    )


def _unknown_type(config: dict[str, Any], model_type: Any, config_path: Path) -> str:
    what = "no model_type" if model_type is None else f"unknown model_type {model_type!r}"
    auto_map = config.get("auto_map")
    if not auto_map:
        return f"{config_path}: {what}; {_known()}"
    return (
        f"{config_path}: {what}, whose architecture needs remote code (auto_map {auto_map}) "
        "and has no stock mapping here; diffusion_rl never runs a checkpoint's modeling code "
        "(trust_remote_code=True only admits a tokenizer's), so this model needs an adapter "
        f"(register_hf_family); {_known()}"
    )


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
    if isinstance(model_type, str) and model_type in MODEL_TYPES:
        return config, MODEL_TYPES[model_type]
    if isinstance(model_type, str) and model_type.lower() in HF_MODEL_TYPES:
        return config, _hf_entry(model_type, config_path)
    raise ModelConfigError(_unknown_type(config, model_type, config_path))


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
    hf = isinstance(model_type, str) and model_type.lower() in HF_MODEL_TYPES
    if hf and model_type not in MODEL_TYPES:
        path = Path(CONFIG_FILE)
        return _hf_parameter_count(_hf_entry(model_type, path), dict(config), path)
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


def _hf_parameter_count(entry: ModelType, config: dict[str, Any], config_path: Path) -> int:
    """The adapter's count (which validates the family config), errors prefixed by the file."""
    try:
        return entry.loader.parameter_count(config)
    except ValueError as error:  # ModelConfigError, or an adapter's own ValueError
        raise ModelConfigError(f"{config_path}: {error}") from None


def _check_memory(num_parameters: int, config_path: Path, required: int | None = None) -> None:
    if required is None:
        required = estimate_load_bytes(num_parameters)
    available = available_memory()
    if available is not None and required > available:
        raise ModelTooLargeError(
            f"{config_path}: a model of {num_parameters:,} parameters would need "
            f"~{format_bytes(required)} of memory to load (parameters plus the weights file), "
            f"this machine has {format_bytes(available)} available",
            required,
            available,
        )


def check_model_directory(path: str | Path, *, dtype: torch.dtype | str | None = None) -> dict:
    """Every check :func:`load_model` makes before building the model in ``path`` (module
    docstring): returns ``{"model_type", "kind", "config", "info", "num_parameters",
    "load_bytes"}`` (``config`` the validated config object — for a Hugging Face family the
    ``config.json`` object —, ``num_parameters`` / ``load_bytes`` None for a loader without a
    formula). Allocates nothing but the JSON (and, for a Hugging Face family, the
    safetensors headers; its load estimate is the parameters in ``dtype``, default the stored
    one, plus the largest weights file)."""
    refuse_hub_id(path, "model directory")
    directory = Path(path)
    raw, entry = _resolve(directory)
    if entry.hf:
        return _check_hf_directory(directory, raw, entry, dtype)
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


def _check_hf_directory(directory: Path, raw: dict, entry: ModelType, dtype) -> dict[str, Any]:
    from .hf.common import find_checkpoint, resolve_dtype

    config_path = directory / CONFIG_FILE
    info = _read_info(directory)
    count = _hf_parameter_count(entry, raw, config_path)
    max_seq_len = getattr(entry.loader, "max_seq_len_of", None)
    limits = None if max_seq_len is None else SimpleNamespace(max_seq_len=max_seq_len(raw))
    _check_info(info, limits, directory / INFO_FILE)
    checkpoint = find_checkpoint(directory)  # safetensors only
    resolved = resolve_dtype(dtype)
    itemsize = checkpoint.stored_itemsize if resolved is None else resolved.itemsize
    required = count * itemsize + checkpoint.largest_file_bytes
    _check_memory(count, config_path, required)
    return {
        "model_type": raw["model_type"],
        "kind": entry.kind,
        "config": raw,
        "info": info,
        "num_parameters": count,
        "load_bytes": required,
    }


def _entry_of(model_type: str, directory: Path) -> ModelType:
    if model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    return _hf_entry(model_type, directory / CONFIG_FILE)


def _load(
    directory: Path,
    entry: ModelType,
    info: dict[str, Any],
    *,
    dtype=None,
    device=None,
    trust_remote_code: bool = False,
) -> LoadedModel:
    if entry.hf:
        from .hf.tokenizer import HFTokenizer

        model = entry.loader.from_pretrained(
            directory, dtype=dtype, device=device, trust_remote_code=trust_remote_code
        ).eval()
        tokenizer = HFTokenizer.from_pretrained(
            directory,
            vocab_size=model.vocab_size,
            mask_id=model.mask_token_id,
            trust_remote_code=trust_remote_code,
        )
        return LoadedModel(model, "token", tokenizer, info)
    model = _from_pretrained(entry, directory).eval()
    if dtype is not None or device is not None:
        from .hf.common import resolve_dtype

        model = model.to(device=device, dtype=resolve_dtype(dtype))
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


def _from_pretrained(entry: ModelType, directory: Path):
    """``entry.loader.from_pretrained(directory)``, a weights file that does not fit the model
    (a missing, extra or reshaped tensor; a file the header checks let through) a
    :class:`ModelFileError` naming it."""
    import safetensors

    try:
        return entry.loader.from_pretrained(directory)
    except (RuntimeError, safetensors.SafetensorError) as error:
        if isinstance(error, torch.OutOfMemoryError):
            raise
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        if len(lines) > 1 and lines[0].startswith("Error(s) in loading state_dict"):
            lines = lines[1:]  # torch's "Error(s) in loading state_dict for CLASS:"
        detail = " ".join(lines) or type(error).__name__
        detail = detail if len(detail) <= 240 else detail[:237] + "..."
        raise ModelFileError(
            directory,
            weights_file_name(directory),
            f"its weights do not fit the model {CONFIG_FILE} describes ({detail}); the file is "
            "damaged or belongs to another model: write the directory again or restore it",
        ) from None


def check_finite_weights(model, directory: str | Path) -> None:
    """Refuse ``model`` (just loaded from ``directory``) if a floating parameter or buffer
    holds NaN or infinity: :class:`NonFiniteWeightsError` naming the tensor (and the weights
    file, when the directory has one)."""
    if not hasattr(model, "state_dict"):
        return
    found = first_non_finite(model.state_dict())
    if found is None:
        return
    name, problem = found
    raise NonFiniteWeightsError(
        directory,
        weights_file_name(directory),
        f"tensor {name!r} holds {problem}; the weights are damaged or come from a diverged "
        "run: load an earlier checkpoint or model directory",
        tensor=name,
    )


def load_model(
    path: str | Path,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    trust_remote_code: bool = False,
) -> LoadedModel:
    """The model saved in the model directory ``path`` (see the module docstring), whatever its
    kind: the class is chosen by ``config.json``'s ``model_type`` (:data:`MODEL_TYPES`, then
    the Hugging Face families of :data:`HF_MODEL_TYPES`).

    ``dtype`` (``torch.bfloat16`` or ``"bf16"``, ...) and ``device`` place the weights (default:
    a Hugging Face checkpoint keeps its stored dtype, a built-in model float32; CPU).
    ``trust_remote_code`` admits a Hugging Face tokenizer whose class is the directory's own
    code; a model's code is never run (the families use transformers' stock classes).

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
        HubIdError: (a ``ValueError``) ``path`` is not a local directory and looks like a Hub
            id (raised before anything is read; see :func:`check_local_directory`).
        ManifestMismatchError: (a ``ModelFileError``) a file differs from what the
            directory's ``manifest.json`` records (naming the file).
        ModelFileError: (a ``ValueError``) a weights file that is empty, truncated, not
            safetensors, or whose tensors do not fit the model (naming the file).
        NonFiniteWeightsError: (a ``ModelFileError``) the weights hold NaN or infinity
            (naming the tensor).
        CheckpointFormatError / CheckpointKeyError: (``ValueError``) a Hugging Face directory
            whose weights are not safetensors, or do not match its ``config.json``.
    """
    if not isinstance(trust_remote_code, bool):
        raise TypeError(f"trust_remote_code: expected a bool, got {trust_remote_code!r}")
    refuse_hub_id(path, "model directory")
    directory = Path(path)
    if is_lora_directory(directory):  # the base directory's model, then the adapter
        verified = check_model_files(directory, warn=False)
        loaded = load_lora_model(directory, load_model)
        check_finite_weights(loaded.model, directory)
        if not verified:
            warn_unverified(directory)
        return loaded
    checked = check_model_directory(directory, dtype=dtype)
    verified = check_model_files(directory, warn=False)
    entry = _entry_of(checked["model_type"], directory)
    loaded = _load(
        directory,
        entry,
        checked["info"],
        dtype=dtype,
        device=device,
        trust_remote_code=trust_remote_code,
    )
    check_finite_weights(loaded.model, directory)
    if not verified:
        warn_unverified(directory)
    return loaded


def _entry_for(model) -> ModelType:
    for entry in MODEL_TYPES.values():
        if isinstance(model, entry.loader):
            return entry
    hf_entry = _hf_class_of(model)
    if hf_entry is not None:
        return hf_entry
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
    models: none), ``info`` and, last, the ``manifest.json`` of them all into the model
    directory ``path``, replaced atomically: all of it goes into a staging directory beside
    ``path`` that is then renamed into place. Returns ``path``.

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
        write_manifest(staging)
        _swap_in(staging, directory)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return directory
