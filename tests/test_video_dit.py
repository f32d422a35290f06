"""Tests of the built-in image-to-video flow model VideoDiT (first-frame conditioning by
channel concatenation): sizes, token layout, conditioning, save/load, bounded loading, exact
SDE replay through the flow sampler, and flow-matching SFT on toy moving-square clips."""

from __future__ import annotations

import json
import time

import pydantic
import pytest
import torch
from conftest import write_config
from flow_toy import fill_zero_layers, one_thread  # noqa: F401 (fixture: one CPU thread)

from diffusion_rl.models import (
    FlowDiT,
    FlowDiTConfig,
    VelocityModel,
    VideoDiT,
    VideoDiTConfig,
    load_model,
    save_model,
)
from diffusion_rl.models import io as model_io
from diffusion_rl.models.video_dit import MODEL_TYPE, VIDEO_SIZE_LIMITS, parameter_count
from diffusion_rl.objectives.flow_sft import FlowMatchingSFT, FlowSFTConfig, flow_sft_batch
from diffusion_rl.sampling.flow import FlowSamplerConfig, sample_flow
from diffusion_rl.scoring.flow import FlowReplayScorer
from diffusion_rl.seeding import noise_keys
from diffusion_rl.train import OptimConfig, Trainer

PROMPTS = ["a red square right", "a blue circle left", "two green triangles"]
TINY = dict(image_size=8, patch_size=4, d_model=32, n_layers=2, n_heads=4, num_frames=3)


def _model(seed: int = 0, **overrides) -> VideoDiT:
    """A tiny VideoDiT whose zero-initialised layers (adaLN, output) get random weights, so
    every input reaches the output (a fresh model predicts exactly 0)."""
    torch.manual_seed(seed)
    return fill_zero_layers(VideoDiT(VideoDiTConfig(**{**TINY, **overrides})).eval())


