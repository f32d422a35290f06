"""SDAR / TraDo block-diffusion LMs (JetAstra/SDAR, Gen-Verse TraDo) on transformers' stock
``Qwen3ForCausalLM``.

An SDAR checkpoint is a Qwen3 decoder (RMSNorm, per-head ``q_norm``/``k_norm`` before RoPE,
GQA, SwiGLU, untied or tied head) run with a *block-causal* mask and *same-position* logits:
``logits[:, i]`` predicts token ``i`` (no shift). Its state-dict keys are Qwen3's, so the
weights load into ``Qwen3ForCausalLM`` unchanged, and no remote code ever runs.

Conventions matched exactly (docs/pitfalls.md, "SDAR's blocks start at the canvas, not at the
completion"):

* **Blocks start at the canvas.** The token at real position ``p`` (``cumsum(key_mask) - 1``,
  left padding excluded) is in block ``p // block_size`` and a query sees every key of its
  own and earlier blocks (JetAstra/SDAR ``generate.py``: ``tril(num_blocks)`` repeated
  ``block_size`` times along both axes). So :attr:`SDARDenoiser.block_origin` is
  ``"canvas"``: with ``P_b`` real prompt tokens and ``r_b = P_b % block_size``, the last
  ``r_b`` prompt tokens share a block with the first ``block_size - r_b`` completion slots
  (models/protocol.py). ``prompt_length`` never changes the logits.
* **Mask id** from ``config.json`` ``mask_token_id`` (151669 in the released models).
* **Attention** is an explicit 4-D *bool* mask passed to SDPA (``attn_implementation`` is
  forced to ``"sdpa"``); the released config's ``"attn_implementation": "flex_attention"``,
  ``fuse_cross_entropy``, ``micro_forward``, ``use_deepep``, ``ep_size``, ``skip_checkpoint``,
  ``debug`` and ``use_cache`` are training-code switches and are ignored (kept when saving).
* **Exact block KV cache** (:meth:`SDARDenoiser.new_cache`, :meth:`forward_block`): the
  prefill caches each row's fully-prompt blocks only; the partial block is denoised with its
  prompt tail, as ``generate.py`` ``block_diffusion_generate`` does (there for one row: prefill
  ``prompt_length // block_size`` blocks, then denoise block by block).
* **Packed replay** (:meth:`forward_packed`): any bool ``[B, T, T]`` layout and positions.

Loading, saving, the local-directory check, dtype resolution and activation checkpointing are
:class:`~diffusion_rl.models.hf.common.HFTokenDenoiser`'s (shared with LLaDA and Dream):
safetensors only (``model.safetensors`` or a sharded ``model.safetensors.index.json``), every
key checked strictly (a tied checkpoint may omit ``lm_head.weight``). This module holds what
is SDAR's own: the config checks and Qwen3 mapping, the canvas-origin block mask, the block KV
cache and the packed forward. Requires transformers >= 5.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..loading import ModelConfigError
from .common import (
    CONFIG_FILE,
    LAYER_LIMIT,
    LLAMA_LINEAR_NAMES,
    POSITION_LIMIT,
    HFTokenDenoiser,
    config_bool,
    config_float,
    config_int,
    config_value,
    linear_params,
    protocol_positions,
    require_transformers,
)

MODEL_TYPE = "sdar"

# The largest sizes accepted from a config.json (checked before anything is allocated): far
# above released SDAR models (vocab 151936, hidden 4096, 36 layers), far below absurd.
SIZE_LIMITS: dict[str, int] = {
    "vocab_size": 1 << 22,
    "hidden_size": 1 << 16,
    "intermediate_size": 1 << 18,
    "num_hidden_layers": LAYER_LIMIT,
    "num_attention_heads": LAYER_LIMIT,
    "num_key_value_heads": LAYER_LIMIT,
    "head_dim": 1 << 12,
    "block_size": 1 << 16,
    "max_position_embeddings": POSITION_LIMIT,
}
REQUIRED_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "block_size",
)
"""Size keys every SDAR ``config.json`` names (``mask_token_id`` too, checked against the
vocabulary)."""
IGNORED_KEYS = (
    "attn_implementation",
    "fuse_cross_entropy",
    "micro_forward",
    "use_deepep",
    "ep_size",
    "skip_checkpoint",
    "debug",
    "use_cache",
)
"""Keys of the released config that switch SDAR's *training* code; they never change this
adapter's computation (kept verbatim by :meth:`SDARDenoiser.save_pretrained`)."""

