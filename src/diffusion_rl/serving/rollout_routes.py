"""``POST /rollout/generate``: the serving sampler with capture on; the trace in the body.

Rollout = serve + capture. The route runs the very loop the OpenAI routes run
(:func:`~diffusion_rl.sampling.sample_tokens` / :func:`~diffusion_rl.sampling.sample_flow`)
with ``capture=True`` on the served weights, and answers ``application/octet-stream``: a
:func:`~diffusion_rl.trace_io.rollout_to_bytes` body, i.e. the trace as safetensors (readable
by :func:`~diffusion_rl.trace_io.trace_from_bytes`) plus the artefact: for a token model the
completions' token ids are the trace's ``tokens`` and the metadata's ``artefact.texts`` holds
them decoded by the served tokenizer; for a flow model the tensor ``artefact/images`` holds
``model.decode`` of the final latents (images ``[B, C, H, W]`` or clips). ``artefact`` also
carries ``weights_version``, ``weights_checksum``, ``usage`` and ``timings``; the headers
``X-Weights-Version`` / ``X-Weights-Checksum`` repeat the first two.

Request (JSON; unknown keys are refused): ``model``; the rows: ``seeds`` (one int per row)
and, for a token model, either ``prompt`` (texts, encoded as ``/v1/completions`` encodes
them: :mod:`.generation`) or ``prompt_ids`` (+ ``prompt_mask``; rectangular, left-padded:
exactly what a task's ``encode`` gives), or, for a flow model, ``prompt`` (one per row) and
``group_size``; ``sampler`` (the sampler's settings; keys left out take the model
directory's serving sampler, then the sampler's defaults); ``stop_token_id`` (token models;
omitted: the tokenizer's EOS, null: none); ``autocast`` (``bfloat16`` / ``float16`` or
null: the precision context the rows are sampled under, so a learner that samples under
autocast gets its own kernels); ``weights_version`` (optional: the version the caller
expects; any other is refused with 409, so a trace is never sampled on weights the caller
did not push).

Invariants: the trace is the one the in-process sampler would capture with the same inputs
and weights (its ``weights_version`` is the served version; ``model_info["served"]`` names
model, version and checksum), and a capture-off request (the OpenAI routes) with the same
seeds returns bitwise the same artefact. Token requests with equal settings and prompt width
are merged into one batch (rows are independent: bitwise the same as alone); flow requests
run alone, because a flow trace records its forward groups and an exact (parity 0) replay
repeats them: a group shared with another request's rows could not be replayed by either.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..sampling import TokenSamplerConfig, sample_tokens
from ..sampling.flow import FlowSamplerConfig, sample_flow
from ..trace_io import rollout_to_bytes
from .engine import Engine, ServedModel
from .errors import RequestError, describe_validation
from .generation import completion_tokens, left_pad, model_device
from .routing import cancel_on_disconnect, read_json_body, weights_fields, weights_headers
from .settings import ServeSettings

__all__ = ["RolloutRequest", "router"]

INT64_MAX = 2**63 - 1
AUTOCAST_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
MEDIA_TYPE = "application/octet-stream"


class RolloutRequest(BaseModel):
    """The JSON body of ``POST /rollout/generate`` (module docstring)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(min_length=1, max_length=256)
    seeds: list[int] = Field(min_length=1)
    prompt: list[str] | None = None
    prompt_ids: list[list[int]] | None = None
    prompt_mask: list[list[bool]] | None = None
    sampler: dict[str, Any] = Field(default_factory=dict)
    stop_token_id: int | None = None
    group_size: int | None = Field(default=None, ge=1)
    autocast: Literal["bfloat16", "float16"] | None = None
    weights_version: int | None = Field(default=None, ge=0)


@dataclass(frozen=True)
class _TokenItem:
    ids: torch.Tensor  # long [b, P]
    mask: torch.Tensor  # bool [b, P]
    seeds: list[int]
    sampler: TokenSamplerConfig
    stop: int | None
    autocast: str | None
    expected: int | None  # the weights version the caller expects (None: any)

    @property
    def rows(self) -> int:
        return len(self.seeds)


@dataclass(frozen=True)
class _FlowItem:
    prompts: list[str]
    seeds: list[int]
    sampler: FlowSamplerConfig
    group_size: int | None
    autocast: str | None
    expected: int | None

    @property
    def rows(self) -> int:
        return len(self.seeds)


