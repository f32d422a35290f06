"""The sections recipe configs are built from: the run fields every recipe shares
(:class:`RunConfig`), model references and new built-in models, tasks, and reward terms with
the check that they apply to the task.

Strict values: ints are ints (``steps: true`` and ``steps: 1.5`` are refused), floats are
finite, bools are bools, sections are mappings (``optim: []`` is refused), paths are
non-empty, ``device`` is ``cpu``, ``cuda``, ``cuda:N`` or ``mps`` and present on this
machine.

A GRPO config's rewards apply to its task (:func:`check_rewards_for_task`; when ``task`` is
null, to some built-in text task: the recipe checks the recorded task once it is known).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails

from ..models.lora import LoraSettings
from ..tasks import TASKS, get_task
from ..tasks.datasets import PromptFileConfig, PromptFileTask
from ..tasks.geneval import GenEvalConfig, GenEvalTask
from ..tasks.motion import MotionConfig, MotionTask
from ..train.parallel import ParallelConfig
from .limits import _limit_problems, check_device
from .loading import (
    ConfigError,
    _did_you_mean,
    _one_line,
    _prefixed,
    _problem,
    _raise_problems,
)

# ---------------------------------------------------------------------------------------------
# Run
# ---------------------------------------------------------------------------------------------


def _non_empty_path(value: str | None) -> str | None:
    if value is not None and (not value.strip() or "\x00" in value):
        raise ValueError(f"expected a non-empty path, got {value!r}")
    return value


class RunConfig(BaseModel):
    """The run fields every recipe shares (each recipe may change their defaults)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    output_dir: str = "runs/run"
    seed: int = Field(default=0, ge=0)  # at most LIMITS["seed"]
    device: str = "cpu"
    threads: int | None = Field(default=None, gt=0)  # null: 1 for small models (recipes/run.py)
    steps: int = Field(default=200, gt=0)
    precision: Literal["fp32", "bf16"] = "fp32"
    eval_every: int = Field(default=25, gt=0)
    checkpoint_every: int = Field(default=50, gt=0)
    keep_last: int = Field(default=2, gt=0)
    log_every: int = Field(default=1, gt=0)
    resume: bool = True
    # Fail loudly: this many consecutive steps skipped for a non-finite loss or gradient abort
    # the run (0: abort on the first). Zero-weight skips (no signal in a batch) never abort.
    max_consecutive_skips: int = Field(default=3, ge=0)
    wandb_project: str | None = None  # also log to Weights & Biases (pip install wandb)
    # under torchrun: meshes, FSDP mixed precision, backend (docs/distributed.md)
    distributed: ParallelConfig = Field(default_factory=ParallelConfig)

    @field_validator("output_dir", "wandb_project")
    @classmethod
    def _non_empty(cls, value: str | None) -> str | None:
        return _non_empty_path(value)

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        return check_device(value)

    @model_validator(mode="after")
    def _within_limits(self) -> RunConfig:
        _raise_problems(type(self).__name__, _limit_problems(self.model_dump()))
        return self


