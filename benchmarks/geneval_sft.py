"""Mini-GenEval accuracy of the built-in FlowDiT after rectified-flow SFT on rendered images.

Trains ``FlowDiT`` with the project's ``FlowMatchingSFT`` loss and ``Trainer`` on the task's
training stream (batch ``--batch`` of freshly rendered images per step, prompt dropout for
classifier-free guidance), then samples every train and held-out prompt ``--per-prompt`` times
with the serving sampler (``sample_flow``, Euler ODE, CFG) and reports the verifier's accuracy
per attribute. Single-threaded by default (the cores are shared); the time reported is the
process CPU time of the training loop. Saves the model directory and a sample grid under
``--output-dir`` when given; ``--model DIR`` only evaluates a saved FlowDiT (e.g. after RL)
with the same protocol. Prints progress to stderr and one JSON object on stdout.

    python benchmarks/geneval_sft.py --steps 2000            # ~4 CPU-minutes
    python benchmarks/geneval_sft.py --steps 500 --output-dir runs/geneval_sft
    python benchmarks/geneval_sft.py --model runs/geneval_sft/model   # evaluate only
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from diffusion_rl.models.dit import FlowDiT, FlowDiTConfig
from diffusion_rl.objectives.flow_sft import FlowMatchingSFT, FlowSFTConfig, flow_sft_batch
from diffusion_rl.plots import save_image_grid
from diffusion_rl.sampling.flow import FlowSamplerConfig, sample_flow
from diffusion_rl.seeding import noise_keys
from diffusion_rl.tasks.geneval import GenEvalConfig, GenEvalTask, attribute_accuracy
from diffusion_rl.train.trainer import OptimConfig, Trainer


def evaluate(model, task, split, per_prompt, sampler):
    """Accuracy per attribute over ``per_prompt`` samples of every prompt of ``split`` (seeds
    0, 1, ...), overall and per prompt kind; also the images and their examples."""
    examples = [e for e in task.prompts(split) for _ in range(per_prompt)]
    sample = sample_flow(
        model, [e.prompt for e in examples], sampler, seeds=list(range(len(examples)))
    )
    results = task.verify(sample.images, examples)
    accuracy = {"all": attribute_accuracy(results)}
    for kind in sorted({e.kind for e in examples}):
        accuracy[kind] = attribute_accuracy(
            [r for r, e in zip(results, examples) if e.kind == kind]
        )
    rounded = {k: {a: round(v, 4) for a, v in acc.items()} for k, acc in accuracy.items()}
    return rounded, sample.images, examples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--schedule", choices=["constant", "cosine"], default="constant")
    ap.add_argument("--sigma-sampling", choices=["uniform", "logit_normal"], default="uniform")
    ap.add_argument("--cond-dropout", type=float, default=0.1)
    ap.add_argument("--image-size", type=int, default=16)
    ap.add_argument("--patch-size", type=int, default=4)
    ap.add_argument("--width", type=int, default=96)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--sample-steps", type=int, default=10)
    ap.add_argument("--shift", type=float, default=1.0)
    ap.add_argument("--guidance", type=float, default=3.0)
    ap.add_argument("--per-prompt", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-dir", default=None)
    ap.add_argument("--model", default=None, help="evaluate this saved FlowDiT, no training")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    sampler = FlowSamplerConfig(
        num_steps=args.sample_steps, shift=args.shift, guidance_scale=args.guidance
    )
    if args.model:
        model = FlowDiT.from_pretrained(args.model)
        task = GenEvalTask.from_info(model.config.task)
        result = {
            "model": args.model,
            "sampler": sampler.model_dump(),
            "per_prompt": args.per_prompt,
        }
        for split in ("train", "eval"):
            result[f"{split}_accuracy"] = evaluate(model, task, split, args.per_prompt, sampler)[0]
        print(json.dumps(result))
        return

    task = GenEvalTask(GenEvalConfig(image_size=args.image_size))
    model = FlowDiT(
        FlowDiTConfig(
            image_size=args.image_size,
            patch_size=args.patch_size,
            d_model=args.width,
            n_layers=args.layers,
            task=task.info(),
        )
    )
    loss = FlowMatchingSFT(
        FlowSFTConfig(sigma_sampling=args.sigma_sampling, cond_dropout=args.cond_dropout)
    )
    optim = OptimConfig(
        lr=args.lr,
        warmup_steps=min(100, args.steps),
        schedule=args.schedule,
        total_steps=args.steps if args.schedule != "constant" else None,
    )
    trainer = Trainer(model, loss, optim, seed=args.seed)
    print(f"FlowDiT with {model.num_parameters():,} parameters", file=sys.stderr)

    cpu, losses = 0.0, []
    for step in range(args.steps):
        start = time.process_time()
        examples, images = task.train_batch(step, args.batch)
        keys = noise_keys(range(step * args.batch, (step + 1) * args.batch), args.seed, step)
        latents, prompts = model.encode_images(images), [e.prompt for e in examples]
        batch = flow_sft_batch(model, latents, prompts, noise_seeds=keys)
        losses.append(trainer.train_step([batch]).metrics["loss"])
        cpu += time.process_time() - start
        if (step + 1) % 250 == 0:
            recent = sum(losses[-250:]) / len(losses[-250:])
            print(f"step {step + 1}: loss {recent:.4f}, {cpu:.0f} CPU-s", file=sys.stderr)

    model.eval()
    result = {
        "settings": vars(args),
        "parameters": model.num_parameters(),
        "train_cpu_s": round(cpu, 1),
        "cpu_s_per_step": round(cpu / max(1, args.steps), 4),
        "final_loss_250": sum(losses[-250:]) / max(1, len(losses[-250:])),
        "torch": torch.__version__,
    }
    for split in ("train", "eval"):
        accuracy, images, examples = evaluate(model, task, split, args.per_prompt, sampler)
        result[f"{split}_accuracy"] = accuracy
        if args.output_dir and split == "eval":
            model.save_pretrained(f"{args.output_dir}/model")
            picked = list(range(0, len(examples), args.per_prompt))[:32]
            save_image_grid(
                images[picked],
                f"{args.output_dir}/samples_eval.png",
                nrow=8,
                captions=[examples[i].prompt for i in picked],
            )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
