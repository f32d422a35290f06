"""LoRA for every model family (token denoisers and flow generators), through peft.

:class:`LoraSettings` is the ``lora:`` field of every config model section; it has no peft
import, so configs can hold it without the ``hf`` extra (peft is imported by the functions
that need it). ``alpha`` defaults to ``rank`` (scale 1); ``target_modules`` defaults to the
model class's own ``lora_targets`` (peft matches each target against module names and their
dotted suffixes); ``dropout`` is 0 by default, so a LoRA run stays deterministic.

Invariants of :func:`add_lora` (our ``nn.Module`` models: the built-in token transformer,
FlowDiT / VideoDiT, the Hugging Face token adapters of :mod:`diffusion_rl.models.hf`):

* peft's ``inject_adapter_in_model`` wraps each target layer in place; the model keeps its
  class and its call signatures (no ``PeftModel`` wrapper).
* Only the adapter weights (``lora_A`` / ``lora_B``) have ``requires_grad``; every base weight
  is frozen and is never changed by training.
* The ``B`` matrices start at zero, so a fresh adapter leaves every output *bitwise*
  unchanged (the adapter adds exactly ``0``). The ``A`` matrices are drawn from a generator
  seeded with ``seed``, inside a fork of torch's CPU RNG: the run's own random stream is
  untouched and the adapter depends on ``seed`` alone.
* Every target must match at least one Linear, Embedding or Conv layer, and must not be a
  layer whose weight is tied to another (a merge would change both); errors name the field
  and list the module names that exist.

Diffusers pipeline adapters (:mod:`diffusion_rl.models.diffusers_adapters`) carry their own
``add_lora`` / ``lora_disabled`` / ``lora_reference``; the functions here delegate to them.

A LoRA model directory (what a LoRA run writes; :func:`save_lora_model`) holds no copy of the
base model::

    config.json          {"model_type": "diffusion_rl.lora", "base_model": ABSOLUTE PATH,
                          "base_fingerprint": HEX, "lora": {rank, alpha, dropout,
                          target_modules}}
    adapter.safetensors  the adapter weights (lora_state_dict)
    diffusion_rl.json    task, sampler, trained_steps, ... (as in every model directory)

:func:`~diffusion_rl.models.io.load_model` reads it by loading the base directory, then
applying the adapter (:func:`load_lora_model`); ``base_fingerprint`` (sizes and sampled bytes
of the base's files) makes a changed base an error instead of a silently different model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = [
    "ADAPTER_FILE",
    "LORA_MODEL_TYPE",
    "LoraReference",
    "LoraSettings",
    "add_lora",
    "has_lora",
    "is_lora_directory",
    "load_lora_model",
    "load_lora_state_dict",
    "lora_base",
    "lora_disabled",
    "lora_reference",
    "lora_settings",
    "lora_state_dict",
    "merge_lora",
    "save_lora_model",
]

LORA_MODEL_TYPE = "diffusion_rl.lora"
"""The ``model_type`` of a LoRA model directory's ``config.json``."""
ADAPTER_FILE = "adapter.safetensors"
CONFIG_FILE = "config.json"
INFO_FILE = "diffusion_rl.json"  # the same name as models.io.INFO_FILE (io imports this module)
_MAX_CONFIG_BYTES = 1 << 20
_FINGERPRINT_BYTES = 1 << 20
_LORA_KEY = ".lora_"  # in every adapter weight's state-dict key (lora_A, lora_B, ...)
_RECORD = "_diffusion_rl_lora"  # the attribute add_lora leaves on the model


class LoraSettings(BaseModel):
    """``rank`` r, ``alpha`` (None: r), ``dropout`` in [0, 1), ``target_modules`` (None: the
    model family's default targets)."""

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(16, gt=0)
    alpha: float | None = Field(None, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] | None = None


@dataclasses.dataclass(frozen=True)
class _LoraRecord:
    settings: LoraSettings  # alpha and target_modules resolved
    base: str | None  # the base model directory, when known


