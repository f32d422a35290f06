"""The token recipes with ``model.lora`` (``student.lora``): only the adapter trains, the
reference is the base (KL 0 at the first step), checkpoints hold the adapter and optimizer
only and resume exactly, the run's model directory names its base instead of copying it, and
``generate`` / ``export --merge`` read it."""

from __future__ import annotations

import json

import pytest
import safetensors
import torch

from diffusion_rl import cli
from diffusion_rl.config import (
    ConfigError,
    DistillRecipeConfig,
    GRPORecipeConfig,
    SFTRecipeConfig,
    build_config,
)
from diffusion_rl.models import load_model
from diffusion_rl.models.lora import ADAPTER_FILE, has_lora, lora_state_dict
from diffusion_rl.recipes.distill import run_distill
from diffusion_rl.recipes.grpo import run_grpo
from diffusion_rl.recipes.sft import run_sft
from diffusion_rl.train import Trainer

QUIET = {"echo": lambda _: None}
LORA = {"rank": 4}
SFT = {
    "model": {"d_model": 32, "n_layers": 1, "n_heads": 2},
    "task": {"num_digits": 2},
    "steps": 4,
    "batch_size": 8,
    "eval_every": 4,
    "eval_examples": 4,
    "checkpoint_every": 2,
}
GRPO = {
    "task": {"num_digits": 2},
    "steps": 4,
    "prompts_per_step": 2,
    "group_size": 4,
    "eval_every": 2,
    "eval_examples": 4,
    "checkpoint_every": 2,
    "optim": {"lr": 1e-2},
    "rewards": [{"name": "digits"}],  # partial credit: spread even from an untrained model
}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny SFT model directory (trained in full): the base of every LoRA run here."""
    root = tmp_path_factory.mktemp("base")
    run_sft(build_config(SFTRecipeConfig, {**SFT, "output_dir": str(root / "sft")}), **QUIET)
    return root / "sft" / "model"


def adapter_keys(model_dir):
    with safetensors.safe_open(model_dir / ADAPTER_FILE, framework="pt") as handle:
        return set(handle.keys())


def checkpoint_keys(run):
    with safetensors.safe_open(
        run / "checkpoints" / "step_00000004" / "model.safetensors", "pt"
    ) as f:
        return set(f.keys())


def grpo_config(tmp_path, base, name, **extra):
    data = {**GRPO, "model": {"path": str(base), "lora": LORA}, "output_dir": str(tmp_path / name)}
    return build_config(GRPORecipeConfig, {**data, **extra})


def test_grpo_with_lora_trains_the_adapter_resumes_exactly_and_writes_an_adapter_directory(
    tmp_path, base, monkeypatch, capsys
):
    straight = run_grpo(grpo_config(tmp_path, base, "straight"), **QUIET)
    run = tmp_path / "straight"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert steps[0]["policy/kl"] == 0.0  # the reference is the base; a fresh adapter adds 0
    assert all(r["policy/ratio_mean"] == 1.0 for r in steps)  # μ = 1: on-policy
    assert steps[-1]["policy/kl"] > 0.0 and straight["weights_version"] == 4

    # the model directory: the adapter and the base's path, no copy of the base
    model_dir = run / "model"
    assert sorted(p.name for p in model_dir.iterdir()) == [
        ADAPTER_FILE,
        "config.json",
        "diffusion_rl.json",
        "manifest.json",
    ]
    config = json.loads((model_dir / "config.json").read_text())
    assert config["base_model"] == str(base.resolve()) and config["lora"]["rank"] == 4
    loaded = load_model(model_dir)
    assert has_lora(loaded.model) and adapter_keys(model_dir) == set(lora_state_dict(loaded.model))
    base_model = load_model(base).model
    base_state = base_model.state_dict()
    for name, tensor in loaded.model.state_dict().items():  # the base weights are the base's
        if ".lora_" not in name:
            assert torch.equal(tensor, base_state[name.replace(".base_layer", "")])

    # checkpoints: adapter + optimizer only
    assert checkpoint_keys(run) == adapter_keys(model_dir)
    optimizer = torch.load(
        run / "checkpoints" / "step_00000004" / "optimizer.pt", weights_only=True
    )
    assert len(optimizer["state"]) == len(adapter_keys(model_dir))

    # killed after the step-2 checkpoint, then resumed: the same adapter, bitwise
    real_step = Trainer.train_step

    def dying_step(self, micro_batches, loss_fn=None):
        if self.global_step == 3:
            raise KeyboardInterrupt
        return real_step(self, micro_batches, loss_fn)

    monkeypatch.setattr(Trainer, "train_step", dying_step)
    with pytest.raises(KeyboardInterrupt):
        run_grpo(grpo_config(tmp_path, base, "killed"), **QUIET)
    monkeypatch.setattr(Trainer, "train_step", real_step)
    resumed = run_grpo(grpo_config(tmp_path, base, "killed"), **QUIET)
    assert resumed["history"] == straight["history"]
    a = lora_state_dict(loaded.model)
    b = lora_state_dict(load_model(tmp_path / "killed" / "model").model)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(Exception, match="trainer.lora.rank"):
        run_grpo(grpo_config(tmp_path, base, "killed", steps=6, model={"path": str(base),
                 "lora": {"rank": 2}}), **QUIET)  # fmt: skip

    # served and exported
    capsys.readouterr()
    assert cli.main(["generate", "--model", str(model_dir), "--prompt", "12+3="]) == 0
    assert capsys.readouterr().out.startswith("12+3=")
    assert cli.main(["export", "--merge", str(run), str(tmp_path / "merged")]) == 0
    merged = load_model(tmp_path / "merged")
    assert not has_lora(merged.model) and set(merged.model.state_dict()) == set(base_state)
    assert merged.info["trained_steps"] == 4


def test_sft_and_distill_with_lora(tmp_path, base):
    config = build_config(
        SFTRecipeConfig,
        {**SFT, "model": {"path": str(base), "lora": LORA}, "output_dir": str(tmp_path / "sft")},
    )
    before = load_model(base).model.state_dict()
    result = run_sft(config, **QUIET)
    assert result["steps"] == 4
    model_dir = tmp_path / "sft" / "model"
    assert json.loads((model_dir / "config.json").read_text())["model_type"] == "diffusion_rl.lora"
    trained = load_model(model_dir).model
    assert any(
        not torch.equal(v, torch.zeros_like(v))
        for k, v in lora_state_dict(trained).items()
        if ".lora_B." in k
    )  # the adapter trained
    for name, tensor in trained.state_dict().items():
        if ".lora_" not in name:
            assert torch.equal(tensor, before[name.replace(".base_layer", "")])
    with pytest.raises(ConfigError, match="model.lora: a LoRA adapter trains on a saved base"):
        run_sft(
            build_config(SFTRecipeConfig, {**SFT, "model": {**SFT["model"], "lora": LORA},
                         "output_dir": str(tmp_path / "new")}), **QUIET,
        )  # fmt: skip
    with pytest.raises(ConfigError, match="model.lora.target_modules: 'q_proj' matches no module"):
        run_sft(
            build_config(SFTRecipeConfig, {**SFT, "model": {"path": str(base), "lora": {
                "target_modules": ["q_proj"]}}, "output_dir": str(tmp_path / "bad")}), **QUIET,
        )  # fmt: skip

    # distillation: the LoRA-SFT student (its adapter merged, a new one trained), any teacher
    distill = {
        "steps": 2,
        "prompts_per_step": 2,
        "samples_per_prompt": 2,
        "eval_every": 2,
        "eval_examples": 4,
        "checkpoint_every": 2,
        "student": {"path": str(model_dir), "lora": LORA},
        "teacher": {"path": str(base)},
        "output_dir": str(tmp_path / "distill"),
    }
    report = run_distill(build_config(DistillRecipeConfig, distill), **QUIET)
    assert report["weights_version"] == 2
    student_dir = tmp_path / "distill" / "model"
    config = json.loads((student_dir / "config.json").read_text())
    assert config["base_model"] == str(model_dir.resolve())  # a chain: LoRA on a LoRA run
    student = load_model(student_dir).model
    ids = torch.randint(2, 13, (2, 10))
    mask = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        assert torch.isfinite(student(ids, mask, 4)).all()
    bad = {
        **distill,
        "teacher": {"path": str(base), "lora": LORA},
        "output_dir": str(tmp_path / "t"),
    }
    with pytest.raises(ConfigError, match="teacher.lora: the teacher is frozen"):
        run_distill(build_config(DistillRecipeConfig, bad), **QUIET)
