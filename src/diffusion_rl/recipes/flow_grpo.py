"""Recipe: Flow-GRPO of a flow model on mini-GenEval.

Each step:

1. the *rollout weights* (version v, stamped into the trace) sample ``group_size`` images per
   train prompt with the serving sampler in ``mode="sde"`` and capture on — every SDE step's
   latent and behaviour log-prob is recorded;
2. the images are scored by the weighted sum of the configured image rewards, and turned into
   :func:`flow_advantages` (per prompt group or batch std, clipped);
3. :class:`FlowPolicyLearner` replays the trained SDE steps exactly (same kernel, same forward
   groups), against the start-of-step snapshot for μ > 1 and the frozen reference for β > 0,
   takes μ trainer steps and syncs the rollout weights (version v + 1).

The model is evaluated before training, every ``eval_every`` steps and at the end, on the
held-out prompts with the ODE sampler at fixed seeds (:func:`evaluate_images`). With
``ema_decay`` the evaluated and saved model is an exponential moving average of the actor's
weights (``torch.optim.swa_utils.AveragedModel``, updated after every learner step and kept
in the checkpoints); rollouts always use the live actor. Writes to
``output_dir``: ``metrics.jsonl`` (+ TensorBoard), ``checkpoints/`` (exact resume: model,
optimizer, RNGs, prompt position, weights version, history; the reference's weights digest is
checked), ``samples/before.png``, ``samples/step_N.png``, ``samples/after.png``, ``model/``,
``curves.png`` (reward, accuracy, KL, clip fraction) and ``results.json`` (before/after
accuracy, overall and per attribute).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from ..config import ConfigError, FlowGRPORecipeConfig
from ..evaluation import ImageEvalResult, evaluate_images
from ..models.io import load_flow_model_dir, save_flow_model_dir
from ..objectives.flow_grpo import FlowGRPOLoss, flow_advantages
from ..plots import plot_curves
from ..rewards import CombinedReward, get_reward
from ..rollout import rollout_seed
from ..sampling.flow import sample_flow
from ..tasks.geneval import GenEvalTask
from ..train import CheckpointManager, MetricsLogger, progress
from ..train.flow_policy import FlowPolicyLearner
from ..train.roles import PolicyRoles
from .common import resume_latest, trainer_factory, weights_digest
from .flow_sft import check_model_fits_task, eval_metrics, eval_record, write_grid


def build_image_task(config: FlowGRPORecipeConfig, model_info: dict) -> GenEvalTask:
    """The configured task, or (``task: null``) the task the model was trained on."""
    if config.task is not None:
        return config.task.build()
    if "task" not in model_info:
        raise ConfigError(
            f"task: {config.model.path} does not record its task; set task.name and its options"
        )
    try:
        return GenEvalTask.from_info(model_info["task"])
    except ValueError as error:
        raise ConfigError(
            f"task: {config.model.path} records a task this recipe cannot run: {error}"
        ) from None


def build_image_rewards(config: FlowGRPORecipeConfig) -> CombinedReward:
    return CombinedReward(
        [
            (get_reward(section.name, **section.options), section.weight)
            for section in config.rewards
        ]
    )


def rollout_stats(rewards, task: GenEvalTask, images, examples, group_size: int) -> dict:
    """What the rollout looked like: reward mean/std, each part's mean, the verifier's
    overall accuracy, and the fraction of groups whose rewards are all equal (no signal)."""
    total = rewards.total
    groups = total.view(-1, group_size)
    stats = {
        "rollout/reward_mean": float(total.mean()),
        "rollout/reward_std": float(total.std(correction=0)),
        "rollout/flat_groups": float((groups.max(1).values == groups.min(1).values).float().mean()),
        "rollout/accuracy": sum(r["overall"] for r in task.verify(images, examples))
        / len(examples),
    }
    if len(rewards.parts) > 1:
        stats.update(
            {f"rollout/{name}": float(part.mean()) for name, part in rewards.parts.items()}
        )
    return stats


def run_flow_grpo(
    config: FlowGRPORecipeConfig, echo: Callable[[str], None] = print
) -> dict[str, Any]:
    """Train, evaluate, save; returns (and writes) ``results.json``."""
    if config.threads:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    loaded = load_flow_model_dir(config.model.path)
    task = build_image_task(config, loaded.info)
    check_model_fits_task(loaded.model, task, "model.path")
    model = loaded.model.to(config.device)
    policy = config.policy
    roles = PolicyRoles(
        model, reference=policy.uses_reference, offload_device=config.offload_device
    )

    learner = FlowPolicyLearner(
        roles,
        FlowGRPOLoss(policy),
        trainer_factory(config),
        allow_off_policy=config.allow_off_policy,
        seed=config.seed,
    )
    trainer = learner.trainer
    ema = None
    if config.ema_decay is not None:
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(config.ema_decay))
    served = model if ema is None else ema.module  # what is evaluated and saved
    reward_fn = build_image_rewards(config)
    sampler = config.sampler
    metadata = {
        "objective": learner.loss.metadata(),
        "sampler": sampler.model_dump(mode="json"),
        "model": model.config.model_dump(mode="json"),
        "task": task.info(),
        "reference": {"path": config.model.path, "weights": weights_digest(model)},
        "rewards": [r.model_dump() for r in config.rewards],
        "group_size": config.group_size,
        "prompts_per_step": config.prompts_per_step,
        "ema_decay": config.ema_decay,
    }
    manager = CheckpointManager(out / "checkpoints", keep_last=config.keep_last)
    iterations = policy.num_iterations
    state = resume_latest(trainer, manager, metadata, resume=config.resume, out=out)
    if state is None:
        state = {"prompt_position": 0, "weights_version": 0, "history": []}
    else:
        roles.restore(int(state["weights_version"]))
        if ema is not None:
            ema.load_state_dict(state["ema"])
        echo(f"resumed from {manager.latest()} at step {trainer.global_step // iterations}")
    position, history = int(state["prompt_position"]), list(state["history"])
    echo(
        f"flow-grpo on {task!r}: FlowDiT {model.num_parameters():,} parameters, "
        f"{config.prompts_per_step}×{config.group_size} rollouts per step, rewards {reward_fn!r}"
    )

    def evaluate(grid_name: str) -> ImageEvalResult:
        result = evaluate_images(
            served,
            task,
            sampler,
            samples_per_prompt=config.eval_samples_per_prompt,
            seed=config.seed,
        )
        step = trainer.global_step // iterations
        history.append(eval_record(step, result))
        logger.log(step, eval_metrics(result))
        write_grid(result, out / "samples" / f"{grid_name}.png", config.grid_images)
        return result

    def save() -> None:
        data = {
            "prompt_position": position,
            "weights_version": roles.version,
            "history": history,
        }
        if ema is not None:
            data["ema"] = ema.state_dict()
        trainer.save_checkpoint(manager, metadata, data)

    started = time.perf_counter()
    with MetricsLogger(out) as logger:
        if not history:
            evaluate("before")
        bar = progress(config.steps, "flow-grpo")
        bar.update(trainer.global_step // iterations)
        while trainer.global_step // iterations < config.steps:
            indices = range(position, position + config.prompts_per_step)
            examples = [task.example(i, "train") for i in indices for _ in range(config.group_size)]
            seeds = [
                rollout_seed(config.seed, i, g) for i in indices for g in range(config.group_size)
            ]
            position += config.prompts_per_step
            with trainer.autocast():  # sample at the learner's precision: same kernels, parity 0
                sample = sample_flow(
                    roles.rollout,
                    [e.prompt for e in examples],
                    sampler,
                    seeds=seeds,
                    capture=True,
                    weights_version=roles.version,
                    group_size=config.group_size,
                )
            images = sample.images.float()
            rewards = reward_fn(images, examples)
            advantages = flow_advantages(
                rewards.total,
                group_size=config.group_size,
                mode=policy.advantage,
                clip=policy.adv_clip,
                eps=policy.std_eps,
            )
            metrics = learner.step(sample.trace, advantages)
            if ema is not None:
                ema.update_parameters(model)
            metrics.update(rollout_stats(rewards, task, images, examples, config.group_size))
            step = trainer.global_step // iterations
            bar.update(1)
            if step % config.log_every == 0:
                logger.log(step, metrics)
            postfix = {"reward": f"{metrics['rollout/reward_mean']:.3f}"}
            if step % config.eval_every == 0 and step < config.steps:
                postfix["acc"] = f"{evaluate(f'step_{step:06d}').accuracy:.3f}"
            bar.set_postfix(postfix)
            if step % config.checkpoint_every == 0:
                save()
        bar.close()
        after = evaluate("after")
        if trainer.global_step // iterations % config.checkpoint_every:
            save()

    curves = plot_curves(
        out / "metrics.jsonl",
        out / "curves.png",
        ["rollout/reward_mean", "eval/accuracy", "flow_grpo/kl", "flow_grpo/clip_frac"],
        f"Flow-GRPO on {task.name}",
    )
    info = {
        "task": task.info(),
        "sampler": sampler.model_copy(
            update={"mode": "ode", "share_group_noise": False}
        ).model_dump(mode="json"),
        "trained_steps": trainer.global_step // iterations,
        "ema_decay": config.ema_decay,
    }
    save_flow_model_dir(out / "model", served, info)
    before = history[0]
    results = {
        "recipe": "flow_grpo",
        "steps": trainer.global_step // iterations,
        "elapsed_s": round(time.perf_counter() - started, 2),
        "accuracy_before": before["accuracy"],
        "accuracy_after": after.accuracy,
        "attributes_before": before["attributes"],
        "attributes_after": after.attributes,
        "eval": after.to_dict(),
        "history": history,
        "weights_version": roles.version,
        "skipped_nonfinite": trainer.skipped_nonfinite,
        "model_dir": str(out / "model"),
        "curves_png": str(curves),
        "grids": sorted(str(p) for p in (out / "samples").glob("*.png")),
    }
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    return results
