"""The one policy learner: one optimisation step of any on-policy method on a rollout.

For a :class:`~diffusion_rl.rollout.Rollout` sampled with rollout weights v (its trace says
which), :meth:`PolicyLearner.step`

1. refuses the trace unless v is the current version (or off-policy use is allowed);
2. *pins* the scoring settings the trace recorded (temperature, kernel ids, guidance, ...;
   an unavailable kernel is refused by name before any work);
3. cuts the rollout into micro-batches (the world's training batches);
4. scores the *reference* role (when the method uses one: the KL anchor, or the teacher of
   distillation) and, for μ > 1, the start-of-step *snapshot*, on exactly those micro-batches,
   under the trainer's precision, without gradient, and *attaches* the scores;
5. runs μ trainer steps; each scores the live actor with gradient on every micro-batch and
   applies the objective (``loss(scores, batch) -> LossOutput``); the attached scores stay
   fixed across them (μ = 1: ``ℓold = stop_grad(ℓθ)``, every ratio exactly 1);
6. syncs the rollout weights (version v + 1).

Live, reference and old policy are scored by the same plan on the same micro-batches, so they
see the same states, actions and shapes: before any update the ratio is 1 and the parity
``|ℓold − ℓβ|`` is 0.

A world plugs in through a :class:`LearnerPlan` (see :mod:`diffusion_rl.train.plans`): the
token GRPO family, Flow-GRPO and on-policy distillation are three small plans on this one
loop. Everything a step needs passes through arguments: ``pin`` returns the settings, the
micro-batch index travels with its batch. Stochastic estimators draw per row from keys the
plan attaches (trace seed, rollout step), so every pass, inner iteration and micro-batch split
sees the same draws; the per-micro-batch generator serves only keyless estimators.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils import _pytree as pytree

from ..contracts import LossOutput
from .roles import PolicyRoles
from .trainer import Trainer

_KEY_MIX = 1_000_003


class LearnerPlan(Protocol):
    """How one world trains on its rollouts (``Batch`` and ``Scores`` are the world's types).

    * ``num_iterations`` μ; ``uses_reference``: score ``roles.reference`` and attach it;
      ``metric_prefix``: the objective's metrics also logged per inner iteration
      (``key@iterN``), or None.
    * ``check(roles)``: refuse models the plan cannot train (raises ``ValueError``).
    * ``pin(trace) -> settings``: what the trace says about how to score it.
    * ``batches(rollout, settings, rollout_step=, micro_batch_size=) -> list[Batch]``.
    * ``score(model, batch, settings, live=, generator=) -> Scores`` (``live``: with gradient).
    * ``attach(batch, reference, old) -> Batch``: the frozen scores (or None) into the batch.
    * ``loss(scores, batch) -> LossOutput``.
    """

    num_iterations: int
    uses_reference: bool
    metric_prefix: str | None

    def check(self, roles: PolicyRoles) -> None: ...

    def pin(self, trace: Any) -> Any: ...

    def batches(
        self, rollout: Any, settings: Any, *, rollout_step: int, micro_batch_size: int | None
    ) -> list[Any]: ...

    def score(
        self, model: torch.nn.Module, batch: Any, settings: Any, *, live: bool, generator
    ) -> Any: ...

    def attach(self, batch: Any, reference: Any | None, old: Any | None) -> Any: ...

    def loss(self, scores: Any, batch: Any) -> LossOutput: ...


@dataclass(frozen=True)
class MicroBatch:
    """A training batch and its position in the step (a pytree: the trainer moves ``batch``)."""

    index: int
    batch: Any


pytree.register_dataclass(MicroBatch, serialized_type_name="diffusion_rl.train.learner.MicroBatch")


class PolicyLearner:
    """Owns the actor's trainer; ``step(rollout)`` → the step's metrics.

    ``trainer_factory(model, loss_fn) -> Trainer`` (the learner passes its loss per step).
    ``micro_batch_size``: rows per micro-batch where the plan splits by rows (None: one).
    ``seed`` keys the draws of stochastic scorers: ``(seed, rollout step, micro-batch)``.
    """

    def __init__(
        self,
        roles: PolicyRoles,
        plan: LearnerPlan,
        trainer_factory,
        *,
        micro_batch_size: int | None = None,
        allow_off_policy: bool = False,
        seed: int = 0,
    ) -> None:
        if plan.uses_reference and roles.reference is None:
            raise ValueError(
                "reference: this objective scores a reference model; build the roles with "
                "PolicyRoles(actor, reference=True) (or the teacher, for distillation)"
            )
        plan.check(roles)
        self.roles = roles
        self.plan = plan
        self.micro_batch_size = micro_batch_size
        self.allow_off_policy = allow_off_policy
        self.seed = seed
        self.trainer: Trainer = trainer_factory(roles.actor, None)

    @property
    def rollout_step(self) -> int:
        """Learner steps taken (each is μ trainer steps)."""
        return self.trainer.global_step // self.plan.num_iterations

    def generator(self, rollout_step: int, index: int) -> torch.Generator:
        """The draws of micro-batch ``index`` at ``rollout_step``: shared by the reference,
        snapshot and live passes and by every inner iteration."""
        return torch.Generator().manual_seed((self.seed * _KEY_MIX + rollout_step) * 4096 + index)

    def _live_loss(self, model, micro: MicroBatch, _generator, *, settings, rollout_step: int):
        generator = self.generator(rollout_step, micro.index)
        scores = self.plan.score(model, micro.batch, settings, live=True, generator=generator)
        return self.plan.loss(scores, micro.batch)

    def _score_frozen(self, model, micro: list[MicroBatch], settings, rollout_step: int) -> list:
        device = self.roles.compute_device
        with self.roles.on_compute(model), torch.no_grad(), self.trainer.autocast():
            return [
                self.plan.score(
                    model,
                    _to_device(m.batch, device),
                    settings,
                    live=False,
                    generator=self.generator(rollout_step, m.index),
                )
                for m in micro
            ]

    def step(self, rollout) -> dict[str, float]:
        """One optimisation step (μ inner iterations) on ``rollout``; syncs the rollout
        weights. Returns the trainer's metrics (per inner iteration for the objective's keys),
        ``weights_version`` and the rollout's stats."""
        trace = rollout.trace
        self.roles.check_trace_version(
            trace.weights_version, allow_off_policy=self.allow_off_policy
        )
        settings = self.plan.pin(trace)
        rollout_step = self.rollout_step
        batches = self.plan.batches(
            rollout, settings, rollout_step=rollout_step, micro_batch_size=self.micro_batch_size
        )
        micro = [MicroBatch(i, b) for i, b in enumerate(batches)]
        none = [None] * len(micro)
        reference = (
            self._score_frozen(self.roles.reference, micro, settings, rollout_step)
            if self.plan.uses_reference
            else none
        )
        old = (
            self._score_frozen(self.roles.take_snapshot(), micro, settings, rollout_step)
            if self.plan.num_iterations > 1
            else none
        )
        micro = [
            MicroBatch(m.index, self.plan.attach(m.batch, r, o))
            for m, r, o in zip(micro, reference, old)
        ]
        loss_fn = functools.partial(self._live_loss, settings=settings, rollout_step=rollout_step)
        prefix = self.plan.metric_prefix
        metrics: dict[str, float] = {}
        for iteration in range(self.plan.num_iterations):
            result = self.trainer.train_step(micro, loss_fn)
            if prefix is not None:
                for key, value in result.metrics.items():
                    if key.startswith(prefix) or key in ("loss", "grad_norm"):
                        metrics[f"{key}@iter{iteration}"] = value
            metrics.update(result.metrics)
        metrics["learner/micro_batches"] = float(len(micro))
        metrics["weights_version"] = float(self.roles.sync_rollout())
        metrics.update(rollout.stats)
        return metrics


def _to_device(batch: Any, device: torch.device) -> Any:
    return pytree.tree_map(
        lambda leaf: leaf.to(device) if isinstance(leaf, torch.Tensor) else leaf, batch
    )
