"""Validated traces and contracts: a fuzz suite of malformed inputs, and real traces that pass.

Every malformed case starts from a *valid* object (a real trace captured by the samplers, or a
small valid contract) and breaks one field in one way: wrong kind, dtype, rank or shape,
NaN / ±inf, out-of-range low or high, a meta or sparse tensor, an empty value, a bool where an
int belongs, an overflowing Python number, a self-referencing structure. Each case must raise
``TypeError`` or ``ValueError`` (never a RecursionError, OverflowError or a late crash) whose
message names the broken field, e.g. ``TokenTrace.behaviour_logprobs``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable

import numpy as np
import pytest
import torch
from conftest import tiny_model
from flow_toy import TinyVelocity, one_thread  # noqa: F401 (fixture)

from diffusion_rl.contracts import (
    DiffusionDistillationBatch,
    DiffusionTokenBatch,
    Extreme,
    FlowStepBatch,
    LossOutput,
    WeightedMetric,
    validate_diffusion_logits,
)
from diffusion_rl.sampling import TokenSamplerConfig, sample_tokens
from diffusion_rl.sampling.flow import FlowSamplerConfig, sample_flow
from diffusion_rl.trace import FlowTrace, TokenTrace

# ------------------------------------------------------------------------------ real traces

VOCAB, MASK = 16, 1
TOKEN_CONFIG = TokenSamplerConfig(
    generation_length=8, block_size=4, steps_per_block=2, temperature=2.0
)


def _prompts(batch: int = 4, length: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (batch, length), generator=generator)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[: batch // 2, :2] = False  # left padding on half the rows
    return torch.where(mask, ids, 0), mask


def _token_trace(config: TokenSamplerConfig = TOKEN_CONFIG, stop: int | None = None, **kw):
    model = kw.pop("model", None) or tiny_model()
    ids, mask = _prompts()
    return sample_tokens(
        model, ids, mask, config, seeds=range(4), stop_token_id=stop, capture=True, **kw
    ).trace


def _stopping_token_trace() -> TokenTrace:
    """A trace in which row 0 stops after its first block (later slots never sampled) and
    another row goes on: the stop id is a token of row 0's first block that is not in every
    row's first block."""
    free = _token_trace()
    first_blocks = [set(row) for row in free.tokens[:, :4].tolist()]
    stop = next(t for t in free.tokens[0, :4].tolist() if not all(t in b for b in first_blocks))
    trace = _token_trace(stop=stop)
    assert bool((trace.commit_steps[0, 4:] == -1).all()), "row 0 should stop after block 0"
    assert bool((trace.commit_steps[:, 4:] >= 0).any()), "another row should sample block 1"
    return trace


TOKEN = _stopping_token_trace()
UNSAMPLED = (0, 6)  # row 0, slot 6: never sampled in TOKEN
SAMPLED = (1, 2)  # sampled in TOKEN, block 0
LATE = tuple(((TOKEN.commit_steps >= 0) & (torch.arange(8) >= 4)).nonzero()[0].tolist())  # block 1
assert int(TOKEN.commit_steps[UNSAMPLED]) == -1 and int(TOKEN.commit_steps[SAMPLED]) >= 0

FLOW_PROMPTS = ["3", "3", "7", "7"]


def _flow_trace(**overrides) -> FlowTrace:
    settings = dict(num_steps=5, guidance_scale=2.0, mode="sde", sde_window=(1, 3))
    config = FlowSamplerConfig(**{**settings, **overrides})
    return sample_flow(
        TinyVelocity(), FLOW_PROMPTS, config, seeds=range(4), capture=True, decode=False
    ).trace


FLOW = _flow_trace()  # steps 1, 2 are SDE; 0, 3, 4 ODE
FLOW_NO_CFG = _flow_trace(guidance_scale=1.0)
SDE_STEP, ODE_STEP = 1, 0
assert FLOW.sde_steps.tolist() == [False, True, True, False, False]


# ------------------------------------------------------------------------------ case tables

Case = tuple[str, Callable[[], object], str]  # (id, build, the field the message must name)
CASES: list[Case] = []


def case(case_id: str, field_name: str, build: Callable[[], object]) -> None:
    CASES.append((case_id, build, field_name))


def with_value(tensor: torch.Tensor, index, value) -> torch.Tensor:
    out = tensor.clone()
    out[index] = value
    return out


def tensor_kind_cases(
    owner: str, name: str, value: torch.Tensor, rebuild: Callable[[object], object]
) -> None:
    """Wrong kind, meta device, sparse layout, wrong rank and an empty batch for one field."""
    prefix = f"{owner}.{name}"
    case(f"{prefix}-list", prefix, lambda: rebuild(value.tolist()))
    case(f"{prefix}-none", prefix, lambda: rebuild(None))
    case(f"{prefix}-numpy", prefix, lambda: rebuild(value.numpy()))
    case(f"{prefix}-meta", prefix, lambda: rebuild(value.to("meta")))
    if value.dim() >= 1:
        case(f"{prefix}-sparse", prefix, lambda: rebuild(value.to_sparse()))
        case(f"{prefix}-rank-up", prefix, lambda: rebuild(value[..., None]))
        case(f"{prefix}-empty-rows", name, lambda: rebuild(value[:0]))
        case(f"{prefix}-one-row-short", name, lambda: rebuild(value[:-1]))
    if value.dim() >= 2:
        case(f"{prefix}-rank-down", prefix, lambda: rebuild(value[0]))
        case(f"{prefix}-one-column-short", name, lambda: rebuild(value[:, :-1]))


