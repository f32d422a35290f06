"""``diffusion-rl``: the command line.

diffusion-rl quickstart [--mode image]       # SFT then RL on a built-in task, CPU, minutes
diffusion-rl sft --config FILE [--set k=v]   # masked-diffusion SFT from a YAML config
diffusion-rl distill --config FILE           # on-policy distillation from a teacher
diffusion-rl flow-sft / flow-grpo --config FILE  # image models on mini-GenEval
diffusion-rl generate --model DIR --prompt "12+34="  # an image model: a PNG grid
diffusion-rl eval --model DIR [--examples N]      # an image model: accuracy per attribute
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never hang on a hub lookup


def _sampler_overrides(args) -> dict:
    keys = ("temperature", "steps_per_block", "confidence", "schedule", "threshold")
    return {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}


def _add_sampler_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--temperature", type=float, help="0 = greedy (default: the model's)")
    parser.add_argument("--steps-per-block", dest="steps_per_block", type=int)
    parser.add_argument("--confidence", choices=["probability", "margin", "neg_entropy"])
    parser.add_argument("--schedule", choices=["fixed", "threshold"])
    parser.add_argument("--threshold", type=float)


def _before_after(results: dict) -> str:
    return f"accuracy {results['accuracy_before']:.3f} -> {results['accuracy_after']:.3f}"


def _held_out_before_after(results: dict) -> str:
    return f"held-out {_before_after(results)}"


def _distill_summary(results: dict) -> str:
    student, teacher = results["student"], results["teacher"]
    return (
        f"student accuracy {student['accuracy_before']:.3f} -> {student['accuracy_after']:.3f} "
        f"(teacher {teacher['accuracy']:.3f})"
    )


# command → (config class, recipe module and class, one-line summary of results.json)
RECIPES = {
    "sft": (
        "SFTRecipeConfig",
        "sft",
        "SFTRecipe",
        lambda r: f"accuracy {r['eval']['accuracy']:.3f}",
    ),
    "grpo": ("GRPORecipeConfig", "grpo", "GRPORecipe", _before_after),
    "distill": ("DistillRecipeConfig", "distill", "DistillRecipe", _distill_summary),
    "flow-sft": (
        "FlowSFTRecipeConfig",
        "flow_sft",
        "FlowSFTRecipe",
        lambda r: f"held-out accuracy {r['eval']['accuracy']:.3f}; model in {r['model_dir']}",
    ),
    "flow-grpo": ("FlowGRPORecipeConfig", "flow_grpo", "FlowGRPORecipe", _held_out_before_after),
}


def cmd_recipe(args) -> int:
    """A recipe command: its config from YAML and ``--set``, run on the one run loop."""
    import importlib

    from . import config as configs
    from .recipes.run import run

    config_name, module, recipe, summary = RECIPES[args.command]
    config = configs.load_config(args.config, getattr(configs, config_name), args.set)
    recipe_class = getattr(importlib.import_module(f".recipes.{module}", __package__), recipe)
    results = run(config, recipe_class)
    print(f"{summary(results)}; results in {Path(config.output_dir) / 'results.json'}")
    return 0


def cmd_quickstart(args) -> int:
    from .quickstart import run_quickstart, run_quickstart_image

    if args.mode == "image":
        output_dir = args.output_dir or "runs/quickstart_image"
        run_quickstart_image(
            output_dir,
            steps=args.steps,
            rl_steps=args.rl_steps,
            overrides=args.set,
            threads=args.threads,
        )
    else:
        output_dir = args.output_dir or "runs/quickstart"
        run_quickstart(
            output_dir,
            steps=args.steps,
            rl_steps=args.rl_steps,
            overrides=args.set,
            threads=args.threads,
        )
    return 0


def _token_sampler(info: dict, sampler_overrides: dict):
    """The model directory's recorded token sampler, with the sampler flags applied."""
    from .sampling import TokenSamplerConfig

    return TokenSamplerConfig(**{**info.get("sampler", {}), **sampler_overrides})


def _refuse_flags(args, flags: dict, kind: str) -> None:
    """A ValueError naming the first given flag of ``flags`` (name → value): it applies to
    ``kind`` models, and ``args.model`` is the other kind."""
    given = sorted(k for k, v in flags.items() if v is not None)
    if given:
        other = "an image" if kind == "token" else "a token"
        raise ValueError(
            f"--{given[0].replace('_', '-')}: applies to {kind} models; {args.model} is {other} model"
        )


def _add_image_sampler_flags(group) -> None:
    group.add_argument(
        "--num-steps", dest="num_steps", type=int, help="ODE steps (default: the model's)"
    )
    group.add_argument("--guidance", type=float, help="CFG scale (default: the model's)")


def _check_no_token_flags(args, *names: str) -> None:
    flags = {**_sampler_overrides(args), **{name: getattr(args, name) for name in names}}
    _refuse_flags(args, flags, "token")


