"""Recipe: GRPO / DAPO / Dr.GRPO of a token denoiser on a built-in task.

Composes: rollout weights + serving sampler with capture (:func:`collect_rollout` with a
:class:`TokenSource`, in process or, with ``rollout.engine: server``, on a serving engine
that gets the rollout weights pushed each step) → rewards → group advantages →
:class:`PolicyLearner` with the :class:`TokenPolicyPlan` (exact replay of live, reference and
old policy on the same states, μ inner iterations, versioned weight sync) →
:func:`evaluate_task`, on the run loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..advantages import OverlongShaping
from ..config import ConfigError, GRPORecipeConfig, check_rewards_for_task
from ..objectives.grpo import PolicyLoss
from ..rewards import CombinedReward, get_reward
from ..rollout import TokenSource
from ..train.learner import PolicyLearner
from ..train.plans import TokenPolicyPlan
from ..train.roles import PolicyRoles
from .common import (
    check_tokenizer,
    evaluate_tokens,
    load_ref,
    rollout_source,
    save_token_model,
    token_task,
    trainer_factory,
    weights_digest,
    with_lora,
)
from .run import OnPolicyRecipe, run


class GRPORecipe(OnPolicyRecipe):
    curves = ("rollout/reward_mean", "eval/accuracy", "policy/kl", "policy/entropy")

    def __init__(self, config: GRPORecipeConfig) -> None:
        self.config = config
        policy = config.policy
        loaded = load_ref(config.model, "token", "model")
        self.task = task = token_task(
            config.task, config.sampler.block_size, loaded.info, config.model.path, loaded.tokenizer
        )
        check_tokenizer(loaded, task, "model.path")
        check_rewards_for_task(config.rewards, task.name)  # task: null reads it from the model
        if policy.dynamic_sampling and task.prompt_length is None:
            raise ConfigError(
                "task.max_prompt_tokens: dynamic sampling joins rollout rounds, which needs one "
                "prompt width; set task.max_prompt_tokens (prompts are otherwise padded to the "
                "longest of each round with this tokenizer)"
            )
        self.name, self.title = policy.algorithm, f"{policy.algorithm} on {task.name}"
        self.model = model = with_lora(loaded.model, config.model, "model", config.seed)
        model.to(config.device)
        self.roles = PolicyRoles(
            model, reference=policy.uses_reference, offload_device=config.offload_device
        )
        plan = TokenPolicyPlan(
            PolicyLoss(policy), scorer=config.scorer, post_stop_weight=config.post_stop_weight
        )
        self.learner = PolicyLearner(
            self.roles,
            plan,
            trainer_factory(config),
            micro_batch_size=config.micro_batch_size,
            allow_off_policy=config.allow_off_policy,
            seed=config.seed,
        )
        self.trainer = self.learner.trainer
        self.reward_fn = CombinedReward(
            [
                (get_reward(r.name, **r.options, **self._task_option(r.name)), r.weight)
                for r in config.rewards
            ]
        )
        sampler = config.sampler.model_copy(update={"generation_length": task.completion_length})
        self.source = rollout_source(TokenSource(task, sampler), config.rollout, self.roles)
        self.shaping = None
        if policy.overlong_buffer_tokens:
            self.shaping = OverlongShaping(
                policy.overlong_max_tokens or sampler.generation_length,
                policy.overlong_buffer_tokens,
                policy.overlong_penalty,
            )
        self.eval_sampler = sampler.model_copy(update={"temperature": config.eval_temperature})
        self.metadata = {
            "objective": plan.objective.metadata(),
            "estimator": config.scorer,
            "sampler": sampler.model_dump(),
            "model": model.config.model_dump(),
            "tokenizer": task.tokenizer.name,
            "task": {"name": task.name, **task.config.model_dump()},
            "reference": {"path": config.model.path, "weights": weights_digest(model)},
            "rewards": [r.model_dump() for r in config.rewards],
            "group_size": config.group_size,
            "prompts_per_step": config.prompts_per_step,
            "post_stop_weight": config.post_stop_weight,
        }
        self.group_size = config.group_size

    def _task_option(self, reward: str) -> dict:
        return {"task": self.task} if reward in ("verifier", "digits") else {}

    def describe(self) -> str:
        return (
            f"{self.name} on {self.task!r}: {self.model.num_parameters():,} parameters, "
            f"scorer {self.config.scorer}"
        )

    def rollout_options(self) -> dict[str, Any]:
        policy = self.config.policy
        return {
            "advantage": policy.advantage_spec,
            "shaping": self.shaping,
            "dynamic_sampling": policy.dynamic_sampling,
            "max_sampling_rounds": self.config.max_sampling_rounds,
        }

    def evaluate(self, tag: str):
        record, metrics, self.final = evaluate_tokens(
            self.model, self.task, self.eval_sampler, self.config, self.steps_done()
        )
        return record, metrics

    def save_model(self, directory) -> None:
        save_token_model(directory, self.model, self.task, self.eval_sampler, self.steps_done())

    def results(self, history) -> dict[str, Any]:
        return {
            "scorer": self.config.scorer,
            "accuracy_before": history[0]["accuracy"],
            "accuracy_after": history[-1]["accuracy"],
            "eval": self.final.to_dict(),
            "weights_version": self.roles.version,
        }


def run_grpo(config: GRPORecipeConfig, echo: Callable[[str], None] = print) -> dict[str, Any]:
    return run(config, GRPORecipe, echo)
