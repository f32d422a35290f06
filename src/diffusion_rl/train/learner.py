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
6. where the plan bounds the step (``max_step_kl`` κ, the token GRPO family), measures how
   far the μ steps moved the policy the sampler runs, D = KL(π_before ‖ π_after) per action
   on the rollout's own actions (:meth:`bound_step`), and when D > κ pulls the actor back
   along the step to ``θ_before + √(κ / D) · (θ_after − θ_before)``: a trust region that
   binds at μ = 1, where every ratio is 1 and no clip can;
7. syncs the rollout weights (version v + 1): a copy of the actor, or, for plans whose old
   policy lags (``rollout_decay``), a moving average toward it.

Live, reference and old policy are scored by the same plan on the same micro-batches, so they
see the same states, actions and shapes: before any update the ratio is 1 and the parity
``|ℓold − ℓβ|`` is 0.

A world plugs in through a :class:`LearnerPlan` (see :mod:`diffusion_rl.train.plans`): the
token GRPO family, Flow-GRPO, on-policy distillation and the forward-process flow methods
(DiffusionNFT, AWM, DGPO; their old policy is the rollout weights themselves, scored when
``uses_rollout_weights``) are four small plans on this one loop. Everything a step needs
passes through arguments: ``pin`` returns the settings, the micro-batch index travels with
its batch. Stochastic estimators draw per row from keys the
plan attaches (trace seed, rollout step), so every pass, inner iteration and micro-batch split
sees the same draws; the per-micro-batch generator serves only keyless estimators.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils import _pytree as pytree

