"""Flow recipes on tiny local diffusers pipeline directories (SD3, FLUX, Wan), from the CLI
with a config file (docs/flow_models.md).

Each family's tiny random pipeline is written with ``save_pretrained`` and loaded back
exactly as a user's SD3.5 / FLUX.1 / Wan2.1 directory is. Checked against independent
computations: the metrics the recipe writes (ratio exactly 1, parity 0, KL 0 before the
first update), the checkpoint's tensors (LoRA weights only) loaded into a freshly built model
(bitwise the run's outputs), the merged export loaded by diffusers' own
``DiffusionPipeline.from_pretrained`` and run through the pipeline's own ``__call__``
(within 1e-5 of the LoRA model), the text cache against uncached single-prompt encodes
(bitwise), and resume against an uninterrupted run (bitwise).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

pytest.importorskip("diffusers")
pytest.importorskip("peft")
pytest.importorskip("ftfy")

import safetensors.torch  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from diffusers import DiffusionPipeline  # noqa: E402
from flow_toy import one_thread, perturbed  # noqa: E402, F401 (fixture: one CPU thread)

from diffusion_rl import cli  # noqa: E402
from diffusion_rl.cli.verify import verify_path  # noqa: E402
from diffusion_rl.config import (  # noqa: E402
    ConfigError,
    FlowGRPORecipeConfig,
    FlowSFTRecipeConfig,
    build_config,
)
from diffusion_rl.models.diffusers_adapters import (  # noqa: E402
    FluxAdapter,
    SD3Adapter,
    WanAdapter,
    WanImageToVideoAdapter,
)
from diffusion_rl.models.diffusers_adapters.export import export_flow_model  # noqa: E402
from diffusion_rl.models.diffusers_adapters.flux import pack, unpack  # noqa: E402
from diffusion_rl.models.dit import FlowDiT, FlowDiTConfig  # noqa: E402
from diffusion_rl.models.flow_pipelines import load_pipeline_model, read_record  # noqa: E402
from diffusion_rl.models.io import load_model, save_model  # noqa: E402
from diffusion_rl.models.lora import lora_disabled  # noqa: E402
from diffusion_rl.recipes.flow_grpo import FlowGRPORecipe  # noqa: E402
from diffusion_rl.recipes.flow_models import FrameMeanReward, TaskView  # noqa: E402
from diffusion_rl.recipes.flow_sft import FlowSFTRecipe  # noqa: E402
from diffusion_rl.rewards import CompressibilityReward  # noqa: E402
from diffusion_rl.tasks.geneval import GenEvalConfig, GenEvalTask  # noqa: E402
from diffusion_rl.workflows import StageSpec, load_stage_model  # noqa: E402

FAMILIES = {"sd3": SD3Adapter, "flux": FluxAdapter, "wan": WanAdapter}
PIPELINE_CLASSES = {"sd3": "StableDiffusion3Pipeline", "flux": "FluxPipeline", "wan": "WanPipeline"}
# one held-out prompt, one image each: evaluation stays a single tiny forward pass
TASK_SETTINGS = {"kinds": ["position"], "heldout_fraction": 0.02}
TASK = {"name": "geneval", **TASK_SETTINGS}
PROMPTS = ["a red circle on the left", "a blue square at the top"]


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory):
    """family → a local directory holding its tiny random pipeline."""
    root = tmp_path_factory.mktemp("pipelines")
    for family, adapter in FAMILIES.items():
        adapter.tiny(seed=0).save_pretrained(root / family)
    return root


def model_section(directory: Path, family: str, **extra) -> dict:
    section = {"path": str(directory), "max_sequence_length": 16, **extra}
    if family == "wan":
        section["num_frames"] = 5  # 1 + 4: the Wan VAE encodes the first frame, then 4 at a time
    return section


def grpo_config(out: Path, model: dict, family: str, steps: int = 2) -> dict:
    """Flow-GRPO with compressibility (a dense reward: the group advantages are never all 0)
    at a learning rate that moves a LoRA visibly in 2 steps."""
    return {
        "output_dir": str(out),
        "model": model,
        "task": TASK,
        "rewards": [{"name": "compressibility"}],
        # FLUX is guidance-distilled: no true CFG, its embedded guidance inside
        "sampler": {
            "num_steps": 3,
            "shift": 3.0,
            "guidance_scale": 1.0 if family == "flux" else 3.0,
        },
        "steps": steps,
        "prompts_per_step": 1,
        "group_size": 2,
        "eval_every": 2,
        "eval_samples_per_prompt": 1,
        "grid_images": 1,
        "checkpoint_every": 1,
        "optim": {"lr": 1e-2},
    }


def run_cli(command: str, config: dict, path: Path) -> None:
    path.write_text(yaml.safe_dump(config))
    assert cli.main([command, "--config", str(path)]) == 0


def metrics(out: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows if "flow_grpo/ratio_min" in row}


@pytest.fixture(scope="module")
def lora_run(pipelines, tmp_path_factory):
    """family → the output directory of a 2-step Flow-GRPO LoRA run from the CLI (run once
    per family and module)."""
    runs: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in runs:
            out = tmp_path_factory.mktemp(f"grpo_{family}") / "run"
            model = model_section(pipelines / family, family, lora={"rank": 4})
            run_cli("flow-grpo", grpo_config(out, model, family), out.parent / "grpo.yaml")
            runs[family] = out
        return runs[family]

    return get


def noise(model, rows: int, seed: int = 3) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, *model.latent_shape, generator=generator)


def velocities(model, x, cond) -> torch.Tensor:
    with torch.no_grad():
        return model(x, torch.tensor([0.9, 0.35]), cond)


# ----------------------------------------------------------------------------- Flow-GRPO, LoRA
@pytest.mark.parametrize("family", list(FAMILIES))
def test_flow_grpo_lora_from_the_cli_ratio_one_adapter_checkpoint_and_merged_export(
    family, pipelines, lora_run, tmp_path
):
    out = lora_run(family)
    rows = metrics(out)
    first, second = rows[1], rows[2]
    assert first["flow_grpo/ratio_min"] == 1.0 == first["flow_grpo/ratio_max"]
    assert first["flow_grpo/parity_max_abs"] == 0.0  # replay == behaviour log-probs, bitwise
    assert first["flow_grpo/kl"] == 0.0  # reference = the actor with its LoRA off
    assert second["flow_grpo/parity_max_abs"] == 0.0 and second["flow_grpo/kl"] > 0.0

    # the checkpoint holds exactly the LoRA weights (and the optimizer), nothing of the base
    checkpoint = out / "checkpoints" / "step_00000002"
    stored = safetensors.torch.load_file(str(checkpoint / "model.safetensors"))
    assert stored and all(".lora_A." in k or ".lora_B." in k for k in stored)
    assert max(float(v.abs().max()) for k, v in stored.items() if ".lora_B." in k) > 0

    # the final model directory: base pipeline path + LoRA; load_model reads it
    record = read_record(out / "model")
    assert record.kind == family and record.weights == "lora" and record.lora.rank == 4
    assert Path(record.base) == (pipelines / family).resolve()
    trained = load_model(out / "model").model
    assert trained.lora is not None and trained.output_shape[-2:] == (16, 16)

    # a fresh model from the pipeline directory + the checkpoint's LoRA: bitwise the run's
    options = dict(record.options)
    fresh = load_pipeline_model(pipelines / family, family, options=options)
    fresh.add_lora(record.lora)
    safetensors.torch.load_model(fresh, str(checkpoint / "model.safetensors"), strict=True)
    cond = trained.encode_prompts(PROMPTS)
    x = noise(trained, 2)
    lora_v = velocities(trained, x, cond)
    assert torch.equal(velocities(fresh, x, cond), lora_v)
    with trained.lora_disabled():
        base_v = velocities(trained, x, cond)
    assert float((lora_v - base_v).abs().max()) > 1e-4  # the LoRA changed the model

    # merged export: a plain diffusers directory (no peft), the LoRA model's outputs
    merged_dir = export_flow_model(out, tmp_path / "merged")
    assert verify_path(merged_dir)[0] == 0  # sealed with a manifest of every file
    pipe = DiffusionPipeline.from_pretrained(str(merged_dir))
    assert type(pipe).__name__ == PIPELINE_CLASSES[family]
    assert not any(".lora_" in name for name in pipe.transformer.state_dict())
    merged = FAMILIES[family](pipe, **options)
    assert float((velocities(merged, x, cond) - lora_v).abs().max()) <= 1e-5
    expected = pipeline_call(family, trained.as_pipeline(), x, options)
    assert float((pipeline_call(family, pipe, x, options) - expected).abs().max()) <= 1e-5


def pipeline_call(family: str, pipe, x: torch.Tensor, options: dict) -> torch.Tensor:
    """2 Euler steps of the diffusers pipeline's own ``__call__`` from latents ``x`` (no CFG),
    its final latents in the adapter's layout."""
    pipe.set_progress_bar_config(disable=True)
    kwargs = dict(
        prompt=PROMPTS,
        num_inference_steps=2,
        height=16,
        width=16,
        max_sequence_length=16,
        output_type="latent",
        return_dict=False,
    )
    with torch.no_grad():
        if family == "flux":
            return unpack(pipe(latents=pack(x), guidance_scale=3.5, **kwargs)[0], 8, 8)
        if family == "wan":
            return pipe(latents=x, num_frames=options["num_frames"], guidance_scale=1.0, **kwargs)[
                0
            ]
        return pipe(latents=x, guidance_scale=1.0, **kwargs)[0]


