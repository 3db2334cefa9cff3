"""Form ``elementwise-decompositions`` (onnx_qrewrite/rewriter/builders/decompose.py):
LayerNormalization within its measured bound of onnxruntime's kernel, Erf's Abramowitz-Stegun form
within 6.7e-7 of onnxruntime's Erf, and the approximate rule only with consent."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import rule_marker, run
from onnx import TensorProto, helper
from onnx.numpy_helper import from_array

from onnx_qrewrite import rewrite
from onnx_qrewrite.rewriter.catalogue import named_form

pytest.importorskip("onnxruntime", reason="needs onnxruntime (extra [verify])")

ALL = ("exact", "bounded", "approximate")
H = 64


def _layer_norm(opset: int, bias: bool) -> tuple[onnx.ModelProto, np.ndarray]:
    rng = np.random.default_rng(0)
    gamma = rng.standard_normal(H).astype(np.float32)
    inits = [from_array(gamma, "g")] + ([from_array(rng.standard_normal(H).astype(np.float32), "b")] if bias else [])
    node = helper.make_node("LayerNormalization", ["x", "g", "b"] if bias else ["x", "g"], ["y"], axis=-1, epsilon=1e-5)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16, H])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 16, H])
    graph = helper.make_graph([node], "ln", [x], [y], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8), gamma


def _decomposed(model: onnx.ModelProto, allow=("exact", "bounded")) -> onnx.ModelProto:
    return rewrite(model, rules=[named_form("elementwise-decompositions")], allow=allow, allow_unlowered=True).model


@rule_marker("layer-norm-decomposed", "positive")
@pytest.mark.parametrize(("opset", "bias"), [(17, True), (18, True), (18, False)])
def test_layer_norm_decomposition_is_within_its_bound_of_onnxruntimes_kernel(opset, bias):
    """Means 0-1000 against spreads 1e-3-100 (the cancellation the bound's |mean|/σ term is for):
    every output within 16·2^-24·(|y| + |γ|·(1 + |mean(x)|/σ(x)))."""
    model, gamma = _layer_norm(opset, bias)
    rewritten = _decomposed(model)
    assert "LayerNormalization" not in {n.op_type for n in rewritten.graph.node}
    worst = 0.0
    for offset in (0.0, 1.0, 10.0, 1000.0):
        for spread in (1e-3, 1.0, 100.0):
            rng = np.random.default_rng(int(offset) + int(spread * 1000))
            x = rng.standard_normal((20, 16, H)) * spread + offset * rng.standard_normal((20, 16, 1))
            x = x.astype(np.float32)
            want, got = run(model, {"x": x})["y"], run(rewritten, {"x": x})["y"]
            x64 = x.astype(np.float64)
            sigma = np.sqrt(x64.var(-1, keepdims=True) + 1e-5)
            bound = 16 * 2.0**-24 * (np.abs(want) + np.abs(gamma) * (1 + np.abs(x64.mean(-1, keepdims=True)) / sigma))
            worst = max(worst, float((np.abs(got.astype(np.float64) - want) / bound).max()))
    assert worst <= 1.0, worst


def _erf_model() -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])
    graph = helper.make_graph([helper.make_node("Erf", ["x"], ["y"], name="erf")], "erf", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_erf_is_approximate_and_runs_only_with_consent():
    model = _erf_model()
    assert "Erf" in {n.op_type for n in _decomposed(model).graph.node}
    assert "Erf" not in {n.op_type for n in _decomposed(model, ALL).graph.node}


@rule_marker("erf-polynomial", "positive")
def test_erf_polynomial_is_within_its_measured_error_of_onnxruntimes_erf():
    """A stride of the float32 bit patterns of [-8, 8] (the whole range was measured at 6.63e-7),
    beyond it, and the special values: ±0 and ±inf exact, NaN NaN."""
    model = _erf_model()
    rewritten = _decomposed(model, ALL)
    top = int(np.float32(8).view(np.uint32))
    positive = np.arange(0, top, 997, dtype=np.uint32).view(np.float32)
    x = np.concatenate([positive, -positive, np.float32([9, 30, 1e30, -3e38])])
    want, got = run(model, {"x": x})["y"], run(rewritten, {"x": x})["y"]
    assert float(np.abs(got - want).max()) <= 6.7e-7
    special = np.float32([0.0, -0.0, np.inf, -np.inf, np.nan])
    assert np.array_equal(run(rewritten, {"x": special})["y"], np.float32([0, 0, 1, -1, np.nan]), equal_nan=True)


@rule_marker("layer-norm-decomposed", "negative")
@rule_marker("erf-polynomial", "negative")
def test_what_the_decompositions_were_not_measured_on_stays():
    """A LayerNormalization whose Mean output is read, and a float16 Erf, stay as they are."""
    model, _ = _layer_norm(18, True)
    node = model.graph.node[0]
    node.output.append("mean")
    model.graph.output.append(helper.make_tensor_value_info("mean", TensorProto.FLOAT, ["n", 16, 1]))
    assert "LayerNormalization" in {n.op_type for n in _decomposed(model).graph.node}
    erf = _erf_model()
    for value in (*erf.graph.input, *erf.graph.output):
        value.type.tensor_type.elem_type = TensorProto.FLOAT16
    assert "Erf" in {n.op_type for n in _decomposed(erf, ALL).graph.node}
