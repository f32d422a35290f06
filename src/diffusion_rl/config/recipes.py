"""The recipe configs (``sft``, ``grpo``, ``distill``, ``flow-sft``, ``flow-grpo``,
``workflow-rl``), their section defaults, and the LR schedule over the run.

The LR schedule follows ``steps`` unless set: ``optim.total_steps`` (null or left out)
defaults to ``steps`` in the SFT recipes, and in the RL and distillation recipes whenever
the schedule decays; ``optim.warmup_steps`` defaults to a tenth of the run, at most 100
(SFT, flow-SFT) or 20 (distillation), and to 0 for GRPO and Flow-GRPO.

Each config also checks its sections together: the task against the sampler's block size,
a new model's size and a step's rollout rows against :mod:`.limits`, and (GRPO) the rewards
against the task.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..objectives.distill import DistillationLossConfig
from ..objectives.flow_grpo import FlowGRPOConfig
from ..objectives.flow_sft import FlowSFTConfig
from ..objectives.forward_flow import (
    FORWARD_ALGORITHMS,
    AWMConfig,
    DGPOConfig,
    ForwardFlowConfig,
    NFTConfig,
)
from ..objectives.grpo import PolicyLossConfig
from ..objectives.sft import MaskedDiffusionSFTConfig
from ..sampling.flow import FlowSamplerConfig
from ..sampling.token import TokenSamplerConfig
from ..train.trainer import OptimConfig
from .limits import (
    LIMITS,
    _model_budget,
    _rows_budget,
    check_device,
    flow_model_size,
    token_model_size,
)
from .loading import _problem, _raise_problems
from .sections import (
    FlowModelSection,
    FlowPolicyModelSection,
    ImageRewardSection,
    ImageTaskSection,
    ModelSection,
    MotionTaskSection,
    PolicyModelSection,
    PromptTaskSection,
    RewardSection,
    RolloutSection,
    RunConfig,
    TaskSection,
    TeacherSection,
    VideoRewardSection,
    _reward_problems,
    _token_task_problems,
    prompt_task_reward_problems,
)

# ---------------------------------------------------------------------------------------------
# Recipe defaults and the LR schedule over the run
# ---------------------------------------------------------------------------------------------


def with_section_defaults(data: Any, defaults: dict[str, dict[str, Any]]) -> Any:
    """``data`` with each section's recipe defaults under the keys the user gave (a partial
    section keeps the recipe's other defaults, not the section class's). A section given as
    anything but a mapping or null is left for validation to refuse."""
    if not isinstance(data, dict):
        return data
    merged = dict(data)
    for name, values in defaults.items():
        given = merged.get(name)
        if given is None or isinstance(given, dict):
            merged[name] = {**values, **(given or {})}
    return merged


def _schedule_defaults(
    cls: type[RunConfig],
    data: Any,
    sections: dict[str, dict[str, Any]],
    *,
    always: bool,
    warmup_cap: int,
) -> Any:
    """``data`` with the recipe's section defaults under the keys the user gave, and the LR
    schedule over the run: ``optim.total_steps`` (absent or null) = ``steps`` (``always``, or
    when the schedule decays), ``optim.warmup_steps`` (absent or null) = a tenth of the run,
    at most ``warmup_cap``. Anything malformed is left for validation to report."""
    data = with_section_defaults(data, sections)
    if not isinstance(data, dict) or not isinstance(data.get("optim"), dict):
        return data
    optim = dict(data["optim"])
    steps = data.get("steps")
    if type(steps) is not int or not 0 < steps <= LIMITS["steps"]:
        steps = cls.model_fields["steps"].default  # absent, or bad: reported once, as steps
    schedule = optim.get("schedule", OptimConfig.model_fields["schedule"].default)
    if optim.get("total_steps") is None and (always or schedule != "constant"):
        optim["total_steps"] = steps
    if optim.get("warmup_steps") is None:
        span = optim.get("total_steps")
        if type(span) is not int or span < 1:
            span = steps  # a bad total_steps is reported once, as itself
        optim["warmup_steps"] = min(warmup_cap, span // 10)
    return {**data, "optim": optim}


def _offload_device(value: str | None) -> str | None:
    return None if value is None else check_device(value)


# ---------------------------------------------------------------------------------------------
# Token recipes: sft, grpo and distill on a built-in text task
# ---------------------------------------------------------------------------------------------


SFT_OPTIM_DEFAULTS = {"lr": 2e-3, "schedule": "cosine", "min_lr_ratio": 0.1}


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
    optim: OptimConfig = OptimConfig()  # recipe defaults: SFT_OPTIM_DEFAULTS, over the run
    sampler: TokenSamplerConfig = TokenSamplerConfig()
    batch_size: int = Field(default=64, gt=0)
    micro_batch_size: int | None = Field(default=None, gt=0)
    activation_checkpointing: bool = False
    eval_examples: int = Field(default=256, gt=0)
    # stop at the first evaluation (every eval_every steps) whose held-out accuracy reaches
    # this, so that RL after SFT starts with headroom (null: train all steps)
    stop_at_accuracy: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _recipe_defaults(cls, data: Any) -> Any:
        """The recipe's optimiser defaults under whatever optim keys the user gave; the LR
        schedule spans the run (``optim.total_steps`` defaults to ``steps``, warm-up to a tenth
        of it, at most 100 steps)."""
        sections = {"optim": SFT_OPTIM_DEFAULTS}
        return _schedule_defaults(cls, data, sections, always=True, warmup_cap=100)

    @model_validator(mode="after")
    def _check_sizes(self) -> SFTRecipeConfig:
        problems = _token_task_problems(self.task, self.sampler.block_size)
        if not problems and self.model.path is None:
            task = self.task.build(self.sampler.block_size)
            rows = min(self.micro_batch_size or self.batch_size, self.batch_size)
            positions = task.prompt_length + task.completion_length
            size = token_model_size(self.model, task.tokenizer.vocab_size, positions, rows)
            problems += _model_budget(*size)
        _raise_problems(type(self).__name__, problems)
        return self


# Rollouts sample at T = 1 (the policy itself); evaluation is greedy (``eval_temperature``).
GRPO_SAMPLER_DEFAULTS = {"temperature": 1.0}
GRPO_OPTIM_DEFAULTS = {"lr": 1e-4, "grad_clip": 1.0}
# The trust region of one step (docs/math.md §3.4): at most 0.003 nats per action of
# KL(π_before ‖ π_after) on the rollout's own actions. Measured from the text quickstart's SFT
# start and from 2-digit addition (benchmarks/grpo_lr_sweep.py): steps that raised the reward
# moved it 0.001-0.005; at lr 5e-4 unbounded steps moved it 0.01-0.12 and the reward
# collapsed, where bounded at 0.003 it rose as at 1e-4.
GRPO_POLICY_DEFAULTS = {"max_step_kl": 0.003}
# The student explores at T = 0.5; the teacher scores exactly the student's states. A fresh
# optimizer's first steps are the largest: warm up over a tenth of the run, at most 20 steps.
DISTILL_SAMPLER_DEFAULTS = {"temperature": 0.5}
DISTILL_OPTIM_DEFAULTS = {"lr": 1e-3, "grad_clip": 1.0}
DISTILL_WARMUP_CAP = 20


class GRPORecipeConfig(RunConfig):
    """``diffusion-rl grpo``: GRPO / DAPO / Dr.GRPO on captured token traces."""

    output_dir: str = "runs/grpo"
    task: TaskSection | None = None  # null: the task recorded in the model directory
    model: PolicyModelSection = PolicyModelSection()
    policy: PolicyLossConfig = PolicyLossConfig(**GRPO_POLICY_DEFAULTS)
    scorer: Literal["exact", "packed", "mean_field", "coupled", "elbo", "spg"] = "exact"
    rewards: list[RewardSection] = [RewardSection()]
    sampler: TokenSamplerConfig = TokenSamplerConfig(**GRPO_SAMPLER_DEFAULTS)
    eval_temperature: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    optim: OptimConfig = OptimConfig(**GRPO_OPTIM_DEFAULTS)
    prompts_per_step: int = Field(default=16, gt=0)
    group_size: int = Field(default=8, gt=1)
    micro_batch_size: int | None = Field(default=None, gt=0)
    post_stop_weight: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)
    max_sampling_rounds: int = Field(default=4, gt=0)
    rollout: RolloutSection = RolloutSection()
    allow_off_policy: bool = False
    sequence_packing: bool = False
    offload_device: str | None = None
    activation_checkpointing: bool = False
    eval_examples: int = Field(default=256, gt=0)

    _check_offload = field_validator("offload_device")(_offload_device)

    @model_validator(mode="before")
    @classmethod
    def _recipe_defaults(cls, data: Any) -> Any:
        sections = {
            "sampler": GRPO_SAMPLER_DEFAULTS,
            "optim": GRPO_OPTIM_DEFAULTS,
            "policy": GRPO_POLICY_DEFAULTS,
        }
        return _schedule_defaults(cls, data, sections, always=False, warmup_cap=0)

    @model_validator(mode="after")
    def _fail_closed(self) -> GRPORecipeConfig:
        if self.sequence_packing:
            raise ValueError(
                "sequence_packing: not supported for diffusion traces (each row's canvas is "
                "replayed exactly; packing rows would mix their attention); set it to false"
            )
        if not self.rewards:
            raise ValueError("rewards: expected at least one reward term")
        task = None if self.task is None else self.task.name
        problems = [_problem(loc, m) for loc, m in _reward_problems(self.rewards, task)]
        if self.task is not None:
            problems += _token_task_problems(self.task, self.sampler.block_size)
        problems += _rows_budget(self.prompts_per_step * self.group_size, "prompts x group_size")
        _raise_problems(type(self).__name__, problems)
        return self


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
    eval_temperature: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    optim: OptimConfig = OptimConfig(**DISTILL_OPTIM_DEFAULTS, warmup_steps=DISTILL_WARMUP_CAP)
    prompts_per_step: int = Field(default=32, gt=0)
    samples_per_prompt: int = Field(default=1, gt=0)
    micro_batch_size: int | None = Field(default=None, gt=0)
    post_stop_weight: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)
    activation_checkpointing: bool = False
    eval_examples: int = Field(default=256, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _recipe_defaults(cls, data: Any) -> Any:
        sections = {"sampler": DISTILL_SAMPLER_DEFAULTS, "optim": DISTILL_OPTIM_DEFAULTS}
        return _schedule_defaults(cls, data, sections, always=False, warmup_cap=DISTILL_WARMUP_CAP)

    @model_validator(mode="after")
    def _check(self) -> DistillRecipeConfig:
        problems = []
        if self.task is not None:
            problems += _token_task_problems(self.task, self.sampler.block_size)
        rows = self.prompts_per_step * self.samples_per_prompt
        problems += _rows_budget(rows, "prompts x samples_per_prompt")
        _raise_problems(type(self).__name__, problems)
        return self


# ---------------------------------------------------------------------------------------------
# Flow-matching image recipes: flow-sft and flow-grpo on mini-GenEval
# ---------------------------------------------------------------------------------------------


# Constant after warm-up: at 3000 steps the cosine decay left the DiT at 16 % held-out accuracy
# (shapes still at chance), the constant rate at 55 % (same seed and data).
FLOW_SFT_OPTIM_DEFAULTS = {"lr": 1e-3, "schedule": "constant", "grad_clip": 1.0}
# Uniform σ and 10 % unconditional rows (the branch classifier-free guidance needs).
FLOW_SFT_OBJECTIVE_DEFAULTS = {"sigma_sampling": "uniform", "cond_dropout": 0.1}
# The serving sampler of the image recipes: few Euler steps and strong guidance suit the
# 16-pixel pixel-space DiT (σ shift 1: pixel space needs no shift towards noise).
FLOW_SAMPLER_DEFAULTS = {"num_steps": 10, "shift": 1.0, "guidance_scale": 4.0}
# The flow recipes' held-out samples take their seeds from here, whatever the run's seed:
# every run's start reads the same, so runs of several seeds compare on the same noise.
EvalSeed = Annotated[int, Field(ge=0)]
FLOW_GRPO_SAMPLER_DEFAULTS = {**FLOW_SAMPLER_DEFAULTS, "mode": "sde"}

# ``policy.algorithm`` picks the flow RL method: Flow-GRPO (PPO on SDE-step log-probs) or a
# forward-process one (DiffusionNFT, AWM, DGPO: trained on forward-noised clean samples).
FlowPolicyConfig = Annotated[
    FlowGRPOConfig | NFTConfig | AWMConfig | DGPOConfig, Field(discriminator="algorithm")
]


def flow_policy_defaults(policy: Any) -> Any:
    """A ``policy`` section without ``algorithm`` is Flow-GRPO's (configs written before the
    forward-process methods)."""
    if policy is None:
        return {"algorithm": "flow_grpo"}
    if isinstance(policy, dict) and "algorithm" not in policy:
        return {"algorithm": "flow_grpo", **policy}
    return policy


FLOW_GRPO_OPTIM_DEFAULTS = {"lr": 1e-4, "grad_clip": 1.0}


class FlowSFTRecipeConfig(RunConfig):
    """``diffusion-rl flow-sft``: rectified-flow SFT of the built-in DiT on rendered
    mini-GenEval images (``task.name: geneval``), or of the built-in image-to-video VideoDiT
    on rendered mini-motion clips (``task.name: mini-motion``: each clip's first frame
    conditions it), evaluated on held-out prompts with the serving (ODE) sampler."""

    output_dir: str = "runs/flow_sft"
    steps: int = Field(default=3000, gt=0)
    eval_every: int = Field(default=500, gt=0)
    checkpoint_every: int = Field(default=500, gt=0)
    log_every: int = Field(default=10, gt=0)
    task: ImageTaskSection | MotionTaskSection = Field(
        default=ImageTaskSection(), discriminator="name"
    )
    model: FlowModelSection = FlowModelSection()
    objective: FlowSFTConfig = FlowSFTConfig(**FLOW_SFT_OBJECTIVE_DEFAULTS)
    optim: OptimConfig = OptimConfig()  # recipe defaults: FLOW_SFT_OPTIM_DEFAULTS, over the run
    sampler: FlowSamplerConfig = FlowSamplerConfig(**FLOW_SAMPLER_DEFAULTS)
    batch_size: int = Field(default=64, gt=0)
    micro_batch_size: int | None = Field(default=None, gt=0)
    activation_checkpointing: bool = False  # pipeline models (docs/flow_models.md)
    eval_samples_per_prompt: int = Field(default=4, gt=0)
    eval_seed: EvalSeed = 0
    grid_images: int = Field(default=16, ge=0)
    # stop at the first evaluation (every eval_every steps) whose held-out accuracy reaches
    # this, so that RL after SFT starts with headroom (null: train all steps)
    stop_at_accuracy: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _recipe_defaults(cls, data: Any) -> Any:
        """The recipe's defaults under whatever section keys were given; the LR schedule spans
        the run (``optim.total_steps`` defaults to ``steps``, warm-up to a tenth, at most 100)."""
        sections = {
            "objective": FLOW_SFT_OBJECTIVE_DEFAULTS,
            "sampler": FLOW_SAMPLER_DEFAULTS,
            "optim": FLOW_SFT_OPTIM_DEFAULTS,
        }
        if isinstance(data, dict) and isinstance(data.get("task"), dict):
            data = {**data, "task": {"name": "geneval", **data["task"]}}  # name defaults
        return _schedule_defaults(cls, data, sections, always=True, warmup_cap=100)

    @model_validator(mode="after")
    def _fail_closed(self) -> FlowSFTRecipeConfig:
        if self.sampler.mode != "ode":
            raise ValueError(
                "sampler.mode: evaluation serves with the ODE sampler; set mode: ode (SDE "
                "rollouts belong to flow-grpo)"
            )
        problems = []
        if self.model.path is None:
            size = self.task.image_size
            if size % self.model.patch_size:
                problems.append(
                    _problem(
                        ("model", "patch_size"),
                        f"must divide task.image_size={size}, got {self.model.patch_size}",
                    )
                )
            else:
                rows = min(self.micro_batch_size or self.batch_size, self.batch_size)
                rows *= getattr(self.task, "num_frames", 1)  # a clip: F frames of patches
                vocab = len(self.task.build().vocabulary)
                problems += _model_budget(*flow_model_size(self.model, size, vocab, rows))
        _raise_problems(type(self).__name__, problems)
        return self


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

    ``task``: mini-GenEval (``name: geneval``, the default name), a prompt list from a local
    file (``name: prompts``, ``path: FILE``: no verifier, so every reward must need none, and
    the image size is the model's; docs/flow_models.md), or null: the task the model
    directory records.
    """

    output_dir: str = "runs/flow_grpo"
    # null: the task recorded in the model directory
    task: ImageTaskSection | PromptTaskSection | None = Field(default=None, discriminator="name")
    model: FlowPolicyModelSection = FlowPolicyModelSection()
    policy: FlowPolicyConfig = FlowGRPOConfig()
    rewards: list[ImageRewardSection] = [ImageRewardSection()]
    sampler: FlowSamplerConfig = FlowSamplerConfig(**FLOW_GRPO_SAMPLER_DEFAULTS)
    optim: OptimConfig = OptimConfig(**FLOW_GRPO_OPTIM_DEFAULTS)
    prompts_per_step: int = Field(default=4, gt=0)
    group_size: int = Field(default=16, gt=1)
    ema_decay: float | None = Field(default=None, gt=0.0, lt=1.0, allow_inf_nan=False)
    rollout: RolloutSection = RolloutSection()
    allow_off_policy: bool = False
    offload_device: str | None = None
    activation_checkpointing: bool = False  # pipeline models (docs/flow_models.md)
    eval_samples_per_prompt: int = Field(default=4, gt=0)
    eval_seed: EvalSeed = 0
    grid_images: int = Field(default=16, ge=0)

    _check_offload = field_validator("offload_device")(_offload_device)

    @model_validator(mode="before")
    @classmethod
    def _recipe_defaults(cls, data: Any) -> Any:
        sampler = FLOW_GRPO_SAMPLER_DEFAULTS
        if isinstance(data, dict):
            policy = flow_policy_defaults(data.get("policy"))
            data = {**data, "policy": policy}
            algorithm = policy.get("algorithm") if isinstance(policy, dict) else None
            if algorithm in FORWARD_ALGORITHMS or isinstance(policy, ForwardFlowConfig):
                # the serving ODE sampler is the rollout; they train the unguided velocity
                sampler = {**sampler, "mode": "ode", "guidance_scale": 1.0}
        sections = {"sampler": sampler, "optim": FLOW_GRPO_OPTIM_DEFAULTS}
        if isinstance(data, dict) and isinstance(data.get("task"), dict):
            data = {**data, "task": {"name": "geneval", **data["task"]}}  # name defaults
        return _schedule_defaults(cls, data, sections, always=False, warmup_cap=0)

    @model_validator(mode="after")
    def _fail_closed(self) -> FlowGRPORecipeConfig:
        if self.sampler.mode != "sde" and self.policy.algorithm == "flow_grpo":
            raise ValueError(
                "sampler.mode: Flow-GRPO rollouts need SDE steps (their log-probs are what is "
                "trained); set mode: sde, or a forward-process policy.algorithm (nft, awm, "
                "dgpo), which trains on the samples of any sampler"
            )
        if self.sampler.mode == "ode" and self.sampler.share_group_noise:
            raise ValueError(
                "sampler.share_group_noise: ODE rollouts of a group from one start noise are "
                "one image repeated (every advantage 0); set share_group_noise: false"
            )
        if not self.rewards:
            raise ValueError("rewards: expected at least one reward term")
        names = [r.name for r in self.rewards]
        if len(set(names)) != len(names):
            raise ValueError(f"rewards: each reward may appear once, got {names}")
        rows = self.prompts_per_step * self.group_size
        problems = _rows_budget(rows, "prompts x group_size")
        if isinstance(self.task, PromptTaskSection):
            problems += [_problem(k, m) for k, m in prompt_task_reward_problems(self.rewards)]
            if self.task.heldout_fraction == 0:
                problems.append(
                    _problem(
                        ("task", "heldout_fraction"),
                        "flow-grpo evaluates on held-out prompts of the file; set a "
                        "heldout_fraction > 0 (e.g. 0.1)",
                    )
                )
        _raise_problems(type(self).__name__, problems)
        return self


