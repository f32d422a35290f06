"""Block sampler: greedy decoding against an independent implementation, cache exactness,
row independence, stop token and capture."""

import math

import pytest
import torch
from conftest import tiny_model

from diffusion_rl.sampling import TokenSamplerConfig, sample_tokens
from diffusion_rl.sampling.token import commit_counts, select_commits

STOP = 2


def prompts(batch=8, length=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 16, (batch, length), generator=g)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[: batch // 2, : length // 3] = False  # left padding on half the rows
    ids[~mask] = 0
    return ids, mask


def reference_greedy(model, prompt_ids, prompt_mask, gen_len, block, steps, stop=None):
    """Straightforward low-confidence remasking, one row at a time, no cache: full canvas forward,
    argmax proposal, confidence = softmax probability of the proposal, commit the most confident
    masked slots (ties: lowest position), fixed counts per step."""
    mask_id = model.mask_token_id
    out = []
    for row in range(prompt_ids.shape[0]):
        p_ids = prompt_ids[row][prompt_mask[row]]  # padding removed entirely
        comp = [mask_id] * gen_len
        finished = False
        for lo in range(0, gen_len, block):
            hi = min(gen_len, lo + block)
            if finished:
                break
            n_steps = min(steps, hi - lo)
            base, extra = divmod(hi - lo, n_steps)
            for s in range(n_steps):
                k = base + (1 if s < extra else 0)
                canvas = torch.tensor([p_ids.tolist() + comp])
                with torch.no_grad():
                    logits = model(canvas, None, len(p_ids))[0, len(p_ids) :].double()
                logits[:, mask_id] = -math.inf
                probs = torch.softmax(logits, -1)
                cands = [i for i in range(lo, hi) if comp[i] == mask_id]
                scored = sorted(cands, key=lambda i: (-probs[i].max().item(), i))
                if s == n_steps - 1:
                    k = len(cands)
                for i in scored[:k]:
                    comp[i] = int(probs[i].argmax())
            if stop is not None and stop in comp[lo:hi]:
                finished = True
        out.append([t if t != mask_id else stop for t in comp])
    return torch.tensor(out)


@pytest.mark.parametrize("attention", ["block_causal", "bidirectional"])
@pytest.mark.parametrize("steps", [4, 2, 1])
def test_greedy_matches_independent_implementation(attention, steps):
    model = tiny_model(attention)
    ids, mask = prompts()
    config = TokenSamplerConfig(generation_length=12, block_size=4, steps_per_block=steps)
    got = sample_tokens(model, ids, mask, config, seeds=range(8), stop_token_id=STOP).tokens
    expected = reference_greedy(model, ids, mask, 12, 4, steps, stop=STOP)
    assert torch.equal(got, expected)
    assert len(set(map(tuple, got.tolist()))) > 1  # not a degenerate constant output


def test_greedy_without_stop_fills_every_slot():
    model = tiny_model("bidirectional")
    ids, mask = prompts()
    config = TokenSamplerConfig(
        generation_length=10, block_size=5, steps_per_block=3, stop_at_eos=False
    )
    sample = sample_tokens(
        model, ids, mask, config, seeds=range(8), stop_token_id=STOP, capture=True
    )
    assert torch.equal(sample.tokens, reference_greedy(model, ids, mask, 10, 5, 3))
    assert bool((sample.trace.commit_steps >= 0).all())
    assert not bool((sample.tokens == model.mask_token_id).any())


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("schedule", ["fixed", "threshold"])
def test_block_kv_cache_equals_no_cache(temperature, schedule):
    model = tiny_model("block_causal")
    ids, mask = prompts()
    config = TokenSamplerConfig(
        generation_length=16,
        block_size=4,
        steps_per_block=2,
        temperature=temperature,
        schedule=schedule,
        threshold=0.5,
    )
    cached = sample_tokens(
        model, ids, mask, config, seeds=range(8), stop_token_id=STOP, capture=True
    )
    plain = sample_tokens(
        model,
        ids,
        mask,
        config.model_copy(update={"use_cache": False}),
        seeds=range(8),
        stop_token_id=STOP,
        capture=True,
    )
    assert cached.trace.sampler["use_cache"] and not plain.trace.sampler["use_cache"]
    assert torch.equal(cached.tokens, plain.tokens)
    assert torch.equal(cached.trace.commit_steps, plain.trace.commit_steps)
    # different matmul shapes (block vs full canvas): equal up to float32 rounding
    torch.testing.assert_close(
        cached.trace.behaviour_logprobs, plain.trace.behaviour_logprobs, atol=1e-5, rtol=1e-6
    )


@pytest.mark.parametrize("attention", ["block_causal", "bidirectional"])
@pytest.mark.parametrize("schedule", ["fixed", "threshold"])
def test_row_output_independent_of_batch(attention, schedule):
    model = tiny_model(attention)
    ids, mask = prompts()
    config = TokenSamplerConfig(
        generation_length=12,
        block_size=4,
        steps_per_block=2,
        temperature=1.0,
        schedule=schedule,
        threshold=0.4,
    )
    seeds = [11, 12, 13, 14, 15, 16, 17, 18]
    batched = sample_tokens(model, ids, mask, config, seeds=seeds, stop_token_id=STOP, capture=True)
    for row in (0, 5):  # a padded row and an unpadded one
        keep = mask[row]
        alone = sample_tokens(
            model,
            ids[row : row + 1, keep[None].expand(1, -1)[0]],
            None,
            config,
            seeds=[seeds[row]],
            stop_token_id=STOP,
            capture=True,
        )
        assert torch.equal(alone.tokens[0], batched.tokens[row])
        assert torch.equal(alone.trace.commit_steps[0], batched.trace.commit_steps[row])
        torch.testing.assert_close(  # batch 1 vs 8: GEMM blocking may round differently
            alone.trace.behaviour_logprobs[0],
            batched.trace.behaviour_logprobs[row],
            atol=1e-6,
            rtol=2e-6,
        )


def test_seeds_change_samples_and_repeat_exactly():
    model = tiny_model("bidirectional")
    ids, mask = prompts()
    config = TokenSamplerConfig(
        generation_length=8, block_size=8, steps_per_block=4, temperature=1.5, stop_at_eos=False
    )
    a = sample_tokens(model, ids, mask, config, seeds=range(8)).tokens
    b = sample_tokens(model, ids, mask, config, seeds=range(8)).tokens
    c = sample_tokens(model, ids, mask, config, seeds=range(100, 108)).tokens
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_temperature_sampling_matches_softmax_distribution():
    """Gumbel-max in float64 samples softmax(z / T): frequencies over many seeds match."""
    model = tiny_model("bidirectional", vocab=6)
    ids = torch.tensor([[3, 4, 5]])
    config = TokenSamplerConfig(
        generation_length=1, block_size=1, steps_per_block=1, temperature=0.7, stop_at_eos=False
    )
    n = 3000
    sample = sample_tokens(model, ids.expand(n, -1), None, config, seeds=range(n), capture=True)
    with torch.no_grad():
        logits = model(torch.tensor([[3, 4, 5, 1]]), None, 3)[0, 3].double()
    logits[1] = -math.inf
    expected = torch.softmax(logits / 0.7, -1)
    freq = torch.bincount(sample.tokens[:, 0], minlength=6).double() / n
    assert (freq - expected).abs().max() < 4 * math.sqrt(0.25 / n)
    # the recorded behaviour log-prob is log softmax(z / T) of the sampled token
    torch.testing.assert_close(
        sample.trace.behaviour_logprobs[:, 0],
        expected.log()[sample.tokens[:, 0]].float(),
        atol=1e-5,
        rtol=0,
    )


def test_stop_token_ends_row_and_unsampled_slots_are_marked():
    model = tiny_model("block_causal")
    with torch.no_grad():  # make the stop token the certain choice in the second block onward
        model.head.weight[STOP] = 0
    ids, mask = prompts()
    config = TokenSamplerConfig(generation_length=12, block_size=4, steps_per_block=4)
    sample = sample_tokens(
        model, ids, mask, config, seeds=range(8), stop_token_id=STOP, capture=True
    )
    trace = sample.trace
    for row in range(8):
        steps = trace.commit_steps[row]
        for lo in range(0, 12, 4):
            block_sampled = steps[lo : lo + 4] >= 0
            assert bool(block_sampled.all()) or not bool(
                block_sampled.any()
            )  # blocks are all or nothing
        first_unsampled = (steps < 0).nonzero()
        if len(first_unsampled):
            lo = int(first_unsampled[0])
            assert STOP in trace.tokens[row, :lo].tolist()  # stopped only after a stop token
            assert bool((trace.tokens[row, lo:] == STOP).all())
            assert bool((trace.behaviour_logprobs[row, lo:] == 0).all())


def test_commit_counts_and_selection_rules():
    assert commit_counts(4, 4) == [1, 1, 1, 1]
    assert commit_counts(5, 2) == [3, 2]
    assert commit_counts(7, 3) == [3, 2, 2]
    pending = torch.tensor([[True, True, True, False]])
    conf = torch.tensor([[0.5, 0.9, 0.5, 1.0]])
    # fixed: the two most confident pending, tie between slots 0 and 2 goes to slot 0
    assert select_commits(pending, conf, torch.tensor([2]), None).tolist() == [
        [True, True, False, False]
    ]
    # threshold: every pending slot >= 0.5; below threshold still commits the best one
    assert select_commits(pending, conf, None, 0.5).tolist() == [[True, True, True, False]]
    assert select_commits(pending, conf, None, 0.95).tolist() == [[False, True, False, False]]


def test_threshold_schedule_commits_confident_slots_together():
    model = tiny_model("bidirectional")
    ids, mask = prompts()
    config = TokenSamplerConfig(
        generation_length=8,
        block_size=8,
        steps_per_block=8,
        schedule="threshold",
        threshold=0.3,
        stop_at_eos=False,
    )
    trace = sample_tokens(model, ids, mask, config, seeds=range(8), capture=True).trace
    steps_used = [len(set(r.tolist())) for r in trace.commit_steps]
    assert min(steps_used) >= 1 and max(steps_used) <= 8
    assert sum(steps_used) < 8 * 8  # some slots were committed together


@pytest.mark.parametrize("confidence", ["probability", "margin", "neg_entropy", "left_to_right"])
def test_confidence_variants_decode_and_capture(confidence):
    model = tiny_model("block_causal")
    ids, mask = prompts()
    config = TokenSamplerConfig(
        generation_length=8, block_size=4, steps_per_block=2, confidence=confidence
    )
    trace = sample_tokens(model, ids, mask, config, seeds=range(8), capture=True).trace
    assert trace.sampler["confidence"] == confidence
    assert bool(torch.isfinite(trace.behaviour_logprobs).all())
    assert set(trace.kernel_ids) == {"token_sample_step", "token_logprobs"}
    if confidence == "left_to_right":  # two steps per block of 4: slots 0-1, then 2-3
        steps = trace.commit_steps.view(8, 2, 4) % 2
        assert steps.tolist() == [[[0, 0, 1, 1]] * 2] * 8


def test_sampler_config_errors():
    with pytest.raises(ValueError, match="steps_per_block"):
        TokenSamplerConfig(block_size=4, steps_per_block=5)
    with pytest.raises(ValueError, match="temperature"):
        TokenSamplerConfig(temperature=-1)
    with pytest.raises(ValueError, match="unknown_key"):
        TokenSamplerConfig(unknown_key=1)
    model = tiny_model("block_causal", block=4)
    ids, mask = prompts()
    with pytest.raises(
        ValueError, match="block_size: this block-causal model was built for blocks of 4"
    ):
        sample_tokens(
            model, ids, mask, TokenSamplerConfig(block_size=8, steps_per_block=2), seeds=range(8)
        )
    with pytest.raises(ValueError, match="seeds: expected one per row"):
        sample_tokens(model, ids, mask, TokenSamplerConfig(), seeds=[1, 2])
    with pytest.raises(ValueError, match="use_cache"):
        sample_tokens(
            tiny_model("bidirectional"),
            ids,
            mask,
            TokenSamplerConfig(use_cache=True),
            seeds=range(8),
        )
