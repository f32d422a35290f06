"""The trace wire format: exact round trips of real captured traces (token, SDAR canvas-origin,
flow with and without CFG, bf16, a workflow stage), replay of the decoded trace with parity 0,
and bounded, validated reading: truncated, corrupt, foreign or tampered bodies are refused
with a TraceFormatError that names the problem."""

from __future__ import annotations

import dataclasses
import json
import struct

import pytest
import torch
from conftest import tiny_model
from flow_toy import TinyVelocity, one_thread, perturbed  # noqa: F401 (fixture: one CPU thread)
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from diffusion_rl.models.dit import FlowDiT, FlowDiTConfig
from diffusion_rl.models.video_dit import VideoDiT, VideoDiTConfig
from diffusion_rl.sampling import TokenSamplerConfig, sample_tokens
from diffusion_rl.sampling.flow import FlowSamplerConfig, sample_flow
from diffusion_rl.scoring import ReplayScorer
from diffusion_rl.scoring.flow import FlowReplayScorer
from diffusion_rl.trace import FlowTrace, TokenTrace
from diffusion_rl.trace_io import (
    FORMAT,
    METADATA_KEY,
    TraceFormatError,
    rollout_from_bytes,
    rollout_to_bytes,
    trace_from_bytes,
    trace_to_bytes,
)
from diffusion_rl.workflows import StageSpec, Workflow, WorkflowSpec

STOP = 2


def assert_same_trace(a, b) -> None:
    """Field by field: equal dtype, shape and values on every tensor (and tensor dict, in
    key order), ``==`` and the same types on the rest."""
    assert type(a) is type(b)
    for spec in dataclasses.fields(a):
        x, y = getattr(a, spec.name), getattr(b, spec.name)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape, spec.name
            assert torch.equal(x.cpu(), y), spec.name
        elif isinstance(x, dict) and x and all(isinstance(v, torch.Tensor) for v in x.values()):
            assert list(x) == list(y), spec.name
            for key in x:
                assert x[key].dtype == y[key].dtype and torch.equal(x[key].cpu(), y[key])
        else:
            assert x == y and type(x) is type(y), spec.name


def token_trace(attention="block_causal", schedule="fixed", temperature=1.0):
    model = tiny_model(attention)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 16, (6, 5), generator=g)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[::3, :2] = False
    config = TokenSamplerConfig(
        generation_length=12,
        block_size=4,
        steps_per_block=2,
        temperature=temperature,
        schedule=schedule,
        threshold=0.5,
    )
    sample = sample_tokens(
        model,
        ids,
        mask,
        config,
        seeds=range(6),
        stop_token_id=STOP,
        capture=True,
        weights_version=7,
    )
    return model, sample.trace


def flow_trace(guidance=2.0, latent_dtype="float32", micro=None):
    """A captured SDE rollout of the toy velocity model (bf16 latents: under bf16 autocast,
    as the recipes sample them)."""
    model = perturbed(TinyVelocity().eval())
    config = FlowSamplerConfig(
        num_steps=5,
        mode="sde",
        guidance_scale=guidance,
        sde_window=(1, 4),
        latent_dtype=latent_dtype,
        micro_batch_size=micro,
    )
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=latent_dtype == "bfloat16"):
        sample = sample_flow(
            model,
            ["1", "1", "6", "6"],
            config,
            seeds=[5, 6, 7, 8],
            capture=True,
            weights_version=3,
            group_size=2,
        )
    return model, sample.trace


# ----------------------------------------------------------------------------- round trips
@pytest.mark.parametrize(
    ("attention", "schedule", "temperature"),
    [
        ("block_causal", "fixed", 1.0),
        ("bidirectional", "threshold", 1.0),
        ("block_causal", "fixed", 0.0),
    ],
)
def test_token_trace_round_trips_exactly_and_replays_with_parity_0(
    attention, schedule, temperature
):
    model, trace = token_trace(attention, schedule, temperature)
    assert int(trace.sampled.sum()) > 0
    back = trace_from_bytes(trace_to_bytes(trace))
    assert_same_trace(trace, back)
    assert back.sampler["use_cache"] == (attention == "block_causal")
    assert back.weights_version == 7 and back.stop_token_id == STOP
    scores = ReplayScorer.for_trace(model, back, stop_gradient=True).score(back.prepare())
    assert float((scores.logprobs - trace.behaviour_logprobs).abs().max()) == 0.0


