"""Replay cost per scored batch, forward AND backward (as in training): dense vs packed.

One randomly initialised block-causal :class:`DiffusionTransformer` (the model of
``dlm_sampler.py``), one captured rollout (fixed schedule, ``stop_at_eos=False``, prompts
left-padded), scored four ways, each followed by ``backward()`` of the weighted sum:

* ``dense_canvas``: :class:`ReplayScorer` with ``use_cache=False``, the docs/math.md §1.3
  definition: one full-canvas forward per distinct commit step;
* ``dense_cached``: :class:`ReplayScorer` default (block KV cache walk, one block forward per
  step, gradients through the cached prefix);
* ``packed``: :class:`PackedReplayScorer`, one forward over
  ``T = P + L + S·K`` positions per row (S distinct steps, K slots per copy);
* ``mean_field``: :class:`MeanFieldEstimator`, one forward over ``P + L`` (the cheapest
  approximate baseline; its cost is the unit of the token-count bound ``T / (P + L)``).

Reported: median seconds per method, ``packed_speedup_vs_dense`` (full-canvas; target >= 5),
``packed_speedup_vs_dense_cached``, ``packed_over_mean_field`` and its ratio to the
token-count bound (target <= 1.5: packed costs at most 1.5x mean-field per position), parity
max |packed − dense|, and the peak memory of one packed / dense-cached scored batch with and
without activation checkpointing. On CPU each memory number comes from a fresh subprocess
that loads only the model and the batch, then measures the ``ru_maxrss`` delta around the
forward+backward; on CUDA, ``max_memory_allocated`` above the allocation before the call.

Progress goes to stderr; the last line of stdout is one JSON object. Example::

    python benchmarks/dlm_replay.py                       # defaults, ~1.7 min on 2 CPU cores
    python benchmarks/dlm_replay.py --block-size 32 --steps-per-block 32 --reps 1
    python benchmarks/dlm_replay.py --device cuda --gen-length 256 --batch 16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from dlm_sampler import cpu_name, make_prompts, synchronize

from diffusion_rl.models.transformer import DiffusionTransformer, TransformerConfig
from diffusion_rl.sampling.token import TokenSamplerConfig, sample_tokens
from diffusion_rl.scoring.estimators import MeanFieldEstimator
from diffusion_rl.scoring.packed import PackedReplayScorer
from diffusion_rl.scoring.replay import ReplayScorer
from diffusion_rl.trace import TokenTrace

METHODS = ("dense_canvas", "dense_cached", "packed", "mean_field")
MEMORY_METHODS = ("packed", "dense_cached")
MEMORY_METHOD_CPU = (
    "peak RSS (VmHWM, reset via /proc/self/clear_refs just before) minus RSS before the "
    "forward+backward, in a fresh subprocess per number (MALLOC_MMAP_THRESHOLD_=65536) that "
    "loaded only the model and the batch and scored one row first; not ru_maxrss, which a "
    "fork+exec child inherits from its parent"
)


def log(message: str) -> None:
    print(f"[dlm_replay] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gen-length", type=int, default=128, help="completion slots per row")
    p.add_argument("--block-size", type=int, default=4, help="sampler and model block size")
    p.add_argument(
        "--steps-per-block", type=int, default=None, help="sampler steps per block (default K)"
    )
    p.add_argument("--batch", type=int, default=4, help="rows per scored batch")
    p.add_argument("--prompt-length", type=int, default=32, help="prompt slots (left-padded)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256, help="d_model")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=64, help="vocabulary size (last id is MASK)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--reps", type=int, default=3, help="timed repetitions (median reported)")
    p.add_argument(
        "--memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure peak memory with and without activation checkpointing",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--memory-probe", default=None, help=argparse.SUPPRESS)  # internal
    args = p.parse_args(argv)
    if args.steps_per_block is None:
        args.steps_per_block = args.block_size
    if args.reps < 1:
        p.error("--reps must be >= 1")
    return args


def build_model(args, device: torch.device) -> DiffusionTransformer:
    torch.manual_seed(args.seed)
    config = TransformerConfig(
        vocab_size=args.vocab,
        mask_token_id=args.vocab - 1,
        d_model=args.width,
        n_layers=args.layers,
        n_heads=args.heads,
        max_seq_len=args.prompt_length + args.gen_length,
        attention="block_causal",
        block_size=args.block_size,
    )
    return DiffusionTransformer(config).to(device)


def make_trace(args, model, device: torch.device):
    prompt_ids, prompt_mask = make_prompts(args, device)
    config = TokenSamplerConfig(
        generation_length=args.gen_length,
        block_size=args.block_size,
        steps_per_block=args.steps_per_block,
        temperature=args.temperature,
        schedule="fixed",
        use_cache=True,
        stop_at_eos=False,
    )
    seeds = [args.seed * 1000 + row for row in range(args.batch)]
    return sample_tokens(model, prompt_ids, prompt_mask, config, seeds=seeds, capture=True).trace


def make_scorers(model, trace) -> dict:
    kernel = trace.kernel_ids["token_logprobs"]
    temperature = trace.temperature
    mean_field = MeanFieldEstimator(model, temperature)
    return {
        "dense_canvas": ReplayScorer(
            model, temperature=temperature, kernel_id=kernel, use_cache=False
        ).score,
        "dense_cached": ReplayScorer(
            model, temperature=temperature, kernel_id=kernel, use_cache=True
        ).score,
        "packed": PackedReplayScorer(model, temperature=temperature, kernel_id=kernel).score,
        "mean_field": lambda batch: mean_field.score(batch, torch.Generator().manual_seed(0)),
    }


def train_step(model, score, batch) -> torch.Tensor:
    """Score, then backward of the weighted log-prob sum (what a policy loss needs)."""
    logprobs = score(batch).logprobs
    (logprobs * batch.loss_weights).sum().backward()
    model.zero_grad(set_to_none=True)
    return logprobs.detach()


def proc_status_kib(key: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (``VmHWM``) to its current RSS (Linux >= 4.0).

    ``ru_maxrss`` cannot be reset, and a child started by fork+exec inherits the parent's
    peak in it, which hides the child's own; ``VmHWM`` belongs to the process image."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return proc_status_kib("VmHWM") <= proc_status_kib("VmRSS") + 1024
    except OSError:
        return False


def memory_probe(args) -> dict:
    """In a fresh process: peak memory of one scored batch (forward + backward)."""
    data = torch.load(args.memory_probe, weights_only=True)  # tensors and plain values only
    device = torch.device(args.device)
    model = build_model(args, device)
    model.load_state_dict(data["model"])
    model.train().enable_activation_checkpointing(data["checkpointing"])
    trace = TokenTrace(**data["trace"])
    score = make_scorers(model, trace)[data["method"]]
    batch = trace.prepare()
    train_step(model, score, batch[:1])  # pages in the kernels' code; its tensors are freed
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        train_step(model, score, batch)
        synchronize(device)
        peak_kib = (torch.cuda.max_memory_allocated(device) - before) / 1024
        method = "cuda max_memory_allocated minus the allocation before the forward+backward"
    elif reset_peak_rss():
        before = proc_status_kib("VmRSS")
        train_step(model, score, batch)
        peak_kib = proc_status_kib("VmHWM") - before
        method = MEMORY_METHOD_CPU
    else:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        train_step(model, score, batch)
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        method = (
            "ru_maxrss delta around the forward+backward (may be 0 if masked by an earlier peak)"
        )
    return {"peak_mib": round(peak_kib / 1024, 1), "method": method}


def measure_memory(args, model, trace, argv: list[str]) -> tuple[dict, str]:
    """Peak MiB per method with and without activation checkpointing, one process each;
    returns the numbers and how they were measured."""
    results, method = {}, ""
    with tempfile.TemporaryDirectory() as tmp:
        for scorer in MEMORY_METHODS:
            for checkpointing in (False, True):
                path = os.path.join(tmp, f"{scorer}_{checkpointing}.pt")
                state = {  # loadable with weights_only=True: no pickled objects
                    "model": model.state_dict(),
                    "trace": {f.name: getattr(trace, f.name) for f in dataclasses.fields(trace)},
                    "method": scorer,
                    "checkpointing": checkpointing,
                }
                torch.save(state, path)
                cmd = [sys.executable, os.path.abspath(__file__), *argv, "--memory-probe", path]
                # Fixed mmap threshold: freed tensors go back to the OS, so RSS tracks them.
                env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
                out = subprocess.run(
                    cmd, check=True, capture_output=True, text=True, env=env
                ).stdout
                probe = json.loads(out.strip().splitlines()[-1])
                key = f"{scorer}_{'checkpointing' if checkpointing else 'plain'}"
                results[key], method = probe["peak_mib"], probe["method"]
                log(f"memory {key}: {results[key]} MiB")
    return results, method


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.memory_probe is not None:
        return memory_probe(args)
    device = torch.device(args.device)
    model = build_model(args, device)
    log(
        f"model {args.layers}L x {args.width}d x {args.heads}h, vocab {args.vocab}, "
        f"{model.num_parameters() / 1e6:.2f}M params on {device} ({torch.get_num_threads()} "
        "threads)"
    )
    start = time.perf_counter()
    trace = make_trace(args, model, device)
    batch = trace.prepare()
    active = batch.active
    log(f"rollout ({args.batch} x {args.gen_length} tokens): {time.perf_counter() - start:.2f}s")

    model.train()
    scorers = make_scorers(model, trace)
    for score in scorers.values():  # warm-up on one row
        train_step(model, score, batch[:1])

    times = {name: [] for name in METHODS}
    logprobs = {}
    for rep in range(args.reps):
        for name in METHODS:
            synchronize(device)
            start = time.perf_counter()
            logprobs[name] = train_step(model, scorers[name], batch)
            synchronize(device)
            times[name].append(time.perf_counter() - start)
            log(f"rep {rep + 1}/{args.reps} {name}: {times[name][-1]:.3f}s")
    median = {name: statistics.median(times[name]) for name in METHODS}

    prompt_len, length = args.prompt_length, args.gen_length
    distinct_steps = int(torch.unique(trace.commit_steps[active]).numel())
    blocks = [(lo, min(length, lo + args.block_size)) for lo in range(0, length, args.block_size)]
    copy_positions = sum(
        (hi - lo) * int(torch.unique(trace.commit_steps[:, lo:hi][active[:, lo:hi]]).numel())
        for lo, hi in blocks
    )
    packed_positions = prompt_len + length + copy_positions
    bound = packed_positions / (prompt_len + length)
    packed_over_mean_field = median["packed"] / median["mean_field"]

    def parity(name: str) -> float:
        return float((logprobs["packed"] - logprobs[name])[active].abs().max())

    memory, memory_method = (
        measure_memory(args, model, trace, argv) if args.memory else (None, None)
    )
    speedup = median["dense_canvas"] / median["packed"]
    return {
        "benchmark": "dlm_replay",
        "seconds_per_batch": {name: round(median[name], 4) for name in METHODS},
        "packed_speedup_vs_dense": round(speedup, 3),
        "packed_speedup_vs_dense_cached": round(median["dense_cached"] / median["packed"], 3),
        "packed_over_mean_field": round(packed_over_mean_field, 3),
        "token_bound": round(bound, 3),
        "packed_over_mean_field_per_bound": round(packed_over_mean_field / bound, 3),
        "targets_met": {
            "packed_speedup_vs_dense>=5": bool(speedup >= 5),
            "packed_over_mean_field_per_bound<=1.5": bool(packed_over_mean_field / bound <= 1.5),
        },
        "parity_max_abs_packed_vs_dense": parity("dense_canvas"),
        "parity_max_abs_packed_vs_dense_cached": parity("dense_cached"),
        "parity_max_abs_packed_vs_behaviour": float(
            (logprobs["packed"] - trace.behaviour_logprobs)[active].abs().max()
        ),
        "peak_memory_mib": memory,
        "memory_method": memory_method,
        "settings": {
            "generation_length": length,
            "block_size": args.block_size,
            "steps_per_block": args.steps_per_block,
            "temperature": args.temperature,
            "batch": args.batch,
            "prompt_length": prompt_len,
            "prompt_pad_slots": (~trace.prompt_mask).sum(1).tolist(),
            "actions": int(active.sum()),
            "distinct_steps": distinct_steps,
            "packed_positions_per_row": packed_positions,
            "dense_canvas_forwards": distinct_steps,
            "reps": args.reps,
            "seed": args.seed,
        },
        "seconds": {name: [round(t, 4) for t in times[name]] for name in METHODS},
        "model": {
            "n_layers": args.layers,
            "d_model": args.width,
            "n_heads": args.heads,
            "vocab_size": args.vocab,
            "attention": "block_causal",
            "parameters": model.num_parameters(),
            "init": "random",
        },
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "device": str(device),
            "device_name": (
                torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
            ),
            "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "kernel_ids": trace.kernel_ids,
        },
    }


if __name__ == "__main__":
    total_start = time.perf_counter()
    out = main()
    out["total_seconds"] = round(time.perf_counter() - total_start, 2)
    print(json.dumps(out))
