"""Workflows: the chain serves and rolls out through one call, hands artefacts on exactly,
and every stage's captured steps replay exactly with that stage's model."""

from __future__ import annotations

import pytest
import torch
import yaml
from flow_toy import one_thread, perturbed  # noqa: F401 (fixture: one CPU thread)

from diffusion_rl.models.dit import FlowDiT, FlowDiTConfig
from diffusion_rl.models.io import save_model
from diffusion_rl.models.video_dit import VideoDiT, VideoDiTConfig
from diffusion_rl.sampling.flow import FlowSamplerConfig
from diffusion_rl.scoring.flow import FlowReplayScorer
from diffusion_rl.workflows import (
    StageSpec,
    Workflow,
    WorkflowError,
    WorkflowSpec,
    load_workflow_spec,
    stage_seed,
)

WORDS = ("a", "red", "blue", "circle", "square", "moving", "left", "right")
SDE = FlowSamplerConfig(num_steps=4, mode="sde", guidance_scale=2.0, shift=1.0)


def _models():
    torch.manual_seed(0)
    small = {"image_size": 8, "patch_size": 4, "d_model": 32, "n_layers": 1, "n_heads": 2}
    image = FlowDiT(FlowDiTConfig(**small, vocabulary=WORDS))
    video = VideoDiT(VideoDiTConfig(**small, vocabulary=WORDS, num_frames=3))
    return perturbed(image).eval(), perturbed(video).eval()


def _spec(fanout=1, video_sampler=SDE):
    return WorkflowSpec(
        name="t2i2v",
        stages=[
            StageSpec(name="image", model="image", sampler=SDE),
            StageSpec(
                name="video", model="video", input="image", fanout=fanout, sampler=video_sampler
            ),
        ],
    )


PROMPTS = ["a red circle moving left", "a blue square moving right"]


def test_capture_changes_nothing_and_each_stage_replays_exactly():
    image, video = _models()
    workflow = Workflow(_spec(), {"image": image, "video": video})
    served = workflow.run(PROMPTS, [3, 4])
    captured = workflow.run(PROMPTS, [3, 4], capture=True, versions={"image": 2, "video": 5})
    for name in ("image", "video"):
        assert torch.equal(served.stages[name].artefact, captured.stages[name].artefact), name
        assert served.stages[name].trace is None
        trace = captured.stages[name].trace
        assert (trace.stage, trace.weights_version) == (name, {"image": 2, "video": 5}[name])
        model = {"image": image, "video": video}[name]
        replay = FlowReplayScorer.for_trace(model, trace).score_trace(trace)
        recorded = trace.behaviour_logprobs[:, trace.sde_step_indices()]
        assert torch.equal(replay.logprobs, recorded), name
    assert captured.stages["video"].artefact.shape == (2, 3, 3, 8, 8)  # [B, F, 3, H, W]
    # the image is handed on as the exact tensor (first frame latent 2x - 1, no file)
    trace = captured.stages["video"].trace
    first = captured.stages["image"].artefact * 2 - 1
    assert torch.equal(trace.cond["first_frame"], first)
    assert torch.equal(trace.uncond["first_frame"], first)
    assert not trace.uncond["prompt_mask"].any()


def test_fanout_grows_a_tree_with_distinct_seeds():
    image, video = _models()
    workflow = Workflow(_spec(fanout=3), {"image": image, "video": video})
    run = workflow.run(PROMPTS, [10, 11], capture=True)
    out = run.stages["video"]
    assert out.parents.tolist() == [0, 0, 0, 1, 1, 1] and out.roots.tolist() == out.parents.tolist()
    assert out.seeds == [stage_seed(s, 1, m) for s in (10, 11) for m in range(3)]
    assert len(set(out.seeds)) == 6
    assert run.examples_of("video") == [PROMPTS[0]] * 3 + [PROMPTS[1]] * 3
    # siblings share a first frame and differ in their own noise
    assert torch.equal(out.trace.cond["first_frame"][0], out.trace.cond["first_frame"][2])
    assert not torch.equal(out.artefact[0], out.artefact[1])
    # a member's clip does not depend on how many siblings were sampled
    single = workflow.run(PROMPTS, [10, 11], fanout={"video": 1})
    torch.testing.assert_close(
        single.stages["video"].artefact[1], out.artefact[3], atol=1e-5, rtol=0
    )


