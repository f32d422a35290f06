"""The workflow recipes end to end on tiny models: flow SFT of the video stage, workflow RL of
both stages (exact replay, independent versions, frozen stages, the constant-reward control,
exact resume), ``generate --workflow`` against the captured rollout, and the quickstart."""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch
import yaml
from flow_toy import one_thread, perturbed  # noqa: F401 (fixture: one CPU thread)

from diffusion_rl import cli
from diffusion_rl.config import ConfigError, FlowSFTRecipeConfig, WorkflowRLRecipeConfig
from diffusion_rl.evaluation import evaluate_workflow
from diffusion_rl.models.dit import FlowDiT, FlowDiTConfig
from diffusion_rl.models.io import load_model, save_model
from diffusion_rl.models.video_dit import VideoDiT, VideoDiTConfig
from diffusion_rl.quickstart import run_quickstart_workflow
from diffusion_rl.recipes.flow_sft import run_flow_sft
from diffusion_rl.recipes.workflow_rl import run_workflow_rl
from diffusion_rl.rewards import CombinedReward, get_reward
from diffusion_rl.rollout import collect_workflow_rollout
from diffusion_rl.tasks.geneval import VOCABULARY
from diffusion_rl.tasks.motion import MOTION_VOCABULARY, MotionTask
from diffusion_rl.workflows import Workflow, load_workflow_spec

TINY = {"patch_size": 4, "d_model": 32, "n_layers": 1, "n_heads": 2}
SAMPLER = {"num_steps": 3, "shift": 1.0, "guidance_scale": 1.0}


@pytest.fixture(scope="module")
def stage_models(tmp_path_factory):
    """Tiny untrained stage models on disk: the image FlowDiT and the video VideoDiT."""
    root = tmp_path_factory.mktemp("stages")
    torch.manual_seed(0)
    task = MotionTask()
    image = perturbed(FlowDiT(FlowDiTConfig(image_size=16, vocabulary=VOCABULARY, **TINY)))
    video = perturbed(
        VideoDiT(VideoDiTConfig(image_size=16, num_frames=4, vocabulary=MOTION_VOCABULARY, **TINY))
    )
    save_model(root / "image", image, {"task": task.image_task().info()})
    save_model(root / "video", video, {"task": task.info()})
    return root


def _workflow_file(root, tmp_path, mode="ode", fanout=2):
    sampler = {**SAMPLER, "mode": mode}
    spec = {
        "name": "t2i2v",
        "task": MotionTask().info(),
        "stages": [
            {
                "name": "image",
                "model": str(root / "image"),
                "prompt": "image_prompt",
                "sampler": sampler,
            },
            {
                "name": "video",
                "model": str(root / "video"),
                "input": "image",
                "fanout": fanout,
                "sampler": sampler,
            },
        ],
    }
    path = tmp_path / "workflow.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _rl_config(path, out, **extra):
    settings = {
        "workflow": str(path),
        "output_dir": str(out),
        "steps": 2,
        "eval_every": 2,
        "checkpoint_every": 1,
        "prompts_per_step": 1,
        "group_size": 2,
        "eval_samples_per_prompt": 1,
        "preview_clips": 2,
        "policy": {"beta": 0.01, "clip_range": 0.2},
        "stages": {"image": {"optim": {"lr": 3e-3}}, "video": {"optim": {"lr": 1e-3}}},
        **extra,
    }
    return WorkflowRLRecipeConfig(**settings)


def _weights(directory):
    return load_model(directory).model.state_dict()


def test_workflow_rl_trains_both_stages_with_exact_replay(stage_models, tmp_path):
    path = _workflow_file(stage_models, tmp_path)
    results = run_workflow_rl(_rl_config(path, tmp_path / "run"), echo=lambda _: None)
    assert results["weights_versions"] == {"image": 2, "video": 2}
    assert results["trained_stages"] == ["image", "video"]
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "loss" in line]
    assert [line["step"] for line in steps] == [1, 2]
    for line in steps:
        for stage in ("image", "video"):
            assert line[f"{stage}/flow_grpo/ratio_mean"] == 1.0
            assert (
                line[f"{stage}/flow_grpo/ratio_min"] == line[f"{stage}/flow_grpo/ratio_max"] == 1.0
            )
            assert line[f"{stage}/flow_grpo/parity_max_abs"] == 0.0
            assert line[f"grad_norm/{stage}"] > 0
        assert line["lr/image"] == 3e-3 and line["lr/video"] == 1e-3
        assert line["video/rollout/group_size"] == 2.0 and line["image/rollout/group_size"] == 2.0
    # the output serves: a workflow file with both trained stages, relative paths
    spec, _ = load_workflow_spec(results["workflow"])
    assert [s.name for s in spec.stages] == ["image", "video"]
    for stage in ("image", "video"):
        before, after = _weights(stage_models / stage), _weights(tmp_path / "run" / "model" / stage)
        assert any(not torch.equal(before[k], after[k]) for k in before), stage
    assert any(p.endswith("after.gif") for p in results["previews"])
    assert (tmp_path / "run" / "samples" / "before.png").is_file()
    assert 0.0 <= results["accuracy_after"] <= 1.0 and "direction" in results["attributes_after"]


