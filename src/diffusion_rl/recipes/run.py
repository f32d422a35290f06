"""The one run loop every recipe uses: prologue, resume, cadence, history, reports.

A recipe is a :class:`Recipe`: it builds its parts (task, model, objective, trainer or
learner) in ``__init__`` and says how to take one step, evaluate, save its model and report.
:func:`run` does everything else, the same way for every method:

1. prologue: global seed and output directory — *before* the recipe is built, so model
   initialisation sees the seed — and the thread count (``threads``, or
   :func:`default_threads` for the model's size); leftovers of an interrupted final save
   (``.model.*`` staging directories, ``.*.tmp-*`` files) are removed;
2. resume: when ``output_dir/checkpoints`` holds checkpoints, the newest usable one is
   validated against the recipe's metadata and restored (model, optimizer, schedule, RNGs,
   the recipe's own state, the evaluation history, the count of ``metrics.jsonl`` lines and
   of consecutive skipped steps); checkpoints that cannot be read stop the run with an error
   (it never silently restarts from step 0); existing checkpoints with ``resume: false`` are
   refused. A run whose checkpoint is at ``steps`` and whose ``results.json`` says so is
   *finished*: nothing is evaluated, logged or written again, and its results are returned;
3. the loop: ``step()`` until ``steps``; metrics logged every ``log_every`` steps
   (``metrics.jsonl``, TensorBoard, wandb when ``wandb_project`` is set); an evaluation
   every ``eval_every`` steps (and one before training when the recipe asks for it), each
   appended to the history; a checkpoint every ``checkpoint_every`` steps and at ``steps``;
   then the final evaluation. An SFT run with ``stop_at_accuracy`` stops (checkpointed) at
   the first evaluation whose held-out accuracy reaches it: that evaluation is its final
   one, and a rerun with the same target finds the run finished;
4. reports: the recipe's plot (``curves.png`` by default), the final model directory, and
   ``results.json`` (the recipe's numbers plus steps, time, history, skipped steps).

Invariants:

* Nothing lost: every checkpoint records the state of a *completed* step, and everything
  logged up to it (history, ``metrics.jsonl`` line count, TensorBoard events flushed). A run
  killed at any moment (``kill -9`` included) and rerun resumes from its last checkpoint,
  cuts ``metrics.jsonl`` back to that checkpoint's lines and redoes what came after, so it
  ends with the same model (bitwise), the same history and each step logged once. The final
  model directory is written to ``.model.staging``, fsynced and renamed over ``model/``;
  ``results.json`` is replaced atomically and written last, so its presence means the run
  finished.
* Ctrl-C and SIGTERM (a cluster's pre-emption, SIGKILL a grace period later): the first
  SIGINT or SIGTERM lets the current step finish, writes a checkpoint of it and raises
  :class:`RunInterrupted` (``signum`` says which signal; the CLI exits 130 or 143), whose
  message says where; the rerun resumes from that step. A second signal of either kind
  stops at once, saving nothing more (a half-done step is never saved); so does one that
  comes during the final evaluation.
* Nothing silent: after every step the trainable parameters are checked; a non-finite one
  raises :class:`NonFiniteParametersError` before anything is saved for that step (no
  checkpoint, no model, no ``results.json``). More than ``max_consecutive_skips`` steps in a
  row skipped for a non-finite loss or gradient raise :class:`TooManySkippedStepsError` the
  same way. Skipped steps are reported at the end and in ``results.json``
  (``skipped_nonfinite``, ``skipped_zero_weight``).
* Each metric is logged once per step under one name (the logger refuses a repeat).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError
from ..distributed import World, init_world
from ..plots import plot_curves
from ..rollout import collect_rollout
from ..train import CheckpointManager, MetricsLogger, Trainer, progress
from ..train.checkpoint import DiskFullError, is_disk_full
from ..train.loggers import (
    METRICS_FILE,
    WandbLogger,
    atomic_write_text,
    fsync_directory,
    truncate_metrics,
)
from ..train.parallel import local_tensor

__all__ = [
    "NonFiniteParametersError",
    "OnPolicyRecipe",
    "Recipe",
    "RunInterrupted",
    "TooManySkippedStepsError",
    "TrainingAbortedError",
    "default_threads",
    "prologue",
    "run",
]

Echo = Callable[[str], None]

MODEL_DIR = "model"
RESULTS_FILE = "results.json"
_MODEL_STAGING = ".model.staging"
_MODEL_RETIRED = ".model.retired"
# Leftovers of an interrupted write in the output directory: the final model's staging
# directories (ours, and the scratch and retired copies ``models.io.save_model`` makes beside
# its target, ``.NAME.tmp-*`` and ``.NAME.old``) and the temporary files of atomic rewrites.
_LEFTOVER_DIRS = (_MODEL_STAGING, _MODEL_RETIRED, f".{_MODEL_STAGING}.old", f".{MODEL_DIR}.old")
_LEFTOVER_DIR_PREFIXES = (f".{_MODEL_STAGING}.tmp-", f".{MODEL_DIR}.tmp-")
_LEFTOVER_FILE_PREFIXES = tuple(
    f".{name}.tmp-" for name in (RESULTS_FILE, METRICS_FILE, "wandb_run_id")
)


class TrainingAbortedError(RuntimeError, ValueError):
    """The run was stopped because training went wrong (non-finite values): nothing was saved
    for the failing step. A ``ValueError`` too, so the CLI reports it as a one-line error
    with a non-zero exit status."""


class NonFiniteParametersError(TrainingAbortedError):
    """A trainable parameter is NaN or infinite after an update (the message names it, the
    step, and the fix)."""


class TooManySkippedStepsError(TrainingAbortedError):
    """More than ``max_consecutive_skips`` steps in a row were skipped for a non-finite loss
    or gradient."""


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) or SIGTERM stopped the run; the message says which checkpoint a rerun
    resumes from, ``signum`` which signal it was (the CLI exits ``128 + signum``)."""

    def __init__(self, message: str = "", signum: int = signal.SIGINT) -> None:
        super().__init__(message)
        self.signum = int(signum)

    def __reduce__(self):  # keep ``signum`` across pickling (multiprocessing)
        return (type(self), (str(self), self.signum))


