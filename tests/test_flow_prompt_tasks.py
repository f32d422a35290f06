"""Flow-GRPO on a prompt list from a local file (``task: {name: prompts, path: FILE}``), from
the CLI with a config file: a tiny built-in FlowDiT directory with the compressibility (and
OCR) reward, and a tiny local SD3 pipeline with LoRA and a CLIP-based reward model.

Checked against independent computations: the held-out evaluation (the file's held-out
prompts sampled with the ODE sampler at seeds 0, 1, ... and scored by freshly built rewards),
the first rollout's reward (the file's train prompts at the recipe's rollout seeds), ratio
exactly 1 and parity 0 before the first update, KL 0 for the LoRA, ``diffusion-rl eval`` on
the saved model (the run's final evaluation again), and the config errors (each names its
key)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from flow_toy import fill_zero_layers, one_thread  # noqa: F401 - the fixture applies by import
from test_reward_models import clip_dir  # noqa: F401 - a tiny random CLIP directory (fixture)

from diffusion_rl import cli
from diffusion_rl.config import ConfigError, FlowGRPORecipeConfig, build_config
from diffusion_rl.models import load_model
from diffusion_rl.models.dit import FlowDiT, FlowDiTConfig
from diffusion_rl.models.io import save_model
from diffusion_rl.recipes.flow_grpo import FlowGRPORecipe
from diffusion_rl.rewards import CompressibilityReward, get_reward
from diffusion_rl.rollout import rollout_seed
from diffusion_rl.sampling.flow import sample_flow
from diffusion_rl.tasks.datasets import PromptFileConfig, PromptFileTask

PNG = b"\x89PNG\r\n\x1a\n"
# in the built-in FlowDiT's vocabulary (the mini-GenEval words)
PROMPTS = [
    "a red circle",
    "two blue squares",
    "a green triangle on the left",
    "one yellow square at the top",
    "three red circles",
    "a blue triangle in the center",
    "two green circles at the bottom",
    "a yellow circle on the right",
]
OCR_TEXTS = ["open", "cafe", "24h", "exit", "stop", "hi", "bar", "inn"]
SAMPLER = {"num_steps": 4, "micro_batch_size": 4}
RUN = {
    "steps": 2,
    "prompts_per_step": 2,
    "group_size": 4,
    "eval_every": 1,
    "eval_samples_per_prompt": 1,
    "grid_images": 4,
    "checkpoint_every": 1,
    "optim": {"lr": 1e-3},
}


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def run_cli(config: dict, path: Path, capsys) -> str:
    path.write_text(yaml.safe_dump(config))
    assert cli.main(["flow-grpo", "--config", str(path)]) == 0
    return capsys.readouterr().out


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """A .txt prompt list (one per line, a blank line skipped) and a .jsonl one whose rows
    also have a ``text`` column (the OCR target)."""
    root = tmp_path_factory.mktemp("prompts")
    txt = root / "prompts.txt"
    txt.write_text("\n".join(PROMPTS[:4]) + "\n\n" + "\n".join(PROMPTS[4:]) + "\n")
    jsonl = root / "prompts.jsonl"
    rows = [{"prompt": p, "text": t} for p, t in zip(PROMPTS, OCR_TEXTS)]
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return {"txt": txt, "jsonl": jsonl}


@pytest.fixture(scope="module")
def dit_dir(tmp_path_factory) -> Path:
    """A tiny built-in FlowDiT model directory (about 30 k parameters) whose zero-initialised
    layers are drawn at random, so that a fresh model's images depend on its weights."""
    directory = tmp_path_factory.mktemp("dit") / "model"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = FlowDiT(FlowDiTConfig(patch_size=4, d_model=32, n_layers=1, n_heads=2))
        fill_zero_layers(model)
    save_model(directory, model, {})
    return directory


def dit_config(out: Path, model: Path, task: dict, rewards: list[dict]) -> dict:
    return {
        **RUN,
        "output_dir": str(out),
        "model": {"path": str(model)},
        "task": task,
        "rewards": rewards,
        "sampler": SAMPLER,
    }


def held_out_images(model, task: PromptFileTask, sampler) -> tuple[list, torch.Tensor]:
    """The held-out prompts (one sample each) and their images with the ODE sampler at seeds
    0, 1, ... (the recipe's evaluation, recomputed)."""
    examples = task.prompts("eval")
    ode = sampler.model_copy(update={"mode": "ode", "share_group_noise": False})
    seeds = list(range(len(examples)))
    return examples, sample_flow(model, [e.prompt for e in examples], ode, seeds=seeds).images


