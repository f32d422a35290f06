"""On-policy distillation (MATH.md §4): the loss against a hand computation, its gradient and
sanitisation, the contract, teacher scoring on the student's states, fresh-rollout refusal,
learning, and the recipe end to end (CLI, report, exact resume, shipped config)."""

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from pydantic import ValidationError

from diffusion_rl import cli
from diffusion_rl.config import (
    ConfigError,
    DistillRecipeConfig,
    SFTRecipeConfig,
    build_config,
    load_config,
)
from diffusion_rl.contracts import DiffusionDistillationBatch, DiffusionTokenBatch
from diffusion_rl.models import (
    CharTokenizer,
    DiffusionTransformer,
    TransformerConfig,
    load_model,
    save_model,
)
from diffusion_rl.objectives.distill import DistillationLoss, DistillationLossConfig
from diffusion_rl.recipes.distill import run_distill
from diffusion_rl.recipes.sft import run_sft
from diffusion_rl.rewards import CombinedReward, get_reward
from diffusion_rl.rollout import Rollout, TokenSource, collect_rollout
from diffusion_rl.sampling import TokenSamplerConfig, sample_tokens
from diffusion_rl.scoring import (
    ReplayScorer,
    ReplayScores,
    TeacherScorer,
    VocabularyMismatchError,
    check_same_vocabulary,
)
from diffusion_rl.train import OptimConfig, Trainer
from diffusion_rl.train.learner import PolicyLearner
from diffusion_rl.train.plans import DistillationPlan
from diffusion_rl.train.roles import PolicyRoles, StaleTraceError

B, L, V = 3, 5, 7
MASK = 1


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: one intra-op thread is fastest, and never oversubscribes a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------- the loss
def _log_softmax(z: list[float]) -> list[float]:
    top = max(z)
    lse = top + math.log(sum(math.exp(x - top) for x in z))
    return [x - lse for x in z]


def student_scores(logits: torch.Tensor) -> ReplayScores:
    """Student logits in the scores shape every on-policy objective takes."""
    return ReplayScores(logprobs=None, entropy=None, logits=logits)


def reference_loss(student, teacher, targets, weights, T, a_soft, a_hard):
    """MATH.md §4 slot by slot in Python floats; 0·log 0 = 0 for impossible teacher tokens."""
    soft_sum = hard_sum = agree_sum = denom = 0.0
    for b in range(student.shape[0]):
        for i in range(student.shape[1]):
            w = float(weights[b, i])
            if w == 0:
                continue
            s, t = student[b, i].double().tolist(), teacher[b, i].double().tolist()
            log_p = _log_softmax([x / T for x in t])
            log_q = _log_softmax([x / T for x in s])
            kl = sum(math.exp(lp) * (lp - lq) for lp, lq in zip(log_p, log_q) if lp > -math.inf)
            soft_sum += w * T * T * kl
            hard_sum += w * -_log_softmax(s)[int(targets[b, i])]
            agree_sum += w * float(
                max(range(V), key=s.__getitem__) == max(range(V), key=t.__getitem__)
            )
            denom += w
    return (
        (a_soft * soft_sum + a_hard * hard_sum) / denom,
        soft_sum / denom,
        hard_sum / denom,
        agree_sum / denom,
    )


def loss_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(B, L, V, generator=g) * 2
    teacher = torch.randn(B, L, V, generator=g) * 2
    student[..., MASK] = -math.inf  # as replay returns them: the MASK logit at -inf
    teacher[..., MASK] = -math.inf
    targets = torch.randint(2, V, (B, L), generator=g)
    weights = torch.tensor(
        [[1.0, 0.5, 0.0, 2.5, 1.0], [0.25, 0.0, 0.0, 1.0, 3.0], [1.0, 1.0, 0.75, 0.0, 0.1]]
    )
    targets[weights == 0] = -1  # sentinels on inactive slots
    batch = DiffusionTokenBatch({"x": torch.zeros(B, 1)}, targets, weights)
    return student, teacher, batch


