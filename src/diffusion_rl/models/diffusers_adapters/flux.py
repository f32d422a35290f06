"""FLUX.1 (``FluxPipeline``) as a VelocityModel.

* Latents stay unpacked ``[B, C, H, W]`` outside; inside, each 2×2 patch becomes one token of
  ``4 C`` channels, row-major over ``(H/2, W/2)`` (``pack``/``unpack`` below, the layout of
  diffusers' ``FluxPipeline._pack_latents``). Image ids are ``(0, row, col)`` per token; text
  ids are zeros ``[L, 3]``.
* The transformer takes ``timestep = σ`` (it multiplies by 1000 itself) and, for
  guidance-distilled checkpoints (``guidance_embeds``: FLUX.1-dev), a guidance value per row,
  ``guidance_scale`` (default 3.5); FLUX.1-schnell has none.
* Conditioning: ``prompt_embeds [B, L, D]`` (T5 states) and ``pooled_prompt_embeds [B, P]``
  (CLIP's pooled output).
* VAE: ``AutoencoderKL``; the transformer sees ``(z - shift_factor) · scaling_factor``.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
)

from ..protocol import Conditioning
from .base import JOINT_ATTENTION_LORA_TARGETS, FlowPipelineAdapter, LoraSettings, check_resolution
from .tiny import seeded, tiny_clip_encoder, tiny_clip_tokenizer, tiny_t5_encoder, tiny_t5_tokenizer


def pack(latents: torch.Tensor) -> torch.Tensor:
    """``[B, C, H, W]`` → ``[B, (H/2)(W/2), 4C]``; token ``(i, j)`` holds
    ``latents[:, c, 2i + a, 2j + b]`` at channel ``4c + 2a + b``."""
    b, c, h, w = latents.shape
    patches = latents.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(b, (h // 2) * (w // 2), 4 * c)


def unpack(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Inverse of :func:`pack` for latents of ``height × width``."""
    b, _, channels = tokens.shape
    c = channels // 4
    patches = tokens.reshape(b, height // 2, width // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return patches.reshape(b, c, height, width)


def image_ids(height: int, width: int, device, dtype) -> torch.Tensor:
    """``[(H/2)(W/2), 3]`` position ids ``(0, row, col)`` of the packed tokens."""
    rows = torch.arange(height // 2, device=device).repeat_interleave(width // 2)
    cols = torch.arange(width // 2, device=device).repeat(height // 2)
    return torch.stack([torch.zeros_like(rows), rows, cols], dim=1).to(dtype)


class FluxAdapter(FlowPipelineAdapter):
    """FLUX pipeline → VelocityModel. ``latent_shape = (C, height / f, width / f)`` with
    ``C = in_channels / 4``; ``height``/``width`` default to 1024 (diffusers' default) and
    must be multiples of ``2 f``."""

    pipeline_class = FluxPipeline
    text_encoder_names = ("text_encoder", "text_encoder_2")
    tokenizer_names = ("tokenizer", "tokenizer_2")
    cond_keys = ("prompt_embeds", "pooled_prompt_embeds")
    lora_targets = JOINT_ATTENTION_LORA_TARGETS

    def __init__(
        self,
        pipeline: FluxPipeline,
        *,
        height: int | None = None,
        width: int | None = None,
        max_sequence_length: int = 512,
        guidance_scale: float = 3.5,
        negative_prompt: str = "",
        lora: LoraSettings | None = None,
        save_frozen: bool = False,
    ) -> None:
        super().__init__(
            pipeline,
            max_sequence_length=max_sequence_length,
            negative_prompt=negative_prompt,
            lora=lora,
            save_frozen=save_frozen,
        )
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        f = self.vae_scale_factor
        height = check_resolution("height", height or 1024, 2 * f)
        width = check_resolution("width", width or 1024, 2 * f)
        self.latent_shape = (self.transformer.config.in_channels // 4, height // f, width // f)
        self.guidance_scale = float(guidance_scale)

    def _velocity(self, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning):
        batch, _, height, width = latents.shape
        prompt_embeds = cond["prompt_embeds"]
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full((batch,), self.guidance_scale, device=latents.device)
        tokens = self.transformer(
            hidden_states=pack(latents),
            timestep=sigma.to(latents.dtype),
            guidance=guidance,
            pooled_projections=cond["pooled_prompt_embeds"],
            encoder_hidden_states=prompt_embeds,
            txt_ids=prompt_embeds.new_zeros(prompt_embeds.shape[1], 3),
            img_ids=image_ids(height, width, latents.device, latents.dtype),
            return_dict=False,
        )[0]
        return unpack(tokens, height, width)

    def _encode(self, prompts: list[str]) -> Conditioning:
        prompt_embeds, pooled, _ = self.as_pipeline().encode_prompt(
            prompt=prompts,
            prompt_2=None,
            device=self.device,
            max_sequence_length=self.max_sequence_length,
        )
        return {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}

    def _to_vae(self, latents: torch.Tensor) -> torch.Tensor:
        config = self.vae.config
        return latents / config.scaling_factor + config.shift_factor

    def _from_vae(self, latents: torch.Tensor) -> torch.Tensor:
        config = self.vae.config
        return (latents - config.shift_factor) * config.scaling_factor

    @classmethod
    def _tiny_components(cls, seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """A 16-wide CLIP (pooled 16), a 32-wide T5, a 2-level VAE (f = 2, 4 latent
        channels), one double and one single block (2 heads × 16, rope axes 4 + 6 + 6) with a
        guidance embedding (like FLUX.1-dev). Pictures are 16 × 16 → latents ``(4, 8, 8)``,
        16 packed tokens."""
        with seeded(seed):
            tokenizer, tokenizer_2 = tiny_clip_tokenizer(16), tiny_t5_tokenizer(16)
            components = {
                "tokenizer": tokenizer,
                "tokenizer_2": tokenizer_2,
                "text_encoder": tiny_clip_encoder(tokenizer, 16, projection=None),
                "text_encoder_2": tiny_t5_encoder(tokenizer_2, 32),
                "vae": AutoencoderKL(
                    down_block_types=("DownEncoderBlock2D",) * 2,
                    up_block_types=("UpDecoderBlock2D",) * 2,
                    block_out_channels=(8, 16),
                    layers_per_block=1,
                    latent_channels=4,
                    norm_num_groups=4,
                    sample_size=16,
                    scaling_factor=0.3611,
                    shift_factor=0.1159,
                    use_quant_conv=False,
                    use_post_quant_conv=False,
                ),
                "transformer": FluxTransformer2DModel(
                    patch_size=1,
                    in_channels=16,
                    num_layers=1,
                    num_single_layers=1,
                    attention_head_dim=16,
                    num_attention_heads=2,
                    joint_attention_dim=32,
                    pooled_projection_dim=16,
                    guidance_embeds=True,
                    axes_dims_rope=(4, 6, 6),
                ),
                "scheduler": FlowMatchEulerDiscreteScheduler(
                    shift=3.0, use_dynamic_shifting=True, base_image_seq_len=16
                ),
            }
        return components, {"height": 16, "width": 16, "max_sequence_length": 16}
