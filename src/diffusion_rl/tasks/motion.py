"""Mini-motion: procedurally generated clips in which a shape moves as the prompt says.

Grammar: ``"a <color> <shape> moving <direction> <speed>"`` with the mini-GenEval colours and
shapes, directions ``left|right|up|down`` and speeds ``slowly|fast``, e.g. ``"a red circle
moving left fast"`` (4 x 3 x 4 x 2 = 96 prompts). Each prompt's first frame is the mini-GenEval
prompt :attr:`MotionExample.image_prompt` (``"a red circle in the center"``), so the image
stage of a text → image → video workflow is the mini-GenEval model and
:meth:`MotionTask.image_task` judges it.

Rendering: frame 0 is *exactly* the mini-GenEval "position" render of the image prompt
(``image_task().render(example.image_prompt, seed)``: same box sizes, jitter, palette, hard
edges, black background); frame ``t`` is frame 0 translated by ``t * v`` pixels in the
direction (``up`` is towards row 0), ``v`` = ``slow_pixels`` or ``fast_pixels``; what leaves
the image is cut off. :class:`MotionConfig` refuses settings where the object could leave view:
at least half the smallest box plus one pixel stays in the image in every frame.

Verifier, from pixels only (:func:`analyze_clips` runs the mini-GenEval analysis on every frame
and measures the largest object's box ``(x0, y0, x1, y1)``). Motion is read from the object's
*trailing* edge (for ``right`` its left edge ``x0``): it keeps moving at the true speed while
the leading edge is cut off at the border. When the prompted trailing edge touches the border
in some frame but the opposite edge on that axis never does, the clip moves the other way and
that edge is read instead (a reversed clip is wrong in direction only). With ``L`` the last
frame showing an object:

* ``color``: every frame shows an object and the largest one has the prompt's colour;
* ``shape``: the majority shape over frame 0 and the frames whose box does not touch the
  border (ties go to the shape seen first) is the prompt's;
* ``direction``: the trailing-edge displacement from frame 0 to ``L`` along the prompted way is
  at least half of ``L * slow_pixels`` (half the least motion any prompt asks for, so the
  verdict does not depend on the speed) and larger than the box's perpendicular displacement;
* ``speed``: the mean per-frame trailing-edge speed along the prompted axis is nearer the
  prompted speed than the other speed and than 0 (a still object is neither slow nor fast);
* ``smooth``: every frame shows an object, each frame-to-frame trailing-edge step is within
  1 pixel of the steps' mean (no jumps) and that mean is at least half of ``slow_pixels`` in
  size (the object moves: every prompt asks for motion, so a still clip is not smooth motion,
  and a reward cannot be earned by freezing the clip);
* ``overall``: all five.

Invariants: ``example(index, split)`` is a pure function of ``(config.seed, split, index)``
(each run of ``len(prompts(split))`` consecutive indices holds every prompt once), and
``render_clip(example, seed)`` of ``(config, example, seed)``; every render verifies as all
right; no global RNG is touched.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from . import geneval
from .geneval import COLORS, SHAPES, DetectedObject, GenEvalConfig, GenEvalTask
from .prompts import PromptTask, example_of

__all__ = [
    "DIRECTIONS",
    "MOTION_ATTRIBUTES",
    "MOTION_VOCABULARY",
    "SPEEDS",
    "FrameAnalysis",
    "MotionConfig",
    "MotionExample",
    "MotionTask",
    "analyze_clips",
    "check_clip",
    "check_motion_attributes",
    "clip_scores",
    "max_travel",
    "motion_accuracy",
    "parse_motion_prompt",
    "to_motion_example",
    "verify_clips",
]

DIRECTIONS = ("left", "right", "up", "down")
SPEEDS = ("slowly", "fast")
MOTION_ATTRIBUTES = ("color", "shape", "direction", "speed", "smooth")
MOTION_VOCABULARY: tuple[str, ...] = ("a", "moving", *COLORS, *SHAPES, *DIRECTIONS, *SPEEDS)
# Per direction: unit step (dx, dy), the trailing-edge index into (x0, y0, x1, y1), the sign
# of its motion, and the two edges across the motion.
_STEP = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
_TRAILING = {"left": (2, -1), "right": (0, 1), "up": (3, -1), "down": (1, 1)}
_ACROSS = {"left": (1, 3), "right": (1, 3), "up": (0, 2), "down": (0, 2)}


def max_travel(image_size: int) -> int:
    """The most pixels the fastest clip may move at this size: every render's trailing edge
    starts at least ``margin`` pixels from the border it moves towards (smallest box ``low``
    at the extreme jitter), and half that box plus one pixel must stay in view."""
    low = max(3, round(geneval._SIZE["position"][0] * image_size))
    jitter = geneval._JITTER * image_size
    near = round(image_size / 2 - jitter - low / 2) + low - 1  # x1 of the leftmost box
    far = image_size - 1 - round(image_size / 2 + jitter - low / 2)  # from x0 of the rightmost
    return min(near, far) - (low + 1) // 2


class MotionConfig(BaseModel):
    """Settings of :class:`MotionTask` (unknown keys are rejected, strict types).

    Speeds are pixels per frame (``slow_pixels < fast_pixels``). ``min_area`` is the verifier's
    noise floor (default: mini-GenEval's for the image size). The fastest clip must stay in
    view: ``(num_frames - 1) * fast_pixels <= max_travel(image_size)`` (6 px at 16 px, 10 at 24).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    image_size: int = Field(16, ge=12, le=64)
    num_frames: int = Field(4, ge=2, le=16)
    slow_pixels: int = Field(1, ge=1)
    fast_pixels: int = Field(2, ge=1)
    heldout_fraction: float = Field(0.2, ge=0.0, lt=0.5, allow_inf_nan=False)
    min_area: int | None = Field(None, ge=1, le=64 * 64)
    seed: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _check_motion(self) -> MotionConfig:
        if self.slow_pixels >= self.fast_pixels:
            raise ValueError(
                f"slow_pixels ({self.slow_pixels}) must be less than fast_pixels "
                f"({self.fast_pixels})"
            )
        most, travel = max_travel(self.image_size), (self.num_frames - 1) * self.fast_pixels
        if travel > most:
            raise ValueError(
                f"num_frames={self.num_frames} with fast_pixels={self.fast_pixels} moves the "
                f"object {travel} px, but at image_size={self.image_size} it leaves view after "
                f"{most} px; use fewer frames, a lower fast_pixels or a larger image_size"
            )
        return self


@dataclass(frozen=True)
class MotionExample:
    """One prompt and its attributes; ``attributes`` lists what the verifier checks."""

    prompt: str
    color: str
    shape: str
    direction: str
    speed: str

    attributes = MOTION_ATTRIBUTES

    @property
    def image_prompt(self) -> str:
        """The first frame's mini-GenEval prompt, e.g. ``"a red circle in the center"``."""
        return f"a {self.color} {self.shape} in the center"


def parse_motion_prompt(text: str) -> MotionExample:
    """Attributes of a mini-motion prompt (case and runs of whitespace ignored).

    Raises:
        TypeError: ``text`` is not a str.
        ValueError: the text is not a prompt of this task (the message shows the grammar).
    """
    if not isinstance(text, str):
        raise TypeError(f"parse_motion_prompt: expected a str, got {type(text).__name__}")
    words = text.lower().split()
    if (
        len(words) == 6
        and words[0] == "a"
        and words[1] in COLORS
        and words[2] in SHAPES
        and words[3] == "moving"
        and words[4] in DIRECTIONS
        and words[5] in SPEEDS
    ):
        return MotionExample(" ".join(words), *words[1:3], *words[4:6])
    raise ValueError(
        f"parse_motion_prompt: {text!r} is not a mini-motion prompt; expected "
        f"'a <color> <shape> moving <direction> <speed>' with colors {list(COLORS)}, shapes "
        f"{list(SHAPES)}, directions {list(DIRECTIONS)} and speeds {list(SPEEDS)}"
    )


def to_motion_example(item: MotionExample | str | object, index: int = 0) -> MotionExample:
    """An example from an example, a prompt str, or a dict / object with a str ``prompt``
    (``index`` names the item in errors)."""
    return example_of(item, index, MotionExample, parse_motion_prompt)


# ---------------------------------------------------------------------------- verifier
@dataclass(frozen=True)
class FrameAnalysis:
    """One frame: its ``objects`` (mini-GenEval detections, largest first) and the inclusive
    pixel box ``(x0, y0, x1, y1)`` of the largest one (None when the frame shows none)."""

    objects: list[DetectedObject]
    box: tuple[int, int, int, int] | None


def _check_clips(clips: torch.Tensor) -> torch.Tensor:
    if not isinstance(clips, torch.Tensor):
        raise TypeError(
            f"clips: expected a torch.Tensor [B, F, 3, H, W], got {type(clips).__name__}"
        )
    if clips.dim() != 5 or clips.shape[2] != 3 or not clips.is_floating_point():
        raise ValueError(
            f"clips: expected a float tensor [B, F, 3, H, W] in [0, 1], got shape "
            f"{tuple(clips.shape)} dtype {clips.dtype}"
        )
    return clips.detach().to(device="cpu", dtype=torch.float32)


def _largest_boxes(frames: torch.Tensor, min_area: int) -> list[tuple[int, int, int, int] | None]:
    """Box of the largest component of at least ``min_area`` pixels in each frame ``[N, 3, H,
    W]``; the same component as ``analyze_images(frames, min_area)[n][0]`` (ties: lowest
    label first, as its stable sort keeps)."""
    palette = np.array([geneval.BACKGROUND, *COLORS.values()], dtype=np.float32)
    pixels = frames.permute(0, 2, 3, 1).numpy()
    nearest = ((pixels[..., None, :] - palette) ** 2).sum(-1).argmin(-1)
    labels = geneval._label_components(nearest > 0)
    none = labels.shape[1] * labels.shape[2]
    boxes: list[tuple[int, int, int, int] | None] = []
    for lab in labels:
        areas = np.bincount(lab.ravel(), minlength=none + 1)[:none]
        best = int(areas.argmax())
        if areas[best] < min_area:
            boxes.append(None)
            continue
        ys, xs = np.nonzero(lab == best)
        boxes.append((int(xs.min()), int(ys.min()), int(xs.max()), int(ys.max())))
    return boxes


def analyze_clips(clips: torch.Tensor, min_area: int | None = None) -> list[list[FrameAnalysis]]:
    """Per clip of ``clips`` float ``[B, F, 3, H, W]`` in ``[0, 1]`` (square frames), per frame,
    its :class:`FrameAnalysis`. ``min_area`` defaults to mini-GenEval's for the frame side."""
    clips = _check_clips(clips)
    b, f, _, h, w = clips.shape
    if min_area is None:
        min_area = geneval.default_min_area(min(h, w))
    frames = clips.reshape(b * f, 3, h, w)
    found = geneval.analyze_images(frames, min_area)
    boxes = _largest_boxes(frames, min_area)
    flat = [FrameAnalysis(objects, box) for objects, box in zip(found, boxes)]
    return [flat[i * f : (i + 1) * f] for i in range(b)]


def check_clip(
    example: MotionExample,
    frames: Sequence[FrameAnalysis],
    image_size: int,
    slow_pixels: int = 1,
    fast_pixels: int = 2,
) -> dict[str, bool]:
    """Per-attribute correctness of one analysed clip (rules in the module docstring), plus
    ``overall``; ``image_size`` is the frame side (for the border test)."""
    present = [f.box is not None for f in frames]
    main = [f.objects[0] if f.objects else None for f in frames]
    result = {"color": all(present) and all(m.color == example.color for m in main)}
    if frames[0].box is None:
        result["shape"] = False
    else:
        inner = [
            m.shape
            for t, (f, m) in enumerate(zip(frames, main))
            if f.box is not None and (t == 0 or not _touches(f.box, image_size))
        ]
        result["shape"] = Counter(inner).most_common(1)[0][0] == example.shape
    speed, other = (
        (slow_pixels, fast_pixels) if example.speed == "slowly" else (fast_pixels, slow_pixels)
    )
    visible = [t for t, ok in enumerate(present) if ok]
    if not present[0] or len(visible) < 2:
        result["direction"] = result["speed"] = False
    else:
        edge, sign = _motion_edge(example.direction, [frames[t].box for t in visible], image_size)
        last, first, end = visible[-1], frames[0].box, frames[visible[-1]].box
        along = sign * (end[edge] - first[edge])
        across = max(abs(end[k] - first[k]) for k in _ACROSS[example.direction])
        result["direction"] = along >= 0.5 * last * slow_pixels and along > across
        rate = abs(along) / last
        result["speed"] = abs(rate - speed) < min(abs(rate - other), rate)
    if all(present):
        boxes = [f.box for f in frames]
        edge, _ = _motion_edge(example.direction, boxes, image_size)
        steps = [b[edge] - a[edge] for a, b in zip(boxes, boxes[1:])]
        mean = sum(steps) / len(steps)
        moving = abs(mean) >= 0.5 * slow_pixels
        result["smooth"] = moving and all(abs(s - mean) <= 1 for s in steps)
    else:
        result["smooth"] = False
    result["overall"] = all(result.values())
    return result


def _touches(box: tuple[int, int, int, int], size: int) -> bool:
    return min(box[:2]) <= 0 or max(box[2:]) >= size - 1


def _motion_edge(direction: str, boxes: Sequence[tuple[int, ...]], size: int) -> tuple[int, int]:
    """``(edge, sign)``: the box edge that measures motion along ``direction``'s axis (the
    prompted trailing edge, or the opposite edge when only that one stays off the border in
    every box: the clip then moves the other way) and the prompted direction's sign."""
    trailing, sign = _TRAILING[direction]

    def free(edge: int) -> bool:
        return all(box[edge] not in (0, size - 1) for box in boxes)

    opposite = trailing ^ 2  # x0 <-> x1, y0 <-> y1
    return (opposite if not free(trailing) and free(opposite) else trailing), sign


def verify_clips(
    clips: torch.Tensor,
    examples: Sequence[MotionExample | str | object],
    *,
    slow_pixels: int = 1,
    fast_pixels: int = 2,
    min_area: int | None = None,
) -> list[dict[str, bool]]:
    """:func:`check_clip` of each clip of :func:`analyze_clips` against its example."""
    clips = _check_clips(clips)
    if len(examples) != clips.shape[0]:
        raise ValueError(f"verify: {clips.shape[0]} clips but {len(examples)} examples")
    parsed = [to_motion_example(e, i) for i, e in enumerate(examples)]
    size = clips.shape[-1]
    return [
        check_clip(e, frames, size, slow_pixels, fast_pixels)
        for e, frames in zip(parsed, analyze_clips(clips, min_area))
    ]


def check_motion_attributes(attributes: Iterable[str] | None) -> tuple[str, ...]:
    """The chosen attribute names in canonical order (``None``: all five).

    Raises:
        TypeError: a single str instead of a list of names.
        ValueError: none, repeated or unknown names (the message lists the valid ones).
    """
    if attributes is None:
        return MOTION_ATTRIBUTES
    if isinstance(attributes, str):
        raise TypeError(f"attributes: expected a list of names, got the str {attributes!r}")
    attributes = tuple(attributes)
    unknown = [a for a in attributes if a not in MOTION_ATTRIBUTES]
    if unknown or not attributes or len(set(attributes)) != len(attributes):
        raise ValueError(
            f"attributes: expected distinct names from {list(MOTION_ATTRIBUTES)}, got "
            f"{list(attributes)}"
        )
    return tuple(a for a in MOTION_ATTRIBUTES if a in attributes)


def clip_scores(
    results: Sequence[dict[str, bool]],
    attributes: Iterable[str] | None = None,
    mode: Literal["mean", "all"] = "mean",
) -> torch.Tensor:
    """float32 ``[B]`` from :func:`verify_clips` results: the fraction of ``attributes``
    (default: all five) right (``"mean"``), or 1.0 iff all of them are right (``"all"``)."""
    if mode not in ("mean", "all"):
        raise ValueError(f"mode: expected 'mean' or 'all', got {mode!r}")
    names = check_motion_attributes(attributes)
    values = [[r[a] for a in names] for r in results]
    reduce = all if mode == "all" else (lambda v: sum(v) / len(v))
    return torch.tensor([float(reduce(v)) for v in values], dtype=torch.float32)


def motion_accuracy(results: Sequence[dict[str, bool]]) -> dict[str, float]:
    """Mean correctness over the clips of each attribute and of ``overall``."""
    if not results:
        raise ValueError("motion_accuracy: expected at least one result, got none")
    return {k: sum(r[k] for r in results) / len(results) for k in (*MOTION_ATTRIBUTES, "overall")}


# ---------------------------------------------------------------------------- the task
class MotionTask(PromptTask):
    """Prompts, clip renders and the verifier of mini-motion (see the module docstring); the
    split and the example streams are :class:`~diffusion_rl.tasks.prompts.PromptTask`'s.

    Args:
        config: a :class:`MotionConfig`; ``None`` means the defaults.
    """

    name = "mini-motion"
    vocabulary = MOTION_VOCABULARY
    config_class = MotionConfig
    seed_key = "diffusion_rl.motion:v1"

    def __init__(self, config: MotionConfig | None = None) -> None:
        super().__init__(config)
        config = self.config
        self.min_area = config.min_area or geneval.default_min_area(config.image_size)
        self._image_task = GenEvalTask(
            GenEvalConfig(
                image_size=config.image_size,
                kinds=("position",),
                min_area=config.min_area,
                seed=config.seed,
            )
        )
        every = [
            MotionExample(f"a {c} {s} moving {d} {v}", c, s, d, v)
            for c in COLORS
            for s in SHAPES
            for d in DIRECTIONS
            for v in SPEEDS
        ]
        self._split_prompts(every, _values)

    @property
    def clip_shape(self) -> tuple[int, int, int, int]:
        size = self.config.image_size
        return (self.config.num_frames, 3, size, size)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return (3, self.config.image_size, self.config.image_size)

    def image_task(self) -> GenEvalTask:
        """The mini-GenEval "position" task of the first frame (same size, seed and noise
        floor): its verifier judges ``clips[:, 0]`` against ``example.image_prompt``."""
        return self._image_task

    def to_example(self, item: MotionExample | str | object, index: int = 0) -> MotionExample:
        """The example a prompt string (or an example, or an object with a ``prompt``) is."""
        return to_motion_example(item, index)

    # ------------------------------------------------------------------ rendering
    def speed_pixels(self, example: MotionExample) -> int:
        """Pixels per frame of the example's speed."""
        return self.config.slow_pixels if example.speed == "slowly" else self.config.fast_pixels

    def render_clip(self, example: MotionExample | str, seed: int) -> torch.Tensor:
        """A correct clip of ``example``: float32 ``[F, 3, S, S]`` in ``[0, 1]`` whose frame 0
        is ``image_task().render(example.image_prompt, seed)``."""
        example = to_motion_example(example)
        first = self._image_task.render(example.image_prompt, seed)
        size = self.config.image_size
        dx, dy = _STEP[example.direction]
        step = self.speed_pixels(example)
        clip = torch.zeros(self.clip_shape, dtype=torch.float32)  # black = BACKGROUND
        for t in range(self.config.num_frames):
            sx, sy = dx * step * t, dy * step * t
            clip[t, :, max(sy, 0) : size + min(sy, 0), max(sx, 0) : size + min(sx, 0)] = first[
                :, max(-sy, 0) : size - max(sy, 0), max(-sx, 0) : size - max(sx, 0)
            ]
        return clip

    def render_batch(self, examples: Sequence[MotionExample | str], seeds: Sequence[int]):
        """``[B, F, 3, S, S]`` renders, row ``i`` = ``render_clip(examples[i], seeds[i])``."""
        if len(examples) != len(seeds):
            raise ValueError(f"render_batch: {len(examples)} examples but {len(seeds)} seeds")
        return torch.stack([self.render_clip(e, s) for e, s in zip(examples, seeds)])

    # ------------------------------------------------------------------ verifier
    def verify(self, clips: torch.Tensor, examples: Sequence) -> list[dict[str, bool]]:
        """Per clip, the correctness of each attribute, plus ``overall``."""
        c = self.config
        return verify_clips(
            clips,
            examples,
            slow_pixels=c.slow_pixels,
            fast_pixels=c.fast_pixels,
            min_area=self.min_area,
        )

    def rewards(
        self,
        clips: torch.Tensor,
        examples: Sequence,
        mode: Literal["mean", "all"] = "mean",
        attributes: Iterable[str] | None = None,
    ) -> torch.Tensor:
        """float32 ``[B]``: :func:`clip_scores` of :meth:`verify`."""
        return clip_scores(self.verify(clips, examples), attributes, mode)

    def accuracy(self, clips: torch.Tensor, examples: Sequence) -> dict[str, float]:
        """:func:`motion_accuracy` of :meth:`verify`."""
        return motion_accuracy(self.verify(clips, examples))


def _values(examples: Iterable[MotionExample]) -> set[tuple[str, str]]:
    """Every (attribute, value) the examples show."""
    return {(a, getattr(e, a)) for e in examples for a in ("color", "shape", "direction", "speed")}