def test_int32_prompts_and_empty_completion_rows_round_trip():
    _, trace = token_trace()
    assert bool((trace.commit_steps == -1).any())  # rows that stopped early: -1 steps kept
    trace = dataclasses.replace(trace, prompt_ids=trace.prompt_ids.int())
    back = trace_from_bytes(trace_to_bytes(trace))
    assert back.prompt_ids.dtype == torch.int32
    assert_same_trace(trace, back)
    none = trace.rows(torch.zeros(len(trace), dtype=torch.bool))  # zero rows
    assert len(trace_from_bytes(trace_to_bytes(none))) == 0


@pytest.mark.parametrize(
    ("guidance", "dtype", "micro"),
    [(2.0, "float32", None), (1.0, "float32", 3), (2.0, "bfloat16", 2)],
)
def test_flow_trace_round_trips_exactly_and_replays_with_parity_0(guidance, dtype, micro):
    model, trace = flow_trace(guidance, dtype, micro)
    back = trace_from_bytes(trace_to_bytes(trace))
    assert_same_trace(trace, back)
    assert (back.uncond is None) == (guidance == 1.0)
    assert back.sampler["sde_window"] == (1, 4)  # a tuple stays a tuple
    assert back.latents.dtype == getattr(torch, dtype)
    if micro is not None:
        assert back.forward_groups.tolist() == [i // micro for i in range(4)]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
        scores = FlowReplayScorer.for_trace(model, back, stop_gradient=True).score_trace(back)
    behaviour = trace.behaviour_logprobs[:, back.sde_step_indices()]
    assert float((scores.logprobs - behaviour).abs().max()) == 0.0


def test_a_workflow_stage_trace_keeps_its_stage_and_replays():
    words = ("a", "red", "blue", "circle", "square", "moving", "left", "right")
    small = {"image_size": 8, "patch_size": 4, "d_model": 32, "n_layers": 1, "n_heads": 2}
    torch.manual_seed(0)
    image = perturbed(FlowDiT(FlowDiTConfig(**small, vocabulary=words))).eval()
    video = perturbed(VideoDiT(VideoDiTConfig(**small, vocabulary=words, num_frames=3))).eval()
    sde = FlowSamplerConfig(num_steps=3, mode="sde", guidance_scale=2.0, shift=1.0)
    spec = WorkflowSpec(
        name="t2i2v",
        stages=[
            StageSpec(name="image", model="image", sampler=sde),
            StageSpec(name="video", model="video", input="image", sampler=sde),
        ],
    )
    run = Workflow(spec, {"image": image, "video": video}).run(
        ["a red circle moving left", "a blue square moving right"],
        [3, 4],
        capture=True,
        versions={"image": 2, "video": 5},
    )
    trace = run.stages["video"].trace
    assert len(trace.cond) > 1  # the video stage is conditioned on the image too
    back = trace_from_bytes(trace_to_bytes(trace))
    assert_same_trace(trace, back)
    assert (back.stage, back.weights_version) == ("video", 5)
    scores = FlowReplayScorer.for_trace(video, back, stop_gradient=True).score_trace(back)
    behaviour = trace.behaviour_logprobs[:, back.sde_step_indices()]
    assert float((scores.logprobs - behaviour).abs().max()) == 0.0


def test_an_sdar_canvas_origin_trace_round_trips(tmp_path):
    pytest.importorskip("transformers")
    from test_hf_sdar import STOP as SDAR_STOP
    from test_hf_sdar import sample, sampler, write_tiny

    from diffusion_rl.models.hf.sdar import SDARDenoiser

    model = SDARDenoiser.from_pretrained(write_tiny(tmp_path / "sdar"))
    trace = sample(model, sampler()).trace
    assert trace.model_info["block_origin"] == "canvas"
    back = trace_from_bytes(trace_to_bytes(trace))
    assert_same_trace(trace, back)
    assert back.stop_token_id == SDAR_STOP
    scores = ReplayScorer.for_trace(model, back, stop_gradient=True).score(back.prepare())
    assert float((scores.logprobs - trace.behaviour_logprobs).abs().max()) == 0.0


def test_shared_storage_and_awkward_json_values_round_trip():
    _, trace = flow_trace()
    # cond and uncond views of one storage (safetensors refuses shared storage: cloned)
    both = torch.cat([trace.cond["label"], trace.uncond["label"]])
    info = {"nested": {"__tuple__": [1, 2]}, "pair": (1, (2.5, None)), "big": 2**62, "x": 1e-300}
    shared = dataclasses.replace(
        trace, cond={"label": both[:4]}, uncond={"label": both[4:]}, model_info=info
    )
    back = trace_from_bytes(trace_to_bytes(shared))
    assert_same_trace(shared, back)
    assert back.model_info["pair"] == (1, (2.5, None)) and isinstance(
        back.model_info["pair"][1], tuple
    )
    assert back.model_info["nested"] == {"__tuple__": [1, 2]}  # a dict, not a tuple


def test_the_body_is_plain_safetensors_with_the_documented_layout():
    _, trace = flow_trace()
    data = trace_to_bytes(trace)
    tensors = load_tensors(data)
    assert set(tensors) == {
        "latents",
        "sigmas",
        "sde_steps",
        "behaviour_logprobs",
        "seeds",
        "forward_groups",
        "cond/label",
        "uncond/label",
    }
    assert torch.equal(tensors["latents"], trace.latents)
    (size,) = struct.unpack("<Q", data[:8])
    layout = json.loads(json.loads(data[8 : 8 + size])["__metadata__"][METADATA_KEY])
    assert layout["format"] == FORMAT and layout["kind"] == "flow"
    assert layout["values"]["prompts"] == ["1", "1", "6", "6"]
    assert layout["values"]["weights_version"] == 3
    assert layout["tensor_dicts"] == {"cond": ["label"], "uncond": ["label"]}


def test_writing_refuses_values_json_cannot_hold():
    _, trace = flow_trace()
    odd = dataclasses.replace(trace, model_info={"dtype": torch.float32})
    with pytest.raises(TypeError, match=r"FlowTrace.model_info\['dtype'\]: a dtype cannot be"):
        trace_to_bytes(odd)
    with pytest.raises(ValueError, match=r"model_info\['x'\]: nan cannot be stored"):
        trace_to_bytes(dataclasses.replace(trace, model_info={"x": float("nan")}))
    with pytest.raises(TypeError, match="trace: expected a TokenTrace or FlowTrace, got dict"):
        trace_to_bytes({"latents": trace.latents})


# ----------------------------------------------------------------------------- refusals
def _rewrite(data: bytes, change) -> bytes:
    """``data`` with its layout metadata passed through ``change(layout) -> layout`` and its
    tensors through ``change_tensors`` (same bytes otherwise)."""
    (size,) = struct.unpack("<Q", data[:8])
    metadata = json.loads(data[8 : 8 + size])["__metadata__"]
    tensors = load_tensors(data)
    layout, tensors = change(json.loads(metadata[METADATA_KEY]), tensors)
    return save_tensors(tensors, metadata={METADATA_KEY: json.dumps(layout)})


def test_truncated_bodies_are_refused_at_every_cut():
    _, trace = token_trace()
    data = trace_to_bytes(trace)
    (size,) = struct.unpack("<Q", data[:8])
    cuts = [0, 3, 8, 9, 8 + size // 2, 8 + size, 8 + size + 1, len(data) // 2, len(data) - 1]
    for cut in cuts:
        with pytest.raises(TraceFormatError, match="trace body: "):
            trace_from_bytes(data[:cut])
    with pytest.raises(TraceFormatError, match="too short for a safetensors header"):
        trace_from_bytes(data[:5])
    with pytest.raises(TraceFormatError, match="header length .* exceeds the body"):
        trace_from_bytes(data[: 8 + size - 1])


def test_corrupt_bodies_are_refused():
    _, trace = token_trace()
    data = trace_to_bytes(trace)
    (size,) = struct.unpack("<Q", data[:8])
    with pytest.raises(TraceFormatError, match="header length"):
        trace_from_bytes(struct.pack("<Q", 2**40) + data[8:])
    with pytest.raises(TraceFormatError, match="header is not JSON"):
        trace_from_bytes(data[:8] + b"\xff" * size + data[8 + size :])
    with pytest.raises(TraceFormatError, match="header is not JSON"):
        trace_from_bytes(data[:8] + b"x" + data[9:])
    with pytest.raises(TraceFormatError, match="header is not a JSON object"):
        trace_from_bytes(data[:8] + b"[" + b" " * (size - 2) + b"]" + data[8 + size :])
    garbage = torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0))
    with pytest.raises(TraceFormatError, match="trace body: "):
        trace_from_bytes(bytes(garbage.to(torch.uint8).tolist()))
    # a data section one byte longer than the tensor table says: safetensors' own check
    with pytest.raises(TraceFormatError, match="not a readable safetensors body"):
        trace_from_bytes(data + b"\0")
    with pytest.raises(TypeError, match="data: expected bytes, got str"):
        trace_from_bytes("not bytes")


