"""The forward-process flow methods (DiffusionNFT, AWM, DGPO): each loss and its gradient
against a hand derivation on fixed tensors, the timestep draws, the learner (micro-batch
invariance, AWM's ratio of exactly 1, the lagging old policy and its resume), and ODE
rollouts that are bitwise the served samples."""

from __future__ import annotations

import math

import pytest
import torch
from flow_toy import TinyVelocity, one_thread  # noqa: F401 (fixture)

from diffusion_rl.contracts import FlowForwardBatch
from diffusion_rl.objectives.forward_flow import (
    AWMConfig,
    AWMLoss,
    DGPOConfig,
    DGPOLoss,
    ForwardScores,
    NFTConfig,
    NFTLoss,
    draw_timesteps,
    old_policy_decay,
)
from diffusion_rl.rollout import Rollout
from diffusion_rl.sampling.flow import FlowSamplerConfig, sample_flow
from diffusion_rl.seeding import RowStreams
from diffusion_rl.train import OptimConfig, Trainer
from diffusion_rl.train.learner import PolicyLearner
from diffusion_rl.train.plans import ForwardFlowPlan, flow_plan
from diffusion_rl.train.roles import PolicyRoles

D = 6  # latent elements of the hand-computed batches


def fixed_batch(items=4, groups=None, seed=0, **extra) -> FlowForwardBatch:
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(items, 2, 3, generator=g)
    noise = torch.randn(items, 2, 3, generator=g)
    sigma = torch.tensor([0.9, 0.5, 0.3, 0.7][:items])
    s = sigma.view(-1, 1, 1)
    groups = torch.zeros(items, dtype=torch.long) if groups is None else groups
    return FlowForwardBatch(
        rows=torch.arange(items),
        groups=groups,
        slots=torch.zeros(items, dtype=torch.long),
        x0=x0,
        noise=noise,
        sigma=sigma,
        noisy=(1 - s) * x0 + s * noise,
        cond={"label": torch.zeros(items, dtype=torch.long)},
        advantages=torch.tensor([1.5, -0.5, 7.0, -2.0][:items]),
        **extra,
    )


def velocities(batch, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch.x0.shape, generator=g) for _ in range(3)]  # live, old, ref


# ------------------------------------------------------------------------------- NFT


def test_nft_loss_and_gradient_against_a_hand_derivation():
    live, old, ref = velocities(fixed_batch())
    batch = fixed_batch(old_velocity=old, ref_velocity=ref)
    config = NFTConfig(beta=0.7, kl_beta=0.01, adv_clip=5.0)
    v = live.clone().requires_grad_(True)
    out = NFTLoss(config)(ForwardScores(v), batch)
    (grad,) = torch.autograd.grad(out.primary.value, v)

    expected_loss, expected_grad = 0.0, torch.zeros_like(live)
    b, c, n = config.beta, config.adv_clip, len(batch)
    for i in range(n):
        a = max(-c, min(c, float(batch.advantages[i])))
        r = min(1.0, max(0.0, 0.5 + 0.5 * a / c))
        sigma = float(batch.sigma[i])
        x_t, x0 = batch.noisy[i].double(), batch.x0[i].double()
        vi, vo, vr = live[i].double(), old[i].double(), ref[i].double()
        xp = x_t - sigma * (b * vi + (1 - b) * vo)
        xn = x_t - sigma * ((1 + b) * vo - b * vi)
        wp, wn = (xp - x0).abs().mean(), (xn - x0).abs().mean()
        lp, ln = ((xp - x0) ** 2).mean() / wp, ((xn - x0) ** 2).mean() / wn
        kl = ((vi - vr) ** 2).mean()
        expected_loss += (c * (r * lp + (1 - r) * ln) / b + 0.01 * kl) / n
        # d/dv: x̂⁺ moves by −σβ, x̂⁻ by +σβ; the weights are constants
        d = (
            c
            / b
            * (r * 2 * (xp - x0) * (-sigma * b) / wp + (1 - r) * 2 * (xn - x0) * (sigma * b) / wn)
        )
        expected_grad[i] = ((d + 0.01 * 2 * (vi - vr)) / D / n).float()
    assert float(out.primary.value.detach()) == pytest.approx(float(expected_loss), rel=1e-5)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-7)