# ----------------------------------------------------------------------------- built-in model
@pytest.fixture(scope="module")
def txt_run(files, dit_dir, tmp_path_factory):
    """flow-grpo from the CLI on the .txt prompt list with the compressibility reward."""
    root = tmp_path_factory.mktemp("txt_run")
    out = root / "run"
    task = {"name": "prompts", "path": str(files["txt"]), "heldout_fraction": 0.25}
    config = dit_config(out, dit_dir, task, [{"name": "compressibility"}])
    (root / "grpo.yaml").write_text(yaml.safe_dump(config))
    assert cli.main(["flow-grpo", "--config", str(root / "grpo.yaml")]) == 0
    return out, config


def test_prompt_file_splits_and_the_first_rollout(files, dit_dir, txt_run):
    out, config = txt_run
    task = PromptFileTask(PromptFileConfig(path=str(files["txt"]), heldout_fraction=0.25))
    train, held = task.prompts("train"), task.prompts("eval")
    # 8 prompts (the blank line skipped), 2 held out, none in both
    assert len(train) == 6 and len(held) == 2
    assert sorted(e.prompt for e in train + held) == sorted(PROMPTS)

    first = next(r for r in records(out) if "loss" in r)
    assert first["flow_grpo/ratio_min"] == 1.0 == first["flow_grpo/ratio_max"]
    assert first["flow_grpo/parity_max_abs"] == 0.0
    assert "rollout/accuracy" not in first  # no verifier, no accuracy
    # the first rollout, recomputed: the file's train prompts at the recipe's rollout seeds
    built = build_config(FlowGRPORecipeConfig, config)
    examples = [task.example(i, "train") for i in range(2) for _ in range(4)]
    assert {e.prompt for e in examples} <= {e.prompt for e in train}
    seeds = [rollout_seed(0, i, g) for i in range(2) for g in range(4)]
    model = load_model(dit_dir).model
    images = sample_flow(model, [e.prompt for e in examples], built.sampler, seeds=seeds).images
    rewards = CompressibilityReward()(images.float(), examples)
    assert first["rollout/reward_mean"] == pytest.approx(float(rewards.mean()), abs=1e-6)
    assert first["rollout/reward_std"] > 0  # compressibility differs within a group


def test_evaluation_scores_the_held_out_prompts_with_the_rewards(files, dit_dir, txt_run):
    out, config = txt_run
    results = json.loads((out / "results.json").read_text())
    history = results["history"]
    assert [h["step"] for h in history] == [0, 1, 2]
    assert all("accuracy" not in h for h in history)
    task = PromptFileTask(PromptFileConfig(path=str(files["txt"]), heldout_fraction=0.25))
    sampler = build_config(FlowGRPORecipeConfig, config).sampler
    examples, images = held_out_images(load_model(dit_dir).model, task, sampler)
    expected = float(CompressibilityReward()(images.float(), examples).mean())
    assert history[0]["rewards"] == {"compressibility": pytest.approx(expected, abs=1e-6)}
    assert history[0]["reward_mean"] == pytest.approx(expected, abs=1e-6)
    assert results["reward_mean_before"] == history[0]["reward_mean"]
    assert results["reward_mean_after"] == history[-1]["reward_mean"]
    assert results["rewards_after"] == history[-1]["rewards"]
    assert results["eval"]["num_images"] == 2
    # the logged curves: eval/reward_mean and eval/<reward> at every evaluation
    logged = [r for r in records(out) if "eval/reward_mean" in r]
    assert [r["step"] for r in logged] == [0, 1, 2]
    assert [r["eval/compressibility"] for r in logged] == [h["reward_mean"] for h in history]
    for name in ("before", "step_000001", "after"):
        assert (out / "samples" / f"{name}.png").read_bytes()[:8] == PNG
    assert (out / "curves.png").read_bytes()[:8] == PNG

    # the model directory records the prompt list and the rewards; `eval` on it is the
    # run's final evaluation again (same prompts, seeds, sampler and rewards)
    saved = load_model(out / "model")
    assert saved.info["task"] == task.info() and saved.info["trained_steps"] == 2
    assert saved.info["rewards"][0]["name"] == "compressibility"
    report = out.parent / "eval.json"
    assert cli.main(["eval", "--model", str(out / "model"), "--output", str(report)]) == 0
    evaluated = json.loads(report.read_text())
    assert evaluated["reward_mean"] == results["eval"]["reward_mean"]
    assert evaluated["rewards"] == results["rewards_after"]


