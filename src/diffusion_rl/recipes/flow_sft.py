"""Recipe: rectified-flow SFT of the built-in FlowDiT on rendered mini-GenEval images.

Composes: task renders (data by position) → :class:`FlowMatchingSFT` → :class:`Trainer`
(global weighted accumulation, checkpoints with exact resume) → :func:`evaluate_images`
(held-out prompts, serving ODE sampler at fixed seeds, per-attribute verifier). Writes to
``output_dir``: ``metrics.jsonl`` (+ TensorBoard), ``checkpoints/``, ``samples/step_N.png``
(a captioned grid of the fixed-seed samples at each evaluation), ``model/`` (the FlowDiT
with its task and sampler, so ``flow-grpo`` and ``generate`` need nothing else),
``curves.png`` and ``results.json``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError, FlowModelSection, FlowSFTRecipeConfig
from ..evaluation import ImageEvalResult, evaluate_images
from ..models.dit import FlowDiT, FlowDiTConfig
from ..models.io import load_flow_model_dir, save_flow_model_dir
from ..objectives.flow_sft import FlowMatchingSFT, flow_sft_batch
from ..plots import plot_curves, save_image_grid
from ..tasks.geneval import GenEvalTask
from ..train import CheckpointManager, MetricsLogger, progress
from .common import resume_latest, trainer_factory


def build_flow_model(section: FlowModelSection, task: GenEvalTask) -> FlowDiT:
    """A fresh FlowDiT for ``task`` (its image size, vocabulary and info), or the saved one at
    ``section.path``, checked to fit the task."""
    if section.path is None:
        return FlowDiT(
            FlowDiTConfig(
                image_size=task.config.image_size,
                patch_size=section.patch_size,
                d_model=section.d_model,
                n_layers=section.n_layers,
                n_heads=section.n_heads,
                mlp_ratio=section.mlp_ratio,
                vocabulary=task.vocabulary,
                task=task.info(),
            )
        )
    model = load_flow_model_dir(section.path).model
    check_model_fits_task(model, task, "model.path")
    return model


def check_model_fits_task(model: FlowDiT, task: GenEvalTask, field: str) -> None:
    if model.latent_shape != task.image_shape:
        raise ConfigError(
            f"{field}: the model makes images {model.latent_shape}, the task {task.image_shape}; "
            "set task.image_size to the model's"
        )
    missing = sorted(set(task.vocabulary) - set(model.config.vocabulary))
    if missing:
        raise ConfigError(f"{field}: the model's vocabulary lacks the task's words {missing}")


def sft_micro_batches(
    model: FlowDiT, examples: list, images: torch.Tensor, micro_batch_size: int
) -> list[dict]:
    """Rendered images and their prompts → flow-SFT micro-batches (clean latents ``2x − 1``)."""
    latents = model.encode_images(images)
    prompts = [e.prompt for e in examples]
    return [
        flow_sft_batch(
            model, latents[lo : lo + micro_batch_size], prompts[lo : lo + micro_batch_size]
        )
        for lo in range(0, len(prompts), micro_batch_size)
    ]


def eval_record(step: int, result: ImageEvalResult) -> dict[str, Any]:
    """One history entry: step, overall accuracy, per-attribute accuracy, mean reward."""
    return {
        "step": step,
        "accuracy": result.accuracy,
        "attributes": result.attributes,
        "reward_mean": result.reward_mean,
    }


def eval_metrics(result: ImageEvalResult) -> dict[str, float]:
    metrics = {"eval/accuracy": result.accuracy, "eval/reward_mean": result.reward_mean}
    metrics.update({f"eval/{k}": v for k, v in result.attributes.items() if k != "overall"})
    return metrics


def write_grid(result: ImageEvalResult, path: Path, count: int) -> Path | None:
    """The first ``count`` evaluation images (distinct prompts first) as a captioned grid."""
    if count == 0:
        return None
    count = min(count, result.num_images)
    return save_image_grid(
        result.images[:count], path, nrow=8, captions=result.captions()[:count], upscale=6
    )


def run_flow_sft(
    config: FlowSFTRecipeConfig, echo: Callable[[str], None] = print
) -> dict[str, Any]:
    """Train, evaluate, save; returns (and writes) the results summary."""
    if config.threads:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    task = config.task.build()
    model = build_flow_model(config.model, task)
    objective = FlowMatchingSFT(config.objective)
    trainer = trainer_factory(config)(model, objective)
    sampler = config.sampler
    metadata = {
        "objective": objective.metadata(),
        "model": model.config.model_dump(mode="json"),
        "task": task.info(),
        "sampler": sampler.model_dump(mode="json"),
        "batch_size": config.batch_size,
        "micro_batch_size": config.micro_batch_size,
    }
    manager = CheckpointManager(out / "checkpoints", keep_last=config.keep_last)
    state = resume_latest(trainer, manager, metadata, resume=config.resume, out=out)
    if state is None:
        state = {"position": 0, "history": []}
    else:
        echo(f"resumed from {manager.latest()} at step {trainer.global_step}")
    position, history = int(state["position"]), list(state["history"])
    echo(f"flow SFT: FlowDiT {model.num_parameters():,} parameters; task: {task!r}")

    started = time.perf_counter()
    last_metrics: dict[str, float] = {}

    def run_eval() -> ImageEvalResult:
        result = evaluate_images(
            model,
            task,
            sampler,
            samples_per_prompt=config.eval_samples_per_prompt,
            seed=config.seed,
        )
        step = trainer.global_step
        history.append(eval_record(step, result))
        logger.log(step, eval_metrics(result))
        write_grid(result, out / "samples" / f"step_{step:06d}.png", config.grid_images)
        return result

    def save() -> None:
        trainer.save_checkpoint(manager, metadata, {"position": position, "history": history})

    micro = config.micro_batch_size or config.batch_size
    with MetricsLogger(out) as logger:
        bar = progress(config.steps, "flow-sft")
        bar.update(trainer.global_step)
        while trainer.global_step < config.steps:
            examples, images = task.train_batch(position, config.batch_size)
            position += 1
            step = trainer.train_step(sft_micro_batches(model, examples, images, micro))
            last_metrics = step.metrics
            bar.update(1)
            if trainer.global_step % config.log_every == 0:
                logger.log(trainer.global_step, step.metrics)
                bar.set_postfix(loss=f"{step.metrics['loss']:.3f}")
            if trainer.global_step % config.eval_every == 0 and trainer.global_step < config.steps:
                accuracy = run_eval().accuracy
                bar.set_postfix(loss=f"{step.metrics['loss']:.3f}", acc=f"{accuracy:.3f}")
            if trainer.global_step % config.checkpoint_every == 0:
                save()
        bar.close()
        final = run_eval()
        if manager.latest() is None or trainer.global_step % config.checkpoint_every:
            save()

    curves = plot_curves(
        out / "metrics.jsonl",
        out / "curves.png",
        ["loss", "eval/accuracy", "eval/reward_mean"],
        "rectified-flow SFT on mini-GenEval",
    )
    info = {
        "task": task.info(),
        "sampler": sampler.model_dump(mode="json"),
        "trained_steps": trainer.global_step,
    }
    save_flow_model_dir(out / "model", model, info)
    results = {
        "recipe": "flow_sft",
        "steps": trainer.global_step,
        "elapsed_s": round(time.perf_counter() - started, 2),
        "model_parameters": model.num_parameters(),
        "final_loss": last_metrics.get("loss"),
        "eval": final.to_dict(),
        "history": history,
        "skipped_nonfinite": trainer.skipped_nonfinite,
        "model_dir": str(out / "model"),
        "curves_png": str(curves),
        "grids": sorted(str(p) for p in (out / "samples").glob("*.png")),
    }
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    return results
