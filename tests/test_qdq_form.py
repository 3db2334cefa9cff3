"""The "qdq" form (rules/forms/qdq.toml, onnx_qrewrite/rewriter/builders/dynamic_qdq.py): dynamically
quantized matmuls and convolutions to DequantizeLinear of the quantized activation and of the
weights, then the float op, with the activation's DynamicQuantizeLinear kept.

It is bounded: float32 accumulation of the dequantized products instead of the exact integer sum.
Here, against onnxruntime's own kernels (MatMulInteger, ConvInteger, com.microsoft
MatMulIntegerToFloat and DynamicQuantizeMatMul), on uint8 and int8 weights, per tensor and per
output column/channel, zero points absent, zero and non-zero, with inputs of several ranges: every
output is within the bound the rule records, computed here independently from the formula; broken
rewrites (a zero point dropped, a scale 1 % off) exceed it at the node through ``verify``, and a
scale one ulp off does not (below the resolution of a sound bound on float32 sums). Real producer
models (quantize_dynamic, onnxruntime's fusions) are rewritten to standard ops and verified.

``python tests/test_qdq_form.py`` prints the battery's worst error / bound ratios and the real
models' verify results.
"""

from __future__ import annotations

import sys
from pathlib import Path
from unittest import mock

import numpy as np
import onnx
import pytest
from _int_matmul_helpers import on_a_saturating_cpu
from _verify_helpers import node_row
from conftest import rule_marker, session
from onnx import TensorProto, helper, numpy_helper
from test_u8s8_saturation import SATURATES

import onnx_qrewrite
from onnx_qrewrite.errors import EXIT_DISAGREE
from onnx_qrewrite.rewriter.builders import dynamic_qdq
from onnx_qrewrite.rewriter.catalogue import load_catalogue, named_form
from onnx_qrewrite.verify import verify
from onnx_qrewrite.verify.bounds import bounded_rewrites

FORM = load_catalogue([named_form("qdq")])
U = 2.0**-24
_INTEGER_OPS = {"MatMulInteger", "ConvInteger", "MatMulIntegerToFloat", "DynamicQuantizeMatMul"}
OPS = ("MatMulInteger", "ConvInteger", "MatMulIntegerToFloat", "DynamicQuantizeMatMul")
N = 8  # output columns / channels
K_MATMUL = 256
C_CONV = 32  # K = 32 * 3 * 3 = 288


def _gamma(n: int) -> float:
    return n * U / (1 - n * U)


def _weights(op: str, dtype: str, per_channel: bool, zp_mode: str, rng: np.random.Generator):
    """W (int8 in 7 bits, as quantize_dynamic's reduce_range writes it: no int16 pair saturation),
    its scale and zero point (None: absent) in the shapes quantize_dynamic uses."""
    conv = op == "ConvInteger"
    shape = (N, C_CONV, 3, 3) if conv else (K_MATMUL, N)
    if dtype == "int8":
        w = rng.integers(-64, 64, shape).astype(np.int8)
    else:
        w = rng.integers(0, 256, shape).astype(np.uint8)
    scale = rng.uniform(0.001, 0.02, N).astype(np.float32) if per_channel else np.float32(0.0123)
    if zp_mode == "absent":
        return w, np.asarray(scale), None
    np_type = np.int8 if dtype == "int8" else np.uint8
    if zp_mode == "zero":
        zp = np.zeros(N, np_type) if per_channel and not conv else np_type(0)
    elif dtype == "int8":
        zp = rng.integers(-20, 20, N).astype(np.int8) if per_channel and not conv else np.int8(-7)
    else:
        zp = rng.integers(100, 156, N).astype(np.uint8) if per_channel and not conv else np.uint8(131)
    return w, np.asarray(scale), np.asarray(zp)