def test_the_cli_reports_the_held_out_reward(files, dit_dir, tmp_path, capsys):
    task = {"name": "prompts", "path": str(files["txt"]), "heldout_fraction": 0.25}
    config = dit_config(tmp_path / "run", dit_dir, task, [{"name": "compressibility"}])
    config.update(steps=1, eval_every=5)
    printed = run_cli(config, tmp_path / "grpo.yaml", capsys)
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    before, after = results["reward_mean_before"], results["reward_mean_after"]
    assert f"held-out reward {before:.3f} -> {after:.3f}; results in" in printed
    assert "the prompts of" in printed and "6 train, 2 held out" in printed


def test_resume_refuses_a_changed_prompt_file(files, dit_dir, tmp_path, capsys):
    """The checkpoint records a digest of the prompts: an edited file (same path) is not
    resumed on."""
    path = tmp_path / "prompts.txt"
    path.write_text(files["txt"].read_text())
    task = {"name": "prompts", "path": str(path), "heldout_fraction": 0.25}
    config = dit_config(tmp_path / "run", dit_dir, task, [{"name": "compressibility"}])
    config.update(steps=1, eval_every=5)
    cfg = tmp_path / "grpo.yaml"
    cfg.write_text(yaml.safe_dump(config))
    assert cli.main(["flow-grpo", "--config", str(cfg)]) == 0
    path.write_text(path.read_text().replace("a red circle", "a red square"))
    cfg.write_text(yaml.safe_dump({**config, "steps": 2}))
    capsys.readouterr()
    assert cli.main(["flow-grpo", "--config", str(cfg)]) == 2
    assert "metadata does not match this run:\n  'prompts': this run has" in capsys.readouterr().err


def test_ocr_reward_reads_the_text_column(files, dit_dir, tmp_path, capsys):
    """The jsonl prompt list with a ``text`` column and the OCR reward beside compressibility:
    each eval record carries both terms and their weighted mean, equal to the rewards built
    afresh on the recomputed held-out images (the OCR target of each row is its ``text``)."""
    pytest.importorskip("rapidocr")
    pytest.importorskip("onnxruntime")
    task = {"name": "prompts", "path": str(files["jsonl"]), "heldout_fraction": 0.25}
    rewards = [
        {"name": "compressibility"},
        {"name": "ocr", "weight": 0.5, "options": {"detect": False}},
    ]
    config = dit_config(tmp_path / "run", dit_dir, task, rewards)
    config.update(steps=1)
    run_cli(config, tmp_path / "grpo.yaml", capsys)
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    prompt_task = PromptFileTask(PromptFileConfig(path=str(files["jsonl"]), heldout_fraction=0.25))
    sampler = build_config(FlowGRPORecipeConfig, config).sampler
    examples, images = held_out_images(load_model(dit_dir).model, prompt_task, sampler)
    assert [e.text for e in examples] == [OCR_TEXTS[e.row] for e in examples]
    ocr_reward = get_reward("ocr", detect=False)
    assert [ocr_reward.target(e, 0) for e in examples] == [e.text for e in examples]
    compress = float(CompressibilityReward()(images.float(), examples).mean())
    read = float(ocr_reward(images.float(), examples).mean())
    before = results["history"][0]
    assert before["rewards"] == {
        "compressibility": pytest.approx(compress, abs=1e-6),
        "ocr": pytest.approx(read, abs=1e-6),
    }
    assert before["reward_mean"] == pytest.approx(compress + 0.5 * read, abs=1e-6)
    logged = next(r for r in records(tmp_path / "run") if "eval/ocr" in r)
    assert logged["eval/ocr"] == before["rewards"]["ocr"]
    rollout = next(r for r in records(tmp_path / "run") if "loss" in r)
    assert {"rollout/ocr", "rollout/compressibility"} <= set(rollout)


