"""The flow sampler: schedule, batched CFG, ODE/SDE steps and windows, per-row seeds, shared
group noise, forward groups, kernel preferences and the trace it captures."""

import pytest
import torch
from flow_toy import TinyVelocity, one_thread  # noqa: F401 (fixture)
from pydantic import ValidationError

from diffusion_rl.guidance import guided_velocity
from diffusion_rl.kernels import KERNELS, KernelUnavailableError
from diffusion_rl.sampling.flow import FlowSamplerConfig, flow_sigmas, sample_flow, step_noise
from diffusion_rl.trace import FlowTrace

PROMPTS = ["3", "3", "7", "7"]


def config(**overrides):
    base = dict(num_steps=6, shift=3.0, guidance_scale=3.0, mode="sde", noise_level=0.7)
    return FlowSamplerConfig(**{**base, **overrides})


def test_shifted_schedule():
    sigmas = flow_sigmas(10, 3.0)
    assert sigmas.dtype == torch.float32 and sigmas.shape == (11,)
    assert float(sigmas[0]) == 1.0 and float(sigmas[-1]) == 0.0
    t = torch.linspace(1, 0, 11, dtype=torch.float64)
    torch.testing.assert_close(sigmas.double(), 3 * t / (1 + 2 * t), rtol=1e-7, atol=1e-7)
    assert float(sigmas[1]) == pytest.approx(2.7 / 2.8)
    assert bool((sigmas[1:] < sigmas[:-1]).all())
    torch.testing.assert_close(flow_sigmas(4, 1.0), torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]))


@pytest.mark.parametrize(("steps", "shift"), [(1, 3.0), (4, 1.0), (10, 3.0), (28, 1.7)])
def test_flux_grid_is_its_closed_form(steps, shift):
    """The default: linspace(1, 1/N, N) shifted, then a final 0 (the FLUX-pipeline form)."""
    sigma = torch.linspace(1.0, 1.0 / steps, steps, dtype=torch.float64)
    expected = torch.cat([shift * sigma / (1 + (shift - 1) * sigma), torch.zeros(1)]).float()
    torch.testing.assert_close(flow_sigmas(steps, shift), expected, rtol=0, atol=1e-7)
    assert torch.equal(flow_sigmas(steps, shift, "flux"), flow_sigmas(steps, shift))


@pytest.mark.parametrize(("steps", "shift"), [(1, 3.0), (4, 1.0), (10, 3.0), (28, 3.0), (40, 1.7)])
def test_sd3_grid_is_diffusers_default_schedule(steps, shift):
    diffusers = pytest.importorskip("diffusers")
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=shift)  # T = 1000
    scheduler.set_timesteps(steps)  # as StableDiffusion3Pipeline calls it
    sigmas = flow_sigmas(steps, shift, "sd3")
    assert sigmas.dtype == torch.float32 and sigmas.shape == (steps + 1,)
    assert torch.equal(sigmas, scheduler.sigmas.cpu())
    assert float(sigmas[0]) == 1.0 and float(sigmas[-1]) == 0.0


def test_sd3_schedule_is_recorded_and_replayed_from_the_trace_sigmas():
    model = TinyVelocity()
    cfg = config(sigma_schedule="sd3")
    trace = sample_flow(model, PROMPTS, cfg, seeds=range(4), capture=True).trace
    assert trace.sampler["sigma_schedule"] == "sd3"
    assert torch.equal(trace.sigmas, flow_sigmas(6, 3.0, "sd3"))
    assert not torch.equal(trace.sigmas, flow_sigmas(6, 3.0))
    # replay reads the trace's sigmas: each SDE step's log-prob, recomputed from them, is exact
    sde = KERNELS.get(trace.kernel_ids["flow_sde_step"]).fn
    options = dict(noise_level=0.7, variant="flow_grpo", reduction="mean")
    with torch.no_grad():
        for k in trace.sde_step_indices():
            sigma, sigma_next = trace.sigmas[k].repeat(4), trace.sigmas[k + 1].repeat(4)
            v = guided_velocity(model, trace.latents[:, k], sigma, trace.cond, trace.uncond, 3.0)
            prev = trace.latents[:, k + 1]
            logprob = sde(trace.latents[:, k], v, sigma, sigma_next, prev_sample=prev, **options)[1]
            assert torch.equal(logprob, trace.behaviour_logprobs[:, k])


