"""Request errors of the server: one exception type, one OpenAI-style JSON body.

Every refusal a route makes is a :class:`RequestError` carrying its HTTP status, a message
that names the field (``param``) and how to fix it, and an optional machine ``code``; the app
(:mod:`.app`) turns it into::

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

with ``type`` chosen by the status (:data:`ERROR_TYPES`). FastAPI's validation errors are
turned into the same body with status 400 by :func:`describe_validation` (``param``: the
dotted path of the field, without FastAPI's ``body`` prefix).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ERROR_TYPES", "RequestError", "describe_validation", "error_body"]

ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_overloaded",
    504: "timeout_error",
}
"""HTTP status → the error ``type`` in the body (any other 4xx: invalid_request_error;
5xx: server_error)."""


class RequestError(Exception):
    """A request the server refuses (4xx) or could not serve (5xx).

    Args:
        status: the HTTP status (400 .. 599).
        message: what is wrong, naming the field and the fix.
        param: the request field at fault (dotted path), or None.
        code: a short machine-readable code (``"queue_full"``, ``"model_not_found"``, ...).
        headers: extra response headers (a 503 carries ``Retry-After``).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        if not isinstance(status, int) or not 400 <= status <= 599:
            raise ValueError(f"status: expected an HTTP error status 400 .. 599, got {status!r}")
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    @property
    def type(self) -> str:
        if self.status in ERROR_TYPES:
            return ERROR_TYPES[self.status]
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def busy(what: str, code: str, retry_after_s: int) -> RequestError:
    """The 503 of a full queue: ``what`` is busy, with ``Retry-After`` in seconds."""
    return RequestError(
        503,
        f"{what}; retry after {retry_after_s} s",
        code=code,
        headers={"Retry-After": str(retry_after_s)},
    )


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The OpenAI error object ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _field_path(loc: Sequence[Any]) -> str:
    parts = list(loc)
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    return ".".join(str(part) for part in parts)


def describe_validation(errors: Sequence[Mapping[str, Any]]) -> RequestError:
    """A 400 :class:`RequestError` for FastAPI / pydantic validation ``errors`` (their first
    item; the message says how many more there are): ``param`` is the dotted field path and
    the message names it, the value received and what is expected."""
    item = errors[0]
    kind, ctx, value = item.get("type", ""), item.get("ctx") or {}, item.get("input")
    path = _field_path(item.get("loc", ()))
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    if kind == "json_invalid":
        where = ctx.get("error", "")
        message = f"body: malformed JSON ({where}); send a JSON object"
        return RequestError(400, message + more, param="body", code="invalid_json")
    if kind == "missing" and not path:
        return RequestError(400, "body: missing; send a JSON object", param="body")
    if kind == "model_attributes_type" or (kind == "dict_type" and not path):
        return RequestError(
            400,
            f"body: expected a JSON object, got {type(value).__name__}{more}",
            param="body",
        )
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    if kind == "missing":
        message = f"{path}: missing; this field is required"
    elif kind == "extra_forbidden":
        message = f"{path}: unknown field; remove it or check its spelling"
    elif kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        symbol = {
            "greater_than": ">",
            "greater_than_equal": ">=",
            "less_than": "<",
            "less_than_equal": "<=",
        }[kind]
        bound = ctx.get("gt", ctx.get("ge", ctx.get("lt", ctx.get("le"))))
        message = f"{path}: must be {symbol} {bound} (got {shown})"
    elif kind in ("too_long", "too_short"):
        limit = ctx.get("max_length", ctx.get("min_length"))
        word = "at most" if kind == "too_long" else "at least"
        message = f"{path}: must have {word} {limit} items/characters (got {shown})"
    else:
        text = str(item.get("msg", "invalid")).removeprefix("Value error, ")
        if not path:  # a model validator: its message starts with the field
            head = text.split(":", 1)[0]
            param = head if head.isidentifier() else None
            return RequestError(400, text + more, param=param, code="invalid_value")
        message = f"{path}: {text[0].lower()}{text[1:]} (got {shown})"
    return RequestError(400, message + more, param=path or None, code="invalid_value")
