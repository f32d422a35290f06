"""Tests of the built-in arithmetic task and the character tokenizer."""

from __future__ import annotations

import json
import random

import pydantic
import pytest
import torch

from diffusion_rl.tasks import (
    ArithmeticConfig,
    ArithmeticTask,
    CharTokenizer,
    Example,
    get_task,
)

PAD, MASK, EOS = 0, 1, 2


def _ids(task: ArithmeticTask, text: str) -> list[int]:
    return task.tokenizer.encode(text)


# ---------------------------------------------------------------------------- tokenizer
def test_tokenizer_layout_and_round_trip():
    tok = CharTokenizer("0123456789+-*= ")
    assert (tok.pad_id, tok.mask_id, tok.eos_id) == (PAD, MASK, EOS)
    assert tok.vocab_size == 3 + 15
    assert tok.encode("0") == [3]
    assert tok.encode(" ") == [17]
    text = "12 * 34 = 408"
    assert tok.decode(tok.encode(text)) == text
    assert tok.name.startswith("char-v1:")
    assert tok.name == CharTokenizer("0123456789+-*= ").name
    assert tok.name != CharTokenizer("0123456789+-=* ").name


def test_tokenizer_decode_specials_and_eos():
    tok = CharTokenizer("0123456789")
    ids = [PAD, 4, MASK, 5, EOS, 6, PAD]
    assert tok.decode(ids) == "12"
    assert tok.decode(ids, stop_at_eos=False) == "123"
    assert tok.decode(torch.tensor(ids)) == "12"
    rows = torch.tensor([[4, EOS, 5], [PAD, 6, 7]])
    assert tok.batch_decode(rows) == ["1", "34"]
    assert tok.batch_decode(rows.tolist(), stop_at_eos=False) == ["12", "34"]


def test_tokenizer_errors():
    tok = CharTokenizer("0123456789+")
    with pytest.raises(ValueError, match=r"unknown character 'x' at position 1.*'0123456789\+'"):
        tok.encode("1x")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([-1])
    with pytest.raises(ValueError, match="duplicates"):
        CharTokenizer("0120")
    with pytest.raises(ValueError, match="at least one character"):
        CharTokenizer("")


def test_tokenizer_save_load(tmp_path):
    tok = CharTokenizer("0123456789+-=")
    path = tok.save(tmp_path / "ckpt")
    assert path == tmp_path / "ckpt" / "tokenizer.json"
    data = json.loads(path.read_text())
    assert data == {
        "type": "char",
        "version": 1,
        "chars": "0123456789+-=",
        "special_tokens": {"<pad>": 0, "<mask>": 1, "<eos>": 2},
    }
    loaded = CharTokenizer.load(tmp_path / "ckpt")
    assert loaded == tok
    assert loaded.name == tok.name
    assert loaded.encode("12+3=") == tok.encode("12+3=")


def test_tokenizer_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json in"):
        CharTokenizer.load(tmp_path)
    (tmp_path / "tokenizer.json").write_text(json.dumps({"type": "bpe", "version": 1}))
    with pytest.raises(ValueError, match="has type 'bpe', expected 'char'"):
        CharTokenizer.load(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        CharTokenizer.load(tmp_path)
    data = CharTokenizer("01").to_dict()
    data["version"] = 2
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="has version 2, expected 1"):
        CharTokenizer.load(tmp_path)


# ---------------------------------------------------------------------------- examples
def test_examples_are_deterministic():
    task = ArithmeticTask(ArithmeticConfig(operations="+-"))
    again = get_task("arithmetic", operations="+-")
    for index in (0, 1, 17, 12345):
        for split in ("train", "eval"):
            assert task.example(index, split) == again.example(index, split)
    other_seed = ArithmeticTask(ArithmeticConfig(operations="+-", seed=1))
    first = task.examples(range(50))
    assert first != other_seed.examples(range(50))
    # Equivalent operation strings generate identical data.
    assert ArithmeticTask(ArithmeticConfig(operations="-+")).examples(range(50)) == first


def test_example_format_and_digit_coverage():
    task = ArithmeticTask(ArithmeticConfig(num_digits=3, operations="+-"))
    examples = task.examples(range(600))
    for ex in examples:
        assert ex.prompt == f"{ex.a}{ex.op}{ex.b}="
        assert ex.answer == str(ex.result)
        assert 0 <= ex.a <= 999 and 0 <= ex.b <= 999
        assert len(ex.prompt) <= task.prompt_length
    lengths = {len(str(ex.a)) for ex in examples} | {len(str(ex.b)) for ex in examples}
    assert lengths == {1, 2, 3}
    assert {ex.op for ex in examples} == {"+", "-"}
    assert any(ex.result < 0 for ex in examples)


