"""Scoring traces: exact replay of the actions a sampler took (dense or packed), and the
approximate estimators used as baselines."""

from .estimators import (
    SCORERS,
    CoupledEstimator,
    ELBOEstimator,
    MeanFieldEstimator,
    TraceScorer,
    make_scorer,
)
from .packed import PackedReplayScorer
from .replay import ReplayScorer, ReplayScores, masked_entropy
from .teacher import TeacherScorer, VocabularyMismatchError, check_same_vocabulary

__all__ = [
    "SCORERS",
    "CoupledEstimator",
    "ELBOEstimator",
    "MeanFieldEstimator",
    "PackedReplayScorer",
    "ReplayScorer",
    "ReplayScores",
    "TeacherScorer",
    "TraceScorer",
    "VocabularyMismatchError",
    "check_same_vocabulary",
    "make_scorer",
    "masked_entropy",
]
