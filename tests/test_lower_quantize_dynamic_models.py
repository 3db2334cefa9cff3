"""Real models from the real producer: small float networks built with onnx.helper, quantized in the
fixture by onnxruntime.quantization.quantize_dynamic itself (and fused by onnxruntime's own
optimizer), rewritten to standard ops only and verified with onnx_qrewrite.verify."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from _target_helpers import assert_never_worse
from conftest import rule_marker
from onnx import TensorProto as T
from onnx import helper, numpy_helper
from onnxruntime.quantization import QuantType, quantize_dynamic

import onnx_qrewrite

#: Ops that must be gone after the rewrite: everything quantize_dynamic and the optimizer produce.
_QUANTIZED = {"DynamicQuantizeLinear", "MatMulInteger", "ConvInteger", "MatMulIntegerToFloat", "DynamicQuantizeMatMul"}


def _save(model: onnx.ModelProto, path: Path) -> Path:
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def _mlp(path: Path) -> Path:
    """A transformer-ish MatMul stack: projections to attention-like scores, a batched MatMul of two
    activations (which quantize_dynamic leaves float), a residual and a two-layer ReLU MLP."""
    rng = np.random.default_rng(0)
    d, h = 32, 64

    def w(*shape):
        return numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32))

    inits = []
    for name, shape in (("wq", (d, d)), ("wk", (d, 8)), ("w1", (d, h)), ("w2", (h, d))):
        t = w(*shape)
        t.name = name
        inits.append(t)
    inits.append(numpy_helper.from_array(rng.standard_normal(h).astype(np.float32) * 0.1, "b1"))
    nodes = [
        helper.make_node("MatMul", ["x", "wq"], ["q"]),
        helper.make_node("MatMul", ["q", "wk"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "x"], ["ctx"]),
        helper.make_node("Add", ["ctx", "x"], ["res"]),
        helper.make_node("MatMul", ["res", "w1"], ["h1"]),
        helper.make_node("Add", ["h1", "b1"], ["h1b"]),
        helper.make_node("Relu", ["h1b"], ["h1r"]),
        helper.make_node("MatMul", ["h1r", "w2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", T.FLOAT, [2, 8, d])],
        [helper.make_tensor_value_info("y", T.FLOAT, [2, 8, d])],
        inits,
    )
    return _save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)


def _cnn(path: Path) -> Path:
    rng = np.random.default_rng(1)
    inits = [
        numpy_helper.from_array((rng.standard_normal((8, 3, 3, 3)) * 0.3).astype(np.float32), "c1"),
        numpy_helper.from_array((rng.standard_normal(8) * 0.1).astype(np.float32), "c1b"),
        numpy_helper.from_array((rng.standard_normal((16, 8, 3, 3)) * 0.2).astype(np.float32), "c2"),
        numpy_helper.from_array((rng.standard_normal((16, 10)) * 0.3).astype(np.float32), "fc"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "c1", "c1b"], ["a1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["a1"], ["r1"]),
        helper.make_node("Conv", ["r1", "c2"], ["a2"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Relu", ["a2"], ["r2"]),
        helper.make_node("GlobalAveragePool", ["r2"], ["p"]),
        helper.make_node("Flatten", ["p"], ["f"]),
        helper.make_node("MatMul", ["f", "fc"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("x", T.FLOAT, [1, 3, 16, 16])],
        [helper.make_tensor_value_info("y", T.FLOAT, [1, 10])],
        inits,
    )
    return _save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)


# name -> (network, quantize_dynamic keyword arguments). Weights are uint8, or int8 with
# reduce_range (7-bit): onnxruntime's uint8 x full-range-int8 kernel saturates on x86 without VNNI
# (rules/50-integer-matmul.toml), where the original itself is CPU-dependent.
_VARIANTS = {
    "mlp-u8": (_mlp, {"weight_type": QuantType.QUInt8}),
    "mlp-s8-per-channel": (_mlp, {"weight_type": QuantType.QInt8, "per_channel": True, "reduce_range": True}),
    "cnn-u8": (_cnn, {"weight_type": QuantType.QUInt8}),
    "cnn-u8-per-channel": (_cnn, {"weight_type": QuantType.QUInt8, "per_channel": True}),
}


@pytest.fixture(scope="module", params=sorted(_VARIANTS))
def quantized(request, tmp_path_factory) -> tuple[str, Path]:
    build, options = _VARIANTS[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    float_model = build(folder / "float.onnx")
    out = folder / "dynamic.onnx"
    quantize_dynamic(str(float_model), str(out), **options)
    return request.param, out


def _optimized(model: Path, out: Path) -> Path:
    """onnxruntime's own optimizer, as a deployment pipeline runs it: fuses DynamicQuantizeLinear +
    MatMulInteger into com.microsoft DynamicQuantizeMatMul / MatMulIntegerToFloat. (The network has
    no Transpose before a MatMul, which it would fuse into com.microsoft FusedMatMul: un-fusing that
    is other work of issue 10.)"""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(out)
    ort.InferenceSession(
        str(model), so, providers=["CPUExecutionProvider"], disabled_optimizers=["MatMulTransposeFusion"]
    )
    return out


def _check(original: Path, tmp_path: Path) -> onnx_qrewrite.RewriteResult:
    result = onnx_qrewrite.rewrite(original)
    ops = {(n.domain, n.op_type) for n in result.model.graph.node}
    assert all(domain in ("", "ai.onnx") for domain, _ in ops), ops
    assert not {op for _, op in ops} & _QUANTIZED, ops
    rewritten = tmp_path / "rewritten.onnx"
    result.save(rewritten)
    report = onnx_qrewrite.verify(original, rewritten, samples=3)
    assert report.passed, report.summary
    return result


@rule_marker("dql-expand", "positive")
@rule_marker("int-matmul-float", "positive")
def test_quantize_dynamic_models_become_standard_onnx_and_verify(quantized, tmp_path):
    name, model = quantized
    original_ops = {n.op_type for n in onnx.load(model).graph.node}
    assert "DynamicQuantizeLinear" in original_ops
    assert ("ConvInteger" if name.startswith("cnn") else "MatMulInteger") in original_ops
    result = _check(model, tmp_path)
    rules = result.report.by_rule()
    assert rules["dql-expand"] >= 1 and rules["int-matmul-float"] >= 1


def test_onnxruntime_fused_models_become_standard_onnx_and_verify(quantized, tmp_path):
    name, model = quantized
    fused = _optimized(model, tmp_path / "fused.onnx")
    fused_ops = {n.op_type for n in onnx.load(fused).graph.node}
    if name.startswith("mlp"):
        assert fused_ops & {"DynamicQuantizeMatMul", "MatMulIntegerToFloat"}, fused_ops
    result = _check(fused, tmp_path)
    if name.startswith("mlp"):
        assert result.report.by_rule().get("ms-int-matmul-float", 0) >= 1


def test_rewrite_for_any_target_never_makes_these_models_worse(quantized, tmp_path):
    """Issue 11's invariant on the producer's models, as quantized and as onnxruntime fuses them."""
    _, model = quantized
    counts = assert_never_worse(model)
    assert counts["tract"] == (0, 0) and counts["onnx"] == (0, 0)  # both run quantize_dynamic's ops
    fused = assert_never_worse(_optimized(model, tmp_path / "fused.onnx"))
    assert fused["onnx"][1] == 0  # the contrib fusions are lowered for plain ONNX
