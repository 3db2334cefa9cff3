"""The "qdq-to-float" form: constant DequantizeLinear folded (exact, bit for bit with onnxruntime),
activation Q -> DQ pairs removed (approximate, only when asked)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import assert_bitwise_equal, op_types, rule_marker, run
from onnx import TensorProto, helper, numpy_helper

import onnx_qrewrite
from onnx_qrewrite.rewriter.catalogue import load_catalogue, named_form

FORM = load_catalogue([named_form("qdq-to-float")])
APPROXIMATE = ("exact", "bounded", "approximate")


def _qdq_conv(per_axis: bool, dtype=np.int8, blocked: bool = False) -> onnx.ModelProto:
    rng = np.random.default_rng(2)
    info = np.iinfo(dtype)
    w = rng.integers(info.min, info.max + 1, (4, 3, 3, 3)).astype(dtype)
    if blocked:
        ws = rng.uniform(0.001, 0.02, (4, 1, 3, 3)).astype(np.float32)  # blocks of 3 along axis 1
        wz = rng.integers(info.min // 2, info.max // 2, (4, 1, 3, 3)).astype(dtype)
        w_attrs = {"axis": 1, "block_size": 3}
    elif per_axis:
        ws = rng.uniform(0.001, 0.02, 4).astype(np.float32)
        wz = rng.integers(info.min // 2, info.max // 2, 4).astype(dtype)
        w_attrs = {"axis": 0}
    else:
        ws, wz, w_attrs = np.float32(0.0123), dtype(info.max // 3), {}
    inits = [numpy_helper.from_array(a, n) for n, a in (("w", w), ("ws", np.asarray(ws)), ("wz", np.asarray(wz)))]
    inits += [numpy_helper.from_array(np.float32(0.05), "xs"), numpy_helper.from_array(np.uint8(128), "xz")]
    inits += [numpy_helper.from_array(np.float32(0.2), "ys"), numpy_helper.from_array(np.uint8(100), "yz")]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"], name="qx"),
        helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xf"], name="dqx"),
        helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wf"], name="dqw", **w_attrs),
        helper.make_node("Conv", ["xf", "wf"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("QuantizeLinear", ["c", "ys", "yz"], ["cq"], name="qc"),
        helper.make_node("DequantizeLinear", ["cq", "ys", "yz"], ["y"], name="dqc"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 6, 6])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def _float_reference(model: onnx.ModelProto, folded: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """The float model: Conv of x with the folded weights."""
    weights = next(t for t in folded.graph.initializer if t.dims == [4, 3, 3, 3])
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "W"], ["y"], pads=[1, 1, 1, 1])],
        "f",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 6, 6])],
        [numpy_helper.from_array(numpy_helper.to_array(weights), "W")],
    )
    return run(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10), {"x": x})["y"]


@rule_marker("qdq-to-float-fold-weights", "positive")
@pytest.mark.parametrize(
    "per_axis, dtype, blocked",
    [
        (False, np.int8, False),
        (True, np.int8, False),
        (True, np.uint8, False),
        (True, np.int16, False),
        (False, np.int8, True),
    ],
)
def test_folding_constant_weights_is_bit_exact_with_dequantize_linear(per_axis, dtype, blocked):
    model = _qdq_conv(per_axis, dtype, blocked)
    result = onnx_qrewrite.rewrite(model, rules=FORM)
    assert result.report.by_rule() == {"qdq-to-float-fold-weights": 1}  # activations stay quantized
    folded = next(n for n in result.model.graph.node if n.output[0] == "wf")
    assert folded.op_type == "Identity"
    # The folded value against onnxruntime's own DequantizeLinear of the weights.
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.append(helper.make_tensor_value_info("wf", TensorProto.FLOAT, None))
    x = np.random.default_rng(0).standard_normal((1, 3, 6, 6)).astype(np.float32)
    value = numpy_helper.to_array(next(t for t in result.model.graph.initializer if t.name == folded.input[0]))
    assert_bitwise_equal(value, run(probe, {"x": x})["wf"], "folded weights")
    assert_bitwise_equal(run(result.model, {"x": x})["y"], run(model, {"x": x})["y"], "model output")


@rule_marker("qdq-to-float-drop-dq", "positive")
@rule_marker("qdq-to-float-drop-q", "positive")
def test_with_approximate_allowed_the_model_becomes_its_float_reference():
    model = _qdq_conv(True)
    result = onnx_qrewrite.rewrite(model, rules=FORM, allow=APPROXIMATE)
    assert result.report.by_rule() == {
        "qdq-to-float-fold-weights": 1,
        "qdq-to-float-drop-dq": 2,
        "qdq-to-float-drop-q": 2,
    }
    assert sorted(op_types(result.model)) == ["Conv", "Identity", "Identity", "Identity"]
    x = np.random.default_rng(1).standard_normal((1, 3, 6, 6)).astype(np.float32)
    assert_bitwise_equal(run(result.model, {"x": x})["y"], _float_reference(model, result.model, x), "float model")
    # And it is not the quantized model any more: that is what "approximate" means.
    assert not np.array_equal(run(result.model, {"x": x})["y"], run(model, {"x": x})["y"])


@rule_marker("qdq-to-float-fold-weights", "negative")
@rule_marker("qdq-to-float-drop-dq", "negative")
@rule_marker("qdq-to-float-drop-q", "negative")
def test_nothing_happens_unless_asked_and_shared_or_output_values_stay():
    model = _qdq_conv(False)
    assert onnx_qrewrite.rewrite(model).report.by_rule() == {}  # not in the default catalogue
    # A quantized value that is also a graph output keeps its QuantizeLinear.
    model.graph.output.append(helper.make_tensor_value_info("cq", TensorProto.UINT8, [1, 4, 6, 6]))
    result = onnx_qrewrite.rewrite(model, rules=FORM, allow=APPROXIMATE)
    assert op_types(result.model).count("QuantizeLinear") == 1  # qc stays, qx goes
    assert not result.report.unlowered  # a standard op the form leaves is fine as it is


@rule_marker("qdq-to-float-fold-weights", "positive")
def test_an_int32_bias_with_zero_point_0_folds_bit_exact_over_the_whole_int32_range():
    """quantize_static's bias DequantizeLinear (int32, zero point 0): onnxruntime converts x to
    float32 rounding to nearest, as the fold does; a non-zero zero point (x - zp wraps in int32 in
    the kernel) is not folded."""
    rng = np.random.default_rng(5)
    x = rng.integers(-(2**31), 2**31 - 1, 256, dtype=np.int64).astype(np.int32)
    x[:8] = [2**31 - 1, -(2**31), 2**24 + 1, -(2**24 + 1), 16777217, 0, 1, -1]
    for scale, zp, axis in ((np.float32(3.7e-5), None, {}), (rng.uniform(1e-6, 1e-2, 256).astype(np.float32), 0, {})):
        inputs = ["b", "s", "z"] if zp is not None else ["b", "s"]
        inits = [numpy_helper.from_array(x, "b"), numpy_helper.from_array(np.asarray(scale), "s")]
        if zp is not None:
            inits.append(numpy_helper.from_array(np.zeros(256, np.int32), "z"))
        graph = helper.make_graph(
            [helper.make_node("DequantizeLinear", inputs, ["y"], name="dq", axis=0, **axis)],
            "g",
            [],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [256])],
            inits,
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
        result = onnx_qrewrite.rewrite(model, rules=FORM)
        assert result.report.by_rule() == {"qdq-to-float-fold-weights": 1}
        assert_bitwise_equal(run(result.model, {})["y"], run(model, {})["y"], "folded int32 bias")
    model.graph.initializer[-1].CopyFrom(numpy_helper.from_array(np.full(256, 3, np.int32), "z"))
    assert onnx_qrewrite.rewrite(model, rules=FORM).report.by_rule() == {}