def test_a_body_over_the_size_cap_is_refused_before_parsing():
    _, trace = token_trace()
    data = trace_to_bytes(trace)
    with pytest.raises(TraceFormatError, match=f"{len(data)} bytes, over the limit of 100"):
        trace_from_bytes(data, max_bytes=100)
    assert len(trace_from_bytes(data, max_bytes=len(data))) == len(trace)


def test_foreign_and_unknown_bodies_are_refused():
    _, trace = token_trace()
    data = trace_to_bytes(trace)
    with pytest.raises(TraceFormatError, match="no 'diffusion_rl.trace' metadata"):
        trace_from_bytes(save_tensors({"x": torch.zeros(2)}))

    def kind(name):
        return lambda layout, t: ({**layout, "kind": name}, t)

    with pytest.raises(
        TraceFormatError, match=r"unknown kind 'video'; expected one of \['flow', 'token'\]"
    ):
        trace_from_bytes(_rewrite(data, kind("video")))
    with pytest.raises(TraceFormatError, match=r"format 'diffusion_rl.trace/2', expected"):
        trace_from_bytes(
            _rewrite(data, lambda layout, t: ({**layout, "format": FORMAT[:-1] + "2"}, t))
        )
    # a token body read as a flow trace: its fields do not match
    with pytest.raises(
        TraceFormatError,
        match=r"has unknown fields \['commit_steps', .*'tokens'\] and lacks \['cond', ",
    ):
        trace_from_bytes(_rewrite(data, kind("flow")))


