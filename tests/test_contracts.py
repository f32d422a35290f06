"""Tests for :mod:`diffusion_rl.contracts` (validation rules, batch behaviour, MATH.md §2)."""

from __future__ import annotations

import dataclasses
import math
import re
import types

import pytest
import torch
from torch.utils import _pytree as pytree

from diffusion_rl.contracts import (
    DiffusionTokenBatch,
    LossOutput,
    WeightedMetric,
    validate_diffusion_logits,
    validate_target_aligned_logits,
)

B, L, V = 3, 4, 5
TB = "DiffusionTokenBatch"


def _targets(b: int = B, length: int = L) -> torch.Tensor:
    return torch.arange(b * length, dtype=torch.long).reshape(b, length) % V


def _weights(b: int = B, length: int = L) -> torch.Tensor:
    return torch.ones(b, length)


def _inputs(b: int = B, length: int = L) -> dict:
    return {
        "input_ids": torch.arange(b * length).reshape(b, length),
        "extra": {"mask": torch.ones(b, length, dtype=torch.bool), "t": torch.rand(b)},
    }


def _batch(b: int = B, length: int = L, **overrides) -> DiffusionTokenBatch:
    kwargs = {
        "model_inputs": _inputs(b, length),
        "target_ids": _targets(b, length),
        "loss_weights": _weights(b, length),
    }
    kwargs.update(overrides)
    return DiffusionTokenBatch(**kwargs)


def _leaves(batch: DiffusionTokenBatch) -> list[torch.Tensor]:
    return pytree.tree_flatten(batch)[0]


def _assert_batches_equal(a: DiffusionTokenBatch, b: DiffusionTokenBatch) -> None:
    leaves_a, spec_a = pytree.tree_flatten(a)
    leaves_b, spec_b = pytree.tree_flatten(b)
    assert spec_a == spec_b
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b):
        assert x.dtype == y.dtype
        assert torch.equal(x, y)


# ===================================================================== target_ids rules


def test_target_ids_not_a_tensor():
    with pytest.raises(
        TypeError, match=re.escape(f"{TB}.target_ids: expected a torch.Tensor, got list")
    ):
        _batch(target_ids=[[0, 1, 2, 3]] * B)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bool, torch.complex64])
def test_target_ids_non_integer_dtype(dtype):
    with pytest.raises(
        TypeError,
        match=re.escape(f"{TB}.target_ids: expected an integer dtype, got {dtype}"),
    ):
        _batch(target_ids=torch.zeros(B, L, dtype=dtype))


def test_target_ids_int64_accepted():
    batch = _batch(target_ids=torch.zeros(B, L, dtype=torch.int64))
    assert batch.target_ids.dtype == torch.int64


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32])
def test_target_ids_narrow_integer_dtypes_refused(dtype):
    """The kernels gather with the ids: int64 only (uint8 ids would fail inside ``gather``)."""
    with pytest.raises(
        TypeError,
        match=re.escape(
            f"{TB}.target_ids: expected int64 (torch.long) ids, got {dtype}; the kernels gather "
            "with int64 indices: convert with .long()"
        ),
    ):
        _batch(target_ids=torch.zeros(B, L, dtype=dtype))


@pytest.mark.parametrize("shape", [(B * L,), (B, L, 1), ()])
def test_target_ids_wrong_rank(shape):
    targets = torch.zeros(shape, dtype=torch.long)
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"{TB}.target_ids: expected rank 2 [B, L], got rank {len(shape)} shape {shape}"
        ),
    ):
        _batch(target_ids=targets)


def test_active_negative_target_rejected():
    targets = _targets()
    targets[1, 2] = -1
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"{TB}.target_ids: active slots (loss_weights != 0) need ids >= 0, got minimum -1; "
            "put sentinels only on inactive slots"
        ),
    ):
        _batch(target_ids=targets)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bool, torch.int64])
def test_inactive_sentinel_targets_accepted(weight_dtype):
    targets = _targets()
    weights = torch.ones(B, L, dtype=weight_dtype)
    targets[:, -2:] = -1
    weights[:, -2:] = 0
    batch = _batch(target_ids=targets, loss_weights=weights)
    assert torch.equal(batch.target_ids, targets)
    assert not bool(batch.active[:, -2:].any())


