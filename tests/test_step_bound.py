"""The learner's trust region at μ = 1 (``max_step_kl``): the step's policy change is measured
on the rollout's own actions and, above the bound, the step is pulled back along itself.

Checked against independent computations: the divergence against a hand-computed k3 mean of
the trace's behaviour log-probs and a separate exact replay of the updated actor; the bounded
weights against an unbounded learner's step from the same start (they must lie on that step's
segment, at the reported scale).
"""

from __future__ import annotations

import copy
import zlib

import pytest
import torch
from conftest import tiny_model
from test_policy import SAMPLER, TASK

from diffusion_rl.objectives.grpo import PolicyLoss, PolicyLossConfig
from diffusion_rl.rewards import CombinedReward
from diffusion_rl.rollout import TokenSource, collect_rollout
from diffusion_rl.scoring.replay import ReplayScorer
from diffusion_rl.train import OptimConfig, Trainer
from diffusion_rl.train.learner import PolicyLearner
from diffusion_rl.train.plans import TokenPolicyPlan
from diffusion_rl.train.roles import PolicyRoles


class SpreadReward:
    """A pseudo-reward with spread inside groups, the same in every process (crc32, not the
    salted ``hash``)."""

    name = "spread"

    def __call__(self, completions, examples):
        return torch.tensor([float(zlib.crc32(c.encode()) % 3) for c in completions])


def learner_for(model, max_step_kl, scorer="exact", lr=1e-4):
    policy = PolicyLossConfig(beta="none", max_step_kl=max_step_kl)
    plan = TokenPolicyPlan(PolicyLoss(policy), scorer=scorer)
    roles = PolicyRoles(model, reference=False)
    return PolicyLearner(
        roles,
        plan,
        lambda actor, loss: Trainer(actor, loss, OptimConfig(lr=lr, grad_clip=None)),
        micro_batch_size=5,
    )


def rollout_of(learner):
    rollout, _ = collect_rollout(
        learner.roles.rollout,
        TokenSource(TASK, SAMPLER),
        CombinedReward([(SpreadReward(), 1.0)]),
        start_prompt=0,
        num_prompts=3,
        group_size=4,
        weights_version=learner.roles.version,
        seed=0,
        advantage=learner.plan.objective.config.advantage_spec,
    )
    return rollout


def replayed_kl(model, trace) -> float:
    """Mean k3 estimate of KL(before ‖ after) over the trace's committed actions, by hand."""
    batch = trace.prepare(1.0)
    after = (
        ReplayScorer(model.eval(), temperature=trace.temperature, stop_gradient=True)
        .score(batch)
        .logprobs
    )
    acted = batch.active & (batch.model_inputs["commit_steps"] >= 0)
    log_ratio = (after - trace.behaviour_logprobs)[acted].double()
    return float((log_ratio.exp() - log_ratio - 1).mean())


def trained(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    ("scorer", "attention"),  # the bound reads packed replay (block-causal) or dense replay
    [("exact", "block_causal"), ("mean_field", "block_causal"), ("exact", "bidirectional")],
)
def test_a_binding_bound_pulls_the_step_back_along_itself_to_the_bound(scorer, attention):
    torch.manual_seed(0)
    start = tiny_model(attention, vocab=TASK.tokenizer.vocab_size)
    free = learner_for(copy.deepcopy(start), None, scorer)
    bounded = learner_for(copy.deepcopy(start), 1e-2, scorer)
    rollout = rollout_of(free)
    assert torch.equal(rollout_of(bounded).trace.tokens, rollout.trace.tokens)

    theta0 = trained(start)
    free_metrics = free.step(rollout)
    metrics = bounded.step(rollout_of(bounded))
    assert "learner/step_kl" not in free_metrics

    unbounded_kl = replayed_kl(free.roles.actor, rollout.trace)
    assert metrics["learner/step_kl_unbounded"] == pytest.approx(unbounded_kl, rel=1e-4)
    assert unbounded_kl > 3 * 1e-2  # one Adam step at 1e-4 moves this model far
    scale = metrics["learner/step_scale"]
    assert scale == pytest.approx((1e-2 / unbounded_kl) ** 0.5)
    theta_free, theta_bounded = trained(free.roles.actor), trained(bounded.roles.actor)
    for name, before in theta0.items():
        expected = before + scale * (theta_free[name] - before)
        torch.testing.assert_close(theta_bounded[name], expected, rtol=1e-5, atol=1e-6)
    # the measured change after the pull-back is near the bound and what a replay says
    assert metrics["learner/step_kl"] == pytest.approx(
        replayed_kl(bounded.roles.actor, rollout.trace), rel=1e-4
    )
    assert 0.3e-2 < metrics["learner/step_kl"] < 2e-2
    # the rollout weights follow the bounded actor
    for name, param in bounded.roles.rollout.named_parameters():
        assert torch.equal(param, theta_bounded[name])


def test_a_bound_that_does_not_bind_leaves_the_step_exactly_as_it_was():
    torch.manual_seed(0)
    start = tiny_model("block_causal", vocab=TASK.tokenizer.vocab_size)
    free = learner_for(copy.deepcopy(start), None, lr=1e-5)
    loose = learner_for(copy.deepcopy(start), 10.0, lr=1e-5)
    free.step(rollout_of(free))
    metrics = loose.step(rollout_of(loose))
    assert metrics["learner/step_scale"] == 1.0
    assert 0 < metrics["learner/step_kl"] == metrics["learner/step_kl_unbounded"] < 10.0
    for (name, a), (_, b) in zip(
        free.roles.actor.named_parameters(), loose.roles.actor.named_parameters()
    ):
        assert torch.equal(a, b), name


def test_max_step_kl_must_be_positive_and_finite():
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="max_step_kl"):
            PolicyLossConfig(max_step_kl=bad)
