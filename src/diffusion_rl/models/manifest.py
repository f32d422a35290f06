"""Verified model directories: ``manifest.json``, the size and SHA-256 of every file.

Every model directory the project writes (a run's ``model/``, an export, a merged LoRA, a
workflow's stages and the workflow directory itself) ends with ``manifest.json``, written last
into the staging directory before it is renamed into place (:func:`write_manifest`)::

    {"format": 1, "step": 120, "files": {NAME: {"size": bytes, "sha256": hex}},
     "manifest_sha256": hex}

This is the format of the trainer checkpoints' manifests (``train/checkpoint.py``), hashed
with the same two functions (:func:`~diffusion_rl.checksums.file_sha256`,
:func:`~diffusion_rl.checksums.manifest_digest`): ``manifest_sha256`` is the SHA-256 of the
canonical JSON of the other three keys, so damage to the manifest itself is reported as such.
``step`` is the ``trained_steps`` the directory's ``diffusion_rl.json`` records (0 when none);
``files`` lists every file below the directory by its relative POSIX name (subdirectories
included), except the manifest itself.

Reading (:func:`verify_manifest`): the manifest must be intact, every file it lists present
with the recorded size and SHA-256, and no other file present (a file added later would be
read unchecked). Anything else is a :class:`~.loading.ManifestMismatchError` naming the file.
:func:`check_weights_files` checks every ``*.safetensors`` header (a truncated, empty, random,
pickled or zipped file is a :class:`~.loading.ModelFileError` naming it), and
:func:`check_model_files` does both: a directory without a manifest (a downloaded checkpoint)
passes after the header checks, with one warning line saying it is unverified (logger
``diffusion_rl.models``). :func:`first_non_finite` finds NaN or infinite weights.

What a manifest cannot catch: a directory damaged and then sealed again, and a downloaded
directory (no manifest) whose tensor data is damaged but whose headers parse.

This module imports nothing of the package but :mod:`diffusion_rl.checksums` and
:mod:`.loading`, so any loader (and the server) can use it.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from ..checksums import file_sha256, manifest_digest
from .loading import MAX_JSON_BYTES, ManifestMismatchError, ModelFileError, NonFiniteWeightsError

if TYPE_CHECKING:
    import torch

__all__ = [
    "MANIFEST_FILE",
    "MANIFEST_FORMAT",
    "DirectoryReport",
    "check_model_files",
    "check_weights_files",
    "directory_files",
    "first_non_finite",
    "read_manifest",
    "verify_manifest",
    "verify_model_directory",
    "warn_unverified",
    "weights_file_name",
    "write_manifest",
]

logger = logging.getLogger("diffusion_rl.models")

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = 1
"""The format number of ``train/checkpoint.py``'s manifests, whose layout this one is."""
MANIFEST_KEYS = frozenset({"format", "step", "files", "manifest_sha256"})
INFO_FILE = "diffusion_rl.json"  # models.io.INFO_FILE (io imports this module)
WEIGHTS_SUFFIX = ".safetensors"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_FIX = "write the directory again (rerun the export or the run's final save) or restore it"


# ----------------------------------------------------------------------------- listing
def directory_files(directory: str | os.PathLike) -> list[str]:
    """Every entry below ``directory`` that is not a directory (regular files, symlinks to
    files, broken symlinks), plus every symlink to a directory (which is not followed), by
    relative POSIX name, sorted; the top-level ``manifest.json`` excluded."""
    root = Path(directory)
    found: list[str] = []
    for current, dirs, files in os.walk(root, followlinks=False):
        here = Path(current)
        for name in dirs:
            if (here / name).is_symlink():
                found.append((here / name).relative_to(root).as_posix())
        found += [(here / name).relative_to(root).as_posix() for name in files]
    return sorted(name for name in found if name != MANIFEST_FILE)


