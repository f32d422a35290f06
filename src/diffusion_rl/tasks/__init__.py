"""Built-in synthetic, verifiable tasks and their tokenizer (re-exported from
:mod:`diffusion_rl.models.tokenizer`). The image and video tasks live in
:mod:`~diffusion_rl.tasks.geneval` and :mod:`~diffusion_rl.tasks.motion` (the latter's task
classes are re-exported here).

``get_task(name, **config)`` builds a registered task from keyword settings; the registry maps a
task name to ``(config class, task class)``.
"""

from __future__ import annotations

from ..models.tokenizer import CharTokenizer
from .arithmetic import ArithmeticConfig, ArithmeticTask, Example, Split
from .motion import MotionConfig, MotionExample, MotionTask

__all__ = [
    "TASKS",
    "ArithmeticConfig",
    "ArithmeticTask",
    "CharTokenizer",
    "Example",
    "MotionConfig",
    "MotionExample",
    "MotionTask",
    "Split",
    "get_task",
]

TASKS = {"arithmetic": (ArithmeticConfig, ArithmeticTask)}


def get_task(name: str, **config) -> ArithmeticTask:
    """The task registered as ``name``, configured by ``config`` (validated by its config class).

    Raises:
        ValueError: unknown ``name`` (the message lists the known ones) or invalid settings.
    """
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {sorted(TASKS)}")
    config_cls, task_cls = TASKS[name]
    return task_cls(config_cls(**config))