# ===================================================================== loss_weights rules


def test_loss_weights_not_a_tensor():
    with pytest.raises(
        TypeError, match=re.escape(f"{TB}.loss_weights: expected a torch.Tensor, got list")
    ):
        _batch(loss_weights=[[1.0] * L] * B)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_loss_weights_bad_dtype(dtype):
    with pytest.raises(
        TypeError,
        match=re.escape(
            f"{TB}.loss_weights: expected a bool, integer or floating dtype, got {dtype}"
        ),
    ):
        _batch(loss_weights=torch.ones(B, L, dtype=dtype))


@pytest.mark.parametrize("shape", [(B, L + 1), (B + 1, L), (B * L,), (B, L, 1)])
def test_loss_weights_shape_mismatch(shape):
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"{TB}.loss_weights: expected the shape of target_ids {(B, L)}, got {shape}"
        ),
    ):
        _batch(loss_weights=torch.ones(shape))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_loss_weights_non_finite(bad):
    weights = _weights()
    weights[2, 1] = bad
    with pytest.raises(
        ValueError,
        match=re.escape(f"{TB}.loss_weights: expected finite values, got NaN/inf"),
    ):
        _batch(loss_weights=weights)


@pytest.mark.parametrize(
    ("weights", "minimum"),
    [
        (torch.tensor([[1.0, -0.5, 0.0, 1.0]] * B), "-0.5"),
        (torch.tensor([[1, -1, 0, 1]] * B, dtype=torch.int64), "-1"),
        (torch.tensor([[1, -3, 0, 1]] * B, dtype=torch.int8), "-3"),
    ],
)
def test_loss_weights_negative(weights, minimum):
    with pytest.raises(
        ValueError,
        match=re.escape(f"{TB}.loss_weights: expected values >= 0, got minimum {minimum}"),
    ):
        _batch(loss_weights=weights)


def test_fractional_weights_accepted():
    weights = torch.tensor([[0.25, 0.0, 1.5, 1e-6]] * B, dtype=torch.float64)
    batch = _batch(loss_weights=weights)
    assert torch.equal(batch.loss_weights, weights)
    assert torch.equal(batch.active, torch.tensor([[True, False, True, True]] * B))


@pytest.mark.parametrize(
    "dtype", [torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64, torch.bfloat16]
)
def test_bool_int_and_low_precision_weights_accepted(dtype):
    weights = torch.tensor([[1, 0, 1, 0]] * B).to(dtype)
    batch = _batch(loss_weights=weights)
    assert batch.loss_weights.dtype == dtype
    assert torch.equal(batch.active, torch.tensor([[True, False, True, False]] * B))


def test_active_property():
    weights = torch.tensor([[0.0, 2.0, 0.0, 0.5], [0.0] * L, [1.0] * L])
    batch = _batch(loss_weights=weights)
    assert batch.active.dtype == torch.bool
    assert torch.equal(batch.active, weights != 0)
    assert batch.batch_size == B


# ===================================================================== model_inputs rules


@pytest.mark.parametrize(("value", "type_name"), [([1, 2], "list"), (torch.zeros(B), "Tensor")])
def test_model_inputs_not_a_mapping(value, type_name):
    with pytest.raises(
        TypeError,
        match=re.escape(f"{TB}.model_inputs: expected a mapping of tensors, got {type_name}"),
    ):
        _batch(model_inputs=value)


def test_model_inputs_non_str_key():
    with pytest.raises(
        TypeError, match=re.escape(f"{TB}.model_inputs: keys must be str, got int 1")
    ):
        _batch(model_inputs={1: torch.zeros(B)})


def test_model_inputs_nested_non_str_key_names_the_path():
    with pytest.raises(
        TypeError,
        match=re.escape(f"{TB}.model_inputs.outer: keys must be str, got tuple ('a', 0)"),
    ):
        _batch(model_inputs={"outer": {("a", 0): torch.zeros(B)}})


