"""Tests of the batched reward layer: combination, task verifier, Countdown, Sudoku, math."""

from __future__ import annotations

import itertools
import sys
import threading
from types import SimpleNamespace

import pytest
import torch

from diffusion_rl.rewards import (
    REWARDS,
    CombinedReward,
    CountdownReward,
    MathAnswerReward,
    RewardFunction,
    RewardOutput,
    SudokuReward,
    TaskVerifierReward,
    get_reward,
)
from diffusion_rl.tasks import ArithmeticConfig, ArithmeticTask


class _Fixed:
    """A reward returning a preset value (or object) whatever the batch."""

    def __init__(self, name, value):
        self.name = name
        self.value = value

    def __call__(self, completions, examples):
        return self.value


# ---------------------------------------------------------------------------- countdown
NUMS = {"numbers": [3, 5, 7, 2], "target": 29}


def _cd(completions, example, **options):
    reward = CountdownReward(**options)
    return reward(completions, [example] * len(completions)).tolist()


def test_countdown_correct_forms_score_one():
    # (completion, its bare expression): the value is checked with Python independently.
    good = [
        ("5*7-3*2", "5*7-3*2"),
        ("(5 * 7) - (3 * 2) = 29", "(5 * 7) - (3 * 2)"),
        ("= 5*7 - 3*2", "5*7 - 3*2"),
        (" 5*7\n-3*2 ", "5*7-3*2"),
        ("7*5-2*3=29", "7*5-2*3"),
    ]
    assert all(eval(expr) == 29 for _, expr in good)  # hand-written literals only
    texts = [text for text, _ in good]
    assert _cd(texts, NUMS) == [1.0] * len(good)
    assert _cd(texts, SimpleNamespace(**NUMS)) == [1.0] * len(good)


def test_countdown_rule_breaks_get_format_score():
    cases = [
        "5*7-3",  # wrong value (32)
        "5*5+2+2",  # 5 and 2 used twice: 29 but illegal
        "30-1",  # numbers not given
        "5*7-3*2 = 30",  # claimed result differs from the target
        "5*7-3*2 = 28",
    ]
    assert eval("5*5+2+2") == 29  # the value is right; only the rule fails
    assert _cd(cases, NUMS) == [0.0] * len(cases)
    assert _cd(cases, NUMS, format_score=0.1) == pytest.approx([0.1] * len(cases))


def test_countdown_exact_division():
    example = {"numbers": [7, 2, 2], "target": 7}
    # Python's float division says both equal 7; only the second is exact at every step.
    assert eval("7/2*2") == eval("7*2/2") == 7
    assert _cd(["7/2*2", "7*2/2", "7/(2-2)"], example, format_score=0.5) == [0.5, 1.0, 0.5]


def test_countdown_repeated_given_numbers_are_a_multiset():
    example = {"numbers": [5, 5, 2], "target": 27}
    assert _cd(["5*5+2", "5*5+2+5"], example) == [1.0, 0.0]


def test_countdown_use_all():
    example = {"numbers": [3, 5, 7, 2], "target": 35}
    texts = ["5*7", "5*7*(3-2)"]
    assert _cd(texts, example) == [1.0, 1.0]
    assert _cd(texts, example, use_all=True, format_score=0.25) == [0.25, 1.0]


def test_countdown_garbage_and_forbidden_syntax_score_zero():
    garbage = [
        "",
        "   ",
        "hello",
        "5*7-3*2)",
        "__import__('os').system('true')",
        "5**2+4",  # power is never allowed
        "7//2",
        "-3+5*7-2-5",  # unary minus
        "(5)(7)",
        "05*7-3*2",  # leading zero
        "5*7-3*2 = twenty-nine",
        "5*7 = 35 = 35",
        "5.0*7-3*2",
        "1+" * 5000 + "1",  # far over max_chars
        "(" * 300 + "5" + ")" * 300,
    ]
    example = {"numbers": [3, 5, 7, 2, 4], "target": 29}
    assert _cd(garbage, example, format_score=0.5) == [0.0] * len(garbage)
    assert CountdownReward().score(None, [1], 1) == 0.0  # type: ignore[arg-type]


def test_countdown_output_contract_and_bad_examples():
    reward = CountdownReward()
    out = reward(["5*7-3*2", "x"], [NUMS, NUMS])
    assert out.dtype == torch.float32 and out.shape == (2,)
    assert reward([], []).shape == (0,)
    with pytest.raises(ValueError, match="example 1 has no 'target'"):
        reward(["1", "1"], [NUMS, {"numbers": [1]}])
    with pytest.raises(TypeError, match="'numbers' must be a list of int"):
        reward(["1"], [{"numbers": "12", "target": 3}])
    with pytest.raises(ValueError, match="2 completions but 1 examples"):
        reward(["1", "2"], [NUMS])
    with pytest.raises(ValueError, match="format_score"):
        CountdownReward(format_score=2.0)


