"""``POST /v1/completions`` and ``POST /v1/chat/completions`` for diffusion LMs.

Any token model the loader reads is served (built-in, LLaDA / Dream / SDAR directories). A
request is sampled exactly as ``diffusion-rl generate`` samples its ``--prompt`` s
(:mod:`.generation`): the model's recorded sampler with the request's settings applied
(``max_tokens`` is the generation length; ``temperature``; the sampler's own settings as
extra fields: ``block_size``, ``steps_per_block``, ``confidence``, ``schedule``,
``threshold``), choice ``i`` (prompt-major: prompt ``p``'s ``n`` choices are ``p * n ..``)
seeded ``seed + i``, prompts left-padded to the request's longest. Chat requests put the
messages through the tokenizer's chat template (``chat_prompt`` for one user message; the
full template for a conversation); a character tokenizer has none, so its chat prompt is the
message itself.

Batching: a request is one engine item; requests with the same padded prompt width and the
same sampler settings are merged (rows are seeded on their own, so the tokens are bitwise
those of the request alone). ``stop`` strings truncate the decoded text (finish_reason
``stop``). ``stream: true`` sends server-sent events as blocks commit: the concatenated
deltas of a choice are exactly its non-streamed text. Every response (and chunk) names
``weights_version`` / ``weights_checksum``; the last carries ``usage`` and ``timings``.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..sampling import TokenSamplerConfig
from .engine import Engine, ServedModel
from .errors import RequestError, describe_validation
from .generation import completion_tokens, left_pad, sample_completions
from .routing import cancel_on_disconnect, read_json_body, weights_fields, weights_headers
from .settings import ServeSettings

__all__ = ["ChatRequest", "CompletionRequest", "router"]

MAX_SEED = 2**63 - 1  # per-row seeds are mixed into a 63-bit generator seed (seeding.py)
MAX_STOP_CHARS = 256
SAMPLER_FIELDS = ("block_size", "steps_per_block", "confidence", "schedule", "threshold")


def _text_list(value: Any, field: str, *, allow_empty: bool = False) -> list[str]:
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise ValueError("expected a string or a list of strings")
    if not values and not allow_empty:
        raise ValueError("expected at least one string, got an empty list")
    return values


class _SamplingFields(BaseModel):
    """The fields shared by both routes (OpenAI's and the sampler's)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=100.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, allow_inf_nan=False)
    n: int = Field(default=1, ge=1)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: Any = None
    stream: bool = False
    stream_options: dict[str, bool] | None = None
    user: str | None = Field(default=None, max_length=256)
    presence_penalty: float | None = Field(default=None, allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=None, allow_inf_nan=False)
    # the sampler's own settings (TokenSamplerConfig)
    block_size: int | None = Field(default=None, ge=1)
    steps_per_block: int | None = Field(default=None, ge=1)
    confidence: Literal["probability", "margin", "neg_entropy", "left_to_right"] | None = None
    schedule: Literal["fixed", "threshold"] | None = None
    threshold: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value):
        if value is None:
            return None
        stops = _text_list(value, "stop", allow_empty=True)
        if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"each stop string must have 1 .. {MAX_STOP_CHARS} characters")
        return stops

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, value):
        if value is not None and value != 1.0:
            raise ValueError("only 1 is supported (the sampler draws from the full softmax)")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, value):
        if value is not None and value != 0.0:
            raise ValueError("only 0 is supported (a diffusion sampler has no token penalties)")
        return value

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, value):
        if value is not None and set(value) - {"include_usage"}:
            raise ValueError("the only stream option is include_usage")
        return value


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: ``prompt`` is a string or a list of strings."""

    prompt: Any
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = Field(default=None, ge=1, le=1)
    suffix: str | None = Field(default=None, max_length=0)

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value):
        if value is not None:
            raise ValueError("not supported (omit it); /rollout/generate returns log-probs")
        return value

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value):
        return _text_list(value, "prompt")

    @field_validator("echo")
    @classmethod
    def _echo(cls, value):
        if value:
            raise ValueError("true is not supported (omit it)")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: Any
    name: str | None = Field(default=None, max_length=256)

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value):
        if isinstance(value, str):
            return value
        if isinstance(value, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in value
        ):
            return "".join(p["text"] for p in value)
        raise ValueError("expected a string or a list of {'type': 'text', 'text': ...} parts")


class ChatRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=256)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, value):
        if value:
            raise ValueError("true is not supported (omit it); /rollout/generate returns log-probs")
        return value


# ----------------------------------------------------------------------------- preparation
@dataclass(frozen=True)
class _Prepared:
    prompts: list[str]
    encoded: list[list[int]]
    sampler: TokenSamplerConfig
    seed: int
    rows: int


@dataclass(eq=False)
class _TokenItem:
    """One request in the engine: its padded rows, their seeds, and an optional block sink."""

    ids: torch.Tensor  # long [rows, width]
    mask: torch.Tensor  # bool [rows, width]
    seeds: list[int]
    sampler: TokenSamplerConfig
    sink: Callable[[ServedModel, int, list[list[int]]], None] | None = None

    @property
    def rows(self) -> int:
        return len(self.seeds)


def _chat_text(tokenizer, messages: list[ChatMessage]) -> str:
    """The prompt text of a conversation under the tokenizer's chat template."""
    if len(messages) == 1 and messages[0].role == "user":
        try:
            return tokenizer.chat_prompt(messages[0].content)
        except ValueError as error:
            raise RequestError(400, f"messages: {error}", param="messages") from None
    hf = getattr(tokenizer, "hf", None)
    if hf is None or not getattr(tokenizer, "has_chat_template", False):
        raise RequestError(
            400,
            "messages: this model's tokenizer has no chat template, so it takes one user "
            "message (or use /v1/completions)",
            param="messages",
        )
    if messages[-1].role != "user":
        raise RequestError(400, "messages: the last message must be the user's", param="messages")
    turns = [{"role": m.role, "content": m.content} for m in messages]
    return hf.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)


