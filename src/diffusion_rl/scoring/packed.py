"""Packed exact replay for block-causal models: every step's logits from one forward.

docs/math.md §1.3 (TraceRL layout). Exact replay scores action ``i`` (slot committed at step
``a_i`` with token ``x_i``) as ``ℓ_i = log softmax(f_θ(c_{a_i})_i / T)[x_i]`` with
``c_s = prompt ⊕ [x_j if 0 <= a_j < s else MASK]``. Dense replay runs one forward per step.
In a block-causal model, a slot of block ``b`` sees only the prompt, blocks ``< b`` and its
own block, and by step ``s`` of block ``b`` every earlier block is final. So the rows of one
chunk are packed into one sequence per row::

    [ prompt (P) | clean completion (L) | copy (b, s) for every block b and step s in S_b ]

* the *clean completion* holds ``x_j`` where ``a_j >= 0`` and MASK where ``a_j = -1`` (never
  sampled, as in every canvas); prompt and clean completion are block-causal exactly like
  the model's own canvas (block origin, models/protocol.py: ``"prompt"``: the prompt is block
  0; ``"canvas"``: blocks of real positions, the prompt tail sharing the first completion
  block);
* the *copy* ``(b, s)`` holds completion block ``b`` of ``c_s`` (slot ``j`` shows ``x_j`` iff
  ``0 <= a_j < s``) at block ``b``'s positions, on the aligned columns of
  :class:`~diffusion_rl.models.protocol.BlockLayout` (for a ``"canvas"`` row with
  ``r_b > 0``, the copy of block 0 starts with the row's ``r_b`` prompt-tail tokens, whose
  keys and values depend on the block's state); it attends to the clean blocks before its
  own (prompt included, padding excluded) and to itself (bidirectionally); nothing attends to
  a copy;
* ``S_b`` is the *union over the chunk's rows* of the steps at which block ``b`` has an
  action. Rows differ (threshold schedules, rows that stopped early); a row with no action at
  ``s`` still carries the copy, whose logits are simply never read for it. This costs a few
  unread positions and keeps the layout one tensor per chunk.

Each action is read from its own copy's logits, ``read_index[b, i]`` = the packed position of
slot ``i`` in copy ``(block(i), a_i)``, with the same sanitised read as dense replay
(:func:`score_actions`). The result equals dense replay to fp32 rounding, gradients included.

Invariant the layout relies on (true of :func:`~diffusion_rl.sampling.sample_tokens`, whose
step ids are ``block * step_stride + step_in_block``): a row's commits in earlier blocks all
precede its actions in later blocks. :func:`packed_layout` checks it and refuses otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..contracts import DiffusionTokenBatch, validate_target_aligned_logits
from ..kernels import Kernel
from ..models.protocol import (
    BlockLayout,
    BlockOrigin,
    TokenDenoiser,
    block_origin,
    completion_offsets,
)
from .replay import ChunkedReplay, ReplayScores, check_block_order, masked_entropy


def score_actions(
    logits: torch.Tensor,
    targets: torch.Tensor,
    acting: torch.Tensor,
    *,
    mask_token_id: int,
    temperature: float,
    kernel: Kernel,
    compute_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The sanitised read of dense replay: log-probs (and entropies) of actions.

    ``logits [B, L, V]`` (any float dtype; read in float32), ``targets`` long ``[B, L]``
    (sanitised: any id in ``[0, V)`` on non-actions), ``acting`` bool ``[B, L]``. Logits of
    non-actions are replaced by 0 before any arithmetic, the MASK logit is set to -inf, and
    outputs on non-actions are exactly 0 (no NaN/inf reaches a loss or a gradient).
    Returns ``logprobs`` float32 ``[B, L]`` and ``entropy`` float32 ``[B, L]`` or None.
    """
    validate_target_aligned_logits(targets, acting, logits)
    logits = torch.where(acting[..., None], logits.float(), torch.zeros((), device=logits.device))
    logits = logits.index_fill(-1, torch.tensor([mask_token_id], device=logits.device), -math.inf)
    logprobs = torch.where(acting, kernel.fn(logits, targets, temperature), 0.0)
    entropy = None
    if compute_entropy:
        entropy = torch.where(acting, masked_entropy(logits, temperature), 0.0)
    return logprobs, entropy


