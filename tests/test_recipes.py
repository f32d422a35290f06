"""Configs, the SFT recipe end to end (with a kill and an exact resume) and the CLI."""

import json
import sys

import pytest
import torch
from fake_wandb import FakeWandb
from PIL import Image

from diffusion_rl import cli
from diffusion_rl.config import (
    ConfigError,
    DistillRecipeConfig,
    GRPORecipeConfig,
    SFTRecipeConfig,
    build_config,
    load_config,
    merge_dicts,
    parse_overrides,
)
from diffusion_rl.models import load_model
from diffusion_rl.recipes.common import token_task
from diffusion_rl.recipes.run import RunInterrupted
from diffusion_rl.recipes.sft import run_sft
from diffusion_rl.train import Trainer

TINY = {
    "model": {"d_model": 32, "n_layers": 1, "n_heads": 2},
    "task": {"num_digits": 2},
    "steps": 6,
    "batch_size": 8,
    "micro_batch_size": 3,
    "eval_every": 3,
    "eval_examples": 8,
    "checkpoint_every": 3,
    "log_every": 1,
}


def tiny_config(tmp_path, name="run", **extra):
    return build_config(SFTRecipeConfig, {**TINY, "output_dir": str(tmp_path / name), **extra})


def metric_lines(out):
    """``metrics.jsonl`` without the wall-clock times."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k != "time"} for line in lines]


def test_unknown_keys_are_rejected_by_name(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("stepz: 3\nmodel:\n  d_modle: 8\ntask:\n  num_digitz: 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, SFTRecipeConfig)
    message = str(info.value)
    for key in ("stepz", "model.d_modle", "task.num_digitz"):
        assert f"{key}: unknown key" in message
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml", SFTRecipeConfig)
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        parse_overrides(["steps"])


def test_defaults_and_overrides():
    config = load_config(
        None, SFTRecipeConfig, ["steps=300", "optim.lr=1e-3", "sampler.temperature=0.5"]
    )
    assert config.steps == 300 and config.sampler.temperature == 0.5
    # a partial optim section keeps the recipe's schedule, spanning the run
    assert (
        config.optim.lr,
        config.optim.schedule,
        config.optim.total_steps,
        config.optim.warmup_steps,
    ) == (
        1e-3,
        "cosine",
        300,
        30,
    )
    assert parse_overrides(["a.b=2", "a.c=x", "d=[1, 2]"]) == {"a": {"b": 2, "c": "x"}, "d": [1, 2]}
    base = {"policy": {"beta": 0.0, "clip_low": 0.2}, "steps": 5, "kinds": [1]}
    on_top = parse_overrides(["policy.beta=0.04", "kinds=[2]", "seed=1"])
    assert merge_dicts(base, on_top) == {
        "policy": {"beta": 0.04, "clip_low": 0.2},
        "steps": 5,
        "kinds": [2],
        "seed": 1,
    }
    assert base["policy"]["beta"] == 0.0  # inputs untouched
    with pytest.raises(ConfigError, match="unknown task 'sudoku9'"):
        build_config(SFTRecipeConfig, {"task": {"name": "sudoku9"}})


@pytest.mark.parametrize(
    ("cls", "temperature", "optim"),
    [
        (GRPORecipeConfig, 1.0, {"grad_clip": 1.0, "warmup_steps": 0}),
        (DistillRecipeConfig, 0.5, {"grad_clip": 1.0, "warmup_steps": 20}),
    ],
)
def test_partial_policy_sections_keep_the_recipe_defaults(cls, temperature, optim):
    # Regression: `--set sampler.steps_per_block=2` once rebuilt the sampler from the section
    # class (greedy, T = 0): every group's samples were equal, so every advantage was 0.
    config = load_config(None, cls, ["sampler.steps_per_block=2", "optim.lr=3e-4"])
    assert (config.sampler.steps_per_block, config.sampler.temperature) == (2, temperature)
    assert config.sampler.temperature == cls().sampler.temperature
    assert config.optim.lr == 3e-4
    assert {k: getattr(config.optim, k) for k in optim} == optim
    assert load_config(None, cls, ["sampler.temperature=0.7"]).sampler.temperature == 0.7


def test_sft_recipe_kill_and_resume_is_exact(tmp_path, monkeypatch):
    straight = run_sft(tiny_config(tmp_path, "straight"), echo=lambda _: None)
    assert straight["steps"] == 6
    assert 0.0 <= straight["eval"]["accuracy"] <= 1.0
    assert [h["step"] for h in straight["history"]] == [3, 6]
    lines = (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()
    assert sum("loss" in json.loads(line) for line in lines) == 6
    png = tmp_path / "straight" / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000

    real_step = Trainer.train_step

    def dying_step(self, micro_batches, loss_fn=None):
        if self.global_step == 4:
            raise KeyboardInterrupt  # killed after the step-3 checkpoint, mid-run
        return real_step(self, micro_batches, loss_fn)

    monkeypatch.setattr(Trainer, "train_step", dying_step)
    checkpoint = tmp_path / "killed" / "checkpoints" / "step_00000003"
    with pytest.raises(RunInterrupted) as info:  # a KeyboardInterrupt
        run_sft(tiny_config(tmp_path, "killed"), echo=lambda _: None)
    assert str(info.value) == (
        f"interrupted during step 5: nothing of it was saved; the last checkpoint, "
        f"{checkpoint}, is intact"
    )
    monkeypatch.setattr(Trainer, "train_step", real_step)
    said = []
    resumed = run_sft(tiny_config(tmp_path, "killed"), echo=said.append)
    assert said[:2] == [
        f"resumed from {checkpoint} at step 3",
        "metrics.jsonl: removed 1 lines logged after that checkpoint",  # step 4's
    ]
    assert resumed["steps"] == 6
    assert resumed["history"] == straight["history"]  # kept in the checkpoint state
    assert metric_lines(tmp_path / "killed") == metric_lines(tmp_path / "straight")

    a = load_model(tmp_path / "straight" / "model").model.state_dict()
    b = load_model(tmp_path / "killed" / "model").model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)

    # a changed objective refuses to resume, naming the key
    with pytest.raises(Exception, match="objective.weighting"):
        run_sft(
            tiny_config(tmp_path, "killed", objective={"weighting": "inverse_t"}, steps=9),
            echo=lambda _: None,
        )
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        run_sft(tiny_config(tmp_path, "killed", resume=False), echo=lambda _: None)


def test_cli_generate_eval_and_errors(tmp_path, capsys):
    run_sft(tiny_config(tmp_path), echo=lambda _: None)
    model_dir = str(tmp_path / "run" / "model")
    assert (
        cli.main(
            [
                "generate",
                "--model",
                model_dir,
                "--prompt",
                "12+3=",
                "--prompt",
                "7+8=",
                "--trace",
                str(tmp_path / "t.json"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("12+3=") and out[1].startswith("7+8=")
    trace = json.loads((tmp_path / "t.json").read_text())
    assert len(trace["tokens"]) == 2 and trace["kernel_ids"]["token_logprobs"]
    assert (
        cli.main(
            ["eval", "--model", model_dir, "--examples", "8", "--output", str(tmp_path / "e.json")]
        )
        == 0
    )
    assert json.loads((tmp_path / "e.json").read_text())["num_examples"] == 8
    capsys.readouterr()
    assert cli.main(["eval", "--model", model_dir, "--guidance", "2"]) == 2
    assert "--guidance: applies to image models" in capsys.readouterr().err
    assert cli.main(["sft", "--set", "stepz=1"]) == 2
    assert "stepz: unknown key" in capsys.readouterr().err
    assert cli.main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "1+1="]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_shipped_config_matches_the_defaults():
    """configs/sft_arithmetic.yaml documents every key with its default value."""
    from pathlib import Path

    shipped = load_config(
        Path(__file__).parents[1] / "configs" / "sft_arithmetic.yaml", SFTRecipeConfig
    )
    defaults = SFTRecipeConfig()
    assert shipped.model_dump(exclude={"task"}) == defaults.model_dump(exclude={"task"})
    assert (
        token_task(shipped.task, 4, {}, "task").config
        == token_task(defaults.task, 4, {}, "task").config
    )


GRPO_TINY = {
    "task": {"num_digits": 2},
    "steps": 4,
    "prompts_per_step": 2,
    "group_size": 4,
    "micro_batch_size": 5,
    "eval_every": 2,
    "eval_examples": 8,
    "checkpoint_every": 2,
    "optim": {"lr": 1e-3},
}


def test_grpo_recipe_kill_and_resume_is_exact(tmp_path, monkeypatch):
    from diffusion_rl.config import GRPORecipeConfig
    from diffusion_rl.recipes.grpo import run_grpo

    run_sft(tiny_config(tmp_path, "sft"), echo=lambda _: None)
    model_path = str(tmp_path / "sft" / "model")

    def config(name, **extra):
        return build_config(
            GRPORecipeConfig,
            {
                **GRPO_TINY,
                "model": {"path": model_path},
                "output_dir": str(tmp_path / name),
                **extra,
            },
        )

    straight = run_grpo(config("straight"), echo=lambda _: None)
    assert straight["steps"] == 4 and straight["weights_version"] == 4
    assert [h["step"] for h in straight["history"]] == [0, 2, 4]
    assert (tmp_path / "straight" / "curves.png").stat().st_size > 5000
    records = [
        json.loads(line)
        for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(r["policy/ratio_mean"] == 1.0 for r in steps)  # μ = 1: on-policy, ratio 1
    # each value once under one name: with μ = 1 the learner's @iter0 copies are not logged
    assert not any(key.endswith("@iter0") for r in records for key in r)

    real_step = Trainer.train_step

    def dying_step(self, micro_batches, loss_fn=None):
        if self.global_step == 3:
            raise KeyboardInterrupt
        return real_step(self, micro_batches, loss_fn)

    monkeypatch.setattr(Trainer, "train_step", dying_step)
    with pytest.raises(KeyboardInterrupt):
        run_grpo(config("killed"), echo=lambda _: None)
    monkeypatch.setattr(Trainer, "train_step", real_step)
    resumed = run_grpo(config("killed"), echo=lambda _: None)
    assert resumed["weights_version"] == 4
    assert resumed["history"] == straight["history"]  # kept in the checkpoint state
    assert resumed["accuracy_before"] == straight["accuracy_before"]
    a = load_model(tmp_path / "straight" / "model").model.state_dict()
    b = load_model(tmp_path / "killed" / "model").model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(Exception, match="objective.clip_low"):
        run_grpo(config("killed", policy={"clip_low": 0.1}, steps=6), echo=lambda _: None)


def test_quickstart_runs_sft_then_grpo(tmp_path, capsys, monkeypatch):
    from diffusion_rl import quickstart
    from diffusion_rl.quickstart import run_quickstart

    seeds = []  # the seed each stage ran with: --seed reaches both

    def spy(run):
        return lambda config: seeds.append(config.seed) or run(config)

    monkeypatch.setattr(quickstart, "run_sft", spy(quickstart.run_sft))
    monkeypatch.setattr(quickstart, "run_grpo", spy(quickstart.run_grpo))

    tiny = {k: v for k, v in TINY.items() if k not in ("steps", "task", "eval_every")}
    overrides = [f"sft.{k}={json.dumps(v)}" for k, v in tiny.items()]
    overrides += [
        "grpo.prompts_per_step=2",
        "grpo.group_size=4",
        "grpo.eval_examples=8",
    ]
    summary = run_quickstart(str(tmp_path / "qs"), steps=4, rl_steps=2, overrides=overrides, seed=3)
    assert seeds == [3, 3]
    out = capsys.readouterr().out
    assert "SFT on sudoku, up to 4 steps, stopping at 15% held-out accuracy" in out
    assert "after SFT" in out and "after GRPO" in out
    saved = json.loads((tmp_path / "qs" / "results.json").read_text())
    assert saved == summary and saved["grpo"]["steps"] == 2
    assert saved["grpo"]["accuracy_before"] == saved["sft"]["accuracy"]  # same eval, same model
    sft = json.loads((tmp_path / "qs" / "sft" / "results.json").read_text())
    assert sft["steps"] == 4 and sft["stopped_at_accuracy"] is None  # 4 steps learn no Sudoku
    grpo = json.loads((tmp_path / "qs" / "grpo" / "results.json").read_text())
    assert [h["step"] for h in grpo["history"]] == [0, 1, 2]  # before, the midpoint, after
    with pytest.raises(ValueError, match="keys must start with sft. or grpo."):
        run_quickstart(str(tmp_path / "x"), overrides=["steps=3"])


def test_shipped_grpo_config_matches_the_defaults():
    from pathlib import Path

    from diffusion_rl.config import GRPORecipeConfig

    shipped = load_config(
        Path(__file__).parents[1] / "configs" / "grpo_arithmetic.yaml", GRPORecipeConfig
    )
    assert shipped == GRPORecipeConfig()


def test_grpo_in_bf16_samples_at_the_learner_precision(tmp_path):
    """Rollouts run under the trainer's autocast, so the learner reproduces them exactly."""
    from diffusion_rl.config import GRPORecipeConfig
    from diffusion_rl.recipes.grpo import run_grpo

    run_sft(tiny_config(tmp_path, "sft", steps=3), echo=lambda _: None)
    config = build_config(
        GRPORecipeConfig,
        {
            **GRPO_TINY,
            "steps": 2,
            "micro_batch_size": None,
            "precision": "bf16",
            "model": {"path": str(tmp_path / "sft" / "model")},
            "output_dir": str(tmp_path / "bf16"),
        },
    )
    run_grpo(config, echo=lambda _: None)
    records = [
        json.loads(line) for line in (tmp_path / "bf16" / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [r for r in records if "policy/parity_max_abs" in r]
    assert len(steps) == 2
    assert all(r["policy/parity_max_abs"] == 0.0 and r["policy/ratio_mean"] == 1.0 for r in steps)


def test_model_references_are_checked_by_kind_and_small_models_train_on_one_thread(tmp_path):
    from diffusion_rl.config import GRPORecipeConfig
    from diffusion_rl.recipes.grpo import run_grpo
    from diffusion_rl.recipes.run import SMALL_MODEL_PARAMETERS, default_threads

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        run_sft(tiny_config(tmp_path, "sft", steps=1), echo=lambda _: None)
        assert torch.get_num_threads() == 1  # threads: null -> 1 for a model this small
    finally:
        torch.set_num_threads(threads)
    assert default_threads(SMALL_MODEL_PARAMETERS - 1) == 1
    assert default_threads(SMALL_MODEL_PARAMETERS) == torch.get_num_threads()

    model = str(tmp_path / "sft" / "model")
    wrong_kind = {**GRPO_TINY, "model": {"path": model, "kind": "flow"}}
    with pytest.raises(ConfigError, match="model.kind: this recipe trains token models"):
        run_grpo(build_config(GRPORecipeConfig, {**wrong_kind, "output_dir": str(tmp_path / "g")}))
    with pytest.raises(ConfigError, match="model.kind"):
        build_config(GRPORecipeConfig, {"model": {"path": model, "kind": "video"}})


def test_a_finished_run_extended_to_more_steps_evaluates_where_the_longer_run_would(tmp_path):
    """Resumed from the end of a 6-step run (its last checkpoint precedes its final
    evaluation), a 9-step run catches up the evaluation due at step 6."""
    schedule = {"optim": {"total_steps": 9}}
    run_sft(tiny_config(tmp_path, "extended", steps=6, **schedule), echo=lambda _: None)
    longer = run_sft(tiny_config(tmp_path, "extended", steps=9, **schedule), echo=lambda _: None)
    straight = run_sft(tiny_config(tmp_path, "straight", steps=9, **schedule), echo=lambda _: None)
    assert [h["step"] for h in longer["history"]] == [3, 6, 9]
    assert longer["history"] == straight["history"]
    assert metric_lines(tmp_path / "extended") == metric_lines(tmp_path / "straight")
    a = load_model(tmp_path / "straight" / "model").model.state_dict()
    b = load_model(tmp_path / "extended" / "model").model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_wandb_gets_the_run_config_and_each_metric_once(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    config = tiny_config(tmp_path, steps=4, wandb_project="diffusion-rl-tests")
    run_sft(config, echo=lambda _: None)
    [init] = fake.inits
    assert init["project"] == "diffusion-rl-tests" and init["resume"] == "allow"
    assert init["config"] == config.model_dump(mode="json") and fake.finished == 1
    pairs = [(step, key) for step, data in fake.logged for key in data]
    assert len(pairs) == len(set(pairs))  # each metric once per step
    expected = [(r["step"], k) for r in metric_lines(tmp_path / "run") for k in r if k != "step"]
    assert pairs == expected  # the same numbers as metrics.jsonl
    assert [s for s, key in pairs if key == "eval/accuracy"] == [3, 4]
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match="pip install wandb"):
        run_sft(tiny_config(tmp_path, "other", wandb_project="p"), echo=lambda _: None)


def test_leftovers_of_an_interrupted_final_save_are_removed_at_the_next_start(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    staged = [out / ".model.staging", out / "..model.staging.tmp-1a2b3c", out / ".model.retired"]
    for directory in staged:
        directory.mkdir()
        (directory / "model.safetensors").write_bytes(b"partial")
    (out / ".results.json.tmp-0badc0de").write_text("{")
    (out / ".notes").write_text("not ours")  # anything else stays
    (out / ".model.mine").mkdir()
    run_sft(tiny_config(tmp_path, steps=1), echo=lambda _: None)
    hidden = sorted(p.name for p in out.iterdir() if p.name.startswith("."))
    assert hidden == [".model.mine", ".notes"]
    assert (out / "model" / "model.safetensors").stat().st_size > 1000


def test_image_recipes_log_their_sample_grids_to_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from diffusion_rl.config import FlowSFTRecipeConfig
    from diffusion_rl.recipes.flow_sft import run_flow_sft

    tiny = {
        "model": {"patch_size": 4, "d_model": 16, "n_layers": 1, "n_heads": 2},
        "sampler": {"num_steps": 2},
        "steps": 2,
        "batch_size": 4,
        "eval_every": 1,
        "eval_samples_per_prompt": 1,
        "grid_images": 4,
        "checkpoint_every": 2,
        "output_dir": str(tmp_path / "flow"),
    }
    result = run_flow_sft(build_config(FlowSFTRecipeConfig, tiny), echo=lambda _: None)
    grids = ["samples/step_000001.png", "samples/step_000002.png"]
    assert [h.get("grid") for h in result["history"]] == grids  # relative to output_dir
    events = EventAccumulator(str(tmp_path / "flow" / "tensorboard"))
    events.Reload()
    images = events.Images("eval/samples")
    assert [i.step for i in images] == [1, 2]
    with Image.open(tmp_path / "flow" / grids[-1]) as png:
        assert (images[-1].width, images[-1].height) == png.size


def test_learner_metrics_are_logged_once_under_one_name():
    from diffusion_rl.recipes.run import _one_name_per_value

    # what PolicyLearner.step reports for μ = 2: per-iteration copies, plain = the last one
    metrics = {"loss@iter0": 0.5, "kl@iter0": 0.0, "loss@iter1": 0.4, "kl@iter1": 0.1}
    metrics.update({"loss": 0.4, "kl": 0.1, "lr": 1e-3, "rollout/reward_mean": 0.25})
    assert _one_name_per_value(metrics, 2) == {
        "loss@iter0": 0.5,
        "kl@iter0": 0.0,
        "loss": 0.4,
        "kl": 0.1,
        "lr": 1e-3,
        "rollout/reward_mean": 0.25,
    }
    single = {"loss@iter0": 0.5, "loss": 0.5, "odd@iter0": 1.0}  # no plain "odd": kept
    assert _one_name_per_value(single, 1) == {"loss": 0.5, "odd@iter0": 1.0}


def test_sft_stops_at_the_first_evaluation_reaching_stop_at_accuracy(tmp_path, monkeypatch):
    """With ``stop_at_accuracy`` the run ends (checkpointed, model written) at the first
    evaluation reaching it, with the weights of a plain run of that many steps; a rerun with
    the same target is finished, one with a higher target trains on to its own stop."""
    from diffusion_rl.recipes.sft import SFTRecipe

    scripted = {3: 0.1, 6: 0.5, 9: 0.9, 12: 0.95}  # held-out accuracy by step
    evaluate = SFTRecipe.evaluate

    def scripted_evaluate(self, tag):
        record, metrics = evaluate(self, tag)
        record["accuracy"] = scripted[record["step"]]
        return record, metrics

    monkeypatch.setattr(SFTRecipe, "evaluate", scripted_evaluate)
    schedule = {"optim": {"total_steps": 12}}
    quiet = {"echo": lambda _: None}
    stopped = run_sft(tiny_config(tmp_path, "stop", steps=12, stop_at_accuracy=0.5, **schedule))
    assert stopped["steps"] == 6 and stopped["stopped_at_accuracy"] == 0.5
    assert [h["step"] for h in stopped["history"]] == [3, 6]  # no second evaluation at 6
    plain = run_sft(tiny_config(tmp_path, "plain", steps=6, **schedule), **quiet)
    assert plain["stopped_at_accuracy"] is None
    a = load_model(tmp_path / "stop" / "model").model.state_dict()
    b = load_model(tmp_path / "plain" / "model").model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)

    messages = []
    again = run_sft(
        tiny_config(tmp_path, "stop", steps=12, stop_at_accuracy=0.5, **schedule),
        echo=messages.append,
    )
    assert again == stopped and any("already finished" in m for m in messages)
    higher = run_sft(
        tiny_config(tmp_path, "stop", steps=12, stop_at_accuracy=0.9, **schedule), **quiet
    )
    assert higher["steps"] == 9 and [h["step"] for h in higher["history"]] == [3, 6, 9]
    with pytest.raises(ValueError, match="stop_at_accuracy"):
        tiny_config(tmp_path, "bad", stop_at_accuracy=1.5)
