"""Typed, validated recipe configs loaded from YAML.

Every section rejects unknown keys by name and suggests the closest valid one; every option
has a default that runs on a laptop CPU. ``load_config(path, cls, overrides)`` reads YAML,
applies ``key.sub=value`` overrides and validates; any problem raises :class:`ConfigError`
(one line per problem, each naming its key or ``file:line:col``: see :mod:`.loading`).

The package, bottom first; each module imports only modules listed before it:

* :mod:`.loading`: :class:`ConfigError`, YAML reading, ``--set`` overrides, merging,
  validation-error messages, :func:`build_config` and :func:`load_config`;
* :mod:`.limits`: the :data:`LIMITS` table and the budgets derived from it,
  :func:`check_device`, the model-size estimators;
* :mod:`.sections`: the sections recipe configs share (run, models, tasks, rewards) and
  :func:`check_rewards_for_task`;
* :mod:`.recipes`: the recipe configs, their defaults and the LR schedule over the run;
* :mod:`.printing`: :func:`config_to_yaml`, the effective config with every key.

Each invariant of a validated config is stated in the module that enforces it: strict values
and rewards that apply to the task (:mod:`.sections`), bounds (:mod:`.limits`), the LR
schedule (:mod:`.recipes`).
"""

from __future__ import annotations

from .limits import LIMITS, check_device, flow_model_size, token_model_size
from .loading import (
    Config,
    ConfigError,
    build_config,
    format_validation_error,
    load_config,
    merge_dicts,
    parse_overrides,
)
from .printing import config_to_yaml
from .recipes import (
    DISTILL_OPTIM_DEFAULTS,
    DISTILL_SAMPLER_DEFAULTS,
    DISTILL_WARMUP_CAP,
    FLOW_GRPO_OPTIM_DEFAULTS,
    FLOW_GRPO_SAMPLER_DEFAULTS,
    FLOW_SAMPLER_DEFAULTS,
    FLOW_SFT_OBJECTIVE_DEFAULTS,
    FLOW_SFT_OPTIM_DEFAULTS,
    GRPO_OPTIM_DEFAULTS,
    GRPO_SAMPLER_DEFAULTS,
    SFT_OPTIM_DEFAULTS,
    DistillRecipeConfig,
    FlowGRPORecipeConfig,
    FlowSFTRecipeConfig,
    GRPORecipeConfig,
    SFTRecipeConfig,
    StageTrainSection,
    WorkflowRLRecipeConfig,
    with_section_defaults,
)
from .sections import _REWARD_NEEDS as _REWARD_NEEDS  # the tests list the rewards it explains
from .sections import (
    IMAGE_REWARDS,
    TASK_REWARDS,
    VIDEO_REWARDS,
    FlowModelSection,
    FlowPolicyModelSection,
    ImageRewardSection,
    ImageTaskSection,
    ModelKind,
    ModelRef,
    ModelSection,
    MotionTaskSection,
    PolicyModelSection,
    PromptTaskSection,
    RewardSection,
    RunConfig,
    TaskSection,
    TeacherSection,
    VideoRewardSection,
    check_rewards_for_task,
    prompt_task_reward_problems,
)

__all__ = [
    "DISTILL_OPTIM_DEFAULTS",
    "DISTILL_SAMPLER_DEFAULTS",
    "DISTILL_WARMUP_CAP",
    "FLOW_GRPO_OPTIM_DEFAULTS",
    "FLOW_GRPO_SAMPLER_DEFAULTS",
    "FLOW_SAMPLER_DEFAULTS",
    "FLOW_SFT_OBJECTIVE_DEFAULTS",
    "FLOW_SFT_OPTIM_DEFAULTS",
    "GRPO_OPTIM_DEFAULTS",
    "GRPO_SAMPLER_DEFAULTS",
    "IMAGE_REWARDS",
    "LIMITS",
    "SFT_OPTIM_DEFAULTS",
    "TASK_REWARDS",
    "VIDEO_REWARDS",
    "Config",
    "ConfigError",
    "DistillRecipeConfig",
    "FlowGRPORecipeConfig",
    "FlowModelSection",
    "FlowPolicyModelSection",
    "FlowSFTRecipeConfig",
    "GRPORecipeConfig",
    "ImageRewardSection",
    "ImageTaskSection",
    "ModelKind",
    "ModelRef",
    "ModelSection",
    "MotionTaskSection",
    "PolicyModelSection",
    "PromptTaskSection",
    "RewardSection",
    "RunConfig",
    "SFTRecipeConfig",
    "StageTrainSection",
    "TaskSection",
    "TeacherSection",
    "VideoRewardSection",
    "WorkflowRLRecipeConfig",
    "build_config",
    "check_device",
    "check_rewards_for_task",
    "config_to_yaml",
    "flow_model_size",
    "format_validation_error",
    "load_config",
    "merge_dicts",
    "parse_overrides",
    "prompt_task_reward_problems",
    "token_model_size",
    "with_section_defaults",
]
