"""The shared seeded prompt split and example streams (tasks/prompts.py): the mini-GenEval and
mini-motion streams are pinned to the values the tasks produced before the split moved into
:class:`PromptTask`, so moving code never reshuffles a run's data."""

import hashlib

import pytest

from diffusion_rl.tasks.geneval import GenEvalConfig, GenEvalTask
from diffusion_rl.tasks.motion import MotionConfig, MotionTask
from diffusion_rl.tasks.prompts import PromptTask


def _digest(examples) -> str:
    return hashlib.sha256("|".join(e.prompt for e in examples).encode()).hexdigest()[:16]


# (task, split, digest of prompts(split), digest of its stream over 3 epochs, first 3 examples)
PINNED = [
    (
        GenEvalTask(),
        "train",
        "3c1b1753fcf8b0be",
        "8cdd6d40eda954fc",
        ["two yellow circles", "one green square", "a yellow circle on the right"],
    ),
    (
        GenEvalTask(),
        "eval",
        "37c30a25bbacee4c",
        "67ff1466493210e5",
        ["a yellow circle at the top", "a red circle at the bottom", "two yellow triangles"],
    ),
    (
        GenEvalTask(GenEvalConfig(seed=3, kinds=("count",))),
        "eval",
        "64f1db9aa79b3ddb",
        "eae64d08298271ca",
        ["one blue square", "two blue squares", "one red triangle"],
    ),
    (
        MotionTask(),
        "train",
        "c3a874ce17d4a467",
        "acaffb5ae8b041f6",
        [
            "a yellow square moving left fast",
            "a yellow circle moving right slowly",
            "a red circle moving left slowly",
        ],
    ),
    (
        MotionTask(MotionConfig(seed=5, heldout_fraction=0.3)),
        "eval",
        "4786b63abdb9ef2c",
        "06d1b306629e6b5f",
        [
            "a blue triangle moving left slowly",
            "a green triangle moving up slowly",
            "a green circle moving left fast",
        ],
    ),
]


@pytest.mark.parametrize("task, split, prompts, stream, first", PINNED)
def test_splits_and_streams_are_pinned(task, split, prompts, stream, first):
    n = len(task.prompts(split))
    assert _digest(task.prompts(split)) == prompts
    assert _digest(task.examples(range(3 * n), split)) == stream
    assert [e.prompt for e in task.examples(range(3), split)] == first
    batch, renders = task.train_batch(1, 2)
    assert batch == task.examples([2, 3]) and len(renders) == 2


def test_the_tasks_share_the_base_and_its_checks():
    assert issubclass(GenEvalTask, PromptTask) and issubclass(MotionTask, PromptTask)
    with pytest.raises(TypeError, match="MotionTask.config: expected a MotionConfig"):
        MotionTask(GenEvalConfig())
    with pytest.raises(TypeError, match="GenEvalTask.config: expected a GenEvalConfig"):
        GenEvalTask(MotionConfig())
    assert repr(MotionTask()) == f"MotionTask({MotionConfig()!r})"
    task = MotionTask(MotionConfig(seed=2))
    assert MotionTask.from_info(task.info()).prompts("eval") == task.prompts("eval")
    with pytest.raises(ValueError, match="describes task 'mini-motion', not 'geneval'"):
        GenEvalTask.from_info(task.info())
    with pytest.raises(ValueError, match="split: expected one of"):
        task.prompts("test")
    with pytest.raises(ValueError, match="index: expected an int >= 0"):
        task.example(-1)
    with pytest.raises(ValueError, match="batch_size: expected an int >= 1"):
        task.train_batch(0, 0)


def test_example_of_takes_an_example_a_prompt_or_anything_holding_one():
    from diffusion_rl.tasks.geneval import GenEvalExample, parse_prompt, to_example
    from diffusion_rl.tasks.prompts import example_of

    expected = parse_prompt("two blue squares")
    assert (expected.kind, expected.color, expected.shape, expected.count) == (
        "count",
        "blue",
        "square",
        2,
    )
    assert example_of(expected, 0, GenEvalExample, parse_prompt) is expected
    assert to_example("Two  blue squares") == expected
    assert to_example({"prompt": "two blue squares"}) == expected
    assert to_example(type("Item", (), {"prompt": "two blue squares"})()) == expected
    with pytest.raises(TypeError, match="example 3: expected a GenEvalExample, a prompt str"):
        to_example({"text": "two blue squares"}, 3)
    with pytest.raises(ValueError, match="is not a mini-GenEval prompt"):
        to_example("two blue", 0)
