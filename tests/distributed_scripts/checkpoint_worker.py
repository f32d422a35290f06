"""The ranks' side of tests/test_distributed_checkpoint.py, launched by ``torchrun
--nproc_per_node 2`` (gloo, CPU): ``checkpoint_worker.py ROOT``.

The definitions above ``main`` (model, batches, loss, trainer) are shared with the test,
which imports this file, so one process and two compute the same run. The loss is a
deterministic sum over each rank's rows of one global batch (no randomness), divided by
the trainer's global row count: two ranks and one process take the same steps.

``main`` runs every two-process scenario in one launch and rank 0 writes what the test
checks into ``ROOT/results.pt``:

* ``trained``: the parameters after steps 1-3, checkpoints (DCP) saved at steps 2 and 3 in
  ``ROOT/dcp``, and at step 0 (before any update: no optimizer state) in ``ROOT/fresh``;
* ``dcp_to_2``: a fresh trainer (other initial weights) resumed from ``ROOT/dcp`` (2 -> 2),
  after one more step (4);
* ``fresh_to_2``: the same from ``ROOT/fresh`` after step 1, and whether the resumed
  optimizer had no state;
* ``fallback``: every rank's checkpoint used and warnings when resuming from a copy of
  ``ROOT/dcp`` whose step 3 has a damaged rank-1 shard (only rank 0 hashes);
* ``ROOT/plain_group``: a plain (unsharded) trainer under the process group, saved at step
  0 by every rank: rank 0 writes the one-process layout;
* ``plain_to_2``: the same from the one-process checkpoint the test wrote in ``ROOT/plain``
  (1 -> 2), after step 4;
* ``lora_trained``: the adapter after steps 1-2 of a LoRA trainer, saved in ``ROOT/lora``;
* ``refusals``: every rank's outcome of a save refused for a NaN on rank 1 only, and of a
  save whose DCP write fails with ENOSPC on rank 1 only, with ``ROOT/dcp`` unchanged.
"""

from __future__ import annotations

import errno
import shutil
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from diffusion_rl.contracts import LossOutput, WeightedMetric
from diffusion_rl.distributed import World, close_world, init_world
from diffusion_rl.models.lora import LoraSettings, add_lora
from diffusion_rl.models.transformer import DiffusionTransformer, TransformerConfig
from diffusion_rl.train import CheckpointManager, OptimConfig, Trainer
from diffusion_rl.train.parallel import Parallel, ParallelConfig, full_tensor, local_tensor

CONFIG = TransformerConfig(
    vocab_size=11, mask_token_id=10, d_model=8, n_layers=2, n_heads=2, max_seq_len=8
)
OPTIM = OptimConfig(
    lr=0.05,
    eps=1e-3,
    weight_decay=0.01,
    grad_clip=None,
    schedule="linear",
    warmup_steps=2,
    total_steps=10,
)
METADATA = {"model": {"d_model": CONFIG.d_model}, "data": "toy"}
LORA = LoraSettings(rank=2)
ROWS, LENGTH = 6, 6


def make_model(init_seed: int, lora: bool = False, config: TransformerConfig = CONFIG):
    torch.manual_seed(init_seed)
    model = DiffusionTransformer(config)
    return add_lora(model, LORA, seed=init_seed) if lora else model


def batch(step: int) -> dict[str, torch.Tensor]:
    """The global batch of ``step``: ``ROWS`` rows of token ids and targets."""
    g = torch.Generator().manual_seed(1000 + step)
    return {
        "ids": torch.randint(0, 10, (ROWS, LENGTH), generator=g),
        "targets": torch.randint(0, 10, (ROWS, LENGTH), generator=g),
    }


def rows(global_batch: dict[str, torch.Tensor], world: World) -> dict[str, torch.Tensor]:
    """This rank's contiguous rows of ``global_batch``."""
    own = world.shard(ROWS)
    return {key: value[own.start : own.stop] for key, value in global_batch.items()}


def loss_fn(model, micro_batch, generator) -> LossOutput:
    """Sum over rows of each row's mean token cross-entropy; the denominator counts rows."""
    logits = model(micro_batch["ids"])
    per_token = F.cross_entropy(
        logits.flatten(0, 1).float(), micro_batch["targets"].flatten(), reduction="none"
    )
    per_row = per_token.view(micro_batch["ids"].shape).mean(-1)
    return LossOutput(WeightedMetric(per_row.sum(), torch.tensor(float(per_row.shape[0]))))


