"""The image recipes end to end on tiny configs: flow-sft (with a kill and an exact resume),
flow-grpo from its model (ratio 1 and parity 0 at the first step, rollouts and evaluation
checked against independent recomputations), the configs, and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from flow_toy import one_thread  # noqa: F401 - the fixture applies by import
from safetensors.torch import load_file

from diffusion_rl import cli
from diffusion_rl.config import (
    ConfigError,
    FlowGRPORecipeConfig,
    FlowSFTRecipeConfig,
    build_config,
    load_config,
)
from diffusion_rl.evaluation import diversity, evaluate_images
from diffusion_rl.models import load_model
from diffusion_rl.models.dit import FlowDiT
from diffusion_rl.recipes.flow_grpo import run_flow_grpo
from diffusion_rl.recipes.flow_sft import run_flow_sft
from diffusion_rl.rewards import GenEvalReward
from diffusion_rl.rollout import rollout_seed
from diffusion_rl.sampling.flow import FlowSamplerConfig, flow_sigmas, sample_flow, step_noise
from diffusion_rl.seeding import noise_keys
from diffusion_rl.tasks.geneval import GenEvalTask
from diffusion_rl.train import Trainer

PNG = b"\x89PNG\r\n\x1a\n"
QUIET = {"echo": lambda _: None}
SFT_TINY = {
    "model": {"patch_size": 4, "d_model": 32, "n_layers": 1, "n_heads": 2},
    "sampler": {"num_steps": 4},
    "steps": 4,
    "batch_size": 8,
    "micro_batch_size": 3,
    "eval_every": 2,
    "eval_samples_per_prompt": 1,
    "grid_images": 8,
    "checkpoint_every": 2,
    "log_every": 1,
}
GRPO_TINY = {
    "sampler": {"num_steps": 4, "micro_batch_size": 4},
    "steps": 2,
    "prompts_per_step": 2,
    "group_size": 4,
    "eval_every": 1,
    "eval_samples_per_prompt": 1,
    "grid_images": 4,
    "checkpoint_every": 1,
    "optim": {"lr": 1e-3},
}


def sft_config(tmp_path, name="sft", **extra) -> FlowSFTRecipeConfig:
    return build_config(
        FlowSFTRecipeConfig, {**SFT_TINY, "output_dir": str(tmp_path / name), **extra}
    )


def grpo_config(tmp_path, model_dir, name="grpo", **extra) -> FlowGRPORecipeConfig:
    return build_config(
        FlowGRPORecipeConfig,
        {
            **GRPO_TINY,
            "model": {"path": str(model_dir)},
            "output_dir": str(tmp_path / name),
            **extra,
        },
    )


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """One tiny flow-SFT run shared by the tests that start from its model."""
    root = tmp_path_factory.mktemp("flow")
    return root, run_flow_sft(sft_config(root), **QUIET)


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ------------------------------------------------------------------------------ configs


def test_config_errors_name_the_field(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("stepz: 3\nmodel:\n  d_modle: 8\ntask:\n  kindz: [count]\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, FlowSFTRecipeConfig)
    for key in ("stepz", "model.d_modle", "task.kindz"):
        assert f"{key}: unknown key" in str(info.value)
    with pytest.raises(ConfigError, match="sampler.mode: evaluation serves with the ODE"):
        build_config(FlowSFTRecipeConfig, {"sampler": {"mode": "sde"}})
    with pytest.raises(ConfigError, match="sampler.mode: Flow-GRPO rollouts need SDE steps"):
        build_config(FlowGRPORecipeConfig, {"sampler": {"mode": "ode"}})
    with pytest.raises(ConfigError, match="rewards.0: .*'verifier' is not an image reward"):
        build_config(FlowGRPORecipeConfig, {"rewards": [{"name": "verifier"}]})
    with pytest.raises(ConfigError, match="rewards.0: .*GenEvalReward.mode"):
        build_config(
            FlowGRPORecipeConfig, {"rewards": [{"name": "geneval", "options": {"mode": "x"}}]}
        )
    with pytest.raises(ConfigError, match="policy.clip_range"):
        build_config(FlowGRPORecipeConfig, {"policy": {"clip_range": 2.0}})
    with pytest.raises(ConfigError, match="task.name"):
        build_config(FlowGRPORecipeConfig, {"task": {"name": "arithmetic"}})


def test_partial_sections_keep_the_recipe_defaults():
    config = load_config(
        None, FlowGRPORecipeConfig, ["sampler.num_steps=6", "optim.lr=3e-4", "task.kinds=[count]"]
    )
    # a partial sampler section stays an SDE rollout sampler with the recipe's shift and CFG
    assert (config.sampler.num_steps, config.sampler.mode, config.sampler.shift) == (6, "sde", 1.0)
    assert config.sampler.guidance_scale == FlowGRPORecipeConfig().sampler.guidance_scale
    assert (config.optim.lr, config.optim.grad_clip) == (3e-4, 1.0)
    assert config.task.build().config.kinds == ("count",)
    sft = load_config(None, FlowSFTRecipeConfig, ["steps=300", "objective.logit_std=2.0"])
    assert sft.objective.cond_dropout == FlowSFTRecipeConfig().objective.cond_dropout > 0
    assert (sft.optim.total_steps, sft.optim.warmup_steps, sft.optim.schedule) == (
        300,
        30,
        "constant",
    )


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("flow_sft_geneval.yaml", FlowSFTRecipeConfig),
        ("flow_grpo_geneval.yaml", FlowGRPORecipeConfig),
    ],
)
def test_shipped_configs_match_the_defaults(name, cls):
    """configs/flow_*_geneval.yaml document every key with its default value."""
    path = Path(__file__).parents[1] / "configs" / name
    assert load_config(path, cls) == cls()
    listed = set(__import__("yaml").safe_load(path.read_text()))
    assert listed == set(cls.model_fields)


# ------------------------------------------------------------------------------ flow-sft


def test_flow_sft_first_loss_is_the_hand_computed_one(sft_run):
    """A fresh DiT predicts v = 0 (adaLN-Zero), so the first step's loss is the mean over rows
    of mean((ε − x0)²), with σ then ε drawn from each row's own stream, keyed by
    ``noise_keys(dataset index, seed 0, step 0)``, and x0 = 2·render − 1 of training batch 0."""
    root, _ = sft_run
    task = GenEvalTask()
    _, images = task.train_batch(0, 8)
    x0 = images * 2 - 1
    total = 0.0
    for row, key in enumerate(noise_keys(range(8), 0, 0).tolist()):
        generator = torch.Generator().manual_seed(key)
        torch.rand((), generator=generator)  # σ (irrelevant: the prediction is 0)
        noise = torch.randn(tuple(x0.shape[1:]), generator=generator)
        total += float((noise - x0[row]).square().mean())
    first = read_records(root / "sft" / "metrics.jsonl")[0]
    assert first["step"] == 1
    assert first["loss"] == pytest.approx(total / 8, rel=1e-6)


def test_flow_sft_writes_model_grids_metrics_and_evaluates_exactly(sft_run):
    root, result = sft_run
    out = root / "sft"
    assert result["steps"] == 4 and [h["step"] for h in result["history"]] == [2, 4]
    assert sum("loss" in r for r in read_records(out / "metrics.jsonl")) == 4
    for png in [
        out / "curves.png",
        out / "samples" / "step_000002.png",
        out / "samples" / "step_000004.png",
    ]:
        assert png.read_bytes()[:8] == PNG and png.stat().st_size > 1000
    assert result["grids"][-1].endswith("step_000004.png")
    saved = load_model(out / "model")
    assert saved.kind == "flow" and saved.tokenizer is None
    assert isinstance(saved.model, FlowDiT)
    assert saved.info["task"] == GenEvalTask().info() and saved.info["trained_steps"] == 4
    assert saved.info["sampler"]["mode"] == "ode" and saved.info["sampler"]["num_steps"] == 4

    # The final evaluation, recomputed by hand: Euler steps with CFG from the seeded noise.
    task = GenEvalTask()
    prompts = [e.prompt for e in task.prompts("eval")]
    sampler = FlowSamplerConfig(**saved.info["sampler"])
    model, rows = saved.model, len(prompts)
    x = step_noise(range(rows), -1, model.latent_shape, "cpu")
    sigmas = flow_sigmas(sampler.num_steps, sampler.shift)
    cond, uncond = model.encode_prompts(prompts), model.empty_condition(rows)
    with torch.no_grad():
        for k in range(sampler.num_steps):
            sigma = sigmas[k].repeat(rows)
            v_c, v_u = model(x, sigma, cond), model(x, sigma, uncond)
            x = x + (sigmas[k + 1] - sigmas[k]) * (v_u + sampler.guidance_scale * (v_c - v_u))
    images = ((x + 1) / 2).clamp(0, 1)
    verdicts = [r["overall"] for r in task.verify(images, prompts)]
    assert result["eval"]["num_images"] == rows == 19
    assert result["eval"]["accuracy"] == sum(verdicts) / rows
    assert [s["correct"] for s in result["eval"]["samples"]] == verdicts[:8]
    rewards = GenEvalReward()(images, prompts)
    assert result["eval"]["reward_mean"] == pytest.approx(float(rewards.mean()), abs=1e-6)


def test_flow_sft_kill_and_resume_is_bitwise(tmp_path, sft_run, monkeypatch):
    root, straight = sft_run
    real_step = Trainer.train_step

    def dying_step(self, micro_batches, loss_fn=None):
        if self.global_step == 3:
            raise KeyboardInterrupt  # killed after the step-2 checkpoint
        return real_step(self, micro_batches, loss_fn)

    monkeypatch.setattr(Trainer, "train_step", dying_step)
    with pytest.raises(KeyboardInterrupt):
        run_flow_sft(sft_config(tmp_path, "killed"), **QUIET)
    monkeypatch.setattr(Trainer, "train_step", real_step)
    resumed = run_flow_sft(sft_config(tmp_path, "killed"), **QUIET)
    assert resumed["history"] == straight["history"]  # the history survives the kill
    a = load_model(root / "sft" / "model").model.state_dict()
    b = load_model(tmp_path / "killed" / "model").model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(Exception, match="objective.cond_dropout"):
        run_flow_sft(
            sft_config(tmp_path, "killed", objective={"cond_dropout": 0.3}, steps=6), **QUIET
        )
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        run_flow_sft(sft_config(tmp_path, "killed", resume=False), **QUIET)


# ------------------------------------------------------------------------------ flow-grpo


def test_flow_grpo_from_the_sft_model(tmp_path, sft_run):
    root, sft = sft_run
    model_dir = root / "sft" / "model"
    result = run_flow_grpo(grpo_config(tmp_path, model_dir), **QUIET)
    out = tmp_path / "grpo"
    assert result["steps"] == 2 and result["weights_version"] == 2
    # task and serving settings come from the model directory: the same evaluation as SFT's end
    assert result["accuracy_before"] == sft["eval"]["accuracy"]
    assert result["attributes_before"] == sft["eval"]["attributes"]
    assert [h["step"] for h in result["history"]] == [0, 1, 2]
    for name in ("before", "step_000001", "after"):
        assert (out / "samples" / f"{name}.png").read_bytes()[:8] == PNG
    assert (out / "curves.png").stat().st_size > 5000

    records = [r for r in read_records(out / "metrics.jsonl") if "loss" in r]
    first = records[0]
    assert first["flow_grpo/ratio_min"] == 1.0 == first["flow_grpo/ratio_max"]
    assert first["flow_grpo/parity_max_abs"] == 0.0
    # 3 trained steps (of 4, the last one ODE) x 2 sampler forward groups of 4 rows
    assert first["learner/micro_batches"] == 6.0

    # The first rollout, recomputed: the SFT model, SDE sampling, the recipe's rollout seeds.
    task = GenEvalTask()
    examples = [task.example(i, "train") for i in range(2) for _ in range(4)]
    seeds = [rollout_seed(0, i, g) for i in range(2) for g in range(4)]
    sampler = grpo_config(tmp_path, model_dir).sampler
    model = load_model(model_dir).model
    images = sample_flow(model, [e.prompt for e in examples], sampler, seeds=seeds).images
    rewards = GenEvalReward()(images, examples)
    assert first["rollout/reward_mean"] == pytest.approx(float(rewards.mean()), abs=1e-6)
    accuracy = sum(r["overall"] for r in task.verify(images, examples)) / 8
    assert first["rollout/accuracy"] == accuracy

    saved = load_model(out / "model")
    assert saved.info["trained_steps"] == 2 and saved.info["sampler"]["mode"] == "ode"
    moved = sum(
        float((p - q).detach().abs().sum())
        for p, q in zip(saved.model.parameters(), model.parameters())
    )
    assert moved > 0


def test_the_held_out_evaluation_does_not_depend_on_the_run_seed(tmp_path, sft_run):
    """Runs of seeds 1 and 3 from one start read the same start (the evaluation samples at
    ``eval_seed``, not the run's seed), that of an independent evaluation at seed 0, while
    their rollouts differ; ``eval_seed: 5`` moves the held-out noise."""
    root, _ = sft_run
    model_dir = root / "sft" / "model"
    options = {"steps": 1, "eval_samples_per_prompt": 2, "grid_images": 0}
    runs = {
        seed: run_flow_grpo(
            grpo_config(tmp_path, model_dir, f"s{seed}", seed=seed, **options), **QUIET
        )
        for seed in (1, 3)
    }
    starts = [run["history"][0] for run in runs.values()]
    assert starts[0]["accuracy"] == starts[1]["accuracy"]
    assert starts[0]["diversity"] == starts[1]["diversity"] > 0
    rollouts = [
        next(r for r in read_records(tmp_path / f"s{seed}" / "metrics.jsonl") if "loss" in r)
        for seed in (1, 3)
    ]
    assert rollouts[0]["loss"] != rollouts[1]["loss"]
    config = grpo_config(tmp_path, model_dir, **options)
    model = load_model(model_dir).model
    for eval_seed, expected in ((0, starts[0]["diversity"]), (5, None)):
        images = evaluate_images(
            model, GenEvalTask(), config.sampler, samples_per_prompt=2, seed=eval_seed
        )
        if expected is not None:
            assert images.diversity == expected
        else:
            moved = run_flow_grpo(
                grpo_config(tmp_path, model_dir, "e5", eval_seed=5, **options), **QUIET
            )
            assert moved["history"][0]["diversity"] == images.diversity != starts[0]["diversity"]


def test_flow_grpo_ema_is_evaluated_and_saved(tmp_path, sft_run):
    root, _ = sft_run
    model_dir = root / "sft" / "model"
    config = grpo_config(tmp_path, model_dir, ema_decay=0.25, keep_last=3)
    result = run_flow_grpo(config, **QUIET)
    checkpoints = tmp_path / "grpo" / "checkpoints"
    live = [load_file(checkpoints / f"step_{n:08d}" / "model.safetensors") for n in (1, 2)]
    saved = load_model(tmp_path / "grpo" / "model")
    assert saved.info["ema_decay"] == 0.25
    ema = saved.model.state_dict()
    # the average starts at the first update's weights, then ema ← 0.25 ema + 0.75 live
    for name, first in live[0].items():
        torch.testing.assert_close(ema[name], 0.25 * first + 0.75 * live[1][name])
    assert any(not torch.equal(ema[k], live[1][k]) for k in live[1])
    # the evaluation served the average: the final accuracy is the saved model's
    task = GenEvalTask()
    again = evaluate_images(
        saved.model, task, config.sampler, samples_per_prompt=1, seed=config.seed
    )
    assert result["accuracy_after"] == again.accuracy


@pytest.mark.parametrize("ema_decay", [None, 0.5])
def test_flow_grpo_resume_is_bitwise_and_checks_metadata(tmp_path, sft_run, monkeypatch, ema_decay):
    root, _ = sft_run
    model_dir = root / "sft" / "model"
    options = {
        "ema_decay": ema_decay,
        "steps": 3,
        "eval_every": 10,
        "policy": {"num_iterations": 2, "beta": 0.01},
        # group members start from one noise; evaluation still serves row by row
        "sampler": {"num_steps": 4, "micro_batch_size": 4, "share_group_noise": True},
    }
    straight = run_flow_grpo(grpo_config(tmp_path, model_dir, "straight", **options), **QUIET)
    real_step = Trainer.train_step

    def dying_step(self, micro_batches, loss_fn=None):
        if self.global_step == 4:  # the first inner iteration of RL step 3
            raise KeyboardInterrupt
        return real_step(self, micro_batches, loss_fn)

    monkeypatch.setattr(Trainer, "train_step", dying_step)
    with pytest.raises(KeyboardInterrupt):
        run_flow_grpo(grpo_config(tmp_path, model_dir, "killed", **options), **QUIET)
    monkeypatch.setattr(Trainer, "train_step", real_step)
    resumed = run_flow_grpo(grpo_config(tmp_path, model_dir, "killed", **options), **QUIET)
    assert resumed["weights_version"] == straight["weights_version"] == 3
    assert resumed["history"] == straight["history"]
    a = load_model(tmp_path / "straight" / "model").model.state_dict()
    b = load_model(tmp_path / "killed" / "model").model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    changed = {**options, "policy": {"num_iterations": 2, "beta": 0.01, "clip_range": 0.2}}
    with pytest.raises(Exception, match="objective.clip_range"):
        run_flow_grpo(grpo_config(tmp_path, model_dir, "killed", **changed), **QUIET)


@pytest.mark.parametrize("algorithm", ["nft", "awm", "dgpo"])
def test_forward_process_methods_train_from_served_samples_and_resume_bitwise(
    tmp_path, sft_run, monkeypatch, algorithm
):
    """flow-grpo with a forward-process policy.algorithm: ODE rollouts (the serving sampler,
    no SDE steps), the old policy lagging the actor (kept in checkpoints: a run killed at step
    3 resumes to the uninterrupted run's weights, bitwise), and the first rollout's images are
    what serving the SFT model with the rollout seeds gives."""
    root, _ = sft_run
    model_dir = root / "sft" / "model"
    policy = {"algorithm": algorithm, "old_decay_rate": 0.2, "old_decay_max": 0.5}
    policy["timesteps_per_sample"] = 2
    options = {"steps": 3, "eval_every": 10, "policy": policy, "sampler": {"num_steps": 4}}
    options["eval_samples_per_prompt"] = 2  # a non-zero diversity: a fingerprint of the images
    config = grpo_config(tmp_path, model_dir, "straight", **options)
    assert config.sampler.mode == "ode" and config.sampler.guidance_scale == 1.0
    with pytest.raises(ConfigError, match="sampler.share_group_noise: ODE rollouts of a group"):
        grpo_config(tmp_path, model_dir, **{**options, "sampler": {"share_group_noise": True}})
    straight = run_flow_grpo(config, **QUIET)
    records = [r for r in read_records(tmp_path / "straight" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[1]["learner/old_policy_decay"] == pytest.approx(0.4)
    if algorithm == "awm":
        assert records[0]["awm/ratio_min"] == 1.0 == records[0]["awm/ratio_max"]
    else:
        assert records[0][f"{algorithm}/old_deviation" if algorithm == "nft" else "dgpo/kl"] == 0.0

    task = GenEvalTask()
    examples = [task.example(i, "train") for i in range(2) for _ in range(4)]
    seeds = [rollout_seed(0, i, g) for i in range(2) for g in range(4)]
    model = load_model(model_dir).model
    images = sample_flow(model, [e.prompt for e in examples], config.sampler, seeds=seeds).images
    rewards = GenEvalReward()(images, examples)
    assert records[0]["rollout/reward_mean"] == pytest.approx(float(rewards.mean()), abs=1e-6)
    # what was evaluated last is what was saved (the trained weights, not the lagging copy)
    saved = load_model(tmp_path / "straight" / "model").model
    again = evaluate_images(saved, task, config.sampler, samples_per_prompt=2, seed=0)
    assert again.accuracy == straight["accuracy_after"]
    assert again.diversity == straight["history"][-1]["diversity"] > 0

    real_step = Trainer.train_step

    def dying_step(self, micro_batches, loss_fn=None):
        if self.global_step == 2:  # RL step 3, after the checkpoint of step 2
            raise KeyboardInterrupt
        return real_step(self, micro_batches, loss_fn)

    monkeypatch.setattr(Trainer, "train_step", dying_step)
    with pytest.raises(KeyboardInterrupt):
        run_flow_grpo(grpo_config(tmp_path, model_dir, "killed", **options), **QUIET)
    monkeypatch.setattr(Trainer, "train_step", real_step)
    resumed = run_flow_grpo(grpo_config(tmp_path, model_dir, "killed", **options), **QUIET)
    assert resumed["history"] == straight["history"]
    a = load_model(tmp_path / "straight" / "model").model.state_dict()
    b = load_model(tmp_path / "killed" / "model").model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    again = [r for r in read_records(tmp_path / "killed" / "metrics.jsonl") if "loss" in r]
    assert again[-1]["loss"] == records[-1]["loss"]  # the step after the resume: same old policy


# ------------------------------------------------------------------------------ CLI


def test_cli_flow_commands_generate_and_errors(tmp_path, sft_run, capsys):
    root, _ = sft_run
    sets = [
        "--set",
        f"output_dir={tmp_path / 'cli_grpo'}",
        "--set",
        f"model.path={root / 'sft' / 'model'}",
    ]
    for key, value in GRPO_TINY.items():
        sets += ["--set", f"{key}={json.dumps(value)}"]
    assert cli.main(["flow-grpo", *sets, "--set", "steps=1"]) == 0
    assert "held-out accuracy" in capsys.readouterr().out
    assert json.loads((tmp_path / "cli_grpo" / "results.json").read_text())["steps"] == 1

    grid = tmp_path / "grid.png"
    prompts = ["--prompt", "a red circle on the left", "--prompt", "two blue squares"]
    assert (
        cli.main(
            [
                "generate",
                "--model",
                str(root / "sft" / "model"),
                *prompts,
                "--samples",
                "2",
                "--output",
                str(grid),
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("seed 0: a red circle on the left")
    assert lines[3].startswith("seed 3: two blue squares") and grid.read_bytes()[:8] == PNG

    # eval on an image model: the recipe's own final evaluation (same sampler, seeds, images)
    report = tmp_path / "eval.json"
    sft_model = str(root / "sft" / "model")
    assert cli.main(["eval", "--model", sft_model, "--samples", "1", "--output", str(report)]) == 0
    recorded = json.loads((root / "sft" / "results.json").read_text())["eval"]
    evaluated = json.loads(report.read_text())
    assert evaluated["attributes"] == recorded["attributes"]
    assert evaluated["num_images"] == recorded["num_images"] == len(GenEvalTask().prompts("eval"))
    assert evaluated["sampler"]["mode"] == "ode" and evaluated["sampler"]["num_steps"] == 4
    assert capsys.readouterr().out.startswith(f"accuracy {recorded['accuracy']:.3f} on ")
    assert cli.main(["eval", "--model", sft_model, "--examples", "8"]) == 2
    assert "--examples: applies to token models" in capsys.readouterr().err

    assert cli.main(["flow-sft", "--set", "task.kindz=[count]"]) == 2
    assert "task.kindz: unknown key" in capsys.readouterr().err
    assert (
        cli.main(
            [
                "generate",
                "--model",
                str(root / "sft" / "model"),
                "--prompt",
                "x",
                "--temperature",
                "1",
            ]
        )
        == 2
    )
    assert "--temperature: applies to token models" in capsys.readouterr().err
    assert (
        cli.main(
            ["generate", "--model", str(root / "sft" / "model"), "--prompt", "a purple circle"]
        )
        == 2
    )
    assert "outside the model's vocabulary" in capsys.readouterr().err


def test_quickstart_image_mode(tmp_path, capsys):
    """SFT of the small DiT, then AWM on unguided ODE rollouts: the table's rows, the
    summary, and AWM's "before" recomputed as the SFT model served without guidance."""
    sets = []
    for key, value in SFT_TINY.items():
        if key != "steps":
            sets += ["--set", f"sft.{key}={json.dumps(value)}"]
    for key, value in GRPO_TINY.items():
        if key not in ("steps", "eval_every"):
            sets += ["--set", f"rl.{key}={json.dumps(value)}"]
    sets += ["--set", "rl.policy.timesteps_per_sample=2"]  # AWM's 6 need 7+ sampler steps
    out = tmp_path / "qs"
    argv = ["quickstart", "--mode", "image", "--output-dir", str(out), "--steps", "2"]
    assert cli.main([*argv, "--rl-steps", "1", *sets]) == 0
    printed = capsys.readouterr().out
    for row in ("SFT, guidance 4", "before AWM, guidance 1", "after AWM, guidance 1"):
        assert f"  {row} " in printed
    summary = json.loads((out / "results.json").read_text())
    assert summary["sft"]["steps"] == 2 and summary["rl"]["steps"] == 1
    assert summary["rl"]["algorithm"] == "awm"
    sft_results = json.loads((out / "flow_sft" / "results.json").read_text())
    assert summary["sft"]["attributes"] == sft_results["eval"]["attributes"]
    saved = load_model(out / "flow_sft" / "model")
    assert saved.model.config.d_model == 32  # SFT_TINY's, over the quickstart's small DiT
    # AWM's "before" is the SFT model sampled without guidance (the rollout sampler, ODE),
    # recomputed here with the serving loop.
    rl = json.loads((out / "rl" / "results.json").read_text())
    assert rl["steps"] == 1 and summary["rl"]["guidance_scale"] == 1.0
    unguided = evaluate_images(
        saved.model,
        GenEvalTask(),
        FlowSamplerConfig(num_steps=4, guidance_scale=1.0),
        samples_per_prompt=1,
    )
    assert summary["rl"]["accuracy_before"] == unguided.accuracy
    assert Path(summary["grids"]["after"]).read_bytes()[:8] == PNG
    assert cli.main([*argv, "--set", "grpo.steps=1"]) == 2  # image mode's stages: sft., rl.
    assert "keys must start with sft. or rl., got ['grpo']" in capsys.readouterr().err


def test_diversity_is_the_mean_same_prompt_pixel_distance():
    """Pairwise L2 distances within each prompt's rows, averaged per prompt then over
    prompts; a lone row counts 0 (hand-computed: 3-4-5 triangles)."""
    rows = torch.tensor([[0.0, 0.0], [3.0, 4.0], [0.0, 8.0], [1.0, 1.0]]).view(4, 2, 1, 1)
    # prompt a: d(0,1)=5, d(0,2)=8, d(1,2)=5 -> mean 6; prompt b: one row -> 0
    assert diversity(rows, ["a", "a", "a", "b"]) == pytest.approx(3.0)
    assert diversity(rows[:2], ["a", "a"]) == pytest.approx(5.0)
    assert diversity(rows[:2].repeat(1, 1, 1, 1)[[0, 0]], ["a", "a"]) == 0.0  # a collapse
