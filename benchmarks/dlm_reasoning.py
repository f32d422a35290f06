"""Countdown and Sudoku under a fixed CPU budget: GRPO with exact replay vs the estimators.

For each task (built-in ``countdown`` with 3 numbers at its defaults, and 4x4 ``sudoku``
with 10 blanks, its hardest 4x4 setting: see the table below) one SFT start (trained here at
one torch thread, unless ``--sft-model TASK=DIR``), then the GRPO recipe once per scorer
(``--scorers``, default exact, packed, mean_field, spg, coupled) and seed (``--seeds``), each
in a fresh one-thread process stopped once it has used ``--minutes`` of *CPU time*
(``grpo_learning.RUN``: a loaded machine costs wall time, not learning), ``--parallel``
processes at a time. Afterwards every model (the start and each
run's final one) is evaluated on the same held-out problems with the run's evaluation sampler
(greedy): the full-answer accuracy (the task's verifier, what GRPO is rewarded with) and a
measure the run does not train on, so that reward hacking would show:

* Sudoku: the **cell accuracy**, the fraction of the blank cells filled with the solution's
  digit (``SudokuReward(mode="cells")``; the reward is the whole puzzle);
* Countdown: the fraction of completions that are **well-formed expressions using each given
  number exactly once** (the reward's grammar; the reward itself accepts any subset and
  checks the value).

Reported per (task, scorer, seed): accuracy before / after and the gain in points, the
held-out measure before / after, steps and CPU seconds; per (task, scorer): the mean and the
min-max gain over seeds; per task: whether exact's mean gain is >= +20 points and >= 1.5x
mean_field's. Prints one JSON object as the last line of stdout.

SFT starts (``SFT_STEPS``; ``--sft-steps`` overrides both): chosen to leave headroom, the
start's greedy accuracy well below its pass@8 at the rollout temperature (T = 1), since RL
sharpens what the model can already sample. Measured on the 2-core machine with the GRPO
evaluation below (one thread, 256 held-out problems, the recipe's SFT defaults otherwise):

===================  =========  ======  ======  =================================
task                 SFT steps  greedy  pass@8  held-out measure (greedy)
===================  =========  ======  ======  =================================
countdown            600        1.6 %   28.5 %  6.6 % well-formed, all numbers once
sudoku, 6 blanks     140        0.0 %   0.0 %   41.0 % cell accuracy
sudoku, 6 blanks     170        7.4 %   5.9 %   72.8 % cell accuracy
sudoku, 6 blanks     185        88.7 %  95.3 %  98.0 % cell accuracy
sudoku, 6 blanks     200        90.2 %  96.9 %  98.0 % cell accuracy
sudoku, 10 blanks    250        0.0 %   0.0 %   24.4 % cell accuracy
sudoku, 10 blanks    **280**    25.4 %  44.9 %  77.5 % cell accuracy
sudoku, 10 blanks    300        69.9 %  80.1 %  91.2 % cell accuracy
===================  =========  ======  ======  =================================

Sudoku is learnt abruptly (0 to ~90 % within ~60 SFT steps; with the default 6 blanks the
sampled pass@8 never clears greedy by much on the way), so 10 blanks at 280 steps is the
start with headroom (greedy 25 %, pass@8 45 %); the window is narrow, so re-measure it (with
``--sft-steps``) on another torch build. The Countdown start repeats one number in most
greedy answers (``9+9-9``), yet samples a right one for 28 % of the problems in 8 tries.

GRPO settings (``SETTINGS``; ``--set KEY=VALUE`` overrides them for every run): those of
``grpo_learning.py`` (the recipe's defaults: 16 prompts x 8 samples, lr 1e-4, mu = 1, clip
0.2; two tokens committed per denoising step; 512 held-out problems) with no KL term and no
reference pass (``policy.beta: none``; SPG uses none either), so every scorer pays only for
its own scoring.

``--minutes`` below 1 is the smoke mode: unless given, 100 SFT steps, seed 0 only and 64
held-out problems (under 3 minutes for one task and two scorers at two processes).

    python benchmarks/dlm_reasoning.py      # 2 tasks x 5 scorers x 3 seeds, 20 CPU-min each
    python benchmarks/dlm_reasoning.py --tasks sudoku --scorers exact spg --seeds 0
    python benchmarks/dlm_reasoning.py --tasks countdown --scorers exact spg --minutes 0.5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from grpo_learning import BENCHMARK_SETTINGS, RUN

from diffusion_rl.config import merge_dicts, parse_overrides

TASKS = {"countdown": {"name": "countdown"}, "sudoku": {"name": "sudoku", "num_blanks": 10}}
SFT_STEPS = {"countdown": 600, "sudoku": 280}  # the headroom table in the module docstring
SCORERS = ("exact", "packed", "mean_field", "spg", "coupled")
SETTINGS = merge_dicts(BENCHMARK_SETTINGS, {"policy": {"beta": "none"}})
HELDOUT_MEASURE = {"countdown": "well_formed_all_numbers", "sudoku": "cell_accuracy"}
SMOKE = {"sft_steps": 100, "seeds": [0], "eval_examples": 64}
PASS_K = 8

SFT = """
import json, sys, torch
from diffusion_rl.config import SFTRecipeConfig, build_config
from diffusion_rl.recipes.sft import run_sft
torch.set_num_threads(1)
result = run_sft(build_config(SFTRecipeConfig, json.loads(sys.argv[1])), echo=lambda _: None)
print(json.dumps({"steps": result["steps"]}))
"""

EVAL = """
import json, sys
sys.path.insert(0, sys.argv[1])
from dlm_reasoning import heldout_metrics
print(json.dumps(heldout_metrics(sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]))))
"""


def uses_each_number_once(completion: str, numbers) -> bool:
    """Whether ``completion`` is a well-formed Countdown expression (the ``countdown``
    reward's grammar: integers, binary ``+ - * /``, parentheses, an optional leading ``=`` and
    trailing ``= n``) whose literals are exactly ``numbers``, each once; its value is not
    checked."""
    import ast

    from diffusion_rl.rewards import _COUNTDOWN_CHARS, _INTEGER, _countdown_literals

    text = " ".join(completion.split()).removeprefix("=")
    pieces = text.split("=")
    if len(pieces) > 2 or (len(pieces) == 2 and not _INTEGER.fullmatch(pieces[1].strip())):
        return False
    expression = pieces[0].strip()
    if not expression or not set(expression) <= _COUNTDOWN_CHARS:
        return False
    try:
        literals = _countdown_literals(ast.parse(expression, mode="eval"))
    except Exception:  # syntax errors and disallowed nodes alike: not well formed
        return False
    return Counter(literals) == Counter(numbers)


def heldout_metrics(model_dir: str, grpo_config: dict, pass_k: int = 0) -> dict:
    """The held-out metrics of ``model_dir`` under ``grpo_config``'s evaluation: the run's
    task, sampler at ``eval_temperature`` (greedy), ``eval_examples`` problems of the eval
    split, seeds ``seed + i`` (what the recipe's own evaluation does). With ``pass_k`` > 0 also
    pass@k: ``pass_k`` samples per problem at the rollout temperature."""
    import torch

    from diffusion_rl.config import GRPORecipeConfig, build_config
    from diffusion_rl.models import load_model
    from diffusion_rl.recipes.common import token_task
    from diffusion_rl.rewards import SudokuReward
    from diffusion_rl.sampling import sample_tokens

    torch.set_num_threads(1)
    config = build_config(GRPORecipeConfig, {**grpo_config, "model": {"path": model_dir}})
    loaded = load_model(model_dir)
    task = token_task(
        config.task, config.sampler.block_size, loaded.info, model_dir, loaded.tokenizer
    )
    model = loaded.model.eval()
    sampler = config.sampler.model_copy(update={"generation_length": task.completion_length})
    total = config.eval_examples
    examples = task.examples(range(total), "eval")
    cells = SudokuReward(mode="cells")

    def sample(temperature: float, seeds: list[int]) -> list[str]:
        texts = []
        settings = sampler.model_copy(update={"temperature": temperature})
        for lo in range(0, total, 128):
            batch = task.encode(examples[lo : lo + 128])
            with torch.no_grad():
                tokens = sample_tokens(
                    model,
                    batch["prompt_ids"],
                    batch["prompt_mask"],
                    settings,
                    seeds=seeds[lo : lo + 128],
                    stop_token_id=task.tokenizer.eos_id,
                ).tokens
            texts += task.tokenizer.batch_decode(tokens)
        return texts

    texts = sample(config.eval_temperature, [config.seed + i for i in range(total)])
    correct = task.rewards(texts, examples)
    result = {"accuracy": round(float(correct.mean()), 4), "num_examples": total}
    if task.name == "sudoku":
        scores = [cells.score(t, e.givens, e.size) for t, e in zip(texts, examples)]
        result["cell_accuracy"] = round(statistics.fmean(scores), 4)
    if task.name == "countdown":
        formed = [uses_each_number_once(t, e.numbers) for t, e in zip(texts, examples)]
        result["well_formed_all_numbers"] = round(statistics.fmean(formed), 4)
    if pass_k:
        solved = torch.zeros(total, dtype=torch.bool)
        for k in range(pass_k):
            seeds = [1_000_000 * (k + 1) + config.seed + i for i in range(total)]
            drawn = sample(config.sampler.temperature, seeds)
            solved |= task.rewards(drawn, examples) > 0
        result[f"pass@{pass_k}"] = round(float(solved.float().mean()), 4)
    return result


def _python(code: str, *args: str) -> dict:
    """``code`` in a fresh process (it limits itself to one torch thread); its last stdout
    line as JSON."""
    env = {**os.environ, "DIFFUSION_RL_NO_PROGRESS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True, env=env
    )
    if proc.returncode:
        raise SystemExit(f"a benchmark process failed with exit code {proc.returncode}: {args}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def evaluate(model_dir: str, grpo_config: dict, pass_k: int = 0) -> dict:
    """:func:`heldout_metrics` in a fresh one-thread process."""
    here = str(Path(__file__).resolve().parent)
    return _python(EVAL, here, model_dir, json.dumps(grpo_config), str(pass_k))


def grpo_config(task: str, scorer: str, seed: int, sft_model: str, out: Path, overrides: dict):
    return {
        "output_dir": str(out / task / f"{scorer}_seed{seed}"),
        "model": {"path": sft_model},
        "task": TASKS[task],
        "scorer": scorer,
        "seed": seed,
        "steps": 100_000,  # the CPU budget ends the run
        "eval_every": 100_000,
        "checkpoint_every": 100_000,
        "resume": False,
        **overrides,
    }


def train_sft(task: str, steps: int, out: Path) -> str:
    config = {
        "task": TASKS[task],
        "steps": steps,
        "eval_every": steps,
        "checkpoint_every": steps,
        "eval_examples": 64,
        "output_dir": str(out / task / "sft"),
        "resume": False,
    }
    _python(SFT, json.dumps(config))
    return str(out / task / "sft" / "model")


def points(after: float, before: float) -> float:
    return round(100 * (after - before), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="GRPO CPU budget per run")
    parser.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=sorted(TASKS))
    parser.add_argument("--scorers", nargs="+", choices=SCORERS, default=list(SCORERS))
    parser.add_argument("--seeds", nargs="+", type=int, help="default 0 1 2 (smoke: 0)")
    parser.add_argument("--parallel", type=int, default=2, help="processes at a time")
    parser.add_argument(
        "--sft-model", action="append", default=[], metavar="TASK=DIR", help="an SFT start"
    )
    parser.add_argument("--sft-steps", type=int, help=f"default {SFT_STEPS} (smoke: 100)")
    parser.add_argument("--out", default="runs/bench_dlm_reasoning")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="GRPO config override"
    )
    args = parser.parse_args()
    smoke = args.minutes < 1
    seeds = args.seeds or (SMOKE["seeds"] if smoke else [0, 1, 2])
    base = merge_dicts(SETTINGS, {"eval_examples": SMOKE["eval_examples"]}) if smoke else SETTINGS
    overrides = merge_dicts(base, parse_overrides(args.set))
    out = Path(args.out)
    given = dict(item.split("=", 1) for item in args.sft_model)
    unknown = sorted(set(given) - set(TASKS))
    if unknown:
        raise SystemExit(f"--sft-model: unknown task {unknown[0]!r}; expected TASK=DIR")
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    pool = ThreadPoolExecutor(max_workers=max(1, args.parallel))

    def sft_steps(task: str) -> int:
        if args.sft_steps is not None:
            return args.sft_steps
        return SMOKE["sft_steps"] if smoke else SFT_STEPS[task]

    print(f"SFT starts for {args.tasks} ...", file=sys.stderr)
    trained = {
        task: pool.submit(train_sft, task, sft_steps(task), out)
        for task in args.tasks
        if task not in given
    }
    starts = {task: given.get(task) or trained[task].result() for task in args.tasks}

    def one_run(task: str, scorer: str, seed: int) -> dict:
        config = grpo_config(task, scorer, seed, starts[task], out, overrides)
        result = _python(RUN, json.dumps(config), str(args.minutes * 60))
        after = evaluate(str(Path(config["output_dir"]) / "model"), config)
        return {"result": result, "after": after}

    first = {
        t: grpo_config(t, args.scorers[0], seeds[0], starts[t], out, overrides) for t in starts
    }
    before = {task: pool.submit(evaluate, starts[task], first[task]) for task in args.tasks}
    print(f"GRPO: {args.tasks} x {args.scorers} x seeds {seeds} ...", file=sys.stderr)
    jobs = {
        (task, scorer, seed): pool.submit(one_run, task, scorer, seed)
        for task in args.tasks
        for scorer in args.scorers
        for seed in seeds
    }
    runs, summary, checks = [], {}, {}
    for task in args.tasks:
        start = before[task].result()
        measure = HELDOUT_MEASURE[task]
        gains: dict[str, list[float]] = {}
        for scorer in args.scorers:
            for seed in seeds:
                done = jobs[task, scorer, seed].result()
                result, after = done["result"], done["after"]
                row = {
                    "task": task,
                    "scorer": scorer,
                    "seed": seed,
                    "accuracy_before": result["accuracy_before"],
                    "accuracy_after": result["accuracy_after"],
                    "gain_points": points(result["accuracy_after"], result["accuracy_before"]),
                    f"{measure}_before": start[measure],
                    f"{measure}_after": after[measure],
                    f"{measure}_change_points": points(after[measure], start[measure]),
                    "steps": result["steps"],
                    "cpu_s": result["cpu_s"],
                    # the separate evaluation reproduces the recipe's (same sampler, problems)
                    "eval_matches_recipe": after["accuracy"] == round(result["accuracy_after"], 4)
                    and start["accuracy"] == round(result["accuracy_before"], 4),
                }
                runs.append(row)
                gains.setdefault(scorer, []).append(row["gain_points"])
        for scorer, values in gains.items():
            changes = [
                r[f"{measure}_change_points"]
                for r in runs
                if (r["task"], r["scorer"]) == (task, scorer)
            ]
            summary[f"{task}/{scorer}"] = {
                "mean_gain_points": round(statistics.fmean(values), 2),
                "min_gain_points": min(values),
                "max_gain_points": max(values),
                f"mean_{measure}_change_points": round(statistics.fmean(changes), 2),
            }
        exact = summary.get(f"{task}/exact")
        mean_field = summary.get(f"{task}/mean_field")
        if exact is not None:
            check = {"exact_mean_gain_at_least_20": exact["mean_gain_points"] >= 20}
            if mean_field is not None:
                check["exact_at_least_1.5x_mean_field"] = (
                    exact["mean_gain_points"] >= 1.5 * mean_field["mean_gain_points"]
                )
            checks[task] = check
        summary[f"{task}/start"] = {"sft_model": starts[task], **start}
    pool.shutdown()
    report = {
        "benchmark": "dlm_reasoning",
        "minutes_per_run": args.minutes,
        "smoke": smoke,
        "tasks": args.tasks,
        "scorers": args.scorers,
        "seeds": seeds,
        "parallel": args.parallel,
        "settings": overrides,
        "heldout_measure": {t: HELDOUT_MEASURE[t] for t in args.tasks},
        "wall_s": round(time.perf_counter() - started, 1),
        "load_average_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "runs": runs,
        "summary": summary,
        "checks": checks,
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
