"""Tasks from local files: math word problems (``math``) and prompt lists (``prompts``).

Files are read through the ``datasets`` library (``pip install 'diffusion-rl[data]'``):
``load_dataset("json" | "parquet" | "csv", data_files=PATH, split="train")``, offline, with a
throw-away cache directory (nothing is written to the Hugging Face cache), and kept in memory
as plain rows. A prompt list may also be a ``.txt`` file, one prompt per non-empty line (read
directly). The format comes from the extension (``.jsonl`` / ``.json`` / ``.ndjson``,
``.parquet`` / ``.pq``, ``.csv``, ``.txt``) unless ``format`` says it. A file is read once per
process for the same path, size and modification time.

:class:`MathTask` (token world): GSM8K / MATH-style rows with a question and an answer field.
The gold final answer is taken from the answer field by ``answer_format``: ``gsm8k`` (the text
after the last ``"####"``, thousands commas dropped), ``boxed`` (the content of the last
``\\boxed{...}``), ``plain`` (the field as it is) or ``auto`` (``gsm8k`` when the field has
``"####"``, else ``boxed`` when it has ``\\boxed``, else ``plain``), row by row. The prompt is
``prompt_template`` with ``"{question}"`` replaced by the question; the SFT target is the
whole answer field; the verifier is :class:`~diffusion_rl.rewards.MathAnswerReward`
(math-verify) against the gold answer, so the ``math`` reward and the task's ``verifier`` agree.

:class:`PromptFileTask` (flow world): the prompt side of the image and video recipes, a list
of prompt strings with the :class:`~diffusion_rl.tasks.prompts.PromptTask` API (``prompts``,
``example``, ``examples``, ``info`` / ``from_info``); no verifier (reward models score it).

Splits: ``"train"`` is the rows of ``path``; ``"eval"`` the rows of ``eval_path`` when given,
else ``heldout_fraction`` of ``path``'s rows (at least one when the fraction is not 0), chosen
by a seeded shuffle and removed from ``"train"``. Each split is an endless stream in epochs,
each epoch a fresh seeded shuffle (every window ``[k n, (k + 1) n)`` holds each row once), so
``example(index, split)`` is a pure function of the files, the config, ``split`` and ``index``.
"""

from __future__ import annotations

import hashlib
import random
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..rewards import MathAnswerReward
from .prompts import PromptTask
from .text import Split, TextTask, check_index, check_split

__all__ = [
    "DATA_INSTALL_HINT",
    "MathConfig",
    "MathExample",
    "MathTask",
    "PromptExample",
    "PromptFileConfig",
    "PromptFileTask",
    "extract_answer",
    "read_rows",
]

DATA_INSTALL_HINT = (
    "the dataset tasks read files through the optional 'datasets' package; install it with: "
    "pip install 'diffusion-rl[data]'"
)
_EXTENSIONS = {
    ".jsonl": "json",
    ".json": "json",
    ".ndjson": "json",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".csv": "csv",
    ".txt": "text",
}
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


# ---------------------------------------------------------------------------- reading files
def check_file(value: str) -> str:
    """``value`` if it names an existing, readable file; else ``ValueError`` saying so (a
    ``"org/name"`` that is no file gets the hint to download it first)."""
    if not value.strip() or "\x00" in value:
        raise ValueError(f"expected a non-empty file path, got {value!r}")
    path = Path(value)
    if path.is_dir():
        raise ValueError(f"{value!r} is a directory; expected a data file (.jsonl, .parquet, ...)")
    if not path.is_file():
        hint = ""
        if _HUB_ID.fullmatch(value):
            hint = (
                f"; to use the Hub dataset {value}, download it first "
                f"(hf download {value} --repo-type dataset --local-dir DIR) and name a file in DIR"
            )
        raise ValueError(
            f"no such file {value!r} (relative paths are from the working directory){hint}"
        )
    try:
        with path.open("rb"):
            pass
    except OSError as error:
        raise ValueError(f"cannot read {value!r}: {error.strerror}") from None
    return value