def test_on_step_reports_progress_without_changing_samples():
    model = TinyVelocity()
    cfg = config(micro_batch_size=3)  # two forward groups of 6 steps
    done = []
    plain = sample_flow(model, PROMPTS, cfg, seeds=range(4), capture=True).trace
    traced = sample_flow(
        model, PROMPTS, cfg, seeds=range(4), capture=True, on_step=done.append
    ).trace
    assert done == list(range(1, 13))
    assert torch.equal(plain.latents, traced.latents)
    assert torch.equal(plain.behaviour_logprobs, traced.behaviour_logprobs)


def test_legacy_progress_key_is_ignored():
    """Sampler settings saved before ``progress`` was dropped still load."""
    legacy = {**FlowSamplerConfig().model_dump(), "progress": False}
    del legacy["sigma_schedule"]
    assert FlowSamplerConfig(**legacy) == FlowSamplerConfig()


def test_batched_cfg_equals_two_forwards_and_guidance_one_is_plain():
    model = TinyVelocity()
    x = torch.randn(4, 3, 8, 8)
    sigma = torch.full((4,), 0.6)
    cond, uncond = model.encode_prompts(PROMPTS), model.empty_condition(4)
    with torch.no_grad():
        v_c, v_u = model(x, sigma, cond), model(x, sigma, uncond)
        guided = guided_velocity(model, x, sigma, cond, uncond, 4.5)
        plain = guided_velocity(model, x, sigma, cond, None, 1.0)
    assert float((v_c - v_u).abs().mean()) > 1e-3  # guidance has something to act on
    torch.testing.assert_close(guided, v_u + 4.5 * (v_c - v_u), rtol=1e-5, atol=1e-5)
    assert torch.equal(plain, v_c)
    # the sampler with guidance 1 never builds the unconditional half
    trace = sample_flow(
        model, PROMPTS, config(guidance_scale=1.0), seeds=range(4), capture=True
    ).trace
    assert trace.uncond is None and trace.guidance_scale == 1.0


def test_ode_sampler_is_the_euler_loop():
    """Serving: every step x + (σ_next − σ) v with v from two separate CFG forwards."""
    model = TinyVelocity()
    cfg = config(mode="ode")
    out = sample_flow(model, PROMPTS, cfg, seeds=[5, 6, 7, 8], capture=True)
    trace = out.trace
    assert not bool(trace.sde_steps.any()) and bool((trace.behaviour_logprobs == 0).all())
    assert trace.kernel_ids == {"flow_ode_step": "flow_ode_step/reference@1"}
    x = step_noise([5, 6, 7, 8], -1, (3, 8, 8), "cpu")
    sigmas = flow_sigmas(6, 3.0).double()
    cond, uncond = model.encode_prompts(PROMPTS), model.empty_condition(4)
    with torch.no_grad():
        for k in range(6):
            s = torch.full((4,), float(sigmas[k]))
            v_c, v_u = model(x, s, cond), model(x, s, uncond)
            x = x + (sigmas[k + 1] - sigmas[k]).float() * (v_u + 3.0 * (v_c - v_u))
    torch.testing.assert_close(out.latents, x, rtol=1e-4, atol=1e-5)
    assert out.images.shape == (4, 3, 8, 8)
    assert float(out.images.min()) >= 0 and float(out.images.max()) <= 1


