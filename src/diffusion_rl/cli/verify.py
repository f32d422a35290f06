"""``diffusion-rl verify DIR``: check a model directory, a trainer checkpoint or a run's output
directory against its manifests, without building a model.

* a model directory (``config.json`` or ``model_index.json``; a workflow directory,
  ``workflow.yaml``): every file against ``manifest.json`` (sizes and SHA-256, no file missing
  or added) and the manifest of every subdirectory that has one (a workflow's stages), every
  JSON file parses, every safetensors header parses and every tensor is finite
  (:func:`~diffusion_rl.models.manifest.verify_model_directory`);
* a trainer checkpoint (``OUTPUT_DIR/checkpoints/step_N``): every file against its manifest,
  parsed, every weight and optimizer-state tensor finite
  (:func:`~diffusion_rl.train.checkpoint.read_checkpoint`);
* a run's output directory: its ``model/`` and every checkpoint in ``checkpoints/``.

Exit status: 0 when everything checked is intact and verified; 1 when something differs from
its manifest, is damaged, or cannot be verified (a model directory without a manifest, such as
a downloaded checkpoint: its files parse, but nothing records what they should hold); 2 for bad
input (no such directory, or not one of the three). One line per directory checked: ``ok: ...``
on stdout, ``diffusion-rl verify: error: ...`` on stderr, naming the file and the fix.

Heavy modules (torch, safetensors, the trainer) are imported only when the command runs.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

__all__ = ["cmd_verify", "verify_path"]

PROG = "diffusion-rl verify"
_MODEL_MARKERS = ("config.json", "model_index.json", "workflow.yaml", "manifest.json")


def _is_checkpoint(path: Path) -> bool:
    """The layout of ``train/checkpoint.py`` (its MANIFEST_FILE, MODEL_FILE, DCP_DIR; named
    here so a model directory is checked without importing the trainer)."""
    return (
        (path / "manifest.json").is_file()
        and ((path / "model.safetensors").is_file() or (path / "dcp").is_dir())
        and not (path / "config.json").exists()
        and not (path / "model_index.json").exists()
    )


def _check_checkpoint(path: Path) -> tuple[bool, str]:
    from ..train.checkpoint import CheckpointCorruptError, read_checkpoint

    try:
        loaded = read_checkpoint(path)
    except CheckpointCorruptError as error:
        return False, str(error)
    what = "sharded trainer checkpoint" if loaded.sharded else "trainer checkpoint"
    return True, (
        f"{path}: {what} of step {loaded.step}: every file matches manifest.json (sizes, "
        "SHA-256), parses, and every tensor read is finite"
    )


def _check_model(path: Path) -> tuple[bool, str]:
    from ..models.loading import ModelFileError
    from ..models.manifest import MANIFEST_FILE, verify_model_directory

    try:
        report = verify_model_directory(path)
    except ModelFileError as error:
        return False, str(error)
    checked = f"{report.weights} weights files parse and their {report.tensors} tensors are finite"
    if not report.verified:
        return False, (
            f"{path}: unverified: it has no {MANIFEST_FILE} (a downloaded checkpoint?), so "
            f"nothing records what its files should hold; {checked}"
        )
    nested = f" and {report.manifests - 1} nested manifests" if report.manifests > 1 else ""
    return True, (
        f"{path}: model directory: {report.files} files match {MANIFEST_FILE}{nested} (sizes, "
        f"SHA-256); {checked}"
    )


def verify_path(path: str | Path) -> tuple[int, list[tuple[bool, str]]]:
    """``(exit status, [(ok, line), ...])`` of ``diffusion-rl verify PATH`` (module
    docstring)."""
    root = Path(path)
    if not root.exists():
        return 2, [(False, f"DIR: {root} does not exist")]
    if not root.is_dir():
        return 2, [(False, f"DIR: {root} is not a directory")]
    if _is_checkpoint(root):
        results = [_check_checkpoint(root)]
    elif any((root / name).exists() for name in _MODEL_MARKERS):
        results = [_check_model(root)]
    elif (root / "model").is_dir() or (root / "checkpoints").is_dir():
        results = []
        if (root / "model").is_dir():
            results.append(_check_model(root / "model"))
        steps = sorted((root / "checkpoints").glob("step_*"))
        results += [_check_checkpoint(step) for step in steps if step.is_dir()]
        if not results:
            return 2, [(False, f"DIR: {root} holds neither a model nor a checkpoint to verify")]
    else:
        return 2, [
            (
                False,
                f"DIR: {root} is not a model directory (config.json, model_index.json, "
                "workflow.yaml), a trainer checkpoint (manifest.json and model.safetensors or "
                "dcp/) or a run's output directory (model/, checkpoints/)",
            )
        ]
    return (0 if all(ok for ok, _ in results) else 1), results


def cmd_verify(args: Any) -> int:
    status, results = verify_path(args.dir)
    for ok, line in results:
        if ok:
            print(f"ok: {line}")
        else:
            print(f"{PROG}: error: {line}", file=sys.stderr)
    return status
