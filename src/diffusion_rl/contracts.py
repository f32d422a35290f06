"""Framework-neutral, validated contracts between samplers, scorers, losses and the trainer.

Every rule is checked at construction (and logits at every scoring call); a violation raises
``TypeError`` (wrong kind of thing) or ``ValueError`` (right kind, wrong value) with a message
that names the field, what was expected and what was found.

* :class:`DiffusionTokenBatch` — target-aligned token batch: ``logits[b, i]`` predicts
  ``target_ids[b, i]``; nothing downstream shifts.
* :func:`validate_diffusion_logits` — the scorer-boundary check on ``[B, L, V]`` logits.
* :class:`WeightedMetric` / :class:`LossOutput` — a loss is a *sum* and a *denominator*, so
  micro-batches normalise once by the global denominator (docs/math.md §2).
* :class:`DiffusionDistillationBatch` — a student batch plus the teacher's logits aligned to
  it slot for slot (docs/math.md §4).
* :class:`FlowStepBatch` — the flow world's training batch: the rows of one sampler forward
  group at one SDE step (docs/math.md §5).
* :class:`FlowForwardBatch` — the forward-process flow methods' batch: clean rollout samples
  noised again at drawn timesteps (docs/math.md §5.8).
* :class:`Extreme` — an aux metric reduced by max or min over micro-batches (a true extreme,
  not a mean of per-micro-batch extremes).

Every tensor a contract holds is *dense* (strided layout) and holds values (not on the meta
device): sparse, nested and meta tensors are refused with a ``TypeError`` naming the field.
Python numbers must fit a float (``10**400`` is refused, not an ``OverflowError``).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = [
    "Conditioning",
    "DiffusionDistillationBatch",
    "DiffusionTokenBatch",
    "Extreme",
    "FlowForwardBatch",
    "FlowStepBatch",
    "LossOutput",
    "WeightedMetric",
    "all_finite",
    "check_conditioning",
    "require_dense_tensor",
    "sum_is_finite",
    "validate_diffusion_logits",
    "validate_target_aligned_logits",
]

Conditioning = dict[str, torch.Tensor]
"""Prompt conditioning of a velocity model: named batch-first tensors ``[B, ...]``."""

_WEIGHT_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _is_integer_dtype(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool


def require_dense_tensor(name: str, value: Any) -> torch.Tensor:
    """``value`` if it is a dense tensor that holds values; else a ``TypeError`` naming ``name``.

    Refused: non-tensors, sparse / nested / other non-strided layouts (the kernels index them
    densely) and meta tensors (shape only, no values: every value check would be vacuous).
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if value.layout != torch.strided:
        raise TypeError(
            f"{name}: expected a dense (strided) tensor, got layout {value.layout}; "
            "convert it with .to_dense()"
        )
    if value.is_meta:
        raise TypeError(
            f"{name}: got a tensor on the meta device, which holds no values; "
            "materialise it on cpu or cuda first"
        )
    return value


def sum_is_finite(tensor: torch.Tensor) -> torch.Tensor:
    """Scalar bool tensor (no host sync): the sum of a floating ``tensor`` is finite.

    True implies every element is finite (a NaN or ±inf element makes any sum non-finite);
    False may also be an overflow of large finite values, so confirm with ``torch.isfinite``.
    One reduction, several times cheaper than ``torch.isfinite(tensor).all()`` on the CPU.
    """
    accumulate = torch.float64 if tensor.dtype == torch.float64 else torch.float32
    return torch.isfinite(torch.sum(tensor, dtype=accumulate))


def all_finite(tensor: torch.Tensor) -> bool:
    """Every element of a floating ``tensor`` is finite (fast path: :func:`sum_is_finite`)."""
    return bool(sum_is_finite(tensor)) or bool(torch.isfinite(tensor).all())


def _describe_number(value: int | float) -> str:
    if isinstance(value, int) and value.bit_length() > 64:
        return f"an int of {value.bit_length()} bits"
    return repr(value)


def _as_float(name: str, value: int | float) -> float:
    """A Python number as a float; ``ValueError`` naming ``name`` when it overflows."""
    try:
        return float(value)
    except OverflowError:
        raise ValueError(
            f"{name}: {_describe_number(value)} does not fit a float (max "
            f"{sys.float_info.max:.3g}); pass a finite value in float range"
        ) from None


def _check_tree(name: str, value: Any, path: tuple[int, ...] = ()) -> None:
    """``ValueError`` naming ``name`` if ``value`` (a container) contains itself."""
    if id(value) in path:
        raise ValueError(
            f"{name}: refers back to a container that encloses it (a self-referencing "
            "structure); model_inputs must be a tree of mappings with tensor leaves"
        )
    if isinstance(value, Mapping):
        children = value.values()
    elif isinstance(value, (list, tuple)):
        children = value
    else:
        return
    for k, child in enumerate(children):
        _check_tree(f"{name}[{k}]", child, (*path, id(value)))