def _model(op: str, dtype: str, per_channel: bool, zp_mode: str, *, bias: bool = False, seed: int = 0):
    """One node of ``op`` as quantize_dynamic (or onnxruntime's fusion) writes it, its output "y"."""
    rng = np.random.default_rng(seed)
    w, scale, zp = _weights(op, dtype, per_channel, zp_mode, rng)
    conv = op == "ConvInteger"
    wscale = scale.reshape(N, 1, 1) if conv and scale.size > 1 else scale  # broadcasts over [1, N, H, W]
    inits = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(wscale, "ws")]
    wz = ""
    if zp is not None:
        inits.append(numpy_helper.from_array(zp, "wz"))
        wz = "wz"
    b = rng.standard_normal(N).astype(np.float32) * 3
    dql = helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"], name="dql")
    if op in ("MatMulInteger", "ConvInteger"):
        attrs = {"pads": [1, 1, 1, 1]} if conv else {}
        nodes = [
            dql,
            helper.make_node(op, ["xq", "W", "xz", wz], ["acc"], name="int", **attrs),
            helper.make_node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT, name="cast"),
            helper.make_node("Mul", ["xs", "ws"], ["sp"], name="scale"),
            helper.make_node("Mul", ["accf", "sp"], ["y"], name="anchor"),
        ]
        assert not bias
    else:
        bias_in = ["b"] if bias else []
        if bias:
            inits.append(numpy_helper.from_array(b, "b"))
        if op == "MatMulIntegerToFloat":
            inputs = ["xq", "W", "xs", "ws", "xz", wz, *bias_in]
            nodes = [dql, helper.make_node(op, inputs, ["y"], name="anchor", domain="com.microsoft")]
        else:
            nodes = [helper.make_node(op, ["x", "W", "ws", wz, *bias_in], ["y"], name="anchor", domain="com.microsoft")]
    x_shape = [1, C_CONV, 6, 6] if conv else [4, K_MATMUL]
    y_shape = [1, N, 6, 6] if conv else [4, N]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)],
        inits,
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def _inputs(model: onnx.ModelProto) -> list[np.ndarray]:
    """Several ranges: normal, wide, all positive (zero point 0), all negative, one outlier."""
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    rng = np.random.default_rng(11)
    normal = rng.standard_normal(shape).astype(np.float32)
    outlier = normal.copy()
    outlier.flat[3] = 40.0
    return [
        normal,
        (normal * 1000).astype(np.float32),
        np.abs(normal) + np.float32(0.5),
        -np.abs(normal),
        outlier,
    ]


def _expected_bound(model: onnx.ModelProto, op: str, bias: bool) -> tuple[float, float]:
    """(constant, per unit of max|x|), from the formula in builders/dynamic_qdq.py, independently."""
    init = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    w = init["W"].astype(np.float64)
    rows = w.reshape(N, -1) if op == "ConvInteger" else w.T
    zp = init["wz"].astype(np.float64).reshape(-1, 1) if "wz" in init else np.zeros((1, 1))
    scale = init["ws"].astype(np.float64).reshape(-1)
    c = float((np.abs(rows - zp).sum(axis=1) * scale).max())
    k = rows.shape[1]
    per_unit = (_gamma(k + 2) + _gamma(3) + (3 * U if bias else 0.0)) * (1 + 2.0**-7) * c
    constant = 3 * U * float(np.abs(init["b"]).max()) if bias else 0.0
    return constant, per_unit


def _rewrite(model: onnx.ModelProto, **kw) -> onnx_qrewrite.RewriteResult:
    return onnx_qrewrite.rewrite(model, rules=FORM, **kw)


_CASES = [
    (op, dtype, per_channel, zp_mode)
    for op in OPS
    for dtype in ("uint8", "int8")
    for per_channel in (False, True)
    for zp_mode in ("absent", "zero", "nonzero")
]


