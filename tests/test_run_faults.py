"""Faults of a run, each with its exact outcome: kill -9 at random moments and inside
checkpoint writes (the rerun ends bitwise equal to a straight run, each step logged once),
Ctrl-C and SIGTERM (a checkpoint of the current step, exit 130 / 143, the rerun resumes from
it; a second signal stops at once), a full disk in the final model write, a finished run
resumed (nothing changes), NaN in one micro-batch (skipped, counted, state untouched), runs
that diverge (a non-zero exit, nothing saved).

The attempts that get killed are forked children running the driver of
``benchmarks/faults.py`` (that file's ``main`` is the ≥ 20-kill version); reruns run here.
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from diffusion_rl import cli
from diffusion_rl.config import SFTRecipeConfig, build_config
from diffusion_rl.contracts import LossOutput, WeightedMetric
from diffusion_rl.objectives import MaskedDiffusionSFT
from diffusion_rl.recipes.run import (
    NonFiniteParametersError,
    RunInterrupted,
    TooManySkippedStepsError,
    run,
)
from diffusion_rl.recipes.sft import SFTRecipe, run_sft
from diffusion_rl.train import CheckpointManager

_spec = importlib.util.spec_from_file_location(
    "faults", Path(__file__).parents[1] / "benchmarks" / "faults.py"
)
faults = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(faults)

QUIET = {"echo": lambda _: None}


def config_of(path: Path) -> SFTRecipeConfig:
    return build_config(SFTRecipeConfig, json.loads(path.read_text()))


@dataclass
class Straight:
    out: Path
    outcome: dict
    events: int  # write events (checkpoint and final-save I/O) of a fresh run


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Straight:
    out = tmp_path_factory.mktemp("faults") / "straight"
    with pytest.MonkeyPatch.context() as patch:
        writes = faults.arm(None, patch=patch.setattr)  # count only
        run_sft(config_of(faults.write_config(out)), **QUIET)
    return Straight(out, faults.outcome(out), writes.count)


def _child(config: str, die_at, slow: float, started, log, stdout: str) -> None:
    # Ctrl-C as a terminal delivers it: a test runner started in the background by a
    # non-interactive shell inherits SIGINT ignored, which the run loop (rightly) respects
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.stdout = sys.stderr = open(stdout, "a", buffering=1)  # noqa: SIM115
    try:
        rc = faults.drive(config, die_at, slow=slow, started=started, log=log)
    finally:
        sys.stdout.flush()
    os._exit(rc)


def attempt(config: Path, *, die_at=None, slow=0.0, log=None) -> multiprocessing.Process:
    """A forked attempt at the run (the driver: ``diffusion-rl sft --config``)."""
    base = str(config.with_suffix(""))
    Path(f"{base}.started").unlink(missing_ok=True)
    args = (str(config), die_at, slow, f"{base}.started", log and str(log), f"{base}.out")
    proc = multiprocessing.get_context("fork").Process(target=_child, args=args)
    proc.start()
    return proc


def wait_for(condition, proc, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        assert proc.is_alive(), f"the attempt ended early (exit {proc.exitcode})"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def loss_steps(out: Path) -> list[int]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines) if "loss" in r]


def leftovers(out: Path) -> list[str]:
    hidden = [p.name for p in out.iterdir() if p.name.startswith(".")]
    return hidden + [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]


# ----------------------------------------------------------------------------- kill -9
def test_kill_9_inside_a_checkpoint_write_and_at_a_random_moment_resume_bitwise(straight, tmp_path):
    rng = random.Random(12)
    out = tmp_path / "killed"
    config, log = faults.write_config(out), tmp_path / "kills.log"
    # 1. inside a checkpoint write: the first half of a fresh run's write events are all
    # checkpoint I/O (file writes, cut in the middle; fsyncs; renames)
    die_at = rng.randint(straight.events // 4, straight.events // 2)
    proc = attempt(config, die_at=die_at, log=log)
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL
    kill = json.loads(log.read_text().splitlines()[-1])
    assert kill["event"] == die_at and kill["where"] == "checkpoint"
    # 2. at a random moment of the resumed attempt (it takes > 1.5 s: 0.15 s per step)
    proc = attempt(config, slow=0.15)
    wait_for(Path(f"{tmp_path}/killed.started").exists, proc)
    time.sleep(rng.uniform(0.3, 1.0))
    assert proc.is_alive()
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL
    # 3. the rerun finishes here
    said = []
    run_sft(config_of(config), echo=said.append)
    assert any(line.startswith("resumed from ") for line in said)
    assert faults.differences(straight.outcome, faults.outcome(out)) == []
    assert loss_steps(out) == list(range(1, 13))  # each step once
    assert leftovers(out) == []


# ----------------------------------------------------------------------------- Ctrl-C
def test_ctrl_c_checkpoints_the_current_step_and_the_rerun_resumes_from_it(straight, tmp_path):
    out = tmp_path / "interrupted"
    config = faults.write_config(out, checkpoint_every=1000)  # no periodic checkpoint
    proc = attempt(config, slow=0.1)
    metrics = out / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and '"loss"' in metrics.read_text(), proc)  # step 1 logged
    os.kill(proc.pid, signal.SIGINT)
    proc.join(60)
    assert proc.exitcode == 130
    [checkpoint] = CheckpointManager(out / "checkpoints").checkpoints()
    step = int(checkpoint.name.removeprefix("step_"))
    assert 1 <= step < 12 and loss_steps(out) == list(range(1, step + 1))
    said = (tmp_path / "interrupted.out").read_text()
    assert f"interrupted: checkpoint of step {step} written to {checkpoint}" in said
    assert "diffusion-rl sft: interrupted" in said  # the CLI's line, exit status 130
    lines = []
    run_sft(config_of(config), echo=lines.append)
    assert f"resumed from {checkpoint} at step {step}" in lines
    assert faults.differences(straight.outcome, faults.outcome(out)) == []


# ----------------------------------------------------------------------------- SIGTERM
# A cluster pre-empts a job with SIGTERM and kills it a grace period later. The attempts
# below are real `python -m diffusion_rl sft` processes (the CLI's own entry point); a
# sitecustomize on their PYTHONPATH only makes each trainer step sleep, so that the signal
# lands while the run is going.
_SLOW_STEPS = """
import os, time
from diffusion_rl.train import Trainer
_real, _slow = Trainer.train_step, float(os.environ["SLOW_STEP_S"])
def _slow_step(self, *args, **kwargs):
    time.sleep(_slow)
    return _real(self, *args, **kwargs)
