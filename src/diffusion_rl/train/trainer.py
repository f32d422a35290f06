"""The one trainer every method reuses: weighted gradient accumulation, AdamW, LR schedule,
safe skipping of degenerate steps, and exact checkpoint/resume.

A step over micro-batches k (docs/math.md §2): ``loss_fn`` returns ``LossOutput`` with
``primary = WeightedMetric(S_k, d_k)``; the trainer back-propagates each ``S_k`` (never the
per-micro-batch mean), then divides the accumulated gradient once by
``bound(Σd_k, eps, min_denom)``. That is the gradient of the global weighted mean over the
whole batch, however it is split.

Invariants of :meth:`Trainer.train_step`:

* total bound 0 (no weight anywhere) -> no optimizer or scheduler step; parameters and
  optimizer state are unchanged; ``skipped_zero_weight`` counts it.
* a non-finite loss or gradient in any micro-batch -> gradients dropped, no optimizer or
  scheduler step; ``skipped_nonfinite`` counts it.
* ``global_step`` advances on every call, applied or not.
* optimizer state keeps its dtypes (bf16 parameters -> bf16 Adam moments), across skipped
  steps and resumes.

A model carrying a LoRA adapter trains only its adapter (the parameters with
``requires_grad``); its checkpoints hold the adapter and the optimizer state
(:func:`~diffusion_rl.train.checkpoint.checkpoint_state`).

Resume is exact: N steps straight equal N/2 steps, save, a fresh ``Trainer`` + :meth:`resume`,
N/2 steps, bitwise on CPU (model, optimizer, scheduler, counters, torch / Python / NumPy RNGs
and the trainer's generator are all restored).
Resume verifies each checkpoint (manifest hashes, readability, finiteness) and falls back,
with a warning, to the newest intact one; a configuration mismatch stops at once.
"""

from __future__ import annotations

import contextlib
import math
import random
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from torch.utils import _pytree as pytree

from diffusion_rl.contracts import Extreme, LossOutput, WeightedMetric
from diffusion_rl.distributed import World
from diffusion_rl.models.lora import lora_settings
from diffusion_rl.train.checkpoint import (
    TRAINER_STATE_FILE,
    CheckpointCorruptError,
    CheckpointManager,
    CheckpointMismatchError,
    LoadedCheckpoint,
    StagedState,
    agree_on_errors,
    apply_state,
    check_model_compatible,
    check_sharded_optimizer,
    collective_world,
    load_weights,
    read_checkpoint,
    stage_state,
    validate_metadata,
)
from diffusion_rl.train.metrics import reduce_metrics, reduce_weighted
from diffusion_rl.train.parallel import Parallel, full_tensor, is_sharded

__all__ = ["LossFn", "OptimConfig", "StepResult", "Trainer", "lr_factor"]

LossFn = Callable[[nn.Module, Any, torch.Generator], LossOutput]

_STATE_FORMAT = 1
_RESERVED_METRICS = (
    "loss",
    "loss_denominator",
    "grad_norm",
    "lr",
    "skipped_zero_weight",
    "skipped_nonfinite",
)


