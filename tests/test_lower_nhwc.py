"""onnxruntime's channels-last ops (rules/60-qoperator.toml, builder nhwc_to_nchw), measured
against onnxruntime's own kernels, and the policy that a vendor quantization op no rule names is
said, not kept silently (review finding X2: onnxruntime's NHWC QLinearConv stayed in a rewrite
that exited 0)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from _cli_helpers import cli_in_process
from conftest import assert_bitwise_equal, rule_marker, run
from onnx import TensorProto, helper

import onnx_qrewrite
from onnx_qrewrite.errors import LoweringError

MS = "com.microsoft"


def _nhwc_max_pool(dtype: int, opset: int = 17, **attrs) -> onnx.ModelProto:
    node = helper.make_node("NhwcMaxPool", ["x"], ["y"], domain=MS, name="pool", **attrs)
    dims = [f"d{i}" for i in range(len(attrs["kernel_shape"]) + 2)]
    x = helper.make_tensor_value_info("x", dtype, dims)
    y = helper.make_tensor_value_info("y", dtype, [f"o{i}" for i in range(len(dims))])
    graph = helper.make_graph([node], "g", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)])
    model.ir_version = 8
    return model


#: kernel, strides, pads, dilations, ceil_mode, auto_pad; 1-D, 2-D and 3-D (onnxruntime's kernel takes each).
_POOLS = [
    {"kernel_shape": [2, 2], "strides": [2, 2]},
    {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]},
    {"kernel_shape": [3, 2], "strides": [2, 1], "pads": [1, 0, 2, 1], "dilations": [2, 1]},
    {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1},
    {"kernel_shape": [2, 2], "auto_pad": "SAME_UPPER"},
    {"kernel_shape": [3], "strides": [2], "pads": [1, 1]},
    {"kernel_shape": [2, 2, 2]},
]


@rule_marker("qop-nhwc-max-pool", "positive")
@pytest.mark.parametrize("dtype", [TensorProto.UINT8, TensorProto.INT8])
def test_nhwc_max_pool_is_transpose_max_pool_transpose_bit_for_bit(dtype):
    np_type = onnx.helper.tensor_dtype_to_np_dtype(dtype)
    info = np.iinfo(np_type)
    rng = np.random.default_rng(dtype)
    for attrs in _POOLS:
        model = _nhwc_max_pool(dtype, **attrs)
        result = onnx_qrewrite.rewrite(model)
        assert result.report.by_rule() == {"qop-nhwc-max-pool": 1}
        assert [n.op_type for n in result.model.graph.node] == ["Transpose", "MaxPool", "Transpose"]
        x = rng.integers(info.min, int(info.max) + 1, (2, *([8] * len(attrs["kernel_shape"])), 5)).astype(np_type)
        x.flat[:6] = [info.min, info.max, info.min, info.max, 0, info.max]  # extremes and ties
        assert_bitwise_equal(run(result.model, {"x": x})["y"], run(model, {"x": x})["y"], str(attrs))


@rule_marker("qop-nhwc-max-pool", "negative")
def test_nhwc_max_pool_below_opset_12_with_the_opset_kept_is_refused_by_name():
    """MaxPool takes uint8/int8 from opset 12 (onnxruntime 1.31.1 refuses the model at 11): with the
    model's opset 11 kept, the node is refused naming the opset; otherwise the opset is raised."""
    model = _nhwc_max_pool(TensorProto.UINT8, opset=11, kernel_shape=[2, 2])
    with pytest.raises(LoweringError, match=r"pool .*needs opset 12, model has 11 and the opset is kept"):
        onnx_qrewrite.rewrite(model, keep_opset=True)
    raised = onnx_qrewrite.rewrite(model)
    assert [o.version for o in raised.model.opset_import if o.domain == ""] == [12]
    x = np.arange(2 * 4 * 4 * 3, dtype=np.uint8).reshape(2, 4, 4, 3)
    assert_bitwise_equal(run(raised.model, {"x": x})["y"], run(model, {"x": x})["y"])


def _vendor_quant_model() -> onnx.ModelProto:
    """com.microsoft QLinearReduceMean (an onnxruntime contrib op): no rule names it."""
    inits = [
        helper.make_tensor("s", TensorProto.FLOAT, [], [0.1]),
        helper.make_tensor("z", TensorProto.UINT8, [], [0]),
    ]
    node = helper.make_node(
        "QLinearReduceMean", ["x", "s", "z", "s", "z"], ["y"], domain=MS, name="mean", axes=[1], keepdims=1
    )
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.UINT8, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.UINT8, [1, 1])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])
    model.ir_version = 8
    return model


def test_a_vendor_quantization_op_no_rule_names_is_unlowered_not_kept_silently(tmp_path):
    src = tmp_path / "m.onnx"
    onnx.save(_vendor_quant_model(), src)
    out = tmp_path / "o.onnx"
    refused = cli_in_process("rewrite", src, "-o", out)
    assert refused.returncode == 4, refused.stderr
    assert "node mean (com.microsoft::QLinearReduceMean) cannot be lowered: no rule of the catalogue" in refused.stderr
    assert not out.exists()
    kept = cli_in_process("rewrite", src, "-o", out, "--allow-unlowered")
    assert kept.returncode == 0, kept.stderr
    said = kept.stdout + kept.stderr
    assert "mean" in said and "no rule of the catalogue lowers com.microsoft::QLinearReduceMean" in said
    assert [n.op_type for n in onnx.load(out).graph.node] == ["QLinearReduceMean"]