def _check_case(op: str, dtype: str, per_channel: bool, zp_mode: str, bias: bool) -> float:
    """Rewrite, check the recorded bound against the formula, run both; the worst error / bound."""
    model = _model(op, dtype, per_channel, zp_mode, bias=bias)
    result = _rewrite(model)
    rule = "qdq-matmul" if op in ("MatMulInteger", "ConvInteger") else "qdq-ms-matmul"
    assert result.report.by_rule().get(rule) == 1, result.report.by_rule()
    out = result.model
    assert not {n.op_type for n in out.graph.node} & _INTEGER_OPS
    assert {n.domain for n in out.graph.node} <= {"", "ai.onnx"}
    (recorded,) = bounded_rewrites(model, out)
    constant, per_unit = _expected_bound(model, op, bias)
    assert recorded.unit == "x" and recorded.outputs == ("y",)
    assert recorded.bound == pytest.approx(constant, rel=1e-12, abs=0)
    assert recorded.per_unit == pytest.approx(per_unit, rel=1e-12)
    original, rewritten = session(model), session(out)
    worst = 0.0
    for x in _inputs(model):
        (a,) = original.run(None, {"x": x})
        (b,) = rewritten.run(None, {"x": x})
        bound = constant + per_unit * float(np.abs(x).max())
        error = float(np.abs(a.astype(np.float64) - b).max())
        assert error <= bound, (error, bound)
        worst = max(worst, error / bound)
    return worst


@rule_marker("qdq-matmul", "positive")
@rule_marker("qdq-ms-matmul", "positive")
@rule_marker("qdq-remove-dead", "positive")
@pytest.mark.parametrize(("op", "dtype", "per_channel", "zp_mode"), _CASES)
def test_every_output_is_within_the_recorded_bound_of_onnxruntimes_kernel(op, dtype, per_channel, zp_mode):
    _check_case(op, dtype, per_channel, zp_mode, bias=False)


@rule_marker("qdq-ms-matmul", "positive")
@pytest.mark.parametrize("op", ["MatMulIntegerToFloat", "DynamicQuantizeMatMul"])
@pytest.mark.parametrize("dtype", ["uint8", "int8"])
def test_the_fused_ops_bias_is_added_within_the_bound(op, dtype):
    _check_case(op, dtype, True, "nonzero", bias=True)


@rule_marker("qdq-matmul", "positive")
@rule_marker("qdq-remove-dead", "positive")
def test_the_activation_quantization_is_kept_and_the_pattern_removed():
    model = _model("MatMulInteger", "uint8", True, "nonzero")
    out = _rewrite(model).model
    ops = [n.op_type for n in out.graph.node]
    assert ops.count("DequantizeLinear") == 2 and ops.count("MatMul") == 1
    assert "Cast" not in ops[ops.index("QuantizeLinear") :]  # the int32 Cast went with MatMulInteger
    dq = {n.input[0]: n for n in out.graph.node if n.op_type == "DequantizeLinear"}
    assert set(dq) == {"xq", "W"} and list(dq["xq"].input) == ["xq", "xs", "xz"]
    # The DynamicQuantizeLinear itself stays where it was, lowered by the default rule: its
    # QuantizeLinear writes xq.
    assert next(n for n in out.graph.node if "xq" in n.output).op_type == "QuantizeLinear"


@rule_marker("qdq-ms-matmul", "positive")
@pytest.mark.parametrize("quantize", ["expand", "keep"])
def test_dynamic_quantize_matmul_quantizes_its_activation_as_asked(quantize):
    model = _model("DynamicQuantizeMatMul", "uint8", False, "nonzero", bias=True)
    rules = FORM.with_option("quantize", quantize)
    out = onnx_qrewrite.rewrite(model, rules=rules).model
    ops = {n.op_type for n in out.graph.node}
    assert ("DynamicQuantizeLinear" in ops) == (quantize == "keep")
    assert ("QuantizeLinear" in ops) == (quantize == "expand")
    x = _inputs(model)[0]
    # Either way the activation is quantized exactly as the kernel does: the same within the bound.
    constant, per_unit = _expected_bound(model, "DynamicQuantizeMatMul", True)
    (a,) = session(model).run(None, {"x": x})
    (b,) = session(out).run(None, {"x": x})
    assert float(np.abs(a - b).max()) <= constant + per_unit * float(np.abs(x).max())


