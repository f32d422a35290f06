"""Rectified-flow SFT: the loss against a hand computation (both σ samplings, weights,
conditioning dropout), a few Trainer steps lowering it on a toy dataset, and per-row noise
(any micro-batch split, any batch composition: the same update; steps draw fresh noise)."""

import math

import pytest
import torch
from flow_toy import TinyVelocity, one_thread  # noqa: F401 (fixture)
from safetensors.torch import load_file

from diffusion_rl.config import FlowSFTRecipeConfig, build_config
from diffusion_rl.objectives.flow_sft import FlowMatchingSFT, FlowSFTConfig, flow_sft_batch
from diffusion_rl.recipes.flow_sft import run_flow_sft
from diffusion_rl.seeding import noise_keys
from diffusion_rl.train import OptimConfig, Trainer

KEYS = torch.tensor([5, 17, 2**62, 3, 99, 0])


def hand_loss(model, x0, labels, weights, keys, config):
    """Row b's own stream ``Generator().manual_seed(keys[b])``, drawn in the documented
    order: σ, ε, then the dropout."""
    rows = x0.shape[0]
    sigma, eps, drop = torch.zeros(rows), torch.zeros(x0.shape), torch.zeros(rows, dtype=bool)
    for b in range(rows):
        generator = torch.Generator().manual_seed(int(keys[b]))
        if config.sigma_sampling == "uniform":
            sigma[b] = torch.rand((), generator=generator)
        else:
            n = torch.randn((), generator=generator)
            sigma[b] = 1 / (1 + torch.exp(-(config.logit_mean + config.logit_std * n)))
        eps[b] = torch.randn(x0.shape[1:], generator=generator)
        if config.cond_dropout > 0:
            drop[b] = torch.rand((), generator=generator) < config.cond_dropout
    if config.cond_dropout > 0:
        assert bool(drop.any()) and not bool(drop.all())  # both branches exercised
        labels = torch.where(drop, torch.full_like(labels, 10), labels)
    total = 0.0
    for b in range(rows):
        s = float(sigma[b])
        x_sigma = (1 - s) * x0[b] + s * eps[b]
        with torch.no_grad():
            v = model(x_sigma[None], sigma[b : b + 1], {"label": labels[b : b + 1]})[0]
        total += float(weights[b]) * float(((v - (eps[b] - x0[b])) ** 2).mean())
    return total, float(weights.sum())


@pytest.mark.parametrize(
    "config",
    [
        FlowSFTConfig(sigma_sampling="uniform"),
        FlowSFTConfig(sigma_sampling="logit_normal", logit_mean=0.5, logit_std=0.8),
        FlowSFTConfig(sigma_sampling="uniform", cond_dropout=0.5),
    ],
)
def test_loss_equals_hand_computation(config):
    model = TinyVelocity()
    x0 = torch.randn(6, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    weights = torch.tensor([1.0, 2.0, 0.0, 0.5, 1.0, 3.0])
    batch = flow_sft_batch(model, x0, ["0", "1", "2", "3", "4", "5"], weights, noise_seeds=KEYS)
    out = FlowMatchingSFT(config)(model, batch, torch.Generator().manual_seed(7))
    expected_sum, expected_den = hand_loss(model, x0, batch["cond"]["label"], weights, KEYS, config)
    assert float(out.primary.sum.detach()) == pytest.approx(expected_sum, rel=1e-5)
    assert float(out.primary.denominator) == expected_den == 7.5
    assert out.primary.sum.requires_grad


def test_bad_batches_name_the_field():
    model = TinyVelocity()
    loss = FlowMatchingSFT()
    keys = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="cond"):
        loss(model, {"latents": torch.zeros(2, 3, 8, 8)}, torch.Generator())
    with pytest.raises(ValueError, match="weights"):
        batch = flow_sft_batch(
            model, torch.zeros(2, 3, 8, 8), ["1", "2"], torch.ones(3), noise_seeds=keys
        )
        loss(model, batch, torch.Generator())
    with pytest.raises(ValueError, match="prompts"):
        flow_sft_batch(model, torch.zeros(2, 3, 8, 8), ["1"], noise_seeds=keys)
    with pytest.raises(ValueError, match=r"noise_seeds: expected an int64 tensor \[B=2\]"):
        flow_sft_batch(model, torch.zeros(2, 3, 8, 8), ["1", "2"], noise_seeds=keys[:1])
    batch = flow_sft_batch(model, torch.zeros(2, 3, 8, 8), ["1", "2"], noise_seeds=keys)
    with pytest.raises(ValueError, match=r"missing 'noise_seeds'.*noise_keys"):
        loss(model, {k: v for k, v in batch.items() if k != "noise_seeds"}, torch.Generator())
    with pytest.raises(TypeError, match="noise_seeds: expected an integer dtype"):
        loss(model, {**batch, "noise_seeds": torch.ones(2)}, torch.Generator())
    with pytest.raises(ValueError, match=r"noise_seeds: expected \[B=2\], got \(3,\)"):
        loss(model, {**batch, "noise_seeds": torch.arange(3)}, torch.Generator())
    with pytest.raises(ValueError, match="noise_seeds: expected keys >= 0"):
        loss(model, {**batch, "noise_seeds": torch.tensor([0, -1])}, torch.Generator())


