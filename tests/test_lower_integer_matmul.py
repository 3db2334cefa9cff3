"""MatMulInteger, ConvInteger, MatMulIntegerToFloat, DynamicQuantizeMatMul -> standard float (or
int32) arithmetic, against onnxruntime's own kernels and the ONNX definition (int64 numpy).

The MatMulInteger and ConvInteger batteries run the tables of _int_matmul_helpers.py (every dtype
pair, zero points absent / zero / non-zero / extreme, per-tensor and per-column/per-channel,
constant and runtime weights and zero points, edge values), which the float-emulation form's tests
(test_float_emulation_int_matmul.py) run too; the tests here add shapes where the 2^24 bound holds
and where it does not. Each case asserts exactly what the applied rule declares.

onnxruntime's uint8 x int8 kernels saturate adjacent product pairs to int16 on x86 without VNNI
(rule file notes): where that can happen the original is compared with a numpy emulation of that
saturation as well, and the rewrite with the ONNX definition.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from _int_matmul_helpers import (
    CONV_CASES,
    MATMUL_CASES,
    NP,
    ONNX,
    ConvCase,
    MatMulCase,
    case_id,
    conv_model,
    conv_reference,
    matmul_model,
    rng_for,
    saturating_matmul,
    values,
    zero_point,
)
from conftest import assert_bitwise_equal, op_types, rule_marker, run, session, u8s8_saturates_here
from onnx import TensorProto as T
from onnx import helper, numpy_helper

import onnx_qrewrite
from onnx_qrewrite.errors import LoweringError
from onnx_qrewrite.rewriter import u8s8
from onnx_qrewrite.rewriter.builders.integer_matmul import float32_sum_bound

#: What must be gone: the integer ops, and DynamicQuantizeLinear (expanded when a fused op held one).
_NOT_STANDARD_ENOUGH = {"MatMulInteger", "ConvInteger", "DynamicQuantizeLinear"}


def _rewrite(model, **kw):
    result = onnx_qrewrite.rewrite(model, **kw)
    nodes = result.model.graph.node
    assert all(n.domain == "" and n.op_type not in _NOT_STANDARD_ENOUGH for n in nodes), op_types(result.model)
    return result


@rule_marker("int-matmul-float", "positive")
@rule_marker("int-matmul-float-bounded", "positive")
@pytest.mark.parametrize("case", MATMUL_CASES, ids=case_id)
def test_matmul_integer_float_form_is_bit_exact(case: MatMulCase):
    ta, tb, n = case.ta, case.tb, case.shape[-1]
    model, feeds, a, b, azp, bzp, reference = case.build()
    result = _rewrite(model)
    # onnxruntime's u8 x s8 kernel pairs products into int16 (x86 without VNNI): where the weights
    # allow a pair to leave int16 (or are not constant), the exact rule gives way to the bounded one,
    # whose bound is each column's pair excess; the rewrite itself is the ONNX definition either way.
    excess = u8s8.pair_excess(b.T, "int8") if ta == "uint8" and tb == "int8" else np.zeros(n, np.int64)
    saturable = ta == "uint8" and tb == "int8" and (not case.b_const or excess.max() > 0)
    assert result.report.by_rule() == {"int-matmul-float-bounded" if saturable else "int-matmul-float": 1}
    actual = run(result.model, feeds)["Y"]
    assert_bitwise_equal(actual, reference.astype(np.int32), "rewrite vs ONNX definition")
    original = run(model, feeds)["Y"]
    if ta == "uint8" and tb == "int8":
        # On x86 without VNNI the kernel saturates int16 pairs: the original differs exactly as
        # emulated, and by at most each column's pair excess from the weights (0: bit-exact); with
        # VNNI (or on ARM) it is the definition.
        kernel = saturating_matmul(a, b, azp, bzp) if u8s8_saturates_here() else reference.astype(np.int32)
        assert_bitwise_equal(original, kernel, "onnxruntime u8s8 kernel")
        assert np.all(np.abs(original.astype(np.int64) - actual) <= excess), "beyond the pair excess"
        # The same of the saturating kernel, emulated: on a CPU that does not saturate, the bound is tried here.
        emulated = saturating_matmul(a, b, azp, bzp).astype(np.int64)
        assert np.all(np.abs(emulated - actual) <= excess), "the saturating kernel beyond the pair excess"
        if case.b_const and saturable:
            assert result.report.rewrites[0].bound == float(excess.max())
    else:
        assert_bitwise_equal(actual, original, "rewrite vs onnxruntime's MatMulInteger")


@rule_marker("int-matmul-float", "negative")
@rule_marker("int-matmul-int32", "positive")
@pytest.mark.parametrize("ta, tb", list(itertools.product(("uint8", "int8"), repeat=2)))
def test_beyond_the_2_24_bound_the_float_form_declines_and_int32_matmul_is_exact(ta, tb):
    """K = 300 with runtime B and zero points: |sum| may reach 300 * 255 * 255 > 2^24."""
    rng = np.random.default_rng(7)
    a, b = values(rng, ta, (3, 300), "extremes"), values(rng, tb, (300, 4), "extremes")
    azp, bzp = zero_point(rng, ta, "nonzero", 3), zero_point(rng, tb, "nonzero", 4)
    model, feeds = matmul_model(ta, tb, a.shape, b, azp, bzp, b_const=False, zp_const=False)
    result = _rewrite(model)
    feeds = {"A": a, **feeds}
    spec = ((a.astype(np.int64) - azp.astype(np.int64)) @ (b.astype(np.int64) - bzp.astype(np.int64))).astype(np.int32)
    if (ta, tb) == ("uint8", "int8"):
        # Weights at run time: onnxruntime's u8 x s8 kernel may saturate, no exact rule holds; the
        # bounded one (float32 rounding plus the types' worst pair excess) takes it.
        assert result.report.by_rule() == {"int-matmul-float-bounded": 1}
        with pytest.raises(LoweringError, match=r"int-matmul-float: onnxruntime's uint8 x int8 kernel .* saturates"):
            onnx_qrewrite.rewrite(model, only=["int-matmul-float"])
        return
    assert result.report.by_rule() == {"int-matmul-int32": 1}
    (applied,) = result.report.rewrites
    assert "int32 MatMul" in applied.notes
    assert_bitwise_equal(run(result.model, feeds)["Y"], spec, "int32 form")
    with pytest.raises(LoweringError, match=r"int-matmul-float: sums of \|products\| may reach 1950\d+ > 2\^24"):
        onnx_qrewrite.rewrite(model, only=["int-matmul-float"])
    # The same K with constant, small weights is provably exact in float.
    small = np.clip(b, -3, 3).astype(b.dtype) if tb == "int8" else np.clip(b, 0, 3).astype(b.dtype)
    const_model, _ = matmul_model(ta, tb, a.shape, small, azp, None)
    assert _rewrite(const_model).report.by_rule() == {"int-matmul-float": 1}


@rule_marker("int-matmul-float-bounded", "positive")
def test_bounded_float_form_stays_within_its_bound_and_the_bound_catches_a_dropped_zero_point():
    """K = 1024, all operands at 255: sums reach 6.7e7, where float32 rounds. With the int32 rule
    skipped the bounded rule applies; the rewrite is not exact, but within the declared bound."""
    k = 1024
    a = np.full((2, k), 255, np.uint8)
    a[1, ::3] = 1
    b = np.full((k, 3), 255, np.uint8)
    b[::5, 1] = 7
    model, feeds = matmul_model("uint8", "uint8", a.shape, b, None, None, b_const=False)
    result = _rewrite(model, skip=["int-matmul-int32"])
    assert result.report.by_rule() == {"int-matmul-float-bounded": 1}
    (applied,) = result.report.rewrites
    assert applied.exactness == "bounded" and applied.bound == float32_sum_bound(k, k * 255 * 255)
    assert "1 node rewritten by bounded rules" in "\n".join(result.report.summary_lines())
    feeds = {"A": a, **feeds}
    original = run(model, feeds)["Y"].astype(np.int64)
    actual = run(result.model, feeds)["Y"].astype(np.int64)
    diff = np.abs(actual - original)
    assert diff.max() <= applied.bound
    assert diff.max() > 0, "the float form rounds here: declaring it exact would be false"
    # A zero point of 1 dropped changes every output by a column sum: far beyond the bound.
    bzp = np.array(1, np.uint8)
    with_zp, zp_feeds = matmul_model("uint8", "uint8", a.shape, b, None, bzp, b_const=False)
    broken = run(result.model, feeds)["Y"].astype(np.int64)
    assert np.abs(broken - run(with_zp, {"A": a, **zp_feeds})["Y"]).min() > applied.bound


@rule_marker("int-matmul-float-bounded", "negative")
def test_bounded_form_needs_k_and_is_not_used_where_an_exact_rule_applies():
    a = np.zeros((2, 4), np.uint8)
    model, _ = matmul_model("uint8", "uint8", a.shape, np.zeros((4, 3), np.uint8), None, None)
    assert _rewrite(model).report.by_rule() == {"int-matmul-float": 1}
    unknown_k = helper.make_model(
        helper.make_graph(
            [helper.make_node("MatMulInteger", ["A", "B"], ["Y"])],
            "g",
            [
                helper.make_tensor_value_info("A", T.UINT8, [None, None]),
                helper.make_tensor_value_info("B", T.UINT8, [None, None]),
            ],
            [helper.make_tensor_value_info("Y", T.INT32, [None, None])],
        ),
        opset_imports=[helper.make_opsetid("", 13)],
        ir_version=8,
    )
    with pytest.raises(LoweringError, match="int-matmul-float-bounded: the reduction length K is unknown"):
        onnx_qrewrite.rewrite(unknown_k, skip=["int-matmul-int32"])


def test_per_row_a_zero_point_follows_the_onnx_definition():
    """Valid ONNX that onnxruntime's kernel rejects: checked against numpy."""
    rng = np.random.default_rng(3)
    a, b = values(rng, "uint8", (4, 6), "random"), values(rng, "int8", (6, 3), "random")
    azp = rng.integers(0, 256, 4).astype(np.uint8)
    model, _ = matmul_model("uint8", "int8", a.shape, b, azp, None)
    result = _rewrite(model)
    assert any("per-row A zero point" in n for n in result.report.rewrites[0].notes)
    spec = ((a.astype(np.int64) - azp.astype(np.int64)[:, None]) @ b.astype(np.int64)).astype(np.int32)
    assert_bitwise_equal(run(result.model, {"A": a})["Y"], spec)


