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