@pytest.mark.parametrize(
    ("leaf", "type_name"), [([0.0] * B, "list"), (1.0, "float"), (None, "NoneType")]
)
def test_model_inputs_non_tensor_leaf(leaf, type_name):
    with pytest.raises(
        TypeError,
        match=re.escape(f"{TB}.model_inputs.outer.x: expected a torch.Tensor, got {type_name}"),
    ):
        _batch(model_inputs={"ok": torch.zeros(B), "outer": {"x": leaf}})


def test_model_inputs_scalar_leaf():
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"{TB}.model_inputs.temperature: expected a batch-major tensor "
            f"(rank >= 1, leading dim {B}), got a scalar; static settings belong to the scorer"
        ),
    ):
        _batch(model_inputs={"temperature": torch.tensor(0.7)})


@pytest.mark.parametrize("shape", [(B + 1,), (B - 1, L), (1, B), (0,)])
def test_model_inputs_wrong_leading_dim(shape):
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"{TB}.model_inputs.a.b: expected leading dim B={B} (from target_ids), "
            f"got shape {shape}"
        ),
    ):
        _batch(model_inputs={"a": {"b": torch.zeros(shape)}})


def test_model_inputs_nested_mappings_converted_to_plain_dicts():
    inner = types.MappingProxyType({"mask": torch.ones(B, L), "t": torch.rand(B)})
    outer = types.MappingProxyType({"input_ids": _targets(), "extra": inner})
    batch = _batch(model_inputs=outer)
    assert type(batch.model_inputs) is dict
    assert type(batch.model_inputs["extra"]) is dict
    assert batch.model_inputs["extra"]["t"] is inner["t"]
    assert batch.model_inputs["input_ids"] is outer["input_ids"]


@pytest.mark.parametrize("inputs", [{}, {"a": {}}, {"a": {"b": {}}, "c": {}}])
def test_model_inputs_without_a_tensor_refused(inputs):
    with pytest.raises(
        ValueError, match=re.escape(f"{TB}.model_inputs: expected at least one tensor, got none")
    ):
        _batch(model_inputs=inputs)


def test_self_referencing_model_inputs_refused_not_recursion():
    inputs = {"ids": torch.zeros(B)}
    inputs["loop"] = {"back": inputs}
    with pytest.raises(ValueError, match=re.escape(f"{TB}.model_inputs.loop.back: refers back")):
        _batch(model_inputs=inputs)
    shared = {"t": torch.zeros(B)}  # the same mapping twice is a DAG, not a cycle: accepted
    batch = _batch(model_inputs={"a": shared, "b": shared})
    assert batch.model_inputs["a"]["t"] is batch.model_inputs["b"]["t"]


# ===================================================================== logits rules


def test_logits_valid():
    validate_diffusion_logits(_batch(), torch.randn(B, L, V))
    validate_diffusion_logits(_batch(), torch.randn(B, L, V, dtype=torch.bfloat16))


@pytest.mark.parametrize(("logits", "type_name"), [([[0.0]], "list"), (None, "NoneType")])
def test_logits_not_a_tensor(logits, type_name):
    with pytest.raises(
        TypeError, match=re.escape(f"logits: expected a torch.Tensor, got {type_name}")
    ):
        validate_diffusion_logits(_batch(), logits)


@pytest.mark.parametrize("shape", [(B, L), (B, L, V, 1), (B * L * V,)])
def test_logits_wrong_rank(shape):
    with pytest.raises(
        ValueError,
        match=re.escape(f"logits: expected rank 3 [B, L, V], got rank {len(shape)} shape {shape}"),
    ):
        validate_diffusion_logits(_batch(), torch.zeros(shape))


@pytest.mark.parametrize("shape", [(B, L + 1, V), (B, L - 1, V), (B + 1, L, V), (L, B, V)])
def test_logits_batch_length_mismatch(shape):
    with pytest.raises(
        ValueError,
        match=re.escape(f"logits: expected [B, L] = {(B, L)} (target_ids), got {shape[:2]}"),
    ):
        validate_diffusion_logits(_batch(), torch.zeros(shape))


