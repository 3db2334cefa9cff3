"""QLinearMatMul of two run-time operands whose reduction length K the model does not record (an
attention's scores and context over a symbolic sequence length): qop-matmul bounds it by a
function of K, ``floor(gamma(K + 4)·K·c) + 1`` steps (formula ``run-time-k``), which verify
evaluates at each sample's own K at the node's output, as the rule computes it for a recorded K
(builders/qoperator.py ``run_time_k_steps``; verify/element_bounds.py).

The model is made by the producer: onnxruntime's quantize_static (QOperator) on a tiny attention
block whose sequence length is symbolic, run at sequence lengths on both sides of the length where
the attention's integer sums may leave float32's exact range (2^24).
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnxruntime.quantization as quantization
import pytest
from _verify_helpers import node_row
from conftest import rule_marker, run
from onnx import TensorProto, helper, numpy_helper
from test_qoperator_real_models import attention_block

import onnx_qrewrite
from onnx_qrewrite.errors import EXIT_DISAGREE, LoweringError
from onnx_qrewrite.rewriter.builders.qoperator import run_time_k_steps
from onnx_qrewrite.targets.shapes import apply_input_shapes, parse_input_shapes
from onnx_qrewrite.verify import verify

D = 16  # the attention block's width: the scores' reduction length
#: The context (att_quant) sums softmax weights times values over the sequence: its K.
CONTEXT = "att_quant"


class _Reader(quantization.CalibrationDataReader):
    """Calibration at several sequence lengths (the model takes any)."""

    def __init__(self) -> None:
        rng = np.random.default_rng(1)
        self._data = iter([{"x": rng.standard_normal((1, s, D)).astype(np.float32)} for s in (8, 16, 32, 64)])

    def get_next(self):
        return next(self._data, None)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory) -> onnx.ModelProto:
    """quantize_static's QOperator attention block, sequence length symbolic ('seq')."""
    folder = tmp_path_factory.mktemp("run_time_k")
    model = attention_block(D)
    for value in (model.graph.input[0], model.graph.output[0]):
        value.type.tensor_type.shape.dim[1].dim_param = "seq"
    src, dst = folder / "attention.onnx", folder / "attention_q.onnx"
    onnx.save(model, src)
    quantization.quantize_static(
        str(src),
        str(dst),
        _Reader(),
        quant_format=quantization.QuantFormat.QOperator,
        activation_type=quantization.QuantType.QUInt8,
        weight_type=quantization.QuantType.QInt8,
        per_channel=True,
        reduce_range=True,
    )
    return onnx.load(dst)


def _node(model: onnx.ModelProto, name: str) -> onnx.NodeProto:
    return next(n for n in model.graph.node if n.name == name)


def _constant(model: onnx.ModelProto, name: str) -> np.ndarray:
    return numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == name))


def _exact_limit(model: onnx.ModelProto) -> int:
    """The K from which the context's integer sums may reach 2^24 (float32's exact integers):
    K · max|a - za| · max|b - zb| >= 2^24."""
    node = _node(model, CONTEXT)
    za, zb = (int(_constant(model, node.input[i])) for i in (2, 5))
    return math.ceil(2**24 / (max(255 - za, za) * max(255 - zb, zb)))


def _per_k(result, node: str) -> float:
    (applied,) = [r for r in result.report.rewrites if r.node == node]
    assert applied.bound is None and applied.bound_formula.startswith("run-time-k:")
    return float(applied.bound_formula.partition(":")[2])


@rule_marker("qop-matmul", "positive")
def test_the_bound_depends_on_k_and_says_so(quantized):
    result = onnx_qrewrite.rewrite(quantized)
    assert {n.domain for n in result.model.graph.node} == {""}
    assert result.report.by_rule() == {"qop-matmul": 6, "qop-softmax": 1, "qop-add": 2}
    # The two activation x activation products: the bound is K's; the weight products have one.
    at_run_time = {r.node for r in result.report.rewrites if r.bound_formula}
    assert at_run_time == {"scores_quant", CONTEXT}
    (note,) = next(r for r in result.report.rewrites if r.node == CONTEXT).notes
    assert "the bound depends on K" in note and "verify evaluates at each sample's K" in note
    summary = "\n".join(result.report.summary_lines())
    assert "2 of them with a bound that depends on the reduction length K" in summary
    # The report says so too (--report): the formula beside a null bound.
    rows = [r for r in result.report.to_dict()["rewrites"] if r["node"] == CONTEXT]
    assert rows[0]["bound"] is None and rows[0]["bound_formula"].startswith("run-time-k:")


