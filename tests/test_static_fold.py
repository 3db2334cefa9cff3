"""Form ``static-shapes`` (onnx_qrewrite/rewriter/builders/static_fold.py): Shape of a static value
and a QuantizeLinear of a value fixed by constants and static shapes, folded to constants. Exact:
the folded model gives onnxruntime's outputs bit for bit, and the quantization is onnxruntime's
kernel's on edge values."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import assert_bitwise_equal, rule_marker, run
from onnx import TensorProto, helper
from onnx.numpy_helper import from_array

from onnx_qrewrite import rewrite
from onnx_qrewrite.rewriter.builders.static_fold import MAX_ELEMENTS, quantize_like_onnxruntime
from onnx_qrewrite.rewriter.catalogue import named_form
from onnx_qrewrite.targets.shapes import InputShapes, apply_input_shapes

pytest.importorskip("onnxruntime", reason="needs onnxruntime (extra [verify])")

_EDGES = np.array(
    [0.0, -0.0, 0.5, 1.5, 2.5, -0.5, -1.5, 127.5, 128.5, -128.5, 1e-45, 3.4e38, -3.4e38, np.inf, -np.inf, np.nan],
    np.float32,
)


def _quantize_model(dtype: int, scale: np.ndarray, zp: np.ndarray, axis: int | None) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, None)
    y = helper.make_tensor_value_info("y", dtype, None)
    kw = {"axis": axis} if axis is not None else {}
    node = helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"], **kw)
    graph = helper.make_graph([node], "q", [x], [y], [from_array(scale, "s"), from_array(zp, "z")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


@pytest.mark.parametrize("np_type", [np.uint8, np.int8, np.uint16, np.int16])
def test_quantization_is_onnxruntimes_kernel_bit_for_bit(np_type):
    """Halves (to even), saturation, infinities, NaN (qmin), tiny and huge values, random ones over
    scales from 1e-30 to 1e30; per-tensor and per-axis."""
    rng = np.random.default_rng(1)
    x = np.concatenate([_EDGES, (rng.standard_normal(4000) * 300).astype(np.float32)])
    dtype = helper.np_dtype_to_tensor_dtype(np.dtype(np_type))
    info = np.iinfo(np_type)
    for scale in (1e-30, 0.0123, 1.0, 3.0, 1e30):
        zp = np.array((int(info.min) + int(info.max)) // 3, np_type)
        s = np.array(scale, np.float32)
        want = run(_quantize_model(dtype, s, zp, None), {"x": x})["y"]
        assert_bitwise_equal(quantize_like_onnxruntime(x, s, zp, np_type), want, f"{np_type.__name__} {scale}")
    xs = x[: 4 * 1000].reshape(4, 1000).T.copy()  # (1000, 4), axis 1
    s = np.array([0.01, 0.5, 2.0, 1e-3], np.float32)
    zp = np.array([0, 1, 2, 3], np_type)
    want = run(_quantize_model(dtype, s, zp, 1), {"x": xs})["y"]
    assert_bitwise_equal(quantize_like_onnxruntime(xs, s.reshape(1, 4), zp.reshape(1, 4), np_type), want, "per-axis")


def _position_model() -> onnx.ModelProto:
    """The static QDQ BERT's embeddings in small: word lookup + a position table sliced up to
    Shape(ids)[1], each quantized, added, quantized again."""
    n = helper.make_node
    rng = np.random.default_rng(2)
    consts = [
        from_array(rng.standard_normal((10, 8)).astype(np.float32), "word"),
        from_array(rng.standard_normal((32, 8)).astype(np.float32), "position"),
        from_array(np.float32(0.02), "s"),
        from_array(np.uint8(128), "z"),
        from_array(np.float32(0.03), "s2"),
        from_array(np.uint8(120), "z2"),
        from_array(np.array([0], np.int64), "zero"),
        from_array(np.array([1], np.int64), "one"),
    ]
    nodes = [
        n("Gather", ["word", "ids"], ["w"], name="lookup"),
        n("QuantizeLinear", ["w", "s", "z"], ["wq"]),
        n("DequantizeLinear", ["wq", "s", "z"], ["wd"]),
        n("Shape", ["ids"], ["shape"], name="shape"),
        n("Gather", ["shape", "one"], ["length"], name="seq_len"),
        n("Slice", ["position", "zero", "length", "zero"], ["p"], name="slice"),
        n("QuantizeLinear", ["p", "s2", "z2"], ["pq"], name="pq"),
        n("DequantizeLinear", ["pq", "s2", "z2"], ["pd"]),
        n("Add", ["wd", "pd"], ["sum"], name="sum"),
        n("QuantizeLinear", ["sum", "s", "z"], ["yq"]),
        n("DequantizeLinear", ["yq", "s", "z"], ["y"]),
    ]
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 8])
    graph = helper.make_graph(nodes, "embeddings", [ids], [y], consts)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@rule_marker("fold-static-shape", "positive")
@rule_marker("fold-static-quantize", "positive")
def test_shape_and_the_quantized_slice_fold_to_constants_bit_for_bit():
    """With the dims fixed, Shape and the position slice's QuantizeLinear become constants; the
    output is the original's bit for bit, for the fixed shape."""
    model = _position_model()
    fixed = _position_model()
    apply_input_shapes(fixed, InputShapes({}, {"batch": 2, "seq": 5}))
    only = ["fold-static-shape", "fold-static-quantize"]
    result = rewrite(fixed, rules=[named_form("static-shapes")], only=only)
    assert result.report.by_rule() == {"fold-static-shape": 1, "fold-static-quantize": 1}
    ops = [node.op_type for node in result.model.graph.node]
    assert "Shape" not in ops and ops.count("QuantizeLinear") == 2
    ids = {"ids": np.random.default_rng(3).integers(0, 10, (2, 5)).astype(np.int64)}
    assert_bitwise_equal(run(result.model, ids)["y"], run(model, ids)["y"], "y")


