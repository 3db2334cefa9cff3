"""com.microsoft QuantizeLinear / DequantizeLinear with float16 x or scale, and dequantize with the
opset kept at 10-12: lowered exactly, against the contrib kernels in the same onnxruntime.

Every float16 bit pattern (65,536 values, NaN, ±inf and subnormals included) is quantized; every
value of the quantized type is dequantized. The contrib kernels compute in float32: the standard
DequantizeLinear's float16 kernel (opset 19) agrees bit for bit, the standard QuantizeLinear's does
not (+inf -> 0 for unsigned types, NaN -> qmax for signed ones), which the decomposition fixes.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_bitwise_equal, op_types, rule_marker, run
from onnx import TensorProto, helper, numpy_helper

import onnx_qrewrite

TP = {"uint8": TensorProto.UINT8, "int8": TensorProto.INT8, "uint16": TensorProto.UINT16, "int16": TensorProto.INT16}
ZP = {"uint8": 128, "int8": -3, "uint16": 30000, "int16": -100}
ALL_FLOAT16 = np.arange(65536, dtype=np.uint16).view(np.float16)


def model(direction: str, dtype: str, opset: int, scale, *, axis: int | None = None, shape=(65536,), float16=True):
    float_type = TensorProto.FLOAT16 if float16 else TensorProto.FLOAT
    np_float = np.float16 if float16 else np.float32
    scale = np.asarray(scale, np_float)
    zp = np.full(scale.shape, ZP[dtype]).astype(dtype)
    attrs = {} if axis is None else {"axis": axis}
    inits = [numpy_helper.from_array(scale, "s"), numpy_helper.from_array(zp, "z")]
    if direction == "quantize":
        node = helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"], name="q", domain="com.microsoft", **attrs)
        io = (float_type, TP[dtype])
    else:
        node = helper.make_node("DequantizeLinear", ["x", "s", "z"], ["y"], name="dq", domain="com.microsoft", **attrs)
        io = (TP[dtype], float_type)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", io[0], list(shape))],
        [helper.make_tensor_value_info("y", io[1], list(shape))],
        inits,
    )
    return helper.make_model(
        graph, ir_version=9, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)]
    )


SCALES = [0.0123, 1.0, 3.5, 1e-4, 60000.0]
QUANTIZE_CASES = [(t, o, k) for t in TP for o in ((17, 21) if t.endswith("8") else (21,)) for k in (False, True)]


@rule_marker("ms-q-decompose", "positive")
@rule_marker("ms-q-standard", "negative")
@pytest.mark.parametrize(
    "dtype, opset, keep", QUANTIZE_CASES, ids=[f"{t}-opset{o}-keep{k}" for t, o, k in QUANTIZE_CASES]
)
def test_float16_quantize_is_decomposed_in_float32_bit_exact(dtype, opset, keep):
    for scale in SCALES:
        original = model("quantize", dtype, opset, scale)
        result = onnx_qrewrite.rewrite(original, keep_opset=keep)
        assert result.report.by_rule() == {"ms-q-decompose": 1}
        ops = op_types(result.model)
        assert ops[:3] == ["Cast", "Cast", "Div"] and "QuantizeLinear" not in ops
        feeds = {"x": ALL_FLOAT16}
        assert_bitwise_equal(run(result.model, feeds)["y"], run(original, feeds)["y"], f"{dtype}, scale {scale}")
    reasons = onnx_qrewrite.rewrite(original, allow_unlowered=True, only=["ms-q-standard"]).report.unlowered
    assert "float16 kernel differs from the contrib one" in reasons[0].reasons[0]


DEQUANTIZE_CASES = [(t, o) for t in TP for o in ((13, 19, 21) if t.endswith("8") else (21,))]


@rule_marker("ms-dq-standard", "positive")
@rule_marker("ms-dq-decompose", "positive")
@pytest.mark.parametrize("dtype, opset", DEQUANTIZE_CASES, ids=[f"{t}-opset{o}" for t, o in DEQUANTIZE_CASES])
@pytest.mark.parametrize("keep", [False, True])
def test_float16_dequantize_is_the_standard_op_from_opset_19_or_exactly_decomposed(dtype, opset, keep):
    info = np.iinfo(dtype)
    x = np.arange(info.min, info.max + 1).astype(dtype)
    for scale in [*SCALES, 6e-8]:
        original = model("dequantize", dtype, opset, scale, shape=x.shape)
        result = onnx_qrewrite.rewrite(original, keep_opset=keep)
        standard = opset >= 19 or not keep
        assert result.report.by_rule() == ({"ms-dq-standard": 1} if standard else {"ms-dq-decompose": 1})
        decomposed = ["Cast", "Cast", "Cast", "Sub", "Mul", "Cast"]  # scale, x, zero point to float32; y to float16
        assert op_types(result.model) == (["DequantizeLinear"] if standard else decomposed)
        assert result.model.opset_import[0].version == (max(opset, 19) if not keep else opset)
        feeds = {"x": x}
        assert_bitwise_equal(run(result.model, feeds)["y"], run(original, feeds)["y"], f"{dtype}, scale {scale}")


@rule_marker("ms-dq-decompose", "positive")
@pytest.mark.parametrize("dtype", ["uint8", "int8"])
@pytest.mark.parametrize("float16", [False, True])
def test_per_axis_dequantize_with_the_opset_kept_at_10_is_decomposed(dtype, float16):
    # DequantizeLinear has no axis before opset 13: keeping opset 10 used to refuse the node.
    info = np.iinfo(dtype)
    x = np.random.default_rng(0).integers(info.min, info.max + 1, (3, 4, 5)).astype(dtype)
    scale = np.array([0.5, 0.0123, 3.0, 1e-3], np.float32)
    original = model("dequantize", dtype, 10, scale, axis=1, shape=x.shape, float16=float16)
    result = onnx_qrewrite.rewrite(original, keep_opset=True)
    assert result.report.by_rule() == {"ms-dq-decompose": 1}
    assert result.model.opset_import[0].version == 10
    assert "DequantizeLinear" not in op_types(result.model)
    assert_bitwise_equal(run(result.model, {"x": x})["y"], run(original, {"x": x})["y"], f"{dtype} per-axis")


@rule_marker("ms-dq-decompose", "negative")
def test_int32_per_axis_dequantize_at_opset_10_stays_an_error():
    # The contrib kernel subtracts in int32 (wraps); the decomposition would not: not claimed.
    x = np.zeros((2, 3), np.int32)
    graph = helper.make_graph(
        [helper.make_node("DequantizeLinear", ["x", "s", "z"], ["y"], name="dq", domain="com.microsoft", axis=1)],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.INT32, list(x.shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(x.shape))],
        [
            numpy_helper.from_array(np.ones(3, np.float32), "s"),
            numpy_helper.from_array(np.array([1, 2, 3], np.int32), "z"),
        ],
    )
    original = helper.make_model(
        graph, ir_version=8, opset_imports=[helper.make_opsetid("", 10), helper.make_opsetid("com.microsoft", 1)]
    )
    with pytest.raises(onnx_qrewrite.LoweringError) as exc:
        onnx_qrewrite.rewrite(original, keep_opset=True)
    assert "ms-dq-decompose: dtype int32 is not one of int16, int8, uint16, uint8" in str(exc.value)


def test_quark_ops_still_refuse_float16_x():
    # Quark's kernels take float32 x and scale only: the option is the com.microsoft rules' alone.
    graph = helper.make_graph(
        [helper.make_node("ExtendedQuantizeLinear", ["x", "s", "z"], ["y"], name="q", domain="com.amd.quark")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [4])],
        [helper.make_tensor_value_info("y", TensorProto.UINT8, [4])],
        [numpy_helper.from_array(np.array(0.5, np.float16), "s"), numpy_helper.from_array(np.array(3, np.uint8), "z")],
    )
    original = helper.make_model(
        graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.amd.quark", 1)]
    )
    with pytest.raises(onnx_qrewrite.LoweringError, match="x 'x' is float16; only float32 is supported"):
        onnx_qrewrite.rewrite(original)
