"""Approximate log-prob estimators (baselines for ablations) and a scorer factory.

docs/math.md §1.3. Exact replay scores each action in the state the sampler took it in. The
estimators below ignore the trace's commit steps and score the final completion ``x`` from
freshly noised canvases instead, as public dLLM RL systems do. Every scorer here has

    ``score(batch, generator=None) -> ReplayScores``

with ``logprobs`` float32 ``[B, L]`` per active slot (0 on inactive slots) and ``entropy``
None. Masks and times are drawn on the CPU (moved to the model's device afterwards), in the
order documented per estimator so that a test (or a reader) can replay them by hand, from

* the rows' own streams when ``model_inputs`` has ``noise_seeds`` (int64 ``[B]`` noise keys,
  :class:`~diffusion_rl.seeding.RowStreams`): a row's draws are then a function of its key
  alone, so they do not depend on the micro-batch it is in or its position there, and
  ``generator`` is ignored (what :class:`~diffusion_rl.train.plans.TokenPolicyPlan` gives);
  "``rand(B, P)``" below then means row b's ``rand(P)`` from its stream, and so on;
* otherwise ``generator``, one stream shared by the batch (``None``: a fresh generator seeded
  with :data:`DEFAULT_SEED`, so such calls repeat exactly).

Conventions shared by all estimators: the clean completion is ``completion_ids`` as given
(unsampled slots hold the stop/fill id); masks cover every completion slot, and scores are
read on active slots only, with the sanitised read of exact replay
(:func:`~diffusion_rl.scoring.packed.score_actions`: MASK logit at -inf, temperature ``T``,
``T = 0`` read at 1). The prompt keeps its key padding. Each estimator runs its noised
canvases as one batched forward (rows are independent).

* ``mean_field`` (d1 / diffu-GRPO): one pass on ``q̃ ⊕ MASK^L``;
  ``ℓ_i = log p(x_i | q̃ ⊕ MASK^L)``.
* ``coupled`` (DiffuCoder): ``ℓ_i = ½ [ℓ⁰_i + m_i ℓᵐ_i / t + (1 - m_i) ℓ^{1-m}_i / (1 - t)]``.
* ``elbo`` (MDLM bound, SPG / VRPO): ``ℓ_i = mean_n (m_i / t) log p(x_i | x_t)``, whose sum
  over slots is the sequence ELBO estimate.
* ``spg`` (SPG, Wang et al. 2025, arXiv:2510.09541; facebookresearch/SPG ``spg/spg_trainer.py``):
  the *sandwiched* surrogate, read from ``model_inputs["advantages"]`` row by row: a row with
  ``A ≥ 0`` gets SPG's block-wise ELBO, a row with ``A < 0`` the mixture
  ``ω · EUBO + (1 - ω) · ELBO`` (``mix_weight`` ω = 1: the EUBO alone). With ``n`` active
  slots ``C`` and ``N`` noised canvases ``s`` of masked set ``M_s``, ``t̂_s = |M_s ∩ C| / n``
  and ``p_{s,i} = p(x_i | x̃_s)``::

      ELBO_i = mean_s [i ∈ M_s] log p_{s,i} / t̂_s
      q_i    = mean_s [i ∈ M_s] p_{s,i}^β / t̂_s
      EUBO_i = (n / n⁺) · (1/β) log q_i    if q_i > 0 (n⁺ = #{i ∈ C : q_i > 0}), else 0

  Both bounds are sums over slots (the EUBO is a sum of per-slot logs of per-slot means), so
  these per-slot terms sum exactly, value and gradient, to the row's surrogate; with μ = 1
  :class:`~diffusion_rl.objectives.grpo.PolicyLoss` gives ``-A · ∇surrogate`` per row.
  Masks are SPG's block-wise ones (:class:`SPGEstimator`).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from ..contracts import DiffusionTokenBatch
from ..kernels import KERNELS
from ..models.protocol import TokenDenoiser, block_origin, completion_blocks, completion_offsets
from ..seeding import RowStreams
from .packed import PackedReplayScorer, score_actions
from .replay import ReplayScorer, ReplayScores

DEFAULT_SEED = 0
ESTIMATOR_INPUTS = ("prompt_ids", "prompt_mask", "completion_ids")
NOISE_SEEDS = "noise_seeds"


class TraceScorer(Protocol):
    """Anything :func:`make_scorer` returns."""

    def score(
        self, batch: DiffusionTokenBatch, generator: torch.Generator | None = None
    ) -> ReplayScores: ...


def _check_temperature(temperature: float) -> None:
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature: expected a finite value >= 0, got {temperature}")


class _SharedStream:
    """``generator`` drawn for all B rows at once: ``rand(*shape)`` is ``rand(B, *shape)``
    (the interface of :class:`~diffusion_rl.seeding.RowStreams`)."""

    def __init__(self, generator: torch.Generator, rows: int) -> None:
        self.generator = generator
        self.rows = rows

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.rand((self.rows, *shape), generator=self.generator)


class _Estimator:
    """Shared plumbing: input checks, the batched forward and the sanitised read."""

    name = ""

    def __init__(self, model: TokenDenoiser, temperature: float) -> None:
        _check_temperature(temperature)
        self.model = model
        self.temperature = temperature
        self.logprob_kernel = KERNELS.resolve("token_logprobs")

    def _inputs(self, batch: DiffusionTokenBatch, generator: torch.Generator | None):
        missing = [k for k in ESTIMATOR_INPUTS if k not in batch.model_inputs]
        if missing:
            raise ValueError(
                f"model_inputs: the {self.name} estimator needs {list(ESTIMATOR_INPUTS)}, "
                f"missing {missing}; build the batch with TokenTrace.prepare()"
            )
        inputs = batch.model_inputs
        if NOISE_SEEDS in inputs:
            streams = RowStreams(inputs[NOISE_SEEDS], f"model_inputs[{NOISE_SEEDS!r}]")
        else:
            if generator is None:
                generator = torch.Generator().manual_seed(DEFAULT_SEED)
            streams = _SharedStream(generator, batch.batch_size)
        return (
            inputs["prompt_ids"],
            inputs["prompt_mask"].bool(),
            inputs["completion_ids"],
            streams,
        )

    def _logprobs(
        self,
        batch: DiffusionTokenBatch,
        prompts: torch.Tensor,
        prompt_mask: torch.Tensor,
        completions: torch.Tensor,
    ) -> torch.Tensor:
        """``log p(x_i | canvas)`` float32 ``[N, B, L]`` for ``N`` noised canvases per row.

        ``prompts [N, B, P]`` and ``completions [N, B, L]`` (MASK where noised) run as one
        forward of ``N · B`` rows; ``x`` is ``batch``'s targets, read on active slots only.
        """
        n, b, p = prompts.shape
        length = completions.shape[-1]
        key_mask = torch.cat(
            [prompt_mask, torch.ones(b, length, dtype=torch.bool, device=prompt_mask.device)], 1
        )
        canvas = torch.cat([prompts, completions], dim=-1).reshape(n * b, p + length)
        logits = self.model(canvas, key_mask.repeat(n, 1), p)[:, p:]
        acting = batch.active.repeat(n, 1)
        targets = torch.where(acting, batch.target_ids.repeat(n, 1), 0)
        logprobs, _ = score_actions(
            logits,
            targets,
            acting,
            mask_token_id=self.model.mask_token_id,
            temperature=self.temperature,
            kernel=self.logprob_kernel,
        )
        return logprobs.view(n, b, length)


class MeanFieldEstimator(_Estimator):
    """d1 / diffu-GRPO: ``ℓ_i ≈ log softmax(f_θ(q̃ ⊕ MASK^L)_i / T)[x_i]``.

    ``q̃`` is the prompt with each real (non-padding) token re-masked independently with
    probability ``prompt_mask_prob``. Draws: ``u = rand(B, P)``; re-masked iff
    ``u < prompt_mask_prob``. Commit steps are ignored.
    """

    name = "mean_field"

    def __init__(
        self, model: TokenDenoiser, temperature: float, prompt_mask_prob: float = 0.15
    ) -> None:
        super().__init__(model, temperature)
        if not 0.0 <= prompt_mask_prob <= 1.0:
            raise ValueError(
                f"prompt_mask_prob: expected a value in [0, 1], got {prompt_mask_prob}"
            )
        self.prompt_mask_prob = prompt_mask_prob

    def score(
        self, batch: DiffusionTokenBatch, generator: torch.Generator | None = None
    ) -> ReplayScores:
        prompt_ids, prompt_mask, completion, streams = self._inputs(batch, generator)
        mask_id = self.model.mask_token_id
        u = streams.rand(prompt_ids.shape[1]).to(prompt_ids.device)
        remask = prompt_mask & (u < self.prompt_mask_prob)
        prompts = torch.where(remask, mask_id, prompt_ids)
        masked = torch.full_like(completion, mask_id)
        return ReplayScores(
            self._logprobs(batch, prompts[None], prompt_mask, masked[None])[0], None
        )


class CoupledEstimator(_Estimator):
    """DiffuCoder's coupled sampling: three passes per row, complementary masks.

    Draws: ``t = lo + (hi - lo) · rand(B)`` (one time per row), then ``u = rand(B, L)``;
    ``m_i = u_i < t``. Passes over the completion: fully masked (``ℓ⁰``), masked where ``m``
    (``ℓᵐ``), masked where ``1 - m`` (``ℓ^{1-m}``); every slot is masked in exactly one of the
    two partial passes. Per slot::

        ℓ_i = ½ [ ℓ⁰_i + m_i · ℓᵐ_i / t + (1 - m_i) · ℓ^{1-m}_i / (1 - t) ]

    i.e. the average of the fully masked pass and the importance-weighted pass in which the
    slot is masked (DiffuCoder draws one ``t`` per batch; here each row has its own).
    """

    name = "coupled"

    def __init__(
        self,
        model: TokenDenoiser,
        temperature: float,
        t_range: tuple[float, float] = (0.2, 0.8),
    ) -> None:
        super().__init__(model, temperature)
        lo, hi = t_range
        if not 0.0 < lo <= hi < 1.0:
            raise ValueError(f"t_range: expected 0 < lo <= hi < 1, got {t_range}")
        self.t_range = (float(lo), float(hi))

    def score(
        self, batch: DiffusionTokenBatch, generator: torch.Generator | None = None
    ) -> ReplayScores:
        prompt_ids, prompt_mask, completion, streams = self._inputs(batch, generator)
        lo, hi = self.t_range
        t = (lo + (hi - lo) * streams.rand())[:, None]
        m = streams.rand(completion.shape[1]) < t
        t, m = t.to(completion.device), m.to(completion.device)
        mask = torch.full_like(completion, self.model.mask_token_id)
        passes = torch.stack(
            [mask, torch.where(m, mask, completion), torch.where(m, completion, mask)]
        )
        full, on_m, off_m = self._logprobs(batch, prompt_ids.expand(3, -1, -1), prompt_mask, passes)
        weighted = torch.where(m, on_m / t, off_m / (1.0 - t))
        return ReplayScores(0.5 * (full + weighted), None)


class ELBOEstimator(_Estimator):
    """MDLM evidence lower bound (SPG / VRPO): ``E_t[(1/t) Σ_{masked i} log p_θ(x_i | x_t)]``.

    Per sample ``n`` (``num_samples`` of them, in order): ``t = eps + (1 - eps) · rand(B)``
    (one time per row; ``eps`` keeps ``1/t`` bounded), then ``u = rand(B, L)``,
    ``m_i = u_i < t``, ``x_t`` = completion with MASK where ``m``. Per slot the estimate is
    ``mean_n (m_i / t) · log p(x_i | x_t)``, so the sum over a row's slots is its ELBO estimate.
    """

    name = "elbo"

    def __init__(
        self, model: TokenDenoiser, temperature: float, num_samples: int = 1, eps: float = 1e-3
    ) -> None:
        super().__init__(model, temperature)
        if num_samples < 1:
            raise ValueError(f"num_samples: expected >= 1, got {num_samples}")
        if not 0.0 < eps < 1.0:
            raise ValueError(f"eps: expected a value in (0, 1), got {eps}")
        self.num_samples = num_samples
        self.eps = eps

    def score(
        self, batch: DiffusionTokenBatch, generator: torch.Generator | None = None
    ) -> ReplayScores:
        prompt_ids, prompt_mask, completion, streams = self._inputs(batch, generator)
        times, masks = [], []
        for _ in range(self.num_samples):
            t = self.eps + (1.0 - self.eps) * streams.rand()
            masks.append(streams.rand(completion.shape[1]) < t[:, None])
            times.append(t[:, None])
        t = torch.stack(times).to(completion.device)  # [N, B, 1]
        m = torch.stack(masks).to(completion.device)  # [N, B, L]
        noised = torch.where(m, self.model.mask_token_id, completion)
        n = self.num_samples
        logprobs = self._logprobs(batch, prompt_ids.expand(n, -1, -1), prompt_mask, noised)
        return ReplayScores((torch.where(m, logprobs, 0.0) / t).mean(0), None)


class SPGEstimator(_Estimator):
    """SPG's sandwiched surrogate: the block-wise ELBO for rows with ``A ≥ 0``, the mixture
    ``ω · EUBO + (1 - ω) · ELBO`` for rows with ``A < 0`` (formulas in the module docstring;
    docs/math.md §1.3). The advantages are ``model_inputs["advantages"]``; a batch without
    them is scored with the ELBO on every row (what an ``A ≥ 0`` row gets).

    Block-wise masking mimics block-wise generation. The completion's blocks are the
    sampler's (``block_size``, pinned from the trace by
    :class:`~diffusion_rl.train.plans.TokenPolicyPlan`; ``None``: one block holding the whole
    completion), with the model's block origin (``completion_offsets``). ``C`` is the row's
    active slots (loss weight ≠ 0), ``J`` the blocks holding at least one of them. Noised
    canvas ``s`` (of ``num_samples``) picks one block ``j_s`` of ``J``: blocks before it stay
    clean, blocks after it are fully masked, and inside it ``k_s ~ U{1, …, a_s}`` of its ``a_s``
    active slots, a uniformly random subset, are masked. The clean context — the prompt's
    real tokens and the active slots of the blocks before ``j_s`` — is then re-masked
    independently with probability ``context_mask_prob``; inactive slots are always MASK.
    ``M_s`` is every masked active slot (including re-masked context), and ``t̂_s = |M_s| / n``.

    Draws, per row (its own stream with ``noise_seeds``), in this order: ``u = rand(NB)``
    once (``NB = (L - 1 + r) // K + 1``, the most completion blocks a row can have, with
    ``r = K - 1`` for a ``"canvas"`` model and 0 otherwise; ``u_j`` is block ``j``'s key);
    the blocks of ``J`` ordered by ``u`` form a random permutation and canvas ``s`` (from 0)
    takes its entry ``s mod |J|`` (distinct blocks while ``num_samples ≤ |J|``). Then per canvas ``s``, in order: ``c = rand()``,
    ``k_s = min(1 + ⌊c · a_s⌋, a_s)``; ``v = rand(L)``, the ``k_s`` active slots of ``j_s`` with
    the smallest ``v`` are masked; ``w = rand(P + L)``, prompt token ``p`` re-masked iff
    ``w_p < context_mask_prob`` (real tokens only), clean active slot ``i`` iff
    ``w_{P+i} < context_mask_prob``. Every shape depends on ``(P, L, K, num_samples)`` only,
    so a row's masks do not depend on its micro-batch.

    Defaults follow the public SPG code and scripts: ``num_samples`` 2 (``num_t``),
    ``eubo_beta`` β 1.5 and ``mix_weight`` ω 0.5 (SPG w/ Mixture; its Sudoku scripts use
    β 1.0, its EUBO-only Countdown script β 2.0), ``context_mask_prob`` 0.15
    (``p_mask_prompt`` of its ``train.yaml``; 0.3 is only its config class default; the code
    applies it to the prompt and the clean earlier blocks alike). Differences from that code: the block is drawn uniformly from the
    blocks holding active slots (the code's permutation-then-modulo favours early blocks when
    the completion is shorter than the generation length), the prompt's left padding is
    never re-masked (it is key-padded here), and ``A = 0`` rows get the ELBO (the code sends
    them to the negative side; their gradient is 0 either way).
    """

    name = "spg"

    def __init__(
        self,
        model: TokenDenoiser,
        temperature: float,
        block_size: int | None = None,
        num_samples: int = 2,
        eubo_beta: float = 1.5,
        mix_weight: float = 0.5,
        context_mask_prob: float = 0.15,
    ) -> None:
        super().__init__(model, temperature)
        if block_size is not None and (isinstance(block_size, bool) or block_size < 1):
            raise ValueError(f"block_size: expected an int >= 1 or None, got {block_size!r}")
        if num_samples < 1:
            raise ValueError(f"num_samples: expected >= 1, got {num_samples}")
        if not (math.isfinite(eubo_beta) and eubo_beta > 0):
            raise ValueError(f"eubo_beta: expected a finite value > 0, got {eubo_beta}")
        if not 0.0 <= mix_weight <= 1.0:
            raise ValueError(f"mix_weight: expected a value in [0, 1], got {mix_weight}")
        if not 0.0 <= context_mask_prob <= 1.0:
            raise ValueError(
                f"context_mask_prob: expected a value in [0, 1], got {context_mask_prob}"
            )
        self.block_size = None if block_size is None else int(block_size)
        self.num_samples = num_samples
        self.eubo_beta = float(eubo_beta)
        self.mix_weight = float(mix_weight)
        self.context_mask_prob = float(context_mask_prob)

    def draw(self, batch: DiffusionTokenBatch, generator: torch.Generator | None = None):
        """The noised canvases' masks, on the CPU: ``prompt_masked [N, B, P]`` (re-masked
        prompt tokens), ``masked [N, B, L]`` (MASK in the completion canvas) and ``scored
        [N, B, L]`` (``M_s``: the masked active slots), in the documented draw order."""
        prompt_ids, prompt_mask, completion, streams = self._inputs(batch, generator)
        prompt_mask = prompt_mask.cpu()
        active = batch.active.cpu()
        rows, length = completion.shape
        width = prompt_ids.shape[1]
        if self.block_size is None:
            size, origin = length, "prompt"
        else:
            size, origin = self.block_size, block_origin(self.model)
        offsets = completion_offsets(prompt_mask, size, origin)
        blocks = completion_blocks(offsets, length, size)  # [B, L]
        count = (length - 1 + (size - 1 if origin == "canvas" else 0)) // size + 1
        holds = torch.zeros(rows, count, dtype=torch.long)
        holds = holds.scatter_add(1, torch.where(active, blocks, 0), active.long()) > 0
        u = streams.rand(count)
        order = torch.where(holds, u, 2.0).argsort(1)  # blocks of J first, a random permutation
        eligible = holds.sum(1).clamp(min=1)
        prompt_masked, masked, scored = [], [], []
        for s in range(self.num_samples):
            chosen = order.gather(1, (s % eligible)[:, None])  # [B, 1]
            in_block = active & (blocks == chosen)
            size_s = in_block.sum(1)
            c = streams.rand()
            k = torch.minimum(1 + (c * size_s).floor().long(), size_s)
            v = torch.where(in_block, streams.rand(length), 2.0)
            partial = in_block & (v.argsort(1).argsort(1) < k[:, None])
            w = streams.rand(width + length)
            remask = w < self.context_mask_prob
            context = active & (blocks < chosen) & remask[:, width:]
            hit = partial | context | (active & (blocks > chosen))
            prompt_masked.append(prompt_mask & remask[:, :width])
            masked.append(hit | ~active)
            scored.append(hit)
        return torch.stack(prompt_masked), torch.stack(masked), torch.stack(scored)

    def score(
        self, batch: DiffusionTokenBatch, generator: torch.Generator | None = None
    ) -> ReplayScores:
        prompt_masked, masked, scored = self.draw(batch, generator)
        inputs = batch.model_inputs
        prompt_ids, completion = inputs["prompt_ids"], inputs["completion_ids"]
        device = completion.device
        prompt_masked, masked, scored = (x.to(device) for x in (prompt_masked, masked, scored))
        mask_id = self.model.mask_token_id
        prompts = torch.where(prompt_masked, mask_id, prompt_ids)
        noised = torch.where(masked, mask_id, completion)
        prompt_mask = inputs["prompt_mask"].bool()
        logp = self._logprobs(batch, prompts, prompt_mask, noised)  # [N, B, L]
        active = batch.active.to(device)
        n = active.sum(1, keepdim=True).float()  # [B, 1]
        hits = scored.sum(2, keepdim=True).float()  # [N, B, 1]
        t_hat = torch.where(hits > 0, hits, 1.0) / n.clamp(min=1.0)  # 1 on rows without actions
        log_t = torch.log(t_hat)
        elbo = torch.where(scored, logp / t_hat, torch.zeros_like(logp)).mean(0)
        terms = elbo
        advantages = batch.model_inputs.get("advantages")
        if advantages is not None and self.mix_weight > 0:
            negative = advantages.to(device)[:, None] < 0  # [B, 1]
            ever = scored.any(0)  # [B, L]: q_i > 0
            exponent = torch.where(scored, self.eubo_beta * logp - log_t, -math.inf)
            exponent = torch.where(ever, exponent, 0.0)  # no all -inf column (NaN gradients)
            log_q = torch.logsumexp(exponent, 0) - math.log(self.num_samples)
            covered = ever.sum(1, keepdim=True).float()  # n⁺
            scale = n / covered.clamp(min=1.0) / self.eubo_beta
            eubo = torch.where(ever, scale * log_q, torch.zeros_like(log_q))
            mixed = self.mix_weight * eubo + (1.0 - self.mix_weight) * elbo
            terms = torch.where(negative, mixed, elbo)
        return ReplayScores(torch.where(active, terms, torch.zeros_like(terms)), None)


class GeneratorFreeScorer:
    """Adapter giving an exact scorer the estimators' signature: ``score(batch,
    generator=None)``. Exact replay draws nothing, so ``generator`` is ignored."""

    def __init__(self, scorer: ReplayScorer | PackedReplayScorer) -> None:
        self.scorer = scorer

    def score(
        self, batch: DiffusionTokenBatch, generator: torch.Generator | None = None
    ) -> ReplayScores:
        return self.scorer.score(batch)


SCORERS = {
    "exact": lambda model, **kw: GeneratorFreeScorer(ReplayScorer(model, **kw)),
    "packed": lambda model, **kw: GeneratorFreeScorer(PackedReplayScorer(model, **kw)),
    "mean_field": MeanFieldEstimator,
    "coupled": CoupledEstimator,
    "elbo": ELBOEstimator,
    "spg": SPGEstimator,
}


def make_scorer(name: str, model: TokenDenoiser, *, temperature: float, **options) -> TraceScorer:
    """The scorer called ``name`` (one of :data:`SCORERS`) for ``model`` at ``temperature``;
    ``options`` go to its constructor (e.g. ``micro_batch_size`` for "exact",
    ``prompt_mask_prob`` for "mean_field", ``num_samples`` for "elbo", ``block_size``,
    ``eubo_beta`` and ``mix_weight`` for "spg")."""
    if name not in SCORERS:
        raise ValueError(f"scorer: unknown name {name!r}; expected one of {sorted(SCORERS)}")
    return SCORERS[name](model, temperature=temperature, **options)
