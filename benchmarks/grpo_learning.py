"""GRPO learning under a fixed CPU budget: exact trace replay vs the mean-field estimator.

Starts from one SFT checkpoint (trained here unless ``--sft-model`` is given), runs the GRPO
recipe with ``scorer=exact`` and with ``scorer=mean_field`` in two processes side by side,
one torch thread each, each stopped once its process has used ``--minutes`` of *CPU time*
(``time.process_time``, so a busy machine costs wall time, not learning), and reports
held-out verifier accuracy before and after. Prints one JSON object as the last line.

Beside the trained reward (the exact-answer verifier) each run reports, on the same held-out
problems, measures it does not train on, so that a gain that is reward hacking shows as a
drop there (``heldout.token_metrics``, on the SFT start and on each run's final model,
after the runs):

* ``well_formed``: the fraction of greedy completions that are a number followed by the
  stop token and nothing else (the SFT targets' form);
* ``digits``: the greedy completions' partial credit (the ``digits`` reward: the fraction of
  answer digits right, aligned from the units);
* ``sampled_accuracy``: the verifier at the rollout temperature (T = 1), 4 samples per
  problem, beside the greedy accuracy (and ``pass@4``).

The default start is a short SFT run (400 steps: about 36 % greedy accuracy on 2-digit
addition, 67 % pass@8 at T = 1). RL sharpens what the model can already sample; the gap
between pass@k and greedy accuracy is its headroom. The quickstart's longer SFT (1500 steps,
56 % greedy, 82 % pass@8) is reachable with ``--sft-steps 1500``.

GRPO settings (``BENCHMARK_SETTINGS``, each overridable with ``--set``): the recipe's
defaults (16 prompts × 8 samples, lr 1e-4, μ = 1, clip 0.2) with no KL term and no reference
model (``policy.beta: none``: no reference pass; ``beta: 0`` would still run one, see
``PolicyLossConfig``) and two tokens committed per denoising step (the sampler's
``steps_per_block: 2``; the SFT model's greedy accuracy is the same as with one token per
step), which halves the rollout and the replay. Held-out accuracy on 512 problems. Numbers
measured before this setting (``benchmarks/README.md``) used ``beta: 0``, which paid for a
reference pass every step: fewer steps in the same CPU budget.

Each seed (``--seeds``, default 0 1 2: the GRPO runs' seed; the SFT start is shared) is one
unit: both scorers' runs and their held-out measures, appended as one JSON line to
``--results`` (``benchmarks/results/grpo_learning.jsonl``) as it finishes; a rerun skips the
seeds already there under the same settings (``--fresh`` redoes them). The last line printed
is the summary over the seeds (mean, min and max per scorer).

    python benchmarks/grpo_learning.py --minutes 10
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

RUN = """
import json, sys, time, torch
from diffusion_rl.config import GRPORecipeConfig, build_config
from diffusion_rl.recipes import grpo as recipe
torch.set_num_threads(1)
config = build_config(GRPORecipeConfig, json.loads(sys.argv[1]))
deadline = time.process_time() + float(sys.argv[2])
real_step = recipe.PolicyLearner.step
def step(self, rollout):  # stop the run (through its normal end) once the CPU budget is spent
    metrics = real_step(self, rollout)
    if time.process_time() > deadline:
        config.steps = self.trainer.global_step // config.policy.num_iterations
    return metrics