def test_shared_group_noise_starts_siblings_from_one_noise():
    """With ``share_group_noise`` the videos grown from one image start from its member 0's
    noise (then differ by their own SDE noise), the images from ``init_seeds``; without
    ``init_seeds`` the first stage refuses, naming the stage."""
    image, video = _models()
    workflow = Workflow(_spec(fanout=3), {"image": image, "video": video})
    shared = SDE.model_copy(update={"share_group_noise": True})
    samplers = {"image": shared, "video": shared}  # rollout settings: a spec refuses them
    with pytest.raises(ValueError, match="share_group_noise: a workflow file holds the serving"):
        StageSpec(name="image", model="image", sampler=shared)
    prompts = [PROMPTS[0]] * 2 + [PROMPTS[1]] * 2
    run = workflow.run(
        prompts, [10, 11, 12, 13], capture=True, samplers=samplers, init_seeds=[10, 10, 12, 12]
    )
    start = run.stages["image"].trace.latents[:, 0]
    assert torch.equal(start[0], start[1]) and torch.equal(start[2], start[3])
    assert not torch.equal(start[0], start[2])
    images = run.stages["image"].artefact
    assert not torch.equal(images[0], images[1])  # the SDE noise differs per row
    out = run.stages["video"]
    first = out.trace.latents[:, 0]
    for parent in range(4):
        rows = range(3 * parent, 3 * parent + 3)
        assert all(torch.equal(first[r], first[3 * parent]) for r in rows)
        assert not torch.equal(out.artefact[3 * parent], out.artefact[3 * parent + 1])
    assert not torch.equal(first[0], first[3])
    # the start noise is member 0's own: the same as sampling the tree without sharing
    independent = workflow.run(prompts, [10, 11, 12, 13], capture=True)
    assert torch.equal(independent.stages["image"].trace.latents[0, 0], start[0])
    assert torch.equal(independent.stages["video"].trace.latents[3, 0], first[3])
    # each stage still replays exactly
    for name, model in (("image", image), ("video", video)):
        trace = run.stages[name].trace
        replay = FlowReplayScorer.for_trace(model, trace).score_trace(trace)
        assert torch.equal(replay.logprobs, trace.behaviour_logprobs[:, trace.sde_step_indices()])
    with pytest.raises(WorkflowError, match="stage 'image': sampler.share_group_noise needs"):
        workflow.run(prompts, [10, 11, 12, 13], samplers=samplers)


def test_spec_errors_name_the_stage_and_field(tmp_path):
    with pytest.raises(ValueError, match=r"stages\[1\].name: 'image' is used twice"):
        WorkflowSpec(
            stages=[
                StageSpec(name="image", model="a"),
                StageSpec(name="image", model="b", input="image"),
            ]
        )
    with pytest.raises(ValueError, match=r"stages\[0\].input"):
        WorkflowSpec(stages=[StageSpec(name="video", model="a", input="image")])
    with pytest.raises(
        ValueError, match=r"stages\[1\].input: expected one of the earlier stages \['image'\]"
    ):
        WorkflowSpec(
            stages=[
                StageSpec(name="image", model="a"),
                StageSpec(name="video", model="b", input="audio"),
            ]
        )
    with pytest.raises(ValueError, match="lower-case identifier"):
        StageSpec(name="Video Stage", model="a")
    image, video = _models()
    with pytest.raises(
        WorkflowError, match=r"stage 'video': .*\(FlowDiT\) has no encode_conditioning"
    ):
        Workflow(_spec(), {"image": image, "video": image})
    other = FlowDiT(
        FlowDiTConfig(
            image_size=16, patch_size=4, d_model=32, n_layers=1, n_heads=2, vocabulary=WORDS
        )
    )
    with pytest.raises(
        WorkflowError, match=r"takes images of shape \(3, 8, 8\), stage 'image' makes \(3, 16, 16\)"
    ):
        Workflow(_spec(), {"image": other, "video": video})
    with pytest.raises(WorkflowError, match="models: expected one per stage"):
        Workflow(_spec(), {"image": image})
    with pytest.raises(WorkflowError, match="pass a workflow YAML file or one of"):
        load_workflow_spec(tmp_path / "nowhere.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages:\n  - name: image\n    model: m\n    sampler: {num_step: 3}\n")
    with pytest.raises(WorkflowError, match=r"bad.yaml: stages.0.sampler.num_step"):
        load_workflow_spec(bad)


def test_workflow_file_resolves_model_paths_relative_to_itself(tmp_path):
    image, video = _models()
    save_model(tmp_path / "models" / "image", image, {})
    save_model(tmp_path / "models" / "video", video, {})
    spec = _spec().model_dump(mode="json")
    spec["stages"][0]["model"] = "models/image"
    spec["stages"][1]["model"] = "models/video"
    (tmp_path / "flows").mkdir()
    path = tmp_path / "flows" / "w.yaml"
    spec["stages"][0]["model"] = "../models/image"
    spec["stages"][1]["model"] = "../models/video"
    path.write_text(yaml.safe_dump(spec))
    loaded, where = load_workflow_spec(path)
    assert where == path
    assert loaded.stage("video").model == str((tmp_path / "models" / "video").resolve())
