"""Token denoiser protocols and the built-in diffusion transformer."""

from .protocol import BlockCachedDenoiser, TokenDenoiser, shift_to_target_aligned
from .transformer import BlockKVCache, DiffusionTransformer, TransformerConfig

__all__ = [
    "BlockCachedDenoiser",
    "BlockKVCache",
    "DiffusionTransformer",
    "TokenDenoiser",
    "TransformerConfig",
    "shift_to_target_aligned",
]
