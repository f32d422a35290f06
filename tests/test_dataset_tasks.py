"""Tasks from local files: math word problems (GSM8K / MATH style, through ``datasets``,
scored by math-verify), prompt lists for the image and video recipes, and the acceptance run:
a GSM8K-format JSONL file drives ``diffusion-rl grpo`` end to end on a tiny local model."""

from __future__ import annotations

import csv
import json
import math
import random
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("datasets", reason="the dataset tasks need the 'datasets' package")
math_verify = pytest.importorskip("math_verify", reason="the math task needs math-verify")

from diffusion_rl import cli  # noqa: E402
from diffusion_rl.config import (  # noqa: E402
    TASK_REWARDS,
    ConfigError,
    GRPORecipeConfig,
    SFTRecipeConfig,
    load_config,
)
from diffusion_rl.models import load_model  # noqa: E402
from diffusion_rl.rewards import MathAnswerReward, get_reward  # noqa: E402
from diffusion_rl.tasks import (  # noqa: E402
    CharTokenizer,
    MathConfig,
    MathTask,
    PromptFileConfig,
    PromptFileTask,
    get_task,
)
from diffusion_rl.tasks.datasets import extract_answer, read_rows  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures"

GSM8K_ROWS = [
    {
        "question": "Tom has 3 apples and buys 4 more. How many apples?",
        "answer": "3 + 4 = <<3+4=7>>7\n#### 7",
    },
    {
        "question": "A box holds 12 pens; 5 are red. How many are not red?",
        "answer": "12 - 5 = 7 pens\n#### 7",
    },
    {
        "question": "Sara earns 1,000 dollars twice. Total?",
        "answer": "1,000 * 2 = 2,000\n#### 2,000",
    },
    {"question": "Half of 9?", "answer": "9 / 2 = 4.5\n#### 4.5"},
    {"question": "Lee had 10 cards and lost 12. Balance?", "answer": "10 - 12 = -2\n#### -2"},
]
MATH_ROWS = [
    {
        "problem": "What is $\\frac{1}{2} + \\frac{1}{4}$?",
        "solution": "Sum: $\\boxed{\\frac{3}{4}}$.",
    },
    {"problem": "Solve $x^2 = 9$, $x>0$.", "solution": "So $x = \\boxed{3}$."},
    {"problem": "Simplify $\\sqrt{8}$.", "solution": "$\\sqrt{8} = \\boxed{2\\sqrt{2}}$"},
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_csv(path: Path, rows: list[dict]) -> Path:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow
    import pyarrow.parquet

    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    return path


def gsm8k_gold(answer_field: str) -> str:
    """The test's own reading of a GSM8K answer: the text after '####', commas dropped."""
    return answer_field.split("####")[-1].strip().replace(",", "")


class PairTokenizer:
    """A subword-like test tokenizer (two characters per token) with a chat template."""

    name = "pairs-test"
    pad_id, mask_id, eos_id = 0, 1, 2

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        return [
            self.ids.setdefault(text[i : i + 2], 3 + len(self.ids)) for i in range(0, len(text), 2)
        ]

    def chat_prompt(self, text: str) -> str:
        return f"<user>{text}</user><assistant>"


# ---------------------------------------------------------------------------- answers
@pytest.mark.parametrize(
    ("text", "answer_format", "expected"),
    [
        ("3 + 4 = 7\n#### 7", "gsm8k", "7"),
        ("#### 1,234,567", "gsm8k", "1234567"),
        ("a #### 3\n#### 5 ", "auto", "5"),  # the last marker
        ("no marker 5", "gsm8k", None),
        ("so $\\boxed{\\frac{1}{2}}$", "boxed", "\\frac{1}{2}"),
        ("\\boxed{1} then \\boxed {x^{2}}", "auto", "x^{2}"),  # the last box, braces balanced
        ("\\boxed{unclosed", "boxed", None),
        ("  42 ", "plain", "42"),
        ("42", "auto", "42"),
        ("   ", "plain", None),
    ],
)
def test_extract_answer(text, answer_format, expected):
    assert extract_answer(text, answer_format) == expected


# ---------------------------------------------------------------------------- reading files
def test_jsonl_parquet_and_csv_give_the_same_problems(tmp_path):
    tasks = [
        MathTask(
            MathConfig(path=str(write(tmp_path / f"g.{ext}", GSM8K_ROWS)), heldout_fraction=0.2)
        )
        for ext, write in (("jsonl", write_jsonl), ("parquet", write_parquet), ("csv", write_csv))
    ]
    first = tasks[0]
    assert [ex.answer for ex in first.prompts("train") + first.prompts("eval")] != []
    for task in tasks[1:]:
        for split in ("train", "eval"):
            assert [(e.question, e.answer, e.solution, e.row) for e in task.prompts(split)] == [
                (e.question, e.answer, e.solution, e.row) for e in first.prompts(split)
            ]
    by_row = {ex.row: ex for ex in first.prompts("train") + first.prompts("eval")}
    assert [by_row[i].answer for i in range(5)] == [gsm8k_gold(r["answer"]) for r in GSM8K_ROWS]
    assert [by_row[i].solution for i in range(5)] == [r["answer"] for r in GSM8K_ROWS]


def test_math_style_fields_and_boxed_answers(tmp_path):
    path = write_jsonl(tmp_path / "math.jsonl", MATH_ROWS)
    config = MathConfig(
        path=str(path),
        eval_path=str(path),
        question_field="problem",
        answer_field="solution",
        prompt_template="Problem: {question}\nPut the answer in \\boxed{}.\n",
    )
    task = MathTask(config)
    train = task.prompts("train")
    assert [ex.answer for ex in train] == ["\\frac{3}{4}", "3", "2\\sqrt{2}"]
    assert (
        train[0].prompt == f"Problem: {MATH_ROWS[0]['problem']}\nPut the answer in \\boxed{{}}.\n"
    )
    assert task.prompts("eval") == train  # eval_path: the same file here
    completions = ["0.75", "\\boxed{3}", "$\\sqrt{8}$", "\\frac{3}{4}"]
    scores = task.rewards(completions[:3], train).tolist()
    assert scores == [1.0, 1.0, 1.0]
    assert task.rewards(["3/4"], [train[1]]).tolist() == [0.0]
    # the task's verifier and the registered math reward agree, and both are math-verify
    reward = MathAnswerReward()
    for text in completions:
        for ex in train:
            gold, guess = math_verify.parse(f"${ex.answer}$"), math_verify.parse(text)
            direct = float(bool(gold and guess and math_verify.verify(gold, guess)))
            assert task.reward(text, ex) == reward.score(text, ex.answer) == direct


def test_splits_and_streams(tmp_path):
    rows = [{"question": f"q{i}?", "answer": f"#### {i}"} for i in range(20)]
    path = str(write_jsonl(tmp_path / "d.jsonl", rows))
    task = MathTask(MathConfig(path=path, heldout_fraction=0.25))
    train, held = task.prompts("train"), task.prompts("eval")
    assert (len(train), len(held)) == (15, 5)
    assert sorted(ex.row for ex in train + held) == list(range(20))
    assert [ex.row for ex in train] == sorted(ex.row for ex in train)  # the file's order
    stream = task.examples(range(45), "train")
    for start in (0, 15, 30):  # each epoch holds each training row once, in a fresh order
        assert sorted(ex.row for ex in stream[start : start + 15]) == [ex.row for ex in train]
    assert [ex.row for ex in stream[:15]] != [ex.row for ex in stream[15:30]]
    again = MathTask(MathConfig(path=path, heldout_fraction=0.25))
    assert again.examples(range(45), "train") == stream
    other = MathTask(MathConfig(path=path, heldout_fraction=0.25, seed=1))
    assert {ex.row for ex in other.prompts("eval")} != {ex.row for ex in held}
    assert [ex.row for ex in task.examples(range(10), "eval")][:5] != []
    with pytest.raises(ValueError, match="split"):
        task.example(0, "test")


def test_char_tokenizer_from_the_file_and_encoding(tmp_path):
    rows = [{"question": "ab?", "answer": "#### 12"}, {"question": "abcd?", "answer": "x\n#### 3"}]
    path = str(write_jsonl(tmp_path / "d.jsonl", rows))
    task = MathTask(
        MathConfig(path=path, eval_path=path, completion_tokens=8, prompt_template="Q {question} A")
    )
    assert task.tokenizer == CharTokenizer("".join(sorted(set("Q ab? AQ abcd? A#### 12x\n#### 3"))))
    assert task.prompt_length == len("Q abcd? A")  # the longest prompt of the files
    examples = task.prompts("train")
    batch = task.encode(examples)
    tok = task.tokenizer
    assert batch["prompt_ids"].shape == (2, 9) and batch["completion_ids"].shape == (2, 8)
    assert tok.batch_decode(batch["prompt_ids"]) == ["Q ab? A", "Q abcd? A"]
    assert batch["prompt_mask"][0].tolist() == [False] * 2 + [True] * 7
    assert tok.batch_decode(batch["completion_ids"]) == ["#### 12", "x\n#### 3"]
    assert batch["completion_ids"][0, 7].item() == tok.eos_id
    short = MathTask(MathConfig(path=path, eval_path=path, completion_tokens=4))
    cut = short.encode(short.prompts("train"))  # targets longer than 4 tokens are cut
    assert short.tokenizer.batch_decode(cut["completion_ids"], stop_at_eos=False) == [
        "####",
        "x\n##",
    ]


def test_subword_tokenizer_chat_template_and_max_prompt_tokens(tmp_path):
    path = str(write_jsonl(tmp_path / "g.jsonl", GSM8K_ROWS))
    tok = PairTokenizer()
    task = MathTask(MathConfig(path=path, eval_path=path, chat=True), tokenizer=tok)
    assert task.prompt_length is None  # padded to the longest prompt of each batch
    examples = task.prompts("train")
    texts = [f"<user>{ex.question}</user><assistant>" for ex in examples]
    lengths = [math.ceil(len(t) / 2) for t in texts]
    for rows in ([0, 1], [2, 3, 4], [3]):
        batch = task.encode([examples[i] for i in rows])
        assert batch["prompt_ids"].shape == (len(rows), max(lengths[i] for i in rows))
        assert batch["prompt_mask"].sum(1).tolist() == [lengths[i] for i in rows]
        assert bool(batch["prompt_mask"][:, -1].all())  # LEFT padding
    longest = max(lengths)
    fixed = MathTask(
        MathConfig(path=path, eval_path=path, chat=True, max_prompt_tokens=longest), tokenizer=tok
    )
    assert fixed.prompt_length == longest
    assert fixed.encode(examples[:1])["prompt_ids"].shape == (1, longest)
    row = lengths.index(longest)
    message = (
        rf"task.max_prompt_tokens={longest - 1}: row {row} of {re.escape(path)} has a prompt of "
        rf"{longest} tokens \(the longest\); raise max_prompt_tokens"
    )
    with pytest.raises(ValueError, match=message):
        MathTask(
            MathConfig(path=path, eval_path=path, chat=True, max_prompt_tokens=longest - 1),
            tokenizer=tok,
        )


# ---------------------------------------------------------------------------- errors
def test_missing_and_bad_files_are_config_errors_naming_the_key(tmp_path):
    S = SFTRecipeConfig

    def error(*sets: str) -> str:
        with pytest.raises(ConfigError) as info:
            load_config(None, S, ["task.name=math", *sets])
        return str(info.value)

    assert "task.path: required key missing" in error()
    missing = tmp_path / "nope.jsonl"
    assert f"task.path: no such file '{missing}'" in error(f"task.path={missing}")
    assert "hf download openai/gsm8k --repo-type dataset" in error("task.path=openai/gsm8k")
    assert "is a directory" in error(f"task.path={tmp_path}")
    good = write_jsonl(tmp_path / "g.jsonl", GSM8K_ROWS)
    assert f"task.eval_path: no such file '{missing}'" in error(
        f"task.path={good}", f"task.eval_path={missing}"
    )
    odd = tmp_path / "g.data"
    odd.write_text(good.read_text())
    assert "task.format: cannot tell the format" in error(f"task.path={odd}")
    load_config(None, S, ["task.name=math", f"task.path={odd}", "task.format=json"])
    text = error(f"task.path={good}", "task.question_field=problem")
    assert (
        f"task.question_field: {good} has no column 'problem' (its columns: 'question', 'answer')"
        in text
    )
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"question": "q?", "answer": "7"}])
    assert "task.answer_format: row 0 of" in error(f"task.path={plain}", "task.answer_format=gsm8k")
    assert "prompt_template: must contain {question}" in error(
        f"task.path={good}", "task.prompt_template=Q"
    )
    assert "completion_tokens=10 must be a multiple of block_size=4" in error(
        f"task.path={good}", "task.completion_tokens=10"
    )
    assert "task.heldout_fraction: 0 holds out no rows" in error(
        f"task.path={good}", "task.heldout_fraction=0.0"
    )
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert "task.path:" in error(f"task.path={empty}")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "q", "answer": \n')
    assert f"task.path: cannot read {broken} as json" in error(f"task.path={broken}")
    bad_row = write_jsonl(tmp_path / "bad.jsonl", [{"question": "", "answer": "#### 1"}])
    assert "task.question_field: row 0 of" in error(
        f"task.path={bad_row}", f"task.eval_path={good}"
    )


