"""The ``diffusion-rl`` command line: every bad flag value is one line naming the flag, help
covers every flag, ``--version``, ``--print-config``, ``--output`` formats, exit statuses;
what it answers without importing torch; the sampler's block size from the model."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from flow_toy import one_thread  # noqa: F401 (fixture: one CPU thread per module)
from PIL import Image

from diffusion_rl import cli, config, quickstart
from diffusion_rl.models import CharTokenizer, FlowDiT, FlowDiTConfig, save_model
from diffusion_rl.recipes.run import NonFiniteParametersError, RunInterrupted
from diffusion_rl.tasks.geneval import GenEvalConfig, GenEvalTask
from diffusion_rl.train.checkpoint import CheckpointCorruptError

CHARS = "0123456789+-="
PROMPT = "a red circle on the left"
MAX_SEED = 2**63 - 1


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """A tiny token model (max_seq_len 48, blocks of 4, fixed schedule) and a tiny image model
    (16 px, 2 ODE steps recorded), saved as model directories."""
    root = tmp_path_factory.mktemp("models")
    info = {"task": {"name": "arithmetic", "num_digits": 1}, "sampler": {"generation_length": 4}}
    token = save_model(root / "tok", tiny_model(), info, CharTokenizer(CHARS))
    torch.manual_seed(0)
    task = GenEvalTask(GenEvalConfig(image_size=16, seed=3)).info()
    flow_config = FlowDiTConfig(
        image_size=16, patch_size=4, d_model=32, n_layers=1, n_heads=4, task=task
    )
    flow = save_model(root / "flow", FlowDiT(flow_config), {"sampler": {"num_steps": 2}})
    # a block-causal model built for blocks of 8 whose directory records no sampler
    block8 = save_model(
        root / "tok8", tiny_model(block=8), {"task": info["task"]}, CharTokenizer(CHARS)
    )
    broken = root / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    huge = root / "huge"
    huge.mkdir()
    (huge / "config.json").write_text(
        json.dumps(
            {
                "model_type": "diffusion_rl.transformer",
                "vocab_size": 16,
                "mask_token_id": 1,
                "d_model": 2**31,
            }
        )  # fmt: skip
    )
    return {
        "T": str(token),
        "F": str(flow),
        "broken": str(broken),
        "huge": str(huge),
        "T8": str(block8),
    }


def _one_line_error(capsys, argv: list[str], code: int = 2) -> str:
    """Run ``main(argv)``; assert the exit status and a single stderr line, no traceback."""
    status = cli.main(argv)
    out, err = capsys.readouterr()
    assert status == code, (status, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith(f"diffusion-rl {argv[0]}: error: ") or lines[0].startswith(
        "diffusion-rl: error: "
    )
    return lines[0]


T, F = "T", "F"  # resolved to the fixture's model directories
LONG_PROMPT = "1" * 60  # more than the token model's 48 positions

BAD_FLAGS = [
    # generate, token model: sampler flags (parse-time ranges, then the sampler's own checks)
    (["generate", T, "--steps-per-block", "0"], "--steps-per-block: must be >= 1 (got 0)"),
    (
        ["generate", T, "--steps-per-block", "8"],
        "--steps-per-block: the fixed schedule commits >= 1 slot per step, so it must be <= "
        "block_size=4, got 8",
    ),
    (["generate", T, "--steps-per-block", "x"], "--steps-per-block: expected an integer, got 'x'"),
    (["generate", T, "--threshold", "2"], "--threshold: must be <= 1 (got 2)"),
    (["generate", T, "--threshold", "0"], "--threshold: must be > 0 (got 0)"),
    (["generate", T, "--threshold", "nan"], "--threshold: must be a finite number (got nan)"),
    (["generate", T, "--temperature", "-1"], "--temperature: must be >= 0 (got -1)"),
    (["generate", T, "--temperature", "inf"], "--temperature: must be a finite number (got inf)"),
    (["generate", T, "--temperature", "1e9"], "--temperature: must be <= 100 (got 1e9)"),
    (["generate", T, "--temperature", "hot"], "--temperature: expected a number, got 'hot'"),
    (["generate", T, "--confidence", "best"], "--confidence: invalid choice: 'best'"),
    (["generate", T, "--schedule", "random"], "--schedule: invalid choice: 'random'"),
    (
        ["generate", T, "--threshold", "0.5"],
        "--threshold: used only by the threshold schedule; the sampler here uses schedule "
        "'fixed' (add --schedule threshold)",
    ),
    (
        ["generate", T, "--schedule", "threshold", "--steps-per-block", "2"],
        "--steps-per-block: used only by the fixed schedule",
    ),
    # generate, token model: length, prompt, seed
    (["generate", T, "--length", "-3"], "--length: must be >= 1 (got -3)"),
    (["generate", T, "--length", "0"], "--length: must be >= 1 (got 0)"),
    (["generate", T, "--length", str(10**9)], "--length: must be <= 1048576 (got 1000000000)"),
    (["generate", T, "--length", "4.5"], "--length: expected an integer, got '4.5'"),
    (
        ["generate", T, "--length", "100"],
        "--length: a prompt of 4 tokens plus --length 100 generated tokens exceeds the model's "
        "max_seq_len=48; use --length <= 44",
    ),
    (["generate", T, "--prompt", ""], "--prompt: must not be empty"),
    (["generate", T, "--prompt", "   "], "--prompt: must not be empty"),
    (["generate", T, "--prompt", "abc"], "--prompt: unknown character 'a' at position 0"),
    (
        ["generate", T, "--prompt", LONG_PROMPT],
        "--prompt: 60 tokens leave no room to generate within the model's max_seq_len=48",
    ),
    (["generate", T, "--prompt", "1" * 10_001], "--prompt: 10001 characters, more than the limit"),
    (["generate", T, "--seed", "-1"], "--seed: must be >= 0 (got -1)"),
    (["generate", T, "--seed", str(2**63)], f"--seed: must be <= {MAX_SEED} (got {2**63})"),
    (["generate", T, "--seed", "abc"], "--seed: expected an integer, got 'abc'"),
    (
        ["generate", T, "--seed", str(MAX_SEED), "--prompt", "2+2="],
        f"--seed: rows use seeds --seed ... --seed + 1, which must stay <= {MAX_SEED}",
    ),
    # generate, token model: flags of the other kind, outputs
    (["generate", T, "--guidance", "2"], "--guidance: applies to image models; {T} is a token"),
    (["generate", T, "--num-steps", "4"], "--num-steps: applies to image models"),
    (["generate", T, "--samples", "2"], "--samples: applies to image models"),
    (
        ["generate", T, "--output", "x.png"],
        "--output: x.png: a token model's completions are written as .json, .txt, got '.png'",
    ),
    (
        ["generate", T, "--output", "x.gif"],
        "--output: x.gif: a token model's completions are written as .json, .txt, got '.gif'",
    ),
    (
        ["generate", T, "--output", "x.bmp"],
        "--output: x.bmp has extension '.bmp'; supported: .png, .jpg, .jpeg, .webp, .json, "
        ".txt, .gif, .safetensors",
    ),
    (["generate", T, "--output", "out"], "--output: out has no extension; supported: .png"),
    (["generate", T, "--trace", "t.txt"], "--trace: t.txt has extension '.txt'; supported: .json"),
    # generate, image model
    (["generate", F, "--length", "3"], "--length: applies to token models; {F} is an image"),
    (["generate", F, "--steps-per-block", "2"], "--steps-per-block: applies to token models"),
    (["generate", F, "--temperature", "0.5"], "--temperature: applies to token models"),
    (["generate", F, "--trace", "t.json"], "--trace: applies to token models"),
    (["generate", F, "--confidence", "margin"], "--confidence: applies to token models"),
    (["generate", F, "--schedule", "threshold"], "--schedule: applies to token models"),
    (["generate", F, "--guidance", "nan"], "--guidance: must be a finite number (got nan)"),
    (["generate", F, "--guidance", "-1"], "--guidance: must be >= 0 (got -1)"),
    (["generate", F, "--guidance", "1e6"], "--guidance: must be <= 100 (got 1e6)"),
    (["generate", F, "--num-steps", "0"], "--num-steps: must be >= 1 (got 0)"),
    (["generate", F, "--num-steps", str(10**6)], "--num-steps: must be <= 10000 (got 1000000)"),
    (["generate", F, "--samples", "0"], "--samples: must be >= 1 (got 0)"),
    (["generate", F, "--samples", "5000"], "--samples: must be <= 4096 (got 5000)"),
    (
        ["generate", F, "--samples", "2000", "--prompt", PROMPT, "--prompt", PROMPT],
        "--samples: 2000 x 3 prompts = 6000 images, more than the limit 4096",
    ),
    (
        ["generate", F, "--prompt", "a purple circle"],
        "--prompt: prompt 1 'a purple circle' has words ['purple'] outside the model's vocabulary",
    ),
    (
        ["generate", F, "--prompt", "a red circle on the left on the top"],
        "--prompt: prompt 1 'a red circle on the left on the top' has 9 words, more than "
        "max_prompt_tokens=8",
    ),
    (
        ["generate", F, "--output", "g.json"],
        "--output: g.json: an image model's grid is written as .png, .jpg, .jpeg, .webp",
    ),
    (["generate", F, "--output", "g.bmp"], "--output: g.bmp has extension '.bmp'"),
    # generate: the model directory
    (["generate", "--model", "/nonexistent/m", "--prompt", "1+2="], "--model: model directory"),
    (
        ["generate", "broken", "--prompt", "1+2="],
        "--model: {broken}/config.json:1:2: not valid JSON",
    ),
    (
        ["generate", "huge", "--prompt", "1+2="],
        "--model: {huge}/config.json: d_model=2147483648 exceeds the limit 65536",
    ),
    (["generate", "--prompt", "1+2="], "one of the arguments --model --workflow is required"),
    (["generate", T, "--promt", "x"], "unrecognized arguments: --promt x"),
    # eval
    (["eval", T, "--examples", "-5"], "--examples: must be >= 1 (got -5)"),
    (["eval", T, "--examples", "0"], "--examples: must be >= 1 (got 0)"),
    (["eval", T, "--examples", str(10**7)], "--examples: must be <= 1000000 (got 10000000)"),
    (["eval", T, "--examples", "many"], "--examples: expected an integer, got 'many'"),
    (["eval", T, "--samples", "0"], "--samples: must be >= 1 (got 0)"),
    (["eval", T, "--samples", "4"], "--samples: applies to image models"),
    (["eval", T, "--guidance", "3"], "--guidance: applies to image models"),
    (["eval", T, "--split", "test"], "--split: invalid choice: 'test'"),
    (["eval", T, "--seed", "-1"], "--seed: must be >= 0 (got -1)"),
    (["eval", T, "--seed", str(MAX_SEED - 10)], "--seed: rows use seeds --seed ... --seed + 255"),
    (["eval", T, "--output", "e.txt"], "--output: e.txt has extension '.txt'; supported: .json"),
    (["eval", T, "--threshold", "1.5"], "--threshold: must be <= 1 (got 1.5)"),
    (["eval", F, "--examples", "3"], "--examples: applies to token models"),
    (["eval", F, "--samples", "0"], "--samples: must be >= 1 (got 0)"),
    (["eval", F, "--threshold", "0.5"], "--threshold: applies to token models"),
    (["eval", F, "--num-steps", "-2"], "--num-steps: must be >= 1 (got -2)"),
    # quickstart
    (["quickstart", "--steps", "0"], "--steps: must be >= 1 (got 0)"),
    (["quickstart", "--rl-steps", "-1"], "--rl-steps: must be >= 1 (got -1)"),
    (["quickstart", "--threads", "0"], "--threads: must be >= 1 (got 0)"),
    (["quickstart", "--threads", "5000"], "--threads: must be <= 1024 (got 5000)"),
    (["quickstart", "--mode", "video"], "--mode: invalid choice: 'video'"),
    (["quickstart", "--seed", "-1"], "--seed: must be >= 0 (got -1)"),
    (["quickstart", "--output-dir", ""], "--output-dir: must not be empty"),
    (["quickstart", "--set", "steps"], "--set: expected KEY=VALUE (e.g. steps=100), got 'steps'"),
    # recipe commands
    (["sft", "--config", "missing.yaml"], "--config: config file missing.yaml does not exist"),
    (["sft", "--set", "=3"], "--set: expected KEY=VALUE"),
    (
        ["flow-grpo"],
        "model.path: model directory runs/flow_sft/model does not exist; `diffusion-rl "
        "flow-sft --config configs/flow_sft_geneval.yaml` writes runs/flow_sft/model",
    ),
    (
        ["grpo", "--set", "model.path=/nonexistent/m"],
        "model.path: model directory /nonexistent/m does not exist; `diffusion-rl quickstart`",
    ),
    (["distill", "--set", "student.path={T}", "--set", "teacher.path=/no/t"], "teacher.path:"),
    (["frobnicate"], "COMMAND: invalid choice: 'frobnicate'"),
]


def _resolve(argv: list[str], models: dict[str, str]) -> list[str]:
    """``T`` / ``F`` / ``broken`` / ``huge`` after the command → ``--model DIR``; a default
    prompt for ``generate``; ``{T}`` placeholders filled."""
    out = [argv[0]]
    rest = argv[1:]
    if rest and rest[0] in models:
        out += ["--model", models[rest[0]]]
        rest = rest[1:]
        if argv[0] == "generate":
            out += ["--prompt", "1+2=" if argv[1] != F else PROMPT]
    return out + [arg.format(**models) for arg in rest]


@pytest.mark.parametrize(("argv", "message"), BAD_FLAGS)
def test_a_bad_flag_is_one_line_naming_it(capsys, models, tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)  # the recipes' default model paths do not exist here
    line = _one_line_error(capsys, _resolve(argv, models))
    assert message.format(**models) in line
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # refused before any output


def test_the_bad_flag_cases_are_many_and_distinct():
    assert len(BAD_FLAGS) >= 40
    assert len({tuple(argv) for argv, _ in BAD_FLAGS}) == len(BAD_FLAGS)


def test_kind_flag_tables_cover_every_serving_flag():
    """Every flag of generate / eval is either shared or listed as one kind's."""
    shared = {"help", "model", "workflow", "prompt", "seed", "output", "split"}
    for name in ("generate", "eval"):
        sub = _subparsers(cli.build_parser())[name]
        dests = {a.dest for a in sub._actions}
        assert dests - shared <= set(cli.TOKEN_ONLY) | set(cli.IMAGE_ONLY)
        assert not set(cli.TOKEN_ONLY) & set(cli.IMAGE_ONLY)


