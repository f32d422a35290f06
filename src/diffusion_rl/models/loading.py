"""What every loader of a model directory checks first (token models, Hugging Face
checkpoints, flow pipelines, reward models), in a module that imports nothing else of the
package so any loader can use it.

* :func:`check_local_directory` / :func:`refuse_hub_id`: a path that is not a local
  directory but looks like a Hugging Face Hub id fails at once (:class:`HubIdError`), with no
  network access and whatever ``HF_HUB_OFFLINE`` says; nothing is ever downloaded.
* :data:`MAX_JSON_BYTES` and :class:`ModelConfigError`: the bound on every JSON file read and
  the error for a config that fails its checks (both re-exported by :mod:`.io`).
* :class:`ModelFileError` and its kinds :class:`ManifestMismatchError` (a file that differs
  from what the directory's ``manifest.json`` records, :mod:`.manifest`) and
  :class:`NonFiniteWeightsError` (a weights tensor holding NaN or infinity): a file of a model
  directory that is missing, damaged or not what was written; the message names the file.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

MAX_JSON_BYTES = 16 << 20
"""The largest ``config.json``, ``diffusion_rl.json``, tokenizer or index JSON read (16 MiB)."""


class ModelConfigError(ValueError):
    """A model directory's ``config.json`` or ``diffusion_rl.json`` that is not valid JSON,
    fails its checks, or asks for sizes beyond the documented limits; the message names the
    file and the field."""


class ModelFileError(ValueError):
    """A file of a model directory that is missing, damaged or unreadable (a weights file that
    is truncated, empty, random bytes, a pickle, or whose tensors do not fit ``config.json``).

    ``directory``: the model directory; ``file``: the file at fault, relative to it (or
    ``None``); ``reason``: what is wrong and how to fix it. ``str(error)`` is one line,
    ``"DIRECTORY/FILE: REASON"``.
    """

    def __init__(self, directory: str | os.PathLike, file: str | None, reason: str) -> None:
        self.directory = Path(directory)
        self.file = file
        self.reason = " ".join(str(reason).split())  # one line
        where = self.directory / file if file else self.directory
        super().__init__(f"{where}: {self.reason}")

    def __reduce__(self):  # keep the attributes across pickling (multiprocessing)
        return (type(self), (self.directory, self.file, self.reason))


class ManifestMismatchError(ModelFileError):
    """A model directory whose files differ from what its ``manifest.json`` records (size,
    SHA-256, a listed file missing or an unlisted one added), or whose manifest is damaged:
    changed after it was written."""


class NonFiniteWeightsError(ModelFileError):
    """A model directory whose weights hold NaN or infinity; ``tensor`` names the first such
    tensor."""

    def __init__(
        self, directory: str | os.PathLike, file: str | None, reason: str, tensor: str = ""
    ) -> None:
        super().__init__(directory, file, reason)
        self.tensor = tensor

    def __reduce__(self):
        return (type(self), (self.directory, self.file, self.reason, self.tensor))


class HubIdError(ValueError):
    """A model path that is not a local directory and looks like a Hugging Face Hub id
    (``org/name``); nothing is ever downloaded, the message says how to fetch it."""


_HUB_ID = re.compile(
    r"^(?:hf://|https?://(?:www\.)?huggingface\.co/)?"
    r"(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)/?$"
)


def refuse_hub_id(path: str | os.PathLike, field: str) -> None:
    """Raise :class:`HubIdError` if ``path`` (as given: ``hf://`` would not survive
    :class:`~pathlib.Path`) names nothing local and looks like a Hub id (``org/name``,
    ``hf://org/name`` or a ``huggingface.co`` URL); otherwise do nothing."""
    text = os.fspath(path)
    match = _HUB_ID.match(text)
    if match and not Path(path).exists():
        repo = match["repo"]
        raise HubIdError(
            f"{field}: {text!r} is not a local directory and looks like a Hugging Face Hub id; "
            f"nothing is downloaded. Pass a local directory: fetch it first with "
            f"`hf download {repo} --local-dir DIR` (on a machine with network access) and "
            f"set {field} to DIR"
        )


def check_local_directory(path: str | os.PathLike, field: str) -> Path:
    """``path`` as a :class:`~pathlib.Path` if it is an existing local directory.

    Every loader of a checkpoint calls this first. ``field`` (the config field or argument,
    e.g. ``"model.path"``) starts the message.

    Raises:
        HubIdError: ``path`` does not exist and looks like a Hub id: the message says to pass
            a local directory (``hf download ORG/NAME --local-dir DIR``).
        FileNotFoundError: ``path`` does not exist, or is not a directory.
    """
    directory = Path(path)
    if directory.is_dir():
        return directory
    refuse_hub_id(path, field)
    text = os.fspath(path)
    if not directory.exists():
        raise FileNotFoundError(f"{field}: {text} does not exist (expected a local directory)")
    raise FileNotFoundError(f"{field}: {text} is not a directory")
