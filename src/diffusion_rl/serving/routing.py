"""Helpers every route module shares (text, rollout, media): the weights stamp of a
response, a JSON body read and parsed with errors naming the field, and cancellation when the
client goes away. Import these from here (not from :mod:`.app`, which includes the routers).

JSON bodies (:func:`read_json_body`, :func:`parse_json_body`, :func:`loads_bounded`) are
bounded before any schema sees them: ``Content-Type: application/json`` (415 otherwise: a web
page cannot send that without a CORS preflight, which this server never grants), UTF-8 text,
at most :data:`MAX_JSON_DEPTH` nested arrays / objects, number literals of at most
:data:`MAX_NUMBER_CHARS` characters (Python refuses integers of more than 4300 digits, and
converting long ones is quadratic), no lone UTF-16 surrogates in strings (they cannot be
encoded back). Each refusal is a 400 naming the body or the field.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError

from .engine import ServedModel
from .errors import RequestError, describe_validation, error_body

__all__ = [
    "MAX_JSON_DEPTH",
    "MAX_NUMBER_CHARS",
    "ClientDisconnected",
    "cancel_on_disconnect",
    "loads_bounded",
    "parse_json_body",
    "read_json_body",
    "require_json",
    "server_error_body",
    "weights_fields",
    "weights_headers",
]

MAX_JSON_DEPTH = 32
"""The deepest nesting of arrays and objects a JSON body may have (the routes need 4)."""
MAX_NUMBER_CHARS = 64
"""The longest number literal a JSON body may hold (a seed below 2^63 has 19 digits)."""

logger = logging.getLogger("diffusion_rl.serving")


def server_error_body(scope, error: BaseException) -> dict:
    """The body of a 500: a generic message with a request id; ``error`` (with its traceback)
    goes to the log under that id, never to the client."""
    ident = uuid.uuid4().hex[:12]
    logger.error(
        "request %s: %s %s failed: %s: %s",
        ident,
        scope.get("method"),
        scope.get("path"),
        type(error).__name__,
        error,
        exc_info=error,
    )
    return error_body(
        f"internal server error (request {ident}); the server log has the details",
        "server_error",
        code="internal_error",
    )


def weights_headers(served: ServedModel) -> dict[str, str]:
    """``X-Weights-Version`` / ``X-Weights-Checksum`` of the weights that served a response."""
    return {"X-Weights-Version": str(served.version), "X-Weights-Checksum": served.checksum}


def weights_fields(served: ServedModel) -> dict[str, Any]:
    """The JSON fields every response carries: ``weights_version``, ``weights_checksum``."""
    return {"weights_version": served.version, "weights_checksum": served.checksum}


class ClientDisconnected(Exception):
    """The client closed the connection before its response was ready."""


async def cancel_on_disconnect(request: Request, awaitable):
    """Await ``awaitable`` (e.g. :meth:`Engine.run`), cancelling it if the client goes away
    first (then :class:`ClientDisconnected`): a queued item is dropped, not computed."""
    task = asyncio.ensure_future(awaitable)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    raise ClientDisconnected()


def require_json(request: Request) -> None:
    """Refuse (415, naming ``Content-Type``) a body that is not ``application/json``
    (parameters allowed: ``charset=utf-8``)."""
    given = request.headers.get("content-type", "")
    media, _, parameters = given.partition(";")
    media = media.strip().lower()
    charset = "utf-8"
    for parameter in parameters.split(";"):
        key, _, value = parameter.partition("=")
        if key.strip().lower() == "charset":
            charset = value.strip().strip('"').lower()
    if media != "application/json" or charset not in ("utf-8", "utf8"):
        shown = given.strip()[:80] or "none"
        raise RequestError(
            415,
            f"Content-Type: {shown!r}; this route takes a JSON body: send 'Content-Type: "
            "application/json' (UTF-8)",
            param="Content-Type",
            code="unsupported_media_type",
        )


async def read_json_body(request: Request, schema: type[BaseModel]) -> BaseModel:
    """The body of ``request`` as ``schema``: :func:`require_json`, then
    :func:`parse_json_body`."""
    require_json(request)
    return parse_json_body(await request.body(), schema)


class _LongNumber:
    """A number literal longer than :data:`MAX_NUMBER_CHARS`, found by the parse hooks and
    refused once its field path is known."""

    __slots__ = ("length",)

    def __init__(self, text: str) -> None:
        self.length = len(text)


def _number(convert):
    def parse(text: str):
        return _LongNumber(text) if len(text) > MAX_NUMBER_CHARS else convert(text)

    return parse


def _path(parts: list) -> str:
    return ".".join(str(part) for part in parts)


def _check_value(data: Any) -> None:
    """Walk the parsed JSON ``data`` (iteratively) and refuse nesting beyond
    :data:`MAX_JSON_DEPTH`, long numbers and lone surrogates, naming the field."""
    stack: list[tuple[Any, list, int]] = [(data, [], 0)]
    while stack:
        value, where, depth = stack.pop()
        if isinstance(value, _LongNumber):
            field = _path(where) or "body"
            raise RequestError(
                400,
                f"{field}: a number of {value.length} characters, more than the "
                f"{MAX_NUMBER_CHARS} a JSON number may have here",
                param=field,
                code="invalid_value",
            )
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                field = _path(where) or "body"
                raise RequestError(
                    400,
                    f"{field}: holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
                    "escape), which is not text; send valid Unicode",
                    param=field,
                    code="invalid_value",
                ) from None
            continue
        if isinstance(value, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                raise RequestError(
                    400,
                    f"body: JSON nested more than {MAX_JSON_DEPTH} levels deep (at "
                    f"{_path(where)!r}); the routes take at most a few levels",
                    param="body",
                    code="invalid_json",
                )
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str) and not isinstance(value, list):
                    stack.append((key, where, depth))  # keys are strings too
                stack.append((item, [*where, key], depth + 1))


def loads_bounded(raw: bytes) -> Any:
    """``raw`` (a request body) as JSON within the bounds of the module docstring; every
    refusal a 400 naming the body or the field."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise RequestError(
            400,
            f"body: not UTF-8 text (byte {error.start}: {error.reason}); send JSON as UTF-8",
            param="body",
            code="invalid_json",
        ) from None
    try:
        data = json.loads(text, parse_int=_number(int), parse_float=_number(float))
    except RecursionError:
        raise RequestError(
            400,
            f"body: JSON nested more than {MAX_JSON_DEPTH} levels deep; the routes take at most "
            "a few levels",
            param="body",
            code="invalid_json",
        ) from None
    except (json.JSONDecodeError, ValueError) as error:
        raise RequestError(
            400,
            f"body: malformed JSON ({error}); send a JSON object",
            param="body",
            code="invalid_json",
        ) from None
    _check_value(data)
    return data


def parse_json_body(raw: bytes, schema: type[BaseModel]) -> BaseModel:
    """``raw`` (a request body) as ``schema``, every failure a 400 naming the field (the
    bounds of :func:`loads_bounded` first)."""
    data = loads_bounded(raw)
    if not isinstance(data, dict):
        raise RequestError(
            400, f"body: expected a JSON object, got {type(data).__name__}", param="body"
        )
    try:
        return schema.model_validate(data)
    except ValidationError as error:
        raise describe_validation(error.errors()) from None
    except RecursionError:  # a schema walking a deep value (bounded above; belt and braces)
        raise RequestError(400, "body: JSON nested too deeply", param="body") from None