def _trained_steps(directory: Path) -> int:
    try:
        info = json.loads((directory / INFO_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return 0
    steps = info.get("trained_steps") if isinstance(info, dict) else None
    return steps if isinstance(steps, int) and not isinstance(steps, bool) and steps >= 0 else 0


# ----------------------------------------------------------------------------- writing
def write_manifest(directory: str | os.PathLike, step: int | None = None) -> Path:
    """Record the size and SHA-256 of every file below model directory ``directory`` (read
    back from disk) in ``manifest.json`` (fsynced); ``step`` defaults to the ``trained_steps``
    of its ``diffusion_rl.json`` (0 when none). Returns the manifest's path.

    Every writer of a model directory calls it last, on the staging directory, before the
    rename. Called on an existing directory it seals whatever the files now hold: only for
    tools and tests."""
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"write_manifest: {root} is not a directory")
    step = _trained_steps(root) if step is None else step
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"write_manifest: step: expected an int >= 0, got {step!r}")
    files = {}
    for name in directory_files(root):
        path = root / name
        if not path.is_file():
            raise ValueError(f"write_manifest: {path} is not a regular file (a symlink?)")
        files[name] = {"size": path.stat().st_size, "sha256": file_sha256(path)}
    body = {"format": MANIFEST_FORMAT, "step": step, "files": files}
    text = json.dumps({**body, "manifest_sha256": manifest_digest(body)}, indent=2, sort_keys=True)
    target = root / MANIFEST_FILE
    with open(target, "wb") as handle:
        handle.write(text.encode("utf-8") + b"\n")
        handle.flush()
        os.fsync(handle.fileno())
    return target


# ----------------------------------------------------------------------------- reading
def _valid_name(name: Any) -> bool:
    if not isinstance(name, str) or not name or "\0" in name or "\\" in name:
        return False
    path = PurePosixPath(name)
    return (
        not path.is_absolute()
        and all(part not in ("", ".", "..") for part in path.parts)
        and path.as_posix() == name
        and name != MANIFEST_FILE
    )


