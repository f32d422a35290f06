"""``create_app``: the FastAPI application around an :class:`~.engine.Engine`.

Routes here: ``GET /health`` (no key needed), ``GET /metrics`` (Prometheus text),
``GET /v1/models`` and ``GET /v1/models/{model}``, ``POST /update_weights``; the routers of
:mod:`.text` (``/v1/completions``, ``/v1/chat/completions``), :mod:`.rollout_routes`
(``/rollout/generate``) and :mod:`.media` (``/v1/images/generations``, ``/v1/videos``) are
included (the last two when their modules exist).

Every request passes one ASGI guard first (:class:`_Guard`): the API key
(``Authorization: Bearer KEY``, compared in constant time; 401 otherwise) when the settings
have one, then the body size (``Content-Length`` and the bytes actually received, at most
``max_body_bytes``, ``max_update_bytes`` for ``/update_weights``; 413 otherwise), then the
route, timed into the ``request_latency_seconds`` histogram and counted in
``requests_total{route,status}`` — every answer, 5xx included: an exception no route handled
is answered by the guard itself with a generic 500 (``type: server_error``, a request id; the
exception and its traceback go to the log, logger ``diffusion_rl.serving``, never to the
client). Every error is the OpenAI error JSON (:mod:`.errors`); validation errors are 400
naming the field, JSON bodies are bounded (:mod:`.routing`: ``application/json`` only, else
415; depth, number size, encoding: 400).

``POST /update_weights`` is the one route that reads the file system, and only below
``settings.update_weights_dirs`` (:func:`confined_directory`: the directory and every file in
it, symlinks resolved); with a ``application/octet-stream`` body of safetensors it updates
from tensors, when ``settings.allow_tensor_updates``.
"""

from __future__ import annotations

import hmac
import importlib
import json
import logging
import os
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engine import Engine, ServedModel
from .errors import RequestError, describe_validation
from .routing import (
    ClientDisconnected,
    parse_json_body,
    require_json,
    server_error_body,
    weights_fields,
    weights_headers,
)
from .settings import ServeSettings

__all__ = ["OPTIONAL_ROUTERS", "confined_directory", "confined_files", "create_app"]

logger = logging.getLogger("diffusion_rl.serving")

OPTIONAL_ROUTERS = ("rollout_routes", "media")
"""Modules of this package whose ``router(engine, settings)`` is included when they exist."""
MAX_PATH_CHARS = 4096
MAX_UPDATE_FILES = 100_000


def _resolve(path: Path, param: str = "directory", *, user: bool = False) -> Path:
    """``path`` resolved (symlinks followed; ``~`` expanded when ``user``); a symlink loop or
    an unknown ``~user`` is a 400 naming ``param``, not an exception."""
    try:
        return (path.expanduser() if user else path).resolve()
    except (OSError, RuntimeError) as error:  # RuntimeError: a symlink loop (Python < 3.13)
        raise RequestError(
            400, f"{param}: {str(path)!r} cannot be resolved ({error})", param=param
        ) from None


def _inside(path: Path, allowed: list[Path]) -> bool:
    return any(path == root or path.is_relative_to(root) for root in allowed)


def confined_files(directory: Path, allowed: list[Path], param: str = "directory") -> None:
    """Refuse (403, naming the file) ``directory`` if any entry below it resolves (symlinks
    followed) outside the ``allowed`` roots; a symlinked subdirectory that stays inside is
    walked too (each real directory once)."""
    seen: set[Path] = set()
    pending, count = [directory], 0
    while pending:
        current = pending.pop()
        real = _resolve(current, param)
        if real in seen:
            continue
        seen.add(real)
        try:
            entries = sorted(os.scandir(current), key=lambda entry: entry.name)
        except OSError as error:
            raise RequestError(
                400, f"{param}: {current} cannot be listed ({error.strerror})", param=param
            ) from None
        for entry in entries:
            count += 1
            if count > MAX_UPDATE_FILES:
                raise RequestError(
                    400,
                    f"{param}: more than {MAX_UPDATE_FILES} files below {directory}",
                    param=param,
                )
            path = Path(entry.path)
            target = _resolve(path, param)
            if not _inside(target, allowed):
                raise RequestError(
                    403,
                    f"{param}: {path} resolves to {target}, outside the directories updates "
                    f"may read ({[str(root) for root in allowed]}); copy the file in instead "
                    "of linking it",
                    param=param,
                    code="path_not_allowed",
                )
            if target.is_dir():
                pending.append(path)


