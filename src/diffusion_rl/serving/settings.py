"""``ServeSettings``: every knob of the server, validated once at start-up.

Security defaults: the server binds to loopback (``127.0.0.1``); another host needs
``allow_remote=True`` (the CLI's ``--allow-remote``, which warns). ``api_key`` None means no
authentication (loopback only is then the protection); set, every route but ``GET /health``
needs ``Authorization: Bearer <key>``. No request path reaches the file system except
``POST /update_weights`` from a directory, which is off unless ``update_weights_dirs`` lists
the directories it may read below; tensors sent in the body (a co-located trainer) are
accepted only with ``allow_tensor_updates``.

The batching knobs (``max_queue``, ``max_batch_rows``, ``max_wait_ms``,
``request_timeout_s``) are the engine's (:mod:`.engine`); the ``max_*`` bounds are checked
on every request, each refusal a 400 naming the field.
"""

from __future__ import annotations

import ipaddress

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["LOOPBACK_HOSTS", "ServeSettings", "is_loopback"]

LOOPBACK_HOSTS = ("localhost",)


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (``localhost``, ``127.0.0.0/8``, ``::1``)."""
    if host in LOOPBACK_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ServeSettings(BaseModel):
    """The server's settings (module docstring). Strict types; sizes are positive."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)  # 0: an ephemeral port (tests)
    allow_remote: bool = False
    api_key: str | None = Field(default=None, min_length=8)

    # batching (engine)
    max_queue: int = Field(default=256, ge=1, le=1_000_000)
    max_batch_rows: int = Field(default=32, ge=1, le=65_536)
    max_wait_ms: float = Field(default=5.0, ge=0.0, le=60_000.0, allow_inf_nan=False)
    request_timeout_s: float = Field(default=600.0, gt=0.0, le=86_400.0, allow_inf_nan=False)
    retry_after_s: int = Field(default=1, ge=1, le=3600)

    # request size and parameter bounds
    max_body_bytes: int = Field(default=4 << 20, ge=1024)
    max_update_bytes: int = Field(default=64 << 30, ge=1024)
    max_n: int = Field(default=16, ge=1, le=4096)
    max_prompts: int = Field(default=64, ge=1, le=4096)
    max_request_rows: int = Field(default=256, ge=1, le=65_536)
    max_tokens: int = Field(default=4096, ge=1, le=1 << 20)
    max_steps: int = Field(default=1000, ge=1, le=1 << 20)
    max_stop: int = Field(default=4, ge=0, le=64)
    max_image_size: int = Field(default=2048, ge=1, le=16_384)
    max_images: int = Field(default=16, ge=1, le=4096)

    # weight updates
    update_weights_dirs: tuple[str, ...] | None = Field(default=None, strict=False)
    allow_tensor_updates: bool = False

    @model_validator(mode="after")
    def _check(self) -> ServeSettings:
        if not self.allow_remote and not is_loopback(self.host):
            raise ValueError(
                f"host: {self.host!r} is not a loopback address; the server binds to loopback "
                "unless allow_remote=True (CLI: --allow-remote), and then set an api_key"
            )
        if self.update_weights_dirs is not None and not self.update_weights_dirs:
            raise ValueError(
                "update_weights_dirs: an empty list; give at least one directory, or None to "
                "turn updates from directories off"
            )
        return self
