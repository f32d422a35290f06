"""Losses; each returns a LossOutput (a weighted sum and its denominator). The RL objectives
of both worlds share one call shape, ``loss(scores, batch)``."""

from .distill import DistillationLoss, DistillationLossConfig
from .flow_grpo import FlowGRPOConfig, FlowGRPOLoss
from .flow_sft import FlowMatchingSFT, FlowSFTConfig
from .grpo import PolicyLoss, PolicyLossConfig
from .sft import MaskedDiffusionSFT, MaskedDiffusionSFTConfig, sanitised_cross_entropy

__all__ = [
    "DistillationLoss",
    "DistillationLossConfig",
    "FlowGRPOConfig",
    "FlowGRPOLoss",
    "FlowMatchingSFT",
    "FlowSFTConfig",
    "MaskedDiffusionSFT",
    "MaskedDiffusionSFTConfig",
    "PolicyLoss",
    "PolicyLossConfig",
    "sanitised_cross_entropy",
]