@dataclass(frozen=True)
class PackedLayout:
    """One chunk's packed sequence (B rows, P prompt slots, L completion slots, T positions).

    * ``input_ids`` long ``[B, T]``: prompt, clean completion, then the copies in order
    * ``position_ids`` long ``[B, T]``: the model's canvas positions (``cumsum(key_mask) - 1``,
      so left padding never shifts a real token); a copy reuses its block's positions
    * ``allowed`` bool ``[B, T, T]``: query ``q`` may attend to key ``k``
    * ``read_index`` long ``[B, L]``: the position whose logits score slot ``i`` (its copy for
      step ``a_i`` when ``i`` is an action, else its clean position, never read)
    * ``copies``: ``(block, step)`` of each copy, in sequence order
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    allowed: torch.Tensor
    read_index: torch.Tensor
    copies: tuple[tuple[int, int], ...]


def packed_layout(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    commit_steps: torch.Tensor,
    acting: torch.Tensor,
    *,
    block_size: int,
    mask_token_id: int,
    block_origin: BlockOrigin = "prompt",
) -> PackedLayout:
    """Build the packed sequence of the module docstring.

    ``prompt_ids`` long ``[B, P]`` left-padded, ``prompt_mask`` bool ``[B, P]``,
    ``completion_ids`` / ``commit_steps`` long ``[B, L]`` (-1 = never sampled), ``acting``
    bool ``[B, L]`` (the slots to score; each has ``commit_steps >= 0``). ``T = P + L +
    Σ_j |S_j| · w_j`` with ``w_j`` the width of completion block ``j`` on the aligned columns
    (:class:`~diffusion_rl.models.protocol.BlockLayout`; ``w_j = |j|`` for ``"prompt"``).
    """
    device = prompt_ids.device
    batch, prompt_len = prompt_ids.shape
    length = completion_ids.shape[1]
    prompt_mask = prompt_mask.bool()
    layout = BlockLayout(
        completion_offsets(prompt_mask, block_size, block_origin), length, block_size
    )
    # The clean blocks stand in for the canvas of every later step: check each action comes
    # after every commit of its row's earlier blocks.
    check_block_order(commit_steps, acting, layout, "packed replay")

    sampled = commit_steps >= 0
    mask = torch.full_like(completion_ids, mask_token_id)
    slot = torch.arange(length, device=device)
    real = prompt_mask.long().sum(1, keepdim=True)
    prompt_pos = (prompt_mask.long().cumsum(1) - 1).clamp_min(0)
    slot_pos = real + slot
    if block_origin == "canvas":  # blocks of real positions (docs/math.md §1.1)
        prompt_block, slot_block = prompt_pos // block_size, slot_pos // block_size
        block_base = (real - layout.offsets[:, None]) // block_size  # block of column 0
    else:  # the prompt is block 0, completion slot k is in block 1 + k // K
        prompt_block = torch.zeros_like(prompt_pos)
        slot_block = (1 + slot // block_size).expand(batch, length)
        block_base = torch.ones_like(real)
    # per aligned column: slot, position and token of the clean canvas (prompt tail included)
    col_slot = layout.slot
    col_pos = real + col_slot
    clean = torch.where(sampled, completion_ids, mask)
    col_clean = layout.to_columns(clean, mask_token_id, tail=prompt_ids)
    col_sampled, col_steps = layout.to_columns(sampled, False), layout.to_columns(commit_steps, -1)
    col_acting, col_key = layout.to_columns(acting, False), layout.is_key
    col_mask = torch.where(col_slot < 0, col_clean, torch.full_like(col_clean, mask_token_id))

    ids, positions = [prompt_ids, clean], [prompt_pos, slot_pos]
    seg_block, key_valid = [prompt_block, slot_block], [prompt_mask, torch.ones_like(sampled)]
    seg_copy = [torch.full((prompt_len + length,), -1, dtype=torch.long, device=device)]
    read_index = (prompt_len + slot).expand(batch, length).clone()
    col_read = layout.to_columns(read_index, 0)
    copies: list[tuple[int, int]] = []
    offset = prompt_len + length
    for block in range(layout.num_blocks):
        lo, hi = layout.span(block)
        steps, here = col_steps[:, lo:hi], col_acting[:, lo:hi]
        for step in torch.unique(steps[here]).tolist():
            visible = col_sampled[:, lo:hi] & (steps < step)
            ids.append(torch.where(visible, col_clean[:, lo:hi], col_mask[:, lo:hi]))
            positions.append(col_pos[:, lo:hi])
            seg_block.append((block_base + block).expand(batch, hi - lo))
            key_valid.append(col_key[:, lo:hi])
            seg_copy.append(torch.full((hi - lo,), len(copies), dtype=torch.long, device=device))
            own = offset + torch.arange(hi - lo, device=device)
            col_read[:, lo:hi] = torch.where(here & (steps == step), own, col_read[:, lo:hi])
            copies.append((block, step))
            offset += hi - lo
    read_index = torch.where(acting, layout.to_slots(col_read), read_index)

    seg_block, seg_copy = torch.cat(seg_block, dim=1), torch.cat(seg_copy)
    key_valid = torch.cat(key_valid, dim=1)
    is_copy = seg_copy >= 0
    q_block, k_block = seg_block[:, :, None], seg_block[:, None, :]
    sees_clean = ~is_copy[None, None, :] & (
        (k_block < q_block) | ((k_block == q_block) & ~is_copy[None, :, None])
    )
    sees_own_copy = (is_copy[:, None] & (seg_copy[:, None] == seg_copy[None, :]))[None]
    allowed = (sees_clean | sees_own_copy) & key_valid[:, None, :]
    # a copy column past its row's end is no key; let it see itself (never read, never NaN)
    lone = ~key_valid & is_copy[None, :]
    allowed = allowed | (torch.diag_embed(lone) if bool(lone.any()) else False)
    return PackedLayout(
        input_ids=torch.cat(ids, dim=1),
        position_ids=torch.cat(positions, dim=1),
        allowed=allowed,
        read_index=read_index,
        copies=tuple(copies),
    )


class PackedReplayScorer(ChunkedReplay):
    """Exact replay of prepared token traces in one forward per chunk (block-causal models).

    Same contract as :class:`~diffusion_rl.scoring.ReplayScorer`: ``score(batch)`` returns
    :class:`ReplayScores` (``logprobs`` float32 ``[B, L]``, 0 on inactive slots; ``entropy``
    when ``compute_entropy``), equal to dense replay to fp32 rounding. ``stop_gradient`` scores
    without a graph; ``micro_batch_size`` bounds the rows per forward (each chunk is packed
    with its own union of steps); ``kernel_id`` pins the log-prob kernel. The model must be
    block-causal and offer ``forward_packed(input_ids, position_ids, allowed)``; a
    bidirectional model has no clean prefix to share, so it is refused (use ReplayScorer).

    Cost per row: one forward over ``T = P + L + Σ_b |S_b| · K`` positions with a dense
    ``T × T`` attention mask, against ``Σ_b |S_b|`` forwards over ``P + L`` for full-canvas
    dense replay.
    """

    kind = "packed replay"

    def __init__(self, model: TokenDenoiser, **settings) -> None:
        if model.attention != "block_causal" or getattr(model, "block_size", None) is None:
            raise ValueError(
                f"PackedReplayScorer: packed replay needs a block_causal model, got attention="
                f"{model.attention!r}; use ReplayScorer (dense replay) for this model"
            )
        if not hasattr(model, "forward_packed"):
            raise TypeError(
                f"PackedReplayScorer: {type(model).__name__} has no forward_packed(input_ids, "
                "position_ids, allowed); use ReplayScorer (dense replay) for this model"
            )
        super().__init__(model, **settings)

    def _score_chunk(self, batch: DiffusionTokenBatch) -> ReplayScores:
        inputs = batch.model_inputs
        tokens, steps = inputs["completion_ids"], inputs["commit_steps"]
        acting = batch.active & (steps >= 0)
        if not bool(acting.any()):
            zeros = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
            return ReplayScores(zeros, zeros.clone() if self.compute_entropy else None)
        targets = torch.where(acting, batch.target_ids, torch.zeros_like(batch.target_ids))
        layout = packed_layout(
            inputs["prompt_ids"],
            inputs["prompt_mask"].bool(),
            tokens,
            steps,
            acting,
            block_size=self.model.block_size,
            mask_token_id=self.model.mask_token_id,
            block_origin=block_origin(self.model),
        )
        logits = self.model.forward_packed(layout.input_ids, layout.position_ids, layout.allowed)
        index = layout.read_index[..., None].expand(-1, -1, logits.shape[-1])
        logprobs, entropy = score_actions(
            logits.gather(1, index),
            targets,
            acting,
            mask_token_id=self.model.mask_token_id,
            temperature=self.temperature,
            kernel=self.logprob_kernel,
            compute_entropy=self.compute_entropy,
        )
        return ReplayScores(logprobs, entropy)
