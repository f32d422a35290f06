"""The built-in prompt-conditioned flow-matching DiT, in pixel space.

Implements :class:`~diffusion_rl.models.protocol.VelocityModel`: the latent is the image
scaled to ``[-1, 1]`` (``latent_shape = (C, S, S)``), ``decode`` maps it back to ``[0, 1]``.
Convention (docs/math.md §5): ``x_σ = (1 - σ) x0 + σ ε``, the network predicts ``v = ε - x0``.

Architecture (a small DiT): the latent is cut into ``p × p`` patches, each linearly embedded
with a learned position; the prompt's word tokens (learned embeddings plus a learned slot
position) are *prepended* to the patch sequence of a bidirectional transformer whose padding
keys are masked out. Every block is modulated adaLN-Zero style by ``c = MLP(sin/cos features
of 1000 σ) + Linear(masked mean of the prompt's word embeddings)``; the output layer is
zero-initialised, so a fresh model predicts ``v = 0``.

Prompts are tokenised by words (lower-cased, split on whitespace) over ``config.vocabulary``:
id 0 is padding, word ``k`` has id ``k + 1``; ``encode_prompts`` pads every row to
``max_prompt_tokens``, so conditional and unconditional (all-padding, ``empty_condition``)
rows always concatenate for classifier-free guidance. So that guidance has an unconditional
model to push away from, train some rows on the null prompt: the flow SFT objective's
``cond_dropout`` replaces a random subset of rows by ``empty_condition`` rows;
:meth:`FlowDiT.drop_condition` does the same for a given bool mask.

Invariants: a row's velocity does not depend on its batch mates (every op is per row; padding
keys are masked); no randomness in the forward (deterministic); ``save_pretrained`` /
``from_pretrained`` round-trip bitwise.
"""

from __future__ import annotations

import json
import math
import numbers
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from safetensors.torch import load_model, save_model
from torch import nn

from .protocol import Conditioning

MODEL_TYPE = "diffusion_rl.flow_dit"
PAD_ID = 0
# The words a default FlowDiT embeds (word k has id k + 1, so the order is part of the model):
# the mini-GenEval prompt words, in the order of the GenEval task's ``VOCABULARY`` (a test
# checks the two agree; the model package imports no task). A saved model records its own list.
DEFAULT_VOCABULARY: tuple[str, ...] = (
    *("a", "on", "at", "in", "the", "one", "two", "three"),
    *("red", "green", "blue", "yellow"),
    *("circle", "square", "triangle", "circles", "squares", "triangles"),
    *("left", "right", "top", "bottom", "center"),
)


# The largest sizes a FlowDiTConfig accepts (documented limits, checked before anything is
# allocated, so an untrusted config.json cannot ask for terabytes). ``patches`` bounds the
# patch sequence ``(image_size / patch_size)²``, ``vocabulary`` the number of prompt words.
SIZE_LIMITS: dict[str, int | float] = {
    "image_size": 4096,
    "channels": 64,
    "patch_size": 4096,
    "d_model": 1 << 16,
    "n_layers": 1024,
    "n_heads": 1024,
    "mlp_ratio": 64.0,
    "sigma_features": 1 << 16,
    "max_prompt_tokens": 4096,
    "vocabulary": 1 << 20,
    "patches": 1 << 16,
}
_INTEGER_FIELDS = (
    "image_size",
    "channels",
    "patch_size",
    "d_model",
    "n_layers",
    "n_heads",
    "sigma_features",
    "max_prompt_tokens",
)


