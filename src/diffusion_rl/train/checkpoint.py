"""Atomic, verified, self-describing training checkpoints.

Layout of ``directory``::

    step_00000120/            one checkpoint
        model.safetensors     model weights (``safetensors.torch.save_model``: tied weights
                              ok); a LoRA model's: only its adapter weights
        optimizer.pt          ``optimizer.state_dict()``
        trainer_state.pt      scheduler state, RNG states, counters, data position
        metadata.json         the run's configuration, checked on resume
        manifest.json         written last: the step, and every other file's size and SHA-256
    latest                    text file: the name of the newest checkpoint
    .tmp-...                  an interrupted write (staging directory, a replaced copy, a
                              pointer being written); removed by :meth:`clean_staging`,
                              which also puts back a replaced copy whose step is missing

``manifest.json`` holds ``{"format": 1, "step": 120, "files": {name: {"size": bytes,
"sha256": hex}}, "manifest_sha256": hex}``, where ``manifest_sha256`` is the SHA-256 of the
canonical JSON (sorted keys, no spaces) of the other three keys, so damage to the manifest
itself is reported as such and not as a mismatch of the file it happens to hit.

Invariants:

* What is saved of the model is :func:`checkpoint_state`: its ``state_dict()``, or for a
  model that carries a LoRA adapter (:func:`~diffusion_rl.models.lora.has_lora`) all but
  its frozen parameters: the adapter weights (the frozen base comes from the base model
  directory, which the run's configuration names). With the optimizer state (which holds only trained parameters), a
  LoRA checkpoint is the size of the adapter, and a resume restores it bitwise.
* Writing: nothing is written unless every floating saved model tensor (parameters and
  buffers) and every optimizer-state tensor is finite (:class:`NonFiniteStateError` otherwise). A
  checkpoint is written as a staging sibling ``.tmp-step_*``; every file is fsynced, the
  manifest (hashes read back from disk) last, then the directory is renamed into place
  (``os.rename`` is atomic). ``latest`` is replaced atomically (temporary file, fsync,
  ``os.replace``) only after the rename; checkpoints beyond ``keep_last`` are deleted only
  after that. A crash or a full disk (:class:`CheckpointDiskFullError`) at any point leaves
  the previous checkpoint and the ``latest`` pointer as they were.
* Reading (:func:`read_checkpoint`): a checkpoint is used only if its manifest is intact and
  names the directory's step, every file it lists exists with the recorded size and SHA-256,
  every file parses (safetensors header and tensors, ``torch.load(weights_only=True)``, JSON
  object) and every floating tensor of the weights and of the optimizer state is finite.
  Anything else raises :class:`CheckpointCorruptError` naming the checkpoint, the file and
  what is wrong. All of it is checked before the caller modifies anything. What hashes
  cannot catch: a file damaged and then re-sealed (:func:`write_manifest`) still has to
  parse and be finite, but flipped bits inside its tensor data go unnoticed.
* Resuming (``Trainer.resume``) tries :meth:`CheckpointManager.candidates` newest first
  (the ``latest`` target, then every ``step_*`` by descending step) and reports each damaged
  one it skips; when none is usable it raises instead of starting from zero.
* Damaged versus different: :class:`CheckpointCorruptError` (damaged files; a resume falls
  back to an older checkpoint) is distinct from :class:`CheckpointMismatchError` (an intact
  checkpoint of another configuration or model; a resume stops at once).
* Checkpoints written before manifests existed (no ``manifest.json``) are treated as corrupt:
  they cannot be verified, and the message says they predate manifests.
* Files in a checkpoint directory that the manifest does not list are ignored.
* ``trainer_state`` and ``optimizer.pt`` load with ``torch.load(weights_only=True)``: they
  may hold only tensors, numbers, strings, bools, ``None``, lists, tuples and dicts.
* One writer per directory: constructing a manager removes staging left by a killed writer.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import re
import shutil
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import safetensors
import safetensors.torch
import torch
from torch import nn

from ..models.lora import has_lora

__all__ = [
    "CheckpointCorruptError",
    "CheckpointDiskFullError",
    "CheckpointManager",
    "CheckpointMismatchError",
    "LoadedCheckpoint",
    "NonFiniteStateError",
    "check_model_compatible",
    "checkpoint_state",
    "load_weights",
    "read_checkpoint",
    "read_metadata",
    "read_state",
    "validate_metadata",
    "verify_files",
    "write_manifest",
]

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
TRAINER_STATE_FILE = "trainer_state.pt"
METADATA_FILE = "metadata.json"
MANIFEST_FILE = "manifest.json"
LATEST_FILE = "latest"
_DATA_FILES = (MODEL_FILE, OPTIMIZER_FILE, TRAINER_STATE_FILE, METADATA_FILE)
_REQUIRED_FILES = (*_DATA_FILES, MANIFEST_FILE)
_MANIFEST_FORMAT = 1
_MANIFEST_KEYS = {"format", "step", "files", "manifest_sha256"}
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_TMP_PREFIX = ".tmp-"
_REPLACED = re.compile(r"^\.tmp-replaced-(step_\d{8,})-[0-9a-f]{8}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_DISK_FULL_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}

_FIX_HINT = (
    "To resume, pass the same configuration that wrote the checkpoint; to train with a "
    "different one, start a new output directory."
)


# ----------------------------------------------------------------------------- errors
class CheckpointMismatchError(ValueError):
    """An intact checkpoint does not match the run trying to resume from it (configuration,
    model shapes or dtypes, optimizer layout). Not a reason to fall back to an older one."""


class CheckpointCorruptError(ValueError):
    """A checkpoint's files are missing, damaged, unreadable or hold non-finite tensors.

    ``path``: the checkpoint directory (for the summary raised when no checkpoint of a
    directory is usable: that directory); ``file``: the file at fault, or ``None``;
    ``reason``: what is wrong; ``problems``: for the summary, one error per checkpoint tried.
    ``str(error)`` reads ``"checkpoint PATH: FILE: REASON"``.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        file: str | None,
        reason: str,
        problems: Sequence[CheckpointCorruptError] = (),
    ) -> None:
        self.path = Path(path)
        self.file = file
        self.reason = reason
        self.problems = tuple(problems)
        where = f"{file}: " if file else ""
        super().__init__(f"checkpoint {self.path}: {where}{reason}")

    def __reduce__(self):  # keep the attributes across pickling (multiprocessing)
        return (type(self), (self.path, self.file, self.reason, self.problems))


