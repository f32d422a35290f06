"""Checksums of model weights: what a server reports with every response and what the
learner checks after pushing weights to it (docs/serving.md).

A tensor's digest is the sha256 of its name, dtype, shape and raw bytes (any dtype, any
device); a set of named tensors is checksummed as the sha256 of their digests in name order,
its first 16 hex digits. Equal checksums mean bitwise-equal weights under the same names.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch

__all__ = ["combine_digests", "tensor_digest", "weights_checksum"]


def tensor_digest(name: str, tensor: torch.Tensor) -> bytes:
    """sha256 of one named tensor: name, dtype, shape and raw bytes."""
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