def _iter_leaves(
    tree: Mapping[str, Any], prefix: str, path: tuple[int, ...] = ()
) -> Iterator[tuple[str, Any]]:
    """``(dotted name, leaf)`` of every non-mapping value; ``path``: ids of the enclosing
    mappings, so a mapping that contains itself is a ``ValueError``, not a RecursionError."""
    path = (*path, id(tree))
    for key, value in tree.items():
        if not isinstance(key, str):
            raise TypeError(f"{prefix}: keys must be str, got {type(key).__name__} {key!r}")
        name = f"{prefix}.{key}"
        if id(value) in path:
            raise ValueError(
                f"{name}: refers back to a mapping that encloses it (a self-referencing "
                "model_inputs); model_inputs must be a tree of mappings with tensor leaves"
            )
        if isinstance(value, Mapping):
            yield from _iter_leaves(value, name, path)
        else:
            yield name, value


def check_conditioning(name: str, cond: Any, rows: int, *, finite: bool = True) -> None:
    """A :data:`Conditioning`: a non-empty dict, str keys, dense batch-first tensors
    ``[rows, ...]``; with ``finite``, floating entries finite. Errors name ``name[key]``."""
    if not isinstance(cond, dict):
        raise TypeError(f"{name}: expected a dict of tensors, got {type(cond).__name__}")
    if not cond:
        raise ValueError(f"{name}: expected at least one tensor, got an empty dict")
    for key, value in cond.items():
        if not isinstance(key, str):
            raise TypeError(f"{name}: keys must be str, got {type(key).__name__} {key!r}")
        entry = f"{name}[{key!r}]"
        require_dense_tensor(entry, value)
        if value.dim() == 0 or value.shape[0] != rows:
            raise ValueError(
                f"{entry}: expected a batch-first tensor [B={rows}, ...], got {tuple(value.shape)}"
            )
        if finite and value.dtype.is_floating_point and not all_finite(value):
            raise ValueError(f"{entry}: expected finite values, got NaN/inf")


