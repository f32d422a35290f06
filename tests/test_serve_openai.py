"""The text routes through the official ``openai`` client against a live loopback server:
completions and chat, with and without streaming, parse as the OpenAI schema and equal
``diffusion-rl generate`` for the same seed; batched equals solo bitwise; a weight update
under streaming load is versioned, loses no request and serves exactly the new weights."""

from __future__ import annotations

import io
import threading
import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

import safetensors.torch  # noqa: E402
from serve_live import LiveServer, write_token_model  # noqa: E402

from diffusion_rl import cli  # noqa: E402
from diffusion_rl.serving.engine import load_served_model  # noqa: E402


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_openai")
    write_token_model(root / "tiny", seed=0)
    write_token_model(root / "new", seed=1)
    return root


@pytest.fixture(scope="module")
def live(dirs):
    server = LiveServer({"tiny": dirs / "tiny"}, max_wait_ms=0.0)
    yield server
    server.stop()


def client_for(server: LiveServer):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)


def cli_completions(capsys, directory, prompts: list[str], seed: int) -> list[str]:
    argv = ["generate", "--model", str(directory), "--seed", str(seed)]
    for prompt in prompts:
        argv += ["--prompt", prompt]
    assert cli.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(prompts)
    return [line[len(p) :] for line, p in zip(lines, prompts)]


def test_completions_parse_and_equal_the_cli(live, dirs, capsys):
    client = client_for(live)
    completion = client.completions.create(model="tiny", prompt="12+34=", seed=7)
    assert isinstance(completion, openai.types.Completion)
    assert completion.object == "text_completion" and completion.model == "tiny"
    choice = completion.choices[0]
    assert choice.text == cli_completions(capsys, dirs / "tiny", ["12+34="], 7)[0]
    assert choice.finish_reason in ("stop", "length") and choice.index == 0
    assert completion.usage.prompt_tokens == 6
    assert 1 <= completion.usage.completion_tokens <= 8
    assert completion.usage.total_tokens == 6 + completion.usage.completion_tokens
    extra = completion.model_extra
    assert extra["weights_version"] == 0
    assert extra["weights_checksum"] == live.engine.get("tiny").checksum
    assert set(extra["timings"]) == {"queue_ms", "compute_ms", "total_ms", "batch_rows"}
    # a list of prompts with n = 2: the CLI's rows, prompt-major, seeds 3, 4, 5, 6
    prompts = ["1+2=", "33+4="]
    many = client.completions.create(model="tiny", prompt=prompts, n=2, seed=3)
    expected = cli_completions(capsys, dirs / "tiny", [p for p in prompts for _ in (0, 1)], 3)
    assert [c.text for c in many.choices] == expected
    assert [c.model_extra["seed"] for c in many.choices] == [3, 4, 5, 6]
    assert many.usage.prompt_tokens == 4 + 5


def test_sampler_settings_and_max_tokens_are_applied(live, dirs, capsys):
    client = client_for(live)
    completion = client.completions.create(
        model="tiny",
        prompt="9+9=",
        seed=2,
        max_tokens=12,
        temperature=0.5,
        extra_body={"steps_per_block": 4, "confidence": "margin"},
    )
    argv = ["generate", "--model", str(dirs / "tiny"), "--prompt", "9+9=", "--seed", "2"]
    argv += ["--length", "12", "--temperature", "0.5", "--steps-per-block", "4"]
    assert cli.main([*argv, "--confidence", "margin"]) == 0
    assert "9+9=" + completion.choices[0].text == capsys.readouterr().out.strip("\n")
    assert len(completion.choices[0].model_extra["token_ids"]) == 12


