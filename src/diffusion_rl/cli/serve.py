"""``diffusion-rl serve``: the OpenAI-compatible server (docs/serving.md) on model
directories and workflows.

``--model DIR`` serves DIR under its base name, ``--model NAME=DIR`` under NAME; any
directory the model loader reads (built-in, LLaDA / Dream / SDAR, LoRA, diffusers pipeline).
``--workflow NAME|FILE`` (or ``NAME=FILE``) serves a workflow. The server binds to loopback
unless ``--allow-remote`` (which warns, louder without an API key); ``--api-key-env VAR``
reads the API key from the environment variable VAR (never from the command line, where
other users can read it). Every model is loaded before the port opens.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from .flags import UsageError

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
SETTING_FLAGS = {
    "host": "--host",
    "port": "--port",
    "max_queue": "--max-queue",
    "max_batch_rows": "--max-batch-rows",
    "max_wait_ms": "--max-wait-ms",
    "request_timeout_s": "--request-timeout",
    "max_body_bytes": "--max-body-bytes",
    "update_weights_dirs": "--update-weights-dir",
    "api_key": "--api-key-env",
}
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000


def split_spec(spec: str, flag: str, default_name: str) -> tuple[str, str]:
    """``NAME=PATH`` → (NAME, PATH); ``PATH`` → (``default_name``, PATH). The name must be
    1 .. 128 letters, digits, ``.``, ``_``, ``-``."""
    name, sep, path = spec.partition("=")
    if not sep or "/" in name or not NAME.match(name):
        name, path = default_name, spec
    if not NAME.match(name):
        raise UsageError(
            f"{flag}: {spec!r}: the served name {name!r} must be letters, digits, '.', '_', '-' "
            "(give one with NAME=PATH)"
        )
    return name, path


def _model_name(path: str) -> str:
    return Path(path.rstrip("/")).name or "model"


def _workflow_name(source: str) -> str:
    return Path(source).stem if source.endswith((".yaml", ".yml")) else source


def _settings(args):
    from pydantic import ValidationError

    from ..serving.settings import ServeSettings

    api_key = None
    if args.api_key_env is not None:
        api_key = os.environ.get(args.api_key_env, "")
        if not api_key:
            raise UsageError(
                f"--api-key-env: the environment variable {args.api_key_env} is not set or "
                "empty; export it with the key clients send as 'Authorization: Bearer KEY'"
            )
    values = {
        "host": args.host or DEFAULT_HOST,
        "port": DEFAULT_PORT if args.port is None else args.port,
        "allow_remote": bool(args.allow_remote),
        "api_key": api_key,
        "allow_tensor_updates": bool(args.allow_tensor_updates),
    }
    optional = {
        "max_queue": args.max_queue,
        "max_batch_rows": args.max_batch_rows,
        "max_wait_ms": args.max_wait_ms,
        "request_timeout_s": args.request_timeout,
        "max_body_bytes": args.max_body_bytes,
        "update_weights_dirs": tuple(args.update_weights_dir) if args.update_weights_dir else None,
    }
    values.update({k: v for k, v in optional.items() if v is not None})
    try:
        return ServeSettings(**values)
    except ValidationError as error:
        item = error.errors()[0]
        field = str(item["loc"][0]) if item["loc"] else ""
        message = str(item["msg"]).removeprefix("Value error, ")
        if field == "api_key":
            message = "the key must have at least 8 characters"
        if not field:  # the model validator: the host check
            raise UsageError(f"--host: {message.split(': ', 1)[-1]}") from None
        raise UsageError(f"{SETTING_FLAGS.get(field, field)}: {message}") from None


def cmd_serve(args) -> int:
    """Load every ``--model`` / ``--workflow``, then serve them until interrupted."""
    from ..models.loading import HubIdError, refuse_hub_id

    for spec in args.model or []:  # a Hub id is refused at once, before torch is imported
        try:
            refuse_hub_id(split_spec(spec, "--model", _model_name(spec))[1], "--model")
        except HubIdError as error:
            raise UsageError(str(error)) from None
    try:
        import uvicorn

        from ..serving.app import create_app
        from ..serving.engine import Engine, load_served_model, load_served_workflow
    except ImportError as error:
        raise UsageError(
            f"serve: needs FastAPI and uvicorn ({error}); install the serve extra: "
            "pip install 'diffusion-rl[serve]'"
        ) from None
    if not args.model and not args.workflow:
        raise UsageError("--model: give at least one --model DIR or --workflow NAME|FILE")
    settings = _settings(args)
    if settings.allow_remote:
        print(
            f"warning: --allow-remote: serving on {settings.host}, reachable from other "
            "machines"
            + ("" if settings.api_key else " WITHOUT an API key (add --api-key-env VAR)"),
            file=sys.stderr,
        )
    specs = [("--model", *split_spec(s, "--model", _model_name(s))) for s in args.model or []]
    specs += [
        ("--workflow", *split_spec(s, "--workflow", _workflow_name(s))) for s in args.workflow or []
    ]
    names = [name for _, name, _ in specs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise UsageError(
            f"--model: the served name {duplicates[0]!r} is given twice; name them with "
            "--model NAME=DIR"
        )
    served = []
    for flag, name, path in specs:
        try:
            if flag == "--model":
                served.append(
                    load_served_model(
                        name,
                        path,
                        dtype=args.dtype,
                        device=args.device,
                        trust_remote_code=args.trust_remote_code,
                    )
                )
            else:
                served.append(load_served_workflow(name, path))
        except (FileNotFoundError, ValueError, TypeError) as error:
            raise UsageError(f"{flag}: {error}") from None
    engine = Engine(served, settings)
    app = create_app(engine, settings)
    listing = ", ".join(f"{s.name} ({s.kind}, weights {s.checksum})" for s in served)
    print(f"serving {listing} on http://{settings.host}:{settings.port}", file=sys.stderr)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=args.log_level or "info")
    return 0
