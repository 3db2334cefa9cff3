"""The "movement-equivalents" form (rules/forms/movement-equivalents.toml,
onnx_qrewrite/rewriter/builders/movement_equivalent.py): Flatten as Reshape with a constant shape
and Gather as GatherND, bit-exact in onnxruntime on every axis (negative and 0 included), dynamic
and empty leading dimensions, constant and run-time indices of rank 0 to 2, negative and
out-of-range indices, int32 and int64 indices and several data types; where it gives way, and why
the shape it refuses ([0, -1]) really differs from Flatten. The CoreML target uses it
(tests/test_targets.py checks the rewrites against onnxruntime's own usability checker)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import assert_bitwise_equal, op_types, rule_marker, run, session
from onnx import TensorProto, helper, numpy_helper

import onnx_qrewrite
from onnx_qrewrite.rewriter.catalogue import load_catalogue, named_form

FORM = load_catalogue([named_form("movement-equivalents")])
TYPES = {
    "float32": TensorProto.FLOAT,
    "float16": TensorProto.FLOAT16,
    "uint8": TensorProto.UINT8,
    "int64": TensorProto.INT64,
    "bool": TensorProto.BOOL,
}


def _data(shape, dtype: str, seed: int = 0) -> np.ndarray:
    """Distinct bit patterns where the type has room (NaN and -0.0 among the floats)."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    if dtype == "bool":
        return rng.integers(0, 2, n).astype(bool).reshape(shape)
    if dtype in ("float32", "float16"):
        v = rng.standard_normal(n).astype(dtype)
        if n >= 3:
            v[:3] = [np.nan, -0.0, np.inf]
        return v.reshape(shape)
    return rng.integers(0, 250, n).astype(dtype).reshape(shape)


