"""Approximate estimators against hand computations that replay the same draws (the shared
generator, or each row's own noise key), and split-invariant estimator noise in GRPO."""

import json
import math

import pytest
import torch
from conftest import tiny_model
from test_policy import SAMPLER, TASK

from diffusion_rl.contracts import DiffusionTokenBatch
from diffusion_rl.objectives.grpo import PolicyLoss, PolicyLossConfig
from diffusion_rl.rewards import CombinedReward
from diffusion_rl.rollout import TokenSource, collect_rollout
from diffusion_rl.sampling import TokenSamplerConfig, sample_tokens
from diffusion_rl.scoring import ReplayScorer
from diffusion_rl.scoring.estimators import (
    SCORERS,
    CoupledEstimator,
    ELBOEstimator,
    MeanFieldEstimator,
    SPGEstimator,
    make_scorer,
)
from diffusion_rl.scoring.packed import PackedReplayScorer
from diffusion_rl.seeding import noise_keys
from diffusion_rl.train import OptimConfig, Trainer
from diffusion_rl.train.learner import PolicyLearner
from diffusion_rl.train.plans import TokenPolicyPlan
from diffusion_rl.train.roles import PolicyRoles

STOP = 2
B, P, L = 5, 5, 8


def rollout(attention="bidirectional", temperature=0.7):
    model = tiny_model(attention)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, 16, (B, P), generator=g)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[::2, :2] = False
    config = TokenSamplerConfig(
        generation_length=L, block_size=4, steps_per_block=2, temperature=temperature
    )
    trace = sample_tokens(
        model, ids, mask, config, seeds=range(B), stop_token_id=STOP, capture=True
    ).trace
    return model, trace, trace.prepare()


def hand_logprobs(model, trace, prompts, completion, temperature):
    """``log softmax(f(prompt ⊕ completion)_i / T)[x_i]`` in float64, one row at a time."""
    rows = []
    for b in range(prompts.shape[0]):
        ids = torch.cat([prompts[b], completion[b]])[None]
        key_mask = torch.cat([trace.prompt_mask[b], torch.ones(L, dtype=torch.bool)])[None]
        with torch.no_grad():
            z = model(ids, key_mask, P)[0, P:].double()
        z[:, model.mask_token_id] = -math.inf
        logp = torch.log_softmax(z / temperature, -1)
        rows.append(logp.gather(-1, trace.tokens[b][:, None]).squeeze(-1))
    return torch.stack(rows)


def check(got, expected, batch):
    assert got.shape == (B, L) and got.dtype == torch.float32
    assert bool((got[~batch.active] == 0).all())
    torch.testing.assert_close(
        got.detach().double()[batch.active], expected[batch.active], atol=1e-5, rtol=0
    )


def test_mean_field_by_hand():
    model, trace, batch = rollout()
    p = 0.3
    got = MeanFieldEstimator(model, 0.7, prompt_mask_prob=p).score(
        batch, torch.Generator().manual_seed(11)
    )
    g = torch.Generator().manual_seed(11)
    remask = trace.prompt_mask & (torch.rand((B, P), generator=g) < p)
    assert bool(remask.any())
    prompts = torch.where(remask, model.mask_token_id, trace.prompt_ids)
    masked = torch.full((B, L), model.mask_token_id)
    check(got.logprobs, hand_logprobs(model, trace, prompts, masked, 0.7), batch)
    assert got.entropy is None


def test_mean_field_ignores_commit_steps_and_draws_fresh_masks():
    model, _, batch = rollout()
    estimator = MeanFieldEstimator(model, 0.7, prompt_mask_prob=0.5)
    inputs = dict(batch.model_inputs)
    inputs["commit_steps"] = inputs["commit_steps"].flip(1)
    shuffled = DiffusionTokenBatch(inputs, batch.target_ids, batch.loss_weights)
    assert torch.equal(estimator.score(batch).logprobs, estimator.score(shuffled).logprobs)
    del inputs["commit_steps"]  # not needed at all
    bare = DiffusionTokenBatch(inputs, batch.target_ids, batch.loss_weights)
    assert torch.equal(estimator.score(batch).logprobs, estimator.score(bare).logprobs)
    g = torch.Generator().manual_seed(1)
    first, second = estimator.score(batch, g).logprobs, estimator.score(batch, g).logprobs
    assert not torch.equal(first, second)  # a fresh prompt mask per call