# ---------------------------------------------------------------------------------------------
# Workflow RL: every stage of a multi-stage workflow trained from one final reward
# ---------------------------------------------------------------------------------------------

WORKFLOW_OPTIM_DEFAULTS = {"lr": 1e-4, "grad_clip": 1.0}


class StageTrainSection(BaseModel):
    """How one workflow stage is trained: ``train: false`` freezes it (no optimizer, its
    weights version stays 0); its own ``optim`` (lr, schedule, clip); ``sampler``: overrides
    of the workflow file's sampler settings for this stage's *rollouts* (Flow-GRPO's are
    SDE; the forward-process methods roll out with the file's serving sampler as it is; e.g.
    ``sde_window``, ``noise_level``, ``kernels``, ``guidance_scale``). ``policy``: this
    stage's objective in place of the run's ``policy`` (e.g. a forward-process method on one
    stage only; every stage takes the same ``num_iterations``).
    ``ema_decay``: keep an exponential moving average of the stage's weights (updated after
    every step; rollouts still use the live weights), which evaluation serves and the model
    directory saves."""

    model_config = ConfigDict(extra="forbid", strict=True)

    train: bool = True
    optim: OptimConfig = OptimConfig(**WORKFLOW_OPTIM_DEFAULTS)
    sampler: dict[str, Any] = {}
    ema_decay: float | None = Field(default=None, gt=0.0, lt=1.0, allow_inf_nan=False)
    policy: FlowPolicyConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _optim_defaults(cls, data: Any) -> Any:
        data = with_section_defaults(data, {"optim": WORKFLOW_OPTIM_DEFAULTS})
        if isinstance(data, dict) and data.get("policy") is not None:
            data = {**data, "policy": flow_policy_defaults(data["policy"])}
        return data

    @field_validator("sampler")
    @classmethod
    def _sampler_keys(cls, value: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(value) - set(FlowSamplerConfig.model_fields))
        if unknown:
            raise ValueError(
                f"unknown sampler setting {unknown[0]!r}; settings: "
                f"{', '.join(FlowSamplerConfig.model_fields)}"
            )
        return value