def _serving_sampler(info: dict, args):
    """The model directory's recorded sampler as ODE, with ``--num-steps`` / ``--guidance``."""
    from .sampling.flow import FlowSamplerConfig

    settings = {**info.get("sampler", {}), "mode": "ode", "share_group_noise": False}
    for key, value in (("num_steps", args.num_steps), ("guidance_scale", args.guidance)):
        if value is not None:
            settings[key] = value
    return FlowSamplerConfig(**settings)


def cmd_generate_images(args, loaded) -> int:
    """``generate`` for a loaded flow (image) model: a captioned PNG grid of the samples."""
    from .plots import save_image_grid
    from .sampling.flow import sample_flow
    from .tasks.geneval import parse_prompt

    _check_no_token_flags(args, "length", "trace")
    sampler = _serving_sampler(loaded.info, args)
    prompts = [p for _ in range(args.samples) for p in args.prompt]  # sample-major
    seeds = [args.seed + i for i in range(len(prompts))]
    images = sample_flow(loaded.model, prompts, sampler, seeds=seeds).images.float()
    captions = list(prompts)
    task_info = loaded.info.get("task") or {}
    if task_info.get("name") == "geneval":  # mark what the verifier finds right
        from .tasks.geneval import GenEvalTask

        task = GenEvalTask.from_info(task_info)
        for i, prompt in enumerate(prompts):
            try:
                verdict = task.verify(images[i : i + 1], [parse_prompt(prompt)])[0]["overall"]
            except ValueError:
                continue
            captions[i] = f"{prompt} {'ok' if verdict else 'x'}"
    path = save_image_grid(
        images,
        args.output,
        nrow=min(8, len(args.prompt) * args.samples),
        captions=captions,
        upscale=6,
    )
    for seed, caption in zip(seeds, captions):
        print(f"seed {seed}: {caption}")
    print(f"grid written to {path}")
    return 0


def cmd_generate_tokens(args, loaded) -> int:
    """``generate`` for a loaded token model: the completion of every ``--prompt``."""
    import torch

    from .sampling import sample_tokens

    sampler = _token_sampler(loaded.info, _sampler_overrides(args))
    if args.length is not None:
        sampler = sampler.model_copy(update={"generation_length": args.length})
    tok = loaded.tokenizer
    encoded = [tok.encode(p) for p in args.prompt]
    width = max(len(e) for e in encoded)
    ids = torch.tensor([[tok.pad_id] * (width - len(e)) + e for e in encoded])
    mask = torch.tensor([[False] * (width - len(e)) + [True] * len(e) for e in encoded])
    sample = sample_tokens(
        loaded.model,
        ids,
        mask,
        sampler,
        seeds=[args.seed + i for i in range(len(encoded))],
        stop_token_id=tok.eos_id,
        capture=args.trace is not None,
    )
    for prompt, text in zip(args.prompt, tok.batch_decode(sample.tokens)):
        print(f"{prompt}{text}")
    if args.trace is not None:
        trace = sample.trace
        record = {
            "prompts": args.prompt,
            "tokens": trace.tokens.tolist(),
            "commit_steps": trace.commit_steps.tolist(),
            "behaviour_logprobs": trace.behaviour_logprobs.tolist(),
            "sampler": trace.sampler,
            "kernel_ids": trace.kernel_ids,
            "weights_version": trace.weights_version,
        }
        Path(args.trace).write_text(json.dumps(record, indent=1) + "\n")
        print(f"trace written to {args.trace}", file=sys.stderr)
    return 0


def cmd_eval_images(args, loaded) -> int:
    """``eval`` for a loaded flow (image) model: verifier accuracy per attribute on its task's
    ``--split`` prompts, ``--samples`` images each (seeds ``--seed``, ``--seed`` + 1, ...)."""
    from .evaluation import evaluate_images
    from .tasks.geneval import GenEvalTask

    _check_no_token_flags(args, "examples")
    task_info = loaded.info.get("task")
    if not task_info or task_info.get("name") != GenEvalTask.name:
        raise ValueError(f"--model: {args.model} records no mini-GenEval task to evaluate on")
    sampler = _serving_sampler(loaded.info, args)
    result = evaluate_images(
        loaded.model,
        GenEvalTask.from_info(task_info),
        sampler,
        samples_per_prompt=args.samples or 16,
        split=args.split,
        seed=args.seed,
    )
    print(
        f"accuracy {result.accuracy:.3f} on {result.num_images} {args.split} images "
        f"({sampler.num_steps} ODE steps, guidance {sampler.guidance_scale:g})"
    )
    print("  " + "  ".join(f"{k} {v:.3f}" for k, v in result.attributes.items()))
    if args.output:
        record = {**result.to_dict(), "sampler": sampler.model_dump(mode="json")}
        Path(args.output).write_text(json.dumps(record, indent=2) + "\n")
    return 0


