"""The built-in diffusion transformer: masks, cache, padding, alignment, save/load."""

import pytest
import torch
from conftest import tiny_model

from diffusion_rl.models import (
    BlockCachedDenoiser,
    DiffusionTransformer,
    TokenDenoiser,
    TransformerConfig,
    shift_to_target_aligned,
)


def test_protocols_are_implemented():
    assert isinstance(tiny_model("bidirectional"), TokenDenoiser)
    assert isinstance(tiny_model("block_causal"), BlockCachedDenoiser)


def test_block_causal_mask_structure():
    model = tiny_model("block_causal", block=2)
    key_mask = torch.tensor([[False, True, True, True, True, True, True]])
    allowed = model.attention_bias(key_mask, prompt_length=3)[0, 0] == 0
    # prompt = positions 0-2 (0 is padding), blocks {3,4}, {5,6}
    expected = torch.tensor(
        [
            [0, 1, 1, 0, 0, 0, 0],
            [0, 1, 1, 0, 0, 0, 0],
            [0, 1, 1, 0, 0, 0, 0],
            [0, 1, 1, 1, 1, 0, 0],
            [0, 1, 1, 1, 1, 0, 0],
            [0, 1, 1, 1, 1, 1, 1],
            [0, 1, 1, 1, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(allowed, expected)
    assert tiny_model("bidirectional").attention_bias(key_mask, 3)[0, 0].eq(0).sum() == 6 * 7


def test_future_blocks_do_not_change_block_causal_logits():
    model = tiny_model("block_causal")
    ids = torch.randint(3, 16, (2, 4 + 12))
    logits = model(ids, None, 4)
    changed = ids.clone()
    changed[:, 4 + 8 :] = 1  # last block
    again = model(changed, None, 4)
    torch.testing.assert_close(again[:, : 4 + 8], logits[:, : 4 + 8], atol=0, rtol=0)
    assert not torch.allclose(again[:, 4 + 8 :], logits[:, 4 + 8 :])


def test_cache_walk_equals_full_forward():
    model = tiny_model("block_causal")
    prompt = torch.randint(3, 16, (3, 5))
    pmask = torch.ones_like(prompt, dtype=torch.bool)
    pmask[0, :2] = False
    completion = torch.randint(3, 16, (3, 12))
    full = model(
        torch.cat([prompt, completion], 1),
        torch.cat([pmask, torch.ones_like(completion, dtype=torch.bool)], 1),
        5,
    )
    cache = model.new_cache(prompt, pmask)
    for lo in range(0, 12, 4):
        block_logits = model.forward_block(completion[:, lo : lo + 4], cache, extend=True)
        torch.testing.assert_close(block_logits, full[:, 5 + lo : 5 + lo + 4], atol=1e-5, rtol=1e-5)
    assert cache.length == 5 + 12
    assert cache.next_position.tolist() == [3 + 12, 5 + 12, 5 + 12]


@pytest.mark.parametrize("attention", ["block_causal", "bidirectional"])
def test_left_padding_does_not_change_a_rows_logits(attention):
    model = tiny_model(attention)
    prompt = torch.tensor([[5, 6, 7]])
    completion = torch.tensor([[1, 8, 1, 9]])
    plain = model(torch.cat([prompt, completion], 1), None, 3)
    padded_ids = torch.cat([torch.tensor([[0, 0]]), prompt, completion], 1)
    key_mask = torch.tensor([[False, False] + [True] * 7])
    padded = model(padded_ids, key_mask, 5)
    torch.testing.assert_close(padded[:, 2:], plain, atol=1e-5, rtol=1e-5)


def test_shift_to_target_aligned():
    raw = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3)
    aligned = shift_to_target_aligned(raw)
    assert torch.equal(aligned[:, 1:], raw[:, :-1])
    assert torch.equal(aligned[:, 0], raw[:, 0])
    with pytest.raises(ValueError, match="raw_logits: expected rank 3"):
        shift_to_target_aligned(raw[0])


def test_activation_checkpointing_gives_identical_gradients():
    model = tiny_model("block_causal").train()
    ids = torch.randint(3, 16, (2, 12))
    model(ids, None, 4).square().mean().backward()
    reference = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.enable_activation_checkpointing(True)
    model(ids, None, 4).square().mean().backward()
    for p, g in zip(model.parameters(), reference):
        torch.testing.assert_close(p.grad, g, atol=1e-6, rtol=1e-5)


def test_save_and_load_round_trip(tmp_path):
    model = tiny_model("block_causal")
    model.save_pretrained(tmp_path / "m")
    assert (tmp_path / "m" / "config.json").is_file() and (
        tmp_path / "m" / "model.safetensors"
    ).is_file()
    loaded = DiffusionTransformer.from_pretrained(tmp_path / "m")
    assert loaded.config == model.config
    for (n, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), n
    tied = DiffusionTransformer(
        TransformerConfig(vocab_size=8, mask_token_id=1, d_model=16, n_heads=2, n_layers=1)
    )
    tied.save_pretrained(tmp_path / "tied")
    again = DiffusionTransformer.from_pretrained(tmp_path / "tied")
    assert again.head.weight.data_ptr() == again.tok_emb.weight.data_ptr()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        DiffusionTransformer.from_pretrained(tmp_path / "missing")


def test_config_errors():
    with pytest.raises(ValueError, match="d_model: must be divisible by n_heads=3"):
        TransformerConfig(vocab_size=8, mask_token_id=1, d_model=16, n_heads=3)
    with pytest.raises(ValueError, match="mask_token_id: must be < vocab_size=8"):
        TransformerConfig(vocab_size=8, mask_token_id=8)
    with pytest.raises(ValueError, match="block_size: a block_causal model needs"):
        TransformerConfig(vocab_size=8, mask_token_id=1, block_size=None)
    with pytest.raises(ValueError, match="nonsense"):
        TransformerConfig(vocab_size=8, mask_token_id=1, nonsense=1)
    model = tiny_model("bidirectional")
    with pytest.raises(ValueError, match="exceeds max_seq_len=48"):
        model(torch.zeros(1, 49, dtype=torch.long))
    with pytest.raises(TypeError, match="block_causal"):
        model.new_cache(torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool))


def test_forward_packed_with_the_canvas_mask_equals_forward():
    model = tiny_model("block_causal")
    ids = torch.randint(3, 16, (2, 12))
    key_mask = torch.ones_like(ids, dtype=torch.bool)
    key_mask[0, :2] = False
    allowed = model.attention_bias(key_mask, 4)[:, 0] == 0
    positions = (key_mask.long().cumsum(1) - 1).clamp_min(0)
    torch.testing.assert_close(
        model.forward_packed(ids, positions, allowed), model(ids, key_mask, 4), atol=0, rtol=0
    )
    with pytest.raises(ValueError, match="allowed: expected"):
        model.forward_packed(ids, positions, allowed[:, :5])
