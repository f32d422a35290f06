"""The token world's text tasks: what they share, tokenizer-agnostic.

A text task makes text prompts (``example.prompt``), the text a model should complete them with
(:meth:`TextTask.target_text`, the SFT target) and a verifier of completion text
(:meth:`TextTask.reward`). A *tokenizer* turns text into tensors: the model's (a recipe passes
the loaded model's tokenizer), or by default the task's own
:class:`~diffusion_rl.models.tokenizer.CharTokenizer` over :attr:`TextTask.characters`.
Any object with CharTokenizer's duck interface works (``name``, ``vocab_size``, ``pad_id``,
``mask_id``, ``eos_id``, ``encode``, ``decode``, ``batch_decode``, ``chat_prompt``).

Invariants of :meth:`TextTask.encode`:

* The prompt text is ``example.prompt``, or ``tokenizer.chat_prompt(example.prompt)`` when the
  config says ``chat: true`` (identity for a CharTokenizer).
* Prompts are LEFT-padded with ``tokenizer.pad_id``; ``prompt_mask`` is True on real tokens.
  The width is :attr:`TextTask.prompt_length` when that is fixed: the config's
  ``max_prompt_tokens``, else, with a CharTokenizer (one token per character), the task's
  bound in characters (:attr:`TextTask.char_prompt_length`). Otherwise (a subword tokenizer
  and no ``max_prompt_tokens``) it is the longest prompt of the batch. A prompt wider than a
  fixed width raises ``ValueError``.
* Completions are ``[B, completion_length]``: the target's tokens, then ``eos_id`` to the end;
  ``completion_mask`` is all True (the ``<eos>`` fill is trained too). A target needing more
  than ``completion_length`` slots with one ``<eos>`` raises ``ValueError``, or, for a task
  with ``truncate_targets`` (the dataset tasks), is cut to ``completion_length`` tokens
  (then without ``<eos>``; only SFT reads targets: rollouts and evaluation use the prompts).
* ``example(index, split)`` is a pure function of the config, ``split`` and ``index``
  (splits ``"train"`` and ``"eval"``); generated tasks seed one ``random.Random`` per example
  from a SHA-256 of ``(seed_key, config.seed, split, index)``.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel

from ..models.tokenizer import CharTokenizer
from .prompts import task_config

__all__ = ["Split", "TextTask", "TokenizerMismatchError", "check_index", "check_split"]

Split = Literal["train", "eval"]
SPLITS = ("train", "eval")


class TokenizerMismatchError(ValueError):
    """A character tokenizer that cannot encode a task's text (it lacks some characters)."""


def check_index(index: Any) -> int:
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"index: expected an int >= 0, got {index!r}")
    return index


def check_split(split: Any) -> str:
    if split not in SPLITS:
        raise ValueError(f"split: expected one of {SPLITS}, got {split!r}")
    return split