def toy_latents(labels: torch.Tensor) -> torch.Tensor:
    """Label c → a fixed smooth pattern (one clean latent per label)."""
    grid = torch.linspace(0, 1, 8)
    yy, xx = torch.meshgrid(grid, grid, indexing="ij")
    out = []
    for c in labels.tolist():
        channels = [torch.sin(math.pi * (c + 1) * xx + k) * 0.8 for k in range(3)]
        out.append(torch.stack(channels) * (1 if c % 2 else -1) + 0.1 * yy)
    return torch.stack(out)


def test_trainer_steps_reduce_the_loss():
    model = TinyVelocity()
    loss = FlowMatchingSFT(FlowSFTConfig(sigma_sampling="uniform"))
    trainer = Trainer(model, loss, OptimConfig(lr=3e-3), seed=0)
    data = torch.Generator().manual_seed(0)
    eval_labels = torch.arange(4).repeat(16)
    eval_batch = flow_sft_batch(
        model,
        toy_latents(eval_labels),
        [str(c) for c in eval_labels.tolist()],
        noise_seeds=noise_keys(range(64), 123),
    )

    def evaluate() -> float:
        with torch.no_grad():
            return float(loss(model, eval_batch, torch.Generator().manual_seed(123)).primary.value)

    before = evaluate()
    for step in range(60):
        labels = torch.randint(0, 4, (16,), generator=data)
        latents = toy_latents(labels)
        keys = noise_keys(range(step * 16, (step + 1) * 16), 0, step)
        halves = [  # two micro-batches: the trainer normalises once by the global weight
            flow_sft_batch(
                model,
                latents[part],
                [str(c) for c in labels[part].tolist()],
                noise_seeds=keys[part],
            )
            for part in (slice(0, 8), slice(8, 16))
        ]
        result = trainer.train_step(halves)
        assert result.applied
    after = evaluate()
    assert after < 0.6 * before, (before, after)  # measured: 1.348 -> 0.389


DROPOUT = FlowSFTConfig(sigma_sampling="logit_normal", cond_dropout=0.3)


