"""Recipe: masked-diffusion SFT of a token denoiser on a built-in task.

Composes: task (data by position, verifier) → :class:`MaskedDiffusionSFT` → :class:`Trainer`
(global weighted accumulation, checkpoints with exact resume) → :func:`evaluate_task` (the
serving sampler + verifier). Writes to ``output_dir``: ``metrics.jsonl`` (+ TensorBoard),
``checkpoints/``, ``model/`` (the final model directory), ``curves.png`` and ``results.json``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError, SFTRecipeConfig, TaskSection
from ..contracts import DiffusionTokenBatch
from ..evaluation import evaluate_task
from ..models import DiffusionTransformer, TransformerConfig
from ..models.io import load_model_dir, save_model_dir
from ..objectives import MaskedDiffusionSFT
from ..plots import plot_curves
from ..tasks import get_task
from ..train import CheckpointManager, MetricsLogger, progress
from .common import resume_latest, trainer_factory


def build_task(section: TaskSection, block_size: int):
    """The task a config section names; its block size is the sampler's (one source of truth)."""
    options = section.options()
    if "block_size" in options:
        raise ConfigError(
            "task.block_size: set sampler.block_size instead (model, data and sampler share it)"
        )
    return get_task(section.name, block_size=block_size, **options)


def build_model(config: SFTRecipeConfig, task) -> DiffusionTransformer:
    tokenizer = task.tokenizer
    if config.model.path is not None:
        loaded = load_model_dir(config.model.path)
        if loaded.tokenizer.name != tokenizer.name:
            raise ConfigError(
                f"model.path: {config.model.path} uses tokenizer {loaded.tokenizer.name}, "
                f"the task uses {tokenizer.name}"
            )
        return loaded.model
    section = config.model
    return DiffusionTransformer(
        TransformerConfig(
            vocab_size=tokenizer.vocab_size,
            mask_token_id=tokenizer.mask_id,
            d_model=section.d_model,
            n_layers=section.n_layers,
            n_heads=section.n_heads,
            d_ff=section.d_ff,
            max_seq_len=task.prompt_length + task.completion_length,
            attention=section.attention,
            block_size=config.sampler.block_size,
        )
    )


def sft_batch(data: dict[str, torch.Tensor]) -> DiffusionTokenBatch:
    """Task tensors → the SFT contract (completion = targets, completion mask = weights)."""
    return DiffusionTokenBatch(
        model_inputs={"prompt_ids": data["prompt_ids"], "prompt_mask": data["prompt_mask"]},
        target_ids=data["completion_ids"],
        loss_weights=data["completion_mask"].float(),
    )


def run_sft(config: SFTRecipeConfig, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Train, evaluate, save; returns (and writes) the results summary."""
    if config.threads:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    task = build_task(config.task, config.sampler.block_size)
    model = build_model(config, task)
    objective = MaskedDiffusionSFT(config.objective)
    trainer = trainer_factory(config)(model, objective)
    sampler = config.sampler.model_copy(update={"generation_length": task.completion_length})
    metadata = {
        "objective": objective.metadata(),
        "model": model.config.model_dump(),
        "tokenizer": task.tokenizer.name,
        "task": {"name": task.name, **task.config.model_dump()},
        "sampler": sampler.model_dump(),
        "batch_size": config.batch_size,
        "micro_batch_size": config.micro_batch_size,
    }
    manager = CheckpointManager(out / "checkpoints", keep_last=config.keep_last)
    position = 0
    state = resume_latest(trainer, manager, metadata, resume=config.resume, out=out)
    if state is not None:
        position = int(state["position"])
        echo(f"resumed from {manager.latest()} at step {trainer.global_step}")
    echo(
        f"model: {model.num_parameters():,} parameters, {model.attention} attention; task: {task!r}"
    )

    history: list[dict[str, Any]] = []
    started = time.perf_counter()
    last_metrics: dict[str, float] = {}

    def run_eval() -> dict[str, Any]:
        result = evaluate_task(
            model, task, sampler, num_examples=config.eval_examples, seed=config.seed
        )
        history.append({"step": trainer.global_step, "accuracy": result.accuracy})
        logger.log(trainer.global_step, {"eval/accuracy": result.accuracy})
        return result.to_dict()

    with MetricsLogger(out) as logger:
        bar = progress(config.steps, "sft")
        bar.update(trainer.global_step)
        while trainer.global_step < config.steps:
            batch = sft_batch(task.train_batch(position, config.batch_size))
            position += 1
            step = trainer.train_step(batch.split(config.micro_batch_size or config.batch_size))
            last_metrics = step.metrics
            bar.update(1)
            if trainer.global_step % config.log_every == 0:
                logger.log(trainer.global_step, step.metrics)
                bar.set_postfix(loss=f"{step.metrics['loss']:.3f}")
            if trainer.global_step % config.eval_every == 0 and trainer.global_step < config.steps:
                accuracy = run_eval()["accuracy"]
                bar.set_postfix(loss=f"{step.metrics['loss']:.3f}", acc=f"{accuracy:.3f}")
            if trainer.global_step % config.checkpoint_every == 0:
                trainer.save_checkpoint(manager, metadata, {"position": position})
        bar.close()
        final = run_eval()
        if manager.latest() is None or trainer.global_step % config.checkpoint_every:
            trainer.save_checkpoint(manager, metadata, {"position": position})

    curves = plot_curves(
        out / "metrics.jsonl", out / "curves.png", ["loss", "eval/accuracy"], "masked-diffusion SFT"
    )
    info = {
        "task": metadata["task"],
        "sampler": metadata["sampler"],
        "trained_steps": trainer.global_step,
    }
    save_model_dir(out / "model", model, task.tokenizer, info)
    results = {
        "recipe": "sft",
        "steps": trainer.global_step,
        "elapsed_s": round(time.perf_counter() - started, 2),
        "model_parameters": model.num_parameters(),
        "final_loss": last_metrics.get("loss"),
        "eval": final,
        "history": history,
        "skipped_nonfinite": trainer.skipped_nonfinite,
        "model_dir": str(out / "model"),
        "curves_png": str(curves),
    }
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    return results
