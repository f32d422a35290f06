"""The built-in Countdown and Sudoku tasks, the text-task encoding with other tokenizers, and
the recipes (sft, grpo, distill) on them with their character tokenizers."""

from __future__ import annotations

import ast
import itertools
import json
import re
from collections import Counter
from fractions import Fraction

import pydantic
import pytest
import torch

from diffusion_rl.config import (
    TASK_REWARDS,
    ConfigError,
    DistillRecipeConfig,
    GRPORecipeConfig,
    SFTRecipeConfig,
    build_config,
    load_config,
)
from diffusion_rl.models import load_model
from diffusion_rl.recipes.distill import run_distill
from diffusion_rl.recipes.grpo import run_grpo
from diffusion_rl.recipes.sft import run_sft
from diffusion_rl.rewards import CountdownReward, SudokuReward, get_reward
from diffusion_rl.tasks import (
    TASKS,
    ArithmeticTask,
    CharTokenizer,
    CountdownConfig,
    CountdownExample,
    CountdownTask,
    SudokuConfig,
    SudokuTask,
    TokenizerMismatchError,
    get_task,
)

PAD, EOS = 0, 2


class PairTokenizer:
    """A subword-like test tokenizer: one token per two characters (ids assigned on first
    sight), so token counts differ from character counts; its chat template wraps the text."""

    name = "pairs-test"
    pad_id, mask_id, eos_id = 0, 1, 2

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    @property
    def vocab_size(self) -> int:
        return 3 + len(self.ids)

    def encode(self, text: str) -> list[int]:
        return [
            self.ids.setdefault(text[i : i + 2], 3 + len(self.ids)) for i in range(0, len(text), 2)
        ]

    def decode(self, ids, stop_at_eos: bool = True) -> str:
        pieces = {i: piece for piece, i in self.ids.items()}
        out = []
        for token in ids.tolist() if isinstance(ids, torch.Tensor) else ids:
            if token == self.eos_id and stop_at_eos:
                break
            out.append(pieces.get(int(token), ""))
        return "".join(out)

    def batch_decode(self, ids, stop_at_eos: bool = True) -> list[str]:
        return [self.decode(row, stop_at_eos) for row in ids]

    def chat_prompt(self, text: str) -> str:
        return f"<u>{text}</u>"


def fraction_value(expression: str) -> tuple[Fraction, list[int]]:
    """Exact value and integer literals of an arithmetic expression (independent of the
    reward's parser: Fractions, so an inexact division would show)."""

    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant):
            literals.append(node.value)
            return Fraction(node.value)
        left, right = walk(node.left), walk(node.right)
        ops = {ast.Add: left + right, ast.Sub: left - right, ast.Mult: left * right}
        return ops.get(type(node.op)) if type(node.op) in ops else left / right

    literals: list[int] = []
    return walk(ast.parse(expression, mode="eval")), literals


# ---------------------------------------------------------------------------- countdown
def test_countdown_examples_are_solvable_and_deterministic():
    task = CountdownTask()
    examples = task.examples(range(300), "train")
    assert examples == CountdownTask().examples(range(300), "train")
    assert examples != task.examples(range(300), "eval")
    assert examples != CountdownTask(CountdownConfig(seed=1)).examples(range(300), "train")
    ops = Counter()
    for ex in examples:
        numbers = [int(n) for n in ex.prompt.split(":")[0].split(",")]
        assert ex.prompt == f"{','.join(map(str, numbers))}:{ex.target}="
        assert tuple(numbers) == ex.numbers and len(numbers) == 3
        assert all(1 <= n <= 9 for n in numbers) and 1 <= ex.target <= 99
        value, literals = fraction_value(ex.answer)
        assert value == ex.target and sorted(literals) == sorted(numbers)  # all used, once
        assert len(ex.answer) < task.completion_length and len(ex.prompt) <= task.prompt_length
        assert task.reward(ex.answer, ex) == 1.0
        ops.update(ch for ch in ex.answer if ch in "+-*/")
    assert min(ops[op] for op in "+-*/") > 20  # every operator occurs
    longest = max(
        len(ex.answer) for ex in CountdownTask(CountdownConfig(num_numbers=4)).examples(range(400))
    )
    assert longest <= 4 + 3 + 4  # digits, operators, two pairs of parentheses at most


