"""The seeded prompt split and example streams shared by the procedural image and video tasks.

:class:`PromptTask` is the base of :class:`~diffusion_rl.tasks.geneval.GenEvalTask` and
:class:`~diffusion_rl.tasks.motion.MotionTask`: a finite prompt set, split once into
``"train"`` and ``"eval"`` by a seeded shuffle, and per split an endless stream of examples in
epochs, each a fresh seeded shuffle of the split.

Invariants: every seed is ``sha256("<seed_key>:<config.seed>:<parts...>")`` (its first 8 bytes,
little-endian), so the split is a pure function of ``(seed_key, config.seed, the prompt list,
heldout_fraction)`` and ``example(index, split)`` of ``(seed_key, config.seed, split, index)``;
each window ``[k n, (k + 1) n)`` of a split's stream (``n = len(prompts(split))``) holds each of
its prompts exactly once; the training prompts show every attribute value of the whole set; no
global RNG is touched.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterable, Sequence
from typing import ClassVar, Literal, TypeVar

from pydantic import BaseModel

__all__ = ["PromptTask", "Split", "example_of"]

Split = Literal["train", "eval"]
_SPLITS = ("train", "eval")
E = TypeVar("E")


def example_of(item: object, index: int, example_type: type[E], parse: Callable[[str], E]) -> E:
    """``item`` itself if it is an ``example_type``, else ``parse`` of the prompt str it is or
    holds (a dict's ``"prompt"`` or an object's ``prompt``).

    Raises:
        TypeError: no str prompt (the message names example ``index`` and what it takes).
        ValueError: from ``parse``, a str that is not a prompt of the task.
    """
    if isinstance(item, example_type):
        return item
    if isinstance(item, str):
        return parse(item)
    prompt = item.get("prompt") if isinstance(item, dict) else getattr(item, "prompt", None)
    if not isinstance(prompt, str):
        raise TypeError(
            f"example {index}: expected a {example_type.__name__}, a prompt str or an object "
            f"with a str 'prompt' field, got {type(item).__name__}"
        )
    return parse(prompt)


def task_config(task, config: BaseModel | None) -> BaseModel:
    """``config`` checked as ``task.config_class`` (None: its defaults); a config of another
    class is a ``TypeError`` naming the task."""
    if config is None:
        return task.config_class()
    if not isinstance(config, task.config_class):
        raise TypeError(
            f"{type(task).__name__}.config: expected a {task.config_class.__name__}, got "
            f"{type(config).__name__}"
        )
    return config


class PromptTask:
    """Base of a task with a finite prompt set: config checks, ``info`` round trip, the seeded
    split and the example streams.

    A subclass sets ``name``, ``config_class`` (a pydantic model with int ``seed`` >= 0 and
    float ``heldout_fraction`` in ``[0, 0.5)``) and ``seed_key`` (the namespace of its seeds,
    versioned: changing it changes every split and stream) and defines
    ``render_batch(examples, seeds)`` (used by :meth:`train_batch`); its ``__init__`` calls
    ``super().__init__(config)`` and then :meth:`_split_prompts`.
    """

    name: ClassVar[str]
    config_class: ClassVar[type[BaseModel]]
    seed_key: ClassVar[str]

    def __init__(self, config: BaseModel | None = None) -> None:
        self.config = task_config(self, config)
        self._orders: dict[tuple[str, int], list[int]] = {}  # a few epochs' shuffles

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"

    def info(self) -> dict:
        """The task's settings as a JSON-ready dict with its ``name`` (model directories record
        it so later stages rebuild the same task)."""
        return {"name": self.name, **self.config.model_dump(mode="json")}

    @classmethod
    def from_info(cls, info: dict):
        """The task described by :meth:`info` (e.g. read back from a model's JSON config).

        Raises:
            ValueError: ``info`` names another task, or its settings are invalid.
        """
        settings = dict(info)
        name = settings.pop("name", cls.name)
        if name != cls.name:
            raise ValueError(f"info: describes task {name!r}, not {cls.name!r}")
        return cls(cls.config_class(**settings))

    def _seed(self, *parts: object) -> int:
        key = ":".join([self.seed_key, str(self.config.seed), *map(str, parts)])
        return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")

    def _split_prompts(self, every: Sequence, values: Callable[[Iterable], set]) -> None:
        """Split ``every`` prompt into ``"train"`` and ``"eval"`` (``heldout_fraction`` of
        them, at least one when the fraction is not 0): the first of the seeded shuffles
        ``("split", attempt)`` whose training prompts show all of ``values(every)``; each split
        keeps the order of ``every``."""
        fraction = self.config.heldout_fraction
        n_held = max(1, round(fraction * len(every))) if fraction else 0
        wanted = values(every)
        for attempt in range(1000):
            order = list(range(len(every)))
            random.Random(self._seed("split", attempt)).shuffle(order)
            if values(every[i] for i in order[n_held:]) == wanted:
                break
        else:  # pragma: no cover - unreachable for heldout_fraction < 0.5
            raise ValueError("heldout_fraction: no split keeps every attribute value in training")
        held, train = sorted(order[:n_held]), sorted(order[n_held:])
        self._split = {"train": [every[i] for i in train], "eval": [every[i] for i in held]}

    def prompts(self, split: Split = "train") -> list:
        """The prompts of ``split`` in a fixed order (``"eval"`` is empty when
        ``heldout_fraction == 0``)."""
        if split not in _SPLITS:
            raise ValueError(f"split: expected one of {_SPLITS}, got {split!r}")
        return list(self._split[split])

    def example(self, index: int, split: Split = "train"):
        """The prompt at ``index`` of the ``split`` stream: the stream runs through the split's
        prompts in epochs of ``n = len(prompts(split))``, each epoch a fresh seeded shuffle, so
        every window ``[k n, (k + 1) n)`` holds each prompt exactly once."""
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"index: expected an int >= 0, got {index!r}")
        pool = self.prompts(split)
        if not pool:
            raise ValueError(f"split {split!r} has no prompts (heldout_fraction is 0)")
        epoch, offset = divmod(index, len(pool))
        return pool[self._epoch_order(split, epoch)[offset]]

    def _epoch_order(self, split: Split, epoch: int) -> list[int]:
        """The seeded shuffle of ``split``'s epoch ``epoch``, kept for the last few epochs
        (a training batch reads one or two: drawing it for every example cost about 7 % of
        the image SFT's time)."""
        order = self._orders.get((split, epoch))
        if order is None:
            order = list(range(len(self._split[split])))
            random.Random(self._seed(split, "epoch", epoch)).shuffle(order)
            if len(self._orders) >= 8:
                self._orders.clear()
            self._orders[(split, epoch)] = order
        return order

    def examples(self, indices: Iterable[int], split: Split = "train") -> list:
        """``[example(i, split) for i in indices]``."""
        return [self.example(int(i), split) for i in indices]

    def train_batch(self, position: int, batch_size: int):
        """Training batch number ``position``: ``(examples, render_batch(examples, indices))``
        for the indices ``[position * B, (position + 1) * B)`` of the training stream, each
        render seeded with its index; the int ``position`` is the whole data state (resume
        reproduces the stream)."""
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:
            raise ValueError(f"position: expected an int >= 0, got {position!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size: expected an int >= 1, got {batch_size!r}")
        indices = range(position * batch_size, (position + 1) * batch_size)
        examples = self.examples(indices, "train")
        return examples, self.render_batch(examples, list(indices))
