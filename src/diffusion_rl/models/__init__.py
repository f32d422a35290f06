"""Models: the token denoiser and velocity-model protocols, the built-in diffusion transformer
(token), FlowDiT (image) and VideoDiT (image-to-video), their tokenizer, and one loader /
writer for model directories (:func:`load_model`, :func:`save_model`; see :mod:`.io` for what
a directory holds)."""

from .dit import FlowDiT, FlowDiTConfig
from .io import LoadedModel, load_model, save_model
from .protocol import (
    BlockCachedDenoiser,
    Conditioning,
    TokenDenoiser,
    VelocityModel,
    shift_to_target_aligned,
)
from .tokenizer import CharTokenizer
from .transformer import BlockKVCache, DiffusionTransformer, TransformerConfig
from .video_dit import VideoDiT, VideoDiTConfig

__all__ = [
    "BlockCachedDenoiser",
    "BlockKVCache",
    "CharTokenizer",
    "Conditioning",
    "DiffusionTransformer",
    "FlowDiT",
    "FlowDiTConfig",
    "LoadedModel",
    "TokenDenoiser",
    "TransformerConfig",
    "VelocityModel",
    "VideoDiT",
    "VideoDiTConfig",
    "load_model",
    "save_model",
    "shift_to_target_aligned",
]
