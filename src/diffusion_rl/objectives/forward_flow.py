"""Forward-process flow RL: DiffusionNFT, AWM and DGPO (docs/math.md §5.8).

These methods never score the sampler's steps. A rollout contributes its clean samples
``x0`` (the final latent of any sampler — the serving ODE sampler by default), their
conditioning and their group advantages; training noises each ``x0`` again by the forward
process at ``K`` drawn timesteps, ``x_σ = (1 − σ) x0 + σ ε``, and compares velocities there
(:class:`~diffusion_rl.contracts.FlowForwardBatch`, one item per (row, slot)). With the
flow-matching target ``u = ε − x0`` and ``mean_d`` the mean over latent elements:

**DiffusionNFT** (``algorithm: nft``). ``r = clamp(½ + ½ clip(A, ±c) / c, 0, 1)``
(c = ``adv_clip``) is the sample's probability of being "good"; with the old policy's
velocity ``v_old`` the implicit positive and negative policies are
``v⁺ = β vθ + (1 − β) v_old`` and ``v⁻ = (1 + β) v_old − β vθ``, their clean-sample
predictions ``x̂± = x_σ − σ v±``, each weighted adaptively by ``w± = max(mean_d |x̂± − x0|,
1e-5)`` (detached, float64), and

    loss = c · [r · mean_d (x̂⁺ − x0)² / w⁺ + (1 − r) · mean_d (x̂⁻ − x0)² / w⁻] / β
           + kl_beta · mean_d (vθ − v_ref)².

At ``vθ = v_old`` its gradient is ``∝ (2r − 1)`` times the x0-prediction regression
toward the sample: good samples are fitted, bad ones pushed away.

**AWM** (``algorithm: awm``). The flow-matching error ``e = mean_d (vθ − u)²`` (float64) is
the likelihood surrogate, ``ℓ = −e`` (``weighting: uniform``), ``−σ e`` (``"sigma"``) or
the generalised Huber ``−σ ((e + δ)^p − δ^p) / p`` (``"ghuber"``, p = ``huber_p``, δ =
1e-10); with ``ρ = exp(ℓθ − ℓold)`` against the start-of-step policy (μ = 1:
``stop_grad(ℓθ)``, so ρ is exactly 1 and the gradient is ``−Ã ∇ℓθ``) and ``Ã = clip(A,
±c) / c``,

    loss = max(−Ã ρ, −Ã clip(ρ, 1 − ε, 1 + ε)) + kl_beta · mean_d (vθ − v_ref)²
           + ema_beta · mean_d (vθ − v_old)².

**DGPO** (``algorithm: dgpo``). Denoising errors ``e_θ, e_ref, e_old`` (``mean_d (v − u)²``)
at one shared (σ, ε) per group and slot; a group preference ``S = dpo_beta · Σ_{i∈g} A_i
(sg(e_θ,i) − e_ref,i) / G`` whose detached weight ``σ(S)`` scales each item, and PPO-style
freezing of items that moved past ``ρ = exp(e_old − e_θ)``'s clip on their advantage's
side:

    loss_i = σ(S_g) · A_i · ê_θ,i + kl_beta · mean_d (vθ − v_ref)²,
    ê_θ,i = sg(e_θ,i) if (A_i > 0 and ρ_i > 1 + ε) or (A_i ≤ 0 and ρ_i < 1 − ε) else e_θ,i.

Its gradient is that of the group Bradley–Terry loss ``−log σ(−S_g)`` up to the constant
``dpo_beta / G``; it needs every member of a group in one micro-batch (the plan splits so).

The *old policy* ``v_old`` is the rollout weights (:class:`~diffusion_rl.train.roles
.PolicyRoles`), which here lag the actor as an exponential moving average:
after learner step ``n`` they become ``d·old + (1 − d)·θ`` with
``d = min(old_decay_rate · n, old_decay_max)`` (:func:`old_policy_decay`; d = 0 is a copy).
So the samples are always the old policy's own and the trace's weights version names them.

Every loss is the weighted mean over items, ``WeightedMetric(Σ w loss, Σ w)``, normalised
once by the trainer. Call shape (every RL objective): ``loss(scores, batch) -> LossOutput``
with ``scores`` the live :class:`ForwardScores` of the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..advantages import AdvantageSpec
from ..contracts import Extreme, FlowForwardBatch, LossOutput, WeightedMetric
from ..seeding import RowStreams

FORWARD_ALGORITHMS = ("nft", "awm", "dgpo")
WEIGHT_FLOOR = 1e-5  # NFT's adaptive weights never drop below it
HUBER_DELTA = 1e-10
MAX_LOG_RATIO = 20.0


class ForwardFlowConfig(BaseModel):
    """Settings every forward-process method shares.

    * ``timesteps_per_sample`` K items per row; ``sigma_sampling``: ``"grid"`` (K distinct
      σ of the rollout's own schedule, σ = 0 excluded), ``"stratified"`` (one σ of the grid
      per K equal strata, AWM) or ``"uniform"`` (continuous); ``timestep_range``: the
      fraction of the grid, from its noisy end, they are drawn from (uniform: σ ∈ (1 −
      range, 1]); ``shared_timesteps`` / ``shared_noise``: the rows of a prompt group share
      their σ / ε draws (one process only).
    * advantages as Flow-GRPO's (``advantage``, ``adv_clip``, ``std_eps``; ddof 0).
    * ``kl_beta``: weight of ``mean_d (vθ − v_ref)²`` (> 0: a reference pass).
    * ``old_decay_rate`` / ``old_decay_max``: the old policy's decay ramp (module doc).
    * ``num_iterations`` μ learner passes over one rollout.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    timesteps_per_sample: int = Field(default=4, ge=1)
    sigma_sampling: Literal["grid", "stratified", "uniform"] = "grid"
    timestep_range: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    shared_timesteps: bool = False
    shared_noise: bool = False
    advantage: Literal["group", "batch"] = "group"
    adv_clip: float = Field(default=5.0, gt=0.0, allow_inf_nan=False)
    std_eps: float = Field(default=1e-4, gt=0.0, allow_inf_nan=False)
    kl_beta: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    old_decay_rate: float = Field(default=0.001, ge=0.0, allow_inf_nan=False)
    old_decay_max: float = Field(default=0.5, ge=0.0, lt=1.0, allow_inf_nan=False)
    num_iterations: int = Field(default=1, ge=1)

    @property
    def uses_reference(self) -> bool:
        return self.kl_beta > 0

    @property
    def advantage_spec(self) -> AdvantageSpec:
        return AdvantageSpec(scale=self.advantage, ddof=0, eps=self.std_eps, clip=self.adv_clip)


