"""Workflow files name their stages' model directories: built-in ones and local diffusers
pipeline directories (Wan 2.1 image-to-video as the second stage), loaded as a user loads them
and served with ``generate --workflow``."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch
import yaml
from flow_toy import one_thread  # noqa: F401 - the fixture applies by import

from diffusion_rl import cli
from diffusion_rl.models.diffusers_adapters import WanImageToVideoAdapter
from diffusion_rl.models.dit import FlowDiT, FlowDiTConfig
from diffusion_rl.models.io import save_model
from diffusion_rl.scoring.flow import FlowReplayScorer
from diffusion_rl.workflows import (
    Workflow,
    WorkflowError,
    load_stage_model,
    load_workflow_spec,
)

WAN = {"height": 16, "width": 16, "num_frames": 5}
SDE = {"num_steps": 3, "mode": "sde", "shift": 1.0, "guidance_scale": 2.0}
WORDS = ("a", "red", "blue", "cat", "dog")


@pytest.fixture(scope="module")
def directories(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan_workflow")
    torch.manual_seed(0)
    image = FlowDiT(
        FlowDiTConfig(image_size=16, patch_size=4, d_model=32, n_layers=1, n_heads=2,
                      vocabulary=WORDS)
    )  # fmt: skip
    with torch.no_grad():
        for p in image.parameters():
            p.add_(0.05 * torch.randn_like(p))
    save_model(root / "image", image, {})
    WanImageToVideoAdapter.tiny(seed=0).save_pretrained(root / "wan_i2v")
    spec = {
        "name": "t2i2v-wan",
        "stages": [
            {"name": "image", "model": "image", "sampler": SDE},
            {"name": "video", "model": "wan_i2v", "model_options": WAN, "input": "image",
             "sampler": SDE},
        ],
    }  # fmt: skip
    (root / "workflow.yaml").write_text(yaml.safe_dump(spec))
    return root


def test_a_wan_pipeline_directory_serves_as_the_second_stage(directories, tmp_path):
    spec, _ = load_workflow_spec(directories / "workflow.yaml")
    models = {stage.name: load_stage_model(stage) for stage in spec.stages}
    assert isinstance(models["video"], WanImageToVideoAdapter)
    assert models["video"].num_frames == 5
    out = tmp_path / "clips.safetensors"
    argv = ["generate", "--workflow", str(directories / "workflow.yaml"), "--prompt", "a red cat"]
    assert cli.main([*argv, "--prompt", "a blue dog", "--output", str(out)]) == 0
    served = safetensors.torch.load_file(str(out))
    assert served["video"].shape == (2, 5, 3, 16, 16)
    captured = Workflow(spec, models).run(["a red cat", "a blue dog"], [0, 1], capture=True)
    for stage in ("image", "video"):
        assert torch.equal(served[stage], captured.stages[stage].artefact), stage
    trace = captured.stages["video"].trace
    scores = FlowReplayScorer.for_trace(models["video"], trace).score_trace(trace)
    assert torch.equal(scores.logprobs, trace.behaviour_logprobs[:, trace.sde_step_indices()])


def test_stage_model_errors_name_the_stage(directories, tmp_path):
    spec, _ = load_workflow_spec(directories / "workflow.yaml")
    image = spec.stage("image").model_copy(update={"model_options": {"height": 16}})
    with pytest.raises(WorkflowError, match="stage 'image': model_options apply to diffusers"):
        load_stage_model(image)
    missing = spec.stage("video").model_copy(update={"model": str(tmp_path / "nowhere")})
    with pytest.raises(WorkflowError, match="stage 'video': "):
        load_stage_model(missing)
    odd = spec.stage("video").model_copy(update={"model_options": {"heigth": 16}})
    with pytest.raises(WorkflowError, match="stage 'video': .*heigth"):
        load_stage_model(odd)
