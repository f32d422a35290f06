"""One process of ``benchmarks/scale.py``: times recipe steps and measures this rank's memory.

``python scale_worker.py SPEC.json OUT.json`` (one process, no process group: the default
path) or ``torchrun --nproc_per_node N scale_worker.py SPEC.json OUT.json`` (every rank runs
the same recipe, FSDP2-sharded over gloo). SPEC is ``{"recipe": "sft" | "grpo" |
"flow_grpo", "config": {...}, "warmup": W, "steps": K}``. The recipe is built as a run
builds it (config, ``prologue``, the recipe class), runs W untimed steps, then K timed steps,
each between two barriers (so a step's time is that of the slowest rank), then, with a process
group, times 50 barriers (``barrier_ms``, the median: the latency every collective of a step
pays). Rank 0 writes OUT: ``{"world_size", "torch", "build_s", "warmup_times_s",
"step_times_s", "barrier_ms", "ranks": [each rank's memory, in rank order]}``.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import torch

from diffusion_rl.config import FlowGRPORecipeConfig, GRPORecipeConfig, SFTRecipeConfig
from diffusion_rl.distributed import World, close_world, init_world
from diffusion_rl.recipes.flow_grpo import FlowGRPORecipe
from diffusion_rl.recipes.grpo import GRPORecipe
from diffusion_rl.recipes.run import prologue
from diffusion_rl.recipes.sft import SFTRecipe
from diffusion_rl.train.parallel import local_tensor

RECIPES = {
    "sft": (SFTRecipeConfig, SFTRecipe),
    "grpo": (GRPORecipeConfig, GRPORecipe),
    "flow_grpo": (FlowGRPORecipeConfig, FlowGRPORecipe),
}
MIB = 2**20


def peak_rss_mib() -> dict[str, float]:
    """This process's peak RSS in MiB: ``VmHWM`` of /proc/self/status (the high-water mark of
    this process's own address space) and ``ru_maxrss`` (KiB on Linux). A fork+exec child
    starts ``ru_maxrss`` at its parent's RSS at the fork (the launcher's, or the benchmark's),
    so it can overstate a small worker; ``VmHWM`` starts afresh at the exec."""
    out = {"ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                out["vm_hwm"] = int(line.split()[1]) / 1024
    except OSError:
        pass
    return {k: round(v, 1) for k, v in out.items()}


def current_rss_mib() -> float | None:
    """This process's resident set now (``VmRSS``), in MiB; None where /proc is missing."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def tensor_bytes(tensors, seen: set[int]) -> int:
    """Bytes of this rank's part of ``tensors`` (a DTensor's local shard, a plain tensor
    itself), each storage counted once across calls sharing ``seen`` (tied weights, the
    frozen tensors a rollout copy shares with its actor)."""
    total = 0
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            continue
        local = local_tensor(tensor.detach())
        storage = local.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def memory(recipe) -> dict[str, float]:
    """This rank's peak RSS, and the bytes of model state it holds: the trained actor's
    parameters, gradients and optimizer state (FSDP shards under torchrun), and the other
    copies the recipe keeps (frozen reference and old-policy snapshot, sharded under torchrun;
    the full rollout / host replica every rank samples, evaluates and saves with)."""
    trainer = recipe.trainer
    seen: set[int] = set()
    params = tensor_bytes(trainer.model.parameters(), seen)
    grads = tensor_bytes((p.grad for p in trainer.model.parameters()), seen)
    state = trainer.optimizer.state.values()
    optimizer = tensor_bytes((t for s in state for t in s.values()), seen)
    others = [trainer.host]
    roles = getattr(recipe, "roles", None)
    if roles is not None:
        others += [roles.rollout, roles.reference, roles._snapshot]
    other = 0
    for module in others:
        if isinstance(module, torch.nn.Module):
            other += tensor_bytes(module.state_dict(keep_vars=True).values(), seen)
    return {
        "peak_rss_mib": peak_rss_mib(),
        "params_mib": round(params / MIB, 4),
        "optimizer_mib": round(optimizer / MIB, 4),
        "state_mib": round((params + optimizer) / MIB, 4),
        "grads_mib": round(grads / MIB, 4),
        "replicas_mib": round(other / MIB, 4),
    }


def main(spec_path: str, out_path: str) -> None:
    init_world()
    world = World.current()
    spec = json.loads(Path(spec_path).read_text())
    config_class, recipe_class = RECIPES[spec["recipe"]]
    run_dir = Path(out_path).with_suffix(".run")
    config = config_class.model_validate({**spec["config"], "output_dir": str(run_dir)})
    baseline = current_rss_mib()  # torch and the library imported, nothing built yet
    started = time.perf_counter()
    prologue(config)
    recipe = recipe_class(config)
    build = time.perf_counter() - started
    warmup = []
    for _ in range(spec["warmup"]):
        started = time.perf_counter()
        recipe.step()
        warmup.append(time.perf_counter() - started)
    times = []
    for _ in range(spec["steps"]):
        world.barrier()
        started = time.perf_counter()
        recipe.step()
        world.barrier()
        times.append(time.perf_counter() - started)
    barrier_ms = None  # one collective's round trip: what each of a step's collectives costs
    if world.distributed:
        rounds = []
        for _ in range(50):
            started = time.perf_counter()
            world.barrier()
            rounds.append(time.perf_counter() - started)
        barrier_ms = round(1000 * sorted(rounds)[len(rounds) // 2], 3)
    ranks = world.gather_objects({"baseline_rss_mib": baseline, **memory(recipe)})
    if world.is_main:
        record = {
            "world_size": world.size,
            "distributed": world.distributed,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "parameters": sum(p.numel() for p in recipe.trainer.host.parameters()),
            "build_s": round(build, 3),
            "barrier_ms": barrier_ms,
            "warmup_times_s": [round(t, 4) for t in warmup],
            "step_times_s": [round(t, 4) for t in times],
            "ranks": ranks,
        }
        Path(out_path).write_text(json.dumps(record))
    world.barrier()
    close_world()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