def _check_micro_batch_size(owner: str, value: Any) -> None:
    """``value`` is an int >= 1 (a bool or float is a ``TypeError`` naming the argument)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{owner}: micro_batch_size: expected an int >= 1 (rows per micro-batch), got "
            f"{type(value).__name__} {value!r}"
        )
    if value < 1:
        raise ValueError(f"{owner}: micro_batch_size: expected >= 1, got {value}")


def _map_leaves(tree: Mapping[str, Any], fn) -> dict[str, Any]:
    return {k: _map_leaves(v, fn) if isinstance(v, Mapping) else fn(v) for k, v in tree.items()}


def _as_plain_dict(tree: Mapping[str, Any]) -> dict[str, Any]:
    return _map_leaves(tree, lambda leaf: leaf)


@dataclass(frozen=True)
class DiffusionTokenBatch:
    """A target-aligned batch of token slots to score or train on.

    Fields (B rows, L target slots):

    * ``model_inputs``: mapping (nested mappings allowed, no cycles) of tensors, each
      batch-major (rank >= 1, leading dim B), at least one. Static settings (temperature,
      block size, ...) belong to the scorer, not here, so scalars are rejected.
    * ``target_ids``: int64 ``[B, L]`` (the kernels ``gather`` with them). Inactive slots may
      hold sentinel ids (e.g. -1); active ids are >= 0.
    * ``loss_weights``: ``[B, L]``, bool/int/float, finite and >= 0. A slot is *active* iff its
      weight != 0; fractional weights are allowed.

    Slicing, concatenation and device moves apply to every tensor leaf along dim 0. The class is
    registered as a PyTorch pytree (children: model_inputs, target_ids, loss_weights).
    """

    model_inputs: Mapping[str, Any]
    target_ids: torch.Tensor
    loss_weights: torch.Tensor

    def __post_init__(self) -> None:
        targets, weights = self.target_ids, self.loss_weights
        require_dense_tensor("DiffusionTokenBatch.target_ids", targets)
        if not _is_integer_dtype(targets.dtype):
            raise TypeError(
                f"DiffusionTokenBatch.target_ids: expected an integer dtype, got {targets.dtype}"
            )
        if targets.dtype != torch.int64:
            raise TypeError(
                f"DiffusionTokenBatch.target_ids: expected int64 (torch.long) ids, got "
                f"{targets.dtype}; the kernels gather with int64 indices: convert with .long()"
            )
        if targets.dim() != 2:
            raise ValueError(
                "DiffusionTokenBatch.target_ids: expected rank 2 [B, L], "
                f"got rank {targets.dim()} shape {tuple(targets.shape)}"
            )
        if targets.shape[0] == 0:
            raise ValueError(
                "DiffusionTokenBatch.target_ids: expected at least one row (B >= 1), got shape "
                f"{tuple(targets.shape)}; leave an empty batch out instead of passing it"
            )
        require_dense_tensor("DiffusionTokenBatch.loss_weights", weights)
        if not (weights.dtype.is_floating_point or weights.dtype in _WEIGHT_DTYPES):
            raise TypeError(
                "DiffusionTokenBatch.loss_weights: expected a bool, integer or floating dtype, "
                f"got {weights.dtype}"
            )
        if weights.shape != targets.shape:
            raise ValueError(
                "DiffusionTokenBatch.loss_weights: expected the shape of target_ids "
                f"{tuple(targets.shape)}, got {tuple(weights.shape)}"
            )
        # one float32 reduction: a finite sum means finite weights and a denominator (the
        # losses sum the weights) that does not overflow
        sum_finite = weights.dtype == torch.bool or bool(
            torch.isfinite(torch.sum(weights, dtype=torch.float32))
        )
        floating = weights.dtype.is_floating_point
        if not sum_finite and floating and not bool(torch.isfinite(weights).all()):
            raise ValueError(
                "DiffusionTokenBatch.loss_weights: expected finite values, got NaN/inf"
            )
        if not sum_finite:
            raise ValueError(
                "DiffusionTokenBatch.loss_weights: the weights sum to more than float32 holds "
                f"(max {torch.finfo(torch.float32).max:.3g}; largest weight "
                f"{weights.max().item():.3g}); scale them down (only their ratios matter)"
            )
        if weights.dtype != torch.bool and bool((weights < 0).any()):
            raise ValueError(
                "DiffusionTokenBatch.loss_weights: expected values >= 0, "
                f"got minimum {weights.min().item()}"
            )
        active = weights != 0
        if bool((targets[active] < 0).any()):
            raise ValueError(
                "DiffusionTokenBatch.target_ids: active slots (loss_weights != 0) need ids >= 0, "
                f"got minimum {targets[active].min().item()}; put sentinels only on inactive slots"
            )
        if not isinstance(self.model_inputs, Mapping):
            raise TypeError(
                "DiffusionTokenBatch.model_inputs: expected a mapping of tensors, "
                f"got {type(self.model_inputs).__name__}"
            )
        batch, tensors = targets.shape[0], 0
        for name, leaf in _iter_leaves(self.model_inputs, "DiffusionTokenBatch.model_inputs"):
            _check_tree(name, leaf)
            require_dense_tensor(name, leaf)
            tensors += 1
            if leaf.dim() == 0:
                raise ValueError(
                    f"{name}: expected a batch-major tensor (rank >= 1, leading dim {batch}), "
                    "got a scalar; static settings belong to the scorer"
                )
            if leaf.shape[0] != batch:
                raise ValueError(
                    f"{name}: expected leading dim B={batch} (from target_ids), got shape "
                    f"{tuple(leaf.shape)}"
                )
        if tensors == 0:
            raise ValueError(
                "DiffusionTokenBatch.model_inputs: expected at least one tensor, got none; the "
                "scorer reads the model's inputs from here (e.g. prompt_ids, completion_ids)"
            )
        object.__setattr__(self, "model_inputs", _as_plain_dict(self.model_inputs))

    # ----------------------------------------------------------------- views and moves
    @property
    def batch_size(self) -> int:
        return self.target_ids.shape[0]

    @property
    def active(self) -> torch.Tensor:
        """Bool ``[B, L]``: slots whose weight is non-zero."""
        return self.loss_weights != 0

    def _map(self, fn) -> DiffusionTokenBatch:
        return DiffusionTokenBatch(
            model_inputs=_map_leaves(self.model_inputs, fn),
            target_ids=fn(self.target_ids),
            loss_weights=fn(self.loss_weights),
        )

    def __getitem__(self, index: slice | torch.Tensor | Sequence[int]) -> DiffusionTokenBatch:
        """Rows along dim 0 (a slice, an index tensor or a bool mask)."""
        if isinstance(index, torch.Tensor) and index.dim() == 0:
            index = int(index)
        if not isinstance(index, (torch.Tensor, slice, Sequence)) and hasattr(index, "__index__"):
            row = int(index)
            if not -self.batch_size <= row < self.batch_size:
                raise IndexError(f"row {row} out of range for batch size {self.batch_size}")
            row %= self.batch_size
            index = slice(row, row + 1)
        return self._map(lambda t: t[index])

    def to(self, device: torch.device | str) -> DiffusionTokenBatch:
        return self._map(lambda t: t.to(device))

    def split(self, micro_batch_size: int) -> list[DiffusionTokenBatch]:
        _check_micro_batch_size("DiffusionTokenBatch.split", micro_batch_size)
        return [
            self[start : start + micro_batch_size]
            for start in range(0, self.batch_size, micro_batch_size)
        ]

    @staticmethod
    def concat(batches: Sequence[DiffusionTokenBatch]) -> DiffusionTokenBatch:
        """Concatenate along dim 0; structures must be equal."""
        if not batches:
            raise ValueError("DiffusionTokenBatch.concat: expected at least one batch, got none")
        leaves0, spec0 = pytree.tree_flatten(batches[0])
        columns = [[leaf] for leaf in leaves0]
        for k, batch in enumerate(batches[1:], start=1):
            leaves, spec = pytree.tree_flatten(batch)
            if spec != spec0:
                raise ValueError(
                    f"DiffusionTokenBatch.concat: batch {k} has structure {spec}, expected {spec0}"
                )
            for column, leaf in zip(columns, leaves):
                if leaf.shape[1:] != column[0].shape[1:]:
                    raise ValueError(
                        f"DiffusionTokenBatch.concat: batch {k} has a leaf of shape "
                        f"{tuple(leaf.shape)}, expected [*, {', '.join(map(str, column[0].shape[1:]))}]"
                    )
                column.append(leaf)
        return pytree.tree_unflatten([torch.cat(column, dim=0) for column in columns], spec0)


def _flatten(batch: DiffusionTokenBatch):
    return [batch.model_inputs, batch.target_ids, batch.loss_weights], None


def _unflatten(children, _context) -> DiffusionTokenBatch:
    model_inputs, target_ids, loss_weights = children
    if all(isinstance(t, torch.Tensor) for t in (target_ids, loss_weights)):
        return DiffusionTokenBatch(model_inputs, target_ids, loss_weights)
    # A tree_map to non-tensors (shapes, specs): keep the structure, skip tensor validation.
    batch = object.__new__(DiffusionTokenBatch)
    for name, value in zip(("model_inputs", "target_ids", "loss_weights"), children):
        object.__setattr__(batch, name, value)
    return batch


pytree.register_pytree_node(
    DiffusionTokenBatch,
    _flatten,
    _unflatten,
    serialized_type_name="diffusion_rl.contracts.DiffusionTokenBatch",
)


def validate_diffusion_logits(batch: DiffusionTokenBatch, logits: torch.Tensor) -> None:
    """Check target-aligned logits ``[B, L, V]`` against ``batch`` (called at every scoring)."""
    if not isinstance(batch, DiffusionTokenBatch):
        raise TypeError(
            f"batch: expected a DiffusionTokenBatch, got {type(batch).__name__}; build one with "
            "DiffusionTokenBatch(model_inputs, target_ids, loss_weights)"
        )
    validate_target_aligned_logits(batch.target_ids, batch.active, logits)


def validate_target_aligned_logits(
    target_ids: torch.Tensor, active: torch.Tensor, logits: torch.Tensor
) -> None:
    """Check logits ``[B, L, V]`` against ``target_ids [B, L]`` and the bool ``active [B, L]``
    slots (whose ids must be < V): what :func:`validate_diffusion_logits` checks, for a scorer
    that holds the targets of a slice of slots rather than a whole batch."""
    require_dense_tensor("logits", logits)
    if logits.dim() != 3:
        raise ValueError(
            f"logits: expected rank 3 [B, L, V], got rank {logits.dim()} shape {tuple(logits.shape)}"
        )
    if tuple(logits.shape[:2]) != tuple(target_ids.shape):
        raise ValueError(
            f"logits: expected [B, L] = {tuple(target_ids.shape)} (target_ids), "
            f"got {tuple(logits.shape[:2])}"
        )
    vocab = logits.shape[2]
    if vocab < 1:
        raise ValueError(f"logits: expected vocabulary size V >= 1, got {vocab}")
    if not logits.dtype.is_floating_point:
        raise TypeError(f"logits: expected a floating dtype, got {logits.dtype}")
    active_targets = target_ids[active]
    if active_targets.numel() and int(active_targets.max()) >= vocab:
        raise ValueError(
            f"target_ids: active ids must be < V={vocab} (logits vocabulary), "
            f"got maximum {int(active_targets.max())}"
        )


def _check_bound(name: str, value: float | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"WeightedMetric.{name}: expected a float or None, got {type(value).__name__}"
        )
    number = _as_float(f"WeightedMetric.{name}", value)
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"WeightedMetric.{name}: expected a finite value >= 0, got {value}")


@dataclass(frozen=True)
class WeightedMetric:
    """A weighted mean kept as ``sum / denominator`` so it can be reduced globally.

    ``value = sum / d'`` with ``d' = max(denominator + eps, min_denom)``, and 0 when ``d' == 0``
    (never NaN). ``sum`` may carry a graph; ``denominator`` is a constant, finite and >= 0.
    A Python number is converted to a tensor and must be finite; a *tensor* ``sum`` may be
    NaN/inf (a diverged micro-batch: the trainer detects it and skips the step).
    """

    sum: torch.Tensor
    denominator: torch.Tensor
    eps: float | None = None
    min_denom: float | None = None

    def __post_init__(self) -> None:
        for name in ("sum", "denominator"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (torch.Tensor, int, float)):
                raise TypeError(
                    f"WeightedMetric.{name}: expected a scalar tensor or number, got {type(value).__name__}"
                )
            if not isinstance(value, torch.Tensor):
                number = _as_float(f"WeightedMetric.{name}", value)
                if not math.isfinite(number):
                    raise ValueError(
                        f"WeightedMetric.{name}: expected a finite number, got {number}"
                    )
                object.__setattr__(self, name, torch.tensor(number))
                continue
            require_dense_tensor(f"WeightedMetric.{name}", value)
            if value.dtype == torch.bool or value.dtype.is_complex:
                raise TypeError(
                    f"WeightedMetric.{name}: expected a real (floating or integer) tensor, got "
                    f"{value.dtype}; convert it with .float()"
                )
            if value.numel() != 1:
                raise ValueError(
                    f"WeightedMetric.{name}: expected a scalar, got shape {tuple(value.shape)}"
                )
        denominator = self.denominator.detach()
        if not bool(torch.isfinite(denominator).all()) or bool((denominator < 0).any()):
            raise ValueError(
                f"WeightedMetric.denominator: expected a finite value >= 0, got {denominator.item()}"
            )
        _check_bound("eps", self.eps)
        _check_bound("min_denom", self.min_denom)

    @staticmethod
    def bound(
        denominator: torch.Tensor, eps: float | None, min_denom: float | None
    ) -> torch.Tensor:
        """The effective denominator ``max(d + eps, min_denom)``."""
        bounded = denominator + (eps or 0.0)
        if min_denom is not None:
            bounded = torch.clamp(bounded, min=min_denom)
        return bounded

    @property
    def value(self) -> torch.Tensor:
        bounded = self.bound(self.denominator, self.eps, self.min_denom)
        safe = torch.where(bounded > 0, bounded, torch.ones_like(bounded))
        return torch.where(bounded > 0, self.sum / safe, torch.zeros_like(self.sum))

    def detach(self) -> WeightedMetric:
        return WeightedMetric(
            self.sum.detach(), self.denominator.detach(), self.eps, self.min_denom
        )


@dataclass(frozen=True)
class Extreme:
    """A diagnostic reduced over micro-batches by ``kind`` (``"max"`` or ``"min"``).

    ``value``: a scalar tensor (dense) or a Python number that fits a float; NaN/inf are
    allowed (an extreme of a diverged micro-batch is still a diagnostic)."""

    value: torch.Tensor | float
    kind: str = "max"

    def __post_init__(self) -> None:
        if self.kind not in ("max", "min"):
            raise ValueError(f"Extreme.kind: expected 'max' or 'min', got {self.kind!r}")
        value = self.value
        if isinstance(value, bool) or not isinstance(value, (torch.Tensor, int, float)):
            raise TypeError(f"Extreme.value: expected a scalar, got {type(value).__name__}")
        if not isinstance(value, torch.Tensor):
            _as_float("Extreme.value", value)
            return
        require_dense_tensor("Extreme.value", value)
        if value.numel() != 1:
            raise ValueError(f"Extreme.value: expected a scalar, got shape {tuple(value.shape)}")


@dataclass(frozen=True)
class LossOutput:
    """What every objective returns: the differentiated weighted loss plus diagnostics.

    ``aux_metrics`` values are :class:`WeightedMetric` (reduced globally), :class:`Extreme`
    (reduced by max / min) or plain scalars (reduced by mean); one key must keep one kind
    across micro-batches.
    """

    primary: WeightedMetric
    aux_metrics: Mapping[str, WeightedMetric | torch.Tensor | float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.primary, WeightedMetric):
            raise TypeError(
                f"LossOutput.primary: expected a WeightedMetric, got {type(self.primary).__name__}"
            )
        if not isinstance(self.aux_metrics, Mapping):
            raise TypeError(
                f"LossOutput.aux_metrics: expected a mapping, got {type(self.aux_metrics).__name__}"
            )
        for key, value in self.aux_metrics.items():
            if not isinstance(key, str):
                raise TypeError(
                    f"LossOutput.aux_metrics: keys must be str (metric names), got "
                    f"{type(key).__name__} {key!r}"
                )
            if isinstance(value, (WeightedMetric, Extreme)):
                continue
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                require_dense_tensor(f"LossOutput.aux_metrics[{key!r}]", value)
                continue
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                _as_float(f"LossOutput.aux_metrics[{key!r}]", value)
                continue
            raise TypeError(
                f"LossOutput.aux_metrics[{key!r}]: expected a WeightedMetric, an Extreme or a scalar, "
                f"got {type(value).__name__}"
            )


@dataclass(frozen=True)
class DiffusionDistillationBatch:
    """A student batch and the teacher's logits at the very same states (docs/math.md §4).

    * ``student_batch``: a :class:`DiffusionTokenBatch` (B rows, L slots); its weights say
      which slots are trained.
    * ``teacher_logits``: floating ``[B, L, V]``, target-aligned with ``student_batch``:
      ``teacher_logits[b, i]`` is the teacher's prediction for slot ``i`` of row ``b`` in the
      state the student's logits for that slot come from. Values on inactive slots (weight 0)
      are never read: they may be anything, NaN and inf included.

    The student's logits must have the same vocabulary ``V``
    (:meth:`validate_student_logits`, called by the loss). Slicing, splitting, concatenation
    and device moves apply to both parts along dim 0; the class is a PyTorch pytree
    (children: student_batch, teacher_logits), so the trainer moves it like any batch.
    """

    student_batch: DiffusionTokenBatch
    teacher_logits: torch.Tensor

    def __post_init__(self) -> None:
        if not isinstance(self.student_batch, DiffusionTokenBatch):
            raise TypeError(
                "DiffusionDistillationBatch.student_batch: expected a DiffusionTokenBatch, "
                f"got {type(self.student_batch).__name__}"
            )
        logits = self.teacher_logits
        require_dense_tensor("DiffusionDistillationBatch.teacher_logits", logits)
        try:
            validate_diffusion_logits(self.student_batch, logits)
        except (TypeError, ValueError) as error:  # name the field: "logits: ..." → ours
            message = str(error)
            if message.startswith("logits:"):
                message = "teacher_" + message
            raise type(error)(f"DiffusionDistillationBatch.{message}") from None

    @property
    def batch_size(self) -> int:
        return self.student_batch.batch_size

    @property
    def vocab_size(self) -> int:
        return self.teacher_logits.shape[2]

    def validate_student_logits(self, logits: torch.Tensor) -> None:
        """Student logits must be ``[B, L, V]`` with the teacher's ``V`` (shared tokenizer)."""
        validate_diffusion_logits(self.student_batch, logits)
        if logits.shape[2] != self.vocab_size:
            raise ValueError(
                f"student logits: vocabulary size {logits.shape[2]} differs from the teacher's "
                f"{self.vocab_size}; student and teacher must share one tokenizer"
            )

    def __getitem__(self, index) -> DiffusionDistillationBatch:
        rows = self.student_batch[index]
        if isinstance(index, torch.Tensor) and index.dim() == 0:
            index = int(index)
        if not isinstance(index, (torch.Tensor, slice, Sequence)) and hasattr(index, "__index__"):
            row = int(index) % self.batch_size
            index = slice(row, row + 1)
        return DiffusionDistillationBatch(rows, self.teacher_logits[index])

    def to(self, device: torch.device | str) -> DiffusionDistillationBatch:
        return DiffusionDistillationBatch(
            self.student_batch.to(device), self.teacher_logits.to(device)
        )

    def split(self, micro_batch_size: int) -> list[DiffusionDistillationBatch]:
        _check_micro_batch_size("DiffusionDistillationBatch.split", micro_batch_size)
        return [
            self[start : start + micro_batch_size]
            for start in range(0, self.batch_size, micro_batch_size)
        ]

    @staticmethod
    def concat(batches: Sequence[DiffusionDistillationBatch]) -> DiffusionDistillationBatch:
        if not batches:
            raise ValueError(
                "DiffusionDistillationBatch.concat: expected at least one batch, got none"
            )
        vocab = {b.vocab_size for b in batches}
        if len(vocab) > 1:
            raise ValueError(
                f"DiffusionDistillationBatch.concat: teacher vocabularies differ: {sorted(vocab)}"
            )
        return DiffusionDistillationBatch(
            DiffusionTokenBatch.concat([b.student_batch for b in batches]),
            torch.cat([b.teacher_logits for b in batches], dim=0),
        )


