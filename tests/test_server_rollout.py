"""The server as the rollout engine: ``POST /rollout/generate`` on a live loopback server
returns the trace the in-process sampler captures (replayed with parity 0, ratio exactly 1)
and, capture off, the same artefact; ``grpo`` / ``flow-grpo`` with ``rollout.engine: server``
push the weights each step and end bitwise where in-process rollouts end; the client's
version map, checksum check, retries and refusals."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx2 as httpx
import pytest
import torch
from conftest import tiny_model
from flow_toy import one_thread, perturbed  # noqa: F401 (fixture: one CPU thread)
from serve_live import SAMPLER, LiveServer, write_token_model

from diffusion_rl.config import (
    ConfigError,
    FlowGRPORecipeConfig,
    GRPORecipeConfig,
    SFTRecipeConfig,
    build_config,
)
from diffusion_rl.models import CharTokenizer, DiffusionTransformer, TransformerConfig, load_model
from diffusion_rl.models.dit import FlowDiT, FlowDiTConfig
from diffusion_rl.models.io import save_model
from diffusion_rl.recipes.common import rollout_source
from diffusion_rl.recipes.flow_grpo import run_flow_grpo
from diffusion_rl.recipes.flow_sft import run_flow_sft
from diffusion_rl.recipes.grpo import run_grpo
from diffusion_rl.recipes.sft import run_sft
from diffusion_rl.rollout import TokenSource
from diffusion_rl.rollout_remote import (
    RolloutClient,
    RolloutServerError,
    ServerTokenSource,
    weights_checksum,
)
from diffusion_rl.sampling import TokenSamplerConfig, sample_tokens
from diffusion_rl.sampling.flow import FlowSamplerConfig, sample_flow
from diffusion_rl.scoring import ReplayScorer
from diffusion_rl.scoring.flow import FlowReplayScorer
from diffusion_rl.serving.engine import weights_checksum as served_checksum
from diffusion_rl.tasks import get_task
from diffusion_rl.trace_io import rollout_from_bytes

QUIET = {"echo": lambda _: None}
PROMPTS = ["12+3=", "4+4=", "7-1=", "9+9="]
ROLLOUT = {**SAMPLER, "steps_per_block": 4, "temperature": 1.0}


@pytest.fixture(scope="module")
def token_dir(tmp_path_factory) -> Path:
    return write_token_model(tmp_path_factory.mktemp("token") / "model", seed=3)


@pytest.fixture(scope="module")
def server(token_dir):
    live = LiveServer({"tiny": token_dir}, allow_tensor_updates=True, max_wait_ms=200.0)
    yield live
    live.stop()


def rollout(server, body) -> tuple[int, dict, object]:
    status, headers, data = server.request("POST", "/rollout/generate", body)
    return status, headers, rollout_from_bytes(data) if status == 200 else json.loads(data)


def encoded(tokenizer, prompts):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tokenizer.pad_id)
    mask = torch.zeros(len(prompts), width, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(tokenizer.encode(prompt))
        mask[row, width - len(prompt) :] = True
    return ids, mask


# ----------------------------------------------------------------------------- the route
def test_a_token_rollout_is_the_in_process_trace_and_replays_with_ratio_1(server, token_dir):
    loaded = load_model(token_dir)
    ids, mask = encoded(loaded.tokenizer, PROMPTS)
    seeds = [11, 12, 13, 14]
    body = {
        "model": "tiny",
        "prompt_ids": ids.tolist(),
        "prompt_mask": mask.tolist(),
        "seeds": seeds,
        "sampler": ROLLOUT,
    }
    status, headers, got = rollout(server, body)
    assert status == 200 and headers["content-type"] == "application/octet-stream"
    served = server.engine.get("tiny")
    assert headers["x-weights-version"] == str(served.version)
    assert headers["x-weights-checksum"] == served.checksum
    local = sample_tokens(
        loaded.model,
        ids,
        mask,
        TokenSamplerConfig(**ROLLOUT),
        seeds=seeds,
        stop_token_id=loaded.tokenizer.eos_id,
        capture=True,
        weights_version=served.version,
    ).trace
    trace = got.trace
    for name in ("prompt_ids", "prompt_mask", "tokens", "commit_steps", "behaviour_logprobs"):
        assert torch.equal(getattr(trace, name), getattr(local, name)), name
    assert (trace.sampler, trace.kernel_ids, trace.stop_token_id) == (
        local.sampler,
        local.kernel_ids,
        local.stop_token_id,
    )
    assert trace.model_info["served"] == {
        "model": "tiny",
        "weights_version": served.version,
        "checksum": served.checksum,
    }
    assert got.info["texts"] == loaded.tokenizer.batch_decode(local.tokens)
    assert got.info["usage"]["prompt_tokens"] == int(mask.sum())
    assert got.info["weights_checksum"] == served.checksum
    # the learner replays it: parity 0, ratio exactly 1 on every action
    scores = ReplayScorer.for_trace(loaded.model, trace, stop_gradient=True).score(trace.prepare())
    assert float((scores.logprobs - trace.behaviour_logprobs).abs().max()) == 0.0
    ratio = torch.exp(scores.logprobs - trace.behaviour_logprobs)[trace.sampled]
    assert ratio.numel() > 0 and bool((ratio == 1.0).all())


def test_autocast_rollouts_sample_under_the_callers_precision(server, token_dir):
    loaded = load_model(token_dir)
    ids, mask = encoded(loaded.tokenizer, PROMPTS)
    body = {"model": "tiny", "prompt": PROMPTS, "seeds": [1, 2, 3, 4], "sampler": ROLLOUT}
    fp32 = rollout(server, body)[2].trace
    bf16 = rollout(server, {**body, "autocast": "bfloat16"})[2].trace
    with torch.autocast("cpu", dtype=torch.bfloat16):
        local = sample_tokens(
            loaded.model,
            ids,
            mask,
            TokenSamplerConfig(**ROLLOUT),
            seeds=[1, 2, 3, 4],
            stop_token_id=loaded.tokenizer.eos_id,
            capture=True,
        ).trace
    assert torch.equal(bf16.behaviour_logprobs, local.behaviour_logprobs)
    assert not torch.equal(bf16.behaviour_logprobs, fp32.behaviour_logprobs)  # it did change


def test_capture_off_completions_equal_the_capture_on_rollout(server):
    seed = 40
    status, _, completion = server.json(
        "POST",
        "/v1/completions",
        {"model": "tiny", "prompt": PROMPTS[:3], "seed": seed, "n": 2, "temperature": 1.0},
    )
    assert status == 200
    rows = [p for p in PROMPTS[:3] for _ in range(2)]  # prompt-major, seeds seed + i
    body = {
        "model": "tiny",
        "prompt": rows,
        "seeds": [seed + i for i in range(6)],
        "sampler": {"temperature": 1.0},
    }
    status, _, got = rollout(server, body)
    assert status == 200
    assert [c["token_ids"] for c in completion["choices"]] == got.trace.tokens.tolist()
    assert [c["text"] for c in completion["choices"]] == got.info["texts"]
    assert completion["weights_version"] == got.info["weights_version"]


def test_merged_rollout_requests_equal_solo_ones(server):
    short = PROMPTS[1:]  # one prompt width (4 tokens): one batch key
    bodies = [
        {"model": "tiny", "prompt": [short[k], short[(k + 1) % 3]], "seeds": [k, k + 7]}
        for k in range(3)
    ]
    solo = [rollout(server, body)[2] for body in bodies]
    for _ in range(5):  # concurrent requests: merged when they arrive within max_wait_ms
        merged: list = [None] * 3

        def send(k, merged=merged):
            merged[k] = rollout(server, bodies[k])[2]

        threads = [threading.Thread(target=send, args=(k,)) for k in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if max(m.info["timings"]["batch_rows"] for m in merged) > 2:
            break
    assert max(m.info["timings"]["batch_rows"] for m in merged) > 2  # some were merged
    for alone, batched in zip(solo, merged):
        for name in ("tokens", "commit_steps", "behaviour_logprobs"):
            assert torch.equal(getattr(alone.trace, name), getattr(batched.trace, name))
        assert alone.info["texts"] == batched.info["texts"]


@pytest.mark.parametrize(
    ("change", "status", "param", "message"),
    [
        ({"prompt_ids": [[3, 4]]}, 400, "prompt", "exactly one of prompt"),
        ({"seeds": [1]}, 400, "prompt", "4 prompts for 1 seeds"),
        ({"sampler": {"temprature": 1.0}}, 400, "sampler.temprature", "unknown field"),
        ({"sampler": {"generation_length": 0}}, 400, "sampler.generation_length", "> 0"),
        ({"sampler": {"generation_length": 5000}}, 400, "sampler.generation_length", "over"),
        (
            {"sampler": {"schedule": "threshold", "steps_per_block": 5000}},
            400,
            "sampler.steps_per_block",
            "5000 is over max_steps=1000",
        ),
        ({"sampler": {"steps_per_block": 5}}, 400, "sampler", "must be <= block_size=4"),
        ({"prompt": ["12+3=", "", "1", "2"]}, 400, "prompt", "prompt[1]: encodes to no"),
        ({"prompt": ["12+3=", "x?", "1", "2"]}, 400, "prompt", "prompt[1]: "),
        ({"group_size": 2}, 400, "group_size", "only flow models"),
        ({"stop_token_id": 99}, 400, "stop_token_id", "not a token id in [0, 16)"),
        ({"weights_version": 77}, 409, "weights_version", "expects weights v77"),
        ({"model": "nope"}, 404, "model", "is not served here"),
        ({"seeds": [-1, 2, 3, 4]}, 400, "seeds", "seeds[0]"),
        ({"autocast": "int8"}, 400, "autocast", "autocast"),
    ],
)
def test_bad_rollout_requests_are_refused_by_field(server, change, status, param, message):
    body = {"model": "tiny", "prompt": PROMPTS, "seeds": [1, 2, 3, 4], **change}
    got_status, _, error = rollout(server, body)
    assert got_status == status, error
    assert error["error"]["param"] == param and message in error["error"]["message"]


def test_bad_prompt_ids_are_refused_by_position(server):
    body = {"model": "tiny", "prompt_ids": [[3, 4], [5, 16]], "seeds": [1, 2]}
    status, _, error = rollout(server, body)
    assert status == 400 and "prompt_ids[1][1]: 16 is not a token id" in error["error"]["message"]
    body = {"model": "tiny", "prompt_ids": [[3, 4], [5]], "seeds": [1, 2]}
    assert "rows of different lengths" in rollout(server, body)[2]["error"]["message"]
    body = {"model": "tiny", "prompt_ids": [[3, 4]], "prompt_mask": [[True]], "seeds": [1]}
    assert rollout(server, body)[2]["error"]["param"] == "prompt_mask"


# ----------------------------------------------------------------------------- flow route
WORDS = ("a", "red", "blue", "circle", "square", "two")
FLOW_PROMPTS = ["a red circle", "two blue square", "a blue circle", "two red square"]


@pytest.fixture(scope="module")
def flow_server(tmp_path_factory):
    torch.manual_seed(0)
    small = {"image_size": 8, "patch_size": 4, "d_model": 32, "n_layers": 1, "n_heads": 2}
    model = perturbed(FlowDiT(FlowDiTConfig(**small, vocabulary=WORDS)))
    directory = save_model(tmp_path_factory.mktemp("flow") / "dit", model, {})
    live = LiveServer({"dit": directory})
    yield live
    live.stop()


@pytest.mark.parametrize(
    "sampler",
    [
        FlowSamplerConfig(num_steps=4, mode="sde", guidance_scale=2.0, micro_batch_size=2),
        FlowSamplerConfig(
            num_steps=5, mode="sde", guidance_scale=1.0, sde_window=(1, 3), share_group_noise=True
        ),
    ],
)
def test_a_flow_rollout_is_the_in_process_trace_and_replays_with_ratio_1(flow_server, sampler):
    body = {
        "model": "dit",
        "prompt": FLOW_PROMPTS,
        "seeds": [3, 4, 5, 6],
        "sampler": sampler.model_dump(mode="json"),
        "group_size": 2,
    }
    status, headers, got = rollout(flow_server, body)
    assert status == 200 and headers["x-weights-version"] == "0"
    served = flow_server.engine.get("dit")
    local = sample_flow(
        served.model, FLOW_PROMPTS, sampler, seeds=[3, 4, 5, 6], capture=True, group_size=2
    )
    trace = got.trace
    for name in ("latents", "sigmas", "sde_steps", "behaviour_logprobs", "forward_groups"):
        assert torch.equal(getattr(trace, name), getattr(local.trace, name)), name
    assert trace.sampler == local.trace.sampler and trace.prompts == FLOW_PROMPTS
    assert torch.equal(got.artefacts["images"], local.images)
    assert got.info["usage"] == {"images": 4, "steps": 4 * sampler.num_steps}
    scores = FlowReplayScorer.for_trace(served.model, trace, stop_gradient=True).score_trace(trace)
    behaviour = trace.behaviour_logprobs[:, trace.sde_step_indices()]
    assert float((scores.logprobs - behaviour).abs().max()) == 0.0
    assert bool((torch.exp(scores.logprobs - behaviour) == 1.0).all())


@pytest.mark.parametrize(
    ("change", "param", "message"),
    [
        ({"prompt": ["a red circle"]}, "prompt", "one prompt per seed (4), got 1"),
        ({"prompt_ids": [[1]]}, "prompt_ids", "token models only"),
        ({"group_size": 3}, "group_size", "3 does not divide the 4 rows"),
        ({"sampler": {"num_steps": 2000}}, "sampler.num_steps", "over max_steps=1000"),
        ({"sampler": {"mode": "sde", "num_steps": 1}}, "sampler", "needs >= 2 steps"),
        ({"sampler": {"share_group_noise": True}, "group_size": None}, "group_size", "needs"),
        ({"prompt": ["a green circle"] * 4}, None, "outside the model's vocabulary"),
    ],
)
def test_bad_flow_rollout_requests_are_refused_by_field(flow_server, change, param, message):
    body = {"model": "dit", "prompt": FLOW_PROMPTS, "seeds": [1, 2, 3, 4], "group_size": 2}
    status, _, error = rollout(flow_server, {**body, **change})
    assert status == 400, error
    assert error["error"]["param"] == param and message in error["error"]["message"]


# ----------------------------------------------------------------------------- the client
def test_the_client_checksum_is_the_servers(token_dir):
    model = load_model(token_dir).model
    assert weights_checksum(model.state_dict()) == served_checksum(model.state_dict())


def test_tied_weights_are_pushed_under_each_name(tmp_path):
    torch.manual_seed(0)
    config = TransformerConfig(
        vocab_size=16, mask_token_id=1, d_model=32, n_layers=1, n_heads=2, max_seq_len=48
    )
    assert config.tie_embeddings  # the built-in default (every SFT model)
    save_model(tmp_path / "tied", DiffusionTransformer(config), {}, CharTokenizer("0123456789+-="))
    live = LiveServer({"tied": tmp_path / "tied"}, allow_tensor_updates=True)
    try:
        model = load_model(tmp_path / "tied").model
        with torch.no_grad():
            model.tok_emb.weight.add_(0.5)  # head.weight too: one tensor
        client = RolloutClient(live.url)
        assert client.sync(model, 0, None) == 1 and client.pushes == 1
        served = live.engine.get("tied").model.state_dict()
        assert torch.equal(served["head.weight"], model.state_dict()["head.weight"])
        assert live.engine.get("tied").checksum == weights_checksum(model.state_dict())
    finally:
        live.stop()


def test_the_version_map_and_the_checksum_guard_the_weights(tmp_path, token_dir):
    other = write_token_model(tmp_path / "other", seed=9)
    live = LiveServer({"tiny": other}, allow_tensor_updates=True)
    try:
        model = load_model(token_dir).model
        client = RolloutClient(live.url)
        assert client.model == "tiny"  # the only model
        # the server holds other weights: the first sync pushes, and fixes the map
        assert client.sync(model, 5, None) == 1 and client.offset == -4 and client.pushes == 1
        assert live.engine.get("tiny").checksum == weights_checksum(model.state_dict())
        assert client.sync(model, 5, None) == 1 and client.pushes == 1  # once per version
        with torch.no_grad():
            model.head.weight.add_(0.01)
        keys = ["head.weight"]
        assert client.sync(model, 6, keys) == 2 and client.pushes == 2  # named: 6 - 4
        assert live.engine.get("tiny").checksum == weights_checksum(model.state_dict())
        # another client's update lands in between: the named version or the checksum refuses
        intruder = RolloutClient(live.url)
        intruder.push_weights({"head.weight": torch.zeros_like(model.head.weight)})
        with torch.no_grad():
            model.head.weight.add_(0.01)
        with pytest.raises(RolloutServerError, match="weights_checksum: the server holds"):
            client.sync(model, 7, keys)
        # a sample against a version the server no longer holds is refused (409)
        source = ServerTokenSource(
            TokenSource(
                get_task("arithmetic", tokenizer=load_model(token_dir).tokenizer),
                TokenSamplerConfig(**SAMPLER),
            ),
            RolloutClient(live.url),
        )
        source.client.offset, source.client._synced = 0, (1, 1)
        task = source.task
        examples = [task.example(i, "train") for i in range(2)]
        with pytest.raises(RolloutServerError, match="HTTP 409: weights_version: the request"):
            source.sample(model, examples, [1, 2], 1)
        # a model of another architecture: the push is refused by name
        wide = tiny_model("bidirectional", width=48)
        with pytest.raises(RolloutServerError, match="HTTP 400: tensors: .* is torch.float32"):
            RolloutClient(live.url).sync(wide, 0, None)
    finally:
        live.stop()


def test_retries_are_bounded_and_honour_retry_after():
    calls = []

    def handler(request):
        calls.append(request.url.path)
        if len(calls) < 3:
            return httpx.Response(503, headers={"Retry-After": "0"}, json={"error": {}})
        return httpx.Response(200, json={"data": [{"id": "m"}]})

    client = RolloutClient("http://test", transport=httpx.MockTransport(handler), backoff_s=0.0)
    assert client.model == "m" and len(calls) == 3
    calls.clear()

    def always_down(request):
        calls.append(1)
        raise httpx.ConnectError("refused", request=request)

    client = RolloutClient(
        "http://test", transport=httpx.MockTransport(always_down), max_retries=2, backoff_s=0.0
    )
    with pytest.raises(RolloutServerError, match=r"ConnectError: refused \(after 3 tries"):
        client.card()
    assert len(calls) == 3

    def refuse(request):
        calls.append(1)
        return httpx.Response(400, json={"error": {"message": "seeds: bad"}})

    calls.clear()
    client = RolloutClient("http://test", transport=httpx.MockTransport(refuse), backoff_s=0.0)
    with pytest.raises(RolloutServerError, match="HTTP 400: seeds: bad") as info:
        client.card()
    assert info.value.status == 400 and len(calls) == 1  # a refusal is not retried


def test_the_api_key_comes_from_the_environment(tmp_path, token_dir, monkeypatch):
    live = LiveServer({"tiny": token_dir}, api_key="secret-key-1", allow_tensor_updates=True)
    try:
        section = build_config(
            GRPORecipeConfig,
            {"rollout": {"engine": "server", "url": live.url, "api_key_env": "S2_TEST_KEY"}},
        ).rollout
        loaded = load_model(token_dir)
        source = TokenSource(
            get_task("arithmetic", tokenizer=loaded.tokenizer), TokenSamplerConfig()
        )

        class Roles:
            actor = loaded.model

        with pytest.raises(ConfigError, match="rollout.api_key_env: the environment variable"):
            rollout_source(source, section, Roles)
        monkeypatch.setenv("S2_TEST_KEY", "wrong-key-22")
        with pytest.raises(RolloutServerError, match="HTTP 401: Authorization: wrong API key"):
            rollout_source(source, section, Roles).client.card()
        monkeypatch.setenv("S2_TEST_KEY", "secret-key-1")
        remote = rollout_source(source, section, Roles)
        assert remote.client.card() == (0, live.engine.get("tiny").checksum)
        assert remote.keys == [k for k, p in loaded.model.named_parameters()]  # all trained
    finally:
        live.stop()


def test_rollout_config_errors_name_the_key():
    for given, message in [
        ({"engine": "server"}, "rollout.url: engine: server needs the server's address"),
        ({"url": "ftp://x"}, "rollout.url: expected http://HOST:PORT"),
        ({"api_key_env": "my key"}, "rollout.api_key_env: expected the name of an environment"),
        ({"engine": "remote"}, "rollout.engine"),
        ({"timeout_s": 0}, "rollout.timeout_s"),
    ]:
        with pytest.raises(ConfigError, match=message):
            build_config(GRPORecipeConfig, {"rollout": given})
    assert GRPORecipeConfig().rollout.engine == "in_process"
    assert FlowGRPORecipeConfig().rollout.engine == "in_process"


# ----------------------------------------------------------------------------- recipes
GRPO_TINY = {
    "task": {"num_digits": 2},
    "steps": 3,
    "prompts_per_step": 2,
    "group_size": 4,
    "micro_batch_size": 5,
    "eval_every": 3,
    "eval_examples": 8,
    "checkpoint_every": 3,
    "rewards": [{"name": "digits"}],  # partial credit: a random model's groups differ
    "optim": {"lr": 1e-2},
}


def metric_records(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if "loss" in json.loads(line)]


def same_metrics(a: Path, b: Path) -> bool:
    """Every logged training metric equal (wall-clock times aside)."""

    def values(out):
        return [{k: v for k, v in r.items() if "time" not in k} for r in metric_records(out)]

    return values(a) == values(b)


def test_grpo_on_the_server_ends_bitwise_where_in_process_ends(tmp_path):
    sft = {
        "model": {"d_model": 32, "n_layers": 1, "n_heads": 2},
        "task": {"num_digits": 2},
        "steps": 30,
        "batch_size": 16,
        "eval_examples": 8,
        "output_dir": str(tmp_path / "sft"),
    }
    run_sft(build_config(SFTRecipeConfig, sft), **QUIET)  # some right answers: rewards vary
    token_dir = tmp_path / "sft" / "model"
    live = LiveServer({"tiny": token_dir}, allow_tensor_updates=True)
    try:

        def config(name, **extra):
            data = {
                **GRPO_TINY,
                "model": {"path": str(token_dir)},
                "output_dir": str(tmp_path / name),
            }
            return build_config(GRPORecipeConfig, {**data, **extra})

        local = run_grpo(config("local"), **QUIET)
        remote = run_grpo(
            config("remote", rollout={"engine": "server", "url": live.url, "model": "tiny"}),
            **QUIET,
        )
        served = live.engine.get("tiny")
    finally:
        live.stop()
    assert remote["weights_version"] == local["weights_version"] == 3
    # the server started on the learner's weights: no push for v0, then one per step; the
    # server's versions are the learner's (offset 0)
    assert served.version == 2
    a = load_model(tmp_path / "local" / "model").model.state_dict()
    b = load_model(tmp_path / "remote" / "model").model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(
        a["head.weight"], load_model(token_dir).model.state_dict()["head.weight"]
    )
    for records in (metric_records(tmp_path / "local"), metric_records(tmp_path / "remote")):
        assert len(records) == 3
        assert all(
            r["policy/ratio_mean"] == 1.0 and r["policy/parity_max_abs"] == 0.0 for r in records
        )
    assert same_metrics(tmp_path / "local", tmp_path / "remote")


FLOW_SFT = {
    "model": {"patch_size": 4, "d_model": 32, "n_layers": 1, "n_heads": 2},
    "sampler": {"num_steps": 4},
    "steps": 1,
    "batch_size": 4,
    "eval_every": 1,
    "eval_samples_per_prompt": 1,
    "grid_images": 0,
    "checkpoint_every": 1,
}
FLOW_GRPO = {
    "sampler": {"num_steps": 4, "micro_batch_size": 4},
    "steps": 3,
    "prompts_per_step": 2,
    "group_size": 4,
    "eval_every": 3,
    "eval_samples_per_prompt": 1,
    "grid_images": 0,
    "checkpoint_every": 3,
    "optim": {"lr": 1e-3},
}


def test_flow_grpo_on_the_server_ends_bitwise_where_in_process_ends(tmp_path):
    from diffusion_rl.config import FlowSFTRecipeConfig

    sft = build_config(FlowSFTRecipeConfig, {**FLOW_SFT, "output_dir": str(tmp_path / "sft")})
    run_flow_sft(sft, **QUIET)
    model_dir = tmp_path / "sft" / "model"
    live = LiveServer({"dit": model_dir}, allow_tensor_updates=True)
    try:

        def config(name, **extra):
            data = {
                **FLOW_GRPO,
                "model": {"path": str(model_dir)},
                "output_dir": str(tmp_path / name),
            }
            return build_config(FlowGRPORecipeConfig, {**data, **extra})

        local = run_flow_grpo(config("local"), **QUIET)
        remote = run_flow_grpo(
            config("remote", rollout={"engine": "server", "url": live.url}), **QUIET
        )
        served = live.engine.get("dit")
    finally:
        live.stop()
    assert remote["weights_version"] == local["weights_version"] == 3 and served.version == 2
    a = load_model(tmp_path / "local" / "model").model.state_dict()
    b = load_model(tmp_path / "remote" / "model").model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    first = next(k for k, v in a.items() if v.is_floating_point())
    assert same_metrics(tmp_path / "local", tmp_path / "remote")
    for out in ("local", "remote"):
        records = metric_records(tmp_path / out)
        assert len(records) == 3
        assert all(r["flow_grpo/parity_max_abs"] == 0.0 for r in records)
        assert records[0]["flow_grpo/ratio_min"] == 1.0 == records[0]["flow_grpo/ratio_max"]
    assert not torch.equal(a[first], load_model(model_dir).model.state_dict()[first])
