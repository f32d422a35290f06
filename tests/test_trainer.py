"""Trainer: weighted accumulation, skipped steps, LR schedule, dtypes, exact resume."""

from __future__ import annotations

import copy
import math
import random

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from torch import nn

from diffusion_rl.contracts import LossOutput, WeightedMetric
from diffusion_rl.train import (
    CheckpointManager,
    CheckpointMismatchError,
    OptimConfig,
    Trainer,
)


class Tiny(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.l1 = nn.Linear(3, 4)
        self.drop = nn.Dropout(dropout)
        self.l2 = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.drop(torch.tanh(self.l1(x))))


def per_row_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """Squared error per row, ``[B]``."""
    pred = model(batch["x"])
    return ((pred.float() - batch["y"]) ** 2).mean(-1)


def weighted_loss(model, batch, generator) -> LossOutput:
    """Row-weighted MSE as a sum and a denominator, plus two diagnostics."""
    per_row = per_row_loss(model, batch)
    weights = batch["w"]
    inject = batch.get("inject")
    total = (per_row * weights).sum()
    if inject == "nan":
        total = total * float("nan")
    if inject == "inf_grad":  # a finite loss whose gradient is not
        total.register_hook(lambda g: g * math.inf)
    return LossOutput(
        WeightedMetric(total, weights.sum()),
        {
            "mse": WeightedMetric(total.detach(), weights.sum()),
            "rows": float(len(weights)),
        },
    )


def make_batch(seed: int = 0, weights: list[float] | None = None) -> dict:
    g = torch.Generator().manual_seed(seed)
    w = torch.tensor(weights if weights is not None else [0.5, 1.5, 0.25, 0, 0, 1, 1, 2])
    return {
        "x": torch.randn(len(w), 3, generator=g),
        "y": torch.randn(len(w), 2, generator=g),
        "w": w,
    }


def split(batch: dict, bounds: list[tuple[int, int]]) -> list[dict]:
    return [{k: v[a:b] for k, v in batch.items()} for a, b in bounds]


MICRO = [(0, 3), (3, 5), (5, 8)]  # fractional weights / all zero / ones and a two


def clone_state(obj):
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: clone_state(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone_state(v) for v in obj)
    return obj