class NFTConfig(ForwardFlowConfig):
    """DiffusionNFT: ``beta`` mixes the implicit policies (1: NFT's default);
    ``adaptive_weight`` divides each squared error by its own mean absolute error."""

    algorithm: Literal["nft"] = "nft"
    beta: float = Field(default=1.0, gt=0.0, allow_inf_nan=False)
    adaptive_weight: bool = True


class AWMConfig(ForwardFlowConfig):
    """AWM: the surrogate's ``weighting`` (``huber_p`` for ``ghuber``), the PPO
    ``clip_range`` ε and ``ema_beta``, the weight of the velocity distance to the old
    policy (AWM's EMA KL). AWM's reference code: ghuber 0.25, kl 0.003, ema_beta 1,
    6 stratified timesteps from the first 90 % of the grid, EMA decay up to 0.3."""

    algorithm: Literal["awm"] = "awm"
    weighting: Literal["uniform", "sigma", "ghuber"] = "ghuber"
    huber_p: float = Field(default=0.25, gt=0.0, le=1.0, allow_inf_nan=False)
    clip_range: float = Field(default=0.2, gt=0.0, lt=1.0, allow_inf_nan=False)
    ema_beta: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)
    timesteps_per_sample: int = Field(default=6, ge=1)
    sigma_sampling: Literal["grid", "stratified", "uniform"] = "stratified"
    timestep_range: float = Field(default=0.9, gt=0.0, le=1.0, allow_inf_nan=False)
    kl_beta: float = Field(default=0.003, ge=0.0, allow_inf_nan=False)
    old_decay_max: float = Field(default=0.3, ge=0.0, lt=1.0, allow_inf_nan=False)