from ..contracts import LossOutput
from ..trace import StageMismatchError
from .parallel import local_tensor
from .roles import PolicyRoles, StaleTraceError
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
    * ``uses_rollout_weights``: also score ``roles.rollout`` (the weights that sampled the
      rollout: the old policy of the forward-process flow methods) and attach it.
    * ``attach(batch, reference, old, sampler) -> Batch``: the frozen scores (or None) into
      the batch (``old``: the start-of-step snapshot; ``sampler``: the rollout weights).
    * ``loss(scores, batch) -> LossOutput``.
    * ``rollout_decay(step) -> float``: how the rollout weights follow the actor after learner
      step ``step``: 0 copies them, ``d > 0`` makes them ``d · rollout + (1 − d) · actor``.
    * optional ``max_step_kl`` (None: unbounded) and ``step_divergence(model, batch,
      settings) -> (kl_sum, weight_sum)``: the bound on one step's policy change, and that
      change on one micro-batch (see :meth:`PolicyLearner.bound_step`).
    """

    num_iterations: int
    uses_reference: bool
    uses_rollout_weights: bool
    metric_prefix: str | None

    def check(self, roles: PolicyRoles) -> None: ...

    def pin(self, trace: Any) -> Any: ...

    def batches(
        self, rollout: Any, settings: Any, *, rollout_step: int, micro_batch_size: int | None
    ) -> list[Any]: ...

    def score(
        self, model: torch.nn.Module, batch: Any, settings: Any, *, live: bool, generator
    ) -> Any: ...

    def attach(
        self, batch: Any, reference: Any | None, old: Any | None, sampler: Any | None
    ) -> Any: ...

    def loss(self, scores: Any, batch: Any) -> LossOutput: ...

    def rollout_decay(self, step: int) -> float: ...


@dataclass(frozen=True)
class MicroBatch:
    """A training batch, its position in the step and the stage (trainer part) it trains
    (``""``: a single-stage learner). A pytree: the trainer moves ``batch``."""

    index: int
    batch: Any
    part: str = ""
    ghost: bool = False  # padding under several processes: its loss counts ×0


pytree.register_dataclass(MicroBatch, serialized_type_name="diffusion_rl.train.learner.MicroBatch")


@dataclass(frozen=True)
class LearnerStage:
    """One trained stage of a workflow: its roles (actor, reference, snapshot, rollout
    weights with their own version) and its plan."""

    roles: PolicyRoles
    plan: LearnerPlan


class PolicyLearner:
    """Owns the actor's trainer; ``step(rollout)`` → the step's metrics.

    ``trainer_factory(model, loss_fn) -> Trainer`` (the learner passes its loss per step).
    ``micro_batch_size``: rows per micro-batch where the plan splits by rows (None: one).
    ``seed`` keys the draws of stochastic scorers: ``(seed, rollout step, micro-batch)``.

    :meth:`staged` builds the learner of a multi-stage workflow: one stage per trained model,
    each with its own roles and plan, trained by one trainer over their actors (one part per
    stage: own optimizer settings, LR schedule and clip, each stage's loss normalised over its
    own micro-batches); :meth:`step_stages` takes one rollout per stage.
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
        self._setup(
            {"": LearnerStage(roles, plan)},
            lambda: trainer_factory(roles.actor, None),
            micro_batch_size=micro_batch_size,
            allow_off_policy=allow_off_policy,
            seed=seed,
        )

    @classmethod
    def staged(
        cls,
        stages: dict[str, LearnerStage],
        trainer_factory,
        *,
        micro_batch_size: int | None = None,
        allow_off_policy: bool = False,
        seed: int = 0,
    ) -> PolicyLearner:
        """A learner of several stages; ``trainer_factory(actors: nn.ModuleDict) -> Trainer``
        must build a trainer with one part per stage (``Trainer(..., parts=...)``)."""
        if not stages or any(not isinstance(name, str) or not name for name in stages):
            raise ValueError(
                f"stages: expected a non-empty dict of named stages, got {list(stages)}"
            )
        learner = cls.__new__(cls)
        actors = torch.nn.ModuleDict({name: stage.roles.actor for name, stage in stages.items()})
        learner._setup(
            dict(stages),
            lambda: trainer_factory(actors),
            micro_batch_size=micro_batch_size,
            allow_off_policy=allow_off_policy,
            seed=seed,
        )
        if set(learner.trainer.parts) != set(stages):
            raise ValueError(
                f"trainer_factory: its trainer has parts {list(learner.trainer.parts)}, the "
                f"stages are {list(stages)}; build it with parts={{stage: OptimConfig}}"
            )
        return learner

    def _setup(self, stages, make_trainer, *, micro_batch_size, allow_off_policy, seed) -> None:
        iterations = {stage.plan.num_iterations for stage in stages.values()}
        if len(iterations) != 1:
            raise ValueError(
                f"num_iterations: the stages' plans take {sorted(iterations)} inner iterations; "
                "one learner step runs the same number for every stage"
            )
        for name, stage in stages.items():
            if stage.plan.uses_reference and stage.roles.reference is None:
                raise ValueError(
                    f"{name + ': ' if name else ''}reference: this objective scores a reference "
                    "model; build the roles with PolicyRoles(actor, reference=True) (or the "
                    "teacher, for distillation)"
                )
            stage.plan.check(stage.roles)
        self.stages: dict[str, LearnerStage] = stages
        self.num_iterations = iterations.pop()
        self.micro_batch_size = micro_batch_size
        self.allow_off_policy = allow_off_policy
        self.seed = seed
        self.trainer: Trainer = make_trainer()
        parallel = self.trainer.parallel
        if parallel is not None:
            for name, stage in stages.items():
                stage.roles.shard(
                    parallel, self.trainer.model[name] if name else self.trainer.model
                )

    @property
    def roles(self) -> PolicyRoles:
        """The roles of a single-stage learner."""
        return self._single().roles

    @property
    def plan(self) -> LearnerPlan:
        """The plan of a single-stage learner."""
        return self._single().plan

    def _single(self) -> LearnerStage:
        if list(self.stages) != [""]:
            raise AttributeError(
                f"this learner has stages {list(self.stages)}: use learner.stages[name]"
            )
        return self.stages[""]

    @property
    def rollout_step(self) -> int:
        """Learner steps taken (each is μ trainer steps)."""
        return self.trainer.global_step // self.num_iterations

    def generator(self, rollout_step: int, index: int) -> torch.Generator:
        """The draws of micro-batch ``index`` at ``rollout_step``: shared by the reference,
        snapshot and live passes and by every inner iteration."""
        return torch.Generator().manual_seed((self.seed * _KEY_MIX + rollout_step) * 4096 + index)

    def _live_loss(self, model, micro: MicroBatch, _generator, *, settings, rollout_step: int):
        stage = self.stages[micro.part]
        generator = self.generator(rollout_step, micro.index)
        module = model[micro.part] if micro.part else model
        scores = stage.plan.score(
            module, micro.batch, settings[micro.part], live=True, generator=generator
        )
        out = stage.plan.loss(scores, micro.batch)
        if not micro.part:
            return out
        aux = {f"{micro.part}/{key}": value for key, value in out.aux_metrics.items()}
        return LossOutput(primary=out.primary, aux_metrics=aux)

    def _score_frozen(
        self, roles: PolicyRoles, plan, model, micro: list[MicroBatch], settings, rollout_step: int
    ) -> list:
        device = roles.compute_device
        with roles.on_compute(model), torch.no_grad(), self.trainer.autocast():
            return [
                plan.score(
                    model,
                    _to_device(m.batch, device),
                    settings,
                    live=False,
                    generator=self.generator(rollout_step, m.index),
                )
                for m in micro
            ]

    def _pad(self, name: str, own: list[MicroBatch]) -> list[MicroBatch]:
        """Under several processes, the stage's micro-batches padded with ghosts to the most
        any rank has (the frozen roles' sharded passes are collectives too)."""
        world = self.trainer.world
        if not world.distributed:
            return own
        most = world.max(len(own))
        if not own:
            raise RuntimeError(
                f"rank {world.rank}: stage {name or 'policy'!r} has no rows to train while "
                f"another rank has {most} micro-batches; the rollout must leave every rank a row"
            )
        last = own[-1]
        return own + [
            MicroBatch(last.index + k + 1, last.batch, name, True) for k in range(most - len(own))
        ]

    def check_trace(self, name: str, trace) -> None:
        """Refuse a trace this stage did not sample, or sampled with other weights (unless
        off-policy use is allowed): :class:`StageMismatchError` /
        :class:`~diffusion_rl.train.roles.StaleTraceError`, naming stage and versions."""
        stage = self.stages[name]
        sampled_by = getattr(trace, "stage", "")
        if sampled_by != name:
            raise StageMismatchError(
                f"stage {name!r}: the trace was sampled by stage {sampled_by!r} (rollout weights "
                f"v{trace.weights_version}); this stage is at v{stage.roles.version}; hand each "
                "stage the trace its own rollout weights sampled"
            )
        try:
            stage.roles.check_trace_version(
                trace.weights_version, allow_off_policy=self.allow_off_policy
            )
        except StaleTraceError as error:
            if not name:
                raise
            raise StaleTraceError(f"stage {name!r}: {error}") from None

    def _per_iteration(self, key: str, prefixes: set[str]) -> bool:
        """Whether a trainer metric is also logged per inner iteration: the objectives' own
        keys (``flow_grpo/...``, or ``STAGE/flow_grpo/...``), the loss and the grad norm."""
        head, _, rest = key.partition("/")
        bare = rest if head in self.stages else key
        return (
            bare.startswith(tuple(prefixes))
            or bare in ("loss", "grad_norm")
            or head in ("loss", "grad_norm")
        )

    def step_divergence(self, name: str, micro: list[MicroBatch], settings) -> float:
        """KL(π_before ‖ π_now) per action of stage ``name``'s rollout (its micro-batches
        ``micro``), summed over every rank's actions: the plan's estimate, with the actor as
        it is now, without gradient, under the trainer's precision."""
        stage = self.stages[name]
        module = self.trainer.model[name] if name else self.trainer.model
        device = stage.roles.compute_device
        totals = [0.0, 0.0]
        training = module.training
        module.eval()  # as the rollout weights sampled
        try:
            with torch.no_grad(), self.trainer.autocast():
                for m in micro:
                    batch = _to_device(m.batch, device)
                    kl, weight = stage.plan.step_divergence(module, batch, settings)
                    if not m.ghost:
                        totals[0] += kl
                        totals[1] += weight
        finally:
            module.train(training)
        kl, weight = self.trainer.world.sum(totals)
        return kl / weight if weight > 0 else 0.0

    def bound_step(self, name: str, before, micro: list[MicroBatch], settings) -> dict:
        """The trust region of one step (plans with ``max_step_kl`` κ): D = the step's
        divergence (:meth:`step_divergence`); when D > κ every trained weight is pulled back
        to ``θ_before + s · (θ − θ_before)``, ``s = √(κ / D)`` (a KL grows with the square of
        a small step), and D is measured again. ``before``: the start-of-step snapshot (sharded
        like the actor under several processes, so shards pull back locally). The optimizer's
        state is left as the step made it. Returns ``step_kl`` (D after the bound),
        ``step_kl_unbounded`` and ``step_scale`` s (1: the bound did not bind)."""
        bound = _bound(self.stages[name].plan)
        module = self.trainer.model[name] if name else self.trainer.model
        divergence = self.step_divergence(name, micro, settings)
        result = {"step_kl_unbounded": divergence, "step_scale": 1.0, "step_kl": divergence}
        if divergence <= bound:
            return result
        scale = math.sqrt(bound / divergence)
        _reshard(module)  # under FSDP: the shards are the weights (drop gathered copies)
        olds = dict(before.named_parameters())
        with torch.no_grad():
            for key, param in module.named_parameters():
                if param.requires_grad and olds[key] is not param:
                    mine, old = local_tensor(param), local_tensor(olds[key])
                    mine.lerp_(old.to(mine.device), 1.0 - scale)
        result["step_scale"] = scale
        result["step_kl"] = self.step_divergence(name, micro, settings)
        return result

    def step(self, rollout) -> dict[str, float]:
        """One optimisation step (μ inner iterations) on ``rollout``; syncs the rollout
        weights. Returns the trainer's metrics (per inner iteration for the objective's keys),
        ``weights_version`` and the rollout's stats."""
        return self.step_stages({"": rollout})

    def step_stages(self, rollouts: dict[str, Any]) -> dict[str, float]:
        """One step on one rollout per stage (keys: the stage names). Every trace is checked
        (:meth:`check_trace`) before any work. Metrics of a staged learner carry the stage as
        a prefix (``video/flow_grpo/ratio_mean``, ``video/weights_version``,
        ``grad_norm/video``)."""
        if set(rollouts) != set(self.stages):
            raise ValueError(
                f"rollouts: expected one per stage {list(self.stages)}, got {list(rollouts)}"
            )
        for name in self.stages:
            self.check_trace(name, rollouts[name].trace)
        rollout_step = self.rollout_step
        settings: dict[str, Any] = {}
        micro: list[MicroBatch] = []
        for name, stage in self.stages.items():
            roles, plan = stage.roles, stage.plan
            settings[name] = plan.pin(rollouts[name].trace)
            batches = plan.batches(
                rollouts[name],
                settings[name],
                rollout_step=rollout_step,
                micro_batch_size=self.micro_batch_size,
            )
            ghost = bool(getattr(rollouts[name], "ghost", False))
            own = [MicroBatch(len(micro) + i, b, name, ghost) for i, b in enumerate(batches)]
            own = self._pad(name, own)
            none = [None] * len(own)
            reference = (
                self._score_frozen(roles, plan, roles.reference, own, settings[name], rollout_step)
                if plan.uses_reference
                else none
            )
            old = (
                self._score_frozen(
                    roles, plan, roles.take_snapshot(), own, settings[name], rollout_step
                )
                if self.num_iterations > 1
                else none
            )
            sampler = (
                self._score_frozen(roles, plan, roles.rollout, own, settings[name], rollout_step)
                if plan.uses_rollout_weights
                else none
            )
            micro += [
                MicroBatch(m.index, plan.attach(m.batch, r, o, s), name, m.ghost)
                for m, r, o, s in zip(own, reference, old, sampler)
            ]
        bounded = [name for name, stage in self.stages.items() if _bound(stage.plan) is not None]
        before = {name: self.stages[name].roles.take_snapshot() for name in bounded}
        loss_fn = functools.partial(self._live_loss, settings=settings, rollout_step=rollout_step)
        prefixes = {stage.plan.metric_prefix for stage in self.stages.values()} - {None}
        metrics: dict[str, float] = {}
        for iteration in range(self.num_iterations):
            result = self.trainer.train_step(micro, loss_fn)
            if prefixes:
                for key, value in result.metrics.items():
                    if self._per_iteration(key, prefixes):
                        metrics[f"{key}@iter{iteration}"] = value
            metrics.update(result.metrics)
        for name in bounded:
            tag = f"{name}/" if name else ""
            own = [m for m in micro if m.part == name]
            bound = self.bound_step(name, before[name], own, settings[name])
            metrics.update({f"{tag}learner/{key}": value for key, value in bound.items()})
        for name, stage in self.stages.items():
            tag = f"{name}/" if name else ""
            count = sum(m.part == name and not m.ghost for m in micro)
            count = self.trainer.world.sum([count])[0]  # every rank's (one process: its own)
            metrics[f"{tag}learner/micro_batches"] = float(count)
            decay = stage.plan.rollout_decay(rollout_step + 1)
            metrics[f"{tag}weights_version"] = float(stage.roles.sync_rollout(decay))
            if decay:
                metrics[f"{tag}learner/old_policy_decay"] = decay
            metrics.update({f"{tag}{k}": v for k, v in rollouts[name].stats.items()})
        return metrics


def _reshard(module: torch.nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


def _bound(plan) -> float | None:
    return getattr(plan, "max_step_kl", None)


def _to_device(batch: Any, device: torch.device) -> Any:
    return pytree.tree_map(
        lambda leaf: leaf.to(device) if isinstance(leaf, torch.Tensor) else leaf, batch
    )