@rule_marker("int-matmul-float", "negative")
def test_exact_only_where_the_weights_rule_out_saturation_else_bounded_by_the_pair_excess():
    rng = np.random.default_rng(4)
    a = values(rng, "uint8", (2, 8), "random")
    calm = np.clip(values(rng, "int8", (8, 3), "random"), -64, 63).astype(np.int8)  # 7-bit: never saturates
    loud = np.full((8, 3), 127, np.int8)
    loud[:, 1] = 64  # 255 * (64 + 64) = 32640: this column cannot saturate
    for weights, rule in ((calm, "int-matmul-float"), (loud, "int-matmul-float-bounded")):
        model, _ = matmul_model("uint8", "int8", a.shape, weights, None, None)
        (applied,) = _rewrite(model).report.rewrites
        assert applied.rule == rule
        if rule == "int-matmul-float":
            assert applied.bound is None
            continue
        # 4 pairs of 255 * 254 = 64770 each: 32003 above int16 each.
        assert applied.bound == 4 * 32003
        assert "may differ by up to 128012 per element" in " ".join(applied.notes)
        with pytest.raises(LoweringError, match="saturates pairs of products to int16 and can here"):
            onnx_qrewrite.rewrite(model, only=["int-matmul-float"])


# -- ConvInteger --------------------------------------------------------------------------------


