"""The "qdq-to-float" form: constant DequantizeLinear folded (exact, bit for bit with onnxruntime),
activation Q -> DQ pairs removed (approximate, only when asked)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import assert_bitwise_equal, op_types, rule_marker, run
from onnx import TensorProto, helper, numpy_helper

import onnx_qrewrite
from onnx_qrewrite.rewriter.catalogue import load_catalogue, named_form

FORM = load_catalogue([named_form("qdq-to-float")])
APPROXIMATE = ("exact", "bounded", "approximate")


def _qdq_conv(per_axis: bool, dtype=np.int8, blocked: bool = False) -> onnx.ModelProto:
    rng = np.random.default_rng(2)
    info = np.iinfo(dtype)
    w = rng.integers(info.min, info.max + 1, (4, 3, 3, 3)).astype(dtype)
    if blocked:
        ws = rng.uniform(0.001, 0.02, (4, 1, 3, 3)).astype(np.float32)  # blocks of 3 along axis 1
        wz = rng.integers(info.min // 2, info.max // 2, (4, 1, 3, 3)).astype(dtype)
        w_attrs = {"axis": 1, "block_size": 3}
    elif per_axis:
        ws = rng.uniform(0.001, 0.02, 4).astype(np.float32)
        wz = rng.integers(info.min // 2, info.max // 2, 4).astype(dtype)
        w_attrs = {"axis": 0}
    else:
        ws, wz, w_attrs = np.float32(0.0123), dtype(info.max // 3), {}
    inits = [numpy_helper.from_array(a, n) for n, a in (("w", w), ("ws", np.asarray(ws)), ("wz", np.asarray(wz)))]
    inits += [numpy_helper.from_array(np.float32(0.05), "xs"), numpy_helper.from_array(np.uint8(128), "xz")]
    inits += [numpy_helper.from_array(np.float32(0.2), "ys"), numpy_helper.from_array(np.uint8(100), "yz")]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"], name="qx"),
        helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xf"], name="dqx"),
        helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wf"], name="dqw", **w_attrs),
        helper.make_node("Conv", ["xf", "wf"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("QuantizeLinear", ["c", "ys", "yz"], ["cq"], name="qc"),
        helper.make_node("DequantizeLinear", ["cq", "ys", "yz"], ["y"], name="dqc"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 6, 6])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def _float_reference(model: onnx.ModelProto, folded: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """The float model: Conv of x with the folded weights, each activation clamped to its Q -> DQ
    pair's range (x: 0.05 * [0 - 128, 255 - 128]; the output: 0.2 * [0 - 100, 255 - 100])."""
    weights = next(t for t in folded.graph.initializer if t.dims == [4, 3, 3, 3])
    graph = helper.make_graph(
        [
            helper.make_node("Clip", ["x", "xlo", "xhi"], ["xc"]),
            helper.make_node("Conv", ["xc", "W"], ["c"], pads=[1, 1, 1, 1]),
            helper.make_node("Clip", ["c", "ylo", "yhi"], ["y"]),
        ],
        "f",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 6, 6])],
        [numpy_helper.from_array(numpy_helper.to_array(weights), "W")]
        + [
            numpy_helper.from_array(np.float32(q) * np.float32(s), n)
            for n, q, s in (("xlo", -128, 0.05), ("xhi", 127, 0.05), ("ylo", -100, 0.2), ("yhi", 155, 0.2))
        ],
    )
    return run(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10), {"x": x})["y"]


@rule_marker("qdq-to-float-fold-weights", "positive")
@pytest.mark.parametrize(
    "per_axis, dtype, blocked",
    [
        (False, np.int8, False),
        (True, np.int8, False),
        (True, np.uint8, False),
        (True, np.int16, False),
        (False, np.int8, True),
    ],
)
def test_folding_constant_weights_is_bit_exact_with_dequantize_linear(per_axis, dtype, blocked):
    model = _qdq_conv(per_axis, dtype, blocked)
    result = onnx_qrewrite.rewrite(model, rules=FORM)
    assert result.report.by_rule() == {"qdq-to-float-fold-weights": 1}  # activations stay quantized
    folded = next(n for n in result.model.graph.node if n.output[0] == "wf")
    assert folded.op_type == "Identity"
    # The folded value against onnxruntime's own DequantizeLinear of the weights.
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.append(helper.make_tensor_value_info("wf", TensorProto.FLOAT, None))
    x = np.random.default_rng(0).standard_normal((1, 3, 6, 6)).astype(np.float32)
    value = numpy_helper.to_array(next(t for t in result.model.graph.initializer if t.name == folded.input[0]))
    assert_bitwise_equal(value, run(probe, {"x": x})["wf"], "folded weights")
    assert_bitwise_equal(run(result.model, {"x": x})["y"], run(model, {"x": x})["y"], "model output")