def test_a_frozen_stage_keeps_version_zero_and_its_weights(stage_models, tmp_path):
    path = _workflow_file(stage_models, tmp_path)
    config = _rl_config(path, tmp_path / "run", stages={"image": {"train": False}})
    results = run_workflow_rl(config, echo=lambda _: None)
    assert results["weights_versions"] == {"image": 0, "video": 2}
    before, after = _weights(stage_models / "image"), _weights(tmp_path / "run" / "model" / "image")
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_constant_reward_moves_no_stage(stage_models, tmp_path):
    """The control: a reward that is the same for every clip (weight 0: total 0) gives zero
    advantages, so neither stage's weights move, bitwise, while both versions advance."""
    path = _workflow_file(stage_models, tmp_path)
    config = _rl_config(path, tmp_path / "run", rewards=[{"name": "motion", "weight": 0.0}])
    results = run_workflow_rl(config, echo=lambda _: None)
    assert results["weights_versions"] == {"image": 2, "video": 2}
    for stage in ("image", "video"):
        before, after = _weights(stage_models / stage), _weights(tmp_path / "run" / "model" / stage)
        assert all(torch.equal(before[k], after[k]) for k in before), stage


class _Constant:
    """A reward of 0.7 for every clip: not dyadic, so a float32 mean of a group of eight is
    off by one ulp (the flat-group hole)."""

    name = "motion"  # stands in for the video reward

    def __init__(self, value: float = 0.7, **_) -> None:
        self.value = value

    def __call__(self, clips, examples):
        return torch.full((len(examples),), self.value)


def test_a_constant_non_dyadic_reward_at_group_size_8_moves_no_stage(
    stage_models, tmp_path, monkeypatch
):
    """Eight first-stage samples per prompt, every clip scored 0.7, three steps: every stage is
    bitwise unchanged (flat groups are decided by max == min, not by the std)."""
    from diffusion_rl import rewards

    monkeypatch.setitem(rewards.REWARDS, "motion", _Constant)
    path = _workflow_file(stage_models, tmp_path)
    config = _rl_config(
        path,
        tmp_path / "run",
        steps=3,
        eval_every=3,
        checkpoint_every=3,
        group_size=8,
        rewards=[{"name": "motion", "weight": 1.0}],
    )
    results = run_workflow_rl(config, echo=lambda _: None)
    assert results["weights_versions"] == {"image": 3, "video": 3}
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "loss" in line]
    assert len(steps) == 3
    for line in steps:
        assert line["image/rollout/flat_groups"] == line["video/rollout/flat_groups"] == 1.0
        assert line["image/rollout/advantage_abs_mean"] == 0.0
    for stage in ("image", "video"):
        before, after = _weights(stage_models / stage), _weights(tmp_path / "run" / "model" / stage)
        assert all(torch.equal(before[k], after[k]) for k in before), stage