def assert_bitwise(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_bitwise(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise(x, y, f"{where}[{i}]")
    else:
        assert a == b or (a != a and b != b), where  # NaN == NaN here


def snapshot(trainer: Trainer) -> dict:
    return clone_state(
        {
            "params": dict(trainer.model.state_dict()),
            "optimizer": trainer.optimizer.state_dict(),
            "scheduler": trainer.scheduler.state_dict(),
            "generator": trainer.generator.get_state(),
            "global_step": trainer.global_step,
        }
    )


# ----------------------------------------------------------------------------- accumulation
def test_accumulation_equals_gradient_of_global_weighted_mean():
    torch.manual_seed(0)
    model = Tiny()
    config = OptimConfig(lr=0.1, weight_decay=0.1, eps=0.5, grad_clip=None)
    batch = make_batch()
    whole = Trainer(copy.deepcopy(model), weighted_loss, config)
    micro = Trainer(copy.deepcopy(model), weighted_loss, config)
    result_whole = whole.train_step([batch])
    result_micro = micro.train_step(split(batch, MICRO))
    assert result_whole.applied and result_micro.applied

    # Independent gradient of Σ w·l / Σ w over the whole batch.
    reference = copy.deepcopy(model)
    global_mean = (per_row_loss(reference, batch) * batch["w"]).sum() / batch["w"].sum()
    names = [n for n, _ in reference.named_parameters()]
    grads = dict(zip(names, torch.autograd.grad(global_mean, list(reference.parameters()))))
    # A mean of the micro-batch means (the empty one counted as 0) is a different gradient.
    means = []
    for part in split(batch, MICRO):
        w = part["w"]
        value = (per_row_loss(reference, part) * w).sum() / w.sum() if w.sum() > 0 else None
        if value is not None:
            means.append(torch.autograd.grad(value, list(reference.parameters())))
    mean_of_means = {n: sum(g[i] for g in means) / len(MICRO) for i, n in enumerate(names)}

    assert result_micro.metrics["loss"] == pytest.approx(global_mean.item(), rel=1e-6)
    assert result_micro.metrics["loss_denominator"] == pytest.approx(6.25)
    for name, param in micro.model.named_parameters():
        torch.testing.assert_close(param.grad, grads[name], rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(
            dict(whole.model.named_parameters())[name].grad, grads[name], rtol=1e-6, atol=1e-9
        )
        rel = (mean_of_means[name] - grads[name]).norm() / grads[name].norm()
        assert rel > 0.05, name

    # One AdamW step by hand: p (1 - lr·wd) - lr · g / (|g| + eps) at step 1.
    def adamw_step(p, g):
        return p * (1 - 0.1 * 0.1) - 0.1 * g / (g.abs() + 0.5)

    start = dict(model.named_parameters())
    differs = False
    for name, param in micro.model.named_parameters():
        expected = adamw_step(start[name].detach(), grads[name])
        torch.testing.assert_close(param.detach(), expected, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(
            dict(whole.model.named_parameters())[name].detach(),
            param.detach(),
            rtol=1e-6,
            atol=1e-7,
        )
        wrong = adamw_step(start[name].detach(), mean_of_means[name])
        differs |= bool((wrong - expected).abs().max() > 1e-3)
    assert differs
    for p_micro, p_whole in zip(micro.model.parameters(), whole.model.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                micro.optimizer.state[p_micro][key],
                whole.optimizer.state[p_whole][key],
                rtol=1e-6,
                atol=1e-12,
            )


def test_aux_metrics_reduce_globally_and_by_mean():
    torch.manual_seed(0)
    trainer = Trainer(Tiny(), weighted_loss, OptimConfig())
    batch = make_batch()
    with torch.no_grad():
        expected_mse = float(
            (per_row_loss(trainer.model, batch) * batch["w"]).sum() / batch["w"].sum()
        )
    metrics = trainer.train_step(split(batch, MICRO)).metrics
    assert metrics["mse"] == pytest.approx(expected_mse, rel=1e-6)
    assert metrics["rows"] == pytest.approx((3 + 2 + 3) / 3)
    assert metrics["loss"] == pytest.approx(expected_mse, rel=1e-6)


def test_grad_clip_reports_preclip_norm_and_clips():
    torch.manual_seed(0)
    model = Tiny()
    batch = make_batch()
    reference = copy.deepcopy(model)
    global_mean = (per_row_loss(reference, batch) * batch["w"]).sum() / batch["w"].sum()
    grads = torch.autograd.grad(global_mean, list(reference.parameters()))
    norm = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])))
    trainer = Trainer(model, weighted_loss, OptimConfig(grad_clip=norm / 4))
    metrics = trainer.train_step(split(batch, MICRO)).metrics
    assert metrics["grad_norm"] == pytest.approx(norm, rel=1e-5)
    clipped = torch.cat([p.grad.flatten() for p in trainer.model.parameters()])
    assert float(clipped.norm()) == pytest.approx(norm / 4, rel=1e-4)


def test_mismatched_eps_across_micro_batches_is_an_error():
    def loss(model, batch, generator):
        out = weighted_loss(model, batch, generator)
        eps = 1e-6 if batch["x"].shape[0] == 3 else None
        return LossOutput(WeightedMetric(out.primary.sum, out.primary.denominator, eps=eps))

    trainer = Trainer(Tiny(), loss, OptimConfig())
    with pytest.raises(ValueError, match=r"'loss'.*eps.*1e-06.*None"):
        trainer.train_step(split(make_batch(), MICRO))
    assert all(p.grad is None for p in trainer.model.parameters())


def test_loss_fn_contract_errors():
    trainer = Trainer(Tiny(), lambda m, b, g: 1.0, OptimConfig())
    with pytest.raises(TypeError, match="expected a LossOutput, got float"):
        trainer.train_step([make_batch()])

    def reserved(model, batch, generator):
        out = weighted_loss(model, batch, generator)
        return LossOutput(out.primary, {"lr": 1.0})

    with pytest.raises(ValueError, match=r"\['lr'\] are reserved"):
        Trainer(Tiny(), reserved, OptimConfig()).train_step([make_batch()])
    with pytest.raises(ValueError, match="at least one micro-batch"):
        trainer.train_step([])


