"""diffusion-rl: post-training for diffusion generators with exact trace replay."""

from .contracts import DiffusionTokenBatch, LossOutput, WeightedMetric, validate_diffusion_logits
from .trace import TokenTrace

__version__ = "0.1.0"

__all__ = [
    "DiffusionTokenBatch",
    "LossOutput",
    "TokenTrace",
    "WeightedMetric",
    "__version__",
    "validate_diffusion_logits",
]
