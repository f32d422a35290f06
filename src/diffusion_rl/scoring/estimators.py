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
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from ..contracts import DiffusionTokenBatch
from ..kernels import KERNELS
from ..models.protocol import TokenDenoiser
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
}


def make_scorer(name: str, model: TokenDenoiser, *, temperature: float, **options) -> TraceScorer:
    """The scorer called ``name`` (one of :data:`SCORERS`) for ``model`` at ``temperature``;
    ``options`` go to its constructor (e.g. ``micro_batch_size`` for "exact",
    ``prompt_mask_prob`` for "mean_field", ``num_samples`` for "elbo")."""
    if name not in SCORERS:
        raise ValueError(f"scorer: unknown name {name!r}; expected one of {sorted(SCORERS)}")
    return SCORERS[name](model, temperature=temperature, **options)