def file_format(path: str, format: str | None, allowed: Sequence[str]) -> str:
    """``format``, or the one ``path``'s extension names; ``ValueError`` when neither is one
    of ``allowed``."""
    if format is not None:
        return format
    found = _EXTENSIONS.get(Path(path).suffix.lower())
    if found not in allowed:
        raise ValueError(
            f"cannot tell the format of {path!r} from its extension; name it with "
            f"format: {' | '.join(allowed)}"
        )
    return found


def read_rows(path: str, format: str, field: str = "task.path") -> tuple[dict[str, Any], ...]:
    """The rows of a local data file, each a dict of its columns (``format`` ``json``,
    ``parquet`` or ``csv`` through ``datasets``; ``text``: ``{"text": line}`` per non-empty
    line). Cached per (path, size, modification time, format).

    Raises:
        ImportError: ``datasets`` is not installed (the message says how to install it).
        ValueError: the file cannot be parsed as ``format``, or has no rows (the message names
            ``field`` and the file).
    """
    stat = Path(path).stat()
    return _read_rows(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns, format, field)


@lru_cache(maxsize=16)
def _read_rows(path: str, size: int, mtime_ns: int, format: str, field: str) -> tuple[dict, ...]:
    if format == "text":
        try:
            lines = Path(path).read_text("utf-8").splitlines()
        except UnicodeDecodeError as error:
            raise ValueError(f"{field}: {path} is not UTF-8 text: {error}") from None
        rows = tuple({"text": line.strip()} for line in lines if line.strip())
    else:
        try:
            import datasets as hf_datasets
        except ImportError as error:
            raise ImportError(DATA_INSTALL_HINT) from error
        bars = not hf_datasets.are_progress_bars_disabled()
        hf_datasets.disable_progress_bars()
        try:
            with tempfile.TemporaryDirectory(prefix="diffusion_rl_data_") as cache:
                table = hf_datasets.load_dataset(
                    format, data_files=path, split="train", cache_dir=cache
                )
                rows = tuple(table.to_list())
        except Exception as error:  # the builders raise many kinds; all mean "cannot parse"
            message = " ".join(str(error).split())[:300]
            raise ValueError(
                f"{field}: cannot read {path} as {format}: {type(error).__name__}: {message}"
            ) from None
        finally:
            if bars:
                hf_datasets.enable_progress_bars()
    if not rows:
        raise ValueError(f"{field}: {path} has no rows")
    return rows


def _column(rows: Sequence[dict], key: str, path: str, field: str) -> None:
    """Raise unless the rows have the column ``key`` (named by the config key ``field``)."""
    if key not in rows[0]:
        columns = ", ".join(map(repr, rows[0])) or "none"
        raise ValueError(
            f"{field}: {path} has no column {key!r} (its columns: {columns}); set {field} to "
            "the column to use"
        )


def _seed(seed_key: str, seed: int, *parts: object) -> int:
    key = ":".join([seed_key, str(seed), *map(str, parts)])
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")


def _split(
    rows: list,
    eval_rows: list | None,
    fraction: float,
    seed_key: str,
    seed: int,
    path: str,
    require_eval: bool = True,
) -> dict[str, list]:
    """``{"train": ..., "eval": ...}`` (module docstring); each keeps the file's order. An
    empty ``"train"`` split, or an empty ``"eval"`` one with ``require_eval``, raises."""
    if eval_rows is not None:
        split = {"train": rows, "eval": eval_rows}
    else:
        held = max(1, round(fraction * len(rows))) if fraction else 0
        order = list(range(len(rows)))
        random.Random(_seed(seed_key, seed, "split")).shuffle(order)
        chosen = set(order[:held])
        split = {
            "train": [r for i, r in enumerate(rows) if i not in chosen],
            "eval": [r for i, r in enumerate(rows) if i in chosen],
        }
    if not split["train"]:
        raise ValueError(
            f"task.path: {path} has {len(rows)} rows, none left for training after holding out "
            f"{len(split['eval'])}; use a larger file or task.heldout_fraction: 0 with an eval_path"
        )
    if require_eval and not split["eval"]:
        raise ValueError(
            "task.heldout_fraction: 0 holds out no rows and there is no eval_path; set "
            "task.eval_path or a heldout_fraction > 0"
        )
    return split


