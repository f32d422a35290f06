"""Atomic, verified, self-describing training checkpoints, of one process or of many.

Layout of ``directory``::

    step_00000120/            one checkpoint, written by one process (a plain module)
        model.safetensors     model weights (``safetensors.torch.save_model``: tied weights
                              ok); a LoRA model's: only its adapter weights
        optimizer.pt          ``optimizer.state_dict()``
        trainer_state.pt      scheduler state, RNG states, counters, data position
        metadata.json         the run's configuration, checked on resume
        manifest.json         written last: the step, and every other file's size and SHA-256
    step_00000240/            one *sharded* checkpoint, written by every rank of a process
                              group together (an FSDP2 model: ``parallel.is_sharded``)
        dcp/                  ``torch.distributed.checkpoint`` (DCP): ``.metadata`` and one
                              ``__R_0.distcp`` per rank, holding only tensors: ``model.FQN``
                              (:func:`checkpoint_state`'s entries) and
                              ``optimizer.state.FQN.KEY`` (the optimizer's tensor state)
        optimizer_groups.pt   the optimizer's ``param_groups`` (parameters named by FQN) and
                              the non-tensor entries of its state
        trainer_state.pt      as above (rank 0's)
        metadata.json         as above
        manifest.json         as above, listing every file of ``dcp/`` too
    latest                    text file: the name of the newest checkpoint
    .tmp-...                  an interrupted write (staging directory, a replaced copy, a
                              pointer being written); removed by :meth:`clean_staging`,
                              which also puts back a replaced copy whose step is missing

``manifest.json`` holds ``{"format": 1, "step": 120, "files": {name: {"size": bytes,
"sha256": hex}}, "manifest_sha256": hex}``, where ``manifest_sha256`` is the SHA-256 of the
canonical JSON (sorted keys, no spaces) of the other three keys, so damage to the manifest
itself is reported as such and not as a mismatch of the file it happens to hit. Its file
names say the layout: exactly the four one-process files, or ``optimizer_groups.pt``,
``trainer_state.pt``, ``metadata.json`` and ``dcp/`` files including ``dcp/.metadata``.

Either layout resumes at any world size (``Trainer.resume``): a sharded checkpoint into one
process and a plain module (DCP reads without a process group) or into any number of
sharded processes (DCP reshards); a one-process checkpoint into sharded processes (its full
tensors are read by every rank and scattered by ``set_state_dict(full_state_dict=True)``,
its id-keyed optimizer state renamed to FQNs by position).

Invariants:

* What is saved of the model is :func:`checkpoint_state`: its ``state_dict()``, or for a
  model that carries a LoRA adapter (:func:`~diffusion_rl.models.lora.has_lora`) all but
  its frozen parameters: the adapter weights (the frozen base comes from the base model
  directory, which the run's configuration names). With the optimizer state (which holds
  only trained parameters), a LoRA checkpoint is the size of the adapter, and a resume
  restores it bitwise. A sharded checkpoint holds the same entries, by FQN
  (``get_state_dict(..., ignore_frozen_params=has_lora(model))``).
* Writing: nothing is written unless every floating saved model tensor (parameters and
  buffers) and every optimizer-state tensor is finite (:class:`NonFiniteStateError`
  otherwise; each rank checks its shards, and every rank raises what the first one found).
  A checkpoint is written as a staging sibling ``.tmp-step_*``; every file is fsynced, the
  manifest (hashes read back from disk) last, then the directory is renamed into place
  (``os.rename`` is atomic). ``latest`` is replaced atomically (temporary file, fsync,
  ``os.replace``) only after the rename; checkpoints beyond ``keep_last`` are deleted only
  after that. A crash or a full disk (:class:`CheckpointDiskFullError`) at any point leaves
  the previous checkpoint and the ``latest`` pointer as they were.
* Under a process group :meth:`CheckpointManager.save` is a collective: every rank calls it
  with the same step. Rank 0 alone creates the staging directory, writes everything but
  the DCP shards (its own ``trainer_state`` and ``metadata``; a plain module's weights and
  optimizer), seals, renames, points ``latest`` and prunes; every rank writes its DCP
  shard. No rank returns before the checkpoint is complete (or before every rank has
  raised the same error). Without a process group a plain module is saved in the
  one-process layout, as it always was.
* Reading (:func:`read_checkpoint`): a checkpoint is used only if its manifest is intact and
  names the directory's step, every file it lists exists with the recorded size and SHA-256,
  every file parses (safetensors header and tensors, ``torch.load(weights_only=True)``, JSON
  object; DCP ``.metadata`` through an unpickler that admits only DCP's metadata classes,
  every entry a tensor, every storage reference inside a listed file) and every floating
  tensor of the weights and of the optimizer state is finite (a sharded checkpoint's
  tensors are checked once loaded, before anything is applied: :func:`stage_state`).
  Anything else raises :class:`CheckpointCorruptError` naming the checkpoint, the file and
  what is wrong. All of it is checked before the caller modifies anything. What hashes
  cannot catch: a file damaged and then re-sealed (:func:`write_manifest`) still has to
  parse and be finite, but flipped bits inside its tensor data go unnoticed.
* Resuming (``Trainer.resume``) tries :meth:`CheckpointManager.candidates` newest first
  (the ``latest`` target, then every ``step_*`` by descending step) and reports each damaged
  one it skips; when none is usable it raises instead of starting from zero. With a
  sharded model every rank resumes together and takes the same decisions
  (:func:`agree_on_errors`).
* Damaged versus different: :class:`CheckpointCorruptError` (damaged files; a resume falls
  back to an older checkpoint) is distinct from :class:`CheckpointMismatchError` (an intact
  checkpoint of another configuration or model; a resume stops at once).
* Checkpoints written before manifests existed (no ``manifest.json``) are treated as corrupt:
  they cannot be verified, and the message says they predate manifests.
* Files in a checkpoint directory that the manifest does not list are ignored.
* ``trainer_state``, ``optimizer.pt`` and ``optimizer_groups.pt`` load with
  ``torch.load(weights_only=True)``: they may hold only tensors, numbers, strings, bools,
  ``None``, lists, tuples and dicts. DCP's shards hold tensors only (no pickled objects).
* One writer per directory: constructing a manager removes staging left by a killed writer
  (on rank 0 only: the others must not remove a staging directory rank 0 is writing).
"""

