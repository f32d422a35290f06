"""A character-level tokenizer built locally (no downloads).

Invariants:

* Special tokens come first with fixed ids: ``<pad>`` = 0, ``<mask>`` = 1, ``<eos>`` = 2.
* Character ``chars[k]`` has id ``3 + k``; ``vocab_size == 3 + len(chars)``.
* ``name`` depends only on the format version and the vocabulary, so two tokenizers with the
  same name map text to ids identically (safe to record in checkpoint metadata).
* ``chat_prompt(text)`` is the identity: one token per character, no chat template.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = ["CharTokenizer"]

_FILE_NAME = "tokenizer.json"
_TYPE = "char"
_VERSION = 1
_SPECIAL_TOKENS = ("<pad>", "<mask>", "<eos>")


class CharTokenizer:
    """Maps each allowed character to one token id; see the module docstring for the id layout.

    Args:
        chars: the characters of the vocabulary, in id order, each exactly once
            (e.g. ``"0123456789+-="``).
    """

    special_tokens: tuple[str, ...] = _SPECIAL_TOKENS

    def __init__(self, chars: str) -> None:
        if not isinstance(chars, str):
            raise TypeError(f"CharTokenizer.chars: expected a str, got {type(chars).__name__}")
        if not chars:
            raise ValueError("CharTokenizer.chars: expected at least one character, got ''")
        duplicates = sorted({c for c in chars if chars.count(c) > 1})
        if duplicates:
            raise ValueError(
                f"CharTokenizer.chars: expected each character once, got duplicates {duplicates}"
            )
        self._chars = chars
        offset = len(_SPECIAL_TOKENS)
        self._char_to_id = {c: offset + k for k, c in enumerate(chars)}
        self._id_to_char = {i: c for c, i in self._char_to_id.items()}
        digest = hashlib.sha256(
            json.dumps({"special_tokens": _SPECIAL_TOKENS, "chars": chars}).encode("utf-8")
        ).hexdigest()
        self._name = f"char-v{_VERSION}:{digest[:12]}"

    # ------------------------------------------------------------------ properties
    @property
    def chars(self) -> str:
        """The vocabulary characters in id order (ids ``3 ..``)."""
        return self._chars

    @property
    def vocab_size(self) -> int:
        return len(_SPECIAL_TOKENS) + len(self._chars)

    @property
    def pad_id(self) -> int:
        return 0

    @property
    def mask_id(self) -> int:
        return 1

    @property
    def eos_id(self) -> int:
        return 2

    @property
    def name(self) -> str:
        """Stable identifier ``"char-v1:<12 hex chars of sha256(vocabulary)>"``."""
        return self._name

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharTokenizer) and other._chars == self._chars

    def __hash__(self) -> int:
        return hash(self._chars)

    def __repr__(self) -> str:
        return f"CharTokenizer(chars={self._chars!r})"

    # ------------------------------------------------------------ encode / decode
    def encode(self, text: str) -> list[int]:
        """One id per character of ``text``; no special tokens are added.

        Raises:
            ValueError: on a character outside the vocabulary (the message names it and the
                allowed set).
        """
        if not isinstance(text, str):
            raise TypeError(f"CharTokenizer.encode: expected a str, got {type(text).__name__}")
        ids = []
        for position, char in enumerate(text):
            token = self._char_to_id.get(char)
            if token is None:
                raise ValueError(
                    f"CharTokenizer.encode: unknown character {char!r} at position {position} "
                    f"of {text!r}; allowed characters are {self._chars!r}"
                )
            ids.append(token)
        return ids

    def decode(self, ids: Sequence[int] | torch.Tensor, stop_at_eos: bool = True) -> str:
        """Text of a 1-D id sequence.

        Special tokens are dropped; with ``stop_at_eos`` everything from the first ``<eos>`` on
        is dropped too.

        Raises:
            ValueError: on an id outside ``[0, vocab_size)`` or a tensor that is not 1-D.
        """
        if isinstance(ids, torch.Tensor):
            if ids.dim() != 1:
                raise ValueError(
                    f"CharTokenizer.decode: expected a 1-D tensor, got shape {tuple(ids.shape)}"
                )
            ids = ids.tolist()
        pieces = []
        for token in ids:
            token = int(token)
            if token == self.eos_id and stop_at_eos:
                break
            char = self._id_to_char.get(token)
            if char is not None:
                pieces.append(char)
            elif not 0 <= token < len(_SPECIAL_TOKENS):
                raise ValueError(
                    f"CharTokenizer.decode: id {token} is outside the vocabulary "
                    f"[0, {self.vocab_size})"
                )
        return "".join(pieces)

    def batch_decode(
        self, ids: Sequence[Sequence[int]] | torch.Tensor, stop_at_eos: bool = True
    ) -> list[str]:
        """:meth:`decode` of each row of a ``[B, L]`` tensor or a list of id lists."""
        if isinstance(ids, torch.Tensor) and ids.dim() != 2:
            raise ValueError(
                f"CharTokenizer.batch_decode: expected a 2-D tensor [B, L], got shape "
                f"{tuple(ids.shape)}"
            )
        return [self.decode(row, stop_at_eos=stop_at_eos) for row in ids]

    def chat_prompt(self, text: str) -> str:
        """``text`` unchanged: a character tokenizer has no chat template (the duck interface
        a tokenizer offers the tasks; an ``HFTokenizer`` applies its directory's template)."""
        if not isinstance(text, str):
            raise TypeError(f"CharTokenizer.chat_prompt: expected a str, got {type(text).__name__}")
        return text

    # ------------------------------------------------------------------ save / load
    def to_dict(self) -> dict:
        """The JSON-serialisable form written by :meth:`save`."""
        return {
            "type": _TYPE,
            "version": _VERSION,
            "chars": self._chars,
            "special_tokens": {token: i for i, token in enumerate(_SPECIAL_TOKENS)},
        }

    def save(self, directory: str | os.PathLike) -> Path:
        """Write ``directory/tokenizer.json`` (creating ``directory``); returns the file path."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / _FILE_NAME
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n", "utf-8")
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, directory: str | os.PathLike) -> CharTokenizer:
        """Read ``directory/tokenizer.json`` written by :meth:`save`.

        Raises:
            FileNotFoundError: no ``tokenizer.json`` in ``directory``.
            ValueError: the file is not valid JSON, not a ``"char"`` tokenizer, has another
                version, or has different special tokens.
        """
        path = Path(directory) / _FILE_NAME
        if not path.is_file():
            raise FileNotFoundError(f"CharTokenizer.load: no {_FILE_NAME} in {str(directory)!r}")
        try:
            data = json.loads(path.read_text("utf-8"))
        except json.JSONDecodeError as error:
            raise ValueError(
                f"CharTokenizer.load: {str(path)!r} is not valid JSON: {error}"
            ) from None
        if not isinstance(data, dict):
            raise ValueError(
                f"CharTokenizer.load: {str(path)!r} must hold a JSON object, "
                f"got {type(data).__name__}"
            )
        if data.get("type") != _TYPE:
            raise ValueError(
                f"CharTokenizer.load: {str(path)!r} has type {data.get('type')!r}, "
                f"expected {_TYPE!r}"
            )
        if data.get("version") != _VERSION:
            raise ValueError(
                f"CharTokenizer.load: {str(path)!r} has version {data.get('version')!r}, "
                f"expected {_VERSION}"
            )
        expected_special = {token: i for i, token in enumerate(_SPECIAL_TOKENS)}
        if data.get("special_tokens") != expected_special:
            raise ValueError(
                f"CharTokenizer.load: {str(path)!r} has special_tokens "
                f"{data.get('special_tokens')!r}, expected {expected_special!r}"
            )
        chars = data.get("chars")
        if not isinstance(chars, str):
            raise ValueError(
                f"CharTokenizer.load: {str(path)!r} field 'chars' must be a string, "
                f"got {type(chars).__name__}"
            )
        return cls(chars)
