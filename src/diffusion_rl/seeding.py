"""Per-row random streams: the samplers' (row seed, step) streams and the training noise keys.

Invariant: the stream a row draws from is a function of that row's own key only — never of
the batch, the row's position in it, the micro-batch it lands in, or a batch-wide counter —
so a row's output is the same whether it is processed alone or in a batch, however a batch
is split, and replay can redraw it.

* Samplers: :func:`row_step_generator` ``(row seed, step id)``.
* Training objectives that draw noise (SFT masks and times, flow-SFT σ / ε / dropout, the
  approximate RL estimators' masks): each row carries a 63-bit *noise key* (an int64
  ``noise_seeds`` column that every slice and micro-batch split carries along with the rows),
  made by :func:`noise_keys` from what identifies the example at this step, e.g.
  ``(run seed, trainer step, dataset index)``. :class:`RowStreams` turns the keys into one
  ``torch.Generator().manual_seed(key)`` stream per row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["RowStreams", "noise_key", "noise_keys", "row_step_generator"]

_MIX_A = 0x9E3779B97F4A7C15
_MIX_B = 0xBF58476D1CE4E5B9
_MASK64 = (1 << 64) - 1


def row_step_generator(seed: int, step_id: int) -> torch.Generator:
    """A fresh CPU generator keyed by ``(seed, step_id)`` alone (the two mixed into one
    63-bit seed); the same pair always gives the same stream."""
    mixed = (int(seed) * _MIX_A + (int(step_id) + 1) * _MIX_B) % (2**63 - 1)
    return torch.Generator().manual_seed(mixed)


def _splitmix64(x: int) -> int:
    """The SplitMix64 finaliser: a bijection of 64-bit ints that scrambles every bit."""
    x = (x + _MIX_A) & _MASK64
    x = ((x ^ (x >> 30)) * _MIX_B) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def noise_key(*parts: int) -> int:
    """A 63-bit key (``0 <= key < 2**63``, so it fits int64) hashed from the ints ``parts``
    (any sign or size; each is reduced mod 2**64), in order, and their count. The same parts
    always give the same key; different parts give different keys except with probability
    about 2**-63 per pair."""
    h = _splitmix64(len(parts))
    for part in parts:
        if isinstance(part, bool) or not isinstance(part, int):
            raise TypeError(f"noise_key: parts must be ints, got {type(part).__name__}")
        h = _splitmix64(h ^ (part & _MASK64))
    return h >> 1


def noise_keys(rows: Sequence[int] | torch.Tensor, *parts: int) -> torch.Tensor:
    """int64 ``[B]``: ``noise_key(*parts, row)`` for each of the B row identifiers ``rows``
    (e.g. ``noise_keys(dataset_indices, run_seed, step)``)."""
    if isinstance(rows, torch.Tensor):
        if rows.dim() != 1 or rows.dtype.is_floating_point or rows.dtype == torch.bool:
            raise ValueError(
                f"rows: expected a 1-D integer tensor, got {rows.dtype} {tuple(rows.shape)}"
            )
        rows = rows.tolist()
    return torch.tensor([noise_key(*parts, int(row)) for row in rows], dtype=torch.int64)


class RowStreams:
    """One CPU stream per row: stream b is ``torch.Generator().manual_seed(keys[b])``.

    ``rand(*shape)`` / ``randn(*shape)`` return float32 ``[B, *shape]`` whose row b is the
    next ``torch.rand(shape)`` / ``torch.randn(shape)`` of stream b. Row b's values therefore
    depend on its key and on the sequence of calls only, never on the other rows.

    ``keys``: integer ``[B]`` tensor, each in ``[0, 2**63)`` (as :func:`noise_keys` makes
    them); ``name`` is what errors call the field.
    """

    def __init__(self, keys: torch.Tensor, name: str = "noise_seeds") -> None:
        if not isinstance(keys, torch.Tensor):
            raise TypeError(f"{name}: expected an int64 tensor [B], got {type(keys).__name__}")
        if keys.dtype.is_floating_point or keys.dtype.is_complex or keys.dtype == torch.bool:
            raise TypeError(f"{name}: expected an integer dtype (int64), got {keys.dtype}")
        if keys.dim() != 1:
            raise ValueError(f"{name}: expected rank 1 [B], got shape {tuple(keys.shape)}")
        values = keys.tolist()
        if any(v < 0 for v in values):
            raise ValueError(f"{name}: expected keys >= 0, got minimum {min(values)}")
        self.generators = [torch.Generator().manual_seed(v) for v in values]

    def __len__(self) -> int:
        return len(self.generators)

    def rand(self, *shape: int) -> torch.Tensor:
        return self._draw(torch.rand, shape)

    def randn(self, *shape: int) -> torch.Tensor:
        return self._draw(torch.randn, shape)

    def _draw(self, fn, shape: tuple[int, ...]) -> torch.Tensor:
        if not self.generators:
            return torch.empty((0, *shape))
        return torch.stack([fn(shape, generator=g) for g in self.generators])