def test_coupled_by_hand():
    model, trace, batch = rollout()
    got = CoupledEstimator(model, 0.7).score(batch, torch.Generator().manual_seed(12))
    g = torch.Generator().manual_seed(12)
    t = (0.2 + 0.6 * torch.rand(B, generator=g))[:, None].double()
    m = torch.rand((B, L), generator=g) < t
    mask = torch.full((B, L), model.mask_token_id)
    full = hand_logprobs(model, trace, trace.prompt_ids, mask, 0.7)
    on_m = hand_logprobs(model, trace, trace.prompt_ids, torch.where(m, mask, trace.tokens), 0.7)
    off_m = hand_logprobs(model, trace, trace.prompt_ids, torch.where(m, trace.tokens, mask), 0.7)
    expected = 0.5 * (full + torch.where(m, on_m / t, off_m / (1 - t)))
    assert bool(m[batch.active].any()) and bool((~m[batch.active]).any())
    check(got.logprobs, expected, batch)


@pytest.mark.parametrize("num_samples", [1, 3])
def test_elbo_by_hand_and_sequence_sum(num_samples):
    model, trace, batch = rollout()
    got = ELBOEstimator(model, 0.7, num_samples=num_samples).score(
        batch, torch.Generator().manual_seed(13)
    )
    g = torch.Generator().manual_seed(13)
    expected = torch.zeros(B, L, dtype=torch.float64)
    sequence = torch.zeros(B, dtype=torch.float64)
    for _ in range(num_samples):
        t = 1e-3 + (1 - 1e-3) * torch.rand(B, generator=g).double()
        m = torch.rand((B, L), generator=g) < t[:, None]
        noised = torch.where(m, model.mask_token_id, trace.tokens)
        logp = hand_logprobs(model, trace, trace.prompt_ids, noised, 0.7)
        expected += torch.where(m, logp, 0.0) / t[:, None] / num_samples
        for b in range(B):  # the bound itself: (1/t) Σ_{masked, active i} log p(x_i | x_t)
            slots = m[b] & batch.active[b]
            sequence[b] += float(logp[b][slots].sum()) / float(t[b]) / num_samples
    check(got.logprobs, expected, batch)
    torch.testing.assert_close(got.logprobs.detach().double().sum(1), sequence, atol=1e-4, rtol=0)


def test_none_generator_is_a_fixed_seed():
    model, _, batch = rollout()
    for name in ("mean_field", "coupled", "elbo", "spg"):
        scorer = make_scorer(name, model, temperature=0.7)
        assert torch.equal(scorer.score(batch).logprobs, scorer.score(batch).logprobs)


@pytest.mark.parametrize("name", sorted(SCORERS))
def test_make_scorer_gives_one_signature_and_gradients(name):
    model, trace, batch = rollout("block_causal", temperature=1.0)
    scorer = make_scorer(name, model, temperature=1.0)
    scores = scorer.score(batch, generator=torch.Generator().manual_seed(0))
    assert scores.logprobs.shape == (B, L) and scores.logprobs.dtype == torch.float32
    assert bool((scores.logprobs[~batch.active] == 0).all())
    assert bool((scores.logprobs[batch.active] < 0).all()) or name in ("coupled", "elbo", "spg")
    scores.logprobs.sum().backward()
    assert any(float(p.grad.abs().sum()) > 0 for p in model.parameters() if p.grad is not None)


