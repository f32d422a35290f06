"""Training logs: a JSON-lines file (always), TensorBoard and Weights & Biases (optional), a
progress bar.

``out_dir/metrics.jsonl`` gets one line per :meth:`MetricsLogger.log` call,
``{"step": int, "time": unix_seconds, <metric>: float | null, ...}``, written and flushed at
once so a killed run keeps every logged step. Non-finite values are written as ``null`` so
every line is strict JSON.

Invariants:

* Each metric is logged once per step under one name: logging a key twice for the same step
  in one session raises ``ValueError``.
* Every line is complete: the file is appended to only after :func:`truncate_metrics` has cut
  it back to the lines that belong to the restored state (a resumed run passes the line count
  its checkpoint recorded, :attr:`MetricsLogger.lines` at save time), so a run killed and
  resumed any number of times has each step once, in order.
* TensorBoard: one stream per run. A resumed run opens its writer with
  ``purge_step = resumed step + 1``, so TensorBoard hides what an earlier session logged after
  the checkpoint; :meth:`MetricsLogger.flush` (called before every checkpoint) puts every
  event of the checkpointed steps on disk.
* Weights & Biases (:class:`WandbLogger`): one run per output directory, its id kept in
  ``out_dir/wandb_run_id`` and reused with ``resume="allow"``; steps it already holds are not
  logged again (wandb keeps steps monotonic).
* Progress bars draw only on a terminal: on a non-TTY stderr (a log file, CI) they are
  disabled, so logs hold no carriage-return redraws; ``DIFFUSION_RL_NO_PROGRESS=1`` disables
  them everywhere.
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tqdm import tqdm

__all__ = [
    "MetricsLogger",
    "WandbLogger",
    "atomic_write_text",
    "fsync_directory",
    "progress",
    "truncate_metrics",
]

_INSTALL_HINT = "pip install 'diffusion-rl[tracking]'"
_RESERVED = ("step", "time")
METRICS_FILE = "metrics.jsonl"
WANDB_ID_FILE = "wandb_run_id"


def _import_summary_writer() -> Any:
    """``torch.utils.tensorboard.SummaryWriter``; raises ImportError without tensorboard."""
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter


def _import_wandb() -> Any:
    """The ``wandb`` module; raises ImportError with the install command without it."""
    try:
        import wandb
    except ImportError as error:
        raise ImportError(
            f"wandb_project is set, which needs the wandb package: pip install wandb ({error})"
        ) from error
    return wandb


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Replace ``path`` by ``text`` atomically: a temporary sibling ``.NAME.tmp-*``, fsynced,
    then ``os.replace``; a kill leaves the old file or the new one, never a mix."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_directory(path.parent)


def fsync_directory(path: str | os.PathLike) -> None:
    """fsync a directory, so that the renames inside it are on disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def truncate_metrics(
    path: str | os.PathLike, keep_lines: int | None = None, *, through_step: int | None = None
) -> int:
    """Cut a ``metrics.jsonl`` back to the lines of a restored state; return how many lines
    were removed (0 when the file is absent or already right).

    ``keep_lines``: keep the first ``keep_lines`` complete lines (the count a checkpoint
    recorded; 0 empties the file). Without it, ``through_step``: keep the lines whose
    ``step`` is at most ``through_step``. A trailing line without its newline (a write cut
    short) is always removed. The file is rewritten atomically.
    """
    path = Path(path)
    if keep_lines is None and through_step is None:
        raise TypeError("truncate_metrics: give keep_lines or through_step")
    if keep_lines is not None and keep_lines < 0:
        raise ValueError(f"keep_lines: expected an int >= 0, got {keep_lines!r}")
    if not path.is_file():
        return 0
    *complete, partial = path.read_text(encoding="utf-8").split("\n")
    if keep_lines is not None:
        kept = complete[:keep_lines]
    else:
        kept = [line for line in complete if _step_of(line) <= through_step]
    removed = len(complete) - len(kept) + (1 if partial else 0)
    if removed:
        atomic_write_text(path, "".join(line + "\n" for line in kept))
    return removed