def dtype_cases(
    owner: str,
    name: str,
    value: torch.Tensor,
    dtypes: list[torch.dtype],
    rebuild: Callable[[object], object],
) -> None:
    for dtype in dtypes:
        label = str(dtype).removeprefix("torch.")
        case(
            f"{owner}.{name}-dtype-{label}", f"{owner}.{name}", lambda d=dtype: rebuild(value.to(d))
        )


def scalar_cases(owner: str, name: str, values: list, rebuild: Callable[[object], object]) -> None:
    for k, bad in enumerate(values):
        shown = re.sub(r"\W+", "_", repr(bad))[:24]
        case(f"{owner}.{name}-{k}-{shown}", f"{owner}.{name}", lambda b=bad: rebuild(b))


BAD_INTS = [-1, "3", 1.0, True, None, 2**63, 10**400]  # a non-negative int field


# ----------------------------------------------------------------- TokenTrace fields


def token(**changes) -> TokenTrace:
    return dataclasses.replace(TOKEN, **changes)


def token_field(name: str) -> Callable[[object], TokenTrace]:
    return lambda value: token(**{name: value})


INT_DTYPES_BAD = [torch.float32, torch.float64, torch.bool, torch.int16, torch.uint8]
for _name in ("prompt_ids", "prompt_mask", "tokens", "commit_steps", "behaviour_logprobs", "seeds"):
    tensor_kind_cases("TokenTrace", _name, getattr(TOKEN, _name), token_field(_name))
for _name in ("tokens", "commit_steps", "seeds"):
    dtype_cases(
        "TokenTrace",
        _name,
        getattr(TOKEN, _name),
        INT_DTYPES_BAD + [torch.int32],
        token_field(_name),
    )
dtype_cases("TokenTrace", "prompt_ids", TOKEN.prompt_ids, INT_DTYPES_BAD, token_field("prompt_ids"))
dtype_cases(
    "TokenTrace",
    "prompt_mask",
    TOKEN.prompt_mask,
    [torch.int64, torch.uint8, torch.float32],
    token_field("prompt_mask"),
)
dtype_cases(
    "TokenTrace",
    "behaviour_logprobs",
    TOKEN.behaviour_logprobs,
    [torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.bool],
    token_field("behaviour_logprobs"),
)

# values of the integer fields
for _value, _label in ((-1, "negative"), (-100, "very-negative")):
    case(
        f"TokenTrace.prompt_ids-{_label}",
        "TokenTrace.prompt_ids",
        lambda v=_value: token(prompt_ids=with_value(TOKEN.prompt_ids, (2, 1), v)),
    )
    case(
        f"TokenTrace.tokens-{_label}",
        "TokenTrace.tokens",
        lambda v=_value: token(tokens=with_value(TOKEN.tokens, SAMPLED, v)),
    )
case(
    "TokenTrace.tokens-negative-on-unsampled-slot",
    "TokenTrace.tokens",
    lambda: token(tokens=with_value(TOKEN.tokens, UNSAMPLED, -1)),
)
case(
    "TokenTrace.tokens-mask-id-on-sampled-slot",
    "TokenTrace.tokens",
    lambda: token(tokens=with_value(TOKEN.tokens, SAMPLED, MASK)),
)
_WITH_VOCAB = {**TOKEN.model_info, "vocab_size": VOCAB}
for _value, _label in ((VOCAB, "at-vocab"), (VOCAB + 7, "above-vocab"), (2**40, "huge")):
    case(
        f"TokenTrace.tokens-{_label}",
        "TokenTrace.tokens",
        lambda v=_value: token(tokens=with_value(TOKEN.tokens, SAMPLED, v), model_info=_WITH_VOCAB),
    )
    case(
        f"TokenTrace.prompt_ids-{_label}",
        "TokenTrace.prompt_ids",
        lambda v=_value: token(
            prompt_ids=with_value(TOKEN.prompt_ids, (3, 4), v), model_info=_WITH_VOCAB
        ),
    )
for _value, _label in (
    (-2, "below-sentinel"),
    (-(2**40), "very-negative"),
    (2, "after-its-block"),  # SAMPLED is slot 2: block 0, step ids [0, 2)
    (4, "two-blocks-later"),
    (10**6, "far-out-of-range"),
):
    case(
        f"TokenTrace.commit_steps-{_label}",
        "TokenTrace.commit_steps",
        lambda v=_value: token(commit_steps=with_value(TOKEN.commit_steps, SAMPLED, v)),
    )
case(
    "TokenTrace.commit_steps-before-its-block",
    "TokenTrace.commit_steps",
    lambda: token(commit_steps=with_value(TOKEN.commit_steps, LATE, 0)),
)