# ----------------------------------------------------------------------------- skipped steps
def test_all_zero_weights_is_an_exact_no_op():
    torch.manual_seed(0)
    trainer = Trainer(Tiny(), weighted_loss, OptimConfig(schedule="linear", total_steps=10))
    trainer.train_step([make_batch()])  # populate the optimizer state first
    before = snapshot(trainer)
    zero = make_batch(seed=1, weights=[0.0] * 8)
    result = trainer.train_step(split(zero, MICRO))
    assert not result.applied
    assert result.metrics["loss"] == 0.0 and result.metrics["mse"] == 0.0
    assert all(math.isfinite(v) for v in result.metrics.values())
    assert (
        result.metrics["skipped_zero_weight"] == 1.0 and result.metrics["skipped_nonfinite"] == 0.0
    )
    after = snapshot(trainer)
    assert after.pop("global_step") == before.pop("global_step") + 1
    assert_bitwise(after, before)
    assert all(p.grad is None for p in trainer.model.parameters())

    fresh = Trainer(Tiny(), weighted_loss, OptimConfig())
    assert not fresh.train_step([zero]).applied
    assert fresh.optimizer.state_dict()["state"] == {}


@pytest.mark.parametrize("inject", ["nan", "inf_grad"])
def test_non_finite_loss_or_gradient_skips_the_update(inject):
    torch.manual_seed(0)
    config = OptimConfig(schedule="cosine", warmup_steps=2, total_steps=10)
    trainer = Trainer(Tiny(), weighted_loss, config)
    trainer.train_step([make_batch()])
    before = snapshot(trainer)
    parts = split(make_batch(seed=2), MICRO)
    parts[2]["inject"] = inject  # the last micro-batch: earlier ones already back-propagated
    result = trainer.train_step(parts)
    assert not result.applied
    assert (
        result.metrics["skipped_nonfinite"] == 1.0 and result.metrics["skipped_zero_weight"] == 0.0
    )
    assert not math.isfinite(result.metrics["grad_norm"])
    after = snapshot(trainer)
    assert after.pop("global_step") == before.pop("global_step") + 1
    assert_bitwise(after, before)
    assert all(p.grad is None for p in trainer.model.parameters())
    # and the next good step trains normally
    assert trainer.train_step([make_batch(seed=3)]).applied
    assert trainer.optimizer_steps == 2 and trainer.global_step == 3


# ----------------------------------------------------------------------------- schedule / config
def test_lr_schedule_warmup_cosine_and_skips_do_not_advance_it():
    config = OptimConfig(lr=0.2, schedule="cosine", warmup_steps=2, total_steps=6, min_lr_ratio=0.1)
    trainer = Trainer(Tiny(), weighted_loss, config)

    def expected(s: int) -> float:
        if s < 2:
            return 0.2 * (s + 1) / 2
        return 0.2 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 2) / 4)))

    seen = []
    for step in range(7):
        weights = [0.0] * 8 if step == 3 else None  # a skipped step in the middle
        seen.append(trainer.train_step([make_batch(step, weights)]).metrics["lr"])
    optimizer_steps = [0, 1, 2, 3, 3, 4, 5]
    assert seen == pytest.approx([expected(s) for s in optimizer_steps], rel=1e-12)


def test_linear_schedule_reaches_min_lr():
    config = OptimConfig(lr=1.0, schedule="linear", total_steps=4, min_lr_ratio=0.25)
    trainer = Trainer(Tiny(), weighted_loss, config)
    lrs = [trainer.train_step([make_batch(s)]).metrics["lr"] for s in range(6)]
    assert lrs == pytest.approx([1.0, 0.8125, 0.625, 0.4375, 0.25, 0.25])


def test_optim_config_validation():
    with pytest.raises(ValidationError, match="total_steps"):
        OptimConfig(schedule="cosine")
    with pytest.raises(ValidationError, match="extra"):
        OptimConfig(learning_rate=1.0)
    with pytest.raises(ValidationError, match="warmup_steps"):
        OptimConfig(schedule="linear", total_steps=3, warmup_steps=4)
    with pytest.raises(ValidationError, match="beta"):
        OptimConfig(betas=(0.9, 1.0))


