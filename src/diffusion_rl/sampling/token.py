"""Block-wise low-confidence remasking: one loop for serving and, with capture, for rollout.

docs/math.md §1.2. The completion (``generation_length`` slots, all MASK) is cut into blocks of
``block_size`` decoded left to right; where the blocks start is the model's block origin
(models/protocol.py: at the completion, or, for ``"canvas"`` models such as SDAR, at the
canvas, so a row's first block may be short and hold its prompt tail). At each step every
still-masked slot of the current block gets a proposal ``x̂ ~ softmax(z / T)`` (Gumbel-max
with float64 noise; ``T = 0`` is argmax) and a confidence; the most confident slots are
committed — a fixed count per step that finishes the block in ``steps_per_block`` steps, or
every slot with confidence >= threshold (at least one). Ties break by lowest position.
Committed tokens never change.

Invariants that make rollouts replayable and rows independent:

* step ids are ``block * step_stride + step_in_block`` (``step_stride`` = steps_per_block for
  the fixed schedule, block_size for the threshold one), never a batch-wide counter;
* the noise for row ``b`` at step id ``s`` comes from a generator seeded by
  ``(seeds[b], s)`` alone, so a row's output does not depend on its batch mates;
* a row stops once a block it completed holds the stop token; its later slots stay MASK in
  every canvas, are never sampled (commit step -1) and read as the stop token in the output.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..kernels import KERNELS
from ..models.protocol import TokenDenoiser, block_layout, block_origin
from ..seeding import row_step_generator
from ..trace import TokenTrace


class TokenSamplerConfig(BaseModel):
    """Settings of the block sampler (stored in every trace and checkpoint).

    Strict types: ints are ints (not bools or floats), floats finite, bools bools. Recipe
    configs also bound the sizes (``diffusion_rl.config.LIMITS``).
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    generation_length: int = Field(default=8, gt=0)
    block_size: int = Field(default=4, gt=0)
    steps_per_block: int = Field(default=4, gt=0)
    temperature: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    confidence: Literal["probability", "margin", "neg_entropy", "left_to_right"] = "probability"
    schedule: Literal["fixed", "threshold"] = "fixed"
    threshold: float = Field(default=0.9, gt=0.0, le=1.0, allow_inf_nan=False)
    use_cache: bool | None = None
    stop_at_eos: bool = True

    @model_validator(mode="after")
    def _check(self) -> TokenSamplerConfig:
        if self.schedule == "fixed" and self.steps_per_block > self.block_size:
            raise ValueError(
                f"steps_per_block: the fixed schedule commits >= 1 slot per step, so it must be "
                f"<= block_size={self.block_size}, got {self.steps_per_block}"
            )
        return self

    @property
    def step_stride(self) -> int:
        return self.steps_per_block if self.schedule == "fixed" else self.block_size


@dataclass(frozen=True)
class TokenSample:
    tokens: torch.Tensor  # long [B, L]
    trace: TokenTrace | None


def commit_counts(num_slots: int, num_steps: int) -> list[int]:
    """Slots to commit at each of ``num_steps`` steps so a block of ``num_slots`` finishes:
    ``num_slots // num_steps`` each, the remainder one extra on the earliest steps."""
    base, extra = divmod(num_slots, num_steps)
    return [base + (1 if s < extra else 0) for s in range(num_steps)]


def gumbel_noise(
    seeds: Sequence[int], step_id: int, shape: tuple[int, int], device
) -> torch.Tensor:
    """Float64 standard Gumbel noise ``[B, *shape]``, row b drawn from ``(seeds[b], step_id)``."""
    tiny = torch.finfo(torch.float64).tiny
    rows = []
    for seed in seeds:
        u = torch.rand(shape, generator=row_step_generator(seed, step_id), dtype=torch.float64)
        rows.append(-torch.log(-torch.log(u.clamp(min=tiny, max=1.0 - 1e-16))))
    return torch.stack(rows).to(device)


