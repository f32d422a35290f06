"""The four policy roles of on-policy RL, with versions.

* **actor** — the trained model.
* **reference** — a frozen copy of the actor at the start of training (KL anchor), or a
  frozen model given explicitly (the teacher of on-policy distillation).
* **old policy** — a snapshot of the actor at the start of each optimisation step, scored on
  the same states and actions as the live actor; optionally held off the compute device.
* **rollout weights** — what the sampler runs; an in-memory copy synced from the actor, whose
  ``version`` increases by one on every sync. Every trace carries the version it was sampled
  with; the learner refuses a trace whose version is not the current one unless off-policy
  use is explicitly allowed.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
from torch import nn


class StaleTraceError(ValueError):
    """A trace sampled with weights other than the ones the learner is about to update."""


def _freeze(model: nn.Module, device: torch.device | str | None = None) -> nn.Module:
    if device is not None:
        model.to(device)
    model.eval()
    for param in model.parameters():
        param.requires_grad_(False)
    return model


def frozen_copy(model: nn.Module, device: torch.device | str | None = None) -> nn.Module:
    """A deep copy of ``model`` in eval mode, without gradients, on ``device``."""
    return _freeze(copy.deepcopy(model), device)


class PolicyRoles:
    """Holds actor, reference, rollout copy and old-policy snapshot.

    ``reference``: True for a frozen copy of the actor, False for none, or a model to freeze
    and use as the reference (e.g. a distillation teacher; it is frozen in place, not copied).
    ``offload_device`` (e.g. ``"cpu"``) keeps the reference and the snapshot there between
    uses; :meth:`on_compute` brings one to the actor's device for a scoring pass.
    """

    def __init__(
        self,
        actor: nn.Module,
        *,
        reference: bool | nn.Module = True,
        offload_device: str | None = None,
        version: int = 0,
    ) -> None:
        self.actor = actor
        self.offload_device = offload_device
        if isinstance(reference, nn.Module):
            self.reference = _freeze(reference, offload_device or self.compute_device)
        else:
            self.reference = frozen_copy(actor, offload_device) if reference else None
        self.rollout = frozen_copy(actor)
        self.version = version
        self._snapshot: nn.Module | None = None
        self.snapshot_version: int | None = None

    @property
    def compute_device(self) -> torch.device:
        return next(self.actor.parameters()).device

    def sync_rollout(self) -> int:
        """Copy the actor's weights into the rollout model (in memory); returns the new version."""
        self.rollout.load_state_dict(self.actor.state_dict())
        self.version += 1
        return self.version

    def restore(self, version: int) -> None:
        """After a resume: the rollout weights are the (restored) actor's, at ``version``."""
        self.rollout.load_state_dict(self.actor.state_dict())
        self.version = version

    def take_snapshot(self) -> nn.Module:
        """The old policy for this step: the actor's current weights, frozen."""
        if self._snapshot is None:
            self._snapshot = frozen_copy(self.actor, self.offload_device)
        else:
            self._snapshot.load_state_dict(self.actor.state_dict())
        self.snapshot_version = self.version
        return self._snapshot

    @property
    def snapshot(self) -> nn.Module:
        if self._snapshot is None:
            raise RuntimeError("snapshot: take_snapshot() has not been called this step")
        return self._snapshot

    @contextlib.contextmanager
    def on_compute(self, model: nn.Module) -> Iterator[nn.Module]:
        """Temporarily move an offloaded role to the compute device."""
        if self.offload_device is None:
            yield model
            return
        model.to(self.compute_device)
        try:
            yield model
        finally:
            model.to(self.offload_device)

    def check_trace_version(self, trace_version: int, *, allow_off_policy: bool = False) -> None:
        if trace_version != self.version and not allow_off_policy:
            raise StaleTraceError(
                f"weights_version: the trace was sampled with rollout weights v{trace_version}, "
                f"the learner is at v{self.version}; sample fresh rollouts or set "
                "allow_off_policy: true"
            )