@rule_marker("qdq-to-float-fold-weights", "positive")
def test_folding_with_a_block_larger_than_the_weights_allocates_nothing_by_it():
    """block_size is the model's: a block of 2^40 covers the whole axis (onnxruntime runs it). The
    fold picks each weight's scale by index; it repeated the scales block_size times (exit 5 here,
    and a smaller huge block filled the memory first)."""
    model = _qdq_conv(False, np.int8, blocked=True)
    dqw = next(n for n in model.graph.node if n.name == "dqw")
    next(a for a in dqw.attribute if a.name == "block_size").i = 2**40
    result = onnx_qrewrite.rewrite(model, rules=FORM)
    assert result.report.by_rule() == {"qdq-to-float-fold-weights": 1}
    x = np.random.default_rng(0).standard_normal((1, 3, 6, 6)).astype(np.float32)
    assert_bitwise_equal(run(result.model, {"x": x})["y"], run(model, {"x": x})["y"], "block 2^40")


@rule_marker("qdq-to-float-drop-dq", "positive")
@rule_marker("qdq-to-float-drop-q", "positive")
def test_with_approximate_allowed_the_model_becomes_its_float_reference():
    model = _qdq_conv(True)
    result = onnx_qrewrite.rewrite(model, rules=FORM, allow=APPROXIMATE)
    assert result.report.by_rule() == {
        "qdq-to-float-fold-weights": 1,
        "qdq-to-float-drop-dq": 2,
        "qdq-to-float-drop-q": 2,
    }
    assert sorted(op_types(result.model)) == ["Clip", "Clip", "Conv", "Identity"]
    x = np.random.default_rng(1).standard_normal((1, 3, 6, 6)).astype(np.float32) * 4  # some beyond +-6.4
    assert_bitwise_equal(run(result.model, {"x": x})["y"], _float_reference(model, result.model, x), "float model")
    # And it is not the quantized model any more: that is what "approximate" means.
    assert not np.array_equal(run(result.model, {"x": x})["y"], run(model, {"x": x})["y"])


@rule_marker("qdq-to-float-fold-weights", "negative")
@rule_marker("qdq-to-float-drop-dq", "negative")
@rule_marker("qdq-to-float-drop-q", "negative")
def test_nothing_happens_unless_asked_and_shared_or_output_values_stay():
    model = _qdq_conv(False)
    assert onnx_qrewrite.rewrite(model).report.by_rule() == {}  # not in the default catalogue
    # A quantized value that is also a graph output keeps its QuantizeLinear.
    model.graph.output.append(helper.make_tensor_value_info("cq", TensorProto.UINT8, [1, 4, 6, 6]))
    result = onnx_qrewrite.rewrite(model, rules=FORM, allow=APPROXIMATE)
    assert op_types(result.model).count("QuantizeLinear") == 1  # qc stays, qx goes
    assert not result.report.unlowered  # a standard op the form leaves is fine as it is


@rule_marker("qdq-to-float-fold-weights", "positive")
def test_an_int32_bias_with_zero_point_0_folds_bit_exact_over_the_whole_int32_range():
    """quantize_static's bias DequantizeLinear (int32, zero point 0): onnxruntime converts x to
    float32 rounding to nearest, as the fold does; a non-zero zero point (x - zp wraps in int32 in
    the kernel) is not folded."""
    rng = np.random.default_rng(5)
    x = rng.integers(-(2**31), 2**31 - 1, 256, dtype=np.int64).astype(np.int32)
    x[:8] = [2**31 - 1, -(2**31), 2**24 + 1, -(2**24 + 1), 16777217, 0, 1, -1]
    for scale, zp, axis in ((np.float32(3.7e-5), None, {}), (rng.uniform(1e-6, 1e-2, 256).astype(np.float32), 0, {})):
        inputs = ["b", "s", "z"] if zp is not None else ["b", "s"]
        inits = [numpy_helper.from_array(x, "b"), numpy_helper.from_array(np.asarray(scale), "s")]
        if zp is not None:
            inits.append(numpy_helper.from_array(np.zeros(256, np.int32), "z"))
        graph = helper.make_graph(
            [helper.make_node("DequantizeLinear", inputs, ["y"], name="dq", axis=0, **axis)],
            "g",
            [],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [256])],
            inits,
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
        result = onnx_qrewrite.rewrite(model, rules=FORM)
        assert result.report.by_rule() == {"qdq-to-float-fold-weights": 1}
        assert_bitwise_equal(run(result.model, {})["y"], run(model, {})["y"], "folded int32 bias")
    model.graph.initializer[-1].CopyFrom(numpy_helper.from_array(np.full(256, 3, np.int32), "z"))
    assert onnx_qrewrite.rewrite(model, rules=FORM).report.by_rule() == {}


