"""Mini-GenEval: compositional text-to-image prompts with an analytic pixel verifier.

Two kinds of prompt, over a fixed palette of colours and shapes:

* ``"position"``: one object at one of five places, e.g. ``"a red circle on the left"``,
  ``"a blue square at the top"``, ``"a green triangle in the center"``; checked attributes
  ``color``, ``shape``, ``position``.
* ``"count"``: one to ``max_count`` objects of one colour and shape, e.g. ``"one red circle"``,
  ``"two blue squares"``; checked attributes ``color``, ``shape``, ``count``.

The task offers a seeded train / held-out split of the finite prompt set (held-out prompts are
unseen *combinations*: every colour, shape, position and count still occurs in training), a
procedural renderer (the SFT data), :func:`parse_prompt` (prompt text → attributes, so a reward
needs only the prompt and the image) and the verifier :func:`analyze_images` /
:meth:`GenEvalTask.verify`.

Rendering: a black background and hard-edged shapes (no anti-aliasing) in pure palette
colours; a shape is drawn in a square box of ``size`` pixels (a triangle points up). A
``"position"`` object's box centre is its anchor plus a small jitter; ``"count"`` objects sit
anywhere with at least ``_GAP`` pixels between boxes.

Verifier, from pixels only: every pixel takes the nearest palette colour (background
included); foreground pixels form 4-connected components; components smaller than
``min_area`` are noise. Each object's colour is its majority colour; its shape comes from the
box fill ratio and the taper (bottom-third fill minus top-third fill: a triangle widens
downwards); its position is the anchor nearest to its box centre. A ``"position"`` prompt is
judged on the largest object; a ``"count"`` prompt needs every object to have the colour and
the shape, and the number of objects to equal the count. ``overall`` is all attributes right.

Invariants: ``example(index, split)`` is a pure function of ``(config.seed, split, index)``
(each run of ``len(prompts(split))`` consecutive indices holds every prompt once),
and ``render(example, seed)`` of ``(example, seed, image_size)``; no global RNG is touched.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from PIL import Image, ImageDraw
from pydantic import BaseModel, ConfigDict, Field, field_validator

from .prompts import PromptTask, example_of

__all__ = [
    "ATTRIBUTES",
    "COLORS",
    "POSITIONS",
    "SHAPES",
    "VOCABULARY",
    "DetectedObject",
    "GenEvalConfig",
    "GenEvalExample",
    "GenEvalTask",
    "analyze_images",
    "attribute_accuracy",
    "check_objects",
    "parse_prompt",
    "to_example",
]

Kind = Literal["position", "count"]

BACKGROUND = (0.0, 0.0, 0.0)
COLORS: dict[str, tuple[float, float, float]] = {
    "red": (1.0, 0.0, 0.0),
    "green": (0.0, 1.0, 0.0),
    "blue": (0.0, 0.0, 1.0),
    "yellow": (1.0, 1.0, 0.0),
}
SHAPES = ("circle", "square", "triangle")
# Anchor of each position as (x, y) fractions of the image side; y grows downwards.
POSITIONS: dict[str, tuple[float, float]] = {
    "left": (0.25, 0.5),
    "right": (0.75, 0.5),
    "top": (0.5, 0.25),
    "bottom": (0.5, 0.75),
    "center": (0.5, 0.5),
}
_PREPOSITION = {"left": "on", "right": "on", "top": "at", "bottom": "at", "center": "in"}
_NUMBERS = ("one", "two", "three")
ATTRIBUTES = ("color", "shape", "position", "count")
# Every word any prompt can contain; models built for this task embed exactly these.
VOCABULARY: tuple[str, ...] = (
    ("a", "on", "at", "in", "the", *_NUMBERS, *COLORS, *SHAPES)
    + tuple(f"{s}s" for s in SHAPES)
    + tuple(POSITIONS)
)

# Box sizes as fractions of the image side, per kind; gap between count boxes, jitter.
_SIZE = {"position": (0.40, 0.50), "count": (0.28, 0.36)}
_JITTER = 0.06
_GAP = 2
# Shape thresholds (see the module docstring); measured on renders at 16-64 px.
_TAPER_TRIANGLE = 0.25
_FILL_SQUARE = 0.9


class GenEvalConfig(BaseModel):
    """Settings of :class:`GenEvalTask` (unknown keys are rejected).

    ``heldout_fraction`` of the prompt set (rounded, at least one prompt) is held out for
    evaluation; ``min_area`` (pixels) defaults to a quarter of the smallest box's area and is
    at most the image's area. Strict types (no bools for numbers); ``seed`` >= 0.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    image_size: int = Field(16, ge=12, le=256)
    kinds: tuple[Kind, ...] = Field(("position", "count"), strict=False)  # JSON gives a list
    max_count: int = Field(3, ge=1, le=len(_NUMBERS))
    heldout_fraction: float = Field(0.2, ge=0.0, lt=0.5, allow_inf_nan=False)
    min_area: int | None = Field(None, ge=1, le=256 * 256)
    seed: int = Field(0, ge=0)

    @field_validator("kinds")
    @classmethod
    def _check_kinds(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value or len(set(value)) != len(value):
            raise ValueError(f"expected distinct kinds from ('position', 'count'), got {value}")
        return tuple(k for k in ("position", "count") if k in value)


@dataclass(frozen=True)
class GenEvalExample:
    """One prompt and its attributes. ``position`` is None for ``"count"`` prompts; ``count``
    is 1 for ``"position"`` prompts. ``attributes`` lists what the verifier checks."""

    prompt: str
    kind: Kind
    color: str
    shape: str
    position: str | None
    count: int

    @property
    def attributes(self) -> tuple[str, ...]:
        if self.kind == "position":
            return ("color", "shape", "position")
        return ("color", "shape", "count")


def make_prompt(kind: Kind, color: str, shape: str, position: str | None, count: int) -> str:
    """The canonical prompt text of these attributes (inverse of :func:`parse_prompt`)."""
    if kind == "position":
        return f"a {color} {shape} {_PREPOSITION[position]} the {position}"
    return f"{_NUMBERS[count - 1]} {color} {shape}{'s' if count > 1 else ''}"


def parse_prompt(prompt: str) -> GenEvalExample:
    """Attributes of a mini-GenEval prompt (case and surrounding whitespace ignored).

    Raises:
        ValueError: the text is not a prompt of this task (the message shows both forms).
    """
    if not isinstance(prompt, str):
        raise TypeError(f"parse_prompt: expected a str, got {type(prompt).__name__}")
    words = prompt.lower().split()
    if (
        len(words) == 6
        and words[0] == "a"
        and words[1] in COLORS
        and words[2] in SHAPES
        and words[5] in POSITIONS
        and words[3:5] == [_PREPOSITION[words[5]], "the"]
    ):
        return GenEvalExample(" ".join(words), "position", words[1], words[2], words[5], 1)
    if len(words) == 3 and words[0] in _NUMBERS and words[1] in COLORS:
        count = _NUMBERS.index(words[0]) + 1
        noun = words[2]
        shape = noun[:-1] if count > 1 and noun.endswith("s") else noun
        if shape in SHAPES and noun == shape + ("s" if count > 1 else ""):
            return GenEvalExample(" ".join(words), "count", words[1], shape, None, count)
    raise ValueError(
        f"parse_prompt: {prompt!r} is not a mini-GenEval prompt; expected "
        "'a <color> <shape> on the left|right / at the top|bottom / in the center' or "
        f"'one|two|three <color> <shape>[s]' with colors {list(COLORS)} and shapes {list(SHAPES)}"
    )


def to_example(item: GenEvalExample | str | object, index: int = 0) -> GenEvalExample:
    """An example from an example, a prompt string, or anything with a ``prompt`` field
    (``index`` names the item in errors)."""
    return example_of(item, index, GenEvalExample, parse_prompt)


# ---------------------------------------------------------------------------- verifier
@dataclass(frozen=True)
class DetectedObject:
    """A foreground component: majority ``color``, classified ``shape``, nearest ``position``,
    ``area`` in pixels, box centre ``(x, y)`` as fractions of the side, and the shape features
    ``fill`` (area / box area) and ``taper`` (bottom-third fill − top-third fill)."""

    color: str
    shape: str
    position: str
    area: int
    center: tuple[float, float]
    fill: float
    taper: float


def _check_images(images: torch.Tensor) -> torch.Tensor:
    if not isinstance(images, torch.Tensor):
        raise TypeError(
            f"images: expected a torch.Tensor [B, 3, H, W], got {type(images).__name__}"
        )
    if images.dim() != 4 or images.shape[1] != 3 or not images.is_floating_point():
        raise ValueError(
            f"images: expected a float tensor [B, 3, H, W] in [0, 1], got shape "
            f"{tuple(images.shape)} dtype {images.dtype}"
        )
    return images.detach().to(device="cpu", dtype=torch.float32)


def _label_components(mask: np.ndarray) -> np.ndarray:
    """4-connected components of ``mask`` bool ``[B, H, W]``: each foreground pixel gets the
    smallest flat index in its component, background gets ``H * W`` (min-label propagation,
    in numpy: small element-wise ops, which torch's intra-op threads slow down)."""
    b, h, w = mask.shape
    none = h * w
    flat = np.arange(h * w, dtype=np.int32).reshape(1, h, w)
    labels = np.where(mask, flat, none).astype(np.int32)
    padded = np.full((b, h + 2, w + 2), none, dtype=np.int32)
    while True:
        padded[:, 1:-1, 1:-1] = labels
        low = np.minimum(np.minimum(padded[:, :-2, 1:-1], padded[:, 2:, 1:-1]), labels)
        low = np.minimum(low, np.minimum(padded[:, 1:-1, :-2], padded[:, 1:-1, 2:]))
        new = np.where(mask, low, none)
        if np.array_equal(new, labels):
            return labels
        labels = new


def _shape_features(box: np.ndarray) -> tuple[float, float]:
    """``(fill, taper)`` of a component's boolean box crop ``[h, w]``."""
    h = box.shape[0]
    third = max(1, round(h / 3))
    fill = float(box.mean())
    taper = float(box[h - third :].mean() - box[:third].mean())
    return fill, taper


def _classify_shape(fill: float, taper: float) -> str:
    if taper > _TAPER_TRIANGLE:
        return "triangle"
    return "square" if fill >= _FILL_SQUARE else "circle"


def default_min_area(image_size: int) -> int:
    """A quarter of the area of the smallest box the renderer draws at this size."""
    smallest = max(3, round(min(s[0] for s in _SIZE.values()) * image_size))
    return max(2, smallest * smallest // 4)


def analyze_images(images: torch.Tensor, min_area: int | None = None) -> list[list[DetectedObject]]:
    """The objects in each image of ``images`` float ``[B, 3, H, W]`` in ``[0, 1]`` (square),
    largest first. ``min_area`` defaults to :func:`default_min_area` of the image side."""
    images = _check_images(images)
    b, _, h, w = images.shape
    if min_area is None:
        min_area = default_min_area(min(h, w))
    names = list(COLORS)
    palette = np.array([BACKGROUND, *COLORS.values()], dtype=np.float32)  # background first
    pixels = images.permute(0, 2, 3, 1).numpy()  # [B, H, W, 3]
    nearest = ((pixels[..., None, :] - palette) ** 2).sum(-1).argmin(-1)  # [B, H, W]
    labels = _label_components(nearest > 0)
    anchors = {name: np.array(xy) for name, xy in POSITIONS.items()}
    found: list[list[DetectedObject]] = []
    for row in range(b):
        lab, col = labels[row], nearest[row]
        ids, areas = np.unique(lab[lab < h * w], return_counts=True)
        objects = []
        for component, area in zip(ids, areas):
            if area < min_area:
                continue
            member = lab == component
            ys, xs = np.nonzero(member)
            y0, y1, x0, x1 = ys.min(), ys.max(), xs.min(), xs.max()
            fill, taper = _shape_features(member[y0 : y1 + 1, x0 : x1 + 1])
            votes = np.bincount(col[member], minlength=len(palette))[1:]
            center = ((x0 + x1 + 1) / 2 / w, (y0 + y1 + 1) / 2 / h)
            position = min(anchors, key=lambda n: float(((anchors[n] - center) ** 2).sum()))
            objects.append(
                DetectedObject(
                    color=names[int(votes.argmax())],
                    shape=_classify_shape(fill, taper),
                    position=position,
                    area=int(area),
                    center=(float(center[0]), float(center[1])),
                    fill=fill,
                    taper=taper,
                )
            )
        objects.sort(key=lambda o: -o.area)
        found.append(objects)
    return found


def check_objects(example: GenEvalExample, objects: Sequence[DetectedObject]) -> dict[str, bool]:
    """Per-attribute correctness of the detected ``objects`` for ``example``, plus
    ``overall``; keys are ``example.attributes`` and ``"overall"``. No object: all False."""
    if example.kind == "position":
        main = objects[0] if objects else None
        result = {
            "color": main is not None and main.color == example.color,
            "shape": main is not None and main.shape == example.shape,
            "position": main is not None and main.position == example.position,
        }
    else:
        result = {
            "color": bool(objects) and all(o.color == example.color for o in objects),
            "shape": bool(objects) and all(o.shape == example.shape for o in objects),
            "count": len(objects) == example.count,
        }
    result["overall"] = all(result.values())
    return result


def attribute_accuracy(results: Sequence[dict[str, bool]]) -> dict[str, float]:
    """Mean correctness per attribute over the results that check it, and ``overall`` over
    all of them; an attribute no result checks is absent."""
    if not results:
        raise ValueError("attribute_accuracy: expected at least one result, got none")
    accuracy = {}
    for key in (*ATTRIBUTES, "overall"):
        values = [r[key] for r in results if key in r]
        if values:
            accuracy[key] = sum(values) / len(values)
    return accuracy


# ---------------------------------------------------------------------------- the task
def _all_prompts(config: GenEvalConfig) -> list[GenEvalExample]:
    examples = []
    for kind in config.kinds:
        for color in COLORS:
            for shape in SHAPES:
                if kind == "position":
                    for position in POSITIONS:
                        prompt = make_prompt(kind, color, shape, position, 1)
                        examples.append(GenEvalExample(prompt, kind, color, shape, position, 1))
                else:
                    for count in range(1, config.max_count + 1):
                        prompt = make_prompt(kind, color, shape, None, count)
                        examples.append(GenEvalExample(prompt, kind, color, shape, None, count))
    return examples


def _values(examples: Iterable[GenEvalExample]) -> set[tuple[str, str, object]]:
    """Every (kind, attribute, value) the examples show."""
    return {(e.kind, a, getattr(e, a)) for e in examples for a in e.attributes}


class GenEvalTask(PromptTask):
    """Prompts, renders and the verifier of mini-GenEval (see the module docstring); the split
    and the example streams are :class:`~diffusion_rl.tasks.prompts.PromptTask`'s.

    Args:
        config: a :class:`GenEvalConfig`; ``None`` means the defaults.
    """

    name = "geneval"
    vocabulary = VOCABULARY
    config_class = GenEvalConfig
    seed_key = "diffusion_rl.geneval:v1"

    def __init__(self, config: GenEvalConfig | None = None) -> None:
        super().__init__(config)
        self.min_area = self.config.min_area or default_min_area(self.config.image_size)
        self._split_prompts(_all_prompts(self.config), _values)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return (3, self.config.image_size, self.config.image_size)

    # ------------------------------------------------------------------ rendering
    def render(self, example: GenEvalExample | str, seed: int) -> torch.Tensor:
        """A correct image of ``example``: float32 ``[3, S, S]`` in ``[0, 1]``; a pure
        function of ``(example, seed, image_size)``."""
        example = to_example(example, 0)
        size = self.config.image_size
        rng = random.Random(self._seed("render", example.prompt, seed))
        low, high = _SIZE[example.kind]
        image = Image.new("RGB", (size, size), tuple(round(255 * c) for c in BACKGROUND))
        draw = ImageDraw.Draw(image)
        fill = tuple(round(255 * c) for c in COLORS[example.color])
        if example.kind == "position":
            box = max(3, round(rng.uniform(low, high) * size))
            ax, ay = POSITIONS[example.position]
            cx = (ax + rng.uniform(-_JITTER, _JITTER)) * size
            cy = (ay + rng.uniform(-_JITTER, _JITTER)) * size
            x0 = min(max(round(cx - box / 2), 0), size - box)
            y0 = min(max(round(cy - box / 2), 0), size - box)
            boxes = [(x0, y0, box)]
        else:
            boxes = self._place(rng, example.count, low, high)
        for x0, y0, box in boxes:
            _draw_shape(draw, example.shape, x0, y0, box, fill)
        array = np.asarray(image, dtype=np.float32) / 255.0
        return torch.from_numpy(array).permute(2, 0, 1).contiguous()

    def _place(self, rng: random.Random, count: int, low: float, high: float):
        """``count`` boxes ``(x0, y0, side)`` inside the image, ``_GAP`` pixels apart."""
        size = self.config.image_size
        for _ in range(200):
            boxes = []
            for _ in range(count):
                box = max(3, round(rng.uniform(low, high) * size))
                x0, y0 = rng.randint(0, size - box), rng.randint(0, size - box)
                apart = (
                    x0 >= x + s + _GAP
                    or x >= x0 + box + _GAP
                    or y0 >= y + s + _GAP
                    or y >= y0 + box + _GAP
                    for x, y, s in boxes
                )
                if all(apart):
                    boxes.append((x0, y0, box))
            if len(boxes) == count:
                return boxes
        # Fallback (tiny images): the smallest boxes on a diagonal.
        box = max(3, round(low * size))
        step = (size - box) // max(1, count - 1) if count > 1 else 0
        return [(k * step, k * step, box) for k in range(count)]

    def render_batch(self, examples: Sequence[GenEvalExample | str], seeds: Sequence[int]):
        """``[B, 3, S, S]`` renders, row ``i`` = ``render(examples[i], seeds[i])``."""
        if len(examples) != len(seeds):
            raise ValueError(f"render_batch: {len(examples)} examples but {len(seeds)} seeds")
        return torch.stack([self.render(e, s) for e, s in zip(examples, seeds)])

    # ------------------------------------------------------------------ verifier
    def verify(
        self, images: torch.Tensor, examples: Sequence[GenEvalExample | str]
    ) -> list[dict[str, bool]]:
        """Per image, the correctness of each attribute its prompt states, plus ``overall``."""
        images = _check_images(images)
        if len(examples) != images.shape[0]:
            raise ValueError(f"verify: {images.shape[0]} images but {len(examples)} examples")
        parsed = [to_example(e, i) for i, e in enumerate(examples)]
        found = analyze_images(images, self.min_area)
        return [check_objects(e, objects) for e, objects in zip(parsed, found)]

    def rewards(
        self,
        images: torch.Tensor,
        examples: Sequence[GenEvalExample | str],
        mode: Literal["mean", "all"] = "mean",
    ) -> torch.Tensor:
        """float32 ``[B]``: the fraction of attributes right (``"mean"``) or 1.0 iff all are
        right (``"all"``)."""
        if mode not in ("mean", "all"):
            raise ValueError(f"mode: expected 'mean' or 'all', got {mode!r}")
        values = []
        for result in self.verify(images, examples):
            if mode == "all":
                values.append(float(result["overall"]))
            else:
                parts = [v for k, v in result.items() if k != "overall"]
                values.append(sum(parts) / len(parts))
        return torch.tensor(values, dtype=torch.float32)

    def accuracy(
        self, images: torch.Tensor, examples: Sequence[GenEvalExample | str]
    ) -> dict[str, float]:
        """:func:`attribute_accuracy` of :meth:`verify`."""
        return attribute_accuracy(self.verify(images, examples))


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, x0: int, y0: int, box: int, fill) -> None:
    x1, y1 = x0 + box - 1, y0 + box - 1
    if shape == "square":
        draw.rectangle((x0, y0, x1, y1), fill=fill)
    elif shape == "circle":
        draw.ellipse((x0, y0, x1, y1), fill=fill)
    else:
        draw.polygon([((x0 + x1) / 2, y0), (x0, y1), (x1, y1)], fill=fill)
