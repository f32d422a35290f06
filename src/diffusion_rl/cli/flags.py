"""What each ``diffusion-rl`` flag accepts: the bounds, the argparse types that enforce them
when a flag is parsed (each error is ``FLAG: what is wrong``), which flags belong to which
model kind, the output formats, and the one-line-error parser and help formatter.

Nothing here imports torch or the rest of the package, so ``--help`` and ``--version`` stay
fast; every other module of the CLI builds on this one.
"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

# Bounds of the flags (inclusive). A model's own limits (its max_seq_len, block size) are
# checked once it is loaded.
MAX_SEED = 2**63 - 1  # per-row seeds are mixed into a 63-bit generator seed
MAX_STEPS = 10**9
MAX_RUN_SEED = 2**32 - 1  # config.LIMITS["seed"]: a run's seed
MAX_THREADS = 1024
MAX_LENGTH = 1 << 20  # models.io.SAMPLER_LIMITS["generation_length"]
MAX_STEPS_PER_BLOCK = 1 << 20
MAX_BLOCK_SIZE = 1 << 16  # config.LIMITS["block_size"]
DEFAULT_BLOCK_SIZE = 4  # sampling.TokenSamplerConfig's default (a test checks they agree)
MAX_NUM_STEPS = 10_000  # models.io.SAMPLER_LIMITS["num_steps"]
MAX_EXAMPLES = 1_000_000
MAX_SAMPLES = 4096
MAX_IMAGES = 4096  # generate: prompts x samples
MAX_TEMPERATURE = 100.0
MAX_GUIDANCE = 100.0
MAX_PROMPT_CHARS = 10_000
# quickstart's (SFT, RL) steps per mode, as in quickstart.py (a test checks they agree; the
# parser does not import it, so --help and --version need no torch).
QUICKSTART_STEPS = {"text": (400, 80), "image": (5000, 100), "workflow": (1000, 120)}
QUICKSTART_WORKFLOW_VIDEO_SFT_STEPS = 2000  # the workflow's second SFT stage

IMAGE_FORMATS = {".png": "PNG", ".jpg": "JPEG", ".jpeg": "JPEG", ".webp": "WEBP"}
# generate --workflow: an animated GIF of the final clips, PNG frame strips, or every stage's
# exact artefact tensors (safetensors: bitwise what the workflow produced)
WORKFLOW_FORMATS = (".gif", ".png", ".safetensors")
TEXT_FORMATS = (".json", ".txt")  # generate, token models: completions as JSON or lines
EVAL_FORMATS = (".json",)

# Flags by the model kind they apply to (argparse ``dest`` → flag); the rest apply to both.
TOKEN_ONLY = {
    "length": "--length",
    "trace": "--trace",
    "temperature": "--temperature",
    "steps_per_block": "--steps-per-block",
    "block_size": "--block-size",
    "confidence": "--confidence",
    "schedule": "--schedule",
    "threshold": "--threshold",
    "examples": "--examples",
}
IMAGE_ONLY = {"samples": "--samples", "num_steps": "--num-steps", "guidance": "--guidance"}
# Sampler config field → the flag that sets it.
SAMPLER_FLAGS = {
    "temperature": "--temperature",
    "steps_per_block": "--steps-per-block",
    "block_size": "--block-size",
    "confidence": "--confidence",
    "schedule": "--schedule",
    "threshold": "--threshold",
    "generation_length": "--length",
    "num_steps": "--num-steps",
    "guidance_scale": "--guidance",
}


class UsageError(ValueError):
    """A flag value that cannot work; the message starts with the flag."""


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line: ``PROG: error: --flag: ...``."""

    def error(self, message: str):
        message = re.sub(
            r"^argument ([^:]+): ", lambda m: f"{m.group(1).split('/')[-1]}: ", message
        )
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _HelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to a flag's help when it has a real default the text does
    not already mention."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            action.option_strings
            and "%(default)" not in text
            and not any(default is none for none in (None, False, argparse.SUPPRESS))
            and action.nargs != 0
        ):
            text += " (default: %(default)s)"
        return text


def _integer(low: int, high: int):
    """An argparse type: an integer in ``[low, high]``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low} (got {value})")
        if value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high} (got {value})")
        return value

    parse.__name__ = "integer"
    return parse


def _real(low: float, high: float, *, low_open: bool = False):
    """An argparse type: a finite number in ``[low, high]`` (``(low, high]`` if ``low_open``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number (got {text})")
        if value < low or (low_open and value == low):
            raise argparse.ArgumentTypeError(
                f"must be {'>' if low_open else '>='} {low:g} (got {text})"
            )
        if value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high:g} (got {text})")
        return value

    parse.__name__ = "number"
    return parse


def _prompt(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    if len(text) > MAX_PROMPT_CHARS:
        raise argparse.ArgumentTypeError(
            f"{len(text)} characters, more than the limit {MAX_PROMPT_CHARS}"
        )
    return text


def _text(what: str):
    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"must not be empty; expected {what}")
        return text

    parse.__name__ = "text"
    return parse


def _file_path(extensions: tuple[str, ...]):
    """An argparse type: a path to write whose extension is one of ``extensions``."""

    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError("must not be empty")
        path = Path(text)
        if path.is_dir():
            raise argparse.ArgumentTypeError(f"{text} is a directory; expected a file path")
        if path.suffix.lower() not in extensions:
            found = f"extension {path.suffix!r}" if path.suffix else "no extension"
            raise argparse.ArgumentTypeError(
                f"{text} has {found}; supported: {', '.join(extensions)}"
            )
        return text

    parse.__name__ = "path"
    return parse


def _not_a_file(path: Path) -> str | None:
    """Why ``path`` is not a regular file to read (it does not exist, is a directory, a FIFO,
    a device, ...), or None when it is one. Only ``stat``: a FIFO is never opened (that
    would block until a writer comes)."""
    import stat

    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return "does not exist"
    except OSError as error:
        return f"cannot be read ({error.strerror or error})"
    if stat.S_ISREG(mode):
        return None
    kinds = {
        stat.S_ISDIR: "a directory",
        stat.S_ISFIFO: "a FIFO (named pipe)",
        stat.S_ISSOCK: "a socket",
        stat.S_ISCHR: "a character device",
        stat.S_ISBLK: "a block device",
    }
    kind = next((what for test, what in kinds.items() if test(mode)), "not a regular file")
    return f"is {kind}, not a regular file"


def _existing_file(text: str) -> str:
    problem = _not_a_file(Path(text))
    if problem is not None:
        raise argparse.ArgumentTypeError(f"config file {text} {problem}; expected a YAML file")
    return text


def _override(text: str) -> str:
    key, sep, _ = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. steps=100), got {text!r}")
    return text


SEED = _integer(0, MAX_SEED)
