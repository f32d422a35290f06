"""What a token rollout records, and how it becomes a scorable batch.

Committed tokens never change, so the canvas the sampler saw at step ``s`` is a pure function
of the final tokens ``x`` and the per-slot commit steps ``a`` (docs/math.md §1.2):
``c_s = prompt ⊕ [x_i if 0 <= a_i < s else MASK]``. Slots the sampler never sampled (a row
stopped early) have ``a_i = -1``: they were MASK in every canvas, are filled with the stop
token in the returned text, and are never actions.

A flow rollout (:class:`FlowTrace`, docs/math.md §5) records every latent the sampler continued
from, so step ``k`` of a row is scored as ``log p(latents[k+1] | latents[k])`` by replaying one
velocity forward; :meth:`FlowTrace.prepare` cuts it into
:class:`~diffusion_rl.contracts.FlowStepBatch` units.

Both traces turn into training batches the same way: ``trace.prepare(...)`` gives the batch
type of its world (defined in :mod:`diffusion_rl.contracts`), advantages included when given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .contracts import Conditioning, DiffusionTokenBatch, FlowStepBatch


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

    def rows(self, index: slice | torch.Tensor | Sequence[int]) -> TokenTrace:
        """The rows ``index`` (slice, index tensor or bool mask); settings unchanged."""
        if not isinstance(index, (slice, torch.Tensor)):
            index = torch.tensor([int(i) for i in index], dtype=torch.long)
        return replace(
            self,
            **{
                name: getattr(self, name)[index]
                for name in (
                    "prompt_ids",
                    "prompt_mask",
                    "tokens",
                    "commit_steps",
                    "behaviour_logprobs",
                    "seeds",
                )
            },
        )

    def lengths(self) -> torch.Tensor:
        """Long ``[B]``: tokens up to and including the first stop token (L if none)."""
        length = self.tokens.shape[1]
        if self.stop_token_id is None:
            return torch.full((len(self),), length, dtype=torch.long)
        is_stop = (self.tokens == self.stop_token_id) & self.sampled
        first = torch.where(is_stop.any(1), is_stop.float().argmax(1) + 1, length)
        return first.long()

    def prepare(
        self, post_stop_weight: float = 1.0, *, advantages: torch.Tensor | None = None
    ) -> DiffusionTokenBatch:
        """The batch the learner scores: every sampled slot is an action (weight 1), slots after
        the stop token weigh ``post_stop_weight`` (1 = full trace), unsampled slots 0.

        ``model_inputs``: ``prompt_ids``, ``prompt_mask``, ``completion_ids``,
        ``commit_steps``; with ``advantages [B]`` also ``advantages`` and
        ``behaviour_logprobs [B, L]`` (the training inputs of a policy loss, kept row-aligned
        by every slice); ``target_ids`` = tokens (-1 on unsampled slots).
        """
        if not (post_stop_weight >= 0):
            raise ValueError(
                f"post_stop_weight: expected a finite value >= 0, got {post_stop_weight}"
            )
        weights = self.sampled.float()
        weights = torch.where(self.post_stop(), torch.full_like(weights, post_stop_weight), weights)
        inputs = {
            "prompt_ids": self.prompt_ids,
            "prompt_mask": self.prompt_mask,
            "completion_ids": self.tokens,
            "commit_steps": self.commit_steps,
        }
        if advantages is not None:
            inputs["advantages"] = advantages
            inputs["behaviour_logprobs"] = self.behaviour_logprobs
        return DiffusionTokenBatch(
            model_inputs=inputs,
            target_ids=torch.where(self.sampled, self.tokens, torch.full_like(self.tokens, -1)),
            loss_weights=weights,
        )


# ---------------------------------------------------------------------------------------------
# Flow-matching rollouts (docs/math.md §5)
# ---------------------------------------------------------------------------------------------


def _check_conditioning(name: str, cond: Conditioning | None, rows: int) -> None:
    if cond is None:
        return
    if not isinstance(cond, dict) or not cond:
        raise TypeError(f"{name}: expected a non-empty dict of tensors, got {type(cond).__name__}")
    for key, value in cond.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != rows:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(
                f"{name}[{key!r}]: expected a batch-first tensor [B={rows}, ...], got {shape}"
            )


def _take(cond: Conditioning | None, index) -> Conditioning | None:
    return None if cond is None else {k: v[index] for k, v in cond.items()}


@dataclass(frozen=True)
class FlowTrace:
    """A captured flow-matching rollout: B rows, N steps from σ = 1 to σ = 0.

    * ``latents`` ``[B, N + 1, *latent_shape]``: ``latents[:, k]`` is *exactly* the tensor the
      sampler fed the model at step k and continued from (its dtype: with a bf16 latent dtype
      the rounded tensor: docs/pitfalls.md, "Stored latent is not the latent continued from"); ``latents[:, N]`` is the final sample
    * ``sigmas`` float32 ``[N + 1]``: the schedule, ``sigmas[0] = 1``, ``sigmas[N] = 0``
    * ``sde_steps`` bool ``[N]``: steps taken by the SDE kernel (the trainable ones); the
      others (and always the last) are ODE steps
    * ``behaviour_logprobs`` float32 ``[B, N]``: ``log p(latents[:, k+1] | latents[:, k])``
      under the sampling weights on SDE steps, 0 on ODE steps
    * ``cond`` / ``uncond``: the conditioning the velocity forwards used (``uncond`` None when
      guidance is 1: no CFG); ``prompts`` ``[B]``; ``seeds`` long ``[B]``
    * ``forward_groups`` long ``[B]``: rows with equal id ran their velocity forwards together,
      in row order. Replay forwards the same groups, so GEMM shapes match the sampler's and
      parity is bitwise; a replay of part of a group is equal only to fp tolerance
    * ``sampler``: the sampler settings (``FlowSamplerConfig`` dump plus ``latent_shape``,
      ``latent_dtype``, ``group_size``); ``kernel_ids`` op → id; ``weights_version``
    """

    latents: torch.Tensor
    sigmas: torch.Tensor
    sde_steps: torch.Tensor
    behaviour_logprobs: torch.Tensor
    cond: Conditioning
    uncond: Conditioning | None
    prompts: list[str]
    seeds: torch.Tensor
    forward_groups: torch.Tensor
    sampler: dict[str, Any]
    kernel_ids: dict[str, str]
    weights_version: int
    model_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        rows = self.latents.shape[0]
        steps = self.sigmas.shape[0] - 1
        if self.latents.dim() < 3 or self.latents.shape[1] != steps + 1:
            raise ValueError(
                f"FlowTrace.latents: expected [B, N+1={steps + 1}, *latent_shape] (sigmas has "
                f"N+1 entries), got {tuple(self.latents.shape)}"
            )
        if self.sigmas.dtype != torch.float32 or self.sigmas.dim() != 1:
            raise ValueError(f"FlowTrace.sigmas: expected float32 [N+1], got {self.sigmas.dtype}")
        if self.sde_steps.dtype != torch.bool or tuple(self.sde_steps.shape) != (steps,):
            raise ValueError(
                f"FlowTrace.sde_steps: expected bool [N={steps}], got {self.sde_steps.dtype} "
                f"{tuple(self.sde_steps.shape)}"
            )
        logprobs = self.behaviour_logprobs
        if logprobs.dtype != torch.float32 or tuple(logprobs.shape) != (rows, steps):
            raise ValueError(
                f"FlowTrace.behaviour_logprobs: expected float32 [B={rows}, N={steps}], got "
                f"{logprobs.dtype} {tuple(logprobs.shape)}"
            )
        for name in ("seeds", "forward_groups"):
            value = getattr(self, name)
            if value.dtype != torch.long or tuple(value.shape) != (rows,):
                raise ValueError(
                    f"FlowTrace.{name}: expected long [B={rows}], got {tuple(value.shape)}"
                )
        if len(self.prompts) != rows:
            raise ValueError(f"FlowTrace.prompts: expected {rows} prompts, got {len(self.prompts)}")
        _check_conditioning("FlowTrace.cond", self.cond, rows)
        _check_conditioning("FlowTrace.uncond", self.uncond, rows)
        if (self.uncond is None) != (self.guidance_scale == 1.0):
            raise ValueError(
                f"FlowTrace.uncond: guidance_scale={self.guidance_scale} needs an unconditional "
                "conditioning exactly when it is not 1"
            )

    # settings the replay must reproduce (from the sampler dump)
    @property
    def guidance_scale(self) -> float:
        return float(self.sampler["guidance_scale"])

    @property
    def noise_level(self) -> float:
        return float(self.sampler["noise_level"])

    @property
    def variant(self) -> str:
        return str(self.sampler["variant"])

    @property
    def reduction(self) -> str:
        return str(self.sampler["reduction"])

    @property
    def num_steps(self) -> int:
        return self.sigmas.shape[0] - 1

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return tuple(self.latents.shape[2:])

    def __len__(self) -> int:
        return self.latents.shape[0]

    def to(self, device: torch.device | str) -> FlowTrace:
        """Every tensor moved to ``device`` (values unchanged: replay parity is kept)."""

        def move(cond: Conditioning | None) -> Conditioning | None:
            return None if cond is None else {k: v.to(device) for k, v in cond.items()}

        return replace(
            self,
            latents=self.latents.to(device),
            behaviour_logprobs=self.behaviour_logprobs.to(device),
            cond=move(self.cond),
            uncond=move(self.uncond),
        )

    def sde_step_indices(self) -> list[int]:
        return self.sde_steps.nonzero().flatten().tolist()

    def rows(self, index: slice | torch.Tensor | Sequence[int]) -> FlowTrace:
        """The rows ``index`` (slice, index tensor or bool mask), keeping their group ids."""
        if isinstance(index, slice):
            picked = list(range(len(self)))[index]
        elif isinstance(index, torch.Tensor) and index.dtype == torch.bool:
            picked = index.nonzero().flatten().tolist()
        else:
            picked = [int(i) for i in index]
        at = torch.tensor(picked, dtype=torch.long)
        return replace(
            self,
            latents=self.latents[at],
            behaviour_logprobs=self.behaviour_logprobs[at],
            cond=_take(self.cond, at),
            uncond=_take(self.uncond, at),
            prompts=[self.prompts[i] for i in picked],
            seeds=self.seeds[at],
            forward_groups=self.forward_groups[at],
        )

    @staticmethod
    def concat(traces: Sequence[FlowTrace]) -> FlowTrace:
        """Rows of several traces of one rollout; schedule, settings, kernels and version must
        agree. Forward-group ids are offset so groups of different traces stay apart."""
        if not traces:
            raise ValueError("FlowTrace.concat: expected at least one trace, got none")
        first = traces[0]
        for k, trace in enumerate(traces[1:], start=1):
            for name in ("sampler", "kernel_ids", "weights_version", "model_info"):
                if getattr(trace, name) != getattr(first, name):
                    raise ValueError(
                        f"FlowTrace.concat: trace {k} has {name}={getattr(trace, name)!r}, trace 0 "
                        f"has {getattr(first, name)!r}; one rollout batch has one setting"
                    )
            for name in ("sigmas", "sde_steps"):
                if not torch.equal(getattr(trace, name), getattr(first, name)):
                    raise ValueError(f"FlowTrace.concat: trace {k} has other {name} than trace 0")
            if (
                trace.latents.shape[1:] != first.latents.shape[1:]
                or trace.latents.dtype != first.latents.dtype
            ):
                raise ValueError(
                    f"FlowTrace.concat: trace {k} has latents {tuple(trace.latents.shape)} "
                    f"{trace.latents.dtype}, trace 0 {tuple(first.latents.shape)} {first.latents.dtype}"
                )
            for name in ("cond", "uncond"):
                a, b = getattr(first, name), getattr(trace, name)
                if (a is None) != (b is None) or (a is not None and set(a) != set(b)):
                    raise ValueError(
                        f"FlowTrace.concat: trace {k} has other {name} keys than trace 0"
                    )
        groups, offset = [], 0
        for trace in traces:
            groups.append(trace.forward_groups + offset)
            offset = int(groups[-1].max()) + 1 if len(trace) else offset

        def cat_cond(name: str) -> Conditioning | None:
            if first.uncond is None and name == "uncond":
                return None
            return {
                key: torch.cat([getattr(t, name)[key] for t in traces])
                for key in getattr(first, name)
            }

        return replace(
            first,
            latents=torch.cat([t.latents for t in traces]),
            behaviour_logprobs=torch.cat([t.behaviour_logprobs for t in traces]),
            cond=cat_cond("cond"),
            uncond=cat_cond("uncond"),
            prompts=[p for t in traces for p in t.prompts],
            seeds=torch.cat([t.seeds for t in traces]),
            forward_groups=torch.cat(groups),
        )

    def group_rows(self) -> list[torch.Tensor]:
        """Row indices of each forward group, groups in order of first appearance."""
        order = dict.fromkeys(self.forward_groups.tolist())
        return [(self.forward_groups == g).nonzero().flatten() for g in order]

    def prepare(
        self,
        steps: Sequence[int],
        *,
        advantages: torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
    ) -> list[FlowStepBatch]:
        """The batches the learner scores: one :class:`FlowStepBatch` per (forward group, step),
        group-major; ``steps`` must be SDE steps. ``advantages`` / ``weights`` ``[B]`` are
        sliced into each batch."""
        sde = self.sde_steps.tolist()
        if len(set(steps)) != len(steps):
            raise ValueError(f"steps: expected distinct steps, got {list(steps)}")
        for k in steps:
            if not (0 <= k < self.num_steps and sde[k]):
                raise ValueError(
                    f"steps: step {k} is not an SDE step of this trace (SDE steps: "
                    f"{self.sde_step_indices()}); only SDE steps have a log-prob"
                )
        for name, value in (("advantages", advantages), ("weights", weights)):
            if value is not None and tuple(value.shape) != (len(self),):
                raise ValueError(f"{name}: expected [B={len(self)}], got {tuple(value.shape)}")
        batches = []
        for rows in self.group_rows():
            for k in steps:
                size = rows.shape[0]
                batches.append(
                    FlowStepBatch(
                        step=int(k),
                        rows=rows,
                        latents=self.latents[rows, k],
                        next_latents=self.latents[rows, k + 1],
                        sigma=self.sigmas[k].repeat(size),
                        sigma_next=self.sigmas[k + 1].repeat(size),
                        cond=_take(self.cond, rows),
                        uncond=_take(self.uncond, rows),
                        behaviour_logprobs=self.behaviour_logprobs[rows, k],
                        advantages=None if advantages is None else advantages[rows].float(),
                        weights=None if weights is None else weights[rows].float(),
                    )
                )
        return batches