@pytest.mark.parametrize(
    "T, a_soft, a_hard", [(1.0, 1.0, 0.0), (2.0, 1.0, 0.0), (0.5, 0.0, 1.0), (1.7, 0.7, 0.3)]
)
def test_loss_equals_hand_computation(T, a_soft, a_hard):
    student, teacher, batch = loss_inputs()
    loss = DistillationLoss(
        DistillationLossConfig(temperature=T, soft_weight=a_soft, hard_weight=a_hard)
    )
    out = loss(student_scores(student), DiffusionDistillationBatch(batch, teacher))
    total, soft, hard, agree = reference_loss(
        student, teacher, batch.target_ids, batch.loss_weights, T, a_soft, a_hard
    )
    assert float(out.primary.denominator) == pytest.approx(12.1)  # Σ w, fractional weights
    assert float(out.primary.value) == pytest.approx(total, rel=1e-5)
    assert float(out.aux_metrics["distill/soft_loss"].value) == pytest.approx(soft, rel=1e-5)
    assert float(out.aux_metrics["distill/hard_loss"].value) == pytest.approx(hard, rel=1e-5)
    assert float(out.aux_metrics["distill/top1_agreement"].value) == pytest.approx(agree, abs=1e-6)
    assert soft > 0.1 and hard > 0.1  # both terms are really exercised


def test_soft_gradient_is_T_times_q_minus_p():
    """∂L/∂s_i = α_soft w_i T (softmax(s_i/T) − softmax(t_i/T)) / Σw; the teacher gets none."""
    student, teacher, batch = loss_inputs(seed=1)
    T, a_soft = 2.0, 0.6
    student.requires_grad_(True)
    teacher.requires_grad_(True)
    loss = DistillationLoss(DistillationLossConfig(temperature=T, soft_weight=a_soft))
    out = loss(student_scores(student), DiffusionDistillationBatch(batch, teacher))
    out.primary.value.backward()
    w = batch.loss_weights[..., None]
    expected = (
        a_soft
        * w
        * T
        * (torch.softmax(student.detach() / T, -1) - torch.softmax(teacher.detach() / T, -1))
        / w.sum()
    )
    assert torch.allclose(student.grad, expected, atol=1e-7)
    assert teacher.grad is None  # stop-gradient: nothing flows to the teacher


def test_teacher_model_receives_no_gradient():
    student_model, teacher_model = tiny_model(seed=0), tiny_model(seed=1)
    teacher_model.train()
    for p in teacher_model.parameters():
        p.requires_grad_(True)
    ids = torch.randint(3, 16, (2, 9))
    student_logits = student_model(ids, None, 5)[:, 5:]
    teacher_logits = teacher_model(ids, None, 5)[:, 5:]  # built with a graph on purpose
    targets = torch.randint(3, 16, (2, 4))
    batch = DiffusionTokenBatch({"x": ids}, targets, torch.ones(2, 4))
    out = DistillationLoss(DistillationLossConfig(hard_weight=0.5))(
        student_scores(student_logits), DiffusionDistillationBatch(batch, teacher_logits)
    )
    out.primary.sum.backward()
    assert all(p.grad is None for p in teacher_model.parameters())
    assert sum(float(p.grad.abs().sum()) for p in student_model.parameters()) > 0


def test_inactive_slots_with_nan_teacher_logits_change_nothing():
    student, teacher, batch = loss_inputs(seed=2)
    inactive = ~batch.active
    poisoned_teacher = teacher.clone()
    poisoned_teacher[inactive] = math.nan
    poisoned_teacher[0, 2, 3] = math.inf
    poisoned_student = student.clone()
    poisoned_student[inactive] = -math.inf  # the student's own garbage there is harmless too
    loss = DistillationLoss(
        DistillationLossConfig(temperature=1.5, soft_weight=1.0, hard_weight=0.4)
    )

    def run(s, t):
        s = s.clone().requires_grad_(True)
        out = loss(student_scores(s), DiffusionDistillationBatch(batch, t))
        out.primary.sum.backward()
        return out, s.grad

    clean, clean_grad = run(student, teacher)
    dirty, dirty_grad = run(poisoned_student, poisoned_teacher)
    assert torch.isfinite(dirty.primary.sum) and bool(torch.isfinite(dirty_grad).all())
    assert torch.equal(clean.primary.sum, dirty.primary.sum)
    assert torch.equal(clean_grad, dirty_grad)
    assert bool((dirty_grad[inactive] == 0).all())
    for key in clean.aux_metrics:
        assert torch.equal(clean.aux_metrics[key].sum, dirty.aux_metrics[key].sum)


