"""Verified model directories: every writer seals its directory with a manifest in the trainer
checkpoints' format; load_model, ``generate`` and ``eval`` refuse a directory that differs
from it (naming the file), a damaged weights file (one line, exit 2) and NaN weights (naming
the tensor); a downloaded directory without a manifest loads with one line saying so; and
``diffusion-rl verify DIR`` checks model directories, checkpoints and run directories."""

from __future__ import annotations

import json
import logging
import pickle
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch
from conftest import tiny_model
from flow_toy import one_thread  # noqa: F401 (fixture: one CPU thread per module)

from diffusion_rl import cli
from diffusion_rl.checksums import file_sha256, manifest_digest
from diffusion_rl.cli.export import export_model
from diffusion_rl.cli.verify import verify_path
from diffusion_rl.models import CharTokenizer, load_model, save_model
from diffusion_rl.models.loading import (
    ManifestMismatchError,
    ModelFileError,
    NonFiniteWeightsError,
)
from diffusion_rl.models.lora import ADAPTER_FILE, LoraSettings, add_lora, save_lora_model
from diffusion_rl.models.manifest import (
    MANIFEST_FORMAT,
    MANIFEST_KEYS,
    read_manifest,
    verify_manifest,
    write_manifest,
)
from diffusion_rl.train import checkpoint as ckpt

CHARS = "0123456789+-="
INFO = {"task": {"name": "arithmetic", "num_digits": 1}, "sampler": {"generation_length": 4}}
WEIGHTS = "model.safetensors"


def _write(directory: Path, seed: int = 0) -> Path:
    return save_model(
        directory, tiny_model(seed=seed), {**INFO, "trained_steps": 7}, CharTokenizer(CHARS)
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return _write(tmp_path_factory.mktemp("verified") / "model")


def _copy(source: Path, target: Path, *, manifest: bool = True) -> Path:
    shutil.copytree(source, target)
    if not manifest:
        (target / "manifest.json").unlink()
    return target


def _rewrite(path: Path, change) -> None:
    tensors = safetensors.torch.load_file(str(path))
    change(tensors)
    safetensors.torch.save_file(tensors, str(path))


def _flip(offset: int):
    def damage(path: Path) -> None:
        data = bytearray(path.read_bytes())
        data[offset] ^= 0x01 if offset < 0 else 0x40
        path.write_bytes(bytes(data))

    return damage


def _nan(tensors):
    tensors["head.weight"][0, 0] = float("nan")


# damage to model.safetensors → (what load_model says with no manifest: error type, words)
DAMAGE = {
    "flipped-data-byte": (_flip(-10), None, None),  # undetectable without a manifest
    "flipped-header-byte": (_flip(20), ModelFileError, "its weights do not fit the model"),
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:5000]), ModelFileError, "not a valid safetensors file"),
    "random-bytes": (lambda p: p.write_bytes(torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)).numpy().tobytes()), ModelFileError, "truncated or not safetensors"),
    "empty": (lambda p: p.write_bytes(b""), ModelFileError, "empty file"),
    "pickle": (lambda p: p.write_bytes(pickle.dumps({"head.weight": [1.0]})), ModelFileError, "a pickle file"),
    "zip": (lambda p: p.write_bytes(b"PK\x03\x04" + b"\x00" * 60), ModelFileError, "a zip archive"),
    "missing-tensor": (lambda p: _rewrite(p, lambda t: t.pop("head.weight")), ModelFileError, 'Missing key(s) in state_dict: "head.weight"'),
    "reshaped-tensor": (lambda p: _rewrite(p, lambda t: t.update({"head.weight": t["head.weight"].reshape(-1)})), ModelFileError, "size mismatch for head.weight"),
    "nan-tensor": (lambda p: _rewrite(p, _nan), NonFiniteWeightsError, "tensor 'head.weight' holds non-finite values (1 NaN, 0 infinite, of 512)"),
}  # fmt: skip


