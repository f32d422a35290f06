"""Recipe: rectified-flow SFT of the built-in FlowDiT on rendered mini-GenEval images.

Composes: task renders (data by position) → :class:`FlowMatchingSFT` → :class:`Trainer` →
:func:`evaluate_images` (held-out prompts, serving ODE sampler at fixed seeds, per-attribute
verifier), on the run loop. Also writes ``samples/step_N.png`` (a captioned grid of the
fixed-seed samples at each evaluation); ``model/`` records the task and the serving sampler,
so ``flow-grpo`` and ``generate`` need nothing else.

Each training row's σ, ε and dropout are drawn from its own noise key
``noise_keys(dataset index, seed, trainer step)``, so ``micro_batch_size`` changes memory
use and nothing else: any split gives the same update.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config import FlowSFTRecipeConfig
from ..models.dit import FlowDiT, FlowDiTConfig
from ..models.io import save_model
from ..objectives.flow_sft import FlowMatchingSFT, flow_sft_batch
from ..seeding import noise_keys
from .common import check_model_fits_task, evaluate_image_model, load_ref, trainer_factory
from .run import Recipe, run


class FlowSFTRecipe(Recipe):
    name = "flow-sft"
    curves = ("loss", "eval/accuracy", "eval/reward_mean")
    title = "rectified-flow SFT on mini-GenEval"

    def __init__(self, config: FlowSFTRecipeConfig) -> None:
        self.config = config
        self.task = task = config.task.build()
        section = config.model
        if section.path is None:
            self.model = FlowDiT(
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
        else:
            self.model = load_ref(section, "flow", "model").model
            check_model_fits_task(self.model, task, "model.path")
        objective = FlowMatchingSFT(config.objective)
        self.trainer = trainer_factory(config)(self.model, objective)
        self.metadata = {
            "objective": objective.metadata(),
            "model": self.model.config.model_dump(mode="json"),
            "task": task.info(),
            "sampler": config.sampler.model_dump(mode="json"),
            "batch_size": config.batch_size,
            "micro_batch_size": config.micro_batch_size,
        }
        self.out = Path(config.output_dir)

    def describe(self) -> str:
        return f"flow SFT: FlowDiT {self.model.num_parameters():,} parameters; task: {self.task!r}"

    def step(self) -> dict[str, float]:
        cfg = self.config
        # train_batch(position, B) holds the examples of indices [position·B, (position+1)·B)
        first = self.position * cfg.batch_size
        keys = noise_keys(range(first, first + cfg.batch_size), cfg.seed, self.trainer.global_step)
        examples, images = self.task.train_batch(self.position, cfg.batch_size)
        self.position += 1
        latents = self.model.encode_images(images)
        prompts = [e.prompt for e in examples]
        size = cfg.micro_batch_size or cfg.batch_size
        micro = [
            flow_sft_batch(
                self.model,
                latents[lo : lo + size],
                prompts[lo : lo + size],
                noise_seeds=keys[lo : lo + size],
            )
            for lo in range(0, len(prompts), size)
        ]
        result = self.trainer.train_step(micro)
        return result.metrics

    def evaluate(self, tag: str):
        step = self.steps_done()
        grid = self.out / "samples" / f"step_{step:06d}.png"
        record, metrics, self.final = evaluate_image_model(
            self.model, self.task, self.config.sampler, self.config, step, grid
        )
        return record, metrics

    def save_model(self, directory) -> None:
        info = {
            "task": self.task.info(),
            "sampler": self.config.sampler.model_dump(mode="json"),
            "trained_steps": self.steps_done(),
        }
        save_model(directory, self.model, info)

    def results(self, history) -> dict[str, Any]:
        return {
            "model_parameters": self.model.num_parameters(),
            "final_loss": (self.last_metrics or {}).get("loss"),
            "eval": self.final.to_dict(),
            "grids": sorted(str(p) for p in (self.out / "samples").glob("*.png")),
        }


def run_flow_sft(
    config: FlowSFTRecipeConfig, echo: Callable[[str], None] = print
) -> dict[str, Any]:
    """Train, evaluate, save; returns (and writes) the results summary."""
    return run(config, FlowSFTRecipe, echo)