# ---------------------------------------------------------------------------------------------
# Rollout engine
# ---------------------------------------------------------------------------------------------

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class RolloutSection(BaseModel):
    """Where rollouts are sampled: in this process, or by a `diffusion-rl serve` server.

    ``engine: in_process`` (the default) samples with the rollout weights in this process;
    ``engine: server`` pushes them to the server at ``url`` every step and samples through
    its ``/rollout/generate`` (:mod:`diffusion_rl.rollout_remote`; docs/serving.md): the
    same traces, replayed exactly. ``model``: the served model's name (null: the server's
    only model); ``api_key_env``: the environment variable holding the server's API key
    (the key itself never goes in a config); ``timeout_s`` per request and ``max_retries``
    of a failed one. ``url`` and the rest are used with ``engine: server`` only.
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    engine: Literal["in_process", "server"] = "in_process"
    url: str | None = None  # http(s)://HOST:PORT of the server (engine: server)
    model: str | None = None  # the served model's name; null: the server's only model
    api_key_env: str | None = None  # environment variable holding the API key; null: none
    timeout_s: float = Field(default=600.0, gt=0.0, le=86_400.0, allow_inf_nan=False)
    max_retries: int = Field(default=3, ge=0, le=100)

    @model_validator(mode="after")
    def _check(self) -> RolloutSection:
        if self.engine == "server" and self.url is None:
            raise ValueError(
                "url: engine: server needs the server's address, e.g. http://127.0.0.1:8000"
            )
        if self.url is not None and not re.match(r"https?://[^/\s]+", self.url):
            raise ValueError(f"url: expected http://HOST:PORT or https://..., got {self.url!r}")
        if self.api_key_env is not None and not _ENV_NAME.fullmatch(self.api_key_env):
            raise ValueError(
                f"api_key_env: expected the name of an environment variable (letters, digits, "
                f"_), got {self.api_key_env!r}; put the key itself in that variable"
            )
        if self.model is not None and not self.model.strip():
            raise ValueError("model: expected a served model's name, got an empty string")
        return self


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


ModelKind = Literal["token", "flow"]


class ModelRef(BaseModel):
    """A model directory to start from: ``path`` (any directory ``load_model`` reads: built-in,
    a Hugging Face LLaDA / Dream / SDAR checkpoint, a diffusers pipeline, a LoRA run), the
    ``kind`` it must be (``token`` or ``flow``; null: whatever the recipe needs), ``lora``
    (train only a LoRA adapter), ``dtype`` of the weights (null: as saved) and
    ``trust_remote_code`` (off: no code from the directory runs; docs/models.md)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    kind: ModelKind | None = None
    path: str
    lora: LoraSettings | None = None  # train only LoRA adapters (peft); null: every weight
    dtype: Literal["float32", "bfloat16"] | None = None  # the weights; null: as saved
    trust_remote_code: bool = False  # admit a tokenizer class from the directory's own code

    @field_validator("path")
    @classmethod
    def _non_empty(cls, value: str | None) -> str | None:
        return _non_empty_path(value)


class ModelSection(ModelRef):
    """A new built-in transformer of this size, or ``path`` to a saved model directory.

    The block size comes from ``sampler.block_size`` so model, data and sampler agree.
    """

    path: str | None = None
    d_model: int = Field(default=128, gt=0)
    n_layers: int = Field(default=4, gt=0)
    n_heads: int = Field(default=4, gt=0)
    d_ff: int | None = Field(default=None, gt=0)  # null: 4 * d_model
    attention: Literal["bidirectional", "block_causal"] = "block_causal"

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelSection:
        if self.d_model % self.n_heads:
            raise ValueError(f"n_heads: must divide d_model={self.d_model}, got {self.n_heads}")
        return self


FlowKind = Literal["builtin", "sd3", "flux", "wan", "wan_i2v", "flow"]
FLOW_PIPELINE_KINDS = ("sd3", "flux", "wan", "wan_i2v")
# The pipeline options, the kinds each applies to (docs/flow_models.md).
FLOW_PIPELINE_OPTIONS: dict[str, tuple[str, ...]] = {
    "dtype": FLOW_PIPELINE_KINDS,
    "height": FLOW_PIPELINE_KINDS,
    "width": FLOW_PIPELINE_KINDS,
    "num_frames": ("wan", "wan_i2v"),
    "max_sequence_length": FLOW_PIPELINE_KINDS,
    "embedded_guidance": ("flux",),
    "negative_prompt": FLOW_PIPELINE_KINDS,
}


def flow_option_problems(section: Any, kind: str) -> list[tuple[str, str]]:
    """``(key, message)`` for each pipeline option ``section`` sets that a model of ``kind``
    (``builtin`` or a pipeline kind) does not take; the default ``dtype`` (float32) and the
    unset (null) options are never a problem."""
    problems = []
    for key, kinds in FLOW_PIPELINE_OPTIONS.items():
        value = getattr(section, key)
        if value is None or (key == "dtype" and value == "float32") or kind in kinds:
            continue
        if kind == "builtin":
            why = "the built-in model's sizes come from its directory or the task"
            if key == "dtype":
                why = "built-in flow models keep float32 weights (precision: bf16 computes in bf16)"
            message = f"applies to pipeline models (kind {' | '.join(kinds)}); {why}"
        else:
            message = f"applies to kind {' | '.join(kinds)} only, not {kind}"
        problems.append((key, message))
    return problems


