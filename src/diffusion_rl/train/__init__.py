"""Training loop, checkpoints, metric reduction and logging shared by every method."""

from diffusion_rl.train.checkpoint import (
    CheckpointManager,
    CheckpointMismatchError,
    validate_metadata,
)
from diffusion_rl.train.loggers import MetricsLogger, progress
from diffusion_rl.train.metrics import WeightedReduction, reduce_metrics, reduce_weighted
from diffusion_rl.train.trainer import LossFn, OptimConfig, StepResult, Trainer, lr_factor

__all__ = [
    "CheckpointManager",
    "CheckpointMismatchError",
    "LossFn",
    "MetricsLogger",
    "OptimConfig",
    "StepResult",
    "Trainer",
    "WeightedReduction",
    "lr_factor",
    "progress",
    "reduce_metrics",
    "reduce_weighted",
    "validate_metadata",
]