def _images(rows: int, size: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.rand(rows, 3, size, size, generator=torch.Generator().manual_seed(seed))


def _inputs(model: VideoDiT, prompts: list[str], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(len(prompts), *model.latent_shape, generator=g)
    sigma = torch.rand(len(prompts), generator=g)
    images = torch.rand(len(prompts), *model.image_shape, generator=g)
    return latents, sigma, model.encode_conditioning(prompts, images)


def _rows(cond: dict, rows) -> dict:
    return {k: v[rows] for k, v in cond.items()}


# ----------------------------------------------------------------------------- sizes
@pytest.mark.parametrize(
    "config",
    [
        VideoDiTConfig(),  # the default: 733,680
        VideoDiTConfig(**TINY),
        VideoDiTConfig(**{**TINY, "num_frames": 7, "mlp_ratio": 2.5, "sigma_features": 16}),
        VideoDiTConfig(image_size=12, patch_size=2, d_model=24, n_layers=3, n_heads=3),
        VideoDiTConfig(**{**TINY, "vocabulary": ("a", "b"), "max_prompt_tokens": 3}),
    ],
)
def test_parameter_count_is_exact(config):
    model = VideoDiT(config)
    built = sum(p.numel() for p in model.parameters())
    assert parameter_count(config) == model.num_parameters() == built
    # independently: FlowDiT's count, a (2C+1)p²-wide patch embedding and F frame positions
    image = FlowDiT(FlowDiTConfig(**config.model_dump(exclude={"num_frames"})))
    p, d = config.patch_size, config.d_model
    assert built == image.num_parameters() + 4 * p * p * d + config.num_frames * d
    assert model.patch_embed.in_features == 7 * p * p  # (2C + 1) p² with C = 3
    assert model.frame_pos.shape == (config.num_frames, d)
    data = {"model_type": MODEL_TYPE, **config.model_dump(mode="json")}
    assert model_io.estimate_parameters(data) == built


def test_default_size_protocol_and_fresh_output():
    model = VideoDiT(VideoDiTConfig())
    assert isinstance(model, VelocityModel)
    assert model.latent_shape == (3, 8, 16, 16) and model.image_shape == (3, 16, 16)
    assert model.num_frames == 8 and model.num_parameters() == 733_680
    latents = torch.randn(2, *model.latent_shape)
    cond = model.encode_conditioning(PROMPTS[:2], _images(2, 16))
    v = model(latents, torch.rand(2), cond)
    assert v.shape == latents.shape and v.dtype == torch.float32
    assert torch.equal(v, torch.zeros_like(v))  # adaLN-Zero: a fresh model predicts v = 0
    assert model(latents.double(), torch.rand(2), cond).dtype == torch.float64


# ----------------------------------------------------------------------------- layout
def test_patch_tokens_concatenate_frame_condition_and_mask():
    """Token (f, gy, gx) holds the noisy frame-f patch, then the first frame's patch at the
    same place (every frame), then the mask patch (ones for f = 0): built element by element."""
    model = _model()
    b, (c, frames, s, _), p = 2, model.latent_shape, model.config.patch_size
    g = torch.Generator().manual_seed(3)
    latents = torch.randn(b, c, frames, s, s, generator=g)
    first = torch.randn(b, c, s, s, generator=g)
    tokens = model._patch_inputs(latents, first)
    grid = s // p
    assert tokens.shape == (b, frames * grid * grid, (2 * c + 1) * p * p)
    for f in range(frames):
        for gy in range(grid):
            for gx in range(grid):
                window = (slice(gy * p, (gy + 1) * p), slice(gx * p, (gx + 1) * p))
                noisy = latents[:, :, f][(slice(None), slice(None), *window)].reshape(b, -1)
                given = first[(slice(None), slice(None), *window)].reshape(b, -1)
                expected = torch.cat(
                    [
                        noisy,
                        given,
                        torch.full((b, p * p), 1.0 if f == 0 else 0.0),
                    ],
                    dim=1,
                )
                assert torch.equal(tokens[:, (f * grid + gy) * grid + gx], expected), (f, gy, gx)


def test_output_depends_on_first_frame_prompt_and_every_frame():
    model = _model()
    latents, sigma, cond = _inputs(model, PROMPTS)
    v = model(latents, sigma, cond)

    def changed(other: torch.Tensor) -> torch.Tensor:
        return (other - v).abs().flatten(1).amax(1)

    other_frames = {**cond, "first_frame": cond["first_frame"].roll(1, 0)}
    other_prompts = model.encode_conditioning(PROMPTS[1:] + PROMPTS[:1], torch.zeros(3, 3, 8, 8))
    other_prompts["first_frame"] = cond["first_frame"]
    for other in (model(latents, sigma, other_frames), model(latents, sigma, other_prompts)):
        assert bool((changed(other) > 1e-3).all()), changed(other)
    # the first frame reaches every output frame (attention), not only frame 0
    per_frame = (model(latents, sigma, other_frames) - v).abs().amax(dim=(0, 1, 3, 4))
    assert bool((per_frame > 1e-3).all()), per_frame
    # frame positions: the same noisy content in two frames gives two different velocities
    same = latents[:, :, :1].expand_as(latents).contiguous()
    out = model(same, sigma, {**cond, "first_frame": torch.zeros_like(cond["first_frame"])})
    assert (out[:, :, 1] - out[:, :, 2]).abs().max() > 1e-3
    assert torch.equal(model(latents, sigma, cond), v)  # deterministic


# ----------------------------------------------------------------------------- conditioning
def test_conditioning_prompt_first_frame_null_and_drop():
    model = _model()
    images = _images(2)
    cond = model.encode_conditioning(["Two blue squares", "a red circle on the left"], images)
    reference = FlowDiT(FlowDiTConfig()).encode_prompts(
        ["two blue squares", "a red circle on the left"]
    )
    assert sorted(cond) == ["first_frame", "prompt_ids", "prompt_mask"]
    assert torch.equal(cond["prompt_ids"], reference["prompt_ids"])
    assert torch.equal(cond["prompt_mask"], reference["prompt_mask"])
    assert cond["first_frame"].dtype == torch.float32
    assert torch.equal(cond["first_frame"], images * 2 - 1)
    empty = model.empty_conditioning(images)
    assert torch.equal(empty["first_frame"], cond["first_frame"])  # the SAME first frame
    assert not empty["prompt_mask"].any() and not empty["prompt_ids"].any()
    assert empty["prompt_ids"].shape == cond["prompt_ids"].shape
    dropped = VideoDiT.drop_condition(cond, torch.tensor([True, False]))
    assert torch.equal(dropped["first_frame"], cond["first_frame"])
    assert torch.equal(dropped["prompt_ids"][0], empty["prompt_ids"][0])
    assert torch.equal(dropped["prompt_mask"][0], empty["prompt_mask"][0])
    assert torch.equal(dropped["prompt_ids"][1], cond["prompt_ids"][1])
    assert cond["prompt_mask"][0].any()  # the input was not modified
    with pytest.raises(ValueError, match="drop: expected a bool"):
        VideoDiT.drop_condition(cond, torch.tensor([1, 0]))
    # a prompt alone cannot condition a clip: the errors give the fix
    with pytest.raises(ValueError, match=r"cond=model\.encode_conditioning\(prompts, images\)"):
        model.encode_prompts(["a red square"])
    with pytest.raises(ValueError, match=r"uncond=model\.empty_conditioning\(images\)"):
        model.empty_condition(2)
    config = FlowSamplerConfig(num_steps=2, guidance_scale=1.0)
    with pytest.raises(ValueError, match=r"encode_conditioning\(prompts, images\)"):
        sample_flow(model, ["a red square"], config, seeds=[0])


def test_pixels_round_trip_and_layout():
    model = _model()
    clips = torch.rand(2, 3, 3, 8, 8, generator=torch.Generator().manual_seed(1))  # [B,F,3,S,S]
    latents = model.encode_videos(clips)
    assert latents.shape == (2, *model.latent_shape) and latents.dtype == torch.float32
    assert float(latents[1, 2, 0, 5, 3]) == pytest.approx(2 * float(clips[1, 0, 2, 5, 3]) - 1)
    assert torch.allclose(model.decode(latents), clips, atol=1e-7)
    extreme = torch.full((1, *model.latent_shape), 3.0)
    extreme[:, 0, 1] = -3.0
    pixels = model.decode(extreme)
    assert pixels.shape == (1, 3, 3, 8, 8)
    assert torch.equal(pixels[0, 1, 0], torch.zeros(8, 8))  # frame 1, channel 0: clamped to 0
    assert torch.equal(pixels[0, 0], torch.ones(3, 8, 8))


def test_input_errors_name_the_argument():
    model = _model()
    latents, sigma, cond = _inputs(model, PROMPTS[:2])
    with pytest.raises(ValueError, match=r"latents: expected \[B, 3, 3, 8, 8\]"):
        model(latents[:, :, :2], sigma, cond)
    with pytest.raises(ValueError, match=r"latents: expected \[B, 3, 3, 8, 8\]"):
        model(latents[:, :, 0], sigma, cond)
    with pytest.raises(ValueError, match=r"sigma: expected shape \[2\]"):
        model(latents, sigma[:1], cond)
    with pytest.raises(ValueError, match=r"cond: missing \['first_frame'\].*encode_conditioning"):
        model(latents, sigma, {k: v for k, v in cond.items() if k != "first_frame"})
    with pytest.raises(ValueError, match=r"first_frame must be a float \[2, 3, 8, 8\]"):
        model(latents, sigma, {**cond, "first_frame": cond["first_frame"][:, :, :4]})
    with pytest.raises(ValueError, match="prompt_ids and prompt_mask"):
        model(latents, sigma, {**cond, "prompt_ids": cond["prompt_ids"][:1]})
    with pytest.raises(ValueError, match=r"images: expected \[B, 3, 8, 8\], got \(2, 3, 16, 16\)"):
        model.encode_conditioning(PROMPTS[:2], _images(2, 16))
    with pytest.raises(ValueError, match=r"images: expected pixels in \[0, 1\].*1/255"):
        model.encode_conditioning(PROMPTS[:2], _images(2) * 255)
    with pytest.raises(TypeError, match="images: expected floating pixels"):
        model.encode_conditioning(PROMPTS[:2], (_images(2) * 255).to(torch.uint8))
    with pytest.raises(ValueError, match=r"images: expected one first frame per prompt \(3\)"):
        model.encode_conditioning(PROMPTS, _images(2))
    with pytest.raises(TypeError, match="prompts: expected a sequence"):
        model.encode_conditioning("a red square", _images(1))
    with pytest.raises(ValueError, match=r"clips: expected \[B, 3, 3, 8, 8\]"):
        model.encode_videos(torch.rand(2, 3, 3, 8, 8).transpose(1, 2)[:, :2])
    with pytest.raises(ValueError, match=r"latents: expected \[B, 3, 3, 8, 8\]"):
        model.decode(torch.zeros(2, 3, 8, 8))
    with pytest.raises(TypeError, match="config: expected a VideoDiTConfig"):
        VideoDiT(FlowDiTConfig())
    assert torch.equal(  # a 0-dim sigma is broadcast to every row
        model(latents, torch.tensor(0.3), cond), model(latents, torch.full((2,), 0.3), cond)
    )


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"num_frames": 1}, r"num_frames\n.*greater than or equal to 2"),
        ({"num_frames": 2000}, r"num_frames\n.*less than or equal to 1024"),
        ({"num_frames": True}, r"num_frames\n.*expected an integer, got bool True"),
        ({"num_frames": 4.0}, r"num_frames\n.*expected an integer, got float 4.0"),
        ({"channels": 1}, r"channels: a VideoDiT's latent is the RGB clip, so channels must be 3"),
        (
            {"image_size": 512, "patch_size": 2, "num_frames": 2},
            r"num_frames: 2 frames of 512 px in patches of 2 give 131072 patch tokens, more "
            r"than the limit 65536; use fewer frames or larger patches",
        ),
        ({"image_size": 10}, r"image_size: must be divisible by patch_size=4"),
        ({"extra": 1}, r"extra\n.*Extra inputs are not permitted"),
    ],
)
def test_config_errors_name_the_field(change, match):
    with pytest.raises(pydantic.ValidationError, match=match):
        VideoDiTConfig(**{**TINY, **change})


