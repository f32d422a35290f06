"""Wan 2.1 text-to-video (``WanPipeline``) as a VelocityModel.

* Transformer: ``WanTransformer3DModel(hidden_states [B, C, F, H, W], timestep = 1000 σ,
  encoder_hidden_states)`` → velocity ``[B, C, F, H, W]``.
* Conditioning: ``prompt_embeds [B, L, D]``, the UMT5 states of the cleaned prompt with every
  position after the prompt's own tokens set to zero (the pipeline's ``encode_prompt``).
* VAE: ``AutoencoderKLWan`` (causal 3D); the transformer sees ``(z - mean) / std`` per
  channel (``latents_mean`` / ``latents_std`` in the VAE config). ``F`` pixel frames become
  ``(F - 1) / t + 1`` latent frames (``t = scale_factor_temporal``, 4 for Wan 2.1).

Wan 2.2's two-expert (``transformer_2``) and per-token-timestep (``expand_timesteps``)
pipelines are refused with an error rather than run with one expert.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from diffusers import (
    AutoencoderKLWan,
    FlowMatchEulerDiscreteScheduler,
    WanPipeline,
    WanTransformer3DModel,
)

from ..protocol import Conditioning
from .base import FlowPipelineAdapter, LoraSettings, check_resolution
from .tiny import seeded, tiny_t5_encoder, tiny_t5_tokenizer

WAN_VAE_CHUNK = 4  # AutoencoderKLWan._encode: the first frame, then 4 frames per chunk


class WanAdapter(FlowPipelineAdapter):
    """Wan pipeline → VelocityModel. ``latent_shape = (z_dim, (num_frames - 1) / t + 1,
    height / s, width / s)``; defaults 480 × 832, 81 frames (diffusers' defaults).
    ``decode`` returns ``[B, num_frames, 3, height, width]``."""

    pipeline_class = WanPipeline
    text_encoder_names = ("text_encoder",)
    tokenizer_names = ("tokenizer",)
    cond_keys = ("prompt_embeds",)
    lora_targets = tuple(
        f"{attn}.{proj}"
        for attn in ("attn1", "attn2")
        for proj in ("to_q", "to_k", "to_v", "to_out.0")
    )  # self- and cross-attention projections

    def __init__(
        self,
        pipeline: WanPipeline,
        *,
        height: int = 480,
        width: int = 832,
        num_frames: int = 81,
        max_sequence_length: int = 512,
        negative_prompt: str = "",
        lora: LoraSettings | None = None,
        save_frozen: bool = False,
    ) -> None:
        if getattr(pipeline, "transformer_2", None) is not None or pipeline.config.get(
            "expand_timesteps"
        ):
            raise ValueError(
                "pipeline: Wan 2.2 two-expert / expand_timesteps pipelines are not supported; "
                "use a single-transformer Wan 2.1 text-to-video directory"
            )
        super().__init__(
            pipeline,
            max_sequence_length=max_sequence_length,
            negative_prompt=negative_prompt,
            lora=lora,
            save_frozen=save_frozen,
        )
        vae = self.vae.config
        spatial, temporal = vae.scale_factor_spatial, vae.scale_factor_temporal
        patch = self.transformer.config.patch_size
        height = check_resolution("height", height, spatial * patch[1])
        width = check_resolution("width", width, spatial * patch[2])
        # AutoencoderKLWan encodes the first frame, then chunks of 4 frames (hard-coded), each
        # to 4 / temporal latent frames: only 1 + multiples of 4 encode to ``latent_shape``.
        chunk = math.lcm(temporal, WAN_VAE_CHUNK)
        if not isinstance(num_frames, int) or num_frames < 1 or (num_frames - 1) % chunk:
            raise ValueError(
                f"num_frames: expected 1 + a multiple of {temporal} (the VAE's temporal "
                f"factor) and of {WAN_VAE_CHUNK} (the frames its encoder takes at a time), "
                f"got {num_frames!r}"
            )
        self.latent_shape = (
            vae.z_dim,
            (num_frames - 1) // temporal + 1,
            height // spatial,
            width // spatial,
        )

    @property
    def output_shape(self) -> tuple[int, int, int, int]:
        """``(num_frames, 3, height, width)``: the clip :meth:`decode` gives per row."""
        vae = self.vae.config
        _, frames, height, width = self.latent_shape
        spatial = vae.scale_factor_spatial
        return ((frames - 1) * vae.scale_factor_temporal + 1, 3, height * spatial, width * spatial)

    def encode_videos(self, clips: torch.Tensor) -> torch.Tensor:
        """Clips ``[B, F, 3, H, W]`` in ``[0, 1]`` → latents (the posterior mean):
        :meth:`encode_images` under the name the video recipes call."""
        return self.encode_images(clips)

    def _velocity(self, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning):
        return self.transformer(
            hidden_states=latents,
            timestep=sigma.float() * 1000,
            encoder_hidden_states=cond["prompt_embeds"],
            return_dict=False,
        )[0]

    def _encode(self, prompts: list[str]) -> Conditioning:
        prompt_embeds, _ = self.as_pipeline().encode_prompt(
            prompt=prompts,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
            device=self.device,
        )
        return {"prompt_embeds": prompt_embeds}

    def _latent_stats(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mean, 1 / std)`` shaped ``[1, C, 1, 1, 1]``; the reciprocal is formed first, as
        diffusers does, so :meth:`decode` matches ``WanPipeline`` bitwise."""
        config = self.vae.config
        shape = (1, config.z_dim, 1, 1, 1)
        mean = torch.tensor(config.latents_mean).view(shape).to(latents)
        inv_std = 1.0 / torch.tensor(config.latents_std).view(shape).to(latents)
        return mean, inv_std

    def _to_vae(self, latents: torch.Tensor) -> torch.Tensor:
        mean, inv_std = self._latent_stats(latents)
        return latents / inv_std + mean

    def _from_vae(self, latents: torch.Tensor) -> torch.Tensor:
        mean, inv_std = self._latent_stats(latents)
        return (latents - mean) * inv_std

    def _vae_pixels_to_output(self, pixels: torch.Tensor) -> torch.Tensor:
        # [B, 3, F, H, W] → [B, F, 3, H, W]
        return super()._vae_pixels_to_output(pixels).permute(0, 2, 1, 3, 4)

    def _output_to_vae_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        return pixels.permute(0, 2, 1, 3, 4)

    @classmethod
    def _tiny_components(cls, seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """A 32-wide UMT5, a 2-level causal 3D VAE (4 latent channels, spatial and temporal
        factor 2), two transformer blocks (2 heads × 12, patch 1×2×2). Videos are 5 frames of
        16 × 16 (diffusers checks multiples of 16) → latents ``(4, 3, 8, 8)``."""
        with seeded(seed):
            tokenizer = tiny_t5_tokenizer(16)
            components = {
                "tokenizer": tokenizer,
                "text_encoder": tiny_t5_encoder(tokenizer, 32, umt5=True),
                "vae": AutoencoderKLWan(
                    base_dim=4,
                    z_dim=4,
                    dim_mult=[1, 1],
                    num_res_blocks=1,
                    temperal_downsample=[True],
                    latents_mean=[0.1, -0.2, 0.3, 0.0],
                    latents_std=[1.5, 0.8, 2.0, 1.2],
                    scale_factor_spatial=2,
                    scale_factor_temporal=2,
                ),
                "transformer": WanTransformer3DModel(
                    patch_size=(1, 2, 2),
                    num_attention_heads=2,
                    attention_head_dim=12,
                    in_channels=4,
                    out_channels=4,
                    text_dim=32,
                    freq_dim=32,
                    ffn_dim=32,
                    num_layers=2,
                    rope_max_seq_len=32,
                ),
                "scheduler": FlowMatchEulerDiscreteScheduler(shift=3.0),
            }
        return components, {"height": 16, "width": 16, "num_frames": 5, "max_sequence_length": 16}
