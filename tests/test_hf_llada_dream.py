"""LLaDA and Dream checkpoints through transformers' stock classes (models/hf/).

Conformance against ../shared/fixtures (tiny checkpoints written and run by each family's own
code; skipped where absent), and tiny random checkpoints written here, checked against an
independent plain-torch forward (tests/hf_tiny.py)."""

from __future__ import annotations

import json

import pytest
import torch
from flow_toy import one_thread  # noqa: F401 (fixture: one CPU thread per module)
from hf_tiny import (
    CHARS,
    SIZES,
    dream_config,
    fixture_dir,
    llada_config,
    reference_logits,
    special_id,
    write_checkpoint,
)
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from diffusion_rl.models import TokenDenoiser, load_model, save_model
from diffusion_rl.models import io as model_io
from diffusion_rl.models.hf import CheckpointKeyError, DreamDenoiser, HFTokenizer, LLaDADenoiser
from diffusion_rl.models.hf.common import bidirectional_mask, protocol_positions
from diffusion_rl.models.protocol import shift_to_target_aligned

FAMILIES = ("llada", "dream")
CLASSES = {"llada": LLaDADenoiser, "dream": DreamDenoiser}
TOL = 1e-5


def _reference(size: str, family: str):
    directory = fixture_dir(size, family)
    return directory, load_file(directory / "reference.safetensors")


def _padding(ref: dict, canvas: int) -> torch.Tensor:
    ids = ref[f"c{canvas}_input_ids"]
    mask = ref.get(f"c{canvas}_attention_mask", ref.get(f"c{canvas}_attention_mask_2d"))
    return torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()


def _with_real_predecessor(mask: torch.Tensor) -> torch.Tensor:
    """Real positions whose predecessor is real too (position 0 counts as its own)."""
    return mask & torch.cat([mask[:, :1], mask[:, :-1]], dim=1)


def _logits(model, ids, mask, **kwargs):
    with torch.no_grad():
        return model(ids, mask, 0, **kwargs)


# ----------------------------------------------------------------------------- fixtures
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("size", SIZES)
def test_fixture_logits_equal_the_reference_on_every_canvas(size, family):
    directory, ref = _reference(size, family)
    loaded = load_model(directory)
    model = loaded.model
    assert loaded.kind == "token" and isinstance(model, CLASSES[family])
    assert isinstance(model, TokenDenoiser) and not model.training
    for canvas in range(3):
        ids, mask = ref[f"c{canvas}_input_ids"], _padding(ref, canvas)
        logits = _logits(model, ids, mask)
        assert logits.shape == ref[f"c{canvas}_logits"].shape
        if family == "llada":  # same-position: compared as is, at every real position
            err = (logits - ref[f"c{canvas}_logits"]).abs()[mask].max()
        else:  # through the target-aligned protocol, as Dream's generate realigns
            expected = ref[f"c{canvas}_logits_generate_aligned"]
            err = (logits - expected).abs()[_with_real_predecessor(mask)].max()
        assert err <= TOL, (canvas, float(err))


@pytest.mark.parametrize("size", SIZES)
def test_dream_scores_token_i_from_position_i_minus_1(size):
    """The returned logits at i are the raw network's at i - 1; the raw ones at i differ."""
    directory, ref = _reference(size, "dream")
    model = load_model(directory).model
    assert model.alignment == "same_position" and model.native_alignment == "shifted"
    for canvas in (0, 1):
        ids, raw = ref[f"c{canvas}_input_ids"], ref[f"c{canvas}_logits"]
        aligned = _logits(model, ids, None)
        assert (aligned[:, 1:] - raw[:, :-1]).abs().max() <= TOL  # i scored from i - 1
        assert (aligned[:, 0] - raw[:, 0]).abs().max() <= TOL  # 0 keeps its own
        assert (aligned[:, 1:] - raw[:, 1:]).abs().max() > 0.1  # not same-position
        with torch.no_grad():
            assert (model.raw_logits(ids) - raw).abs().max() <= TOL


