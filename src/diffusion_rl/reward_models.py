"""Image rewards computed by models loaded from local directories (optional extras).

Each follows the image-reward interface of :mod:`diffusion_rl.rewards`:
``reward(images, examples) -> Tensor`` float32 ``[B]`` on CPU, finite, where ``images`` is
float ``[B, 3, H, W]`` in ``[0, 1]`` and ``examples`` the B prompt strings (or objects with a
``prompt`` field, and for :class:`OcrReward` optionally a ``text`` field) in the same order.

* :class:`ClipScoreReward` (``clip_score``): ``scale * cos(text embedding, image embedding)``
  of a transformers ``CLIPModel``.
* :class:`PickScoreReward` (``pickscore``): ``scale * exp(logit_scale) * cos(...)``, the
  PickScore formula (the released model is a CLIP-H ``CLIPModel``; any CLIPModel directory
  works).
* :class:`AestheticReward` (``aesthetic``): a stack of linear layers from a safetensors file
  applied to the L2-normalised CLIP image embedding (the LAION aesthetic predictor v2 layout,
  see :func:`load_linear_head`).
* :class:`OcrReward` (``ocr``): ``1 - min(edit distance, len(target)) / len(target)`` between
  the prompt's target text and the text an offline OCR engine (RapidOCR on onnxruntime, whose
  models ship inside its wheel) reads in the image.

Invariants:

* Models are read only from local directories (a hub id fails at once with a message saying
  to download it first) and only from ``*.safetensors`` weights; nothing is ever downloaded.
* Construction is cheap and checks every option (paths, files, shapes from the safetensors
  headers, the optional package): config validation builds rewards to check their options.
  The model is loaded on the first call, once per (directory, device, dtype) for the whole
  process (:func:`clear_cache` forgets them), in eval mode with gradients off.
* Scores are computed under ``torch.no_grad``, in chunks of ``batch_size`` images; every row's
  score depends only on that row's image and prompt (a row scored alone equals the same row in
  a batch up to float rounding): images are preprocessed per row and texts are padded to the
  model's fixed maximum length.
"""

from __future__ import annotations

import importlib.util
import json
import math
import numbers
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F

__all__ = [
    "MODEL_REWARDS",
    "AestheticReward",
    "ClipScoreReward",
    "ImageSettings",
    "LinearHead",
    "OcrReward",
    "PickScoreReward",
    "clear_cache",
    "edit_distance",
    "load_linear_head",
    "ocr_target_text",
    "preprocess_images",
    "read_image_settings",
]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_CACHE: dict[tuple, Any] = {}
_CACHE_LOCK = threading.Lock()


def clear_cache() -> None:
    """Forget every loaded reward model (the next call of a reward loads it again)."""
    with _CACHE_LOCK:
        _CACHE.clear()


def _cached(key: tuple, load: Any) -> Any:
    """``_CACHE[key]``, computed once by ``load()`` (under a lock: one load per key)."""
    with _CACHE_LOCK:
        if key not in _CACHE:
            _CACHE[key] = load()
        return _CACHE[key]


# ---------------------------------------------------------------------------- option checks
def _require(owner: str, modules: Sequence[str], extra: str) -> None:
    """ImportError naming the extra unless every module in ``modules`` is importable."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(
            f"the {owner} reward needs {' and '.join(missing)} (not installed): "
            f"pip install 'diffusion-rl[{extra}]'"
        )


def _local_directory(path: Any, field: str) -> Path:
    """``path`` as a Path after the project's one local-directory check (hub ids fail fast)."""
    if path is None:
        raise ValueError(
            f"{field}: the option 'path' is required: the local directory of the model "
            "(options: {path: DIR}; see docs/rewards.md for the layout)"
        )
    if not isinstance(path, (str, Path)) or not str(path).strip():
        raise TypeError(f"{field}: expected a directory path (str), got {path!r}")
    from .models.io import check_local_directory  # lazily: models.io imports every loader

    try:
        return check_local_directory(os.path.expanduser(str(path)), field)
    except FileNotFoundError as error:  # config validation reports ValueErrors
        raise ValueError(str(error)) from None


