"""Serving throughput, latency, batching gain and weight-update time (``diffusion-rl serve``).

On two tiny built-in models written to a temporary directory (a bidirectional token
``DiffusionTransformer``, 2 layers × 64 wide, character tokenizer of the arithmetic task,
generating ``--tokens`` tokens in blocks of 4 with 2 steps per block; and a FlowDiT at its
default size, 16 px, patches of 4, 96 wide, 4 layers, ``--steps`` ODE steps, guidance 4.5),
served by ``create_app`` under uvicorn on loopback in this process, with ``--clients`` 1, 8
and 32 concurrent HTTP clients (asyncio + httpx2, the client the openai package brings; each client sends its requests one after
another, ``--requests`` requests per level in all):

* per model and client count: requests/s, tokens/s (completion tokens) or images/s, and the
  p50 / p99 of the client-observed latency;
* ``batching_gain``: throughput at the largest client count with batching
  (``max_batch_rows=32``, ``max_wait_ms=5``) ÷ the same load served one request at a time
  (``max_batch_rows=1``); target ≥ 3 on CPU;
* ``weight_update``: ``POST /update_weights`` with a safetensors body of every tensor of the
  model (median of 5; client wall time and the server's own ``seconds``);
* ``peak_rss_mib``: the process's peak RSS (server and clients together).

Requests are text completions (1 prompt, ``n = 1``) and image generations (1 prompt,
``n = 1``); every request has its own seed. Prints one JSON object as the last line.

    python benchmarks/serve.py              # ~1-2 min on 2 shared CPU cores
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai package installs
import safetensors.torch
import torch
import uvicorn

from diffusion_rl.models import CharTokenizer
from diffusion_rl.models.dit import FlowDiT, FlowDiTConfig
from diffusion_rl.models.io import save_model
from diffusion_rl.models.transformer import DiffusionTransformer, TransformerConfig
from diffusion_rl.serving.app import create_app
from diffusion_rl.serving.engine import Engine, load_served_model
from diffusion_rl.serving.settings import ServeSettings

CHARS = "0123456789+-="


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def write_models(root: Path, tokens: int, steps: int) -> dict[str, Path]:
    torch.manual_seed(0)
    config = TransformerConfig(
        vocab_size=16, mask_token_id=1, d_model=64, n_layers=2, n_heads=4, max_seq_len=64,
        attention="bidirectional", block_size=4, tie_embeddings=False,
    )  # fmt: skip
    token = DiffusionTransformer(config).eval()
    sampler = {"generation_length": tokens, "block_size": 4, "steps_per_block": 2}
    save_model(root / "adder", token, {"sampler": sampler}, CharTokenizer(CHARS))
    image = FlowDiT(FlowDiTConfig()).eval()
    with torch.no_grad():
        for p in image.parameters():
            if torch.count_nonzero(p) == 0:
                p.normal_(0.0, 0.05)
    save_model(root / "painter", image, {"sampler": {"num_steps": steps, "guidance_scale": 4.5}})
    return {"adder": root / "adder", "painter": root / "painter"}


class Server:
    def __init__(self, models: dict[str, Path], **settings) -> None:
        self.settings = ServeSettings(port=0, allow_tensor_updates=True, **settings)
        self.engine = Engine([load_served_model(n, p) for n, p in models.items()], self.settings)
        app = create_app(self.engine, self.settings)
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def request_body(model: str, index: int) -> tuple[str, dict]:
    if model == "adder":
        return "/v1/completions", {
            "model": model,
            "prompt": f"{index % 50}+{index % 7}=",
            "seed": index,
        }
    prompt = ("a red circle", "two blue squares", "a green triangle")[index % 3]
    return "/v1/images/generations", {"model": model, "prompt": prompt, "seed": index}


async def load(url: str, model: str, clients: int, total: int) -> dict:
    latencies: list[float] = []
    produced = 0
    counter = iter(range(total))

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal produced
        for index in counter:
            path, body = request_body(model, index)
            started = time.perf_counter()
            response = await http.post(path, json=body)
            latencies.append(time.perf_counter() - started)
            if response.status_code != 200:
                raise RuntimeError(f"{path}: {response.status_code} {response.text[:200]}")
            usage = response.json()["usage"]
            produced += usage.get("completion_tokens", usage.get("images", 0))

    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        await client_warmup(http, model)
        started = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        elapsed = time.perf_counter() - started
    latencies.sort()
    unit = "tokens_per_s" if model == "adder" else "images_per_s"
    return {
        "clients": clients,
        "requests": total,
        "seconds": round(elapsed, 4),
        "requests_per_s": round(total / elapsed, 3),
        unit: round(produced / elapsed, 3),
        "p50_ms": round(1000 * statistics.median(latencies), 3),
        "p99_ms": round(1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 3),
    }


async def client_warmup(http: httpx.AsyncClient, model: str) -> None:
    path, body = request_body(model, 10**6)
    (await http.post(path, json=body)).raise_for_status()


def weight_update(url: str, server: Server, model: str, reps: int = 5) -> dict:
    served = server.engine.get(model).model
    state = {k: v.detach().clone() for k, v in served.state_dict().items()}
    data = safetensors.torch.save(state)
    client_s, server_s = [], []
    with httpx.Client(base_url=url, timeout=600) as http:
        for _ in range(reps):
            started = time.perf_counter()
            response = http.post(
                f"/update_weights?model={model}",
                content=data,
                headers={"Content-Type": "application/octet-stream"},
            )
            client_s.append(time.perf_counter() - started)
            response.raise_for_status()
            server_s.append(response.json()["seconds"])
    return {
        "tensors": len(state),
        "bytes": len(data),
        "client_ms": round(1000 * statistics.median(client_s), 3),
        "server_ms": round(1000 * statistics.median(server_s), 3),
        "final_version": response.json()["weights_version"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests", type=int, default=96, help="requests per level")
    parser.add_argument("--tokens", type=int, default=16, help="generated tokens per request")
    parser.add_argument("--steps", type=int, default=10, help="image ODE steps")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result: dict = {
        "settings": vars(args),
        "environment": {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "python": platform.python_version(),
            "machine": platform.machine(),
        },
    }
    most = max(args.clients)
    with tempfile.TemporaryDirectory() as scratch:
        models = write_models(Path(scratch), args.tokens, args.steps)
        for name, rows in (("batched", 32), ("one_at_a_time", 1)):
            server = Server(models, max_batch_rows=rows, max_wait_ms=5.0, max_queue=4096)
            try:
                section: dict = {}
                levels = args.clients if name == "batched" else [most]
                for model in ("adder", "painter"):
                    section[model] = []
                    for clients in levels:
                        total = max(args.requests // (4 if clients == 1 else 1), clients)
                        row = asyncio.run(load(server.url, model, clients, total))
                        log(f"{name} {model} {clients} clients: {row}")
                        section[model].append(row)
                if name == "batched":
                    section["weight_update"] = {
                        m: weight_update(server.url, server, m) for m in ("adder", "painter")
                    }
                    log(f"weight update: {section['weight_update']}")
                result[name] = section
            finally:
                server.stop()
    gain = {}
    for model in ("adder", "painter"):
        batched = next(r for r in result["batched"][model] if r["clients"] == most)
        alone = result["one_at_a_time"][model][0]
        gain[model] = round(batched["requests_per_s"] / alone["requests_per_s"], 3)
    result["batching_gain"] = {**gain, "clients": most, "target": 3.0,
                               "target_met": all(g >= 3.0 for g in gain.values())}  # fmt: skip
    result["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
