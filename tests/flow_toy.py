"""A tiny conforming :class:`~diffusion_rl.models.protocol.VelocityModel` for the flow tests,
the ``one_thread`` fixture (import it: ``from flow_toy import one_thread  # noqa: F401``) and
the weight perturbations the flow-model tests share.

Conditioning is an integer label (prompt "0".."9"; the unconditional row is label 10) through
a learned embedding, added to a learned embedding of σ, modulating (FiLM) a three-layer conv
net on ``(3, 8, 8)`` latents. About 14 k parameters; random init gives distinct velocities
per label, so CFG and group noise have something to act on.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

NUM_LABELS = 10


class TinyVelocity(nn.Module):
    latent_shape = (3, 8, 8)

    def __init__(self, width: int = 32, seed: int = 0) -> None:
        super().__init__()
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        self.label = nn.Embedding(NUM_LABELS + 1, width)
        self.time = nn.Linear(3, width)
        self.film = nn.Linear(width, 2 * width)
        self.conv_in = nn.Conv2d(3, width, 3, padding=1)
        self.conv_mid = nn.Conv2d(width, width, 3, padding=1)
        self.conv_out = nn.Conv2d(width, 3, 3, padding=1)
        torch.random.set_rng_state(generator_state)

    def forward(self, latents, sigma, cond):
        feats = torch.stack([sigma, torch.sin(math.pi * sigma), torch.cos(math.pi * sigma)], -1)
        emb = self.label(cond["label"]) + self.time(feats.float())
        scale, shift = self.film(F.silu(emb)).chunk(2, dim=-1)
        h = F.silu(self.conv_in(latents))
        h = h * (1 + scale[..., None, None]) + shift[..., None, None]
        h = F.silu(self.conv_mid(h))
        return self.conv_out(h).to(latents.dtype)

    def encode_prompts(self, prompts):
        labels = []
        for prompt in prompts:
            if not (prompt.isdigit() and int(prompt) < NUM_LABELS):
                raise ValueError(f"prompts: expected a digit 0-9, got {prompt!r}")
            labels.append(int(prompt))
        return {"label": torch.tensor(labels, dtype=torch.long)}

    def empty_condition(self, batch_size):
        return {"label": torch.full((batch_size,), NUM_LABELS, dtype=torch.long)}

    def decode(self, latents):
        return (latents.float().clamp(-1, 1) + 1) / 2


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny convs run ~50x faster on one thread when other processes load the CPUs."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def fill_zero_layers(model: nn.Module, std: float = 0.05) -> nn.Module:
    """``model`` with every all-zero parameter (a DiT's adaLN-Zero and output layers) drawn
    from N(0, std²) in place, from torch's global RNG, so every input reaches the output (a
    fresh DiT predicts exactly 0)."""
    with torch.no_grad():
        for p in model.parameters():
            if torch.count_nonzero(p) == 0:
                p.normal_(0.0, std)
    return model


def perturbed(model: nn.Module, scale: float = 0.05) -> nn.Module:
    """``model`` with ``scale`` · N(0, 1) noise (torch's global RNG) added to every parameter
    in place: away from the zero-initialised output, so samples are not flat."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    return model
