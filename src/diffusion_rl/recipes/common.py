"""What recipes compose the same way: trainers, model references, tasks, evaluations.

Every helper here is shared by at least two recipes; a recipe module imports only from here,
:mod:`~diffusion_rl.recipes.run` and the layers below (never another recipe).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import ConfigError, FlowModelSection, ModelRef, TaskSection
from ..evaluation import (
    ClipEvalResult,
    ImageEvalResult,
    evaluate_images,
    evaluate_task,
    evaluate_videos,
)
from ..models.dit import FlowDiT, FlowDiTConfig
from ..models.io import LoadedModel, load_model, save_model
from ..models.lora import add_lora, has_lora, merge_lora, save_lora_model
from ..models.video_dit import VideoDiT, VideoDiTConfig
from ..plots import save_image_grid, save_video_gif, save_video_strip
from ..tasks import TokenizerMismatchError, get_task
from ..tasks.datasets import PromptFileTask
from ..tasks.geneval import GenEvalTask
from ..tasks.motion import MotionTask
from ..train.parallel import run_parallel
from ..train.trainer import LossFn, Trainer

# The flow recipes' model: built-in or a diffusers pipeline (recipes/flow_models.py).
from .flow_models import (  # noqa: F401, E402 - re-exported for flow-sft and flow-grpo
    FlowActor,
    FrameMeanReward,
    PromptSource,
    TaskView,
    check_model_takes_prompts,
    evaluate_pipeline_model,
    evaluate_prompt_model,
    flow_start,
    load_builtin,
    load_pipeline_actor,
    verified,
)


def trainer_factory(config: Any) -> Callable[[nn.Module, LossFn | None], Trainer]:
    """``(model, loss_fn) → Trainer`` with the recipe config's ``optim``, ``precision``,
    ``seed`` and ``device`` (and ``activation_checkpointing`` where the recipe offers it),
    sharded as ``distributed`` says under ``torchrun``."""

    def make_trainer(model: nn.Module, loss_fn: LossFn | None) -> Trainer:
        return Trainer(
            model,
            loss_fn,
            config.optim,
            precision=config.precision,
            activation_checkpointing=getattr(config, "activation_checkpointing", False),
            seed=config.seed,
            device=config.device,
            parallel=run_parallel(config.distributed),
        )

    return make_trainer


def weights_digest(model: torch.nn.Module) -> str:
    """A short content hash of a model's weights (identifies a frozen model in checkpoints)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def load_ref(ref: ModelRef, kind: str, field: str) -> LoadedModel:
    """The model directory ``ref`` names, refused (naming ``field``) unless it is ``kind``."""
    expected = ref.kind or kind
    if expected != kind:
        raise ConfigError(f"{field}.kind: this recipe trains {kind} models, got {ref.kind!r}")
    try:
        loaded = load_model(ref.path, dtype=ref.dtype, trust_remote_code=ref.trust_remote_code)
    except (FileNotFoundError, ValueError) as error:
        raise ConfigError(f"{field}.path: {error}") from None
    if loaded.kind != kind:
        raise ConfigError(
            f"{field}.path: {ref.path} holds a {loaded.kind} model; this recipe needs a {kind} model"
        )
    return loaded


def with_lora(model, ref: ModelRef, field: str, seed: int):
    """The loaded ``model`` as ``ref`` trains it. A model loaded from a LoRA directory has its
    adapter merged first (it is the base of this run); then, with ``ref.lora``, a fresh LoRA
    adapter (seeded by ``seed``; only its weights train, and the run's model directory
    records ``ref.path`` as its base). Errors name ``field``."""
    if has_lora(model):
        merge_lora(model)
    if ref.lora is None:
        return model
    if ref.path is None:
        raise ConfigError(
            f"{field}.lora: a LoRA adapter trains on a saved base model; set {field}.path "
            f"(or {field}.lora: null to train a new model in full)"
        )
    try:
        return add_lora(model, ref.lora, seed=seed, field=f"{field}.lora", base=ref.path)
    except ValueError as error:
        raise ConfigError(str(error)) from None


# ----------------------------------------------------------------------------- token world
def token_task(
    section: TaskSection | None,
    block_size: int,
    model_info: dict,
    field: str,
    tokenizer=None,
    tokenizer_field: str = "model.path",
):
    """The task a config section names, or (``section`` None) the task the model directory
    ``field`` records; its block size is the sampler's (one source of truth for model, data,
    sampler). It encodes with ``tokenizer`` (the loaded model's, from the config key
    ``tokenizer_field``; None: the task's own character tokenizer, for a new model). A
    character tokenizer lacking the task's characters, or a task that cannot be built (e.g.
    its data file), is a :class:`ConfigError` naming the key."""
    if section is not None:
        options = section.options()
        if "block_size" in options:
            raise ConfigError(
                "task.block_size: set sampler.block_size instead (model, data and sampler share it)"
            )
        name = section.name
    else:
        if "task" not in model_info:
            raise ConfigError(
                f"task: {field} does not record its task; set task.name and its options"
            )
        options = dict(model_info["task"])
        name = options.pop("name")
        if options.get("block_size", block_size) != block_size:
            raise ConfigError(
                f"sampler.block_size: the model was trained with blocks of "
                f"{options['block_size']}, got {block_size}"
            )
    options["block_size"] = block_size
    try:
        return get_task(name, tokenizer=tokenizer, **options)
    except TokenizerMismatchError as error:
        raise ConfigError(f"{tokenizer_field}: {error}") from None
    except (ValueError, ImportError) as error:  # e.g. a dataset file the tokenizer overflows
        message = " ".join(str(error).split())
        if section is not None:
            raise ConfigError(message) from None
        raise ConfigError(  # e.g. a recorded dataset file since moved
            f"task: the {name} task {field} records cannot be built here: {message}; "
            "set task to its settings"
        ) from None


