"""``POST /v1/images/generations`` and the ``/v1/videos`` jobs, on the flow sampler.

Images. A request is sampled as ``diffusion-rl generate`` samples a flow model: the model's
recorded sampler as ODE (``mode: ode``, no shared group noise) with the request's
``num_inference_steps`` / ``guidance_scale``, image ``i`` seeded ``seed + i``,
:func:`~diffusion_rl.sampling.flow.sample_flow`; a ``negative_prompt`` is the condition of
the classifier-free-guidance branch (``model.encode_prompts``) instead of the null prompt.
``size`` must be the model's own (``"WxH"``; a built-in FlowDiT and a loaded diffusers
pipeline make one resolution). Images are PNG, base64 (``response_format: b64_json``;
``url`` is refused: nothing is stored). Pixels are ``round(255 · clamp(x, 0, 1))``, as the
CLI's grids.

Batch invariance. Requests with equal ``(size, steps, guidance, negative prompt, sampler)``
are merged, and every velocity forward of a merged batch runs on exactly ``forward_rows``
rows (:func:`forward_rows`: the recorded ``micro_batch_size``, else :data:`FORWARD_ROWS`),
the last group padded with copies of the last row (discarded). A row's output then depends
only on its own prompt and seed, never on its batch mates or its position (GEMM kernels pick
their blocking by the row count, so an unpadded batch of another size could differ in the
last bits): a request's images are bitwise the same served alone or merged. A request of
``forward_rows`` images is bitwise the CLI's ``generate --samples forward_rows``.

Videos. ``POST /v1/videos`` creates an asynchronous job for a video model (a flow model
whose rows are clips) or a workflow (``kind == "workflow"``, e.g. text-to-image-to-video);
``input_reference`` (a base64 PNG of the model's frame size) makes it image-to-video: the
image is the first frame (a workflow then skips its first stage and conditions the stage
that takes the first stage's output on it). A job runs alone (no merging), exactly as
``diffusion-rl generate --workflow`` runs (row ``i`` seeded ``seed + i``), so its
``?variant=tensors`` content is bitwise the CLI's safetensors file. Status moves
``queued → in_progress → completed | failed`` (a failed job names its error). At most
:data:`MAX_VIDEO_JOBS` jobs are kept in memory; a new job evicts the oldest finished one,
and when every kept job is still running the create is refused with 503 and ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import re
import secrets
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..sampling.flow import FlowSamplerConfig, sample_flow
from .engine import Engine, ServedModel
from .errors import RequestError, busy, describe_validation
from .routing import (
    cancel_on_disconnect,
    read_json_body,
    server_error_body,
    weights_fields,
    weights_headers,
)
from .settings import ServeSettings

__all__ = [
    "FORWARD_ROWS",
    "MAX_VIDEO_JOBS",
    "ImageRequest",
    "VideoRequest",
    "encode_png",
    "forward_rows",
    "image_sampler",
    "router",
    "sample_images",
]

MAX_SEED = 2**63 - 1
FORWARD_ROWS = 8
"""Rows per velocity forward when the model records no ``micro_batch_size``."""
MAX_VIDEO_JOBS = 64
"""Video jobs kept in memory (queued, running and finished together)."""
MAX_PROMPT_CHARS = 4000
MAX_REFERENCE_BYTES = 8 << 20
_SIZE = re.compile(r"^([1-9][0-9]{0,5})x([1-9][0-9]{0,5})$")
_FIELDS = {"num_steps": "num_inference_steps", "guidance_scale": "guidance_scale"}


class _MediaFields(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(min_length=1, max_length=256)
    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    n: int = Field(default=1, ge=1)
    size: str | None = Field(default=None, max_length=16)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    num_inference_steps: int | None = Field(default=None, ge=1)
    guidance_scale: float | None = Field(default=None, ge=0.0, le=100.0, allow_inf_nan=False)
    user: str | None = Field(default=None, max_length=256)


class ImageRequest(_MediaFields):
    """``POST /v1/images/generations`` (OpenAI's fields plus the sampler's)."""

    response_format: Literal["b64_json", "url"] = "b64_json"
    negative_prompt: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    quality: Literal["auto", "standard"] | None = None
    output_format: Literal["png"] | None = None


class VideoRequest(_MediaFields):
    """``POST /v1/videos``: ``input_reference`` is a base64 PNG (image-to-video)."""

    input_reference: str | None = Field(default=None, max_length=MAX_REFERENCE_BYTES)
    seconds: str | None = Field(default=None, max_length=8)


# ----------------------------------------------------------------------------- sampling
def model_size(model: Any) -> tuple[int, int]:
    """``(width, height)`` of a flow model's images (or frames)."""
    shape = getattr(model, "output_shape", None) or model.latent_shape
    return int(shape[-1]), int(shape[-2])