def test_activation_checkpointing_hook():
    class WithCheckpointing(Tiny):
        enabled = None

        def enable_activation_checkpointing(self, enabled: bool) -> None:
            self.enabled = enabled

    model = WithCheckpointing()
    Trainer(model, weighted_loss, OptimConfig(), activation_checkpointing=True)
    assert model.enabled is True
    with pytest.raises(TypeError, match="Tiny has no enable_activation_checkpointing"):
        Trainer(Tiny(), weighted_loss, OptimConfig(), activation_checkpointing=True)


def test_bf16_autocast_wraps_loss_and_keeps_param_dtype():
    seen = {}

    def loss(model, batch, generator):
        seen["autocast"] = torch.is_autocast_enabled("cpu")
        seen["pred"] = model(batch["x"]).dtype
        return weighted_loss(model, batch, generator)

    trainer = Trainer(Tiny(), loss, OptimConfig(), precision="bf16")
    assert trainer.train_step([make_batch()]).applied
    assert seen == {"autocast": True, "pred": torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    Trainer(Tiny(), loss, OptimConfig()).train_step([make_batch()])
    assert seen == {"autocast": False, "pred": torch.float32}


# ----------------------------------------------------------------------------- dtypes
def moment_dtypes(trainer: Trainer) -> set:
    return {
        (key, value.dtype)
        for state in trainer.optimizer.state.values()
        for key, value in state.items()
        if key != "step"
    }


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_optimizer_state_keeps_dtype_across_steps_skips_and_resume(tmp_path, dtype):
    precision = "bf16" if dtype == torch.bfloat16 else "fp32"
    expected = {("exp_avg", dtype), ("exp_avg_sq", dtype)}
    torch.manual_seed(0)
    trainer = Trainer(Tiny().to(dtype), weighted_loss, OptimConfig(), precision=precision)
    trainer.train_step([make_batch(0)])
    assert moment_dtypes(trainer) == expected
    assert not trainer.train_step([make_batch(1, [0.0] * 8)]).applied
    assert moment_dtypes(trainer) == expected
    trainer.train_step([make_batch(2)])
    manager = CheckpointManager(tmp_path)
    trainer.save_checkpoint(manager, {"run": 1})

    resumed = Trainer(Tiny().to(dtype), weighted_loss, OptimConfig(), precision=precision)
    resumed.resume(manager, {"run": 1})
    assert moment_dtypes(resumed) == expected
    assert_bitwise(resumed.optimizer.state_dict(), trainer.optimizer.state_dict())
    resumed.train_step([make_batch(3)])
    assert moment_dtypes(resumed) == expected
    assert all(p.dtype == dtype for p in resumed.model.parameters())


def test_resume_into_other_param_dtype_is_rejected_untouched(tmp_path):
    trainer = Trainer(Tiny().to(torch.bfloat16), weighted_loss, OptimConfig(), precision="bf16")
    trainer.train_step([make_batch()])
    manager = CheckpointManager(tmp_path)
    trainer.save_checkpoint(manager, {})
    other = Trainer(Tiny(), weighted_loss, OptimConfig(), precision="bf16")
    before = snapshot(other)
    with pytest.raises(CheckpointMismatchError, match=r"l1\.weight.*bfloat16"):
        other.resume(manager, {})
    assert_bitwise(snapshot(other), before)


# ----------------------------------------------------------------------------- resume
def noisy_loss(model, batch, generator) -> LossOutput:
    """Randomness from every stream the trainer restores: its generator (input noise, row
    dropout), the global torch RNG (nn.Dropout), Python's and NumPy's global RNGs."""
    noise = 0.1 * torch.randn(batch["x"].shape, generator=generator)
    keep = (torch.rand(batch["w"].shape, generator=generator) > 0.3).float()
    scale = 1.0 + 0.1 * random.random() + 0.1 * float(np.random.rand())
    pred = model(batch["x"] + noise)
    per_row = ((pred - batch["y"]) ** 2).mean(-1) * scale
    weights = batch["w"] * keep
    return LossOutput(WeightedMetric((per_row * weights).sum(), weights.sum()))


RESUME_CONFIG = dict(
    lr=0.05, weight_decay=0.01, grad_clip=0.5, schedule="cosine", warmup_steps=2, total_steps=6
)
METADATA = {"model": {"hidden": 4, "dropout": 0.2}, "data": {"path": "toy"}}


def run_steps(trainer: Trainer, steps: range) -> None:
    for step in steps:
        trainer.train_step(split(make_batch(100 + step), MICRO))


def fresh_trainer(init_seed: int) -> Trainer:
    torch.manual_seed(init_seed)
    return Trainer(Tiny(dropout=0.2), noisy_loss, OptimConfig(**RESUME_CONFIG), seed=3)


def test_resume_is_bitwise_exact(tmp_path):
    torch.manual_seed(11)
    random.seed(11)
    np.random.seed(11)
    straight = fresh_trainer(0)
    run_steps(straight, range(6))

    torch.manual_seed(11)
    random.seed(11)
    np.random.seed(11)
    first = fresh_trainer(0)
    run_steps(first, range(3))
    manager = CheckpointManager(tmp_path)
    first.save_checkpoint(manager, METADATA, data_state={"position": 3})
    del first

    torch.manual_seed(999)  # a new process: other init, other global RNG states
    random.seed(999)
    np.random.seed(999)
    second = fresh_trainer(init_seed=7)
    assert second.resumed_from is None
    data_state = second.resume(manager, METADATA)
    assert data_state == {"position": 3}
    assert second.resumed_from == manager.path_for(3)
    assert second.global_step == 3
    run_steps(second, range(data_state["position"], 6))

    assert second.global_step == straight.global_step == 6
    for (name, a), b in zip(
        straight.model.state_dict().items(), second.model.state_dict().values()
    ):
        assert torch.equal(a, b), name
    assert_bitwise(second.optimizer.state_dict(), straight.optimizer.state_dict(), "optimizer")
    assert_bitwise(second.scheduler.state_dict(), straight.scheduler.state_dict(), "scheduler")
    assert torch.equal(second.generator.get_state(), straight.generator.get_state())

    # The check has teeth: a resume that loses the global torch RNG (dropout) diverges.
    third = fresh_trainer(init_seed=7)
    third.resume(manager, METADATA)
    torch.manual_seed(12345)
    run_steps(third, range(3, 6))
    assert not torch.equal(third.model.l1.weight, straight.model.l1.weight)


def test_resume_with_mismatched_metadata_leaves_state_untouched(tmp_path):
    manager = CheckpointManager(tmp_path)
    writer = fresh_trainer(0)
    run_steps(writer, range(2))
    writer.save_checkpoint(manager, METADATA)

    reader = fresh_trainer(5)
    run_steps(reader, range(1))
    other_optim = Trainer(
        Tiny(dropout=0.2), noisy_loss, OptimConfig(**{**RESUME_CONFIG, "lr": 0.1}), seed=3
    )
    before = snapshot(reader)
    rng_before = torch.get_rng_state()

    changed = {"model": {"hidden": 8, "dropout": 0.2}, "data": {"path": "toy"}}
    with pytest.raises(
        CheckpointMismatchError, match=r"'model\.hidden': this run has 8, the checkpoint has 4"
    ):
        reader.resume(manager, changed)
    missing = {**METADATA, "data": {"path": "toy", "split": "train"}}
    with pytest.raises(
        CheckpointMismatchError, match=r"'data\.split': this run has 'train', the checkpoint has no"
    ):
        reader.resume(manager, missing)
    with pytest.raises(
        CheckpointMismatchError,
        match=r"'trainer\.optim\.lr': this run has 0\.1, the checkpoint has 0\.05",
    ):
        other_optim.resume(manager, METADATA)
    assert_bitwise(snapshot(reader), before)
    assert torch.equal(torch.get_rng_state(), rng_before)
    with pytest.raises(ValueError, match="'trainer' is reserved"):
        reader.save_checkpoint(manager, {"trainer": 1})


def test_resume_without_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint to resume"):
        fresh_trainer(0).resume(CheckpointManager(tmp_path), METADATA)