class NonFiniteStateError(ValueError):
    """Refused to save: a model or optimizer-state tensor holds NaN or infinity.
    ``tensor`` names the first such tensor."""

    def __init__(self, message: str, tensor: str) -> None:
        super().__init__(message)
        self.tensor = tensor

    def __reduce__(self):
        return (type(self), (str(self), self.tensor))


class CheckpointDiskFullError(OSError):
    """The disk filled up during a checkpoint write (``errno`` ENOSPC or EDQUOT). The message
    says which directory and which checkpoint ``latest`` still names (left intact)."""


# ----------------------------------------------------------------------------- metadata
def _diff(ours: Any, theirs: Any, prefix: str, out: list[str]) -> None:
    if isinstance(ours, Mapping) and isinstance(theirs, Mapping):
        for key in ours:
            name = f"{prefix}.{key}" if prefix else str(key)
            if key not in theirs:
                out.append(f"{name!r}: this run has {ours[key]!r}, the checkpoint has no such key")
            else:
                _diff(ours[key], theirs[key], name, out)
        for key in theirs:
            if key not in ours:
                name = f"{prefix}.{key}" if prefix else str(key)
                out.append(
                    f"{name!r}: this run has no such key, the checkpoint has {theirs[key]!r}"
                )
    elif ours != theirs or isinstance(ours, bool) != isinstance(theirs, bool):
        out.append(f"{prefix or '<root>'!r}: this run has {ours!r}, the checkpoint has {theirs!r}")


def _json_normal(value: Any) -> Any:
    """What ``value`` becomes after a JSON round trip (tuples become lists, keys strings)."""
    return json.loads(json.dumps(value))