def cmd_eval_tokens(args, loaded) -> int:
    """``eval`` for a loaded token model: accuracy on its task's ``--split`` problems."""
    from .evaluation import evaluate_task, format_samples
    from .tasks import get_task

    image_flags = {"samples": args.samples, "num_steps": args.num_steps, "guidance": args.guidance}
    _refuse_flags(args, image_flags, "image")
    sampler = _token_sampler(loaded.info, _sampler_overrides(args))
    task_info = dict(loaded.info.get("task", {"name": "arithmetic"}))
    task = get_task(task_info.pop("name"), **task_info)
    result = evaluate_task(
        loaded.model,
        task,
        sampler,
        num_examples=args.examples or 256,
        split=args.split,
        seed=args.seed,
    )
    print(f"accuracy {result.accuracy:.3f} on {result.num_examples} {args.split} problems")
    print(format_samples(result.samples))
    if args.output:
        Path(args.output).write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    return 0


# ``generate`` / ``eval`` per model kind (``LoadedModel.kind``): each takes (args, loaded).
GENERATE = {"token": cmd_generate_tokens, "flow": cmd_generate_images}
EVAL = {"token": cmd_eval_tokens, "flow": cmd_eval_images}


def _dispatch(table: dict, args) -> int:
    """Load ``args.model`` once and run ``table``'s command for its kind."""
    from .models.io import load_model

    loaded = load_model(args.model)
    if loaded.kind not in table:
        raise ValueError(
            f"--model: {args.model} is a {loaded.kind} model; {args.command} handles "
            f"{' and '.join(sorted(table))} models"
        )
    return table[loaded.kind](args, loaded)


def cmd_generate(args) -> int:
    return _dispatch(GENERATE, args)


def cmd_eval(args) -> int:
    return _dispatch(EVAL, args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diffusion-rl", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("quickstart", help="SFT then GRPO on the built-in task, on CPU, in minutes")
    p.add_argument(
        "--mode",
        choices=["text", "image"],
        default="text",
        help="text: 2-digit addition (default); image: flow SFT + Flow-GRPO on mini-GenEval",
    )
    p.add_argument(
        "--output-dir", default=None, help="default runs/quickstart (image: runs/quickstart_image)"
    )
    p.add_argument("--steps", type=int, default=None, help="SFT steps (default: the quickstart's)")
    p.add_argument(
        "--rl-steps", type=int, default=None, help="GRPO steps (default: the quickstart's)"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads (default: 1, the fastest for the built-in models' size)",
    )
    p.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="override sft.KEY or grpo.KEY"
    )
    p.set_defaults(func=cmd_quickstart)

    for name, help_text, example in (
        ("sft", "masked-diffusion SFT from a YAML config", "optim.lr=3e-4"),
        ("grpo", "GRPO / DAPO / Dr.GRPO from a YAML config", "policy.algorithm=dapo"),
        ("distill", "on-policy distillation from a YAML config", "teacher.path=DIR"),
        ("flow-sft", "rectified-flow SFT of an image model", "steps=500"),
        ("flow-grpo", "Flow-GRPO of an image model", "policy.beta=0"),
    ):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--config", help="YAML file (omit for all defaults)")
        p.add_argument(
            "--set",
            action="append",
            metavar="KEY=VALUE",
            help=f"override a config key, e.g. {example}",
        )
        p.set_defaults(func=cmd_recipe)

    p = sub.add_parser(
        "generate", help="sample completions (token model) or a PNG grid (image model)"
    )
    p.add_argument(
        "--model",
        required=True,
        help="a model directory (e.g. runs/quickstart/grpo/model, runs/flow_grpo/model)",
    )
    p.add_argument("--prompt", required=True, action="append", help="repeat for a batch")
    p.add_argument("--length", type=int, help="generation length (default: the model's task)")
    p.add_argument("--seed", type=int, default=0, help="row i uses seed + i")
    p.add_argument("--trace", help="also write the captured trace as JSON here")
    _add_sampler_flags(p)
    images = p.add_argument_group("image models")
    images.add_argument(
        "--output", default="samples.png", help="the PNG grid (default: %(default)s)"
    )
    images.add_argument("--samples", type=int, default=1, help="images per prompt")
    _add_image_sampler_flags(images)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("eval", help="verifier accuracy of a saved model on its task")
    p.add_argument("--model", required=True, help="a token or image model directory")
    p.add_argument("--examples", type=int, help="problems (token models; default 256)")
    p.add_argument("--split", choices=["eval", "train"], default="eval")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", help="write the result JSON here")
    _add_sampler_flags(p)
    images = p.add_argument_group("image models")
    images.add_argument("--samples", type=int, help="images per prompt (default 16)")
    _add_image_sampler_flags(images)
    p.set_defaults(func=cmd_eval)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError, LookupError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; the last checkpoint is intact", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