@rule_marker("qop-matmul", "positive")
def test_the_bound_holds_at_the_node_at_each_run_time_k(quantized):
    """verify at sequence lengths below and above the length where the context's sums may leave
    float32's exact integers: every bounded node within its bound, the context's evaluated at the
    sample's K (named in the row), growing with K as the rule's function says."""
    result = onnx_qrewrite.rewrite(quantized)
    per_k = _per_k(result, CONTEXT)
    limit = _exact_limit(quantized)
    lengths = (8, 64, limit - 1, limit + 1, 2 * limit)
    assert 300 < limit < 1000  # both sides are real sequence lengths
    bounds = []
    for seq in lengths:
        report = verify(quantized, result.model, samples=2, input_shapes={"x": (1, seq, D)})
        assert report.passed, report.to_table()
        row = node_row(report, CONTEXT)
        assert f"K = {seq} (run-time-k)" in row.tolerance.describe(True)
        assert row.tolerance.lsb == run_time_k_steps(seq, per_k)
        assert row.max_abs_error <= row.tolerance.lsb
        bounds.append(row.tolerance.lsb)
    assert bounds[0] == 1 and bounds == sorted(bounds) and bounds[-1] > 1, bounds


@rule_marker("qop-matmul", "positive")
def test_the_run_time_bound_is_the_one_the_rule_computes_for_a_recorded_k(quantized):
    """As tight as with the shape known: the same model with its sequence length fixed gets, from
    qop-matmul itself, the scalar bound the formula gives at that K; and that bound is reached on
    real runs (a one-step difference at the scores), so it is not vacuous."""
    result = onnx_qrewrite.rewrite(quantized)
    per_k = {node: _per_k(result, node) for node in ("scores_quant", CONTEXT)}
    for seq in (16, 700):
        fixed = onnx.ModelProto()
        fixed.CopyFrom(quantized)
        # What rewrite --target T --input-shape does: fix the dimension, record the shapes after it.
        apply_input_shapes(fixed, parse_input_shapes((f"seq={seq}",)))
        recorded = onnx_qrewrite.rewrite(fixed)
        bounds = {r.node: r.bound for r in recorded.report.rewrites if r.node in per_k}
        assert not any(r.bound_formula for r in recorded.report.rewrites)
        assert bounds == {
            "scores_quant": run_time_k_steps(D, per_k["scores_quant"]),
            CONTEXT: run_time_k_steps(seq, per_k[CONTEXT]),
        }, bounds
    reached = verify(quantized, result.model, samples=2, input_shapes={"x": (1, 300, D)})
    assert node_row(reached, "scores_quant").max_abs_error == 1 == node_row(reached, "scores_quant").tolerance.lsb


def _broken(rewritten: onnx.ModelProto, how: str) -> onnx.ModelProto:
    """The context's replacement with one bug: the values' zero point dropped from its
    DequantizeLinear, or its output scale one ulp larger."""
    broken = onnx.ModelProto()
    broken.CopyFrom(rewritten)
    nodes = [n for n in broken.graph.node if n.name.startswith(CONTEXT + "/")]
    if how == "zero point dropped":
        dq = next(n for n in nodes if n.name.endswith("/dq1"))
        del dq.input[2]
        return broken
    q = next(n for n in nodes if n.op_type == "QuantizeLinear")
    value = _constant(broken, q.input[1])
    broken.graph.initializer.append(numpy_helper.from_array(np.nextafter(value, np.float32(1)), "y_scale_ulp"))
    q.input[1] = "y_scale_ulp"
    return broken


@pytest.mark.parametrize("seq", [64, 700])
def test_a_dropped_zero_point_is_caught_at_the_node_at_a_run_time_k(quantized, seq):
    result = onnx_qrewrite.rewrite(quantized)
    report = verify(quantized, _broken(result.model, "zero point dropped"), samples=2, input_shapes={"x": (1, seq, D)})
    assert report.exit_code == EXIT_DISAGREE
    row = node_row(report, CONTEXT)
    assert not row.passed and f"K = {seq}" in row.tolerance.describe(True)
    assert row.max_abs_error > 10 * row.tolerance.lsb, report.to_table()  # far beyond, at either K