class _Streams:
    """The endless per-split streams: epoch ``e`` of a split is its rows in the seeded shuffle
    ``(split, "epoch", e)`` (the last few epochs' orders are cached)."""

    def __init__(self, split: dict[str, list], seed_key: str, seed: int) -> None:
        self.split, self.seed_key, self.seed = split, seed_key, seed
        self._orders: dict[tuple[str, int], list[int]] = {}

    def example(self, index: int, split: str):
        check_index(index)
        pool = self.split[check_split(split)]
        if not pool:
            raise ValueError(f"split {split!r} has no examples (heldout_fraction is 0)")
        epoch, offset = divmod(index, len(pool))
        order = self._orders.get((split, epoch))
        if order is None:
            order = list(range(len(pool)))
            random.Random(_seed(self.seed_key, self.seed, split, "epoch", epoch)).shuffle(order)
            if len(self._orders) >= 8:
                self._orders.clear()
            self._orders[(split, epoch)] = order
        return pool[order[offset]]


# ---------------------------------------------------------------------------- math problems
def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces balanced), or None."""
    start = text.rfind("\\boxed")
    while start != -1:
        at = start + len("\\boxed")
        while at < len(text) and text[at] == " ":
            at += 1
        if at < len(text) and text[at] == "{":
            depth = 0
            for end in range(at, len(text)):
                depth += {"{": 1, "}": -1}.get(text[end], 0)
                if depth == 0:
                    return text[at + 1 : end].strip()
        start = text.rfind("\\boxed", 0, start)
    return None


def extract_answer(text: str, answer_format: str) -> str | None:
    """The gold final answer of an answer field (module docstring), or None when the field
    has none in that format (``gsm8k`` without ``"####"``, ``boxed`` without a ``\\boxed{}``,
    or an empty answer)."""
    if answer_format == "auto":
        answer_format = "gsm8k" if "####" in text else "boxed" if "\\boxed" in text else "plain"
    if answer_format == "gsm8k":
        if "####" not in text:
            return None
        answer = _THOUSANDS.sub("", text.rsplit("####", 1)[1].strip())
    elif answer_format == "boxed":
        answer = _last_boxed(text)
    else:
        answer = text.strip()
    return answer or None


def _path(value: str | None) -> str | None:
    return None if value is None else check_file(value)


class MathConfig(BaseModel):
    """Settings of :class:`MathTask` (unknown keys are rejected; see the module docstring).

    ``path`` (required) and ``eval_path`` must be existing files; ``format`` null: from the
    extension. ``prompt_template`` must contain ``"{question}"``. ``max_prompt_tokens`` null:
    prompts padded to the longest of each batch (subword tokenizers) or of the file (character
    tokenizers). ``completion_tokens``: completion slots, a multiple of ``block_size``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    path: str
    eval_path: str | None = None
    format: Literal["json", "parquet", "csv"] | None = None
    question_field: str = "question"
    answer_field: str = "answer"
    answer_format: Literal["auto", "gsm8k", "boxed", "plain"] = "auto"
    prompt_template: str = "{question}"
    heldout_fraction: float = Field(0.1, ge=0.0, lt=0.5, allow_inf_nan=False)
    chat: bool = False
    max_prompt_tokens: int | None = Field(None, ge=1, le=65536)
    completion_tokens: int = Field(256, ge=1, le=65536)
    block_size: int = Field(4, ge=1, le=4096)
    seed: int = Field(0, ge=0)

    _check_paths = field_validator("path", "eval_path")(_path)

    @model_validator(mode="after")
    def _check(self) -> MathConfig:
        if "{question}" not in self.prompt_template:
            raise ValueError(
                f"prompt_template: must contain {{question}} (where the question goes), got "
                f"{self.prompt_template!r}"
            )
        allowed = ("json", "parquet", "csv")
        for key in ("path", "eval_path"):
            value = getattr(self, key)
            if value is not None:
                try:
                    file_format(value, self.format, allowed)
                except ValueError as error:
                    raise ValueError(f"format: {error}") from None
        if self.completion_tokens % self.block_size:
            raise ValueError(
                f"completion_tokens={self.completion_tokens} must be a multiple of "
                f"block_size={self.block_size} (sampler.block_size)"
            )
        return self