# ----------------------------------------------------------------------------- batch mates
@torch.no_grad()
def test_rows_are_independent_of_batch_mates():
    model = _model()
    latents, sigma, cond = _inputs(model, PROMPTS)
    batch = model(latents, sigma, cond)
    assert 0.3 < batch.abs().max() < 5
    for row in range(3):
        alone = model(
            latents[row : row + 1], sigma[row : row + 1], _rows(cond, slice(row, row + 1))
        )
        assert (alone - batch[row : row + 1]).abs().max() <= 1e-6
    empty = model.empty_conditioning((cond["first_frame"] + 1) / 2)
    both = {k: torch.cat([cond[k], empty[k]]) for k in cond}  # a CFG batch [cond; uncond]
    doubled = model(torch.cat([latents, latents]), torch.cat([sigma, sigma]), both)
    assert (doubled[:3] - batch).abs().max() <= 1e-6
    assert (doubled[3:] - model(latents, sigma, empty)).abs().max() <= 1e-6


# ----------------------------------------------------------------------------- save / load
def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and torch.equal(sa[name], sb[name]), name


def test_save_load_round_trip(tmp_path):
    model = _model(task={"name": "mini-motion", "seed": 3})
    path = model.save_pretrained(tmp_path / "video")
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == MODEL_TYPE == "diffusion_rl.flow_video_dit"
    assert config["num_frames"] == 3 and config["task"] == {"name": "mini-motion", "seed": 3}
    loaded = VideoDiT.from_pretrained(path)
    assert isinstance(loaded, VideoDiT) and loaded.config == model.config and not loaded.training
    _assert_same_weights(model, loaded)
    latents, sigma, cond = _inputs(model, PROMPTS)
    assert torch.equal(loaded(latents, sigma, cond), model(latents, sigma, cond))
    model.save_pretrained(path)  # overwriting is atomic and allowed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["video"]
    with pytest.raises(ValueError, match="model_type must be 'diffusion_rl.flow_dit'"):
        FlowDiT.from_pretrained(path)
    image_dir = FlowDiT(FlowDiTConfig(image_size=8, d_model=32)).save_pretrained(tmp_path / "i")
    with pytest.raises(ValueError, match="model_type must be 'diffusion_rl.flow_video_dit'"):
        VideoDiT.from_pretrained(image_dir)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        VideoDiT.from_pretrained(tmp_path / "missing")