def test_missing_extra_and_tampered_fields_are_refused_by_name():
    _, trace = token_trace()
    data = trace_to_bytes(trace)

    def drop_tensor(layout, tensors):
        return layout, {k: v for k, v in tensors.items() if k != "seeds"}

    with pytest.raises(
        TraceFormatError, match=r"the body lacks \['seeds'\]; a TokenTrace has the fields"
    ):
        trace_from_bytes(_rewrite(data, drop_tensor))

    def extra_value(layout, tensors):
        return {**layout, "values": {**layout["values"], "owner": "me"}}, tensors

    with pytest.raises(TraceFormatError, match=r"unknown fields \['owner'\]"):
        trace_from_bytes(_rewrite(data, extra_value))

    def drop_value(layout, tensors):
        values = {k: v for k, v in layout["values"].items() if k != "kernel_ids"}
        return {**layout, "values": values}, tensors

    with pytest.raises(TraceFormatError, match=r"the body lacks \['kernel_ids'\]"):
        trace_from_bytes(_rewrite(data, drop_value))

    def positive_logprob(layout, tensors):
        logprobs = tensors["behaviour_logprobs"].clone()
        row, slot = trace.sampled.nonzero()[0].tolist()
        logprobs[row, slot] = 0.5
        return layout, {**tensors, "behaviour_logprobs": logprobs}

    with pytest.raises(
        TraceFormatError,
        match=r"decoded trace is invalid: TokenTrace.behaviour_logprobs: must be <= 0",
    ):
        trace_from_bytes(_rewrite(data, positive_logprob))

    def float_tokens(layout, tensors):
        return layout, {**tensors, "tokens": tensors["tokens"].float()}

    with pytest.raises(TraceFormatError, match="TokenTrace.tokens: expected int64 ids"):
        trace_from_bytes(_rewrite(data, float_tokens))

    def bad_version(layout, tensors):
        return {**layout, "values": {**layout["values"], "weights_version": -1}}, tensors

    with pytest.raises(TraceFormatError, match=r"TokenTrace.weights_version: expected a weights"):
        trace_from_bytes(_rewrite(data, bad_version))


