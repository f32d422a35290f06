"""diffusion-rl: post-training for diffusion generators with exact trace replay.

The package face exports both worlds' contracts and traces; the parts live in
:mod:`~diffusion_rl.models`, :mod:`~diffusion_rl.sampling`, :mod:`~diffusion_rl.scoring`,
:mod:`~diffusion_rl.objectives`, :mod:`~diffusion_rl.rollout` and :mod:`~diffusion_rl.train`.
"""

from .contracts import (
    DiffusionDistillationBatch,
    DiffusionTokenBatch,
    Extreme,
    FlowStepBatch,
    LossOutput,
    WeightedMetric,
    validate_diffusion_logits,
)
from .trace import FlowTrace, TokenTrace

__version__ = "0.1.0"

__all__ = [
    "DiffusionDistillationBatch",
    "DiffusionTokenBatch",
    "Extreme",
    "FlowStepBatch",
    "FlowTrace",
    "LossOutput",
    "TokenTrace",
    "WeightedMetric",
    "__version__",
    "validate_diffusion_logits",
]
