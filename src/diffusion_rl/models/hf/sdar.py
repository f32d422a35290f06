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

Requires transformers >= 5 (``rope_parameters``, the ``cache`` keyword). Checkpoint loading is
safetensors only (``model.safetensors`` or a sharded ``model.safetensors.index.json``).
"""

from __future__ import annotations

import inspect
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

MODEL_TYPE = "sdar"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_CONFIG_BYTES = 1 << 20

# The largest sizes accepted from a config.json (checked before anything is allocated): far
# above released SDAR models (vocab 151936, hidden 4096, 36 layers), far below absurd.
SIZE_LIMITS: dict[str, int] = {
    "vocab_size": 1 << 22,
    "hidden_size": 1 << 16,
    "intermediate_size": 1 << 18,
    "num_hidden_layers": 1024,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "head_dim": 1 << 12,
    "block_size": 1 << 16,
    "max_position_embeddings": 1 << 24,
}
REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "block_size",
    "mask_token_id",
)
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

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class SDARCheckpointError(ValueError):
    """An SDAR directory or ``config.json`` this adapter cannot load; the message names the
    file and the key, and says what to do."""


# --------------------------------------------------------------------------------- config
def _check_int(config: dict, key: str, path: str, *, low: int = 1) -> int:
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise SDARCheckpointError(
            f"{path}: {key} must be an integer, got {type(value).__name__} {value!r}"
        )
    high = SIZE_LIMITS.get(key)
    if value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise SDARCheckpointError(f"{path}: {key} must be in {bound}, got {value}")
    return value


def check_config(config: Any, path: str = CONFIG_FILE) -> dict:
    """Validate an SDAR ``config.json`` dict (``path`` names it in messages) and return the
    resolved sizes: the required keys, ``num_key_value_heads`` (default: the heads),
    ``head_dim`` (default ``hidden_size // num_attention_heads``), ``tie_word_embeddings``,
    ``attention_bias``. Refuses (:class:`SDARCheckpointError`) another ``model_type``, a
    missing or non-integer size, sizes beyond :data:`SIZE_LIMITS`, a mask id outside the
    vocabulary, an activation other than SiLU, and a sliding window (not SDAR's mask)."""
    if not isinstance(config, dict):
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
    missing = [k for k in REQUIRED_KEYS if k not in config]
    if missing:
        raise SDARCheckpointError(f"{path}: missing keys {missing} (an SDAR config names them)")
    sizes = {k: _check_int(config, k, path) for k in REQUIRED_KEYS if k != "mask_token_id"}
    heads = sizes["num_attention_heads"]
    for key, default in (
        ("num_key_value_heads", heads),
        ("head_dim", sizes["hidden_size"] // heads),
        ("max_position_embeddings", 32768),
    ):
        sizes[key] = default if config.get(key) is None else _check_int(config, key, path)
    sizes["mask_token_id"] = _check_int(config, "mask_token_id", path, low=0)
    if sizes["mask_token_id"] >= sizes["vocab_size"]:
        raise SDARCheckpointError(
            f"{path}: mask_token_id must be < vocab_size={sizes['vocab_size']}, got "
            f"{sizes['mask_token_id']}"
        )
    if heads % sizes["num_key_value_heads"]:
        raise SDARCheckpointError(
            f"{path}: num_attention_heads={heads} must be a multiple of num_key_value_heads="
            f"{sizes['num_key_value_heads']}"
        )
    if config.get("hidden_act", "silu") != "silu":
        raise SDARCheckpointError(
            f"{path}: hidden_act must be 'silu' (SDAR's SwiGLU), got {config['hidden_act']!r}"
        )
    if config.get("use_sliding_window", False):
        raise SDARCheckpointError(
            f"{path}: use_sliding_window=true is not SDAR's block-causal attention; set it false"
        )
    for key in ("tie_word_embeddings", "attention_bias"):
        value = config.get(key, False)
        if not isinstance(value, bool):
            raise SDARCheckpointError(f"{path}: {key} must be true or false, got {value!r}")
        sizes[key] = value
    for key, default in (("rms_norm_eps", 1e-6), ("rope_theta", 1e6)):
        value = config.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise SDARCheckpointError(f"{path}: {key} must be a positive number, got {value!r}")
        sizes[key] = float(value)
    scaling = config.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise SDARCheckpointError(f"{path}: rope_scaling must be null or an object")
    return sizes


def qwen3_config(config: dict, path: str = CONFIG_FILE):
    """The stock ``Qwen3Config`` of an SDAR ``config.json`` dict, with SDPA attention."""
    from transformers import Qwen3Config

    sizes = check_config(config, path)
    rope = {"rope_type": "default"}
    if config.get("rope_scaling"):
        scaling = dict(config["rope_scaling"])
        rope = {**scaling, "rope_type": scaling.get("rope_type", scaling.get("type", "default"))}
        rope.pop("type", None)
    rope["rope_theta"] = sizes["rope_theta"]
    qwen = Qwen3Config(
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
        attention_dropout=float(config.get("attention_dropout", 0.0)),
        tie_word_embeddings=sizes["tie_word_embeddings"],
        use_sliding_window=False,
        use_cache=False,
        bos_token_id=config.get("bos_token_id"),
        eos_token_id=config.get("eos_token_id"),
        pad_token_id=config.get("pad_token_id"),
    )
    qwen._attn_implementation = "sdpa"
    return qwen


def parameter_count(config: dict) -> int:
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
    attn = d * q + 2 * d * kv + q * d + (q + 2 * kv + d if s["attention_bias"] else 0)
    layer = attn + 2 * s["head_dim"] + 3 * d * f + 2 * d
    head = 0 if s["tie_word_embeddings"] else v * d
    return v * d + n * layer + d + head


# ---------------------------------------------------------------------------------- files
def _local_directory(path: str | Path) -> Path:
    directory = Path(path)
    if directory.is_dir():
        return directory
    text = str(path)
    if not directory.exists() and _HUB_ID.match(text) and not text.startswith((".", "/", "~")):
        raise SDARCheckpointError(
            f"{text!r} is not a local directory (a hub id?); nothing is downloaded: pass a local "
            f"directory, e.g. `hf download {text} --local-dir DIR`"
        )
    raise SDARCheckpointError(f"{text}: not a directory (pass an SDAR checkpoint directory)")


def _read_config(directory: Path) -> dict:
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise SDARCheckpointError(f"{path}: missing (an SDAR directory holds config.json)")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise SDARCheckpointError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise SDARCheckpointError(f"{path}: not valid JSON ({error})") from None


def _weight_files(directory: Path) -> list[Path]:
    single = directory / WEIGHTS_FILE
    if single.is_file():
        return [single]
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise SDARCheckpointError(f"{index}: expected JSON with a 'weight_map'") from None
        shards = sorted(set(weight_map.values()))
        for name in shards:
            if (
                not isinstance(name, str)
                or Path(name).name != name
                or not name.endswith(".safetensors")
            ):
                raise SDARCheckpointError(
                    f"{index}: weight_map names {name!r}; shards must be *.safetensors files "
                    "in the same directory"
                )
            if not (directory / name).is_file():
                raise SDARCheckpointError(f"{index}: shard {name} is missing from {directory}")
        return [directory / name for name in shards]
    others = sorted(p.name for p in directory.glob("*") if p.suffix in (".bin", ".pt", ".pth"))
    if others:
        raise SDARCheckpointError(
            f"{directory}: only {others} (pickle) weights; this loader reads safetensors only: "
            "convert them to model.safetensors (e.g. load with transformers and save with "
            "safe_serialization=True) on a trusted machine"
        )
    raise SDARCheckpointError(f"{directory}: no {WEIGHTS_FILE} or {INDEX_FILE}")


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


def _resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """``None``, a ``torch.dtype`` or its name (``"bfloat16"``, ``"torch.float32"``)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(f"dtype: expected a floating torch dtype or its name, got {dtype!r}")
    return resolved


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


# ---------------------------------------------------------------------------------- model
class SDARDenoiser(nn.Module):
    """An SDAR / TraDo checkpoint as a :class:`~diffusion_rl.models.BlockCachedDenoiser`
    (block-causal, ``block_origin = "canvas"``, same-position logits) with packed replay.

    ``SDARDenoiser(config)`` builds a randomly initialised model from an SDAR ``config.json``
    dict (kept as :attr:`config` and written back by :meth:`save_pretrained`);
    :meth:`from_pretrained` loads a checkpoint directory. The network is
    ``self.network``, a stock ``Qwen3ForCausalLM`` whose state-dict keys are SDAR's.
    """

    alignment = "same_position"
    attention = "block_causal"
    block_origin = "canvas"
    model_type = MODEL_TYPE
    lora_targets: tuple[str, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    size_limits = SIZE_LIMITS

    def __init__(self, config: dict, *, _meta: bool = False) -> None:
        super().__init__()
        from transformers import Qwen3ForCausalLM

        qwen = qwen3_config(config)
        self.config = dict(config)
        self._sizes = check_config(config)
        if _meta:
            with torch.device("meta"):
                self.network = Qwen3ForCausalLM(qwen)
        else:
            self.network = Qwen3ForCausalLM(qwen)
        self._cache_keyword = _cache_keyword()

    # ------------------------------------------------------------------ protocol fields
    @property
    def vocab_size(self) -> int:
        return self._sizes["vocab_size"]

    @property
    def mask_token_id(self) -> int:
        return self._sizes["mask_token_id"]

    @property
    def block_size(self) -> int:
        return self._sizes["block_size"]

    @classmethod
    def parameter_count(cls, config: dict) -> int:
        """:func:`parameter_count` (from ``config.json``, nothing allocated)."""
        return parameter_count(config)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def enable_activation_checkpointing(self, enabled: bool = True) -> None:
        """Recompute each decoder layer in backward through transformers' own gradient
        checkpointing (non-reentrant, so gradients also reach the block KV cache's keys,
        which a block forward reads but does not take as inputs)."""
        network = self.network
        if enabled:
            kwargs = {"use_reentrant": False}
            if hasattr(network, "activation_checkpointing_enable"):  # transformers >= 5.x
                network.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                network.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            for layer in network.model.layers:  # our cache view is pure: safe to recompute
                layer._can_checkpoint_with_cache = True
        elif hasattr(network, "activation_checkpointing_disable"):
            network.activation_checkpointing_disable()
        else:
            network.gradient_checkpointing_disable()

    # ------------------------------------------------------------------ forwards
    def _run(self, ids, positions, allowed, cache: _CallCache | None = None) -> torch.Tensor:
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= self.vocab_size:
            raise ValueError(
                f"input_ids: ids must be in [0, vocab_size={self.vocab_size}), got [{low}, "
                f"{high}]; is the tokenizer the model's?"
            )
        options = {} if cache is None else {self._cache_keyword: cache}
        out = self.network(
            input_ids=ids,
            attention_mask=allowed[:, None],
            position_ids=positions,
            use_cache=False,
            **options,
        )
        return out.logits

    def forward(
        self, input_ids: torch.Tensor, key_mask: torch.Tensor | None = None, prompt_length: int = 0
    ) -> torch.Tensor:
        """Target-aligned logits ``[B, T, V]`` of the canvas ``input_ids [B, T]``.

        Position ``cumsum(key_mask) - 1``; block ``position // block_size``; query ``i`` sees
        key ``j`` iff ``key_mask[j]`` and ``block(j) <= block(i)``. ``prompt_length`` is not
        used: SDAR's blocks start at the first real token, not at the completion.
        """
        if key_mask is None:
            key_mask = torch.ones_like(input_ids, dtype=torch.bool)
        key_mask = key_mask.bool()
        positions = (key_mask.long().cumsum(1) - 1).clamp_min(0)
        blocks = positions // self.block_size
        allowed = key_mask[:, None, :] & (blocks[:, None, :] <= blocks[:, :, None])
        return self._run(input_ids, positions, _with_self(allowed))

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
        positions = (mask.long().cumsum(1) - 1).clamp_min(0)
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
        blocks = positions // self.block_size
        allowed = keep[:, None, :] & (blocks[:, None, :] <= blocks[:, :, None])
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
        positions = cache.next_position[:, None] + (mask.long().cumsum(1) - 1).clamp_min(0)
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

    # ------------------------------------------------------------------ save / load
    def save_pretrained(self, directory: str | Path) -> None:
        """Write SDAR's own format: ``config.json`` (the SDAR config this model was built
        from, ``torch_dtype`` updated) and ``model.safetensors`` (Qwen3 / SDAR key names,
        metadata ``format: pt``; no ``lm_head.weight`` when the embeddings are tied)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = dict(self.config)
        dtype = next(self.network.parameters()).dtype
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
        (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        state = {k: v.detach().contiguous() for k, v in self.network.state_dict().items()}
        if self._sizes["tie_word_embeddings"]:
            state.pop("lm_head.weight", None)
        save_file(state, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        *,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        trust_remote_code: bool = False,
    ) -> SDARDenoiser:
        """Load an SDAR checkpoint directory (``config.json`` + safetensors weights) into
        the stock Qwen3 network; in eval mode.

        ``dtype``: cast the weights (a dtype or its name; None keeps the stored dtype);
        ``device``: where they are
        read to. ``trust_remote_code`` is accepted for a uniform adapter interface but never
        runs anything: the stock network reproduces SDAR's own modeling code (checked against
        it by the fixtures), so no remote code is needed. Every key must match (an untied
        checkpoint must hold ``lm_head.weight``; a tied one may omit it).
        """
        del trust_remote_code  # never needed (see the docstring)
        directory = _local_directory(directory)
        config = _read_config(directory)
        path = str(directory / CONFIG_FILE)
        check_config(config, path)
        files = _weight_files(directory)
        model = cls(config, _meta=True)
        target = "cpu" if device is None else str(torch.device(device))
        state: dict[str, torch.Tensor] = {}
        for file in files:
            state.update(load_file(str(file), device=target))
        dtype = _resolve_dtype(dtype)
        if dtype is not None:
            state = {k: v.to(dtype) for k, v in state.items()}
        expected = set(model.network.state_dict())
        tied = model._sizes["tie_word_embeddings"]
        allowed_missing = {"lm_head.weight"} if tied else set()
        missing = sorted(expected - set(state) - allowed_missing)
        unexpected = sorted(set(state) - expected)
        if missing or unexpected:
            raise SDARCheckpointError(
                f"{directory}: weights do not match the SDAR config: missing {missing[:8]}, "
                f"unexpected {unexpected[:8]} (is it an SDAR checkpoint of this config?)"
            )
        if tied:
            state.pop("lm_head.weight", None)
        model.network.load_state_dict(state, strict=False, assign=True)
        if tied:
            model.network.lm_head.weight = model.network.model.embed_tokens.weight
        rotary = type(model.network.model.rotary_emb)
        model.network.model.rotary_emb = rotary(model.network.config).to(target)
        model.eval()
        leftover = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
        if leftover:
            raise SDARCheckpointError(f"{directory}: tensors not loaded: {leftover[:8]}")
        return model