def test_flow_grpo_resume_gives_the_uninterrupted_runs_model_bitwise(
    pipelines, lora_run, tmp_path, capsys
):
    """1 step, then the same config extended to 2 steps (resumed from the adapter-only
    checkpoint): the final LoRA equals the uninterrupted 2-step run's, bitwise."""
    straight = lora_run("sd3")
    out = tmp_path / "resumed"
    model = model_section(pipelines / "sd3", "sd3", lora={"rank": 4})
    run_cli("flow-grpo", grpo_config(out, model, "sd3", steps=1), tmp_path / "a.yaml")
    capsys.readouterr()
    run_cli("flow-grpo", grpo_config(out, model, "sd3", steps=2), tmp_path / "b.yaml")
    assert "resumed from" in capsys.readouterr().out  # not a fresh start
    assert sorted(metrics(out)) == [1, 2]  # each step logged once
    assert json.loads((out / "results.json").read_text())["steps"] == 2
    resumed = safetensors.torch.load_file(str(out / "model" / "model.safetensors"))
    expected = safetensors.torch.load_file(str(straight / "model" / "model.safetensors"))
    assert resumed.keys() == expected.keys()
    assert all(torch.equal(resumed[k], expected[k]) for k in expected)


def test_bf16_pipeline_weights_keep_ratio_one_and_parity_zero(pipelines, tmp_path):
    """dtype: bfloat16 loads the pipeline's weights in bf16 (the LoRA stays float32, peft's
    default); rollout and replay run the same bf16 forwards: ratio 1, parity 0, KL 0."""
    out = tmp_path / "bf16"
    model = model_section(pipelines / "sd3", "sd3", lora={"rank": 4}, dtype="bfloat16")
    run_cli("flow-grpo", grpo_config(out, model, "sd3", steps=1), tmp_path / "c.yaml")
    first = metrics(out)[1]
    assert first["flow_grpo/ratio_min"] == 1.0 == first["flow_grpo/ratio_max"]
    assert first["flow_grpo/parity_max_abs"] == 0.0 and first["flow_grpo/kl"] == 0.0
    trained = load_model(out / "model").model
    assert read_record(out / "model").dtype == "bfloat16"
    dtypes = {n: p.dtype for n, p in trained.transformer.named_parameters()}
    assert {d for n, d in dtypes.items() if ".lora_" not in n} == {torch.bfloat16}
    assert {d for n, d in dtypes.items() if ".lora_" in n} == {torch.float32}


