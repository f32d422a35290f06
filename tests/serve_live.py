"""A live server for the serving tests: uvicorn on 127.0.0.1 with an ephemeral port, in a
background thread (started and stopped by :class:`LiveServer`), and tiny token model
directories (the conftest ``tiny_model`` with a character tokenizer)."""

from __future__ import annotations

import http.client
import json
import threading
import time
from pathlib import Path

import uvicorn
from conftest import tiny_model

from diffusion_rl.models import CharTokenizer
from diffusion_rl.models.io import save_model
from diffusion_rl.serving.app import create_app
from diffusion_rl.serving.engine import Engine, load_served_model
from diffusion_rl.serving.settings import ServeSettings

CHARS = "0123456789+-="  # vocab 3 + 13 = 16, the tiny model's
SAMPLER = {"generation_length": 8, "block_size": 4, "steps_per_block": 2, "temperature": 1.0}


def write_token_model(directory: Path, seed: int = 0, attention: str = "bidirectional") -> Path:
    """A tiny token model directory (``tiny_model(seed=seed)``) recording :data:`SAMPLER`."""
    model = tiny_model(attention, seed=seed)
    info = {"task": {"name": "arithmetic"}, "sampler": dict(SAMPLER)}
    return save_model(directory, model, info, CharTokenizer(CHARS))


class LiveServer:
    """``create_app`` on an :class:`Engine` of ``models`` (name → directory), served by
    uvicorn on loopback; ``url``, ``port``, :meth:`request` (plain HTTP), :meth:`stop`."""

    def __init__(
        self, models: dict[str, Path] | None = None, *, served: list | None = None, **settings
    ) -> None:
        """``models`` (name → directory) are loaded; ``served``: ServedModels already loaded
        (e.g. workflows)."""
        self.settings = ServeSettings(port=0, **settings)
        served = list(served or [])
        served += [load_served_model(name, path) for name, path in (models or {}).items()]
        self.engine = Engine(served, self.settings)
        self.app = create_app(self.engine, self.settings)
        config = uvicorn.Config(
            self.app, host="127.0.0.1", port=0, log_level="error", lifespan="on"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start within 20 s")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def request(
        self,
        method: str,
        path: str,
        body: bytes | str | dict | list | None = None,
        headers: dict | None = None,
        timeout: float = 30,
    ) -> tuple[int, dict, bytes]:
        """``(status, headers (lower-case names), body bytes)`` of one plain HTTP request."""
        headers = dict(headers or {})
        if isinstance(body, (dict, list)):
            body = json.dumps(body)
            headers.setdefault("Content-Type", "application/json")
        if isinstance(body, str):
            body = body.encode()
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            connection.request(method, path, body=body, headers=headers)
            response = connection.getresponse()
            data = response.read()
            return response.status, {k.lower(): v for k, v in response.getheaders()}, data
        finally:
            connection.close()

    def json(self, method: str, path: str, body=None, headers=None) -> tuple[int, dict, dict]:
        status, head, data = self.request(method, path, body, headers)
        return status, head, json.loads(data)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)
        if self.thread.is_alive():
            raise RuntimeError("the test server did not stop within 20 s")