# --- verify checks the bound at the node, and it is tight enough to catch broken rewrites --------


def _broken(rewritten: onnx.ModelProto, how: str) -> onnx.ModelProto:
    broken = onnx.ModelProto()
    broken.CopyFrom(rewritten)
    # The weights' DequantizeLinear reads W; the activation's the quantized x (its own name for
    # DynamicQuantizeMatMul, which quantizes inside).
    dq = {("W" if n.input[0] == "W" else "x"): n for n in broken.graph.node if n.op_type == "DequantizeLinear"}
    if how == "weight zero point dropped":
        del dq["W"].input[2]
    elif how == "activation zero point dropped":
        del dq["x"].input[2]
    else:  # the weight scale changed
        name = dq["W"].input[1]
        value = numpy_helper.to_array(next(t for t in broken.graph.initializer if t.name == name))
        if how == "weight scale 1% off":
            changed = (value * np.float32(1.01)).astype(np.float32)
        else:
            changed = np.nextafter(value, np.float32(1))
        broken.graph.initializer.append(numpy_helper.from_array(changed, f"{name}_broken"))
        dq["W"].input[1] = f"{name}_broken"
    return broken


@rule_marker("qdq-matmul", "positive")
@rule_marker("qdq-ms-matmul", "positive")
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("how", ["weight zero point dropped", "activation zero point dropped", "weight scale 1% off"])
def test_verify_catches_a_broken_rewrite_at_its_node_and_passes_the_correct_one(op, how):
    model = _model(op, "uint8", op != "ConvInteger", "nonzero")
    rewritten = _rewrite(model).model
    good = verify(model, rewritten, samples=2)
    good_row = node_row(good, "anchor")
    # (The model output is the same value: against the original re-run from the rewritten model's
    # value there (verify/reanchor.py) it is trivially equal; the bound row is the judge.)
    assert good_row.passed and good.passed, good.to_table()
    assert "bound 0 + " in good_row.name and "·max|x|" in good_row.name
    report = verify(model, _broken(rewritten, how), samples=2)
    assert report.exit_code == EXIT_DISAGREE
    row = node_row(report, "anchor")
    assert not row.passed, report.to_table()
    # Tight enough: the correct replacement is well within the bound, the broken one beyond it.
    assert good_row.max_abs_error < 0.1 * good_row.tolerance.atol
    assert row.max_abs_error > row.tolerance.atol


def test_a_scale_one_ulp_off_is_below_the_resolution_of_the_bound():
    """A weight scale one ulp off changes each output by about one float32 rounding of it, which
    float32 accumulation itself may do K times over: no sound bound on the sum can see it. Pinned
    so that the form's notes stay true."""
    model = _model("MatMulInteger", "uint8", False, "nonzero")
    rewritten = _rewrite(model).model
    report = verify(model, _broken(rewritten, "weight scale one ulp off"), samples=2)
    assert node_row(report, "anchor").passed, report.to_table()


# --- where it gives way ------------------------------------------------------------------------


@rule_marker("qdq-matmul", "negative")
@rule_marker("qdq-ms-matmul", "negative")
@pytest.mark.parametrize("op", ["MatMulInteger", "MatMulIntegerToFloat", "DynamicQuantizeMatMul"])
def test_full_range_int8_weights_that_onnxruntime_may_saturate_give_way(op):
    """uint8 x int8 pairs beyond int16 (onnxruntime's kernel without AVX-VNNI saturates them): this
    form states no bound for them, so the default rules lower the node (bounded by the weights'
    pair excess, rules/50-integer-matmul.toml)."""
    model = _model(op, "int8", False, "absent")
    w = next(t for t in model.graph.initializer if t.name == "W")
    full = numpy_helper.to_array(w).copy()
    full[0, :] = 127
    full[1, :] = 127
    w.CopyFrom(numpy_helper.from_array(full, "W"))
    result = _rewrite(model)
    rules = result.report.by_rule()
    assert "qdq-matmul" not in rules and "qdq-ms-matmul" not in rules, rules
    bounded = bounded_rewrites(model, result.model)
    assert bounded and all((r.formula or "").startswith("u8s8-pairs") for r in bounded), bounded


