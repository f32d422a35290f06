"""On-policy distillation loss: student logits against teacher logits on the same states.

docs/math.md §4. For every slot ``i`` with weight ``w_i`` (fractional allowed; a slot is active
iff ``w_i != 0``), student logits ``s_i`` and teacher logits ``t_i`` ``[V]`` read at the same
target-aligned state, and temperature ``T``:

    soft_i = T² · KL(softmax(t_i / T) ‖ softmax(s_i / T))
           = T² · Σ_v p_v (log p_v − log q_v),   p = softmax(t_i / T), q = softmax(s_i / T)
    hard_i = −log softmax(s_i)[x_i]               (untempered student logits, x_i = target)
    L      = (α_soft Σ_i w_i soft_i + α_hard Σ_i w_i hard_i) / Σ_i w_i

returned as ``WeightedMetric(sum, Σ w)`` so micro-batches normalise once (docs/math.md §2). The T²
factor keeps the soft gradient's scale independent of ``T`` (∂soft/∂s = T (q − p)).

Invariants:

* the teacher is a constant: its logits are detached, no gradient ever reaches it;
* inactive slots are sanitised: both logits (and the target id) are replaced by 0 before any
  arithmetic, so NaN/inf teacher or student logits there change neither loss nor gradient;
* vocabulary entries the teacher gives probability 0 (e.g. the MASK logit at -inf) add
  exactly 0, even where the student's logit is -inf too (no ``0 · ∞``);
* a broken teacher is never read as probability 0: an *active* slot whose teacher logits hold
  a NaN or a +inf, or are all -inf (no distribution at all), has ``soft_i = NaN``, so the
  micro-batch's loss is NaN — whatever α_soft, since ``0 · NaN = NaN`` — and the
  :class:`~diffusion_rl.train.Trainer` skips the step and counts it in ``skipped_nonfinite``
  (parameters and optimizer state untouched). -inf entries in an otherwise finite row are
  legitimate (a token the teacher rules out) and stay probability 0;
* float32 throughout, whatever the input dtype.

Aux metrics (weighted by ``w``, reduced globally): ``distill/soft_loss`` (mean soft_i),
``distill/hard_loss`` (mean hard_i), both without the α factors, and
``distill/top1_agreement`` (fraction of slots where the student's and the teacher's most
likely token agree).
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..contracts import DiffusionDistillationBatch, LossOutput, WeightedMetric


class DistillationLossConfig(BaseModel):
    """``temperature`` T (finite, > 0) of the soft term; ``soft_weight`` α_soft and
    ``hard_weight`` α_hard (finite, >= 0, not both 0). Strict types (no bools for numbers)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    temperature: float = Field(default=1.0, gt=0.0, allow_inf_nan=False)
    soft_weight: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)
    hard_weight: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _some_term(self) -> DistillationLossConfig:
        if self.soft_weight == 0 and self.hard_weight == 0:
            raise ValueError(
                "soft_weight, hard_weight: both are 0, so the loss is identically 0; "
                "set soft_weight > 0 (teacher KL) and/or hard_weight > 0 (cross-entropy)"
            )
        return self


def soft_kl(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """``T² · KL(softmax(teacher / T) ‖ softmax(student / T))`` over the last dim, float32.

    ``student``, ``teacher`` ``[..., V]`` (finite, or -inf where a token is impossible).
    Entries with teacher probability 0 contribute exactly 0. A teacher row that is not a
    distribution (any NaN or +inf, or every entry -inf) gives NaN, never a finite value.
    """
    teacher = teacher.float()
    log_p = torch.log_softmax(teacher / temperature, dim=-1)
    log_q = torch.log_softmax(student.float() / temperature, dim=-1)
    possible = log_p > -torch.inf
    terms = torch.where(possible, log_p.exp() * (log_p - torch.where(possible, log_q, 0.0)), 0.0)
    broken = (teacher.isnan() | teacher.isposinf()).any(-1) | teacher.isneginf().all(-1)
    return torch.where(broken, torch.nan, temperature**2 * terms.sum(-1))


class DistillationLoss:
    """``loss(scores, batch) -> LossOutput`` for one micro-batch (the call shape of every
    on-policy objective).

    ``scores.logits`` are the student's ``[B, L, V]`` with gradient, read at the same states
    as ``batch.teacher_logits`` (both from exact replay of the student's trace); the
    vocabularies must match (a clear error otherwise).
    """

    name = "on_policy_distillation"

    def __init__(self, config: DistillationLossConfig | None = None) -> None:
        self.config = config or DistillationLossConfig()

    def metadata(self) -> dict:
        return {"name": self.name, "version": 1, **self.config.model_dump()}

    def __call__(self, scores, batch: DiffusionDistillationBatch) -> LossOutput:
        student_logits = scores.logits
        if student_logits is None:
            raise ValueError("scores.logits: distillation needs the student's logits")
        if not isinstance(batch, DiffusionDistillationBatch):
            raise TypeError(
                f"batch: expected a DiffusionDistillationBatch, got {type(batch).__name__}"
            )
        batch.validate_student_logits(student_logits)
        cfg = self.config
        student_batch = batch.student_batch
        weights = student_batch.loss_weights.float()
        active = student_batch.active
        here = active[..., None]
        zero = torch.zeros((), device=student_logits.device)
        student = torch.where(here, student_logits.float(), zero)
        teacher = torch.where(here, batch.teacher_logits.detach().float(), zero)
        targets = torch.where(active, student_batch.target_ids, 0)

        soft = torch.where(active, soft_kl(student, teacher, cfg.temperature), 0.0)
        log_q = torch.log_softmax(student, dim=-1)
        hard = torch.where(active, -log_q.gather(-1, targets[..., None]).squeeze(-1), 0.0)
        agree = (student.detach().argmax(-1) == teacher.argmax(-1)).float()

        denominator = weights.sum().detach()
        total = cfg.soft_weight * (weights * soft).sum() + cfg.hard_weight * (weights * hard).sum()
        return LossOutput(
            primary=WeightedMetric(total, denominator),
            aux_metrics={
                "distill/soft_loss": WeightedMetric((weights * soft).sum().detach(), denominator),
                "distill/hard_loss": WeightedMetric((weights * hard).sum().detach(), denominator),
                "distill/top1_agreement": WeightedMetric((weights * agree).sum(), denominator),
            },
        )
