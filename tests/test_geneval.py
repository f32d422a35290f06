"""Tests of mini-GenEval (prompts, renderer, verifier), the image rewards and the image grid."""

from __future__ import annotations

import json
import random

import numpy as np
import pydantic
import pytest
import torch
from PIL import Image

from diffusion_rl.plots import save_image_grid
from diffusion_rl.rewards import (
    REWARDS,
    CombinedReward,
    CompressibilityReward,
    GenEvalReward,
    get_reward,
)
from diffusion_rl.tasks.geneval import (
    COLORS,
    POSITIONS,
    SHAPES,
    VOCABULARY,
    GenEvalConfig,
    GenEvalExample,
    GenEvalTask,
    analyze_images,
    attribute_accuracy,
    make_prompt,
    parse_prompt,
)

TASK = GenEvalTask(GenEvalConfig(image_size=16))


def _example(prompt: str) -> GenEvalExample:
    return parse_prompt(prompt)


# ---------------------------------------------------------------------------- prompts
def test_prompt_set_split_and_parser_round_trip():
    train, held = TASK.prompts("train"), TASK.prompts("eval")
    # 4 colours x 3 shapes x (5 positions + 3 counts) = 96 prompts; 20 % held out.
    assert len(train) + len(held) == 96 and len(held) == round(0.2 * 96)
    assert not {e.prompt for e in train} & {e.prompt for e in held}
    for e in train + held:
        assert parse_prompt(e.prompt) == e
        assert make_prompt(e.kind, e.color, e.shape, e.position, e.count) == e.prompt
        assert set(e.prompt.split()) <= set(VOCABULARY)
    # Every attribute value is seen in training (held-out prompts are new combinations).
    assert {e.color for e in train} == set(COLORS) and {e.shape for e in train} == set(SHAPES)
    assert {e.position for e in train if e.kind == "position"} == set(POSITIONS)
    assert {e.count for e in train if e.kind == "count"} == {1, 2, 3}
    # Seeded: same seed same split, another seed another split.
    assert GenEvalTask(GenEvalConfig(seed=0)).prompts("eval") == held
    assert GenEvalTask(GenEvalConfig(seed=1)).prompts("eval") != held
    # The JSON form of the settings rebuilds the same task.
    info = json.loads(json.dumps(TASK.info()))
    assert GenEvalTask.from_info(info).config == TASK.config
    with pytest.raises(ValueError, match="not 'geneval'"):
        GenEvalTask.from_info({**info, "name": "arithmetic"})


def test_parser_examples_and_errors():
    assert parse_prompt("A red circle on the left") == GenEvalExample(
        "a red circle on the left", "position", "red", "circle", "left", 1
    )
    assert parse_prompt("two blue squares") == GenEvalExample(
        "two blue squares", "count", "blue", "square", None, 2
    )
    assert parse_prompt("one green triangle").count == 1
    for bad in ("a red circle on the top", "two blue square", "one blue squares", "a cat", ""):
        with pytest.raises(ValueError, match="not a mini-GenEval prompt"):
            parse_prompt(bad)


def test_example_stream_is_deterministic_and_covers_the_split():
    n = len(TASK.prompts("train"))
    stream = TASK.examples(range(3 * n), "train")
    assert stream == GenEvalTask(GenEvalConfig(image_size=16)).examples(range(3 * n), "train")
    for epoch in range(3):  # each epoch is a permutation of the split, a different one each
        window = stream[epoch * n : (epoch + 1) * n]
        assert sorted(e.prompt for e in window) == sorted(e.prompt for e in TASK.prompts("train"))
    assert stream[:n] != stream[n : 2 * n]
    # each epoch is the split shuffled by its own seed, read in any order (the shuffles are
    # cached): the stream by hand, backwards and far out
    for index in [*range(3 * n - 1, -1, -7), 10**6 + 3]:
        epoch, offset = divmod(index, n)
        order = list(range(n))
        random.Random(TASK._seed("train", "epoch", epoch)).shuffle(order)
        assert TASK.example(index, "train") == TASK.prompts("train")[order[offset]]
    held = TASK.examples(range(len(TASK.prompts("eval"))), "eval")
    assert sorted(e.prompt for e in held) == sorted(e.prompt for e in TASK.prompts("eval"))
    with pytest.raises(pydantic.ValidationError, match="max_count"):
        GenEvalConfig(max_count=4)
    with pytest.raises(pydantic.ValidationError, match="kinds"):
        GenEvalConfig(kinds=())


