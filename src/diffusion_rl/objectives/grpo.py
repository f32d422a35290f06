"""Policy optimisation on token traces: GRPO, DAPO and Dr.GRPO (docs/math.md §3).

Everything per action ``i`` of row ``b`` with weight ``w_i`` (fractional allowed):

    δ_i  = clip(ℓ_i − ℓold_i, −20, 20),   ρ_i = exp(δ_i)
    pg_i = max(−A_b ρ_i, −A_b clip(ρ_i, 1 − ε_low, 1 + ε_high))
    pg_i = min(pg_i, −ε_c A_b)                       if dual clip and A_b < 0
    kl_i = k1: ℓ − ℓref | k2: ½(ℓ − ℓref)² | k3: exp(ℓref − ℓ) − (ℓref − ℓ) − 1
    x_i  = pg_i + β kl_i

aggregated into a :class:`~diffusion_rl.contracts.WeightedMetric` so micro-batches normalise
once (token-mean: ΣΣ x w / ΣΣ w; sequence-mean-token-mean: Σ_b (Σ_i x w / Σ_i w) / B;
sequence-mean-token-scale: Σ_b (Σ_i x w / N) / B; sequence-mean-token-sum: Σ_b Σ_i x w /
#non-empty rows). ``ℓold`` is the start-of-step snapshot; with one inner iteration it is
``stop_grad(ℓ)``, so every ratio is exactly 1 before the update.

Advantages per group of G completions of one prompt (computed by
:func:`~diffusion_rl.advantages.group_advantages` with :attr:`PolicyLossConfig.advantage_spec`):
GRPO ``(r − mean) / (std + 1e-6)`` (ddof 1 by default), Dr.GRPO ``r − mean``. DAPO adds
overlong shaping in *tokens* and dynamic sampling (groups whose rewards are all equal are
dropped and the batch refilled by the rollout collector).

Call shape (every RL objective): ``loss(scores, batch) -> LossOutput`` with ``scores`` the
live :class:`~diffusion_rl.scoring.ReplayScores` of the batch's actions.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..advantages import AdvantageSpec
from ..contracts import DiffusionTokenBatch, Extreme, LossOutput, WeightedMetric

Algorithm = Literal["grpo", "dapo", "drgrpo"]
Aggregation = Literal[
    "token_mean", "sequence_mean_token_mean", "sequence_mean_token_scale", "sequence_mean_token_sum"
]

MAX_LOG_RATIO = 20.0

# what each algorithm means when a field is left unset
ALGORITHM_DEFAULTS: dict[str, dict] = {
    "grpo": {
        "clip_high": 0.2,
        "beta": 0.04,
        "aggregation": "sequence_mean_token_mean",
        "advantage": "group_std",
        "dynamic_sampling": False,
        "overlong_penalty": 0.0,
    },
    "dapo": {
        "clip_high": 0.28,
        "beta": "none",
        "aggregation": "token_mean",
        "advantage": "group_std",
        "dynamic_sampling": True,
        "overlong_penalty": 1.0,
    },
    "drgrpo": {
        "clip_high": 0.2,
        "beta": "none",
        "aggregation": "sequence_mean_token_scale",
        "advantage": "group_mean",
        "dynamic_sampling": False,
        "overlong_penalty": 0.0,
    },
}


class PolicyLossConfig(BaseModel):
    """GRPO-family settings; fields left unset (null) take ``ALGORITHM_DEFAULTS[algorithm]``.

    ``beta="none"``: no reference model and no reference pass; ``beta=0``: the reference is
    scored for the KL diagnostic but the KL is not in the loss. Strict types: finite floats,
    ints that are not bools.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    algorithm: Algorithm = "grpo"
    num_iterations: int = Field(default=1, ge=1)
    clip_low: float = Field(default=0.2, ge=0.0, lt=1.0, allow_inf_nan=False)
    clip_high: float | None = Field(default=None, ge=0.0, allow_inf_nan=False)
    dual_clip: float | None = Field(default=None, gt=1.0, allow_inf_nan=False)
    beta: float | Literal["none"] | None = None
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    aggregation: Aggregation | None = None
    token_scale: int | None = Field(default=None, gt=0)  # N of sequence_mean_token_scale; None = L
    advantage: Literal["group_std", "group_mean"] | None = None
    std_ddof: int = Field(default=1, ge=0, le=1)  # 0 or 1 (strict: not a bool)
    std_eps: float = Field(default=1e-6, gt=0.0, allow_inf_nan=False)
    dynamic_sampling: bool | None = None
    overlong_max_tokens: int | None = Field(default=None, gt=0)  # L_max; None = generation length
    overlong_buffer_tokens: int = Field(default=0, ge=0)  # L_buf; 0 = no shaping
    overlong_penalty: float | None = Field(default=None, ge=0.0, allow_inf_nan=False)
    # the learner's bound on one step's policy change (nats per action, KL(π_before ‖ π_after)
    # on the rollout's own actions, by exact replay); None: unbounded (docs/math.md §3)
    max_step_kl: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _resolve(self) -> PolicyLossConfig:
        for key, value in ALGORITHM_DEFAULTS[self.algorithm].items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)
        if self.beta != "none" and not (0 <= self.beta < float("inf")):
            raise ValueError(
                f"beta: expected a finite value >= 0 or 'none' (no reference), got {self.beta}"
            )
        return self

    @property
    def uses_reference(self) -> bool:
        return self.beta != "none"

    @property
    def advantage_spec(self) -> AdvantageSpec:
        if self.advantage == "group_mean":
            return AdvantageSpec(scale="none")
        return AdvantageSpec(scale="group", ddof=self.std_ddof, eps=self.std_eps)


