"""Flow models from local directories: which kind a directory holds, how a diffusers pipeline
is loaded as a velocity model, and the *pipeline model directory* a recipe writes for a
pipeline actor. diffusers is imported only when a pipeline is built (the ``hf`` extra).

Kinds (the ``model.kind`` of the flow recipes' config): ``builtin`` (a model directory whose
``config.json`` names a built-in model type, e.g. the FlowDiT) or a diffusers pipeline:
``sd3`` (``StableDiffusion3Pipeline``), ``flux`` (``FluxPipeline``), ``wan``
(``WanPipeline``, text-to-video) and ``wan_i2v`` (``WanImageToVideoPipeline``), read from
``model_index.json``'s ``_class_name``.

A pipeline model directory (``config.json`` ``model_type`` = :data:`PIPELINE_MODEL_TYPE`)
records a trained pipeline model without copying the pipeline::

    config.json        {"model_type", "kind", "base", "dtype", "options", "lora", "weights"}
    model.safetensors  the trained weights: the LoRA weights ("weights": "lora") or the whole
                       transformer ("weights": "transformer"), keys as in adapter.state_dict()
    diffusion_rl.json  what it was trained for (task, serving sampler, trained steps)

``base`` is the absolute path of the directory training started from: a diffusers pipeline
directory, or another pipeline model directory. Loading (:meth:`PipelineModel.from_pretrained`,
also reached through :func:`diffusion_rl.models.io.load_model`) builds the base — a pipeline
directory with ``dtype`` and ``options`` (resolution, text length, ...), or, recursively, a
pipeline model directory whose LoRA is then merged into the transformer — and applies this
directory's weights (a LoRA stays a LoRA, so the loaded model computes exactly what training
computed). The same function builds a recipe's starting model, so a run resumed or reloaded
gives bitwise the outputs it had.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, ValidationError

from .lora import LoraSettings

__all__ = [
    "ADAPTER_OPTIONS",
    "DEFAULT_TEXT_CACHE",
    "DTYPES",
    "FLOW_KINDS",
    "PIPELINE_KINDS",
    "PIPELINE_MODEL_TYPE",
    "PipelineModel",
    "PipelineRecord",
    "adapter_class",
    "flow_directory_kind",
    "load_pipeline_model",
    "read_record",
]

PIPELINE_MODEL_TYPE = "diffusion_rl.flow_pipeline"
# model_index.json ``_class_name`` → kind
PIPELINE_KINDS: dict[str, str] = {
    "StableDiffusion3Pipeline": "sd3",
    "FluxPipeline": "flux",
    "WanPipeline": "wan",
    "WanImageToVideoPipeline": "wan_i2v",
}
FLOW_KINDS: tuple[str, ...] = ("builtin", *PIPELINE_KINDS.values())
_ADAPTERS = {
    "sd3": "SD3Adapter",
    "flux": "FluxAdapter",
    "wan": "WanAdapter",
    "wan_i2v": "WanImageToVideoAdapter",
}
# The adapter constructor options each kind takes (config keys of the same names).
_IMAGE_OPTIONS = ("height", "width", "max_sequence_length", "negative_prompt")
_VIDEO_OPTIONS = ("height", "width", "num_frames", "max_sequence_length", "negative_prompt")
ADAPTER_OPTIONS: dict[str, tuple[str, ...]] = {
    "sd3": _IMAGE_OPTIONS,
    "flux": (*_IMAGE_OPTIONS, "guidance_scale"),
    "wan": _VIDEO_OPTIONS,
    "wan_i2v": _VIDEO_OPTIONS,
}
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_TEXT_CACHE = 64
"""Prompts whose text embeddings a loaded pipeline keeps (see the adapters' text cache)."""
MAX_BASE_DEPTH = 8
"""The longest chain of pipeline model directories (each the ``base`` of the next) read."""
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


def adapter_class(kind: str) -> type:
    """The adapter class of a pipeline ``kind`` (imports diffusers)."""
    if kind not in _ADAPTERS:
        raise ValueError(f"kind: expected one of {sorted(_ADAPTERS)}, got {kind!r}")
    from . import diffusers_adapters

    return getattr(diffusers_adapters, _ADAPTERS[kind])


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None


def flow_directory_kind(path: str | Path) -> tuple[str, bool]:
    """``(kind, recorded)`` of a local directory: a diffusers pipeline directory
    (``model_index.json``) → its kind, ``recorded = False``; a pipeline model directory →
    its recorded kind, ``recorded = True``; any other model directory (``config.json``) →
    ``("builtin", False)``. ``FileNotFoundError`` when it has neither file, ``ValueError``
    for a pipeline class no adapter wraps."""
    directory = Path(path)
    index = directory / "model_index.json"
    if index.is_file():
        class_name = _read_json(index).get("_class_name")
        if class_name not in PIPELINE_KINDS:
            raise ValueError(
                f"{index}: _class_name is {class_name!r}; the flow recipes load "
                + ", ".join(f"{name} ({kind})" for name, kind in PIPELINE_KINDS.items())
            )
        return PIPELINE_KINDS[class_name], False
    config = directory / CONFIG_FILE
    if config.is_file():
        data = _read_json(config)
        if isinstance(data, dict) and data.get("model_type") == PIPELINE_MODEL_TYPE:
            return read_record(directory).kind, True
        return "builtin", False
    raise FileNotFoundError(
        f"{directory}: neither model_index.json (a diffusers pipeline directory) nor "
        f"{CONFIG_FILE} (a model directory); pass the root of one"
    )


class PipelineRecord(BaseModel):
    """The ``config.json`` of a pipeline model directory (module docstring)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model_type: Literal["diffusion_rl.flow_pipeline"] = PIPELINE_MODEL_TYPE
    kind: Literal["sd3", "flux", "wan", "wan_i2v"]
    base: str
    dtype: Literal["float32", "bfloat16"] = "float32"
    options: dict[str, Any] = {}
    lora: LoraSettings | None = None
    weights: Literal["lora", "transformer"]


def read_record(directory: str | Path) -> PipelineRecord:
    """The validated ``config.json`` of the pipeline model directory ``directory``; a
    ``ValueError`` names the file and the key."""
    path = Path(directory) / CONFIG_FILE
    data = _read_json(path)
    try:
        record = PipelineRecord.model_validate(data)
    except ValidationError as error:
        item = error.errors()[0]
        key = ".".join(str(part) for part in item["loc"]) or "config"
        raise ValueError(f"{path}: {key}: {item['msg']}") from None
    unknown = sorted(set(record.options) - set(ADAPTER_OPTIONS[record.kind]))
    if unknown:
        raise ValueError(
            f"{path}: options.{unknown[0]}: not an option of {record.kind} pipelines "
            f"(options: {', '.join(ADAPTER_OPTIONS[record.kind])})"
        )
    if (record.weights == "lora") != (record.lora is not None):
        raise ValueError(f"{path}: weights: 'lora' exactly when lora is set, got {record.weights}")
    return record


def _build(
    path: Path, kind: str, dtype: str, options: dict[str, Any], depth: int
) -> torch.nn.Module:
    """The model of ``path`` (a pipeline directory, or a pipeline model directory whose LoRA
    is merged), built with ``dtype`` and ``options``."""
    if depth > MAX_BASE_DEPTH:
        raise ValueError(
            f"{path}: more than {MAX_BASE_DEPTH} pipeline model directories chained through "
            "'base' (a cycle?); export one with `diffusion-rl export --merge` and start from it"
        )
    if (path / "model_index.json").is_file():
        found, _ = flow_directory_kind(path)
        if found != kind:
            raise ValueError(f"{path}: holds a {found} pipeline, expected {kind}")
        return adapter_class(kind).from_pretrained(path, torch_dtype=DTYPES[dtype], **options)
    record = read_record(path)
    if record.kind != kind:
        raise ValueError(f"{path}: holds a {record.kind} model, expected {kind}")
    adapter = _build(_base_path(path, record), kind, dtype, options, depth + 1)
    _apply_weights(adapter, path, record)
    if adapter.lora is not None:
        adapter.merge_lora()
    return adapter


def _base_path(directory: Path, record: PipelineRecord) -> Path:
    base = Path(record.base)
    if not base.is_dir():
        raise FileNotFoundError(
            f"{directory / CONFIG_FILE}: base: {record.base} (the directory this model was "
            "trained from) is not a directory; put it back, or export the model on the "
            "machine that has it (`diffusion-rl export --merge`)"
        )
    return base


def _apply_weights(adapter, directory: Path, record: PipelineRecord) -> None:
    """This directory's LoRA (added, then loaded) or transformer weights, strictly."""
    import safetensors.torch

    if record.lora is not None:  # its initial values are replaced by the stored ones
        with torch.random.fork_rng(devices=[]):  # the caller's RNG is left as it was
            adapter.add_lora(record.lora)
    try:
        safetensors.torch.load_model(adapter, str(directory / WEIGHTS_FILE), strict=True)
    except (OSError, RuntimeError) as error:
        raise ValueError(f"{directory / WEIGHTS_FILE}: does not fit the model: {error}") from None


def load_pipeline_model(
    path: str | Path,
    kind: str,
    *,
    dtype: str = "float32",
    options: dict[str, Any] | None = None,
    text_cache_size: int = DEFAULT_TEXT_CACHE,
) -> torch.nn.Module:
    """The *starting* model in ``path``: a diffusers pipeline directory as loaded, or a
    pipeline model directory with its trained weights merged in (a LoRA folded into the
    transformer). ``options`` are the adapter's (resolution, ...); with the text cache on."""
    adapter = _build(Path(path), kind, dtype, dict(options or {}), 0)
    adapter.cache_text_embeddings(text_cache_size)
    return adapter


class PipelineModel:
    """A trained pipeline model as a model directory (module docstring): the loader
    :func:`diffusion_rl.models.io.load_model` uses for :data:`PIPELINE_MODEL_TYPE`, and what
    :func:`~diffusion_rl.models.io.save_model` writes (``save_model(dir, PipelineModel(...),
    info)``).

    ``adapter``: the trained adapter (with its LoRA, or fully trained); ``base``: the
    directory training started from; ``dtype`` / ``options``: how the base is built.
    """

    def __init__(
        self, adapter, *, base: str | Path, kind: str, dtype: str, options: dict[str, Any]
    ) -> None:
        self.adapter = adapter
        self.record = PipelineRecord(
            kind=kind,
            base=str(Path(base).resolve()),
            dtype=dtype,
            options=dict(options),
            lora=adapter.lora,
            weights="transformer" if adapter.lora is None else "lora",
        )

    def save_pretrained(self, directory: str | Path) -> None:
        import safetensors.torch

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = self.record.model_dump(mode="json")
        (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        safetensors.torch.save_model(self.adapter, str(directory / WEIGHTS_FILE))

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> torch.nn.Module:
        """The trained adapter of a pipeline model directory (its LoRA kept as a LoRA), with
        the text cache on; raises ``ValueError`` / ``FileNotFoundError`` naming the file."""
        directory = Path(directory)
        record = read_record(directory)
        adapter = _build(
            _base_path(directory, record), record.kind, record.dtype, record.options, 1
        )
        _apply_weights(adapter, directory, record)
        adapter.cache_text_embeddings(DEFAULT_TEXT_CACHE)
        return adapter
