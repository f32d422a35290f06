"""Packed replay: equal to dense replay (values, entropy, gradients), the layout by hand."""

import pytest
import torch
from conftest import tiny_model

from diffusion_rl.contracts import DiffusionTokenBatch
from diffusion_rl.kernels import KernelUnavailableError
from diffusion_rl.sampling import TokenSamplerConfig, sample_tokens
from diffusion_rl.scoring import ReplayScorer
from diffusion_rl.scoring.packed import PackedReplayScorer, packed_layout

STOP = 2
MASK = 1  # tiny_model's mask id


def rollout(temperature=1.0, schedule="fixed", batch=12, seed=3):
    """Left-padded prompts, a stop token, 3 blocks of 4 slots."""
    model = tiny_model("block_causal")
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 16, (batch, 5), generator=g)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[::3, :2] = False
    config = TokenSamplerConfig(
        generation_length=12,
        block_size=4,
        steps_per_block=2,
        temperature=temperature,
        schedule=schedule,
        threshold=0.5,
    )
    trace = sample_tokens(
        model, ids, mask, config, seeds=range(batch), stop_token_id=STOP, capture=True
    ).trace
    return model, trace


def max_abs(a, b):
    return float((a - b).detach().abs().max())


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("schedule", ["fixed", "threshold"])
def test_packed_equals_dense(temperature, schedule):
    model, trace = rollout(temperature, schedule)
    batch = trace.prepare()
    options = {"stop_gradient": True, "compute_entropy": True}
    packed = PackedReplayScorer.for_trace(model, trace, **options).score(batch)
    canvas = ReplayScorer(model, temperature=temperature, use_cache=False, **options).score(batch)
    cached = ReplayScorer.for_trace(model, trace, **options).score(batch)
    for dense in (canvas, cached):
        assert max_abs(packed.logprobs, dense.logprobs) <= 1e-5
        assert max_abs(packed.entropy, dense.entropy) <= 1e-5
    assert max_abs(packed.logprobs, trace.behaviour_logprobs) <= 1e-5
    assert bool((packed.logprobs[~batch.active] == 0).all())
    assert bool((packed.entropy[~batch.active] == 0).all())
    assert packed.logprobs.dtype == torch.float32


def test_threshold_rows_have_different_step_sets():
    """The union-of-steps layout is exercised: rows act at different step ids."""
    _, trace = rollout(1.0, "threshold")
    sets = {frozenset(row[row >= 0].tolist()) for row in trace.commit_steps}
    assert len(sets) > 1
    model, trace = rollout(1.0, "threshold")
    batch = trace.prepare()
    packed = PackedReplayScorer.for_trace(model, trace, stop_gradient=True).score(batch)
    assert max_abs(packed.logprobs, trace.behaviour_logprobs) <= 1e-5


def test_early_stop_and_post_stop_weights():
    """Rows that stopped early (commit step -1: MASK in every canvas, never read)."""
    model, trace = rollout(1.0)
    assert bool((trace.commit_steps < 0).any()) and bool(trace.post_stop().any())
    for weight in (0.0, 0.5):
        batch = trace.prepare(post_stop_weight=weight)
        packed = PackedReplayScorer.for_trace(model, trace, stop_gradient=True).score(batch)
        dense = ReplayScorer(model, temperature=1.0, use_cache=False, stop_gradient=True)
        assert max_abs(packed.logprobs, dense.score(batch).logprobs) <= 1e-5
        assert bool((packed.logprobs[~batch.active] == 0).all())


@pytest.mark.parametrize("micro", [1, 3, 5])
def test_micro_batches_equal_dense(micro):
    model, trace = rollout(1.0, "threshold", batch=7)
    batch = trace.prepare()
    options = {"stop_gradient": True, "compute_entropy": True}
    whole = PackedReplayScorer.for_trace(model, trace, **options).score(batch)
    chunked = PackedReplayScorer.for_trace(model, trace, micro_batch_size=micro, **options)
    chunked = chunked.score(batch)
    dense = ReplayScorer(model, temperature=1.0, use_cache=False, **options).score(batch)
    assert max_abs(chunked.logprobs, dense.logprobs) <= 1e-5
    assert max_abs(chunked.logprobs, whole.logprobs) <= 1e-5
    assert max_abs(chunked.entropy, dense.entropy) <= 1e-5


def parameter_grads(model, scores_fn, weights):
    model.zero_grad()
    (scores_fn().logprobs * weights).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_gradients_equal_dense():
    model, trace = rollout(1.0, batch=6)
    model.train()
    batch = trace.prepare()
    weights = torch.rand(batch.target_ids.shape, generator=torch.Generator().manual_seed(1))
    packed = PackedReplayScorer.for_trace(model, trace)
    dense = ReplayScorer(model, temperature=1.0, use_cache=False)
    got = parameter_grads(model, lambda: packed.score(batch), weights)
    expected = parameter_grads(model, lambda: dense.score(batch), weights)
    assert got.keys() == expected.keys() and len(got) > 0
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=1e-4, msg=name)
    frozen = PackedReplayScorer.for_trace(model, trace, stop_gradient=True).score(batch)
    assert not frozen.logprobs.requires_grad


