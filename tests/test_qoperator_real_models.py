"""Real QOperator models, made here by the producer itself: onnxruntime.quantization.quantize_static
(QuantFormat.QOperator, seeded calibration) on a small CNN (Conv/Relu/MaxPool/Add/Concat/
GlobalAveragePool/Gemm) and a tiny attention block (MatMul/Softmax/Add), each rewritten to standard
ops only and checked with onnx_qrewrite.verify, which runs every bounded replacement alone on the
original's own inputs against its recorded bound. A broken rewrite is caught there, at its node.

Weights are quantized with ``reduce_range=True``: on x86 CPUs without VNNI onnxruntime saturates
uint8 x full-range int8 products (see builders/qoperator.py), which onnxruntime's documentation
answers with the same setting.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime.quantization as quantization
import pytest
from _target_helpers import assert_never_worse
from conftest import rule_marker
from onnx import TensorProto, helper, numpy_helper

import onnx_qrewrite
from onnx_qrewrite.verify import verify
from onnx_qrewrite.verify.bounds import bounded_rewrites


def _weight(rng, name, shape, scale=0.2):
    return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)


def small_cnn() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    node = helper.make_node
    nodes = [
        node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
        node("Relu", ["c1"], ["r1"], name="relu1"),
        node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2], name="pool1"),
        node("Conv", ["p1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], name="conv2"),
        node("Relu", ["c2"], ["r2"], name="relu2"),
        node("Conv", ["p1", "w3", "b3"], ["c3"], name="conv3"),
        node("Add", ["r2", "c3"], ["a1"], name="add1"),
        node("Concat", ["a1", "p1"], ["cat"], axis=1, name="concat1"),
        node("GlobalAveragePool", ["cat"], ["gap"], name="gap"),
        node("Flatten", ["gap"], ["flat"], name="flatten"),
        node("Gemm", ["flat", "wf", "bf"], ["y"], transB=1, name="fc"),
    ]
    inits = [
        _weight(rng, "w1", (8, 3, 3, 3)),
        _weight(rng, "b1", (8,), 0.1),
        _weight(rng, "w2", (8, 8, 3, 3), 0.1),
        _weight(rng, "b2", (8,), 0.1),
        _weight(rng, "w3", (8, 8, 1, 1)),
        _weight(rng, "b3", (8,), 0.1),
        _weight(rng, "wf", (10, 16)),
        _weight(rng, "bf", (10,), 0.1),
    ]
    graph = helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def attention_block(d: int = 16) -> onnx.ModelProto:
    rng = np.random.default_rng(1)
    node = helper.make_node
    nodes = [
        node("MatMul", ["x", "wq"], ["q"], name="q"),
        node("MatMul", ["x", "wk"], ["k"], name="k"),
        node("MatMul", ["x", "wv"], ["v"], name="v"),
        node("Transpose", ["k"], ["kt"], perm=[0, 2, 1], name="kt"),
        node("MatMul", ["q", "kt"], ["s"], name="scores"),
        node("Softmax", ["s"], ["p"], axis=-1, name="softmax"),
        node("MatMul", ["p", "v"], ["att"], name="att"),
        node("Add", ["att", "x"], ["res"], name="residual"),
        node("MatMul", ["res", "wo"], ["o"], name="out_proj"),
        node("Add", ["o", "bo"], ["y"], name="bias"),
    ]
    inits = [_weight(rng, n, (d, d), 0.3) for n in ("wq", "wk", "wv", "wo")] + [_weight(rng, "bo", (d,), 0.1)]
    graph = helper.make_graph(
        nodes,
        "block",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, d])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, d])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


class _Reader(quantization.CalibrationDataReader):
    def __init__(self, shape, n: int = 8, seed: int = 1):
        rng = np.random.default_rng(seed)
        self._data = iter([{"x": rng.standard_normal(shape).astype(np.float32)} for _ in range(n)])

    def get_next(self):
        return next(self._data, None)


MODELS = {"cnn": (small_cnn, (1, 3, 16, 16)), "attention": (attention_block, (1, 8, 16))}
WEIGHTS = {"s8-per-channel": ("QInt8", True), "u8-per-tensor": ("QUInt8", False)}


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    made = {}
    folder = tmp_path_factory.mktemp("qoperator")
    for name, (make, shape) in MODELS.items():
        for weights, (weight_type, per_channel) in WEIGHTS.items():
            src, dst = folder / f"{name}.onnx", folder / f"{name}_{weights}.onnx"
            onnx.save(make(), src)
            quantization.quantize_static(
                str(src),
                str(dst),
                _Reader(shape),
                quant_format=quantization.QuantFormat.QOperator,
                activation_type=quantization.QuantType.QUInt8,
                weight_type=getattr(quantization.QuantType, weight_type),
                per_channel=per_channel,
                reduce_range=True,
            )
            # The attention scores multiply two activations: the rewrite bounds that from the
            # reduction length, which shape inference records (onnxruntime's own pre-processing).
            made[name, weights] = onnx.shape_inference.infer_shapes(onnx.load(dst))
    return made


EXPECTED_RULES = {
    "cnn": {"qop-conv": 3, "qop-add": 1, "qop-concat": 1, "qop-global-average-pool": 1, "qop-gemm": 1},
    "attention": {"qop-matmul": 6, "qop-softmax": 1, "qop-add": 2},
}


@rule_marker("qop-conv", "positive")
@rule_marker("qop-matmul", "positive")
@rule_marker("qop-gemm", "positive")
@rule_marker("qop-softmax", "positive")
@pytest.mark.parametrize("weights", list(WEIGHTS))
@pytest.mark.parametrize("name", list(MODELS))
def test_quantize_static_qoperator_models_become_standard_onnx_and_verify(quantized, name, weights):
    model = quantized[name, weights]
    assert any(n.op_type.startswith("QLinear") for n in model.graph.node)
    result = onnx_qrewrite.rewrite(model)
    assert {n.domain for n in result.model.graph.node} == {""}
    assert not any(n.op_type.startswith(("QLinear", "QGemm")) for n in result.model.graph.node)
    assert result.report.by_rule() == EXPECTED_RULES[name]
    assert {o.domain for o in result.model.opset_import} == {""}  # com.microsoft import removed
    report = verify(model, result.model, samples=3)
    assert report.passed, report.to_table()
    bounded = [o for o in report.outputs if "bound" in o.name]
    # Every bounded replacement was checked at its own output (the Concat rewrite is exact).
    assert len(bounded) == sum(n for rule, n in EXPECTED_RULES[name].items() if rule != "qop-concat")
    # The same replacements are found whatever the provenance mode that records the bounds.
    full = onnx_qrewrite.rewrite(model, provenance="full").model
    in_full, in_compact = bounded_rewrites(model, full), bounded_rewrites(model, result.model)
    assert [(r.origin, r.bound, [n.op_type for n in r.nodes]) for r in in_full] == [
        (r.origin, r.bound, [n.op_type for n in r.nodes]) for r in in_compact
    ]
    assert len(in_compact) == len(bounded)


#: With the form qlinear-exact: the rules it adds take the integer-accumulating ops.
EXACT_FORM_RULES = {
    "cnn": {
        "qop-conv-exact": 3,
        "qop-add": 1,
        "qop-concat": 1,
        "qop-global-average-pool": 1,  # its input's shape is not recorded (behind QLinearConcat)
        "qop-gemm-exact": 1,
    },
    "attention": {"qop-matmul-exact": 6, "qop-softmax": 1, "qop-add": 2},
}


@rule_marker("qop-conv-exact", "positive")
@rule_marker("qop-matmul-exact", "positive")
@rule_marker("qop-gemm-exact", "positive")
@pytest.mark.parametrize("name", list(MODELS))
def test_the_form_qlinear_exact_takes_every_accumulating_node_of_these_models(quantized, name):
    """quantize_static's models (reduce_range: 7-bit weights, no pair of products leaves int16):
    with the form, every QLinearConv, QLinearMatMul (the attention's two of activations included)
    and QGemm is rewritten exactly, and verify passes (the bounded rules' nodes within their bounds).
    The CNN's QLinearGlobalAveragePool stays bounded: onnx's shape inference stops at the
    com.microsoft QLinearConcat before it, so its image size is not recorded."""
    from onnx_qrewrite.rewriter.catalogue import named_form

    model = quantized[name, "s8-per-channel"]
    result = onnx_qrewrite.rewrite(model, rules=[named_form("qlinear-exact")])
    assert result.report.by_rule() == EXACT_FORM_RULES[name]
    report = verify(model, result.model, samples=3)
    assert report.passed, report.to_table()


@pytest.mark.parametrize("name", list(MODELS))
def test_a_broken_rewrite_is_caught_at_the_node_that_breaks_its_bound(quantized, name):
    """A zero point dropped from one replacement's QuantizeLinear: verify names that node."""
    model = quantized[name, "s8-per-channel"]
    result = onnx_qrewrite.rewrite(model)
    broken = onnx.ModelProto()
    broken.CopyFrom(result.model)
    replaced = bounded_rewrites(model, broken)[0]
    victim = replaced.nodes[-1]
    assert victim.op_type == "QuantizeLinear"
    zp = next(t for t in broken.graph.initializer if t.name == victim.input[2])
    if not numpy_helper.to_array(zp).any():  # a zero point of 0: move it instead
        zp.CopyFrom(numpy_helper.from_array(np.asarray(17, numpy_helper.to_array(zp).dtype), zp.name))
    else:
        zp.CopyFrom(numpy_helper.from_array(np.zeros_like(numpy_helper.to_array(zp)), zp.name))
    origin = replaced.origin
    report = verify(model, broken, samples=2)
    assert not report.passed
    failing = [o.name for o in report.outputs if not o.passed and "bound" in o.name]
    # Shared zero-point constants may serve several replacements: each one using it is named.
    assert failing and all("node " in f for f in failing)
    assert any(f"node {origin}," in f for f in failing), failing


@pytest.mark.parametrize("weights", list(WEIGHTS))
@pytest.mark.parametrize("name", list(MODELS))
def test_rewrite_for_any_target_never_makes_these_models_worse(quantized, name, weights):
    """Issue 11's invariant on quantize_static's QOperator models."""
    counts = assert_never_worse(quantized[name, weights])
    assert counts["onnx"][1] == 0  # every QOperator op has a rewrite to standard ONNX


@pytest.mark.parametrize("name", list(MODELS))
def test_webgpu_reaches_qoperator_models_through_qdq_units_and_the_float_emulation(quantized, name):
    """The WebGPU EP has no QLinear, QuantizeLinear or 8-bit kernel: each QOperator op is lowered
    (bounded), the MaxPool/Reshape/Transpose on raw uint8 wrapped in Q/DQ (qdq-units, exact), and
    the Q -> DQ pairs that leaves computed in float by the float emulation, which a later plan
    stage reaches through the DequantizeLinear that reads each QuantizeLinear. Nothing is refused
    after, and verify passes every bound on the original's inputs."""
    from onnx_qrewrite.targets import check_model, load_target

    model = quantized[name, "s8-per-channel"]
    result = onnx_qrewrite.rewrite(model, target="webgpu")
    assert result.report.target["refused_before"] > 0
    assert result.report.target["refused_after"] == 0
    assert not check_model(result.model, load_target("webgpu"))
    rules = result.report.by_rule()
    assert rules["qdq-wrap-move"] >= 1 and rules["float-emulation-qdq-pair"] >= 1
    assert not {"QuantizeLinear", "Round", "IsNaN"} & {n.op_type for n in result.model.graph.node}
    report = verify(model, result.model, samples=2)
    assert report.passed, report.to_table()
