"""What the samplers, scorers and losses need from a token denoiser.

A *canvas* is ``prompt [P] ⊕ completion [L]`` (some completion slots = MASK). A denoiser maps
it to **target-aligned** logits: ``logits[b, i]`` predicts the token at canvas position ``i``.
Models that predict position ``i`` from ``i - 1`` (Dream, DiffuCoder, AR-initialised dLLMs)
are aligned once, in their adapter, with :func:`shift_to_target_aligned`; nothing downstream
shifts (docs/pitfalls.md, "Shifted versus same-position logits": mixing the two silently
scores the wrong token).

Attention is ``"bidirectional"`` (LLaDA / MDLM) or ``"block_causal"`` (BD3-LM / SDAR): the
prompt is block 0, completion slot ``k`` is in block ``1 + k // block_size``; a position sees
every position of its own and earlier blocks. Block-causal denoisers may also offer an exact
block KV cache (:class:`BlockCachedDenoiser`).
"""

from __future__ import annotations

from typing import Literal, Protocol, runtime_checkable

import torch

from ..contracts import Conditioning

Alignment = Literal["same_position", "shifted"]
AttentionKind = Literal["bidirectional", "block_causal"]


@runtime_checkable
class TokenDenoiser(Protocol):
    """A masked-diffusion LM with target-aligned logits.

    Attributes: ``vocab_size``, ``mask_token_id``, ``attention``, ``block_size`` (the block
    length a block-causal model was built for; ``None`` for bidirectional models).
    """

    vocab_size: int
    mask_token_id: int
    attention: AttentionKind
    block_size: int | None

    def __call__(
        self, input_ids: torch.Tensor, key_mask: torch.Tensor, prompt_length: int
    ) -> torch.Tensor:
        """``input_ids`` long ``[B, T]`` (T = P + L), ``key_mask`` bool ``[B, T]`` (False on
        padding), ``prompt_length`` P → target-aligned logits ``[B, T, V]``."""
        ...


@runtime_checkable
class BlockCachedDenoiser(TokenDenoiser, Protocol):
    """A block-causal denoiser with an exact block KV cache.

    ``new_cache`` runs the prompt once; ``forward_block`` scores the next block given
    everything cached (``extend=True`` also appends the block's keys/values, which is done
    once per block, with the block's final, committed tokens).
    """

    def new_cache(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor): ...

    def forward_block(
        self, block_ids: torch.Tensor, cache, *, extend: bool = False
    ) -> torch.Tensor: ...


def shift_to_target_aligned(raw_logits: torch.Tensor) -> torch.Tensor:
    """Align logits of a *shifted* model (position ``i - 1`` predicts token ``i``).

    ``raw_logits [B, T, V]`` → ``aligned [B, T, V]`` with ``aligned[:, i] = raw[:, i - 1]``
    for ``i >= 1``. Position 0 has no predecessor and keeps ``raw[:, 0]``; it is always a prompt
    position, which is never a target.
    """
    if raw_logits.dim() != 3:
        raise ValueError(
            f"raw_logits: expected rank 3 [B, T, V], got shape {tuple(raw_logits.shape)}"
        )
    return torch.cat([raw_logits[:, :1], raw_logits[:, :-1]], dim=1)


# ---------------------------------------------------------------------------------------------
# Flow-matching generators (docs/math.md §5)
# ---------------------------------------------------------------------------------------------
# Prompt conditioning (:data:`~diffusion_rl.contracts.Conditioning`): every value is batch-first
# ``[B, ...]`` so that the conditional and unconditional halves of classifier-free guidance
# concatenate along dim 0 into one forward.


@runtime_checkable
class VelocityModel(Protocol):
    """A flow-matching generator: the trained velocity network plus its frozen encoders.

    Convention (docs/math.md §5): ``x_σ = (1 - σ) x0 + σ ε`` and the model predicts
    ``v = ε - x0``; ``σ = 1`` is pure noise, ``σ = 0`` the clean latent. Adapters of models
    with another timestep convention (diffusers: ``t = 1000 σ``) convert inside ``__call__``.

    * ``latent_shape``: one sample's latent, ``(C, H, W)`` for images, ``(C, F, H, W)`` video.
    * ``__call__(latents [B, *latent_shape], sigma float [B], cond)`` → velocity, same shape
      and dtype as ``latents``.
    * ``encode_prompts(prompts)`` → :data:`Conditioning` for ``len(prompts)`` rows;
      ``empty_condition(B)`` → the unconditional (empty / negative prompt) conditioning.
      Neither carries gradient into frozen encoders.
    * ``decode(latents)`` → pixels in ``[0, 1]``: ``[B, 3, H, W]`` (``[B, F, 3, H, W]`` video).

    Only parameters with ``requires_grad`` are trained (frozen encoders and VAEs set it False).
    """

    latent_shape: tuple[int, ...]

    def __call__(
        self, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning
    ) -> torch.Tensor: ...

    def encode_prompts(self, prompts: list[str]) -> Conditioning: ...

    def empty_condition(self, batch_size: int) -> Conditioning: ...

    def decode(self, latents: torch.Tensor) -> torch.Tensor: ...
