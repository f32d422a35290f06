"""Recipe: Flow-GRPO on every stage of a multi-stage workflow, from one final reward.

Each step the workflow runs with its stages' *rollout weights* and capture on — the very
:meth:`~diffusion_rl.workflows.Workflow.run` that serves it — as a tree
(:func:`~diffusion_rl.rollout.collect_workflow_rollout`): per train prompt ``group_size``
first-stage samples, and per row ``fanout`` samples of each later stage. The final videos
are scored by the configured rewards; the video stage's advantage is computed among the
videos of one image, the image stage's from the mean final reward of its videos. One
:class:`~diffusion_rl.train.learner.PolicyLearner` with one stage per *trained* model
replays each stage's SDE steps with that stage's pinned kernels, against its own reference
and snapshot, and takes one step of one trainer whose parts are the stages (each with its
own optimizer settings, schedule and clip, each stage's loss normalised over its own steps).
Then every trained stage's rollout weights are synced, each with its own version; a frozen
stage keeps version 0.

A stage with ``ema_decay`` keeps an exponential moving average of its weights, updated after
every step (rollouts still run the live weights); evaluation serves it and the model directory
saves it.

What is evaluated is what is saved: a stage's EMA where it keeps one, else its rollout
weights (for the forward-process methods the old policy that lags the trained weights;
for Flow-GRPO a copy of them). Evaluation serves the workflow with its own samplers on the
held-out prompts at fixed seeds:
per-attribute accuracy of the final clips, the first stage's image accuracy (a diagnostic),
and previews ``samples/<tag>.gif`` (animated) and ``samples/<tag>.png`` (frame strips).
The model directory holds one directory per stage and a ``workflow.yaml`` that serves them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml
from pydantic import ValidationError
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from ..config import ConfigError, WorkflowRLRecipeConfig
from ..evaluation import evaluate_workflow
from ..models.io import save_model
from ..models.manifest import write_manifest
from ..plots import plot_curve_groups, save_video_gif, save_video_strip
from ..rewards import CombinedReward, get_reward
from ..rollout import collect_workflow_rollout
from ..sampling.flow import FlowSamplerConfig
from ..tasks.motion import MotionTask
from ..train.learner import LearnerStage, PolicyLearner
from ..train.parallel import run_parallel
from ..train.plans import flow_plan
from ..train.roles import PolicyRoles, frozen_copy
from ..train.trainer import OptimConfig, Trainer
from ..workflows import Workflow, WorkflowError, load_stage_model, load_workflow_spec
from .common import before_after, eval_record
from .run import Recipe, _one_name_per_value, run

WORKFLOW_FILE = "workflow.yaml"


class WorkflowRLRecipe(Recipe):
    name = "workflow-rl"
    eval_before = True
    curves = ("rollout/reward_mean", "eval/accuracy", "eval/image_accuracy")
    attributes = ("color", "shape", "direction", "speed", "smooth")

    def __init__(self, config: WorkflowRLRecipeConfig) -> None:
        self.config = config
        try:
            spec, self.workflow_file = load_workflow_spec(config.workflow)
        except WorkflowError as error:
            raise ConfigError(str(error)) from None
        names = [stage.name for stage in spec.stages]
        for name in [*config.stages, *config.fanout]:
            if name not in names:
                raise ConfigError(
                    f"stages.{name}: the workflow {config.workflow} has no stage {name!r} "
                    f"(its stages: {names})"
                )
        if spec.task is None:
            raise ConfigError(
                f"workflow: {self.workflow_file} names no task; workflow-rl takes its prompts "
                "from the workflow's task (set task: {name: mini-motion, ...})"
            )
        self.task = MotionTask.from_info(spec.task)
        self.spec = spec
        self.title = f"workflow RL ({' → '.join(names)}) on {self.task.name}"
        settings = {name: config.stages.get(name) for name in names}
        models = {}
        for stage in spec.stages:
            try:
                models[stage.name] = load_stage_model(stage).to(config.device)
            except WorkflowError as error:
                raise ConfigError(f"workflow: {error}") from None
        self.trained = [n for n in names if settings[n] is None or settings[n].train]
        if not self.trained:
            raise ConfigError("stages: every stage is frozen (train: false); nothing to train")
        for name in names:
            if name not in self.trained and settings[name].ema_decay is not None:
                raise ConfigError(
                    f"stages.{name}.ema_decay: the stage is frozen (train: false), so there is "
                    "nothing to average; drop ema_decay or train the stage"
                )
        policies = {name: config.stage_policy(name) for name in names}
        self.rollout_samplers = {
            stage.name: _rollout_sampler(stage, settings[stage.name], policies[stage.name])
            for stage in spec.stages
        }
        self.fanout = {s.name: config.fanout.get(s.name, s.fanout) for s in spec.stages[1:]}
        self.roles = {
            name: PolicyRoles(models[name], reference=policies[name].uses_reference)
            for name in self.trained
        }
        plans = {
            name: flow_plan(
                policies[name], reduction=self.rollout_samplers[name].reduction, seed=config.seed
            )
            for name in self.trained
        }
        stages = {name: LearnerStage(self.roles[name], plans[name]) for name in self.trained}
        optims = {
            name: (settings[name].optim if settings[name] else OptimConfig(lr=1e-4, grad_clip=1.0))
            for name in self.trained
        }

        def make_trainer(actors: torch.nn.Module) -> Trainer:
            return Trainer(
                actors,
                None,
                OptimConfig(),
                precision=config.precision,
                seed=config.seed,
                device=config.device,
                parts=optims,
                parallel=run_parallel(config.distributed),
            )

        self.learner = PolicyLearner.staged(
            stages, make_trainer, allow_off_policy=config.allow_off_policy, seed=config.seed
        )
        self.trainer = self.learner.trainer
        # rollouts (and evaluation) run the stages' rollout weights; a frozen stage its model
        for name in names:
            if name not in self.roles:
                models[name] = frozen_copy(models[name])
        self.models = models
        rollout_models = {n: self.roles[n].rollout if n in self.roles else models[n] for n in names}
        self.workflow = Workflow(spec, rollout_models, task=self.task)
        self.ema = {
            name: AveragedModel(
                rollout_models[name],
                multi_avg_fn=get_ema_multi_avg_fn(settings[name].ema_decay),
            )
            for name in self.trained
            if settings[name] is not None and settings[name].ema_decay is not None
        }
        # evaluated and saved: a stage's EMA where it keeps one, else its rollout weights
        served = {n: self.ema[n].module if n in self.ema else rollout_models[n] for n in names}
        self.served_workflow = Workflow(spec, served, task=self.task) if self.ema else self.workflow
        self.reward_fn = CombinedReward(
            [(get_reward(r.name, **r.options), r.weight) for r in config.rewards]
        )
        self.image_task = self.task.image_task()
        self.metadata = {
            "objective": flow_plan(config.policy, reduction="mean").objective.metadata(),
            "workflow": spec.model_dump(mode="json", exclude={"stages": {"__all__": {"model"}}}),
            "trained": self.trained,
            "samplers": {k: v.model_dump(mode="json") for k, v in self.rollout_samplers.items()},
            "task": self.task.info(),
            "rewards": [r.model_dump() for r in config.rewards],
            "group_size": config.group_size,
            "fanout": self.fanout,
            "prompts_per_step": config.prompts_per_step,
        }
        own = {n: p.objective.metadata() for n, p in plans.items() if policies[n] != config.policy}
        if own:  # stages with their own objective
            self.metadata["stage_objectives"] = own
        self.out = Path(config.output_dir)

    # ------------------------------------------------------------------ the loop's hooks
    def describe(self) -> str:
        cfg = self.config
        sizes = ", ".join(
            f"{n} {sum(p.numel() for p in self.models[n].parameters()):,} params"
            f"{'' if n in self.roles else ' (frozen)'}"
            for n in self.models
        )
        tree = " × ".join([str(cfg.group_size), *map(str, self.fanout.values())])
        return (
            f"workflow-rl on {self.task!r}: {sizes}; {cfg.prompts_per_step} prompts × {tree} "
            f"rollouts per step; rewards {self.reward_fn!r}"
        )

    def steps_done(self) -> int:
        return self.learner.rollout_step

    def versions(self) -> dict[str, int]:
        return {name: self.roles[name].version if name in self.roles else 0 for name in self.models}

    def _diagnostics(self, run) -> dict[str, float]:
        first = next(iter(run.stages.values()))
        prompts = [e.image_prompt for e in run.examples_of(first.name)]
        correct = self.image_task.rewards(first.artefact, prompts, mode="all")
        final = run.final
        accuracy = self.task.accuracy(final.artefact, run.examples_of(final.name))
        stats = {"rollout/image_accuracy": float(correct.mean())}
        stats.update({f"rollout/{k}": v for k, v in accuracy.items()})
        return stats

    def step(self) -> dict[str, float]:
        cfg = self.config
        # sample at the learner's precision (autocast, or FSDP's compute dtype): parity 0
        with self.trainer.autocast(), contextlib.ExitStack() as stack:
            for roles in self.roles.values():
                stack.enter_context(roles.sampling())
            rollout, self.position = collect_workflow_rollout(
                self.workflow,
                self.reward_fn,
                start_prompt=self.position,
                num_prompts=cfg.prompts_per_step,
                group_size=cfg.group_size,
                versions=self.versions(),
                seed=cfg.seed,
                advantage=cfg.policy.advantage_spec,
                fanout=self.fanout,
                samplers=self.rollout_samplers,
                diagnostics=self._diagnostics,
            )
        metrics = self.learner.step_stages({n: rollout.stages[n] for n in self.trained})
        for name, average in self.ema.items():  # after the sync: the new rollout weights
            average.update_parameters(self.roles[name].rollout)
        metrics.update(rollout.stats)
        return _one_name_per_value(metrics, self.learner.num_iterations)

    def postfix(self, metrics: dict[str, float]) -> dict[str, str]:
        return {"reward": f"{metrics['rollout/reward_mean']:.3f}"}

    def evaluate(self, tag: str):
        step = self.steps_done()
        name = f"step_{step:06d}" if tag == "step" else tag
        result = evaluate_workflow(
            self.served_workflow,
            samples_per_prompt=self.config.eval_samples_per_prompt,
            seed=self.config.eval_seed,
        )
        self.final = result
        record, metrics = eval_record(result, step)
        record["image_accuracy"] = result.image_accuracy
        metrics["eval/image_accuracy"] = result.image_accuracy
        count = min(self.config.preview_clips, result.num_clips)
        if count:
            samples = self.out / "samples"
            captions = result.prompts[:count]
            save_video_strip(result.clips[:count], samples / f"{name}.png", captions=captions)
            save_video_gif(result.clips[:count], samples / f"{name}.gif")
            record["grid"] = f"samples/{name}.png"
            record["gif"] = f"samples/{name}.gif"
        return record, metrics

    def state(self) -> dict[str, Any]:
        state = {"position": self.position, "versions": self.versions()}
        if self.ema:
            state["ema"] = {name: average.state_dict() for name, average in self.ema.items()}
        lagging = {name: roles.rollout_state() for name, roles in self.roles.items()}
        lagging = {name: weights for name, weights in lagging.items() if weights is not None}
        if lagging:  # rollout weights that lag their actor (the forward-process methods)
            state["rollout_weights"] = lagging
        return state

    def load_state(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])
        lagging = state.get("rollout_weights", {})
        for name, roles in self.roles.items():
            roles.restore(int(state["versions"][name]), lagging.get(name))
        for name, average in self.ema.items():
            average.load_state_dict(state["ema"][name])

    def plot(self, out: Path, history) -> Path:
        """``curves.png``: the rollout reward and each attribute's rollout accuracy, the
        held-out accuracy per attribute, and per stage the KL and gradient norm."""
        groups = {
            "rollout reward and attributes": [
                "rollout/reward_mean",
                *(f"rollout/{a}" for a in self.attributes),
            ],
            "held-out final videos": [
                "eval/accuracy",
                "eval/image_accuracy",
                *(f"eval/{a}" for a in self.attributes),
            ],
            "KL per stage": [f"{n}/flow_grpo/kl" for n in self.trained],
            "grad norm per stage": [f"grad_norm/{n}" for n in self.trained],
        }
        return plot_curve_groups(out / "metrics.jsonl", out / "curves.png", groups, self.title)

    def save_model(self, directory) -> None:
        """One model directory per stage and a ``workflow.yaml`` serving them (paths
        relative to it, the workflow's own serving samplers)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        stages = []
        for stage in self.spec.stages:
            info = {"workflow_stage": stage.name, "trained_steps": self.steps_done()}
            if stage.name in self.ema:
                model = self.ema[stage.name].module
                info["ema_decay"] = self.config.stages[stage.name].ema_decay
            elif stage.name in self.roles:  # what rolled out and was evaluated: for the
                model = self.roles[stage.name].rollout  # forward methods a lagging average
            else:
                model = self.models[stage.name]
            save_model(directory / stage.name, model, info)
            stages.append({**stage.model_dump(mode="json"), "model": stage.name})
        spec = {"name": self.spec.name, "task": self.spec.task, "stages": stages}
        (directory / WORKFLOW_FILE).write_text(yaml.safe_dump(spec, sort_keys=False))
        write_manifest(directory, self.steps_done())  # every stage's files too, written last

    def results(self, history) -> dict[str, Any]:
        return {
            **before_after(history, "image_accuracy"),
            "eval": self.final.to_dict(),
            "trained_stages": self.trained,
            "weights_versions": self.versions(),
            "workflow": str(self.out / "model" / WORKFLOW_FILE),
            "previews": sorted(str(p) for p in (self.out / "samples").glob("*.gif")),
        }


def _rollout_sampler(stage, settings, policy) -> FlowSamplerConfig:
    """The stage's rollout sampler: the workflow file's serving sampler (as SDE for
    Flow-GRPO, whose rollouts need SDE steps; as it is for the forward-process methods), with
    this run's overrides (``stages.NAME.sampler``); a bad value is a ConfigError naming the
    key."""
    overrides = settings.sampler if settings is not None else {}
    sde = policy.algorithm == "flow_grpo"
    if sde and overrides.get("mode", "sde") != "sde":
        raise ConfigError(
            f"stages.{stage.name}.sampler.mode: Flow-GRPO rollouts need SDE steps; leave mode "
            "out (it is sde), or train the stage with a forward-process policy.algorithm"
        )
    try:
        sampler = FlowSamplerConfig.model_validate(
            {**stage.sampler.model_dump(), **({"mode": "sde"} if sde else {}), **overrides}
        )
    except ValidationError as error:
        item = error.errors()[0]
        key = ".".join(map(str, item["loc"])) or "sampler"
        raise ConfigError(f"stages.{stage.name}.sampler.{key}: {item['msg']}") from None
    if sampler.mode == "ode" and sampler.share_group_noise:
        raise ConfigError(
            f"stages.{stage.name}.sampler.share_group_noise: ODE rollouts of a group from one "
            "start noise are one artefact repeated (every advantage 0); set it false"
        )
    return sampler


def run_workflow_rl(
    config: WorkflowRLRecipeConfig, echo: Callable[[str], None] = print
) -> dict[str, Any]:
    """Train, evaluate, save; returns (and writes) ``results.json``."""
    return run(config, WorkflowRLRecipe, echo)