# ----------------------------------------------------------------------------- inspection
def _tuner_layers(model: Any) -> list[tuple[str, Any]]:
    """``(name, layer)`` of every peft tuner layer in ``model`` (none when peft was never
    imported: then no model can carry one)."""
    if "peft" not in sys.modules or not callable(getattr(model, "named_modules", None)):
        return []
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [(n, m) for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)]


def has_lora(model: Any) -> bool:
    """Whether ``model`` carries a LoRA adapter (peft tuner layers)."""
    return bool(_tuner_layers(model))


def lora_settings(model: Any) -> LoraSettings | None:
    """The settings of the adapter ``model`` carries (alpha and targets resolved), or None."""
    record = getattr(model, _RECORD, None)
    if isinstance(record, _LoraRecord) and has_lora(model):
        return record.settings
    settings = getattr(model, "lora", None)  # a diffusers pipeline adapter
    return settings if isinstance(settings, LoraSettings) else None


def lora_base(model: Any) -> str | None:
    """The base model directory recorded by :func:`add_lora` (``base=``), or None."""
    record = getattr(model, _RECORD, None)
    return record.base if isinstance(record, _LoraRecord) else None


def _is_pipeline_adapter(model: Any) -> bool:
    return callable(getattr(model, "lora_reference", None)) and hasattr(model, "lora")


# ----------------------------------------------------------------------------- adding
def _adaptable(module: Any) -> bool:
    from torch import nn

    kinds = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d)
    return isinstance(module, kinds) or type(module).__name__ == "Conv1D"  # transformers'


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def _name_patterns(names: list[str]) -> str:
    """Module names with layer indices folded (``blocks.N.attn.qkv``), at most 40."""
    patterns = list(dict.fromkeys(re.sub(r"\.\d+\.", ".N.", name) for name in names))
    more = f", ... ({len(patterns) - 40} more)" if len(patterns) > 40 else ""
    return ", ".join(patterns[:40]) + more


def _check_targets(model: Any, targets: list[str], field: str) -> None:
    """Every target matches an adaptable layer whose weight is not tied to another's."""
    modules = dict(model.named_modules())
    adaptable = [name for name, module in modules.items() if name and _adaptable(module)]
    owners: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(name)
    for target in targets:
        if not isinstance(target, str) or not target:
            raise ValueError(f"{field}.target_modules: expected module names, got {target!r}")
        matched = [name for name in modules if name and _matches(name, target)]
        if not matched:
            raise ValueError(
                f"{field}.target_modules: {target!r} matches no module of "
                f"{type(model).__name__}; a target is a module name or its dotted suffix. "
                f"Its Linear / Embedding / Conv modules: {_name_patterns(adaptable)}"
            )
        for name in matched:
            module = modules[name]
            if not _adaptable(module):
                raise ValueError(
                    f"{field}.target_modules: {target!r} matches {name!r}, a "
                    f"{type(module).__name__}; LoRA adapts Linear, Embedding and Conv layers "
                    f"(those of {type(model).__name__}: {_name_patterns(adaptable)})"
                )
            tied = [n for n in owners.get(id(module.weight), []) if n != f"{name}.weight"]
            if tied:
                raise ValueError(
                    f"{field}.target_modules: {target!r} matches {name!r}, whose weight is "
                    f"tied to {tied}; a LoRA on a tied weight cannot be merged into it. "
                    "Leave that module out of target_modules."
                )


