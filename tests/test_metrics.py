"""Metric reduction (MATH.md §2) and the metrics logger."""

from __future__ import annotations

import json
import math

import pytest
import torch

from diffusion_rl.contracts import Extreme, WeightedMetric
from diffusion_rl.train import loggers
from diffusion_rl.train.loggers import MetricsLogger, progress
from diffusion_rl.train.metrics import reduce_metrics, reduce_weighted


def wm(total: float, denominator: float, eps: float | None = None, min_denom: float | None = None):
    return WeightedMetric(torch.tensor(total), torch.tensor(denominator), eps, min_denom)


def test_weighted_metrics_reduce_globally_not_as_mean_of_means():
    items = [{"kl": wm(3.0, 3.0)}, {"kl": wm(0.0, 0.0)}, {"kl": wm(2.0, 0.5)}]
    out = reduce_metrics(items)
    assert out["kl"] == pytest.approx((3.0 + 0.0 + 2.0) / (3.0 + 0.0 + 0.5))  # 1.43
    mean_of_means = (3.0 / 3.0 + 0.0 + 2.0 / 0.5) / 3  # the empty item's value is 0: 1.67
    assert abs(out["kl"] - mean_of_means) > 0.2


def test_eps_and_min_denom_are_applied_once_to_the_total():
    out = reduce_metrics([{"a": wm(1.0, 1.0, eps=0.5)}, {"a": wm(2.0, 1.0, eps=0.5)}])
    assert out["a"] == pytest.approx(3.0 / (2.0 + 0.5))
    out = reduce_metrics([{"a": wm(1.0, 0.5, min_denom=4.0)}, {"a": wm(2.0, 1.0, min_denom=4.0)}])
    assert out["a"] == pytest.approx(3.0 / 4.0)
    reduced = reduce_weighted([wm(1.0, 2.0, eps=1.0), wm(5.0, 3.0, eps=1.0)])
    assert (reduced.sum, reduced.denominator, reduced.bound) == (6.0, 5.0, 6.0)
    assert reduced.value == pytest.approx(1.0)


def test_zero_bound_gives_zero_not_nan():
    out = reduce_metrics([{"a": wm(0.0, 0.0)}, {"a": wm(0.0, 0.0)}])
    assert out["a"] == 0.0
    assert reduce_weighted([wm(0.0, 0.0)]).value == 0.0


def test_plain_scalars_mean_over_items_that_carry_the_key():
    items = [{"a": 1.0, "b": torch.tensor(4.0)}, {"a": torch.tensor([3.0])}, {"b": 2}]
    out = reduce_metrics(items)
    assert out == {"a": 2.0, "b": 3.0}
    assert list(out) == ["a", "b"]


def test_weighted_and_plain_keys_coexist():
    out = reduce_metrics([{"w": wm(2.0, 4.0), "p": 1.0}, {"w": wm(2.0, 0.0), "p": 5.0}])
    assert out == {"w": 1.0, "p": 3.0}


def test_eps_disagreement_names_key_and_both_values():
    with pytest.raises(ValueError, match=r"'kl'.*eps.*0\.1.*0\.2"):
        reduce_metrics([{"kl": wm(1.0, 1.0, eps=0.1)}, {"kl": wm(1.0, 1.0, eps=0.2)}])
    with pytest.raises(ValueError, match=r"'kl'.*min_denom.*None.*1\.0"):
        reduce_metrics([{"kl": wm(1.0, 1.0)}, {"kl": wm(1.0, 1.0, min_denom=1.0)}])


@pytest.mark.parametrize("order", ["weighted_first", "plain_first"])
def test_mixing_kinds_under_one_key_is_a_type_error(order):
    items = [{"acc": wm(1.0, 2.0)}, {"acc": 0.5}]
    if order == "plain_first":
        items.reverse()
    with pytest.raises(TypeError, match=r"metric 'acc': mixes (WeightedMetric|plain scalar) and"):
        reduce_metrics(items)
    with pytest.raises(TypeError, match=r"metric 'acc': mixes Extreme \(max\) and plain scalar"):
        reduce_metrics([{"acc": Extreme(torch.tensor(1.0))}, {"acc": 0.5}])


def test_extremes_reduce_to_the_true_max_and_min():
    """Extremes over micro-batches are the extremes of the whole batch, not their mean."""
    items = [
        {"hi": Extreme(torch.tensor(3.0)), "lo": Extreme(torch.tensor(-1.0), "min")},
        {"hi": Extreme(7.0), "lo": Extreme(torch.tensor(2.0), "min")},
        {"hi": Extreme(torch.tensor(5.0))},
    ]
    assert reduce_metrics(items) == {"hi": 7.0, "lo": -1.0}
    with pytest.raises(ValueError, match="Extreme.kind"):
        Extreme(1.0, "mean")
    with pytest.raises(ValueError, match="Extreme.value"):
        Extreme(torch.ones(2))


def test_unsupported_value_is_a_type_error():
    with pytest.raises(TypeError, match=r"'v'.*got str"):
        reduce_metrics([{"v": "high"}])
    with pytest.raises(TypeError, match=r"'v'.*got Tensor"):
        reduce_metrics([{"v": torch.ones(2)}])


# ----------------------------------------------------------------------------- logger
def test_jsonl_logger_writes_parseable_lines(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        assert not log.tensorboard_enabled
        log.log(1, {"loss": 0.5, "lr": torch.tensor(1e-3)})
        log.log(2, {"loss": math.nan, "grad_norm": math.inf})
    with MetricsLogger(tmp_path, tensorboard=False) as log:  # a resumed run appends
        log.log(3, {"loss": 0.25})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]  # strict JSON: no NaN tokens
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[0]["loss"] == 0.5 and records[0]["lr"] == pytest.approx(1e-3)
    assert records[1]["loss"] is None and records[1]["grad_norm"] is None
    assert all(isinstance(r["time"], float) for r in records)


def test_logger_rejects_reserved_names_and_use_after_close(tmp_path):
    log = MetricsLogger(tmp_path, tensorboard=False)
    with pytest.raises(ValueError, match="'step'"):
        log.log(0, {"step": 1.0})
    log.close()
    log.close()
    with pytest.raises(RuntimeError, match="after close"):
        log.log(1, {"loss": 1.0})


def test_tensorboard_event_file_appears(tmp_path):
    pytest.importorskip("tensorboard")
    with MetricsLogger(tmp_path) as log:
        assert log.tensorboard_enabled
        log.log(1, {"loss": 0.5})
        log.log(2, {"loss": 0.25})
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0


def test_tensorboard_required_but_missing_points_at_the_extra(tmp_path, monkeypatch):
    def missing():
        raise ImportError("No module named 'tensorboard'")

    monkeypatch.setattr(loggers, "_import_summary_writer", missing)
    with pytest.raises(ImportError, match=r"pip install 'diffusion-rl\[tracking\]'"):
        MetricsLogger(tmp_path, tensorboard=True)
    with MetricsLogger(tmp_path) as log:  # auto: silently JSONL only
        assert not log.tensorboard_enabled


def test_progress_bar_respects_env(monkeypatch):
    monkeypatch.setenv("DIFFUSION_RL_NO_PROGRESS", "1")
    with progress(10, "train") as bar:
        assert bar.disable
    monkeypatch.delenv("DIFFUSION_RL_NO_PROGRESS")
    with progress(10, "train") as bar:
        assert not bar.disable and bar.total == 10 and bar.desc.startswith("train")
