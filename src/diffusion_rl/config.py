"""Typed, validated recipe configs loaded from YAML.

Every section rejects unknown keys by name; every option has a default that runs on a laptop
CPU. ``load_config(path, cls, overrides)`` reads YAML, applies ``key.sub=value`` overrides
and validates; any problem raises :class:`ConfigError` naming the file, the dotted key and
the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .objectives.distill import DistillationLossConfig
from .objectives.flow_grpo import FlowGRPOConfig
from .objectives.flow_sft import FlowSFTConfig
from .objectives.grpo import PolicyLossConfig
from .objectives.sft import MaskedDiffusionSFTConfig
from .sampling.flow import FlowSamplerConfig
from .sampling.token import TokenSamplerConfig
from .tasks import TASKS
from .tasks.geneval import GenEvalConfig, GenEvalTask
from .train.trainer import OptimConfig

Config = TypeVar("Config", bound=BaseModel)


class ConfigError(ValueError):
    """A config file or override that does not validate."""


class TaskSection(BaseModel):
    """``name`` picks a built-in task; the other keys are that task's settings."""

    model_config = ConfigDict(extra="allow")

    name: str = "arithmetic"

    @model_validator(mode="after")
    def _check(self) -> TaskSection:
        if self.name not in TASKS:
            raise ValueError(f"name: unknown task {self.name!r}; known tasks: {sorted(TASKS)}")
        TASKS[self.name][0](**self.options())  # validates the task's own keys by name
        return self

    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class RunConfig(BaseModel):
    """The run fields every recipe shares (each recipe may change their defaults)."""

    model_config = ConfigDict(extra="forbid")

    output_dir: str = "runs/run"
    seed: int = 0
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


ModelKind = Literal["token", "flow"]


class ModelRef(BaseModel):
    """A model directory to start from: ``path`` (any directory ``load_model`` reads) and the
    ``kind`` it must be (``token`` or ``flow``; null: whatever the recipe needs)."""

    model_config = ConfigDict(extra="forbid")

    kind: ModelKind | None = None
    path: str


class ModelSection(ModelRef):
    """A new built-in transformer of this size, or ``path`` to a saved model directory.

    The block size comes from ``sampler.block_size`` so model, data and sampler agree.
    """

    path: str | None = None
    d_model: int = Field(default=128, gt=0)
    n_layers: int = Field(default=4, gt=0)
    n_heads: int = Field(default=4, gt=0)
    d_ff: int | None = None
    attention: Literal["bidirectional", "block_causal"] = "block_causal"


