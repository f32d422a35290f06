"""The kernel table: every numeric step a sampler takes and a learner replays, by name.

An *operation* (``"token_sample_step"``, ``"token_logprobs"``, ...) has one reference
implementation and any number of alternatives, each under a stable id. Samplers stamp the ids
they used into the trace; replay looks each one up by that id and refuses, naming it, when it
is unavailable (docs/pitfalls.md, "Implicit kernel pinning").

Token operations (docs/math.md §1.2–1.3). ``logits`` are float32 ``[..., V]`` with the MASK logit
already at -inf. The *scoring temperature* is ``T`` for ``T > 0`` and 1 for greedy (``T = 0``)
decoding, so a greedy trace still has finite behaviour log-probs.

Flow operations (docs/math.md §5): ``flow_ode_step`` and ``flow_sde_step`` (the SDE step with its
log-prob, variants ``flow_grpo`` / ``constant`` / ``cps``), in the section at the end.
"""

from __future__ import annotations

import math
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

    def implementations(self, op: str) -> list[Kernel]:
        """Every registered kernel of ``op``, the reference first."""
        found = [k for k in self._by_id.values() if k.op == op]
        return sorted(found, key=lambda k: not k.reference)


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
    ``"neg_entropy"`` Σ p log p — all under the scoring temperature — or ``"left_to_right"``
    0 everywhere (ties go to the lowest position, so slots commit in order: an order that does
    not depend on the weights, so a trace's action is exactly its token).
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
    elif confidence == "left_to_right":
        conf = torch.zeros_like(logprob)
    else:
        raise ValueError(
            "confidence: expected 'probability', 'margin', 'neg_entropy' or 'left_to_right', "
            f"got {confidence!r}"
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


# ---------------------------------------------------------------------------------------------
# Flow-matching steps (docs/math.md §5)
# ---------------------------------------------------------------------------------------------
#
# Convention: x_σ = (1 − σ) x0 + σ ε, velocity v = ε − x0, so x̂0 = x − σ v and
# ε̂ = x + (1 − σ) v. A step goes from σ to σ_next < σ, Δt = σ_next − σ < 0. Everything is
# computed in float32 (inputs are upcast exactly); ``sigma`` / ``sigma_next`` are python floats
# or per-row float tensors ``[B]`` (a float equals the float32 tensor of its value).
#
# ODE (serving):  x' = x + Δt v.
#
# SDE with log-prob (rollout): x' = μ + s ε with ε ~ N(0, I), per variant
#
# * ``"flow_grpo"``: std = a √(σ / (1 − σ̃)), σ̃ = σ_next when σ == 1 else σ — the first sigma
#   below 1 (σ_next of the σ = 1 step) replaces σ *in the denominator only*, so the first step
#   is finite and on the scale of its input (clamping σ to 0.9999 instead makes std ≈ 100 a and
#   multiplies the latent by ≈ −86: docs/pitfalls.md, "Clamped σ at the first SDE step"). The reverse-time SDE with diffusion
#   coefficient ``std`` discretised by Euler–Maruyama, using the score −ε̂/σ of x_σ given x̂0:
#       μ = x (1 + std² Δt / (2σ)) + v (1 + std² (1 − σ) / (2σ)) Δt,   s = std √(−Δt).
# * ``"constant"`` (DanceGRPO): the same μ with a constant std = η (``noise_level``).
# * ``"cps"`` (coefficient-preserving): with θ = aπ/2 (a ∈ (0, 1]),
#       μ = (1 − σ_next) x̂0 + σ_next cos θ · ε̂,   s = σ_next sin θ.
#   Derivation: the marginal at σ_next is (1 − σ_next) x0 + σ_next ε'. CPS keeps the clean
#   coefficient (1 − σ_next) exactly and splits the noise coefficient σ_next between the
#   predicted noise ε̂ (deterministic, weight σ_next cos θ) and fresh noise ε (weight
#   σ_next sin θ); with ε̂ and ε independent unit Gaussians the noise variance is
#   σ_next² (cos² θ + sin² θ) = σ_next², exactly the marginal's. (So cos θ · σ_next equals
#   √(σ_next² − s²), the form in the CPS paper.) To share one interface the returned ``std`` is
#   s / √(−Δt), so that s = std √(−Δt) holds for every variant. CPS needs σ_next > 0.
#
# The log-prob of x' (a given ``prev_sample`` on replay, else μ + s ε) is the diagonal Gaussian
#   log p(x' | x) = Σ_d [−(x'_d − μ_d)² / (2 s²) − log s − ½ log 2π]
# reduced per row by ``"mean"`` over the latent elements (Flow-GRPO; its PPO clip range 1e-4
# is calibrated to it; the default) or ``"sum"`` (the exact log-density).
# Returns ``(sample, log_prob, mean, std)``: float32 ``[B, *latent]``, ``[B]``, ``[B, *latent]``,
# ``[B]``. The log-prob is always computed from ``sample − mean`` so that the sampler's value
# equals a replay's (which passes ``prev_sample``) bitwise.

FLOW_SDE_VARIANTS = ("flow_grpo", "constant", "cps")
FLOW_LOGPROB_REDUCTIONS = ("mean", "sum")
_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


def _per_row_sigma(name: str, value, x: torch.Tensor) -> torch.Tensor:
    """``value`` (float, 0-d or ``[B]`` tensor) → float32 ``[B]`` on ``x``'s device."""
    sigma = torch.as_tensor(value, dtype=torch.float32, device=x.device)
    if sigma.dim() == 0:
        sigma = sigma.expand(x.shape[0])
    if sigma.dim() != 1 or sigma.shape[0] != x.shape[0]:
        raise ValueError(
            f"{name}: expected a float or a per-row tensor [B={x.shape[0]}], "
            f"got shape {tuple(sigma.shape)}"
        )
    return sigma


def _flow_inputs(x, v, sigma, sigma_next, *, sde: bool, variant="flow_grpo", noise_level=1.0):
    """Shared checks of the flow steps; returns float32 ``x, v, σ [B], σ_next [B]``."""
    if x.dim() < 2:
        raise ValueError(f"x: expected [B, *latent_shape], got shape {tuple(x.shape)}")
    if v.shape != x.shape:
        raise ValueError(f"v: expected the shape of x {tuple(x.shape)}, got {tuple(v.shape)}")
    sigma = _per_row_sigma("sigma", sigma, x)
    sigma_next = _per_row_sigma("sigma_next", sigma_next, x)
    ordered = (sigma_next < sigma) & (sigma <= 1) & (sigma_next >= 0)
    if not bool(ordered.all()):
        raise ValueError(
            "sigma, sigma_next: a step needs 0 <= sigma_next < sigma <= 1, got "
            f"sigma={sigma.tolist()} sigma_next={sigma_next.tolist()}"
        )
    if sde:
        if variant not in FLOW_SDE_VARIANTS:
            raise ValueError(f"variant: expected one of {FLOW_SDE_VARIANTS}, got {variant!r}")
        upper = 1.0 if variant == "cps" else math.inf
        if not (0.0 < noise_level <= upper):
            raise ValueError(
                f"noise_level: expected a value in (0, {upper}] for variant {variant!r}, "
                f"got {noise_level}"
            )
        if variant == "cps" and bool((sigma_next == 0).any()):
            raise ValueError(
                "sigma_next: the cps variant has zero noise at sigma_next = 0 (no density); "
                "make the last step an ODE step"
            )
    return x.float(), v.float(), sigma, sigma_next


def _check_sde_tensors(x: torch.Tensor, noise, prev_sample, reduction: str) -> None:
    if reduction not in FLOW_LOGPROB_REDUCTIONS:
        raise ValueError(f"reduction: expected one of {FLOW_LOGPROB_REDUCTIONS}, got {reduction!r}")
    for name, tensor in (("noise", noise), ("prev_sample", prev_sample)):
        if tensor is not None and tensor.shape != x.shape:
            raise ValueError(
                f"{name}: expected the shape of x {tuple(x.shape)}, got {tuple(tensor.shape)}"
            )


def flow_ode_step_reference(x, v, sigma, sigma_next) -> torch.Tensor:
    """``x + (σ_next − σ) v`` in float32; ``x, v [B, *latent]``."""
    x, v, sigma, sigma_next = _flow_inputs(x, v, sigma, sigma_next, sde=False)
    dt = (sigma_next - sigma).view(-1, *([1] * (x.dim() - 1)))
    return x + dt * v


def flow_ode_step_inplace(x, v, sigma, sigma_next) -> torch.Tensor:
    """Same values as the reference, bitwise: ``v · Δt`` into a fresh buffer, then ``+= x``
    (float multiplication and addition commute exactly)."""
    x, v, sigma, sigma_next = _flow_inputs(x, v, sigma, sigma_next, sde=False)
    dt = (sigma_next - sigma).view(-1, *([1] * (x.dim() - 1)))
    return v.mul(dt).add_(x)


def _reduce_logprob(log_prob: torch.Tensor, reduction: str) -> torch.Tensor:
    dims = tuple(range(1, log_prob.dim()))
    return log_prob.mean(dim=dims) if reduction == "mean" else log_prob.sum(dim=dims)


def flow_sde_step_reference(
    x: torch.Tensor,
    v: torch.Tensor,
    sigma,
    sigma_next,
    *,
    noise_level: float,
    noise: torch.Tensor | None = None,
    prev_sample: torch.Tensor | None = None,
    variant: str = "flow_grpo",
    reduction: str = "mean",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One SDE step with its log-prob (the formulas above); ``x, v [B, *latent]``.

    ``prev_sample`` given: the log-prob is that of ``prev_sample`` (replay) and it is returned
    as the sample. Else the sample is ``μ + s · noise`` (``noise`` standard normal
    ``[B, *latent]``, drawn from the global generator when None).
    """
    _check_sde_tensors(x, noise, prev_sample, reduction)
    x, v, sigma, sigma_next = _flow_inputs(
        x, v, sigma, sigma_next, sde=True, variant=variant, noise_level=noise_level
    )
    shape = (-1, *([1] * (x.dim() - 1)))
    sigma, sigma_next = sigma.view(shape), sigma_next.view(shape)
    dt = sigma_next - sigma
    if variant == "cps":
        theta = noise_level * math.pi / 2
        scale = sigma_next * math.sin(theta)
        std = scale / torch.sqrt(-dt)
        x0 = x - sigma * v
        eps = x + (1 - sigma) * v
        mean = (1 - sigma_next) * x0 + sigma_next * math.cos(theta) * eps
    else:
        if variant == "flow_grpo":
            denominator = torch.where(sigma == 1, sigma_next, sigma)
            std = noise_level * torch.sqrt(sigma / (1 - denominator))
        else:
            std = torch.full_like(sigma, noise_level)
        scale = std * torch.sqrt(-dt)
        mean = (
            x * (1 + std**2 * dt / (2 * sigma)) + v * (1 + std**2 * (1 - sigma) / (2 * sigma)) * dt
        )
    if prev_sample is not None:
        sample = prev_sample.float()
    else:
        sample = mean + scale * (torch.randn_like(x) if noise is None else noise.float())
    log_prob = -((sample - mean) ** 2) / (2 * scale**2) - torch.log(scale) - _HALF_LOG_2PI
    return sample, _reduce_logprob(log_prob, reduction), mean, std.reshape(-1)


def flow_sde_step_inplace(
    x: torch.Tensor,
    v: torch.Tensor,
    sigma,
    sigma_next,
    *,
    noise_level: float,
    noise: torch.Tensor | None = None,
    prev_sample: torch.Tensor | None = None,
    variant: str = "flow_grpo",
    reduction: str = "mean",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference on flat ``[B, D]`` views with in-place updates of fresh buffers (fewer
    temporaries of latent size). Every element sees the reference's float ops in the
    reference's order, so the results are bitwise equal (tested)."""
    _check_sde_tensors(x, noise, prev_sample, reduction)
    shape = x.shape
    x, v, sigma, sigma_next = _flow_inputs(
        x, v, sigma, sigma_next, sde=True, variant=variant, noise_level=noise_level
    )
    x, v = x.reshape(shape[0], -1), v.reshape(shape[0], -1)
    sigma, sigma_next = sigma[:, None], sigma_next[:, None]
    dt = sigma_next - sigma
    if variant == "cps":
        theta = noise_level * math.pi / 2
        scale = sigma_next * math.sin(theta)
        std = scale / torch.sqrt(-dt)
        x0 = v.mul(sigma).neg_().add_(x)  # x − σ v
        eps = v.mul(1 - sigma).add_(x)  # x + (1 − σ) v
        mean = x0.mul_(1 - sigma_next).add_(eps.mul_(sigma_next * math.cos(theta)))
    else:
        if variant == "flow_grpo":
            denominator = torch.where(sigma == 1, sigma_next, sigma)
            std = noise_level * torch.sqrt(sigma / (1 - denominator))
        else:
            std = torch.full_like(sigma, noise_level)
        scale = std * torch.sqrt(-dt)
        mean = x.mul(1 + std**2 * dt / (2 * sigma))
        mean.add_(v.mul(1 + std**2 * (1 - sigma) / (2 * sigma)).mul_(dt))
    if prev_sample is not None:
        sample = prev_sample.float().reshape(shape[0], -1)
    else:
        drawn = torch.randn_like(x) if noise is None else noise.float().reshape(shape[0], -1)
        sample = drawn.mul(scale).add_(mean)
    log_prob = sample.sub(mean).pow_(2).neg_().div_(2 * scale**2)
    log_prob.sub_(torch.log(scale)).sub_(_HALF_LOG_2PI)
    return (
        sample.view(shape),
        _reduce_logprob(log_prob, reduction),
        mean.view(shape),
        std.reshape(-1),
    )


KERNELS.register(
    "flow_ode_step", "flow_ode_step/reference@1", flow_ode_step_reference, reference=True
)
KERNELS.register("flow_ode_step", "flow_ode_step/inplace@1", flow_ode_step_inplace)
KERNELS.register(
    "flow_sde_step", "flow_sde_step/reference@1", flow_sde_step_reference, reference=True
)
KERNELS.register("flow_sde_step", "flow_sde_step/inplace@1", flow_sde_step_inplace)
