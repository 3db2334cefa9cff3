"""The "float-emulation" form: standard QuantizeLinear / DequantizeLinear computed in float
arithmetic, bit for bit against onnxruntime's own kernels, and applied only when asked for."""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import pytest
from conftest import assert_bitwise_equal, rule_marker, run
from onnx import TensorProto, helper, numpy_helper

import onnx_qrewrite
from onnx_qrewrite.errors import UsageError
from onnx_qrewrite.rewriter.catalogue import load_catalogue, named_form

NP = {"uint8": np.uint8, "int8": np.int8, "uint16": np.uint16, "int16": np.int16}
TP = {"uint8": TensorProto.UINT8, "int8": TensorProto.INT8, "uint16": TensorProto.UINT16, "int16": TensorProto.INT16}
FLOATS = {"float32": (np.float32, TensorProto.FLOAT), "float16": (np.float16, TensorProto.FLOAT16)}
FORM = load_catalogue([named_form("float-emulation")])

#: Scales from the smallest denormal to the largest float32, and ordinary ones.
SCALES = [1e-45, 1e-38, 3e-5, 0.0078125, 0.1, 0.37, 1.0, 3.0, 1e10, 1e38, 3.4e38]


def _edge_inputs(float_type) -> np.ndarray:
    if float_type is np.float16:  # every float16 bit pattern
        return np.arange(2**16, dtype=np.uint16).view(np.float16)
    rng = np.random.default_rng(3)
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e38, -1e38, 3.4e38, 1e-45, -1e-45, 1e-38, 0.5, 1.5, 2.5, -0.5]
    ties = (np.arange(-600, 600) + 0.5).astype(np.float32)
    spread = (rng.standard_normal(20000) * 10.0 ** rng.integers(-6, 8, 20000)).astype(np.float32)
    return np.concatenate([np.asarray(special, np.float32), ties, spread])


