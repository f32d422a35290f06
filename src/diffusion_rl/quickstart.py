"""Recipe: the out-of-the-box run, SFT → RL on a built-in task, on a laptop CPU.

Text mode (:func:`run_quickstart`, the default): 4x4 Sudoku with 10 blanks.

1. masked-diffusion SFT of the built-in block-causal transformer (``OUT/sft``), evaluated
   every 10 steps with the serving sampler and stopped at the first evaluation at or above
   ``QUICKSTART_SFT_STOP`` held-out accuracy (``stop_at_accuracy``): Sudoku is learnt
   abruptly, and an SFT run to convergence would leave RL nothing to do;
2. GRPO from that checkpoint with exact trace replay (``OUT/grpo``), evaluated again;

then a before/after table, sample completions, ``OUT/results.json`` and the curves
(``OUT/sft/curves.png``, ``OUT/grpo/curves.png`` with the reward curve).
``--set sft.KEY=VALUE`` / ``--set grpo.KEY=VALUE`` override either stage's config.

Image mode (:func:`run_quickstart_image`, ``diffusion-rl quickstart --mode image``): the same
two stages for a small built-in flow DiT on mini-GenEval — rectified-flow SFT
(``OUT/flow_sft``), then flow RL from that checkpoint (``OUT/rl``) with the method and settings
that learnt fastest on CPU (``QUICKSTART_IMAGE_RL``: AWM, a forward-process method, on
rollouts of the serving ODE sampler without guidance, so before and after are measured
without guidance) — with a table per attribute (the SFT model with its own guidance, then
before and after RL) and PNG grids of fixed-seed held-out samples before and after RL.
``--set sft.KEY=VALUE`` / ``--set rl.KEY=VALUE`` override either stage's config.
"""

from __future__ import annotations

import json
from pathlib import Path

from .config import (
    FlowGRPORecipeConfig,
    FlowSFTRecipeConfig,
    GRPORecipeConfig,
    SFTRecipeConfig,
    build_config,
    merge_dicts,
    parse_overrides,
)
from .evaluation import format_samples
from .recipes.flow_grpo import METHOD_NAMES, run_flow_grpo
from .recipes.flow_sft import run_flow_sft
from .recipes.grpo import run_grpo
from .recipes.sft import run_sft
from .tasks import TASKS

# Text: 4x4 Sudoku with 10 blanks (its hardest 4x4 setting). SFT jumps from ~0 to ~90 %
# held-out within ~60 steps (somewhere after step 80-150, by seed), so it stops at the first
# evaluation (every 10 steps) at or above 15 %: measured 26 % and 33 % at steps 150 and 100 on
# seeds 0 and 1. The sampler commits two tokens per step in SFT evaluation and GRPO alike
# (the evaluation the stop is decided on is the one GRPO starts from); GRPO runs without a
# reference pass (beta none), 16 prompts x 8 samples, lr 1e-4.
QUICKSTART_SFT_STEPS = 400  # at most: the stop comes first
QUICKSTART_SFT_STOP = 0.15
QUICKSTART_GRPO_STEPS = 80
QUICKSTART_TASK = {"name": "sudoku", "num_blanks": 10}
QUICKSTART_SAMPLER = {"steps_per_block": 2}
QUICKSTART_SFT = {
    "task": QUICKSTART_TASK,
    "sampler": QUICKSTART_SAMPLER,
    "stop_at_accuracy": QUICKSTART_SFT_STOP,
    "eval_every": 10,
    "log_every": 10,
}
QUICKSTART_GRPO = {"policy": {"beta": "none"}, "sampler": QUICKSTART_SAMPLER}


# The RL stage is evaluated this many times (and before): its held-out curve, the reference a
# user compares their own run with (benchmarks/quickstart_seeds.py draws it over seeds).
QUICKSTART_CURVE_POINTS = 4


