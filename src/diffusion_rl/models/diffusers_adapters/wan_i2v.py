"""Wan 2.1 image-to-video (``WanImageToVideoPipeline``) as a VelocityModel conditioned on a
first frame and a prompt: the second stage of a text → image → video workflow.

Everything of :mod:`.wan` holds (timestep ``1000 σ``, velocity ``ε - x0``, latents
``[B, z_dim, F', H/s, W/s]`` normalised with the VAE's ``latents_mean`` / ``latents_std``,
``decode`` → ``[B, F, 3, H, W]`` in ``[0, 1]``, LoRA, checkpoints of the transformer only).
What the first frame adds, as the pipeline builds it for Wan 2.1 I2V:

* ``cond["condition"]`` float32 ``[B, t + z_dim, F', H/s, W/s]`` (``t`` = the VAE's temporal
  factor): a mask (all ``t`` channels 1 on the first latent frame, 0 after) ⊕ the normalised
  VAE latent of the video ``[first frame, F - 1 grey frames]`` (pixels ``2 x - 1``, so the
  grey frames are 0). The transformer takes ``cat([latents, condition], channels)``; its
  ``in_channels`` must be ``2 z_dim + t``.
* ``cond["image_embeds"]`` ``[B, tokens, image_dim]`` when the transformer has an image
  projection (``image_dim`` set): the CLIP vision tower's penultimate hidden states
  (``encode_image``), passed as ``encoder_hidden_states_image``.
* ``cond["prompt_embeds"]``: the UMT5 states exactly as in :mod:`.wan`.

Invariants of :meth:`WanImageToVideoAdapter.encode_conditioning`:

* deterministic: the VAE encode takes the posterior's mode (the pipeline's
  ``retrieve_latents(..., sample_mode="argmax")``), never a sample (DanceGRPO's I2V script
  samples it, so its replayed conditioning is not the rollout's);
* the first frame is the exact float tensor, never quantised to 8 bits: the VAE input is
  ``2 x - 1`` (the pipeline's ``video_processor`` on a tensor), and CLIP's preprocessing
  (shortest-edge bicubic resize with antialiasing, centre crop, mean / std — the image
  processor's own settings) runs in torch on it. On 8-bit images at CLIP's resolution this
  equals the image processor's output bitwise. The pipeline's own tensor path would rescale
  ``[0, 1]`` pixels by 1/255 a second time inside the CLIP processor, so it is not followed;
* each row's image conditioning is encoded alone (batch 1, as the pipeline encodes its one
  image), so it does not depend on its batch mates, bitwise.

Refused with a ``ValueError`` naming the config key: Wan 2.2's two-expert pipelines
(``transformer_2`` / ``boundary_ratio``), its clean-first-frame ``expand_timesteps`` variant
(the stepped first-frame slot would need excluding from the log-probs, docs/pitfalls.md) and
first-last-frame transformers (``pos_embed_seq_len``). With an image projection the text
context must be 512 tokens (``max_sequence_length``): diffusers' Wan attention splits image
from text tokens at a hard-coded text length of 512, so any other length silently feeds
text tokens to the image attention.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from diffusers import WanImageToVideoPipeline, WanTransformer3DModel

from ..protocol import Conditioning
from .base import FlowPipelineAdapter, LoraSettings
from .tiny import (
    seeded,
    tiny_clip_image_processor,
    tiny_clip_vision_encoder,
    tiny_t5_encoder,
    tiny_t5_tokenizer,
)
from .wan import WanAdapter

__all__ = ["WanImageToVideoAdapter"]

# diffusers' WanAttnProcessor: ``image_context_length = encoder_hidden_states.shape[1] - 512``.
WAN_I2V_TEXT_LENGTH = 512
# PIL resampling codes (``image_processor.resample``) torch can interpolate with antialiasing.
RESAMPLE_MODES = {2: "bilinear", 3: "bicubic"}
_FIX_COND = (
    "build cond with encode_conditioning(prompts, images) and uncond with "
    "empty_conditioning(images)"
)


def _size_entry(size: Any, key: str) -> int | None:
    """``size[key]`` of an image processor's ``size`` / ``crop_size`` (a dict, or
    transformers 5's ``SizeDict``), None when absent."""
    value = size.get(key) if isinstance(size, dict) else getattr(size, key, None)
    return None if value is None else int(value)


