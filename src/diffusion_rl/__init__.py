"""diffusion-rl: post-training for diffusion generators with exact trace replay.

The package face exports both worlds' contracts and traces; the parts live in
:mod:`~diffusion_rl.models`, :mod:`~diffusion_rl.sampling`, :mod:`~diffusion_rl.scoring`,
:mod:`~diffusion_rl.objectives`, :mod:`~diffusion_rl.rollout` and :mod:`~diffusion_rl.train`.

The names are imported on first use, so ``import diffusion_rl`` (and the command line's
``--version`` and ``--help``) does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_exports

__version__ = "0.1.0"

# exported name → the module that defines it (imported on first use)
_EXPORTS = {
    "DiffusionDistillationBatch": ".contracts",
    "DiffusionTokenBatch": ".contracts",
    "Extreme": ".contracts",
    "FlowStepBatch": ".contracts",
    "LossOutput": ".contracts",
    "WeightedMetric": ".contracts",
    "validate_diffusion_logits": ".contracts",
    "FlowTrace": ".trace",
    "TokenTrace": ".trace",
}

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

if TYPE_CHECKING:  # for type checkers; at run time the names load on first use
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

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
