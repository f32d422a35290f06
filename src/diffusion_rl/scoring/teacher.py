"""Teacher logits on the student's states: the input of on-policy distillation (docs/math.md §4).

For every action ``i`` of a student trace (slot committed at step ``a_i``), the teacher is
run on the canvas the student saw when it committed that slot,
``c_{a_i} = prompt ⊕ [x_j if 0 <= a_j < a_i else MASK]``, and its target-aligned logits for
slot ``i`` are kept. This is the dense replay walk of
:class:`~diffusion_rl.scoring.ReplayScorer` with the teacher as the model
(``return_logits=True``, stop-gradient), so the teacher sees exactly the states the
student's own replay sees: with the student's weights as the teacher, the two logits are
bitwise equal.

Any :class:`~diffusion_rl.models.TokenDenoiser` can be the teacher (a larger built-in
transformer, a GRPO-trained checkpoint, an adapter of a Hugging Face model), provided it is
target-aligned and shares the student's vocabulary: the same ``vocab_size`` and the same
MASK id (so the same tokenizer). Student and teacher may differ in size and attention. The
block KV cache walk is used only when the teacher is block-causal with the trace's block
size (then it is exact); otherwise each step runs the teacher on the full canvas.

Output: float32 ``[B, L, V]``, the untempered logits with the MASK logit at -inf on action
slots, exactly 0 on every other slot (never NaN).
"""

from __future__ import annotations

import torch

from ..contracts import DiffusionDistillationBatch, DiffusionTokenBatch
from ..models.protocol import TokenDenoiser, block_origin
from .replay import ReplayScorer, ReplayScores


class VocabularyMismatchError(ValueError):
    """Teacher and student do not share a vocabulary (tokenizer)."""


def check_same_vocabulary(student: TokenDenoiser, teacher: TokenDenoiser) -> None:
    """Refuse a teacher whose vocabulary size or MASK id differs from the student's."""
    for name in ("vocab_size", "mask_token_id"):
        mine, theirs = getattr(student, name), getattr(teacher, name)
        if mine != theirs:
            raise VocabularyMismatchError(
                f"teacher.{name}: the teacher has {name}={theirs}, the student {mine}; "
                "distillation needs one tokenizer for both (same vocabulary and MASK id)"
            )


def _check_aligned(teacher: TokenDenoiser) -> None:
    if getattr(teacher, "alignment", "same_position") != "same_position":
        raise ValueError(
            "teacher: its logits are not target-aligned; wrap it with shift_to_target_aligned "
            "in its adapter (teacher scoring never shifts)"
        )


class TeacherScorer:
    """``logits(batch)`` → the teacher's logits at every action's state of a prepared trace.

    ``batch`` comes from :meth:`~diffusion_rl.trace.TokenTrace.prepare` (inputs
    ``prompt_ids``, ``prompt_mask``, ``completion_ids``, ``commit_steps``). Runs without
    gradient; ``micro_batch_size`` bounds the rows per forward; ``use_cache`` as in
    :class:`ReplayScorer` (use :meth:`for_trace`, which decides it safely).
    """

    def __init__(
        self,
        teacher: TokenDenoiser,
        *,
        micro_batch_size: int | None = None,
        use_cache: bool | None = None,
        kernel_id: str | None = None,
    ) -> None:
        _check_aligned(teacher)
        self.teacher = teacher
        self.replay = ReplayScorer(
            teacher,
            temperature=1.0,  # logits are returned untempered; the log-probs are not used
            stop_gradient=True,
            micro_batch_size=micro_batch_size,
            use_cache=use_cache,
            return_logits=True,
            kernel_id=kernel_id,
        )

    @classmethod
    def for_trace(cls, teacher: TokenDenoiser, trace, **options) -> TeacherScorer:
        """A scorer for ``trace``: checks the teacher's vocabulary against the MASK id the
        trace recorded, and walks the block KV cache only when that is exact for the teacher
        (block-causal with the trace's block size and the trace sampled with the cache)."""
        mask_id = trace.model_info.get("mask_token_id")
        if mask_id is not None and mask_id != teacher.mask_token_id:
            raise VocabularyMismatchError(
                f"teacher.mask_token_id: the trace was sampled with MASK id {mask_id}, the "
                f"teacher uses {teacher.mask_token_id}; use a teacher with the student's tokenizer"
            )
        same_blocks = (
            teacher.attention == "block_causal"
            and getattr(teacher, "block_size", None) == trace.sampler.get("block_size")
            and hasattr(teacher, "forward_block")
            and block_origin(teacher) == trace.model_info.get("block_origin", "prompt")
        )
        options.setdefault("use_cache", bool(trace.sampler.get("use_cache")) and same_blocks)
        options.setdefault("kernel_id", trace.kernel_ids.get("token_logprobs"))
        return cls(teacher, **options)

    def score(self, batch: DiffusionTokenBatch) -> ReplayScores:
        """The replay of ``batch`` with the teacher; ``.logits`` as in :meth:`logits`."""
        return self.replay.score(batch)

    def logits(self, batch: DiffusionTokenBatch) -> torch.Tensor:
        """Float32 ``[B, L, V]`` (see the module docstring)."""
        return self.score(batch).logits

    def distillation_batch(self, batch: DiffusionTokenBatch) -> DiffusionDistillationBatch:
        """``batch`` with the teacher's logits attached (the distillation contract)."""
        return DiffusionDistillationBatch(batch, self.logits(batch))