@dataclass(frozen=True)
class MathExample:
    """One problem: ``prompt`` (the template applied to ``question``), ``answer`` (the gold
    final answer), ``solution`` (the answer field as written: the SFT target), and where it
    came from (``source`` file, ``row`` index in it)."""

    prompt: str
    answer: str
    question: str
    solution: str
    source: str
    row: int


class MathTask(TextTask):
    """Math word problems from a local file, verified by math-verify (module docstring).

    Args:
        config: a :class:`MathConfig`.
        tokenizer: the model's tokenizer; ``None``: a character tokenizer over every
            character of the file's prompts and solutions (sorted).

    Raises:
        ValueError: a missing column, a row without a question or a gold answer, an empty
            split, or (with ``max_prompt_tokens``) a prompt longer than that; each message
            names the config key and the file.
        ImportError: ``datasets`` or ``math-verify`` is not installed.
    """

    name = "math"
    config_class = MathConfig
    seed_key = "diffusion_rl.math_file:v1"
    truncate_targets = True

    def __init__(self, config: MathConfig, tokenizer=None) -> None:
        super().__init__(config, tokenizer)
        self._verifier = MathAnswerReward()
        limit = self.config.max_prompt_tokens
        if limit is not None:  # every prompt fits, checked once here (not mid-run)
            every = [ex for split in self._split.values() for ex in split]
            tokens, longest = max(
                (
                    (len(self.tokenizer.encode(self.prompt_text(ex))), -k)
                    for k, ex in enumerate(every)
                )
            )
            longest = every[-longest]
            if tokens > limit:
                raise ValueError(
                    f"task.max_prompt_tokens={limit}: row {longest.row} of {longest.source} "
                    f"has a prompt of {tokens} tokens (the longest); raise max_prompt_tokens"
                )

    def __repr__(self) -> str:
        sizes = {split: len(rows) for split, rows in self._split.items()}
        return (
            f"MathTask(path={self.config.path!r}, {sizes['train']} train / {sizes['eval']} "
            f"eval problems, completion_tokens={self.config.completion_tokens})"
        )

    def _prepare(self) -> None:
        c = self.config
        train = self._read(c.path)
        evals = None if c.eval_path is None else self._read(c.eval_path)
        self._split = _split(train, evals, c.heldout_fraction, self.seed_key, c.seed, c.path)
        self._streams = _Streams(self._split, self.seed_key, c.seed)
        every = [ex for split in self._split.values() for ex in split]
        self._characters = "".join(sorted({ch for ex in every for ch in ex.prompt + ex.solution}))
        self._longest_prompt = max(len(ex.prompt) for ex in every)

    def _read(self, path: str) -> list[MathExample]:
        c = self.config
        key = "task.path" if path == c.path else "task.eval_path"
        rows = read_rows(path, file_format(path, c.format, ("json", "parquet", "csv")), key)
        _column(rows, c.question_field, path, "task.question_field")
        _column(rows, c.answer_field, path, "task.answer_field")
        examples = []
        for index, row in enumerate(rows):
            question, solution = row[c.question_field], row[c.answer_field]
            if not isinstance(question, str) or not question.strip():
                raise ValueError(
                    f"task.question_field: row {index} of {path} has {c.question_field!r} = "
                    f"{question!r}; expected a non-empty string"
                )
            if isinstance(solution, (int, float)) and not isinstance(solution, bool):
                solution = str(solution)
            if not isinstance(solution, str):
                raise ValueError(
                    f"task.answer_field: row {index} of {path} has {c.answer_field!r} = "
                    f"{solution!r}; expected a string or a number"
                )
            answer = extract_answer(solution, c.answer_format)
            if answer is None:
                raise ValueError(
                    f"task.answer_format: row {index} of {path} has no final answer in its "
                    f"{c.answer_field!r} field for answer_format {c.answer_format!r} "
                    f"({solution[-80:]!r}); set task.answer_format (gsm8k: '#### 42', boxed: "
                    "\\boxed{42}, plain: the field is the answer)"
                )
            prompt = c.prompt_template.replace("{question}", question)
            examples.append(MathExample(prompt, answer, question, solution, path, index))
        return examples

    @property
    def characters(self) -> str:
        return self._characters

    @property
    def char_prompt_length(self) -> int:
        """The longest prompt of the files in characters."""
        return self._longest_prompt

    @property
    def completion_length(self) -> int:
        return self.config.completion_tokens

    def prompts(self, split: Split = "train") -> list[MathExample]:
        """The problems of ``split`` in the files' order."""
        return list(self._split[check_split(split)])

    def example(self, index: int, split: Split = "train") -> MathExample:
        """The problem at ``index`` of the ``split`` stream (module docstring)."""
        return self._streams.example(index, split)

    def target_text(self, example: MathExample) -> str:
        return example.solution

    def reward(self, completion_text: str, example: MathExample) -> float:
        """1.0 iff math-verify finds the completion's final answer equal to the gold
        ``example.answer`` (:meth:`~diffusion_rl.rewards.MathAnswerReward.score`), else 0.0;
        never raises on bad text."""
        if not isinstance(completion_text, str):
            raise TypeError(
                f"reward: expected completion text as a str, got {type(completion_text).__name__}"
            )
        return self._verifier.score(completion_text, example.answer)