def select_commits(
    pending: torch.Tensor,
    confidence: torch.Tensor,
    count: torch.Tensor | None,
    threshold: float | None,
) -> torch.Tensor:
    """Bool ``[B, K]`` of slots to commit among ``pending`` ones.

    Fixed schedule: the ``count[b]`` most confident pending slots. Threshold: every pending
    slot with confidence >= threshold, and at least the most confident one. Ties go to the
    lowest position (stable sort).
    """
    scores = torch.where(pending, confidence, torch.full_like(confidence, -math.inf))
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order))
    if count is not None:
        return pending & (rank < count[:, None])
    chosen = pending & (confidence >= threshold)
    return chosen | (pending & (rank == 0))


def _count_table(slots: torch.Tensor, steps_per_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed schedule, per row: ``S_b = min(steps_per_block, n_b)`` steps and the commit count
    of each step (:func:`commit_counts`) for a block with ``slots [B]`` = ``n_b`` slots."""
    steps = slots.clamp(max=steps_per_block)
    table = torch.zeros(slots.shape[0], steps_per_block, dtype=torch.long)
    for n in set(slots.tolist()):
        if n > 0:
            counts = commit_counts(n, min(steps_per_block, n))
            table[slots.cpu() == n, : len(counts)] = torch.tensor(counts)
    return steps, table.to(slots.device)


@torch.no_grad()
def sample_tokens(
    model: TokenDenoiser,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor | None,
    config: TokenSamplerConfig,
    *,
    seeds: Sequence[int] | torch.Tensor,
    stop_token_id: int | None = None,
    capture: bool = False,
    weights_version: int = 0,
    on_block: Callable[[int, torch.Tensor], None] | None = None,
) -> TokenSample:
    """Decode ``generation_length`` tokens after each prompt.

    ``prompt_ids`` long ``[B, P]`` left-padded, ``prompt_mask`` bool ``[B, P]`` (None = all
    real), ``seeds``: one int per row. ``stop_token_id`` is honoured when
    ``config.stop_at_eos``. With ``capture`` the result carries a :class:`TokenTrace`.

    Blocks follow the model's block origin (``models/protocol.py``): row ``b``'s completion
    block ``j`` holds slots ``k`` with ``(r_b + k) // block_size = j`` (``r_b = 0`` unless the
    model is ``"canvas"``); with ``r_b > 0`` block 0 is short (``block_size - r_b`` slots,
    denoised together with the row's last ``r_b`` prompt tokens). Schedules count per row:
    the fixed one finishes a block of ``n_b`` slots in ``min(steps_per_block, n_b)`` steps.

    ``on_block(block, tokens)`` (optional; streaming) is called after each block is decoded
    with the tokens so far, ``[B, L]`` as the result reads them (uncommitted slots: the stop
    token, or MASK); it only observes, the result is the same with or without it.
    """
    device = prompt_ids.device
    batch, prompt_len = prompt_ids.shape
    if prompt_mask is None:
        prompt_mask = torch.ones_like(prompt_ids, dtype=torch.bool)
    seeds = [int(s) for s in (seeds.tolist() if isinstance(seeds, torch.Tensor) else seeds)]
    if len(seeds) != batch:
        raise ValueError(f"seeds: expected one per row ({batch}), got {len(seeds)}")
    model_block = getattr(model, "block_size", None)
    if model.attention == "block_causal" and config.block_size != model_block:
        raise ValueError(
            f"block_size: this block-causal model was built for blocks of {model_block}, "
            f"got sampler block_size={config.block_size}"
        )
    use_cache = (
        config.use_cache if config.use_cache is not None else model.attention == "block_causal"
    )
    if use_cache and model.attention != "block_causal":
        raise ValueError("use_cache: the block KV cache is exact only for block_causal models")
    stop = stop_token_id if config.stop_at_eos else None

    mask_id = model.mask_token_id
    length, size = config.generation_length, config.block_size
    origin = block_origin(model)
    layout = block_layout(model, prompt_mask, length, size)
    sample_kernel = KERNELS.resolve("token_sample_step", device)
    # Sampler state on aligned columns (== the completion slots unless some r_b > 0).
    slots = torch.full((batch, length), mask_id, dtype=torch.long, device=device)
    columns = layout.to_columns(slots, mask_id, tail=prompt_ids)
    commit_steps = layout.to_columns(torch.full_like(slots, -1), -1)
    logprobs = layout.to_columns(torch.zeros((batch, length), device=device), 0.0)
    is_slot, is_key, slot_index = layout.is_slot, layout.is_key, layout.slot
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    cache = model.new_cache(prompt_ids, prompt_mask) if use_cache else None
    full_mask = torch.cat([prompt_mask, torch.ones_like(slots, dtype=torch.bool)], dim=1)

    for block in range(layout.num_blocks):
        lo, hi = layout.span(block)
        block_slots = is_slot[:, lo:hi].sum(1)
        if config.schedule == "fixed":
            row_steps, table = _count_table(block_slots, config.steps_per_block)
        else:
            row_steps, table = block_slots, None
        key_mask = {"key_mask": is_key[:, lo:hi]} if origin == "canvas" else {}
        for step in range(int(row_steps.max())):
            pending = is_slot[:, lo:hi] & (commit_steps[:, lo:hi] < 0) & ~done[:, None]
            if not bool(pending.any()):
                break
            if cache is not None:
                logits = model.forward_block(columns[:, lo:hi], cache, **key_mask)
            else:
                canvas = torch.cat([prompt_ids, layout.to_slots(columns)], dim=1)
                logits = model(canvas, full_mask, prompt_len)
                if layout.aligned:
                    where = (prompt_len + slot_index[:, lo:hi]).clamp(0, canvas.shape[1] - 1)
                    logits = logits.gather(1, where[..., None].expand(-1, -1, logits.shape[-1]))
                else:
                    logits = logits[:, prompt_len + lo : prompt_len + hi]
            logits = logits.float()
            logits[..., mask_id] = -math.inf
            step_id = block * config.step_stride + step
            noise = None
            if config.temperature > 0:  # canvas rows: a fixed width, whatever the batch
                width = size if origin == "canvas" else hi - lo
                noise = gumbel_noise(seeds, step_id, (width, logits.shape[-1]), device)
                noise = noise[:, : hi - lo]
            proposal, logprob, confidence = sample_kernel.fn(
                logits, config.temperature, noise, config.confidence
            )
            count = None
            if table is not None:
                count = torch.where(step == row_steps - 1, pending.sum(1), table[:, step])
            chosen = select_commits(
                pending, confidence, count, config.threshold if table is None else None
            )
            columns[:, lo:hi] = torch.where(chosen, proposal, columns[:, lo:hi])
            commit_steps[:, lo:hi] = torch.where(chosen, step_id, commit_steps[:, lo:hi])
            logprobs[:, lo:hi] = torch.where(chosen, logprob, logprobs[:, lo:hi])
        if cache is not None:
            model.forward_block(columns[:, lo:hi], cache, extend=True, **key_mask)
        if stop is not None:
            done |= ((columns[:, lo:hi] == stop) & (commit_steps[:, lo:hi] >= 0)).any(1)
        if on_block is not None:
            so_far, committed = layout.to_slots(columns), layout.to_slots(commit_steps) >= 0
            fill = stop if stop is not None else mask_id
            on_block(block, torch.where(committed, so_far, torch.full_like(so_far, fill)))
        if stop is not None and bool(done.all()):
            break

    completion = layout.to_slots(columns)
    commit_steps, logprobs = layout.to_slots(commit_steps), layout.to_slots(logprobs)
    fill = stop if stop is not None else mask_id
    tokens = torch.where(commit_steps >= 0, completion, torch.full_like(completion, fill))
    trace = None
    if capture:
        info = {
            "mask_token_id": mask_id,
            "attention": model.attention,
            "block_size": model_block,
            "vocab_size": int(model.vocab_size),
        }
        if origin != "prompt":  # absent = "prompt" (traces of the built-in models unchanged)
            info["block_origin"] = origin
        trace = TokenTrace(
            prompt_ids=prompt_ids.clone(),
            prompt_mask=prompt_mask.clone(),
            tokens=tokens,
            commit_steps=commit_steps,
            behaviour_logprobs=logprobs,
            seeds=torch.tensor(seeds, dtype=torch.long),
            sampler={**config.model_dump(), "use_cache": use_cache},
            kernel_ids={
                "token_sample_step": sample_kernel.kernel_id,
                "token_logprobs": KERNELS.resolve("token_logprobs", device).kernel_id,
            },
            weights_version=int(weights_version),
            stop_token_id=stop,
            model_info=info,
        )
    return TokenSample(tokens=tokens, trace=trace)
