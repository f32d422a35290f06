"""Flow-GRPO learning under a fixed CPU budget on mini-GenEval.

Starts from one flow-SFT checkpoint (trained here with the ``flow-sft`` recipe unless
``--sft-model`` is given), runs the ``flow-grpo`` recipe in a subprocess with one torch
thread, stopped (through the recipe's normal end: final evaluation, checkpoint, model,
results) once the process has used ``--minutes`` of *CPU time* (``time.process_time``, so a
loaded machine costs wall time, not learning), and reports held-out verifier accuracy before
and after, overall and per attribute, with the before/after PNG grids of fixed-seed samples.
Also reports the accuracy on the *train* prompts (ODE, fixed evaluation seeds, which the
rollouts never use) before and after: held-out prompts are unseen shape × colour × position
combinations, so the two numbers separate learning from compositional transfer.
Beside the trained reward (the GenEval verifier) it reports the **diversity** of the
fixed-seed held-out images before and after (``diffusion_rl.evaluation.diversity``, as in
``flow_rl_compare.py``: the mean pairwise pixel L2 distance between the images of one
prompt, averaged over prompts, computed on the recipe's own before / after evaluations): a
measure the run does not train on, so that a gain that is reward hacking (a collapse to one
image per prompt) shows as a drop there. Prints one JSON object as the last line of stdout.

RL sharpens what the model can already sample: the SFT checkpoint should be partly right,
with a pass@k (any of k SDE samples right) well above its ODE accuracy.

Flow-GRPO settings (``BENCHMARK_SETTINGS``, each overridable with ``--set``): the recipe's
defaults (lr 1e-4, β 0.004, 10 steps, noise level 0.7, groups of 16) with

* **no classifier-free guidance** (``guidance_scale: 1``): every forward is one batch of B
  rows instead of 2B, so a CPU-minute buys twice the images, and the SFT model sampled
  without guidance is more varied (fewer groups with equal rewards). Before and after are
  measured with this sampler; the report adds both models served with the SFT model's own
  guidance (``heldout_at_sft_guidance``), so the trained model is also compared with the SFT
  model at its best;
* 8 prompts × 16 images per step (128 images: the cost of 64 guided ones);
* the group sharing its initial noise (``share_group_noise``: reward differences inside a
  group then come from the SDE noise the policy gradient credits, not from the starting noise
  it cannot);
* SDE on the first 4 of the 10 steps only (``sde_window: [0, 4]``: composition is decided at
  high noise; the later steps run as ODE and are not trained, which also cuts the replay
  cost);
* an EMA of the weights (``ema_decay: 0.99``) evaluated and saved: it averages away part of
  the noise each update adds.

Evaluation: 16 fixed-seed images per held-out prompt.

    python benchmarks/flow_grpo_learning.py --minutes 15
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
from diffusion_rl.config import build_config, {cls}
from diffusion_rl.recipes import {module} as recipe
config = build_config({cls}, json.loads(sys.argv[1]))
deadline = time.process_time() + float(sys.argv[2])
{patch}
result = recipe.{run}(config, echo=lambda message: print(message, file=sys.stderr))
result["cpu_s"] = round(time.process_time(), 1)
print(json.dumps(result))
"""
# Flow-GRPO stops (through the recipe's normal end) once the CPU budget is spent.
GRPO_PATCH = """
real_step = recipe.PolicyLearner.step
def step(self, rollout):
    metrics = real_step(self, rollout)
    if time.process_time() > deadline:
        config.steps = self.rollout_step
    return metrics
recipe.PolicyLearner.step = step
"""
# The measures the run does not train on (beside the held-out verifier accuracy).
HELDOUT_MEASURES = ("diversity", "train_prompts")

# The settings listed above (Flow-GRPO's fastest here; the image quickstart used them until a
# forward-process method learnt faster, benchmarks/flow_rl_compare.py).
FLOW_GRPO_SETTINGS = {
    "prompts_per_step": 8,
    "group_size": 16,
    "sampler": {"guidance_scale": 1.0, "share_group_noise": True, "sde_window": [0, 4]},
    "ema_decay": 0.99,
}
BENCHMARK_SETTINGS = {**FLOW_GRPO_SETTINGS, "eval_samples_per_prompt": 16}