class _Abort(KeyboardInterrupt):
    """A second signal (or one outside the step loop): stop at once."""

    def __init__(self, signum: int) -> None:
        super().__init__()
        self.signum = int(signum)


class Recipe:
    """What a recipe supplies to :func:`run` (override the methods marked so).

    Attributes set by the subclass: ``name`` (progress bar and ``results["recipe"]``),
    ``trainer``, ``metadata`` (checked on resume), ``eval_before`` (evaluate before the first
    step), ``curves`` (metric keys plotted in ``curves.png``) and ``title``. Set by
    :func:`run`: ``last_metrics``, the metrics of the last step taken (kept in checkpoints,
    so a resumed run reports the same final numbers).
    """

    name = "recipe"
    eval_before = False
    curves: tuple[str, ...] = ("loss", "eval/accuracy")
    title = ""
    trainer: Trainer
    metadata: dict[str, Any]
    last_metrics: dict[str, float] | None = None

    def steps_done(self) -> int:
        """Recipe steps taken so far (a learner step may be several trainer steps)."""
        return self.trainer.global_step

    def step(self) -> dict[str, float]:  # override
        """Take one step; return its metrics."""
        raise NotImplementedError

    def evaluate(self, tag: str) -> tuple[dict[str, Any], dict[str, float]]:  # override
        """Evaluate now; ``tag`` is ``"before"``, ``"step"`` or ``"after"``. Returns the
        history record (with at least ``step`` and ``accuracy``, or, for a task without a
        verifier, ``reward_mean``, the held-out reward; an optional ``grid``, a PNG
        path relative to ``output_dir``, is logged as the image ``eval/samples``) and the
        metrics to log."""
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
        return plot_curves(out / METRICS_FILE, out / "curves.png", list(self.curves), self.title)

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