# ---------------------------------------------------------------------------- sudoku
SOL4 = "1234341221434321"
PUZ4 = "1.3.3..22..34.2."  # 8 blanks
SOL9 = "534678912672195348198342567859761423426853791713924856961537284287419635345286179"
PUZ9 = "530070000600195000098000060800060003400803001700020006060000280000419005000080079"


def _valid(grid: str, n: int) -> bool:
    """Independent checker: every row, column and box holds 1..n exactly once."""
    b = int(n**0.5)
    rows = [grid[r * n : (r + 1) * n] for r in range(n)]
    units = rows + ["".join(row[c] for row in rows) for c in range(n)]
    for br, bc in itertools.product(range(0, n, b), repeat=2):
        units.append("".join(rows[br + r][bc + c] for r in range(b) for c in range(b)))
    return all(sorted(u) == [str(d) for d in range(1, n + 1)] for u in units)


def _consistent(grid: str, puzzle: str) -> bool:
    return all(p in "0." or p == g for p, g in zip(puzzle, grid))


def test_reference_puzzles_are_valid_and_unique():
    assert _valid(SOL4, 4) and _consistent(SOL4, PUZ4)
    assert _valid(SOL9, 9) and _consistent(SOL9, PUZ9)
    # Brute force over all fillings of the 4x4 blanks: exactly one valid completion.
    blanks = [i for i, ch in enumerate(PUZ4) if ch == "."]
    found = []
    for digits in itertools.product("1234", repeat=len(blanks)):
        grid = list(PUZ4)
        for i, d in zip(blanks, digits):
            grid[i] = d
        if _valid("".join(grid), 4):
            found.append("".join(grid))
    assert found == [SOL4]


def test_sudoku_exact():
    reward = SudokuReward()
    swapped = SOL4[1] + SOL4[0] + SOL4[2:]  # row still a permutation, columns broken
    relabelled = SOL4.translate(str.maketrans("12", "21"))  # valid grid, breaks the givens
    assert not _valid(swapped, 4) and _valid(relabelled, 4)
    assert not _consistent(relabelled, PUZ4)
    texts = [
        SOL4,
        "1234\n3412\n2143\n4321",
        "|1|2|3|4|\n+-+-+\n3 4 1 2 | 2 1 4 3, 4 3 2 1",
        swapped,
        relabelled,
        SOL4[:-1],  # too short
        SOL4 + "1",  # too long
        SOL4[:-1] + "0",  # one blank left
        "abcd" * 4,
        "",
    ]
    expected = [1.0, 1.0, 1.0] + [0.0] * 7
    assert reward(texts, [{"puzzle": PUZ4}] * len(texts)).tolist() == expected
    nine = reward([SOL9, SOL9.replace("9", "0", 1), "\n".join(SOL9[i : i + 9] for i in range(0, 81, 9))],
                  [SimpleNamespace(puzzle=PUZ9)] * 3)  # fmt: skip
    assert nine.tolist() == [1.0, 0.0, 1.0]


def test_sudoku_cells_fraction_matches_known_solution():
    reward = SudokuReward(mode="cells")
    for puzzle, solution, n in ((PUZ4, SOL4, 4), (PUZ9, SOL9, 9)):
        blanks = [i for i, ch in enumerate(puzzle) if ch in "0."]
        # Fill the first third of the blanks correctly, the rest with a wrong digit / blank.
        grid = list(solution)
        for k, i in enumerate(blanks):
            if k >= len(blanks) // 3:
                grid[i] = "0" if k % 2 else str(int(solution[i]) % n + 1)  # never right
        grid_text = "".join(grid)
        expected = sum(grid_text[i] == solution[i] for i in blanks) / len(blanks)
        got = reward([grid_text, solution, "garbage"], [{"puzzle": puzzle}] * 3).tolist()
        assert got == pytest.approx([expected, 1.0, 0.0])
        assert 0.0 < expected < 1.0


def test_sudoku_cells_falls_back_to_exact_without_unique_solution():
    reward = SudokuReward(mode="cells")
    empty = "0" * 16  # many solutions
    conflicting = "11" + "0" * 14  # no solution
    half = SOL4[:8] + "0" * 8
    got = reward(
        [SOL4, half, SOL4], [{"puzzle": empty}, {"puzzle": empty}, {"puzzle": conflicting}]
    )
    assert got.tolist() == [1.0, 0.0, 0.0]
    relabelled = SOL4.translate(str.maketrans("12", "21"))  # valid, but breaks the givens
    full = reward([SOL4, relabelled], [{"puzzle": SOL4}] * 2)  # no blanks: exact rule
    assert full.tolist() == [1.0, 0.0]


