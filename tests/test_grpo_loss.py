"""GRPO / DAPO / Dr.GRPO policy loss against hand computations (MATH.md §2 and §3).

Every expected value here is computed in plain Python (loops over rows and slots with
``math.exp`` / ``math.log`` on floats), never by calling the functions under test.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from diffusion_rl.advantages import AdvantageSpec, group_advantages, overlong_penalty
from diffusion_rl.contracts import DiffusionTokenBatch, Extreme, WeightedMetric
from diffusion_rl.objectives.grpo import (
    ALGORITHM_DEFAULTS,
    PolicyLoss,
    PolicyLossConfig,
    aggregate,
    kl_per_action,
)
from diffusion_rl.scoring import ReplayScores
from diffusion_rl.train.metrics import reduce_metrics

REL = 1e-6

# ---------------------------------------------------------------------------- the example
# B = 4 rows in 2 groups of 2, L = 5 slots. Row 2 has zero weight everywhere; fractional
# weights 0.25 / 0.5; advantages of both signs; log-ratios chosen so that ratios fall inside
# and outside the clip range on both sides (0.22 -> rho = 1.246: outside 1 + 0.2, inside
# 1 + 0.28, so GRPO and DAPO clip differently).
ADV = [1.0, -1.0, 0.5, -0.5]
W = [
    [1.0, 0.5, 0.0, 1.0, 1.0],
    [1.0, 1.0, 1.0, 0.25, 0.0],
    [0.0, 0.0, 0.0, 0.0, 0.0],
    [0.5, 1.0, 1.0, 0.0, 0.5],
]
OLD = [
    [-1.0, -2.0, -0.5, -1.5, -0.8],
    [-0.7, -1.1, -2.3, -0.9, -1.4],
    [-1.3, -0.4, -0.8, -1.0, -2.2],
    [-2.0, -0.6, -1.2, -1.7, -0.3],
]
DELTA = [
    [0.5, 0.1, 0.3, -0.5, 0.22],  # A > 0: above high, inside, (inactive), below low, 0.22
    [-0.5, 0.05, 0.22, 1.0, -3.0],  # A < 0: below low, inside, 0.22, e (large), (inactive)
    [0.2, -0.3, 0.0, 0.4, 0.1],  # zero-weight row
    [0.22, -0.3, 0.15, 0.7, -0.1],  # A < 0: 0.22, below low, inside, (inactive), inside
]
LIVE = [[o + d for o, d in zip(orow, drow)] for orow, drow in zip(OLD, DELTA)]
REF = [
    [lv + off for lv, off in zip(lrow, orow)]
    for lrow, orow in zip(
        LIVE,
        [
            [0.3, -0.2, 0.1, 0.5, -0.4],
            [-0.6, 0.25, 0.0, 0.15, 0.9],
            [0.1, 0.1, 0.1, 0.1, 0.1],
            [0.45, -0.35, 0.2, -0.1, 0.05],
        ],
    )
]
BEHAVIOUR = [
    [o + e for o, e in zip(orow, erow)]
    for orow, erow in zip(
        OLD,
        [
            [0.01, -0.02, 0.5, 0.0, 0.003],
            [-0.004, 0.0, 0.03, -0.05, 0.9],
            [0.7, 0.7, 0.7, 0.7, 0.7],
            [0.02, -0.01, 0.0, 0.6, -0.008],
        ],
    )
]

ALGORITHMS = ["grpo", "dapo", "drgrpo"]
CLIP_LOW = 0.2
CLIP_HIGH = {"grpo": 0.2, "dapo": 0.28, "drgrpo": 0.2}  # MATH.md §3 / DAPO paper
AGGREGATIONS = [
    ("token_mean", None),
    ("sequence_mean_token_mean", None),
    ("sequence_mean_token_scale", None),
    ("sequence_mean_token_scale", 7),
    ("sequence_mean_token_sum", None),
]
KL_SETTINGS = [("none", "k3"), (0.04, "k1"), (0.04, "k2"), (0.04, "k3")]


def param_id(value) -> str:
    """Readable test ids: ('sequence_mean_token_scale', 7) -> sequence_mean_token_scale:7."""
    if isinstance(value, tuple):
        if value == ("none", "k3"):
            return "nokl"
        return ":".join(str(v) for v in value if v is not None)
    return str(value)


def make_batch(
    *,
    adv=ADV,
    weights=W,
    old=OLD,
    ref=REF,
    behaviour=BEHAVIOUR,
    with_old: bool = True,
    with_ref: bool = True,
) -> DiffusionTokenBatch:
    inputs = {
        "advantages": torch.tensor(adv, dtype=torch.float32),
        "behaviour_logprobs": torch.tensor(behaviour, dtype=torch.float64),
    }
    if with_old:
        inputs["old_logprobs"] = torch.tensor(old, dtype=torch.float64)
    if with_ref:
        inputs["ref_logprobs"] = torch.tensor(ref, dtype=torch.float64)
    length = len(weights[0])
    targets = [
        [(3 * b + i) % 11 if wi != 0 else -1 for i, wi in enumerate(wrow)]
        for b, wrow in enumerate(weights)
    ]
    assert all(len(row) == length for row in targets)
    return DiffusionTokenBatch(
        model_inputs=inputs,
        target_ids=torch.tensor(targets, dtype=torch.long),
        loss_weights=torch.tensor(weights, dtype=torch.float32),
    )


def live_tensor(live=LIVE) -> torch.Tensor:
    return torch.tensor(live, dtype=torch.float64, requires_grad=True)


# ------------------------------------------------------------------ hand computations
def hand_kl(live: float, ref: float, estimator: str) -> float:
    diff = ref - live
    if estimator == "k1":
        return live - ref
    if estimator == "k2":
        return 0.5 * (live - ref) ** 2
    return math.exp(diff) - diff - 1.0


def hand_kl_grad(live: float, ref: float, estimator: str) -> float:
    """d kl / d live."""
    if estimator == "k1":
        return 1.0
    if estimator == "k2":
        return live - ref
    return 1.0 - math.exp(ref - live)


def hand_slot(live, old, ref, adv, *, clip_low, clip_high, dual, beta, estimator):
    """(x, pg, rho, kl, dx/dlive) for one active slot."""
    raw = live - old
    delta = max(-20.0, min(20.0, raw))
    delta_grad = 1.0 if -20.0 < raw < 20.0 else 0.0
    rho = math.exp(delta)
    clipped = min(max(rho, 1.0 - clip_low), 1.0 + clip_high)
    unclipped_term, clipped_term = -adv * rho, -adv * clipped
    if unclipped_term >= clipped_term:
        pg, pg_grad = unclipped_term, -adv * rho * delta_grad
    else:
        pg, pg_grad = clipped_term, 0.0  # the clip is binding: constant in live
    if dual is not None and adv < 0 and -dual * adv < pg:
        pg, pg_grad = -dual * adv, 0.0
    x, x_grad, kl = pg, pg_grad, None
    if beta != "none":
        kl = hand_kl(live, ref, estimator)
        x += beta * kl
        x_grad += beta * hand_kl_grad(live, ref, estimator)
    return x, pg, rho, kl, x_grad


def hand_loss(
    *,
    clip_high,
    beta,
    estimator="k3",
    aggregation="token_mean",
    token_scale=None,
    dual=None,
    clip_low=CLIP_LOW,
    live=LIVE,
    old=OLD,
    ref=REF,
    adv=ADV,
    weights=W,
):
    """Returns (S, d, value, grad [B][L] of value w.r.t. live)."""
    rows, length = len(weights), len(weights[0])
    total, grads, nonempty, total_w = 0.0, [], 0, 0.0
    for b in range(rows):
        row_w = sum(weights[b])
        if row_w > 0:
            nonempty += 1
        total_w += row_w
        if aggregation == "sequence_mean_token_mean":
            scale = 1.0 / row_w if row_w > 0 else 0.0
        elif aggregation == "sequence_mean_token_scale":
            scale = 1.0 / (token_scale or length)
        else:
            scale = 1.0
        row_sum, row_grads = 0.0, []
        for i in range(length):
            w = weights[b][i]
            if w == 0:
                row_grads.append(0.0)
                continue
            x, _, _, _, x_grad = hand_slot(
                live[b][i],
                old[b][i],
                ref[b][i],
                adv[b],
                clip_low=clip_low,
                clip_high=clip_high,
                dual=dual,
                beta=beta,
                estimator=estimator,
            )
            row_sum += x * w
            row_grads.append(x_grad * w * scale)
        total += row_sum * scale
        grads.append(row_grads)
    if aggregation == "token_mean":
        denom = total_w
    elif aggregation == "sequence_mean_token_sum":
        denom = float(nonempty)
    else:
        denom = float(rows)
    value = total / denom if denom > 0 else 0.0
    grads = [[g / denom if denom > 0 else 0.0 for g in row] for row in grads]
    return total, denom, value, grads


def extreme(metric, kind: str = "max") -> float:
    """The value of an :class:`Extreme` aux metric, checked to reduce by ``kind``."""
    assert isinstance(metric, Extreme), type(metric).__name__
    assert metric.kind == kind, metric.kind
    return float(metric.value)


def assert_close_grid(actual: torch.Tensor, expected, rel=REL, abs_=1e-12) -> None:
    got = actual.tolist()
    for b, (grow, erow) in enumerate(zip(got, expected)):
        for i, (g, e) in enumerate(zip(grow, erow)):
            assert g == pytest.approx(e, rel=rel, abs=abs_), f"slot [{b}, {i}]: {g} != {e}"


# ---------------------------------------------------------------- the full grid (μ = 2)
@pytest.mark.parametrize(
    "algorithm,aggregation,kl",
    list(itertools.product(ALGORITHMS, AGGREGATIONS, KL_SETTINGS)),
    ids=param_id,
)
def test_primary_matches_hand_computation(algorithm, aggregation, kl):
    mode, token_scale = aggregation
    beta, estimator = kl
    config = PolicyLossConfig(
        algorithm=algorithm,
        num_iterations=2,
        aggregation=mode,
        token_scale=token_scale,
        beta=beta,
        kl_estimator=estimator,
    )
    logprobs = live_tensor()
    out = PolicyLoss(config)(ReplayScores(logprobs, None), make_batch(with_ref=beta != "none"))
    S, d, value, grads = hand_loss(
        clip_high=CLIP_HIGH[algorithm],
        beta=beta,
        estimator=estimator,
        aggregation=mode,
        token_scale=token_scale,
    )
    assert isinstance(out.primary, WeightedMetric)
    assert out.primary.sum.item() == pytest.approx(S, rel=REL)
    assert out.primary.denominator.item() == pytest.approx(d, rel=REL)
    assert out.primary.value.item() == pytest.approx(value, rel=REL)
    assert value != 0.0
    # the clip and the KL shape the differentiated loss (PITFALLS: not diagnostics only)
    (grad,) = torch.autograd.grad(out.primary.value, logprobs)
    assert_close_grid(grad, grads)
    assert ("policy/kl" in out.aux_metrics) == (beta != "none")


def test_denominators_by_aggregation():
    """Σw = 9.75; B = 4 (the zero-weight row counts for the sequence means); 3 non-empty rows."""
    expected = {
        "token_mean": 9.75,
        "sequence_mean_token_mean": 4.0,
        "sequence_mean_token_scale": 4.0,
        "sequence_mean_token_sum": 3.0,
    }
    for mode, d in expected.items():
        config = PolicyLossConfig(algorithm="grpo", num_iterations=2, aggregation=mode, beta="none")
        out = PolicyLoss(config)(ReplayScores(live_tensor(), None), make_batch(with_ref=False))
        assert out.primary.denominator.item() == d, mode


def test_token_scale_defaults_to_length_and_explicit_n_wins():
    base = dict(
        algorithm="drgrpo", num_iterations=2, aggregation="sequence_mean_token_scale", beta="none"
    )
    default = PolicyLoss(PolicyLossConfig(**base))(
        ReplayScores(live_tensor(), None), make_batch(with_ref=False)
    )
    explicit = PolicyLoss(PolicyLossConfig(**base, token_scale=7))(
        ReplayScores(live_tensor(), None), make_batch(with_ref=False)
    )
    # S_default * L == S_7 * 7 (both equal the plain weighted sum)
    assert default.primary.sum.item() * 5 == pytest.approx(explicit.primary.sum.item() * 7, rel=REL)
    S5, *_ = hand_loss(clip_high=0.2, beta="none", aggregation="sequence_mean_token_scale")
    assert default.primary.sum.item() == pytest.approx(S5, rel=REL)


@pytest.mark.parametrize("mode,token_scale", AGGREGATIONS, ids=param_id)
def test_micro_batches_reduce_to_the_global_value(mode, token_scale):
    """MATH.md §2: Σ_k S_k / Σ_k d_k over micro-batches equals the whole-batch value."""
    config = PolicyLossConfig(
        algorithm="grpo", num_iterations=2, aggregation=mode, token_scale=token_scale
    )
    loss = PolicyLoss(config)
    logprobs = live_tensor()
    whole = loss(ReplayScores(logprobs, None), make_batch())
    parts = [
        loss(ReplayScores(logprobs[s], None), make_batch()[s])
        for s in (slice(0, 2), slice(2, 3), slice(3, 4))
    ]
    S = sum(p.primary.sum for p in parts)
    d = sum(p.primary.denominator.item() for p in parts)
    assert d == pytest.approx(whole.primary.denominator.item(), rel=REL)
    assert (S / d).item() == pytest.approx(whole.primary.value.item(), rel=REL)
    (g_parts,) = torch.autograd.grad(S / d, logprobs)
    (g_whole,) = torch.autograd.grad(whole.primary.value, logprobs)
    assert torch.allclose(g_parts, g_whole, rtol=1e-9, atol=1e-15)
    # the extremes reduce to the true extreme over micro-batches (the zero-weight part
    # carries the neutral 1.0 / 0.0), which is the whole batch's, by hand: e^1.0, e^-0.5, 0.05
    active = [(b, i) for b in range(4) for i in range(5) if W[b][i] != 0]
    hand = {
        ("policy/ratio_max", "max"): max(math.exp(DELTA[b][i]) for b, i in active),
        ("policy/ratio_min", "min"): min(math.exp(DELTA[b][i]) for b, i in active),
        ("policy/parity_max_abs", "max"): max(abs(OLD[b][i] - BEHAVIOUR[b][i]) for b, i in active),
    }
    reduced = reduce_metrics([p.aux_metrics for p in parts])
    for (key, kind), expected in hand.items():
        assert reduced[key] == extreme(whole.aux_metrics[key], kind), key
        assert reduced[key] == pytest.approx(expected, rel=REL), key


def test_all_zero_weights_give_zero_not_nan():
    weights = [[0.0] * 5 for _ in range(4)]
    for mode, token_scale in AGGREGATIONS:
        config = PolicyLossConfig(
            algorithm="grpo", num_iterations=2, aggregation=mode, token_scale=token_scale
        )
        logprobs = live_tensor()
        out = PolicyLoss(config)(ReplayScores(logprobs, None), make_batch(weights=weights))
        assert out.primary.value.item() == 0.0, mode
        (grad,) = torch.autograd.grad(out.primary.value, logprobs)
        assert bool((grad == 0).all()), mode


# ------------------------------------------------------------------------- dual clip
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("mode,token_scale", AGGREGATIONS, ids=param_id)
def test_dual_clip_on_the_example(algorithm, mode, token_scale):
    """ε_c = 2: row 1 slot 3 (A = -1, ρ = e) becomes 2 exactly; the rest is unchanged."""
    config = PolicyLossConfig(
        algorithm=algorithm,
        num_iterations=2,
        aggregation=mode,
        token_scale=token_scale,
        dual_clip=2.0,
        beta="none",
    )
    logprobs = live_tensor()
    out = PolicyLoss(config)(ReplayScores(logprobs, None), make_batch(with_ref=False))
    S, d, value, grads = hand_loss(
        clip_high=CLIP_HIGH[algorithm],
        beta="none",
        aggregation=mode,
        token_scale=token_scale,
        dual=2.0,
    )
    assert out.primary.sum.item() == pytest.approx(S, rel=REL)
    assert out.primary.denominator.item() == pytest.approx(d, rel=REL)
    assert out.primary.value.item() == pytest.approx(value, rel=REL)
    (grad,) = torch.autograd.grad(out.primary.value, logprobs)
    assert_close_grid(grad, grads)
    assert grad[1, 3].item() == 0.0  # the dual clip is binding there
    # and it did change the loss relative to no dual clip
    _, _, plain, _ = hand_loss(
        clip_high=CLIP_HIGH[algorithm], beta="none", aggregation=mode, token_scale=token_scale
    )
    assert value < plain


def single_slot(adv: float, delta: float, **config_kwargs):
    """One row, one active slot of weight 1, token_mean, beta 'none', μ = 2."""
    old = [[-1.0]]
    live = torch.tensor([[old[0][0] + delta]], dtype=torch.float64, requires_grad=True)
    config = PolicyLossConfig(
        algorithm="grpo",
        num_iterations=2,
        aggregation="token_mean",
        beta="none",
        **config_kwargs,
    )
    batch = make_batch(adv=[adv], weights=[[1.0]], old=old, behaviour=old, ref=old, with_ref=False)
    out = PolicyLoss(config)(ReplayScores(live, None), batch)
    (grad,) = torch.autograd.grad(out.primary.value, live)
    return out, grad.item()


@pytest.mark.parametrize("adv,eps_c", [(-0.5, 3.0), (-1.0, 2.0), (-2.0, 1.5)])
def test_dual_clip_caps_negative_advantage_exactly(adv, eps_c):
    out, grad = single_slot(adv, 2.0, dual_clip=eps_c)  # ρ = e² ≈ 7.39 > ε_c
    assert out.primary.sum.item() == -eps_c * adv  # exact
    assert out.primary.value.item() == -eps_c * adv
    assert grad == 0.0
    # without the dual clip the loss is the (larger) unclipped -A ρ
    plain, plain_grad = single_slot(adv, 2.0)
    assert plain.primary.sum.item() == pytest.approx(-adv * math.exp(2.0), rel=REL)
    assert plain_grad == pytest.approx(-adv * math.exp(2.0), rel=REL)


@pytest.mark.parametrize("delta", [2.0, 0.1, -0.5, -2.0])
def test_dual_clip_leaves_positive_advantage_alone(delta):
    with_dual, g1 = single_slot(0.75, delta, dual_clip=1.5)
    without, g2 = single_slot(0.75, delta)
    assert with_dual.primary.sum.item() == without.primary.sum.item()
    assert g1 == g2
    rho = math.exp(delta)
    expected = max(-0.75 * rho, -0.75 * min(max(rho, 0.8), 1.2))
    assert with_dual.primary.sum.item() == pytest.approx(expected, rel=REL)


def test_dual_clip_not_binding_for_moderate_ratio():
    out, grad = single_slot(-1.0, 0.5, dual_clip=3.0)  # ρ = 1.65 < 3
    assert out.primary.sum.item() == pytest.approx(math.exp(0.5), rel=REL)
    assert grad == pytest.approx(math.exp(0.5), rel=REL)


# ------------------------------------------------------------------ log-ratio clamp
def test_log_ratio_clamped_at_plus_minus_20():
    old = [[-1.0, -1.0, -2.0], [-1.0, -1.0, -2.0]]
    deltas = [25.0, -25.0, 19.0]
    live_rows = [[o + d for o, d in zip(row, deltas)] for row in old]
    live = torch.tensor(live_rows, dtype=torch.float64, requires_grad=True)
    adv = [-1.0, 1.0]
    weights = [[1.0, 1.0, 0.5], [1.0, 1.0, 0.5]]
    config = PolicyLossConfig(
        algorithm="grpo", num_iterations=2, aggregation="token_mean", beta="none"
    )
    batch = make_batch(adv=adv, weights=weights, old=old, behaviour=old, ref=old, with_ref=False)
    out = PolicyLoss(config)(ReplayScores(live, None), batch)
    e20, e19 = math.exp(20.0), math.exp(19.0)
    # row 0 (A = -1): ρ = e^20 unclipped, ρ = e^-20 clipped to 0.8, e^19 unclipped
    # row 1 (A = +1): clipped to -1.2, -e^-20 unclipped, clipped to -1.2
    S = (e20 + 0.8 + 0.5 * e19) + (-1.2 - math.exp(-20.0) - 0.5 * 1.2)
    assert math.isfinite(out.primary.sum.item())
    assert out.primary.sum.item() == pytest.approx(S, rel=REL)
    assert out.primary.value.item() == pytest.approx(S / 5.0, rel=REL)
    assert extreme(out.aux_metrics["policy/ratio_max"]) == pytest.approx(e20, rel=REL)
    assert extreme(out.aux_metrics["policy/ratio_min"], "min") == pytest.approx(
        math.exp(-20.0), rel=REL
    )
    (grad,) = torch.autograd.grad(out.primary.value, live)
    # beyond the clamp the log-ratio is constant: no gradient; inside (δ = 19) -A ρ w / d
    expected = [[0.0, 0.0, 1.0 * e19 * 0.5 / 5.0], [0.0, 0.0, 0.0]]
    assert_close_grid(grad, expected)


def test_huge_log_ratio_stays_finite():
    out, grad = single_slot(-1.0, 1000.0)
    assert out.primary.sum.item() == pytest.approx(math.exp(20.0), rel=REL)
    assert grad == 0.0


# ------------------------------------------------------- μ = 1: old = stop_grad(live)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("mode,token_scale", AGGREGATIONS, ids=param_id)
@pytest.mark.parametrize(
    "kl", [("none", "k3"), (0.0, "k3"), (0.04, "k2"), (0.04, "k3")], ids=param_id
)
def test_single_iteration_ratio_is_one_and_gradient_is_minus_a_w_over_d(
    algorithm, mode, token_scale, kl
):
    beta, estimator = kl
    config = PolicyLossConfig(
        algorithm=algorithm,
        num_iterations=1,
        aggregation=mode,
        token_scale=token_scale,
        beta=beta,
        kl_estimator=estimator,
    )
    logprobs = live_tensor()
    # old_logprobs present but must be ignored with one inner iteration
    out = PolicyLoss(config)(ReplayScores(logprobs, None), make_batch(with_ref=beta != "none"))
    aux = out.aux_metrics
    assert aux["policy/ratio_mean"].value.item() == 1.0
    assert extreme(aux["policy/ratio_max"]) == 1.0
    assert extreme(aux["policy/ratio_min"], "min") == 1.0
    assert aux["policy/clip_frac_low"].value.item() == 0.0
    assert aux["policy/clip_frac_high"].value.item() == 0.0
    S, d, value, grads = hand_loss(
        clip_high=CLIP_HIGH[algorithm],
        beta=beta,
        estimator=estimator,
        aggregation=mode,
        token_scale=token_scale,
        old=LIVE,
    )
    assert out.primary.sum.item() == pytest.approx(S, rel=REL)
    assert out.primary.denominator.item() == pytest.approx(d, rel=REL)
    assert out.primary.value.item() == pytest.approx(value, rel=REL)
    (grad,) = torch.autograd.grad(out.primary.value, logprobs)
    assert_close_grid(grad, grads)
    assert bool((grad != 0).any())
    if beta in ("none", 0.0) and mode == "token_mean":
        # pure pg: -A · w / d, written out
        manual = [[-ADV[b] * W[b][i] / 9.75 for i in range(5)] for b in range(4)]
        assert_close_grid(grad, manual)


def test_single_iteration_parity_uses_live_scores():
    config = PolicyLossConfig(algorithm="dapo", num_iterations=1)
    out = PolicyLoss(config)(ReplayScores(live_tensor(), None), make_batch(with_ref=False))
    num = sum(W[b][i] * abs(LIVE[b][i] - BEHAVIOUR[b][i]) for b in range(4) for i in range(5))
    assert out.aux_metrics["policy/parity_mean_abs"].value.item() == pytest.approx(
        num / 9.75, rel=REL
    )


# ------------------------------------------------------ gradient shaping by the clip
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_clip_zeroes_gradient_beyond_range_and_passes_it_inside(algorithm):
    config = PolicyLossConfig(
        algorithm=algorithm, num_iterations=2, aggregation="token_mean", beta="none"
    )
    logprobs = live_tensor()
    out = PolicyLoss(config)(ReplayScores(logprobs, None), make_batch(with_ref=False))
    (grad,) = torch.autograd.grad(out.primary.value, logprobs)
    d = 9.75
    high = 1.0 + CLIP_HIGH[algorithm]

    def inside(b, i):
        return -ADV[b] * math.exp(DELTA[b][i]) * W[b][i] / d

    # A > 0, ρ = e^0.5 > 1 + ε_high: clipped, zero gradient
    assert grad[0, 0].item() == 0.0
    # A < 0, ρ = e^-0.5 < 1 - ε_low and e^-0.3 < 0.8: clipped, zero gradient
    assert grad[1, 0].item() == 0.0
    assert grad[3, 1].item() == 0.0
    # inside the range: -A ρ w / d
    for b, i in [(0, 1), (1, 1), (3, 2), (3, 4)]:
        assert grad[b, i].item() == pytest.approx(inside(b, i), rel=REL)
    # pessimistic side: A > 0 with ρ < 1 - ε_low, A < 0 with ρ > 1 + ε_high: not clipped
    for b, i in [(0, 3), (1, 2), (1, 3), (3, 0)]:
        assert grad[b, i].item() == pytest.approx(inside(b, i), rel=REL)
    # ρ = e^0.22 = 1.246 with A > 0: clipped by GRPO's 1.2, inside DAPO's 1.28
    if math.exp(0.22) > high:
        assert grad[0, 4].item() == 0.0
    else:
        assert grad[0, 4].item() == pytest.approx(inside(0, 4), rel=REL)
    assert (algorithm == "dapo") == (grad[0, 4].item() != 0.0)
    # inactive slots and the zero-weight row: no gradient
    for b, i in [(0, 2), (1, 4), (3, 3)] + [(2, k) for k in range(5)]:
        assert grad[b, i].item() == 0.0


# ------------------------------------------------------------------------------ KL
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_per_action_hand_values(estimator):
    live = [-1.0, -0.2, -3.0, -0.5]
    ref = [-1.5, -0.2, -0.1, -4.0]
    got = kl_per_action(
        torch.tensor(live, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64), estimator
    ).tolist()
    for g, lv, rf in zip(got, live, ref):
        assert g == pytest.approx(hand_kl(lv, rf, estimator), rel=REL, abs=1e-15)
    assert got[1] == 0.0  # equal log-probs


def test_k3_is_non_negative():
    diffs = [x / 4.0 for x in range(-60, 61)]
    live = torch.tensor([-1.0] * len(diffs), dtype=torch.float64)
    ref = live + torch.tensor(diffs, dtype=torch.float64)
    kl = kl_per_action(live, ref, "k3")
    assert bool((kl >= 0).all())
    assert kl[diffs.index(0.0)].item() == 0.0
    assert bool((kl_per_action(live, ref, "k2") >= 0).all())


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_zero_when_live_equals_reference(estimator):
    config = PolicyLossConfig(algorithm="grpo", num_iterations=2, beta=0.04, kl_estimator=estimator)
    out = PolicyLoss(config)(ReplayScores(live_tensor(), None), make_batch(ref=LIVE))
    assert out.aux_metrics["policy/kl"].value.item() == 0.0
    S, _, _, _ = hand_loss(clip_high=0.2, beta="none", aggregation="sequence_mean_token_mean")
    assert out.primary.sum.item() == pytest.approx(S, rel=REL)


@pytest.mark.parametrize("estimator", ["k2", "k3"])
@pytest.mark.parametrize("num_iterations", [1, 2])
def test_kl_gradient_pulls_toward_reference(estimator, num_iterations):
    """With A = 0 only β·KL shapes the gradient; descent moves live toward ref."""
    live = [[-1.0, -2.0, -0.5]]
    ref = [[-1.6, -1.2, -0.5]]  # live above ref, live below ref, equal
    logprobs = torch.tensor(live, dtype=torch.float64, requires_grad=True)
    config = PolicyLossConfig(
        algorithm="grpo",
        num_iterations=num_iterations,
        beta=0.04,
        kl_estimator=estimator,
        aggregation="token_mean",
    )
    batch = make_batch(adv=[0.0], weights=[[1.0, 1.0, 1.0]], old=live, behaviour=live, ref=ref)
    out = PolicyLoss(config)(ReplayScores(logprobs, None), batch)
    (grad,) = torch.autograd.grad(out.primary.value, logprobs)
    assert grad[0, 0].item() > 0  # live > ref: descent lowers live
    assert grad[0, 1].item() < 0  # live < ref: descent raises live
    assert grad[0, 2].item() == 0.0
    for i in range(3):
        expected = 0.04 * hand_kl_grad(live[0][i], ref[0][i], estimator) / 3.0
        assert grad[0, i].item() == pytest.approx(expected, rel=REL, abs=1e-15)


def test_beta_zero_scores_reference_but_keeps_kl_out_of_the_loss():
    config = PolicyLossConfig(algorithm="grpo", num_iterations=2, beta=0.0)
    out = PolicyLoss(config)(ReplayScores(live_tensor(), None), make_batch())
    S, *_ = hand_loss(clip_high=0.2, beta="none", aggregation="sequence_mean_token_mean")
    assert out.primary.sum.item() == pytest.approx(S, rel=REL)
    kl_sum = sum(W[b][i] * hand_kl(LIVE[b][i], REF[b][i], "k3") for b in range(4) for i in range(5))
    assert out.aux_metrics["policy/kl"].value.item() == pytest.approx(kl_sum / 9.75, rel=REL)
    assert kl_sum > 0


# ---------------------------------------------------------------------- aux metrics
def test_aux_metrics_on_the_example():
    config = PolicyLossConfig(algorithm="grpo", num_iterations=2, beta=0.04, kl_estimator="k3")
    entropy = torch.tensor([[0.1 * (b + 1) + 0.01 * i for i in range(5)] for b in range(4)])
    out = PolicyLoss(config)(ReplayScores(live_tensor(), entropy), make_batch())
    aux = out.aux_metrics
    total_w = 9.75
    pg_sum = ratio_sum = low = high = parity_sum = kl_sum = ent_sum = 0.0
    ratios, parities = [], []
    for b in range(4):
        for i in range(5):
            w = W[b][i]
            if w == 0:
                continue
            _, pg, rho, kl, _ = hand_slot(
                LIVE[b][i],
                OLD[b][i],
                REF[b][i],
                ADV[b],
                clip_low=0.2,
                clip_high=0.2,
                dual=None,
                beta=0.04,
                estimator="k3",
            )
            pg_sum += w * pg
            ratio_sum += w * rho
            ratios.append(rho)
            low += w * (ADV[b] < 0 and rho < 0.8)
            high += w * (ADV[b] > 0 and rho > 1.2)
            parity = abs(OLD[b][i] - BEHAVIOUR[b][i])
            parities.append(parity)
            parity_sum += w * parity
            kl_sum += w * kl
            ent_sum += w * (0.1 * (b + 1) + 0.01 * i)
    # by hand: high-clipped = row 0 slots 0 (w 1) and 4 (w 1); low-clipped = row 1 slot 0
    # (w 1) and row 3 slot 1 (w 1)
    assert high == 2.0 and low == 2.0
    expected = {
        "policy/pg_loss": pg_sum / total_w,
        "policy/ratio_mean": ratio_sum / total_w,
        "policy/clip_frac_low": 2.0 / total_w,
        "policy/clip_frac_high": 2.0 / total_w,
        "policy/parity_mean_abs": parity_sum / total_w,
        "policy/kl": kl_sum / total_w,
        "policy/entropy": ent_sum / total_w,
    }
    for key, value in expected.items():
        metric = aux[key]
        assert isinstance(metric, WeightedMetric), key
        assert metric.denominator.item() == total_w, key
        assert metric.value.item() == pytest.approx(value, rel=REL), key
        assert not metric.sum.requires_grad, key
    assert extreme(aux["policy/ratio_max"]) == pytest.approx(max(ratios), rel=REL)
    assert extreme(aux["policy/ratio_min"], "min") == pytest.approx(min(ratios), rel=REL)
    assert extreme(aux["policy/parity_max_abs"]) == pytest.approx(max(parities), rel=REL)
    # inactive slots with large behaviour gaps (0.5, 0.9, 0.7, 0.6) are ignored
    assert max(parities) == pytest.approx(0.05, rel=1e-9)


def test_aux_clip_fractions_for_dapo_clip_high():
    config = PolicyLossConfig(algorithm="dapo", num_iterations=2)
    out = PolicyLoss(config)(ReplayScores(live_tensor(), None), make_batch(with_ref=False))
    # with 1 + 0.28 only row 0 slot 0 (ρ = e^0.5) is high-clipped
    assert out.aux_metrics["policy/clip_frac_high"].value.item() == pytest.approx(
        1.0 / 9.75, rel=REL
    )
    assert out.aux_metrics["policy/clip_frac_low"].value.item() == pytest.approx(
        2.0 / 9.75, rel=REL
    )
    assert "policy/kl" not in out.aux_metrics


# ------------------------------------------------------------------ missing inputs
def test_multiple_iterations_need_old_logprobs():
    config = PolicyLossConfig(algorithm="grpo", num_iterations=2, beta="none")
    with pytest.raises(ValueError, match="old_logprobs"):
        PolicyLoss(config)(
            ReplayScores(live_tensor(), None), make_batch(with_old=False, with_ref=False)
        )


@pytest.mark.parametrize("beta", [0.04, 0.0])
@pytest.mark.parametrize("num_iterations", [1, 2])
def test_beta_needs_ref_logprobs(beta, num_iterations):
    config = PolicyLossConfig(algorithm="grpo", num_iterations=num_iterations, beta=beta)
    with pytest.raises(ValueError, match="ref_logprobs"):
        PolicyLoss(config)(ReplayScores(live_tensor(), None), make_batch(with_ref=False))


@pytest.mark.parametrize("algorithm", ["dapo", "drgrpo"])
def test_no_reference_needed_when_beta_none(algorithm):
    config = PolicyLossConfig(algorithm=algorithm, num_iterations=1)
    out = PolicyLoss(config)(
        ReplayScores(live_tensor(), None), make_batch(with_old=False, with_ref=False)
    )
    assert math.isfinite(out.primary.value.item())
    assert "policy/kl" not in out.aux_metrics


# ------------------------------------------------------------------ group advantages
REWARDS = [1.0, 2.0, 4.0, 3.0, 3.0, 3.0, 0.0, 1.0, 0.0]


def hand_advantages(rewards, group, mode="group_std", ddof=1, eps=1e-6):
    out = []
    for start in range(0, len(rewards), group):
        g = rewards[start : start + group]
        mean = sum(g) / len(g)
        if mode == "group_mean":
            out.extend(r - mean for r in g)
            continue
        std = math.sqrt(sum((r - mean) ** 2 for r in g) / (len(g) - ddof))
        out.extend((r - mean) / (std + eps) for r in g)
    return out


@pytest.mark.parametrize(
    "mode,ddof,eps",
    [
        ("group_std", 1, 1e-6),
        ("group_std", 0, 1e-6),
        ("group_std", 1, 1e-2),
        ("group_mean", 1, 1e-6),
    ],
)
def test_group_advantages_hand_values(mode, ddof, eps):
    scale = {"group_std": "group", "group_mean": "none"}[mode]
    spec = AdvantageSpec(scale=scale, ddof=ddof, eps=eps)
    got = group_advantages(torch.tensor(REWARDS), 3, spec)
    assert got.dtype == torch.float32
    assert got.shape == (9,)
    expected = hand_advantages(REWARDS, 3, mode, ddof, eps)
    for g, e in zip(got.tolist(), expected):
        assert g == pytest.approx(e, rel=1e-6, abs=1e-7)
    # equal rewards -> exactly 0
    assert got[3:6].tolist() == [0.0, 0.0, 0.0]


def test_group_advantages_defaults_are_grpo_ddof1_eps1e6():
    assert AdvantageSpec() == AdvantageSpec(scale="group", ddof=1, eps=1e-6, clip=None)
    got = group_advantages(torch.tensor([0.0, 1.0, 5.0, 5.0]), 2)
    # group [0, 1]: mean 0.5, std (ddof 1) = sqrt(0.5)
    s = math.sqrt(0.5)
    assert got.tolist() == pytest.approx([-0.5 / (s + 1e-6), 0.5 / (s + 1e-6), 0.0, 0.0], rel=1e-6)


def test_group_advantages_integer_rewards_and_sign():
    got = group_advantages(torch.tensor([0, 1, 1, 1]), 4, AdvantageSpec(scale="none"))
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx([-0.75, 0.25, 0.25, 0.25], rel=1e-6)


def test_group_advantages_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"rewards: expected \[B\].*group_size=2.*\(2, 2\)"):
        group_advantages(torch.zeros(2, 2), 2)
    with pytest.raises(ValueError, match=r"multiple of group_size=2.*\(5,\)"):
        group_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(4), 1, AdvantageSpec(ddof=1))  # std of one sample, ddof 1


def test_group_advantages_group_of_one_with_ddof0_or_mean():
    rewards = torch.tensor([3.0, 5.0])
    assert group_advantages(rewards, 1, AdvantageSpec(ddof=0)).tolist() == [0.0, 0.0]
    assert group_advantages(rewards, 1, AdvantageSpec(scale="none")).tolist() == [0.0, 0.0]


# ------------------------------------------------------------------ overlong penalty
def hand_overlong(length, max_tokens, buffer, penalty):
    if buffer == 0:
        return 0.0
    return min(-(length - (max_tokens - buffer)) / buffer * penalty, 0.0)


@pytest.mark.parametrize("penalty", [1.0, 0.5])
def test_overlong_penalty_in_tokens(penalty):
    lengths = [0, 10, 16, 17, 18, 19, 20, 22]  # L_max = 20, L_buf = 4: buffer is (16, 20]
    got = overlong_penalty(torch.tensor(lengths), 20, 4, penalty)
    assert got.dtype == torch.float32
    expected = [hand_overlong(n, 20, 4, penalty) for n in lengths]
    assert got.tolist() == pytest.approx(expected, rel=REL, abs=1e-12)
    # spelled out: below the buffer 0, inside linear, at L_max the full penalty
    assert got.tolist()[:3] == [0.0, 0.0, 0.0]
    assert got[3].item() == pytest.approx(-0.25 * penalty, rel=REL)
    assert got[4].item() == pytest.approx(-0.5 * penalty, rel=REL)
    assert got[6].item() == pytest.approx(-1.0 * penalty, rel=REL)
    # beyond L_max the MATH.md §3 formula keeps falling linearly (no lower clamp)
    assert got[7].item() == pytest.approx(-1.5 * penalty, rel=REL)


def test_overlong_penalty_off():
    lengths = torch.tensor([5, 19, 20, 40])
    for buffer, penalty in [(0, 1.0), (4, 0.0)]:
        got = overlong_penalty(lengths, 20, buffer, penalty)
        assert got.dtype == torch.float32
        assert got.tolist() == [0.0, 0.0, 0.0, 0.0]


# ------------------------------------------------------------------------- config
def test_algorithm_defaults_table():
    assert ALGORITHM_DEFAULTS["dapo"]["clip_high"] == 0.28
    assert ALGORITHM_DEFAULTS["dapo"]["beta"] == "none"
    assert ALGORITHM_DEFAULTS["grpo"]["beta"] == 0.04
    assert ALGORITHM_DEFAULTS["drgrpo"]["advantage"] == "group_mean"


def test_config_resolves_dapo():
    c = PolicyLossConfig(algorithm="dapo")
    assert c.clip_low == 0.2
    assert c.clip_high == 0.28
    assert c.beta == "none"
    assert not c.uses_reference
    assert c.aggregation == "token_mean"
    assert c.dynamic_sampling is True
    assert c.advantage == "group_std"


def test_config_resolves_drgrpo():
    c = PolicyLossConfig(algorithm="drgrpo")
    assert c.advantage == "group_mean"
    assert c.aggregation == "sequence_mean_token_scale"
    assert c.token_scale is None  # N = L at call time
    assert c.clip_high == 0.2
    assert c.dynamic_sampling is False


def test_config_resolves_grpo():
    c = PolicyLossConfig()
    assert c.algorithm == "grpo"
    assert c.beta == 0.04
    assert c.uses_reference
    assert c.clip_high == 0.2
    assert c.advantage == "group_std"
    assert c.std_ddof == 1
    assert c.std_eps == 1e-6
    assert c.num_iterations == 1
    assert c.kl_estimator == "k3"
    assert c.dual_clip is None


def test_config_advantage_spec_mapping():
    """group_std -> scale group with std_ddof / std_eps; group_mean (Dr.GRPO) -> scale none."""
    assert PolicyLossConfig().advantage_spec == AdvantageSpec(scale="group", ddof=1, eps=1e-6)
    assert PolicyLossConfig(std_ddof=0, std_eps=1e-2).advantage_spec == AdvantageSpec(
        scale="group", ddof=0, eps=1e-2
    )
    assert PolicyLossConfig(algorithm="dapo").advantage_spec == AdvantageSpec(scale="group")
    assert PolicyLossConfig(algorithm="drgrpo").advantage_spec == AdvantageSpec(scale="none")


def test_config_explicit_overrides_win_even_when_falsy():
    c = PolicyLossConfig(
        algorithm="dapo",
        clip_high=0.3,
        beta=0.0,
        aggregation="sequence_mean_token_sum",
        dynamic_sampling=False,
        overlong_penalty=0.0,
        advantage="group_mean",
    )
    assert c.clip_high == 0.3
    assert c.beta == 0.0 and c.uses_reference
    assert c.aggregation == "sequence_mean_token_sum"
    assert c.dynamic_sampling is False
    assert c.overlong_penalty == 0.0
    assert c.advantage == "group_mean"
    g = PolicyLossConfig(algorithm="grpo", beta="none", clip_high=0.0)
    assert g.beta == "none" and not g.uses_reference
    assert g.clip_high == 0.0
    # the defaults table itself is not mutated by a resolved config
    assert ALGORITHM_DEFAULTS["dapo"]["clip_high"] == 0.28


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        ({"beta": -1}, "beta"),
        ({"beta": float("inf")}, "beta"),
        ({"beta": float("nan")}, "beta"),
        ({"beta": "off"}, "beta"),
        ({"clip_low": 1.0}, "clip_low"),
        ({"clip_low": -0.1}, "clip_low"),
        ({"clip_high": -0.1}, "clip_high"),
        ({"dual_clip": 1.0}, "dual_clip"),
        ({"num_iterations": 0}, "num_iterations"),
        ({"token_scale": 0}, "token_scale"),
        ({"kl_estimator": "k4"}, "kl_estimator"),
        ({"aggregation": "mean"}, "aggregation"),
        ({"algorithm": "ppo"}, "algorithm"),
        ({"std_ddof": 2}, "std_ddof"),
        ({"unknown_key": 1}, "unknown_key"),
    ],
)
def test_config_rejects_bad_values(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        PolicyLossConfig(**kwargs)


def test_config_unknown_key_message_says_extra():
    with pytest.raises(ValueError, match=r"(?s)clip_ratio.*[Ee]xtra"):
        PolicyLossConfig(clip_ratio=0.2)


def test_config_beta_message_explains_expected():
    with pytest.raises(ValueError, match=r"beta: expected a finite value >= 0 or 'none'"):
        PolicyLossConfig(beta=-1)


# ---------------------------------------------------------------------- aggregate
def test_aggregate_direct_hand_values():
    values = torch.tensor([[1.0, -2.0, 3.0], [0.5, 0.5, 9.0], [4.0, 4.0, 4.0]])
    weights = torch.tensor([[1.0, 0.5, 0.0], [0.0, 0.0, 0.0], [0.25, 1.0, 1.0]])
    row0, row2 = 1.0 - 1.0, 1.0 + 4.0 + 4.0  # Σ x w per row (row 1 empty)
    cases = {
        ("token_mean", None): (row0 + row2, 1.5 + 2.25),
        ("sequence_mean_token_mean", None): (row0 / 1.5 + row2 / 2.25, 3.0),
        ("sequence_mean_token_scale", None): ((row0 + row2) / 3, 3.0),
        ("sequence_mean_token_scale", 10): ((row0 + row2) / 10, 3.0),
        ("sequence_mean_token_sum", None): (row0 + row2, 2.0),
    }
    for (mode, n), (S, d) in cases.items():
        m = aggregate(values, weights, mode, n)
        assert m.sum.item() == pytest.approx(S, rel=REL, abs=1e-12), mode
        assert m.denominator.item() == d, mode
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(values, weights, "bogus", None)


def test_metadata_names_algorithm():
    meta = PolicyLoss(PolicyLossConfig(algorithm="dapo")).metadata()
    assert meta["name"] == "dapo"
    assert meta["clip_high"] == 0.28
    assert meta["beta"] == "none"


# ------------------------------------------------- non-finite values on inactive slots
NONFINITE_CASES = {
    "nan_live": ("live", float("nan")),
    "neg_inf_live": ("live", float("-inf")),
    "nan_old": ("old", float("nan")),
    "inf_old": ("old", float("inf")),
    "nan_ref": ("ref", float("nan")),
    "neg_inf_ref": ("ref", float("-inf")),
    "nan_behaviour": ("behaviour", float("nan")),
}


def poisoned_example(where: str, bad: float):
    """The example with ``bad`` written into every inactive slot of one input."""
    tables = {
        "live": [row[:] for row in LIVE],
        "old": [row[:] for row in OLD],
        "ref": [row[:] for row in REF],
        "behaviour": [row[:] for row in BEHAVIOUR],
    }
    for b in range(4):
        for i in range(5):
            if W[b][i] == 0:
                tables[where][b][i] = bad
    logprobs = torch.tensor(tables["live"], dtype=torch.float64, requires_grad=True)
    batch = make_batch(old=tables["old"], ref=tables["ref"], behaviour=tables["behaviour"])
    return logprobs, batch


@pytest.mark.parametrize("case", sorted(NONFINITE_CASES))
@pytest.mark.parametrize("kl", KL_SETTINGS, ids=param_id)
def test_inactive_non_finite_values_never_reach_loss_or_metrics(case, kl):
    beta, estimator = kl
    config = PolicyLossConfig(algorithm="grpo", num_iterations=2, beta=beta, kl_estimator=estimator)
    logprobs, batch = poisoned_example(*NONFINITE_CASES[case])
    out = PolicyLoss(config)(ReplayScores(logprobs, None), batch)
    S, d, value, _ = hand_loss(
        clip_high=0.2, beta=beta, estimator=estimator, aggregation="sequence_mean_token_mean"
    )
    assert out.primary.sum.item() == pytest.approx(S, rel=REL)
    assert out.primary.value.item() == pytest.approx(value, rel=REL)
    for key, metric in out.aux_metrics.items():
        v = (
            metric.value
            if isinstance(metric, (WeightedMetric, Extreme))
            else torch.as_tensor(metric)
        )
        assert math.isfinite(float(v)), key
    assert extreme(out.aux_metrics["policy/ratio_max"]) == pytest.approx(math.exp(1.0), rel=REL)


def _gradient_case_ids():
    return [
        pytest.param(case, (beta, estimator), id=f"{case}-{param_id((beta, estimator))}")
        for case in sorted(NONFINITE_CASES)
        for beta, estimator in KL_SETTINGS
    ]


@pytest.mark.parametrize("case,kl", _gradient_case_ids())
def test_inactive_non_finite_values_never_reach_gradient(case, kl):
    beta, estimator = kl
    config = PolicyLossConfig(algorithm="grpo", num_iterations=2, beta=beta, kl_estimator=estimator)
    logprobs, batch = poisoned_example(*NONFINITE_CASES[case])
    out = PolicyLoss(config)(ReplayScores(logprobs, None), batch)
    (grad,) = torch.autograd.grad(out.primary.value, logprobs)
    assert bool(torch.isfinite(grad).all()), grad
    _, _, _, grads = hand_loss(
        clip_high=0.2, beta=beta, estimator=estimator, aggregation="sequence_mean_token_mean"
    )
    assert_close_grid(grad, grads)


def test_logprob_by_advantage_sign_metrics():
    logprobs = torch.tensor([[-0.5, -1.5, float("nan")], [-2.0, -4.0, -6.0], [-3.0, -3.0, -3.0]])
    weights = torch.tensor([[1.0, 1.0, 0.0], [0.5, 1.0, 0.0], [1.0, 1.0, 1.0]])
    batch = DiffusionTokenBatch(
        {
            "advantages": torch.tensor([1.0, -2.0, 0.0]),
            "behaviour_logprobs": torch.zeros(3, 3),
        },
        torch.where(weights != 0, 4, -1),
        weights,
    )
    out = PolicyLoss(PolicyLossConfig(beta="none"))(ReplayScores(logprobs, None), batch)
    # positive side: row 0, slots 0-1 → (-0.5 - 1.5) / 2; negative: row 1 → (0.5·-2 + -4) / 1.5
    assert float(out.aux_metrics["policy/logprob_pos_adv"].value) == pytest.approx(-1.0)
    assert float(out.aux_metrics["policy/logprob_neg_adv"].value) == pytest.approx(-5.0 / 1.5)
