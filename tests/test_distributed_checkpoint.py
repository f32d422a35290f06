"""Distributed checkpoints (torch.distributed.checkpoint) that resume at another world size.

One ``torchrun --nproc_per_node 2`` launch (tests/distributed_scripts/checkpoint_worker.py,
gloo on CPU) trains a tiny FSDP2-sharded DiffusionTransformer (tied embeddings) and a LoRA
one, saves sharded checkpoints, resumes them and a one-process checkpoint at two processes,
and tries refused saves. This process runs the same training alone, with no process group,
as the independent reference (the loss is a deterministic sum over each rank's rows of one
global batch, so one process and two take the same steps; Adam's eps is large enough that
rounding noise in null gradients, e.g. attention key biases, is not amplified into
updates), and resumes the two-process checkpoints here:

* 2 -> 1, 2 -> 2 and 1 -> 2 resumes, then one more step, equal the uninterrupted run
  within 1e-5 (weights, optimizer moments, counters, scheduler, RNGs, data state);
* a sharded checkpoint is verified like a one-process one (every DCP file hashed in the
  manifest, DCP metadata read through a restricted unpickler, tensors checked finite on
  load): damage falls back to the previous checkpoint, an intact checkpoint of another model
  or configuration stops the resume, and the trainer is untouched whenever resume raises;
* a checkpoint saved before any update (no optimizer state) resumes into no state, and saving
  it leaves the run unchanged (``get_state_dict``'s state-creating step is taken back);
* a LoRA model's sharded checkpoint holds its adapter and the adapter's optimizer state only;
* a plain module under a process group is saved by rank 0 in the one-process layout;
* a save refused on one rank (a NaN in its shard, a full disk under its DCP write) is
  refused on every rank, and nothing is written.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import pickle
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from diffusion_rl.models.lora import add_lora
from diffusion_rl.models.transformer import DiffusionTransformer
from diffusion_rl.train import (
    CheckpointCorruptError,
    CheckpointManager,
    CheckpointMismatchError,
    Trainer,
)
from diffusion_rl.train import checkpoint as ckpt
from diffusion_rl.train.checkpoint import (
    load_model_tensors,
    read_checkpoint,
    verify_files,
    write_manifest,
)

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo"
)

WORKER_FILE = Path(__file__).parent / "distributed_scripts" / "checkpoint_worker.py"
_spec = importlib.util.spec_from_file_location("checkpoint_worker", WORKER_FILE)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

TOLERANCE = 1e-5
STEP_2, STEP_3 = "step_00000002", "step_00000003"


def launch(root: Path, timeout: float = 240) -> float:
    """Run the worker under ``torchrun --standalone`` (a free port of its own) with two
    gloo processes; returns the wall time. Fails with their output when they fail."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node=2", str(WORKER_FILE), str(root)]
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    return time.perf_counter() - started


def snapshot(trainer: Trainer) -> dict:
    """Everything a resume restores, copied."""
    return {
        "params": worker.trained_params(trainer),
        "optimizer": copy.deepcopy(trainer.optimizer.state_dict()),
        "scheduler": copy.deepcopy(trainer.scheduler.state_dict()),
        "generator": trainer.generator.get_state().clone(),
        "counters": (trainer.global_step, trainer.optimizer_steps),
    }