def _pair(scale, zero_point, dtype=np.uint8, opset: int = 13, axis: int | None = None, runtime_scale: bool = False):
    """x -> QuantizeLinear -> DequantizeLinear -> y, x of shape [2, 3, 4]."""
    inits = [numpy_helper.from_array(np.asarray(zero_point, dtype), "z")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])]
    if runtime_scale:
        inputs.append(helper.make_tensor_value_info("s", TensorProto.FLOAT, []))
    else:
        inits.append(numpy_helper.from_array(np.asarray(scale, np.float32), "s"))
    attrs = {} if axis is None else {"axis": axis}
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], **attrs),
        helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], **attrs),
    ]
    graph = helper.make_graph(
        nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 4])], inits
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


_EDGES = np.array([-1e30, -7.0, -0.3, -0.0, 0.0, 0.1, 0.26, 2.5, 6.0, 1e30, -np.inf, np.inf], np.float32)


def _x(rng) -> np.ndarray:
    return np.concatenate([_EDGES, (rng.standard_normal(12) * 5).astype(np.float32)]).reshape(2, 3, 4)


@rule_marker("qdq-to-float-drop-dq", "positive")
@pytest.mark.parametrize("opset", [10, 13])
@pytest.mark.parametrize(
    "scale, zero_point, dtype",
    [(0.0237, 0, np.uint8), (0.05, 128, np.uint8), (0.011, -128, np.int8), (0.3, 7, np.int8), (1e-3, 0, np.uint16)],
)
def test_a_removed_pair_keeps_its_saturation_as_a_clip(opset, scale, zero_point, dtype):
    """Zero point qmin is what a quantizer writes for a Relu it folded into the QuantizeLinear: the
    pair's lower bound is then 0, the Relu. The bounds are the pair's own extreme outputs."""
    if dtype == np.uint16:
        opset = 21
    model = _pair(scale, zero_point, dtype, opset)
    result = onnx_qrewrite.rewrite(model, rules=FORM, allow=APPROXIMATE)
    assert result.report.by_rule() == {"qdq-to-float-drop-dq": 1, "qdq-to-float-drop-q": 1}
    assert op_types(result.model) == ["Clip"]
    clip = result.model.graph.node[0]
    assert (len(clip.input) == 1) == (opset < 11)  # min/max attributes below opset 11
    x = _x(np.random.default_rng(3))
    got, quantized = run(result.model, {"x": x})["y"], run(model, {"x": x})["y"]
    # The extremes are the pair's own wherever the pair saturates (the Clip keeps -0.0 at a bound
    # of 0, where the pair gives +0.0: equal values).
    info = np.iinfo(dtype)
    lo, hi = (np.float32(q - zero_point) * np.float32(scale) for q in (info.min, info.max))
    assert_bitwise_equal(got, np.clip(x, lo, hi), "Clip(x, lo, hi)")
    saturated = (x <= lo) | (x >= hi)
    np.testing.assert_array_equal(got[saturated], quantized[saturated])
    # Inside the range only the rounding is dropped: at most half a step.
    inside = ~saturated
    assert np.abs(got[inside] - quantized[inside]).max() <= np.float32(scale) / 2 * (1 + 1e-6)
    notes = next(r.notes for r in result.report.rewrites if r.rule == "qdq-to-float-drop-dq")
    assert notes == (f"clamped to [{lo:.9g}, {hi:.9g}], the pair's range",)


@rule_marker("qdq-to-float-drop-dq", "positive")
def test_a_per_axis_pair_is_clamped_per_channel():
    scale = np.array([0.01, 0.2, 0.05], np.float32)
    zero_point = np.array([0, 100, 255], np.uint8)
    model = _pair(scale, zero_point, axis=1)
    result = onnx_qrewrite.rewrite(model, rules=FORM, allow=APPROXIMATE)
    assert op_types(result.model) == ["Min", "Max"]
    x = _x(np.random.default_rng(4)) * 10
    lo = ((0 - zero_point.astype(np.float32)) * scale).reshape(3, 1)
    hi = ((255 - zero_point.astype(np.float32)) * scale).reshape(3, 1)
    assert_bitwise_equal(run(result.model, {"x": x})["y"], np.minimum(np.maximum(x, lo), hi), "per channel")