def _with_pair(op: str, rows: tuple[int, int]) -> onnx.ModelProto:
    """``op``'s model with int8 weights of 127 at ``rows`` (along K) of every column, and 0 at the
    rows the kernel pairs them with if not each other (the random weights stay within [-64, 63])."""
    model = _model(op, "int8", False, "absent")
    w = next(t for t in model.graph.initializer if t.name == "W")
    full = numpy_helper.to_array(w).copy()
    full[[k ^ 1 for k in rows], :] = 0
    full[list(rows), :] = 127
    w.CopyFrom(numpy_helper.from_array(full, "W"))
    return model


def _error_and_bound(model: onnx.ModelProto, rewritten: onnx.ModelProto, hot: tuple[int, int]) -> tuple[float, float]:
    """The rewrite against onnxruntime's default kernel (no x64quantprecision, which verify's
    reference applies) with x largest at rows ``hot`` (quantized to 255): (max error, its bound)."""
    x = np.random.default_rng(5).standard_normal((4, K_MATMUL)).astype(np.float32)
    x[:, list(hot)] = 8.0
    (want,) = session(model).run(None, {"x": x})
    (got,) = session(rewritten).run(None, {"x": x})
    (recorded,) = bounded_rewrites(model, rewritten)
    return float(np.abs(want.astype(np.float64) - got).max()), recorded.bound + recorded.per_unit * 8.0


def _no_excess(rows: np.ndarray, dtype: str) -> np.ndarray:
    return np.zeros(rows.shape[0], np.int64)


@rule_marker("qdq-matmul", "positive")
@rule_marker("qdq-ms-matmul", "positive")
@pytest.mark.parametrize("op", ["MatMulInteger", "MatMulIntegerToFloat", "DynamicQuantizeMatMul"])
def test_full_range_weights_across_two_of_the_kernels_pairs_keep_the_form(op):
    """Weights of 127 at k = 1 and 2, times activations of 255: 64770 if they were a pair, but the
    kernel pairs (0, 1) and (2, 3), each within int16. The check on every adjacent pair gave way
    here; the kernel's own pairs (u8s8.pair_excess) prove no saturation, and onnxruntime's default
    kernel agrees: the rewrite stays within its float32 bound. The same form forced onto weights the
    kernel does pair (2, 3) is beyond it where the kernel saturates (this CPU's, or the saturating
    kernel emulated): the check is what keeps it sound."""
    model = _with_pair(op, (1, 2))
    result = _rewrite(model)
    rule = "qdq-matmul" if op == "MatMulInteger" else "qdq-ms-matmul"
    assert result.report.by_rule().get(rule) == 1, result.report.by_rule()
    error, bound = _error_and_bound(model, result.model, (1, 2))
    assert error <= bound, (error, bound)
    paired = _with_pair(op, (2, 3))
    with mock.patch.object(dynamic_qdq.u8s8, "pair_excess", _no_excess):
        forced = _rewrite(paired)
    assert forced.report.by_rule().get(rule) == 1, forced.report.by_rule()
    error, bound = _error_and_bound(paired, forced.model, (2, 3))
    assert (error > 100 * bound) == SATURATES, (error, bound)
    with on_a_saturating_cpu():  # the kernel of a CPU that saturates, emulated on any CPU
        error, bound = _error_and_bound(paired, forced.model, (2, 3))
    assert error > 100 * bound, (error, bound)