def test_exact_adapters_match_the_scorers():
    model, trace, batch = rollout("block_causal", temperature=1.0)
    exact = make_scorer("exact", model, temperature=1.0, stop_gradient=True)
    packed = make_scorer("packed", model, temperature=1.0, stop_gradient=True)
    assert isinstance(exact.scorer, ReplayScorer) and isinstance(packed.scorer, PackedReplayScorer)
    reference = ReplayScorer.for_trace(model, trace, stop_gradient=True).score(batch).logprobs
    assert torch.equal(exact.score(batch, torch.Generator()).logprobs, reference)
    assert float((packed.score(batch).logprobs - reference).abs().max()) <= 1e-5


def test_make_scorer_refusals():
    model = tiny_model("bidirectional")
    with pytest.raises(ValueError, match=r"'coupled', 'elbo', 'exact', 'mean_field', 'packed'"):
        make_scorer("nope", model, temperature=1.0)
    with pytest.raises(ValueError, match="use ReplayScorer"):
        make_scorer("packed", model, temperature=1.0)
    with pytest.raises(ValueError, match="prompt_mask_prob"):
        make_scorer("mean_field", model, temperature=1.0, prompt_mask_prob=1.5)
    with pytest.raises(ValueError, match="t_range"):
        make_scorer("coupled", model, temperature=1.0, t_range=(0.0, 0.5))
    with pytest.raises(ValueError, match="num_samples"):
        make_scorer("elbo", model, temperature=1.0, num_samples=0)
    with pytest.raises(ValueError, match="temperature"):
        make_scorer("elbo", model, temperature=math.nan)
    _, _, batch = rollout()
    inputs = {k: v for k, v in batch.model_inputs.items() if k != "completion_ids"}
    with pytest.raises(ValueError, match=r"missing \['completion_ids'\]"):
        make_scorer("mean_field", model, temperature=1.0).score(
            DiffusionTokenBatch(inputs, batch.target_ids, batch.loss_weights)
        )


# ----------------------------------------------------------------- per-row (keyed) draws
ROW_KEYS = torch.tensor([7, 2**61 + 3, 0, 12345, 99])


def keyed(batch, keys=ROW_KEYS):
    return DiffusionTokenBatch(
        {**batch.model_inputs, "noise_seeds": keys}, batch.target_ids, batch.loss_weights
    )


def test_coupled_with_noise_seeds_draws_each_row_from_its_own_key():
    model, trace, batch = rollout()
    got = CoupledEstimator(model, 0.7).score(keyed(batch), torch.Generator().manual_seed(3))
    t, m = torch.zeros(B, 1, dtype=torch.float64), torch.zeros(B, L, dtype=torch.bool)
    for b in range(B):  # row b: t then u, from Generator().manual_seed(key_b)
        g = torch.Generator().manual_seed(int(ROW_KEYS[b]))
        t[b] = 0.2 + 0.6 * torch.rand((), generator=g).double()
        m[b] = torch.rand(L, generator=g) < t[b].float()
    mask = torch.full((B, L), model.mask_token_id)
    full = hand_logprobs(model, trace, trace.prompt_ids, mask, 0.7)
    on_m = hand_logprobs(model, trace, trace.prompt_ids, torch.where(m, mask, trace.tokens), 0.7)
    off_m = hand_logprobs(model, trace, trace.prompt_ids, torch.where(m, trace.tokens, mask), 0.7)
    assert bool(m[batch.active].any()) and bool((~m[batch.active]).any())
    check(got.logprobs, 0.5 * (full + torch.where(m, on_m / t, off_m / (1 - t))), batch)