def test_layout_by_hand():
    """P = 2, L = 4, K = 2; row 0 left-padded, row 1 never sampled its last slot."""
    prompt_ids = torch.tensor([[5, 6], [5, 6]])
    prompt_mask = torch.tensor([[False, True], [True, True]])
    tokens = torch.tensor([[3, 4, 8, 9], [3, 4, 8, 2]])
    steps = torch.tensor([[1, 0, 2, 3], [0, 0, 2, -1]])
    layout = packed_layout(
        prompt_ids, prompt_mask, tokens, steps, steps >= 0, block_size=2, mask_token_id=MASK
    )
    # 0-1 prompt | 2-3 clean block 0 | 4-5 clean block 1 | copies (0,0) (0,1) (1,2) (1,3)
    assert layout.copies == ((0, 0), (0, 1), (1, 2), (1, 3))
    grid = [
        "11000000000000",  # prompt
        "11000000000000",
        "11110000000000",  # clean block 0: prompt + itself
        "11110000000000",
        "11111100000000",  # clean block 1: prompt + block 0 + itself
        "11111100000000",
        "11000011000000",  # copy (0, 0): prompt + itself
        "11000011000000",
        "11000000110000",  # copy (0, 1)
        "11000000110000",
        "11110000001100",  # copy (1, 2): prompt + clean block 0 + itself
        "11110000001100",
        "11110000000011",  # copy (1, 3)
        "11110000000011",
    ]
    structural = torch.tensor([[c == "1" for c in row] for row in grid])
    expected = structural[None].repeat(2, 1, 1)
    expected[0, :, 0] = False  # row 0's padding is no key
    assert torch.equal(layout.allowed, expected)
    M = MASK
    assert layout.input_ids.tolist() == [
        [5, 6, 3, 4, 8, 9, M, M, M, 4, M, M, 8, M],
        [5, 6, 3, 4, 8, M, M, M, 3, 4, M, M, 8, M],
    ]
    assert layout.position_ids.tolist() == [
        [0, 0, 1, 2, 3, 4, 1, 2, 1, 2, 3, 4, 3, 4],
        [0, 1, 2, 3, 4, 5, 2, 3, 2, 3, 4, 5, 4, 5],
    ]
    assert layout.read_index.tolist() == [[8, 7, 10, 13], [6, 7, 10, 5]]


def test_layout_refuses_out_of_order_steps():
    prompt = torch.tensor([[5, 6]])
    steps = torch.tensor([[0, 5, 2, 3]])  # block 0 commits at 5, after block 1's actions
    with pytest.raises(ValueError, match="use ReplayScorer"):
        packed_layout(
            prompt,
            torch.ones_like(prompt, dtype=torch.bool),
            torch.tensor([[3, 4, 8, 9]]),
            steps,
            steps >= 0,
            block_size=2,
            mask_token_id=MASK,
        )


def test_refuses_bidirectional_models_and_unknown_kernels():
    with pytest.raises(ValueError, match="use ReplayScorer"):
        PackedReplayScorer(tiny_model("bidirectional"), temperature=1.0)
    model, trace = rollout(batch=2)
    with pytest.raises(KernelUnavailableError, match="token_logprobs/fused@9"):
        PackedReplayScorer(model, temperature=1.0, kernel_id="token_logprobs/fused@9")
    with pytest.raises(ValueError, match="temperature"):
        PackedReplayScorer(model, temperature=-1.0)
    batch = trace.prepare()
    inputs = {k: v for k, v in batch.model_inputs.items() if k != "commit_steps"}
    with pytest.raises(ValueError, match=r"missing \['commit_steps'\]"):
        PackedReplayScorer(model, temperature=1.0).score(
            DiffusionTokenBatch(inputs, batch.target_ids, batch.loss_weights)
        )


def test_inactive_slots_are_sanitised():
    model, trace = rollout(1.0, batch=4)
    batch = trace.prepare(post_stop_weight=0.0)
    targets = torch.where(batch.active, batch.target_ids, torch.full_like(batch.target_ids, -7))
    batch = DiffusionTokenBatch(batch.model_inputs, targets, batch.loss_weights)
    scores = PackedReplayScorer.for_trace(model, trace).score(batch)
    assert bool((scores.logprobs[~batch.active] == 0).all())
    scores.logprobs.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_chunk_without_actions_scores_zero():
    model, trace = rollout(1.0, batch=3)
    batch = trace.prepare()
    weights = batch.loss_weights.clone()
    weights[1] = 0
    batch = DiffusionTokenBatch(
        batch.model_inputs, torch.where(weights > 0, batch.target_ids, -1), weights
    )
    scorer = PackedReplayScorer.for_trace(model, trace, micro_batch_size=1, compute_entropy=True)
    scores = scorer.score(batch)
    assert bool((scores.logprobs[1] == 0).all()) and bool((scores.entropy[1] == 0).all())
    dense = ReplayScorer(model, temperature=1.0, use_cache=False).score(batch)
    assert max_abs(scores.logprobs, dense.logprobs) <= 1e-5
