"""Flow RL methods side by side: Flow-GRPO, DiffusionNFT, AWM and DGPO from one SFT start.

Each (method, seed) runs the ``flow-grpo`` recipe with ``policy.algorithm`` set, in its own
one-thread process, for ``--minutes`` of *training* CPU time (``time.process_time`` minus
what its evaluations cost, so the curve's cadence does not eat the budget), ``--parallel``
processes at a time. Every ``--eval-every-s`` CPU-seconds the served model (the EMA when
the method keeps one) is evaluated on the held-out prompts (unseen shape × colour ×
position combinations) with the rollout sampler as ODE at fixed seeds: the curve of
held-out accuracy against CPU-seconds.

Beside the trained reward (the GenEval verifier) each run reports measures it never
trained on, so a gain that is reward hacking shows as a drop there:

* ``diversity``: the mean pixel distance between the fixed-seed held-out images of one
  prompt (a collapse to one image per prompt drives it to 0), before and after
  (``diffusion_rl.evaluation.diversity``, in every flow evaluation record);
* ``train_prompts``: accuracy on the train prompts at evaluation seeds the rollouts never
  used, `--curve-samples` images each (the gap to held-out accuracy: memorisation).

The report (one JSON object, the last line of stdout) has, per method, the mean and
min–max held-out gain over the seeds, the mean curve, and for the best forward-process
method the CPU time at which its mean curve first reaches Flow-GRPO's mean final gain
(``speedup``: Flow-GRPO's budget over that time).

Evaluation: every run from one start reads the same start (the held-out noise is the
recipe's ``eval_seed``, not the run's seed). The first and last points of a curve are the
recipe's own before / after evaluations at ``--final-samples`` images per held-out prompt
(132: 2508 images, a standard error of at most 1 point, reported per run as ``se_before`` /
``se_after``); the points between at ``--curve-samples`` (16).

Each finished (method, seed) appends one JSON line to ``--results``
(``benchmarks/results/flow_rl_compare.jsonl``, committed) with a digest of its settings, the
budget and the SFT model's weights; a rerun skips the units already there, so a stopped
comparison is finished by running it again. ``--plot`` draws ``curves.png``: held-out gain
against training CPU-seconds, one line per method (mean over the seeds) in its min–max band,
and each method's diversity before and after.

    python benchmarks/flow_rl_compare.py --sft-model runs/quickstart_image/flow_sft/model \
        --plot benchmarks/results/flow_rl_compare.png
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from flow_grpo_learning import BENCHMARK_SETTINGS as FLOW_GRPO_SETTINGS

from diffusion_rl.config import merge_dicts, parse_overrides

# Each method at the settings that learnt fastest here (see benchmarks/README.md); all roll
# out without guidance and evaluate the same way.
COMMON: dict = {}  # and eval_samples_per_prompt: --final-samples
FORWARD = {
    "prompts_per_step": 8,
    "group_size": 16,
    "sampler": {"guidance_scale": 1.0, "mode": "ode"},
    "optim": {"lr": 3e-4},
}
METHODS = {
    "flow_grpo": FLOW_GRPO_SETTINGS,
    **{m: {**FORWARD, "policy": {"algorithm": m}} for m in ("nft", "awm", "dgpo")},
    # the forward methods with Flow-GRPO's EMA of the weights (0.99) evaluated: it averages
    # away noise late, but lags the live weights by ~100 steps early on
    **{
        f"{m}_ema": {**FORWARD, "policy": {"algorithm": m}, "ema_decay": 0.99}
        for m in ("nft", "awm", "dgpo")
    },
}
DEFAULT_METHODS = ["flow_grpo", "nft", "awm", "dgpo"]
RESULTS = Path(__file__).resolve().parent / "results" / "flow_rl_compare.jsonl"
GRID_S = 10.0  # the mean curves are read every 10 training CPU-seconds

RUN = """
import json, sys, time, torch
torch.set_num_threads(1)
from diffusion_rl.config import build_config, FlowGRPORecipeConfig
from diffusion_rl.evaluation import evaluate_images
from diffusion_rl.recipes import flow_grpo as recipe
config = build_config(FlowGRPORecipeConfig, json.loads(sys.argv[1]))
budget, every, curve_samples = float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
spent = {"eval": 0.0}
curve = []

def training_cpu():
    return time.process_time() - spent["eval"]