def _step_of(line: str) -> float:
    """The ``step`` of a metrics line; an unreadable line sorts after every step."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return math.inf


def _count_lines(path: Path) -> int:
    if not path.is_file():
        return 0
    with open(path, "rb") as handle:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: handle.read(1 << 20), b""))


class WandbLogger:
    """Scalars and images to a Weights & Biases run (``wandb`` is imported here, lazily).

    ``project``: the wandb project; ``out_dir``: the run's output directory (wandb's files go
    to ``out_dir/wandb``; the run id is kept in ``out_dir/wandb_run_id`` so a resumed run
    continues the same wandb run); ``config``: the run config, recorded with the run.
    Raises ``ImportError`` naming ``pip install wandb`` when the package is missing.
    """

    def __init__(self, project: str, out_dir: str | os.PathLike, config: Mapping[str, Any]) -> None:
        self._wandb = wandb = _import_wandb()
        out = Path(out_dir)
        id_file = out / WANDB_ID_FILE
        if id_file.is_file() and id_file.read_text(encoding="utf-8").strip():
            run_id = id_file.read_text(encoding="utf-8").strip()
        else:
            run_id = uuid.uuid4().hex[:12]
            atomic_write_text(id_file, run_id + "\n")
        self.run_id = run_id
        self._run = wandb.init(
            project=project,
            name=out.name,
            id=run_id,
            resume="allow",
            dir=str(out),
            config=dict(config),
        )

    def log(self, step: int, metrics: Mapping[str, float | None]) -> None:
        self._run.log(dict(metrics), step=int(step))

    def log_images(self, step: int, images: Mapping[str, Path]) -> None:
        self._run.log({tag: self._wandb.Image(str(p)) for tag, p in images.items()}, step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


class MetricsLogger:
    """Append metrics to ``out_dir/metrics.jsonl`` and, optionally, TensorBoard and wandb.

    ``tensorboard``: ``None`` uses TensorBoard when it is importable, ``True`` requires it
    (``ImportError`` with the install command otherwise), ``False`` never uses it. Event
    files go to ``out_dir/tensorboard``; ``purge_step`` (a resumed run: its step + 1) hides
    the events earlier sessions logged at that step or later. ``wandb``: a
    :class:`WandbLogger` that receives the same scalars and images (closed with this
    logger). Usable as a context manager; :meth:`close` is idempotent.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        tensorboard: bool | None = None,
        *,
        purge_step: int | None = None,
        wandb: WandbLogger | None = None,
    ) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / METRICS_FILE
        self._writer = None
        self._wandb = wandb
        if tensorboard is not False:
            try:
                summary_writer = _import_summary_writer()
            except ImportError as error:
                if tensorboard:
                    raise ImportError(
                        f"MetricsLogger(tensorboard=True) needs the tensorboard package: "
                        f"{_INSTALL_HINT} ({error})"
                    ) from error
            else:
                self._writer = summary_writer(
                    log_dir=str(self.out_dir / "tensorboard"), purge_step=purge_step
                )
        self.lines = _count_lines(self.path)  # lines in the file: kept ones plus ours
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._step: int | None = None
        self._keys_at_step: set[str] = set()

    @property
    def tensorboard_enabled(self) -> bool:
        return self._writer is not None

    def _claim(self, step: int, keys: list[str]) -> None:
        """Refuse a key logged before for this ``step`` (one value per metric and step)."""
        if self._file.closed:
            raise RuntimeError(f"MetricsLogger({self.out_dir}): log() after close()")
        if step != self._step:
            self._step, self._keys_at_step = step, set()
        twice = sorted(set(keys) & self._keys_at_step)
        if twice:
            raise ValueError(
                f"metric {twice[0]!r}: logged twice for step {step}; log each metric once "
                "per step under one name"
            )
        self._keys_at_step.update(keys)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Write one line for ``step``; values must convert with ``float()``."""
        step = int(step)
        for key in metrics:
            if key in _RESERVED:
                raise ValueError(f"metric {key!r}: the name is reserved by the metrics log")
        self._claim(step, list(metrics))
        numbers = {key: float(value) for key, value in metrics.items()}
        record: dict[str, Any] = {"step": step, "time": time.time()}
        record.update({k: v if math.isfinite(v) else None for k, v in numbers.items()})
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        self.lines += 1
        if self._writer is not None:
            for key, number in numbers.items():
                self._writer.add_scalar(key, number, step)
        if self._wandb is not None:
            self._wandb.log(step, numbers)

    def log_images(self, step: int, images: Mapping[str, str | os.PathLike]) -> None:
        """Log image files (PNGs: e.g. the sample grids of an evaluation) under their tags,
        to TensorBoard and wandb (``metrics.jsonl`` holds numbers only)."""
        step = int(step)
        paths = {tag: Path(path) for tag, path in images.items()}
        for tag, path in paths.items():
            if not path.is_file():
                raise FileNotFoundError(f"image {tag!r}: {path} does not exist")
        self._claim(step, list(paths))
        if self._writer is not None:
            import numpy as np
            from PIL import Image

            for tag, path in paths.items():
                with Image.open(path) as image:
                    pixels = np.asarray(image.convert("RGB"))
                self._writer.add_image(tag, pixels, step, dataformats="HWC")
        if self._wandb is not None:
            self._wandb.log_images(step, paths)

    def flush(self) -> None:
        """Put everything logged so far on disk (TensorBoard buffers its events)."""
        if not self._file.closed:
            self._file.flush()
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def progress(total: int | None, desc: str, disable: bool = False) -> tqdm:
    """A tqdm bar over ``total`` steps (shows rate and ETA) on stderr.

    Disabled when ``disable`` is true (the processes other than rank 0), when stderr is not a
    terminal (no carriage-return redraws in log files) and when the environment variable
    ``DIFFUSION_RL_NO_PROGRESS`` is ``"1"``.
    """
    disable = True if disable or os.environ.get("DIFFUSION_RL_NO_PROGRESS") == "1" else None
    return tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True, disable=disable)
