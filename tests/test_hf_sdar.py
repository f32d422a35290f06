"""SDAR / TraDo block diffusion: conformance with the family's fixtures and the canvas block
origin through sampler, block KV cache, dense and packed replay and one GRPO step.

The fixtures (``../shared/fixtures/hf_dllm{,_wide}/sdar``) were written by SDAR's own modeling
code with reference logits; the batch tests use a tiny random SDAR checkpoint written to
``tmp_path`` and loaded back like a user's directory, with prompts of different lengths in
one left-padded batch, so that ``r_b = P_b % block_size`` differs per row.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from diffusion_rl.advantages import group_advantages  # noqa: E402
from diffusion_rl.models.hf.sdar import (  # noqa: E402
    SDARCheckpointError,
    SDARDenoiser,
    check_config,
)
from diffusion_rl.models.protocol import (  # noqa: E402
    BlockCachedDenoiser,
    BlockLayout,
    block_origin,
    completion_blocks,
    completion_offsets,
)
from diffusion_rl.objectives.grpo import PolicyLoss, PolicyLossConfig  # noqa: E402
from diffusion_rl.rollout import Rollout  # noqa: E402
from diffusion_rl.sampling import TokenSamplerConfig, sample_tokens  # noqa: E402
from diffusion_rl.scoring import ReplayScorer  # noqa: E402
from diffusion_rl.scoring.packed import PackedReplayScorer, packed_layout  # noqa: E402
from diffusion_rl.trace import TokenTrace  # noqa: E402
from diffusion_rl.train import OptimConfig, Trainer  # noqa: E402
from diffusion_rl.train.learner import PolicyLearner  # noqa: E402
from diffusion_rl.train.plans import TokenPolicyPlan  # noqa: E402
from diffusion_rl.train.roles import PolicyRoles  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures"
FIXTURE_DIRS = [FIXTURES / "hf_dllm" / "sdar", FIXTURES / "hf_dllm_wide" / "sdar"]
K = 4  # block size of every model here
MASK, STOP = 47, 2  # ids of the tiny random checkpoint
PROMPT_LENGTHS = (3, 4, 5, 6, 9, 2)  # r_b = 3, 0, 1, 2, 1, 2


def fixture_dir(path: Path) -> Path:
    if not (path / "reference.safetensors").is_file():
        pytest.skip(f"{path}: ../shared/fixtures absent (CI has it)")
    return path


def tiny_config(**overrides) -> dict:
    """An SDAR config.json (the released field names, tiny sizes), training switches
    included so that they are shown to change nothing."""
    config = {
        "architectures": ["SDARForCausalLM"],
        "model_type": "sdar",
        "vocab_size": 48,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "block_size": K,
        "mask_token_id": MASK,
        "bos_token_id": STOP,
        "eos_token_id": STOP,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "rope_scaling": None,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "use_sliding_window": False,
        "attn_implementation": "flex_attention",
        "fuse_cross_entropy": True,
        "use_cache": False,
    }
    return {**config, **overrides}


def write_tiny(directory: Path, seed: int = 0, **overrides) -> Path:
    """A random SDAR checkpoint (weights large enough for distinct, confident proposals)."""
    torch.manual_seed(seed)
    model = SDARDenoiser(tiny_config(**overrides))
    with torch.no_grad():
        for name, p in model.network.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 1.0 if name.startswith("lm_head") else 0.15)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("sdar_tiny"))


@pytest.fixture(scope="module")
def tiny(tiny_dir) -> SDARDenoiser:
    return SDARDenoiser.from_pretrained(tiny_dir)


def prompts(lengths=PROMPT_LENGTHS, seed=1):
    """Left-padded prompts of the given real lengths (pad id = STOP)."""
    width = max(lengths)
    ids = torch.full((len(lengths), width), STOP)
    mask = torch.zeros(len(lengths), width, dtype=torch.bool)
    g = torch.Generator().manual_seed(seed)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(3, MASK, (n,), generator=g)
        mask[row, width - n :] = True
    return ids, mask


def sampler(**options) -> TokenSamplerConfig:
    settings = {
        "generation_length": 10,
        "block_size": K,
        "steps_per_block": 2,
        "temperature": 1.0,
        "threshold": 0.3,
    }
    return TokenSamplerConfig(**{**settings, **options})


def sample(model, config, lengths=PROMPT_LENGTHS, stop=STOP):
    ids, mask = prompts(lengths)
    seeds = range(len(lengths))
    return sample_tokens(model, ids, mask, config, seeds=seeds, stop_token_id=stop, capture=True)


def max_abs(a, b) -> float:
    return float((a - b).detach().abs().max())


# ------------------------------------------------------------------------------- fixtures
@pytest.mark.parametrize("path", FIXTURE_DIRS, ids=["shared", "wide"])
def test_fixture_logits_equal_the_reference(path):
    directory = fixture_dir(path)
    model = SDARDenoiser.from_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    assert isinstance(model, BlockCachedDenoiser) and block_origin(model) == "canvas"
    assert model.mask_token_id == config["mask_token_id"] and model.block_size == 4
    assert model.attention == "block_causal" and model.alignment == "same_position"
    # the released training switches are present and switch nothing
    assert config["attn_implementation"] == "flex_attention" and config["fuse_cross_entropy"]
    assert model.network.config._attn_implementation == "sdpa"
    assert model.num_parameters() == SDARDenoiser.parameter_count(config)
    ref = load_file(str(directory / "reference.safetensors"))
    assert torch.equal(ref["position_ids"][0], torch.arange(ref["c0_input_ids"].shape[1]))
    with torch.no_grad():
        for canvas in ("c0", "c1", "c2"):
            ids = ref[f"{canvas}_input_ids"]
            for prompt_length in (0, 6):  # SDAR's blocks do not depend on prompt_length
                logits = model(ids, torch.ones_like(ids, dtype=torch.bool), prompt_length)
                assert max_abs(logits, ref[f"{canvas}_logits"]) <= 1e-5, canvas


@pytest.mark.parametrize("path", FIXTURE_DIRS, ids=["shared", "wide"])
def test_load_model_reads_the_fixture(path):
    directory = fixture_dir(path)
    io = pytest.importorskip("diffusion_rl.models.io")
    if "sdar" not in getattr(io, "HF_MODEL_TYPES", {}):
        pytest.skip("models.io has no Hugging Face registry yet (helper A)")
    loaded = io.load_model(directory)
    assert isinstance(loaded.model, SDARDenoiser) and loaded.kind == "token"
    assert loaded.tokenizer.mask_id == loaded.model.mask_token_id
    ref = load_file(str(directory / "reference.safetensors"))
    with torch.no_grad():
        for canvas in ("c0", "c1", "c2"):
            ids = ref[f"{canvas}_input_ids"]
            logits = loaded.model(ids, torch.ones_like(ids, dtype=torch.bool), 0)
            assert max_abs(logits, ref[f"{canvas}_logits"]) <= 1e-5, canvas


@pytest.mark.parametrize("path", FIXTURE_DIRS, ids=["shared", "wide"])
def test_block_causality_and_left_padding(path):
    model = SDARDenoiser.from_pretrained(fixture_dir(path))
    ids = load_file(str(path / "reference.safetensors"))["c2_input_ids"]  # L = 16: 4 blocks
    ones = torch.ones_like(ids, dtype=torch.bool)
    changed = ids.clone()
    changed[:, 12:] = (changed[:, 12:] + 7) % 250
    with torch.no_grad():
        before, after = model(ids, ones, 0), model(changed, ones, 0)
        assert torch.equal(before[:, :12], after[:, :12])  # earlier blocks: bitwise unchanged
        assert max_abs(before[:, 12:], after[:, 12:]) > 1e-3
        changed = ids.clone()
        changed[:, 5] = (changed[:, 5] + 1) % 250  # block 1 changes blocks 1.. only
        moved = model(changed, ones, 0)
        assert torch.equal(before[:, :4], moved[:, :4])
        assert max_abs(before[:, 4:8], moved[:, 4:8]) > 1e-3
        # three pad columns on the left (any id, masked): the real tokens' logits stay
        padded = torch.cat([torch.full((2, 3), 7), ids], dim=1)
        mask = torch.cat([torch.zeros(2, 3, dtype=torch.bool), ones], dim=1)
        assert max_abs(model(padded, mask, 0)[:, 3:], before) <= 1e-5


@pytest.mark.parametrize("path", FIXTURE_DIRS[:1], ids=["shared"])
def test_save_pretrained_writes_sdars_own_format(path, tmp_path):
    source = fixture_dir(path)
    model = SDARDenoiser.from_pretrained(source)
    model.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    original = json.loads((source / "config.json").read_text())
    assert written == original  # same keys and values (torch_dtype float32 both)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    saved, stored = (
        load_file(str(tmp_path / "model.safetensors")),
        load_file(str(source / "model.safetensors")),
    )
    assert saved.keys() == stored.keys()
    assert all(torch.equal(saved[k], stored[k]) for k in stored)
    # the family's key layout loads into the stock class SDAR's checkpoints are built on
    from transformers import Qwen3ForCausalLM

    Qwen3ForCausalLM(model.network.config).load_state_dict(saved, strict=True)
    ids = torch.tensor([[5, 6, 7, 286, 286, 286]])
    again = SDARDenoiser.from_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(again(ids, None, 0), model(ids, None, 0))


def test_tied_embeddings_and_bf16(tmp_path):
    directory = write_tiny(tmp_path / "tied", tie_word_embeddings=True)
    keys = load_file(str(directory / "model.safetensors")).keys()
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys
    model = SDARDenoiser.from_pretrained(directory, dtype="bfloat16")
    net = model.network
    assert net.lm_head.weight is net.model.embed_tokens.weight
    assert model.num_parameters() == SDARDenoiser.parameter_count(
        tiny_config(tie_word_embeddings=True)
    )
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    # bf16: the cached sampler and its cached replay run the same computation, bitwise
    trace = sample(model, sampler()).trace
    scores = ReplayScorer.for_trace(model, trace, stop_gradient=True).score(trace.prepare())
    assert torch.equal(scores.logprobs, trace.behaviour_logprobs)


def test_refusals_name_the_file_and_the_key(tmp_path):
    for change, pattern in [
        ({"model_type": "qwen3"}, "model_type must be 'sdar'"),
        ({"model_type": "sdar_moe"}, "mixture-of-experts"),
        ({"mask_token_id": 48}, r"^x/config.json: mask_token_id=48 exceeds the limit 47$"),
        ({"hidden_size": True}, "^x/config.json: hidden_size: expected an integer, got bool"),
        (
            {"num_hidden_layers": 10**6},
            "x/config.json: num_hidden_layers=1000000 exceeds the limit 1024$",
        ),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ]:
        with pytest.raises(SDARCheckpointError, match=pattern):
            check_config(tiny_config(**change), "x/config.json")
    config = tiny_config()
    del config["block_size"]
    with pytest.raises(ValueError, match="^config.json: missing key block_size$"):
        SDARDenoiser.parameter_count(config)
    start = time.monotonic()
    with pytest.raises(ValueError, match="hf download JetLM/SDAR-4B-Chat --local-dir DIR"):
        SDARDenoiser.from_pretrained("JetLM/SDAR-4B-Chat")
    assert time.monotonic() - start < 2
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps(tiny_config()))
    (pickled / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(
        ValueError, match=r"\['pytorch_model.bin'\] are pickle files, .*to safetensors"
    ):
        SDARDenoiser.from_pretrained(pickled)
    short = write_tiny(tmp_path / "short")
    state = load_file(str(short / "model.safetensors"))
    del state["model.layers.1.self_attn.k_norm.weight"]
    from safetensors.torch import save_file

    save_file(state, str(short / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing .*model.layers.1.self_attn.k_norm.weight"):
        SDARDenoiser.from_pretrained(short)


# -------------------------------------------------------------------------- block origin
def test_offsets_and_blocks_by_hand():
    _, mask = prompts()
    offsets = completion_offsets(mask, K, "canvas")
    assert offsets.tolist() == [3, 0, 1, 2, 1, 2]
    assert completion_offsets(mask, K, "prompt").tolist() == [0] * 6
    assert completion_blocks(offsets, 6, K)[0].tolist() == [0, 1, 1, 1, 1, 2]  # P = 3
    assert completion_blocks(offsets, 6, K)[1].tolist() == [0, 0, 0, 0, 1, 1]  # P = 4
    with pytest.raises(ValueError, match="block_origin"):
        completion_offsets(mask, K, "completion")
    layout = BlockLayout(torch.tensor([3, 0, 1]), 5, K)  # aligned columns, by hand
    assert (layout.width, layout.num_blocks, layout.span(1)) == (8, 2, (4, 8))
    columns = layout.to_columns(torch.arange(15).view(3, 5), -1, tail=torch.arange(4).repeat(3, 1))
    assert columns.tolist() == [
        [1, 2, 3, 0, 1, 2, 3, 4],  # prompt tail (last 3 prompt ids), slots 0..4
        [5, 6, 7, 8, 9, -1, -1, -1],  # r = 0: slots, then past the end
        [3, 10, 11, 12, 13, 14, -1, -1],
    ]
    assert layout.is_key.sum(1).tolist() == [8, 5, 6]
    assert torch.equal(layout.to_slots(columns), torch.arange(15).view(3, 5))

    class Odd:
        block_origin = "middle"

    with pytest.raises(ValueError, match="Odd.block_origin must be one of"):
        block_origin(Odd())


def sdar_reference(model, prompt: list[int], length: int, steps_per_block: int):
    """SDAR's own per-row procedure (JetAstra/SDAR generate.py ``block_diffusion_generate``,
    one unpadded row): the canvas is cut into blocks from its first token; the fully-prompt
    blocks are context, then every block with a MASK is denoised in turn, a partial first
    block together with its prompt tokens. Inside a block: greedy proposals, the fixed
    schedule (``n // S`` per step, the remainder on the first steps), most confident first,
    ties to the lowest position. Returns the completion, the slot groups denoised together
    and the log-prob of each slot's token."""
    total = len(prompt) + length
    num_blocks = math.ceil(total / K)
    tril = torch.tril(torch.ones(num_blocks, num_blocks))
    attend = tril.repeat_interleave(K, 0).repeat_interleave(K, 1)[:total, :total].bool()
    x = torch.tensor([prompt + [model.mask_token_id] * length])
    positions = torch.arange(total)[None]
    groups, logprobs = [], [0.0] * length
    for block in range(len(prompt) // K, num_blocks):
        columns = [c for c in range(block * K, min(total, (block + 1) * K)) if c >= len(prompt)]
        groups.append([c - len(prompt) for c in columns])
        steps = min(steps_per_block, len(columns))
        counts = [len(columns) // steps + (s < len(columns) % steps) for s in range(steps)]
        for count in counts:
            with torch.no_grad():
                out = model.network(
                    input_ids=x, attention_mask=attend[None, None], position_ids=positions
                )
            logits = out.logits[0].float()
            logits[:, model.mask_token_id] = -math.inf
            logp = torch.log_softmax(logits, -1)
            pending = [c for c in columns if int(x[0, c]) == model.mask_token_id]
            best = {c: int(logp[c].argmax()) for c in pending}
            ranked = sorted(pending, key=lambda c: (-float(logp[c, best[c]]), c))
            for c in ranked[:count]:
                x[0, c] = best[c]
                logprobs[c - len(prompt)] = float(logp[c, best[c]])
    return x[0, len(prompt) :], groups, torch.tensor(logprobs)


@pytest.mark.parametrize("use_cache", [True, False])
def test_sampler_denoises_the_blocks_sdar_denoises(tiny, use_cache):
    config = sampler(temperature=0.0, steps_per_block=3, generation_length=9, use_cache=use_cache)
    trace = sample(tiny, config, stop=None).trace
    ids, mask = prompts()
    assert trace.model_info["block_origin"] == "canvas"
    for row, n in enumerate(PROMPT_LENGTHS):
        prompt = ids[row, mask[row]].tolist()
        tokens, groups, logprobs = sdar_reference(tiny, prompt, 9, 3)
        steps = trace.commit_steps[row]
        got = [sorted(torch.nonzero(steps // 3 == j).flatten().tolist()) for j in range(4)]
        assert [g for g in got if g] == groups, f"row {row} (P={n})"
        assert torch.equal(trace.tokens[row], tokens), f"row {row}"
        assert max_abs(trace.behaviour_logprobs[row], logprobs) <= 1e-5
    # by hand: P = 6 (r = 2) denoises slots 0, 1 with prompt tokens 4, 5, then slots 2..5
    six = ids[3, mask[3]].tolist()
    assert len(six) == 6 and sdar_reference(tiny, six, 9, 3)[1][:2] == [[0, 1], [2, 3, 4, 5]]
    assert sorted(torch.nonzero(trace.commit_steps[3] < 3).flatten().tolist()) == [0, 1]


@pytest.mark.parametrize("schedule", ["fixed", "threshold"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_block_cache_gives_the_tokens_and_logprobs_of_no_cache(tiny, schedule, temperature):
    cached = sample(tiny, sampler(schedule=schedule, temperature=temperature)).trace
    plain = sample(tiny, sampler(schedule=schedule, temperature=temperature, use_cache=False)).trace
    assert cached.sampler["use_cache"] and not plain.sampler["use_cache"]
    assert torch.equal(cached.tokens, plain.tokens)
    assert torch.equal(cached.commit_steps, plain.commit_steps)
    assert max_abs(cached.behaviour_logprobs, plain.behaviour_logprobs) <= 1e-5
    assert bool((cached.commit_steps >= 0).any(1).all())


def test_rows_do_not_depend_on_batch_mates(tiny):
    config = sampler()
    whole = sample(tiny, config).trace
    ids, mask = prompts()
    for row in (0, 1, 3):  # r = 3, 0, 2
        alone = sample_tokens(
            tiny,
            ids[row : row + 1],
            mask[row : row + 1],
            config,
            seeds=[row],
            stop_token_id=STOP,
            capture=True,
        ).trace
        assert torch.equal(alone.tokens[0], whole.tokens[row])
        assert torch.equal(alone.commit_steps[0], whole.commit_steps[row])
        assert max_abs(alone.behaviour_logprobs[0], whole.behaviour_logprobs[row]) <= 1e-5


@pytest.mark.parametrize("schedule", ["fixed", "threshold"])
def test_dense_and_packed_replay(tiny, schedule):
    free = sample(tiny, sampler(schedule=schedule), stop=None).trace
    stop = int(free.tokens.flatten().mode().values)  # a frequent token: rows stop early
    trace = sample(tiny, sampler(schedule=schedule), stop=stop).trace
    assert bool((trace.commit_steps < 0).any()) and bool(trace.post_stop().any())
    batch = trace.prepare()
    options = {"stop_gradient": True, "compute_entropy": True}
    cached = ReplayScorer.for_trace(tiny, trace, **options).score(batch)
    canvas = ReplayScorer(tiny, temperature=1.0, use_cache=False, **options).score(batch)
    packed = PackedReplayScorer.for_trace(tiny, trace, **options).score(batch)
    assert max_abs(cached.logprobs, trace.behaviour_logprobs) <= 1e-6  # the sampler's walk
    assert max_abs(canvas.logprobs, trace.behaviour_logprobs) <= 1e-5
    for dense in (cached, canvas):
        assert max_abs(packed.logprobs, dense.logprobs) <= 1e-5
        assert max_abs(packed.entropy, dense.entropy) <= 1e-5
    assert bool((packed.logprobs[~batch.active] == 0).all())
    chunked = PackedReplayScorer.for_trace(tiny, trace, micro_batch_size=4, **options)
    assert max_abs(chunked.score(batch).logprobs, canvas.logprobs) <= 1e-5


def test_gradients_through_cache_and_packing_with_activation_checkpointing(tiny_dir):
    """Cached and packed replay give the full-canvas gradients (to fp32 rounding); with
    transformers' activation checkpointing on, every decoder layer is recomputed in backward
    and the gradients are bitwise those without it (the cache's keys are reached too)."""
    model = SDARDenoiser.from_pretrained(tiny_dir)
    trace = sample(model, sampler()).trace
    batch = trace.prepare()
    weights = torch.rand(batch.target_ids.shape, generator=torch.Generator().manual_seed(2))
    model.train()

    def grads(scorer):
        model.zero_grad()
        (scorer.score(batch).logprobs * weights).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    expected = grads(ReplayScorer(model, temperature=1.0, use_cache=False))
    scale = max(float(g.abs().max()) for g in expected.values())
    calls = []
    mlp = model.network.model.layers[0].mlp
    original = mlp.forward
    mlp.forward = lambda x: (calls.append(1), original(x))[1]
    for make in (
        lambda: ReplayScorer(model, temperature=1.0, use_cache=True),
        lambda: PackedReplayScorer(model, temperature=1.0),
    ):
        runs = {}
        for checkpointing in (False, True):
            model.enable_activation_checkpointing(checkpointing)
            calls.clear()
            runs[checkpointing] = grads(make()), len(calls)
        model.enable_activation_checkpointing(False)
        (plain, plain_calls), (checked, checked_calls) = runs[False], runs[True]
        assert plain.keys() == expected.keys() == checked.keys() and len(expected) > 0
        for name in expected:
            assert max_abs(plain[name], expected[name]) <= 1e-5 * scale, name
            assert torch.equal(checked[name], plain[name]), name
        assert checked_calls == 2 * plain_calls > 0  # each layer forward recomputed once


def test_packed_layout_canvas_by_hand():
    """One row, P = 3, K = 2 (r = 1): completion block 0 = prompt token 7 (position 2) and
    slot 0; block 1 = slots 1, 2. Steps: slot 0 at 0, slot 1 at 2, slot 2 at 3."""
    M = MASK
    steps = torch.tensor([[0, 2, 3]])
    layout = packed_layout(
        torch.tensor([[5, 6, 7]]),
        torch.ones(1, 3, dtype=torch.bool),
        torch.tensor([[3, 4, 8]]),
        steps,
        steps >= 0,
        block_size=2,
        mask_token_id=M,
        block_origin="canvas",
    )
    # 0-2 prompt | 3-5 clean slots | copy (0, 0): 6-7 | copy (1, 2): 8-9 | copy (1, 3): 10-11
    assert layout.copies == ((0, 0), (1, 2), (1, 3))
    assert layout.input_ids.tolist() == [[5, 6, 7, 3, 4, 8, 7, M, M, M, 4, M]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 2, 3, 4, 5, 4, 5]]
    assert layout.read_index.tolist() == [[7, 8, 11]]
    grid = [
        "110000000000",  # prompt 0, 1: canvas block 0
        "110000000000",
        "111100000000",  # prompt tail 2: block 1, with slot 0 (bidirectional)
        "111100000000",  # clean slot 0
        "111111000000",  # clean slots 1, 2: block 2
        "111111000000",
        "110000110000",  # copy (0, 0): blocks < 1, and itself (its own prompt tail)
        "110000110000",
        "111100001100",  # copy (1, 2): blocks < 2, and itself
        "111100001100",
        "111100000011",  # copy (1, 3)
        "111100000011",
    ]
    expected = torch.tensor([[[c == "1" for c in row] for row in grid]])
    assert torch.equal(layout.allowed, expected)
    # the completion origin groups the same slots differently: {0, 1} then {2}
    other = packed_layout(
        torch.tensor([[5, 6, 7]]),
        torch.ones(1, 3, dtype=torch.bool),
        torch.tensor([[3, 4, 8]]),
        steps,
        steps >= 0,
        block_size=2,
        mask_token_id=M,
    )
    assert other.copies == ((0, 0), (0, 2), (1, 3))


def test_a_canvas_trace_is_refused_by_a_completion_origin_walk(tiny):
    """Row 0 (P = 3, r = 3): slots 1..4 are one canvas block, committed at steps 2 and 3; the
    completion origin puts slot 4 in a later block than slots 1..3, so it would be scored
    against a final block 0 it never saw."""
    trace = sample(tiny, sampler(generation_length=8), stop=None).trace
    inputs = trace.prepare().model_inputs
    with pytest.raises(ValueError, match="another block_origin"):
        packed_layout(
            inputs["prompt_ids"],
            inputs["prompt_mask"],
            trace.tokens,
            trace.commit_steps,
            trace.sampled,
            block_size=K,
            mask_token_id=MASK,
            block_origin="prompt",
        )


def test_trace_validation_follows_the_canvas_blocks(tiny):
    trace = sample(tiny, sampler(generation_length=8), stop=None).trace
    fields = {name: getattr(trace, name) for name in trace.__dataclass_fields__}
    TokenTrace(**fields)  # accepted as sampled
    prompt_info = {k: v for k, v in trace.model_info.items() if k != "block_origin"}
    with pytest.raises(ValueError, match=r"lies in block 0 \(block_size 4, block_origin 'prompt'"):
        TokenTrace(**{**fields, "model_info": prompt_info})
    with pytest.raises(ValueError, match=r"model_info\['block_origin'\]"):
        TokenTrace(**{**fields, "model_info": {**trace.model_info, "block_origin": "middle"}})


# --------------------------------------------------------------------------------- GRPO
@pytest.mark.parametrize(("scorer", "iterations"), [("exact", 1), ("exact", 2), ("packed", 1)])
def test_one_grpo_step_has_parity_and_ratio_one(tiny_dir, scorer, iterations):
    model = SDARDenoiser.from_pretrained(tiny_dir)
    policy = PolicyLossConfig(algorithm="grpo", num_iterations=iterations, beta=0.04)
    roles = PolicyRoles(model, reference=policy.uses_reference)
    learner = PolicyLearner(
        roles,
        TokenPolicyPlan(PolicyLoss(policy), scorer=scorer),
        lambda actor, loss_fn: Trainer(actor, loss_fn, OptimConfig(lr=1e-3, grad_clip=None)),
    )
    group, lengths = 4, (5,) * 4 + (7,) * 4  # two prompts (r = 1, 3), four samples each
    ids, mask = prompts(lengths)
    ids[4:] = ids[4]  # each group shares its prompt
    ids[:4] = ids[0]
    trace = sample_tokens(
        roles.rollout, ids, mask, sampler(), seeds=range(8), stop_token_id=STOP, capture=True
    ).trace
    rewards = torch.tensor([0.0, 1.0, 2.0, 1.0, 2.0, 0.0, 0.0, 1.0])
    rollout = Rollout(
        trace=trace,
        outputs=[""] * 8,
        examples=[None] * 8,
        rewards=rewards,
        advantages=group_advantages(rewards, group, policy.advantage_spec),
        group_size=group,
    )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    metrics = learner.step(rollout)
    assert metrics["policy/ratio_max@iter0"] == 1.0 == metrics["policy/ratio_min@iter0"]
    assert metrics["policy/parity_max_abs@iter0"] <= (1e-6 if scorer == "exact" else 1e-5)
    assert metrics["policy/kl@iter0"] == 0.0 and metrics["grad_norm@iter0"] > 0
    after = model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
