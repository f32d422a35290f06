"""A Hugging Face tokenizer from a local checkpoint directory, with the interface of
:class:`~diffusion_rl.models.tokenizer.CharTokenizer`.

Invariants:

* ``vocab_size`` is the MODEL's (the rows of its logits, from ``config.json``); the tokenizer
  may know fewer ids (``len(hf) <= vocab_size``; LLaDA pads its embedding to 126464). Ids in
  ``[len(hf), vocab_size)`` decode to nothing.
* ``mask_id`` is ``config.json`` ``mask_token_id``; when the tokenizer has a mask token it
  must be the same id.
* ``encode`` adds no special tokens (a chat template, :meth:`HFTokenizer.chat_prompt`, carries
  its own BOS); ``decode`` drops special tokens and, with ``stop_at_eos``, everything from the
  first stop token on (:attr:`HFTokenizer.stop_ids`: EOS, the chat template's end-of-turn
  token, ``generation_config.json``'s EOS ids).
* ``name`` depends only on what maps text to ids (the tokenizer's serialised pipeline, chat
  template, special ids, vocab size), so it survives :meth:`HFTokenizer.save` and reload.
* Nothing is downloaded (``local_files_only``) and a tokenizer class that is remote code is
  refused unless ``trust_remote_code=True``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..loading import MAX_JSON_BYTES, ModelConfigError, check_local_directory
from .common import CONFIG_FILE, read_json_object, require_transformers

__all__ = ["HFTokenizer"]

_VERSION = 1
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "chat_template.json",
)
"""JSON files a tokenizer directory may hold; each is refused past ``MAX_JSON_BYTES``."""


def _first_id(value: Any) -> int | None:
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _ids(value: Any) -> list[int]:
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


class HFTokenizer:
    """A transformers tokenizer (``hf``) behind the CharTokenizer interface (module docstring).

    Args:
        hf: the loaded transformers tokenizer.
        vocab_size: the model's vocabulary (logit rows), ``>= len(hf)``.
        mask_id: the model's MASK id (``config.json`` ``mask_token_id``).
        pad_id, eos_id: defaults: the tokenizer's, else ``config.json``'s.
        extra_stop_ids: further ids that end a completion (e.g. generation_config EOS ids).
    """

    def __init__(
        self,
        hf,
        *,
        vocab_size: int,
        mask_id: int,
        pad_id: int | None = None,
        eos_id: int | None = None,
        extra_stop_ids: Iterable[int] = (),
        source: str = "tokenizer",
    ) -> None:
        self.hf = hf
        known = len(hf)
        if known > vocab_size:
            raise ValueError(
                f"{source}: the tokenizer has {known} ids, more than the model's vocab_size "
                f"{vocab_size}; is it the model's tokenizer?"
            )
        if not 0 <= mask_id < vocab_size:
            raise ValueError(f"{source}: mask_token_id={mask_id} is outside [0, {vocab_size})")
        own_mask = hf.mask_token_id
        if own_mask is not None and own_mask != mask_id:
            raise ValueError(
                f"{source}: the tokenizer's mask token {hf.mask_token!r} has id {own_mask}, "
                f"config.json says mask_token_id={mask_id}; they must agree"
            )
        eos = hf.eos_token_id if hf.eos_token_id is not None else eos_id
        if eos is None:
            raise ValueError(f"{source}: no EOS token (tokenizer eos_token or eos_token_id)")
        pad = hf.pad_token_id if hf.pad_token_id is not None else pad_id
        self._vocab_size, self._mask_id = vocab_size, mask_id
        self._eos_id, self._pad_id = int(eos), int(eos if pad is None else pad)
        stops = {self._eos_id, *extra_stop_ids}
        turn_end = self._end_of_turn_id()
        if turn_end is not None:
            stops.add(turn_end)
        self.stop_ids: frozenset[int] = frozenset(stops)
        self._special = set(hf.all_special_ids)
        self._name = self._fingerprint()

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(
        cls,
        directory: str | os.PathLike,
        *,
        vocab_size: int | None = None,
        mask_id: int | None = None,
        trust_remote_code: bool = False,
    ) -> HFTokenizer:
        """The tokenizer of the local checkpoint ``directory`` (``AutoTokenizer``, local files
        only). ``vocab_size`` / ``mask_id`` default to ``config.json``'s ``embedding_size`` or
        ``vocab_size`` and ``mask_token_id``.

        Raises:
            HubIdError / FileNotFoundError: ``directory`` is not a local directory.
            ModelConfigError: a JSON file is too large or malformed.
            ValueError: the tokenizer class is remote code and ``trust_remote_code`` is False,
                the tokenizer does not fit the model (more ids, another mask id), or no EOS.
        """
        directory = check_local_directory(directory, "tokenizer directory")
        for name in TOKENIZER_FILES:
            path = directory / name
            if path.is_file() and path.stat().st_size > MAX_JSON_BYTES:
                raise ModelConfigError(
                    f"{path}: {path.stat().st_size} bytes, more than the {MAX_JSON_BYTES} a "
                    "tokenizer file may have"
                )
        settings_path = directory / "tokenizer_config.json"
        settings = (
            read_json_object(settings_path, "tokenizer config") if settings_path.is_file() else {}
        )
        auto_map = settings.get("auto_map")
        if auto_map and not trust_remote_code:
            raise ValueError(
                f"{settings_path}: the tokenizer class {settings.get('tokenizer_class')!r} is "
                f"remote code (auto_map {auto_map!r}); diffusion_rl runs no code from a "
                "checkpoint directory unless trust_remote_code=True is passed. If the class is "
                "a stock one under another name (Dream's DreamTokenizer is a Qwen2 byte-level "
                "BPE), set tokenizer_class to the stock class (e.g. 'Qwen2Tokenizer') and "
                "remove auto_map in your local copy instead"
            )
        config_path = directory / CONFIG_FILE
        config = read_json_object(config_path) if config_path.is_file() else {}
        if vocab_size is None:
            vocab_size = config.get("embedding_size") or config.get("vocab_size")
        if mask_id is None:
            mask_id = config.get("mask_token_id")
        if not isinstance(vocab_size, int) or not isinstance(mask_id, int):
            raise ValueError(
                f"{config_path}: needs integer vocab_size and mask_token_id for the tokenizer "
                f"(got {vocab_size!r}, {mask_id!r})"
            )
        transformers = require_transformers()
        hf = transformers.AutoTokenizer.from_pretrained(
            str(directory),
            local_files_only=True,
            trust_remote_code=trust_remote_code,
            # the model config is not a transformers one: do not let AutoTokenizer read it
            config=transformers.PretrainedConfig(),
        )
        generation = directory / "generation_config.json"
        extra = (
            _ids(read_json_object(generation).get("eos_token_id")) if generation.is_file() else []
        )
        return cls(
            hf,
            vocab_size=vocab_size,
            mask_id=mask_id,
            pad_id=_first_id(config.get("pad_token_id")),
            eos_id=_first_id(config.get("eos_token_id")),
            extra_stop_ids=extra,
            source=str(directory),
        )

    def save(self, directory: str | os.PathLike) -> Path:
        """Write the tokenizer files into ``directory`` (``save_pretrained``); returns it."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.hf.save_pretrained(str(directory))
        return directory

    # ------------------------------------------------------------------ properties
    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def mask_id(self) -> int:
        return self._mask_id

    @property
    def pad_id(self) -> int:
        return self._pad_id

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def name(self) -> str:
        """``"hf-v1:<12 hex chars>"`` (module docstring: what it depends on)."""
        return self._name

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HFTokenizer) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self._name)

    def __repr__(self) -> str:
        return f"HFTokenizer({type(self.hf).__name__}, vocab_size={self._vocab_size}, name={self._name!r})"

    def _fingerprint(self) -> str:
        backend = getattr(self.hf, "backend_tokenizer", None)
        pipeline = (
            backend.to_str()
            if backend is not None
            else json.dumps(sorted(self.hf.get_vocab().items()))
        )
        record = {
            "pipeline": pipeline,
            "chat_template": getattr(self.hf, "chat_template", None),
            "ids": [self._vocab_size, self._mask_id, self._pad_id, self._eos_id],
            "stop": sorted(self.stop_ids),
        }
        digest = hashlib.sha256(json.dumps(record, sort_keys=True).encode("utf-8")).hexdigest()
        return f"hf-v{_VERSION}:{digest[:12]}"

    def _end_of_turn_id(self) -> int | None:
        """The first special token the chat template puts after a message's text (LLaDA's
        ``<|eot_id|>``, Qwen's ``<|im_end|>``), or None without a template."""
        if not getattr(self.hf, "chat_template", None):
            return None
        marker = "\u2063diffusion-rl\u2063"
        text = self.hf.apply_chat_template(
            [{"role": "user", "content": marker}], tokenize=False, add_generation_prompt=False
        )
        if not isinstance(text, str) or marker not in text:
            return None
        tail = self.hf.encode(text.split(marker, 1)[1], add_special_tokens=False)
        special = set(self.hf.all_special_ids) | set(getattr(self.hf, "added_tokens_decoder", {}))
        return next((token for token in tail if token in special), None)

    # ------------------------------------------------------------------ encode / decode
    def encode(self, text: str) -> list[int]:
        """The ids of ``text``, no special tokens added (special-token strings in ``text``
        map to their ids)."""
        if not isinstance(text, str):
            raise TypeError(f"HFTokenizer.encode: expected a str, got {type(text).__name__}")
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int] | torch.Tensor, stop_at_eos: bool = True) -> str:
        """Text of a 1-D id sequence: special tokens and ids the tokenizer does not know are
        dropped; with ``stop_at_eos`` everything from the first stop id on is dropped too.

        Raises:
            ValueError: an id outside ``[0, vocab_size)`` or a tensor that is not 1-D.
        """
        if isinstance(ids, torch.Tensor):
            if ids.dim() != 1:
                raise ValueError(
                    f"HFTokenizer.decode: expected a 1-D tensor, got shape {tuple(ids.shape)}"
                )
            ids = ids.tolist()
        known, kept = len(self.hf), []
        for token in ids:
            token = int(token)
            if not 0 <= token < self._vocab_size:
                raise ValueError(
                    f"HFTokenizer.decode: id {token} is outside the vocabulary "
                    f"[0, {self._vocab_size})"
                )
            if stop_at_eos and token in self.stop_ids:
                break
            if token < known and token not in self._special:
                kept.append(token)
        return self.hf.decode(kept, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def batch_decode(
        self, ids: Sequence[Sequence[int]] | torch.Tensor, stop_at_eos: bool = True
    ) -> list[str]:
        """:meth:`decode` of each row of a ``[B, L]`` tensor or a list of id lists."""
        if isinstance(ids, torch.Tensor) and ids.dim() != 2:
            raise ValueError(
                f"HFTokenizer.batch_decode: expected a 2-D tensor [B, L], got shape "
                f"{tuple(ids.shape)}"
            )
        return [self.decode(row, stop_at_eos=stop_at_eos) for row in ids]

    def chat_prompt(self, text: str) -> str:
        """``text`` as one user message under the directory's chat template, with the
        generation prompt (the assistant header) appended.

        Raises:
            ValueError: the directory has no chat template (a base model: use plain prompts).
        """
        if not self.has_chat_template:
            raise ValueError(
                f"{self._name}: this tokenizer has no chat template (a base model?); use plain "
                "prompts, or a directory whose tokenizer_config.json has a chat_template"
            )
        return self.hf.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
