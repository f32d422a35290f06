"""Synthetic multi-digit arithmetic with a verifiable answer.

A problem is ``a op b`` with ``op`` in ``config.operations`` and non-negative operands of 1 to
``num_digits`` digits (the digit count is drawn uniformly first, then the value uniformly among
numbers with that many digits; ``0`` counts as a 1-digit number). The prompt is ``"a+b="``, the
answer is ``str(a op b)`` (negative results carry a leading ``"-"``).

Invariants:

* ``example(index, split)`` is a pure function of ``(config.seed, split, index)``: each example
  gets its own ``random.Random`` seeded from a SHA-256 of those three values (no global RNG), and
  train / eval use different derived seeds.
* With the task's own character tokenizer (the default), shapes are fixed by the config, not
  the batch: prompts are ``[B, prompt_length]`` and completions ``[B, completion_length]``,
  with ``completion_length % block_size == 0`` and room for the longest answer plus at least
  one ``<eos>``. Encoding, batches and the verifier's batch forms are
  :class:`~diffusion_rl.tasks.text.TextTask`'s (another tokenizer: see its invariants).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .text import Split, TextTask

__all__ = ["ArithmeticConfig", "ArithmeticTask", "Example", "Split"]

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


class ArithmeticTask(TextTask):
    """Deterministic arithmetic problems, their token encoding and the verifier (reward).

    Args:
        config: an :class:`ArithmeticConfig`; ``None`` means the defaults.
        tokenizer: the tokenizer to encode with (the model's); ``None``: the task's own
            character tokenizer over ``"0123456789+-="``.
    """

    name = "arithmetic"
    config_class = ArithmeticConfig
    seed_key = "diffusion_rl.arithmetic:v1"

    def __init__(self, config: ArithmeticConfig | None = None, tokenizer=None) -> None:
        super().__init__(config, tokenizer)
        config = self.config
        self._max_answer_length = _max_answer_length(config.num_digits, config.operations)
        if config.completion_length is None:
            blocks = math.ceil((self._max_answer_length + 1) / config.block_size)
            self._completion_length = blocks * config.block_size
        else:
            self._completion_length = config.completion_length

    @property
    def characters(self) -> str:
        return _CHARS

    @property
    def char_prompt_length(self) -> int:
        """Characters in the longest prompt (``"a+b="`` with both operands at full width)."""
        return 2 * self.config.num_digits + 2

    @property
    def completion_length(self) -> int:
        """L: completion slots, a multiple of ``block_size`` >= longest answer + 1."""
        return self._completion_length

    # ------------------------------------------------------------------ examples
    def example(self, index: int, split: Split = "train") -> Example:
        """The problem at ``index`` of ``split``; same arguments, same example, always."""
        rng = self._rng(index, split)
        operands = []
        for _ in range(2):
            digits = rng.randint(1, self.config.num_digits)
            low = 0 if digits == 1 else 10 ** (digits - 1)
            operands.append(rng.randint(low, 10**digits - 1))
        a, b = operands
        op = rng.choice(self.config.operations)
        result = a + b if op == "+" else a - b
        return Example(prompt=f"{a}{op}{b}=", answer=str(result), a=a, op=op, b=b)

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
