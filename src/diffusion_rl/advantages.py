"""Advantages from rewards, and reward shaping: what both worlds' policy losses consume.

One function, :func:`group_advantages`, for every method. Rewards come in consecutive groups
of ``G`` rows that answer one prompt (the rollout collector lays them out so). With ``r_g``
a group's rewards:

    centred  a = r − mean(r_g)
    scale    "group":  a / (std_ddof(r_g) + eps)       GRPO (ddof 1), Flow-GRPO (ddof 0)
             "batch":  a / (std_ddof(r) + eps)         Flow-GRPO's global-std option
             "none":   a                               Dr.GRPO
    clip     clamp(·, −clip, clip) when ``clip`` is set (Flow-GRPO: 5)

A group whose rewards are all equal gets advantage exactly 0 (no signal), for every group size
and value: "flat" is decided by ``max == min``, never by the std, because the float32 mean of
equal values need not be that value (eight rewards of 0.7 average to 0.7 plus one ulp, and
``(r − mean) / (std + eps)`` would turn that ulp into advantages of up to ~0.06). The
statistics are ``torch.mean`` / ``torch.std`` over each group, float32.

:class:`AdvantageSpec` holds those options; each objective's config says which it uses
(``PolicyLossConfig.advantage_spec``, ``FlowGRPOConfig.advantage_spec``).

Reward shaping: :func:`overlong_penalty`, DAPO's soft punishment of long completions, in
tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Scale = Literal["group", "batch", "none"]


@dataclass(frozen=True)
class AdvantageSpec:
    """How rewards become advantages (see the module doc)."""

    scale: Scale = "group"
    ddof: int = 1
    eps: float = 1e-6
    clip: float | None = None

    def __post_init__(self) -> None:
        if self.scale not in ("group", "batch", "none"):
            raise ValueError(
                f"AdvantageSpec.scale: expected 'group', 'batch' or 'none', got {self.scale!r}"
            )
        if self.ddof not in (0, 1):
            raise ValueError(f"AdvantageSpec.ddof: expected 0 or 1, got {self.ddof}")
        if not self.eps >= 0:
            raise ValueError(f"AdvantageSpec.eps: expected a value >= 0, got {self.eps}")
        if self.clip is not None and not self.clip > 0:
            raise ValueError(f"AdvantageSpec.clip: expected a value > 0 or None, got {self.clip}")


def group_advantages(
    rewards: torch.Tensor, group_size: int, spec: AdvantageSpec = AdvantageSpec()
) -> torch.Tensor:
    """``rewards [B]`` in consecutive groups of ``group_size`` → float32 advantages ``[B]``."""
    rewards = torch.as_tensor(rewards)
    if group_size < 1:
        raise ValueError(f"group_size: expected >= 1, got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards: expected [B] with B a multiple of group_size={group_size}, "
            f"got {tuple(rewards.shape)}"
        )
    groups = rewards.float().view(-1, group_size)
    flat = flat_groups(groups)
    centred = groups - groups.mean(1, keepdim=True)
    if spec.scale == "group":
        if group_size - spec.ddof < 1:
            raise ValueError(
                f"group_size: a group std with ddof={spec.ddof} needs group_size > {spec.ddof}, "
                f"got {group_size}"
            )
        centred = centred / (groups.std(1, correction=spec.ddof, keepdim=True) + spec.eps)
    elif spec.scale == "batch":
        centred = centred / (rewards.float().std(correction=spec.ddof) + spec.eps)
    advantages = torch.where(flat[:, None], 0.0, centred).reshape(-1)
    if spec.clip is not None:
        advantages = torch.clamp(advantages, -spec.clip, spec.clip)
    return advantages


def flat_groups(groups: torch.Tensor) -> torch.Tensor:
    """``groups [N, G]`` → bool ``[N]``: the groups whose values are all equal (``max == min``;
    a group holding a NaN is not flat). The one test of "no signal" for advantages, DAPO's
    filter and the flat-group metrics."""
    return groups.amax(1) == groups.amin(1)


def overlong_penalty(
    lengths: torch.Tensor, max_tokens: int, buffer_tokens: int, penalty: float
) -> torch.Tensor:
    """DAPO soft overlong punishment, in tokens: ``min(−(len − (L_max − L_buf)) / L_buf · p, 0)``."""
    if buffer_tokens == 0 or penalty == 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    excess = lengths.float() - (max_tokens - buffer_tokens)
    return torch.clamp(-excess / buffer_tokens * penalty, max=0.0)


class OverlongShaping:
    """DAPO's overlong shaping as a rollout reward term named ``"overlong"``:
    ``shaping(trace)`` → :func:`overlong_penalty` of the trace's completion lengths."""

    name = "overlong"

    def __init__(self, max_tokens: int, buffer_tokens: int, penalty: float) -> None:
        self.max_tokens = max_tokens
        self.buffer_tokens = buffer_tokens
        self.penalty = penalty

    def __call__(self, trace) -> torch.Tensor:
        return overlong_penalty(trace.lengths(), self.max_tokens, self.buffer_tokens, self.penalty)
