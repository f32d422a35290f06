"""The serving engine: the loaded models, the batching scheduler, versioned weight updates
and the metrics.

Batching (:meth:`Engine.run`). Each model has a FIFO queue, a scheduler task on the event
loop and one worker thread. A request is queued as one *item* with a batch *key* and a
function ``fn(served, items) -> results``. The scheduler takes the oldest item, waits up to
``max_wait_ms`` from its arrival for more items with the same ``(fn, key)`` (up to
``max_batch_rows`` rows: an item counts ``item.rows`` rows when it has that attribute, else
1), and runs them as one call of ``fn`` in the worker thread. Callers choose keys so that
merged rows cannot influence each other (same sampler settings, same input shapes; every row
seeded on its own), which makes a request's output bitwise the same served alone or merged.
If a merged call raises, each item is run again alone, so one bad item fails only itself.

Invariants:

* **A weight update never changes a running batch.** Batches and updates of a model run one
  after another in the model's one worker thread; a batch reads the current
  :class:`ServedModel` when it starts there, and its results are returned with that
  ``ServedModel`` (its ``version`` and ``checksum``), retries included. An update from
  tensors is applied in place between batches (no second copy of the weights); an update
  from a directory loads a new module. Either way the next batch sees a new ``ServedModel``
  with ``version + 1``. ``ServedModel.model`` is used only inside ``fn`` (the worker).
* **Bounded queue.** At most ``max_queue`` items wait (over all models); one more is refused
  with 503 and ``Retry-After``. A request waits at most ``request_timeout_s`` (then 504);
  a caller that is cancelled (the client went away) drops its item if it has not started.
* **No cache outlives a version.** The engine keeps no state between batches but the
  weights; the samplers' KV caches live within one call.

The checksum (:func:`weights_checksum`) is the first 16 hex digits of a sha256 over each
tensor's name, dtype, shape and bytes in name order; an in-place update rehashes only the
tensors it changed.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch

from ..checksums import combine_digests, tensor_digest, weights_checksum
from .errors import RequestError, busy
from .settings import ServeSettings

__all__ = [
    "Engine",
    "Metrics",
    "ServedModel",
    "load_served_model",
    "load_served_workflow",
    "load_update_directory",
    "model_tensors",
    "tensor_digest",
    "weights_checksum",
]

Kind = Literal["token", "flow", "workflow"]


@dataclass(frozen=True)
class ServedModel:
    """One served model at one weights version (immutable: an update makes a new one)."""

    name: str
    kind: Kind
    model: Any  # the nn.Module (eval mode) or a Workflow
    tokenizer: Any | None
    info: dict
    version: int  # weights version: 0 at start, +1 per update (or the version an update names)
    checksum: str  # sha256 hex (first 16) of the weights' bytes (weights_checksum)


# ----------------------------------------------------------------------------- checksums
def model_tensors(kind: str, model: Any) -> dict[str, torch.Tensor]:
    """The tensors that make up a served model's weights: its ``state_dict()``; for a
    workflow, every stage's, named ``STAGE.KEY``."""
    if kind == "workflow":
        tensors: dict[str, torch.Tensor] = {}
        for stage, module in model.models.items():
            state = module.state_dict() if hasattr(module, "state_dict") else {}
            tensors.update({f"{stage}.{key}": value for key, value in state.items()})
        return tensors
    return dict(model.state_dict()) if hasattr(model, "state_dict") else {}


def is_training_checkpoint(directory: str | Path) -> bool:
    """Whether ``directory`` is a trainer checkpoint (``OUTPUT_DIR/checkpoints/step_N``: a
    manifest and ``model.safetensors``, or the ``dcp/`` shards of a run under torchrun, and
    no ``config.json``) rather than a model directory."""
    from ..train.checkpoint import DCP_DIR, MANIFEST_FILE, MODEL_FILE

    path = Path(directory)
    return (
        (path / MANIFEST_FILE).is_file()
        and ((path / MODEL_FILE).is_file() or (path / DCP_DIR).is_dir())
        and not (path / "config.json").exists()
    )


def checkpoint_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """The weights of trainer checkpoint ``directory`` (either layout; a sharded one is
    assembled whole), after verifying every file against its manifest (sizes and SHA-256);
    a corrupt checkpoint is a 400 naming the file."""
    from ..train.checkpoint import CheckpointCorruptError, load_model_tensors

    try:
        return load_model_tensors(directory)
    except CheckpointCorruptError as error:
        raise RequestError(
            400, f"directory: {error}", param="directory", code="corrupt_checkpoint"
        ) from None
    except (OSError, ValueError) as error:
        raise RequestError(400, f"directory: {_one_line(error)}", param="directory") from None


