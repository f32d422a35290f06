"""Batched reward functions for RL post-training (GRPO and friends).

A reward function maps B decoded completions and their B examples to one float32 score each:

* :class:`RewardFunction` is the protocol: a ``name`` and
  ``__call__(completions, examples) -> Tensor`` float32 ``[B]``, finite, on CPU.
* :class:`CombinedReward` sums several rewards with non-negative weights and keeps every part
  (``RewardOutput.total == sum(weight * part)``), validating what each reward returns.
* Built-in rewards: :class:`TaskVerifierReward` (any task with ``.rewards(texts, examples)``,
  e.g. the arithmetic task), :class:`CountdownReward`, :class:`SudokuReward` and
  :class:`MathAnswerReward` (needs the optional ``math-verify`` package).
* Image rewards take ``(images [B, 3, H, W] in [0, 1], prompts)`` in the same order:
  :class:`GenEvalReward` (mini-GenEval attribute correctness) and
  :class:`CompressibilityReward` (minus the JPEG/PNG size, as in DDPO).
* :func:`get_reward` builds a registered reward by name.

Invariants: rewards never raise on malformed completion text (it scores 0.0, or the documented
partial score); malformed *examples* are programming errors and raise ``TypeError`` /
``ValueError`` naming the reward and the example index.
"""

from __future__ import annotations

import ast
import functools
import math
import numbers
import re
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import torch

__all__ = [
    "REWARDS",
    "CombinedReward",
    "CountdownReward",
    "MathAnswerReward",
    "RewardFunction",
    "RewardOutput",
    "SudokuReward",
    "TaskVerifierReward",
    "get_reward",
]


@runtime_checkable
class RewardFunction(Protocol):
    """Scores a batch of completions.

    ``__call__(completions, examples)`` takes B completion strings and the B examples they
    answer (same order) and returns a float32 tensor of shape ``[B]`` with finite values.
    ``name`` identifies the reward in logs and in :class:`RewardOutput.parts`.
    """

    name: str

    def __call__(self, completions: Sequence[str], examples: Sequence[Any]) -> torch.Tensor: ...


def _check_batch(owner: str, completions: Sequence[str], examples: Sequence[Any]) -> None:
    """Raise unless ``completions`` and ``examples`` are equally long sequences of the batch."""
    if isinstance(completions, str):
        raise TypeError(f"{owner}: expected a sequence of completion strings, got a single str")
    if len(completions) != len(examples):
        raise ValueError(
            f"{owner}: got {len(completions)} completions but {len(examples)} examples; "
            "expected equal"
        )


def _field(owner: str, example: Any, index: int, key: str) -> Any:
    """``example[key]`` for a mapping, else ``example.key``; a clear error when it is missing."""
    if isinstance(example, dict):
        if key in example:
            return example[key]
    elif hasattr(example, key):
        return getattr(example, key)
    raise ValueError(f"{owner}: example {index} has no {key!r} field ({type(example).__name__})")


# ---------------------------------------------------------------------------- combination
@dataclass(frozen=True)
class RewardOutput:
    """Result of :class:`CombinedReward`.

    ``total`` is float32 ``[B]`` and equals ``sum(weight * parts[name])`` over the terms;
    ``parts`` maps each reward's name to its own float32 ``[B]`` scores (unweighted), in the
    order the terms were given.
    """

    total: torch.Tensor
    parts: dict[str, torch.Tensor]