class FlowModelRef(ModelRef):
    """A flow model to start from: a built-in model directory or a local diffusers pipeline
    directory (``kind``: ``builtin``, ``sd3``, ``flux``, ``wan``, ``wan_i2v``; null or
    ``flow``: read from the directory), with the pipeline options (docs/flow_models.md).

    ``lora``: train a LoRA (a pipeline's transformer, or a saved built-in model; the
    reference is the model with its LoRA off);
    ``dtype``: the pipeline's weights; ``height`` / ``width`` (pixels; null: the task's
    image size), ``num_frames`` (Wan; null: the task's, or the pipeline's 81),
    ``max_sequence_length`` (text tokens; null: the pipeline's), ``embedded_guidance`` (FLUX
    guidance-distilled checkpoints; null: 3.5), ``negative_prompt`` (the unconditional
    prompt; null: ""), ``text_cache_size``: prompts whose text embeddings are kept.
    """

    kind: FlowKind | None = None
    dtype: Literal["float32", "bfloat16"] = "float32"
    height: int | None = Field(default=None, gt=0)
    width: int | None = Field(default=None, gt=0)
    num_frames: int | None = Field(default=None, gt=0)
    max_sequence_length: int | None = Field(default=None, gt=0)
    embedded_guidance: float | None = Field(default=None, ge=0.0, allow_inf_nan=False)
    negative_prompt: str | None = None
    text_cache_size: int = Field(default=64, ge=0, le=1_000_000)

    @model_validator(mode="after")
    def _options_fit_the_kind(self) -> FlowModelRef:
        if self.trust_remote_code:
            raise ValueError(
                "trust_remote_code: flow models load with diffusers' stock classes and never "
                "run a directory's own code; leave it false"
            )
        kind = "builtin" if self.kind == "flow" else self.kind
        if kind is not None:
            problems = flow_option_problems(self, kind)
            _raise_problems(type(self).__name__, [_problem((k,), m) for k, m in problems])
        return self