# ---------------------------------------------------------------------------- renderer + verifier
@pytest.mark.parametrize("size", [16, 32])
def test_verifier_is_right_on_renders(size):
    task = GenEvalTask(GenEvalConfig(image_size=size))
    examples = task.examples(range(300), "train") + task.examples(range(100), "eval")
    images = task.render_batch(examples, list(range(400)))
    assert images.shape == (400, 3, size, size) and images.dtype == torch.float32
    assert images.min() >= 0 and images.max() <= 1
    accuracy = attribute_accuracy(task.verify(images, examples))
    # Measured: every attribute of all 400 renders right (16 and 32 px).
    assert accuracy == {"color": 1.0, "shape": 1.0, "position": 1.0, "count": 1.0, "overall": 1.0}
    # Pixel noise of std 0.1 (clamped) does not change a verdict.
    noisy = images + 0.1 * torch.randn(images.shape, generator=torch.Generator().manual_seed(0))
    assert attribute_accuracy(task.verify(noisy.clamp(0, 1), examples))["overall"] == 1.0


def test_render_is_a_pure_function_of_example_and_seed():
    e = _example("two red triangles")
    assert torch.equal(TASK.render(e, 7), TASK.render(e, 7))
    assert not torch.equal(TASK.render(e, 7), TASK.render(e, 8))
    examples, images = TASK.train_batch(3, 5)
    assert examples == TASK.examples(range(15, 20)) and images.shape == (5, 3, 16, 16)
    assert torch.equal(images, TASK.render_batch(examples, list(range(15, 20))))


def test_each_attribute_verifier_flags_a_wrong_render():
    """Render one prompt, judge it against a prompt that differs in one attribute: exactly
    that attribute (and overall) is wrong."""
    cases = [
        ("a red circle on the left", "a blue circle on the left", "color"),
        ("a red circle on the left", "a red square on the left", "shape"),
        ("a red circle on the left", "a red triangle on the left", "shape"),
        ("a green square at the top", "a green circle at the top", "shape"),
        ("a yellow triangle in the center", "a yellow square in the center", "shape"),
        ("a red circle on the left", "a red circle on the right", "position"),
        ("a blue square at the top", "a blue square at the bottom", "position"),
        ("a blue square at the top", "a blue square in the center", "position"),
        ("two blue squares", "three blue squares", "count"),
        ("three green circles", "one green circle", "count"),
        ("two yellow triangles", "two red triangles", "color"),
        ("two yellow triangles", "two yellow circles", "shape"),
    ]
    for drawn, asked, wrong in cases:
        for seed in range(5):
            image = TASK.render(drawn, seed)[None]
            assert TASK.verify(image, [drawn])[0]["overall"], (drawn, seed)
            result = TASK.verify(image, [asked])[0]
            assert {k for k, ok in result.items() if not ok} == {wrong, "overall"}, (asked, seed)


def test_verifier_on_hand_drawn_images():
    """Images built by hand (not by the renderer): a 6x6 square, a disc, an up-triangle."""
    image = torch.zeros(3, 3, 24, 24)
    image[0, 0, 9:15, 2:8] = 1.0  # red 6x6 square, left
    yy, xx = torch.meshgrid(torch.arange(24.0), torch.arange(24.0), indexing="ij")
    disc = (yy - 5.5) ** 2 + (xx - 11.5) ** 2 <= 3.6**2  # green disc, top
    image[1, 1][disc] = 1.0
    for row in range(7):  # yellow (red + green channels) up-triangle, bottom
        image[2, 0:2, 12 + row, 12 - row : 13 + row] = 1.0
    objects = analyze_images(image)
    assert [(o.color, o.shape, o.position) for o in objects[0]] == [("red", "square", "left")]
    assert [(o.color, o.shape, o.position) for o in objects[1]] == [("green", "circle", "top")]
    assert [(o.color, o.shape, o.position) for o in objects[2]] == [
        ("yellow", "triangle", "bottom")
    ]
    assert objects[0][0].area == 36 and objects[0][0].fill == 1.0
    # Specks below min_area are noise; a blank image has no objects and fails everything.
    speck = torch.zeros(1, 3, 24, 24)
    speck[0, 0, 3, 3] = 1.0
    assert analyze_images(speck) == [[]]
    result = TASK.verify(torch.zeros(1, 3, 16, 16), ["one red circle"])[0]
    assert result == {"color": False, "shape": False, "count": False, "overall": False}


