"""diffusers flow-matching pipelines (SD3, FLUX, Wan) as :class:`VelocityModel` s.

Needs the ``hf`` extra (``transformers``, ``diffusers``, ``peft``). Real use:
``SD3Adapter.from_pretrained("/models/sd3.5-medium", torch_dtype=torch.bfloat16,
lora=LoraSettings(rank=32))`` on a local pipeline directory; tests: ``SD3Adapter.tiny(seed)``.
See :mod:`.base` for the conventions every adapter keeps.
"""

from .base import FlowPipelineAdapter, LoraSettings
from .flux import FluxAdapter
from .sd3 import SD3Adapter
from .wan import WanAdapter

ADAPTERS = {"sd3": SD3Adapter, "flux": FluxAdapter, "wan": WanAdapter}

__all__ = [
    "ADAPTERS",
    "FlowPipelineAdapter",
    "FluxAdapter",
    "LoraSettings",
    "SD3Adapter",
    "WanAdapter",
]
