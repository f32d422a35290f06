"""The built-in image-to-video flow model: :class:`~diffusion_rl.models.dit.FlowDiT` on clips,
conditioned on the prompt and a first frame.

Implements :class:`~diffusion_rl.models.protocol.VelocityModel` for video: the latent is the
clip scaled to ``[-1, 1]``, channel-first like Wan (``latent_shape = (C, F, S, S)``, ``C = 3``);
``decode`` maps it back to frame-major pixels ``[B, F, 3, S, S]`` in ``[0, 1]``. Same flow
convention as FlowDiT (docs/math.md §5): ``x_σ = (1 - σ) x0 + σ ε``, ``v = ε - x0``, one σ per
clip.

First-frame conditioning by channel concatenation: every frame ``f`` of the noisy clip is
stacked over channels with the first frame's latent ``2 · image - 1`` (repeated at every
frame, as Stable Video Diffusion concatenates its conditioning latent to each frame, so a
frame's patch sees the first frame at the same place and a small motion is a local edit) and
a mask channel marking the given frame (1 at ``f = 0``, 0 elsewhere, as in Wan2.1
image-to-video), so each ``p × p`` patch token's input has ``(2C + 1) p²`` values. Tokens: the
prompt's word tokens (as FlowDiT) followed by ``F · (S / p)²`` patch tokens, one frame per
patch (no temporal patching), frame-major, each with a spatial position ``patch_pos[G²]`` plus
a frame position ``frame_pos[F]``. Every frame, the first included, is denoised and trained;
the first one is simply given in the clean conditioning channels. The adaLN-Zero blocks, σ MLP,
prompt pooling and zero-initialised output are FlowDiT's (a fresh model predicts ``v = 0``).

Conditioning (``encode_conditioning(prompts, images)``): ``prompt_ids`` / ``prompt_mask`` as
FlowDiT plus ``first_frame`` float32 ``[B, C, S, S]``. ``empty_conditioning(images)`` is the
classifier-free-guidance branch: the null prompt with the SAME first frame. A prompt alone
cannot condition a clip, so ``encode_prompts`` / ``empty_condition`` raise (pass ``cond`` /
``uncond`` to the sampler and to ``flow_sft_batch``).

Invariants: a row's velocity does not depend on its batch mates; the forward is
deterministic; ``save_pretrained`` / ``from_pretrained`` round-trip bitwise.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch
from pydantic import Field, field_validator, model_validator
from torch import nn

from .dit import SIZE_LIMITS, FlowDiT, FlowDiTConfig
from .dit import parameter_count as image_parameter_count
from .protocol import Conditioning

MODEL_TYPE = "diffusion_rl.flow_video_dit"
RGB = 3
CONDITIONING_KEYS = ("prompt_ids", "prompt_mask", "first_frame")

# FlowDiT's limits plus ``num_frames``; ``patches`` here bounds the whole patch sequence
# ``num_frames · (image_size / patch_size)²`` (checked before anything is allocated).
VIDEO_SIZE_LIMITS: dict[str, int | float] = {**SIZE_LIMITS, "num_frames": 1024}

_FIX_COND = (
    "pass cond=model.encode_conditioning(prompts, images) (and, for guidance, "
    "uncond=model.empty_conditioning(images))"
)


class VideoDiTConfig(FlowDiTConfig):
    """:class:`~diffusion_rl.models.dit.FlowDiTConfig` plus ``num_frames`` (integer in
    ``[2, VIDEO_SIZE_LIMITS["num_frames"]]``). ``channels`` must be 3 (the latent is the RGB
    clip) and ``num_frames · (image_size / patch_size)²`` at most
    ``VIDEO_SIZE_LIMITS["patches"]``. The default (16 px, 8 frames, patches of 4, 96 wide, 4
    layers) has 0.73 M parameters."""

    num_frames: int = Field(default=8, ge=2, le=VIDEO_SIZE_LIMITS["num_frames"])

    @field_validator("num_frames", mode="before")
    @classmethod
    def _frames_integer(cls, value):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"expected an integer, got {type(value).__name__} {value!r}")
        return value

    @model_validator(mode="after")
    def _check_video(self) -> VideoDiTConfig:
        if self.channels != RGB:
            raise ValueError(
                f"channels: a VideoDiT's latent is the RGB clip, so channels must be {RGB}, "
                f"got {self.channels}"
            )
        tokens = self.num_frames * (self.image_size // self.patch_size) ** 2
        if tokens > VIDEO_SIZE_LIMITS["patches"]:
            raise ValueError(
                f"num_frames: {self.num_frames} frames of {self.image_size} px in patches of "
                f"{self.patch_size} give {tokens} patch tokens, more than the limit "
                f"{VIDEO_SIZE_LIMITS['patches']}; use fewer frames or larger patches"
            )
        return self


def parameter_count(config: VideoDiTConfig) -> int:
    """The number of parameters of ``VideoDiT(config)``, from the sizes alone (nothing is
    allocated); equal to ``model.num_parameters()``.

    FlowDiT's count (:func:`~diffusion_rl.models.dit.parameter_count`) with the patch embedding
    taking ``(2C + 1) p²`` inputs instead of ``C p²`` (``+ (C + 1) p² D``) and the frame
    positions ``F D``.
    """
    d, p = config.d_model, config.patch_size
    return image_parameter_count(config) + (config.channels + 1) * p * p * d + config.num_frames * d


def _check_pixels(name: str, pixels: torch.Tensor, shape: tuple[int, ...], layout: str) -> None:
    """``pixels``: a floating tensor ``[B, *shape]`` with values in ``[0, 1]``."""
    if not isinstance(pixels, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor {layout}, got {type(pixels).__name__}")
    if pixels.dim() != len(shape) + 1 or tuple(pixels.shape[1:]) != shape:
        raise ValueError(f"{name}: expected {layout}, got {tuple(pixels.shape)}")
    if not pixels.dtype.is_floating_point:
        raise TypeError(f"{name}: expected floating pixels in [0, 1], got {pixels.dtype}")
    if pixels.numel() and not (bool((pixels >= 0).all()) and bool((pixels <= 1).all())):
        raise ValueError(
            f"{name}: expected pixels in [0, 1] (NaN-free), got values in "
            f"[{float(pixels.min())}, {float(pixels.max())}]; scale 0..255 images by 1/255"
        )


class VideoDiT(FlowDiT):
    """An image-to-video velocity network on pixel clips; see the module docstring."""

    model_type = MODEL_TYPE
    config_class = VideoDiTConfig
    size_limits = VIDEO_SIZE_LIMITS
    parameter_count = staticmethod(parameter_count)
    conditioning_keys = CONDITIONING_KEYS
    conditioning_fix = _FIX_COND

    def __init__(self, config: VideoDiTConfig) -> None:
        if not isinstance(config, VideoDiTConfig):
            raise TypeError(f"config: expected a VideoDiTConfig, got {type(config).__name__}")
        super().__init__(config)
        c, p, s, d = config.channels, config.patch_size, config.image_size, config.d_model
        self.num_frames = config.num_frames
        self.latent_shape = (c, config.num_frames, s, s)
        self.image_shape: tuple[int, int, int] = (c, s, s)
        # noisy frame (C p²) ⊕ conditioning frame (C p²) ⊕ mask (p²) per patch
        self.patch_embed = nn.Linear((2 * c + 1) * p * p, d)
        self.frame_pos = nn.Parameter(torch.zeros(config.num_frames, d))
        self._init_weights()

    def _init_weights(self) -> None:
        super()._init_weights()
        if hasattr(self, "frame_pos"):  # FlowDiT.__init__ calls this before frame_pos exists
            nn.init.normal_(self.frame_pos, std=0.02)

    # ------------------------------------------------------------------ conditioning
    def encode_prompts(self, prompts: Sequence[str]) -> Conditioning:
        """Refused: a VideoDiT needs the first frame too (the error says what to pass)."""
        raise ValueError(
            "encode_prompts: a VideoDiT is conditioned on the prompt AND the first frame, so a "
            f"prompt alone cannot condition it; {_FIX_COND}"
        )

    def empty_condition(self, batch_size: int) -> Conditioning:
        """Refused: the unconditional branch keeps the first frame (the error says the fix)."""
        raise ValueError(
            "empty_condition: a VideoDiT's unconditional branch keeps the first frame; pass "
            "uncond=model.empty_conditioning(images)"
        )

    def encode_conditioning(self, prompts: Sequence[str], images: torch.Tensor) -> Conditioning:
        """``{"prompt_ids", "prompt_mask"}`` as :meth:`FlowDiT.encode_prompts` plus
        ``"first_frame"``: float32 ``[B, C, S, S]`` = ``2 · images - 1`` (``images``
        ``[B, 3, S, S]`` in ``[0, 1]``, one per prompt), on the model's device; deterministic.
        """
        if isinstance(prompts, str):
            raise TypeError("prompts: expected a sequence of prompt strings, got a str")
        first = self.encode_images(images)
        if len(prompts) != first.shape[0]:
            raise ValueError(
                f"images: expected one first frame per prompt ({len(prompts)}), got "
                f"{first.shape[0]}"
            )
        return {**FlowDiT.encode_prompts(self, list(prompts)), "first_frame": first}

    def empty_conditioning(self, images: torch.Tensor) -> Conditioning:
        """The classifier-free-guidance branch of :meth:`encode_conditioning`: the null prompt
        (all padding) with the SAME ``first_frame``."""
        first = self.encode_images(images)
        return {**FlowDiT.empty_condition(self, first.shape[0]), "first_frame": first}

    @staticmethod
    def drop_condition(cond: Conditioning, drop: torch.Tensor) -> Conditioning:
        """``cond`` with the prompt of the rows where ``drop`` (bool ``[B]``) is True replaced
        by the null prompt; ``first_frame`` (and any other key) is kept for every row. The
        input is not modified."""
        return {**cond, **FlowDiT.drop_condition(cond, drop)}

    # ------------------------------------------------------------------ pixels
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """First-frame latents ``2 x - 1`` (float32, on the model's device) of images
        ``[B, 3, S, S]`` in ``[0, 1]``."""
        _check_pixels("images", images, self.image_shape, f"[B, {self._dims(self.image_shape)}]")
        return images.to(device=self.patch_pos.device, dtype=torch.float32) * 2 - 1

    def encode_videos(self, clips: torch.Tensor) -> torch.Tensor:
        """Latents ``[B, C, F, S, S]`` (float32, ``2 x - 1``) of frame-major clips
        ``[B, F, 3, S, S]`` in ``[0, 1]`` (the SFT targets ``x0``)."""
        c, f, s, _ = self.latent_shape
        _check_pixels("clips", clips, (f, c, s, s), f"[B, {self._dims((f, c, s, s))}]")
        latents = clips.to(device=self.patch_pos.device, dtype=torch.float32) * 2 - 1
        return latents.transpose(1, 2).contiguous()

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Frame-major pixels ``[B, F, 3, S, S]`` in ``[0, 1]``: ``clamp((x + 1) / 2, 0, 1)``
        of ``latents`` ``[B, C, F, S, S]``."""
        self._check_latents(latents)
        return ((latents + 1) / 2).clamp(0, 1).transpose(1, 2).contiguous()

    # ------------------------------------------------------------------ forward
    @staticmethod
    def _dims(shape: Sequence[int]) -> str:
        return ", ".join(map(str, shape))

    def _check_latents(self, latents: torch.Tensor) -> None:
        if latents.dim() != 5 or tuple(latents.shape[1:]) != self.latent_shape:
            raise ValueError(
                f"latents: expected [B, {self._dims(self.latent_shape)}] (B, C, F, S, S), got "
                f"{tuple(latents.shape)}"
            )

    def _check_cond(self, cond: Conditioning, batch_size: int) -> None:
        if not isinstance(cond, dict):
            raise TypeError(f"cond: expected a dict of tensors; {_FIX_COND}")
        super()._check_cond(cond, batch_size)
        first, b = cond["first_frame"], batch_size
        if tuple(first.shape) != (b, *self.image_shape) or not first.dtype.is_floating_point:
            raise ValueError(
                f"cond: first_frame must be a float [{b}, {self._dims(self.image_shape)}] "
                f"latent, got {first.dtype} {tuple(first.shape)}; {_FIX_COND}"
            )

    def _patch_inputs(self, latents: torch.Tensor, first_frame: torch.Tensor) -> torch.Tensor:
        """Per patch token (frame-major, then row-major patches): noisy frame patch ⊕
        conditioning frame patch ⊕ mask patch → ``[B, F · G², (2C + 1) p²]``."""
        b, c, f, s, _ = latents.shape
        p, g = self.config.patch_size, self.grid
        condition = first_frame[:, :, None].expand(b, c, f, s, s)
        mask = torch.zeros(b, 1, f, s, s, dtype=latents.dtype, device=latents.device)
        mask[:, :, 0] = 1
        stacked = torch.cat([latents, condition, mask], dim=1)
        k = stacked.shape[1]
        patches = stacked.reshape(b, k, f, g, p, g, p).permute(0, 2, 3, 5, 1, 4, 6)
        return patches.reshape(b, f * g * g, k * p * p)

    def forward(
        self, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning
    ) -> torch.Tensor:
        """Velocity ``[B, C, F, S, S]`` (dtype of ``latents``) for ``latents`` at noise level
        ``sigma`` float ``[B]`` under ``cond`` (:meth:`encode_conditioning`)."""
        sigma = self._check_inputs(latents, sigma, cond)
        dtype = self.patch_embed.weight.dtype
        b, (ch, frames, _, _) = latents.shape[0], self.latent_shape
        p, g, d = self.config.patch_size, self.grid, self.config.d_model
        patches = self._patch_inputs(latents.to(dtype), cond["first_frame"].to(dtype))
        positions = (self.frame_pos[:, None] + self.patch_pos[None]).reshape(frames * g * g, d)
        patches = self.patch_embed(patches) + positions
        out = self._transformer(patches, sigma, cond)
        out = out.view(b, frames, g, g, ch, p, p).permute(0, 4, 1, 2, 5, 3, 6)
        return out.reshape(b, *self.latent_shape).to(latents.dtype)