# ----------------------------------------------------------------------------- SD3 + LoRA
def test_sd3_lora_with_a_reward_model_from_the_cli(files, clip_dir, tmp_path, capsys):  # noqa: F811
    pytest.importorskip("diffusers")
    pytest.importorskip("peft")
    from diffusion_rl.models.diffusers_adapters import SD3Adapter
    from diffusion_rl.models.flow_pipelines import load_pipeline_model, read_record

    pipeline = tmp_path / "sd3"
    SD3Adapter.tiny(seed=0).save_pretrained(pipeline)
    out = tmp_path / "run"
    options = {"path": str(clip_dir), "batch_size": 3}
    config = {
        **RUN,
        "output_dir": str(out),
        "model": {"path": str(pipeline), "max_sequence_length": 16, "lora": {"rank": 4}},
        "task": {"name": "prompts", "path": str(files["jsonl"]), "heldout_fraction": 0.25},
        "rewards": [{"name": "pickscore", "options": options}],
        "sampler": {"num_steps": 3, "shift": 3.0, "guidance_scale": 3.0},
        "prompts_per_step": 1,
        "group_size": 2,
        "eval_every": 2,
        "grid_images": 2,
        "optim": {"lr": 1e-2},
    }
    run_cli(config, tmp_path / "grpo.yaml", capsys)
    rows = {r["step"]: r for r in records(out) if "loss" in r}
    assert rows[1]["flow_grpo/ratio_min"] == 1.0 == rows[1]["flow_grpo/ratio_max"]
    assert rows[1]["flow_grpo/parity_max_abs"] == 0.0 and rows[1]["flow_grpo/kl"] == 0.0
    assert "rollout/accuracy" not in rows[1]
    results = json.loads((out / "results.json").read_text())
    history = results["history"]
    assert [h["step"] for h in history] == [0, 2] and set(history[0]["rewards"]) == {"pickscore"}

    # the images are the pipeline's own size (16 px for the tiny SD3), recorded in the model
    record = read_record(out / "model")
    assert (record.options["height"], record.options["width"]) == (16, 16)
    assert record.weights == "lora"
    # before the update the LoRA is zero: the base pipeline's held-out images, scored afresh
    base = load_pipeline_model(pipeline, "sd3", options=dict(record.options))
    task = PromptFileTask(PromptFileConfig(path=str(files["jsonl"]), heldout_fraction=0.25))
    sampler = build_config(FlowGRPORecipeConfig, config).sampler
    examples, images = held_out_images(base, task, sampler)
    assert tuple(images.shape[1:]) == (3, 16, 16)
    expected = float(get_reward("pickscore", **options)(images.float(), examples).mean())
    assert history[0]["reward_mean"] == pytest.approx(expected, abs=1e-5)
    assert results["rewards_before"]["pickscore"] == history[0]["reward_mean"]
    logged = [r for r in records(out) if "eval/pickscore" in r]
    assert [r["step"] for r in logged] == [0, 2]
    assert (out / "samples" / "before.png").read_bytes()[:8] == PNG


def test_wan_text_to_video_scores_clips_frame_by_frame(files, tmp_path, capsys):
    """A text-to-video pipeline on a prompt list: each image reward of a clip is the mean over
    its frames; the previews are frame strips with a GIF beside them."""
    pytest.importorskip("diffusers")
    pytest.importorskip("peft")
    from diffusion_rl.models.diffusers_adapters import WanAdapter
    from diffusion_rl.models.flow_pipelines import load_pipeline_model, read_record

    pipeline = tmp_path / "wan"
    WanAdapter.tiny(seed=0).save_pretrained(pipeline)
    out = tmp_path / "run"
    # 16 px: the tiny Wan's rotary tables are too small for the pipeline's default 480 x 832
    model = {"path": str(pipeline), "height": 16, "width": 16, "num_frames": 5}
    config = {
        **RUN,
        "output_dir": str(out),
        "model": {**model, "max_sequence_length": 16, "lora": {"rank": 4}},
        "task": {"name": "prompts", "path": str(files["txt"]), "heldout_fraction": 0.25},
        "rewards": [{"name": "compressibility"}],
        "sampler": {"num_steps": 3, "shift": 3.0, "guidance_scale": 3.0},
        "steps": 1,
        "prompts_per_step": 1,
        "group_size": 2,
        "grid_images": 2,
    }
    run_cli(config, tmp_path / "grpo.yaml", capsys)
    results = json.loads((out / "results.json").read_text())
    assert read_record(out / "model").options["num_frames"] == 5
    assert (out / "samples" / "before.gif").read_bytes()[:6] == b"GIF89a"
    base = load_pipeline_model(pipeline, "wan", options=dict(read_record(out / "model").options))
    task = PromptFileTask(PromptFileConfig(path=str(files["txt"]), heldout_fraction=0.25))
    sampler = build_config(FlowGRPORecipeConfig, config).sampler
    examples, clips = held_out_images(base, task, sampler)
    assert tuple(clips.shape[1:]) == (5, 3, 16, 16)
    per_frame = CompressibilityReward()(clips.flatten(0, 1).float(), [None] * 10).view(2, 5)
    expected = float(per_frame.mean(1).mean())
    assert results["rewards_before"]["compressibility"] == pytest.approx(expected, abs=1e-6)