def test_logits_empty_vocabulary():
    with pytest.raises(
        ValueError, match=re.escape("logits: expected vocabulary size V >= 1, got 0")
    ):
        validate_diffusion_logits(_batch(), torch.zeros(B, L, 0))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64])
def test_logits_non_floating_dtype(dtype):
    with pytest.raises(
        TypeError, match=re.escape(f"logits: expected a floating dtype, got {dtype}")
    ):
        validate_diffusion_logits(_batch(), torch.zeros(B, L, V, dtype=dtype))


def test_logits_active_target_out_of_vocabulary():
    targets = _targets()
    targets[0, 3] = V + 2
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"target_ids: active ids must be < V={V} (logits vocabulary), got maximum {V + 2}"
        ),
    ):
        validate_diffusion_logits(_batch(target_ids=targets), torch.zeros(B, L, V))


def test_logits_active_target_equal_to_vocabulary_rejected():
    targets = _targets()
    targets[2, 0] = V
    with pytest.raises(ValueError, match=re.escape(f"got maximum {V}")):
        validate_diffusion_logits(_batch(target_ids=targets), torch.zeros(B, L, V))


def test_logits_inactive_target_out_of_vocabulary_accepted():
    targets = _targets()
    weights = _weights()
    targets[0, 3] = V + 100
    weights[0, 3] = 0
    targets[1, 0] = -1
    weights[1, 0] = 0
    validate_diffusion_logits(
        _batch(target_ids=targets, loss_weights=weights), torch.zeros(B, L, V)
    )


def test_target_aligned_logits_check_on_a_slice_of_slots():
    targets = _targets()
    targets[0, 1] = V + 3  # out of vocabulary, only an error where active
    active = torch.zeros(B, L, dtype=torch.bool)
    validate_target_aligned_logits(targets[:, 1:3], active[:, 1:3], torch.zeros(B, 2, V))
    active[0, 1] = True
    with pytest.raises(ValueError, match=re.escape(f"got maximum {V + 3}")):
        validate_target_aligned_logits(targets[:, 1:3], active[:, 1:3], torch.zeros(B, 2, V))
    with pytest.raises(ValueError, match=re.escape("logits: expected [B, L] = (3, 2)")):
        validate_target_aligned_logits(targets[:, 1:3], active[:, 1:3], torch.zeros(B, 3, V))


def test_logits_all_inactive_accepted():
    targets = torch.full((B, L), 10 * V, dtype=torch.long)
    batch = _batch(target_ids=targets, loss_weights=torch.zeros(B, L))
    validate_diffusion_logits(batch, torch.zeros(B, L, V))


# ===================================================================== batch behaviour


def test_slice_indexing():
    batch = _batch()
    sub = batch[1:3]
    assert isinstance(sub, DiffusionTokenBatch)
    assert sub.batch_size == 2
    assert torch.equal(sub.target_ids, batch.target_ids[1:3])
    assert torch.equal(sub.loss_weights, batch.loss_weights[1:3])
    assert torch.equal(sub.model_inputs["extra"]["t"], batch.model_inputs["extra"]["t"][1:3])


@pytest.mark.parametrize(
    "index",
    [
        torch.tensor([2, 0]),
        [2, 0],
        torch.tensor([True, False, True]),
    ],
    ids=["index_tensor", "index_list", "bool_mask"],
)
def test_tensor_and_mask_indexing(index):
    batch = _batch()
    rows = [2, 0] if not isinstance(index, torch.Tensor) or index.dtype != torch.bool else [0, 2]
    sub = batch[index]
    assert sub.batch_size == 2
    for got, full in zip(_leaves(sub), _leaves(batch)):
        assert torch.equal(got, full[rows])


@pytest.mark.parametrize("index", [0, 1, B - 1])
def test_int_index_keeps_batch_dim(index):
    batch = _batch()
    sub = batch[index]
    assert sub.batch_size == 1
    assert sub.target_ids.shape == (1, L)
    for got, full in zip(_leaves(sub), _leaves(batch)):
        assert torch.equal(got, full[index : index + 1])


