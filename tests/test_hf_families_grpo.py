"""Issue 14's exactness acceptance for every Hugging Face token family, through the real loader.

For LLaDA, Dream and SDAR checkpoints written by each family's own public code (the shared
fixtures), loaded with ``load_model(dir, dtype=...)``: a captured rollout on a built-in task
(encoded with the directory's own tokenizer), then one GRPO step through the learner with
μ = 2. Before the update the importance ratio is exactly 1 and the snapshot reproduces the
sampler's log-probs; with a LoRA the reference is the base (KL exactly 0 at the first inner
iteration) and only adapter tensors change. In fp32 and with bf16 weights (sampled under the
learner's autocast, as the recipes do).
"""

from __future__ import annotations

import zlib

import pytest
import torch
from hf_tiny import fixture_dir

from diffusion_rl.models import load_model
from diffusion_rl.models.lora import LoraSettings, add_lora
from diffusion_rl.objectives.grpo import PolicyLoss, PolicyLossConfig
from diffusion_rl.rewards import CombinedReward
from diffusion_rl.rollout import TokenSource, collect_rollout
from diffusion_rl.sampling import TokenSamplerConfig
from diffusion_rl.tasks import get_task
from diffusion_rl.train import OptimConfig, Trainer
from diffusion_rl.train.learner import PolicyLearner
from diffusion_rl.train.plans import TokenPolicyPlan
from diffusion_rl.train.roles import PolicyRoles

FAMILIES = ("llada", "dream", "sdar")
POLICY = PolicyLossConfig(algorithm="grpo", num_iterations=2, beta=0.04)


class TextHashReward:
    """A deterministic pseudo-reward with spread inside a group (the models are untrained)."""

    name = "text_hash"

    def __call__(self, completions, examples):
        return torch.tensor([float(zlib.crc32(c.encode()) % 3) for c in completions])


def learner_and_rollout(family: str, dtype: str, lora: bool):
    loaded = load_model(fixture_dir("hf_dllm", family), dtype=dtype)
    model = loaded.model
    if lora:
        model = add_lora(model, LoraSettings(rank=4), seed=1)
    precision = "bf16" if dtype == "bfloat16" else "fp32"

    def make_trainer(actor, loss_fn):
        return Trainer(actor, loss_fn, OptimConfig(lr=3e-2, grad_clip=None), precision=precision)

    roles = PolicyRoles(model, reference=True)
    learner = PolicyLearner(roles, TokenPolicyPlan(PolicyLoss(POLICY)), make_trainer)
    task = get_task("arithmetic", tokenizer=loaded.tokenizer, num_digits=1, block_size=4)
    sampler = TokenSamplerConfig(
        generation_length=task.completion_length, block_size=4, steps_per_block=2, temperature=1.0
    )
    with learner.trainer.autocast():  # sampled at the learner's precision, as the recipes do
        rollout, _ = collect_rollout(
            roles.rollout,
            TokenSource(task, sampler),
            CombinedReward([(TextHashReward(), 1.0)]),
            start_prompt=0,
            num_prompts=3,
            group_size=4,
            weights_version=roles.version,
            seed=0,
            advantage=POLICY.advantage_spec,
        )
    return model, learner, rollout


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_one_grpo_step_is_exact_before_the_update(family, dtype):
    model, learner, rollout = learner_and_rollout(family, dtype, lora=False)
    assert next(model.parameters()).dtype == getattr(torch, dtype)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    metrics = learner.step(rollout)
    assert metrics["policy/ratio_min@iter0"] == 1.0 == metrics["policy/ratio_max@iter0"]
    assert metrics["policy/parity_max_abs@iter0"] <= 1e-6
    assert metrics["policy/kl@iter0"] == 0.0  # the reference is the actor before the update
    assert metrics["policy/ratio_mean@iter1"] != 1.0  # the first inner update moved the policy
    now = dict(model.named_parameters())
    assert sum(not torch.equal(now[n], value) for n, value in before.items()) > len(before) // 2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_lora_step_starts_at_the_base_and_changes_only_the_adapter(family, dtype):
    model, learner, rollout = learner_and_rollout(family, dtype, lora=True)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" not in n}
    adapter = {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" in n}
    assert adapter and learner.roles.reference.model is model  # no second copy of the base
    metrics = learner.step(rollout)
    assert metrics["policy/kl@iter0"] == 0.0  # a fresh adapter adds exactly 0
    assert metrics["policy/ratio_min@iter0"] == 1.0 == metrics["policy/ratio_max@iter0"]
    assert metrics["policy/parity_max_abs@iter0"] <= 1e-6
    assert metrics["policy/kl@iter1"] > 0.0
    now = dict(model.named_parameters())
    assert all(torch.equal(now[n], value) for n, value in base.items())
    assert any(not torch.equal(now[n], value) for n, value in adapter.items())