@pytest.mark.parametrize("soft_weight, hard_weight", [(1.0, 0.0), (0.0, 1.0), (0.5, 0.5)])
@pytest.mark.parametrize("poison", ["nan", "+inf", "all -inf"])
def test_a_broken_teacher_row_on_an_active_slot_makes_the_loss_nan(
    poison, soft_weight, hard_weight
):
    """NaN / +inf in a teacher row, or a row of only -inf, is no distribution: never read as
    probability 0, whatever the loss weights (0 · NaN = NaN)."""
    student, teacher, batch = loss_inputs(seed=3)
    assert bool(batch.active[1, 3])
    broken = teacher.clone()
    if poison == "all -inf":
        broken[1, 3] = -math.inf
    else:
        broken[1, 3, 4] = math.nan if poison == "nan" else math.inf
    loss = DistillationLoss(
        DistillationLossConfig(soft_weight=soft_weight, hard_weight=hard_weight)
    )
    clean = loss(student_scores(student), DiffusionDistillationBatch(batch, teacher))
    out = loss(student_scores(student), DiffusionDistillationBatch(batch, broken))
    assert torch.isfinite(clean.primary.sum)
    assert torch.isnan(out.primary.sum)
    assert torch.isnan(out.aux_metrics["distill/soft_loss"].sum)


def test_minus_inf_entries_in_a_finite_teacher_row_are_probability_zero():
    """-inf for some tokens (besides the MASK logit) is a legitimate "impossible": the loss is
    the hand computation with those tokens left out, finite."""
    student, teacher, batch = loss_inputs(seed=4)
    teacher[0, 0, 2] = teacher[2, 4, 5] = -math.inf
    out = DistillationLoss()(student_scores(student), DiffusionDistillationBatch(batch, teacher))
    total, *_ = reference_loss(
        student, teacher, batch.target_ids, batch.loss_weights, 1.0, 1.0, 0.0
    )
    assert torch.isfinite(out.primary.sum)
    assert float(out.primary.value) == pytest.approx(total, rel=1e-5)


def distill_micro_batches(model, poisoned_micro: int | None, poison=math.nan):
    """Two micro-batches of 2 rows with fixed canvases and teacher logits (the teacher's
    logits of micro-batch ``poisoned_micro`` carry ``poison`` at one active slot)."""
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(3, 16, (4, 9), generator=g)
    targets = torch.randint(3, 16, (4, 4), generator=g)
    teacher = torch.randn(4, 4, 16, generator=g) * 2
    teacher[..., MASK] = -math.inf
    if poisoned_micro is not None:
        teacher[2 * poisoned_micro + 1, 2, 7] = poison
    batch = DiffusionTokenBatch({"ids": ids}, targets, torch.ones(4, 4))
    return DiffusionDistillationBatch(batch, teacher).split(2)


def distill_loss_fn(model, micro, _generator):
    ids = micro.student_batch.model_inputs["ids"]
    return DistillationLoss(DistillationLossConfig(hard_weight=0.3))(
        student_scores(model(ids, None, 5)[:, 5:]), micro
    )


def trainer_state(trainer):
    state = {f"p.{k}": v.clone() for k, v in trainer.model.state_dict().items()}
    for i, entry in trainer.optimizer.state_dict()["state"].items():
        state.update({f"o.{i}.{k}": v.clone() for k, v in entry.items()})
    return state, (trainer.optimizer_steps, trainer.scheduler.last_epoch)


@pytest.mark.parametrize("poison", [math.nan, math.inf])
@pytest.mark.parametrize("poisoned_micro", [0, 1])
def test_trainer_skips_and_counts_a_step_with_a_nan_teacher(poisoned_micro, poison):
    model = tiny_model(seed=0).train()
    trainer = Trainer(model, distill_loss_fn, OptimConfig(lr=1e-2))
    assert trainer.train_step(distill_micro_batches(model, None)).applied  # optimizer state
    before, counters = trainer_state(trainer)
    result = trainer.train_step(distill_micro_batches(model, poisoned_micro, poison))
    assert not result.applied
    assert trainer.skipped_nonfinite == 1 and result.metrics["skipped_nonfinite"] == 1.0
    after, counters_after = trainer_state(trainer)
    assert before.keys() == after.keys() and len(after) > len(list(model.parameters()))
    assert all(torch.equal(before[k], after[k]) for k in before)  # bitwise unchanged
    assert counters_after == counters and trainer.global_step == 2
    assert trainer.train_step(distill_micro_batches(model, None)).applied  # and it goes on
    assert trainer.skipped_nonfinite == 1


