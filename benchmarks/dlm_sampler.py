"""Block sampler throughput with and without the block KV cache, and dense-replay throughput.

One run, one randomly initialised block-causal :class:`DiffusionTransformer`, side by side:

* ``sample_tokens`` tokens/s with ``use_cache=True`` and ``use_cache=False`` (fixed schedule,
  ``steps_per_block = block_size``: one token committed per step, the hardest case for the
  cache-free path, which re-runs the whole canvas every step);
* dense replay actions/s: :class:`ReplayScorer` (``stop_gradient=True``) on the cached run's
  ``trace.prepare()`` in its default mode (through the block KV cache for block-causal models,
  where the scorer offers ``use_cache``); ``--canvas-replay`` also times the full-canvas
  replay (``use_cache=False``), which costs about as much as the no-cache sampler.

It also checks that both sampler runs give identical tokens for identical seeds, the max
|Δ behaviour log-prob| between them, and replay parity max |replay − behaviour|.

Progress goes to stderr; the last line of stdout is one JSON object. Example::

    python benchmarks/dlm_sampler.py                      # defaults, ~1 min on 2 CPU cores
    python benchmarks/dlm_sampler.py --canvas-replay --reps 2
    python benchmarks/dlm_sampler.py --gen-length 512 --batch 16 --device cuda --reps 5
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import statistics
import sys
import time

import torch

from diffusion_rl.models.transformer import DiffusionTransformer, TransformerConfig
from diffusion_rl.sampling.token import TokenSamplerConfig, sample_tokens
from diffusion_rl.scoring.replay import ReplayScorer


def log(message: str) -> None:
    print(f"[dlm_sampler] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gen-length", type=int, default=256, help="completion slots per row")
    p.add_argument("--block-size", type=int, default=32, help="sampler and model block size")
    p.add_argument("--batch", type=int, default=4, help="rows per sampler call")
    p.add_argument("--prompt-length", type=int, default=32, help="prompt slots (left-padded)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256, help="d_model")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=64, help="vocabulary size (last id is MASK)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--reps", type=int, default=3, help="timed repetitions (median reported)")
    p.add_argument(
        "--canvas-replay",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="also time the full-canvas replay (use_cache=False; as slow as the no-cache sampler)",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error("--reps must be >= 1")
    if args.gen_length < 1 or args.block_size < 1 or args.batch < 1 or args.prompt_length < 1:
        p.error("--gen-length, --block-size, --batch and --prompt-length must be >= 1")
    return args


def replay_cache_modes(model, canvas: bool) -> list[bool | None]:
    """``use_cache`` values to benchmark: where :class:`ReplayScorer` takes the option, the
    replay through the block KV cache and (with ``canvas``) the full-canvas one; else only the
    scorer's one mode (``None``)."""
    if "use_cache" not in inspect.signature(ReplayScorer).parameters:
        return [None]
    if model.attention != "block_causal":
        return [False]
    return [True, False] if canvas else [True]


def scorer_uses_cache(scorer: ReplayScorer) -> bool:
    return bool(getattr(scorer, "use_cache", False))


def max_abs(delta: torch.Tensor) -> float:
    return float(delta.abs().max()) if delta.numel() else 0.0


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device):
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return time.perf_counter() - start, result