@pytest.mark.parametrize("size", SIZES)
def test_llada_logits_are_same_position(size):
    directory, ref = _reference(size, "llada")
    model = load_model(directory).model
    assert model.alignment == model.native_alignment == "same_position"
    ids, raw = ref["c0_input_ids"], ref["c0_logits"]
    logits = _logits(model, ids, None)
    assert (logits - raw).abs().max() <= TOL
    assert (logits[:, 1:] - raw[:, :-1]).abs().max() > 0.1  # a shift would be caught


@pytest.mark.parametrize("size", SIZES)
def test_llada_left_padded_canvas_positions(size):
    """LLaDA's own positions (arange, pads included) reproduce c2; the protocol's positions
    (cumsum - 1) give the real tokens the logits of the unpadded run, whatever the padding."""
    directory, ref = _reference(size, "llada")
    model = load_model(directory).model
    ids, mask, expected = ref["c2_input_ids"], _padding(ref, 2), ref["c2_logits"]
    assert (~mask[0]).sum() > 0 and mask[1].all()  # row 0 is left-padded, row 1 is not
    arange = torch.arange(ids.shape[1]).expand_as(ids)
    own = _logits(model, ids, mask, position_ids=arange)
    assert (own - expected).abs()[mask].max() <= TOL
    scrambled = _logits(model, ids, mask, position_ids=arange.flip(1))
    assert (scrambled - expected).abs()[mask].max() > 0.01  # positions are really used
    protocol = _logits(model, ids, mask)
    assert (protocol - expected).abs()[mask].max() <= TOL
    real = ids[0][mask[0]][None]
    alone = _logits(model, real, None)
    assert (protocol[0][mask[0]] - alone[0]).abs().max() <= TOL  # rounding only (1.4e-6)
    row1_alone = _logits(model, ids[1:], None)
    assert (protocol[1] - row1_alone[0]).abs().max() <= TOL


@pytest.mark.parametrize("size", SIZES)
def test_dream_left_padding_uses_generates_mask_and_positions(size):
    directory, ref = _reference(size, "dream")
    mask = ref["c2_attention_mask_2d"].bool()
    assert (~mask).any()
    positions = protocol_positions(mask)
    assert torch.equal(positions[mask], ref["c2_position_ids"][mask])
    ours, theirs = bidirectional_mask(mask), ref["c2_attention_mask_4d"]
    assert ours.shape == theirs.shape
    real_rows = mask[:, None, :, None].expand_as(ours)
    assert torch.equal(ours[real_rows], theirs[real_rows])  # the same mask on real queries
    assert ours.any(-1).all()  # and no fully masked row (pads see themselves)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("size", SIZES)
def test_tokenizer_from_the_fixture_directory(size, family):
    directory = fixture_dir(size, family)
    config = json.loads((directory / "config.json").read_text())
    expected = json.loads((directory / "verification.json").read_text())["tokenizer"]
    tok = load_model(directory).tokenizer
    assert isinstance(tok, HFTokenizer)
    assert (
        tok.mask_id == config["mask_token_id"] == tok.hf.mask_token_id == expected["mask_token_id"]
    )
    assert tok.vocab_size == config.get("embedding_size", config["vocab_size"])
    assert len(tok.hf) == expected["len"] <= tok.vocab_size
    assert tok.eos_id == config["eos_token_id"] and tok.pad_id == config["pad_token_id"]
    assert tok.chat_prompt("Hi") == expected["chat"]
    ids = tok.encode("hello world")
    assert tok.decode(ids) == "hello world"
    assert tok.decode([*ids, tok.eos_id, *ids]) == "hello world"
    assert tok.decode([*ids, tok.eos_id, *ids], stop_at_eos=False) == "hello worldhello world"
    assert tok.decode([*ids, tok.mask_id, tok.vocab_size - 1]) == "hello world"
    assert tok.batch_decode(torch.tensor([ids, ids])) == ["hello world"] * 2


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("size", SIZES)
def test_save_pretrained_writes_the_familys_own_checkpoint(size, family, tmp_path):
    directory, ref = _reference(size, family)
    model = load_model(directory).model
    model.save_pretrained(tmp_path / "saved")
    saved, original = (
        load_file(tmp_path / "saved" / "model.safetensors"),
        load_file(directory / "model.safetensors"),
    )
    keys = json.loads((directory / "provenance.json").read_text())["state_dict_keys"]
    assert sorted(saved) == sorted(original) == sorted(keys)
    for key in original:
        assert saved[key].dtype == original[key].dtype and torch.equal(saved[key], original[key])
    with safe_open(str(tmp_path / "saved" / "model.safetensors"), "pt") as handle:
        assert handle.metadata() == {"format": "pt"}
    assert json.loads((tmp_path / "saved" / "config.json").read_text()) == json.loads(
        (directory / "config.json").read_text()
    )
    if family == "dream":  # Dream's own loader reads generation_config.json
        assert json.loads((tmp_path / "saved" / "generation_config.json").read_text()) == (
            json.loads((directory / "generation_config.json").read_text())
        )

    tokenizer = load_model(directory).tokenizer
    out = save_model(tmp_path / "model", model, {"trained_steps": 0}, tokenizer)
    again = load_model(out)
    assert again.tokenizer.name == tokenizer.name and again.info["tokenizer"] == tokenizer.name
    ids, mask = ref["c2_input_ids"], _padding(ref, 2)
    assert torch.equal(_logits(again.model, ids, mask), _logits(model, ids, mask))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("size", SIZES)