# values of the behaviour log-probs
for _value, _label in (
    (float("nan"), "nan"),
    (float("inf"), "pos-inf"),
    (float("-inf"), "neg-inf"),
    (0.31, "positive"),
    (1e-6, "tiny-positive"),
    (3.4e38, "huge-positive"),
):
    case(
        f"TokenTrace.behaviour_logprobs-{_label}",
        "TokenTrace.behaviour_logprobs",
        lambda v=_value: token(behaviour_logprobs=with_value(TOKEN.behaviour_logprobs, SAMPLED, v)),
    )
for _value, _label in ((-0.5, "negative"), (float("nan"), "nan")):
    case(
        f"TokenTrace.behaviour_logprobs-{_label}-on-unsampled",
        "TokenTrace.behaviour_logprobs",
        lambda v=_value: token(
            behaviour_logprobs=with_value(TOKEN.behaviour_logprobs, UNSAMPLED, v)
        ),
    )

# settings and scalars
scalar_cases(
    "TokenTrace", "weights_version", BAD_INTS + [np.int64(2), 2.5], token_field("weights_version")
)
scalar_cases(
    "TokenTrace", "stop_token_id", [-1, "2", 2.0, True, 2**63], token_field("stop_token_id")
)
case(
    "TokenTrace.stop_token_id-at-vocab",
    "TokenTrace.stop_token_id",
    lambda: token(stop_token_id=VOCAB, model_info=_WITH_VOCAB),
)
scalar_cases(
    "TokenTrace",
    "sampler",
    [None, [("temperature", 1.0)], "fixed", {1: 1.0}],
    token_field("sampler"),
)
case(
    "TokenTrace.sampler-missing-temperature",
    "TokenTrace.sampler",
    lambda: token(sampler={k: v for k, v in TOKEN.sampler.items() if k != "temperature"}),
)
for _value in (float("nan"), float("inf"), -0.5, "1.0", True, None, 10**400):
    case(
        f"TokenTrace.sampler-temperature-{_value!r:.12}",
        "TokenTrace.sampler['temperature']",
        lambda v=_value: token(sampler={**TOKEN.sampler, "temperature": v}),
    )
case(
    "TokenTrace.sampler-generation_length-mismatch",
    "generation_length",
    lambda: token(sampler={**TOKEN.sampler, "generation_length": 9}),
)
for _key, _value in (
    ("block_size", 0),
    ("block_size", -4),
    ("block_size", "4"),
    ("block_size", True),
    ("steps_per_block", 0),
    ("steps_per_block", 2.0),
    ("schedule", "bogus"),
    ("schedule", 3),
):
    case(
        f"TokenTrace.sampler-{_key}-{_value!r}",
        f"TokenTrace.sampler[{_key!r}]",
        lambda k=_key, v=_value: token(sampler={**TOKEN.sampler, k: v}),
    )
scalar_cases(
    "TokenTrace",
    "kernel_ids",
    [
        None,
        ["token_logprobs"],
        {},
        {"token_logprobs": 1},
        {3: "x", "token_logprobs": "token_logprobs/reference@1"},
    ],
    token_field("kernel_ids"),
)
case(
    "TokenTrace.kernel_ids-missing-token_logprobs",
    "TokenTrace.kernel_ids",
    lambda: token(kernel_ids={"token_sample_step": TOKEN.kernel_ids["token_sample_step"]}),
)
scalar_cases("TokenTrace", "model_info", [None, [], {1: 2}], token_field("model_info"))
for _key, _value in (
    ("mask_token_id", -1),
    ("mask_token_id", "1"),
    ("mask_token_id", True),
    ("vocab_size", 0),
    ("vocab_size", "16"),
    ("vocab_size", 2.0),
):
    case(
        f"TokenTrace.model_info-{_key}-{_value!r}",
        f"TokenTrace.model_info[{_key!r}]",
        lambda k=_key, v=_value: token(model_info={**TOKEN.model_info, k: v}),
    )
case(
    "TokenTrace.model_info-mask-id-at-vocab",
    "TokenTrace.model_info['mask_token_id']",
    lambda: token(model_info={**TOKEN.model_info, "mask_token_id": VOCAB, "vocab_size": VOCAB}),
)


# ----------------------------------------------------------------- FlowTrace fields


def flow(base: FlowTrace = FLOW, **changes) -> FlowTrace:
    return dataclasses.replace(base, **changes)


def flow_field(name: str) -> Callable[[object], FlowTrace]:
    return lambda value: flow(**{name: value})


for _name in ("latents", "sigmas", "sde_steps", "behaviour_logprobs", "seeds", "forward_groups"):
    tensor_kind_cases("FlowTrace", _name, getattr(FLOW, _name), flow_field(_name))
dtype_cases(
    "FlowTrace",
    "latents",
    FLOW.latents,
    [torch.int64, torch.bool, torch.bfloat16],
    flow_field("latents"),
)
dtype_cases(
    "FlowTrace",
    "sigmas",
    FLOW.sigmas,
    [torch.float64, torch.bfloat16, torch.int64],
    flow_field("sigmas"),
)
dtype_cases(
    "FlowTrace",
    "sde_steps",
    FLOW.sde_steps,
    [torch.int64, torch.uint8, torch.float32],
    flow_field("sde_steps"),
)
dtype_cases(
    "FlowTrace",
    "behaviour_logprobs",
    FLOW.behaviour_logprobs,
    [torch.float64, torch.float16, torch.int64],
    flow_field("behaviour_logprobs"),
)
for _name in ("seeds", "forward_groups"):
    dtype_cases(
        "FlowTrace",
        _name,
        getattr(FLOW, _name),
        [torch.float32, torch.int32, torch.bool],
        flow_field(_name),
    )