def make_prompts(args, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts, left-padded by 0..P/4 slots so positions and padding are exercised."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    mask_id = args.vocab - 1
    ids = torch.randint(0, mask_id, (args.batch, args.prompt_length), generator=gen)
    max_pad = args.prompt_length // 4
    pads = [(row * 3) % (max_pad + 1) for row in range(args.batch)]
    mask = torch.ones_like(ids, dtype=torch.bool)
    for row, pad in enumerate(pads):
        mask[row, :pad] = False
        ids[row, :pad] = 0
    return ids.to(device), mask.to(device)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(args.seed)

    model_cfg = TransformerConfig(
        vocab_size=args.vocab,
        mask_token_id=args.vocab - 1,
        d_model=args.width,
        n_layers=args.layers,
        n_heads=args.heads,
        max_seq_len=args.prompt_length + args.gen_length,
        attention="block_causal",
        block_size=args.block_size,
    )
    model = DiffusionTransformer(model_cfg).to(device).eval()
    prompt_ids, prompt_mask = make_prompts(args, device)
    seeds = [args.seed * 1000 + row for row in range(args.batch)]
    n_params = model.num_parameters()
    log(
        f"model {args.layers}L x {args.width}d x {args.heads}h, vocab {args.vocab}, "
        f"{n_params / 1e6:.2f}M params on {device} ({torch.get_num_threads()} threads)"
    )

    def sampler_config(use_cache: bool, length: int) -> TokenSamplerConfig:
        return TokenSamplerConfig(
            generation_length=length,
            block_size=args.block_size,
            steps_per_block=args.block_size,
            temperature=args.temperature,
            schedule="fixed",
            use_cache=use_cache,
            stop_at_eos=False,
        )

    def run_sampler(use_cache: bool, length: int = args.gen_length):
        return sample_tokens(
            model,
            prompt_ids,
            prompt_mask,
            sampler_config(use_cache, length),
            seeds=seeds,
            capture=True,
        )

    # ---------------------------------------------------------------- replay scorers
    replay_modes = replay_cache_modes(model, args.canvas_replay)

    def make_scorer(trace, use_cache: bool | None) -> ReplayScorer:
        options = {} if use_cache is None else {"use_cache": use_cache}
        return ReplayScorer(
            model,
            temperature=trace.temperature,
            stop_gradient=True,
            kernel_id=trace.kernel_ids["token_logprobs"],
            **options,
        )

    # ---------------------------------------------------------------- warm-up (one block)
    warm_len = min(args.block_size, args.gen_length)
    warm_start = time.perf_counter()
    for use_cache in (True, False):
        warm = run_sampler(use_cache, warm_len)
    for mode in replay_modes:
        make_scorer(warm.trace, mode).score(warm.trace.prepare())
    synchronize(device)
    log(
        f"warm-up ({warm_len} tokens/row, both sampler paths + replay): "
        f"{time.perf_counter() - warm_start:.2f}s"
    )

    # ---------------------------------------------------------------- sampler, interleaved
    tokens_per_run = args.batch * args.gen_length
    times = {True: [], False: []}
    samples = {}
    deterministic = True
    for rep in range(args.reps):
        for use_cache in (True, False):
            seconds, sample = timed(lambda use_cache=use_cache: run_sampler(use_cache), device)
            times[use_cache].append(seconds)
            if use_cache in samples:
                deterministic &= torch.equal(samples[use_cache].tokens, sample.tokens)
            else:
                samples[use_cache] = sample
            log(
                f"rep {rep + 1}/{args.reps} sampler use_cache={use_cache}: {seconds:.2f}s "
                f"({tokens_per_run / seconds:.1f} tokens/s)"
            )

    cached, uncached = samples[True], samples[False]
    tps_cache = tokens_per_run / statistics.median(times[True])
    tps_nocache = tokens_per_run / statistics.median(times[False])
    tokens_identical = torch.equal(cached.tokens, uncached.tokens)
    commit_steps_identical = torch.equal(cached.trace.commit_steps, uncached.trace.commit_steps)
    logprob_delta = max_abs(cached.trace.behaviour_logprobs - uncached.trace.behaviour_logprobs)

    # ---------------------------------------------------------------- dense replay, interleaved
    batch = cached.trace.prepare()
    active = batch.active
    actions = int(active.sum())
    scorers = {mode: make_scorer(cached.trace, mode) for mode in replay_modes}
    replay_times = {mode: [] for mode in replay_modes}
    replay_scores = {}
    for rep in range(args.reps):
        for mode, scorer in scorers.items():
            seconds, replay_scores[mode] = timed(lambda scorer=scorer: scorer.score(batch), device)
            replay_times[mode].append(seconds)
            log(
                f"rep {rep + 1}/{args.reps} replay use_cache={scorer_uses_cache(scorer)}: "
                f"{seconds:.2f}s ({actions / seconds:.1f} actions/s)"
            )
    replay = {}
    for mode, scorer in scorers.items():
        logprobs = replay_scores[mode].logprobs
        replay["cache" if scorer_uses_cache(scorer) else "nocache"] = {
            "actions_per_s": round(actions / statistics.median(replay_times[mode]), 2),
            "parity_max_abs": max_abs((logprobs - cached.trace.behaviour_logprobs)[active]),
            "parity_vs_nocache_sampler_max_abs": max_abs(
                (logprobs - uncached.trace.behaviour_logprobs)[active]
            ),
            "seconds": [round(t, 4) for t in replay_times[mode]],
        }
    default_mode = "cache" if scorer_uses_cache(make_scorer(cached.trace, None)) else "nocache"
    replay_forwards = int(torch.unique(cached.trace.commit_steps[active]).numel())

    speedup = tps_cache / tps_nocache
    result = {
        "benchmark": "dlm_sampler",
        "sampler_tokens_per_s_cache": round(tps_cache, 2),
        "sampler_tokens_per_s_nocache": round(tps_nocache, 2),
        "cache_speedup": round(speedup, 3),
        "target_met": bool(speedup >= 3),
        "replay_actions_per_s": replay[default_mode]["actions_per_s"],
        "replay_default_mode": default_mode,
        "tokens_identical": bool(tokens_identical),
        "commit_steps_identical": bool(commit_steps_identical),
        "deterministic_across_reps": bool(deterministic),
        "max_abs_behaviour_logprob_delta": logprob_delta,
        "replay_parity_max_abs": replay[default_mode]["parity_max_abs"],
        "replay": replay,
        "seconds": {
            "sampler_cache": [round(t, 4) for t in times[True]],
            "sampler_nocache": [round(t, 4) for t in times[False]],
        },
        "settings": {
            "generation_length": args.gen_length,
            "block_size": args.block_size,
            "steps_per_block": args.block_size,
            "temperature": args.temperature,
            "confidence": "probability",
            "schedule": "fixed",
            "batch": args.batch,
            "prompt_length": args.prompt_length,
            "prompt_pad_slots": (~prompt_mask).sum(1).tolist(),
            "tokens_per_run": tokens_per_run,
            "sampler_steps_per_run": args.gen_length,
            "replay_actions": actions,
            "replay_forwards": replay_forwards,
            "reps": args.reps,
            "canvas_replay": args.canvas_replay,
            "warmup_generation_length": warm_len,
            "seed": args.seed,
        },
        "model": {
            "n_layers": args.layers,
            "d_model": args.width,
            "n_heads": args.heads,
            "vocab_size": args.vocab,
            "max_seq_len": model_cfg.max_seq_len,
            "attention": model_cfg.attention,
            "parameters": n_params,
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
            "kernel_ids": cached.trace.kernel_ids,
        },
    }
    return result


if __name__ == "__main__":
    total_start = time.perf_counter()
    out = main()
    out["total_seconds"] = round(time.perf_counter() - total_start, 2)
    print(json.dumps(out))
