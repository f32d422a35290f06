"""Tests of the built-in prompt-conditioned flow DiT (the VelocityModel of the image tasks)."""

from __future__ import annotations

import json

import pydantic
import pytest
import torch
from flow_toy import fill_zero_layers, one_thread  # noqa: F401 (fixture: one CPU thread)

from diffusion_rl.models.dit import DEFAULT_VOCABULARY, FlowDiT, FlowDiTConfig
from diffusion_rl.models.protocol import VelocityModel
from diffusion_rl.sampling.flow import FlowSamplerConfig, sample_flow
from diffusion_rl.scoring.flow import FlowReplayScorer
from diffusion_rl.tasks.geneval import VOCABULARY, GenEvalConfig, GenEvalTask

PROMPTS = [
    "a red circle on the left",
    "two blue squares",
    "a green triangle in the center",
    "three yellow circles",
    "one red square",
]


def _model(seed: int = 0, **overrides) -> FlowDiT:
    """A small DiT whose zero-initialised layers (adaLN, output) are given random weights, so
    that every input actually reaches the output (a fresh model predicts exactly 0)."""
    torch.manual_seed(seed)
    settings = dict(image_size=16, patch_size=4, d_model=32, n_layers=2, n_heads=4)
    return fill_zero_layers(FlowDiT(FlowDiTConfig(**{**settings, **overrides})).eval())