@rule_marker("qdq-matmul", "negative")
@rule_marker("qdq-ms-matmul", "negative")
@pytest.mark.parametrize("op", ["MatMulInteger", "MatMulIntegerToFloat", "DynamicQuantizeMatMul"])
@pytest.mark.parametrize("rows", [(2, 3), (K_MATMUL - 2, K_MATMUL - 1)], ids=str)
def test_full_range_weights_in_one_of_the_kernels_pairs_still_give_way(op, rows):
    """The same weights where the kernel pairs them (2j, 2j + 1): saturation is real (measured in
    tests/test_u8s8_saturation.py), so the form gives way to the default rules' pair-excess bound."""
    result = _rewrite(_with_pair(op, rows))
    rules = result.report.by_rule()
    assert "qdq-matmul" not in rules and "qdq-ms-matmul" not in rules, rules
    bounded = bounded_rewrites(_with_pair(op, rows), result.model)
    assert bounded and all((r.formula or "").startswith("u8s8-pairs") for r in bounded), bounded


@rule_marker("qdq-ms-matmul", "negative")
def test_a_bias_computed_at_run_time_gives_way():
    model = _model("MatMulIntegerToFloat", "uint8", False, "nonzero", bias=True)
    b = next(t for t in model.graph.initializer if t.name == "b")
    model.graph.initializer.remove(b)
    model.graph.input.append(helper.make_tensor_value_info("b", TensorProto.FLOAT, [N]))
    rules = _rewrite(model).report.by_rule()
    assert "qdq-ms-matmul" not in rules and rules.get("ms-int-matmul-float") == 1, rules


@rule_marker("qdq-remove-dead", "negative")
def test_a_pattern_node_something_else_reads_stays_and_gets_its_exact_lowering():
    model = _model("MatMulInteger", "uint8", False, "nonzero")
    model.graph.output.append(helper.make_tensor_value_info("accf", TensorProto.FLOAT, [4, N]))
    result = _rewrite(model)
    rules = result.report.by_rule()
    assert rules["qdq-matmul"] == 1 and rules.get("int-matmul-float") == 1, rules
    assert rules.get("qdq-remove-dead") == 1  # the scale product only: the Cast and MatMulInteger are read
    x = _inputs(model)[0]
    a = session(model).run(None, {"x": x})
    b = session(result.model).run(None, {"x": x})
    np.testing.assert_array_equal(a[1], b[1])  # the Cast's value, exactly


@rule_marker("qdq-matmul", "negative")
@rule_marker("qdq-remove-dead", "negative")
def test_with_only_exact_rules_allowed_the_form_changes_nothing():
    model = _model("MatMulInteger", "uint8", True, "nonzero")
    alone = onnx_qrewrite.rewrite(model, rules=FORM, allow=("exact",))
    default = onnx_qrewrite.rewrite(model)
    assert alone.report.by_rule() == default.report.by_rule()
    assert alone.model.SerializeToString() == default.model.SerializeToString()


def test_the_form_is_selected_by_name_from_the_command_line(tmp_path):
    from click.testing import CliRunner

    from onnx_qrewrite.cli import main

    source, out = tmp_path / "m.onnx", tmp_path / "out.onnx"
    onnx.save(_model("ConvInteger", "uint8", True, "nonzero"), source)
    result = CliRunner().invoke(main, ["rewrite", str(source), "-o", str(out), "--form", "qdq"])
    assert result.exit_code == 0, result.output
    assert "qdq-matmul" in result.output and "bounded" in result.output
    assert {n.op_type for n in onnx.load(out).graph.node} >= {"DequantizeLinear", "Conv"}


# --- real producer models ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def producer_models(tmp_path_factory) -> dict[str, Path]:
    from test_weight_only_models import _producer_models

    return _producer_models(tmp_path_factory.mktemp("qdq"))


