"""Bounds of config values: the :data:`LIMITS` table, the derived budgets of a step and of a
new built-in model, :func:`check_device`, and the size estimators :func:`token_model_size` and
:func:`flow_model_size`.

Bounds (:data:`LIMITS`): every key the table names, in whatever section, is at most its
limit; a new built-in model (``model.path: null``) stays under ``LIMITS["parameters"]``
estimated parameters and ``LIMITS["activations"]`` activation elements (rows x positions x
widest hidden width x layers of one forward); a step's rollout rows stay under
``LIMITS["rows_per_step"]``. The limits are generous (far beyond the built-in tasks and
models) but keep any config from asking for terabytes.

``device`` is ``cpu``, ``cuda``, ``cuda:N`` or ``mps`` and present on this machine
(:func:`check_device`).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch
from pydantic_core import InitErrorDetails

from .loading import _problem

if TYPE_CHECKING:  # annotations only: the sections import this module
    from .sections import FlowModelSection, ModelSection


# Upper bounds of config values, by key name, in any section (``micro_batch_size`` bounds the
# recipe's and ``sampler.micro_batch_size``, ``seed`` the run's and ``task.seed``). The last
# three are derived quantities, not keys (see the module docstring).
LIMITS: dict[str, int | float] = {
    # run. seed: the learner keys its micro-batch generators (seed * 1_000_003 + step) * 4096
    # + index, which torch.Generator.manual_seed takes only below 2**64.
    "seed": 2**32 - 1,
    "steps": 10**9,
    "eval_every": 10**9,
    "checkpoint_every": 10**9,
    "log_every": 10**9,
    "keep_last": 10_000,
    "threads": 1024,
    "max_consecutive_skips": 10**6,
    "total_steps": 10**9,
    "warmup_steps": 10**9,
    # batches and rollouts
    "batch_size": 2**16,
    "micro_batch_size": 2**16,
    "prompts_per_step": 2**16,
    "group_size": 2**12,
    "samples_per_prompt": 2**12,
    "num_iterations": 1024,
    "max_sampling_rounds": 1024,
    # evaluation
    "eval_examples": 2**20,
    "eval_samples_per_prompt": 1024,
    "grid_images": 1024,
    # models (new built-in ones)
    "d_model": 2**15,
    "n_layers": 1024,
    "n_heads": 1024,
    "d_ff": 2**17,
    "patch_size": 256,
    "mlp_ratio": 64.0,
    # samplers and objectives
    "generation_length": 2**16,
    "block_size": 2**16,
    "steps_per_block": 2**16,
    "num_steps": 2**14,
    "token_scale": 2**16,
    "overlong_max_tokens": 2**16,
    "overlong_buffer_tokens": 2**16,
    # derived: rollout rows of one step (prompts_per_step x group_size or samples_per_prompt)
    "rows_per_step": 2**16,
    # derived, new built-in models: estimated parameters (2**31 in fp32 with AdamW: ~34 GB)
    "parameters": 2**31,
    # derived, new built-in models: rows x positions x widest hidden width x layers per forward
    "activations": 2**34,
}
_DERIVED_LIMITS = ("rows_per_step", "parameters", "activations")


def _limit_problems(tree: Any, loc: tuple = ()) -> list[InitErrorDetails]:
    """Every number in the dumped config ``tree`` above its key's :data:`LIMITS` entry."""
    problems = []
    if isinstance(tree, dict):
        for key, value in tree.items():
            limit = LIMITS.get(key) if key not in _DERIVED_LIMITS else None
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if limit is not None and number and value > limit:
                problems.append(
                    _problem(loc + (key,), f"{value} exceeds the limit {limit} (LIMITS)", value)
                )
            else:
                problems += _limit_problems(value, loc + (key,))
    elif isinstance(tree, list):
        for index, value in enumerate(tree):
            problems += _limit_problems(value, loc + (index,))
    return problems


