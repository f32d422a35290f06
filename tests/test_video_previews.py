"""Tests of the video previews: PNG frame strips and animated GIF grids, read back with PIL."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image, ImageSequence

from diffusion_rl.plots import save_video_gif, save_video_strip
from diffusion_rl.tasks.motion import MotionConfig, MotionTask

TASK = MotionTask(MotionConfig())  # 16 px, 4 frames
PROMPTS = [
    "a red circle moving left fast",
    "a green square moving up slowly",
    "a yellow triangle moving right fast",
]
CLIPS = TASK.render_batch(PROMPTS, [0, 1, 2])  # [3, 4, 3, 16, 16]


def tile(sheet: Image.Image, x: int, y: int, size: int) -> torch.Tensor:
    """The ``size``-square crop at ``(x, y)`` of ``sheet`` as float ``[3, size, size]``."""
    crop = np.array(sheet.convert("RGB").crop((x, y, x + size, y + size)))
    return torch.from_numpy(crop).permute(2, 0, 1).float() / 255


def enlarged(frame: torch.Tensor, factor: int) -> torch.Tensor:
    return frame.repeat_interleave(factor, 1).repeat_interleave(factor, 2)


def test_video_strip_lays_out_every_frame_exactly(tmp_path):
    path = save_video_strip(CLIPS, tmp_path / "previews" / "strip.png", upscale=2)
    assert path == tmp_path / "previews" / "strip.png"
    sheet = Image.open(path)
    assert sheet.format == "PNG" and sheet.size == (4 * (32 + 1) + 1, 3 * (32 + 1) + 1)
    for b in range(3):
        for t in range(4):
            got = tile(sheet, 1 + t * 33, 1 + b * 33, 32)
            assert torch.equal(got, enlarged(CLIPS[b, t], 2)), (b, t)
    pixels = np.array(sheet)
    for x in range(0, sheet.size[0], 33):  # separator columns and rows are white
        assert (pixels[:, x] == 255).all()
    for y in range(0, sheet.size[1], 33):
        assert (pixels[y] == 255).all()


def test_video_strip_with_captions_keeps_the_frames_in_place(tmp_path):
    path = save_video_strip(CLIPS, tmp_path / "c.png", captions=PROMPTS, upscale=3)
    sheet = Image.open(path)
    strip_w = 4 * (48 + 1) + 1
    assert sheet.size[0] > strip_w + 60 and sheet.size[1] == 3 * (48 + 1) + 1
    pixels = np.array(sheet.convert("RGB"))
    for b in range(3):
        for t in range(4):
            assert torch.equal(tile(sheet, 1 + t * 49, 1 + b * 49, 48), enlarged(CLIPS[b, t], 3))
        caption = pixels[1 + b * 49 : 49 + b * 49, strip_w:]
        assert (caption < 128).any() and (caption > 128).any()  # dark text on white
    with pytest.raises(ValueError, match="captions: expected 3"):
        save_video_strip(CLIPS, tmp_path / "x.png", captions=["one"])
    with pytest.raises(ValueError, match=r"clips: expected a tensor \[B, F, 3, H, W\]"):
        save_video_strip(CLIPS[:, 0], tmp_path / "x.png")
    with pytest.raises(ValueError, match="upscale"):
        save_video_strip(CLIPS, tmp_path / "x.png", upscale=0)


def test_video_gif_has_one_grid_per_frame_with_exact_colours(tmp_path):
    path = save_video_gif(CLIPS, tmp_path / "clips.gif", nrow=2, upscale=3, frame_ms=120)
    gif = Image.open(path)
    assert gif.format == "GIF" and gif.n_frames == 4
    assert gif.size == (2 * (48 + 1) + 1, 2 * (48 + 1) + 1)
    assert gif.info["loop"] == 0  # loops forever
    for t, frame in enumerate(ImageSequence.Iterator(gif)):
        assert frame.info["duration"] == 120
        rgb = frame.convert("RGB")
        for b in range(3):
            x, y = 1 + (b % 2) * 49, 1 + (b // 2) * 49
            assert torch.equal(tile(rgb, x, y, 48), enlarged(CLIPS[b, t], 3)), (t, b)
        assert torch.equal(tile(rgb, 50, 50, 48), torch.ones(3, 48, 48))  # the empty cell
    one_row = Image.open(save_video_gif(CLIPS, tmp_path / "row.gif", upscale=1))
    assert one_row.size == (3 * 17 + 1, 17 + 1)  # nrow=8 > 3 clips: a single row


def test_video_gif_with_many_colours_uses_one_shared_palette(tmp_path):
    noise = torch.rand((2, 3, 3, 8, 8), generator=torch.Generator().manual_seed(0))
    gif = Image.open(save_video_gif(noise, tmp_path / "noise.gif", upscale=1))
    assert gif.n_frames == 3
    errors = []
    for t, frame in enumerate(ImageSequence.Iterator(gif)):
        rgb = frame.convert("RGB")
        for b in range(2):
            errors.append((tile(rgb, 1 + b * 9, 1, 8) - noise[b, t]).abs().mean())
    # 384 random colours squeezed into 256 palette entries: close, not exact.
    assert 0 < max(errors) < 0.05
    with pytest.raises(ValueError, match="nrow"):
        save_video_gif(noise, tmp_path / "x.gif", nrow=0)
    with pytest.raises(ValueError, match="frame_ms"):
        save_video_gif(noise, tmp_path / "x.gif", frame_ms=5)