# ----------------------------------------------------------------------------- the format
def test_save_model_seals_the_directory_in_the_checkpoint_manifest_format(model_dir):
    manifest = json.loads((model_dir / "manifest.json").read_text())
    assert set(manifest) == MANIFEST_KEYS == ckpt._MANIFEST_KEYS
    assert manifest["format"] == MANIFEST_FORMAT == ckpt._MANIFEST_FORMAT
    body = {key: manifest[key] for key in ("format", "step", "files")}
    assert manifest["manifest_sha256"] == manifest_digest(body) == ckpt._manifest_digest(body)
    assert manifest["step"] == 7  # the recorded trained_steps
    names = ["config.json", "diffusion_rl.json", WEIGHTS, "tokenizer.json"]
    assert sorted(manifest["files"]) == names
    for name in names:
        entry = manifest["files"][name]
        assert entry == {
            "size": (model_dir / name).stat().st_size,
            "sha256": file_sha256(model_dir / name),
        }
    assert ckpt._sha256(model_dir / WEIGHTS) == file_sha256(model_dir / WEIGHTS)  # one helper
    assert verify_manifest(model_dir) == manifest == read_manifest(model_dir)
    assert verify_path(model_dir)[0] == 0


# ----------------------------------------------------------------------------- load_model
@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_a_damaged_weights_file_is_refused_naming_it(model_dir, tmp_path, case, caplog):
    damage, error_type, words = DAMAGE[case]
    sealed = _copy(model_dir, tmp_path / "sealed")
    damage(sealed / WEIGHTS)
    with pytest.raises(ManifestMismatchError, match=f"^{sealed / WEIGHTS}: ") as refused:
        load_model(sealed)
    assert refused.value.file == WEIGHTS and "\n" not in str(refused.value)
    downloaded = _copy(model_dir, tmp_path / "downloaded", manifest=False)
    damage(downloaded / WEIGHTS)
    with caplog.at_level(logging.WARNING, logger="diffusion_rl.models"):
        if error_type is None:  # nothing to see without a manifest: it loads, unverified
            load_model(downloaded)
            assert [r.getMessage() for r in caplog.records] == [
                f"model directory {downloaded}: unverified: it has no manifest.json (a "
                "downloaded checkpoint?), so only its safetensors headers were checked, not "
                "its tensor data"
            ]
            return
        with pytest.raises(error_type) as refused:
            load_model(downloaded)
    message = str(refused.value)
    assert message.startswith(f"{downloaded / WEIGHTS}: ") and words in message, message
    assert "\n" not in message and not caplog.records  # refused: no "unverified" line
    if error_type is NonFiniteWeightsError:
        assert refused.value.tensor == "head.weight"


