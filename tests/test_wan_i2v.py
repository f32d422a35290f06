"""The Wan image-to-video adapter (``WanImageToVideoPipeline``) on a tiny random pipeline.

The independent reference is diffusers itself: the conditioning must equal what the
pipeline's own ``encode_prompt`` / ``encode_image`` / ``prepare_latents`` build from the same
first frame (given to the pipeline as a PIL image, as users do), the velocity must be the
transformer's on the channel-concatenated input, and the adapter's Euler loop and decode must
reproduce the pipeline's ``__call__`` bitwise. Then the project's side: SDE rollout with
capture, replay parity, a Flow-GRPO step with ratio exactly 1 before the update.
"""

import pytest

pytest.importorskip("diffusers")
pytest.importorskip("peft")
pytest.importorskip("ftfy")

import copy  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402

import torch  # noqa: E402
from diffusers import (  # noqa: E402
    WanImageToVideoPipeline,
    WanPipeline,
    WanTransformer3DModel,
)
from diffusers.pipelines.wan.pipeline_wan_i2v import retrieve_latents  # noqa: E402
from flow_toy import one_thread  # noqa: E402, F401 (fixture: one CPU thread)
from PIL import Image  # noqa: E402

from diffusion_rl.advantages import group_advantages  # noqa: E402
from diffusion_rl.models.diffusers_adapters import (  # noqa: E402
    ADAPTERS,
    LoraSettings,
    WanAdapter,
    WanImageToVideoAdapter,
    adapter_for_directory,
)
from diffusion_rl.models.diffusers_adapters.tiny import tiny_clip_image_processor  # noqa: E402
from diffusion_rl.models.protocol import VelocityModel  # noqa: E402
from diffusion_rl.objectives.flow_grpo import FlowGRPOConfig, FlowGRPOLoss  # noqa: E402
from diffusion_rl.rollout import Rollout  # noqa: E402
from diffusion_rl.sampling.flow import FlowSamplerConfig, sample_flow  # noqa: E402
from diffusion_rl.scoring.flow import FlowReplayScorer  # noqa: E402
from diffusion_rl.train import OptimConfig, Trainer  # noqa: E402
from diffusion_rl.train.learner import PolicyLearner  # noqa: E402
from diffusion_rl.train.plans import FlowPolicyPlan  # noqa: E402
from diffusion_rl.train.roles import PolicyRoles  # noqa: E402

PROMPTS = ["a red cat", "two dogs 12"]
SETTINGS = {"height": 16, "width": 16, "num_frames": 5}


@pytest.fixture(scope="module")
def adapter():
    return WanImageToVideoAdapter.tiny(seed=0)


def first_frames(rows, seed=3, size=(16, 16)):
    """8-bit first frames ``[rows, 3, H, W]`` as float tensors in [0, 1] and as PIL images
    (the same pixels)."""
    u8 = torch.randint(0, 256, (rows, 3, *size), generator=torch.Generator().manual_seed(seed))
    u8 = u8.to(torch.uint8)
    pil = [Image.fromarray(row.permute(1, 2, 0).numpy()) for row in u8]
    return u8.float() / 255, pil