for _value, _label in (
    (float("nan"), "nan"),
    (float("inf"), "pos-inf"),
    (float("-inf"), "neg-inf"),
):
    case(
        f"FlowTrace.latents-{_label}",
        "FlowTrace.latents",
        lambda v=_value: flow(latents=with_value(FLOW.latents, (2, 3, 0, 1, 1), v)),
    )
    case(
        f"FlowTrace.latents-{_label}-final",
        "FlowTrace.latents",
        lambda v=_value: flow(latents=with_value(FLOW.latents, (0, -1, 2, 7, 7), v)),
    )
    case(
        f"FlowTrace.behaviour_logprobs-{_label}",
        "FlowTrace.behaviour_logprobs",
        lambda v=_value: flow(
            behaviour_logprobs=with_value(FLOW.behaviour_logprobs, (1, SDE_STEP), v)
        ),
    )
    case(
        f"FlowTrace.sigmas-{_label}",
        "FlowTrace.sigmas",
        lambda v=_value: flow(sigmas=with_value(FLOW.sigmas, 2, v)),
    )
case(
    "FlowTrace.behaviour_logprobs-nonzero-on-ode-step",
    "FlowTrace.behaviour_logprobs",
    lambda: flow(behaviour_logprobs=with_value(FLOW.behaviour_logprobs, (0, ODE_STEP), -1.5)),
)
case(
    "FlowTrace.behaviour_logprobs-nonzero-on-last-step",
    "FlowTrace.behaviour_logprobs",
    lambda: flow(behaviour_logprobs=with_value(FLOW.behaviour_logprobs, (3, 4), 2.0)),
)
for _label, _make in (
    ("increasing", lambda s: s.flip(0)),
    ("plateau", lambda s: with_value(s, 2, float(s[1]))),
    ("bump", lambda s: with_value(s, 3, float(s[1]) + 0.01)),
    ("not-ending-at-zero", lambda s: with_value(s, -1, 0.01)),
    ("ending-negative", lambda s: with_value(s, -1, -0.1)),
    ("starting-below-one", lambda s: s * 0.5),
    ("starting-above-one", lambda s: with_value(s, 0, 1.5)),
    ("all-zero", lambda s: torch.zeros_like(s)),
    ("single-entry", lambda s: s[:1]),
    ("too-long", lambda s: torch.cat([s[:1] * 0 + 1.0, s])),
):
    case(
        f"FlowTrace.sigmas-{_label}",
        "FlowTrace.sigmas",
        lambda m=_make: flow(sigmas=m(FLOW.sigmas)),
    )
case(
    "FlowTrace.sde_steps-last-step-sde",
    "FlowTrace.sde_steps",
    lambda: flow(sde_steps=with_value(FLOW.sde_steps, -1, True)),
)
case(
    "FlowTrace.forward_groups-negative",
    "FlowTrace.forward_groups",
    lambda: flow(forward_groups=with_value(FLOW.forward_groups, 2, -1)),
)
case(
    "FlowTrace.latents-rank-2",
    "FlowTrace.latents",
    lambda: flow(latents=FLOW.latents[:, :, 0, 0, 0]),
)
case(
    "FlowTrace.latents-one-step-short",
    "FlowTrace.latents",
    lambda: flow(latents=FLOW.latents[:, :-1]),
)
case(
    "FlowTrace.latents-dtype-vs-sampler",
    "FlowTrace.latents",
    lambda: flow(latents=FLOW.latents.double()),
)
case(
    "FlowTrace.latents-shape-vs-sampler",
    "FlowTrace.latents",
    lambda: flow(latents=FLOW.latents[..., :4]),
)

# conditioning
_LABEL = FLOW.cond["label"]
for _name in ("cond", "uncond"):
    _good = getattr(FLOW, _name)
    _field = f"FlowTrace.{_name}"
    for _label, _bad in (
        ("list", [_good["label"]]),
        ("empty", {}),
        ("tensor-not-dict", _good["label"]),
        ("non-str-key", {0: _good["label"]}),
        ("non-tensor-value", {"label": _good["label"].tolist()}),
        ("scalar-value", {"label": _good["label"][0]}),
        ("wrong-rows", {"label": _good["label"][:3]}),
        ("meta-value", {"label": _good["label"].to("meta")}),
        ("sparse-value", {"label": _good["label"].to_sparse()}),
        ("nan-embedding", {**_good, "emb": with_value(torch.zeros(4, 2), (1, 1), float("nan"))}),
        ("inf-embedding", {**_good, "emb": with_value(torch.zeros(4, 2), (3, 0), float("inf"))}),
    ):
        case(f"{_field}-{_label}", _field, lambda n=_name, b=_bad: flow(**{n: b}))
case("FlowTrace.uncond-missing-with-guidance", "FlowTrace.uncond", lambda: flow(uncond=None))
case(
    "FlowTrace.uncond-given-without-guidance",
    "FlowTrace.uncond",
    lambda: flow(FLOW_NO_CFG, uncond=FLOW.uncond),
)