def test_sudoku_bad_examples_raise():
    reward = SudokuReward()
    with pytest.raises(ValueError, match="expected 16 \\(4x4\\) or 81 \\(9x9\\)"):
        reward(["1"], [{"puzzle": "123"}])
    with pytest.raises(ValueError, match="puzzle characters"):
        reward(["1"], [{"puzzle": "5" + "0" * 15}])
    with pytest.raises(ValueError, match="mode"):
        SudokuReward(mode="partial")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- combination
def test_combined_totals_match_hand_sums():
    countdown = CountdownReward(format_score=0.5)
    constant = _Fixed("const", torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))
    combined = CombinedReward([(countdown, 2.0), (constant, 0.25)])
    texts = ["5*7-3*2", "5*7", "nonsense"]
    out = combined(texts, [NUMS] * 3)
    assert isinstance(out, RewardOutput)
    assert list(out.parts) == ["countdown", "const"]
    assert out.parts["countdown"].tolist() == [1.0, 0.5, 0.0]
    assert out.parts["const"].dtype == torch.float32
    hand = [2.0 * 1.0 + 0.25 * 1.0, 2.0 * 0.5 + 0.25 * 2.0, 2.0 * 0.0 + 0.25 * 3.0]
    assert out.total.dtype == torch.float32 and out.total.tolist() == pytest.approx(hand)
    assert combined.weights == {"countdown": 2.0, "const": 0.25}
    zero = CombinedReward([(countdown, 0)])(texts, [NUMS] * 3)
    assert zero.total.tolist() == [0.0, 0.0, 0.0] and zero.parts["countdown"].sum() == 1.5


@pytest.mark.parametrize(
    ("terms", "error", "text"),
    [
        ([], ValueError, "at least one"),
        ([(CountdownReward(), -1.0)], ValueError, "'countdown' must be finite and >= 0"),
        ([(CountdownReward(), float("nan"))], ValueError, "'countdown' must be finite"),
        ([(CountdownReward(), float("inf"))], ValueError, "'countdown' must be finite"),
        ([(CountdownReward(), True)], TypeError, "must be a real number"),
        ([(CountdownReward(), 1.0), (CountdownReward(), 1.0)], ValueError, "duplicate"),
        ([(lambda c, e: None, 1.0)], TypeError, "'name' attribute"),
        ([CountdownReward()], TypeError, "term 0 must be a"),
        (CountdownReward(), TypeError, "sequence of"),
    ],
)
def test_combined_rejects_bad_terms(terms, error, text):
    with pytest.raises(error, match=text):
        CombinedReward(terms)


@pytest.mark.parametrize(
    ("value", "error", "text"),
    [
        ([1.0, 0.0], TypeError, "reward 'bad' returned list"),
        (torch.zeros(3), ValueError, "reward 'bad' returned shape \\(3,\\), expected \\(2,\\)"),
        (torch.zeros(2, 1), ValueError, "reward 'bad' returned shape"),
        (torch.tensor([1.0, float("nan")]), ValueError, "'bad' returned non-finite values at indices \\[1\\]"),
        (torch.tensor([float("inf"), 0.0]), ValueError, "non-finite"),
        (torch.tensor([1, 0]), TypeError, "reward 'bad' returned dtype torch.int64"),
    ],
)  # fmt: skip
def test_combined_rejects_bad_outputs(value, error, text):
    combined = CombinedReward([(CountdownReward(), 1.0), (_Fixed("bad", value), 1.0)])
    with pytest.raises(error, match=text):
        combined(["1", "2"], [NUMS, NUMS])


def test_combined_rejects_length_mismatch():
    combined = CombinedReward([(CountdownReward(), 1.0)])
    with pytest.raises(ValueError, match="2 completions but 3 examples"):
        combined(["1", "2"], [NUMS] * 3)
    with pytest.raises(TypeError, match="single str"):
        combined("12", [NUMS, NUMS])


