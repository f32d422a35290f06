"""``generate`` and ``eval`` on a saved model directory, for token and image (flow) models,
and ``generate --workflow`` for multi-stage workflows.

The model directory is loaded once (bounded by ``models.io``) and its kind picks the command
(:data:`GENERATE`, :data:`EVAL`). The sampler is the one the directory records with the
sampler flags applied; a flag for the other model kind, a flag value the sampler refuses, or
an ``--output`` in the wrong format is a :class:`UsageError` naming the flag.

``--model`` may also be a local diffusers pipeline directory (SD3, FLUX, Wan; served at the
pipeline's default resolution with the default flow sampler) or the model a flow recipe wrote
for one (the base pipeline + LoRA or transformer weights, at the resolution and with the
sampler it was trained with); a text-to-video model writes its clips as a GIF or PNG frame
strips (docs/flow_models.md).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from .flags import (
    IMAGE_FORMATS,
    IMAGE_ONLY,
    MAX_IMAGES,
    MAX_SEED,
    SAMPLER_FLAGS,
    TEXT_FORMATS,
    TOKEN_ONLY,
    WORKFLOW_FORMATS,
    UsageError,
)


def _check_kind_flags(args, kind: str) -> None:
    """Refuse a flag given for the other model kind (``kind`` is ``args.model``'s)."""
    other = IMAGE_ONLY if kind == "token" else TOKEN_ONLY
    for dest, flag in other.items():
        if getattr(args, dest, None) is not None:
            applies = "image" if kind == "token" else "token"
            actual = "a token" if kind == "token" else "an image (flow)"
            raise UsageError(f"{flag}: applies to {applies} models; {args.model} is {actual} model")


def _check_output(args, extensions, what: str) -> None:
    if args.output is not None and Path(args.output).suffix.lower() not in extensions:
        raise UsageError(
            f"--output: {args.output}: {what} {', '.join(extensions)}, got "
            f"{Path(args.output).suffix!r}"
        )


def _sampler(cls, recorded: dict, flags: dict, args, fixed: dict | None = None):
    """``cls`` from the model's ``recorded`` sampler settings under the flags' values
    (``flags``: field → value) and ``fixed`` settings; a validation error names the flag that
    set the field, or else the model's info file (and the flags given)."""
    from pydantic import ValidationError

    from ..models.io import INFO_FILE, describe_field_error

    try:
        return cls(**{**recorded, **flags, **(fixed or {})})
    except ValidationError as error:
        message = describe_field_error(error.errors()[0])
        field = re.match(r"(?:missing key )?([a-z_]+)", message)
        name = field.group(1) if field else ""
        if name in flags:
            raise UsageError(message.replace(name, SAMPLER_FLAGS[name], 1)) from None
        given = f" (with {', '.join(SAMPLER_FLAGS[k] for k in flags)})" if flags else ""
        raise UsageError(
            f"--model: {Path(args.model) / INFO_FILE}: sampler.{message}{given}"
        ) from None


def _model_block_size(model) -> int | None:
    """The block size a block-causal model was built for (SDAR, the built-in transformer with
    ``attention: block_causal``); None for a model that decodes blocks of any size."""
    if getattr(model, "attention", None) != "block_causal":
        return None
    block = getattr(model, "block_size", None)
    return block if isinstance(block, int) and not isinstance(block, bool) else None


def _token_sampler(args, info: dict, model=None):
    """The model directory's recorded token sampler, with the sampler flags applied; a
    ``--threshold`` / ``--steps-per-block`` the resulting schedule ignores is refused.

    Unless the directory records a block size, a block-causal ``model``'s own block size is
    the default (and ``--block-size`` must equal it); ``steps_per_block``, when neither
    recorded nor given, is then at most one block."""
    from ..sampling import TokenSamplerConfig

    keys = ("temperature", "steps_per_block", "confidence", "schedule", "threshold", "block_size")
    overrides = {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}
    if getattr(args, "length", None) is not None:
        overrides["generation_length"] = args.length
    recorded = dict(info.get("sampler") or {})
    model_block = _model_block_size(model)
    if model_block is not None and overrides.get("block_size", model_block) != model_block:
        raise UsageError(
            f"--block-size: this block-causal model was built for blocks of {model_block}, "
            f"got {overrides['block_size']}; omit --block-size (the model's is the default)"
        )
    if model_block is not None and "block_size" not in recorded:
        recorded["block_size"] = model_block
    block = overrides.get("block_size", recorded.get("block_size"))
    if isinstance(block, int) and "steps_per_block" not in {**recorded, **overrides}:
        default = TokenSamplerConfig.model_fields["steps_per_block"].default
        recorded["steps_per_block"] = max(1, min(default, block))
    sampler = _sampler(TokenSamplerConfig, recorded, overrides, args)
    unused = {"fixed": "threshold", "threshold": "steps_per_block"}[sampler.schedule]
    if unused in overrides:
        other = "threshold" if sampler.schedule == "fixed" else "fixed"
        raise UsageError(
            f"{SAMPLER_FLAGS[unused]}: used only by the {other} schedule; the sampler here "
            f"uses schedule {sampler.schedule!r} (add --schedule {other})"
        )
    return sampler


def _serving_sampler(args, info: dict):
    """The model directory's recorded sampler as ODE, with ``--num-steps`` / ``--guidance``."""
    from ..sampling.flow import FlowSamplerConfig

    flags = {}
    for key, value in (("num_steps", args.num_steps), ("guidance_scale", args.guidance)):
        if value is not None:
            flags[key] = value
    serving = {"mode": "ode", "share_group_noise": False}
    return _sampler(FlowSamplerConfig, info.get("sampler", {}), flags, args, serving)


def _check_seeds(args, rows: int) -> None:
    if args.seed + rows - 1 > MAX_SEED:
        raise UsageError(
            f"--seed: rows use seeds --seed ... --seed + {rows - 1}, which must stay <= "
            f"{MAX_SEED} (got --seed {args.seed})"
        )


def _upscale(images) -> int:
    """Grid enlargement: 6× for the built-in 16-pixel images, none from 96 pixels up."""
    return max(1, 96 // int(images.shape[-1]))


def save_images(images, path: str, captions: list[str], nrow: int) -> Path:
    """A captioned grid of ``images`` in the format ``path``'s extension names
    (:data:`IMAGE_FORMATS`)."""
    import tempfile

    from PIL import Image

    from ..plots import save_image_grid

    target = Path(path)
    fmt = IMAGE_FORMATS[target.suffix.lower()]
    upscale = _upscale(images)
    if fmt == "PNG":
        return save_image_grid(images, target, nrow=nrow, captions=captions, upscale=upscale)
    with tempfile.TemporaryDirectory() as scratch:  # the grid is drawn as PNG, then converted
        grid = save_image_grid(
            images, Path(scratch) / "grid.png", nrow=nrow, captions=captions, upscale=upscale
        )
        with Image.open(grid) as image:
            target.parent.mkdir(parents=True, exist_ok=True)
            image.convert("RGB").save(target, format=fmt, quality=95)
    return target


VIDEO_FORMATS = (".gif", ".png")  # generate, text-to-video models: a GIF or frame strips


def _makes_clips(model) -> bool:
    """Whether a flow model's rows are clips (a text-to-video pipeline)."""
    return len(getattr(model, "output_shape", ())) == 4


def _judged(task, model):
    """The image task as ``model``'s outputs meet it: for a diffusers pipeline a
    :class:`~diffusion_rl.recipes.flow_models.TaskView` (clips frame by frame, k× images
    after a k × k area downsample); ``ValueError`` when its size is no multiple of the
    task's."""
    shape = getattr(model, "output_shape", None)
    if shape is None:
        return task
    from ..recipes.flow_models import TaskView

    size, height, width = task.config.image_size, shape[-2], shape[-1]
    if height != width or height % size:
        raise ValueError(
            f"the model makes {height} × {width} images, no multiple of its task's "
            f"image_size={size}"
        )
    return TaskView(task, height // size)


def cmd_generate_images(args, loaded) -> int:
    """``generate`` for a loaded flow (image) model: a captioned grid of the samples (for a
    text-to-video model, an animated GIF of the clips or PNG frame strips)."""
    from ..sampling.flow import sample_flow
    from ..tasks.geneval import parse_prompt

    _check_kind_flags(args, "flow")
    clips = _makes_clips(loaded.model)
    if clips:
        _check_output(args, VIDEO_FORMATS, "a text-to-video model's clips are written as")
        output = args.output or "samples.gif"
    else:
        _check_output(args, tuple(IMAGE_FORMATS), "an image model's grid is written as")
        output = args.output or "samples.png"
    samples = args.samples or 1
    prompts = [p for _ in range(samples) for p in args.prompt]  # sample-major
    if len(prompts) > MAX_IMAGES:
        raise UsageError(
            f"--samples: {samples} x {len(args.prompt)} prompts = {len(prompts)} images, more "
            f"than the limit {MAX_IMAGES}"
        )
    _check_seeds(args, len(prompts))
    try:
        loaded.model.encode_prompts(args.prompt)
    except ValueError as error:
        raise UsageError(f"--prompt: {error}".replace("encode_prompts: ", "")) from None
    sampler = _serving_sampler(args, loaded.info)
    seeds = [args.seed + i for i in range(len(prompts))]
    images = sample_flow(loaded.model, prompts, sampler, seeds=seeds).images.float()
    captions = list(prompts)
    task_info = loaded.info.get("task") or {}
    if task_info.get("name") == "geneval":  # mark what the verifier finds right
        from ..tasks.geneval import GenEvalTask

        task = _judged(GenEvalTask.from_info(task_info), loaded.model)
        for i, prompt in enumerate(prompts):
            try:
                verdict = task.verify(images[i : i + 1], [parse_prompt(prompt)])[0]["overall"]
            except ValueError:
                continue
            captions[i] = f"{prompt} {'ok' if verdict else 'x'}"
    if clips:
        from ..plots import save_video_gif, save_video_strip

        nrow, upscale = min(8, len(prompts)), _upscale(images)
        if output.lower().endswith(".gif"):
            path = save_video_gif(images, output, nrow=nrow, upscale=upscale)
        else:
            path = save_video_strip(images, output, captions=captions, upscale=upscale)
    else:
        path = save_images(images, output, captions, nrow=min(8, len(prompts)))
    for seed, caption in zip(seeds, captions):
        print(f"seed {seed}: {caption}")
    print(f"grid written to {path}")
    return 0


def cmd_generate_tokens(args, loaded) -> int:
    """``generate`` for a loaded token model: the completion of every ``--prompt``."""
    from ..serving.generation import left_pad, sample_completions

    _check_kind_flags(args, "token")
    _check_output(args, TEXT_FORMATS, "a token model's completions are written as")
    _check_seeds(args, len(args.prompt))
    sampler = _token_sampler(args, loaded.info, loaded.model)
    tok = loaded.tokenizer
    try:
        encoded = [tok.encode(p) for p in args.prompt]
    except ValueError as error:
        raise UsageError(f"--prompt: {error}".replace("CharTokenizer.encode: ", "")) from None
    width, length = max(len(e) for e in encoded), sampler.generation_length
    limit = loaded.model.config.max_seq_len
    if width >= limit:
        raise UsageError(
            f"--prompt: {width} tokens leave no room to generate within the model's "
            f"max_seq_len={limit}"
        )
    if width + length > limit:
        flag, what = ("--length", "--length") if args.length else ("--prompt", "the model's")
        raise UsageError(
            f"{flag}: a prompt of {width} tokens plus {what} {length} generated tokens "
            f"exceeds the model's max_seq_len={limit}; use --length <= {limit - width} or a "
            "shorter prompt"
        )
    ids, mask = left_pad(encoded, tok.pad_id)
    seeds = [args.seed + i for i in range(len(encoded))]
    sample = sample_completions(
        loaded.model, tok, ids, mask, sampler, seeds, capture=args.trace is not None
    )
    completions = tok.batch_decode(sample.tokens)
    for prompt, text in zip(args.prompt, completions):
        print(f"{prompt}{text}")
    if args.output is not None:
        path = Path(args.output)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix.lower() == ".json":
            rows = [
                {"prompt": p, "completion": c, "seed": s}
                for p, c, s in zip(args.prompt, completions, seeds)
            ]
            record = {"samples": rows, "sampler": sampler.model_dump(mode="json")}
            path.write_text(json.dumps(record, indent=2) + "\n")
        else:
            path.write_text("".join(f"{p}{c}\n" for p, c in zip(args.prompt, completions)))
        print(f"completions written to {path}", file=sys.stderr)
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
        Path(args.trace).parent.mkdir(parents=True, exist_ok=True)
        Path(args.trace).write_text(json.dumps(record, indent=1) + "\n")
        print(f"trace written to {args.trace}", file=sys.stderr)
    return 0


def _report_images(args, result, sampler, headline: str, parts: dict) -> None:
    """Print an image evaluation (``headline`` on N images, then ``parts``) and write it to
    ``--output`` as JSON with the sampler."""
    print(
        f"{headline} on {result.num_images} {args.split} images "
        f"({sampler.num_steps} ODE steps, guidance {sampler.guidance_scale:g})"
    )
    print("  " + "  ".join(f"{k} {v:.3f}" for k, v in parts.items()))
    if args.output:
        record = {**result.to_dict(), "sampler": sampler.model_dump(mode="json")}
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(record, indent=2) + "\n")


def cmd_eval_images(args, loaded) -> int:
    """``eval`` for a loaded flow (image) model: verifier accuracy per attribute on its task's
    ``--split`` prompts, ``--samples`` images each (seeds ``--seed``, ``--seed`` + 1, ...)."""
    from ..evaluation import evaluate_images
    from ..tasks.geneval import GenEvalTask

    _check_kind_flags(args, "flow")
    task_info = loaded.info.get("task")
    if task_info and task_info.get("name") == "prompts":
        return _eval_prompt_list(args, loaded, task_info)
    if not task_info or task_info.get("name") != GenEvalTask.name:
        raise UsageError(f"--model: {args.model} records no mini-GenEval task to evaluate on")
    task = GenEvalTask.from_info(task_info)
    samples = args.samples or 16
    _check_seeds(args, samples * len(task.prompts(args.split)))
    sampler = _serving_sampler(args, loaded.info)
    pipeline = hasattr(loaded.model, "output_shape")  # a diffusers pipeline: small batches
    try:
        task = _judged(task, loaded.model)
    except ValueError as error:
        raise UsageError(f"--model: {args.model}: {error}") from None
    result = evaluate_images(
        loaded.model,
        task,
        sampler,
        samples_per_prompt=samples,
        split=args.split,
        seed=args.seed,
        batch_size=(sampler.micro_batch_size or 8) if pipeline else 128,
    )
    _report_images(args, result, sampler, f"accuracy {result.accuracy:.3f}", result.attributes)
    return 0


def _eval_prompt_list(args, loaded, task_info: dict) -> int:
    """``eval`` for a flow model trained on a prompt list (no verifier): the rewards its run
    recorded (weighted total and each term, means) on the ``--split`` prompts of its file,
    ``--samples`` images each (default 1; seeds ``--seed``, ``--seed`` + 1, ...), sampled as
    flow-grpo's evaluation samples them."""
    from ..evaluation import evaluate_rewards
    from ..recipes.flow_models import FrameMeanReward
    from ..rewards import CombinedReward, get_reward
    from ..tasks.datasets import PromptFileTask

    recorded = loaded.info.get("rewards")
    if not recorded:
        raise UsageError(
            f"--model: {args.model} was trained on a prompt list but records no rewards to "
            "score it with"
        )
    try:
        task = PromptFileTask.from_info(task_info)
    except (ValueError, ImportError) as error:
        raise UsageError(
            f"--model: {args.model} records the prompt file {task_info.get('path')!r}, which "
            f"cannot be read here: {' '.join(str(error).split())}"
        ) from None
    try:
        terms = [(get_reward(r["name"], **r.get("options", {})), r["weight"]) for r in recorded]
    except (TypeError, ValueError, ImportError) as error:
        raise UsageError(
            f"--model: the rewards {args.model} records cannot be built here: "
            f"{' '.join(str(error).split())}"
        ) from None
    if _makes_clips(loaded.model):
        terms = [(FrameMeanReward(fn), weight) for fn, weight in terms]
    samples = args.samples or 1
    _check_seeds(args, samples * len(task.prompts(args.split)))
    sampler = _serving_sampler(args, loaded.info)
    pipeline = hasattr(loaded.model, "output_shape")  # a diffusers pipeline: small batches
    result = evaluate_rewards(
        loaded.model,
        task,
        sampler,
        CombinedReward(terms),
        samples_per_prompt=samples,
        split=args.split,
        seed=args.seed,
        batch_size=(sampler.micro_batch_size or 8) if pipeline else 128,
    )
    _report_images(args, result, sampler, f"reward {result.reward_mean:.3f}", result.rewards)
    return 0


def cmd_eval_tokens(args, loaded) -> int:
    """``eval`` for a loaded token model: accuracy on its task's ``--split`` problems."""
    from ..evaluation import evaluate_task, format_samples
    from ..tasks import get_task

    _check_kind_flags(args, "token")
    examples = args.examples or 256
    _check_seeds(args, examples)
    sampler = _token_sampler(args, loaded.info, loaded.model)
    task_info = dict(loaded.info.get("task", {"name": "arithmetic"}))
    task = get_task(task_info.pop("name"), tokenizer=loaded.tokenizer, **task_info)
    result = evaluate_task(
        loaded.model,
        task,
        sampler,
        num_examples=examples,
        split=args.split,
        seed=args.seed,
    )
    print(f"accuracy {result.accuracy:.3f} on {result.num_examples} {args.split} problems")
    print(format_samples(result.samples))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    return 0


# ``generate`` / ``eval`` per model kind (``LoadedModel.kind``): each takes (args, loaded).
GENERATE = {"token": cmd_generate_tokens, "flow": cmd_generate_images}
EVAL = {"token": cmd_eval_tokens, "flow": cmd_eval_images}


def _dispatch(table: dict, args) -> int:
    """Load ``args.model`` once (bounded: models.io) and run ``table``'s command for its kind.
    A Hub id (``org/name``) is refused first, before torch is imported."""
    from ..models.loading import HubIdError, refuse_hub_id

    try:
        refuse_hub_id(args.model, "--model")
    except HubIdError as error:
        raise UsageError(str(error)) from None
    from ..models.io import load_model

    try:
        if (Path(args.model) / "model_index.json").is_file():
            loaded = _load_pipeline_directory(args.model)
        else:
            loaded = load_model(args.model)
    except (FileNotFoundError, ValueError) as error:
        raise UsageError(f"--model: {error}") from error
    if loaded.kind not in table:
        raise UsageError(
            f"--model: {args.model} is a {loaded.kind} model; {args.command} handles "
            f"{' and '.join(sorted(table))} models"
        )
    return table[loaded.kind](args, loaded)


def _load_pipeline_directory(path: str):
    """A local diffusers pipeline directory as a flow model (its default resolution, the
    text cache on, no recorded task or sampler)."""
    from ..models.flow_pipelines import flow_directory_kind, load_pipeline_model
    from ..models.io import LoadedModel, check_finite_weights
    from ..models.manifest import check_model_files, warn_unverified

    kind, _ = flow_directory_kind(path)
    verified = check_model_files(path, warn=False)  # manifest (an export's) and headers
    model = load_pipeline_model(path, kind).eval()
    check_finite_weights(model, path)
    if not verified:
        warn_unverified(path)
    return LoadedModel(model, "flow", None, {})


def cmd_generate_workflow(args) -> int:
    """``generate --workflow``: run every stage of a workflow with the settings its file
    records (``--samples`` clips per prompt, sample-major, row i seeded ``--seed + i``) and
    write the final clips (GIF, PNG frame strips) or every stage's exact artefacts
    (safetensors, the tensors the workflow handed on, bitwise)."""
    import safetensors.torch
    import torch

    from ..plots import save_video_gif, save_video_strip
    from ..tasks.motion import MotionTask
    from ..workflows import Workflow, WorkflowError, load_stage_model, load_workflow_spec

    for dest, flag in {**TOKEN_ONLY, "num_steps": "--num-steps", "guidance": "--guidance"}.items():
        if getattr(args, dest, None) is not None:
            raise UsageError(
                f"{flag}: does not apply to --workflow (each stage's sampler is set in the "
                "workflow file)"
            )
    _check_output(args, WORKFLOW_FORMATS, "a workflow's clips are written as")
    try:
        spec, path = load_workflow_spec(args.workflow)
        models = {stage.name: load_stage_model(stage) for stage in spec.stages}
        task = MotionTask.from_info(spec.task) if spec.task else None
        workflow = Workflow(spec, models, task=task)
        samples = args.samples or 1
        prompts = [p for _ in range(samples) for p in args.prompt]
        if len(prompts) > MAX_IMAGES:
            raise UsageError(
                f"--samples: {samples} x {len(args.prompt)} prompts = {len(prompts)} clips, "
                f"more than the limit {MAX_IMAGES}"
            )
        _check_seeds(args, len(prompts))
        seeds = [args.seed + i for i in range(len(prompts))]
        run = workflow.run(prompts, seeds)
    except WorkflowError as error:
        raise UsageError(f"--workflow: {error}".replace("workflow: ", "", 1)) from None
    except ValueError as error:  # a prompt the task or a model cannot take
        raise UsageError(f"--prompt: {error}") from None
    final = run.final
    clips, captions = final.artefact, list(final.prompts)
    if task is not None:
        verdicts = task.verify(clips, run.examples_of(final.name))
        captions = [f"{p} {'ok' if v['overall'] else 'x'}" for p, v in zip(captions, verdicts)]
    output = Path(args.output or "clips.gif")
    suffix = output.suffix.lower()
    if suffix == ".gif":
        save_video_gif(clips, output, nrow=min(8, len(captions)))
    elif suffix == ".png":
        save_video_strip(clips, output, captions=captions)
    else:
        output.parent.mkdir(parents=True, exist_ok=True)
        tensors = {name: stage.artefact.contiguous() for name, stage in run.stages.items()}
        tensors.update(
            {f"{name}.seeds": torch.tensor(stage.seeds) for name, stage in run.stages.items()}
        )
        safetensors.torch.save_file(tensors, str(output), metadata={"workflow": str(path)})
    for seed, caption in zip(final.seeds, captions):
        print(f"seed {seed}: {caption}")
    print(f"{' → '.join(run.stages)}: {len(captions)} clips written to {output}")
    return 0


def cmd_generate(args) -> int:
    if getattr(args, "workflow", None) is not None:
        return cmd_generate_workflow(args)
    return _dispatch(GENERATE, args)


def cmd_eval(args) -> int:
    return _dispatch(EVAL, args)
