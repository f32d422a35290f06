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

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

# exported name → the module that defines it (imported on first use: :mod:`.loading`
# alone imports no torch, so the command line reads a config file before it imports the
# config classes)
_EXPORTS = {
    "LIMITS": ".limits",
    "check_device": ".limits",
    "flow_model_size": ".limits",
    "token_model_size": ".limits",
    "Config": ".loading",
    "ConfigError": ".loading",
    "build_config": ".loading",
    "format_validation_error": ".loading",
    "load_config": ".loading",
    "merge_dicts": ".loading",
    "parse_overrides": ".loading",
    "read_config": ".loading",
    "config_to_yaml": ".printing",
    "DISTILL_OPTIM_DEFAULTS": ".recipes",
    "DISTILL_SAMPLER_DEFAULTS": ".recipes",
    "DISTILL_WARMUP_CAP": ".recipes",
    "FLOW_GRPO_OPTIM_DEFAULTS": ".recipes",
    "FLOW_GRPO_SAMPLER_DEFAULTS": ".recipes",
    "FLOW_SAMPLER_DEFAULTS": ".recipes",
    "FLOW_SFT_OBJECTIVE_DEFAULTS": ".recipes",
    "FLOW_SFT_OPTIM_DEFAULTS": ".recipes",
    "GRPO_OPTIM_DEFAULTS": ".recipes",
    "GRPO_SAMPLER_DEFAULTS": ".recipes",
    "SFT_OPTIM_DEFAULTS": ".recipes",
    "DistillRecipeConfig": ".recipes",
    "FlowGRPORecipeConfig": ".recipes",
    "FlowSFTRecipeConfig": ".recipes",
    "GRPORecipeConfig": ".recipes",
    "SFTRecipeConfig": ".recipes",
    "StageTrainSection": ".recipes",
    "WorkflowRLRecipeConfig": ".recipes",
    "with_section_defaults": ".recipes",
    "_REWARD_NEEDS": ".sections",
    "IMAGE_REWARDS": ".sections",
    "TASK_REWARDS": ".sections",
    "VIDEO_REWARDS": ".sections",
    "FlowModelSection": ".sections",
    "FlowPolicyModelSection": ".sections",
    "ImageRewardSection": ".sections",
    "ImageTaskSection": ".sections",
    "ModelKind": ".sections",
    "ModelRef": ".sections",
    "ModelSection": ".sections",
    "MotionTaskSection": ".sections",
    "PolicyModelSection": ".sections",
    "PromptTaskSection": ".sections",
    "RewardSection": ".sections",
    "RunConfig": ".sections",
    "TaskSection": ".sections",
    "TeacherSection": ".sections",
    "VideoRewardSection": ".sections",
    "check_rewards_for_task": ".sections",
    "prompt_task_reward_problems": ".sections",
}

if TYPE_CHECKING:  # for type checkers; at run time the names load on first use
    from .limits import LIMITS, check_device, flow_model_size, token_model_size
    from .loading import (
        Config,
        ConfigError,
        build_config,
        format_validation_error,
        load_config,
        merge_dicts,
        parse_overrides,
        read_config,
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
    "read_config",
    "token_model_size",
    "with_section_defaults",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