@rule_marker("fold-static-shape", "negative")
@rule_marker("fold-static-quantize", "negative")
def test_without_static_shapes_nothing_folds():
    """The sequence length is symbolic: neither Shape nor the slice's QuantizeLinear is a constant."""
    result = rewrite(
        _position_model(),
        rules=[named_form("static-shapes")],
        only=["fold-static-shape", "fold-static-quantize"],
        allow_unlowered=True,
    )
    assert result.report.by_rule() == {}


@rule_marker("fold-static-quantize", "negative")
def test_a_fold_larger_than_the_limit_is_decided_before_it_is_computed():
    """A Gather of a constant by many indices would allocate a huge tensor: the fold gives way
    from the sizes alone."""
    n = helper.make_node
    count = MAX_ELEMENTS // 4 + 1
    consts = [
        from_array(np.zeros((2, 8), np.float32), "table"),
        from_array(np.float32(0.1), "s"),
        from_array(np.uint8(0), "z"),
    ]
    indices = helper.make_tensor("idx", TensorProto.INT64, [count], np.zeros(count, np.int64).tobytes(), raw=True)
    nodes = [n("Gather", ["table", "idx"], ["big"]), n("QuantizeLinear", ["big", "s", "z"], ["y"], name="q")]
    y = helper.make_tensor_value_info("y", TensorProto.UINT8, [count, 8])
    graph = helper.make_graph(nodes, "big", [], [y], [*consts, indices])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    result = rewrite(model, rules=[named_form("static-shapes")], only=["fold-static-quantize"], allow_unlowered=True)
    assert result.report.by_rule() == {}


@rule_marker("fold-static-quantize", "negative")
def test_a_four_bit_zero_point_is_not_folded():
    """An int4 QuantizeLinear saturates to [-8, 7], which the fold does not compute: it gives way."""
    n = helper.make_node
    consts = [
        from_array(np.linspace(-3, 3, 8, dtype=np.float32), "table"),
        from_array(np.float32(0.1), "s"),
        helper.make_tensor("z", TensorProto.INT4, [], [0]),
    ]
    y = helper.make_tensor_value_info("y", TensorProto.INT4, [8])
    graph = helper.make_graph([n("QuantizeLinear", ["table", "s", "z"], ["y"], name="q")], "int4", [], [y], consts)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    result = rewrite(model, rules=[named_form("static-shapes")], only=["fold-static-quantize"], allow_unlowered=True)
    assert result.report.by_rule() == {}
