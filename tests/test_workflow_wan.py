"""A text → image → video workflow whose second stage is the Wan 2.1 image-to-video adapter
(``WanImageToVideoAdapter``, tiny random pipeline) behind a built-in FlowDiT image stage.

The issue's acceptance, checked on the real adapter: serving and the capture-on rollout
make bitwise-equal artefacts; each stage's captured steps replay bitwise; the video stage's
trace holds exactly the adapter's own conditioning of the image stage's tensor (no file
round trip, deterministic encode); a staged learner over both stages sees a ratio of exactly
1 before its update, moves both stages (the Wan transformer only, never its frozen parts),
advances each stage's version, and moves nothing under a constant reward.
"""

import pytest

pytest.importorskip("diffusers")
pytest.importorskip("peft")
pytest.importorskip("ftfy")

import torch  # noqa: E402
from flow_toy import one_thread, perturbed  # noqa: E402, F401 (fixture: one CPU thread)

from diffusion_rl.advantages import group_advantages  # noqa: E402
from diffusion_rl.models.diffusers_adapters import WanImageToVideoAdapter  # noqa: E402
from diffusion_rl.models.dit import FlowDiT, FlowDiTConfig  # noqa: E402
from diffusion_rl.objectives.flow_grpo import FlowGRPOConfig, FlowGRPOLoss  # noqa: E402
from diffusion_rl.rollout import Rollout, descendant_means, tree_group_sizes  # noqa: E402
from diffusion_rl.sampling.flow import FlowSamplerConfig  # noqa: E402
from diffusion_rl.scoring.flow import FlowReplayScorer  # noqa: E402
from diffusion_rl.train.learner import LearnerStage, PolicyLearner  # noqa: E402
from diffusion_rl.train.plans import FlowPolicyPlan  # noqa: E402
from diffusion_rl.train.roles import PolicyRoles  # noqa: E402
from diffusion_rl.train.trainer import OptimConfig, Trainer  # noqa: E402
from diffusion_rl.workflows import StageSpec, Workflow, WorkflowSpec  # noqa: E402

WORDS = ("a", "red", "blue", "circle", "square", "moving", "left", "right")
PROMPTS = ["a red circle moving left", "a blue square moving right"]
IMAGE_SDE = FlowSamplerConfig(num_steps=4, mode="sde", guidance_scale=2.0, shift=1.0)
VIDEO_SDE = FlowSamplerConfig(num_steps=3, mode="sde", guidance_scale=2.0)  # CFG: same frame
POLICY = FlowGRPOConfig(beta=0.01, clip_range=0.2)
OPTIMS = {"image": OptimConfig(lr=3e-3), "video": OptimConfig(lr=1e-3, grad_clip=0.5)}
GROUP, FANOUT = 2, 2  # per prompt: G images, K videos per image


def _models():
    """The tiny Wan I2V adapter and a FlowDiT making images of the adapter's first-frame
    shape, perturbed away from its zero-initialised output so its samples are not flat."""
    video = WanImageToVideoAdapter.tiny(seed=0)
    channels, height, width = video.image_shape
    assert (channels, height) == (3, width)  # FlowDiT makes square RGB images
    torch.manual_seed(0)
    image = FlowDiT(
        FlowDiTConfig(
            image_size=height, patch_size=4, d_model=32, n_layers=1, n_heads=2, vocabulary=WORDS
        )
    )
    return perturbed(image).eval(), video


def _spec():
    return WorkflowSpec(
        name="t2i2v_wan",
        stages=[
            StageSpec(name="image", model="image", sampler=IMAGE_SDE),
            StageSpec(name="video", model="video", input="image", fanout=FANOUT, sampler=VIDEO_SDE),
        ],
    )


def _quantised(images):
    """What an 8-bit file (PNG; JPEG loses more) round trip would hand on."""
    return (images * 255).round() / 255


def test_capture_changes_nothing_and_the_wan_stage_replays_exactly():
    image, video = _models()
    models = {"image": image, "video": video}
    workflow = Workflow(_spec(), models)
    served = workflow.run(PROMPTS, [3, 4])
    captured = workflow.run(PROMPTS, [3, 4], capture=True, versions={"image": 2, "video": 5})
    for name, version in (("image", 2), ("video", 5)):
        assert torch.equal(served.stages[name].artefact, captured.stages[name].artefact), name
        assert served.stages[name].trace is None
        trace = captured.stages[name].trace
        assert (trace.stage, trace.weights_version) == (name, version)
        scorer = FlowReplayScorer.for_trace(models[name], trace, stop_gradient=True)
        replay = scorer.score_trace(trace)
        recorded = trace.behaviour_logprobs[:, trace.sde_step_indices()]
        assert replay.steps == trace.sde_step_indices() and len(replay.steps) > 0, name
        assert bool(torch.isfinite(recorded).all()), name
        assert torch.equal(replay.logprobs, recorded), name  # max |Δ| = 0, fp32

    frames, clips = captured.stages["image"].artefact, captured.stages["video"].artefact
    assert frames.shape == (2, 3, 16, 16) and float(frames.std()) > 0.05
    assert clips.shape == (2 * FANOUT, video.num_frames, 3, 16, 16)  # [B, F, 3, H, W]
    out = captured.stages["video"]
    assert out.parents.tolist() == [0, 0, 1, 1]
    assert out.prompts == [PROMPTS[0]] * FANOUT + [PROMPTS[1]] * FANOUT
    # the trace holds exactly the adapter's conditioning of the image stage's tensors
    handed = frames[out.parents]
    cond = video.encode_conditioning(out.prompts, handed)
    uncond = video.empty_conditioning(handed)
    trace = out.trace
    assert set(trace.cond) == set(cond) == {"prompt_embeds", "condition", "image_embeds"}
    assert all(torch.equal(trace.cond[k], cond[k]) for k in cond)
    assert set(trace.uncond) == set(uncond)
    assert all(torch.equal(trace.uncond[k], uncond[k]) for k in uncond)
    assert torch.equal(trace.uncond["condition"], trace.cond["condition"])  # CFG: same frame
    # an 8-bit file round trip of the frame would have conditioned the video differently
    assert not torch.equal(frames, _quantised(frames))
    lossy = video.encode_conditioning(out.prompts, _quantised(handed))
    assert float((lossy["condition"] - cond["condition"]).abs().max()) > 0
    assert float((lossy["image_embeds"] - cond["image_embeds"]).abs().max()) > 0