def test_load_model_and_save_model_round_trip(tmp_path):
    model = _model(seed=1, task={"name": "mini-motion"}).train()
    info = {"sampler": {"num_steps": 4}, "trained_steps": 7}
    path = save_model(tmp_path / "m", model, info)
    assert sorted(p.name for p in path.iterdir()) == [
        "config.json",
        "diffusion_rl.json",
        "manifest.json",
        "model.safetensors",
    ]
    loaded = load_model(path)
    assert loaded.kind == "flow" and loaded.tokenizer is None
    assert isinstance(loaded.model, VideoDiT) and not loaded.model.training
    assert loaded.info == {**info, "task": {"name": "mini-motion"}}
    _assert_same_weights(model, loaded.model)
    checked = model_io.check_model_directory(path)
    # by hand (C 3, p 4, D 32, G² 4, F 3, 23 words, T 8, E 64, H 128, 2 layers): patch embed
    # 7·16·32 + 32, positions (4 + 3)·32; prompt 24·32 + 8·32 + 32² + 32; σ MLP 64·32 + 32 +
    # 32² + 32; per block 3·32² + 96 + 32² + 32 + 2·32·128 + 128 + 32 + 6·32² + 192; final
    # 2·32² + 64 + 32·48 + 48
    assert checked["model_type"] == MODEL_TYPE and checked["num_parameters"] == 50_576
    assert model_io.MODEL_LIMITS[MODEL_TYPE] is VIDEO_SIZE_LIMITS
    assert VIDEO_SIZE_LIMITS["num_frames"] == 1024 and VIDEO_SIZE_LIMITS["patches"] == 1 << 16


