"""The real-model example configs (configs/examples/) validate as their recipes' configs.

Their directories (/models/...) do not exist here, so each test points the paths the config
loader itself opens (a dataset file, a reward model) at tiny local stand-ins and the device at
the CPU; the model directories are opened only when a run starts.
"""

from __future__ import annotations

import json
from pathlib import Path

from test_reward_models import clip_dir  # noqa: F401 (fixture)

from diffusion_rl.config import FlowGRPORecipeConfig, GRPORecipeConfig, load_config

EXAMPLES = Path(__file__).resolve().parents[1] / "configs" / "examples"


def gsm8k_file(tmp_path: Path) -> Path:
    path = tmp_path / "gsm8k.jsonl"
    rows = [{"question": f"What is {a} + 2?", "answer": f"{a} + 2 = {a + 2}\n#### {a + 2}"}
            for a in range(12)]  # fmt: skip
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_the_llada_lora_example_validates(tmp_path):
    config = load_config(
        EXAMPLES / "grpo_llada8b_lora_gsm8k.yaml",
        GRPORecipeConfig,
        ["device=cpu", f"task.path={gsm8k_file(tmp_path)}"],
    )
    assert config.model.lora.rank == 32 and config.model.lora.alpha == 64
    assert config.model.dtype == "bfloat16" and config.precision == "bf16"
    assert config.task.name == "math" and config.task.options()["chat"] is True
    assert [r.name for r in config.rewards] == ["math"]
    assert config.activation_checkpointing


def test_the_sdar_example_validates(tmp_path):
    config = load_config(
        EXAMPLES / "grpo_sdar_gsm8k.yaml",
        GRPORecipeConfig,
        ["device=cpu", f"task.path={gsm8k_file(tmp_path)}"],
    )
    assert config.scorer == "packed" and config.sampler.block_size == 4
    assert config.model.lora is None


def test_the_sd35_example_validates(clip_dir):  # noqa: F811
    rewards = json.dumps([{"name": "pickscore", "options": {"path": str(clip_dir)}}])
    config = load_config(
        EXAMPLES / "flow_grpo_sd35_pickscore.yaml",
        FlowGRPORecipeConfig,
        ["device=cpu", f"rewards={rewards}"],
    )
    assert config.model.kind == "sd3" and config.model.height == 512 == 2 * 256
    assert config.model.lora.rank == 32
    assert config.sampler.sigma_schedule == "sd3"


def test_the_sd35_ocr_example_validates(tmp_path):
    prompts = tmp_path / "ocr_prompts.jsonl"
    rows = [{"prompt": f'a shop sign that says "OPEN {k}"', "text": f"OPEN {k}"} for k in range(20)]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = load_config(
        EXAMPLES / "flow_grpo_sd35_ocr.yaml",
        FlowGRPORecipeConfig,
        ["device=cpu", f"task.path={prompts}"],
    )
    assert config.task.name == "prompts" and config.task.prompt_field == "prompt"
    task = config.task.build()
    assert (len(task.prompts("train")), len(task.prompts("eval"))) == (18, 2)
    assert [r.name for r in config.rewards] == ["ocr"]
    assert config.rewards[0].options["text_field"] == "text"
    assert config.model.kind == "sd3" and config.model.height == 512 == config.model.width
    assert config.model.lora.rank == 32 and config.model.dtype == "bfloat16"