class CombinedReward:
    """A weighted sum of rewards: ``CombinedReward([(fn, weight), ...])``.

    Weights must be finite and ``>= 0`` (a zero weight keeps a reward for logging only) and
    reward names must be unique. Every part is checked on each call: it must be a tensor of
    shape ``[B]`` with a floating dtype and finite values (it is then cast to float32 on CPU);
    otherwise a ``TypeError`` / ``ValueError`` names the offending reward.
    """

    def __init__(self, terms: Sequence[tuple[RewardFunction, float]]) -> None:
        if isinstance(terms, (str, bytes)) or not isinstance(terms, Sequence):
            raise TypeError(
                f"CombinedReward: expected a sequence of (reward, weight) pairs, "
                f"got {type(terms).__name__}"
            )
        if len(terms) == 0:
            raise ValueError(
                "CombinedReward: expected at least one (reward, weight) pair, got none"
            )
        checked: list[tuple[RewardFunction, float]] = []
        seen: set[str] = set()
        for position, term in enumerate(terms):
            if not isinstance(term, tuple) or len(term) != 2:
                raise TypeError(
                    f"CombinedReward: term {position} must be a (reward, weight) pair, got {term!r}"
                )
            fn, weight = term
            name = getattr(fn, "name", None)
            if not callable(fn) or not isinstance(name, str) or not name:
                raise TypeError(
                    f"CombinedReward: term {position} must be a callable with a non-empty str "
                    f"'name' attribute, got {type(fn).__name__}"
                )
            if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
                raise TypeError(
                    f"CombinedReward: weight of reward {name!r} must be a real number, "
                    f"got {type(weight).__name__}"
                )
            weight = float(weight)
            if not math.isfinite(weight) or weight < 0:
                raise ValueError(
                    f"CombinedReward: weight of reward {name!r} must be finite and >= 0, "
                    f"got {weight}"
                )
            if name in seen:
                raise ValueError(f"CombinedReward: duplicate reward name {name!r}")
            seen.add(name)
            checked.append((fn, weight))
        self.terms: tuple[tuple[RewardFunction, float], ...] = tuple(checked)

    @property
    def names(self) -> list[str]:
        return [fn.name for fn, _ in self.terms]

    @property
    def weights(self) -> dict[str, float]:
        return {fn.name: weight for fn, weight in self.terms}

    def __repr__(self) -> str:
        inner = ", ".join(f"{fn.name}={weight:g}" for fn, weight in self.terms)
        return f"CombinedReward({inner})"

    def __call__(self, completions: Sequence[str], examples: Sequence[Any]) -> RewardOutput:
        """Score the batch with every reward; ``total`` float32 ``[B]``, ``parts`` per name."""
        _check_batch("CombinedReward", completions, examples)
        size = len(completions)
        total = torch.zeros(size, dtype=torch.float32)
        parts: dict[str, torch.Tensor] = {}
        for fn, weight in self.terms:
            part = _check_part(fn.name, fn(completions, examples), size)
            parts[fn.name] = part
            total = total + weight * part
        return RewardOutput(total=total, parts=parts)