def check_tokenizer(loaded: LoadedModel, task, field: str) -> None:
    """The task encodes with the model's tokenizer (``token_task(..., loaded.tokenizer)``), or
    one of the same name."""
    if task.tokenizer is not loaded.tokenizer and loaded.tokenizer.name != task.tokenizer.name:
        raise ConfigError(
            f"{field}: the model uses tokenizer {loaded.tokenizer.name}, the task {task.tokenizer.name}"
        )


def save_token_model(directory, model, task, sampler, trained_steps: int) -> None:
    """The model directory of a token recipe: the model, its tokenizer, the task it was
    trained on and the ``sampler`` it is served with."""
    info = {
        "task": {"name": task.name, **task.config.model_dump()},
        "sampler": sampler.model_dump(),
        "trained_steps": trained_steps,
    }
    if has_lora(model):  # the adapter and the base directory's path, not a copy of the base
        save_lora_model(directory, model, {"tokenizer": task.tokenizer.name, **info})
        return
    save_model(directory, model, info, task.tokenizer)


def evaluate_tokens(model, task, sampler, config, step: int):
    """Held-out accuracy with the serving sampler (and the task's partial credit, ``credit``,
    where it has one): (history record, metrics, full result)."""
    result = evaluate_task(
        model, task, sampler, num_examples=config.eval_examples, seed=config.seed
    )
    record, metrics = (
        {"step": step, "accuracy": result.accuracy},
        {"eval/accuracy": result.accuracy},
    )
    if result.credit is not None:
        record["credit"], metrics["eval/credit"] = result.credit, result.credit
    return record, metrics, result


# ----------------------------------------------------------------------------- flow world
def image_task(section, model_info: dict, field: str) -> GenEvalTask | PromptFileTask:
    """The configured image task, or (``section`` None) the task the model directory records
    (mini-GenEval, or a prompt list whose file must still be there)."""
    if section is not None:
        return section.build()
    if "task" not in model_info:
        raise ConfigError(f"task: {field} does not record its task; set task.name and its options")
    recorded = model_info["task"]
    cls = PromptFileTask if recorded.get("name") == PromptFileTask.name else GenEvalTask
    try:
        return cls.from_info(recorded)
    except ValueError as error:
        message = " ".join(str(error).split())
        raise ConfigError(
            f"task: {field} records a task this recipe cannot run: {message}; set task to "
            "its settings"
        ) from None


def new_flow_model(section: FlowModelSection, task: GenEvalTask | MotionTask) -> FlowDiT:
    """A fresh built-in model of ``section``'s sizes for ``task`` (it records the task's
    vocabulary and ``info()``, its image size is the task's): a
    :class:`~diffusion_rl.models.video_dit.VideoDiT` of the task's ``num_frames`` for the video
    task (mini-motion), else a :class:`~diffusion_rl.models.dit.FlowDiT`. Draws its initial
    weights from torch's global RNG (seed it first for reproducible weights)."""
    sizes = {
        "image_size": task.config.image_size,
        "patch_size": section.patch_size,
        "d_model": section.d_model,
        "n_layers": section.n_layers,
        "n_heads": section.n_heads,
        "mlp_ratio": section.mlp_ratio,
        "vocabulary": task.vocabulary,
        "task": task.info(),
    }
    if isinstance(task, MotionTask):
        return VideoDiT(VideoDiTConfig(**sizes, num_frames=task.config.num_frames))
    return FlowDiT(FlowDiTConfig(**sizes))


def check_model_fits_task(model, task: GenEvalTask, field: str) -> None:
    if model.latent_shape != task.image_shape:
        raise ConfigError(
            f"{field}: the model makes images {model.latent_shape}, the task {task.image_shape}; "
            "set task.image_size to the model's"
        )
    missing = sorted(set(task.vocabulary) - set(model.config.vocabulary))
    if missing:
        raise ConfigError(f"{field}: the model's vocabulary lacks the task's words {missing}")