def _model(op: str, qtype: str, ftype: str, scale, zp, x_shape, axis: int | None) -> onnx.ModelProto:
    fnp, ftp = FLOATS[ftype]
    x_type = ftp if op == "QuantizeLinear" else TP[qtype]
    y_type = TP[qtype] if op == "QuantizeLinear" else ftp
    inits = [numpy_helper.from_array(np.asarray(scale, fnp), "s")]
    inputs = ["x", "s"]
    if zp is not None:
        inits.append(numpy_helper.from_array(np.asarray(zp, NP[qtype]), "z"))
        inputs.append("z")
    attrs = {"axis": axis} if axis is not None else {}
    opset = 21 if qtype in ("uint16", "int16") else 19
    graph = helper.make_graph(
        [helper.make_node(op, inputs, ["y"], **attrs)],
        "g",
        [helper.make_tensor_value_info("x", x_type, x_shape)],
        [helper.make_tensor_value_info("y", y_type, x_shape)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


def _zero_points(qtype: str, quantize: bool) -> list:
    """Absent (QuantizeLinear without one gives uint8), 0, the extremes and one in between."""
    lo, hi = np.iinfo(NP[qtype]).min, np.iinfo(NP[qtype]).max
    absent = [None] if qtype == "uint8" or not quantize else []
    return [*absent, 0, lo, hi, (int(lo) + int(hi)) // 3]


@rule_marker("float-emulation-q", "positive")
@pytest.mark.parametrize("ftype", list(FLOATS))
@pytest.mark.parametrize("qtype", list(NP))
def test_quantize_emulation_is_bit_exact_per_tensor(qtype, ftype):
    fnp = FLOATS[ftype][0]
    x = _edge_inputs(fnp)
    scales = SCALES if ftype == "float32" else [6e-8, 1e-3, 0.37, 1.0, 3.0, 65504.0]
    for scale, zp in itertools.product(scales, _zero_points(qtype, True)):
        model = _model("QuantizeLinear", qtype, ftype, scale, zp, list(x.shape), None)
        result = onnx_qrewrite.rewrite(model, rules=FORM)
        assert result.report.by_rule() == {"float-emulation-q": 1}
        assert "QuantizeLinear" not in [n.op_type for n in result.model.graph.node]
        what = f"{qtype} {ftype} scale {scale} zp {zp}"
        assert_bitwise_equal(run(result.model, {"x": x})["y"], run(model, {"x": x})["y"], what)


@rule_marker("float-emulation-dq", "positive")
@pytest.mark.parametrize("ftype", list(FLOATS))
@pytest.mark.parametrize("qtype", list(NP))
def test_dequantize_emulation_is_bit_exact_per_tensor(qtype, ftype):
    info = np.iinfo(NP[qtype])
    x = np.arange(info.min, info.max + 1).astype(NP[qtype])  # every value of the type
    scales = SCALES if ftype == "float32" else [6e-8, 1e-3, 0.37, 1.0, 3.0, 65504.0]
    for scale, zp in itertools.product(scales, _zero_points(qtype, False)):
        model = _model("DequantizeLinear", qtype, ftype, scale, zp, list(x.shape), None)
        result = onnx_qrewrite.rewrite(model, rules=FORM)
        assert result.report.by_rule() == {"float-emulation-dq": 1}
        what = f"{qtype} {ftype} scale {scale} zp {zp}"
        assert_bitwise_equal(run(result.model, {"x": x})["y"], run(model, {"x": x})["y"], what)


@pytest.mark.parametrize("op", ["QuantizeLinear", "DequantizeLinear"])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_per_axis_emulation_is_bit_exact(op, axis):
    rng = np.random.default_rng(9)
    shape = [3, 4, 5]
    n = shape[axis]
    scale = rng.uniform(0.001, 2.0, n).astype(np.float32)
    zp = rng.integers(-100, 100, n).astype(np.int8)
    model = _model(op, "int8", "float32", scale, zp, shape, axis)
    if op == "QuantizeLinear":
        x = (rng.standard_normal(shape) * 100).astype(np.float32)
    else:
        x = rng.integers(-128, 128, shape).astype(np.int8)
    result = onnx_qrewrite.rewrite(model, rules=FORM)
    assert_bitwise_equal(run(result.model, {"x": x})["y"], run(model, {"x": x})["y"], f"{op} axis {axis}")


@rule_marker("float-emulation-q", "negative")
@rule_marker("float-emulation-dq", "negative")
@rule_marker("float-emulation-qdq-pair", "negative")
def test_the_form_is_not_applied_by_default_and_gives_way_where_it_cannot_emulate():
    model = _model("QuantizeLinear", "uint8", "float32", 0.1, 3, [4], None)
    assert onnx_qrewrite.rewrite(model).report.by_rule() == {}  # standard Q/DQ is the default target form
    # A DequantizeLinear of a graph input is no pair: its own rule applies.
    lone = _model("DequantizeLinear", "uint8", "float32", 0.1, 3, [4], None)
    assert onnx_qrewrite.rewrite(lone, rules=FORM).report.by_rule() == {"float-emulation-dq": 1}
    # float16 pairs are emulated node by node
    half = _pair("uint8", 0.1, 3, 0.1, 3, [4], None)
    half.graph.input[0].type.tensor_type.elem_type = TensorProto.FLOAT16
    half.graph.output[0].type.tensor_type.elem_type = TensorProto.FLOAT16
    for name in ("sq", "sd"):
        t = next(i for i in half.graph.initializer if i.name == name)
        t.CopyFrom(numpy_helper.from_array(np.float16(0.1), name))
    by_rule = onnx_qrewrite.rewrite(half, rules=FORM).report.by_rule()
    assert by_rule == {"float-emulation-q": 1, "float-emulation-dq": 1}, by_rule
    # Blocked quantization is not emulated: the standard node stays as it is, without an error.
    blocked = _model("DequantizeLinear", "int8", "float32", np.ones((2, 2), np.float32), None, [2, 4], 1)
    blocked.graph.node[0].attribute.append(helper.make_attribute("block_size", 2))
    blocked.opset_import[0].version = 21
    result = onnx_qrewrite.rewrite(blocked, rules=FORM)
    assert result.report.by_rule() == {} and not result.report.unlowered
    assert [n.op_type for n in result.model.graph.node] == ["DequantizeLinear"]


def test_an_unknown_form_is_a_usage_error_naming_the_known_ones():
    with pytest.raises(UsageError, match="did you mean 'float-emulation'"):
        named_form("float-emulaton")


@pytest.mark.parametrize("op", ["QuantizeLinear", "DequantizeLinear"])
def test_bfloat16_follows_the_onnx_definition_with_one_rounding(op):
    """onnxruntime has no bfloat16 QuantizeLinear/DequantizeLinear kernel to be exact against: the
    form computes the definition in float32 and rounds once to nearest even (numpy + ml_dtypes)."""
    import ml_dtypes

    bf16 = ml_dtypes.bfloat16
    scale, zp = bf16(0.37), np.int8(-7)
    inits = [
        helper.make_tensor("s", TensorProto.BFLOAT16, [], [float(scale)]),
        numpy_helper.from_array(np.asarray(zp), "z"),
    ]
    if op == "QuantizeLinear":
        x = np.arange(2**16, dtype=np.uint16).view(bf16)  # every bfloat16 bit pattern
        x_type, y_type = TensorProto.BFLOAT16, TensorProto.INT8
        # Every bit pattern includes ±inf and NaN and values whose quotient overflows: inf and NaN
        # are the IEEE results the definition's clip and NaN case below then handle.
        with np.errstate(over="ignore", invalid="ignore"):
            r = np.round(x.astype(np.float32) / np.float32(scale))
            expected = np.where(np.isnan(r), -128, np.clip(r + np.float32(zp), -128, 127)).astype(np.int8)
    else:
        x = np.arange(-128, 128).astype(np.int8)
        x_type, y_type = TensorProto.INT8, TensorProto.BFLOAT16
        expected = ((x.astype(np.float32) - np.float32(zp)) * np.float32(scale)).astype(bf16)
    # onnxruntime's Python API cannot feed or fetch bfloat16: cross the boundary as float32 (exact).
    nodes = [helper.make_node(op, ["xb" if op == "QuantizeLinear" else "x", "s", "z"], ["y"])]
    if op == "QuantizeLinear":
        nodes.insert(0, helper.make_node("Cast", ["x"], ["xb"], to=TensorProto.BFLOAT16))
        x_type, feed = TensorProto.FLOAT, x.astype(np.float32)
        outputs = [helper.make_tensor_value_info("y", y_type, list(x.shape))]
    else:
        nodes.append(helper.make_node("Cast", ["y"], ["y32"], to=TensorProto.FLOAT))
        feed, expected = x, expected.astype(np.float32)
        outputs = [helper.make_tensor_value_info("y32", TensorProto.FLOAT, list(x.shape))]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", x_type, list(x.shape))], outputs, inits)
    graph.value_info.append(helper.make_tensor_value_info("xb", TensorProto.BFLOAT16, list(x.shape)))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)
    result = onnx_qrewrite.rewrite(model, rules=FORM)
    assert result.report.by_rule() == {f"float-emulation-{'q' if op == 'QuantizeLinear' else 'dq'}": 1}
    (actual,) = run(result.model, {"x": feed}).values()
    assert_bitwise_equal(actual, expected, f"bfloat16 {op}")


def _pair(qtype: str, scale_q, zp_q, scale_dq, zp_dq, shape, axis: int | None, q_is_output: bool = False):
    """x -> QuantizeLinear -> DequantizeLinear -> y (float32), the QuantizeLinear's output also a
    graph output when asked."""
    inits = [
        numpy_helper.from_array(np.asarray(scale_q, np.float32), "sq"),
        numpy_helper.from_array(np.asarray(zp_q, NP[qtype]), "zq"),
        numpy_helper.from_array(np.asarray(scale_dq, np.float32), "sd"),
        numpy_helper.from_array(np.asarray(zp_dq, NP[qtype]), "zd"),
    ]
    attrs = {"axis": axis} if axis is not None else {}
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)]
    if q_is_output:
        outputs.append(helper.make_tensor_value_info("q", TP[qtype], shape))
    graph = helper.make_graph(
        [
            helper.make_node("QuantizeLinear", ["x", "sq", "zq"], ["q"], name="quant", **attrs),
            helper.make_node("DequantizeLinear", ["q", "sd", "zd"], ["y"], name="dequant", **attrs),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        outputs,
        inits,
    )
    opset = 21 if qtype in ("uint16", "int16") else 19
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


@rule_marker("float-emulation-qdq-pair", "positive")
@rule_marker("float-emulation-q-unread", "positive")
@pytest.mark.parametrize("qtype", list(NP))
def test_a_quantize_dequantize_pair_is_one_float_expression_bit_exact(qtype):
    """No integer tensor is left between the two (TensorRT refuses uint8 inside the network), and
    the result is onnxruntime's Q then DQ bit for bit: the Casts the node rules put between them
    are identities on the integer-valued floats the Clip leaves."""
    x = _edge_inputs(np.float32)
    lo, hi = np.iinfo(NP[qtype]).min, np.iinfo(NP[qtype]).max
    for scale, (zq, zd) in itertools.product(SCALES, [(0, 0), (lo, lo), (hi, hi), (hi // 3, lo // 5)]):
        model = _pair(qtype, scale, zq, min(scale * 1.5, 3.4e38), zd, list(x.shape), None)
        result = onnx_qrewrite.rewrite(model, rules=FORM)
        assert result.report.by_rule() == {"float-emulation-qdq-pair": 1, "float-emulation-q-unread": 1}
        types = {n.op_type for n in result.model.graph.node}
        assert not types & {"QuantizeLinear", "DequantizeLinear", "Cast"}, types
        what = f"{qtype} scale {scale} zero points {zq}, {zd}"
        assert_bitwise_equal(run(result.model, {"x": x})["y"], run(model, {"x": x})["y"], what)


@rule_marker("float-emulation-qdq-pair", "positive")
@rule_marker("float-emulation-q-unread", "negative")
def test_a_pair_per_axis_and_a_quantized_value_read_elsewhere():
    rng = np.random.default_rng(4)
    shape = [3, 4, 5]
    scale = rng.uniform(0.001, 2.0, 4).astype(np.float32)
    zp = rng.integers(0, 255, 4).astype(np.uint8)
    model = _pair("uint8", scale, zp, scale, zp, shape, 1)
    x = (rng.standard_normal(shape) * 100).astype(np.float32)
    result = onnx_qrewrite.rewrite(model, rules=FORM)
    assert result.report.by_rule() == {"float-emulation-qdq-pair": 1, "float-emulation-q-unread": 1}
    assert_bitwise_equal(run(result.model, {"x": x})["y"], run(model, {"x": x})["y"], "per-axis pair")
    # The quantized value is also a graph output: the QuantizeLinear stays (its own float rule).
    shared = _pair("uint8", 0.1, 7, 0.1, 7, [4], None, q_is_output=True)
    result = onnx_qrewrite.rewrite(shared, rules=FORM)
    assert result.report.by_rule() == {"float-emulation-qdq-pair": 1, "float-emulation-q": 1}
    x = np.linspace(-20, 20, 4, dtype=np.float32)
    got, want = run(result.model, {"x": x}), run(shared, {"x": x})
    for name in ("y", "q"):
        assert_bitwise_equal(got[name], want[name], name)