# ----------------------------------------------------------------------------- config errors
def test_config_errors_name_the_key(files, tmp_path):
    def error(**data) -> str:
        with pytest.raises(ConfigError) as info:
            build_config(FlowGRPORecipeConfig, {"rewards": [{"name": "compressibility"}], **data})
        return str(info.value)

    prompts = {"name": "prompts", "path": str(files["txt"])}
    missing = str(tmp_path / "none.txt")
    assert f"task.path: no such file {missing!r}" in error(task={**prompts, "path": missing})
    assert "task.path: required key missing" in error(task={"name": "prompts"})
    assert "task.pathz: unknown key; did you mean 'path'?" in error(task={**prompts, "pathz": 1})
    assert "task.name: unknown value 'prompt'; expected one of 'geneval', 'prompts'" in error(
        task={**prompts, "name": "prompt"}
    )
    message = error(task=prompts, rewards=[{"name": "compressibility"}, {"name": "geneval"}])
    assert "rewards.1.name: the geneval reward scores images with the mini-GenEval verifier" in (
        message
    )
    assert "compressibility, clip_score, pickscore, aesthetic, ocr" in message
    assert "task.heldout_fraction: flow-grpo evaluates on held-out prompts" in error(
        task={**prompts, "heldout_fraction": 0.0}
    )
    table = tmp_path / "table.jsonl"
    table.write_text('{"caption": "a red circle"}\n{"caption": "two blue squares"}\n')
    message = error(task={"name": "prompts", "path": str(table)})
    assert "task.prompt_field: " in message and "no column 'prompt'" in message
    # geneval stays the default task name: its keys work without one
    config = build_config(FlowGRPORecipeConfig, {"task": {"kinds": ["count"]}})
    assert config.task.name == "geneval" and config.task.kinds == ("count",)


def test_recipe_refuses_prompts_the_model_cannot_take(files, dit_dir, tmp_path):
    """At build time, before anything is sampled: a word outside the built-in model's
    vocabulary, an OCR reward without a target for some row, and a geneval reward on the
    prompt list a model directory records."""
    outside = tmp_path / "outside.txt"
    outside.write_text("a red circle\na neon sign\ntwo blue squares\n")
    task = {"name": "prompts", "path": str(outside), "heldout_fraction": 0.3}
    config = dit_config(tmp_path / "a", dit_dir, task, [{"name": "compressibility"}])
    with pytest.raises(
        ConfigError, match=r"model.path: .* row 1 of task.path .*\['neon', 'sign'\]"
    ):
        FlowGRPORecipe(build_config(FlowGRPORecipeConfig, config))

    pytest.importorskip("rapidocr")
    pytest.importorskip("onnxruntime")
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        '{"prompt": "a red circle", "text": "ab"}\n{"prompt": "two blue squares"}\n'
        '{"prompt": "a green triangle", "text": "cd"}\n'
    )
    task = {"name": "prompts", "path": str(rows), "heldout_fraction": 0.3}
    config = dit_config(tmp_path / "b", dit_dir, task, [{"name": "ocr"}])
    with pytest.raises(ConfigError, match=r"rewards.0: task.path .*: ocr: row 1 has no target"):
        FlowGRPORecipe(build_config(FlowGRPORecipeConfig, config))


def test_a_recorded_prompt_list_refuses_the_geneval_reward(txt_run, tmp_path):
    out, _ = txt_run
    config = {**RUN, "output_dir": str(tmp_path / "c"), "model": {"path": str(out / "model")}}
    config["sampler"] = SAMPLER
    with pytest.raises(ConfigError, match="rewards.0.name: the geneval reward .* no verifier"):
        FlowGRPORecipe(build_config(FlowGRPORecipeConfig, config))  # task: the recorded one
    recipe = FlowGRPORecipe(
        build_config(FlowGRPORecipeConfig, {**config, "rewards": [{"name": "compressibility"}]})
    )
    assert isinstance(recipe.task, PromptFileTask) and recipe.task.config.heldout_fraction == 0.25