# ----------------------------------------------------------------------------- bounded loading
VIDEO_CONFIG = {"model_type": MODEL_TYPE, **TINY}
MAX_REFUSAL_S = 1.0


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"num_frames": 10**9}, r"num_frames=1000000000 exceeds the limit 1024"),
        ({"num_frames": 0}, r"num_frames: must be >= 2 \(got 0\)"),
        ({"num_frames": True}, r"num_frames: expected an integer, got bool True"),
        ({"num_frames": "8"}, r"num_frames: expected an integer, got str '8'"),
        ({"d_model": 2**31}, r"d_model=2147483648 exceeds the limit 65536"),
        ({"n_layers": 10**7}, r"n_layers=10000000 exceeds the limit 1024"),
        ({"image_size": 2**31}, r"image_size=2147483648 exceeds the limit 4096"),
        ({"channels": 4}, r"channels: a VideoDiT's latent is the RGB clip"),
        (
            {"image_size": 1024, "patch_size": 4, "num_frames": 2},
            r"num_frames: 2 frames of 1024 px in patches of 4 give 131072 patch tokens",
        ),
        ({"frames": 4}, r"frames: unknown key; remove it or check its spelling"),
    ],
)
def test_config_json_beyond_limits_is_refused_before_allocation(
    tmp_path, never_built, change, match
):
    path = write_config(tmp_path / "m", {**VIDEO_CONFIG, **change})
    start = time.perf_counter()
    with pytest.raises(model_io.ModelConfigError, match=f"^{path / 'config.json'}: {match}"):
        load_model(path)
    assert time.perf_counter() - start < MAX_REFUSAL_S


def test_a_model_larger_than_memory_is_refused_with_its_estimate(tmp_path, monkeypatch):
    monkeypatch.setattr(model_io, "available_memory", lambda: 1 << 30)  # a 1 GiB machine
    config = {**VIDEO_CONFIG, "d_model": 1024, "n_layers": 16, "n_heads": 16}
    count = model_io.estimate_parameters(config)
    d, f, p = 1024, 3, 4
    image = {**config, "model_type": "diffusion_rl.flow_dit"}
    image.pop("num_frames")
    assert count == model_io.estimate_parameters(image) + 4 * p * p * d + f * d
    path = write_config(tmp_path / "big", config)
    with monkeypatch.context() as patched:
        patched.setattr(VideoDiT, "__init__", None)  # building it would be a TypeError
        with pytest.raises(model_io.ModelTooLargeError, match=rf"{count:,} parameters would need"):
            load_model(path)
    small = save_model(tmp_path / "small", _model(), {})
    assert isinstance(load_model(small).model, VideoDiT)