def test_loss_config_validation_names_the_field():
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValidationError, match="temperature"):
            DistillationLossConfig(temperature=bad)
    with pytest.raises(ValidationError, match="soft_weight"):
        DistillationLossConfig(soft_weight=-0.1)
    with pytest.raises(ValidationError, match="hard_weight"):
        DistillationLossConfig(hard_weight=math.inf)
    with pytest.raises(ValidationError, match="both are 0"):
        DistillationLossConfig(soft_weight=0.0, hard_weight=0.0)


# --------------------------------------------------------------------------- the contract
def test_contract_validates_and_slices():
    student, teacher, batch = loss_inputs()
    pair = DiffusionDistillationBatch(batch, teacher)
    with pytest.raises(ValueError, match=r"teacher_logits: expected \[B, L\] = \(3, 5\)"):
        DiffusionDistillationBatch(batch, teacher[:, :4])
    with pytest.raises(TypeError, match="teacher_logits: expected a floating dtype"):
        DiffusionDistillationBatch(batch, teacher.long())
    with pytest.raises(TypeError, match="student_batch: expected a DiffusionTokenBatch"):
        DiffusionDistillationBatch({"x": 1}, teacher)
    with pytest.raises(ValueError, match="target_ids: active ids must be < V=2"):
        DiffusionDistillationBatch(batch, teacher[..., :2])
    with pytest.raises(ValueError, match="vocabulary size 8 differs from the teacher's 7"):
        DistillationLoss()(student_scores(torch.zeros(B, L, V + 1)), pair)

    parts = pair.split(2)
    assert [p.batch_size for p in parts] == [2, 1]
    joined = DiffusionDistillationBatch.concat(parts)
    assert torch.equal(joined.teacher_logits, teacher)
    assert torch.equal(joined.student_batch.loss_weights, batch.loss_weights)
    row = pair[1]
    assert torch.equal(row.teacher_logits, teacher[1:2])
    assert torch.equal(row.student_batch.target_ids, batch.target_ids[1:2])
    # a pytree, so the trainer's device move reaches the teacher logits too
    moved = torch.utils._pytree.tree_map(lambda t: t + 0, pair)
    assert isinstance(moved, DiffusionDistillationBatch)
    assert len(torch.utils._pytree.tree_leaves(pair)) == 4


# --------------------------------------------------------------------------- teacher scoring
def student_trace(student, batch=8, temperature=1.0, weights_version=0):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 16, (batch, 5), generator=g)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[::3, :2] = False
    config = TokenSamplerConfig(
        generation_length=12, block_size=4, steps_per_block=2, temperature=temperature
    )
    return sample_tokens(
        student,
        ids,
        mask,
        config,
        seeds=range(batch),
        stop_token_id=2,
        capture=True,
        weights_version=weights_version,
    ).trace


@pytest.mark.parametrize("attention", ["block_causal", "bidirectional"])
def test_teacher_with_the_students_weights_sees_the_students_states(attention):
    student = tiny_model(attention)
    trace = student_trace(student)
    batch = trace.prepare()
    live = ReplayScorer.for_trace(student, trace, return_logits=True).score(batch)
    teacher = tiny_model(attention)  # a separate module with the same weights
    distill = TeacherScorer.for_trace(teacher, trace).distillation_batch(batch)
    assert torch.equal(distill.teacher_logits, live.logits.detach())  # bitwise
    out = DistillationLoss()(live, distill)
    assert float(out.aux_metrics["distill/soft_loss"].value) == 0.0
    assert float(out.aux_metrics["distill/top1_agreement"].value) == 1.0
    # the logits are the ones the replay log-probs were read from
    read = torch.log_softmax(live.logits / trace.temperature, -1)
    read = read.gather(-1, batch.target_ids.clamp_min(0)[..., None]).squeeze(-1)
    assert torch.equal(torch.where(batch.active, read, 0.0), live.logprobs)
    assert bool((distill.teacher_logits[~batch.active] == 0).all())