@rule_marker("int-matmul-float", "positive")
@pytest.mark.parametrize("case", CONV_CASES, ids=case_id)
def test_conv_integer_float_form_is_bit_exact(case: ConvCase):
    model, feeds, *_, reference = case.build()
    result = _rewrite(model)
    assert result.report.by_rule() == {"int-matmul-float-bounded" if case.saturable else "int-matmul-float": 1}
    actual = run(result.model, feeds)["Y"]
    assert_bitwise_equal(actual, reference, "rewrite vs ONNX definition")
    if not case.saturable:  # that case: see the saturation test below
        assert_bitwise_equal(actual, run(model, feeds)["Y"], "rewrite vs onnxruntime's ConvInteger")


def test_conv_integer_int8_x_uint8_w_saturates_in_onnxruntime_and_the_rewrite_does_not():
    x = np.full((1, 2, 1, 1), -128, np.int8)
    w = np.full((1, 2, 1, 1), 255, np.uint8)
    model, _ = conv_model("int8", "uint8", x.shape, w, None, None, {})
    result = _rewrite(model)
    (applied,) = result.report.rewrites
    # One pair: -128 * (255 + 255) = -65280, 32512 below int16.
    assert (applied.rule, applied.bound) == ("int-matmul-float-bounded", 32512.0)
    assert run(result.model, {"X": x})["Y"].item() == -65280
    assert run(model, {"X": x})["Y"].item() == (-32768 if u8s8_saturates_here() else -65280)
    assert saturating_matmul(x.reshape(1, -1), w.reshape(1, -1).T, None, None).item() == -32768  # emulated


