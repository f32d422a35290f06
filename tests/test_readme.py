"""The README stays true for a newcomer.

After the three quickstart modes have run (at tiny sizes, into ``runs/`` of a scratch
directory), every path the README names under a quickstart's output directory exists, every
``diffusion-rl`` command in its code blocks parses (``torchrun ... -m diffusion_rl ...`` too),
every recipe config it names validates with its ``--set`` overrides, and its ``generate`` and
``eval`` commands run as typed and exit 0. Not a timing test.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from diffusion_rl import cli, config
from diffusion_rl.quickstart import run_quickstart, run_quickstart_image, run_quickstart_workflow

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
CONFIG_CLASSES = {name: getattr(config, entry[0]) for name, entry in cli.RECIPES.items()}

TEXT_TINY = {
    "sft.model": {"d_model": 32, "n_layers": 1, "n_heads": 2},
    "sft.batch_size": 8,
    "sft.eval_examples": 8,
    "grpo.prompts_per_step": 2,
    "grpo.group_size": 4,
    "grpo.eval_examples": 8,
}
IMAGE_TINY = {
    "sft.model": {"patch_size": 4, "d_model": 32, "n_layers": 1, "n_heads": 2},
    "sft.sampler": {"num_steps": 4},
    "sft.batch_size": 8,
    "sft.eval_samples_per_prompt": 1,
    "sft.grid_images": 4,
    "rl.sampler": {"num_steps": 4, "guidance_scale": 1.0, "mode": "ode"},
    "rl.prompts_per_step": 2,
    "rl.group_size": 4,
    "rl.grid_images": 4,
    "rl.policy": {"algorithm": "awm", "timesteps_per_sample": 2},
}
WORKFLOW_TINY = {
    **{
        f"{s}.model": {"d_model": 32, "n_layers": 1, "n_heads": 2}
        for s in ("image_sft", "video_sft")
    },
    **{f"{s}.sampler.num_steps": 3 for s in ("image_sft", "video_sft")},
    "workflow_rl.prompts_per_step": 1,
    "workflow_rl.group_size": 2,
    "workflow_rl.eval_samples_per_prompt": 1,
    "workflow_rl.preview_clips": 2,
}


def _sets(tiny: dict) -> list[str]:
    return [f"{key}={json.dumps(value)}" for key, value in tiny.items()]


def _readme_commands() -> list[list[str]]:
    """The argv (after the program name) of every command line in the README's bash blocks."""
    blocks = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    commands = []
    for line in (line for block in blocks for line in block.splitlines()):
        line = line.split("  #")[0].strip()
        words = shlex.split(line)
        if words[:1] == ["diffusion-rl"]:
            commands.append(words[1:])
        elif words[:1] == ["torchrun"]:
            commands.append(words[words.index("diffusion_rl") + 1 :])
    return commands


@pytest.fixture(scope="module")
def quickstarts(tmp_path_factory):
    """The three quickstarts, tiny, at their default output directories under a scratch
    directory (which also links ``configs/``)."""
    home = tmp_path_factory.mktemp("newcomer")
    (home / "configs").symlink_to(ROOT / "configs")
    run_quickstart(str(home / "runs/quickstart"), steps=2, rl_steps=1, overrides=_sets(TEXT_TINY))
    run_quickstart_image(
        str(home / "runs/quickstart_image"), steps=2, rl_steps=1, overrides=_sets(IMAGE_TINY)
    )
    run_quickstart_workflow(
        str(home / "runs/quickstart_workflow"),
        steps=2,
        rl_steps=1,
        overrides=_sets(WORKFLOW_TINY),
    )
    return home


def test_every_quickstart_path_the_readme_names_exists(quickstarts):
    paths = set(re.findall(r"runs/quickstart\w*(?:/[\w.\-]+)*", README))
    assert {"runs/quickstart/grpo/model", "runs/quickstart_image/rl/model"} <= paths
    missing = sorted(p for p in paths if not (quickstarts / p).exists())
    assert not missing, f"the README names paths no quickstart writes: {missing}"


def test_every_readme_command_parses_and_generate_and_eval_run_as_typed(
    quickstarts, monkeypatch, capsys
):
    monkeypatch.chdir(quickstarts)
    commands = _readme_commands()
    ran = set()
    for argv in commands:
        args = cli.build_parser().parse_args(argv)  # exits (SystemExit) on a bad flag
        if args.command in cli.RECIPES:  # its config (or the defaults) and --set validate
            loaded = config.load_config(args.config, CONFIG_CLASSES[args.command], args.set)
            assert loaded.steps >= 1
        if args.command in ("generate", "eval"):
            assert cli.main(argv) == 0, (argv, capsys.readouterr().err)
            ran.add(args.command)
    assert ran == {"generate", "eval"} and len(commands) >= 12
    assert (quickstarts / "grid.png").is_file() and (quickstarts / "clips.gif").is_file()
