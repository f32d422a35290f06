"""Atomic, self-describing training checkpoints.

Layout of ``directory``::

    step_00000120/            one complete checkpoint
        model.safetensors     model weights (``safetensors.torch.save_model``: tied weights ok)
        optimizer.pt          ``optimizer.state_dict()``
        trainer_state.pt      scheduler state, RNG states, counters, data position
        metadata.json         the run's configuration, checked on resume
    latest                    text file: the name of the newest complete checkpoint
    .tmp-...                  an interrupted write; ignored, removed by the next save

Invariants:

* A checkpoint directory named ``step_*`` is always complete: it is written as a temporary
  sibling, every file is fsynced, then it is renamed into place (``os.rename`` is atomic).
* ``latest`` is replaced atomically (write a temporary file, fsync, ``os.replace``) and only
  after the rename; old checkpoints beyond ``keep_last`` are deleted only after that.
* So a crash at any point leaves the previous checkpoint loadable through :meth:`latest`.
* ``trainer_state`` and ``optimizer.pt`` load with ``torch.load(weights_only=True)``: they
  may hold only tensors, numbers, strings, bools, ``None``, lists, tuples and dicts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

import safetensors
import safetensors.torch
import torch
from torch import nn

__all__ = [
    "CheckpointManager",
    "CheckpointMismatchError",
    "check_model_compatible",
    "load_weights",
    "read_metadata",
    "read_state",
    "validate_metadata",
]

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
TRAINER_STATE_FILE = "trainer_state.pt"
METADATA_FILE = "metadata.json"
LATEST_FILE = "latest"
_REQUIRED_FILES = (MODEL_FILE, OPTIMIZER_FILE, TRAINER_STATE_FILE, METADATA_FILE)
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_TMP_PREFIX = ".tmp-"

_FIX_HINT = (
    "To resume, pass the same configuration that wrote the checkpoint; to train with a "
    "different one, start a new output directory."
)


class CheckpointMismatchError(ValueError):
    """A checkpoint does not match the run trying to resume from it."""


# ----------------------------------------------------------------------------- metadata
def _diff(expected: Any, found: Any, prefix: str, out: list[str]) -> None:
    if isinstance(expected, Mapping) and isinstance(found, Mapping):
        for key in expected:
            name = f"{prefix}.{key}" if prefix else str(key)
            if key not in found:
                out.append(f"{name!r}: missing from the checkpoint (expected {expected[key]!r})")
            else:
                _diff(expected[key], found[key], name, out)
        for key in found:
            if key not in expected:
                name = f"{prefix}.{key}" if prefix else str(key)
                out.append(f"{name!r}: not expected, found {found[key]!r} in the checkpoint")
    elif expected != found or isinstance(expected, bool) != isinstance(found, bool):
        out.append(f"{prefix or '<root>'!r}: expected {expected!r}, found {found!r}")


def _json_normal(value: Any) -> Any:
    """What ``value`` becomes after a JSON round trip (tuples become lists, keys strings)."""
    return json.loads(json.dumps(value))


def validate_metadata(expected: Mapping[str, Any], found: Mapping[str, Any]) -> None:
    """Raise :class:`CheckpointMismatchError` unless ``found`` equals ``expected``.

    Nested mappings are compared key by key; every difference is reported with its dotted
    key ("missing", "not expected", or expected vs found). ``expected`` is compared in its
    JSON form, so a tuple equals the list the checkpoint stored.
    """
    problems: list[str] = []
    _diff(_json_normal(expected), found, "", problems)
    if problems:
        lines = "\n  ".join(problems)
        raise CheckpointMismatchError(
            f"checkpoint metadata does not match this run:\n  {lines}\n{_FIX_HINT}"
        )


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


def _step_dirs(directory: Path) -> list[tuple[int, Path]]:
    """Complete-looking checkpoint directories, sorted by step."""
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def _is_complete(path: Path) -> bool:
    return path.is_dir() and all((path / name).is_file() for name in _REQUIRED_FILES)


def _require_complete(path: Path) -> None:
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint {path}: no such directory")
    missing = [name for name in _REQUIRED_FILES if not (path / name).is_file()]
    if missing:
        raise FileNotFoundError(f"checkpoint {path}: incomplete, missing {', '.join(missing)}")


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint's ``metadata.json`` (reads nothing else)."""
    path = Path(path)
    _require_complete(path)
    return json.loads((path / METADATA_FILE).read_text(encoding="utf-8"))


