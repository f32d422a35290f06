"""The four policy roles of on-policy RL, with versions.

* **actor** — the trained model.
* **reference** — a frozen copy of the actor at the start of training (KL anchor; for a
  LoRA actor, the actor itself with its adapter switched off), or a frozen model given
  explicitly (the teacher of on-policy distillation).
* **old policy** — a snapshot of the actor at the start of each optimisation step, scored on
  the same states and actions as the live actor; optionally held off the compute device.
* **rollout weights** — what the sampler runs; an in-memory copy synced from the actor, whose
  ``version`` increases by one on every sync. Every trace carries the version it was sampled
  with; the learner refuses a trace whose version is not the current one unless off-policy
  use is explicitly allowed. For the forward-process flow methods they are instead the
  *old policy* that lags the actor, a moving average updated on every sync
  (``sync_rollout(decay)``), which checkpoints keep.

Frozen copies (rollout weights, snapshot, the reference of a full fine-tune) share the
actor's frozen parameters and buffers (:func:`frozen_copy`): memory grows by the trainable
weights only (docs/lora.md).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from ..models.lora import LoraReference, has_lora, lora_reference
from ..trace import StaleTraceError  # noqa: F401 (re-exported: defined below scoring/ too)
from .parallel import Parallel


def _tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    yield from model.parameters()
    yield from model.buffers()


def shared_tensors(model: nn.Module) -> dict[int, torch.Tensor]:
    """What a frozen copy of ``model`` shares with it instead of copying, by ``id``: every
    parameter without ``requires_grad`` and every buffer, except the running statistics of
    batch-norm layers (the actor updates those in place while it trains)."""
    updated = {
        id(buffer)
        for module in model.modules()
        if isinstance(module, _NormBase)
        for buffer in module.buffers(recurse=False)
    }
    shared = {id(p): p for p in model.parameters() if not p.requires_grad}
    shared.update({id(b): b for b in model.buffers() if id(b) not in updated})
    return shared


def _move(model: nn.Module, device: torch.device | str, keep: dict[int, Any]) -> None:
    """Move ``model`` to ``device``, except the tensors in ``keep`` (shared with another
    model, which must stay where they are)."""
    if not any(id(t) in keep for t in _tensors(model)):
        model.to(device)
        return
    with torch.no_grad():
        for module in model.modules():
            for param in module._parameters.values():
                if param is not None and id(param) not in keep:
                    param.data = param.data.to(device)
            for name, buffer in module._buffers.items():
                if buffer is not None and id(buffer) not in keep:
                    module._buffers[name] = buffer.to(device)


def _freeze(model: nn.Module, device: torch.device | str | None = None) -> nn.Module:
    if device is not None:
        model.to(device)
    model.eval()
    for param in model.parameters():
        param.requires_grad_(False)
    return model


def frozen_copy(model: nn.Module, device: torch.device | str | None = None) -> nn.Module:
    """A copy of ``model`` in eval mode, without gradients, on ``device``.

    Only what training can change is copied: the tensors of :func:`shared_tensors` (frozen
    parameters and buffers) are *shared* with ``model`` (the same objects; a deep copy with
    them in its memo), so a LoRA actor or a pipeline with frozen encoders costs one copy of
    its trainable weights, not of the base. Shared tensors stay on their device when the
    copy moves. A model whose every parameter trains (and has no buffers) is copied whole,
    exactly as ``copy.deepcopy`` does.
    """
    shared = shared_tensors(model)
    clone = copy.deepcopy(model, dict(shared))
    clone.eval()
    for param in clone.parameters():
        param.requires_grad_(False)
    if device is not None:
        _move(clone, device, shared)
    return clone


def copy_weights(target: nn.Module, source: nn.Module) -> None:
    """Copy ``source``'s state-dict tensors into ``target``'s (same keys: ``target`` is a copy
    of ``source``), skipping the tensors they share. Equal to
    ``target.load_state_dict(source.state_dict())`` for a copy, without copying a shared base
    onto itself."""
    sources = source.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, tensor in target.state_dict(keep_vars=True).items():
            if tensor is not sources[name]:
                tensor.copy_(sources[name])


class PolicyRoles:
    """Holds actor, reference, rollout copy and old-policy snapshot.

    ``reference``: True for a frozen copy of the actor, False for none, or a model to freeze
    and use as the reference (e.g. a distillation teacher; it is frozen in place, not copied).
    With a LoRA actor (peft adapter; :func:`~diffusion_rl.models.lora.has_lora`),
    ``reference=True`` is the actor itself with its adapter switched off
    (:func:`~diffusion_rl.models.lora.lora_reference`): no copy at all, and since a fresh
    adapter adds exactly 0, the KL to the reference is exactly 0 before the first update.

    The rollout copy and the snapshot are :func:`frozen_copy` s: they share the actor's frozen
    parameters and buffers (a LoRA actor's base, a pipeline's encoders) and own copies of its
    trainable weights, which :meth:`sync_rollout` / :meth:`take_snapshot` copy. The shared
    tensors must stay frozen in the actor (they are never trained).
    ``offload_device`` (e.g. ``"cpu"``) keeps the reference and the snapshot (what they own)
    there between uses; :meth:`on_compute` brings one to the actor's device for a scoring
    pass.
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
        self.reference: Any
        if isinstance(reference, nn.Module):
            self.reference = _freeze(reference, offload_device or self.compute_device)
        elif reference and has_lora(actor):
            self.reference = lora_reference(actor)
        else:
            self.reference = frozen_copy(actor, offload_device) if reference else None
        self.rollout = frozen_copy(actor)
        self.rollout_lags = False  # the rollout weights are a moving average, not a copy
        self.version = version
        self._snapshot: nn.Module | None = None
        self.snapshot_version: int | None = None
        self.parallel: Parallel | None = None

    def shard(self, parallel: Parallel, actor: nn.Module) -> None:
        """Switch to sharded roles (under several processes; ``actor`` is the trainer's
        sharded copy of :attr:`actor`): the plain actor becomes the rollout weights (a full
        replica per rank, synced by gathering), the reference is a sharded copy over its
        mesh (a given model, e.g. a distillation teacher, stays plain for rank 0's
        evaluations; a LoRA reference is the sharded actor with its adapter off) and the
        snapshot will be a sharded copy on the actor's mesh, synced shard by shard."""
        if self.offload_device is not None:
            raise ValueError(
                "offload_device: not used under torchrun; FSDP already shards the frozen "
                "roles (set distributed.reference_shard), so remove offload_device"
            )
        host, self.parallel = self.actor, parallel
        if isinstance(self.reference, LoraReference):
            self.reference = lora_reference(actor)
        elif self.reference is not None:  # a copy: a given model (a teacher) stays plain
            self.reference = _freeze(parallel.sharded_copy(self.reference, "reference"))
        self.actor, self.rollout = actor, host

    def sampling(self) -> contextlib.AbstractContextManager:
        """The context the rollout weights sample in: sharded roles cast them to FSDP's
        compute dtype for the block (what the live actor computes with); else nothing."""
        if self.parallel is None:
            return contextlib.nullcontext()
        return self.parallel.sampling(self.rollout)

    @property
    def compute_device(self) -> torch.device:
        return next(self.actor.parameters()).device

    def _copy_to_rollout(self) -> None:
        if self.parallel is None:
            copy_weights(self.rollout, self.actor)
        else:  # a collective: every rank gathers the actor's shards
            self.parallel.gather_into(self.rollout, self.actor)

    def _owned_rollout(self) -> dict[str, torch.Tensor]:
        """The rollout weights' own tensors (what a sync writes), by state-dict name."""
        if self.parallel is not None:
            return {n: p for n, p in self.rollout.named_parameters() if p.requires_grad}
        actor = self.actor.state_dict(keep_vars=True)
        return {
            name: tensor
            for name, tensor in self.rollout.state_dict(keep_vars=True).items()
            if tensor is not actor[name]
        }

    def sync_rollout(self, decay: float = 0.0) -> int:
        """The rollout weights become the actor's (``decay`` 0: a copy, in memory) or, for
        ``0 < decay < 1``, the moving average ``decay · rollout + (1 − decay) · actor`` of
        their floating tensors (an old policy that lags the actor: the forward-process flow
        methods); returns the new version."""
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay: expected 0 <= decay < 1, got {decay}")
        previous = None
        if decay > 0:
            previous = {n: t.detach().clone() for n, t in self._owned_rollout().items()}
        self._copy_to_rollout()
        if previous is not None:
            with torch.no_grad():
                for name, tensor in self._owned_rollout().items():
                    if tensor.is_floating_point():
                        tensor.lerp_(previous[name].to(tensor.device), decay)
            self.rollout_lags = True
        self.version += 1
        return self.version

    def rollout_state(self) -> dict[str, torch.Tensor] | None:
        """The rollout weights' own tensors when they lag the actor (checkpoints keep them),
        else None (they are the actor's)."""
        if not self.rollout_lags:
            return None
        return {n: t.detach().to("cpu", copy=True) for n, t in self._owned_rollout().items()}

    def restore(self, version: int, rollout: dict[str, torch.Tensor] | None = None) -> None:
        """After a resume: the rollout weights are the (restored) actor's, or the saved
        ``rollout`` tensors (:meth:`rollout_state`) when they lagged, at ``version``."""
        self._copy_to_rollout()
        if rollout is not None:
            owned = self._owned_rollout()
            if set(owned) != set(rollout):
                raise ValueError(
                    "rollout: the checkpoint's rollout weights do not match this model "
                    f"({sorted(set(owned) ^ set(rollout))[:3]} differ)"
                )
            with torch.no_grad():
                for name, tensor in owned.items():
                    tensor.copy_(rollout[name].to(tensor.device, tensor.dtype))
            self.rollout_lags = True
        self.version = version

    def take_snapshot(self) -> nn.Module:
        """The old policy for this step: the actor's current weights, frozen."""
        if self.parallel is not None:
            if self._snapshot is None:  # sharded like the actor, so shards copy locally
                self._snapshot = _freeze(self.parallel.sharded_copy(self.rollout, "actor"))
            self.parallel.copy_shards(self._snapshot, self.actor)
        elif self._snapshot is None:
            self._snapshot = frozen_copy(self.actor, self.offload_device)
        else:
            copy_weights(self._snapshot, self.actor)
        self.snapshot_version = self.version
        return self._snapshot

    @property
    def snapshot(self) -> nn.Module:
        if self._snapshot is None:
            raise RuntimeError("snapshot: take_snapshot() has not been called this step")
        return self._snapshot

    @contextlib.contextmanager
    def on_compute(self, model: nn.Module) -> Iterator[nn.Module]:
        """The role ``model`` ready to score on the compute device: an offloaded one is moved
        there for the block (what it shares with the actor stays put); the LoRA reference is
        the actor with its adapter off, in eval mode (restored after the block)."""
        if isinstance(model, LoraReference):
            with model.active() as base:
                yield base
            return
        if self.offload_device is None or not isinstance(model, nn.Module):
            yield model
            return
        keep = shared_tensors(self.actor)
        _move(model, self.compute_device, keep)
        try:
            yield model
        finally:
            _move(model, self.offload_device, keep)

    def check_trace_version(self, trace_version: int, *, allow_off_policy: bool = False) -> None:
        if trace_version != self.version and not allow_off_policy:
            raise StaleTraceError(
                f"weights_version: the trace was sampled with rollout weights v{trace_version}, "
                f"the learner is at v{self.version}; sample fresh rollouts or set "
                "allow_off_policy: true"
            )
