"""``build_parser``: every ``diffusion-rl`` command, its flags, their help text and the
function each command runs (``args.func``).

The flags' types and bounds are in :mod:`.flags`; a test walks this parser to check that
every flag has help text and belongs to at most one model kind.
"""

from __future__ import annotations

import argparse

from .export import cmd_export
from .flags import (
    DEFAULT_BLOCK_SIZE,
    EVAL_FORMATS,
    IMAGE_FORMATS,
    MAX_BLOCK_SIZE,
    MAX_EXAMPLES,
    MAX_GUIDANCE,
    MAX_LENGTH,
    MAX_NUM_STEPS,
    MAX_RUN_SEED,
    MAX_SAMPLES,
    MAX_SEED,
    MAX_STEPS,
    MAX_STEPS_PER_BLOCK,
    MAX_TEMPERATURE,
    MAX_THREADS,
    QUICKSTART_STEPS,
    QUICKSTART_WORKFLOW_VIDEO_SFT_STEPS,
    SEED,
    TEXT_FORMATS,
    WORKFLOW_FORMATS,
    _existing_file,
    _file_path,
    _HelpFormatter,
    _integer,
    _override,
    _Parser,
    _prompt,
    _real,
    _text,
)
from .recipes import cmd_quickstart, cmd_recipe
from .serve import cmd_serve
from .serving import cmd_eval, cmd_generate
from .verify import cmd_verify

PROG = "diffusion-rl"
DESCRIPTION = (
    "Post-training for diffusion generators. For token models (masked and block diffusion): "
    "masked-diffusion SFT (sft), GRPO / DAPO / Dr.GRPO with exact trace replay (grpo) and "
    "on-policy distillation (distill); for image models (flow matching): rectified-flow SFT "
    "(flow-sft) and Flow-GRPO (flow-grpo). quickstart runs SFT then RL on a built-in task on "
    "CPU in minutes; generate and eval serve a saved model directory; export writes a LoRA "
    "run's model as a directory of its own (--merge: the adapter merged). Every recipe command "
    "reads a YAML config (--config), takes KEY=VALUE overrides (--set) and prints its "
    "effective config with --print-config; 'diffusion-rl COMMAND --help' lists a command's "
    "flags."
)


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("diffusion-rl")
    except PackageNotFoundError:
        from .. import __version__

        return __version__


def _add_token_sampler_flags(parser) -> argparse._ArgumentGroup:
    group = parser.add_argument_group("token models (sampler; default: the model's recorded one)")
    group.add_argument(
        "--temperature",
        type=_real(0.0, MAX_TEMPERATURE),
        help=f"sampling temperature in [0, {MAX_TEMPERATURE:g}]; 0 = greedy",
    )
    group.add_argument(
        "--steps-per-block",
        dest="steps_per_block",
        type=_integer(1, MAX_STEPS_PER_BLOCK),
        help="denoising steps per block, 1 .. the block size (fixed schedule only)",
    )
    group.add_argument(
        "--block-size",
        dest="block_size",
        type=_integer(1, MAX_BLOCK_SIZE),
        help=f"slots per block, 1 .. {MAX_BLOCK_SIZE} (default: the recorded one, else a "
        f"block-causal model's own, which it must then equal, else {DEFAULT_BLOCK_SIZE})",
    )
    group.add_argument(
        "--confidence",
        choices=["probability", "margin", "neg_entropy", "left_to_right"],
        help="how a slot's confidence is scored to choose which slots to commit "
        "(left_to_right: in order, whatever the model)",
    )
    group.add_argument(
        "--schedule",
        choices=["fixed", "threshold"],
        help="fixed: a set number of slots per step; threshold: every slot above --threshold",
    )
    group.add_argument(
        "--threshold",
        type=_real(0.0, 1.0, low_open=True),
        help="confidence in (0, 1] above which the threshold schedule commits a slot",
    )
    return group