def assert_close(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert got[name].shape == value.shape and got[name].dtype == value.dtype, name
        assert torch.allclose(got[name], value, rtol=0, atol=TOLERANCE), (
            name,
            (got[name] - value).abs().max().item(),
        )


def assert_same_optimizer_state(got: dict, expected: dict) -> None:
    """Adam's moments and step counts of every parameter (by index), within TOLERANCE;
    the hyper-parameters of every group exactly."""
    assert got["state"].keys() == expected["state"].keys()
    for index, entry in expected["state"].items():
        assert got["state"][index].keys() == entry.keys()
        for key, value in entry.items():
            assert got["state"][index][key].dtype == value.dtype, (index, key)
            assert torch.allclose(got["state"][index][key], value, rtol=0, atol=TOLERANCE)
    assert got["param_groups"] == expected["param_groups"]


def assert_untouched(trainer: Trainer, before: dict) -> None:
    after = snapshot(trainer)
    assert after["counters"] == before["counters"]
    assert torch.equal(after["generator"], before["generator"])
    assert after["scheduler"] == before["scheduler"]
    assert repr(after["optimizer"]) == repr(before["optimizer"])  # still no state at all
    for name, value in before["params"].items():
        assert torch.equal(after["params"][name], value), name


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The reference run (one process: snapshots after steps 1-4, a one-process checkpoint
    of step 3 in ``ROOT/plain``; a LoRA run of steps 1-3), then the two-process launch."""
    root = tmp_path_factory.mktemp("distributed_checkpoint")
    trainer = worker.make_trainer(0)
    reference = {}
    for step in (1, 2, 3, 4):
        trainer.train_step([worker.batch(step)])
        reference[step] = snapshot(trainer)
        if step == 3:
            trainer.save_checkpoint(
                CheckpointManager(root / "plain"), worker.METADATA, {"position": 3}
            )
    lora = worker.make_trainer(0, lora=True)
    for step in (1, 2, 3):
        lora.train_step([worker.batch(step)])
        reference[f"lora{step}"] = snapshot(lora)
    seconds = launch(root)
    results = torch.load(root / "results.pt", weights_only=True)
    return root, reference, results, seconds


@pytest.fixture
def dcp_copy(run, tmp_path):
    """A private copy of the two-process run's checkpoint directory (steps 2 and 3)."""
    root = run[0]
    directory = tmp_path / "dcp"
    shutil.copytree(root / "dcp", directory)
    return directory


def resume_alone(directory, init_seed: int = 99, **kwargs) -> tuple[Trainer, dict, list[str]]:
    trainer = worker.make_trainer(init_seed, **kwargs)
    warnings: list[str] = []
    target = directory if isinstance(directory, CheckpointManager) else CheckpointManager(directory)
    data_state = trainer.resume(target, worker.METADATA, warn=warnings.append)
    return trainer, data_state, warnings


# ----------------------------------------------------------------------------- the layout
def test_two_processes_train_as_one_and_write_a_verified_sharded_checkpoint(run):
    root, reference, results, seconds = run
    assert seconds < 120
    assert_close(results["trained"], reference[3]["params"])
    directory = root / "dcp"
    assert (directory / "latest").read_text() == f"{STEP_3}\n"
    assert [p.name for p in CheckpointManager(directory).checkpoints()] == [STEP_2, STEP_3]
    newest = directory / STEP_3
    files = ckpt._read_manifest(newest)["files"]
    assert sorted(files) == [
        "dcp/.metadata",
        "dcp/__0_0.distcp",
        "dcp/__1_0.distcp",
        "metadata.json",
        "optimizer_groups.pt",
        "trainer_state.pt",
    ]
    assert not (newest / "model.safetensors").exists() and verify_files(newest) == 3
    checkpoint = read_checkpoint(newest)
    assert checkpoint.sharded and checkpoint.step == 3
    assert checkpoint.trainer_state["data_state"] == {"position": 3}
    trained = [name for name, p in worker.make_model(0).named_parameters() if p.requires_grad]
    assert checkpoint.optimizer_state["param_groups"][0]["params"] == trained
    assert checkpoint.optimizer_state["state"] == {}  # Adam's state is all tensors: in dcp/
    # the shards assemble, in one process, into the reference run's weights (tied ones too)
    tensors = load_model_tensors(newest)
    full = {name: t.detach() for name, t in worker.make_model(0).state_dict().items()}
    assert tensors.keys() == full.keys()
    expected = {**reference[3]["params"], "head.weight": reference[3]["params"]["tok_emb.weight"]}
    assert_close(tensors, expected)
    assert read_checkpoint(root / "plain" / STEP_3).sharded is False


# ----------------------------------------------------------------------------- resumes
def test_two_process_checkpoint_resumes_into_one_process_exactly(run):
    root, reference, _, _ = run
    trainer, data_state, warnings = resume_alone(root / "dcp")
    assert warnings == [] and data_state == {"position": 3}
    assert trainer.resumed_from == root / "dcp" / STEP_3
    restored = snapshot(trainer)
    assert restored["counters"] == (3, 3) == reference[3]["counters"]
    assert restored["scheduler"] == reference[3]["scheduler"]
    assert torch.equal(restored["generator"], reference[3]["generator"])
    assert_close(restored["params"], reference[3]["params"])
    assert_same_optimizer_state(restored["optimizer"], reference[3]["optimizer"])
    saved_rng = read_checkpoint(root / "dcp" / STEP_3).trainer_state["rng"]
    assert torch.equal(torch.get_rng_state(), saved_rng["torch"])  # rank 0's, restored
    trainer.train_step([worker.batch(4)])
    assert_close(worker.trained_params(trainer), reference[4]["params"])
    assert_same_optimizer_state(trainer.optimizer.state_dict(), reference[4]["optimizer"])
    # the manager alone loads it too (verified, checked, staged, applied)
    model = worker.make_model(7)
    optimizer = torch.optim.AdamW(model.parameters())
    state, metadata = CheckpointManager(root / "dcp").load(root / "dcp" / STEP_3, model, optimizer)
    assert state["global_step"] == 3 and metadata["data"] == "toy"
    assert_close({n: p.detach() for n, p in model.named_parameters()}, reference[3]["params"])
    assert_same_optimizer_state(
        {**optimizer.state_dict(), "param_groups": reference[3]["optimizer"]["param_groups"]},
        reference[3]["optimizer"],
    )


def test_two_process_checkpoint_resumes_into_two_processes(run):
    _, reference, results, _ = run
    assert results["dcp_data_state"] == {"position": 3}
    assert_close(results["dcp_to_2"], reference[4]["params"])


def test_one_process_checkpoint_resumes_into_two_sharded_processes(run):
    _, reference, results, _ = run
    assert results["plain_data_state"] == {"position": 3}
    assert results["plain_counters"] == (3, 3)
    assert_close(results["plain_to_2"], reference[4]["params"])


def test_checkpoint_before_any_update_resumes_without_optimizer_state(run):
    root, reference, results, _ = run
    assert results["fresh_state_empty"] == [True, True]
    assert_close(results["fresh_to_2"], reference[1]["params"])
    checkpoint = read_checkpoint(root / "fresh" / "step_00000000")
    assert checkpoint.sharded
    assert not [k for k in checkpoint.dcp_metadata.state_dict_metadata if k.startswith("optim")]
    trainer, _, _ = resume_alone(root / "fresh")
    assert trainer.global_step == 0 and not trainer.optimizer.state
    assert_close(worker.trained_params(trainer), worker.trained_params(worker.make_trainer(0)))
    trainer.train_step([worker.batch(1)])
    assert_close(worker.trained_params(trainer), reference[1]["params"])
    assert_same_optimizer_state(trainer.optimizer.state_dict(), reference[1]["optimizer"])


def test_plain_module_under_a_process_group_is_saved_by_rank_0_in_one_process_layout(run):
    root = run[0]
    directory = root / "plain_group"
    path = directory / "step_00000000"
    assert sorted(p.name for p in directory.iterdir()) == ["latest", path.name]
    assert not read_checkpoint(path).sharded and (path / "model.safetensors").is_file()
    model = worker.make_model(99)
    optimizer = torch.optim.AdamW(model.parameters())
    state, _ = CheckpointManager(directory).load(path, model, optimizer)
    assert state["global_step"] == 0 and not optimizer.state
    expected = worker.make_model(0).state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_lora_sharded_checkpoint_holds_the_adapter_only_and_resumes(run):
    root, reference, results, _ = run
    assert_close(results["lora_trained"], reference["lora2"]["params"])
    checkpoint = read_checkpoint(root / "lora" / STEP_2)
    entries = checkpoint.dcp_metadata.state_dict_metadata
    adapter = set(reference["lora2"]["params"])
    assert adapter and all(".lora_" in name for name in adapter)
    assert {key.removeprefix("model.") for key in entries if key.startswith("model.")} == adapter
    optimized = {
        key.removeprefix("optimizer.state.").rpartition(".")[0]
        for key in entries
        if key.startswith("optimizer.state.")
    }
    assert optimized == adapter
    size = sum(p.stat().st_size for p in (root / "lora" / STEP_2 / "dcp").iterdir())
    assert size < sum(p.stat().st_size for p in (root / "dcp" / STEP_2 / "dcp").iterdir())
    trainer, data_state, _ = resume_alone(root / "lora", init_seed=0, lora=True)
    assert data_state == {} and trainer.global_step == 2
    assert_close(worker.trained_params(trainer), reference["lora2"]["params"])
    trainer.train_step([worker.batch(3)])
    assert_close(worker.trained_params(trainer), reference["lora3"]["params"])
    # other LoRA settings: refused by name, before anything is loaded
    torch.manual_seed(0)
    model = add_lora(
        DiffusionTransformer(worker.CONFIG), worker.LORA.model_copy(update={"rank": 4})
    )
    other = Trainer(model, worker.loss_fn, worker.OPTIM, seed=1)
    with pytest.raises(CheckpointMismatchError, match=r"'trainer\.lora\.rank': this run has 4"):
        other.resume(root / "lora" / STEP_2, worker.METADATA)


def test_refused_saves_agree_on_every_rank_and_write_nothing(run):
    _, _, results, _ = run
    nan = [outcome["nan"] for outcome in results["refusals"]]
    assert [kind for kind, _, _ in nan] == ["NonFiniteStateError"] * 2
    assert [tensor for _, tensor, _ in nan] == ["model tensor 'blocks.0.attn.qkv.weight'"] * 2
    assert "Nothing was written (the latest checkpoint is still step_00000003)" in nan[0][2]
    full = [outcome["enospc"] for outcome in results["refusals"]]
    assert [(kind, code) for kind, code, _ in full] == [("CheckpointDiskFullError", 28)] * 2
    assert all(
        "step_00000004 was not saved (its partial copy was removed); the previous checkpoint "
        "step_00000003 is intact and `latest` still points at it" in message
        for _, _, message in full
    )
    assert [outcome["unchanged"] for outcome in results["refusals"]] == [True, True]


# ----------------------------------------------------------------------------- damage
def bit_flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_two_processes_fall_back_together_when_one_shard_is_damaged(run):
    """Rank 1 does not hash (rank 0 does): it skips step 3 on rank 0's verdict."""
    root, _, results, _ = run
    expected = f"skipping checkpoint {root / 'damaged' / STEP_3}: dcp/__1_0.distcp: sha256 mismatch"
    for name, warnings in results["fallback"]:
        assert name == STEP_2 and len(warnings) == 1 and warnings[0].startswith(expected)


def test_damaged_shard_falls_back_to_the_previous_sharded_checkpoint(run, dcp_copy):
    _, reference, _, _ = run
    bit_flip(dcp_copy / STEP_3 / "dcp" / "__1_0.distcp")
    trainer, data_state, warnings = resume_alone(dcp_copy)
    assert len(warnings) == 1
    assert warnings[0].startswith(
        f"skipping checkpoint {dcp_copy / STEP_3}: dcp/__1_0.distcp: sha256 mismatch"
    )
    assert trainer.resumed_from == dcp_copy / STEP_2 and data_state == {"position": 2}
    assert_close(worker.trained_params(trainer), reference[2]["params"])
    assert_same_optimizer_state(trainer.optimizer.state_dict(), reference[2]["optimizer"])


class _Hostile:
    def __reduce__(self):
        return (os.system, ("touch HOSTILE_MARKER",))


def _reseal_truncated_shard(newest: Path) -> str:
    shard = newest / "dcp" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    write_manifest(newest, 3)
    return (
        r"dcp/\.metadata: refers to bytes \[\d+, \d+\+\d+\) of dcp/__1_0\.distcp, which holds 100"
    )


def _reseal_hostile_metadata(newest: Path) -> str:
    (newest / "dcp" / ".metadata").write_bytes(pickle.dumps(_Hostile()))
    write_manifest(newest, 3)
    return r"dcp/\.metadata: unreadable \(UnpicklingError: refusing (posix|os|nt)\.system"


def _reseal_non_finite_shards(newest: Path) -> str:
    """Rewrite step 3's shards (one process, no process group) with a NaN weight."""
    from torch.distributed.checkpoint import FileSystemWriter, save

    trainer = worker.make_trainer(0)
    trainer.train_step([worker.batch(1)])
    with torch.no_grad():
        trainer.model.norm.weight[1] = float("nan")
    payload, _ = ckpt._sharded_payload(trainer.model, trainer.optimizer)
    shutil.rmtree(newest / "dcp")
    save(payload, storage_writer=FileSystemWriter(newest / "dcp"), no_dist=True)
    write_manifest(newest, 3)
    return r"dcp: model tensor 'norm\.weight' holds non-finite values \(1 NaN, 0 infinite, of 8\)"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the one-process save
@pytest.mark.parametrize(
    "damage",
    [_reseal_truncated_shard, _reseal_hostile_metadata, _reseal_non_finite_shards],
    ids=["truncated-shard", "hostile-metadata", "non-finite"],
)
def test_resealed_damage_is_caught_by_parsing_or_on_load(run, dcp_copy, damage, monkeypatch):
    """The manifest vouches for the damaged files: the metadata checks, the restricted
    unpickler or the finiteness check after loading must catch it."""
    _, reference, _, _ = run
    monkeypatch.chdir(dcp_copy)
    newest = dcp_copy / STEP_3
    reason = damage(newest)
    trainer = worker.make_trainer(99)
    before = snapshot(trainer)
    with pytest.raises(CheckpointCorruptError) as info:
        trainer.resume(newest, worker.METADATA)
    assert re.search(reason, str(info.value)), str(info.value)
    assert info.value.path == newest
    assert_untouched(trainer, before)
    assert not (dcp_copy / "HOSTILE_MARKER").exists()
    fallback, _, warnings = resume_alone(dcp_copy)
    assert fallback.resumed_from == dcp_copy / STEP_2 and len(warnings) == 1
    assert re.search(reason, warnings[0])
    assert_close(worker.trained_params(fallback), reference[2]["params"])


# ----------------------------------------------------------------------------- mismatches
def test_sharded_checkpoint_of_another_model_or_run_stops_the_resume(run):
    root, _, _, _ = run
    wider = worker.CONFIG.model_copy(update={"d_model": 12})
    trainer = worker.make_trainer(99, config=wider)
    before = snapshot(trainer)
    with pytest.raises(CheckpointMismatchError) as info:
        trainer.resume(CheckpointManager(root / "dcp"), worker.METADATA)
    message = str(info.value)
    assert f"checkpoint {root / 'dcp' / STEP_3}: weights do not fit DiffusionTransformer" in message
    assert (
        "'tok_emb.weight': expected (11, 12) torch.float32 (the model), found (11, 8) "
        "torch.float32 (the checkpoint)" in message
    )
    assert_untouched(trainer, before)

    trainer = worker.make_trainer(99)
    before = snapshot(trainer)
    changed = {**worker.METADATA, "model": {"d_model": 12}}
    with pytest.raises(CheckpointMismatchError, match=r"'model\.d_model': this run has 12"):
        trainer.resume(CheckpointManager(root / "dcp"), changed)
    assert_untouched(trainer, before)

    model = worker.make_model(99)
    model.norm.bias.requires_grad_(False)  # same weights, one parameter fewer to train
    trainer = Trainer(model, worker.loss_fn, worker.OPTIM, seed=1)
    before = snapshot(trainer)
    with pytest.raises(
        CheckpointMismatchError,
        match=r"optimizer has 28 parameters in 1 groups, this model trains 27 in 1",
    ):
        trainer.resume(CheckpointManager(root / "dcp"), worker.METADATA)
    assert_untouched(trainer, before)
