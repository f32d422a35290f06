"""diffusers adapters (SD3, FLUX, Wan) as VelocityModels, on tiny random pipelines.

The independent reference throughout is diffusers itself: the adapters' Euler loop and decode
must reproduce each pipeline's own ``__call__`` bitwise, and the velocity convention is
checked against ``FlowMatchEulerDiscreteScheduler``.
"""

import pytest

pytest.importorskip("diffusers")
pytest.importorskip("peft")

import copy  # noqa: E402
import time  # noqa: E402

import safetensors.torch  # noqa: E402
import torch  # noqa: E402
from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, WanPipeline  # noqa: E402
from flow_toy import one_thread  # noqa: E402, F401 (fixture: one CPU thread)

from diffusion_rl.advantages import group_advantages  # noqa: E402
from diffusion_rl.models.diffusers_adapters import (  # noqa: E402
    FluxAdapter,
    LoraSettings,
    SD3Adapter,
    WanAdapter,
)
from diffusion_rl.models.diffusers_adapters.flux import image_ids, pack, unpack  # noqa: E402
from diffusion_rl.models.protocol import VelocityModel  # noqa: E402
from diffusion_rl.objectives.flow_grpo import FlowGRPOConfig, FlowGRPOLoss  # noqa: E402
from diffusion_rl.rollout import Rollout  # noqa: E402
from diffusion_rl.sampling.flow import FlowSamplerConfig, sample_flow  # noqa: E402
from diffusion_rl.scoring.flow import FlowReplayScorer  # noqa: E402
from diffusion_rl.train import OptimConfig, Trainer  # noqa: E402
from diffusion_rl.train.learner import PolicyLearner  # noqa: E402
from diffusion_rl.train.plans import FlowPolicyPlan  # noqa: E402
from diffusion_rl.train.roles import PolicyRoles  # noqa: E402

FAMILIES = {"sd3": SD3Adapter, "flux": FluxAdapter, "wan": WanAdapter}
LATENT_SHAPES = {"sd3": (4, 8, 8), "flux": (4, 8, 8), "wan": (4, 3, 8, 8)}
PIXEL_SHAPES = {"sd3": (3, 16, 16), "flux": (3, 16, 16), "wan": (5, 3, 16, 16)}
PROMPTS = ["a red cat", "two dogs 12", "x"]


@pytest.fixture(params=list(FAMILIES))
def family(request):
    return request.param


def noise(adapter, rows, seed=1):
    return torch.randn(rows, *adapter.latent_shape, generator=torch.Generator().manual_seed(seed))


def pipeline_latents(family, adapter, pipe, latents, steps, output_type="latent"):
    """Run the diffusers pipeline itself from ``latents`` (no CFG) and return its output in
    the adapter's (unpacked) layout."""
    kwargs = dict(
        prompt=PROMPTS[:2],
        num_inference_steps=steps,
        height=16,
        width=16,
        max_sequence_length=adapter.max_sequence_length,
        output_type=output_type,
        return_dict=False,
    )
    pipe.set_progress_bar_config(disable=True)
    if family == "flux":  # guidance-distilled: embedded guidance, no true CFG by default
        out = pipe(latents=pack(latents), guidance_scale=adapter.guidance_scale, **kwargs)[0]
        return unpack(out, 8, 8) if output_type == "latent" else out
    if family == "wan":
        return pipe(latents=latents, num_frames=5, guidance_scale=1.0, **kwargs)[0]
    return pipe(latents=latents, guidance_scale=1.0, **kwargs)[0]


# --------------------------------------------------------------------------- protocol, shapes


def test_protocol_shapes_and_build_time(family):
    start = time.perf_counter()
    adapter = FAMILIES[family].tiny(seed=0)
    build_seconds = time.perf_counter() - start
    assert build_seconds < 3.0, build_seconds
    assert isinstance(adapter, VelocityModel)
    assert adapter.latent_shape == LATENT_SHAPES[family]
    cond = adapter.encode_prompts(PROMPTS)
    assert set(cond) == set(adapter.cond_keys)
    assert all(v.shape[0] == 3 and not v.requires_grad for v in cond.values())
    empty = adapter.empty_condition(3)
    assert {k: v.shape for k, v in empty.items()} == {k: v.shape for k, v in cond.items()}
    assert all(torch.equal(v[0], v[2]) for v in empty.values())  # one encoding, repeated
    x = noise(adapter, 3)
    with torch.no_grad():
        v = adapter(x, torch.tensor([1.0, 0.5, 0.1]), cond)
        v_empty = adapter(x, torch.tensor([1.0, 0.5, 0.1]), empty)
        pixels = adapter.decode(x)
    assert v.shape == x.shape and v.dtype == x.dtype
    assert float(v.std()) > 0.1  # a random tiny model, not a zero-initialised one
    assert float((v - v_empty).abs().max()) > 1e-3  # the prompt reaches the velocity
    assert pixels.shape == (3, *PIXEL_SHAPES[family]) and pixels.dtype == torch.float32
    assert float(pixels.min()) >= 0.0 and float(pixels.max()) <= 1.0
    assert float(pixels.std()) > 1e-3


