"""The "float-emulation" form with ``elementwise = "comparisons"`` (for targets without Round and
IsNaN kernels: onnxruntime's WebGPU execution provider): Round half to even from Floor and
comparisons, IsNaN as Not(Equal(x, x)); bit for bit against onnxruntime's QuantizeLinear and
QuantizeLinear -> DequantizeLinear on the edge values of tests/test_float_emulation.py, random
float32 bit patterns and every tie in the 16-bit range; and a broken tie rule shown to fail."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from conftest import assert_bitwise_equal, op_types, rule_marker, run
from test_float_emulation import FLOATS, NP, _edge_inputs, _model, _pair, _zero_points

import onnx_qrewrite
from onnx_qrewrite.rewriter.catalogue import load_catalogue, named_form

FORM = load_catalogue([named_form("float-emulation")]).with_option("elementwise", "comparisons")
#: What a target without these kernels cannot have.
ABSENT = {"Round", "IsNaN", "QuantizeLinear"}


def _values() -> np.ndarray:
    """Edge values, 200k random float32 bit patterns (NaNs, infinities and denormals among them),
    every half-integer tie in the 16-bit range and its two neighbours."""
    rng = np.random.default_rng(11)
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    ties = (np.arange(-70000, 70000) + 0.5).astype(np.float32)
    near = np.concatenate([np.nextafter(ties, np.float32(np.inf)), np.nextafter(ties, np.float32(-np.inf))])
    return np.concatenate([_edge_inputs(np.float32), bits, ties, near]).astype(np.float32)


@rule_marker("float-emulation-q", "positive")
@pytest.mark.parametrize("ftype", list(FLOATS))
@pytest.mark.parametrize("qtype", list(NP))
def test_quantize_without_round_or_isnan_is_bit_exact(qtype, ftype):
    fnp = FLOATS[ftype][0]
    x = _values() if ftype == "float32" else _edge_inputs(fnp)
    scales = [1e-45, 3e-5, 0.1, 0.37, 1.0, 3.0, 1e38] if ftype == "float32" else [6e-8, 1e-3, 1.0, 65504.0]
    for scale, zp in itertools.product(scales, _zero_points(qtype, True)):
        model = _model("QuantizeLinear", qtype, ftype, scale, zp, list(x.shape), None)
        result = onnx_qrewrite.rewrite(model, rules=FORM)
        assert result.report.by_rule() == {"float-emulation-q": 1}
        assert not ABSENT & set(op_types(result.model)), op_types(result.model)
        what = f"{qtype} {ftype} scale {scale} zp {zp}"
        assert_bitwise_equal(run(result.model, {"x": x})["y"], run(model, {"x": x})["y"], what)


@rule_marker("float-emulation-qdq-pair", "positive")
@pytest.mark.parametrize("qtype", list(NP))
def test_pair_without_round_or_isnan_is_bit_exact(qtype):
    """Q -> DQ as one float expression: the sign of a zero Round gives is erased by the zero point
    (or the + 0.0 where there is none), so the output is bit-exact, -0.0 and NaN inputs included."""
    x = _values()
    lo, hi = np.iinfo(NP[qtype]).min, np.iinfo(NP[qtype]).max
    for scale, zp in itertools.product([1e-45, 0.0078125, 0.37, 1.0, 3.4e38], [0, lo, hi]):
        model = _pair(qtype, scale, zp, scale, zp, list(x.shape), None)
        result = onnx_qrewrite.rewrite(model, rules=FORM)
        assert "float-emulation-qdq-pair" in result.report.by_rule()
        assert not ABSENT & set(op_types(result.model)), op_types(result.model)
        what = f"{qtype} scale {scale} zp {zp}"
        assert_bitwise_equal(run(result.model, {"x": x})["y"], run(model, {"x": x})["y"], what)


@rule_marker("float-emulation-q", "positive")
@pytest.mark.parametrize("axis", [0, -1])
def test_per_axis_quantize_without_round_is_bit_exact(axis):
    rng = np.random.default_rng(5)
    shape = [3, 4, 5]
    scale = rng.uniform(0.001, 2.0, shape[axis]).astype(np.float32)
    zp = rng.integers(-100, 100, shape[axis]).astype(np.int8)
    model = _model("QuantizeLinear", "int8", "float32", scale, zp, shape, axis)
    x = (rng.standard_normal(shape) * 100).astype(np.float32)
    x.flat[:4] = [0.5 * scale.flat[0], -1.5 * scale.flat[0], np.nan, -0.0]
    result = onnx_qrewrite.rewrite(model, rules=FORM)
    assert_bitwise_equal(run(result.model, {"x": x})["y"], run(model, {"x": x})["y"], f"axis {axis}")


def test_a_tie_rounded_away_from_even_is_caught(monkeypatch):
    """The battery above can fail: rounding ties up instead of to even (the parity term dropped)
    gives other integers than onnxruntime's QuantizeLinear."""
    from onnx_qrewrite.rewriter.builders import float_emulation

    real = float_emulation._round

    def ties_up(emit, v, elementwise):
        if elementwise == "standard":
            return real(emit, v, elementwise)
        return emit.op1("Floor", [emit.op1("Add", [v, emit.const(np.float32(0.5))])])

    monkeypatch.setattr(float_emulation, "_round", ties_up)
    x = (np.arange(-300, 300) + 0.5).astype(np.float32)
    model = _model("QuantizeLinear", "int16", "float32", 1.0, 0, list(x.shape), None)
    result = onnx_qrewrite.rewrite(model, rules=FORM)
    assert np.any(run(result.model, {"x": x})["y"] != run(model, {"x": x})["y"])


def test_the_standard_form_still_uses_round_and_isnan():
    model = _model("QuantizeLinear", "uint8", "float32", 0.1, 3, [4], None)
    ops = op_types(onnx_qrewrite.rewrite(model, rules=load_catalogue([named_form("float-emulation")])).model)
    assert {"Round", "IsNaN"} <= set(ops)