class FlowDiTConfig(BaseModel):
    """Size and prompt vocabulary of :class:`FlowDiT` (unknown keys are rejected).

    ``vocabulary`` lists the prompt words (default: the mini-GenEval words); ``task`` is free
    JSON recorded with the model (e.g. ``GenEvalTask.info()``) so later stages rebuild the
    task it was trained for. The default (16 px, patches of 4, 96 wide, 4 layers) has 0.73 M
    parameters. Sizes are integers (a bool, float or string is refused, not coerced) within
    :data:`SIZE_LIMITS`; ``mlp_ratio`` and ``norm_eps`` are positive finite numbers.
    """

    model_config = ConfigDict(extra="forbid")

    image_size: int = Field(default=16, gt=0, le=SIZE_LIMITS["image_size"])
    channels: int = Field(default=3, gt=0, le=SIZE_LIMITS["channels"])
    patch_size: int = Field(default=4, gt=0, le=SIZE_LIMITS["patch_size"])
    d_model: int = Field(default=96, gt=0, le=SIZE_LIMITS["d_model"])
    n_layers: int = Field(default=4, gt=0, le=SIZE_LIMITS["n_layers"])
    n_heads: int = Field(default=4, gt=0, le=SIZE_LIMITS["n_heads"])
    mlp_ratio: float = Field(default=4.0, gt=0, le=SIZE_LIMITS["mlp_ratio"], allow_inf_nan=False)
    sigma_features: int = Field(default=64, gt=0, le=SIZE_LIMITS["sigma_features"])
    vocabulary: tuple[str, ...] = Field(
        default=DEFAULT_VOCABULARY, max_length=SIZE_LIMITS["vocabulary"]
    )
    max_prompt_tokens: int = Field(default=8, gt=0, le=SIZE_LIMITS["max_prompt_tokens"])
    norm_eps: float = Field(default=1e-6, gt=0.0, allow_inf_nan=False)
    task: dict[str, Any] | None = None

    @field_validator(*_INTEGER_FIELDS, mode="before")
    @classmethod
    def _integers_only(cls, value):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"expected an integer, got {type(value).__name__} {value!r}")
        return value

    @model_validator(mode="after")
    def _check(self) -> FlowDiTConfig:
        if self.image_size % self.patch_size:
            raise ValueError(
                f"image_size: must be divisible by patch_size={self.patch_size}, "
                f"got {self.image_size}"
            )
        patches = (self.image_size // self.patch_size) ** 2
        if patches > SIZE_LIMITS["patches"]:
            raise ValueError(
                f"patch_size: image_size={self.image_size} in patches of {self.patch_size} gives "
                f"{patches} patches, more than the limit {SIZE_LIMITS['patches']}; use larger "
                "patches"
            )
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model: must be divisible by n_heads={self.n_heads}, got {self.d_model}"
            )
        if self.sigma_features % 2:
            raise ValueError(f"sigma_features: must be even, got {self.sigma_features}")
        words = list(self.vocabulary)
        bad = [w for w in words if not w or w != w.lower() or len(w.split()) != 1]
        if not words or bad or len(set(words)) != len(words):
            raise ValueError(
                "vocabulary: expected distinct, non-empty, lower-case single words, got "
                f"{bad or words}"
            )
        return self


