"""Hugging Face diffusion LMs from local checkpoint directories, as
:class:`~diffusion_rl.models.TokenDenoiser` adapters over transformers' stock classes.

* :class:`LLaDADenoiser` (``model_type: llada``; ``LlamaForCausalLM`` with a key map),
* :class:`DreamDenoiser` (``model_type: Dream``; ``Qwen2ForCausalLM``, shifted logits aligned),
* ``SDARDenoiser`` (``model_type: sdar``; ``diffusion_rl.models.hf.sdar``),
* :class:`HFTokenizer`: the directory's tokenizer and chat template.

:func:`diffusion_rl.models.load_model` picks the adapter from ``config.json``'s
``model_type`` (``diffusion_rl.models.io.HF_MODEL_TYPES``). Importing this package does not
import transformers; building a model does. See docs/models.md for each family's conventions.
"""

from .common import (
    CheckpointFormatError,
    CheckpointKeyError,
    FamilyConfig,
    HFTokenDenoiser,
    KeyMap,
)
from .dream import DreamDenoiser
from .llada import LLADA_KEY_MAP, LLaDADenoiser
from .tokenizer import HFTokenizer

__all__ = [
    "LLADA_KEY_MAP",
    "CheckpointFormatError",
    "CheckpointKeyError",
    "DreamDenoiser",
    "FamilyConfig",
    "HFTokenDenoiser",
    "HFTokenizer",
    "KeyMap",
    "LLaDADenoiser",
]