def _one_name_per_value(metrics: dict[str, float], iterations: int) -> dict[str, float]:
    """The learner reports the objective's metrics per inner iteration (``key@iterN``) and,
    under the plain ``key``, those of the last one: drop the ``key@iter{μ-1}`` copies, so
    each value is logged once (plain keys: the last iteration; ``@iterN``: earlier ones)."""
    suffix = f"@iter{iterations - 1}"
    return {
        key: value
        for key, value in metrics.items()
        if not (key.endswith(suffix) and key[: -len(suffix)] in metrics)
    }


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
        # sample at the learner's precision (autocast, or FSDP's compute dtype): parity 0
        with self.trainer.autocast(), self.roles.sampling():
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
        metrics = self.learner.step(rollout)
        return _one_name_per_value(metrics, self.learner.num_iterations)

    def postfix(self, metrics: dict[str, float]) -> dict[str, str]:
        return {"reward": f"{metrics['rollout/reward_mean']:.3f}"}

    def state(self) -> dict[str, Any]:
        state = {"position": self.position, "weights_version": self.roles.version}
        rollout = self.roles.rollout_state()  # rollout weights that lag the actor
        if rollout is not None:
            state["rollout_weights"] = rollout
        return state

    def load_state(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])
        self.roles.restore(int(state["weights_version"]), state.get("rollout_weights"))


def prologue(config: Any) -> Path:
    """Thread count (when set), seed and output directory of a run config; returns the output
    directory, cleared of the leftovers of an interrupted final save (by rank 0, while the
    other processes of a distributed run wait)."""
    if config.threads:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    out = Path(config.output_dir)
    world = World.current()
    if world.is_main:
        out.mkdir(parents=True, exist_ok=True)
        remove_leftovers(out)
    world.barrier()
    return out


def remove_leftovers(out: Path) -> list[Path]:
    """Remove the staging directories and temporary files an interrupted final save or
    atomic write left in ``out``; returns what was removed."""
    removed = []
    for entry in out.iterdir():
        name = entry.name
        if entry.is_dir() and (name in _LEFTOVER_DIRS or name.startswith(_LEFTOVER_DIR_PREFIXES)):
            shutil.rmtree(entry, ignore_errors=True)
        elif entry.is_file() and name.startswith(_LEFTOVER_FILE_PREFIXES):
            entry.unlink(missing_ok=True)
        else:
            continue
        removed.append(entry)
    return removed


# ----------------------------------------------------------------------------- helpers
def finished_results(
    out: Path, step: int, steps: int, stop_at: float | None = None
) -> dict[str, Any] | None:
    """The results of a finished run in ``out``: its checkpoint is at ``step >= steps`` (or
    at the step where it reached ``stop_at``, the same ``stop_at_accuracy``) and its
    ``results.json`` (written last) reports that step, with the model directory present."""
    path = out / RESULTS_FILE
    if not path.is_file() or not (out / MODEL_DIR).is_dir():
        return None
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
        return None
    if not isinstance(results, dict) or results.get("steps") != step:
        return None
    stopped = stop_at is not None and results.get("stopped_at_accuracy") == stop_at
    return results if step >= steps or stopped else None


def first_non_finite(model: torch.nn.Module) -> tuple[str, torch.Tensor] | None:
    """The first trainable parameter of ``model`` holding NaN or ±inf, as ``(name, tensor)``;
    ``None`` when all are finite (one device sync for the whole check). A sharded model's
    parameters are checked on this process's shards."""
    named = [(name, local_tensor(p)) for name, p in model.named_parameters() if p.requires_grad]
    if not named:
        return None
    finite = torch.stack([torch.isfinite(p.detach()).all() for _, p in named])
    if bool(finite.all()):
        return None
    return named[int((~finite).nonzero()[0])]