# ---------------------------------------------------------------------------- prompt lists
class PromptFileConfig(BaseModel):
    """Settings of :class:`PromptFileTask`: ``path`` (an existing ``.txt`` / ``.jsonl`` /
    ``.parquet`` / ``.csv`` file), ``format`` (null: from the extension), ``prompt_field``
    (the column holding the prompt; a ``.txt`` file has one prompt per line),
    ``heldout_fraction`` of the prompts for the ``"eval"`` split and the split ``seed``."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    path: str
    format: Literal["text", "json", "parquet", "csv"] | None = None
    prompt_field: str = "prompt"
    heldout_fraction: float = Field(0.1, ge=0.0, lt=0.5, allow_inf_nan=False)
    seed: int = Field(0, ge=0)

    _check_path = field_validator("path")(_path)

    @model_validator(mode="after")
    def _check(self) -> PromptFileConfig:
        try:
            file_format(self.path, self.format, ("text", "json", "parquet", "csv"))
        except ValueError as error:
            raise ValueError(f"format: {error}") from None
        return self


@dataclass(frozen=True)
class PromptExample:
    """One prompt of a prompt file, its ``row`` in the file and the row's other columns
    (``fields``; also readable as attributes, e.g. ``example.text`` for an OCR target)."""

    prompt: str
    row: int
    fields: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __getattr__(self, name: str) -> Any:
        try:
            return object.__getattribute__(self, "fields")[name]
        except (KeyError, AttributeError):
            raise AttributeError(name) from None


class PromptFileTask(PromptTask):
    """Prompts for the image and video recipes from a local file (module docstring): the
    :class:`~diffusion_rl.tasks.prompts.PromptTask` API over :class:`PromptExample` rows.

    Raises:
        ValueError: no ``prompt_field`` column, an empty or non-string prompt, an empty split
            (each message names the config key and the file).
    """

    name = "prompts"
    config_class = PromptFileConfig
    seed_key = "diffusion_rl.prompt_file:v1"

    def __init__(self, config: PromptFileConfig) -> None:
        super().__init__(config)
        c = self.config
        format = file_format(c.path, c.format, ("text", "json", "parquet", "csv"))
        rows = read_rows(c.path, format)
        key = "text" if format == "text" else c.prompt_field
        if format != "text":
            _column(rows, key, c.path, "task.prompt_field")
        examples = []
        for index, row in enumerate(rows):
            prompt = row[key]
            if not isinstance(prompt, str) or not prompt.strip():
                raise ValueError(
                    f"task.prompt_field: row {index} of {c.path} has {key!r} = {prompt!r}; "
                    "expected a non-empty string"
                )
            others = {k: v for k, v in row.items() if k != key}
            examples.append(PromptExample(prompt=prompt, row=index, fields=others))
        self._split = _split(
            examples, None, c.heldout_fraction, self.seed_key, c.seed, c.path, require_eval=False
        )
        self._streams = _Streams(self._split, self.seed_key, c.seed)

    def example(self, index: int, split: Split = "train") -> PromptExample:
        """The prompt at ``index`` of the ``split`` stream (module docstring)."""
        return self._streams.example(index, split)

    def render_batch(self, examples, seeds):
        raise TypeError(
            "a prompt file has prompts and no images: use it where only prompts are needed "
            "(flow-grpo, evaluation), not for flow-sft"
        )
