"""Flow-matching step kernels (MATH.md §5) against independent float64 formulas, torch's
Normal, the σ = 1 first step, and bitwise equality of every alternative with its reference."""

import math

import pytest
import torch

from diffusion_rl.kernels import KERNELS, flow_ode_step_reference, flow_sde_step_reference

VARIANTS = ["flow_grpo", "constant", "cps"]
REDUCTIONS = ["mean", "sum"]
NOISE_LEVEL = {"flow_grpo": 0.7, "constant": 0.3, "cps": 0.8}
# row 0 is the σ = 1 first step of a shift-3, 10-step schedule
SIGMA = torch.tensor([1.0, 0.8, 0.5, 0.2])
SIGMA_NEXT = torch.tensor([0.9642857, 0.7, 0.3, 0.1])


def tensors(seed=0, batch=4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, 8, 8, generator=g)
    v = torch.randn(batch, 3, 8, 8, generator=g)
    noise = torch.randn(batch, 3, 8, 8, generator=g)
    return x, v, noise


def independent_step(x, v, sigma, sigma_next, a, variant, noise):
    """MATH.md §5 in float64, written from the SDE view: μ = x + v Δt − ½ g² ∇log p Δt with
    the score ∇log p = −ε̂/σ, ε̂ = x + (1 − σ) v; CPS from its √(σ_next² − s²) form."""
    x, v, noise = x.double(), v.double(), noise.double()
    shape = (-1, 1, 1, 1)
    s, sn = sigma.double().view(shape), sigma_next.double().view(shape)
    dt = sn - s
    eps_hat = x + (1 - s) * v
    if variant == "cps":
        scale = sn * math.sin(a * math.pi / 2)
        g = scale / torch.sqrt(-dt)
        mean = (1 - sn) * (x - s * v) + torch.sqrt(sn**2 - scale**2) * eps_hat
    else:
        if variant == "flow_grpo":
            tilde = torch.where(s == 1, sn, s)  # first sigma below 1, denominator only
            g = a * torch.sqrt(s / (1 - tilde))
        else:
            g = torch.full_like(s, a)
        score = -eps_hat / s
        mean = x + v * dt - 0.5 * g**2 * score * dt
        scale = g * torch.sqrt(-dt)
    sample = mean + scale * noise
    per_element = (
        -0.5 * ((sample - mean) / scale) ** 2 - torch.log(scale) - 0.5 * math.log(2 * math.pi)
    )
    return sample, per_element, mean, g.reshape(-1)


