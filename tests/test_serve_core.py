"""The serving engine and app core: batching (merge, limits, retry alone), backpressure (503
with Retry-After), timeouts, cancellation, versioned weight updates that never change a
running batch, checksums, /health, /metrics, the API key, directory confinement of
/update_weights, settings and the ``serve`` command."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import socket
import threading
import time

import pytest
import safetensors.torch
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from serve_live import LiveServer, write_token_model  # noqa: E402

from diffusion_rl import cli  # noqa: E402
from diffusion_rl.cli.serve import split_spec  # noqa: E402
from diffusion_rl.serving.engine import (  # noqa: E402
    Engine,
    ServedModel,
    load_served_model,
    weights_checksum,
)
from diffusion_rl.serving.errors import RequestError  # noqa: E402
from diffusion_rl.serving.settings import ServeSettings  # noqa: E402


def _linear_served(name: str = "m") -> ServedModel:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    checksum = weights_checksum(model.state_dict())
    return ServedModel(name, "flow", model, None, {}, 0, checksum)


def _engine(**settings) -> Engine:
    return Engine([_linear_served("m"), _linear_served("other")], ServeSettings(**settings))


class Rows:
    def __init__(self, value, rows: int = 1) -> None:
        self.value, self.rows = value, rows


# ----------------------------------------------------------------------------- batching
def test_compatible_items_merge_and_incompatible_ones_never_do():
    batches: list[list] = []

    def fn(served, items):
        batches.append([item.value for item in items])
        return [(item.value, served.version) for item in items]

    async def main():
        engine = _engine(max_wait_ms=300.0, max_batch_rows=64)
        runs = [engine.run("m", "a", Rows(i), fn) for i in range(6)]
        runs += [engine.run("m", "b", Rows(10 + i), fn) for i in range(3)]
        results = await asyncio.gather(*runs)
        await engine.stop()
        return results

    results = asyncio.run(main())
    assert [r[0] for r in results] == [(i, 0) for i in range(6)] + [(10 + i, 0) for i in range(3)]
    assert sorted(batches) == [[0, 1, 2, 3, 4, 5], [10, 11, 12]]


def test_batches_hold_at_most_max_batch_rows_rows():
    sizes: list[int] = []

    def fn(served, items):
        sizes.append(sum(item.rows for item in items))
        return [item.value for item in items]

    async def main():
        engine = _engine(max_wait_ms=200.0, max_batch_rows=5)
        rows = [2, 2, 2, 1, 3, 9]  # the 9-row item runs alone
        results = await asyncio.gather(
            *[engine.run("m", "k", Rows(i, r), fn) for i, r in enumerate(rows)]
        )
        await engine.stop()
        return results

    assert [r[0] for r in asyncio.run(main())] == [0, 1, 2, 3, 4, 5]
    assert sizes == [4, 3, 3, 9]  # 2+2 | 2+1 (3 would make 6) | 3 | 9


def test_a_failing_merged_batch_is_retried_item_by_item():
    calls: list[list] = []

    def fn(served, items):
        calls.append([item.value for item in items])
        if any(item.value == "bad" for item in items):
            raise ValueError("bad item")
        return [item.value.upper() for item in items]

    async def main():
        engine = _engine(max_wait_ms=300.0)
        runs = [engine.run("m", "k", Rows(v), fn) for v in ("a", "bad", "c")]
        results = await asyncio.gather(*runs, return_exceptions=True)
        retries = engine.metrics.counter("batch_retries_total", model="m")
        await engine.stop()
        return results, retries

    results, retries = asyncio.run(main())
    assert results[0][0] == "A" and results[2][0] == "C"
    assert isinstance(results[1], ValueError) and str(results[1]) == "bad item"
    assert calls == [["a", "bad", "c"], ["a"], ["bad"], ["c"]]
    assert retries == 1


def test_a_full_queue_is_503_with_retry_after():
    started, release = threading.Event(), threading.Event()

    def blocking(served, items):
        started.set()
        release.wait(10)
        return [item.value for item in items]

    async def main():
        engine = _engine(max_queue=1, max_batch_rows=1, max_wait_ms=0.0)
        running = asyncio.ensure_future(engine.run("m", "k", Rows(0), blocking))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 10)
        queued = asyncio.ensure_future(engine.run("m", "k", Rows(1), blocking))
        await asyncio.sleep(0.05)
        depth = engine.queue_depth
        with pytest.raises(RequestError) as full:
            await engine.run("other", "k", Rows(2), blocking)  # the bound is over all models
        release.set()
        results = await asyncio.gather(running, queued)
        rejected = engine.metrics.counter("rejected_total", model="other")
        await engine.stop()
        return depth, full.value, [r[0] for r in results], rejected

    depth, full, results, rejected = asyncio.run(main())
    assert depth == 1 and results == [0, 1] and rejected == 1
    assert full.status == 503 and full.headers == {"Retry-After": "1"}
    assert full.body()["error"]["type"] == "server_overloaded"
    assert full.body()["error"]["code"] == "queue_full"


def test_a_timed_out_or_cancelled_waiting_item_is_never_run():
    release, seen = threading.Event(), []

    def fn(served, items):
        seen.extend(item.value for item in items)
        release.wait(10)
        return [item.value for item in items]

    async def main():
        engine = _engine(max_batch_rows=1, max_wait_ms=0.0, request_timeout_s=0.2)
        first = asyncio.ensure_future(engine.run("m", "k", Rows("first"), fn))
        await asyncio.sleep(0.05)
        cancelled = asyncio.ensure_future(engine.run("m", "k", Rows("cancelled"), fn))
        timed_out = asyncio.ensure_future(engine.run("m", "k", Rows("timed out"), fn))
        await asyncio.sleep(0.05)
        cancelled.cancel()
        outcome = await asyncio.gather(timed_out, return_exceptions=True)
        depth = engine.queue_depth
        release.set()
        await asyncio.gather(first, return_exceptions=True)
        await asyncio.sleep(0.05)
        counts = (
            engine.metrics.counter("cancelled_total", model="m"),
            engine.metrics.counter("timeouts_total", model="m"),
        )
        await engine.stop()
        return outcome[0], depth, counts

    error, depth, counts = asyncio.run(main())
    assert isinstance(error, RequestError) and error.status == 504
    assert depth == 0 and seen == ["first"] and counts == (1, 2)


# ----------------------------------------------------------------------------- weight updates
def test_an_update_waits_for_the_running_batch_and_the_next_batch_sees_it():
    inside, release = threading.Event(), threading.Event()

    def fn(served, items):
        before = served.model.weight.detach().clone()
        inside.set()
        release.wait(10)
        after = served.model.weight.detach().clone()
        return [(before, after, served.version)] * len(items)

    async def main():
        engine = _engine(max_wait_ms=0.0)
        old = engine.get("m").model.weight.detach().clone()
        running = asyncio.ensure_future(engine.run("m", "k", Rows(0), fn))
        await asyncio.get_running_loop().run_in_executor(None, inside.wait, 10)
        new_weight = torch.full((2, 3), 0.5)
        update = asyncio.ensure_future(
            engine.update_weights("m", state_dict={"weight": new_weight})
        )
        await asyncio.sleep(0.1)
        assert not update.done()  # it waits for the running batch
        release.set()
        (before, after, version), served = await running
        updated = await update
        (before2, after2, version2), served2 = await engine.run("m", "k", Rows(1), fn)
        await engine.stop()
        return old, before, after, version, served, updated, before2, version2, served2

    old, before, after, version, served, updated, before2, version2, served2 = asyncio.run(main())
    assert torch.equal(before, old) and torch.equal(after, old)  # the batch saw one version
    assert version == 0 and served.version == 0
    assert updated.version == 1 and served2.version == 1 and version2 == 1
    assert torch.equal(before2, torch.full((2, 3), 0.5))
    reference = torch.nn.Linear(3, 2)
    reference.load_state_dict({"weight": torch.full((2, 3), 0.5), "bias": served2.model.bias})
    assert updated.checksum == weights_checksum(reference.state_dict()) != served.checksum


def test_updates_refuse_bad_tensors_without_changing_anything():
    async def main():
        engine = _engine()
        before = {k: v.clone() for k, v in engine.get("m").model.state_dict().items()}
        errors = []
        for tensors in (
            {"weight": torch.zeros(2, 3), "nope": torch.zeros(1)},  # unknown name
            {"weight": torch.zeros(3, 2)},  # shape
            {"weight": torch.zeros(2, 3, dtype=torch.float64)},  # dtype
        ):
            try:
                await engine.update_weights("m", state_dict=tensors)
            except RequestError as error:
                errors.append((error.status, error.param, error.message))
        with pytest.raises(RequestError) as conflict:
            await engine.update_weights("m", state_dict={"bias": torch.zeros(2)}, version=0)
        served = engine.get("m")
        after = served.model.state_dict()
        await engine.stop()
        return before, after, errors, served, conflict.value

    before, after, errors, served, conflict = asyncio.run(main())
    assert [e[:2] for e in errors] == [(400, "tensors")] * 3
    assert "'nope'" in errors[0][2] and "(3, 2)" in errors[1][2] and "float64" in errors[2][2]
    assert all(torch.equal(before[k], after[k]) for k in before) and served.version == 0
    assert conflict.status == 409 and conflict.param == "version"


def test_an_update_of_one_name_of_tied_weights_rehashes_every_name_sharing_it():
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(4, 3)
            self.head = torch.nn.Linear(3, 4, bias=False)
            self.head.weight = self.emb.weight  # one storage, two state-dict names

    torch.manual_seed(0)
    model = Tied()
    served = ServedModel("t", "flow", model, None, {}, 0, weights_checksum(model.state_dict()))

    async def main():
        engine = Engine([served], ServeSettings())
        updated = await engine.update_weights("t", state_dict={"emb.weight": torch.ones(4, 3)})
        await engine.stop()
        return updated

    updated = asyncio.run(main())
    assert torch.equal(model.head.weight, torch.ones(4, 3))
    assert updated.checksum == weights_checksum(model.state_dict()) != served.checksum


def test_the_checksum_is_sha256_of_names_dtypes_shapes_and_bytes(tmp_path):
    state = {"b": torch.tensor([1.0, 2.0]), "a": torch.arange(6, dtype=torch.int64).view(2, 3)}
    total = hashlib.sha256()
    for name in sorted(state):  # written out independently of the engine's helpers
        tensor = state[name]
        part = hashlib.sha256(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        part.update(tensor.numpy().tobytes())
        total.update(part.digest())
    assert weights_checksum(state) == total.hexdigest()[:16]
    changed = dict(state, b=torch.tensor([1.0, 2.0000002]))
    assert weights_checksum(changed) != weights_checksum(state)
    # the same weights read back from a directory have the same checksum
    write_token_model(tmp_path / "m", seed=4)
    first, second = (load_served_model("x", tmp_path / "m") for _ in range(2))
    assert first.checksum == second.checksum == weights_checksum(first.model.state_dict())


# ----------------------------------------------------------------------------- live server
@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_core")
    allowed = root / "allowed"
    write_token_model(root / "tiny", seed=0)
    write_token_model(allowed / "new", seed=1)
    write_token_model(root / "outside", seed=2)
    (allowed / "link").symlink_to(root / "outside")
    return root


@pytest.fixture(scope="module")
def live(dirs):
    server = LiveServer(
        {"tiny": dirs / "tiny"},
        api_key="secret-key-1",
        update_weights_dirs=(str(dirs / "allowed"),),
        max_wait_ms=0.0,
    )
    yield server
    server.stop()


AUTH = {"Authorization": "Bearer secret-key-1"}
PROMPT = {"model": "tiny", "prompt": "12+34=", "seed": 5, "max_tokens": 8}


def test_health_needs_no_key_and_the_rest_does(live):
    status, _, body = live.json("GET", "/health")
    assert status == 200 and body["status"] == "ok" and body["models"]["tiny"]["kind"] == "token"
    for headers, what in (({}, "missing"), ({"Authorization": "Bearer wrong-key-1"}, "wrong")):
        status, head, body = live.json("GET", "/v1/models", headers=headers)
        assert status == 401 and head["www-authenticate"] == "Bearer"
        assert body["error"]["param"] == "Authorization" and what in body["error"]["message"]
    status, _, body = live.json("GET", "/v1/models", headers=AUTH)
    assert status == 200 and [m["id"] for m in body["data"]] == ["tiny"]


def _prometheus(text: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def test_metrics_count_tokens_batches_and_latency(live):
    before = _prometheus(live.request("GET", "/metrics", headers=AUTH)[2].decode())
    used = 0
    for seed in range(3):
        status, _, body = live.json("POST", "/v1/completions", dict(PROMPT, seed=seed), AUTH)
        assert status == 200
        used += body["usage"]["completion_tokens"]
    status, head, data = live.request("GET", "/metrics", headers=AUTH)
    assert status == 200 and head["content-type"].startswith("text/plain; version=0.0.4")
    after = _prometheus(data.decode())
    tokens = 'diffusion_rl_generated_tokens_total{model="tiny"}'
    assert after[tokens] - before.get(tokens, 0) == used
    batches = 'diffusion_rl_batches_total{model="tiny"}'
    assert after[batches] - before.get(batches, 0) == 3
    latency = 'diffusion_rl_request_latency_seconds_count{route="/v1/completions"}'
    assert after[latency] - before.get(latency, 0) == 3
    assert after['diffusion_rl_batch_rows_bucket{model="tiny",le="1"}'] >= 3
    assert after["diffusion_rl_queue_depth"] == 0
    assert after['diffusion_rl_weights_version{model="tiny"}'] >= 0
    assert "# TYPE diffusion_rl_request_latency_seconds histogram" in data.decode()


def test_update_weights_reads_only_below_the_allowed_directories(live, dirs):
    refused = [
        str(dirs / "outside"),  # a sibling
        str(dirs / "allowed" / ".." / "outside"),  # traversal
        str(dirs / "allowed" / "link"),  # a symlink inside pointing outside
        "/etc",
    ]
    for path in refused:
        status, _, body = live.json(
            "POST", "/update_weights", {"model": "tiny", "directory": path}, AUTH
        )
        assert status == 403 and body["error"]["param"] == "directory", path
        assert body["error"]["code"] == "path_not_allowed"
    status, _, body = live.json("GET", "/health")
    assert body["models"]["tiny"]["weights_version"] == 0  # nothing changed
    # tensors are off on this server
    data = safetensors.torch.save({"x": torch.zeros(1)})
    headers = {**AUTH, "Content-Type": "application/octet-stream"}
    status, _, raw = live.request("POST", "/update_weights?model=tiny", data, headers)
    assert status == 403 and json.loads(raw)["error"]["code"] == "updates_disabled"


def test_update_from_an_allowed_directory_serves_its_weights(dirs):
    fresh = LiveServer({"tiny": dirs / "allowed" / "new"}, max_wait_ms=0.0)
    try:
        expected = fresh.json("POST", "/v1/completions", PROMPT)[2]
    finally:
        fresh.stop()
    server = LiveServer(
        {"tiny": dirs / "tiny"}, update_weights_dirs=(str(dirs / "allowed"),), max_wait_ms=0.0
    )
    try:
        before = server.json("POST", "/v1/completions", PROMPT)[2]
        status, head, body = server.json(
            "POST", "/update_weights", {"model": "tiny", "directory": str(dirs / "allowed/new")}
        )
        assert status == 200 and body["weights_version"] == 1 and body["previous_version"] == 0
        assert head["x-weights-version"] == "1"
        assert body["weights_checksum"] == expected["weights_checksum"]
        after = server.json("POST", "/v1/completions", PROMPT)[2]
    finally:
        server.stop()
    assert before["weights_version"] == 0 and after["weights_version"] == 1
    assert after["choices"][0]["token_ids"] == expected["choices"][0]["token_ids"]
    assert after["choices"][0]["token_ids"] != before["choices"][0]["token_ids"]
    # directories off: 403 naming the field
    server = LiveServer({"tiny": dirs / "tiny"})
    try:
        status, _, body = server.json(
            "POST", "/update_weights", {"model": "tiny", "directory": str(dirs / "allowed/new")}
        )
    finally:
        server.stop()
    assert status == 403 and body["error"]["param"] == "directory"
    assert "--update-weights-dir" in body["error"]["message"]


def test_update_from_a_training_checkpoint_is_verified_and_serves_its_weights(dirs):
    from diffusion_rl.contracts import LossOutput, WeightedMetric
    from diffusion_rl.models import load_model
    from diffusion_rl.train import OptimConfig, Trainer
    from diffusion_rl.train.checkpoint import CheckpointManager

    def no_loss(model, batch, generator):
        return LossOutput(WeightedMetric(torch.zeros(()), torch.ones(())))

    trainer = Trainer(load_model(dirs / "allowed" / "new").model, no_loss, OptimConfig())
    step = trainer.save_checkpoint(CheckpointManager(dirs / "allowed" / "ckpt"), {"run": "x"})
    fresh = LiveServer({"tiny": dirs / "allowed" / "new"}, max_wait_ms=0.0)
    try:
        expected = fresh.json("POST", "/v1/completions", PROMPT)[2]
    finally:
        fresh.stop()
    server = LiveServer(
        {"tiny": dirs / "tiny"}, update_weights_dirs=(str(dirs / "allowed"),), max_wait_ms=0.0
    )
    try:
        status, _, body = server.json(
            "POST", "/update_weights", {"model": "tiny", "directory": str(step)}
        )
        assert status == 200 and body["weights_version"] == 1
        assert body["weights_checksum"] == expected["weights_checksum"]
        after = server.json("POST", "/v1/completions", PROMPT)[2]
        assert after["choices"][0]["token_ids"] == expected["choices"][0]["token_ids"]
        weights = step / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-1] ^= 1  # one flipped bit: the manifest's SHA-256 no longer matches
        weights.write_bytes(bytes(data))
        status, _, body = server.json(
            "POST", "/update_weights", {"model": "tiny", "directory": str(step)}
        )
        assert status == 400 and body["error"]["param"] == "directory"
        assert "model.safetensors" in body["error"]["message"]
        assert server.json("POST", "/v1/completions", PROMPT)[2]["weights_version"] == 1
    finally:
        server.stop()


def test_a_full_queue_answers_503_over_http_and_the_queued_request_is_served(dirs):
    server = LiveServer({"tiny": dirs / "tiny"}, max_queue=1, max_batch_rows=1, max_wait_ms=0.0)
    started, release = threading.Event(), threading.Event()

    def blocking(served, items):
        started.set()
        release.wait(10)
        return [None] * len(items)

    try:
        blocker = asyncio.run_coroutine_threadsafe(
            server.engine.run("tiny", "block", Rows(0), blocking), server.engine.loop
        )
        assert started.wait(5)
        deadline = time.monotonic() + 5
        results = {}
        waiting = threading.Thread(
            target=lambda: results.update(queued=server.json("POST", "/v1/completions", PROMPT))
        )
        waiting.start()
        while server.engine.queue_depth < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        status, head, body = server.json("POST", "/v1/completions", PROMPT)
        release.set()
        waiting.join(10)
        blocker.result(10)
        after = server.json("POST", "/v1/completions", PROMPT)
    finally:
        release.set()
        server.stop()
    assert status == 503 and head["retry-after"] == "1"
    assert body["error"]["code"] == "queue_full" and "queue is full" in body["error"]["message"]
    assert results["queued"][0] == 200 and after[0] == 200
    assert results["queued"][2]["choices"] == after[2]["choices"]


def test_a_client_that_disconnects_while_queued_is_dropped(dirs):
    server = LiveServer({"tiny": dirs / "tiny"}, max_batch_rows=1, max_wait_ms=0.0)
    started, release, seen = threading.Event(), threading.Event(), []

    def blocking(served, items):
        started.set()
        release.wait(10)
        return [None] * len(items)

    try:
        blocker = asyncio.run_coroutine_threadsafe(
            server.engine.run("tiny", "block", Rows(0), blocking), server.engine.loop
        )
        assert started.wait(5)
        body = json.dumps(PROMPT).encode()
        raw = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        raw.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        deadline = time.monotonic() + 5
        while server.engine.queue_depth < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        raw.close()
        while server.engine.metrics.counter("cancelled_total", model="tiny") < 1:
            assert time.monotonic() < deadline, "the dropped request stayed queued"
            time.sleep(0.01)
        release.set()
        blocker.result(10)
        seen.append(server.engine.metrics.counter("batches_total", model="tiny"))
        status = server.json("POST", "/v1/completions", PROMPT)[0]
    finally:
        release.set()
        server.stop()
    assert seen == [1] and status == 200  # only the blocker ran; the server still serves


# ----------------------------------------------------------------------------- settings, CLI
def test_settings_bind_to_loopback_unless_remote_is_allowed():
    assert ServeSettings().host == "127.0.0.1"
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        assert ServeSettings(host=host).host == host
    with pytest.raises(ValueError, match="host: '0.0.0.0' is not a loopback address"):
        ServeSettings(host="0.0.0.0")
    assert ServeSettings(host="0.0.0.0", allow_remote=True).allow_remote
    with pytest.raises(ValueError, match="update_weights_dirs"):
        ServeSettings(update_weights_dirs=())
    with pytest.raises(ValueError, match="max_queue"):
        ServeSettings(max_queue=0)


def test_split_spec_names_models_by_base_name_or_name():
    assert split_spec("runs/a/model", "--model", "model") == ("model", "runs/a/model")
    assert split_spec("tiny=runs/a/model", "--model", "x") == ("tiny", "runs/a/model")
    assert split_spec("/x/a=b/model", "--model", "model") == ("model", "/x/a=b/model")


def _serve_error(capsys, argv) -> str:
    assert cli.main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    return err[0]


def test_serve_refuses_bad_flags_in_one_line(capsys, dirs, monkeypatch):
    monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)
    tiny = str(dirs / "tiny")
    cases = [
        ([], "--model: give at least one --model DIR"),
        (["--model", tiny, "--host", "0.0.0.0"], "--host: '0.0.0.0' is not a loopback"),
        (["--model", tiny, "--api-key-env", "NO_SUCH_KEY_VAR"], "--api-key-env: the environment"),
        (["--model", tiny, "--model", tiny], "--model: the served name 'tiny' is given twice"),
        (["--model", str(dirs / "missing")], "--model: model directory"),
        (["--model", tiny, "--port", "70000"], "--port"),
    ]
    for argv, message in cases:
        assert message in _serve_error(capsys, argv), argv


def test_serve_loads_every_model_and_runs_uvicorn_with_the_settings(capsys, dirs, monkeypatch):
    import uvicorn

    captured = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: captured.update(app=app, **kw))
    monkeypatch.setenv("TEST_SERVE_KEY", "a-long-key")
    argv = ["serve", "--model", str(dirs / "tiny"), "--model", f"second={dirs / 'outside'}"]
    argv += ["--port", "0", "--api-key-env", "TEST_SERVE_KEY", "--host", "0.0.0.0"]
    assert cli.main([*argv, "--allow-remote", "--max-queue", "7"]) == 0
    err = capsys.readouterr().err
    assert "warning: --allow-remote: serving on 0.0.0.0" in err and "WITHOUT" not in err
    engine, settings = captured["app"].state.engine, captured["app"].state.settings
    assert engine.names() == ["tiny", "second"]
    assert settings.api_key == "a-long-key" and settings.max_queue == 7
    assert captured["host"] == "0.0.0.0" and captured["port"] == 0
    expected = load_served_model("x", dirs / "outside").checksum
    assert engine.get("second").checksum == expected


def test_tensor_updates_from_a_body_change_the_served_weights(dirs):
    server = LiveServer({"tiny": dirs / "tiny"}, allow_tensor_updates=True, max_wait_ms=0.0)
    new = load_served_model("n", dirs / "allowed" / "new")
    try:
        buffer = io.BytesIO(safetensors.torch.save(dict(new.model.state_dict())))
        headers = {"Content-Type": "application/octet-stream"}
        status, head, raw = server.request(
            "POST", "/update_weights?model=tiny&version=5", buffer.getvalue(), headers
        )
        body = json.loads(raw)
        health = server.json("GET", "/health")[2]
    finally:
        server.stop()
    assert status == 200 and body["weights_version"] == 5 and head["x-weights-version"] == "5"
    assert body["weights_checksum"] == new.checksum == health["models"]["tiny"]["weights_checksum"]
    assert body["updated_tensors"] == len(new.model.state_dict())


def test_the_package_and_the_shared_generation_need_no_web_stack():
    """``diffusion_rl.serving`` and ``.generation`` (which the CLI may share) import neither
    FastAPI nor uvicorn (read from the source; every import statement)."""
    import ast
    from pathlib import Path

    import diffusion_rl.serving as package

    root = Path(package.__file__).parent
    for name in ("__init__.py", "generation.py", "errors.py", "settings.py"):
        tree = ast.parse((root / name).read_text())
        modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        modules |= {
            ("." * n.level) + (n.module or "")
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom)
        }
        web = {m for m in modules if m.split(".")[0] in ("fastapi", "starlette", "uvicorn")}
        local = {
            m for m in modules if m.startswith(".") and m not in ("..sampling", "..sampling.token")
        }
        assert not web and local <= {".errors", ".settings"}, (name, web, local)


@pytest.mark.parametrize("attention", ["bidirectional", "block_causal"])
def test_the_block_callback_only_observes(attention):
    """``sample_tokens(on_block=...)``: the same tokens and trace with or without it; it sees
    each block once, left to right, and its last view is the result."""
    from conftest import tiny_model

    from diffusion_rl.sampling import TokenSamplerConfig, sample_tokens

    model = tiny_model(attention)
    sampler = TokenSamplerConfig(
        generation_length=12, block_size=4, steps_per_block=2, temperature=1.0
    )
    ids = torch.tensor([[5, 6, 7], [0, 8, 9]])
    mask = torch.tensor([[True, True, True], [False, True, True]])
    seen = []
    plain = sample_tokens(model, ids, mask, sampler, seeds=[3, 4], capture=True)
    watched = sample_tokens(
        model,
        ids,
        mask,
        sampler,
        seeds=[3, 4],
        capture=True,
        on_block=lambda block, tokens: seen.append((block, tokens.clone())),
    )
    assert torch.equal(plain.tokens, watched.tokens)
    assert torch.equal(plain.trace.behaviour_logprobs, watched.trace.behaviour_logprobs)
    assert torch.equal(plain.trace.commit_steps, watched.trace.commit_steps)
    assert [block for block, _ in seen] == [0, 1, 2]
    assert torch.equal(seen[-1][1], plain.tokens)
    for block, tokens in seen:  # blocks up to this one are final; later slots not yet drawn
        assert torch.equal(tokens[:, : 4 * (block + 1)], plain.tokens[:, : 4 * (block + 1)])
        assert (tokens[:, 4 * (block + 1) :] == model.mask_token_id).all()