def test_activation_checkpointing_trains_the_same_lora_bitwise(pipelines, lora_run, tmp_path):
    """diffusers' gradient checkpointing recomputes the transformer's blocks in the backward
    pass: the same two Flow-GRPO steps give the same LoRA weights, bitwise."""
    out = tmp_path / "checkpointed"
    model = model_section(pipelines / "sd3", "sd3", lora={"rank": 4})
    config = {**grpo_config(out, model, "sd3"), "activation_checkpointing": True}
    recipe = FlowGRPORecipe(build_config(FlowGRPORecipeConfig, config))
    assert recipe.model.transformer.is_gradient_checkpointing  # it is on ...
    run_cli("flow-grpo", config, tmp_path / "c.yaml")  # ... and changes no number
    ours = safetensors.torch.load_file(str(out / "model" / "model.safetensors"))
    expected = safetensors.torch.load_file(str(lora_run("sd3") / "model" / "model.safetensors"))
    assert ours.keys() == expected.keys()
    assert all(torch.equal(ours[k], expected[k]) for k in expected)


# ----------------------------------------------------------------------------- SFT, chains
def test_flow_sft_full_transformer_then_flow_grpo_lora_from_its_model(pipelines, tmp_path):
    """flow-sft trains the whole SD3 transformer (frozen VAE / text encoders untouched) at
    twice the task's image size (renders enlarged, the verifier sees a 2 × 2 downsample), its
    model directory reloads bitwise; flow-grpo then trains a LoRA on that model (the SFT
    weights merged in: the reference), ratio 1 and KL 0 at its first step."""
    sft_out = tmp_path / "sft"
    sft = {
        "output_dir": str(sft_out),
        "model": model_section(pipelines / "sd3", "sd3", height=32, width=32),
        "task": TASK,
        "sampler": {"num_steps": 2, "shift": 3.0, "guidance_scale": 3.0},
        "steps": 2,
        "batch_size": 2,
        "eval_every": 2,
        "eval_samples_per_prompt": 1,
        "grid_images": 1,
        "checkpoint_every": 2,
        "optim": {"lr": 1e-3},
    }
    run_cli("flow-sft", sft, tmp_path / "sft.yaml")
    record = read_record(sft_out / "model")
    assert record.weights == "transformer" and record.lora is None
    assert (record.options["height"], record.options["width"]) == (32, 32)
    base = load_pipeline_model(pipelines / "sd3", "sd3", options=record.options)
    trained = load_model(sft_out / "model").model
    stored = safetensors.torch.load_file(
        str(sft_out / "checkpoints" / "step_00000002" / "model.safetensors")
    )
    assert set(stored) == {f"transformer.{k}" for k in base.transformer.state_dict()}
    moved = [
        k
        for k, v in trained.transformer.state_dict().items()
        if not torch.equal(v, base.transformer.state_dict()[k])
    ]
    assert moved  # the transformer trained ...
    for name in ("vae", "text_encoder", "text_encoder_2", "text_encoder_3"):  # ... nothing else
        mine, theirs = getattr(trained, name).state_dict(), getattr(base, name).state_dict()
        assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    cond = trained.encode_prompts(PROMPTS)
    x = noise(trained, 2)
    again = load_model(sft_out / "model").model
    assert torch.equal(velocities(again, x, cond), velocities(trained, x, cond))

    grpo_out = tmp_path / "grpo"
    model = {"path": str(sft_out / "model"), "lora": {"rank": 2}}  # options as recorded
    run_cli("flow-grpo", grpo_config(grpo_out, model, "sd3", steps=1), tmp_path / "grpo.yaml")
    first = metrics(grpo_out)[1]
    assert first["flow_grpo/ratio_min"] == 1.0 == first["flow_grpo/ratio_max"]
    assert first["flow_grpo/kl"] == 0.0 and first["flow_grpo/parity_max_abs"] == 0.0
    chained = load_model(grpo_out / "model").model
    assert chained.output_shape == (3, 32, 32)  # the options recorded by the SFT run
    assert read_record(grpo_out / "model").base == str((sft_out / "model").resolve())
    with chained.lora_disabled():  # the LoRA's base is the SFT model
        assert torch.equal(velocities(chained, x, cond), velocities(trained, x, cond))
    # the workflow stage loader reads the same directory
    stage = load_stage_model(StageSpec(name="image", model=str(grpo_out / "model")))
    assert torch.equal(velocities(stage, x, cond), velocities(chained, x, cond))