scalar_cases(
    "FlowTrace", "prompts", ["3377", ["3", "3", "7"], None, torch.zeros(4)], flow_field("prompts")
)
case("FlowTrace.prompts-non-str", "FlowTrace.prompts[2]", lambda: flow(prompts=["3", "3", 7, "7"]))
scalar_cases("FlowTrace", "weights_version", BAD_INTS, flow_field("weights_version"))
scalar_cases("FlowTrace", "sampler", [None, ["guidance_scale"], {2: 1.0}], flow_field("sampler"))
case(
    "FlowTrace.sampler-missing-guidance",
    "FlowTrace.sampler",
    lambda: flow(sampler={k: v for k, v in FLOW.sampler.items() if k != "guidance_scale"}),
)
for _value in (float("nan"), float("inf"), -1.0, "2.0", True, 10**400):
    case(
        f"FlowTrace.sampler-guidance-{_value!r:.12}",
        "FlowTrace.sampler['guidance_scale']",
        lambda v=_value: flow(sampler={**FLOW.sampler, "guidance_scale": v}),
    )
case(
    "FlowTrace.sampler-num_steps-mismatch",
    "num_steps",
    lambda: flow(sampler={**FLOW.sampler, "num_steps": 6}),
)
case(
    "FlowTrace.sampler-latent_shape-mismatch",
    "latent_shape",
    lambda: flow(sampler={**FLOW.sampler, "latent_shape": [3, 4, 4]}),
)
case(
    "FlowTrace.sampler-latent_dtype-mismatch",
    "latent_dtype",
    lambda: flow(sampler={**FLOW.sampler, "latent_dtype": "bfloat16"}),
)
scalar_cases(
    "FlowTrace",
    "kernel_ids",
    [None, {}, {"flow_ode_step": 3}, ["flow_ode_step"]],
    flow_field("kernel_ids"),
)
case(
    "FlowTrace.kernel_ids-missing-sde",
    "FlowTrace.kernel_ids",
    lambda: flow(kernel_ids={"flow_ode_step": FLOW.kernel_ids["flow_ode_step"]}),
)
scalar_cases("FlowTrace", "model_info", [None, ["class"], {1: "x"}], flow_field("model_info"))


# ----------------------------------------------------------------- contracts

B, L, V = 3, 4, 5
TARGETS = torch.arange(B * L).reshape(B, L) % V
WEIGHTS = torch.ones(B, L)
INPUTS = {"ids": torch.zeros(B, L, dtype=torch.long)}


def token_batch(**changes) -> DiffusionTokenBatch:
    kwargs = {"model_inputs": INPUTS, "target_ids": TARGETS, "loss_weights": WEIGHTS, **changes}
    return DiffusionTokenBatch(**kwargs)


TB = "DiffusionTokenBatch"
tensor_kind_cases(TB, "target_ids", TARGETS, lambda v: token_batch(target_ids=v))
tensor_kind_cases(TB, "loss_weights", WEIGHTS, lambda v: token_batch(loss_weights=v))
dtype_cases(
    TB,
    "target_ids",
    TARGETS,
    [torch.uint8, torch.int8, torch.int16, torch.int32, torch.float32, torch.bool],
    lambda v: token_batch(target_ids=v),
)
case(
    f"{TB}.loss_weights-nan",
    f"{TB}.loss_weights",
    lambda: token_batch(loss_weights=with_value(WEIGHTS, (1, 1), float("nan"))),
)
case(
    f"{TB}.loss_weights-negative",
    f"{TB}.loss_weights",
    lambda: token_batch(loss_weights=with_value(WEIGHTS, (1, 1), -1.0)),
)
case(
    f"{TB}.target_ids-negative-active",
    f"{TB}.target_ids",
    lambda: token_batch(target_ids=with_value(TARGETS, (2, 0), -1)),
)
_cyclic: dict = {"ids": torch.zeros(B)}
_cyclic["self"] = _cyclic
_deep_cycle: dict = {"a": {"b": {}}}
_deep_cycle["a"]["b"]["back"] = _deep_cycle["a"]
_cyclic_list: list = [torch.zeros(B)]
_cyclic_list.append(_cyclic_list)
for _label, _inputs, _field in (
    ("self-referencing-dict", _cyclic, f"{TB}.model_inputs.self"),
    ("self-referencing-nested-dict", _deep_cycle, f"{TB}.model_inputs.a.b.back"),
    ("self-referencing-list", {"ids": torch.zeros(B), "xs": _cyclic_list}, f"{TB}.model_inputs.xs"),
    ("empty", {}, f"{TB}.model_inputs"),
    ("only-empty-mappings", {"a": {}, "b": {"c": {}}}, f"{TB}.model_inputs"),
    ("meta-leaf", {"ids": torch.zeros(B, L).to("meta")}, f"{TB}.model_inputs.ids"),
    ("sparse-leaf", {"ids": torch.eye(B).to_sparse()}, f"{TB}.model_inputs.ids"),
    ("list-leaf", {"ids": [0, 1, 2]}, f"{TB}.model_inputs.ids"),
    ("scalar-leaf", {"ids": torch.tensor(1.0)}, f"{TB}.model_inputs.ids"),
    ("wrong-rows-leaf", {"ids": torch.zeros(B + 1)}, f"{TB}.model_inputs.ids"),
    ("not-a-mapping", [torch.zeros(B)], f"{TB}.model_inputs"),
):
    case(f"{TB}.model_inputs-{_label}", _field, lambda x=_inputs: token_batch(model_inputs=x))

