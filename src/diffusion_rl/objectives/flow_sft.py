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
``cond`` (batch-first tensors), ``noise_seeds [B]`` (int64 noise keys,
:func:`~diffusion_rl.seeding.noise_keys`), optionally ``uncond`` (default
``model.empty_condition(B)``) and ``weights [B]`` (default 1). A dropped row takes its
``uncond`` row (same keys and shapes as ``cond``), so a model whose unconditional branch keeps
part of the conditioning (an image-to-video model's first frame) passes explicit ``cond`` /
``uncond`` to :func:`flow_sft_batch`.

Randomness is per row: row b draws from its own stream
``torch.Generator().manual_seed(noise_seeds[b])``, in this order: σ (``rand(())``, or
``randn(())`` for logit-normal), ε (``randn(*latent_shape)``), then the dropout uniform
``rand(())`` when ``cond_dropout > 0``. The trainer's shared generator is not used, so a
row's draws depend on its key (and the latent shape) only: however the batch is split into
micro-batches, and wherever the row sits in it, the update is the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from ..contracts import LossOutput, WeightedMetric, check_conditioning
from ..models.protocol import Conditioning, VelocityModel
from ..seeding import RowStreams

NOISE_SEEDS = "noise_seeds"


class FlowSFTConfig(BaseModel):
    """σ sampling (``uniform`` or ``logit_normal`` with ``logit_mean`` / ``logit_std``) and
    the ``cond_dropout`` fraction of unconditional rows. Strict types, finite floats."""

    model_config = ConfigDict(extra="forbid", strict=True)

    sigma_sampling: Literal["uniform", "logit_normal"] = "logit_normal"
    logit_mean: float = Field(default=0.0, allow_inf_nan=False)
    logit_std: float = Field(default=1.0, gt=0.0, allow_inf_nan=False)
    cond_dropout: float = Field(default=0.0, ge=0.0, lt=1.0, allow_inf_nan=False)


def flow_sft_batch(
    model: VelocityModel,
    latents: torch.Tensor,
    prompts: Sequence[str],
    weights: torch.Tensor | None = None,
    *,
    noise_seeds: torch.Tensor,
    cond: Conditioning | None = None,
    uncond: Conditioning | None = None,
) -> dict:
    """A batch for :class:`FlowMatchingSFT` from clean latents, their prompts and the rows'
    noise keys (int64 ``[B]``, e.g. ``noise_keys(dataset_indices, seed, step)``).

    ``cond`` (default ``model.encode_prompts(prompts)``) and ``uncond`` (the rows
    ``cond_dropout`` swaps in; default ``model.empty_condition(B)`` at loss time) give the
    conditioning explicitly, e.g. ``model.encode_conditioning(prompts, first_frames)`` /
    ``model.empty_conditioning(first_frames)`` for an image-to-video model. Both are checked:
    batch-first ``[B, ...]`` tensors, ``uncond`` with the keys and shapes of ``cond``.
    """
    rows = latents.shape[0]
    if len(prompts) != rows:
        raise ValueError(f"prompts: expected {rows} (one per latent), got {len(prompts)}")
    if not isinstance(noise_seeds, torch.Tensor) or tuple(noise_seeds.shape) != (rows,):
        shape = tuple(noise_seeds.shape) if isinstance(noise_seeds, torch.Tensor) else noise_seeds
        raise ValueError(f"noise_seeds: expected an int64 tensor [B={rows}], got {shape!r}")
    if cond is None:
        cond = model.encode_prompts(list(prompts))
    else:
        check_conditioning("cond", cond, rows)
    batch = {"latents": latents, "cond": cond, NOISE_SEEDS: noise_seeds}
    if uncond is not None:
        check_conditioning("uncond", uncond, rows)
        _check_like(cond, uncond)
        batch["uncond"] = uncond
    if weights is not None:
        batch["weights"] = weights
    return batch


class FlowMatchingSFT:
    """``loss_fn(model, batch, generator) -> LossOutput`` for :class:`~diffusion_rl.train.Trainer`
    (``generator`` is accepted for the trainer's call shape and ignored: every draw comes from
    the batch's per-row ``noise_seeds``)."""

    name = "flow_matching_sft"

    def __init__(self, config: FlowSFTConfig | None = None) -> None:
        self.config = config or FlowSFTConfig()

    def metadata(self) -> dict:
        return {"name": self.name, **self.config.model_dump()}

    def sample_sigmas(self, streams: RowStreams) -> torch.Tensor:
        """σ ``[B]``: each row's first draw (uniform, or logit-normal)."""
        cfg = self.config
        if cfg.sigma_sampling == "uniform":
            return streams.rand()
        return torch.sigmoid(cfg.logit_mean + cfg.logit_std * streams.randn())

    def noise(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(σ [B], ε [B, *latent], drop [B] bool or None)`` on the CPU from the rows' own
        streams, in the documented order (``drop`` is None when ``cond_dropout == 0``)."""
        keys = batch.get(NOISE_SEEDS)
        if keys is None:
            raise ValueError(
                f"batch: missing {NOISE_SEEDS!r}, the per-row noise keys (int64 [B]) flow SFT "
                "draws σ, ε and the dropout from; build it with flow_sft_batch(..., "
                "noise_seeds=diffusion_rl.seeding.noise_keys(example_ids, seed, step))"
            )
        streams = RowStreams(keys, NOISE_SEEDS)
        rows = batch["latents"].shape[0]
        if len(streams) != rows:
            raise ValueError(f"{NOISE_SEEDS}: expected [B={rows}], got {tuple(keys.shape)}")
        sigma = self.sample_sigmas(streams)
        noise = streams.randn(*batch["latents"].shape[1:])
        drop = None
        if self.config.cond_dropout > 0:
            drop = streams.rand() < self.config.cond_dropout
        return sigma, noise, drop

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

        sigma, noise, drop = self.noise(batch)
        sigma, noise = sigma.to(device), noise.to(device)
        cond = batch["cond"]
        if drop is not None:
            uncond = batch.get("uncond")
            if uncond is None:
                uncond = model.empty_condition(rows)
            cond = _mix(cond, {k: v.to(device) for k, v in uncond.items()}, drop.to(device))

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


def _check_like(cond: Conditioning, uncond: Conditioning) -> None:
    """``uncond`` has the keys of ``cond`` and, per key, its shape (no silent broadcast)."""
    if set(cond) != set(uncond):
        raise ValueError(f"uncond: expected the keys of cond {sorted(cond)}, got {sorted(uncond)}")
    for key, value in cond.items():
        if tuple(uncond[key].shape) != tuple(value.shape):
            raise ValueError(
                f"uncond[{key!r}]: expected the shape of cond[{key!r}] {tuple(value.shape)}, "
                f"got {tuple(uncond[key].shape)}"
            )


def _mix(cond: Conditioning, uncond: Conditioning, drop: torch.Tensor) -> Conditioning:
    """Per row: ``uncond`` where ``drop``, else ``cond`` (same keys and shapes)."""
    _check_like(cond, uncond)
    mixed = {}
    for key, value in cond.items():
        mask = drop.view(-1, *([1] * (value.dim() - 1)))
        mixed[key] = torch.where(mask, uncond[key].to(value.dtype), value)
    return mixed