def _one_line(error: BaseException, limit: int = 400) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def load_update_directory(name: str, directory: str | Path, version: int) -> ServedModel:
    """:func:`load_served_model` for an update from ``directory`` (already confined by the
    caller): every failure to read it — a file that differs from its manifest, a damaged
    weights file, bad JSON, a config that fails its checks, weights that do not fit — is a
    RequestError 400 naming the file (``param: directory``); nothing is served from it."""
    from ..models.loading import ManifestMismatchError, ModelFileError

    try:
        return load_served_model(name, directory, version=version)
    except ManifestMismatchError as error:
        raise RequestError(
            400, f"directory: {error}", param="directory", code="manifest_mismatch"
        ) from None
    except ModelFileError as error:
        raise RequestError(
            400, f"directory: {error}", param="directory", code="invalid_model_files"
        ) from None
    except (OSError, TypeError, ValueError, KeyError, RecursionError) as error:
        raise RequestError(400, f"directory: {_one_line(error)}", param="directory") from None
    except RuntimeError as error:  # torch refusing weights that do not fit (a pipeline's)
        if isinstance(error, torch.OutOfMemoryError):
            raise
        raise RequestError(
            400, f"directory: {directory}: {_one_line(error)}", param="directory"
        ) from None


# ----------------------------------------------------------------------------- metrics
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

COUNTERS = {
    "requests_total": "HTTP requests answered, by route and status",
    "generated_tokens_total": "tokens generated (a rate of it is tokens per second)",
    "generated_images_total": "images (or clips) generated (a rate of it is images per second)",
    "batches_total": "batches run",
    "batch_retries_total": "merged batches that failed and were retried item by item",
    "rejected_total": "requests refused because the queue was full (503)",
    "timeouts_total": "requests that waited past request_timeout_s (504)",
    "cancelled_total": "queued requests dropped because their client went away",
    "weight_updates_total": "weight updates applied",
}
HISTOGRAMS = {
    "batch_rows": ("rows per batch", ROW_BUCKETS),
    "request_latency_seconds": ("time from request to response, by route", LATENCY_BUCKETS),
    "queue_wait_seconds": ("time an item waited before its batch started", LATENCY_BUCKETS),
    "batch_seconds": ("time a batch ran", LATENCY_BUCKETS),
    "weight_update_seconds": ("time a weight update took", LATENCY_BUCKETS),
}
PREFIX = "diffusion_rl_"


def _labels(labels: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, str(v)) for k, v in labels.items()))


def _render_labels(labels: Iterable[tuple[str, str]], extra: str = "") -> str:
    def quote(value: str) -> str:
        return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    parts = [f'{k}="{quote(v)}"' for k, v in labels]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