TEACHER = torch.randn(B, L, V)
DB = "DiffusionDistillationBatch"
for _label, _bad in (
    ("meta", TEACHER.to("meta")),
    ("sparse", TEACHER.to_sparse()),
    ("list", TEACHER.tolist()),
    ("int", TEACHER.long()),
    ("rank-2", TEACHER[..., 0]),
    ("wrong-length", TEACHER[:, :-1]),
):
    case(
        f"{DB}.teacher_logits-{_label}",
        f"{DB}.teacher_logits",
        lambda x=_bad: DiffusionDistillationBatch(token_batch(), x),
    )
case(
    f"{DB}.student_batch-dict",
    f"{DB}.student_batch",
    lambda: DiffusionDistillationBatch({"target_ids": TARGETS}, TEACHER),
)
for _label, _bad in (("meta", TEACHER.to("meta")), ("sparse", TEACHER.to_sparse())):
    case(f"logits-{_label}", "logits", lambda x=_bad: validate_diffusion_logits(token_batch(), x))

ROWS = 2
STEP_FIELDS = dict(
    step=1,
    rows=torch.arange(ROWS),
    latents=torch.zeros(ROWS, 3, 2, 2),
    next_latents=torch.zeros(ROWS, 3, 2, 2),
    sigma=torch.full((ROWS,), 0.8),
    sigma_next=torch.full((ROWS,), 0.6),
    cond={"label": torch.zeros(ROWS, dtype=torch.long)},
    uncond={"label": torch.full((ROWS,), 10)},
    behaviour_logprobs=torch.zeros(ROWS),
    advantages=torch.ones(ROWS),
    weights=torch.ones(ROWS),
    old_logprobs=torch.zeros(ROWS),
    ref_means=torch.zeros(ROWS, 3, 2, 2),
)


def step_batch(**changes) -> FlowStepBatch:
    return FlowStepBatch(**{**STEP_FIELDS, **changes})


FS = "FlowStepBatch"
scalar_cases(FS, "step", [-1, True, 1.0, "1", None], lambda v: step_batch(step=v))
for _name in (
    "rows",
    "latents",
    "next_latents",
    "sigma",
    "sigma_next",
    "behaviour_logprobs",
    "advantages",
    "weights",
    "old_logprobs",
    "ref_means",
):
    _good = STEP_FIELDS[_name]
    _rebuild = lambda v, n=_name: step_batch(**{n: v})  # noqa: E731
    for _label, _bad in (
        ("meta", _good.to("meta")),
        ("sparse", _good.to_sparse()),
        ("list", _good.tolist()),
        ("wrong-rows", _good[:1]),
        ("bool", _good.bool()),
    ):
        case(f"{FS}.{_name}-{_label}", f"{FS}.{_name}", lambda b=_bad, r=_rebuild: r(b))
case(f"{FS}.rows-float", f"{FS}.rows", lambda: step_batch(rows=torch.arange(ROWS).float()))
case(f"{FS}.rows-2d", f"{FS}.rows", lambda: step_batch(rows=torch.arange(ROWS)[:, None]))
case(
    f"{FS}.next_latents-other-shape",
    f"{FS}.next_latents",
    lambda: step_batch(next_latents=torch.zeros(ROWS, 3, 2, 1)),
)
case(
    f"{FS}.ref_means-other-shape",
    f"{FS}.ref_means",
    lambda: step_batch(ref_means=torch.zeros(ROWS, 3, 4)),
)
case(f"{FS}.sigma-2d", f"{FS}.sigma", lambda: step_batch(sigma=torch.ones(ROWS, 1)))
for _name in ("cond", "uncond"):
    for _label, _bad in (
        ("empty", {}),
        ("meta", {"label": torch.zeros(ROWS).to("meta")}),
        ("wrong-rows", {"label": torch.zeros(ROWS + 1)}),
        ("list", [torch.zeros(ROWS)]),
    ):
        case(
            f"{FS}.{_name}-{_label}", f"{FS}.{_name}", lambda n=_name, b=_bad: step_batch(**{n: b})
        )

WM = "WeightedMetric"
for _name in ("sum", "denominator"):
    for _label, _bad in (
        ("float-overflow-literal", 1e400),
        ("int-overflow", 10**400),
        ("negative-int-overflow", -(10**400)),
        ("nan-number", float("nan")),
        ("meta", torch.tensor(1.0).to("meta")),
        ("sparse", torch.ones(1, 1).to_sparse()),
    ):
        case(
            f"{WM}.{_name}-{_label}",
            f"{WM}.{_name}",
            lambda n=_name, b=_bad: WeightedMetric(**{"sum": 1.0, "denominator": 2.0, n: b}),
        )
for _name in ("eps", "min_denom"):
    for _label, _bad in (("int-overflow", 10**400), ("float-overflow", 1e400), ("nan", math.nan)):
        case(
            f"{WM}.{_name}-{_label}",
            f"{WM}.{_name}",
            lambda n=_name, b=_bad: WeightedMetric(1.0, 2.0, **{n: b}),
        )
