"""A trainer of several parts (the stages of a workflow) equals one trainer per part.

Each part has its own AdamW settings, LR schedule and clip, and its gradient is normalised by
its own micro-batches' weight; so training the parts together must give bitwise what
separate single-part trainers give, a part without weight must stay put, and one non-finite
part must leave the whole model untouched.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from diffusion_rl.contracts import LossOutput, WeightedMetric
from diffusion_rl.train.checkpoint import CheckpointManager
from diffusion_rl.train.trainer import OptimConfig, Trainer, lr_factor


@dataclass
class Micro:
    x: torch.Tensor
    y: torch.Tensor
    w: torch.Tensor
    part: str = ""


def _loss(model, micro, _generator):
    module = model[micro.part] if isinstance(model, nn.ModuleDict) else model
    err = (module(micro.x).squeeze(-1) - micro.y).square()
    return LossOutput(
        primary=WeightedMetric((err * micro.w).sum(), micro.w.sum()),
        aux_metrics={"mse": WeightedMetric((err.detach() * micro.w).sum(), micro.w.sum())},
    )


def _models(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)), nn.Linear(3, 1)


OPTIMS = {
    "image": OptimConfig(lr=3e-2, weight_decay=0.01, grad_clip=0.5, warmup_steps=2),
    "video": OptimConfig(
        lr=1e-2, betas=(0.8, 0.99), grad_clip=None, schedule="cosine", total_steps=6
    ),
}


def _batches(step, part, rows=5, weight_scale=1.0):
    g = torch.Generator().manual_seed(100 * step + len(part))
    out = []
    for k in range(2):  # two micro-batches per part, unequal weights
        x = torch.randn(rows + k, 3, generator=g)
        y = torch.randn(rows + k, generator=g)
        w = torch.rand(rows + k, generator=g) * weight_scale
        out.append(Micro(x, y, w, part))
    return out


def test_parts_equal_separate_trainers_bitwise():
    image, video = _models()
    joint = Trainer(
        nn.ModuleDict({"image": copy.deepcopy(image), "video": copy.deepcopy(video)}),
        _loss,
        OptimConfig(),
        parts=OPTIMS,
    )
    alone = {
        "image": Trainer(copy.deepcopy(image), _loss, OPTIMS["image"]),
        "video": Trainer(copy.deepcopy(video), _loss, OPTIMS["video"]),
    }
    for step in range(5):
        micro = _batches(step, "image") + _batches(step, "video")
        metrics = joint.train_step(micro).metrics
        separate = {
            name: alone[name].train_step([Micro(m.x, m.y, m.w) for m in micro if m.part == name])
            for name in alone
        }
        for name in alone:
            assert metrics[f"loss/{name}"] == separate[name].metrics["loss"]
            assert metrics[f"grad_norm/{name}"] == separate[name].metrics["grad_norm"]
            assert metrics[f"lr/{name}"] == separate[name].metrics["lr"]
            assert metrics[f"lr/{name}"] == pytest.approx(
                OPTIMS[name].lr * lr_factor(OPTIMS[name], step)
            )
        assert metrics["loss"] == pytest.approx(
            separate["image"].metrics["loss"] + separate["video"].metrics["loss"], rel=1e-12
        )
    for name, trainer in alone.items():
        for (key, a), b in zip(
            joint.model[name].state_dict().items(), trainer.model.state_dict().values()
        ):
            assert torch.equal(a, b), f"{name}.{key}"


def test_part_without_weight_stays_put_and_others_train():
    image, video = _models()
    trainer = Trainer(
        nn.ModuleDict({"image": image, "video": video}), _loss, OptimConfig(), parts=OPTIMS
    )
    before = copy.deepcopy(trainer.model.state_dict())
    micro = _batches(0, "image", weight_scale=0.0) + _batches(0, "video")
    result = trainer.train_step(micro)
    assert result.applied and result.metrics["loss/image"] == 0.0
    after = trainer.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith("image."))
    assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith("video."))
    # only the video part holds Adam state: the image part was never stepped
    assert all(p not in trainer.optimizer.state for p in trainer.model["image"].parameters())


def test_non_finite_part_skips_the_whole_step():
    image, video = _models()
    trainer = Trainer(
        nn.ModuleDict({"image": image, "video": video}), _loss, OptimConfig(), parts=OPTIMS
    )
    before = copy.deepcopy(trainer.model.state_dict())
    micro = _batches(0, "image") + _batches(0, "video")
    micro[3].y[0] = math.nan
    result = trainer.train_step(micro)
    assert not result.applied and trainer.skipped_nonfinite == 1
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    assert not trainer.optimizer.state


def test_micro_batch_must_name_a_part():
    image, video = _models()
    trainer = Trainer(
        nn.ModuleDict({"image": image, "video": video}), _loss, OptimConfig(), parts=OPTIMS
    )
    with pytest.raises(ValueError, match="part 'audio' is not one of this trainer's parts"):
        trainer.train_step([Micro(torch.zeros(1, 3), torch.zeros(1), torch.ones(1), "audio")])
    with pytest.raises(ValueError, match=r"parts: 'audio' is not a submodule"):
        Trainer(
            nn.ModuleDict({"image": image}), _loss, OptimConfig(), parts={"audio": OptimConfig()}
        )
    with pytest.raises(TypeError, match=r"parts\['image'\]: expected an OptimConfig"):
        Trainer(nn.ModuleDict({"image": image}), _loss, OptimConfig(), parts={"image": {}})


def test_frozen_part_is_not_trained():
    image, video = _models()
    for p in video.parameters():
        p.requires_grad_(False)
    trainer = Trainer(
        nn.ModuleDict({"image": image}), _loss, OptimConfig(), parts={"image": OPTIMS["image"]}
    )
    frozen = copy.deepcopy(video.state_dict())
    trainer.train_step(_batches(0, "image"))
    assert all(torch.equal(frozen[k], v) for k, v in video.state_dict().items())


def test_checkpoint_resume_with_parts_is_exact(tmp_path):
    def make():
        image, video = _models()
        return Trainer(
            nn.ModuleDict({"image": image, "video": video}), _loss, OptimConfig(), parts=OPTIMS
        )

    straight = make()
    for step in range(6):
        straight.train_step(_batches(step, "image") + _batches(step, "video"))
    first = make()
    for step in range(3):
        first.train_step(_batches(step, "image") + _batches(step, "video"))
    manager = CheckpointManager(tmp_path / "ckpt")
    first.save_checkpoint(manager, {"run": "parts"})
    resumed = make()
    resumed.resume(manager, {"run": "parts"})
    for step in range(3, 6):
        resumed.train_step(_batches(step, "image") + _batches(step, "video"))
    for key, value in straight.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[key]), key
    assert resumed.scheduler.get_last_lr() == straight.scheduler.get_last_lr()
    # the parts' settings are part of the checkpoint's identity
    other = dict(OPTIMS, video=OptimConfig(lr=5e-3))
    image, video = _models()
    changed = Trainer(
        nn.ModuleDict({"image": image, "video": video}), _loss, OptimConfig(), parts=other
    )
    with pytest.raises(ValueError, match="trainer.parts.video.lr"):
        changed.resume(manager, {"run": "parts"})