def test_parameter_count_from_the_config_alone(size, family):
    directory = fixture_dir(size, family)
    config = json.loads((directory / "config.json").read_text())
    stored = sum(t.numel() for t in load_file(directory / "model.safetensors").values())
    assert CLASSES[family].parameter_count(config) == stored
    assert model_io.estimate_parameters(config) == stored
    checked = model_io.check_model_directory(directory)
    file_bytes = (directory / "model.safetensors").stat().st_size
    assert checked["num_parameters"] == stored
    assert checked["load_bytes"] == 4 * stored + file_bytes  # float32 parameters + one file
    assert load_model(directory).model.num_parameters() == stored


# ----------------------------------------------------------------------------- tiny, local
def _canvas(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, len(CHARS), (3, 12), generator=generator)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[0, :4], mask[1, :1] = False, False  # left padding
    return ids, mask


def _check_against_reference(model, directory, family, ids, mask):
    config = json.loads((directory / "config.json").read_text())
    state = load_file(directory / "model.safetensors")
    raw = reference_logits(state, config, family, ids, mask, protocol_positions(mask))
    expected = shift_to_target_aligned(raw) if family == "dream" else raw
    logits = _logits(model, ids, mask)
    where = _with_real_predecessor(mask) if family == "dream" else mask
    assert (logits.double() - expected).abs()[where].max() <= TOL
    assert expected.abs().max() > 1.0  # logits large enough for a mapping error to show
    return logits


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_local_checkpoint_equals_an_independent_forward(family, tmp_path):
    written = write_checkpoint(tmp_path / family, family, seed=3)
    loaded = load_model(tmp_path / family)
    ids, mask = _canvas()
    logits = _check_against_reference(loaded.model, tmp_path / family, family, ids, mask)
    assert torch.equal(logits, _logits(written, ids, mask))
    out = save_model(tmp_path / "saved", loaded.model, {"trained_steps": 1}, loaded.tokenizer)
    again = load_model(out)
    assert torch.equal(_logits(again.model, ids, mask), logits)
    assert again.tokenizer.name == loaded.tokenizer.name == again.info["tokenizer"]
    tok = loaded.tokenizer
    mask_token = "<|mdm_mask|>" if family == "llada" else "<|mask|>"
    assert tok.mask_id == special_id(family, mask_token) == loaded.model.mask_token_id
    assert tok.vocab_size == loaded.model.vocab_size == 48 > len(tok.hf)
    turn_end = "<|eot_id|>" if family == "llada" else "<|im_end|>"
    assert special_id(family, turn_end) in tok.stop_ids
    assert tok.decode([*tok.encode("12+3=15"), special_id(family, turn_end), 4]) == "12+3=15"
    prompt = tok.encode(tok.chat_prompt("2+2"))
    if family == "llada":
        assert prompt[0] == special_id(family, "<|startoftext|>")  # the template's BOS
        assert tok.decode(prompt, stop_at_eos=False) == "user\n\n2+2assistant\n\n"
        assert tok.decode(prompt) == "user\n\n2+2"  # stops at <|eot_id|>
    else:
        assert tok.decode(prompt, stop_at_eos=False) == "user\n2+2\nassistant\n"
        assert tok.decode(prompt) == "user\n2+2"  # stops at <|im_end|>