def _operand_count(value: int) -> int:
    """How many operands have as many digits as ``value`` (0 counts as one digit)."""
    digits = len(str(value))
    return 10 if digits == 1 else 9 * 10 ** (digits - 1)


def test_train_and_eval_are_disjoint_streams():
    """Different derived seeds: position-wise the streams never agree, and repeats across splits
    occur only by chance, i.e. in small problem spaces (e.g. the 100 one-digit sums)."""
    task = ArithmeticTask(ArithmeticConfig(num_digits=3, operations="+"))
    train = task.examples(range(2000), "train")
    evals = task.examples(range(2000), "eval")
    assert sum(t == e for t, e in zip(train, evals)) == 0

    def space(ex: Example) -> int:  # problems sharing ex's operand digit counts
        return _operand_count(ex.a) * _operand_count(ex.b)

    seen = {(ex.a, ex.op, ex.b) for ex in train}
    large = [ex for ex in evals if space(ex) >= 90 * 90]
    large_overlap = [ex for ex in large if (ex.a, ex.op, ex.b) in seen]
    assert len(large) > 800
    assert len(large_overlap) / len(large) < 0.05
    assert not any(space(ex) == 900 * 900 for ex in large_overlap)


def test_example_argument_errors():
    task = ArithmeticTask()
    with pytest.raises(ValueError, match="split"):
        task.example(0, "test")
    with pytest.raises(ValueError, match="index"):
        task.example(-1)


# ---------------------------------------------------------------------------- config
def test_config_defaults_and_validation():
    assert ArithmeticTask().completion_length == 8  # "1998" + eos -> 5 -> 8
    assert ArithmeticTask(ArithmeticConfig(num_digits=2)).completion_length == 4  # "198"+eos
    assert ArithmeticTask(ArithmeticConfig(num_digits=3, block_size=3)).completion_length == 6
    assert (
        ArithmeticTask(ArithmeticConfig(num_digits=3, completion_length=12)).completion_length == 12
    )
    assert ArithmeticTask(ArithmeticConfig(num_digits=5)).prompt_length == 12
    with pytest.raises(pydantic.ValidationError, match="extra"):
        ArithmeticConfig(num_digit=3)
    with pytest.raises(pydantic.ValidationError, match="subset"):
        ArithmeticConfig(operations="*")
    with pytest.raises(pydantic.ValidationError, match="too short"):
        ArithmeticConfig(num_digits=3, completion_length=4)
    with pytest.raises(pydantic.ValidationError, match="multiple of block_size"):
        ArithmeticConfig(num_digits=3, completion_length=10)
    known = r"\['arithmetic', 'countdown', 'math', 'sudoku'\]"
    with pytest.raises(ValueError, match=rf"unknown task 'sudoku9'; known tasks: {known}"):
        get_task("sudoku9")


# ---------------------------------------------------------------------------- tensors
def test_encode_left_padding_and_completion_layout():
    task = ArithmeticTask(ArithmeticConfig(num_digits=3, operations="+-"))
    examples = [
        Example(prompt="123+456=", answer="579", a=123, op="+", b=456),
        Example(prompt="7-38=", answer="-31", a=7, op="-", b=38),
        Example(prompt="999+999=", answer="1998", a=999, op="+", b=999),
    ]
    batch = task.encode(examples)
    assert set(batch) == {"prompt_ids", "prompt_mask", "completion_ids", "completion_mask"}
    P, L = task.prompt_length, task.completion_length
    assert (P, L) == (8, 8) and L % task.block_size == 0
    assert batch["prompt_ids"].dtype == torch.int64 and batch["prompt_ids"].shape == (3, P)
    assert batch["prompt_mask"].dtype == torch.bool and batch["prompt_mask"].shape == (3, P)
    assert batch["completion_ids"].dtype == torch.int64 and batch["completion_ids"].shape == (3, L)
    assert batch["completion_mask"].dtype == torch.bool and bool(batch["completion_mask"].all())

    assert batch["prompt_ids"][0].tolist() == _ids(task, "123+456=")
    assert batch["prompt_ids"][1].tolist() == [PAD] * 3 + _ids(task, "7-38=")
    assert batch["prompt_mask"][1].tolist() == [False] * 3 + [True] * 5
    assert batch["prompt_mask"][0].tolist() == [True] * 8

    assert batch["completion_ids"][0].tolist() == _ids(task, "579") + [EOS] * 5
    assert batch["completion_ids"][1].tolist() == _ids(task, "-31") + [EOS] * 5
    assert batch["completion_ids"][2].tolist() == _ids(task, "1998") + [EOS] * 4

    tok = task.tokenizer
    assert tok.batch_decode(batch["prompt_ids"]) == [ex.prompt for ex in examples]
    assert tok.batch_decode(batch["completion_ids"]) == [ex.answer for ex in examples]