def parameter_count(config: FlowDiTConfig) -> int:
    """The number of parameters of ``FlowDiT(config)``, from the sizes alone (nothing is
    allocated); equal to ``model.num_parameters()``.

    With ``D`` width, ``P = C p²`` values per patch, ``G² = (S / p)²`` patches, ``W`` words,
    ``T`` prompt slots, ``E`` σ features, ``H = max(1, round(mlp_ratio D))`` and ``L`` layers:
    patch embedding ``P D + D`` and positions ``G² D``; word embeddings ``(W + 1) D``, slot
    positions ``T D``, prompt pool ``D² + D``; σ MLP ``E D + D + D² + D``; per block QKV
    ``3 D² + 3 D``, projection ``D² + D``, MLP ``2 D H + H + D``, adaLN ``6 D² + 6 D``; final
    adaLN ``2 D² + 2 D``; output ``D P + P``.
    """
    d, h = config.d_model, max(1, round(config.mlp_ratio * config.d_model))
    per_patch = config.channels * config.patch_size**2
    patches = (config.image_size // config.patch_size) ** 2
    embed = per_patch * d + d + patches * d
    prompt = (len(config.vocabulary) + 1) * d + config.max_prompt_tokens * d + d * d + d
    sigma = config.sigma_features * d + d + d * d + d
    block = (3 * d * d + 3 * d) + (d * d + d) + (2 * d * h + h + d) + (6 * d * d + 6 * d)
    final = (2 * d * d + 2 * d) + (d * per_patch + per_patch)
    return embed + prompt + sigma + config.n_layers * block + final


def sigma_features(sigma: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal features ``[B, dim]`` of ``t = 1000 σ`` (``σ`` float ``[B]``): ``cos`` then
    ``sin`` at frequencies ``10000^(-k / (dim / 2))``, computed in float32."""
    half = dim // 2
    freqs = torch.exp(
        -math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=sigma.device) / half
    )
    args = 1000.0 * sigma.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale[:, None]) + shift[:, None]


class DiTBlock(nn.Module):
    """Pre-norm attention + MLP, each scaled/shifted/gated by the conditioning (adaLN-Zero)."""

    def __init__(self, cfg: FlowDiTConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.norm1 = nn.LayerNorm(d, elementwise_affine=False, eps=cfg.norm_eps)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d, elementwise_affine=False, eps=cfg.norm_eps)
        hidden = max(1, round(cfg.mlp_ratio * d))
        self.mlp = nn.Sequential(
            nn.Linear(d, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, d)
        )
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))

    def forward(self, x: torch.Tensor, c: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """``x [B, T, D]``, ``c [B, D]``, ``bias [B, 1, 1, T]`` additive key mask."""
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(c).chunk(6, dim=-1)
        b, t, d = x.shape
        h = _modulate(self.norm1(x), shift1, scale1)
        q, k, v = self.qkv(h).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias
        )
        x = x + gate1[:, None] * self.proj(y.transpose(1, 2).reshape(b, t, d))
        h = _modulate(self.norm2(x), shift2, scale2)
        return x + gate2[:, None] * self.mlp(h)


class FlowDiT(nn.Module):
    """A prompt-conditioned velocity network on pixel latents; see the module docstring.

    A subclass (e.g. :class:`~diffusion_rl.models.video_dit.VideoDiT`) sets ``model_type``
    (recorded in ``config.json``) and ``config_class`` to reuse :meth:`save_pretrained` /
    :meth:`from_pretrained`, ``conditioning_keys`` / ``conditioning_fix`` for the input checks,
    and reuses :meth:`_transformer` (prompt tokens, σ conditioning, blocks, output projection)
    around its own patching.
    """

    model_type = MODEL_TYPE
    config_class = FlowDiTConfig
    size_limits = SIZE_LIMITS
    parameter_count = staticmethod(parameter_count)
    lora_targets = ("qkv", "proj", "mlp.0", "mlp.2")  # default LoRA targets (peft)
    # The keys ``forward`` needs in ``cond`` and what an error about them says to do.
    conditioning_keys: tuple[str, ...] = ("prompt_ids", "prompt_mask")
    conditioning_fix = "build it with encode_prompts / empty_condition"

    def __init__(self, config: FlowDiTConfig) -> None:
        super().__init__()
        self.config = config
        d, p, c = config.d_model, config.patch_size, config.channels
        self.grid = config.image_size // p
        self.latent_shape: tuple[int, ...] = (c, config.image_size, config.image_size)
        self._word_ids = {w: i + 1 for i, w in enumerate(config.vocabulary)}
        self.patch_embed = nn.Linear(c * p * p, d)
        self.patch_pos = nn.Parameter(torch.zeros(self.grid * self.grid, d))
        self.word_embed = nn.Embedding(len(config.vocabulary) + 1, d)
        self.prompt_pos = nn.Parameter(torch.zeros(config.max_prompt_tokens, d))
        self.prompt_pool = nn.Linear(d, d)
        self.sigma_mlp = nn.Sequential(
            nn.Linear(config.sigma_features, d), nn.SiLU(), nn.Linear(d, d)
        )
        self.blocks = nn.ModuleList(DiTBlock(config) for _ in range(config.n_layers))
        self.final_norm = nn.LayerNorm(d, elementwise_affine=False, eps=config.norm_eps)
        self.final_ada = nn.Sequential(nn.SiLU(), nn.Linear(d, 2 * d))
        self.out = nn.Linear(d, c * p * p)
        self._init_weights()

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        nn.init.normal_(self.word_embed.weight, std=0.02)
        nn.init.normal_(self.patch_pos, std=0.02)
        nn.init.normal_(self.prompt_pos, std=0.02)
        for ada in [block.ada for block in self.blocks] + [self.final_ada]:
            nn.init.zeros_(ada[-1].weight)
            nn.init.zeros_(ada[-1].bias)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # ------------------------------------------------------------------ conditioning
    def encode_prompts(self, prompts: Sequence[str]) -> Conditioning:
        """``{"prompt_ids": long [B, T], "prompt_mask": bool [B, T]}`` with
        ``T = max_prompt_tokens`` (right-padded with id 0, mask False there).

        Raises:
            ValueError: a word outside ``config.vocabulary`` or a prompt longer than
                ``max_prompt_tokens`` words (the message names the prompt and the fix).
        """
        if isinstance(prompts, str):
            raise TypeError("encode_prompts: expected a sequence of prompt strings, got a str")
        limit = self.config.max_prompt_tokens
        ids = torch.full((len(prompts), limit), PAD_ID, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            words = prompt.lower().split()
            unknown = [w for w in words if w not in self._word_ids]
            if unknown:
                raise ValueError(
                    f"encode_prompts: prompt {row} {prompt!r} has words {unknown} outside the "
                    f"model's vocabulary {list(self.config.vocabulary)}"
                )
            if len(words) > limit:
                raise ValueError(
                    f"encode_prompts: prompt {row} {prompt!r} has {len(words)} words, more than "
                    f"max_prompt_tokens={limit}; build the model with a larger max_prompt_tokens"
                )
            ids[row, : len(words)] = torch.tensor([self._word_ids[w] for w in words])
        device = self.patch_pos.device
        return {"prompt_ids": ids.to(device), "prompt_mask": (ids != PAD_ID).to(device)}

    def empty_condition(self, batch_size: int) -> Conditioning:
        """The unconditional (null prompt) conditioning: all padding, ``[B, T]``."""
        limit, device = self.config.max_prompt_tokens, self.patch_pos.device
        return {
            "prompt_ids": torch.full((batch_size, limit), PAD_ID, dtype=torch.long, device=device),
            "prompt_mask": torch.zeros((batch_size, limit), dtype=torch.bool, device=device),
        }

    @staticmethod
    def drop_condition(cond: Conditioning, drop: torch.Tensor) -> Conditioning:
        """``cond`` with the rows where ``drop`` (bool ``[B]``) is True replaced by the null
        prompt (for classifier-free-guidance training; the input is not modified)."""
        ids, mask = cond["prompt_ids"], cond["prompt_mask"]
        if drop.shape != (ids.shape[0],) or drop.dtype != torch.bool:
            raise ValueError(
                f"drop: expected a bool tensor [{ids.shape[0]}], got {drop.dtype} "
                f"{tuple(drop.shape)}"
            )
        keep = ~drop.to(ids.device)[:, None]
        return {"prompt_ids": torch.where(keep, ids, PAD_ID), "prompt_mask": mask & keep}

    # ------------------------------------------------------------------ pixels
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Pixels ``[B, C, S, S]`` in ``[0, 1]``: ``clamp((x + 1) / 2, 0, 1)``."""
        return ((latents + 1) / 2).clamp(0, 1)

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Latents ``2 x - 1`` of images ``[B, C, S, S]`` in ``[0, 1]`` (SFT targets ``x0``)."""
        if images.dim() != 4 or tuple(images.shape[1:]) != self.latent_shape:
            raise ValueError(
                f"images: expected [B, {', '.join(map(str, self.latent_shape))}], got "
                f"{tuple(images.shape)}"
            )
        return images * 2 - 1

    # ------------------------------------------------------------------ forward
    def _check_latents(self, latents: torch.Tensor) -> None:
        if latents.dim() != 4 or tuple(latents.shape[1:]) != self.latent_shape:
            raise ValueError(
                f"latents: expected [B, {', '.join(map(str, self.latent_shape))}], got "
                f"{tuple(latents.shape)}"
            )

    def _check_cond(self, cond: Conditioning, batch_size: int) -> None:
        missing = set(self.conditioning_keys) - set(cond)
        if missing:
            raise ValueError(f"cond: missing {sorted(missing)}; {self.conditioning_fix}")
        ids, mask = cond["prompt_ids"], cond["prompt_mask"]
        b, limit = batch_size, self.config.max_prompt_tokens
        if ids.dim() != 2 or ids.shape[0] != b or ids.shape[1] > limit or mask.shape != ids.shape:
            raise ValueError(
                f"cond: prompt_ids and prompt_mask must be [{b}, T<={limit}], got "
                f"{tuple(ids.shape)} and {tuple(mask.shape)}"
            )

    def _check_inputs(self, latents, sigma, cond) -> torch.Tensor:
        """Checks latents, then σ, then ``cond``; returns σ as a ``[B]`` tensor."""
        self._check_latents(latents)
        b = latents.shape[0]
        sigma = torch.as_tensor(sigma, device=latents.device)
        if sigma.dim() == 0:
            sigma = sigma.expand(b)
        if sigma.shape != (b,):
            raise ValueError(
                f"sigma: expected shape [{b}] (one σ per row), got {tuple(sigma.shape)}"
            )
        self._check_cond(cond, b)
        return sigma

    def _transformer(
        self, patches: torch.Tensor, sigma: torch.Tensor, cond: Conditioning
    ) -> torch.Tensor:
        """The patch tokens' outputs ``[B, N, C p²]`` (model dtype) for embedded patch tokens
        ``patches`` ``[B, N, D]`` (positions added): the prompt's word tokens are prepended
        (padding keys masked), every block is modulated by ``c = σ MLP + pooled prompt``."""
        dtype = self.patch_embed.weight.dtype
        ids, mask = cond["prompt_ids"], cond["prompt_mask"].bool()
        words = self.word_embed(ids) * mask[..., None]
        tokens = words + self.prompt_pos[: ids.shape[1]]
        pooled = words.sum(1) / mask.sum(1, keepdim=True).clamp_min(1)
        c = self.sigma_mlp(sigma_features(sigma, self.config.sigma_features).to(dtype))
        c = c + self.prompt_pool(pooled)

        x = torch.cat([tokens, patches], dim=1)
        keys = torch.cat([mask, mask.new_ones(patches.shape[:2])], dim=1)
        zero = torch.zeros((), dtype=dtype, device=x.device)
        bias = torch.where(keys, zero, torch.finfo(dtype).min)[:, None, None, :]
        for block in self.blocks:
            x = block(x, c, bias)
        shift, scale = self.final_ada(c).chunk(2, dim=-1)
        return self.out(_modulate(self.final_norm(x[:, ids.shape[1] :]), shift, scale))

    def forward(
        self, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning
    ) -> torch.Tensor:
        """Velocity ``[B, C, S, S]`` (dtype of ``latents``) for ``latents`` at noise level
        ``sigma`` float ``[B]`` under the prompt ``cond``."""
        sigma = self._check_inputs(latents, sigma, cond)
        dtype = self.patch_embed.weight.dtype
        b, ch, p, g = latents.shape[0], self.config.channels, self.config.patch_size, self.grid
        patches = latents.to(dtype).reshape(b, ch, g, p, g, p).permute(0, 2, 4, 1, 3, 5)
        patches = self.patch_embed(patches.reshape(b, g * g, ch * p * p)) + self.patch_pos
        out = self._transformer(patches, sigma, cond)
        out = out.view(b, g, g, ch, p, p).permute(0, 3, 1, 4, 2, 5)
        return out.reshape(b, *self.latent_shape).to(latents.dtype)

    # ------------------------------------------------------------------ save / load
    def save_pretrained(self, directory: str | Path) -> Path:
        """Write ``config.json`` (model type, sizes, vocabulary, task) and
        ``model.safetensors`` into ``directory``, replacing it atomically."""
        directory = Path(directory)
        directory.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
        config = {"model_type": self.model_type, **self.config.model_dump(mode="json")}
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_model(self, str(staging / "model.safetensors"))
        retired = directory.with_name(f".{directory.name}.old")
        if directory.exists():
            shutil.rmtree(retired, ignore_errors=True)
            directory.rename(retired)
        staging.rename(directory)
        shutil.rmtree(retired, ignore_errors=True)
        return directory

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> FlowDiT:
        """The model (of this class, in eval mode) saved by :meth:`save_pretrained` in
        ``directory``; its ``config.json`` must name ``cls.model_type``."""
        directory = Path(directory)
        config_path = directory / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(
                f"model directory {directory}: no config.json (is it a saved {cls.__name__}?)"
            )
        config = json.loads(config_path.read_text())
        model_type = config.pop("model_type", None)
        if model_type != cls.model_type:
            raise ValueError(
                f"{config_path}: model_type must be {cls.model_type!r}, got {model_type!r} (load "
                "any model directory with diffusion_rl.models.load_model)"
            )
        model = cls(cls.config_class(**config))
        load_model(model, str(directory / "model.safetensors"))
        return model.eval()
