"""Training shared by every method: the trainer, the one policy learner and its per-world
plans, roles with versions, checkpoints, metric reduction and logging."""

from diffusion_rl.train.checkpoint import (
    CheckpointCorruptError,
    CheckpointDiskFullError,
    CheckpointManager,
    CheckpointMismatchError,
    NonFiniteStateError,
    validate_metadata,
)
from diffusion_rl.train.learner import LearnerPlan, PolicyLearner
from diffusion_rl.train.loggers import MetricsLogger, progress
from diffusion_rl.train.metrics import WeightedReduction, reduce_metrics, reduce_weighted
from diffusion_rl.train.plans import DistillationPlan, FlowPolicyPlan, TokenPolicyPlan
from diffusion_rl.train.roles import PolicyRoles, StaleTraceError
from diffusion_rl.train.trainer import LossFn, OptimConfig, StepResult, Trainer, lr_factor

__all__ = [
    "CheckpointCorruptError",
    "CheckpointDiskFullError",
    "CheckpointManager",
    "CheckpointMismatchError",
    "DistillationPlan",
    "FlowPolicyPlan",
    "LearnerPlan",
    "LossFn",
    "MetricsLogger",
    "NonFiniteStateError",
    "OptimConfig",
    "PolicyLearner",
    "PolicyRoles",
    "StaleTraceError",
    "StepResult",
    "TokenPolicyPlan",
    "Trainer",
    "WeightedReduction",
    "lr_factor",
    "progress",
    "reduce_metrics",
    "reduce_weighted",
    "validate_metadata",
]
