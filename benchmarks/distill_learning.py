"""On-policy distillation vs plain SFT of the same student, under the same CPU budget.

1. Teacher: ``--teacher-model DIR``, or trained here by masked-diffusion SFT
   (``--teacher-width``, ``--teacher-layers``, ``--teacher-steps``). Not in the budget.
2. Student start: ``--student-model DIR``, or a short SFT here (``--student-width``,
   ``--student-layers``, ``--student-steps``). Not in the budget. The student must have at
   most half the teacher's parameters.
3. Two processes side by side, one torch thread each, from the same student checkpoint: the
   ``distill`` recipe (fresh student rollouts every step, teacher logits on the student's
   states) and continued plain SFT on the task's gold answers. Each stops after
   ``--minutes`` of its own CPU time (``--budget cpu``, the default: robust to other load on
   a shared machine) or of wall time (``--budget wall``), ending through the recipe's normal
   end (final evaluation, save). Evaluations inside the runs count in the budget.
4. Held-out greedy verifier accuracy of the teacher, the student start and both results; the
   fraction of the student-teacher gap each run closed, ``(after - start) / (teacher -
   start)``; the machine's load average before and after, and each run's CPU and wall
   seconds (CPU / wall < 1 means the run waited for a core).
5. Beside the accuracy, measures neither loss trains on, so that a gain that is reward or
   teacher hacking shows as a drop there (``heldout.token_metrics``, after the runs, on the
   same held-out problems with the distill run's sampler, for the teacher, the start and
   both results): the fraction of greedy completions that are **well-formed** (a number
   followed by the stop token, nothing else), their partial-credit **digits** score, and
   the verifier's accuracy when **sampling at T = 1** (4 samples per problem: the student's
   own distribution, not its greedy mode; and ``pass@4``).

Writes ``OUT/report.png`` (accuracy against CPU minutes, the teacher as a line) and prints one
JSON object as the last line of stdout; ``target_met``: student <= half the teacher's
parameters and distillation closed >= 50 % of the gap.

    python benchmarks/distill_learning.py --minutes 10
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
torch.set_num_threads(1)
from diffusion_rl.config import DistillRecipeConfig, SFTRecipeConfig, build_config
from diffusion_rl.train import Trainer
recipe, budget_kind, budget = sys.argv[1], sys.argv[2], float(sys.argv[4])
if recipe == "distill":
    from diffusion_rl.recipes.distill import run_distill as run
    config = build_config(DistillRecipeConfig, json.loads(sys.argv[3]))
else:
    from diffusion_rl.recipes.sft import run_sft as run
    config = build_config(SFTRecipeConfig, json.loads(sys.argv[3]))
clock = time.process_time if budget_kind == "cpu" else time.perf_counter
cpu0, wall0, start = time.process_time(), time.perf_counter(), clock()
cpu_at_step = {0: 0.0}
real_step = Trainer.train_step
def train_step(self, micro_batches, *args, **kwargs):  # stop through the normal end once spent
    result = real_step(self, micro_batches, *args, **kwargs)
    cpu_at_step[self.global_step] = time.process_time() - cpu0
    if clock() - start > budget:
        config.steps = self.global_step
    return result
Trainer.train_step = train_step
result = run(config, echo=lambda _: None)
result["cpu_s"] = round(time.process_time() - cpu0, 1)
result["wall_s"] = round(time.perf_counter() - wall0, 1)
result["cpu_at_eval"] = [round(cpu_at_step[h["step"]], 1) for h in result["history"]]
print(json.dumps(result))
"""


def sft_model(out: Path, task: dict, width: int, layers: int, steps: int, threads: int) -> str:
    """Train a model directory with the SFT recipe (outside the budget)."""
    sets = {
        "output_dir": out,
        "steps": steps,
        "task.num_digits": task["num_digits"],
        "model.d_model": width,
        "model.n_layers": layers,
        "threads": threads,
        "checkpoint_every": steps,
        "eval_every": steps,
        "resume": False,
    }
    args = [a for key, value in sets.items() for a in ("--set", f"{key}={value}")]
    env = {**os.environ, "DIFFUSION_RL_NO_PROGRESS": "1"}
    subprocess.run(
        [sys.executable, "-m", "diffusion_rl.cli", "sft", *args],
        check=True,
        stdout=subprocess.DEVNULL,
        env=env,
    )
    return str(out / "model")


