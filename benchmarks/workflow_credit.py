"""Credit assignment in workflow RL: which stage learns from which reward, under CPU budgets.

Starts from one text → image → video workflow (an image-stage FlowDiT and a video-stage
VideoDiT after flow SFT with the quickstart's settings: 1000 image and 3000 video steps at one
thread, bitwise the quickstart's models; trained here unless ``--workflow`` is given) and runs
the ``workflow-rl`` recipe in fresh one-thread processes, each stopped (through the recipe's
normal end: final evaluation, checkpoint, model, results) once it has
used its budget of *CPU time* (``time.process_time``; a loaded machine costs wall time, not
learning). Four arms, the same seeds and settings otherwise:

* ``color_image``: the reward is the clip's colour only (``motion`` reward, ``attributes:
  [color]``; the image stage decides the colour, the video stage should keep it) and only the
  image stage trains (the video stage frozen);
* ``motion_video``: the reward is motion only (``[direction, speed]``; decided by the video
  stage) and only the video stage trains;
* ``both``: the full final-video reward (all five attributes), both stages trained;
* ``video_only``: the same full reward and budget, the image stage frozen.

Each arm reports held-out before / after per attribute (the final clips of the served
workflow at fixed seeds), its mean attribute score (``score``: the fraction of the five
attributes right, averaged; what the full reward is) and the overall accuracy (all five
right), plus the first stage's image accuracy. The credit checks: ``color_image`` raises
colour, ``motion_video`` raises direction / speed, and ``both`` is compared with
``video_only`` on the score.

Beside the trained reward each arm reports, by name (``untrained_measures``), what its
reward does not contain, so that a gain that is reward hacking shows as a drop there: the
attributes outside its reward (``untrained_attributes``: all but colour for ``color_image``,
all but direction and speed for ``motion_video``, none for the full reward), with their mean
accuracy (``untrained_score``); the first stage's image accuracy (the image verifier on the
images no reward looks at); and the **clip diversity** (``diffusion_rl.evaluation.diversity`` on the final
clips: the mean pairwise pixel L2 distance between the fixed-seed held-out clips of one
prompt, averaged over prompts; a collapse to one clip per prompt drives it to 0), computed on
the recipe's own before / after evaluations. Prints one JSON object as the last line of
stdout.

    python benchmarks/workflow_credit.py --minutes 20 --credit-minutes 10
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from flow_grpo_learning import run_recipe

from diffusion_rl.quickstart import QUICKSTART_WORKFLOW_SFT_STEPS
from diffusion_rl.tasks.motion import MOTION_ATTRIBUTES

# The run stops (through the recipe's normal end) once its CPU budget is spent.
STAGES_PATCH = """
real_step = recipe.PolicyLearner.step_stages
def step_stages(self, rollouts):
    metrics = real_step(self, rollouts)
    if time.process_time() > deadline:
        config.steps = self.rollout_step
    return metrics
recipe.PolicyLearner.step_stages = step_stages
"""

# Flow-GRPO per stage (lr 1e-4, SDE on the first 4 of the 10 steps, each group starting from
# one noise, an EMA of the weights at 0.97; the quickstart's settings when this was measured)
# with 4 prompts x 8 images x 2 videos (the workflow file's fanout) per step, run to a CPU
# budget with before / after evaluations only (each top-level key overridable with --set).
STAGE = {
    "optim": {"lr": 1e-4},
    "sampler": {"sde_window": [0, 4], "share_group_noise": True},
    "ema_decay": 0.97,
}
SETTINGS = {
    "stages": {"image": STAGE, "video": STAGE},
    "group_size": 8,
    "prompts_per_step": 4,
    "steps": 100000,  # the CPU budget ends the run
    "eval_every": 100000,
    "checkpoint_every": 100000,
    "eval_samples_per_prompt": 8,
    "preview_clips": 16,
}
MOTION = ["direction", "speed"]
ARMS = {
    "both": {"rewards": [{"name": "motion"}], "freeze": None},
    "video_only": {"rewards": [{"name": "motion"}], "freeze": "image"},
    "color_image": {"rewards": [{"name": "motion", "options": {"attributes": ["color"]}}],
                    "freeze": "video"},
    "motion_video": {"rewards": [{"name": "motion", "options": {"attributes": MOTION}}],
                     "freeze": "image"},
}  # fmt: skip


def arm_config(name: str, workflow: str, out: Path, extra: dict) -> dict:
    """The recipe config of arm ``name``: the settings under ``extra`` (whose ``stages``
    sections are merged per stage), then the arm's rewards and frozen stage."""
    arm = ARMS[name]
    stages = json.loads(json.dumps(SETTINGS["stages"]))
    for stage, section in extra.get("stages", {}).items():
        stages[stage] = {**stages.get(stage, {}), **section}
    if arm["freeze"]:  # frozen: no optimizer, nothing to average
        stages[arm["freeze"]] = {**stages[arm["freeze"]], "train": False, "ema_decay": None}
    return {
        **SETTINGS,
        **{k: v for k, v in extra.items() if k != "stages"},
        "stages": stages,
        "rewards": arm["rewards"],
        "workflow": workflow,
        "output_dir": str(out / name),
        "resume": False,
    }


