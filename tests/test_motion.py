"""Tests of mini-motion (prompts, clip renderer, verifier) and the motion reward."""

from __future__ import annotations

import inspect
import json

import pydantic
import pytest
import torch

from diffusion_rl.rewards import REWARDS, CombinedReward, MotionReward, get_reward
from diffusion_rl.tasks import MotionConfig as ExportedConfig
from diffusion_rl.tasks import MotionTask as ExportedTask
from diffusion_rl.tasks.geneval import COLORS, SHAPES, GenEvalConfig, GenEvalTask, parse_prompt
from diffusion_rl.tasks.motion import (
    DIRECTIONS,
    MOTION_ATTRIBUTES,
    MOTION_VOCABULARY,
    SPEEDS,
    MotionConfig,
    MotionExample,
    MotionTask,
    analyze_clips,
    check_motion_attributes,
    clip_scores,
    max_travel,
    motion_accuracy,
    parse_motion_prompt,
    to_motion_example,
    verify_clips,
)

TASK = MotionTask(MotionConfig())  # 16 px, 4 frames, 1 and 2 px per frame
STEP = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
OPPOSITE = {"left": "right", "right": "left", "up": "down", "down": "up"}
ALL_RIGHT = dict.fromkeys((*MOTION_ATTRIBUTES, "overall"), True)


def wrong(*attributes: str) -> dict[str, bool]:
    """The verdict with exactly ``attributes`` (and overall) wrong."""
    return {**ALL_RIGHT, **dict.fromkeys(attributes, False), "overall": not attributes}


def shifted(frame: torch.Tensor, dx: int, dy: int) -> torch.Tensor:
    """``frame [3, S, S]`` moved by ``(dx, dy)``, pixel by pixel; what leaves is dropped."""
    out = torch.zeros_like(frame)
    size = frame.shape[-1]
    ys, xs = torch.nonzero(frame.sum(0) > 0, as_tuple=True)
    for y, x in zip(ys.tolist(), xs.tolist()):
        if 0 <= y + dy < size and 0 <= x + dx < size:
            out[:, y + dy, x + dx] = frame[:, y, x]
    return out


def moved(frame: torch.Tensor, direction: str, offsets: list[int]) -> torch.Tensor:
    """A clip ``[F, 3, S, S]``: ``frame`` at each offset (pixels) along ``direction``."""
    dx, dy = STEP[direction]
    return torch.stack([shifted(frame, dx * o, dy * o) for o in offsets])


# ---------------------------------------------------------------------------- prompts
def test_prompt_set_split_and_info_round_trip():
    train, held = TASK.prompts("train"), TASK.prompts("eval")
    assert len(train) + len(held) == 4 * 3 * 4 * 2 and len(held) == round(0.2 * 96)
    assert not {e.prompt for e in train} & {e.prompt for e in held}
    for e in train + held:
        assert parse_motion_prompt(e.prompt) == e
        assert e.prompt == f"a {e.color} {e.shape} moving {e.direction} {e.speed}"
        assert set(e.prompt.split()) <= set(MOTION_VOCABULARY) == set(TASK.vocabulary)
        image = parse_prompt(e.image_prompt)  # the first frame is a mini-GenEval prompt
        assert (image.kind, image.color, image.shape, image.position) == (
            "position",
            e.color,
            e.shape,
            "center",
        )
        assert e.attributes == ("color", "shape", "direction", "speed", "smooth")
    # Held-out prompts are unseen combinations: every value still occurs in training.
    assert {e.color for e in train} == set(COLORS) and {e.shape for e in train} == set(SHAPES)
    assert {e.direction for e in train} == set(DIRECTIONS) and {e.speed for e in train} == set(
        SPEEDS
    )
    assert MotionTask(MotionConfig(seed=0)).prompts("eval") == held
    assert MotionTask(MotionConfig(seed=1)).prompts("eval") != held
    assert MotionTask(MotionConfig(heldout_fraction=0.0)).prompts("eval") == []
    info = json.loads(json.dumps(TASK.info()))
    assert info["name"] == "mini-motion" == TASK.name
    assert MotionTask.from_info(info).config == TASK.config
    other = MotionTask(MotionConfig(image_size=24, num_frames=6, seed=3))
    assert MotionTask.from_info(other.info()).config == other.config
    with pytest.raises(ValueError, match="not 'mini-motion'"):
        MotionTask.from_info({**info, "name": "geneval"})
    assert ExportedTask is MotionTask and ExportedConfig is MotionConfig
    assert TASK.clip_shape == (4, 3, 16, 16) and TASK.image_shape == (3, 16, 16)