def test_noise_follows_the_row_not_its_position_or_batch_mates():
    model = TinyVelocity()
    x0 = torch.randn(6, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    prompts = ["0", "1", "2", "3", "4", "5"]
    loss = FlowMatchingSFT(DROPOUT)
    sigma, eps, drop = loss.noise(flow_sft_batch(model, x0, prompts, noise_seeds=KEYS))
    order = [4, 0, 5, 2, 1, 3]
    permuted = flow_sft_batch(
        model, x0[order], [prompts[i] for i in order], noise_seeds=KEYS[order]
    )
    sigma_p, eps_p, drop_p = loss.noise(permuted)
    assert torch.equal(sigma_p, sigma[order]) and torch.equal(eps_p, eps[order])
    assert torch.equal(drop_p, drop[order])
    alone = loss.noise(flow_sft_batch(model, x0[3:4], ["3"], noise_seeds=KEYS[3:4]))
    assert torch.equal(alone[0], sigma[3:4]) and torch.equal(alone[1], eps[3:4])
    # the per-row loss follows its row too: the weighted sums add up over any partition
    with torch.no_grad():
        batch = flow_sft_batch(model, x0, prompts, noise_seeds=KEYS)
        whole = float(loss(model, batch, None).primary.sum)
        parts = [
            loss(model, flow_sft_batch(model, x0[p], prompts[p], noise_seeds=KEYS[p]), None)
            for p in (slice(0, 1), slice(1, 4), slice(4, 6))
        ]
    assert float(sum(o.primary.sum for o in parts)) == pytest.approx(whole, rel=1e-6)


def test_each_step_draws_fresh_noise():
    model = TinyVelocity()
    x0 = torch.zeros(6, 3, 8, 8)
    loss = FlowMatchingSFT(DROPOUT)
    draws = [
        loss.noise(
            flow_sft_batch(model, x0, list("012345"), noise_seeds=noise_keys(range(6), 0, s))
        )
        for s in (0, 1)
    ]
    assert bool((draws[0][0] != draws[1][0]).all())  # σ
    assert bool((draws[0][1] != draws[1][1]).all())  # ε
    assert len(set(noise_keys(range(6), 0, 0).tolist() + noise_keys(range(6), 0, 1).tolist())) == 12


def flow_data(step: int, rows: int = 8):
    """Toy rows of dataset indices [step·rows, (step+1)·rows), ragged weights."""
    labels = torch.randint(0, 10, (rows,), generator=torch.Generator().manual_seed(50 + step))
    weights = torch.linspace(0.25, 2.0, rows)
    weights[3] = 0.0
    keys = noise_keys(range(step * rows, (step + 1) * rows), 7, step)
    return toy_latents(labels), [str(c) for c in labels.tolist()], weights, keys


def train_three_steps(micro_batch_size, keys_step=None) -> dict[str, torch.Tensor]:
    model = TinyVelocity()
    trainer = Trainer(model, FlowMatchingSFT(DROPOUT), OptimConfig(lr=1e-3), seed=0)
    for step in range(3):
        latents, prompts, weights, keys = flow_data(step)
        if keys_step is not None:  # a deliberately wrong key: always step keys_step's noise
            keys = flow_data(keys_step)[3]
        size = micro_batch_size or len(prompts)
        micro = [
            flow_sft_batch(
                model,
                latents[lo : lo + size],
                prompts[lo : lo + size],
                weights[lo : lo + size],
                noise_seeds=keys[lo : lo + size],
            )
            for lo in range(0, len(prompts), size)
        ]
        assert trainer.train_step(micro).applied
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def relative_difference(a: dict, b: dict) -> float:
    """max |a − b| / max |a| over every parameter."""
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    return diff / max(float(a[k].abs().max()) for k in a)


def test_any_micro_batch_split_gives_the_same_parameters():
    start = {k: v.clone() for k, v in TinyVelocity().state_dict().items()}
    whole = train_three_steps(None)
    assert relative_difference(whole, start) > 5e-4  # three real updates (measured 7.7e-4)
    for size in (1, 2, 4):  # measured 2.2e-8, 8.5e-9, 7.6e-9
        assert relative_difference(whole, train_three_steps(size)) <= 1e-6, size
    # the tolerance discriminates: other noise (every step drawing step 0's) is far off (9e-4)
    assert relative_difference(whole, train_three_steps(None, keys_step=0)) > 1e-4


RECIPE_TINY = {
    "model": {"patch_size": 4, "d_model": 32, "n_layers": 1, "n_heads": 2},
    "sampler": {"num_steps": 2},
    "steps": 3,
    "batch_size": 6,
    "eval_every": 3,
    "eval_samples_per_prompt": 1,
    "grid_images": 2,
    "log_every": 1,
    "objective": {"cond_dropout": 0.3},
    "optim": {"eps": 1e-6},  # see test_sft.py: keeps AdamW from amplifying rounding
}


def test_recipe_micro_batch_size_does_not_change_the_weights(tmp_path):
    def final_weights(name: str, **extra) -> dict[str, torch.Tensor]:
        config = {**RECIPE_TINY, "output_dir": str(tmp_path / name), **extra}
        run_flow_sft(build_config(FlowSFTRecipeConfig, config), echo=lambda _: None)
        return load_file(tmp_path / name / "model" / "model.safetensors")

    whole = final_weights("whole", micro_batch_size=None)
    assert relative_difference(whole, final_weights("split", micro_batch_size=4)) <= 1e-6
    assert relative_difference(whole, final_weights("short", micro_batch_size=4, steps=2)) > 1e-4


def test_explicit_cond_and_uncond_are_used_and_dropout_swaps_in_the_uncond_rows():
    """``flow_sft_batch(cond=..., uncond=...)``: the loss uses them instead of the model's
    encoders; a dropped row takes ITS row of ``uncond`` (hand computation: the dropout uniform
    is each row's third draw, after σ and ε)."""
    model = TinyVelocity()
    x0 = torch.randn(6, 3, 8, 8, generator=torch.Generator().manual_seed(3))
    weights = torch.tensor([1.0, 2.0, 0.0, 0.5, 1.0, 3.0])
    prompts = list("012345")
    default = flow_sft_batch(model, x0, prompts, weights, noise_seeds=KEYS)
    assert "uncond" not in default and torch.equal(default["cond"]["label"], torch.arange(6))
    cond = {"label": torch.tensor([9, 8, 7, 6, 5, 4])}  # not what the prompts encode to
    uncond = {"label": torch.tensor([0, 1, 2, 3, 1, 0])}  # not the model's empty label (10)
    batch = flow_sft_batch(model, x0, prompts, weights, noise_seeds=KEYS, cond=cond, uncond=uncond)
    assert batch["cond"] is cond and batch["uncond"] is uncond
    config = FlowSFTConfig(sigma_sampling="uniform", cond_dropout=0.5)
    out = FlowMatchingSFT(config)(model, batch, None)
    drop = torch.zeros(6, dtype=torch.bool)
    for b in range(6):
        generator = torch.Generator().manual_seed(int(KEYS[b]))
        torch.rand((), generator=generator)
        torch.randn(x0.shape[1:], generator=generator)
        drop[b] = torch.rand((), generator=generator) < 0.5
    assert bool(drop.any()) and not bool(drop.all())
    mixed = torch.where(drop, uncond["label"], cond["label"])
    no_dropout = FlowSFTConfig(sigma_sampling="uniform")  # the same σ and ε draws
    expected, denominator = hand_loss(model, x0, mixed, weights, KEYS, no_dropout)
    assert float(out.primary.sum.detach()) == pytest.approx(expected, rel=1e-5)
    assert float(out.primary.denominator) == denominator
    # discriminates: the model's empty condition on the dropped rows gives another loss
    empty = torch.where(drop, torch.full((6,), 10), cond["label"])
    assert abs(hand_loss(model, x0, empty, weights, KEYS, no_dropout)[0] - expected) > 1e-3
    # without dropout, only cond matters: uncond is carried but unused
    plain = FlowMatchingSFT(no_dropout)(model, batch, None)
    assert float(plain.primary.sum.detach()) == pytest.approx(
        hand_loss(model, x0, cond["label"], weights, KEYS, no_dropout)[0], rel=1e-5
    )


def test_explicit_conditioning_is_checked():
    model = TinyVelocity()
    x0, keys = torch.zeros(2, 3, 8, 8), torch.tensor([1, 2])
    label = {"label": torch.tensor([1, 2])}
    with pytest.raises(ValueError, match=r"cond\['label'\]: expected a batch-first tensor \[B=2"):
        flow_sft_batch(model, x0, ["1", "2"], noise_seeds=keys, cond={"label": torch.ones(3)})
    with pytest.raises(ValueError, match=r"uncond\['label'\]: expected a batch-first tensor"):
        flow_sft_batch(
            model, x0, ["1", "2"], noise_seeds=keys, cond=label, uncond={"label": torch.ones(1)}
        )
    with pytest.raises(ValueError, match=r"uncond: expected the keys of cond \['label'\]"):
        flow_sft_batch(
            model, x0, ["1", "2"], noise_seeds=keys, cond=label, uncond={"other": torch.ones(2)}
        )
    with pytest.raises(ValueError, match=r"uncond\['label'\]: expected the shape of cond"):
        flow_sft_batch(
            model,
            x0,
            ["1", "2"],
            noise_seeds=keys,
            cond=label,
            uncond={"label": torch.ones(2, 1, dtype=torch.long)},
        )
    with pytest.raises(TypeError, match="cond: expected a dict of tensors"):
        flow_sft_batch(model, x0, ["1", "2"], noise_seeds=keys, cond=[1, 2])
