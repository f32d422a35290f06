"""Stable Diffusion 3 / 3.5 (``StableDiffusion3Pipeline``) as a VelocityModel.

* Transformer: ``SD3Transformer2DModel(hidden_states [B, C, H, W], timestep = 1000 σ,
  encoder_hidden_states, pooled_projections)`` → velocity ``[B, C, H, W]``.
* Conditioning (from the pipeline's ``encode_prompt``): ``prompt_embeds [B, L, D]`` = the two
  CLIP encoders' penultimate states side by side, zero-padded to the T5 width, followed by the
  T5 states (``L = 77 + max_sequence_length`` for the real model);
  ``pooled_prompt_embeds [B, P]`` = both CLIP projections concatenated.
* VAE: ``AutoencoderKL``; the transformer sees ``(z - shift_factor) · scaling_factor``.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)

from ..protocol import Conditioning
from .base import JOINT_ATTENTION_LORA_TARGETS, FlowPipelineAdapter, LoraSettings, check_resolution
from .tiny import seeded, tiny_clip_encoder, tiny_clip_tokenizer, tiny_t5_encoder, tiny_t5_tokenizer


class SD3Adapter(FlowPipelineAdapter):
    """SD3 pipeline → VelocityModel. ``latent_shape = (C, height / f, width / f)`` with ``f``
    the VAE's downsampling factor; ``height``/``width`` (pixels) default to the transformer's
    ``sample_size · f`` (1024 for SD3 medium / 3.5)."""

    pipeline_class = StableDiffusion3Pipeline
    text_encoder_names = ("text_encoder", "text_encoder_2", "text_encoder_3")
    tokenizer_names = ("tokenizer", "tokenizer_2", "tokenizer_3")
    cond_keys = ("prompt_embeds", "pooled_prompt_embeds")
    lora_targets = JOINT_ATTENTION_LORA_TARGETS

    def __init__(
        self,
        pipeline: StableDiffusion3Pipeline,
        *,
        height: int | None = None,
        width: int | None = None,
        max_sequence_length: int = 256,
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
        config = self.transformer.config
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        multiple = self.vae_scale_factor * config.patch_size
        height = check_resolution(
            "height", height or config.sample_size * self.vae_scale_factor, multiple
        )
        width = check_resolution(
            "width", width or config.sample_size * self.vae_scale_factor, multiple
        )
        f = self.vae_scale_factor
        self.latent_shape = (config.in_channels, height // f, width // f)

    def _velocity(self, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning):
        return self.transformer(
            hidden_states=latents,
            timestep=sigma.float() * 1000,
            encoder_hidden_states=cond["prompt_embeds"],
            pooled_projections=cond["pooled_prompt_embeds"],
            return_dict=False,
        )[0]

    def _encode(self, prompts: list[str]) -> Conditioning:
        prompt_embeds, _, pooled, _ = self.as_pipeline().encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            do_classifier_free_guidance=False,
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
        """Two 16-wide CLIPs (projections 16 + 16 = pooled 32), a 32-wide T5, a 2-level VAE
        (f = 2, 4 latent channels), a 1-layer transformer (2 heads × 8, patch 2).
        Pictures are 16 × 16 pixels → latents ``(4, 8, 8)``."""
        with seeded(seed):
            tokenizer, tokenizer_2 = tiny_clip_tokenizer(16), tiny_clip_tokenizer(16)
            tokenizer_3 = tiny_t5_tokenizer(16)
            components = {
                "tokenizer": tokenizer,
                "tokenizer_2": tokenizer_2,
                "tokenizer_3": tokenizer_3,
                "text_encoder": tiny_clip_encoder(tokenizer, 16, projection=16),
                "text_encoder_2": tiny_clip_encoder(tokenizer_2, 16, projection=16),
                "text_encoder_3": tiny_t5_encoder(tokenizer_3, 32),
                "vae": AutoencoderKL(
                    down_block_types=("DownEncoderBlock2D",) * 2,
                    up_block_types=("UpDecoderBlock2D",) * 2,
                    block_out_channels=(8, 16),
                    layers_per_block=1,
                    latent_channels=4,
                    norm_num_groups=4,
                    sample_size=16,
                    scaling_factor=1.5305,
                    shift_factor=0.0609,
                ),
                "transformer": SD3Transformer2DModel(
                    sample_size=8,
                    patch_size=2,
                    in_channels=4,
                    out_channels=4,
                    num_layers=1,
                    attention_head_dim=8,
                    num_attention_heads=2,
                    joint_attention_dim=32,
                    caption_projection_dim=16,
                    pooled_projection_dim=32,
                    pos_embed_max_size=8,
                ),
                "scheduler": FlowMatchEulerDiscreteScheduler(shift=3.0),
            }
        return components, {"max_sequence_length": 16}