def _allowed_roots(settings: ServeSettings) -> list[Path]:
    return [Path(root).expanduser().resolve() for root in settings.update_weights_dirs or ()]


def confined_directory(path: Any, settings: ServeSettings) -> Path:
    """``path`` resolved (symlinks followed) if it lies within one of
    ``settings.update_weights_dirs``, and so does every file below it (:func:`confined_files`)
    and, for a trained pipeline model directory, its recorded base pipeline; RequestError 403
    when updates from directories are off or a path resolves outside them, 400 when it is not
    a directory or is a LoRA directory."""
    roots = settings.update_weights_dirs
    if roots is None:
        raise RequestError(
            403,
            "directory: updates from directories are off; start the server with "
            "--update-weights-dir DIR to allow directories below DIR",
            param="directory",
            code="updates_disabled",
        )
    if not isinstance(path, str) or not path or len(path) > MAX_PATH_CHARS or "\0" in path:
        raise RequestError(
            400,
            f"directory: expected a path of 1 .. {MAX_PATH_CHARS} characters",
            param="directory",
        )
    resolved = _resolve(Path(path), user=True)
    allowed = _allowed_roots(settings)
    if not _inside(resolved, allowed):
        raise RequestError(
            403,
            f"directory: {path!r} is outside the directories updates may read "
            f"({[str(root) for root in allowed]})",
            param="directory",
            code="path_not_allowed",
        )
    if not resolved.is_dir():
        raise RequestError(400, f"directory: {path!r} is not a directory", param="directory")
    from ..models.lora import is_lora_directory

    if is_lora_directory(resolved):
        raise RequestError(
            400,
            f"directory: {path!r} is a LoRA directory, whose base model may lie elsewhere; "
            "export it with 'diffusion-rl export --merge' into an allowed directory",
            param="directory",
        )
    confined_files(resolved, allowed)
    base = _pipeline_base(resolved)
    if base is not None:
        if not _inside(base, allowed):
            raise RequestError(
                403,
                f"directory: {path!r} is a trained pipeline model whose base pipeline {base} "
                "lies outside the directories updates may read; export it with "
                "'diffusion-rl export --merge' into an allowed directory",
                param="directory",
                code="path_not_allowed",
            )
        if not base.is_dir():
            raise RequestError(
                400,
                f"directory: {path!r} is a trained pipeline model whose base pipeline {base} "
                "is not a directory; put it back, or export the model with 'diffusion-rl "
                "export --merge'",
                param="directory",
            )
        confined_files(base, allowed)
    return resolved


