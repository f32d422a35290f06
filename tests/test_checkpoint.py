"""CheckpointManager: atomic writes, crash safety, keep_last, tied weights, metadata checks."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import safetensors.torch
import torch
from torch import nn

from diffusion_rl.train import checkpoint
from diffusion_rl.train.checkpoint import (
    CheckpointManager,
    CheckpointMismatchError,
    check_model_compatible,
    validate_metadata,
    verify_files,
)


class TiedLM(nn.Module):
    """Embedding and output head share one weight."""

    def __init__(self, vocab: int = 8, dim: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mid = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(ids))))


def trained(seed: int) -> tuple[TiedLM, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TiedLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    model(ids).logsumexp(-1).sum().backward()
    optimizer.step()
    return model, optimizer


def state(step: int) -> dict:
    return {"global_step": step, "rng": torch.arange(3), "nested": {"xs": [1.5, 2], "none": None}}


def assert_same_tensors(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same_tensors(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_tensors(x, y)
    else:
        assert a == b


def test_round_trip_with_tied_weights(tmp_path):
    model, optimizer = trained(0)
    manager = CheckpointManager(tmp_path / "ckpt")
    path = manager.save(7, model, optimizer, state(7), {"model": {"dim": 4}})
    assert path.name == "step_00000007"
    assert sorted(p.name for p in path.iterdir()) == [
        "manifest.json",
        "metadata.json",
        "model.safetensors",
        "optimizer.pt",
        "trainer_state.pt",
    ]
    assert manager.latest() == path

    fresh, fresh_optimizer = trained(1)
    trainer_state, metadata = manager.load(path, fresh, fresh_optimizer)
    assert fresh.head.weight is fresh.emb.weight  # the tie survives
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    assert_same_tensors(optimizer.state_dict(), fresh_optimizer.state_dict())
    assert_same_tensors(trainer_state, state(7))
    assert metadata == {"model": {"dim": 4}}


def test_manifest_records_size_and_sha256_of_every_file(tmp_path):
    model, optimizer = trained(0)
    path = CheckpointManager(tmp_path).save(5, model, optimizer, state(5), {"v": 1})
    files = {}
    for name in ["metadata.json", "model.safetensors", "optimizer.pt", "trainer_state.pt"]:
        data = (path / name).read_bytes()
        files[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    body = {"format": 1, "step": 5, "files": files}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest == {**body, "manifest_sha256": hashlib.sha256(canonical).hexdigest()}
    assert verify_files(path) == 5


def test_has_checkpoints_and_candidate_order(tmp_path):
    directory = tmp_path / "ckpt"
    manager = CheckpointManager(directory)
    assert not manager.has_checkpoints() and manager.candidates() == [] and manager.latest() is None
    directory.mkdir()
    (directory / ".tmp-step_00000001-abcdef12").mkdir()  # staging is not a checkpoint
    manager = CheckpointManager(directory)
    assert not manager.has_checkpoints() and list(directory.iterdir()) == []  # and is removed
    model, optimizer = trained(0)
    for step in (1, 2, 3):
        manager.save(step, model, optimizer, state(step), {})
    (directory / "latest").write_text("step_00000002\n")
    manager.path_for(5).mkdir()  # incomplete: still tried (and reported) by a resume
    assert manager.candidates() == [manager.path_for(s) for s in (2, 5, 3, 1)]
    assert manager.latest() == manager.path_for(2)
    for step in (1, 2, 3, 5):
        shutil.rmtree(manager.path_for(step))
    assert manager.has_checkpoints()  # a pointer alone: something was there
    assert manager.candidates() == [manager.path_for(2)]
    (directory / "latest").unlink()
    manager.path_for(7).mkdir()
    assert manager.has_checkpoints() and manager.latest() is None


def test_keep_last_and_latest_pointer(tmp_path):
    model, optimizer = trained(0)
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in range(1, 6):
        manager.save(step, model, optimizer, state(step), {})
    assert [p.name for p in manager.checkpoints()] == ["step_00000004", "step_00000005"]
    assert (tmp_path / "latest").read_text().strip() == "step_00000005"
    assert manager.latest() == tmp_path / "step_00000005"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_saving_an_existing_step_replaces_it(tmp_path):
    model, optimizer = trained(0)
    manager = CheckpointManager(tmp_path)
    manager.save(3, model, optimizer, state(3), {"v": 1})
    manager.save(3, model, optimizer, state(3), {"v": 2})
    assert [p.name for p in manager.checkpoints()] == ["step_00000003"]
    assert json.loads((manager.latest() / "metadata.json").read_text()) == {"v": 2}


def _partial_torch_save(obj, f, *args, **kwargs):
    f.write(b"\x80\x02partial")
    raise RuntimeError("simulated crash during torch.save")


def _partial_save_model(model, filename, *args, **kwargs):
    with open(filename, "wb") as handle:
        handle.write(b"garbage")
    raise RuntimeError("simulated crash during save_model")


def _crash(*args, **kwargs):
    raise RuntimeError("simulated crash")


@pytest.mark.parametrize(
    "target, replacement",
    [
        (torch, ("save", _partial_torch_save)),
        (safetensors.torch, ("save_model", _partial_save_model)),
        (checkpoint, ("_fsync_dir", _crash)),  # every file written, before the rename
        (checkpoint.CheckpointManager, ("_point_latest_at", _crash)),  # after the rename
    ],
    ids=["torch.save", "save_model", "before-rename", "before-pointer"],
)
def test_crash_mid_write_keeps_previous_checkpoint(tmp_path, monkeypatch, target, replacement):
    model, optimizer = trained(0)
    manager = CheckpointManager(tmp_path, keep_last=2)
    manager.save(1, model, optimizer, state(1), {"run": "a"})
    good = manager.save(2, model, optimizer, state(2), {"run": "a"})
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    later_model, later_optimizer = trained(5)
    monkeypatch.setattr(target, *replacement)
    with pytest.raises(RuntimeError, match="simulated crash"):
        manager.save(3, later_model, later_optimizer, state(3), {"run": "a"})
    monkeypatch.undo()

    assert manager.latest() == good
    assert [p.name for p in manager.checkpoints()][:2] == ["step_00000001", "step_00000002"]
    fresh, _ = trained(9)
    trainer_state, metadata = manager.load(manager.latest(), fresh)
    assert trainer_state["global_step"] == 2 and metadata == {"run": "a"}
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, expected[name]), name

    manager.save(4, model, optimizer, state(4), {"run": "a"})  # cleans temporaries up
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    assert manager.latest().name == "step_00000004"
    assert len(manager.checkpoints()) == 2


def test_leftover_temp_dir_is_ignored_then_removed(tmp_path):
    model, optimizer = trained(0)
    manager = CheckpointManager(tmp_path)
    good = manager.save(1, model, optimizer, state(1), {})
    stale = tmp_path / ".tmp-step_00000009-deadbeef"  # a process killed mid-write
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    assert manager.latest() == good and manager.checkpoints() == [good]
    manager.save(2, model, optimizer, state(2), {})
    assert not stale.exists()


def test_latest_falls_back_when_pointer_is_missing_or_stale(tmp_path):
    model, optimizer = trained(0)
    manager = CheckpointManager(tmp_path)
    assert manager.latest() is None
    manager.save(1, model, optimizer, state(1), {})
    manager.save(2, model, optimizer, state(2), {})
    (tmp_path / "latest").write_text("step_00000042\n")
    assert manager.latest().name == "step_00000002"
    (tmp_path / "latest").unlink()
    (tmp_path / "step_00000002" / "optimizer.pt").unlink()  # incomplete: skipped
    assert manager.latest().name == "step_00000001"


def test_unloadable_trainer_state_fails_before_writing(tmp_path):
    model, optimizer = trained(0)
    manager = CheckpointManager(tmp_path)
    with pytest.raises(TypeError, match=r"trainer_state\.data\.sampler: a object"):
        manager.save(1, model, optimizer, {"data": {"sampler": object()}}, {})
    with pytest.raises(TypeError, match="metadata: must be JSON-serialisable"):
        manager.save(1, model, optimizer, {}, {"x": object()})
    assert manager.latest() is None
    assert not [p for p in tmp_path.iterdir() if p.name != "latest"]


def test_keep_last_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(tmp_path, keep_last=0)


def test_weights_that_do_not_fit_are_rejected_before_loading(tmp_path):
    model, optimizer = trained(0)
    path = CheckpointManager(tmp_path).save(1, model, optimizer, {}, {})
    other = TiedLM(dim=5)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointMismatchError, match=r"'mid\.weight': expected \(5, 5\)"):
        CheckpointManager(tmp_path).load(path, other)
    for name, value in other.state_dict().items():
        assert torch.equal(value, before[name]), name
    half = TiedLM().to(torch.bfloat16)
    with pytest.raises(
        CheckpointMismatchError, match=r"torch\.bfloat16.*found \(4, 4\) torch\.float32"
    ):
        check_model_compatible(path, half)


# ----------------------------------------------------------------------------- metadata
def test_validate_metadata_accepts_equal_and_json_normalised():
    validate_metadata({"a": 1, "b": {"betas": (0.9, 0.99)}}, {"a": 1, "b": {"betas": [0.9, 0.99]}})


def test_validate_metadata_names_nested_key_this_run_and_checkpoint():
    with pytest.raises(CheckpointMismatchError) as info:
        validate_metadata(
            {"model": {"hidden": 32, "vocab": 8}}, {"model": {"hidden": 64, "vocab": 8}}
        )
    message = str(info.value)
    assert "'model.hidden': this run has 32, the checkpoint has 64" in message
    assert "vocab" not in message
    assert "start a new output directory" in message and "pass the same configuration" in message


def test_validate_metadata_missing_and_unexpected_keys():
    with pytest.raises(
        CheckpointMismatchError,
        match=r"'data\.path': this run has 'x\.jsonl', the checkpoint has no such key",
    ):
        validate_metadata({"data": {"path": "x.jsonl", "n": 1}}, {"data": {"n": 1}})
    with pytest.raises(
        CheckpointMismatchError, match=r"'extra': this run has no such key, the checkpoint has 3"
    ):
        validate_metadata({"a": 1}, {"a": 1, "extra": 3})
    with pytest.raises(
        CheckpointMismatchError, match=r"'flag': this run has True, the checkpoint has 1"
    ):
        validate_metadata({"flag": True}, {"flag": 1})
    with pytest.raises(
        CheckpointMismatchError, match=r"'model': this run has \{'dim': 4\}, the checkpoint has 4"
    ):
        validate_metadata({"model": {"dim": 4}}, {"model": 4})
    with pytest.raises(CheckpointMismatchError, match=r"^checkpoint /x/step_00000001: metadata"):
        validate_metadata({"a": 1}, {"a": 2}, where="/x/step_00000001")