def test_flow_sft_lora_of_wan_image_to_video_on_mini_motion(tmp_path):
    """A Wan image-to-video pipeline learns mini-motion clips (each conditioned on its first
    frame) as a LoRA at the task's clip shape; the model directory reloads bitwise."""
    WanImageToVideoAdapter.tiny(seed=0).save_pretrained(tmp_path / "pipe")
    out = tmp_path / "sft"
    config = {
        "output_dir": str(out),
        "model": {"path": str(tmp_path / "pipe"), "lora": {"rank": 2}},
        # 5 frames (1 + 4: the Wan VAE's encoder chunk) of 24 px, so the fast object stays in view
        "task": {
            "name": "mini-motion",
            "num_frames": 5,
            "image_size": 24,
            "heldout_fraction": 0.02,
        },
        "sampler": {"num_steps": 2, "shift": 3.0, "guidance_scale": 2.0},
        "steps": 1,
        "batch_size": 2,
        "eval_every": 1,
        "eval_samples_per_prompt": 1,
        "grid_images": 1,
    }
    run_cli("flow-sft", config, tmp_path / "sft.yaml")
    results = json.loads((out / "results.json").read_text())
    assert results["final_loss"] > 0 and (out / "samples" / "step_000001.gif").is_file()
    record = read_record(out / "model")
    assert record.kind == "wan_i2v" and record.options["num_frames"] == 5
    trained, again = load_model(out / "model").model, load_model(out / "model").model
    assert trained.output_shape == (5, 3, 24, 24) and trained.lora.rank == 2
    first = torch.rand(2, 3, 24, 24, generator=torch.Generator().manual_seed(0))
    cond = trained.encode_conditioning(PROMPTS, first)
    assert torch.equal(
        velocities(again, noise(trained, 2), cond), velocities(trained, noise(trained, 2), cond)
    )
    with pytest.raises(ValueError, match=r"num_frames: expected 1 \+ a multiple of 2 .* and of 4"):
        WanAdapter.tiny(seed=0, num_frames=3)  # the VAE would encode 3 frames to 1 latent frame