def measure(model, split="eval", samples=curve_samples):
    start = time.process_time()
    result = evaluate_images(model, self_task[0], config.sampler, samples_per_prompt=samples,
                             split=split, seed=config.eval_seed)
    spent["eval"] += time.process_time() - start
    return result

self_task = []
real_init = recipe.FlowGRPORecipe.__init__
def init(self, cfg):
    real_init(self, cfg)
    self_task.append(self.task)
recipe.FlowGRPORecipe.__init__ = init

real_step = recipe.FlowGRPORecipe.step
def step(self):
    metrics = real_step(self)
    now = training_cpu()
    if now > budget:  # the recipe's final evaluation is the curve's last point
        self.config.steps = self.steps_done()
    elif now >= every * (len(curve) + 1):
        result = measure(self.served)
        curve.append({"cpu_s": round(now, 1), "step": self.steps_done(),
                      "accuracy": result.accuracy, "reward_mean": result.reward_mean})
    return metrics
recipe.FlowGRPORecipe.step = step

real_evaluate = recipe.FlowGRPORecipe.evaluate
extra = {}
def evaluate(self, tag):
    start = time.process_time()
    out = real_evaluate(self, tag)
    if tag in ("before", "after"):
        extra[f"diversity_{tag}"] = self.final.diversity
        extra[f"train_prompts_{tag}"] = measure(self.served, "train").accuracy
    spent["eval"] += time.process_time() - start
    return out
recipe.FlowGRPORecipe.evaluate = evaluate

result = recipe.run_flow_grpo(config, echo=lambda message: print(message, file=sys.stderr))
end = {"cpu_s": round(training_cpu(), 1), "step": result["steps"], "accuracy": result["accuracy_after"]}
result.update(extra, curve=[{"cpu_s": 0.0, "step": 0, "accuracy": result["accuracy_before"]}, *curve, end],
              training_cpu_s=round(training_cpu(), 1), cpu_s=round(time.process_time(), 1))
print(json.dumps(result))
"""


def weights_digest(model_dir: str) -> str:
    """A digest of the SFT model's weight files (a unit names the start it ran from)."""
    digest = hashlib.sha256()
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def unit_key(method: str, settings: dict, args, start: str) -> str:
    """The digest a finished unit is filed under: its settings, budget, evaluation and start."""
    fields = [method, settings, args.minutes, args.eval_every_s, args.curve_samples, start]
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]


def standard_error(accuracy: float, images: int) -> float:
    """The binomial standard error of an accuracy over ``images`` images, in points."""
    return round(100 * math.sqrt(accuracy * (1 - accuracy) / images), 2)


