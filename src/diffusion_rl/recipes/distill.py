"""Recipe: on-policy distillation of a student token denoiser from a teacher (docs/math.md §4).

Each step the student's rollout weights sample fresh completions with capture on (the
serving sampler, so the states are the student's own; :func:`collect_rollout`), and the
:class:`PolicyLearner` with the :class:`DistillationPlan` scores the teacher (the *reference*
role) on exactly those states, replays the student with gradient through the same walk, takes
one trainer step on :class:`DistillationLoss` and syncs the rollout weights. Student and
teacher are evaluated on held-out problems (the teacher once, before training). On the run
loop; ``curves.png`` shows the loss terms and the student's accuracy against the teacher's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..config import ConfigError, DistillRecipeConfig
from ..evaluation import evaluate_task
from ..objectives.distill import DistillationLoss
from ..plots import plot_loss_and_accuracy
from ..rewards import CombinedReward, get_reward
from ..rollout import TokenSource
from ..train.learner import PolicyLearner
from ..train.plans import DistillationPlan
from ..train.roles import PolicyRoles
from .common import (
    check_tokenizer,
    evaluate_tokens,
    load_ref,
    save_token_model,
    token_task,
    trainer_factory,
    weights_digest,
    with_lora,
)
from .run import OnPolicyRecipe, run


class DistillRecipe(OnPolicyRecipe):
    name = "distill"

    def __init__(self, config: DistillRecipeConfig) -> None:
        self.config = config
        student = load_ref(config.student, "token", "student")
        teacher = load_ref(config.teacher, "token", "teacher")
        if teacher.tokenizer.name != student.tokenizer.name:
            raise ConfigError(
                f"teacher.path: {config.teacher.path} uses tokenizer {teacher.tokenizer.name}, "
                f"the student ({config.student.path}) {student.tokenizer.name}; distillation "
                "needs one tokenizer"
            )
        self.task = task = token_task(
            config.task,
            config.sampler.block_size,
            student.info,
            config.student.path,
            student.tokenizer,
            "student.path",
        )
        check_tokenizer(student, task, "student.path")
        if config.teacher.lora is not None:
            raise ConfigError("teacher.lora: the teacher is frozen; set student.lora to train one")
        self.model = with_lora(student.model, config.student, "student", config.seed)
        self.model.to(config.device)
        self.roles = PolicyRoles(self.model, reference=teacher.model.to(config.device))
        self.teacher = self.roles.reference
        loss = DistillationLoss(config.objective)
        plan = DistillationPlan(loss, post_stop_weight=config.post_stop_weight)
        self.learner = PolicyLearner(
            self.roles, plan, trainer_factory(config), micro_batch_size=config.micro_batch_size
        )
        self.trainer = self.learner.trainer
        sampler = config.sampler.model_copy(update={"generation_length": task.completion_length})
        self.source = TokenSource(task, sampler)
        self.reward_fn = CombinedReward([(get_reward("verifier", task=task), 1.0)])
        self.eval_sampler = sampler.model_copy(update={"temperature": config.eval_temperature})
        self.metadata = {
            "objective": loss.metadata(),
            "sampler": sampler.model_dump(),
            "model": self.model.config.model_dump(),
            "tokenizer": task.tokenizer.name,
            "task": {"name": task.name, **task.config.model_dump()},
            "teacher": {"path": config.teacher.path, "weights": weights_digest(self.teacher)},
            "prompts_per_step": config.prompts_per_step,
            "samples_per_prompt": config.samples_per_prompt,
            "post_stop_weight": config.post_stop_weight,
        }
        self.group_size = config.samples_per_prompt
        self.teacher_accuracy: float | None = None

    def describe(self) -> str:
        return (
            f"distill on {self.task!r}: student {self.model.num_parameters():,} parameters, "
            f"teacher {self.teacher.num_parameters():,}"
        )

    def postfix(self, metrics) -> dict[str, str]:
        return {"kl": f"{metrics['distill/soft_loss']:.3f}"}

    def evaluate(self, tag: str):
        """The student's accuracy; the first time, also the teacher's (logged that once: it
        is fixed, and kept in the checkpoints)."""
        teacher = {}
        if self.teacher_accuracy is None:
            self.teacher_accuracy = evaluate_task(
                self.teacher,
                self.task,
                self.eval_sampler,
                num_examples=self.config.eval_examples,
                seed=self.config.seed,
            ).accuracy
            teacher["eval/teacher_accuracy"] = self.teacher_accuracy
        record, metrics, self.final = evaluate_tokens(
            self.model, self.task, self.eval_sampler, self.config, self.steps_done()
        )
        return record, {**metrics, **teacher}

    def state(self) -> dict[str, Any]:
        return {**super().state(), "teacher_accuracy": self.teacher_accuracy}

    def load_state(self, state: dict[str, Any]) -> None:
        super().load_state(state)
        self.teacher_accuracy = state["teacher_accuracy"]

    def plot(self, out, history):
        """The loss terms per step; the student's accuracy against the teacher's line."""
        terms = [t for t in ("soft", "hard") if getattr(self.config.objective, f"{t}_weight") > 0]
        return plot_loss_and_accuracy(
            out / "metrics.jsonl",
            out / "curves.png",
            history,
            [f"distill/{t}_loss" for t in terms],
            reference=("teacher", self.teacher_accuracy),
            title=f"on-policy distillation on {self.task.name}",
        )

    def save_model(self, directory) -> None:
        save_token_model(directory, self.model, self.task, self.eval_sampler, self.steps_done())

    def results(self, history) -> dict[str, Any]:
        before, after = history[0]["accuracy"], history[-1]["accuracy"]
        gap = self.teacher_accuracy - before
        cfg = self.config
        return {
            "student": {
                "path": cfg.student.path,
                "parameters": self.model.num_parameters(),
                "accuracy_before": before,
                "accuracy_after": after,
            },
            "teacher": {
                "path": cfg.teacher.path,
                "parameters": self.teacher.num_parameters(),
                "accuracy": self.teacher_accuracy,
            },
            # the fraction of the student-teacher gap closed; None when the teacher is not better
            "gap_closed": (after - before) / gap if gap > 0 else None,
            "eval": self.final.to_dict(),
            "weights_version": self.roles.version,
        }


def run_distill(config: DistillRecipeConfig, echo: Callable[[str], None] = print) -> dict[str, Any]:
    return run(config, DistillRecipe, echo)
