"""Tiny local LLaDA / Dream checkpoints for the Hugging Face adapter tests, and an independent
plain-torch forward of both families (from the checkpoint's own key names) to check them.

Nothing here comes from the fixtures: a random config, a character tokenizer built with
``tokenizers``, weights written by the adapter's ``save_pretrained``."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures"
SIZES = ("hf_dllm", "hf_dllm_wide")
CHARS = "0123456789+-= abcdefghijklmnopqrstuvwxyz\n"  # ids 0..40; special tokens follow
VOCAB = 48  # the model's rows: more than the tokenizer's 40 + specials

LLADA_SPECIALS = (
    "<|startoftext|>",
    "<|endoftext|>",
    "<|mdm_mask|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
)
DREAM_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>")
LLADA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
DREAM_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def special_id(family: str, token: str) -> int:
    specials = LLADA_SPECIALS if family == "llada" else DREAM_SPECIALS
    return len(CHARS) + specials.index(token)


def fixture_dir(size: str, family: str) -> Path:
    path = FIXTURES / size / family
    if not path.is_dir():
        pytest.skip(f"{path}: ../shared/fixtures absent (CI has it)")
    return path


def llada_config(**overrides) -> dict:
    """A LLaDA config.json object (the released field names) of a tiny model."""
    config = {
        "activation_type": "silu",
        "alibi": False,
        "architectures": ["LLaDAModelLM"],
        "attention_dropout": 0.0,
        "attention_layer_norm": False,
        "block_type": "llama",
        "d_model": 32,
        "embedding_dropout": 0.0,
        "embedding_size": VOCAB,
        "eos_token_id": special_id("llada", "<|endoftext|>"),
        "include_bias": False,
        "include_qkv_bias": False,
        "layer_norm_type": "rms",
        "layer_norm_with_affine": True,
        "mask_token_id": special_id("llada", "<|mdm_mask|>"),
        "max_sequence_length": 64,
        "mlp_hidden_size": 48,
        "model_type": "llada",
        "n_heads": 4,
        "n_kv_heads": 2,
        "n_layers": 2,
        "pad_token_id": special_id("llada", "<|endoftext|>"),
        "residual_dropout": 0.0,
        "rms_norm_eps": 1e-5,
        "rope": True,
        "rope_theta": 500000.0,
        "scale_logits": False,
        "vocab_size": len(CHARS) + len(LLADA_SPECIALS),
        "weight_tying": False,
    }
    config.update(overrides)
    return config


def dream_config(**overrides) -> dict:
    """A Dream config.json object (the released field names) of a tiny model."""
    eos = special_id("dream", "<|endoftext|>")
    config = {
        "architectures": ["DreamModel"],
        "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_dream.DreamConfig"},
        "bos_token_id": eos,
        "eos_token_id": eos,
        "hidden_act": "silu",
        "hidden_size": 32,
        "intermediate_size": 56,
        "mask_token_id": special_id("dream", "<|mask|>"),
        "max_position_embeddings": 128,
        "model_type": "Dream",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "pad_token_id": eos,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "vocab_size": VOCAB,
    }
    config.update(overrides)
    return config


def write_tokenizer(directory: Path, family: str) -> None:
    """A character-level fast tokenizer with the family's special strings (after the 41
    characters), mask token set, and a minimal chat template."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    specials = LLADA_SPECIALS if family == "llada" else DREAM_SPECIALS
    vocab = {c: i for i, c in enumerate(CHARS)}
    vocab.update({s: len(CHARS) + k for k, s in enumerate(specials)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.decoder = decoders.Fuse()
    if family == "llada":
        names = {
            "bos_token": "<|startoftext|>",
            "eos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>",
            "mask_token": "<|mdm_mask|>",
            "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        }
    else:
        names = {
            "eos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>",
            "mask_token": "<|mask|>",
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        }
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **names)
    tokenizer.chat_template = LLADA_TEMPLATE if family == "llada" else DREAM_TEMPLATE
    tokenizer.save_pretrained(str(directory))


def perturb_constants(model: torch.nn.Module, seed: int = 1) -> None:
    """Norm weights (init 1) and biases (init 0) get noise, so a mis-mapped one shows; the
    matrices are scaled up from the 0.02 init so the logits are O(1)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))
            else:
                parameter.mul_(5.0)


def write_checkpoint(directory: Path, family: str, seed: int = 0, **overrides):
    """A random tiny checkpoint of ``family`` in ``directory`` (the adapter's save_pretrained
    plus the tokenizer); returns the in-memory model."""
    from diffusion_rl.models.hf import DreamDenoiser, LLaDADenoiser

    cls, config = (
        (LLaDADenoiser, llada_config(**overrides))
        if family == "llada"
        else (DreamDenoiser, dream_config(**overrides))
    )
    model = cls.from_config(config, seed=seed)
    perturb_constants(model, seed + 1)
    model.save_pretrained(directory)
    write_tokenizer(directory, family)
    return model


# ----------------------------------------------------------------------------- reference
LLADA_NAMES = {
    "embed": "model.transformer.wte.weight",
    "final_norm": "model.transformer.ln_f.weight",
    "head": "model.transformer.ff_out.weight",
    "attn_norm": "model.transformer.blocks.{i}.attn_norm.weight",
    "q": "model.transformer.blocks.{i}.q_proj",
    "k": "model.transformer.blocks.{i}.k_proj",
    "v": "model.transformer.blocks.{i}.v_proj",
    "o": "model.transformer.blocks.{i}.attn_out",
    "mlp_norm": "model.transformer.blocks.{i}.ff_norm.weight",
    "gate": "model.transformer.blocks.{i}.ff_proj",
    "up": "model.transformer.blocks.{i}.up_proj",
    "down": "model.transformer.blocks.{i}.ff_out",
}
DREAM_NAMES = {
    "embed": "model.embed_tokens.weight",
    "final_norm": "model.norm.weight",
    "head": "lm_head.weight",
    "attn_norm": "model.layers.{i}.input_layernorm.weight",
    "q": "model.layers.{i}.self_attn.q_proj",
    "k": "model.layers.{i}.self_attn.k_proj",
    "v": "model.layers.{i}.self_attn.v_proj",
    "o": "model.layers.{i}.self_attn.o_proj",
    "mlp_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "gate": "model.layers.{i}.mlp.gate_proj",
    "up": "model.layers.{i}.mlp.up_proj",
    "down": "model.layers.{i}.mlp.down_proj",
}


def reference_logits(state: dict, config: dict, family: str, ids, key_mask, positions):
    """The family's forward written out in plain float64 torch from its own checkpoint keys:
    pre-norm RMSNorm, RoPE (rotate_half) at ``positions``, full attention over non-padding
    keys, SwiGLU; raw logits in the network's native alignment (Dream: shifted)."""
    names = LLADA_NAMES if family == "llada" else DREAM_NAMES
    if family == "llada":
        d, heads, kv, layers = (config[k] for k in ("d_model", "n_heads", "n_kv_heads", "n_layers"))
        eps, theta, tied = config["rms_norm_eps"], config["rope_theta"], config["weight_tying"]
    else:
        keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers")
        d, heads, kv, layers = (config[k] for k in keys)
        eps, theta, tied = (
            config["rms_norm_eps"],
            config["rope_theta"],
            config["tie_word_embeddings"],
        )
    hd = d // heads
    s = {k: v.double() for k, v in state.items()}

    def linear(x, prefix, i):
        name = prefix.format(i=i)
        bias = s.get(name + ".bias")
        y = x @ s[name + ".weight"].T
        return y if bias is None else y + bias

    def norm(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    angles = positions.double()[..., None] * inv_freq
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

    def rope(x):  # [B, H, T, hd]
        half = torch.cat([-x[..., hd // 2 :], x[..., : hd // 2]], -1)
        return x * cos[:, None] + half * sin[:, None]

    b, t = ids.shape
    x = s[names["embed"]][ids]
    blocked = ~key_mask.bool()[:, None, None, :]
    for i in range(layers):
        h = norm(x, s[names["attn_norm"].format(i=i)])
        q = linear(h, names["q"], i).view(b, t, heads, hd).transpose(1, 2)
        k = linear(h, names["k"], i).view(b, t, kv, hd).transpose(1, 2)
        v = linear(h, names["v"], i).view(b, t, kv, hd).transpose(1, 2)
        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
        scores = (q @ k.transpose(-1, -2) / math.sqrt(hd)).masked_fill(blocked, -math.inf)
        attended = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + linear(attended, names["o"], i)
        h = norm(x, s[names["mlp_norm"].format(i=i)])
        gate = linear(h, names["gate"], i)
        x = x + linear(torch.nn.functional.silu(gate) * linear(h, names["up"], i), names["down"], i)
    x = norm(x, s[names["final_norm"]])
    head = s[names["embed"]] if tied else s[names["head"]]
    return x @ head.T
