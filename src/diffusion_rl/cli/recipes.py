"""The recipe commands (``sft``, ``grpo``, ``distill``, ``flow-sft``, ``flow-grpo``,
``workflow-rl``), their ``--print-config``, and ``quickstart``.

A recipe command loads its config (YAML, then ``--set``), refuses a missing model directory
before creating anything, and runs on the one run loop (``recipes.run.run``); a failed run
removes the output directories it created while they are still empty.
"""

from __future__ import annotations

from pathlib import Path


def _before_after(results: dict) -> str:
    return f"accuracy {results['accuracy_before']:.3f} -> {results['accuracy_after']:.3f}"


def _held_out_before_after(results: dict) -> str:
    if "accuracy_before" not in results:  # a task without a verifier (a prompt list)
        before, after = results["reward_mean_before"], results["reward_mean_after"]
        return f"held-out reward {before:.3f} -> {after:.3f}"
    return f"held-out {_before_after(results)}"


def _distill_summary(results: dict) -> str:
    student, teacher = results["student"], results["teacher"]
    return (
        f"student accuracy {student['accuracy_before']:.3f} -> {student['accuracy_after']:.3f} "
        f"(teacher {teacher['accuracy']:.3f})"
    )


# command → (config class, recipe module and class, one-line summary of results.json)
RECIPES = {
    "sft": (
        "SFTRecipeConfig",
        "sft",
        "SFTRecipe",
        lambda r: f"accuracy {r['eval']['accuracy']:.3f}",
    ),
    "grpo": ("GRPORecipeConfig", "grpo", "GRPORecipe", _before_after),
    "distill": ("DistillRecipeConfig", "distill", "DistillRecipe", _distill_summary),
    "flow-sft": (
        "FlowSFTRecipeConfig",
        "flow_sft",
        "FlowSFTRecipe",
        lambda r: f"held-out accuracy {r['eval']['accuracy']:.3f}; model in {r['model_dir']}",
    ),
    "flow-grpo": ("FlowGRPORecipeConfig", "flow_grpo", "FlowGRPORecipe", _held_out_before_after),
    "workflow-rl": (
        "WorkflowRLRecipeConfig",
        "workflow_rl",
        "WorkflowRLRecipe",
        lambda r: f"held-out final-video {_before_after(r)}; workflow in {r['workflow']}",
    ),
}

# What writes a model directory of each kind (the hint of a missing ``*.path``).
MODEL_SOURCES = {
    "token": (
        "`diffusion-rl quickstart` writes runs/quickstart/sft/model and "
        "runs/quickstart/grpo/model; `diffusion-rl sft --config configs/sft_arithmetic.yaml` "
        "writes runs/sft/model"
    ),
    "flow": (
        "`diffusion-rl flow-sft --config configs/flow_sft_geneval.yaml` writes "
        "runs/flow_sft/model (3000 steps); `diffusion-rl quickstart --mode image` writes "
        "runs/quickstart_image/flow_sft/model and runs/quickstart_image/rl/model"
    ),
}
RECIPE_KIND = {"sft": "token", "grpo": "token", "distill": "token", "flow-sft": "flow"}


def config_yaml(config) -> str:
    """The effective config as YAML (``config.config_to_yaml`` where the config module has
    it; else every field of the validated config, defaults included, which re-loads to an
    equal config)."""
    from .. import config as configs

    to_yaml = getattr(configs, "config_to_yaml", None)
    if to_yaml is not None:
        return to_yaml(config)
    import yaml

    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def _check_model_paths(command: str, config) -> None:
    """Refuse a model directory the config names that does not exist, naming the key and the
    command that writes one — before any output directory is created."""
    from ..config import ConfigError

    kind = RECIPE_KIND.get(command, "flow")
    for section in ("model", "student", "teacher"):
        path = getattr(getattr(config, section, None), "path", None)
        if path is not None and not Path(path).exists():
            raise ConfigError(
                f"{section}.path: model directory {path} does not exist; {MODEL_SOURCES[kind]}; "
                f"or --set {section}.path=DIR for a model directory you have"
            )


def _new_directories(path: Path) -> list[Path]:
    """``path`` and its ancestors that do not exist yet, deepest first."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def cmd_recipe(args) -> int:
    """A recipe command: its config from YAML and ``--set``, run on the one run loop (or
    printed, with ``--print-config``). A run that fails removes the output directories it
    created while they are still empty."""
    import importlib

    from ..config.loading import build_config, read_config

    # the file and the overrides first: a syntax error or an input beyond the bounds is
    # answered before the config classes (and torch) are imported
    data, source = read_config(args.config, args.set)
    from .. import config as configs

    config_name, module, recipe, summary = RECIPES[args.command]
    config = build_config(getattr(configs, config_name), data, source)
    if args.print_config:
        print(config_yaml(config), end="")
        return 0
    _check_model_paths(args.command, config)
    from ..recipes.run import run

    recipe_class = getattr(importlib.import_module(f"..recipes.{module}", __package__), recipe)
    created = _new_directories(Path(config.output_dir))
    try:
        results = run(config, recipe_class)
    except BaseException:
        for directory in created:  # deepest first; stops at the first non-empty one
            try:
                directory.rmdir()
            except OSError:
                break
        raise
    from ..distributed import World, close_world

    if World.current().is_main:  # under torchrun, rank 0 speaks for the run
        print(f"{summary(results)}; results in {Path(config.output_dir) / 'results.json'}")
    close_world()
    return 0


def cmd_quickstart(args) -> int:
    from ..quickstart import run_quickstart, run_quickstart_image, run_quickstart_workflow

    run, default_dir = {
        "text": (run_quickstart, "runs/quickstart"),
        "image": (run_quickstart_image, "runs/quickstart_image"),
        "workflow": (run_quickstart_workflow, "runs/quickstart_workflow"),
    }[args.mode]
    run(
        args.output_dir or default_dir,
        steps=args.steps,
        rl_steps=args.rl_steps,
        overrides=args.set,
        threads=args.threads,
        seed=args.seed,
    )
    return 0
