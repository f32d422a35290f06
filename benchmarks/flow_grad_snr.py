"""How much signal one Flow-GRPO batch gradient carries: cosines between independent batches.

For a flow model (default: a saved flow-SFT model directory), draws ``--batches`` rollout
batches of ``--prompts`` train prompts × ``--group-size`` SDE samples (different prompts and
seeds per batch), computes each batch's policy gradient at ratio 1 (``−mean(A · ℓθ)`` over
rows and SDE steps, group advantages of the recipe's mini-GenEval reward), and reports the
cosine between every pair, for each combination of ``share_group_noise`` and SDE window.
Two estimates of one true gradient ``g`` with noise ``n`` have cosine ≈ |g|² / (|g|² + |n|²):
near 0 means one batch's gradient is mostly noise. Prints one JSON object.

    python benchmarks/flow_grad_snr.py --model runs/flow_sft/model
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="runs/flow_sft/model", help="a flow model directory")
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from diffusion_rl.advantages import group_advantages
    from diffusion_rl.config import FlowGRPORecipeConfig, build_config
    from diffusion_rl.models.io import load_model
    from diffusion_rl.rewards import CombinedReward, get_reward
    from diffusion_rl.rollout import rollout_seed
    from diffusion_rl.sampling.flow import sample_flow
    from diffusion_rl.scoring.flow import FlowReplayScorer
    from diffusion_rl.tasks.geneval import GenEvalTask

    loaded = load_model(args.model)
    model, task = loaded.model, GenEvalTask.from_info(loaded.info["task"])
    config = build_config(FlowGRPORecipeConfig, {"model": {"path": args.model}})
    reward_fn = CombinedReward(
        [(get_reward(r.name, **r.options), r.weight) for r in config.rewards]
    )  # the recipe's rewards

    def batch_gradient(sampler, batch: int) -> torch.Tensor:
        indices = range(batch * args.prompts, (batch + 1) * args.prompts)
        examples = [task.example(i, "train") for i in indices for _ in range(args.group_size)]
        seeds = [rollout_seed(0, i, g) for i in indices for g in range(args.group_size)]
        sample = sample_flow(
            model,
            [e.prompt for e in examples],
            sampler,
            seeds=seeds,
            capture=True,
            group_size=args.group_size,
        )
        rewards = reward_fn(sample.images.float(), examples).total
        advantages = group_advantages(rewards, args.group_size, config.policy.advantage_spec)
        model.zero_grad()
        scores = FlowReplayScorer.for_trace(model, sample.trace).score_trace(sample.trace)
        (-(advantages[:, None] * scores.logprobs).mean()).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    results = []
    for share, window in itertools.product((False, True), (None, (0, 4), (0, 2))):
        sampler = config.sampler.model_copy(
            update={"share_group_noise": share, "sde_window": window}
        )
        grads = [batch_gradient(sampler, b) for b in range(args.batches)]
        cosines = [
            float(torch.nn.functional.cosine_similarity(a, b, dim=0))
            for a, b in itertools.combinations(grads, 2)
        ]
        mean = sum(cosines) / len(cosines)
        std = (sum((c - mean) ** 2 for c in cosines) / len(cosines)) ** 0.5
        results.append(
            {
                "share_group_noise": share,
                "sde_window": window,
                "cosine_mean": round(mean, 4),
                "cosine_std": round(std, 4),
            }
        )
    print(
        json.dumps(
            {
                "benchmark": "flow_grad_snr",
                "model": args.model,
                "images_per_batch": args.prompts * args.group_size,
                "batches": args.batches,
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
