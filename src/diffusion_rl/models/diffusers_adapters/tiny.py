"""Tiny, randomly initialised text encoders and tokenizers, built offline (tests, examples).

The tokenizers know lowercase letters and digits one character at a time (anything else is
the unknown token); they are real transformers tokenizers, so pipelines save and reload them.
The image side (Wan image-to-video) is a 2-layer CLIP vision tower and a CLIP image processor
sized to it.
transformers 5's ``CLIPTokenizer`` ignores ``vocab_file=``: it is built from ``vocab=`` /
``merges=`` with an explicit ``model_max_length``. The T5 tokenizer is a Unigram model over a
hand-written piece list (no sentencepiece file).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import (
    CLIPImageProcessor,
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    CLIPVisionConfig,
    CLIPVisionModel,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
    UMT5Config,
    UMT5EncoderModel,
)

CHARACTERS = "abcdefghijklmnopqrstuvwxyz0123456789"
CLIP_BOS, CLIP_EOS = "<|startoftext|>", "<|endoftext|>"


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the block under ``torch.manual_seed(seed)`` without touching the caller's RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def tiny_clip_tokenizer(max_length: int) -> CLIPTokenizer:
    """Byte-level BPE with no merges: every character is a token (``c`` inside a word,
    ``c</w>`` at its end)."""
    vocab = {CLIP_BOS: 0, CLIP_EOS: 1}
    for char in CHARACTERS:
        vocab[char] = len(vocab)
        vocab[char + "</w>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_length)


def tiny_t5_tokenizer(max_length: int) -> T5Tokenizer:
    """Unigram over ``<pad>, </s>, <unk>, ▁`` and each character with and without ``▁``."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(char, -3.0) for char in CHARACTERS]
    pieces += [("▁" + char, -3.5) for char in CHARACTERS]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=max_length)


def tiny_clip_encoder(
    tokenizer: CLIPTokenizer, hidden: int, *, projection: int | None
) -> CLIPTextModel | CLIPTextModelWithProjection:
    """A 2-layer CLIP text encoder; ``projection`` set → ``CLIPTextModelWithProjection``
    (SD3), else ``CLIPTextModel`` (FLUX pools its last hidden state)."""
    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=tokenizer.model_max_length,
        projection_dim=projection or hidden,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model_class = CLIPTextModelWithProjection if projection else CLIPTextModel
    return model_class(config).eval()


def tiny_t5_encoder(tokenizer: T5Tokenizer, d_model: int, *, umt5: bool = False):
    """A 1-layer T5 (or UMT5, Wan's) encoder of width ``d_model``."""
    config_class, model_class = (
        (UMT5Config, UMT5EncoderModel) if umt5 else (T5Config, T5EncoderModel)
    )
    config = config_class(
        vocab_size=len(tokenizer),
        d_model=d_model,
        d_kv=d_model // 4,
        d_ff=2 * d_model,
        num_layers=1,
        num_heads=4,
        relative_attention_num_buckets=8,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    return model_class(config).eval()


def tiny_clip_vision_encoder(hidden: int, image_size: int, patch_size: int) -> CLIPVisionModel:
    """A 2-layer CLIP vision tower of width ``hidden`` on ``image_size``² pixels:
    ``(image_size / patch_size)² + 1`` tokens (patches and the class token)."""
    config = CLIPVisionConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        projection_dim=hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=patch_size,
    )
    return CLIPVisionModel(config).eval()


def tiny_clip_image_processor(image_size: int) -> CLIPImageProcessor:
    """CLIP's preprocessing (shortest edge resized to ``image_size``, bicubic, centre crop of
    ``image_size``², OpenAI mean / std) at the tiny tower's resolution. Without torchvision,
    transformers 5 builds its PIL-backend twin (same settings, same saved config)."""
    size = {"shortest_edge": image_size}
    crop = {"height": image_size, "width": image_size}
    return CLIPImageProcessor(size=size, crop_size=crop)
