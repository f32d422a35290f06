"""Recipe: GRPO / DAPO / Dr.GRPO of a token denoiser on a built-in task.

Composes: rollout weights + serving sampler with capture (:func:`collect_rollouts`) →
rewards → group advantages → :class:`PolicyLearner` (exact replay of live, reference and
old policy on the same states, μ inner iterations, versioned weight sync) →
:func:`evaluate_task`. Writes ``metrics.jsonl``, ``checkpoints/``, ``model/``,
``curves.png`` (reward and accuracy) and ``results.json`` (before/after) to ``output_dir``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError, GRPORecipeConfig
from ..evaluation import evaluate_task
from ..models.io import load_model_dir, save_model_dir
from ..objectives.grpo import PolicyLoss
from ..plots import plot_curves
from ..rewards import CombinedReward, get_reward
from ..rollout import collect_rollouts
from ..tasks import get_task
from ..train import CheckpointManager, MetricsLogger, progress
from ..train.policy import PolicyLearner
from ..train.roles import PolicyRoles
from .common import resume_latest, trainer_factory, weights_digest
from .sft import build_task as build_configured_task


def build_rewards(config: GRPORecipeConfig, task) -> CombinedReward:
    terms = []
    for section in config.rewards:
        options = dict(section.options)
        if section.name in ("verifier", "digits"):
            options["task"] = task
        terms.append((get_reward(section.name, **options), section.weight))
    return CombinedReward(terms)


def build_task(config: GRPORecipeConfig, model_info: dict):
    """The configured task, or (``task: null``) the task the model was trained on."""
    if config.task is None:
        if "task" not in model_info:
            raise ConfigError(
                f"task: {config.model.path} does not record its task; set task.name and its options"
            )
        options = dict(model_info["task"])
        name = options.pop("name")
        if options.get("block_size", config.sampler.block_size) != config.sampler.block_size:
            raise ConfigError(
                f"sampler.block_size: the model was trained with blocks of {options['block_size']}, "
                f"got {config.sampler.block_size}"
            )
        options["block_size"] = config.sampler.block_size
        return get_task(name, **options)
    return build_configured_task(config.task, config.sampler.block_size)


def run_grpo(config: GRPORecipeConfig, echo: Callable[[str], None] = print) -> dict[str, Any]:
    if config.threads:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    loaded = load_model_dir(config.model.path)
    task = build_task(config, loaded.info)
    if loaded.tokenizer.name != task.tokenizer.name:
        raise ConfigError(
            f"model.path: {config.model.path} uses tokenizer {loaded.tokenizer.name}, the task {task.tokenizer.name}"
        )
    model = loaded.model.to(config.device)
    policy = PolicyLoss(config.policy)
    roles = PolicyRoles(
        model, reference=config.policy.uses_reference, offload_device=config.offload_device
    )
    reference_digest = weights_digest(model)

    learner = PolicyLearner(
        roles,
        policy,
        trainer_factory(config),
        scorer=config.scorer,
        micro_batch_size=config.micro_batch_size,
        allow_off_policy=config.allow_off_policy,
        seed=config.seed,
    )
    trainer = learner.trainer
    reward_fn = build_rewards(config, task)
    sampler = config.sampler.model_copy(update={"generation_length": task.completion_length})
    eval_sampler = sampler.model_copy(update={"temperature": config.eval_temperature})
    metadata = {
        "objective": policy.metadata(),
        "estimator": config.scorer,
        "sampler": sampler.model_dump(),
        "model": model.config.model_dump(),
        "tokenizer": task.tokenizer.name,
        "task": {"name": task.name, **task.config.model_dump()},
        "reference": {"path": config.model.path, "weights": reference_digest},
        "rewards": [r.model_dump() for r in config.rewards],
        "group_size": config.group_size,
        "prompts_per_step": config.prompts_per_step,
        "post_stop_weight": config.post_stop_weight,
    }
    manager = CheckpointManager(out / "checkpoints", keep_last=config.keep_last)
    prompt_position = 0
    iterations = config.policy.num_iterations
    history: list[dict[str, Any]] = []
    results_path = out / "results.json"
    data = resume_latest(trainer, manager, metadata, resume=config.resume, out=out)
    if data is not None:
        prompt_position = int(data["prompt_position"])
        roles.restore(int(data["weights_version"]))
        if results_path.is_file():
            history = json.loads(results_path.read_text()).get("history", [])
        echo(f"resumed from {manager.latest()} at step {trainer.global_step // iterations}")
    echo(
        f"{config.policy.algorithm} on {task!r}: {model.num_parameters():,} parameters, scorer {config.scorer}"
    )

    def evaluate() -> dict[str, Any]:
        result = evaluate_task(
            model, task, eval_sampler, num_examples=config.eval_examples, seed=config.seed
        )
        step = trainer.global_step // iterations
        history.append({"step": step, "accuracy": result.accuracy})
        logger.log(step, {"eval/accuracy": result.accuracy})
        return result.to_dict()

    started = time.perf_counter()
    with MetricsLogger(out) as logger:
        before = evaluate() if not history else {"accuracy": history[0]["accuracy"]}
        bar = progress(config.steps, config.policy.algorithm)
        bar.update(trainer.global_step // iterations)
        while trainer.global_step // iterations < config.steps:
            with trainer.autocast():  # sample at the learner's precision: same kernels, parity 0
                rollout, prompt_position = collect_rollouts(
                    roles.rollout,
                    task,
                    reward_fn,
                    start_prompt=prompt_position,
                    num_prompts=config.prompts_per_step,
                    group_size=config.group_size,
                    sampler=sampler,
                    policy=config.policy,
                    post_stop_weight=config.post_stop_weight,
                    weights_version=roles.version,
                    seed=config.seed,
                    max_sampling_rounds=config.max_sampling_rounds,
                )
            metrics = learner.step(rollout)
            step = trainer.global_step // iterations
            bar.update(1)
            if step % config.log_every == 0:
                logger.log(step, metrics)
            bar.set_postfix(reward=f"{metrics['rollout/reward_mean']:.3f}")
            if step % config.eval_every == 0 and step < config.steps:
                accuracy = evaluate()["accuracy"]
                bar.set_postfix(
                    reward=f"{metrics['rollout/reward_mean']:.3f}", acc=f"{accuracy:.3f}"
                )
            if step % config.checkpoint_every == 0:
                trainer.save_checkpoint(
                    manager,
                    metadata,
                    {"prompt_position": prompt_position, "weights_version": roles.version},
                )
        bar.close()
        after = evaluate()
        if trainer.global_step // iterations % config.checkpoint_every:
            trainer.save_checkpoint(
                manager,
                metadata,
                {"prompt_position": prompt_position, "weights_version": roles.version},
            )

    curves = plot_curves(
        out / "metrics.jsonl",
        out / "curves.png",
        ["rollout/reward_mean", "eval/accuracy", "policy/kl", "policy/entropy"],
        f"{config.policy.algorithm} on {task.name}",
    )
    info = {
        "task": metadata["task"],
        "sampler": eval_sampler.model_dump(),
        "trained_steps": trainer.global_step // iterations,
    }
    save_model_dir(out / "model", model, task.tokenizer, info)
    results = {
        "recipe": config.policy.algorithm,
        "scorer": config.scorer,
        "steps": trainer.global_step // iterations,
        "elapsed_s": round(time.perf_counter() - started, 2),
        "accuracy_before": before["accuracy"],
        "accuracy_after": after["accuracy"],
        "eval": after,
        "history": history,
        "weights_version": roles.version,
        "skipped_nonfinite": trainer.skipped_nonfinite,
        "model_dir": str(out / "model"),
        "curves_png": str(curves),
    }
    results_path.write_text(json.dumps(results, indent=2) + "\n")
    return results
