"""The quickstart over seeds: what a fresh clone prints, its spread, and the RL reference curve.

Runs ``diffusion-rl quickstart --mode MODE --seed S`` (one thread, defaults otherwise) for
each mode and seed, ``--jobs`` processes at a time, and appends one JSON line per finished
unit to ``--results`` (``benchmarks/results/quickstart.jsonl``): wall and CPU seconds of the
whole command (the child's own rusage), the RL stage's held-out headline before and after,
the gain in points, the measure the run does not train on before and after, and the RL
stage's held-out curve (step, headline) from its evaluations. A unit already in the file
with the same ``settings`` (a digest of the mode's constants in ``quickstart.py`` and the
extra ``--set`` flags) is skipped, so a rerun finishes what a stopped one left.

The headline and the untrained measure per mode:

* ``text``: held-out accuracy (exact Sudoku solutions, greedy); untrained: the fraction of
  blank cells right (``credit``).
* ``image``: held-out accuracy (every attribute right, unguided ODE); untrained: the
  same-prompt ``diversity`` of the fixed-seed held-out images.
* ``workflow``: the final-video score (fraction of the five attributes right); untrained:
  the first stage's image accuracy (no reward judges the images).

Then prints one JSON object: per mode the mean and min-max of the gain and of the wall time
over the seeds in the file, and (``--plot``) draws the RL stage's held-out curve of every
seed, one panel per mode (the reference a user compares their own run with).

    python benchmarks/quickstart_seeds.py --modes text image --seeds 0 1 2 --jobs 2 \\
        --plot docs/images/quickstart_rl.png

Wall times are only comparable on an otherwise idle machine (``--jobs 1``); CPU seconds of
a one-thread run are the idle wall time's floor.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("text", "image", "workflow")
# the RL stage's directory, its headline key in the history, the untrained measure's key
# (in the RL stage's history records; the workflow's first-frame image accuracy)
STAGES = {
    "text": ("grpo", "accuracy", "credit"),
    "image": ("rl", "accuracy", "diversity"),
    "workflow": ("workflow_rl", "reward_mean", "image_accuracy"),
}


# the quickstart constants each mode runs with (a unit's settings digest covers these)
CONSTANTS = {
    "text": ("QUICKSTART_SFT", "QUICKSTART_GRPO", "QUICKSTART_TASK", "QUICKSTART_SAMPLER"),
    "image": ("QUICKSTART_IMAGE",),
    "workflow": ("QUICKSTART_WORKFLOW",),
}


# the recipe defaults its stages take where the quickstart leaves a key unset: the constants
# by prefix and every field's default of the stages' config classes
RECIPE_DEFAULTS = {
    "text": ("SFT_", "GRPO_"),
    "image": ("FLOW_SFT_", "FLOW_GRPO_"),
    "workflow": ("FLOW_SFT_", "WORKFLOW_"),
}
RECIPE_CONFIGS = {
    "text": ("SFTRecipeConfig", "GRPORecipeConfig"),
    "image": ("FlowSFTRecipeConfig", "FlowGRPORecipeConfig"),
    "workflow": ("FlowSFTRecipeConfig", "WorkflowRLRecipeConfig"),
}


def settings_digest(mode: str, extra: list[str]) -> str:
    """A digest of the quickstart's constants for ``mode``, the recipe defaults its stages
    take (constants and config fields: a changed default re-runs the mode's units) and the
    extra ``--set`` flags."""
    from diffusion_rl import quickstart
    from diffusion_rl.config import recipes

    prefixes = (*CONSTANTS[mode], "QUICKSTART_CURVE")
    values = {k: getattr(quickstart, k) for k in dir(quickstart) if k.startswith(prefixes)}
    defaults = {k: getattr(recipes, k) for k in dir(recipes) if k.startswith(RECIPE_DEFAULTS[mode])}
    values.update({k: v for k, v in defaults.items() if k.isupper()})
    values.update({k: getattr(recipes, k)().model_dump(mode="json") for k in RECIPE_CONFIGS[mode]})
    text = json.dumps([values, extra], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def commit() -> str:
    run = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return run.stdout.strip() or "unknown"


def read_units(results: Path, settings: dict[str, str]) -> list[dict]:
    """The units in ``results`` run with today's ``settings`` of their mode."""
    if not results.is_file():
        return []
    units = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    return [u for u in units if u["settings"] == settings.get(u["mode"])]


def unit_record(mode: str, seed: int, out: Path, wall: float, cpu: float, settings: str):
    stage, headline, untrained = STAGES[mode]
    history = json.loads((out / stage / "results.json").read_text())["history"]
    first, last = history[0], history[-1]
    return {
        "mode": mode,
        "seed": seed,
        "settings": settings,
        "commit": commit(),
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
        "before": round(100 * first[headline], 2),
        "after": round(100 * last[headline], 2),
        "gain": round(100 * (last[headline] - first[headline]), 2),
        "untrained": untrained,
        "untrained_before": round(first[untrained], 4),
        "untrained_after": round(last[untrained], 4),
        "curve": [[h["step"], round(100 * h[headline], 2)] for h in history],
    }


def run_units(units, args, settings: dict[str, str]) -> None:
    """``units`` as child processes, ``args.jobs`` at a time; each finished one appended."""
    env = {**os.environ, "DIFFUSION_RL_NO_PROGRESS": "1", "HF_HUB_OFFLINE": "1"}
    running: dict[int, tuple[str, int, Path, float]] = {}
    pending = list(units)
    results = Path(args.results)
    results.parent.mkdir(parents=True, exist_ok=True)
    while pending or running:
        while pending and len(running) < args.jobs:
            mode, seed = pending.pop(0)
            out = Path(args.out) / f"{mode}_s{seed}"
            argv = [sys.executable, "-m", "diffusion_rl", "quickstart", "--mode", mode]
            argv += ["--seed", str(seed), "--output-dir", str(out), "--threads", "1"]
            argv += [flag for value in args.set for flag in ("--set", value)]
            out.mkdir(parents=True, exist_ok=True)
            with open(out.with_suffix(".log"), "w") as log:
                child = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
            running[child.pid] = (mode, seed, out, time.perf_counter())
            print(f"started {mode} seed {seed} -> {out}", file=sys.stderr)
        pid, status, usage = os.wait4(-1, 0)
        mode, seed, out, started = running.pop(pid)
        wall = time.perf_counter() - started
        if os.waitstatus_to_exitcode(status) != 0:
            print(f"{mode} seed {seed} failed; see {out.with_suffix('.log')}", file=sys.stderr)
            continue
        cpu = usage.ru_utime + usage.ru_stime
        record = unit_record(mode, seed, out, wall, cpu, settings[mode])
        with open(results, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(
            f"{mode} seed {seed}: {record['before']} -> {record['after']} "
            f"({record['gain']:+.1f}) in {wall:.0f} s",
            file=sys.stderr,
        )


def spread(values: list[float]) -> dict:
    return {"mean": round(statistics.mean(values), 4), "min": min(values), "max": max(values)}


def summary(units: list[dict], modes) -> dict:
    out: dict = {}
    for mode in modes:
        rows = sorted((u for u in units if u["mode"] == mode), key=lambda u: u["seed"])
        if not rows:
            continue
        keys = ("gain", "before", "after", "wall_s", "cpu_s")
        keys += ("untrained_before", "untrained_after")
        out[mode] = {"seeds": [u["seed"] for u in rows], "settings": rows[0]["settings"]}
        out[mode]["untrained"] = rows[0]["untrained"]
        out[mode].update({key: spread([u[key] for u in rows]) for key in keys})
    return out


def plot(units: list[dict], modes, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in modes if any(u["mode"] == m for u in units)]
    fig, axes = plt.subplots(1, len(modes), figsize=(4.2 * len(modes), 3.2), squeeze=False)
    labels = {
        "text": "text: GRPO, held-out accuracy %",
        "image": "image: AWM, held-out accuracy %",
        "workflow": "workflow: AWM on both stages, final-video score %",
    }
    for ax, mode in zip(axes[0], modes):
        for u in sorted((u for u in units if u["mode"] == mode), key=lambda u: u["seed"]):
            steps, values = zip(*u["curve"])
            ax.plot(steps, values, marker="o", markersize=3, label=f"seed {u['seed']}")
        ax.set_title(labels[mode], fontsize=10)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=["text", "image"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=2, help="quickstarts at a time")
    parser.add_argument("--out", default="runs/quickstart_seeds")
    parser.add_argument("--results", default=str(ROOT / "benchmarks/results/quickstart.jsonl"))
    parser.add_argument("--set", action="append", default=[], help="passed to the quickstart")
    parser.add_argument("--plot", default=None, help="a PNG of the RL stage's curves")
    args = parser.parse_args()
    settings = {mode: settings_digest(mode, args.set) for mode in MODES}
    done = {(u["mode"], u["seed"]) for u in read_units(Path(args.results), settings)}
    units = [(m, s) for m in args.modes for s in args.seeds if (m, s) not in done]
    run_units(units, args, settings)
    units = read_units(Path(args.results), settings)
    if args.plot:
        plot(units, args.modes, Path(args.plot))
    print(json.dumps(summary(units, args.modes)))


if __name__ == "__main__":
    main()