recipe.PolicyLearner.step = step
result = recipe.run_grpo(config, echo=lambda _: None)
result["cpu_s"] = round(time.process_time(), 1)
print(json.dumps(result))
"""

BENCHMARK_SETTINGS = {
    "policy": {"beta": "none"},
    "sampler": {"steps_per_block": 2},
    "eval_examples": 512,
}
# What the runs do not train on (heldout.token_metrics), before / after / change per run;
# sampled at the rollout temperature, HELDOUT_SAMPLES completions per problem.
HELDOUT_SAMPLES = 4
HELDOUT_MEASURES = ("well_formed", "digits", "sampled_accuracy", f"pass@{HELDOUT_SAMPLES}")
SCORERS = ("exact", "mean_field")
ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks/results/grpo_learning.jsonl"


def run_seed(args, seed: int, sft_model: str, overrides: dict, heldout_start: dict | None):
    """Both scorers side by side at ``seed`` (the GRPO run's seed: rollout noise and prompt
    order; the SFT start is shared); returns the unit's record and the start's measures."""
    import torch
    from heldout import token_metrics

    from diffusion_rl.config import GRPORecipeConfig, build_config

    out = Path(args.out) / f"seed{seed}"
    task = {"name": "arithmetic", "num_digits": args.num_digits}
    procs, configs = {}, {}
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    for scorer in SCORERS:
        config = {
            "output_dir": str(out / scorer),
            "model": {"path": sft_model},
            "task": task,
            "scorer": scorer,
            "seed": seed,
            "steps": 100_000,
            "eval_every": 100_000,
            "checkpoint_every": 100_000,
            "resume": False,
            **overrides,
        }
        configs[scorer] = config
        procs[scorer] = subprocess.Popen(
            [sys.executable, "-c", RUN, json.dumps(config), str(args.minutes * 60)],
            stdout=subprocess.PIPE,
            text=True,
        )
    results = {}
    for scorer, proc in procs.items():
        stdout, _ = proc.communicate()
        if proc.returncode:
            raise SystemExit(f"{scorer} run failed with exit code {proc.returncode}")
        results[scorer] = json.loads(stdout.strip().splitlines()[-1])
    wall_runs, load_after = time.perf_counter() - started, os.getloadavg()[0]
    # The held-out measures the runs do not train on: the start and each final model, on the
    # recipe's evaluation problems and sampler, in this process at one thread after the runs.
    torch.set_num_threads(1)
    print(f"seed {seed}: held-out measures ...", file=sys.stderr)
    eval_started = time.perf_counter()

    def measures(model_dir: str, scorer: str) -> dict:
        config = build_config(GRPORecipeConfig, configs[scorer])
        return token_metrics(
            model_dir, config, samples=HELDOUT_SAMPLES, temperature=config.sampler.temperature
        )

    if heldout_start is None:
        heldout_start = measures(sft_model, "exact")
    heldout = {scorer: measures(str(out / scorer / "model"), scorer) for scorer in results}
    unit = {
        "seed": seed,
        "minutes_per_run": args.minutes,
        "task": task,
        "settings": overrides,
        "sft_model": sft_model,
        "wall_s": round(wall_runs, 1),
        "load_average_before_after": [round(load_before, 2), round(load_after, 2)],
        "heldout_wall_s": round(time.perf_counter() - eval_started, 1),
        "heldout_sampled": heldout_start["sampled"],
    }
    for scorer, result in results.items():
        after = heldout[scorer]
        unit[scorer] = {
            "accuracy_before": result["accuracy_before"],
            "accuracy_after": result["accuracy_after"],
            "gain_points": round(100 * (result["accuracy_after"] - result["accuracy_before"]), 2),
            "steps": result["steps"],
            "cpu_s": result["cpu_s"],
        }
        for measure in HELDOUT_MEASURES:
            unit[scorer].update(
                {
                    f"{measure}_before": heldout_start[measure],
                    f"{measure}_after": after[measure],
                    f"{measure}_change_points": round(
                        100 * (after[measure] - heldout_start[measure]), 2
                    ),
                }
            )
        # the separate greedy evaluation reproduces the recipe's (same sampler, problems)
        unit[scorer]["eval_matches_recipe"] = after["accuracy"] == round(
            result["accuracy_after"], 4
        ) and heldout_start["accuracy"] == round(result["accuracy_before"], 4)
    return unit, heldout_start


def summary(units: list[dict]) -> dict:
    """Per scorer: the gain's mean and min-max over the seeds, and each held-out measure's."""
    report: dict = {"benchmark": "grpo_learning", "seeds": [u["seed"] for u in units]}
    for scorer in SCORERS:
        rows = [u[scorer] for u in units]
        keys = ["gain_points", "steps"] + [f"{m}_change_points" for m in HELDOUT_MEASURES]
        report[scorer] = {
            key: {
                "mean": round(sum(r[key] for r in rows) / len(rows), 2),
                "min": min(r[key] for r in rows),
                "max": max(r[key] for r in rows),
            }
            for key in keys
        }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--minutes", type=float, default=10.0, help="GRPO CPU-time budget per estimator"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--sft-model", help="an SFT model directory (default: train one here)")
    parser.add_argument("--sft-steps", type=int, default=400)
    parser.add_argument("--num-digits", type=int, default=2)
    parser.add_argument("--out", default="runs/bench_grpo_learning")
    parser.add_argument("--results", default=str(RESULTS))
    parser.add_argument("--fresh", action="store_true", help="redo seeds already in --results")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="GRPO config override"
    )
    args = parser.parse_args()
    out = Path(args.out)

    sft_model = args.sft_model
    if sft_model is None:
        sft_model = str(out / "sft" / "model")
        if not Path(sft_model).is_dir():
            print(f"SFT for {args.sft_steps} steps ...", file=sys.stderr)
            subprocess.run(
                [
                    sys.executable, "-m", "diffusion_rl.cli", "sft",
                    "--set", f"output_dir={out / 'sft'}",
                    "--set", f"steps={args.sft_steps}",
                    "--set", f"task.num_digits={args.num_digits}",
                ],
                check=True,
                stdout=subprocess.DEVNULL,
            )  # fmt: skip

    from diffusion_rl.config import merge_dicts, parse_overrides

    overrides = merge_dicts(BENCHMARK_SETTINGS, parse_overrides(args.set))
    # a unit is one seed of both scorers, under these settings, budget and start
    key = {"settings": overrides, "minutes_per_run": args.minutes, "sft_steps": args.sft_steps}
    key["sft_model"] = args.sft_model
    key["digest"] = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    results = Path(args.results)
    results.parent.mkdir(parents=True, exist_ok=True)
    units = []
    if results.is_file():
        units = [json.loads(line) for line in results.read_text().splitlines() if line]
    mine = [u for u in units if u.get("digest") == key["digest"]]
    done = set() if args.fresh else {u["seed"] for u in mine}
    heldout_start = None
    for seed in args.seeds:
        if seed in done:
            print(f"seed {seed}: already in {results}, skipped", file=sys.stderr)
            continue
        unit, heldout_start = run_seed(args, seed, sft_model, overrides, heldout_start)
        unit.update(digest=key["digest"], commit=commit())
        with open(results, "a") as f:
            f.write(json.dumps(unit) + "\n")
        mine = [u for u in mine if u["seed"] != seed] + [unit]
        print(
            f"seed {seed}: " + ", ".join(f"{s} {unit[s]['gain_points']:+.1f}" for s in SCORERS),
            file=sys.stderr,
        )
    mine = sorted((u for u in mine if u["seed"] in args.seeds), key=lambda u: u["seed"])
    print(json.dumps(summary(mine)))


def commit() -> str:
    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    )
    return done.stdout.strip()


if __name__ == "__main__":
    main()
