"""Recipe: Flow-GRPO of a flow model on mini-GenEval or on a prompt list from a local file.

Each step the *rollout weights* (version v, stamped into the trace) sample ``group_size``
images per train prompt with the serving sampler in ``mode="sde"`` and capture on
(:func:`collect_rollout` with a :class:`FlowSource`); the images are scored by the configured
image rewards and turned into group advantages; the :class:`PolicyLearner` with the
:class:`FlowPolicyPlan` replays the trained SDE steps exactly (same kernel, same forward
groups), against the start-of-step snapshot for μ > 1 and the frozen reference for β > 0,
takes μ trainer steps and syncs the rollout weights (version v + 1).

Evaluation: held-out prompts with the ODE sampler at fixed seeds, before training, every
``eval_every`` steps and at the end, with grids ``samples/before.png``, ``step_N.png``,
``after.png``. With ``ema_decay`` the evaluated and saved model is an exponential moving
average of the actor's weights (``AveragedModel``, updated after every learner step and kept
in the checkpoints); rollouts always use the live actor. On the run loop.

The model (``model.path``) is a built-in flow model directory or a local diffusers pipeline
directory (SD3, FLUX, Wan text-to-video; docs/flow_models.md), trained in full or, with
``model.lora``, as a LoRA whose reference (β > 0) is the same model with its LoRA switched off
(no second copy). A pipeline makes images at the task's size (checked); a Wan clip is scored
frame by frame (:class:`~diffusion_rl.recipes.flow_models.FrameMeanReward`). The final model
of a pipeline run is a pipeline model directory (the base path and the trained weights).

A prompt list (``task: {name: prompts, path: FILE}``,
:class:`~diffusion_rl.tasks.datasets.PromptFileTask`) trains on the file's ``"train"``
prompts and evaluates on its held-out ones. It has no verifier: the rewards are reward models
or others that need none (checked at config load and again for a task recorded in the model
directory); rollouts report the rewards only; evaluation reports the configured rewards'
weighted mean (``eval/reward_mean``) and each term's (``eval/<name>``, e.g. ``eval/ocr``) on
the held-out prompts at fixed seeds, and ``results.json`` has ``reward_mean_before`` /
``_after`` and ``rewards_before`` / ``_after``. The images are the model's size
(docs/flow_models.md).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from ..config import ConfigError, FlowGRPORecipeConfig, prompt_task_reward_problems
from ..rewards import CombinedReward, get_reward
from ..rollout import FlowSource
from ..train.learner import PolicyLearner
from ..train.plans import flow_plan
from ..train.roles import PolicyRoles
from .common import (
    FlowActor,
    FrameMeanReward,
    PromptSource,
    before_after,
    check_model_fits_task,
    check_model_takes_prompts,
    evaluate_image_model,
    evaluate_prompt_model,
    flow_start,
    image_task,
    load_builtin,
    load_pipeline_actor,
    pipeline_eval_record,
    rollout_source,
    trainer_factory,
    verified,
    weights_digest,
    with_lora,
)
from .run import OnPolicyRecipe, run

METHOD_NAMES = {"flow_grpo": "Flow-GRPO", "nft": "DiffusionNFT", "awm": "AWM", "dgpo": "DGPO"}


class FlowGRPORecipe(OnPolicyRecipe):
    name = "flow-grpo"
    curves = ("rollout/reward_mean", "eval/accuracy", "flow_grpo/kl", "flow_grpo/clip_frac")
    # a prompt list has no verifier: its held-out curve is the configured rewards' mean
    prompt_curves = (
        "rollout/reward_mean",
        "eval/reward_mean",
        "flow_grpo/kl",
        "flow_grpo/clip_frac",
    )

    def __init__(self, config: FlowGRPORecipeConfig) -> None:
        self.config = config
        policy, sampler = config.policy, config.sampler
        start = flow_start(config.model)
        if start.pipeline:
            if config.ema_decay is not None:
                raise ConfigError(
                    "ema_decay: not supported for pipeline models (the average would copy the "
                    "whole pipeline); set ema_decay: null"
                )
            self.task = task = image_task(config.task, start.info, config.model.path)
            self.verified = verified(task)
            _check_rewards(config, task)
            model, options, scale = load_pipeline_actor(config.model, start, task, seed=config.seed)
            self.actor = FlowActor(model, start.kind, start, config.model.dtype, options, scale)
        else:
            loaded = load_builtin(config.model)
            self.task = task = image_task(config.task, loaded.info, config.model.path)
            self.verified = verified(task)
            _check_rewards(config, task)
            if self.verified:
                check_model_fits_task(loaded.model, task, "model.path")
            else:
                check_model_takes_prompts(loaded.model, task, "model.path")
            model = with_lora(loaded.model, config.model, "model", config.seed)
            self.actor = FlowActor(model, "builtin", start)
        method = METHOD_NAMES[policy.algorithm]
        self.title = f"{method} on {task.name}"
        if policy.algorithm != "flow_grpo":  # the forward-process methods' own diagnostics
            prefix = policy.algorithm
            self.curves = ("rollout/reward_mean", "eval/accuracy", f"{prefix}/policy_loss")
            self.prompt_curves = (
                "rollout/reward_mean",
                "eval/reward_mean",
                f"{prefix}/policy_loss",
            )
        if not self.verified:
            self.curves = self.prompt_curves
            self.title = f"{method} on the prompts of {Path(task.config.path).name}"
        self.actor.check_activation_checkpointing(config.activation_checkpointing)
        self.model = model = self.actor.model.to(config.device)
        # with a LoRA the reference is the actor with its LoRA off (no copy; PolicyRoles)
        self.roles = PolicyRoles(
            model, reference=policy.uses_reference, offload_device=config.offload_device
        )
        plan = flow_plan(policy, reduction=sampler.reduction, seed=config.seed)
        self.learner = PolicyLearner(
            self.roles,
            plan,
            trainer_factory(config),
            allow_off_policy=config.allow_off_policy,
            seed=config.seed,
        )
        self.trainer = self.learner.trainer
        self.ema = None
        if config.ema_decay is not None:
            self.ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(config.ema_decay))
        self.served = model if self.ema is None else self.ema.module  # evaluated and saved
        rewards = [(get_reward(r.name, **r.options), r.weight) for r in config.rewards]
        if self.actor.video:  # clips: each image reward is the mean over the frames
            rewards = [(FrameMeanReward(fn), weight) for fn, weight in rewards]
        self.reward_fn = CombinedReward(rewards)
        if not self.verified:
            _check_targets(self.reward_fn, task)
        source = FlowSource if self.verified else PromptSource
        self.source = rollout_source(
            source(self.actor.judged(task), sampler, config.group_size), config.rollout, self.roles
        )
        # the starting weights: a full pipeline transformer is identified by its directory
        # (actor metadata), not hashed on every start
        full_pipeline = self.actor.pipeline and model.lora is None
        self.metadata = {
            "objective": plan.objective.metadata(),
            "sampler": sampler.model_dump(mode="json"),
            "model": self.actor.metadata(),
            "task": task.info(),
            **({} if self.verified else {"prompts": _prompts_digest(task)}),
            "reference": {
                "path": config.model.path,
                "weights": None if full_pipeline else weights_digest(model),
            },
            "rewards": [r.model_dump() for r in config.rewards],
            "group_size": config.group_size,
            "prompts_per_step": config.prompts_per_step,
            "ema_decay": config.ema_decay,
        }
        self.group_size = config.group_size
        self.out = Path(config.output_dir)

    def describe(self) -> str:
        cfg = self.config
        task = repr(self.task)
        if not self.verified:
            sizes = [len(self.task.prompts(split)) for split in ("train", "eval")]
            task = f"the prompts of {self.task.config.path} ({sizes[0]} train, {sizes[1]} held out)"
        return (
            f"flow-grpo ({METHOD_NAMES[cfg.policy.algorithm]}) on {task}: {self.actor.describe()}, "
            f"{cfg.prompts_per_step}×{cfg.group_size} rollouts per step, rewards {self.reward_fn!r}"
        )

    def rollout_options(self) -> dict[str, Any]:
        return {"advantage": self.config.policy.advantage_spec}

    def step(self) -> dict[str, float]:
        metrics = super().step()
        if self.ema is not None:
            self.ema.update_parameters(self.model)
        return metrics

    def evaluate(self, tag: str):
        step = self.steps_done()
        name = f"step_{step:06d}" if tag == "step" else tag
        grid = self.out / "samples" / f"{name}.png"
        cfg = self.config
        if not self.verified:
            record, metrics, self.final = evaluate_prompt_model(
                self.served,
                self.task,
                self.reward_fn,
                cfg.sampler,
                cfg,
                grid,
                pipeline=self.actor.pipeline,
                video=self.actor.video,
            )
            return {"step": step, **record}, metrics
        if self.actor.pipeline:
            record, metrics, self.final = pipeline_eval_record(
                self.served,
                self.actor.judged(self.task),
                cfg.sampler,
                cfg,
                grid,
                step,
                video=self.actor.video,
            )
        else:
            record, metrics, self.final = evaluate_image_model(
                self.served, self.task, cfg.sampler, cfg, step, grid
            )
        return record, metrics

    def state(self) -> dict[str, Any]:
        state = super().state()
        if self.ema is not None:
            state["ema"] = self.ema.state_dict()
        return state

    def load_state(self, state: dict[str, Any]) -> None:
        super().load_state(state)
        if self.ema is not None:
            self.ema.load_state_dict(state["ema"])

    def save_model(self, directory) -> None:
        serving = self.config.sampler.model_copy(update={"mode": "ode", "share_group_noise": False})
        info = {
            "task": self.task.info(),
            "sampler": serving.model_dump(mode="json"),
            "trained_steps": self.steps_done(),
            "ema_decay": self.config.ema_decay,
        }
        if not self.verified:  # the file wherever the directory is read from; the rewards
            # `diffusion-rl eval` scores the model with
            info["task"]["path"] = str(Path(self.task.config.path).resolve())
            info["rewards"] = [r.model_dump(mode="json") for r in self.config.rewards]
        self.actor.save(directory, self.served, info)

    def results(self, history) -> dict[str, Any]:
        if self.verified:
            compared = before_after(history)
        else:
            compared = before_after(history, "rewards", base=("reward_mean",))
        return {
            **compared,
            "eval": self.final.to_dict(),
            "weights_version": self.roles.version,
            "grids": sorted(str(p) for p in (self.out / "samples").glob("*.png")),
        }


def _prompts_digest(task) -> str:
    """A short hash of a prompt list's splits (prompts and their columns, in order): a
    checkpoint resumes only on the same prompts, even when the file changed in place."""
    rows = {
        split: [(e.prompt, dict(e.fields)) for e in task.prompts(split)]
        for split in ("train", "eval")
    }
    text = json.dumps(rows, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _check_rewards(config: FlowGRPORecipeConfig, task) -> None:
    """A task without a verifier (a prompt list, perhaps recorded in the model directory)
    takes only rewards that need none: a :class:`ConfigError` per reward that does."""
    problems = [] if verified(task) else prompt_task_reward_problems(config.rewards)
    if problems:
        lines = [f"{'.'.join(map(str, key))}: {message}" for key, message in problems]
        raise ConfigError("\n".join(lines))


def _check_targets(reward_fn: CombinedReward, task) -> None:
    """Every prompt of a prompt list has what each reward needs of it before anything is
    sampled: a reward with a ``target(example, index)`` method (the OCR reward's text to
    read) is asked for each prompt's; its ``ValueError`` becomes a :class:`ConfigError`
    naming the reward, the row and ``task.path``."""
    examples = sorted(task.prompts("train") + task.prompts("eval"), key=lambda e: e.row)
    for index, (fn, _) in enumerate(reward_fn.terms):
        target = getattr(getattr(fn, "reward", fn), "target", None)  # FrameMean wraps one
        if not callable(target):
            continue
        for example in examples:
            try:
                target(example, example.row)
            except ValueError as error:
                message = str(error).replace(f"example {example.row}", f"row {example.row}")
                raise ConfigError(
                    f"rewards.{index}: task.path {task.config.path}: {message}"
                ) from None


def run_flow_grpo(
    config: FlowGRPORecipeConfig, echo: Callable[[str], None] = print
) -> dict[str, Any]:
    """Train, evaluate, save; returns (and writes) ``results.json``."""
    return run(config, FlowGRPORecipe, echo)
