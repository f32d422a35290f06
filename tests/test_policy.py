"""The GRPO-family learner: exact ratios, fixed old policy, roles and versions, rollouts."""

import itertools
from dataclasses import replace

import pytest
import torch
from conftest import tiny_model

from diffusion_rl.advantages import OverlongShaping, group_advantages
from diffusion_rl.config import ConfigError, GRPORecipeConfig, build_config
from diffusion_rl.objectives.grpo import PolicyLoss, PolicyLossConfig
from diffusion_rl.rewards import CombinedReward, TaskVerifierReward
from diffusion_rl.rollout import Rollout, TokenSource, collect_rollout
from diffusion_rl.sampling import TokenSamplerConfig
from diffusion_rl.tasks import ArithmeticConfig, ArithmeticTask
from diffusion_rl.train import OptimConfig, Trainer
from diffusion_rl.train.learner import PolicyLearner
from diffusion_rl.train.plans import TokenPolicyPlan
from diffusion_rl.train.roles import PolicyRoles, StaleTraceError

TASK = ArithmeticTask(ArithmeticConfig(num_digits=1))
SAMPLER = TokenSamplerConfig(
    generation_length=TASK.completion_length, block_size=4, steps_per_block=2, temperature=1.0
)


def learner_for(policy: PolicyLossConfig, *, lr=1e-2, eps=1e-8, scorer="exact", **options):
    model = tiny_model("block_causal", vocab=TASK.tokenizer.vocab_size)
    roles = PolicyRoles(model, reference=policy.uses_reference)

    def make_trainer(actor, loss_fn):
        return Trainer(actor, loss_fn, OptimConfig(lr=lr, eps=eps, grad_clip=None))

    return PolicyLearner(
        roles, TokenPolicyPlan(PolicyLoss(policy), scorer=scorer), make_trainer, **options
    )


def shaping_for(policy: PolicyLossConfig):
    """DAPO's overlong shaping as the GRPO recipe builds it (None when the buffer is 0)."""
    if not policy.overlong_buffer_tokens:
        return None
    return OverlongShaping(
        policy.overlong_max_tokens or SAMPLER.generation_length,
        policy.overlong_buffer_tokens,
        policy.overlong_penalty,
    )


def collect(model, policy, *, start=0, prompts=4, group=4, reward_fn=None, weights_version=0):
    reward_fn = reward_fn or CombinedReward([(TaskVerifierReward(TASK), 1.0)])
    rollout, _ = collect_rollout(
        model,
        TokenSource(TASK, SAMPLER),
        reward_fn,
        start_prompt=start,
        num_prompts=prompts,
        group_size=group,
        weights_version=weights_version,
        seed=0,
        advantage=policy.advantage_spec,
        shaping=shaping_for(policy),
        dynamic_sampling=policy.dynamic_sampling,
        max_sampling_rounds=4,
    )
    return rollout


def rollout_for(learner, policy, start=0, prompts=4, group=4, reward_fn=None):
    return collect(
        learner.roles.rollout,
        policy,
        start=start,
        prompts=prompts,
        group=group,
        reward_fn=reward_fn,
        weights_version=learner.roles.version,
    )


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
    real = learner.plan.loss

    def spy(scores, batch):
        seen.append((scores.logprobs.detach().clone(), batch.model_inputs["old_logprobs"].clone()))
        return real(scores, batch)

    learner.plan.loss = spy
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
            TokenPolicyPlan(PolicyLoss(PolicyLossConfig())),
            lambda m, f: Trainer(m, f, OptimConfig()),
        )
    with pytest.raises(ValueError, match=r"scores a reference model.*reference=True"):
        PolicyLearner(
            PolicyRoles(tiny_model("block_causal", vocab=16), reference=False),
            TokenPolicyPlan(PolicyLoss(PolicyLossConfig(beta=0.04))),
            lambda m, f: Trainer(m, f, OptimConfig()),
        )