# ---------------------------------------------------------------------------- task verifier
def test_task_verifier_matches_python_arithmetic():
    task = ArithmeticTask(ArithmeticConfig(num_digits=3, operations="+-"))
    examples = task.examples(range(24))
    texts, expected = [], []
    for i, ex in enumerate(examples):
        value = ex.a + ex.b if ex.op == "+" else ex.a - ex.b
        kind = i % 3
        texts.append([str(value), str(value + 1), f"x{value}"][kind])
        expected.append(1.0 if kind == 0 else 0.0)
    reward = TaskVerifierReward(task)
    assert reward.name == "arithmetic_verifier"
    assert isinstance(reward, RewardFunction)
    out = reward(texts, examples)
    assert out.dtype == torch.float32 and out.tolist() == expected
    combined = CombinedReward([(reward, 3.0)])(texts, examples)
    assert combined.total.tolist() == [3.0 * e for e in expected]
    with pytest.raises(TypeError, match="rewards\\(texts, examples\\)"):
        TaskVerifierReward(object())


# ---------------------------------------------------------------------------- registry
def test_get_reward_registry():
    assert sorted(REWARDS) == [
        "aesthetic",
        "clip_score",
        "compressibility",
        "countdown",
        "digits",
        "geneval",
        "math",
        "motion",
        "ocr",
        "pickscore",
        "sudoku",
        "verifier",
    ]
    assert isinstance(get_reward("countdown", use_all=True), CountdownReward)
    assert get_reward("countdown", use_all=True).use_all
    assert get_reward("sudoku", mode="cells").mode == "cells"
    assert get_reward("verifier", task=ArithmeticTask()).name == "arithmetic_verifier"
    with pytest.raises(ValueError, match="unknown reward 'chess'.*'countdown'.*'verifier'"):
        get_reward("chess")
    with pytest.raises(TypeError):
        get_reward("verifier")


# ---------------------------------------------------------------------------- math answers
def test_math_reward_missing_dependency_message(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` fail
    with pytest.raises(ImportError, match=r"pip install 'diffusion-rl\[math\]'"):
        MathAnswerReward()
    with pytest.raises(ImportError, match="math-verify"):
        get_reward("math")


def test_math_reward_answers():
    pytest.importorskip("math_verify")
    reward = MathAnswerReward()
    cases = [
        ("0.5", "\\frac{1}{2}", 1.0),
        ("The answer is $\\frac{1}{2}$", "0.5", 1.0),
        ("\\boxed{2}", "2", 1.0),
        ("3", "2", 0.0),
        ("\\boxed{\\sqrt 2}", "\\sqrt{2}", 1.0),
        ("", "2", 0.0),
        ("}}{{\\frac{", "2", 0.0),
    ]
    texts = [c for c, _, _ in cases]
    examples = [SimpleNamespace(answer=a) for _, a, _ in cases]
    out = reward(texts, examples)
    assert out.dtype == torch.float32
    assert out.tolist() == [expected for _, _, expected in cases]
    with pytest.raises(TypeError, match="'answer' must be a str"):
        reward(["2"], [{"answer": 2}])
    with pytest.raises(ValueError, match="timeout_seconds"):
        MathAnswerReward(timeout_seconds=0)


def test_math_reward_thread_rule():
    pytest.importorskip("math_verify")
    results: dict[str, object] = {}

    def run(key, reward):
        try:
            results[key] = reward(["1/2"], [{"answer": "0.5"}]).tolist()
        except Exception as error:  # reported to the main thread
            results[key] = error

    for key, reward in (
        ("signals", MathAnswerReward()),
        ("plain", MathAnswerReward(timeout_seconds=None)),
    ):
        worker = threading.Thread(target=run, args=(key, reward))
        worker.start()
        worker.join()
    assert isinstance(results["signals"], RuntimeError)
    assert "main thread" in str(results["signals"]) and "timeout_seconds=None" in str(
        results["signals"]
    )
    assert results["plain"] == [1.0]


def test_digit_reward_partial_credit_right_aligned():
    from diffusion_rl.rewards import TaskDigitReward
    from diffusion_rl.tasks import ArithmeticTask, Example

    task = ArithmeticTask()
    example = Example(prompt="387+27=", answer="414", a=387, op="+", b=27)
    reward = get_reward("digits", task=task)
    assert isinstance(reward, TaskDigitReward) and reward.name == "arithmetic_digits"
    got = reward(["414", "419", "14", "1414", "x", "0414"], [example] * 6).tolist()
    # right-aligned: 419 → 2/3; 14 → 2/3 (missing hundreds); 1414 → 3/4; garbage 0; leading zero ok
    assert got == pytest.approx([1.0, 2 / 3, 2 / 3, 3 / 4, 0.0, 1.0])
    verifier = task.rewards(["414", "419"], [example] * 2).tolist()
    assert verifier == [1.0, 0.0]
    with pytest.raises(TypeError, match="no digit_reward"):
        TaskDigitReward(object())
