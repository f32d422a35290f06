"""Rollouts for policy optimisation: G captured samples per prompt, rewards, advantages.

A rollout is the serving sampler with capture on, run by the *rollout weights* (whose
version every trace carries). :func:`collect_rollouts` returns a :class:`RolloutBatch`: the
merged trace, the prepared :class:`~diffusion_rl.contracts.DiffusionTokenBatch` whose
``model_inputs`` also carry ``advantages [B]`` and ``behaviour_logprobs [B, L]`` (so every
micro-batch slice keeps them aligned), the rewards and the decoded texts.

DAPO's dynamic sampling is implemented here: groups whose rewards are all equal carry no
signal and are dropped; further prompts are sampled until the batch holds the requested
number of groups (or ``max_sampling_rounds`` is reached, which is reported).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .contracts import DiffusionTokenBatch
from .objectives.grpo import PolicyLossConfig, group_advantages, overlong_penalty
from .sampling.token import TokenSamplerConfig, sample_tokens
from .trace import TokenTrace

_SEED_MIX = 1_000_003


@dataclass(frozen=True)
class RolloutBatch:
    """``B = groups × group_size`` rows, consecutive rows of a group share a prompt."""

    trace: TokenTrace | None
    batch: DiffusionTokenBatch
    rewards: torch.Tensor  # float32 [B], after shaping
    texts: list[str]
    examples: list[Any]
    group_size: int
    reward_parts: dict[str, torch.Tensor] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        size = self.batch.batch_size
        sizes = {
            "rewards": self.rewards.shape[0],
            "texts": len(self.texts),
            "examples": len(self.examples),
        }
        if self.trace is not None:
            sizes["trace"] = len(self.trace)
        for name, value in sizes.items():
            if value != size:
                raise ValueError(
                    f"RolloutBatch.{name}: expected {size} rows (the batch), got {value}"
                )
        if size % self.group_size:
            raise ValueError(
                f"RolloutBatch: {size} rows is not a multiple of group_size={self.group_size}"
            )


def merge_rollouts(parts: Sequence[RolloutBatch]) -> RolloutBatch:
    """Concatenate rollout micro-batches with strict checks: all or none carry a trace, equal
    group sizes and batch structures, and (through the trace) one sampler setting."""
    if not parts:
        raise ValueError("merge_rollouts: expected at least one rollout batch, got none")
    with_trace = [p.trace is not None for p in parts]
    if any(with_trace) and not all(with_trace):
        raise ValueError(
            f"merge_rollouts: rollout batches {[i for i, t in enumerate(with_trace) if not t]} carry "
            "no trace while others do; a diffusion batch is scored from its trace"
        )
    spec = pytree.tree_structure(parts[0].batch)
    for k, part in enumerate(parts[1:], start=1):
        if part.group_size != parts[0].group_size:
            raise ValueError(
                f"merge_rollouts: batch {k} has group_size {part.group_size}, batch 0 {parts[0].group_size}"
            )
        if pytree.tree_structure(part.batch) != spec:
            raise ValueError(f"merge_rollouts: batch {k} has a different structure of model inputs")
        if set(part.reward_parts) != set(parts[0].reward_parts):
            raise ValueError(f"merge_rollouts: batch {k} has rewards {sorted(part.reward_parts)}")
    return RolloutBatch(
        trace=TokenTrace.concat([p.trace for p in parts]) if all(with_trace) else None,
        batch=DiffusionTokenBatch.concat([p.batch for p in parts]),
        rewards=torch.cat([p.rewards for p in parts]),
        texts=[t for p in parts for t in p.texts],
        examples=[e for p in parts for e in p.examples],
        group_size=parts[0].group_size,
        reward_parts={
            k: torch.cat([p.reward_parts[k] for p in parts]) for k in parts[0].reward_parts
        },
        stats={},
    )


def rollout_seed(seed: int, prompt_index: int, member: int) -> int:
    """Seed of group member ``member`` for train prompt ``prompt_index`` (distinct per sample)."""
    return (seed * _SEED_MIX + prompt_index) * 64 + member


def sample_groups(
    model,
    task,
    reward_fn: Callable[[list[str], list[Any]], Any],
    prompt_indices: Sequence[int],
    *,
    group_size: int,
    sampler: TokenSamplerConfig,
    policy: PolicyLossConfig,
    post_stop_weight: float,
    weights_version: int,
    seed: int,
) -> RolloutBatch:
    """One captured rollout of ``group_size`` samples for each train prompt index."""
    examples = [task.example(i, "train") for i in prompt_indices for _ in range(group_size)]
    data = task.encode(examples)
    seeds = [rollout_seed(seed, i, g) for i in prompt_indices for g in range(group_size)]
    sample = sample_tokens(
        model,
        data["prompt_ids"],
        data["prompt_mask"],
        sampler,
        seeds=seeds,
        stop_token_id=task.tokenizer.eos_id,
        capture=True,
        weights_version=weights_version,
    )
    trace = sample.trace
    texts = task.tokenizer.batch_decode(trace.tokens)
    scored = reward_fn(texts, examples)
    rewards, parts = scored.total, dict(scored.parts)
    if policy.overlong_buffer_tokens:
        shaping = overlong_penalty(
            trace.lengths(),
            policy.overlong_max_tokens or sampler.generation_length,
            policy.overlong_buffer_tokens,
            policy.overlong_penalty,
        )
        parts["overlong"] = shaping
        rewards = rewards + shaping
    advantages = group_advantages(
        rewards, group_size, mode=policy.advantage, ddof=policy.std_ddof, eps=policy.std_eps
    )
    prepared = trace.prepare(post_stop_weight)
    batch = DiffusionTokenBatch(
        {
            **prepared.model_inputs,
            "advantages": advantages,
            "behaviour_logprobs": trace.behaviour_logprobs,
        },
        prepared.target_ids,
        prepared.loss_weights,
    )
    return RolloutBatch(trace, batch, rewards, texts, examples, group_size, parts)


def _keep_groups(rollout: RolloutBatch, keep: torch.Tensor) -> RolloutBatch:
    rows = keep.repeat_interleave(rollout.group_size).nonzero().squeeze(1)
    index = rows.tolist()
    trace = rollout.trace
    kept_trace = None
    if trace is not None:
        kept_trace = TokenTrace(
            **{
                name: getattr(trace, name)[rows]
                if isinstance(getattr(trace, name), torch.Tensor)
                else getattr(trace, name)
                for name in trace.__dataclass_fields__
            }
        )
    return RolloutBatch(
        kept_trace,
        rollout.batch[rows],
        rollout.rewards[rows],
        [rollout.texts[i] for i in index],
        [rollout.examples[i] for i in index],
        rollout.group_size,
        {k: v[rows] for k, v in rollout.reward_parts.items()},
    )


def collect_rollouts(
    model,
    task,
    reward_fn,
    *,
    start_prompt: int,
    num_prompts: int,
    group_size: int,
    sampler: TokenSamplerConfig,
    policy: PolicyLossConfig,
    post_stop_weight: float = 1.0,
    weights_version: int,
    seed: int,
    max_sampling_rounds: int = 4,
) -> tuple[RolloutBatch, int]:
    """Sample ``num_prompts`` groups from train prompts ``start_prompt, ...``; returns the
    rollout and the next prompt position. With dynamic sampling, zero-variance groups are
    dropped and refilled from the following prompts (at most ``max_sampling_rounds`` rounds;
    if still short, the batch is smaller and ``stats['groups_short']`` says by how much)."""
    position = start_prompt
    kept: list[RolloutBatch] = []
    have, sampled_groups, rounds = 0, 0, 0
    sampled_rewards = []
    while have < num_prompts and rounds < (max_sampling_rounds if policy.dynamic_sampling else 1):
        need = num_prompts - have
        indices = list(range(position, position + need))
        position += need
        rollout = sample_groups(
            model,
            task,
            reward_fn,
            indices,
            group_size=group_size,
            sampler=sampler,
            policy=policy,
            post_stop_weight=post_stop_weight,
            weights_version=weights_version,
            seed=seed,
        )
        sampled_groups += need
        rounds += 1
        sampled_rewards.append(rollout.rewards)
        if policy.dynamic_sampling:
            spread = rollout.rewards.view(-1, group_size)
            informative = (spread.max(1).values - spread.min(1).values) > 0
            if not bool(informative.any()):
                continue
            rollout = _keep_groups(rollout, informative)
            have += int(informative.sum())
        else:
            have += need
        kept.append(rollout)
    if not kept:
        raise RuntimeError(
            f"dynamic sampling: all {sampled_groups} sampled groups had equal rewards in "
            f"{rounds} rounds; raise max_sampling_rounds or the sampling temperature"
        )
    merged = merge_rollouts(kept)
    merged_rewards = torch.cat(sampled_rewards)
    stats = {
        "rollout/reward_mean": float(merged_rewards.mean()),
        "rollout/groups_sampled": float(sampled_groups),
        "rollout/groups_kept": float(merged.batch.batch_size // group_size),
        "rollout/groups_short": float(max(0, num_prompts - merged.batch.batch_size // group_size)),
        "rollout/mean_length": float(merged.trace.lengths().float().mean())
        if merged.trace is not None
        else 0.0,
        "rollout/advantage_abs_mean": float(merged.batch.model_inputs["advantages"].abs().mean()),
    }
    return RolloutBatch(**{**merged.__dict__, "stats": stats}), position
