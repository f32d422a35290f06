"""Rollouts sampled by a serving engine: ``diffusion-rl serve`` as the rollout engine.

:class:`ServerTokenSource` / :class:`ServerFlowSource` have the interface of
:class:`~diffusion_rl.rollout.TokenSource` / :class:`~diffusion_rl.rollout.FlowSource`
(``task``, ``sample(model, examples, seeds, weights_version)``, ``stats(rollout)``) and wrap
one: the local source says what to sample (its task's encoding, its sampler, its group size)
and how to report it; the server samples it. Each ``sample`` call

1. **syncs the weights** (:meth:`RolloutClient.sync`): the rollout copy ``model`` at learner
   version ``v`` is pushed to the server (``POST /update_weights``, a safetensors body of the
   tensors the learner trains: ``keys``) once per version. Server and learner versions are
   tied by one explicit map fixed at the first sync, ``server = v + offset`` (``offset = 0``
   when the server starts on the learner's weights: then no push is needed and the versions
   are equal), every later push names its server version, and the server's answer must be
   that version with the checksum of the learner's whole rollout model (the tensors not
   pushed are hashed once); anything else, e.g. another client's update in between, is a
   :class:`RolloutServerError`;
2. **samples** through ``POST /rollout/generate`` with the same inputs the in-process source
   gives its sampler (token ids and mask from ``task.encode``, per-row seeds, the sampler
   dump, the stop id; prompts and group size for flow), the expected server version (the
   server refuses any other with 409) and the caller's autocast precision;
3. **adopts the trace**: it must be of the right kind, carry the expected server version and
   the requested seeds; its ``weights_version`` is mapped back to ``v`` (the served version
   stays in ``model_info["served"]``) and its tensors are moved to the model's device.

So the learner replays the server's trace exactly as an in-process one: on the same weights,
device and precision the two are bitwise equal, and before any update the ratio is exactly 1.
HTTP runs through one ``httpx2`` client with a timeout; connection failures, timeouts and
503 / 502 / 504 answers are retried ``max_retries`` times with exponential back-off (a 503's
``Retry-After`` is honoured). A retried push is safe: it names its version, and a 409 for
that version is accepted when the server already holds exactly those weights.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from .checksums import combine_digests, tensor_digest, weights_checksum
from .distributed import World
from .rollout import FlowSource, TokenSource
from .sampling.flow import model_device
from .trace import FlowTrace, TokenTrace
from .trace_io import RolloutBody, TraceFormatError, cpu_unshared, rollout_from_bytes

try:  # the HTTP client (the `serve` extra); httpx2 is httpx's successor, same API
    import httpx2 as httpx
except ModuleNotFoundError:  # pragma: no cover (an environment with the older name)
    import httpx  # type: ignore[no-redef]

__all__ = [
    "RolloutClient",
    "RolloutServerError",
    "ServerFlowSource",
    "ServerTokenSource",
    "combine_digests",
    "tensor_digest",
    "weights_checksum",
]

RETRY_STATUSES = (502, 503, 504)
MAX_BACKOFF_S = 30.0
_AUTOCAST_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


class RolloutServerError(RuntimeError):
    """The rollout server failed, refused a request, or answered something the learner must
    not train on (another weights version or checksum, a trace of other rows). ``status``:
    the HTTP status of a refusal (None otherwise)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