def run_arm(config: dict, seconds: float) -> dict:
    """One arm in a fresh one-thread process (``flow_grpo_learning.run_recipe``)."""
    return run_recipe(
        "workflow_rl",
        "WorkflowRLRecipeConfig",
        "run_workflow_rl",
        config,
        seconds,
        STAGES_PATCH,
    )


def reward_attributes(arm: str | None) -> list[str]:
    """The attributes arm ``arm``'s reward scores (None: the full reward's, all of them)."""
    if arm is None:
        return list(MOTION_ATTRIBUTES)
    named = set()
    for reward in ARMS[arm]["rewards"]:
        named.update(reward.get("options", {}).get("attributes", MOTION_ATTRIBUTES))
    return [a for a in MOTION_ATTRIBUTES if a in named]


def summary(result: dict, arm: str | None = None) -> dict:
    before, after = result["history"][0], result["history"][-1]
    trained = reward_attributes(arm)
    untrained = [a for a in MOTION_ATTRIBUTES if a not in trained]

    def score(record: dict) -> float:
        return round(record["reward_mean"], 4)

    def untrained_score(record: dict) -> float | None:
        if not untrained:
            return None
        return round(sum(record["attributes"][a] for a in untrained) / len(untrained), 4)

    diversity = {"before": before["diversity"], "after": after["diversity"]}
    return {
        "steps": result["steps"],
        "cpu_s": result["cpu_s"],
        "score_before": score(before),
        "score_after": score(after),
        "score_gain_points": round(100 * (after["reward_mean"] - before["reward_mean"]), 1),
        "accuracy_before": round(before["accuracy"], 4),
        "accuracy_after": round(after["accuracy"], 4),
        "attributes_before": {k: round(v, 4) for k, v in before["attributes"].items()},
        "attributes_after": {k: round(v, 4) for k, v in after["attributes"].items()},
        "image_accuracy_before": round(before["image_accuracy"], 4),
        "image_accuracy_after": round(after["image_accuracy"], 4),
        "reward_attributes": trained,
        "untrained_attributes": untrained,
        "untrained_measures": [
            *(f"attributes.{a}" for a in untrained),
            "image_accuracy",
            "clip_diversity",
        ],
        "untrained_score_before": untrained_score(before),
        "untrained_score_after": untrained_score(after),
        "untrained_attribute_gain_points": {
            a: round(100 * (after["attributes"][a] - before["attributes"][a]), 1) for a in untrained
        },
        "image_accuracy_gain_points": round(
            100 * (after["image_accuracy"] - before["image_accuracy"]), 1
        ),
        "clip_diversity_before": round(diversity["before"], 3),
        "clip_diversity_after": round(diversity["after"], 3),
        "clip_diversity_ratio": round(diversity["after"] / diversity["before"], 3)
        if diversity["before"] > 0
        else None,
        "weights_versions": result["weights_versions"],
        "previews": result["previews"],
    }


def train_workflow(out: Path, image_steps: int, video_steps: int) -> str:
    """The quickstart's two SFT stages (``image_steps`` / ``video_steps``) and its workflow
    file (the quickstart's one RL step is not used: the file points at the SFT models)."""
    from diffusion_rl.quickstart import run_quickstart_workflow

    steps = [f"image_sft.steps={image_steps}", f"video_sft.steps={video_steps}"]
    summary = run_quickstart_workflow(str(out / "sft"), rl_steps=1, overrides=steps, threads=1)
    return str(Path(summary["workflow"]).parents[2] / "workflow.yaml")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--minutes", type=float, default=20.0, help="CPU budget of both / video_only"
    )
    parser.add_argument(
        "--credit-minutes",
        type=float,
        default=10.0,
        help="CPU budget of color_image / motion_video",
    )
    parser.add_argument("--workflow", help="a workflow file to start from (default: train one)")
    image_sft, video_sft = QUICKSTART_WORKFLOW_SFT_STEPS  # the quickstart's start by default
    parser.add_argument("--image-sft-steps", type=int, default=image_sft, help="when training one")
    parser.add_argument("--video-sft-steps", type=int, default=video_sft, help="when training one")
    parser.add_argument("--out", default="runs/bench_workflow_credit")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated arms to run")
    parser.add_argument("--parallel", type=int, default=2, help="arms run at once (1 thread each)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="override a top-level recipe key in every arm, e.g. policy='{...}'",
    )
    args = parser.parse_args()  # fmt: skip
    out = Path(args.out)
    started = time.time()
    workflow = args.workflow or train_workflow(out, args.image_sft_steps, args.video_sft_steps)
    extra = {}
    for item in args.set:
        key, _, value = item.partition("=")
        extra[key] = json.loads(value)
    arms = [a for a in args.arms.split(",") if a]
    budgets = {a: 60 * (args.minutes if a in ("both", "video_only") else args.credit_minutes)
               for a in arms}  # fmt: skip
    configs = {a: arm_config(a, workflow, out, extra) for a in arms}
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        futures = {a: pool.submit(run_arm, configs[a], budgets[a]) for a in arms}
        results = {a: summary(f.result(), a) for a, f in futures.items()}
    report = {"workflow": workflow, "budgets_cpu_s": budgets, "settings": SETTINGS,
              "overrides": extra, "arms": results,
              "wall_s": round(time.time() - started, 1)}  # fmt: skip
    if "both" in results and "video_only" in results:
        report["both_minus_video_only_points"] = round(
            results["both"]["score_gain_points"] - results["video_only"]["score_gain_points"], 1
        )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