# ----------------------------------------------------------------------------- sampling
SDE = FlowSamplerConfig(mode="sde", num_steps=4, guidance_scale=2.0)


def _sample(model, rows, **options):
    images = _images(3, seed=5)[rows]
    prompts = PROMPTS[rows]
    return sample_flow(
        model,
        prompts,
        options.pop("config", SDE),
        seeds=list(range(10, 13))[rows],
        cond=model.encode_conditioning(prompts, images),
        uncond=model.empty_conditioning(images),
        **options,
    )


def test_sde_rollout_replays_bitwise_and_rows_are_independent():
    model = _model()
    sample = _sample(model, slice(0, 3), capture=True)
    trace = sample.trace
    steps = trace.sde_step_indices()
    assert steps == [0, 1, 2]
    assert trace.cond["first_frame"].shape == (3, 3, 8, 8)
    assert torch.equal(trace.cond["first_frame"], trace.uncond["first_frame"])
    with torch.no_grad():
        replayed = FlowReplayScorer.for_trace(model, trace).score_trace(trace)
    assert torch.equal(replayed.logprobs, trace.behaviour_logprobs[:, steps])
    assert bool((trace.behaviour_logprobs[:, steps] != 0).all())
    # the parity is not vacuous: another model gives other log-probs
    with torch.no_grad():
        other = FlowReplayScorer.for_trace(_model(seed=1), trace).score_trace(trace)
    assert (other.logprobs - replayed.logprobs).abs().max() > 1e-3
    # capture on or off: bitwise the same sample
    assert torch.equal(_sample(model, slice(0, 3)).latents, sample.latents)
    # a row sampled alone equals the same row in the batch of 3
    for row in range(3):
        alone = _sample(model, slice(row, row + 1))
        assert torch.allclose(alone.latents, sample.latents[row : row + 1], atol=1e-5, rtol=0)
    assert sample.images.shape == (3, 3, 3, 8, 8)  # [B, F, 3, S, S]
    assert sample.images.min() >= 0 and sample.images.max() <= 1


# ----------------------------------------------------------------------------- flow SFT
COLOURS = {"red": (1.0, 0.1, 0.1), "green": (0.1, 0.9, 0.2), "blue": (0.15, 0.2, 1.0)}


def moving_squares(rows: int, seed: int, frames: int = 4, size: int = 8):
    """Clips ``[rows, F, 3, S, S]`` of a 3×3 square on grey moving 1 px per frame in the
    prompted direction ("a red square right"), their prompts and first frames."""
    g = torch.Generator().manual_seed(seed)
    clips = torch.full((rows, frames, 3, size, size), 0.5)
    prompts = []
    for b in range(rows):
        colour = list(COLOURS)[int(torch.randint(3, (), generator=g))]
        direction = ("left", "right")[int(torch.randint(2, (), generator=g))]
        y = int(torch.randint(size - 2, (), generator=g))
        x = int(torch.randint(size - 2 - frames + 1, (), generator=g))
        step = 1 if direction == "right" else -1
        x = x if direction == "right" else x + frames - 1
        for f in range(frames):
            left = x + step * f
            clips[b, f, :, y : y + 3, left : left + 3] = torch.tensor(COLOURS[colour])[
                :, None, None
            ]
        prompts.append(f"a {colour} square {direction}")
    return clips, prompts, clips[:, 0]


def _video_batch(model, clips, prompts, first, keys):
    return flow_sft_batch(
        model,
        model.encode_videos(clips),
        prompts,
        noise_seeds=keys,
        cond=model.encode_conditioning(prompts, first),
        uncond=model.empty_conditioning(first),
    )


