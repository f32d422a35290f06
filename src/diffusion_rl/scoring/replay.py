"""Exact replay: the policy log-prob of every action in the very state it was taken.

docs/math.md §1.3. For action ``i`` (slot committed at step ``a_i`` with token ``x_i``):
``ℓ_i(θ) = log softmax(f_θ(c_{a_i})_i / T)[x_i]`` with ``c_s = prompt ⊕ [x_j if 0 <= a_j < s
else MASK]``. *Dense* replay runs one forward per distinct step id, on the rows that acted at
that step, and reads the slots committed there. At the behaviour weights it reproduces the
sampler's log-probs (the parity diagnostic). The block KV-cache walk follows the model's block
origin per row (models/protocol.py: for a ``"canvas"`` model such as SDAR, a row's first block
holds its prompt tail), on the sampler's aligned columns; full-canvas replay leaves the blocks
to the model's own mask.

Input: a :class:`~diffusion_rl.contracts.DiffusionTokenBatch` from
:meth:`~diffusion_rl.trace.TokenTrace.prepare` (model inputs ``prompt_ids``, ``prompt_mask``,
``completion_ids``, ``commit_steps``). Inactive slots (weight 0) are sanitised: their logits
and targets are replaced by 0 before any arithmetic and their outputs are 0, so sentinels or
non-finite values there never reach a loss or a gradient.

With ``return_logits=True`` dense replay also returns the logits every action was read from
(the input of on-policy distillation, docs/math.md §4: a teacher scored through the same walk sees
exactly the student's states).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from ..contracts import DiffusionTokenBatch, validate_target_aligned_logits
from ..kernels import KERNELS, scoring_temperature
from ..models.protocol import BlockLayout, TokenDenoiser, block_layout, block_origin

REQUIRED_INPUTS = ("prompt_ids", "prompt_mask", "completion_ids", "commit_steps")


@dataclass(frozen=True)
class ReplayScores:
    """``logprobs`` float32 ``[B, L]`` (0 on inactive slots); ``entropy`` float32 ``[B, L]`` of
    the policy at each action's state, or None when not requested; ``logits`` float32
    ``[B, L, V]``, the untempered logits each action was read from (MASK logit at -inf),
    exactly 0 on non-actions, or None when not requested."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    logits: torch.Tensor | None = None


