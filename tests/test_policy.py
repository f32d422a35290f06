"""The GRPO-family learner: exact ratios, fixed old policy, roles and versions, rollouts."""

import itertools

import pytest
import torch
from conftest import tiny_model

from diffusion_rl.config import ConfigError, GRPORecipeConfig, build_config
from diffusion_rl.objectives.grpo import PolicyLoss, PolicyLossConfig
from diffusion_rl.rewards import CombinedReward, TaskVerifierReward
from diffusion_rl.rollout import collect_rollouts, merge_rollouts, sample_groups
from diffusion_rl.sampling import TokenSamplerConfig
from diffusion_rl.tasks import ArithmeticConfig, ArithmeticTask
from diffusion_rl.train import OptimConfig, Trainer
from diffusion_rl.train.policy import PolicyLearner
from diffusion_rl.train.roles import PolicyRoles, StaleTraceError

TASK = ArithmeticTask(ArithmeticConfig(num_digits=1))
SAMPLER = TokenSamplerConfig(
    generation_length=TASK.completion_length, block_size=4, steps_per_block=2, temperature=1.0
)


def learner_for(policy: PolicyLossConfig, *, lr=1e-2, scorer="exact", **options):
    model = tiny_model("block_causal", vocab=TASK.tokenizer.vocab_size)
    roles = PolicyRoles(model, reference=policy.uses_reference)

    def make_trainer(actor, loss_fn):
        return Trainer(actor, loss_fn, OptimConfig(lr=lr, grad_clip=None))

    return PolicyLearner(roles, PolicyLoss(policy), make_trainer, scorer=scorer, **options)


def rollout_for(learner, policy, start=0, prompts=4, group=4, reward_fn=None):
    reward_fn = reward_fn or CombinedReward([(TaskVerifierReward(TASK), 1.0)])
    rollout, _ = collect_rollouts(
        learner.roles.rollout,
        TASK,
        reward_fn,
        start_prompt=start,
        num_prompts=prompts,
        group_size=group,
        sampler=SAMPLER,
        policy=policy,
        weights_version=learner.roles.version,
        seed=0,
    )
    return rollout


class RandomReward:
    """A deterministic pseudo-reward with spread inside every group (the tiny model is untrained)."""

    name = "random"

    def __call__(self, completions, examples):
        return torch.tensor([float(hash(c) % 3) for c in completions], dtype=torch.float32)


def spread_rewards():
    return CombinedReward([(RandomReward(), 1.0)])


@pytest.mark.parametrize("iterations", [1, 3])
def test_ratio_is_exactly_one_before_any_update_and_kl_grows(iterations):
    policy = PolicyLossConfig(algorithm="grpo", num_iterations=iterations, beta=0.04)
    learner = learner_for(policy)
    metrics = learner.step(rollout_for(learner, policy, reward_fn=spread_rewards()))
    assert metrics["policy/ratio_mean@iter0"] == 1.0
    assert metrics["policy/ratio_max@iter0"] == 1.0 and metrics["policy/ratio_min@iter0"] == 1.0
    assert metrics["policy/kl@iter0"] == 0.0  # actor == reference before the first update
    assert metrics["grad_norm@iter0"] > 0
    assert metrics["policy/parity_max_abs@iter0"] <= 1e-6  # snapshot reproduces the sampler
    if iterations > 1:
        assert metrics[f"policy/ratio_mean@iter{iterations - 1}"] != 1.0
    second = learner.step(rollout_for(learner, policy, start=4, reward_fn=spread_rewards()))
    assert second["policy/ratio_mean@iter0"] == 1.0
    assert second["policy/kl@iter0"] > 0  # the actor has moved away from the reference


def test_old_policy_is_fixed_across_inner_iterations_while_live_changes():
    policy = PolicyLossConfig(algorithm="grpo", num_iterations=3, beta="none")
    learner = learner_for(policy)
    seen = []
    real = learner.loss.__call__

    def spy(logprobs, batch, entropy=None):
        seen.append((logprobs.detach().clone(), batch.model_inputs["old_logprobs"].clone()))
        return real(logprobs, batch, entropy)

    learner.loss = type("Spy", (), {"__call__": staticmethod(spy), "config": policy})()
    learner.step(rollout_for(learner, policy, reward_fn=spread_rewards()))
    assert len(seen) == 3
    olds = [old for _, old in seen]
    assert all(torch.equal(olds[0], other) for other in olds[1:])
    assert torch.equal(seen[0][0], olds[0])  # iteration 0: live == snapshot, bitwise
    assert not torch.equal(seen[2][0], olds[0])  # the live policy moved