def test_flow_sft_on_moving_squares_lowers_the_loss():
    """30 Trainer steps of flow SFT (lr 3e-3, explicit cond / uncond, 10 % dropout) on clips of
    a square moving as the prompt says, the first frame given; held-out loss on fixed noise."""
    torch.manual_seed(0)
    model = VideoDiT(VideoDiTConfig(**{**TINY, "num_frames": 4, "patch_size": 2}))
    loss = FlowMatchingSFT(FlowSFTConfig(sigma_sampling="uniform", cond_dropout=0.1))
    trainer = Trainer(model, loss, OptimConfig(lr=3e-3), seed=0)
    held = _video_batch(model, *moving_squares(32, seed=999), noise_keys(range(32), 123))

    def evaluate() -> float:
        with torch.no_grad():
            return float(loss(model, held, None).primary.value)

    before = evaluate()
    for step in range(30):
        clips, prompts, first = moving_squares(16, seed=step)
        keys = noise_keys(range(step * 16, (step + 1) * 16), 0, step)
        assert trainer.train_step([_video_batch(model, clips, prompts, first, keys)]).applied
    after = evaluate()
    # the first frame is used: the held-out clips with another clip's first frame fit worse
    first = held["cond"]["first_frame"]
    wrong = {**held, "cond": {**held["cond"], "first_frame": first.roll(1, 0)}}
    with torch.no_grad():
        mismatched = float(loss(model, wrong, None).primary.value)
    # measured (one thread, ~4 s): 1.099 -> 0.343; mismatched first frames 0.399
    assert after < 0.4 * before, (before, after)
    assert mismatched > 1.1 * after, (after, mismatched)


def test_cond_dropout_swaps_in_the_explicit_uncond_rows():
    """Hand computation from the documented per-row draws (σ, ε, then the dropout uniform):
    a dropped row takes ITS uncond row (here another first frame and a null prompt), not the
    model's empty condition (which a VideoDiT refuses to make)."""
    model = _model()
    config = FlowSFTConfig(sigma_sampling="uniform", cond_dropout=0.5)
    clips, prompts, first = moving_squares(6, seed=4, frames=3)
    x0 = model.encode_videos(clips)
    keys = torch.tensor([5, 17, 2**62, 3, 99, 0])
    cond = model.encode_conditioning(prompts, first)
    uncond = model.empty_conditioning(first.flip(-1))  # a recognisably different first frame
    batch = flow_sft_batch(model, x0, prompts, noise_seeds=keys, cond=cond, uncond=uncond)
    assert batch["cond"] is cond and batch["uncond"] is uncond
    with torch.no_grad():
        out = FlowMatchingSFT(config)(model, batch, None)

    def hand(swap: dict) -> float:
        total = 0.0
        for b in range(6):
            g = torch.Generator().manual_seed(int(keys[b]))
            sigma = torch.rand((), generator=g)
            eps = torch.randn(x0.shape[1:], generator=g)
            drop = bool(torch.rand((), generator=g) < 0.5)
            row = _rows(swap if drop else cond, slice(b, b + 1))
            x_sigma = (1 - sigma) * x0[b] + sigma * eps
            with torch.no_grad():
                v = model(x_sigma[None], sigma[None], row)[0]
            total += float(((v - (eps - x0[b])) ** 2).mean())
        return total

    drops = [
        bool(torch.rand((), generator=_skip(int(k), x0.shape[1:])) < 0.5) for k in keys.tolist()
    ]
    assert any(drops) and not all(drops)  # both branches exercised
    assert float(out.primary.sum) == pytest.approx(hand(uncond), rel=1e-5)
    # the tolerance discriminates: the null prompt with the rows' OWN first frames is off
    own = VideoDiT.drop_condition(cond, torch.ones(6, dtype=torch.bool))
    assert abs(hand(own) - hand(uncond)) > 1e-3 * hand(uncond)
    # without an explicit uncond, dropout needs the model's empty condition: refused, with the fix
    plain = flow_sft_batch(model, x0, prompts, noise_seeds=keys, cond=cond)
    with pytest.raises(ValueError, match=r"uncond=model\.empty_conditioning\(images\)"):
        FlowMatchingSFT(config)(model, plain, None)
    with pytest.raises(ValueError, match=r"uncond\['first_frame'\]: expected the shape"):
        flow_sft_batch(
            model,
            x0,
            prompts,
            noise_seeds=keys,
            cond=cond,
            uncond={**uncond, "first_frame": uncond["first_frame"][:, :, :4]},
        )


def _skip(key: int, latent_shape) -> torch.Generator:
    """Row ``key``'s stream advanced past σ and ε (the next draw is the dropout uniform)."""
    g = torch.Generator().manual_seed(key)
    torch.rand((), generator=g)
    torch.randn(latent_shape, generator=g)
    return g