def read_manifest(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The parsed, self-consistent ``manifest.json`` of ``directory``, or ``None`` when it has
    none; :class:`ManifestMismatchError` naming ``manifest.json`` when it is damaged."""
    root = Path(directory)
    file = root / MANIFEST_FILE
    if not file.exists() and not file.is_symlink():
        return None

    def damaged(reason: str) -> ManifestMismatchError:
        return ManifestMismatchError(root, MANIFEST_FILE, f"{reason}; {_FIX}")

    if not file.is_file():
        raise damaged("not a regular file")
    size = file.stat().st_size
    if size > MAX_JSON_BYTES:
        raise damaged(f"{size} bytes, more than the {MAX_JSON_BYTES} a manifest may have")
    data = file.read_bytes()
    if not data:
        raise damaged("empty file")
    try:
        manifest = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise damaged(f"not valid JSON ({type(error).__name__})") from None
    if not isinstance(manifest, dict) or set(manifest) != MANIFEST_KEYS:
        raise damaged(f"expected an object with the keys {sorted(MANIFEST_KEYS)}")
    body = {key: manifest[key] for key in ("format", "step", "files")}
    try:
        intact = manifest["manifest_sha256"] == manifest_digest(body)
    except (TypeError, ValueError):  # NaN, infinity or an unsortable object in the body
        intact = False
    if not intact:
        raise damaged("damaged: its own checksum (manifest_sha256) does not match its content")
    if manifest["format"] != MANIFEST_FORMAT:
        raise damaged(f"format {manifest['format']!r}; this version reads {MANIFEST_FORMAT}")
    step = manifest["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise damaged(f"'step': expected an int >= 0, got {step!r}")
    files = manifest["files"]
    if not isinstance(files, dict):
        raise damaged("'files': expected an object of file entries")
    for name, entry in files.items():
        if not _valid_name(name):
            raise damaged(f"'files': {name!r} is not a relative file name inside the directory")
        if not (
            isinstance(entry, dict)
            and set(entry) == {"size", "sha256"}
            and isinstance(entry["size"], int)
            and not isinstance(entry["size"], bool)
            and entry["size"] >= 0
            and isinstance(entry["sha256"], str)
            and _HEX64.match(entry["sha256"])
        ):
            raise damaged(f"entry {name!r}: expected {{'size': int, 'sha256': 64 hex digits}}")
    return manifest


def verify_manifest(directory: str | os.PathLike, *, hashes: bool = True) -> dict | None:
    """Check ``directory`` against its ``manifest.json`` (module docstring) and return the
    manifest, or ``None`` when it has none (unverified). ``hashes=False`` compares sizes only.

    Raises:
        ManifestMismatchError: the manifest is damaged, a file it lists is missing or differs
            in size or SHA-256, or a file it does not list is present (naming the file).
    """
    root = Path(directory)
    manifest = read_manifest(root)
    if manifest is None:
        return None
    listed: dict[str, dict] = manifest["files"]
    for name in directory_files(root):
        if name not in listed:
            raise ManifestMismatchError(
                root,
                name,
                "not listed in manifest.json: added after the directory was written; remove "
                f"it, or {_FIX}",
            )
    for name in sorted(listed):
        path, recorded = root / name, listed[name]
        if not path.is_file():
            what = "not a regular file" if path.exists() else "missing"
            raise ManifestMismatchError(
                root, name, f"{what}: manifest.json lists it (removed after it was written); {_FIX}"
            )
        size = path.stat().st_size
        if size != recorded["size"]:
            kind = "size mismatch"
            if size == 0:
                kind = "empty file"
            elif size < recorded["size"]:
                kind = "truncated"
            raise ManifestMismatchError(
                root,
                name,
                f"{kind}: {size} bytes, manifest.json records {recorded['size']}; {_FIX}",
            )
        if not hashes:
            continue
        digest = file_sha256(path)
        if digest != recorded["sha256"]:
            raise ManifestMismatchError(
                root,
                name,
                f"sha256 mismatch (manifest.json records {recorded['sha256'][:16]}..., the file "
                f"hashes to {digest[:16]}...): changed or damaged after it was written; {_FIX}",
            )
    return manifest


# ----------------------------------------------------------------------------- weights files
def _one_line(error: BaseException, limit: int = 200) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def weights_problem(path: str | os.PathLike) -> str | None:
    """What is wrong with safetensors file ``path`` (None: its header and layout parse): empty,
    truncated, a pickle or zip archive, or a header that does not parse."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        return "not a regular file"
    size = path.stat().st_size
    if size == 0:
        return "empty file (0 bytes); the weights were never written or were wiped"
    with open(path, "rb") as handle:
        head = handle.read(8)
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return (
            "a pickle file, not safetensors; diffusion_rl never unpickles weights (it can run "
            "code): convert it to safetensors in a trusted environment"
        )
    if head[:4] == b"PK\x03\x04":
        return (
            "a zip archive (torch.save), not safetensors; diffusion_rl never unpickles "
            "weights: convert it to safetensors in a trusted environment"
        )
    if size < 8:
        return f"truncated: {size} bytes, shorter than a safetensors header"
    declared = int.from_bytes(head, "little")
    if declared > size - 8:
        return (
            f"truncated or not safetensors: its header claims {declared} bytes, the whole file "
            f"has {size}"
        )
    try:
        with safe_open(str(path), framework="pt") as handle:
            list(handle.keys())
    except Exception as error:  # noqa: BLE001 (any parse failure is the file's fault)
        return f"not a valid safetensors file ({_one_line(error)})"
    return None


def weights_files(directory: str | os.PathLike) -> list[Path]:
    """Every ``*.safetensors`` file below ``directory`` (sorted)."""
    root = Path(directory)
    return [root / name for name in directory_files(root) if name.endswith(WEIGHTS_SUFFIX)]


def check_weights_files(directory: str | os.PathLike) -> list[Path]:
    """Check the header of every ``*.safetensors`` file below ``directory``; returns them.
    :class:`ModelFileError` naming the first that is empty, truncated, a pickle, a zip archive
    or otherwise does not parse."""
    root = Path(directory)
    files = weights_files(root)
    for path in files:
        problem = weights_problem(path)
        if problem is not None:
            raise ModelFileError(root, path.relative_to(root).as_posix(), problem)
    return files


def weights_file_name(directory: str | os.PathLike) -> str | None:
    """The one weights file at the top of ``directory`` (its name), or None (several, none)."""
    names = [p.name for p in Path(directory).glob(f"*{WEIGHTS_SUFFIX}") if p.is_file()]
    return names[0] if len(names) == 1 else None


def check_model_files(directory: str | os.PathLike, *, warn: bool = True) -> bool:
    """Verify model directory ``directory`` against its manifest and check every weights
    file's header; returns whether it was verified. Without a manifest, ``warn`` logs the
    one line saying the directory is unverified (:func:`warn_unverified`; a loader passes
    ``warn=False`` and logs it once the model has loaded).

    Raises:
        ManifestMismatchError: a file differs from what the manifest records.
        ModelFileError: a weights file that does not parse.
    """
    root = Path(directory)
    manifest = verify_manifest(root)
    check_weights_files(root)
    if manifest is None and warn:
        warn_unverified(root)
    return manifest is not None


def warn_unverified(directory: str | os.PathLike) -> None:
    """Log (warning, logger ``diffusion_rl.models``) the one line saying ``directory`` has no
    manifest, so its tensor data could not be verified."""
    logger.warning(
        "model directory %s: unverified: it has no %s (a downloaded checkpoint?), so only its "
        "safetensors headers were checked, not its tensor data",
        directory,
        MANIFEST_FILE,
    )


# ----------------------------------------------------------------------------- finiteness
def non_finite(tensor: torch.Tensor) -> str | None:
    """None if ``tensor`` is not floating or holds only finite values, else what it holds."""
    import torch

    if not (tensor.is_floating_point() or tensor.is_complex()) or tensor.is_meta:
        return None
    if bool(torch.isfinite(tensor).all()):
        return None
    nans, infs = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
    return f"non-finite values ({nans} NaN, {infs} infinite, of {tensor.numel()})"


def first_non_finite(tensors: Mapping[str, torch.Tensor] | Iterable) -> tuple[str, str] | None:
    """``(name, what it holds)`` of the first tensor (by name order of ``tensors``, a mapping
    or ``(name, tensor)`` pairs) holding NaN or infinity; None when all are finite."""
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    for name, tensor in items:
        problem = non_finite(tensor.detach())
        if problem is not None:
            return name, problem
    return None


# ----------------------------------------------------------------------------- verify
@dataclass(frozen=True)
class DirectoryReport:
    """What :func:`verify_model_directory` checked: ``verified`` (it has a manifest, and every
    file matched it), ``files`` (the files its manifest lists), ``manifests`` (its own and those
    of its subdirectories, e.g. a workflow's stages), ``weights`` (safetensors
    files read), ``tensors`` (tensors read, all finite)."""

    directory: Path
    verified: bool
    files: int
    manifests: int
    weights: int
    tensors: int


def verify_model_directory(directory: str | os.PathLike) -> DirectoryReport:
    """Check model directory ``directory`` completely without building a model: its manifest
    and the manifest of every subdirectory that has one (a workflow's stages), every JSON file
    parses, every ``*.safetensors`` file's header parses and every tensor in it is finite
    (read one at a time). What ``diffusion-rl verify`` runs on a model directory.

    Raises:
        ManifestMismatchError: a file differs from what a manifest records.
        ModelFileError: a JSON or weights file that does not parse.
        NonFiniteWeightsError: a tensor holding NaN or infinity (naming it).
    """
    from safetensors import safe_open

    root = Path(directory)
    names = directory_files(root)
    manifest = verify_manifest(root)
    files = len(manifest["files"]) if manifest else 0
    manifests = 1 if manifest else 0
    for name in names:  # nested manifests (a workflow directory's stages)
        if PurePosixPath(name).name == MANIFEST_FILE:
            verify_manifest(root / PurePosixPath(name).parent)
            manifests += 1
    for name in names:
        if not name.endswith(".json") or PurePosixPath(name).name == MANIFEST_FILE:
            continue
        path = root / name
        try:
            if path.stat().st_size > MAX_JSON_BYTES:
                raise ValueError(f"more than {MAX_JSON_BYTES} bytes")
            json.loads(path.read_bytes().decode("utf-8"))
        except (OSError, ValueError, RecursionError) as error:
            raise ModelFileError(root, name, f"not valid JSON ({_one_line(error)})") from None
    tensors = 0
    weights = check_weights_files(root)
    for path in weights:
        name = path.relative_to(root).as_posix()
        try:
            with safe_open(str(path), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                    problem = non_finite(handle.get_tensor(key))
                    tensors += 1
                    if problem is not None:
                        raise NonFiniteWeightsError(
                            root,
                            name,
                            f"tensor {key!r} holds {problem}; the weights are damaged or come "
                            "from a diverged run",
                            tensor=key,
                        )
        except ModelFileError:
            raise
        except Exception as error:  # noqa: BLE001 (a tensor whose data does not read)
            raise ModelFileError(
                root, name, f"a tensor does not read ({_one_line(error)})"
            ) from None
    return DirectoryReport(root, manifest is not None, files, manifests, len(weights), tensors)
