"""Helpers every route module shares (text, rollout, media): the weights stamp of a
response, a JSON body parsed with errors naming the field, and cancellation when the client
goes away. Import these from here (not from :mod:`.app`, which includes the routers)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError

from .engine import ServedModel
from .errors import RequestError, describe_validation

__all__ = [
    "ClientDisconnected",
    "cancel_on_disconnect",
    "parse_json_body",
    "weights_fields",
    "weights_headers",
]


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


def parse_json_body(raw: bytes, schema: type[BaseModel]) -> BaseModel:
    """``raw`` (a request body) as ``schema``, every failure a 400 naming the field."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RequestError(
            400, f"body: malformed JSON ({error}); send a JSON object", param="body"
        ) from None
    if not isinstance(data, dict):
        raise RequestError(
            400, f"body: expected a JSON object, got {type(data).__name__}", param="body"
        )
    try:
        return schema.model_validate(data)
    except ValidationError as error:
        raise describe_validation(error.errors()) from None