def _sampler(served: ServedModel, request: _SamplingFields, max_tokens: int | None):
    overrides: dict[str, Any] = {
        key: getattr(request, key) for key in SAMPLER_FIELDS if getattr(request, key) is not None
    }
    if request.temperature is not None:
        overrides["temperature"] = float(request.temperature)
    if max_tokens is not None:
        overrides["generation_length"] = max_tokens
    recorded = dict(served.info.get("sampler") or {})
    try:
        sampler = TokenSamplerConfig(**{**recorded, **overrides})
    except ValidationError as error:
        problem = describe_validation(error.errors())
        field = problem.param if problem.param in overrides else None
        name = "max_tokens" if field == "generation_length" else field
        message = problem.message.replace("generation_length", "max_tokens")
        raise RequestError(400, message, param=name) from None
    unused = {"fixed": "threshold", "threshold": "steps_per_block"}[sampler.schedule]
    if unused in overrides:
        other = "threshold" if sampler.schedule == "fixed" else "fixed"
        raise RequestError(
            400,
            f"{unused}: used only by the {other} schedule; this request's sampler uses "
            f'schedule {sampler.schedule!r} (add "schedule": "{other}")',
            param=unused,
        )
    model = served.model
    model_block = getattr(model, "block_size", None)
    if getattr(model, "attention", None) == "block_causal" and sampler.block_size != model_block:
        raise RequestError(
            400,
            f"block_size: this block-causal model was built for blocks of {model_block}, got "
            f"{sampler.block_size}",
            param="block_size",
        )
    return sampler