# ------------------------------------------------------------------------------- checksums
# ---------------------------------------------------------------------------------- client
class RolloutClient:
    """HTTP client of one served model (module docstring).

    Args:
        url: the server, e.g. ``http://127.0.0.1:8000``.
        model: the served model's name; None: the server's only model.
        api_key: sent as ``Authorization: Bearer``; None: no header.
        timeout_s: per-request timeout (connect: at most 10 s).
        max_retries: retries of a failed request (module docstring).
        backoff_s: the first retry's wait, doubled on each further one (at most 30 s).
        transport: an ``httpx2`` transport (tests); None: the network.
    """

    def __init__(
        self,
        url: str,
        *,
        model: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        transport: Any = None,
    ) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url: expected an http:// or https:// address, got {url!r}")
        if max_retries < 0:
            raise ValueError(f"max_retries: expected >= 0, got {max_retries}")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        timeout = httpx.Timeout(timeout_s, connect=min(10.0, timeout_s))
        self.url = url.rstrip("/")
        self._http = httpx.Client(
            base_url=self.url, headers=headers, timeout=timeout, transport=transport
        )
        self._model = model
        self.max_retries, self.backoff_s, self.timeout_s = max_retries, backoff_s, timeout_s
        self.offset: int | None = None  # server version - learner version (fixed at first sync)
        self._synced: tuple[int, int] | None = None  # (learner version, server version)
        self._frozen_digests: dict[str, bytes] | None = None  # tensors never pushed
        self.pushes = 0

    # -------------------------------------------------------------- plumbing
    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _request(self, method: str, path: str, **kwargs) -> Any:
        """One HTTP exchange with bounded retries; an error answer is a RolloutServerError
        naming the route, the status and the server's message."""
        where = f"{method} {self.url}{path}"
        for attempt in range(self.max_retries + 1):
            wait = min(MAX_BACKOFF_S, self.backoff_s * 2**attempt)
            try:
                response = self._http.request(method, path, **kwargs)
            except (httpx.TransportError, httpx.TimeoutException) as error:
                if attempt == self.max_retries:
                    raise RolloutServerError(
                        f"{where}: {type(error).__name__}: {error} (after {attempt + 1} tries; "
                        "is `diffusion-rl serve` running there? rollout.url names it)"
                    ) from error
                time.sleep(wait)
                continue
            if response.status_code in RETRY_STATUSES and attempt < self.max_retries:
                after = response.headers.get("Retry-After", "")
                time.sleep(min(MAX_BACKOFF_S, float(after)) if after.isdigit() else wait)
                continue
            if response.status_code >= 400:
                raise RolloutServerError(
                    f"{where}: HTTP {response.status_code}: {_message(response)}",
                    response.status_code,
                )
            return response
        raise AssertionError("unreachable")  # the loop returns or raises

    @property
    def model(self) -> str:
        """The served model's name (asked of ``GET /v1/models`` when not given)."""
        if self._model is None:
            names = [card["id"] for card in self._request("GET", "/v1/models").json()["data"]]
            if len(names) != 1:
                raise RolloutServerError(
                    f"rollout.model: the server at {self.url} serves {names}; name the one to "
                    "roll out with (rollout.model)"
                )
            self._model = names[0]
        return self._model

    def card(self) -> tuple[int, str]:
        """``(weights_version, weights_checksum)`` the server holds now."""
        card = self._request("GET", f"/v1/models/{self.model}").json()
        return int(card["weights_version"]), str(card["weights_checksum"])

    # -------------------------------------------------------------- weights
    def push_weights(
        self, tensors: Mapping[str, torch.Tensor], *, version: int | None = None
    ) -> tuple[int, str]:
        """``POST /update_weights`` with ``tensors`` (a safetensors body; the server copies
        them into its model in place); returns the server's new ``(version, checksum)``.
        ``version``: the version to name (None: the server's next). A tied tensor (one
        tensor under several names, e.g. tied embeddings) is sent under each of its names,
        so a server that rehashes only the names it received still reports the right
        checksum."""
        from safetensors.torch import save

        body = save(cpu_unshared(tensors))
        params = {"model": self.model, **({} if version is None else {"version": version})}
        headers = {"Content-Type": "application/octet-stream"}
        try:
            answer = self._request(
                "POST", "/update_weights", content=body, params=params, headers=headers
            ).json()
        except RolloutServerError as error:
            if version is None or error.status != 409:
                raise
            # a retried push whose first try landed: the server already holds this version
            answer = dict(zip(("weights_version", "weights_checksum"), self.card()))
            if answer["weights_version"] != version:
                raise
        self.pushes += 1
        return int(answer["weights_version"]), str(answer["weights_checksum"])

    def _checksum(self, state: Mapping[str, torch.Tensor], keys: Sequence[str] | None) -> str:
        """The checksum of the whole ``state``; tensors outside ``keys`` (never pushed, so
        never changed) are hashed once."""
        if keys is None:
            return weights_checksum(state)
        pushed = set(keys)
        if self._frozen_digests is None:
            self._frozen_digests = {
                k: tensor_digest(k, t) for k, t in state.items() if k not in pushed
            }
        digests = dict(self._frozen_digests)
        digests.update({k: tensor_digest(k, state[k]) for k in keys})
        return combine_digests(digests)

    def sync(
        self, model: torch.nn.Module, version: int, keys: Sequence[str] | None, *, push=True
    ) -> int:
        """Make the server hold ``model``'s weights as learner version ``version``; returns
        the server version that maps to it (module docstring, step 1). ``push=False`` (the
        ranks after 0 of a distributed run, whose rollout weights equal rank 0's) pushes
        nothing: it waits, up to ``timeout_s``, until the server holds these weights."""
        if self._synced is not None and self._synced[0] == version:
            return self._synced[1]
        state = model.state_dict()
        missing = sorted(set(keys or ()) - set(state))
        if missing:
            raise ValueError(f"keys: {missing[:3]} are not in the rollout model's state_dict")
        local = self._checksum(state, keys)
        if not push:
            expected = None if self.offset is None else version + self.offset
            served = self._wait_for(local, version, expected)
            self.offset = served - version
            self._synced = (version, served)
            return served
        if self.offset is None:
            served, checksum = self.card()
            if checksum != local:  # the server holds other weights: push, then fix the map
                pushed = state if keys is None else {k: state[k] for k in keys}
                served, checksum = self.push_weights(pushed)
            self.offset = served - version
        else:
            target = version + self.offset
            pushed = state if keys is None else {k: state[k] for k in keys}
            served, checksum = self.push_weights(pushed, version=target)
            if served != target:
                raise RolloutServerError(
                    f"weights_version: pushed learner v{version} as server v{target}, the server "
                    f"answered v{served}; another client updates this model"
                )
        if checksum != local:
            raise RolloutServerError(
                f"weights_checksum: the server holds {checksum} after the sync, the learner's "
                f"rollout weights (v{version}) hash to {local}; the server's model is not the "
                "learner's (another base model, dtype or architecture?): serve the model "
                "directory the run starts from"
            )
        self._synced = (version, served)
        return served

    def _wait_for(self, checksum: str, version: int, expected: int | None) -> int:
        """The server version once the server holds weights hashing to ``checksum`` as
        version ``expected`` (None: any version; the first sync), pushed by another process;
        polled for up to ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            served, held = self.card()
            if held == checksum and expected in (None, served):
                return served
            if time.monotonic() > deadline:
                raise RolloutServerError(
                    f"weights_checksum: waited {self.timeout_s:g} s for rank 0 to push learner "
                    f"v{version} (hash {checksum}); the server holds {held} (v{served})"
                )
            time.sleep(0.02)

    # -------------------------------------------------------------- rollouts
    def generate(self, body: Mapping[str, Any]) -> RolloutBody:
        """``POST /rollout/generate`` with the JSON ``body`` (``model`` added); the decoded
        trace and artefact."""
        response = self._request("POST", "/rollout/generate", json={"model": self.model, **body})
        try:
            return rollout_from_bytes(response.content)
        except TraceFormatError as error:
            raise RolloutServerError(f"POST /rollout/generate: {error}") from None

    def adopt(
        self,
        got: RolloutBody,
        kind: type,
        *,
        seeds: Sequence[int],
        server_version: int,
        learner_version: int,
        device: torch.device,
    ) -> TokenTrace | FlowTrace:
        """The server's trace as the learner's (module docstring, step 3)."""
        trace = got.trace
        if type(trace) is not kind:
            raise RolloutServerError(
                f"POST /rollout/generate: a {type(trace).__name__}, expected a {kind.__name__}; "
                f"{self.model!r} is not the kind of model this recipe trains"
            )
        if trace.weights_version != server_version:
            raise RolloutServerError(
                f"weights_version: the trace was sampled on server v{trace.weights_version}, "
                f"expected v{server_version} (learner v{learner_version})"
            )
        if trace.seeds.tolist() != [int(s) for s in seeds]:
            raise RolloutServerError("seeds: the trace's rows are not the requested rows")
        trace = replace(trace, weights_version=learner_version)
        if isinstance(trace, FlowTrace):
            return trace.to(device)
        moved = ("prompt_ids", "prompt_mask", "tokens", "commit_steps", "behaviour_logprobs")
        return replace(trace, **{name: getattr(trace, name).to(device) for name in moved})


def _message(response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except Exception:  # noqa: BLE001 (not the server's error JSON: show the text)
        return response.text[:500]


def _autocast(device: torch.device) -> str | None:
    """The autocast dtype the caller samples under on ``device``'s type (None: none)."""
    if not torch.is_autocast_enabled(device.type):
        return None
    dtype = torch.get_autocast_dtype(device.type)
    if dtype not in _AUTOCAST_NAMES:
        raise ValueError(f"autocast: {dtype} is not supported by the rollout server")
    return _AUTOCAST_NAMES[dtype]


