"""Classifier-free guidance: the one velocity combination the flow sampler and replay share.

docs/math.md §5. With guidance scale ``s`` the guided velocity is

    v = v_u + s (v_c − v_u)

where ``v_c`` / ``v_u`` are the model's velocities under the conditional / unconditional
conditioning. Both halves run as ONE batched forward of ``2B`` rows (conditional rows first)
and are combined in float32; ``s = 1`` (``uncond`` None) runs the conditional rows only.

Invariant: the sampler (:mod:`diffusion_rl.sampling.flow`) and the replay scorer
(:mod:`diffusion_rl.scoring.flow`) both call :func:`guided_velocity`, so the replayed
velocity — and hence the replayed log-prob — matches the rollout's bitwise (same forward
shapes, same combination, same rounding).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # types only: this module sits below the models
    from .models.protocol import Conditioning, VelocityModel

__all__ = ["guided_velocity"]


def guided_velocity(
    model: VelocityModel,
    latents: torch.Tensor,
    sigma: torch.Tensor,
    cond: Conditioning,
    uncond: Conditioning | None,
    guidance_scale: float,
) -> torch.Tensor:
    """Float32 velocity ``[B, *latent]``; the one CFG combination sampler and replay share.

    ``uncond`` None (guidance 1): ``model(x, σ, cond)``. Else ONE forward of ``2B`` rows,
    conditional first: ``v = v_u + g (v_c − v_u)``.
    """
    if uncond is None:
        return model(latents, sigma, cond).float()
    if set(cond) != set(uncond):
        raise ValueError(
            f"uncond: expected the keys of cond {sorted(cond)}, got {sorted(uncond)}; the two "
            "halves of classifier-free guidance run as one batch"
        )
    both = {key: torch.cat([cond[key], uncond[key]]) for key in cond}
    velocity = model(torch.cat([latents, latents]), torch.cat([sigma, sigma]), both).float()
    v_cond, v_uncond = velocity.chunk(2)
    return v_uncond + guidance_scale * (v_cond - v_uncond)
