"""The built-in masked-diffusion transformer, at any size.

Pre-norm transformer with learned absolute positions and same-position (target-aligned)
logits, bidirectional or block-causal attention through SDPA with *float* additive masks
(docs/pitfalls.md, "Boolean 4D attention masks ignored" and "FlexAttention without CPU
backward"). Block-causal models offer an exact block KV cache for decoding.

Positions: ``position = cumsum(key_mask) - 1`` so left padding of the prompt never shifts
the positions of real tokens; a row's logits do not depend on how much its batch mates pad.
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from safetensors.torch import load_model, save_model
from torch import nn
from torch.utils.checkpoint import checkpoint

MODEL_TYPE = "diffusion_rl.transformer"


# The largest sizes a TransformerConfig accepts (documented limits, checked before anything is
# allocated, so an untrusted config.json cannot ask for terabytes): far above any model this
# project trains, far below what would overflow memory arithmetic.
SIZE_LIMITS: dict[str, int] = {
    "vocab_size": 1 << 20,
    "d_model": 1 << 16,
    "n_layers": 1024,
    "n_heads": 1024,
    "d_ff": 1 << 18,
    "max_seq_len": 1 << 20,
    "block_size": 1 << 20,
}
_INTEGER_FIELDS = ("vocab_size", "mask_token_id", *SIZE_LIMITS)


class TransformerConfig(BaseModel):
    """Size and behaviour of :class:`DiffusionTransformer`.

    Sizes are integers (a bool, float or string is refused, not coerced) within
    :data:`SIZE_LIMITS`; ``norm_eps`` is a positive finite number.
    """

    model_config = ConfigDict(extra="forbid")

    vocab_size: int = Field(gt=1, le=SIZE_LIMITS["vocab_size"])
    mask_token_id: int = Field(ge=0)
    d_model: int = Field(default=128, gt=0, le=SIZE_LIMITS["d_model"])
    n_layers: int = Field(default=4, gt=0, le=SIZE_LIMITS["n_layers"])
    n_heads: int = Field(default=4, gt=0, le=SIZE_LIMITS["n_heads"])
    d_ff: int | None = Field(default=None, gt=0, le=SIZE_LIMITS["d_ff"])
    max_seq_len: int = Field(default=64, gt=0, le=SIZE_LIMITS["max_seq_len"])
    attention: Literal["bidirectional", "block_causal"] = "block_causal"
    block_size: int | None = Field(default=4, le=SIZE_LIMITS["block_size"])
    tie_embeddings: bool = True
    norm_eps: float = Field(default=1e-5, gt=0.0, allow_inf_nan=False)

    @field_validator(*_INTEGER_FIELDS, mode="before")
    @classmethod
    def _integers_only(cls, value):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, numbers.Integral)
        ):
            raise ValueError(f"expected an integer, got {type(value).__name__} {value!r}")
        return value

    @model_validator(mode="after")
    def _check(self) -> TransformerConfig:
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model: must be divisible by n_heads={self.n_heads}, got {self.d_model}"
            )
        if self.mask_token_id >= self.vocab_size:
            raise ValueError(
                f"mask_token_id: must be < vocab_size={self.vocab_size}, got {self.mask_token_id}"
            )
        if self.attention == "block_causal" and (self.block_size is None or self.block_size < 1):
            raise ValueError(
                f"block_size: a block_causal model needs block_size >= 1, got {self.block_size}"
            )
        return self


def parameter_count(config: TransformerConfig) -> int:
    """The number of parameters of ``DiffusionTransformer(config)``, from the sizes alone
    (nothing is allocated); equal to ``model.num_parameters()`` (a tied head adds none).

    With ``V`` vocabulary, ``D`` width, ``F`` MLP width (``d_ff`` or ``4 D``), ``S`` positions
    and ``L`` layers: embeddings ``V D + S D``; per block two LayerNorms (``4 D``), QKV
    (``3 D² + 3 D``), output projection (``D² + D``) and MLP (``2 D F + F + D``); the final
    LayerNorm ``2 D``; an untied head ``V D``.
    """
    v, d, s, n = config.vocab_size, config.d_model, config.max_seq_len, config.n_layers
    f = config.d_ff or 4 * d
    block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (2 * d * f + f + d)
    head = 0 if config.tie_embeddings else v * d
    return v * d + s * d + n * block + 2 * d + head


@dataclass
class BlockKVCache:
    """Keys/values of the prompt and of the committed blocks.

    ``keys[l]``/``values[l]``: per layer ``[B, H, n, Dh]`` (None before the prompt runs);
    ``key_mask``: bool ``[B, n]``; ``next_position``: ``[B]`` position id of the next token.
    Extending builds new tensors (no in-place writes), so a replay with gradients can run
    through the cache and differentiate the cached prefix too; within a block every step
    reuses the same cached tensors.
    """

    keys: list[torch.Tensor | None]
    values: list[torch.Tensor | None]
    key_mask: torch.Tensor
    next_position: torch.Tensor

    @property
    def length(self) -> int:
        return self.key_mask.shape[1]


class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(
        self,
        x: torch.Tensor,
        bias: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """``x [B, T, D]``; ``bias [B, 1, T, T_past + T]`` additive; returns out and new k/v."""
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        k_all, v_all = k, v
        if past is not None:
            k_all = torch.cat([past[0], k], dim=2)
            v_all = torch.cat([past[1], v], dim=2)
        y = F.scaled_dot_product_attention(
            q, k_all.to(q.dtype), v_all.to(q.dtype), attn_mask=bias.to(q.dtype)
        )
        return self.out(y.transpose(1, 2).reshape(b, t, d)), (k, v)


class Block(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        d_ff = cfg.d_ff or 4 * cfg.d_model
        self.norm1 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.norm2 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, d_ff), nn.GELU(), nn.Linear(d_ff, cfg.d_model)
        )

    def forward(self, x, bias, past=None):
        a, kv = self.attn(self.norm1(x), bias, past)
        x = x + a
        return x + self.mlp(self.norm2(x)), kv


class DiffusionTransformer(nn.Module):
    """Masked-diffusion LM implementing :class:`~diffusion_rl.models.TokenDenoiser`
    (and :class:`~diffusion_rl.models.BlockCachedDenoiser` when block-causal)."""

    alignment = "same_position"
    config_class = TransformerConfig
    size_limits = SIZE_LIMITS
    parameter_count = staticmethod(parameter_count)
    lora_targets = ("attn.qkv", "attn.out", "mlp.0", "mlp.2")  # default LoRA targets (peft)

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.max_seq_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = nn.LayerNorm(config.d_model, eps=config.norm_eps)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        self.activation_checkpointing = False
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("out.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * config.n_layers))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    # ------------------------------------------------------------------ protocol fields
    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def attention(self) -> str:
        return self.config.attention

    @property
    def block_size(self) -> int | None:
        return self.config.block_size if self.config.attention == "block_causal" else None

    def enable_activation_checkpointing(self, enabled: bool = True) -> None:
        """Recompute each block's activations in backward (less memory, ~30% more compute)."""
        self.activation_checkpointing = enabled

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # ------------------------------------------------------------------ full canvas
    def block_ids(self, total_length: int, prompt_length: int, device) -> torch.Tensor:
        """Block index per canvas position: 0 for the prompt, ``1 + k // block_size`` after."""
        idx = torch.arange(total_length, device=device)
        if self.block_size is None:
            return torch.zeros_like(idx)
        return torch.where(idx < prompt_length, 0, 1 + (idx - prompt_length) // self.block_size)

    def attention_bias(self, key_mask: torch.Tensor, prompt_length: int) -> torch.Tensor:
        """Float additive mask ``[B, 1, T, T]``: 0 where query i may see key j, else finfo.min."""
        t = key_mask.shape[1]
        allowed = key_mask[:, None, None, :].expand(-1, 1, t, t)
        if self.block_size is not None:
            blocks = self.block_ids(t, prompt_length, key_mask.device)
            allowed = allowed & (blocks[None, :] <= blocks[:, None])[None, None]
        zero = torch.zeros((), dtype=torch.float32, device=key_mask.device)
        return torch.where(allowed, zero, torch.finfo(torch.float32).min)

    def _run(self, x: torch.Tensor, bias: torch.Tensor, pasts=None):
        kvs = []
        for i, block in enumerate(self.blocks):
            past = None if pasts is None else pasts[i]
            if self.activation_checkpointing and self.training and torch.is_grad_enabled():
                x, kv = checkpoint(block, x, bias, past, use_reentrant=False)
            else:
                x, kv = block(x, bias, past)
            kvs.append(kv)
        return self.head(self.norm(x)), kvs

    def _embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= self.config.vocab_size:
            raise ValueError(
                f"input_ids: ids must be in [0, vocab_size={self.config.vocab_size}), got "
                f"[{low}, {high}]; is the tokenizer the model's?"
            )
        if int(positions.max()) >= self.config.max_seq_len:
            raise ValueError(
                f"input_ids: position {int(positions.max())} exceeds max_seq_len="
                f"{self.config.max_seq_len}; build the model with a larger max_seq_len"
            )
        return self.tok_emb(input_ids) + self.pos_emb(positions)

    def forward(
        self, input_ids: torch.Tensor, key_mask: torch.Tensor | None = None, prompt_length: int = 0
    ) -> torch.Tensor:
        """Target-aligned logits ``[B, T, V]`` for the canvas ``input_ids [B, T]``."""
        if key_mask is None:
            key_mask = torch.ones_like(input_ids, dtype=torch.bool)
        positions = (key_mask.long().cumsum(1) - 1).clamp_min(0)
        logits, _ = self._run(
            self._embed(input_ids, positions), self.attention_bias(key_mask, prompt_length)
        )
        return logits

    def forward_packed(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, allowed: torch.Tensor
    ) -> torch.Tensor:
        """Logits ``[B, T, V]`` for an arbitrary packed layout: ``position_ids [B, T]`` and a
        bool ``allowed [B, T, T]`` (query i may attend to key j). Used by packed replay, where
        one sequence holds the clean completion and a noisy copy of a block per step."""
        if allowed.shape != (*input_ids.shape, input_ids.shape[1]):
            raise ValueError(
                f"allowed: expected [B, T, T] = {(*input_ids.shape, input_ids.shape[1])}, "
                f"got {tuple(allowed.shape)}"
            )
        zero = torch.zeros((), dtype=torch.float32, device=input_ids.device)
        bias = torch.where(allowed, zero, torch.finfo(torch.float32).min)[:, None]
        logits, _ = self._run(self._embed(input_ids, position_ids), bias)
        return logits

    # ------------------------------------------------------------------ block KV cache
    def new_cache(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> BlockKVCache:
        """Run the prompt (block 0) once and cache its keys/values."""
        if self.block_size is None:
            raise TypeError("new_cache: the block KV cache needs a block_causal model")
        cache = BlockKVCache(
            keys=[None for _ in self.blocks],
            values=[None for _ in self.blocks],
            key_mask=prompt_mask.new_zeros((prompt_ids.shape[0], 0), dtype=torch.bool),
            next_position=torch.zeros(
                prompt_ids.shape[0], dtype=torch.long, device=prompt_ids.device
            ),
        )
        self._forward_cached(prompt_ids, prompt_mask.bool(), cache, extend=True)
        return cache

    def forward_block(
        self, block_ids: torch.Tensor, cache: BlockKVCache, *, extend: bool = False
    ) -> torch.Tensor:
        """Logits ``[B, K, V]`` for the next block ``block_ids [B, K]`` attending to the cache
        and to itself (bidirectionally); ``extend`` appends its keys/values."""
        mask = torch.ones_like(block_ids, dtype=torch.bool)
        return self._forward_cached(block_ids, mask, cache, extend)

    def _forward_cached(self, ids, mask, cache: BlockKVCache, extend: bool) -> torch.Tensor:
        k = ids.shape[1]
        positions = cache.next_position[:, None] + (mask.long().cumsum(1) - 1).clamp_min(0)
        key_mask = torch.cat([cache.key_mask, mask], dim=1)
        zero = torch.zeros((), dtype=torch.float32, device=ids.device)
        bias = torch.where(key_mask, zero, torch.finfo(torch.float32).min)[:, None, None, :]
        bias = bias.expand(-1, 1, k, -1)
        pasts = None if cache.keys[0] is None else list(zip(cache.keys, cache.values))
        logits, kvs = self._run(self._embed(ids, positions), bias, pasts)
        if extend:
            for layer, (kk, vv) in enumerate(kvs):
                past_k, past_v = cache.keys[layer], cache.values[layer]
                cache.keys[layer] = kk if past_k is None else torch.cat([past_k, kk], dim=2)
                cache.values[layer] = vv if past_v is None else torch.cat([past_v, vv], dim=2)
            cache.key_mask = key_mask
            cache.next_position = cache.next_position + mask.long().sum(1)
        return logits

    # ------------------------------------------------------------------ save / load
    def save_pretrained(self, directory: str | Path) -> None:
        """Write ``config.json`` and ``model.safetensors`` into ``directory``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = {"model_type": MODEL_TYPE, **self.config.model_dump()}
        (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_model(self, str(directory / "model.safetensors"))

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> DiffusionTransformer:
        directory = Path(directory)
        config_path = directory / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(
                f"model directory {directory}: no config.json (is it a saved model?)"
            )
        config = json.loads(config_path.read_text())
        model_type = config.pop("model_type", None)
        if model_type != MODEL_TYPE:
            raise ValueError(
                f"{config_path}: model_type must be {MODEL_TYPE!r}, got {model_type!r}"
            )
        model = cls(TransformerConfig(**config))
        load_model(model, str(directory / "model.safetensors"))
        return model
