"""The three worlds' plans for :class:`~diffusion_rl.train.learner.PolicyLearner`.

* :class:`TokenPolicyPlan` — GRPO / DAPO / Dr.GRPO on token traces: micro-batches of rows of
  :meth:`TokenTrace.prepare`, scored by exact replay (or packed replay, or an approximate
  estimator for ablations, whose masks each row draws from its own noise key
  ``noise_keys(trace seed, rollout step)``, so they do not depend on the split); the
  reference and snapshot log-probs go into ``model_inputs``.
* :class:`FlowPolicyPlan` — Flow-GRPO on flow traces: the trained SDE steps (a subsample
  drawn from ``(seed, rollout step)``), one micro-batch per (sampler forward group, step),
  replayed through the trace's SDE kernel; reference means and snapshot log-probs go into
  the :class:`~diffusion_rl.contracts.FlowStepBatch`.
* :class:`DistillationPlan` — on-policy distillation: the *reference* role is the teacher,
  whose logits on the student's own states are attached as a
  :class:`~diffusion_rl.contracts.DiffusionDistillationBatch`.

Each plan's ``score`` is the only place its world's scorer is built, for all three roles.
"""

from __future__ import annotations

import dataclasses

import torch

from ..contracts import DiffusionDistillationBatch, DiffusionTokenBatch, FlowStepBatch, LossOutput
from ..kernels import KERNELS
from ..objectives.distill import DistillationLoss
from ..objectives.flow_grpo import FlowGRPOLoss
from ..objectives.grpo import PolicyLoss
from ..scoring.estimators import make_scorer
from ..scoring.flow import FlowReplayScorer, FlowStepScores
from ..scoring.replay import ReplayScorer, ReplayScores
from ..scoring.teacher import TeacherScorer, check_same_vocabulary
from ..seeding import noise_keys
from ..trace import FlowTrace, TokenTrace
from .roles import PolicyRoles

EXACT_SCORERS = ("exact", "packed")


def _check_target_aligned(model, role: str) -> None:
    if getattr(model, "alignment", "same_position") != "same_position":
        raise ValueError(
            f"{role}: its logits are not target-aligned; wrap it with shift_to_target_aligned "
            "in its adapter (scoring never shifts, and never falls back to autoregressive scoring)"
        )


def _check_trace(trace, kind: type) -> None:
    if not isinstance(trace, kind):
        raise TypeError(f"trace: expected a {kind.__name__}, got {type(trace).__name__}")


class TokenPolicyPlan:
    """The GRPO family on :class:`TokenTrace` rollouts (``scorer``: exact, packed, mean_field,
    coupled or elbo; ``post_stop_weight``: the weight of actions after the stop token)."""

    metric_prefix = "policy/"

    def __init__(
        self,
        loss: PolicyLoss,
        *,
        scorer: str = "exact",
        post_stop_weight: float = 1.0,
        compute_entropy: bool = True,
    ) -> None:
        self.objective = loss
        self.scorer = scorer
        self.post_stop_weight = post_stop_weight
        self.compute_entropy = compute_entropy
        self.num_iterations = loss.config.num_iterations
        self.uses_reference = loss.config.uses_reference

    def check(self, roles: PolicyRoles) -> None:
        _check_target_aligned(roles.actor, "model")

    def pin(self, trace: TokenTrace) -> dict:
        _check_trace(trace, TokenTrace)
        settings = {
            "temperature": trace.temperature,
            "kernel_id": trace.kernel_ids["token_logprobs"],
        }
        if self.scorer == "exact":
            settings.update(ReplayScorer.trace_options(trace))
        return settings

    def batches(self, rollout, settings, *, rollout_step, micro_batch_size):
        if rollout.advantages is None:
            raise ValueError("rollout: it carries no advantages; collect it with an AdvantageSpec")
        batch = rollout.trace.prepare(self.post_stop_weight, advantages=rollout.advantages)
        if self.scorer not in EXACT_SCORERS:  # per-row estimator noise: split-invariant
            keys = noise_keys(rollout.trace.seeds, rollout_step)
            inputs = {**batch.model_inputs, "noise_seeds": keys}
            batch = DiffusionTokenBatch(inputs, batch.target_ids, batch.loss_weights)
        return batch.split(micro_batch_size or batch.batch_size)

    def score(self, model, batch, settings, *, live, generator) -> ReplayScores:
        options = dict(settings)
        if self.scorer in EXACT_SCORERS:
            options.update(stop_gradient=not live, compute_entropy=live and self.compute_entropy)
        else:  # approximate estimators: no kernel pinning, no entropy
            options.pop("kernel_id")
        return make_scorer(self.scorer, model, **options).score(batch, generator)

    def attach(self, batch: DiffusionTokenBatch, reference, old) -> DiffusionTokenBatch:
        extra = {}
        if reference is not None:
            extra["ref_logprobs"] = reference.logprobs
        if old is not None:
            extra["old_logprobs"] = old.logprobs
        inputs = {**batch.model_inputs, **extra}
        return DiffusionTokenBatch(inputs, batch.target_ids, batch.loss_weights)

    def loss(self, scores: ReplayScores, batch: DiffusionTokenBatch) -> LossOutput:
        return self.objective(scores, batch)