def add_lora(
    model: Any,
    settings: LoraSettings | dict,
    *,
    seed: int = 0,
    field: str = "lora",
    base: str | os.PathLike | None = None,
) -> Any:
    """Inject a LoRA adapter into ``model`` in place (module invariants) and return it.

    ``field`` prefixes every error (e.g. ``"model.lora"``); ``base`` is the directory the
    model was loaded from, recorded for :func:`save_lora_model`. A diffusers pipeline
    adapter gets its own ``add_lora(settings)`` (its targets, its records). Raises ``ValueError`` for a
    model that already carries a LoRA (merge it first: :func:`merge_lora`), a model class
    without ``lora_targets`` when ``target_modules`` is not set, or a bad target.
    """
    import torch
    from peft import LoraConfig, inject_adapter_in_model

    settings = LoraSettings.model_validate(settings)
    if _is_pipeline_adapter(model):
        model.add_lora(settings)
        return model
    if has_lora(model):
        raise ValueError(
            f"{field}: {type(model).__name__} already carries a LoRA adapter; merge it into "
            "the weights first (merge_lora) or train that adapter"
        )
    targets = settings.target_modules or getattr(model, "lora_targets", None)
    if not targets:
        raise ValueError(
            f"{field}.target_modules: {type(model).__name__} has no default LoRA targets "
            "(no lora_targets); set target_modules to the names of the layers to adapt"
        )
    targets = list(targets)
    _check_targets(model, targets, field)
    resolved = settings.model_copy(
        update={"alpha": settings.alpha or float(settings.rank), "target_modules": targets}
    )
    config = LoraConfig(
        r=resolved.rank,
        lora_alpha=resolved.alpha,
        lora_dropout=resolved.dropout,
        target_modules=targets,
        init_lora_weights=True,
        bias="none",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_adapter_in_model(config, model)
    for name, param in model.named_parameters():
        param.requires_grad_(_LORA_KEY in f".{name}")
    object.__setattr__(
        model, _RECORD, _LoraRecord(resolved, None if base is None else str(Path(base).resolve()))
    )
    return model


# ----------------------------------------------------------------------------- weights
def lora_state_dict(model: Any) -> dict[str, Any]:
    """The adapter weights: the entries of ``model.state_dict()`` whose key names a LoRA
    weight (``...lora_A.default.weight``, ...), sharing storage with the model."""
    return {k: v for k, v in model.state_dict().items() if _LORA_KEY in f".{k}"}


def load_lora_state_dict(model: Any, state: dict[str, Any], *, source: str = "state") -> None:
    """Copy adapter weights ``state`` (exactly the keys of :func:`lora_state_dict`, with its
    shapes) into ``model``; ``ValueError`` naming ``source`` and the keys otherwise."""
    import torch

    own = lora_state_dict(model)
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    wrong = [
        f"{k}: {tuple(state[k].shape)}, the model has {tuple(own[k].shape)}"
        for k in sorted(set(own) & set(state))
        if tuple(state[k].shape) != tuple(own[k].shape)
    ]
    if missing or unexpected or wrong:
        lines = [f"missing {missing[:5]}"] if missing else []
        lines += [f"unexpected {unexpected[:5]}"] if unexpected else []
        lines += wrong[:5]
        raise ValueError(
            f"{source}: the adapter weights do not fit {type(model).__name__} "
            f"({'; '.join(lines)}); were they written for another base model or LoRA settings?"
        )
    with torch.no_grad():
        for key, tensor in own.items():
            tensor.copy_(state[key])


def merge_lora(model: Any) -> Any:
    """Merge the adapter into the base weights (``W + (alpha / r) B A``), remove every LoRA
    layer and return the plain model (in place; same class, the original module names and
    state-dict keys). Every parameter then has ``requires_grad`` (a freshly loaded model).
    ``ValueError`` when ``model`` has no LoRA or the merge gives non-finite weights."""
    layers = _tuner_layers(model)
    if not layers:
        raise ValueError(f"merge_lora: {type(model).__name__} carries no LoRA adapter")
    import torch

    with torch.no_grad():
        for name, layer in layers:
            layer.merge(safe_merge=True)
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, layer.get_base_layer())
    for param in model.parameters():
        param.requires_grad_(True)
    for attribute in (_RECORD, "peft_config"):
        model.__dict__.pop(attribute, None)
    return model


# ----------------------------------------------------------------------------- reference
@contextlib.contextmanager
def lora_disabled(model: Any) -> Iterator[Any]:
    """The base model inside the block: every adapter of ``model`` switched off (outputs are
    exactly the base's). ``requires_grad`` of every parameter is restored on exit."""
    if _is_pipeline_adapter(model):
        with model.lora_disabled() as base:
            yield base
        return
    layers = [layer for _, layer in _tuner_layers(model)]
    if not layers:
        raise ValueError(f"lora_disabled: {type(model).__name__} carries no LoRA adapter")
    flags = [(param, param.requires_grad) for param in model.parameters()]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for param, flag in flags:
            param.requires_grad_(flag)