def test_sde_window_marks_trainable_steps_and_outside_is_ode():
    model = TinyVelocity()
    trace = sample_flow(
        model, PROMPTS, config(sde_window=(1, 4)), seeds=range(4), capture=True
    ).trace
    assert trace.sde_steps.tolist() == [False, True, True, True, False, False]
    assert bool((trace.behaviour_logprobs[:, [1, 2, 3]] != 0).all())
    assert bool((trace.behaviour_logprobs[:, [0, 4, 5]] == 0).all())
    assert set(trace.kernel_ids) == {"flow_ode_step", "flow_sde_step"}
    # ODE steps: the stored next latent is exactly the ODE step of the stored latent
    with torch.no_grad():
        for k in (0, 4, 5):
            sigma = trace.sigmas[k].expand(4)
            v = guided_velocity(model, trace.latents[:, k], sigma, trace.cond, trace.uncond, 3.0)
            ode = KERNELS.get(trace.kernel_ids["flow_ode_step"]).fn
            expected = ode(trace.latents[:, k], v, sigma, trace.sigmas[k + 1].expand(4))
            assert torch.equal(trace.latents[:, k + 1], expected)
    # default window: every step but the last
    full = sample_flow(model, PROMPTS, config(), seeds=range(4), capture=True).trace
    assert full.sde_steps.tolist() == [True] * 5 + [False]


def test_rows_are_independent_of_their_batch_mates():
    model = TinyVelocity()
    cfg = config()
    batch = sample_flow(model, PROMPTS, cfg, seeds=[11, 12, 13, 14], capture=True).trace
    for row, seed in enumerate([11, 12, 13, 14]):
        alone = sample_flow(model, [PROMPTS[row]], cfg, seeds=[seed], capture=True).trace
        assert torch.equal(alone.latents[0, 0], batch.latents[row, 0])  # noise: bitwise
        torch.testing.assert_close(alone.latents[0], batch.latents[row], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            alone.behaviour_logprobs[0], batch.behaviour_logprobs[row], rtol=1e-5, atol=1e-5
        )
    # other seeds, other samples
    other = sample_flow(model, PROMPTS, cfg, seeds=[21, 22, 23, 24], capture=True).trace
    assert float((other.latents[:, -1] - batch.latents[:, -1]).abs().mean()) > 0.1


def test_shared_group_noise_shares_only_the_initial_noise():
    model = TinyVelocity()
    cfg = config(share_group_noise=True)
    trace = sample_flow(model, PROMPTS, cfg, seeds=[1, 2, 3, 4], group_size=2, capture=True).trace
    x1 = trace.latents[:, 0]
    assert torch.equal(x1[0], x1[1]) and torch.equal(x1[2], x1[3])
    assert not torch.equal(x1[0], x1[2])
    assert torch.equal(x1[0], step_noise([1], -1, (3, 8, 8), "cpu")[0])  # the group's first seed
    final = trace.latents[:, -1]
    assert float((final[0] - final[1]).abs().mean()) > 0.05  # distinct SDE noise
    assert float((final[2] - final[3]).abs().mean()) > 0.05
    with pytest.raises(ValueError, match="group_size"):
        sample_flow(model, PROMPTS, cfg, seeds=[1, 2, 3, 4])
    with pytest.raises(ValueError, match="group_size"):
        sample_flow(model, PROMPTS, cfg, seeds=[1, 2, 3, 4], group_size=3)


