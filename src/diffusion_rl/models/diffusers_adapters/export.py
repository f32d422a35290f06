"""Merged export of a trained flow pipeline: a plain diffusers pipeline directory.

:func:`export_flow_model` reads what a flow recipe wrote for a pipeline actor (a pipeline
model directory: base pipeline path + LoRA or transformer weights, see
:mod:`diffusion_rl.models.flow_pipelines`), merges a LoRA into the transformer's weights
(peft's merge) and writes the whole pipeline with ``save_pretrained``: ``model_index.json``,
the trained transformer, and the base's VAE, text encoders, tokenizers and scheduler. The
result needs neither peft nor this package: ``DiffusionPipeline.from_pretrained(out_dir)``
or the family's pipeline class loads it, and it gives the LoRA model's outputs (float32:
within ~1e-6; bf16 weights round the merged sums to bf16).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from ..flow_pipelines import PipelineModel, flow_directory_kind

__all__ = ["export_flow_model", "pipeline_model_directory"]


def pipeline_model_directory(source: str | Path) -> Path:
    """The pipeline model directory ``source`` names: itself, or a run's output directory's
    ``model/``. ``ValueError`` (naming what it holds) for anything else."""
    path = Path(source)
    if not (path / "config.json").is_file() and (path / "model" / "config.json").is_file():
        path = path / "model"  # a run's output directory
    try:
        kind, recorded = flow_directory_kind(path)
    except FileNotFoundError as error:
        raise FileNotFoundError(f"{source}: {error}") from None
    if not recorded:
        what = "a built-in model directory" if kind == "builtin" else f"a {kind} diffusers pipeline"
        raise ValueError(
            f"{source}: holds {what}, not a trained pipeline model (the model/ directory a "
            "flow-sft or flow-grpo run on a pipeline writes); a diffusers pipeline directory "
            "is already plain"
        )
    return path


def export_flow_model(source: str | Path, out_dir: str | Path) -> Path:
    """Write the trained pipeline model in ``source`` (a pipeline model directory, or the
    output directory of the run that wrote one) as a plain diffusers pipeline directory at
    ``out_dir``, its LoRA merged (module docstring). ``out_dir`` must not exist or be an
    empty directory; it is written into a staging directory beside it and renamed into place,
    so an interrupted export leaves nothing. Returns ``out_dir``."""
    directory = pipeline_model_directory(source)
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"out_dir: {out} exists and is not an empty directory")
    adapter = PipelineModel.from_pretrained(directory)
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        staging = scratch / out.name
        adapter.save_merged(staging, in_place=True)
        from ..manifest import write_manifest  # sizes and SHA-256 of every file, written last

        write_manifest(staging)
        if out.exists():
            out.rmdir()
        staging.rename(out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return out
