"""LLaDA (GSAI-ML/LLaDA-8B-Base / -Instruct) as transformers' stock ``LlamaForCausalLM``.

Conventions (matched to the family's own code; ``../shared/fixtures/hf_dllm/llada/README.md``):

* **Logits**: same-position (``logits[:, i]`` predicts token ``i``), no shift.
* **Attention**: full bidirectional; padding keys are masked on the KEY axis only, as LLaDA's
  post-October-2025 hub code does (an additive ``(1 - mask) * min`` bias ``[B, 1, 1, T]``);
  here the same mask is a bool ``[B, 1, T, T]`` passed to SDPA
  (:func:`~diffusion_rl.models.hf.common.bidirectional_mask`). Padding query rows have no
  defined logits in either.
* **Positions**: LLaDA's code uses ``arange(T)``, pads included. RoPE is relative, so for the
  real tokens of a left-padded row that is the same function as our protocol's
  ``cumsum(key_mask) - 1``, which this adapter uses (a row's logits then do not depend on how
  much its batch mates pad); the two differ only by float rounding (1.5e-6 on the fixture).
  ``forward(..., position_ids=torch.arange(T).expand(B, T))`` reproduces LLaDA's exactly.
* **Mask id**: ``config.json`` ``mask_token_id`` (126336 in the released models).
* **Checkpoint**: LLaDA's own keys (``model.transformer.*``) and ``config.json``; the map to
  Llama's names is :data:`LLADA_KEY_MAP`, used in both directions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..loading import ModelConfigError
from .common import (
    LAYER_LIMIT,
    POSITION_LIMIT,
    HFTokenDenoiser,
    KeyMap,
    config_bool,
    config_float,
    config_int,
    config_value,
    decoder_keywords,
    linear_params,
    require_transformers,
)

MODEL_TYPE = "llada"

LLADA_KEY_MAP = KeyMap(
    [
        ("model.transformer.wte.weight", "model.embed_tokens.weight"),
        ("model.transformer.ln_f.weight", "model.norm.weight"),
        ("model.transformer.ff_out.weight", "lm_head.weight"),
        (
            "model.transformer.blocks.{i}.attn_norm.weight",
            "model.layers.{i}.input_layernorm.weight",
        ),
        ("model.transformer.blocks.{i}.q_proj.weight", "model.layers.{i}.self_attn.q_proj.weight"),
        ("model.transformer.blocks.{i}.k_proj.weight", "model.layers.{i}.self_attn.k_proj.weight"),
        ("model.transformer.blocks.{i}.v_proj.weight", "model.layers.{i}.self_attn.v_proj.weight"),
        (
            "model.transformer.blocks.{i}.attn_out.weight",
            "model.layers.{i}.self_attn.o_proj.weight",
        ),
        (
            "model.transformer.blocks.{i}.ff_norm.weight",
            "model.layers.{i}.post_attention_layernorm.weight",
        ),
        ("model.transformer.blocks.{i}.ff_proj.weight", "model.layers.{i}.mlp.gate_proj.weight"),
        ("model.transformer.blocks.{i}.up_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
        ("model.transformer.blocks.{i}.ff_out.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ]
)
"""LLaDA key → Llama key. ``ff_proj`` is the SiLU (gate) side: LLaDA's block computes
``ff_out(silu(ff_proj(x)) * up_proj(x))``."""

# Features of LLaDA's config the Llama block reproduces at one value only. Required keys must
# hold it; optional ones may also be absent or null (LLaDA's default is then that value).
_REQUIRED: dict[str, Any] = {
    "block_type": "llama",
    "activation_type": "silu",
    "layer_norm_type": "rms",
    "rope": True,
}
_OPTIONAL: dict[str, Any] = {
    "alibi": False,
    "include_bias": False,
    "include_qkv_bias": False,
    "bias_for_layer_norm": False,
    "attention_layer_norm": False,
    "layer_norm_with_affine": True,
    "input_emb_norm": False,
    "scale_logits": False,
    "multi_query_attention": False,
    "clip_qkv": None,
    "rope_scaling": None,
}
_ZERO = ("embedding_dropout", "residual_dropout")


def _sizes(config: Mapping[str, Any], where: str) -> dict[str, int]:
    """The sizes of a LLaDA config, every field the mapping depends on validated (no
    transformers import: this runs before anything is built)."""
    d = config_int(config, "d_model", where=where)
    heads = config_int(config, "n_heads", where=where, high=LAYER_LIMIT)
    if d % heads:
        raise ModelConfigError(f"{where}: d_model: must be divisible by n_heads={heads}, got {d}")
    kv = config_int(config, "n_kv_heads", heads, where=where, high=LAYER_LIMIT)
    if heads % kv:
        raise ModelConfigError(f"{where}: n_kv_heads: must divide n_heads={heads}, got {kv}")
    if config.get("mlp_hidden_size") is not None:
        mlp = config_int(config, "mlp_hidden_size", where=where)
    else:
        mlp = config_int(config, "mlp_ratio", where=where, high=LAYER_LIMIT) * d
    vocab = config_int(config, "vocab_size", where=where, low=2)
    embedding = config_int(config, "embedding_size", vocab, where=where, low=2)
    if embedding < vocab:
        raise ModelConfigError(
            f"{where}: embedding_size: must be >= vocab_size={vocab}, got {embedding}"
        )
    layers = config_int(config, "n_layers", where=where, high=LAYER_LIMIT)
    config_int(config, "mask_token_id", where=where, low=0, high=embedding - 1)
    config_bool(config, "weight_tying", where=where)
    fixed = {key: config_value(config, key, where=where) for key in _REQUIRED}
    fixed.update({key: config.get(key) for key in _OPTIONAL if config.get(key) is not None})
    for key, value in fixed.items():
        supported = {**_REQUIRED, **_OPTIONAL}[key]
        if value != supported:
            raise ModelConfigError(
                f"{where}: {key}={value!r} is not supported by the stock Llama mapping of "
                f"LLaDA (supported: {supported!r}); this checkpoint needs the family's own "
                "modeling code"
            )
    for key in _ZERO:
        if config_float(config, key, 0.0, where=where, positive=False) != 0.0:
            raise ModelConfigError(
                f"{where}: {key}={config[key]!r} is not supported by the stock Llama "
                "mapping of LLaDA (only 0.0)"
            )
    config_int(config, "max_sequence_length", 4096, where=where, high=POSITION_LIMIT)
    config_float(config, "rms_norm_eps", 1e-5, where=where)
    config_float(config, "rope_theta", 10000.0, where=where)
    config_float(config, "attention_dropout", 0.0, where=where, positive=False)
    return {"d": d, "heads": heads, "kv": kv, "mlp": mlp, "vocab": embedding, "layers": layers}


class LLaDADenoiser(HFTokenDenoiser):
    """A LLaDA checkpoint in stock ``LlamaForCausalLM`` (module docstring for the
    conventions): bidirectional, same-position logits, mask id from ``config.json``."""

    family = "LLaDA"
    key_map = LLADA_KEY_MAP
    network_class_name = "LlamaForCausalLM"

    @classmethod
    def vocab_size_of(cls, config: Mapping[str, Any]) -> int:
        return _sizes(config, f"{cls.family} config")["vocab"]

    @classmethod
    def max_seq_len_of(cls, config: Mapping[str, Any]) -> int:
        where = f"{cls.family} config"
        return config_int(config, "max_sequence_length", 4096, where=where, high=POSITION_LIMIT)

    @classmethod
    def parameter_count(cls, config: Mapping[str, Any]) -> int:
        """Embeddings ``V D``; per layer two RMSNorm weights (``2 D``), Q and O (``2 D²``),
        K and V (``2 D · kv · D / heads``), gate, up and down (``3 D F``); the final norm
        ``D``; the output head ``V D`` unless ``weight_tying``."""
        s = _sizes(config, f"{cls.family} config")
        d, f, v = s["d"], s["mlp"], s["vocab"]
        kv_width = s["kv"] * (d // s["heads"])
        layer = 2 * d + 2 * linear_params(d, d) + 2 * linear_params(d, kv_width)
        layer += 2 * linear_params(d, f) + linear_params(f, d)
        tied = config_bool(config, "weight_tying", where=f"{cls.family} config")
        return v * d + s["layers"] * layer + d + (0 if tied else v * d)

    @classmethod
    def stock_config(cls, config: Mapping[str, Any], where: str = "config.json"):
        """The ``LlamaConfig`` of ``config`` (LLaDA's ``config.json`` values). A feature the
        Llama block cannot express (ALiBi, biases, another block type or activation, QK
        layer norms, non-zero residual dropout, ...) is a :class:`ModelConfigError` naming
        the key."""
        sizes = _sizes(config, where)
        transformers = require_transformers()
        return transformers.LlamaConfig(
            **decoder_keywords(sizes, cls.max_seq_len_of(config), config, where),
            rms_norm_eps=config_float(config, "rms_norm_eps", 1e-5, where=where),
            rope_parameters={
                "rope_type": "default",
                "rope_theta": config_float(config, "rope_theta", 10000.0, where=where),
            },
            attention_bias=False,
            mlp_bias=False,
            tie_word_embeddings=config_bool(config, "weight_tying", where=where),
            pad_token_id=None,
            bos_token_id=None,
            eos_token_id=None,
            use_cache=False,
        )