class FlowPolicyPlan:
    """Flow-GRPO on :class:`FlowTrace` rollouts; ``seed`` keys the choice of trained steps."""

    metric_prefix = "flow_grpo/"

    def __init__(self, loss: FlowGRPOLoss, *, seed: int = 0) -> None:
        self.objective = loss
        self.seed = seed
        self.num_iterations = loss.config.num_iterations
        self.uses_reference = loss.config.uses_reference

    def check(self, roles: PolicyRoles) -> None:
        return None

    def trained_steps(self, trace: FlowTrace, rollout_step: int) -> list[int]:
        """The SDE steps trained at ``rollout_step``: ``max(1, ⌊fraction · n_sde⌋)`` of them,
        a deterministic function of ``(seed, rollout_step)``, in increasing order; the same
        steps for every row, so each replay forward has the sampler's batch composition."""
        sde = trace.sde_step_indices()
        if not sde:
            raise ValueError("trace: it has no SDE steps to train; sample with mode='sde'")
        count = max(1, int(self.objective.config.timestep_fraction * len(sde) + 1e-9))
        if count >= len(sde):
            return sde
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + rollout_step)
        picked = torch.randperm(len(sde), generator=generator)[:count].sort().values
        return [sde[i] for i in picked.tolist()]

    def pin(self, trace: FlowTrace) -> dict:
        _check_trace(trace, FlowTrace)
        settings = FlowReplayScorer.trace_settings(trace)
        KERNELS.get(settings["kernel_id"])  # unavailable: refused, by name, before any work
        if settings["reduction"] != self.objective.reduction:
            raise ValueError(
                f"reduction: the trace's log-probs are {settings['reduction']}-reduced, the loss "
                f"expects {self.objective.reduction!r}; build FlowGRPOLoss(reduction=...) from "
                "the sampler settings"
            )
        return settings

    def batches(self, rollout, settings, *, rollout_step, micro_batch_size):
        if rollout.advantages is None:
            raise ValueError("rollout: it carries no advantages; collect it with an AdvantageSpec")
        steps = self.trained_steps(rollout.trace, rollout_step)
        return rollout.trace.prepare(steps, advantages=rollout.advantages)

    def score(self, model, batch: FlowStepBatch, settings, *, live, generator) -> FlowStepScores:
        return FlowReplayScorer(model, **settings, stop_gradient=not live).score(batch)

    def attach(self, batch: FlowStepBatch, reference, old) -> FlowStepBatch:
        return dataclasses.replace(
            batch,
            ref_means=None if reference is None else reference.means,
            old_logprobs=None if old is None else old.logprobs,
        )

    def loss(self, scores: FlowStepScores, batch: FlowStepBatch) -> LossOutput:
        return self.objective(scores, batch)


class DistillationPlan:
    """On-policy distillation on the student's :class:`TokenTrace` rollouts; ``roles.actor``
    is the student, ``roles.reference`` the teacher (any target-aligned token denoiser with
    the student's vocabulary). μ = 1: the student's own rollouts, one step each."""

    metric_prefix = None
    num_iterations = 1
    uses_reference = True

    def __init__(self, loss: DistillationLoss, *, post_stop_weight: float = 1.0) -> None:
        self.objective = loss
        self.post_stop_weight = post_stop_weight

    def check(self, roles: PolicyRoles) -> None:
        _check_target_aligned(roles.actor, "student")
        check_same_vocabulary(roles.actor, roles.reference)

    def pin(self, trace: TokenTrace) -> TokenTrace:
        """The trace itself: the student's replay and the teacher's walk both read it."""
        _check_trace(trace, TokenTrace)
        return trace

    def batches(self, rollout, settings, *, rollout_step, micro_batch_size):
        batch = rollout.trace.prepare(self.post_stop_weight)
        return batch.split(micro_batch_size or batch.batch_size)

    def score(self, model, batch, trace: TokenTrace, *, live, generator) -> ReplayScores:
        if live:
            student = (
                batch.student_batch if isinstance(batch, DiffusionDistillationBatch) else batch
            )
            return ReplayScorer.for_trace(model, trace, return_logits=True).score(student)
        return TeacherScorer.for_trace(model, trace).score(batch)

    def attach(self, batch: DiffusionTokenBatch, reference, old) -> DiffusionDistillationBatch:
        return DiffusionDistillationBatch(batch, reference.logits)

    def loss(self, scores: ReplayScores, batch: DiffusionDistillationBatch) -> LossOutput:
        return self.objective(scores, batch)
