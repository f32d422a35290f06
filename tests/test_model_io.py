"""Model directories: one loader (load_model) and one writer (save_model) for both kinds."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from conftest import tiny_model, write_config
from flow_toy import one_thread  # noqa: F401 (fixture: one CPU thread per module)

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
from diffusion_rl.models.loading import ManifestMismatchError
from diffusion_rl.models.manifest import write_manifest
from diffusion_rl.tasks.geneval import GenEvalConfig, GenEvalTask

CHARS = "0123456789+-="  # 3 specials + 13 characters = tiny_model's vocabulary of 16


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
        "manifest.json",
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
        "manifest.json",
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
    write_manifest(path)  # sealed again without it (removed, it is a manifest mismatch)
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
    known = r"known model types: \['diffusion_rl.flow_dit', 'diffusion_rl.flow_pipeline', 'diffusion_rl.flow_video_dit', 'diffusion_rl.transformer'\]"
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
    with pytest.raises(ValueError, match=f"{config}:1:2: not valid JSON: Expecting .*{known}"):
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
    recorded = (path / model_io.INFO_FILE).read_bytes()
    (path / model_io.INFO_FILE).write_text("{")
    with pytest.raises(ValueError, match=f"{path / model_io.INFO_FILE}:1:2: not valid JSON"):
        load_model(path)
    (path / model_io.INFO_FILE).write_bytes(recorded)
    (path / "tokenizer.json").unlink()
    with pytest.raises(ManifestMismatchError, match=f"{path / 'tokenizer.json'}: missing"):
        load_model(path)
    (path / "manifest.json").unlink()  # unverified, the loader's own message
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


# ----------------------------------------------------------------------------- bounded loading
TOKEN_CONFIG = {
    "model_type": "diffusion_rl.transformer",
    "vocab_size": 16,
    "mask_token_id": 1,
    "d_model": 32,
    "n_layers": 2,
    "n_heads": 4,
    "max_seq_len": 48,
    "attention": "block_causal",
    "block_size": 4,
    "tie_embeddings": False,
}
FLOW_CONFIG = {
    "model_type": "diffusion_rl.flow_dit",
    "image_size": 16,
    "patch_size": 4,
    "d_model": 32,
    "n_layers": 1,
    "n_heads": 4,
}
MAX_REFUSAL_S = 1.0  # generous: a refusal reads two small JSON files; an allocation would not end


@pytest.mark.parametrize(
    "config",
    [
        TOKEN_CONFIG,
        {**TOKEN_CONFIG, "tie_embeddings": True},
        {**TOKEN_CONFIG, "d_ff": 50, "attention": "bidirectional", "block_size": None},
        {**TOKEN_CONFIG, "vocab_size": 37, "d_model": 24, "n_layers": 3, "n_heads": 3},
        FLOW_CONFIG,
        {**FLOW_CONFIG, "channels": 1, "mlp_ratio": 2.5, "sigma_features": 16, "n_layers": 3},
        {**FLOW_CONFIG, "image_size": 32, "patch_size": 8, "vocabulary": ["a", "b", "c"]},
        {"model_type": "diffusion_rl.flow_dit"},  # the default FlowDiT: 0.73 M
    ],
)
def test_estimate_parameters_equals_the_built_models_count(config):
    """The formula, from config.json alone, equals ``sum(p.numel())`` of the built model."""
    entry = model_io.MODEL_TYPES[config["model_type"]]
    data = {k: v for k, v in config.items() if k != "model_type"}
    model = entry.loader(entry.config_class(**data))
    built = sum(p.numel() for p in model.parameters())
    assert model_io.estimate_parameters(config) == built
    assert model_io.estimate_load_bytes(built) == 2 * 4 * built  # float32, plus the file read


def _refused(path: Path, error: type, match: str) -> float:
    start = time.perf_counter()
    with pytest.raises(error, match=match):
        load_model(path)
    elapsed = time.perf_counter() - start
    assert elapsed < MAX_REFUSAL_S
    return elapsed


BAD_CONFIGS = [
    # sizes beyond the documented limits
    (TOKEN_CONFIG, {"d_model": 2**31}, r"d_model=2147483648 exceeds the limit 65536$"),
    (TOKEN_CONFIG, {"vocab_size": 2**33}, r"vocab_size=8589934592 exceeds the limit 1048576"),
    (TOKEN_CONFIG, {"n_layers": 10**7}, r"n_layers=10000000 exceeds the limit 1024"),
    (TOKEN_CONFIG, {"n_heads": 2**20}, r"n_heads=1048576 exceeds the limit 1024"),
    (TOKEN_CONFIG, {"d_ff": 2**40}, r"d_ff=1099511627776 exceeds the limit 262144"),
    (TOKEN_CONFIG, {"max_seq_len": 10**9}, r"max_seq_len=1000000000 exceeds the limit 1048576"),
    (TOKEN_CONFIG, {"block_size": 2**40}, r"block_size=1099511627776 exceeds the limit"),
    (FLOW_CONFIG, {"d_model": 2**31}, r"d_model=2147483648 exceeds the limit 65536"),
    (FLOW_CONFIG, {"n_layers": 10**7}, r"n_layers=10000000 exceeds the limit 1024"),
    (FLOW_CONFIG, {"image_size": 2**31}, r"image_size=2147483648 exceeds the limit 4096"),
    (FLOW_CONFIG, {"channels": 10**6}, r"channels=1000000 exceeds the limit 64"),
    (FLOW_CONFIG, {"mlp_ratio": 1e9}, r"mlp_ratio=1000000000.0 exceeds the limit 64.0"),
    (FLOW_CONFIG, {"sigma_features": 2**40}, r"sigma_features=1099511627776 exceeds"),
    (FLOW_CONFIG, {"max_prompt_tokens": 10**9}, r"max_prompt_tokens=1000000000 exceeds"),
    (
        FLOW_CONFIG,
        {"image_size": 4096, "patch_size": 1},
        r"patch_size: image_size=4096 in patches of 1 gives 16777216 patches, more than the "
        r"limit 65536",
    ),
    # negative, zero, bool, string, float, null, list sizes
    (TOKEN_CONFIG, {"d_model": -4}, r"d_model: must be > 0 \(got -4\)"),
    (TOKEN_CONFIG, {"n_layers": 0}, r"n_layers: must be > 0 \(got 0\)"),
    (TOKEN_CONFIG, {"mask_token_id": -1}, r"mask_token_id: must be >= 0 \(got -1\)"),
    (TOKEN_CONFIG, {"d_model": True}, r"d_model: expected an integer, got bool True"),
    (TOKEN_CONFIG, {"d_model": "32"}, r"d_model: expected an integer, got str '32'"),
    (TOKEN_CONFIG, {"d_model": 32.0}, r"d_model: expected an integer, got float 32.0"),
    (TOKEN_CONFIG, {"vocab_size": 16.5}, r"vocab_size: expected an integer, got float 16.5"),
    (TOKEN_CONFIG, {"d_model": None}, r"d_model: input should be a valid integer \(got None\)"),
    (TOKEN_CONFIG, {"n_heads": [4]}, r"n_heads: expected an integer, got list \[4\]"),
    (FLOW_CONFIG, {"image_size": -16}, r"image_size: must be > 0 \(got -16\)"),
    (FLOW_CONFIG, {"patch_size": False}, r"patch_size: expected an integer, got bool False"),
    (FLOW_CONFIG, {"n_heads": "4"}, r"n_heads: expected an integer, got str '4'"),
    (FLOW_CONFIG, {"mlp_ratio": -1.0}, r"mlp_ratio: must be > 0.0 \(got -1.0\)"),
    (TOKEN_CONFIG, {"norm_eps": float("nan")}, r"norm_eps: input should be a finite number"),
    (TOKEN_CONFIG, {"norm_eps": 0.0}, r"norm_eps: must be > 0.0 \(got 0.0\)"),
    # missing and unknown keys, cross-field checks
    (TOKEN_CONFIG, {"vocab_size": None, "drop": "vocab_size"}, r"missing key vocab_size"),
    (TOKEN_CONFIG, {"drop": "mask_token_id"}, r"missing key mask_token_id"),
    (TOKEN_CONFIG, {"n_embd": 32}, r"n_embd: unknown key; remove it or check its spelling"),
    (TOKEN_CONFIG, {"mask_token_id": 16}, r"mask_token_id: must be < vocab_size=16, got 16"),
    (TOKEN_CONFIG, {"d_model": 30}, r"d_model: must be divisible by n_heads=4, got 30"),
    (FLOW_CONFIG, {"image_size": 18}, r"image_size: must be divisible by patch_size=4"),
    (FLOW_CONFIG, {"vocabulary": ["a", "a"]}, r"vocabulary: expected distinct"),
    (
        TOKEN_CONFIG,
        {"attention": "sparse"},
        r"attention: input should be 'bidirectional' or 'block_causal' \(got 'sparse'\)",
    ),
]


@pytest.mark.parametrize(("base", "change", "match"), BAD_CONFIGS)
def test_config_json_beyond_limits_or_malformed_is_refused_before_allocation(
    tmp_path, never_built, base, change, match
):
    change = dict(change)
    drop = change.pop("drop", None)
    config = {k: v for k, v in {**base, **change}.items() if k != drop and v is not None}
    config.update({k: v for k, v in change.items() if v is None and k != drop})
    path = write_config(tmp_path / "m", config)
    _refused(path, model_io.ModelConfigError, f"^{path / 'config.json'}: {match}")


@pytest.mark.parametrize(
    ("text", "where", "what"),
    [
        ('{"model_type": "diffusion_rl.transformer",\n  "d_model": 32,\n}', "3:1", "Expecting"),
        (
            '{"model_type": "diffusion_rl.transformer", "d_model": 3 2}',
            "1:57",
            "Expecting ',' delimiter",
        ),
        ("", "1:1", "Expecting value"),
        ('{"model_type": "diffusion_rl.flow_dit"', "1:39", "Expecting ',' delimiter"),
    ],
)
def test_invalid_json_is_one_line_with_line_and_column(tmp_path, never_built, text, where, what):
    path = write_config(tmp_path / "m", text)
    _refused(path, model_io.ModelConfigError, f"^{path / 'config.json'}:{where}: not valid JSON")
    with pytest.raises(ValueError) as caught:
        load_model(path)
    assert what in str(caught.value) and "\n" not in str(caught.value)


def test_oversized_json_files_are_refused_unread(tmp_path, never_built, monkeypatch):
    path = write_config(tmp_path / "m", {**TOKEN_CONFIG, "pad": "x" * 2048})
    monkeypatch.setattr(model_io, "MAX_JSON_BYTES", 1024)
    size = (path / "config.json").stat().st_size
    _refused(path, model_io.ModelConfigError, f"config.json: {size} bytes, more than the 1024")


@pytest.mark.parametrize(
    ("kind", "sampler", "match"),
    [
        ("token", {"generation_length": 10**9}, r"sampler.generation_length=1000000000 exceeds "),
        (
            "token",
            {"generation_length": 48},
            r"sampler.generation_length=48 leaves no room for a prompt",
        ),
        ("token", {"generation_length": -3}, r"sampler.generation_length=-3 must be >= 1"),
        ("token", {"generation_length": 0}, r"sampler.generation_length=0 must be >= 1"),
        (
            "token",
            {"generation_length": "8"},
            r"sampler.generation_length: expected an integer, got str '8'",
        ),
        (
            "token",
            {"generation_length": True},
            r"sampler.generation_length: expected an integer, got bool",
        ),
        (
            "token",
            {"steps_per_block": 2.0},
            r"sampler.steps_per_block: expected an integer, got float",
        ),
        ("token", {"block_size": 2**40}, r"sampler.block_size=1099511627776 exceeds the limit"),
        ("flow", {"num_steps": 10**7}, r"sampler.num_steps=10000000 exceeds the limit 10000"),
        ("flow", [1, 2], r"sampler: expected a JSON object, got list"),
    ],
)
def test_recorded_sampler_sizes_are_bounded(tmp_path, monkeypatch, kind, sampler, match):
    model = tiny_model() if kind == "token" else _flow_model()
    tokenizer = CharTokenizer(CHARS) if kind == "token" else None
    path = save_model(tmp_path / "m", model, {"sampler": sampler}, tokenizer)
    info = path / model_io.INFO_FILE
    monkeypatch.setattr(DiffusionTransformer, "from_pretrained", None)  # never reached
    monkeypatch.setattr(FlowDiT, "from_pretrained", None)
    _refused(path, model_io.ModelConfigError, f"^{info}: {match}")


def test_a_model_larger_than_memory_is_refused_with_its_estimate(tmp_path, never_built):
    """Within every size limit, yet ~386 TiB to load: refused with the estimate."""
    config = {
        **TOKEN_CONFIG,
        **{"vocab_size": 2**20, "d_model": 2**16, "n_layers": 1024, "n_heads": 1024},
        **{"d_ff": 2**18, "max_seq_len": 2**20, "block_size": 64},
    }
    path = write_config(tmp_path / "huge", config)
    d, f, v, s = 2**16, 2**18, 2**20, 2**20
    count = 2 * v * d + s * d + 1024 * (4 * d * d + 2 * d * f + 9 * d + f) + 2 * d
    assert model_io.estimate_parameters(config) == count
    available = model_io.available_memory()
    _refused(
        path,
        model_io.ModelTooLargeError,
        rf"^{path / 'config.json'}: a model of {count:,} parameters would need ~386 TiB of "
        rf"memory to load \(parameters plus the weights file\), this machine has .* available$",
    )
    with pytest.raises(model_io.ModelTooLargeError) as caught:
        load_model(path)
    assert caught.value.required_bytes == 8 * count > caught.value.available_bytes
    assert abs(caught.value.available_bytes - available) < 2**30  # MemAvailable moves a little


def test_the_memory_check_compares_with_what_is_available(tmp_path, monkeypatch):
    monkeypatch.setattr(model_io, "available_memory", lambda: 1 << 30)  # a 1 GiB machine
    config = {**FLOW_CONFIG, "d_model": 1024, "n_layers": 16, "n_heads": 16}  # 2.45 GB to load
    path = write_config(tmp_path / "big", config)
    count = model_io.estimate_parameters(config)
    assert count == 306_649_136 and 8 * count > 1 << 30
    with monkeypatch.context() as patched:
        patched.setattr(FlowDiT, "__init__", None)  # building it would be a TypeError
        _refused(
            path,
            model_io.ModelTooLargeError,
            r"306,649,136 parameters would need ~2.3 GiB .* has 1.0 GiB available$",
        )
    small = save_model(tmp_path / "small", _flow_model(), {})  # 8 x 25 k parameters: fits
    assert isinstance(load_model(small).model, FlowDiT)
    monkeypatch.setattr(model_io, "available_memory", lambda: None)  # unknown: no check
    checked = model_io.check_model_directory(path)
    assert checked["num_parameters"] == count and checked["load_bytes"] == 8 * count


def test_available_memory_and_byte_formatting():
    available = model_io.available_memory()
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < available <= physical
    assert model_io.format_bytes(3.2 * 2**40) == "3.2 TiB"
    assert model_io.format_bytes(24 * 2**30) == "24 GiB"
    assert model_io.format_bytes(512) == "512 B"
    assert model_io.format_bytes(1536) == "1.5 KiB"
