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

    python benchmarks/grpo_learning.py --minutes 10
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--minutes", type=float, default=10.0, help="GRPO CPU-time budget per estimator"
    )
    parser.add_argument("--sft-model", help="an SFT model directory (default: train one here)")
    parser.add_argument("--sft-steps", type=int, default=400)
    parser.add_argument("--num-digits", type=int, default=2)
    parser.add_argument("--out", default="runs/bench_grpo_learning")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="GRPO config override"
    )
    args = parser.parse_args()
    out = Path(args.out)
    task = {"name": "arithmetic", "num_digits": args.num_digits}

    sft_model = args.sft_model
    if sft_model is None:
        print(f"SFT for {args.sft_steps} steps ...", file=sys.stderr)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "diffusion_rl.cli",
                "sft",
                "--set",
                f"output_dir={out / 'sft'}",
                "--set",
                f"steps={args.sft_steps}",
                "--set",
                f"task.num_digits={args.num_digits}",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        sft_model = str(out / "sft" / "model")

    from diffusion_rl.config import merge_dicts, parse_overrides

    overrides = merge_dicts(BENCHMARK_SETTINGS, parse_overrides(args.set))
    procs, configs = {}, {}
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    for scorer in ("exact", "mean_field"):
        config = {
            "output_dir": str(out / scorer),
            "model": {"path": sft_model},
            "task": task,
            "scorer": scorer,
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
    import torch
    from heldout import token_metrics

    from diffusion_rl.config import GRPORecipeConfig, build_config

    torch.set_num_threads(1)
    print("held-out measures ...", file=sys.stderr)
    eval_started = time.perf_counter()

    def measures(model_dir: str, scorer: str) -> dict:
        config = build_config(GRPORecipeConfig, configs[scorer])
        return token_metrics(
            model_dir, config, samples=HELDOUT_SAMPLES, temperature=config.sampler.temperature
        )

    heldout_start = measures(sft_model, "exact")
    heldout = {scorer: measures(str(out / scorer / "model"), scorer) for scorer in results}
    report = {
        "benchmark": "grpo_learning",
        "minutes_per_run": args.minutes,
        "task": task,
        "settings": overrides,
        "sft_model": sft_model,
        "wall_s": round(wall_runs, 1),
        "load_average_before_after": [round(load_before, 2), round(load_after, 2)],
        "heldout_wall_s": round(time.perf_counter() - eval_started, 1),
        "heldout_measures": list(HELDOUT_MEASURES),
        "heldout_sampled": heldout_start["sampled"],
        "heldout_start": heldout_start,
    }
    for scorer, result in results.items():
        after = heldout[scorer]
        report[scorer] = {
            "accuracy_before": result["accuracy_before"],
            "accuracy_after": result["accuracy_after"],
            "gain_points": round(100 * (result["accuracy_after"] - result["accuracy_before"]), 2),
            "steps": result["steps"],
            "cpu_s": result["cpu_s"],
        }
        for measure in HELDOUT_MEASURES:
            report[scorer].update(
                {
                    f"{measure}_before": heldout_start[measure],
                    f"{measure}_after": after[measure],
                    f"{measure}_change_points": round(
                        100 * (after[measure] - heldout_start[measure]), 2
                    ),
                }
            )
        # the separate greedy evaluation reproduces the recipe's (same sampler, problems)
        report[scorer]["eval_matches_recipe"] = after["accuracy"] == round(
            result["accuracy_after"], 4
        ) and heldout_start["accuracy"] == round(result["accuracy_before"], 4)
    report["target_met"] = report["exact"]["gain_points"] >= 15
    print(json.dumps(report))


if __name__ == "__main__":
    main()
