"""Data-parallel, sharded training on PyTorch's own engine: a device mesh per role, FSDP2
``fully_shard`` with a mixed-precision policy, and the plain replica that samples, evaluates
and saves.

:class:`Parallel` is built once per run from :class:`ParallelConfig` and the process group
(:func:`~diffusion_rl.distributed.init_world`). Roles and their meshes:

* **actor** — sharded over a 2-D mesh ``(replicate, shard)`` with ``shard`` processes per
  FSDP group (``null``: all of them, pure FSDP; ``1``: every process holds a full copy and
  gradients are all-reduced, as DDP does; in between: HSDP). The optimizer is built on the
  sharded parameters.
* **reference** — a frozen copy sharded over its own mesh (``reference_shard``);
  **old-policy snapshot** — a frozen copy sharded like the actor (so its shards copy
  locally); both scored on the same micro-batches as the live actor.
* **rollout** — a plain full replica per process (the *host*, the module the recipe built),
  synced from the sharded actor by gathering its trainable tensors; it samples, evaluates and
  is saved, with no collective inside a generation (so rank 0 can evaluate alone).

Exactness under mixed precision (``param_dtype``): FSDP computes with parameters cast to
``param_dtype`` and keeps float32 masters. Inputs are *not* cast (``cast_forward_inputs`` is
off), so the replica matches it exactly when its parameters are cast the same way for the
duration of a rollout (:meth:`Parallel.sampling`): same values, same kernels, so the ratio is
exactly 1 before an update.

Gradients are *summed* across processes (FSDP's averaging and its pre-multiplied sums are
switched off: gloo has no PREMUL_SUM, and the trainer divides once by the global weighted
denominator itself).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from ..distributed import World

__all__ = [
    "FORWARD_METHODS",
    "Parallel",
    "ParallelConfig",
    "full_tensor",
    "is_sharded",
    "local_tensor",
    "run_parallel",
]

# Methods besides ``forward`` that scorers call on a model (FSDP must gather before them).
FORWARD_METHODS = ("forward_packed", "forward_block", "new_cache", "encode_prompts")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class ParallelConfig(BaseModel):
    """``distributed:`` of every recipe config (used when the run has a process group, i.e.
    under ``torchrun``; one process ignores it).

    ``shard``: processes per FSDP group of the actor (null: all; must divide the world size);
    ``reference_shard``: the same for the reference (null: as the actor);
    ``param_dtype``: FSDP's compute dtype (null: the parameters' own; ``bf16``: mixed
    precision with float32 masters); ``reduce_dtype``: the dtype gradients are summed in;
    ``reshard_after_forward``: free gathered parameters after each forward (less memory, one
    more gather in backward); ``backend``: ``auto`` (NCCL on CUDA, gloo on CPU);
    ``timeout_s``: how long a collective may wait for the other ranks (they wait while rank 0
    evaluates or writes the final model).
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    shard: int | None = Field(None, ge=1)
    reference_shard: int | None = Field(None, ge=1)
    param_dtype: Literal["fp32", "bf16"] | None = None
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    reshard_after_forward: bool = True
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    timeout_s: float = Field(3600.0, gt=0, allow_inf_nan=False)


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` (or a submodule) was sharded by ``fully_shard``."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules())


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This process's shard of a DTensor; a plain tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective); a plain tensor itself."""
    gather = getattr(tensor, "full_tensor", None)
    return gather() if callable(gather) else tensor


def _units(module: nn.Module) -> list[nn.Module]:
    """The FSDP units of ``module``, innermost first: each element of every ``ModuleList``
    that holds parameters (transformer blocks), then ``module`` itself."""
    units = []
    for child in module.modules():
        if isinstance(child, nn.ModuleList):
            units += [m for m in child if any(True for _ in m.parameters())]
    return [*units, module]


class Parallel:
    """The meshes and sharding of one run (module doc). ``world`` must be distributed."""

    def __init__(self, config: ParallelConfig, world: World) -> None:
        if not world.distributed:
            raise ValueError("Parallel: needs a process group (run under torchrun)")
        for name in ("shard", "reference_shard"):
            size = getattr(config, name)
            if size is not None and world.size % size:
                raise ValueError(
                    f"distributed.{name}: {size} does not divide the world size {world.size}; "
                    f"choose a divisor of {world.size} (or null for all processes)"
                )
        self.config = config
        self.world = world
        self._meshes: dict[int, object] = {}

    @property
    def param_dtype(self) -> torch.dtype | None:
        return None if self.config.param_dtype is None else _DTYPES[self.config.param_dtype]

    def mesh(self, shard: int | None):
        """The ``(replicate, shard)`` device mesh with ``shard`` processes per group."""
        from torch.distributed.device_mesh import init_device_mesh

        shard = shard or self.world.size
        if shard not in self._meshes:
            device = "cuda" if self.world.device.startswith("cuda") else "cpu"
            self._meshes[shard] = init_device_mesh(
                device, (self.world.size // shard, shard), mesh_dim_names=("replicate", "shard")
            )
        return self._meshes[shard]

    def shard(self, module: nn.Module, role: Literal["actor", "reference"] = "actor") -> nn.Module:
        """Shard ``module`` in place with ``fully_shard`` (its units, then itself) over the
        role's mesh, with the mixed-precision policy and summed gradients; returns it."""
        from torch.distributed.fsdp import (
            FSDPModule,
            MixedPrecisionPolicy,
            fully_shard,
            register_fsdp_forward_method,
        )

        size = (
            self.config.shard
            if role == "actor"
            else (self.config.reference_shard or self.config.shard)
        )
        mesh = self.mesh(size)
        policy = MixedPrecisionPolicy(
            param_dtype=self.param_dtype,
            reduce_dtype=_DTYPES[self.config.reduce_dtype],
            cast_forward_inputs=False,
        )
        module.to(self.world.device)
        for unit in _units(module):
            fully_shard(
                unit,
                mesh=mesh,
                mp_policy=policy,
                reshard_after_forward=self.config.reshard_after_forward,
            )
        for name in FORWARD_METHODS:
            if callable(getattr(module, name, None)):
                register_fsdp_forward_method(module, name)
        for unit in module.modules():
            if isinstance(unit, FSDPModule):
                unit.set_gradient_divide_factor(1.0)
                unit.set_force_sum_reduction_for_comms(True)
        # FSDP reads which parameters train (and so the gradient dtype) at its lazy init,
        # normally the first forward; that may be a LoRA reference pass with the adapter
        # switched off (requires_grad False), so initialise now, while the flags are true.
        module._get_fsdp_state()._lazy_init()
        return module

    def sharded_copy(self, host: nn.Module, role: Literal["actor", "reference"]) -> nn.Module:
        """A sharded copy of the plain module ``host`` (``host`` is left as it is)."""
        return self.shard(copy.deepcopy(host), role)

    def gather_into(self, host: nn.Module, sharded: nn.Module) -> None:
        """Copy ``sharded``'s trainable parameters, gathered whole, into the plain ``host``
        (a collective: every rank calls it). Frozen parameters and buffers are not moved:
        ``host`` is what ``sharded`` was copied from, and they never change."""
        targets = dict(host.named_parameters())
        with torch.no_grad():
            for name, param in sharded.named_parameters():
                if param.requires_grad:
                    target = targets[name]
                    target.copy_(full_tensor(param.detach()).to(target.device, target.dtype))

    @staticmethod
    def copy_shards(target: nn.Module, source: nn.Module) -> None:
        """Copy each shard of ``source`` into the same shard of ``target`` (two modules sharded
        alike): local, no communication."""
        from torch.distributed.fsdp import FSDPModule

        for unit in target.modules():  # drop gathered copies (reshard_after_forward: false)
            if isinstance(unit, FSDPModule):
                unit.reshard()
        sources = source.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, tensor in target.state_dict(keep_vars=True).items():
                local_tensor(tensor).copy_(local_tensor(sources[name].detach()))

    @contextlib.contextmanager
    def sampling(self, host: nn.Module) -> Iterator[nn.Module]:
        """``host`` with its parameters cast to ``param_dtype`` for the block (as FSDP casts
        the actor's), restored afterwards; a no-op without mixed precision."""
        dtype = self.param_dtype
        params = [p for p in host.parameters() if p.is_floating_point() and p.dtype != dtype]
        if dtype is None or not params:
            yield host
            return
        saved = [p.data for p in params]
        try:
            for p in params:
                p.data = p.data.to(dtype)
            yield host
        finally:
            for p, data in zip(params, saved):
                p.data = data


_RUN: dict[tuple, Parallel] = {}


def run_parallel(config: ParallelConfig) -> Parallel | None:
    """The :class:`Parallel` of this run's process group and ``config`` (one per pair, so
    its meshes are made once), or None for one process without a group."""
    world = World.current()
    if not world.distributed:
        return None
    key = (config, world)
    if key not in _RUN:
        _RUN.clear()  # a new group (tests make several in one process)
        _RUN[key] = Parallel(config, world)
    return _RUN[key]
