"""``diffusion-rl``: the command line.

diffusion-rl quickstart [--mode image]       # SFT then RL on a built-in task, CPU, minutes
diffusion-rl sft --config FILE [--set k=v]   # masked-diffusion SFT from a YAML config
diffusion-rl distill --config FILE           # on-policy distillation from a teacher
diffusion-rl flow-sft / flow-grpo --config FILE  # image models on mini-GenEval
diffusion-rl RECIPE --config FILE --print-config  # the effective config as YAML, no run
diffusion-rl generate --model DIR --prompt "12+34="  # completions; an image model: a grid
diffusion-rl eval --model DIR [--examples N]      # accuracy on the model's task
diffusion-rl export [--merge] SRC OUT          # a LoRA run's model as its own (merged) directory

Error contract (:func:`main`): a bad flag, config or model directory ends in one line on
stderr, ``diffusion-rl COMMAND: error: FLAG-OR-KEY: what is wrong``, and exit status 2; a
run that fails (a corrupt checkpoint, non-finite state, a full disk) ends in one such line
and status 1 (a full disk anywhere, whatever library reported it, is one line naming it);
Ctrl-C in status 130 and SIGTERM (a cluster's pre-emption) in 143, after the run loop has
checkpointed the current step (``recipes.run``). No traceback unless ``--debug`` or
``DIFFUSION_RL_DEBUG=1``.
Every flag is range-checked when parsed (the bounds are in its ``--help``), before any work;
a flag that does not apply to the model kind is refused, naming the kind it applies to.

The package: :mod:`.flags` (what each flag accepts: bounds, types, the one-line-error parser),
:mod:`.parser` (``build_parser``: the commands and their flags), :mod:`.recipes` (the recipe
commands, ``--print-config``, ``quickstart``), :mod:`.serving` (``generate`` / ``eval`` for
token and image models). This module holds ``main`` and the one mapping from an error to an
exit status (:data:`USAGE_ERRORS`, :func:`_run_failure`).
"""

from __future__ import annotations

import errno
import os
import signal
import sys

from .flags import IMAGE_ONLY, QUICKSTART_STEPS, TOKEN_ONLY, UsageError
from .parser import DESCRIPTION, PROG, build_parser
from .recipes import RECIPES, config_yaml
from .serving import save_images

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never hang on a hub lookup

__all__ = [
    "DESCRIPTION",
    "IMAGE_ONLY",
    "PROG",
    "QUICKSTART_STEPS",
    "RECIPES",
    "TOKEN_ONLY",
    "UsageError",
    "build_parser",
    "config_yaml",
    "main",
    "save_images",
]


# ----------------------------------------------------------------------------- exit statuses
# Errors that are bad input (status 2) when they are not a failed run (:func:`_run_failure`).
USAGE_ERRORS = (ValueError, TypeError, LookupError, FileNotFoundError)


_DISK_FULL_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
# How libraries report a full disk without an OSError: safetensors (SafetensorError:
# "I/O error: No space left on device (os error 28)"), torch.save's zip writer (a RuntimeError
# "[enforce fail at inline_container.cc:...] unexpected pos N vs M" when a write came up short)
_DISK_FULL_TEXTS = (
    "No space left on device",
    "Disk quota exceeded",
    "os error 28",
    "StorageFull",
    "unexpected pos",
    "PytorchStreamWriter failed writing",
)


def _disk_full(error: BaseException) -> bool:
    """Whether ``error`` (or an error it was raised from or while handling) is a full disk."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in _DISK_FULL_ERRNOS:
            return True
        if any(text in str(error) for text in _DISK_FULL_TEXTS):
            return True
        error = error.__cause__ or error.__context__
    return False


def _run_failure(error: BaseException) -> bool:
    """Whether ``error`` is a run that failed (status 1) rather than bad input (status 2):
    checkpoint corruption, non-finite state, a full disk, a ``RuntimeError`` the project
    defines, running out of memory."""
    if _disk_full(error):
        return True
    classes: list[type] = []
    checkpoint = sys.modules.get("diffusion_rl.train.checkpoint")
    for name in ("CheckpointCorruptError", "NonFiniteStateError"):
        cls = getattr(checkpoint, name, None)
        if isinstance(cls, type):
            classes.append(cls)
    if isinstance(error, (*classes, MemoryError)):
        return True
    if isinstance(error, OSError) and not isinstance(error, FileNotFoundError):
        return True
    if type(error).__name__ == "OutOfMemoryError":  # torch's, on an accelerator
        return True
    return isinstance(error, RuntimeError) and any(
        cls.__module__.startswith("diffusion_rl.") for cls in type(error).__mro__
    )


def main(argv: list[str] | None = None) -> int:
    """Run ``diffusion-rl`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status
    (module docstring: 0, 1 for a failed run, 2 for bad input, 130 for Ctrl-C, 143 for
    SIGTERM)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, --version, a usage error (already printed)
        return exit_.code if isinstance(exit_.code, int) else 0
    prog = f"{PROG} {args.command}"
    debug = args.debug or os.environ.get("DIFFUSION_RL_DEBUG", "") not in ("", "0")
    try:
        return args.func(args)
    except KeyboardInterrupt as interrupt:  # the run loop's message says what it saved
        signum = getattr(interrupt, "signum", None) or signal.SIGINT
        detail = " ".join(str(interrupt).split())
        if not detail.startswith("interrupted"):
            name = "interrupted (SIGTERM)" if signum == signal.SIGTERM else "interrupted"
            detail = f"{name}: {detail}" if detail else name
        if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 speaks for the run
            print(f"{prog}: {detail}", file=sys.stderr)
        return 128 + int(signum)
    except Exception as error:
        failed = _run_failure(error)
        usage = isinstance(error, USAGE_ERRORS)
        if debug or not (failed or usage):
            raise
        message = str(error) or type(error).__name__
        if _disk_full(error) and "disk full" not in message:  # one line, whoever raised it
            message = " ".join(message.split())
            message = f"disk full: {message}; free space on that disk, then run it again"
        print(f"{prog}: error: {message}", file=sys.stderr)
        return 1 if failed else 2
