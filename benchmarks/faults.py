"""kill -9 fault suite of the run loop, as JSON.

A tiny SFT run (``diffusion-rl sft`` through :func:`diffusion_rl.cli.main`) is killed with
SIGKILL again and again, then rerun until it finishes; its final model directory (every file,
byte for byte), its ``results.json`` (everything but the time and the paths) and its
``metrics.jsonl`` (every line but the time) must equal those of a straight run. Kills land

* at random moments (seeded: uniform over the part of a straight run's measured length that
  is left, by the newest checkpoint, counted from the moment the attempt starts running), and
* inside writes: the driver counts every file write, fsync and rename of the checkpoint
  writer (``diffusion_rl.train.checkpoint``), of the final save (the model directory's
  staging and renames) and of atomic rewrites (``results.json``, ``metrics.jsonl``), and
  kills itself at the N-th one (drawn over what is left of the run; in every other trial,
  one attempt dies inside the final save); a file write is cut in the middle (half its
  bytes on disk) before the kill.

    python benchmarks/faults.py [--kills 24] [--seed 0] [--output faults.json]

Prints ``{"kills": ..., "inside_checkpoint_writes": ..., "inside_final_save": ...,
"inside_results_or_log_rewrites": ..., "random_moments": ..., "trials": ...,
"all_equal": true, ...}``. The same harness runs a
few kills in ``tests/test_run_faults.py`` (there the attempts are forked, not spawned, to
keep the test suite fast). ``--drive CONFIG`` is the driver the attempts run.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("DIFFUSION_RL_NO_PROGRESS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TINY_SFT = {
    "model": {"d_model": 16, "n_layers": 1, "n_heads": 2},
    "task": {"num_digits": 2},
    "threads": 1,
    "steps": 12,
    "batch_size": 8,
    "eval_every": 4,
    "eval_examples": 8,
    "checkpoint_every": 2,
    "keep_last": 2,
    "log_every": 1,
}
KILLED = -signal.SIGKILL
KINDS = ("checkpoint", "final save", "results or log rewrite")
_VOLATILE_RESULTS = ("elapsed_s", "model_dir", "curves_png")


# ----------------------------------------------------------------------------- the driver
class _Writes:
    """Counts the write events of checkpoints, of the final save and of atomic file rewrites
    (``results.json``, ``metrics.jsonl``); kills this process with SIGKILL at event
    ``die_at`` (counted among the events of kind ``only``, when given); a file write is cut
    in the middle first."""

    def __init__(self, die_at: int | None, log: Path | None, only: str | None = None) -> None:
        self.die_at, self.log, self.only = die_at, log, only
        self.counts: dict[str, int] = {kind: 0 for kind in KINDS}

    @property
    def count(self) -> int:
        return sum(self.counts.values())

    def event(self, where: str, what: str) -> bool:
        self.counts[where] += 1
        number = self.counts[where] if self.only else self.count
        if self.die_at is None or number != self.die_at or self.only not in (None, where):
            return False
        if self.log is not None:
            with open(self.log, "a", encoding="utf-8") as handle:
                handle.write(json.dumps({"event": number, "where": where, "what": what}) + "\n")
        return True

    @staticmethod
    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # never reached: SIGKILL cannot be caught


class _OsProxy:
    """``os`` for one module, with ``rename`` / ``replace`` counted as write events."""

    def __init__(self, writes: _Writes, where: str) -> None:
        self._writes, self._where = writes, where

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def rename(self, src, dst) -> None:
        if self._writes.event(self._where, f"rename {Path(dst).name}"):
            self._writes.die()
        os.rename(src, dst)

    def replace(self, src, dst) -> None:
        if self._writes.event(self._where, f"replace {Path(dst).name}"):
            self._writes.die()
        os.replace(src, dst)


def arm(
    die_at: int | None, log: Path | None = None, patch=setattr, only: str | None = None
) -> _Writes:
    """Install the write-event hooks in this process (``patch(obj, name, value)``: e.g. a
    pytest ``monkeypatch.setattr`` to undo them); returns the counter."""
    import safetensors.torch

    from diffusion_rl.recipes import run as run_module
    from diffusion_rl.train import checkpoint, loggers

    writes = _Writes(die_at, log, only)

    real_write = checkpoint._write_file

    def write_file(path, write):
        if writes.event("checkpoint", f"write {Path(path).name}"):
            buffer = io.BytesIO()
            write(buffer)
            data = buffer.getvalue()
            with open(path, "wb") as handle:  # a torn write: half of it reached the disk
                handle.write(data[: len(data) // 2])
            writes.die()
        return real_write(path, write)

    patch(checkpoint, "_write_file", write_file)
    for name in ("_fsync_file", "_fsync_dir"):
        real = getattr(checkpoint, name)

        def fsync(path, _real=real, _name=name):
            if writes.event("checkpoint", f"{_name} {Path(path).name}"):
                writes.die()
            return _real(path)

        patch(checkpoint, name, fsync)
    real_save = safetensors.torch.save_model

    def save_model(model, filename, *args, **kwargs):
        result = real_save(model, filename, *args, **kwargs)
        where = "checkpoint" if f"{os.sep}checkpoints{os.sep}" in str(filename) else "final save"
        if writes.event(where, f"write {Path(filename).name}"):
            size = os.path.getsize(filename)
            os.truncate(filename, size // 2)
            writes.die()
        return result

    patch(safetensors.torch, "save_model", save_model)
    real_tree, real_directory = run_module._fsync_tree, run_module.fsync_directory

    def fsync_tree(root):  # the staged model directory is complete: tear its weights
        if writes.event("final save", f"fsync staging {Path(root).name}"):
            weights = sorted(Path(root).rglob("*.safetensors"))[0]
            os.truncate(weights, weights.stat().st_size // 2)
            writes.die()
        return real_tree(root)

    def fsync_directory(path):
        if writes.event("final save", f"fsync_directory {Path(path).name}"):
            writes.die()
        return real_directory(path)

    patch(run_module, "_fsync_tree", fsync_tree)
    patch(run_module, "fsync_directory", fsync_directory)
    patch(checkpoint, "os", _OsProxy(writes, "checkpoint"))
    patch(run_module, "os", _OsProxy(writes, "final save"))
    patch(loggers, "os", _OsProxy(writes, "results or log rewrite"))
    return writes


def drive(
    config_path: str,
    die_at: int | None = None,
    *,
    slow: float = 0.0,
    started: str | None = None,
    log: str | None = None,
    count: str | None = None,
    only: str | None = None,
) -> int:
    """One attempt: ``diffusion-rl sft --config CONFIG`` with the hooks armed (die at write
    event ``die_at``, of kind ``only`` when given). ``slow``: seconds of sleep added to every
    trainer step; ``started``: a file touched when the run begins; ``count``: a file that gets
    the write events per kind, as JSON, at the end."""
    from diffusion_rl import cli
    from diffusion_rl.train import Trainer

    writes = arm(die_at, Path(log) if log else None, only=only)
    if slow:
        real_step = Trainer.train_step

        def slow_step(self, *args, **kwargs):
            time.sleep(slow)
            return real_step(self, *args, **kwargs)

        Trainer.train_step = slow_step
    if started:
        Path(started).touch()
    rc = cli.main(["sft", "--config", config_path])
    if count:
        Path(count).write_text(json.dumps(writes.counts) + "\n")
    return rc


# ----------------------------------------------------------------------------- the harness
def write_config(out: Path, **extra: Any) -> Path:
    """The tiny SFT config with ``output_dir = out``, as a YAML (JSON) file beside ``out``."""
    path = out.with_name(out.name + ".json")
    path.write_text(json.dumps({**TINY_SFT, "output_dir": str(out), **extra}))
    return path


def spawn(config: Path, die_at: int | None, started: Path, log=None, only=None):
    """An attempt in a fresh interpreter (the CLI as a user runs it)."""
    command = [sys.executable, __file__, "--drive", str(config), "--started", str(started)]
    if die_at is not None:
        command += ["--die-at", str(die_at)]
    if only is not None:
        command += ["--only", only]
    if log is not None:
        command += ["--log", str(log)]
    with open(started.with_suffix(".out"), "w") as output:  # the attempt's stdout and stderr
        return subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)


def outcome(out: Path) -> dict[str, Any]:
    """What must not depend on kills: model files, results (no time or paths), log lines."""
    results = json.loads((out / "results.json").read_text())
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {
        "model": {p.name: p.read_bytes() for p in sorted((out / "model").iterdir())},
        "results": {k: v for k, v in results.items() if k not in _VOLATILE_RESULTS},
        "metrics": [{k: v for k, v in line.items() if k != "time"} for line in lines],
    }


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    problems = []
    if a["model"] != b["model"]:
        names = sorted(
            n
            for n in a["model"].keys() | b["model"].keys()
            if a["model"].get(n) != b["model"].get(n)
        )
        problems.append(f"model files differ: {names}")
    if a["results"]["history"] != b["results"]["history"]:
        problems.append("results.json history differs")
    others = [k for k in a["results"].keys() | b["results"].keys() if k != "history"]
    changed = sorted(k for k in others if a["results"].get(k) != b["results"].get(k))
    if changed:
        problems.append(f"results.json differs in {changed}")
    steps = [line["step"] for line in b["metrics"] if "loss" in line]
    if steps != sorted(set(steps)):
        problems.append(f"metrics.jsonl steps not once each: {steps}")
    if a["metrics"] != b["metrics"]:
        problems.append("metrics.jsonl lines differ")
    return problems


def _wait_started(started: Path, proc, limit: float = 300.0) -> None:
    deadline = time.monotonic() + limit
    while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)


def _left(out: Path, steps: int) -> float:
    """The fraction of the run still to do, by its newest checkpoint's step."""
    done = [int(p.name.removeprefix("step_")) for p in (out / "checkpoints").glob("step_*")]
    return 1.0 - max(done, default=0) / steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=24, help="SIGKILLs to land (default 24)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", help="also write the JSON here")
    parser.add_argument("--drive", help=argparse.SUPPRESS)
    parser.add_argument("--die-at", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--started", help=argparse.SUPPRESS)
    parser.add_argument("--log", help=argparse.SUPPRESS)
    parser.add_argument("--count", help=argparse.SUPPRESS)
    parser.add_argument("--only", choices=KINDS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.drive:
        options = {"started": args.started, "log": args.log, "count": args.count}
        return drive(args.drive, args.die_at, only=args.only, **options)

    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="faults-"))
    # the straight run, in a fresh interpreter too: its length and its count of write events
    straight_dir, started, count = root / "straight", root / "straight.started", root / "count"
    command = [sys.executable, __file__, "--drive", str(write_config(straight_dir))]
    rc = subprocess.call(command + ["--started", str(started), "--count", str(count)])
    if rc != 0:
        raise SystemExit(f"the straight run failed (exit {rc})")
    length = count.stat().st_mtime - started.stat().st_mtime  # from `started` to the end
    counts = json.loads(count.read_text())
    events = sum(counts.values())
    reference = outcome(straight_dir)
    steps = TINY_SFT["steps"]

    kills = {"random": 0, **{kind: 0 for kind in KINDS}}
    where: list[str] = []
    trials, problems, attempts = 0, [], 0
    while sum(kills.values()) < args.kills:
        trials += 1
        out = root / f"trial_{trials:02d}"
        config, log = write_config(out), root / f"trial_{trials:02d}.kills"
        for attempt in range(4):  # up to 4 kills per trial (alternating kinds), then a finish
            if (out / "results.json").exists():
                break
            left = _left(out, steps)
            started = root / f"trial_{trials:02d}.{attempt}.started"
            by_write = attempt % 2 == trials % 2
            only = "final save" if by_write and attempt == 3 else None
            if only:  # one of the final save's events
                die_at = rng.randint(1, counts[only])
            elif by_write:  # a write event of what is left of the run
                die_at = rng.randint(1, int(events * left) + 6)
            else:
                die_at = None
            proc = spawn(config, die_at, started, log, only)
            attempts += 1
            if not by_write:
                _wait_started(started, proc)
                time.sleep(rng.uniform(0.0, length * (0.2 + 0.8 * left)))
                if proc.poll() is None:
                    proc.kill()
            rc = proc.wait()
            if rc == KILLED:
                if by_write:
                    kill = json.loads(log.read_text().splitlines()[-1])
                    kills[kill["where"]] += 1
                    where.append(re.sub(r"step_\d+|-[0-9a-f]{8}\b", "", kill["what"]))
                else:
                    kills["random"] += 1
            elif rc != 0:
                problems.append(f"trial {trials}: attempt {attempt} exited {rc}")
        while not (out / "results.json").exists():  # rerun until finished
            started = root / f"trial_{trials:02d}.rerun.started"
            proc = spawn(config, None, started)
            attempts += 1
            if proc.wait() != 0:
                said = started.with_suffix(".out").read_text().strip().splitlines()
                problems.append(f"trial {trials}: a clean rerun failed: {said[-1:]}")
                break
        else:
            problems += [f"trial {trials}: {p}" for p in differences(reference, outcome(out))]
    report = {
        "kills": sum(kills.values()),
        "inside_checkpoint_writes": kills["checkpoint"],
        "inside_final_save": kills["final save"],
        "inside_results_or_log_rewrites": kills["results or log rewrite"],
        "random_moments": kills["random"],
        "write_kill_points": sorted(set(where)),
        "trials": trials,
        "attempts": attempts,
        "write_events_per_run": counts,
        "straight_run_s": round(length, 2),
        "models_equal": not any("model files" in p for p in problems),
        "histories_equal": not any("history" in p for p in problems),
        "metrics_each_step_once": not any("metrics.jsonl" in p for p in problems),
        "all_equal": not problems,
        "problems": problems,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
