"""Reward models from local directories (diffusion_rl.reward_models): CLIP score, PickScore,
the aesthetic head and OCR, on a tiny random CLIPModel written to a temporary directory and on
text rendered with PIL. Each score is checked against an independent computation through
transformers' own CLIP API (get_text_features / get_image_features, its image processor)."""

from __future__ import annotations

import importlib.util
import json
import time

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from diffusion_rl import reward_models
from diffusion_rl.config import ConfigError, FlowGRPORecipeConfig, load_config
from diffusion_rl.reward_models import (
    AestheticReward,
    ClipScoreReward,
    OcrReward,
    PickScoreReward,
    edit_distance,
    load_linear_head,
    ocr_target_text,
    preprocess_images,
    read_image_settings,
)
from diffusion_rl.rewards import REWARDS, CombinedReward, get_reward

transformers = pytest.importorskip("transformers")

PROMPTS = ["a red cat", "a blue dog on grass", "a red cat", "hello world"]
HAS_OCR = all(importlib.util.find_spec(m) for m in ("rapidocr", "onnxruntime"))
needs_ocr = pytest.mark.skipif(not HAS_OCR, reason="rapidocr / onnxruntime absent (extra: ocr)")


def _features(output):
    """get_*_features gives a tensor (transformers 4) or a pooled output (5)."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output


@pytest.fixture(scope="session")
def clip_dir(tmp_path_factory):
    """A tiny random CLIPModel directory: safetensors weights, a CLIP BPE tokenizer written
    from a hand-made vocabulary (printable ASCII, with and without the end-of-word mark, a few
    merges, the two special tokens last as in CLIP), and a processor config that resizes the
    shorter side to 32 and centre-crops 32x32."""
    directory = tmp_path_factory.mktemp("clip")
    chars = [chr(i) for i in range(33, 127)]
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": len(chars) + i for i, c in enumerate(chars)})
    merges = ["r e", "c a", "ca t</w>", "d o", "do g</w>"]
    for merge in merges:
        vocab[merge.replace(" ", "")] = len(vocab)
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    tokenizer_config = {"tokenizer_class": "CLIPTokenizer", "model_max_length": 16}
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    processor = {
        "image_processor_type": "CLIPImageProcessor",
        "do_resize": True,
        "size": {"shortest_edge": 32},
        "resample": 3,
        "do_center_crop": True,
        "crop_size": {"height": 32, "width": 32},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
    }
    (directory / "preprocessor_config.json").write_text(json.dumps(processor))
    special = vocab["<|endoftext|>"]
    text = dict(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=16,
        bos_token_id=vocab["<|startoftext|>"],
        eos_token_id=special,
        pad_token_id=special,
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
    )
    config = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    torch.manual_seed(0)
    model = transformers.CLIPModel(config)
    with torch.no_grad():
        model.logit_scale.fill_(3.0)  # not the init value: PickScore must read it
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def clip_model(clip_dir):
    return transformers.CLIPModel.from_pretrained(clip_dir).eval()


@pytest.fixture(scope="session")
def images():
    """4 images of 8-bit values (k / 255), 32x40: the shorter side is already 32, so the
    processor only crops and normalises (no resampling)."""
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (4, 3, 32, 40), generator=generator).float() / 255


def _processor(clip_dir):
    cls = getattr(transformers, "CLIPImageProcessorPil", transformers.CLIPImageProcessor)
    return cls.from_pretrained(clip_dir)


def _pil(image):
    from PIL import Image

    array = (image.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()
    return Image.fromarray(array)


def _hand_cosines(clip_dir, clip_model, images, prompts):
    """cos(text, image) per row through transformers' own tokenizer call (longest padding,
    one prompt at a time), image processor (PIL images) and get_*_features."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(clip_dir)
    pixels = _processor(clip_dir)(images=[_pil(i) for i in images], return_tensors="pt")
    with torch.no_grad():
        image = _features(clip_model.get_image_features(pixel_values=pixels["pixel_values"]))
        texts = [
            _features(clip_model.get_text_features(**tokenizer([p], return_tensors="pt")))[0]
            for p in prompts
        ]
    return F.cosine_similarity(image, torch.stack(texts), dim=-1)