def test_nft_at_the_old_policy_fits_good_samples_and_pushes_bad_ones():
    """At vθ = v_old the NFT gradient is (2r − 1) × an x0-regression gradient: zero for an
    advantage of 0, opposite signs for A > 0 and A < 0."""
    batch = fixed_batch()
    live, _, _ = velocities(batch)
    for advantage, sign in ((0.0, 0), (2.0, 1), (-2.0, -1)):
        b = FlowForwardBatch(
            **{**batch.__dict__, "advantages": torch.full((4,), advantage), "old_velocity": live}
        )
        v = live.clone().requires_grad_(True)
        out = NFTLoss(NFTConfig(adaptive_weight=False))(ForwardScores(v), b)
        (grad,) = torch.autograd.grad(out.primary.value, v)
        regression = (b.noisy - b.sigma.view(-1, 1, 1) * live - b.x0) * (-b.sigma.view(-1, 1, 1))
        if sign == 0:
            assert float(grad.abs().max()) < 1e-7
        else:
            cosine = torch.nn.functional.cosine_similarity(grad.flatten(), regression.flatten(), 0)
            assert float(cosine) == pytest.approx(sign, abs=1e-5)


# ------------------------------------------------------------------------------- AWM


@pytest.mark.parametrize("weighting", ["uniform", "sigma", "ghuber"])
def test_awm_loss_and_gradient_against_a_hand_derivation(weighting):
    live, old, ref = velocities(fixed_batch())
    batch = fixed_batch(old_velocity=old, ref_velocity=ref)
    config = AWMConfig(weighting=weighting, huber_p=0.25, kl_beta=0.02, ema_beta=0.5)
    v = live.clone().requires_grad_(True)
    out = AWMLoss(config)(ForwardScores(v), batch)
    (grad,) = torch.autograd.grad(out.primary.value, v)
    expected_loss, expected_grad, n = 0.0, torch.zeros_like(live), len(batch)
    for i in range(n):
        a = max(-5.0, min(5.0, float(batch.advantages[i]))) / 5.0
        sigma = float(batch.sigma[i])
        u = batch.noise[i].double() - batch.x0[i].double()
        vi = live[i].double()
        e = float(((vi - u) ** 2).mean())
        if weighting == "uniform":
            ell, d_ell = -e, -1.0
        elif weighting == "sigma":
            ell, d_ell = -sigma * e, -sigma
        else:
            ell = -((e + 1e-10) ** 0.25 - 1e-10**0.25) * sigma / 0.25
            d_ell = -sigma * (e + 1e-10) ** -0.75
        de = 2 * (vi - u) / D
        kl = ((vi - ref[i].double()) ** 2).mean()
        drift = ((vi - old[i].double()) ** 2).mean()
        expected_loss += (-a + 0.02 * kl + 0.5 * drift) / n  # ratio 1: −Ã ρ = −Ã
        g = -a * d_ell * de + 0.02 * 2 * (vi - ref[i]) / D + 0.5 * 2 * (vi - old[i]) / D
        expected_grad[i] = (g / n).float()
        assert ell < 0
    assert float(out.primary.value.detach()) == pytest.approx(float(expected_loss), rel=1e-5)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-7)
    assert out.aux_metrics["awm/ratio_min"].value == 1.0 == out.aux_metrics["awm/ratio_max"].value


def test_awm_clips_the_ratio_against_the_snapshot():
    live, snapshot, _ = velocities(fixed_batch())
    batch = fixed_batch(snapshot_velocity=snapshot)
    config = AWMConfig(weighting="uniform", num_iterations=2, ema_beta=0, kl_beta=0, clip_range=0.1)
    v = live.clone().requires_grad_(True)
    out = AWMLoss(config)(ForwardScores(v), batch)
    (grad,) = torch.autograd.grad(out.primary.value, v)
    loss = AWMLoss(config)
    ratio = torch.exp(loss.surrogate(live, batch) - loss.surrogate(snapshot, batch))
    a = batch.advantages.clamp(-5, 5) / 5
    clipped = ((a > 0) & (ratio > 1.1)) | ((a < 0) & (ratio < 0.9))
    assert bool(clipped.any()) and not bool(clipped.all())
    zero = grad.flatten(1).abs().amax(1) == 0
    assert zero.tolist() == clipped.tolist()


# ------------------------------------------------------------------------------ DGPO