def test_flow_refusals_name_the_flow_field():
    _, trace = flow_trace()
    data = trace_to_bytes(trace)

    def rising_sigmas(layout, tensors):
        return layout, {**tensors, "sigmas": tensors["sigmas"].flip(0)}

    with pytest.raises(TraceFormatError, match="FlowTrace.sigmas"):
        trace_from_bytes(_rewrite(data, rising_sigmas))

    def lost_uncond(layout, tensors):
        dicts = {**layout["tensor_dicts"], "uncond": None}
        kept = {k: v for k, v in tensors.items() if not k.startswith("uncond/")}
        return {**layout, "tensor_dicts": dicts}, kept

    with pytest.raises(TraceFormatError, match="FlowTrace.uncond: guidance_scale=2.0 needs"):
        trace_from_bytes(_rewrite(data, lost_uncond))
    assert isinstance(trace_from_bytes(data), FlowTrace) and not isinstance(
        trace_from_bytes(data), TokenTrace
    )


def test_a_rollout_body_carries_the_artefact_next_to_the_trace():
    _, trace = flow_trace()
    images = torch.rand(4, 3, 8, 8)
    info = {"texts": ["a", "b"], "usage": {"images": 4}, "window": (1, 4)}
    data = rollout_to_bytes(trace, {"images": images}, info)
    body = rollout_from_bytes(data)
    assert_same_trace(trace, body.trace)
    assert list(body.artefacts) == ["images"] and torch.equal(body.artefacts["images"], images)
    assert body.info == info and isinstance(body.info["window"], tuple)
    assert_same_trace(trace, trace_from_bytes(data))  # a trace reader reads its trace
    plain = rollout_from_bytes(trace_to_bytes(trace))
    assert plain.artefacts == {} and plain.info == {}
    with pytest.raises(ValueError, match="artefacts: names are non-empty str without '/'"):
        rollout_to_bytes(trace, {"a/b": images})
    with pytest.raises(TypeError, match=r"artefacts\['images'\]: expected a tensor"):
        rollout_to_bytes(trace, {"images": [1, 2]})


def test_tensor_dict_entries_must_match_their_key_lists():
    _, trace = flow_trace()
    data = trace_to_bytes(trace)

    def extra_key(layout, tensors):
        return layout, {**tensors, "cond/extra": torch.zeros(4)}

    with pytest.raises(TraceFormatError, match=r"tensor dict entries \['cond/extra', 'cond/label'"):
        trace_from_bytes(_rewrite(data, extra_key))
