"""Step time and per-rank memory of SFT, GRPO and Flow-GRPO on 1 and 2 CPU processes (gloo).

A report of what scale-out on torch.distributed costs and saves on tiny built-in models, not a
scaling result: on CPU, gloo's collectives and FSDP's gathers are pure overhead next to
matrices this small, and the processes share the machine's cores.

In a temporary directory the script first writes two model directories with one-process
runs (a token ``DiffusionTransformer``, 64 wide × 2 layers × 4 heads, from 4 SFT steps on
1-digit arithmetic; a ``FlowDiT``, 16 px, patches of 4, 64 wide × 2 layers × 4 heads, from
4 flow-SFT steps on mini-GenEval), then, per recipe and world size, launches a worker
(benchmarks/scale_worker.py): one plain process with no process group for 1 (the default
path), ``python -m torch.distributed.run --standalone --nproc_per_node 2`` for 2 (FSDP2
sharding of the actor, the reference and the old-policy snapshot over gloo). The worker builds
the recipe as a run does, runs ``--warmup`` steps, then times ``--steps`` steps, each between
two barriers; every rank reports its peak RSS and the bytes of model state it holds.

Reported per recipe and world size: ``step_time_s`` (median of the timed steps; all of them
in ``step_times_s``) and per rank ``peak_rss_mib`` (``VmHWM``; ``baseline_rss_mib``: the RSS
with torch and the library imported, before the recipe is built), ``state_mib`` (the actor's
parameters + optimizer state held by this rank: FSDP's local shards), ``grads_mib`` and
``replicas_mib`` (the other copies: rollout / host replica, reference, snapshot); side by
side, ``ratios``: 2-process ÷ 1-process step time and rank-0 state, RSS.

    python benchmarks/scale.py              # ~75 s on 2 idle CPU cores, ~2 min loaded
    python benchmarks/scale.py --recipes grpo --param-dtype bf16 --steps 8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

WORKER = Path(__file__).with_name("scale_worker.py")
RECIPES = ("sft", "grpo", "flow_grpo")
TOKEN_MODEL = {"d_model": 64, "n_layers": 2, "n_heads": 4}
FLOW_MODEL = {"patch_size": 4, "d_model": 64, "n_layers": 2, "n_heads": 4}
TASK = {"name": "arithmetic", "num_digits": 1}
NOTE = (
    "a report, not a scaling result: CPU gloo scale-out is for correctness and memory; on 2 "
    "shared cores the 2 processes (1 thread each) share the machine, the models are too small "
    "for the gathers and reductions to pay off, and the 2-process run holds a full rollout "
    "replica per rank besides its shards"
)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def write_models(root: Path) -> dict[str, Path]:
    """The token and flow model directories, from tiny one-process SFT runs (in this process)."""
    from diffusion_rl.config import FlowSFTRecipeConfig, SFTRecipeConfig
    from diffusion_rl.recipes.flow_sft import run_flow_sft
    from diffusion_rl.recipes.sft import run_sft

    quiet = {"echo": lambda _: None}
    common = {"steps": 4, "batch_size": 16, "eval_every": 100, "threads": 1}
    token = {**common, "task": TASK, "eval_examples": 8, "model": TOKEN_MODEL}
    run_sft(SFTRecipeConfig.model_validate({**token, "output_dir": str(root / "sft")}), **quiet)
    flow = {
        **common,
        "output_dir": str(root / "flow_sft"),
        "eval_samples_per_prompt": 1,
        "grid_images": 4,
        "model": FLOW_MODEL,
        "sampler": {"num_steps": 4},
    }
    run_flow_sft(FlowSFTRecipeConfig.model_validate(flow), **quiet)
    return {"token": root / "sft" / "model", "flow": root / "flow_sft" / "model"}


def recipe_configs(models: dict[str, Path], distributed: dict) -> dict[str, dict]:
    """Each recipe's config: batch rows divide evenly between 2 ranks; the RL recipes run
    μ = 2 (an old-policy snapshot) with β > 0 (a frozen reference), so every role is there."""
    common = {"threads": 1, "eval_every": 10**6, "checkpoint_every": 10**6}
    common["distributed"] = distributed
    rl = {"optim": {"lr": 1e-4}, "policy": {"num_iterations": 2, "beta": 0.04}}
    return {
        "sft": {
            **common,
            "task": TASK,
            "model": TOKEN_MODEL,
            "batch_size": 32,
            "micro_batch_size": 8,
        },
        "grpo": {
            **common,
            **rl,
            "task": TASK,
            "model": {"path": str(models["token"])},
            "rewards": [{"name": "digits", "weight": 1.0}],
            "prompts_per_step": 4,
            "group_size": 4,
            "micro_batch_size": 4,
        },
        "flow_grpo": {
            **common,
            **rl,
            "model": {"path": str(models["flow"])},
            "rewards": [{"name": "geneval", "weight": 1.0}],
            "prompts_per_step": 2,
            "group_size": 4,
            "sampler": {"num_steps": 4, "micro_batch_size": 4},
        },
    }


def launch(spec: dict, nproc: int, scratch: Path, timeout: float) -> dict:
    """Run the worker on ``spec`` in ``nproc`` processes; returns rank 0's record."""
    name = f"{spec['recipe']}_{nproc}"
    spec_path, out_path = scratch / f"{name}.spec.json", scratch / f"{name}.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env["DIFFUSION_RL_NO_PROGRESS"] = "1"
    if nproc == 1:  # the default path: one plain process, no process group
        command = [sys.executable, str(WORKER)]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += [f"--nproc_per_node={nproc}", str(WORKER)]
    started = time.perf_counter()
    done = subprocess.run(
        [*command, str(spec_path), str(out_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    record = json.loads(out_path.read_text())
    record["launch_s"] = round(time.perf_counter() - started, 2)
    return record


def summary(record: dict) -> dict:
    ranks = [
        {**r, "peak_rss_mib": r["peak_rss_mib"].get("vm_hwm", r["peak_rss_mib"]["ru_maxrss"]),
         "ru_maxrss_mib": r["peak_rss_mib"]["ru_maxrss"]}
        for r in record["ranks"]
    ]  # fmt: skip
    return {
        "step_time_s": round(statistics.median(record["step_times_s"]), 4),
        "step_times_s": record["step_times_s"],
        "warmup_times_s": record["warmup_times_s"],
        "parameters": record["parameters"],
        "build_s": record["build_s"],
        "barrier_ms": record["barrier_ms"],
        "launch_s": record["launch_s"],
        "ranks": ranks,
    }


def ratios(one: dict, two: dict) -> dict:
    first, alone = two["ranks"][0], one["ranks"][0]
    ratio = lambda a, b: round(a / b, 3) if b else None  # noqa: E731
    return {
        "step_time": ratio(two["step_time_s"], one["step_time_s"]),
        "state_mib_per_rank": ratio(first["state_mib"], alone["state_mib"]),
        "params_mib_per_rank": ratio(first["params_mib"], alone["params_mib"]),
        "optimizer_mib_per_rank": ratio(first["optimizer_mib"], alone["optimizer_mib"]),
        "peak_rss_mib_per_rank": ratio(first["peak_rss_mib"], alone["peak_rss_mib"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated")
    parser.add_argument("--param-dtype", choices=["null", "bf16"], default="null",
                        help="FSDP compute dtype of the 2-process run (bf16: mixed precision)")  # fmt: skip
    # Off by default: with it on, FSDP frees the gathered parameters after every forward and
    # gathers them again for the next, and block replay (GRPO's exact scorer, Flow-GRPO's
    # per-step scoring) runs many small forwards per micro-batch, so it gathers over and
    # over (tests/test_distributed.py measured 3x slower); at this size memory is no issue.
    parser.add_argument("--reshard-after-forward", action="store_true")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per launch")
    args = parser.parse_args()
    names = [n.strip() for n in args.recipes.split(",") if n.strip()]
    unknown = sorted(set(names) - set(RECIPES))
    if unknown:
        parser.error(f"--recipes: unknown {unknown}; choose from {', '.join(RECIPES)}")
    distributed = {
        "param_dtype": None if args.param_dtype == "null" else args.param_dtype,
        "reshard_after_forward": args.reshard_after_forward,
    }
    result: dict = {
        "settings": {**vars(args), "recipes": names, "distributed": distributed},
        "environment": {
            "torch": torch.__version__,
            "cpu_count": os.cpu_count(),
            "threads_per_process": 1,
            "backend": "gloo",
            "python": platform.python_version(),
            "machine": platform.machine(),
        },
        "note": NOTE,
        "recipes": {},
    }
    load = [round(x, 2) for x in os.getloadavg()]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        models = write_models(root)
        log(f"models written in {time.perf_counter() - started:.1f} s")
        configs = recipe_configs(models, distributed)
        for name in names:
            spec = {"recipe": name, "config": configs[name]}
            spec |= {"warmup": args.warmup, "steps": args.steps}
            runs = {}
            for nproc in (1, 2):
                runs[str(nproc)] = summary(launch(spec, nproc, root, args.timeout))
                log(f"{name} x{nproc}: {json.dumps(runs[str(nproc)])}")
            result["recipes"][name] = {**runs, "ratios": ratios(runs["1"], runs["2"])}
    result["seconds"] = round(time.perf_counter() - started, 1)
    # other work on the machine inflates the 2-process times most (each collective waits
    # for both processes to be scheduled): the 1/5/15-minute load averages, before and after
    result["environment"]["load_average"] = {
        "start": load,
        "end": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