def makes_clips(model: Any) -> bool:
    """Whether a flow model's rows are clips (``[F, 3, H, W]`` outputs)."""
    shape = getattr(model, "output_shape", None) or getattr(model, "latent_shape", ())
    return len(shape) == 4


def image_sampler(info: dict, overrides: dict[str, Any]) -> FlowSamplerConfig:
    """The model directory's recorded sampler as served (ODE, no group noise) with
    ``overrides`` (``num_steps``, ``guidance_scale``), as the CLI's ``generate``; a refused
    value is a 400 naming the request field."""
    fixed = {"mode": "ode", "share_group_noise": False}
    try:
        return FlowSamplerConfig(**{**dict(info.get("sampler") or {}), **overrides, **fixed})
    except ValidationError as error:
        problem = describe_validation(error.errors())
        if problem.param in overrides:
            name = _FIELDS[problem.param]
            message = problem.message.replace(problem.param, name, 1)
            raise RequestError(400, message, param=name) from None
        raise RequestError(
            500, f"the model's recorded sampler is invalid: {problem.message}", param=None
        ) from None


def forward_rows(sampler: FlowSamplerConfig) -> int:
    """Rows per velocity forward in serving: the sampler's ``micro_batch_size`` or
    :data:`FORWARD_ROWS` (module docstring: what makes rows batch-invariant)."""
    return sampler.micro_batch_size or FORWARD_ROWS


def sample_images(
    model: Any,
    prompts: list[str],
    seeds: list[int],
    sampler: FlowSamplerConfig,
    negative_prompts: list[str | None] | None = None,
) -> torch.Tensor:
    """Float ``[B, 3, H, W]`` (or clips) in ``[0, 1]``: :func:`sample_flow` with every
    forward on exactly :func:`forward_rows` rows (padding rows are copies of the last row,
    dropped), so row ``b`` depends only on ``prompts[b]``, ``seeds[b]`` and its negative
    prompt (None: the null prompt)."""
    width = forward_rows(sampler)
    count = len(prompts)
    pad = (-count) % width
    prompts = prompts + [prompts[-1]] * pad
    seeds = list(seeds) + [seeds[-1]] * pad
    negatives = list(negative_prompts or [None] * count)
    negatives += [negatives[-1]] * pad
    uncond = None
    if sampler.guidance_scale != 1.0 and any(n is not None for n in negatives):
        empty = model.empty_condition(1)
        parts = [model.encode_prompts([n]) if n is not None else empty for n in negatives]
        uncond = {key: torch.cat([p[key] for p in parts]) for key in parts[0]}
    config = sampler.model_copy(update={"micro_batch_size": width})
    with torch.no_grad():
        sample = sample_flow(model, prompts, config, seeds=seeds, uncond=uncond)
    return sample.images.float()[:count].cpu()


def encode_png(image: torch.Tensor) -> bytes:
    """PNG bytes of one float ``[3, H, W]`` image in ``[0, 1]`` (pixels
    ``round(255 · clamp(x, 0, 1))``)."""
    from PIL import Image

    pixels = (image.detach().float().cpu().clamp(0, 1) * 255).round().to(torch.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels.permute(1, 2, 0).contiguous().numpy()).save(buffer, format="PNG")
    return buffer.getvalue()