def kl_per_action(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """k1 ``ℓ − ℓref``, k2 ``½(ℓ − ℓref)²``, k3 ``exp(ℓref − ℓ) − (ℓref − ℓ) − 1`` (its log-ratio
    clamped to ±20 like the policy ratio, so a noisy estimator cannot overflow the exp)."""
    diff = ref_logp - logp
    if estimator == "k1":
        return -diff
    if estimator == "k2":
        return 0.5 * diff.square()
    diff = torch.clamp(diff, -MAX_LOG_RATIO, MAX_LOG_RATIO)
    return torch.exp(diff) - diff - 1.0


def aggregate(
    values: torch.Tensor, weights: torch.Tensor, mode: str, token_scale: int | None
) -> WeightedMetric:
    """Per-action ``values [B, L]`` and ``weights [B, L]`` → WeightedMetric (see module doc)."""
    weighted = values * weights
    if mode == "token_mean":
        return WeightedMetric(weighted.sum(), weights.sum().detach())
    rows = weights.shape[0]
    row_weight = weights.sum(1)
    if mode == "sequence_mean_token_mean":
        safe = torch.where(row_weight > 0, row_weight, torch.ones_like(row_weight))
        per_row = torch.where(row_weight > 0, weighted.sum(1) / safe, torch.zeros_like(row_weight))
        return WeightedMetric(per_row.sum(), torch.tensor(float(rows)))
    if mode == "sequence_mean_token_scale":
        scale = token_scale or weights.shape[1]
        return WeightedMetric(weighted.sum() / scale, torch.tensor(float(rows)))
    if mode == "sequence_mean_token_sum":
        return WeightedMetric(weighted.sum(), (row_weight > 0).sum().float())
    raise ValueError(f"aggregation: unknown mode {mode!r}")


class PolicyLoss:
    """``loss(scores, batch) -> LossOutput`` for one micro-batch of a prepared trace batch.

    ``batch.model_inputs`` must carry (batch-major): ``advantages [B]`` and
    ``behaviour_logprobs [B, L]`` (``TokenTrace.prepare(advantages=...)``), ``old_logprobs
    [B, L]`` when ``num_iterations > 1``, ``ref_logprobs [B, L]`` when ``beta`` is not
    ``"none"`` (both attached by the learner). ``scores.logprobs`` are the live scores
    ``[B, L]`` (with gradient) of the same actions in the same states; ``scores.entropy``
    (optional) is logged.
    """

    name = "policy_gradient"

    def __init__(self, config: PolicyLossConfig) -> None:
        self.config = config

    def metadata(self) -> dict:
        return {"name": self.config.algorithm, "version": 1, **self.config.model_dump()}

    def __call__(self, scores, batch: DiffusionTokenBatch) -> LossOutput:
        cfg = self.config
        logprobs, entropy = scores.logprobs, scores.entropy
        inputs = batch.model_inputs
        weights = batch.loss_weights.float()
        active = weights != 0
        zeros = torch.zeros_like(logprobs)
        if cfg.num_iterations == 1:
            old = logprobs.detach()
        else:
            if "old_logprobs" not in inputs:
                raise ValueError(
                    "model_inputs: num_iterations > 1 needs old_logprobs (the start-of-step snapshot)"
                )
            old = inputs["old_logprobs"]
        advantages = inputs["advantages"].float()[:, None]

        delta = torch.clamp(logprobs - old, -MAX_LOG_RATIO, MAX_LOG_RATIO)
        delta = torch.where(active, delta, zeros)
        ratio = torch.exp(delta)
        clipped = torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
        pg = torch.maximum(-advantages * ratio, -advantages * clipped)
        if cfg.dual_clip is not None:
            pg = torch.where(advantages < 0, torch.minimum(pg, -cfg.dual_clip * advantages), pg)
        per_action = pg
        kl = None
        if cfg.uses_reference:
            if "ref_logprobs" not in inputs:
                raise ValueError(
                    "model_inputs: beta is set but ref_logprobs (the reference pass) is missing"
                )
            live = torch.where(active, logprobs, zeros)  # sanitise first: 0·NaN would reach grads
            ref = torch.where(active, inputs["ref_logprobs"], zeros)
            kl = torch.where(active, kl_per_action(live, ref, cfg.kl_estimator), zeros)
            per_action = pg + cfg.beta * kl
        per_action = torch.where(active, per_action, zeros)
        primary = aggregate(per_action, weights, cfg.aggregation, cfg.token_scale)

        total_w = weights.sum().detach()

        def token_mean(x: torch.Tensor) -> WeightedMetric:
            return WeightedMetric((x.detach() * weights).sum(), total_w)

        low_clipped = (advantages < 0) & (ratio < 1.0 - cfg.clip_low)
        high_clipped = (advantages > 0) & (ratio > 1.0 + cfg.clip_high)
        parity = torch.where(active, (old - inputs["behaviour_logprobs"]).abs(), zeros).detach()
        finite_ratio = ratio.detach()[active]
        aux: dict = {
            "policy/pg_loss": token_mean(pg),
            "policy/ratio_mean": token_mean(ratio),
            "policy/ratio_max": Extreme(finite_ratio.max() if finite_ratio.numel() else 1.0),
            "policy/ratio_min": Extreme(finite_ratio.min() if finite_ratio.numel() else 1.0, "min"),
            "policy/clip_frac_low": token_mean(low_clipped.float()),
            "policy/clip_frac_high": token_mean(high_clipped.float()),
            "policy/parity_mean_abs": token_mean(parity),
            "policy/parity_max_abs": Extreme(parity.max() if parity.numel() else 0.0),
        }
        # where the update pushes: mean log-prob of actions with positive / negative advantage
        for name, side in (("pos", advantages > 0), ("neg", advantages < 0)):
            side_w = weights * side
            aux[f"policy/logprob_{name}_adv"] = WeightedMetric(
                (torch.where(active, logprobs.detach(), zeros) * side_w).sum(),
                side_w.sum().detach(),
            )
        if kl is not None:
            aux["policy/kl"] = token_mean(kl)
        if entropy is not None:
            aux["policy/entropy"] = token_mean(entropy)
        return LossOutput(primary=primary, aux_metrics=aux)