def test_parser_and_example_conversion():
    expected = MotionExample("a red circle moving left fast", "red", "circle", "left", "fast")
    assert parse_motion_prompt("  A Red   circle moving LEFT fast ") == expected
    assert expected.image_prompt == "a red circle in the center"
    for bad in ("a red circle moving left", "a red circle moving north fast", "a red circle", ""):
        with pytest.raises(ValueError, match=r"not a mini-motion prompt.*<direction> <speed>"):
            parse_motion_prompt(bad)
    with pytest.raises(TypeError, match="expected a str"):
        parse_motion_prompt(3)

    class Item:
        prompt = "a blue square moving up slowly"

    assert to_motion_example(expected) is expected
    assert to_motion_example(expected.prompt) == expected
    assert to_motion_example({"prompt": expected.prompt}) == expected
    assert to_motion_example(Item()).direction == "up"
    with pytest.raises(TypeError, match="example 4: expected a MotionExample"):
        to_motion_example({"text": "x"}, 4)


def test_config_is_strict_and_keeps_the_object_in_view():
    with pytest.raises(pydantic.ValidationError, match="slow_pixels .2. must be less"):
        MotionConfig(slow_pixels=2, fast_pixels=2)
    with pytest.raises(pydantic.ValidationError, match="moves the object 10 px.*after 6 px"):
        MotionConfig(image_size=16, num_frames=6)
    for bad in ({"image_size": 16.0}, {"num_frames": True}, {"frames": 4}, {"image_size": 11}):
        with pytest.raises(pydantic.ValidationError):
            MotionConfig(**bad)
    with pytest.raises(TypeError, match="expected a MotionConfig"):
        MotionTask(GenEvalConfig())
    # max_travel is a true bound: over many renders, the trailing edge of frame 0 starts at
    # least max_travel + ceil(smallest box / 2) pixels from any border.
    for size, travel in ((16, 6), (24, 10)):
        assert max_travel(size) == travel
        geneval = GenEvalTask(GenEvalConfig(image_size=size, kinds=("position",)))
        prompts = [f"a red {s} in the center" for s in SHAPES]
        images = geneval.render_batch(prompts * 100, list(range(300)))
        mask = images.sum(1) > 0  # [N, S, S]
        distances = []  # each render's trailing edge to the border, per direction
        for occupied in (mask.any(1), mask.any(2)):  # columns, rows: [N, S]
            low = occupied.float().argmax(1)  # x0 / y0
            high = size - 1 - occupied.flip(1).float().argmax(1)  # x1 / y1
            distances += [high, size - 1 - low]  # left / up: x1, y1; right / down: from x0, y0
        smallest = max(3, round(0.4 * size))
        assert int(torch.stack(distances).min()) >= travel + (smallest + 1) // 2


def test_example_stream_epochs_and_errors():
    n = len(TASK.prompts("train"))
    stream = TASK.examples(range(3 * n))
    assert stream == MotionTask(MotionConfig()).examples(range(3 * n))
    for epoch in range(3):
        window = stream[epoch * n : (epoch + 1) * n]
        assert sorted(e.prompt for e in window) == sorted(e.prompt for e in TASK.prompts())
    assert stream[:n] != stream[n : 2 * n]
    held = TASK.examples(range(len(TASK.prompts("eval"))), "eval")
    assert sorted(e.prompt for e in held) == sorted(e.prompt for e in TASK.prompts("eval"))
    with pytest.raises(ValueError, match="index"):
        TASK.example(-1)
    with pytest.raises(ValueError, match="split"):
        TASK.prompts("test")
    with pytest.raises(ValueError, match="no prompts"):
        MotionTask(MotionConfig(heldout_fraction=0.0)).example(0, "eval")


# ---------------------------------------------------------------------------- renderer
def test_clip_is_the_first_frame_translated():
    image_task = TASK.image_task()
    assert image_task.config == GenEvalConfig(image_size=16, kinds=("position",))
    for prompt, step in (
        ("a red circle moving left fast", 2),
        ("a green triangle moving up slowly", 1),
        ("a yellow square moving down fast", 2),
        ("a blue triangle moving right slowly", 1),
    ):
        example = parse_motion_prompt(prompt)
        for seed in range(4):
            clip = TASK.render_clip(example, seed)
            assert clip.shape == (4, 3, 16, 16) and clip.dtype == torch.float32
            assert torch.equal(clip[0], image_task.render(example.image_prompt, seed))
            expected = moved(clip[0], example.direction, [step * t for t in range(4)])
            assert torch.equal(clip, expected)
            assert set(clip.unique().tolist()) <= {0.0, 1.0}  # palette colours, hard edges
    e = "a red circle moving left fast"
    assert torch.equal(TASK.render_clip(e, 7), TASK.render_clip(e, 7))
    assert not torch.equal(TASK.render_clip(e, 7), TASK.render_clip(e, 8))
    examples, clips = TASK.train_batch(3, 5)
    assert examples == TASK.examples(range(15, 20)) and clips.shape == (5, 4, 3, 16, 16)
    assert torch.equal(clips, TASK.render_batch(examples, list(range(15, 20))))
    with pytest.raises(ValueError, match="2 examples but 1 seeds"):
        TASK.render_batch([e, e], [0])
    with pytest.raises(ValueError, match="batch_size"):
        TASK.train_batch(0, 0)


