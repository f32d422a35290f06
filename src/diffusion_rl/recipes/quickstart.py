"""Recipe: the out-of-the-box run. Masked-diffusion SFT of the built-in block-causal
transformer on 3-digit addition, then an evaluation with the serving sampler; prints the
accuracy and sample completions and writes ``results.json`` — a few minutes on a laptop CPU.
"""

from __future__ import annotations

from pathlib import Path

from ..config import SFTRecipeConfig, build_config, merge_dicts, parse_overrides
from ..evaluation import format_samples
from .sft import run_sft

QUICKSTART_STEPS = 2000


def run_quickstart(
    output_dir: str = "runs/quickstart",
    steps: int | None = None,
    overrides: list[str] | None = None,
) -> dict:
    data = {"output_dir": output_dir, "steps": steps or QUICKSTART_STEPS, "eval_every": 500}
    data = merge_dicts(data, parse_overrides(overrides))
    config = build_config(SFTRecipeConfig, data, "quickstart")
    print(f"diffusion-rl quickstart: SFT for {config.steps} steps into {config.output_dir}")
    results = run_sft(config)
    print()
    print(
        f"held-out accuracy after SFT: {results['eval']['accuracy']:.1%} on {results['eval']['num_examples']} problems"
    )
    print("samples (prompt → completion):")
    print(format_samples(results["eval"]["samples"]))
    out = Path(config.output_dir)
    print(f"\nmetrics: {out / 'results.json'} (summary), {out / 'metrics.jsonl'} (per step)")
    print(f"curves:  {out / 'curves.png'}")
    print(
        f"model:   {out / 'model'}  — try: diffusion-rl generate --model {out / 'model'} --prompt 123+456="
    )
    return results
