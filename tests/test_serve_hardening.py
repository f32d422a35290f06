"""The server never answers 500 to input: deep JSON, huge numbers, bad encodings and wrong
content types are 4xx naming the body or field; a damaged or escaping model directory in an
update is a 4xx naming the file (the server stays on its weights); an exception no route
handles is a generic 500, counted in /metrics, its detail in the log only."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import safetensors.torch
import torch

pytest.importorskip("fastapi")

from serve_live import LiveServer, write_token_model  # noqa: E402

from diffusion_rl.serving import text as text_routes  # noqa: E402

KEY = "hardening-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {**AUTH, "Content-Type": "application/json"}
GOOD = {"model": "tiny", "prompt": "12+34=", "seed": 1}
DEEP = "[" * 1000 + "]" * 1000
HUGE = "9" * 5000
JSON_ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/images/generations",
    "/v1/videos",
    "/rollout/generate",
    "/update_weights",
)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_hardening")
    write_token_model(root / "tiny", seed=0)
    allowed = root / "allowed"
    write_token_model(allowed / "new", seed=1)
    write_token_model(root / "outside", seed=2)
    return root


@pytest.fixture(scope="module")
def live(root):
    server = LiveServer(
        {"tiny": root / "tiny"},
        api_key=KEY,
        update_weights_dirs=(str(root / "allowed"),),
        allow_tensor_updates=True,
        max_wait_ms=0.0,
    )
    yield server
    server.stop()


def _prometheus(text: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def _metrics(live) -> dict[str, float]:
    return _prometheus(live.request("GET", "/metrics", headers=AUTH)[2].decode())


def _error(raw: bytes) -> dict:
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "\n" not in error["message"]
    return error


def _server_errors(metrics: dict[str, float]) -> float:
    return sum(v for k, v in metrics.items() if "requests_total" in k and 'status="5' in k)


def _damaged_copy(source, target, damage, *, manifest=True):
    shutil.copytree(source, target)
    damage(target / "model.safetensors")
    if not manifest:
        (target / "manifest.json").unlink()
    return target


def _flip_header_byte(path):
    data = bytearray(path.read_bytes())
    data[20] ^= 0x40  # inside the JSON header: a tensor name changes
    path.write_bytes(bytes(data))


def _flip_data_byte(path):
    data = bytearray(path.read_bytes())
    data[-10] ^= 1
    path.write_bytes(bytes(data))


# ----------------------------------------------------------------------------- reproductions
@pytest.mark.parametrize("route", JSON_ROUTES)
def test_json_nested_1000_deep_is_400_naming_the_body_on_every_json_route(live, route):
    body = '{"model": "tiny", "prompt": ' + DEEP + "}"
    status, _, raw = live.request("POST", route, body, JSON)
    assert status == 400, raw
    error = _error(raw)
    assert error["param"] == "body" and "nested more than 32 levels" in error["message"]


def test_a_5000_digit_integer_is_400_naming_the_field(live):
    body = '{"model": "tiny", "prompt": "1+2=", "seed": ' + HUGE + "}"
    status, _, raw = live.request("POST", "/v1/completions", body, JSON)
    assert status == 400
    error = _error(raw)
    assert error["param"] == "seed" and "a number of 5000 characters" in error["message"]
    body = '{"model": "tiny", "directory": "x", "version": ' + HUGE + "}"
    status, _, raw = live.request("POST", "/update_weights", body, JSON)
    assert status == 400 and _error(raw)["param"] == "version"
    body = '{"model": "tiny", "prompt_ids": [[1, 2, ' + HUGE + "]], " + '"seeds": [0]}'
    status, _, raw = live.request("POST", "/rollout/generate", body, JSON)
    assert status == 400 and _error(raw)["param"] == "prompt_ids.0.2"


@pytest.mark.parametrize("manifest", [True, False], ids=["with-manifest", "downloaded"])
def test_an_update_from_a_flipped_header_byte_is_400_naming_the_file(live, root, manifest):
    name = f"flipped-header-{manifest}"
    damaged = _damaged_copy(
        root / "allowed" / "new", root / "allowed" / name, _flip_header_byte, manifest=manifest
    )
    checksum = live.engine.get("tiny").checksum
    status, _, raw = live.request(
        "POST", "/update_weights", {"model": "tiny", "directory": str(damaged)}, AUTH
    )
    assert status == 400, raw
    error = _error(raw)
    assert error["param"] == "directory"
    assert f"{damaged / 'model.safetensors'}:" in error["message"]
    if manifest:
        assert error["code"] == "manifest_mismatch" and "sha256 mismatch" in error["message"]
    else:  # the header parses, but names a tensor the model does not have
        assert error["code"] == "invalid_model_files"
        assert "its weights do not fit the model" in error["message"]
    assert live.engine.get("tiny").version == 0 and live.engine.get("tiny").checksum == checksum


@pytest.mark.parametrize(
    ("damage", "manifest", "code", "words"),
    [
        (_flip_data_byte, True, "manifest_mismatch", "sha256 mismatch"),
        (lambda p: p.write_bytes(p.read_bytes()[:1000]), False, "invalid_model_files", "truncated"),
        (lambda p: p.write_bytes(b""), False, "invalid_model_files", "empty file"),
        (lambda p: p.write_bytes(b"\x80\x04K\x01."), False, "invalid_model_files", "pickle"),
    ],
    ids=["flipped-data-byte", "truncated", "empty", "pickle"],
)
def test_an_update_from_a_damaged_weights_file_is_400_naming_it(
    live, root, damage, manifest, code, words
):
    name = f"damaged-{code}-{words.replace(' ', '-')}"
    damaged = _damaged_copy(
        root / "allowed" / "new", root / "allowed" / name, damage, manifest=manifest
    )
    status, _, raw = live.request(
        "POST", "/update_weights", {"model": "tiny", "directory": str(damaged)}, AUTH
    )
    assert status == 400, raw
    error = _error(raw)
    assert error["code"] == code and words in error["message"]
    assert f"{damaged / 'model.safetensors'}:" in error["message"]
    assert live.engine.get("tiny").version == 0


def test_a_bad_json_or_config_file_in_an_update_is_400_naming_it(live, root):
    broken = root / "allowed" / "broken-info"
    shutil.copytree(root / "allowed" / "new", broken)
    (broken / "diffusion_rl.json").write_text('{"sampler": ')
    status, _, raw = live.request(
        "POST", "/update_weights", {"model": "tiny", "directory": str(broken)}, AUTH
    )
    assert status == 400 and f"{broken / 'diffusion_rl.json'}:1:" in _error(raw)["message"]
    config = root / "allowed" / "big-config"
    shutil.copytree(root / "allowed" / "new", config)
    data = json.loads((config / "config.json").read_text())
    (config / "config.json").write_text(json.dumps({**data, "d_model": 2**40}))
    status, _, raw = live.request(
        "POST", "/update_weights", {"model": "tiny", "directory": str(config)}, AUTH
    )
    assert status == 400 and f"{config / 'config.json'}: d_model" in _error(raw)["message"]
    assert live.engine.get("tiny").version == 0


def test_a_symlinked_file_escaping_the_allowed_directory_is_refused(live, root):
    linked = root / "allowed" / "linked-file"
    shutil.copytree(root / "allowed" / "new", linked)
    (linked / "model.safetensors").unlink()
    (linked / "model.safetensors").symlink_to(root / "outside" / "model.safetensors")
    linked_dir = root / "allowed" / "linked-dir"
    shutil.copytree(root / "allowed" / "new", linked_dir)
    (linked_dir / "extra").symlink_to(root / "outside", target_is_directory=True)
    for directory, entry in ((linked, "model.safetensors"), (linked_dir, "extra")):
        status, _, raw = live.request(
            "POST", "/update_weights", {"model": "tiny", "directory": str(directory)}, AUTH
        )
        assert status == 403, raw
        error = _error(raw)
        assert error["param"] == "directory" and error["code"] == "path_not_allowed"
        assert f"{directory / entry} resolves to {root / 'outside'}" in error["message"]
    assert live.engine.get("tiny").version == 0


def test_update_paths_that_cannot_be_resolved_are_400(live, root):
    loop = root / "allowed" / "loop"
    loop.mkdir()
    (loop / "a").symlink_to(loop / "b")
    (loop / "b").symlink_to(loop / "a")
    cases = [
        (str(root / "allowed" / "loop" / "a"), "cannot be resolved"),  # the directory itself
        (str(loop), "cannot be resolved"),  # an entry below it
        ("~no-such-user-here/model", "cannot be resolved"),
        ("x" * 300 + "/model", "outside the directories"),
    ]
    for directory, words in cases:
        status, _, raw = live.request(
            "POST", "/update_weights", {"model": "tiny", "directory": directory}, AUTH
        )
        assert 400 <= status < 500, (directory, raw)
        error = _error(raw)
        assert error["param"] == "directory" and words in error["message"], error
    assert live.engine.get("tiny").version == 0


def test_an_unverified_directory_updates_with_one_line(root, caplog):
    downloaded = root / "allowed" / "downloaded"
    shutil.copytree(root / "allowed" / "new", downloaded)
    (downloaded / "manifest.json").unlink()
    inside = root / "allowed" / "inside-link"
    shutil.copytree(root / "allowed" / "new", inside)
    (inside / "model.safetensors").unlink()  # a symlink that stays inside is fine
    (inside / "model.safetensors").symlink_to(root / "allowed" / "new" / "model.safetensors")
    (inside / "manifest.json").unlink()
    server = LiveServer(
        {"tiny": root / "tiny"}, update_weights_dirs=(str(root / "allowed"),), max_wait_ms=0.0
    )
    try:
        with caplog.at_level(logging.WARNING, logger="diffusion_rl.models"):
            caplog.clear()
            status, _, body = server.json(
                "POST", "/update_weights", {"model": "tiny", "directory": str(downloaded)}
            )
            assert status == 200 and body["weights_version"] == 1
            lines = [r.getMessage() for r in caplog.records if r.name == "diffusion_rl.models"]
            assert lines == [
                f"model directory {downloaded}: unverified: it has no manifest.json (a "
                "downloaded checkpoint?), so only its safetensors headers were checked, not "
                "its tensor data"
            ]
            caplog.clear()
            status, _, body = server.json(
                "POST", "/update_weights", {"model": "tiny", "directory": str(root / "allowed/new")}
            )
            assert status == 200 and body["weights_version"] == 2
            assert not [r for r in caplog.records if r.name == "diffusion_rl.models"]
            status, _, body = server.json(
                "POST", "/update_weights", {"model": "tiny", "directory": str(inside)}
            )
            assert status == 200 and body["weights_version"] == 3
    finally:
        server.stop()


def test_non_finite_tensors_in_an_update_body_are_refused(live):
    weights = torch.zeros(16, 32)
    weights[3, 4] = float("nan")
    data = safetensors.torch.save({"head.weight": weights})
    headers = {**AUTH, "Content-Type": "application/octet-stream"}
    status, _, raw = live.request("POST", "/update_weights?model=tiny", data, headers)
    assert status == 400
    error = _error(raw)
    assert (
        error["param"] == "tensors"
        and "'head.weight' holds non-finite values (1 NaN" in (error["message"])
    )
    assert live.engine.get("tiny").version == 0


def test_json_routes_refuse_other_content_types_with_415(live):
    body = json.dumps(GOOD)
    for content_type in (
        "text/plain",
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/json; charset=latin-1",
        None,
    ):
        headers = dict(AUTH) if content_type is None else {**AUTH, "Content-Type": content_type}
        status, _, raw = live.request("POST", "/v1/completions", body, headers)
        assert status == 415, (content_type, raw)
        error = _error(raw)
        assert error["param"] == "Content-Type" and "application/json" in error["message"]
    headers = {**AUTH, "Content-Type": "application/json; charset=UTF-8"}
    assert live.request("POST", "/v1/completions", body, headers)[0] == 200


# ----------------------------------------------------------------------------- 500s
def test_an_unhandled_exception_is_a_generic_500_counted_in_metrics(live, monkeypatch, caplog):
    before = _metrics(live)
    served = live.engine.get("tiny")

    def crash(*args, **kwargs):  # a fault inside the model's worker
        raise RuntimeError("secret detail /srv/weights/internal")

    monkeypatch.setattr(served.model, "forward", crash)
    with caplog.at_level(logging.ERROR, logger="diffusion_rl.serving"):
        status, head, raw = live.request("POST", "/v1/completions", GOOD, AUTH)
    assert status == 500
    error = _error(raw)
    assert error["type"] == "server_error" and error["code"] == "internal_error"
    assert "secret" not in raw.decode() and "RuntimeError" not in raw.decode()
    ident = error["message"].split("(request ")[1].split(")")[0]
    logged = [r for r in caplog.records if r.name == "diffusion_rl.serving"]
    assert len(logged) == 1 and ident in logged[0].getMessage()
    assert "secret detail /srv/weights/internal" in logged[0].getMessage()
    assert logged[0].exc_info is not None  # the traceback goes to the log
    monkeypatch.undo()

    def broken_prepare(*args, **kwargs):  # a fault in the route itself, outside the engine
        raise KeyError("internal-key")

    monkeypatch.setattr(text_routes, "_prepare", broken_prepare)
    status, _, raw = live.request("POST", "/v1/completions", GOOD, AUTH)
    assert status == 500 and "internal-key" not in raw.decode()
    monkeypatch.undo()
    after = _metrics(live)
    key = 'diffusion_rl_requests_total{route="/v1/completions",status="500"}'
    assert after[key] - before.get(key, 0) == 2
    assert live.request("POST", "/v1/completions", GOOD, AUTH)[0] == 200  # still serving


# ----------------------------------------------------------------------------- adversarial
ADVERSARIAL = [
    # (id, path, body bytes or str, content type, status, param)
    ("deep-array", "/v1/completions", '{"model": "tiny", "prompt": ' + DEEP + "}", None, 400, "body"),
    ("deep-object", "/v1/completions", '{"a": ' * 800 + "1" + "}" * 800, None, 400, "body"),
    ("deep-33", "/v1/completions", '{"model": "tiny", "prompt": ' + "[" * 33 + "]" * 33 + "}", None, 400, "body"),
    ("deep-100000", "/v1/chat/completions", "[" * 100_000, None, 400, "body"),
    ("deep-update", "/update_weights", '{"model": ' + DEEP + "}", None, 400, "body"),
    ("huge-int-seed", "/v1/completions", '{"model": "tiny", "prompt": "1=", "seed": ' + HUGE + "}", None, 400, "seed"),
    ("huge-int-n", "/v1/completions", '{"model": "tiny", "prompt": "1=", "n": -' + HUGE + "}", None, 400, "n"),
    ("huge-int-nested", "/v1/completions", '{"model": "tiny", "prompt": ["1=", ' + HUGE + "]}", None, 400, "prompt.1"),
    ("long-float", "/v1/completions", '{"model": "tiny", "prompt": "1=", "temperature": 0.' + "1" * 200 + "}", None, 400, "temperature"),
    ("float-overflow", "/v1/completions", '{"model": "tiny", "prompt": "1=", "temperature": 1e999}', None, 400, "temperature"),
    ("infinity", "/v1/completions", '{"model": "tiny", "prompt": "1=", "temperature": -Infinity}', None, 400, "temperature"),
    ("invalid-utf8", "/v1/completions", b'{"model": "tiny", "prompt": "\xff\xfe"}', None, 400, "body"),
    ("utf16-body", "/v1/completions", json.dumps(GOOD).encode("utf-16"), None, 400, "body"),
    ("utf8-bom", "/v1/completions", b"\xef\xbb\xbf" + json.dumps(GOOD).encode(), None, 400, "body"),
    ("lone-surrogate", "/v1/completions", '{"model": "tiny", "prompt": "\\ud800"}', None, 400, "prompt"),
    ("surrogate-model", "/v1/chat/completions", '{"model": "\\udfff", "messages": []}', None, 400, "model"),
    ("surrogate-key", "/v1/completions", '{"model": "tiny", "prompt": "1=", "\\ud800": 1}', None, 400, "body"),
    ("nul-in-model", "/v1/completions", '{"model": "\\u0000", "prompt": "1="}', None, 404, "model"),
    ("null-body", "/v1/completions", "null", None, 400, "body"),
    ("bare-number", "/rollout/generate", HUGE, None, 400, "body"),
    ("truncated", "/v1/images/generations", '{"model": "tiny", "prompt": "a', None, 400, "body"),
    ("text-plain", "/v1/completions", json.dumps(GOOD), "text/plain", 415, "Content-Type"),
    ("form", "/v1/chat/completions", "model=tiny", "application/x-www-form-urlencoded", 415, "Content-Type"),
    ("multipart", "/v1/videos", "--x--", "multipart/form-data; boundary=x", 415, "Content-Type"),
    ("json-patch", "/rollout/generate", json.dumps(GOOD), "application/json-patch+json", 415, "Content-Type"),
    ("latin1", "/v1/images/generations", json.dumps(GOOD), "application/json; charset=latin-1", 415, "Content-Type"),
    ("update-text", "/update_weights", '{"model": "tiny", "directory": "x"}', "text/plain", 415, "Content-Type"),
    ("update-latin1", "/update_weights", '{"model": "tiny", "directory": "x"}', "application/json; charset=iso-8859-1", 415, "Content-Type"),
    ("version-superscript", "/update_weights?model=tiny&version=%C2%B2", safetensors.torch.save({"head.weight": torch.zeros(16, 32)}), "application/octet-stream", 400, "version"),
    ("octet-garbage", "/update_weights?model=tiny", b"\xff" * 64, "application/octet-stream", 400, "body"),
]  # fmt: skip


def test_twenty_adversarial_bodies_are_4xx_and_the_server_keeps_answering(live):
    assert len(ADVERSARIAL) >= 20 and len({case[0] for case in ADVERSARIAL}) == len(ADVERSARIAL)
    status, _, before = live.json("POST", "/v1/completions", GOOD, AUTH)
    assert status == 200
    metrics = _metrics(live)
    for ident, path, body, content_type, expected, param in ADVERSARIAL:
        headers = {**AUTH, "Content-Type": content_type or "application/json"}
        status, _, raw = live.request("POST", path, body, headers)
        assert status == expected, (ident, raw)
        error = _error(raw)
        assert error["param"] == param, (ident, error)
        assert param.split(".")[0] in error["message"], (ident, error)
    status, _, after = live.json("POST", "/v1/completions", GOOD, AUTH)
    assert status == 200 and after["choices"] == before["choices"]
    assert after["weights_version"] == 0 and after["weights_checksum"] == before["weights_checksum"]
    assert live.json("GET", "/health")[2]["status"] == "ok"
    assert _server_errors(_metrics(live)) == _server_errors(metrics)  # no 5xx among them