def test_euler_loop_and_decode_equal_the_diffusers_pipeline(family):
    """Timestep conversion, FLUX packing / ids / guidance, prompt encoding and the VAE
    scaling all at once: 3 Euler steps through the adapter equal the pipeline bitwise."""
    adapter = FAMILIES[family].tiny(seed=0)
    pipe = adapter.as_pipeline()
    x = noise(adapter, 2)
    expected = pipeline_latents(family, adapter, pipe, x, steps=3)
    sigmas = pipe.scheduler.sigmas  # the schedule the pipeline just used
    cond = adapter.encode_prompts(PROMPTS[:2])
    latents = x
    with torch.no_grad():
        for k in range(3):
            v = adapter(latents, sigmas[k].expand(2), cond)
            latents = latents + (sigmas[k + 1] - sigmas[k]) * v
        assert float((latents - x).abs().mean()) > 0.1
        assert torch.equal(latents, expected)
        pixels = pipeline_latents(family, adapter, adapter.as_pipeline(), x, 3, "pt")
        assert torch.equal(adapter.decode(latents), pixels.float())


def test_velocity_convention_and_scheduler_step(family):
    """diffusers' flow scheduler interpolates x_σ = (1-σ) x0 + σ ε and integrates
    model_output as dx/dσ: with v = ε - x0 one step lands on x_σnext; and its step on the
    adapter's output is the Euler step x + (σ_next - σ) v."""
    adapter = FAMILIES[family].tiny(seed=0)
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(adapter.scheduler_config)
    dynamic = scheduler.config.use_dynamic_shifting  # FLUX: resolution-dependent shift μ
    scheduler.set_timesteps(4, **({"mu": 0.8} if dynamic else {}))
    sigmas = scheduler.sigmas
    assert torch.equal(scheduler.timesteps, sigmas[:-1] * 1000)  # t = 1000 σ
    x0, eps = noise(adapter, 2, seed=2), noise(adapter, 2, seed=3)
    k = 1
    t, sigma, sigma_next = scheduler.timesteps[k], sigmas[k], sigmas[k + 1]
    x_sigma = scheduler.scale_noise(x0, t.reshape(1), eps)
    torch.testing.assert_close(x_sigma, (1 - sigma) * x0 + sigma * eps, rtol=0, atol=1e-6)
    scheduler._step_index = k
    stepped = scheduler.step(eps - x0, t, x_sigma, return_dict=False)[0]
    torch.testing.assert_close(stepped, (1 - sigma_next) * x0 + sigma_next * eps, rtol=0, atol=1e-6)
    cond = adapter.encode_prompts(PROMPTS[:2])
    with torch.no_grad():
        v = adapter(x_sigma, sigma.expand(2), cond)
    scheduler._step_index = k
    ours = x_sigma + (sigma_next - sigma) * v
    assert torch.equal(scheduler.step(v, t, x_sigma, return_dict=False)[0], ours)


