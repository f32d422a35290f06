"""Bad requests: each kind gets a 4xx whose OpenAI error JSON names the field (``param`` and
the message), and the server keeps serving with its weights unchanged."""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch

pytest.importorskip("fastapi")

from serve_live import LiveServer, write_token_model  # noqa: E402

KEY = "bad-requests-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
GOOD = {"model": "tiny", "prompt": "12+34=", "seed": 1}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "1+2="}]}
OCTET = {"Content-Type": "application/octet-stream"}


def good(**changes):
    body = dict(GOOD, **changes)
    return {k: v for k, v in body.items() if v is not ...}


def chat(**changes):
    body = dict(CHAT, **changes)
    return {k: v for k, v in body.items() if v is not ...}


def tensors(**named) -> bytes:
    return safetensors.torch.save(named)


# (id, method, path, body, extra headers, status, param); ... removes a key
CASES = [
    ("malformed-json", "POST", "/v1/completions", '{"model": "tiny",', {}, 400, "body"),
    ("json-array", "POST", "/v1/completions", [1, 2], {}, 400, "body"),
    ("empty-body", "POST", "/v1/completions", "", {}, 400, "body"),
    ("missing-model", "POST", "/v1/completions", good(model=...), {}, 400, "model"),
    ("missing-prompt", "POST", "/v1/completions", good(prompt=...), {}, 400, "prompt"),
    ("model-not-a-string", "POST", "/v1/completions", good(model=3), {}, 400, "model"),
    ("model-empty", "POST", "/v1/completions", good(model=""), {}, 400, "model"),
    ("unknown-model", "POST", "/v1/completions", good(model="gpt-9"), {}, 404, "model"),
    ("prompt-not-text", "POST", "/v1/completions", good(prompt=12), {}, 400, "prompt"),
    ("prompt-list-of-ints", "POST", "/v1/completions", good(prompt=[1, 2]), {}, 400, "prompt"),
    ("prompt-list-empty", "POST", "/v1/completions", good(prompt=[]), {}, 400, "prompt"),
    ("prompt-empty-string", "POST", "/v1/completions", good(prompt=""), {}, 400, "prompt"),
    ("prompt-unknown-char", "POST", "/v1/completions", good(prompt="1+x="), {}, 400, "prompt"),
    ("too-many-prompts", "POST", "/v1/completions", good(prompt=["1="] * 5), {}, 400, "prompt"),
    ("prompt-too-long", "POST", "/v1/completions", good(prompt="1" * 48), {}, 400, "prompt"),
    ("n-zero", "POST", "/v1/completions", good(n=0), {}, 400, "n"),
    ("n-over-limit", "POST", "/v1/completions", good(n=5), {}, 400, "n"),
    ("n-string", "POST", "/v1/completions", good(n="2"), {}, 400, "n"),
    ("n-float", "POST", "/v1/completions", good(n=2.0), {}, 400, "n"),
    ("max-tokens-zero", "POST", "/v1/completions", good(max_tokens=0), {}, 400, "max_tokens"),
    ("max-tokens-over", "POST", "/v1/completions", good(max_tokens=33), {}, 400, "max_tokens"),
    (
        "max-tokens-no-room",
        "POST",
        "/v1/completions",
        good(prompt="1" * 20, max_tokens=30),
        {},
        400,
        "max_tokens",
    ),
    ("temperature-negative", "POST", "/v1/completions", good(temperature=-1), {}, 400, "temperature"),
    ("temperature-text", "POST", "/v1/completions", good(temperature="hot"), {}, 400, "temperature"),
    (
        "temperature-nan",
        "POST",
        "/v1/completions",
        '{"model": "tiny", "prompt": "1+2=", "temperature": NaN}',
        {},
        400,
        "temperature",
    ),
    ("seed-negative", "POST", "/v1/completions", good(seed=-1), {}, 400, "seed"),
    ("seed-too-large", "POST", "/v1/completions", good(seed=2**63), {}, 400, "seed"),
    ("seed-bool", "POST", "/v1/completions", good(seed=True), {}, 400, "seed"),
    ("seed-overflows-rows", "POST", "/v1/completions", good(seed=2**63 - 1, n=2), {}, 400, "seed"),
    ("stop-too-many", "POST", "/v1/completions", good(stop=["1", "2", "3"]), {}, 400, "stop"),
    ("stop-empty-string", "POST", "/v1/completions", good(stop=[""]), {}, 400, "stop"),
    ("stop-not-text", "POST", "/v1/completions", good(stop=7), {}, 400, "stop"),
    ("stream-not-bool", "POST", "/v1/completions", good(stream="yes"), {}, 400, "stream"),
    ("unknown-field", "POST", "/v1/completions", good(best_answer=True), {}, 400, "best_answer"),
    ("top-p-unsupported", "POST", "/v1/completions", good(top_p=0.5), {}, 400, "top_p"),
    ("penalty-unsupported", "POST", "/v1/completions", good(presence_penalty=1.0), {}, 400, "presence_penalty"),
    ("echo-unsupported", "POST", "/v1/completions", good(echo=True), {}, 400, "echo"),
    ("logprobs-unsupported", "POST", "/v1/completions", good(logprobs=5), {}, 400, "logprobs"),
    ("block-size-zero", "POST", "/v1/completions", good(block_size=0), {}, 400, "block_size"),
    (
        "steps-above-block",
        "POST",
        "/v1/completions",
        good(steps_per_block=5),
        {},
        400,
        "steps_per_block",
    ),
    (
        "threshold-with-fixed",
        "POST",
        "/v1/completions",
        good(threshold=0.5),
        {},
        400,
        "threshold",
    ),
    ("confidence-unknown", "POST", "/v1/completions", good(confidence="best"), {}, 400, "confidence"),
    ("schedule-unknown", "POST", "/v1/completions", good(schedule="cosine"), {}, 400, "schedule"),
    (
        "stream-options-unknown",
        "POST",
        "/v1/completions",
        good(stream_options={"fast": True}),
        {},
        400,
        "stream_options",
    ),
    ("chat-missing-messages", "POST", "/v1/chat/completions", chat(messages=...), {}, 400, "messages"),
    ("chat-empty-messages", "POST", "/v1/chat/completions", chat(messages=[]), {}, 400, "messages"),
    (
        "chat-bad-role",
        "POST",
        "/v1/chat/completions",
        chat(messages=[{"role": "robot", "content": "1"}]),
        {},
        400,
        "messages.0.role",
    ),
    (
        "chat-content-not-text",
        "POST",
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": 5}]),
        {},
        400,
        "messages.0.content",
    ),
    (
        "chat-conversation-without-template",
        "POST",
        "/v1/chat/completions",
        chat(messages=[{"role": "system", "content": "1"}, {"role": "user", "content": "2"}]),
        {},
        400,
        "messages",
    ),
    (
        "chat-max-completion-over",
        "POST",
        "/v1/chat/completions",
        chat(max_completion_tokens=99),
        {},
        400,
        "max_completion_tokens",
    ),
    ("oversized-body", "POST", "/v1/completions", good(prompt="1" * 5000), {}, 413, "body"),
    ("bad-api-key", "POST", "/v1/completions", GOOD, {"Authorization": "Bearer nope-nope"}, 401, "Authorization"),
    ("not-bearer", "GET", "/v1/models", None, {"Authorization": f"Basic {KEY}"}, 401, "Authorization"),
    ("wrong-method", "GET", "/v1/completions", None, {}, 405, None),
    ("unknown-route", "POST", "/v1/engines/tiny/completions", GOOD, {}, 404, None),
    (
        "update-outside-dirs",
        "POST",
        "/update_weights",
        {"model": "tiny", "directory": "/etc"},
        {},
        403,
        "directory",
    ),
    ("update-missing-directory", "POST", "/update_weights", {"model": "tiny"}, {}, 400, "directory"),
    (
        "update-unknown-model",
        "POST",
        "/update_weights",
        {"model": "nope", "directory": "/tmp"},
        {},
        404,
        "model",
    ),
    ("update-content-type", "POST", "/update_weights", "x", {"Content-Type": "text/plain"}, 415, "Content-Type"),
    ("update-not-safetensors", "POST", "/update_weights?model=tiny", b"\x00" * 64, OCTET, 400, "body"),
    ("update-no-model-query", "POST", "/update_weights", tensors(x=torch.zeros(1)), OCTET, 400, "model"),
    (
        "update-unknown-tensor",
        "POST",
        "/update_weights?model=tiny",
        tensors(nope=torch.zeros(1)),
        OCTET,
        400,
        "tensors",
    ),
    (
        "update-wrong-shape",
        "POST",
        "/update_weights?model=tiny",
        tensors(**{"head.weight": torch.zeros(3, 3)}),
        OCTET,
        400,
        "tensors",
    ),
    (
        "update-version-not-above",
        "POST",
        "/update_weights?model=tiny&version=0",
        tensors(**{"head.weight": torch.zeros(16, 32)}),
        OCTET,
        409,
        "version",
    ),
    (
        "update-version-not-int",
        "POST",
        "/update_weights?model=tiny&version=1.5",
        tensors(x=torch.zeros(1)),
        OCTET,
        400,
        "version",
    ),
]  # fmt: skip


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_bad")
    write_token_model(root / "tiny")
    (root / "allowed").mkdir()
    server = LiveServer(
        {"tiny": root / "tiny"},
        api_key=KEY,
        max_n=4,
        max_prompts=4,
        max_tokens=32,
        max_stop=2,
        max_body_bytes=4096,
        update_weights_dirs=(str(root / "allowed"),),
        allow_tensor_updates=True,
        max_wait_ms=0.0,
    )
    yield server
    server.stop()