@pytest.mark.parametrize("name", ["mean_field", "coupled", "elbo", "spg"])
def test_keyed_scores_follow_the_row_not_the_split_or_the_generator(name):
    model, _, batch = rollout()
    options = {"num_samples": 2} if name == "elbo" else {}
    scorer = make_scorer(name, model, temperature=0.7, **options)
    with torch.no_grad():
        whole = scorer.score(keyed(batch), torch.Generator().manual_seed(0)).logprobs
        other_generator = scorer.score(keyed(batch), torch.Generator().manual_seed(5)).logprobs
        rows = [scorer.score(keyed(batch)[b], None).logprobs for b in range(B)]
        order = torch.tensor([3, 1, 4, 0, 2])
        permuted = scorer.score(keyed(batch)[order]).logprobs
        rekeyed = scorer.score(keyed(batch, ROW_KEYS + 1)).logprobs
    assert torch.equal(whole, other_generator)
    # equal up to float rounding of batch-size-dependent kernels (measured <= 1.6e-6)
    torch.testing.assert_close(torch.cat(rows), whole, atol=1e-5, rtol=0)
    torch.testing.assert_close(permuted, whole[order], atol=1e-5, rtol=0)
    assert float((rekeyed - whole).abs().max()) > 1e-3  # the keys do drive the draws


class CharReward:
    """Deterministic rewards with spread inside groups (unlike ``hash``, the same in every
    process)."""

    name = "chars"

    def __call__(self, completions, examples):
        return torch.tensor([float(sum(map(ord, c)) % 3) for c in completions])


def _char_rollout(model, policy):
    """Two prompts x 3 samples of ``model`` on TASK, rewarded by :class:`CharReward`."""
    return collect_rollout(
        model,
        TokenSource(TASK, SAMPLER),
        CombinedReward([(CharReward(), 1.0)]),
        start_prompt=0,
        num_prompts=2,
        group_size=3,
        weights_version=0,
        seed=0,
        advantage=policy.advantage_spec,
    )


def test_the_policy_plan_keys_estimator_noise_by_trace_seed_and_rollout_step():
    model = tiny_model("block_causal", vocab=TASK.tokenizer.vocab_size)
    policy = PolicyLossConfig()
    rollout, _ = _char_rollout(model, policy)
    for scorer in ("exact", "packed", "mean_field", "coupled", "elbo", "spg"):
        plan = TokenPolicyPlan(PolicyLoss(policy), scorer=scorer)
        parts = plan.batches(rollout, {}, rollout_step=4, micro_batch_size=4)
        assert [p.batch_size for p in parts] == [4, 2]
        if scorer in ("exact", "packed"):
            assert all("noise_seeds" not in p.model_inputs for p in parts)
            continue
        keys = torch.cat([p.model_inputs["noise_seeds"] for p in parts])
        assert torch.equal(keys, noise_keys(rollout.trace.seeds, 4))
        assert len(set(keys.tolist())) == 6


class SharedStreamPlan(TokenPolicyPlan):
    """The plan without per-row keys: estimators fall back to the learner's per-micro-batch
    generator (the behaviour before noise keys)."""

    def batches(self, rollout, settings, **options):
        return [
            DiffusionTokenBatch(
                {k: v for k, v in b.model_inputs.items() if k != "noise_seeds"},
                b.target_ids,
                b.loss_weights,
            )
            for b in super().batches(rollout, settings, **options)
        ]


def grpo_weights(scorer: str, micro_batch_size, plan_type=TokenPolicyPlan):
    """One GRPO step (μ = 2, KL to a reference: reference, snapshot and two live passes)."""
    policy = PolicyLossConfig(num_iterations=2)
    model = tiny_model("block_causal", vocab=TASK.tokenizer.vocab_size)
    roles = PolicyRoles(model, reference=policy.uses_reference)
    learner = PolicyLearner(
        roles,
        plan_type(PolicyLoss(policy), scorer=scorer),
        # eps 1e-6: AdamW's m / (sqrt(v) + eps) leaves float rounding of near-zero gradient
        # elements un-amplified (with 1e-8 even exact replay differs by up to 5e-7 across splits)
        lambda actor, loss_fn: Trainer(actor, loss_fn, OptimConfig(lr=1e-3, eps=1e-6)),
        micro_batch_size=micro_batch_size,
    )
    rollout, _ = _char_rollout(roles.rollout, policy)
    learner.step(rollout)
    assert learner.trainer.optimizer_steps == 2
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def relative_difference(a: dict, b: dict) -> float:
    """max |a − b| / max |a| over every parameter."""
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    return diff / max(float(a[k].abs().max()) for k in a)