def test_dgpo_gradient_is_the_group_bradley_terry_gradient():
    """Two groups of two items: the loss gradient equals G / (β N) × the gradient of
    Σ_g −log σ(−S_g), S_g = β Σ_{i∈g} A_i (e_θ,i − e_ref,i) / G (no item frozen)."""
    groups = torch.tensor([0, 0, 1, 1])
    batch = fixed_batch(groups=groups)
    live, _, ref = velocities(batch)
    batch = fixed_batch(groups=groups, old_velocity=live, ref_velocity=ref)  # ratio 1: unfrozen
    config = DGPOConfig(dpo_beta=3.0, kl_beta=0.0)
    v = live.clone().requires_grad_(True)
    out = DGPOLoss(config)(ForwardScores(v), batch)
    (grad,) = torch.autograd.grad(out.primary.value, v)

    w = live.clone().double().requires_grad_(True)
    u = batch.noise.double() - batch.x0.double()
    e = ((w - u) ** 2).flatten(1).mean(1)
    e_ref = ((ref.double() - u) ** 2).flatten(1).mean(1)
    a = batch.advantages.double()
    bt = 0.0
    for g in (0, 1):
        member = groups == g
        s = 3.0 * (a[member] * (e[member] - e_ref[member])).sum() / 2
        bt = bt - torch.nn.functional.logsigmoid(-s)
    (expected,) = torch.autograd.grad(bt, w)
    torch.testing.assert_close(grad.double(), expected * 2 / (3.0 * 4), rtol=1e-5, atol=1e-9)
    assert out.aux_metrics["dgpo/frozen_frac"].value == 0.0


def test_dgpo_freezes_items_past_the_clip_on_their_side():
    batch = fixed_batch()
    live, _, ref = velocities(batch)
    u = batch.noise - batch.x0
    old = live.clone()
    old[0] = live[0] + 0.5 * (u[0] - live[0])  # old error below live: ratio < 1 for A > 0
    old[1] = u[1] + 0.01  # old error ~0: ratio ≪ 1 on an A < 0 item → frozen
    batch = fixed_batch(old_velocity=old, ref_velocity=ref)
    v = live.clone().requires_grad_(True)
    out = DGPOLoss(DGPOConfig(kl_beta=0.0))(ForwardScores(v), batch)
    (grad,) = torch.autograd.grad(out.primary.value, v)
    assert float(grad[1].abs().max()) == 0.0  # frozen
    assert float(grad[0].abs().max()) > 0  # A > 0 with ratio < 1: not frozen


# ------------------------------------------------------------------------- timesteps


def test_timestep_draws_follow_the_documented_recipe():
    grid = torch.tensor([1.0, 0.9, 0.7, 0.5, 0.3, 0.1])
    keys = torch.tensor([11, 12])
    sigma = draw_timesteps(RowStreams(keys), grid, NFTConfig(timesteps_per_sample=3))
    for row, key in enumerate(keys.tolist()):
        index = torch.randperm(6, generator=torch.Generator().manual_seed(key))[:3]
        assert torch.equal(sigma[row], grid[index])
    stratified = draw_timesteps(
        RowStreams(keys), grid, AWMConfig(timesteps_per_sample=2, timestep_range=0.5)
    )
    for row, key in enumerate(keys.tolist()):
        u = torch.rand(2, generator=torch.Generator().manual_seed(key))
        # reach 3: strata [0, 1) and [1, 3)
        assert stratified[row].tolist() == [grid[0].item(), grid[1 + int(u[1] * 2)].item()]
    uniform = draw_timesteps(RowStreams(keys), grid, NFTConfig(sigma_sampling="uniform"))
    assert bool(((uniform > 0) & (uniform <= 1)).all())
    with pytest.raises(ValueError, match="timesteps_per_sample"):
        draw_timesteps(RowStreams(keys), grid, NFTConfig(timesteps_per_sample=7))
    assert old_policy_decay(NFTConfig(), 100) == pytest.approx(0.1)
    assert old_policy_decay(NFTConfig(), 10_000) == 0.5


# --------------------------------------------------------------------------- learner

PROMPTS = ["1", "1", "1", "1", "6", "6", "6", "6"]


def ode_rollout(model, version=0):
    config = FlowSamplerConfig(num_steps=6, guidance_scale=1.0, mode="ode", shift=1.0)
    sample = sample_flow(
        model, PROMPTS, config, seeds=range(8), group_size=4, capture=True, weights_version=version
    )
    return sample.trace, config


def as_rollout(trace):
    rewards = trace.latents[:, -1].float().mean((1, 2, 3))
    advantages = (rewards - rewards.view(2, 4).mean(1).repeat_interleave(4)) * 10
    return Rollout(trace, trace.latents[:, -1].float(), list(trace.prompts), rewards, advantages, 4)