def _prepare(
    engine: Engine,
    settings: ServeSettings,
    request: _SamplingFields,
    prompts: list[str],
    field: str,
) -> tuple[ServedModel, _Prepared]:
    served = engine.get(request.model)
    if served.kind != "token":
        raise RequestError(
            400,
            f"model: {request.model!r} is a {served.kind} model; text completions need a token "
            "model",
            param="model",
        )
    if len(prompts) > settings.max_prompts:
        raise RequestError(
            400,
            f"{field}: {len(prompts)} prompts, more than the limit {settings.max_prompts}",
            param=field,
        )
    if request.n > settings.max_n:
        raise RequestError(400, f"n: {request.n} exceeds the limit {settings.max_n}", param="n")
    rows = request.n * len(prompts)
    if rows > settings.max_request_rows:
        raise RequestError(
            400,
            f"n: {request.n} choices x {len(prompts)} prompts = {rows} rows, more than the "
            f"limit {settings.max_request_rows}",
            param="n",
        )
    stops = request.stop or []
    if len(stops) > settings.max_stop:
        raise RequestError(
            400,
            f"stop: {len(stops)} strings, more than the limit {settings.max_stop}",
            param="stop",
        )
    max_tokens = getattr(request, "max_completion_tokens", None) or request.max_tokens
    length_field = "max_tokens" if request.max_tokens is not None else "max_completion_tokens"
    if max_tokens is not None and max_tokens > settings.max_tokens:
        raise RequestError(
            400,
            f"{length_field}: {max_tokens} exceeds the limit {settings.max_tokens}",
            param=length_field,
        )
    for key in ("block_size", "steps_per_block"):
        value = getattr(request, key)
        limit = settings.max_tokens if key == "block_size" else settings.max_steps
        if value is not None and value > limit:
            raise RequestError(400, f"{key}: {value} exceeds the limit {limit}", param=key)
    sampler = _sampler(served, request, max_tokens)
    tokenizer = served.tokenizer
    encoded = []
    for index, prompt in enumerate(prompts):
        if not prompt:
            raise RequestError(400, f"{field}: prompt {index} is empty", param=field)
        try:
            encoded.append(tokenizer.encode(prompt))
        except ValueError as error:
            message = str(error).split(": ", 1)[-1]
            raise RequestError(400, f"{field}: {message}", param=field) from None
        if not encoded[-1]:
            raise RequestError(400, f"{field}: prompt {index} encodes to no tokens", param=field)
    width, length = max(len(e) for e in encoded), sampler.generation_length
    limit = served.model.config.max_seq_len
    if width >= limit:
        raise RequestError(
            400,
            f"{field}: {width} tokens leave no room to generate within the model's "
            f"max_seq_len={limit}",
            param=field,
        )
    if width + length > limit:
        raise RequestError(
            400,
            f"max_tokens: a prompt of {width} tokens plus {length} generated tokens exceeds the "
            f"model's max_seq_len={limit}; use max_tokens <= {limit - width}",
            param="max_tokens",
        )
    seed = request.seed if request.seed is not None else secrets.randbelow(2**31)
    if seed + rows - 1 > MAX_SEED:
        raise RequestError(
            400,
            f"seed: rows use seeds seed .. seed + {rows - 1}, which must stay <= {MAX_SEED}",
            param="seed",
        )
    return served, _Prepared(prompts, encoded, sampler, seed, rows)


# ----------------------------------------------------------------------------- running
def _generate(served: ServedModel, items: list[_TokenItem]) -> list[dict]:
    """The engine's batch function: all items' rows in one sampler call (same width and
    sampler, by the batch key); one ``{"tokens", "started", "finished", "batch_rows"}`` per
    item."""
    started = time.perf_counter()
    ids = torch.cat([item.ids for item in items])
    mask = torch.cat([item.mask for item in items])
    seeds = [seed for item in items for seed in item.seeds]
    spans, offset = [], 0
    for item in items:
        spans.append((offset, offset + item.rows, item.sink))
        offset += item.rows

    def on_block(block: int, tokens: torch.Tensor) -> None:
        for lo, hi, sink in spans:
            if sink is not None:
                sink(served, block, tokens[lo:hi].tolist())

    streaming = any(item.sink is not None for item in items)
    sample = sample_completions(
        served.model,
        served.tokenizer,
        ids,
        mask,
        items[0].sampler,
        seeds,
        on_block=on_block if streaming else None,
    )
    tokens = sample.tokens.cpu().tolist()
    finished = time.perf_counter()
    return [
        {"tokens": tokens[lo:hi], "started": started, "finished": finished, "batch_rows": offset}
        for lo, hi, _ in spans
    ]


