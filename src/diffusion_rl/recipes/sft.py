"""Recipe: masked-diffusion SFT of a token denoiser on a built-in task.

Composes: task (data by position, verifier) → :class:`MaskedDiffusionSFT` → :class:`Trainer`
(global weighted accumulation) → :func:`evaluate_task` (the serving sampler + verifier), on
the run loop (:func:`~diffusion_rl.recipes.run.run`: checkpoints with exact resume,
``metrics.jsonl``, ``curves.png``, ``model/``, ``results.json``).

Each training row's masks are drawn from its own noise key
``noise_keys(dataset index, seed, trainer step)``, so ``micro_batch_size`` changes memory
use and nothing else: any split gives the same update.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..config import SFTRecipeConfig
from ..contracts import DiffusionTokenBatch
from ..models import DiffusionTransformer, TransformerConfig
from ..objectives import MaskedDiffusionSFT
from ..seeding import noise_keys
from .common import (
    check_tokenizer,
    evaluate_tokens,
    load_ref,
    save_token_model,
    token_task,
    trainer_factory,
    with_lora,
)
from .run import Recipe, run


def sft_batch(data: dict, noise_seeds: torch.Tensor) -> DiffusionTokenBatch:
    """Task tensors → the SFT contract (completion = targets, completion mask = weights);
    ``noise_seeds`` (int64 ``[B]``) are the rows' noise keys."""
    return DiffusionTokenBatch(
        model_inputs={
            "prompt_ids": data["prompt_ids"],
            "prompt_mask": data["prompt_mask"],
            "noise_seeds": noise_seeds,
        },
        target_ids=data["completion_ids"],
        loss_weights=data["completion_mask"].float(),
    )


class SFTRecipe(Recipe):
    name = "sft"
    title = "masked-diffusion SFT"

    def __init__(self, config: SFTRecipeConfig) -> None:
        self.config = config
        loaded = None if config.model.path is None else load_ref(config.model, "token", "model")
        tokenizer = None if loaded is None else loaded.tokenizer  # None: the task's own
        self.task = task = token_task(config.task, config.sampler.block_size, {}, "task", tokenizer)
        if loaded is not None:
            check_tokenizer(loaded, task, "model.path")
            self.model = loaded.model
        else:
            m = config.model
            self.model = DiffusionTransformer(
                TransformerConfig(
                    vocab_size=task.tokenizer.vocab_size,
                    mask_token_id=task.tokenizer.mask_id,
                    d_model=m.d_model,
                    n_layers=m.n_layers,
                    n_heads=m.n_heads,
                    d_ff=m.d_ff,
                    max_seq_len=task.prompt_length + task.completion_length,
                    attention=m.attention,
                    block_size=config.sampler.block_size,
                )
            )
        self.model = with_lora(self.model, config.model, "model", config.seed)
        objective = MaskedDiffusionSFT(config.objective)
        self.trainer = trainer_factory(config)(self.model, objective)
        self.sampler = config.sampler.model_copy(
            update={"generation_length": task.completion_length}
        )
        self.metadata = {
            "objective": objective.metadata(),
            "model": self.model.config.model_dump(),
            "tokenizer": task.tokenizer.name,
            "task": {"name": task.name, **task.config.model_dump()},
            "sampler": self.sampler.model_dump(),
            "batch_size": config.batch_size,
            "micro_batch_size": config.micro_batch_size,
        }

    def describe(self) -> str:
        return (
            f"model: {self.model.num_parameters():,} parameters, {self.model.attention} "
            f"attention; task: {self.task!r}"
        )

    def step(self) -> dict[str, float]:
        cfg = self.config
        indices = self.task.train_indices(self.position, cfg.batch_size)
        indices = indices[self.trainer.world.share(len(indices), "batch_size")]  # this rank's rows
        keys = noise_keys(indices, cfg.seed, self.trainer.global_step)
        batch = sft_batch(self.task.batch(indices, "train"), keys)
        self.position += 1
        result = self.trainer.train_step(batch.split(cfg.micro_batch_size or cfg.batch_size))
        return result.metrics

    def evaluate(self, tag: str):
        record, metrics, self.final = evaluate_tokens(
            self.model, self.task, self.sampler, self.config, self.steps_done()
        )
        return record, metrics

    def save_model(self, directory) -> None:
        save_token_model(directory, self.model, self.task, self.sampler, self.steps_done())

    def results(self, history) -> dict[str, Any]:
        return {
            "model_parameters": self.model.num_parameters(),
            "final_loss": (self.last_metrics or {}).get("loss"),
            "eval": self.final.to_dict(),
        }


def run_sft(config: SFTRecipeConfig, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Train, evaluate, save; returns (and writes) the results summary."""
    return run(config, SFTRecipe, echo)