# ----------------------------------------------------------------------------- help
def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def undocumented(parser: argparse.ArgumentParser, name: str = "diffusion-rl") -> list[str]:
    """Every action of ``parser`` and its subcommands (recursively) without help text."""
    missing = []
    for action in parser._actions:
        if not (action.help or "").strip() or action.help == argparse.SUPPRESS:
            missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
        if isinstance(action, argparse._SubParsersAction):
            documented = {a.dest for a in action._choices_actions if (a.help or "").strip()}
            missing += [f"{name} {c}" for c in action.choices if c not in documented]
    for command, sub in _subparsers(parser).items():
        missing += undocumented(sub, f"{name} {command}")
    return missing


def test_every_flag_of_every_command_has_help():
    parser = cli.build_parser()
    assert set(_subparsers(parser)) == {
        "quickstart", "sft", "grpo", "distill", "flow-sft", "flow-grpo", "workflow-rl",
        "generate", "eval", "export", "serve", "verify",
    }  # fmt: skip
    assert undocumented(parser) == []
    # the walk finds what is missing: a flag, a subcommand without help
    bad = argparse.ArgumentParser(prog="p")
    bad.add_argument("--documented", help="yes")
    bad.add_argument("--bare")
    sub = bad.add_subparsers(dest="command", help="commands")
    sub.add_parser("silent").add_argument("--also-bare", help="  ")
    assert undocumented(bad, "p") == ["p --bare", "p silent", "p silent --also-bare"]