@pytest.mark.parametrize(
    "attention, block, width, layers",
    [("bidirectional", 4, 48, 3), ("block_causal", 2, 48, 1), ("block_causal", 4, 64, 2)],
)
def test_teacher_logits_equal_a_hand_walk_of_the_students_canvases(attention, block, width, layers):
    """A teacher of another size/attention/block size is run on c_{a_i} for every action i."""
    student = tiny_model("block_causal")
    trace = student_trace(student, batch=4)
    teacher = tiny_model(attention, seed=7, block=block, width=width, layers=layers)
    assert_teacher_walk(teacher, trace)


def assert_teacher_walk(teacher, trace) -> None:
    """TeacherScorer's logits vs the teacher run by hand on the canvas of every action."""
    logits = TeacherScorer.for_trace(teacher, trace).logits(trace.prepare())
    P, Lc = trace.prompt_ids.shape[1], trace.tokens.shape[1]
    checked = 0
    for b in range(len(trace)):
        for i in range(Lc):
            step = int(trace.commit_steps[b, i])
            if step < 0:
                assert bool((logits[b, i] == 0).all())
                continue
            visible = (trace.commit_steps[b] >= 0) & (trace.commit_steps[b] < step)
            canvas = torch.where(visible, trace.tokens[b], teacher.mask_token_id)
            key_mask = torch.cat([trace.prompt_mask[b], torch.ones(Lc, dtype=torch.bool)])
            with torch.no_grad():
                z = teacher(torch.cat([trace.prompt_ids[b], canvas])[None], key_mask[None], P)
            z = z[0, P + i].clone()
            z[teacher.mask_token_id] = -math.inf
            assert torch.allclose(logits[b, i], z, atol=2e-5), (b, i)
            checked += 1
    assert checked >= 4 * len(trace)


class MaskedLMTeacher(torch.nn.Module):
    """A Hugging Face masked LM seen through the TokenDenoiser protocol (its logits are
    same-position, so target-aligned as they are)."""

    attention = "bidirectional"
    block_size = None

    def __init__(self, model, mask_token_id: int) -> None:
        super().__init__()
        self.model = model
        self.vocab_size = model.config.vocab_size
        self.mask_token_id = mask_token_id

    def forward(self, input_ids, key_mask, prompt_length):
        return self.model(input_ids=input_ids, attention_mask=key_mask.long()).logits


def test_a_hugging_face_model_can_be_the_teacher():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(3)
    config = transformers.BertConfig(
        vocab_size=16,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=48,
    )
    teacher = MaskedLMTeacher(transformers.BertForMaskedLM(config).eval(), mask_token_id=MASK)
    student = tiny_model("block_causal")
    trace = student_trace(student, batch=4)
    assert_teacher_walk(teacher, trace)
    batch = TeacherScorer.for_trace(teacher, trace).distillation_batch(trace.prepare())
    live = ReplayScorer.for_trace(student, trace, return_logits=True).score(batch.student_batch)
    out = DistillationLoss()(live, batch)
    out.primary.value.backward()
    assert float(out.primary.value.detach()) > 0.1
    assert all(p.grad is None for p in teacher.parameters())


def test_vocabulary_mismatch_is_refused():
    student = tiny_model()
    with pytest.raises(VocabularyMismatchError, match="vocab_size=17, the student 16"):
        check_same_vocabulary(student, tiny_model(vocab=17))
    other_mask = DiffusionTransformer(
        TransformerConfig(vocab_size=16, mask_token_id=3, d_model=32, n_heads=4, max_seq_len=48)
    )
    with pytest.raises(VocabularyMismatchError, match="mask_token_id"):
        check_same_vocabulary(student, other_mask)
    with pytest.raises(VocabularyMismatchError, match="MASK id 1"):
        TeacherScorer.for_trace(other_mask, student_trace(student, batch=2))


# --------------------------------------------------------------------------- the learner
def make_learner(student, teacher, lr=3e-3):
    roles = PolicyRoles(student, reference=teacher)

    def factory(actor, loss_fn):
        return Trainer(actor, loss_fn, OptimConfig(lr=lr))

    return roles, PolicyLearner(roles, DistillationPlan(DistillationLoss()), factory)


