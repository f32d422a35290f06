"""Metric reduction (MATH.md §2) and the metrics logger."""

from __future__ import annotations

import io
import json
import math
import sys

import pytest
import torch
from fake_wandb import FakeWandb

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


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("tty", [True, False])
def test_progress_bar_draws_only_on_a_terminal_and_respects_env(monkeypatch, tty):
    stderr = _Terminal() if tty else io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    monkeypatch.setenv("DIFFUSION_RL_NO_PROGRESS", "1")
    with progress(10, "train") as bar:
        assert bar.disable
    monkeypatch.delenv("DIFFUSION_RL_NO_PROGRESS")
    with progress(10, "train") as bar:
        assert bar.disable is not tty and bar.total == 10
        for _ in range(10):
            bar.update(1)
    # a log file (not a TTY) gets no carriage-return redraws at all
    assert ("\r" in stderr.getvalue()) is tty
    assert ("train" in stderr.getvalue()) is tty


# ----------------------------------------------------------------------------- resume logs
def write_lines(path, steps):
    path.write_text(
        "".join(json.dumps({"step": s, "time": 0.0, "loss": s / 10}) + "\n" for s in steps)
    )


def test_truncate_metrics_keeps_the_lines_of_the_restored_state(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert loggers.truncate_metrics(path, 3) == 0  # absent: nothing to do
    write_lines(path, [1, 2, 3, 3, 4, 5])  # line 4: an eval line of step 3
    assert loggers.truncate_metrics(path, 4) == 2
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3, 3]
    assert loggers.truncate_metrics(path, 4) == 0 and loggers.truncate_metrics(path, 9) == 0
    # no recorded count: keep the lines up to the checkpoint's step
    write_lines(path, [1, 2, 3, 4, 5, 4, 5])
    assert loggers.truncate_metrics(path, through_step=3) == 4
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3]
    # a line cut short by a kill is removed, whatever the count says
    write_lines(path, [1, 2])
    with open(path, "a") as handle:
        handle.write('{"step": 3, "lo')
    assert loggers.truncate_metrics(path, 5) == 1
    assert path.read_text().count("\n") == 2 and path.read_text().endswith("}\n")
    assert loggers.truncate_metrics(path, 0) == 2 and path.read_text() == ""
    assert not list(tmp_path.glob(".metrics.jsonl.tmp-*"))  # the atomic rewrite cleaned up
    with pytest.raises(TypeError, match="keep_lines or through_step"):
        loggers.truncate_metrics(path)
    with pytest.raises(ValueError, match="keep_lines"):
        loggers.truncate_metrics(path, -1)


def test_logger_counts_lines_and_refuses_a_metric_twice_per_step(tmp_path):
    write_lines(tmp_path / "metrics.jsonl", [1, 2])
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        assert log.lines == 2
        log.log(3, {"loss": 0.1})
        log.log(3, {"eval/accuracy": 0.5})  # another metric of the same step: fine
        with pytest.raises(ValueError, match=r"metric 'loss': logged twice for step 3"):
            log.log(3, {"loss": 0.2, "lr": 1.0})
        log.log(4, {"loss": 0.3})  # a new step: every name is free again
        assert log.lines == 5
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 3, 4]  # the refused call wrote nothing


def _png(path, color):
    from PIL import Image

    Image.new("RGB", (6, 4), color).save(path)
    return path


def test_tensorboard_resume_purges_later_steps_and_gets_images(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path) as log:
        for step in range(1, 6):
            log.log(step, {"loss": float(step)})
        log.log_images(5, {"eval/samples": _png(tmp_path / "a.png", (255, 0, 0))})
    with MetricsLogger(tmp_path, purge_step=4) as log:  # resumed from the step-3 checkpoint
        for step in range(4, 7):
            log.log(step, {"loss": 10.0 * step})
        log.log_images(6, {"eval/samples": _png(tmp_path / "b.png", (0, 0, 255))})
        with pytest.raises(ValueError, match="'eval/samples': logged twice for step 6"):
            log.log_images(6, {"eval/samples": tmp_path / "b.png"})
        with pytest.raises(FileNotFoundError, match="missing.png"):
            log.log_images(7, {"eval/samples": tmp_path / "missing.png"})
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = [(e.step, e.value) for e in events.Scalars("loss")]
    assert scalars == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0), (6, 60.0)]
    images = events.Images("eval/samples")
    assert [(i.step, i.width, i.height) for i in images] == [(6, 6, 4)]  # step 5's was purged


def test_wandb_logger_is_lazy_resume_safe_and_gets_scalars_and_images(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    with pytest.raises(ImportError, match="pip install wandb"):
        loggers.WandbLogger("proj", tmp_path, {"steps": 3})
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    grid = _png(tmp_path / "g.png", (0, 255, 0))
    run = loggers.WandbLogger("proj", tmp_path, {"steps": 3, "optim": {"lr": 0.1}})
    with MetricsLogger(tmp_path, tensorboard=False, wandb=run) as log:
        log.log(1, {"loss": 0.5, "grad_norm": math.inf})
        log.log_images(1, {"eval/samples": grid})
    assert fake.finished == 1  # closed with the metrics logger
    assert fake.logged == [
        (1, {"loss": 0.5, "grad_norm": math.inf}),
        (1, {"eval/samples": FakeWandb.Image(str(grid))}),
    ]
    first = fake.inits[0]
    assert first["project"] == "proj" and first["resume"] == "allow"
    assert first["config"] == {"steps": 3, "optim": {"lr": 0.1}} and first["dir"] == str(tmp_path)
    # a resumed run continues the same wandb run
    loggers.WandbLogger("proj", tmp_path, {"steps": 3}).close()
    assert fake.inits[1]["id"] == first["id"] == (tmp_path / "wandb_run_id").read_text().strip()
    assert len(first["id"]) == 12