def _learner(image, video):
    stages = {
        name: LearnerStage(
            PolicyRoles(model, reference=True), FlowPolicyPlan(FlowGRPOLoss(POLICY), seed=0)
        )
        for name, model in (("image", image), ("video", video))
    }
    return PolicyLearner.staged(
        stages, lambda actors: Trainer(actors, None, OptimConfig(), parts=OPTIMS)
    )


def _rollouts(learner, *, constant=False):
    """A captured tree rollout of the stages' rollout weights: the final reward is each clip's
    mean brightness (or 1), the image stage's the mean over its videos, advantages within
    the tree's groups (G images of a prompt, K videos of an image)."""
    workflow = Workflow(_spec(), {name: s.roles.rollout for name, s in learner.stages.items()})
    prompts = [p for p in PROMPTS for _ in range(GROUP)]
    versions = {name: s.roles.version for name, s in learner.stages.items()}
    run = workflow.run(prompts, list(range(len(prompts))), capture=True, versions=versions)
    final = run.final.artefact.mean(dim=(1, 2, 3, 4))
    if constant:
        final = torch.ones_like(final)
    fanouts = [1, FANOUT]
    rollouts = {}
    for stage, size, rewards in zip(
        workflow.spec.stages, tree_group_sizes(GROUP, fanouts), descendant_means(final, fanouts)
    ):
        out = run.stages[stage.name]
        advantages = group_advantages(rewards, size, POLICY.advantage_spec)
        rollouts[stage.name] = Rollout(
            out.trace, out.artefact, out.prompts, rewards, advantages, size
        )
    return rollouts


def _trainable(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _frozen(adapter):
    return {
        f"{index}.{name}": value.detach().clone()
        for index, module in enumerate(adapter.frozen_modules())
        for name, value in module.state_dict().items()
    }


def _max_change(before, model):
    after = dict(model.named_parameters())
    return max(float((after[n].detach() - value).abs().max()) for n, value in before.items())


def test_staged_learner_ratio_is_one_before_the_update_on_both_stages():
    image, video = _models()
    learner = _learner(image, video)
    rollouts = _rollouts(learner)
    for name, rollout in rollouts.items():  # rewards vary within every group
        assert rollout.trace.stage == name
        assert bool((rollout.advantages.view(-1, rollout.group_size).abs().amax(1) > 0).all())
    image_before, video_before = _trainable(image), _trainable(video)
    assert video_before and all(n.startswith("transformer.") for n in video_before)
    frozen_before = _frozen(video)
    assert {"vae", "text_encoder", "image_encoder"} <= {
        name for name, m in video.named_children() if m in video.frozen_modules()
    }

    metrics = learner.step_stages(rollouts)
    for name in ("image", "video"):
        assert metrics[f"{name}/flow_grpo/ratio_mean"] == 1.0, name
        assert metrics[f"{name}/flow_grpo/ratio_min"] == 1.0, name
        assert metrics[f"{name}/flow_grpo/ratio_max"] == 1.0, name
        assert metrics[f"{name}/flow_grpo/parity_max_abs"] == 0.0, name
        assert metrics[f"{name}/weights_version"] == 1.0, name
        assert learner.stages[name].roles.version == 1
        assert metrics[f"grad_norm/{name}"] > 0, name
    assert _max_change(image_before, image) > 1e-5
    assert _max_change(video_before, video) > 1e-5  # the Wan transformer moved
    frozen_after = _frozen(video)
    assert set(frozen_after) == set(frozen_before)
    assert all(torch.equal(frozen_after[k], v) for k, v in frozen_before.items())
    # each stage's rollout weights are synced to its trained actor, in memory
    for stage in learner.stages.values():
        rollout_weights = stage.roles.rollout.state_dict()
        assert all(
            torch.equal(rollout_weights[k], v) for k, v in stage.roles.actor.state_dict().items()
        )


def test_constant_reward_moves_neither_stage():
    image, video = _models()
    learner = _learner(image, video)
    rollouts = _rollouts(learner, constant=True)
    assert all(bool((r.advantages == 0).all()) for r in rollouts.values())
    before = {"image": _trainable(image), "video": _trainable(video)}
    metrics = learner.step_stages(rollouts)
    assert learner.trainer.global_step == 1
    for name, model in (("image", image), ("video", video)):
        assert metrics[f"{name}/flow_grpo/ratio_mean"] == 1.0, name
        assert metrics[f"{name}/weights_version"] == 1.0, name
        after = dict(model.named_parameters())
        assert all(torch.equal(after[k], v) for k, v in before[name].items()), name