def noise(adapter, rows, seed=1):
    return torch.randn(rows, *adapter.latent_shape, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- protocol, shapes


def test_protocol_shapes_and_what_reaches_the_velocity(adapter):
    assert isinstance(adapter, VelocityModel)
    assert ADAPTERS["wan-i2v"] is WanImageToVideoAdapter
    assert adapter.latent_shape == (4, 3, 8, 8) and adapter.condition_shape == (6, 3, 8, 8)
    assert adapter.image_shape == (3, 16, 16) and adapter.num_frames == 5
    images, _ = first_frames(2)
    cond = adapter.encode_conditioning(PROMPTS, images)
    shapes = {k: tuple(v.shape) for k, v in cond.items()}
    assert shapes == {
        "prompt_embeds": (2, 512, 32),
        "condition": (2, 6, 3, 8, 8),
        "image_embeds": (2, 17, 8),
    }
    assert all(not v.requires_grad and v.dtype == torch.float32 for v in cond.values())
    # the mask: all 2 (= temporal factor) channels 1 on the first latent frame, 0 after
    mask = cond["condition"][:, :2]
    assert bool((mask[:, :, 0] == 1).all()) and bool((mask[:, :, 1:] == 0).all())

    empty = adapter.empty_conditioning(images)
    assert set(empty) == set(cond)
    assert torch.equal(empty["condition"], cond["condition"])  # SAME image conditioning
    assert torch.equal(empty["image_embeds"], cond["image_embeds"])
    assert torch.equal(empty["prompt_embeds"][0], empty["prompt_embeds"][1])
    assert not torch.equal(empty["prompt_embeds"], cond["prompt_embeds"])

    x, sigma = noise(adapter, 2), torch.tensor([0.9, 0.4])
    other = adapter.encode_conditioning(PROMPTS, first_frames(2, seed=9)[0])
    no_clip = {**cond, "image_embeds": other["image_embeds"]}
    with torch.no_grad():
        v = adapter(x, sigma, cond)
        assert v.shape == x.shape and v.dtype == x.dtype and float(v.std()) > 0.1
        # prompt, first-frame latent and CLIP tokens each reach the velocity
        assert float((adapter(x, sigma, empty) - v).abs().max()) > 1e-3
        assert (
            float((adapter(x, sigma, {**cond, "condition": other["condition"]}) - v).abs().max())
            > 1e-3
        )
        assert float((adapter(x, sigma, no_clip) - v).abs().max()) > 1e-3
        pixels = adapter.decode(x)
    assert pixels.shape == (2, 5, 3, 16, 16) and pixels.dtype == torch.float32
    assert float(pixels.min()) >= 0.0 and float(pixels.max()) <= 1.0 and float(pixels.std()) > 1e-3


# --------------------------------------------------------------------------- diffusers parity


def test_conditioning_equals_the_pipelines_own_methods(adapter):
    """Each tensor against the pipeline's method on the same first frame given as PIL: the
    VAE input (video_processor), the condition (prepare_latents), the CLIP tokens
    (encode_image), the prompt and negative-prompt states (encode_prompt)."""
    pipe = adapter.as_pipeline()
    images, pil = first_frames(2)
    cond = adapter.encode_conditioning(PROMPTS, images)
    empty = adapter.empty_conditioning(images)
    with torch.no_grad():
        for b in range(2):
            pre = pipe.video_processor.preprocess(pil[b], height=16, width=16)
            assert torch.equal(pre, images[b : b + 1] * 2 - 1)  # PIL path == exact tensor path
            assert torch.equal(pipe.video_processor.preprocess(images[b : b + 1], 16, 16), pre)
            zeros = torch.zeros(1, *adapter.latent_shape)
            _, condition = pipe.prepare_latents(
                pre, 1, 4, 16, 16, 5, torch.float32, torch.device("cpu"), None, zeros
            )
            assert torch.equal(cond["condition"][b : b + 1], condition)
            embeds = pipe.encode_image(pil[b], torch.device("cpu"))
            if getattr(pipe.image_processor, "backend", "pil") == "pil":  # this venv: bitwise
                assert torch.equal(cond["image_embeds"][b : b + 1], embeds)
            else:  # torchvision folds the 1/255 into mean / std: float32 rounding apart
                torch.testing.assert_close(
                    cond["image_embeds"][b : b + 1], embeds, rtol=0, atol=1e-6
                )
            # the pipeline's tensor path is not the reference: its CLIP processor rescales
            # [0, 1] pixels by 1/255 again, so CLIP sees an all but black frame
            clip_in = pipe.image_processor(images=images[b : b + 1], return_tensors="pt")
            assert float(clip_in.pixel_values.max()) < -1.4
            tensor_path = pipe.encode_image(images[b : b + 1], torch.device("cpu"))
            assert float((tensor_path - embeds).abs().max()) > 1.0
        positive, negative = pipe.encode_prompt(
            PROMPTS, negative_prompt="", max_sequence_length=512, device=torch.device("cpu")
        )
    assert torch.equal(cond["prompt_embeds"], positive)
    assert torch.equal(empty["prompt_embeds"], negative)
    assert float(positive[:, 16:].abs().max()) == 0.0  # zero past the prompt's own tokens


def test_clip_preprocessing_follows_the_image_processor_when_it_resizes(adapter):
    """A smooth 16 × 24 frame, CLIP at 12: shortest edge 16 → 12 (long 18), centre crop
    12 × 12, bicubic with antialiasing. The processor resizes the 8-bit image in PIL, so it
    agrees to 8-bit rounding only: within one 8-bit level (1/255/std, 0.0142 .. 0.0146 in
    normalised units; measured 0.0118). No antialiasing (0.039), bilinear (0.051) or a crop
    from the wrong place (1.8) are outside that."""
    processor = tiny_clip_image_processor(12)
    yy, xx = torch.meshgrid(torch.arange(16.0), torch.arange(24.0), indexing="ij")
    smooth = torch.stack(
        [0.5 + 0.4 * torch.sin(xx / 3 + yy / 5), 0.5 + 0.4 * torch.cos(yy / 2.5), (xx + yy) / 40]
    )
    u8 = (smooth * 255).round().to(torch.uint8)
    images = u8.float()[None] / 255
    theirs = processor(
        images=Image.fromarray(u8.permute(1, 2, 0).numpy()), return_tensors="pt"
    ).pixel_values
    view = copy.copy(adapter)  # shares the modules; only the processor differs
    view.image_processor = processor
    ours = view.clip_pixels(images)
    level = 1 / 255 / min(processor.image_std)
    assert ours.shape == theirs.shape == (1, 3, 12, 12)
    assert float((ours - theirs).abs().max()) < level
    mean = torch.tensor(processor.image_mean).view(1, 3, 1, 1)
    std = torch.tensor(processor.image_std).view(1, 3, 1, 1)
    resize = torch.nn.functional.interpolate
    wrong = [
        resize(images, size=(12, 18), mode="bicubic")[..., 3:15],
        resize(images, size=(12, 18), mode="bilinear", antialias=True)[..., 3:15],
        resize(images, size=(12, 18), mode="bicubic", antialias=True)[..., :12],
    ]
    for pixels in wrong:
        assert float(((pixels - mean) / std - theirs).abs().max()) > 2 * level


def test_velocity_is_the_transformer_on_the_concatenated_input(adapter):
    images, _ = first_frames(2)
    cond = adapter.encode_conditioning(PROMPTS, images)
    x, sigma = noise(adapter, 2), torch.tensor([0.8, 0.3])
    with torch.no_grad():
        ours = adapter(x, sigma, cond)

        def transformer(timestep):
            return adapter.transformer(
                hidden_states=torch.cat([x, cond["condition"]], dim=1),
                timestep=timestep,
                encoder_hidden_states=cond["prompt_embeds"],
                encoder_hidden_states_image=cond["image_embeds"],
                return_dict=False,
            )[0]

        assert torch.equal(ours, transformer(sigma * 1000))
        assert float((transformer(sigma) - ours).abs().max()) > 1e-3  # t = σ is another input


def test_a_transformer_without_image_projection_takes_no_clip_tokens():
    """``image_dim`` unset (no CLIP cross-attention): the conditioning is the prompt and the
    channel condition only, the text length is free, and the velocity is the transformer's
    call without ``encoder_hidden_states_image``."""
    components, _ = WanImageToVideoAdapter._tiny_components(0)
    config = {**components["transformer"].config, "image_dim": None, "added_kv_proj_dim": None}
    components["transformer"] = WanTransformer3DModel.from_config(config)
    components["image_encoder"] = components["image_processor"] = None
    adapter = WanImageToVideoAdapter(
        WanImageToVideoPipeline(**components), max_sequence_length=16, **SETTINGS
    )
    assert adapter.cond_keys == ("prompt_embeds", "condition")
    images, _ = first_frames(2)
    cond = adapter.encode_conditioning(PROMPTS, images)
    assert set(cond) == {"prompt_embeds", "condition"} and cond["prompt_embeds"].shape[1] == 16
    x, sigma = noise(adapter, 2), torch.tensor([0.6, 0.1])
    with torch.no_grad():
        direct = adapter.transformer(
            hidden_states=torch.cat([x, cond["condition"]], dim=1),
            timestep=sigma * 1000,
            encoder_hidden_states=cond["prompt_embeds"],
            return_dict=False,
        )[0]
        assert torch.equal(adapter(x, sigma, cond), direct)


def test_euler_loop_and_decode_equal_the_diffusers_pipeline(adapter):
    """The pipeline's own __call__ (first frame as PIL, no CFG, 3 steps, our initial noise):
    its prompt encoding, prepare_latents condition, timesteps and scheduler steps against the
    adapter's Euler loop on its conditioning: the same latents bitwise, and the adapter's
    decode equals the pipeline's decoded video."""
    pipe = adapter.as_pipeline()
    pipe.set_progress_bar_config(disable=True)
    images, pil = first_frames(1)
    x = noise(adapter, 2)
    kwargs = dict(
        image=pil[0],
        prompt=PROMPTS,
        latents=x,
        num_inference_steps=3,
        guidance_scale=1.0,
        max_sequence_length=512,
        return_dict=False,
        **SETTINGS,
    )
    # the CLIP tokens are the adapter's (equal to encode_image's: test above), so the loop is
    # compared bitwise whichever image-processor backend transformers picked
    pipe.encode_image = lambda image, device: adapter.image_conditioning(images)["image_embeds"]
    expected = pipe(output_type="latent", **kwargs)[0]
    sigmas = pipe.scheduler.sigmas
    cond = adapter.encode_conditioning(PROMPTS, images.expand(2, -1, -1, -1))
    latents = x
    with torch.no_grad():
        for k in range(3):
            v = adapter(latents, sigmas[k].expand(2), cond)
            latents = latents + (sigmas[k + 1] - sigmas[k]) * v
        assert float((latents - x).abs().mean()) > 0.1
        assert torch.equal(latents, expected)
        video = pipe(output_type="pt", **kwargs)[0]
        assert torch.equal(adapter.decode(latents), video.float())


# --------------------------------------------------------------------------- determinism


def test_first_frame_encode_is_deterministic_and_row_independent(adapter):
    images, _ = first_frames(3)
    one = adapter.encode_conditioning(PROMPTS + ["x"], images)
    two = adapter.encode_conditioning(PROMPTS + ["x"], images)
    assert all(torch.equal(one[k], two[k]) for k in one)  # bitwise, call after call
    alone = adapter.image_conditioning(images[1:2])
    assert all(torch.equal(alone[k], one[k][1:2]) for k in alone)  # batch mates do not matter
    # the latent half is the normalised posterior MODE; a sample (DanceGRPO's encode) differs
    video = torch.cat([images[:1, :, None] * 2 - 1, torch.zeros(1, 3, 4, 16, 16)], dim=2)
    with torch.no_grad():
        encoded = adapter.vae.encode(video)
        mode = retrieve_latents(encoded, sample_mode="argmax")
        sampled = retrieve_latents(encoded, torch.Generator().manual_seed(0), "sample")
    assert torch.equal(one["condition"][:1, 2:], adapter._from_vae(mode))
    assert float((adapter._from_vae(sampled) - one["condition"][:1, 2:]).abs().max()) > 1e-2


# --------------------------------------------------------------------------- rollout, Flow-GRPO


@pytest.mark.parametrize("guidance", [1.0, 2.0])
def test_rollout_replay_parity_and_ratio_one_before_the_update(guidance):
    """SDE rollout with capture on the adapter's conditioning (CFG keeps the first frame);
    the replay equals the behaviour log-probs bitwise, and the learner's ratio is exactly 1
    before its update, which then moves the transformer only."""
    adapter = WanImageToVideoAdapter.tiny(seed=0)
    roles = PolicyRoles(adapter, reference=False)
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]]
    images, _ = first_frames(4)
    images = images[[0, 0, 1, 1]]  # G = 2 videos per first frame
    cond = adapter.encode_conditioning(prompts, images)
    uncond = adapter.empty_conditioning(images) if guidance != 1.0 else None
    config = FlowSamplerConfig(mode="sde", num_steps=3, guidance_scale=guidance)
    sample = sample_flow(
        roles.rollout,
        prompts,
        config,
        seeds=range(4),
        group_size=2,
        cond=cond,
        uncond=uncond,
        capture=True,
    )
    trace = sample.trace
    assert sample.images.shape == (4, 5, 3, 16, 16)
    assert trace.latents.shape == (4, 4, *adapter.latent_shape)
    assert torch.equal(trace.cond["condition"], cond["condition"])
    scores = FlowReplayScorer.for_trace(adapter, trace, stop_gradient=True).score_trace(trace)
    behaviour = trace.behaviour_logprobs[:, trace.sde_step_indices()]
    assert scores.steps == [0, 1] and bool(torch.isfinite(behaviour).all())
    assert float((scores.logprobs - behaviour).abs().max()) == 0.0  # bitwise, fp32

    loss_config = FlowGRPOConfig(beta=0.0)
    learner = PolicyLearner(
        roles,
        FlowPolicyPlan(FlowGRPOLoss(loss_config)),
        lambda actor, loss_fn: Trainer(actor, loss_fn, OptimConfig(lr=1e-3, grad_clip=None)),
    )
    frozen = {
        name: p.detach().clone()
        for module in adapter.frozen_modules()
        for name, p in module.named_parameters()
    }
    trained = [p.detach().clone() for p in adapter.transformer.parameters()]
    rewards = sample.images.mean(dim=(1, 2, 3, 4))
    advantages = group_advantages(rewards, 2, loss_config.advantage_spec)
    rollout = Rollout(trace, sample.images, prompts, rewards, advantages, 2)
    metrics = learner.step(rollout)
    assert metrics["flow_grpo/parity_max_abs@iter0"] == 0.0
    assert metrics["flow_grpo/ratio_mean@iter0"] == 1.0
    assert metrics["flow_grpo/ratio_min@iter0"] == 1.0 == metrics["flow_grpo/ratio_max@iter0"]
    moved = max(
        float((p.detach() - q).abs().max())
        for p, q in zip(adapter.transformer.parameters(), trained)
    )
    assert moved > 1e-5
    after = {n: p for m in adapter.frozen_modules() for n, p in m.named_parameters()}
    assert all(torch.equal(after[name], value) for name, value in frozen.items())


