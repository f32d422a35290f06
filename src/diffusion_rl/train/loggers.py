"""Training logs: a JSON-lines file (always), TensorBoard scalars (optional), a progress bar.

``out_dir/metrics.jsonl`` gets one line per :meth:`MetricsLogger.log` call,
``{"step": int, "time": unix_seconds, <metric>: float | null, ...}``, flushed at once so a
crashed run keeps every logged step. Non-finite values are written as ``null`` so every line
is strict JSON. The file is appended to, so a resumed run continues the same log.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tqdm import tqdm

__all__ = ["MetricsLogger", "progress"]

_INSTALL_HINT = "pip install 'diffusion-rl[tracking]'"
_RESERVED = ("step", "time")


def _import_summary_writer() -> Any:
    """``torch.utils.tensorboard.SummaryWriter``; raises ImportError without tensorboard."""
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter


class MetricsLogger:
    """Append metrics to ``out_dir/metrics.jsonl`` and, optionally, TensorBoard.

    ``tensorboard``: ``None`` uses TensorBoard when it is importable, ``True`` requires it
    (``ImportError`` with the install command otherwise), ``False`` never uses it. Event
    files go to ``out_dir/tensorboard``. Usable as a context manager; :meth:`close` is
    idempotent.
    """

    def __init__(self, out_dir: str | os.PathLike, tensorboard: bool | None = None) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / "metrics.jsonl"
        self._writer = None
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
                self._writer = summary_writer(log_dir=str(self.out_dir / "tensorboard"))
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    @property
    def tensorboard_enabled(self) -> bool:
        return self._writer is not None

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Write one line for ``step``; values must convert with ``float()``."""
        if self._file.closed:
            raise RuntimeError(f"MetricsLogger({self.out_dir}): log() after close()")
        record: dict[str, Any] = {"step": int(step), "time": time.time()}
        for key, value in metrics.items():
            if key in _RESERVED:
                raise ValueError(f"metric {key!r}: the name is reserved by the metrics log")
            number = float(value)
            record[key] = number if math.isfinite(number) else None
            if self._writer is not None:
                self._writer.add_scalar(key, number, int(step))
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def progress(total: int | None, desc: str) -> tqdm:
    """A tqdm bar over ``total`` steps (shows rate and ETA).

    Disabled when the environment variable ``DIFFUSION_RL_NO_PROGRESS`` is ``"1"``.
    """
    disable = os.environ.get("DIFFUSION_RL_NO_PROGRESS") == "1"
    return tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True, disable=disable)
