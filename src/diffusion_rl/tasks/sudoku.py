"""Sudoku on a 4x4 (2x2 boxes, the default: tiny models) or 9x9 (3x3 boxes) grid.

A problem is a seeded full solution (the pattern ``(box * (r % box) + r // box + c) % N + 1``
with its digits relabelled, rows shuffled within bands and bands shuffled, the same for
columns and stacks, and a transpose half of the time) from which ``num_blanks`` cells are
blanked one at a time in a random order, a blank kept only while the puzzle still has exactly
one solution (the backtracking solver of :mod:`diffusion_rl.rewards`). Row-major text
throughout: the prompt is the puzzle with ``"."`` for blanks and a final ``"="``
(``"1.3..4.2....3..1="``), the answer the solution's ``N * N`` digits.

The verifier is :class:`~diffusion_rl.rewards.SudokuReward` in ``"exact"`` mode (its
``score``): 1.0 iff the completion is a valid complete grid that keeps every given (which,
the solution being unique, is the solution).

Invariants: :class:`~diffusion_rl.tasks.text.TextTask`'s; every puzzle has exactly one
solution, ``num_blanks`` blanks, and its solution is ``example.answer``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..rewards import SudokuReward, _sudoku_unique_solution
from .text import Split, TextTask

__all__ = ["SudokuConfig", "SudokuExample", "SudokuTask"]

_CHARS = "0123456789.="
_BOX = {4: 2, 9: 3}
_DEFAULT_BLANKS = {4: 6, 9: 40}
_MAX_BLANKS = {
    4: 10,
    9: 55,
}  # greedy blanking reaches these at once (16 - 4 and 81 - 17 are the limits)
_ATTEMPTS = 20


class SudokuConfig(BaseModel):
    """Settings of :class:`SudokuTask` (unknown keys are rejected).

    ``size`` 4 or 9; ``num_blanks`` (null: 6 for 4x4, 40 for 9x9; at most 10 and 55).
    ``chat`` / ``max_prompt_tokens`` as for every text task. ``completion_length`` defaults to
    the smallest multiple of ``block_size`` holding ``size * size`` digits plus one ``<eos>``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    size: Literal[4, 9] = 4
    num_blanks: int | None = Field(None, ge=1)
    chat: bool = False
    max_prompt_tokens: int | None = Field(None, ge=1, le=65536)
    completion_length: int | None = Field(None, ge=1, le=4096)
    block_size: int = Field(4, ge=1, le=4096)
    seed: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _check(self) -> SudokuConfig:
        if self.num_blanks is not None and self.num_blanks > _MAX_BLANKS[self.size]:
            raise ValueError(
                f"num_blanks={self.num_blanks} is too many for a {self.size}x{self.size} grid "
                f"(at most {_MAX_BLANKS[self.size]})"
            )
        if self.completion_length is not None:
            needed = self.size * self.size + 1
            if self.completion_length < needed:
                raise ValueError(
                    f"completion_length={self.completion_length} is too short: a solution has "
                    f"{needed - 1} digits plus one <eos>, so at least {needed}"
                )
            if self.completion_length % self.block_size:
                raise ValueError(
                    f"completion_length={self.completion_length} must be a multiple of "
                    f"block_size={self.block_size}"
                )
        return self


@dataclass(frozen=True)
class SudokuExample:
    """One puzzle: ``puzzle`` row-major with ``"."`` blanks, ``givens`` its digits (0: blank),
    ``answer`` the unique solution's digits, ``prompt == puzzle + "="``."""

    prompt: str
    answer: str
    puzzle: str
    givens: tuple[int, ...]
    size: int


class SudokuTask(TextTask):
    """Seeded Sudoku puzzles with a unique solution and their verifier (module docstring).

    Args:
        config: a :class:`SudokuConfig`; ``None`` means the defaults (4x4).
        tokenizer: the model's tokenizer; ``None``: the character tokenizer over
            ``"0123456789.="``.
    """

    name = "sudoku"
    config_class = SudokuConfig
    seed_key = "diffusion_rl.sudoku:v1"

    def __init__(self, config: SudokuConfig | None = None, tokenizer=None) -> None:
        super().__init__(config, tokenizer)
        self._verifier = SudokuReward(mode="exact")
        self._cells = SudokuReward(mode="cells")
        cells, block = self.config.size**2, self.config.block_size
        if self.config.completion_length is None:
            self._completion_length = math.ceil((cells + 1) / block) * block
        else:
            self._completion_length = self.config.completion_length

    @property
    def num_blanks(self) -> int:
        c = self.config
        return _DEFAULT_BLANKS[c.size] if c.num_blanks is None else c.num_blanks

    @property
    def characters(self) -> str:
        return _CHARS

    @property
    def char_prompt_length(self) -> int:
        return self.config.size**2 + 1

    @property
    def completion_length(self) -> int:
        return self._completion_length

    def _solution(self, rng) -> list[int]:
        """A random valid full grid, row-major (module docstring)."""
        size = self.config.size
        box = _BOX[size]

        def lines() -> list[int]:  # a band order, then a row order inside each band
            bands = rng.sample(range(box), box)
            return [b * box + r for b in bands for r in rng.sample(range(box), box)]

        digits = rng.sample(range(1, size + 1), size)
        rows, cols = lines(), lines()
        grid = [[digits[(box * (r % box) + r // box + c) % size] for c in cols] for r in rows]
        if rng.random() < 0.5:
            grid = [list(column) for column in zip(*grid)]
        return [value for row in grid for value in row]

    def example(self, index: int, split: Split = "train") -> SudokuExample:
        """The puzzle at ``index`` of ``split``; same arguments, same example, always."""
        rng = self._rng(index, split)
        size = self.config.size
        solution = self._solution(rng)
        order = list(range(size * size))
        for _ in range(_ATTEMPTS):
            rng.shuffle(order)
            givens, blanks = list(solution), 0
            for cell in order:
                givens[cell] = 0
                if _sudoku_unique_solution(tuple(givens), size) is None:
                    givens[cell] = solution[cell]
                    continue
                blanks += 1
                if blanks == self.num_blanks:
                    puzzle = "".join("." if v == 0 else str(v) for v in givens)
                    return SudokuExample(
                        prompt=f"{puzzle}=",
                        answer="".join(map(str, solution)),
                        puzzle=puzzle,
                        givens=tuple(givens),
                        size=size,
                    )
        raise RuntimeError(  # pragma: no cover - the blank limits are reached on the first try
            f"sudoku: no puzzle with {self.num_blanks} blanks and one solution in "
            f"{_ATTEMPTS} attempts (index {index}, split {split!r}); lower task.num_blanks"
        )

    def reward(self, completion_text: str, example: SudokuExample) -> float:
        """1.0 iff ``SudokuReward(mode="exact").score`` is 1.0 (the solution), else 0.0;
        never raises on bad text."""
        if not isinstance(completion_text, str):
            raise TypeError(
                f"reward: expected completion text as a str, got {type(completion_text).__name__}"
            )
        return self._verifier.score(completion_text, example.givens, example.size)

    credit_name = "blank cells"

    def credit(self, completion_text: str, example: SudokuExample) -> float:
        """The fraction of the puzzle's blanks filled with the solution's digit
        (``SudokuReward(mode="cells")``); 0.0 for text that is not a grid."""
        return self._cells.score(completion_text, example.givens, example.size)
