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
* :class:`ForwardFlowPlan` — DiffusionNFT, AWM and DGPO on flow traces of any sampler (the
  serving ODE by default): each row's clean sample noised again at K timesteps drawn from
  the row's key ``(trace seed, seed, rollout step)`` (a group's key, where the method shares
  them), as :class:`~diffusion_rl.contracts.FlowForwardBatch` micro-batches of whole rows
  (of whole groups for DGPO); every role scores one conditional velocity forward there, and
  the old policy is the rollout weights, which lag the actor.

Each plan's ``score`` is the only place its world's scorer is built, for all three roles.
"""

from __future__ import annotations

import dataclasses

import torch

from ..contracts import (
    DiffusionDistillationBatch,
    DiffusionTokenBatch,
    FlowForwardBatch,
    FlowStepBatch,
    LossOutput,
)
from ..kernels import KERNELS
from ..objectives.distill import DistillationLoss
from ..objectives.flow_grpo import FlowGRPOLoss
from ..objectives.forward_flow import (
    DGPOLoss,
    ForwardScores,
    draw_timesteps,
    forward_flow_loss,
    old_policy_decay,
)
from ..objectives.grpo import PolicyLoss, kl_per_action
from ..scoring.estimators import make_scorer
from ..scoring.flow import FlowReplayScorer, FlowStepScores
from ..scoring.replay import ReplayScorer, ReplayScores
from ..scoring.teacher import TeacherScorer, check_same_vocabulary
from ..seeding import RowStreams, noise_keys
from ..trace import FlowTrace, TokenTrace
from .roles import PolicyRoles

EXACT_SCORERS = ("exact", "packed")


def _check_target_aligned(model, role: str) -> None:
    if getattr(model, "alignment", "same_position") != "same_position":
        raise ValueError(
            f"{role}: its logits are not target-aligned; wrap it with shift_to_target_aligned "
            "in its adapter (scoring never shifts, and never falls back to autoregressive scoring)"
        )


def _packs(model) -> bool:
    """Whether packed exact replay can score ``model``: a block-causal model with a block size."""
    return getattr(model, "attention", None) == "block_causal" and bool(
        getattr(model, "block_size", None)
    )


def _check_trace(trace, kind: type) -> None:
    if not isinstance(trace, kind):
        raise TypeError(f"trace: expected a {kind.__name__}, got {type(trace).__name__}")


class _CopiedRollout:
    """The rollout weights are a copy of the actor after every step (the on-policy plans)."""

    uses_rollout_weights = False

    def rollout_decay(self, step: int) -> float:
        return 0.0


class TokenPolicyPlan(_CopiedRollout):
    """The GRPO family on :class:`TokenTrace` rollouts (``scorer``: exact, packed, mean_field,
    coupled, elbo or spg; ``post_stop_weight``: the weight of actions after the stop token).
    ``spg`` masks block-wise with the trace's ``sampler["block_size"]``, pinned here."""

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
        self.max_step_kl = loss.config.max_step_kl

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
        if self.max_step_kl is not None:  # the step's divergence is read by exact replay
            settings["replay"] = ReplayScorer.trace_options(trace)
        if self.scorer == "spg":  # block-wise masks follow the sampler's blocks
            settings["block_size"] = trace.sampler.get("block_size")
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
        options.pop("replay", None)
        if self.scorer in EXACT_SCORERS:
            options.update(stop_gradient=not live, compute_entropy=live and self.compute_entropy)
        else:  # approximate estimators: no kernel pinning, no entropy
            options.pop("kernel_id")
        return make_scorer(self.scorer, model, **options).score(batch, generator)

    def attach(self, batch: DiffusionTokenBatch, reference, old, sampler=None):
        extra = {}
        if reference is not None:
            extra["ref_logprobs"] = reference.logprobs
        if old is not None:
            extra["old_logprobs"] = old.logprobs
        inputs = {**batch.model_inputs, **extra}
        return DiffusionTokenBatch(inputs, batch.target_ids, batch.loss_weights)

    def loss(self, scores: ReplayScores, batch: DiffusionTokenBatch) -> LossOutput:
        return self.objective(scores, batch)

    def step_divergence(self, model, batch: DiffusionTokenBatch, settings) -> tuple[float, float]:
        """How far a step moved the policy the sampler runs, on this micro-batch: the sum over
        its actions (weighted like the loss) of the k3 estimate of KL(π_before ‖ π_after) and
        the sum of the weights. π_before's log-probs are the trace's behaviour log-probs (the
        rollout weights are the start-of-step actor); π_after's are ``model``'s, by exact
        replay whatever the training scorer, since the bound is on what the sampler does
        (packed replay where the model is block-causal: one forward, the same log-probs)."""
        options = {"temperature": settings["temperature"], "kernel_id": settings["kernel_id"]}
        if _packs(model):  # one forward for every step, equal to dense replay to fp32 rounding
            scorer = make_scorer("packed", model, **options, stop_gradient=True)
        else:
            scorer = ReplayScorer(model, **options, **settings["replay"], stop_gradient=True)
        after = scorer.score(batch).logprobs
        inputs = batch.model_inputs
        active = batch.active & (inputs["commit_steps"] >= 0) & (batch.loss_weights != 0)
        weights = torch.where(active, batch.loss_weights.float(), 0.0)
        before = torch.where(active, inputs["behaviour_logprobs"].float(), 0.0)
        kl = kl_per_action(before, torch.where(active, after, 0.0), "k3")
        return float((kl * weights).sum()), float(weights.sum())


class FlowPolicyPlan(_CopiedRollout):
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

    def attach(self, batch: FlowStepBatch, reference, old, sampler=None) -> FlowStepBatch:
        return dataclasses.replace(
            batch,
            ref_means=None if reference is None else reference.means,
            old_logprobs=None if old is None else old.logprobs,
        )

    def loss(self, scores: FlowStepScores, batch: FlowStepBatch) -> LossOutput:
        return self.objective(scores, batch)


