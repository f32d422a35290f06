"""The kernel table: every numeric step a sampler takes and a learner replays, by name.

An *operation* (``"token_sample_step"``, ``"token_logprobs"``, ...) has one reference
implementation and any number of alternatives, each under a stable id. Samplers stamp the ids
they used into the trace; replay looks each one up by that id and refuses, naming it, when it
is unavailable (PITFALLS.md: implicit pinning is checked by nothing).

Token operations (MATH.md §1.2–1.3). ``logits`` are float32 ``[..., V]`` with the MASK logit
already at -inf. The *scoring temperature* is ``T`` for ``T > 0`` and 1 for greedy (``T = 0``)
decoding, so a greedy trace still has finite behaviour log-probs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


class KernelUnavailableError(LookupError):
    """A trace names a kernel id this installation does not have."""


@dataclass(frozen=True)
class Kernel:
    op: str
    kernel_id: str
    fn: Callable
    devices: tuple[str, ...] = ("cpu", "cuda")
    reference: bool = False


@dataclass
class KernelTable:
    """Operation name → implementations; ``resolve`` picks one, ``get`` finds one by id."""

    _by_id: dict[str, Kernel] = field(default_factory=dict)

    def register(
        self, op: str, kernel_id: str, fn: Callable, *, devices=("cpu", "cuda"), reference=False
    ) -> Kernel:
        if kernel_id in self._by_id:
            raise ValueError(f"kernel_id {kernel_id!r} is already registered")
        if reference and any(k.reference for k in self._by_id.values() if k.op == op):
            raise ValueError(f"operation {op!r} already has a reference implementation")
        kernel = Kernel(op, kernel_id, fn, tuple(devices), reference)
        self._by_id[kernel_id] = kernel
        return kernel

    def get(self, kernel_id: str) -> Kernel:
        try:
            return self._by_id[kernel_id]
        except KeyError:
            known = sorted(self._by_id)
            raise KernelUnavailableError(
                f"kernel {kernel_id!r} is not available in this installation (known: {known}); "
                "replay needs the exact kernel the sampler used"
            ) from None

    def resolve(
        self, op: str, device: str | torch.device = "cpu", prefer: str | None = None
    ) -> Kernel:
        """The preferred id if given, else the reference implementation of ``op``."""
        if prefer is not None:
            kernel = self.get(prefer)
            if kernel.op != op:
                raise ValueError(f"kernel {prefer!r} implements {kernel.op!r}, not {op!r}")
            return kernel
        device_type = torch.device(device).type
        for kernel in self._by_id.values():
            if kernel.op == op and kernel.reference and device_type in kernel.devices:
                return kernel
        raise KernelUnavailableError(f"no reference kernel for operation {op!r} on {device_type}")

    def ops(self) -> list[str]:
        return sorted({k.op for k in self._by_id.values()})


KERNELS = KernelTable()


def scoring_temperature(temperature: float) -> float:
    return temperature if temperature > 0 else 1.0


def token_logprobs_reference(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> torch.Tensor:
    """``log softmax(logits / T)[target]`` in float32; ``logits [..., V]``, ``targets [...]``."""
    logp = torch.log_softmax(logits.float() / scoring_temperature(temperature), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def token_sample_step_reference(
    logits: torch.Tensor,
    temperature: float,
    gumbel: torch.Tensor | None,
    confidence: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One proposal per slot.

    ``logits [B, K, V]`` float32; ``gumbel [B, K, V]`` float64 standard Gumbel noise (required
    for ``T > 0``, exact temperature sampling by Gumbel-max in float64). Returns
    ``proposal`` long ``[B, K]``, behaviour ``logprob`` float32 ``[B, K]`` (same formula as
    :func:`token_logprobs_reference`) and ``confidence`` float32 ``[B, K]``:
    ``"probability"`` p(proposal), ``"margin"`` top-1 minus top-2 probability,
    ``"neg_entropy"`` Σ p log p — all under the scoring temperature.
    """
    if temperature > 0:
        if gumbel is None:
            raise ValueError("gumbel: noise is required for temperature > 0")
        proposal = (logits.double() / temperature + gumbel).argmax(-1)
    else:
        proposal = logits.argmax(-1)
    logp_all = torch.log_softmax(logits.float() / scoring_temperature(temperature), dim=-1)
    logprob = logp_all.gather(-1, proposal.unsqueeze(-1)).squeeze(-1)
    probs = logp_all.exp()
    if confidence == "probability":
        conf = logprob.exp()
    elif confidence == "margin":
        top2 = (
            probs.topk(2, dim=-1).values
            if probs.shape[-1] > 1
            else torch.cat([probs, torch.zeros_like(probs)], -1)
        )
        conf = top2[..., 0] - top2[..., 1]
    elif confidence == "neg_entropy":
        conf = torch.where(probs > 0, probs * logp_all, torch.zeros_like(probs)).sum(-1)
    else:
        raise ValueError(
            f"confidence: expected 'probability', 'margin' or 'neg_entropy', got {confidence!r}"
        )
    return proposal, logprob, conf


KERNELS.register(
    "token_sample_step",
    "token_sample_step/reference@1",
    token_sample_step_reference,
    reference=True,
)
KERNELS.register(
    "token_logprobs", "token_logprobs/reference@1", token_logprobs_reference, reference=True
)
