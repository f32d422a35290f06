"""One learner, several stages: each stage's replay is exact, its version its own, and its
traces its own; one stage through the staged learner trains exactly like the plain learner."""

from __future__ import annotations

import copy

import pytest
import torch
from flow_toy import TinyVelocity, one_thread  # noqa: F401 - the fixture applies by import

from diffusion_rl.advantages import group_advantages
from diffusion_rl.objectives.flow_grpo import FlowGRPOConfig, FlowGRPOLoss
from diffusion_rl.rollout import Rollout, descendant_means, tree_group_sizes
from diffusion_rl.sampling.flow import FlowSamplerConfig, sample_flow
from diffusion_rl.train.learner import LearnerStage, PolicyLearner, StageMismatchError
from diffusion_rl.train.plans import FlowPolicyPlan
from diffusion_rl.train.roles import PolicyRoles, StaleTraceError
from diffusion_rl.train.trainer import OptimConfig, Trainer

SAMPLER = FlowSamplerConfig(num_steps=4, mode="sde", guidance_scale=2.0, shift=1.0)
POLICY = FlowGRPOConfig(beta=0.01, clip_range=0.2)
OPTIMS = {"image": OptimConfig(lr=3e-3), "video": OptimConfig(lr=1e-3, grad_clip=0.5)}
GROUP = 4


def _rollout(model, stage, version, *, rewards=None, seed=0):
    prompts = [str(d) for d in (1, 2) for _ in range(GROUP)]
    sample = sample_flow(
        model,
        prompts,
        SAMPLER,
        seeds=[seed * 100 + i for i in range(len(prompts))],
        capture=True,
        weights_version=version,
        stage=stage,
    )
    if rewards is None:
        rewards = sample.images.mean(dim=(1, 2, 3))  # brightness: varies within a group
    advantages = group_advantages(rewards, GROUP, POLICY.advantage_spec)
    return Rollout(sample.trace, sample.images, prompts, rewards, advantages, GROUP)


def _learner(names=("image", "video"), iterations=1):
    policy = POLICY.model_copy(update={"num_iterations": iterations})
    stages = {
        name: LearnerStage(
            PolicyRoles(TinyVelocity(seed=k), reference=True),
            FlowPolicyPlan(FlowGRPOLoss(policy), seed=0),
        )
        for k, name in enumerate(names)
    }

    def make_trainer(actors):
        return Trainer(actors, None, OptimConfig(), parts={n: OPTIMS[n] for n in names})

    return PolicyLearner.staged(stages, make_trainer)


def _step(learner, seed=0, rewards=None):
    rollouts = {
        name: _rollout(stage.roles.rollout, name, stage.roles.version, seed=seed, rewards=rewards)
        for name, stage in learner.stages.items()
    }
    return learner.step_stages(rollouts)


@pytest.mark.parametrize("iterations", [1, 2])
def test_every_stage_replays_exactly_before_the_update(iterations):
    learner = _learner(iterations=iterations)
    metrics = _step(learner)
    for name in ("image", "video"):
        first = "" if iterations == 1 else "@iter0"
        assert metrics[f"{name}/flow_grpo/ratio_mean{first}"] == 1.0
        assert metrics[f"{name}/flow_grpo/ratio_min{first}"] == 1.0
        assert metrics[f"{name}/flow_grpo/ratio_max{first}"] == 1.0
        assert metrics[f"{name}/flow_grpo/parity_max_abs{first}"] == 0.0
        assert metrics[f"{name}/weights_version"] == 1.0
        assert metrics[f"grad_norm/{name}"] > 0
        assert f"{name}/flow_grpo/kl" in metrics
    # the second step: each stage's new rollout weights replay exactly again
    metrics = _step(learner, seed=1)
    assert metrics["image/weights_version"] == metrics["video/weights_version"] == 2.0
    assert metrics["video/flow_grpo/parity_max_abs" + ("" if iterations == 1 else "@iter0")] == 0


def test_one_stage_through_the_staged_learner_trains_like_the_plain_learner():
    staged = _learner(names=("image",))
    actor = copy.deepcopy(staged.stages["image"].roles.actor)
    plain = PolicyLearner(
        PolicyRoles(actor, reference=True),
        FlowPolicyPlan(FlowGRPOLoss(POLICY), seed=0),
        lambda model, loss: Trainer(model, loss, OPTIMS["image"]),
    )
    for seed in range(3):
        a = _step(staged, seed=seed)
        b = plain.step(_rollout(plain.roles.rollout, "", plain.roles.version, seed=seed))
        assert a["loss"] == b["loss"] and a["grad_norm/image"] == b["grad_norm"]
    for key, value in plain.roles.actor.state_dict().items():
        assert torch.equal(value, staged.stages["image"].roles.actor.state_dict()[key]), key


def test_constant_reward_moves_no_stage():
    learner = _learner()
    before = {n: copy.deepcopy(s.roles.actor.state_dict()) for n, s in learner.stages.items()}
    for seed in range(2):
        metrics = _step(learner, seed=seed, rewards=torch.ones(2 * GROUP))
        assert metrics["image/flow_grpo/advantage_abs"] == 0.0
    for name, stage in learner.stages.items():
        after = stage.roles.actor.state_dict()
        assert all(torch.equal(before[name][k], after[k]) for k in after), name
        assert stage.roles.version == 2


def test_traces_of_another_stage_or_version_are_refused_by_name():
    learner = _learner()
    video = learner.stages["video"].roles
    swapped = {
        "image": _rollout(video.rollout, "video", 0),
        "video": _rollout(video.rollout, "video", 0),
    }
    with pytest.raises(
        StageMismatchError, match="stage 'image': the trace was sampled by stage 'video'"
    ):
        learner.step_stages(swapped)
    _step(learner)  # both stages at v1 now
    stale = {
        "image": _rollout(learner.stages["image"].roles.rollout, "image", 1),
        "video": _rollout(video.rollout, "video", 0),
    }
    with pytest.raises(
        StaleTraceError, match=r"stage 'video': weights_version: .* v0, the learner is at v1"
    ):
        learner.step_stages(stale)
    with pytest.raises(ValueError, match="rollouts: expected one per stage"):
        learner.step_stages({"image": stale["image"]})
    # nothing was trained by the refused steps
    assert learner.trainer.global_step == 1


def test_a_frozen_stage_keeps_its_version_while_the_other_advances():
    learner = _learner(names=("video",))  # the image stage is frozen: not a learner stage
    frozen = TinyVelocity(seed=5)
    for seed in range(3):
        image = _rollout(frozen, "image", 0, seed=seed)
        assert image.trace.weights_version == 0
        _step(learner, seed=seed)
    assert learner.stages["video"].roles.version == 3


def test_tree_groups_and_descendant_means():
    # 2 prompts x G=2 images x K=3 videos: rewards 0..11
    rewards = torch.arange(12, dtype=torch.float32)
    image, video = descendant_means(rewards, [1, 3])
    assert image.tolist() == [1.0, 4.0, 7.0, 10.0] and torch.equal(video, rewards)
    assert tree_group_sizes(2, [1, 3]) == [2, 3]
    assert tree_group_sizes(4, [1, 1]) == [4, 4]  # K = 1: one shared advantage
    spec = POLICY.advantage_spec
    k1 = torch.tensor([0.0, 1.0, 3.0, 2.0])
    image_adv = group_advantages(descendant_means(k1, [1, 1])[0], 4, spec)
    video_adv = group_advantages(descendant_means(k1, [1, 1])[1], 4, spec)
    assert torch.equal(image_adv, video_adv)
