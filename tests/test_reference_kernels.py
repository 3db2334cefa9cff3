"""The numpy reference kernels, run inside onnxruntime, reproduce the vendor kernels bit for bit.

Evidence: the 96 cases AMD Quark's own CPU kernels computed (tests/data/quark_vectors), through one-node
models under both op names (com.amd.quark Extended* and com.vai.quantize Vitis*); every real model
in tests/data/models against the outputs stored with it; oneDNN DynamicDequantize against the
standard-op decomposition NUMERICS.md verified bit-exact.
"""

from __future__ import annotations

import collections

import ml_dtypes
import numpy as np
import onnx
import pytest
from _verify_helpers import (
    ONNX_TYPES,
    QUARK_DOMAINS,
    bits,
    one_node_model,
    vector_arrays,
    vector_cases,
)
from conftest import REAL_MODEL_NAMES, REAL_MODELS
from onnx import TensorProto, helper

from onnx_qrewrite.errors import InvalidModelError
from onnx_qrewrite.verify import kernels
from onnx_qrewrite.verify.reference_ops import REFERENCE_DOMAIN, retarget_vendor_nodes
from onnx_qrewrite.verify.session import ModelRunner, SessionSettings

CASES = vector_cases()


def _run_reference(model: onnx.ModelProto, feeds: dict[str, np.ndarray], **settings) -> dict[str, np.ndarray]:
    runner = ModelRunner(model, label="test model", settings=SessionSettings(**settings), reference_kernels=True)
    return runner.run(feeds)


def test_the_vectors_cover_every_dtype_both_ops_and_both_axis_forms():
    seen = collections.defaultdict(set)
    for case in CASES:
        seen[(case["op"], case["dtype"])].add("absent" if case["axis"] is None else "given")
    assert len(CASES) == 96
    for op in ("ExtendedQuantizeLinear", "ExtendedDequantizeLinear"):
        for dtype in ONNX_TYPES:
            assert seen[(op, dtype)] == {"absent", "given"}, (op, dtype)


@pytest.mark.parametrize("domain", sorted(QUARK_DOMAINS))
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['key']}-{c['op'][8:]}-{c['dtype']}-axis{c['axis']}")
def test_reference_kernels_reproduce_quark_vectors_bit_for_bit(case, domain):
    x, scale, zp, expected = vector_arrays(case)
    quantize_op, dequantize_op = QUARK_DOMAINS[domain]
    op_type = dequantize_op if case["op"] == "ExtendedDequantizeLinear" else quantize_op
    model = one_node_model(
        domain, op_type, ONNX_TYPES[case["dtype"]], case["axis"], {"x": x.shape, "scale": scale.shape, "zp": zp.shape}
    )
    got = _run_reference(model, {"x": x, "scale": scale, "zp": zp})["y"]
    assert got.dtype == expected.dtype and got.shape == expected.shape
    mismatch = np.flatnonzero(bits(got).ravel() != bits(expected).ravel())
    assert mismatch.size == 0, (
        f"{mismatch.size} of {got.size} differ; first at {mismatch[0]}: x={x.ravel()[mismatch[0]]!r} "
        f"got {got.ravel()[mismatch[0]]!r}, Quark gave {expected.ravel()[mismatch[0]]!r}"
    )


def test_quantize_overflow_follows_the_kernels_int64_conversion_not_saturation():
    # From the vectors: x / scale = +inf gives qmin (not qmax), and -1.65e38 with zp -5 gives qmax:
    # the kernel converts to int64 the x86 way (INT64_MIN) and adds the zero point with wrap-around.
    x = np.array([3.3e38, -3.3e38, 6e9], np.float32)
    assert kernels.quark_quantize(x, np.float32(0.5), np.int8(0)).tolist() == [-128, -128, 127]
    assert kernels.quark_quantize(x, np.float32(2.0), np.int16(-5)).tolist() == [32767, 32767, 32767]


@pytest.mark.parametrize("name", REAL_MODEL_NAMES)
def test_every_shared_model_reproduces_its_stored_outputs(name):
    # The stored outputs were made with onnxruntime's default settings (optimisation "all") and,
    # for the Quark models, AMD's own kernels.
    model = onnx.load(REAL_MODELS / f"{name}.onnx")
    feeds = dict(np.load(REAL_MODELS / f"{name}.inputs.npz"))
    expected = dict(np.load(REAL_MODELS / f"{name}.outputs.npz"))
    got = _run_reference(model, feeds, opt_level="all")
    assert set(got) == set(expected)
    for key, want in expected.items():
        assert np.array_equal(bits(got[key]), bits(want)), f"{name}: output {key} differs"


@pytest.mark.parametrize("name", [n for n in REAL_MODEL_NAMES if n.startswith("quark_")])
def test_quark_models_reproduce_their_outputs_without_graph_optimisation_too(name):
    model = onnx.load(REAL_MODELS / f"{name}.onnx")
    feeds = dict(np.load(REAL_MODELS / f"{name}.inputs.npz"))
    expected = dict(np.load(REAL_MODELS / f"{name}.outputs.npz"))
    got = _run_reference(model, feeds, opt_level="disable", threads=2)
    for key, want in expected.items():
        assert np.array_equal(bits(got[key]), bits(want)), f"{name}: output {key} differs"