# ----------------------------------------------------------------------------- generate
def test_generate_serves_a_pipeline_directory_and_a_lora_runs_model(pipelines, lora_run, tmp_path):
    from PIL import Image

    grid = tmp_path / "grid.png"
    base = ["generate", "--prompt", PROMPTS[0], "--samples", "2", "--num-steps", "2"]
    assert cli.main([*base, "--model", str(pipelines / "sd3"), "--output", str(grid)]) == 0
    with Image.open(grid) as image:  # 2 images of 16 px (the pipeline's default), 6× enlarged
        assert image.width >= 2 * 16 * 6
    assert cli.main([*base, "--model", str(lora_run("sd3") / "model"), "--output", str(grid)]) == 0
    clips = tmp_path / "clips.gif"
    assert cli.main([*base, "--model", str(lora_run("wan") / "model"), "--output", str(clips)]) == 0
    with Image.open(clips) as gif:
        assert gif.n_frames == 5  # the recorded num_frames
    assert (
        cli.main(
            [
                *base,
                "--model",
                str(lora_run("wan") / "model"),
                "--output",
                str(grid.with_suffix(".jpg")),
            ]
        )
        == 2
    )


# ----------------------------------------------------------------------------- text cache
def test_text_embedding_cache_equals_fresh_single_prompt_encodes_bitwise():
    adapter = SD3Adapter.tiny(seed=0)
    fresh = {p: adapter.encode_prompts([p]) for p in PROMPTS + ["x"]}  # cache off: encoded now
    calls = []
    encode = adapter._encode
    adapter._encode = lambda prompts: calls.append(list(prompts)) or encode(prompts)
    adapter.cache_text_embeddings(2)
    batch = [PROMPTS[0], PROMPTS[1], PROMPTS[0]]
    for _ in range(2):  # the second round comes from the cache
        cond = adapter.encode_prompts(batch)
        for key, value in cond.items():
            assert torch.equal(value, torch.cat([fresh[p][key] for p in batch]))
    assert calls == [[PROMPTS[0]], [PROMPTS[1]]]  # each distinct prompt encoded once, alone
    adapter.encode_prompts(["x"])  # a third prompt evicts the least recently used
    assert list(adapter._text_cache) == [PROMPTS[1], "x"]
    adapter.encode_prompts([PROMPTS[0]])
    assert calls[-1] == [PROMPTS[0]]
    adapter.to(torch.float64)  # moved or cast: nothing cached survives
    assert not adapter._text_cache
    # without the cache a batch is one pipeline call: equal up to rounding, not bitwise
    uncached = SD3Adapter.tiny(seed=0).encode_prompts(PROMPTS)
    pooled = torch.cat([fresh[p]["pooled_prompt_embeds"] for p in PROMPTS])
    assert float((uncached["pooled_prompt_embeds"] - pooled).abs().max()) < 1e-5


