"""Masked-diffusion SFT (docs/math.md §1.4).

Per row, ``t ~ U(eps, 1)``; each active completion slot is masked with probability ``t``; the
loss is the weighted cross-entropy on the masked slots,
``L = Σ_i w_i CE(f_θ(x_t)_i, x_i) / Σ_i w_i`` with ``w_i = loss_weight_i`` (``"plain"``) or
``loss_weight_i / t`` (``"inverse_t"``, the MDLM NELBO weighting) on masked slots, 0 elsewhere.
Float32, target-aligned (no shift), MASK logit at -inf, inactive slots sanitised.

Batch: ``model_inputs`` ``prompt_ids [B, P]``, ``prompt_mask [B, P]`` and ``noise_seeds [B]``
(int64 noise keys, :func:`~diffusion_rl.seeding.noise_keys`); ``target_ids [B, L]`` the clean
completion; ``loss_weights [B, L]``.

Randomness is per row: row b draws from its own stream
``torch.Generator().manual_seed(noise_seeds[b])``, first ``t_b = eps + (1 - eps) · rand(())``,
then ``u_b = rand(L)``; slot i is masked iff ``u_b[i] < t_b`` (and active). The trainer's
shared generator is not used, so a row's mask depends on its key and ``L`` only: however the
batch is split into micro-batches, and wherever the row sits in it, the update is the same.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from ..contracts import DiffusionTokenBatch, LossOutput, WeightedMetric, validate_diffusion_logits
from ..models.protocol import TokenDenoiser
from ..seeding import RowStreams

NOISE_SEEDS = "noise_seeds"


class MaskedDiffusionSFTConfig(BaseModel):
    """Masked-diffusion SFT: ``weighting`` of the masked CE (``plain`` or MDLM's
    ``inverse_t``) and ``t ~ U(eps, 1)``. Strict types, finite floats."""

    model_config = ConfigDict(extra="forbid", strict=True)

    weighting: Literal["plain", "inverse_t"] = "plain"
    eps: float = Field(default=1e-3, gt=0.0, lt=1.0, allow_inf_nan=False)


def sanitised_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, active: torch.Tensor
) -> torch.Tensor:
    """Float32 CE ``[B, L]`` that is exactly 0 on inactive slots, whatever their logits/ids."""
    logits = torch.where(active[..., None], logits.float(), torch.zeros((), device=logits.device))
    targets = torch.where(active, targets, torch.zeros_like(targets))
    ce = -torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return torch.where(active, ce, torch.zeros_like(ce))


class MaskedDiffusionSFT:
    """``loss_fn(model, batch, generator) -> LossOutput`` for :class:`~diffusion_rl.train.Trainer`
    (``generator`` is accepted for the trainer's call shape and ignored: every draw comes from
    the batch's per-row ``noise_seeds``)."""

    name = "masked_diffusion_sft"

    def __init__(self, config: MaskedDiffusionSFTConfig | None = None) -> None:
        self.config = config or MaskedDiffusionSFTConfig()

    def metadata(self) -> dict:
        return {"name": self.name, **self.config.model_dump()}

    def noise(self, batch: DiffusionTokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(t [B], u [B, L])`` on the CPU, float32, from the rows' own streams (see the
        module docstring); a slot is masked iff active and ``u < t``."""
        keys = batch.model_inputs.get(NOISE_SEEDS)
        if keys is None:
            raise ValueError(
                f"model_inputs: missing {NOISE_SEEDS!r}, the per-row noise keys (int64 [B]) SFT "
                "draws its masks from; add model_inputs['noise_seeds'] = "
                "diffusion_rl.seeding.noise_keys(example_ids, seed, step)"
            )
        streams = RowStreams(keys, f"model_inputs[{NOISE_SEEDS!r}]")
        eps = self.config.eps
        t = eps + (1 - eps) * streams.rand()
        return t, streams.rand(batch.target_ids.shape[1])

    def __call__(
        self, model: TokenDenoiser, batch: DiffusionTokenBatch, generator: torch.Generator
    ) -> LossOutput:
        prompt_ids = batch.model_inputs["prompt_ids"]
        prompt_mask = batch.model_inputs["prompt_mask"].bool()
        targets, weights = batch.target_ids, batch.loss_weights.float()
        active = batch.active
        t, u = self.noise(batch)
        masked = (u < t[:, None]).to(targets.device) & active
        t = t.to(targets.device)
        mask_id = model.mask_token_id
        canvas = torch.where(masked | ~active, torch.full_like(targets, mask_id), targets)
        key_mask = torch.cat([prompt_mask, torch.ones_like(canvas, dtype=torch.bool)], dim=1)
        logits = model(torch.cat([prompt_ids, canvas], 1), key_mask, prompt_ids.shape[1])
        logits = logits[:, prompt_ids.shape[1] :].float()
        validate_diffusion_logits(batch, logits)
        logits = logits.index_fill(-1, torch.tensor([mask_id], device=logits.device), -math.inf)

        w = torch.where(masked, weights, torch.zeros_like(weights))
        if self.config.weighting == "inverse_t":
            w = w / t[:, None]
        ce = sanitised_cross_entropy(logits, targets, w != 0)
        correct = (logits.argmax(-1) == targets).float()
        denominator = w.sum().detach()
        return LossOutput(
            primary=WeightedMetric((w * ce).sum(), denominator),
            aux_metrics={
                "sft/token_accuracy": WeightedMetric((w * correct).sum().detach(), denominator),
                "sft/masked_fraction": masked.float().sum() / active.float().sum().clamp_min(1),
            },
        )