def _decode_png(data: str, shape: tuple[int, int, int]) -> torch.Tensor:
    """A base64 PNG (optionally a ``data:image/png;base64,`` URL) as float ``[3, H, W]``."""
    from PIL import Image, UnidentifiedImageError

    text = data.split(",", 1)[1] if data.startswith("data:") else data
    try:
        raw = base64.b64decode(text, validate=True)
        with Image.open(io.BytesIO(raw)) as opened:
            if opened.format != "PNG":
                raise ValueError(f"a {opened.format} image")
            image = opened.convert("RGB")
    except (binascii.Error, ValueError, UnidentifiedImageError, OSError) as error:
        raise RequestError(
            400,
            f"input_reference: not a base64 PNG image ({error}); send the PNG's bytes in base64",
            param="input_reference",
        ) from None
    _, height, width = shape
    if image.size != (width, height):
        raise RequestError(
            400,
            f"input_reference: a {image.size[0]}x{image.size[1]} image; this model's first "
            f"frame is {width}x{height}",
            param="input_reference",
        )
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    return pixels.reshape(height, width, 3).permute(2, 0, 1).float() / 255


# ----------------------------------------------------------------------------- checks
def _check_common(request: _MediaFields, settings: ServeSettings, limit: int, word: str) -> int:
    if request.n > limit:
        raise RequestError(400, f"n: {request.n} {word} exceeds the limit {limit}", param="n")
    steps = request.num_inference_steps
    if steps is not None and steps > settings.max_steps:
        raise RequestError(
            400,
            f"num_inference_steps: {steps} exceeds the limit {settings.max_steps}",
            param="num_inference_steps",
        )
    seed = request.seed if request.seed is not None else secrets.randbelow(2**31)
    if seed + request.n - 1 > MAX_SEED:
        raise RequestError(
            400,
            f"seed: images use seeds seed .. seed + {request.n - 1}, which must stay <= {MAX_SEED}",
            param="seed",
        )
    return seed


def _check_size(size: str | None, model: Any, settings: ServeSettings) -> None:
    if size is None or size == "auto":
        return
    match = _SIZE.match(size)
    if match is None:
        raise RequestError(
            400, f"size: expected 'WIDTHxHEIGHT' such as '16x16', got {size!r}", param="size"
        )
    width, height = int(match.group(1)), int(match.group(2))
    if max(width, height) > settings.max_image_size:
        raise RequestError(
            400,
            f"size: {size} exceeds the limit of {settings.max_image_size} pixels a side",
            param="size",
        )
    own = model_size(model)
    if (width, height) != own:
        raise RequestError(
            400,
            f"size: {size} is not a size this model makes; it makes {own[0]}x{own[1]} "
            "(omit size for it)",
            param="size",
        )


def _check_prompt(model: Any, prompt: str, field: str) -> None:
    try:
        model.encode_prompts([prompt])
    except ValueError as error:
        message = str(error).replace("encode_prompts: ", "")
        raise RequestError(400, f"{field}: {message}", param=field) from None


def _overrides(request: _MediaFields) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if request.num_inference_steps is not None:
        out["num_steps"] = request.num_inference_steps
    if request.guidance_scale is not None:
        out["guidance_scale"] = float(request.guidance_scale)
    return out


# ----------------------------------------------------------------------------- images
@dataclass(eq=False)
class _ImageItem:
    prompt: str
    seeds: list[int]
    sampler: FlowSamplerConfig
    negative_prompt: str | None

    @property
    def rows(self) -> int:
        return len(self.seeds)


def _generate_images(served: ServedModel, items: list[_ImageItem]) -> list[dict]:
    """The engine's batch function: every item's rows in one padded sampler call."""
    started = time.perf_counter()
    prompts = [item.prompt for item in items for _ in item.seeds]
    seeds = [seed for item in items for seed in item.seeds]
    negatives = [item.negative_prompt for item in items for _ in item.seeds]
    images = sample_images(served.model, prompts, seeds, items[0].sampler, negatives)
    finished, out, offset = time.perf_counter(), [], 0
    for item in items:
        out.append(
            {
                "images": images[offset : offset + item.rows],
                "started": started,
                "finished": finished,
                "batch_rows": len(seeds),
            }
        )
        offset += item.rows
    return out


def _timings(result: dict, submitted: float) -> dict:
    return {
        "queue_ms": round(1000 * (result["started"] - submitted), 3),
        "compute_ms": round(1000 * (result["finished"] - result["started"]), 3),
        "total_ms": round(1000 * (time.perf_counter() - submitted), 3),
        "batch_rows": result["batch_rows"],
    }


def _flow_model(engine: Engine, name: str, route: str) -> ServedModel:
    served = engine.get(name)
    if served.kind != "flow":
        raise RequestError(
            400,
            f"model: {name!r} is a {served.kind} model; {route} needs a flow (image) model",
            param="model",
        )
    return served


