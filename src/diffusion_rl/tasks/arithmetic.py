"""Synthetic multi-digit arithmetic with a verifiable answer.

A problem is ``a op b`` with ``op`` in ``config.operations`` and non-negative operands of 1 to
``num_digits`` digits (the digit count is drawn uniformly first, then the value uniformly among
numbers with that many digits; ``0`` counts as a 1-digit number). The prompt is ``"a+b="``, the
answer is ``str(a op b)`` (negative results carry a leading ``"-"``).

Invariants:

* ``example(index, split)`` is a pure function of ``(config.seed, split, index)``: each example
  gets its own ``random.Random`` seeded from a SHA-256 of those three values (no global RNG), and
  train / eval use different derived seeds.
* Shapes are fixed by the config, not the batch: prompts are ``[B, prompt_length]`` and
  completions ``[B, completion_length]``, with ``completion_length % block_size == 0`` and room
  for the longest answer plus at least one ``<eos>``.
"""

from __future__ import annotations

import hashlib
import math
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..models.tokenizer import CharTokenizer

__all__ = ["ArithmeticConfig", "ArithmeticTask", "Example", "Split"]

Split = Literal["train", "eval"]
_SPLITS = ("train", "eval")
_OPERATIONS = "+-"
# One vocabulary for every config, so checkpoints are interchangeable across task settings.
_CHARS = "0123456789+-="
_ANSWER = re.compile(r"-?[0-9]+")
_EOS_TEXT = "<eos>"


def _max_answer_length(num_digits: int, operations: str) -> int:
    """Characters in the longest possible answer for these settings."""
    largest = 10**num_digits - 1
    extremes = []
    if "+" in operations:
        extremes.append(largest + largest)
    if "-" in operations:
        extremes += [largest - 0, 0 - largest]
    return max(len(str(value)) for value in extremes)


