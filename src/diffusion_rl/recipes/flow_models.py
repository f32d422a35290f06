"""The model of the flow recipes (flow-sft, flow-grpo): a built-in flow model or a local
diffusers pipeline (SD3, FLUX, Wan, Wan image-to-video), how it meets the task, and the model
directory a run writes (docs/flow_models.md).

* :func:`flow_start` reads what ``model.path`` holds (its kind, from ``model_index.json`` or
  ``config.json``; nothing is built), checks it against ``model.kind`` and the pipeline
  options, and gives the info the directory records (its task, ...).
* :func:`load_pipeline_actor` builds a pipeline actor for the task: the resolution defaults
  to the task's (``task.image_size``; a mini-motion task's ``num_frames`` too); an image
  pipeline may make k× larger square images (:func:`verify_scale`: the rewards see them in
  full, the verifier after a k × k area downsample, :class:`TaskView`); ``lora`` adds a LoRA
  drawn from the run's seed; the text cache is on.
* :class:`FlowActor` describes the actor for ``describe()``, the resume metadata and the
  final model directory (a built-in model directory, or a pipeline model directory:
  :class:`~diffusion_rl.models.flow_pipelines.PipelineModel`).

A text-to-video pipeline (``wan``) on the image task (mini-GenEval prompts) is judged frame
by frame: each image reward of a clip is the mean over its frames (:class:`FrameMeanReward`),
and the verifier finds an attribute right when it is right in every frame
(:class:`TaskView`).

A prompt list from a local file (``task.name: prompts``,
:class:`~diffusion_rl.tasks.datasets.PromptFileTask`) has no verifier and no image size: the
images are the model's size (a built-in model's own; a pipeline's ``model.height`` /
``width``, else the size a pipeline model directory records, else the pipeline's default,
e.g. 1024 for SD3.5-Medium), every prompt must be one the model can encode
(:func:`check_model_takes_prompts`), rollouts report no accuracy (:class:`PromptSource`) and
evaluation scores held-out samples with the configured rewards
(:func:`evaluate_prompt_model`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..config import ConfigError
from ..config.sections import flow_option_problems
from ..evaluation import evaluate_images, evaluate_rewards
from ..models.flow_pipelines import (
    PipelineModel,
    flow_directory_kind,
    load_pipeline_model,
    read_record,
)
from ..models.io import (
    LoadedModel,
    check_local_directory,
    check_model_directory,
    load_model,
    save_model,
)
from ..models.lora import has_lora, lora_settings, save_lora_model
from ..plots import save_image_grid, save_video_gif, save_video_strip
from ..rollout import FlowSource
from ..tasks.datasets import PromptFileTask
from ..tasks.geneval import GenEvalTask, attribute_accuracy
from ..tasks.motion import MotionTask

__all__ = [
    "FlowActor",
    "FlowStart",
    "FrameMeanReward",
    "PromptSource",
    "TaskView",
    "check_model_takes_prompts",
    "evaluate_pipeline_model",
    "evaluate_prompt_model",
    "flow_start",
    "load_builtin",
    "load_pipeline_actor",
    "verified",
]

VIDEO_KINDS = ("wan", "wan_i2v")


def verified(task) -> bool:
    """Whether ``task`` has a verifier (mini-GenEval, mini-motion); a prompt list has none."""
    return not isinstance(task, PromptFileTask)


@dataclass(frozen=True)
class FlowStart:
    """What ``model.path`` holds: ``kind`` (``builtin`` or a pipeline kind), ``recorded``
    (a pipeline model directory a run wrote, rather than a diffusers pipeline directory),
    ``info`` (what it records: task, sampler, ...; ``{}`` for a diffusers directory) and
    ``options`` (the adapter options it was trained with)."""

    path: Path
    kind: str
    recorded: bool
    info: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def pipeline(self) -> bool:
        return self.kind != "builtin"


def flow_start(section, field_name: str = "model") -> FlowStart:
    """The kind and recorded info of ``section.path`` (a local directory; a hub id fails at
    once), checked against ``section.kind`` and the pipeline options it sets; a
    :class:`ConfigError` names the field."""
    try:
        path = check_local_directory(section.path, f"{field_name}.path")
        kind, recorded = flow_directory_kind(path)
    except (FileNotFoundError, ValueError) as error:
        raise ConfigError(_prefixed(error, f"{field_name}.path")) from None
    wanted = None if section.kind == "flow" else section.kind
    if wanted is not None and wanted != kind:
        what = "a built-in flow model directory" if kind == "builtin" else f"a {kind} pipeline"
        raise ConfigError(
            f"{field_name}.kind: {section.path} holds {what}, not {wanted}; set kind: {kind} "
            "(or null to read it from the directory)"
        )
    problems = flow_option_problems(section, kind)
    if problems:
        raise ConfigError("\n".join(f"{field_name}.{key}: {message}" for key, message in problems))
    info, options = {}, {}
    if recorded:
        try:
            checked = check_model_directory(path)
        except (FileNotFoundError, ValueError) as error:
            raise ConfigError(f"{field_name}.path: {error}") from None
        info, options = checked["info"], dict(read_record(path).options)
    return FlowStart(path, kind, recorded, info, options)


def load_builtin(section, field_name: str = "model") -> LoadedModel:
    """The built-in flow model directory ``section.path`` (:func:`load_model`); a
    :class:`ConfigError` names the field."""
    try:
        loaded = load_model(section.path)
    except (FileNotFoundError, ValueError) as error:
        raise ConfigError(f"{field_name}.path: {error}") from None
    if loaded.kind != "flow":
        raise ConfigError(
            f"{field_name}.path: {section.path} holds a {loaded.kind} model; this recipe "
            "needs a flow model"
        )
    return loaded


def _prefixed(error: Exception, name: str) -> str:
    text = str(error)
    return text if text.startswith(name) else f"{name}: {text}"


def pipeline_options(section, start: FlowStart, task, field_name: str = "model") -> dict:
    """The adapter options: those ``start`` was trained with, then the section's, with the
    resolution (and a mini-motion task's frame count) defaulting to the task's; a prompt
    list has no size (the pipeline's own default then applies)."""
    kind = start.kind
    video_task = isinstance(task, MotionTask)
    if not verified(task) and kind == "wan_i2v":
        raise ConfigError(
            f"{field_name}.kind: a wan_i2v pipeline is conditioned on a first frame, which a "
            "prompts task (task.path) does not give; use a text-to-image or text-to-video "
            "pipeline (sd3, flux, wan)"
        )
    if video_task and kind != "wan_i2v":
        raise ConfigError(
            f"{field_name}.kind: the mini-motion task trains an image-to-video model (each "
            f"clip conditioned on its first frame): kind wan_i2v or the built-in VideoDiT, "
            f"not {kind}"
        )
    if not video_task and kind == "wan_i2v":
        raise ConfigError(
            f"{field_name}.kind: a wan_i2v pipeline is conditioned on a first frame; train it "
            "on task.name: mini-motion (flow-sft), or as a stage of a workflow (workflow-rl)"
        )
    size = task.config.image_size if verified(task) else None
    options = {} if size is None else {"height": size, "width": size}
    options.update(start.options)
    if video_task:
        options["num_frames"] = task.config.num_frames
    given = {
        "height": section.height,
        "width": section.width,
        "num_frames": section.num_frames,
        "max_sequence_length": section.max_sequence_length,
        "guidance_scale": section.embedded_guidance,
        "negative_prompt": section.negative_prompt,
    }
    options.update({key: value for key, value in given.items() if value is not None})
    return options


def verify_scale(options: dict, task, field_name: str = "model") -> int:
    """How many times the task's image size the pipeline's images are (``options``' height
    and width): 1 for the mini-motion task, whose clips must have its exact shape; for the
    image task any integer k with ``height == width == k · task.image_size`` (the verifier
    sees a k × k area downsample, the rewards the full images); 1 for a prompt list (no
    verifier: any size the pipeline makes). Else a :class:`ConfigError`."""
    if not verified(task):
        return 1
    size, height, width = task.config.image_size, options["height"], options["width"]
    if isinstance(task, MotionTask):
        frames = options.get("num_frames")
        if (height, width, frames) != (size, size, task.config.num_frames):
            raise ConfigError(
                f"{field_name}.height / width / num_frames: the mini-motion task verifies clips "
                f"of {task.config.num_frames} frames of {size} × {size} pixels, the pipeline "
                f"would make {frames} of {height} × {width}; leave them null to take the task's"
            )
        return 1
    if height != width or height % size:
        raise ConfigError(
            f"{field_name}.height / width: the {task.name} task verifies square images of "
            f"task.image_size={size} pixels, so a pipeline's must be equal multiples of it (a "
            f"k× image is verified after a k × k area downsample), got {height} × {width}; "
            "leave model.height / width null to take the task's size"
        )
    return height // size


def load_pipeline_actor(section, start: FlowStart, task, *, seed: int, field_name="model"):
    """The pipeline actor for ``task``: built from ``start`` with :func:`pipeline_options`
    (their size checked first: :func:`verify_scale`), a LoRA added (``section.lora``, drawn
    from ``seed`` without touching the global RNG), the text cache set. Returns
    ``(model, options, scale)``."""
    options = pipeline_options(section, start, task, field_name)
    scale = verify_scale(options, task, field_name)
    try:
        model = load_pipeline_model(
            start.path,
            start.kind,
            dtype=section.dtype,
            options=options,
            text_cache_size=section.text_cache_size,
        )
    except ValueError as error:
        text = str(error)
        key = text.split(":", 1)[0]
        if key in options:  # the adapter refused an option value: name its config key
            name = "embedded_guidance" if key == "guidance_scale" else key
            raise ConfigError(f"{field_name}.{name}{text[len(key) :]}") from None
        raise ConfigError(_prefixed(error, f"{field_name}.path")) from None
    except FileNotFoundError as error:
        raise ConfigError(_prefixed(error, f"{field_name}.path")) from None
    if not verified(task):  # record the size the pipeline chose (its default, or as given)
        shape = model.output_shape
        options = {"height": shape[-2], "width": shape[-1], **options}
        if len(shape) == 4:
            options.setdefault("num_frames", shape[0])
    if section.lora is not None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model.add_lora(section.lora)
    return model, options, scale


def directory_digest(path: Path) -> str:
    """A short hash of a directory's layout and small files: every file's relative path and
    size, and the bytes of its JSON / text files (configs, tokenizers), without reading the
    weights. Identifies the base of a pipeline run in its checkpoints."""
    digest = hashlib.sha256()
    for file in sorted(p for p in Path(path).rglob("*") if p.is_file()):
        relative = file.relative_to(path).as_posix()
        digest.update(f"{relative}:{file.stat().st_size}\n".encode())
        if file.suffix in (".json", ".txt"):
            digest.update(file.read_bytes())
    return digest.hexdigest()[:16]


@dataclass
class FlowActor:
    """The trained flow model and where it came from: ``kind``, ``start`` (None: a new
    built-in model), the pipeline ``dtype``, ``options`` and ``scale``
    (:func:`verify_scale`)."""

    model: Any
    kind: str
    start: FlowStart | None = None
    dtype: str = "float32"
    options: dict[str, Any] = field(default_factory=dict)
    scale: int = 1  # the pipeline's images are this many times the task's size

    def check_activation_checkpointing(self, enabled: bool) -> None:
        """``activation_checkpointing: true`` needs a pipeline (diffusers' own gradient
        checkpointing); a :class:`ConfigError` otherwise."""
        if enabled and not self.pipeline:
            raise ConfigError(
                "activation_checkpointing: applies to pipeline models (diffusers' gradient "
                f"checkpointing); the built-in {type(self.model).__name__} is small enough "
                "without it (set it to false)"
            )

    def judged(self, task):
        """The task as this actor's outputs meet it: a :class:`TaskView` for a pipeline
        (frames, k× images), the task itself for a built-in model or a task without a
        verifier."""
        return TaskView(task, self.scale) if self.pipeline and verified(task) else task

    @property
    def pipeline(self) -> bool:
        return self.kind != "builtin"

    @property
    def video(self) -> bool:
        """A text-to-video pipeline (its rows are clips)."""
        return self.kind in VIDEO_KINDS

    def parameter_counts(self) -> tuple[int, int]:
        """``(trainable, total)`` parameters."""
        params = list(self.model.parameters())
        return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)

    def describe(self) -> str:
        trainable, total = self.parameter_counts()
        if not self.pipeline:
            settings = lora_settings(self.model)
            if settings is None:
                return f"{type(self.model).__name__} {total:,} parameters"
            return (
                f"{type(self.model).__name__} with LoRA rank {settings.rank}: {trainable:,} "
                f"trainable of {total:,} parameters"
            )
        lora = self.model.lora
        how = "full transformer" if lora is None else f"LoRA rank {lora.rank}"
        shape = "×".join(map(str, self.model.output_shape))
        return (
            f"{self.kind} pipeline {self.start.path} ({self.dtype}, {shape} pixels; {how}: "
            f"{trainable:,} trainable of {total:,} parameters)"
        )

    def metadata(self) -> dict[str, Any]:
        """What a checkpoint of this run must match (``model`` in the resume metadata)."""
        if not self.pipeline:  # (no "lora" key without one: older checkpoints still match)
            settings = lora_settings(self.model)
            lora = {} if settings is None else {"lora": settings.model_dump(mode="json")}
            return {**self.model.config.model_dump(mode="json"), **lora}
        lora = self.model.lora
        return {
            "kind": self.kind,
            "base": str(self.start.path.resolve()),
            "base_digest": directory_digest(self.start.path),
            "dtype": self.dtype,
            "options": self.options,
            "lora": None if lora is None else lora.model_dump(mode="json"),
        }

    def save(self, directory, model, info: dict[str, Any]) -> None:
        """The final model directory of ``model`` (this actor, or its EMA): a built-in
        model directory, or a pipeline model directory whose base is the start directory."""
        if not self.pipeline:
            if has_lora(model):  # the adapter and its base directory (models.lora)
                save_lora_model(directory, model, info)
            else:
                save_model(directory, model, info)
            return
        record = PipelineModel(
            model, base=self.start.path, kind=self.kind, dtype=self.dtype, options=self.options
        )
        save_model(directory, record, info)


# ----------------------------------------------------------------------------- clips as images
class FrameMeanReward:
    """An image reward applied to text-to-video clips ``[B, F, 3, H, W]``: each frame is
    scored as an image of the row's prompt and the clip's reward is the mean over its
    frames; images ``[B, 3, H, W]`` are passed through unchanged."""

    def __init__(self, reward) -> None:
        self.reward = reward
        self.name = reward.name

    def __repr__(self) -> str:
        return f"FrameMean({self.reward!r})"

    def __call__(self, outputs: torch.Tensor, examples) -> torch.Tensor:
        if not isinstance(outputs, torch.Tensor) or outputs.dim() != 5:
            return self.reward(outputs, examples)
        rows, frames = outputs.shape[:2]
        repeated = [example for example in examples for _ in range(frames)]
        scores = self.reward(outputs.flatten(0, 1), repeated)
        return torch.as_tensor(scores, dtype=torch.float32).view(rows, frames).mean(1)


class TaskView:
    """The image task as a pipeline's outputs meet it: its prompts, split and settings
    (everything but the verifier is the task's), with a verifier that takes

    * images ``[B, 3, k S, k S]`` of ``scale`` k times the task's size ``S``: each is first
      averaged over k × k pixel blocks (an exact area downsample; values stay in [0, 1]);
    * clips ``[B, F, 3, H, W]`` of a text-to-video model: an attribute is right when the image
      verifier finds it right in every frame (``overall`` likewise).

    With ``scale`` 1 and images it is the task's own verifier."""

    def __init__(self, task: GenEvalTask, scale: int = 1) -> None:
        if isinstance(scale, bool) or not isinstance(scale, int) or scale < 1:
            raise ValueError(f"scale: expected an int >= 1, got {scale!r}")
        self.task = task
        self.scale = scale

    def __getattr__(self, name: str):
        if name in ("task", "scale"):  # not set yet (copy, unpickling)
            raise AttributeError(name)
        return getattr(self.task, name)

    def __repr__(self) -> str:
        return f"TaskView({self.task!r}, scale={self.scale})"

    def verify(self, outputs: torch.Tensor, examples) -> list[dict[str, bool]]:
        if outputs.dim() not in (4, 5):
            raise ValueError(
                f"outputs: expected images [B, 3, H, W] or clips [B, F, 3, H, W], got "
                f"{tuple(outputs.shape)}"
            )
        frames = outputs.shape[1] if outputs.dim() == 5 else 1
        images = outputs.flatten(0, 1) if outputs.dim() == 5 else outputs
        if self.scale > 1:
            images = F.avg_pool2d(images.float(), self.scale)
        repeated = [example for example in examples for _ in range(frames)]
        per_frame = self.task.verify(images, repeated)
        results = []
        for row in range(len(examples)):
            mine = per_frame[row * frames : (row + 1) * frames]
            results.append({key: all(r[key] for r in mine) for key in mine[0]})
        return results

    def rewards(self, outputs: torch.Tensor, examples, mode: str = "mean") -> torch.Tensor:
        """float32 ``[B]``: the fraction of attributes :meth:`verify` finds right
        (``"mean"``), or 1.0 iff all are (``"all"``)."""
        if mode not in ("mean", "all"):
            raise ValueError(f"mode: expected 'mean' or 'all', got {mode!r}")
        values = []
        for result in self.verify(outputs, examples):
            parts = [v for k, v in result.items() if k != "overall"]
            values.append(float(result["overall"]) if mode == "all" else sum(parts) / len(parts))
        return torch.tensor(values, dtype=torch.float32)

    def accuracy(self, outputs: torch.Tensor, examples) -> dict[str, float]:
        return attribute_accuracy(self.verify(outputs, examples))


def evaluate_pipeline_model(model, task: TaskView, sampler, config, grid: Path, *, video: bool):
    """Held-out evaluation of a pipeline actor on the image task (seen through a
    :class:`TaskView`), as :func:`~diffusion_rl.recipes.common.evaluate_image_model` does for
    built-in models: rows sampled ``sampler.micro_batch_size`` (or 8) at a time, so the VAE
    decodes few images at once; a text-to-video model's grid is frame strips with a GIF beside
    them. Returns ``(result, grid)``: ``grid`` the written file relative to
    ``config.output_dir``, or None when ``grid_images`` is 0."""
    result = evaluate_images(
        model,
        task,
        sampler,
        samples_per_prompt=config.eval_samples_per_prompt,
        seed=config.eval_seed,
        batch_size=sampler.micro_batch_size or 8,
    )
    return result, save_preview(result, config, grid, video=video)


def save_preview(result, config, grid: Path, *, video: bool) -> str | None:
    """The first ``config.grid_images`` samples of an evaluation ``result`` as a captioned
    grid (a video model: frame strips with a GIF beside them) at ``grid``; returns the file
    relative to ``config.output_dir``, or None when ``grid_images`` is 0."""
    count = min(config.grid_images, result.num_images)
    if not count:
        return None
    images, captions = result.images[:count], result.captions()[:count]
    upscale = max(1, 96 // int(images.shape[-1]))  # 6x for 16 pixels, none from 96 up
    if video:
        save_video_strip(images, grid, captions=captions, upscale=upscale)
        save_video_gif(images, Path(grid).with_suffix(".gif"), upscale=upscale)
    else:
        save_image_grid(images, grid, nrow=8, captions=captions, upscale=upscale)
    grid, root = Path(grid), Path(config.output_dir)
    return str(grid.relative_to(root) if grid.is_relative_to(root) else grid)


# ----------------------------------------------------------------------------- prompt lists
def check_model_takes_prompts(model, task: PromptFileTask, field: str = "model.path") -> None:
    """Every prompt of a prompt list (both splits) is one the built-in ``model`` encodes:
    its words (lower-cased, split on whitespace) are in the model's vocabulary and there are
    at most ``max_prompt_tokens`` of them; else a :class:`ConfigError` naming ``field``,
    ``task.path`` and the first offending row. (A pipeline's text encoders take any text.)"""
    vocabulary = set(model.config.vocabulary)
    limit = model.config.max_prompt_tokens
    for example in sorted(task.prompts("train") + task.prompts("eval"), key=lambda e: e.row):
        words = example.prompt.lower().split()
        unknown = sorted(set(words) - vocabulary)
        if unknown:
            raise ConfigError(
                f"{field}: the built-in {type(model).__name__} knows only the words of its "
                f"vocabulary, and row {example.row} of task.path {task.config.path} has "
                f"{unknown} outside it; use a pipeline model (kind sd3, flux, wan) for free "
                f"text, or prompts in its vocabulary {list(model.config.vocabulary)}"
            )
        if len(words) > limit:
            raise ConfigError(
                f"{field}: row {example.row} of task.path {task.config.path} has "
                f"{len(words)} words, more than the model's max_prompt_tokens={limit}"
            )


class PromptSource(FlowSource):
    """:class:`~diffusion_rl.rollout.FlowSource` for a task without a verifier: rollouts
    report no accuracy (the configured rewards, ``rollout/reward_mean`` and each term, are
    the whole picture); the task is asked for its examples only."""

    def stats(self, rollout) -> dict[str, float]:
        return {}


def evaluate_prompt_model(model, task, reward_fn, sampler, config, grid: Path, *, pipeline, video):
    """Held-out evaluation on a prompt list (:func:`~diffusion_rl.evaluation.evaluate_rewards`:
    the ODE sampler at fixed seeds, each sample scored by ``reward_fn``, the run's configured
    rewards), ``sampler.micro_batch_size`` (or 8) rows at a time for a pipeline, 128 for a
    built-in model; a captioned grid of the first ``config.grid_images`` samples (clips: frame
    strips and a GIF). Returns ``(record, metrics, result)``: the record holds
    ``reward_mean`` (the weighted total's mean), ``rewards`` (each term's mean, by name) and,
    when a grid is written, ``grid`` (relative to ``config.output_dir``; the caller adds
    ``step``); the metrics are ``eval/reward_mean`` and ``eval/<reward name>``."""
    result = evaluate_rewards(
        model,
        task,
        sampler,
        reward_fn,
        samples_per_prompt=config.eval_samples_per_prompt,
        seed=config.eval_seed,
        batch_size=(sampler.micro_batch_size or 8) if pipeline else 128,
    )
    record = {"reward_mean": result.reward_mean, "rewards": dict(result.rewards)}
    metrics = {"eval/reward_mean": result.reward_mean}
    metrics.update({f"eval/{name}": value for name, value in result.rewards.items()})
    written = save_preview(result, config, grid, video=video)
    if written is not None:
        record["grid"] = written
    return record, metrics, result