# ----------------------------------------------------------------------------- videos
@dataclass(eq=False)
class _Job:
    id: str
    model: str
    prompt: str
    seed: int
    n: int
    created_at: int
    status: str = "queued"
    completed_at: int | None = None
    error: dict | None = None
    served: ServedModel | None = None
    clips: torch.Tensor | None = None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    timings: dict | None = None
    task: asyncio.Task | None = None

    def record(self) -> dict:
        done = self.status == "completed"
        out = {
            "id": self.id,
            "object": "video",
            "model": self.model,
            "status": self.status,
            "progress": 100 if done else 0,
            "created_at": self.created_at,
            "completed_at": self.completed_at,
            "prompt": self.prompt,
            "seed": self.seed,
            "n": self.n,
            "error": self.error,
        }
        if self.clips is not None:
            frames, _, height, width = self.clips.shape[1:]
            out.update(size=f"{width}x{height}", frames=frames, clips=self.clips.shape[0])
            out["usage"] = {"videos": int(self.clips.shape[0]), "frames": int(frames)}
        if self.timings is not None:
            out["timings"] = self.timings
        if self.served is not None:
            out.update(weights_fields(self.served))
        return out


@dataclass(eq=False)
class _VideoItem:
    job: _Job
    prompts: list[str]
    seeds: list[int]
    overrides: dict[str, Any]
    image: torch.Tensor | None


def _video_stage(workflow: Any):
    """``(index, stage)`` of the workflow stage an input image conditions: the one whose
    input is the first stage (image-to-video skips the first stage)."""
    stages = workflow.spec.stages
    first = stages[0].name
    for index, stage in enumerate(stages):
        if stage.input == first:
            return index, stage
    return None, None


def _run_video(served: ServedModel, items: list[_VideoItem]) -> list[dict]:
    """One job (never merged): the clips and the tensors ``generate --workflow`` writes."""
    (item,) = items
    item.job.status = "in_progress"
    started = time.perf_counter()
    with torch.no_grad():
        if served.kind == "workflow":
            clips, tensors = _run_workflow(served.model, item)
        else:
            model = served.model
            config = image_sampler(served.info, item.overrides)
            cond = uncond = None
            if item.image is not None:
                images = item.image.expand(len(item.prompts), *item.image.shape)
                cond = model.encode_conditioning(item.prompts, images)
                if config.guidance_scale != 1.0:
                    uncond = model.empty_conditioning(images)
            sample = sample_flow(
                model, item.prompts, config, seeds=item.seeds, cond=cond, uncond=uncond
            )
            clips = sample.images.float().cpu()
            tensors = {"video": clips.contiguous(), "video.seeds": torch.tensor(item.seeds)}
    finished = time.perf_counter()
    return [{"clips": clips, "tensors": tensors, "started": started, "finished": finished}]


def _run_workflow(workflow: Any, item: _VideoItem):
    from ..workflows import stage_seed

    samplers = {}
    if item.overrides:
        samplers = {
            s.name: s.sampler.model_copy(update=item.overrides) for s in workflow.spec.stages
        }
    if item.image is None:
        run = workflow.run(item.prompts, item.seeds, samplers=samplers)
        tensors = {name: out.artefact.contiguous() for name, out in run.stages.items()}
        tensors.update(
            {f"{name}.seeds": torch.tensor(out.seeds) for name, out in run.stages.items()}
        )
        return run.final.artefact.cpu(), tensors
    index, stage = _video_stage(workflow)
    model = workflow.models[stage.name]
    config = samplers.get(stage.name, stage.sampler)
    k = stage.fanout
    examples = workflow._examples(item.prompts)
    texts = workflow._prompts(stage, [examples[p] for p in range(len(examples)) for _ in range(k)])
    seeds = [stage_seed(seed, index, m) for seed in item.seeds for m in range(k)]
    images = item.image.expand(len(texts), *item.image.shape)
    cond = model.encode_conditioning(texts, images)
    uncond = model.empty_conditioning(images) if config.guidance_scale != 1.0 else None
    sample = sample_flow(model, texts, config, seeds=seeds, cond=cond, uncond=uncond)
    clips = sample.images.float().cpu()
    return clips, {stage.name: clips.contiguous(), f"{stage.name}.seeds": torch.tensor(seeds)}