def _inputs(model: FlowDiT, prompts: list[str], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(len(prompts), *model.latent_shape, generator=g)
    sigma = torch.rand(len(prompts), generator=g)
    return latents, sigma, model.encode_prompts(prompts)


def test_default_size_protocol_and_fresh_output():
    model = FlowDiT(FlowDiTConfig())
    assert isinstance(model, VelocityModel)
    assert model.latent_shape == (3, 16, 16)
    assert 200_000 <= model.num_parameters() <= 1_000_000  # 726,768 at the defaults
    latents, sigma, cond = _inputs(model, PROMPTS)
    v = model(latents, sigma, cond)
    assert v.shape == latents.shape and v.dtype == torch.float32
    assert torch.equal(v, torch.zeros_like(v))  # adaLN-Zero: a fresh model predicts v = 0
    assert model(latents.double(), sigma, cond).dtype == torch.float64


def test_prompt_encoding_and_null_condition():
    model = _model()
    cond = model.encode_prompts(["Two blue squares", "a red circle on the left"])
    word = {w: i + 1 for i, w in enumerate(VOCABULARY)}
    expected = [word["two"], word["blue"], word["squares"], 0, 0, 0, 0, 0]
    assert cond["prompt_ids"][0].tolist() == expected
    assert cond["prompt_mask"].sum(1).tolist() == [3, 6]
    empty = model.empty_condition(2)
    assert empty["prompt_ids"].shape == (2, 8) and not empty["prompt_mask"].any()
    assert not torch.equal(empty["prompt_ids"], cond["prompt_ids"])
    latents, sigma, _ = _inputs(model, PROMPTS[:2])
    assert not torch.allclose(model(latents, sigma, empty), model(latents, sigma, cond))
    # drop_condition: dropped rows become exactly the null prompt, others are untouched.
    dropped = FlowDiT.drop_condition(cond, torch.tensor([True, False]))
    assert torch.equal(dropped["prompt_ids"][0], empty["prompt_ids"][0])
    assert torch.equal(dropped["prompt_mask"][0], empty["prompt_mask"][0])
    assert torch.equal(dropped["prompt_ids"][1], cond["prompt_ids"][1])
    assert cond["prompt_mask"][0].any()  # the input was not modified
    with pytest.raises(ValueError, match=r"words \['cat'\] outside"):
        model.encode_prompts(["a red cat"])
    with pytest.raises(ValueError, match="max_prompt_tokens=8"):
        model.encode_prompts(["a red circle on the left a red circle"])
    with pytest.raises(ValueError, match="drop: expected a bool"):
        FlowDiT.drop_condition(cond, torch.tensor([1, 0]))


def test_sigma_and_prompt_change_the_velocity():
    model = _model()
    latents, sigma, cond = _inputs(model, PROMPTS)
    v = model(latents, sigma, cond)
    v_sigma = model(latents, sigma * 0.5, cond)
    v_prompt = model(latents, sigma, model.encode_prompts(PROMPTS[1:] + PROMPTS[:1]))
    for other in (v_sigma, v_prompt):
        per_row = (other - v).abs().flatten(1).amax(1)
        assert bool((per_row > 1e-3).all()), per_row
    # Deterministic: the same call twice is bitwise equal.
    assert torch.equal(model(latents, sigma, cond), v)


@torch.no_grad()
def test_rows_are_independent_of_batch_mates_and_padding_contents():
    """Equal to fp32 rounding (GEMMs of other sizes may sum in another order): <= 1e-6 on
    velocities of size ~1."""
    model = _model()
    latents, sigma, cond = _inputs(model, PROMPTS)
    batch = model(latents, sigma, cond)
    assert 0.5 < batch.abs().max() < 3
    for row in range(len(PROMPTS)):
        alone = model(
            latents[row : row + 1],
            sigma[row : row + 1],
            {k: v[row : row + 1] for k, v in cond.items()},
        )
        assert (alone - batch[row : row + 1]).abs().max() <= 1e-6
    # A CFG batch [cond; uncond] gives each half what it gives alone.
    empty = model.empty_condition(len(PROMPTS))
    both = {k: torch.cat([cond[k], empty[k]]) for k in cond}
    doubled = model(torch.cat([latents, latents]), torch.cat([sigma, sigma]), both)
    assert (doubled[: len(PROMPTS)] - batch).abs().max() <= 1e-6
    assert (doubled[len(PROMPTS) :] - model(latents, sigma, empty)).abs().max() <= 1e-6
    # Ids in masked (padding) slots are never read.
    junk = dict(cond)
    junk["prompt_ids"] = torch.where(cond["prompt_mask"], cond["prompt_ids"], 7)
    assert torch.equal(model(latents, sigma, junk), batch)


def test_input_errors_name_the_field():
    model = _model()
    latents, sigma, cond = _inputs(model, PROMPTS[:2])
    with pytest.raises(ValueError, match=r"latents: expected \[B, 3, 16, 16\]"):
        model(latents[:, :2], sigma, cond)
    with pytest.raises(ValueError, match=r"sigma: expected shape \[2\]"):
        model(latents, sigma[:1], cond)
    with pytest.raises(ValueError, match=r"cond: missing \['prompt_mask'\]"):
        model(latents, sigma, {"prompt_ids": cond["prompt_ids"]})
    with pytest.raises(ValueError, match="prompt_ids and prompt_mask"):
        model(latents, sigma, model.encode_prompts(PROMPTS[:3]))
    with pytest.raises(pydantic.ValidationError, match="divisible by patch_size"):
        FlowDiTConfig(image_size=18, patch_size=4)
    with pytest.raises(pydantic.ValidationError, match="vocabulary"):
        FlowDiTConfig(vocabulary=("red", "red"))
    # The default vocabulary is the mini-GenEval words, in the task's order (the ids).
    assert FlowDiTConfig().vocabulary == DEFAULT_VOCABULARY == VOCABULARY
    # A 0-dim sigma is broadcast to every row.
    assert torch.equal(
        model(latents, torch.tensor(0.3), cond), model(latents, torch.full((2,), 0.3), cond)
    )


def test_pixels_round_trip():
    model = _model()
    images = GenEvalTask(GenEvalConfig(image_size=16)).render_batch(PROMPTS[:2], [0, 1])
    latents = model.encode_images(images)
    assert latents.min() == -1 and latents.max() == 1
    assert torch.equal(model.decode(latents), images)
    assert torch.equal(model.decode(torch.tensor([-3.0, 0.0, 3.0])), torch.tensor([0.0, 0.5, 1.0]))


def test_save_load_round_trip(tmp_path):
    task = GenEvalTask(GenEvalConfig(image_size=16, seed=3))
    model = _model(task=task.info())
    path = model.save_pretrained(tmp_path / "dit")
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "diffusion_rl.flow_dit"
    assert config["vocabulary"] == list(VOCABULARY) and config["task"]["seed"] == 3
    loaded = FlowDiT.from_pretrained(path)
    assert loaded.config == model.config and not loaded.training
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    latents, sigma, cond = _inputs(model, PROMPTS)
    assert torch.equal(loaded(latents, sigma, cond), model(latents, sigma, cond))
    model.save_pretrained(path)  # overwriting an existing directory is atomic and allowed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dit"]
    (path / "config.json").write_text(json.dumps({**config, "model_type": "other"}))
    with pytest.raises(ValueError, match="model_type must be"):
        FlowDiT.from_pretrained(path)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        FlowDiT.from_pretrained(tmp_path / "missing")


def test_flow_matching_training_learns_more_than_pixel_statistics():
    """A minimal rectified-flow loop (x_σ = (1-σ) x0 + σ ε, target ε - x0) on rendered
    mini-GenEval images. On a fixed held-out batch the loss must fall 3x from the fresh model's
    (which predicts 0) and below the best predictor that knows only each pixel's mean and
    variance: per pixel, v̂ = -μ + c/V (x_σ - (1-σ)μ) with c = σ - (1-σ)s², V = (1-σ)²s² + σ²,
    the optimal linear predictor for independent Gaussian pixels (computed from 2000 renders)."""
    torch.manual_seed(0)
    task = GenEvalTask(GenEvalConfig(image_size=16))
    model = FlowDiT(FlowDiTConfig(image_size=16, patch_size=4, d_model=64, n_layers=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)

    def noised(images):
        x0 = model.encode_images(images)
        sigma = torch.rand(x0.shape[0], generator=g)
        eps = torch.randn(x0.shape, generator=g)
        s = sigma[:, None, None, None]
        return (1 - s) * x0 + s * eps, sigma, eps - x0

    held_examples, held_images = task.train_batch(1000, 64)
    x_held, sigma_held, target_held = noised(held_images)
    cond_held = model.encode_prompts([e.prompt for e in held_examples])

    def held_loss() -> float:
        with torch.no_grad():
            return float(((model(x_held, sigma_held, cond_held) - target_held) ** 2).mean())

    pixels = model.encode_images(task.train_batch(10, 2000)[1])
    mu, var = pixels.mean(0), pixels.var(0)
    s = sigma_held[:, None, None, None]
    gaussian = -mu + (s - (1 - s) * var) / ((1 - s) ** 2 * var + s**2) * (x_held - (1 - s) * mu)
    gaussian_loss = float(((gaussian - target_held) ** 2).mean())

    before = held_loss()
    assert before == pytest.approx(float((target_held**2).mean()))  # a fresh model predicts 0
    for step in range(100):
        examples, images = task.train_batch(step, 32)
        x, sigma, target = noised(images)
        cond = model.encode_prompts([e.prompt for e in examples])
        cond = model.drop_condition(cond, torch.rand(32, generator=g) < 0.1)
        loss = ((model(x, sigma, cond) - target) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = held_loss()
    # Measured: fresh 1.99, per-pixel Gaussian 0.75, trained 0.51 (~7 s on one core).
    assert after < before / 3 and after < gaussian_loss - 0.1, (before, gaussian_loss, after)


def test_sde_rollout_replays_bitwise():
    """Through the project's flow sampler (SDE steps, CFG, capture) and exact replay: at the
    behaviour weights the replayed step log-probs equal the recorded ones bitwise, and a row
    sampled alone matches the same row sampled in the batch."""
    model = _model()
    config = FlowSamplerConfig(num_steps=6, mode="sde", guidance_scale=3.0)
    sample = sample_flow(model, PROMPTS, config, seeds=list(range(5)), capture=True)
    trace = sample.trace
    steps = trace.sde_step_indices()
    assert steps == [0, 1, 2, 3, 4]
    with torch.no_grad():
        replayed = FlowReplayScorer.for_trace(model, trace).score_trace(trace)
    assert torch.equal(replayed.logprobs, trace.behaviour_logprobs[:, steps])
    alone = sample_flow(model, PROMPTS[2:3], config, seeds=[2])
    assert (alone.latents - sample.latents[2:3]).abs().max() <= 2e-6  # measured 4.8e-7
    assert sample.images.min() >= 0 and sample.images.max() <= 1
