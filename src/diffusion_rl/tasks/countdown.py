"""Countdown: combine the given numbers with ``+ - * /`` and parentheses to hit a target.

A problem draws ``num_numbers`` integers in ``[1, max_number]`` and builds the reference
expression from all of them: the numbers in a fresh random order, folded left, each step's
operator drawn uniformly among those that keep the running value an integer in
``[1, max_target]`` (``+`` while the sum fits, ``-`` while the difference stays >= 1, ``*``
while the product fits, ``/`` when it divides exactly). Since ``max_target >= 2 * max_number``
one operator is always possible, so every target is reachable by construction. The prompt
lists the numbers in another random order, then the target: ``"3,5,7:15="``; the answer is the
reference expression (``"7*5/3"``-style: parentheses only where the left operand of ``*`` or
``/`` is a sum or difference).

The verifier is :class:`~diffusion_rl.rewards.CountdownReward` (its ``score``, with the
config's ``use_all``): 1.0 iff the completion is a well-formed expression over the given numbers
(each at most once; exactly all of them with ``use_all``) whose exact value is the target.

Invariants: :class:`~diffusion_rl.tasks.text.TextTask`'s (``example(index, split)`` a pure
function of ``(seed, split, index)``; with the task's character tokenizer, shapes fixed by the
config: the longest prompt and the longest possible reference expression plus one ``<eos>``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..rewards import CountdownReward
from .text import Split, TextTask

__all__ = ["CountdownConfig", "CountdownExample", "CountdownTask"]

# One vocabulary for every config (checkpoints are interchangeable across settings).
_CHARS = "0123456789+-*/(),:="


def _max_expression_length(num_numbers: int, max_number: int) -> int:
    """Characters in the longest reference expression: the numbers, the operators and one
    pair of parentheses per step after the second number."""
    return num_numbers * len(str(max_number)) + (num_numbers - 1) + 2 * max(0, num_numbers - 2)


class CountdownConfig(BaseModel):
    """Settings of :class:`CountdownTask` (unknown keys are rejected).

    ``max_target`` must be at least ``2 * max_number`` (so every step has an operator that
    keeps the value in range). ``use_all``: the verifier demands every given number exactly
    once (else any subset, each at most once; the ``countdown`` reward's default). ``chat``:
    prompts go through the tokenizer's chat template; ``max_prompt_tokens`` fixes the prompt
    width (null: see :class:`~diffusion_rl.tasks.text.TextTask`). ``completion_length``
    defaults to the smallest multiple of ``block_size`` holding the longest reference
    expression plus one ``<eos>``; an explicit value must be a multiple of ``block_size``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    num_numbers: int = Field(3, ge=2, le=6)
    max_number: int = Field(9, ge=1, le=999)
    max_target: int = Field(99, ge=2, le=1_000_000)
    use_all: bool = False
    chat: bool = False
    max_prompt_tokens: int | None = Field(None, ge=1, le=65536)
    completion_length: int | None = Field(None, ge=1, le=4096)
    block_size: int = Field(4, ge=1, le=4096)
    seed: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _check(self) -> CountdownConfig:
        if self.max_target < 2 * self.max_number:
            raise ValueError(
                f"max_target={self.max_target} must be at least 2 * max_number = "
                f"{2 * self.max_number} (so every step has an operator that stays in range)"
            )
        if self.completion_length is not None and self.completion_length % self.block_size:
            raise ValueError(
                f"completion_length={self.completion_length} must be a multiple of "
                f"block_size={self.block_size}"
            )
        return self


@dataclass(frozen=True)
class CountdownExample:
    """One problem: reach ``target`` from ``numbers``; ``answer`` is a reference expression."""

    prompt: str
    answer: str
    numbers: tuple[int, ...]
    target: int


class CountdownTask(TextTask):
    """Seeded Countdown problems and their verifier (module docstring).

    Args:
        config: a :class:`CountdownConfig`; ``None`` means the defaults.
        tokenizer: the model's tokenizer; ``None``: the character tokenizer over
            ``"0123456789+-*/(),:="``.
    """

    name = "countdown"
    config_class = CountdownConfig
    seed_key = "diffusion_rl.countdown:v1"

    def __init__(self, config: CountdownConfig | None = None, tokenizer=None) -> None:
        super().__init__(config, tokenizer)
        self._verifier = CountdownReward(use_all=self.config.use_all)
        longest = _max_expression_length(self.config.num_numbers, self.config.max_number)
        if self.config.completion_length is None:
            block = self.config.block_size
            self._completion_length = math.ceil((longest + 1) / block) * block
        else:
            self._completion_length = self.config.completion_length

    @property
    def characters(self) -> str:
        return _CHARS

    @property
    def char_prompt_length(self) -> int:
        """The numbers at full width with commas, ``":"``, the largest target and ``"="``."""
        c = self.config
        return (
            c.num_numbers * len(str(c.max_number))
            + (c.num_numbers - 1)
            + len(str(c.max_target))
            + 2
        )

    @property
    def completion_length(self) -> int:
        return self._completion_length

    def example(self, index: int, split: Split = "train") -> CountdownExample:
        """The problem at ``index`` of ``split``; same arguments, same example, always."""
        rng = self._rng(index, split)
        c = self.config
        numbers = [rng.randint(1, c.max_number) for _ in range(c.num_numbers)]
        order = list(range(c.num_numbers))
        rng.shuffle(order)
        value, text, top = numbers[order[0]], str(numbers[order[0]]), ""
        for k in order[1:]:
            n = numbers[k]
            options = []
            if value + n <= c.max_target:
                options.append("+")
            if value - n >= 1:
                options.append("-")
            if value * n <= c.max_target:
                options.append("*")
            if value % n == 0:
                options.append("/")
            op = rng.choice(options)  # never empty: max_target >= 2 * max_number
            if op in "*/" and top in ("+", "-"):
                text = f"({text})"
            text, top = f"{text}{op}{n}", op
            value = {"+": value + n, "-": value - n, "*": value * n, "/": value // n}[op]
        prompt = f"{','.join(map(str, numbers))}:{value}="
        return CountdownExample(prompt=prompt, answer=text, numbers=tuple(numbers), target=value)

    def reward(self, completion_text: str, example: CountdownExample) -> float:
        """1.0 iff ``CountdownReward(use_all=config.use_all).score`` is 1.0 (a correct
        expression), else 0.0; never raises on bad text."""
        if not isinstance(completion_text, str):
            raise TypeError(
                f"reward: expected completion text as a str, got {type(completion_text).__name__}"
            )
        return self._verifier.score(completion_text, example.numbers, example.target)