def _save_gif(clips: torch.Tensor) -> bytes:
    from ..plots import save_video_gif

    with tempfile.TemporaryDirectory() as scratch:
        path = save_video_gif(clips, Path(scratch) / "clips.gif", nrow=min(8, clips.shape[0]))
        return path.read_bytes()


# ----------------------------------------------------------------------------- router
def router(engine: Engine, settings: ServeSettings) -> APIRouter:
    """The media routes (module docstring) on ``engine``."""
    api = APIRouter()
    jobs: dict[str, _Job] = {}

    @api.post("/v1/images/generations")
    async def images(request: Request):
        submitted = time.perf_counter()
        body = await read_json_body(request, ImageRequest)
        if body.response_format == "url":
            raise RequestError(
                400,
                "response_format: 'url' is not supported (the server stores nothing); use "
                "'b64_json'",
                param="response_format",
            )
        served = _flow_model(engine, body.model, "/v1/images/generations")
        model = served.model
        if makes_clips(model):
            raise RequestError(
                400,
                f"model: {body.model!r} makes videos; create a job with POST /v1/videos",
                param="model",
            )
        seed = _check_common(body, settings, settings.max_images, "images")
        _check_size(body.size, model, settings)
        _check_prompt(model, body.prompt, "prompt")
        if body.negative_prompt is not None:
            _check_prompt(model, body.negative_prompt, "negative_prompt")
        sampler = image_sampler(served.info, _overrides(body))
        seeds = [seed + i for i in range(body.n)]
        key = ("images", model_size(model), sampler.model_dump_json(), body.negative_prompt)
        item = _ImageItem(body.prompt, seeds, sampler, body.negative_prompt)
        result, served = await cancel_on_disconnect(
            request, engine.run(body.model, key, item, _generate_images)
        )
        encoded = [encode_png(image) for image in result["images"]]
        engine.metrics.count("generated_images_total", body.n, model=served.name)
        width, height = model_size(model)
        record = {
            "created": int(time.time()),
            "data": [
                {"b64_json": base64.b64encode(png).decode(), "revised_prompt": None, "seed": s}
                for png, s in zip(encoded, seeds)
            ],
            "model": served.name,
            "size": f"{width}x{height}",
            "output_format": "png",
            "seed": seed,
            "usage": {"images": body.n, "num_inference_steps": sampler.num_steps},
            "timings": _timings(result, submitted),
            **weights_fields(served),
        }
        return JSONResponse(record, headers=weights_headers(served))

    def job_of(video_id: str) -> _Job:
        job = jobs.get(video_id)
        if job is None:
            raise RequestError(
                404,
                f"video_id: no video job {video_id!r} (GET /v1/videos lists them)",
                param="video_id",
                code="video_not_found",
            )
        return job

    def make_room() -> None:
        if len(jobs) < MAX_VIDEO_JOBS:
            return
        finished = [j for j in jobs.values() if j.status in ("completed", "failed")]
        if not finished:
            raise busy(
                f"{MAX_VIDEO_JOBS} video jobs are running or queued",
                "too_many_jobs",
                settings.retry_after_s,
            )
        del jobs[finished[0].id]

    async def run_job(job: _Job, item: _VideoItem) -> None:
        submitted = time.perf_counter()
        try:
            result, served = await engine.run(job.model, ("video", job.id), item, _run_video)
        except asyncio.CancelledError:
            raise
        except RequestError as error:
            job.status, job.error = "failed", {"message": error.message, "code": error.code}
        except Exception as error:  # noqa: BLE001 (the job's own failure, reported in it)
            job.status = "failed"  # generic, as a 500's body: the detail goes to the log only
            message = server_error_body({"method": "POST", "path": "/v1/videos"}, error)
            job.error = {"message": message["error"]["message"], "code": "server_error"}
        else:
            job.clips, job.tensors, job.served = result["clips"], result["tensors"], served
            job.timings = {**_timings({**result, "batch_rows": job.n}, submitted)}
            job.status = "completed"
            engine.metrics.count("generated_images_total", job.clips.shape[0], model=served.name)
        job.completed_at = int(time.time())

    @api.post("/v1/videos")
    async def create_video(request: Request):
        body = await read_json_body(request, VideoRequest)
        served = engine.get(body.model)
        if served.kind == "token" or (served.kind == "flow" and not makes_clips(served.model)):
            raise RequestError(
                400,
                f"model: {body.model!r} is a {served.kind} model that makes no videos; serve a "
                "video model or a workflow",
                param="model",
            )
        seed = _check_common(body, settings, settings.max_images, "videos")
        if body.seconds is not None:
            raise RequestError(
                400,
                "seconds: the clip length is the model's (its frame count); omit seconds",
                param="seconds",
            )
        image, model = None, served.model
        if served.kind == "workflow":
            _, stage = _video_stage(model)
            first = model.models[model.spec.stages[0].name]
            if body.input_reference is not None and stage is None:
                raise RequestError(
                    400,
                    "input_reference: this workflow has no stage conditioned on its first "
                    "stage's image",
                    param="input_reference",
                )
            target = model.models[stage.name] if stage is not None else first
            _check_size(body.size, target, settings)
            try:
                examples = model._examples([body.prompt])
                for spec in model.spec.stages if body.input_reference is None else [stage]:
                    if spec.input is None:
                        model.models[spec.name].encode_prompts(model._prompts(spec, examples))
            except ValueError as error:
                message = str(error).replace("encode_prompts: ", "")
                raise RequestError(400, f"prompt: {message}", param="prompt") from None
            if body.input_reference is not None:
                image = _decode_png(body.input_reference, tuple(target.image_shape))
        else:
            _check_size(body.size, model, settings)
            if body.input_reference is not None:
                if not callable(getattr(model, "encode_conditioning", None)):
                    raise RequestError(
                        400,
                        f"input_reference: {body.model!r} is a text-to-video model; it takes "
                        "no input image",
                        param="input_reference",
                    )
                image = _decode_png(body.input_reference, tuple(model.image_shape))
            elif callable(getattr(model, "encode_conditioning", None)):
                raise RequestError(
                    400,
                    f"input_reference: {body.model!r} is an image-to-video model; send the "
                    "first frame as a base64 PNG",
                    param="input_reference",
                )
            else:
                _check_prompt(model, body.prompt, "prompt")
        make_room()
        job = _Job(
            id=f"video_{uuid.uuid4().hex[:24]}",
            model=body.model,
            prompt=body.prompt,
            seed=seed,
            n=body.n,
            created_at=int(time.time()),
        )
        prompts = [body.prompt] * body.n
        item = _VideoItem(job, prompts, [seed + i for i in range(body.n)], _overrides(body), image)
        jobs[job.id] = job
        job.task = asyncio.ensure_future(run_job(job, item))
        return JSONResponse(job.record(), headers=weights_headers(served))

    @api.get("/v1/videos")
    async def list_videos():
        return {"object": "list", "data": [job.record() for job in jobs.values()]}

    @api.get("/v1/videos/{video_id}")
    async def get_video(video_id: str):
        return job_of(video_id).record()

    @api.delete("/v1/videos/{video_id}")
    async def delete_video(video_id: str):
        job = job_of(video_id)
        if job.task is not None and not job.task.done():
            job.task.cancel()  # a queued item is dropped; a running one finishes unseen
        del jobs[video_id]
        return {"id": video_id, "object": "video.deleted", "deleted": True}

    @api.get("/v1/videos/{video_id}/content")
    async def video_content(video_id: str, request: Request):
        job = job_of(video_id)
        variant = request.query_params.get("variant", "video")
        if variant not in ("video", "tensors"):
            raise RequestError(
                400,
                f"variant: {variant!r}; use 'video' (a GIF) or 'tensors' (safetensors of the "
                "exact frames)",
                param="variant",
            )
        if job.status != "completed":
            raise RequestError(
                409,
                f"video_id: job {video_id} is {job.status}; its content is ready when the "
                "status is completed",
                param="video_id",
                code="video_not_ready",
            )
        headers = weights_headers(job.served)
        if variant == "tensors":
            import safetensors.torch

            data = safetensors.torch.save(job.tensors, metadata={"model": job.model})
            return Response(data, media_type="application/octet-stream", headers=headers)
        data = await asyncio.get_running_loop().run_in_executor(None, _save_gif, job.clips)
        return Response(data, media_type="image/gif", headers=headers)

    return api