@pytest.mark.parametrize(
    ("change", "file", "words"),
    [
        (lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json", "missing: manifest.json lists it"),
        (lambda d: (d / "extra.safetensors").write_bytes(b""), "extra.safetensors", "not listed in manifest.json"),
        (lambda d: (d / "config.json").write_text((d / "config.json").read_text() + " "), "config.json", "size mismatch"),
        (lambda d: (d / "manifest.json").write_text("{}"), "manifest.json", "expected an object with the keys"),
        (lambda d: (d / "manifest.json").write_text((d / "manifest.json").read_text().replace('"step": 7', '"step": 8')), "manifest.json", "its own checksum"),
        (lambda d: (d / "sub").symlink_to(d.parent, target_is_directory=True), "sub", "not listed in manifest.json"),
    ],
    ids=["file-deleted", "file-added", "config-edited", "manifest-emptied", "manifest-edited", "dir-symlink-added"],
)  # fmt: skip
def test_a_directory_that_differs_from_its_manifest_is_refused_naming_the_file(
    model_dir, tmp_path, change, file, words
):
    directory = _copy(model_dir, tmp_path / "m")
    change(directory)
    with pytest.raises(ManifestMismatchError, match=f"^{directory / file}: .*{words}"):
        load_model(directory)
    status, results = verify_path(directory)
    assert status == 1 and results[0][1].startswith(f"{directory / file}: ")


def test_an_unverified_directory_loads_and_a_resealed_one_verifies(model_dir, tmp_path, caplog):
    downloaded = _copy(model_dir, tmp_path / "downloaded", manifest=False)
    with caplog.at_level(logging.WARNING, logger="diffusion_rl.models"):
        loaded = load_model(downloaded)
        assert len(caplog.records) == 1 and "unverified" in caplog.records[0].getMessage()
        caplog.clear()
        load_model(model_dir)
        assert not caplog.records  # verified: silent
    reference = load_model(model_dir).model.state_dict()
    assert all(torch.equal(reference[k], v) for k, v in loaded.model.state_dict().items())
    status, results = verify_path(downloaded)
    assert status == 1 and "unverified: it has no manifest.json" in results[0][1]
    write_manifest(downloaded)
    assert verify_path(downloaded)[0] == 0


def test_a_lora_directory_and_its_export_are_sealed(tmp_path):
    base = _write(tmp_path / "base")
    model = load_model(base).model
    add_lora(model, LoraSettings(rank=2), seed=0, base=base)
    lora = save_lora_model(tmp_path / "lora", model, {"trained_steps": 3})
    assert read_manifest(lora)["step"] == 3 and ADAPTER_FILE in read_manifest(lora)["files"]
    assert verify_path(lora)[0] == 0
    copy = export_model(lora, tmp_path / "copy", merge=False)
    merged = export_model(lora, tmp_path / "merged", merge=True)
    assert verify_path(copy)[0] == 0 and verify_path(merged)[0] == 0
    load_model(copy), load_model(merged)
    _flip(-3)(lora / ADAPTER_FILE)
    with pytest.raises(ManifestMismatchError, match=f"^{lora / ADAPTER_FILE}: sha256 mismatch"):
        load_model(lora)
    with pytest.raises(ManifestMismatchError, match=ADAPTER_FILE):  # nothing damaged is copied
        export_model(lora, tmp_path / "copy2", merge=False)
    assert not (tmp_path / "copy2").exists()
    _flip(-3)(base / WEIGHTS)  # a damaged base is refused when the adapter is loaded
    with pytest.raises(ValueError, match=f"the base model {base} is not the one"):
        load_model(copy)


# ----------------------------------------------------------------------------- the CLI
def _one_line_error(capsys, argv: list[str], code: int = 2) -> str:
    status = cli.main(argv)
    err = capsys.readouterr().err
    assert status == code, (status, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"diffusion-rl {argv[0]}: error: "), err
    return lines[0]


@pytest.mark.parametrize("command", ["generate", "eval"])
@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_generate_and_eval_refuse_a_damaged_directory_in_one_line(
    model_dir, tmp_path, capsys, command, case
):
    damage, error_type, words = DAMAGE[case]
    flags = ["--prompt", "1+2="] if command == "generate" else ["--examples", "2"]
    sealed = _copy(model_dir, tmp_path / "sealed")
    damage(sealed / WEIGHTS)
    line = _one_line_error(capsys, [command, "--model", str(sealed), *flags])
    assert f"{sealed / WEIGHTS}: " in line and "manifest.json" in line
    if error_type is None:
        return
    downloaded = _copy(model_dir, tmp_path / "downloaded", manifest=False)
    damage(downloaded / WEIGHTS)
    line = _one_line_error(capsys, [command, "--model", str(downloaded), *flags])
    assert f"{downloaded / WEIGHTS}: " in line and words in line


def test_verify_command_exit_statuses(model_dir, tmp_path, capsys):
    assert cli.main(["verify", str(model_dir)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [
        f"ok: {model_dir}: model directory: 4 files match manifest.json (sizes, SHA-256); 1 "
        "weights files parse and their 29 tensors are finite"
    ]
    damaged = _copy(model_dir, tmp_path / "damaged")
    _flip(-10)(damaged / WEIGHTS)
    line = _one_line_error(capsys, ["verify", str(damaged)], code=1)
    assert f"{damaged / WEIGHTS}: sha256 mismatch" in line
    nan = _copy(model_dir, tmp_path / "nan")
    _rewrite(nan / WEIGHTS, _nan)
    write_manifest(nan)  # sealed over the damage: the tensor scan still finds it
    line = _one_line_error(capsys, ["verify", str(nan)], code=1)
    assert f"{nan / WEIGHTS}: tensor 'head.weight' holds non-finite values" in line
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    for bad in (tmp_path / "missing", tmp_path / "file", tmp_path / "empty"):
        line = _one_line_error(capsys, ["verify", str(bad)], code=2)
        assert f"DIR: {bad}" in line


def test_verify_checks_checkpoints_run_directories_and_nested_manifests(
    model_dir, tmp_path, capsys
):
    from diffusion_rl.contracts import LossOutput, WeightedMetric
    from diffusion_rl.train import OptimConfig, Trainer

    def no_loss(model, batch, generator):
        return LossOutput(WeightedMetric(torch.zeros(()), torch.ones(())))

    run = tmp_path / "run"
    shutil.copytree(model_dir, run / "model")
    trainer = Trainer(load_model(model_dir).model, no_loss, OptimConfig())
    step = trainer.save_checkpoint(ckpt.CheckpointManager(run / "checkpoints"), {"run": "x"})
    assert cli.main(["verify", str(step)]) == 0
    assert "trainer checkpoint of step 0" in capsys.readouterr().out
    assert cli.main(["verify", str(run)]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 2  # model/ and the checkpoint
    _flip(-5)(step / WEIGHTS)
    line = _one_line_error(capsys, ["verify", str(run)], code=1)
    assert f"checkpoint {step}: {WEIGHTS}: sha256 mismatch" in line

    workflow = tmp_path / "workflow"  # a workflow run's model/: stages, each sealed, and the whole
    for stage in ("image", "video"):
        shutil.copytree(model_dir, workflow / stage)
    (workflow / "workflow.yaml").write_text("name: w\n")
    write_manifest(workflow)
    assert sorted(read_manifest(workflow)["files"])[-1] == "workflow.yaml"
    assert cli.main(["verify", str(workflow)]) == 0
    assert "11 files match manifest.json and 2 nested manifests" in capsys.readouterr().out
    (workflow / "video" / "tokenizer.json").write_text("{}")
    line = _one_line_error(capsys, ["verify", str(workflow)], code=1)
    assert str(workflow / "video" / "tokenizer.json") in line


def test_a_flipped_byte_in_a_runs_model_is_refused_everywhere(tmp_path, capsys):
    """A real run's model/ (the recipe's final save): sealed, verified, and once one byte of
    its tensor data flips, refused by load_model, generate, eval, verify and /update_weights,
    each naming the file."""
    out = tmp_path / "allowed" / "run"
    config = tmp_path / "run.json"
    settings = {
        "model": {"d_model": 16, "n_layers": 1, "n_heads": 2},
        "task": {"num_digits": 1},
        "threads": 1,
        "steps": 1,
        "batch_size": 4,
        "eval_every": 1,
        "eval_examples": 2,
        "output_dir": str(out),
    }
    config.write_text(json.dumps(settings))
    assert cli.main(["sft", "--config", str(config)]) == 0
    capsys.readouterr()
    model = out / "model"
    assert read_manifest(model)["step"] == 1 and verify_path(out)[0] == 0
    _flip(-10)(model / WEIGHTS)
    with pytest.raises(ManifestMismatchError, match=f"^{model / WEIGHTS}: sha256 mismatch"):
        load_model(model)
    for argv in (["generate", "--prompt", "1+2="], ["eval", "--examples", "2"]):
        line = _one_line_error(capsys, [argv[0], "--model", str(model), *argv[1:]])
        assert f"{model / WEIGHTS}: sha256 mismatch" in line
    assert f"{model / WEIGHTS}: sha256 mismatch" in _one_line_error(
        capsys, ["verify", str(out)], code=1
    )
    pytest.importorskip("fastapi")
    from serve_live import LiveServer, write_token_model

    write_token_model(tmp_path / "served")
    server = LiveServer(
        {"tiny": tmp_path / "served"}, update_weights_dirs=(str(tmp_path / "allowed"),)
    )
    try:
        status, _, body = server.json(
            "POST", "/update_weights", {"model": "tiny", "directory": str(model)}
        )
    finally:
        server.stop()
    assert status == 400 and body["error"]["code"] == "manifest_mismatch"
    assert f"{model / WEIGHTS}: sha256 mismatch" in body["error"]["message"]