# ----------------------------------------------------------------------------- clips as images
def test_the_task_view_judges_clips_frame_by_frame_and_large_images_downsampled():
    task = GenEvalTask(GenEvalConfig(kinds=("position",)))
    examples = task.prompts("train")[:2]
    renders = torch.stack([task.render(e, 0) for e in examples])
    large = torch.nn.functional.interpolate(renders, scale_factor=3, mode="nearest")
    assert TaskView(task, 3).verify(large, examples) == task.verify(renders, examples)
    assert all(r["overall"] for r in task.verify(renders, examples))
    still = renders.unsqueeze(1).repeat(1, 3, 1, 1, 1)
    frames = TaskView(task)
    assert [r["overall"] for r in frames.verify(still, examples)] == [True, True]
    broken = still.clone()
    broken[1, 2] = 0  # the last frame of the second clip is black: nothing in it
    verdicts = frames.verify(broken, examples)
    assert verdicts[0]["overall"] and not verdicts[1]["overall"] and not verdicts[1]["color"]
    assert frames.rewards(broken, examples, mode="all").tolist() == [1.0, 0.0]
    reward = CompressibilityReward()
    per_frame = reward(broken.flatten(0, 1), [e for e in examples for _ in range(3)])
    expected = per_frame.view(2, 3).mean(1)
    assert torch.equal(FrameMeanReward(reward)(broken, examples), expected)
    assert torch.equal(
        FrameMeanReward(reward)(still[:, 0], examples), reward(still[:, 0], examples)
    )


# ----------------------------------------------------------------------------- config errors
def test_config_errors_name_the_field(pipelines, tmp_path):
    def build(**model):
        config = {**grpo_config(tmp_path / "x", {}, "sd3"), "model": model}
        return FlowGRPORecipe(build_config(FlowGRPORecipeConfig, config))

    sd3 = str(pipelines / "sd3")
    with pytest.raises(ConfigError, match=r"model\.kind: .* holds a sd3 pipeline, not flux"):
        build(path=sd3, kind="flux")
    with pytest.raises(ConfigError, match=r"model\.kind: .* built-in flow model directory"):
        build(path=str(lora_free_builtin(tmp_path)), kind="sd3")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"model\.path: .*neither model_index\.json"):
        build(path=str(tmp_path / "empty"))
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"model\.path: .*local"):
        build(path="stabilityai/stable-diffusion-3.5-medium")
    assert time.perf_counter() - start < 2.0
    for height, width in ((24, 24), (32, 16)):  # no multiple of the task's 16 px; not square
        with pytest.raises(ConfigError, match=rf"model\.height / width: .*got {height} × {width}"):
            build(path=sd3, height=height, width=width)
    with pytest.raises(ConfigError, match=r"model\.kind: a wan_i2v pipeline is conditioned"):
        build(path=str(i2v_directory(tmp_path)))
    motion = {"name": "mini-motion", "num_frames": 5, "image_size": 24}
    sft = {"model": {"path": str(i2v_directory(tmp_path)), "max_sequence_length": 16}}
    with pytest.raises(ConfigError, match=r"model\.max_sequence_length: expected 512"):
        FlowSFTRecipe(build_config(FlowSFTRecipeConfig, {**sft, "task": motion}))
    with pytest.raises(ConfigError, match=r"model\.num_frames: applies to kind wan \| wan_i2v"):
        build(path=sd3, num_frames=5)  # detected sd3: refused after reading the directory
    with pytest.raises(ConfigError, match=r"model\.num_frames: applies to kind wan"):
        build_config(FlowGRPORecipeConfig, {"model": {"path": sd3, "kind": "sd3", "num_frames": 5}})
    with pytest.raises(ConfigError, match=r"model\.dtype: applies to pipeline models"):
        build_config(FlowGRPORecipeConfig, {"model": {"kind": "builtin", "dtype": "bfloat16"}})
    with pytest.raises(ConfigError, match=r"activation_checkpointing: applies to pipeline"):
        config = grpo_config(tmp_path / "z", {"path": str(lora_free_builtin(tmp_path))}, "x")
        FlowGRPORecipe(
            build_config(FlowGRPORecipeConfig, {**config, "activation_checkpointing": True})
        )
    with pytest.raises(ConfigError, match=r"ema_decay: not supported for pipeline models"):
        FlowGRPORecipe(
            build_config(
                FlowGRPORecipeConfig,
                {**grpo_config(tmp_path / "y", {"path": sd3}, "sd3"), "ema_decay": 0.9},
            )
        )