def reduce(per_element, reduction):
    flat = per_element.flatten(1)
    return flat.mean(1) if reduction == "mean" else flat.sum(1)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_sde_step_equals_independent_formula(variant, reduction):
    x, v, noise = tensors()
    a = NOISE_LEVEL[variant]
    sample, logp, mean, std = flow_sde_step_reference(
        x, v, SIGMA, SIGMA_NEXT, noise_level=a, noise=noise, variant=variant, reduction=reduction
    )
    ref_sample, ref_elem, ref_mean, ref_std = independent_step(
        x, v, SIGMA, SIGMA_NEXT, a, variant, noise
    )
    assert sample.dtype == logp.dtype == mean.dtype == std.dtype == torch.float32
    assert logp.shape == std.shape == (4,)
    torch.testing.assert_close(mean.double(), ref_mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sample.double(), ref_sample, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(std.double(), ref_std, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logp.double(), reduce(ref_elem, reduction), rtol=1e-5, atol=1e-4)
    # per-row tensors and python floats give the same numbers, bitwise
    for row in range(4):
        one = flow_sde_step_reference(
            x[row : row + 1],
            v[row : row + 1],
            float(SIGMA[row]),
            float(SIGMA_NEXT[row]),
            noise_level=a,
            noise=noise[row : row + 1],
            variant=variant,
            reduction=reduction,
        )
        assert torch.equal(one[0][0], sample[row]) and torch.equal(one[1][0], logp[row])


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_logprob_equals_torch_normal_and_replay_of_the_sample(variant, reduction):
    x, v, noise = tensors(1)
    a = NOISE_LEVEL[variant]
    sample, logp, mean, std = flow_sde_step_reference(
        x, v, SIGMA, SIGMA_NEXT, noise_level=a, noise=noise, variant=variant, reduction=reduction
    )
    scale = (std * torch.sqrt(SIGMA - SIGMA_NEXT)).view(-1, 1, 1, 1)
    expected = reduce(torch.distributions.Normal(mean, scale).log_prob(sample), reduction)
    torch.testing.assert_close(logp, expected, rtol=1e-5, atol=1e-4)
    # replay: the log-prob of a given sample is the sampler's value, bitwise
    replay = flow_sde_step_reference(
        x,
        v,
        SIGMA,
        SIGMA_NEXT,
        noise_level=a,
        prev_sample=sample,
        variant=variant,
        reduction=reduction,
    )
    assert torch.equal(replay[1], logp) and torch.equal(replay[2], mean)
    # a different sample is less likely under the same step
    other = flow_sde_step_reference(
        x,
        v,
        SIGMA,
        SIGMA_NEXT,
        noise_level=a,
        prev_sample=sample + scale,
        variant=variant,
        reduction=reduction,
    )
    assert bool((other[1] < logp).all())


def first_step_inputs():
    g = torch.Generator().manual_seed(5)
    eps = torch.randn(8, 3, 8, 8, generator=g)
    x0 = 0.5 * torch.randn(8, 3, 8, 8, generator=g)
    return eps, eps - x0, torch.randn(8, 3, 8, 8, generator=g)  # x_1 = ε, v = ε − x0


def test_first_step_is_finite_and_on_the_input_scale():
    x, v, noise = first_step_inputs()
    sigma_next = 0.9642857  # 10 steps, shift 3: σ_1 = 3·0.9 / (1 + 2·0.9)
    sample, logp, mean, std = flow_sde_step_reference(
        x, v, 1.0, sigma_next, noise_level=0.7, noise=noise
    )
    assert bool(torch.isfinite(sample).all() and torch.isfinite(logp).all())
    # std = 0.7 √(1 / (1 − σ_1)) = 3.74 and s = std √(1 − σ_1) = 0.7 exactly
    assert float(std[0]) == pytest.approx(0.7 / math.sqrt(1 - sigma_next), rel=1e-5)
    ratio = float(sample.std() / x.std())
    assert 0.5 < ratio < 2.0


def test_clamping_sigma_instead_blows_the_first_step_up():
    """What the σ̃ substitution avoids: σ clamped to 0.9999 makes std = 70 and the x
    coefficient 1 + std² Δt / (2σ) ≈ −85 (PITFALLS.md)."""
    x, v, noise = first_step_inputs()
    sample, _, mean, std = flow_sde_step_reference(
        x, v, 0.9999, 0.9642857, noise_level=0.7, noise=noise
    )
    assert float(std[0]) == pytest.approx(70.0, rel=1e-3)
    assert float(sample.std() / x.std()) > 20.0
    coefficient = 1 + 70.0**2 * (0.9642857 - 0.9999) / (2 * 0.9999)
    assert coefficient < -80


def test_ode_step_and_its_alternative():
    x, v, _ = tensors(2)
    expected = x.double() + (SIGMA_NEXT - SIGMA).double().view(-1, 1, 1, 1) * v.double()
    out = flow_ode_step_reference(x, v, SIGMA, SIGMA_NEXT)
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-6)
    for kernel in KERNELS.implementations("flow_ode_step")[1:]:
        assert torch.equal(kernel.fn(x, v, SIGMA, SIGMA_NEXT), out), kernel.kernel_id


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_every_sde_alternative_equals_the_reference_bitwise(variant, reduction):
    kernels = KERNELS.implementations("flow_sde_step")
    assert kernels[0].reference and len(kernels) >= 2
    x, v, noise = tensors(3)
    a = NOISE_LEVEL[variant]
    kwargs = dict(noise_level=a, variant=variant, reduction=reduction)
    ref = kernels[0].fn(x, v, SIGMA, SIGMA_NEXT, noise=noise, **kwargs)
    ref_replay = kernels[0].fn(x, v, SIGMA, SIGMA_NEXT, prev_sample=ref[0] + 0.01, **kwargs)
    for kernel in kernels[1:]:
        out = kernel.fn(x, v, SIGMA, SIGMA_NEXT, noise=noise, **kwargs)
        replay = kernel.fn(x, v, SIGMA, SIGMA_NEXT, prev_sample=ref[0] + 0.01, **kwargs)
        for name, a_, b_ in zip(("sample", "log_prob", "mean", "std"), out, ref):
            assert a_.shape == b_.shape and torch.equal(a_, b_), (kernel.kernel_id, name)
        for a_, b_ in zip(replay, ref_replay):
            assert torch.equal(a_, b_), kernel.kernel_id


def test_bad_inputs_name_the_field():
    x, v, noise = tensors()
    step = flow_sde_step_reference
    with pytest.raises(ValueError, match="variant"):
        step(x, v, SIGMA, SIGMA_NEXT, noise_level=0.7, variant="ddim")
    with pytest.raises(ValueError, match="reduction"):
        step(x, v, SIGMA, SIGMA_NEXT, noise_level=0.7, reduction="max")
    with pytest.raises(ValueError, match="noise_level"):
        step(x, v, SIGMA, SIGMA_NEXT, noise_level=1.5, variant="cps")
    with pytest.raises(ValueError, match="noise_level"):
        step(x, v, SIGMA, SIGMA_NEXT, noise_level=0.0)
    with pytest.raises(ValueError, match="sigma_next < sigma"):
        step(x, v, SIGMA_NEXT, SIGMA, noise_level=0.7)
    with pytest.raises(ValueError, match="cps variant"):
        step(x, v, 0.2, 0.0, noise_level=0.7, variant="cps")
    with pytest.raises(ValueError, match="noise: expected the shape"):
        step(x, v, SIGMA, SIGMA_NEXT, noise_level=0.7, noise=noise[:, :1])
    with pytest.raises(ValueError, match=r"sigma: expected a float or a per-row tensor \[B=4\]"):
        step(x, v, SIGMA[:2], SIGMA_NEXT, noise_level=0.7)
    # σ_next = 0 is a valid (if noisy) flow_grpo step: finite
    assert bool(torch.isfinite(step(x, v, 0.2, 0.0, noise_level=0.7, noise=noise)[1]).all())