@pytest.mark.parametrize("size,frames", [(16, 4), (16, 3), (24, 4), (24, 6), (12, 3)])
def test_every_render_of_every_prompt_verifies(size, frames):
    task = MotionTask(MotionConfig(image_size=size, num_frames=frames, heldout_fraction=0.0))
    prompts = task.prompts()
    assert len(prompts) == 96
    for seed in range(3):
        seeds = [seed * 1000 + i for i in range(96)]
        clips = task.render_batch(prompts, seeds)
        assert clips.shape == (96, frames, 3, size, size)
        assert task.accuracy(clips, prompts) == dict.fromkeys(ALL_RIGHT, 1.0)
        # Stage one's verifier accepts every first frame for its image prompt.
        firsts = task.image_task().verify(clips[:, 0], [e.image_prompt for e in prompts])
        assert all(r["overall"] for r in firsts)
    # Each frame's box is that of its largest detected object (the same component).
    for frames in analyze_clips(clips):
        for frame in frames:
            x0, y0, x1, y1 = frame.box
            assert frame.objects[0].center == ((x0 + x1 + 1) / 2 / size, (y0 + y1 + 1) / 2 / size)
    # Mild pixel noise (std 0.05, clamped) changes no verdict.
    noise = torch.randn(clips.shape, generator=torch.Generator().manual_seed(0))
    assert task.accuracy((clips + 0.05 * noise).clamp(0, 1), prompts)["overall"] == 1.0


# ---------------------------------------------------------------------------- verifier
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_each_wrong_clip_fails_exactly_its_attributes(direction):
    shape = SHAPES[DIRECTIONS.index(direction) % 3]
    other_shape = SHAPES[(DIRECTIONS.index(direction) + 1) % 3]
    fast = f"a red {shape} moving {direction} fast"
    slow = f"a red {shape} moving {direction} slowly"
    for seed in range(4):
        clip = TASK.render_clip(fast, seed)

        def judge(clip, prompt=fast):
            return TASK.verify(clip[None], [prompt])[0]

        assert judge(clip) == ALL_RIGHT
        assert judge(TASK.render_clip(slow, seed), slow) == ALL_RIGHT
        assert judge(TASK.render_clip(f"a blue {shape} moving {direction} fast", seed)) == wrong(
            "color"
        )
        other = TASK.render_clip(f"a red {other_shape} moving {direction} fast", seed)
        assert judge(other) == wrong("shape")
        reverse = TASK.render_clip(f"a red {shape} moving {OPPOSITE[direction]} fast", seed)
        assert judge(reverse) == wrong("direction")
        assert judge(TASK.render_clip(slow, seed)) == wrong("speed")
        assert judge(clip, slow) == wrong("speed")
        frozen = clip[:1].repeat(4, 1, 1, 1)
        # a still clip is not smooth motion (the reward cannot be earned by freezing)
        assert judge(frozen) == judge(frozen, slow) == wrong("direction", "speed", "smooth")
        gap = clip.clone()
        gap[2] = 0.0
        assert judge(gap) == wrong("color", "smooth")
        no_start = clip.clone()
        no_start[0] = 0.0
        assert judge(no_start) == wrong(*MOTION_ATTRIBUTES)
        assert judge(torch.zeros_like(clip)) == wrong(*MOTION_ATTRIBUTES)
    # A jump (offsets 0, 1, 2, 5, 6, 7 px: one step of 3 against a mean of 1.4) is not smooth
    # but still moves the right way at about the slow speed.
    task = MotionTask(MotionConfig(image_size=24, num_frames=6))
    start = task.render_clip(slow, 0)
    assert torch.equal(start, moved(start[0], direction, [0, 1, 2, 3, 4, 5]))
    jump = moved(start[0], direction, [0, 1, 2, 5, 6, 7])
    assert task.verify(jump[None], [slow])[0] == wrong("smooth")