def _pipeline_base(directory: Path) -> Path | None:
    """The resolved base pipeline a trained pipeline model directory records, else None."""
    from ..models.flow_pipelines import PIPELINE_MODEL_TYPE
    from ..models.loading import MAX_JSON_BYTES

    config = directory / "config.json"
    try:
        if not config.is_file() or config.stat().st_size > MAX_JSON_BYTES:
            return None
        data = json.loads(config.read_bytes().decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return None  # the loader names what is wrong with it
    if not isinstance(data, dict) or data.get("model_type") != PIPELINE_MODEL_TYPE:
        return None
    base = data.get("base")
    if not isinstance(base, str) or not base or "\0" in base:
        return directory  # the loader refuses the record
    return _resolve(Path(base))  # as the loader reads it (models/flow_pipelines.py)


class UpdateFromDirectory(BaseModel):
    """The JSON body of ``POST /update_weights`` from a directory."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(min_length=1, max_length=256)
    directory: str = Field(min_length=1, max_length=MAX_PATH_CHARS)
    version: int | None = Field(default=None, ge=0, le=2**62)


def _error_response(error: RequestError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


# ----------------------------------------------------------------------------- ASGI guard
async def _send_json(send, status: int, body: dict, headers: list | None = None) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


class _Guard:
    """API key, body size and latency metrics for every HTTP request (module docstring)."""

    def __init__(self, app, engine: Engine, settings: ServeSettings) -> None:
        self.app, self.engine, self.settings = app, engine, settings
        self._key = settings.api_key.encode() if settings.api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = {"code": 500}

        async def send_timed(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                route = getattr(scope.get("route"), "path", "unmatched")
                elapsed = time.perf_counter() - started
                self.engine.metrics.observe("request_latency_seconds", elapsed, route=route)
                self.engine.metrics.count("requests_total", route=route, status=str(status["code"]))

        refusal = self._refuse(scope)
        if refusal is not None:
            error, headers = refusal
            await _send_json(send_timed, error.status, error.body(), headers)
            return
        path = scope.get("path", "")
        limit = (
            self.settings.max_update_bytes
            if path == "/update_weights"
            else self.settings.max_body_bytes
        )
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            try:
                length = int(declared)
            except ValueError:
                length = -1
            if length < 0:
                error = RequestError(400, "Content-Length: not a byte count", param="body")
                await _send_json(send_timed, 400, error.body())
                return
            if length > limit:
                await _send_json(send_timed, 413, self._too_large(length, limit).body())
                return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                await _send_json(send_timed, 413, self._too_large(size, limit).body())
                return
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False
        started_response = {"sent": False}

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        async def send_tracked(message) -> None:
            if message["type"] == "http.response.start":
                started_response["sent"] = True
            await send_timed(message)

        try:
            await self.app(scope, replay, send_tracked)
        except Exception as error:  # noqa: BLE001 (no route handled it: a generic 500)
            if started_response["sent"]:  # a stream that broke: nothing more can be sent
                logger.error("%s %s failed mid-response", scope.get("method"), path, exc_info=error)
                raise
            await _send_json(send_timed, 500, server_error_body(scope, error))

    def _too_large(self, size: int, limit: int) -> RequestError:
        return RequestError(
            413,
            f"body: {size} bytes, more than the limit of {limit} bytes (settings "
            "max_body_bytes / max_update_bytes)",
            param="body",
            code="body_too_large",
        )

    def _refuse(self, scope) -> tuple[RequestError, list] | None:
        if self._key is None or scope.get("path") == "/health":
            return None
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key):
            return None
        what = "missing" if not given else "wrong"
        error = RequestError(
            401,
            f"Authorization: {what} API key; send the header 'Authorization: Bearer KEY'",
            param="Authorization",
            code="invalid_api_key",
        )
        return error, [(b"www-authenticate", b"Bearer")]


# ----------------------------------------------------------------------------- the app
def _include_routers(app: FastAPI, engine: Engine, settings: ServeSettings) -> None:
    from . import text

    app.include_router(text.router(engine, settings))
    for name in OPTIONAL_ROUTERS:
        module_name = f"{__package__}.{name}"
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name == module_name:
                continue  # not written yet (the lead removes this guard)
            raise
        app.include_router(module.router(engine, settings))


def create_app(engine: Engine, settings: ServeSettings) -> FastAPI:
    """The FastAPI app serving ``engine`` under ``settings`` (module docstring). Its lifespan
    starts and stops the engine's schedulers."""

    @asynccontextmanager
    async def lifespan(_app):
        await engine.start()
        try:
            yield
        finally:
            await engine.stop()

    app = FastAPI(
        title="diffusion-rl serve",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.engine, app.state.settings = engine, settings

    @app.exception_handler(RequestError)
    async def _request_error(_request, error: RequestError):
        return _error_response(error)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request, error: RequestValidationError):
        return _error_response(describe_validation(error.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException):
        if error.status_code == 404:
            message = f"{request.url.path}: no such route (see docs/serving.md for the routes)"
        elif error.status_code == 405:
            message = f"{request.method} {request.url.path}: method not allowed"
        else:
            message = str(error.detail)
        wrapped = RequestError(error.status_code, message, param=None)
        return JSONResponse(wrapped.body(), status_code=error.status_code, headers=error.headers)

    @app.exception_handler(ClientDisconnected)
    async def _disconnected(_request, _error):
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _server_error(request: Request, error: Exception):  # (the guard answers first)
        return JSONResponse(server_error_body(request.scope, error), status_code=500)

    @app.get("/health")
    async def health():
        models = {
            name: {
                "kind": engine.get(name).kind,
                "weights_version": engine.get(name).version,
                "weights_checksum": engine.get(name).checksum,
            }
            for name in engine.names()
        }
        return {"status": "ok", "models": models, "queue_depth": engine.queue_depth}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(
            engine.metrics.render(engine.gauges()),
            media_type="text/plain; version=0.0.4; charset=utf-8",
        )

    def model_card(served: ServedModel) -> dict:
        return {
            "id": served.name,
            "object": "model",
            "created": int(engine.started),
            "owned_by": "diffusion-rl",
            "kind": served.kind,
            **weights_fields(served),
        }

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card(engine.get(n)) for n in engine.names()]}

    @app.get("/v1/models/{model}")
    async def get_model(model: str):
        served = engine.get(model)
        return JSONResponse(model_card(served), headers=weights_headers(served))

    @app.post("/update_weights")
    async def update_weights(request: Request):
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        raw = await request.body()
        started = time.perf_counter()
        if content_type == "application/json":
            require_json(request)  # its charset too
            body = parse_json_body(raw, UpdateFromDirectory)
            previous = engine.get(body.model)
            directory = confined_directory(body.directory, settings)
            served = await engine.update_weights(
                body.model, directory=str(directory), version=body.version
            )
            updated = len(served.model.state_dict()) if hasattr(served.model, "state_dict") else 0
        elif content_type == "application/octet-stream":
            model, version = _update_query(request)
            previous = engine.get(model)
            if not settings.allow_tensor_updates:
                raise RequestError(
                    403,
                    "body: updates from tensors are off; start the server with "
                    "--allow-tensor-updates (for a trainer on this machine)",
                    param="body",
                    code="updates_disabled",
                )
            tensors = _read_safetensors(raw)
            served = await engine.update_weights(model, state_dict=tensors, version=version)
            updated = len(tensors)
        else:
            raise RequestError(
                415,
                f"Content-Type: {content_type or 'none'}; send application/json "
                '({"model", "directory"}) or application/octet-stream (a safetensors file '
                "of tensors, ?model=NAME)",
                param="Content-Type",
            )
        record = {
            "model": served.name,
            "previous_version": previous.version,
            "updated_tensors": updated,
            "seconds": round(time.perf_counter() - started, 6),
            **weights_fields(served),
        }
        return JSONResponse(record, headers=weights_headers(served))

    _include_routers(app, engine, settings)
    app.add_middleware(_Guard, engine=engine, settings=settings)
    return app


def _update_query(request: Request) -> tuple[str, int | None]:
    params = request.query_params
    unknown = sorted(set(params) - {"model", "version"})
    if unknown:
        raise RequestError(400, f"{unknown[0]}: unknown query parameter", param=unknown[0])
    model = params.get("model")
    if not model:
        raise RequestError(
            400, "model: missing; name the model to update (?model=NAME)", param="model"
        )
    version = params.get("version")
    if version is None:
        return model, None
    if not (version.isascii() and version.isdigit()) or len(version) > 18:
        raise RequestError(
            400, f"version: expected a non-negative integer, got {version!r}", param="version"
        )
    return model, int(version)


def _read_safetensors(raw: bytes) -> dict:
    import safetensors.torch

    if not raw:
        raise RequestError(400, "body: empty; send a safetensors file of tensors", param="body")
    try:
        tensors = safetensors.torch.load(raw)
    except Exception as error:  # noqa: BLE001 (any parse failure is the body's fault)
        raise RequestError(
            400, f"body: not a safetensors file ({error})", param="body", code="invalid_tensors"
        ) from None
    if not tensors:
        raise RequestError(400, "body: the safetensors file holds no tensors", param="body")
    return tensors
