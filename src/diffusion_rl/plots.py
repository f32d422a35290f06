"""Pictures of a run: learning curves from ``metrics.jsonl`` and sample-image grids, as PNGs."""

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
    return plot_curve_groups(metrics_path, png_path, {key: [key] for key in keys}, title)


def plot_curve_groups(
    metrics_path: str | Path,
    png_path: str | Path,
    groups: dict[str, list[str]],
    title: str = "",
) -> Path:
    """One panel per group (its title → the keys drawn in it, one line each, labelled by the
    key's last part); keys absent from the log are skipped, and so is a group with none."""
    records = read_metrics(metrics_path)
    present = {
        name: [k for k in keys if any(r.get(k) is not None for r in records)]
        for name, keys in groups.items()
    }
    present = {name: keys for name, keys in present.items() if keys}
    if not present:
        raise ValueError(f"{metrics_path}: none of {sorted(groups)} was logged")
    fig, axes = plt.subplots(1, len(present), figsize=(4.6 * len(present), 3.4), squeeze=False)
    for ax, (name, keys) in zip(axes[0], present.items()):
        for key in keys:
            points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            steps, values = zip(*points)
            marker = "o" if len(points) < 30 else None
            ax.plot(steps, values, marker=marker, linewidth=1.5, label=key.rsplit("/", 1)[-1])
        ax.set_xlabel("step")
        ax.set_title(name)
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    png_path = Path(png_path)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path