class TextTask:
    """Base of the text tasks (see the module docstring for the encoding invariants).

    A subclass sets ``name``, ``config_class`` and ``seed_key`` (generated tasks), and defines
    :meth:`example`, :meth:`reward`, :attr:`characters`, :attr:`completion_length` and
    :attr:`char_prompt_length`; it may override :meth:`target_text` (default
    ``example.answer``) and :meth:`_prepare` (called before the tokenizer is set, e.g. to read
    a file).

    Args:
        config: an instance of ``config_class``; ``None`` means the defaults.
        tokenizer: the tokenizer to encode with (the model's); ``None``: the task's own
            ``CharTokenizer(characters)``. A CharTokenizer lacking some of the task's
            characters raises :class:`TokenizerMismatchError`.
    """

    name: ClassVar[str]
    config_class: ClassVar[type[BaseModel]]
    seed_key: ClassVar[str] = ""
    truncate_targets: ClassVar[bool] = False

    def __init__(self, config: BaseModel | None = None, tokenizer: Any = None) -> None:
        self.config = task_config(self, config)
        self._prepare()
        self.tokenizer = CharTokenizer(self.characters) if tokenizer is None else tokenizer
        if isinstance(self.tokenizer, CharTokenizer):
            missing = sorted(set(self.characters) - set(self.tokenizer.chars))
            if missing:
                raise TokenizerMismatchError(
                    f"the tokenizer {self.tokenizer.name} lacks the characters {missing} that "
                    f"the {self.name} task writes (its characters: {self.characters!r}); use a "
                    "model trained with the task's tokenizer"
                )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"

    def _prepare(self) -> None:
        """Hook run after the config check, before the tokenizer is set (default: nothing)."""

    # ------------------------------------------------------------------ to define
    @property
    def characters(self) -> str:
        """Every character the task's prompts and targets use (the default tokenizer's)."""
        raise NotImplementedError

    @property
    def char_prompt_length(self) -> int:
        """The longest prompt in characters (= tokens with a CharTokenizer, whose chat template
        is the identity)."""
        raise NotImplementedError

    @property
    def completion_length(self) -> int:
        """L: completion slots (a multiple of ``block_size``)."""
        raise NotImplementedError

    def example(self, index: int, split: Split = "train"):
        raise NotImplementedError

    def reward(self, completion_text: str, example: Any) -> float:
        raise NotImplementedError

    # a graded score that training does not use (held out beside the reward), and its name in
    # tables; None: the task has none
    credit_name: ClassVar[str | None] = None

    def credit(self, completion_text: str, example: Any) -> float:
        """Partial credit in [0, 1] of one completion (only where ``credit_name`` is set)."""
        raise NotImplementedError(f"the {self.name} task has no partial credit")

    # ------------------------------------------------------------------ settings
    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def chat(self) -> bool:
        """Whether prompts go through ``tokenizer.chat_prompt`` (config ``chat``)."""
        return bool(getattr(self.config, "chat", False))

    @property
    def prompt_length(self) -> int | None:
        """P, the width every prompt is padded to, when it is fixed: ``max_prompt_tokens``,
        else :attr:`char_prompt_length` with a CharTokenizer; None: the longest prompt of each
        batch (a subword tokenizer without ``max_prompt_tokens``)."""
        limit = getattr(self.config, "max_prompt_tokens", None)
        if limit is not None:
            return limit
        if isinstance(self.tokenizer, CharTokenizer):
            return self.char_prompt_length
        return None

    # ------------------------------------------------------------------ examples
    def _rng(self, index: int, split: str) -> random.Random:
        """The example's own generator (no global RNG): seeded from
        ``sha256(f"{seed_key}:{config.seed}:{split}:{index}")``."""
        check_index(index)
        check_split(split)
        key = f"{self.seed_key}:{self.config.seed}:{split}:{index}".encode()
        return random.Random(int.from_bytes(hashlib.sha256(key).digest()[:8], "little"))

    def examples(self, indices: Iterable[int], split: Split = "train") -> list:
        return [self.example(int(i), split) for i in indices]

    def prompt_text(self, example: Any) -> str:
        """The text the model is prompted with (chat template applied when ``chat``)."""
        return self.tokenizer.chat_prompt(example.prompt) if self.chat else example.prompt

    def target_text(self, example: Any) -> str:
        """The completion SFT trains on (default ``example.answer``)."""
        return example.answer

    # ------------------------------------------------------------------ tensors
    def _prompt_too_long(self, row: int, example: Any, tokens: int, width: int) -> str:
        where = "task.max_prompt_tokens" if getattr(self.config, "max_prompt_tokens", None) else ""
        fix = f" (raise {where})" if where else ""
        return (
            f"example {row}: prompt {example.prompt!r} has {tokens} tokens, more than "
            f"prompt_length={width}{fix}"
        )

    def encode(self, examples: Sequence[Any]) -> dict[str, torch.Tensor]:
        """Token tensors for ``examples`` (B of them), on CPU (module docstring).

        Returns:
            ``prompt_ids`` int64 ``[B, P]`` (LEFT-padded with ``pad_id``), ``prompt_mask``
            bool ``[B, P]``, ``completion_ids`` int64 ``[B, L]`` (target, then ``eos_id``),
            ``completion_mask`` bool ``[B, L]`` (all True).
        """
        tok = self.tokenizer
        size, completion_len = len(examples), self.completion_length
        prompts = [tok.encode(self.prompt_text(ex)) for ex in examples]
        prompt_len = self.prompt_length
        if prompt_len is None:
            prompt_len = max((len(p) for p in prompts), default=0)
        prompt_ids = torch.full((size, prompt_len), tok.pad_id, dtype=torch.int64)
        prompt_mask = torch.zeros((size, prompt_len), dtype=torch.bool)
        completion_ids = torch.full((size, completion_len), tok.eos_id, dtype=torch.int64)
        for row, (ex, prompt) in enumerate(zip(examples, prompts)):
            target = tok.encode(self.target_text(ex))
            if len(prompt) > prompt_len:
                raise ValueError(self._prompt_too_long(row, ex, len(prompt), prompt_len))
            if len(target) >= completion_len:
                if not self.truncate_targets:
                    raise ValueError(
                        f"example {row}: answer {self.target_text(ex)!r} needs "
                        f"{len(target) + 1} slots with <eos>, more than "
                        f"completion_length={completion_len}"
                    )
                target = target[:completion_len]
            if prompt:
                prompt_ids[row, prompt_len - len(prompt) :] = torch.tensor(prompt)
                prompt_mask[row, prompt_len - len(prompt) :] = True
            if target:
                completion_ids[row, : len(target)] = torch.tensor(target)
        completion_mask = torch.ones((size, completion_len), dtype=torch.bool)
        return {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "completion_ids": completion_ids,
            "completion_mask": completion_mask,
        }

    def batch(self, indices: Iterable[int], split: Split = "train") -> dict[str, torch.Tensor]:
        """``encode(examples(indices, split))``."""
        return self.encode(self.examples(indices, split))

    def train_indices(self, position: int, batch_size: int) -> range:
        """Indices of training batch ``position``: ``[position * B, (position + 1) * B)``."""
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:
            raise ValueError(f"position: expected an int >= 0, got {position!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size: expected an int >= 1, got {batch_size!r}")
        return range(position * batch_size, (position + 1) * batch_size)

    def train_batch(self, position: int, batch_size: int) -> dict[str, torch.Tensor]:
        """Training batch number ``position``; the single int ``position`` is the whole data
        state, so resuming at ``position`` reproduces the stream exactly."""
        return self.batch(self.train_indices(position, batch_size), "train")

    # ------------------------------------------------------------------ verifier
    def rewards(self, texts: Sequence[str], examples: Sequence[Any]) -> torch.Tensor:
        """float32 ``[B]`` of :meth:`reward` per (text, example) pair."""
        if len(texts) != len(examples):
            raise ValueError(
                f"rewards: got {len(texts)} texts but {len(examples)} examples; expected equal"
            )
        values = [self.reward(text, ex) for text, ex in zip(texts, examples)]
        return torch.tensor(values, dtype=torch.float32)

    def accuracy(self, texts: Sequence[str], examples: Sequence[Any]) -> float:
        """Fraction of correct completions (mean reward)."""
        if len(texts) == 0:
            raise ValueError("accuracy: expected at least one text, got none")
        return float(self.rewards(texts, examples).mean())