@rule_marker("qdq-to-float-drop-dq", "negative")
def test_a_pair_whose_range_is_computed_at_run_time_becomes_identity_and_says_so():
    result = onnx_qrewrite.rewrite(_pair(0.1, 0, runtime_scale=True), rules=FORM, allow=APPROXIMATE)
    assert op_types(result.model) == ["Identity"]
    notes = next(r.notes for r in result.report.rewrites if r.rule == "qdq-to-float-drop-dq")
    assert notes == ("clamp not kept: the scale is not a float32 constant",)


def _relu_cnn() -> onnx.ModelProto:
    from test_qoperator_real_models import small_cnn

    return small_cnn()


def quantize_static_relu_cnn(tmp_path) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """The small ReLU CNN and onnxruntime's quantize_static of it (QDQ, uint8 activations,
    per-channel int8 weights), as (float model, quantized model)."""
    import onnxruntime.quantization as quantization
    from test_qoperator_real_models import _Reader

    src, dst = tmp_path / "cnn.onnx", tmp_path / "cnn_qdq.onnx"
    onnx.save(_relu_cnn(), src)
    quantization.quantize_static(
        str(src),
        str(dst),
        _Reader((1, 3, 16, 16)),
        quant_format=quantization.QuantFormat.QDQ,
        activation_type=quantization.QuantType.QUInt8,
        weight_type=quantization.QuantType.QInt8,
        per_channel=True,
    )
    return onnx.load(src), onnx.load(dst)


@rule_marker("qdq-to-float-drop-dq", "positive")
def test_quantize_static_folds_the_relu_into_the_quantizer_and_the_form_keeps_it(tmp_path):
    """onnxruntime's quantize_static (QDQ) removes each Relu after a Conv and quantizes the Conv's
    output with zero point 0 (uint8 qmin): the Q -> DQ pair is the Relu. Replaced by Identity, the
    negative values pass (measured: 0.61 max abs from the quantized model on these inputs); by the
    Clip the form now writes, the result stays within 0.006 of it (the rounding dropped)."""
    float_model, quantized = quantize_static_relu_cnn(tmp_path)
    assert "Relu" in op_types(float_model) and "Relu" not in op_types(quantized)  # folded
    result = onnx_qrewrite.rewrite(quantized, rules=FORM, allow=APPROXIMATE)
    assert not {"QuantizeLinear", "Relu"} & set(op_types(result.model))
    clamps = {r.node: r.notes[0] for r in result.report.rewrites if r.rule == "qdq-to-float-drop-dq"}
    # The two Relu outputs (and the max-pool of one) are clamped below at 0.
    assert sum(note.startswith("clamped to [0, ") for note in clamps.values()) == 3, clamps
    # "Before": the same model with each Clip replaced by the Identity the form used to write.
    identity = onnx.ModelProto()
    identity.CopyFrom(result.model)
    for node in identity.graph.node:
        if node.op_type == "Clip":
            node.op_type = "Identity"
            del node.input[1:]
    rng = np.random.default_rng(7)
    worst = {"clip": 0.0, "identity": 0.0}
    for _ in range(4):
        x = rng.standard_normal((1, 3, 16, 16)).astype(np.float32)
        expected = run(quantized, {"x": x})["y"]
        worst["clip"] = max(worst["clip"], float(np.abs(run(result.model, {"x": x})["y"] - expected).max()))
        worst["identity"] = max(worst["identity"], float(np.abs(run(identity, {"x": x})["y"] - expected).max()))
    assert worst["clip"] < 0.02, worst
    assert worst["identity"] > 0.3, worst


@rule_marker("qdq-to-float-drop-dq", "positive")
def test_a_pair_without_zero_points_or_types_is_clamped_to_the_uint8_default():
    """No zero point and no value_info: QuantizeLinear's default output type, uint8, gives the range."""
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s"], ["q"]),
        helper.make_node("DequantizeLinear", ["q", "s"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        [numpy_helper.from_array(np.float32(0.1), "s")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    result = onnx_qrewrite.rewrite(model, rules=FORM, allow=APPROXIMATE)
    assert op_types(result.model) == ["Clip"]
    x = np.array([-3.0, 0.04, 7.0, 99.0], np.float32)
    np.testing.assert_array_equal(run(result.model, {"x": x})["y"], np.clip(x, 0, np.float32(255) * np.float32(0.1)))