def test_direction_and_speed_verdicts_are_independent_at_other_speeds():
    task = MotionTask(MotionConfig(image_size=24, num_frames=4, slow_pixels=1, fast_pixels=3))
    for direction in DIRECTIONS:
        slow = f"a green square moving {direction} slowly"
        fast = f"a green square moving {direction} fast"
        back = f"a green square moving {OPPOSITE[direction]} fast"
        for seed in range(3):
            clips = task.render_batch([slow, fast, back], [seed] * 3)
            assert task.verify(clips, [fast, slow, fast]) == [
                wrong("speed"),
                wrong("speed"),
                wrong("direction"),
            ]


def test_motion_is_read_from_the_trailing_edge():
    """A hand-made 6x6 red square moving right 2 px per frame into the border: its leading edge
    stops at column 15, the trailing edge keeps the true speed."""
    clip = torch.zeros(1, 4, 3, 16, 16)
    for t in range(4):
        x0 = 8 + 2 * t
        clip[0, t, 0, 5:11, x0 : x0 + 6] = 1.0
    frames = analyze_clips(clip)[0]
    assert [f.box for f in frames] == [
        (8, 5, 13, 10),
        (10, 5, 15, 10),
        (12, 5, 15, 10),
        (14, 5, 15, 10),
    ]
    assert [f.objects[0].area for f in frames] == [36, 36, 24, 12]
    assert all(f.objects[0].color == "red" for f in frames)
    assert verify_clips(clip, ["a red square moving right fast"])[0] == ALL_RIGHT
    # The box centre moves 2, 1, 1 px: a centre-based reading would call this clip uneven.
    centres = [(f.box[0] + f.box[2]) / 2 for f in frames]
    assert [b - a for a, b in zip(centres, centres[1:])] == [2.0, 1.0, 1.0]
    assert verify_clips(clip, ["a red square moving right slowly"])[0] == wrong("speed")
    # A speck below min_area is not an object; a blank frame has no box.
    speck = torch.zeros(1, 2, 3, 16, 16)
    speck[0, 0, 1, 2, 2] = 1.0
    assert [(f.objects, f.box) for f in analyze_clips(speck)[0]] == [([], None), ([], None)]


def test_shape_majority_skips_border_frames_and_ties_go_to_frame_zero():
    geneval = GenEvalTask(GenEvalConfig(image_size=16, kinds=("position",)))
    circle = geneval.render("a red circle in the center", 0)
    square = geneval.render("a red square in the center", 0)
    tie = torch.stack([circle, square])[None]  # a 2-frame clip: one vote each
    assert verify_clips(tie, ["a red circle moving left fast"])[0]["shape"]
    assert not verify_clips(tie, ["a red square moving left fast"])[0]["shape"]
    two_squares = torch.stack([circle, square, square])[None]
    assert verify_clips(two_squares, ["a red square moving left fast"])[0]["shape"]
    # Square frames pushed against the border do not vote.
    edge = torch.zeros(3, 16, 16)
    edge[0, 4:10, 0:5] = 1.0
    against = torch.stack([circle, edge, edge])[None]
    assert verify_clips(against, ["a red circle moving left fast"])[0]["shape"]


def test_rewards_and_accuracy_by_hand():
    prompt = "a green square moving right fast"
    clips = torch.stack(
        [
            TASK.render_clip(prompt, 0),  # all right
            TASK.render_clip("a yellow square moving right fast", 0),  # colour wrong
            TASK.render_clip("a green square moving left slowly", 0),  # direction + speed wrong
            TASK.render_clip(prompt, 0)[:1].repeat(4, 1, 1, 1),  # frozen: direction, speed, smooth
        ]
    )
    examples = [prompt] * 4
    torch.testing.assert_close(TASK.rewards(clips, examples), torch.tensor([1, 0.8, 0.6, 0.4]))
    assert TASK.rewards(clips, examples, mode="all").tolist() == [1.0, 0.0, 0.0, 0.0]
    color_smooth = TASK.rewards(clips, examples, attributes=["smooth", "color"])
    assert color_smooth.tolist() == [1.0, 0.5, 1.0, 0.5]
    assert TASK.accuracy(clips, examples) == {
        "color": 0.75,
        "shape": 1.0,
        "direction": 0.5,
        "speed": 0.5,
        "smooth": 0.75,
        "overall": 0.25,
    }
    results = [wrong("color"), ALL_RIGHT]
    assert clip_scores(results, ["color", "shape"]).tolist() == [0.5, 1.0]
    assert motion_accuracy(results)["color"] == 0.5
    assert check_motion_attributes(["speed", "color"]) == ("color", "speed")
    with pytest.raises(ValueError, match=r"distinct names from \['color', 'shape'"):
        clip_scores(results, ["colour"])
    with pytest.raises(TypeError, match="list of names"):
        clip_scores(results, "color")
    with pytest.raises(ValueError, match="mode"):
        clip_scores(results, mode="max")
    with pytest.raises(ValueError, match="at least one"):
        motion_accuracy([])
    with pytest.raises(ValueError, match=r"\[B, F, 3, H, W\]"):
        TASK.verify(clips[:, 0], examples)
    with pytest.raises(ValueError, match="4 clips but 1 examples"):
        TASK.verify(clips, examples[:1])


