"""Held-out measures the learning benchmarks report beside the trained reward.

Each is something the run does not train on, so that a gain that is reward hacking shows as
a drop there:

* ``diversity``: the mean pairwise pixel L2 distance between the samples (images, or
  clips) of one prompt, averaged over prompts (a collapse to one sample per prompt drives it
  to 0): the library's ``diffusion_rl.evaluation.diversity``, in every flow recipe's
  evaluation record (``history[i]["diversity"]``).
* :func:`token_metrics`: for a token denoiser on a text task with an integer answer
  (arithmetic), the fraction of well-formed greedy completions (:func:`well_formed`), the
  partial-credit ``digits`` score and the verifier's accuracy when sampling at a temperature
  (a few samples per problem), beside the greedy accuracy.

This module imports only torch at import time (a recipe process can import it cheaply).
"""

from __future__ import annotations

import re

import torch

_NUMBER = re.compile(r"-?[0-9]+")


def well_formed(row: list[int], tokenizer) -> bool:
    """Whether completion ``row`` (token ids) is a number and the stop token, nothing else:
    one or more non-special tokens reading ``-?[0-9]+`` (no whitespace), then ``eos`` in
    every remaining slot (the form of the SFT targets)."""
    eos = tokenizer.eos_id
    if eos not in row:
        return False
    cut = row.index(eos)
    if cut == 0 or any(token != eos for token in row[cut:]):
        return False
    if not all(tokenizer.decode([token], stop_at_eos=False) for token in row[:cut]):
        return False  # a special token (mask, pad) that decoding would drop
    return _NUMBER.fullmatch(tokenizer.decode(row[:cut])) is not None


def token_metrics(model_dir: str, config, *, samples: int = 4, temperature: float = 1.0) -> dict:
    """Held-out measures of the token model in ``model_dir`` under ``config`` (a built
    ``GRPORecipeConfig`` or ``DistillRecipeConfig``: its task, or the one the model records,
    its sampler, ``eval_examples`` problems of the eval split, seeds ``seed + i``):

    * ``accuracy``: the verifier at ``eval_temperature`` (greedy; what the recipe's own
      evaluation reports, the same problems, seeds and batches);
    * ``well_formed``: the fraction of those completions that are :func:`well_formed`;
    * ``digits``: their mean partial-credit score (the ``digits`` reward: the fraction of
      answer digits right, aligned from the units);
    * ``sampled_accuracy``: the verifier's mean over ``samples`` completions per problem at
      ``temperature`` (seeds ``1_000_000 * (k + 1) + seed + i``), and ``pass@<samples>``:
      the fraction of problems with any of them right.

    Runs in this process (set its torch threads first)."""
    from diffusion_rl.models import load_model
    from diffusion_rl.recipes.common import token_task
    from diffusion_rl.rewards import get_reward
    from diffusion_rl.sampling import sample_tokens

    loaded = load_model(model_dir)
    task = token_task(
        config.task, config.sampler.block_size, loaded.info, model_dir, loaded.tokenizer
    )
    model = loaded.model.eval()
    sampler = config.sampler.model_copy(update={"generation_length": task.completion_length})
    total = config.eval_examples
    examples = task.examples(range(total), "eval")
    digits = get_reward("digits", task=task)

    def sample(temperature: float, seeds: list[int]) -> torch.Tensor:
        settings = sampler.model_copy(update={"temperature": temperature})
        rows = []
        for lo in range(0, total, 128):  # evaluate_task's batches
            batch = task.encode(examples[lo : lo + 128])
            with torch.no_grad():
                rows.append(
                    sample_tokens(
                        model,
                        batch["prompt_ids"],
                        batch["prompt_mask"],
                        settings,
                        seeds=seeds[lo : lo + 128],
                        stop_token_id=task.tokenizer.eos_id,
                    ).tokens
                )
        return torch.cat(rows)

    tokens = sample(config.eval_temperature, [config.seed + i for i in range(total)])
    texts = task.tokenizer.batch_decode(tokens)
    formed = [well_formed(row, task.tokenizer) for row in tokens.tolist()]
    result = {
        "accuracy": round(float(task.rewards(texts, examples).mean()), 4),
        "well_formed": round(sum(formed) / total, 4),
        "digits": round(float(digits(texts, examples).mean()), 4),
        "num_examples": total,
    }
    right = torch.zeros(samples, total)
    for k in range(samples):
        seeds = [1_000_000 * (k + 1) + config.seed + i for i in range(total)]
        drawn = task.tokenizer.batch_decode(sample(temperature, seeds))
        right[k] = task.rewards(drawn, examples)
    if samples:
        result["sampled_accuracy"] = round(float(right.mean()), 4)
        result[f"pass@{samples}"] = round(float((right > 0).any(0).float().mean()), 4)
    result["sampled"] = {"temperature": temperature, "samples_per_problem": samples}
    return result