def _flatten_distill(batch: DiffusionDistillationBatch):
    return [batch.student_batch, batch.teacher_logits], None


def _unflatten_distill(children, _context) -> DiffusionDistillationBatch:
    student_batch, teacher_logits = children
    if isinstance(student_batch, DiffusionTokenBatch) and isinstance(teacher_logits, torch.Tensor):
        return DiffusionDistillationBatch(student_batch, teacher_logits)
    batch = object.__new__(DiffusionDistillationBatch)  # non-tensor tree_map: keep the structure
    object.__setattr__(batch, "student_batch", student_batch)
    object.__setattr__(batch, "teacher_logits", teacher_logits)
    return batch


pytree.register_pytree_node(
    DiffusionDistillationBatch,
    _flatten_distill,
    _unflatten_distill,
    serialized_type_name="diffusion_rl.contracts.DiffusionDistillationBatch",
)


@dataclass(frozen=True)
class FlowStepBatch:
    """One replay forward of a flow trace: the rows of one sampler forward group at SDE step
    ``step`` (from :meth:`~diffusion_rl.trace.FlowTrace.prepare`).

    * ``latents`` / ``next_latents`` ``[b, *latent]``: ``trace.latents[rows, k]`` and
      ``[rows, k + 1]`` exactly as stored (the sampler's dtype)
    * ``sigma`` / ``sigma_next`` float32 ``[b]``; ``cond`` / ``uncond`` (None without CFG)
    * ``behaviour_logprobs`` float32 ``[b]``; ``rows`` long ``[b]`` (indices into the trace)
    * training inputs: ``advantages [b]`` and ``weights [b]`` (from the rollout), and, filled
      by the learner, ``old_logprobs [b]`` (start-of-step snapshot, μ > 1) and
      ``ref_means [b, *latent]`` (the reference's step means, β > 0)

    Checked at construction: kinds, dtypes (integer ``step`` / ``rows``, floating values) and
    shapes; values are not (a diverged model's NaN scores must reach the trainer's skip
    logic, and the trace the batch came from was checked already). Registered as a pytree,
    so the trainer moves every tensor to its device.
    """

    step: int
    rows: torch.Tensor
    latents: torch.Tensor
    next_latents: torch.Tensor
    sigma: torch.Tensor
    sigma_next: torch.Tensor
    cond: Conditioning
    uncond: Conditioning | None
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    ref_means: torch.Tensor | None = None

    def __post_init__(self) -> None:
        owner = "FlowStepBatch"
        step = self.step
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"{owner}.step: expected an int step index, got {type(step).__name__}")
        if step < 0:
            raise ValueError(f"{owner}.step: expected a step index >= 0, got {step}")
        rows = require_dense_tensor(f"{owner}.rows", self.rows)
        if rows.dtype != torch.int64:
            raise TypeError(f"{owner}.rows: expected int64 row indices, got {rows.dtype}")
        if rows.dim() != 1:
            raise ValueError(f"{owner}.rows: expected shape [b], got {tuple(rows.shape)}")
        size = rows.shape[0]
        latents = require_dense_tensor(f"{owner}.latents", self.latents)
        if not latents.dtype.is_floating_point:
            raise TypeError(f"{owner}.latents: expected a floating dtype, got {latents.dtype}")
        if latents.dim() < 1 or latents.shape[0] != size:
            raise ValueError(
                f"{owner}.latents: expected [b={size}, *latent] (b from FlowStepBatch.rows), got "
                f"{tuple(latents.shape)}"
            )
        for name in ("next_latents", "ref_means"):
            value = getattr(self, name)
            if value is None and name == "ref_means":
                continue
            require_dense_tensor(f"{owner}.{name}", value)
            if not value.dtype.is_floating_point:
                raise TypeError(f"{owner}.{name}: expected a floating dtype, got {value.dtype}")
            if value.shape != latents.shape:
                raise ValueError(
                    f"{owner}.{name}: expected the shape of latents {tuple(latents.shape)}, got "
                    f"{tuple(value.shape)}"
                )
        for name in ("sigma", "sigma_next", "behaviour_logprobs"):
            self._check_row_values(name, getattr(self, name), size)
        for name in ("advantages", "weights", "old_logprobs"):
            if getattr(self, name) is not None:
                self._check_row_values(name, getattr(self, name), size)
        check_conditioning(f"{owner}.cond", self.cond, size, finite=False)
        if self.uncond is not None:
            check_conditioning(f"{owner}.uncond", self.uncond, size, finite=False)

    @staticmethod
    def _check_row_values(name: str, value: Any, size: int) -> None:
        require_dense_tensor(f"FlowStepBatch.{name}", value)
        if not value.dtype.is_floating_point:
            raise TypeError(f"FlowStepBatch.{name}: expected a floating dtype, got {value.dtype}")
        if tuple(value.shape) != (size,):
            raise ValueError(
                f"FlowStepBatch.{name}: expected [b={size}] (b from FlowStepBatch.rows), got "
                f"{tuple(value.shape)}"
            )

    def __len__(self) -> int:
        return self.latents.shape[0]


