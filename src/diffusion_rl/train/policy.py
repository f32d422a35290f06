"""The policy learner: one optimisation step of the GRPO family on a rollout batch.

For a rollout sampled with rollout weights v (the trace says which):

1. refuse the trace unless v is the current version (or off-policy use is allowed);
2. split into micro-batches; score the reference (if β is not ``"none"``) and, for μ > 1, the
   start-of-step snapshot on exactly the micro-batches, states and actions the live pass
   will use, under the trainer's precision — stop-gradient;
3. run μ trainer steps; each scores the live actor (with gradient) and applies
   :class:`~diffusion_rl.objectives.grpo.PolicyLoss`; ``ℓold`` stays fixed across them;
4. sync the rollout weights (version v + 1).

Scoring goes through one scorer family for all three policies (exact replay by default, or
packed replay / an approximate estimator for ablations), so live, reference and old policy
always see the same states. Stochastic estimators draw from a generator keyed by
(rollout step, micro-batch), shared by the three passes and all inner iterations.
"""

from __future__ import annotations

import torch

from ..contracts import DiffusionTokenBatch
from ..objectives.grpo import PolicyLoss
from ..rollout import RolloutBatch
from ..scoring.estimators import make_scorer
from ..scoring.replay import ReplayScorer
from .roles import PolicyRoles
from .trainer import Trainer

EXACT_SCORERS = ("exact", "packed")


EXACT_SCORERS = ("exact", "packed")


class PolicyLearner:
    """Owns the trainer for the actor; ``step(rollout)`` → metrics of the step."""

    def __init__(
        self,
        roles: PolicyRoles,
        loss: PolicyLoss,
        trainer_factory,
        *,
        scorer: str = "exact",
        micro_batch_size: int | None = None,
        allow_off_policy: bool = False,
        compute_entropy: bool = True,
        seed: int = 0,
    ) -> None:
        if getattr(roles.actor, "alignment", "same_position") != "same_position":
            raise ValueError(
                "model: its logits are not target-aligned; wrap it with shift_to_target_aligned "
                "in its adapter (scoring never shifts, and never falls back to autoregressive scoring)"
            )
        if loss.config.uses_reference and roles.reference is None:
            raise ValueError(
                f"beta={loss.config.beta}: a reference pass needs PolicyRoles(reference=True)"
            )
        self.roles = roles
        self.loss = loss
        self.scorer_name = scorer
        self.micro_batch_size = micro_batch_size
        self.allow_off_policy = allow_off_policy
        self.compute_entropy = compute_entropy
        self.seed = seed
        self.trainer: Trainer = trainer_factory(roles.actor, self._loss_fn)
        self._settings: dict = {}
        self._iteration = 0
        self._rollout_step = 0

    # ----------------------------------------------------------------- scoring
    def _scorer(self, model, *, live: bool):
        options = dict(self._settings)
        if self.scorer_name in EXACT_SCORERS:
            options.update(stop_gradient=not live, compute_entropy=live and self.compute_entropy)
        else:  # approximate estimators: no kernel pinning, no entropy (frozen passes run under no_grad)
            options.pop("kernel_id")
        return make_scorer(self.scorer_name, model, **options)

    def _generator(self, micro_index: int) -> torch.Generator:
        """Draws of stochastic estimators, keyed by (rollout step, micro-batch): the live pass
        of every inner iteration and the frozen passes see the same masks."""
        return torch.Generator().manual_seed(
            (self.seed * 1_000_003 + self._rollout_step) * 4096 + micro_index
        )

    def _loss_fn(self, model, micro_batch: DiffusionTokenBatch, _generator):
        index = int(micro_batch.model_inputs["micro_index"][0])
        scores = self._scorer(model, live=True).score(micro_batch, self._generator(index))
        return self.loss(scores.logprobs, micro_batch, scores.entropy)

    def _score_frozen(self, model, micro_batches: list[DiffusionTokenBatch]) -> list[torch.Tensor]:
        with self.roles.on_compute(model), torch.no_grad(), self.trainer.autocast():
            scorer = self._scorer(model, live=False)
            return [
                scorer.score(mb, self._generator(i)).logprobs for i, mb in enumerate(micro_batches)
            ]

    # ----------------------------------------------------------------- the step
    def step(self, rollout: RolloutBatch) -> dict[str, float]:
        trace = rollout.trace
        if trace is None:
            raise ValueError("rollout: a diffusion rollout must carry its trace (capture=True)")
        self.roles.check_trace_version(
            trace.weights_version, allow_off_policy=self.allow_off_policy
        )
        self._settings = {
            "temperature": trace.temperature,
            "kernel_id": trace.kernel_ids["token_logprobs"],
        }
        if self.scorer_name == "exact":
            self._settings.update(ReplayScorer.trace_options(trace))
        size = self.micro_batch_size or rollout.batch.batch_size
        micro = rollout.batch.split(size)
        micro = [
            _with_inputs(mb, micro_index=torch.full((mb.batch_size,), i, dtype=torch.long))
            for i, mb in enumerate(micro)
        ]
        cfg = self.loss.config
        self._rollout_step = self.trainer.global_step // cfg.num_iterations
        metrics: dict[str, float] = {}
        for self._iteration in range(cfg.num_iterations):
            if self._iteration == 0:
                extra: list[dict[str, torch.Tensor]] = [{} for _ in micro]
                if cfg.uses_reference:
                    for slot, ref in zip(extra, self._score_frozen(self.roles.reference, micro)):
                        slot["ref_logprobs"] = ref
                if cfg.num_iterations > 1:
                    snapshot = self.roles.take_snapshot()
                    for slot, old in zip(extra, self._score_frozen(snapshot, micro)):
                        slot["old_logprobs"] = old
                micro = [_with_inputs(mb, **slot) for mb, slot in zip(micro, extra)]
            result = self.trainer.train_step(micro)
            for key, value in result.metrics.items():
                if key.startswith("policy/") or key in ("loss", "grad_norm"):
                    metrics[f"{key}@iter{self._iteration}"] = value
            metrics.update(result.metrics)
        self._iteration = 0
        metrics["weights_version"] = float(self.roles.sync_rollout())
        metrics.update(rollout.stats)
        return metrics


def _with_inputs(batch: DiffusionTokenBatch, **extra: torch.Tensor) -> DiffusionTokenBatch:
    return DiffusionTokenBatch(
        {**batch.model_inputs, **extra}, batch.target_ids, batch.loss_weights
    )