def test_a_scale_one_ulp_off_is_below_the_resolution_of_the_bound_at_any_k(quantized):
    """One ulp of the output scale moves each value by ~1e-7 of its size, at most 255 steps: never
    a whole step, which the bound (at least one step: fixed-point requantization against float)
    allows everywhere. The per-node check cannot see it, at a run-time K as at a recorded one
    (tests/test_verify_bounded_breaks.py pins the same for a recorded K); a scale 1.5x is caught."""
    result = onnx_qrewrite.rewrite(quantized)
    report = verify(quantized, _broken(result.model, "scale one ulp"), samples=2, input_shapes={"x": (1, 64, D)})
    row = node_row(report, CONTEXT)
    assert row.passed and row.tolerance.lsb == 1, report.to_table()
    broken = _broken(result.model, "scale one ulp")
    scale = next(t for t in broken.graph.initializer if t.name == "y_scale_ulp")
    scale.CopyFrom(numpy_helper.from_array(_constant(broken, "y_scale_ulp") * np.float32(1.5), "y_scale_ulp"))
    report = verify(quantized, broken, samples=2, input_shapes={"x": (1, 64, D)})
    assert not node_row(report, CONTEXT).passed, report.to_table()


def _activation_matmul(a_dtype: str, b_dtype: str, zero_points: tuple[int, int]) -> onnx.ModelProto:
    """One QLinearMatMul of two graph inputs, K symbolic ('k'), output scale sized for the sums."""
    types = {"uint8": TensorProto.UINT8, "int8": TensorProto.INT8}
    np_types = {"uint8": np.uint8, "int8": np.int8}
    consts = [
        numpy_helper.from_array(np.float32(0.02), "a_s"),
        numpy_helper.from_array(np.asarray(zero_points[0], np_types[a_dtype]), "a_z"),
        numpy_helper.from_array(np.float32(0.01), "b_s"),
        numpy_helper.from_array(np.asarray(zero_points[1], np_types[b_dtype]), "b_z"),
        numpy_helper.from_array(np.float32(0.5), "y_s"),
        numpy_helper.from_array(np.asarray(0, np_types[a_dtype]), "y_z"),
    ]
    node = helper.make_node("QLinearMatMul", ["a", "a_s", "a_z", "b", "b_s", "b_z", "y_s", "y_z"], ["y"], name="mm")
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info("a", types[a_dtype], [2, "k"]),
            helper.make_tensor_value_info("b", types[b_dtype], ["k", 3]),
        ],
        [helper.make_tensor_value_info("y", types[a_dtype], [2, 3])],
        consts,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def _odd_extreme(lo: int, hi: int, zero_point: int, side: int) -> int:
    """The value of [lo, hi] farthest from ``zero_point`` on ``side`` whose distance to it is odd
    (odd products keep the partial sums odd, so float32 must round them beyond 2^24)."""
    value = hi if side > 0 else lo
    return value if (value - zero_point) % 2 else value - side


def _cancelling_operands(k: int, dtype: str, zero_points: tuple[int, int], target: float, rng: np.random.Generator):
    """Row 0 of A at its farthest (odd) distance from its zero point, and B's columns the largest
    products of one sign first, then of the other, as many of each as brings the sum near
    ``target``: partial sums far beyond 2^24 (at K = 4096) that cancel to an output inside the
    output type's range, where a rewrite's rounding shows instead of saturating away. Row 1 of A is
    random; one element per column of B too, so the columns differ."""
    lo, hi = {"uint8": (0, 255), "int8": (-128, 127)}[dtype]
    (za, zb), np_type = zero_points, {"uint8": np.uint8, "int8": np.int8}[dtype]
    a = np.stack([np.full(k, _odd_extreme(lo, hi, za, 1 if hi - za >= za - lo else -1)), rng.integers(lo, hi + 1, k)])
    up, down = _odd_extreme(lo, hi, zb, 1), _odd_extreme(lo, hi, zb, -1)
    first, then = sorted((up, down), key=lambda v: -(a[0, 0] - za) * (v - zb))
    big, small = ((a[0, 0] - za) * (v - zb) for v in (first, then))
    count = int(np.clip(round((target - k * small) / (big - small)), 0, k))
    b = np.concatenate([np.full((count, 3), first), np.full((k - count, 3), then)])
    b[rng.integers(k, size=3), [0, 1, 2]] = rng.integers(lo, hi + 1, 3)
    return a.astype(np_type), b.astype(np_type)


