"""Model directories: one loader (:func:`load_model`) and one writer (:func:`save_model`) for
every model the project writes.

A model directory holds:

* ``config.json``: the architecture, with a ``model_type`` naming the class that reads it
  (see :data:`MODEL_TYPES`; built in: ``"diffusion_rl.transformer"`` → the token denoiser
  :class:`~diffusion_rl.models.transformer.DiffusionTransformer`, ``"diffusion_rl.flow_dit"``
  → the flow-matching image model :class:`~diffusion_rl.models.dit.FlowDiT`);
* ``model.safetensors``: the weights;
* ``tokenizer.json``: the :class:`~diffusion_rl.models.tokenizer.CharTokenizer` (token models
  only; its vocabulary and MASK id must match the model's);
* ``diffusion_rl.json`` (:data:`INFO_FILE`): what the model was trained for: ``task``, the
  serving ``sampler`` settings, ``trained_steps``, ... (token models also record
  ``tokenizer``, the tokenizer's name). Optional when loading.

:func:`save_model` writes everything into a staging directory next to the target and then
swaps it in with renames, so an interrupted save leaves the previous directory (or nothing),
never a half-written model. A new architecture is one :func:`register_model_type` call.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .dit import MODEL_TYPE as FLOW_DIT_MODEL_TYPE
from .dit import FlowDiT
from .tokenizer import CharTokenizer
from .transformer import MODEL_TYPE as TRANSFORMER_MODEL_TYPE
from .transformer import DiffusionTransformer

CONFIG_FILE = "config.json"
INFO_FILE = "diffusion_rl.json"

ModelKind = Literal["token", "flow"]
KINDS: tuple[str, ...] = ("token", "flow")
"""``"token"``: a masked-diffusion token denoiser (with a tokenizer); ``"flow"``: a
flow-matching velocity model (images; no tokenizer)."""


@dataclass(frozen=True)
class ModelType:
    """A registered ``config.json`` ``model_type``: its ``kind`` and the ``loader`` class
    (``loader.from_pretrained(directory)`` reads the model; instances are saved with
    ``model.save_pretrained(directory)``)."""

    kind: ModelKind
    loader: type


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


def _resolve(directory: Path) -> tuple[str, ModelType]:
    """The ``model_type`` recorded in ``directory/config.json`` and its registry entry."""
    if not directory.exists():
        raise FileNotFoundError(f"model directory {directory} does not exist")
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
        config = json.loads(config_path.read_text("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(
            f"{config_path}: not valid JSON ({error}); expected a model config object with a "
            f"model_type; {_known()}"
        ) from None
    if not isinstance(config, dict):
        raise ValueError(
            f"{config_path}: expected a JSON object with a model_type, got "
            f"{type(config).__name__}; {_known()}"
        )
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        what = "no model_type" if model_type is None else f"unknown model_type {model_type!r}"
        raise ValueError(f"{config_path}: {what}; {_known()}")
    return model_type, MODEL_TYPES[model_type]


def _read_info(directory: Path) -> dict[str, Any]:
    path = directory / INFO_FILE
    if not path.is_file():
        return {}
    try:
        info = json.loads(path.read_text("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(info, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(info).__name__}")
    return info


def _load(directory: Path, entry: ModelType) -> LoadedModel:
    model = entry.loader.from_pretrained(directory).eval()
    info = _read_info(directory)
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

    Raises:
        FileNotFoundError: ``path`` does not exist, is not a directory, or has no
            ``config.json`` (or a token model has no ``tokenizer.json``).
        ValueError: ``config.json`` or the info file is not valid JSON, the ``model_type`` is
            missing or unknown (the message lists the known ones), or the tokenizer does not
            match the model.
    """
    directory = Path(path)
    _, entry = _resolve(directory)
    return _load(directory, entry)


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