@dataclass(frozen=True)
class _Result:
    trace: Any
    artefacts: dict[str, torch.Tensor]
    texts: list[str] | None
    batch_ms: float
    batch_rows: int


def _autocast(device: torch.device, name: str | None):
    if name is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=AUTOCAST_DTYPES[name])


def _check_version(served: ServedModel, expected: int | None) -> None:
    if expected is not None and served.version != expected:
        raise RequestError(
            409,
            f"weights_version: the request expects weights v{expected}, the server holds "
            f"v{served.version} (checksum {served.checksum}); push the weights you sample with "
            "(POST /update_weights) and send the version it answered",
            param="weights_version",
            code="version_conflict",
        )


def _stamp(trace, served: ServedModel):
    """The trace with the served model, version and checksum in its ``model_info``."""
    stamp = {"model": served.name, "weights_version": served.version, "checksum": served.checksum}
    return replace(trace, model_info={**trace.model_info, "served": stamp})


def _run_tokens(served: ServedModel, items: list[_TokenItem]) -> list[_Result]:
    """The engine's batch function of token rollouts: every item's rows in one
    ``sample_tokens`` call (they share sampler, prompt width, stop id, precision and expected
    version: the batch key), split back."""
    first = items[0]
    _check_version(served, first.expected)
    device = model_device(served.model)
    started = time.perf_counter()
    with _autocast(device, first.autocast):
        sample = sample_tokens(
            served.model,
            torch.cat([item.ids for item in items]).to(device),
            torch.cat([item.mask for item in items]).to(device),
            first.sampler,
            seeds=[seed for item in items for seed in item.seeds],
            stop_token_id=first.stop,
            capture=True,
            weights_version=served.version,
        )
    trace = _stamp(sample.trace, served)
    elapsed = (time.perf_counter() - started) * 1000
    tokenizer, results, start = served.tokenizer, [], 0
    for item in items:
        part = trace.rows(slice(start, start + item.rows))
        start += item.rows
        texts = None if tokenizer is None else tokenizer.batch_decode(part.tokens)
        results.append(_Result(part, {}, texts, elapsed, trace.tokens.shape[0]))
    return results


def _run_flow(served: ServedModel, items: list[_FlowItem]) -> list[_Result]:
    """The engine's batch function of flow rollouts: one item (one request) per call, as
    each request has a key of its own."""
    results = []
    for item in items:
        _check_version(served, item.expected)
        device = model_device(served.model)
        started = time.perf_counter()
        with _autocast(device, item.autocast):
            sample = sample_flow(
                served.model,
                item.prompts,
                item.sampler,
                seeds=item.seeds,
                capture=True,
                weights_version=served.version,
                group_size=item.group_size,
            )
        elapsed = (time.perf_counter() - started) * 1000
        images = {"images": sample.images} if sample.images is not None else {}
        results.append(_Result(_stamp(sample.trace, served), images, None, elapsed, item.rows))
    return results


def _sampler(config_cls, served: ServedModel, given: dict[str, Any]):
    """The request's sampler: the model directory's serving sampler (where it has one),
    overridden by the request's keys; a 400 naming ``sampler.KEY`` otherwise."""
    base = served.info.get("sampler") if isinstance(served.info.get("sampler"), dict) else {}
    known = set(config_cls.model_fields)
    settings = {**{k: v for k, v in base.items() if k in known}, **given}
    if config_cls is FlowSamplerConfig:  # JSON lists for the tuple field
        window = settings.get("sde_window")
        if isinstance(window, list):
            settings["sde_window"] = tuple(window)
    try:
        return config_cls(**settings)
    except ValidationError as error:
        errors = [{**e, "loc": ("sampler", *e.get("loc", ()))} for e in error.errors()]
        raise describe_validation(errors) from None


def _seeds(request: RolloutRequest, settings: ServeSettings) -> list[int]:
    rows = len(request.seeds)
    if rows > settings.max_request_rows:
        raise RequestError(
            400,
            f"seeds: {rows} rows, more than max_request_rows={settings.max_request_rows}; "
            "split the request",
            param="seeds",
        )
    for k, seed in enumerate(request.seeds):
        if not 0 <= seed <= INT64_MAX:
            raise RequestError(
                400, f"seeds[{k}]: expected an int in [0, 2^63 - 1], got {seed}", param="seeds"
            )
    return list(request.seeds)