# -- retargeting ---------------------------------------------------------------------------------


def test_absent_axis_is_written_as_the_kernels_default_zero():
    model = one_node_model(
        "com.amd.quark", "ExtendedDequantizeLinear", TensorProto.INT8, None, {"x": (2, 3), "scale": (2,), "zp": (2,)}
    )
    retargeted = retarget_vendor_nodes(model)
    (node,) = retargeted.graph.node
    assert (node.domain, node.op_type) == (REFERENCE_DOMAIN, "QuarkDequantize_int8")
    assert {a.name: helper.get_attribute_value(a) for a in node.attribute} == {"axis": 0, "node": b"vendor"}
    assert model.graph.node[0].domain == "com.amd.quark"  # the caller's model is not touched


def test_narrow_floats_cross_the_python_op_boundary_as_float32_casts():
    model = one_node_model(
        "com.amd.quark", "ExtendedQuantizeLinear", TensorProto.BFLOAT16, None, {"x": (4,), "scale": (), "zp": ()}
    )
    ops = [(n.op_type, n.output[0]) for n in retarget_vendor_nodes(model).graph.node]
    assert [op for op, _ in ops] == ["Cast", "QuarkQuantize_bfloat16", "Cast"]
    assert ops[-1][1] == "y"  # the original output name is kept, so values compare by name


def test_vitis_aliases_run_the_same_kernels():
    model = one_node_model(
        "com.vai.quantize", "VitisQuantizeLinear", TensorProto.UINT16, 1, {"x": (2, 3), "scale": (3,), "zp": (3,)}
    )
    (node,) = retarget_vendor_nodes(model).graph.node
    assert node.op_type == "QuarkQuantize_uint16"


def test_unsupported_zero_point_type_is_refused_naming_the_node():
    model = one_node_model(
        "com.amd.quark", "ExtendedQuantizeLinear", TensorProto.FLOAT8E4M3FN, None, {"x": (4,), "scale": (), "zp": ()}
    )
    with pytest.raises(InvalidModelError, match=r"'vendor' \(com.amd.quark::ExtendedQuantizeLinear\).*FLOAT8E4M3FN"):
        ModelRunner(model, label="m.onnx", settings=SessionSettings(), reference_kernels=True)


def test_a_kernel_error_at_run_time_is_one_line_naming_the_model():
    model = one_node_model(
        "com.amd.quark", "ExtendedDequantizeLinear", TensorProto.INT8, 1, {"x": (2, 3), "scale": (2,), "zp": (2,)}
    )
    runner = ModelRunner(model, label="m.onnx", settings=SessionSettings(), reference_kernels=True)
    feeds = {"x": np.zeros((2, 3), np.int8), "scale": np.ones(2, np.float32), "zp": np.zeros(2, np.int8)}
    expected = (
        r"^m\.onnx: onnxruntime failed while running the model: node 'vendor': reference kernel "
        r"QuarkDequantize_int8: scale has 2 elements but the input has 3 along axis 1$"
    )
    with pytest.raises(InvalidModelError, match=expected) as info:
        runner.run(feeds)
    assert "\n" not in str(info.value)


# -- oneDNN DynamicDequantize ---------------------------------------------------------------------


def _dynamic_dequantize_model(domain, src_t, zp_t, scale_t, per_channel, axis, src_shape, n_scales):
    inputs = ["src", "scales"] + (["zps"] if zp_t is not None else [])
    attrs = {"qtype": "per_channel" if per_channel else "per_tensor"}
    if axis is not None:
        attrs["axis"] = axis
    node = helper.make_node("DynamicDequantize", inputs, ["dst"], domain=domain, name="dyn", **attrs)
    infos = [
        helper.make_tensor_value_info("src", src_t, src_shape),
        helper.make_tensor_value_info("scales", scale_t, [n_scales]),
    ]
    if zp_t is not None:
        infos.append(helper.make_tensor_value_info("zps", zp_t, [n_scales]))
    graph = helper.make_graph([node], "g", infos, [helper.make_tensor_value_info("dst", scale_t, src_shape)])
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)], ir_version=8
    )