def test_rows_are_read_once_per_file_version(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", GSM8K_ROWS)
    first = read_rows(str(path), "json")
    assert read_rows(str(path), "json") is first  # cached
    write_jsonl(path, GSM8K_ROWS[:2])
    assert len(read_rows(str(path), "json")) == 2  # a new size / mtime: read again


def test_math_task_in_the_config_and_its_rewards(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", GSM8K_ROWS)
    assert TASK_REWARDS["math"] == ("verifier", "math")
    config = load_config(
        None, GRPORecipeConfig, [f"task={{name: math, path: {path}}}", "rewards=[{name: math}]"]
    )
    options = config.task.options()
    assert options["path"] == str(path) and options["completion_tokens"] == 256
    task = config.task.build(4)
    assert isinstance(task, MathTask) and task.config == MathConfig(**options, block_size=4)
    with pytest.raises(ConfigError, match="'digits' does not apply to the math task"):
        load_config(
            None,
            GRPORecipeConfig,
            [f"task={{name: math, path: {path}}}", "rewards=[{name: digits}]"],
        )
    examples = task.prompts("eval") + task.prompts("train")
    right = [f"so the answer is {ex.answer}" for ex in examples]
    wrong = [f"#### {ex.answer}1" for ex in examples]
    for reward in (get_reward("verifier", task=task), get_reward("math")):
        assert reward(right, examples).tolist() == [1.0] * 5
        assert reward(wrong, examples).tolist() == [0.0] * 5


# ---------------------------------------------------------------------------- prompt files
def test_prompt_files_for_the_image_and_video_recipes(tmp_path):
    txt = tmp_path / "prompts.txt"
    txt.write_text(
        "a red cube\n\n  a blue ball  \na sign that says hello\n"
        + "".join(f"p{i}\n" for i in range(7))
    )
    task = PromptFileTask(PromptFileConfig(path=str(txt), heldout_fraction=0.2))
    every = task.prompts("train") + task.prompts("eval")
    assert sorted(ex.prompt for ex in every) == sorted(
        ["a red cube", "a blue ball", "a sign that says hello"] + [f"p{i}" for i in range(7)]
    )
    assert len(task.prompts("eval")) == 2
    stream = task.examples(range(16), "train")
    assert sorted(ex.prompt for ex in stream[:8]) == sorted(
        ex.prompt for ex in task.prompts("train")
    )
    assert PromptFileTask.from_info(task.info()).examples(range(16), "train") == stream
    assert task.info() == {
        "name": "prompts",
        "path": str(txt),
        "format": None,
        "prompt_field": "prompt",
        "heldout_fraction": 0.2,
        "seed": 0,
    }
    rows = [{"caption": "a sign that says open", "text": "open"}, {"caption": "a cat", "text": ""}]
    jsonl = write_jsonl(tmp_path / "ocr.jsonl", rows)
    ocr = PromptFileTask(
        PromptFileConfig(path=str(jsonl), prompt_field="caption", heldout_fraction=0.0)
    )
    assert ocr.prompts("eval") == []
    first = ocr.prompts("train")[0]
    assert (first.prompt, first.text, first.fields) == (
        "a sign that says open",
        "open",
        {"text": "open"},
    )
    with pytest.raises(AttributeError):
        _ = first.missing
    with pytest.raises(ValueError, match="split 'eval' has no examples"):
        ocr.example(0, "eval")
    with pytest.raises(TypeError, match="no images"):
        ocr.train_batch(0, 2)
    with pytest.raises(
        ValueError,
        match="task.prompt_field: .* has no column 'prompt' \\(its columns: 'caption', 'text'\\)",
    ):
        PromptFileTask(PromptFileConfig(path=str(jsonl)))
    with pytest.raises(ValueError, match="no such file"):
        PromptFileConfig(path=str(tmp_path / "none.txt"))


# ---------------------------------------------------------------------------- acceptance
def gsm8k_problems(count: int = 20, seed: int = 0) -> list[dict]:
    """GSM8K-format rows: a word problem, a one-line solution and the '#### N' final answer."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(1, 5), rng.randint(1, 4)
        name, item = (
            rng.choice(["Sam", "Ann", "Tom", "Mia"]),
            rng.choice(["apples", "pens", "cats"]),
        )
        rows.append(
            {
                "question": f"{name} has {a} {item} and gets {b} more How many {item} now?",
                "answer": f"{a} plus {b} is {a + b}\n#### {a + b}",
            }
        )
    return rows


@pytest.fixture(scope="module")
def gsm8k_model(tmp_path_factory):
    """A tiny built-in DiffusionTransformer trained briefly (``diffusion-rl sft``) on a
    GSM8K-format JSONL file, saved with the character tokenizer of the file's characters."""
    root = tmp_path_factory.mktemp("gsm8k")
    data = write_jsonl(root / "gsm8k.jsonl", gsm8k_problems())
    config = root / "sft.yaml"
    config.write_text(
        f"output_dir: {root / 'sft'}\nsteps: 60\neval_every: 60\ncheckpoint_every: 60\n"
        "batch_size: 16\neval_examples: 8\noptim: {lr: 0.01}\n"
        "model: {d_model: 32, n_layers: 2, n_heads: 4}\n"
        f"task: {{name: math, path: {data}, eval_path: {data}, completion_tokens: 24}}\n"
    )
    assert cli.main(["sft", "--config", str(config)]) == 0
    return root, data


def check_grpo_run(out: Path, data: Path, eval_examples: int) -> dict:
    """The run's results: finite rollout rewards (the math reward and the math task's own
    verifier agreeing), and the eval accuracy equal to an independent check of every decoded
    eval completion against the file's '#### N' answers."""
    results = json.loads((out / "results.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "rollout/reward_mean" in r]
    assert len(steps) == results["steps"] > 0
    for r in steps:
        assert math.isfinite(r["rollout/reward_mean"]) and 0.0 <= r["rollout/reward_mean"] <= 1.0
        assert r["rollout/reward_mean"] == pytest.approx(r["rollout/accuracy"], abs=1e-6)
        assert r["policy/ratio_mean"] == 1.0
    gold = {
        row["question"]: gsm8k_gold(row["answer"])
        for row in map(json.loads, data.read_text().splitlines())
    }
    evaluation = results["eval"]
    samples = evaluation["samples"]
    assert evaluation["num_examples"] == len(samples) == eval_examples
    independent = []
    for sample in samples:
        question = next(q for q in gold if q in sample["prompt"])
        assert sample["answer"] == gold[question]
        guess, truth = (
            math_verify.parse(sample["completion"]),
            math_verify.parse(f"${gold[question]}$"),
        )
        verdict = bool(guess and truth and math_verify.verify(truth, guess))
        strict = re.fullmatch(r"(?s).*####\s*(-?\d+)\s*", sample["completion"])
        if strict:  # a well-formed answer: the last '#### N' decides, without math-verify
            assert verdict == (int(strict.group(1)) == int(gold[question]))
        independent.append(verdict)
        assert sample["correct"] == verdict
    assert evaluation["accuracy"] == pytest.approx(sum(independent) / len(independent))
    assert results["accuracy_after"] == evaluation["accuracy"]
    return results


def test_a_gsm8k_file_drives_grpo_end_to_end(gsm8k_model, tmp_path):
    root, data = gsm8k_model
    model_dir = root / "sft" / "model"
    loaded = load_model(model_dir)
    file_chars = set("".join(r["question"] + r["answer"] for r in gsm8k_problems()))
    assert set(loaded.tokenizer.chars) == file_chars  # a tokenizer covering the dataset
    config = tmp_path / "grpo.yaml"
    config.write_text(
        f"output_dir: {tmp_path / 'grpo'}\nsteps: 2\neval_every: 2\ncheckpoint_every: 2\n"
        "prompts_per_step: 4\ngroup_size: 4\neval_examples: 8\n"
        f"model: {{path: {model_dir}}}\n"
        f"task: {{name: math, path: {data}, eval_path: {data}, completion_tokens: 24}}\n"
        "rewards: [{name: math}]\n"
    )
    assert cli.main(["grpo", "--config", str(config)]) == 0
    results = check_grpo_run(tmp_path / "grpo", data, 8)
    assert results["weights_version"] == 2
    # the run's model records the dataset task, so a later stage needs no task section
    info = json.loads((tmp_path / "grpo" / "model" / "diffusion_rl.json").read_text())
    assert info["task"]["name"] == "math" and info["task"]["path"] == str(data)
    state = load_model(tmp_path / "grpo" / "model").model.state_dict()
    assert any(not torch.equal(state[k], v) for k, v in loaded.model.state_dict().items())


def test_the_dataset_task_needs_the_models_characters(gsm8k_model, tmp_path):
    root, _ = gsm8k_model
    other = write_jsonl(
        tmp_path / "other.jsonl", [{"question": "Zoe has 3 kites?", "answer": "#### 3"}] * 5
    )
    config = load_config(
        None,
        GRPORecipeConfig,
        [
            f"model.path={root / 'sft' / 'model'}",
            f"task={{name: math, path: {other}}}",
            "rewards=[{name: math}]",
        ],
    )
    from diffusion_rl.recipes.grpo import GRPORecipe

    with pytest.raises(
        ConfigError,
        match=r"model.path: the tokenizer char-v1:\w+ lacks the characters \['Z', 'k'\] that the math task writes",
    ):
        GRPORecipe(config)


def _llada_fixture() -> Path:
    directory = FIXTURES / "hf_dllm" / "llada"
    if not directory.is_dir():
        pytest.skip("hf_dllm/llada: ../shared/fixtures absent (CI has it)")
    pytest.importorskip("diffusion_rl.models.hf", reason="the HF token adapters are not built yet")
    return directory


def test_a_gsm8k_file_drives_grpo_on_a_tiny_llada_directory(tmp_path):
    directory = _llada_fixture()
    loaded = load_model(directory)
    if loaded.kind != "token" or not hasattr(loaded.tokenizer, "chat_prompt"):
        pytest.skip("load_model does not read LLaDA directories yet")
    data = write_jsonl(tmp_path / "gsm8k.jsonl", gsm8k_problems(8))
    task = get_task(
        "math",
        tokenizer=loaded.tokenizer,
        path=str(data),
        eval_path=str(data),
        chat=True,
        completion_tokens=8,
    )
    assert task.prompt_length is None  # a subword tokenizer: prompts padded per batch
    chat = loaded.tokenizer.chat_prompt(task.prompts("train")[0].prompt)
    assert task.prompts("train")[0].prompt in chat and chat != task.prompts("train")[0].prompt
    config = tmp_path / "grpo.yaml"
    config.write_text(
        f"output_dir: {tmp_path / 'grpo'}\nsteps: 1\neval_every: 1\ncheckpoint_every: 1\n"
        "prompts_per_step: 2\ngroup_size: 2\neval_examples: 4\n"
        f"model: {{path: {directory}}}\n"
        "sampler: {block_size: 4, steps_per_block: 2}\n"
        f"task: {{name: math, path: {data}, eval_path: {data}, chat: true, completion_tokens: 8}}\n"
        "rewards: [{name: math}]\n"
    )
    assert cli.main(["grpo", "--config", str(config)]) == 0
    check_grpo_run(tmp_path / "grpo", data, 4)


def test_dynamic_sampling_needs_a_fixed_prompt_width_with_a_subword_tokenizer(tmp_path):
    directory = _llada_fixture()
    from diffusion_rl.recipes.grpo import GRPORecipe

    data = write_jsonl(tmp_path / "gsm8k.jsonl", gsm8k_problems(8))
    task = f"task={{name: math, path: {data}, completion_tokens: 8}}"
    base = [f"model.path={directory}", "rewards=[{name: math}]", "policy.algorithm=dapo"]
    config = load_config(None, GRPORecipeConfig, [*base, task])
    with pytest.raises(
        ConfigError, match="task.max_prompt_tokens: dynamic sampling joins rollout rounds"
    ):
        GRPORecipe(config)
    fixed = load_config(None, GRPORecipeConfig, [*base, task[:-1] + ", max_prompt_tokens: 64}"])
    assert GRPORecipe(fixed).task.prompt_length == 64
