"""Exact replay: the policy log-prob of every action in the very state it was taken.

MATH.md §1.3. For action ``i`` (slot committed at step ``a_i`` with token ``x_i``):
``ℓ_i(θ) = log softmax(f_θ(c_{a_i})_i / T)[x_i]`` with ``c_s = prompt ⊕ [x_j if 0 <= a_j < s
else MASK]``. *Dense* replay runs one forward per distinct step id, on the rows that acted at
that step, and reads the slots committed there. At the behaviour weights it reproduces the
sampler's log-probs (the parity diagnostic).

Input: a :class:`~diffusion_rl.contracts.DiffusionTokenBatch` from
:meth:`~diffusion_rl.trace.TokenTrace.prepare` (model inputs ``prompt_ids``, ``prompt_mask``,
``completion_ids``, ``commit_steps``). Inactive slots (weight 0) are sanitised: their logits
and targets are replaced by 0 before any arithmetic and their outputs are 0, so sentinels or
non-finite values there never reach a loss or a gradient.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from ..contracts import DiffusionTokenBatch, validate_diffusion_logits
from ..kernels import KERNELS, scoring_temperature
from ..models.protocol import TokenDenoiser

REQUIRED_INPUTS = ("prompt_ids", "prompt_mask", "completion_ids", "commit_steps")


@dataclass(frozen=True)
class ReplayScores:
    """``logprobs`` float32 ``[B, L]`` (0 on inactive slots); ``entropy`` float32 ``[B, L]`` of
    the policy at each action's state, or None when not requested."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None


def masked_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Entropy of ``softmax(logits / T)`` over the last dim; finite with -inf (MASK) logits."""
    logp = torch.log_softmax(logits / scoring_temperature(temperature), dim=-1)
    p_logp = torch.where(logp > -math.inf, logp.exp() * logp, torch.zeros_like(logp))
    return -p_logp.sum(-1)


class ReplayScorer:
    """Scores prepared token traces with ``model`` at the rollout's temperature.

    ``stop_gradient=True`` scores without building a graph (reference / old policy);
    ``micro_batch_size`` bounds how many rows run per forward; ``kernel_id`` pins the
    log-prob kernel recorded in the trace (refused, by name, when unavailable).
    """

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

    def score(self, batch: DiffusionTokenBatch) -> ReplayScores:
        missing = [k for k in REQUIRED_INPUTS if k not in batch.model_inputs]
        if missing:
            raise ValueError(
                f"model_inputs: exact replay needs {list(REQUIRED_INPUTS)}, missing {missing}; "
                "build the batch with TokenTrace.prepare()"
            )
        chunks = batch.split(self.micro_batch_size or batch.batch_size)
        context = torch.no_grad() if self.stop_gradient else contextlib.nullcontext()
        with context:
            parts = [self._score_chunk(chunk) for chunk in chunks]
        logprobs = torch.cat([p.logprobs for p in parts])
        entropy = torch.cat([p.entropy for p in parts]) if self.compute_entropy else None
        return ReplayScores(logprobs, entropy)

    def _score_chunk(self, batch: DiffusionTokenBatch) -> ReplayScores:
        inputs = batch.model_inputs
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"].bool()
        tokens, steps = inputs["completion_ids"], inputs["commit_steps"]
        active = batch.active
        targets = torch.where(active, batch.target_ids, torch.zeros_like(batch.target_ids))
        prompt_len = prompt_ids.shape[1]
        key_mask = torch.cat([prompt_mask, torch.ones_like(tokens, dtype=torch.bool)], dim=1)
        mask_id = self.model.mask_token_id

        logprobs = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
        entropy = torch.zeros_like(logprobs) if self.compute_entropy else None
        acting = active & (steps >= 0)
        for step in torch.unique(steps[acting]).tolist():
            at_step = acting & (steps == step)
            rows = at_step.any(1).nonzero().squeeze(1)
            visible = (steps[rows] >= 0) & (steps[rows] < step)
            canvas = torch.where(visible, tokens[rows], torch.full_like(tokens[rows], mask_id))
            logits = self.model(
                torch.cat([prompt_ids[rows], canvas], 1), key_mask[rows], prompt_len
            )
            logits = logits[:, prompt_len:].float()
            validate_diffusion_logits(batch[rows], logits)
            here = at_step[rows]
            logits = torch.where(here[..., None], logits, torch.zeros_like(logits))
            logits = logits.index_fill(-1, torch.tensor([mask_id], device=logits.device), -math.inf)
            step_logprobs = self.logprob_kernel.fn(logits, targets[rows], self.temperature)
            update = torch.zeros_like(logprobs).index_put(
                (rows,), torch.where(here, step_logprobs, 0.0)
            )
            logprobs = logprobs + update
            if entropy is not None:
                step_entropy = torch.where(here, masked_entropy(logits, self.temperature), 0.0)
                entropy = entropy + torch.zeros_like(entropy).index_put((rows,), step_entropy)
        return ReplayScores(logprobs, entropy)