class OptimConfig(BaseModel):
    """AdamW and learning-rate schedule settings.

    ``schedule``: ``warmup_steps`` linear warm-up (factor ``(s + 1) / warmup_steps`` at
    optimizer step s), then constant, or linear / cosine decay from ``lr`` to
    ``lr * min_lr_ratio`` at ``total_steps`` (required for those two). ``grad_clip=None``
    disables clipping (the norm is still reported).

    Strict types: every float is finite (no nan / inf), ints are ints (``true`` is not a
    step count), bools are bools.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    lr: float = Field(1e-3, gt=0, allow_inf_nan=False)
    weight_decay: float = Field(0.0, ge=0, allow_inf_nan=False)
    betas: tuple[float, float] = Field((0.9, 0.999), strict=False)  # YAML gives a list
    eps: float = Field(1e-8, gt=0, allow_inf_nan=False)
    grad_clip: float | None = Field(1.0, gt=0, allow_inf_nan=False)
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    total_steps: int | None = Field(None, ge=1)
    min_lr_ratio: float = Field(0.0, ge=0, le=1, allow_inf_nan=False)

    @field_validator("betas", mode="before")
    @classmethod
    def _betas_are_numbers(cls, betas: Any) -> Any:
        if isinstance(betas, (list, tuple)) and any(isinstance(b, bool) for b in betas):
            raise ValueError(f"expected two numbers in [0, 1), got {list(betas)}")
        return betas

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"each beta must be in [0, 1), got {betas}")
        return betas

    @model_validator(mode="after")
    def _schedule_is_complete(self) -> OptimConfig:
        if self.schedule != "constant" and self.total_steps is None:
            raise ValueError(f"total_steps: required when schedule={self.schedule!r}")
        if self.total_steps is not None and self.warmup_steps > self.total_steps:
            raise ValueError(
                f"warmup_steps: must be <= total_steps={self.total_steps}, got {self.warmup_steps}"
            )
        return self


def lr_factor(config: OptimConfig, step: int) -> float:
    """Multiplier of ``config.lr`` at optimizer step ``step`` (0-based)."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.schedule == "constant":
        return 1.0
    span = max(1, config.total_steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    if config.schedule == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * shape


@dataclass(frozen=True)
class StepResult:
    """``metrics``: loss, loss_denominator, reduced aux metrics, grad_norm, lr, skip counters.
    ``applied``: whether the optimizer stepped."""

    metrics: dict[str, float]
    applied: bool


def _detached(value: torch.Tensor | float) -> torch.Tensor | float:
    return value.detach() if isinstance(value, torch.Tensor) else value


def _python_rng_state() -> dict[str, Any]:
    version, internal, gauss_next = random.getstate()
    return {"version": version, "state": list(internal), "gauss_next": gauss_next}


def _python_rng_tuple(state: Mapping[str, Any]) -> tuple:
    return (state["version"], tuple(state["state"]), state["gauss_next"])


def _numpy_rng_state() -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "name": name,
        "keys": keys.tolist(),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }


def _numpy_rng_tuple(state: Mapping[str, Any]) -> tuple:
    keys = np.asarray(state["keys"], dtype=np.uint32)
    return (state["name"], keys, state["pos"], state["has_gauss"], state["cached_gaussian"])


_COUNTERS = ("global_step", "optimizer_steps", "skipped_zero_weight", "skipped_nonfinite")


