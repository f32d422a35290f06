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

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .contracts import (
    Conditioning,
    DiffusionTokenBatch,
    FlowStepBatch,
    check_conditioning,
    require_dense_tensor,
    sum_is_finite,
)
from .models.protocol import BLOCK_ORIGINS, completion_blocks, completion_offsets

INT64_MAX = 2**63 - 1
SIGMA_START_TOLERANCE = 1e-5
"""``sigmas[0]`` may sit this far below 1 (the SD3 grid's σ_max is 1 only up to float32
rounding, sampling/flow.py ``flow_sigmas``)."""


class StaleTraceError(ValueError):
    """A trace sampled with weights other than the ones the learner is about to update (or a
    scorer was told to expect). Defined here, below both, so the learner
    (``train/roles.py`` re-exports it) and the scorers (``scoring/``) raise one type."""


class StageMismatchError(StaleTraceError):
    """A trace handed to a stage (or a stage's scorer) it was not sampled by: a workflow's
    traces mixed up."""


# ---------------------------------------------------------------------------------------------
# Field validation shared by both traces. Kinds, dtypes and shapes are checked one field at a
# time (attribute reads, no device work); value rules are collected as bool masks and reduced
# with one host sync per device, so validating costs a few vectorised passes over the trace.
# ---------------------------------------------------------------------------------------------


def _tensor(
    name: str, value: Any, dtypes: tuple[torch.dtype, ...], what: str, fix: str = ""
) -> torch.Tensor:
    """A dense tensor of one of ``dtypes`` (``TypeError`` naming ``name`` otherwise)."""
    require_dense_tensor(name, value)
    if value.dtype not in dtypes:
        hint = f"; {fix}" if fix else ""
        raise TypeError(f"{name}: expected {what}, got {value.dtype}{hint}")
    return value


def _floating(name: str, value: Any) -> torch.Tensor:
    require_dense_tensor(name, value)
    if not value.dtype.is_floating_point:
        raise TypeError(f"{name}: expected a floating dtype, got {value.dtype}")
    return value