def test_conv_integer_per_channel_w_zero_point_follows_the_onnx_definition():
    rng = np.random.default_rng(5)
    x, w = values(rng, "uint8", (1, 3, 5, 5), "random"), values(rng, "uint8", (4, 3, 3, 3), "random")
    wzp = rng.integers(0, 256, 4).astype(np.uint8)
    model, _ = conv_model("uint8", "uint8", x.shape, w, np.array(9, np.uint8), wzp, {"pads": [1, 1, 1, 1]})
    result = _rewrite(model)
    spec = conv_reference(x, w, 9, wzp, pads=[1, 1, 1, 1], strides=[1, 1], dilations=[1, 1], group=1)
    assert_bitwise_equal(run(result.model, {"X": x})["Y"], spec)


def test_conv_integer_beyond_the_bound_uses_the_bounded_form_within_its_bound():
    """C*kh*kw = 64*3*3 = 576 terms of up to 255*255: no exact form (Conv has no int32 form)."""
    rng = np.random.default_rng(6)
    x = np.full((1, 64, 4, 4), 255, np.uint8)
    x[0, ::3] = rng.integers(0, 256, x[0, ::3].shape)
    w = np.full((2, 64, 3, 3), 255, np.uint8)
    model, feeds = conv_model("uint8", "uint8", x.shape, w, None, None, {"pads": [1, 1, 1, 1]}, w_const=False)
    result = _rewrite(model)
    assert result.report.by_rule() == {"int-matmul-float-bounded": 1}
    (applied,) = result.report.rewrites
    reasons = "; ".join(applied.notes)
    assert "within" in reasons and applied.bound == float32_sum_bound(576, 576 * 255 * 255)
    feeds = {"X": x, **feeds}
    diff = np.abs(run(result.model, feeds)["Y"].astype(np.int64) - run(model, feeds)["Y"])
    assert diff.max() <= applied.bound
    with pytest.raises(LoweringError, match=r"int-matmul-float: sums of \|products\| may reach"):
        onnx_qrewrite.rewrite(model, only=["int-matmul-float"])


@rule_marker("int-matmul-int32", "negative")
def test_a_zero_point_of_another_type_than_its_operand_is_named_by_every_rule():
    model, _ = matmul_model("uint8", "uint8", (2, 4), np.ones((4, 3), np.uint8), np.array(1, np.int8), None)
    with pytest.raises(LoweringError) as info:
        onnx_qrewrite.rewrite(model)
    for rule in ("int-matmul-float", "int-matmul-int32", "int-matmul-float-bounded"):
        assert f"{rule}: malformed node: zero point 'a_zp' is int8, A is uint8" in str(info.value)


@rule_marker("ms-int-matmul-float", "negative")
@rule_marker("ms-int-matmul-int32", "negative")
def test_what_cannot_be_lowered_is_named_for_every_rule():
    """MatMulIntegerToFloat without b_scale is malformed: every rule that matches it says why."""
    model = _ms_model(
        "MatMulIntegerToFloat",
        [("A", T.UINT8), ("B", 0), ("a_scale", 0)],
        {"B": np.ones((4, 3), np.uint8), "a_scale": np.array(0.5, np.float32)},
        2,
        4,
    )
    with pytest.raises(LoweringError) as info:
        onnx_qrewrite.rewrite(model)
    message = str(info.value)
    for rule in ("ms-int-matmul-float", "ms-int-matmul-int32"):
        assert f"{rule}: malformed node: MatMulIntegerToFloat needs a_scale and b_scale" in message


