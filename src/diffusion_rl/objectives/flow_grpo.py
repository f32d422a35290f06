"""Flow-GRPO: PPO on the SDE steps of flow-matching rollouts (MATH.md §5).

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
loss (PITFALLS.md: a FastVideo prototype only logged them). The loss is the weighted mean of
``x`` over rows and trained steps: ``WeightedMetric(Σ w x, Σ w)`` per micro-batch, normalised
once by the trainer.

``ℓold`` is the start-of-step snapshot; with one inner iteration it is ``stop_grad(ℓθ)``, so
every ratio is exactly 1 before the update.

Default clip range ``ε = 1e-4``: with mean-reduced log-probs ``δ`` is a per-element average,
so ratios stay within ~1e-4 of 1 and Flow-GRPO calibrates its clip to that. A sum-reduced
trace needs a clip of the order of ``1e-4 × latent elements``.

Advantages (:func:`flow_advantages`): per prompt group ``(r − mean_g) / (std_g + 1e-4)``
(``"group"``) or with the std over the whole batch (``"batch"``, Flow-GRPO's global-std
option; the mean stays per group), population std (ddof 0), clipped to ``±adv_clip`` (5).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from ..contracts import LossOutput, WeightedMetric
from ..kernels import FLOW_LOGPROB_REDUCTIONS

MAX_LOG_RATIO = 20.0


class FlowGRPOConfig(BaseModel):
    """Flow-GRPO settings. ``beta = 0``: no reference model and no reference pass."""

    model_config = ConfigDict(extra="forbid")

    clip_range: float = Field(default=1e-4, gt=0.0, lt=1.0)
    beta: float = Field(default=0.004, ge=0.0, allow_inf_nan=False)
    kl: Literal["exact", "flow_grpo"] = "exact"
    advantage: Literal["group", "batch"] = "group"
    adv_clip: float = Field(default=5.0, gt=0.0)
    std_eps: float = Field(default=1e-4, gt=0.0)
    timestep_fraction: float = Field(default=1.0, gt=0.0, le=1.0)
    num_iterations: int = Field(default=1, ge=1)

    @property
    def uses_reference(self) -> bool:
        return self.beta > 0


def flow_advantages(
    rewards: torch.Tensor,
    *,
    group_size: int | None = None,
    group_ids: torch.Tensor | Sequence[int] | None = None,
    mode: str = "group",
    clip: float = 5.0,
    eps: float = 1e-4,
) -> torch.Tensor:
    """``rewards [B]`` → float32 advantages ``[B]`` (see the module doc).

    Groups are consecutive runs of ``group_size`` rows, or arbitrary ``group_ids [B]`` (rows
    with equal id share a prompt); exactly one of the two.
    """
    if mode not in ("group", "batch"):
        raise ValueError(f"mode: expected 'group' or 'batch', got {mode!r}")
    if (group_size is None) == (group_ids is None):
        raise ValueError("flow_advantages: give exactly one of group_size and group_ids")
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if rewards.dim() != 1:
        raise ValueError(f"rewards: expected [B], got shape {tuple(rewards.shape)}")
    rows = rewards.shape[0]
    if group_size is not None:
        if group_size < 1 or rows % group_size:
            raise ValueError(
                f"group_size: expected a divisor of the batch size {rows}, got {group_size}"
            )
        group_ids = torch.arange(rows) // group_size
    group_ids = torch.as_tensor(group_ids).to(rewards.device)
    if tuple(group_ids.shape) != (rows,):
        raise ValueError(f"group_ids: expected [B={rows}], got {tuple(group_ids.shape)}")
    _, index = torch.unique(group_ids, return_inverse=True)
    zeros = torch.zeros(int(index.max()) + 1, device=rewards.device)
    counts = zeros.index_add(0, index, torch.ones_like(rewards))
    mean = zeros.index_add(0, index, rewards) / counts
    centred = rewards - mean[index]
    if mode == "group":
        var = zeros.index_add(0, index, centred.square()) / counts
        std = var.sqrt()[index]
    else:
        std = rewards.std(correction=0).expand(rows)
    return torch.clamp(centred / (std + eps), -clip, clip)


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
    """``loss(log_prob, advantages=..., ...) -> LossOutput`` for one micro-batch of steps.

    Inputs per row (``[b]`` unless said): ``log_prob`` live ``ℓθ`` (with gradient);
    ``advantages``; ``old_log_prob`` (required when ``num_iterations > 1``);
    ``behaviour_log_prob`` (for the parity diagnostic); when ``beta > 0``: ``mean`` μθ and
    ``ref_mean`` μref ``[b, *latent]``, ``std``, ``sigma``, ``sigma_next``; ``weights``
    (default 1); ``reduction`` of the trace.
    """

    name = "flow_grpo"

    def __init__(self, config: FlowGRPOConfig | None = None) -> None:
        self.config = config or FlowGRPOConfig()

    def metadata(self) -> dict:
        return {"name": self.name, "version": 1, **self.config.model_dump()}

    def __call__(
        self,
        log_prob: torch.Tensor,
        *,
        advantages: torch.Tensor,
        old_log_prob: torch.Tensor | None = None,
        behaviour_log_prob: torch.Tensor | None = None,
        mean: torch.Tensor | None = None,
        ref_mean: torch.Tensor | None = None,
        std: torch.Tensor | None = None,
        sigma: torch.Tensor | None = None,
        sigma_next: torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
        reduction: str = "mean",
    ) -> LossOutput:
        cfg = self.config
        if log_prob.dim() != 1:
            raise ValueError(f"log_prob: expected per-row [b], got shape {tuple(log_prob.shape)}")
        if cfg.num_iterations == 1:
            old = log_prob.detach()
        elif old_log_prob is None:
            raise ValueError(
                "old_log_prob: num_iterations > 1 needs the start-of-step snapshot's log-probs"
            )
        else:
            old = old_log_prob.float()
        advantages = advantages.float()
        weights = torch.ones_like(advantages) if weights is None else weights.float()

        delta = torch.clamp(log_prob - old, -MAX_LOG_RATIO, MAX_LOG_RATIO)
        ratio = torch.exp(delta)
        clipped = torch.clamp(ratio, 1.0 - cfg.clip_range, 1.0 + cfg.clip_range)
        pg = torch.maximum(-advantages * ratio, -advantages * clipped)
        per_row = pg
        kl = None
        if cfg.uses_reference:
            missing = [
                n
                for n, t in (
                    ("mean", mean),
                    ("ref_mean", ref_mean),
                    ("std", std),
                    ("sigma", sigma),
                    ("sigma_next", sigma_next),
                )
                if t is None
            ]
            if missing:
                raise ValueError(f"beta={cfg.beta} > 0: the KL term needs {missing}")
            kl = flow_kl(mean, ref_mean, std, sigma, sigma_next, kind=cfg.kl, reduction=reduction)
            per_row = pg + cfg.beta * kl
        total_w = weights.sum().detach()

        def weighted(x: torch.Tensor) -> WeightedMetric:
            return WeightedMetric((x.detach().float() * weights).sum(), total_w)

        ratio_d = ratio.detach()
        outside = (ratio_d < 1.0 - cfg.clip_range) | (ratio_d > 1.0 + cfg.clip_range)
        clipped_side = ((advantages > 0) & (ratio_d > 1.0 + cfg.clip_range)) | (
            (advantages < 0) & (ratio_d < 1.0 - cfg.clip_range)
        )
        aux: dict = {
            "flow_grpo/pg_loss": weighted(pg),
            "flow_grpo/ratio_mean": weighted(ratio_d),
            "flow_grpo/ratio_min": ratio_d.min(),
            "flow_grpo/ratio_max": ratio_d.max(),
            "flow_grpo/outside_clip_frac": weighted(outside.float()),
            "flow_grpo/clip_frac": weighted(clipped_side.float()),
            "flow_grpo/advantage_abs": weighted(advantages.abs()),
        }
        if kl is not None:
            aux["flow_grpo/kl"] = weighted(kl)
        if behaviour_log_prob is not None:
            parity = (old.detach() - behaviour_log_prob.float()).abs()
            aux["flow_grpo/parity_mean_abs"] = weighted(parity)
            aux["flow_grpo/parity_max_abs"] = parity.max()
        return LossOutput(
            primary=WeightedMetric((per_row * weights).sum(), total_w), aux_metrics=aux
        )
