"""Evaluate generators on built-in tasks: sample with the serving loop, verify.

:func:`evaluate_task`: a token denoiser on a text task. :func:`evaluate_images`: a flow
model on mini-GenEval, with the ODE sampler at fixed seeds. :func:`evaluate_videos`: an
image-to-video model on mini-motion from rendered first frames. :func:`evaluate_rewards`: a
flow model on a prompt list without a verifier, scored by reward models.
:func:`evaluate_workflow`: a multi-stage workflow's final videos on its task (and its first
stage's images). :func:`diversity`: how different the samples of one prompt are, a held-out
measure beside the reward (a collapse to one sample per prompt drives it to 0).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .models.protocol import TokenDenoiser, VelocityModel
from .sampling.flow import FlowSamplerConfig, sample_flow
from .sampling.token import TokenSamplerConfig, sample_tokens
from .tasks import ArithmeticTask
from .tasks.geneval import GenEvalTask, attribute_accuracy


def diversity(samples: torch.Tensor, prompts: list[str]) -> float:
    """Mean pairwise pixel L2 distance between the rows of ``samples`` (``[N, ...]``, e.g.
    images ``[N, 3, H, W]`` or clips ``[N, F, 3, H, W]``) that share a prompt
    (``prompts[i]`` is row ``i``'s), averaged over the prompts; a prompt with one row counts
    as 0."""
    rows = samples.flatten(1).float()
    groups: dict[str, list[torch.Tensor]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(prompt, []).append(rows[i])
    distances = []
    for group in groups.values():
        x = torch.stack(group)
        distances.append(float(torch.cdist(x, x).sum() / max(1, len(group) * (len(group) - 1))))
    return sum(distances) / len(distances)


@contextmanager
def eval_mode(*models) -> Iterator[None]:
    """Every model (anything with ``eval`` / ``train``; others are left alone) in eval mode
    for the block; on exit, even by an error, those that were training train again and the
    others stay as they were."""
    modes = [getattr(model, "training", False) for model in models]
    for model in models:
        if hasattr(model, "eval"):
            model.eval()
    try:
        yield
    finally:
        for model, training in zip(models, modes):
            if training:
                model.train()


def _prompt_samples(task, split: str, samples_per_prompt: int, seed: int):
    """``(examples, seeds)``: every prompt of ``split`` ``samples_per_prompt`` times,
    sample-major (all prompts once, then again, ...), sample ``i`` with seed ``seed + i``."""
    if samples_per_prompt < 1:
        raise ValueError(f"samples_per_prompt: expected >= 1, got {samples_per_prompt}")
    examples = [e for _ in range(samples_per_prompt) for e in task.prompts(split)]
    if not examples:
        raise ValueError(f"split {split!r} has no prompts (heldout_fraction is 0?)")
    return examples, [seed + i for i in range(len(examples))]


def _batches(total: int, batch_size: int) -> Iterator[slice]:
    """The row slices ``[lo, lo + batch_size)`` covering ``range(total)`` in order."""
    for lo in range(0, total, batch_size):
        yield slice(lo, lo + batch_size)


@dataclass(frozen=True)
class EvalResult:
    accuracy: float
    num_examples: int
    samples: list[dict] = field(default_factory=list)
    credit: float | None = None  # the task's mean partial credit (None: it has none)

    def to_dict(self) -> dict:
        return {
            "accuracy": self.accuracy,
            "num_examples": self.num_examples,
            "samples": self.samples,
            "credit": self.credit,
        }


def evaluate_task(
    model: TokenDenoiser,
    task: ArithmeticTask,
    sampler: TokenSamplerConfig,
    *,
    num_examples: int = 256,
    batch_size: int = 128,
    split: str = "eval",
    seed: int = 0,
    num_samples_shown: int = 8,
) -> EvalResult:
    """Accuracy of the verifier on ``num_examples`` held-out problems (seeds ``seed + i``),
    and the task's mean partial credit where it has one (``task.credit_name``)."""
    tokenizer = task.tokenizer
    sampler = sampler.model_copy(update={"generation_length": task.completion_length})
    correct, credit, samples = 0.0, 0.0, []
    with eval_mode(model):
        for start in range(0, num_examples, batch_size):
            indices = range(start, min(num_examples, start + batch_size))
            examples = task.examples(indices, split)
            batch = task.encode(examples)
            tokens = sample_tokens(
                model,
                batch["prompt_ids"],
                batch["prompt_mask"],
                sampler,
                seeds=[seed + i for i in indices],
                stop_token_id=tokenizer.eos_id,
            ).tokens
            texts = tokenizer.batch_decode(tokens)
            rewards = task.rewards(texts, examples)
            correct += float(rewards.sum())
            if task.credit_name is not None:
                credit += sum(task.credit(text, ex) for text, ex in zip(texts, examples))
            for example, text, reward in zip(examples, texts, rewards.tolist()):
                if len(samples) < num_samples_shown:
                    samples.append(
                        {
                            "prompt": example.prompt,
                            "completion": text,
                            "answer": example.answer,
                            "correct": bool(reward),
                        }
                    )
    return EvalResult(
        accuracy=correct / num_examples,
        num_examples=num_examples,
        samples=samples,
        credit=None if task.credit_name is None else credit / num_examples,
    )


def format_samples(samples: list[dict]) -> str:
    """One line per sample: a check mark, prompt + completion, the true answer."""
    lines = []
    for sample in samples:
        mark = "✓" if sample["correct"] else "✗"
        lines.append(
            f"  {mark} {sample['prompt'] + sample['completion']:<16} answer {sample['answer']}"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class ImageEvalResult:
    """Verifier results on ``num_images`` samples.

    ``accuracy``: fraction with every attribute right; ``attributes``: accuracy per attribute
    over the images whose prompt states it, plus ``overall`` (= ``accuracy``);
    ``reward_mean``: mean fraction of attributes right (the ``geneval`` reward). Row ``i`` of
    ``images`` (float ``[N, 3, H, W]`` in ``[0, 1]``) was sampled for ``prompts[i]`` from seed
    ``seeds[i]``; ``correct[i]`` is its overall verdict.
    """

    accuracy: float
    attributes: dict[str, float]
    reward_mean: float
    num_images: int
    prompts: list[str]
    seeds: list[int]
    correct: list[bool]
    images: torch.Tensor

    @property
    def diversity(self) -> float:
        """:func:`diversity` of the images (the samples of one prompt)."""
        return diversity(self.images, self.prompts)

    def captions(self) -> list[str]:
        """``"<prompt> ok"`` / ``"<prompt> x"`` per image (grid captions)."""
        return [f"{p} {'ok' if c else 'x'}" for p, c in zip(self.prompts, self.correct)]

    def to_dict(self, num_samples_shown: int = 8) -> dict:
        samples = [
            {"prompt": p, "seed": s, "correct": c}
            for p, s, c in list(zip(self.prompts, self.seeds, self.correct))[:num_samples_shown]
        ]
        return {
            "accuracy": self.accuracy,
            "attributes": self.attributes,
            "reward_mean": self.reward_mean,
            "num_images": self.num_images,
            "samples": samples,
        }


@torch.no_grad()
def evaluate_images(
    model: VelocityModel,
    task: GenEvalTask,
    sampler: FlowSamplerConfig,
    *,
    samples_per_prompt: int = 4,
    split: str = "eval",
    seed: int = 0,
    batch_size: int = 128,
) -> ImageEvalResult:
    """Sample every prompt of ``split`` ``samples_per_prompt`` times with the serving ODE
    sampler and verify each image.

    Images are ordered sample-major (all prompts with their first seed, then all with the
    second, ...), so the first ``len(prompts)`` images show every prompt once; image ``i``
    uses seed ``seed + i``, the same at every evaluation (fixed-seed samples are comparable
    across training). ``sampler`` is used with ``mode="ode"`` and without group noise sharing
    whatever its settings (a rollout sampler serves as is).
    """
    examples, seeds = _prompt_samples(task, split, samples_per_prompt, seed)
    sampler = sampler.model_copy(update={"mode": "ode", "share_group_noise": False})
    chunks = []
    with eval_mode(model):
        for rows in _batches(len(examples), batch_size):
            prompts = [e.prompt for e in examples[rows]]
            sample = sample_flow(model, prompts, sampler, seeds=seeds[rows])
            chunks.append(sample.images.float().cpu())
    images = torch.cat(chunks)
    results = task.verify(images, examples)
    attributes = attribute_accuracy(results)
    rewards = [
        sum(r[a] for a in e.attributes) / len(e.attributes) for r, e in zip(results, examples)
    ]
    return ImageEvalResult(
        accuracy=attributes["overall"],
        attributes=attributes,
        reward_mean=sum(rewards) / len(rewards),
        num_images=len(examples),
        prompts=[e.prompt for e in examples],
        seeds=seeds,
        correct=[bool(r["overall"]) for r in results],
        images=images,
    )


@dataclass(frozen=True)
class RewardEvalResult:
    """Reward scores of samples for the prompts of a task without a verifier (a prompt
    list): ``reward_mean`` is the mean over the ``num_images`` samples of the weighted total
    reward, ``rewards`` the mean of each reward term (unweighted, by name). Row ``i`` of
    ``images`` (float ``[N, 3, H, W]``, or clips ``[N, F, 3, H, W]``, in ``[0, 1]``) was
    sampled for ``prompts[i]`` from seed ``seeds[i]`` and scored ``scores[i]`` (its total)."""

    reward_mean: float
    rewards: dict[str, float]
    num_images: int
    prompts: list[str]
    seeds: list[int]
    scores: list[float]
    images: torch.Tensor

    def captions(self) -> list[str]:
        """``"<prompt> <total reward>"`` per image (grid captions)."""
        return [f"{p} {s:.3g}" for p, s in zip(self.prompts, self.scores)]

    def to_dict(self, num_samples_shown: int = 8) -> dict:
        samples = [
            {"prompt": p, "seed": s, "reward": r}
            for p, s, r in list(zip(self.prompts, self.seeds, self.scores))[:num_samples_shown]
        ]
        return {
            "reward_mean": self.reward_mean,
            "rewards": self.rewards,
            "num_images": self.num_images,
            "samples": samples,
        }


@torch.no_grad()
def evaluate_rewards(
    model: VelocityModel,
    task,
    sampler: FlowSamplerConfig,
    reward_fn,
    *,
    samples_per_prompt: int = 4,
    split: str = "eval",
    seed: int = 0,
    batch_size: int = 128,
) -> RewardEvalResult:
    """Sample every prompt of ``task``'s ``split`` ``samples_per_prompt`` times with the
    serving ODE sampler, as :func:`evaluate_images` does (sample-major, image ``i`` from seed
    ``seed + i``, the same at every evaluation), and score each sample with ``reward_fn`` (a
    :class:`~diffusion_rl.rewards.CombinedReward`: ``reward_fn(images, examples)`` gives
    ``total`` and ``parts``), ``batch_size`` rows at a time. For tasks without a verifier
    (:class:`~diffusion_rl.tasks.datasets.PromptFileTask`); the task is asked for its
    prompts only."""
    examples, seeds = _prompt_samples(task, split, samples_per_prompt, seed)
    sampler = sampler.model_copy(update={"mode": "ode", "share_group_noise": False})
    chunks, totals, parts = [], [], {}
    with eval_mode(model):
        for rows in _batches(len(examples), batch_size):
            prompts = [e.prompt for e in examples[rows]]
            images = sample_flow(model, prompts, sampler, seeds=seeds[rows]).images.float().cpu()
            scored = reward_fn(images, examples[rows])
            chunks.append(images)
            totals.append(scored.total)
            for name, part in scored.parts.items():
                parts.setdefault(name, []).append(part)
    total = torch.cat(totals)
    return RewardEvalResult(
        reward_mean=float(total.mean()),
        rewards={name: float(torch.cat(values).mean()) for name, values in parts.items()},
        num_images=len(examples),
        prompts=[e.prompt for e in examples],
        seeds=seeds,
        scores=total.tolist(),
        images=torch.cat(chunks),
    )


@dataclass(frozen=True)
class ClipEvalResult:
    """Clips verified on held-out prompts: ``accuracy`` (all attributes right),
    ``attributes`` (per attribute and ``overall``), ``reward_mean`` (mean fraction right),
    the ``clips`` ``[N, F, 3, H, W]``, their first frames ``images`` and ``prompts`` /
    ``seeds`` per clip. For a workflow, ``image_accuracy`` / ``image_attributes`` judge the
    first stage's images with the task's image verifier (a diagnostic; None otherwise)."""

    accuracy: float
    attributes: dict[str, float]
    reward_mean: float
    num_clips: int
    prompts: list[str]
    seeds: list[int]
    correct: list[bool]
    clips: torch.Tensor
    images: torch.Tensor
    image_accuracy: float | None = None
    image_attributes: dict[str, float] | None = None

    @property
    def diversity(self) -> float:
        """:func:`diversity` of the clips (the clips of one prompt)."""
        return diversity(self.clips, self.prompts)

    def to_dict(self) -> dict:
        return {
            "accuracy": self.accuracy,
            "attributes": self.attributes,
            "reward_mean": self.reward_mean,
            "image_accuracy": self.image_accuracy,
            "image_attributes": self.image_attributes,
            "num_clips": self.num_clips,
            "samples": [
                {"prompt": p, "seed": s, "correct": c}
                for p, s, c in list(zip(self.prompts, self.seeds, self.correct))[:16]
            ],
        }


def evaluate_workflow(
    workflow,
    *,
    samplers: dict[str, FlowSamplerConfig] | None = None,
    samples_per_prompt: int = 2,
    split: str = "eval",
    seed: int = 0,
    batch_size: int = 64,
) -> ClipEvalResult:
    """Run ``workflow`` (its task's ``split`` prompts, each ``samples_per_prompt`` times,
    sample-major, clip ``i`` from seed ``seed + i``, one output per stage) with ``samplers``
    (per stage; default the workflow's own settings), and verify the final clips with the
    task and the first stage's images with the task's image verifier. Fixed seeds: the same
    clips at every evaluation for the same weights."""
    task = workflow.task
    examples, seeds = _prompt_samples(task, split, samples_per_prompt, seed)
    fanout = {stage.name: 1 for stage in workflow.spec.stages[1:]}
    clips, images = [], []
    with eval_mode(*workflow.models.values()):
        for rows in _batches(len(examples), batch_size):
            run = workflow.run(examples[rows], seeds[rows], samplers=samplers, fanout=fanout)
            clips.append(run.final.artefact.cpu())
            images.append(next(iter(run.stages.values())).artefact.cpu())
    clips, images = torch.cat(clips), torch.cat(images)
    image_results = task.image_task().verify(images, [e.image_prompt for e in examples])
    image_attributes = attribute_accuracy(image_results)
    return _clip_result(
        task,
        examples,
        seeds,
        clips,
        images,
        image_accuracy=image_attributes["overall"],
        image_attributes=image_attributes,
    )


def evaluate_videos(
    model: VelocityModel,
    task,
    sampler: FlowSamplerConfig,
    *,
    samples_per_prompt: int = 2,
    split: str = "eval",
    seed: int = 0,
    batch_size: int = 64,
) -> ClipEvalResult:
    """An image-to-video model on its task's ``split`` prompts, each ``samples_per_prompt``
    times (sample-major; clip ``i`` from seed ``seed + i``), conditioned on the *rendered*
    first frame of each prompt (``task.render_clip(example, seed + i)[0]``) with the serving
    ODE sampler; every clip verified."""
    examples, seeds = _prompt_samples(task, split, samples_per_prompt, seed)
    sampler = sampler.model_copy(update={"mode": "ode", "share_group_noise": False})
    images = torch.stack([task.render_clip(e, s)[0] for e, s in zip(examples, seeds)])
    chunks = []
    with eval_mode(model):
        for rows in _batches(len(examples), batch_size):
            prompts = [e.prompt for e in examples[rows]]
            first = images[rows]
            uncond = model.empty_conditioning(first) if sampler.guidance_scale != 1.0 else None
            sample = sample_flow(
                model,
                prompts,
                sampler,
                seeds=seeds[rows],
                cond=model.encode_conditioning(prompts, first),
                uncond=uncond,
            )
            chunks.append(sample.images.float().cpu())
    return _clip_result(task, examples, seeds, torch.cat(chunks), images)


def _clip_result(task, examples, seeds, clips, images, **extra) -> ClipEvalResult:
    """Verify ``clips`` against ``examples``: per-attribute means and the result record."""
    results = task.verify(clips, examples)
    attributes = {key: sum(r[key] for r in results) / len(results) for key in results[0]}
    rewards = [sum(v for k, v in r.items() if k != "overall") / (len(r) - 1) for r in results]
    return ClipEvalResult(
        accuracy=attributes["overall"],
        attributes=attributes,
        reward_mean=sum(rewards) / len(rewards),
        num_clips=len(examples),
        prompts=[e.prompt for e in examples],
        seeds=seeds,
        correct=[bool(r["overall"]) for r in results],
        clips=clips,
        images=images,
        **extra,
    )


__all__ = [
    "EvalResult",
    "RewardEvalResult",
    "eval_mode",
    "ImageEvalResult",
    "ClipEvalResult",
    "evaluate_videos",
    "evaluate_workflow",
    "evaluate_images",
    "evaluate_rewards",
    "evaluate_task",
    "format_samples",
]