def test_attribute_accuracy_by_hand():
    results = [
        {"color": True, "shape": False, "position": True, "overall": False},
        {"color": True, "shape": True, "count": True, "overall": True},
        {"color": False, "shape": True, "count": False, "overall": False},
    ]
    assert attribute_accuracy(results) == {
        "color": 2 / 3,
        "shape": 2 / 3,
        "position": 1.0,
        "count": 0.5,
        "overall": 1 / 3,
    }
    with pytest.raises(ValueError, match="at least one"):
        attribute_accuracy([])


# ---------------------------------------------------------------------------- rewards
def test_geneval_reward_scores_right_and_wrong_renders():
    prompts = ["a red circle on the left", "two blue squares", "a green triangle at the top"]
    images = TASK.render_batch(prompts, [0, 1, 2])
    reward = get_reward("geneval")
    assert isinstance(reward, GenEvalReward) and REWARDS["geneval"] is GenEvalReward
    assert torch.equal(reward(images, prompts), torch.ones(3))
    asked = ["a red square on the right", "three blue squares", "a blue circle at the bottom"]
    # Attributes right: (colour) 1/3; (colour, shape) 2/3; none 0/3.
    torch.testing.assert_close(reward(images, asked), torch.tensor([1 / 3, 2 / 3, 0.0]))
    strict = GenEvalReward(mode="all")
    assert torch.equal(strict(images, asked), torch.zeros(3))
    # Examples may be objects with a prompt field, as in the text rewards.
    examples = [{"prompt": p} for p in prompts]
    assert torch.equal(reward(images, examples), torch.ones(3))
    with pytest.raises(TypeError, match="images as a torch.Tensor"):
        reward(prompts, images)
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        reward(images * 2 - 1, prompts)
    with pytest.raises(ValueError, match="not a mini-GenEval prompt"):
        reward(images, ["a cat", "a dog", "a fish"])


def test_compressibility_reward():
    flat = torch.full((1, 3, 32, 32), 0.5)
    noisy = torch.rand((1, 3, 32, 32), generator=torch.Generator().manual_seed(0))
    render = TASK.render("a red circle on the left", 0)[None]
    for reward in (CompressibilityReward(), CompressibilityReward(format="png", unit="bpp")):
        values = reward(torch.cat([flat, noisy]), ["a", "b"])
        assert values.shape == (2,) and values.dtype == torch.float32
        assert values[0] > values[1]
    # kb: exactly minus the encoded size / 1000; bpp: 8 * bytes / pixels.
    jpeg = CompressibilityReward()
    assert float(jpeg(noisy)[0]) == pytest.approx(-jpeg.encoded_bytes(noisy[0]) / 1000)
    png = CompressibilityReward(format="png", unit="bpp")
    assert float(png(render)[0]) == pytest.approx(-8 * png.encoded_bytes(render[0]) / 256)
    assert get_reward("compressibility", format="png").format == "png"
    with pytest.raises(ValueError, match="quality"):
        CompressibilityReward(quality=0)


def test_image_rewards_combine():
    prompts = ["one red circle", "two green squares"]
    images = TASK.render_batch(prompts, [3, 4])
    combined = CombinedReward([(GenEvalReward(), 1.0), (CompressibilityReward(), 0.5)])
    out = combined(images, prompts)
    assert out.parts["geneval"].tolist() == [1.0, 1.0]
    torch.testing.assert_close(out.total, out.parts["geneval"] + 0.5 * out.parts["compressibility"])


# ---------------------------------------------------------------------------- image grid
def test_save_image_grid(tmp_path):
    images = TASK.render_batch(["a red circle on the left"] * 5, range(5))
    path = save_image_grid(images, tmp_path / "grid.png", nrow=3, upscale=2, padding=1)
    sheet = Image.open(path)
    assert sheet.size == (3 * (32 + 1) + 1, 2 * (32 + 1) + 1)
    # Tile 4 (row 1, col 1) holds image 4 enlarged twice: compare every pixel.
    tile = torch.from_numpy(np.array(sheet.crop((34, 34, 66, 66)))).float() / 255
    expected = images[4].repeat_interleave(2, 1).repeat_interleave(2, 2)
    assert torch.equal(tile.permute(2, 0, 1), expected)
    captioned = save_image_grid(images, tmp_path / "c.png", nrow=5, captions=["a red circle"] * 5)
    assert Image.open(captioned).size[1] > 64 + 4
    with pytest.raises(ValueError, match="captions"):
        save_image_grid(images, tmp_path / "x.png", captions=["one"])