class Trainer:
    """Optimises ``model`` with ``loss_fn(model, micro_batch, generator) -> LossOutput``.

    ``loss_fn`` is given at construction (a fixed objective, e.g. SFT) or per step to
    :meth:`train_step` (a learner whose loss depends on the rollout it trains on).

    * ``self.generator``: a CPU ``torch.Generator`` seeded with ``seed``, passed to every
      ``loss_fn`` call (the loss's randomness: masks, timesteps). Saved and restored.
    * ``precision="bf16"`` runs ``loss_fn`` under ``torch.autocast(device.type, bfloat16)``;
      parameters keep their own dtype.
    * ``activation_checkpointing=True`` calls ``model.enable_activation_checkpointing(True)``.
    * The model is moved to ``device``; so are tensors in each micro-batch (pytree leaves).
    * ``parallel`` (under ``torchrun``; :mod:`diffusion_rl.train.parallel`): the model given
      stays a plain module, :attr:`host` (what recipes sample, evaluate and save, refreshed by
      :meth:`publish`), and :attr:`model` is a sharded copy of it (FSDP2; each part sharded
      on its own) that the optimizer trains. Each rank passes its own rows; the step is that
      of the whole batch: micro-batch counts are agreed (ghost padding), every ``S_k`` and
      ``d_k`` of every rank enters one global reduction, gradients are summed across ranks
      and divided once by the global bound, and skip decisions are global. Without it,
      :attr:`host` and :attr:`model` are the same module.
    * ``parts`` (``{name: OptimConfig}``): train the submodules ``model[name]`` (e.g. the
      stages of a workflow, ``model`` an ``nn.ModuleDict``) as separate parts, each with its
      own AdamW hyper-parameters, LR schedule and gradient clip (one parameter group per
      part, in ``parts`` order; ``optim`` is then only the trainer's default). Each
      micro-batch names its part (``micro_batch.part``), and each part's gradient is
      normalised once by its own micro-batches' total weight, so a step on several parts is
      the sum of their weighted-mean losses (``loss``; ``loss/NAME`` each) and a part whose
      weight is 0 is left unchanged. A non-finite loss or gradient in any part skips the
      whole step. Metrics add ``grad_norm/NAME`` and ``lr/NAME``.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn | None,
        optim: OptimConfig,
        *,
        precision: Literal["fp32", "bf16"] = "fp32",
        activation_checkpointing: bool = False,
        seed: int = 0,
        device: str | torch.device = "cpu",
        parts: Mapping[str, OptimConfig] | None = None,
        parallel: Parallel | None = None,
    ) -> None:
        if not isinstance(optim, OptimConfig):
            raise TypeError(f"optim: expected an OptimConfig, got {type(optim).__name__}")
        if precision not in ("fp32", "bf16"):
            raise ValueError(f"precision: expected 'fp32' or 'bf16', got {precision!r}")
        if activation_checkpointing:
            enable = getattr(model, "enable_activation_checkpointing", None)
            if not callable(enable):
                raise TypeError(
                    f"activation_checkpointing=True: {type(model).__name__} has no "
                    "enable_activation_checkpointing(enabled) method"
                )
            enable(True)
        self.parallel = parallel
        self.world = parallel.world if parallel is not None else World()
        if parallel is not None:
            if precision == "bf16":
                raise ValueError(
                    "precision: bf16 autocast and FSDP do not mix; under torchrun set "
                    "distributed.param_dtype: bf16 (FSDP mixed precision) and precision: fp32"
                )
            device = parallel.world.device
        self.device = torch.device(device)
        self.host = model.to(self.device)
        checked_parts = _check_parts(model, parts)
        if parallel is not None:
            model = (
                _shard_parts(parallel, model, parts)
                if parts
                else parallel.sharded_copy(model, "actor")
            )
        self.model = model
        self.loss_fn = loss_fn
        self.optim = optim
        self.precision = precision
        self.activation_checkpointing = activation_checkpointing
        self.seed = seed
        self.generator = torch.Generator(device="cpu").manual_seed(seed)

        self.parts: dict[str, OptimConfig] = checked_parts or {"": optim}
        self._part_params = {
            name: [p for p in (model[name] if name else model).parameters() if p.requires_grad]
            for name in self.parts
        }
        self._params = [p for params in self._part_params.values() for p in params]
        if not self._params:
            raise ValueError(f"model: {type(model).__name__} has no parameter with requires_grad")
        self._param_names = {id(p): name for name, p in model.named_parameters()}
        self.optimizer = torch.optim.AdamW(
            [
                {
                    "params": self._part_params[name],
                    "lr": config.lr,
                    "betas": config.betas,
                    "eps": config.eps,
                    "weight_decay": config.weight_decay,
                }
                for name, config in self.parts.items()
            ]
        )
        # plain functions (one per part): LambdaLR then saves no closure state
        factors = [lambda step, c=config: lr_factor(c, step) for config in self.parts.values()]
        self.scheduler = LambdaLR(self.optimizer, lr_lambda=factors)

        self.global_step = 0
        self.optimizer_steps = 0
        self.skipped_zero_weight = 0
        self.skipped_nonfinite = 0
        self.resumed_from: Path | None = None  # the checkpoint the last resume() used

    # ------------------------------------------------------------------------- training
    def train_step(self, micro_batches: Sequence[Any], loss_fn: LossFn | None = None) -> StepResult:
        """One optimisation step over ``micro_batches`` (see the module invariants), with
        ``loss_fn`` (default: the constructor's).

        After an applied step ``p.grad`` holds the gradient that was used (normalised and
        clipped); after a skipped step every ``p.grad`` is ``None``.
        """
        loss_fn = loss_fn or self.loss_fn
        if loss_fn is None:
            raise TypeError("loss_fn: give one to Trainer(...) or to train_step(...)")
        if isinstance(micro_batches, (str, bytes)) or not isinstance(micro_batches, Sequence):
            raise TypeError(
                f"micro_batches: expected a sequence, got {type(micro_batches).__name__}"
            )
        if len(micro_batches) == 0:
            raise ValueError("micro_batches: expected at least one micro-batch, got none")
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        try:
            ghosts = [bool(getattr(m, "ghost", False)) for m in micro_batches]
            if self.world.distributed:
                micro_batches, ghosts = self._agree_on_micro_batches(micro_batches, ghosts)
            primaries, aux_items, finite = self._accumulate(micro_batches, loss_fn, ghosts)
            if self.world.distributed:  # every rank reduces the same values, in rank order
                gathered = self.world.gather_objects((primaries, aux_items, finite))
                primaries = {}
                for rank_primaries, _, _ in gathered:
                    for name, items in rank_primaries.items():
                        primaries.setdefault(name, []).extend(items)
                aux_items = [item for _, items, _ in gathered for item in items]
                finite = all(ok for _, _, ok in gathered)
            losses = {
                name: reduce_weighted(items, f"loss/{name}" if name else "loss")
                for name, items in primaries.items()
            }
            aux = reduce_metrics(aux_items)
        except BaseException:
            self.optimizer.zero_grad(set_to_none=True)
            raise

        lrs = {
            name: float(group["lr"]) for name, group in zip(self.parts, self.optimizer.param_groups)
        }
        norms = {name: 0.0 for name in self.parts}
        applied = False
        if not finite:
            norms = {name: math.nan for name in self.parts}
            self.skipped_nonfinite += 1
        elif all(loss.bound == 0.0 for loss in losses.values()):
            self.skipped_zero_weight += 1
        else:
            for name, loss in losses.items():
                for param in self._part_params[name]:
                    if param.grad is None:
                        continue
                    if loss.bound == 0.0:  # no weight in this part: no update of it
                        param.grad = None
                    else:
                        param.grad.div_(loss.bound)
            norms = {name: self._clip_and_norm(name) for name in self.parts}
            if all(math.isfinite(norm) for norm in norms.values()):
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer_steps += 1
                applied = True
            else:
                self.skipped_nonfinite += 1
        if not applied:
            self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1

        loss_value = sum(loss.value for loss in losses.values())
        denominator = sum(loss.denominator for loss in losses.values())
        metrics = {"loss": loss_value, "loss_denominator": denominator, **aux}
        values = list(norms.values())
        grad_norm = values[0] if len(values) == 1 else math.sqrt(sum(n * n for n in values))
        metrics.update(
            grad_norm=grad_norm,
            lr=lrs[next(iter(self.parts))],
            skipped_zero_weight=float(self.skipped_zero_weight),
            skipped_nonfinite=float(self.skipped_nonfinite),
        )
        if len(self.parts) > 1 or next(iter(self.parts)):
            for name in self.parts:
                if name in losses:
                    metrics[f"loss/{name}"] = losses[name].value
                metrics[f"grad_norm/{name}"] = norms[name]
                metrics[f"lr/{name}"] = lrs[name]
        return StepResult(metrics=metrics, applied=applied)

    def _agree_on_micro_batches(
        self, micro_batches: Sequence[Any], ghosts: list[bool]
    ) -> tuple[list[Any], list[bool]]:
        """Under several processes every rank must run the same passes of each sharded part,
        in the same order (each forward and backward is a collective): the micro-batches are
        ordered by part, and each part's are padded to the largest count of any rank with
        *ghosts* (copies of its last one, whose loss counts ×0: no gradient, no weight, no
        metric)."""
        by_part: dict[str, list[tuple[Any, bool]]] = {name: [] for name in self.parts}
        for index, (micro_batch, ghost) in enumerate(zip(micro_batches, ghosts)):
            by_part[self._part_of(micro_batch, index)].append((micro_batch, ghost))
        counts = self.world.gather_objects([len(by_part[name]) for name in self.parts])
        ordered: list[tuple[Any, bool]] = []
        for k, name in enumerate(self.parts):
            own, most = by_part[name], max(rank_counts[k] for rank_counts in counts)
            if most and not own:
                raise RuntimeError(
                    f"rank {self.world.rank}: no micro-batch of part {name or 'model'!r} while "
                    f"another rank has {most}; give every rank at least one (a ghost) so the "
                    "sharded passes match"
                )
            ordered += own + [(own[-1][0], True)] * (most - len(own))
        return [m for m, _ in ordered], [g for _, g in ordered]

    def _accumulate(
        self, micro_batches: Sequence[Any], loss_fn: LossFn, ghosts: Sequence[bool]
    ) -> tuple[dict[str, list[WeightedMetric]], list[dict[str, Any]], bool]:
        """Run ``loss_fn`` on every micro-batch and back-propagate each finite ``S_k`` (a
        ghost's ×0); the primaries of real micro-batches come back grouped by part (in
        micro-batch order). Under several processes every micro-batch is back-propagated,
        finite or not (the backward passes are collectives; the global flag skips the step)."""
        primaries: dict[str, list[WeightedMetric]] = {}
        aux_items: list[dict[str, Any]] = []
        finite = True
        for index, (micro_batch, ghost) in enumerate(zip(micro_batches, ghosts)):
            part = self._part_of(micro_batch, index)
            with self._autocast():
                out = loss_fn(self.model, self._to_device(micro_batch), self.generator)
            if not isinstance(out, LossOutput):
                raise TypeError(
                    f"loss_fn: expected a LossOutput, got {type(out).__name__} (micro-batch {index})"
                )
            total = out.primary.sum
            if not total.requires_grad:
                raise TypeError(
                    f"loss_fn: primary.sum of micro-batch {index} does not require grad; "
                    "return the differentiable weighted sum"
                )
            clash = [key for key in out.aux_metrics if key in _RESERVED_METRICS]
            if clash:
                raise ValueError(
                    f"loss_fn: aux metric names {clash} are reserved by the trainer "
                    f"({', '.join(_RESERVED_METRICS)})"
                )
            if ghost:
                (total * 0.0).backward()
                continue
            aux_items.append(
                {
                    key: value.detach()
                    if isinstance(value, (WeightedMetric, torch.Tensor))
                    else Extreme(_detached(value.value), value.kind)
                    if isinstance(value, Extreme)
                    else value
                    for key, value in out.aux_metrics.items()
                }
            )
            primaries.setdefault(part, []).append(out.primary.detach())
            ok = bool(torch.isfinite(total.detach()))
            if (finite and ok) or self.world.distributed:
                total.backward()
            finite = finite and ok  # keep running loss_fn: metrics and RNG use stay step-invariant
        return primaries, aux_items, finite

    def _part_of(self, micro_batch: Any, index: int) -> str:
        """The part a micro-batch trains: ``""`` for a trainer without parts, else its
        ``part`` attribute, which must name one of them."""
        if list(self.parts) == [""]:
            return ""
        part = getattr(micro_batch, "part", None)
        if part not in self.parts:
            raise ValueError(
                f"micro-batch {index}: part {part!r} is not one of this trainer's parts "
                f"{list(self.parts)}; give each micro-batch a .part naming the model part it trains"
            )
        return part

    def _clip_and_norm(self, part: str) -> float:
        """Clip ``part``'s gradient to its ``grad_clip`` (if set); return its pre-clip L2
        norm."""
        params = self._part_params[part]
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return 0.0
        grad_clip = self.parts[part].grad_clip
        if grad_clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
        else:  # a sharded model's norms are DTensors: full_tensor sums the shards'
            norms = [full_tensor(torch.linalg.vector_norm(g, dtype=torch.float32)) for g in grads]
            norm = torch.linalg.vector_norm(torch.stack(norms))
        return float(full_tensor(norm))

    def publish(self) -> nn.Module:
        """The trained weights in the plain :attr:`host` module (returned): under several
        processes the sharded actor's trainable tensors are gathered into it (a collective:
        every rank calls it); otherwise the host *is* the trained model."""
        if self.parallel is not None:
            if list(self.parts) == [""]:
                self.parallel.gather_into(self.host, self.model)
            else:
                for name in self.parts:
                    self.parallel.gather_into(self.host[name], self.model[name])
        return self.host

    def autocast(self) -> contextlib.AbstractContextManager:
        """The precision context of the live pass; score old/reference policies under it too
        so that they run the same kernels."""
        return self._autocast()

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.precision == "bf16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _to_device(self, micro_batch: Any) -> Any:
        def off_device(leaf: Any) -> bool:
            return isinstance(leaf, torch.Tensor) and leaf.device.type != self.device.type

        if not any(off_device(leaf) for leaf in pytree.tree_leaves(micro_batch)):
            return micro_batch
        return pytree.tree_map(
            lambda leaf: leaf.to(self.device) if isinstance(leaf, torch.Tensor) else leaf,
            micro_batch,
        )

    # ------------------------------------------------------------------------- checkpoints
    def full_metadata(self, metadata: Mapping[str, Any]) -> dict[str, Any]:
        """``metadata`` plus the trainer's own settings under the reserved key ``"trainer"``
        (with ``lora``, the adapter's settings, when the model trains a LoRA adapter: a
        resume with other LoRA settings is refused by name)."""
        if "trainer" in metadata:
            raise ValueError("metadata: the key 'trainer' is reserved for the trainer's settings")
        lora = lora_settings(self.model)
        return {
            **metadata,
            "trainer": {
                "optim": self.optim.model_dump(mode="json"),
                "precision": self.precision,
                "seed": self.seed,
                **(
                    {"parts": {k: v.model_dump(mode="json") for k, v in self.parts.items()}}
                    if list(self.parts) != [""]
                    else {}
                ),
                **({"lora": lora.model_dump(mode="json")} if lora is not None else {}),
            },
        }

    def trainer_state(self, data_state: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Everything but model and optimizer, in ``weights_only``-loadable form."""
        rng: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "generator": self.generator.get_state(),
            "python": _python_rng_state(),
            "numpy": _numpy_rng_state(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        return {
            "format": _STATE_FORMAT,
            "global_step": self.global_step,
            "optimizer_steps": self.optimizer_steps,
            "skipped_zero_weight": self.skipped_zero_weight,
            "skipped_nonfinite": self.skipped_nonfinite,
            "scheduler": self.scheduler.state_dict(),
            "rng": rng,
            "data_state": dict(data_state) if data_state is not None else {},
        }

    def save_checkpoint(
        self,
        manager: CheckpointManager,
        metadata: Mapping[str, Any],
        data_state: Mapping[str, Any] | None = None,
    ) -> Path:
        """Write checkpoint ``global_step`` through ``manager``; returns its directory.

        Under a process group a collective: every rank calls it at the same step (a sharded
        model is written by all of them in the DCP layout; ``data_state``, the trainer state
        and the metadata written are rank 0's)."""
        return manager.save(
            self.global_step,
            self.model,
            self.optimizer,
            self.trainer_state(data_state),
            self.full_metadata(metadata),
        )

    def resume(
        self,
        manager_or_path: CheckpointManager | str | Path,
        expected_metadata: Mapping[str, Any],
        *,
        warn: Callable[[str], Any] | None = None,
    ) -> dict[str, Any]:
        """Restore everything from the newest usable checkpoint; return its ``data_state``.

        ``manager_or_path``: a manager (its :meth:`~CheckpointManager.candidates`: the
        ``latest`` pointer's target, then every ``step_*`` directory by descending step) or
        one checkpoint directory. Each candidate is verified completely before any state is
        modified (:func:`~diffusion_rl.train.checkpoint.read_checkpoint`: manifest, hashes,
        readability, finiteness; a well-formed trainer state), then checked against this run
        (metadata, weights, optimizer layout):

        * damaged (:class:`CheckpointCorruptError`): reported through ``warn`` (default
          :func:`warnings.warn`) as ``"skipping checkpoint PATH: FILE: REASON"``, and the next
          older one is tried. When none is usable, :class:`CheckpointCorruptError` lists each
          with its reason (for a single directory: that directory's error). Never a silent
          start from zero.
        * intact but not this run's (:class:`CheckpointMismatchError`: the configuration, the
          model or the optimizer changed): raised at once, no fallback.

        Any layout into any world size (:mod:`~diffusion_rl.train.checkpoint`): a sharded
        (DCP) checkpoint into a plain model or a sharded one, a one-process checkpoint into a
        sharded model. With a sharded model every rank calls this together: rank 0 hashes
        the files (the others check sizes and parse), and every decision (skip, stop,
        restore) is taken by all ranks alike on the first rank's error
        (:func:`~diffusion_rl.train.checkpoint.agree_on_errors`); every rank restores rank
        0's saved counters, scheduler and RNG states.

        Afterwards ``self.resumed_from`` is the checkpoint used. Whenever this raises, the
        trainer (and every RNG) is untouched.
        """
        if isinstance(manager_or_path, CheckpointManager):
            candidates = manager_or_path.candidates()
            if not candidates:
                raise FileNotFoundError(f"no checkpoint to resume in {manager_or_path.directory}")
        else:
            candidates = [Path(manager_or_path)]
        world = collective_world(self.model)
        expected = self.full_metadata(expected_metadata)
        names = self._optimizer_param_names()
        skipped: list[CheckpointCorruptError] = []

        def skip(error: CheckpointCorruptError) -> None:
            if not isinstance(manager_or_path, CheckpointManager):
                raise error
            skipped.append(error)
            (warn or _warn_skipped)(f"skipping {error}")

        for path in candidates:
            try:
                checkpoint = agree_on_errors(world, lambda p=path: self._read(p, names, world))
            except CheckpointCorruptError as error:
                skip(error)
                continue
            saved_dtypes = agree_on_errors(
                world, lambda c=checkpoint: self._check_fits(c, expected)
            )
            try:
                staged = self._stage(checkpoint)  # agrees on its own errors
            except CheckpointCorruptError as error:
                skip(error)
                continue
            self._restore(checkpoint, saved_dtypes, staged)
            self.resumed_from = checkpoint.path
            self.publish()  # a sharded actor was restored: its host follows
            return dict(checkpoint.trainer_state["data_state"])
        lines = "\n  ".join(
            f"{error.path.name}: {error.file + ': ' if error.file else ''}{error.reason}"
            for error in skipped
        )
        raise CheckpointCorruptError(
            manager_or_path.directory,
            None,
            f"no usable checkpoint ({len(skipped)} tried, every one damaged):\n  {lines}\n"
            "Nothing was loaded. Restore the damaged files from a backup, or move this "
            "directory away to start from step 0.",
            problems=skipped,
        )

    def _read(self, path: Path, names: Sequence[str], world: World | None) -> LoadedCheckpoint:
        """Verify and read candidate ``path`` (only rank 0 of a collective ``world``
        hashes), with a well-formed trainer state."""
        checkpoint = read_checkpoint(path, names, hashes=world is None or world.is_main)
        if checkpoint.trainer_state.get("format") == _STATE_FORMAT:
            self._check_trainer_state(checkpoint)
        return checkpoint

    def _stage(self, checkpoint: LoadedCheckpoint) -> StagedState | None:
        """A fitting checkpoint's tensors read for this model (:func:`stage_state`: a
        sharded checkpoint, or a sharded model; a collective then), or ``None`` for a
        one-process checkpoint into a plain model (loaded directly by :meth:`_restore`)."""
        if not checkpoint.sharded and not is_sharded(self.model):
            return None
        return stage_state(checkpoint, self.model, self.optimizer)

    def _optimizer_param_names(self) -> list[str]:
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        return [self._param_names.get(id(p), f"#{i}") for i, p in enumerate(params)]

    def _check_trainer_state(self, checkpoint: LoadedCheckpoint) -> None:
        """Raise :class:`CheckpointCorruptError` unless the trainer state would restore: its
        counters are ints >= 0 (``global_step`` the manifest's step) and every RNG state is
        accepted by a scratch generator of its kind. Modifies nothing."""
        state = checkpoint.trainer_state

        def corrupt(reason: str) -> CheckpointCorruptError:
            return CheckpointCorruptError(checkpoint.path, TRAINER_STATE_FILE, reason)

        for key in _COUNTERS:
            value = state.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise corrupt(f"{key!r}: expected an int >= 0, got {value!r}")
        if state["global_step"] != checkpoint.step:
            raise corrupt(
                f"'global_step' is {state['global_step']}, but the manifest says step "
                f"{checkpoint.step}"
            )
        for key in ("scheduler", "rng", "data_state"):
            if not isinstance(state.get(key), dict):
                raise corrupt(f"{key!r}: expected a dict, got {type(state.get(key)).__name__}")
        rng = state["rng"]
        try:
            torch.Generator().set_state(rng["torch"])
            torch.Generator().set_state(rng["generator"])
            random.Random().setstate(_python_rng_tuple(rng["python"]))
            np.random.RandomState().set_state(_numpy_rng_tuple(rng["numpy"]))
        except Exception as error:  # KeyError, TypeError, ValueError, RuntimeError
            raise corrupt(f"malformed RNG state ({type(error).__name__}: {error})") from error

    def _check_fits(
        self, checkpoint: LoadedCheckpoint, expected: Mapping[str, Any]
    ) -> dict[tuple[int, str], torch.dtype]:
        """Raise :class:`CheckpointMismatchError` unless the checkpoint is this run's (metadata,
        state format, weights, optimizer layout); return the saved optimizer dtypes,
        ``{(flat parameter index, key): dtype}``. Either layout, a plain or sharded model."""
        path = checkpoint.path
        validate_metadata(expected, checkpoint.metadata, where=path)
        found = checkpoint.trainer_state.get("format")
        if found != _STATE_FORMAT:
            raise CheckpointMismatchError(
                f"checkpoint {path}: trainer_state format {found!r}, this version reads format "
                f"{_STATE_FORMAT}"
            )
        check_model_compatible(path, self.model)
        if checkpoint.sharded:
            return check_sharded_optimizer(checkpoint, self.model, self.optimizer)
        return self._check_optimizer_state(path, checkpoint.optimizer_state)

    def _restore(
        self,
        checkpoint: LoadedCheckpoint,
        saved_dtypes: Mapping[tuple[int, str], torch.dtype],
        staged: StagedState | None = None,
    ) -> None:
        """Apply a verified, fitting checkpoint (the only step that modifies state): the
        ``staged`` tensors (a collective for a sharded model), or a one-process checkpoint
        read directly into a plain model; then the trainer state, on every rank alike."""
        state = checkpoint.trainer_state
        if staged is None:
            load_weights(checkpoint.path, self.model)
            self.optimizer.load_state_dict(checkpoint.optimizer_state)
        else:
            apply_state(staged, self.model, self.optimizer)
        self._verify_optimizer_dtypes(saved_dtypes)
        self.scheduler.load_state_dict(state["scheduler"])
        for key in _COUNTERS:
            setattr(self, key, state[key])
        rng = state["rng"]
        torch.set_rng_state(rng["torch"])
        self.generator.set_state(rng["generator"])
        random.setstate(_python_rng_tuple(rng["python"]))
        np.random.set_state(_numpy_rng_tuple(rng["numpy"]))
        cuda_states = rng.get("cuda")
        if (
            cuda_states
            and torch.cuda.is_available()
            and len(cuda_states) == torch.cuda.device_count()
        ):
            torch.cuda.set_rng_state_all(cuda_states)

    def _check_optimizer_state(
        self, path: Path, optimizer_state: Mapping[str, Any]
    ) -> dict[tuple[int, str], torch.dtype]:
        """Check saved optimizer state fits our parameters; return ``{(index, key): dtype}``."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        saved_ids = [i for group in optimizer_state["param_groups"] for i in group["params"]]
        if len(saved_ids) != len(params) or len(optimizer_state["param_groups"]) != len(
            self.optimizer.param_groups
        ):
            raise CheckpointMismatchError(
                f"checkpoint {path}: optimizer has {len(saved_ids)} parameters, this model trains "
                f"{len(params)}"
            )
        by_id = dict(zip(saved_ids, range(len(params))))
        dtypes: dict[tuple[int, str], torch.dtype] = {}
        for saved_id, entry in optimizer_state["state"].items():
            index = by_id.get(saved_id)
            if index is None:
                raise CheckpointMismatchError(
                    f"checkpoint {path}: optimizer state for parameter id {saved_id!r}, which "
                    f"no parameter group lists (ids {saved_ids})"
                )
            param = params[index]
            for key, value in entry.items():
                if not isinstance(value, torch.Tensor):
                    continue
                dtypes[(index, key)] = value.dtype
                if key == "step" or value.dim() == 0:
                    continue
                if value.dtype != param.dtype or value.shape != param.shape:
                    name = self._param_names.get(id(param), f"#{index}")
                    raise CheckpointMismatchError(
                        f"checkpoint {path}: optimizer state {key!r} of parameter {name!r}: "
                        f"expected {tuple(param.shape)} {param.dtype} (the model), found "
                        f"{tuple(value.shape)} {value.dtype}. Resume with the parameter dtypes "
                        "and shapes that wrote the checkpoint, or start a new output directory."
                    )
        return dtypes

    def _verify_optimizer_dtypes(self, saved: Mapping[tuple[int, str], torch.dtype]) -> None:
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        for (index, key), dtype in saved.items():
            loaded = self.optimizer.state[params[index]][key].dtype
            if loaded != dtype:
                raise RuntimeError(
                    f"optimizer state {key!r} of parameter #{index} loaded as {loaded}, saved as "
                    f"{dtype}: optimizer state must keep its dtypes across resumes"
                )


def _check_parts(
    model: nn.Module, parts: Mapping[str, OptimConfig] | None
) -> dict[str, OptimConfig]:
    """``parts`` validated against ``model`` (``{"": optim}`` stands for no parts)."""
    if parts is None:
        return {}
    if not isinstance(parts, Mapping) or not parts:
        raise ValueError("parts: expected a non-empty mapping {submodule name: OptimConfig}")
    children = dict(model.named_children())
    for name, config in parts.items():
        if not isinstance(name, str) or not name or name not in children:
            raise ValueError(
                f"parts: {name!r} is not a submodule of {type(model).__name__} "
                f"(its submodules: {sorted(children)})"
            )
        if not isinstance(config, OptimConfig):
            raise TypeError(
                f"parts[{name!r}]: expected an OptimConfig, got {type(config).__name__}"
            )
    return dict(parts)


def _shard_parts(
    parallel: Parallel, model: nn.Module, parts: Mapping[str, OptimConfig]
) -> nn.ModuleDict:
    """A ``ModuleDict`` of a sharded copy of each part of ``model`` (the stages of a
    workflow are sharded separately: each runs its own passes)."""
    return nn.ModuleDict({name: parallel.sharded_copy(model[name], "actor") for name in parts})


def _warn_skipped(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)
