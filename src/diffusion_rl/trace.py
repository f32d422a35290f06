"""What a token rollout records, and how it becomes a scorable batch.

Committed tokens never change, so the canvas the sampler saw at step ``s`` is a pure function
of the final tokens ``x`` and the per-slot commit steps ``a`` (MATH.md §1.2):
``c_s = prompt ⊕ [x_i if 0 <= a_i < s else MASK]``. Slots the sampler never sampled (a row
stopped early) have ``a_i = -1``: they were MASK in every canvas, are filled with the stop
token in the returned text, and are never actions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .contracts import DiffusionTokenBatch


@dataclass(frozen=True)
class TokenTrace:
    """A captured token rollout (B rows, P prompt slots, L completion slots).

    * ``prompt_ids`` long ``[B, P]`` (left-padded), ``prompt_mask`` bool ``[B, P]``
    * ``tokens`` long ``[B, L]``: final completion (unsampled slots hold the stop/fill id)
    * ``commit_steps`` long ``[B, L]``: step at which each slot was committed, -1 if never
      sampled; step ids are ``block * step_stride + step_in_block`` so they do not depend on
      batch mates
    * ``behaviour_logprobs`` float32 ``[B, L]``: ``log softmax(z / T)[x]`` from the very
      logits that produced the sample (0 on unsampled slots)
    * ``seeds`` long ``[B]``; ``sampler`` settings; ``kernel_ids`` op → id; ``weights_version``
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    tokens: torch.Tensor
    commit_steps: torch.Tensor
    behaviour_logprobs: torch.Tensor
    seeds: torch.Tensor
    sampler: dict[str, Any]
    kernel_ids: dict[str, str]
    weights_version: int
    stop_token_id: int | None = None
    model_info: dict[str, Any] = field(default_factory=dict)

    @property
    def sampled(self) -> torch.Tensor:
        """Bool ``[B, L]``: slots that are actions (were sampled)."""
        return self.commit_steps >= 0

    @property
    def temperature(self) -> float:
        return float(self.sampler["temperature"])

    def post_stop(self) -> torch.Tensor:
        """Bool ``[B, L]``: sampled slots strictly after the row's first stop token."""
        if self.stop_token_id is None:
            return torch.zeros_like(self.sampled)
        is_stop = (self.tokens == self.stop_token_id) & self.sampled
        seen = is_stop.long().cumsum(1)
        return self.sampled & ((seen - is_stop.long()) > 0)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @staticmethod
    def concat(traces: list[TokenTrace]) -> TokenTrace:
        """Rows of several traces of one rollout; settings, kernels and version must agree."""
        if not traces:
            raise ValueError("TokenTrace.concat: expected at least one trace, got none")
        first = traces[0]
        for k, trace in enumerate(traces[1:], start=1):
            for name in ("sampler", "kernel_ids", "weights_version", "stop_token_id", "model_info"):
                if getattr(trace, name) != getattr(first, name):
                    raise ValueError(
                        f"TokenTrace.concat: trace {k} has {name}={getattr(trace, name)!r}, "
                        f"trace 0 has {getattr(first, name)!r}; one rollout batch has one setting"
                    )
            for name in ("prompt_ids", "tokens"):
                if getattr(trace, name).shape[1:] != getattr(first, name).shape[1:]:
                    raise ValueError(
                        f"TokenTrace.concat: trace {k} has {name} of shape "
                        f"{tuple(getattr(trace, name).shape)}, trace 0 {tuple(getattr(first, name).shape)}"
                    )

        def cat(name: str) -> torch.Tensor:
            return torch.cat([getattr(t, name) for t in traces])

        return TokenTrace(
            prompt_ids=cat("prompt_ids"),
            prompt_mask=cat("prompt_mask"),
            tokens=cat("tokens"),
            commit_steps=cat("commit_steps"),
            behaviour_logprobs=cat("behaviour_logprobs"),
            seeds=cat("seeds"),
            sampler=first.sampler,
            kernel_ids=first.kernel_ids,
            weights_version=first.weights_version,
            stop_token_id=first.stop_token_id,
            model_info=first.model_info,
        )

    def lengths(self) -> torch.Tensor:
        """Long ``[B]``: tokens up to and including the first stop token (L if none)."""
        length = self.tokens.shape[1]
        if self.stop_token_id is None:
            return torch.full((len(self),), length, dtype=torch.long)
        is_stop = (self.tokens == self.stop_token_id) & self.sampled
        first = torch.where(is_stop.any(1), is_stop.float().argmax(1) + 1, length)
        return first.long()

    def prepare(self, post_stop_weight: float = 1.0) -> DiffusionTokenBatch:
        """The batch the learner scores: every sampled slot is an action (weight 1), slots after
        the stop token weigh ``post_stop_weight`` (1 = full trace), unsampled slots 0.

        ``model_inputs``: ``prompt_ids``, ``prompt_mask``, ``completion_ids``,
        ``commit_steps``; ``target_ids`` = tokens (-1 on unsampled slots).
        """
        if not (post_stop_weight >= 0):
            raise ValueError(
                f"post_stop_weight: expected a finite value >= 0, got {post_stop_weight}"
            )
        weights = self.sampled.float()
        weights = torch.where(self.post_stop(), torch.full_like(weights, post_stop_weight), weights)
        return DiffusionTokenBatch(
            model_inputs={
                "prompt_ids": self.prompt_ids,
                "prompt_mask": self.prompt_mask,
                "completion_ids": self.tokens,
                "commit_steps": self.commit_steps,
            },
            target_ids=torch.where(self.sampled, self.tokens, torch.full_like(self.tokens, -1)),
            loss_weights=weights,
        )