# What the losses do not train on (heldout.token_metrics): per run before / after / change.
HELDOUT_SAMPLES, HELDOUT_TEMPERATURE = 4, 1.0
HELDOUT_MEASURES = ("well_formed", "digits", "sampled_accuracy", f"pass@{HELDOUT_SAMPLES}")


def plot(png: Path, curves: dict, teacher: float, start: float, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for name, curve in curves.items():
        minutes = [point["cpu_s"] / 60 for point in curve]
        ax.plot(minutes, [point["accuracy"] for point in curve], marker="o", label=name)
    ax.axhline(teacher, color="black", linestyle="--", label="teacher")
    ax.axhline(start + 0.5 * (teacher - start), color="grey", linestyle=":", label="50% of gap")
    ax.set_xlabel("CPU minutes of the run")
    ax.set_ylabel("held-out accuracy")
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="budget per run")
    parser.add_argument("--budget", choices=["cpu", "wall"], default="cpu")
    parser.add_argument("--teacher-model", help="a teacher model directory (default: train one)")
    parser.add_argument("--teacher-width", type=int, default=128)
    parser.add_argument("--teacher-layers", type=int, default=4)
    parser.add_argument("--teacher-steps", type=int, default=5000)
    parser.add_argument("--student-model", help="the student's start (default: a short SFT)")
    parser.add_argument("--student-width", type=int, default=64)
    parser.add_argument("--student-layers", type=int, default=4)
    parser.add_argument("--student-steps", type=int, default=400)
    parser.add_argument("--num-digits", type=int, default=2)
    parser.add_argument("--eval-examples", type=int, default=512)
    parser.add_argument("--distill-eval-every", type=int, default=100)
    parser.add_argument("--sft-eval-every", type=int, default=500)
    parser.add_argument("--prep-threads", type=int, default=2, help="threads for the SFT runs")
    parser.add_argument("--out", default="runs/bench_distill_learning")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a distill config key",
    )
    parser.add_argument(
        "--sft-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a key of the SFT baseline's config",
    )
    args = parser.parse_args()
    out = Path(args.out)
    task = {"name": "arithmetic", "num_digits": args.num_digits}

    from diffusion_rl.config import merge_dicts, parse_overrides
    from diffusion_rl.models.io import load_model

    teacher = args.teacher_model
    if teacher is None:
        print(f"teacher: SFT for {args.teacher_steps} steps ...", file=sys.stderr)
        teacher = sft_model(
            out / "teacher",
            task,
            args.teacher_width,
            args.teacher_layers,
            args.teacher_steps,
            args.prep_threads,
        )
    student = args.student_model
    if student is None:
        print(f"student start: SFT for {args.student_steps} steps ...", file=sys.stderr)
        student = sft_model(
            out / "student_start",
            task,
            args.student_width,
            args.student_layers,
            args.student_steps,
            args.prep_threads,
        )
    teacher_params = load_model(teacher).model.num_parameters()
    student_params = load_model(student).model.num_parameters()

    common = {
        "task": task,
        "steps": 10_000_000,
        "checkpoint_every": 10_000_000,
        "eval_examples": args.eval_examples,
        "resume": False,
    }
    configs = {
        "distill": merge_dicts(
            {
                **common,
                "output_dir": str(out / "distill"),
                "student": {"path": student},
                "teacher": {"path": teacher},
                "eval_every": args.distill_eval_every,
            },
            parse_overrides(args.set),
        ),
        "sft": merge_dicts(
            {
                **common,
                "output_dir": str(out / "sft"),
                "model": {"path": student},
                "eval_every": args.sft_eval_every,
                # continue from the checkpoint at a constant rate: the run has no fixed length
                "optim": {"lr": 1e-3, "schedule": "constant", "warmup_steps": 20},
            },
            parse_overrides(args.sft_set),
        ),
    }
    load_before = os.getloadavg()
    env = {**os.environ, "DIFFUSION_RL_NO_PROGRESS": "1"}
    started = time.perf_counter()
    procs = {
        name: subprocess.Popen(
            [
                sys.executable,
                "-c",
                RUN,
                name,
                args.budget,
                json.dumps(config),
                str(args.minutes * 60),
            ],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for name, config in configs.items()
    }
    runs = {}
    for name, proc in procs.items():
        stdout, _ = proc.communicate()
        if proc.returncode:
            raise SystemExit(f"{name} run failed with exit code {proc.returncode}")
        runs[name] = json.loads(stdout.strip().splitlines()[-1])
    load_after = os.getloadavg()
    wall_runs = time.perf_counter() - started

    # The held-out measures, in this process at one thread after the runs.
    import torch
    from heldout import token_metrics

    from diffusion_rl.config import DistillRecipeConfig, build_config

    torch.set_num_threads(1)
    print("held-out measures ...", file=sys.stderr)
    eval_started = time.perf_counter()
    eval_config = build_config(DistillRecipeConfig, configs["distill"])
    heldout = {
        name: token_metrics(
            model_dir, eval_config, samples=HELDOUT_SAMPLES, temperature=HELDOUT_TEMPERATURE
        )
        for name, model_dir in {
            "teacher": teacher,
            "start": student,
            "distill": runs["distill"]["model_dir"],
            "sft": runs["sft"]["model_dir"],
        }.items()
    }

    distill = runs["distill"]
    teacher_accuracy = distill["teacher"]["accuracy"]
    start = distill["student"]["accuracy_before"]
    gap = teacher_accuracy - start

    def summary(result: dict, after: float, measures: dict) -> dict:
        curve = [
            {"cpu_s": c, "step": h["step"], "accuracy": h["accuracy"]}
            for c, h in zip(result["cpu_at_eval"], result["history"])
        ]
        if curve[0]["step"] != 0:  # the SFT recipe does not evaluate its start: the same model
            curve.insert(0, {"cpu_s": 0.0, "step": 0, "accuracy": start})
        row = {
            "accuracy_after": after,
            "gap_closed": round((after - start) / gap, 3) if gap > 0 else None,
            "steps": result["steps"],
            "cpu_s": result["cpu_s"],
            "wall_s": result["wall_s"],
            "cpu_over_wall": round(result["cpu_s"] / result["wall_s"], 2),
            "curve": curve,
        }
        for m in HELDOUT_MEASURES:
            row[f"{m}_before"] = heldout["start"][m]
            row[f"{m}_after"] = measures[m]
            row[f"{m}_change_points"] = round(100 * (measures[m] - heldout["start"][m]), 2)
        # the separate greedy evaluation reproduces the run's (same problems and seeds)
        row["eval_matches_recipe"] = measures["accuracy"] == round(after, 4)
        return row

    report = {
        "benchmark": "distill_learning",
        "budget": f"{args.minutes} {args.budget}-minutes per run",
        "task": task,
        "teacher": {
            "model": teacher,
            "parameters": teacher_params,
            "accuracy": teacher_accuracy,
            "heldout": heldout["teacher"],
        },
        "student": {
            "model": student,
            "parameters": student_params,
            "accuracy_start": start,
            "heldout_start": heldout["start"],
        },
        "parameter_ratio": round(student_params / teacher_params, 3),
        "eval_examples": args.eval_examples,
        "distill": summary(distill, distill["student"]["accuracy_after"], heldout["distill"]),
        "sft": summary(runs["sft"], runs["sft"]["eval"]["accuracy"], heldout["sft"]),
        "heldout_measures": list(HELDOUT_MEASURES),
        "heldout_sampled": heldout["start"]["sampled"],
        "heldout_wall_s": round(time.perf_counter() - eval_started, 1),
        "distill_config": configs["distill"],
        "load_average_1_5_15": {"before": load_before, "after": load_after},
        "cpu_count": os.cpu_count(),
        "wall_s": round(wall_runs, 1),
    }
    report["report_png"] = str(
        plot(
            out / "report.png",
            {"distill": report["distill"]["curve"], "plain SFT": report["sft"]["curve"]},
            teacher_accuracy,
            start,
            f"{args.num_digits}-digit addition: student {student_params:,} vs teacher "
            f"{teacher_params:,} parameters",
        )
    )
    closed = report["distill"]["gap_closed"]
    report["target_met"] = bool(
        report["parameter_ratio"] <= 0.5 and closed is not None and closed >= 0.5
    )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