@pytest.mark.parametrize(
    ("algorithm", "iterations", "beta"),
    list(itertools.product(["grpo", "dapo", "drgrpo"], [1, 2], [0.0, 0.04, "none"])),
)
def test_every_algorithm_iteration_beta_combination_runs_a_step(algorithm, iterations, beta):
    policy = PolicyLossConfig(algorithm=algorithm, num_iterations=iterations, beta=beta)
    learner = learner_for(policy)
    before = [p.detach().clone() for p in learner.roles.actor.parameters()]
    metrics = learner.step(rollout_for(learner, policy, reward_fn=spread_rewards()))
    assert torch.isfinite(torch.tensor(metrics["loss"]))
    assert metrics["weights_version"] == 1.0
    assert any(not torch.equal(a, p) for a, p in zip(before, learner.roles.actor.parameters()))
    assert ("policy/kl" in metrics) == (beta != "none")
    # rollout weights were synced in memory
    for a, r in zip(learner.roles.actor.parameters(), learner.roles.rollout.parameters()):
        assert torch.equal(a, r)


def test_stale_traces_are_refused_unless_off_policy_is_allowed():
    policy = PolicyLossConfig(beta="none")
    learner = learner_for(policy)
    stale = rollout_for(learner, policy, reward_fn=spread_rewards())
    learner.step(rollout_for(learner, policy, reward_fn=spread_rewards()))
    with pytest.raises(
        StaleTraceError, match="sampled with rollout weights v0, the learner is at v1"
    ):
        learner.step(stale)
    learner.allow_off_policy = True
    assert learner.step(stale)["weights_version"] == 2.0


def test_fail_closed_configuration():
    with pytest.raises(ConfigError, match="sequence_packing: not supported"):
        build_config(GRPORecipeConfig, {"sequence_packing": True})
    with pytest.raises(ConfigError, match="beta"):
        build_config(GRPORecipeConfig, {"policy": {"beta": -1}})
    model = tiny_model("block_causal", vocab=16)
    model.alignment = "shifted"
    with pytest.raises(ValueError, match="not target-aligned"):
        PolicyLearner(
            PolicyRoles(model),
            PolicyLoss(PolicyLossConfig()),
            lambda m, f: Trainer(m, f, OptimConfig()),
        )
    with pytest.raises(ValueError, match="reference pass needs"):
        PolicyLearner(
            PolicyRoles(tiny_model("block_causal", vocab=16), reference=False),
            PolicyLoss(PolicyLossConfig(beta=0.04)),
            lambda m, f: Trainer(m, f, OptimConfig()),
        )


def test_rollout_batch_layout_and_merge_checks():
    policy = PolicyLossConfig(beta="none")
    learner = learner_for(policy)
    reward_fn = CombinedReward([(TaskVerifierReward(TASK), 1.0)])
    kwargs = dict(
        group_size=4,
        sampler=SAMPLER,
        policy=policy,
        post_stop_weight=0.5,
        weights_version=0,
        seed=0,
    )
    a = sample_groups(learner.roles.rollout, TASK, reward_fn, [0, 1], **kwargs)
    b = sample_groups(learner.roles.rollout, TASK, reward_fn, [2], **kwargs)
    merged = merge_rollouts([a, b])
    assert merged.batch.batch_size == 12 and len(merged.trace) == 12
    assert merged.examples[0].prompt == merged.examples[3].prompt != merged.examples[4].prompt
    advantages = merged.batch.model_inputs["advantages"].view(3, 4)
    assert torch.allclose(advantages.sum(1), torch.zeros(3), atol=1e-5)  # centred per group
    assert torch.equal(
        merged.batch.model_inputs["behaviour_logprobs"], merged.trace.behaviour_logprobs
    )
    post = merged.trace.post_stop()
    assert bool((merged.batch.loss_weights[post] == 0.5).all())
    other = sample_groups(
        learner.roles.rollout, TASK, reward_fn, [3], **{**kwargs, "weights_version": 7}
    )
    with pytest.raises(ValueError, match="weights_version"):
        merge_rollouts([a, other])
    no_trace = type(a)(**{**a.__dict__, "trace": None})
    with pytest.raises(ValueError, match="carry no trace"):
        merge_rollouts([a, no_trace])
    with pytest.raises(ValueError, match="expected at least one"):
        merge_rollouts([])