def test_there_are_at_least_thirty_distinct_kinds():
    assert len(CASES) >= 30
    assert len({case[0] for case in CASES}) == len(CASES)
    assert len({json.dumps(case[3], default=repr) + case[2] for case in CASES}) >= 30


@pytest.mark.parametrize(
    ("method", "path", "body", "headers", "status", "param"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_a_bad_request_gets_a_4xx_naming_the_field(
    live, method, path, body, headers, status, param
):
    sent = {**AUTH, **headers}
    if isinstance(body, str) and "Content-Type" not in sent:
        sent["Content-Type"] = "application/json"
    code, head, raw = live.request(method, path, body, sent)
    assert code == status, raw
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert error["type"] == {
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        409: "conflict_error",
    }.get(status, "invalid_request_error")
    if param is not None:
        assert param.split(".")[0] in error["message"], error["message"]
    else:
        assert path in error["message"]
    if status == 401:
        assert head["www-authenticate"] == "Bearer"


def test_the_server_keeps_serving_with_its_weights_unchanged(live):
    checksum = live.engine.get("tiny").checksum
    status, head, body = live.json("POST", "/v1/completions", GOOD, AUTH)
    assert status == 200 and body["weights_version"] == 0 and head["x-weights-version"] == "0"
    assert body["weights_checksum"] == checksum
    assert live.json("GET", "/health")[2]["status"] == "ok"
    assert live.engine.get("tiny").version == 0