# ---------------------------------------------------------------------------- the reward
def test_motion_reward_registry_options_and_errors():
    assert REWARDS["motion"] is MotionReward and isinstance(get_reward("motion"), MotionReward)
    params = inspect.signature(MotionReward).parameters.values()
    assert all(p.kind is p.KEYWORD_ONLY for p in params)  # the config layer's contract
    assert get_reward("motion").name == "motion"
    assert get_reward("motion", attributes=["speed", "direction"]).name == "motion_direction_speed"
    prompts = ["a red circle moving left fast", "a blue triangle moving down slowly"]
    clips = TASK.render_batch(prompts, [0, 1])
    assert torch.equal(get_reward("motion")(clips, prompts), torch.ones(2))
    assert torch.equal(get_reward("motion")(clips, [{"prompt": p} for p in prompts]), torch.ones(2))
    with pytest.raises(ValueError, match=r"MotionReward.attributes: .*'smooth'\], got \['size'\]"):
        get_reward("motion", attributes=["size"])
    with pytest.raises(TypeError, match="MotionReward.attributes"):
        MotionReward(attributes="color")
    for bad in ({"mode": "max"}, {"min_area": 0}, {"slow_pixels": 2}, {"fast_pixels": True}):
        with pytest.raises(ValueError, match="MotionReward"):
            MotionReward(**bad)
    reward = MotionReward()
    with pytest.raises(TypeError, match="motion: expected clips as a torch.Tensor"):
        reward(prompts, clips)
    with pytest.raises(ValueError, match=r"motion: expected a float video tensor"):
        reward(clips[:, 0], prompts)
    with pytest.raises(ValueError, match=r"motion: pixel values .* in \[0, 1\]"):
        reward(clips * 2 - 1, prompts)
    with pytest.raises(ValueError, match="2 completions but 1 examples"):
        reward(clips, prompts[:1])
    with pytest.raises(ValueError, match="not a mini-motion prompt"):
        reward(clips, ["a cat", "a dog"])


def test_motion_reward_depends_only_on_its_attributes():
    prompts = [f"a {c} circle moving {d} fast" for c, d in (("red", "left"), ("green", "up"))]
    seeds = [4, 5]
    right = TASK.render_batch(prompts, seeds)
    recoloured = TASK.render_batch(
        [p.replace("a red", "a blue").replace("a green", "a yellow") for p in prompts], seeds
    )
    reversed_ = TASK.render_batch(
        [p.replace("left", "right").replace("up", "down") for p in prompts], seeds
    )
    color = get_reward("motion", attributes=["color"])
    assert color(right, prompts).tolist() == [1.0, 1.0]
    assert color(recoloured, prompts).tolist() == [0.0, 0.0]
    assert color(reversed_, prompts).tolist() == [1.0, 1.0]
    motion = get_reward("motion", attributes=["direction", "speed"])
    assert motion(right, prompts).tolist() == [1.0, 1.0]
    assert motion(recoloured, prompts).tolist() == [1.0, 1.0]
    assert motion(reversed_, prompts).tolist() == [0.5, 0.5]  # the speed is still right
    assert MotionReward(mode="all")(reversed_, prompts).tolist() == [0.0, 0.0]
    combined = CombinedReward([(color, 1.0), (motion, 2.0)])(reversed_, prompts)
    assert combined.total.tolist() == [2.0, 2.0]
    assert set(combined.parts) == {"motion_color", "motion_direction_speed"}
    # The speeds are the task's: with 1 and 4 px per frame, a 2 px/frame clip reads as slow.
    wide = MotionReward(attributes=["speed"], slow_pixels=1, fast_pixels=4)
    assert wide(right, prompts).tolist() == [0.0, 0.0]
    assert wide(right, [p.replace("fast", "slowly") for p in prompts]).tolist() == [1.0, 1.0]