def test_dynamic_sampling_drops_equal_reward_groups_and_refills():
    class PromptParity:
        name = "parity"

        def __call__(self, completions, examples):  # groups of even prompts: all equal rewards
            return torch.tensor(
                [float(hash(c) % 2) if e.a % 2 else 1.0 for c, e in zip(completions, examples)],
                dtype=torch.float32,
            )

    policy = PolicyLossConfig(algorithm="dapo")
    learner = learner_for(policy)
    rollout = rollout_for(
        learner, policy, prompts=4, reward_fn=CombinedReward([(PromptParity(), 1.0)])
    )
    groups = rollout.rewards.view(-1, 4)
    assert bool(
        ((groups.max(1).values - groups.min(1).values) > 0).all()
    )  # only informative groups kept
    assert rollout.stats["rollout/groups_sampled"] >= rollout.stats["rollout/groups_kept"]
    assert rollout.stats["rollout/groups_kept"] + rollout.stats["rollout/groups_short"] == 4


def test_overlong_shaping_is_counted_in_tokens():
    policy = PolicyLossConfig(
        algorithm="dapo", overlong_buffer_tokens=2, overlong_max_tokens=4, overlong_penalty=1.0
    )
    learner = learner_for(policy)
    rollout = rollout_for(learner, policy, reward_fn=spread_rewards())
    lengths = rollout.trace.lengths().float()
    expected = torch.clamp(-(lengths - 2) / 2, max=0.0)
    assert torch.equal(rollout.reward_parts["overlong"], expected)


def test_roles_snapshot_reference_and_offload():
    model = tiny_model("block_causal", vocab=16)
    roles = PolicyRoles(model, reference=True, offload_device="cpu")
    assert roles.version == 0 and not any(p.requires_grad for p in roles.reference.parameters())
    with pytest.raises(RuntimeError, match="take_snapshot"):
        roles.snapshot  # noqa: B018
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    snapshot = roles.take_snapshot()
    assert roles.snapshot_version == 0
    assert torch.equal(next(snapshot.parameters()), next(model.parameters()))
    assert not torch.equal(next(roles.reference.parameters()), next(model.parameters()))
    assert not torch.equal(next(roles.rollout.parameters()), next(model.parameters()))
    assert roles.sync_rollout() == 1
    assert torch.equal(next(roles.rollout.parameters()), next(model.parameters()))
    with torch.no_grad():  # as after loading a checkpoint into the actor
        next(model.parameters()).mul_(0.5)
    roles.restore(7)
    assert roles.version == 7
    assert torch.equal(next(roles.rollout.parameters()), next(model.parameters()))
    assert roles.sync_rollout() == 8
    with roles.on_compute(roles.reference) as ref:
        assert next(ref.parameters()).device == next(model.parameters()).device
    policy = PolicyLossConfig(num_iterations=2, beta=0.04)
    learner = PolicyLearner(
        PolicyRoles(tiny_model("block_causal", vocab=16), offload_device="cpu"),
        PolicyLoss(policy),
        lambda m, f: Trainer(m, f, OptimConfig(lr=1e-2)),
    )
    metrics = learner.step(rollout_for(learner, policy, reward_fn=spread_rewards()))
    assert metrics["policy/ratio_mean@iter0"] == 1.0 and metrics["weights_version"] == 1.0


@pytest.mark.parametrize("scorer", ["exact", "packed", "mean_field", "coupled", "elbo"])
def test_every_scorer_drives_a_full_step(scorer):
    policy = PolicyLossConfig(algorithm="grpo", num_iterations=2, beta=0.04)
    learner = learner_for(policy, scorer=scorer)
    metrics = learner.step(rollout_for(learner, policy, reward_fn=spread_rewards()))
    assert torch.isfinite(torch.tensor(metrics["loss"])) and metrics["weights_version"] == 1.0
    if scorer in ("exact", "packed"):
        assert metrics["policy/ratio_mean@iter0"] == pytest.approx(1.0, abs=1e-6)
        assert metrics["policy/parity_max_abs@iter0"] <= 1e-5


def test_grpo_learns_a_simple_preference():
    """End to end: rollouts → rewards → exact replay → updates raise the reward."""

    class FourthIsNotPlus:  # the untrained tiny model writes "+" there ~90% of the time
        name = "not_plus"

        def __call__(self, completions, examples):
            return torch.tensor([float(c[3:4] != "+") for c in completions])

    policy = PolicyLossConfig(algorithm="grpo", beta="none")
    learner = learner_for(policy, lr=3e-3)
    reward_fn = CombinedReward([(FourthIsNotPlus(), 1.0)])
    rewards = []
    for step in range(12):
        rollout = rollout_for(
            learner, policy, start=4 * step, prompts=4, group=8, reward_fn=reward_fn
        )
        rewards.append(float(rollout.rewards.mean()))
        learner.step(rollout)
    assert rewards[0] < 0.3
    assert sum(rewards[-3:]) / 3 > rewards[0] + 0.4