class ArithmeticConfig(BaseModel):
    """Settings of :class:`ArithmeticTask` (unknown keys are rejected).

    ``operations`` is normalised to the canonical order ``"+-"`` so equivalent configs generate
    identical data. ``completion_length`` defaults to the smallest multiple of ``block_size``
    that holds the longest answer plus one ``<eos>``; an explicit value must satisfy the same
    two rules. Sizes are bounded (``num_digits`` <= 32, ``completion_length`` and
    ``block_size`` <= 4096) so a config cannot ask for absurd sequences; ``seed`` >= 0.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    num_digits: int = Field(3, ge=1, le=32)
    operations: str = "+"
    completion_length: int | None = Field(None, ge=1, le=4096)
    block_size: int = Field(4, ge=1, le=4096)
    seed: int = Field(0, ge=0)

    @field_validator("operations")
    @classmethod
    def _check_operations(cls, value: str) -> str:
        unknown = sorted(set(value) - set(_OPERATIONS))
        if unknown or not value:
            raise ValueError(
                f"expected a non-empty subset of {_OPERATIONS!r}, got {value!r}"
                + (f" (unknown {unknown})" if unknown else "")
            )
        return "".join(op for op in _OPERATIONS if op in value)

    @model_validator(mode="after")
    def _check_completion_length(self) -> ArithmeticConfig:
        if self.completion_length is None:
            return self
        needed = _max_answer_length(self.num_digits, self.operations) + 1
        if self.completion_length < needed:
            raise ValueError(
                f"completion_length={self.completion_length} is too short: answers need up to "
                f"{needed - 1} characters plus one <eos>, so at least {needed}"
            )
        if self.completion_length % self.block_size:
            raise ValueError(
                f"completion_length={self.completion_length} must be a multiple of "
                f"block_size={self.block_size}"
            )
        return self


@dataclass(frozen=True)
class Example:
    """One problem: ``prompt == f"{a}{op}{b}="`` and ``answer == str(result)``."""

    prompt: str
    answer: str
    a: int
    op: str
    b: int

    @property
    def result(self) -> int:
        return self.a + self.b if self.op == "+" else self.a - self.b


class ArithmeticTask:
    """Deterministic arithmetic problems, their token encoding and the verifier (reward).

    Args:
        config: an :class:`ArithmeticConfig`; ``None`` means the defaults.
    """

    name = "arithmetic"

    def __init__(self, config: ArithmeticConfig | None = None) -> None:
        if config is None:
            config = ArithmeticConfig()
        if not isinstance(config, ArithmeticConfig):
            raise TypeError(
                f"ArithmeticTask.config: expected an ArithmeticConfig, got {type(config).__name__}"
            )
        self.config = config
        self.tokenizer = CharTokenizer(_CHARS)
        self._max_answer_length = _max_answer_length(config.num_digits, config.operations)
        if config.completion_length is None:
            blocks = math.ceil((self._max_answer_length + 1) / config.block_size)
            self._completion_length = blocks * config.block_size
        else:
            self._completion_length = config.completion_length

    def __repr__(self) -> str:
        return f"ArithmeticTask({self.config!r})"

    @property
    def prompt_length(self) -> int:
        """P: characters in the longest prompt (``"a+b="`` with both operands at full width)."""
        return 2 * self.config.num_digits + 2

    @property
    def completion_length(self) -> int:
        """L: completion slots, a multiple of ``block_size`` >= longest answer + 1."""
        return self._completion_length

    @property
    def block_size(self) -> int:
        return self.config.block_size

    # ------------------------------------------------------------------ examples
    def _rng_seed(self, index: int, split: str) -> int:
        key = f"diffusion_rl.arithmetic:v1:{self.config.seed}:{split}:{index}".encode()
        return int.from_bytes(hashlib.sha256(key).digest()[:8], "little")

    def example(self, index: int, split: Split = "train") -> Example:
        """The problem at ``index`` of ``split``; same arguments, same example, always."""
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"index: expected an int >= 0, got {index!r}")
        if split not in _SPLITS:
            raise ValueError(f"split: expected one of {_SPLITS}, got {split!r}")
        rng = random.Random(self._rng_seed(index, split))
        operands = []
        for _ in range(2):
            digits = rng.randint(1, self.config.num_digits)
            low = 0 if digits == 1 else 10 ** (digits - 1)
            operands.append(rng.randint(low, 10**digits - 1))
        a, b = operands
        op = rng.choice(self.config.operations)
        result = a + b if op == "+" else a - b
        return Example(prompt=f"{a}{op}{b}=", answer=str(result), a=a, op=op, b=b)

    def examples(self, indices: Iterable[int], split: Split = "train") -> list[Example]:
        return [self.example(int(i), split) for i in indices]

    # ------------------------------------------------------------------ tensors
    def encode(self, examples: Sequence[Example]) -> dict[str, torch.Tensor]:
        """Token tensors for ``examples`` (B of them), on CPU.

        Returns:
            ``prompt_ids`` int64 ``[B, P]``: prompt characters LEFT-padded with ``<pad>``;
            ``prompt_mask`` bool ``[B, P]``: True on real prompt tokens;
            ``completion_ids`` int64 ``[B, L]``: answer characters, then ``<eos>`` to the end;
            ``completion_mask`` bool ``[B, L]``: all True (the ``<eos>`` fill is trained too).
        """
        tok = self.tokenizer
        size, prompt_len, completion_len = len(examples), self.prompt_length, self.completion_length
        prompt_ids = torch.full((size, prompt_len), tok.pad_id, dtype=torch.int64)
        prompt_mask = torch.zeros((size, prompt_len), dtype=torch.bool)
        completion_ids = torch.full((size, completion_len), tok.eos_id, dtype=torch.int64)
        for row, ex in enumerate(examples):
            prompt = tok.encode(ex.prompt)
            answer = tok.encode(ex.answer)
            if len(prompt) > prompt_len:
                raise ValueError(
                    f"example {row}: prompt {ex.prompt!r} has {len(prompt)} characters, "
                    f"more than prompt_length={prompt_len}"
                )
            if len(answer) >= completion_len:
                raise ValueError(
                    f"example {row}: answer {ex.answer!r} needs {len(answer) + 1} slots with "
                    f"<eos>, more than completion_length={completion_len}"
                )
            if prompt:
                prompt_ids[row, prompt_len - len(prompt) :] = torch.tensor(prompt)
                prompt_mask[row, prompt_len - len(prompt) :] = True
            if answer:
                completion_ids[row, : len(answer)] = torch.tensor(answer)
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
    def reward(self, completion_text: str, example: Example) -> float:
        """1.0 iff the completion is the correct result, else 0.0; never raises on bad text.

        The text is cut at the first ``"<eos>"`` (if the literal appears), stripped of
        whitespace, and must then be an optional ``"-"`` followed by ASCII digits whose integer
        value equals ``example.result`` (leading zeros are accepted).
        """
        if not isinstance(completion_text, str):
            raise TypeError(
                f"reward: expected completion text as a str, got {type(completion_text).__name__}"
            )
        text = completion_text.split(_EOS_TEXT, 1)[0].strip()
        if not _ANSWER.fullmatch(text):
            return 0.0
        return 1.0 if int(text) == example.result else 0.0

    def digit_reward(self, completion_text: str, example: Example) -> float:
        """Partial credit: the fraction of answer characters right, aligned from the right
        (units with units), over the longer of answer and completion; 0.0 for unparsable text.
        1.0 exactly when :meth:`reward` is 1.0 (up to leading zeros)."""
        text = completion_text.split(_EOS_TEXT, 1)[0].strip()
        if not _ANSWER.fullmatch(text):
            return 0.0
        predicted, answer = str(int(text)), str(example.result)
        width = max(len(predicted), len(answer))
        matches = sum(p == a for p, a in zip(predicted.rjust(width), answer.rjust(width)))
        return matches / width

    def rewards(self, texts: Sequence[str], examples: Sequence[Example]) -> torch.Tensor:
        """float32 ``[B]`` of :meth:`reward` per (text, example) pair."""
        if len(texts) != len(examples):
            raise ValueError(
                f"rewards: got {len(texts)} texts but {len(examples)} examples; expected equal"
            )
        values = [self.reward(text, ex) for text, ex in zip(texts, examples)]
        return torch.tensor(values, dtype=torch.float32)

    def accuracy(self, texts: Sequence[str], examples: Sequence[Example]) -> float:
        """Fraction of correct completions (mean reward)."""
        if len(texts) == 0:
            raise ValueError("accuracy: expected at least one text, got none")
        return float(self.rewards(texts, examples).mean())