for _label, _bad in (
    ("int-overflow", 10**400),
    ("meta", torch.tensor(1.0).to("meta")),
    ("sparse", torch.ones(1).to_sparse()),
    ("vector", torch.ones(2)),
    ("str", "1.0"),
):
    case(f"Extreme.value-{_label}", "Extreme.value", lambda b=_bad: Extreme(b))
case("Extreme.kind-mean", "Extreme.kind", lambda: Extreme(1.0, "mean"))
_METRIC = WeightedMetric(1.0, 2.0)
for _label, _aux, _field in (
    ("int-overflow", {"n": 10**400}, "LossOutput.aux_metrics['n']"),
    ("meta", {"n": torch.tensor(1.0).to("meta")}, "LossOutput.aux_metrics['n']"),
    ("sparse", {"n": torch.ones(1).to_sparse()}, "LossOutput.aux_metrics['n']"),
    ("non-str-key", {3: 1.0}, "LossOutput.aux_metrics"),
    ("bool", {"n": True}, "LossOutput.aux_metrics['n']"),
):
    case(f"LossOutput.aux_metrics-{_label}", _field, lambda a=_aux: LossOutput(_METRIC, a))

_ids = [c[0] for c in CASES]
assert len(_ids) == len(set(_ids)), sorted({i for i in _ids if _ids.count(i) > 1})


_PARAMS = [pytest.param(*c[1:], id=c[0]) for c in CASES]


@pytest.mark.parametrize(("build", "field_name"), _PARAMS)
def test_malformed_input_is_refused_naming_the_field(build, field_name):
    with pytest.raises((TypeError, ValueError)) as info:
        build()
    assert field_name in str(info.value), f"{field_name!r} not named in: {info.value}"


# ------------------------------------------------------------------------------ messages


def test_token_error_names_value_position_and_fix():
    bad = with_value(TOKEN.behaviour_logprobs, SAMPLED, 0.31)
    with pytest.raises(ValueError) as info:
        token(behaviour_logprobs=bad)
    message = str(info.value)
    assert message.startswith("TokenTrace.behaviour_logprobs: must be <= 0")
    assert "found 0.31 at row 1, slot 2" in message
    assert "log softmax" in message  # the fix


def test_commit_step_error_states_the_block_window():
    stride = TOKEN_CONFIG.steps_per_block  # fixed schedule: step ids block * 2 + {0, 1}
    row, slot = LATE  # a slot of block 1: step ids [2, 4)
    bad = with_value(TOKEN.commit_steps, LATE, 0)
    with pytest.raises(ValueError, match=re.escape(f"slot {slot} lies in block 1")) as info:
        token(commit_steps=bad)
    assert f"[{stride}, {2 * stride})" in str(info.value)
    assert f"found 0 at row {row}, slot {slot}" in str(info.value)


def test_flow_sigma_error_points_at_the_entry():
    bad = with_value(FLOW.sigmas, 3, float(FLOW.sigmas[1]) + 0.01)
    with pytest.raises(ValueError, match=r"FlowTrace\.sigmas: must be strictly decreasing") as info:
        flow(sigmas=bad)
    assert "at entry 3" in str(info.value)


def test_int8_targets_refused_naming_int64():
    with pytest.raises(
        TypeError,
        match=r"target_ids: expected int64 \(torch.long\) ids, got "
        r"torch.int8",
    ):
        token_batch(target_ids=TARGETS.to(torch.int8))


def test_self_reference_is_a_value_error_not_recursion():
    with pytest.raises(ValueError, match="self-referencing"):
        token_batch(model_inputs=_cyclic)


def test_overflowing_int_names_field_and_size():
    with pytest.raises(ValueError, match=r"WeightedMetric\.sum: an int of 1329 bits"):
        WeightedMetric(10**400, 1.0)


# ------------------------------------------------------------------------------ valid inputs


def test_the_bases_of_the_fuzz_cases_are_valid():
    """Each malformed case differs from these in one field; they themselves construct."""
    for trace in (TOKEN, FLOW, FLOW_NO_CFG):
        dataclasses.replace(trace)  # rebuilt through validation
    token(model_info=_WITH_VOCAB)
    token_batch()
    DiffusionDistillationBatch(token_batch(), TEACHER)
    step_batch()
    step_batch(uncond=None, ref_means=None, advantages=None, weights=None, old_logprobs=None)
    WeightedMetric(1.0, 2.0, eps=1e-8, min_denom=0.5)
    Extreme(torch.tensor(float("inf")), "max")  # a tensor extreme may be inf (a diagnostic)
    LossOutput(_METRIC, {"n": 3, "t": torch.tensor(0.5)})


def test_nan_tensor_sum_is_kept_for_the_trainer_to_skip():
    metric = WeightedMetric(torch.tensor(float("nan")), torch.tensor(2.0))
    assert math.isnan(float(metric.value))