def validate_metadata(
    expected: Mapping[str, Any],
    found: Mapping[str, Any],
    where: str | os.PathLike | None = None,
) -> None:
    """Raise :class:`CheckpointMismatchError` unless ``found`` (the checkpoint's metadata)
    equals ``expected`` (this run's).

    Nested mappings are compared key by key; every difference is reported with its dotted
    key as "this run has X, the checkpoint has Y" (or "no such key" on either side).
    ``expected`` is compared in its JSON form, so a tuple equals the list the checkpoint
    stored. ``where`` (the checkpoint directory) is named in the message when given.
    """
    problems: list[str] = []
    _diff(_json_normal(expected), found, "", problems)
    if problems:
        lines = "\n  ".join(problems)
        source = f"checkpoint {where}: metadata" if where is not None else "checkpoint metadata"
        raise CheckpointMismatchError(f"{source} does not match this run:\n  {lines}\n{_FIX_HINT}")


# ----------------------------------------------------------------------------- files
def _check_weights_only(value: Any, name: str) -> None:
    """Raise ``TypeError`` naming the first leaf ``torch.load(weights_only=True)`` rejects."""
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_weights_only(item, f"{name}[{index}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise TypeError(f"{name}: dict keys must be str or int, got {type(key).__name__}")
            _check_weights_only(item, f"{name}.{key}")
        return
    raise TypeError(
        f"{name}: a {type(value).__name__} cannot be stored in a checkpoint; use tensors, "
        "numbers, strings, bools, None, lists, tuples or dicts"
    )


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    with open(path, "wb") as handle:
        write(handle)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _manifest_digest(body: Mapping[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def _short(error: BaseException) -> str:
    """``Type: first line of the message`` (at most 160 characters)."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    text = text if len(text) <= 160 else text[:157] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _step_dirs(directory: Path) -> list[tuple[int, Path]]:
    """Every ``step_*`` directory (complete or not), sorted by step."""
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def _is_complete(path: Path) -> bool:
    """Every file present (cheap; says nothing about their content)."""
    return path.is_dir() and all((path / name).is_file() for name in _REQUIRED_FILES)


def write_manifest(path: str | os.PathLike, step: int) -> Path:
    """Record the size and SHA-256 of every data file of checkpoint directory ``path`` (read
    back from disk) and ``step`` in ``manifest.json`` (fsynced); return the manifest's path.

    :meth:`CheckpointManager.save` calls it last. Calling it on an existing checkpoint
    re-seals whatever the files now hold: only for tools and tests.
    """
    path = Path(path)
    files = {
        name: {"size": (path / name).stat().st_size, "sha256": _sha256(path / name)}
        for name in _DATA_FILES
    }
    body = {"format": _MANIFEST_FORMAT, "step": step, "files": files}
    text = json.dumps({**body, "manifest_sha256": _manifest_digest(body)}, indent=2, sort_keys=True)
    _write_file(path / MANIFEST_FILE, lambda f: f.write(text.encode("utf-8") + b"\n"))
    return path / MANIFEST_FILE


def _read_manifest(path: Path) -> dict[str, Any]:
    """The parsed, self-consistent manifest of ``path`` (raises CheckpointCorruptError)."""

    def corrupt(reason: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(path, MANIFEST_FILE, reason)

    file = path / MANIFEST_FILE
    if not file.is_file():
        if all((path / name).is_file() for name in _DATA_FILES):
            raise corrupt(
                "missing: this checkpoint predates manifests (written by an earlier version) "
                "or its manifest was deleted, so its files cannot be verified; start a new "
                "output directory (or move this checkpoint away)"
            )
        raise corrupt("missing")
    data = file.read_bytes()
    if not data:
        raise corrupt("empty file")
    try:
        manifest = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise corrupt(f"not valid JSON ({_short(error)})") from error
    if not isinstance(manifest, dict) or set(manifest) != _MANIFEST_KEYS:
        raise corrupt(f"expected an object with keys {sorted(_MANIFEST_KEYS)}")
    body = {key: manifest[key] for key in ("format", "step", "files")}
    try:
        intact = manifest["manifest_sha256"] == _manifest_digest(body)
    except ValueError:  # NaN or infinity in the body
        intact = False
    if not intact:
        raise corrupt("damaged: its own checksum (manifest_sha256) does not match its content")
    if manifest["format"] != _MANIFEST_FORMAT:
        raise corrupt(f"format {manifest['format']!r}; this version reads {_MANIFEST_FORMAT}")
    step = manifest["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise corrupt(f"'step': expected an int >= 0, got {step!r}")
    files = manifest["files"]
    if not isinstance(files, dict) or sorted(files) != sorted(_DATA_FILES):
        raise corrupt(f"must list exactly {', '.join(_DATA_FILES)}")
    for name, entry in files.items():
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("size"), int)
            and isinstance(entry.get("sha256"), str)
            and _HEX64.match(entry["sha256"])
        ):
            raise corrupt(f"entry {name!r}: expected {{'size': int, 'sha256': 64 hex digits}}")
    match = _STEP_DIR.match(path.name)
    if match and step != int(match.group(1)):
        raise corrupt(
            f"written for step {step}, but the directory is {path.name} "
            "(a checkpoint copied or renamed into the wrong place)"
        )
    return manifest


def verify_files(path: str | os.PathLike) -> int:
    """Check the manifest and every file it lists (size, then SHA-256); return the step.

    Raises :class:`CheckpointCorruptError` naming the first file that is missing, empty,
    of the wrong size or of the wrong hash (see the module invariants).
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointCorruptError(path, None, "no such directory")
    manifest = _read_manifest(path)
    for name in _DATA_FILES:
        file = path / name
        recorded = manifest["files"][name]
        if not file.is_file():
            raise CheckpointCorruptError(path, name, "missing (listed in manifest.json)")
        size = file.stat().st_size
        if size != recorded["size"]:
            kind = "size mismatch"
            if size == 0:
                kind = "empty file"
            elif size < recorded["size"]:
                kind = "truncated"
            raise CheckpointCorruptError(
                path, name, f"{kind}: {size} bytes, the manifest records {recorded['size']}"
            )
        digest = _sha256(file)
        if digest != recorded["sha256"]:
            raise CheckpointCorruptError(
                path,
                name,
                f"sha256 mismatch (the manifest records {recorded['sha256'][:16]}..., the file "
                f"hashes to {digest[:16]}...): modified or damaged after it was written",
            )
    return manifest["step"]


def _non_finite(tensor: torch.Tensor) -> str | None:
    """``None`` if ``tensor`` is not floating or is finite, else what it holds."""
    if not (tensor.is_floating_point() or tensor.is_complex()) or tensor.is_meta:
        return None
    if bool(torch.isfinite(tensor).all()):
        return None
    nans, infs = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
    return f"non-finite values ({nans} NaN, {infs} infinite, of {tensor.numel()})"


def _optimizer_tensors(
    state: Mapping[Any, Any], label: Callable[[Any], str]
) -> Iterable[tuple[str, torch.Tensor]]:
    for key, entry in state.items():
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                yield f"optimizer state {name!r} of parameter {label(key)!r}", value


def _first_non_finite_state(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[str, str] | None:
    """``(tensor, what it holds)`` for the first non-finite saved model tensor or
    optimizer-state tensor."""
    for name, tensor in checkpoint_state(model).items():
        problem = _non_finite(tensor)
        if problem:
            return f"model tensor {name!r}", problem
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    index = {id(p): i for i, p in enumerate(params)}
    state = {p: optimizer.state[p] for p in params if p in optimizer.state}
    for name, tensor in _optimizer_tensors(state, lambda p: names.get(id(p), f"#{index[id(p)]}")):
        problem = _non_finite(tensor)
        if problem:
            return name, problem
    return None


def _read_json_object(path: Path, name: str) -> dict[str, Any]:
    try:
        value = json.loads((path / name).read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise CheckpointCorruptError(path, name, f"not valid JSON ({_short(error)})") from error
    if not isinstance(value, dict):
        raise CheckpointCorruptError(
            path, name, f"expected a JSON object, got {type(value).__name__}"
        )
    return value


def _torch_load(path: Path, name: str) -> dict[str, Any]:
    try:
        value = torch.load(path / name, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:  # its message speaks of torch defaults
        raise CheckpointCorruptError(
            path, name, "unreadable: not a torch.save archive of tensors and plain values"
        ) from error
    except Exception as error:  # torch raises RuntimeError, EOFError, OSError, ...
        raise CheckpointCorruptError(path, name, f"unreadable ({_short(error)})") from error
    if not isinstance(value, dict):
        raise CheckpointCorruptError(path, name, f"expected a dict, got {type(value).__name__}")
    return value


def _check_optimizer_layout(path: Path, state: Mapping[str, Any]) -> None:
    groups = state.get("param_groups")
    entries = state.get("state")
    if (
        not isinstance(groups, list)
        or not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)
        or not isinstance(entries, dict)
        or not all(isinstance(entry, dict) for entry in entries.values())
    ):
        raise CheckpointCorruptError(
            path, OPTIMIZER_FILE, "not an optimizer state_dict ('state' and 'param_groups')"
        )


def _scan_weights(path: Path) -> None:
    """Every tensor of ``model.safetensors`` reads and, if floating, is finite."""
    try:
        with safetensors.safe_open(path / MODEL_FILE, framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                problem = _non_finite(handle.get_tensor(name))
                if problem:
                    raise CheckpointCorruptError(
                        path, MODEL_FILE, f"tensor {name!r} holds {problem}"
                    )
    except CheckpointCorruptError:
        raise
    except Exception as error:  # SafetensorError, OSError, ...
        raise CheckpointCorruptError(
            path, MODEL_FILE, f"unreadable safetensors file ({_short(error)})"
        ) from error


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A checkpoint read into memory and verified (nothing applied to any model yet).

    ``step`` comes from the manifest; the weights stay on disk (verified, loaded by
    :func:`load_weights`), everything else is here.
    """

    path: Path
    step: int
    metadata: dict[str, Any]
    trainer_state: dict[str, Any]
    optimizer_state: dict[str, Any]


def read_checkpoint(
    path: str | os.PathLike, param_names: Sequence[str] | None = None
) -> LoadedCheckpoint:
    """Verify checkpoint ``path`` completely (module invariants) and read it.

    ``param_names[i]`` names the i-th optimizer parameter in messages (default ``#i``).
    Raises :class:`CheckpointCorruptError` naming the checkpoint, the file and the problem.
    """
    path = Path(path)
    step = verify_files(path)
    metadata = _read_json_object(path, METADATA_FILE)
    trainer_state = _torch_load(path, TRAINER_STATE_FILE)
    optimizer_state = _torch_load(path, OPTIMIZER_FILE)
    _check_optimizer_layout(path, optimizer_state)
    _scan_weights(path)

    def label(index: Any) -> str:
        if param_names is not None and isinstance(index, int) and 0 <= index < len(param_names):
            return param_names[index]
        return f"#{index}"

    for name, tensor in _optimizer_tensors(optimizer_state["state"], label):
        problem = _non_finite(tensor)
        if problem:
            raise CheckpointCorruptError(path, OPTIMIZER_FILE, f"{name} holds {problem}")
    return LoadedCheckpoint(path, step, metadata, trainer_state, optimizer_state)


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint's ``metadata.json``, after :func:`verify_files`."""
    path = Path(path)
    verify_files(path)
    return _read_json_object(path, METADATA_FILE)


def read_state(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(trainer_state, optimizer_state_dict)`` on CPU, after :func:`read_checkpoint`."""
    checkpoint = read_checkpoint(path)
    return checkpoint.trainer_state, checkpoint.optimizer_state


def _storage_key(tensor: torch.Tensor) -> tuple:
    return (
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
    )


def checkpoint_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint holds of ``model``: ``model.state_dict()``; for a model carrying a
    LoRA adapter, its entries less every frozen parameter (``requires_grad`` False: the
    base the adapter sits on). For one LoRA model that is its adapter weights; in a model of
    several parts (workflow stages), a part trained in full keeps all of its weights."""
    if not has_lora(model):
        return model.state_dict()
    return {
        name: tensor.detach()
        for name, tensor in model.state_dict(keep_vars=True).items()
        if not (isinstance(tensor, nn.Parameter) and not tensor.requires_grad)
    }


def _save_weights(model: nn.Module, file: Path) -> None:
    if not has_lora(model):
        safetensors.torch.save_model(model, str(file))
        return
    tensors: dict[str, torch.Tensor] = {}
    stored: set[tuple] = set()
    for name, tensor in checkpoint_state(model).items():  # tied weights: stored once
        if _storage_key(tensor) not in stored:
            stored.add(_storage_key(tensor))
            tensors[name] = tensor.contiguous()
    safetensors.torch.save_file(tensors, str(file), metadata={"format": "pt"})


def check_model_compatible(path: str | os.PathLike, model: nn.Module) -> None:
    """Check the stored weights fit ``model`` (names, shapes, dtypes) without loading them.

    Weights tied in ``model`` may be stored once. Raises :class:`CheckpointMismatchError`
    naming the first offending tensors (or :class:`CheckpointCorruptError` when the file
    cannot be read); leaves ``model`` untouched. Does not verify hashes: see
    :func:`read_checkpoint`.
    """
    path = Path(path)
    model_state = checkpoint_state(model)
    problems: list[str] = []
    stored: set[str] = set()
    try:
        with safetensors.safe_open(path / MODEL_FILE, framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                stored.add(name)
                if name not in model_state:
                    problems.append(f"{name!r}: in the checkpoint but not in the model")
                    continue
                view = handle.get_slice(name)
                shape = tuple(view.get_shape())
                dtype = _SAFETENSORS_DTYPES.get(view.get_dtype())
                target = model_state[name]
                if shape != tuple(target.shape) or dtype != target.dtype:
                    problems.append(
                        f"{name!r}: expected {tuple(target.shape)} {target.dtype} (the model), "
                        f"found {shape} {dtype or view.get_dtype()} (the checkpoint)"
                    )
    except Exception as error:
        raise CheckpointCorruptError(
            path, MODEL_FILE, f"unreadable safetensors file ({_short(error)})"
        ) from error
    covered = {_storage_key(t) for name, t in model_state.items() if name in stored}
    for name, tensor in model_state.items():
        if name not in stored and _storage_key(tensor) not in covered:
            problems.append(f"{name!r}: in the model but missing from the checkpoint")
    if problems:
        lines = "\n  ".join(problems[:10])
        more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise CheckpointMismatchError(
            f"checkpoint {path}: weights do not fit {type(model).__name__}:\n  {lines}{more}\n"
            f"{_FIX_HINT}"
        )


def load_weights(path: str | os.PathLike, model: nn.Module) -> None:
    """Check (:func:`check_model_compatible`), then load the stored weights into ``model``."""
    path = Path(path)
    check_model_compatible(path, model)
    if has_lora(model):  # checked above: exactly checkpoint_state's entries (tied once)
        tensors = safetensors.torch.load_file(str(path / MODEL_FILE))
        model.load_state_dict(tensors, strict=False)
    else:
        safetensors.torch.load_model(model, str(path / MODEL_FILE), strict=True)


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _is_disk_full(error: BaseException) -> bool:
    if isinstance(error, OSError) and error.errno in _DISK_FULL_ERRNOS:
        return True
    text = str(error)  # safetensors wraps the OS error in its own exception type
    return "No space left on device" in text or "Disk quota exceeded" in text


# ----------------------------------------------------------------------------- manager
class CheckpointManager:
    """Writes, finds and loads checkpoints under ``directory`` (see the module docstring).

    ``keep_last`` (>= 1) complete checkpoints are kept: the newest by step, plus always the
    one just written. The constructor calls :meth:`clean_staging`.
    """

    def __init__(self, directory: str | os.PathLike, keep_last: int = 3) -> None:
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"keep_last: expected an int >= 1, got {keep_last!r}")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.clean_staging()

    def path_for(self, step: int) -> Path:
        return self.directory / f"step_{step:08d}"

    def checkpoints(self) -> list[Path]:
        """Checkpoint directories with all their files, oldest step first (contents not
        verified; staging directories ignored)."""
        return [path for _, path in _step_dirs(self.directory) if _is_complete(path)]

    def has_checkpoints(self) -> bool:
        """Whether anything of a checkpoint exists: a ``step_*`` directory (complete or not)
        or a ``latest`` pointer. A run that finds one must resume (or stop), never restart."""
        return (self.directory / LATEST_FILE).exists() or bool(_step_dirs(self.directory))

    def candidates(self) -> list[Path]:
        """Where :meth:`Trainer.resume` looks, in order: the ``latest`` pointer's target (even
        if missing), then every ``step_*`` directory by descending step, complete or not. An
        unreadable pointer is ignored (the step directories are all listed anyway)."""
        ordered = []
        target = self._pointer_target()
        if target is not None:
            ordered.append(target)
        for _, path in reversed(_step_dirs(self.directory)):
            if path not in ordered:
                ordered.append(path)
        return ordered

    def latest(self) -> Path | None:
        """The newest checkpoint with all its files, or ``None`` (contents not verified).

        Follows the ``latest`` pointer; if it is absent or points at something incomplete,
        falls back to the highest complete ``step_*`` directory.
        """
        target = self._pointer_target()
        if target is not None and _is_complete(target):
            return target
        complete = self.checkpoints()
        return complete[-1] if complete else None

    def clean_staging(self) -> None:
        """Remove what an interrupted write left behind (``.tmp-*``).

        A ``.tmp-replaced-step_*`` copy (a checkpoint moved aside while its step was being
        re-saved) is put back when its ``step_*`` is missing, i.e. the re-save died between
        the two renames; otherwise it is removed.
        """
        if not self.directory.is_dir():
            return
        for entry in sorted(self.directory.iterdir()):
            if not entry.name.startswith(_TMP_PREFIX):
                continue
            replaced = _REPLACED.match(entry.name)
            if replaced and entry.is_dir() and not (self.directory / replaced.group(1)).exists():
                os.rename(entry, self.directory / replaced.group(1))
            elif entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        trainer_state: dict[str, Any],
        metadata: dict[str, Any],
    ) -> Path:
        """Atomically write checkpoint ``step`` and return its directory.

        Raises, before writing anything: ``TypeError`` when ``trainer_state`` holds something
        ``torch.load(weights_only=True)`` cannot read or ``metadata`` is not JSON-serialisable;
        :class:`NonFiniteStateError` when a model or optimizer-state tensor is not finite.
        A full disk raises :class:`CheckpointDiskFullError`, leaving the previous checkpoint
        and ``latest`` unchanged. Saving a step that already exists replaces it.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step: expected an int >= 0, got {step!r}")
        _check_weights_only(trainer_state, "trainer_state")
        try:
            metadata_text = json.dumps(metadata, indent=2, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as error:
            raise TypeError(f"metadata: must be JSON-serialisable ({error})") from error
        final = self.path_for(step)
        non_finite = _first_non_finite_state(model, optimizer)
        if non_finite is not None:
            tensor, problem = non_finite
            previous = self._previous(exclude=None)
            kept = f"the latest checkpoint is still {previous}" if previous else "none exists"
            raise NonFiniteStateError(
                f"refusing to save checkpoint {final.name} in {self.directory}: {tensor} holds "
                f"{problem}. Nothing was written ({kept}). The run has diverged: lower optim.lr "
                "(or enable grad_clip) and resume from the last checkpoint.",
                tensor=tensor,
            )

        self.directory.mkdir(parents=True, exist_ok=True)
        self.clean_staging()
        tmp = self.directory / f"{_TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
        try:
            tmp.mkdir()
            _save_weights(model, tmp / MODEL_FILE)
            _fsync_file(tmp / MODEL_FILE)
            _write_file(tmp / OPTIMIZER_FILE, lambda f: torch.save(optimizer.state_dict(), f))
            _write_file(tmp / TRAINER_STATE_FILE, lambda f: torch.save(trainer_state, f))
            _write_file(tmp / METADATA_FILE, lambda f: f.write(metadata_text.encode("utf-8")))
            write_manifest(tmp, step)
            _fsync_dir(tmp)
        except BaseException as error:
            shutil.rmtree(tmp, ignore_errors=True)
            if _is_disk_full(error):
                raise self._disk_full(error, final, written=False) from error
            raise

        old = None
        try:
            if final.exists():
                # Move the old copy aside: a directory cannot be renamed over a non-empty one.
                old = self.directory / f"{_TMP_PREFIX}replaced-{final.name}-{uuid.uuid4().hex[:8]}"
                os.rename(final, old)
            os.rename(tmp, final)
        except BaseException as error:
            if old is not None and old.exists() and not final.exists():
                os.rename(old, final)
            shutil.rmtree(tmp, ignore_errors=True)
            if _is_disk_full(error):
                raise self._disk_full(error, final, written=False) from error
            raise
        try:
            _fsync_dir(self.directory)
            self._point_latest_at(final.name)
        except OSError as error:
            if _is_disk_full(error):
                raise self._disk_full(error, final, written=True) from error
            raise
        self._prune(keep=final)
        self.clean_staging()
        return final

    def load(
        self,
        path: str | os.PathLike,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Load weights (and optimizer state) from ``path``; return ``(trainer_state, metadata)``.

        The checkpoint is verified (:func:`read_checkpoint`) and the weights are checked
        against ``model`` before anything is modified. Restoring schedulers, RNGs and counters
        from ``trainer_state`` is the caller's job (see ``Trainer.resume``).
        """
        checkpoint = read_checkpoint(path)
        load_weights(checkpoint.path, model)
        if optimizer is not None:
            optimizer.load_state_dict(checkpoint.optimizer_state)
        return checkpoint.trainer_state, checkpoint.metadata

    # ------------------------------------------------------------------------- internals
    def _pointer_target(self) -> Path | None:
        """The directory ``latest`` names (existing or not), or ``None``."""
        try:
            name = (self.directory / LATEST_FILE).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            return None
        return self.directory / name if _STEP_DIR.match(name) else None

    def _previous(self, exclude: Path | None) -> str | None:
        """The name of the checkpoint ``latest`` resolves to, other than ``exclude``."""
        target = self._pointer_target()
        if target is not None and target != exclude and target.is_dir():
            return target.name
        others = [path for path in self.checkpoints() if path != exclude]
        return others[-1].name if others else None

    def _disk_full(self, error: BaseException, final: Path, written: bool) -> OSError:
        previous = self._previous(exclude=final if written else None)
        cause = getattr(error, "strerror", None) or "no space left on device"
        if written:
            outcome = f"{final.name} was written completely, but `latest` was not updated"
        else:
            outcome = f"{final.name} was not saved (its partial copy was removed)"
        kept = (
            f"the previous checkpoint {previous} is intact and `latest` still points at it"
            if previous
            else "there is no previous checkpoint"
        )
        return CheckpointDiskFullError(
            errno.ENOSPC,
            f"disk full while writing checkpoint {final.name} in {self.directory} ({cause}): "
            f"{outcome}; {kept}. Free space on that disk (or lower keep_last), then resume.",
        )

    def _point_latest_at(self, name: str) -> None:
        tmp = self.directory / f"{_TMP_PREFIX}{LATEST_FILE}-{uuid.uuid4().hex[:8]}"
        try:
            _write_file(tmp, lambda f: f.write(f"{name}\n".encode()))
            os.replace(tmp, self.directory / LATEST_FILE)
        finally:
            tmp.unlink(missing_ok=True)
        _fsync_dir(self.directory)

    def _prune(self, keep: Path) -> None:
        complete = self.checkpoints()
        survivors = set(complete[-self.keep_last :]) | {keep}
        for path in complete:
            if path not in survivors:
                shutil.rmtree(path, ignore_errors=True)