def make_learner(config, micro_batch_size=None, seed=0):
    model = TinyVelocity()
    roles = PolicyRoles(model, reference=config.uses_reference)

    def factory(actor, loss_fn):
        return Trainer(actor, loss_fn, OptimConfig(lr=1e-3, grad_clip=None))

    plan = flow_plan(config, reduction="mean", seed=seed)
    assert isinstance(plan, ForwardFlowPlan)
    return PolicyLearner(roles, plan, factory, micro_batch_size=micro_batch_size, seed=seed)


CONFIGS = {
    "nft": NFTConfig(kl_beta=0.01, old_decay_rate=0.2),
    "awm": AWMConfig(timesteps_per_sample=3, kl_beta=0.01, old_decay_rate=0.2),
    "dgpo": DGPOConfig(kl_beta=0.01, old_decay_rate=0.2),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_micro_batch_sizes_give_the_same_update(name):
    weights = []
    for size in (None, 1, 2):
        learner = make_learner(CONFIGS[name], micro_batch_size=size)
        for _ in range(2):
            trace, _ = ode_rollout(learner.roles.rollout, learner.roles.version)
            metrics = learner.step(as_rollout(trace))
        weights.append(torch.cat([p.detach().flatten() for p in learner.roles.actor.parameters()]))
        expected = {None: 1, 1: 8, 2: 4}[size] if name != "dgpo" else {None: 1, 1: 2, 2: 2}[size]
        assert metrics["learner/micro_batches"] == expected
    assert float((weights[0] - weights[1]).abs().max()) <= 1e-6
    assert float((weights[0] - weights[2]).abs().max()) <= 1e-6


def test_awm_ratio_is_exactly_one_before_the_update_for_every_mu():
    for iterations in (1, 2):
        learner = make_learner(AWMConfig(timesteps_per_sample=3, num_iterations=iterations))
        trace, _ = ode_rollout(learner.roles.rollout)
        metrics = learner.step(as_rollout(trace))
        assert metrics["awm/ratio_min@iter0"] == 1.0 == metrics["awm/ratio_max@iter0"]
        assert metrics["awm/kl@iter0"] == 0.0 and metrics["awm/old_deviation@iter0"] == 0.0
        if iterations == 2:
            assert metrics["awm/ratio_min@iter1"] != 1.0 or metrics["awm/ratio_max@iter1"] != 1.0


def test_the_old_policy_lags_the_actor_as_a_moving_average():
    """After step n the rollout weights are d_n · old + (1 − d_n) · θ_n, d_n = min(rate n, max);
    at the first step the old policy is the actor (its velocity deviation is exactly 0)."""
    config = NFTConfig(old_decay_rate=0.3, old_decay_max=0.5)
    learner = make_learner(config)
    roles = learner.roles
    old = [p.detach().clone() for p in roles.rollout.parameters()]
    for step in (1, 2, 3):
        trace, _ = ode_rollout(roles.rollout, roles.version)
        metrics = learner.step(as_rollout(trace))
        if step == 1:
            assert metrics["nft/old_deviation"] == 0.0
        decay = min(0.3 * step, 0.5)
        assert metrics["learner/old_policy_decay"] == pytest.approx(decay)
        for o, p, q in zip(old, roles.rollout.parameters(), roles.actor.parameters()):
            torch.testing.assert_close(p, decay * o + (1 - decay) * q, rtol=0, atol=1e-6)
        old = [p.detach().clone() for p in roles.rollout.parameters()]
    assert roles.version == 3 and roles.rollout_lags
    state = roles.rollout_state()
    fresh = PolicyRoles(TinyVelocity(), reference=False)
    fresh.actor.load_state_dict(roles.actor.state_dict())
    fresh.restore(3, state)
    for p, q in zip(fresh.rollout.parameters(), roles.rollout.parameters()):
        assert torch.equal(p, q)


def test_ode_rollout_samples_are_the_served_samples_bitwise():
    """A forward-process rollout is the serving ODE sampler with capture on: its final latents
    and images equal a plain serving call with the same seeds, bitwise."""
    model = TinyVelocity()
    trace, config = ode_rollout(model)
    served = sample_flow(model, PROMPTS, config, seeds=range(8))
    assert torch.equal(trace.latents[:, -1], served.latents)
    assert not bool(trace.sde_steps.any())
    assert math.isfinite(float(served.images.sum()))
