"""What the samplers, scorers and losses need from a token denoiser.

A *canvas* is ``prompt [P] ⊕ completion [L]`` (some completion slots = MASK). A denoiser maps
it to **target-aligned** logits: ``logits[b, i]`` predicts the token at canvas position ``i``.
Models that predict position ``i`` from ``i - 1`` (Dream, DiffuCoder, AR-initialised dLLMs)
are aligned once, in their adapter, with :func:`shift_to_target_aligned`; nothing downstream
shifts (docs/pitfalls.md, "Shifted versus same-position logits": mixing the two silently
scores the wrong token).

Attention is ``"bidirectional"`` (LLaDA / MDLM) or ``"block_causal"`` (BD3-LM / SDAR): a
position sees every position of its own and earlier blocks. Where the blocks start is the
model's ``block_origin`` (an optional attribute; absent means ``"prompt"``):

* ``"prompt"`` (the built-in models, BD3-LM-style): the prompt is block 0 and completion slot
  ``k`` is in block ``1 + k // block_size``; the completion's blocks start at slot 0.
* ``"canvas"`` (SDAR / TraDo): the *whole canvas* is cut into blocks from its first real
  token: the token at real position ``p`` (``cumsum(key_mask) - 1``, left padding excluded)
  is in block ``p // block_size``. With ``P_b`` real prompt tokens and
  ``r_b = P_b % block_size``, row ``b``'s completion slot ``k`` is in the row's completion
  block ``(r_b + k) // block_size`` (:func:`completion_offsets`); when ``r_b > 0`` the last
  ``r_b`` prompt tokens share completion block 0 with slots ``0 .. block_size - r_b - 1``
  and are denoised together with them (they attend to those slots and the slots to them).

The sampler, dense and packed replay and the trace validation decode *completion blocks*
``j = (r_b + k) // block_size`` (``r_b = 0`` for ``"prompt"``), per row; step ids are
``j * step_stride + step_in_block`` in both cases (docs/math.md §1.2, docs/pitfalls.md "SDAR's
blocks start at the canvas, not at the completion"). Block-causal denoisers may also offer
an exact block KV cache (:class:`BlockCachedDenoiser`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Literal, Protocol, runtime_checkable

import torch

from ..contracts import Conditioning

Alignment = Literal["same_position", "shifted"]
AttentionKind = Literal["bidirectional", "block_causal"]
BlockOrigin = Literal["prompt", "canvas"]
BLOCK_ORIGINS: tuple[str, ...] = ("prompt", "canvas")


def block_origin(model) -> BlockOrigin:
    """``model.block_origin`` (``"prompt"`` when the model does not say); anything else is a
    ``ValueError`` naming the attribute."""
    origin = getattr(model, "block_origin", "prompt")
    if origin not in BLOCK_ORIGINS:
        raise ValueError(
            f"block_origin: {type(model).__name__}.block_origin must be one of "
            f"{list(BLOCK_ORIGINS)}, got {origin!r}"
        )
    return origin


def completion_offsets(
    prompt_mask: torch.Tensor, block_size: int, origin: BlockOrigin
) -> torch.Tensor:
    """Long ``[B]``: ``r_b``, how many of row ``b``'s prompt tokens share its first completion
    block. ``P_b % block_size`` (``P_b`` = real prompt tokens, ``prompt_mask [B, P]`` bool,
    False on left padding) for ``"canvas"``; 0 for ``"prompt"``. Completion slot ``k`` of row
    ``b`` is in completion block ``(r_b + k) // block_size``."""
    if origin not in BLOCK_ORIGINS:
        raise ValueError(f"block_origin: expected one of {list(BLOCK_ORIGINS)}, got {origin!r}")
    if origin == "prompt":
        return torch.zeros(prompt_mask.shape[0], dtype=torch.long, device=prompt_mask.device)
    return prompt_mask.long().sum(1) % block_size