def test_stop_strings_truncate_the_text(live):
    client = client_for(live)
    full = client.completions.create(model="tiny", prompt="12+34=", seed=11, max_tokens=16)
    text = full.choices[0].text
    assert len(text) >= 4
    stop = text[2:4]
    cut = client.completions.create(
        model="tiny", prompt="12+34=", seed=11, max_tokens=16, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_chat_with_and_without_streaming(live, dirs, capsys):
    client = client_for(live)
    messages = [{"role": "user", "content": "12+34="}]
    chat = client.chat.completions.create(model="tiny", messages=messages, seed=9, n=2)
    assert isinstance(chat, openai.types.chat.ChatCompletion)
    assert chat.object == "chat.completion"
    texts = [c.message.content for c in chat.choices]
    # a character tokenizer has no template: the chat prompt is the message itself
    assert texts == cli_completions(capsys, dirs / "tiny", ["12+34="] * 2, 9)
    assert all(c.message.role == "assistant" for c in chat.choices)
    stream = client.chat.completions.create(
        model="tiny", messages=messages, seed=9, n=2, stream=True
    )
    pieces, roles, finish, versions, usage = ["", ""], [None, None], [None, None], set(), None
    chunks = 0
    for chunk in stream:
        assert isinstance(chunk, openai.types.chat.ChatCompletionChunk)
        chunks += 1
        versions.add(chunk.model_extra["weights_version"])
        usage = chunk.usage or usage
        for choice in chunk.choices:
            pieces[choice.index] += choice.delta.content or ""
            roles[choice.index] = roles[choice.index] or choice.delta.role
            finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert pieces == texts and roles == ["assistant", "assistant"]
    assert finish == [c.finish_reason for c in chat.choices] and versions == {0}
    assert chunks >= 2  # blocks arrive as they commit (8 tokens in blocks of 4), then the end
    assert usage.completion_tokens == chat.usage.completion_tokens


def test_streamed_completions_concatenate_to_the_plain_text(live):
    client = client_for(live)
    for seed, stop in ((1, None), (4, ["+"]), (6, ["2", "=="])):
        kwargs = dict(model="tiny", prompt="12+34=", seed=seed, max_tokens=16, stop=stop)
        plain = client.completions.create(**kwargs)
        text, finish = "", None
        for chunk in client.completions.create(stream=True, **kwargs):
            assert isinstance(chunk, openai.types.Completion)
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        assert text == plain.choices[0].text and finish == plain.choices[0].finish_reason


REQUESTS = [  # (prompt, seed): two prompt widths, so two batch keys
    ("12+34=", 0), ("56+78=", 1), ("90+12=", 2), ("11+11=", 3),
    ("1+2=", 4), ("3+4=", 5), ("5+6=", 6), ("12+34=", 7),
]  # fmt: skip


def _fire(server, requests, stream=False):
    """All ``requests`` at once from their own threads; the completions in order."""
    results, errors = [None] * len(requests), []

    def one(index, prompt, seed):
        try:
            client = client_for(server)
            results[index] = client.completions.create(
                model="tiny", prompt=prompt, seed=seed, n=2, max_tokens=12
            )
        except Exception as error:  # noqa: BLE001 (reported below)
            errors.append(error)

    threads = [threading.Thread(target=one, args=(i, *r)) for i, r in enumerate(requests)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    return results


def test_batched_requests_equal_each_request_alone(dirs):
    server = LiveServer({"tiny": dirs / "tiny"}, max_wait_ms=300.0, max_batch_rows=32)
    try:
        batched = _fire(server, REQUESTS)
    finally:
        server.stop()
    server = LiveServer({"tiny": dirs / "tiny"}, max_wait_ms=0.0)  # each request alone
    try:
        client = client_for(server)
        solo = [
            client.completions.create(model="tiny", prompt=p, seed=s, n=2, max_tokens=12)
            for p, s in REQUESTS
        ]
    finally:
        server.stop()
    merged = [r.model_extra["timings"]["batch_rows"] for r in batched]
    assert max(merged) >= 4  # requests really were merged (2 rows each)
    assert [r.model_extra["timings"]["batch_rows"] for r in solo] == [2] * len(REQUESTS)
    for together, alone in zip(batched, solo):
        assert [c.model_extra["token_ids"] for c in together.choices] == [
            c.model_extra["token_ids"] for c in alone.choices
        ]
        assert [c.text for c in together.choices] == [c.text for c in alone.choices]


def test_a_weight_update_under_streaming_load(dirs):
    server = LiveServer(
        {"tiny": dirs / "tiny"}, allow_tensor_updates=True, max_wait_ms=2.0, max_batch_rows=8
    )
    new_state = dict(load_served_model("n", dirs / "new").model.state_dict())
    body = io.BytesIO(safetensors.torch.save(new_state)).getvalue()
    records, errors, lock = [], [], threading.Lock()
    updated = threading.Event()

    def client_loop(worker: int):
        client = client_for(server)
        after_update = 0
        for turn in range(40):  # bounded: stops once it has seen the new version twice
            prompt, seed = REQUESTS[(worker + turn) % len(REQUESTS)]
            try:
                stream = client.completions.create(
                    model="tiny", prompt=prompt, seed=seed, max_tokens=12, stream=True
                )
                text, versions = "", set()
                for chunk in stream:
                    text += chunk.choices[0].text if chunk.choices else ""
                    versions.add(chunk.model_extra["weights_version"])
            except Exception as error:  # noqa: BLE001 (reported below)
                with lock:
                    errors.append(error)
                return
            with lock:
                records.append((prompt, seed, versions, text))
            if updated.is_set():
                after_update += 1
                if after_update >= 2:
                    return

    threads = [threading.Thread(target=client_loop, args=(w,)) for w in range(4)]
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while len(records) < 6:
            assert time.monotonic() < deadline and not errors
            time.sleep(0.005)
        status, head, raw = server.request(
            "POST",
            "/update_weights?model=tiny",
            body,
            {"Content-Type": "application/octet-stream"},
        )
        updated.set()
        for thread in threads:
            thread.join(60)
    finally:
        server.stop()
    assert status == 200 and head["x-weights-version"] == "1", raw
    assert not errors, errors
    assert all(len(v) == 1 for *_, v, _ in records)  # one version per response
    versions = [next(iter(v)) for *_, v, _ in records]
    assert set(versions) == {0, 1} and versions.count(1) >= 4
    expected = {}
    for version, directory in ((0, dirs / "tiny"), (1, dirs / "new")):
        fresh = LiveServer({"tiny": directory}, max_wait_ms=0.0)
        try:
            client = client_for(fresh)
            for prompt, seed in REQUESTS:
                completion = client.completions.create(
                    model="tiny", prompt=prompt, seed=seed, max_tokens=12
                )
                expected[version, prompt, seed] = completion.choices[0].text
        finally:
            fresh.stop()
    assert any(expected[0, p, s] != expected[1, p, s] for p, s in REQUESTS)
    for (prompt, seed, _, text), version in zip(records, versions):
        assert text == expected[version, prompt, seed], (prompt, seed, version)


def test_a_llada_directory_serves_chat_through_its_template(tmp_path):
    pytest.importorskip("transformers")
    from hf_tiny import write_checkpoint

    write_checkpoint(tmp_path / "llada", "llada", seed=3)
    server = LiveServer({"llada": tmp_path / "llada"}, max_wait_ms=0.0)
    try:
        client = client_for(server)
        tokenizer = server.engine.get("llada").tokenizer
        templated = tokenizer.chat_prompt("what is 1+2")
        assert templated.startswith("<|startoftext|><|start_header_id|>user")
        chat = client.chat.completions.create(
            model="llada", messages=[{"role": "user", "content": "what is 1+2"}], seed=1
        )
        plain = client.completions.create(model="llada", prompt=templated, seed=1)
    finally:
        server.stop()
    assert chat.choices[0].message.content == plain.choices[0].text
    assert chat.usage.prompt_tokens == len(tokenizer.encode(templated)) == plain.usage.prompt_tokens
    assert chat.choices[0].model_extra["token_ids"] == plain.choices[0].model_extra["token_ids"]
