"""Model directories: one loader (load_model) and one writer (save_model) for both kinds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

from diffusion_rl.models import (
    CharTokenizer,
    DiffusionTransformer,
    FlowDiT,
    FlowDiTConfig,
    LoadedModel,
    load_model,
    save_model,
)
from diffusion_rl.models import io as model_io
from diffusion_rl.tasks.geneval import GenEvalConfig, GenEvalTask

CHARS = "0123456789+-="  # 3 specials + 13 characters = tiny_model's vocabulary of 16


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _flow_model(seed: int = 0, task: dict | None = None) -> FlowDiT:
    torch.manual_seed(seed)
    config = FlowDiTConfig(
        image_size=16, patch_size=4, d_model=32, n_layers=1, n_heads=4, task=task
    )
    model = FlowDiT(config)
    with torch.no_grad():  # the zero-initialised layers too, so every weight is checked
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    return model


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and torch.equal(sa[name], sb[name]), name


def _siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir())


def test_token_model_round_trip(tmp_path):
    model, tokenizer = tiny_model("block_causal"), CharTokenizer(CHARS)
    info = {"task": {"name": "arithmetic"}, "sampler": {"temperature": 0.0}, "trained_steps": 3}
    path = save_model(tmp_path / "tok", model.train(), info, tokenizer)
    assert path == tmp_path / "tok"
    assert sorted(p.name for p in path.iterdir()) == [
        "config.json",
        "diffusion_rl.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    loaded = load_model(path)
    assert isinstance(loaded, LoadedModel) and loaded.kind == "token"
    assert isinstance(loaded.model, DiffusionTransformer) and not loaded.model.training
    assert loaded.model.config == model.config
    assert loaded.tokenizer == tokenizer
    assert loaded.info == {"tokenizer": tokenizer.name, **info}
    _assert_same_weights(model, loaded.model)
    save_model(path, tiny_model("block_causal", seed=1), info, tokenizer)  # overwrite
    assert _siblings(path) == ["tok"]  # no staging or retired directory left behind
    _assert_same_weights(tiny_model("block_causal", seed=1), load_model(str(path)).model)


def test_flow_model_round_trip(tmp_path):
    task = GenEvalTask(GenEvalConfig(image_size=16, seed=3)).info()
    model = _flow_model(task=task)
    path = save_model(tmp_path / "flow", model, {"trained_steps": 2, "sampler": {"num_steps": 4}})
    assert sorted(p.name for p in path.iterdir()) == [
        "config.json",
        "diffusion_rl.json",
        "model.safetensors",
    ]
    loaded = load_model(path)
    assert loaded.kind == "flow" and loaded.tokenizer is None
    assert isinstance(loaded.model, FlowDiT) and not loaded.model.training
    assert loaded.model.config == model.config
    # the info file lacks the task: it comes from the model's config
    assert loaded.info == {"trained_steps": 2, "sampler": {"num_steps": 4}, "task": task}
    _assert_same_weights(model, loaded.model)
    assert _siblings(path) == ["flow"]

    # a task recorded in the info file wins; no info file at all is fine
    save_model(path, model, {"task": {"name": "other"}})
    assert load_model(path).info == {"task": {"name": "other"}}
    (path / model_io.INFO_FILE).unlink()
    assert load_model(path).info == {"task": task}
    save_model(tmp_path / "bare", _flow_model(), {})
    assert load_model(tmp_path / "bare").info == {}


def test_save_model_refuses_bad_arguments(tmp_path):
    with pytest.raises(
        ValueError, match="DiffusionTransformer is a token model; pass its tokenizer"
    ):
        save_model(tmp_path / "t", tiny_model(), {})
    with pytest.raises(ValueError, match="flow model and takes no tokenizer"):
        save_model(tmp_path / "f", _flow_model(), {}, CharTokenizer(CHARS))
    with pytest.raises(TypeError, match=r"registered model class .*got Linear"):
        save_model(tmp_path / "l", torch.nn.Linear(2, 2), {})
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="exists and is not a directory"):
        save_model(tmp_path / "file", _flow_model(), {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # nothing was written


def test_load_model_errors_name_the_path(tmp_path):
    known = r"known model types: \['diffusion_rl.flow_dit', 'diffusion_rl.transformer'\]"
    missing = tmp_path / "missing"
    with pytest.raises(FileNotFoundError, match=f"model directory {missing} does not exist"):
        load_model(missing)
    (tmp_path / "a_file").write_text("{}")
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'a_file'} is not a directory"):
        load_model(tmp_path / "a_file")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=f"{empty}: no config.json .*{known}"):
        load_model(empty)

    bad = tmp_path / "bad"
    bad.mkdir()
    config = bad / "config.json"
    config.write_text("{not json")
    with pytest.raises(ValueError, match=f"{config}: not valid JSON .*{known}"):
        load_model(bad)
    config.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ValueError, match=f"{config}: not valid JSON"):
        load_model(bad)
    config.write_text("[1, 2]")
    with pytest.raises(ValueError, match=f"{config}: expected a JSON object .*got list"):
        load_model(bad)
    config.write_text(json.dumps({"d_model": 8}))
    with pytest.raises(ValueError, match=f"{config}: no model_type; {known}"):
        load_model(bad)
    config.write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match=f"{config}: unknown model_type 'llama'; {known}"):
        load_model(bad)

    # a broken info file, a missing tokenizer, a tokenizer of another vocabulary
    path = save_model(tmp_path / "tok", tiny_model(), {}, CharTokenizer(CHARS))
    (path / model_io.INFO_FILE).write_text("{")
    with pytest.raises(ValueError, match=f"{path / model_io.INFO_FILE}: not valid JSON"):
        load_model(path)
    (path / model_io.INFO_FILE).write_text("{}")
    (path / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_model(path)
    save_model(path, tiny_model(), {}, CharTokenizer(CHARS + "*"))
    with pytest.raises(ValueError, match=r"tokenizer \(vocab 17, mask 1\) does not match"):
        load_model(path)


@pytest.mark.parametrize("kind", ["token", "flow"])
def test_an_interrupted_save_leaves_the_previous_directory(tmp_path, monkeypatch, kind):
    def build(seed):
        return tiny_model(seed=seed) if kind == "token" else _flow_model(seed)

    tokenizer = CharTokenizer(CHARS) if kind == "token" else None
    path = save_model(tmp_path / "model", build(0), {"trained_steps": 1}, tokenizer)
    before = {p.name: p.read_bytes() for p in path.iterdir()}

    real_rename = Path.rename

    def failing_rename(self, target):
        if Path(target) == path and self.parent != path.parent:  # staging → into place
            raise OSError("disk on fire")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", failing_rename)
    with pytest.raises(OSError, match="disk on fire"):
        save_model(path, build(1), {"trained_steps": 2}, tokenizer)
    monkeypatch.setattr(Path, "rename", real_rename)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert _siblings(path) == ["model"]

    def failing_dump(*args, **kwargs):  # dies while the staging directory is written
        raise KeyboardInterrupt

    monkeypatch.setattr(model_io.json, "dumps", failing_dump)
    with pytest.raises(KeyboardInterrupt):
        save_model(path, build(2), {"trained_steps": 3}, tokenizer)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert _siblings(path) == ["model"]
    loaded = load_model(path)
    assert loaded.info["trained_steps"] == 1
    _assert_same_weights(build(0), loaded.model)


def test_the_registry_dispatches_on_model_type(tmp_path, monkeypatch):
    class Toy:
        """A stand-in for an external architecture registered with one entry."""

        @classmethod
        def from_pretrained(cls, directory):
            return _flow_model(task={"name": "toy", "from": str(directory)})

    monkeypatch.setitem(model_io.MODEL_TYPES, "toy", model_io.ModelType("flow", Toy))
    (tmp_path / "toy").mkdir()
    (tmp_path / "toy" / "config.json").write_text(json.dumps({"model_type": "toy"}))
    loaded = load_model(tmp_path / "toy")
    assert loaded.kind == "flow" and loaded.info == {
        "task": {"name": "toy", "from": str(tmp_path / "toy")}
    }
    with pytest.raises(ValueError, match="kind: expected one of"):
        model_io.register_model_type("x", Toy, "audio")
    with pytest.raises(TypeError, match="no from_pretrained"):
        model_io.register_model_type("x", object, "flow")
