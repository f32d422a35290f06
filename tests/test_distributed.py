"""Scale-out on torch.distributed: two gloo processes on CPU train exactly as one.

One ``torchrun --nproc_per_node 2`` launch (tests/distributed_scripts/scenarios.py) runs each
scenario — SFT, GRPO (μ = 2, KL, groups cut between ranks), Flow-GRPO, each also with LoRA,
and GRPO under FSDP mixed precision — for 3 steps on FSDP2-sharded actors and references;
this process runs the same scenarios alone, with no process group, as the reference:

* the weights after 3 steps agree within 1e-5 (the gradient of the whole batch, summed across
  ranks and divided once by the global denominator: a regression test of averaged
  reductions, which gloo has got wrong);
* before any update the ratio is exactly 1 and the parity 0 on every rank (also with FSDP
  computing in bf16 from float32 masters: the rollout replica is cast the same way);
* every rank reports the same metrics (reductions are global);
* whole runs on the run loop resume across world sizes: a run checkpointed by 2 processes
  and finished by 1, and one checkpointed by 1 and finished by 2, end with the weights of an
  uninterrupted run (within 1e-5).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml

sys.path.insert(0, str(Path(__file__).parent / "distributed_scripts"))
from scenarios import run_scenarios  # noqa: E402
from serve_live import LiveServer  # noqa: E402

from diffusion_rl.config import FlowSFTRecipeConfig, SFTRecipeConfig  # noqa: E402
from diffusion_rl.models import FlowDiT, FlowDiTConfig, VideoDiT, VideoDiTConfig  # noqa: E402
from diffusion_rl.models.io import load_model, save_model  # noqa: E402
from diffusion_rl.recipes.flow_sft import run_flow_sft  # noqa: E402
from diffusion_rl.recipes.sft import run_sft  # noqa: E402
from diffusion_rl.tasks.geneval import VOCABULARY  # noqa: E402
from diffusion_rl.tasks.motion import MOTION_VOCABULARY, MotionTask  # noqa: E402

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo"
)

SCRIPTS = Path(__file__).parent / "distributed_scripts"
QUIET = {"echo": lambda _: None}
TOKEN = {"task": {"name": "arithmetic", "num_digits": 1}}
RL = {"rewards": [{"name": "digits", "weight": 1.0}], "optim": {"lr": 1e-3}}
LORA = {"rank": 4}


def launch(script: Path, *args: str, nproc: int = 2, timeout: float = 240) -> float:
    """Run ``script`` under ``torchrun --standalone`` with ``nproc`` gloo processes; returns
    the wall time. Fails with the processes' output when they fail."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPTS), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc_per_node={nproc}", str(script), *args]
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    return time.perf_counter() - started


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two token models (seeds 0 and 1) and a flow model directory from tiny SFT runs (one
    process)."""
    root = tmp_path_factory.mktemp("models")
    for seed in (0, 1):
        token = SFTRecipeConfig.model_validate(
            {
                **TOKEN,
                "output_dir": str(root / f"token{seed}"),
                "seed": seed,
                "steps": 2,
                "batch_size": 8,
                "eval_every": 100,
                "eval_examples": 8,
                "model": {"d_model": 32, "n_layers": 2},
            }
        )
        run_sft(token, **QUIET)
    flow = FlowSFTRecipeConfig.model_validate(
        {
            "output_dir": str(root / "flow"),
            "steps": 2,
            "batch_size": 8,
            "eval_every": 100,
            "eval_samples_per_prompt": 1,
            "grid_images": 4,
            "model": {"patch_size": 4, "d_model": 32, "n_layers": 1, "n_heads": 2},
            "sampler": {"num_steps": 4},
        }
    )
    run_flow_sft(flow, **QUIET)
    return root / "token0" / "model", root / "token1" / "model", root / "flow" / "model"


@pytest.fixture(scope="module")
def workflow_file(tmp_path_factory) -> Path:
    """A text → image → video workflow of two tiny untrained stage models."""
    root = tmp_path_factory.mktemp("workflow")
    torch.manual_seed(0)
    tiny = {"patch_size": 4, "d_model": 32, "n_layers": 1, "n_heads": 2}
    task = MotionTask()
    image = FlowDiT(FlowDiTConfig(image_size=16, vocabulary=VOCABULARY, **tiny))
    video = VideoDiT(
        VideoDiTConfig(image_size=16, num_frames=4, vocabulary=MOTION_VOCABULARY, **tiny)
    )
    save_model(root / "image", image, {"task": task.image_task().info()})
    save_model(root / "video", video, {"task": task.info()})
    sampler = {"num_steps": 3, "shift": 1.0, "guidance_scale": 1.0, "mode": "sde"}
    stage = {"sampler": sampler}
    spec = {
        "name": "t2i2v",
        "task": task.info(),
        "stages": [
            {**stage, "name": "image", "model": str(root / "image"), "prompt": "image_prompt"},
            {**stage, "name": "video", "model": str(root / "video"), "input": "image"},
        ],
    }
    (root / "workflow.yaml").write_text(yaml.safe_dump(spec))
    return root / "workflow.yaml"


def scenarios(token_dir: Path, student_dir: Path, flow_dir: Path) -> dict:
    sft = {**TOKEN, "batch_size": 8, "micro_batch_size": 3, "model": {"d_model": 32, "n_layers": 2}}
    grpo = {
        **TOKEN,
        **RL,
        "model": {"path": str(token_dir)},
        "prompts_per_step": 3,  # 6 rows: the second group is cut between the two ranks
        "group_size": 2,
        "micro_batch_size": 2,
        "policy": {"num_iterations": 2, "beta": 0.04},
    }
    flow = {
        **RL,
        "rewards": [{"name": "geneval", "weight": 1.0}],
        "model": {"path": str(flow_dir)},
        "prompts_per_step": 3,
        "group_size": 2,
        "sampler": {"num_steps": 4, "micro_batch_size": 2},
        "policy": {"num_iterations": 2},
    }
    lora = lambda config: {**config, "model": {**config["model"], "lora": LORA}}  # noqa: E731
    sft_lora = {**sft, "model": {"path": str(token_dir), "lora": LORA}}
    flow_sft = {
        "batch_size": 6,
        "micro_batch_size": 2,
        "model": {"patch_size": 4, "d_model": 32, "n_layers": 1, "n_heads": 2},
        "sampler": {"num_steps": 4},
    }
    distill = {
        "student": {"path": str(student_dir)},
        "teacher": {"path": str(token_dir)},
        "optim": {"lr": 1e-3},
        "prompts_per_step": 5,
        "micro_batch_size": 2,
    }
    return {
        "sft": {"recipe": "sft", "config": sft, "steps": 3},
        "sft_lora": {"recipe": "sft", "config": sft_lora, "steps": 3},
        "grpo": {"recipe": "grpo", "config": grpo, "steps": 3},
        "grpo_lora": {"recipe": "grpo", "config": lora(grpo), "steps": 3},
        "flow_grpo": {"recipe": "flow_grpo", "config": flow, "steps": 3},
        "flow_grpo_lora": {"recipe": "flow_grpo", "config": lora(flow), "steps": 3},
        # DAPO: groups kept by the gathered rewards; ranks keep different row counts (ghosts)
        "dapo": {"recipe": "grpo", "config": {**grpo, "policy": {"algorithm": "dapo"}}, "steps": 3},
        "flow_sft": {"recipe": "flow_sft", "config": flow_sft, "steps": 3},
        "distill": {"recipe": "distill", "config": distill, "steps": 3},
    }


MIXED = {  # two processes only: FSDP computing in bf16 (one process has no FSDP to compare)
    "grpo_lora_bf16": ("grpo_lora", {"param_dtype": "bf16"}),
    "flow_grpo_bf16": ("flow_grpo", {"param_dtype": "bf16"}),
}
MESHES = {  # other meshes, compared with the one-process run of their base scenario
    "sft_replicated": ("sft", {"shard": 1}),  # full replicas, gradients summed
    "grpo_reference_replicated": ("grpo", {"reference_shard": 1}),
}


@pytest.fixture(scope="module")
def runs(models, workflow_file, tmp_path_factory):
    """(one process, two processes): the output directories of both runs of every scenario."""
    spec = scenarios(*models)
    one, two = tmp_path_factory.mktemp("one"), tmp_path_factory.mktemp("two")
    # whole GRPO runs: uninterrupted (1 process), 1 -> 2 and 2 -> 1 processes at step 2
    grpo = {**spec["grpo"]["config"], "eval_every": 100, "eval_examples": 8}
    grpo["checkpoint_every"] = 1

    def whole(out: Path, steps: int) -> dict:
        config = {**grpo, "output_dir": str(out), "steps": steps}
        return {"recipe": "grpo", "run": True, "config": config}

    run_scenarios(one, {"straight": whole(one / "straight", 3), "r12": whole(two / "r12", 2)})
    # whole runs of distillation and workflow RL (rank 0 evaluates and saves)
    wf = {
        "workflow": str(workflow_file),
        "steps": 2,
        "eval_every": 100,
        "checkpoint_every": 1,
        "prompts_per_step": 3,
        "group_size": 2,
        "eval_samples_per_prompt": 1,
        "preview_clips": 2,
        "policy": {"beta": 0.01, "clip_range": 0.2},
        "stages": {"image": {"optim": {"lr": 3e-3}}, "video": {"optim": {"lr": 1e-3}}},
    }
    distill = {**spec["distill"]["config"], "steps": 2, "eval_every": 100, "eval_examples": 8}
    for name, recipe, config in (("wf", "workflow_rl", wf), ("dist", "distill", distill)):
        for where, out in ((f"{name}_one", one), (f"{name}_two", two)):
            spec[where] = {
                "recipe": recipe,
                "run": True,
                "config": {**config, "output_dir": str(out / where)},
            }  # noqa: E501
    run_scenarios(one, {"wf_one": spec.pop("wf_one"), "dist_one": spec.pop("dist_one")})
    spec["r21"] = whole(two / "r21", 2)  # started by 2 processes
    spec["r12"] = whole(two / "r12", 3)  # finished by 2 processes
    both = {}
    for name, (base, distributed) in {**{n: (n, {}) for n in spec}, **MIXED, **MESHES}.items():
        # parameters stay gathered between the many small forwards of block replay (3x faster)
        distributed = {**distributed, "reshard_after_forward": False}
        both[name] = {**spec[base], "config": {**spec[base]["config"], "distributed": distributed}}
    run_scenarios(one, {k: v for k, v in spec.items() if not v.get("run")})
    # GRPO sampled by a server: rank 0 pushes each version, both ranks sample their rows there
    server = LiveServer({"tiny": models[0]}, allow_tensor_updates=True)
    rollout = {"engine": "server", "url": server.url, "model": "tiny"}
    both["grpo_server"] = {
        **both["grpo"],
        "config": {**both["grpo"]["config"], "rollout": rollout},
    }
    # two launches, each well under a minute
    first = set(scenarios(*models)) - {"r21", "r12"}  # the plain scenarios, then the rest
    launches = {
        "scenarios": {k: v for k, v in both.items() if k in first},
        "variants_and_runs": {k: v for k, v in both.items() if k not in first},
    }
    seconds = {}
    try:
        for name, part in launches.items():
            (two / f"{name}.json").write_text(json.dumps(part))
            seconds[name] = launch(SCRIPTS / "scenarios.py", str(two), str(two / f"{name}.json"))
    finally:
        server.stop()
    run_scenarios(one, {"r21": whole(two / "r21", 3)})  # finished by 1 process
    print("\n2-process torchrun launches:", {k: round(v, 1) for k, v in seconds.items()}, "s")
    assert max(seconds.values()) < 90, f"2-process launches took {seconds} s (target: < 60 s)"
    return one, two


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


@pytest.mark.parametrize(
    "name",
    [
        "sft",
        "sft_lora",
        "grpo",
        "grpo_lora",
        "dapo",
        "flow_grpo",
        "flow_grpo_lora",
        "flow_sft",
        "distill",
        *MESHES,
    ],
)
def test_two_processes_train_as_one(runs, name):
    one, two = runs
    base = MESHES.get(name, (name,))[0]
    alone, shared = _weights(one / f"{base}.pt"), _weights(two / f"{name}.pt")
    assert alone.keys() == shared.keys()
    gap = max(float((alone[k].float() - shared[k].float()).abs().max()) for k in alone)
    assert gap <= 1e-5, f"{name}: weights after 3 steps differ by {gap:.2e}"
    record = json.loads((two / f"{name}.json").read_text())
    assert record["world_size"] == 2
    for step in record["steps"]:  # every rank reduced the same global numbers
        assert step[0] == step[1]
    alone_steps = json.loads((one / f"{base}.json").read_text())["steps"]
    for mine, theirs in zip(alone_steps, record["steps"]):
        assert abs(mine[0]["loss"] - theirs[0]["loss"]) <= 1e-6
        assert abs(mine[0]["grad_norm"] - theirs[0]["grad_norm"]) <= 1e-4 * mine[0]["grad_norm"]
    assert max(step[0]["grad_norm"] for step in alone_steps) > 0  # the weights did move


RL_SCENARIOS = ["grpo", "grpo_lora", "dapo", "flow_grpo", "flow_grpo_lora", *MIXED]


@pytest.mark.parametrize("name", RL_SCENARIOS)
def test_ratio_is_one_before_any_update_on_every_rank(runs, name):
    _, two = runs
    prefix = "flow_grpo" if name.startswith("flow") else "policy"
    record = json.loads((two / f"{name}.json").read_text())

    def first_pass(rank: dict, key: str) -> float:  # μ = 1 logs the only pass unsuffixed
        return rank.get(f"{prefix}/{key}@iter0", rank.get(f"{prefix}/{key}"))

    for step in record["steps"]:
        for rank in step:
            assert first_pass(rank, "ratio_min") == first_pass(rank, "ratio_max") == 1.0
            # a rank replays its shard of the token batch: other GEMM shapes than the
            # sampler's, whose float32 sums some CPUs order differently (flow replays keep
            # the sampler's composition per rank: exactly 0)
            parity = first_pass(rank, "parity_max_abs")
            assert parity == 0.0 if name.startswith("flow") else parity <= 1e-5
    first = record["steps"][0]
    assert all(first_pass(rank, "kl") in (0.0, None) for rank in first)  # reference = start
    assert any(rank["grad_norm"] > 0 for step in record["steps"] for rank in step)


def test_two_processes_sampling_on_a_server_train_as_one_in_process(runs):
    one, two = runs
    alone, served = _weights(one / "grpo.pt"), _weights(two / "grpo_server.pt")
    gap = max(float((alone[k] - served[k]).abs().max()) for k in alone)
    assert gap <= 1e-5, f"weights after 3 steps differ by {gap:.2e}"
    record = json.loads((two / "grpo_server.json").read_text())
    assert all(
        r["policy/ratio_min@iter0"] == r["policy/ratio_max@iter0"] == 1.0
        for step in record["steps"]
        for r in step
    )


@pytest.mark.parametrize("run", ["r21", "r12"])
def test_a_run_resumes_at_another_world_size(runs, run):
    one, two = runs
    straight = load_model(one / "straight" / "model").model.state_dict()
    resumed = load_model(two / run / "model").model.state_dict()
    results = json.loads((two / run / "results.json").read_text())
    assert results["steps"] == 3 and results["weights_version"] == 3
    gap = max(float((straight[k] - resumed[k]).abs().max()) for k in straight)
    assert gap <= 1e-5, f"{run}: final weights differ from the uninterrupted run by {gap:.2e}"
    logged = [json.loads(line) for line in (two / run / "metrics.jsonl").read_text().splitlines()]
    trained = [record["step"] for record in logged if "loss" in record]
    assert trained == [1, 2, 3]  # each step logged once, by rank 0, across the two legs


def test_a_sharded_checkpoint_serves_as_its_whole_weights(runs):
    """The serving engine reads a checkpoint written by 2 processes (DCP shards) as whole
    tensors: those of the same step written by 1 process (the plain layout)."""
    from diffusion_rl.serving.engine import checkpoint_tensors, is_training_checkpoint

    _, two = runs
    sharded = sorted((two / "r21" / "checkpoints").glob("step_*"))[0]  # by 2 processes
    plain = sorted((two / "r12" / "checkpoints").glob("step_*"))[0]  # by 1 process
    assert (sharded / "dcp").is_dir() and not (plain / "dcp").exists()
    assert sharded.name == plain.name and is_training_checkpoint(sharded)
    whole, reference = checkpoint_tensors(sharded), checkpoint_tensors(plain)
    assert reference.keys() <= whole.keys()
    for extra in whole.keys() - reference.keys():  # a tied weight, stored once in the plain
        assert any(torch.equal(whole[extra], whole[k]) for k in reference), extra
    gap = max(float((whole[k] - reference[k]).abs().max()) for k in reference)
    assert gap <= 1e-5


@pytest.mark.parametrize("name", ["wf", "dist"])
def test_whole_workflow_and_distillation_runs_under_torchrun(runs, name):
    """Workflow RL (both stages trained from the final reward) and distillation as whole runs
    of 2 processes: rank 0 evaluates (the distillation teacher stays a plain model) and saves
    the final models, which are those of the one-process run."""
    one, two = runs
    alone = json.loads((one / f"{name}_one" / "results.json").read_text())
    shared = json.loads((two / f"{name}_two" / "results.json").read_text())
    assert alone["steps"] == shared["steps"] == 2
    models = ["image", "video"] if name == "wf" else [""]
    for stage in models:
        a = load_model(one / f"{name}_one" / "model" / stage).model.state_dict()
        b = load_model(two / f"{name}_two" / "model" / stage).model.state_dict()
        gap = max(float((a[k] - b[k]).abs().max()) for k in a)
        assert gap <= 1e-5, f"{name} {stage}: final weights differ by {gap:.2e}"
