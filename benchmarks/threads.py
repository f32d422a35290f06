"""Training throughput of the built-in models against the number of CPU threads, as JSON.

For each thread count, a fresh subprocess runs ``--steps`` SFT steps of the default text
recipe (the 0.8 M-parameter block-causal transformer, batch 64) and of the default flow-SFT
recipe (the 0.7 M-parameter DiT, batch 64) and reports wall-clock steps per second; the
ratios to one thread are the numbers to read (they are measured side by side, in one run).
This is what the run configs' ``threads: null`` default (:func:`diffusion_rl.recipes.run.
default_threads`) is based on.

    python benchmarks/threads.py [--threads 1 2 4] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, sys, tempfile, time
os.environ["DIFFUSION_RL_NO_PROGRESS"] = "1"
import torch
torch.set_num_threads(int(sys.argv[1]))
steps = int(sys.argv[2])
from diffusion_rl.config import FlowSFTRecipeConfig, SFTRecipeConfig, build_config
from diffusion_rl.recipes.flow_sft import FlowSFTRecipe
from diffusion_rl.recipes.sft import SFTRecipe
out = {}
for name, cls, recipe in (("sft", SFTRecipeConfig, SFTRecipe), ("flow_sft", FlowSFTRecipeConfig, FlowSFTRecipe)):
    with tempfile.TemporaryDirectory() as tmp:
        config = build_config(cls, {"output_dir": tmp, "threads": int(sys.argv[1])})
        job = recipe(config)
        job.step()  # warm-up
        start = time.perf_counter()
        for _ in range(steps):
            job.step()
        out[name] = steps / (time.perf_counter() - start)
print(json.dumps(out))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    rates = {}
    with tempfile.TemporaryDirectory():
        for threads in args.threads:
            result = subprocess.run(
                [sys.executable, "-c", CHILD, str(threads), str(args.steps)],
                check=True,
                capture_output=True,
                text=True,
            )
            rates[threads] = json.loads(result.stdout.strip().splitlines()[-1])
    base = rates[args.threads[0]]
    report = {
        "steps_per_s": {str(t): {k: round(v, 2) for k, v in r.items()} for t, r in rates.items()},
        f"speed_vs_{args.threads[0]}_thread": {
            str(t): {k: round(v / base[k], 2) for k, v in r.items()} for t, r in rates.items()
        },
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
