"""Exact replay: parity with the sampler, gradients, chunking, entropy, sanitisation."""

import math

import pytest
import torch
from conftest import tiny_model

from diffusion_rl.contracts import DiffusionTokenBatch
from diffusion_rl.kernels import KernelUnavailableError
from diffusion_rl.sampling import TokenSamplerConfig, sample_tokens
from diffusion_rl.scoring import ReplayScorer, masked_entropy

STOP = 2


def rollout(attention, temperature=1.0, batch=16, use_cache=None, schedule="fixed"):
    model = tiny_model(attention)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 16, (batch, 5), generator=g)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[::3, :2] = False
    config = TokenSamplerConfig(
        generation_length=12,
        block_size=4,
        steps_per_block=2,
        temperature=temperature,
        use_cache=use_cache,
        schedule=schedule,
        threshold=0.5,
    )
    trace = sample_tokens(
        model, ids, mask, config, seeds=range(batch), stop_token_id=STOP, capture=True
    ).trace
    return model, trace


@pytest.mark.parametrize("attention", ["block_causal", "bidirectional"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("schedule", ["fixed", "threshold"])
def test_replay_equals_behaviour_logprobs(attention, temperature, schedule):
    model, trace = rollout(attention, temperature, schedule=schedule)
    batch = trace.prepare()
    assert int(batch.active.sum()) >= 16 * 4  # real actions over >= 16 sequences
    scores = ReplayScorer.for_trace(model, trace, stop_gradient=True).score(batch)
    delta = (scores.logprobs - trace.behaviour_logprobs).abs()
    assert float(delta.max()) <= 1e-6
    assert float(delta.max()) == 0.0  # same kernels, same shapes: bitwise
    assert bool((scores.logprobs[~batch.active] == 0).all())
    assert bool((scores.logprobs[batch.active] < 0).all())


def test_full_canvas_replay_of_cached_rollout_within_tolerance():
    """Block-causal replay without the cache runs different shapes: equal to fp32 rounding."""
    model, trace = rollout("block_causal")
    scores = ReplayScorer(model, temperature=1.0, stop_gradient=True, use_cache=False).score(
        trace.prepare()
    )
    assert float((scores.logprobs - trace.behaviour_logprobs).abs().max()) <= 1e-5


def test_replay_is_an_independent_recomputation():
    """The replay recomputes log softmax(f(c_s)/T)[x] from the canvas formula, slot by slot."""
    model, trace = rollout("bidirectional", temperature=0.7, batch=3)
    scores = ReplayScorer.for_trace(model, trace).score(trace.prepare())
    P = trace.prompt_ids.shape[1]
    for b in range(3):
        for i in range(12):
            step = int(trace.commit_steps[b, i])
            if step < 0:
                continue
            visible = (trace.commit_steps[b] >= 0) & (trace.commit_steps[b] < step)
            canvas = torch.where(visible, trace.tokens[b], model.mask_token_id)
            ids = torch.cat([trace.prompt_ids[b], canvas])[None]
            with torch.no_grad():
                z = model(
                    ids,
                    torch.cat([trace.prompt_mask[b], torch.ones(12, dtype=torch.bool)])[None],
                    P,
                )[0, P + i].double()
            z[model.mask_token_id] = -math.inf
            expected = torch.log_softmax(z / 0.7, -1)[trace.tokens[b, i]]
            assert abs(float(scores.logprobs[b, i].detach()) - float(expected)) < 1e-5


@pytest.mark.parametrize("attention", ["block_causal", "bidirectional"])
def test_gradients_flow_and_stop_gradient_builds_no_graph(attention):
    model, trace = rollout(attention, batch=4)
    batch = trace.prepare()
    model.train()
    live = ReplayScorer.for_trace(model, trace).score(batch)
    assert live.logprobs.requires_grad
    live.logprobs.sum().backward()
    norms = [p.grad.norm() for p in model.parameters() if p.grad is not None]
    assert norms and float(sum(norms)) > 0
    frozen = ReplayScorer.for_trace(model, trace, stop_gradient=True).score(batch)
    assert not frozen.logprobs.requires_grad
    torch.testing.assert_close(frozen.logprobs, live.logprobs.detach(), atol=0, rtol=0)


def test_gradient_matches_finite_difference():
    """d/dθ Σ ℓ through the cached block walk equals a central finite difference in float64."""
    model, trace = rollout("block_causal", batch=2)
    model = model.double()
    batch = trace.prepare()
    scorer = ReplayScorer.for_trace(model, trace)
    param = model.tok_emb.weight
    scorer.score(batch).logprobs.sum().backward()
    idx = (int(trace.tokens[0, 0]), 3)
    assert abs(float(param.grad[idx])) > 1e-2  # a coordinate that matters
    analytic = float(param.grad[idx])
    with torch.no_grad():
        eps = 1e-2  # logits are read in float32: a large step keeps rounding out
        param[idx] += eps
        up = float(scorer.score(batch).logprobs.double().sum())
        param[idx] -= 2 * eps
        down = float(scorer.score(batch).logprobs.double().sum())
        param[idx] += eps
    assert analytic == pytest.approx((up - down) / (2 * eps), rel=1e-2, abs=1e-4)


@pytest.mark.parametrize("micro", [1, 3, 5])
def test_micro_batches_give_the_same_scores(micro):
    model, trace = rollout("bidirectional", batch=7)
    batch = trace.prepare()
    whole = ReplayScorer.for_trace(model, trace, stop_gradient=True, compute_entropy=True).score(
        batch
    )
    chunked = ReplayScorer.for_trace(
        model, trace, stop_gradient=True, compute_entropy=True, micro_batch_size=micro
    ).score(batch)
    # A batch of 1 and a batch of 7 may take different GEMM blockings: float32 rounding only
    # (measured up to 2.1e-6 on log-probs of magnitude ~2.4 on a loaded machine).
    torch.testing.assert_close(chunked.logprobs, whole.logprobs, atol=1e-6, rtol=2e-6)
    torch.testing.assert_close(chunked.entropy, whole.entropy, atol=1e-6, rtol=2e-6)


def test_entropy_is_finite_with_mask_logit_and_matches_definition():
    logits = torch.tensor([[[0.0, -math.inf, 1.0, 2.0]]])
    p = torch.softmax(torch.tensor([0.0, 2.0, 4.0]), -1)  # T = 0.5 over the finite entries
    expected = -(p * p.log()).sum()
    got = masked_entropy(logits, 0.5)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[0, 0], expected)
    model, trace = rollout("block_causal")
    scores = ReplayScorer.for_trace(model, trace, compute_entropy=True, stop_gradient=True).score(
        trace.prepare()
    )
    assert bool(torch.isfinite(scores.entropy).all())
    assert bool((scores.entropy[trace.sampled] > 0).all())
    assert float(scores.entropy.max()) <= math.log(model.vocab_size - 1) + 1e-5


def test_inactive_slots_are_sanitised():
    """Post-stop weight 0 and sentinel ids: inactive outputs are 0, gradients stay finite."""
    model, trace = rollout("bidirectional", batch=4)
    batch = trace.prepare(post_stop_weight=0.0)
    poisoned = dict(batch.model_inputs)
    targets = torch.where(batch.active, batch.target_ids, torch.full_like(batch.target_ids, -7))
    batch = DiffusionTokenBatch(poisoned, targets, batch.loss_weights)
    scores = ReplayScorer.for_trace(model, trace).score(batch)
    assert bool((scores.logprobs[~batch.active] == 0).all())
    scores.logprobs.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_post_stop_weights_in_prepare():
    model, trace = rollout("block_causal")
    batch = trace.prepare(post_stop_weight=0.25)
    post = trace.post_stop()
    assert bool(post.any())
    assert bool((batch.loss_weights[post] == 0.25).all())
    assert bool((batch.loss_weights[trace.sampled & ~post] == 1).all())
    assert bool((batch.loss_weights[~trace.sampled] == 0).all())
    assert bool((batch.target_ids[~trace.sampled] == -1).all())
    with pytest.raises(ValueError, match="post_stop_weight"):
        trace.prepare(post_stop_weight=-1.0)


def test_replay_refuses_unknown_kernel_and_incomplete_inputs():
    model, trace = rollout("bidirectional", batch=2)
    with pytest.raises(KernelUnavailableError, match="token_logprobs/fused@9"):
        ReplayScorer(model, temperature=1.0, kernel_id="token_logprobs/fused@9")
    batch = trace.prepare()
    inputs = {k: v for k, v in batch.model_inputs.items() if k != "commit_steps"}
    with pytest.raises(ValueError, match=r"missing \['commit_steps'\]"):
        ReplayScorer(model, temperature=1.0).score(
            DiffusionTokenBatch(inputs, batch.target_ids, batch.loss_weights)
        )
    with pytest.raises(ValueError, match="use_cache"):
        ReplayScorer(model, temperature=1.0, use_cache=True)
    with pytest.raises(ValueError, match="temperature"):
        ReplayScorer(model, temperature=float("nan"))


@pytest.mark.parametrize("attention", ["block_causal", "bidirectional"])
def test_replay_validates_logits_against_targets(attention):
    """Scoring a trace with a model whose vocabulary cannot hold its tokens fails by name."""
    model, trace = rollout(attention, batch=4)
    small = tiny_model(attention, vocab=4)
    batch = trace.prepare()
    assert int(batch.target_ids.max()) >= 4
    with pytest.raises(ValueError, match=r"vocab_size=4\)|active ids must be < V=4"):
        ReplayScorer.for_trace(small, trace).score(batch)