# --------------------------------------------------------------------------------- sources
class _ServerSource:
    """What both server sources share: the wrapped local source and the client. Under
    several processes, rank 0 pushes each version and the other ranks wait for it (no
    collective inside a rollout: a rank may sample no rows in a refill round)."""

    def __init__(self, source, client: RolloutClient, keys: Sequence[str] | None = None):
        self.source, self.client = source, client
        self.keys = None if keys is None else list(keys)

    def _sync(self, model, weights_version: int) -> int:
        push = World.current().is_main
        return self.client.sync(model, weights_version, self.keys, push=push)

    @property
    def task(self):
        return self.source.task

    @property
    def sampler(self):
        return self.source.sampler

    def stats(self, rollout) -> dict[str, float]:
        return self.source.stats(rollout)


class ServerTokenSource(_ServerSource):
    """A :class:`~diffusion_rl.rollout.TokenSource` sampled by the server (module doc).

    ``keys``: the state-dict names pushed each version (what the learner trains; None:
    all)."""

    def __init__(self, source: TokenSource, client: RolloutClient, keys=None) -> None:
        if not isinstance(source, TokenSource):
            raise TypeError(f"source: expected a TokenSource, got {type(source).__name__}")
        super().__init__(source, client, keys)

    def sample(
        self, model, examples, seeds, weights_version: int, group_seeds=None
    ) -> tuple[TokenTrace, list[str]]:
        """``group_seeds`` is ignored (tokens draw per row)."""
        served = self._sync(model, weights_version)
        data = self.task.encode(examples)
        device = model_device(model)
        body = {
            "prompt_ids": data["prompt_ids"].tolist(),
            "prompt_mask": data["prompt_mask"].tolist(),
            "seeds": [int(s) for s in seeds],
            "sampler": self.sampler.model_dump(mode="json"),
            "stop_token_id": self.task.tokenizer.eos_id,
            "autocast": _autocast(device),
            "weights_version": served,
        }
        trace = self.client.adopt(
            self.client.generate(body),
            TokenTrace,
            seeds=seeds,
            server_version=served,
            learner_version=weights_version,
            device=device,
        )
        return trace, self.task.tokenizer.batch_decode(trace.tokens)


