"""Losses; each returns a LossOutput (a weighted sum and its denominator)."""

from .sft import MaskedDiffusionSFT, MaskedDiffusionSFTConfig, sanitised_cross_entropy

__all__ = ["MaskedDiffusionSFT", "MaskedDiffusionSFTConfig", "sanitised_cross_entropy"]
