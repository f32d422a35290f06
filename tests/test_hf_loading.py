"""Safety of loading Hugging Face checkpoints: local directories only (a Hub id fails at
once, offline or not), safetensors only, no remote code, strict keys, bounded configs, and the
loader's dispatch on config.json's model_type."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from flow_toy import one_thread  # noqa: F401 (fixture: one CPU thread per module)
from hf_tiny import FIXTURES, dream_config, llada_config, write_checkpoint
from safetensors.torch import load_file, save_file

from diffusion_rl.models import CharTokenizer, load_model, save_model
from diffusion_rl.models import io as model_io
from diffusion_rl.models.hf import (
    CheckpointFormatError,
    CheckpointKeyError,
    DreamDenoiser,
    HFTokenDenoiser,
    HFTokenizer,
    LLaDADenoiser,
)
from diffusion_rl.models.io import HubIdError, ModelConfigError, check_local_directory

HUB_IDS = [
    ("GSAI-ML/LLaDA-8B-Instruct", "GSAI-ML/LLaDA-8B-Instruct"),
    ("hf://Dream-org/Dream-v0-Instruct-7B", "Dream-org/Dream-v0-Instruct-7B"),
    ("https://huggingface.co/JetLM/SDAR-1.7B-Chat", "JetLM/SDAR-1.7B-Chat"),
]
FAST_S = 2.0


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a connection or download fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    import huggingface_hub

    for name in ("hf_hub_download", "snapshot_download"):
        monkeypatch.setattr(huggingface_hub, name, refuse)


@pytest.mark.parametrize("offline", [True, False])
@pytest.mark.parametrize(("spelled", "repo"), HUB_IDS)
def test_a_hub_id_fails_at_once_with_the_local_directory_message(
    monkeypatch, tmp_path, no_network, offline, spelled, repo
):
    monkeypatch.chdir(tmp_path)  # the relative "org/name" exists nowhere
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    message = rf"{spelled!r} is not a local directory .*`hf download {repo} --local-dir DIR`"
    for call in (
        lambda: load_model(spelled),
        lambda: model_io.check_model_directory(spelled),
        lambda: LLaDADenoiser.from_pretrained(spelled),
        lambda: HFTokenizer.from_pretrained(spelled),
        lambda: check_local_directory(spelled, "model.path"),
    ):
        start = time.perf_counter()
        with pytest.raises(HubIdError, match=message) as caught:
            call()
        assert time.perf_counter() - start < FAST_S
        assert isinstance(caught.value, ValueError)
    with pytest.raises(HubIdError, match=r"^model\.path: .* set model\.path to DIR$"):
        check_local_directory(spelled, "model.path")


def test_local_paths_that_look_like_hub_ids(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    write_checkpoint(tmp_path / "org" / "name", "dream", seed=1)
    assert check_local_directory("org/name", "model.path") == Path("org/name")
    assert isinstance(load_model("org/name").model, DreamDenoiser)  # a local directory wins
    (tmp_path / "org" / "file").write_text("x")
    with pytest.raises(FileNotFoundError, match=r"^model\.path: org/file is not a directory$"):
        check_local_directory("org/file", "model.path")
    with pytest.raises(FileNotFoundError, match=r"model\.path: \./org/gone does not exist"):
        check_local_directory("./org/gone", "model.path")  # an explicit path, not an id
    with pytest.raises(FileNotFoundError, match=r"model directory /no/such/dir does not exist"):
        load_model("/no/such/dir")


def test_pickle_weights_are_refused_and_never_unpickled(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a pickle was loaded")

    directory = tmp_path / "m"
    write_checkpoint(directory, "llada", seed=2)
    torch.save(load_file(directory / "model.safetensors"), directory / "pytorch_model.bin")
    monkeypatch.setattr(torch, "load", refuse)
    assert isinstance(load_model(directory).model, LLaDADenoiser)  # safetensors preferred
    (directory / "model.safetensors").unlink()
    message = r"\['pytorch_model.bin'\] are pickle files, .*convert them to safetensors"
    for call in (lambda: load_model(directory), lambda: model_io.check_model_directory(directory)):
        with pytest.raises(CheckpointFormatError, match=message):
            call()
    (directory / "pytorch_model.bin").unlink()
    with pytest.raises(FileNotFoundError, match=r"no model.safetensors or model.safetensors"):
        load_model(directory)


def test_a_shard_index_may_only_name_shards_beside_it(tmp_path):
    directory = tmp_path / "m"
    write_checkpoint(directory, "dream", seed=3)
    (directory / "model.safetensors").rename(tmp_path / "outside.safetensors")
    index = directory / "model.safetensors.index.json"
    for name, error, match in [
        ("../outside.safetensors", CheckpointFormatError, r"names '\.\./outside\.safetensors'"),
        ("model.bin", CheckpointFormatError, r"names 'model\.bin'"),
        ("missing.safetensors", FileNotFoundError, r"names the shard missing\.safetensors"),
    ]:
        index.write_text(json.dumps({"weight_map": {"lm_head.weight": name}}))
        with pytest.raises(error, match=match):
            load_model(directory)


def _rewrite(directory: Path, change) -> None:
    state = load_file(directory / "model.safetensors")
    change(state)
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})


def test_missing_and_unexpected_keys_are_named(tmp_path):
    directory = tmp_path / "m"
    write_checkpoint(directory, "llada", seed=4)

    def damage(state):
        del state["model.transformer.blocks.1.ff_norm.weight"]
        state["model.transformer.final_norm.weight"] = state.pop("model.transformer.ln_f.weight")

    _rewrite(directory, damage)
    with pytest.raises(CheckpointKeyError) as caught:
        load_model(directory)
    assert caught.value.missing == [
        "model.transformer.blocks.1.ff_norm.weight",
        "model.transformer.ln_f.weight",
    ]
    assert caught.value.unexpected == ["model.transformer.final_norm.weight"]
    text = str(caught.value)
    assert "do not match the LLaDA architecture config.json describes" in text
    assert all(key in text for key in [*caught.value.missing, *caught.value.unexpected])

    write_checkpoint(directory, "dream", seed=4)
    _rewrite(directory, lambda s: s.update(extra=torch.zeros(1)))
    with pytest.raises(CheckpointKeyError, match=r"unexpected keys \['extra'\]$"):
        load_model(directory)


def test_tensors_of_the_wrong_shape_are_named(tmp_path):
    directory = tmp_path / "m"
    write_checkpoint(directory, "llada", seed=5)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "mlp_hidden_size": 40}))
    with pytest.raises(
        CheckpointKeyError, match=r"ff_proj.weight \(48, 32\) \(expected \(40, 32\)"
    ):
        load_model(directory)


def test_an_unmerged_extra_parameter_cannot_be_saved_as_the_family(tmp_path):
    model = LLaDADenoiser.from_config(llada_config())
    q_proj = model.network.model.layers[0].self_attn.q_proj
    q_proj.register_parameter("lora_A", torch.nn.Parameter(torch.zeros(2, 32)))
    with pytest.raises(CheckpointKeyError, match=r"model.layers.0.self_attn.q_proj.lora_A.*merge"):
        model.save_pretrained(tmp_path / "out")


CONFIG_PROBLEMS = [
    (llada_config(alibi=True), r"alibi=True is not supported by the stock Llama mapping"),
    (llada_config(block_type="sequential"), r"block_type='sequential' is not supported"),
    (llada_config(include_qkv_bias=True), r"include_qkv_bias=True is not supported"),
    (llada_config(residual_dropout=0.1), r"residual_dropout=0.1 is not supported"),
    (llada_config(activation_type="gelu"), r"activation_type='gelu' is not supported"),
    (llada_config(d_model=2**31), r"d_model=2147483648 exceeds the limit 1048576"),
    (llada_config(n_layers=True), r"n_layers: expected an integer, got bool True"),
    (llada_config(d_model=30), r"d_model: must be divisible by n_heads=4, got 30"),
    (llada_config(mask_token_id=48), r"mask_token_id=48 exceeds the limit 47"),
    (llada_config(mask_token_id=None), r"missing key mask_token_id"),
    (llada_config(weight_tying=None), r"missing key weight_tying"),
    (dream_config(use_sliding_window=True), r"use_sliding_window=true is not supported"),
    (dream_config(rope_scaling={"type": "yarn"}), r"rope_scaling=\{'type': 'yarn'\} is not"),
    (dream_config(hidden_act="gelu"), r"hidden_act='gelu' is not supported"),
    (dream_config(num_key_value_heads=3), r"num_key_value_heads: must divide"),
    (dream_config(rms_norm_eps=0.0), r"rms_norm_eps: must be > 0, got 0.0"),
]


@pytest.mark.parametrize(("config", "match"), CONFIG_PROBLEMS)
def test_config_problems_are_refused_before_anything_is_built(tmp_path, monkeypatch, config, match):
    directory = tmp_path / "m"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))

    def never(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr(HFTokenDenoiser, "from_pretrained", never)
    start = time.perf_counter()
    with pytest.raises(ModelConfigError, match=rf"^{directory / 'config.json'}: .*{match}"):
        load_model(directory)
    assert time.perf_counter() - start < 1.0


def test_a_checkpoint_too_large_for_memory_is_refused_with_its_estimate(tmp_path, monkeypatch):
    directory = tmp_path / "m"
    write_checkpoint(directory, "dream", seed=6)
    config = json.loads((directory / "config.json").read_text())
    count = DreamDenoiser.parameter_count(config)
    file_bytes = (directory / "model.safetensors").stat().st_size
    monkeypatch.setattr(model_io, "available_memory", lambda: 4 * count + file_bytes - 1)
    monkeypatch.setattr(HFTokenDenoiser, "from_pretrained", None)  # never reached
    with pytest.raises(model_io.ModelTooLargeError, match=rf"a model of {count:,} parameters"):
        load_model(directory)
    # in bf16 the same checkpoint fits
    monkeypatch.undo()
    monkeypatch.setattr(model_io, "available_memory", lambda: 4 * count + file_bytes - 1)
    assert load_model(directory, dtype="bf16").model.num_parameters() == count

    huge = llada_config(d_model=2**16, n_heads=512, n_layers=1024, mlp_hidden_size=2**18)
    (directory / "config.json").write_text(json.dumps(huge))
    expected = LLaDADenoiser.parameter_count(huge)
    assert expected > 10**13 and model_io.estimate_parameters(huge) == expected
    with pytest.raises(model_io.ModelTooLargeError, match=r"TiB of memory to load"):
        load_model(directory)


def test_remote_code_is_never_run(tmp_path):
    marker = tmp_path / "ran"
    code = f"open({str(marker)!r}, 'w').write('remote code ran')\n"

    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(
        json.dumps({"model_type": "fancy_dllm", "auto_map": {"AutoModel": "modeling_fancy.Fancy"}})
    )
    (unknown / "modeling_fancy.py").write_text(code)
    for trust in (False, True):
        with pytest.raises(ModelConfigError, match=r"needs remote code .*trust_remote_code"):
            load_model(unknown, trust_remote_code=trust)

    directory = tmp_path / "dream"
    write_checkpoint(directory, "dream", seed=7)
    settings = json.loads((directory / "tokenizer_config.json").read_text())
    settings.update(
        tokenizer_class="DreamTokenizer",
        auto_map={"AutoTokenizer": ["tokenization_dream.DreamTokenizer", None]},
    )
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    (directory / "tokenization_dream.py").write_text(code)
    with pytest.raises(ValueError, match=r"'DreamTokenizer' is remote code .*trust_remote_code"):
        load_model(directory)
    with pytest.raises(TypeError, match="trust_remote_code: expected a bool"):
        load_model(directory, trust_remote_code="yes")
    assert not marker.exists()


def test_the_hf_registry_dispatches_lazily_and_case_insensitively(tmp_path, monkeypatch):
    assert model_io.HF_MODEL_TYPES["sdar"] == "diffusion_rl.models.hf.sdar:SDARDenoiser"
    directory = tmp_path / "m"
    write_checkpoint(directory, "dream", seed=8)
    config = json.loads((directory / "config.json").read_text())
    for spelling in ("dream", "DREAM"):
        (directory / "config.json").write_text(json.dumps({**config, "model_type": spelling}))
        assert isinstance(load_model(directory).model, DreamDenoiser)

    monkeypatch.setitem(model_io.HF_MODEL_TYPES, "ghost", "diffusion_rl.models.hf.ghost:Ghost")
    (directory / "config.json").write_text(json.dumps({**config, "model_type": "ghost"}))
    with pytest.raises(ModelConfigError, match=r"adapter diffusion_rl.models.hf.ghost is not"):
        load_model(directory)
    (directory / "config.json").write_text(json.dumps({**config, "model_type": "mystery"}))
    with pytest.raises(ModelConfigError, match=r"Hugging Face token families .*'llada'"):
        load_model(directory)
    with pytest.raises(ValueError, match="target: expected 'package.module:Class'"):
        model_io.register_hf_family("x", "no_colon")
    model_io.register_hf_family("Dream2", "diffusion_rl.models.hf.dream:DreamDenoiser")
    try:
        (directory / "config.json").write_text(json.dumps({**config, "model_type": "Dream2"}))
        assert isinstance(load_model(directory).model, DreamDenoiser)
    finally:
        del model_io.HF_MODEL_TYPES["dream2"]


def test_the_sdar_fixture_goes_to_helper_bs_adapter():
    directory = FIXTURES / "hf_dllm" / "sdar"
    if not directory.is_dir():
        pytest.skip(f"{directory}: ../shared/fixtures absent (CI has it)")
    loaded = load_model(directory)
    config = json.loads((directory / "config.json").read_text())
    assert type(loaded.model).__name__ == "SDARDenoiser"
    assert isinstance(loaded.tokenizer, HFTokenizer)
    assert loaded.tokenizer.mask_id == config["mask_token_id"] == loaded.model.mask_token_id


def test_the_recorded_sampler_must_fit_the_family_config(tmp_path, monkeypatch):
    directory = tmp_path / "m"
    write_checkpoint(directory, "llada", seed=10)  # max_sequence_length 64
    (directory / "diffusion_rl.json").write_text(json.dumps({"sampler": {"generation_length": 64}}))
    monkeypatch.setattr(HFTokenDenoiser, "from_pretrained", None)  # never reached
    with pytest.raises(ModelConfigError, match=r"generation_length=64 leaves no room .*=64"):
        load_model(directory)


def test_tokenizer_must_fit_the_model(tmp_path):
    directory = tmp_path / "m"
    write_checkpoint(directory, "llada", seed=9)
    tokenizer = HFTokenizer.from_pretrained(directory)  # vocab and mask from config.json
    assert (tokenizer.vocab_size, tokenizer.mask_id) == (48, 43)
    with pytest.raises(ValueError, match=r"mask token '<\|mdm_mask\|>' has id 43, .*=42"):
        HFTokenizer.from_pretrained(directory, mask_id=42)
    with pytest.raises(ValueError, match=r"has 47 ids, more than the model's vocab_size 40"):
        HFTokenizer.from_pretrained(directory, vocab_size=40, mask_id=3)
    saved = tokenizer.save(tmp_path / "copy")
    (saved / "config.json").write_text(json.dumps(llada_config()))
    assert HFTokenizer.from_pretrained(saved).name == tokenizer.name  # survives save / reload


def test_load_model_options_keep_the_built_in_call_sites(tmp_path):
    path = save_model(tmp_path / "tok", tiny_model(), {}, CharTokenizer("0123456789+-="))
    default = load_model(path)
    assert {p.dtype for p in default.model.parameters()} == {torch.float32}
    low = load_model(path, dtype="bf16", device="cpu")
    assert {p.dtype for p in low.model.parameters()} == {torch.bfloat16}
    assert low.tokenizer == default.tokenizer
    with pytest.raises(ValueError, match=r"dtype: expected one of .*got 'int8'"):
        load_model(path, dtype="int8")
