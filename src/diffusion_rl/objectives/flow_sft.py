"""Rectified-flow SFT for flow-matching generators (docs/math.md §5).

Per row ``b`` with clean latent ``x0``: ``σ ~ U(0, 1)`` or logit-normal
(``σ = sigmoid(m + s·n)``, ``n ~ N(0, 1)``), ``ε ~ N(0, I)``,
``x_σ = (1 − σ) x0 + σ ε``, target ``v = ε − x0``, and

    L = Σ_b w_b · mean_d (f_θ(x_σ, σ, c_b) − v)_d² / Σ_b w_b

returned as ``WeightedMetric(Σ w · mse, Σ w)`` so the trainer normalises once over every
micro-batch. With ``cond_dropout = p`` each row's conditioning is replaced by the
unconditional one with probability ``p`` (trains the unconditional branch CFG needs).
Computed in float32.

Batch (a dict, moved to the device by the trainer): ``latents`` ``[B, *latent_shape]``,
``cond`` (batch-first tensors), optionally ``uncond`` (default ``model.empty_condition(B)``)
and ``weights [B]`` (default 1). Random draws, all from the trainer's CPU generator, in this
order: σ ``[B]`` (``rand`` or ``randn``), ε ``[B, *latent]`` (``randn``), then the dropout
``rand [B]`` when ``cond_dropout > 0``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from ..contracts import LossOutput, WeightedMetric
from ..models.protocol import Conditioning, VelocityModel


class FlowSFTConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sigma_sampling: Literal["uniform", "logit_normal"] = "logit_normal"
    logit_mean: float = Field(default=0.0, allow_inf_nan=False)
    logit_std: float = Field(default=1.0, gt=0.0, allow_inf_nan=False)
    cond_dropout: float = Field(default=0.0, ge=0.0, lt=1.0)


def flow_sft_batch(
    model: VelocityModel,
    latents: torch.Tensor,
    prompts: Sequence[str],
    weights: torch.Tensor | None = None,
) -> dict:
    """A batch for :class:`FlowMatchingSFT` from clean latents and their prompts."""
    if len(prompts) != latents.shape[0]:
        raise ValueError(
            f"prompts: expected {latents.shape[0]} (one per latent), got {len(prompts)}"
        )
    batch = {"latents": latents, "cond": model.encode_prompts(list(prompts))}
    if weights is not None:
        batch["weights"] = weights
    return batch


class FlowMatchingSFT:
    """``loss_fn(model, batch, generator) -> LossOutput`` for :class:`~diffusion_rl.train.Trainer`."""

    name = "flow_matching_sft"

    def __init__(self, config: FlowSFTConfig | None = None) -> None:
        self.config = config or FlowSFTConfig()

    def metadata(self) -> dict:
        return {"name": self.name, **self.config.model_dump()}

    def sample_sigmas(self, rows: int, generator: torch.Generator) -> torch.Tensor:
        cfg = self.config
        if cfg.sigma_sampling == "uniform":
            return torch.rand(rows, generator=generator)
        normal = torch.randn(rows, generator=generator)
        return torch.sigmoid(cfg.logit_mean + cfg.logit_std * normal)

    def __call__(self, model: VelocityModel, batch: dict, generator: torch.Generator) -> LossOutput:
        for key in ("latents", "cond"):
            if key not in batch:
                raise ValueError(f"batch: missing {key!r}; build it with flow_sft_batch()")
        x0 = batch["latents"].float()
        rows, device = x0.shape[0], x0.device
        weights = batch.get("weights")
        weights = torch.ones(rows, device=device) if weights is None else weights.float()
        if tuple(weights.shape) != (rows,):
            raise ValueError(f"weights: expected [B={rows}], got {tuple(weights.shape)}")

        sigma = self.sample_sigmas(rows, generator)
        noise = torch.randn(tuple(x0.shape), generator=generator)
        sigma, noise = sigma.to(device), noise.to(device)
        cond = batch["cond"]
        if self.config.cond_dropout > 0:
            drop = (torch.rand(rows, generator=generator) < self.config.cond_dropout).to(device)
            uncond = batch.get("uncond") or model.empty_condition(rows)
            cond = _mix(cond, {k: v.to(device) for k, v in uncond.items()}, drop)

        s = sigma.view(-1, *([1] * (x0.dim() - 1)))
        x_sigma = (1 - s) * x0 + s * noise
        target = noise - x0
        prediction = model(x_sigma, sigma, cond).float()
        if prediction.shape != x0.shape:
            raise ValueError(
                f"model: expected a velocity of the latents' shape {tuple(x0.shape)}, got "
                f"{tuple(prediction.shape)}"
            )
        mse = (prediction - target).square().flatten(1).mean(1)
        denominator = weights.sum().detach()
        return LossOutput(
            primary=WeightedMetric((weights * mse).sum(), denominator),
            aux_metrics={
                "flow_sft/sigma_mean": WeightedMetric((weights * sigma).sum(), denominator)
            },
        )


def _mix(cond: Conditioning, uncond: Conditioning, drop: torch.Tensor) -> Conditioning:
    """Per row: ``uncond`` where ``drop``, else ``cond`` (same keys and shapes)."""
    if set(cond) != set(uncond):
        raise ValueError(f"uncond: expected the keys of cond {sorted(cond)}, got {sorted(uncond)}")
    mixed = {}
    for key, value in cond.items():
        mask = drop.view(-1, *([1] * (value.dim() - 1)))
        mixed[key] = torch.where(mask, uncond[key].to(value.dtype), value)
    return mixed
