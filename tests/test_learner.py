"""The learner interface, in both worlds: what PolicyLearner asks of a plan, in what order.

A recording wrapper around each world's real plan logs every call. For μ inner iterations,
with or without a reference, the learner must: pin once; cut the batches once; score every
micro-batch frozen once per frozen role (reference, then snapshot) and live once per inner
iteration, each micro-batch with the same random stream in every pass; attach once per
micro-batch; and sync the rollout weights once.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from flow_toy import TinyVelocity, one_thread  # noqa: F401 (fixture)
from test_flow_grpo import as_rollout
from test_flow_grpo import rollout as flow_trace
from test_policy import SAMPLER, TASK, spread_rewards

from diffusion_rl.objectives.flow_grpo import FlowGRPOConfig, FlowGRPOLoss
from diffusion_rl.objectives.grpo import PolicyLoss, PolicyLossConfig
from diffusion_rl.rollout import TokenSource, collect_rollout
from diffusion_rl.train import OptimConfig, Trainer
from diffusion_rl.train.learner import PolicyLearner
from diffusion_rl.train.plans import FlowPolicyPlan, TokenPolicyPlan
from diffusion_rl.train.roles import PolicyRoles


class Recording:
    """Delegates to ``plan``; logs (method, details) for every call."""

    def __init__(self, plan) -> None:
        self.plan = plan
        self.calls: list[tuple] = []
        self.num_iterations = plan.num_iterations
        self.uses_reference = plan.uses_reference
        self.metric_prefix = plan.metric_prefix
        self.uses_rollout_weights = plan.uses_rollout_weights

    def check(self, roles):
        self.calls.append(("check",))
        return self.plan.check(roles)

    def pin(self, trace):
        self.calls.append(("pin",))
        return self.plan.pin(trace)

    def batches(self, rollout, settings, **options):
        out = self.plan.batches(rollout, settings, **options)
        self.calls.append(("batches", len(out)))
        return out

    def score(self, model, batch, settings, *, live, generator):
        self.calls.append(("score", live, generator.initial_seed()))
        return self.plan.score(model, batch, settings, live=live, generator=generator)

    def attach(self, batch, reference, old, sampler):
        self.calls.append(("attach", reference is not None, old is not None))
        return self.plan.attach(batch, reference, old, sampler)

    def rollout_decay(self, step):
        return self.plan.rollout_decay(step)

    def loss(self, scores, batch):
        self.calls.append(("loss",))
        return self.plan.loss(scores, batch)


def token_case(iterations: int, beta):
    policy = PolicyLossConfig(num_iterations=iterations, beta=beta)
    model = tiny_model("block_causal", vocab=TASK.tokenizer.vocab_size)
    plan = Recording(TokenPolicyPlan(PolicyLoss(policy)))
    roles = PolicyRoles(model, reference=policy.uses_reference)
    learner = PolicyLearner(roles, plan, factory, micro_batch_size=5)
    rollout, _ = collect_rollout(
        roles.rollout,
        TokenSource(TASK, SAMPLER),
        spread_rewards(),
        start_prompt=0,
        num_prompts=3,
        group_size=4,
        weights_version=0,
        seed=0,
        advantage=policy.advantage_spec,
    )
    return learner, plan, rollout, 3  # 12 rows in micro-batches of 5: 3


def flow_case(iterations: int, beta):
    config = FlowGRPOConfig(num_iterations=iterations, beta=0.0 if beta == "none" else beta)
    model = TinyVelocity()
    plan = Recording(FlowPolicyPlan(FlowGRPOLoss(config), seed=0))
    roles = PolicyRoles(model, reference=config.uses_reference)
    learner = PolicyLearner(roles, plan, factory)
    trace = flow_trace(roles.rollout)
    return learner, plan, as_rollout(trace, torch.linspace(-1, 1, 8)), 2 * 5  # groups × steps


def factory(actor, loss_fn):
    return Trainer(actor, loss_fn, OptimConfig(lr=1e-3, grad_clip=None))


@pytest.mark.parametrize("world", [token_case, flow_case])
@pytest.mark.parametrize(("iterations", "beta"), [(1, "none"), (1, 0.1), (2, "none"), (3, 0.1)])
def test_the_learner_drives_every_plan_the_same_way(world, iterations, beta):
    learner, plan, rollout, micro = world(iterations, beta)
    assert plan.calls == [("check",)]
    metrics = learner.step(rollout)
    calls = plan.calls[1:]
    assert calls[:2] == [("pin",), ("batches", micro)]
    frozen = [c for c in calls if c[0] == "score" and not c[1]]
    live = [c for c in calls if c[0] == "score" and c[1]]
    passes = int(plan.uses_reference) + int(iterations > 1)
    assert len(frozen) == micro * passes and len(live) == micro * iterations
    assert [c for c in calls if c[0] == "loss"] == [("loss",)] * (micro * iterations)
    attach = [c for c in calls if c[0] == "attach"]
    assert attach == [("attach", plan.uses_reference, iterations > 1)] * micro
    # every pass over the micro-batches uses the same per-micro-batch streams, in order
    seeds = [c[2] for c in live[:micro]]
    assert len(set(seeds)) == micro
    for start in range(0, len(frozen), micro):
        assert [c[2] for c in frozen[start : start + micro]] == seeds
    for start in range(0, len(live), micro):
        assert [c[2] for c in live[start : start + micro]] == seeds
    # frozen passes all come before the first live one
    first_live = calls.index(live[0])
    assert all(calls.index(c) < first_live for c in frozen)
    assert metrics["weights_version"] == 1.0 and learner.roles.version == 1
    assert metrics["learner/micro_batches"] == float(micro)
    assert learner.trainer.global_step == iterations and learner.rollout_step == 1
    prefix = plan.metric_prefix
    for i in range(iterations):
        assert metrics[f"{prefix}ratio_max@iter{i}"] >= 1.0 and f"loss@iter{i}" in metrics
    assert metrics[f"{prefix}ratio_max@iter0"] == 1.0 == metrics[f"{prefix}ratio_min@iter0"]
    assert metrics[f"{prefix}parity_max_abs@iter0"] == 0.0


def test_a_plan_that_needs_a_reference_is_refused_without_one():
    plan = TokenPolicyPlan(PolicyLoss(PolicyLossConfig(beta=0.1)))
    roles = PolicyRoles(tiny_model(), reference=False)
    with pytest.raises(ValueError, match="reference: this objective scores a reference model"):
        PolicyLearner(roles, plan, factory)
