"""Workflow text → image → video: serving vs rollout with capture vs the staged learner.

On the built-in two-stage workflow of the ``workflow-rl`` recipe, built here at its default
sizes with random weights (FlowDiT image stage and VideoDiT image-to-video stage: 16 px,
patches of 4, 96 wide, 4 layers; the video stage makes 4 frames; their zero-initialised layers
given small random values so that a fresh model does not predict exactly 0), on mini-motion
train prompts, in one run:

* ``serving_clips_per_s``: ``Workflow.run(prompts, seeds)`` with the serving samplers (ODE,
  ``--steps`` steps, guidance ``--guidance``, shift 1, both stages) on ``--batch`` clips;
* ``rollout_clips_per_s``: the same call with ``capture=True`` and the rollout samplers (mode
  ``sde``, the same steps and guidance); ``rollout_over_serving`` = time ratio;
  ``capture_over_no_capture`` = ODE with capture ÷ ODE without (the cost of capture alone);
* learner: per step a tree rollout (``collect_workflow_rollout``: ``--prompts`` prompts ×
  ``--group-size`` images × ``--fanout`` videos per image, captured, scored by the ``motion``
  reward) and one ``PolicyLearner.step_stages`` (Flow-GRPO with β ``--beta``: exact replay
  of every trained SDE step with gradient, the frozen reference's forward, backward, one
  optimizer step per stage part, rollout-weight sync), for three learners side by side: both
  stages trained, only the image stage, only the video stage (the other frozen);
* memory: the process's peak RSS (``ru_maxrss``) at the end, and the bytes of the captured
  traces (every tensor of each stage's trace) per clip.

Timings are medians of ``--reps`` repetitions after a warm-up, on ``--clock``: this process's
CPU time by default with one thread on the CPU (the work done, nearly independent of other
processes' load), else wall time. Within a repetition the three serving phases run as a
palindrome (each twice, A B C C B A, its time the mean of the two) and the learners in
alternating order, so load drift hits them alike; every ratio is the median over repetitions
of that repetition's ratio. Compare the ratios; absolute numbers are context. Prints one JSON
object as the last line of stdout.

    python benchmarks/workflow.py            # ~75 s on 2 shared CPU cores, one thread
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import resource
import statistics
import sys

import torch
from flow import CLOCKS, environment, fill_zero_layers, log, timed  # benchmarks/flow.py

from diffusion_rl.config.sections import FlowModelSection
from diffusion_rl.objectives.flow_grpo import FlowGRPOConfig, FlowGRPOLoss
from diffusion_rl.recipes.common import new_flow_model
from diffusion_rl.rewards import CombinedReward, get_reward
from diffusion_rl.rollout import collect_workflow_rollout
from diffusion_rl.sampling.flow import FlowSamplerConfig
from diffusion_rl.tasks.motion import MotionConfig, MotionTask
from diffusion_rl.train.learner import LearnerStage, PolicyLearner
from diffusion_rl.train.plans import FlowPolicyPlan
from diffusion_rl.train.roles import PolicyRoles, frozen_copy
from diffusion_rl.train.trainer import OptimConfig, Trainer
from diffusion_rl.workflows import StageSpec, Workflow, WorkflowSpec

STAGES = ("image", "video")
LEARNERS = {"both": STAGES, "image": ("image",), "video": ("video",)}
TRACE_BYTES_METHOD = (
    "sum of nbytes of every tensor of each stage's FlowTrace (latents [B, N+1, *latent], cond, "
    "uncond, behaviour_logprobs, sigmas, sde_steps, seeds, forward_groups) of the rollout-with-"
    "capture run, divided by its number of clips"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16, help="clips per serving batch")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--guidance", type=float, default=4.0)
    parser.add_argument("--noise-level", type=float, default=0.7)
    parser.add_argument("--image-size", type=int, default=16)
    parser.add_argument("--frames", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=2, help="learner: prompts per step")
    parser.add_argument("--group-size", type=int, default=4, help="learner: images per prompt")
    parser.add_argument("--fanout", type=int, default=2, help="learner: videos per image")
    parser.add_argument("--beta", type=float, default=0.004, help="KL weight (0: no reference)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        help="what timings measure (default: cpu with one thread, else wall)",
    )
    args = parser.parse_args(argv)
    for flag in ("batch", "steps", "prompts", "group_size", "fanout", "reps", "threads"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}: expected an integer >= 1")
    if args.group_size < 2:
        parser.error("--group-size: expected at least 2 (group advantages need a group)")
    return args


def build_models(task: MotionTask, seed: int) -> dict[str, torch.nn.Module]:
    """The flow-sft recipe's new models at the default sizes (``FlowModelSection``): the
    FlowDiT of the first-frame task and the VideoDiT of ``task``, random weights, zero layers
    filled."""
    section = FlowModelSection()
    torch.manual_seed(seed)
    image, video = new_flow_model(section, task.image_task()), new_flow_model(section, task)
    return {"image": fill_zero_layers(image).eval(), "video": fill_zero_layers(video).eval()}


def workflow_spec(task: MotionTask, serving: FlowSamplerConfig) -> WorkflowSpec:
    return WorkflowSpec(
        name="text-to-image-to-video",
        task=task.info(),
        stages=[
            StageSpec(name="image", model="image", prompt="image_prompt", sampler=serving),
            StageSpec(name="video", model="video", input="image", sampler=serving),
        ],
    )


def trace_bytes(trace) -> dict[str, int]:
    """nbytes of one trace's tensors: latents, cond, uncond and the rest."""

    def size(mapping) -> int:
        return sum(t.numel() * t.element_size() for t in (mapping or {}).values())

    rest = (trace.behaviour_logprobs, trace.sigmas, trace.sde_steps, trace.seeds)
    return {
        "latents": trace.latents.numel() * trace.latents.element_size(),
        "cond": size(trace.cond),
        "uncond": size(trace.uncond),
        "other": sum(t.numel() * t.element_size() for t in (*rest, trace.forward_groups)),
    }