class DGPOConfig(ForwardFlowConfig):
    """DGPO: ``dpo_beta`` scales the group preference, ``clip_range`` ε freezes items past
    the ratio's clip. DGPO's reference code: β 100, ε 0.01, kl 0.02, 4 timesteps and noise
    shared by the group, old-policy decay up to 0.3."""

    algorithm: Literal["dgpo"] = "dgpo"
    dpo_beta: float = Field(default=100.0, gt=0.0, allow_inf_nan=False)
    clip_range: float = Field(default=0.01, gt=0.0, lt=1.0, allow_inf_nan=False)
    shared_timesteps: bool = True
    shared_noise: bool = True
    kl_beta: float = Field(default=0.02, ge=0.0, allow_inf_nan=False)
    old_decay_max: float = Field(default=0.3, ge=0.0, lt=1.0, allow_inf_nan=False)

    @property
    def uses_reference(self) -> bool:
        return True  # the preference is measured against the reference's errors

    @model_validator(mode="after")
    def _shared(self) -> DGPOConfig:
        if not self.shared_timesteps:
            raise ValueError(
                "shared_timesteps: DGPO compares a group's errors at one σ per slot; keep it true"
            )
        return self


def old_policy_decay(config: ForwardFlowConfig, step: int) -> float:
    """The decay ``d`` of the old policy's update after learner step ``step`` (1, 2, ...):
    ``min(old_decay_rate · step, old_decay_max)``."""
    return min(config.old_decay_rate * step, config.old_decay_max)