class SFTRecipeConfig(RunConfig):
    """``diffusion-rl sft``: masked-diffusion SFT on a built-in task, with evaluation."""

    output_dir: str = "runs/sft"
    steps: int = Field(default=2000, gt=0)
    eval_every: int = Field(default=500, gt=0)
    checkpoint_every: int = Field(default=500, gt=0)
    log_every: int = Field(default=10, gt=0)
    task: TaskSection = TaskSection()
    model: ModelSection = ModelSection()
    objective: MaskedDiffusionSFTConfig = MaskedDiffusionSFTConfig()
    optim: OptimConfig = OptimConfig()
    sampler: TokenSamplerConfig = TokenSamplerConfig()
    batch_size: int = Field(default=64, gt=0)
    micro_batch_size: int | None = Field(default=None, gt=0)
    activation_checkpointing: bool = False
    eval_examples: int = Field(default=256, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _recipe_defaults(cls, data: Any) -> Any:
        """The recipe's optimiser defaults under whatever optim keys the user gave; the LR
        schedule spans the run (``optim.total_steps`` defaults to ``steps``, warm-up to a tenth
        of it, at most 100 steps)."""
        if not isinstance(data, dict) or isinstance(data.get("optim"), OptimConfig):
            return data
        optim = {**SFT_OPTIM_DEFAULTS, **(data.get("optim") or {})}
        optim.setdefault("total_steps", data.get("steps", cls.model_fields["steps"].default))
        if isinstance(optim["total_steps"], int):
            optim.setdefault("warmup_steps", min(100, optim["total_steps"] // 10))
        return {**data, "optim": optim}


SFT_OPTIM_DEFAULTS = {"lr": 2e-3, "schedule": "cosine", "min_lr_ratio": 0.1}


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted!r}: {key!r} is not a section")
        node = child
    node[keys[-1]] = value


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    """``["optim.lr=3e-4", "steps=10"]`` → nested dict; values parsed as YAML scalars."""
    tree: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. optim.lr=3e-4")
        key, raw = item.split("=", 1)
        _set_dotted(tree, key.strip(), yaml.safe_load(raw))
    return tree


def merge_dicts(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra`` on top, section by section (nested dicts merge; any other value
    replaces). Neither input is modified."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_dicts(out[key], value)
        else:
            out[key] = value
    return out


def format_validation_error(error: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid config"]
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"]) or "(top level)"
        if item["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key; remove it or check its spelling")
        else:
            lines.append(f"  {key}: {item['msg']} (got {item.get('input')!r})")
    return "\n".join(lines)


def build_config(cls: type[Config], data: dict[str, Any], source: str = "config") -> Config:
    try:
        return cls.model_validate(data)
    except ValidationError as error:
        raise ConfigError(format_validation_error(error, source)) from None


def load_config(
    path: str | Path | None, cls: type[Config], overrides: list[str] | None = None
) -> Config:
    """Read ``path`` (YAML; None = all defaults), apply overrides, validate as ``cls``."""
    data: dict[str, Any] = {}
    source = "defaults with --set overrides"
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(
                f"{path}: expected a mapping at the top level, got {type(loaded).__name__}"
            )
        data, source = loaded, str(path)
    return build_config(cls, merge_dicts(data, parse_overrides(overrides)), source)


class RewardSection(BaseModel):
    """One reward term: ``name`` from the reward registry, its ``weight`` and options."""

    model_config = ConfigDict(extra="forbid")

    name: str = "verifier"
    weight: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)
    options: dict[str, Any] = {}


class PolicyModelSection(ModelRef):
    path: str = "runs/quickstart/sft/model"


def with_section_defaults(data: Any, defaults: dict[str, dict[str, Any]]) -> Any:
    """``data`` with each section's recipe defaults under the keys the user gave (a partial
    section keeps the recipe's other defaults, not the section class's)."""
    if not isinstance(data, dict):
        return data
    merged = dict(data)
    for name, values in defaults.items():
        given = merged.get(name)
        if given is None or isinstance(given, dict):
            merged[name] = {**values, **(given or {})}
    return merged


# Rollouts sample at T = 1 (the policy itself); evaluation is greedy (``eval_temperature``).
GRPO_SAMPLER_DEFAULTS = {"temperature": 1.0}
GRPO_OPTIM_DEFAULTS = {"lr": 1e-4, "grad_clip": 1.0}
# The student explores at T = 0.5; the teacher scores exactly the student's states.
DISTILL_SAMPLER_DEFAULTS = {"temperature": 0.5}
DISTILL_OPTIM_DEFAULTS = {"lr": 1e-3, "grad_clip": 1.0, "warmup_steps": 20}


class GRPORecipeConfig(RunConfig):
    """``diffusion-rl grpo``: GRPO / DAPO / Dr.GRPO on captured token traces."""

    output_dir: str = "runs/grpo"
    task: TaskSection | None = None  # null: the task recorded in the model directory
    model: PolicyModelSection = PolicyModelSection()
    policy: PolicyLossConfig = PolicyLossConfig()
    scorer: Literal["exact", "packed", "mean_field", "coupled", "elbo"] = "exact"
    rewards: list[RewardSection] = [RewardSection()]
    sampler: TokenSamplerConfig = TokenSamplerConfig(**GRPO_SAMPLER_DEFAULTS)
    eval_temperature: float = Field(default=0.0, ge=0.0)
    optim: OptimConfig = OptimConfig(**GRPO_OPTIM_DEFAULTS)
    prompts_per_step: int = Field(default=16, gt=0)
    group_size: int = Field(default=8, gt=1)
    micro_batch_size: int | None = Field(default=None, gt=0)
    post_stop_weight: float = Field(default=1.0, ge=0.0)
    max_sampling_rounds: int = Field(default=4, gt=0)
    allow_off_policy: bool = False
    sequence_packing: bool = False
    offload_device: str | None = None
    activation_checkpointing: bool = False
    eval_examples: int = Field(default=256, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _recipe_defaults(cls, data: Any) -> Any:
        return with_section_defaults(
            data, {"sampler": GRPO_SAMPLER_DEFAULTS, "optim": GRPO_OPTIM_DEFAULTS}
        )

    @model_validator(mode="after")
    def _fail_closed(self) -> GRPORecipeConfig:
        if self.sequence_packing:
            raise ValueError(
                "sequence_packing: not supported for diffusion traces (each row's canvas is "
                "replayed exactly; packing rows would mix their attention); set it to false"
            )
        if not self.rewards:
            raise ValueError("rewards: expected at least one reward term")
        return self


class TeacherSection(ModelRef):
    """The teacher: a saved model directory sharing the student's tokenizer (any size)."""

    path: str = "runs/quickstart/grpo/model"


class DistillRecipeConfig(RunConfig):
    """``diffusion-rl distill``: on-policy distillation of a student from a teacher.

    Every step samples fresh rollouts from the student's current weights (a trace from other
    weights is refused), scores the teacher on exactly the student's states, and trains the
    student on the soft KL (and optional hard CE) of docs/math.md §4.
    """

    output_dir: str = "runs/distill"
    steps: int = Field(default=1000, gt=0)
    eval_every: int = Field(default=100, gt=0)
    checkpoint_every: int = Field(default=100, gt=0)
    task: TaskSection | None = None  # null: the task recorded in the student's model directory
    student: PolicyModelSection = PolicyModelSection()
    teacher: TeacherSection = TeacherSection()
    objective: DistillationLossConfig = DistillationLossConfig()
    sampler: TokenSamplerConfig = TokenSamplerConfig(**DISTILL_SAMPLER_DEFAULTS)
    eval_temperature: float = Field(default=0.0, ge=0.0)
    optim: OptimConfig = OptimConfig(**DISTILL_OPTIM_DEFAULTS)
    prompts_per_step: int = Field(default=32, gt=0)
    samples_per_prompt: int = Field(default=1, gt=0)
    micro_batch_size: int | None = Field(default=None, gt=0)
    post_stop_weight: float = Field(default=1.0, ge=0.0)
    activation_checkpointing: bool = False
    eval_examples: int = Field(default=256, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _recipe_defaults(cls, data: Any) -> Any:
        return with_section_defaults(
            data, {"sampler": DISTILL_SAMPLER_DEFAULTS, "optim": DISTILL_OPTIM_DEFAULTS}
        )


# ---------------------------------------------------------------------------------------------
# Flow-matching image recipes: flow-sft and flow-grpo on mini-GenEval
# ---------------------------------------------------------------------------------------------


class ImageTaskSection(GenEvalConfig):
    """The image task: ``name`` (``geneval``, the only built-in one) and the
    :class:`~diffusion_rl.tasks.geneval.GenEvalConfig` keys with their defaults (YAML lists
    are accepted for ``kinds``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=False)

    name: Literal["geneval"] = "geneval"

    def build(self) -> GenEvalTask:
        return GenEvalTask(GenEvalConfig(**self.model_dump(exclude={"name"})))


class FlowModelSection(ModelRef):
    """A new built-in :class:`~diffusion_rl.models.dit.FlowDiT` of this size, or ``path`` to
    a saved FlowDiT directory. Image size and prompt vocabulary come from the task."""

    path: str | None = None
    patch_size: int = Field(default=4, gt=0)
    d_model: int = Field(default=96, gt=0)
    n_layers: int = Field(default=4, gt=0)
    n_heads: int = Field(default=4, gt=0)
    mlp_ratio: float = Field(default=4.0, gt=0.0)


# Constant after warm-up: at 3000 steps the cosine decay left the DiT at 16 % held-out accuracy
# (shapes still at chance), the constant rate at 55 % (same seed and data).
FLOW_SFT_OPTIM_DEFAULTS = {"lr": 1e-3, "schedule": "constant", "grad_clip": 1.0}
# Uniform σ and 10 % unconditional rows (the branch classifier-free guidance needs).
FLOW_SFT_OBJECTIVE_DEFAULTS = {"sigma_sampling": "uniform", "cond_dropout": 0.1}
# The serving sampler of the image recipes: few Euler steps and strong guidance suit the
# 16-pixel pixel-space DiT (σ shift 1: pixel space needs no shift towards noise).
FLOW_SAMPLER_DEFAULTS = {"num_steps": 10, "shift": 1.0, "guidance_scale": 4.0}
FLOW_GRPO_SAMPLER_DEFAULTS = {**FLOW_SAMPLER_DEFAULTS, "mode": "sde"}
FLOW_GRPO_OPTIM_DEFAULTS = {"lr": 1e-4, "grad_clip": 1.0}


class FlowSFTRecipeConfig(RunConfig):
    """``diffusion-rl flow-sft``: rectified-flow SFT of the built-in DiT on rendered
    mini-GenEval images, evaluated on held-out prompts with the serving (ODE) sampler."""

    output_dir: str = "runs/flow_sft"
    steps: int = Field(default=3000, gt=0)
    eval_every: int = Field(default=500, gt=0)
    checkpoint_every: int = Field(default=500, gt=0)
    log_every: int = Field(default=10, gt=0)
    task: ImageTaskSection = ImageTaskSection()
    model: FlowModelSection = FlowModelSection()
    objective: FlowSFTConfig = FlowSFTConfig(**FLOW_SFT_OBJECTIVE_DEFAULTS)
    optim: OptimConfig = OptimConfig()  # recipe defaults: FLOW_SFT_OPTIM_DEFAULTS, over the run
    sampler: FlowSamplerConfig = FlowSamplerConfig(**FLOW_SAMPLER_DEFAULTS)
    batch_size: int = Field(default=64, gt=0)
    micro_batch_size: int | None = Field(default=None, gt=0)
    eval_samples_per_prompt: int = Field(default=4, gt=0)
    grid_images: int = Field(default=16, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _recipe_defaults(cls, data: Any) -> Any:
        """The recipe's defaults under whatever section keys were given; the LR schedule spans
        the run (``optim.total_steps`` defaults to ``steps``, warm-up to a tenth, at most 100)."""
        data = with_section_defaults(
            data,
            {
                "objective": FLOW_SFT_OBJECTIVE_DEFAULTS,
                "sampler": FLOW_SAMPLER_DEFAULTS,
                "optim": FLOW_SFT_OPTIM_DEFAULTS,
            },
        )
        if not isinstance(data, dict) or not isinstance(data.get("optim"), dict):
            return data
        optim = dict(data["optim"])
        optim.setdefault("total_steps", data.get("steps", cls.model_fields["steps"].default))
        if isinstance(optim["total_steps"], int):
            optim.setdefault("warmup_steps", min(100, optim["total_steps"] // 10))
        return {**data, "optim": optim}

    @model_validator(mode="after")
    def _fail_closed(self) -> FlowSFTRecipeConfig:
        if self.sampler.mode != "ode":
            raise ValueError(
                "sampler.mode: evaluation serves with the ODE sampler; set mode: ode (SDE "
                "rollouts belong to flow-grpo)"
            )
        return self


IMAGE_REWARDS = ("geneval", "compressibility")


class ImageRewardSection(RewardSection):
    """One image reward term: ``geneval`` (mini-GenEval attribute correctness; options
    ``mode: mean | all``, ``min_area``) or ``compressibility`` (options ``format``,
    ``quality``, ``unit``), its ``weight`` and options."""

    name: str = "geneval"

    @model_validator(mode="after")
    def _check(self) -> ImageRewardSection:
        if self.name not in IMAGE_REWARDS:
            raise ValueError(
                f"name: {self.name!r} is not an image reward; use one of {IMAGE_REWARDS}"
            )
        from .rewards import get_reward

        get_reward(self.name, **self.options)  # the reward's own options, validated by name
        return self


class FlowPolicyModelSection(ModelRef):
    path: str = "runs/flow_sft/model"


class FlowGRPORecipeConfig(RunConfig):
    """``diffusion-rl flow-grpo``: Flow-GRPO on captured SDE rollouts of a flow model.

    ``policy`` holds the objective's options: advantages per prompt group or with the batch
    std (``advantage``) clipped to ±``adv_clip``, ``timestep_fraction`` of the SDE steps
    trained, ``num_iterations`` μ against the start-of-step snapshot, ``beta`` > 0 for the KL
    to a frozen copy of the starting model (``kl: exact`` or Flow-GRPO's ``flow_grpo``). The
    sampler's ``sde_window`` restricts SDE (and training) to a window of steps.
    ``ema_decay``: keep an exponential moving average of the actor's weights (updated after
    every Flow-GRPO step, i.e. every μ optimizer steps; rollouts still use the live weights)
    and evaluate and save it.
    """

    output_dir: str = "runs/flow_grpo"
    task: ImageTaskSection | None = None  # null: the task recorded in the model directory
    model: FlowPolicyModelSection = FlowPolicyModelSection()
    policy: FlowGRPOConfig = FlowGRPOConfig()
    rewards: list[ImageRewardSection] = [ImageRewardSection()]
    sampler: FlowSamplerConfig = FlowSamplerConfig(**FLOW_GRPO_SAMPLER_DEFAULTS)
    optim: OptimConfig = OptimConfig(**FLOW_GRPO_OPTIM_DEFAULTS)
    prompts_per_step: int = Field(default=4, gt=0)
    group_size: int = Field(default=16, gt=1)
    ema_decay: float | None = Field(default=None, gt=0.0, lt=1.0)
    allow_off_policy: bool = False
    offload_device: str | None = None
    eval_samples_per_prompt: int = Field(default=4, gt=0)
    grid_images: int = Field(default=16, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _recipe_defaults(cls, data: Any) -> Any:
        return with_section_defaults(
            data, {"sampler": FLOW_GRPO_SAMPLER_DEFAULTS, "optim": FLOW_GRPO_OPTIM_DEFAULTS}
        )

    @model_validator(mode="after")
    def _fail_closed(self) -> FlowGRPORecipeConfig:
        if self.sampler.mode != "sde":
            raise ValueError(
                "sampler.mode: rollouts need SDE steps (their log-probs are what is trained); "
                "set mode: sde (evaluation always serves with the ODE sampler)"
            )
        if not self.rewards:
            raise ValueError("rewards: expected at least one reward term")
        names = [r.name for r in self.rewards]
        if len(set(names)) != len(names):
            raise ValueError(f"rewards: each reward may appear once, got {names}")
        return self