@pytest.mark.parametrize("scorer", ["coupled", "elbo", "spg"])
def test_grpo_with_an_estimator_gives_the_same_update_for_any_split(scorer):
    whole = grpo_weights(scorer, None)
    start = tiny_model("block_causal", vocab=TASK.tokenizer.vocab_size).state_dict()
    assert relative_difference(whole, start) > 1e-4
    for size in (1, 4):  # measured <= 1.3e-7
        assert relative_difference(whole, grpo_weights(scorer, size)) <= 1e-6, size
    # without the keys the draws follow the micro-batches, and the update with them (1e-3)
    shared = grpo_weights(scorer, None, SharedStreamPlan)
    assert relative_difference(shared, grpo_weights(scorer, 4, SharedStreamPlan)) > 1e-4


# ----------------------------------------------------------------------------- SPG
# Rows: A > 0, A < 0, A = 0, A < 0, A < 0 (so every branch of the sandwich is exercised).
SPG_ADVANTAGES = torch.tensor([1.0, -1.0, 0.0, -0.5, -2.0])


def spg_batch(batch, advantages=SPG_ADVANTAGES, keys=ROW_KEYS):
    """``batch`` with advantages, per-row noise keys and some inactive slots: row 1 without
    its last three actions (a stopped row with ``post_stop_weight = 0``), row 3 without slot 2
    (an unsampled slot in the middle of a block)."""
    weights = batch.loss_weights.clone()
    weights[1, -3:] = 0.0
    weights[3, 2] = 0.0
    inputs = {**batch.model_inputs, "advantages": advantages, "noise_seeds": keys}
    if "behaviour_logprobs" not in inputs:
        inputs["behaviour_logprobs"] = torch.zeros_like(weights)
    return DiffusionTokenBatch(inputs, batch.target_ids, weights)


