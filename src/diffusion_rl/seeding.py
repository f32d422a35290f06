"""Per-row, per-step random streams shared by the token and the flow sampler.

Invariant: the stream a row draws from at a step is a function of ``(row seed, step id)``
only — never of the batch, the row's position in it, or a batch-wide counter — so a row's
output is the same whether it is sampled alone or in a batch, and replay can redraw it.
"""

from __future__ import annotations

import torch

__all__ = ["row_step_generator"]

_MIX_A = 0x9E3779B97F4A7C15
_MIX_B = 0xBF58476D1CE4E5B9


def row_step_generator(seed: int, step_id: int) -> torch.Generator:
    """A fresh CPU generator keyed by ``(seed, step_id)`` alone (the two mixed into one
    63-bit seed); the same pair always gives the same stream."""
    mixed = (int(seed) * _MIX_A + (int(step_id) + 1) * _MIX_B) % (2**63 - 1)
    return torch.Generator().manual_seed(mixed)