class ServerFlowSource(_ServerSource):
    """A :class:`~diffusion_rl.rollout.FlowSource` (or a subclass, e.g. a prompt list's)
    sampled by the server (module doc); the images are the server's
    ``artefact/images``, float32 on the model's device."""

    def __init__(self, source: FlowSource, client: RolloutClient, keys=None) -> None:
        if not isinstance(source, FlowSource):
            raise TypeError(f"source: expected a FlowSource, got {type(source).__name__}")
        super().__init__(source, client, keys)

    @property
    def group_size(self) -> int:
        return self.source.group_size

    def sample(
        self, model, examples, seeds, weights_version: int, group_seeds=None
    ) -> tuple[FlowTrace, torch.Tensor]:
        """``group_seeds`` (rows of a distributed run, whose groups may be cut between
        ranks): the server is sent no group size, which only shared start noise needs."""
        if group_seeds is not None and self.sampler.share_group_noise:
            raise RolloutServerError(
                "sampler.share_group_noise: a group cut between processes cannot share its "
                "start noise on the server; set share_group_noise: false, or rollout.engine: "
                "in_process, under torchrun"
            )
        served = self._sync(model, weights_version)
        device = model_device(model)
        body = {
            "prompt": [e.prompt for e in examples],
            "seeds": [int(s) for s in seeds],
            "sampler": self.sampler.model_dump(mode="json"),
            "group_size": self.group_size if group_seeds is None else None,
            "autocast": _autocast(device),
            "weights_version": served,
        }
        got = self.client.generate(body)
        trace = self.client.adopt(
            got,
            FlowTrace,
            seeds=seeds,
            server_version=served,
            learner_version=weights_version,
            device=device,
        )
        if "images" not in got.artefacts:
            raise RolloutServerError("POST /rollout/generate: the body has no artefact/images")
        return trace, got.artefacts["images"].to(device).float()