def _verify_real(original: Path, rewritten: onnx.ModelProto, tmp_path: Path):
    """At verify's default tolerances: the outputs against the original re-run from the rewritten
    model's bounded values (verify/reanchor.py), each bounded node against its bound. (Against the
    plain original, float32 accumulation on the 'wide-range' sample differs by up to 3.6e-5
    relative near cancellation on the MLP, beyond the default rtol of 1e-5: informational.)"""
    path = tmp_path / "rewritten.onnx"
    onnx.save(rewritten, path)
    return verify(original, path, samples=2)


_REAL = [
    "mlp-u8",
    "mlp-s8-per-channel",
    "mlp-s8-per-channel-fused",
    "cnn-u8",
    "cnn-u8-per-channel-fused",
    "bert",
    "bert-fused",
    "cnn",
]


@rule_marker("qdq-matmul", "positive")
@rule_marker("qdq-ms-matmul", "positive")
@pytest.mark.parametrize("name", _REAL)
def test_producer_models_become_standard_onnx_and_verify_within_every_node_bound(producer_models, name, tmp_path):
    original = producer_models[name]
    result = onnx_qrewrite.rewrite(original, rules=FORM)
    out = result.model
    assert {n.domain for n in out.graph.node} <= {"", "ai.onnx"}
    assert not {n.op_type for n in out.graph.node} & _INTEGER_OPS
    rules = result.report.by_rule()
    anchors = rules.get("qdq-matmul", 0) + rules.get("qdq-ms-matmul", 0)
    assert anchors and not any(r.startswith(("int-matmul", "ms-int-matmul")) for r in rules), rules
    report = _verify_real(original, out, tmp_path)
    assert report.passed, report.to_table()
    rows = [o for o in report.outputs if "(node " in o.name]  # also the bounded contrib un-fusings (bert-fused)
    assert len([o for o in rows if "rule qdq-" in o.name]) == anchors
    assert all(o.max_abs_error <= o.tolerance.atol for o in rows)
    assert {o.reference for o in report.outputs if "(node " not in o.name} == {"re-anchored"}


def _table() -> None:
    """The battery's worst error / bound ratios, and the real models' verify results."""
    import tempfile

    from test_weight_only_models import _producer_models

    print(f"{'op':22} {'weights':6} {'per-ch':6} {'zp':8} {'bias':5} {'worst error / bound':>20}")
    for op, dtype, per_channel, zp_mode in _CASES:
        ratio = _check_case(op, dtype, per_channel, zp_mode, bias=False)
        print(f"{op:22} {dtype:6} {per_channel!s:6} {zp_mode:8} {'no':5} {ratio:20.3g}")
    for op in ("MatMulIntegerToFloat", "DynamicQuantizeMatMul"):
        for dtype in ("uint8", "int8"):
            ratio = _check_case(op, dtype, True, "nonzero", bias=True)
            print(f"{op:22} {dtype:6} {'True':6} {'nonzero':8} {'yes':5} {ratio:20.3g}")
    with tempfile.TemporaryDirectory() as folder:
        found = _producer_models(Path(folder))
        print(
            f"\n{'model':26} {'rules':58} {'verify':7} {'nodes':>5} {'worst err/bound':>15} "
            f"{'re-anchored max abs':>19} {'vs original max abs':>19} {'max rel':>8}"
        )
        for name, path in found.items():
            result = onnx_qrewrite.rewrite(path, rules=FORM)
            report = _verify_real(path, result.model, Path(folder))
            rows = [o for o in report.outputs if "(node " in o.name]
            finals = [o for o in report.outputs if " (" not in o.name]
            worst = max((o.max_abs_error / o.tolerance.atol for o in rows), default=0.0)
            rules = ", ".join(f"{k} {v}" for k, v in sorted(result.report.by_rule().items()))
            plain = [o.against_original or o for o in finals]
            print(
                f"{name:26} {rules:58} {'PASSED' if report.passed else 'FAILED':7} {len(rows):5d} {worst:15.3g} "
                f"{max(o.max_abs_error for o in finals):19.3g} {max(o.max_abs_error for o in plain):19.3g} "
                f"{max(o.max_rel_error for o in plain):8.3g}"
            )


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    _table()
