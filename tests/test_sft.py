"""Masked-diffusion SFT against a hand computation; sanitisation; weighting."""

import math

import pytest
import torch
from conftest import tiny_model

from diffusion_rl.contracts import DiffusionTokenBatch
from diffusion_rl.objectives import MaskedDiffusionSFT, MaskedDiffusionSFTConfig


def make_batch(weights=None):
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 16, (3, 4), generator=g)
    pmask = torch.ones_like(prompt, dtype=torch.bool)
    pmask[1, :1] = False
    targets = torch.randint(3, 16, (3, 8), generator=g)
    if weights is None:
        weights = torch.ones(3, 8)
    targets = torch.where(weights != 0, targets, torch.full_like(targets, -1))
    return DiffusionTokenBatch({"prompt_ids": prompt, "prompt_mask": pmask}, targets, weights)


@pytest.mark.parametrize("weighting", ["plain", "inverse_t"])
def test_sft_loss_equals_hand_computation(weighting):
    model = tiny_model("bidirectional")
    weights = torch.tensor([[1.0] * 8, [0.5] * 4 + [0.0] * 4, [2.0, 0.0] * 4])
    batch = make_batch(weights)
    objective = MaskedDiffusionSFT(MaskedDiffusionSFTConfig(weighting=weighting, eps=1e-3))
    out = objective(model, batch, torch.Generator().manual_seed(0))

    # replay the same random draws by hand
    g = torch.Generator().manual_seed(0)
    t = 1e-3 + (1 - 1e-3) * torch.rand(3, generator=g)
    masked = (torch.rand(3, 8, generator=g) < t[:, None]) & (weights != 0)
    assert bool(masked.any())
    num, den = 0.0, 0.0
    for b in range(3):
        canvas = [
            int(x) if not masked[b, i] and weights[b, i] != 0 else 1
            for i, x in enumerate(batch.target_ids[b])
        ]
        ids = torch.tensor([batch.model_inputs["prompt_ids"][b].tolist() + canvas])
        key = torch.tensor([batch.model_inputs["prompt_mask"][b].tolist() + [True] * 8])
        with torch.no_grad():
            z = model(ids, key, 4)[0, 4:].double()
        z[:, 1] = -math.inf
        for i in range(8):
            if masked[b, i]:
                w = float(weights[b, i]) / (float(t[b]) if weighting == "inverse_t" else 1.0)
                num += w * -float(torch.log_softmax(z[i], -1)[batch.target_ids[b, i]])
                den += w
    assert float(out.primary.denominator) == pytest.approx(den, rel=1e-6)
    assert float(out.primary.sum.detach()) == pytest.approx(num, rel=1e-5)
    assert float(out.primary.value.detach()) == pytest.approx(num / den, rel=1e-5)
    assert 0 <= float(out.aux_metrics["sft/token_accuracy"].value) <= 1


def test_sft_ignores_nonfinite_logits_on_inactive_slots():
    model = tiny_model("bidirectional")
    weights = torch.ones(3, 8)
    weights[:, 6:] = 0
    batch = make_batch(weights)

    def poisoned(ids, key_mask, prompt_length):
        z = model(ids, key_mask, prompt_length)
        return torch.cat(
            [z[:, : prompt_length + 6], torch.full_like(z[:, prompt_length + 6 :], float("nan"))], 1
        )

    poisoned.mask_token_id = 1
    out = MaskedDiffusionSFT()(poisoned, batch, torch.Generator().manual_seed(0))
    assert torch.isfinite(out.primary.sum)
    out.primary.sum.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_sft_zero_weights_give_zero_denominator_and_value():
    model = tiny_model("bidirectional")
    out = MaskedDiffusionSFT()(
        model, make_batch(torch.zeros(3, 8)), torch.Generator().manual_seed(0)
    )
    assert float(out.primary.denominator) == 0.0
    assert float(out.primary.value.detach()) == 0.0


def test_sft_config_validation():
    with pytest.raises(ValueError, match="weighting"):
        MaskedDiffusionSFTConfig(weighting="sqrt")
    with pytest.raises(ValueError, match="eps"):
        MaskedDiffusionSFTConfig(eps=0.0)