def curve_every(rl_steps: int) -> int:
    """``eval_every`` of an RL stage of ``rl_steps`` steps: :data:`QUICKSTART_CURVE_POINTS`
    evaluations, the last at the end."""
    return max(1, -(-rl_steps // QUICKSTART_CURVE_POINTS))


def _stage_config(cls, defaults: dict, overrides: dict, name: str):
    """A stage's config: the quickstart's ``defaults`` under the user's ``--set`` ones."""
    return build_config(cls, merge_dicts(defaults, overrides.get(name, {})), f"quickstart {name}")


def _stage_overrides(overrides: list[str] | None, stages=("sft", "grpo")) -> dict:
    extra = parse_overrides(overrides)
    unknown = sorted(set(extra) - set(stages))
    if unknown:
        allowed = " or ".join(f"{stage}." for stage in stages)
        raise ValueError(f"quickstart --set: keys must start with {allowed}, got {unknown}")
    return extra


def run_quickstart(
    output_dir: str = "runs/quickstart",
    steps: int | None = None,
    rl_steps: int | None = None,
    overrides: list[str] | None = None,
    threads: int | None = None,
    seed: int = 0,
) -> dict:
    out = Path(output_dir)
    extra = _stage_overrides(overrides)
    sft_config = _stage_config(
        SFTRecipeConfig,
        {
            **QUICKSTART_SFT,
            "output_dir": str(out / "sft"),
            "threads": threads,
            "seed": seed,
            "steps": steps or QUICKSTART_SFT_STEPS,
        },
        extra,
        "sft",
    )
    grpo_config = _stage_config(
        GRPORecipeConfig,
        {
            **QUICKSTART_GRPO,
            "output_dir": str(out / "grpo"),
            "threads": threads,
            "seed": seed,
            "steps": rl_steps or QUICKSTART_GRPO_STEPS,
            "model": {"path": str(out / "sft" / "model")},
            "eval_examples": sft_config.eval_examples,
            "eval_every": curve_every(rl_steps or QUICKSTART_GRPO_STEPS),
        },
        extra,
        "grpo",
    )
    print(f"diffusion-rl quickstart → {out}")
    stop = sft_config.stop_at_accuracy
    until = "" if stop is None else f", stopping at {stop:.0%} held-out accuracy"
    print(
        f"[1/2] masked-diffusion SFT on {sft_config.task.name}, up to {sft_config.steps} steps{until}"
    )
    sft = run_sft(sft_config)
    print(f"      held-out accuracy {sft['eval']['accuracy']:.1%} after {sft['steps']} steps")
    algorithm = grpo_config.policy.algorithm.upper()
    print(f"[2/2] {algorithm} with exact trace replay, {grpo_config.steps} steps")
    grpo = run_grpo(grpo_config)

    credit = TASKS[sft_config.task.name][1].credit_name  # held out: the reward is the answer
    rows = [("after SFT", sft), (f"after {algorithm}", grpo)]
    print(f"\n  stage          held-out accuracy   {credit or '':>11}   time")
    for name, stage in rows:
        cells = "" if credit is None else f"{stage['eval']['credit']:.1%}"
        print(
            f"  {name:<14} {stage['eval']['accuracy']:>17.1%}   {cells:>11}   {stage['elapsed_s']:>4.0f} s"
        )
    if credit is not None:
        print(f"  ({credit}: the held-out fraction right, a measure GRPO does not train on)")
    print("\nsamples after RL (prompt → completion):")
    print(format_samples(grpo["eval"]["samples"]))
    summary = {
        "sft": {
            "accuracy": sft["eval"]["accuracy"],
            "credit": sft["eval"]["credit"],
            "elapsed_s": sft["elapsed_s"],
            "steps": sft["steps"],
        },
        "grpo": {
            "accuracy_before": grpo["accuracy_before"],
            "accuracy_after": grpo["accuracy_after"],
            "credit_before": sft["eval"]["credit"],
            "credit_after": grpo["eval"]["credit"],
            "elapsed_s": grpo["elapsed_s"],
            "steps": grpo["steps"],
        },
        "model_dir": grpo["model_dir"],
    }
    (out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(
        f"\nresults: {out / 'results.json'}; curves: {out / 'sft' / 'curves.png'}, {out / 'grpo' / 'curves.png'}"
    )
    prompt = grpo["eval"]["samples"][0]["prompt"]
    print(
        f"model:   {grpo['model_dir']}  — try: diffusion-rl generate --model {grpo['model_dir']} --prompt {prompt}"
    )
    return summary


# The image quickstart: a small built-in DiT (d_model 64, 3 layers: 254 k parameters) SFT'd
# 5000 steps: until ~3500 it draws shapes at chance (33 %, held-out and train prompts alike),
# and RL from a 3000-step start only memorised the training prompts' shapes (held-out over
# seeds 0-2: +10.5 / -7.5 / -3.3 after 120 AWM steps; training prompts +17 to +23). From
# 5000 steps (~36 % held-out unguided, position learnt, shapes starting) AWM lifts held-out
# shapes from 38 to 59 % (+19.4 / +17.8 overall in 120 steps, seeds 0 and 1). AWM, the
# fastest-learning flow RL method in benchmarks/flow_rl_compare.py, runs on rollouts of the
# serving ODE sampler without guidance, 8 prompts x 16 images per step, lr 3e-4, no EMA (over
# ~100 steps an average lags too far), rewarded 1 only when every attribute is right
# (geneval mode "all", the accuracy the table reports; the mean of the attributes traded
# shapes for positions: -3.3 against 0.0 on seed 2, -7.5 against +1.0 on seed 1). The KL to
# the SFT model at 0.01 (AWM's 0.003 elsewhere): on seed 0 +21.1 with same-prompt diversity
# 5.11 -> 3.92, against +19.4 and 3.56 at 0.003 and +13.5 and 4.02 at 0.03; no setting tried
# kept the diversity (benchmarks/README.md, the image pilots).
QUICKSTART_IMAGE_SFT_STEPS = 5000
# the SFT stage evaluates once, at its end (the table's SFT row): evaluations cost time
QUICKSTART_IMAGE_SFT_EVAL_EVERY = QUICKSTART_IMAGE_SFT_STEPS
QUICKSTART_IMAGE_MODEL = {"d_model": 64, "n_layers": 3, "n_heads": 4}
QUICKSTART_IMAGE_RL_STEPS = 100
# held-out images per prompt in every evaluation (19 prompts: 304 images; at 4, one image
# moved the accuracy by 1.3 points and the before/after difference was mostly noise)
QUICKSTART_IMAGE_EVAL_SAMPLES = 16
QUICKSTART_IMAGE_RL = {
    "policy": {"algorithm": "awm", "kl_beta": 0.01},
    "rewards": [{"name": "geneval", "weight": 1.0, "options": {"mode": "all"}}],
    "prompts_per_step": 8,
    "group_size": 16,
    "sampler": {"guidance_scale": 1.0, "mode": "ode"},
    "optim": {"lr": 3e-4},
}


def run_quickstart_image(
    output_dir: str = "runs/quickstart_image",
    steps: int | None = None,
    rl_steps: int | None = None,
    overrides: list[str] | None = None,
    threads: int | None = None,
    seed: int = 0,
) -> dict:
    """Flow SFT then flow RL on mini-GenEval; ``--set sft.K=V`` / ``rl.K=V`` as above."""
    out = Path(output_dir)
    extra = _stage_overrides(overrides, ("sft", "rl"))
    sft_config = _stage_config(
        FlowSFTRecipeConfig,
        {
            "output_dir": str(out / "flow_sft"),
            "steps": steps or QUICKSTART_IMAGE_SFT_STEPS,
            "threads": threads,
            "seed": seed,
            "model": QUICKSTART_IMAGE_MODEL,
            "eval_samples_per_prompt": QUICKSTART_IMAGE_EVAL_SAMPLES,
            "eval_every": QUICKSTART_IMAGE_SFT_EVAL_EVERY,
        },
        extra,
        "sft",
    )
    rl_config = _stage_config(
        FlowGRPORecipeConfig,
        {
            **QUICKSTART_IMAGE_RL,
            "output_dir": str(out / "rl"),
            "threads": threads,
            "seed": seed,
            "steps": rl_steps or QUICKSTART_IMAGE_RL_STEPS,
            "model": {"path": str(out / "flow_sft" / "model")},
            "eval_samples_per_prompt": sft_config.eval_samples_per_prompt,
            "eval_every": curve_every(rl_steps or QUICKSTART_IMAGE_RL_STEPS),
        },
        extra,
        "rl",
    )
    method = METHOD_NAMES[rl_config.policy.algorithm]
    print(f"diffusion-rl quickstart (image) → {out}")
    print(f"[1/2] rectified-flow SFT of the built-in DiT, {sft_config.steps} steps")
    sft = run_flow_sft(sft_config)
    print(f"      held-out accuracy {sft['eval']['accuracy']:.1%}")
    guidance = rl_config.sampler.guidance_scale
    print(
        f"[2/2] {method} on {rl_config.sampler.mode.upper()} rollouts, {rl_config.steps} steps "
        f"(rollouts and evaluation with guidance {guidance:g})"
    )
    rl = run_flow_grpo(rl_config)

    before, after = rl["attributes_before"], rl["attributes_after"]
    names = [k for k in ("color", "shape", "position", "count", "overall") if k in after]
    rows = [
        (
            f"SFT, guidance {sft_config.sampler.guidance_scale:g}",
            sft["eval"]["attributes"],
            sft["history"][-1],
        ),
        (f"before {method}, guidance {guidance:g}", before, rl["history"][0]),
        (f"after {method}, guidance {guidance:g}", after, rl["history"][-1]),
    ]
    print("\n  held-out accuracy" + " " * 17 + "".join(f"{n:>10}" for n in names) + "  diversity")
    for label, values, record in rows:
        print(
            f"  {label:<33}"
            + "".join(f"{values[n]:>10.1%}" for n in names)
            + f"{record['diversity']:>11.2f}"
        )
    print(
        "  (diversity: the mean pixel distance between the held-out images of one prompt, "
        "which no reward trains)"
    )
    grids = {
        "before": str(out / "rl" / "samples" / "before.png"),
        "after": str(out / "rl" / "samples" / "after.png"),
    }
    summary = {
        "sft": {
            "accuracy": sft["eval"]["accuracy"],
            "attributes": sft["eval"]["attributes"],
            "guidance_scale": sft_config.sampler.guidance_scale,
            "elapsed_s": sft["elapsed_s"],
            "steps": sft["steps"],
        },
        "rl": {
            "algorithm": rl_config.policy.algorithm,
            "guidance_scale": guidance,
            "accuracy_before": rl["accuracy_before"],
            "accuracy_after": rl["accuracy_after"],
            "attributes_before": before,
            "attributes_after": after,
            "diversity_before": rl["history"][0]["diversity"],
            "diversity_after": rl["history"][-1]["diversity"],
            "elapsed_s": rl["elapsed_s"],
            "steps": rl["steps"],
        },
        "grids": grids,
        "model_dir": rl["model_dir"],
    }
    (out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\nresults: {out / 'results.json'}; samples: {grids['before']}, {grids['after']}")
    print(
        f"model:   {rl['model_dir']}  — try: diffusion-rl generate --model {rl['model_dir']} "
        '--prompt "a red circle on the left" --samples 4'
    )
    return summary


# Video SFT: 2000 steps at lr 2e-3 (held-out clip accuracy from rendered first frames 32-39 %
# over seeds 0-2; 3000 steps at lr 1e-3 reached 34-39 % in half as much time again, 1500 at
# lr 1e-3 only 24 %). Image SFT to 1000: its first frames are often ragged (held-out image
# accuracy 4-12 %) and those spoil every attribute of the clip, so the workflow's headroom is
# in the first stage, which only credit through the final video reaches (benchmarks/README.md,
# workflow_credit). The video model's batch stays 32: at 16, RL gained less (+7.8 mean).
QUICKSTART_WORKFLOW_SFT_STEPS = (1000, 2000)  # image, video
QUICKSTART_WORKFLOW_VIDEO_SFT_OPTIM = {"lr": 2e-3}
QUICKSTART_WORKFLOW_RL_STEPS = 120
# Workflow RL: AWM on both stages (a forward-process method: rollouts are the workflow file's
# own ODE samplers, what it serves), 2 prompts x 8 images x 2 videos per step, lr 1e-4 per
# stage, no EMA, 3 forward-noised timesteps per sample (AWM's 6 doubled the learner's time:
# 2.3 s a step against 1.5 s); evaluated on 8 clips per held-out prompt (152: at 4 the curve
# swung by +-4 points between evaluations). With 6 timesteps after a 3000-step video SFT,
# 120 steps moved the final-video score by +12.5 / +13.5 / +14.8 in 13 minutes a run; these
# settings fit 10 minutes (pilots: +8.7 / +14.1 / +8.5). At lr 3e-4, 80 steps: +9.2 / -0.5 /
# +4.5; Flow-GRPO (SDE on the first 4 of 10 steps, lr 1e-4, EMA 0.97), what
# benchmarks/workflow_credit.py measures: 55.5 -> 58.2 % on seed 0 in 40 steps, then flat.
QUICKSTART_WORKFLOW_RL = {
    "policy": {"algorithm": "awm", "timesteps_per_sample": 3},
    "prompts_per_step": 2,
    "group_size": 8,
    "eval_samples_per_prompt": 8,
    "stages": {"image": {"optim": {"lr": 1e-4}}, "video": {"optim": {"lr": 1e-4}}},
}


WORKFLOW_STAGES = ("image_sft", "video_sft", "workflow_rl")
# The serving samplers of the workflow file: 10 ODE steps without guidance (rollouts then need
# no unconditional branch: half the cost of a guided forward). Served with guidance 4 the
# image stage's first frames would raise the SFT workflow's score (0.48 -> 0.57 measured),
# but workflow RL from guided image rollouts lost ground in 40 steps (57.4 -> 52.1 %),
# where from unguided ones it gained.
QUICKSTART_WORKFLOW_SAMPLER = {"num_steps": 10, "shift": 1.0, "guidance_scale": 1.0}


def workflow_file(out: Path, image_model: Path, video_model: Path, task: dict) -> Path:
    """``out/workflow.yaml``: the text → image → video workflow of the two SFT models (model
    paths relative to the file), prompted with the task's examples."""
    import os

    import yaml

    stages = [
        {
            "name": "image",
            "model": os.path.relpath(image_model, out),
            "prompt": "image_prompt",
            "sampler": QUICKSTART_WORKFLOW_SAMPLER,
        },
        {
            "name": "video",
            "model": os.path.relpath(video_model, out),
            "input": "image",
            "fanout": 2,
            "sampler": QUICKSTART_WORKFLOW_SAMPLER,
        },
    ]
    spec = {"name": "text-to-image-to-video", "task": task, "stages": stages}
    out.mkdir(parents=True, exist_ok=True)
    path = out / "workflow.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def run_quickstart_workflow(
    output_dir: str = "runs/quickstart_workflow",
    steps: int | None = None,
    rl_steps: int | None = None,
    overrides: list[str] | None = None,
    threads: int | None = None,
    seed: int = 0,
) -> dict:
    """Image SFT (mini-GenEval position prompts) → video SFT (mini-motion clips, each
    conditioned on its first frame) → ``workflow.yaml`` chaining them → workflow RL of both
    stages from the final video reward. ``--set image_sft.K=V`` / ``video_sft.K=V`` /
    ``workflow_rl.K=V`` override a stage's config; ``steps`` sets both SFT stages."""
    from .config import WorkflowRLRecipeConfig
    from .recipes.workflow_rl import run_workflow_rl
    from .tasks.motion import MotionTask

    out = Path(output_dir)
    extra = parse_overrides(overrides)
    unknown = sorted(set(extra) - set(WORKFLOW_STAGES))
    if unknown:
        raise ValueError(
            f"quickstart --set: keys must start with {', '.join(s + '.' for s in WORKFLOW_STAGES)}"
            f" got {unknown}"
        )
    image_steps, video_steps = (steps, steps) if steps else QUICKSTART_WORKFLOW_SFT_STEPS
    video = _stage_config(
        FlowSFTRecipeConfig,
        {
            "output_dir": str(out / "video_sft"),
            "steps": video_steps,
            "eval_every": video_steps,  # once, at the end: the evaluations cost time, not learning
            "threads": threads,
            "seed": seed,
            "task": {"name": "mini-motion"},
            "batch_size": 32,
            "optim": QUICKSTART_WORKFLOW_VIDEO_SFT_OPTIM,
            "sampler": QUICKSTART_WORKFLOW_SAMPLER,
            "eval_samples_per_prompt": 2,
        },
        extra,
        "video_sft",
    )
    task = MotionTask(video.task.build().config)
    image = _stage_config(
        FlowSFTRecipeConfig,
        {
            "output_dir": str(out / "image_sft"),
            "steps": image_steps,
            "eval_every": image_steps,
            "threads": threads,
            "seed": seed,
            "task": {
                "name": "geneval",
                "kinds": ["position"],
                "image_size": task.config.image_size,
            },
            "batch_size": 32,
            "sampler": QUICKSTART_WORKFLOW_SAMPLER,
            "eval_samples_per_prompt": 2,
        },
        extra,
        "image_sft",
    )
    print(f"diffusion-rl quickstart (workflow: text → image → video) → {out}")
    print(f"[1/3] rectified-flow SFT of the image stage (mini-GenEval), {image.steps} steps")
    image_results = run_flow_sft(image)
    print(f"      held-out image accuracy {image_results['eval']['accuracy']:.1%}")
    print(f"[2/3] rectified-flow SFT of the video stage (mini-motion), {video.steps} steps")
    video_results = run_flow_sft(video)
    print(
        f"      held-out clip accuracy from rendered first frames {video_results['eval']['accuracy']:.1%}"
    )
    path = workflow_file(
        out, Path(image_results["model_dir"]), Path(video_results["model_dir"]), task.info()
    )
    rl = _stage_config(
        WorkflowRLRecipeConfig,
        {
            **QUICKSTART_WORKFLOW_RL,
            "output_dir": str(out / "workflow_rl"),
            "steps": rl_steps or QUICKSTART_WORKFLOW_RL_STEPS,
            "eval_every": curve_every(rl_steps or QUICKSTART_WORKFLOW_RL_STEPS),
            "threads": threads,
            "seed": seed,
            "workflow": str(path),
        },
        extra,
        "workflow_rl",
    )
    method = METHOD_NAMES[rl.policy.algorithm]
    print(f"[3/3] {method} on both stages from the final video reward, {rl.steps} steps")
    results = run_workflow_rl(rl)
    before, after = results["attributes_before"], results["attributes_after"]
    first, last = results["history"][0], results["history"][-1]
    print("\n  held-out final videos" + "".join(f"{n:>10}" for n in after) + "   score   image")
    for label, values, record in (
        ("before workflow RL", before, first),
        ("after workflow RL", after, last),
    ):
        print(
            f"  {label:<21}"
            + "".join(f"{values[n]:>10.1%}" for n in after)
            + f"{record['reward_mean']:>8.1%}{record['image_accuracy']:>8.1%}"
        )
    print(
        "  (score: the fraction of the five attributes right, averaged over the clips; image: "
        "the first frames judged by the image verifier, which no reward does)"
    )
    summary = {
        "image_sft": {k: image_results[k] for k in ("steps", "elapsed_s")}
        | {"accuracy": image_results["eval"]["accuracy"]},
        "video_sft": {k: video_results[k] for k in ("steps", "elapsed_s")}
        | {"accuracy": video_results["eval"]["accuracy"]},
        "workflow_rl": {
            k: results[k]
            for k in (
                "steps",
                "elapsed_s",
                "accuracy_before",
                "accuracy_after",
                "attributes_before",
                "attributes_after",
                "image_accuracy_before",
                "image_accuracy_after",
                "previews",
            )
        }
        | {"score_before": first["reward_mean"], "score_after": last["reward_mean"]},
        "workflow": results["workflow"],
    }
    (out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\nresults: {out / 'results.json'}; previews: {', '.join(results['previews'])}")
    print(
        f"workflow: {results['workflow']}  — try: diffusion-rl generate --workflow "
        f'{results["workflow"]} --prompt "a red circle moving left fast" --samples 2'
    )
    return summary