class DistillationPlan(_CopiedRollout):
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

    def attach(self, batch: DiffusionTokenBatch, reference, old, sampler=None):
        return DiffusionDistillationBatch(batch, reference.logits)

    def loss(self, scores: ReplayScores, batch: DiffusionDistillationBatch) -> LossOutput:
        return self.objective(scores, batch)


class ForwardFlowPlan:
    """DiffusionNFT / AWM / DGPO on :class:`FlowTrace` rollouts (module doc); ``seed`` keys
    the forward-process draws. Under several processes a row's draws are its own (so ranks
    may cut groups), but group-shared draws and DGPO's group loss need whole groups: they
    are refused on a sharded rollout."""

    def __init__(self, loss, *, seed: int = 0) -> None:
        self.objective = loss
        self.seed = seed
        config = loss.config
        self.metric_prefix = f"{loss.name}/"
        self.num_iterations = config.num_iterations
        self.uses_reference = loss.uses_reference
        self.uses_rollout_weights = loss.name != "awm" or config.ema_beta > 0
        self.whole_groups = isinstance(loss, DGPOLoss)

    def check(self, roles: PolicyRoles) -> None:
        return None

    def rollout_decay(self, step: int) -> float:
        return old_policy_decay(self.objective.config, step)

    def pin(self, trace: FlowTrace) -> dict:
        _check_trace(trace, FlowTrace)
        return {"grid": trace.sigmas[:-1]}

    def draws(self, trace: FlowTrace, group_size: int, grid: torch.Tensor, rollout_step: int):
        """``(σ [B, K], ε [B, K, *latent])`` float32: row b's timesteps from stream
        ``noise_key(seed, rollout_step, 0, key_b)`` and its noise (``randn`` K times) from
        ``noise_key(seed, rollout_step, 1, key_b)``, ``key_b`` its trace seed, or its group's
        first trace seed for what the method shares within a group."""
        config = self.objective.config
        seeds = trace.seeds
        firsts = seeds[(torch.arange(len(trace)) // group_size) * group_size]
        timestep_keys = firsts if config.shared_timesteps else seeds
        noise_keys_ = firsts if config.shared_noise else seeds
        sigma = draw_timesteps(
            RowStreams(noise_keys(timestep_keys, self.seed, rollout_step, 0)), grid, config
        )
        streams = RowStreams(noise_keys(noise_keys_, self.seed, rollout_step, 1))
        noise = streams.randn(config.timesteps_per_sample, *trace.latent_shape)
        return sigma, noise

    def batches(self, rollout, settings, *, rollout_step, micro_batch_size):
        config = self.objective.config
        if rollout.advantages is None:
            raise ValueError("rollout: it carries no advantages; collect it with an AdvantageSpec")
        grouped = self.whole_groups or config.shared_timesteps or config.shared_noise
        if rollout.shard and grouped:
            raise ValueError(
                f"policy.algorithm {self.objective.name!r}: group-shared timesteps / noise and "
                "DGPO's group loss need every group in one process; under several processes "
                "use nft or awm with shared_timesteps and shared_noise false"
            )
        trace, size = rollout.trace, rollout.group_size
        sigma, noise = self.draws(trace, size, settings["grid"], rollout_step)
        rows, k = len(trace), config.timesteps_per_sample
        step = micro_batch_size or rows
        if self.whole_groups:
            step = -(-step // size) * size  # whole groups per micro-batch
        x0 = trace.latents[:, -1].float()
        device = x0.device
        batches = []
        for start in range(0, rows, step):
            picked = torch.arange(start, min(rows, start + step))
            index = picked.repeat_interleave(k)  # row-major items: (row, slot)
            slots = torch.arange(k).repeat(len(picked))
            s = sigma[picked].reshape(-1).to(device)
            e = noise[picked].reshape(-1, *trace.latent_shape).to(device)
            clean = x0[index.to(device)]
            view = s.view(-1, *([1] * (clean.dim() - 1)))
            batches.append(
                FlowForwardBatch(
                    rows=index,
                    groups=index // size,
                    slots=slots,
                    x0=clean,
                    noise=e,
                    sigma=s,
                    noisy=(1 - view) * clean + view * e,
                    cond={key: value[index.to(value.device)] for key, value in trace.cond.items()},
                    advantages=rollout.advantages[index].float().to(device),
                )
            )
        return batches

    def score(self, model, batch: FlowForwardBatch, settings, *, live, generator) -> ForwardScores:
        return ForwardScores(model(batch.noisy, batch.sigma, batch.cond).float())

    def attach(self, batch: FlowForwardBatch, reference, old, sampler=None) -> FlowForwardBatch:
        return dataclasses.replace(
            batch,
            ref_velocity=None if reference is None else reference.velocity,
            snapshot_velocity=None if old is None else old.velocity,
            old_velocity=None if sampler is None else sampler.velocity,
        )

    def loss(self, scores: ForwardScores, batch: FlowForwardBatch) -> LossOutput:
        return self.objective(scores, batch)


def flow_plan(policy, *, reduction: str, seed: int = 0) -> FlowPolicyPlan | ForwardFlowPlan:
    """The plan of a flow ``policy`` config (``policy.algorithm``): Flow-GRPO's on the SDE
    steps (``reduction``: the sampler's log-prob reduction), or a forward-process one."""
    if policy.algorithm == "flow_grpo":
        return FlowPolicyPlan(FlowGRPOLoss(policy, reduction=reduction), seed=seed)
    return ForwardFlowPlan(forward_flow_loss(policy), seed=seed)
