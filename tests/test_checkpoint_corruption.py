"""Checkpoint fault suite: every corruption kind in every checkpoint file, non-finite state,
stale weights, missing metadata, a full disk.

Each case starts from the same four checkpoints (steps 1-4 of one run, params recorded at
each step), damages some of them, and asserts the exact outcome of ``Trainer.resume``:
either a fallback to the newest intact checkpoint (the step resumed from, the parameters
bitwise equal to the ones saved at that step, one warning per skipped checkpoint naming its
file) or a ``CheckpointCorruptError`` naming every checkpoint and file, with the trainer
untouched. Never a silent resume.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch
from torch import nn

from diffusion_rl.contracts import LossOutput, WeightedMetric
from diffusion_rl.train import (
    CheckpointCorruptError,
    CheckpointDiskFullError,
    CheckpointManager,
    CheckpointMismatchError,
    NonFiniteStateError,
    OptimConfig,
    Trainer,
)
from diffusion_rl.train import checkpoint as ckpt
from diffusion_rl.train.checkpoint import read_checkpoint, verify_files, write_manifest

STEPS = (1, 2, 3, 4)
METADATA = {"model": {"hidden": 4}, "data": {"path": "toy"}}
MODEL, OPTIMIZER, STATE, META, MANIFEST = (
    "model.safetensors",
    "optimizer.pt",
    "trainer_state.pt",
    "metadata.json",
    "manifest.json",
)
DATA_FILES = (MODEL, OPTIMIZER, STATE, META)
ALL_FILES = (*DATA_FILES, MANIFEST)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(3, 4)
        self.l2 = nn.Linear(4, 2)
        self.register_buffer("scale", torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(x))) * self.scale


def loss_fn(model, batch, generator) -> LossOutput:
    noise = 0.1 * torch.randn(batch["x"].shape, generator=generator)
    per_row = ((model(batch["x"] + noise) - batch["y"]) ** 2).mean(-1)
    return LossOutput(WeightedMetric(per_row.sum(), torch.tensor(float(len(per_row)))))


def batch(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"x": torch.randn(6, 3, generator=g), "y": torch.randn(6, 2, generator=g)}


def make_trainer(init_seed: int) -> Trainer:
    torch.manual_seed(init_seed)
    return Trainer(Tiny(), loss_fn, OptimConfig(lr=0.05), seed=1)


def params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in trainer.model.state_dict().items()}


def snapshot(trainer: Trainer) -> dict:
    return {
        "params": params(trainer),
        "optimizer": repr(trainer.optimizer.state_dict()),
        "scheduler": repr(trainer.scheduler.state_dict()),
        "generator": trainer.generator.get_state().clone(),
        "torch_rng": torch.get_rng_state().clone(),
        "counters": (trainer.global_step, trainer.optimizer_steps, trainer.resumed_from),
    }


def assert_same_snapshot(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
    assert a["optimizer"] == b["optimizer"] and a["scheduler"] == b["scheduler"]
    assert torch.equal(a["generator"], b["generator"])
    assert torch.equal(a["torch_rng"], b["torch_rng"])
    assert a["counters"] == b["counters"]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """Checkpoints of steps 1-4 and the parameters at each step."""
    root = tmp_path_factory.mktemp("pristine") / "checkpoints"
    trainer = make_trainer(0)
    manager = CheckpointManager(root, keep_last=len(STEPS))
    saved = {}
    for step in STEPS:
        trainer.train_step([batch(step)])
        trainer.save_checkpoint(manager, METADATA, {"position": step})
        saved[step] = params(trainer)
    assert [p.name for p in manager.checkpoints()] == [f"step_{s:08d}" for s in STEPS]
    for a, b in zip(STEPS, STEPS[1:]):  # bitwise equality to a step identifies that step
        assert not torch.equal(saved[a]["l1.weight"], saved[b]["l1.weight"])
    return root, saved


@pytest.fixture
def run(pristine, tmp_path):
    root, saved = pristine
    directory = tmp_path / "checkpoints"
    shutil.copytree(root, directory)
    return directory, saved


def step_dir(directory: Path, step: int) -> Path:
    return directory / f"step_{step:08d}"


def resume(directory: Path) -> tuple[Trainer, dict, list[str]]:
    trainer = make_trainer(init_seed=99)
    warnings: list[str] = []
    data_state = trainer.resume(CheckpointManager(directory), METADATA, warn=warnings.append)
    return trainer, data_state, warnings


def assert_resumed_from(directory: Path, saved: dict, step: int) -> tuple[Trainer, list[str]]:
    trainer, data_state, warnings = resume(directory)
    assert trainer.resumed_from == step_dir(directory, step)
    assert data_state == {"position": step}
    assert trainer.global_step == step == trainer.optimizer_steps
    got = params(trainer)
    assert got.keys() == saved[step].keys()
    for name, value in saved[step].items():
        assert value.dtype == got[name].dtype and torch.equal(got[name], value), name
    assert all(bool(torch.isfinite(v).all()) for v in got.values())
    return trainer, warnings


def assert_no_usable_checkpoint(directory: Path, file: str, reason: str, steps=STEPS) -> None:
    trainer = make_trainer(init_seed=99)
    before = snapshot(trainer)
    warnings: list[str] = []
    with pytest.raises(CheckpointCorruptError) as info:
        trainer.resume(CheckpointManager(directory), METADATA, warn=warnings.append)
    assert_same_snapshot(snapshot(trainer), before)
    error = info.value
    assert error.path == directory and error.file is None
    assert [problem.path.name for problem in error.problems] == [
        f"step_{s:08d}" for s in sorted(steps, reverse=True)
    ]
    message = str(error)
    assert f"no usable checkpoint ({len(steps)} tried" in message
    for step in steps:
        assert re.search(rf"step_{step:08d}: {re.escape(file)}: {reason}", message), message
    assert len(warnings) == len(steps)


# ----------------------------------------------------------------------------- corruptions
def bit_flip(path: Path) -> None:
    """Invert 64 bytes at the middle of the file (all of it if shorter)."""
    data = bytearray(path.read_bytes())
    start = max(0, len(data) // 2 - 32)
    for index in range(start, min(len(data), start + 64)):
        data[index] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def empty(path: Path) -> None:
    path.write_bytes(b"")


def garble_header(path: Path) -> None:
    """Invert the first 8 bytes (the header length of a safetensors file)."""
    data = path.read_bytes()
    path.write_bytes(bytes(b ^ 0xFF for b in data[:8]) + data[8:])


KINDS = {"bit_flip": bit_flip, "truncate": truncate, "empty": empty, "garble_header": garble_header}

# What the warning says, by (file, kind), when the manifest still has the original hashes.
STALE_HASH_REASON = {
    "bit_flip": "sha256 mismatch",
    "truncate": r"truncated: \d+ bytes, the manifest records \d+",
    "empty": r"empty file: 0 bytes, the manifest records \d+",
    "garble_header": "sha256 mismatch",
}
MANIFEST_REASON = {
    "bit_flip": r"(not valid JSON|damaged: its own checksum)",
    "truncate": "not valid JSON",
    "empty": "empty file",
    "garble_header": "not valid JSON",
}
# ... and when the manifest was re-sealed over the damaged file, so only parsing catches it.
RESEALED_REASON = {
    MODEL: r"unreadable safetensors file \(SafetensorError",
    OPTIMIZER: "unreadable",
    STATE: "unreadable",
    META: "not valid JSON",
}


def reason_for(file: str, kind: str) -> str:
    return MANIFEST_REASON[kind] if file == MANIFEST else STALE_HASH_REASON[kind]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("file", ALL_FILES)
def test_damaged_newest_falls_back_to_previous(run, file, kind):
    directory, saved = run
    KINDS[kind](step_dir(directory, 4) / file)
    _, warnings = assert_resumed_from(directory, saved, 3)
    assert len(warnings) == 1
    prefix = f"skipping checkpoint {step_dir(directory, 4)}: {file}: "
    assert warnings[0].startswith(prefix), warnings
    assert re.match(reason_for(file, kind), warnings[0][len(prefix) :]), warnings


@pytest.mark.parametrize("kind", ["truncate", "empty", "garble_header"])
@pytest.mark.parametrize("file", DATA_FILES)
def test_damaged_and_resealed_newest_falls_back(run, file, kind):
    """The manifest vouches for the damaged file: parsing must catch it."""
    directory, saved = run
    newest = step_dir(directory, 4)
    KINDS[kind](newest / file)
    write_manifest(newest, 4)
    assert verify_files(newest) == 4  # the hashes now agree
    _, warnings = assert_resumed_from(directory, saved, 3)
    assert len(warnings) == 1
    assert re.match(
        rf"skipping checkpoint {re.escape(str(newest))}: {re.escape(file)}: "
        + RESEALED_REASON[file],
        warnings[0],
    ), warnings


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("file", ALL_FILES)
def test_damaged_everywhere_stops_naming_each_file(run, file, kind):
    directory, _ = run
    for step in STEPS:
        KINDS[kind](step_dir(directory, step) / file)
    assert_no_usable_checkpoint(directory, file, reason_for(file, kind))


@pytest.mark.parametrize("file", ALL_FILES)
def test_missing_file_in_newest_falls_back(run, file):
    directory, saved = run
    (step_dir(directory, 4) / file).unlink()
    _, warnings = assert_resumed_from(directory, saved, 3)
    assert len(warnings) == 1
    assert warnings[0].startswith(f"skipping checkpoint {step_dir(directory, 4)}: {file}: missing")


def test_missing_metadata_in_every_checkpoint_stops(run):
    directory, _ = run
    for step in STEPS:
        (step_dir(directory, step) / META).unlink()
    assert_no_usable_checkpoint(directory, META, r"missing \(listed in manifest\.json\)")
    assert CheckpointManager(directory).has_checkpoints()  # so the run loop must call resume


# ----------------------------------------------------------------------------- NaN tensors
def poke_model(path: Path, tensor: str, value: float) -> None:
    """Write ``value`` into one element of a stored tensor, as a valid safetensors file."""
    file = path / MODEL
    with safetensors.safe_open(file, framework="pt") as handle:
        header = handle.metadata()
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    tensors[tensor].view(-1)[1] = value
    safetensors.torch.save_file(tensors, file, metadata=header)


def poke_optimizer(path: Path, index: int, key: str, value: float) -> None:
    file = path / OPTIMIZER
    state = torch.load(file, weights_only=True)
    state["state"][index][key].view(-1)[1] = value
    torch.save(state, file)


NAN_CASES = {
    "model_nan": (MODEL, lambda p: poke_model(p, "l1.weight", float("nan"))),
    "model_inf": (MODEL, lambda p: poke_model(p, "l2.bias", float("inf"))),
    "buffer_nan": (MODEL, lambda p: poke_model(p, "scale", float("nan"))),
    "optimizer_nan": (OPTIMIZER, lambda p: poke_optimizer(p, 0, "exp_avg", float("nan"))),
    "optimizer_inf": (OPTIMIZER, lambda p: poke_optimizer(p, 3, "exp_avg_sq", float("inf"))),
}
NAN_REASON = {
    "model_nan": r"tensor 'l1\.weight' holds non-finite values \(1 NaN, 0 infinite, of 12\)",
    "model_inf": r"tensor 'l2\.bias' holds non-finite values \(0 NaN, 1 infinite, of 2\)",
    "buffer_nan": r"tensor 'scale' holds non-finite values \(1 NaN, 0 infinite, of 2\)",
    "optimizer_nan": r"optimizer state 'exp_avg' of parameter 'l1\.weight' holds non-finite "
    r"values \(1 NaN, 0 infinite, of 12\)",
    "optimizer_inf": r"optimizer state 'exp_avg_sq' of parameter 'l2\.bias' holds non-finite "
    r"values \(0 NaN, 1 infinite, of 2\)",
}


@pytest.mark.parametrize("resealed", [True, False], ids=["valid_hash", "stale_hash"])
@pytest.mark.parametrize("case", NAN_CASES)
def test_non_finite_tensor_in_newest_falls_back(run, case, resealed):
    directory, saved = run
    newest = step_dir(directory, 4)
    file, poke = NAN_CASES[case]
    poke(newest)
    if resealed:  # a valid file with a valid hash: only the finiteness check can catch it
        write_manifest(newest, 4)
        assert verify_files(newest) == 4
    _, warnings = assert_resumed_from(directory, saved, 3)
    assert len(warnings) == 1
    # stale hash: the re-written safetensors file keeps its size, the torch archive does not
    stale = "sha256 mismatch" if file == MODEL else r"size mismatch: \d+ bytes, the manifest"
    reason = NAN_REASON[case] if resealed else stale
    assert re.match(
        rf"skipping checkpoint {re.escape(str(newest))}: {re.escape(file)}: {reason}", warnings[0]
    ), warnings


def test_read_checkpoint_names_optimizer_parameter_by_index_without_names(run):
    directory, _ = run
    newest = step_dir(directory, 4)
    poke_optimizer(newest, 2, "exp_avg", float("nan"))
    write_manifest(newest, 4)
    with pytest.raises(CheckpointCorruptError, match=r"'exp_avg' of parameter '#2' holds") as info:
        read_checkpoint(newest)
    assert info.value.file == OPTIMIZER and info.value.path == newest


# ----------------------------------------------------------------------------- stale weights
def test_stale_weights_under_newer_step_are_detected(run):
    directory, saved = run
    shutil.copyfile(step_dir(directory, 2) / MODEL, step_dir(directory, 4) / MODEL)
    _, warnings = assert_resumed_from(directory, saved, 3)
    assert len(warnings) == 1
    assert warnings[0].startswith(
        f"skipping checkpoint {step_dir(directory, 4)}: {MODEL}: sha256 mismatch"
    )


def test_older_checkpoint_copied_over_newer_step_is_detected(run):
    directory, saved = run
    shutil.rmtree(step_dir(directory, 4))
    shutil.copytree(step_dir(directory, 2), step_dir(directory, 4))  # with its own manifest
    _, warnings = assert_resumed_from(directory, saved, 3)
    assert warnings == [
        f"skipping checkpoint {step_dir(directory, 4)}: {MANIFEST}: written for step 2, but the "
        "directory is step_00000004 (a checkpoint copied or renamed into the wrong place)"
    ]


# ----------------------------------------------------------------------------- fallback order
def test_two_damaged_checkpoints_fall_back_two_steps_in_order(run):
    directory, saved = run
    bit_flip(step_dir(directory, 4) / OPTIMIZER)
    truncate(step_dir(directory, 3) / MODEL)
    _, warnings = assert_resumed_from(directory, saved, 2)
    assert [w.split(": ")[0] for w in warnings] == [
        f"skipping checkpoint {step_dir(directory, 4)}",
        f"skipping checkpoint {step_dir(directory, 3)}",
    ]
    assert f": {OPTIMIZER}: sha256 mismatch" in warnings[0]
    assert f": {MODEL}: truncated" in warnings[1]


def test_issue_repro_pointer_at_damaged_older_step(run):
    """Newest removed, ``latest`` pointed at step 3, 64 bytes of its optimizer.pt flipped."""
    directory, saved = run
    shutil.rmtree(step_dir(directory, 4))
    (directory / "latest").write_text("step_00000003\n")
    bit_flip(step_dir(directory, 3) / OPTIMIZER)
    trainer, warnings = assert_resumed_from(directory, saved, 2)
    assert len(warnings) == 1 and f"step_00000003: {OPTIMIZER}: sha256 mismatch" in warnings[0]
    trainer.train_step([batch(3)])  # and the run goes on, saving finite checkpoints
    path = trainer.save_checkpoint(CheckpointManager(directory, keep_last=4), METADATA)
    assert path == step_dir(directory, 3) and verify_files(path) == 3


def test_pointer_to_missing_directory_is_reported_and_skipped(run):
    directory, saved = run
    (directory / "latest").write_text("step_00000009\n")
    _, warnings = assert_resumed_from(directory, saved, 4)
    assert warnings == [f"skipping checkpoint {step_dir(directory, 9)}: no such directory"]


def test_checkpoint_without_manifest_predates_manifests(run):
    directory, _ = run
    for step in STEPS:
        (step_dir(directory, step) / MANIFEST).unlink()  # as written by earlier versions
    assert_no_usable_checkpoint(directory, MANIFEST, "missing: this checkpoint predates manifests")


def test_default_warning_is_a_runtime_warning(run):
    directory, _ = run
    empty(step_dir(directory, 4) / STATE)
    trainer = make_trainer(99)
    with pytest.warns(RuntimeWarning, match=rf"skipping checkpoint .*step_00000004: {STATE}"):
        trainer.resume(CheckpointManager(directory), METADATA)
    assert trainer.resumed_from == step_dir(directory, 3)


def test_single_directory_resume_raises_its_own_error(run):
    directory, _ = run
    bit_flip(step_dir(directory, 4) / META)
    trainer = make_trainer(99)
    before = snapshot(trainer)
    with pytest.raises(CheckpointCorruptError, match=rf"step_00000004: {META}: sha256") as info:
        trainer.resume(step_dir(directory, 4), METADATA)
    assert info.value.file == META and info.value.path == step_dir(directory, 4)
    assert_same_snapshot(snapshot(trainer), before)


def test_metadata_mismatch_is_not_a_fallback(run):
    directory, _ = run
    trainer = make_trainer(99)
    before = snapshot(trainer)
    warnings: list[str] = []
    changed = {**METADATA, "model": {"hidden": 8}}
    with pytest.raises(CheckpointMismatchError) as info:
        trainer.resume(CheckpointManager(directory), changed, warn=warnings.append)
    assert f"checkpoint {step_dir(directory, 4)}: metadata does not match" in str(info.value)
    assert "'model.hidden': this run has 8, the checkpoint has 4" in str(info.value)
    assert warnings == []
    # a damaged newest is skipped, then the intact older one's mismatch stops the resume
    bit_flip(step_dir(directory, 4) / MODEL)
    with pytest.raises(CheckpointMismatchError, match=r"step_00000003: metadata does not"):
        trainer.resume(CheckpointManager(directory), changed, warn=warnings.append)
    assert len(warnings) == 1 and "step_00000004" in warnings[0]
    assert_same_snapshot(snapshot(trainer), before)


def test_malformed_trainer_state_with_valid_hash_is_corrupt(run):
    directory, saved = run
    newest = step_dir(directory, 4)
    state = torch.load(newest / STATE, weights_only=True)
    state["rng"]["generator"] = torch.zeros(3, dtype=torch.uint8)
    torch.save(state, newest / STATE)
    write_manifest(newest, 4)
    _, warnings = assert_resumed_from(directory, saved, 3)
    assert re.match(rf"skipping checkpoint .*step_00000004: {STATE}: malformed RNG", warnings[0])
    state["rng"] = torch.load(step_dir(directory, 3) / STATE, weights_only=True)["rng"]
    state["global_step"] = 7
    torch.save(state, newest / STATE)
    write_manifest(newest, 4)
    _, warnings = assert_resumed_from(directory, saved, 3)
    assert warnings[0].endswith(f"{STATE}: 'global_step' is 7, but the manifest says step 4")


# ----------------------------------------------------------------------------- refused saves
def listing(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()
    }


@pytest.mark.parametrize(
    "where, expected",
    [
        ("param", r"model tensor 'l1\.weight' holds non-finite values \(1 NaN, 0 infinite, of 12"),
        ("buffer", r"model tensor 'scale' holds non-finite values \(0 NaN, 1 infinite, of 2\)"),
        (
            "optimizer",
            r"optimizer state 'exp_avg_sq' of parameter 'l2\.bias' holds non-finite values "
            r"\(1 NaN, 0 infinite, of 2\)",
        ),
    ],
)
def test_save_with_non_finite_state_is_refused_and_writes_nothing(run, where, expected):
    directory, _ = run
    trainer, _, _ = resume(directory)
    trainer.train_step([batch(5)])
    with torch.no_grad():
        if where == "param":
            trainer.model.l1.weight[0, 0] = float("nan")
        elif where == "buffer":
            trainer.model.scale[1] = float("inf")
        else:
            trainer.optimizer.state[trainer.model.l2.bias]["exp_avg_sq"][0] = float("nan")
    before = listing(directory)
    with pytest.raises(NonFiniteStateError, match=expected) as info:
        trainer.save_checkpoint(CheckpointManager(directory, keep_last=4), METADATA)
    assert "Nothing was written (the latest checkpoint is still step_00000004)" in str(info.value)
    assert info.value.tensor == re.match(r"(.*?) holds", expected.replace("\\", "")).group(1)
    assert listing(directory) == before  # nothing written, nothing pruned, pointer unchanged


# ----------------------------------------------------------------------------- disk full
def enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def partial_then_enospc_torch_save(obj, f, *args, **kwargs):
    f.write(b"PK\x03\x04partial")
    enospc()


def partial_then_enospc_save_model(model, filename, *args, **kwargs):
    Path(filename).write_bytes(b"garbage")
    raise RuntimeError(  # how safetensors reports an OS error: not an OSError
        'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No '
        'space left on device" })'
    )


DISK_FULL_POINTS = {
    "model": (safetensors.torch, "save_model", partial_then_enospc_save_model),
    "optimizer": (torch, "save", partial_then_enospc_torch_save),
    "manifest": (ckpt, "write_manifest", enospc),
    "fsync": (ckpt, "_fsync_dir", enospc),
    "pointer": (ckpt, "_write_file", None),  # fails only for the pointer (set below)
}


@pytest.mark.parametrize("point", DISK_FULL_POINTS)
def test_disk_full_keeps_previous_checkpoint(run, monkeypatch, point):
    directory, saved = run
    trainer, _, _ = resume(directory)
    trainer.train_step([batch(5)])
    manager = CheckpointManager(directory, keep_last=4)
    before = listing(directory)
    target, name, replacement = DISK_FULL_POINTS[point]
    if point == "pointer":
        real = ckpt._write_file

        def replacement(path, write):
            if path.name.startswith(".tmp-latest"):
                enospc()
            real(path, write)

    monkeypatch.setattr(target, name, replacement)
    with pytest.raises(CheckpointDiskFullError) as info:
        trainer.save_checkpoint(manager, METADATA)
    monkeypatch.undo()

    error = info.value
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC
    message = str(error)
    assert f"disk full while writing checkpoint step_00000005 in {directory}" in message
    assert "the previous checkpoint step_00000004 is intact and `latest` still points at it" in (
        message
    )
    assert not [p for p in directory.iterdir() if p.name.startswith(".tmp-")]
    assert (directory / "latest").read_text() == "step_00000004\n"
    after = listing(directory)
    if point == "pointer":  # the new checkpoint is complete, only the pointer update failed
        assert "step_00000005 was written completely, but `latest` was not updated" in message
        assert verify_files(step_dir(directory, 5)) == 5
        after = {k: v for k, v in after.items() if not k.startswith("step_00000005")}
    else:
        assert "step_00000005 was not saved (its partial copy was removed)" in message
    assert after == before
    assert_resumed_from(directory, saved, 4)


class _FillingDisk:
    """``open`` for the checkpoint writer on a disk with ``free`` bytes left: a write that
    does not fit writes what fits, then raises ENOSPC, as a file system does. Behind
    ``torch.save`` the zip writer then raises its own ``RuntimeError: [enforce fail at
    inline_container.cc:...] unexpected pos ...`` (the OSError only its context)."""

    def __init__(self, free: int) -> None:
        self.free = free

    def __call__(self, path, mode="r", *args, **kwargs):
        handle = open(path, mode, *args, **kwargs)  # noqa: SIM115
        if "w" not in mode:
            return handle
        disk, real_write = self, handle.write

        def write(data) -> int:
            room = min(len(data), disk.free)
            if room:
                real_write(bytes(memoryview(data)[:room]))
                disk.free -= room
            if room < len(data):
                raise OSError(errno.ENOSPC, "No space left on device")
            return room

        handle.write = write
        return handle


def test_a_full_disk_inside_torch_save_is_a_disk_full_error_at_every_level(run, monkeypatch):
    """At every level of free space, a save either completes or raises
    CheckpointDiskFullError (never torch's RuntimeError), and the previous checkpoint stays
    the loadable `latest`."""
    directory, saved = run
    trainer, _, _ = resume(directory)
    trainer.train_step([batch(5)])
    manager = CheckpointManager(directory, keep_last=10)
    before = listing(directory)
    weights = len((step_dir(directory, 4) / MODEL).read_bytes())  # written by safetensors
    needed = sum(len(v) for k, v in before.items() if k.startswith("step_00000004/"))
    seen = set()
    for free in range(0, needed + 512, 97):
        monkeypatch.setattr(ckpt, "open", _FillingDisk(free), raising=False)
        try:
            trainer.save_checkpoint(manager, METADATA, {"position": 5})
        except CheckpointDiskFullError as error:
            seen.add(type(error.__cause__).__name__)
            message = str(error)
            assert "disk full while writing checkpoint step_00000005" in message, message
            assert "the previous checkpoint step_00000004 is intact" in message, message
            assert "\n" not in message
            assert (directory / "latest").read_text() == "step_00000004\n"
            assert not [p for p in directory.iterdir() if p.name.startswith(".tmp-")]
            assert listing(directory) == before
            continue
        finally:
            monkeypatch.undo()
        assert free >= needed - weights - 1024, free  # it fitted only with room for it
        break
    else:
        pytest.fail("no level of free space let the save complete")
    # torch.save's zip writer reported the short write as a RuntimeError at some levels
    assert "RuntimeError" in seen and "OSError" in seen, seen
    assert_resumed_from(directory, {**saved, 5: params(trainer)}, 5)


def test_the_zip_writers_runtime_error_alone_is_recognised():
    """torch.save to a path reports a full disk as RuntimeError('... unexpected pos ...')
    whose context is no OSError at all: the text alone says it."""
    error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    error.__context__ = RuntimeError("basic_ios::clear: iostream error")
    assert ckpt.is_disk_full(error)
    assert ckpt.is_disk_full(
        safetensors.SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        )
    )
    assert not ckpt.is_disk_full(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def _mount_tmpfs(path: Path, size: int) -> bool:
    """Mount a tmpfs of ``size`` bytes at ``path`` (root only); whether it worked."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        check=False,
    )
    return done.returncode == 0