@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=0.0),
        dict(temperature=1.0),
        dict(temperature=0.7, confidence="margin"),
        dict(temperature=1.3, confidence="neg_entropy", steps_per_block=4),
        dict(temperature=1.0, schedule="threshold", threshold=0.3),
        dict(temperature=0.5, generation_length=7, block_size=3, steps_per_block=3),
        dict(temperature=1.0, use_cache=False),
        dict(temperature=1.0, stop_at_eos=False),
    ],
    ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()),
)
@pytest.mark.parametrize("attention", ["block_causal", "bidirectional"])
def test_real_token_traces_pass_validation(settings, attention):
    block = settings.get("block_size", 4)
    model = tiny_model(attention, block=block)
    config = TokenSamplerConfig(**{"generation_length": 8, "block_size": 4, **settings})
    free = _token_trace(config, model=model)
    trace = _token_trace(config, stop=int(free.tokens[0, 0]), model=model, weights_version=7)
    assert float(trace.behaviour_logprobs.max()) <= 0  # the sampler's log-probs are <= 0
    assert bool((trace.behaviour_logprobs[~trace.sampled] == 0).all())
    # what the system derives from a trace passes too: rows (also none), concat, prepare
    parts = [trace.rows(slice(0, 1)), trace.rows(torch.tensor([3, 1])), trace.rows([])]
    joined = TokenTrace.concat(parts)
    assert torch.equal(joined.tokens, trace.tokens[[0, 3, 1]])
    batch = trace.prepare(0.5, advantages=torch.randn(len(trace)))
    assert torch.equal(batch.target_ids[trace.sampled], trace.tokens[trace.sampled])


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),
        dict(sde_window=None),
        dict(mode="ode"),
        dict(guidance_scale=1.0),
        dict(latent_dtype="bfloat16"),
        dict(sigma_schedule="sd3", shift=3.0),
        dict(sigma_schedule="sd3", shift=1.7, num_steps=9),
        dict(micro_batch_size=3, variant="cps", noise_level=0.5),
        dict(variant="constant", reduction="sum"),
        dict(num_steps=2, sde_window=(0, 1)),
    ],
    ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "default",
)
def test_real_flow_traces_pass_validation(overrides):
    if overrides.get("latent_dtype") == "bfloat16":  # a bf16 rollout runs under autocast
        with torch.autocast("cpu", dtype=torch.bfloat16):
            trace = _flow_trace(**overrides)
        assert trace.latents.dtype == torch.bfloat16
    else:
        trace = _flow_trace(**overrides)
    if bool(trace.sde_steps.any()):  # a density: flow log-probs may be positive
        assert bool(torch.isfinite(trace.behaviour_logprobs).all())
    joined = FlowTrace.concat([trace.rows(slice(0, 2)), trace.rows(torch.tensor([3, 2]))])
    assert torch.equal(joined.latents, trace.latents[[0, 1, 3, 2]])
    assert len(trace.rows([])) == 0
    trace.to("cpu")
    steps = trace.sde_step_indices()
    batches = trace.prepare(steps, advantages=torch.randn(4), weights=torch.ones(4))
    assert len(batches) == len(trace.group_rows()) * len(steps)


def test_huge_finite_values_are_not_mistaken_for_inf():
    """Finiteness is checked by one sum first; a sum that overflows on finite values falls
    back to the element check and passes."""
    latents = with_value(FLOW.latents, (0, 1, 0, 0, 0), 3e38)
    latents[1, 2, 0, 0, 0] = 3e38
    assert not bool(torch.isfinite(latents.sum()))
    assert torch.equal(flow(latents=latents).latents, latents)
    logprobs = with_value(TOKEN.behaviour_logprobs, SAMPLED, -3e38)
    logprobs[3, 0] = -3e38
    assert torch.equal(token(behaviour_logprobs=logprobs).behaviour_logprobs, logprobs)
    weights = torch.zeros((B, L))
    weights[0, 0] = 3e38  # one huge finite weight passes
    assert token_batch(loss_weights=weights).loss_weights is weights
    # weights whose sum (the losses' denominator) overflows float32 are refused by name, not
    # later as an internal WeightedMetric.denominator
    with pytest.raises(ValueError, match=r"^DiffusionTokenBatch\.loss_weights: the weights sum"):
        token_batch(loss_weights=torch.full((B, L), 3e38))
    with pytest.raises(ValueError, match=r"FlowTrace\.latents: must be finite, found nan"):
        flow(latents=with_value(latents, (3, 0, 0, 0, 0), float("nan")))


# ----------------------------------------------------------------------------- gaps an audit found
def test_a_trace_of_no_rows_is_refused_when_prepared():
    """rows([]) is a valid part (for concat), but preparing it used to fail later, in replay,
    on a micro_batch_size the caller never set."""
    with pytest.raises(ValueError, match=r"^TokenTrace\.prepare: the trace has no rows"):
        TOKEN.rows([]).prepare()
    with pytest.raises(ValueError, match=r"^FlowTrace\.prepare: the trace has no rows"):
        FLOW.rows([]).prepare(FLOW.sde_step_indices())


@pytest.mark.parametrize("weight", [float("inf"), float("nan"), -1.0])
def test_post_stop_weight_is_named_not_loss_weights(weight):
    with pytest.raises(ValueError, match=r"^post_stop_weight: expected a finite value >= 0"):
        TOKEN.prepare(weight)
    with pytest.raises(TypeError, match=r"^post_stop_weight: expected a number >= 0, got str"):
        TOKEN.prepare("1")