def save_image_grid(
    images,
    path: str | Path,
    nrow: int = 8,
    captions: list[str] | None = None,
    upscale: int = 4,
    padding: int = 2,
) -> Path:
    """Write ``images`` (float ``[N, 3, H, W]`` in ``[0, 1]``) as one PNG grid.

    Tiles are enlarged ``upscale`` times by nearest-neighbour (pixels stay sharp), laid out
    ``nrow`` per row on a white sheet with ``padding`` pixels between them; each caption (one
    per image, optional) is word-wrapped in black under its tile. Returns ``path``.
    """
    import numpy as np
    import torch
    from PIL import Image, ImageDraw, ImageFont

    if not isinstance(images, torch.Tensor) or images.dim() != 4 or images.shape[1] != 3:
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise ValueError(f"images: expected a tensor [N, 3, H, W] in [0, 1], got {shape}")
    if nrow < 1 or upscale < 1 or padding < 0:
        raise ValueError(
            f"save_image_grid: need nrow >= 1, upscale >= 1, padding >= 0; got nrow={nrow}, "
            f"upscale={upscale}, padding={padding}"
        )
    count, _, height, width = images.shape
    if captions is not None and len(captions) != count:
        raise ValueError(f"captions: expected {count} (one per image), got {len(captions)}")
    pixels = (images.detach().float().cpu().clamp(0, 1) * 255).round().to(torch.uint8)
    tile_w, tile_h = width * upscale, height * upscale
    font = ImageFont.load_default()
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    line_h = measure.textbbox((0, 0), "Ag", font=font)[3] + 2

    def wrap(text: str) -> list[str]:
        lines, current = [], ""
        for word in text.split():
            trial = f"{current} {word}".strip()
            if current and measure.textlength(trial, font=font) > tile_w:
                lines.append(current)
                current = word
            else:
                current = trial
        return lines + ([current] if current else [])

    wrapped = [wrap(c) for c in captions] if captions is not None else [[] for _ in range(count)]
    caption_h = max((len(lines) for lines in wrapped), default=0) * line_h
    cols = min(nrow, max(count, 1))
    rows = max(1, -(-count // nrow))
    cell_w, cell_h = tile_w + padding, tile_h + caption_h + padding
    sheet = Image.new("RGB", (cols * cell_w + padding, rows * cell_h + padding), "white")
    draw = ImageDraw.Draw(sheet)
    for index in range(count):
        x = padding + (index % nrow) * cell_w
        y = padding + (index // nrow) * cell_h
        tile = Image.fromarray(np.ascontiguousarray(pixels[index].permute(1, 2, 0).numpy()))
        sheet.paste(tile.resize((tile_w, tile_h), Image.NEAREST), (x, y))
        for k, line in enumerate(wrapped[index]):
            draw.text((x, y + tile_h + k * line_h), line, fill="black", font=font)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(path, format="PNG")
    return path


def plot_loss_and_accuracy(
    metrics_path: Path,
    png_path: Path,
    history: list[dict],
    loss_keys: list[str],
    *,
    reference: tuple[str, float] | None = None,
    title: str = "",
) -> Path:
    """Two panels: the ``loss_keys`` per step, and held-out accuracy of the ``history``
    against a ``(label, accuracy)`` reference line (e.g. a distillation teacher)."""
    records = read_metrics(metrics_path)
    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(9.5, 3.4))
    for key in loss_keys:
        points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        if points:
            loss_ax.plot(*zip(*points), linewidth=1.2, label=key.split("/")[-1])
    loss_ax.set(xlabel="step", title="loss")
    loss_ax.legend()
    loss_ax.grid(alpha=0.3)
    acc_ax.plot([h["step"] for h in history], [h["accuracy"] for h in history], marker="o")
    if reference is not None:
        acc_ax.axhline(reference[1], color="black", linestyle="--", label=reference[0])
        acc_ax.legend()
    acc_ax.set(xlabel="step", ylim=(0, 1.02), title="held-out accuracy")
    acc_ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return Path(png_path)


# ---------------------------------------------------------------------------- video previews
_SEPARATOR = 1  # white pixels between frames / clips and around the sheet
_CAPTION_MARGIN = 4


def _video_pixels(clips, owner: str, upscale: int):
    """``clips`` float ``[B, F, 3, H, W]`` in ``[0, 1]`` as uint8 ``[B, F, H*u, W*u, 3]``
    (rounded, nearest-neighbour enlarged ``upscale`` times)."""
    import torch

    if not isinstance(clips, torch.Tensor) or clips.dim() != 5 or clips.shape[2] != 3:
        shape = tuple(clips.shape) if isinstance(clips, torch.Tensor) else type(clips).__name__
        raise ValueError(
            f"{owner}: clips: expected a tensor [B, F, 3, H, W] in [0, 1], got {shape}"
        )
    if clips.shape[0] < 1 or clips.shape[1] < 1:
        raise ValueError(f"{owner}: clips: expected at least one clip and one frame, got none")
    if isinstance(upscale, bool) or not isinstance(upscale, int) or upscale < 1:
        raise ValueError(f"{owner}: upscale: expected an int >= 1, got {upscale!r}")
    pixels = (clips.detach().float().cpu().clamp(0, 1) * 255).round().to(torch.uint8)
    pixels = pixels.permute(0, 1, 3, 4, 2).repeat_interleave(upscale, 2)
    return pixels.repeat_interleave(upscale, 3).numpy()


def save_video_strip(clips, path: str | Path, captions: list[str] | None = None, upscale: int = 6):
    """Write ``clips`` (float ``[B, F, 3, H, W]`` in ``[0, 1]``) as one PNG of frame strips.

    One row per clip, its frames left to right; every frame is enlarged ``upscale`` times by
    nearest-neighbour and framed by 1-pixel white separators, so frame ``t`` of clip ``b``
    starts at ``(1 + t * (W*u + 1), 1 + b * (row_h + 1))`` where ``row_h = H*u`` (with
    captions, at least one text line). Captions (one per clip, optional) go in a column on the
    right, in black, one line each. Returns ``path``.
    """
    import numpy as np
    from PIL import Image, ImageDraw, ImageFont

    pixels = _video_pixels(clips, "save_video_strip", upscale)
    count, frames, tile_h, tile_w, _ = pixels.shape
    if captions is not None and len(captions) != count:
        raise ValueError(f"captions: expected {count} (one per clip), got {len(captions)}")
    font = ImageFont.load_default()
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    caption_w, row_h = 0, tile_h
    if captions is not None:
        widths = [measure.textlength(c, font=font) for c in captions]
        caption_w = int(np.ceil(max(widths))) + 2 * _CAPTION_MARGIN
        row_h = max(tile_h, measure.textbbox((0, 0), "Ag", font=font)[3] + 2)
    strip_w = frames * (tile_w + _SEPARATOR) + _SEPARATOR
    sheet = Image.new("RGB", (strip_w + caption_w, count * (row_h + _SEPARATOR) + _SEPARATOR))
    sheet.paste("white", (0, 0, *sheet.size))
    draw = ImageDraw.Draw(sheet)
    for b in range(count):
        y = _SEPARATOR + b * (row_h + _SEPARATOR)
        for t in range(frames):
            x = _SEPARATOR + t * (tile_w + _SEPARATOR)
            sheet.paste(Image.fromarray(np.ascontiguousarray(pixels[b, t])), (x, y))
        if captions is not None:
            draw.text((strip_w + _CAPTION_MARGIN, y), captions[b], fill="black", font=font)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(path, format="PNG")
    return path


def save_video_gif(
    clips, path: str | Path, nrow: int = 8, upscale: int = 6, frame_ms: int = 250
) -> Path:
    """Write ``clips`` (float ``[B, F, 3, H, W]`` in ``[0, 1]``) as one animated GIF.

    GIF frame ``t`` is a grid of every clip's frame ``t`` (``nrow`` clips per row, each
    enlarged ``upscale`` times by nearest-neighbour, 1-pixel white separators: tile ``b`` starts
    at ``(1 + (b % nrow) * (W*u + 1), 1 + (b // nrow) * (H*u + 1))``); it shows ``frame_ms``
    milliseconds (stored in 10 ms units) and the animation loops forever. One palette serves
    every frame: exact when the sheets hold at most 256 distinct colours, white separators
    included (e.g. palette renders), otherwise a median-cut palette of all frames. GIF writers merge
    consecutive identical frames (a still clip reads back as fewer frames). Returns ``path``.
    """
    import numpy as np
    from PIL import Image

    pixels = _video_pixels(clips, "save_video_gif", upscale)
    if isinstance(nrow, bool) or not isinstance(nrow, int) or nrow < 1:
        raise ValueError(f"save_video_gif: nrow: expected an int >= 1, got {nrow!r}")
    if isinstance(frame_ms, bool) or not isinstance(frame_ms, int) or frame_ms < 10:
        raise ValueError(f"save_video_gif: frame_ms: expected an int >= 10, got {frame_ms!r}")
    count, frames, tile_h, tile_w, _ = pixels.shape
    cols, rows = min(nrow, count), -(-count // nrow)
    sheets = np.full(
        (
            frames,
            rows * (tile_h + _SEPARATOR) + _SEPARATOR,
            cols * (tile_w + _SEPARATOR) + _SEPARATOR,
            3,
        ),
        255,
        dtype=np.uint8,
    )
    for b in range(count):
        y = _SEPARATOR + (b // nrow) * (tile_h + _SEPARATOR)
        x = _SEPARATOR + (b % nrow) * (tile_w + _SEPARATOR)
        sheets[:, y : y + tile_h, x : x + tile_w] = pixels[b]
    colours, index = np.unique(sheets.reshape(-1, 3), axis=0, return_inverse=True)
    if len(colours) <= 256:
        palette = colours.astype(np.uint8)
        indexed = index.reshape(sheets.shape[:3]).astype(np.uint8)
        size = (sheets.shape[2], sheets.shape[1])
        images = [Image.frombytes("P", size, frame.tobytes()) for frame in indexed]
        for image in images:
            image.putpalette(palette.ravel().tolist())
    else:
        mosaic = Image.fromarray(sheets.reshape(-1, sheets.shape[2], 3))
        shared = mosaic.quantize(256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
        images = [
            Image.fromarray(frame).quantize(palette=shared, dither=Image.Dither.NONE)
            for frame in sheets
        ]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    images[0].save(
        path,
        format="GIF",
        save_all=True,
        append_images=images[1:],
        duration=frame_ms,
        loop=0,
        optimize=False,
    )
    return path
