"""The one run loop every recipe uses: prologue, resume, cadence, history, reports.

A recipe is a :class:`Recipe`: it builds its parts (task, model, objective, trainer or
learner) in ``__init__`` and says how to take one step, evaluate, save its model and report.
:func:`run` does everything else, the same way for every method:

1. prologue: global seed and output directory — *before* the recipe is built, so model
   initialisation sees the seed — and the thread count (``threads``, or
   :func:`default_threads` for the model's size);
2. resume: the latest checkpoint of ``output_dir/checkpoints`` is validated against the
   recipe's metadata and restored (model, optimizer, schedule, RNGs, the recipe's own state,
   and the evaluation history); existing checkpoints with ``resume: false`` are refused;
3. the loop: ``step()`` until ``steps``; metrics logged every ``log_every`` steps
   (``metrics.jsonl`` + TensorBoard); an evaluation every ``eval_every`` steps (and one
   before training when the recipe asks for it, and one at the end), each appended to the
   history; a checkpoint every ``checkpoint_every`` steps and at the end;
4. reports: the recipe's plot (``curves.png`` by default), the final model directory, and
   ``results.json`` (the recipe's numbers plus steps, time, history, skipped steps).

Invariant: the history is part of the checkpoint state, so a killed and resumed run reports
the same history as a straight one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError
from ..plots import plot_curves
from ..rollout import collect_rollout
from ..train import CheckpointManager, MetricsLogger, Trainer, progress

Echo = Callable[[str], None]


class Recipe:
    """What a recipe supplies to :func:`run` (override the methods marked so).

    Attributes set by the subclass: ``name`` (progress bar and ``results["recipe"]``),
    ``trainer``, ``metadata`` (checked on resume), ``eval_before`` (evaluate before the first
    step), ``curves`` (metric keys plotted in ``curves.png``) and ``title``.
    """

    name = "recipe"
    eval_before = False
    curves: tuple[str, ...] = ("loss", "eval/accuracy")
    title = ""
    trainer: Trainer
    metadata: dict[str, Any]

    def steps_done(self) -> int:
        """Recipe steps taken so far (a learner step may be several trainer steps)."""
        return self.trainer.global_step

    def step(self) -> dict[str, float]:  # override
        """Take one step; return its metrics."""
        raise NotImplementedError

    def evaluate(self, tag: str) -> tuple[dict[str, Any], dict[str, float]]:  # override
        """Evaluate now; ``tag`` is ``"before"``, ``"step"`` or ``"after"``. Returns the
        history record (with at least ``step`` and ``accuracy``) and the metrics to log."""
        raise NotImplementedError

    position = 0  # the data position: the next training example or prompt

    def state(self) -> dict[str, Any]:
        """The recipe's own resumable state (data position, ...), checkpoint-safe values."""
        return {"position": self.position}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state` after a resume."""
        self.position = int(state["position"])

    def postfix(self, metrics: dict[str, float]) -> dict[str, str]:
        """Progress-bar fields for a step's metrics."""
        return {"loss": f"{metrics['loss']:.3f}"} if "loss" in metrics else {}

    def describe(self) -> str:
        """One line printed when the run starts."""
        return self.name

    def plot(self, out: Path, history: list[dict[str, Any]]) -> Path:
        """The run's figure, ``curves.png``; by default the curves of :attr:`curves`."""
        return plot_curves(out / "metrics.jsonl", out / "curves.png", list(self.curves), self.title)

    def save_model(self, directory: Path) -> None:  # override
        raise NotImplementedError

    def results(self, history: list[dict[str, Any]]) -> dict[str, Any]:  # override
        """The recipe's own numbers for ``results.json`` (before/after, ...)."""
        return {}


SMALL_MODEL_PARAMETERS = 20_000_000


def default_threads(num_parameters: int) -> int:
    """CPU threads for a model of ``num_parameters``: 1 below :data:`SMALL_MODEL_PARAMETERS`
    (measured by ``benchmarks/threads.py`` on 2 cores: SFT of the 0.8 M-parameter built-in
    transformer runs about 2× faster on 1 thread than on 2 or 4; the matrices are too small to
    split); above it, the process's current thread count."""
    if num_parameters < SMALL_MODEL_PARAMETERS:
        return 1
    return torch.get_num_threads()


class OnPolicyRecipe(Recipe):
    """A recipe that trains a :class:`~diffusion_rl.train.learner.PolicyLearner` on fresh
    rollouts of its own weights. Set ``learner``, ``roles``, ``source``, ``reward_fn`` and
    ``group_size``; override :meth:`rollout_options` for advantages, shaping and dynamic
    sampling. One step is one collected rollout and one learner step (μ trainer steps)."""

    eval_before = True
    group_size: int

    def rollout_options(self) -> dict[str, Any]:
        """Extra keyword arguments of :func:`~diffusion_rl.rollout.collect_rollout`."""
        return {}

    def steps_done(self) -> int:
        return self.learner.rollout_step

    def step(self) -> dict[str, float]:
        cfg = self.config
        with self.trainer.autocast():  # sample at the learner's precision: same kernels, parity 0
            rollout, self.position = collect_rollout(
                self.roles.rollout,
                self.source,
                self.reward_fn,
                start_prompt=self.position,
                num_prompts=cfg.prompts_per_step,
                group_size=self.group_size,
                weights_version=self.roles.version,
                seed=cfg.seed,
                **self.rollout_options(),
            )
        return self.learner.step(rollout)

    def postfix(self, metrics: dict[str, float]) -> dict[str, str]:
        return {"reward": f"{metrics['rollout/reward_mean']:.3f}"}

    def state(self) -> dict[str, Any]:
        return {"position": self.position, "weights_version": self.roles.version}

    def load_state(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])
        self.roles.restore(int(state["weights_version"]))


def prologue(config: Any) -> Path:
    """Thread count (when set), seed and output directory of a run config; returns the output
    directory."""
    if config.threads:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    return out


def run(config: Any, build: Callable[[Any], Recipe], echo: Echo = print) -> dict[str, Any]:
    """Build the recipe with ``build(config)`` after the prologue and run it (module doc)."""
    out = prologue(config)
    recipe = build(config)
    trainer = recipe.trainer
    if not config.threads:
        torch.set_num_threads(default_threads(sum(p.numel() for p in trainer.model.parameters())))
    manager = CheckpointManager(out / "checkpoints", keep_last=config.keep_last)
    history: list[dict[str, Any]] = []
    if manager.latest() is not None:
        if not config.resume:
            raise ConfigError(
                f"output_dir: {out} already holds checkpoints; set resume: true to continue, "
                "or choose a new output_dir"
            )
        state = trainer.resume(manager, recipe.metadata)
        recipe.load_state(state["recipe"])
        history = list(state["history"])
        echo(f"resumed from {manager.latest()} at step {recipe.steps_done()}")
    echo(recipe.describe())

    def save() -> None:
        trainer.save_checkpoint(
            manager, recipe.metadata, {"recipe": recipe.state(), "history": history}
        )

    started = time.perf_counter()
    with MetricsLogger(out) as logger:

        def evaluate(tag: str) -> dict[str, Any]:
            record, metrics = recipe.evaluate(tag)
            history.append(record)
            logger.log(record["step"], metrics)
            return record

        if recipe.eval_before and not history:
            evaluate("before")
        bar = progress(config.steps, recipe.name)
        bar.update(recipe.steps_done())
        while recipe.steps_done() < config.steps:
            metrics = recipe.step()
            step = recipe.steps_done()
            bar.update(1)
            if step % config.log_every == 0:
                logger.log(step, metrics)
            postfix = recipe.postfix(metrics)
            if step % config.eval_every == 0 and step < config.steps:
                postfix["acc"] = f"{evaluate('step')['accuracy']:.3f}"
            bar.set_postfix(postfix)
            if step % config.checkpoint_every == 0:
                save()
        bar.close()
        evaluate("after")
        if manager.latest() is None or recipe.steps_done() % config.checkpoint_every:
            save()

    figure = recipe.plot(out, history)
    recipe.save_model(out / "model")
    results = {
        "recipe": recipe.name,
        "steps": recipe.steps_done(),
        "elapsed_s": round(time.perf_counter() - started, 2),
        **recipe.results(history),
        "history": history,
        "skipped_nonfinite": trainer.skipped_nonfinite,
        "model_dir": str(out / "model"),
        "curves_png": str(figure),
    }
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    return results
