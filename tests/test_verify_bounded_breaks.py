"""Broken *bounded* rewrites of integer matmul/conv and QLinear ops are caught by verify at the node
that breaks its declared bound (the per-node check of verify/bounds.py: each replacement run alone
on the original's own inputs), and the correct rewrites pass the same check: the bound is tight
enough to tell them apart. Where a break is smaller than the bound (one ulp of a scale, one step of
a zero point in a rule bounded by one step), the per-node check cannot see it by construction; the
last test pins that resolution down so the README's claim stays true (the named form qlinear-exact
rewrites QLinearConv/QLinearMatMul/QGemm exactly, and there a one-ulp scale is caught:
tests/test_lower_qlinear_integer.py).

(Exact rules are caught element-wise: tests/test_verify_breakage.py. Bounds that vary per element
-- MatMulNBits' 2*gamma(K+1)*sum|a*w|, onnxruntime's u8 x s8 pair excess -- are checked per element
at the node too: tests/test_lower_matmul_nbits.py, tests/test_u8s8_saturation.py.)"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from _int_matmul_helpers import conv_model, matmul_model
from _verify_helpers import node_row
from onnx import TensorProto, helper, numpy_helper

import onnx_qrewrite
from onnx_qrewrite.errors import EXIT_DISAGREE
from onnx_qrewrite.verify import verify

FULL_RANGE = (0, 255)  # integer inputs default to {0, 1}: the sums must be large to matter


def _bounded_matmul_integer() -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """MatMulInteger, K = 1024, uint8 with zero points 7 and 130: sums beyond 2^24, so (the int32
    rule skipped) the bounded float form applies."""
    b = np.random.default_rng(0).integers(0, 256, (1024, 8)).astype(np.uint8)
    model, _ = matmul_model("uint8", "uint8", (2, 1024), b, np.array(7, np.uint8), np.array(130, np.uint8))
    result = onnx_qrewrite.rewrite(model, skip=["int-matmul-int32"])
    assert result.report.by_rule() == {"int-matmul-float-bounded": 1}
    return model, result.model


def _bounded_conv_integer() -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """ConvInteger over 64 channels x 3x3 (576 terms of up to 255^2) with W computed at run time
    (a graph input): ONNX Conv has no integer form, so bounded."""
    w = np.zeros((2, 64, 3, 3), np.uint8)  # only its shape and type: W is an input
    model, _ = conv_model(
        "uint8",
        "uint8",
        (1, 64, 4, 4),
        w,
        np.array(3, np.uint8),
        np.array(140, np.uint8),
        {"pads": [1, 1, 1, 1]},
        w_const=False,
    )
    result = onnx_qrewrite.rewrite(model)
    assert result.report.by_rule() == {"int-matmul-float-bounded": 1}
    return model, result.model


def _qlinear_matmul() -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """QLinearMatMul, uint8, scales chosen so the outputs stay mostly inside [0, 255]."""
    b = np.random.default_rng(2).integers(0, 256, (64, 16)).astype(np.uint8)
    values = {
        "a_scale": np.float32(0.02),
        "a_zp": np.uint8(120),
        "B": b,
        "b_scale": np.float32(0.01),
        "b_zp": np.uint8(128),
        "y_scale": np.float32(0.2),
        "y_zp": np.uint8(128),
    }
    node = helper.make_node("QLinearMatMul", ["A", *values], ["Y"], name="qmm")
    graph = helper.make_graph(
        [node],
        "qlinear",
        [helper.make_tensor_value_info("A", TensorProto.UINT8, [4, 64])],
        [helper.make_tensor_value_info("Y", TensorProto.UINT8, [4, 16])],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in values.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    result = onnx_qrewrite.rewrite(model)
    assert result.report.by_rule() == {"qop-matmul": 1}
    return model, result.model


MAKERS = {
    "MatMulInteger": _bounded_matmul_integer,
    "ConvInteger": _bounded_conv_integer,
    "QLinearMatMul": _qlinear_matmul,
}


def _origin(model: onnx.ModelProto) -> str:
    (node,) = model.graph.node
    return node.name


def _constant(model: onnx.ModelProto, name: str) -> np.ndarray:
    return numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == name))


def _break(rewritten: onnx.ModelProto, how: str) -> onnx.ModelProto:
    """One bug in the replacement: the weight's zero point dropped (the operand read as is)."""
    broken = onnx.ModelProto()
    broken.CopyFrom(rewritten)
    nodes = list(broken.graph.node)
    if how == "weight zero point dropped":
        dq = [n for n in nodes if n.op_type == "DequantizeLinear"]
        if dq:  # QLinear: DequantizeLinear(B, scale, zp) -> without zp
            del dq[1].input[2]
            return broken
        # integer forms: what read Sub(Cast(W), Cast(zp)) reads Cast(W) instead
        sub = [n for n in nodes if n.op_type == "Sub"][1]
        cast_w = sub.input[0]
        for node in nodes:
            for i, name in enumerate(node.input):
                if name == sub.output[0]:
                    node.input[i] = cast_w
        return broken
    raise AssertionError(how)


