"""Scoring traces: exact replay of the actions a sampler took."""

from .replay import ReplayScorer, ReplayScores, masked_entropy

__all__ = ["ReplayScorer", "ReplayScores", "masked_entropy"]