@pytest.mark.parametrize("family", FAMILIES)
def test_tied_embeddings_round_trip(family, tmp_path):
    tie = {"weight_tying": True} if family == "llada" else {"tie_word_embeddings": True}
    write_checkpoint(tmp_path / "m", family, seed=5, **tie)
    stored = load_file(tmp_path / "m" / "model.safetensors")
    head = "model.transformer.ff_out.weight" if family == "llada" else "lm_head.weight"
    assert head not in stored
    model = load_model(tmp_path / "m").model
    assert model.network.lm_head.weight is model.network.model.embed_tokens.weight
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert model.num_parameters() == CLASSES[family].parameter_count(config)
    _check_against_reference(model, tmp_path / "m", family, *_canvas(1))

    embed = "model.transformer.wte.weight" if family == "llada" else "model.embed_tokens.weight"
    path = str(tmp_path / "m" / "model.safetensors")
    save_file({**stored, head: stored[embed].clone()}, path)  # stored twice: fine
    assert torch.equal(
        _logits(load_model(tmp_path / "m").model, *_canvas(1)), _logits(model, *_canvas(1))
    )
    save_file({**stored, head: stored[embed] + 1.0}, path)  # two different tensors: refused
    first, second = sorted([head, embed])
    with pytest.raises(CheckpointKeyError, match=rf"ties {first} and {second}, but the file"):
        load_model(tmp_path / "m")


