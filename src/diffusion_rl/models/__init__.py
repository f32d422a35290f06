"""Models: the token denoiser and velocity-model protocols, the built-in diffusion transformer
(token), FlowDiT (image) and VideoDiT (image-to-video), their tokenizer, and one loader /
writer for model directories (:func:`load_model`, :func:`save_model`; see :mod:`.io` for what
a directory holds).

The names are imported on first use."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

# exported name → the module that defines it (imported on first use: importing a light
# submodule such as .loading, which the command line uses, imports no torch)
_EXPORTS = {
    "FlowDiT": ".dit",
    "FlowDiTConfig": ".dit",
    "LoadedModel": ".io",
    "load_model": ".io",
    "save_model": ".io",
    "BlockCachedDenoiser": ".protocol",
    "Conditioning": ".protocol",
    "TokenDenoiser": ".protocol",
    "VelocityModel": ".protocol",
    "shift_to_target_aligned": ".protocol",
    "CharTokenizer": ".tokenizer",
    "BlockKVCache": ".transformer",
    "DiffusionTransformer": ".transformer",
    "TransformerConfig": ".transformer",
    "VideoDiT": ".video_dit",
    "VideoDiTConfig": ".video_dit",
}

if TYPE_CHECKING:  # for type checkers; at run time the names load on first use
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

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