def run_recipe(module: str, cls: str, run: str, config: dict, seconds: float, patch: str = ""):
    """The recipe in a fresh one-thread process; its results dict (with ``cpu_s``)."""
    code = RUN.format(module=module, cls=cls, run=run, patch=patch)
    env = {**os.environ, "DIFFUSION_RL_NO_PROGRESS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(config), str(seconds)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    if proc.returncode:
        raise SystemExit(f"{module} failed with exit code {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def accuracy(model_dir: str, settings: dict, split: str = "train", **sampler) -> dict[str, float]:
    """Verifier accuracy per attribute on ``split``: the run's evaluation (its sampler as ODE,
    with ``sampler`` overrides; ``eval_samples_per_prompt`` images per prompt, seeds 0, 1, ...)."""
    import torch

    from diffusion_rl.config import FlowGRPORecipeConfig, build_config
    from diffusion_rl.evaluation import evaluate_images
    from diffusion_rl.models.io import load_model
    from diffusion_rl.tasks.geneval import GenEvalTask

    torch.set_num_threads(1)
    loaded = load_model(model_dir)
    config = build_config(FlowGRPORecipeConfig, {**settings, "model": {"path": model_dir}})
    result = evaluate_images(
        loaded.model,
        GenEvalTask.from_info(loaded.info["task"]),
        config.sampler.model_copy(update=sampler),
        samples_per_prompt=config.eval_samples_per_prompt,
        split=split,
    )
    return {key: round(value, 4) for key, value in result.attributes.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=15.0, help="Flow-GRPO CPU-time budget")
    parser.add_argument("--sft-model", help="a flow-SFT model directory (default: train one)")
    parser.add_argument("--sft-steps", type=int, default=None, help="default: the recipe's")
    parser.add_argument("--out", default="runs/bench_flow_grpo_learning")
    parser.add_argument(
        "--sft-set", action="append", default=[], metavar="KEY=VALUE", help="flow-SFT override"
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="Flow-GRPO override"
    )
    args = parser.parse_args()

    from diffusion_rl.config import merge_dicts, parse_overrides

    out = Path(args.out)
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    sft = None
    sft_model = args.sft_model
    if sft_model is None:
        config = {
            "output_dir": str(out / "flow_sft"),
            "resume": False,
            **parse_overrides(args.sft_set),
        }
        if args.sft_steps is not None:
            config["steps"] = args.sft_steps
        print("flow SFT ...", file=sys.stderr)
        sft = run_recipe("flow_sft", "FlowSFTRecipeConfig", "run_flow_sft", config, 0.0)
        sft_model = sft["model_dir"]

    settings = merge_dicts(BENCHMARK_SETTINGS, parse_overrides(args.set))
    config = {
        "output_dir": str(out / "flow_grpo"),
        "model": {"path": sft_model},
        "steps": 100_000,
        "eval_every": 100_000,
        "checkpoint_every": 100_000,
        "resume": False,
        **settings,
    }
    print(f"Flow-GRPO for {args.minutes} CPU-minutes ...", file=sys.stderr)
    grpo = run_recipe(
        "flow_grpo",
        "FlowGRPORecipeConfig",
        "run_flow_grpo",
        config,
        args.minutes * 60,
        GRPO_PATCH,
    )
    diversity_before = grpo["history"][0]["diversity"]
    diversity_after = grpo["history"][-1]["diversity"]
    before, after = grpo["attributes_before"], grpo["attributes_after"]
    train_before = accuracy(sft_model, settings)
    train_after = accuracy(grpo["model_dir"], settings)
    # Both models under the SFT model's own serving sampler (its recorded guidance): is the
    # trained model better than the SFT model served the way it was meant to be?
    from diffusion_rl.models.io import load_model

    served = load_model(sft_model).info["sampler"]
    guidance = {"guidance_scale": served["guidance_scale"]}
    sft_sampler = {
        "guidance_scale": served["guidance_scale"],
        "before": accuracy(sft_model, settings, "eval", **guidance)["overall"],
        "after": accuracy(grpo["model_dir"], settings, "eval", **guidance)["overall"],
    }
    report = {
        "benchmark": "flow_grpo_learning",
        "minutes": args.minutes,
        "accuracy_before": grpo["accuracy_before"],
        "accuracy_after": grpo["accuracy_after"],
        "gain_points": round(100 * (grpo["accuracy_after"] - grpo["accuracy_before"]), 2),
        "attributes_before": before,
        "attributes_after": after,
        "attribute_gain_points": {k: round(100 * (after[k] - before[k]), 2) for k in after},
        "train_prompts_before": train_before,
        "train_prompts_after": train_after,
        "train_prompts_gain_points": round(
            100 * (train_after["overall"] - train_before["overall"]), 2
        ),
        "heldout_at_sft_guidance": sft_sampler,
        "heldout_measures": list(HELDOUT_MEASURES),
        "diversity_before": round(diversity_before, 3),
        "diversity_after": round(diversity_after, 3),
        "diversity_ratio": round(diversity_after / diversity_before, 3)
        if diversity_before > 0
        else None,
        "steps": grpo["steps"],
        "cpu_s": grpo["cpu_s"],
        "held_out_images": grpo["eval"]["num_images"],
        "grids": grpo["grids"],
        "sft_model": sft_model,
        "sft": None
        if sft is None
        else {"steps": sft["steps"], "accuracy": sft["eval"]["accuracy"], "cpu_s": sft["cpu_s"]},
        "settings": {"sft": parse_overrides(args.sft_set), "flow_grpo": settings},
        "wall_s": round(time.perf_counter() - started, 1),
        "load_average_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    report["target_met"] = report["gain_points"] >= 20
    print(json.dumps(report))


if __name__ == "__main__":
    main()