def i2v_directory(tmp_path: Path) -> Path:
    """A tiny Wan image-to-video pipeline directory (written once per test directory)."""
    directory = tmp_path / "i2v"
    if not directory.is_dir():
        WanImageToVideoAdapter.tiny(seed=0).save_pretrained(directory)
    return directory


def lora_free_builtin(tmp_path: Path) -> Path:
    """A built-in FlowDiT model directory (weights perturbed off its zero-initialised output,
    so a LoRA on it has a gradient)."""
    torch.manual_seed(0)
    model = perturbed(
        FlowDiT(FlowDiTConfig(image_size=16, patch_size=4, d_model=16, n_layers=1, n_heads=2))
    )
    return save_model(
        tmp_path / "builtin", model, {"task": GenEvalTask(GenEvalConfig(**TASK_SETTINGS)).info()}
    )


def test_flow_grpo_lora_on_a_built_in_model(tmp_path):
    """The same config keys train a LoRA on a saved built-in FlowDiT: ratio 1 and KL 0 at the
    first step, only adapter weights change, the run writes a LoRA model directory (base path
    + adapter) that load_model reads back to the run's final outputs."""
    base_dir = lora_free_builtin(tmp_path)
    out = tmp_path / "run"
    config = grpo_config(out, {"path": str(base_dir), "lora": {"rank": 2}}, "builtin")
    run_cli(
        "flow-grpo",
        {**config, "sampler": {"num_steps": 3, "shift": 1.0, "guidance_scale": 2.0}},
        tmp_path / "c.yaml",
    )
    rows = metrics(out)
    assert rows[1]["flow_grpo/ratio_min"] == 1.0 == rows[1]["flow_grpo/ratio_max"]
    assert rows[1]["flow_grpo/kl"] == 0.0 and rows[2]["flow_grpo/kl"] > 0.0
    stored = safetensors.torch.load_file(
        str(out / "checkpoints" / "step_00000002" / "model.safetensors")
    )
    base = load_model(base_dir).model
    trained = load_model(out / "model").model
    assert json.loads((out / "model" / "config.json").read_text())["base_model"] == str(
        base_dir.resolve()
    )
    assert stored and all(".lora_" in k for k in stored)  # the adapter only
    cond = base.encode_prompts(PROMPTS)
    x = torch.randn(2, *base.latent_shape, generator=torch.Generator().manual_seed(1))
    assert float((velocities(trained, x, cond) - velocities(base, x, cond)).abs().max()) > 1e-5
    with lora_disabled(trained):  # the base weights never changed
        assert torch.equal(velocities(trained, x, cond), velocities(base, x, cond))