def _check_part(name: str, value: Any, size: int) -> torch.Tensor:
    """The reward's output as float32 ``[size]`` on CPU, or a clear error naming the reward."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"reward {name!r} returned {type(value).__name__}, expected a torch.Tensor")
    if tuple(value.shape) != (size,):
        raise ValueError(
            f"reward {name!r} returned shape {tuple(value.shape)}, expected ({size},) "
            "(one score per completion)"
        )
    if not value.is_floating_point():
        raise TypeError(f"reward {name!r} returned dtype {value.dtype}, expected a float dtype")
    value = value.detach().to(device="cpu", dtype=torch.float32)
    bad = (~torch.isfinite(value)).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"reward {name!r} returned non-finite values at indices {bad[:8]}")
    return value


# ---------------------------------------------------------------------------- task verifier
class TaskVerifierReward:
    """A task's own verifier as a reward: ``task.rewards(completions, examples)``.

    Works with any object that has a ``name`` and a ``rewards(texts, examples)`` method
    returning ``[B]`` scores (e.g. :class:`~diffusion_rl.tasks.ArithmeticTask`).
    The reward's name is ``f"{task.name}_verifier"``.
    """

    def __init__(self, task: Any) -> None:
        task_name = getattr(task, "name", None)
        if not callable(getattr(task, "rewards", None)) or not isinstance(task_name, str):
            raise TypeError(
                "TaskVerifierReward: expected a task with a str 'name' and a "
                f"rewards(texts, examples) method, got {type(task).__name__}"
            )
        self.task = task
        self.name = f"{task_name}_verifier"

    def __repr__(self) -> str:
        return f"TaskVerifierReward({self.task!r})"

    def __call__(self, completions: Sequence[str], examples: Sequence[Any]) -> torch.Tensor:
        _check_batch(self.name, completions, examples)
        return _check_part(self.name, self.task.rewards(list(completions), examples), len(examples))


# ---------------------------------------------------------------------------- countdown
_COUNTDOWN_CHARS = frozenset("0123456789+-*/() ")
_COUNTDOWN_OPS = (ast.Add, ast.Sub, ast.Mult, ast.Div)
_INTEGER = re.compile(r"-?[0-9]{1,64}")


class _BadExpression(Exception):
    """The completion is not a well-formed Countdown expression."""


class _WrongAnswer(Exception):
    """Well-formed, but breaks a game rule (inexact division, division by zero)."""


def _countdown_literals(node: ast.AST) -> list[int]:
    """The integer literals of a whitelisted expression tree (``+ - * /``, ints, nothing else)."""
    if isinstance(node, ast.Expression):
        return _countdown_literals(node.body)
    if isinstance(node, ast.BinOp) and isinstance(node.op, _COUNTDOWN_OPS):
        return _countdown_literals(node.left) + _countdown_literals(node.right)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return [node.value]
    raise _BadExpression(type(node).__name__)


def _countdown_value(node: ast.AST) -> int:
    """Exact value of a whitelisted tree; every division must leave no remainder."""
    if isinstance(node, ast.Expression):
        return _countdown_value(node.body)
    if isinstance(node, ast.Constant):
        return node.value
    assert isinstance(node, ast.BinOp)
    left, right = _countdown_value(node.left), _countdown_value(node.right)
    if isinstance(node.op, ast.Add):
        return left + right
    if isinstance(node.op, ast.Sub):
        return left - right
    if isinstance(node.op, ast.Mult):
        return left * right
    if right == 0 or left % right:
        raise _WrongAnswer("division by zero or with a remainder")
    return left // right


class CountdownReward:
    """Countdown: combine the given numbers with ``+ - * /`` and parentheses to hit a target.

    Each example carries ``numbers`` (list of int) and ``target`` (int), as dict keys or
    attributes. The completion is an expression, optionally preceded by ``"="`` and optionally
    followed by ``"= <integer>"`` (optional ``-``, at most 64 digits) (e.g. ``"(6 - 2) * 5 = 20"``); runs of whitespace count as one
    space. The expression is parsed with :mod:`ast` and only integer literals, binary ``+ - * /``
    and parentheses are accepted (no unary minus, no ``**``, ``//``, names or calls), so nothing
    is ever evaluated by Python and sizes stay bounded.

    Scores:

    * ``1.0``: well formed; the multiset of literals is contained in ``numbers`` (each given
      number used at most once; with ``use_all`` exactly the multiset ``numbers``); every
      division is exact (integer arithmetic, no fractional intermediate result, no division by
      zero); the value equals ``target``; and a trailing ``"= n"`` (if present) has
      ``n == target``.
    * ``format_score``: well formed, but one of those rules fails.
    * ``0.0``: anything else (empty, over ``max_chars`` characters, characters outside
      ``0-9 + - * / ( )`` and spaces, syntax error, disallowed node, non-integer ``"= ..."``).

    Negative intermediate results are allowed.
    """

    name = "countdown"

    def __init__(
        self, *, use_all: bool = False, format_score: float = 0.0, max_chars: int = 256
    ) -> None:
        if not isinstance(use_all, bool):
            raise TypeError(f"CountdownReward.use_all: expected a bool, got {use_all!r}")
        if isinstance(format_score, bool) or not isinstance(format_score, numbers.Real):
            raise TypeError(
                f"CountdownReward.format_score: expected a real number, got {format_score!r}"
            )
        if not 0.0 <= float(format_score) <= 1.0:
            raise ValueError(
                f"CountdownReward.format_score: expected 0 <= x <= 1, got {format_score}"
            )
        if isinstance(max_chars, bool) or not isinstance(max_chars, int) or max_chars < 1:
            raise ValueError(f"CountdownReward.max_chars: expected an int >= 1, got {max_chars!r}")
        self.use_all = use_all
        self.format_score = float(format_score)
        self.max_chars = max_chars

    def __repr__(self) -> str:
        return (
            f"CountdownReward(use_all={self.use_all}, format_score={self.format_score}, "
            f"max_chars={self.max_chars})"
        )

    def _example(self, example: Any, index: int) -> tuple[list[int], int]:
        numbers_ = _field(self.name, example, index, "numbers")
        target = _field(self.name, example, index, "target")
        if not isinstance(numbers_, (list, tuple)) or not all(type(n) is int for n in numbers_):
            raise TypeError(f"{self.name}: example {index}: 'numbers' must be a list of int")
        if type(target) is not int:
            raise TypeError(f"{self.name}: example {index}: 'target' must be an int")
        return list(numbers_), target

    def score(self, completion: str, numbers: Sequence[int], target: int) -> float:
        """The score of one completion (see the class docstring); never raises on bad text."""
        if not isinstance(completion, str):
            return 0.0
        text = " ".join(completion.split())
        if not text or len(text) > self.max_chars:
            return 0.0
        if text.startswith("="):
            text = text[1:]
        pieces = text.split("=")
        if len(pieces) > 2:
            return 0.0
        claimed = None
        if len(pieces) == 2:
            rhs = pieces[1].strip()
            if not _INTEGER.fullmatch(rhs):
                return 0.0
            claimed = int(rhs)
        expression = pieces[0].strip()
        if not expression or not set(expression) <= _COUNTDOWN_CHARS:
            return 0.0
        try:
            tree = ast.parse(expression, mode="eval")
            literals = _countdown_literals(tree)
        except (SyntaxError, ValueError, RecursionError, MemoryError, _BadExpression):
            return 0.0
        used, given = Counter(literals), Counter(numbers)
        if used - given or (self.use_all and used != given):
            return self.format_score
        try:
            value = _countdown_value(tree)
        except (_WrongAnswer, RecursionError):
            return self.format_score
        if value != target or (claimed is not None and claimed != target):
            return self.format_score
        return 1.0

    def __call__(self, completions: Sequence[str], examples: Sequence[Any]) -> torch.Tensor:
        _check_batch(self.name, completions, examples)
        values = []
        for index, (completion, example) in enumerate(zip(completions, examples)):
            numbers_, target = self._example(example, index)
            values.append(self.score(completion, numbers_, target))
        return torch.tensor(values, dtype=torch.float32)


# ---------------------------------------------------------------------------- sudoku
_SUDOKU_BOX = {4: 2, 9: 3}
_SUDOKU_SEPARATORS = frozenset("|,;:-+_/")


def _sudoku_units(size: int) -> list[list[int]]:
    """Cell indices (row-major) of every row, column and box of a ``size x size`` grid."""
    box = _SUDOKU_BOX[size]
    rows = [[r * size + c for c in range(size)] for r in range(size)]
    cols = [[r * size + c for r in range(size)] for c in range(size)]
    boxes = [
        [(br + r) * size + bc + c for r in range(box) for c in range(box)]
        for br in range(0, size, box)
        for bc in range(0, size, box)
    ]
    return rows + cols + boxes


@functools.lru_cache(maxsize=4)
def _sudoku_peers(size: int) -> tuple[tuple[int, ...], ...]:
    """For each cell, the other cells sharing a row, column or box with it."""
    peers: list[set[int]] = [set() for _ in range(size * size)]
    for unit in _sudoku_units(size):
        for cell in unit:
            peers[cell].update(unit)
    return tuple(tuple(sorted(p - {cell})) for cell, p in enumerate(peers))


def _sudoku_is_solution(grid: Sequence[int], givens: Sequence[int], size: int) -> bool:
    """True iff ``grid`` is complete, keeps every nonzero given and every unit is 1..size."""
    if any(g and g != v for g, v in zip(givens, grid)):
        return False
    full = set(range(1, size + 1))
    return all({grid[i] for i in unit} == full for unit in _sudoku_units(size))


@functools.lru_cache(maxsize=1024)
def _sudoku_unique_solution(givens: tuple[int, ...], size: int) -> tuple[int, ...] | None:
    """The solution of the puzzle if there is exactly one, else ``None`` (none, or several).

    Depth-first backtracking that always branches on the blank cell with the fewest candidates
    and stops as soon as a second solution is found.
    """
    peers = _sudoku_peers(size)
    grid = list(givens)
    for cell, value in enumerate(grid):
        if value and any(grid[p] == value for p in peers[cell]):
            return None  # the givens already conflict
    solutions: list[tuple[int, ...]] = []

    def search() -> None:
        best, best_options = -1, None
        for cell, value in enumerate(grid):
            if value:
                continue
            options = set(range(1, size + 1)) - {grid[p] for p in peers[cell]}
            if best_options is None or len(options) < len(best_options):
                best, best_options = cell, options
                if not options:
                    return
        if best_options is None:
            solutions.append(tuple(grid))
            return
        for value in sorted(best_options):
            grid[best] = value
            search()
            grid[best] = 0
            if len(solutions) > 1:
                return

    search()
    return solutions[0] if len(solutions) == 1 else None


class SudokuReward:
    """Sudoku on a 4x4 (2x2 boxes) or 9x9 (3x3 boxes) grid.

    Each example carries ``puzzle``: a row-major string of ``N*N`` characters, digits ``1..N``
    for givens and ``"0"`` or ``"."`` for blanks. The completion is the filled grid: after
    deleting whitespace and the separators ``| , ; : - + _ /`` it must be exactly ``N*N``
    characters from ``0-9`` and ``"."``, else it scores 0.0. A cell holding ``0``, ``.`` or a
    digit above ``N`` counts as unfilled.

    Modes:

    * ``"exact"``: 1.0 iff the grid is a valid complete solution (every row, column and box
      holds ``1..N`` once) that keeps every given, else 0.0.
    * ``"cells"``: when the puzzle has exactly one solution (found by a small backtracking
      solver, cached per puzzle), the fraction of the puzzle's blank cells whose completion
      digit equals that solution (givens are not scored); when it has no blank cells, none or
      several solutions, the ``"exact"`` score.
    """

    name = "sudoku"

    def __init__(self, *, mode: Literal["exact", "cells"] = "exact") -> None:
        if mode not in ("exact", "cells"):
            raise ValueError(f"SudokuReward.mode: expected 'exact' or 'cells', got {mode!r}")
        self.mode = mode

    def __repr__(self) -> str:
        return f"SudokuReward(mode={self.mode!r})"

    def _puzzle(self, example: Any, index: int) -> tuple[tuple[int, ...], int]:
        puzzle = _field(self.name, example, index, "puzzle")
        if not isinstance(puzzle, str):
            raise TypeError(f"{self.name}: example {index}: 'puzzle' must be a str")
        size = math.isqrt(len(puzzle))
        if size not in _SUDOKU_BOX or size * size != len(puzzle):
            raise ValueError(
                f"{self.name}: example {index}: puzzle has {len(puzzle)} characters; "
                "expected 16 (4x4) or 81 (9x9)"
            )
        allowed = set("0.") | {str(d) for d in range(1, size + 1)}
        if not set(puzzle) <= allowed:
            raise ValueError(
                f"{self.name}: example {index}: puzzle characters must be in {sorted(allowed)}"
            )
        return tuple(0 if ch in "0." else int(ch) for ch in puzzle), size

    def score(self, completion: str, givens: Sequence[int], size: int) -> float:
        """The score of one completion for a parsed puzzle; never raises on bad text."""
        if not isinstance(completion, str):
            return 0.0
        chars = [ch for ch in completion if not ch.isspace() and ch not in _SUDOKU_SEPARATORS]
        if len(chars) != size * size or not all(ch in "0123456789." for ch in chars):
            return 0.0
        grid = [0 if ch == "." or int(ch) > size else int(ch) for ch in chars]
        exact = 1.0 if _sudoku_is_solution(grid, givens, size) else 0.0
        blanks = [cell for cell, value in enumerate(givens) if not value]
        if self.mode == "exact" or not blanks:
            return exact
        solution = _sudoku_unique_solution(tuple(givens), size)
        if solution is None:
            return exact
        return sum(grid[cell] == solution[cell] for cell in blanks) / len(blanks)

    def __call__(self, completions: Sequence[str], examples: Sequence[Any]) -> torch.Tensor:
        _check_batch(self.name, completions, examples)
        values = []
        for index, (completion, example) in enumerate(zip(completions, examples)):
            givens, size = self._puzzle(example, index)
            values.append(self.score(completion, givens, size))
        return torch.tensor(values, dtype=torch.float32)


# ---------------------------------------------------------------------------- math answers
_MATH_INSTALL_HINT = (
    "MathAnswerReward needs the optional 'math-verify' package; "
    "install it with: pip install 'diffusion-rl[math]'"
)


def _import_math_verify() -> Any:
    try:
        import math_verify
    except ImportError as error:
        raise ImportError(_MATH_INSTALL_HINT) from error
    return math_verify


class MathAnswerReward:
    """1.0 iff the completion's final math answer equals the example's ``answer``.

    Uses ``math_verify.parse`` on both sides and ``math_verify.verify(gold, prediction)``, so
    ``"\\frac{1}{2}"``, ``"0.5"`` and ``"\\boxed{1/2}"`` all match. A gold ``answer`` (a str)
    without ``$`` or ``\\boxed`` is read as LaTeX math (wrapped in ``$...$``). Anything that
    fails to parse or compare scores 0.0.

    Threads: math-verify bounds each parse/compare with ``signal.alarm``, which works only in
    the main thread (and replaces any SIGALRM handler / pending alarm of the caller while it
    runs). With ``timeout_seconds`` set (default 5), calling this reward from another thread
    raises ``RuntimeError``; with ``timeout_seconds=None`` no signals are used and it may run
    in any thread, but a pathological expression can then take unbounded time.

    Raises:
        ImportError: at construction, when ``math-verify`` is not installed (the message says
            ``pip install 'diffusion-rl[math]'``).
    """

    name = "math"

    def __init__(self, *, timeout_seconds: int | None = 5) -> None:
        if timeout_seconds is not None and (
            isinstance(timeout_seconds, bool)
            or not isinstance(timeout_seconds, int)
            or timeout_seconds < 1
        ):
            raise ValueError(
                "MathAnswerReward.timeout_seconds: expected None or an int >= 1 (signal.alarm "
                f"takes whole seconds), got {timeout_seconds!r}"
            )
        self._math_verify = _import_math_verify()
        self.timeout_seconds = timeout_seconds

    def __repr__(self) -> str:
        return f"MathAnswerReward(timeout_seconds={self.timeout_seconds})"

    def score(self, completion: str, answer: str) -> float:
        """The score of one completion; never raises on bad text (see the thread rule)."""
        if not isinstance(completion, str):
            return 0.0
        mv, timeout = self._math_verify, self.timeout_seconds
        if "$" not in answer and "\\boxed" not in answer:
            answer = f"${answer}$"
        try:
            gold = mv.parse(answer, parsing_timeout=timeout)
            prediction = mv.parse(completion, parsing_timeout=timeout)
            if not gold or not prediction:
                return 0.0
            return 1.0 if mv.verify(gold, prediction, timeout_seconds=timeout) else 0.0
        except Exception:
            return 0.0

    def __call__(self, completions: Sequence[str], examples: Sequence[Any]) -> torch.Tensor:
        _check_batch(self.name, completions, examples)
        if self.timeout_seconds is not None and (
            threading.current_thread() is not threading.main_thread()
        ):
            raise RuntimeError(
                "MathAnswerReward: math-verify's timeouts use signal.alarm, which works only in "
                "the main thread; call it from the main thread or build it with "
                "timeout_seconds=None (no timeout) to use it from other threads"
            )
        values = []
        for index, (completion, example) in enumerate(zip(completions, examples)):
            answer = _field(self.name, example, index, "answer")
            if not isinstance(answer, str):
                raise TypeError(f"{self.name}: example {index}: 'answer' must be a str")
            values.append(self.score(completion, answer))
        return torch.tensor(values, dtype=torch.float32)


# ---------------------------------------------------------------------------- registry
class TaskDigitReward:
    """Partial credit from a task's ``digit_reward(text, example)`` (a denser signal than the
    exact verifier for arithmetic), named ``f"{task.name}_digits"``."""

    def __init__(self, task: Any) -> None:
        if not callable(getattr(task, "digit_reward", None)):
            raise TypeError(f"task: {type(task).__name__} has no digit_reward(text, example)")
        self.task = task
        self.name = f"{task.name}_digits"

    def __call__(self, completions: Sequence[str], examples: Sequence[Any]) -> torch.Tensor:
        _check_batch(self.name, completions, examples)
        scores = [self.task.digit_reward(c, e) for c, e in zip(completions, examples)]
        return torch.tensor(scores, dtype=torch.float32)


REWARDS: dict[str, Callable[..., RewardFunction]] = {
    "verifier": TaskVerifierReward,
    "digits": TaskDigitReward,
    "countdown": CountdownReward,
    "sudoku": SudokuReward,
    "math": MathAnswerReward,
}


def get_reward(name: str, **options: Any) -> RewardFunction:
    """The reward registered as ``name``, built with ``options``.

    ``"verifier"`` and ``"digits"`` need ``task=...``; ``"countdown"`` takes ``use_all``, ``format_score``,
    ``max_chars``; ``"sudoku"`` takes ``mode``; ``"math"`` takes ``timeout_seconds``.

    Raises:
        ValueError: unknown ``name`` (the message lists the known ones).
        TypeError: options the reward does not accept.
    """
    if name not in REWARDS:
        raise ValueError(f"unknown reward {name!r}; known rewards: {sorted(REWARDS)}")
    return REWARDS[name](**options)


# ---------------------------------------------------------------------------- images
# Image rewards follow the same call order as the text rewards: the generated artefact first,
# then what it answers. ``__call__(images, examples)``: ``images`` float ``[B, 3, H, W]`` in
# ``[0, 1]`` (``model.decode(latents)``), ``examples`` B prompt strings (or objects with a
# ``prompt`` field); the result is float32 ``[B]``. They combine with :class:`CombinedReward`
# unchanged (it only needs ``len(images) == len(examples)``).


# Per artefact kind: the argument's name, its layout (and a note on it), its rank and the index
# of its RGB axis.
_PIXEL_LAYOUTS = {
    "image": ("images", "[B, 3, H, W]", "", 4, 1),
    "video": ("clips", "[B, F, 3, H, W]", " (frame-major)", 5, 2),
}


def _check_pixels(
    owner: str, pixels: Any, examples: Sequence[Any] | None, kind: str
) -> torch.Tensor:
    """``pixels`` (``kind`` ``"image"`` or ``"video"``, see ``_PIXEL_LAYOUTS``) as float32 on
    CPU, values finite in ``[0, 1]``, one row per example when ``examples`` is given; or a
    TypeError / ValueError naming ``owner``."""
    noun, layout, note, rank, rgb = _PIXEL_LAYOUTS[kind]
    if not isinstance(pixels, torch.Tensor):
        raise TypeError(
            f"{owner}: expected {noun} as a torch.Tensor {layout} first and the prompts second, "
            f"got {type(pixels).__name__} first"
        )
    if pixels.dim() != rank or pixels.shape[rgb] != 3 or not pixels.is_floating_point():
        raise ValueError(
            f"{owner}: expected a float {kind} tensor {layout}{note}, got shape "
            f"{tuple(pixels.shape)} dtype {pixels.dtype}"
        )
    pixels = pixels.detach().to(device="cpu", dtype=torch.float32)
    if not bool(torch.isfinite(pixels).all()) or pixels.min() < 0 or pixels.max() > 1:
        raise ValueError(
            f"{owner}: pixel values must be finite and in [0, 1] (e.g. model.decode(latents)), "
            "got a tensor outside that range"
        )
    if examples is not None:
        _check_batch(owner, pixels, examples)
    return pixels


class GenEvalReward:
    """Mini-GenEval correctness of an image for its prompt (see
    :mod:`diffusion_rl.tasks.geneval`): the fraction of the prompt's attributes (colour,
    shape, position or count) the verifier finds right (``mode="mean"``, a denser signal), or
    1.0 iff all are right (``mode="all"``). ``min_area`` overrides the verifier's noise floor
    (default: from the image size). Prompts that are not mini-GenEval prompts raise
    ``ValueError``."""

    name = "geneval"

    def __init__(self, *, mode: Literal["mean", "all"] = "mean", min_area: int | None = None):
        if mode not in ("mean", "all"):
            raise ValueError(f"GenEvalReward.mode: expected 'mean' or 'all', got {mode!r}")
        if min_area is not None and (
            isinstance(min_area, bool) or not isinstance(min_area, int) or min_area < 1
        ):
            raise ValueError(f"GenEvalReward.min_area: expected an int >= 1, got {min_area!r}")
        self.mode = mode
        self.min_area = min_area

    def __repr__(self) -> str:
        return f"GenEvalReward(mode={self.mode!r}, min_area={self.min_area})"

    def __call__(self, images: torch.Tensor, examples: Sequence[Any]) -> torch.Tensor:
        from .tasks.geneval import analyze_images, check_objects, to_example

        images = _check_pixels(self.name, images, examples, "image")
        parsed = [to_example(example, index) for index, example in enumerate(examples)]
        values = []
        for example, objects in zip(parsed, analyze_images(images, self.min_area)):
            result = check_objects(example, objects)
            if self.mode == "all":
                values.append(float(result["overall"]))
            else:
                values.append(sum(result[a] for a in example.attributes) / len(example.attributes))
        return torch.tensor(values, dtype=torch.float32)


class CompressibilityReward:
    """How well the image compresses (DDPO's compressibility reward): minus the size of the
    image encoded as ``format`` (``"jpeg"`` at ``quality``, or lossless ``"png"``) after
    rounding to 8-bit, in kilobytes (``unit="kb"``, 1 kB = 1000 bytes) or in bits per pixel
    (``unit="bpp"``, comparable across image sizes). Prompts are ignored. Higher is flatter."""

    name = "compressibility"

    def __init__(
        self,
        *,
        format: Literal["jpeg", "png"] = "jpeg",
        quality: int = 95,
        unit: Literal["kb", "bpp"] = "kb",
    ) -> None:
        if format not in ("jpeg", "png"):
            raise ValueError(
                f"CompressibilityReward.format: expected 'jpeg' or 'png', got {format!r}"
            )
        if isinstance(quality, bool) or not isinstance(quality, int) or not 1 <= quality <= 100:
            raise ValueError(
                f"CompressibilityReward.quality: expected an int in [1, 100], got {quality!r}"
            )
        if unit not in ("kb", "bpp"):
            raise ValueError(f"CompressibilityReward.unit: expected 'kb' or 'bpp', got {unit!r}")
        self.format, self.quality, self.unit = format, quality, unit

    def __repr__(self) -> str:
        return (
            f"CompressibilityReward(format={self.format!r}, quality={self.quality}, "
            f"unit={self.unit!r})"
        )

    def encoded_bytes(self, image: torch.Tensor) -> int:
        """Size in bytes of one image ``[3, H, W]`` in ``[0, 1]`` encoded as configured."""
        import io

        from PIL import Image

        pixels = (image.permute(1, 2, 0) * 255).round().clamp(0, 255).to(torch.uint8).numpy()
        buffer = io.BytesIO()
        if self.format == "jpeg":
            Image.fromarray(pixels).save(buffer, format="JPEG", quality=self.quality)
        else:
            Image.fromarray(pixels).save(buffer, format="PNG", optimize=False)
        return buffer.tell()

    def __call__(self, images: torch.Tensor, examples: Sequence[Any] | None = None) -> torch.Tensor:
        images = _check_pixels(self.name, images, examples, "image")
        sizes = torch.tensor([self.encoded_bytes(image) for image in images], dtype=torch.float64)
        if self.unit == "kb":
            values = -sizes / 1000.0
        else:
            values = -sizes * 8.0 / (images.shape[2] * images.shape[3])
        return values.to(torch.float32)


REWARDS["geneval"] = GenEvalReward
REWARDS["compressibility"] = CompressibilityReward
__all__ += ["CompressibilityReward", "GenEvalReward"]


# ---------------------------------------------------------------------------- videos
# Video rewards take ``(clips [B, F, 3, H, W] in [0, 1], prompts)`` (frame-major pixels, e.g.
# an image-to-video model's ``decode(latents)``) and return float32 ``[B]``, like the image
# rewards; they combine with :class:`CombinedReward` unchanged.


class MotionReward:
    """Mini-motion correctness of a clip for its prompt (see :mod:`diffusion_rl.tasks.motion`):
    the fraction of ``attributes`` (default all of ``color``, ``shape``, ``direction``,
    ``speed``, ``smooth``) the verifier finds right (``mode="mean"``), or 1.0 iff all of them
    are (``mode="all"``). The score depends on the chosen attributes only (``["color"]``: on
    the colour, never on the motion). ``slow_pixels`` / ``fast_pixels`` are the task's speeds
    (pixels per frame); ``min_area`` overrides the noise floor. The name is ``"motion"``, or
    ``"motion_<attr>_..."`` for a subset (so several subsets can be combined)."""

    def __init__(
        self,
        *,
        attributes: Sequence[str] | None = None,
        mode: Literal["mean", "all"] = "mean",
        min_area: int | None = None,
        slow_pixels: int = 1,
        fast_pixels: int = 2,
    ) -> None:
        from .tasks.motion import MOTION_ATTRIBUTES, check_motion_attributes

        try:
            self.attributes = check_motion_attributes(attributes)
        except (TypeError, ValueError) as error:
            raise type(error)(f"MotionReward.{error}") from None
        if mode not in ("mean", "all"):
            raise ValueError(f"MotionReward.mode: expected 'mean' or 'all', got {mode!r}")
        if min_area is not None and (
            isinstance(min_area, bool) or not isinstance(min_area, int) or min_area < 1
        ):
            raise ValueError(f"MotionReward.min_area: expected an int >= 1, got {min_area!r}")
        for key, value in (("slow_pixels", slow_pixels), ("fast_pixels", fast_pixels)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MotionReward.{key}: expected an int >= 1, got {value!r}")
        if slow_pixels >= fast_pixels:
            raise ValueError(
                f"MotionReward: slow_pixels ({slow_pixels}) must be less than fast_pixels "
                f"({fast_pixels})"
            )
        self.mode, self.min_area = mode, min_area
        self.slow_pixels, self.fast_pixels = slow_pixels, fast_pixels
        full = self.attributes == MOTION_ATTRIBUTES
        self.name = "motion" if full else "_".join(("motion", *self.attributes))

    def __repr__(self) -> str:
        return (
            f"MotionReward(attributes={list(self.attributes)}, mode={self.mode!r}, "
            f"min_area={self.min_area}, slow_pixels={self.slow_pixels}, "
            f"fast_pixels={self.fast_pixels})"
        )

    def __call__(self, clips: torch.Tensor, examples: Sequence[Any]) -> torch.Tensor:
        from .tasks.motion import clip_scores, verify_clips

        clips = _check_pixels(self.name, clips, examples, "video")
        results = verify_clips(
            clips,
            examples,
            slow_pixels=self.slow_pixels,
            fast_pixels=self.fast_pixels,
            min_area=self.min_area,
        )
        return clip_scores(results, self.attributes, self.mode)


REWARDS["motion"] = MotionReward
__all__ += ["MotionReward"]


# ---------------------------------------------------------------------------- reward models
# Image rewards computed by models from local directories (optional extras; docs/rewards.md):
# clip_score, pickscore, aesthetic (pip install 'diffusion-rl[clip]') and ocr ('[ocr]').
# reward_models imports nothing from this module at import time, so either may load first.
from .reward_models import MODEL_REWARDS  # noqa: E402

REWARDS.update(MODEL_REWARDS)