def spg_draws_by_hand(batch, keys, block_size, *, num_samples, p, origin="prompt"):
    """SPGEstimator's documented draws, replayed row by row from ``Generator(key_b)``:
    ``prompt_masked [N, B, P]``, ``masked [N, B, L]`` and ``scored [N, B, L]``."""
    active = batch.active
    prompt_mask = batch.model_inputs["prompt_mask"].bool()
    rows, length = active.shape
    width = prompt_mask.shape[1]
    prompt_masked = torch.zeros(num_samples, rows, width, dtype=torch.bool)
    scored = torch.zeros(num_samples, rows, length, dtype=torch.bool)
    for b in range(rows):
        g = torch.Generator().manual_seed(int(keys[b]))
        offset = int(prompt_mask[b].sum()) % block_size if origin == "canvas" else 0
        block = [(offset + i) // block_size for i in range(length)]
        count = (length - 1 + (block_size - 1 if origin == "canvas" else 0)) // block_size + 1
        u = torch.rand(count, generator=g)
        holding = sorted({block[i] for i in range(length) if active[b, i]})
        order = sorted(holding, key=lambda j: float(u[j]))
        for s in range(num_samples):
            chosen = order[s % len(order)] if order else 0
            slots = [i for i in range(length) if active[b, i] and block[i] == chosen]
            c = torch.rand((), generator=g)
            k = min(1 + int(torch.floor(c * len(slots))), len(slots))
            v = torch.rand(length, generator=g)
            for i in sorted(slots, key=lambda i: float(v[i]))[:k]:
                scored[s, b, i] = True
            w = torch.rand(width + length, generator=g)
            prompt_masked[s, b] = prompt_mask[b] & (w[:width] < p)
            for i in range(length):
                if active[b, i] and (block[i] > chosen or (block[i] < chosen and w[width + i] < p)):
                    scored[s, b, i] = True
    return prompt_masked, scored | ~active, scored


def spg_canvas_logprobs(model, batch, prompt_masked, masked, temperature=0.7):
    """``log p(x_i | canvas_s)`` float64 ``[N, B, L]`` from one hand forward per row and
    canvas (MASK logit at -inf, temperature read)."""
    inputs = batch.model_inputs
    prompt_mask = inputs["prompt_mask"].bool()
    out = []
    for s in range(masked.shape[0]):
        prompts = torch.where(prompt_masked[s], model.mask_token_id, inputs["prompt_ids"])
        completion = torch.where(masked[s], model.mask_token_id, inputs["completion_ids"])
        rows = []
        for b in range(completion.shape[0]):
            ids = torch.cat([prompts[b], completion[b]])[None]
            keys = torch.cat([prompt_mask[b], torch.ones(L, dtype=torch.bool)])[None]
            z = model(ids, keys, P)[0, P:].double()
            z[:, model.mask_token_id] = -math.inf
            logp = torch.log_softmax(z / temperature, -1)
            rows.append(logp.gather(-1, inputs["completion_ids"][b][:, None]).squeeze(-1))
        out.append(torch.stack(rows))
    return torch.stack(out)


def spg_bounds_by_hand(logp, scored, active, beta):
    """Per slot ``[B, L]`` (float64): SPG's ELBO and EUBO terms, and the row sums computed
    separately as the sequence-level bounds ``mean_s (1/t̂_s) Σ_{M_s} log p`` and
    ``(n/n⁺) (1/β) Σ_{q_i>0} log q_i``."""
    num, rows, length = logp.shape
    elbo = torch.zeros(rows, length, dtype=logp.dtype)
    eubo = torch.zeros(rows, length, dtype=logp.dtype)
    elbo_rows, eubo_rows = [], []
    for b in range(rows):
        n = int(active[b].sum())
        t = [int(scored[s, b].sum()) / n for s in range(num)]
        sequence = 0.0
        for s in range(num):
            sequence = sequence + logp[s, b][scored[s, b]].sum() / t[s] / num
            for i in range(length):
                if scored[s, b, i]:
                    elbo[b, i] = elbo[b, i] + logp[s, b, i] / t[s] / num
        q = [
            sum(torch.exp(beta * logp[s, b, i]) / t[s] for s in range(num) if scored[s, b, i]) / num
            for i in range(length)
        ]
        covered = [i for i in range(length) if active[b, i] and scored[:, b, i].any()]
        upper = 0.0
        for i in covered:
            eubo[b, i] = n / len(covered) * torch.log(q[i]) / beta
            upper = upper + eubo[b, i]
        elbo_rows.append(sequence)
        eubo_rows.append(upper)
    return elbo, eubo, torch.stack(elbo_rows), torch.stack(eubo_rows)


@pytest.mark.parametrize("origin", ["prompt", "canvas"])
def test_spg_draws_follow_the_documented_order_and_block_structure(origin):
    model, trace, plain = rollout("bidirectional")
    if origin == "canvas":
        model.block_origin = "canvas"  # SDAR-style blocks: slot k in block (r_b + k) // K
    batch = spg_batch(plain)
    estimator = SPGEstimator(model, 0.7, block_size=4, num_samples=3, context_mask_prob=0.3)
    got = estimator.draw(batch, torch.Generator().manual_seed(9))  # keyed: generator unused
    expected = spg_draws_by_hand(batch, ROW_KEYS, 4, num_samples=3, p=0.3, origin=origin)
    for a, e in zip(got, expected, strict=True):
        assert torch.equal(a, e)
    _, masked, scored = got
    assert bool(masked[:, ~batch.active].all()) and not bool(scored[:, ~batch.active].any())
    assert bool(scored.any(2).all())  # every canvas masks at least one action of every row
    assert bool((~scored).any(0)[batch.active].any())  # and leaves some clean


def test_spg_elbo_and_eubo_by_hand():
    model, trace, plain = rollout()
    batch = spg_batch(plain)
    beta = 1.5
    prompt_masked, masked, scored = spg_draws_by_hand(batch, ROW_KEYS, 4, num_samples=2, p=0.3)
    with torch.no_grad():
        logp = spg_canvas_logprobs(model, batch, prompt_masked, masked)
    elbo, eubo, elbo_rows, eubo_rows = spg_bounds_by_hand(logp, scored, batch.active, beta)
    # the per-slot terms sum to the sequence-level bounds
    torch.testing.assert_close(elbo.sum(1), elbo_rows, atol=1e-9, rtol=0)
    torch.testing.assert_close(eubo.sum(1), eubo_rows, atol=1e-9, rtol=0)
    negative = (SPG_ADVANTAGES < 0)[:, None]
    scores = {}
    for omega in (0.0, 0.5, 1.0):
        estimator = SPGEstimator(
            model, 0.7, block_size=4, eubo_beta=beta, mix_weight=omega, context_mask_prob=0.3
        )
        with torch.no_grad():
            got = scores[omega] = estimator.score(batch).logprobs
        expected = torch.where(negative, omega * eubo + (1 - omega) * elbo, elbo)
        assert got.dtype == torch.float32 and bool((got[~batch.active] == 0).all())
        torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=0)
    positive = ~negative[:, 0]  # A >= 0 (A = 0 included) gets the ELBO exactly, whatever ω
    assert torch.equal(scores[0.5][positive], scores[0.0][positive])
    assert torch.equal(scores[1.0][positive], scores[0.0][positive])
    assert float((eubo - elbo)[negative[:, 0]].abs().max()) > 1e-2  # the two bounds differ