def as_rollout(trace):
    """A student trace as a rollout (distillation reads only the trace)."""
    rows = len(trace)
    return Rollout(trace, [""] * rows, [None] * rows, torch.zeros(rows), None, 1)


def test_stale_rollouts_are_refused_by_weights_version():
    student, teacher = tiny_model(seed=0), tiny_model(seed=1)
    roles, learner = make_learner(student, teacher)
    with pytest.raises(StaleTraceError, match="v3, the learner is at v0"):
        learner.step(as_rollout(student_trace(roles.rollout, weights_version=3)))
    fresh = student_trace(roles.rollout, weights_version=roles.version)
    before = {k: v.clone() for k, v in student.state_dict().items()}
    metrics = learner.step(as_rollout(fresh))
    assert metrics["weights_version"] == 1.0 and roles.version == 1
    assert any(not torch.equal(before[k], v) for k, v in student.state_dict().items())
    with pytest.raises(StaleTraceError, match="v0, the learner is at v1"):
        learner.step(as_rollout(fresh))  # the same rollout again: weights that are gone
    with pytest.raises(VocabularyMismatchError):
        make_learner(student, tiny_model(vocab=17))


class NaNRowTeacher(torch.nn.Module):
    """The wrapped teacher, except that row 0 of every forward it runs is NaN (no
    ``forward_block``: the teacher walk runs full canvases through ``forward``)."""

    def __init__(self, teacher) -> None:
        super().__init__()
        self.teacher = teacher
        self.vocab_size, self.mask_token_id = teacher.vocab_size, teacher.mask_token_id
        self.attention, self.block_size = teacher.attention, teacher.block_size

    def forward(self, input_ids, key_mask, prompt_length):
        logits = self.teacher(input_ids, key_mask, prompt_length).clone()
        logits[0] = math.nan
        return logits


def test_learner_skips_and_counts_a_step_whose_teacher_returns_nan():
    student = tiny_model(seed=0)
    roles, learner = make_learner(student, NaNRowTeacher(tiny_model(seed=1)))
    learner.micro_batch_size = 3
    before = {k: v.clone() for k, v in student.state_dict().items()}
    metrics = learner.step(as_rollout(student_trace(roles.rollout, batch=6)))
    assert learner.trainer.skipped_nonfinite == 1 and metrics["skipped_nonfinite"] == 1.0
    assert learner.trainer.optimizer_steps == 0 and not learner.trainer.optimizer.state
    assert all(torch.equal(before[k], v) for k, v in student.state_dict().items())


def test_on_policy_steps_pull_the_student_to_the_teacher():
    """KL(teacher ‖ student) on a fixed set of the student's states falls as it trains."""
    student, teacher = tiny_model(seed=0), tiny_model(seed=1, width=48)
    roles, learner = make_learner(student, teacher, lr=3e-3)
    probe = student_trace(student, batch=8)

    def probe_kl() -> float:
        batch = TeacherScorer.for_trace(teacher, probe).distillation_batch(probe.prepare())
        with torch.no_grad():
            live = ReplayScorer.for_trace(student, probe, return_logits=True).score(
                batch.student_batch
            )
        return float(DistillationLoss()(live, batch).primary.value)

    start = probe_kl()
    for _ in range(25):
        learner.step(as_rollout(student_trace(roles.rollout, weights_version=roles.version)))
    end = probe_kl()
    assert start > 1.0 and end < 0.05 * start


# --------------------------------------------------------------------------- the recipe
SFT_TINY = {
    "task": {"num_digits": 2},
    "steps": 3,
    "batch_size": 8,
    "eval_examples": 8,
    "log_every": 1,
}


def sft_model(tmp_path, name, width, layers):
    config = {
        **SFT_TINY,
        "model": {"d_model": width, "n_layers": layers, "n_heads": 2},
        "output_dir": str(tmp_path / name),
    }
    run_sft(build_config(SFTRecipeConfig, config), echo=lambda _: None)
    return str(tmp_path / name / "model")


DISTILL_TINY = {
    "steps": 4,
    "prompts_per_step": 3,
    "samples_per_prompt": 2,
    "micro_batch_size": 4,
    "eval_every": 2,
    "eval_examples": 8,
    "checkpoint_every": 2,
}


