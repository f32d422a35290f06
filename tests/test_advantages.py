"""Group advantages: the centred / scaled / clipped formula against a hand computation, and
flat groups, exactly 0 for every group size, value and spec (decided by max == min)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from diffusion_rl.advantages import AdvantageSpec, flat_groups, group_advantages
from diffusion_rl.objectives.flow_grpo import FlowGRPOConfig
from diffusion_rl.objectives.grpo import PolicyLossConfig

SPECS = {
    "grpo": PolicyLossConfig(algorithm="grpo").advantage_spec,
    "drgrpo": PolicyLossConfig(algorithm="drgrpo").advantage_spec,
    "flow": FlowGRPOConfig().advantage_spec,
    "flow_batch": dataclasses.replace(FlowGRPOConfig().advantage_spec, scale="batch"),
}


def test_the_reproduction_is_exactly_zero():
    """Eight rewards of 0.7: their float32 mean is 0.7 plus one ulp, which (r − mean) / (std +
    eps) turned into 0.056 per row (GRPO) and 5.96e-4 (Flow-GRPO)."""
    rewards = torch.full((8,), 0.7)
    assert float(rewards.mean()) != float(rewards[0])  # the hole itself
    for name, spec in SPECS.items():
        assert torch.equal(group_advantages(rewards, 8, spec), torch.zeros(8)), name


@pytest.mark.parametrize("name", sorted(SPECS))
def test_flat_groups_are_exactly_zero_for_every_size_and_value(name):
    """Property: groups of 1–64 filled with a repeated random value (mixed with informative
    groups in one batch) get advantage exactly 0; the other groups are what the formula gives
    when computed on their own."""
    spec = SPECS[name]
    generator = torch.Generator().manual_seed(0)
    for size in range(1, 65):
        if spec.scale == "group" and size <= spec.ddof:
            continue
        values = torch.rand(6, generator=generator) * torch.tensor([1, 3, 1e-3, 1e3, 0.1, 7])
        special = torch.tensor([0.7, 2 / 3, 0.1, 0.2, 1 / 3, 0.3])
        for value in torch.cat([values, special]).tolist():
            flat = torch.full((size,), value)
            informative = torch.rand(size, generator=generator)
            if size > 1:
                informative[0] = informative[1] + 0.5  # never flat
            rewards = torch.cat([flat, informative, flat])
            advantages = group_advantages(rewards, size, spec)
            assert torch.equal(advantages[:size], torch.zeros(size)), (size, value)
            assert torch.equal(advantages[2 * size :], torch.zeros(size)), (size, value)
            if spec.scale != "batch":
                alone = group_advantages(informative, size, spec)
                assert torch.equal(advantages[size : 2 * size], alone)


def test_the_formula_against_a_hand_computation():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25, 3.0, 1.0, 2.0, 2.0])
    spec = AdvantageSpec(scale="group", ddof=1, eps=1e-6, clip=None)
    got = group_advantages(rewards, 4, spec)
    expected = []
    for group in (rewards[:4].tolist(), rewards[4:].tolist()):
        mean = sum(group) / 4
        std = (sum((r - mean) ** 2 for r in group) / 3) ** 0.5
        expected += [(r - mean) / (std + 1e-6) for r in group]
    torch.testing.assert_close(got, torch.tensor(expected), rtol=1e-6, atol=1e-7)
    clipped = group_advantages(rewards * 100, 4, AdvantageSpec(scale="none", clip=5.0))
    assert float(clipped.abs().max()) == 5.0


def test_a_flat_batch_under_the_batch_scale_is_zero():
    spec = AdvantageSpec(scale="batch", ddof=0, eps=1e-4)
    assert torch.equal(group_advantages(torch.full((16,), 0.1), 4, spec), torch.zeros(16))


def test_flat_groups_is_max_equals_min():
    groups = torch.tensor([[0.7, 0.7, 0.7], [0.7, 0.7, 0.70000005], [float("nan")] * 3])
    assert flat_groups(groups).tolist() == [True, False, False]
