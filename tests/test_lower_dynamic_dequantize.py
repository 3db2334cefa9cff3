"""oneDNN's DynamicDequantize -> DequantizeLinear, or its Cast/Sub/Mul form, bit for bit.

No runtime we can install runs DynamicDequantize, so the reference is its definition computed in
numpy the way oneDNN does: ``dst = (src - zps) * scales``, the difference in integers, the product
in float32. Covered: per-tensor, per-channel (default axis 1, explicit axes), missing zps, zps of
another type than src (s32 with u8, u8 with s8), scales and zero points computed at run time, and
the node in any non-standard domain.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import assert_bitwise_equal, op_types, rule_marker, run
from onnx import TensorProto, helper, numpy_helper

import onnx_qrewrite

NP = {"uint8": np.uint8, "int8": np.int8, "int32": np.int32}
TP = {
    "uint8": TensorProto.UINT8,
    "int8": TensorProto.INT8,
    "int32": TensorProto.INT32,
    "float32": TensorProto.FLOAT,
    "bfloat16": TensorProto.BFLOAT16,
}
SHAPE = (2, 3, 4)
rng = np.random.default_rng(11)


def reference(src, scales, zps, axis):
    """(src - zps) * scales: integer difference, float32 product; per-channel along ``axis``."""

    def along(a):
        a = np.asarray(a)
        return a.reshape(()) if axis is None else a.reshape([-1] + [1] * (src.ndim - 1 - axis % src.ndim))

    diff = src.astype(np.int64) - (along(zps).astype(np.int64) if zps is not None else 0)
    return (diff.astype(np.float32) * along(scales).astype(np.float32)).astype(np.float32)


def dd_model(
    src_type, zp_type, *, qtype="per_tensor", axis=None, domain="com.intel.onednn", runtime=(), scale_type="float32"
):
    """One DynamicDequantize node; scales/zps are initializers unless named in ``runtime``."""
    n = 1 if qtype == "per_tensor" else SHAPE[axis if axis is not None else 1]
    scales = rng.uniform(0.001, 0.5, n).astype(np.float32)
    if scale_type == "bfloat16":
        scales = scales.astype(ml_dtypes.bfloat16)
    zps = None if zp_type is None else rng.integers(-100, 100, n).astype(NP[zp_type])
    if zp_type == "uint8":
        zps = rng.integers(0, 256, n).astype(np.uint8)
    attrs = {"qtype": qtype} if qtype != "per_tensor" or axis == "explicit" else {}
    if axis is not None:
        attrs["axis"] = axis
    ins = ["src", "scales"] + (["zps"] if zps is not None else [])
    inputs = [helper.make_tensor_value_info("src", TP[src_type], SHAPE)]
    inits = []
    for name, value in (("scales", scales), ("zps", zps)):
        if value is None:
            continue
        if name in runtime:
            inputs.append(
                helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(value.dtype), value.shape)
            )
        else:
            inits.append(numpy_helper.from_array(value, name))
    out_type = TensorProto.FLOAT
    nodes = [helper.make_node("DynamicDequantize", ins, ["dst"], name="dd", domain=domain, **attrs)]
    if scale_type == "bfloat16":  # onnxruntime cannot return bfloat16 to numpy: cast it (exact)
        nodes[0].output[0] = "dst_bf16"
        nodes.append(helper.make_node("Cast", ["dst_bf16"], ["dst"], to=TensorProto.FLOAT))
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("dst", out_type, SHAPE)], inits)
    model = helper.make_model(
        graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)]
    )
    src = rng.integers(np.iinfo(NP[src_type]).min, np.iinfo(NP[src_type]).max + 1, SHAPE).astype(NP[src_type])
    return model, src, scales, zps


def check(model, src, scales, zps, axis, runtime=()):
    feeds = {"src": src}
    if "scales" in runtime:
        feeds["scales"] = scales
    if "zps" in runtime:
        feeds["zps"] = zps
    result = onnx_qrewrite.rewrite(model)
    want = reference(src, scales, zps, axis)
    if scales.dtype == ml_dtypes.bfloat16:
        want = want.astype(ml_dtypes.bfloat16).astype(np.float32)
    assert_bitwise_equal(run(result.model, feeds)["dst"], want, "dst")
    return result


@rule_marker("onednn-dynamic-dequantize", "positive")
@pytest.mark.parametrize("src_type, zp_type", [("uint8", "uint8"), ("int8", "int8"), ("uint8", None), ("int8", None)])
@pytest.mark.parametrize(
    "qtype, axis", [("per_tensor", None), ("per_channel", None), ("per_channel", -1), ("per_channel", 0)]
)
def test_zero_point_of_src_type_or_none_becomes_dequantize_linear(src_type, zp_type, qtype, axis):
    model, src, scales, zps = dd_model(src_type, zp_type, qtype=qtype, axis=axis)
    effective_axis = None if qtype == "per_tensor" else (1 if axis is None else axis)
    result = check(model, src, scales, zps, effective_axis)
    assert op_types(result.model) == ["DequantizeLinear"]
    (node,) = result.model.graph.node
    assert len(node.input) == (3 if zp_type else 2)
    attrs = {a.name: a.i for a in node.attribute}
    assert attrs == ({} if qtype == "per_tensor" else {"axis": effective_axis % 3})
    assert result.report.by_rule() == {"onednn-dynamic-dequantize": 1}
    assert "com.intel.onednn" not in {o.domain for o in result.model.opset_import}


@rule_marker("onednn-dynamic-dequantize", "negative")
@rule_marker("onednn-dynamic-dequantize-arith", "positive")
@pytest.mark.parametrize(
    "src_type, zp_type", [("uint8", "int32"), ("int8", "int32"), ("int8", "uint8"), ("uint8", "int8")]
)
@pytest.mark.parametrize("qtype, axis", [("per_tensor", None), ("per_channel", None), ("per_channel", 2)])
def test_zero_point_of_another_type_uses_the_arithmetic_form(src_type, zp_type, qtype, axis):
    model, src, scales, zps = dd_model(src_type, zp_type, qtype=qtype, axis=axis)
    result = check(model, src, scales, zps, None if qtype == "per_tensor" else (1 if axis is None else axis))
    assert op_types(result.model) == ["Cast", "Cast", "Sub", "Cast", "Mul"]
    assert result.report.by_rule() == {"onednn-dynamic-dequantize-arith": 1}
    only = onnx_qrewrite.rewrite(model, only=["onednn-dynamic-dequantize"], allow_unlowered=True)
    assert only.report.unlowered[0].reasons == (
        f"onednn-dynamic-dequantize: zps 'zps' is {zp_type} but src is {src_type}; DequantizeLinear needs both "
        "of one type (the arithmetic form follows)",
    )


def test_scales_and_zero_points_computed_at_run_time():
    model, src, scales, zps = dd_model("uint8", "uint8", qtype="per_channel", runtime=("scales", "zps"))
    assert op_types(check(model, src, scales, zps, 1, runtime=("scales", "zps")).model) == ["DequantizeLinear"]
    model, src, scales, zps = dd_model("uint8", "int32", qtype="per_channel", axis=-1, runtime=("scales", "zps"))
    result = check(model, src, scales, zps, -1, runtime=("scales", "zps"))
    assert op_types(result.model) == ["Reshape", "Reshape", "Cast", "Cast", "Sub", "Cast", "Mul"]
    model, src, scales, zps = dd_model("int8", "int32", runtime=("scales",))
    assert op_types(check(model, src, scales, zps, None, runtime=("scales",)).model)[0] == "Reshape"


@pytest.mark.parametrize("domain", ["com.intel.onednn", "org.openvinotoolkit", "ai.onnx.contrib"])
def test_matched_in_any_non_standard_domain(domain):
    model, src, scales, zps = dd_model("int8", "int8", domain=domain)
    assert op_types(check(model, src, scales, zps, None).model) == ["DequantizeLinear"]


def test_a_rule_file_can_narrow_the_domain(tmp_path):
    rules = tmp_path / "narrow.toml"
    rules.write_text(
        '[[rule]]\nid = "my-dd"\nsummary = "only my domain"\nbuilder = "dynamic_dequantize"\n'
        'exactness = "exact"\nmatch = [{ domain = "my.domain", op = "DynamicDequantize" }]\n'
        'options = { form = "arithmetic", axis_default = 1 }\n'
    )
    skip = ["onednn-dynamic-dequantize", "onednn-dynamic-dequantize-arith"]
    mine, _src, _scales, _zps = dd_model("int8", "int8", domain="my.domain")
    result = onnx_qrewrite.rewrite(mine, rules=[rules], skip=skip)
    assert result.report.by_rule() == {"my-dd": 1} and op_types(result.model) == ["Cast", "Cast", "Sub", "Cast", "Mul"]
    other, *_ = dd_model("int8", "int8", domain="other.domain")
    # A quantization op no active rule names is said (exit 4), and kept when unlowered ops are allowed.
    with pytest.raises(onnx_qrewrite.LoweringError, match=r"no rule of the catalogue lowers other\.domain::Dyn"):
        onnx_qrewrite.rewrite(other, rules=[rules], skip=skip)
    untouched = onnx_qrewrite.rewrite(other, rules=[rules], skip=skip, allow_unlowered=True)
    assert op_types(untouched.model) == ["DynamicDequantize"] and not untouched.report.changed
    assert [u.node for u in untouched.report.unlowered] == ["dd"]


def test_bfloat16_scales_compute_in_float_and_cast():
    model, src, scales, zps = dd_model("int8", "int8", qtype="per_channel", scale_type="bfloat16")
    result = check(model, src, scales, zps, 1)
    assert op_types(result.model) == ["Cast", "Cast", "Cast", "Sub", "Cast", "Mul", "Cast", "Cast"]


@rule_marker("onednn-dynamic-dequantize-arith", "negative")
@pytest.mark.parametrize(
    "edit, reason",
    [
        (
            lambda m: m.graph.node[0].attribute.append(helper.make_attribute("qtype", "per_group")),
            "qtype 'per_group' is not supported (only per_tensor, per_channel)",
        ),
        (
            lambda m: m.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.ones(3, np.float32), "scales")),
            "malformed node: qtype per_tensor but 'scales' has shape [3] (one element expected)",
        ),
        (
            lambda m: m.graph.input[0].type.tensor_type.__setattr__("elem_type", TensorProto.INT32),
            "dtype int32 is not one of int8, uint8",
        ),
    ],
)
def test_what_cannot_be_lowered_is_named(edit, reason):
    model, *_ = dd_model("uint8", "int32")
    edit(model)
    with pytest.raises(onnx_qrewrite.LoweringError) as exc:
        onnx_qrewrite.rewrite(model)
    assert str(exc.value).startswith("node dd (com.intel.onednn::DynamicDequantize) cannot be lowered: ")
    assert f"onednn-dynamic-dequantize-arith: {reason}" in str(exc.value)
    assert exc.value.exit_code == 4


def test_per_channel_arithmetic_needs_the_rank_of_src():
    model, *_ = dd_model("uint8", "int32", qtype="per_channel")
    model.graph.input[0].name = "src_in"
    model.graph.node.insert(0, helper.make_node("Abs", ["src_in"], ["src"]))
    model.graph.value_info.append(helper.make_tensor_value_info("src", TensorProto.UINT8, None))
    with pytest.raises(onnx_qrewrite.LoweringError, match=r"per_channel needs the rank of src 'src'"):
        onnx_qrewrite.rewrite(model)