def test_rollout_layout_and_concat_checks():
    policy = PolicyLossConfig(beta="none")
    learner = learner_for(policy)
    model = learner.roles.rollout
    a = collect(model, policy, start=0, prompts=2)
    b = collect(model, policy, start=2, prompts=1)
    merged = Rollout.concat([a, b])
    assert len(merged) == 12 and len(merged.trace) == 12 and merged.group_size == 4
    assert len(merged.outputs) == 12 and merged.rewards.shape == (12,)
    assert merged.examples[0].prompt == merged.examples[3].prompt != merged.examples[4].prompt
    advantages = merged.advantages.view(3, 4)
    assert torch.allclose(advantages.sum(1), torch.zeros(3), atol=1e-5)  # centred per group
    # advantages are per group, so the parts' advantages are those of the whole
    assert torch.equal(
        merged.advantages, group_advantages(merged.rewards, 4, policy.advantage_spec)
    )
    # rows() slices every field alike: the last group is rollout b
    tail = merged.rows(torch.arange(8, 12))
    assert torch.equal(tail.trace.tokens, b.trace.tokens) and tail.outputs == b.outputs
    assert torch.equal(tail.rewards, b.rewards) and torch.equal(tail.advantages, b.advantages)

    # what the learner trains on: the plan's prepared batch, row-aligned with the rollout
    plan = TokenPolicyPlan(PolicyLoss(policy), post_stop_weight=0.5)
    settings = plan.pin(merged.trace)
    (batch,) = plan.batches(merged, settings, rollout_step=0, micro_batch_size=None)
    assert batch.batch_size == 12
    assert torch.equal(batch.model_inputs["advantages"], merged.advantages)
    assert torch.equal(batch.model_inputs["behaviour_logprobs"], merged.trace.behaviour_logprobs)
    post = merged.trace.post_stop()
    assert bool((batch.loss_weights[post] == 0.5).all())
    micro = plan.batches(merged, settings, rollout_step=0, micro_batch_size=5)
    assert [m.batch_size for m in micro] == [5, 5, 2]

    # Rollout.concat's checks
    other = collect(model, policy, start=3, prompts=1, weights_version=7)
    with pytest.raises(ValueError, match="weights_version"):
        Rollout.concat([a, other])
    with pytest.raises(ValueError, match="rollout 1 has group_size 2, rollout 0 4"):
        Rollout.concat([a, replace(b, group_size=2)])
    extra = {**b.reward_parts, "extra": torch.zeros(4)}
    with pytest.raises(ValueError, match="rollout 1 has rewards"):
        Rollout.concat([a, replace(b, reward_parts=extra)])
    with pytest.raises(ValueError, match="rollout 1 disagrees on having advantages"):
        Rollout.concat([a, replace(b, advantages=None)])
    with pytest.raises(ValueError, match="expected at least one"):
        Rollout.concat([])
    # Rollout's row-count validation: every field has the trace's rows, in whole groups
    with pytest.raises(ValueError, match=r"Rollout.rewards: expected 8 rows \(the trace\), got 7"):
        replace(a, rewards=a.rewards[:-1])
    with pytest.raises(ValueError, match=r"Rollout.outputs: expected 8 rows"):
        replace(a, outputs=a.outputs[:-1])
    with pytest.raises(ValueError, match=r"Rollout.advantages: expected 8 rows"):
        replace(a, advantages=a.advantages[:4])
    with pytest.raises(ValueError, match="8 rows is not a multiple of group_size=3"):
        replace(a, group_size=3)


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
        TokenPolicyPlan(PolicyLoss(policy)),
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


@pytest.mark.parametrize("iterations", [1, 2])
def test_micro_batch_size_does_not_change_the_step(iterations):
    """The learner interface: one rollout of 16 rows trained with micro-batches of 1, 2, 3
    (uneven: 5 × 3 + 1) or all rows gives the same step. The loss is normalised once over
    the whole batch, so the parameters agree to float32 rounding; the ratio and parity
    extremes are true extremes over micro-batches: the ratio exactly 1 before the update, the
    parity exactly 0 for one batch and within float32 rounding for micro-batches.

    The optimiser is Adam in its SGD limit (eps ≫ |g|: update ≈ lr · g / eps = 1e-4 g): plain
    Adam normalises each element, so in directions whose gradient is mathematically zero
    (the attention key biases: softmax is shift-invariant) it would turn float32 rounding
    noise into ±lr steps and compare noise, not the step. ``atol`` is the float32 rounding
    of weights near zero (ulp(0.1) ≈ 7e-9), far below the step (> 1e-4)."""
    policy = PolicyLossConfig(algorithm="grpo", num_iterations=iterations, beta=0.04)
    rollout = initial = None
    results, weighted = {}, {}
    for size in (None, 1, 2, 3):
        learner = learner_for(policy, lr=1e-2, eps=100.0, micro_batch_size=size)
        if rollout is None:  # every learner starts from the same weights at version 0
            initial = [p.detach().clone() for p in learner.roles.actor.parameters()]
            rollout = rollout_for(learner, policy, reward_fn=spread_rewards())
        assert len(rollout) == 16
        metrics = learner.step(rollout)
        assert metrics["learner/micro_batches"] == (1 if size is None else -(-16 // size))
        assert metrics["policy/ratio_max@iter0"] == 1.0
        assert metrics["policy/ratio_min@iter0"] == 1.0
        # one replay batch = the sampler's: parity exactly 0; smaller micro-batches run other
        # GEMM shapes, whose float32 sums some CPUs (AVX-512 oneDNN) order differently
        parity = metrics["policy/parity_max_abs@iter0"]
        assert parity == 0.0 if size is None else parity <= 1e-5
        assert metrics["weights_version"] == 1.0
        # before the update ρ = 1 and KL = 0, so the loss is -mean(A) over rows: 0 (centred)
        assert metrics["loss@iter0"] == pytest.approx(0.0, abs=1e-6)
        weighted[size] = [
            metrics[f"policy/{key}@iter0"] for key in ("logprob_pos_adv", "logprob_neg_adv")
        ]
        results[size] = [p.detach().clone() for p in learner.roles.actor.parameters()]
    for size in (1, 2, 3):  # weighted metrics reduce globally: the same value for any split
        assert weighted[size] == pytest.approx(weighted[None], rel=1e-6)
    whole = results[None]
    moved = max(float((p - q).abs().max()) for p, q in zip(whole, initial))
    assert moved > 1e-4  # a real step, far above the tolerance below
    for size in (1, 2, 3):
        for p, q in zip(results[size], whole):
            torch.testing.assert_close(p, q, rtol=2e-6, atol=1e-8)


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