SDARCheckpointError = ModelConfigError
"""An SDAR ``config.json`` this adapter refuses (the message names the file and the key):
:class:`~diffusion_rl.models.loading.ModelConfigError`, the error of every family's config
checks. Weights that do not fit are
:class:`~diffusion_rl.models.hf.common.CheckpointKeyError` (missing / unexpected keys named) or
:class:`~diffusion_rl.models.hf.common.CheckpointFormatError` (not safetensors); all three are
``ValueError``."""


# --------------------------------------------------------------------------------- config
def check_config(config: Any, path: str = CONFIG_FILE) -> dict:
    """Validate an SDAR ``config.json`` dict (``path`` names it in messages) and return the
    resolved sizes: :data:`REQUIRED_SIZES`, ``mask_token_id``, ``num_key_value_heads``
    (default: the heads), ``head_dim`` (default ``hidden_size // num_attention_heads``),
    ``max_position_embeddings`` (default 32768), ``tie_word_embeddings``, ``attention_bias``,
    ``rms_norm_eps``, ``rope_theta``. Refuses (:data:`SDARCheckpointError`) another
    ``model_type``, a missing or non-integer size, sizes beyond :data:`SIZE_LIMITS`, a mask id
    outside the vocabulary, an activation other than SiLU, and a sliding window (not SDAR's
    mask)."""
    if not isinstance(config, Mapping):
        raise SDARCheckpointError(f"{path}: expected a JSON object, got {type(config).__name__}")
    model_type = config.get("model_type")
    if model_type != MODEL_TYPE:
        hint = (
            " (the mixture-of-experts SDAR variant is not supported)"
            if model_type == "sdar_moe"
            else ""
        )
        raise SDARCheckpointError(
            f"{path}: model_type must be {MODEL_TYPE!r} for SDARDenoiser, got {model_type!r}{hint}"
        )
    sizes: dict[str, Any] = {
        key: config_int(config, key, where=path, high=SIZE_LIMITS[key]) for key in REQUIRED_SIZES
    }
    heads = sizes["num_attention_heads"]
    for key, default in (
        ("num_key_value_heads", heads),
        ("head_dim", sizes["hidden_size"] // heads),
        ("max_position_embeddings", 32768),
    ):
        sizes[key] = config_int(config, key, default, where=path, high=SIZE_LIMITS[key])
    sizes["mask_token_id"] = config_int(
        config, "mask_token_id", where=path, low=0, high=sizes["vocab_size"] - 1
    )
    if heads % sizes["num_key_value_heads"]:
        raise SDARCheckpointError(
            f"{path}: num_attention_heads={heads} must be a multiple of num_key_value_heads="
            f"{sizes['num_key_value_heads']}"
        )
    act = config_value(config, "hidden_act", "silu", where=path)
    if act != "silu":
        raise SDARCheckpointError(f"{path}: hidden_act must be 'silu' (SDAR's SwiGLU), got {act!r}")
    if config_bool(config, "use_sliding_window", False, where=path):
        raise SDARCheckpointError(
            f"{path}: use_sliding_window=true is not SDAR's block-causal attention; set it false"
        )
    for key in ("tie_word_embeddings", "attention_bias"):
        sizes[key] = config_bool(config, key, False, where=path)
    for key, default in (("rms_norm_eps", 1e-6), ("rope_theta", 1e6)):
        sizes[key] = config_float(config, key, default, where=path)
    scaling = config.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise SDARCheckpointError(f"{path}: rope_scaling must be null or an object")
    return sizes


def qwen3_config(config: Mapping[str, Any], path: str = CONFIG_FILE):
    """The stock ``Qwen3Config`` of an SDAR ``config.json`` dict, with SDPA attention."""
    sizes = check_config(config, path)
    rope = {"rope_type": "default"}
    if config.get("rope_scaling"):
        scaling = dict(config["rope_scaling"])
        rope = {**scaling, "rope_type": scaling.get("rope_type", scaling.get("type", "default"))}
        rope.pop("type", None)
    rope["rope_theta"] = sizes["rope_theta"]
    qwen = require_transformers().Qwen3Config(
        vocab_size=sizes["vocab_size"],
        hidden_size=sizes["hidden_size"],
        intermediate_size=sizes["intermediate_size"],
        num_hidden_layers=sizes["num_hidden_layers"],
        num_attention_heads=sizes["num_attention_heads"],
        num_key_value_heads=sizes["num_key_value_heads"],
        head_dim=sizes["head_dim"],
        hidden_act="silu",
        max_position_embeddings=sizes["max_position_embeddings"],
        rms_norm_eps=sizes["rms_norm_eps"],
        rope_parameters=rope,
        attention_bias=sizes["attention_bias"],
        attention_dropout=config_float(
            config, "attention_dropout", 0.0, where=path, positive=False
        ),
        tie_word_embeddings=sizes["tie_word_embeddings"],
        use_sliding_window=False,
        use_cache=False,
        bos_token_id=config.get("bos_token_id"),
        eos_token_id=config.get("eos_token_id"),
        pad_token_id=config.get("pad_token_id"),
    )
    qwen._attn_implementation = "sdpa"
    return qwen


def parameter_count(config: Mapping[str, Any]) -> int:
    """Parameters of the SDAR model ``config`` describes, from the sizes alone (nothing is
    allocated); equal to :meth:`SDARDenoiser.num_parameters`.

    With ``V`` vocabulary, ``D`` width, ``F`` MLP width, ``H``/``G`` query/key-value heads of
    ``d`` dims and ``N`` layers: embeddings ``V D``; per layer the projections ``D (H d) + 2 D
    (G d) + (H d) D`` (plus biases ``H d + 2 G d + D`` when ``attention_bias``), ``q_norm`` and
    ``k_norm`` (``2 d``), the MLP ``3 D F`` and two RMSNorms ``2 D``; the final norm ``D``;
    an untied head ``V D``.
    """
    s = check_config(config)
    v, d, f, n = s["vocab_size"], s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"]
    q, kv = s["num_attention_heads"] * s["head_dim"], s["num_key_value_heads"] * s["head_dim"]
    bias = s["attention_bias"]
    attn = linear_params(d, q, bias) + 2 * linear_params(d, kv, bias) + linear_params(q, d, bias)
    layer = attn + 2 * s["head_dim"] + 2 * linear_params(d, f) + linear_params(f, d) + 2 * d
    head = 0 if s["tie_word_embeddings"] else v * d
    return v * d + n * layer + d + head


# ---------------------------------------------------------------------------------- cache
@dataclass
class SDARBlockCache:
    """Keys/values of each row's fully-prompt blocks and of the committed blocks.

    ``keys[l]``/``values[l]``: per layer ``[B, G, n, d]`` (after ``k_norm`` and RoPE; None
    before anything is cached); ``key_mask`` bool ``[B, n]`` (False on padding, on the
    prompt tail, which belongs to the first denoised block, and past a row's end);
    ``next_position`` long ``[B]``: the real position of the next token. Extending builds new
    tensors (no in-place writes), so a replay with gradients can run through the cache.
    """

    keys: list[torch.Tensor | None]
    values: list[torch.Tensor | None]
    key_mask: torch.Tensor
    next_position: torch.Tensor

    @property
    def length(self) -> int:
        return self.key_mask.shape[1]


class _CallCache:
    """What transformers' attention calls during one forward: ``update(k, v, layer)`` returns
    the cached keys/values (as they were when this view was made) followed by this call's.
    Pure: a recompute under activation checkpointing, after the cache was extended, returns
    the same; the caller decides afterwards whether to keep them."""

    def __init__(self, past: SDARBlockCache) -> None:
        self.past_keys, self.past_values = list(past.keys), list(past.values)  # as of now
        self.keys: list[torch.Tensor | None] = [None] * len(past.keys)
        self.values: list[torch.Tensor | None] = [None] * len(past.keys)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        past_k, past_v = self.past_keys[layer_idx], self.past_values[layer_idx]
        keys = key_states if past_k is None else torch.cat([past_k, key_states], dim=-2)
        values = value_states if past_v is None else torch.cat([past_v, value_states], dim=-2)
        self.keys[layer_idx], self.values[layer_idx] = keys, values
        return keys, values


def _cache_keyword() -> str:
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Model

    params = inspect.signature(Qwen3Model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _with_self(allowed: torch.Tensor) -> torch.Tensor:
    """``allowed [B, Q, K]`` where a query row with no key at all also sees key ``q`` (such
    rows are never read; this only keeps SDPA from producing NaN). Needs ``K >= Q``."""
    lone = ~allowed.any(-1)
    if not bool(lone.any()):
        return allowed
    eye = torch.zeros_like(allowed)
    eye[:, :, : allowed.shape[1]] = torch.diag_embed(lone)
    return allowed | eye


def _block_causal(keys: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Bool ``[B, T, T]``: query ``i`` sees key ``j`` iff ``keys[j]`` and ``block(j) <=
    block(i)``, with ``block = position // block_size`` (SDAR's canvas-origin blocks)."""
    blocks = positions // block_size
    return keys[:, None, :] & (blocks[:, None, :] <= blocks[:, :, None])


# ---------------------------------------------------------------------------------- model
class SDARDenoiser(HFTokenDenoiser):
    """An SDAR / TraDo checkpoint as a :class:`~diffusion_rl.models.BlockCachedDenoiser`
    (block-causal, ``block_origin = "canvas"``, same-position logits) with packed replay.

    ``SDARDenoiser(config)`` builds a randomly initialised model (the stock class's own init,
    from torch's current random state) from an SDAR ``config.json`` dict;
    ``SDARDenoiser(network, config, extra_files)`` wraps a built network, as
    :meth:`from_pretrained` and :meth:`from_config` do. :attr:`config` holds the SDAR values
    (written back by :meth:`save_pretrained`, ``torch_dtype`` updated); ``self.network`` is a
    stock ``Qwen3ForCausalLM`` whose state-dict keys are SDAR's.
    """

    family = "SDAR"  # key_map: the base's identity map (SDAR's keys are Qwen3's)
    network_class_name = "Qwen3ForCausalLM"
    attention = "block_causal"
    block_origin = "canvas"
    model_type = MODEL_TYPE
    lora_targets = LLAMA_LINEAR_NAMES
    size_limits = SIZE_LIMITS

    def __init__(
        self,
        network: nn.Module | Mapping[str, Any],
        family_config: Mapping[str, Any] | None = None,
        extra_files: Mapping[str, dict] | None = None,
    ) -> None:
        if isinstance(network, Mapping):
            if family_config is not None or extra_files is not None:
                raise TypeError(
                    "SDARDenoiser(config) takes the config alone; pass a built network first "
                    "to give family_config / extra_files"
                )
            family_config, network = network, self.network_class()(qwen3_config(network))
        super().__init__(network, family_config, extra_files)
        self._block_size = check_config(family_config)["block_size"]
        self._cache_keyword = _cache_keyword()

    # ------------------------------------------------------------------ family hooks
    @classmethod
    def stock_config(cls, config: Mapping[str, Any], where: str = CONFIG_FILE):
        """:func:`qwen3_config`."""
        return qwen3_config(config, where)

    @classmethod
    def parameter_count(cls, config: Mapping[str, Any]) -> int:
        """:func:`parameter_count` (from ``config.json``, nothing allocated)."""
        return parameter_count(config)

    @classmethod
    def vocab_size_of(cls, config: Mapping[str, Any]) -> int:
        return check_config(config)["vocab_size"]

    @classmethod
    def max_seq_len_of(cls, config: Mapping[str, Any]) -> int:
        return check_config(config)["max_position_embeddings"]

    @property
    def block_size(self) -> int:
        return self._block_size

    def saved_config(self) -> dict[str, Any]:
        """The SDAR config this model was built from, ``torch_dtype`` set to its weights'."""
        config = super().saved_config()
        config["torch_dtype"] = str(next(self.network.parameters()).dtype).removeprefix("torch.")
        return config

    def enable_activation_checkpointing(self, enabled: bool = True) -> None:
        """The shared activation checkpointing (non-reentrant, so gradients also reach the
        block KV cache's keys, which a block forward reads but does not take as inputs), with
        each decoder layer allowed to recompute under a cache: the cache view is pure."""
        super().enable_activation_checkpointing(enabled)
        for layer in self.network.model.layers:
            layer._can_checkpoint_with_cache = enabled

    # ------------------------------------------------------------------ forwards
    def _run(self, ids, positions, allowed, cache: _CallCache | None = None) -> torch.Tensor:
        """Logits for the bool ``allowed [B, T, K]`` (``K`` = cached + ``T`` keys)."""
        self.check_input_ids(ids)
        options = {} if cache is None else {self._cache_keyword: cache}
        return self.run_network(ids, allowed[:, None], positions, **options)

    def canvas_mask(self, key_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """SDAR's block-causal mask ``[B, 1, T, T]`` (what :meth:`forward` attends with): query
        ``i`` sees key ``j`` iff ``key_mask[j]`` and ``block(j) <= block(i)``, block
        ``position // block_size``. With the default positions ``cumsum(key_mask) - 1`` the
        blocks start at the first real token (the canvas), so ``prompt_length`` is not used.
        A query with no key (padding) sees itself (never read; keeps SDPA finite)."""
        allowed = _block_causal(key_mask.bool(), position_ids, self.block_size)
        return _with_self(allowed)[:, None]

    def forward_packed(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, allowed: torch.Tensor
    ) -> torch.Tensor:
        """Logits ``[B, T, V]`` of an arbitrary packed layout: ``position_ids [B, T]`` and bool
        ``allowed [B, T, T]`` (query ``i`` may attend to key ``j``), as packed replay builds."""
        if allowed.shape != (*input_ids.shape, input_ids.shape[1]):
            raise ValueError(
                f"allowed: expected [B, T, T] = {(*input_ids.shape, input_ids.shape[1])}, "
                f"got {tuple(allowed.shape)}"
            )
        return self._run(input_ids, position_ids, _with_self(allowed.bool()))

    # ------------------------------------------------------------------ block KV cache
    def new_cache(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> SDARBlockCache:
        """Run and cache each row's fully-prompt blocks: its first ``P_b - r_b`` real prompt
        tokens (``r_b = P_b % block_size``); the ``r_b``-token tail is left to the first
        :meth:`forward_block`, which denoises it with the first completion slots."""
        mask = prompt_mask.bool()
        batch = prompt_ids.shape[0]
        real = mask.long().sum(1)
        cached = real - real % self.block_size
        positions = protocol_positions(mask)
        keep = mask & (positions < cached[:, None])
        layers = len(self.network.model.layers)
        cache = SDARBlockCache(
            keys=[None] * layers,
            values=[None] * layers,
            key_mask=keep[:, :0],
            next_position=torch.zeros(batch, dtype=torch.long, device=prompt_ids.device),
        )
        if not bool(keep.any()):
            return cache
        allowed = _block_causal(keep, positions, self.block_size)
        call = _CallCache(cache)
        self._run(prompt_ids, positions, _with_self(allowed), call)
        cache.keys, cache.values = call.keys, call.values
        cache.key_mask, cache.next_position = keep, cached
        return cache

    def forward_block(
        self,
        block_ids: torch.Tensor,
        cache: SDARBlockCache,
        *,
        extend: bool = False,
        key_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, K, V]`` of the next block ``block_ids [B, K]`` (for the first block:
        the prompt tail, then the first slots) attending to the cache and to itself
        (bidirectionally). ``key_mask`` bool ``[B, K]`` (default all True) marks the columns
        that exist (False past a row's end: no key, never read). ``extend`` appends the
        block's keys/values (done once per block, with its final tokens)."""
        mask = torch.ones_like(block_ids, dtype=torch.bool) if key_mask is None else key_mask
        mask = mask.bool()
        positions = cache.next_position[:, None] + protocol_positions(mask)
        keys = torch.cat([cache.key_mask, mask], dim=1)
        width = block_ids.shape[1]
        allowed = keys[:, None, :].expand(-1, width, -1)
        lone = ~mask  # a column past the end sees itself too (never read; keeps SDPA finite)
        if bool(lone.any()):
            own = torch.zeros_like(allowed)
            own[:, :, cache.length :] = torch.diag_embed(lone)
            allowed = allowed | own
        call = _CallCache(cache)
        logits = self._run(block_ids, positions, allowed, call)
        if extend:
            cache.keys, cache.values = call.keys, call.values
            cache.key_mask = keys
            cache.next_position = cache.next_position + mask.long().sum(1)
        return logits
