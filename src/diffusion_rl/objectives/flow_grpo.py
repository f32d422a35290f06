"""Flow-GRPO: PPO on the SDE steps of flow-matching rollouts (docs/math.md §5).

For a trained step of row ``b`` (log-probs are per-row reductions over the latent elements,
``"mean"`` by default — the trace's ``reduction``):

    δ   = clip(ℓθ − ℓold, −20, 20),   ρ = exp(δ)
    pg  = max(−A ρ, −A clip(ρ, 1 − ε, 1 + ε))
    kl  = red_d (μθ − μref)_d² / (2 s²),   s = std √(σ − σ_next)     (kl="exact")
        = red_d (μθ − μref)_d² / (2 std²)                           (kl="flow_grpo")
    x   = pg + β kl

``red`` is the trace's reduction: with ``"sum"`` the exact KL between the two step Gaussians
(equal variance s²), with ``"mean"`` its per-element average (the scale of the mean log-prob).
``kl="flow_grpo"`` reproduces Flow-GRPO's code, which divides by 2·std² and so omits the
``σ − σ_next`` factor of the variance. Both the clip and the KL are in the differentiated
loss (docs/pitfalls.md, "PPO terms computed but not differentiated"). The loss is the weighted mean of
``x`` over rows and trained steps: ``WeightedMetric(Σ w x, Σ w)`` per micro-batch, normalised
once by the trainer.

``ℓold`` is the start-of-step snapshot; with one inner iteration it is ``stop_grad(ℓθ)``, so
every ratio is exactly 1 before the update.

Default clip range ``ε = 1e-4``: with mean-reduced log-probs ``δ`` is a per-element average,
so ratios stay within ~1e-4 of 1 and Flow-GRPO calibrates its clip to that. A sum-reduced
trace needs a clip of the order of ``1e-4 × latent elements``.

Advantages (:func:`~diffusion_rl.advantages.group_advantages` with
:attr:`FlowGRPOConfig.advantage_spec`): per prompt group ``(r − mean_g) / (std_g + 1e-4)``
(``"group"``) or with the std over the whole batch (``"batch"``, Flow-GRPO's global-std
option; the mean stays per group), population std (ddof 0), clipped to ``±adv_clip`` (5).

Call shape (every RL objective): ``loss(scores, batch) -> LossOutput`` with ``scores`` the
live :class:`~diffusion_rl.scoring.flow.FlowStepScores` of a
:class:`~diffusion_rl.contracts.FlowStepBatch`.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from ..advantages import AdvantageSpec
from ..contracts import Extreme, FlowStepBatch, LossOutput, WeightedMetric
from ..kernels import FLOW_LOGPROB_REDUCTIONS

MAX_LOG_RATIO = 20.0


class FlowGRPOConfig(BaseModel):
    """Flow-GRPO settings. ``beta = 0``: no reference model and no reference pass. Strict
    types: finite floats, ints that are not bools."""

    model_config = ConfigDict(extra="forbid", strict=True)

    algorithm: Literal["flow_grpo"] = "flow_grpo"
    clip_range: float = Field(default=1e-4, gt=0.0, lt=1.0, allow_inf_nan=False)
    beta: float = Field(default=0.004, ge=0.0, allow_inf_nan=False)
    kl: Literal["exact", "flow_grpo"] = "exact"
    advantage: Literal["group", "batch"] = "group"
    adv_clip: float = Field(default=5.0, gt=0.0, allow_inf_nan=False)
    std_eps: float = Field(default=1e-4, gt=0.0, allow_inf_nan=False)
    timestep_fraction: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    num_iterations: int = Field(default=1, ge=1)

    @property
    def uses_reference(self) -> bool:
        return self.beta > 0

    @property
    def advantage_spec(self) -> AdvantageSpec:
        return AdvantageSpec(scale=self.advantage, ddof=0, eps=self.std_eps, clip=self.adv_clip)


def flow_kl(
    mean: torch.Tensor,
    ref_mean: torch.Tensor,
    std: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    *,
    kind: str = "exact",
    reduction: str = "mean",
) -> torch.Tensor:
    """Per-row KL ``[b]`` between the step Gaussians of the policy and the reference (module
    doc); ``mean``, ``ref_mean`` ``[b, *latent]``; ``std``, ``sigma``, ``sigma_next`` ``[b]``."""
    if reduction not in FLOW_LOGPROB_REDUCTIONS:
        raise ValueError(f"reduction: expected one of {FLOW_LOGPROB_REDUCTIONS}, got {reduction!r}")
    dims = tuple(range(1, mean.dim()))
    square = (mean.float() - ref_mean.float()).square()
    distance = square.mean(dims) if reduction == "mean" else square.sum(dims)
    if kind == "exact":
        variance = std.square() * (sigma - sigma_next)
    elif kind == "flow_grpo":
        variance = std.square()
    else:
        raise ValueError(f"kl: expected 'exact' or 'flow_grpo', got {kind!r}")
    return distance / (2 * variance)


class FlowGRPOLoss:
    """``loss(scores, batch) -> LossOutput`` for one micro-batch of steps.

    ``scores``: the live replay of ``batch`` (``logprobs`` ``ℓθ [b]`` with gradient; ``means``
    ``μθ [b, *latent]`` and ``stds [b]`` for the KL). ``batch`` carries ``advantages``,
    ``behaviour_logprobs`` (the parity diagnostic), ``weights`` (default 1),
    ``old_logprobs`` (required when ``num_iterations > 1``) and, when ``beta > 0``,
    ``ref_means`` and ``sigma`` / ``sigma_next``. ``reduction`` is the trace's (how the
    log-probs reduce over latent elements; the KL reduces the same way).
    """

    name = "flow_grpo"

    def __init__(self, config: FlowGRPOConfig | None = None, *, reduction: str = "mean") -> None:
        if reduction not in FLOW_LOGPROB_REDUCTIONS:
            raise ValueError(
                f"reduction: expected one of {FLOW_LOGPROB_REDUCTIONS}, got {reduction!r}"
            )
        self.config = config or FlowGRPOConfig()
        self.reduction = reduction

    def metadata(self) -> dict:
        return {"name": self.name, "version": 1, **self.config.model_dump(exclude={"algorithm"})}

    def __call__(self, scores, batch: FlowStepBatch) -> LossOutput:
        cfg = self.config
        log_prob = scores.logprobs
        if log_prob.dim() != 1:
            raise ValueError(f"logprobs: expected per-row [b], got shape {tuple(log_prob.shape)}")
        if batch.advantages is None:
            raise ValueError("advantages: the batch carries none; prepare it with advantages")
        if cfg.num_iterations == 1:
            old = log_prob.detach()
        elif batch.old_logprobs is None:
            raise ValueError(
                "old_logprobs: num_iterations > 1 needs the start-of-step snapshot's log-probs"
            )
        else:
            old = batch.old_logprobs.float()
        advantages = batch.advantages.float()
        weights = torch.ones_like(advantages) if batch.weights is None else batch.weights.float()

        delta = torch.clamp(log_prob - old, -MAX_LOG_RATIO, MAX_LOG_RATIO)
        ratio = torch.exp(delta)
        clipped = torch.clamp(ratio, 1.0 - cfg.clip_range, 1.0 + cfg.clip_range)
        pg = torch.maximum(-advantages * ratio, -advantages * clipped)
        per_row = pg
        kl = None
        if cfg.uses_reference:
            if batch.ref_means is None:
                raise ValueError(f"ref_means: beta={cfg.beta} > 0, the KL term needs them")
            kl = flow_kl(
                scores.means,
                batch.ref_means,
                scores.stds,
                batch.sigma,
                batch.sigma_next,
                kind=cfg.kl,
                reduction=self.reduction,
            )
            per_row = pg + cfg.beta * kl
        total_w = weights.sum().detach()

        def weighted(x: torch.Tensor) -> WeightedMetric:
            return WeightedMetric((x.detach().float() * weights).sum(), total_w)

        ratio_d = ratio.detach()
        outside = (ratio_d < 1.0 - cfg.clip_range) | (ratio_d > 1.0 + cfg.clip_range)
        clipped_side = ((advantages > 0) & (ratio_d > 1.0 + cfg.clip_range)) | (
            (advantages < 0) & (ratio_d < 1.0 - cfg.clip_range)
        )
        parity = (old.detach() - batch.behaviour_logprobs.float()).abs()
        aux: dict = {
            "flow_grpo/pg_loss": weighted(pg),
            "flow_grpo/ratio_mean": weighted(ratio_d),
            "flow_grpo/ratio_min": Extreme(ratio_d.min(), "min"),
            "flow_grpo/ratio_max": Extreme(ratio_d.max()),
            "flow_grpo/outside_clip_frac": weighted(outside.float()),
            "flow_grpo/clip_frac": weighted(clipped_side.float()),
            "flow_grpo/advantage_abs": weighted(advantages.abs()),
            "flow_grpo/parity_mean_abs": weighted(parity),
            "flow_grpo/parity_max_abs": Extreme(parity.max()),
        }
        if kl is not None:
            aux["flow_grpo/kl"] = weighted(kl)
        return LossOutput(
            primary=WeightedMetric((per_row * weights).sum(), total_w), aux_metrics=aux
        )