def evaluate_image_model(model, task, sampler, config, step: int, grid: Path):
    """Held-out accuracy per attribute with the ODE sampler at fixed seeds, and a captioned
    grid of the first ``config.grid_images`` samples at ``grid``: (record, metrics, result).

    When a grid is written, ``record["grid"]`` is its path relative to ``config.output_dir``
    (the run loop logs it as the image ``eval/samples`` at the record's step)."""
    result: ImageEvalResult = evaluate_images(
        model,
        task,
        sampler,
        samples_per_prompt=config.eval_samples_per_prompt,
        seed=config.eval_seed,
    )
    record, metrics = eval_record(result, step)
    count = min(config.grid_images, result.num_images)
    if count:
        save_image_grid(
            result.images[:count], grid, nrow=8, captions=result.captions()[:count], upscale=6
        )
        record["grid"] = _relative_to(Path(grid), Path(config.output_dir))
    return record, metrics, result


def evaluate_video_model(model, task, sampler, config, step: int, grid: Path):
    """:func:`evaluate_image_model` for an image-to-video model on its video task
    (:func:`~diffusion_rl.evaluation.evaluate_videos`): frame strips of the first
    ``config.grid_images`` clips at ``grid`` and their GIF beside it (``.gif``)."""
    result: ClipEvalResult = evaluate_videos(
        model,
        task,
        sampler,
        samples_per_prompt=config.eval_samples_per_prompt,
        seed=config.eval_seed,
    )
    record, metrics = eval_record(result, step)
    count = min(config.grid_images, result.num_clips)
    if count:
        save_video_strip(result.clips[:count], grid, captions=result.prompts[:count])
        save_video_gif(result.clips[:count], Path(grid).with_suffix(".gif"))
        record["grid"] = _relative_to(Path(grid), Path(config.output_dir))
    return record, metrics, result


def before_after(
    history: list[dict[str, Any]], *keys: str, base: tuple[str, ...] = ("accuracy", "attributes")
) -> dict[str, Any]:
    """``KEY_before`` / ``KEY_after`` from the first and last evaluation records, for the
    ``base`` keys (a verified task's accuracy and attributes) and ``keys``, in that order."""
    before, after = history[0], history[-1]
    out: dict[str, Any] = {}
    for key in (*base, *keys):
        out[f"{key}_before"], out[f"{key}_after"] = before[key], after[key]
    return out


def eval_record(result: ImageEvalResult | ClipEvalResult, step: int) -> tuple[dict, dict]:
    """The history record (step, accuracy, per-attribute accuracy, mean reward, the samples'
    same-prompt ``diversity``, which no reward trains) and the metrics (``eval/accuracy``,
    ``eval/reward_mean``, ``eval/diversity``, ``eval/<attribute>``) of an evaluation."""
    diversity = result.diversity  # computed once: pairwise distances over every sample
    record = {
        "step": step,
        "accuracy": result.accuracy,
        "attributes": result.attributes,
        "reward_mean": result.reward_mean,
        "diversity": diversity,
    }
    metrics = {
        "eval/accuracy": result.accuracy,
        "eval/reward_mean": result.reward_mean,
        "eval/diversity": diversity,
    }
    metrics.update({f"eval/{k}": v for k, v in result.attributes.items() if k != "overall"})
    return record, metrics


def pipeline_eval_record(model, task, sampler, config, grid: Path, step: int, *, video: bool):
    """:func:`evaluate_pipeline_model` as a history entry: ``(record, metrics, result)``, the
    record with ``grid`` (the written preview, relative to the run) when one was written."""
    result, written = evaluate_pipeline_model(model, task, sampler, config, grid, video=video)
    record, metrics = eval_record(result, step)
    if written is not None:
        record["grid"] = written
    return record, metrics, result


def _relative_to(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


def rollout_source(source, section, roles):
    """The source a recipe collects rollouts from: ``source`` itself with
    ``rollout.engine: in_process``; with ``engine: server`` a
    :class:`~diffusion_rl.rollout_remote.ServerTokenSource` / ``ServerFlowSource`` around it
    that pushes, each version, the state-dict tensors the rollout copy owns (those
    :func:`~diffusion_rl.train.roles.frozen_copy` does not share with the actor: the trained
    ones) and samples on the server. The API key is read from ``rollout.api_key_env``."""
    import os

    if section.engine == "in_process":
        return source
    from ..rollout import TokenSource
    from ..rollout_remote import RolloutClient, ServerFlowSource, ServerTokenSource
    from ..train.roles import shared_tensors

    key = None
    if section.api_key_env is not None:
        key = os.environ.get(section.api_key_env)
        if not key:
            raise ConfigError(
                f"rollout.api_key_env: the environment variable {section.api_key_env} is not "
                "set; export the server's API key there (or set api_key_env: null)"
            )
    client = RolloutClient(
        section.url,
        model=section.model,
        api_key=key,
        timeout_s=section.timeout_s,
        max_retries=section.max_retries,
    )
    shared = shared_tensors(roles.actor)
    keys = [k for k, t in roles.actor.state_dict(keep_vars=True).items() if id(t) not in shared]
    wrapper = ServerTokenSource if isinstance(source, TokenSource) else ServerFlowSource
    return wrapper(source, client, keys=keys)