def _truncate(text: str, stops: list[str]) -> tuple[str, bool]:
    """``text`` up to the earliest stop string, and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def _streamable(text: str, stops: list[str]) -> str:
    """The part of a partial text that no later token can change: without a stop string
    found yet, hold back a tail that could begin one, and an undecodable last byte."""
    cut, hit = _truncate(text, stops)
    if hit:
        return cut
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                hold = max(hold, k)
                break
    text = text[: len(text) - hold]
    return text.rstrip("\ufffd")


@dataclass
class _Choice:
    text: str
    finish_reason: str
    token_ids: list[int]
    seed: int
    completion_tokens: int


def _choices(served: ServedModel, prepared: _Prepared, rows: list[list[int]], stops) -> list:
    tokenizer, out = served.tokenizer, []
    for i, row in enumerate(rows):
        text = tokenizer.decode(row)
        text, hit = _truncate(text, stops)
        used = completion_tokens(row, tokenizer)
        stopped = hit or (used > 0 and row[used - 1] in _stop_ids(tokenizer))
        out.append(_Choice(text, "stop" if stopped else "length", row, prepared.seed + i, used))
    return out


def _stop_ids(tokenizer) -> set[int]:
    return set(getattr(tokenizer, "stop_ids", None) or {tokenizer.eos_id})


def _usage(prepared: _Prepared, choices: list[_Choice]) -> dict:
    prompt_tokens = sum(len(e) for e in prepared.encoded)
    completion = sum(c.completion_tokens for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


def _timings(result: dict, submitted: float) -> dict:
    now = time.perf_counter()
    return {
        "queue_ms": round(1000 * (result["started"] - submitted), 3),
        "compute_ms": round(1000 * (result["finished"] - result["started"]), 3),
        "total_ms": round(1000 * (now - submitted), 3),
        "batch_rows": result["batch_rows"],
    }


def _item(prepared: _Prepared, tokenizer, sink=None) -> tuple[tuple, _TokenItem]:
    n = prepared.rows // len(prepared.encoded)
    rows = [e for e in prepared.encoded for _ in range(n)]  # prompt-major
    ids, mask = left_pad(rows, tokenizer.pad_id)
    seeds = [prepared.seed + i for i in range(prepared.rows)]
    key = ("tokens", ids.shape[1], prepared.sampler.model_dump_json())
    return key, _TokenItem(ids, mask, seeds, prepared.sampler, sink)


def router(engine: Engine, settings: ServeSettings) -> APIRouter:
    """The text routes (module docstring) on ``engine``."""
    api = APIRouter()

    async def serve(request: Request, chat: bool) -> Any:
        submitted = time.perf_counter()
        schema = ChatRequest if chat else CompletionRequest
        body = await read_json_body(request, schema)
        field = "messages" if chat else "prompt"
        if chat:
            served = engine.get(body.model)
            if served.kind != "token":
                raise RequestError(
                    400, f"model: {body.model!r} is a {served.kind} model", param="model"
                )
            prompts = [_chat_text(served.tokenizer, body.messages)]
        else:
            prompts = body.prompt
        served, prepared = _prepare(engine, settings, body, prompts, field)
        stops = body.stop or []
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        if body.stream:
            return await _stream(
                request, engine, served, prepared, stops, chat, ident, created, submitted
            )
        key, item = _item(prepared, served.tokenizer)
        result, served = await cancel_on_disconnect(
            request, engine.run(body.model, key, item, _generate)
        )
        choices = _choices(served, prepared, result["tokens"], stops)
        engine.metrics.count(
            "generated_tokens_total", sum(c.completion_tokens for c in choices), model=served.name
        )
        record = {
            "id": ident,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": served.name,
            "system_fingerprint": f"w{served.version}-{served.checksum}",
            "choices": [_choice_json(i, c, chat) for i, c in enumerate(choices)],
            "usage": _usage(prepared, choices),
            "timings": _timings(result, submitted),
            "seed": prepared.seed,
            **weights_fields(served),
        }
        return JSONResponse(record, headers=weights_headers(served))

    @api.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, chat=True)

    return api


def _choice_json(index: int, choice: _Choice, chat: bool) -> dict:
    extra = {"token_ids": choice.token_ids, "seed": choice.seed}
    if chat:
        message = {"role": "assistant", "content": choice.text}
        return {"index": index, "message": message, "finish_reason": choice.finish_reason, **extra}
    return {
        "index": index,
        "text": choice.text,
        "finish_reason": choice.finish_reason,
        "logprobs": None,
        **extra,
    }


async def _stream(request, engine, served, prepared, stops, chat, ident, created, submitted):
    """Queue the request with a block sink and stream its blocks as server-sent events; the
    response starts (with the weights headers) when the first block or the result is in, so
    a refusal (503, 504) is still a plain error response."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def sink(batch_served: ServedModel, block: int, rows: list[list[int]]) -> None:
        loop.call_soon_threadsafe(events.put_nowait, ("block", batch_served, rows))

    key, item = _item(prepared, served.tokenizer, sink)
    task = asyncio.ensure_future(engine.run(served.name, key, item, _generate))
    task.add_done_callback(lambda _task: events.put_nowait(("done", None, None)))
    try:
        first = await cancel_on_disconnect(request, events.get())
    except BaseException:
        task.cancel()
        raise
    if first[0] == "done":
        result, batch_served = task.result()  # raises the request's error, if any
    else:
        batch_served = first[1]
    kind = "chat.completion.chunk" if chat else "text_completion"
    header = {"id": ident, "object": kind, "created": created, "model": served.name}

    def chunk(choices: list[dict], **extra) -> str:
        record = {
            **header,
            "system_fingerprint": f"w{batch_served.version}-{batch_served.checksum}",
            "choices": choices,
            **extra,
            **weights_fields(batch_served),
        }
        return f"data: {json.dumps(record)}\n\n"

    def delta(index: int, text: str, finish: str | None, first_chunk: bool) -> dict:
        if chat:
            content = {"content": text}
            if first_chunk:
                content = {"role": "assistant", **content}
            return {"index": index, "delta": content, "finish_reason": finish}
        return {"index": index, "text": text, "finish_reason": finish, "logprobs": None}

    async def body():
        sent = [""] * prepared.rows
        started = [False] * prepared.rows
        event = first
        try:
            while event[0] == "block":
                pieces = []
                for i, row in enumerate(event[2]):
                    text = _streamable(served.tokenizer.decode(row), stops)
                    if len(text) > len(sent[i]) and text.startswith(sent[i]):
                        pieces.append(delta(i, text[len(sent[i]) :], None, not started[i]))
                        sent[i], started[i] = text, True
                if pieces:
                    yield chunk(pieces)
                event = await events.get()
            result, final_served = task.result()
            choices = _choices(final_served, prepared, result["tokens"], stops)
            engine.metrics.count(
                "generated_tokens_total",
                sum(c.completion_tokens for c in choices),
                model=served.name,
            )
            tail = []
            for i, choice in enumerate(choices):
                rest = choice.text[len(sent[i]) :] if choice.text.startswith(sent[i]) else ""
                tail.append(delta(i, rest, choice.finish_reason, not started[i]))
            yield chunk(
                tail,
                usage=_usage(prepared, choices),
                timings=_timings(result, submitted),
                seed=prepared.seed,
            )
            yield "data: [DONE]\n\n"
        finally:
            task.cancel()

    return StreamingResponse(
        body(),
        media_type="text/event-stream",
        headers={**weights_headers(batch_served), "Cache-Control": "no-cache"},
    )
