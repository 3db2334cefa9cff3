"""The "qdq-units" form (rules/forms/qdq-units.toml, onnx_qrewrite/rewriter/builders/qdq_wrap.py): data
movement on a uint8/int8 tensor wrapped in DequantizeLinear -> op -> QuantizeLinear with the
tensor's own scale and zero point, bit-exact in onnxruntime on every uint8/int8 value; where it
gives way; and that a scale outside the range it accepts really breaks the round trip. The QNN
target uses it on QOperator models (tests/test_targets_runtime.py runs them on QNN's HTP simulator)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import assert_bitwise_equal, op_types, rule_marker, run
from onnx import TensorProto, helper, numpy_helper

import onnx_qrewrite
from onnx_qrewrite.rewriter.builders.qdq_wrap import SCALE_RANGE
from onnx_qrewrite.rewriter.catalogue import load_catalogue, named_form

FORM = load_catalogue([named_form("qdq-units")])
RULE = "qdq-wrap-move"
TYPES = {"uint8": (np.uint8, TensorProto.UINT8), "int8": (np.int8, TensorProto.INT8)}
#: Ordinary scales, the ends of the range the rule accepts, and quantize_static-like ones.
SCALES = [SCALE_RANGE[0], 1e-30, 0.00364174, 0.0149762, 1 / 3, 1.0, 7.3e12, SCALE_RANGE[1]]


def _values(dtype) -> np.ndarray:
    """Every value of the type, twice, as a (2, 4, 8, 8) tensor."""
    info = np.iinfo(dtype)
    return np.tile(np.arange(info.min, info.max + 1, dtype=np.int64), 2).astype(dtype).reshape(2, 4, 8, 8)


def _model(op: str, dtype: str, scale: float, zp: int, *, where: str = "producer") -> onnx.ModelProto:
    """x (float) -> QuantizeLinear -> [op on the quantized tensor] -> outputs: the moved uint8/int8
    tensor itself and its DequantizeLinear. ``where`` says which node tells the q-params: the
    QuantizeLinear before (``producer``), or only the DequantizeLinear after (``reader``: the
    model input is then the integer tensor)."""
    np_t, onnx_t = TYPES[dtype]
    inits = [
        numpy_helper.from_array(np.array(scale, np.float32), "s"),
        numpy_helper.from_array(np.array(zp, np_t), "z"),
    ]
    attrs: dict = {}
    extra: list[str] = []
    if op == "Reshape":
        inits.append(numpy_helper.from_array(np.array([2, 0, -1], np.int64), "shape"))
        extra = ["shape"]
    elif op == "Transpose":
        attrs = {"perm": [0, 3, 1, 2]}
    elif op == "Flatten":
        attrs = {"axis": 2}
    elif op == "Gather":
        inits.append(numpy_helper.from_array(np.array([[3, 0], [-1, 2]], np.int64), "idx"))
        extra = ["idx"]
        attrs = {"axis": 1}
    elif op == "Slice":
        for name, v in (("st", [1, -6]), ("en", [4, 100]), ("ax", [1, 3]), ("sp", [2, 1])):
            inits.append(numpy_helper.from_array(np.array(v, np.int64), name))
        extra = ["st", "en", "ax", "sp"]
    elif op == "MaxPool":
        attrs = {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}
    elif op == "Unsqueeze":
        inits.append(numpy_helper.from_array(np.array([1], np.int64), "axes"))
        extra = ["axes"]
    nodes = []
    if where == "producer":
        inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 8, 8])]
        nodes.append(helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], name="quant"))
    else:
        inputs = [helper.make_tensor_value_info("q", onnx_t, [2, 4, 8, 8])]
    data = ["q", "q"] if op == "Concat" else ["q"]
    if op == "Concat":
        attrs = {"axis": 1}
    nodes.append(helper.make_node(op, data + extra, ["moved"], name="move", **attrs))
    nodes.append(helper.make_node("DequantizeLinear", ["moved", "s", "z"], ["y"], name="dequant"))
    graph = helper.make_graph(
        nodes,
        "g",
        inputs,
        [
            helper.make_tensor_value_info("moved", onnx_t, SHAPES[op]),
            helper.make_tensor_value_info("y", TensorProto.FLOAT, SHAPES[op]),
        ],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _feeds(model: onnx.ModelProto, dtype: str, scale: float, zp: int) -> dict[str, np.ndarray]:
    q = _values(TYPES[dtype][0])
    if model.graph.input[0].name == "q":
        return {"q": q}
    # Float inputs that quantize to every value: (q - zp) * s, computed as DequantizeLinear does.
    return {"x": ((q.astype(np.float32) - np.float32(zp)) * np.float32(scale)).astype(np.float32)}


#: The moved tensor's shape, from (2, 4, 8, 8).
SHAPES = {
    "Reshape": [2, 4, 64],
    "Transpose": [2, 8, 4, 8],
    "Flatten": [8, 64],
    "Gather": [2, 2, 2, 8, 8],
    "Slice": [2, 2, 8, 7],
    "Unsqueeze": [2, 1, 4, 8, 8],
    "Concat": [2, 8, 8, 8],
    "MaxPool": [2, 4, 4, 4],
}
OPS = ["Reshape", "Transpose", "Flatten", "Gather", "Slice", "Unsqueeze", "Concat", "MaxPool"]


@rule_marker("qdq-wrap-move", "positive")
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", ["uint8", "int8"])
def test_wrapped_data_movement_is_bit_exact_on_every_value(op, dtype):
    info = np.iinfo(TYPES[dtype][0])
    for scale in SCALES:
        for zp in (0, info.min, info.max, info.min // 3 + info.max // 2):
            model = _model(op, dtype, scale, zp)
            result = onnx_qrewrite.rewrite(model, rules=FORM)
            assert [r.rule for r in result.report.rewrites if r.node == "move"] == [RULE], (op, scale, zp)
            assert op_types(result.model).count("DequantizeLinear") == 1 + (2 if op == "Concat" else 1)
            feeds = _feeds(model, dtype, scale, zp)
            want, got = run(model, feeds), run(result.model, feeds)
            for name in ("moved", "y"):
                assert_bitwise_equal(got[name], want[name], f"{op} {dtype} s={scale!r} zp={zp} {name}")


@rule_marker("qdq-wrap-move", "positive")
def test_the_quantization_is_found_from_a_reader_through_other_moves():
    """No QuantizeLinear before: the DequantizeLinear after a chain of moves tells the q-params,
    and both moves are rewritten."""
    model = _model("Transpose", "uint8", 0.02, 131, where="reader")
    graph = model.graph
    graph.node[0].output[0] = "mid"
    graph.node.insert(1, helper.make_node("Flatten", ["mid"], ["moved"], name="move2", axis=1))
    result = onnx_qrewrite.rewrite(model, rules=FORM)
    assert {r.node: r.rule for r in result.report.rewrites} == {"move": RULE, "move2": RULE}
    feeds = _feeds(model, "uint8", 0.02, 131)
    want, got = run(model, feeds), run(result.model, feeds)
    assert_bitwise_equal(got["moved"], want["moved"])
    assert_bitwise_equal(got["y"], want["y"])


@rule_marker("qdq-wrap-move", "negative")
@pytest.mark.parametrize("scale", [1e-40, 1e-45, 3e36, float("inf")])
def test_a_scale_outside_the_range_is_left_as_it_is(scale):
    model = _model("Reshape", "uint8", scale, 3)
    result = onnx_qrewrite.rewrite(model, rules=FORM)
    assert not [r for r in result.report.rewrites if r.node == "move"]
    assert op_types(result.model) == op_types(model)


def test_outside_the_range_the_round_trip_really_loses_values():
    """Why the upper end of the range is checked: DequantizeLinear -> QuantizeLinear with a scale
    whose multiples overflow does not give every value back in onnxruntime. (The lower end is what
    the rounding argument covers, not a boundary seen to fail: a subnormal scale is a whole number
    of subnormal steps, and so are its multiples, so 1e-40 survives; it is still left alone.)"""
    for scale in (3e36, 1e37):
        nodes = [
            helper.make_node("DequantizeLinear", ["q", "s", "z"], ["f"]),
            helper.make_node("QuantizeLinear", ["f", "s", "z"], ["back"]),
        ]
        inits = [
            numpy_helper.from_array(np.array(scale, np.float32), "s"),
            numpy_helper.from_array(np.array(0, np.uint8), "z"),
        ]
        graph = helper.make_graph(
            nodes,
            "g",
            [helper.make_tensor_value_info("q", TensorProto.UINT8, [256])],
            [helper.make_tensor_value_info("back", TensorProto.UINT8, [256])],
            inits,
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
        q = np.arange(256, dtype=np.uint8)
        assert np.any(run(model, {"q": q})["back"] != q), scale


@rule_marker("qdq-wrap-move", "negative")
def test_concat_of_differently_quantized_inputs_is_left_as_it_is():
    model = _model("Concat", "uint8", 0.02, 128)
    graph = model.graph
    graph.initializer.append(numpy_helper.from_array(np.array(0.03, np.float32), "s2"))
    graph.node.insert(1, helper.make_node("QuantizeLinear", ["x", "s2", "z"], ["q2"], name="quant2"))
    graph.node[2].input[1] = "q2"
    result = onnx_qrewrite.rewrite(model, rules=FORM)
    assert not [r for r in result.report.rewrites if r.node == "move"]


@rule_marker("qdq-wrap-move", "negative")
def test_float_moves_and_unknown_quantization_are_left_as_they_are():
    model = _model("Reshape", "uint8", 0.02, 128, where="reader")
    graph = model.graph
    del graph.node[-1]  # no DequantizeLinear: nothing says how "moved" is quantized
    del graph.output[-1]
    result = onnx_qrewrite.rewrite(model, rules=FORM)
    assert not result.report.rewrites
    f = _model("Reshape", "uint8", 0.02, 128)
    f.graph.node[1].input[0] = "x"  # the Reshape now moves the float input
    f.graph.node[2].input[0] = "q"
    del f.graph.output[0]
    result = onnx_qrewrite.rewrite(f, rules=FORM)
    assert not result.report.rewrites


def _lookup(transpose_too: bool) -> onnx.ModelProto:
    """DequantizeLinear(Gather(uint8 table, ids)), as quantize_dynamic writes the embedding lookup;
    ``transpose_too``: a Transpose reads the gathered uint8 rows as well."""
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["rows"], name="lookup"),
        helper.make_node("DequantizeLinear", ["rows", "s", "z"], ["y"], name="dequant"),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])]
    if transpose_too:
        nodes.append(helper.make_node("Transpose", ["rows"], ["rows_t"], name="move", perm=[1, 0]))
        outputs.append(helper.make_tensor_value_info("rows_t", TensorProto.UINT8, [4, 3]))
    inits = [
        numpy_helper.from_array(np.arange(40, dtype=np.uint8).reshape(10, 4), "table"),
        numpy_helper.from_array(np.array(0.5, np.float32), "s"),
        numpy_helper.from_array(np.array(3, np.uint8), "z"),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [3])], outputs, inits
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@rule_marker("qdq-wrap-move", "negative")
def test_the_dequantized_embedding_lookup_is_left_to_the_weight_only_gather():
    """quantize_dynamic's DequantizeLinear(Gather(uint8 table)): the weight-only form's exact
    gather rule takes it (no Q/DQ left); this form gives way. With another reader of the gathered
    uint8 rows the lookup is wrapped (as ortqop_bert's, read by a QLinearAdd)."""
    assert not onnx_qrewrite.rewrite(_lookup(False), rules=FORM).report.rewrites
    model = _lookup(True)
    result = onnx_qrewrite.rewrite(model, rules=FORM)
    assert sorted(r.node for r in result.report.rewrites) == ["lookup", "move"]
    feeds = {"ids": np.array([9, 0, -1], np.int64)}
    want, got = run(model, feeds), run(result.model, feeds)
    assert_bitwise_equal(got["rows_t"], want["rows_t"])
    assert_bitwise_equal(got["y"], want["y"])
