"""Run recipe steps in this process, or in each process of a ``torchrun`` launch, and keep
what the tests compare: the trained weights (rank 0 gathers them) and every rank's metrics.

``python scenarios.py OUT SPEC.json``: SPEC maps a scenario name to ``{"recipe": "sft" | "grpo"
| "flow_grpo" | "flow_sft" | "distill" | "workflow_rl", "config": {...}, "steps": N}``; for each, ``OUT/NAME.pt``
holds the state dict after the steps and ``OUT/NAME.json`` the metrics of each step on each
rank. A scenario with ``"run": true`` is instead a whole run on the run loop (checkpoints,
resume, reports) in its config's ``output_dir``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from diffusion_rl.config import (
    DistillRecipeConfig,
    FlowGRPORecipeConfig,
    FlowSFTRecipeConfig,
    GRPORecipeConfig,
    SFTRecipeConfig,
    WorkflowRLRecipeConfig,
)
from diffusion_rl.distributed import World, init_world
from diffusion_rl.recipes.distill import DistillRecipe
from diffusion_rl.recipes.flow_grpo import FlowGRPORecipe
from diffusion_rl.recipes.flow_sft import FlowSFTRecipe
from diffusion_rl.recipes.grpo import GRPORecipe
from diffusion_rl.recipes.run import prologue, run
from diffusion_rl.recipes.sft import SFTRecipe
from diffusion_rl.recipes.workflow_rl import WorkflowRLRecipe

RECIPES = {
    "sft": (SFTRecipeConfig, SFTRecipe),
    "grpo": (GRPORecipeConfig, GRPORecipe),
    "flow_sft": (FlowSFTRecipeConfig, FlowSFTRecipe),
    "flow_grpo": (FlowGRPORecipeConfig, FlowGRPORecipe),
    "distill": (DistillRecipeConfig, DistillRecipe),
    "workflow_rl": (WorkflowRLRecipeConfig, WorkflowRLRecipe),
}


def run_scenarios(out: Path, spec: dict) -> None:
    world = World.current()
    for name, scenario in spec.items():
        config_class, recipe_class = RECIPES[scenario["recipe"]]
        config = config_class.model_validate(
            {"output_dir": str(out / f"{name}_run"), **scenario["config"]}
        )
        if scenario.get("run"):
            run(config, recipe_class, echo=lambda _: None)
            continue
        started = time.perf_counter()
        prologue(config)
        recipe = recipe_class(config)
        steps = []
        for _ in range(scenario["steps"]):
            metrics = recipe.step()
            steps.append(world.gather_objects(metrics))
        weights = recipe.trainer.publish().state_dict()
        if world.is_main:
            torch.save({k: v.detach().clone() for k, v in weights.items()}, out / f"{name}.pt")
            seconds = time.perf_counter() - started
            record = {"world_size": world.size, "steps": steps, "seconds": seconds}
            (out / f"{name}.json").write_text(json.dumps(record))
        world.barrier()


if __name__ == "__main__":
    init_world()
    run_scenarios(Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()))