def _nhwc_conv(x_type: int, w: np.ndarray, w_scale: np.ndarray, w_zp: np.ndarray, **attrs) -> onnx.ModelProto:
    """com.microsoft QLinearConv, channels_last = 1, as onnxruntime's NHWC optimizer writes it:
    x and y NHWC, the weights OIHW, an int32 bias."""
    x_np = onnx.helper.tensor_dtype_to_np_dtype(x_type)
    inits = [
        onnx.numpy_helper.from_array(np.array(0.02, np.float32), "xs"),
        onnx.numpy_helper.from_array(np.array(100 if x_np == np.uint8 else -3, x_np), "xz"),
        onnx.numpy_helper.from_array(w, "w"),
        onnx.numpy_helper.from_array(w_scale, "ws"),
        onnx.numpy_helper.from_array(w_zp, "wz"),
        onnx.numpy_helper.from_array(np.array(0.05, np.float32), "ys"),
        onnx.numpy_helper.from_array(np.array(120 if x_np == np.uint8 else 5, x_np), "yz"),
        onnx.numpy_helper.from_array(np.arange(w.shape[0], dtype=np.int32) * 37 - 50, "b"),
    ]
    node = helper.make_node(
        "QLinearConv",
        ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz", "b"],
        ["y"],
        domain=MS,
        name="conv",
        channels_last=1,
        kernel_shape=list(w.shape[2:]),
        **attrs,
    )
    rank = w.ndim
    x = helper.make_tensor_value_info("x", x_type, [f"d{i}" for i in range(rank)])
    y = helper.make_tensor_value_info("y", x_type, [f"o{i}" for i in range(rank)])
    model = helper.make_model(
        helper.make_graph([node], "g", [x], [y], inits),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)],
    )
    model.ir_version = 8
    return model


@rule_marker("qop-conv-channels-last", "negative")
def test_channels_last_qlinear_conv_with_int8_activations_is_not_lowered():
    """Review 5 R9: onnxruntime's optimizer fuses the int8 rewrite back into a channels-last int8 conv
    that saturates pairs of products (x86 without AVX-VNNI), up to 192 steps from the original."""
    w = np.ones((2, 1, 2, 2), np.int8)
    model = _nhwc_conv(TensorProto.INT8, w, np.float32(0.01), np.int8(0))
    with pytest.raises(onnx_qrewrite.LoweringError, match="dtype int8 is not one of uint8"):
        onnx_qrewrite.rewrite(model)


@rule_marker("qop-conv-channels-last", "positive")
@pytest.mark.parametrize("x_type", [TensorProto.UINT8])
def test_channels_last_qlinear_conv_is_within_the_qop_conv_bound_of_onnxruntimes_kernel(x_type):
    """Weights within [-64, 64] (quantize_static's reduce_range), per channel and per tensor,
    grouped, strided, padded, dilated, 1-D and 2-D: within the bound the rule declares (one step
    here), and a rewrite without the Transposes' layout (the output read as NCHW) far beyond it."""
    rng = np.random.default_rng(7 + x_type)
    x_np = onnx.helper.tensor_dtype_to_np_dtype(x_type)
    info = np.iinfo(x_np)
    cases = [
        ((6, 4, 3, 3), {"pads": [1, 1, 1, 1]}, True),
        ((4, 2, 3, 2), {"group": 2, "strides": [2, 1], "dilations": [1, 2], "pads": [0, 1, 1, 0]}, False),
        ((5, 4, 3), {"strides": [2], "pads": [1, 1]}, True),
    ]
    for shape, attrs, per_channel in cases:
        w = rng.integers(-64, 65, shape).astype(np.int8)
        n = shape[0] if per_channel else 1
        w_scale = rng.uniform(0.005, 0.02, n).astype(np.float32).reshape(-1 if per_channel else ())
        w_zp = np.zeros(n, np.int8).reshape(-1 if per_channel else ())
        model = _nhwc_conv(x_type, w, w_scale, w_zp, **attrs)
        result = onnx_qrewrite.rewrite(model)
        (rewrite,) = result.report.rewrites
        assert rewrite.rule == "qop-conv-channels-last" and rewrite.bound == 1
        channels = shape[1] * attrs.get("group", 1)
        x = rng.integers(info.min, int(info.max) + 1, (2, *([9] * (len(shape) - 2)), channels)).astype(x_np)
        x.flat[:4] = [info.min, info.max, info.min, info.max]
        expected = run(model, {"x": x})["y"].astype(np.int32)
        actual = run(result.model, {"x": x})["y"].astype(np.int32)
        assert expected.shape == actual.shape
        assert np.abs(expected - actual).max() <= rewrite.bound, (shape, attrs)
        # The layout is what is being tested: the same values in NCHW order are not the output.
        moved = np.moveaxis(actual, -1, 1).reshape(actual.shape)
        assert np.abs(expected - moved).max() > rewrite.bound