def make_trainer(
    init_seed: int,
    parallel: Parallel | None = None,
    lora: bool = False,
    config: TransformerConfig = CONFIG,
) -> Trainer:
    return Trainer(make_model(init_seed, lora, config), loss_fn, OPTIM, seed=1, parallel=parallel)


def trained_params(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The trainer's trainable parameters, whole (a collective for a sharded model)."""
    return {
        name: full_tensor(param.detach()).clone()
        for name, param in trainer.model.named_parameters()
        if param.requires_grad
    }


def listing(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()
    }


def refusals(trainer: Trainer, manager: CheckpointManager, world: World) -> dict:
    """A NaN in rank 1's shard, then an ENOSPC in rank 1's DCP write: what each rank raised
    and whether the directory stayed as it was."""
    from torch.distributed.checkpoint import filesystem

    outcomes = {}
    before = listing(manager.directory)
    param = dict(trainer.model.named_parameters())["blocks.0.attn.qkv.weight"]
    shard = local_tensor(param.detach())
    saved = shard.clone()
    if world.rank == 1:
        shard.view(-1)[0] = float("nan")
    try:
        trainer.save_checkpoint(manager, METADATA)
        outcomes["nan"] = None
    except Exception as error:
        outcomes["nan"] = (type(error).__name__, getattr(error, "tensor", None), str(error))
    shard.copy_(saved)

    real = filesystem._write_item

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if world.rank == 1:
        filesystem._write_item = full_disk
    try:
        trainer.save_checkpoint(manager, METADATA)
        outcomes["enospc"] = None
    except Exception as error:
        outcomes["enospc"] = (type(error).__name__, getattr(error, "errno", None), str(error))
    finally:
        filesystem._write_item = real
    world.barrier()
    outcomes["unchanged"] = listing(manager.directory) == before
    return outcomes


def main(root: Path) -> None:
    world = init_world("cpu", "gloo")
    torch.set_num_threads(1)
    parallel = Parallel(ParallelConfig(), world)
    results: dict = {}

    trainer = make_trainer(0, parallel)
    trainer.save_checkpoint(CheckpointManager(root / "fresh"), METADATA)  # no optimizer state
    manager = CheckpointManager(root / "dcp", keep_last=3)
    for step in (1, 2, 3):
        trainer.train_step([rows(batch(step), world)])
        if step >= 2:
            trainer.save_checkpoint(manager, METADATA, {"position": step})
    results["trained"] = trained_params(trainer)

    resumed = make_trainer(99, parallel)
    results["dcp_data_state"] = resumed.resume(manager, METADATA)
    resumed.train_step([rows(batch(4), world)])
    results["dcp_to_2"] = trained_params(resumed)
    results["refusals"] = world.gather_objects(refusals(resumed, manager, world))

    resumed = make_trainer(99, parallel)
    resumed.resume(CheckpointManager(root / "fresh"), METADATA)
    results["fresh_state_empty"] = world.gather_objects(not resumed.optimizer.state)
    resumed.train_step([rows(batch(1), world)])
    results["fresh_to_2"] = trained_params(resumed)

    if world.is_main:
        shutil.copytree(root / "dcp", root / "damaged")
        shard = root / "damaged" / "step_00000003" / "dcp" / "__1_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    world.barrier()
    resumed, warnings = make_trainer(99, parallel), []
    resumed.resume(CheckpointManager(root / "damaged"), METADATA, warn=warnings.append)
    results["fallback"] = world.gather_objects((resumed.resumed_from.name, warnings))

    plain = make_trainer(0)  # not sharded (not trained: the same weights on every rank)
    plain.save_checkpoint(CheckpointManager(root / "plain_group"), METADATA)

    resumed = make_trainer(99, parallel)
    results["plain_data_state"] = resumed.resume(CheckpointManager(root / "plain"), METADATA)
    results["plain_counters"] = (resumed.global_step, resumed.optimizer_steps)
    resumed.train_step([rows(batch(4), world)])
    results["plain_to_2"] = trained_params(resumed)

    lora = make_trainer(0, parallel, lora=True)
    for step in (1, 2):
        lora.train_step([rows(batch(step), world)])
    lora.save_checkpoint(CheckpointManager(root / "lora"), METADATA)
    results["lora_trained"] = trained_params(lora)

    if world.is_main:
        torch.save(results, root / "results.pt")
    world.barrier()
    close_world()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