# ---------------------------------------------------------------------------- CLIP score
def test_clip_score_equals_the_hand_computation(clip_dir, clip_model, images):
    reward = get_reward("clip_score", path=str(clip_dir), scale=2.5)
    assert isinstance(reward, ClipScoreReward) and REWARDS["clip_score"] is ClipScoreReward
    scores = reward(images, PROMPTS)
    assert scores.shape == (4,) and scores.dtype == torch.float32
    assert torch.isfinite(scores).all()
    expected = 2.5 * _hand_cosines(clip_dir, clip_model, images, PROMPTS)
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=0)
    # the rows differ (a random model, random images): the check above is not vacuous
    assert scores.unique().numel() == 4


def test_pickscore_is_logit_scale_times_cosine(clip_dir, clip_model, images):
    reward = get_reward("pickscore", path=str(clip_dir))
    assert isinstance(reward, PickScoreReward)
    scores = reward(images, PROMPTS)
    expected = torch.e**3.0 * _hand_cosines(clip_dir, clip_model, images, PROMPTS)
    torch.testing.assert_close(scores, expected, atol=1e-4, rtol=0)
    half = get_reward("pickscore", path=str(clip_dir), scale=0.5)(images, PROMPTS)
    torch.testing.assert_close(half, 0.5 * scores, atol=1e-6, rtol=0)
    low = get_reward("pickscore", path=str(clip_dir), dtype="bf16")(images, PROMPTS)
    assert low.dtype == torch.float32 and not torch.equal(low, scores)  # really ran in bf16
    torch.testing.assert_close(low, scores, atol=0.1, rtol=0)


def test_prompts_come_from_strings_or_prompt_fields(clip_dir, images):
    reward = ClipScoreReward(path=str(clip_dir))
    examples = [{"prompt": PROMPTS[0]}, {"prompt": PROMPTS[1]}]
    assert torch.equal(reward(images[:2], examples), reward(images[:2], PROMPTS[:2]))
    with pytest.raises(ValueError, match="clip_score: example 0 has no 'prompt' field"):
        reward(images[:1], [{"caption": "x"}])
    with pytest.raises(ValueError, match="clip_score: got 2 images but 1 examples"):
        reward(images[:2], PROMPTS[:1])
    with pytest.raises(ValueError, match="clip_score: pixel values must be finite and in"):
        reward(images[:1] * 2, PROMPTS[:1])


@pytest.mark.parametrize("name", ["clip_score", "pickscore", "aesthetic"])
def test_clip_rewards_are_deterministic_and_batch_invariant(name, clip_dir, head_file, images):
    options = {"path": str(clip_dir), "batch_size": 3}
    if name == "aesthetic":
        options["head"] = str(head_file)
    reward = get_reward(name, **options)
    batch = reward(images, PROMPTS)
    assert batch.shape == (4,) and batch.dtype == torch.float32 and torch.isfinite(batch).all()
    assert torch.equal(reward(images, PROMPTS), batch)
    for row in range(4):
        alone = reward(images[row : row + 1], PROMPTS[row : row + 1])
        # float32 rounding: a batch of 1 runs other GEMM shapes (1.2e-6 measured on AVX-512)
        assert abs(alone.item() - batch[row].item()) <= 1e-5
    # the order of the batch does not matter either
    order = [2, 0, 3, 1]
    shuffled = reward(images[order], [PROMPTS[i] for i in order])
    torch.testing.assert_close(shuffled, batch[order], atol=1e-6, rtol=0)