def test_help_shows_every_default(capsys):
    parser, shown = cli.build_parser(), []
    for name, sub in _subparsers(parser).items():
        text = " ".join(sub.format_help().split())
        for action in sub._actions:
            unset = any(action.default is none for none in (None, False, argparse.SUPPRESS))
            if action.option_strings and not unset:  # 0 is a default to show
                assert f"(default: {action.default})" in text, (name, action.dest)
                shown.append(action.dest)
    assert sorted(set(shown)) == ["mode", "seed", "split"]
    assert cli.main(["generate", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--seed SEED row i uses seed + i, in [0, 9223372036854775807] (default: 0)" in text
    assert "--steps-per-block STEPS_PER_BLOCK denoising steps per block" in text


def test_the_description_is_one_plain_paragraph():
    text = cli.build_parser().description
    assert text == cli.DESCRIPTION and "\n" not in text
    assert "``" not in text and "::" not in text and not text.startswith("diffusion-rl ")
    assert len(text.split(". ")) >= 3  # sentences, not a usage listing


def test_quickstart_help_describes_both_modes(capsys):
    assert cli.main(["quickstart", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "text: SFT -> GRPO" in text and "image: flow SFT -> AWM" in text
    assert "workflow: SFT of both stages -> workflow RL" not in text  # the summary is the list's
    assert "OUT/rl/model" in text and "OUT/grpo/model" in text
    assert "OUT/workflow_rl/model/workflow.yaml" in text
    image_sft, video_sft = quickstart.QUICKSTART_WORKFLOW_SFT_STEPS
    assert video_sft == cli.flags.QUICKSTART_WORKFLOW_VIDEO_SFT_STEPS
    assert {
        "text": (quickstart.QUICKSTART_SFT_STEPS, quickstart.QUICKSTART_GRPO_STEPS),
        "image": (quickstart.QUICKSTART_IMAGE_SFT_STEPS, quickstart.QUICKSTART_IMAGE_RL_STEPS),
        "workflow": (image_sft, quickstart.QUICKSTART_WORKFLOW_RL_STEPS),
    } == cli.QUICKSTART_STEPS
    assert (
        "(default: at most 400, stopped at 15 % held-out accuracy; image: 5000; workflow: 1000 "
        "image and 2000 video SFT steps, --steps sets both)" in text
    )
    assert "(default: 80; image: 100; workflow: 120)" in text
    assert "seed of every stage" in text


# ----------------------------------------------------------------------------- version
def test_version_is_the_package_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"diffusion-rl {version('diffusion-rl')}\n"


def test_the_installed_entry_point_prints_the_version():
    exe = shutil.which("diffusion-rl", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("the diffusion-rl entry point is not installed next to this interpreter")
    done = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == f"diffusion-rl {version('diffusion-rl')}\n"


# ----------------------------------------------------------------------------- start-up
# What the command line answers without importing torch (a fresh interpreter: the test
# process has torch already). benchmarks/cli_start.py measures the CPU time of each.
_NO_TORCH = """
import contextlib, io, json, sys
import diffusion_rl, diffusion_rl.cli, diffusion_rl.models.loading, diffusion_rl.config.loading
from diffusion_rl.cli import main
assert "torch" not in sys.modules, "importing the command line imported torch"
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit_:
            code = exit_.code
    results.append([code, out.getvalue(), err.getvalue(), "torch" in sys.modules])
print(json.dumps(results))
"""


def test_version_help_hub_ids_and_bad_config_files_need_no_torch(tmp_path):
    commands = sorted(_subparsers(cli.build_parser()))
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("steps: [1, 2\n")
    deep = tmp_path / "deep.yaml"
    deep.write_text("steps: " + "[" * 100_000 + "]" * 100_000 + "\n")
    cases = [
        ["--version"],
        ["--help"],
        *[[name, "--help"] for name in commands],
        ["generate", "--model", "org/name", "--prompt", "1+2="],
        ["eval", "--model", "hf://org/name"],
        ["sft", "--config", str(bad_yaml)],
        ["sft", "--config", str(deep)],
        ["grpo", "--set", "steps=" + "[" * 30_000],
    ]
    done = subprocess.run(
        [sys.executable, "-c", _NO_TORCH, json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,  # no org/name directory here
    )
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    for argv, (code, out, err, torch_imported) in zip(cases, results):
        assert not torch_imported, argv
        if "--help" in argv or argv == ["--version"]:
            assert code == 0 and out and not err, argv
            continue
        assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, (argv, err)
    help_text = dict(zip(map(tuple, cases), results))
    assert "--block-size BLOCK_SIZE" in help_text[("generate", "--help")][1]  # complete help
    assert "default: 256" in help_text[("eval", "--help")][1]
    *_, hub, hub_eval, syntax, nested, override = results
    assert hub[2] == (
        "diffusion-rl generate: error: --model: 'org/name' is not a local directory and looks "
        "like a Hugging Face Hub id; nothing is downloaded. Pass a local directory: fetch it "
        "first with `hf download org/name --local-dir DIR` (on a machine with network access) "
        "and set --model to DIR\n"
    )
    assert hub_eval[2].startswith("diffusion-rl eval: error: --model: 'hf://org/name' is not")
    assert syntax[2].startswith(f"diffusion-rl sft: error: {bad_yaml}:2:1: ")
    assert nested[2] == (
        f"diffusion-rl sft: error: {deep}:1:41: nested deeper than 32 levels of mappings and "
        "lists\n"
    )
    assert override[2].startswith("diffusion-rl grpo: error: --set 'steps=[[[[[[[[[[[[[[[")
    assert "nested deeper than 32 levels" in override[2] and len(override[2]) < 300


def test_the_constants_help_shows_without_torch_agree_with_their_sources():
    from diffusion_rl.cli import export
    from diffusion_rl.models import io, lora
    from diffusion_rl.sampling import TokenSamplerConfig

    assert (export.CONFIG_FILE, export.INFO_FILE) == (io.CONFIG_FILE, io.INFO_FILE)
    assert export.ADAPTER_FILE == lora.ADAPTER_FILE
    assert TokenSamplerConfig().block_size == cli.flags.DEFAULT_BLOCK_SIZE
    assert config.LIMITS["block_size"] == cli.flags.MAX_BLOCK_SIZE


def test_cli_start_benchmark_reports_every_case(tmp_path):
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "cli_start.py"), "--reps", "1"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = json.loads(done.stdout.strip().splitlines()[-1])  # no timing asserted here
    assert set(report["cases"]) >= {"--version", "--help", "sft --help", "eval --model org/name"}
    assert report["any_imports_torch"] is False
    assert all(
        case["exit"] == (2 if "org/name" in name else 0) for name, case in report["cases"].items()
    )


# ----------------------------------------------------------------------------- print-config
CONFIG_CLASSES = {name: getattr(config, entry[0]) for name, entry in cli.RECIPES.items()}


@pytest.mark.parametrize(
    ("command", "config_file"),
    [
        ("sft", None),
        ("sft", "configs/sft_arithmetic.yaml"),
        ("grpo", "configs/grpo_arithmetic.yaml"),
        ("distill", "configs/distill_arithmetic.yaml"),
        ("flow-sft", "configs/flow_sft_geneval.yaml"),
        ("flow-grpo", None),
    ],
)
def test_print_config_prints_the_effective_config(capsys, tmp_path, command, config_file):
    root = Path(__file__).resolve().parents[1]
    path = None if config_file is None else str(root / config_file)
    overrides = ["steps=7", "seed=3", f"output_dir={tmp_path / 'run'}"]
    argv = [command, *(["--config", path] if path else [])]
    argv += [arg for item in overrides for arg in ("--set", item)] + ["--print-config"]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert err == ""
    printed = tmp_path / "printed.yaml"
    printed.write_text(out)
    cls = CONFIG_CLASSES[command]
    expected = config.load_config(path, cls, overrides)
    again = config.load_config(printed, cls)
    assert again == expected and again.steps == 7 and again.seed == 3
    assert not (tmp_path / "run").exists()  # printed, not run


# ----------------------------------------------------------------------------- outputs
def test_token_generate_writes_json_and_txt(capsys, models, tmp_path):
    argv = ["generate", "--model", models[T], "--prompt", "1+2=", "--prompt", "7+8="]
    assert cli.main([*argv, "--output", str(tmp_path / "out" / "c.json")]) == 0
    printed = capsys.readouterr().out.splitlines()
    record = json.loads((tmp_path / "out" / "c.json").read_text())
    rows = record["samples"]
    assert [r["prompt"] + r["completion"] for r in rows] == printed
    assert [r["seed"] for r in rows] == [0, 1]
    assert record["sampler"]["generation_length"] == 4
    assert cli.main([*argv, "--output", str(tmp_path / "c.txt")]) == 0
    assert (
        (tmp_path / "c.txt").read_text().splitlines()
        == printed
        == capsys.readouterr().out.splitlines()
    )


@pytest.mark.parametrize(("name", "fmt"), [("g.png", "PNG"), ("g.JPG", "JPEG"), ("g.webp", "WEBP")])
def test_image_generate_writes_the_format_its_extension_names(capsys, models, tmp_path, name, fmt):
    target = tmp_path / name
    argv = ["generate", "--model", models[F], "--prompt", PROMPT, "--samples", "2"]
    assert cli.main([*argv, "--output", str(target)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"grid written to {target}"
    with Image.open(target) as image:
        assert image.format == fmt and image.mode == "RGB"
        size = image.size
    assert cli.main([*argv, "--output", str(tmp_path / "ref.png")]) == 0
    with Image.open(tmp_path / "ref.png") as reference:
        assert reference.size == size  # the same grid, another encoding
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({name, "ref.png"})


def test_eval_writes_json(capsys, models, tmp_path):
    target = tmp_path / "e.json"
    assert cli.main(["eval", "--model", models[T], "--examples", "3", "--output", str(target)]) == 0
    record = json.loads(target.read_text())
    assert record["num_examples"] == 3
    assert f"accuracy {record['accuracy']:.3f} on 3 eval problems" in capsys.readouterr().out


# ----------------------------------------------------------------------------- exit statuses
def test_a_failed_run_leaves_no_empty_output_directory(capsys, models, tmp_path):
    out = tmp_path / "a" / "b"
    argv = ["grpo", "--set", f"model.path={models[F]}", "--set", f"output_dir={out}"]
    line = _one_line_error(capsys, argv)
    assert f"model.path: {models[F]} holds a flow model; this recipe needs a token model" in line
    assert list(tmp_path.iterdir()) == []  # a/b was created by the run loop, then removed


def _failing_run(monkeypatch, error: BaseException) -> None:
    from diffusion_rl.recipes import run as run_module

    def run(config, recipe):
        Path(config.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(config.output_dir) / "metrics.jsonl").write_text("{}\n")
        raise error

    monkeypatch.setattr(run_module, "run", run)


@pytest.mark.parametrize(
    ("make_error", "status", "message"),
    [
        (
            lambda: CheckpointCorruptError("ck/step_5", "optimizer.pt", "content hash mismatch"),
            1,
            "checkpoint ck/step_5: optimizer.pt: content hash mismatch",
        ),
        (lambda: NonFiniteParametersError("blocks.0.w: NaN"), 1, "blocks.0.w: NaN"),
        (
            lambda: OSError(28, "No space left on device"),
            1,
            "disk full: [Errno 28] No space left on device; free space on that disk, then run it "
            "again",
        ),
        (
            lambda: RuntimeError(
                "[enforce fail at inline_container.cc:672] . unexpected pos 7 vs 5"
            ),
            1,
            "disk full: [enforce fail at inline_container.cc:672] . unexpected pos 7 vs 5; free "
            "space on that disk, then run it again",
        ),
        (
            lambda: __import__("safetensors").SafetensorError(
                "Error while serializing: I/O error: No space left on device (os error 28)"
            ),
            1,
            "disk full: Error while serializing: I/O error: No space left on device (os error "
            "28); free space on that disk, then run it again",
        ),
        (lambda: config.ConfigError("optim.lr: must be finite"), 2, "optim.lr: must be finite"),
        (lambda: ValueError("task.name: unknown task"), 2, "task.name: unknown task"),
    ],
)
def test_run_errors_are_one_line_with_their_status(
    capsys, monkeypatch, tmp_path, make_error, status, message
):
    _failing_run(monkeypatch, make_error())
    argv = ["sft", "--set", f"output_dir={tmp_path / 'run'}"]
    assert _one_line_error(capsys, argv, status) == f"diffusion-rl sft: error: {message}"
    assert (tmp_path / "run" / "metrics.jsonl").is_file()  # a non-empty directory is kept


def test_interrupt_bug_and_debug(capsys, monkeypatch, tmp_path):
    argv = ["sft", "--set", f"output_dir={tmp_path / 'run'}"]
    _failing_run(monkeypatch, KeyboardInterrupt())
    assert cli.main(argv) == 130
    assert capsys.readouterr().err == "diffusion-rl sft: interrupted\n"
    _failing_run(monkeypatch, RunInterrupted("checkpoint step 7 written; rerun to resume"))
    assert cli.main(argv) == 130
    assert capsys.readouterr().err == (
        "diffusion-rl sft: interrupted: checkpoint step 7 written; rerun to resume\n"
    )
    _failing_run(monkeypatch, RuntimeError("a bug"))  # not a user error: the traceback shows
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(argv)
    _failing_run(monkeypatch, ValueError("bad value"))
    with pytest.raises(ValueError, match="bad value"):
        cli.main(["--debug", *argv])
    monkeypatch.setenv("DIFFUSION_RL_DEBUG", "1")
    with pytest.raises(ValueError, match="bad value"):
        cli.main(argv)


def test_interrupt_messages_are_said_once_with_the_signals_status(capsys, monkeypatch, tmp_path):
    argv = ["sft", "--set", f"output_dir={tmp_path / 'run'}"]
    said = "interrupted: checkpoint of step 3 written to ck/step_00000003; run it again"
    _failing_run(monkeypatch, RunInterrupted(said))
    assert cli.main(argv) == 130
    assert (
        capsys.readouterr().err == f"diffusion-rl sft: {said}\n"
    )  # not "interrupted: interrupted:"
    said = "interrupted (SIGTERM): checkpoint of step 3 written to ck/step_00000003"
    _failing_run(monkeypatch, RunInterrupted(said, signal.SIGTERM))
    assert cli.main(argv) == 143
    assert capsys.readouterr().err == f"diffusion-rl sft: {said}\n"
    monkeypatch.setenv("RANK", "1")  # under torchrun, rank 0 speaks for the run
    assert cli.main(argv) == 143
    assert capsys.readouterr().err == ""


def test_a_config_that_is_no_regular_file_is_named_for_what_it_is(capsys, tmp_path):
    fifo = tmp_path / "config.fifo"
    os.mkfifo(fifo)  # never opened: that would block until a writer comes
    for path, what in (
        (tmp_path, "is a directory, not a regular file"),
        (fifo, "is a FIFO (named pipe), not a regular file"),
        (tmp_path / "missing.yaml", "does not exist"),
    ):
        line = _one_line_error(capsys, ["sft", "--config", str(path)])
        assert f"--config: config file {path} {what}; expected a YAML file" in line


def test_the_default_block_size_is_a_block_causal_models_own(capsys, models, tmp_path):
    """A block-causal model built for blocks of 8 whose directory records no sampler: the
    sampler's block size is the model's (not the default 4), --block-size must equal it."""
    argv = ["generate", "--model", models["T8"], "--prompt", "1+2=", "--length", "8"]
    assert cli.main([*argv, "--output", str(tmp_path / "c.json")]) == 0
    sampler = json.loads((tmp_path / "c.json").read_text())["sampler"]
    assert (sampler["block_size"], sampler["steps_per_block"]) == (8, 4)
    assert cli.main([*argv, "--block-size", "8", "--steps-per-block", "8"]) == 0
    capsys.readouterr()
    line = _one_line_error(capsys, [*argv, "--block-size", "4"])
    assert line == (
        "diffusion-rl generate: error: --block-size: this block-causal model was built for "
        "blocks of 8, got 4; omit --block-size (the model's is the default)"
    )
    assert cli.main(["eval", "--model", models["T8"], "--examples", "2"]) == 0
    # a model that decodes blocks of any size takes --block-size; steps follow a small block
    bidirectional = save_model(
        tmp_path / "bi",
        tiny_model("bidirectional"),
        {"task": {"name": "arithmetic"}},
        CharTokenizer(CHARS),
    )
    out = tmp_path / "bi.json"
    bi = ["generate", "--model", str(bidirectional), "--prompt", "1+2=", "--output", str(out)]
    assert cli.main([*bi, "--block-size", "2", "--length", "6"]) == 0
    sampler = json.loads(out.read_text())["sampler"]
    assert (sampler["block_size"], sampler["steps_per_block"]) == (2, 2)
    capsys.readouterr()
    line = _one_line_error(capsys, [*bi, "--block-size", "0"])
    assert "--block-size: must be >= 1 (got 0)" in line


SDAR_FIXTURE = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "hf_dllm" / "sdar"


def test_an_sdar_model_with_blocks_of_8_and_no_info_file_generates(capsys, tmp_path):
    if not (SDAR_FIXTURE / "config.json").is_file():
        pytest.skip(f"{SDAR_FIXTURE}: ../shared/fixtures absent (CI has it)")
    model = tmp_path / "sdar8"
    shutil.copytree(SDAR_FIXTURE, model)
    settings = json.loads((model / "config.json").read_text())
    assert settings["block_size"] != 8 and not (model / "diffusion_rl.json").exists()
    (model / "config.json").write_text(json.dumps({**settings, "block_size": 8}))
    out = tmp_path / "c.json"
    argv = ["generate", "--model", str(model), "--prompt", "hi", "--length", "8"]
    assert cli.main([*argv, "--output", str(out)]) == 0, capsys.readouterr().err
    assert json.loads(out.read_text())["sampler"]["block_size"] == 8
    capsys.readouterr()
    line = _one_line_error(capsys, [*argv, "--block-size", "4"])
    assert "--block-size: this block-causal model was built for blocks of 8, got 4" in line