def completion_blocks(offsets: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Long ``[B, L]``: the completion block ``(r_b + k) // block_size`` of every slot ``k``
    (``offsets`` = :func:`completion_offsets`)."""
    slots = torch.arange(length, device=offsets.device)
    return (offsets[:, None] + slots[None, :]) // block_size


@dataclass(frozen=True)
class BlockLayout:
    """Where each row's completion blocks lie (``models/protocol.py``, block origin).

    The sampler, dense and packed replay work on *aligned* rows of ``width = L + max_b r_b``
    columns: column ``c`` of row ``b`` is completion slot ``c - r_b`` (``slot [B, W]``), so
    completion block ``j`` is columns ``[j K, (j + 1) K)`` for every row. Columns ``c < r_b``
    hold the row's prompt tail (real prompt tokens in block 0, context, never sampled),
    columns ``c >= r_b + L`` lie past the row's end (not keys, never sampled). For
    ``block_origin = "prompt"`` every ``r_b = 0``: ``width = L`` and aligned rows *are* the
    completion, so built-in models run exactly the computation of the slot layout.
    """

    offsets: torch.Tensor  # long [B]: r_b
    length: int  # L
    block_size: int  # K

    @cached_property
    def width(self) -> int:
        return self.length + (int(self.offsets.max()) if self.offsets.numel() else 0)

    @property
    def num_blocks(self) -> int:
        return math.ceil(self.width / self.block_size)

    @property
    def aligned(self) -> bool:
        """True when some ``r_b > 0`` (columns and slots differ)."""
        return self.width != self.length

    def span(self, block: int) -> tuple[int, int]:
        return block * self.block_size, min(self.width, (block + 1) * self.block_size)

    @cached_property
    def slot(self) -> torch.Tensor:
        """Long ``[B, W]``: the completion slot of each column (< 0: prompt tail)."""
        cols = torch.arange(self.width, device=self.offsets.device)
        return cols[None, :] - self.offsets[:, None]

    @cached_property
    def is_slot(self) -> torch.Tensor:
        """Bool ``[B, W]``: columns that are completion slots."""
        slot = self.slot
        return (slot >= 0) & (slot < self.length)

    @cached_property
    def is_key(self) -> torch.Tensor:
        """Bool ``[B, W]``: columns that exist (prompt tail or slot), i.e. attention keys."""
        return self.slot < self.length

    def to_columns(self, values: torch.Tensor, fill, tail: torch.Tensor | None = None):
        """``values [B, L, ...]`` on aligned columns ``[B, W, ...]``: ``fill`` off the slots,
        or the last ``r_b`` columns of ``tail [B, P]`` (the prompt) on the prompt tail.
        Without any ``r_b > 0`` this is ``values`` itself (not a copy)."""
        if not self.aligned:
            return values
        slot = self.slot
        index = slot.clamp(0, self.length - 1)
        while index.dim() < values.dim():
            index = index[..., None]
        out = values.gather(1, index.expand(-1, -1, *values.shape[2:]))
        keep = self.is_slot.view(*slot.shape, *([1] * (values.dim() - 2)))
        out = torch.where(keep, out, torch.full_like(out, fill))
        if tail is not None:
            prompt_len = tail.shape[1]
            tail_cols = tail.gather(1, (prompt_len + slot).clamp(0, prompt_len - 1))
            out = torch.where(slot < 0, tail_cols, out)
        return out

    def to_slots(self, columns: torch.Tensor) -> torch.Tensor:
        """Aligned ``[B, W, ...]`` back to slots ``[B, L, ...]`` (``columns`` itself without
        any ``r_b > 0``)."""
        if not self.aligned:
            return columns
        index = self.offsets[:, None] + torch.arange(self.length, device=columns.device)
        while index.dim() < columns.dim():
            index = index[..., None]
        return columns.gather(1, index.expand(-1, -1, *columns.shape[2:]))


def block_layout(model, prompt_mask: torch.Tensor, length: int, block_size: int) -> BlockLayout:
    """The :class:`BlockLayout` of ``model``'s block origin (:func:`block_origin`) for these
    prompts (``prompt_mask [B, P]``), ``length`` completion slots, blocks of ``block_size``."""
    offsets = completion_offsets(prompt_mask.bool(), block_size, block_origin(model))
    return BlockLayout(offsets=offsets, length=length, block_size=block_size)


@runtime_checkable
class TokenDenoiser(Protocol):
    """A masked-diffusion LM with target-aligned logits.

    Attributes: ``vocab_size``, ``mask_token_id``, ``attention``, ``block_size`` (the block
    length a block-causal model was built for; ``None`` for bidirectional models), and
    optionally ``block_origin`` (``"prompt"`` when absent; see the module docstring). A
    ``"canvas"`` model takes its blocks from ``key_mask`` alone (``prompt_length`` does not
    change its logits).
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

    ``block_origin == "canvas"`` models: ``new_cache`` caches only each row's *fully-prompt*
    blocks (the first ``P_b - r_b`` real prompt tokens); the block passed to ``forward_block``
    is the row's completion block ``j`` laid out on the canvas (for ``j = 0``: the ``r_b``
    prompt-tail tokens, then slots ``0 .. block_size - r_b - 1``), and ``forward_block``
    takes ``key_mask`` (bool ``[B, K]``, False on columns past the row's end) as a keyword.
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