class _SkipStreak:
    """Consecutive trainer steps skipped for a non-finite loss or gradient, read from the
    trainer's counters after each recipe step. Any applied update resets it (for a learner
    step of μ > 1 trainer steps: one that applied any); zero-weight skips neither count nor
    reset."""

    def __init__(self, trainer: Trainer, streak: int = 0) -> None:
        self.trainer = trainer
        self.streak = streak
        self._skipped = trainer.skipped_nonfinite
        self._applied = trainer.optimizer_steps

    def update(self) -> int:
        skipped = self.trainer.skipped_nonfinite - self._skipped
        applied = self.trainer.optimizer_steps - self._applied
        self._skipped, self._applied = self.trainer.skipped_nonfinite, self.trainer.optimizer_steps
        self.streak = 0 if applied else self.streak + skipped
        return self.streak


_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_SIGNAL_NAMES = {signal.SIGINT: b"interrupt (SIGINT)", signal.SIGTERM: b"SIGTERM"}


class _InterruptGuard:
    """While active (in the main thread), the first SIGINT or SIGTERM is recorded
    (``requested``, ``signum``), not raised: the loop finishes the step it is in, checkpoints
    it and stops. From then on a second signal of either kind raises at once (a
    ``KeyboardInterrupt`` with its ``signum``), as does any signal after :meth:`abort_now`.
    A signal the process ignores (SIG_IGN, e.g. ``nohup`` or a background job's SIGINT)
    stays ignored. The previous handlers are back on exit."""

    def __init__(self) -> None:
        self.requested = False
        self.signum: int = signal.SIGINT
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _InterruptGuard:
        if threading.current_thread() is threading.main_thread():
            for signum in _SIGNALS:
                previous = signal.getsignal(signum)
                if previous not in (signal.SIG_IGN, None):
                    self._previous[signum] = previous
                    signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested, self.signum = True, signum
        self.abort_now()
        if os.environ.get("RANK", "0") != "0":  # under torchrun, rank 0 speaks for the run
            return
        os.write(  # async-signal-safe, unlike print
            2,
            b"\n"
            + _SIGNAL_NAMES.get(signum, b"signal")
            + b": finishing the current step, then writing a checkpoint (a second signal "
            b"stops at once, without it)\n",
        )

    @staticmethod
    def _abort(signum: int, frame: Any) -> None:
        raise _Abort(signum)

    def abort_now(self) -> None:
        """From now on a signal stops the run at once."""
        for signum in self._previous:
            signal.signal(signum, self._abort)

    def __exit__(self, *exc_info: object) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}


def _signum(stop: BaseException, interrupt: _InterruptGuard) -> int:
    """The signal that stopped the run: ``stop``'s own, else the one the guard recorded,
    else SIGINT (a ``KeyboardInterrupt`` raised by the step itself)."""
    signum = getattr(stop, "signum", None)
    if signum is None:
        signum = interrupt.signum if interrupt.requested else signal.SIGINT
    return int(signum)


def _by(signum: int) -> str:
    """How an interrupt message names its signal: nothing for Ctrl-C, `` (SIGTERM)``."""
    return "" if signum == signal.SIGINT else f" ({signal.Signals(signum).name})"


def _fsync_tree(root: Path) -> None:
    for directory, _, files in os.walk(root):
        for name in files:
            with open(Path(directory) / name, "rb") as handle:
                os.fsync(handle.fileno())
        fsync_directory(directory)


def save_final_model(recipe: Recipe, out: Path) -> Path:
    """``recipe.save_model`` into ``out/.model.staging``, fsynced, then renamed over
    ``out/model`` (the old one is moved aside first and removed after): a kill leaves either
    the old model or the new one, plus staging that the next start removes."""
    staging, retired, final = out / _MODEL_STAGING, out / _MODEL_RETIRED, out / MODEL_DIR
    for leftover in (staging, retired):
        shutil.rmtree(leftover, ignore_errors=True)
    recipe.save_model(staging)
    _fsync_tree(staging)
    if final.exists():
        os.rename(final, retired)
    os.rename(staging, final)
    fsync_directory(out)
    shutil.rmtree(retired, ignore_errors=True)
    return final


def _where(checkpoint: Path | None) -> str:
    if checkpoint is None:
        return "no checkpoint was written yet, so a rerun starts from step 0"
    return f"the last checkpoint, {checkpoint}, is intact"