def draw_timesteps(
    streams: RowStreams, grid: torch.Tensor, config: ForwardFlowConfig
) -> torch.Tensor:
    """σ ``[B, K]`` float32, row b from stream b: ``grid`` is the rollout's σ schedule
    without its final 0 (``[N]``, noisy first), cut to its first ``R = ⌈range · N⌉``
    entries. ``"grid"``: ``randperm(R)[:K]`` (K ≤ R distinct entries); ``"stratified"``:
    stratum k = ``[⌊kR/K⌋, ⌊(k+1)R/K⌋)`` and one index ``lo + ⌊u (hi − lo)⌋`` of each, with
    ``u = rand(K)`` (K ≤ R); ``"uniform"``: ``1 − range · rand(K)``."""
    k, size = config.timesteps_per_sample, grid.shape[0]
    reach = max(1, math.ceil(config.timestep_range * size - 1e-9))
    if config.sigma_sampling == "uniform":
        return 1 - config.timestep_range * streams.rand(k)
    if k > reach:
        raise ValueError(
            f"timesteps_per_sample: {k} distinct timesteps from the first {reach} of the "
            f"rollout's {size} (timestep_range {config.timestep_range}); lower it or sample "
            "with more steps"
        )
    if config.sigma_sampling == "grid":
        index = torch.stack([torch.randperm(reach, generator=g)[:k] for g in streams.generators])
    else:
        bounds = torch.tensor([(j * reach) // k for j in range(k + 1)])
        lo, hi = bounds[:-1], bounds[1:]
        index = lo + (streams.rand(k) * (hi - lo)).long().clamp(max=hi - lo - 1)
    return grid.float()[index]


@dataclass(frozen=True)
class ForwardScores:
    """One velocity pass over a :class:`FlowForwardBatch`: ``velocity`` float32 ``[b, *latent]``."""

    velocity: torch.Tensor


def _mean_elements(x: torch.Tensor) -> torch.Tensor:
    return x.flatten(1).mean(1)


def flow_matching_error(velocity: torch.Tensor, batch: FlowForwardBatch) -> torch.Tensor:
    """``e = mean_d (v − (ε − x0))²`` per item ``[b]``, float64."""
    target = batch.noise.double() - batch.x0.double()
    return _mean_elements((velocity.double() - target).square())


def _sigma(batch: FlowForwardBatch, like: torch.Tensor) -> torch.Tensor:
    return batch.sigma.to(like.dtype).view(-1, *([1] * (like.dim() - 1)))


def _require(batch: FlowForwardBatch, name: str, why: str) -> torch.Tensor:
    value = getattr(batch, name)
    if value is None:
        raise ValueError(f"{name}: the batch carries none; {why}")
    return value


class _ForwardLoss:
    """Shared plumbing: the config, metadata and the item weights."""

    name = "forward"

    def __init__(self, config: ForwardFlowConfig) -> None:
        self.config = config

    @property
    def uses_reference(self) -> bool:
        return self.config.uses_reference

    def metadata(self) -> dict:
        return {"name": self.name, "version": 1, **self.config.model_dump()}

    @staticmethod
    def _inputs(scores: ForwardScores, batch: FlowForwardBatch):
        velocity = scores.velocity.float()
        if velocity.shape != batch.x0.shape:
            raise ValueError(
                f"velocity: expected the shape of x0 {tuple(batch.x0.shape)}, got "
                f"{tuple(velocity.shape)}"
            )
        advantages = _require(batch, "advantages", "prepare it with the rollout's advantages")
        weights = batch.weights
        weights = torch.ones_like(advantages) if weights is None else weights
        return velocity, advantages.float(), weights.float()

    def _kl(self, velocity: torch.Tensor, batch: FlowForwardBatch) -> torch.Tensor | None:
        if self.config.kl_beta == 0:
            return None
        reference = _require(batch, "ref_velocity", "kl_beta > 0 needs the reference pass")
        return _mean_elements((velocity - reference.float()).square())

    @staticmethod
    def _output(per_item, weights, metrics: dict[str, torch.Tensor], extremes) -> LossOutput:
        total = weights.sum().detach()
        aux: dict = {
            key: WeightedMetric((value.detach().float() * weights).sum(), total)
            for key, value in metrics.items()
        }
        aux.update(extremes)
        return LossOutput(WeightedMetric((per_item * weights).sum(), total), aux)


class NFTLoss(_ForwardLoss):
    """DiffusionNFT's loss (module doc); needs ``old_velocity`` (and ``ref_velocity`` for
    ``kl_beta > 0``)."""

    name = "nft"

    def __call__(self, scores: ForwardScores, batch: FlowForwardBatch) -> LossOutput:
        cfg = self.config
        velocity, advantages, weights = self._inputs(scores, batch)
        old = _require(batch, "old_velocity", "NFT needs the old policy's pass").float()
        clipped = torch.clamp(advantages, -cfg.adv_clip, cfg.adv_clip)
        r = torch.clamp(0.5 + 0.5 * clipped / cfg.adv_clip, 0, 1)
        positive = cfg.beta * velocity + (1 - cfg.beta) * old
        negative = (1 + cfg.beta) * old - cfg.beta * velocity
        sigma = _sigma(batch, velocity)
        x0 = batch.x0.float()
        errors = []
        for implicit in (positive, negative):
            predicted = batch.noisy.float() - sigma * implicit
            square = _mean_elements((predicted - x0).square())
            if cfg.adaptive_weight:
                with torch.no_grad():
                    scale = _mean_elements((predicted.double() - x0.double()).abs())
                square = square / scale.clamp(min=WEIGHT_FLOOR).to(square.dtype)
            errors.append(square)
        policy = cfg.adv_clip * (r * errors[0] + (1 - r) * errors[1]) / cfg.beta
        per_item = policy
        metrics = {
            "nft/policy_loss": policy,
            "nft/positive_loss": errors[0],
            "nft/negative_loss": errors[1],
            "nft/optimality": r,
            "nft/old_deviation": _mean_elements((velocity - old).square()),
            "nft/advantage_abs": advantages.abs(),
        }
        kl = self._kl(velocity, batch)
        if kl is not None:
            per_item = per_item + cfg.kl_beta * kl
            metrics["nft/kl"] = kl
        return self._output(per_item, weights, metrics, {})


class AWMLoss(_ForwardLoss):
    """AWM's loss (module doc); ``old_velocity`` for ``ema_beta > 0``, ``snapshot_velocity``
    for μ > 1, ``ref_velocity`` for ``kl_beta > 0``."""

    name = "awm"

    def surrogate(self, velocity: torch.Tensor, batch: FlowForwardBatch) -> torch.Tensor:
        """``ℓ`` per item ``[b]`` (float64): minus the weighted flow-matching error."""
        cfg = self.config
        error = flow_matching_error(velocity, batch)
        sigma = batch.sigma.double()
        if cfg.weighting == "uniform":
            return -error
        if cfg.weighting == "sigma":
            return -error * sigma
        p = cfg.huber_p
        return -((error + HUBER_DELTA) ** p - HUBER_DELTA**p) * sigma / p

    def __call__(self, scores: ForwardScores, batch: FlowForwardBatch) -> LossOutput:
        cfg = self.config
        velocity, advantages, weights = self._inputs(scores, batch)
        live = self.surrogate(velocity, batch)
        if cfg.num_iterations == 1:
            start = live.detach()
        else:
            snapshot = _require(
                batch, "snapshot_velocity", "num_iterations > 1 needs the start-of-step pass"
            )
            start = self.surrogate(snapshot.float(), batch)
        scaled = torch.clamp(advantages, -cfg.adv_clip, cfg.adv_clip).double() / cfg.adv_clip
        ratio = torch.exp(torch.clamp(live - start, -MAX_LOG_RATIO, MAX_LOG_RATIO))
        clipped = torch.clamp(ratio, 1 - cfg.clip_range, 1 + cfg.clip_range)
        policy = torch.maximum(-scaled * ratio, -scaled * clipped).float()
        per_item = policy
        ratio_d = ratio.detach().float()
        metrics = {
            "awm/policy_loss": policy,
            "awm/surrogate": live.float(),
            "awm/ratio_mean": ratio_d,
            "awm/advantage_abs": scaled.float().abs(),
        }
        extremes = {
            "awm/ratio_min": Extreme(ratio_d.min(), "min"),
            "awm/ratio_max": Extreme(ratio_d.max()),
        }
        kl = self._kl(velocity, batch)
        if kl is not None:
            per_item = per_item + cfg.kl_beta * kl
            metrics["awm/kl"] = kl
        if cfg.ema_beta > 0:
            old = _require(batch, "old_velocity", "ema_beta > 0 needs the old policy's pass")
            drift = _mean_elements((velocity - old.float()).square())
            per_item = per_item + cfg.ema_beta * drift
            metrics["awm/old_deviation"] = drift
        return self._output(per_item, weights, metrics, extremes)


class DGPOLoss(_ForwardLoss):
    """DGPO's loss (module doc); needs ``ref_velocity`` and ``old_velocity``, and every
    member of each group in the batch (``groups`` says who they are; a group's items at one
    slot share σ and ε)."""

    name = "dgpo"

    def __call__(self, scores: ForwardScores, batch: FlowForwardBatch) -> LossOutput:
        cfg = self.config
        velocity, advantages, weights = self._inputs(scores, batch)
        reference = _require(batch, "ref_velocity", "DGPO needs the reference pass")
        old = _require(batch, "old_velocity", "DGPO needs the old policy's pass")
        live = flow_matching_error(velocity, batch)
        ref_error = flow_matching_error(reference.float(), batch)
        old_error = flow_matching_error(old.float(), batch)
        a = advantages.double()
        ratio = torch.exp(torch.clamp(old_error - live.detach(), -MAX_LOG_RATIO, MAX_LOG_RATIO))
        frozen = ((a > 0) & (ratio > 1 + cfg.clip_range)) | (
            (a <= 0) & (ratio < 1 - cfg.clip_range)
        )
        used = torch.where(frozen, live.detach(), live)
        # one preference per (group, slot): those items share σ and ε
        key = torch.stack([batch.groups, batch.slots], 1).to(a.device)
        _, slot_group, counts = torch.unique(key, dim=0, return_inverse=True, return_counts=True)
        preference = torch.zeros(counts.shape[0], dtype=torch.float64, device=a.device)
        preference.index_add_(0, slot_group, a * (live.detach() - ref_error))
        preference = cfg.dpo_beta * preference / counts.double()
        weight = torch.sigmoid(preference)[slot_group]
        policy = (weight * a * used).float()
        per_item = policy
        metrics = {
            "dgpo/policy_loss": policy,
            "dgpo/preference_weight": weight.float(),
            "dgpo/error_gap": (live.detach() - ref_error).float(),
            "dgpo/frozen_frac": frozen.float(),
            "dgpo/advantage_abs": advantages.abs(),
        }
        kl = self._kl(velocity, batch)
        if kl is not None:
            per_item = per_item + cfg.kl_beta * kl
            metrics["dgpo/kl"] = kl
        return self._output(per_item, weights, metrics, {})


FORWARD_LOSSES = {
    "nft": (NFTConfig, NFTLoss),
    "awm": (AWMConfig, AWMLoss),
    "dgpo": (DGPOConfig, DGPOLoss),
}


def forward_flow_loss(config: ForwardFlowConfig) -> _ForwardLoss:
    """The loss of ``config.algorithm``."""
    return FORWARD_LOSSES[config.algorithm][1](config)