def _token_item(request: RolloutRequest, served: ServedModel, settings: ServeSettings):
    seeds = _seeds(request, settings)
    if request.group_size is not None:
        raise RequestError(
            400, "group_size: only flow models take a group size; remove it", param="group_size"
        )
    sampler = _sampler(TokenSamplerConfig, served, request.sampler)
    if sampler.generation_length > settings.max_tokens:
        raise RequestError(
            400,
            f"sampler.generation_length: {sampler.generation_length} is over max_tokens="
            f"{settings.max_tokens}",
            param="sampler.generation_length",
        )
    for key, limit, name in (
        ("block_size", settings.max_tokens, "max_tokens"),
        ("steps_per_block", settings.max_steps, "max_steps"),
    ):
        if getattr(sampler, key) > limit:
            raise RequestError(
                400,
                f"sampler.{key}: {getattr(sampler, key)} is over {name}={limit}",
                param=f"sampler.{key}",
            )
    tokenizer, vocab = served.tokenizer, int(served.model.vocab_size)
    if (request.prompt is None) == (request.prompt_ids is None):
        raise RequestError(
            400,
            "prompt: give exactly one of prompt (texts) and prompt_ids (token ids)",
            param="prompt",
        )
    if request.prompt is not None:
        if tokenizer is None:
            raise RequestError(
                400, "prompt: this model has no tokenizer; send prompt_ids", param="prompt"
            )
        if request.prompt_mask is not None:
            raise RequestError(
                400, "prompt_mask: goes with prompt_ids only; remove it", param="prompt_mask"
            )
        if len(request.prompt) != len(seeds):
            raise RequestError(
                400,
                f"prompt: {len(request.prompt)} prompts for {len(seeds)} seeds; one seed per row",
                param="prompt",
            )
        encoded = []
        for index, text in enumerate(request.prompt):
            try:
                encoded.append(tokenizer.encode(text))
            except ValueError as error:
                message = str(error).split(": ", 1)[-1]
                raise RequestError(400, f"prompt[{index}]: {message}", param="prompt") from None
            if not encoded[-1]:
                raise RequestError(
                    400,
                    f"prompt[{index}]: encodes to no tokens; send a non-empty prompt",
                    param="prompt",
                )
        ids, mask = left_pad(encoded, tokenizer.pad_id)
    else:
        rows = request.prompt_ids
        if len(rows) != len(seeds):
            raise RequestError(
                400,
                f"prompt_ids: {len(rows)} rows for {len(seeds)} seeds; one seed per row",
                param="prompt_ids",
            )
        if len({len(row) for row in rows}) != 1:
            raise RequestError(
                400,
                "prompt_ids: rows of different lengths; left-pad them to one width and mark "
                "the padding False in prompt_mask",
                param="prompt_ids",
            )
        ids = torch.tensor(rows, dtype=torch.long)
        bad = (ids < 0) | (ids >= vocab)
        if bool(bad.any()):
            row, col = bad.nonzero()[0].tolist()
            raise RequestError(
                400,
                f"prompt_ids[{row}][{col}]: {int(ids[row, col])} is not a token id in [0, {vocab})",
                param="prompt_ids",
            )
        if request.prompt_mask is None:
            mask = torch.ones_like(ids, dtype=torch.bool)
        else:
            mask = torch.tensor(request.prompt_mask, dtype=torch.bool)
            if tuple(mask.shape) != tuple(ids.shape):
                raise RequestError(
                    400,
                    f"prompt_mask: shape {tuple(mask.shape)}, expected that of prompt_ids "
                    f"{tuple(ids.shape)}",
                    param="prompt_mask",
                )
    limit = getattr(getattr(served.model, "config", None), "max_seq_len", None)
    if isinstance(limit, int) and ids.shape[1] + sampler.generation_length > limit:
        raise RequestError(
            400,
            f"prompt: {ids.shape[1]} prompt slots + generation_length "
            f"{sampler.generation_length} exceed the model's max_seq_len={limit}",
            param="prompt",
        )
    if "stop_token_id" in request.model_fields_set:
        stop = request.stop_token_id
        if stop is not None and not 0 <= stop < vocab:
            raise RequestError(
                400,
                f"stop_token_id: {stop} is not a token id in [0, {vocab})",
                param="stop_token_id",
            )
    else:
        stop = None if tokenizer is None else tokenizer.eos_id
    item = _TokenItem(ids, mask, seeds, sampler, stop, request.autocast, request.weights_version)
    key = (
        "token",
        json.dumps(sampler.model_dump(), sort_keys=True),
        ids.shape[1],
        stop,
        request.autocast,
        request.weights_version,
    )
    return item, key, _run_tokens