class WorkflowRLRecipeConfig(RunConfig):
    """``diffusion-rl workflow-rl``: Flow-GRPO on every stage of a workflow from one final
    reward, with tree rollouts (or a forward-process method: ``policy.algorithm``).

    ``workflow``: a workflow file or a built-in name (its stages' model directories and
    serving samplers, and the task its prompts come from). Per step, ``prompts_per_step``
    train prompts each get ``group_size`` first-stage samples and every later stage
    ``fanout`` samples per input row (default: the workflow file's ``fanout``; the video
    stage's advantage is computed among the K videos of one image, the image stage's from the
    mean final reward of its videos; K = 1 shares one advantage). ``stages.NAME`` trains,
    freezes and tunes each stage; ``policy`` is the objective of every trained stage
    (Flow-GRPO, or a forward-process method: docs/math.md §5.8) unless a stage sets its own. Evaluation serves the workflow with its own samplers at fixed seeds.
    """

    output_dir: str = "runs/workflow_rl"
    steps: int = Field(default=60, gt=0)
    eval_every: int = Field(default=20, gt=0)
    checkpoint_every: int = Field(default=20, gt=0)
    workflow: str = "text-to-image-to-video"
    stages: dict[str, StageTrainSection] = {}
    fanout: dict[str, int] = {}
    policy: FlowPolicyConfig = FlowGRPOConfig()
    rewards: list[VideoRewardSection] = [VideoRewardSection()]
    prompts_per_step: int = Field(default=2, gt=0)
    group_size: int = Field(default=4, gt=1)
    allow_off_policy: bool = False
    eval_samples_per_prompt: int = Field(default=2, gt=0)
    eval_seed: EvalSeed = 0
    preview_clips: int = Field(default=8, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _policy_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = {**data, "policy": flow_policy_defaults(data.get("policy"))}
        return data

    def stage_policy(self, name: str):
        """The objective of stage ``name``: its own ``stages.NAME.policy``, else ``policy``."""
        stage = self.stages.get(name)
        return stage.policy if stage is not None and stage.policy is not None else self.policy

    @model_validator(mode="after")
    def _fail_closed(self) -> WorkflowRLRecipeConfig:
        if not self.rewards:
            raise ValueError("rewards: expected at least one reward term")
        names = [r.name for r in self.rewards]
        if len(set(names)) != len(names):
            raise ValueError(f"rewards: each reward may appear once, got {names}")
        for name, count in self.fanout.items():
            if type(count) is not int or not 1 <= count <= 64:
                raise ValueError(f"fanout.{name}: expected an int in [1, 64], got {count!r}")
        rows = self.prompts_per_step * self.group_size * max([1, *self.fanout.values()])
        _raise_problems(type(self).__name__, _rows_budget(rows, "prompts x group_size x fanout"))
        return self