def test_countdown_division_stays_exact():
    task = CountdownTask(CountdownConfig(num_numbers=4, max_number=12, max_target=200))
    divided = [ex for ex in task.examples(range(400)) if "/" in ex.answer]
    assert len(divided) > 20
    for ex in divided:  # each step's value is an integer: replay the left fold
        tokens = re.findall(r"\d+|[-+*/]", ex.answer)
        value = int(tokens[0])
        for op, n in zip(tokens[1::2], map(int, tokens[2::2])):
            if op == "/":
                assert value % n == 0
            value = {"+": value + n, "-": value - n, "*": value * n, "/": value // n}[op]
            assert 1 <= value <= 200
        assert value == ex.target


def test_countdown_verifier_is_the_countdown_reward():
    ex = CountdownExample(prompt="3,5,7:15=", answer="3+5+7", numbers=(3, 5, 7), target=15)
    texts = ["3+5+7", "(7-5)*3+5+ 4", "7+5+3 = 15", "5*3", "3*5=15", "5*3/0", "15", "3+5+7=14", ""]
    for use_all in (False, True):
        task = CountdownTask(CountdownConfig(use_all=use_all))
        reward = CountdownReward(use_all=use_all)
        assert (
            task.rewards(texts, [ex] * len(texts)).tolist()
            == reward(texts, [ex] * len(texts)).tolist()
        )
    subset = CountdownTask().rewards(["5*3", "3*5=15"], [ex, ex]).tolist()
    assert subset == [1.0, 1.0]
    assert CountdownTask(CountdownConfig(use_all=True)).rewards(["5*3"], [ex]).tolist() == [0.0]
    verifier = get_reward("verifier", task=CountdownTask())
    assert verifier(texts, [ex] * len(texts)).tolist() == [1, 0, 1, 1, 1, 0, 0, 0, 0]


def test_countdown_config_is_checked():
    with pytest.raises(pydantic.ValidationError, match="max_target=10 must be at least 2"):
        CountdownConfig(max_target=10)
    with pytest.raises(pydantic.ValidationError, match="multiple of block_size=4"):
        CountdownConfig(completion_length=10)
    with pytest.raises(pydantic.ValidationError, match="extra"):
        CountdownConfig(numbers=3)
    # the longest answer: 3 digits, 2 operators, 1 pair of parentheses = 7, then one <eos>
    assert max(len(ex.answer) for ex in CountdownTask().examples(range(300))) == 7
    lengths = [CountdownTask(CountdownConfig(block_size=b)).completion_length for b in (8, 3, 5)]
    assert lengths == [8, 9, 10]


# ---------------------------------------------------------------------------- sudoku
def all_4x4_grids() -> list[tuple[int, ...]]:
    """Every valid 4x4 sudoku (288), by brute force: rows are permutations, stacked while the
    columns and boxes stay free of repeats."""
    rows = list(itertools.permutations(range(1, 5)))
    grids: list[tuple[int, ...]] = []

    def fits(grid: list[tuple[int, ...]], row: tuple[int, ...]) -> bool:
        if any(row[c] == above[c] for above in grid for c in range(4)):
            return False
        if len(grid) % 2 == 1:  # the second row of a band: its boxes
            top = grid[-1]
            return (
                len({top[0], top[1], row[0], row[1]}) == 4
                and len({top[2], top[3], row[2], row[3]}) == 4
            )
        return True

    def extend(grid: list[tuple[int, ...]]) -> None:
        if len(grid) == 4:
            grids.append(tuple(v for row in grid for v in row))
            return
        for row in rows:
            if fits(grid, row):
                extend([*grid, row])

    extend([])
    return grids


def valid_grid(values: list[int], size: int) -> bool:
    box = int(size**0.5)
    full = set(range(1, size + 1))
    rows = [values[r * size : (r + 1) * size] for r in range(size)]
    cols = [values[c::size] for c in range(size)]
    boxes = [
        [values[(br + r) * size + bc + c] for r in range(box) for c in range(box)]
        for br in range(0, size, box)
        for bc in range(0, size, box)
    ]
    return all(set(unit) == full for unit in rows + cols + boxes)


def test_sudoku_4x4_puzzles_have_exactly_one_solution():
    grids = all_4x4_grids()
    assert len(grids) == 288
    task = SudokuTask()
    examples = task.examples(range(40), "eval")
    assert examples == SudokuTask().examples(range(40), "eval")
    assert len({ex.puzzle for ex in examples}) > 30
    for ex in examples:
        assert ex.prompt == ex.puzzle + "=" and len(ex.puzzle) == 16
        assert ex.puzzle.count(".") == 6 and ex.givens.count(0) == 6
        solutions = [g for g in grids if all(v in (0, s) for v, s in zip(ex.givens, g))]
        assert solutions == [tuple(int(ch) for ch in ex.answer)]  # unique, and it is the answer
        assert task.reward(ex.answer, ex) == 1.0
        wrong = ex.answer[::-1]
        assert task.reward(wrong, ex) == float(wrong == ex.answer)
    assert task.completion_length == 20 and task.prompt_length == 17


def test_sudoku_9x9_and_its_verifier():
    task = SudokuTask(SudokuConfig(size=9, num_blanks=30))
    ex = task.example(0)
    solution = [int(ch) for ch in ex.answer]
    assert valid_grid(solution, 9) and ex.puzzle.count(".") == 30
    assert all(g in (0, s) for g, s in zip(ex.givens, solution))
    assert task.completion_length == 84 and task.prompt_length == 82
    blank = ex.puzzle.index(".")
    one_off = ex.answer[:blank] + str(solution[blank] % 9 + 1) + ex.answer[blank + 1 :]
    texts = [ex.answer, " | ".join(ex.answer[i : i + 9] for i in range(0, 81, 9)), one_off, "12"]
    assert task.rewards(texts, [ex] * 4).tolist() == [1.0, 1.0, 0.0, 0.0]
    assert SudokuReward()(texts, [ex] * 4).tolist() == [1.0, 1.0, 0.0, 0.0]
    cells = SudokuReward(mode="cells")([one_off], [ex]).item()
    assert cells == pytest.approx(29 / 30)  # the reward's denser mode still works on the example


def test_sudoku_credit_is_the_fraction_of_blanks_filled_right():
    """The held-out partial credit beside the exact reward: blanks right / blanks, givens not
    counted, 0 for text that is not a grid (a hand count over wrong cells)."""
    task = SudokuTask(SudokuConfig(num_blanks=10))
    assert task.credit_name == "blank cells"
    ex = task.example(3, "eval")
    blanks = [i for i, ch in enumerate(ex.puzzle) if ch == "."]
    assert len(blanks) == 10
    for wrong in range(4):
        cells = list(ex.answer)
        for i in blanks[:wrong]:
            cells[i] = str(int(cells[i]) % 4 + 1)
        text = "".join(cells)
        assert task.credit(text, ex) == pytest.approx((10 - wrong) / 10)
        assert task.reward(text, ex) == float(wrong == 0)
    given = next(i for i, ch in enumerate(ex.puzzle) if ch != ".")
    broken_given = ex.answer[:given] + str(int(ex.answer[given]) % 4 + 1) + ex.answer[given + 1 :]
    assert task.credit(broken_given, ex) == 1.0 and task.reward(broken_given, ex) == 0.0
    assert task.credit("12", ex) == 0.0
    with pytest.raises(NotImplementedError, match="arithmetic task has no partial credit"):
        get_task("arithmetic").credit("12", None)


def test_sudoku_config_is_checked():
    with pytest.raises(pydantic.ValidationError, match="size"):
        SudokuConfig(size=5)
    with pytest.raises(pydantic.ValidationError, match="at most 10"):
        SudokuConfig(num_blanks=11)
    with pytest.raises(pydantic.ValidationError, match="at least 82"):
        SudokuConfig(size=9, completion_length=80)
    assert SudokuTask(SudokuConfig(num_blanks=10)).example(3).puzzle.count(".") == 10


# ---------------------------------------------------------------------------- tokenizers
def test_char_tokenizer_chat_prompt_is_identity():
    tok = CharTokenizer("ab")
    assert tok.chat_prompt("abba") == "abba"
    with pytest.raises(TypeError, match="expected a str"):
        tok.chat_prompt(3)


def test_own_tokenizer_gives_fixed_shapes_and_round_trips():
    for task in (CountdownTask(), SudokuTask()):
        examples = task.examples(range(16), "eval")
        batch = task.encode(examples)
        P, L = task.prompt_length, task.completion_length
        assert batch["prompt_ids"].shape == (16, P) and batch["completion_ids"].shape == (16, L)
        tok = task.tokenizer
        assert tok.batch_decode(batch["prompt_ids"]) == [ex.prompt for ex in examples]
        assert tok.batch_decode(batch["completion_ids"]) == [ex.answer for ex in examples]
        for row, ex in enumerate(examples):  # left padding, then the answer and <eos> fill
            pad = P - len(ex.prompt)
            assert batch["prompt_ids"][row, :pad].tolist() == [PAD] * pad
            assert batch["prompt_mask"][row].tolist() == [False] * pad + [True] * len(ex.prompt)
            assert batch["completion_ids"][row, len(ex.answer) :].tolist() == [EOS] * (
                L - len(ex.answer)
            )


def test_subword_tokenizer_pads_to_the_batch_and_applies_the_chat_template():
    tok = PairTokenizer()
    task = CountdownTask(CountdownConfig(chat=True), tokenizer=tok)
    assert task.prompt_length is None and task.tokenizer is tok
    examples = task.examples(range(6), "eval")
    batch = task.encode(examples)
    texts = [f"<u>{ex.prompt}</u>" for ex in examples]
    lengths = [(len(t) + 1) // 2 for t in texts]
    assert batch["prompt_ids"].shape == (6, max(lengths))
    for row, (text, n) in enumerate(zip(texts, lengths)):
        assert batch["prompt_mask"][row].sum() == n
        assert tok.decode(batch["prompt_ids"][row]) == text  # pads decode to ""
        assert tok.decode(batch["completion_ids"][row]) == examples[row].answer
    # a fixed width: max_prompt_tokens, and a clear error past it
    fixed = CountdownTask(CountdownConfig(chat=True, max_prompt_tokens=12), tokenizer=tok)
    assert fixed.encode(examples)["prompt_ids"].shape == (6, 12)
    short = CountdownTask(CountdownConfig(chat=True, max_prompt_tokens=5), tokenizer=tok)
    with pytest.raises(
        ValueError, match=r"more than prompt_length=5 \(raise task.max_prompt_tokens\)"
    ):
        short.encode(examples)
    # arithmetic (no chat option) encodes with the subword tokenizer too, padded per batch
    arithmetic = ArithmeticTask(tokenizer=tok)
    one = arithmetic.encode(arithmetic.examples([0]))
    assert one["prompt_ids"].shape == (1, (len(arithmetic.example(0).prompt) + 1) // 2)


def test_a_char_tokenizer_lacking_the_task_characters_is_refused():
    arithmetic_vocab = ArithmeticTask().tokenizer
    with pytest.raises(
        TokenizerMismatchError, match=r"lacks the characters \['\(', '\)', '\*', ',', '/', ':'\]"
    ):
        CountdownTask(tokenizer=arithmetic_vocab)
    wider = CharTokenizer("0123456789+-*/(),:=.")  # a superset encodes the task's text
    task = SudokuTask(tokenizer=wider)
    batch = task.encode(task.examples([0]))
    assert wider.decode(batch["prompt_ids"][0]) == task.example(0).prompt


# ---------------------------------------------------------------------------- registry, config
def test_registry_and_rewards_per_task():
    assert sorted(TASKS) == ["arithmetic", "countdown", "math", "sudoku"]
    assert get_task("sudoku", size=9).config.size == 9
    assert isinstance(get_task("countdown", tokenizer=PairTokenizer()).tokenizer, PairTokenizer)
    assert TASK_REWARDS["countdown"] == ("verifier", "countdown")
    assert TASK_REWARDS["sudoku"] == ("verifier", "sudoku")
    config = load_config(
        None, GRPORecipeConfig, ["task.name=countdown", "rewards=[{name: countdown}]"]
    )
    assert config.task.name == "countdown" and config.task.options()["num_numbers"] == 3
    config = load_config(
        None,
        GRPORecipeConfig,
        ["task={name: sudoku, size: 9}", "rewards=[{name: sudoku, options: {mode: cells}}]"],
    )
    assert config.task.options()["size"] == 9
    with pytest.raises(
        ConfigError,
        match="'digits' does not apply to the sudoku task; rewards that apply: verifier, sudoku",
    ):
        load_config(None, GRPORecipeConfig, ["task.name=sudoku", "rewards=[{name: digits}]"])
    with pytest.raises(ConfigError, match="'sudoku' does not apply to the countdown task"):
        load_config(None, GRPORecipeConfig, ["task.name=countdown", "rewards=[{name: sudoku}]"])
    with pytest.raises(
        ConfigError, match=r"task: num_blanks=70 is too many for a 4x4 grid \(at most 10\)"
    ):
        load_config(None, SFTRecipeConfig, ["task.name=sudoku", "task.num_blanks=70"])


# ---------------------------------------------------------------------------- recipes
SFT = {
    "model": {"d_model": 32, "n_layers": 1, "n_heads": 2},
    "steps": 4,
    "batch_size": 8,
    "eval_every": 4,
    "eval_examples": 4,
    "checkpoint_every": 4,
}
ON_POLICY = {"steps": 2, "eval_every": 2, "eval_examples": 4, "checkpoint_every": 2}


def quiet(_):
    return None


@pytest.mark.parametrize(
    ("task", "reward"),
    [
        ({"name": "countdown"}, {"name": "countdown"}),
        ({"name": "sudoku"}, {"name": "sudoku", "options": {"mode": "cells"}}),
    ],
)
def test_sft_grpo_and_distill_run_on_the_task(tmp_path, task, reward):
    sft = run_sft(
        build_config(SFTRecipeConfig, {**SFT, "task": task, "output_dir": str(tmp_path / "sft")}),
        echo=quiet,
    )
    model_dir = tmp_path / "sft" / "model"
    loaded = load_model(model_dir)
    recorded = json.loads((model_dir / "diffusion_rl.json").read_text())
    assert recorded["task"]["name"] == task["name"]
    assert loaded.tokenizer == get_task(task["name"]).tokenizer
    assert sft["eval"]["num_examples"] == 4
    grpo = run_grpo(
        build_config(
            GRPORecipeConfig,
            {
                **ON_POLICY,
                "model": {"path": str(model_dir)},  # task: null, read from the model
                "rewards": [reward],
                "prompts_per_step": 2,
                "group_size": 2,
                "output_dir": str(tmp_path / "grpo"),
            },
        ),
        echo=quiet,
    )
    lines = [
        json.loads(line) for line in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()
    ]
    rewards = [r["rollout/reward_mean"] for r in lines if "rollout/reward_mean" in r]
    assert len(rewards) == 2 and all(0.0 <= r <= 1.0 for r in rewards)
    assert all(r["policy/ratio_mean"] == 1.0 for r in lines if "policy/ratio_mean" in r)
    assert grpo["steps"] == 2 and 0.0 <= grpo["accuracy_after"] <= 1.0
    distill = run_distill(
        build_config(
            DistillRecipeConfig,
            {
                **ON_POLICY,
                "student": {"path": str(model_dir)},
                "teacher": {"path": str(tmp_path / "grpo" / "model")},
                "prompts_per_step": 2,
                "output_dir": str(tmp_path / "distill"),
            },
        ),
        echo=quiet,
    )
    assert distill["steps"] == 2 and distill["teacher"]["accuracy"] == grpo["accuracy_after"]


def test_a_model_of_another_task_vocabulary_is_refused(tmp_path):
    run_sft(build_config(SFTRecipeConfig, {**SFT, "output_dir": str(tmp_path / "sft")}), echo=quiet)
    config = build_config(
        GRPORecipeConfig,
        {
            **ON_POLICY,
            "task": {"name": "countdown"},
            "rewards": [{"name": "countdown"}],
            "model": {"path": str(tmp_path / "sft" / "model")},
            "output_dir": str(tmp_path / "grpo"),
        },
    )
    with pytest.raises(
        ConfigError, match=r"^model.path: the tokenizer char-v1:\w+ lacks the characters"
    ):
        run_grpo(config, echo=quiet)