def test_negative_int_index_selects_last_row():
    batch = _batch()
    sub = batch[-1]
    assert sub.batch_size == 1
    assert torch.equal(sub.target_ids, batch.target_ids[-1:])
    assert torch.equal(batch[torch.tensor(1)].target_ids, batch.target_ids[1:2])
    with pytest.raises(IndexError, match="out of range"):
        batch[batch.batch_size]


def test_concat_rejects_different_lengths():
    a = _batch()
    b = DiffusionTokenBatch(
        {"x": torch.zeros(2)},
        torch.zeros(2, a.target_ids.shape[1] + 1, dtype=torch.long),
        torch.ones(2, a.target_ids.shape[1] + 1),
    )
    a = DiffusionTokenBatch({"x": torch.zeros(B)}, a.target_ids, a.loss_weights)
    with pytest.raises(ValueError, match="concat: batch 1 has a leaf of shape"):
        DiffusionTokenBatch.concat([a, b])


@pytest.mark.parametrize(("size", "expected"), [(1, [1, 1, 1]), (2, [2, 1]), (3, [3]), (10, [3])])
def test_split_sizes(size, expected):
    parts = _batch().split(size)
    assert [p.batch_size for p in parts] == expected
    assert all(isinstance(p, DiffusionTokenBatch) for p in parts)


@pytest.mark.parametrize("size", [0, -1])
def test_split_rejects_non_positive(size):
    with pytest.raises(ValueError, match=re.escape(f"micro_batch_size: expected >= 1, got {size}")):
        _batch().split(size)


@pytest.mark.parametrize("size", [1, 2, 3])
def test_split_concat_round_trip(size):
    batch = _batch(loss_weights=torch.rand(B, L))
    _assert_batches_equal(DiffusionTokenBatch.concat(batch.split(size)), batch)


def test_concat_of_different_batches():
    a, b = _batch(2), _batch(3)
    cat = DiffusionTokenBatch.concat([a, b])
    assert cat.batch_size == 5
    for got, x, y in zip(_leaves(cat), _leaves(a), _leaves(b)):
        assert torch.equal(got, torch.cat([x, y]))


def test_concat_empty_list_raises():
    with pytest.raises(
        ValueError,
        match=re.escape(f"{TB}.concat: expected at least one batch, got none"),
    ):
        DiffusionTokenBatch.concat([])


@pytest.mark.parametrize(
    "other_inputs",
    [
        {"input_ids": torch.zeros(B, L)},
        {"input_ids": torch.zeros(B, L), "extra": {"mask": torch.zeros(B, L)}},
        {"input_ids": torch.zeros(B, L), "extra": torch.zeros(B)},
        {**_inputs(), "more": torch.zeros(B)},
    ],
    ids=["missing_key", "missing_nested_key", "leaf_vs_mapping", "extra_key"],
)
def test_concat_mismatched_structures_raises(other_inputs):
    other = _batch(model_inputs=other_inputs)
    with pytest.raises(ValueError, match=re.escape(f"{TB}.concat: batch 1 has structure")):
        DiffusionTokenBatch.concat([_batch(), other])


def test_to_cpu():
    batch = _batch()
    moved = batch.to("cpu")
    assert isinstance(moved, DiffusionTokenBatch)
    for leaf in _leaves(moved):
        assert leaf.device.type == "cpu"
    _assert_batches_equal(moved, batch)
    _assert_batches_equal(batch.to(torch.device("cpu")), batch)


def test_pytree_flatten_unflatten_round_trip():
    batch = _batch()
    leaves, spec = pytree.tree_flatten(batch)
    assert len(leaves) == 5  # input_ids, extra.mask, extra.t, target_ids, loss_weights
    assert leaves[-2] is batch.target_ids
    assert leaves[-1] is batch.loss_weights
    rebuilt = pytree.tree_unflatten(leaves, spec)
    assert isinstance(rebuilt, DiffusionTokenBatch)
    _assert_batches_equal(rebuilt, batch)