def _add_image_sampler_flags(group) -> None:
    group.add_argument(
        "--num-steps",
        dest="num_steps",
        type=_integer(1, MAX_NUM_STEPS),
        help=f"ODE steps, 1 .. {MAX_NUM_STEPS} (default: the model's)",
    )
    group.add_argument(
        "--guidance",
        type=_real(0.0, MAX_GUIDANCE),
        help=f"classifier-free guidance scale in [0, {MAX_GUIDANCE:g}]; 1 = none "
        "(default: the model's)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``diffusion-rl`` parser; every flag has help text (a test walks it)."""
    parser = _Parser(prog=PROG, description=DESCRIPTION, formatter_class=_HelpFormatter)
    parser.add_argument(
        "--version",
        action="version",
        version=f"%(prog)s {_package_version()}",
        help="print the package version and exit",
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show the full traceback of an error (also: DIFFUSION_RL_DEBUG=1)",
    )
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", help="the command to run"
    )

    def command(name: str, summary: str, description: str | None = None):
        return sub.add_parser(
            name,
            help=summary,
            description=description or f"{summary[0].upper()}{summary[1:]}.",
            formatter_class=_HelpFormatter,
        )

    p = command(
        "quickstart",
        "SFT then RL on a built-in task, on CPU, in minutes (text: SFT -> GRPO; image: "
        "flow SFT -> AWM; workflow: SFT of both stages -> workflow RL)",
        "The out-of-the-box run on a built-in task. --mode text (default): "
        "masked-diffusion SFT of the built-in transformer on 4x4 Sudoku, stopped at 15 % held-out "
        "accuracy (headroom for RL), then GRPO with "
        "exact trace replay; writes OUT/sft and OUT/grpo (model: OUT/grpo/model). --mode "
        "image: rectified-flow SFT of a small built-in DiT on mini-GenEval, then AWM (a "
        "forward-process flow RL method) on the serving sampler's samples; writes "
        "OUT/flow_sft and OUT/rl (model: OUT/rl/model). --mode "
        "workflow: SFT of the image stage (mini-GenEval) and of the image-to-video stage "
        "(mini-motion clips), OUT/workflow.yaml chaining them, then workflow RL of both "
        "stages from the final video reward; writes OUT/image_sft, OUT/video_sft and "
        "OUT/workflow_rl (workflow: OUT/workflow_rl/model/workflow.yaml). Each prints a "
        "before/after table and writes OUT/results.json.",
    )
    p.add_argument(
        "--mode",
        choices=["text", "image", "workflow"],
        default="text",
        help="text: SFT -> GRPO on 4x4 Sudoku; image: flow SFT -> AWM on "
        "mini-GenEval; workflow: image SFT and video SFT -> workflow RL of text -> image -> "
        "video from the final video reward",
    )
    p.add_argument(
        "--output-dir",
        type=_text("a directory"),
        default=None,
        help="where the stages write (default: runs/quickstart; image: runs/quickstart_image; "
        "workflow: runs/quickstart_workflow)",
    )
    p.add_argument(
        "--steps",
        type=_integer(1, MAX_STEPS),
        default=None,
        help=f"SFT steps of the first stage (default: at most {QUICKSTART_STEPS['text'][0]}, "
        f"stopped at 15 %% held-out accuracy; image: "
        f"{QUICKSTART_STEPS['image'][0]}; workflow: {QUICKSTART_STEPS['workflow'][0]} image "
        f"and {QUICKSTART_WORKFLOW_VIDEO_SFT_STEPS} video SFT steps, --steps sets both)",
    )
    p.add_argument(
        "--rl-steps",
        type=_integer(1, MAX_STEPS),
        default=None,
        help=f"GRPO (text), AWM (image) or workflow-RL (workflow) steps of the RL stage "
        f"(default: {QUICKSTART_STEPS['text'][1]}; image: {QUICKSTART_STEPS['image'][1]}; "
        f"workflow: {QUICKSTART_STEPS['workflow'][1]})",
    )
    p.add_argument(
        "--threads",
        type=_integer(1, MAX_THREADS),
        default=None,
        help="CPU threads (default: 1, the fastest for the built-in models' size)",
    )
    p.add_argument(
        "--seed",
        type=_integer(0, MAX_RUN_SEED),
        default=0,
        help="seed of every stage: initial weights, data order, rollout noise (the held-out "
        "problems and their sampling noise stay the same, so seeds compare; default: 0)",
    )
    p.add_argument(
        "--set",
        action="append",
        type=_override,
        metavar="KEY=VALUE",
        help="override a stage's config key: sft.KEY=VALUE (the SFT stage) or "
        "grpo.KEY=VALUE (text: the GRPO stage), rl.KEY=VALUE (image: the AWM stage); "
        "workflow mode: image_sft.KEY=VALUE, video_sft.KEY=VALUE, workflow_rl.KEY=VALUE; "
        "repeatable",
    )
    p.set_defaults(func=cmd_quickstart)

    for name, help_text, example in (
        ("sft", "masked-diffusion SFT of a token model from a YAML config", "optim.lr=3e-4"),
        (
            "grpo",
            "GRPO / DAPO / Dr.GRPO of a token model from a YAML config",
            "policy.algorithm=dapo",
        ),
        ("distill", "on-policy distillation of a token model from a teacher", "teacher.path=DIR"),
        ("flow-sft", "rectified-flow SFT of an image model on mini-GenEval", "steps=500"),
        ("flow-grpo", "Flow-GRPO of an image model on mini-GenEval", "policy.beta=0"),
        (
            "workflow-rl",
            "Flow-GRPO of every stage of a text-to-image-to-video workflow from one final reward",
            "stages.image.train=false",
        ),
    ):
        p = command(
            name,
            help_text,
            f"{help_text[0].upper()}{help_text[1:]}. The run writes OUTPUT_DIR (metrics, "
            "checkpoints, model/, results.json) and resumes from its checkpoints when run "
            "again.",
        )
        p.add_argument(
            "--config",
            type=_existing_file,
            help="YAML config file, e.g. configs/*.yaml (omit for all defaults)",
        )
        p.add_argument(
            "--set",
            action="append",
            type=_override,
            metavar="KEY=VALUE",
            help=f"override a config key (dotted for sections), e.g. {example}; repeatable",
        )
        p.add_argument(
            "--print-config",
            action="store_true",
            help="print the effective config (after --config and --set, every default filled "
            "in) as YAML and exit without running",
        )
        p.set_defaults(func=cmd_recipe)

    all_outputs = tuple(dict.fromkeys((*IMAGE_FORMATS, *TEXT_FORMATS, *WORKFLOW_FORMATS)))
    p = command(
        "generate",
        "sample completions (token model), an image grid (image model) or clips (workflow)",
        "Sample from a saved model directory with the sampler it records (flags override "
        "it), or run a multi-stage workflow. A token model prints the completion of every "
        "--prompt; an image model writes a captioned grid of --samples images per prompt; a "
        "workflow (--workflow) runs every stage with the settings its file records and writes "
        "the final clips as an animated GIF, PNG frame strips, or every stage's exact "
        "artefacts (.safetensors).",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--model",
        help="a model directory (e.g. runs/quickstart/grpo/model, runs/quickstart_image/rl/model)",
    )
    source.add_argument(
        "--workflow",
        help="a workflow YAML file (e.g. runs/workflow_rl/model/workflow.yaml) or a built-in "
        "workflow name (text-to-image-to-video, written by quickstart --mode workflow)",
    )
    p.add_argument(
        "--prompt",
        required=True,
        action="append",
        type=_prompt,
        help="a prompt (non-empty); repeat for a batch",
    )
    p.add_argument(
        "--seed",
        type=SEED,
        default=0,
        help=f"row i uses seed + i, in [0, {MAX_SEED}]",
    )
    p.add_argument(
        "--output",
        type=_file_path(all_outputs),
        help="write the result here, in the format its extension names: an image model's grid "
        f"as {', '.join(IMAGE_FORMATS)} (default samples.png); a token model's completions as "
        ".json or .txt (default: printed only); a workflow's clips as "
        f"{', '.join(WORKFLOW_FORMATS)} (default clips.gif)",
    )
    tokens = _add_token_sampler_flags(p)
    tokens.add_argument(
        "--length",
        type=_integer(1, MAX_LENGTH),
        help="tokens to generate; prompt + length must fit the model's max_seq_len",
    )
    tokens.add_argument(
        "--trace",
        type=_file_path((".json",)),
        help="also write the captured trace (tokens, commit steps, log-probs) as JSON here",
    )
    images = p.add_argument_group("image models")
    images.add_argument(
        "--samples",
        type=_integer(1, MAX_SAMPLES),
        help=f"images (or a workflow's clips) per prompt, 1 .. {MAX_SAMPLES} (default: 1)",
    )
    _add_image_sampler_flags(images)
    p.set_defaults(func=cmd_generate)

    p = command(
        "eval",
        "verifier accuracy of a saved model on its task",
        "Evaluate a saved model directory on the task it records, with the sampler it "
        "records (flags override it): a token model on --examples problems, an image model "
        "on every prompt of the split, --samples images each (a model trained on a prompt "
        "list: the mean of the rewards its run recorded).",
    )
    p.add_argument("--model", required=True, help="a token or image model directory")
    p.add_argument(
        "--split", choices=["eval", "train"], default="eval", help="the task split to evaluate on"
    )
    p.add_argument(
        "--seed",
        type=SEED,
        default=0,
        help=f"example / image i uses seed + i, in [0, {MAX_SEED}]",
    )
    p.add_argument(
        "--output", type=_file_path(EVAL_FORMATS), help="also write the result as JSON here (.json)"
    )
    tokens = _add_token_sampler_flags(p)
    tokens.add_argument(
        "--examples",
        type=_integer(1, MAX_EXAMPLES),
        help=f"problems to evaluate, 1 .. {MAX_EXAMPLES} (default: 256)",
    )
    images = p.add_argument_group("image models")
    images.add_argument(
        "--samples",
        type=_integer(1, MAX_SAMPLES),
        help=f"images per prompt, 1 .. {MAX_SAMPLES} (default: 16; 1 for a prompt list)",
    )
    _add_image_sampler_flags(images)
    p.set_defaults(func=cmd_eval)

    p = command(
        "export",
        "write a LoRA run's model as a directory of its own (--merge: a plain merged model)",
        "Export the model a LoRA run wrote (SRC: its model directory or its OUTPUT_DIR; it "
        "holds the adapter and the path of its base model). With --merge, OUT is a plain "
        "model directory with the adapter merged into the base weights: the built-in models "
        "in this project's format, a Hugging Face token model in its family's own format, a "
        "diffusers pipeline as a pipeline directory. Without it, OUT is a copy of the adapter "
        "directory. OUT must not exist; it appears complete or not at all.",
    )
    p.add_argument("src", metavar="SRC", help="a LoRA run's model directory or its OUTPUT_DIR")
    p.add_argument("out", metavar="OUT", help="the directory to write (must not exist)")
    p.add_argument(
        "--merge",
        action="store_true",
        help="merge the adapter into the base weights and write a plain model directory",
    )
    p.set_defaults(func=cmd_export)

    p = command(
        "verify",
        "check a model directory, trainer checkpoint or run directory against its manifests",
        "Check DIR without building a model: a model directory (every file against its "
        "manifest.json: sizes and SHA-256; JSON and safetensors parse; every tensor finite), "
        "a trainer checkpoint (OUTPUT_DIR/checkpoints/step_N: files, parse, finite) or a run's "
        "OUTPUT_DIR (its model/ and every checkpoint). Exit status 0: intact and verified; 1: "
        "a file differs from its manifest, is damaged, or cannot be verified (no manifest, "
        "e.g. a downloaded checkpoint); 2: DIR is none of these.",
    )
    p.add_argument(
        "dir", metavar="DIR", help="a model directory, trainer checkpoint or run OUTPUT_DIR"
    )
    p.set_defaults(func=cmd_verify)

    p = command(
        "serve",
        "an OpenAI-compatible HTTP server on model directories and workflows",
        "Serve model directories (token models: /v1/completions and /v1/chat/completions, "
        "streaming as blocks commit; image models: /v1/images/generations; video models and "
        "workflows: /v1/videos jobs) and the capture-on rollout route /rollout/generate, with "
        "request batching, versioned hot weight updates (POST /update_weights), GET /health "
        "and GET /metrics. Binds to loopback unless --allow-remote. See docs/serving.md.",
    )
    p.add_argument(
        "--model",
        action="append",
        type=_text("a model directory"),
        metavar="[NAME=]DIR",
        help="a model directory to serve, named by its base name or NAME; repeatable",
    )
    p.add_argument(
        "--workflow",
        action="append",
        type=_text("a workflow"),
        metavar="[NAME=]NAME|FILE",
        help="a workflow YAML file or built-in workflow name to serve; repeatable",
    )
    p.add_argument(
        "--host", type=_text("a host"), help="address to bind (default 127.0.0.1, loopback)"
    )
    p.add_argument("--port", type=_integer(0, 65535), help="TCP port (default 8000; 0: any free)")
    p.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow a --host that is not loopback (reachable from other machines; warns)",
    )
    p.add_argument(
        "--api-key-env",
        metavar="VAR",
        type=_text("an environment variable name"),
        help="require 'Authorization: Bearer KEY' with KEY read from the environment "
        "variable VAR (at least 8 characters)",
    )
    p.add_argument(
        "--max-queue",
        type=_integer(1, 1_000_000),
        help="requests that may wait; one more gets 503 with Retry-After (default 256)",
    )
    p.add_argument(
        "--max-batch-rows",
        type=_integer(1, 65_536),
        help="rows merged into one batch at most (default 32)",
    )
    p.add_argument(
        "--max-wait-ms",
        type=_real(0.0, 60_000.0),
        help="how long the oldest request waits for compatible ones to merge (default 5)",
    )
    p.add_argument(
        "--request-timeout",
        type=_real(0.001, 86_400.0),
        help="seconds a request may take before it gets 504 (default 600)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=_integer(1024, 1 << 40),
        help="largest request body, bytes (default 4194304; /update_weights: 64 GiB)",
    )
    p.add_argument(
        "--update-weights-dir",
        action="append",
        type=_text("a directory"),
        metavar="DIR",
        help="allow POST /update_weights from model directories below DIR; repeatable "
        "(default: off)",
    )
    p.add_argument(
        "--allow-tensor-updates",
        action="store_true",
        help="allow POST /update_weights with a safetensors body of tensors (a trainer on "
        "this machine)",
    )
    p.add_argument(
        "--device", type=_text("a device"), help="where to load the models, e.g. cuda (default cpu)"
    )
    p.add_argument(
        "--dtype",
        choices=["fp32", "bf16", "fp16"],
        help="weights dtype (default: a Hugging Face checkpoint's stored one, else fp32)",
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="admit a Hugging Face tokenizer whose class is the directory's own code",
    )
    p.add_argument(
        "--log-level",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's log level (default info)",
    )
    p.set_defaults(func=cmd_serve)
    return parser
