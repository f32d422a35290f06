"""Several processes working as one: the world (rank, size), row shards and the few
collectives the layers above need.

One process is the default and needs nothing from this module: :meth:`World.current` is then
``World()`` (rank 0 of 1) and every collective returns its input. Under ``torchrun`` (which
sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``)
:func:`init_world` joins the process group (gloo on CPU, NCCL on CUDA) and
:meth:`World.current` describes this process.

Invariants:

* :meth:`World.shard` splits ``n`` rows into ``size`` contiguous ranges in rank order whose
  lengths differ by at most one; their concatenation is ``range(n)``. Work keyed by row (the
  samplers' row seeds, the objectives' noise keys) is therefore the same for any world size.
* Every collective is called by every rank in the same order (a call on one rank only blocks
  the others: the deadlock FSDP users meet when one rank generates alone).
* Sums are taken in float64 after gathering every rank's values, in rank order, so each rank
  computes bitwise the same total (no reduction-op averaging, which gloo has got wrong).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["World", "close_world", "init_world", "launched"]


def launched() -> bool:
    """Whether this process was started by a launcher (``torchrun``) with a world size."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


@dataclass(frozen=True)
class World:
    """This process's place among the processes of a run: ``rank`` of ``size``, and the
    device its collectives use (``cpu`` for gloo, ``cuda:LOCAL_RANK`` for NCCL)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    device: str = "cpu"
    distributed: bool = False  # whether this world is a process group (even one of size 1)

    @classmethod
    def current(cls) -> World:
        """The world of the initialised process group, or one process when there is none."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls()
        backend = dist.get_backend()
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
        device = f"cuda:{local}" if backend == "nccl" else "cpu"
        return cls(dist.get_rank(), dist.get_world_size(), local, device, distributed=True)

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that logs, evaluates and writes reports."""
        return self.rank == 0

    def shard(self, n: int) -> range:
        """This rank's contiguous rows of ``n`` (see the module invariants)."""
        if n < 0:
            raise ValueError(f"shard: expected a row count >= 0, got {n}")
        return range(n * self.rank // self.size, n * (self.rank + 1) // self.size)

    def share(self, n: int, field: str) -> slice:
        """This rank's rows of a batch of ``n`` as a slice, refusing a batch too small for
        every rank to get one (``field`` names the config key in the error)."""
        if n < self.size:
            raise ValueError(
                f"{field}: {n} rows cannot be shared by {self.size} processes; use at least "
                f"{self.size} (one per process), or fewer processes"
            )
        rows = self.shard(n)
        return slice(rows.start, rows.stop)

    # ------------------------------------------------------------------------ collectives
    def gather_objects(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (picklable), in rank order."""
        if not self.distributed:
            return [value]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, value)
        return out

    def broadcast(self, value: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``value`` on every rank."""
        if not self.distributed:
            return value
        box = [value if self.rank == src else None]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise float64 sums of every rank's ``values`` (same length everywhere)."""
        if not self.distributed:
            return [float(v) for v in values]
        totals = torch.zeros(len(values), dtype=torch.float64)
        for row in self.gather_objects([float(v) for v in values]):
            if len(row) != len(values):
                raise RuntimeError(
                    f"World.sum: ranks disagree on the number of values ({len(row)} vs "
                    f"{len(values)}); every rank must reduce the same quantities"
                )
            totals += torch.tensor(row, dtype=torch.float64)
        return totals.tolist()

    def max(self, value: int) -> int:
        """The largest ``value`` of any rank."""
        return max(self.gather_objects(int(value)))

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on some rank."""
        return any(self.gather_objects(bool(flag)))

    def gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's rows (dim 0; shapes after dim 0 agree), concatenated in rank order,
        on ``tensor``'s device. Ranks may hold different numbers of rows."""
        if not self.distributed:
            return tensor
        parts = self.gather_objects(tensor.detach().cpu())
        return torch.cat(parts).to(tensor.device)

    def barrier(self) -> None:
        """Wait until every rank gets here."""
        if self.distributed:
            if dist.get_backend() == "nccl":
                dist.barrier(device_ids=[self.local_rank])
            else:
                dist.barrier()


def init_world(device: str = "cpu", backend: str = "auto", timeout_s: float = 3600.0) -> World:
    """Join the process group a launcher set up (idempotent); one process without a launcher
    gets ``World()``. ``backend``: ``auto`` (NCCL for a CUDA ``device``, else gloo), ``gloo``
    or ``nccl``; ``timeout_s``: how long a collective waits for the other ranks."""
    if dist.is_available() and dist.is_initialized():
        return World.current()
    if not launched():
        return World()
    if backend == "auto":
        backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError(
                "distributed.backend: nccl needs CUDA GPUs, and none is visible; use gloo on CPU"
            )
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return World.current()


def close_world() -> None:
    """Leave the process group (at the end of a run under a launcher)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
