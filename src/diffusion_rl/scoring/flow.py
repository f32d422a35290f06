"""Exact replay of flow rollouts: the log-prob of each trained SDE step, recomputed.

docs/math.md §5. For SDE step ``k`` of a row the learner needs
``ℓ_k(θ) = log p_θ(latents[k+1] | latents[k])``. The replay

1. takes ``latents[:, k]`` exactly as stored (the tensor the sampler continued from);
2. recomputes the velocity with the trace's guidance scale through the function the sampler
   uses, :func:`~diffusion_rl.guidance.guided_velocity` (one batched CFG forward, float32
   combination), on the rows of one sampler forward group, so shapes are the sampler's;
3. calls the SDE kernel looked up **by the id recorded in the trace**
   (:class:`~diffusion_rl.kernels.KernelUnavailableError`, naming it, when this installation
   lacks it) with ``prev_sample = latents[:, k+1]`` → ``logprobs [b]``, ``means``, ``stds``.

``score(batch)`` scores one :class:`~diffusion_rl.contracts.FlowStepBatch` (what the learner
calls, like the token world's ``ReplayScorer.score(batch)``); ``score_trace(trace, steps)``
replays whole traces.

Told what to expect (``stage=``, ``weights_version=``), the scorer refuses a trace that another
stage sampled (:class:`~diffusion_rl.trace.StageMismatchError`) or that other rollout weights
sampled (:class:`~diffusion_rl.trace.StaleTraceError`), naming the stage and both versions,
before it replays anything (:meth:`FlowReplayScorer.check_trace`; the learner's own check,
``PolicyLearner.check_trace``, raises the same types). Without it, two stages with equal
latent shapes would replay each other's traces silently.

At the behaviour weights, under the sampler's precision, the replayed log-probs equal the
trace's bitwise (the parity diagnostic): same tensors in, same kernels, same shapes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..contracts import FlowStepBatch
from ..guidance import guided_velocity
from ..kernels import KERNELS
from ..models.protocol import VelocityModel
from ..trace import FlowTrace, StageMismatchError, StaleTraceError

SETTINGS = ("guidance_scale", "noise_level", "variant", "reduction", "kernel_id")


@dataclass(frozen=True)
class FlowStepScores:
    """One replayed step: ``logprobs`` float32 ``[b]``, ``means`` float32 ``[b, *latent]`` (μθ
    of the step's Gaussian), ``stds`` float32 ``[b]`` (its diffusion coefficient; the
    Gaussian's scale is ``std √(σ − σ_next)``)."""

    logprobs: torch.Tensor
    means: torch.Tensor
    stds: torch.Tensor


@dataclass(frozen=True)
class FlowScores:
    """Scores of ``steps`` (S of them) for every row: ``logprobs`` / ``stds`` float32
    ``[B, S]``, ``means`` ``[B, S, *latent]`` when requested."""

    steps: list[int]
    logprobs: torch.Tensor
    stds: torch.Tensor
    means: torch.Tensor | None


class FlowReplayScorer:
    """Replays SDE steps of flow traces with ``model``.

    Settings (what the rollout used; :meth:`for_trace` reads them from a trace):
    ``guidance_scale``, ``noise_level``, ``variant``, ``reduction`` and the SDE ``kernel_id``.
    ``stop_gradient=True`` scores without building a graph (reference / old policy).
    ``stage`` / ``weights_version``: the workflow stage and the rollout weights version whose
    traces this scorer replays (None: not checked); a trace of another is refused
    (:meth:`check_trace`).
    """

    def __init__(
        self,
        model: VelocityModel,
        *,
        guidance_scale: float,
        noise_level: float,
        variant: str,
        reduction: str,
        kernel_id: str,
        stop_gradient: bool = False,
        stage: str | None = None,
        weights_version: int | None = None,
    ) -> None:
        if stage is not None and not isinstance(stage, str):
            raise TypeError(
                f"stage: expected the name of the workflow stage whose traces this scorer "
                f"replays (a str, '' outside workflows) or None, got {type(stage).__name__}"
            )
        if weights_version is not None and (
            isinstance(weights_version, bool)
            or not isinstance(weights_version, int)
            or weights_version < 0
        ):
            raise ValueError(
                f"weights_version: expected the rollout weights version this scorer replays "
                f"(an int >= 0) or None, got {weights_version!r}"
            )
        kernel = KERNELS.get(kernel_id)
        if kernel.op != "flow_sde_step":
            raise ValueError(
                f"kernel_id: {kernel_id!r} implements {kernel.op!r}, not flow_sde_step"
            )
        self.model = model
        self.kernel = kernel
        self.settings = {
            "guidance_scale": float(guidance_scale),
            "noise_level": float(noise_level),
            "variant": variant,
            "reduction": reduction,
            "kernel_id": kernel_id,
        }
        self.stop_gradient = stop_gradient
        self.stage = stage
        self.weights_version = weights_version

    def check_trace(self, trace: FlowTrace) -> None:
        """Refuse a trace that does not carry the stage (:class:`StageMismatchError`) or the
        rollout weights version (:class:`StaleTraceError`) this scorer was told to expect;
        an expectation left None, or a trace without the field, is not checked."""
        sampled_by = getattr(trace, "stage", None)
        version = getattr(trace, "weights_version", None)
        if self.stage is not None and sampled_by is not None and sampled_by != self.stage:
            raise StageMismatchError(
                f"stage: the trace was sampled by stage {sampled_by!r} (rollout weights "
                f"v{version}); this scorer replays stage {self.stage!r}; hand each stage's "
                "scorer the traces its own rollout weights sampled"
            )
        if (
            self.weights_version is not None
            and version is not None
            and version != self.weights_version
        ):
            where = f" of stage {self.stage!r}" if self.stage else ""
            raise StaleTraceError(
                f"weights_version: the trace was sampled with rollout weights v{version}, this "
                f"scorer{where} replays v{self.weights_version}; sample fresh rollouts, or "
                "build the scorer for the trace's version"
            )

    @staticmethod
    def trace_settings(trace: FlowTrace) -> dict:
        """The replay settings a trace recorded."""
        if "flow_sde_step" not in trace.kernel_ids:
            raise ValueError(
                "trace: it has no SDE steps (an ODE / serving trace), so nothing to replay; "
                "sample with mode='sde'"
            )
        return {
            "guidance_scale": trace.guidance_scale,
            "noise_level": trace.noise_level,
            "variant": trace.variant,
            "reduction": trace.reduction,
            "kernel_id": trace.kernel_ids["flow_sde_step"],
        }

    @classmethod
    def for_trace(cls, model: VelocityModel, trace: FlowTrace, **options) -> FlowReplayScorer:
        """A scorer with the settings ``trace`` recorded; ``options``: ``stop_gradient``,
        ``stage``, ``weights_version`` (the trace is checked against the last two at once)."""
        scorer = cls(model, **cls.trace_settings(trace), **options)
        scorer.check_trace(trace)
        return scorer

    def _context(self):
        return torch.no_grad() if self.stop_gradient else contextlib.nullcontext()

    def score(self, batch: FlowStepBatch) -> FlowStepScores:
        """Replay one :class:`~diffusion_rl.contracts.FlowStepBatch` (one forward group, one
        step)."""
        s = self.settings
        if (batch.uncond is None) != (s["guidance_scale"] == 1.0):
            raise ValueError(
                f"uncond: guidance_scale={s['guidance_scale']} needs the unconditional "
                "conditioning exactly when it is not 1"
            )
        with self._context():
            v = guided_velocity(
                self.model,
                batch.latents,
                batch.sigma,
                batch.cond,
                batch.uncond,
                s["guidance_scale"],
            )
            _, log_prob, mean, std = self.kernel.fn(
                batch.latents,
                v,
                batch.sigma,
                batch.sigma_next,
                noise_level=s["noise_level"],
                prev_sample=batch.next_latents,
                variant=s["variant"],
                reduction=s["reduction"],
            )
        return FlowStepScores(log_prob, mean, std)

    def score_trace(
        self, trace: FlowTrace, steps: Sequence[int] | None = None, *, return_means: bool = False
    ) -> FlowScores:
        """Replay ``steps`` (default: every SDE step) of every row, forward group by forward
        group as the sampler ran them. A trace of another stage or version than the one the
        scorer expects is refused first (:meth:`check_trace`)."""
        self.check_trace(trace)
        recorded = self.trace_settings(trace)
        for key in SETTINGS:
            if recorded[key] != self.settings[key]:
                raise ValueError(
                    f"{key}: the trace was sampled with {recorded[key]!r}, this scorer replays "
                    f"with {self.settings[key]!r}; build it with FlowReplayScorer.for_trace"
                )
        steps = trace.sde_step_indices() if steps is None else [int(k) for k in steps]
        parts: dict[int, list[tuple[torch.Tensor, FlowStepScores]]] = {k: [] for k in steps}
        for batch in trace.prepare(steps):
            parts[batch.step].append((batch.rows, self.score(batch)))
        logprobs, stds, means = [], [], []
        for k in steps:
            rows = torch.cat([r for r, _ in parts[k]])
            logprobs.append(_in_trace_order(rows, [sc.logprobs for _, sc in parts[k]]))
            stds.append(_in_trace_order(rows, [sc.stds for _, sc in parts[k]]))
            if return_means:
                means.append(_in_trace_order(rows, [sc.means for _, sc in parts[k]]))
        return FlowScores(
            steps,
            torch.stack(logprobs, 1),
            torch.stack(stds, 1),
            torch.stack(means, 1) if return_means else None,
        )


def _in_trace_order(rows: torch.Tensor, values: list[torch.Tensor]) -> torch.Tensor:
    """``values`` of the forward groups, concatenated (their rows: ``rows``, a permutation of
    the trace's rows), put back in trace row order; keeps the graph."""
    inverse = torch.empty_like(rows)
    inverse[rows] = torch.arange(rows.shape[0])
    joined = torch.cat(values)
    return joined[inverse.to(joined.device)]