def _decomposition(src, scales, zps, axis, out_dtype):
    """NUMERICS.md: Mul(Cast<f32>(Sub(Cast<i32>(x), Cast<i32>(zps))), s), run by onnxruntime's own
    kernels; a bfloat16 dst is dequantized in float and cast."""
    shape = [1] * src.ndim
    shape[axis] = -1 if scales.size > 1 else 1
    nodes = [
        helper.make_node("Cast", ["src"], ["src32"], to=TensorProto.INT32),
        helper.make_node("Reshape", ["scales", "shape"], ["s"]),
    ]
    diff = "src32"
    if zps is not None:
        nodes += [
            helper.make_node("Cast", ["zps"], ["zp32"], to=TensorProto.INT32),
            helper.make_node("Reshape", ["zp32", "shape"], ["zpr"]),
            helper.make_node("Sub", ["src32", "zpr"], ["diff"]),
        ]
        diff = "diff"
    nodes += [
        helper.make_node("Cast", [diff], ["difff"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["difff", "s"], ["dst"]),
    ]
    feeds = {"src": src, "scales": scales.astype(np.float32)}
    infos = [
        helper.make_tensor_value_info("src", helper.np_dtype_to_tensor_dtype(src.dtype), src.shape),
        helper.make_tensor_value_info("scales", TensorProto.FLOAT, scales.shape),
    ]
    if zps is not None:
        feeds["zps"] = zps
        infos.append(helper.make_tensor_value_info("zps", helper.np_dtype_to_tensor_dtype(zps.dtype), zps.shape))
    graph = helper.make_graph(
        nodes,
        "d",
        infos,
        [helper.make_tensor_value_info("dst", TensorProto.FLOAT, None)],
        initializer=[onnx.numpy_helper.from_array(np.array(shape, np.int64), "shape")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    dst = ModelRunner(model, label="decomposition", settings=SessionSettings()).run(feeds)["dst"]
    return dst.astype(out_dtype)


@pytest.mark.parametrize("domain", ["com.intel.onednn", "org.openvinotoolkit"])
@pytest.mark.parametrize("src_t", [TensorProto.INT8, TensorProto.UINT8, TensorProto.INT32])
@pytest.mark.parametrize("zp_t", [None, TensorProto.INT8, TensorProto.UINT8, TensorProto.INT32])
@pytest.mark.parametrize("layout", ["per_tensor", "per_channel_default_axis", "per_channel_axis0"])
def test_dynamic_dequantize_matches_the_standard_op_decomposition(domain, src_t, zp_t, layout):
    rng = np.random.default_rng(src_t * 10 + (zp_t or 0))
    src_dtype = helper.tensor_dtype_to_np_dtype(src_t)
    info = np.iinfo(src_dtype)
    lo, hi = (max(info.min, -(2**20)), min(info.max, 2**20)) if src_t == TensorProto.INT32 else (info.min, info.max)
    src = rng.integers(lo, hi, size=(3, 4, 5), endpoint=True).astype(src_dtype)
    axis = {"per_tensor": None, "per_channel_default_axis": None, "per_channel_axis0": 0}[layout]
    effective_axis = 1 if axis is None else axis
    n = 1 if layout == "per_tensor" else src.shape[effective_axis]
    scales = rng.uniform(1e-3, 0.5, size=n).astype(np.float32)
    zps = None
    if zp_t is not None:
        zp_info = np.iinfo(helper.tensor_dtype_to_np_dtype(zp_t))
        zps = rng.integers(max(zp_info.min, -100), min(zp_info.max, 100), size=n, endpoint=True).astype(
            helper.tensor_dtype_to_np_dtype(zp_t)
        )
    model = _dynamic_dequantize_model(
        domain, src_t, zp_t, TensorProto.FLOAT, layout != "per_tensor", axis, src.shape, n
    )
    feeds = {"src": src, "scales": scales} | ({"zps": zps} if zps is not None else {})
    got = _run_reference(model, feeds)["dst"]
    expected = _decomposition(src, scales, zps, effective_axis, np.float32)
    assert np.array_equal(bits(got), bits(expected))


def test_dynamic_dequantize_with_a_bfloat16_scale_dequantizes_in_float_then_casts():
    src = np.arange(-12, 12, dtype=np.int8).reshape(2, 3, 4)
    scales = np.array([0.1, 0.3, 0.7], np.float32).astype(ml_dtypes.bfloat16)
    zps = np.array([1, -2, 3], np.int8)
    model = _dynamic_dequantize_model(
        "com.intel.onednn", TensorProto.INT8, TensorProto.INT8, TensorProto.BFLOAT16, True, 1, src.shape, 3
    )
    got = _run_reference(model, {"src": src, "scales": scales, "zps": zps})["dst"]
    expected = _decomposition(src, scales.astype(np.float32), zps, 1, ml_dtypes.bfloat16)
    assert got.dtype == np.dtype(ml_dtypes.bfloat16)
    assert np.array_equal(bits(got), bits(expected))


def test_dynamic_dequantize_with_an_unsupported_type_is_refused_naming_the_types():
    model = _dynamic_dequantize_model(
        "com.intel.onednn", TensorProto.INT16, TensorProto.INT8, TensorProto.FLOAT, False, None, (2, 3), 1
    )
    with pytest.raises(
        InvalidModelError,
        match=r"^m\.onnx: node 'dyn' \(com\.intel\.onednn::DynamicDequantize\): "
        r"no reference kernel for src int16, scales float, zps int8$",
    ):
        ModelRunner(model, label="m.onnx", settings=SessionSettings(), reference_kernels=True)
