"""Checksums of model weights: what a server reports with every response and what the
learner checks after pushing weights to it (docs/serving.md).

A tensor's digest is the sha256 of its name, dtype, shape and raw bytes (any dtype, any
device); a set of named tensors is checksummed as the sha256 of their digests in name order,
its first 16 hex digits. Equal checksums mean bitwise-equal weights under the same names.

Files: :func:`file_sha256` (a file's SHA-256, read in 1 MiB chunks) and
:func:`manifest_digest` (the SHA-256 of a manifest body's canonical JSON: sorted keys, no
spaces) are the two hashes of every ``manifest.json`` the project writes, the trainer
checkpoints' (``train/checkpoint.py``) and the model directories' (``models/manifest.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported by the tensor functions (file hashing needs none)
    import torch

__all__ = [
    "combine_digests",
    "file_sha256",
    "manifest_digest",
    "tensor_digest",
    "weights_checksum",
]


def tensor_digest(name: str, tensor: torch.Tensor) -> bytes:
    """sha256 of one named tensor: name, dtype, shape and raw bytes."""
    import torch

    digest = hashlib.sha256(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel():
        digest.update(flat.view(torch.uint8).numpy())
    return digest.digest()


def combine_digests(digests: Mapping[str, bytes]) -> str:
    """The checksum of per-tensor digests: sha256 over them in name order, 16 hex digits."""
    total = hashlib.sha256()
    for name in sorted(digests):
        total.update(digests[name])
    return total.hexdigest()[:16]


def weights_checksum(tensors: Mapping[str, torch.Tensor]) -> str:
    """The checksum of a set of named tensors (module docstring)."""
    return combine_digests({name: tensor_digest(name, t) for name, t in tensors.items()})


def file_sha256(path: str | os.PathLike) -> str:
    """The SHA-256 (64 hex digits) of the file at ``path``, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def manifest_digest(body: Mapping[str, Any]) -> str:
    """The SHA-256 of ``body``'s canonical JSON (sorted keys, no spaces, no NaN): the
    ``manifest_sha256`` a manifest records of its other keys."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()