def _short(error: BaseException) -> str:
    """``Type: message`` of ``error`` in one line of at most 200 characters."""
    text = f"{type(error).__name__}: {' '.join(str(error).split())}"
    return text if len(text) <= 200 else text[:197] + "..."


def _lr(config: Any) -> str:
    optim = getattr(config, "optim", None)
    return f" (now {optim.lr:g})" if optim is not None else ""


# ----------------------------------------------------------------------------- the run
def run(config: Any, build: Callable[[Any], Recipe], echo: Echo = print) -> dict[str, Any]:
    """Build the recipe with ``build(config)`` after the prologue and run it (module doc).

    Returns the results (also in ``results.json``). Raises :class:`TrainingAbortedError`
    when training produced non-finite values, :class:`RunInterrupted` on Ctrl-C (after
    writing a checkpoint of the last completed step), ``ConfigError`` when ``output_dir``
    holds checkpoints and ``resume`` is false.

    Under ``torchrun`` every process runs this loop (the process group is joined first); each
    takes its share of every step, all take part in checkpoints and weight gathers, and rank 0
    alone prints, logs, evaluates and writes the reports; every rank returns the results.
    """
    world = init_world(config.device, config.distributed.backend, config.distributed.timeout_s)
    if not world.is_main:
        echo = _silent
    out = prologue(config)
    recipe = build(config)
    trainer = recipe.trainer
    if not config.threads:
        torch.set_num_threads(default_threads(sum(p.numel() for p in trainer.model.parameters())))
    manager = CheckpointManager(out / "checkpoints", keep_last=config.keep_last)
    history: list[dict[str, Any]] = []
    resumed_at: int | None = None
    checkpoint: Path | None = None
    streak = 0
    if manager.has_checkpoints():
        if not config.resume:
            raise ConfigError(
                f"output_dir: {out} already holds checkpoints; set resume: true to continue, "
                "or choose a new output_dir"
            )
        state = trainer.resume(manager, recipe.metadata, warn=echo)
        checkpoint = trainer.resumed_from
        recipe.load_state(state["recipe"])
        history = list(state["history"])
        resumed_at = recipe.steps_done()
        done = finished_results(
            out, resumed_at, config.steps, getattr(config, "stop_at_accuracy", None)
        )
        if done is not None:
            echo(
                f"already finished: {out} holds a complete run of {resumed_at} steps; results in "
                f"{out / RESULTS_FILE}, model in {out / MODEL_DIR} (nothing was changed)"
            )
            return done
        recipe.last_metrics = state.get("last_metrics") or None
        streak = int(state.get("skip_streak", 0))
        removed = 0
        if world.is_main:
            removed = truncate_metrics(
                out / METRICS_FILE, state.get("metrics_lines"), through_step=resumed_at
            )
        echo(f"resumed from {checkpoint} at step {resumed_at}")
        if removed:
            echo(f"{METRICS_FILE}: removed {removed} lines logged after that checkpoint")
    elif world.is_main:  # a fresh start: what an attempt without any checkpoint logged is void
        truncate_metrics(out / METRICS_FILE, 0)
        for stale in (out / "tensorboard").glob("events.out.tfevents.*"):
            stale.unlink()
    echo(recipe.describe())

    wandb = None
    if getattr(config, "wandb_project", None) and world.is_main:
        wandb = WandbLogger(config.wandb_project, out, config.model_dump(mode="json"))
    skips = _SkipStreak(trainer, streak)
    saved_at = resumed_at
    started = time.perf_counter()
    purge = None if resumed_at is None else resumed_at + 1
    logs = MetricsLogger(out, purge_step=purge, wandb=wandb) if world.is_main else _NoLogger()
    with logs as logger:

        def save() -> None:
            nonlocal saved_at, checkpoint
            logger.flush()
            run_state = {
                "recipe": recipe.state(),
                "history": history,
                "metrics_lines": logger.lines,
                "skip_streak": skips.streak,
                "last_metrics": recipe.last_metrics or {},
            }
            checkpoint = trainer.save_checkpoint(manager, recipe.metadata, run_state)
            saved_at = recipe.steps_done()

        def evaluate(tag: str) -> dict[str, Any]:
            trainer.publish()  # the trained weights into the plain model rank 0 evaluates
            record, metrics = recipe.evaluate(tag) if world.is_main else (None, None)
            record, metrics = world.broadcast((record, metrics))
            history.append(record)
            logger.log(record["step"], metrics)
            if "grid" in record:
                logger.log_images(record["step"], {"eval/samples": out / record["grid"]})
            return record

        with _InterruptGuard() as interrupt:
            bar = progress(config.steps, recipe.name, disable=not world.is_main)
            stopped = False  # by stop_at_accuracy (the last evaluation is the final one)
            try:
                if recipe.eval_before and not history:
                    evaluate("before")
                elif (
                    resumed_at
                    and resumed_at < config.steps
                    and resumed_at % config.eval_every == 0
                    and all(h["step"] != resumed_at for h in history)
                ):  # resumed from the end of a shorter run: its last evaluation is due
                    evaluate("step")
                bar.update(recipe.steps_done())
                while recipe.steps_done() < config.steps and not world.any(interrupt.requested):
                    metrics = recipe.step()
                    recipe.last_metrics = metrics
                    step = recipe.steps_done()
                    bar.update(1)
                    if step % config.log_every == 0:
                        logger.log(step, metrics)
                    _check_step(config, trainer, skips, step, checkpoint, world)
                    postfix = recipe.postfix(metrics)
                    if step % config.eval_every == 0 and step < config.steps:
                        what, value = _headline(evaluate("step"))
                        postfix["acc" if what == "accuracy" else "eval"] = f"{value:.3f}"
                        if bar.disable:
                            echo(f"step {step}/{config.steps}: held-out {what} {value:.3f}")
                        stopped = _reached(config, what, value)
                    bar.set_postfix(postfix)
                    if step % config.checkpoint_every == 0 or stopped:
                        save()
                    if stopped:
                        echo(
                            f"step {step}: held-out accuracy {value:.3f} reached "
                            f"stop_at_accuracy {config.stop_at_accuracy}; training stops here"
                        )
                        break
                if saved_at != recipe.steps_done():
                    save()  # the last step (or the one Ctrl-C let finish)
            except KeyboardInterrupt as stop:  # mid-step: a second signal, or raised by the step
                signum = _signum(stop, interrupt)
                message = (
                    f"interrupted{_by(signum)} during step {recipe.steps_done() + 1}: nothing "
                    f"of it was saved; {_where(checkpoint)}"
                )
                raise RunInterrupted(message, signum) from None
            finally:
                bar.close()
            # The messages are the exceptions': the CLI prints each once, as its last line.
            interrupt.abort_now()  # from here on a signal stops the run at once
            try:
                if world.any(interrupt.requested):
                    signum = world.max(interrupt.signum if interrupt.requested else 0)
                    message = (
                        f"interrupted{_by(signum)}: checkpoint of step {saved_at} written to "
                        f"{checkpoint}; run the same command again to resume from it"
                    )
                    raise RunInterrupted(message, signum)
                if not stopped:
                    evaluate("after")
            except RunInterrupted:
                raise
            except KeyboardInterrupt as stop:
                signum = _signum(stop, interrupt)
                message = f"interrupted{_by(signum)} in the final evaluation; {_where(checkpoint)}"
                raise RunInterrupted(message, signum) from None

    trainer.publish()
    if not world.is_main:
        world.barrier()  # rank 0 writes the figure, the model and results.json
        return world.broadcast(None)
    try:
        figure = recipe.plot(out, history)
        save_final_model(recipe, out)
    except Exception as error:  # torch's / safetensors' own report of a full disk: ours
        if not is_disk_full(error):
            raise
        shutil.rmtree(out / _MODEL_STAGING, ignore_errors=True)  # give the space back
        kept = f"the checkpoint of the last step, {checkpoint}, is intact" if checkpoint else ""
        raise DiskFullError(
            errno.ENOSPC,
            f"disk full while writing the final model to {out / MODEL_DIR} ({_short(error)}); "
            f"{kept or _where(checkpoint)}: free space on that disk, then run the same "
            "command again to write the model",
        ) from error
    results = {
        "recipe": recipe.name,
        "steps": recipe.steps_done(),
        "stopped_at_accuracy": config.stop_at_accuracy if stopped else None,
        "elapsed_s": round(time.perf_counter() - started, 2),
        **recipe.results(history),
        "history": history,
        "skipped_nonfinite": trainer.skipped_nonfinite,
        "skipped_zero_weight": trainer.skipped_zero_weight,
        "model_dir": str(out / MODEL_DIR),
        "curves_png": str(figure),
    }
    atomic_write_text(out / RESULTS_FILE, json.dumps(results, indent=2) + "\n")
    if trainer.skipped_nonfinite or trainer.skipped_zero_weight:
        echo(
            f"note: trainer steps skipped without an update: {trainer.skipped_nonfinite} for a "
            f"non-finite loss or gradient, {trainer.skipped_zero_weight} for zero loss weight "
            f"(skipped_nonfinite, skipped_zero_weight in {out / RESULTS_FILE})"
        )
    world.barrier()
    return world.broadcast(results)