class WanImageToVideoAdapter(WanAdapter):
    """``WanImageToVideoPipeline`` → image-to-video VelocityModel; see the module docstring.

    ``latent_shape = (z_dim, (num_frames - 1) / t + 1, height / s, width / s)``,
    ``image_shape = (3, height, width)`` (the first frame it takes), ``num_frames`` the
    pixel frames of :meth:`decode`. Defaults: 480 × 832, 81 frames, 512 text tokens
    (diffusers' defaults for Wan 2.1 I2V 480P).
    """

    pipeline_class = WanImageToVideoPipeline

    def __init__(
        self,
        pipeline: WanImageToVideoPipeline,
        *,
        height: int = 480,
        width: int = 832,
        num_frames: int = 81,
        max_sequence_length: int = WAN_I2V_TEXT_LENGTH,
        negative_prompt: str = "",
        lora: LoraSettings | None = None,
        save_frozen: bool = False,
    ) -> None:
        if not isinstance(pipeline, WanImageToVideoPipeline):
            raise TypeError(
                f"pipeline: WanImageToVideoAdapter wraps a WanImageToVideoPipeline, got "
                f"{type(pipeline).__name__}"
            )
        _check_supported(pipeline, max_sequence_length)
        super().__init__(
            pipeline,
            height=height,
            width=width,
            num_frames=num_frames,
            max_sequence_length=max_sequence_length,
            negative_prompt=negative_prompt,
            lora=lora,
            save_frozen=save_frozen,
        )
        self.uses_image_embeds = self.transformer.config.image_dim is not None
        self.image_encoder = pipeline.image_encoder  # None, or used only with image_dim
        self.image_processor = pipeline.image_processor
        if self.image_encoder is not None:
            self.image_encoder.requires_grad_(False)
            self.image_encoder.eval()
        self.cond_keys = ("prompt_embeds", "condition") + (
            ("image_embeds",) if self.uses_image_embeds else ()
        )
        self.num_frames = num_frames
        self.image_shape = (3, height, width)
        z_dim, latent_frames, latent_height, latent_width = self.latent_shape
        temporal = self.vae.config.scale_factor_temporal
        self.condition_shape = (temporal + z_dim, latent_frames, latent_height, latent_width)

    # ------------------------------------------------------------------ construction
    def as_pipeline(self) -> WanImageToVideoPipeline:
        """The pipeline over this adapter's modules (shared), image encoder included."""
        pipeline = super().as_pipeline()
        pipeline.register_modules(
            image_encoder=self.image_encoder, image_processor=self.image_processor
        )
        return pipeline

    def frozen_modules(self) -> list[torch.nn.Module]:
        # ``getattr``: the base constructor asks before the image encoder is attached.
        image_encoder = getattr(self, "image_encoder", None)
        return super().frozen_modules() + ([image_encoder] if image_encoder is not None else [])

    # ------------------------------------------------------------------ conditioning
    def encode_prompts(self, prompts: list[str]) -> Conditioning:
        """Refused: the transformer needs the first frame too (the error says what to pass)."""
        raise ValueError(
            "encode_prompts: a Wan image-to-video model is conditioned on the prompt AND the "
            f"first frame, so a prompt alone cannot condition it; {_FIX_COND}"
        )

    def empty_condition(self, batch_size: int) -> Conditioning:
        """Refused: the unconditional branch keeps the first frame (the error says the fix)."""
        raise ValueError(
            "empty_condition: the unconditional branch of a Wan image-to-video model keeps the "
            "first frame; pass uncond=adapter.empty_conditioning(images)"
        )

    def encode_conditioning(self, prompts: list[str], images: torch.Tensor) -> Conditioning:
        """``prompt_embeds`` of ``prompts`` plus the image conditioning of ``images``
        ``[B, 3, H, W]`` in ``[0, 1]`` (one first frame per prompt; see the module
        docstring). Deterministic, no gradient."""
        cond = FlowPipelineAdapter.encode_prompts(self, prompts)
        return {**cond, **self.image_conditioning(images, rows=len(prompts))}

    def empty_conditioning(self, images: torch.Tensor) -> Conditioning:
        """The classifier-free-guidance branch: ``negative_prompt`` (default ``""``) encoded
        once and repeated, with the SAME image conditioning as :meth:`encode_conditioning`
        (the pipeline gives both branches the same ``condition`` and ``image_embeds``)."""
        image_cond = self.image_conditioning(images)
        rows = image_cond["condition"].shape[0]
        one = FlowPipelineAdapter.encode_prompts(self, [self.negative_prompt])
        prompt = {k: v.expand(rows, *v.shape[1:]).clone() for k, v in one.items()}
        return {**prompt, **image_cond}

    def image_conditioning(self, images: torch.Tensor, rows: int | None = None) -> Conditioning:
        """``{"condition"}`` (and ``{"image_embeds"}`` with an image projection) of
        ``images`` ``[B, 3, H, W]`` in ``[0, 1]``, row by row; ``rows``: the expected B."""
        self._check_images(images, rows)
        with torch.no_grad():
            parts = [self._encode_first_frame(images[b : b + 1]) for b in range(len(images))]
        return {key: torch.cat([part[key] for part in parts]) for key in parts[0]}

    def _encode_first_frame(self, image: torch.Tensor) -> Conditioning:
        """One image ``[1, 3, H, W]`` → its ``condition`` (and ``image_embeds``)."""
        device = self.device
        pixels = image.to(device=device, dtype=torch.float32) * 2 - 1
        grey = pixels.new_zeros(1, 3, self.num_frames - 1, *pixels.shape[-2:])
        video = torch.cat([pixels.unsqueeze(2), grey], dim=2)
        posterior = self.vae.encode(video.to(self.vae.dtype)).latent_dist
        latent = self._from_vae(posterior.mode().to(device=device, dtype=torch.float32))
        temporal = self.vae.config.scale_factor_temporal
        mask = torch.zeros(1, temporal, *latent.shape[2:], device=device)
        mask[:, :, 0] = 1  # the first latent frame holds the given frame
        out = {"condition": torch.cat([mask, latent], dim=1)}
        if self.uses_image_embeds:
            clip_pixels = self.clip_pixels(image.to(device=device, dtype=torch.float32))
            hidden = self.image_encoder(pixel_values=clip_pixels, output_hidden_states=True)
            out["image_embeds"] = hidden.hidden_states[-2].to(device)
        return out

    def clip_pixels(self, images: torch.Tensor) -> torch.Tensor:
        """CLIP's input for float ``images`` ``[B, 3, H, W]`` in ``[0, 1]``: the image
        processor's resize (shortest edge, or height × width), centre crop and mean / std,
        in torch (no 8-bit rounding); float32."""
        processor = self.image_processor
        x = images.float()
        if processor.do_resize:
            x = self._clip_resize(x, processor)
        if processor.do_center_crop:
            crop_h = _size_entry(processor.crop_size, "height")
            crop_w = _size_entry(processor.crop_size, "width")
            height, width = x.shape[-2:]
            if crop_h is None or crop_w is None or crop_h > height or crop_w > width:
                raise ValueError(
                    f"image_processor.crop_size: expected a height × width within the resized "
                    f"{height} × {width} image, got {processor.crop_size}"
                )
            top, left = (height - crop_h) // 2, (width - crop_w) // 2
            x = x[..., top : top + crop_h, left : left + crop_w]
        if processor.do_normalize:
            mean = torch.tensor(processor.image_mean, dtype=torch.float32, device=x.device)
            std = torch.tensor(processor.image_std, dtype=torch.float32, device=x.device)
            x = (x - mean.view(1, -1, 1, 1)) / std.view(1, -1, 1, 1)
        return x

    @staticmethod
    def _clip_resize(x: torch.Tensor, processor) -> torch.Tensor:
        height, width = x.shape[-2:]
        shortest = _size_entry(processor.size, "shortest_edge")
        if shortest is not None and _size_entry(processor.size, "longest_edge") is None:
            # transformers' get_resize_output_image_size(default_to_square=False)
            short, long = min(height, width), max(height, width)
            new_short, new_long = shortest, int(shortest * long / short)
            target = (new_long, new_short) if width <= height else (new_short, new_long)
        elif _size_entry(processor.size, "height") and _size_entry(processor.size, "width"):
            target = (_size_entry(processor.size, "height"), _size_entry(processor.size, "width"))
        else:
            raise ValueError(
                "image_processor.size: expected {'shortest_edge': n} or {'height', 'width'}, "
                f"got {processor.size}"
            )
        if target == (height, width):
            return x
        mode = RESAMPLE_MODES.get(int(processor.resample))
        if mode is None:
            raise ValueError(
                f"image_processor.resample: expected bilinear (2) or bicubic (3), got "
                f"{processor.resample!r}"
            )
        return F.interpolate(x, size=target, mode=mode, align_corners=False, antialias=True)

    # ------------------------------------------------------------------ VelocityModel
    def forward(self, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning):
        """``latents [B, *latent_shape]``, ``sigma`` float ``[B]``, ``cond`` from
        :meth:`encode_conditioning` / :meth:`empty_conditioning` → velocity ``ε - x0``."""
        missing = [key for key in self.cond_keys if key not in cond]
        if missing:
            raise KeyError(f"cond: missing {missing}; {_FIX_COND}")
        expected = tuple(self.condition_shape)
        if tuple(cond["condition"].shape[1:]) != expected:
            raise ValueError(
                f"cond['condition']: expected [B, {', '.join(map(str, expected))}], got "
                f"{tuple(cond['condition'].shape)}; {_FIX_COND} of this adapter"
            )
        return super().forward(latents, sigma, cond)

    def _velocity(self, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning):
        return self.transformer(
            hidden_states=torch.cat([latents, cond["condition"]], dim=1),
            timestep=sigma.float() * 1000,
            encoder_hidden_states=cond["prompt_embeds"],
            encoder_hidden_states_image=cond.get("image_embeds"),
            return_dict=False,
        )[0]

    # ------------------------------------------------------------------ helpers
    def _check_images(self, images: torch.Tensor, rows: int | None) -> None:
        layout = f"[B, {', '.join(map(str, self.image_shape))}]"
        if not isinstance(images, torch.Tensor):
            raise TypeError(f"images: expected a tensor {layout}, got {type(images).__name__}")
        if not images.dtype.is_floating_point:
            raise TypeError(f"images: expected floating pixels in [0, 1], got {images.dtype}")
        if images.dim() != 4 or tuple(images.shape[1:]) != self.image_shape or not len(images):
            raise ValueError(
                f"images: expected {layout} (image_shape), got {tuple(images.shape)}; resize the "
                "first frame, or build the adapter with its height / width"
            )
        if rows is not None and images.shape[0] != rows:
            raise ValueError(
                f"images: expected one first frame per prompt ({rows}), got {images.shape[0]}"
            )
        if not (bool((images >= 0).all()) and bool((images <= 1).all())):
            raise ValueError(
                f"images: expected pixels in [0, 1] (NaN-free), got values in "
                f"[{float(images.min())}, {float(images.max())}]; scale 0..255 images by 1/255"
            )

    @classmethod
    def _tiny_components(cls, seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """:meth:`WanAdapter._tiny_components`' UMT5, VAE (4 latent channels, factors 2) and
        two blocks, with 4 + 2 + 4 = 10 input channels, cross-attention to 8-wide image
        tokens, and a 2-layer CLIP tower on 16 × 16 images (patch 4: 17 tokens). Videos are
        5 frames of 16 × 16 → latents ``(4, 3, 8, 8)``, condition ``(6, 3, 8, 8)``; the text
        context is 512 tokens, the length Wan's image attention hard-codes."""
        components, defaults = WanAdapter._tiny_components(seed)
        with seeded(seed):
            tokenizer = tiny_t5_tokenizer(WAN_I2V_TEXT_LENGTH)
            components.update(
                tokenizer=tokenizer,
                text_encoder=tiny_t5_encoder(tokenizer, 32, umt5=True),
                transformer=WanTransformer3DModel(
                    patch_size=(1, 2, 2),
                    num_attention_heads=2,
                    attention_head_dim=12,
                    in_channels=10,
                    out_channels=4,
                    text_dim=32,
                    freq_dim=32,
                    ffn_dim=32,
                    num_layers=2,
                    image_dim=8,
                    added_kv_proj_dim=24,
                    rope_max_seq_len=32,
                ),
                image_encoder=tiny_clip_vision_encoder(8, image_size=16, patch_size=4),
                image_processor=tiny_clip_image_processor(16),
            )
        return components, {**defaults, "max_sequence_length": WAN_I2V_TEXT_LENGTH}


def _check_supported(pipeline: WanImageToVideoPipeline, max_sequence_length: int) -> None:
    """Refuse the Wan variants this adapter does not run (named by their config key)."""
    config = pipeline.config
    if pipeline.transformer is None:
        raise ValueError(
            "transformer: the pipeline has none (model_index.json lists it as null); a Wan 2.1 "
            "image-to-video directory has one transformer"
        )
    # ``.get``: diffusers before Wan 2.2 (0.35) has neither key
    if (
        getattr(pipeline, "transformer_2", None) is not None
        or config.get("boundary_ratio") is not None
    ):
        raise ValueError(
            "transformer_2 / boundary_ratio: Wan 2.2 two-expert image-to-video pipelines are not "
            "supported (the velocity would switch experts by σ); use a Wan 2.1 I2V directory"
        )
    if config.get("expand_timesteps"):
        raise ValueError(
            "expand_timesteps: Wan 2.2 clean-first-frame (per-token timestep) pipelines are not "
            "supported; their stepped first-frame slot is overwritten and must be excluded from "
            "the log-probs; use a Wan 2.1 I2V directory (channel-concatenated condition)"
        )
    transformer = pipeline.transformer.config
    if transformer.get("pos_embed_seq_len") is not None:
        raise ValueError(
            "transformer.pos_embed_seq_len: first-last-frame (FLF2V) transformers take two "
            "images per row; this adapter conditions on the first frame only"
        )
    vae = pipeline.vae.config
    expected = 2 * vae.z_dim + vae.scale_factor_temporal
    if transformer.in_channels != expected:
        raise ValueError(
            f"transformer.in_channels: expected 2 × z_dim + scale_factor_temporal = {expected} "
            f"(latents ⊕ mask ⊕ first-frame latent), got {transformer.in_channels}; is this a "
            "text-to-video transformer?"
        )
    if transformer.image_dim is not None:
        for name in ("image_encoder", "image_processor"):
            if getattr(pipeline, name, None) is None:
                raise ValueError(
                    f"{name}: the transformer has image_dim={transformer.image_dim} (CLIP image "
                    f"conditioning) but the pipeline has no {name}; model_index.json must "
                    "list it"
                )
    if transformer.added_kv_proj_dim is not None and max_sequence_length != WAN_I2V_TEXT_LENGTH:
        raise ValueError(
            f"max_sequence_length: expected {WAN_I2V_TEXT_LENGTH} for a transformer with image "
            f"cross-attention (added_kv_proj_dim), got {max_sequence_length!r}; diffusers' Wan "
            f"attention splits image from text tokens at {WAN_I2V_TEXT_LENGTH} text tokens"
        )