def test_a_real_full_tmpfs_at_every_level_of_free_space(pristine, tmp_path):
    """A real full disk: a small tmpfs filled up to leave 0, 1, 2, ... pages free. Every
    save either completes or raises CheckpointDiskFullError, and the previous checkpoint
    stays intact and loadable (needs root to mount; skipped otherwise)."""
    mount = tmp_path / "tmpfs"
    if not _mount_tmpfs(mount, 1 << 20):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        root, saved = pristine
        directory = mount / "checkpoints"
        directory.mkdir()
        shutil.copytree(step_dir(root, 4), step_dir(directory, 4))
        (directory / "latest").write_text("step_00000004\n")
        trainer, _, _ = resume(directory)
        trainer.train_step([batch(5)])
        filler = mount / "filler"
        outcomes = []
        for pages in range(0, 64):
            with open(filler, "wb", buffering=0) as handle:  # fill it, then free `pages`
                try:
                    while True:
                        handle.write(b"\0" * 4096)
                except OSError:
                    pass
            os.truncate(filler, max(0, filler.stat().st_size - pages * 4096))
            manager = CheckpointManager(directory, keep_last=10)
            try:
                trainer.save_checkpoint(manager, METADATA, {"position": 5})
            except CheckpointDiskFullError as error:
                outcomes.append(type(error.__cause__).__name__)
                message = str(error)
                assert "the previous checkpoint step_00000004 is intact" in message
                assert (directory / "latest").read_text() == "step_00000004\n"
                names = sorted(p.name for p in directory.iterdir())
                if "was written completely, but `latest` was not updated" in message:
                    assert names == ["latest", "step_00000004", "step_00000005"]
                    assert verify_files(step_dir(directory, 5)) == 5
                else:
                    assert "step_00000005 was not saved" in message
                    assert names == ["latest", "step_00000004"]
                continue
            outcomes.append("saved")
            break
        assert outcomes[-1] == "saved" and len(outcomes) > 1, outcomes
        filler.unlink()
        assert_resumed_from(directory, {**saved, 5: params(trainer)}, 5)
        shutil.rmtree(step_dir(directory, 5))
        (directory / "latest").write_text("step_00000004\n")
        assert_resumed_from(directory, saved, 4)
    finally:
        subprocess.run(["umount", str(mount)], check=False)


# ----------------------------------------------------------------------------- staging
def test_staging_left_by_a_kill_is_cleaned_at_start(run):
    directory, saved = run
    (directory / ".tmp-step_00000005-deadbeef").mkdir()
    (directory / ".tmp-step_00000005-deadbeef" / MODEL).write_bytes(b"half")
    (directory / ".tmp-latest-cafebabe").write_text("step_00000005\n")
    # a re-save of step 4 killed between moving the old copy aside and renaming the new one
    # in: the old copy is put back; a re-save of step 3 killed later: its old copy is removed
    step_dir(directory, 4).rename(directory / ".tmp-replaced-step_00000004-0badf00d")
    shutil.copytree(step_dir(directory, 3), directory / ".tmp-replaced-step_00000003-0badf00d")
    manager = CheckpointManager(directory)
    assert sorted(p.name for p in directory.iterdir()) == [
        "latest",
        *(f"step_{s:08d}" for s in STEPS),
    ]
    assert manager.latest() == step_dir(directory, 4)
    assert_resumed_from(directory, saved, 4)