def test_spg_without_advantages_or_actions():
    model, trace, plain = rollout()
    estimator = SPGEstimator(model, 0.7, block_size=4)
    batch = spg_batch(plain, torch.ones(B))
    inputs = {k: v for k, v in batch.model_inputs.items() if k != "advantages"}
    bare = DiffusionTokenBatch(inputs, batch.target_ids, batch.loss_weights)
    with torch.no_grad():  # without advantages every row is scored as an A >= 0 row
        assert torch.equal(estimator.score(bare).logprobs, estimator.score(batch).logprobs)
    batch = spg_batch(plain)
    weights = batch.loss_weights.clone()
    weights[2] = 0.0  # a row without actions scores exactly 0, without NaN
    empty = DiffusionTokenBatch(batch.model_inputs, batch.target_ids, weights)
    scores = estimator.score(empty).logprobs
    assert bool((scores[2] == 0).all()) and bool(torch.isfinite(scores).all())
    scores.sum().backward()
    assert all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean_token_mean"])
def test_spg_policy_loss_gradient_is_minus_advantage_times_the_surrogate_gradient(aggregation):
    """μ = 1: every ratio is exp(ℓ − stop_grad(ℓ)) = 1, so PolicyLoss's gradient is
    −Σ_b A_b ∇S_b (token_mean: / Σ_b n_b, SPG's normalisation; sequence_mean_token_mean:
    each row / n_b, then / B), with S_b the row's surrogate computed here by hand."""
    model, trace, _ = rollout()
    batch = spg_batch(trace.prepare(advantages=SPG_ADVANTAGES))
    beta, omega = 1.5, 0.5
    loss_fn = PolicyLoss(PolicyLossConfig(beta="none", aggregation=aggregation))
    estimator = SPGEstimator(model, 0.7, block_size=4, eubo_beta=beta, mix_weight=omega)
    out = loss_fn(estimator.score(batch), batch)
    params = [p for p in model.parameters()]
    got = torch.autograd.grad(out.primary.sum / out.primary.denominator, params, allow_unused=True)

    prompt_masked, masked, scored = spg_draws_by_hand(batch, ROW_KEYS, 4, num_samples=2, p=0.15)
    logp = spg_canvas_logprobs(model, batch, prompt_masked, masked)  # with graph
    elbo, eubo, elbo_rows, eubo_rows = spg_bounds_by_hand(logp, scored, batch.active, beta)
    negative = SPG_ADVANTAGES < 0
    surrogate = torch.where(negative, omega * eubo_rows + (1 - omega) * elbo_rows, elbo_rows)
    n = batch.active.sum(1).double()
    if aggregation == "token_mean":
        hand = -(SPG_ADVANTAGES.double() * surrogate).sum() / n.sum()
    else:
        hand = -(SPG_ADVANTAGES.double() * surrogate / n).sum() / B
    ratio = out.aux_metrics["policy/ratio_mean"]
    assert float(ratio.sum / ratio.denominator) == 1.0  # the loss value is −A · 1 per action
    expected = torch.autograd.grad(hand, params, allow_unused=True)
    pairs = [(a, e) for a, e in zip(got, expected, strict=True) if e is not None]
    assert any(float(e.abs().max()) > 1e-4 for _, e in pairs)
    for a, e in pairs:
        torch.testing.assert_close(a.double(), e.double(), atol=1e-6, rtol=1e-4)