pytree.register_dataclass(
    FlowStepBatch, serialized_type_name="diffusion_rl.contracts.FlowStepBatch"
)


@dataclass(frozen=True)
class FlowForwardBatch:
    """The training batch of the forward-process flow methods (DiffusionNFT, AWM, DGPO):
    clean rollout samples noised again by the forward process, ``x_σ = (1 − σ) x0 + σ ε``
    (docs/math.md §5.8). One *item* is one (row, timestep slot) pair; a row contributes
    ``K`` items, one per slot.

    * ``rows`` / ``groups`` / ``slots`` long ``[b]``: the trace row of each item, its prompt
      group and its timestep slot (0 … K − 1)
    * ``x0`` float32 ``[b, *latent]``: the row's final (σ = 0) rollout latent
    * ``noise`` float32 ``[b, *latent]`` (ε), ``sigma`` float32 ``[b]``, ``noisy`` float32
      ``[b, *latent]`` (``x_σ``, formed once so that every role sees the same tensor)
    * ``cond``: the row's conditioning (no unconditional half: these methods train the
      conditional velocity, guidance-free)
    * ``advantages`` / ``weights`` ``[b]`` (the row's, repeated per slot), and, filled by the
      learner, ``old_velocity`` (the old policy's velocity at the same input: the rollout
      weights), ``snapshot_velocity`` (the start-of-step snapshot's, μ > 1) and
      ``ref_velocity`` (the reference's), float32 ``[b, *latent]``

    Checked at construction: kinds, dtypes and shapes (values are not: a diverged model's NaN
    scores must reach the trainer's skip logic). Registered as a pytree.
    """

    rows: torch.Tensor
    groups: torch.Tensor
    slots: torch.Tensor
    x0: torch.Tensor
    noise: torch.Tensor
    sigma: torch.Tensor
    noisy: torch.Tensor
    cond: Conditioning
    advantages: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    old_velocity: torch.Tensor | None = None
    snapshot_velocity: torch.Tensor | None = None
    ref_velocity: torch.Tensor | None = None

    def __post_init__(self) -> None:
        owner = "FlowForwardBatch"
        size = None
        for name in ("rows", "groups", "slots"):
            value = require_dense_tensor(f"{owner}.{name}", getattr(self, name))
            if value.dtype != torch.int64 or value.dim() != 1:
                raise TypeError(
                    f"{owner}.{name}: expected int64 [b], got {value.dtype} {tuple(value.shape)}"
                )
            if size is not None and value.shape[0] != size:
                raise ValueError(f"{owner}.{name}: expected [b={size}], got {tuple(value.shape)}")
            size = value.shape[0]
        x0 = require_dense_tensor(f"{owner}.x0", self.x0)
        if x0.dtype != torch.float32 or x0.dim() < 2 or x0.shape[0] != size:
            raise ValueError(
                f"{owner}.x0: expected float32 [b={size}, *latent], got {x0.dtype} "
                f"{tuple(x0.shape)}"
            )
        for name in ("noise", "noisy", "old_velocity", "snapshot_velocity", "ref_velocity"):
            value = getattr(self, name)
            if value is None and name not in ("noise", "noisy"):
                continue
            require_dense_tensor(f"{owner}.{name}", value)
            if not value.dtype.is_floating_point or value.shape != x0.shape:
                raise ValueError(
                    f"{owner}.{name}: expected a floating tensor of the shape of x0 "
                    f"{tuple(x0.shape)}, got {value.dtype} {tuple(value.shape)}"
                )
        for name in ("sigma", "advantages", "weights"):
            value = getattr(self, name)
            if value is None and name != "sigma":
                continue
            require_dense_tensor(f"{owner}.{name}", value)
            if not value.dtype.is_floating_point or tuple(value.shape) != (size,):
                raise ValueError(
                    f"{owner}.{name}: expected a floating tensor [b={size}] (b from "
                    f"{owner}.rows), got {value.dtype} {tuple(value.shape)}"
                )
        check_conditioning(f"{owner}.cond", self.cond, size, finite=False)

    def __len__(self) -> int:
        return self.x0.shape[0]


pytree.register_dataclass(
    FlowForwardBatch, serialized_type_name="diffusion_rl.contracts.FlowForwardBatch"
)