class StagedRun:
    """One staged learner (``trained`` stages; the others frozen) with its own copies of the
    models, its workflow over the rollout weights, and its position in the prompt stream."""

    def __init__(self, args, spec, task, models, trained, rollout_samplers, reward_fn) -> None:
        self.args, self.trained, self.task = args, trained, task
        self.samplers, self.reward_fn, self.position = rollout_samplers, reward_fn, 0
        policy = FlowGRPOConfig(beta=args.beta)
        self.advantage = policy.advantage_spec
        self.roles = {
            name: PolicyRoles(copy.deepcopy(models[name]), reference=args.beta > 0)
            for name in trained
        }
        stages = {
            name: LearnerStage(
                self.roles[name],
                FlowPolicyPlan(
                    FlowGRPOLoss(policy, reduction=rollout_samplers[name].reduction),
                    seed=args.seed,
                ),
            )
            for name in trained
        }
        optims = {name: OptimConfig(lr=args.lr, grad_clip=1.0) for name in trained}

        def make_trainer(actors):
            return Trainer(actors, None, OptimConfig(), seed=args.seed, parts=optims)

        self.learner = PolicyLearner.staged(stages, make_trainer, seed=args.seed)
        rollout_models = {
            name: self.roles[name].rollout if name in self.roles else frozen_copy(models[name])
            for name in STAGES
        }
        self.workflow = Workflow(spec, rollout_models, task=task)

    def versions(self) -> dict[str, int]:
        return {n: self.roles[n].version if n in self.roles else 0 for n in STAGES}

    def rollout(self):
        rollout, self.position = collect_workflow_rollout(
            self.workflow,
            self.reward_fn,
            start_prompt=self.position,
            num_prompts=self.args.prompts,
            group_size=self.args.group_size,
            versions=self.versions(),
            seed=self.args.seed,
            advantage=self.advantage,
            fanout={"video": self.args.fanout},
            samplers=self.samplers,
        )
        return rollout

    def step(self, rollout) -> dict[str, float]:
        return self.learner.step_stages({n: rollout.stages[n] for n in self.trained})