class LoraReference:
    """The reference policy of a LoRA run: the actor itself with its adapter switched off
    and in eval mode, so it holds no weight of its own (no second copy of the base).

    Calling it, or any method of the model through it (``forward_packed``, ``new_cache``,
    ...), runs the base model; other attributes (``vocab_size``, submodules) are the model's. ``to``,
    ``eval`` and ``train`` do nothing (the weights are the actor's). :meth:`active` gives the
    plain model for a block of calls (what ``PolicyRoles.on_compute`` does). Score it
    without gradient, as a reference is scored.
    """

    def __init__(self, model: Any) -> None:
        if not has_lora(model):
            raise ValueError(f"LoraReference: {type(model).__name__} carries no LoRA adapter")
        self.model = model

    @contextlib.contextmanager
    def active(self) -> Iterator[Any]:
        """The model with its adapter off and every module in eval mode; restored on exit."""
        modes = [(module, module.training) for module in self.model.modules()]
        self.model.eval()
        try:
            with lora_disabled(self.model) as base:
                yield base
        finally:
            for module, mode in modes:
                module.training = mode

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.active() as base:
            return base(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name == "model":  # not set yet (unpickling)
            raise AttributeError(name)
        value = getattr(self.model, name)
        if not inspect.ismethod(value):  # fields, submodules, classes: the model's own
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            with self.active():
                return value(*args, **kwargs)

        return call

    def parameters(self, recurse: bool = True):
        return self.model.parameters(recurse)

    def to(self, *args: Any, **kwargs: Any) -> LoraReference:
        return self

    def eval(self) -> LoraReference:
        return self

    def train(self, mode: bool = True) -> LoraReference:
        return self


def lora_reference(model: Any) -> Any:
    """The reference policy of a LoRA ``model``, sharing its weights: a :class:`LoraReference`
    (a diffusers pipeline adapter's own ``lora_reference()`` view for those)."""
    if _is_pipeline_adapter(model):
        return model.lora_reference()
    return LoraReference(model)


# ----------------------------------------------------------------------------- directories
def _read_config(path: Path) -> dict[str, Any]:
    size = path.stat().st_size
    if size > _MAX_CONFIG_BYTES:
        raise ValueError(f"{path}: {size} bytes, more than a LoRA config may have")
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def is_lora_directory(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a LoRA model directory (its ``config.json`` says
    ``model_type: diffusion_rl.lora``)."""
    config = Path(path) / CONFIG_FILE
    if not config.is_file():
        return False
    try:
        return _read_config(config).get("model_type") == LORA_MODEL_TYPE
    except (OSError, ValueError):
        return False


def directory_fingerprint(path: str | os.PathLike) -> str:
    """A cheap identity of a model directory's content: SHA-256 over every ``*.json`` and
    ``*.safetensors`` file's relative name and size, the JSON files whole, and the first and
    last MiB of each weights file (different weights differ there too)."""
    root = Path(path)
    digest = hashlib.sha256()
    files = sorted(
        p for p in root.rglob("*") if p.is_file() and p.suffix in (".json", ".safetensors")
    )
    for file in files:
        if file.name in ("diffusion_rl.json", "manifest.json"):  # run records, not the model
            continue
        size = file.stat().st_size
        digest.update(f"{file.relative_to(root).as_posix()}\0{size}\0".encode())
        with open(file, "rb") as handle:
            if file.suffix == ".json" or size <= 2 * _FINGERPRINT_BYTES:
                digest.update(handle.read())
            else:
                digest.update(handle.read(_FINGERPRINT_BYTES))
                handle.seek(size - _FINGERPRINT_BYTES)
                digest.update(handle.read(_FINGERPRINT_BYTES))
    return digest.hexdigest()


def save_lora_model(path: str | os.PathLike, model: Any, info: dict[str, Any]) -> Path:
    """Write the LoRA model directory of ``model`` (module docstring) at ``path``: its base
    directory (recorded by :func:`add_lora`), the adapter weights and ``info``. Written into
    a staging directory beside ``path``, then renamed into place (replacing a previous
    directory), so an interrupted save leaves the previous one or nothing."""
    from safetensors.torch import save_file

    settings, base = lora_settings(model), lora_base(model)
    if settings is None or not has_lora(model):
        raise ValueError(f"save_lora_model: {type(model).__name__} carries no LoRA adapter")
    if base is None or not Path(base).is_dir():
        raise ValueError(
            f"save_lora_model: the model records no base directory ({base!r}); pass "
            "base=DIR to add_lora so the directory can name the model it adapts"
        )
    config = {
        "model_type": LORA_MODEL_TYPE,
        "base_model": base,
        "base_fingerprint": directory_fingerprint(base),
        "lora": settings.model_dump(mode="json"),
    }
    weights = {k: v.detach().cpu().contiguous() for k, v in lora_state_dict(model).items()}
    directory = Path(path)
    directory.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    try:
        staging = scratch / directory.name
        staging.mkdir()
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        save_file(weights, str(staging / ADAPTER_FILE), metadata={"format": "pt"})
        (staging / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
        from .manifest import write_manifest  # sizes and SHA-256 of the files, written last

        write_manifest(staging)
        retired = scratch / "previous"
        if directory.exists():
            directory.rename(retired)
        try:
            staging.rename(directory)
        except BaseException:
            if retired.exists() and not directory.exists():
                retired.rename(directory)
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return directory


def read_lora_config(directory: str | os.PathLike) -> tuple[Path, LoraSettings, dict[str, Any]]:
    """``(base directory, settings, config)`` of a LoRA model directory, checked: the base
    exists and still has the fingerprint recorded when the adapter was trained."""
    path = Path(directory) / CONFIG_FILE
    config = _read_config(path)
    if config.get("model_type") != LORA_MODEL_TYPE:
        raise ValueError(f"{path}: model_type is {config.get('model_type')!r}, not a LoRA model")
    base = config.get("base_model")
    if not isinstance(base, str) or not base:
        raise ValueError(f"{path}: base_model: expected the base model directory, got {base!r}")
    base_path = Path(base) if Path(base).is_absolute() else Path(directory) / base
    try:
        settings = LoraSettings.model_validate(config.get("lora"))
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ValueError(f"{path}: lora.{where}: {first['msg']}") from None
    if not base_path.is_dir():
        raise FileNotFoundError(
            f"{path}: base_model {str(base_path)!r} does not exist; a LoRA model directory "
            "holds only the adapter, so its base model directory must stay where it was "
            "trained (or edit base_model to where it is now)"
        )
    recorded = config.get("base_fingerprint")
    if recorded is not None and recorded != directory_fingerprint(base_path):
        raise ValueError(
            f"{path}: base_fingerprint: the base model {base_path} is not the one this adapter "
            "was trained on (its files changed); restore that base directory or retrain"
        )
    return base_path, settings, config


def load_lora_model(directory: str | os.PathLike, load_base: Callable[[Path], Any]) -> Any:
    """Read a LoRA model directory: ``load_base(base)`` (``models.io.load_model``) loads the
    base directory (a LoRA directory itself: its adapter is merged first), then the adapter
    is applied. Returns the base's ``LoadedModel`` with this model (in eval mode; the
    adapter unmerged, so outputs are those the run evaluated) and this directory's info
    over the base's."""
    from safetensors.torch import load_file

    directory = Path(directory)
    base, settings, _ = read_lora_config(directory)
    loaded = load_base(base)
    model = loaded.model
    if has_lora(model):
        merge_lora(model)
    add_lora(model, settings, field=f"{directory / CONFIG_FILE}: lora", base=base)
    weights = directory / ADAPTER_FILE
    if not weights.is_file():
        raise FileNotFoundError(f"LoRA model directory {directory}: no {ADAPTER_FILE}")
    load_lora_state_dict(model, load_file(str(weights)), source=str(weights))
    info = dict(loaded.info)
    if (directory / INFO_FILE).is_file():
        own = _read_config(directory / INFO_FILE)
        info.update(own)
    return dataclasses.replace(loaded, model=model.eval(), info=info)
