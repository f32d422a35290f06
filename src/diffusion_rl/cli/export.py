"""``diffusion-rl export [--merge] SRC OUT``: a LoRA run's model as a directory of its own.

``SRC`` is a LoRA model directory (what a run with ``model.lora`` writes: the adapter and the
path of its base model; :mod:`diffusion_rl.models.lora`) or the run's ``OUTPUT_DIR`` (its
``model/`` is used). ``OUT`` must not exist; it is written into a staging directory beside it
and renamed into place, so an interrupted export leaves nothing.

* ``--merge``: the adapter merged into the base weights (``W + (alpha / r) B A``), a plain
  model directory without LoRA: the built-in models in this project's format (read by
  ``load_model``, ``generate``, ``eval``), a Hugging Face token model in its family's own
  format (config.json and weights under the family's key names, with its tokenizer
  files: ``models.io.save_model``), so the family's own loader reads it too; a diffusers
  pipeline run through the flow adapters' export
  (:func:`~diffusion_rl.models.diffusers_adapters.export.export_flow_model`).
* without it: a copy of the adapter directory (still naming its base model).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["cmd_export", "export_model"]

# The model modules import torch; they are imported when the command runs, so that
# ``diffusion-rl --help`` does not (the file names are the ones ``models.io`` and
# ``models.lora`` define; a test checks that they agree).
CONFIG_FILE = "config.json"
INFO_FILE = "diffusion_rl.json"
ADAPTER_FILE = "adapter.safetensors"
PIPELINE_WEIGHTS = "model.safetensors"  # a pipeline model directory's trained weights


def _model_directory(src: Path) -> Path:
    if not src.is_dir():
        raise FileNotFoundError(f"SRC: {src} is not a directory")
    if not (src / CONFIG_FILE).is_file() and (src / "model" / CONFIG_FILE).is_file():
        return src / "model"  # a run's OUTPUT_DIR
    return src


def _is_pipeline_model(directory: Path) -> bool:
    """Whether ``directory`` is what a flow recipe writes for a diffusers pipeline actor."""
    from ..models.flow_pipelines import PIPELINE_MODEL_TYPE

    try:
        config = json.loads((directory / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("model_type") == PIPELINE_MODEL_TYPE


def _write_merged(src: Path, target: Path) -> None:
    from ..models.io import load_model, save_model
    from ..models.lora import merge_lora

    loaded = load_model(src)
    model = merge_lora(loaded.model)
    tokenizer = loaded.tokenizer if loaded.kind == "token" else None
    save_model(target, model, loaded.info, tokenizer)


def _write_adapter(src: Path, target: Path) -> None:
    from ..models.manifest import check_model_files, write_manifest

    check_model_files(src)  # copy only what the source's manifest vouches for
    target.mkdir()
    for name in (CONFIG_FILE, ADAPTER_FILE, PIPELINE_WEIGHTS, INFO_FILE):
        if (src / name).is_file():
            shutil.copy2(src / name, target / name)
    write_manifest(target)


def export_model(src: str | os.PathLike, out: str | os.PathLike, *, merge: bool) -> Path:
    """Write the export of LoRA model directory (or run directory) ``src`` at ``out`` (module
    docstring); returns ``out``. ``ValueError`` naming ``SRC`` / ``OUT`` for a source that is
    not a LoRA model or a target that exists."""
    from ..models.lora import LORA_MODEL_TYPE, is_lora_directory, read_lora_config

    source, out = _model_directory(Path(src)), Path(out)
    if out.exists():
        raise ValueError(f"OUT: {out} exists; export writes a new directory (remove it first)")
    pipeline = _is_pipeline_model(source)
    if pipeline and merge:
        return export_flow_model(source, out)
    if not (pipeline or is_lora_directory(source)):
        raise ValueError(
            f"SRC: {source} is not a LoRA model directory (its {CONFIG_FILE} has no model_type "
            f"{LORA_MODEL_TYPE!r}); export takes what a run with model.lora wrote: a plain "
            "model directory is already loadable as it is"
        )
    if not pipeline:
        read_lora_config(source)  # the base exists and is the one the adapter was trained on
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        staging = scratch / out.name
        (_write_merged if merge else _write_adapter)(source, staging)
        os.rename(staging, out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return out


def export_flow_model(source: Path, out: Path) -> Path:
    """A diffusers pipeline run merged: the flow adapters' own export (a plain pipeline
    directory; diffusers is imported only here)."""
    from ..models.diffusers_adapters.export import export_flow_model as export_pipeline

    return export_pipeline(source, out)


def cmd_export(args: Any) -> int:
    out = export_model(args.src, args.out, merge=args.merge)
    what = "merged model" if args.merge else "adapter"
    print(f"wrote the {what} to {out}")
    return 0
