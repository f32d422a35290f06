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
  used.

The report (one JSON object, the last line of stdout) has, per method, the mean and
min–max held-out gain over the seeds, the mean curve, and for the best forward-process
method the CPU time at which its mean curve first reaches Flow-GRPO's mean final gain
(``speedup``: Flow-GRPO's budget over that time).

    python benchmarks/flow_rl_compare.py --sft-model runs/flow_sft/model --minutes 15
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from flow_grpo_learning import BENCHMARK_SETTINGS as FLOW_GRPO_SETTINGS

from diffusion_rl.config import merge_dicts, parse_overrides

# Each method at the settings that learnt fastest here (see benchmarks/README.md); all roll
# out without guidance and evaluate the same way.
COMMON = {"eval_samples_per_prompt": 16}
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

RUN = """
import json, sys, time, torch
torch.set_num_threads(1)
from diffusion_rl.config import build_config, FlowGRPORecipeConfig
from diffusion_rl.evaluation import evaluate_images
from diffusion_rl.recipes import flow_grpo as recipe
config = build_config(FlowGRPORecipeConfig, json.loads(sys.argv[1]))
budget, every = float(sys.argv[2]), float(sys.argv[3])
spent = {"eval": 0.0}
curve = []

def training_cpu():
    return time.process_time() - spent["eval"]

def measure(model, split="eval"):
    start = time.process_time()
    result = evaluate_images(model, self_task[0], config.sampler,
                             samples_per_prompt=config.eval_samples_per_prompt, split=split)
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
    if now >= every * (len(curve) + 1) or now > budget:
        result = measure(self.served)
        curve.append({"cpu_s": round(now, 1), "step": self.steps_done(),
                      "accuracy": result.accuracy, "reward_mean": result.reward_mean})
    if now > budget:
        self.config.steps = self.steps_done()
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
result.update(extra, curve=[{"cpu_s": 0.0, "step": 0, "accuracy": result["accuracy_before"]}] + curve,
              training_cpu_s=round(training_cpu(), 1), cpu_s=round(time.process_time(), 1))
print(json.dumps(result))
"""


def run_one(method: str, seed: int, args, settings: dict) -> dict:
    out = Path(args.out) / f"{method}_s{seed}"
    report_path = out / "report.json"
    if report_path.is_file() and not args.fresh:
        return json.loads(report_path.read_text())
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
    out.mkdir(parents=True, exist_ok=True)
    budget, every = args.minutes * 60, args.eval_every_s
    with open(out / "log.txt", "w") as log:
        proc = subprocess.run(
            [sys.executable, "-c", RUN, json.dumps(config), str(budget), str(every)],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
        )
    if proc.returncode:
        raise SystemExit(f"{method} seed {seed} failed ({proc.returncode}); see {out / 'log.txt'}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    report = {
        "method": method,
        "seed": seed,
        "accuracy_before": result["accuracy_before"],
        "accuracy_after": result["accuracy_after"],
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
        "grids": result["grids"],
        "settings": settings,
    }
    report_path.write_text(json.dumps(report, indent=1))
    print(
        f"{method} seed {seed}: {report['accuracy_before']:.3f} -> {report['accuracy_after']:.3f}"
        f" ({report['gain_points']:+.1f}) in {report['steps']} steps",
        file=sys.stderr,
    )
    return report


def mean_curve(reports: list[dict], grid: list[float]) -> list[float]:
    """The seeds' mean held-out gain (points) at each CPU time of ``grid`` (each run's curve
    held constant between its evaluations)."""
    values = []
    for t in grid:
        gains = []
        for report in reports:
            seen = [p for p in report["curve"] if p["cpu_s"] <= t]
            gains.append(100 * (seen[-1]["accuracy"] - report["accuracy_before"]))
        values.append(round(sum(gains) / len(gains), 2))
    return values


def summarise(reports: list[dict], minutes: float, every: float) -> dict:
    by_method: dict[str, list[dict]] = {}
    for report in reports:
        by_method.setdefault(report["method"], []).append(report)
    grid = [every * k for k in range(int(minutes * 60 / every) + 1)]
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
        target = summary["flow_grpo"]["gain_mean"]
        forward = {m: s for m, s in summary.items() if m != "flow_grpo"}
        if forward:
            best = max(forward, key=lambda m: forward[m]["gain_mean"])
            reached = [
                t for t, g in zip(grid, forward[best]["curve_gain_mean"]) if g >= target and t > 0
            ]
            comparison = {
                "best_forward_method": best,
                "flow_grpo_gain_mean": target,
                "best_gain_mean": forward[best]["gain_mean"],
                "cpu_s_to_flow_grpo_gain": reached[0] if reached else None,
                "speedup": round(minutes * 60 / reached[0], 2) if reached else None,
                "target_speed_met": bool(reached) and reached[0] <= minutes * 60 / 3,
                "target_gain_met": forward[best]["gain_mean"] >= 20,
            }
    return {"methods": summary, "comparison": comparison}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sft-model", required=True, help="the flow-SFT model directory")
    parser.add_argument("--minutes", type=float, default=15.0, help="training CPU budget")
    parser.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, choices=list(METHODS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time")
    parser.add_argument("--eval-every-s", type=float, default=90.0, help="curve cadence (CPU-s)")
    parser.add_argument("--out", default="runs/bench_flow_rl_compare")
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
    jobs = [
        (m, s, merge_dicts(merge_dicts(METHODS[m], COMMON), overrides.get(m, {})))
        for s in args.seeds
        for m in args.methods
    ]
    with ThreadPoolExecutor(args.parallel) as pool:
        reports = list(pool.map(lambda job: run_one(job[0], job[1], args, job[2]), jobs))
    summary = summarise(reports, args.minutes, args.eval_every_s)
    summary.update(
        benchmark="flow_rl_compare",
        minutes=args.minutes,
        sft_model=args.sft_model,
        runs=[{k: r[k] for k in ("method", "seed", "gain_points", "steps")} for r in reports],
        wall_s=round(time.perf_counter() - started, 1),
        load_average_before_after=[round(load_before, 2), round(os.getloadavg()[0], 2)],
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