def _silent(message: str) -> None:
    """The echo of ranks other than 0: rank 0 speaks for the run."""


class _NoLogger:
    """The metrics logger of ranks other than 0: logs nothing (rank 0 writes the files)."""

    lines = 0

    def __enter__(self) -> _NoLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass

    def log(self, step: int, metrics: dict) -> None:
        pass

    def log_images(self, step: int, images: dict) -> None:
        pass

    def flush(self) -> None:
        pass


def _reached(config: Any, what: str, value: float) -> bool:
    """Whether an evaluation's headline reached the run's ``stop_at_accuracy`` (SFT recipes)."""
    target = getattr(config, "stop_at_accuracy", None)
    return target is not None and what == "accuracy" and value >= target


def _headline(record: dict[str, Any]) -> tuple[str, float]:
    """What an evaluation record is summed up by: ``("accuracy", value)``, or for a task
    without a verifier ``("reward", its reward_mean)``."""
    if "accuracy" in record:
        return "accuracy", record["accuracy"]
    return "reward", record["reward_mean"]


def _check_step(
    config: Any,
    trainer: Trainer,
    skips: _SkipStreak,
    step: int,
    checkpoint: Path | None,
    world: World,
) -> None:
    """Fail loudly after a step: too many non-finite skips in a row, or non-finite
    parameters, raise before anything of this step is saved (on every rank: the skip counters
    are global, and each rank's shards are checked and the verdicts shared)."""
    limit = config.max_consecutive_skips
    if skips.update() > limit:
        raise TooManySkippedStepsError(
            f"step {step}: trainer steps skipped in a row for a non-finite loss or gradient: "
            f"{skips.streak} (max_consecutive_skips: {limit}); training diverged or the "
            f"data holds NaN/inf: lower optim.lr{_lr(config)}, check the inputs, or raise "
            f"max_consecutive_skips; nothing was saved for step {step} and {_where(checkpoint)}"
        )
    bad = first_non_finite(trainer.model)
    found = [v for v in world.gather_objects(None if bad is None else bad[0]) if v is not None]
    if found and bad is None:
        raise NonFiniteParametersError(
            f"step {step}: parameter {found[0]!r} has non-finite values after the update (on "
            f"another rank's shard); training diverged: lower optim.lr{_lr(config)}; nothing "
            f"was saved for this step and {_where(checkpoint)}"
        )
    if bad is not None:
        name, tensor = bad
        count = int((~torch.isfinite(tensor.detach())).sum())
        raise NonFiniteParametersError(
            f"step {step}: parameter {name!r} has {count} non-finite values (of "
            f"{tensor.numel()}) after the update; training diverged: lower "
            f"optim.lr{_lr(config)} or set optim.grad_clip; nothing was saved for this step "
            f"and {_where(checkpoint)}"
        )