def test_trace_records_what_the_sampler_did():
    model = TinyVelocity()
    cfg = config(micro_batch_size=3)
    out = sample_flow(model, PROMPTS, cfg, seeds=[9, 8, 7, 6], capture=True, weights_version=4)
    trace = out.trace
    assert trace.latents.shape == (4, 7, 3, 8, 8) and trace.latents.dtype == torch.float32
    assert torch.equal(trace.latents[:, -1], out.latents)
    assert torch.equal(trace.latents[:, 0], step_noise([9, 8, 7, 6], -1, (3, 8, 8), "cpu"))
    assert trace.forward_groups.tolist() == [0, 0, 0, 1]
    assert trace.seeds.tolist() == [9, 8, 7, 6] and trace.prompts == PROMPTS
    assert trace.weights_version == 4
    assert trace.kernel_ids["flow_sde_step"] == "flow_sde_step/reference@1"
    assert trace.sampler["micro_batch_size"] == 3 and trace.sampler["latent_shape"] == [3, 8, 8]
    assert (trace.guidance_scale, trace.noise_level, trace.variant, trace.reduction) == (
        3.0,
        0.7,
        "flow_grpo",
        "mean",
    )
    assert torch.equal(trace.cond["label"], torch.tensor([3, 3, 7, 7]))
    assert torch.equal(trace.uncond["label"], torch.full((4,), 10))
    # forward groups of 3 + 1 rows: the same samples as one group of 4, to fp tolerance
    whole = sample_flow(model, PROMPTS, config(), seeds=[9, 8, 7, 6], capture=True).trace
    torch.testing.assert_close(whole.latents, trace.latents, rtol=1e-5, atol=1e-5)


def test_preferred_kernels_are_used_and_stamped():
    model = TinyVelocity()
    prefer = {
        "flow_sde_step": "flow_sde_step/inplace@1",
        "flow_ode_step": "flow_ode_step/inplace@1",
    }
    for variant in ("flow_grpo", "constant", "cps"):
        level = 0.3 if variant == "constant" else 0.7
        ref = sample_flow(
            model, PROMPTS, config(variant=variant, noise_level=level), seeds=range(4), capture=True
        ).trace
        alt = sample_flow(
            model,
            PROMPTS,
            config(variant=variant, noise_level=level, kernels=prefer),
            seeds=range(4),
            capture=True,
        ).trace
        assert alt.kernel_ids == prefer
        assert torch.equal(alt.latents, ref.latents) and torch.equal(
            alt.behaviour_logprobs, ref.behaviour_logprobs
        )
        assert bool(torch.isfinite(ref.latents).all())


def test_trace_rows_and_concat_round_trip():
    model = TinyVelocity()
    trace = sample_flow(model, PROMPTS, config(), seeds=range(4), capture=True).trace
    a, b = trace.rows(slice(0, 2)), trace.rows(torch.tensor([2, 3]))
    joined = FlowTrace.concat([a, b])
    for name in ("latents", "behaviour_logprobs", "seeds"):
        assert torch.equal(getattr(joined, name), getattr(trace, name))
    assert torch.equal(joined.cond["label"], trace.cond["label"])
    assert joined.forward_groups.tolist() == [0, 0, 1, 1]  # separate sampler batches stay apart
    assert trace.rows(torch.tensor([False, True, False, True])).prompts == ["3", "7"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    moved = trace.to(device)
    assert moved.latents.device.type == moved.cond["label"].device.type == device
    assert torch.equal(moved.latents.cpu(), trace.latents)
    with pytest.raises(TypeError, match=r"FlowTrace\.latents: got a tensor on the meta device"):
        trace.to("meta")  # a trace must hold values: meta tensors are refused
    other = sample_flow(model, PROMPTS, config(num_steps=5), seeds=range(4), capture=True).trace
    with pytest.raises(ValueError, match="sampler"):
        FlowTrace.concat([trace, other])


def test_config_errors_name_the_field():
    with pytest.raises(ValidationError, match="sde_window"):
        config(sde_window=(2, 6))  # would include the last step
    with pytest.raises(ValidationError, match="noise_level"):
        config(variant="cps", noise_level=1.2)
    with pytest.raises(ValidationError, match="num_steps"):
        config(num_steps=1)
    with pytest.raises(ValidationError, match="extra"):
        config(guidance=2.0)
    with pytest.raises(ValidationError, match="kernels"):
        config(kernels={"token_logprobs": "token_logprobs/reference@1"})
    with pytest.raises(KernelUnavailableError, match="flow_sde_step/cuda-fused@9"):
        config(kernels={"flow_sde_step": "flow_sde_step/cuda-fused@9"})
    with pytest.raises(ValueError, match="seeds"):
        sample_flow(TinyVelocity(), PROMPTS, config(), seeds=[1])
