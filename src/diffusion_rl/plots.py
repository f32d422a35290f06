"""Pictures of a run: learning curves from ``metrics.jsonl`` as a PNG."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt  # noqa: E402


def read_metrics(path: str | Path) -> list[dict]:
    lines = Path(path).read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def plot_curves(
    metrics_path: str | Path, png_path: str | Path, keys: list[str], title: str = ""
) -> Path:
    """One panel per key in ``keys`` (value vs step); keys absent from the log are skipped."""
    records = read_metrics(metrics_path)
    present = [k for k in keys if any(r.get(k) is not None for r in records)]
    if not present:
        raise ValueError(f"{metrics_path}: none of {keys} was logged")
    fig, axes = plt.subplots(1, len(present), figsize=(4.2 * len(present), 3.2), squeeze=False)
    for ax, key in zip(axes[0], present):
        points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        steps, values = zip(*points)
        ax.plot(steps, values, marker="o" if len(points) < 30 else None, linewidth=1.5)
        ax.set_xlabel("step")
        ax.set_title(key)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    png_path = Path(png_path)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path