def run_one(method: str, seed: int, args, settings: dict, key: str) -> dict:
    out = Path(args.out) / f"{method}_s{seed}"
    config = {
        "output_dir": str(out / "run"),
        "model": {"path": args.sft_model},
        "steps": 100_000,
        "eval_every": 100_000,
        "checkpoint_every": 100_000,
        "resume": False,
        "seed": seed,
        **settings,
    }
    env = {**os.environ, "DIFFUSION_RL_NO_PROGRESS": "1"}
    if out.exists():
        shutil.rmtree(out)  # an unfinished unit starts again
    out.mkdir(parents=True)
    budget, every = args.minutes * 60, args.eval_every_s
    with open(out / "log.txt", "w") as log:
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                RUN,
                json.dumps(config),
                str(budget),
                str(every),
                str(args.curve_samples),
            ],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
        )
    if proc.returncode:
        raise SystemExit(f"{method} seed {seed} failed ({proc.returncode}); see {out / 'log.txt'}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    images = result["eval"]["num_images"]  # of the final evaluation (the before one's too)
    report = {
        "method": method,
        "seed": seed,
        "key": key,
        "minutes": args.minutes,
        "accuracy_before": result["accuracy_before"],
        "accuracy_after": result["accuracy_after"],
        "se_before": standard_error(result["accuracy_before"], images),
        "se_after": standard_error(result["accuracy_after"], images),
        "gain_points": round(100 * (result["accuracy_after"] - result["accuracy_before"]), 2),
        "attributes_before": result["attributes_before"],
        "attributes_after": result["attributes_after"],
        "train_prompts_before": result["train_prompts_before"],
        "train_prompts_after": result["train_prompts_after"],
        "diversity_before": round(result["diversity_before"], 3),
        "diversity_after": round(result["diversity_after"], 3),
        "curve": result["curve"],
        "steps": result["steps"],
        "training_cpu_s": result["training_cpu_s"],
        "cpu_s": result["cpu_s"],
        "settings": settings,
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
    }
    with open(args.results, "a") as results:
        results.write(json.dumps(report) + "\n")
    print(
        f"{method} seed {seed}: {report['accuracy_before']:.3f} -> {report['accuracy_after']:.3f}"
        f" ({report['gain_points']:+.1f}, se {report['se_after']}) in {report['steps']} steps",
        file=sys.stderr,
    )
    return report


def curve_grid(minutes: float, every: float) -> list[float]:
    """CPU times of the curve: every ``every`` seconds, then the budget."""
    grid = [every * k for k in range(int(minutes * 60 / every) + 1)]
    return grid if grid[-1] == minutes * 60 else [*grid, minutes * 60]


def mean_curve(reports: list[dict], grid: list[float]) -> list[float]:
    """The seeds' mean held-out gain (points) at each CPU time of ``grid`` (each run's curve
    held constant between its evaluations; the grid's last time, the budget, reads each
    run's final evaluation, taken just past it)."""
    values = []
    for t in grid:
        gains = []
        for report in reports:
            seen = [p for p in report["curve"] if p["cpu_s"] <= t]
            point = report["curve"][-1] if t == grid[-1] else seen[-1]
            gains.append(100 * (point["accuracy"] - report["accuracy_before"]))
        values.append(round(sum(gains) / len(gains), 2))
    return values


def summarise(reports: list[dict], minutes: float, every: float) -> dict:
    by_method: dict[str, list[dict]] = {}
    for report in reports:
        by_method.setdefault(report["method"], []).append(report)
    grid = curve_grid(minutes, GRID_S)
    summary = {}
    for method, runs in by_method.items():
        gains = [r["gain_points"] for r in runs]
        summary[method] = {
            "gain_mean": round(sum(gains) / len(gains), 2),
            "gain_min": min(gains),
            "gain_max": max(gains),
            "seeds": [r["seed"] for r in runs],
            "steps_mean": round(sum(r["steps"] for r in runs) / len(runs)),
            "train_prompts_gain_mean": round(
                100
                * sum(r["train_prompts_after"] - r["train_prompts_before"] for r in runs)
                / len(runs),
                2,
            ),
            "diversity_before_after": [
                round(sum(r["diversity_before"] for r in runs) / len(runs), 3),
                round(sum(r["diversity_after"] for r in runs) / len(runs), 3),
            ],
            "curve_cpu_s": grid,
            "curve_gain_mean": mean_curve(runs, grid),
        }
    comparison = {}
    if "flow_grpo" in summary:
        baseline = summary["flow_grpo"]
        target = baseline["gain_mean"]
        forward = {m: s for m, s in summary.items() if m != "flow_grpo"}
        if forward:
            best = max(forward, key=lambda m: forward[m]["gain_mean"])
            chosen = forward[best]
            reached = [t for t, g in zip(grid, chosen["curve_gain_mean"]) if g >= target and t > 0]
            gap = chosen["train_prompts_gain_mean"] - chosen["gain_mean"]
            fall = chosen["diversity_before_after"][0] - chosen["diversity_before_after"][1]
            fall_baseline = (
                baseline["diversity_before_after"][0] - baseline["diversity_before_after"][1]
            )
            comparison = {
                "best_forward_method": best,
                "flow_grpo_gain_mean": target,
                "best_gain_mean": chosen["gain_mean"],
                "best_gain_min": chosen["gain_min"],
                "cpu_s_to_flow_grpo_gain": reached[0] if reached else None,
                "speedup": round(minutes * 60 / reached[0], 2) if reached else None,
                "train_minus_heldout_growth": round(gap, 2),
                "diversity_fall": round(fall, 3),
                "flow_grpo_diversity_fall": round(fall_baseline, 3),
                "targets_met": {
                    "gain": chosen["gain_mean"] >= 15 and chosen["gain_min"] >= 8,
                    "speed": bool(reached) and reached[0] <= minutes * 60 / 3,
                    "diversity": fall <= fall_baseline,
                    "memorisation": gap <= 5,
                },
            }
    return {"methods": summary, "comparison": comparison}


def plot(reports: list[dict], path: str, minutes: float, every: float) -> None:
    """``path``: held-out gain (points) against training CPU-seconds per method, the mean
    over its seeds in its min–max band; beside it, each method's diversity before → after."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_method: dict[str, list[dict]] = {}
    for report in reports:
        by_method.setdefault(report["method"], []).append(report)
    grid = curve_grid(minutes, GRID_S)
    figure, (gains, diversity) = plt.subplots(1, 2, figsize=(11, 4), width_ratios=(2, 1))
    for index, (method, runs) in enumerate(sorted(by_method.items())):
        per_seed = [mean_curve([run], grid) for run in runs]
        mean = [sum(v) / len(v) for v in zip(*per_seed)]
        low, high = [min(v) for v in zip(*per_seed)], [max(v) for v in zip(*per_seed)]
        line = gains.plot(grid, mean, label=f"{method} ({len(runs)} seeds)")[0]
        gains.fill_between(grid, low, high, color=line.get_color(), alpha=0.15)
        before = sum(r["diversity_before"] for r in runs) / len(runs)
        after = sum(r["diversity_after"] for r in runs) / len(runs)
        diversity.bar(index - 0.2, before, width=0.4, color=line.get_color(), alpha=0.35)
        diversity.bar(index + 0.2, after, width=0.4, color=line.get_color())
    gains.axhline(0, color="grey", lw=0.5)
    gains.set(
        xlabel="training CPU-seconds",
        ylabel="held-out accuracy gain (points)",
        title="flow RL from one SFT start: mean and min–max over seeds",
    )
    gains.legend()
    names = sorted(by_method)
    diversity.set_xticks(range(len(names)), names)
    diversity.set(ylabel="same-prompt diversity", title="diversity: before (pale), after")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sft-model", required=True, help="the flow-SFT model directory")
    parser.add_argument("--minutes", type=float, default=5.0, help="training CPU budget")
    parser.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, choices=list(METHODS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time")
    parser.add_argument("--eval-every-s", type=float, default=60.0, help="curve cadence (CPU-s)")
    parser.add_argument(
        "--final-samples", type=int, default=132, help="images per held-out prompt, before/after"
    )
    parser.add_argument(
        "--curve-samples", type=int, default=16, help="images per held-out prompt, in between"
    )
    parser.add_argument("--out", default="runs/bench_flow_rl_compare")
    parser.add_argument("--results", default=str(RESULTS), help="finished units (JSON lines)")
    parser.add_argument("--plot", default=None, help="a PNG of the curves and diversities")
    parser.add_argument("--fresh", action="store_true", help="rerun finished (method, seed)s")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="METHOD.KEY=VALUE",
        help="override one method's config, e.g. nft.optim.lr=1e-4",
    )
    args = parser.parse_args()
    overrides = parse_overrides(args.set)
    unknown = sorted(set(overrides) - set(METHODS))
    if unknown:
        raise SystemExit(f"--set: keys must start with a method name, got {unknown}")
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    start = weights_digest(args.sft_model)
    common = {**COMMON, "eval_samples_per_prompt": args.final_samples}
    jobs = []
    for seed in args.seeds:
        for method in args.methods:
            settings = merge_dicts(merge_dicts(METHODS[method], common), overrides.get(method, {}))
            jobs.append((method, seed, settings, unit_key(method, settings, args, start)))
    done = {}
    if Path(args.results).is_file() and not args.fresh:
        for line in Path(args.results).read_text().splitlines():
            unit = json.loads(line)
            done[(unit["key"], unit["seed"])] = unit
    todo = [job for job in jobs if (job[3], job[1]) not in done]
    print(
        f"{len(jobs) - len(todo)} of {len(jobs)} units already in {args.results}", file=sys.stderr
    )
    with ThreadPoolExecutor(args.parallel) as pool:
        fresh = list(pool.map(lambda job: run_one(*job[:2], args, *job[2:]), todo))
    new = {(r["key"], r["seed"]): r for r in fresh}
    reports = [done.get((key, seed)) or new[(key, seed)] for _, seed, _, key in jobs]
    summary = summarise(reports, args.minutes, args.eval_every_s)
    if args.plot:
        plot(reports, args.plot, args.minutes, args.eval_every_s)
    summary.update(
        benchmark="flow_rl_compare",
        minutes=args.minutes,
        sft_model=args.sft_model,
        sft_weights=start,
        runs=[
            {k: r[k] for k in ("method", "seed", "gain_points", "se_after", "steps")}
            for r in reports
        ],
        wall_s=round(time.perf_counter() - started, 1),
        load_average_before_after=[round(load_before, 2), round(os.getloadavg()[0], 2)],
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