def test_pytree_tree_map_tensor_op_gives_validated_batch():
    batch = _batch()
    doubled = pytree.tree_map(lambda t: t[:2] * 2, batch)
    assert isinstance(doubled, DiffusionTokenBatch)
    assert doubled.batch_size == 2
    assert torch.equal(doubled.target_ids, batch.target_ids[:2] * 2)
    assert type(doubled.model_inputs["extra"]) is dict
    # The result goes through __post_init__: an op that breaks a rule is caught.
    with pytest.raises(TypeError, match=re.escape(f"{TB}.target_ids: expected an integer dtype")):
        pytree.tree_map(lambda t: t.float(), batch)
    with pytest.raises(ValueError, match=re.escape(f"{TB}.loss_weights: expected values >= 0")):
        pytree.tree_map(lambda t: -t if t.is_floating_point() else t, batch)


def test_pytree_tree_map_to_non_tensors_keeps_structure():
    shapes = pytree.tree_map(lambda t: tuple(t.shape), _batch())
    assert isinstance(shapes, DiffusionTokenBatch)
    assert shapes.target_ids == (B, L)
    assert shapes.loss_weights == (B, L)
    assert shapes.model_inputs == {
        "input_ids": (B, L),
        "extra": {"mask": (B, L), "t": (B,)},
    }


@pytest.mark.parametrize(
    ("make", "attr"),
    [
        (_batch, "target_ids"),
        (lambda: WeightedMetric(torch.tensor(1.0), torch.tensor(2.0)), "sum"),
        (lambda: LossOutput(WeightedMetric(torch.tensor(1.0), torch.tensor(2.0))), "primary"),
    ],
    ids=["batch", "weighted_metric", "loss_output"],
)
def test_frozen(make, attr):
    obj = make()
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(obj, attr, None)


# ===================================================================== WeightedMetric rules


@pytest.mark.parametrize("name", ["sum", "denominator"])
@pytest.mark.parametrize(
    ("value", "type_name"), [(True, "bool"), ("1", "str"), ([1.0], "list"), (None, "NoneType")]
)
def test_weighted_metric_bad_kind(name, value, type_name):
    kwargs = {"sum": torch.tensor(1.0), "denominator": torch.tensor(1.0), name: value}
    with pytest.raises(
        TypeError,
        match=re.escape(
            f"WeightedMetric.{name}: expected a scalar tensor or number, got {type_name}"
        ),
    ):
        WeightedMetric(**kwargs)


@pytest.mark.parametrize("name", ["sum", "denominator"])
@pytest.mark.parametrize("shape", [(2,), (1, 2), (0,)])
def test_weighted_metric_non_scalar(name, shape):
    kwargs = {"sum": torch.tensor(1.0), "denominator": torch.tensor(1.0), name: torch.ones(shape)}
    with pytest.raises(
        ValueError,
        match=re.escape(f"WeightedMetric.{name}: expected a scalar, got shape {shape}"),
    ):
        WeightedMetric(**kwargs)


def test_weighted_metric_numbers_converted_to_tensors():
    metric = WeightedMetric(3, 4.0)
    assert isinstance(metric.sum, torch.Tensor)
    assert isinstance(metric.denominator, torch.Tensor)
    assert metric.value.item() == pytest.approx(0.75)


@pytest.mark.parametrize(
    ("denominator", "shown"),
    [
        (torch.tensor(-1.0), "-1.0"),
        (-2, "-2.0"),
        (torch.tensor(float("nan")), "nan"),
        (torch.tensor(float("inf")), "inf"),
    ],
)
def test_weighted_metric_bad_denominator_value(denominator, shown):
    with pytest.raises(
        ValueError,
        match=re.escape(f"WeightedMetric.denominator: expected a finite value >= 0, got {shown}"),
    ):
        WeightedMetric(torch.tensor(1.0), denominator)


def test_weighted_metric_denominator_with_grad_checked():
    d = torch.tensor(-1.0, requires_grad=True)
    with pytest.raises(ValueError, match=re.escape("WeightedMetric.denominator")):
        WeightedMetric(torch.tensor(1.0), d)


@pytest.mark.parametrize("name", ["eps", "min_denom"])
@pytest.mark.parametrize(
    ("value", "type_name"), [(True, "bool"), ("0.1", "str"), (torch.tensor(0.1), "Tensor")]
)
def test_weighted_metric_bad_bound_type(name, value, type_name):
    with pytest.raises(
        TypeError,
        match=re.escape(f"WeightedMetric.{name}: expected a float or None, got {type_name}"),
    ):
        WeightedMetric(torch.tensor(1.0), torch.tensor(1.0), **{name: value})