def test_sharded_checkpoint_round_trip(tmp_path):
    model = write_checkpoint(tmp_path / "one", "llada", seed=2)
    model.save_pretrained(tmp_path / "sharded", max_shard_bytes=20_000)
    (tmp_path / "one" / "model.safetensors").unlink()
    for path in (tmp_path / "sharded").iterdir():
        path.rename(tmp_path / "one" / path.name)
    names = sorted(p.name for p in (tmp_path / "one").glob("model*.safetensors"))
    assert len(names) > 2 and names[0] == f"model-00001-of-{len(names):05d}.safetensors"
    index = json.loads((tmp_path / "one" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == names
    assert sorted(index["weight_map"]) == sorted(model.family_state())
    loaded = load_model(tmp_path / "one").model
    ids, mask = _canvas(2)
    assert torch.equal(_logits(loaded, ids, mask), _logits(model, ids, mask))


@pytest.mark.parametrize("family", FAMILIES)
def test_activation_checkpointing_recomputes_layers_with_the_same_gradients(family, tmp_path):
    write_checkpoint(tmp_path / "m", family, seed=4)
    ids, mask = _canvas(3)

    def gradients(checkpointing: bool):
        model = load_model(tmp_path / "m").model.train()
        model.enable_activation_checkpointing(checkpointing)
        assert model.activation_checkpointing is checkpointing
        calls, mlp = [], model.network.model.layers[0].mlp
        forward = mlp.forward  # counted by wrapping (hooks do not fire in the recompute)
        mlp.forward = lambda *args, **kwargs: calls.append(1) or forward(*args, **kwargs)
        model(ids, mask, 0).float().logsumexp(-1)[mask].sum().backward()
        return {n: p.grad for n, p in model.named_parameters()}, len(calls)

    plain, plain_calls = gradients(False)
    recomputed, recomputed_calls = gradients(True)
    assert (plain_calls, recomputed_calls) == (1, 2)  # the layer ran again in backward
    for name, grad in plain.items():
        assert torch.allclose(recomputed[name], grad, atol=1e-6, rtol=1e-5), name


def test_bf16_loading_keeps_rope_in_float32(tmp_path):
    write_checkpoint(tmp_path / "m", "dream", seed=6)
    count = DreamDenoiser.parameter_count(json.loads((tmp_path / "m" / "config.json").read_text()))
    checked = model_io.check_model_directory(tmp_path / "m", dtype="bf16")
    assert (
        checked["load_bytes"] == 2 * count + (tmp_path / "m" / "model.safetensors").stat().st_size
    )
    model = load_model(tmp_path / "m", dtype=torch.bfloat16, device="cpu").model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.network.model.rotary_emb.inv_freq.dtype == torch.float32
    ids, mask = _canvas(4)
    reference = _logits(load_model(tmp_path / "m").model, ids, mask)
    low = _logits(model, ids, mask)
    assert low.dtype == torch.bfloat16
    assert (low.float() - reference).abs()[mask].max() < 0.1 * reference.abs().max()


@pytest.mark.parametrize("family", FAMILIES)
def test_protocol_fields_config_and_lora_targets(family, tmp_path):
    write_checkpoint(tmp_path / "m", family, seed=7)
    model = load_model(tmp_path / "m").model
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert model.attention == "bidirectional" and model.block_size is None
    assert (
        model.config.model_dump() == config and model.config["model_type"] == config["model_type"]
    )
    assert model.config.max_seq_len == (64 if family == "llada" else 128)
    assert model.network.config._attn_implementation == "sdpa"
    assert not any(getattr(m, "is_causal", False) for m in model.modules())
    linear = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    targeted = [n for n in linear if n.rsplit(".", 1)[-1] in model.lora_targets]
    assert sorted(set(linear) - set(targeted)) == ["network.lm_head"]
    assert all(any(n.endswith(t) for n in targeted) for t in model.lora_targets)
    with pytest.raises(ValueError, match=r"ids must be in \[0, vocab_size=48\), got \[0, 48\]"):
        model(torch.tensor([[0, 48]]), None, 0)
    with pytest.raises(ValueError, match=r"key_mask: expected shape \(1, 2\)"):
        model(torch.tensor([[0, 1]]), torch.ones(1, 3, dtype=torch.bool), 0)


def test_configs_built_here_match_their_parameter_formulas():
    for cls, config in [
        (LLaDADenoiser, llada_config()),
        (
            LLaDADenoiser,
            llada_config(n_kv_heads=4, weight_tying=True, mlp_hidden_size=None, mlp_ratio=3),
        ),
        (DreamDenoiser, dream_config()),
        (DreamDenoiser, dream_config(num_key_value_heads=1, tie_word_embeddings=True)),
    ]:
        model = cls.from_config(config)
        assert model.num_parameters() == cls.parameter_count(config)


@pytest.mark.parametrize("family", FAMILIES)
def test_rollout_replay_parity_and_one_update(family, tmp_path):
    """The block sampler's captured log-probs equal exact replay bitwise (ratio exactly 1
    before any update); one policy-gradient step through the replay then moves them."""
    from diffusion_rl.sampling import TokenSamplerConfig, sample_tokens
    from diffusion_rl.scoring import ReplayScorer

    write_checkpoint(tmp_path / "m", family, seed=11)
    loaded = load_model(tmp_path / "m")
    model, tok = loaded.model, loaded.tokenizer
    generator = torch.Generator().manual_seed(3)
    prompts = torch.randint(0, len(CHARS), (6, 5), generator=generator)
    prompt_mask = torch.ones_like(prompts, dtype=torch.bool)
    prompt_mask[::3, :2] = False
    sampler = TokenSamplerConfig(
        generation_length=8, block_size=4, steps_per_block=2, temperature=1.0
    )
    trace = sample_tokens(
        model, prompts, prompt_mask, sampler, seeds=range(6), stop_token_id=tok.eos_id, capture=True
    ).trace
    batch = trace.prepare()
    assert int(batch.active.sum()) >= 24
    frozen = ReplayScorer.for_trace(model, trace, stop_gradient=True).score(batch)
    ratio = (frozen.logprobs - trace.behaviour_logprobs).exp()[batch.active]
    assert bool((ratio == 1.0).all())

    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    live = ReplayScorer.for_trace(model, trace).score(batch)
    advantages = torch.linspace(-1.0, 1.0, 6)[:, None].expand_as(live.logprobs)
    (-(live.logprobs * advantages)[batch.active].mean()).backward()
    optimizer.step()
    after = ReplayScorer.for_trace(model.eval(), trace, stop_gradient=True).score(batch)
    moved = (after.logprobs - trace.behaviour_logprobs)[batch.active].abs().max()
    assert float(moved) > 1e-4
