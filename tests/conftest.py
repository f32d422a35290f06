"""Shared test setup: offline, deterministic, single-threaded where it matters; the tiny
token model and, for the bounded-loading tests, ``write_config`` and the ``never_built``
fixture."""

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DIFFUSION_RL_NO_PROGRESS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from diffusion_rl.models import (  # noqa: E402
    DiffusionTransformer,
    FlowDiT,
    TransformerConfig,
    VideoDiT,
)


def tiny_model(
    attention: str = "block_causal",
    *,
    seed: int = 0,
    vocab: int = 16,
    block: int = 4,
    layers: int = 2,
    width: int = 32,
) -> DiffusionTransformer:
    """A ~20 k-parameter model whose random init gives varied, untied logits."""
    torch.manual_seed(seed)
    config = TransformerConfig(
        vocab_size=vocab,
        mask_token_id=1,
        d_model=width,
        n_layers=layers,
        n_heads=4,
        max_seq_len=48,
        attention=attention,
        block_size=block,
        tie_embeddings=False,
    )
    model = DiffusionTransformer(config).eval()
    with torch.no_grad():  # larger logits than the 0.02 init: confident, distinct proposals
        model.head.weight.normal_(0.0, 1.0)
    return model


def write_config(directory: Path, config) -> Path:
    """``directory`` (created if missing) holding ``config.json``: ``config`` as JSON, or the
    str ``config`` verbatim."""
    directory.mkdir(exist_ok=True)
    text = config if isinstance(config, str) else json.dumps(config)
    (directory / "config.json").write_text(text)
    return directory


@pytest.fixture
def never_built(monkeypatch):
    """Fail the test if a built-in model class is instantiated (refusals happen before
    allocation)."""

    def refuse(self, *args, **kwargs):
        raise AssertionError(f"{type(self).__name__} was built")

    for cls in (DiffusionTransformer, FlowDiT, VideoDiT):
        monkeypatch.setattr(cls, "__init__", refuse)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
