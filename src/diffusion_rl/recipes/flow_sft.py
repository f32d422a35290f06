"""Recipe: rectified-flow SFT of the built-in FlowDiT on rendered mini-GenEval images, or of
the built-in image-to-video VideoDiT on rendered mini-motion clips.

Composes: task renders (data by position) → :class:`FlowMatchingSFT` → :class:`Trainer` →
:func:`evaluate_images` / :func:`evaluate_videos` (held-out prompts, serving ODE sampler at
fixed seeds, per-attribute verifier), on the run loop. Also writes ``samples/step_N.png`` at
each evaluation (a captioned grid of the fixed-seed images, or frame strips of the clips,
with ``step_N.gif`` beside them); ``model/`` records the task and the serving sampler, so
``flow-grpo``, workflows and ``generate`` need nothing else.

A video clip is conditioned on its own first frame (``model.encode_conditioning(prompts,
clips[:, 0])``, the null-prompt branch on the same frame for ``cond_dropout``), as the video
stage of a workflow is conditioned on the image stage's picture.

Each training row's σ, ε and dropout are drawn from its own noise key
``noise_keys(dataset index, seed, trainer step)``, so ``micro_batch_size`` changes memory
use and nothing else: any split gives the same update.

``model.path`` may also be a local diffusers pipeline directory (docs/flow_models.md): SD3 or
FLUX on the image task, Wan text-to-video on the image task (each render held still for the
clip's frames), Wan image-to-video on mini-motion; trained in full or as a LoRA
(``model.lora``), at the task's resolution. The data are the renders encoded by the
pipeline's VAE (the posterior mean); the final model is a pipeline model directory.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.nn.functional as F

from ..config import ConfigError, FlowSFTRecipeConfig
from ..objectives.flow_sft import FlowMatchingSFT, flow_sft_batch
from ..seeding import noise_keys
from ..tasks.motion import MotionTask
from .common import (
    FlowActor,
    check_model_fits_task,
    evaluate_image_model,
    evaluate_video_model,
    flow_start,
    load_builtin,
    load_pipeline_actor,
    new_flow_model,
    pipeline_eval_record,
    trainer_factory,
    with_lora,
)
from .run import Recipe, run


class FlowSFTRecipe(Recipe):
    name = "flow-sft"
    curves = ("loss", "eval/accuracy", "eval/reward_mean")
    title = "rectified-flow SFT on mini-GenEval"

    def __init__(self, config: FlowSFTRecipeConfig) -> None:
        self.config = config
        self.task = task = config.task.build()
        self.video = isinstance(task, MotionTask)
        if self.video:
            self.title = "rectified-flow SFT of image-to-video on mini-motion"
        section = config.model
        if section.path is None:
            model = with_lora(new_flow_model(section, task), section, "model", config.seed)
            self.actor = FlowActor(model, "builtin")
        else:
            start = flow_start(section)
            if start.pipeline:
                model, options, scale = load_pipeline_actor(section, start, task, seed=config.seed)
                self.actor = FlowActor(model, start.kind, start, section.dtype, options, scale)
            else:
                model = load_builtin(section).model
                if self.video:
                    _check_video_model(model, task)
                else:
                    check_model_fits_task(model, task, "model.path")
                model = with_lora(model, section, "model", config.seed)
                self.actor = FlowActor(model, "builtin", start)
        self.model = self.actor.model
        self.actor.check_activation_checkpointing(config.activation_checkpointing)
        objective = FlowMatchingSFT(config.objective)
        self.trainer = trainer_factory(config)(self.model, objective)
        self.metadata = {
            "objective": objective.metadata(),
            "model": self.actor.metadata(),
            "task": task.info(),
            "sampler": config.sampler.model_dump(mode="json"),
            "batch_size": config.batch_size,
            "micro_batch_size": config.micro_batch_size,
        }
        self.out = Path(config.output_dir)

    def describe(self) -> str:
        return f"flow SFT: {self.actor.describe()}; task: {self.task!r}"

    def step(self) -> dict[str, float]:
        cfg = self.config
        # train_batch(position, B) holds the examples of indices [position·B, (position+1)·B)
        first = self.position * cfg.batch_size
        keys = noise_keys(range(first, first + cfg.batch_size), cfg.seed, self.trainer.global_step)
        examples, pixels = self.task.train_batch(self.position, cfg.batch_size)
        self.position += 1
        mine = self.trainer.world.share(cfg.batch_size, "batch_size")  # this rank's rows
        keys, examples, pixels = keys[mine], examples[mine], pixels[mine]
        prompts = [e.prompt for e in examples]
        if self.actor.scale > 1:  # a pipeline making k× the task's images: renders enlarged
            pixels = F.interpolate(pixels, scale_factor=self.actor.scale, mode="nearest")
        if self.video:  # clips [B, F, 3, S, S], each conditioned on its own first frame
            latents = self.model.encode_videos(pixels)
            cond = self.model.encode_conditioning(prompts, pixels[:, 0])
            uncond = self.model.empty_conditioning(pixels[:, 0])
        elif self.actor.video:  # text-to-video on images: each render held for every frame
            frames = self.model.output_shape[0]
            clips = pixels.unsqueeze(1).expand(-1, frames, -1, -1, -1)
            latents, cond, uncond = self.model.encode_images(clips), None, None
        else:
            latents, cond, uncond = self.model.encode_images(pixels), None, None
        size = cfg.micro_batch_size or cfg.batch_size
        micro = [
            flow_sft_batch(
                self.model,
                latents[lo : lo + size],
                prompts[lo : lo + size],
                noise_seeds=keys[lo : lo + size],
                cond=_rows(cond, lo, size),
                uncond=_rows(uncond, lo, size),
            )
            for lo in range(0, len(prompts), size)
        ]
        result = self.trainer.train_step(micro)
        return result.metrics

    def evaluate(self, tag: str):
        step = self.steps_done()
        grid = self.out / "samples" / f"step_{step:06d}.png"
        cfg = self.config
        if self.actor.pipeline and not self.video:
            record, metrics, self.final = pipeline_eval_record(
                self.model,
                self.actor.judged(self.task),
                cfg.sampler,
                cfg,
                grid,
                step,
                video=self.actor.video,
            )
            return record, metrics
        evaluate = evaluate_video_model if self.video else evaluate_image_model
        record, metrics, self.final = evaluate(self.model, self.task, cfg.sampler, cfg, step, grid)
        return record, metrics

    def save_model(self, directory) -> None:
        info = {
            "task": self.task.info(),
            "sampler": self.config.sampler.model_dump(mode="json"),
            "trained_steps": self.steps_done(),
        }
        self.actor.save(directory, self.model, info)

    def results(self, history) -> dict[str, Any]:
        return {
            "model_parameters": self.actor.parameter_counts()[1],
            "final_loss": (self.last_metrics or {}).get("loss"),
            "eval": self.final.to_dict(),
            "grids": sorted(str(p) for p in (self.out / "samples").glob("*.png")),
        }


def _rows(cond, lo: int, size: int):
    """Rows ``[lo, lo + size)`` of a conditioning dict (None stays None)."""
    return None if cond is None else {k: v[lo : lo + size] for k, v in cond.items()}


def _check_video_model(model, task: MotionTask) -> None:
    """A loaded model must be an image-to-video model making the task's clips."""
    if not callable(getattr(model, "encode_conditioning", None)):
        raise ConfigError(
            f"model.path: the {task.name} task trains an image-to-video model; "
            f"{type(model).__name__} is not one (leave model.path out for a new VideoDiT)"
        )
    frames, channels, size, _ = task.clip_shape
    if tuple(model.latent_shape) != (channels, frames, size, size):
        raise ConfigError(
            f"model.path: the model makes clips {tuple(model.latent_shape)} (C, F, H, W), the "
            f"task {(channels, frames, size, size)}; set task.num_frames / task.image_size"
        )


def run_flow_sft(
    config: FlowSFTRecipeConfig, echo: Callable[[str], None] = print
) -> dict[str, Any]:
    """Train, evaluate, save; returns (and writes) the results summary."""
    return run(config, FlowSFTRecipe, echo)
