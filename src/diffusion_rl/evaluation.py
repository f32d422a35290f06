"""Evaluate a token denoiser on a built-in task: sample with the serving loop, verify."""

from __future__ import annotations

from dataclasses import dataclass, field

from .models.protocol import TokenDenoiser
from .sampling.token import TokenSamplerConfig, sample_tokens
from .tasks import ArithmeticTask


@dataclass(frozen=True)
class EvalResult:
    accuracy: float
    num_examples: int
    samples: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "accuracy": self.accuracy,
            "num_examples": self.num_examples,
            "samples": self.samples,
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
    """Accuracy of the verifier on ``num_examples`` held-out problems (seeds ``seed + i``)."""
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    tokenizer = task.tokenizer
    sampler = sampler.model_copy(update={"generation_length": task.completion_length})
    correct, samples = 0.0, []
    try:
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
    finally:
        if was_training:
            model.train()
    return EvalResult(accuracy=correct / num_examples, num_examples=num_examples, samples=samples)


def format_samples(samples: list[dict]) -> str:
    """One line per sample: a check mark, prompt + completion, the true answer."""
    lines = []
    for sample in samples:
        mark = "✓" if sample["correct"] else "✗"
        lines.append(
            f"  {mark} {sample['prompt'] + sample['completion']:<16} answer {sample['answer']}"
        )
    return "\n".join(lines)


__all__ = ["EvalResult", "evaluate_task", "format_samples"]
