"""Dream (Dream-org/Dream-v0-Base-7B / -Instruct-7B, Qwen2.5-based) as transformers' stock
``Qwen2ForCausalLM`` with causal masking off.

Conventions (matched to the family's own code; ``../shared/fixtures/hf_dllm/dream/README.md``):

* **Logits**: the network is *shifted* (``raw[:, j]`` predicts token ``j + 1``); this adapter
  returns target-aligned logits through
  :func:`~diffusion_rl.models.protocol.shift_to_target_aligned` (``aligned[:, i] =
  raw[:, i - 1]``, position 0 keeps its own), exactly what Dream's ``diffusion_generate``
  does before sampling. ``alignment`` is therefore ``"same_position"``; ``native_alignment``
  records ``"shifted"``.
* **Attention**: full bidirectional (Dream hard-codes ``is_causal=False``). With left padding
  Dream's generate passes the 4-D bool mask ``m[:, None, None, :] & m[:, None, :, None]`` and
  ``tok_idx = cumsum(m) - 1`` as position ids; this adapter passes the same mask on real
  queries (padding queries also see themselves, so no SDPA row is fully masked) and the same
  positions (``cumsum(key_mask) - 1``; Dream puts 1 on pads, here 0; pads are never keys of
  real tokens, so nothing real depends on it). In a left-padded row the aligned logit of the
  first real token comes from a padding row: it is a prompt position, never a target.
* **Mask id**: ``config.json`` ``mask_token_id`` (151666 in the released models).
* **Checkpoint**: the keys are Qwen2's own (no map); ``config.json`` keeps Dream's values
  (``model_type: "Dream"``, ``architectures``, ``auto_map``), and ``generation_config.json``
  is written back (Dream's own loader reads it unconditionally).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..loading import ModelConfigError
from ..protocol import shift_to_target_aligned
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
    rope_parameters,
)

MODEL_TYPE = "dream"


def _sizes(config: Mapping[str, Any], where: str) -> dict[str, int]:
    """The sizes of a Dream config, every field the mapping depends on validated (no
    transformers import: this runs before anything is built)."""
    d = config_int(config, "hidden_size", where=where)
    heads = config_int(config, "num_attention_heads", where=where, high=LAYER_LIMIT)
    if d % heads:
        raise ModelConfigError(
            f"{where}: hidden_size: must be divisible by num_attention_heads={heads}, got {d}"
        )
    kv = config_int(config, "num_key_value_heads", heads, where=where, high=LAYER_LIMIT)
    if heads % kv:
        raise ModelConfigError(
            f"{where}: num_key_value_heads: must divide num_attention_heads={heads}, got {kv}"
        )
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim != d // heads:
        raise ModelConfigError(
            f"{where}: head_dim={head_dim!r} is not supported by the stock Qwen2 mapping of "
            f"Dream (Qwen2 uses hidden_size / num_attention_heads = {d // heads})"
        )
    vocab = config_int(config, "vocab_size", where=where, low=2)
    config_int(config, "mask_token_id", where=where, low=0, high=vocab - 1)
    config_bool(config, "tie_word_embeddings", False, where=where)
    if config_bool(config, "use_sliding_window", False, where=where):
        raise ModelConfigError(
            f"{where}: use_sliding_window=true is not supported by the stock Qwen2 mapping "
            "of Dream (full attention only)"
        )
    act = config_value(config, "hidden_act", "silu", where=where)
    if act != "silu":
        raise ModelConfigError(
            f"{where}: hidden_act={act!r} is not supported by the stock Qwen2 mapping of "
            "Dream (supported: 'silu')"
        )
    rope_parameters({"rope_theta": 10000.0, **config}, where)
    config_int(config, "max_position_embeddings", 32768, where=where, high=POSITION_LIMIT)
    config_float(config, "rms_norm_eps", 1e-6, where=where)
    config_float(config, "attention_dropout", 0.0, where=where, positive=False)
    return {
        "d": d,
        "heads": heads,
        "kv": kv,
        "mlp": config_int(config, "intermediate_size", where=where),
        "vocab": vocab,
        "layers": config_int(config, "num_hidden_layers", where=where, high=LAYER_LIMIT),
    }


class DreamDenoiser(HFTokenDenoiser):
    """A Dream checkpoint in stock ``Qwen2ForCausalLM`` (module docstring for the
    conventions): bidirectional, shifted network aligned to target-aligned logits."""

    family = "Dream"
    key_map = KeyMap()  # Dream's keys are Qwen2's
    network_class_name = "Qwen2ForCausalLM"
    native_alignment = "shifted"

    @classmethod
    def vocab_size_of(cls, config: Mapping[str, Any]) -> int:
        return _sizes(config, f"{cls.family} config")["vocab"]

    @classmethod
    def max_seq_len_of(cls, config: Mapping[str, Any]) -> int:
        where = f"{cls.family} config"
        return config_int(
            config, "max_position_embeddings", 32768, where=where, high=POSITION_LIMIT
        )

    @classmethod
    def parameter_count(cls, config: Mapping[str, Any]) -> int:
        """Embeddings ``V D``; per layer two RMSNorm weights (``2 D``), Q with bias
        (``D² + D``), K and V with bias (``2 (D w + w)``, ``w = kv · D / heads``), O without
        (``D²``), gate, up and down (``3 D F``); the final norm ``D``; ``lm_head`` ``V D``
        unless ``tie_word_embeddings``."""
        s = _sizes(config, f"{cls.family} config")
        d, f, v = s["d"], s["mlp"], s["vocab"]
        kv_width = s["kv"] * (d // s["heads"])
        layer = 2 * d + linear_params(d, d, True) + 2 * linear_params(d, kv_width, True)
        layer += linear_params(d, d) + 2 * linear_params(d, f) + linear_params(f, d)
        tied = config_bool(config, "tie_word_embeddings", False, where=f"{cls.family} config")
        return v * d + s["layers"] * layer + d + (0 if tied else v * d)

    @classmethod
    def stock_config(cls, config: Mapping[str, Any], where: str = "config.json"):
        """The ``Qwen2Config`` of ``config`` (Dream's ``config.json`` values); sliding-window
        attention, RoPE scaling or another activation is a :class:`ModelConfigError`."""
        sizes = _sizes(config, where)
        transformers = require_transformers()
        return transformers.Qwen2Config(
            **decoder_keywords(sizes, cls.max_seq_len_of(config), config, where),
            rms_norm_eps=config_float(config, "rms_norm_eps", 1e-6, where=where),
            rope_parameters=rope_parameters({"rope_theta": 10000.0, **config}, where),
            tie_word_embeddings=config_bool(config, "tie_word_embeddings", False, where=where),
            use_sliding_window=False,
            sliding_window=None,
            use_cache=False,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        key_mask: torch.Tensor | None = None,
        prompt_length: int = 0,
        *,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Target-aligned logits ``[B, T, V]``: the shifted network's ``raw[:, i - 1]`` at
        ``i >= 1`` (module docstring)."""
        return shift_to_target_aligned(
            self.raw_logits(input_ids, key_mask, position_ids=position_ids)
        )