def rss_mb() -> float | None:
    """The process's current resident set (Linux ``/proc/self/status`` VmRSS), else None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(args.threads)
    clock = args.clock or ("cpu" if torch.get_num_threads() == 1 else "wall")
    load_before = os.getloadavg()[0]
    task = MotionTask(MotionConfig(image_size=args.image_size, num_frames=args.frames))
    models = build_models(task, args.seed)
    rss_start = rss_mb()
    base = {"num_steps": args.steps, "guidance_scale": args.guidance, "shift": 1.0}
    serving = FlowSamplerConfig(**base)
    rollout_sampler = FlowSamplerConfig(**base, mode="sde", noise_level=args.noise_level)
    spec = workflow_spec(task, serving)
    workflow = Workflow(spec, models, task=task)
    prompts = [task.example(i, "train") for i in range(args.batch)]
    seeds = list(range(args.batch))
    sde = {name: rollout_sampler for name in STAGES}
    reward_fn = CombinedReward([(get_reward("motion"), 1.0)])
    log(
        f"FlowDiT {models['image'].num_parameters():,} + VideoDiT "
        f"{models['video'].num_parameters():,} parameters, {torch.get_num_threads()} thread(s), "
        f"clock {clock}"
    )

    serving_phases = {
        "serving": lambda: workflow.run(prompts, seeds),
        "ode_capture": lambda: workflow.run(prompts, seeds, capture=True),
        "rollout": lambda: workflow.run(prompts, seeds, capture=True, samplers=sde),
    }
    runs = {
        kind: StagedRun(args, spec, task, models, trained, sde, reward_fn)
        for kind, trained in LEARNERS.items()
    }

    # warm-up: every phase once (pages in the kernels' code, builds the optimizer states)
    for fn in serving_phases.values():
        fn()
    for run in runs.values():
        run.step(run.rollout())

    times: dict[str, list[float]] = {name: [] for name in serving_phases}
    for kind in runs:
        times[f"{kind}_rollout"], times[f"{kind}_step"] = [], []
    captured = None
    last_metrics: dict[str, dict[str, float]] = {}
    order = list(serving_phases)
    for rep in range(args.reps):
        elapsed = dict.fromkeys(order, 0.0)
        for name in order + order[::-1]:  # a palindrome: linear load drift hits each alike
            seconds, out = timed(serving_phases[name], "cpu", clock)
            elapsed[name] += seconds / 2
            if name == "rollout":
                captured = out
        for name in order:
            times[name].append(elapsed[name])
        kinds = list(runs) if rep % 2 == 0 else list(runs)[::-1]
        for kind in kinds:
            run = runs[kind]
            seconds, rollout = timed(run.rollout, "cpu", clock)
            times[f"{kind}_rollout"].append(seconds)
            seconds, last_metrics[kind] = timed(functools.partial(run.step, rollout), "cpu", clock)
            times[f"{kind}_step"].append(seconds)
        log(
            f"rep {rep + 1}/{args.reps}: "
            + ", ".join(f"{n} {v[-1]:.3f}s" for n, v in times.items())
        )
    median = {name: statistics.median(values) for name, values in times.items()}

    def paired(numerator: str, *denominator: str) -> float:
        """The median over repetitions of one repetition's time ratio (pairs share the load)."""
        per_rep = zip(times[numerator], *(times[d] for d in denominator))
        return round(statistics.median(t[0] / sum(t[1:]) for t in per_rep), 3)

    # correctness beside the timings: capture changes no artefact (the learner's metrics
    # below say that every stage's replay equals its rollout: parity 0, ratio 1)
    plain = workflow.run(prompts, seeds)
    captured_ode = workflow.run(prompts, seeds, capture=True)
    capture_identical = all(
        torch.equal(plain.stages[n].artefact, captured_ode.stages[n].artefact) for n in STAGES
    )
    per_stage = {name: trace_bytes(captured.stages[name].trace) for name in STAGES}
    clips = args.batch
    total_bytes = sum(sum(parts.values()) for parts in per_stage.values())
    videos = args.prompts * args.group_size * args.fanout
    images = args.prompts * args.group_size
    both = last_metrics["both"]
    learner_step = {kind: round(median[f"{kind}_step"], 4) for kind in runs}
    report = {
        "benchmark": "workflow",
        "clock": clock,
        "serving_clips_per_s": round(clips / median["serving"], 2),
        "rollout_clips_per_s": round(clips / median["rollout"], 2),
        "ode_capture_clips_per_s": round(clips / median["ode_capture"], 2),
        "rollout_over_serving": paired("rollout", "serving"),
        "capture_over_no_capture": paired("ode_capture", "serving"),
        "capture_artefacts_identical": capture_identical,
        "learner_rollout_s": {kind: round(median[f"{kind}_rollout"], 4) for kind in runs},
        "learner_step_s": learner_step,
        "learner_step_over_rollout": {
            kind: paired(f"{kind}_step", f"{kind}_rollout") for kind in runs
        },
        "learner_both_over_image_plus_video": paired("both_step", "image_step", "video_step"),
        "learner_step_per_clip_s": round(median["both_step"] / videos, 5),
        "learner_metrics_last_step": {
            f"{name}/{key}": both[f"{name}/{key}"]
            for name in STAGES
            for key in (
                "weights_version",
                "learner/micro_batches",
                "flow_grpo/ratio_mean",
                "flow_grpo/parity_max_abs",
            )
            if f"{name}/{key}" in both
        },
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "rss_mb_after_imports_and_models": rss_start,
        "trace_bytes_per_clip": round(total_bytes / clips),
        "trace_bytes_per_clip_by_stage": {
            name: {part: round(n / clips) for part, n in parts.items()}
            for name, parts in per_stage.items()
        },
        "trace_bytes_method": TRACE_BYTES_METHOD,
        "settings": {
            "batch_clips": clips,
            "steps": args.steps,
            "guidance_scale": args.guidance,
            "shift": 1.0,
            "noise_level": args.noise_level,
            "learner_tree": {
                "prompts": args.prompts,
                "group_size": args.group_size,
                "fanout": args.fanout,
                "images": images,
                "videos": videos,
            },
            "beta": args.beta,
            "lr": args.lr,
            "reps": args.reps,
            "seed": args.seed,
        },
        "seconds": {name: [round(t, 4) for t in values] for name, values in times.items()},
        "models": {
            name: {
                "class": type(model).__name__,
                "parameters": model.num_parameters(),
                "latent_shape": list(model.latent_shape),
            }
            for name, model in models.items()
        },
        "environment": environment("cpu", load_before),
    }
    return report


if __name__ == "__main__":
    print(json.dumps(main()))
