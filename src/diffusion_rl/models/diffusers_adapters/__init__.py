"""diffusers flow-matching pipelines (SD3, FLUX, Wan, Wan image-to-video) as
:class:`VelocityModel` s.

Needs the ``hf`` extra (``transformers``, ``diffusers``, ``peft``, ``ftfy``). Real use:
``SD3Adapter.from_pretrained("/models/sd3.5-medium", torch_dtype=torch.bfloat16,
lora=LoraSettings(rank=32))`` on a local pipeline directory, or
``adapter_for_directory(path).from_pretrained(path, ...)`` to pick the adapter from the
directory's ``model_index.json``; tests: ``SD3Adapter.tiny(seed)``. See :mod:`.base` for the
conventions every adapter keeps, :mod:`.export` for the merged export of a trained pipeline
(``from diffusion_rl.models.diffusers_adapters.export import export_flow_model``), and
docs/flow_models.md for training one from a config.
"""

from __future__ import annotations

import json
from pathlib import Path

from .base import FlowPipelineAdapter, LoraSettings
from .flux import FluxAdapter
from .sd3 import SD3Adapter
from .wan import WanAdapter
from .wan_i2v import WanImageToVideoAdapter

ADAPTERS: dict[str, type[FlowPipelineAdapter]] = {
    "sd3": SD3Adapter,
    "flux": FluxAdapter,
    "wan": WanAdapter,
    "wan-i2v": WanImageToVideoAdapter,
}
# model_index.json ``_class_name`` → the adapter that loads such a directory
PIPELINE_ADAPTERS = {adapter.pipeline_class.__name__: adapter for adapter in ADAPTERS.values()}

__all__ = [
    "ADAPTERS",
    "PIPELINE_ADAPTERS",
    "FlowPipelineAdapter",
    "FluxAdapter",
    "LoraSettings",
    "SD3Adapter",
    "WanAdapter",
    "WanImageToVideoAdapter",
    "adapter_for_directory",
]


def adapter_for_directory(directory: str | Path) -> type[FlowPipelineAdapter]:
    """The adapter class for a local diffusers pipeline directory, chosen by the
    ``_class_name`` of its ``model_index.json`` (``FileNotFoundError`` without one,
    ``ValueError`` for a pipeline no adapter wraps)."""
    index = Path(directory).expanduser() / "model_index.json"
    if not index.is_file():
        raise FileNotFoundError(
            f"adapter_for_directory: {index} does not exist; pass the root of a local diffusers "
            "pipeline directory (fetch one with `hf download <repo-id> --local-dir <dir>`)"
        )
    class_name = json.loads(index.read_text()).get("_class_name")
    if class_name not in PIPELINE_ADAPTERS:
        raise ValueError(
            f"{index}: _class_name is {class_name!r}; adapters exist for "
            f"{sorted(PIPELINE_ADAPTERS)}"
        )
    return PIPELINE_ADAPTERS[class_name]