def test_operand_types_the_model_does_not_record_are_taken_from_their_producer():
    """quantize_dynamic's models have no value_info for DynamicQuantizeLinear's outputs."""
    graph = helper.make_graph(
        [
            helper.make_node("DynamicQuantizeLinear", ["X"], ["q", "s", "z"]),
            helper.make_node("MatMulInteger", ["q", "B", "z"], ["Y"], name="mmi"),
        ],
        "g",
        [helper.make_tensor_value_info("X", T.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("Y", T.INT32, [2, 3])],
        [numpy_helper.from_array(np.full((4, 3), 60, np.int8), "B")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    result = _rewrite(model)
    assert result.report.by_rule() == {"dql-expand": 1, "int-matmul-float": 1}
    notes = " ".join(r for rw in result.report.rewrites for r in rw.notes)
    # Known to be uint8 x int8 (not "8-bit"), so the saturation check could run, and found none.
    assert "uint8 x int8" in notes and "saturates" not in notes
    x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
    assert_bitwise_equal(run(result.model, {"X": x})["Y"], run(model, {"X": x})["Y"])


# -- com.microsoft MatMulIntegerToFloat, DynamicQuantizeMatMul ------------------------------------


def _ms_model(op, inputs_spec, inits, m, k):
    node = helper.make_node(op, [name for name, _ in inputs_spec], ["Y"], domain="com.microsoft", name="fused")
    a_type = T.FLOAT if op == "DynamicQuantizeMatMul" else inputs_spec[0][1]
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("A", a_type, [m, k])],
        [helper.make_tensor_value_info("Y", T.FLOAT, [None, None])],
        [numpy_helper.from_array(v, n) for n, v in inits.items()],
    )
    opsets = [helper.make_opsetid("", 13), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


@rule_marker("ms-int-matmul-float", "positive")
@rule_marker("ms-int-matmul-int32", "positive")
@pytest.mark.parametrize(
    "op, ta, tb",
    [
        # onnxruntime has no int8 x uint8 MatMulIntegerToFloat kernel; DynamicQuantizeMatMul's A is uint8.
        *[("MatMulIntegerToFloat", ta, tb) for ta, tb in (("uint8", "int8"), ("uint8", "uint8"), ("int8", "int8"))],
        *[("DynamicQuantizeMatMul", "uint8", tb) for tb in ("int8", "uint8")],
    ],
)
@pytest.mark.parametrize(
    "per_column, zero_points, bias", [(False, False, True), (True, True, True), (True, True, False)]
)
@pytest.mark.parametrize("k", [16, 4096])
def test_fused_contrib_ops_are_bit_exact_with_their_kernels(op, ta, tb, per_column, zero_points, bias, k):
    """K = 16: the float form. K = 4096 with extreme weights: sums pass 2^24, the int32 form."""
    rng = rng_for(op, ta, tb, per_column, zero_points, bias, k)
    m, n = 5, 6
    lo, hi = (-60, 60) if tb == "int8" else (0, 255)  # no int16 pair saturation in the kernel
    b = rng.integers(lo, hi + 1, (k, n)).astype(NP[tb])
    if k > 16:
        b = np.where(rng.random(b.shape) < 0.5, lo, hi).astype(NP[tb])
    b_scale = (rng.random(n if per_column else 1) * 0.02 + 1e-3).astype(np.float32).reshape(-1 if per_column else ())
    inits = {"B": b, "b_scale": b_scale}
    if op == "MatMulIntegerToFloat":
        inits["a_scale"] = np.array(0.0123, np.float32)
        spec = [("A", ONNX[ta]), ("B", 0), ("a_scale", 0), ("b_scale", 0)]
        if zero_points:
            inits["a_zp"] = np.array(3 if ta == "uint8" else -2, NP[ta])
            inits["b_zp"] = rng.integers(lo, hi + 1, b_scale.shape).astype(NP[tb])
            spec += [("a_zp", 0), ("b_zp", 0)]
        elif bias:
            spec += [("", 0), ("", 0)]
    else:
        spec = [("A", 0), ("B", 0), ("b_scale", 0)]
        if zero_points:
            inits["b_zp"] = rng.integers(lo, hi + 1, b_scale.shape).astype(NP[tb])
            spec.append(("b_zp", 0))
        elif bias:
            spec.append(("", 0))
    if bias:
        inits["bias"] = rng.standard_normal(n).astype(np.float32)
        spec.append(("bias", 0))
    model = _ms_model(op, spec, inits, m, k)
    result = _rewrite(model)
    expected_rule = "ms-int-matmul-float" if k == 16 else "ms-int-matmul-int32"
    assert result.report.by_rule() == {expected_rule: 1}
    assert all(o.domain != "com.microsoft" for o in result.model.opset_import)
    for trial in range(3):
        if op == "DynamicQuantizeMatMul":
            a = (rng.standard_normal((m, k)) * (1 + trial)).astype(np.float32)
            if trial == 2:
                a[:] = 0.0  # DynamicQuantizeLinear's degenerate case: scale 1
        else:
            a = values(rng, ta, (m, k), ("random", "extremes", "max")[trial])
        assert_bitwise_equal(run(result.model, {"A": a})["Y"], run(model, {"A": a})["Y"], f"{op} trial {trial}")


@rule_marker("ms-int-matmul-float-bounded", "positive")
@rule_marker("ms-int-matmul-float", "negative")
def test_dynamic_quantize_matmul_with_full_range_int8_weights_computes_the_onnx_definition():
    """Weights at +-127 can saturate in the kernel on this CPU; the rewrite is the unfused chain's
    definition: DynamicQuantizeLinear, exact integer products, then scale and bias in float32."""
    rng = np.random.default_rng(8)
    b = np.where(rng.random((32, 4)) < 0.5, -127, 127).astype(np.int8)
    b_scale, bias = np.array(0.01, np.float32), rng.standard_normal(4).astype(np.float32)
    model = _ms_model(
        "DynamicQuantizeMatMul",
        [("A", 0), ("B", 0), ("b_scale", 0), ("", 0), ("bias", 0)],
        {"B": b, "b_scale": b_scale, "bias": bias},
        3,
        32,
    )
    result = _rewrite(model)
    assert result.report.by_rule() == {"ms-int-matmul-float-bounded": 1}
    with pytest.raises(LoweringError, match="saturates pairs of products to int16 and can here"):
        onnx_qrewrite.rewrite(model, only=["ms-int-matmul-float"])
    a = np.abs(rng.standard_normal((3, 32))).astype(np.float32)
    dql = helper.make_model(
        helper.make_graph(
            [helper.make_node("DynamicQuantizeLinear", ["A"], ["q", "s", "z"])],
            "g",
            [helper.make_tensor_value_info("A", T.FLOAT, [3, 32])],
            [
                helper.make_tensor_value_info(n, t, s)
                for n, t, s in (("q", T.UINT8, [3, 32]), ("s", T.FLOAT, []), ("z", T.UINT8, []))
            ],
        ),
        opset_imports=[helper.make_opsetid("", 13)],
        ir_version=8,
    )
    q = run(dql, {"A": a})
    acc = (q["q"].astype(np.int64) - q["z"].astype(np.int64)) @ b.astype(np.int64)
    expected = acc.astype(np.float32) * (q["s"] * b_scale) + bias
    assert_bitwise_equal(run(result.model, {"A": a})["Y"], expected.astype(np.float32))


def test_weight_statistics_shared_by_nodes_follow_each_nodes_zero_point_and_types():
    """Statistics of one weight are worked out once per scope (graph.Scope.memo) and shared by the
    nodes reading it; a node with another zero point or operand type must still get its own."""
    rng = np.random.default_rng(9)
    w = np.full((8, 3), 127, np.int8)
    w[::2] = values(rng, "int8", (4, 3), "random")
    variants = [("uint8", None), ("uint8", np.int8(-100)), ("int8", None), ("uint8", None)]
    alone = []
    for ta, bzp in variants:
        model, _ = matmul_model(ta, "int8", (2, 8), w, None, bzp)
        alone.append(_rewrite(model).report.rewrites[0].notes)
    inits = [numpy_helper.from_array(w, "B")]
    inputs, nodes, outputs = [], [], []
    for i, (ta, bzp) in enumerate(variants):
        names = [f"A{i}", "B"]
        if bzp is not None:
            inits.append(numpy_helper.from_array(np.asarray(bzp), f"b_zp{i}"))
            names += ["", f"b_zp{i}"]
        inputs.append(helper.make_tensor_value_info(f"A{i}", ONNX[ta], [2, 8]))
        nodes.append(helper.make_node("MatMulInteger", names, [f"Y{i}"], name=f"mmi{i}"))
        outputs.append(helper.make_tensor_value_info(f"Y{i}", T.INT32, [None, None]))
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    shared = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    together = [r.notes for r in _rewrite(shared).report.rewrites]
    assert together == alone
    assert len({n for notes in alone for n in notes}) > 3  # the variants do differ


def _dynamic_quantize_matmul(m: int, k: int):
    """DynamicQuantizeMatMul with A of m x k (shape recorded), a weight zero point and a bias."""
    rng = rng_for("dqmm-nan", m, k)
    b = rng.integers(-60, 61, (k, 6)).astype(np.int8)
    inits = {
        "B": b,
        "b_scale": np.array(0.0173, np.float32),
        "b_zp": np.array(3, np.int8),
        "bias": rng.standard_normal(6).astype(np.float32),
    }
    spec = [("A", 0), ("B", 0), ("b_scale", 0), ("b_zp", 0), ("bias", 0)]
    return _ms_model("DynamicQuantizeMatMul", spec, inits, m, k)


@rule_marker("ms-int-matmul-float", "positive")
@rule_marker("ms-int-matmul-int32", "positive")
@pytest.mark.parametrize("int32", [False, True])
def test_dynamic_quantize_matmul_matches_the_kernel_on_nan_in_at_most_seven_elements(int32):
    """onnxruntime's DynamicQuantizeMatMul quantizes A with DynamicQuantizeLinear's min/max search:
    below 8 elements a scalar loop that skips NaN, deterministically (measured: 121 of 121 NaN
    cases equal, 1 and 2 threads alike; before, the expansion gave NaN outputs in 72 of them). The
    expansion takes A's range as the DynamicQuantizeLinear rule does (one shared function)."""
    from test_dynamic_quantize import _nan_battery

    rng = np.random.default_rng(17)
    for m, k in [(1, 1), (1, 3), (2, 2), (1, 5), (2, 3), (7, 1)]:
        model = _dynamic_quantize_matmul(m, k)
        # The int32 form (chosen when the float sums are not provably exact) quantizes A the same way.
        result = _rewrite(model, options={"ms-int-matmul-float": {"accumulate": "int32"}} if int32 else None)
        notes = " ".join(result.report.rewrites[0].notes)
        assert "NaN skipped by min/max" in notes, notes
        for threads in (1, 2):
            kernel, expansion = session(model, threads=threads), session(result.model, threads=threads)
            for flat in _nan_battery(m * k, rng):
                a = flat.reshape(m, k)
                assert_bitwise_equal(
                    expansion.run(None, {"A": a})[0], kernel.run(None, {"A": a})[0], f"{a.ravel().tolist()}"
                )


@rule_marker("ms-int-matmul-float", "positive")
def test_dynamic_quantize_matmul_run_time_nan_guard_where_a_is_not_recorded():
    """nan_guard = "run-time" guards A of unrecorded shape at run time: NaN in 1-7 elements matches
    the kernel bit for bit, and from 8 elements on (NaN-free) the output is the unguarded one's."""
    from test_dynamic_quantize import _nan_battery

    model = _dynamic_quantize_matmul(2, 3)
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "m"  # A is [m, 3]
    plain = _rewrite(model)
    assert "NaN skipped" not in " ".join(plain.report.rewrites[0].notes)
    result = _rewrite(model, options={"ms-int-matmul-float": {"nan_guard": "run-time"}})
    assert "at run time" in " ".join(result.report.rewrites[0].notes)
    kernel, expansion, unguarded = session(model), session(result.model), session(plain.model)
    rng = np.random.default_rng(23)
    for m in (1, 2):
        for flat in _nan_battery(m * 3, rng)[::4]:
            a = flat.reshape(m, 3)
            assert_bitwise_equal(expansion.run(None, {"A": a})[0], kernel.run(None, {"A": a})[0], f"{a.tolist()}")
    a = rng.standard_normal((4, 3)).astype(np.float32)
    assert_bitwise_equal(expansion.run(None, {"A": a})[0], unguarded.run(None, {"A": a})[0], "12 elements")


def test_dynamic_quantize_matmul_nan_guard_only_where_a_is_known_to_be_small():
    """From 8 elements on the kernel's vectorised search makes a NaN's effect depend on its position
    (measured: 5 of 8 NaN positions at 8 elements match a NaN-skipping range): no guard there."""
    result = _rewrite(_dynamic_quantize_matmul(2, 4))
    assert "NaN skipped" not in " ".join(result.report.rewrites[0].notes)
    assert "IsNaN" not in op_types(result.model)[:2]