def test_only_the_transformer_trains_and_lora_starts_at_the_base(adapter):
    adapter.train()
    try:
        assert adapter.image_encoder in adapter.frozen_modules()
        assert not adapter.image_encoder.training
        assert not any(p.requires_grad for p in adapter.image_encoder.parameters())
        assert set(adapter.state_dict()) == {
            f"transformer.{k}" for k in adapter.transformer.state_dict()
        }
    finally:
        adapter.eval()
    lora = WanImageToVideoAdapter.tiny(seed=0, lora=LoraSettings(rank=4))
    trainable = [n for n, p in lora.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    images, _ = first_frames(2)
    cond = adapter.encode_conditioning(PROMPTS, images)
    x, sigma = noise(adapter, 2), torch.tensor([0.7, 0.2])
    with torch.no_grad():
        assert torch.equal(lora(x, sigma, cond), adapter(x, sigma, cond))  # B = 0 at init


# --------------------------------------------------------------------------- directories


def test_pipeline_directory_round_trip(adapter, tmp_path):
    """save_pretrained writes a WanImageToVideoPipeline directory (image encoder and
    processor included); the directory picks its adapter and loads back to the same
    conditioning, velocity and decode."""
    adapter.save_pretrained(tmp_path / "pipe")
    index = json.loads((tmp_path / "pipe" / "model_index.json").read_text())
    assert index["_class_name"] == "WanImageToVideoPipeline"
    assert index["image_encoder"][1] == "CLIPVisionModel" and index["image_processor"][0]
    assert adapter_for_directory(tmp_path / "pipe") is WanImageToVideoAdapter
    loaded = WanImageToVideoAdapter.from_pretrained(tmp_path / "pipe", **SETTINGS)
    assert loaded.latent_shape == adapter.latent_shape
    assert loaded.cond_keys == adapter.cond_keys
    images, _ = first_frames(2)
    cond = adapter.encode_conditioning(PROMPTS, images)
    cond_loaded = loaded.encode_conditioning(PROMPTS, images)
    assert all(torch.equal(cond[k], cond_loaded[k]) for k in cond)
    x, sigma = noise(adapter, 2), torch.tensor([1.0, 0.05])
    with torch.no_grad():
        assert torch.equal(loaded(x, sigma, cond), adapter(x, sigma, cond))
        assert torch.equal(loaded.decode(x), adapter.decode(x))
    half = WanImageToVideoAdapter.from_pretrained(
        tmp_path / "pipe", torch_dtype=torch.bfloat16, **SETTINGS
    )
    assert half.transformer.dtype == half.image_encoder.dtype == torch.bfloat16
    cond_half = half.encode_conditioning(PROMPTS, images)
    assert cond_half["condition"].dtype == torch.float32  # as prepare_latents builds it
    with torch.no_grad():
        v = half(x, sigma, cond_half)
    assert v.dtype == torch.float32
    # the same model in bf16: measured max |Δ| 0.012 on velocities of std 0.6
    assert float((v - adapter(x, sigma, cond).detach()).abs().max()) < 0.05


def test_missing_and_odd_directories_raise_named_errors(adapter, tmp_path):
    with pytest.raises(FileNotFoundError, match="local diffusers pipeline directory"):
        WanImageToVideoAdapter.from_pretrained("Wan-AI/Wan2.1-I2V-14B-480P-Diffusers")
    with pytest.raises(FileNotFoundError, match="model_index.json"):
        adapter_for_directory(tmp_path)
    WanAdapter.tiny(seed=0).save_pretrained(tmp_path / "t2v")
    with pytest.raises(ValueError, match="'WanPipeline'.*WanImageToVideoPipeline"):
        WanImageToVideoAdapter.from_pretrained(tmp_path / "t2v", **SETTINGS)
    assert adapter_for_directory(tmp_path / "t2v") is WanAdapter
    # an I2V directory whose model_index.json drops the CLIP tower its transformer needs
    adapter.save_pretrained(tmp_path / "i2v")
    index_path = tmp_path / "i2v" / "model_index.json"
    index = json.loads(index_path.read_text())
    index["image_encoder"] = [None, None]
    index_path.write_text(json.dumps(index))
    shutil.rmtree(tmp_path / "i2v" / "image_encoder")
    with pytest.raises(ValueError, match="image_encoder: the transformer has image_dim=8"):
        WanImageToVideoAdapter.from_pretrained(tmp_path / "i2v", **SETTINGS)
    index_path.write_text(json.dumps({**index, "_class_name": "StableAudioPipeline"}))
    with pytest.raises(ValueError, match="_class_name is 'StableAudioPipeline'"):
        adapter_for_directory(tmp_path / "i2v")


def test_unsupported_wan_variants_are_refused_by_config_key():
    components, _ = WanImageToVideoAdapter._tiny_components(0)
    with pytest.raises(TypeError, match="wraps a WanImageToVideoPipeline, got WanPipeline"):
        t2v, _ = WanAdapter._tiny_components(0)
        WanImageToVideoAdapter(WanPipeline(**t2v))
    cases = {
        "expand_timesteps": {"expand_timesteps": True},
        "transformer_2 / boundary_ratio": {
            "transformer_2": copy.deepcopy(components["transformer"]),
            "boundary_ratio": 0.9,
        },
    }
    for key, extra in cases.items():
        with pytest.raises(ValueError, match=key):
            WanImageToVideoAdapter(WanImageToVideoPipeline(**components, **extra), **SETTINGS)
    pipe = WanImageToVideoPipeline(**components)
    with pytest.raises(ValueError, match="max_sequence_length: expected 512"):
        WanImageToVideoAdapter(pipe, max_sequence_length=16, **SETTINGS)
    t2v_transformer = WanAdapter._tiny_components(0)[0]["transformer"]
    with pytest.raises(ValueError, match=r"transformer.in_channels: expected .* = 10"):
        WanImageToVideoAdapter(
            WanImageToVideoPipeline(**{**components, "transformer": t2v_transformer}), **SETTINGS
        )


def test_bad_images_and_conditioning_name_the_field(adapter):
    images, _ = first_frames(2)
    with pytest.raises(ValueError, match=r"images: expected \[B, 3, 16, 16\]"):
        adapter.encode_conditioning(PROMPTS, torch.zeros(2, 3, 32, 32))
    with pytest.raises(ValueError, match=r"images: expected pixels in \[0, 1\]"):
        adapter.encode_conditioning(PROMPTS, images * 255)
    with pytest.raises(TypeError, match="images: expected floating pixels"):
        adapter.encode_conditioning(PROMPTS, (images * 255).to(torch.uint8))
    with pytest.raises(ValueError, match=r"one first frame per prompt \(3\), got 2"):
        adapter.encode_conditioning(PROMPTS + ["x"], images)
    with pytest.raises(ValueError, match="encode_conditioning"):
        adapter.encode_prompts(PROMPTS)
    with pytest.raises(ValueError, match="empty_conditioning"):
        adapter.empty_condition(2)
    cond = adapter.encode_conditioning(PROMPTS, images)
    x, sigma = noise(adapter, 2), torch.ones(2)
    with pytest.raises(KeyError, match="image_embeds.*encode_conditioning"):
        adapter(x, sigma, {k: v for k, v in cond.items() if k != "image_embeds"})
    with pytest.raises(ValueError, match=r"cond\['condition'\]: expected \[B, 6, 3, 8, 8\]"):
        adapter(x, sigma, {**cond, "condition": cond["condition"][:, 2:]})