from __future__ import annotations

import copy
import errno
import json
import os
import pickle
import re
import shutil
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

import safetensors
import safetensors.torch
import torch
from torch import nn

from ..checksums import file_sha256 as _sha256  # shared with models/manifest.py
from ..checksums import manifest_digest as _manifest_digest
from ..distributed import World
from ..models.lora import has_lora
from .parallel import is_sharded, local_tensor

__all__ = [
    "CheckpointCorruptError",
    "CheckpointDiskFullError",
    "CheckpointManager",
    "CheckpointMismatchError",
    "DiskFullError",
    "LoadedCheckpoint",
    "NonFiniteStateError",
    "StagedState",
    "agree_on_errors",
    "apply_state",
    "check_model_compatible",
    "check_sharded_optimizer",
    "checkpoint_state",
    "collective_world",
    "is_disk_full",
    "load_model_tensors",
    "load_weights",
    "read_checkpoint",
    "read_metadata",
    "read_state",
    "stage_state",
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
OPTIMIZER_GROUPS_FILE = "optimizer_groups.pt"
DCP_DIR = "dcp"
_DCP_METADATA = f"{DCP_DIR}/.metadata"
_DATA_FILES = (MODEL_FILE, OPTIMIZER_FILE, TRAINER_STATE_FILE, METADATA_FILE)
_REQUIRED_FILES = (*_DATA_FILES, MANIFEST_FILE)
# a sharded checkpoint: these, plus every file of dcp/ (dcp/.metadata among them)
_SHARDED_DATA_FILES = (OPTIMIZER_GROUPS_FILE, TRAINER_STATE_FILE, METADATA_FILE)
_SHARDED_REQUIRED_FILES = (*_SHARDED_DATA_FILES, MANIFEST_FILE, _DCP_METADATA)
_DCP_FILE = re.compile(r"^dcp/(\.metadata|[A-Za-z0-9_][A-Za-z0-9_.-]*)$")
_MODEL_PREFIX = "model."
_OPTIMIZER_PREFIX = "optimizer.state."
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


class DiskFullError(OSError):
    """The disk filled up during a write (``errno`` ENOSPC), whichever library reported it
    (an ``OSError``, safetensors' ``SafetensorError``, torch.save's ``RuntimeError``: see
    :func:`is_disk_full`); the message names what was being written and what is intact."""


class CheckpointDiskFullError(DiskFullError):
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
    """Every file of either layout present (cheap; says nothing about their content)."""
    return path.is_dir() and any(
        all((path / name).is_file() for name in required)
        for required in (_REQUIRED_FILES, _SHARDED_REQUIRED_FILES)
    )


def _is_sharded_listing(names: Iterable[str]) -> bool:
    """Whether manifest file ``names`` are those of a sharded checkpoint: exactly
    ``_SHARDED_DATA_FILES`` besides ``dcp/`` files (plain names, ``dcp/.metadata`` among them)."""
    names = set(names)
    shards = {name for name in names if name.startswith(f"{DCP_DIR}/")}
    return (
        names - shards == set(_SHARDED_DATA_FILES)
        and _DCP_METADATA in shards
        and all(_DCP_FILE.match(name) for name in shards)
    )


def _ordered(names: Iterable[str]) -> list[str]:
    """Manifest file names in checking order: the layout's fixed files, then ``dcp/``'s
    sorted (the order in which a damaged file is reported first)."""
    names = set(names)
    fixed = [name for name in (*_DATA_FILES, *_SHARDED_DATA_FILES) if name in names]
    return list(dict.fromkeys(fixed)) + sorted(names - set(fixed))


def _data_files(path: Path) -> list[str]:
    """The data files of checkpoint directory ``path`` as written: a sharded checkpoint's
    (it has ``dcp/``) or the one-process set."""
    dcp = path / DCP_DIR
    if not dcp.is_dir():
        return list(_DATA_FILES)
    shards = sorted(f"{DCP_DIR}/{entry.name}" for entry in dcp.iterdir() if entry.is_file())
    return [*_SHARDED_DATA_FILES, *shards]


def write_manifest(path: str | os.PathLike, step: int) -> Path:
    """Record the size and SHA-256 of every data file of checkpoint directory ``path`` (read
    back from disk; a sharded checkpoint's include every file of ``dcp/``) and ``step`` in
    ``manifest.json`` (fsynced); return the manifest's path.

    :meth:`CheckpointManager.save` calls it last. Calling it on an existing checkpoint
    re-seals whatever the files now hold: only for tools and tests.
    """
    path = Path(path)
    files = {
        name: {"size": (path / name).stat().st_size, "sha256": _sha256(path / name)}
        for name in _data_files(path)
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
    if not isinstance(files, dict) or not (
        sorted(files) == sorted(_DATA_FILES) or _is_sharded_listing(files)
    ):
        raise corrupt(
            f"must list exactly {', '.join(_DATA_FILES)} (one process), or "
            f"{', '.join(_SHARDED_DATA_FILES)} and the files of {DCP_DIR}/ with "
            f"{_DCP_METADATA} (sharded)"
        )
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


def verify_files(path: str | os.PathLike, *, hashes: bool = True) -> int:
    """Check the manifest and every file it lists (size, then SHA-256); return the step.

    Raises :class:`CheckpointCorruptError` naming the first file that is missing, empty,
    of the wrong size or of the wrong hash (see the module invariants). ``hashes=False``
    skips the SHA-256 pass (sizes are still compared): for the ranks other than 0 of a
    collective resume, where rank 0 hashes and every rank acts on its verdict.
    """
    return _verify(Path(path), hashes)["step"]


def _verify(path: Path, hashes: bool = True) -> dict[str, Any]:
    """:func:`verify_files`, returning the manifest."""
    if not path.is_dir():
        raise CheckpointCorruptError(path, None, "no such directory")
    manifest = _read_manifest(path)
    for name in _ordered(manifest["files"]):
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
        if not hashes:
            continue
        digest = _sha256(file)
        if digest != recorded["sha256"]:
            raise CheckpointCorruptError(
                path,
                name,
                f"sha256 mismatch (the manifest records {recorded['sha256'][:16]}..., the file "
                f"hashes to {digest[:16]}...): modified or damaged after it was written",
            )
    return manifest


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
    optimizer-state tensor (of a sharded model: of this rank's shards; no communication)."""
    for name, tensor in checkpoint_state(model).items():
        problem = _non_finite(local_tensor(tensor))
        if problem:
            return f"model tensor {name!r}", problem
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    index = {id(p): i for i, p in enumerate(params)}
    state = {p: optimizer.state[p] for p in params if p in optimizer.state}
    for name, tensor in _optimizer_tensors(state, lambda p: names.get(id(p), f"#{index[id(p)]}")):
        problem = _non_finite(local_tensor(tensor))
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


def _check_optimizer_layout(
    path: Path, state: Mapping[str, Any], file: str = OPTIMIZER_FILE
) -> None:
    groups = state.get("param_groups")
    entries = state.get("state")
    if (
        not isinstance(groups, list)
        or not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)
        or not isinstance(entries, dict)
        or not all(isinstance(entry, dict) for entry in entries.values())
    ):
        raise CheckpointCorruptError(
            path, file, "not an optimizer state_dict ('state' and 'param_groups')"
        )
    if file == OPTIMIZER_GROUPS_FILE and not all(
        isinstance(name, str) for group in groups for name in group["params"]
    ):
        raise CheckpointCorruptError(path, file, "parameters must be named by FQN (strings)")


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
    :func:`load_weights` or :func:`stage_state`), everything else is here.
    ``optimizer_state``: of a one-process checkpoint ``optimizer.state_dict()`` (keyed by
    parameter index); of a sharded one ``optimizer_groups.pt``: ``param_groups`` naming
    parameters by FQN and ``state`` holding only non-tensor entries (its tensors stay in
    ``dcp/``). ``dcp_metadata``: a sharded checkpoint's DCP ``Metadata`` (``None`` for one
    process).
    """

    path: Path
    step: int
    metadata: dict[str, Any]
    trainer_state: dict[str, Any]
    optimizer_state: dict[str, Any]
    dcp_metadata: Any = None

    @property
    def sharded(self) -> bool:
        """Whether the checkpoint was written by a process group in the DCP layout."""
        return self.dcp_metadata is not None


def read_checkpoint(
    path: str | os.PathLike,
    param_names: Sequence[str] | None = None,
    *,
    hashes: bool = True,
) -> LoadedCheckpoint:
    """Verify checkpoint ``path`` completely (module invariants) and read it, in either
    layout.

    ``param_names[i]`` names the i-th optimizer parameter in messages (default ``#i``).
    ``hashes=False``: see :func:`verify_files`. Raises :class:`CheckpointCorruptError`
    naming the checkpoint, the file and the problem. A sharded checkpoint's tensors are not
    read here (they are checked as they are loaded: :func:`stage_state`).
    """
    path = Path(path)
    manifest = _verify(path, hashes)
    step = manifest["step"]
    metadata = _read_json_object(path, METADATA_FILE)
    trainer_state = _torch_load(path, TRAINER_STATE_FILE)
    if _is_sharded_listing(manifest["files"]):
        groups = _torch_load(path, OPTIMIZER_GROUPS_FILE)
        _check_optimizer_layout(path, groups, OPTIMIZER_GROUPS_FILE)
        sizes = {name: entry["size"] for name, entry in manifest["files"].items()}
        dcp_metadata = _read_dcp_metadata(path, sizes)
        return LoadedCheckpoint(path, step, metadata, trainer_state, groups, dcp_metadata)
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
    """The checkpoint's ``metadata.json`` (either layout), after :func:`verify_files`."""
    path = Path(path)
    verify_files(path)
    return _read_json_object(path, METADATA_FILE)


def read_state(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(trainer_state, optimizer_state)`` on CPU, after :func:`read_checkpoint` (a sharded
    checkpoint's ``optimizer_state``: see :class:`LoadedCheckpoint`)."""
    checkpoint = read_checkpoint(path)
    return checkpoint.trainer_state, checkpoint.optimizer_state


def _storage_key(tensor: torch.Tensor) -> tuple:
    return (
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
    )


def _tie_keys(model: nn.Module) -> dict[str, tuple]:
    """A key per entry of :func:`checkpoint_state`, equal for entries that are one tensor
    (tied weights): the storage of a plain tensor; a sharded parameter's identity (its local
    shard may be empty, and empty shards would all look alike)."""
    live = model.state_dict(keep_vars=True)
    return {
        name: ("parameter", id(live[name])) if _is_dtensor(live[name]) else _storage_key(tensor)
        for name, tensor in checkpoint_state(model).items()
    }


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return callable(getattr(tensor, "to_local", None))


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


def _is_sharded_dir(path: Path) -> bool:
    """Whether checkpoint directory ``path`` is in the sharded layout (by its files; the
    manifest, when verified, says the same)."""
    return not (path / MODEL_FILE).is_file() and (path / _DCP_METADATA).is_file()


def _mismatch(path: Path, model: nn.Module, problems: list[str]) -> CheckpointMismatchError:
    lines = "\n  ".join(problems[:10])
    more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
    return CheckpointMismatchError(
        f"checkpoint {path}: weights do not fit {type(model).__name__}:\n  {lines}{more}\n"
        f"{_FIX_HINT}"
    )


def check_model_compatible(path: str | os.PathLike, model: nn.Module) -> None:
    """Check the stored weights fit ``model`` (names, shapes, dtypes) without loading them.

    Either layout, into a plain or a sharded model (a sharded parameter's shape is its
    global shape). Weights tied in ``model`` may be stored once (one process; a sharded
    checkpoint stores every name). Raises :class:`CheckpointMismatchError` naming the first
    offending tensors (or :class:`CheckpointCorruptError` when the file cannot be read);
    leaves ``model`` untouched. Does not verify hashes: see :func:`read_checkpoint`.
    """
    path = Path(path)
    if _is_sharded_dir(path):
        _check_sharded_model(path, model)
        return
    model_state = checkpoint_state(model)
    ties = _tie_keys(model)
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
    covered = {ties[name] for name in model_state if name in stored}
    for name in model_state:
        if name not in stored and ties[name] not in covered:
            problems.append(f"{name!r}: in the model but missing from the checkpoint")
    if problems:
        raise _mismatch(path, model, problems)


def _check_sharded_model(path: Path, model: nn.Module) -> None:
    """:func:`check_model_compatible` for a sharded checkpoint (its DCP metadata)."""
    expected = _state_dicts(model)[0]
    stored = {
        key[len(_MODEL_PREFIX) :]: entry
        for key, entry in _read_dcp_metadata(path).state_dict_metadata.items()
        if key.startswith(_MODEL_PREFIX)
    }
    problems: list[str] = []
    for name, entry in stored.items():
        target = expected.get(name)
        if target is None:
            problems.append(f"{name!r}: in the checkpoint but not in the model")
            continue
        shape, dtype = tuple(entry.size), entry.properties.dtype
        if shape != tuple(target.shape) or dtype != target.dtype:
            problems.append(
                f"{name!r}: expected {tuple(target.shape)} {target.dtype} (the model), "
                f"found {shape} {dtype} (the checkpoint)"
            )
    problems += [
        f"{name!r}: in the model but missing from the checkpoint"
        for name in expected
        if name not in stored
    ]
    if problems:
        raise _mismatch(path, model, problems)


def load_weights(path: str | os.PathLike, model: nn.Module) -> None:
    """Check (:func:`check_model_compatible`), then load the stored weights of a
    one-process checkpoint into a plain ``model``. Other combinations go through
    :meth:`CheckpointManager.load` (or ``Trainer.resume``), which stages them."""
    path = Path(path)
    if _is_sharded_dir(path) or is_sharded(model):
        raise ValueError(
            f"load_weights: {path} is a sharded checkpoint or {type(model).__name__} is "
            "sharded; use CheckpointManager.load (or Trainer.resume), which handles both"
        )
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


# How a full disk reads when no OSError says so: safetensors wraps the OS error in its own
# SafetensorError ("I/O error: No space left on device (os error 28)"); torch.save's zip
# writer raises RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos N vs
# M") when a write comes up short (the OSError, if any, is only its __context__; writing to a
# path, not even that: "basic_ios::clear: iostream error").
_DISK_FULL_TEXTS = (
    "No space left on device",
    "Disk quota exceeded",
    "os error 28",
    "StorageFull",
    "unexpected pos",
    "PytorchStreamWriter failed writing",
)


def is_disk_full(error: BaseException) -> bool:
    """Whether ``error`` reports a full disk: an ``OSError`` with ENOSPC / EDQUOT, a library's
    own wrapping of one (:data:`_DISK_FULL_TEXTS`), DCP's gathered failures of every rank,
    or an error raised from or while handling any of these."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in _DISK_FULL_ERRNOS:
            return True
        failures = getattr(error, "failures", None)  # DCP's CheckpointException
        if isinstance(failures, dict) and any(
            isinstance(item, tuple)
            and item
            and isinstance(item[0], BaseException)
            and is_disk_full(item[0])
            for item in failures.values()
        ):
            return True
        if any(text in str(error) for text in _DISK_FULL_TEXTS):
            return True
        error = error.__cause__ or error.__context__
    return False


_is_disk_full = is_disk_full


# ----------------------------------------------------------------------------- sharded (DCP)
_DCP_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}
_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` (a pickle) admitting only what it is made of: DCP's
    metadata classes, ``torch.Size``, dtypes, paths. A damaged or hostile file raises
    instead of running code."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_GLOBALS:
            return super().find_class(module, name)
        if "." not in name and module == "torch":
            found = getattr(torch, name, None)
            if isinstance(found, torch.dtype):
                return found
        if "." not in name and module == _DCP_METADATA_MODULE:
            import torch.distributed.checkpoint.metadata as dcp_metadata

            found = getattr(dcp_metadata, name, None)
            if isinstance(found, type) and found.__module__ == module:
                return found
        raise pickle.UnpicklingError(f"refusing {module}.{name}: not part of DCP metadata")


def _read_dcp_metadata(path: Path, sizes: Mapping[str, int] | None = None) -> Any:
    """The checked DCP ``Metadata`` of sharded checkpoint ``path``: every entry a tensor of
    the model (``model.*``) or of the optimizer state (``optimizer.state.*``), at least one
    model tensor and, given the manifest's file ``sizes``, every storage reference inside a
    listed file. Raises :class:`CheckpointCorruptError` (file ``dcp/.metadata``)."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    def corrupt(reason: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(path, _DCP_METADATA, reason)

    try:
        with open(path / _DCP_METADATA, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
    except Exception as error:  # UnpicklingError, EOFError, OSError, TypeError, ...
        raise corrupt(f"unreadable ({_short(error)})") from error
    entries = getattr(metadata, "state_dict_metadata", None)
    storage = getattr(metadata, "storage_data", None)
    if not (
        isinstance(metadata, Metadata) and isinstance(entries, dict) and isinstance(storage, dict)
    ):
        raise corrupt("not the metadata of a DCP checkpoint")
    for key, entry in entries.items():
        if not (isinstance(key, str) and key.startswith((_MODEL_PREFIX, _OPTIMIZER_PREFIX))):
            raise corrupt(f"unexpected entry {key!r} (expected model.* and optimizer.state.*)")
        if not isinstance(entry, TensorStorageMetadata):
            raise corrupt(f"entry {key!r} is not a tensor (this layout stores tensors only)")
    if not any(key.startswith(_MODEL_PREFIX) for key in entries):
        raise corrupt("holds no model tensor")
    if sizes is not None:
        for info in storage.values():
            name = f"{DCP_DIR}/{getattr(info, 'relative_path', None)}"
            offset, length = getattr(info, "offset", None), getattr(info, "length", None)
            if name not in sizes:
                raise corrupt(f"refers to {name}, which the manifest does not list")
            if not (
                isinstance(offset, int)
                and isinstance(length, int)
                and offset >= 0
                and length >= 0
                and offset + length <= sizes[name]
            ):
                raise corrupt(
                    f"refers to bytes [{offset}, {offset}+{length}) of {name}, which holds "
                    f"{sizes[name]}"
                )
    return metadata


def _dcp_reader(path: Path) -> Any:
    """A DCP reader of ``path/dcp`` whose metadata goes through :func:`_read_dcp_metadata`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = _read_dcp_metadata(path)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return _Reader(path / DCP_DIR)


def _dcp_load(path: Path, target: dict[str, Any], collective: bool) -> None:
    """DCP-load sharded checkpoint ``path`` into ``target`` (in place): with the process
    group (every rank reads its part; a collective) or alone. Raises
    :class:`CheckpointCorruptError` (file ``dcp``) when the data cannot be read."""
    import warnings

    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():  # alone by intent: not worth DCP's warning
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            load(target, storage_reader=_dcp_reader(path), no_dist=not collective)
    except (Exception, CheckpointException) as error:  # the latter is a BaseException
        raise CheckpointCorruptError(path, DCP_DIR, f"unreadable ({_dcp_cause(error)})") from error


def _dcp_cause(error: BaseException) -> str:
    """The first rank's error inside DCP's ``CheckpointException`` (else ``error``)."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, item = min(failures.items())
        inner = item[0] if isinstance(item, tuple) and item else item
        if isinstance(inner, BaseException):
            return f"rank {rank}: {_short(inner)}"
    return _short(error)


def _state_options(model: nn.Module, **options: Any) -> Any:
    """``StateDictOptions`` for ``model``: a LoRA model's frozen base left out (and so not
    required on load), as :func:`checkpoint_state` does."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    lora = has_lora(model)
    return StateDictOptions(ignore_frozen_params=lora, strict=not lora, **options)


def _state_dicts(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, dict[str, Any]]]:
    """``(model_state, optimizer_state, layouts)``, keyed by FQN as DCP saves and loads them
    (they share storage with the module and the optimizer): the model's
    :func:`checkpoint_state` entries; the optimizer's ``param_groups`` (parameters named by
    FQN) and ``state`` (empty while it has never stepped); ``layouts[FQN][KEY]``: a tensor
    laid out as that state tensor is or would be (shape, dtype, sharding), to load into.

    Leaves the optimizer as it was: ``get_state_dict`` creates the state of an optimizer
    that has none by a zero-learning-rate step (parameters unchanged), which is taken back
    here (one more Adam step count would change every later update)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    options = _state_options(model)
    if optimizer is None:
        return _without_frozen(model, get_model_state_dict(model, options=options)), None, {}
    fresh = not optimizer.state
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params]
    if fresh:  # get_state_dict creates state only when no gradient is held
        for p in params:
            p.grad = None
    try:
        model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    finally:
        if fresh:
            optimizer.state.clear()
            for p, grad in zip(params, grads):
                p.grad = grad
    layouts = optimizer_state["state"]
    if fresh:
        optimizer_state = {"state": {}, "param_groups": optimizer_state["param_groups"]}
    return _without_frozen(model, model_state), optimizer_state, layouts


def _without_frozen(model: nn.Module, model_state: dict[str, Any]) -> dict[str, Any]:
    """``model_state`` less every name of a frozen parameter of a LoRA model, as
    :func:`checkpoint_state` has it: ``ignore_frozen_params`` misses the second name of a
    tied frozen weight (a frozen embedding tied to the head would be saved whole)."""
    if not has_lora(model):
        return model_state
    frozen = {
        name
        for name, tensor in model.state_dict(keep_vars=True).items()
        if isinstance(tensor, nn.Parameter) and not tensor.requires_grad
    }
    return {name: value for name, value in model_state.items() if name not in frozen}


def _sharded_payload(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(dcp_state, groups)``: what DCP writes (tensors only: ``model``, and the tensors of
    ``optimizer.state``) and what ``optimizer_groups.pt`` holds (``param_groups`` and the
    non-tensor state entries)."""
    model_state, optimizer_state, _ = _state_dicts(model, optimizer)
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for fqn, entry in optimizer_state["state"].items():
        for key, value in entry.items():
            kind = tensors if isinstance(value, torch.Tensor) else scalars
            kind.setdefault(fqn, {})[key] = value
    groups = {"param_groups": optimizer_state["param_groups"], "state": scalars}
    return {"model": model_state, "optimizer": {"state": tensors}}, groups


def _saved_optimizer_entries(
    checkpoint: LoadedCheckpoint, fqns: Sequence[str]
) -> dict[tuple[str, str], Any]:
    """``{(FQN, KEY): TensorStorageMetadata}`` of a sharded checkpoint's optimizer tensors;
    :class:`CheckpointMismatchError` for one of a parameter not among ``fqns``."""
    known = set(fqns)
    entries: dict[tuple[str, str], Any] = {}
    for key, entry in checkpoint.dcp_metadata.state_dict_metadata.items():
        if not key.startswith(_OPTIMIZER_PREFIX):
            continue
        fqn, _, name = key[len(_OPTIMIZER_PREFIX) :].rpartition(".")
        if fqn not in known:
            raise CheckpointMismatchError(
                f"checkpoint {checkpoint.path}: optimizer state {name!r} of parameter {fqn!r}, "
                f"which this model does not train. {_FIX_HINT}"
            )
        entries[(fqn, name)] = entry
    return entries


def check_sharded_optimizer(
    checkpoint: LoadedCheckpoint, model: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[tuple[int, str], torch.dtype]:
    """Check a sharded checkpoint's optimizer state fits ``optimizer`` without loading it;
    return the saved dtypes ``{(flat parameter index, KEY): dtype}``.

    Fits: as many parameter groups, each naming the same parameters (FQNs) in the same
    order; every saved tensor is a state this optimizer keeps, with the shape and dtype it
    keeps it in (Adam's moments: the parameter's global shape and dtype); non-tensor entries
    belong to trained parameters. Raises :class:`CheckpointMismatchError`; modifies
    nothing.
    """
    path = checkpoint.path
    _, ours, layouts = _state_dicts(model, optimizer)
    mine = [list(group["params"]) for group in ours["param_groups"]]
    theirs = [list(group["params"]) for group in checkpoint.optimizer_state["param_groups"]]
    if [len(g) for g in mine] != [len(g) for g in theirs]:
        raise CheckpointMismatchError(
            f"checkpoint {path}: optimizer has {sum(map(len, theirs))} parameters in "
            f"{len(theirs)} groups, this model trains {sum(map(len, mine))} in {len(mine)}. "
            f"{_FIX_HINT}"
        )
    for index, (a, b) in enumerate(zip(mine, theirs)):
        if a != b:
            ours_name, saved_name = next((x, y) for x, y in zip(a, b) if x != y)
            raise CheckpointMismatchError(
                f"checkpoint {path}: optimizer parameter group {index} trains {saved_name!r} "
                f"where this model trains {ours_name!r}. {_FIX_HINT}"
            )
    fqns = [fqn for group in mine for fqn in group]
    position = {fqn: i for i, fqn in enumerate(fqns)}
    dtypes: dict[tuple[int, str], torch.dtype] = {}
    for (fqn, key), entry in _saved_optimizer_entries(checkpoint, fqns).items():
        layout = layouts.get(fqn, {}).get(key)
        shape, dtype = tuple(entry.size), entry.properties.dtype
        if not isinstance(layout, torch.Tensor):
            raise CheckpointMismatchError(
                f"checkpoint {path}: optimizer state {key!r} of parameter {fqn!r}: this "
                f"optimizer keeps no such state. {_FIX_HINT}"
            )
        if shape != tuple(layout.shape) or dtype != layout.dtype:
            raise CheckpointMismatchError(
                f"checkpoint {path}: optimizer state {key!r} of parameter {fqn!r}: expected "
                f"{tuple(layout.shape)} {layout.dtype} (the model), found {shape} {dtype}. "
                "Resume with the parameter dtypes and shapes that wrote the checkpoint, or "
                "start a new output directory."
            )
        dtypes[(position[fqn], key)] = dtype
    strays = [fqn for fqn in checkpoint.optimizer_state["state"] if fqn not in position]
    if strays:
        raise CheckpointMismatchError(
            f"checkpoint {path}: optimizer state of parameter {strays[0]!r}, which this model "
            f"does not train. {_FIX_HINT}"
        )
    return dtypes


@dataclass(frozen=True)
class StagedState:
    """A checkpoint's model and optimizer state read into new tensors for one model, ready
    for :func:`apply_state` (nothing applied yet). ``model`` and ``optimizer`` are keyed by
    FQN; ``full``: whole tensors (a one-process checkpoint), which ``set_state_dict``
    scatters to a sharded model's shards; else laid out as the model's own (DCP read this
    rank's part of every tensor)."""

    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None
    full: bool


def _fqn_optimizer_state(
    path: Path, saved: Mapping[str, Any], groups: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """A one-process ``optimizer.state_dict()`` (parameters by index) renamed to FQNs by
    position against ``groups`` (this optimizer's FQN-keyed ``param_groups``)."""
    saved_groups = saved["param_groups"]
    if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in groups]:
        raise CheckpointMismatchError(
            f"checkpoint {path}: optimizer has "
            f"{sum(len(g['params']) for g in saved_groups)} parameters in {len(saved_groups)} "
            f"groups, this model trains {sum(len(g['params']) for g in groups)} in "
            f"{len(groups)}. {_FIX_HINT}"
        )
    names = {
        index: fqn
        for saved_group, group in zip(saved_groups, groups)
        for index, fqn in zip(saved_group["params"], group["params"])
    }
    state = {}
    for index, entry in saved["state"].items():
        if index not in names:
            raise CheckpointMismatchError(
                f"checkpoint {path}: optimizer state for parameter id {index!r}, which no "
                f"parameter group lists"
            )
        state[names[index]] = dict(entry)
    return {
        "state": state,
        "param_groups": [
            {**group, "params": [names[index] for index in group["params"]]}
            for group in saved_groups
        ],
    }


def stage_state(
    checkpoint: LoadedCheckpoint,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> StagedState:
    """Read a verified checkpoint's tensors for ``model`` (and ``optimizer``) into new
    tensors, without applying them (:func:`apply_state` does).

    Meant for the combinations :func:`load_weights` does not handle: a sharded checkpoint
    (into a plain model, or a sharded one of any world size: DCP reads each rank's part) or
    a one-process checkpoint into a sharded model (full tensors; tied weights stored once
    are given every name; the optimizer state is renamed to FQNs by position). The caller
    has checked the checkpoint fits (:func:`check_model_compatible`;
    :func:`check_sharded_optimizer` or, one process, the parameter layout).

    A collective when ``model`` is sharded (every rank calls it). Raises
    :class:`CheckpointCorruptError`, on every rank alike, when DCP cannot read the data or a
    loaded tensor is not finite (a rank checks its own part). Leaves ``model`` and
    ``optimizer`` as they were.
    """
    path = checkpoint.path
    model_state, optimizer_state, layouts = _state_dicts(model, optimizer)
    if not checkpoint.sharded:
        tensors = safetensors.torch.load_file(str(path / MODEL_FILE))  # verified and finite
        ties = _tie_keys(model)
        by_tie = {ties[name]: name for name in tensors if name in ties}
        for name, tie in ties.items():
            if name not in tensors and tie in by_tie:
                tensors[name] = tensors[by_tie[tie]]
        staged = None
        if optimizer_state is not None:
            groups = optimizer_state["param_groups"]
            staged = _fqn_optimizer_state(path, checkpoint.optimizer_state, groups)
        return StagedState(tensors, staged, full=True)

    world = collective_world(model)
    staged_model = {name: tensor.detach().clone() for name, tensor in model_state.items()}
    staged_tensors: dict[str, dict[str, torch.Tensor]] = {}
    if optimizer_state is not None:
        fqns = [fqn for group in optimizer_state["param_groups"] for fqn in group["params"]]
        for fqn, key in _saved_optimizer_entries(checkpoint, fqns):
            layout = layouts.get(fqn, {}).get(key)
            if not isinstance(layout, torch.Tensor):
                raise CheckpointMismatchError(
                    f"checkpoint {path}: optimizer state {key!r} of parameter {fqn!r}: this "
                    f"optimizer keeps no such state. {_FIX_HINT}"
                )
            staged_tensors.setdefault(fqn, {})[key] = layout.detach().clone()

    def load() -> None:
        target = {"model": staged_model, "optimizer": {"state": staged_tensors}}
        _dcp_load(path, target, collective=world is not None)
        where = f" (rank {world.rank}'s shard)" if world is not None else ""
        for name, tensor in staged_model.items():
            problem = _non_finite(local_tensor(tensor))
            if problem:
                raise CheckpointCorruptError(
                    path, DCP_DIR, f"model tensor {name!r} holds {problem}{where}"
                )
        for fqn, entry in staged_tensors.items():
            for key, tensor in entry.items():
                problem = _non_finite(local_tensor(tensor))
                if problem:
                    raise CheckpointCorruptError(
                        path,
                        DCP_DIR,
                        f"optimizer state {key!r} of parameter {fqn!r} holds {problem}{where}",
                    )

    agree_on_errors(world, load)
    staged_optimizer = None
    if optimizer_state is not None:
        state: dict[str, dict[str, Any]] = {}
        for fqn, entry in staged_tensors.items():
            state.setdefault(fqn, {}).update(entry)
        for fqn, entry in checkpoint.optimizer_state["state"].items():
            state.setdefault(fqn, {}).update(entry)
        groups = copy.deepcopy(checkpoint.optimizer_state["param_groups"])
        staged_optimizer = {"state": state, "param_groups": groups}
    return StagedState(staged_model, staged_optimizer, full=False)


def apply_state(
    staged: StagedState, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Load :func:`stage_state`'s tensors into ``model`` (and ``optimizer``, whose state
    and ``param_groups`` hyper-parameters become the checkpoint's) through
    ``set_state_dict``. A collective when ``model`` is sharded. Consumes ``staged``."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    options = _state_options(model, full_state_dict=staged.full)
    if optimizer is None or staged.optimizer is None:
        set_model_state_dict(model, staged.model, options=options)
        return
    set_state_dict(
        model,
        optimizer,
        model_state_dict=staged.model,
        optim_state_dict=staged.optimizer,
        options=options,
    )
    if not staged.optimizer["state"]:  # saved before any step: no state, as it was
        optimizer.state.clear()


def load_model_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every model tensor of checkpoint ``path`` (either layout), whole, on CPU, in one
    process (no process group needed), after :func:`read_checkpoint`: for serving or
    exporting a checkpoint. A sharded checkpoint's are assembled from its shards and
    checked finite (:class:`CheckpointCorruptError`)."""
    checkpoint = read_checkpoint(path)
    if not checkpoint.sharded:
        return safetensors.torch.load_file(str(checkpoint.path / MODEL_FILE))
    target = {
        key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        for key, entry in checkpoint.dcp_metadata.state_dict_metadata.items()
        if key.startswith(_MODEL_PREFIX)
    }
    _dcp_load(checkpoint.path, target, collective=False)
    tensors = {key[len(_MODEL_PREFIX) :]: tensor for key, tensor in target.items()}
    for name, tensor in tensors.items():
        problem = _non_finite(tensor)
        if problem:
            raise CheckpointCorruptError(
                checkpoint.path, DCP_DIR, f"model tensor {name!r} holds {problem}"
            )
    return tensors


_T = TypeVar("_T")


def collective_world(model: nn.Module) -> World | None:
    """The world whose ranks load ``model`` together: the process group's for a sharded
    model, ``None`` (this process alone, even under a process group) for a plain one."""
    return World.current() if is_sharded(model) else None


def agree_on_errors(world: World | None, action: Callable[[], _T]) -> _T:
    """``action()`` on every rank of ``world`` with one outcome for all: when it raises a
    :class:`CheckpointCorruptError` or :class:`CheckpointMismatchError` on some rank, every
    rank raises the lowest such rank's (so every rank skips the same checkpoint, or stops
    with the same message). A collective for a distributed ``world``; just ``action()`` for
    ``None`` (this process alone) or one without a process group. Other exceptions propagate
    on the rank that raised them (the launcher then stops the run)."""
    if world is None or not world.distributed:
        return action()
    result, own = None, None
    try:
        result = action()
    except (CheckpointCorruptError, CheckpointMismatchError) as error:
        own = error
    first = next((error for error in world.gather_objects(own) if error is not None), None)
    if first is None:
        return result
    if own is not None and type(own) is type(first) and str(own) == str(first):
        raise own
    raise first


# ----------------------------------------------------------------------------- manager
class CheckpointManager:
    """Writes, finds and loads checkpoints under ``directory`` (see the module docstring).

    ``keep_last`` (>= 1) complete checkpoints are kept: the newest by step, plus always the
    one just written. The constructor calls :meth:`clean_staging` (on rank 0 only, under a
    process group). Under a process group every rank builds its manager on the same
    directory and calls :meth:`save` together (module invariants); the reading methods are
    local.
    """

    def __init__(self, directory: str | os.PathLike, keep_last: int = 3) -> None:
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"keep_last: expected an int >= 1, got {keep_last!r}")
        self.directory = Path(directory)
        self.keep_last = keep_last
        if World.current().is_main:
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

        Without a process group: the one-process layout (``model`` a plain module). Under
        one: a collective, every rank calling it with the same ``step`` (module
        invariants); a sharded ``model`` is written in the DCP layout, a plain one by rank 0
        in the one-process layout; ``trainer_state`` and ``metadata`` are rank 0's.

        Raises, before writing anything: ``TypeError`` when ``trainer_state`` holds something
        ``torch.load(weights_only=True)`` cannot read or ``metadata`` is not JSON-serialisable;
        :class:`NonFiniteStateError` when a model or optimizer-state tensor is not finite.
        A full disk raises :class:`CheckpointDiskFullError`, leaving the previous checkpoint
        and ``latest`` unchanged. Saving a step that already exists replaces it. Under a
        process group every rank raises alike (an error on rank 0 alone reaches the others
        as a :class:`CheckpointDiskFullError` or a ``RuntimeError`` naming it).
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step: expected an int >= 0, got {step!r}")
        _check_weights_only(trainer_state, "trainer_state")
        try:
            metadata_text = json.dumps(metadata, indent=2, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as error:
            raise TypeError(f"metadata: must be JSON-serialisable ({error})") from error
        world = World.current()
        if world.distributed:
            return self._save_collective(
                step, model, optimizer, trainer_state, metadata_text, world
            )
        if is_sharded(model):
            raise ValueError(
                f"model: {type(model).__name__} is sharded, but no process group is "
                "initialised; a sharded model is saved by every rank of its group"
            )
        final = self.path_for(step)
        non_finite = _first_non_finite_state(model, optimizer)
        if non_finite is not None:
            raise self._non_finite_error(final, *non_finite)

        self.directory.mkdir(parents=True, exist_ok=True)
        self.clean_staging()
        tmp = self.directory / f"{_TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"

        def write() -> None:
            tmp.mkdir()
            self._write_contents(tmp, step, trainer_state, metadata_text, model, optimizer)

        self._seal(tmp, final, write)
        return final

    def _seal(self, tmp: Path, final: Path, write: Callable[[], None]) -> None:
        """``write()`` the staging directory ``tmp``, then install it as ``final``; when the
        write fails, ``tmp`` is removed (a full disk raised as CheckpointDiskFullError)."""
        try:
            write()
        except BaseException as error:
            shutil.rmtree(tmp, ignore_errors=True)
            if _is_disk_full(error):
                raise self._disk_full(error, final, written=False) from error
            raise
        self._install(tmp, final)

    def _save_collective(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        trainer_state: dict[str, Any],
        metadata_text: str,
        world: World,
    ) -> Path:
        """:meth:`save` under a process group: agree on finiteness (each rank checks its
        shards), rank 0 stages, every rank writes its DCP shard (a sharded model), rank 0
        writes the rest, seals and installs; the others wait for its outcome."""
        final = self.path_for(step)
        found = world.gather_objects(_first_non_finite_state(model, optimizer))
        non_finite = next((item for item in found if item is not None), None)
        if non_finite is not None:
            raise self._non_finite_error(final, *non_finite)
        sharded = is_sharded(model)
        payload, groups = _sharded_payload(model, optimizer) if sharded else (None, None)

        def stage() -> str:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.clean_staging()
            tmp = self.directory / f"{_TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
            try:
                tmp.mkdir()
            except BaseException as error:
                if _is_disk_full(error):
                    raise self._disk_full(error, final, written=False) from error
                raise
            return str(tmp)

        tmp = Path(self._on_rank0(world, final, stage))
        if sharded:
            from torch.distributed.checkpoint import FileSystemWriter
            from torch.distributed.checkpoint import save as dcp_save

            try:  # DCP gathers every rank's failure and raises it on all of them
                dcp_save(payload, storage_writer=FileSystemWriter(tmp / DCP_DIR, sync_files=True))
            except BaseException as error:
                if world.is_main:
                    shutil.rmtree(tmp, ignore_errors=True)
                if _is_disk_full(error):
                    raise self._disk_full(error, final, written=False) from error
                raise

        def write() -> None:
            if sharded:
                _fsync_dir(tmp / DCP_DIR)
                self._write_contents(tmp, step, trainer_state, metadata_text, groups=groups)
            else:
                self._write_contents(tmp, step, trainer_state, metadata_text, model, optimizer)

        self._on_rank0(world, final, lambda: self._seal(tmp, final, write))
        return final

    def _on_rank0(self, world: World, final: Path, action: Callable[[], _T]) -> _T:
        """``action()`` on rank 0 alone, its result or failure shared with every rank (a
        collective: the others wait for it). Rank 0 re-raises its own error; the others
        raise a :class:`CheckpointDiskFullError` with its message, or a ``RuntimeError``
        naming it."""
        result, failure, raised = None, None, None
        if world.is_main:
            try:
                result = action()
            except BaseException as error:
                raised = error
                if isinstance(error, CheckpointDiskFullError):
                    failure = (error.errno, error.strerror)
                else:
                    failure = (None, _short(error))
        result, failure = world.broadcast((result, failure))
        if raised is not None:
            raise raised
        if failure is not None:
            code, message = failure
            if code is not None:
                raise CheckpointDiskFullError(code, message)
            raise RuntimeError(
                f"checkpoint {final.name} in {self.directory}: rank 0 failed while writing "
                f"it: {message}"
            )
        return result

    @staticmethod
    def _write_contents(
        tmp: Path,
        step: int,
        trainer_state: dict[str, Any],
        metadata_text: str,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        groups: dict[str, Any] | None = None,
    ) -> None:
        """Write (and fsync) every file but DCP's into staging directory ``tmp``: a plain
        ``model``'s weights and ``optimizer``'s state, or a sharded checkpoint's
        ``groups``; then the trainer state, the metadata and last the manifest."""
        if groups is None:
            _save_weights(model, tmp / MODEL_FILE)
            _fsync_file(tmp / MODEL_FILE)
            _write_file(tmp / OPTIMIZER_FILE, lambda f: torch.save(optimizer.state_dict(), f))
        else:
            _write_file(tmp / OPTIMIZER_GROUPS_FILE, lambda f: torch.save(groups, f))
        _write_file(tmp / TRAINER_STATE_FILE, lambda f: torch.save(trainer_state, f))
        _write_file(tmp / METADATA_FILE, lambda f: f.write(metadata_text.encode("utf-8")))
        write_manifest(tmp, step)
        _fsync_dir(tmp)

    def _install(self, tmp: Path, final: Path) -> None:
        """Rename the sealed staging directory ``tmp`` to ``final`` (replacing an older copy
        of the step), point ``latest`` at it, prune and clean up."""
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

    def _non_finite_error(self, final: Path, tensor: str, problem: str) -> NonFiniteStateError:
        previous = self._previous(exclude=None)
        kept = f"the latest checkpoint is still {previous}" if previous else "none exists"
        return NonFiniteStateError(
            f"refusing to save checkpoint {final.name} in {self.directory}: {tensor} holds "
            f"{problem}. Nothing was written ({kept}). The run has diverged: lower optim.lr "
            "(or enable grad_clip) and resume from the last checkpoint.",
            tensor=tensor,
        )

    def load(
        self,
        path: str | os.PathLike,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Load weights (and optimizer state) from ``path``; return ``(trainer_state, metadata)``.

        Either layout, into a plain or a sharded ``model`` (then a collective). The
        checkpoint is verified (:func:`read_checkpoint`) and the weights (and a sharded
        checkpoint's optimizer state) are checked against ``model`` before anything is
        modified. Restoring schedulers, RNGs and counters from ``trainer_state`` is the
        caller's job (see ``Trainer.resume``).
        """
        checkpoint = read_checkpoint(path)
        if not checkpoint.sharded and not is_sharded(model):
            load_weights(checkpoint.path, model)
            if optimizer is not None:
                optimizer.load_state_dict(checkpoint.optimizer_state)
        else:
            check_model_compatible(checkpoint.path, model)
            if optimizer is not None and checkpoint.sharded:
                check_sharded_optimizer(checkpoint, model, optimizer)
            apply_state(stage_state(checkpoint, model, optimizer), model, optimizer)
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
        if not isinstance(error, OSError):  # a library's own report: say which it was
            text = " ".join(str(error).split())
            cause = f"{cause}: {type(error).__name__}: {text[:160]}"
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