def test_models_are_loaded_once_per_directory(clip_dir, images, monkeypatch):
    reward_models.clear_cache()
    calls = []
    original = transformers.CLIPModel.from_pretrained

    def counting(*args, **kwargs):
        calls.append(args[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(transformers.CLIPModel, "from_pretrained", counting)
    score, pick = ClipScoreReward(path=str(clip_dir)), PickScoreReward(path=str(clip_dir))
    assert calls == []  # construction (and so config validation) loads nothing
    score(images, PROMPTS)
    pick(images, PROMPTS)
    score(images[:1], PROMPTS[:1])
    assert len(calls) == 1
    clip = score.clip(torch.device("cpu"))
    assert clip is pick.clip(torch.device("cpu"))
    assert not clip.model.training
    assert not any(p.requires_grad for p in clip.model.parameters())


def test_torch_preprocessing_matches_the_image_processor(clip_dir):
    """With resizing (the 40x48 images have a shorter side of 40 -> 32x38, then the 32x32
    crop), the torch bicubic resize agrees with the processor's PIL resize up to 8-bit
    rounding; without resizing the result is the same to float precision."""
    settings = read_image_settings(clip_dir)
    assert settings.shortest_edge == 32 and settings.crop == (32, 32)
    processor = _processor(clip_dir)
    generator = torch.Generator().manual_seed(2)
    # smooth images (upsampled noise): resampling differences stay small
    low = torch.rand(2, 3, 10, 12, generator=generator)
    big = F.interpolate(low, size=(40, 48), mode="bilinear", align_corners=False)
    big = (big * 255).round() / 255
    ours = preprocess_images(big, settings)
    theirs = processor(images=[_pil(i) for i in big], return_tensors="pt")["pixel_values"]
    assert ours.shape == theirs.shape == (2, 3, 32, 32)
    assert (ours - theirs).abs().mean() < 0.01 and (ours - theirs).abs().max() < 0.05
    exact = big[..., :32, :40]
    theirs = processor(images=[_pil(i) for i in exact], return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(preprocess_images(exact, settings), theirs, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------- aesthetic
LAION_KEYS = [("layers.0", 16, 12), ("layers.2", 12, 6), ("layers.4", 6, 4), ("layers.7", 4, 1)]


@pytest.fixture(scope="session")
def head_file(tmp_path_factory):
    """A LAION-aesthetic-v2-style head (layers.N.weight / .bias with gaps for the dropouts),
    16-d input = the tiny model's projection_dim."""
    generator = torch.Generator().manual_seed(3)
    tensors = {}
    for prefix, fan_in, fan_out in LAION_KEYS:
        weight = torch.randn(fan_out, fan_in, generator=generator) / fan_in**0.5  # nn.Linear scale
        tensors[f"{prefix}.weight"] = weight
        tensors[f"{prefix}.bias"] = torch.randn(fan_out, generator=generator)
    path = tmp_path_factory.mktemp("head") / "aesthetic.safetensors"
    save_file(tensors, str(path))
    return path


@pytest.mark.parametrize("activation", ["none", "relu"])
def test_aesthetic_equals_the_head_on_normalised_image_embeddings(
    activation, clip_dir, clip_model, head_file, images
):
    reward = get_reward("aesthetic", path=str(clip_dir), head=str(head_file), activation=activation)
    scores = reward(images, None)
    assert torch.equal(scores, reward(images, PROMPTS))  # prompts are ignored
    pixels = _processor(clip_dir)(images=[_pil(i) for i in images], return_tensors="pt")
    from safetensors.torch import load_file

    tensors = load_file(str(head_file))
    with torch.no_grad():
        x = _features(clip_model.get_image_features(pixel_values=pixels["pixel_values"]))
        x = x / x.norm(dim=-1, keepdim=True)
        for position, (prefix, _, _) in enumerate(LAION_KEYS):
            x = x @ tensors[f"{prefix}.weight"].T + tensors[f"{prefix}.bias"]
            if activation == "relu" and position < len(LAION_KEYS) - 1:
                x = x.clamp(min=0)
    torch.testing.assert_close(scores, x[:, 0], atol=1e-4, rtol=1e-5)


def test_head_files_are_checked(tmp_path, clip_dir, head_file):
    head = load_linear_head(head_file)
    assert [tuple(w.shape) for w in head.weights] == [(o, i) for _, i, o in LAION_KEYS]
    probe = tmp_path / "probe.safetensors"
    save_file({"weight": torch.ones(1, 16)}, str(probe))
    assert load_linear_head(probe).biases == (None,)
    cases = {
        "wide.safetensors": ({"0.weight": torch.ones(1, 8)}, "takes 8-d inputs but the CLIP"),
        "two.safetensors": ({"0.weight": torch.ones(2, 16)}, "last layer has 2 outputs"),
        "gap.safetensors": (
            {"l.0.weight": torch.ones(4, 16), "l.1.weight": torch.ones(1, 5)},
            "'l.1.weight' takes 5 inputs but the layer before gives 4",
        ),
        "odd.safetensors": ({"proj": torch.ones(1, 16)}, "unexpected key 'proj'"),
    }
    for name, (tensors, message) in cases.items():
        save_file(tensors, str(tmp_path / name))
        with pytest.raises(ValueError, match=message):
            AestheticReward(path=str(clip_dir), head=str(tmp_path / name))
    pickle = tmp_path / "head.pth"
    torch.save({"weight": torch.ones(1, 16)}, pickle)
    with pytest.raises(ValueError, match="aesthetic.head: head.pth is not a .safetensors file"):
        AestheticReward(path=str(clip_dir), head=str(pickle))
    with pytest.raises(ValueError, match="aesthetic.head: the option 'head' is required"):
        AestheticReward(path=str(clip_dir))


# ---------------------------------------------------------------------------- loading safety
def test_a_hub_id_fails_at_once_with_the_local_directory_message(monkeypatch):
    for offline in ("1", None):
        if offline is None:
            monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        else:
            monkeypatch.setenv("HF_HUB_OFFLINE", offline)
        start = time.perf_counter()
        with pytest.raises(ValueError, match="clip_score.path: .*hf download openai/clip-vit"):
            ClipScoreReward(path="openai/clip-vit-large-patch14")
        assert time.perf_counter() - start < 2.0


def test_model_directories_are_checked(tmp_path, clip_dir):
    with pytest.raises(ValueError, match="pickscore.path: the option 'path' is required"):
        PickScoreReward()
    with pytest.raises(ValueError, match="does not exist"):
        ClipScoreReward(path=str(tmp_path / "nowhere"))
    pickles = tmp_path / "pickles"
    pickles.mkdir()
    for name in ("config.json", "vocab.json", "preprocessor_config.json"):
        (pickles / name).write_text((clip_dir / name).read_text())
    (pickles / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match="holds only pickle weights .*pytorch_model.bin.*safet"):
        ClipScoreReward(path=str(pickles))
    (pickles / "config.json").write_text(json.dumps({"model_type": "siglip"}))
    with pytest.raises(ValueError, match="model_type 'siglip'; expected 'clip'"):
        ClipScoreReward(path=str(pickles))
    with pytest.raises(ValueError, match="clip_score.dtype: expected one of"):
        ClipScoreReward(path=str(clip_dir), dtype="int8")
    with pytest.raises(ValueError, match="clip_score.batch_size: expected an int >= 1"):
        ClipScoreReward(path=str(clip_dir), batch_size=0)
    with pytest.raises(ValueError, match="clip_score.device: expected 'cpu', 'cuda'"):
        ClipScoreReward(path=str(clip_dir), device="gpu")
    with pytest.raises(ValueError, match="clip_score.device: 'cuda:7' is not on this machine"):
        ClipScoreReward(path=str(clip_dir), device="cuda:7")


def test_a_missing_package_names_the_extra(clip_dir, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("transformers", "rapidocr") else real(name, *a),
    )
    with pytest.raises(ImportError, match=r"needs transformers .*diffusion-rl\[clip\]"):
        ClipScoreReward(path=str(clip_dir))
    with pytest.raises(ImportError, match=r"ocr reward needs rapidocr .*diffusion-rl\[ocr\]"):
        OcrReward()


def test_flow_grpo_configs_name_the_reward_models(clip_dir, head_file):
    def rewards(value):
        return load_config(None, FlowGRPORecipeConfig, [f"rewards={value}"]).rewards

    with pytest.raises(ConfigError, match="clip_score.path: the option 'path' is required"):
        rewards("[{name: clip_score}]")
    with pytest.raises(ConfigError, match="hf download openai/clip"):
        rewards("[{name: pickscore, options: {path: openai/clip-vit-large-patch14}}]")
    with pytest.raises(ConfigError, match="unknown option 'heads' of the aesthetic reward"):
        rewards(f"[{{name: aesthetic, options: {{path: {clip_dir}, heads: x}}}}]")
    value = (
        f"[{{name: clip_score, weight: 2.0, options: {{path: {clip_dir}, scale: 2.5}}}}, "
        f"{{name: aesthetic, weight: 0.5, options: {{path: {clip_dir}, head: {head_file}}}}}]"
    )
    terms = rewards(value)
    assert [(t.name, t.weight) for t in terms] == [("clip_score", 2.0), ("aesthetic", 0.5)]
    assert terms[0].options == {"path": str(clip_dir), "scale": 2.5}


def test_reward_models_combine_with_other_image_rewards(clip_dir, images):
    clip = get_reward("clip_score", path=str(clip_dir))
    combined = CombinedReward([(clip, 2.0), (get_reward("compressibility"), 0.0)])
    output = combined(images, PROMPTS)
    assert list(output.parts) == ["clip_score", "compressibility"]
    torch.testing.assert_close(output.total, 2.0 * clip(images, PROMPTS), atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------- OCR
def test_edit_distance_and_target_text():
    assert edit_distance("kitten", "sitting") == 3
    assert edit_distance("sitting", "kitten") == 3
    assert edit_distance("", "abc") == 3 and edit_distance("abc", "") == 3
    assert edit_distance("flaw", "lawn") == 2 and edit_distance("same", "same") == 0
    assert ocr_target_text('a sign that says "Open Late"') == "Open Late"
    assert ocr_target_text('a “neon” sign reading "24h"') == "neon 24h"
    assert ocr_target_text("no quotes here") is None


@needs_ocr
def test_ocr_score_and_targets():
    reward = OcrReward()
    assert reward.score("hello", "hello") == 1.0
    assert reward.score("HeLLo", "hello") == 1.0  # case and spaces ignored by default
    assert reward.score("hallo", "hello") == pytest.approx(1 - 1 / 5)
    assert reward.score("", "hello") == 0.0
    assert reward.score("a much longer reading", "hi") == 0.0  # clipped at 0
    assert OcrReward(ignore_case=False).score("Hello", "hello") == pytest.approx(0.8)
    assert reward.target({"prompt": "x", "text": "A B"}, 0) == "ab"
    assert reward.target('a sign "Open Late"', 0) == "openlate"
    with pytest.raises(ValueError, match="ocr: example 1 has no target text.*'text' field"):
        reward.target("a sign with no quotes", 1)


def _render(word, size=(160, 48), at=(8, 10)):
    """Black text on white, [3, H, W] in [0, 1], drawn with PIL's bundled font."""
    import numpy as np
    from PIL import Image, ImageDraw, ImageFont

    canvas = Image.new("RGB", size, "white")
    ImageDraw.Draw(canvas).text(at, word, fill="black", font=ImageFont.load_default(size=24))
    return torch.from_numpy(np.array(canvas)).permute(2, 0, 1).float() / 255


@needs_ocr
def test_ocr_ranks_the_right_word_above_a_wrong_one():
    reward = get_reward("ocr", detect=False)
    blank = torch.ones(3, 48, 160)
    images = torch.stack([_render("hello"), _render("world"), _render("hallo"), blank])
    prompts = ['a sign that says "hello"'] * 4
    scores = reward(images, prompts)
    assert scores.shape == (4,) and scores.dtype == torch.float32
    assert scores[0].item() == 1.0  # an exact read
    assert scores[3].item() < scores[1].item() < scores[2].item() < scores[0].item()
    assert scores[2].item() == pytest.approx(0.8)  # one substitution in five letters
    assert scores[3].item() == 0.0  # nothing read
    with_field = reward(images[:2], [{"prompt": "anything", "text": "world"}] * 2)
    assert with_field.tolist()[1] == 1.0 and with_field.tolist()[0] < 1.0


@needs_ocr
def test_ocr_with_text_detection_reads_a_word_anywhere():
    reward = OcrReward()  # the default pipeline: text detection, then recognition
    image = _render("Diffusion", size=(128, 128), at=(12, 70))
    scores = reward(image[None], ['the word "Diffusion"'])
    assert scores.tolist() == [1.0]