def _model(op, dtype, in_shape, out_shape, attrs, *, indices=None, indices_input=None, opset=17):
    """x -> op -> y with the given recorded shapes (None: unrecorded; the output, which the checker
    needs a shape for, then gets ``out_shape`` symbolic dimensions when that is an int); Gather's
    indices either a constant (``indices``) or a graph input (``indices_input``: (elem type,
    recorded shape))."""
    elem = TYPES[dtype]
    if isinstance(out_shape, int):
        out_shape = [f"o{k}" for k in range(out_shape)]
    nodes = []
    if isinstance(in_shape, int):
        # x unrecorded (the checker wants a graph input's shape): the axes-reversing Transpose of
        # a recorded input x0 of that rank, which :func:`_feeds` feeds reversed.
        inputs = [helper.make_tensor_value_info("x0", elem, [f"d{k}" for k in range(in_shape)])]
        nodes.append(helper.make_node("Transpose", ["x0"], ["x"], name="unrecorded"))
    else:
        inputs = [helper.make_tensor_value_info("x", elem, in_shape)]
    inits = []
    node_inputs = ["x"]
    if op == "Gather":
        if indices is not None:
            inits.append(numpy_helper.from_array(indices, "i"))
        else:
            elem_i, shape_i = indices_input
            if shape_i is None:  # unrecorded, as x above (rank 1)
                inputs.append(helper.make_tensor_value_info("i0", elem_i, ["k"]))
                nodes.append(helper.make_node("Transpose", ["i0"], ["i"], name="unrecorded_i"))
            else:
                inputs.append(helper.make_tensor_value_info("i", elem_i, shape_i))
        node_inputs.append("i")
    graph = helper.make_graph(
        [*nodes, helper.make_node(op, node_inputs, ["y"], name="move", **attrs)],
        "g",
        inputs,
        [helper.make_tensor_value_info("y", elem, out_shape)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _feeds(model: onnx.ModelProto, x: np.ndarray, **more: np.ndarray) -> dict[str, np.ndarray]:
    if model.graph.input[0].name == "x0":
        return {"x0": np.ascontiguousarray(np.transpose(x)), **more}
    return {"x": x, **more}


def _rewritten(model: onnx.ModelProto, rule: str) -> onnx.ModelProto:
    result = onnx_qrewrite.rewrite(model, rules=FORM)
    assert [r.rule for r in result.report.rewrites if r.node == "move"] == [rule]
    onnx.checker.check_model(result.model, full_check=True)
    return result.model


# -- Flatten -> Reshape ----------------------------------------------------------------------------


FLATTEN_CASES = [
    # (data shape, recorded input shape, recorded output shape, axis)
    *[((2, 3, 4, 5), [2, 3, 4, 5], None, a) for a in range(-4, 5)],
    ((2, 3, 4, 5), ["n", 3, 4, 5], None, 1),  # dynamic batch: [-1, 60]
    ((0, 3, 4, 5), ["n", 3, 4, 5], None, 1),  # an empty batch through [-1, 60]
    ((2, 3, 4, 5), ["n", "c", 4, 5], None, 2),  # [-1, 20]
    ((2, 3, 4, 5), [2, 3, "h", "w"], None, 2),  # [6, -1]
    ((2, 3, 4, 5), [2, 3, "h", "w"], None, -2),  # negative axis, rank recorded
    ((3, 4), 2, None, 0),  # axis 0 needs no shape: [1, -1]
    ((2, 16, 1, 1), 4, ["n", 16], 1),  # only the output recorded (the Quark CNNs' Flatten)
    ((7,), [7], None, 1),  # axis == rank: [7, 1]
    ((), [], None, 0),  # a scalar: [1, 1]
]


@rule_marker("flatten-as-reshape", "positive")
@pytest.mark.parametrize(("shape", "recorded", "out", "axis"), FLATTEN_CASES)
@pytest.mark.parametrize("dtype", list(TYPES))
def test_flatten_as_reshape_is_bit_exact(shape, recorded, out, axis, dtype):
    model = _model("Flatten", dtype, recorded, 2 if out is None else out, {"axis": axis})
    new = _rewritten(model, "flatten-as-reshape")
    assert "Flatten" not in op_types(new) and "Reshape" in op_types(new)
    x = _data(shape, dtype)
    want, got = run(model, _feeds(model, x))["y"], run(new, _feeds(model, x))["y"]
    assert got.shape == want.shape and got.dtype == want.dtype
    assert_bitwise_equal(got, want, f"{shape} axis {axis}")


@rule_marker("flatten-as-reshape", "positive")
def test_flatten_without_axis_attribute_and_at_opset_9():
    model = _model("Flatten", "float32", ["n", 3, 2], 2, {}, opset=9)
    new = _rewritten(model, "flatten-as-reshape")
    for n in (0, 1, 5):
        x = _data((n, 3, 2), "float32")
        assert_bitwise_equal(run(new, {"x": x})["y"], run(model, {"x": x})["y"])


@rule_marker("flatten-as-reshape", "negative")
@pytest.mark.parametrize(
    ("recorded", "out", "axis", "why"),
    [
        (3, None, 1, "neither the size before nor the size from the axis is recorded"),
        (["n", "c", 4], None, 1, "neither"),
        (3, None, -1, "unrecorded rank"),
        (["n", 0, 4], None, 1, "empty tensor"),
        ([0, 3], None, 1, "empty tensor"),
    ],
)
def test_flatten_of_unrecorded_or_empty_sizes_is_left_as_it_is(recorded, out, axis, why):
    model = _model("Flatten", "float32", recorded, 2, {"axis": axis})
    result = onnx_qrewrite.rewrite(model, rules=FORM)
    assert not result.report.rewrites and "Flatten" in op_types(result.model)
    from onnx_qrewrite.rewriter.builders.movement_equivalent import flatten_shape

    shape = None if isinstance(recorded, int) else tuple(d if isinstance(d, int) else None for d in recorded)
    reason = flatten_shape(axis, shape, out)
    assert isinstance(reason, str) and why in reason


def test_the_shape_left_unused_really_differs_from_flatten():
    """Why Flatten(axis=1) of a dynamic batch with unrecorded other sizes is not Reshape [0, -1]:
    onnxruntime refuses that Reshape on an empty batch, where Flatten gives (0, Q)."""
    flatten = _model("Flatten", "float32", 3, 2, {"axis": 1})
    reshape = helper.make_model(
        helper.make_graph(
            [helper.make_node("Reshape", ["x", "s"], ["y"])],
            "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
            [numpy_helper.from_array(np.array([0, -1], np.int64), "s")],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
        ir_version=8,
    )
    x = np.zeros((0, 3, 2), np.float32)
    assert run(flatten, _feeds(flatten, x))["y"].shape == (0, 6)
    with pytest.raises(Exception, match="cannot be reshaped"):
        session(reshape).run(None, {"x": x})


# -- Gather -> GatherND ----------------------------------------------------------------------------

#: Indices with negative entries, both ends of [-s, s-1], of rank 0, 1 and 2 (s = 4 on every axis).
INDICES = [np.array(-1), np.array(2), np.array([3, -4, 0, -1, 3]), np.array([[0, -2], [3, 1], [-3, -3]])]


@rule_marker("gather-as-gathernd", "positive")
@pytest.mark.parametrize("axis", [-3, -2, -1, 0, 1, 2])
@pytest.mark.parametrize("k", range(len(INDICES)))
@pytest.mark.parametrize("dtype", list(TYPES))
def test_gather_of_constant_indices_is_bit_exact(axis, k, dtype):
    idx = INDICES[k]
    model = _model("Gather", dtype, [4, 4, 4], 2 + idx.ndim, {"axis": axis}, indices=idx.astype(np.int64))
    new = _rewritten(model, "gather-as-gathernd")
    assert "GatherND" in op_types(new) and "Gather" not in op_types(new)
    x = _data((4, 4, 4), dtype, seed=k)
    want, got = run(model, {"x": x})["y"], run(new, {"x": x})["y"]
    assert got.shape == want.shape
    assert_bitwise_equal(got, want, f"axis {axis} indices {idx.tolist()}")


@rule_marker("gather-as-gathernd", "positive")
@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("index_type", [TensorProto.INT64, TensorProto.INT32])
@pytest.mark.parametrize("k", range(len(INDICES)))
def test_gather_of_run_time_indices_is_bit_exact(axis, index_type, k):
    """Indices fed at run time (the embedding lookup's input_ids), int32 ones cast to int64; the
    data's leading size dynamic where the axis is 0 (no rank needed then)."""
    idx = INDICES[k].astype(np.int64 if index_type == TensorProto.INT64 else np.int32)
    recorded_data = [None, 4, 4] if axis == 0 else [4, 4, 4]
    model = _model(
        "Gather", "float32", recorded_data, 2 + idx.ndim, {"axis": axis}, indices_input=(index_type, list(idx.shape))
    )
    new = _rewritten(model, "gather-as-gathernd")
    assert ("Cast" in op_types(new)) == (index_type == TensorProto.INT32)
    x = _data((4, 4, 4), "float32", seed=k)
    want, got = run(model, {"x": x, "i": idx})["y"], run(new, {"x": x, "i": idx})["y"]
    assert_bitwise_equal(got, want, f"axis {axis} indices {idx.tolist()}")


@rule_marker("gather-as-gathernd", "positive")
def test_gather_on_axis_0_needs_no_shape_and_runs_at_opset_11():
    x = np.array([5, 7, 11], np.int64)  # Shape -> Gather, as the BERTs compute their length
    for idx in (np.array([1]), np.array(-1), np.array([[2, 0]])):
        model = _model("Gather", "int64", 1, idx.ndim, {}, indices_input=(TensorProto.INT64, list(idx.shape)), opset=11)
        new = _rewritten(model, "gather-as-gathernd")
        feeds = _feeds(model, x, i=idx)
        assert_bitwise_equal(run(new, feeds)["y"], run(model, feeds)["y"])


def test_out_of_range_indices_fail_in_both():
    """An index outside [-s, s-1] is an error in Gather's kernel and in GatherND's: the rewrite does
    not turn a failing model into one that returns numbers."""
    model = _model("Gather", "float32", [3, 2], 2, {}, indices_input=(TensorProto.INT64, [1]))
    new = _rewritten(model, "gather-as-gathernd")
    x = _data((3, 2), "float32")
    for bad in (3, -4):
        for m in (model, new):
            with pytest.raises(Exception, match=r"index|indices"):
                session(m).run(None, {"x": x, "i": np.array([bad])})


@rule_marker("gather-as-gathernd", "negative")
def test_gather_on_another_axis_without_recorded_ranks_is_left_as_it_is():
    for recorded, idx_shape in ((2, [2]), ([4, 4], None)):
        model = _model("Gather", "float32", recorded, 2, {"axis": 1}, indices_input=(TensorProto.INT64, idx_shape))
        result = onnx_qrewrite.rewrite(model, rules=FORM)
        assert not result.report.rewrites and "Gather" in op_types(result.model)
    model = _model("Gather", "float32", 2, 1, {"axis": -1}, indices=np.array([0]))
    assert not onnx_qrewrite.rewrite(model, rules=FORM).report.rewrites
