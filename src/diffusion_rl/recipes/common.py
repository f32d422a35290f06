"""What every recipe does the same way: build its trainers, resume its latest checkpoint,
identify a frozen model by its weights."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import ConfigError
from ..train.checkpoint import CheckpointManager
from ..train.trainer import LossFn, Trainer


def trainer_factory(config: Any) -> Callable[[nn.Module, LossFn], Trainer]:
    """``(model, loss_fn) → Trainer`` with the recipe config's ``optim``, ``precision``,
    ``seed`` and ``device`` (and ``activation_checkpointing`` where the recipe offers it)."""

    def make_trainer(model: nn.Module, loss_fn: LossFn) -> Trainer:
        return Trainer(
            model,
            loss_fn,
            config.optim,
            precision=config.precision,
            activation_checkpointing=getattr(config, "activation_checkpointing", False),
            seed=config.seed,
            device=config.device,
        )

    return make_trainer


def resume_latest(
    trainer: Trainer, manager: CheckpointManager, metadata: dict, *, resume: bool, out: Path
) -> dict[str, Any] | None:
    """The extra state of ``manager``'s latest checkpoint, restored into ``trainer`` after
    ``metadata`` is validated against it; ``None`` when there is no checkpoint. Existing
    checkpoints with ``resume`` false are refused rather than overwritten."""
    if manager.latest() is None:
        return None
    if not resume:
        raise ConfigError(
            f"output_dir: {out} already holds checkpoints; set resume: true to continue, or "
            "choose a new output_dir"
        )
    return trainer.resume(manager, metadata)


def weights_digest(model: torch.nn.Module) -> str:
    """A short content hash of a model's weights (identifies the reference in checkpoints)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]