def _check_safetensors_weights(directory: Path, field: str) -> None:
    """Refuse a model directory without ``*.safetensors`` weights (no pickle loading)."""
    if any(directory.glob("*.safetensors")):
        return
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
    if pickles:
        raise ValueError(
            f"{field}: {directory} holds only pickle weights ({', '.join(pickles[:3])}); only "
            "safetensors are loaded: convert them (e.g. load once in a trusted environment and "
            "save_pretrained(DIR, safe_serialization=True)) and pass that directory"
        )
    raise ValueError(f"{field}: {directory} has no *.safetensors weights")


def _read_json(path: Path, field: str) -> dict[str, Any]:
    if not path.is_file():
        raise ValueError(f"{field}: {path.parent} has no {path.name}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(f"{field}: cannot read {path}: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{field}: {path} must hold a JSON object")
    return data


def _check_device(field: str, device: Any) -> str | None:
    """None, or ``cpu`` / ``cuda`` / ``cuda:N`` / ``mps`` present on this machine."""
    if device is None:
        return None
    if not isinstance(device, str) or not re.fullmatch(r"cpu|mps|cuda(:[0-9]+)?", device):
        raise ValueError(f"{field}: expected 'cpu', 'cuda', 'cuda:N' or 'mps', got {device!r}")
    if device.startswith("cuda"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= count:
            raise ValueError(f"{field}: {device!r} is not on this machine ({count} CUDA devices)")
    if device == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{field}: 'mps' is not available on this machine; use 'cpu'")
    return device


def _check_images(owner: str, images: Any, examples: Sequence[Any] | None) -> torch.Tensor:
    """``images`` as float32 on their own device after the image-reward checks: a float tensor
    ``[B, 3, H, W]``, finite values in ``[0, 1]``, one example per image when given."""
    if not isinstance(images, torch.Tensor):
        raise TypeError(
            f"{owner}: expected images as a torch.Tensor [B, 3, H, W] first and the prompts "
            f"second, got {type(images).__name__} first"
        )
    if images.dim() != 4 or images.shape[1] != 3 or not images.is_floating_point():
        raise ValueError(
            f"{owner}: expected a float image tensor [B, 3, H, W], got shape "
            f"{tuple(images.shape)} dtype {images.dtype}"
        )
    images = images.detach().float()
    if not bool(((images >= 0) & (images <= 1)).all()):  # NaN fails both comparisons
        raise ValueError(
            f"{owner}: pixel values must be finite and in [0, 1] (e.g. model.decode(latents)), "
            "got a tensor outside that range"
        )
    if examples is not None and len(examples) != len(images):
        raise ValueError(
            f"{owner}: got {len(images)} images but {len(examples)} examples; expected one "
            "example per image"
        )
    return images


def _check_positive_int(field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{field}: expected an int >= 1, got {value!r}")
    return value


def _check_real(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{field}: expected a real number, got {value!r}")
    if not math.isfinite(float(value)):
        raise ValueError(f"{field}: expected a finite number, got {value!r}")
    return float(value)


def _prompt(owner: str, example: Any, index: int) -> str:
    """The example itself when it is a str, else its ``prompt`` field (a str)."""
    if isinstance(example, str):
        return example
    prompt = (
        example.get("prompt") if isinstance(example, dict) else getattr(example, "prompt", None)
    )
    if prompt is None:
        raise ValueError(
            f"{owner}: example {index} has no 'prompt' field ({type(example).__name__}); pass "
            "prompt strings or examples with a prompt"
        )
    if not isinstance(prompt, str):
        raise TypeError(f"{owner}: example {index}: 'prompt' must be a str")
    return prompt


def _resolve_device(device: str | None, source: torch.device) -> torch.device:
    """The configured device, else ``source`` (the images' own); ``cuda`` means the current
    CUDA device."""
    resolved = torch.device(device) if device is not None else source
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


# ---------------------------------------------------------------------------- preprocessing
@dataclass(frozen=True)
class ImageSettings:
    """A CLIP image processor's settings (``preprocessor_config.json``), applied in torch.

    ``shortest_edge``: resize so the shorter side has this length (aspect kept, the longer
    side ``int(edge * long / short)``, as transformers computes it); or ``resize_to`` an exact
    ``(height, width)``; neither: no resize. ``crop``: centre crop ``(height, width)`` (top =
    ``(H - h) // 2``) or None. Pixels ``p`` in ``[0, 1]`` become
    ``(p * 255 * rescale - mean) / std`` (``rescale`` is ``rescale_factor`` when
    ``do_rescale``, else 1; ``mean`` 0 and ``std`` 1 without ``do_normalize``).
    ``resample``: ``"bicubic"``, ``"bilinear"`` or ``"nearest"`` (PIL codes 3, 2, 0).
    """

    shortest_edge: int | None
    resize_to: tuple[int, int] | None
    crop: tuple[int, int] | None
    rescale: float
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    resample: str


_RESAMPLE = {0: "nearest", 2: "bilinear", 3: "bicubic"}
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def _size_pair(value: Any, where: str) -> tuple[int, int]:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value, value
    if isinstance(value, dict) and {"height", "width"} <= set(value):
        height, width = value["height"], value["width"]
        if all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (height, width)):
            return height, width
    raise ValueError(f"{where}: expected a positive int or {{height, width}}, got {value!r}")


def read_image_settings(directory: str | Path, field: str = "path") -> ImageSettings:
    """The :class:`ImageSettings` of ``directory/preprocessor_config.json`` (the keys of
    transformers' ``CLIPImageProcessor``, with its defaults for absent keys)."""
    path = Path(directory) / "preprocessor_config.json"
    data = _read_json(path, field)
    where = f"{field}: {path}"
    shortest_edge = resize_to = crop = None
    if data.get("do_resize", True):
        size = data.get("size", 224)
        if isinstance(size, dict) and "shortest_edge" in size:
            size = size["shortest_edge"]
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            shortest_edge = size
        else:
            resize_to = _size_pair(size, f"{where} 'size'")
    if data.get("do_center_crop", True):
        crop = _size_pair(data.get("crop_size", 224), f"{where} 'crop_size'")
    rescale = float(data.get("rescale_factor", 1 / 255)) if data.get("do_rescale", True) else 1.0
    mean, std = (0.0,) * 3, (1.0,) * 3
    if data.get("do_normalize", True):
        mean = tuple(float(v) for v in data.get("image_mean", _CLIP_MEAN))
        std = tuple(float(v) for v in data.get("image_std", _CLIP_STD))
        if len(mean) != 3 or len(std) != 3 or min(std) <= 0:
            raise ValueError(f"{where}: image_mean / image_std must be 3 values (std > 0)")
    resample = data.get("resample", 3)
    if resample not in _RESAMPLE:
        raise ValueError(
            f"{where}: resample {resample!r} is not supported; use 3 (bicubic), 2 (bilinear) or "
            "0 (nearest)"
        )
    return ImageSettings(shortest_edge, resize_to, crop, rescale, mean, std, _RESAMPLE[resample])


def preprocess_images(images: torch.Tensor, settings: ImageSettings) -> torch.Tensor:
    """``images`` ``[B, 3, H, W]`` in ``[0, 1]`` → the model's ``pixel_values`` (float32).

    Resizing is ``torch.nn.functional.interpolate`` (antialiased for bilinear / bicubic,
    then clamped to ``[0, 1]``, as an 8-bit image would be), so it matches the processor's PIL
    resize up to resampling and 8-bit rounding differences; crop and normalisation are exact.
    """
    images = images.float()
    height, width = images.shape[-2:]
    target = settings.resize_to
    if settings.shortest_edge is not None:
        edge = settings.shortest_edge
        short, long = min(height, width), max(height, width)
        other = int(edge * long / short)
        target = (edge, other) if height <= width else (other, edge)
    if target is not None and tuple(target) != (height, width):
        smooth = settings.resample != "nearest"
        images = F.interpolate(
            images,
            size=target,
            mode=settings.resample,
            antialias=smooth,
            **({"align_corners": False} if smooth else {}),
        ).clamp(0.0, 1.0)
        height, width = target
    if settings.crop is not None:
        crop_h, crop_w = settings.crop
        if crop_h > height or crop_w > width:
            raise ValueError(
                f"preprocess_images: the crop {crop_h}x{crop_w} is larger than the resized image "
                f"{height}x{width}; check size / crop_size in preprocessor_config.json"
            )
        top, left = (height - crop_h) // 2, (width - crop_w) // 2
        images = images[..., top : top + crop_h, left : left + crop_w]
    mean = images.new_tensor(settings.mean).view(1, 3, 1, 1)
    std = images.new_tensor(settings.std).view(1, 3, 1, 1)
    return (images * (255.0 * settings.rescale) - mean) / std


# ---------------------------------------------------------------------------- CLIP models
@dataclass(frozen=True)
class _Clip:
    """A loaded CLIP directory: model (eval, no grad), tokenizer, image settings, text length."""

    model: Any
    tokenizer: Any
    settings: ImageSettings
    max_length: int


def _check_clip_directory(path: Any, field: str) -> Path:
    """The CLIP directory after checking its files (cheap: reads only JSON)."""
    directory = _local_directory(path, field)
    config = _read_json(directory / "config.json", field)
    if config.get("model_type") != "clip":
        raise ValueError(
            f"{field}: {directory / 'config.json'} has model_type "
            f"{config.get('model_type')!r}; expected 'clip' (a transformers CLIPModel directory)"
        )
    _check_safetensors_weights(directory, field)
    tokenizer_files = ("tokenizer.json", "vocab.json", "tokenizer_config.json")
    if not any((directory / name).is_file() for name in tokenizer_files):
        raise ValueError(
            f"{field}: {directory} has no tokenizer files (tokenizer.json, or vocab.json and "
            "merges.txt); copy the tokenizer into the model directory"
        )
    read_image_settings(directory, field)
    return directory


def _load_clip(directory: Path, device: torch.device, dtype: torch.dtype) -> _Clip:
    def load() -> _Clip:
        from transformers import AutoTokenizer, CLIPModel

        model = CLIPModel.from_pretrained(directory, use_safetensors=True, local_files_only=True)
        model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        limit = model.config.text_config.max_position_embeddings
        max_length = min(int(getattr(tokenizer, "model_max_length", limit) or limit), limit)
        return _Clip(model, tokenizer, read_image_settings(directory), max_length)

    return _cached(("clip", str(directory.resolve()), str(device), dtype), load)


def _image_embeddings(clip: _Clip, images: torch.Tensor, batch_size: int) -> torch.Tensor:
    """L2-normalised projected image embeddings, float32 ``[B, D]`` on the model's device."""
    model = clip.model
    parameter = next(model.parameters())
    rows = []
    with torch.no_grad():
        for start in range(0, len(images), batch_size):
            chunk = images[start : start + batch_size].to(parameter.device)
            pixels = preprocess_images(chunk, clip.settings).to(parameter.dtype)
            pooled = model.vision_model(pixel_values=pixels).pooler_output
            rows.append(model.visual_projection(pooled).float())
    return F.normalize(torch.cat(rows), dim=-1)


def _text_embeddings(clip: _Clip, texts: Sequence[str], batch_size: int) -> torch.Tensor:
    """L2-normalised projected text embeddings, float32 ``[N, D]``; every text padded (and
    truncated) to the same fixed length, so a text's embedding does not depend on the others."""
    model = clip.model
    device = next(model.parameters()).device
    rows = []
    with torch.no_grad():
        for start in range(0, len(texts), batch_size):
            tokens = clip.tokenizer(
                list(texts[start : start + batch_size]),
                padding="max_length",
                truncation=True,
                max_length=clip.max_length,
                return_tensors="pt",
            )
            output = model.text_model(
                input_ids=tokens["input_ids"].to(device),
                attention_mask=tokens["attention_mask"].to(device),
            )
            rows.append(model.text_projection(output.pooler_output).float())
    return F.normalize(torch.cat(rows), dim=-1)


class _ClipReward:
    """Shared options and loading of the CLIP-based rewards."""

    name: str
    extra = "clip"

    def __init__(
        self,
        *,
        path: str | None = None,
        device: str | None = None,
        dtype: Literal["fp32", "bf16", "fp16"] = "fp32",
        batch_size: int = 32,
    ) -> None:
        _require(self.name, ("transformers",), self.extra)
        self.directory = _check_clip_directory(path, f"{self.name}.path")
        self.path = str(path)
        self.device = _check_device(f"{self.name}.device", device)
        if dtype not in _DTYPES:
            raise ValueError(f"{self.name}.dtype: expected one of {sorted(_DTYPES)}, got {dtype!r}")
        self.dtype = dtype
        self.batch_size = _check_positive_int(f"{self.name}.batch_size", batch_size)

    def _options(self) -> str:
        return f"path={self.path!r}, device={self.device!r}, dtype={self.dtype!r}"

    def clip(self, source: torch.device) -> _Clip:
        """The loaded model (cached per directory, device and dtype) on the configured device,
        else on ``source`` (the device the images came on)."""
        return _load_clip(self.directory, _resolve_device(self.device, source), _DTYPES[self.dtype])

    def _cosines(self, images: Any, examples: Sequence[Any]) -> tuple[_Clip, torch.Tensor]:
        """(the model, float32 ``[B]`` cosine of each image with its own prompt)."""
        pixels = _check_images(self.name, images, examples)
        prompts = [_prompt(self.name, example, i) for i, example in enumerate(examples)]
        clip = self.clip(pixels.device)
        unique = {p: i for i, p in enumerate(dict.fromkeys(prompts))}  # a group shares a prompt
        texts = _text_embeddings(clip, list(unique), self.batch_size)
        rows = torch.tensor([unique[p] for p in prompts], device=texts.device)
        image = _image_embeddings(clip, pixels, self.batch_size)
        return clip, (image * texts[rows]).sum(-1)


class _ScaledClipReward(_ClipReward):
    """A CLIP reward times ``scale`` (the options of :class:`ClipScoreReward`)."""

    def __init__(
        self,
        *,
        path: str | None = None,
        scale: float = 1.0,
        device: str | None = None,
        dtype: Literal["fp32", "bf16", "fp16"] = "fp32",
        batch_size: int = 32,
    ) -> None:
        super().__init__(path=path, device=device, dtype=dtype, batch_size=batch_size)
        self.scale = _check_real(f"{self.name}.scale", scale)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._options()}, scale={self.scale})"


class ClipScoreReward(_ScaledClipReward):
    """CLIP score: ``scale * cos(E_text(prompt), E_image(image))`` with a transformers
    ``CLIPModel`` from the local directory ``path`` (projected, L2-normalised embeddings; the
    raw cosine in ``[-1, 1]`` times ``scale``, no clipping at 0).

    Options: ``path`` (required), ``scale`` (default 1.0; the CLIPScore metric uses 2.5 with a
    clip at 0, torchmetrics 100), ``device`` (default: the images' device), ``dtype`` (``fp32``
    | ``bf16`` | ``fp16``), ``batch_size`` (images per forward).
    """

    name = "clip_score"

    def __call__(self, images: torch.Tensor, examples: Sequence[Any]) -> torch.Tensor:
        _, cosines = self._cosines(images, examples)
        return (self.scale * cosines).cpu()


class PickScoreReward(_ScaledClipReward):
    """PickScore-style preference: ``scale * exp(logit_scale) * cos(E_text, E_image)`` (the
    PickScore formula; the released PickScore_v1 is a CLIP-H ``CLIPModel`` with its
    ``logit_scale``, ~100, giving scores around 20). Flow-GRPO trains on ``scale = 1/26``.

    Options: ``path`` (required), ``scale`` (default 1.0), ``device``, ``dtype``,
    ``batch_size`` (as :class:`ClipScoreReward`).
    """

    name = "pickscore"

    def __call__(self, images: torch.Tensor, examples: Sequence[Any]) -> torch.Tensor:
        clip, cosines = self._cosines(images, examples)
        logit_scale = clip.model.logit_scale.detach().float().exp()
        return (self.scale * logit_scale * cosines).cpu()


# ---------------------------------------------------------------------------- aesthetic head
_LAYER_KEY = re.compile(r"(?:(?P<prefix>.*)\.)?(?P<index>\d+)\.(?P<kind>weight|bias)")


@dataclass(frozen=True)
class LinearHead:
    """Linear layers applied in order: ``x <- x @ W.T + b`` with ``activation`` between
    layers (never after the last); ``weights[i]`` is ``[out_i, in_i]``, ``in_{i+1} == out_i``
    and the last ``out`` is 1."""

    weights: tuple[torch.Tensor, ...]
    biases: tuple[torch.Tensor | None, ...]
    activation: str

    @property
    def in_features(self) -> int:
        return self.weights[0].shape[1]

    def to(self, device: torch.device) -> LinearHead:
        return LinearHead(
            tuple(w.to(device) for w in self.weights),
            tuple(None if b is None else b.to(device) for b in self.biases),
            self.activation,
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` float32 ``[B, in_features]`` → ``[B]``."""
        last = len(self.weights) - 1
        for i, (weight, bias) in enumerate(zip(self.weights, self.biases)):
            x = F.linear(x, weight, bias)
            if i < last and self.activation == "relu":
                x = F.relu(x)
            elif i < last and self.activation == "gelu":
                x = F.gelu(x)
        return x.squeeze(-1)


def _head_layout(keys: Sequence[str], shapes: dict[str, tuple[int, ...]], where: str) -> list:
    """[(weight key, bias key or None)] in layer order, after checking the key layout and the
    shapes (2-D weights chaining to one output, 1-D biases)."""
    if set(keys) <= {"weight", "bias"} and "weight" in keys:
        layers = [("weight", "bias" if "bias" in keys else None)]
    else:
        found: dict[int, dict[str, str]] = {}
        prefixes = set()
        for key in keys:
            match = _LAYER_KEY.fullmatch(key)
            if match is None:
                raise ValueError(
                    f"{where}: unexpected key {key!r}; expected '<prefix>.<index>.weight' / "
                    "'.bias' (e.g. layers.0.weight, as the LAION aesthetic predictor v2)"
                )
            prefixes.add(match["prefix"] or "")
            found.setdefault(int(match["index"]), {})[match["kind"]] = key
        if len(prefixes) != 1:
            raise ValueError(f"{where}: keys under several prefixes {sorted(prefixes)}; use one")
        layers = []
        for index in sorted(found):
            if "weight" not in found[index]:
                raise ValueError(f"{where}: layer {index} has a bias but no weight")
            layers.append((found[index]["weight"], found[index].get("bias")))
    previous = None
    for weight, bias in layers:
        shape = shapes[weight]
        if len(shape) != 2:
            raise ValueError(f"{where}: {weight!r} must be 2-D [out, in], got shape {shape}")
        if previous is not None and shape[1] != previous:
            raise ValueError(
                f"{where}: {weight!r} takes {shape[1]} inputs but the layer before gives {previous}"
            )
        if bias is not None and shapes[bias] != (shape[0],):
            raise ValueError(f"{where}: {bias!r} has shape {shapes[bias]}, expected ({shape[0]},)")
        previous = shape[0]
    if previous != 1:
        raise ValueError(f"{where}: the last layer has {previous} outputs; expected 1 (a score)")
    return layers


def load_linear_head(
    path: str | Path, activation: Literal["none", "relu", "gelu"] = "none", *, field: str = "head"
) -> LinearHead:
    """The :class:`LinearHead` stored in the safetensors file ``path`` (float32, CPU).

    Key layout: ``<prefix>.<i>.weight`` ``[out, in]`` and optional ``<prefix>.<i>.bias``
    ``[out]``, applied in increasing ``i`` (gaps allowed: the LAION aesthetic predictor v2
    stores ``layers.0``, ``layers.2``, ``layers.4``, ``layers.6``, ``layers.7``, 768 → 1024 →
    128 → 64 → 16 → 1, its dropouts in between and no activation), or a single ``weight`` /
    ``bias`` (a linear probe). The last layer has one output.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"{field}: {str(path)!r} is not a file; pass a .safetensors head file")
    if file.suffix != ".safetensors":
        raise ValueError(
            f"{field}: {file.name} is not a .safetensors file; only safetensors are loaded "
            "(convert a .pth head with safetensors.torch.save_file)"
        )
    try:
        with safe_open(str(file), framework="pt") as handle:
            shapes = {k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()}  # noqa: SIM118
    except Exception as error:
        raise ValueError(f"{field}: cannot read {file}: {error}") from None
    if not shapes:
        raise ValueError(f"{field}: {file} holds no tensors")
    if activation not in ("none", "relu", "gelu"):
        raise ValueError(
            f"{field}: activation must be 'none', 'relu' or 'gelu', got {activation!r}"
        )
    layers = _head_layout(sorted(shapes), shapes, f"{field}: {file}")
    tensors = load_file(str(file))
    return LinearHead(
        tuple(tensors[w].float() for w, _ in layers),
        tuple(None if b is None else tensors[b].float() for _, b in layers),
        activation,
    )


class AestheticReward(_ClipReward):
    """Aesthetic score: a linear head (:func:`load_linear_head`, from the safetensors file
    ``head``) on the L2-normalised projected CLIP image embedding of the image (the CLIP
    directory ``path``; the LAION aesthetic predictor v2 expects openai CLIP ViT-L/14, 768-d).
    Prompts are ignored.

    Options: ``path`` and ``head`` (both required), ``activation`` between head layers
    (``none`` for the LAION layout, ``relu``, ``gelu``), ``device``, ``dtype``, ``batch_size``.
    """

    name = "aesthetic"

    def __init__(
        self,
        *,
        path: str | None = None,
        head: str | None = None,
        activation: Literal["none", "relu", "gelu"] = "none",
        device: str | None = None,
        dtype: Literal["fp32", "bf16", "fp16"] = "fp32",
        batch_size: int = 32,
    ) -> None:
        super().__init__(path=path, device=device, dtype=dtype, batch_size=batch_size)
        if head is None:
            raise ValueError(
                "aesthetic.head: the option 'head' is required: a .safetensors file with the "
                "score head's linear layers (see docs/rewards.md)"
            )
        self.head_file = Path(head).expanduser()
        self.activation = activation
        width = load_linear_head(head, activation, field="aesthetic.head").in_features
        config = _read_json(self.directory / "config.json", "aesthetic.path")
        projection = config.get("projection_dim", 512)
        if width != projection:
            raise ValueError(
                f"aesthetic.head: {self.head_file.name} takes {width}-d inputs but the CLIP model "
                f"in {self.directory} projects to {projection}-d; use the head trained on this "
                "CLIP model"
            )

    def __repr__(self) -> str:
        return (
            f"AestheticReward({self._options()}, head={str(self.head_file)!r}, "
            f"activation={self.activation!r})"
        )

    def __call__(self, images: torch.Tensor, examples: Sequence[Any] | None = None) -> torch.Tensor:
        pixels = _check_images(self.name, images, examples)
        clip = self.clip(pixels.device)
        embeddings = _image_embeddings(clip, pixels, self.batch_size)
        key = ("head", str(self.head_file.resolve()), self.activation, str(embeddings.device))
        head = _cached(
            key, lambda: load_linear_head(self.head_file, self.activation).to(embeddings.device)
        )
        with torch.no_grad():
            return head(embeddings).cpu()


# ---------------------------------------------------------------------------- OCR
def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance: the fewest single-character insertions, deletions and
    substitutions turning ``a`` into ``b``."""
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, 1):
        current = [i]
        for j, char_b in enumerate(b, 1):
            current.append(
                min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b))
            )
        previous = current
    return previous[-1]


_QUOTED = re.compile(r'"([^"]*)"|“([^”]*)”')


def ocr_target_text(prompt: str) -> str | None:
    """The text the prompt asks to render: its double-quoted (``"..."`` or ``“...”``)
    segments joined by spaces, or None without quotes (``'a sign that says "OPEN"'`` →
    ``"OPEN"``)."""
    parts = [straight + curly for straight, curly in _QUOTED.findall(prompt)]  # one is ""
    return " ".join(parts) if parts else None


class OcrReward:
    """OCR reward: ``1 - min(d, len(t)) / len(t)`` with ``d`` the :func:`edit_distance`
    between the target text ``t`` and the text read from the image (Flow-GRPO's OCR reward),
    so an exact read scores 1.0 and nothing read scores 0.0.

    The target is the example's ``text_field`` (default ``text``) when the example has one,
    else the quoted text of its prompt (:func:`ocr_target_text`); an example with neither is
    a ``ValueError``. Both texts are compared lower-cased (``ignore_case``) and without
    whitespace (``ignore_spaces``); the texts the engine finds are joined in its reading
    order. The engine is RapidOCR (pip install 'diffusion-rl[ocr]': ``rapidocr`` and
    ``onnxruntime``; its PP-OCR detection and recognition models ship in the wheel and run
    on CPU; no text-direction classifier, generated text is upright), loaded once per process
    and ``detect`` setting; ``detect=False`` skips text detection and reads the whole image as
    one line (faster, for images holding one line of text).
    """

    name = "ocr"

    def __init__(
        self,
        *,
        text_field: str = "text",
        detect: bool = True,
        ignore_case: bool = True,
        ignore_spaces: bool = True,
    ) -> None:
        _require(self.name, ("rapidocr", "onnxruntime"), "ocr")
        if not isinstance(text_field, str) or not text_field:
            raise TypeError(f"ocr.text_field: expected a non-empty str, got {text_field!r}")
        for key, value in (
            ("detect", detect),
            ("ignore_case", ignore_case),
            ("ignore_spaces", ignore_spaces),
        ):
            if not isinstance(value, bool):
                raise TypeError(f"ocr.{key}: expected a bool, got {value!r}")
        self.text_field = text_field
        self.detect, self.ignore_case, self.ignore_spaces = detect, ignore_case, ignore_spaces

    def __repr__(self) -> str:
        return (
            f"OcrReward(text_field={self.text_field!r}, detect={self.detect}, "
            f"ignore_case={self.ignore_case}, ignore_spaces={self.ignore_spaces})"
        )

    def _normalise(self, text: str) -> str:
        if self.ignore_spaces:
            text = "".join(text.split())
        return text.lower() if self.ignore_case else text

    def target(self, example: Any, index: int) -> str:
        """The normalised target text of one example (see the class docstring)."""
        if isinstance(example, dict):
            text = example.get(self.text_field)
        else:
            text = None if isinstance(example, str) else getattr(example, self.text_field, None)
        if text is None:
            text = ocr_target_text(_prompt(self.name, example, index))
        if not isinstance(text, str) or not self._normalise(text):
            raise ValueError(
                f"ocr: example {index} has no target text: give it a non-empty "
                f"{self.text_field!r} field or put the text in double quotes in the prompt "
                '(a sign that says "OPEN")'
            )
        return self._normalise(text)

    def engine(self) -> Any:
        """The RapidOCR engine (cached per process and ``detect`` setting)."""

        def load() -> Any:
            try:
                from rapidocr import RapidOCR
            except ImportError as error:
                raise ImportError(
                    f"the ocr reward needs rapidocr and onnxruntime ({error}): "
                    "pip install 'diffusion-rl[ocr]'"
                ) from None
            params = {
                "Global.use_det": self.detect,
                "Global.use_cls": False,  # generated text is upright (as Flow-GRPO's OCR reward)
                "Global.log_level": "error",
            }
            return RapidOCR(params=params)

        return _cached(("ocr", self.detect), load)

    def read(self, image: torch.Tensor) -> str:
        """The text the engine reads in one image ``[3, H, W]`` in ``[0, 1]`` ("" for none)."""
        pixels = (image.permute(1, 2, 0) * 255).round().clamp(0, 255).to(torch.uint8).numpy()
        result = self.engine()(pixels[..., ::-1].copy())  # the engine takes BGR arrays
        return " ".join(getattr(result, "txts", None) or ())

    def score(self, read: str, target: str) -> float:
        """``1 - min(d, len(target)) / len(target)`` on the normalised texts."""
        target, read = self._normalise(target), self._normalise(read)
        return 1.0 - min(edit_distance(read, target), len(target)) / len(target)

    def __call__(self, images: torch.Tensor, examples: Sequence[Any]) -> torch.Tensor:
        images = _check_images(self.name, images, examples).cpu()
        targets = [self.target(example, index) for index, example in enumerate(examples)]
        values = [self.score(self.read(image), t) for image, t in zip(images, targets)]
        return torch.tensor(values, dtype=torch.float32)


MODEL_REWARDS = {
    "clip_score": ClipScoreReward,
    "pickscore": PickScoreReward,
    "aesthetic": AestheticReward,
    "ocr": OcrReward,
}
