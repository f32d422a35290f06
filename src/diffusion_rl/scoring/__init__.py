"""Scoring traces: exact replay of the actions a sampler took — token traces (dense or
packed) and flow traces (per SDE step) — and the approximate token estimators used as
baselines."""

from .estimators import (
    SCORERS,
    CoupledEstimator,
    ELBOEstimator,
    MeanFieldEstimator,
    SPGEstimator,
    TraceScorer,
    make_scorer,
)
from .flow import FlowReplayScorer, FlowScores, FlowStepScores
from .packed import PackedReplayScorer
from .replay import ReplayScorer, ReplayScores, masked_entropy
from .teacher import TeacherScorer, VocabularyMismatchError, check_same_vocabulary

__all__ = [
    "SCORERS",
    "CoupledEstimator",
    "ELBOEstimator",
    "FlowReplayScorer",
    "FlowScores",
    "FlowStepScores",
    "MeanFieldEstimator",
    "PackedReplayScorer",
    "ReplayScorer",
    "ReplayScores",
    "SPGEstimator",
    "TeacherScorer",
    "TraceScorer",
    "VocabularyMismatchError",
    "check_same_vocabulary",
    "make_scorer",
    "masked_entropy",
]