def test_spg_scores_do_not_depend_on_the_micro_batch_split():
    model, trace, _ = rollout()
    batch = spg_batch(trace.prepare(advantages=SPG_ADVANTAGES))
    estimator = make_scorer("spg", model, temperature=0.7, block_size=4)
    with torch.no_grad():
        whole = estimator.score(batch, torch.Generator().manual_seed(1)).logprobs
        for size in (1, 2):
            parts = [
                estimator.score(p, torch.Generator().manual_seed(size)) for p in batch.split(size)
            ]
            split = torch.cat([p.logprobs for p in parts])
            assert float((split - whole).abs().max()) <= 1e-6, size
        rekeyed = estimator.score(
            spg_batch(trace.prepare(advantages=SPG_ADVANTAGES), keys=ROW_KEYS + 1)
        )
    assert float((rekeyed.logprobs - whole).abs().max()) > 1e-3


def test_spg_refusals():
    model = tiny_model("bidirectional")
    for options, match in (
        ({"eubo_beta": 0.0}, "eubo_beta"),
        ({"eubo_beta": math.inf}, "eubo_beta"),
        ({"mix_weight": 1.5}, "mix_weight"),
        ({"context_mask_prob": -0.1}, "context_mask_prob"),
        ({"num_samples": 0}, "num_samples"),
        ({"block_size": 0}, "block_size"),
    ):
        with pytest.raises(ValueError, match=match):
            make_scorer("spg", model, temperature=1.0, **options)


def test_the_policy_plan_pins_the_sampler_blocks_for_spg():
    model = tiny_model("block_causal", vocab=TASK.tokenizer.vocab_size)
    policy = PolicyLossConfig()
    rollout_, _ = _char_rollout(model, policy)
    settings = TokenPolicyPlan(PolicyLoss(policy), scorer="spg").pin(rollout_.trace)
    assert settings["block_size"] == SAMPLER.block_size == rollout_.trace.sampler["block_size"]
    assert "block_size" not in TokenPolicyPlan(PolicyLoss(policy), scorer="elbo").pin(
        rollout_.trace
    )


def test_grpo_recipe_with_the_spg_scorer_runs_end_to_end(tmp_path):
    from test_recipes import GRPO_TINY, tiny_config

    from diffusion_rl.config import GRPORecipeConfig, build_config
    from diffusion_rl.recipes.grpo import run_grpo
    from diffusion_rl.recipes.sft import run_sft

    run_sft(tiny_config(tmp_path, "sft", steps=2), echo=lambda _: None)
    config = build_config(
        GRPORecipeConfig,
        {
            **GRPO_TINY,
            "steps": 2,
            "eval_every": 2,
            "checkpoint_every": 2,
            "scorer": "spg",
            "policy": {"beta": "none"},
            "model": {"path": str(tmp_path / "sft" / "model")},
            "output_dir": str(tmp_path / "spg"),
        },
    )
    result = run_grpo(config, echo=lambda _: None)
    assert result["steps"] == 2 and result["weights_version"] == 2
    lines = (tmp_path / "spg" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line) for line in lines if '"loss"' in line]
    assert len(steps) == 2 and all(math.isfinite(s["loss"]) for s in steps)
    assert all(s["policy/ratio_mean"] == pytest.approx(1.0) for s in steps)