def test_recipe_cli_report_and_exact_resume(tmp_path, monkeypatch, capsys):
    student = sft_model(tmp_path, "student", 16, 1)
    teacher = sft_model(tmp_path, "teacher", 32, 2)
    sets = [f"student.path={student}", f"teacher.path={teacher}"]
    sets += [f"{k}={v}" for k, v in DISTILL_TINY.items()]
    assert (
        cli.main(
            [
                "distill",
                *[a for s in sets for a in ("--set", s)],
                "--set",
                f"output_dir={tmp_path / 'straight'}",
            ]
        )
        == 0
    )
    assert "student accuracy" in capsys.readouterr().out
    report = json.loads((tmp_path / "straight" / "results.json").read_text())
    assert report["steps"] == 4 and report["weights_version"] == 4
    assert [h["step"] for h in report["history"]] == [0, 2, 4]
    assert report["student"]["parameters"] * 2 <= report["teacher"]["parameters"]
    assert 0.0 <= report["teacher"]["accuracy"] <= 1.0
    png = tmp_path / "straight" / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    records = [
        json.loads(x) for x in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [r for r in records if "distill/soft_loss" in r]
    assert [r["weights_version"] for r in steps] == [1.0, 2.0, 3.0, 4.0]
    assert all(r["distill/soft_loss"] > 0 for r in steps)

    def config(name, **extra):
        data = {**DISTILL_TINY, "student": {"path": student}, "teacher": {"path": teacher}}
        return build_config(
            DistillRecipeConfig, {**data, "output_dir": str(tmp_path / name), **extra}
        )

    real_step = Trainer.train_step

    def dying_step(self, micro_batches, loss_fn=None):
        if self.global_step == 3:
            raise KeyboardInterrupt  # killed after the step-2 checkpoint
        return real_step(self, micro_batches, loss_fn)

    monkeypatch.setattr(Trainer, "train_step", dying_step)
    with pytest.raises(KeyboardInterrupt):
        run_distill(config("killed"), echo=lambda _: None)
    monkeypatch.setattr(Trainer, "train_step", real_step)
    resumed = run_distill(config("killed"), echo=lambda _: None)
    assert resumed["history"] == report["history"] and resumed["weights_version"] == 4
    a = load_model(tmp_path / "straight" / "model").model.state_dict()
    b = load_model(tmp_path / "killed" / "model").model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(Exception, match="objective.temperature"):
        run_distill(config("killed", objective={"temperature": 2.0}, steps=6), echo=lambda _: None)

    # a teacher with another tokenizer is refused by name
    loaded = load_model(teacher)
    save_model(tmp_path / "alien", loaded.model, loaded.info, CharTokenizer("0123456789+-*"))
    with pytest.raises(ConfigError, match="teacher.path: .* uses tokenizer"):
        run_distill(
            config("alien_run", teacher={"path": str(tmp_path / "alien")}), echo=lambda _: None
        )


def test_student_rollouts_are_fresh_and_seeded_by_position(tmp_path):
    from diffusion_rl.tasks import get_task

    task = get_task("arithmetic", num_digits=2)
    model = tiny_model(vocab=task.tokenizer.vocab_size)
    sampler = TokenSamplerConfig(generation_length=task.completion_length, temperature=1.0)
    reward = CombinedReward([(get_reward("verifier", task=task), 1.0)])
    kwargs = dict(num_prompts=3, group_size=2, seed=0, weights_version=7, start_prompt=5)
    a, position = collect_rollout(model, TokenSource(task, sampler), reward, **kwargs)
    b, _ = collect_rollout(model, TokenSource(task, sampler), reward, **kwargs)
    assert a.trace.weights_version == 7 and len(a.trace) == 6 and position == 8
    assert torch.equal(a.trace.tokens, b.trace.tokens)
    assert [e.prompt for e in a.examples[::2]] == [task.example(i).prompt for i in (5, 6, 7)]
    assert a.rewards.shape == (6,) and a.advantages is None
    assert a.stats["rollout/accuracy"] == float(task.rewards(a.outputs, a.examples).mean())


def test_shipped_distill_config_matches_the_defaults():
    shipped = load_config(
        Path(__file__).parents[1] / "configs" / "distill_arithmetic.yaml", DistillRecipeConfig
    )
    assert shipped == DistillRecipeConfig()