@pytest.mark.parametrize("algorithm", ["awm", "nft"])
def test_forward_process_workflow_rl_rolls_out_the_served_workflow_and_resumes(
    stage_models, tmp_path, monkeypatch, algorithm
):
    """workflow-rl with a forward-process objective: both stages roll out with the workflow
    file's own (ODE) samplers, so the first rollout's artefacts are what serving the workflow
    gives; both stages train, their old policies lag, and a killed run resumes bitwise. A
    stage may take its own objective (here the image stage Flow-GRPO's, on SDE rollouts)."""
    path = _workflow_file(stage_models, tmp_path)
    policy = {"algorithm": algorithm, "timesteps_per_sample": 2, "old_decay_rate": 0.3}
    policy["old_decay_max"] = 0.9
    extra = {"steps": 3, "eval_every": 3, "policy": policy, "eval_samples_per_prompt": 2}
    straight = run_workflow_rl(
        _rl_config(path, tmp_path / "straight", **extra), echo=lambda _: None
    )
    assert straight["weights_versions"] == {"image": 3, "video": 3}
    lines = [
        json.loads(x) for x in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [line for line in lines if "loss" in line]
    assert steps[1]["video/learner/old_policy_decay"] == pytest.approx(0.6)
    assert all(max(x[f"grad_norm/{s}"] for x in steps) > 0 for s in ("image", "video"))
    for stage in ("image", "video"):
        before, after = (
            _weights(stage_models / stage),
            _weights(tmp_path / "straight" / "model" / stage),
        )
        assert any(not torch.equal(before[k], after[k]) for k in before), stage

    # what was evaluated is what was saved: the lagging rollout weights, not the actor's
    saved_spec, _ = load_workflow_spec(straight["workflow"])
    saved = Workflow(
        saved_spec,
        {s.name: load_model(s.model).model for s in saved_spec.stages},
        task=MotionTask(),
    )
    again = evaluate_workflow(saved, samples_per_prompt=2, seed=0)
    assert again.accuracy == straight["eval"]["accuracy"]
    assert again.diversity > 0 and again.diversity == straight["history"][-1]["diversity"]

    # the first rollout is the served workflow (ODE samplers of the file) at the rollout seeds
    spec, _ = load_workflow_spec(path)
    models = {s.name: load_model(s.model).model for s in spec.stages}
    reward = CombinedReward([(get_reward("motion"), 1.0)])
    served, _ = collect_workflow_rollout(
        Workflow(spec, models, task=MotionTask()),
        reward,
        start_prompt=0,
        num_prompts=1,
        group_size=2,
        versions={"image": 0, "video": 0},
        seed=0,
        advantage=WorkflowRLRecipeConfig(workflow=str(path)).policy.advantage_spec,
    )
    assert not bool(served.run.stages["video"].trace.sde_steps.any())
    assert steps[0]["rollout/reward_mean"] == pytest.approx(float(served.rewards.mean()), abs=1e-6)

    from diffusion_rl.train import Trainer

    real_step = Trainer.train_step

    def dying_step(self, micro_batches, loss_fn=None):
        if self.global_step == 2:
            raise KeyboardInterrupt
        return real_step(self, micro_batches, loss_fn)

    monkeypatch.setattr(Trainer, "train_step", dying_step)
    with pytest.raises(KeyboardInterrupt):
        run_workflow_rl(_rl_config(path, tmp_path / "killed", **extra), echo=lambda _: None)
    monkeypatch.setattr(Trainer, "train_step", real_step)
    run_workflow_rl(_rl_config(path, tmp_path / "killed", **extra), echo=lambda _: None)
    for stage in ("image", "video"):
        a = _weights(tmp_path / "straight" / "model" / stage)
        b = _weights(tmp_path / "killed" / "model" / stage)
        assert all(torch.equal(a[k], b[k]) for k in a), stage

    mixed = {**extra, "stages": {"image": {"policy": {"algorithm": "flow_grpo"}}}}
    results = run_workflow_rl(_rl_config(path, tmp_path / "mixed", **mixed), echo=lambda _: None)
    lines = [json.loads(x) for x in (tmp_path / "mixed" / "metrics.jsonl").read_text().splitlines()]
    first = next(line for line in lines if "loss" in line)
    assert first["image/flow_grpo/ratio_min"] == 1.0 and f"video/{algorithm}/policy_loss" in first
    assert results["weights_versions"] == {"image": 3, "video": 3}


def test_resume_continues_exactly(stage_models, tmp_path):
    path = _workflow_file(stage_models, tmp_path)
    straight = run_workflow_rl(
        _rl_config(path, tmp_path / "straight", steps=3, eval_every=3), echo=lambda _: None
    )
    run_workflow_rl(
        _rl_config(path, tmp_path / "split", steps=2, eval_every=3), echo=lambda _: None
    )
    resumed = run_workflow_rl(
        _rl_config(path, tmp_path / "split", steps=3, eval_every=3), echo=lambda _: None
    )
    assert resumed["weights_versions"] == straight["weights_versions"] == {"image": 3, "video": 3}
    for stage in ("image", "video"):
        a = _weights(tmp_path / "straight" / "model" / stage)
        b = _weights(tmp_path / "split" / "model" / stage)
        assert all(torch.equal(a[k], b[k]) for k in a), stage


def test_a_stage_ema_is_served_saved_and_resumed(stage_models, tmp_path):
    """``stages.video.ema_decay: d`` (rollouts with shared group noise): the rollouts, hence
    the live weights, are unchanged; the saved video stage is the EMA of the live weights after
    each step (the first update copies: ``d · w1 + (1 - d) · w2`` after two steps); the image
    stage saves its live weights; a resumed run's EMA is the straight run's, bitwise."""
    path = _workflow_file(stage_models, tmp_path)
    d = 0.75
    shared = {"share_group_noise": True}  # the rollouts' groups start from one noise
    live = {
        "image": {"optim": {"lr": 3e-3}, "sampler": shared},
        "video": {"optim": {"lr": 1e-3}, "sampler": shared},
    }
    ema = {**live, "video": {**live["video"], "ema_decay": d}}

    def weights(out, stage):
        return _weights(tmp_path / out / "model" / stage)

    run_workflow_rl(_rl_config(path, tmp_path / "ema", stages=ema), echo=lambda _: None)
    run_workflow_rl(_rl_config(path, tmp_path / "live1", steps=1, stages=live), echo=lambda _: None)
    run_workflow_rl(_rl_config(path, tmp_path / "live2", stages=live), echo=lambda _: None)
    averaged, w1, w2 = (weights(out, "video") for out in ("ema", "live1", "live2"))
    moved = [k for k in w1 if not torch.equal(w1[k], w2[k])]
    assert moved  # the second step changed the live weights
    for key in w1:
        torch.testing.assert_close(averaged[key], d * w1[key] + (1 - d) * w2[key])
    image, live_image = weights("ema", "image"), weights("live2", "image")
    assert all(torch.equal(image[k], live_image[k]) for k in image)
    info = load_model(tmp_path / "ema" / "model" / "video").info
    assert info["ema_decay"] == d
    # resume: one step, then on to two; the EMA continues from its checkpointed state
    run_workflow_rl(_rl_config(path, tmp_path / "split", steps=1, stages=ema), echo=lambda _: None)
    run_workflow_rl(_rl_config(path, tmp_path / "split", stages=ema), echo=lambda _: None)
    resumed = weights("split", "video")
    assert all(torch.equal(resumed[k], averaged[k]) for k in averaged)
    with pytest.raises(ConfigError, match="stages.image.ema_decay: the stage is frozen"):
        frozen = {"image": {"train": False, "ema_decay": d}}
        run_workflow_rl(_rl_config(path, tmp_path / "f", stages=frozen), echo=lambda _: None)


def test_config_errors_name_the_stage(stage_models, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the built-in workflow a quickstart here would write is absent
    path = _workflow_file(stage_models, tmp_path)
    with pytest.raises(ConfigError, match="stages.audio: the workflow .* has no stage 'audio'"):
        run_workflow_rl(_rl_config(path, tmp_path / "a", stages={"audio": {}}), echo=print)
    frozen = {"image": {"train": False}, "video": {"train": False}}
    with pytest.raises(ConfigError, match="every stage is frozen"):
        run_workflow_rl(_rl_config(path, tmp_path / "b", stages=frozen), echo=print)
    with pytest.raises(ConfigError, match="quickstart --mode workflow"):
        run_workflow_rl(_rl_config("text-to-image-to-video", tmp_path / "c"), echo=print)
    ode = {"video": {"sampler": {"mode": "ode"}}}
    with pytest.raises(ConfigError, match="stages.video.sampler.mode: Flow-GRPO rollouts need SDE"):
        run_workflow_rl(_rl_config(path, tmp_path / "d", stages=ode), echo=print)
    window = {"video": {"sampler": {"sde_window": [0, 9]}}}
    with pytest.raises(ConfigError, match=r"stages.video.sampler.*sde_window: expected 0 <= start"):
        run_workflow_rl(_rl_config(path, tmp_path / "f", stages=window), echo=print)
    with pytest.raises(ValueError, match="unknown sampler setting 'num_step'"):
        _rl_config(path, tmp_path / "e", stages={"video": {"sampler": {"num_step": 3}}})


def test_generate_workflow_is_bitwise_the_captured_rollout(stage_models, tmp_path):
    """generate --workflow (capture off) and the workflow-RL rollout (capture on) of the same
    settings and seeds produce bitwise the same image and video artefacts."""
    path = _workflow_file(stage_models, tmp_path, mode="sde")
    out = tmp_path / "clips.safetensors"
    task = MotionTask()
    prompt = task.example(0, "train").prompt
    argv = [
        "generate",
        "--workflow",
        str(path),
        "--prompt",
        prompt,
        "--samples",
        "2",
        "--seed",
        "0",
    ]
    assert cli.main([*argv, "--output", str(out)]) == 0
    served = safetensors.torch.load_file(str(out))
    spec, _ = load_workflow_spec(path)
    models = {s.name: load_model(s.model).model for s in spec.stages}
    workflow = Workflow(spec, models, task=task)
    reward = CombinedReward([(get_reward("motion"), 1.0)])
    rollout, _ = collect_workflow_rollout(
        workflow,
        reward,
        start_prompt=0,
        num_prompts=1,
        group_size=2,
        versions={"image": 0, "video": 0},
        seed=0,
        advantage=WorkflowRLRecipeConfig().policy.advantage_spec,
    )
    for stage in ("image", "video"):
        captured = rollout.run.stages[stage]
        assert captured.trace is not None
        assert torch.equal(served[stage], captured.artefact), stage
        assert served[f"{stage}.seeds"].tolist() == captured.seeds
    assert served["video"].shape == (4, 4, 3, 16, 16)


def test_flow_sft_trains_the_video_stage(tmp_path):
    config = FlowSFTRecipeConfig(
        output_dir=str(tmp_path / "video"),
        steps=3,
        eval_every=3,
        batch_size=4,
        task={"name": "mini-motion"},
        model=TINY,
        sampler=SAMPLER,
        eval_samples_per_prompt=1,
        grid_images=2,
    )
    results = run_flow_sft(config, echo=lambda _: None)
    model = load_model(results["model_dir"]).model
    assert isinstance(model, VideoDiT) and model.latent_shape == (3, 4, 16, 16)
    assert set(results["eval"]["attributes"]) == {
        "color", "shape", "direction", "speed", "smooth", "overall"
    }  # fmt: skip
    assert (tmp_path / "video" / "samples" / "step_000003.gif").is_file()
    with pytest.raises(ConfigError, match="trains an image-to-video model; FlowDiT is not one"):
        image_dir = tmp_path / "image_model"
        save_model(
            image_dir, FlowDiT(FlowDiTConfig(image_size=16, vocabulary=VOCABULARY, **TINY)), {}
        )
        run_flow_sft(
            config.model_copy(
                update={
                    "model": config.model.model_copy(update={"path": str(image_dir)}),
                    "output_dir": str(tmp_path / "v2"),
                }
            ),
            echo=lambda _: None,
        )


def test_quickstart_workflow_runs_the_chain(tmp_path, capsys):
    tiny = [
        f"{stage}.model.{k}={v}" for stage in ("image_sft", "video_sft") for k, v in TINY.items()
    ]
    sampler = [f"{stage}.sampler.num_steps=3" for stage in ("image_sft", "video_sft")]
    rl = ["workflow_rl.prompts_per_step=1", "workflow_rl.group_size=2",
          "workflow_rl.eval_samples_per_prompt=1", "workflow_rl.preview_clips=2"]  # fmt: skip
    summary = run_quickstart_workflow(
        str(tmp_path / "qs"), steps=2, rl_steps=1, overrides=tiny + sampler + rl
    )
    assert summary["image_sft"]["steps"] == summary["video_sft"]["steps"] == 2
    assert summary["workflow_rl"]["steps"] == 1
    spec, _ = load_workflow_spec(tmp_path / "qs" / "workflow.yaml")
    assert spec.stage("video").input == "image" and spec.stage("image").prompt == "image_prompt"
    assert load_workflow_spec(summary["workflow"])[0].stage("video").fanout == 2
    text = capsys.readouterr().out
    assert "after workflow RL" in text and "generate --workflow" in text
    with pytest.raises(
        ValueError, match="keys must start with image_sft., video_sft., workflow_rl."
    ):
        run_quickstart_workflow(str(tmp_path / "bad"), overrides=["sft.steps=3"])


def test_the_shipped_config_documents_the_defaults():
    """configs/workflow_rl.yaml holds every key at its default (each stage's section at the
    stage defaults)."""
    from pathlib import Path

    from diffusion_rl.config import StageTrainSection, load_config

    path = Path(__file__).parents[1] / "configs" / "workflow_rl.yaml"
    shipped = load_config(path, WorkflowRLRecipeConfig)
    assert shipped.stages == {"image": StageTrainSection(), "video": StageTrainSection()}
    assert shipped.model_copy(update={"stages": {}}) == WorkflowRLRecipeConfig()