def _shape(name: str, value: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
    if tuple(value.shape) != expected:
        raise ValueError(f"{name}: expected shape {what} = {expected}, got {tuple(value.shape)}")


def _rank(name: str, value: torch.Tensor, rank: int, what: str) -> None:
    if value.dim() != rank:
        raise ValueError(
            f"{name}: expected rank {rank} {what}, got rank {value.dim()} shape "
            f"{tuple(value.shape)}"
        )


def _same_device(owner: str, fields: dict[str, torch.Tensor]) -> None:
    (first, reference), *rest = fields.items()
    for name, value in rest:
        if value.device != reference.device:
            raise ValueError(
                f"{owner}.{name}: on {value.device}, but {first} is on {reference.device}; the "
                f"trace's tensors ({', '.join(fields)}) share one device: move them together"
            )


def _shown(value: Any) -> str:
    """``repr(value)``, short for huge ints."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"an int of {value.bit_length()} bits"
    return repr(value)


def _int(name: str, value: Any, *, low: int = 0, high: int = INT64_MAX, what: str) -> int:
    """A Python int (not bool) in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int ({what}), got {type(value).__name__} {value!r}")
    if not low <= value <= high:
        top = "2^63 - 1" if high == INT64_MAX else high
        raise ValueError(f"{name}: expected {what} in [{low}, {top}], got {_shown(value)}")
    return value


def _number(name: str, value: Any, *, what: str) -> float:
    """A finite Python number >= 0 (int or float, not bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a number ({what}), got {type(value).__name__}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not (math.isfinite(number) and number >= 0):
        raise ValueError(f"{name}: expected a finite {what} >= 0, got {_shown(value)}")
    return number


def _str_dict(name: str, value: Any, *, str_values: bool = False) -> dict:
    if not isinstance(value, dict):
        raise TypeError(f"{name}: expected a dict, got {type(value).__name__}")
    for key, item in value.items():
        if not isinstance(key, str):
            raise TypeError(f"{name}: keys must be str, got {type(key).__name__} {key!r}")
        if str_values and not isinstance(item, str):
            raise TypeError(f"{name}[{key!r}]: expected a str, got {type(item).__name__}")
    return value


def _refuse_no_rows(owner: str, rows: int) -> None:
    """A trace of no rows (``rows([])``, a part for ``concat``) is valid but cannot be
    prepared for scoring: there is nothing to replay."""
    if rows == 0:
        raise ValueError(
            f"{owner}.prepare: the trace has no rows (B = 0), so there is nothing to score; "
            "leave empty traces out (or concat them with others) before preparing"
        )


def _require_key(name: str, settings: dict, key: str, why: str) -> Any:
    if key not in settings:
        raise ValueError(f"{name}: missing key {key!r} ({why})")
    return settings[key]


@dataclass(frozen=True)
class _Rule:
    """A value rule: ``bad`` marks violating elements of ``values`` (same shape), or builds
    that mask when called; ``suspect`` (scalar bool, default ``bad.any()``) says whether to
    look; ``axes`` name the leading dims in the message; ``rule`` is the text, or a function
    of the first violating position giving it."""

    name: str
    bad: torch.Tensor | Callable[[], torch.Tensor]
    values: torch.Tensor
    rule: str | Callable[[list[int]], str]
    fix: str
    axes: tuple[str, ...]
    suspect: torch.Tensor | None = None

    def flag(self) -> torch.Tensor:
        return self.suspect if self.suspect is not None else self.bad.any()

    def mask(self) -> torch.Tensor:
        return self.bad() if callable(self.bad) else self.bad


def _enforce(rules: list[_Rule]) -> None:
    """Raise a ``ValueError`` for the first rule with a violation, naming the field, the
    first violating value and its position. One host sync per device in the good case."""
    by_device: dict[torch.device, list[int]] = {}
    for k, rule in enumerate(rules):
        by_device.setdefault(rule.values.device, []).append(k)
    suspects = []
    for indices in by_device.values():
        flags = torch.stack([rules[k].flag() for k in indices]).tolist()
        suspects += [k for k, flag in zip(indices, flags) if flag]
    for k in sorted(suspects):
        bad = rules[k].mask()
        if bool(bad.any()):  # a suspect may be clean (a finite sum that overflowed)
            _report(rules[k], bad)


def _report(rule: _Rule, bad: torch.Tensor) -> None:
    at = bad.nonzero()[0].tolist()
    value = rule.values[tuple(at)].item()
    shown = f"{value:.6g}" if isinstance(value, float) else str(value)
    parts = [f"{axis} {i}" for axis, i in zip(rule.axes, at)]
    if rule.axes and len(at) > len(rule.axes):
        parts.append(f"element {tuple(at[len(rule.axes) :])}")
    where = f" at {', '.join(parts)}" if parts else ""
    count = int(bad.sum())
    more = f" ({count} such values)" if count > 1 else ""
    text = rule.rule if isinstance(rule.rule, str) else rule.rule(at)
    raise ValueError(f"{rule.name}: {text}, found {shown}{where}{more}; {rule.fix}")


def _not_finite(name: str, values: torch.Tensor, axes: tuple[str, ...], fix: str) -> _Rule:
    """Finiteness, checked by one sum; the element mask is built only if the sum is not."""
    return _Rule(
        name,
        lambda: ~torch.isfinite(values),
        values,
        "must be finite",
        fix,
        axes,
        suspect=~sum_is_finite(values),
    )


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

    Validated at construction (errors name the field, e.g. ``TokenTrace.commit_steps``):
    ``prompt_ids`` int64/int32 and ``tokens`` int64 ids >= 0 (< ``model_info["vocab_size"]``
    when known; sampled slots never the mask id); ``commit_steps`` int64, -1 or a step id of
    the slot's block (``[block · stride, (block + 1) · stride)`` when the sampler settings give
    ``block_size``, ``steps_per_block`` and ``schedule``); ``behaviour_logprobs`` finite, <= 0,
    exactly 0 on unsampled slots; ``sampler["temperature"]`` a finite number >= 0 (and
    ``generation_length`` = L when present); ``kernel_ids`` str → str with
    ``"token_logprobs"``; ``weights_version`` an int in [0, 2^63); ``stop_token_id`` None or an
    id; the five ``[B, ·]`` tensors on one device (``seeds`` may live on the CPU).
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

    def __post_init__(self) -> None:
        owner = "TokenTrace"
        ids = (torch.int64, torch.int32)
        prompt = _tensor(f"{owner}.prompt_ids", self.prompt_ids, ids, "int64 (or int32) ids")
        _rank(f"{owner}.prompt_ids", prompt, 2, "[B, P]")
        batch = prompt.shape[0]
        mask = _tensor(
            f"{owner}.prompt_mask", self.prompt_mask, (torch.bool,), "bool", "use mask.bool()"
        )
        _shape(f"{owner}.prompt_mask", mask, tuple(prompt.shape), f"[B, P] of {owner}.prompt_ids")
        long = (torch.int64,)
        tokens = _tensor(f"{owner}.tokens", self.tokens, long, "int64 ids", "use .long()")
        _rank(f"{owner}.tokens", tokens, 2, "[B, L]")
        if tokens.shape[0] != batch:
            raise ValueError(
                f"{owner}.tokens: expected B={batch} rows (from {owner}.prompt_ids), got shape "
                f"{tuple(tokens.shape)}"
            )
        length = tokens.shape[1]
        steps = _tensor(f"{owner}.commit_steps", self.commit_steps, long, "int64 step ids")
        _shape(f"{owner}.commit_steps", steps, (batch, length), f"[B, L] of {owner}.tokens")
        logprobs = _tensor(
            f"{owner}.behaviour_logprobs", self.behaviour_logprobs, (torch.float32,), "float32"
        )
        _shape(
            f"{owner}.behaviour_logprobs", logprobs, (batch, length), f"[B, L] of {owner}.tokens"
        )
        seeds = _tensor(f"{owner}.seeds", self.seeds, long, "int64 seeds (one per row)")
        _shape(f"{owner}.seeds", seeds, (batch,), f"[B] (B from {owner}.prompt_ids)")
        _same_device(
            owner,
            {
                "prompt_ids": prompt,
                "prompt_mask": mask,
                "tokens": tokens,
                "commit_steps": steps,
                "behaviour_logprobs": logprobs,
            },
        )

        sampler = _str_dict(f"{owner}.sampler", self.sampler)
        _number(
            f"{owner}.sampler['temperature']",
            _require_key(f"{owner}.sampler", sampler, "temperature", "replay scores at it"),
            what="temperature",
        )
        if "generation_length" in sampler and sampler["generation_length"] != length:
            raise ValueError(
                f"{owner}.tokens: expected L = sampler['generation_length'] = "
                f"{sampler['generation_length']!r} slots, got {length}"
            )
        kernels = _str_dict(f"{owner}.kernel_ids", self.kernel_ids, str_values=True)
        _require_key(f"{owner}.kernel_ids", kernels, "token_logprobs", "replay pins this kernel")
        _int(f"{owner}.weights_version", self.weights_version, what="a weights version")
        info = _str_dict(f"{owner}.model_info", self.model_info)
        vocab = info.get("vocab_size")
        if vocab is not None:
            vocab = _int(f"{owner}.model_info['vocab_size']", vocab, low=1, what="a vocab size")
        id_high = INT64_MAX if vocab is None else vocab - 1
        mask_id = info.get("mask_token_id")
        if mask_id is not None:
            _int(f"{owner}.model_info['mask_token_id']", mask_id, high=id_high, what="a token id")
        if self.stop_token_id is not None:
            _int(f"{owner}.stop_token_id", self.stop_token_id, high=id_high, what="a token id")

        sampled = steps >= 0
        row_slot = ("row", "slot")
        rules = [
            _Rule(
                f"{owner}.prompt_ids",
                prompt < 0,
                prompt,
                "token ids must be >= 0",
                "left-pad with a real id (e.g. the pad id) and mark padding False in prompt_mask",
                row_slot,
            ),
            _Rule(
                f"{owner}.tokens",
                tokens < 0,
                tokens,
                "token ids must be >= 0",
                "unsampled slots hold the stop (or mask) id, never a negative sentinel",
                row_slot,
            ),
            _Rule(
                f"{owner}.commit_steps",
                steps < -1,
                steps,
                "must be a step id >= 0 or -1 (never sampled)",
                "record the step id at which the slot was committed",
                row_slot,
            ),
            _not_finite(
                f"{owner}.behaviour_logprobs",
                logprobs,
                row_slot,
                "record log softmax(z / T)[x] of the logits the sample was drawn from",
            ),
            _Rule(
                f"{owner}.behaviour_logprobs",
                logprobs > 0,
                logprobs,
                "must be <= 0 (log-probabilities)",
                "record log softmax(z / T)[x] of the logits the sample was drawn from",
                row_slot,
            ),
            _Rule(
                f"{owner}.behaviour_logprobs",
                ~sampled & (logprobs != 0),
                logprobs,
                "must be 0 on unsampled slots (commit_steps -1)",
                "unsampled slots are not actions: store 0 there",
                row_slot,
            ),
        ]
        if vocab is not None:
            for name, value in (("prompt_ids", prompt), ("tokens", tokens)):
                rules.append(
                    _Rule(
                        f"{owner}.{name}",
                        value >= vocab,
                        value,
                        f"token ids must be < vocab_size={vocab} (model_info)",
                        "ids come from the model's tokenizer",
                        row_slot,
                    )
                )
        if mask_id is not None:
            rules.append(
                _Rule(
                    f"{owner}.tokens",
                    sampled & (tokens == mask_id),
                    tokens,
                    f"a sampled slot holds the mask id {mask_id} (model_info['mask_token_id'])",
                    "the sampler never proposes MASK: a sampled slot holds a real token",
                    row_slot,
                )
            )
        origin = info.get("block_origin", "prompt")
        if origin not in BLOCK_ORIGINS:
            raise ValueError(
                f"{owner}.model_info['block_origin']: expected one of {list(BLOCK_ORIGINS)}, "
                f"got {origin!r}"
            )
        window = self._step_window(
            sampler, length, steps.device, mask if origin == "canvas" else None
        )
        if window is not None:
            low, high, stride = window
            size = sampler["block_size"]

            def in_block(at: list[int]) -> str:
                block = int(low.expand(steps.shape)[at[0], at[1]]) // stride
                return (
                    f"slot {at[1]} lies in block {block} (block_size {size}, block_origin "
                    f"{origin!r}), so its step id must be in [{block * stride}, "
                    f"{(block + 1) * stride}) (step_stride {stride})"
                )

            rules.append(
                _Rule(
                    f"{owner}.commit_steps",
                    sampled & ((steps < low) | (steps >= high)),
                    steps,
                    in_block,
                    "step ids are block * step_stride + step_in_block, or -1 if never sampled",
                    row_slot,
                )
            )
        _enforce(rules)

    @staticmethod
    def _step_window(
        sampler: dict, length: int, device: torch.device, canvas_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """Per-slot ``[low, high)`` step ids ``[1 or B, L]`` and the stride, when the sampler
        settings say how steps are numbered (``sampling/token.py``: ``block * step_stride +
        step``, with ``block`` the slot's completion block: ``k // block_size``, or
        ``(r_b + k) // block_size`` for a ``"canvas"`` model, ``canvas_mask`` = the prompt
        mask; models/protocol.py)."""
        size, per_block = sampler.get("block_size"), sampler.get("steps_per_block")
        schedule = sampler.get("schedule")
        for key, value in (("block_size", size), ("steps_per_block", per_block)):
            if value is not None:
                _int(f"TokenTrace.sampler[{key!r}]", value, low=1, what="a count")
        if schedule is not None and schedule not in ("fixed", "threshold"):
            raise ValueError(
                f"TokenTrace.sampler['schedule']: expected 'fixed' or 'threshold', got {schedule!r}"
            )
        if size is None or per_block is None or schedule is None:
            return None
        stride = per_block if schedule == "fixed" else size
        if canvas_mask is None:
            block = (torch.arange(length, device=device) // size)[None, :]
        else:
            block = completion_blocks(completion_offsets(canvas_mask, size, "canvas"), length, size)
        return block * stride, (block + 1) * stride, stride

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
        _refuse_no_rows("TokenTrace", len(self))
        if isinstance(post_stop_weight, bool) or not isinstance(post_stop_weight, (int, float)):
            raise TypeError(
                f"post_stop_weight: expected a number >= 0, got {type(post_stop_weight).__name__}"
            )
        if not (math.isfinite(post_stop_weight) and post_stop_weight >= 0):
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


def _take(cond: Conditioning | None, index) -> Conditioning | None:
    return None if cond is None else {k: v[index] for k, v in cond.items()}


@dataclass(frozen=True)
class FlowTrace:
    """A captured flow-matching rollout: B rows, N steps from σ = 1 to σ = 0.

    * ``latents`` ``[B, N + 1, *latent_shape]``: ``latents[:, k]`` is *exactly* the tensor the
      sampler fed the model at step k and continued from (its dtype: with a bf16 latent dtype
      the rounded tensor: docs/pitfalls.md, "Stored latent is not the latent continued
      from"); ``latents[:, N]`` is the final sample
    * ``sigmas`` float32 ``[N + 1]``: the schedule, ``sigmas[0] = 1`` (within 1e-5),
      ``sigmas[N] = 0``
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
      ``latent_dtype``, ``group_size``); ``kernel_ids`` op → id; ``weights_version``;
      ``stage``: the workflow stage that sampled it (``""`` outside workflows)

    Validated at construction (errors name the field, e.g. ``FlowTrace.sigmas``): ``latents``
    floating and finite; ``sigmas`` finite, strictly decreasing, from 1 (within 1e-5) to
    exactly 0; ``sde_steps`` False at the last step; ``behaviour_logprobs`` finite (a density:
    it may be > 0) and exactly 0 on ODE steps; ``cond`` / ``uncond`` dense ``[B, ...]``
    tensors, finite; ``prompts`` B strings; ``forward_groups`` >= 0; the sampler's
    ``num_steps``, ``latent_shape`` and ``latent_dtype`` (when present) match the tensors;
    ``kernel_ids`` str → str with ``flow_ode_step`` (and ``flow_sde_step`` when a step is
    SDE); ``weights_version`` an int in [0, 2^63); ``stage`` a str; ``latents``,
    ``behaviour_logprobs`` and the conditioning on one device (``sigmas``, ``sde_steps``,
    ``seeds``, ``forward_groups`` may stay on the CPU).
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
    stage: str = ""

    def __post_init__(self) -> None:
        owner = "FlowTrace"
        latents = _floating(f"{owner}.latents", self.latents)
        sigmas = _tensor(f"{owner}.sigmas", self.sigmas, (torch.float32,), "float32")
        _rank(f"{owner}.sigmas", sigmas, 1, "[N+1]")
        steps = sigmas.shape[0] - 1
        if steps < 1:
            raise ValueError(
                f"{owner}.sigmas: expected N+1 >= 2 entries (at least one step), got "
                f"{tuple(sigmas.shape)}"
            )
        if latents.dim() < 3 or latents.shape[1] != steps + 1:
            raise ValueError(
                f"{owner}.latents: expected [B, N+1={steps + 1}, *latent_shape] ({owner}.sigmas "
                f"has N+1 entries), got {tuple(latents.shape)}"
            )
        rows = latents.shape[0]
        sde = _tensor(f"{owner}.sde_steps", self.sde_steps, (torch.bool,), "bool")
        _shape(f"{owner}.sde_steps", sde, (steps,), f"[N] (N + 1 entries in {owner}.sigmas)")
        logprobs = _tensor(
            f"{owner}.behaviour_logprobs", self.behaviour_logprobs, (torch.float32,), "float32"
        )
        _shape(
            f"{owner}.behaviour_logprobs",
            logprobs,
            (rows, steps),
            f"[B, N] (B from {owner}.latents, N from {owner}.sigmas)",
        )
        for name in ("seeds", "forward_groups"):
            value = _tensor(f"{owner}.{name}", getattr(self, name), (torch.int64,), "int64")
            _shape(f"{owner}.{name}", value, (rows,), f"[B] (B from {owner}.latents)")
        prompts = self.prompts
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(
                f"{owner}.prompts: expected a list of str, got {type(prompts).__name__}"
            )
        if len(prompts) != rows:
            raise ValueError(
                f"{owner}.prompts: expected B={rows} prompts (B from {owner}.latents), got "
                f"{len(prompts)}"
            )
        for k, prompt in enumerate(prompts):
            if not isinstance(prompt, str):
                raise TypeError(
                    f"{owner}.prompts[{k}]: expected a str, got {type(prompt).__name__}"
                )
        check_conditioning(f"{owner}.cond", self.cond, rows)
        if self.uncond is not None:
            check_conditioning(f"{owner}.uncond", self.uncond, rows)
        on_device = {"latents": latents, "behaviour_logprobs": logprobs}
        for name in ("cond", "uncond"):
            for key, value in (getattr(self, name) or {}).items():
                on_device[f"{name}[{key!r}]"] = value
        _same_device(owner, on_device)

        sampler = _str_dict(f"{owner}.sampler", self.sampler)
        guidance = _number(
            f"{owner}.sampler['guidance_scale']",
            _require_key(f"{owner}.sampler", sampler, "guidance_scale", "replay guides with it"),
            what="guidance scale",
        )
        if (self.uncond is None) != (guidance == 1.0):
            raise ValueError(
                f"{owner}.uncond: guidance_scale={guidance} needs an unconditional "
                "conditioning exactly when it is not 1"
            )
        self._check_settings(sampler, steps, latents)
        kernels = _str_dict(f"{owner}.kernel_ids", self.kernel_ids, str_values=True)
        _require_key(f"{owner}.kernel_ids", kernels, "flow_ode_step", "every trace has ODE steps")
        if bool(sde.any()):
            _require_key(f"{owner}.kernel_ids", kernels, "flow_sde_step", "it has SDE steps")
        _int(f"{owner}.weights_version", self.weights_version, what="a weights version")
        _str_dict(f"{owner}.model_info", self.model_info)
        if not isinstance(self.stage, str):
            raise TypeError(
                f"{owner}.stage: expected the name of the workflow stage that sampled it (a str, "
                f"'' outside workflows), got {type(self.stage).__name__}"
            )

        sigma_fix = "the schedule runs from 1 down to 0 (sampling/flow.py flow_sigmas)"
        rules = [
            _not_finite(
                f"{owner}.latents",
                latents,
                ("row", "step"),
                "store the latents the sampler continued from (a diverged sample is no rollout)",
            ),
            _not_finite(f"{owner}.sigmas", sigmas, ("entry",), sigma_fix),
            _Rule(
                f"{owner}.sigmas",
                torch.cat(
                    [
                        torch.zeros(1, dtype=torch.bool, device=sigmas.device),
                        sigmas[1:] >= sigmas[:-1],
                    ]
                ),
                sigmas,
                "must be strictly decreasing (each entry below the one before it)",
                sigma_fix,
                ("entry",),
            ),
            _Rule(
                f"{owner}.sigmas",
                (sigmas[:1] < 1 - SIGMA_START_TOLERANCE) | (sigmas[:1] > 1),
                sigmas[:1],
                f"must start at 1 (within {SIGMA_START_TOLERANCE}: entry 0)",
                sigma_fix,
                (),
            ),
            _Rule(
                f"{owner}.sigmas",
                sigmas[-1:] != 0,
                sigmas[-1:],
                f"must end at exactly 0 (entry {steps})",
                sigma_fix,
                (),
            ),
            _Rule(
                f"{owner}.sde_steps",
                sde[-1:],
                sde[-1:],
                "the last step (to sigma = 0) must be an ODE step (False)",
                "the SDE window ends at num_steps - 1 at most",
                (),
            ),
            _not_finite(
                f"{owner}.behaviour_logprobs",
                logprobs,
                ("row", "step"),
                "record log p(latents[k+1] | latents[k]) of the SDE step taken",
            ),
            _Rule(
                f"{owner}.behaviour_logprobs",
                ~sde.to(logprobs.device)[None, :] & (logprobs != 0),
                logprobs,
                "must be 0 on ODE steps (sde_steps False)",
                "only SDE steps have a log-prob: store 0 on the others",
                ("row", "step"),
            ),
            _Rule(
                f"{owner}.forward_groups",
                self.forward_groups < 0,
                self.forward_groups,
                "group ids must be >= 0",
                "number the sampler's forward groups 0, 1, ...",
                ("row",),
            ),
        ]
        _enforce(rules)

    @staticmethod
    def _check_settings(sampler: dict, steps: int, latents: torch.Tensor) -> None:
        """The sampler dump, where it states them, agrees with the tensors."""
        owner = "FlowTrace"
        if "num_steps" in sampler and sampler["num_steps"] != steps:
            raise ValueError(
                f"{owner}.sigmas: N = {steps} steps, but sampler['num_steps'] = "
                f"{sampler['num_steps']!r}; a trace keeps its sampler's schedule"
            )
        shape = sampler.get("latent_shape")
        if shape is not None and (
            not isinstance(shape, (list, tuple)) or list(shape) != list(latents.shape[2:])
        ):
            raise ValueError(
                f"{owner}.latents: latent shape {tuple(latents.shape[2:])}, but "
                f"sampler['latent_shape'] = {shape!r}"
            )
        dtype = sampler.get("latent_dtype")
        if dtype is not None and str(latents.dtype) != f"torch.{dtype}":
            raise TypeError(
                f"{owner}.latents: dtype {latents.dtype}, but sampler['latent_dtype'] = "
                f"{dtype!r}; store the latents in the dtype the sampler kept them in"
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
            for name in ("sampler", "kernel_ids", "weights_version", "model_info", "stage"):
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
        _refuse_no_rows("FlowTrace", len(self))
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