class FlowModelSection(FlowModelRef):
    """A new built-in :class:`~diffusion_rl.models.dit.FlowDiT` of this size, or ``path`` to
    a saved flow model directory or a local diffusers pipeline directory (the pipeline
    options of :class:`FlowModelRef`). Image size and prompt vocabulary come from the task."""

    path: str | None = None
    patch_size: int = Field(default=4, gt=0)
    d_model: int = Field(default=96, gt=0)
    n_layers: int = Field(default=4, gt=0)
    n_heads: int = Field(default=4, gt=0)
    mlp_ratio: float = Field(default=4.0, gt=0.0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _heads_divide_width(self) -> FlowModelSection:
        if self.d_model % self.n_heads:
            raise ValueError(f"n_heads: must divide d_model={self.d_model}, got {self.n_heads}")
        if self.path is None and self.kind in FLOW_PIPELINE_KINDS:
            raise ValueError(
                f"path: kind {self.kind} loads a local diffusers pipeline directory; set "
                "model.path to it (leave kind null for a new built-in FlowDiT)"
            )
        return self


class PolicyModelSection(ModelRef):
    path: str = "runs/quickstart/sft/model"


class TeacherSection(ModelRef):
    """The teacher: a saved model directory sharing the student's tokenizer (any size)."""

    path: str = "runs/quickstart/grpo/model"


class FlowPolicyModelSection(FlowModelRef):
    path: str = "runs/flow_sft/model"


# ---------------------------------------------------------------------------------------------
# Tasks
# ---------------------------------------------------------------------------------------------


class TaskSection(BaseModel):
    """``name`` picks a text task (``arithmetic``, ``countdown``, ``sudoku``, or ``math``:
    word problems from a local file, whose ``path`` must exist); the other keys are that
    task's settings (see docs/tasks.md).

    After validation the extra keys are the task's full settings (defaults filled in,
    normalised by the task's config class), except ``block_size``, which comes from
    ``sampler.block_size``.
    """

    model_config = ConfigDict(extra="allow", strict=True)

    name: str = "arithmetic"

    @model_validator(mode="after")
    def _check(self) -> TaskSection:
        if self.name not in TASKS:
            raise ValueError(
                f"name: unknown task {self.name!r}; known tasks: {sorted(TASKS)}"
                + _did_you_mean(self.name, TASKS)
            )
        options = self.options()
        if "block_size" in options:
            message = "set sampler.block_size instead (model, data and sampler share it)"
            _raise_problems("TaskSection", [_problem(("block_size",), message)])
        config_cls = TASKS[self.name][0]
        # validated by the task's own class (its keys by name); the block size is checked with
        # the sampler's by the recipe config
        neutral = {"block_size": 1} if "block_size" in config_cls.model_fields else {}
        settings = config_cls(**options, **neutral).model_dump(exclude={"block_size"})
        self.__pydantic_extra__ = settings
        return self

    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    @classmethod
    def known_keys(cls) -> list[str]:
        keys = ["name"]
        for config_cls, _ in TASKS.values():
            keys += [k for k in config_cls.model_fields if k not in keys and k != "block_size"]
        return keys

    def build(self, block_size: int):
        """The task, its block size the sampler's."""
        return get_task(self.name, block_size=block_size, **self.options())


def _token_task_problems(section: TaskSection, block_size: int) -> list[InitErrorDetails]:
    try:
        section.build(block_size)
    except ValidationError as error:
        problems = _prefixed(error, ("task",))
        for problem in problems:  # the task's block size is the sampler's
            if tuple(problem["loc"]) == ("task", "block_size"):
                problem["loc"] = ("sampler", "block_size")
        return problems
    except (ValueError, ImportError) as error:  # a dataset task's file, or datasets missing
        message = str(error)
        key = re.match(r"task\.(\w+): ", message)  # "task.KEY: ...": the key it is about
        if key:
            return [_problem(("task", key.group(1)), message[key.end() :])]
        return [_problem(("task",), message)]
    return []


class ImageTaskSection(GenEvalConfig):
    """The image task: ``name`` (``geneval``, the only built-in one) and the
    :class:`~diffusion_rl.tasks.geneval.GenEvalConfig` keys with their defaults (YAML lists
    are accepted for ``kinds``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    name: Literal["geneval"] = "geneval"

    def build(self) -> GenEvalTask:
        return GenEvalTask(GenEvalConfig(**self.model_dump(exclude={"name"})))


class MotionTaskSection(MotionConfig):
    """The video task: ``name: mini-motion`` and the
    :class:`~diffusion_rl.tasks.motion.MotionConfig` keys with their defaults (clips of a
    shape moving as the prompt says; the model is then the built-in image-to-video
    :class:`~diffusion_rl.models.video_dit.VideoDiT`)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    name: Literal["mini-motion"]

    def build(self) -> MotionTask:
        return MotionTask(MotionConfig(**self.model_dump(exclude={"name"})))


class PromptTaskSection(PromptFileConfig):
    """A prompt list from a local file for the image recipes (flow-grpo): ``name: prompts``
    and the :class:`~diffusion_rl.tasks.datasets.PromptFileConfig` keys (``path`` required:
    a ``.txt`` file, one prompt per line, or a ``.jsonl`` / ``.parquet`` / ``.csv`` table
    whose ``prompt_field`` column holds the prompts; ``format``, ``heldout_fraction``,
    ``seed``). Its other columns are the examples' attributes (``text``: the OCR reward's
    target). The task has no verifier (reward models score it) and no image size (the
    model's). Invariant: a validated section names a file that builds, so the recipe's
    :meth:`build` reads no file the config did not (the rows are cached per file)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    name: Literal["prompts"]

    @model_validator(mode="after")
    def _readable(self) -> PromptTaskSection:
        try:
            self.build()
        except ImportError as error:
            raise ValueError(f"path: {self.path}: {error}") from None
        except ValueError as error:  # "task.KEY: ..." from the task: the key it is about
            raise ValueError(str(error).removeprefix("task.")) from None
        return self

    def build(self) -> PromptFileTask:
        return PromptFileTask(PromptFileConfig(**self.model_dump(exclude={"name"})))


# ---------------------------------------------------------------------------------------------
# Rewards
# ---------------------------------------------------------------------------------------------


class RewardSection(BaseModel):
    """One reward term: ``name`` from the reward registry, its ``weight`` and options."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = "verifier"
    weight: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)
    options: dict[str, Any] = {}