@rule_marker("qop-matmul", "positive")
@pytest.mark.parametrize(
    ("a_dtype", "b_dtype", "zero_points"), [("uint8", "uint8", (7, 200)), ("int8", "int8", (0, -3))]
)
def test_against_onnxruntime_at_k_on_both_sides_of_2_24(a_dtype, b_dtype, zero_points):
    """The rewrite in stock onnxruntime against onnxruntime's QLinearMatMul at K = 4 .. 4096, on
    operands whose partial sums leave float32's exact range (beyond 2^24 at K = 4096) and cancel
    to outputs inside the output's range (random operands saturate the output at large K, where
    every rewrite agrees): within the formula's bound at that K, which grows past one step where
    the sums leave float32's exact range."""
    model = _activation_matmul(a_dtype, b_dtype, zero_points)
    result = onnx_qrewrite.rewrite(model)
    (applied,) = result.report.rewrites
    per_k = float(applied.bound_formula.partition(":")[2])
    y_lo, y_hi = {"uint8": (0, 255), "int8": (-128, 127)}[a_dtype]
    target = (y_lo + y_hi) / 2 / (0.02 * 0.01 / 0.5)  # mid-range of y, in units of the sum (scales: the model's)
    rng = np.random.default_rng(0)
    steps = []
    for k in (4, 200, 1000, 4096):
        a, b = _cancelling_operands(k, a_dtype, zero_points, target, rng)
        bound = run_time_k_steps(k, per_k)
        got = run(result.model, {"a": a, "b": b})["y"].astype(np.int64)
        want = run(model, {"a": a, "b": b})["y"].astype(np.int64)
        assert np.abs(got - want).max() <= bound, (k, np.abs(got - want).max(), bound)
        if k >= 200:  # row 0 is not saturated: the comparison says something there
            assert ((want[0] > y_lo) & (want[0] < y_hi)).all(), (k, want)
        steps.append(bound)
    assert steps[0] == 1 and steps[-1] > 1, steps


@rule_marker("qop-matmul", "negative")
def test_with_reduction_length_recorded_the_rule_declines_an_unrecorded_k():
    """The option the rule declares: 'recorded' leaves such a node with the reason and the way out."""
    model = _activation_matmul("uint8", "uint8", (7, 200))
    with pytest.raises(LoweringError, match=r"reduction length of mm .* is not fixed in the model"):
        onnx_qrewrite.rewrite(model, options={"qop-matmul": {"reduction_length": "recorded"}})


def test_a_run_time_bound_verify_cannot_evaluate_allows_nothing(quantized):
    """With the original node not found (renamed), the formula cannot be evaluated: the node's row
    holds the rewrite to exactness, so the dropped zero point fails there, instead of passing
    within an unbounded tolerance."""
    result = onnx_qrewrite.rewrite(quantized)
    renamed = onnx.ModelProto()
    renamed.CopyFrom(quantized)
    _node(renamed, CONTEXT).name = CONTEXT + "_renamed"
    report = verify(renamed, _broken(result.model, "zero point dropped"), samples=2, input_shapes={"x": (1, 64, D)})
    row = node_row(report, CONTEXT)
    assert not row.passed and row.tolerance.lsb == 0, report.to_table()
    assert "could not be evaluated" in row.tolerance.describe(True)


def test_an_output_scale_that_makes_the_bound_one_step_up_to_2_24_is_rewritten():
    """A per-K factor so small that the bound is one step until float32 summation has no bound at
    all (K + 4 >= 2^24): the rule says so in its note, and the function is infinite beyond, not a
    crash (it was exit 5)."""
    model = _activation_matmul("uint8", "uint8", (7, 200))
    y_s = next(t for t in model.graph.initializer if t.name == "y_s")
    y_s.CopyFrom(numpy_helper.from_array(np.float32(1e16), "y_s"))
    (applied,) = onnx_qrewrite.rewrite(model).report.rewrites
    assert f"one step up to K = {2**24 - 5}" in applied.notes[0], applied.notes
    assert run_time_k_steps(2**24 - 5, 1e-15) == 1 and run_time_k_steps(2**24 - 4, 1e-15) == math.inf


@rule_marker("qop-matmul-u8s8-unsaturated", "positive")
def test_the_approximate_u8s8_rule_needs_no_recorded_k():
    """uint8 x int8 operands both computed at run time: the approximate rule (asked for) keeps no
    bound, so an unrecorded K does not stop it (it declined, pointing at an option it lacks)."""
    model = _activation_matmul("uint8", "int8", (7, 0))
    with pytest.raises(LoweringError, match="may saturate pairs of products to int16"):
        onnx_qrewrite.rewrite(model)
    result = onnx_qrewrite.rewrite(model, allow=["exact", "bounded", "approximate"])
    (applied,) = result.report.rewrites
    assert applied.rule == "qop-matmul-u8s8-unsaturated" and applied.bound is None, applied
    assert "known only at run time: approximate, no bound" in applied.notes[0]