def _flow_item(request: RolloutRequest, served: ServedModel, settings: ServeSettings):
    seeds = _seeds(request, settings)
    for name in ("prompt_ids", "prompt_mask", "stop_token_id"):
        if name in request.model_fields_set:
            raise RequestError(
                400, f"{name}: token models only; a flow model takes prompt (texts)", param=name
            )
    if request.prompt is None or len(request.prompt) != len(seeds):
        given = None if request.prompt is None else len(request.prompt)
        raise RequestError(
            400,
            f"prompt: expected one prompt per seed ({len(seeds)}), got {given}",
            param="prompt",
        )
    sampler = _sampler(FlowSamplerConfig, served, request.sampler)
    if sampler.num_steps > settings.max_steps:
        raise RequestError(
            400,
            f"sampler.num_steps: {sampler.num_steps} is over max_steps={settings.max_steps}",
            param="sampler.num_steps",
        )
    group = request.group_size
    if group is not None and len(seeds) % group:
        raise RequestError(
            400,
            f"group_size: {group} does not divide the {len(seeds)} rows",
            param="group_size",
        )
    if sampler.share_group_noise and group is None:
        raise RequestError(
            400, "group_size: sampler.share_group_noise needs the group size", param="group_size"
        )
    item = _FlowItem(
        list(request.prompt), seeds, sampler, group, request.autocast, request.weights_version
    )
    return item, ("flow", object()), _run_flow  # a key of its own: never merged


def router(engine: Engine, settings: ServeSettings) -> APIRouter:
    """The rollout route over ``engine`` (module docstring)."""
    routes = APIRouter()

    @routes.post("/rollout/generate", response_class=Response)
    async def generate(raw: Request) -> Response:
        started = time.perf_counter()
        request = await read_json_body(raw, RolloutRequest)
        served = engine.get(request.model)
        _check_version(served, request.weights_version)  # early; checked again in the batch
        if served.kind == "token":
            item, key, fn = _token_item(request, served, settings)
        elif served.kind == "flow":
            item, key, fn = _flow_item(request, served, settings)
        else:
            raise RequestError(
                400,
                f"model: {request.model!r} is a {served.kind}; /rollout/generate samples token "
                "and flow models (a workflow's stages are rolled out in process)",
                param="model",
            )
        try:
            result, used = await cancel_on_disconnect(raw, engine.run(request.model, key, item, fn))
        except (TypeError, ValueError) as error:  # the sampler or model refused an input
            raise RequestError(400, str(error)) from None
        trace = result.trace
        if served.kind == "token":
            prompt_tokens = int(trace.prompt_mask.sum())
            tokenizer = used.tokenizer
            made = sum(
                completion_tokens(row, tokenizer) if tokenizer is not None else len(row)
                for row in trace.tokens.tolist()
            )
            usage = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": made,
                "total_tokens": prompt_tokens + made,
            }
            engine.metrics.count("generated_tokens_total", made, model=used.name)
        else:
            usage = {"images": len(trace), "steps": len(trace) * trace.num_steps}
            engine.metrics.count("generated_images_total", len(trace), model=used.name)
        info = {
            "model": used.name,
            **weights_fields(used),
            "usage": usage,
            "timings": {
                "total_ms": round((time.perf_counter() - started) * 1000, 3),
                "compute_ms": round(result.batch_ms, 3),
                "batch_rows": result.batch_rows,
            },
        }
        if result.texts is not None:
            info["texts"] = result.texts
        body = rollout_to_bytes(trace, result.artefacts, info)
        return Response(body, media_type=MEDIA_TYPE, headers=weights_headers(used))

    return routes