# The text rewards that apply to each built-in text task. ``verifier`` and ``digits`` are the
# task's own verifier (exact answer; partial credit per digit); ``math`` compares the
# completion's final answer with the example's ``answer`` string through math-verify (pip
# install 'diffusion-rl[math]'). ``countdown`` needs examples with ``numbers`` and ``target``
# (the countdown task's) and ``sudoku`` a ``puzzle`` (the sudoku task's). The math task (a
# local file of word problems) is verified by math-verify: its verifier is the math reward.
TASK_REWARDS: dict[str, tuple[str, ...]] = {
    "arithmetic": ("verifier", "digits", "math"),
    "countdown": ("verifier", "countdown"),
    "sudoku": ("verifier", "sudoku"),
    "math": ("verifier", "math"),
}
_TASK_BOUND_REWARDS = ("verifier", "digits")  # built with task=...: they take no options
_REWARD_NEEDS = {
    "countdown": "examples with 'numbers' and 'target'",
    "sudoku": "examples with a 'puzzle'",
}


def _reward_options_problem(name: str, options: dict[str, Any]) -> str | None:
    """Why the registered reward ``name`` refuses ``options`` (None: it takes them)."""
    from ..rewards import REWARDS, get_reward

    parameters = inspect.signature(REWARDS[name]).parameters.values()
    accepted = [p.name for p in parameters if p.kind is p.KEYWORD_ONLY]
    unknown = [key for key in options if key not in accepted]
    if unknown:
        return (
            f"unknown option {unknown[0]!r} of the {name} reward"
            f"{_did_you_mean(unknown[0], accepted)} (options: {', '.join(accepted) or 'none'})"
        )
    try:
        get_reward(name, **options)  # the reward's own checks of its option values
    except (TypeError, ValueError, ImportError) as error:
        return _one_line(error)
    return None


def _reward_problems(rewards: Sequence[Any], task_name: str | None) -> list[tuple[tuple, str]]:
    """(key, message) for each reward term that does not apply to ``task_name`` (None: to no
    built-in text task), or whose options its reward refuses."""
    from ..rewards import REWARDS

    if task_name is None:
        usable = [n for names in TASK_REWARDS.values() for n in names]
        where = "any built-in text task"
    else:
        usable = list(TASK_REWARDS.get(task_name, ()))
        where = f"the {task_name} task"
    usable = list(dict.fromkeys(usable))
    listed = ", ".join(usable) or "none"
    problems: list[tuple[tuple, str]] = []
    for index, term in enumerate(rewards):
        name = term if isinstance(term, str) else term.name
        options = {} if isinstance(term, str) else term.options
        loc = ("rewards", index, "name")
        if name not in REWARDS:
            problems.append(
                (
                    loc,
                    f"unknown reward {name!r}; rewards that apply to {where}: {listed}"
                    + _did_you_mean(name, usable),
                )
            )
        elif name in IMAGE_REWARDS:
            problems.append(
                (
                    loc,
                    f"{name!r} is an image reward (flow-grpo); rewards that apply "
                    f"to {where}: {listed}",
                )
            )
        elif name not in usable:
            need = _REWARD_NEEDS.get(name)
            why = f" (it needs {need})" if need else ""
            problems.append(
                (loc, f"{name!r} does not apply to {where}{why}; rewards that apply: {listed}")
            )
        elif name in _TASK_BOUND_REWARDS:
            if options:
                problems.append(
                    (
                        (*loc[:2], "options"),
                        f"the {name} reward takes no options "
                        f"(it scores with the task's verifier), got {sorted(options)}",
                    )
                )
        else:
            problem = _reward_options_problem(name, options)
            if problem is not None:
                problems.append(((*loc[:2], "options"), problem))
    names = [r if isinstance(r, str) else r.name for r in rewards]
    if len(set(names)) != len(names):
        problems.append((("rewards",), f"each reward may appear once, got {names}"))
    return problems