@pytest.mark.parametrize("name", ["eps", "min_denom"])
@pytest.mark.parametrize("value", [-1e-8, -1, float("nan"), float("inf")])
def test_weighted_metric_bad_bound_value(name, value):
    with pytest.raises(
        ValueError,
        match=re.escape(f"WeightedMetric.{name}: expected a finite value >= 0, got {value}"),
    ):
        WeightedMetric(torch.tensor(1.0), torch.tensor(1.0), **{name: value})


@pytest.mark.parametrize(
    ("s", "d", "eps", "min_denom", "expected"),
    [
        (3.0, 4.0, None, None, 3.0 / 4.0),
        (3.0, 4.0, 0.5, None, 3.0 / 4.5),
        (3.0, 1.0, None, 2.0, 3.0 / 2.0),  # max picks min_denom
        (3.0, 4.0, None, 2.0, 3.0 / 4.0),  # max picks d
        (3.0, 1.0, 0.5, 2.0, 3.0 / 2.0),  # d + eps = 1.5 < 2
        (3.0, 3.0, 1.0, 2.0, 3.0 / 4.0),  # d + eps = 4 > 2
        (3.0, 0.0, 0.5, None, 3.0 / 0.5),
        (3.0, 0.0, None, 1.0, 3.0),
        (3.0, 0.0, None, None, 0.0),  # bound 0 -> exactly 0
        (3.0, 0.0, 0.0, 0.0, 0.0),
        (-2.0, 4, 0, 0, -0.5),  # int bounds accepted
    ],
)
def test_weighted_metric_value(s, d, eps, min_denom, expected):
    metric = WeightedMetric(torch.tensor(s), torch.tensor(d), eps=eps, min_denom=min_denom)
    bounded = max(d + (eps or 0.0), min_denom if min_denom is not None else -math.inf)
    assert WeightedMetric.bound(metric.denominator, eps, min_denom).item() == pytest.approx(bounded)
    value = metric.value
    assert not bool(torch.isnan(value))
    assert value.item() == pytest.approx(expected)
    if expected == 0.0:
        assert value.item() == 0.0


def test_weighted_metric_integer_denominator():
    metric = WeightedMetric(torch.tensor(3.0), torch.tensor(4, dtype=torch.int64))
    assert metric.value.dtype.is_floating_point
    assert metric.value.item() == pytest.approx(0.75)


def test_weighted_metric_gradient_flows_through_sum():
    x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    w = torch.tensor([1.0, 0.0, 2.0])
    metric = WeightedMetric((w * x).sum(), w.sum(), eps=1.0)
    metric.value.backward()
    assert torch.allclose(x.grad, w / (w.sum() + 1.0))


def test_weighted_metric_zero_bound_gradient_is_zero_not_nan():
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    metric = WeightedMetric(x.sum(), torch.tensor(0.0))
    value = metric.value
    assert value.item() == 0.0
    value.backward()
    assert torch.equal(x.grad, torch.zeros(2))


def test_weighted_metric_detach():
    x = torch.tensor(2.0, requires_grad=True)
    metric = WeightedMetric(x * 3, torch.tensor(4.0), eps=0.5, min_denom=1.0)
    detached = metric.detach()
    assert isinstance(detached, WeightedMetric)
    assert metric.sum.requires_grad
    assert not detached.sum.requires_grad
    assert not detached.value.requires_grad
    assert detached.eps == 0.5
    assert detached.min_denom == 1.0
    assert torch.equal(detached.sum, metric.sum.detach())
    assert torch.equal(detached.denominator, metric.denominator)
    assert detached.value.item() == pytest.approx(6.0 / 4.5)


# ===================================================================== LossOutput rules


def _metric() -> WeightedMetric:
    return WeightedMetric(torch.tensor(1.0), torch.tensor(2.0))