def test_timestep_reaches_the_transformer_as_diffusers_expects(family):
    """SD3 and Wan take t = 1000 σ; FLUX takes σ (x1000 inside), packed tokens, ids and
    its guidance embedding."""
    adapter = FAMILIES[family].tiny(seed=0)
    x, sigma = noise(adapter, 2), torch.tensor([0.8, 0.3])
    cond = adapter.encode_prompts(PROMPTS[:2])
    with torch.no_grad():
        ours = adapter(x, sigma, cond)
        if family == "flux":
            embeds = cond["prompt_embeds"]
            direct = adapter.transformer(
                hidden_states=pack(x),
                timestep=sigma,
                guidance=torch.full((2,), adapter.guidance_scale),
                pooled_projections=cond["pooled_prompt_embeds"],
                encoder_hidden_states=embeds,
                txt_ids=torch.zeros(embeds.shape[1], 3),
                img_ids=image_ids(8, 8, "cpu", torch.float32),
                return_dict=False,
            )[0]
            direct = unpack(direct, 8, 8)
        else:
            extra = {"pooled_projections": cond["pooled_prompt_embeds"]} if family == "sd3" else {}
            direct = adapter.transformer(
                hidden_states=x,
                timestep=sigma * 1000,
                encoder_hidden_states=cond["prompt_embeds"],
                return_dict=False,
                **extra,
            )[0]
        assert torch.equal(ours, direct)
        if family != "flux":  # the other scale would be a different model input
            wrong = adapter.transformer(
                hidden_states=x,
                timestep=sigma,
                encoder_hidden_states=cond["prompt_embeds"],
                return_dict=False,
                **extra,
            )[0]
            assert float((wrong - ours).abs().max()) > 1e-3


def test_flux_packing_is_the_pipelines():
    x = torch.randn(2, 3, 4, 6)
    tokens = pack(x)
    assert torch.equal(tokens, FluxPipeline._pack_latents(x, 2, 3, 4, 6))
    # token (i, j) = (1, 2), channel 4c + 2a + b with c=1, a=1, b=0 → x[:, 1, 3, 4]
    assert torch.equal(tokens[:, 1 * 3 + 2, 4 * 1 + 2 * 1 + 0], x[:, 1, 3, 4])
    assert torch.equal(unpack(tokens, 4, 6), x)
    assert torch.equal(unpack(tokens, 4, 6), FluxPipeline._unpack_latents(tokens, 32, 48, 8))
    expected_ids = FluxPipeline._prepare_latent_image_ids(2, 2, 3, "cpu", torch.float32)
    assert torch.equal(image_ids(4, 6, "cpu", torch.float32), expected_ids)


def test_rows_are_independent_up_to_gemm_blocking(family):
    """A row alone vs in a batch of 3: equal to float32 rounding, not bitwise (measured max
    |Δ| 2e-7 .. 6e-7), while a repeated call is bitwise: replay must repeat the sampler's
    forward groups to be exact, which the flow sampler records and the replay does."""
    adapter = FAMILIES[family].tiny(seed=0)
    cond = adapter.encode_prompts(PROMPTS)
    x, sigma = noise(adapter, 3), torch.tensor([0.9, 0.4, 0.1])
    with torch.no_grad():
        batched = adapter(x, sigma, cond)
        assert torch.equal(adapter(x, sigma, cond), batched)
        for row in range(3):
            one = slice(row, row + 1)
            alone = adapter(x[one], sigma[one], {k: v[one] for k, v in cond.items()})
            assert float((alone - batched[one]).abs().max()) < 5e-6


# --------------------------------------------------------------------------- trainability


def test_only_the_transformer_trains_and_only_it_is_checkpointed(family, tmp_path):
    adapter = FAMILIES[family].tiny(seed=0).train()
    for module in adapter.frozen_modules():
        assert not module.training
        assert not any(p.requires_grad for p in module.parameters())
    assert all(p.requires_grad for p in adapter.transformer.parameters())
    cond = adapter.encode_prompts(PROMPTS[:2])
    adapter(noise(adapter, 2), torch.tensor([0.7, 0.2]), cond).square().mean().backward()
    assert all(p.grad is not None for p in adapter.transformer.parameters() if p.requires_grad)
    assert all(p.grad is None for m in adapter.frozen_modules() for p in m.parameters())

    state = adapter.state_dict()
    assert state and all(key.startswith("transformer.") for key in state)
    assert set(state) == {f"transformer.{k}" for k in adapter.transformer.state_dict()}
    # the way training checkpoints save and load (train/checkpoint.py): another seed's
    # transformer takes these weights, and the frozen parts are not asked for
    other = FAMILIES[family].tiny(seed=5)
    safetensors.torch.save_model(adapter, str(tmp_path / "model.safetensors"))
    safetensors.torch.load_model(other, str(tmp_path / "model.safetensors"), strict=True)
    x, sigma = noise(adapter, 2), torch.tensor([0.5, 0.2])
    with torch.no_grad():  # cond is an input: only the transformers differ
        assert torch.equal(other(x, sigma, cond), adapter(x, sigma, cond))
    assert set(FAMILIES[family].tiny(seed=0, save_frozen=True).state_dict()) > set(state)


