"""LoRA settings shared by every model family (token denoisers and flow generators).

Only the settings live here (no peft import), so configs can hold them without the ``hf``
extra. ``alpha`` defaults to ``rank`` (scale 1); ``target_modules`` defaults to the family's
own list (peft matches names as suffixes of module names); ``dropout`` is 0 by default, so a
LoRA run stays deterministic. The LoRA B matrices start at zero, so a fresh LoRA leaves the
model's output bitwise unchanged.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["LoraSettings"]


class LoraSettings(BaseModel):
    """``rank`` r, ``alpha`` (None: r), ``dropout`` in [0, 1), ``target_modules`` (None: the
    model family's default targets)."""

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(16, gt=0)
    alpha: float | None = Field(None, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] | None = None