def test_encode_rejects_oversized_examples():
    task = ArithmeticTask(ArithmeticConfig(num_digits=2))
    with pytest.raises(ValueError, match="more than prompt_length"):
        task.encode([Example(prompt="100+10=", answer="110", a=100, op="+", b=10)])
    with pytest.raises(ValueError, match="more than completion_length"):
        task.encode([Example(prompt="9+9=", answer="1234", a=9, op="+", b=9)])


def test_every_generated_answer_fits_with_eos():
    for config in (ArithmeticConfig(num_digits=1, operations="+-"), ArithmeticConfig(num_digits=4)):
        task = ArithmeticTask(config)
        batch = task.batch(range(300), "eval")
        assert bool((batch["completion_ids"][:, -1] == EOS).all())
        assert bool(batch["prompt_mask"][:, -1].all())  # left padding: last slot is always real


def test_train_batch_positions():
    task = ArithmeticTask()
    b0, b1 = task.train_batch(0, 4), task.train_batch(1, 4)
    whole = task.batch(range(8), "train")
    for key in whole:
        assert torch.equal(torch.cat([b0[key], b1[key]]), whole[key])
    assert torch.equal(task.train_batch(1, 4)["prompt_ids"], b1["prompt_ids"])
    assert list(task.train_indices(3, 5)) == [15, 16, 17, 18, 19]
    with pytest.raises(ValueError, match="position"):
        task.train_batch(-1, 4)
    with pytest.raises(ValueError, match="batch_size"):
        task.train_batch(0, 0)


# ---------------------------------------------------------------------------- verifier
def test_verifier_against_python_arithmetic():
    task = ArithmeticTask(ArithmeticConfig(num_digits=3, operations="+-", seed=7))
    rng = random.Random(0)
    examples = task.examples(rng.sample(range(100_000), 500), "eval")
    assert any(ex.result < 0 for ex in examples)
    for ex in examples:
        truth = ex.a + ex.b if ex.op == "+" else ex.a - ex.b
        assert ex.answer == str(truth)
        assert task.reward(str(truth), ex) == 1.0
        assert task.reward(f" {truth}\n", ex) == 1.0
        assert task.reward(f"{truth}<eos>junk", ex) == 1.0
        assert task.reward(str(truth + 1), ex) == 0.0
        assert task.reward(str(-truth), ex) == (1.0 if truth == 0 else 0.0)
    texts = [ex.answer for ex in examples[:10]] + ["0x1f"] * 5
    rewards = task.rewards(texts, examples[:15])
    assert rewards.dtype == torch.float32 and rewards.shape == (15,)
    assert rewards[:10].tolist() == [1.0] * 10
    assert task.accuracy(texts, examples[:15]) == pytest.approx(10 / 15)


@pytest.mark.parametrize(
    "text",
    ["", "   ", "-", "--5", "1 2", "12a", "abc", "1.0", "1e2", "+-=", "٣", "1_2", "5-", "<eos>5"],
)
def test_verifier_garbage_scores_zero(text):
    task = ArithmeticTask(ArithmeticConfig(operations="+-"))
    for ex in (
        Example(prompt="3+0=", answer="3", a=3, op="+", b=0),
        Example(prompt="0-5=", answer="-5", a=0, op="-", b=5),
        Example(prompt="0+0=", answer="0", a=0, op="+", b=0),
        Example(prompt="1+11=", answer="12", a=1, op="+", b=11),
    ):
        assert task.reward(text, ex) == 0.0


def test_verifier_negative_and_decoded_completions():
    task = ArithmeticTask(ArithmeticConfig(operations="-"))
    ex = Example(prompt="12-345=", answer="-333", a=12, op="-", b=345)
    assert task.reward("-333", ex) == 1.0
    assert task.reward("333", ex) == 0.0
    ids = torch.tensor([_ids(task, "-333") + [EOS, 5, 6, EOS]])
    assert task.rewards(task.tokenizer.batch_decode(ids), [ex]).tolist() == [1.0]
    with pytest.raises(ValueError, match="2 texts but 1 examples"):
        task.rewards(["1", "2"], [ex])
