"""Token completions as ``diffusion-rl generate`` makes them, without the web layer (no
FastAPI import, so the CLI can share it).

The rules that make a served completion equal the CLI's for the same seed: prompts are
encoded without special tokens, left-padded with the tokenizer's pad id to the longest
prompt of the request (mask False on padding), row ``i`` is seeded ``seed + i``, the sampler
stops at the tokenizer's EOS, and the completion is ``tokenizer.decode`` of the row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..sampling import TokenSamplerConfig, sample_tokens
from ..sampling.token import TokenSample

__all__ = ["completion_tokens", "left_pad", "model_device", "sample_completions"]


def left_pad(encoded: Sequence[Sequence[int]], pad_id: int, width: int | None = None):
    """``(ids, mask)``: long / bool ``[B, width]`` with each row right-aligned (left padding,
    mask False there); ``width`` defaults to the longest row."""
    width = max(len(e) for e in encoded) if width is None else width
    ids = torch.tensor([[pad_id] * (width - len(e)) + list(e) for e in encoded], dtype=torch.long)
    mask = torch.tensor([[False] * (width - len(e)) + [True] * len(e) for e in encoded])
    return ids, mask


def model_device(model) -> torch.device:
    parameter = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    return parameter.device if parameter is not None else torch.device("cpu")


def sample_completions(
    model,
    tokenizer,
    ids: torch.Tensor,
    mask: torch.Tensor,
    sampler: TokenSamplerConfig,
    seeds: Sequence[int],
    *,
    capture: bool = False,
    on_block: Callable[[int, torch.Tensor], None] | None = None,
) -> TokenSample:
    """:func:`~diffusion_rl.sampling.sample_tokens` as the CLI calls it (stop at the
    tokenizer's EOS), on the model's device."""
    device = model_device(model)
    return sample_tokens(
        model,
        ids.to(device),
        mask.to(device),
        sampler,
        seeds=list(seeds),
        stop_token_id=tokenizer.eos_id,
        capture=capture,
        on_block=on_block,
    )


def completion_tokens(row: Sequence[int], tokenizer) -> int:
    """Tokens a completion row used: up to and including its first stop token (EOS, or any
    of an ``HFTokenizer``'s ``stop_ids``), else all of them."""
    stops = getattr(tokenizer, "stop_ids", None) or {tokenizer.eos_id}
    for position, token in enumerate(row):
        if int(token) in stops:
            return position + 1
    return len(row)
