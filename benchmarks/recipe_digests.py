"""Final-weight digests of every recipe on tiny fixed-seed runs, as JSON.

A structural change that is meant to preserve behaviour (a refactor of the learner, the
rollout collector or the run loop) must leave every digest unchanged: run this before and
after, and compare. Each run is a few seconds on one CPU thread; the whole script well under a
minute. The runs cover SFT, the text quickstart (SFT → GRPO), GRPO with μ = 2 and micro-batches,
DAPO with packed replay and dynamic sampling, Dr.GRPO with a stochastic estimator, on-policy
distillation, flow-SFT, and Flow-GRPO with μ = 2, a KL term and an EMA.

    python benchmarks/recipe_digests.py [--output digests.json]

A change that is *meant* to alter one stage (e.g. SFT's random draws) changes every digest
downstream of it, because the later runs start from its model. To check that the later
stages themselves are unchanged, keep the starting models of one run and give them to the
other: ``--save-starts DIR`` copies the SFT and flow-SFT models to ``DIR/sft``,
``DIR/flow_sft``; ``--starts DIR`` starts GRPO, distillation and Flow-GRPO from those instead
of this run's (the ``sft``, ``flow_sft`` and ``quickstart_text`` digests are still this run's).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

os.environ.setdefault("DIFFUSION_RL_NO_PROGRESS", "1")

from diffusion_rl.config import (  # noqa: E402
    DistillRecipeConfig,
    FlowGRPORecipeConfig,
    FlowSFTRecipeConfig,
    GRPORecipeConfig,
    SFTRecipeConfig,
    build_config,
)
from diffusion_rl.quickstart import run_quickstart  # noqa: E402
from diffusion_rl.recipes.distill import run_distill  # noqa: E402
from diffusion_rl.recipes.flow_grpo import run_flow_grpo  # noqa: E402
from diffusion_rl.recipes.flow_sft import run_flow_sft  # noqa: E402
from diffusion_rl.recipes.grpo import run_grpo  # noqa: E402
from diffusion_rl.recipes.sft import run_sft  # noqa: E402

SFT = {
    "model": {"d_model": 32, "n_layers": 1, "n_heads": 2},
    "task": {"num_digits": 2},
    "steps": 60,
    "batch_size": 16,
    "micro_batch_size": 6,
    "eval_every": 30,
    "eval_examples": 8,
    "checkpoint_every": 30,
    "log_every": 1,
}
GRPO = {
    "steps": 4,
    "prompts_per_step": 2,
    "group_size": 4,
    "micro_batch_size": 5,
    "eval_every": 2,
    "eval_examples": 8,
    "checkpoint_every": 2,
    "optim": {"lr": 1e-3},
    "rewards": [{"name": "digits"}],  # partial credit: untrained models get varied rewards
}
FLOW_SFT = {
    "model": {"patch_size": 4, "d_model": 32, "n_layers": 1, "n_heads": 2},
    "sampler": {"num_steps": 4},
    "steps": 4,
    "batch_size": 8,
    "micro_batch_size": 3,
    "eval_every": 2,
    "eval_samples_per_prompt": 1,
    "grid_images": 4,
    "checkpoint_every": 2,
    "log_every": 1,
}
FLOW_GRPO = {
    "sampler": {"num_steps": 4, "micro_batch_size": 4},
    "steps": 3,
    "prompts_per_step": 2,
    "group_size": 4,
    "eval_every": 2,
    "eval_samples_per_prompt": 1,
    "grid_images": 4,
    "checkpoint_every": 2,
    "optim": {"lr": 1e-3},
}


def digest(model_dir: Path) -> str:
    """sha256 over the sorted tensors of ``model.safetensors`` (names, dtypes, shapes, bytes)."""
    tensors = load_file(model_dir / "model.safetensors")
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", help="also write the JSON here")
    parser.add_argument("--save-starts", help="copy the SFT and flow-SFT models here")
    parser.add_argument("--starts", help="start the later runs from the models saved here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    quiet = {"echo": lambda _: None}
    out: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        starts = {name: root / name / "model" for name in ("sft", "flow_sft")}
        if args.starts:
            starts = {name: Path(args.starts) / name for name in starts}
            missing = [str(path) for path in starts.values() if not path.is_dir()]
            if missing:
                parser.error(f"--starts: no model directory {', '.join(missing)}")

        def grpo(name: str, **extra) -> None:
            data = {**GRPO, "model": {"path": str(starts["sft"])}, **extra}
            data["output_dir"] = str(root / name)
            run_grpo(build_config(GRPORecipeConfig, data), **quiet)
            out[name] = digest(root / name / "model")

        run_sft(build_config(SFTRecipeConfig, {**SFT, "output_dir": str(root / "sft")}), **quiet)
        out["sft"] = digest(root / "sft" / "model")
        overrides = [f"sft.{k}={json.dumps(v)}" for k, v in SFT.items() if k != "steps"]
        overrides += ["grpo.prompts_per_step=2", "grpo.group_size=4", "grpo.eval_examples=8"]
        with contextlib.redirect_stdout(io.StringIO()):
            run_quickstart(str(root / "qs"), steps=4, rl_steps=3, overrides=overrides)
        out["quickstart_text"] = digest(root / "qs" / "grpo" / "model")
        grpo("grpo")
        grpo("grpo_mu2", policy={"num_iterations": 2})
        grpo("dapo_packed", policy={"algorithm": "dapo"}, scorer="packed")
        grpo(
            "drgrpo_coupled", policy={"algorithm": "drgrpo", "num_iterations": 2}, scorer="coupled"
        )
        distill = {
            "steps": 4,
            "prompts_per_step": 3,
            "samples_per_prompt": 2,
            "micro_batch_size": 4,
            "eval_every": 2,
            "eval_examples": 8,
            "checkpoint_every": 2,
            "student": {"path": str(starts["sft"])},
            "teacher": {"path": str(root / "grpo" / "model")},
            "output_dir": str(root / "distill"),
        }
        run_distill(build_config(DistillRecipeConfig, distill), **quiet)
        out["distill"] = digest(root / "distill" / "model")
        flow_sft = {**FLOW_SFT, "output_dir": str(root / "flow_sft")}
        run_flow_sft(build_config(FlowSFTRecipeConfig, flow_sft), **quiet)
        out["flow_sft"] = digest(root / "flow_sft" / "model")
        if args.save_starts:
            for name in ("sft", "flow_sft"):
                target = Path(args.save_starts) / name
                shutil.rmtree(target, ignore_errors=True)
                shutil.copytree(root / name / "model", target)
        for name, extra in (
            ("flow_grpo", {}),
            ("flow_grpo_mu2_ema", {"policy": {"num_iterations": 2}, "ema_decay": 0.9}),
        ):
            data = {**FLOW_GRPO, "model": {"path": str(starts["flow_sft"])}, **extra}
            data["output_dir"] = str(root / name)
            run_flow_grpo(build_config(FlowGRPORecipeConfig, data), **quiet)
            out[name] = digest(root / name / "model")
    text = json.dumps(out, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")


if __name__ == "__main__":
    main()