class Metrics:
    """Prometheus counters and histograms (names in :data:`COUNTERS` / :data:`HISTOGRAMS`,
    exported with the ``diffusion_rl_`` prefix); thread-safe. Gauges (queue depth, weights
    version) are read from the engine when rendered."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[tuple[str, tuple], float] = {}
        self._histograms: dict[tuple[str, tuple], list] = {}

    def count(self, name: str, amount: float = 1, **labels: str) -> None:
        if name not in COUNTERS:
            raise ValueError(f"name: unknown counter {name!r}; known: {sorted(COUNTERS)}")
        key = (name, _labels(labels))
        with self._lock:
            self._counters[key] = self._counters.get(key, 0) + amount

    def observe(self, name: str, value: float, **labels: str) -> None:
        if name not in HISTOGRAMS:
            raise ValueError(f"name: unknown histogram {name!r}; known: {sorted(HISTOGRAMS)}")
        buckets = HISTOGRAMS[name][1]
        key = (name, _labels(labels))
        with self._lock:
            entry = self._histograms.setdefault(key, [[0] * len(buckets), 0.0, 0])
            index = bisect.bisect_left(buckets, value)
            if index < len(buckets):
                entry[0][index] += 1
            entry[1] += value
            entry[2] += 1

    def counter(self, name: str, **labels: str) -> float:
        """A counter's current value (0 if never counted)."""
        with self._lock:
            return self._counters.get((name, _labels(labels)), 0)

    def render(self, gauges: Iterable[tuple[str, str, Mapping[str, str], float]] = ()) -> str:
        """The Prometheus text exposition (format 0.0.4); ``gauges``: (name, help, labels,
        value) tuples added as gauges."""
        lines: list[str] = []
        with self._lock:
            counters = dict(self._counters)
            histograms = {k: (list(v[0]), v[1], v[2]) for k, v in self._histograms.items()}
        for name, help_text in COUNTERS.items():
            lines += [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} counter"]
            rows = [(k[1], v) for k, v in counters.items() if k[0] == name] or [((), 0)]
            lines += [f"{PREFIX}{name}{_render_labels(lab)} {value:g}" for lab, value in rows]
        for name, (help_text, buckets) in HISTOGRAMS.items():
            lines += [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} histogram"]
            for (metric, labels), (counts, total, number) in sorted(histograms.items()):
                if metric != name:
                    continue
                running = 0
                for bound, count in zip(buckets, counts):
                    running += count
                    lab = _render_labels(labels, f'le="{bound:g}"')
                    lines.append(f"{PREFIX}{name}_bucket{lab} {running}")
                inf = _render_labels(labels, 'le="+Inf"')
                lines.append(f"{PREFIX}{name}_bucket{inf} {number}")
                lines.append(f"{PREFIX}{name}_sum{_render_labels(labels)} {total:.6g}")
                lines.append(f"{PREFIX}{name}_count{_render_labels(labels)} {number}")
        seen: set[str] = set()
        for name, help_text, labels, value in gauges:
            if name not in seen:
                lines += [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} gauge"]
                seen.add(name)
            lines.append(f"{PREFIX}{name}{_render_labels(_labels(labels))} {value:g}")
        return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- loading