def read_state(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(trainer_state, optimizer_state_dict)``, loaded to CPU with ``weights_only=True``."""
    path = Path(path)
    _require_complete(path)
    trainer_state = torch.load(path / TRAINER_STATE_FILE, map_location="cpu", weights_only=True)
    optimizer_state = torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
    return trainer_state, optimizer_state


def _storage_key(tensor: torch.Tensor) -> tuple:
    return (
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
    )


def check_model_compatible(path: str | os.PathLike, model: nn.Module) -> None:
    """Check the stored weights fit ``model`` (names, shapes, dtypes) without loading them.

    Weights tied in ``model`` may be stored once. Raises :class:`CheckpointMismatchError`
    naming the first offending tensors; leaves ``model`` untouched.
    """
    path = Path(path)
    _require_complete(path)
    model_state = model.state_dict()
    problems: list[str] = []
    stored: set[str] = set()
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


# ----------------------------------------------------------------------------- manager
class CheckpointManager:
    """Writes, finds and loads checkpoints under ``directory`` (see the module docstring).

    ``keep_last`` (>= 1) complete checkpoints are kept: the newest by step, plus always the
    one just written.
    """

    def __init__(self, directory: str | os.PathLike, keep_last: int = 3) -> None:
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"keep_last: expected an int >= 1, got {keep_last!r}")
        self.directory = Path(directory)
        self.keep_last = keep_last

    def path_for(self, step: int) -> Path:
        return self.directory / f"step_{step:08d}"

    def checkpoints(self) -> list[Path]:
        """Complete checkpoint directories, oldest step first (temporary dirs ignored)."""
        return [path for _, path in _step_dirs(self.directory) if _is_complete(path)]

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or ``None``.

        Follows the ``latest`` pointer; if it is absent or points at something incomplete,
        falls back to the highest complete ``step_*`` directory.
        """
        pointer = self.directory / LATEST_FILE
        if pointer.is_file():
            name = pointer.read_text(encoding="utf-8").strip()
            if _STEP_DIR.match(name) and _is_complete(self.directory / name):
                return self.directory / name
        complete = self.checkpoints()
        return complete[-1] if complete else None

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        trainer_state: dict[str, Any],
        metadata: dict[str, Any],
    ) -> Path:
        """Atomically write checkpoint ``step`` and return its directory.

        Raises ``TypeError`` (before writing anything) when ``trainer_state`` holds something
        ``torch.load(weights_only=True)`` cannot read or ``metadata`` is not JSON-serialisable.
        Saving a step that already exists replaces it.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step: expected an int >= 0, got {step!r}")
        _check_weights_only(trainer_state, "trainer_state")
        try:
            metadata_text = json.dumps(metadata, indent=2, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as error:
            raise TypeError(f"metadata: must be JSON-serialisable ({error})") from error

        self.directory.mkdir(parents=True, exist_ok=True)
        self._remove_temporaries()
        final = self.path_for(step)
        tmp = self.directory / f"{_TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        safetensors.torch.save_model(model, str(tmp / MODEL_FILE))
        _fsync_file(tmp / MODEL_FILE)
        _write_file(tmp / OPTIMIZER_FILE, lambda f: torch.save(optimizer.state_dict(), f))
        _write_file(tmp / TRAINER_STATE_FILE, lambda f: torch.save(trainer_state, f))
        _write_file(tmp / METADATA_FILE, lambda f: f.write(metadata_text.encode("utf-8")))
        _fsync_dir(tmp)

        if final.exists():
            # Move the old copy aside first: a directory cannot be renamed over a non-empty one.
            old = self.directory / f"{_TMP_PREFIX}replaced-{final.name}-{uuid.uuid4().hex[:8]}"
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync_dir(self.directory)
        self._point_latest_at(final.name)
        self._prune(keep=final)
        self._remove_temporaries()
        return final

    def load(
        self,
        path: str | os.PathLike,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Load weights (and optimizer state) from ``path``; return ``(trainer_state, metadata)``.

        Everything is read and the weights are checked against ``model`` before anything is
        modified. Restoring schedulers, RNGs and counters from ``trainer_state`` is the
        caller's job (see ``Trainer.resume``).
        """
        path = Path(path)
        metadata = read_metadata(path)
        trainer_state, optimizer_state = read_state(path)
        load_weights(path, model)
        if optimizer is not None:
            optimizer.load_state_dict(optimizer_state)
        return trainer_state, metadata

    # ------------------------------------------------------------------------- internals
    def _point_latest_at(self, name: str) -> None:
        tmp = self.directory / f"{_TMP_PREFIX}{LATEST_FILE}-{uuid.uuid4().hex[:8]}"
        _write_file(tmp, lambda f: f.write(f"{name}\n".encode()))
        os.replace(tmp, self.directory / LATEST_FILE)
        _fsync_dir(self.directory)

    def _prune(self, keep: Path) -> None:
        complete = self.checkpoints()
        survivors = set(complete[-self.keep_last :]) | {keep}
        for path in complete:
            if path not in survivors:
                shutil.rmtree(path, ignore_errors=True)

    def _remove_temporaries(self) -> None:
        for entry in self.directory.iterdir():
            if entry.name.startswith(_TMP_PREFIX):
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