def test_policy_roles_copy_and_sync_an_adapter(family):
    """PolicyRoles' deep copies work, and a sync copies the transformer weights."""
    adapter = FAMILIES[family].tiny(seed=0)
    roles = PolicyRoles(adapter)
    with torch.no_grad():
        for param in adapter.transformer.parameters():
            param.add_(0.01)
    x, sigma = noise(adapter, 2), torch.tensor([0.6, 0.3])
    cond = adapter.encode_prompts(PROMPTS[:2])
    with torch.no_grad():
        live = adapter(x, sigma, cond)
        assert not torch.equal(roles.rollout(x, sigma, cond), live)
        roles.sync_rollout()
        assert torch.equal(roles.rollout(x, sigma, cond), live)
        assert not torch.equal(roles.reference(x, sigma, cond), live)


def test_lora_starts_at_the_base_model_and_disables_to_it(family):
    base = FAMILIES[family].tiny(seed=0)
    adapter = FAMILIES[family].tiny(seed=0, lora=LoraSettings(rank=4))
    trainable = [n for n, p in adapter.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    assert set(adapter.state_dict()) == set(trainable)  # checkpoints hold the LoRA only
    x, sigma = noise(adapter, 2), torch.tensor([0.9, 0.35])
    cond = adapter.encode_prompts(PROMPTS[:2])
    with torch.no_grad():
        reference = base(x, sigma, cond)
        assert torch.equal(adapter(x, sigma, cond), reference)  # B = 0 at init: bitwise
    optimizer = torch.optim.Adam([p for p in adapter.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):  # step 1 moves B only (A's gradient is 0 while B = 0); step 2 both
        optimizer.zero_grad()
        (adapter(x, sigma, cond) - reference - 1).square().mean().backward()
        optimizer.step()
    with torch.no_grad():
        updated = adapter(x, sigma, cond)
        assert float((updated - reference).abs().max()) > 1e-3
        with adapter.lora_disabled() as reference_policy:
            assert torch.equal(reference_policy(x, sigma, cond), reference)
        assert torch.equal(adapter(x, sigma, cond), updated)
    assert [n for n, p in adapter.named_parameters() if p.requires_grad] == trainable
    with pytest.raises(ValueError, match="no LoRA"), base.lora_disabled():
        pass
    with pytest.raises(ValueError, match="save the LoRA weights"):
        adapter.save_pretrained("unused")


# --------------------------------------------------------------------------- directories


def test_from_pretrained_round_trips_a_saved_tiny_pipeline(family, tmp_path):
    adapter = FAMILIES[family].tiny(seed=0)
    adapter.save_pretrained(tmp_path / "pipe")
    settings = {"max_sequence_length": 16, "height": 16, "width": 16}
    if family == "wan":
        settings["num_frames"] = 5
    loaded = FAMILIES[family].from_pretrained(tmp_path / "pipe", **settings)
    assert loaded.latent_shape == adapter.latent_shape
    assert loaded.scheduler_config["shift"] == adapter.scheduler_config["shift"]
    cond, cond_loaded = adapter.encode_prompts(PROMPTS), loaded.encode_prompts(PROMPTS)
    assert all(torch.equal(cond[k], cond_loaded[k]) for k in cond)  # tokenizers round-trip
    x, sigma = noise(adapter, 3), torch.tensor([1.0, 0.5, 0.05])
    with torch.no_grad():
        assert torch.equal(loaded(x, sigma, cond), adapter(x, sigma, cond))
        assert torch.equal(loaded.decode(x), adapter.decode(x))
    half = FAMILIES[family].from_pretrained(
        tmp_path / "pipe", torch_dtype=torch.bfloat16, **settings
    )
    with torch.no_grad():
        v = half(x, sigma, half.encode_prompts(PROMPTS))
    assert v.dtype == torch.float32 and half.transformer.dtype == torch.bfloat16


def test_from_pretrained_refuses_hub_ids_and_other_families(tmp_path):
    start = time.perf_counter()
    with pytest.raises(FileNotFoundError, match="local diffusers pipeline directory"):
        SD3Adapter.from_pretrained("stabilityai/stable-diffusion-3.5-medium")
    assert time.perf_counter() - start < 1.0  # no network attempt
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="model_index.json"):
        FluxAdapter.from_pretrained(tmp_path / "empty")
    SD3Adapter.tiny(seed=0).save_pretrained(tmp_path / "sd3")
    with pytest.raises(ValueError, match="'StableDiffusion3Pipeline'.*FluxPipeline"):
        FluxAdapter.from_pretrained(tmp_path / "sd3")


def test_wan_two_expert_pipelines_are_refused():
    components, _ = WanAdapter._tiny_components(0)
    pipe = WanPipeline(**components, transformer_2=copy.deepcopy(components["transformer"]))
    with pytest.raises(ValueError, match="two-expert"):
        WanAdapter(pipe)


# --------------------------------------------------------------------------- inputs, encode


def test_bad_inputs_name_the_field():
    adapter = SD3Adapter.tiny(seed=0)
    cond = adapter.encode_prompts(PROMPTS[:2])
    x = noise(adapter, 2)
    with pytest.raises(ValueError, match=r"latents: expected \[B, 4, 8, 8\]"):
        adapter(torch.zeros(2, 4, 16, 16), torch.ones(2), cond)
    with pytest.raises(ValueError, match="sigma: expected a float tensor"):
        adapter(x, torch.ones(3), cond)
    with pytest.raises(KeyError, match="pooled_prompt_embeds"):
        adapter(x, torch.ones(2), {"prompt_embeds": cond["prompt_embeds"]})
    with pytest.raises(ValueError, match=r"cond\['prompt_embeds'\]: batch 1"):
        adapter(x, torch.ones(2), {k: v[:1] for k, v in cond.items()})
    with pytest.raises(TypeError, match="prompts: expected a list of strings"):
        adapter.encode_prompts("a cat")
    with pytest.raises(ValueError, match="height: expected a positive multiple of 4"):
        SD3Adapter.tiny(seed=0, height=18)
    with pytest.raises(ValueError, match="num_frames: expected 1 \\+ a multiple of 2"):
        WanAdapter.tiny(seed=0, num_frames=4)


def test_encode_images_inverts_the_latent_scaling(family):
    """encode_images gives the VAE posterior mean in the transformer's scaling: mapping it
    back with the decode-side scaling recovers the raw mean."""
    adapter = FAMILIES[family].tiny(seed=0)
    pixels = torch.rand(2, *PIXEL_SHAPES[family], generator=torch.Generator().manual_seed(4))
    latents = adapter.encode_images(pixels)
    assert latents.shape == (2, *adapter.latent_shape)
    vae_pixels = pixels * 2 - 1 if family != "wan" else (pixels * 2 - 1).permute(0, 2, 1, 3, 4)
    with torch.no_grad():
        raw = adapter.vae.encode(vae_pixels).latent_dist.mean
    torch.testing.assert_close(adapter._to_vae(latents), raw, rtol=1e-5, atol=1e-5)
    if family == "sd3":
        config = adapter.vae.config
        expected = (raw - config.shift_factor) * config.scaling_factor
        torch.testing.assert_close(latents, expected, rtol=0, atol=0)
    assert adapter.decode(latents).shape == pixels.shape


# --------------------------------------------------------------------------- Flow-GRPO


# FLUX is guidance-distilled: no true CFG (sampler guidance 1), its embedded guidance inside
GUIDANCE = {"sd3": 3.0, "flux": 1.0, "wan": 3.0}
GRPO_PROMPTS = ["a red cat", "a red cat", "two dogs", "two dogs"]


def flow_learner(roles, config, trainer):
    return PolicyLearner(roles, FlowPolicyPlan(FlowGRPOLoss(config)), trainer)


def as_rollout(trace, images, rewards, advantages, group_size=2):
    return Rollout(trace, images, list(trace.prompts), rewards, advantages, group_size)


def test_rollout_replay_parity_and_one_flow_grpo_step(family):
    """Rollout = served sampling with capture (SDE, CFG, two forward groups); replay of every
    SDE step equals the behaviour log-probs bitwise; one Flow-GRPO step (β > 0: reference
    KL) moves the transformer only."""
    adapter = FAMILIES[family].tiny(seed=0)
    roles = PolicyRoles(adapter, reference=True)

    def trainer(actor, loss_fn):
        return Trainer(actor, loss_fn, OptimConfig(lr=1e-3, grad_clip=None))

    config = FlowGRPOConfig(beta=0.04)
    learner = flow_learner(roles, config, trainer)
    sampler = FlowSamplerConfig(
        num_steps=4, mode="sde", guidance_scale=GUIDANCE[family], micro_batch_size=2
    )
    sample = sample_flow(
        roles.rollout, GRPO_PROMPTS, sampler, seeds=range(4), group_size=2, capture=True
    )
    trace = sample.trace
    assert sample.images.shape == (4, *PIXEL_SHAPES[family])
    assert trace.latents.shape == (4, 5, *adapter.latent_shape)
    assert (trace.uncond is None) == (GUIDANCE[family] == 1.0)

    scores = FlowReplayScorer.for_trace(adapter, trace, stop_gradient=True).score_trace(trace)
    behaviour = trace.behaviour_logprobs[:, trace.sde_step_indices()]
    assert scores.steps == [0, 1, 2] and bool(torch.isfinite(behaviour).all())
    assert float((scores.logprobs - behaviour).abs().max()) == 0.0  # bitwise, fp32

    frozen = {
        name: p.detach().clone()
        for module in adapter.frozen_modules()
        for name, p in module.named_parameters()
    }
    trained = [p.detach().clone() for p in adapter.transformer.parameters()]
    rewards = sample.images.float().mean(dim=tuple(range(1, sample.images.dim())))
    advantages = group_advantages(rewards, 2, config.advantage_spec)
    metrics = learner.step(as_rollout(trace, sample.images.float(), rewards, advantages))
    assert metrics["flow_grpo/parity_max_abs@iter0"] == 0.0
    assert metrics["flow_grpo/ratio_min@iter0"] == 1.0 == metrics["flow_grpo/ratio_max@iter0"]
    assert metrics["flow_grpo/kl@iter0"] == 0.0  # actor == reference before the update
    assert metrics["skipped_nonfinite"] == 0.0 and metrics["weights_version"] == 1.0
    params = adapter.transformer.parameters()
    assert max(float((p.detach() - q).abs().max()) for p, q in zip(params, trained)) > 1e-4
    after = {
        name: p for module in adapter.frozen_modules() for name, p in module.named_parameters()
    }
    assert all(torch.equal(after[name], value) for name, value in frozen.items())


def test_lora_flow_grpo_step_with_the_lora_disabled_reference():
    """LoRA run: the reference is the actor with LoRA off (no weight copy); before the update
    the KL is 0 and ratios 1; the step moves LoRA weights only."""
    adapter = SD3Adapter.tiny(seed=0, lora=LoraSettings(rank=4))
    roles = PolicyRoles(adapter, reference=False)
    roles.reference = adapter.lora_reference()

    def trainer(actor, loss_fn):
        return Trainer(actor, loss_fn, OptimConfig(lr=1e-2, grad_clip=None))

    learner = flow_learner(roles, FlowGRPOConfig(beta=0.04, num_iterations=2), trainer)
    sampler = FlowSamplerConfig(num_steps=4, mode="sde", guidance_scale=3.0, micro_batch_size=2)
    sample = sample_flow(
        roles.rollout, GRPO_PROMPTS, sampler, seeds=range(4), group_size=2, capture=True
    )
    trace = sample.trace
    base = {n: p.detach().clone() for n, p in adapter.transformer.named_parameters()}
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    rollout = as_rollout(trace, sample.images.float(), torch.zeros(4), advantages)
    metrics = learner.step(rollout)
    assert metrics["flow_grpo/parity_max_abs@iter0"] == 0.0
    assert metrics["flow_grpo/kl@iter0"] == 0.0
    assert metrics["flow_grpo/kl@iter1"] > 0.0  # the LoRA moved away from the base
    changed = {n for n, p in adapter.transformer.named_parameters() if not torch.equal(p, base[n])}
    assert changed and all(".lora_" in name for name in changed)  # base weights untouched
    assert any(".lora_B" in name for name in changed)
    with torch.no_grad():  # the synced rollout copy carries the update; the reference does not
        x, sigma = noise(adapter, 2), torch.tensor([0.9, 0.4])
        cond = adapter.encode_prompts(GRPO_PROMPTS[:2])
        assert torch.equal(roles.rollout(x, sigma, cond), adapter(x, sigma, cond))
        assert not torch.equal(roles.reference(x, sigma, cond), adapter(x, sigma, cond))
