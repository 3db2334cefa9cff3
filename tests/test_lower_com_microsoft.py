"""onnxruntime's com.microsoft QuantizeLinear / DequantizeLinear -> the standard ops, bit for bit.

onnxruntime runs the contrib ops itself, so every case compares the original model and the
rewrite in the same runtime: every supported type, per-tensor and per-axis (with and without the
axis attribute, whose kernel default is 1), at the opsets where the standard op is legal, on inputs
with NaN, +-inf, ties and values far out of range.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import (
    assert_bitwise_equal,
    op_types,
    rule_marker,
    run,
    runtime_runs_int32_dequantize_with_zero_point,
)
from onnx import TensorProto, helper, numpy_helper

import onnx_qrewrite

NP = {
    "uint8": np.uint8,
    "int8": np.int8,
    "uint16": np.uint16,
    "int16": np.int16,
    "uint4": ml_dtypes.uint4,
    "int4": ml_dtypes.int4,
    "int32": np.int32,
}
TP = {
    "uint8": TensorProto.UINT8,
    "int8": TensorProto.INT8,
    "uint16": TensorProto.UINT16,
    "int16": TensorProto.INT16,
    "uint4": TensorProto.UINT4,
    "int4": TensorProto.INT4,
    "int32": TensorProto.INT32,
}
SHAPE = (4, 3, 5)

rng = np.random.default_rng(7)
X = (rng.standard_normal(SHAPE) * rng.choice([0.1, 3.0, 300.0, 1e5], SHAPE)).astype(np.float32)
X.flat[:10] = [np.nan, np.inf, -np.inf, 1e10, -1e10, 0.5, 1.5, -2.5, -0.0, 3.3e38]

# granularity -> (scale shape, axis attribute or None)
GRANULARITY = {
    "per-tensor": ((), None),
    "per-axis, no axis attribute (kernel default 1)": ((3,), None),
    "per-axis, axis=-1": ((5,), -1),
    "per-axis, axis=0": ((4,), 0),
}


def qdq_model(dtype: str, granularity: str, opset: int, *, with_zp: bool = True) -> onnx.ModelProto:
    """x -> com.microsoft QuantizeLinear -> q -> com.microsoft DequantizeLinear -> z."""
    shape, axis = GRANULARITY[granularity]
    attrs = {} if axis is None else {"axis": axis}
    lo, hi = (int(ml_dtypes.iinfo(NP[dtype]).min), int(ml_dtypes.iinfo(NP[dtype]).max))
    scale = np.asarray(rng.uniform(0.01, 2.0, shape), np.float32)
    zp = np.asarray(rng.integers(lo, hi + 1, shape)).astype(NP[dtype])
    inputs = ["x", "s", "zp"] if with_zp else ["x", "s"]
    nodes = [
        helper.make_node("QuantizeLinear", inputs, ["q"], name="q", domain="com.microsoft", **attrs),
        helper.make_node("DequantizeLinear", ["q", *inputs[1:]], ["z"], name="dq", domain="com.microsoft", **attrs),
    ]
    q_type = TP[dtype] if with_zp else TensorProto.UINT8
    outputs = [helper.make_tensor_value_info("z", TensorProto.FLOAT, SHAPE)]
    if "4" not in dtype:  # onnxruntime's Python API cannot return 4-bit tensors
        outputs.append(helper.make_tensor_value_info("q", q_type, SHAPE))
    inits = [numpy_helper.from_array(scale, "s")] + ([numpy_helper.from_array(zp, "zp")] if with_zp else [])
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE)], outputs, inits
    )
    ir = 10 if "4" in dtype else 8
    return helper.make_model(
        graph, ir_version=ir, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)]
    )


def assert_same_outputs(original: onnx.ModelProto, rewritten: onnx.ModelProto, feeds: dict, what: str) -> None:
    want, got = run(original, feeds), run(rewritten, feeds)
    assert set(got) == set(want)
    for name in want:
        assert_bitwise_equal(got[name], want[name], f"{what}, {name}")


CASES = [
    # (dtype, opset of the model, granularities)
    ("uint8", 10, ["per-tensor"]),
    ("int8", 10, ["per-tensor"]),
    *[(t, o, list(GRANULARITY)) for t in ("uint8", "int8") for o in (13, 21)],
    *[(t, 21, list(GRANULARITY)) for t in ("uint16", "int16", "uint4", "int4")],
]


@rule_marker("ms-q-standard", "positive")
@rule_marker("ms-dq-standard", "positive")
@pytest.mark.parametrize("dtype, opset, granularities", CASES, ids=[f"{t}-opset{o}" for t, o, _ in CASES])
def test_every_type_per_tensor_and_per_axis_becomes_the_standard_op(dtype, opset, granularities):
    for granularity in granularities:
        what = f"{dtype}, opset {opset}, {granularity}"
        original = qdq_model(dtype, granularity, opset)
        result = onnx_qrewrite.rewrite(original)
        assert op_types(result.model) == ["QuantizeLinear", "DequantizeLinear"], what
        assert [n.domain for n in result.model.graph.node] == ["", ""], what
        assert {o.domain: o.version for o in result.model.opset_import} == {"": opset}, what
        assert result.report.by_rule() == {"ms-q-standard": 1, "ms-dq-standard": 1}, what
        axes = [{a.name: a.i for a in n.attribute}.get("axis") for n in result.model.graph.node]
        shape, axis = GRANULARITY[granularity]
        assert axes == [None, None] if not shape else [1 if axis is None else axis] * 2, what
        assert_same_outputs(original, result.model, {"x": X}, what)


def test_without_zero_point_the_type_is_uint8():
    original = qdq_model("uint8", "per-tensor", 13, with_zp=False)
    result = onnx_qrewrite.rewrite(original)
    assert op_types(result.model) == ["QuantizeLinear", "DequantizeLinear"]
    assert [len(n.input) for n in result.model.graph.node] == [2, 2]
    assert_same_outputs(original, result.model, {"x": X}, "no zero point")


@pytest.mark.parametrize(
    ("zp", "opset"), [(np.int32(0), 10), (np.int32(3), 13), (np.array([5, -5], np.int32), 13)], ids=str
)
def test_int32_dequantize_including_its_wraparound(zp, opset):
    # Same kernel as the standard op: x - zp wraps in int32 on both sides.
    x = np.array([-(2**31), 2**31 - 1, 0, 1, -1, 123456789], np.int32)
    shape = (3, 2) if zp.ndim else (6,)
    scale = np.full(zp.shape, 0.037, np.float32)
    node = helper.make_node(
        "DequantizeLinear",
        ["x", "s", "zp"],
        ["y"],
        name="dq",
        domain="com.microsoft",
        **({"axis": 1} if zp.ndim else {}),
    )
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.INT32, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        [numpy_helper.from_array(scale, "s"), numpy_helper.from_array(zp, "zp")],
    )
    original = helper.make_model(
        graph, ir_version=8, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)]
    )
    result = onnx_qrewrite.rewrite(original)
    assert op_types(result.model) == ["DequantizeLinear"]
    if np.any(zp != 0) and not runtime_runs_int32_dequantize_with_zero_point():
        # The runtime refuses the original too: there is nothing to compare against.
        pytest.skip(f"onnxruntime {ort.__version__} refuses int32 DequantizeLinear with a nonzero zero point")
    assert_same_outputs(original, result.model, {"x": x.reshape(shape)}, f"int32 zp={zp}")


@pytest.mark.parametrize("dtype", ["uint16", "int16"])
def test_16_bit_below_opset_21_raises_the_opset_with_the_version_converter(dtype):
    original = qdq_model(dtype, "per-axis, no axis attribute (kernel default 1)", 17)
    result = onnx_qrewrite.rewrite(original)
    assert op_types(result.model) == ["QuantizeLinear", "DequantizeLinear"]
    assert [(c.domain, c.before, c.after) for c in result.report.opset_changes] == [
        ("", 17, 21),
        ("com.microsoft", 1, None),
    ]
    assert_same_outputs(original, result.model, {"x": X}, dtype)


@rule_marker("ms-q-decompose", "positive")
@rule_marker("ms-dq-decompose", "positive")
@rule_marker("ms-q-standard", "negative")
@rule_marker("ms-dq-standard", "negative")
@pytest.mark.parametrize("dtype", ["uint16", "int16"])
@pytest.mark.parametrize("granularity", list(GRANULARITY))
def test_16_bit_with_the_opset_kept_decomposes_with_onnxruntimes_saturation(dtype, granularity):
    # Saturating semantics (overflow = "saturate"): +-inf saturate, NaN gives qmin, like the kernel.
    original = qdq_model(dtype, granularity, 17)
    result = onnx_qrewrite.rewrite(original, keep_opset=True)
    ops = op_types(result.model)
    assert "QuantizeLinear" not in ops and "DequantizeLinear" not in ops
    assert ops[:2] == ["Div", "Round"] and "IsNaN" in ops and ops[-1] == "Mul"
    assert result.model.opset_import[0].version == 17
    assert_same_outputs(original, result.model, {"x": X}, f"{dtype}, {granularity}, opset kept")
    reasons = {
        u.node: u.reasons
        for u in onnx_qrewrite.rewrite(
            original, keep_opset=True, allow_unlowered=True, only=["ms-q-standard"]
        ).report.unlowered
    }
    assert reasons["q"] == ("ms-q-standard: needs opset 21, model has 17 and the opset is kept",)
    # The DequantizeLinear no rule of `only` names is said too, not kept silently.
    assert set(reasons) == {"q", "dq"} and "no rule of the catalogue lowers" in reasons["dq"][0], reasons


@rule_marker("ms-q-decompose", "negative")
@rule_marker("ms-dq-decompose", "negative")
def test_4_bit_types_with_the_opset_kept_cannot_be_lowered():
    with pytest.raises(onnx_qrewrite.LoweringError) as exc:
        onnx_qrewrite.rewrite(qdq_model("int4", "per-tensor", 17), keep_opset=True)
    message = str(exc.value)
    assert message.startswith("node q (com.microsoft::QuantizeLinear) cannot be lowered: ")
    assert "ms-q-standard: needs opset 21, model has 17 and the opset is kept" in message
    assert "ms-q-decompose: dtype int4 is not one of int16, int8, uint16, uint8" in message
    assert exc.value.exit_code == 4