@pytest.mark.parametrize(
    ("primary", "type_name"),
    [(torch.tensor(1.0), "Tensor"), (1.0, "float"), (None, "NoneType")],
)
def test_loss_output_wrong_primary_type(primary, type_name):
    with pytest.raises(
        TypeError,
        match=re.escape(f"LossOutput.primary: expected a WeightedMetric, got {type_name}"),
    ):
        LossOutput(primary)


@pytest.mark.parametrize(("aux", "type_name"), [([("a", 1.0)], "list"), (None, "NoneType")])
def test_loss_output_non_mapping_aux(aux, type_name):
    with pytest.raises(
        TypeError,
        match=re.escape(f"LossOutput.aux_metrics: expected a mapping, got {type_name}"),
    ):
        LossOutput(_metric(), aux)


@pytest.mark.parametrize(
    ("value", "type_name"),
    [("x", "str"), (True, "bool"), (None, "NoneType"), (torch.ones(2), "Tensor"), ([1.0], "list")],
)
def test_loss_output_bad_aux_value(value, type_name):
    with pytest.raises(
        TypeError,
        match=re.escape(
            f"LossOutput.aux_metrics['kl']: expected a WeightedMetric, an Extreme or a scalar, "
            f"got {type_name}"
        ),
    ):
        LossOutput(_metric(), {"ok": 1.0, "kl": value})


def test_loss_output_good_aux_values():
    aux = {"wm": _metric(), "t": torch.tensor(0.5), "t1": torch.ones(1), "f": 0.1, "i": 3}
    out = LossOutput(_metric(), aux)
    assert out.aux_metrics == aux
    assert LossOutput(_metric()).aux_metrics == {}


# ----------------------------------------------------------------------------- gaps an audit found
def test_a_zero_row_batch_is_refused_naming_target_ids():
    """It used to be accepted, and train_step then crashed inside the model."""
    with pytest.raises(ValueError, match=rf"^{TB}\.target_ids: expected at least one row"):
        _batch(b=0)
    empty = torch.zeros(3, dtype=torch.bool)
    with pytest.raises(ValueError, match=rf"^{TB}\.target_ids: expected at least one row"):
        _batch()[empty]  # selecting no rows


def test_weights_whose_sum_overflows_are_refused_naming_loss_weights():
    """3e38 per slot: each finite, their sum (the losses' denominator) is not. The error used
    to name an internal WeightedMetric.denominator."""
    with pytest.raises(ValueError, match=rf"^{TB}\.loss_weights: the weights sum to more than"):
        _batch(loss_weights=torch.full((B, L), 3e38))
    assert _batch(loss_weights=torch.full((B, L), 1e36)).loss_weights.max() == 1e36


@pytest.mark.parametrize(
    ("size", "shown"), [(2.5, "float 2.5"), (True, "bool True"), ("2", "str '2'")]
)
def test_split_names_micro_batch_size_for_a_non_int(size, shown):
    with pytest.raises(
        TypeError,
        match=re.escape(
            f"micro_batch_size: expected an int >= 1 (rows per micro-batch), got {shown}"
        ),
    ):
        _batch().split(size)


def test_logits_check_names_a_batch_that_is_not_a_batch():
    with pytest.raises(TypeError, match=r"^batch: expected a DiffusionTokenBatch, got dict"):
        validate_diffusion_logits({"target_ids": _targets()}, torch.zeros(B, L, V))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("sum", torch.tensor(True)),
        ("denominator", torch.tensor(True)),
        ("sum", torch.tensor(1.0 + 2.0j)),
        ("denominator", torch.tensor(2.0 + 0.0j)),  # used to raise NotImplementedError
    ],
)
def test_weighted_metric_refuses_bool_and_complex_tensors(field, value):
    values = {"sum": torch.tensor(1.0), "denominator": torch.tensor(2.0), field: value}
    with pytest.raises(
        TypeError,
        match=rf"^WeightedMetric\.{field}: expected a real \(floating or integer\) tensor, got torch\.(bool|complex64)",
    ):
        WeightedMetric(**values)
    assert WeightedMetric(torch.tensor(3.0), torch.tensor(2)).value == 1.5  # integer counts