Trainer.train_step = _slow_step
"""


def sft_process(config: Path, slow: float) -> subprocess.Popen:
    hook = config.parent / "slow_steps"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(_SLOW_STEPS)
    src = str(Path(__file__).parents[1] / "src")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(hook), src, os.environ.get("PYTHONPATH", "")]),
        "SLOW_STEP_S": str(slow),
        "DIFFUSION_RL_NO_PROGRESS": "1",
    }

    def default_signals() -> None:  # not inherited as ignored from a background shell
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_DFL)

    command = [sys.executable, "-m", "diffusion_rl", "sft", "--config", str(config)]
    return subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_signals,  # noqa: PLW1509 (single-threaded here)
    )


def wait_for_step(out: Path, proc: subprocess.Popen, step: int, limit: float = 120.0) -> None:
    deadline = time.monotonic() + limit
    while True:
        assert proc.poll() is None, f"the run ended early: {proc.communicate()}"
        assert time.monotonic() < deadline, "timed out waiting for the run"
        if (out / "metrics.jsonl").exists() and len(loss_steps(out)) >= step:
            return
        time.sleep(0.01)


def test_sigterm_checkpoints_the_current_step_exits_143_and_the_rerun_resumes_bitwise(
    straight, tmp_path
):
    out = tmp_path / "preempted"
    config = faults.write_config(out, checkpoint_every=1000)  # no periodic checkpoint
    proc = sft_process(config, slow=0.1)
    wait_for_step(out, proc, 1)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, (stdout, stderr)
    [checkpoint] = CheckpointManager(out / "checkpoints").checkpoints()
    step = int(checkpoint.name.removeprefix("step_"))
    assert 1 <= step < 12 and loss_steps(out) == list(range(1, step + 1))
    lines = stderr.strip().splitlines()
    assert lines[-1] == (
        f"diffusion-rl sft: interrupted (SIGTERM): checkpoint of step {step} written to "
        f"{checkpoint}; run the same command again to resume from it"
    )
    assert lines[-2] == (
        "SIGTERM: finishing the current step, then writing a checkpoint (a second signal "
        "stops at once, without it)"
    )
    assert "Traceback" not in stderr and "interrupted" not in stdout  # said once
    said = []
    run_sft(config_of(config), echo=said.append)
    assert f"resumed from {checkpoint} at step {step}" in said
    assert faults.differences(straight.outcome, faults.outcome(out)) == []


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_stops_at_once_saving_nothing_of_the_step(straight, tmp_path, second):
    out = tmp_path / "stopped"
    config = faults.write_config(out)  # a checkpoint every 2 steps
    proc = sft_process(config, slow=2.0)  # both signals land inside step 4's 2 s sleep
    wait_for_step(out, proc, 3)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    proc.send_signal(second)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + second, (stdout, stderr)
    # at once: step 4 was cut short, neither logged nor checkpointed
    last = out / "checkpoints" / "step_00000002"
    assert CheckpointManager(out / "checkpoints").checkpoints()[-1] == last
    assert loss_steps(out) == [1, 2, 3]
    by = "" if second == signal.SIGINT else " (SIGTERM)"
    assert stderr.strip().splitlines()[-1] == (
        f"diffusion-rl sft: interrupted{by} during step 4: nothing of it was saved; the last "
        f"checkpoint, {last}, is intact"
    )
    assert "Traceback" not in stderr
    run_sft(config_of(config), **QUIET)
    assert faults.differences(straight.outcome, faults.outcome(out)) == []


# ----------------------------------------------------------------------------- disk full
def test_a_full_disk_in_the_final_model_write_is_one_line_and_the_rerun_finishes(
    straight, tmp_path, monkeypatch, capsys
):
    """safetensors reports a full disk as its own SafetensorError (not an OSError): the
    final `model/model.safetensors` write fails with it, and the CLI says so in one line
    (status 1); the checkpoint of the last step is intact and the rerun writes the model."""
    import safetensors

    from diffusion_rl.models import transformer

    real = transformer.save_model  # what DiffusionTransformer.save_pretrained writes with

    def full(model, filename, *args, **kwargs):
        if f"{os.sep}checkpoints{os.sep}" not in str(filename):  # the final model only
            Path(filename).write_bytes(b"\0" * 10)  # a torn file, as a full disk leaves
            raise safetensors.SafetensorError(
                "Error while serializing: I/O error: No space left on device (os error 28)"
            )
        return real(model, filename, *args, **kwargs)

    out = tmp_path / "full"
    config = faults.write_config(out)
    monkeypatch.setattr(transformer, "save_model", full)
    assert cli.main(["sft", "--config", str(config)]) == 1
    monkeypatch.undo()
    err = capsys.readouterr().err
    last = out / "checkpoints" / "step_00000012"
    assert err.splitlines() == [
        f"diffusion-rl sft: error: [Errno 28] disk full while writing the final model to "
        f"{out / 'model'} (SafetensorError: Error while serializing: I/O error: No space left "
        f"on device (os error 28)); the checkpoint of the last step, {last}, is intact: free "
        "space on that disk, then run the same command again to write the model"
    ]
    assert not (out / "model").exists() and not (out / "results.json").exists()
    assert leftovers(out) == []
    assert cli.main(["sft", "--config", str(config)]) == 0
    assert faults.differences(straight.outcome, faults.outcome(out)) == []


def test_an_interrupt_inside_a_step_saves_nothing_of_it(tmp_path, monkeypatch):
    real = MaskedDiffusionSFT.__call__
    calls = []

    def interrupted(self, model, batch, generator):
        calls.append(1)
        if len(calls) == 4:  # one micro-batch a step: inside step 4
            raise KeyboardInterrupt
        return real(self, model, batch, generator)

    monkeypatch.setattr(MaskedDiffusionSFT, "__call__", interrupted)
    out = tmp_path / "run"
    with pytest.raises(RunInterrupted) as info:
        run_sft(config_of(faults.write_config(out)), **QUIET)
    last = out / "checkpoints" / "step_00000002"
    assert str(info.value) == (
        f"interrupted during step 4: nothing of it was saved; the last checkpoint, {last}, "
        "is intact"
    )
    assert CheckpointManager(out / "checkpoints").checkpoints() == [last]


def test_a_run_interrupted_before_its_first_checkpoint_starts_over_cleanly(
    straight, tmp_path, monkeypatch
):
    real = MaskedDiffusionSFT.__call__
    calls = []

    def interrupted(self, model, batch, generator):
        calls.append(1)
        if len(calls) == 2:  # inside step 2: step 1 is logged, no checkpoint exists
            raise KeyboardInterrupt
        return real(self, model, batch, generator)

    out = tmp_path / "run"
    config = config_of(faults.write_config(out))
    with monkeypatch.context() as patch:
        patch.setattr(MaskedDiffusionSFT, "__call__", interrupted)
        with pytest.raises(RunInterrupted, match="no checkpoint was written yet, so a rerun"):
            run_sft(config, **QUIET)
    assert loss_steps(out) == [1]
    run_sft(config, **QUIET)
    assert faults.differences(straight.outcome, faults.outcome(out)) == []  # step 1 once
    if (out / "tensorboard").exists():  # the void attempt's events are gone: one stream
        assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 1


# ----------------------------------------------------------------------------- finished
def test_resuming_a_finished_run_changes_nothing(straight, tmp_path):
    out = tmp_path / "again"
    shutil.copytree(straight.out, out)
    results = out / "results.json"
    text = json.loads(results.read_text())
    text["model_dir"] = str(out / "model")  # the copy's own paths, as its run would write
    results.write_text(json.dumps(text, indent=2) + "\n")

    def snapshot():
        return {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}

    before = snapshot()
    said = []
    again = run_sft(config_of(faults.write_config(out)), echo=said.append)
    assert snapshot() == before  # results.json, metrics.jsonl, model, TensorBoard: untouched
    assert again == json.loads(results.read_text())
    assert said == [
        f"already finished: {out} holds a complete run of 12 steps; results in {results}, "
        f"model in {out / 'model'} (nothing was changed)"
    ]


# ----------------------------------------------------------------------------- non-finite
def poisoned(where, counter: list[int]):
    """``MaskedDiffusionSFT.__call__`` whose loss is NaN when ``where(step, micro_batch)``;
    ``counter`` holds the (trainer step, micro-batch) of the next call."""
    real = MaskedDiffusionSFT.__call__

    def call(self, model, batch, generator):
        out = real(self, model, batch, generator)
        step, micro = counter
        counter[1] += 1
        if not where(step, micro):
            return out
        nan_sum = out.primary.sum * float("nan")
        return LossOutput(WeightedMetric(nan_sum, out.primary.denominator), out.aux_metrics)

    return call


def state_of(trainer) -> dict:
    return {
        "params": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
        "optimizer": torch.optim.Optimizer.state_dict(trainer.optimizer),
        "scheduler": dict(trainer.scheduler.state_dict()),
    }


def assert_bitwise(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_bitwise(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_bitwise(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("micro", [0, 1])
def test_nan_in_one_micro_batch_skips_the_step_bitwise_and_counts_it(tmp_path, micro, monkeypatch):
    counter = [0, 0]  # (trainer step, micro-batch) of the next loss call
    poison = poisoned(lambda s, m: (s, m) == (2, micro), counter)
    monkeypatch.setattr(MaskedDiffusionSFT, "__call__", poison)
    seen = {}

    def build(config):
        recipe = SFTRecipe(config)
        real_step = recipe.trainer.train_step

        def step(micro_batches, loss_fn=None):
            counter[:] = [recipe.trainer.global_step, 0]
            before = state_of(recipe.trainer) if counter[0] == 2 else None
            result = real_step(micro_batches, loss_fn)
            if before is not None:
                seen.update(before=before, after=state_of(recipe.trainer), result=result)
            return result

        recipe.trainer.train_step = step
        return recipe

    extra = {"steps": 4, "micro_batch_size": 4, "eval_every": 100, "checkpoint_every": 100}
    out = tmp_path / "run"
    config = config_of(faults.write_config(out, **extra))
    said = []
    results = run(config, build, echo=said.append)
    assert not seen["result"].applied
    assert_bitwise(seen["after"], seen["before"])  # parameters, optimizer and schedule
    assert results["steps"] == 4
    assert (results["skipped_nonfinite"], results["skipped_zero_weight"]) == (1, 0)
    saved = json.loads((tmp_path / "run" / "results.json").read_text())
    assert saved["skipped_nonfinite"] == 1
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step3 = next(r for r in lines if r["step"] == 3 and "loss" in r)
    assert step3["loss"] is None and step3["skipped_nonfinite"] == 1.0
    assert said[-1] == (
        "note: trainer steps skipped without an update: 1 for a non-finite loss or gradient, "
        f"0 for zero loss weight (skipped_nonfinite, skipped_zero_weight in {out / 'results.json'})"
    )


@pytest.mark.parametrize("limit", [0, 2])
def test_consecutive_non_finite_skips_abort_with_a_non_zero_exit(
    tmp_path, limit, capsys, monkeypatch
):
    monkeypatch.setattr(MaskedDiffusionSFT, "__call__", poisoned(lambda s, m: True, [0, 0]))
    out = tmp_path / "run"
    config = faults.write_config(out, max_consecutive_skips=limit, checkpoint_every=2)
    assert cli.main(["sft", "--config", str(config)]) == 1
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and error.startswith(f"diffusion-rl sft: error: step {limit + 1}: ")
    assert f"skipped in a row for a non-finite loss or gradient: {limit + 1} " in error
    assert f"(max_consecutive_skips: {limit})" in error and "lower optim.lr (now 0.002)" in error
    assert not (out / "model").exists() and not (out / "results.json").exists()
    saved = [p.name for p in CheckpointManager(out / "checkpoints").checkpoints()]
    assert saved == (["step_00000002"] if limit == 2 else [])  # none for the failing step


def test_non_finite_parameters_abort_naming_the_parameter_and_save_nothing(tmp_path):
    out = tmp_path / "run"
    poisoned_names = []

    def build(config):
        recipe = SFTRecipe(config)
        real_step = recipe.trainer.train_step

        def step(micro_batches, loss_fn=None):
            result = real_step(micro_batches, loss_fn)
            if recipe.trainer.global_step == 3:  # the update of step 3 "overflows"
                name, param = list(recipe.model.named_parameters())[-1]
                poisoned_names.append(name)
                with torch.no_grad():
                    param.view(-1)[:5] = float("inf")
            return result

        recipe.trainer.train_step = step
        return recipe

    config = config_of(faults.write_config(out, checkpoint_every=1))
    with pytest.raises(NonFiniteParametersError) as info:
        run(config, build, **QUIET)
    message = str(info.value)
    [name] = poisoned_names
    assert message.startswith(f"step 3: parameter {name!r} has 5 non-finite values (of ")
    assert "lower optim.lr (now 0.002) or set optim.grad_clip" in message
    assert f"the last checkpoint, {out / 'checkpoints' / 'step_00000002'}, is intact" in message
    assert isinstance(info.value, ValueError)  # the CLI reports it in one line
    assert not (out / "model").exists() and not (out / "results.json").exists()
    saved = [p.name for p in CheckpointManager(out / "checkpoints").checkpoints()]
    assert saved[-1] == "step_00000002"


def test_a_huge_learning_rate_aborts_with_a_non_zero_exit_and_no_model(tmp_path, capsys):
    out = tmp_path / "run"
    config = faults.write_config(out, optim={"lr": 1e9})
    assert cli.main(["sft", "--config", str(config)]) == 1
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "lower optim.lr (now 1e+09)" in error
    assert not (out / "model").exists() and not (out / "results.json").exists()
    with pytest.raises((TooManySkippedStepsError, NonFiniteParametersError)):
        run_sft(config_of(faults.write_config(tmp_path / "again", optim={"lr": 1e9})), **QUIET)