def check_device(value: str) -> str:
    """``value`` if it names a device this machine has: ``cpu``, ``cuda``, ``cuda:N`` (N below
    the number of visible GPUs) or ``mps``; else ``ValueError`` saying why."""
    if not isinstance(value, str) or not re.fullmatch(r"cpu|mps|cuda(:[0-9]+)?", value):
        raise ValueError(f"expected 'cpu', 'cuda', 'cuda:N' or 'mps', got {value!r}")
    if value.startswith("cuda"):
        if not torch.cuda.is_available():
            why = (
                "this build of PyTorch has no CUDA"
                if torch.version.cuda is None
                else "no CUDA device is visible (torch.cuda.is_available() is False)"
            )
            raise ValueError(f"{value!r}: {why}; use 'cpu'")
        count = torch.cuda.device_count()
        if ":" in value and int(value.split(":")[1]) >= count:
            raise ValueError(
                f"{value!r}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
            )
    if value == "mps" and not torch.backends.mps.is_available():
        raise ValueError("'mps': this machine or build of PyTorch has no MPS; use 'cpu'")
    return value


# ---------------------------------------------------------------------------------------------
# Budgets and size estimators
# ---------------------------------------------------------------------------------------------


def _model_budget(parameters: int, activations: int) -> list[InitErrorDetails]:
    """One problem at ``model`` when the new model's estimated sizes exceed :data:`LIMITS`."""
    over = [
        f"~{value:.3g} {what} (LIMITS[{key!r}] = {LIMITS[key]:.3g})"
        for key, value, what in (
            ("parameters", parameters, "parameters"),
            ("activations", activations, "activation elements per forward"),
        )
        if value > LIMITS[key]
    ]
    if not over:
        return []
    message = f"too large a new model: {' and '.join(over)}; reduce its size or the batch"
    return [_problem(("model",), message, parameters)]


def _rows_budget(rows: int, what: str) -> list[InitErrorDetails]:
    """One top-level problem when a step's rollout rows exceed ``LIMITS["rows_per_step"]``."""
    limit = LIMITS["rows_per_step"]
    if rows <= limit:
        return []
    message = f"{what} = {rows} rollout rows per step exceed LIMITS['rows_per_step'] = {limit}"
    return [_problem(("prompts_per_step",), message, rows)]


def token_model_size(model: ModelSection, vocab: int, positions: int, rows: int) -> tuple[int, int]:
    """(estimated parameters, activation elements of one forward of ``rows`` sequences of
    ``positions`` tokens) of the new built-in transformer ``model`` describes."""
    d, layers = model.d_model, model.n_layers
    ff = model.d_ff or 4 * d
    parameters = layers * (4 * d * d + 2 * d * ff + 9 * d + ff) + (vocab + positions) * d
    return parameters, rows * positions * max(ff, 3 * d) * layers


def flow_model_size(
    model: FlowModelSection, image_size: int, vocab: int, rows: int
) -> tuple[int, int]:
    """(estimated parameters, activation elements of one forward of ``rows`` images) of the
    new built-in FlowDiT ``model`` describes, for ``image_size`` pixels and ``vocab`` words."""
    d, layers, values = model.d_model, model.n_layers, 3 * model.patch_size**2  # RGB patches
    hidden = max(1, round(model.mlp_ratio * d))
    patches = (image_size // model.patch_size) ** 2
    per_layer = 10 * d * d + 2 * d * hidden + 11 * d + hidden  # QKV, projection, MLP, adaLN
    embeddings = (values + 1 + patches + vocab + 1 + 8 + 64 + 2) * d  # patches, words, σ
    heads = 4 * d * d + 5 * d + d * values + values  # prompt pool, σ MLP, final adaLN, output
    positions = patches + 8  # image patches and the prompt tokens
    return layers * per_layer + embeddings + heads, rows * positions * max(hidden, 6 * d) * layers