def check_rewards_for_task(rewards: Sequence[Any], task_name: str) -> None:
    """Raise :class:`ConfigError` unless every reward term (a :class:`RewardSection` or a
    name) applies to the built-in text task ``task_name`` (:data:`TASK_REWARDS`); the message
    has one line per bad term and lists the rewards that do apply. Recipes call it once they
    know the task (a config whose ``task`` is null takes the model directory's)."""
    problems = _reward_problems(rewards, task_name)
    if problems:
        lines = [f"{'.'.join(map(str, loc))}: {message}" for loc, message in problems]
        raise ConfigError("\n".join(lines))


# clip_score, pickscore, aesthetic and ocr are reward models from local directories
# (diffusion_rl.reward_models, docs/rewards.md); the CLIP ones need ``options: {path: DIR}``.
IMAGE_REWARDS = ("geneval", "compressibility", "clip_score", "pickscore", "aesthetic", "ocr")
VIDEO_REWARDS = ("motion",)
# The image rewards that score with the task's own verifier (mini-GenEval's attribute
# checks): a prompt list (task.name: prompts) has none, so they do not apply to it.
VERIFIER_IMAGE_REWARDS = ("geneval",)


def prompt_task_reward_problems(rewards: Sequence[Any]) -> list[tuple[tuple, str]]:
    """``(key, message)`` for each reward term (a section or a name) that needs a task
    verifier, which a prompts task (``task.name: prompts``) does not have."""
    usable = ", ".join(r for r in IMAGE_REWARDS if r not in VERIFIER_IMAGE_REWARDS)
    problems = []
    for index, term in enumerate(rewards):
        name = term if isinstance(term, str) else term.name
        if name in VERIFIER_IMAGE_REWARDS:
            problems.append(
                (
                    ("rewards", index, "name"),
                    f"the {name} reward scores images with the mini-GenEval verifier, and a "
                    f"prompts task (task.path) has no verifier; use rewards that need none: "
                    f"{usable}",
                )
            )
    return problems


class ImageRewardSection(RewardSection):
    """One image reward term: ``geneval`` (mini-GenEval attribute correctness; options
    ``mode: mean | all``, ``min_area``), ``compressibility`` (options ``format``,
    ``quality``, ``unit``), or a reward model (docs/rewards.md): ``clip_score`` /
    ``pickscore`` (options ``path`` required, ``scale``, ``device``, ``dtype``,
    ``batch_size``), ``aesthetic`` (``path`` and ``head`` required, ``activation``, ...),
    ``ocr`` (``text_field``, ``detect``, ``ignore_case``, ``ignore_spaces``); its ``weight``
    and options."""

    name: str = "geneval"

    @model_validator(mode="after")
    def _check(self) -> ImageRewardSection:
        if self.name not in IMAGE_REWARDS:
            raise ValueError(
                f"name {self.name!r} is not an image reward; use one of {IMAGE_REWARDS}"
            )
        problem = _reward_options_problem(self.name, self.options)
        if problem is not None:
            unknown = problem.startswith("unknown option")
            raise ValueError(f"options: {problem}" if unknown else problem)
        return self


class VideoRewardSection(RewardSection):
    """One reward term on a workflow's final videos: ``motion`` (the mini-motion clip
    verifier; options ``attributes``, a subset of color, shape, direction, speed, smooth, and
    ``mode: mean | all``), its ``weight`` and options."""

    name: str = "motion"

    @model_validator(mode="after")
    def _check(self) -> VideoRewardSection:
        if self.name not in VIDEO_REWARDS:
            raise ValueError(
                f"name {self.name!r} is not a video reward; use one of {VIDEO_REWARDS}"
            )
        problem = _reward_options_problem(self.name, self.options)
        if problem is not None:
            unknown = problem.startswith("unknown option")
            raise ValueError(f"options: {problem}" if unknown else problem)
        return self