def masked_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Entropy of ``softmax(logits / T)`` over the last dim; finite with -inf (MASK) logits."""
    logp = torch.log_softmax(logits / scoring_temperature(temperature), dim=-1)
    p_logp = torch.where(logp > -math.inf, logp.exp() * logp, torch.zeros_like(logp))
    return -p_logp.sum(-1)


class ChunkedReplay:
    """What the exact scorers share: settings checks, kernel pinning, micro-batching and
    stop-gradient; subclasses implement ``_score_chunk(batch) -> ReplayScores``."""

    kind = "replay"

    def __init__(
        self,
        model: TokenDenoiser,
        *,
        temperature: float,
        compute_entropy: bool = False,
        stop_gradient: bool = False,
        micro_batch_size: int | None = None,
        kernel_id: str | None = None,
    ) -> None:
        if not (math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"temperature: expected a finite value >= 0, got {temperature}")
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError(f"micro_batch_size: expected >= 1 or None, got {micro_batch_size}")
        self.model = model
        self.temperature = temperature
        self.compute_entropy = compute_entropy
        self.stop_gradient = stop_gradient
        self.micro_batch_size = micro_batch_size
        self.logprob_kernel = KERNELS.resolve("token_logprobs", prefer=kernel_id)

    @classmethod
    def for_trace(cls, model: TokenDenoiser, trace, **options):
        """A scorer pinned to ``trace``: its temperature, log-prob kernel id and whatever else
        the scorer reads from a trace (:meth:`trace_options`)."""
        return cls(
            model,
            temperature=trace.temperature,
            kernel_id=trace.kernel_ids["token_logprobs"],
            **cls.trace_options(trace),
            **options,
        )

    @staticmethod
    def trace_options(trace) -> dict:
        return {}

    def score(self, batch: DiffusionTokenBatch) -> ReplayScores:
        missing = [k for k in REQUIRED_INPUTS if k not in batch.model_inputs]
        if missing:
            raise ValueError(
                f"model_inputs: {self.kind} needs {list(REQUIRED_INPUTS)}, missing {missing}; "
                "build the batch with TokenTrace.prepare()"
            )
        chunks = batch.split(self.micro_batch_size or batch.batch_size)
        context = torch.no_grad() if self.stop_gradient else contextlib.nullcontext()
        with context:
            parts = [self._score_chunk(chunk) for chunk in chunks]
        logprobs = torch.cat([p.logprobs for p in parts])
        entropy = torch.cat([p.entropy for p in parts]) if self.compute_entropy else None
        logits = torch.cat([p.logits for p in parts]) if parts[0].logits is not None else None
        return ReplayScores(logprobs, entropy, logits)

    def _score_chunk(self, batch: DiffusionTokenBatch) -> ReplayScores:
        raise NotImplementedError


class ReplayScorer(ChunkedReplay):
    """Scores prepared token traces with ``model`` at the rollout's temperature.

    ``stop_gradient=True`` scores without building a graph (reference / old policy);
    ``micro_batch_size`` bounds how many rows run per forward; ``kernel_id`` pins the
    log-prob kernel recorded in the trace (refused, by name, when unavailable); ``use_cache``
    (default: on for block-causal models, like the sampler) walks the blocks through the block
    KV cache, so a replay of the sampler's batch runs the sampler's exact computation;
    ``return_logits`` also returns each action's logits (:class:`ReplayScores`).

    :meth:`for_trace` builds a scorer with the settings a trace recorded.
    """

    kind = "exact replay"

    def __init__(
        self,
        model: TokenDenoiser,
        *,
        use_cache: bool | None = None,
        return_logits: bool = False,
        **settings,
    ) -> None:
        super().__init__(model, **settings)
        self.return_logits = return_logits
        cacheable = model.attention == "block_causal" and hasattr(model, "forward_block")
        if use_cache and not cacheable:
            raise ValueError(
                "use_cache: the block KV cache needs a block_causal model with forward_block"
            )
        self.use_cache = cacheable if use_cache is None else use_cache

    @staticmethod
    def trace_options(trace) -> dict:
        return {"use_cache": bool(trace.sampler.get("use_cache"))}

    def _score_chunk(self, batch: DiffusionTokenBatch) -> ReplayScores:
        inputs = batch.model_inputs
        tokens, steps = inputs["completion_ids"], inputs["commit_steps"]
        acting = batch.active & (steps >= 0)
        targets = torch.where(acting, batch.target_ids, torch.zeros_like(batch.target_ids))
        mask_id = self.model.mask_token_id

        def canvas_before(step: int | float) -> torch.Tensor:
            """The completion as the sampler saw it when step ``step`` began."""
            visible = (steps >= 0) & (steps < step)
            return torch.where(visible, tokens, torch.full_like(tokens, mask_id))

        def read(logits: torch.Tensor, here: torch.Tensor, target: torch.Tensor) -> tuple:
            """Log-probs (and entropy) of the actions ``here [B, K]`` (targets ``target``) from
            logits ``[B, K, V]``."""
            validate_target_aligned_logits(target, here, logits)
            logits = torch.where(
                here[..., None], logits.float(), torch.zeros((), device=logits.device)
            )
            logits = logits.index_fill(-1, torch.tensor([mask_id], device=logits.device), -math.inf)
            lp = torch.where(here, self.logprob_kernel.fn(logits, target, self.temperature), 0.0)
            ent = None
            if self.compute_entropy:
                ent = torch.where(here, masked_entropy(logits, self.temperature), 0.0)
            return lp, ent, logits if self.return_logits else None

        if self.use_cache:
            parts = self._replay_blocks(inputs, steps, acting, targets, canvas_before, read)
        else:
            parts = self._replay_canvas(batch, steps, acting, targets, canvas_before, read)
        logprobs = sum(p[0] for p in parts)
        entropy = sum(p[1] for p in parts) if self.compute_entropy else None
        zeros = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
        logits = None
        if self.return_logits:  # each action's slot is filled by exactly one part
            start = zeros[..., None].expand(*tokens.shape, self.model.vocab_size)
            logits = torch.where(acting[..., None], sum((p[2] for p in parts), start), 0.0)
        return ReplayScores(logprobs + zeros, None if entropy is None else entropy + zeros, logits)

    def _replay_canvas(self, batch, steps, acting, targets, canvas_before, read) -> list:
        """One full-canvas forward per distinct step id (any attention, any block origin: the
        model builds its own blocks from the canvas)."""
        prompt_ids, prompt_mask = (
            batch.model_inputs["prompt_ids"],
            batch.model_inputs["prompt_mask"].bool(),
        )
        prompt_len = prompt_ids.shape[1]
        key_mask = torch.cat([prompt_mask, torch.ones_like(steps, dtype=torch.bool)], dim=1)
        parts = []
        for step in torch.unique(steps[acting]).tolist():
            canvas = torch.cat([prompt_ids, canvas_before(step)], 1)
            logits = self.model(canvas, key_mask, prompt_len)[:, prompt_len:]
            parts.append(read(logits, acting & (steps == step), targets))
        return parts

    def _replay_blocks(self, inputs, steps, acting, targets, canvas_before, read) -> list:
        """Block-causal models: walk the blocks through the block KV cache exactly as the
        sampler did (same kernels, same shapes, same aligned columns for ``"canvas"`` models:
        bitwise parity for the same batch)."""
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"].bool()
        layout = block_layout(self.model, prompt_mask, steps.shape[1], self.model.block_size)
        check_block_order(steps, acting, layout, "ReplayScorer(use_cache=True)")
        col_steps, col_acting = layout.to_columns(steps, -1), layout.to_columns(acting, False)
        col_targets = layout.to_columns(targets, 0)
        is_key = layout.is_key if block_origin(self.model) == "canvas" else None
        mask_id = self.model.mask_token_id

        def state(step: int | float) -> torch.Tensor:
            return layout.to_columns(canvas_before(step), mask_id, tail=prompt_ids)

        size = self.model.block_size
        last = int(col_acting.nonzero()[:, 1].max()) // size if bool(col_acting.any()) else -1
        cache = self.model.new_cache(prompt_ids, prompt_mask)
        width = layout.width
        parts = []
        for block in range(last + 1):
            lo, hi = layout.span(block)
            extra = {} if is_key is None else {"key_mask": is_key[:, lo:hi]}
            block_steps, block_acting = col_steps[:, lo:hi], col_acting[:, lo:hi]
            pieces = []
            for step in torch.unique(block_steps[block_acting]).tolist():
                logits = self.model.forward_block(state(step)[:, lo:hi], cache, **extra)
                here = block_acting & (block_steps == step)
                pieces.append(read(logits, here, col_targets[:, lo:hi]))
            if block < last:
                self.model.forward_block(state(math.inf)[:, lo:hi], cache, extend=True, **extra)
            parts.extend(
                tuple(_to_slots(layout, t) for t in _place(piece, lo, hi, width))
                for piece in pieces
            )
        return parts


def check_block_order(
    commit_steps: torch.Tensor, acting: torch.Tensor, layout: BlockLayout, scorer: str
) -> None:
    """Refuse traces whose actions in a completion block do not all come after every commit
    of the row's earlier blocks (``commit_steps``/``acting`` ``[B, L]``; blocks per
    ``layout``). A block walk (KV cache, packed replay) scores a block against the *final*
    earlier blocks, which is the state the sampler acted in only under this order; a trace of
    another block origin than the model's fails it."""
    if not bool(acting.any()):
        return
    steps = layout.to_columns(commit_steps, -1)
    size, blocks = layout.block_size, layout.num_blocks
    padded = torch.nn.functional.pad(steps, (0, blocks * size - steps.shape[1]), value=-1)
    block_last = padded.view(steps.shape[0], blocks, size).max(-1).values.cummax(1).values
    earlier_last = torch.nn.functional.pad(block_last, (1, 0), value=-1)[:, :blocks]
    col_block = torch.arange(steps.shape[1], device=steps.device) // size
    late = layout.to_columns(acting, False) & (steps <= earlier_last[:, col_block])
    if bool(late.any()):
        raise ValueError(
            f"commit_steps: {scorer} needs every row's commits in earlier blocks to precede its "
            "actions in later blocks (as sample_tokens records them with the model's block "
            "origin; a trace sampled with another block_origin breaks it); use "
            "ReplayScorer(use_cache=False)"
        )


def _to_slots(layout: BlockLayout, t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else layout.to_slots(t)


def _place(piece: tuple, lo: int, hi: int, length: int) -> tuple:
    """Pad ``[B, hi - lo]`` (or ``[B, hi - lo, V]``) block results to ``[B, length(, V)]``."""
    return tuple(
        None
        if t is None
        else torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (lo, length - hi))
        for t in piece
    )