def load_served_model(
    name: str,
    path: str | Path,
    *,
    dtype: Any = None,
    device: Any = None,
    trust_remote_code: bool = False,
    version: int = 0,
) -> ServedModel:
    """A model directory as a :class:`ServedModel` at ``version``: any directory
    :func:`~diffusion_rl.models.io.load_model` reads (built-in, LLaDA / Dream / SDAR, LoRA,
    a trained pipeline) or a local diffusers pipeline directory (``model_index.json``), each
    verified against its manifest when it has one (:mod:`diffusion_rl.models.manifest`)."""
    from ..models.io import check_finite_weights, load_model

    if (Path(path) / "model_index.json").is_file():
        from ..models.flow_pipelines import flow_directory_kind, load_pipeline_model
        from ..models.manifest import check_model_files, warn_unverified

        pipeline_kind, _ = flow_directory_kind(path)
        verified = check_model_files(path, warn=False)  # an export's manifest, the headers
        model, kind, tokenizer, info = (
            load_pipeline_model(path, pipeline_kind).eval(),
            "flow",
            None,
            {},
        )
        check_finite_weights(model, path)
        if not verified:
            warn_unverified(path)
        if device is not None:
            model = model.to(device)
    else:
        loaded = load_model(path, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
        model, kind, tokenizer, info = loaded.model, loaded.kind, loaded.tokenizer, loaded.info
    checksum = weights_checksum(model_tensors(kind, model))
    return ServedModel(name, kind, model, tokenizer, dict(info), version, checksum)


def load_served_workflow(name: str, source: str | Path) -> ServedModel:
    """A workflow (a YAML file or a built-in name, :func:`~diffusion_rl.workflows.
    load_workflow_spec`) with every stage's model loaded, as a :class:`ServedModel`."""
    from ..tasks.motion import MotionTask
    from ..workflows import Workflow, load_stage_model, load_workflow_spec

    spec, path = load_workflow_spec(source)
    models = {stage.name: load_stage_model(stage) for stage in spec.stages}
    task = MotionTask.from_info(spec.task) if spec.task else None
    workflow = Workflow(spec, models, task=task)
    info = {"workflow": str(path), "stages": [stage.name for stage in spec.stages]}
    checksum = weights_checksum(model_tensors("workflow", workflow))
    return ServedModel(name, "workflow", workflow, None, info, 0, checksum)


# ----------------------------------------------------------------------------- engine
@dataclass(eq=False)
class _Job:
    group: tuple  # (fn, key): only jobs of one group are merged
    fn: Callable
    item: Any
    rows: int
    future: asyncio.Future
    enqueued: float
    running: bool = False


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


@dataclass
class _Lane:
    """One model's queue, worker thread and scheduler state."""

    queue: deque = field(default_factory=deque)
    executor: ThreadPoolExecutor | None = None
    wake: asyncio.Event | None = None
    task: asyncio.Task | None = None
    digests: dict[str, bytes] | None = None  # per-tensor digests, for incremental checksums


class Engine:
    """The served models and their batching scheduler (module docstring).

    Args:
        models: the models to serve (distinct names).
        settings: the batching knobs (``max_queue``, ``max_batch_rows``, ``max_wait_ms``,
            ``request_timeout_s``, ``retry_after_s``).
    """

    def __init__(self, models: Iterable[ServedModel], settings: ServeSettings) -> None:
        self.settings = settings
        self._served: dict[str, ServedModel] = {}
        for served in models:
            if served.name in self._served:
                raise ValueError(f"models: the name {served.name!r} is given twice")
            self._served[served.name] = served
        if not self._served:
            raise ValueError("models: expected at least one model to serve")
        self._lanes = {name: _Lane() for name in self._served}
        self._depth = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self.metrics = Metrics()
        self.started = time.time()

    # ------------------------------------------------------------------ models
    def get(self, name: str) -> ServedModel:
        """The current :class:`ServedModel` named ``name``; RequestError 404 if unknown."""
        served = self._served.get(name) if isinstance(name, str) else None
        if served is None:
            raise RequestError(
                404,
                f"model: {name!r} is not served here; served models: {self.names()} "
                "(GET /v1/models lists them)",
                param="model",
                code="model_not_found",
            )
        return served

    def names(self) -> list[str]:
        return list(self._served)

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the schedulers run on (None before :meth:`start`)."""
        return self._loop

    @property
    def queue_depth(self) -> int:
        """Items waiting (not yet running), over all models."""
        return self._depth

    def gauges(self) -> list[tuple[str, str, dict, float]]:
        """The engine's gauges for :meth:`Metrics.render`."""
        rows = [("queue_depth", "items waiting, all models", {}, self._depth)]
        for name, served in self._served.items():
            waiting = sum(not job.running for job in self._lanes[name].queue)
            rows.append(("model_queue_depth", "items waiting, per model", {"model": name}, waiting))
            rows.append(
                ("weights_version", "weights version served", {"model": name}, served.version)
            )
        return rows

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start the schedulers on the running loop (:meth:`run` calls it when needed)."""
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        if self._loop is not None:
            raise RuntimeError("Engine.start: this engine already runs on another event loop")
        self._loop = loop
        for name, lane in self._lanes.items():
            lane.executor = ThreadPoolExecutor(1, thread_name_prefix=f"serve-{name}")
            lane.wake = asyncio.Event()
            lane.task = loop.create_task(self._schedule(name), name=f"schedule-{name}")

    async def stop(self) -> None:
        """Stop the schedulers; items still queued fail with 503."""
        for lane in self._lanes.values():
            if lane.task is not None:
                lane.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await lane.task
            for job in lane.queue:
                if not job.future.done():
                    job.future.set_exception(RequestError(503, "the server is shutting down"))
            lane.queue.clear()
            if lane.executor is not None:
                lane.executor.shutdown(wait=True)
        self._depth = 0
        self._loop = None

    # ------------------------------------------------------------------ batching
    async def run(
        self,
        name: str,
        key: Hashable,
        item: Any,
        fn: Callable[[ServedModel, list[Any]], list[Any]],
    ) -> tuple[Any, ServedModel]:
        """Queue ``item`` for model ``name`` and wait for its result (module docstring).

        Items with equal ``(name, key)`` (and the same ``fn``) that arrive within
        ``max_wait_ms`` are merged (up to ``max_batch_rows`` rows); ``fn(served, items)``
        runs in the model's worker thread on the ServedModel current when the batch started
        and returns one result per item. If a merged batch raises, each item is retried
        alone. Full queue -> RequestError(503) with ``Retry-After``; waiting past
        ``request_timeout_s`` -> 504; a cancelled caller drops its item. Returns
        ``(result, served)``."""
        self.get(name)
        await self.start()
        settings = self.settings
        if self._depth >= settings.max_queue:
            self.metrics.count("rejected_total", model=name)
            raise busy(
                f"the request queue is full ({settings.max_queue} waiting)",
                "queue_full",
                settings.retry_after_s,
            )
        rows = getattr(item, "rows", 1)
        rows = rows if isinstance(rows, int) and rows > 0 else 1
        loop = asyncio.get_running_loop()
        job = _Job((fn, key), fn, item, rows, loop.create_future(), loop.time())
        job.future.add_done_callback(_retrieve)  # no "never retrieved" warning once abandoned
        lane = self._lanes[name]
        lane.queue.append(job)
        self._depth += 1
        lane.wake.set()
        try:
            return await asyncio.wait_for(asyncio.shield(job.future), settings.request_timeout_s)
        except asyncio.TimeoutError:
            self._drop(lane, job)
            self.metrics.count("timeouts_total", model=name)
            raise RequestError(
                504,
                f"the request waited more than request_timeout_s={settings.request_timeout_s:g} s",
                code="timeout",
            ) from None
        except asyncio.CancelledError:
            if self._drop(lane, job):
                self.metrics.count("cancelled_total", model=name)
            raise

    def _drop(self, lane: _Lane, job: _Job) -> bool:
        """Remove a job that has not started; whether it was still waiting."""
        if job.running or job not in lane.queue:
            return False
        lane.queue.remove(job)
        self._depth -= 1
        if not job.future.done():
            job.future.cancel()
        return True

    def _take(self, lane: _Lane, group: tuple) -> list[_Job]:
        """The oldest jobs of ``group``, up to ``max_batch_rows`` rows (the first always)."""
        limit, taken, rows = self.settings.max_batch_rows, [], 0
        for job in list(lane.queue):
            if job.group != group:
                continue
            if taken and rows + job.rows > limit:
                break
            lane.queue.remove(job)
            self._depth -= 1
            if job.future.done():  # cancelled while waiting
                continue
            job.running = True
            taken.append(job)
            rows += job.rows
        return taken

    async def _schedule(self, name: str) -> None:
        lane, loop = self._lanes[name], asyncio.get_running_loop()
        wait_s = self.settings.max_wait_ms / 1000.0
        while True:
            while not lane.queue:
                lane.wake.clear()
                await lane.wake.wait()
            head = lane.queue[0]
            deadline = head.enqueued + wait_s
            while lane.queue and lane.queue[0] is head:
                rows = sum(job.rows for job in lane.queue if job.group == head.group)
                remaining = deadline - loop.time()
                if rows >= self.settings.max_batch_rows or remaining <= 0:
                    break
                lane.wake.clear()
                try:
                    await asyncio.wait_for(lane.wake.wait(), remaining)
                except asyncio.TimeoutError:
                    break
            if not lane.queue or lane.queue[0] is not head:
                continue  # the head left (cancelled or timed out): start over
            batch = self._take(lane, head.group)
            if not batch:
                continue
            started = loop.time()
            for job in batch:
                self.metrics.observe("queue_wait_seconds", started - job.enqueued, model=name)
            try:
                served, outcomes = await loop.run_in_executor(
                    lane.executor, self._run_batch, name, head.fn, [job.item for job in batch]
                )
            except Exception as error:  # noqa: BLE001 (the engine's own failure: fail the batch)
                served, outcomes = None, [error] * len(batch)
            self.metrics.count("batches_total", model=name)
            self.metrics.observe("batch_rows", sum(job.rows for job in batch), model=name)
            self.metrics.observe("batch_seconds", loop.time() - started, model=name)
            for job, outcome in zip(batch, outcomes):
                if job.future.done():
                    continue
                if isinstance(outcome, BaseException):
                    job.future.set_exception(outcome)
                else:
                    job.future.set_result((outcome, served))

    def _run_batch(self, name: str, fn: Callable, items: list) -> tuple[ServedModel, list]:
        """In the worker thread: ``fn`` on the current ServedModel; a merged batch that
        raises is retried item by item on the same one. One outcome (result or exception)
        per item."""
        served = self._served[name]
        try:
            results = list(fn(served, items))
            if len(results) != len(items):
                raise RuntimeError(
                    f"the batch function returned {len(results)} results for {len(items)} items"
                )
            return served, results
        except Exception as error:  # noqa: BLE001 (retried alone below)
            if len(items) == 1:
                return served, [error]
        self.metrics.count("batch_retries_total", model=name)
        outcomes: list = []
        for item in items:
            try:
                (result,) = fn(served, [item])
                outcomes.append(result)
            except Exception as error:  # noqa: BLE001 (this item's own failure)
                outcomes.append(error)
        return served, outcomes

    # ------------------------------------------------------------------ weight updates
    async def update_weights(
        self,
        name: str,
        *,
        directory: str | None = None,
        state_dict: dict[str, torch.Tensor] | None = None,
        version: int | None = None,
    ) -> ServedModel:
        """A new weights version of model ``name``: from a model ``directory`` or a trainer
        checkpoint directory (``checkpoints/step_N``, verified against its manifest, its
        tensors applied as a ``state_dict``; both already confined by the caller:
        :func:`~diffusion_rl.serving.app.confined_directory`) or from
        ``state_dict`` (a subset of the model's tensors, same names, shapes and dtypes; all
        are checked before any is copied). Runs in the model's worker between batches
        (module docstring). ``version``: the new version number (> the current one; default
        current + 1). Returns the new ServedModel."""
        current = self.get(name)
        if (directory is None) == (state_dict is None):
            raise RequestError(
                400, "give exactly one of directory and a tensors body", param="directory"
            )
        if version is not None and version <= current.version:
            raise RequestError(
                409,
                f"version: {version} is not above the served version {current.version}; "
                "versions only increase",
                param="version",
                code="version_conflict",
            )
        await self.start()
        lane, loop = self._lanes[name], asyncio.get_running_loop()
        started = time.perf_counter()
        served = await loop.run_in_executor(
            lane.executor, self._apply_update, name, directory, state_dict, version
        )
        self.metrics.count("weight_updates_total", model=name)
        self.metrics.observe("weight_update_seconds", time.perf_counter() - started, model=name)
        return served

    def _apply_update(self, name, directory, state_dict, version) -> ServedModel:
        current = self._served[name]
        lane = self._lanes[name]
        new_version = current.version + 1 if version is None else version
        if new_version <= current.version:  # another update landed first
            raise RequestError(
                409,
                f"version: {new_version} is not above the served version {current.version}",
                param="version",
                code="version_conflict",
            )
        if directory is not None and is_training_checkpoint(directory):
            state_dict, directory = checkpoint_tensors(directory), None
        if directory is not None:
            if current.kind == "workflow":
                raise RequestError(
                    400,
                    "directory: a workflow is updated from tensors named STAGE.KEY (a "
                    "safetensors body), not from a directory",
                    param="directory",
                )
            loaded = load_update_directory(name, directory, new_version)
            if loaded.kind != current.kind:
                raise RequestError(
                    400,
                    f"directory: holds a {loaded.kind} model; {name!r} serves a {current.kind} "
                    "model",
                    param="directory",
                )
            lane.digests = None
            self._served[name] = loaded
            return loaded
        from ..models.manifest import non_finite

        tensors = model_tensors(current.kind, current.model)
        for key, value in state_dict.items():
            target = tensors.get(key)
            if target is None:
                close = [k for k in tensors if k.endswith(key.rsplit(".", 1)[-1])][:3]
                hint = f" (similar: {close})" if close else ""
                raise RequestError(
                    400,
                    f"tensors: {key!r} is not a tensor of {name!r}{hint}; send the served "
                    "model's own state_dict names",
                    param="tensors",
                )
            if tuple(value.shape) != tuple(target.shape) or value.dtype != target.dtype:
                raise RequestError(
                    400,
                    f"tensors: {key!r} is {value.dtype} {tuple(value.shape)}, the model's is "
                    f"{target.dtype} {tuple(target.shape)}",
                    param="tensors",
                )
            problem = non_finite(value)
            if problem is not None:
                raise RequestError(
                    400,
                    f"tensors: {key!r} holds {problem}; send finite weights (a diverged "
                    "trainer's are refused)",
                    param="tensors",
                )
        if lane.digests is None:
            lane.digests = {k: tensor_digest(k, v) for k, v in tensors.items()}
        with torch.no_grad():
            for key, value in state_dict.items():
                tensors[key].copy_(value)
        # every name whose storage an update wrote (tied weights share one) is rehashed
        written = {tensors[key].untyped_storage().data_ptr() for key in state_dict}
        for key, tensor in tensors.items():
            if key in state_dict or tensor.untyped_storage().data_ptr() in written:
                lane.digests[key] = tensor_digest(key, tensor)
        updated = replace(current, version=new_version, checksum=combine_digests(lane.digests))
        self._served[name] = updated
        return updated
