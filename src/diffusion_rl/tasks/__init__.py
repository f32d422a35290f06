"""Built-in verifiable tasks, the dataset tasks and their tokenizer (re-exported from
:mod:`diffusion_rl.models.tokenizer`).

Token world (:data:`TASKS`, all :class:`~diffusion_rl.tasks.text.TextTask`): ``arithmetic``
(the default), ``countdown``, ``sudoku`` (generated, each with its own character tokenizer)
and ``math`` (math word problems from a local file, :mod:`~diffusion_rl.tasks.datasets`).
The image and video tasks live in :mod:`~diffusion_rl.tasks.geneval` and
:mod:`~diffusion_rl.tasks.motion` (the latter's task classes are re-exported here); prompt
lists for them from a local file are :class:`~diffusion_rl.tasks.datasets.PromptFileTask`.

``get_task(name, tokenizer=None, **config)`` builds a registered text task from keyword
settings, encoding with ``tokenizer`` (the model's; None: the task's own); the registry maps a
task name to ``(config class, task class)``.
"""

from __future__ import annotations

from typing import Any

from ..models.tokenizer import CharTokenizer
from .arithmetic import ArithmeticConfig, ArithmeticTask, Example, Split
from .countdown import CountdownConfig, CountdownExample, CountdownTask
from .datasets import (
    MathConfig,
    MathExample,
    MathTask,
    PromptExample,
    PromptFileConfig,
    PromptFileTask,
)
from .motion import MotionConfig, MotionExample, MotionTask
from .sudoku import SudokuConfig, SudokuExample, SudokuTask
from .text import TextTask, TokenizerMismatchError

__all__ = [
    "TASKS",
    "ArithmeticConfig",
    "ArithmeticTask",
    "CharTokenizer",
    "CountdownConfig",
    "CountdownExample",
    "CountdownTask",
    "Example",
    "MathConfig",
    "MathExample",
    "MathTask",
    "MotionConfig",
    "MotionExample",
    "MotionTask",
    "PromptExample",
    "PromptFileConfig",
    "PromptFileTask",
    "Split",
    "SudokuConfig",
    "SudokuExample",
    "SudokuTask",
    "TextTask",
    "TokenizerMismatchError",
    "get_task",
]

TASKS: dict[str, tuple[type, type[TextTask]]] = {
    "arithmetic": (ArithmeticConfig, ArithmeticTask),
    "countdown": (CountdownConfig, CountdownTask),
    "sudoku": (SudokuConfig, SudokuTask),
    "math": (MathConfig, MathTask),
}


def get_task(name: str, tokenizer: Any = None, **config) -> TextTask:
    """The text task registered as ``name``, configured by ``config`` (validated by its config
    class), encoding with ``tokenizer`` (None: the task's own character tokenizer).

    Raises:
        ValueError: unknown ``name`` (the message lists the known ones) or invalid settings;
            :class:`TokenizerMismatchError` for a character tokenizer lacking the task's
            characters.
    """
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {sorted(TASKS)}")
    config_cls, task_cls = TASKS[name]
    return task_cls(config_cls(**config), tokenizer=tokenizer)