@pytest.mark.parametrize("op", list(MAKERS))
def test_a_correct_bounded_rewrite_passes_its_per_node_check(op):
    original, rewritten = MAKERS[op]()
    report = verify(original, rewritten, int_range=FULL_RANGE)
    assert report.passed, report.to_table()
    row = node_row(report, _origin(original))
    assert row.integer and row.tolerance.lsb >= 1 and row.max_abs_error <= row.tolerance.lsb


@pytest.mark.parametrize("op", list(MAKERS))
def test_a_dropped_weight_zero_point_breaks_the_bound_at_its_node(op):
    original, rewritten = MAKERS[op]()
    good = node_row(verify(original, rewritten, int_range=FULL_RANGE), _origin(original))
    report = verify(original, _break(rewritten, "weight zero point dropped"), int_range=FULL_RANGE)
    assert report.exit_code == EXIT_DISAGREE
    row = node_row(report, _origin(original))
    assert not row.passed, report.to_table()
    # Tight enough: the correct replacement stays within the bound, the broken one goes beyond it.
    assert good.max_abs_error <= row.tolerance.lsb < row.max_abs_error
    assert f"rule {'qop-matmul' if op == 'QLinearMatMul' else 'int-matmul-float-bounded'}" in row.name


def test_the_bound_is_far_below_what_a_zero_point_off_by_one_does_in_integer_matmul():
    """MatMulInteger's bound (float32 rounding of sums near 2^26, ~1e3) against the smallest zero
    point bug, off by one: it moves every output by a column sum of the other operand (~1e5)."""
    original, rewritten = _bounded_matmul_integer()
    broken = onnx.ModelProto()
    broken.CopyFrom(rewritten)
    found = 0
    for t in broken.graph.initializer:
        value = numpy_helper.to_array(t)
        if value.ndim == 0 and value == 130:  # the zero point, in whatever type the rewrite computes in
            t.CopyFrom(numpy_helper.from_array(np.asarray(131, value.dtype), t.name))
            found += 1
    assert found == 1
    report = verify(original, broken, int_range=FULL_RANGE)
    row = node_row(report, "mmi")
    assert not row.passed and row.max_abs_error > 50 * row.tolerance.lsb, report.to_table()


def test_breaks_smaller_than_one_step_are_below_the_resolution_of_a_one_step_bound():
    """QLinear rules are bounded by one quantization step (fixed-point requantization against
    float), so a replacement one step off anywhere passes its per-node check: here the output
    zero point off by one and the output scale one ulp off. Both change values (the first every
    one), and both stay within the bound: the per-node check cannot see them, by construction."""
    original, rewritten = _qlinear_matmul()
    for change in ("zero point + 1", "scale + 1 ulp"):
        broken = onnx.ModelProto()
        broken.CopyFrom(rewritten)
        q = next(n for n in broken.graph.node if n.op_type == "QuantizeLinear")
        index = 2 if change.startswith("zero") else 1
        value = _constant(broken, q.input[index])
        new = value + np.uint8(1) if index == 2 else np.nextafter(value, np.float32(1))
        name = f"{q.input[index]}_broken"
        broken.graph.initializer.append(numpy_helper.from_array(np.asarray(new, value.dtype), name))
        q.input[index] = name
        report = verify(original, broken, int_range=FULL_RANGE)
        row = node_row(report, "qmm")
        assert row.passed and row.tolerance.lsb == 1, (change, report.to_table())
        if index == 2:
            assert row.exact_match_rate < 0.5 and row.max_abs_error == 1  # every unsaturated value moved
