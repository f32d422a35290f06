"""Model directories: ``config.json`` + ``model.safetensors`` + ``tokenizer.json`` +
``diffusion_rl.json`` (what the model was trained for: task and sampler settings), written
atomically so an interrupted save never leaves a half model behind."""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..tasks.tokenizer import CharTokenizer
from .transformer import DiffusionTransformer

INFO_FILE = "diffusion_rl.json"


@dataclass(frozen=True)
class ModelDir:
    model: DiffusionTransformer
    tokenizer: CharTokenizer
    info: dict[str, Any]


def save_model_dir(
    directory: str | Path,
    model: DiffusionTransformer,
    tokenizer: CharTokenizer,
    info: dict[str, Any],
) -> Path:
    """Write the model, its tokenizer and ``info`` to ``directory`` (replaced atomically)."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    model.save_pretrained(staging)
    tokenizer.save(staging)
    (staging / INFO_FILE).write_text(
        json.dumps({"tokenizer": tokenizer.name, **info}, indent=2) + "\n"
    )
    retired = directory.with_name(f".{directory.name}.old")
    if directory.exists():
        shutil.rmtree(retired, ignore_errors=True)
        directory.rename(retired)
    staging.rename(directory)
    shutil.rmtree(retired, ignore_errors=True)
    return directory


def load_model_dir(directory: str | Path) -> ModelDir:
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"model directory {directory} does not exist")
    model = DiffusionTransformer.from_pretrained(directory)
    tokenizer = CharTokenizer.load(directory)
    info_path = directory / INFO_FILE
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    if tokenizer.vocab_size != model.vocab_size or tokenizer.mask_id != model.mask_token_id:
        raise ValueError(
            f"{directory}: tokenizer (vocab {tokenizer.vocab_size}, mask {tokenizer.mask_id}) does not "
            f"match the model (vocab {model.vocab_size}, mask {model.mask_token_id})"
        )
    return ModelDir(model.eval(), tokenizer, info)


# ---------------------------------------------------------------------------------------------
# Flow (image) model directories: FlowDiT's config.json + model.safetensors, plus INFO_FILE
# ---------------------------------------------------------------------------------------------


def is_flow_model_dir(directory: str | Path) -> bool:
    """True when ``directory`` holds a saved :class:`~diffusion_rl.models.dit.FlowDiT`."""
    from .dit import MODEL_TYPE

    config = Path(directory) / "config.json"
    if not config.is_file():
        return False
    try:
        return json.loads(config.read_text()).get("model_type") == MODEL_TYPE
    except (json.JSONDecodeError, AttributeError):
        return False


@dataclass(frozen=True)
class FlowModelDir:
    """A saved FlowDiT (in eval mode) and ``info``: what it was trained for (``task``, the
    serving ``sampler`` settings, ``trained_steps``)."""

    model: Any
    info: dict[str, Any]


def save_flow_model_dir(directory: str | Path, model, info: dict[str, Any]) -> Path:
    """Write ``model`` (``save_pretrained``, replaced atomically) and ``info`` (written to a
    temporary name, then renamed) to ``directory``."""
    directory = model.save_pretrained(directory)
    staging = directory / f".{INFO_FILE}.tmp"
    staging.write_text(json.dumps(info, indent=2) + "\n")
    staging.replace(directory / INFO_FILE)
    return directory


def load_flow_model_dir(directory: str | Path) -> FlowModelDir:
    from .dit import FlowDiT

    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"model directory {directory} does not exist")
    model = FlowDiT.from_pretrained(directory)
    info_path = directory / INFO_FILE
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    if "task" not in info and model.config.task is not None:
        info["task"] = dict(model.config.task)
    return FlowModelDir(model, info)
