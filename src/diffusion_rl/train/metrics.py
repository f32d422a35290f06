"""Reduce per-micro-batch metrics to one number per key (docs/math.md §2).

Two kinds of values, never mixed under one key:

* :class:`~diffusion_rl.contracts.WeightedMetric` reduces *globally*:
  ``ΣS / bound(Σd, eps, min_denom)`` (0 when the bound is 0, never NaN). ``eps`` and
  ``min_denom`` are applied once, to the total, so they must agree across items.
* :class:`~diffusion_rl.contracts.Extreme` reduces by its ``kind``: the max (or min) over
  the items that carry the key.
* plain scalars (a one-element tensor, an ``int`` or a ``float``) reduce by the mean over
  the items that carry the key.

Sums are taken in float64 on the CPU; results are Python floats.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from diffusion_rl.contracts import Extreme, WeightedMetric

__all__ = ["WeightedReduction", "reduce_metrics", "reduce_weighted"]


@dataclass(frozen=True)
class WeightedReduction:
    """The global reduction of several :class:`WeightedMetric` items.

    ``sum`` = ΣS, ``denominator`` = Σd, ``bound`` = ``WeightedMetric.bound(Σd, eps, min_denom)``
    and ``value`` = ``sum / bound`` (0 when ``bound == 0``). All float64 Python floats.
    """

    sum: float
    denominator: float
    bound: float
    value: float


def _as_float64(value: torch.Tensor) -> torch.Tensor:
    return value.detach().reshape(()).to(device="cpu", dtype=torch.float64)


def reduce_weighted(metrics: Sequence[WeightedMetric], key: str = "loss") -> WeightedReduction:
    """Reduce ``metrics`` globally; ``key`` only names the metric in error messages.

    This is the trainer's helper for the primary loss: the gradient of the global weighted
    mean is ``Σ∇S_k / bound`` with the ``bound`` returned here.

    Raises ``ValueError`` when ``metrics`` is empty or ``eps`` / ``min_denom`` disagree.
    """
    if not metrics:
        raise ValueError(f"metric {key!r}: expected at least one WeightedMetric, got none")
    first = metrics[0]
    for item in metrics[1:]:
        for name in ("eps", "min_denom"):
            expected, found = getattr(first, name), getattr(item, name)
            if expected != found:
                raise ValueError(
                    f"metric {key!r}: WeightedMetric.{name} must agree across items "
                    f"(it is applied once to the global denominator), got {expected!r} and {found!r}"
                )
    total_sum = torch.stack([_as_float64(m.sum) for m in metrics]).sum()
    total_den = torch.stack([_as_float64(m.denominator) for m in metrics]).sum()
    bound = WeightedMetric.bound(total_den, first.eps, first.min_denom)
    value = total_sum / bound if bool(bound > 0) else torch.zeros((), dtype=torch.float64)
    return WeightedReduction(
        sum=float(total_sum), denominator=float(total_den), bound=float(bound), value=float(value)
    )


def _is_plain_scalar(value: object) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def reduce_metrics(
    items: Sequence[Mapping[str, WeightedMetric | Extreme | torch.Tensor | float]],
) -> dict[str, float]:
    """Reduce a sequence of metric mappings (one per micro-batch) to ``{key: float}``.

    Keys may be absent from some items. Raises ``TypeError`` when a key mixes kinds
    (:class:`WeightedMetric`, :class:`Extreme`, plain scalar) or holds anything else;
    ``ValueError`` when the ``eps`` / ``min_denom`` of one weighted key disagree. Output keys
    keep first-seen order.
    """
    weighted: dict[str, list[WeightedMetric]] = {}
    extremes: dict[str, list[Extreme]] = {}
    plain: dict[str, list[float]] = {}
    kinds: dict[str, str] = {}
    for item in items:
        for key, value in item.items():
            if isinstance(value, WeightedMetric):
                kind = "WeightedMetric"
                weighted.setdefault(key, []).append(value)
            elif isinstance(value, Extreme):
                kind = f"Extreme ({value.kind})"
                extremes.setdefault(key, []).append(value)
            elif _is_plain_scalar(value):
                kind = "plain scalar"
                plain.setdefault(key, []).append(_as_python_float(value))
            else:
                raise TypeError(
                    f"metric {key!r}: expected a WeightedMetric, an Extreme or a scalar "
                    f"(one-element tensor, int, float), got {type(value).__name__}"
                )
            if kinds.setdefault(key, kind) != kind:
                raise TypeError(_mixed_message(key, kinds[key], kind))
    out: dict[str, float] = {}
    for key in kinds:
        if key in weighted:
            out[key] = reduce_weighted(weighted[key], key).value
        elif key in extremes:
            pick = max if extremes[key][0].kind == "max" else min
            out[key] = pick(_as_python_float(e.value) for e in extremes[key])
        else:
            values = plain[key]
            out[key] = sum(values) / len(values)
    return out


def _as_python_float(value: torch.Tensor | float) -> float:
    return float(value.detach().double().item() if isinstance(value, torch.Tensor) else value)


def _mixed_message(key: str, first: str, other: str) -> str:
    return (
        f"metric {key!r}: mixes {first} and {other} values across items; one key must keep "
        "one kind (weighted metrics reduce globally, extremes by max / min, scalars by mean)"
    )
