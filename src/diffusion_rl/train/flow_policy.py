"""The flow policy learner: one Flow-GRPO optimisation step on a captured flow rollout.

For a :class:`~diffusion_rl.trace.FlowTrace` sampled with rollout weights v:

1. refuse it unless v is the current version (or off-policy use is allowed), and look its
   SDE kernel up by the recorded id (refused, by name, when unavailable);
2. choose the trained steps: the trace's SDE steps (the sampler's window), subsampled to
   ``timestep_fraction`` of them by a permutation drawn from ``(seed, rollout step)`` — the
   same steps for every row, so each replay forward has the sampler's batch composition;
3. cut the trace into micro-batches of one sampler forward group at one step
   (:meth:`~diffusion_rl.trace.FlowTrace.step_batches`); score the reference means
   (``beta > 0``) and, for μ > 1, the start-of-step snapshot's log-probs on exactly those
   micro-batches, under the trainer's precision, without gradient;
4. run μ trainer steps; each replays the live actor (with gradient) on every micro-batch and
   applies :class:`~diffusion_rl.objectives.flow_grpo.FlowGRPOLoss`; ``ℓold`` stays fixed
   across them (μ = 1: ``ℓold = stop_grad(ℓθ)``, ratio exactly 1);
5. sync the rollout weights (version v + 1).

Live, reference and old policy go through the same replay on the same tensors and shapes, so
before any update every ratio is exactly 1 and the parity ``|ℓold − ℓβ|`` is 0.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.utils import _pytree as pytree

from ..kernels import KERNELS
from ..objectives.flow_grpo import FlowGRPOLoss
from ..scoring.flow import FlowReplayScorer, FlowStepScores
from ..trace import FlowStepBatch, FlowTrace
from .roles import PolicyRoles
from .trainer import Trainer

_EXTREMES = {
    "flow_grpo/ratio_min": min,
    "flow_grpo/ratio_max": max,
    "flow_grpo/parity_max_abs": max,
}


class FlowPolicyLearner:
    """Owns the trainer for the actor; ``step(trace, advantages)`` → metrics of the step.

    ``trainer_factory(model, loss_fn) -> Trainer`` (as for the token learner).
    """

    def __init__(
        self,
        roles: PolicyRoles,
        loss: FlowGRPOLoss,
        trainer_factory,
        *,
        allow_off_policy: bool = False,
        seed: int = 0,
    ) -> None:
        if loss.config.uses_reference and roles.reference is None:
            raise ValueError(
                f"beta={loss.config.beta}: the KL term needs PolicyRoles(reference=True)"
            )
        self.roles = roles
        self.loss = loss
        self.allow_off_policy = allow_off_policy
        self.seed = seed
        self.trainer: Trainer = trainer_factory(roles.actor, self._loss_fn)
        self._settings: dict = {}
        self._extremes: list[dict[str, float]] = []

    # ----------------------------------------------------------------- step choice
    def trained_steps(self, trace: FlowTrace, rollout_step: int) -> list[int]:
        """The SDE steps trained this rollout step: ``max(1, ⌊fraction · n_sde⌋)`` of them,
        a deterministic function of ``(seed, rollout_step)``, in increasing order."""
        sde = trace.sde_step_indices()
        if not sde:
            raise ValueError("trace: it has no SDE steps to train; sample with mode='sde'")
        count = max(1, int(self.loss.config.timestep_fraction * len(sde) + 1e-9))
        if count >= len(sde):
            return sde
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + rollout_step)
        picked = torch.randperm(len(sde), generator=generator)[:count].sort().values
        return [sde[i] for i in picked.tolist()]

    # ----------------------------------------------------------------- scoring
    def _scorer(self, model, *, live: bool) -> FlowReplayScorer:
        return FlowReplayScorer(model, **self._settings, stop_gradient=not live)

    def _loss_fn(self, model, batch: FlowStepBatch, _generator) -> object:
        scores = self._scorer(model, live=True).score_step(batch)
        out = self.loss(
            scores.log_prob,
            advantages=batch.advantages,
            old_log_prob=batch.old_logprobs,
            behaviour_log_prob=batch.behaviour_logprobs,
            mean=scores.mean,
            ref_mean=batch.ref_means,
            std=scores.std,
            sigma=batch.sigma,
            sigma_next=batch.sigma_next,
            weights=batch.weights,
            reduction=self._settings["reduction"],
        )
        self._extremes.append(
            {k: float(out.aux_metrics[k]) for k in _EXTREMES if k in out.aux_metrics}
        )
        return out

    def _score_frozen(self, model, batches: list[FlowStepBatch]) -> list[FlowStepScores]:
        with self.roles.on_compute(model), torch.no_grad(), self.trainer.autocast():
            scorer = self._scorer(model, live=False)
            device = self.roles.compute_device
            return [scorer.score_step(_to_device(batch, device)) for batch in batches]

    # ----------------------------------------------------------------- the step
    def step(
        self,
        trace: FlowTrace,
        advantages: torch.Tensor,
        *,
        weights: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """One optimisation step (μ inner iterations) on ``trace`` with per-row
        ``advantages [B]`` (e.g. from :func:`~diffusion_rl.objectives.flow_grpo.flow_advantages`)
        and optional per-row ``weights [B]``."""
        if not isinstance(trace, FlowTrace):
            raise TypeError(f"trace: expected a FlowTrace, got {type(trace).__name__}")
        self.roles.check_trace_version(
            trace.weights_version, allow_off_policy=self.allow_off_policy
        )
        self._settings = FlowReplayScorer.trace_settings(trace)
        KERNELS.get(self._settings["kernel_id"])  # unavailable: refused, by name, before any work
        cfg = self.loss.config
        rollout_step = self.trainer.global_step // cfg.num_iterations
        steps = self.trained_steps(trace, rollout_step)
        advantages = torch.as_tensor(advantages, dtype=torch.float32)
        batches = trace.step_batches(steps, advantages=advantages, weights=weights)

        metrics: dict[str, float] = {"flow_grpo/trained_steps": float(len(steps))}
        for iteration in range(cfg.num_iterations):
            if iteration == 0:
                if cfg.uses_reference:
                    refs = self._score_frozen(self.roles.reference, batches)
                    batches = [
                        dataclasses.replace(b, ref_means=r.mean) for b, r in zip(batches, refs)
                    ]
                if cfg.num_iterations > 1:
                    olds = self._score_frozen(self.roles.take_snapshot(), batches)
                    batches = [
                        dataclasses.replace(b, old_logprobs=o.log_prob)
                        for b, o in zip(batches, olds)
                    ]
            self._extremes = []
            result = self.trainer.train_step(batches)
            step_metrics = dict(result.metrics)
            for key, pick in _EXTREMES.items():  # true extremes, not a mean of micro-batch ones
                values = [e[key] for e in self._extremes if key in e]
                if values:
                    step_metrics[key] = pick(values)
            for key, value in step_metrics.items():
                if key.startswith("flow_grpo/") or key in ("loss", "grad_norm"):
                    metrics[f"{key}@iter{iteration}"] = value
            metrics.update(step_metrics)
        metrics["weights_version"] = float(self.roles.sync_rollout())
        return metrics


def _to_device(batch: FlowStepBatch, device: torch.device) -> FlowStepBatch:
    return pytree.tree_map(
        lambda leaf: leaf.to(device) if isinstance(leaf, torch.Tensor) else leaf, batch
    )
