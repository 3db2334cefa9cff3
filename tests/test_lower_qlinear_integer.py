"""QLinearConv, QLinearMatMul, QGemm and QLinearMul rewritten bit for bit (form qlinear-exact: rules
qop-*-exact, builder qlinear_integer): the exact integer sums (products) as float sums of
integer-valued floats and onnxruntime's requantization in its own order, against onnxruntime's own
kernels.

The battery is test_lower_qoperator.py's table (uint8/int8 activations, uint8/int8 weights,
per-tensor and per-channel scales, zero points zero, non-zero and absent, qmin/qmax/zero point
planted, "decimal" scales that put many results on a half step, QGemm's alpha, bias, transB and
float output), plus edge cases of its own: sums of 2^24 - 766 (the largest 258 products of uint8
values reach), saturation at both rails, ties of the multiplier 0.5, two threads, two run-time
operands, every pair of values for QLinearMul. Where a rule declines (sums beyond 2^24, uint8 x int8
pairs that onnxruntime's AVX2 kernel can saturate, a multiplier that could overflow the kernel's
int32 conversion), the bounded rules take the node. The condition excludes the saturating pairs, so
what is asserted holds on CPUs with and without VNNI alike. A wider battery:
tools/measure_qlinear_exact.py."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import rule_marker, run
from onnx import TensorProto, helper, numpy_helper
from test_lower_qoperator import ACCUMULATING, Case, build, table

import onnx_qrewrite
from onnx_qrewrite.errors import EXIT_DISAGREE, LoweringError
from onnx_qrewrite.rewriter.builders.qlinear_integer import kernel_multiplier
from onnx_qrewrite.rewriter.catalogue import named_form
from onnx_qrewrite.verify import verify

EXACT = {"QLinearConv": "qop-conv-exact", "QLinearMatMul": "qop-matmul-exact", "QGemm": "qop-gemm-exact"}
BOUNDED = {"QLinearConv": "qop-conv", "QLinearMatMul": "qop-matmul", "QGemm": "qop-gemm"}
FULL_RANGE = (0, 255)
FORM = [named_form("qlinear-exact")]


def _bits(y: np.ndarray) -> np.ndarray:
    return y.view(np.uint32 if y.dtype == np.float32 else np.uint8)


def _session_run(model: onnx.ModelProto, feeds: dict, threads: int, optimize: bool = False) -> np.ndarray:
    """onnxruntime with graph optimisation off (verify's default), or at its default level (all)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    level = ort.GraphOptimizationLevel
    options.graph_optimization_level = level.ORT_ENABLE_ALL if optimize else level.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


@rule_marker("qop-conv-exact", "positive")
@rule_marker("qop-matmul-exact", "positive")
@rule_marker("qop-gemm-exact", "positive")
@pytest.mark.parametrize("op", ACCUMULATING)
def test_the_accumulating_ops_are_bit_exact_where_the_sums_stay_within_2_24(op):
    """Every case of the table (72 QLinearConv, 72 QLinearMatMul, 108 QGemm) is taken by the exact
    rule (the table's uint8 x int8 weights keep every pair of products within int16) and bit for bit
    onnxruntime's; every sixth case also with the rewrite at onnxruntime's default optimisation level
    (test_onnxruntimes_conv_mul_fusion_leaves_the_multiplier_alone)."""
    for i, case in enumerate(table(op)):
        model, feeds = build(case)
        result = onnx_qrewrite.rewrite(model, rules=FORM)
        (applied,) = result.report.rewrites
        assert applied.rule == EXACT[op] and applied.exactness == "exact" and applied.bound is None, case.id
        assert {n.op_type for n in result.model.graph.node} <= {
            "Cast", "Sub", "MatMul", "Conv", "Gemm", "Mul", "Round", "Add", "Clip"
        }, case.id  # fmt: skip
        want, got = run(model, feeds)["y"], run(result.model, feeds)["y"]
        assert got.dtype == want.dtype and np.array_equal(_bits(got), _bits(want)), case.id
        if i % 6 == 0:
            optimized = _session_run(result.model, feeds, 1, optimize=True)
            assert np.array_equal(_bits(optimized), _bits(want)), case.id


def _matmul(a_dtype, b, a_scale, a_zp, b_scale, b_zp, y_scale, y_zp, m_rows=4) -> onnx.ModelProto:
    values = {"as": a_scale, "az": a_zp, "b": b, "bs": b_scale, "bz": b_zp, "ys": y_scale, "yz": y_zp}
    t = TensorProto.UINT8 if a_dtype == "uint8" else TensorProto.INT8
    node = helper.make_node("QLinearMatMul", ["a", *values], ["y"], name="qmm")
    graph = helper.make_graph(
        [node],
        "qmm",
        [helper.make_tensor_value_info("a", t, [m_rows, b.shape[0]])],
        [helper.make_tensor_value_info("y", t, [m_rows, b.shape[1]])],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in values.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@rule_marker("qop-matmul-exact", "positive")
def test_sums_up_to_2_24_ties_and_both_rails_bit_exact_on_one_and_two_threads():
    """258 products of 255 x 255: |sum| = 16,776,450 (2^24 - 766), the largest uint8 reaches within
    2^24; the multiplier 0.5 puts every odd sum on a tie (half to even); scales that saturate both
    rails; per-column scales. One and two threads."""
    rng = np.random.default_rng(3)
    cases = [
        # (a dtype, b, a_scale, a_zp, b_scale, b_zp, y_scale, y_zp, a values)
        ("uint8", np.zeros((258, 4), np.uint8), 1.0, 0, 1.0, 255, 4e6, 128, np.full((4, 258), 255, np.uint8)),
        ("uint8", rng.integers(0, 256, (16, 8)).astype(np.uint8), 0.5, 3, 1.0, 7, 1.0, 128, None),
        ("int8", rng.integers(-128, 128, (16, 8)).astype(np.int8), 0.5, -1, 0.5, 0, 0.25, 0, None),
        ("uint8", rng.integers(0, 256, (32, 8)).astype(np.uint8), 0.3, 0, 0.2, 128, 0.01, 0, None),  # rails
        ("int8", rng.integers(-128, 128, (32, 6)).astype(np.int8), 0.02, 5, rng.uniform(0.01, 0.1, 6), 0, 0.3, -3,
         None),
    ]  # fmt: skip
    for i, (dt, b, s_a, z_a, s_b, z_b, s_y, z_y, a) in enumerate(cases):
        npt = np.uint8 if dt == "uint8" else np.int8
        model = _matmul(dt, b, np.float32(s_a), npt(z_a), np.asarray(s_b, np.float32), b.dtype.type(z_b),
                        np.float32(s_y), npt(z_y))  # fmt: skip
        result = onnx_qrewrite.rewrite(model, rules=FORM)
        assert result.report.by_rule() == {"qop-matmul-exact": 1}, (i, result.report.by_rule())
        lo, hi = (0, 255) if dt == "uint8" else (-128, 127)
        feeds = {"a": a if a is not None else rng.integers(lo, hi + 1, (4, b.shape[0])).astype(npt)}
        for threads in (1, 2):
            want = _session_run(model, feeds, threads)
            got = _session_run(result.model, feeds, threads)
            assert np.array_equal(want, got), (i, threads, want, got)
        if i == 3:
            assert {int(want.min()), int(want.max())} == {0, 255}  # both rails reached


@rule_marker("qop-matmul-exact", "negative")
@rule_marker("qop-conv-exact", "negative")
def test_beyond_2_24_or_where_a_pair_can_saturate_the_bounded_rule_takes_the_node():
    """259 products of 255 x 255 may pass 2^24: the exact rule declines, the bounded one applies.
    uint8 x full-range int8 weights: onnxruntime's AVX2 kernel (no VNNI) saturates pairs, a result
    that depends on the CPU, so the exact rule declines there too (on every CPU)."""
    model = _matmul("uint8", np.zeros((259, 4), np.uint8), np.float32(1), np.uint8(0), np.float32(1),
                    np.uint8(255), np.float32(4e6), np.uint8(128))  # fmt: skip
    assert onnx_qrewrite.rewrite(model, rules=FORM).report.by_rule() == {"qop-matmul": 1}
    with pytest.raises(
        LoweringError, match=r"qop-matmul-exact: the integer sums of .* may reach 1.684e\+07, beyond 2\^24"
    ):
        onnx_qrewrite.rewrite(model, rules=FORM, only=["qop-matmul-exact"])
    b = np.array([[127, -128], [127, -128]] * 4, np.int8)
    model = _matmul("uint8", b, np.float32(0.1), np.uint8(0), np.float32(0.1), np.int8(0), np.float32(1), np.uint8(0))
    assert onnx_qrewrite.rewrite(model, rules=FORM).report.by_rule() == {"qop-matmul": 1}
    with pytest.raises(LoweringError, match=r"qop-matmul-exact: .* can saturate a pair of products to int16"):
        onnx_qrewrite.rewrite(model, rules=FORM, only=["qop-matmul-exact"])
    small = np.clip(b, -64, 64).astype(np.int8)  # pairs within int16: exact
    model = _matmul(
        "uint8", small, np.float32(0.1), np.uint8(0), np.float32(0.1), np.int8(0), np.float32(1), np.uint8(0)
    )
    assert onnx_qrewrite.rewrite(model, rules=FORM).report.by_rule() == {"qop-matmul-exact": 1}


def test_the_multiplier_is_the_kernels_float32_product_then_quotient():
    """a_scale * b_scale / y_scale rounded twice in float32 (C++ float arithmetic, left to right),
    which differs from the real quotient rounded once: the case where the two differ is the one a
    float64 computation would get wrong by one ulp."""
    a, b, y = np.float32(0.1), np.float32(0.3), np.float32(0.7)
    twice = np.float32(np.float32(a * b) / y)
    assert kernel_multiplier(float(a), np.asarray([b]), float(y), None)[0] == twice
    once = np.float32(float(a) * float(b) / float(y))
    assert twice != once  # the order matters for these values
    assert kernel_multiplier(float(a), np.asarray([b]), None, 0.75)[0] == np.float32(np.float32(0.75) * a) * b


def _two_matmuls() -> onnx.ModelProto:
    """qmm1 -> qmm2, both exact. qmm1's multiplier is 1/16 (a_scale 1/16, b_scale 1, y_scale 1)
    and its weights stay within 2 of their zero point, so its sums are small and every sum of 8
    modulo 16 sits on a tie."""
    rng = np.random.default_rng(4)
    b1 = rng.integers(126, 131, (16, 8)).astype(np.uint8)
    b2 = rng.integers(0, 256, (8, 4)).astype(np.uint8)
    inits = {
        "s1": np.float32(1 / 16), "z1": np.uint8(7), "b1": b1, "t1": np.float32(1.0), "u1": np.uint8(128),
        "y1": np.float32(1.0), "w1": np.uint8(128), "b2": b2, "y2": np.float32(40.0),
    }  # fmt: skip
    nodes = [
        helper.make_node("QLinearMatMul", ["a", "s1", "z1", "b1", "t1", "u1", "y1", "w1"], ["h"], name="qmm1"),
        helper.make_node("QLinearMatMul", ["h", "y1", "w1", "b2", "t1", "u1", "y2", "w1"], ["y"], name="qmm2"),
    ]
    graph = helper.make_graph(
        nodes,
        "two",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, [8, 16])],
        [helper.make_tensor_value_info("y", TensorProto.UINT8, [8, 4])],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _multiplier_one_ulp_up(rewritten: onnx.ModelProto, output: str) -> onnx.ModelProto:
    """The rewrite with the multiplier of the replacement that writes ``output`` one ulp up (in a
    new initializer: equal constants are shared between replacements)."""
    broken = onnx.ModelProto()
    broken.CopyFrom(rewritten)
    mul = next(n for n in broken.graph.node if n.op_type == "Mul" and n.name.startswith(f"{output}/"))
    constants = {t.name: numpy_helper.to_array(t) for t in broken.graph.initializer}
    (at,) = [i for i, name in enumerate(mul.input) if name in constants]  # the multiplier (first, in fact)
    value = constants[mul.input[at]]
    assert value == np.float32(1 / 16)
    name = f"{mul.input[at]}_broken"
    broken.graph.initializer.append(numpy_helper.from_array(np.nextafter(value, np.float32(np.inf)), name))
    mul.input[at] = name
    return broken


@rule_marker("qop-matmul-exact", "positive")
def test_a_multiplier_one_ulp_off_is_caught_at_the_node_that_breaks():
    """Issue 10's P3: the exact rule has no bound to hide a one-ulp scale error in. With qmm1's
    multiplier one ulp up, the sums on a tie round up instead of to even: verify fails and
    localises the difference to qmm1 (rule qop-matmul-exact). The correct rewrite passes the same
    check; the bounded rule, with the same break, would pass (test_verify_bounded_breaks.py)."""
    original = _two_matmuls()
    rewritten = onnx_qrewrite.rewrite(original, rules=FORM).model
    assert verify(original, rewritten, int_range=FULL_RANGE).passed
    report = verify(original, _multiplier_one_ulp_up(rewritten, "h"), int_range=FULL_RANGE)
    assert not report.passed and report.exit_code == EXIT_DISAGREE, report.to_table()
    loc = report.localization
    assert loc is not None and loc.found and loc.origin == "qmm1" and loc.rule == "qop-matmul-exact", report.summary


@rule_marker("qop-conv-exact", "negative")
@rule_marker("qop-matmul-exact", "negative")
@rule_marker("qop-gemm-exact", "negative")
@pytest.mark.parametrize("op", ACCUMULATING)
def test_uint8_by_full_range_int8_weights_is_left_to_the_bounded_rule(op):
    """Full-range int8 weights under uint8 activations: a pair of products can leave int16, which
    onnxruntime's AVX2 kernel (no VNNI) saturates and a VNNI kernel does not. The exact rule
    declines on every CPU (its condition reads the weights, not the CPU), saying so; the bounded
    rule takes the node."""
    model, _ = build(Case(op, "uint8", "int8", False, "nonzero", 0, 99))
    w = next(t for t in model.graph.initializer if t.name in ("w", "b"))
    full = np.random.default_rng(5).integers(-127, 128, numpy_helper.to_array(w).shape).astype(np.int8)
    w.CopyFrom(numpy_helper.from_array(full, w.name))
    assert onnx_qrewrite.rewrite(model, rules=FORM).report.by_rule() == {BOUNDED[op]: 1}
    with pytest.raises(LoweringError, match=rf"{EXACT[op]}: .* can saturate a pair of products to int16"):
        onnx_qrewrite.rewrite(model, rules=FORM, only=[EXACT[op]])


@rule_marker("qop-mul-exact", "positive")
def test_qlinear_mul_is_bit_exact_on_the_qoperator_table():
    """QLinearMul's table (uint8/int8, zero points zero, non-zero and absent, broadcasting shapes,
    a scalar B, "decimal" scales)."""
    for case in table("QLinearMul"):
        model, feeds = build(case)
        result = onnx_qrewrite.rewrite(model, rules=FORM)
        assert result.report.by_rule() == {"qop-mul-exact": 1}, case.id
        want, got = run(model, feeds)["y"], run(result.model, feeds)["y"]
        assert got.dtype == want.dtype and np.array_equal(got, want), case.id


#: Scales and zero points for which rounding before adding the output zero point differs from the
#: kernel's order (a search over random ones with numpy).
ORDER_MATTERS = {
    "int8": ((0.022162824869155884, 0.004667982459068298, 0.10802948474884033), (113, 67, 109)),
    "uint8": ((0.12439260631799698, 0.012817992828786373, 0.16795022785663605), (162, 241, 201)),
}


def _mul_model(dtype: str, scales: tuple, zero_points: tuple) -> onnx.ModelProto:
    t = TensorProto.UINT8 if dtype == "uint8" else TensorProto.INT8
    names = ["as", "az", "bs", "bz", "ys", "yz"]
    values = [np.float32(scales[0]), zero_points[0], np.float32(scales[1]), zero_points[1]]
    values += [np.float32(scales[2]), zero_points[2]]
    node = helper.make_node("QLinearMul", ["a", "as", "az", "b", "bs", "bz", "ys", "yz"], ["y"], domain="com.microsoft")
    graph = helper.make_graph(
        [node],
        "qmul",
        [helper.make_tensor_value_info(n, t, [65536]) for n in ("a", "b")],
        [helper.make_tensor_value_info("y", t, [65536])],
        [
            numpy_helper.from_array(np.asarray(v, dtype if k.endswith("z") else np.float32), k)
            for k, v in zip(names, values, strict=True)
        ],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


@rule_marker("qop-mul-exact", "positive")
def test_qlinear_mul_is_bit_exact_on_every_pair_of_values_and_adds_the_zero_point_before_rounding():
    """Every one of the 65,536 pairs of each type, random scales and zero points, one and two
    threads: bit for bit. The kernel adds the output zero point in float before rounding: rounding
    first and adding it after (what the rewrite would do by analogy with the matmuls) differs on
    some pair of this battery, so the order is measured, not assumed."""
    rng = np.random.default_rng(11)
    other_order_differs = 0
    for dtype in ("uint8", "int8"):
        lo, hi = (0, 255) if dtype == "uint8" else (-128, 127)
        grid = np.meshgrid(np.arange(lo, hi + 1), np.arange(lo, hi + 1))
        feeds = {"a": grid[0].reshape(-1).astype(dtype), "b": grid[1].reshape(-1).astype(dtype)}
        for trial in range(6):
            scales = tuple(np.exp(rng.uniform(-6, 0, 3)).astype(np.float32))
            zps = tuple(np.asarray(z, dtype) for z in (rng.integers(lo, hi + 1, 3) if trial % 3 else (0, 0, 0)))
            if trial == 1:  # found by search: the two orders differ on 6 (int8) / 30 (uint8) pairs
                scales = tuple(np.float32(v) for v in ORDER_MATTERS[dtype][0])
                zps = tuple(np.asarray(z, dtype) for z in ORDER_MATTERS[dtype][1])
            model = _mul_model(dtype, scales, zps)
            result = onnx_qrewrite.rewrite(model, rules=FORM)
            assert result.report.by_rule() == {"qop-mul-exact": 1}
            for threads in (1, 2) if trial == 0 else (1,):
                want = _session_run(model, feeds, threads)
                assert np.array_equal(want, _session_run(result.model, feeds, threads)), (dtype, trial, threads)
            products = (feeds["a"].astype(np.int64) - int(zps[0])) * (feeds["b"].astype(np.int64) - int(zps[1]))
            m = kernel_multiplier(float(scales[0]), np.asarray([scales[1]]), float(scales[2]), None)[0]
            after = np.clip(np.rint(products.astype(np.float32) * m).astype(np.int64) + int(zps[2]), lo, hi)
            other_order_differs += int((after != want.astype(np.int64)).sum())
    assert other_order_differs > 0


@rule_marker("qop-mul-exact", "negative")
def test_qlinear_mul_with_a_multiplier_that_could_overflow_int32_is_left_to_the_bounded_rule():
    """255^2 products times a multiplier of 2^15 pass 2^30: the kernel converts float to int32 before
    it saturates, so the exact rule declines and qop-mul takes the node."""
    model = _mul_model("uint8", (1.0, 1.0, 2.0**-15), (np.uint8(0), np.uint8(0), np.uint8(0)))
    assert onnx_qrewrite.rewrite(model, rules=FORM).report.by_rule() == {"qop-mul": 1}
    with pytest.raises(LoweringError, match=r"qop-mul-exact: .* may reach 2\^30"):
        onnx_qrewrite.rewrite(model, rules=FORM, only=["qop-mul-exact"])


@rule_marker("qop-matmul-exact", "positive")
@rule_marker("qop-matmul-exact", "negative")
@pytest.mark.parametrize(
    ("a_dtype", "b_dtype", "k"), [("int8", "int8", 64), ("uint8", "uint8", 258), ("uint8", "int8", 8)]
)
def test_two_run_time_operands_with_a_recorded_reduction_length(a_dtype, b_dtype, k):
    """Attention's QLinearMatMul of two activations: the sums are bounded by K and the types alone
    (K = 258 is the most uint8 allows within 2^24 with zero points 0), exact; uint8 x int8 operands
    at run time could saturate onnxruntime's AVX2 kernel: the exact rule declines (as the bounded one
    does; only the approximate rule takes them, when asked)."""
    ta, tb = (TensorProto.UINT8 if t == "uint8" else TensorProto.INT8 for t in (a_dtype, b_dtype))
    params = {"as": np.float32(0.02), "az": np.asarray(0, a_dtype), "bs": np.float32(0.03)}
    params |= {"bz": np.asarray(0, b_dtype), "ys": np.float32(40.0), "yz": np.asarray(3, a_dtype)}
    node = helper.make_node("QLinearMatMul", ["a", "as", "az", "b", "bs", "bz", "ys", "yz"], ["y"], name="qmm")
    graph = helper.make_graph(
        [node],
        "scores",
        [helper.make_tensor_value_info("a", ta, [2, 5, k]), helper.make_tensor_value_info("b", tb, [2, k, 6])],
        [helper.make_tensor_value_info("y", ta, [2, 5, 6])],
        [numpy_helper.from_array(np.asarray(v), n) for n, v in params.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    if a_dtype == "uint8" and b_dtype == "int8":  # no bounded rule either: only the approximate one, when asked
        with pytest.raises(LoweringError, match="qop-matmul-exact: uint8 x int8 operands computed at run time"):
            onnx_qrewrite.rewrite(model, rules=FORM)
        return
    result = onnx_qrewrite.rewrite(model, rules=FORM)
    assert result.report.by_rule() == {"qop-matmul-exact": 1}
    rng = np.random.default_rng(k)
    lo, hi = (0, 255) if a_dtype == "uint8" else (-128, 127)
    for extreme in (False, True):
        values = [lo, hi] if extreme else np.arange(lo, hi + 1)
        feeds = {
            "a": rng.choice(values, (2, 5, k)).astype(a_dtype),
            "b": rng.choice(values, (2, k, 6)).astype(b_dtype),
        }
        assert np.array_equal(run(model, feeds)["y"], run(result.model, feeds)["y"]), (a_dtype, extreme)


@rule_marker("qop-conv-exact", "positive")
def test_onnxruntimes_conv_mul_fusion_leaves_the_multiplier_alone(tmp_path):
    """At onnxruntime's default optimisation level ConvMulFusion folds a Mul whose second input is a
    constant into the Conv's weights; w * m is not an integer, and the float sums before rounding
    moved by an ulp or so on most elements (measured with the multiplier second). The rewrite puts
    the multiplier first: the Mul stays, and the values before rounding are the same bits."""
    import onnxruntime as ort

    model, feeds = build(table("QLinearConv")[5])
    rewritten = onnx_qrewrite.rewrite(model, rules=FORM).model
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(rewritten.SerializeToString(), options, providers=["CPUExecutionProvider"])
    optimized = onnx.load(tmp_path / "optimized.onnx")
    assert "Mul" in {n.op_type for n in optimized.graph.node}
    # The values before rounding: the rewrite cut after its Mul, at both levels.
    cut = onnx.ModelProto()
    cut.CopyFrom(rewritten)
    mul = next(n for n in cut.graph.node if n.op_type == "Mul")
    nodes = list(cut.graph.node)[: [n.name for n in cut.graph.node].index(mul.name) + 1]
    del cut.graph.node[:]
    cut.graph.node.extend(nodes)
    del cut.graph.output[:]
    cut.graph.output.append(helper.make_tensor_value_info(mul.output[0], TensorProto.FLOAT, None))
    plain, fused = (_session_run(cut, feeds, 1, optimize=o) for o in (False, True))
    assert np.array_equal(plain.view(np.uint32), fused.view(np.uint32))


def _pool_model(dtype: str, shape: tuple, channels_last: int, params: tuple, record: bool = True) -> onnx.ModelProto:
    t = TensorProto.UINT8 if dtype == "uint8" else TensorProto.INT8
    names = ["xs", "xz", "ys", "yz"]
    values = [np.float32(params[0]), np.asarray(params[1], dtype), np.float32(params[2]), np.asarray(params[3], dtype)]
    node = helper.make_node(
        "QLinearGlobalAveragePool", ["x", *names], ["y"], domain="com.microsoft", channels_last=channels_last
    )
    dims: list = list(shape) if record else ["n", *shape[1:-1], "w"]
    out = [dims[0], *([1] * (len(dims) - 2)), dims[-1]] if channels_last else [*dims[:2], *([1] * (len(dims) - 2))]
    graph = helper.make_graph(
        [node],
        "gap",
        [helper.make_tensor_value_info("x", t, dims)],
        [helper.make_tensor_value_info("y", t, out)],
        [numpy_helper.from_array(v, n) for n, v in zip(names, values, strict=True)],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


@rule_marker("qop-global-average-pool-exact", "positive")
def test_qlinear_global_average_pool_is_bit_exact_where_the_image_size_is_recorded():
    """MLAS sums each channel in int32 and requantizes with x_scale / (y_scale * image size) by
    MlasRequantizeOutput: bit for bit, uint8/int8, channels first and last, images of 1 to 4096
    values, extreme values, a multiplier that puts half the means on ties; 1 and 2 threads."""
    rng = np.random.default_rng(7)
    cases = 0
    for dtype in ("uint8", "int8"):
        lo, hi = (0, 255) if dtype == "uint8" else (-128, 127)
        for shape, last in (((2, 5, 7, 7), 0), ((1, 3, 1, 1), 0), ((1, 16, 13, 17), 1), ((1, 4, 64, 64), 0)):
            xs = np.float32(np.exp(rng.uniform(-5, -1)))
            image = int(np.prod(shape[1:3] if last else shape[2:]))
            for ys in (np.float32(xs * rng.uniform(0.3, 3)), np.float32(xs * 2 / image)):  # the second: ties
                params = (xs, int(rng.integers(lo, hi + 1)), ys, int(rng.integers(lo, hi + 1)))
                model = _pool_model(dtype, shape, last, params)
                result = onnx_qrewrite.rewrite(model, rules=FORM)
                assert result.report.by_rule() == {"qop-global-average-pool-exact": 1}, (dtype, shape)
                for extreme in (False, True):
                    x = rng.choice([lo, hi], shape) if extreme else rng.integers(lo, hi + 1, shape)
                    feeds = {"x": x.astype(dtype)}
                    for threads in (1, 2):
                        want = _session_run(model, feeds, threads)
                        assert np.array_equal(want, _session_run(result.model, feeds, threads)), (dtype, shape, ys)
                cases += 1
    assert cases == 16
    # Found by search: x_scale 0.07, y_scale 0.0048 over 7 x 7 puts the channel sums 126 and 294 on a
    # tie (37.5, 87.5) with the kernel's float32 multiplier, and off it with the quotient rounded once.
    xs, ys = np.float32(0.07), np.float32(0.0048)
    model = _pool_model("uint8", (1, 3, 7, 7), 0, (xs, 0, ys, 100))
    x = np.zeros((1, 3, 7, 7), np.uint8)
    x[0, 0, 0, :2], x[0, 1, 0, :2], x[0, 2] = (100, 26), (200, 94), 5
    want = _session_run(model, {"x": x}, 1)
    assert np.array_equal(want, _session_run(onnx_qrewrite.rewrite(model, rules=FORM).model, {"x": x}, 1))
    once = np.float32(float(xs) / (float(ys) * 49))
    rounded_once = np.rint(np.array([126, 294, 245], np.float32) * once) + 100
    assert not np.array_equal(rounded_once, want.reshape(-1).astype(np.float32))  # the test can tell them apart


@rule_marker("qop-global-average-pool-exact", "negative")
def test_qlinear_global_average_pool_of_an_unrecorded_image_size_is_left_to_the_bounded_rule():
    """The multiplier depends on the image size: where the model does not record it, the exact rule
    declines, saying why, and qop-global-average-pool takes the node."""
    model = _pool_model("uint8", (1, 3, 5, 5), 0, (0.02, 3, 0.03, 5), record=False)
    assert onnx_qrewrite.rewrite(model, rules=FORM).report.by_rule() == {"qop-global-average-pool": 1}
    with pytest.raises(LoweringError, match="qop-global-average-pool-exact: the spatial size of 'x' is not recorded"):
        onnx_qrewrite.rewrite(model, rules=FORM, only=["qop-global-average-pool-exact"])
