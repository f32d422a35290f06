"""Recipe: on-policy distillation of a student token denoiser from a teacher (MATH.md §4).

Each step:

1. the student's *rollout weights* (version v, stamped into the trace) sample fresh
   completions with capture on — the serving sampler, so the states are the student's own;
2. :class:`DistillationLearner` refuses the trace unless v is the student's current version,
   scores the teacher on exactly the student's states (:class:`TeacherScorer`, the replay
   walk with the teacher as the model, stop-gradient), replays the student with gradient
   through the same walk, and takes one :class:`Trainer` step on :class:`DistillationLoss`;
3. the rollout weights are synced (version v + 1).

Student and teacher are evaluated on the task's held-out problems with the serving sampler
(the teacher once, at the start). Writes to ``output_dir``: ``metrics.jsonl`` (+ TensorBoard),
``checkpoints/`` (exact resume: model, optimizer, RNGs, prompt position, weights version,
history), ``model/``, ``report.json`` and ``report.png`` (student accuracy against the teacher
line, and the distillation loss).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError, DistillRecipeConfig
from ..contracts import DiffusionDistillationBatch, DiffusionTokenBatch
from ..evaluation import evaluate_task
from ..models.io import load_model_dir, save_model_dir
from ..objectives.distill import DistillationLoss
from ..plots import plt, read_metrics
from ..rollout import rollout_seed
from ..sampling.token import TokenSamplerConfig, sample_tokens
from ..scoring.replay import ReplayScorer
from ..scoring.teacher import TeacherScorer, check_same_vocabulary
from ..tasks import get_task
from ..trace import TokenTrace
from ..train import CheckpointManager, MetricsLogger, Trainer, progress
from ..train.roles import PolicyRoles, frozen_copy
from .common import resume_latest, trainer_factory, weights_digest
from .sft import build_task as build_configured_task


@dataclass(frozen=True)
class StudentRollout:
    """``trace`` of B = prompts × samples rows and the train ``examples`` they answer."""

    trace: TokenTrace
    examples: list[Any]
    texts: list[str]
    correct: torch.Tensor  # float32 [B], the task verifier on each completion


def sample_student(
    model,
    task,
    *,
    start_prompt: int,
    num_prompts: int,
    samples_per_prompt: int,
    sampler: TokenSamplerConfig,
    weights_version: int,
    seed: int,
) -> StudentRollout:
    """Captured samples of train prompts ``start_prompt .. + num_prompts`` (seeds per sample
    from :func:`~diffusion_rl.rollout.rollout_seed`, so the stream is a function of the
    position and the weights)."""
    indices = range(start_prompt, start_prompt + num_prompts)
    examples = [task.example(i, "train") for i in indices for _ in range(samples_per_prompt)]
    data = task.encode(examples)
    seeds = [rollout_seed(seed, i, g) for i in indices for g in range(samples_per_prompt)]
    trace = sample_tokens(
        model,
        data["prompt_ids"],
        data["prompt_mask"],
        sampler,
        seeds=seeds,
        stop_token_id=task.tokenizer.eos_id,
        capture=True,
        weights_version=weights_version,
    ).trace
    texts = task.tokenizer.batch_decode(trace.tokens)
    return StudentRollout(trace, examples, texts, task.rewards(texts, examples))


class DistillationLearner:
    """One distillation step per fresh student trace: ``step(trace)`` → metrics.

    ``roles.actor`` is the student; ``roles.rollout`` (version ``roles.version``) is what
    samples. ``teacher`` is any target-aligned token denoiser with the student's vocabulary.
    The teacher and the student are scored on the same micro-batches, states and actions,
    under the trainer's precision; the teacher without gradient.
    """

    def __init__(
        self,
        roles: PolicyRoles,
        teacher,
        loss: DistillationLoss,
        trainer_factory: Callable[[torch.nn.Module, Callable], Trainer],
        *,
        micro_batch_size: int | None = None,
        post_stop_weight: float = 1.0,
    ) -> None:
        if getattr(roles.actor, "alignment", "same_position") != "same_position":
            raise ValueError(
                "student: its logits are not target-aligned; wrap it with "
                "shift_to_target_aligned in its adapter"
            )
        check_same_vocabulary(roles.actor, teacher)
        self.roles = roles
        self.teacher = teacher
        self.loss = loss
        self.micro_batch_size = micro_batch_size
        self.post_stop_weight = post_stop_weight
        self.trainer: Trainer = trainer_factory(roles.actor, self._loss_fn)
        self._trace: TokenTrace | None = None

    def _loss_fn(self, model, micro: DiffusionDistillationBatch, _generator) -> Any:
        scorer = ReplayScorer.for_trace(model, self._trace, return_logits=True)
        return self.loss(scorer.score(micro.student_batch).logits, micro)

    def teacher_batches(
        self, trace: TokenTrace, batch: DiffusionTokenBatch
    ) -> list[DiffusionDistillationBatch]:
        """The micro-batches of ``batch`` with the teacher's logits on the student's states."""
        size = self.micro_batch_size or batch.batch_size
        scorer = TeacherScorer.for_trace(self.teacher, trace)
        with torch.no_grad(), self.trainer.autocast():
            return [scorer.distillation_batch(mb) for mb in batch.split(size)]

    def step(self, trace: TokenTrace) -> dict[str, float]:
        """Refuse a stale trace, train one step on it, sync the rollout weights."""
        self.roles.check_trace_version(trace.weights_version)
        batch = trace.prepare(self.post_stop_weight)
        micro = self.teacher_batches(trace, batch)
        self._trace = trace
        try:
            result = self.trainer.train_step(micro)
        finally:
            self._trace = None
        metrics = dict(result.metrics)
        metrics["weights_version"] = float(self.roles.sync_rollout())
        return metrics


def _load_pair(config: DistillRecipeConfig):
    """Student and teacher model directories, checked to share one tokenizer."""
    student = load_model_dir(config.student.path)
    teacher = load_model_dir(config.teacher.path)
    if teacher.tokenizer.name != student.tokenizer.name:
        raise ConfigError(
            f"teacher.path: {config.teacher.path} uses tokenizer {teacher.tokenizer.name}, the "
            f"student ({config.student.path}) {student.tokenizer.name}; distillation needs one "
            "tokenizer"
        )
    check_same_vocabulary(student.model, teacher.model)
    return student, teacher


def build_task(config: DistillRecipeConfig, student_info: dict):
    """The configured task, or (``task: null``) the task the student was trained on."""
    if config.task is not None:
        return build_configured_task(config.task, config.sampler.block_size)
    if "task" not in student_info:
        raise ConfigError(
            f"task: {config.student.path} does not record its task; set task.name and its options"
        )
    options = dict(student_info["task"])
    name = options.pop("name")
    if options.get("block_size", config.sampler.block_size) != config.sampler.block_size:
        raise ConfigError(
            f"sampler.block_size: the student was trained with blocks of "
            f"{options['block_size']}, got {config.sampler.block_size}"
        )
    options["block_size"] = config.sampler.block_size
    return get_task(name, **options)


def plot_report(
    metrics_path: Path,
    png_path: Path,
    history: list[dict],
    teacher_accuracy: float,
    loss_keys: list[str],
    title: str,
) -> Path:
    """Two panels: the loss terms ``loss_keys`` per step; student accuracy vs the teacher line."""
    records = read_metrics(metrics_path)
    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(9.5, 3.4))
    for key in loss_keys:
        points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        if points:
            loss_ax.plot(*zip(*points), linewidth=1.2, label=key.split("/")[1])
    loss_ax.set_xlabel("step")
    loss_ax.set_title("distillation loss")
    loss_ax.legend()
    loss_ax.grid(alpha=0.3)
    steps = [h["step"] for h in history]
    acc_ax.plot(steps, [h["accuracy"] for h in history], marker="o", label="student")
    acc_ax.axhline(teacher_accuracy, color="black", linestyle="--", label="teacher")
    acc_ax.set_xlabel("step")
    acc_ax.set_ylim(0, 1.02)
    acc_ax.set_title("held-out accuracy")
    acc_ax.legend()
    acc_ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path


def run_distill(config: DistillRecipeConfig, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Distil, evaluate, save; returns (and writes) ``report.json``."""
    if config.threads:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    student_dir, teacher_dir = _load_pair(config)
    task = build_task(config, student_dir.info)
    if student_dir.tokenizer.name != task.tokenizer.name:
        raise ConfigError(
            f"student.path: {config.student.path} uses tokenizer {student_dir.tokenizer.name}, "
            f"the task {task.tokenizer.name}"
        )
    student = student_dir.model.to(config.device)
    teacher = frozen_copy(teacher_dir.model, config.device)
    roles = PolicyRoles(student, reference=False)
    loss = DistillationLoss(config.objective)

    learner = DistillationLearner(
        roles,
        teacher,
        loss,
        trainer_factory(config),
        micro_batch_size=config.micro_batch_size,
        post_stop_weight=config.post_stop_weight,
    )
    trainer = learner.trainer
    sampler = config.sampler.model_copy(update={"generation_length": task.completion_length})
    eval_sampler = sampler.model_copy(update={"temperature": config.eval_temperature})
    metadata = {
        "objective": loss.metadata(),
        "sampler": sampler.model_dump(),
        "model": student.config.model_dump(),
        "tokenizer": task.tokenizer.name,
        "task": {"name": task.name, **task.config.model_dump()},
        "teacher": {"path": config.teacher.path, "weights": weights_digest(teacher)},
        "prompts_per_step": config.prompts_per_step,
        "samples_per_prompt": config.samples_per_prompt,
        "post_stop_weight": config.post_stop_weight,
    }
    manager = CheckpointManager(out / "checkpoints", keep_last=config.keep_last)
    state = resume_latest(trainer, manager, metadata, resume=config.resume, out=out)
    if state is None:
        state = {"prompt_position": 0, "history": [], "teacher_accuracy": None}
    else:
        roles.restore(int(state["weights_version"]))
        echo(f"resumed from {manager.latest()} at step {trainer.global_step}")
    history: list[dict[str, Any]] = list(state["history"])
    echo(
        f"distill on {task!r}: student {student.num_parameters():,} parameters, teacher "
        f"{teacher.num_parameters():,}"
    )

    def evaluate(model) -> dict[str, Any]:
        return evaluate_task(
            model, task, eval_sampler, num_examples=config.eval_examples, seed=config.seed
        ).to_dict()

    def evaluate_student() -> dict[str, Any]:
        result = evaluate(student)
        history.append({"step": trainer.global_step, "accuracy": result["accuracy"]})
        logger.log(trainer.global_step, {"eval/accuracy": result["accuracy"]})
        return result

    def save() -> None:
        data = {
            "prompt_position": position,
            "weights_version": roles.version,
            "history": history,
            "teacher_accuracy": teacher_accuracy,
        }
        trainer.save_checkpoint(manager, metadata, data)

    started = time.perf_counter()
    position = int(state["prompt_position"])
    with MetricsLogger(out) as logger:
        teacher_accuracy = state["teacher_accuracy"]
        if teacher_accuracy is None:
            teacher_accuracy = evaluate(teacher)["accuracy"]
            logger.log(0, {"eval/teacher_accuracy": teacher_accuracy})
        if not history:
            evaluate_student()
        bar = progress(config.steps, "distill")
        bar.update(trainer.global_step)
        while trainer.global_step < config.steps:
            with trainer.autocast():  # sample at the learner's precision: the same kernels
                rollout = sample_student(
                    roles.rollout,
                    task,
                    start_prompt=position,
                    num_prompts=config.prompts_per_step,
                    samples_per_prompt=config.samples_per_prompt,
                    sampler=sampler,
                    weights_version=roles.version,
                    seed=config.seed,
                )
            position += config.prompts_per_step
            metrics = learner.step(rollout.trace)
            metrics["rollout/accuracy"] = float(rollout.correct.mean())
            metrics["rollout/mean_length"] = float(rollout.trace.lengths().float().mean())
            step = trainer.global_step
            bar.update(1)
            if step % config.log_every == 0:
                logger.log(step, metrics)
            postfix = {"kl": f"{metrics['distill/soft_loss']:.3f}"}
            if step % config.eval_every == 0 and step < config.steps:
                postfix["acc"] = f"{evaluate_student()['accuracy']:.3f}"
            bar.set_postfix(postfix)
            if step % config.checkpoint_every == 0:
                save()
        bar.close()
        after = evaluate_student()
        if trainer.global_step % config.checkpoint_every:
            save()

    png = plot_report(
        out / "metrics.jsonl",
        out / "report.png",
        history,
        teacher_accuracy,
        [
            f"distill/{term}_loss"
            for term in ("soft", "hard")
            if getattr(config.objective, f"{term}_weight") > 0
        ],
        f"on-policy distillation on {task.name}",
    )
    info = {
        "task": metadata["task"],
        "sampler": eval_sampler.model_dump(),
        "trained_steps": trainer.global_step,
    }
    save_model_dir(out / "model", student, task.tokenizer, info)
    before = history[0]["accuracy"]
    gap = teacher_accuracy - before
    report = {
        "recipe": "distill",
        "steps": trainer.global_step,
        "elapsed_s": round(time.perf_counter() - started, 2),
        "student": {
            "path": config.student.path,
            "parameters": student.num_parameters(),
            "accuracy_before": before,
            "accuracy_after": after["accuracy"],
        },
        "teacher": {
            "path": config.teacher.path,
            "parameters": teacher.num_parameters(),
            "accuracy": teacher_accuracy,
        },
        # the fraction of the student-teacher gap closed; None when the teacher is not better
        "gap_closed": (after["accuracy"] - before) / gap if gap > 0 else None,
        "eval": after,
        "history": history,
        "weights_version": roles.version,
        "skipped_nonfinite": trainer.skipped_nonfinite,
        "model_dir": str(out / "model"),
        "report_png": str(png),
    }
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
