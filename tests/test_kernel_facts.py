"""onnxruntime kernel behaviours the rules depend on, measured on the installed onnxruntime
(docs/numerics.md records them, with the version they were measured on). Each test is the
one-line reproduction of one fact: if an onnxruntime upgrade changes a behaviour, the test that
fails names the fact, and the doc and the rules that rely on it must be revisited.

Where an existing test already pins the fact with the rewrite (named in docs/numerics.md), the
test here is the bare kernel measurement only."""

from __future__ import annotations

import platform
import subprocess
import sys

import numpy as np
import onnx
import pytest
from conftest import run, u8s8_saturates_here
from onnx import TensorProto as T
from onnx import helper, numpy_helper

import onnx_qrewrite
from onnx_qrewrite.rewriter.builders.matmul_nbits import pack


def _model(nodes, inputs, outputs, inits=(), opset=21) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    opsets = [helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def _c(name: str, value, dtype=np.float32) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(value, dtype), name)


def _vi(name: str, elem: int, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def _cpu_has_vnni() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx_vnni" in flags or "avx512_vnni" in flags


def test_u8_x_s8_pairs_saturate_to_int16_in_the_integer_kernels_on_x86_without_vnni():
    """[255, 255] . [127, 127] = 64770, but the AVX2 kernels (x86 without VNNI) give 32767 (or its
    requantization); with AVX-VNNI or AVX512-VNNI every kernel gives the definition."""
    if sys.platform.startswith("linux") and platform.machine() == "x86_64":
        assert u8s8_saturates_here() is not _cpu_has_vnni()
    full, requantized = (32767, 32) if u8s8_saturates_here() else (64770, 63)
    mmi = _model(
        [helper.make_node("MatMulInteger", ["a", "b"], ["y"])],
        [_vi("a", T.UINT8, [1, 2])],
        [_vi("y", T.INT32, [1, 1])],
        [_c("b", [[127], [127]], np.int8)],
    )
    assert run(mmi, {"a": np.array([[255, 255]], np.uint8)})["y"].item() == full
    conv = _model(
        [helper.make_node("ConvInteger", ["x", "w"], ["y"])],
        [_vi("x", T.INT8, [1, 2, 1, 1])],
        [_vi("y", T.INT32, [1, 1, 1, 1])],
        [_c("w", np.full((1, 2, 1, 1), 255), np.uint8)],
    )
    assert run(conv, {"x": np.full((1, 2, 1, 1), 127, np.int8)})["y"].item() == full
    requantize = [_c("s1", 1.0), _c("z_u8", 0, np.uint8), _c("z_s8", 0, np.int8), _c("ys", 1024.0)]
    qmm = _model(
        [helper.make_node("QLinearMatMul", ["a", "s1", "z_u8", "b", "s1", "z_s8", "ys", "z_u8"], ["y"])],
        [_vi("a", T.UINT8, [1, 2])],
        [_vi("y", T.UINT8, [1, 1])],
        [*requantize, _c("b", [[127], [127]], np.int8)],
    )
    assert run(qmm, {"a": np.array([[255, 255]], np.uint8)})["y"].item() == requantized  # 64770 / 1024 -> 63
    qconv = _model(
        [helper.make_node("QLinearConv", ["x", "s1", "z_u8", "w", "s1", "z_s8", "ys", "z_u8"], ["y"])],
        [_vi("x", T.UINT8, [1, 2, 1, 1])],
        [_vi("y", T.UINT8, [1, 1, 1, 1])],
        [*requantize, _c("w", np.full((1, 2, 1, 1), 127), np.int8)],
    )
    assert run(qconv, {"x": np.full((1, 2, 1, 1), 255, np.uint8)})["y"].item() == requantized


def test_qlinear_softmax_multiplies_by_floor_of_the_inverse_scale():
    """p = 1 (one element), y_scale = 1/133.9: p / y_scale rounds to 134, the kernel gives 133."""
    ys = np.float32(1 / 133.9)
    model = _model(
        [helper.make_node("QLinearSoftmax", ["x", "xs", "xz", "ys", "yz"], ["y"], domain="com.microsoft", opset=13)],
        [_vi("x", T.UINT8, [1, 1])],
        [_vi("y", T.UINT8, [1, 1])],
        [_c("xs", 0.1), _c("xz", 0, np.uint8), _c("ys", ys), _c("yz", 0, np.uint8)],
        opset=13,
    )
    assert np.round(1 / ys) == 134
    assert run(model, {"x": np.array([[7]], np.uint8)})["y"].item() == 133


def test_float16_quantize_linear_converts_to_int32_before_saturating():
    """+inf, -inf and NaN become INT_MIN, then the zero point is added in int32 (wrapping): with zero
    point -5 all three give 127; float32 input saturates (127, -128, -128)."""
    xs = [np.inf, -np.inf, np.nan, 60000]
    for dtype, elem, want in (
        (np.float16, T.FLOAT16, [127, 127, 127, 127]),
        (np.float32, T.FLOAT, [127, -128, -128, 127]),
    ):
        model = _model(
            [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"])],
            [_vi("x", elem, [4])],
            [_vi("y", T.INT8, [4])],
            [_c("s", 1.0, dtype), _c("z", -5, np.int8)],
        )
        assert run(model, {"x": np.array(xs, dtype)})["y"].tolist() == want
    unsigned = _model(
        [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"])],
        [_vi("x", T.FLOAT16, [2])],
        [_vi("y", T.UINT8, [2])],
        [_c("s", 1.0, np.float16), _c("z", 0, np.uint8)],
    )
    assert run(unsigned, {"x": np.array([np.inf, 60000], np.float16)})["y"].tolist() == [0, 255]


def _leaky_relu_without_output_zero_point() -> onnx.ModelProto:
    return _model(
        [helper.make_node("QLinearLeakyRelu", ["x", "xs", "xz", "ys"], ["y"], domain="com.microsoft", alpha=0.1)],
        [_vi("x", T.UINT8, [4])],
        [_vi("y", T.UINT8, [4])],
        [_c("xs", 0.1), _c("xz", 3, np.uint8), _c("ys", 0.1)],
    )


def test_qlinear_leaky_relu_without_output_zero_point_aborts_the_process(tmp_path):
    path = tmp_path / "leaky.onnx"
    onnx.save(_leaky_relu_without_output_zero_point(), path)
    code = (
        "import onnxruntime as ort, sys\n"
        f"ort.InferenceSession({str(path)!r}, providers=['CPUExecutionProvider'])\n"
        "print('session created')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -6 and "session created" not in proc.stdout  # SIGABRT: an assertion
    # The rewrite (qop-leaky-relu) takes the schema's default, zero point 0, and runs: it equals the
    # original given that zero point explicitly, which onnxruntime does run.
    rewritten = onnx_qrewrite.rewrite(_leaky_relu_without_output_zero_point()).model
    explicit = _leaky_relu_without_output_zero_point()
    explicit.graph.node[0].input.append("yz")
    explicit.graph.initializer.append(_c("yz", 0, np.uint8))
    x = np.arange(0, 256, 17, dtype=np.uint8)[:4]
    assert run(rewritten, {"x": x})["y"].tolist() == run(explicit, {"x": x})["y"].tolist()


def _nbits(bits: int, k: int = 32, n: int = 4, block: int = 16, zero_points: str = "none", g_idx: bool = False):
    rng = np.random.default_rng(bits * 100 + k)
    nb = -(-k // block)
    q = rng.integers(0, 2**bits, (n, nb * block)).astype(np.uint8)
    scale = rng.uniform(0.1, 1, (n, nb)).astype(np.float32)
    inits = [numpy_helper.from_array(pack(q, bits).reshape(n, nb, block * bits // 8), "B"), _c("S", scale)]
    inputs = ["A", "B", "S"]
    zp = np.full((n, nb), 2 ** (bits - 1), np.float32)
    if zero_points == "uint8":
        stored = rng.integers(0, 2**bits, (n, nb)).astype(np.uint8)
        inits.append(numpy_helper.from_array(pack(stored, bits).reshape(n, -1), "Z"))
        inputs.append("Z")
        zp = stored.astype(np.float32)
    elif zero_points == "float":
        inits.append(_c("Z", np.ones(n * nb)))
        inputs.append("Z")
    if g_idx:
        inits.append(numpy_helper.from_array((np.arange(k) // block).astype(np.int32), "G"))
        inputs.append("G")
    node = helper.make_node("MatMulNBits", inputs, ["Y"], domain="com.microsoft", K=k, N=n, bits=bits, block_size=block)
    model = _model([node], [_vi("A", T.FLOAT, [k, k])], [_vi("Y", T.FLOAT, [k, n])], inits)
    weights = ((q[:, :k] - np.repeat(zp, block, axis=1)[:, :k]) * np.repeat(scale, block, axis=1)[:, :k]).T
    return model, weights.astype(np.float32)


@pytest.mark.parametrize("zero_points", ["none", "uint8"])
def test_matmul_nbits_2_bit_runs_on_cpu(zero_points):
    """onnxruntime 1.31.1's CPU kernel runs bits=2: with A = I its output is the dequantized weights."""
    model, weights = _nbits(2, zero_points=zero_points)
    got = run(model, {"A": np.eye(32, dtype=np.float32)})["Y"]
    assert np.array_equal(got, weights)
    # Lowered unpacked (the fact below): tests/test_lower_matmul_nbits.py.
    assert onnx_qrewrite.rewrite(model).report.by_rule() == {"matmul-nbits-unpacked": 1}


def test_an_int2_blocked_dequantize_and_matmul_are_fused_into_wrong_weights():
    """Why 2-bit MatMulNBits is lowered unpacked (review 5 R3): int2 blocked DequantizeLinear (opset
    25) + MatMul computes the weights right without graph optimization, but onnxruntime 1.31.1's
    default level fuses the pair into a MatMulNBits whose weights are not these (measured with an odd
    N, here 9: max abs 2.8 on weights of at most 2; N = 8 gave the weights right)."""
    rng = np.random.default_rng(2)
    k, n, block = 64, 9, 32
    q = rng.integers(-2, 2, (k, n))
    scale = rng.uniform(0.1, 1, (k // block, n)).astype(np.float32)
    weights = (q * np.repeat(scale, block, axis=0)).astype(np.float32)
    nodes = [
        helper.make_node("DequantizeLinear", ["W", "S"], ["D"], axis=0, block_size=block),
        helper.make_node("MatMul", ["A", "D"], ["Y"]),
    ]
    inits = [helper.make_tensor("W", T.INT2, [k, n], q.flatten().tolist()), _c("S", scale)]
    graph = helper.make_graph(nodes, "g", [_vi("A", T.FLOAT, [k, k])], [_vi("Y", T.FLOAT, [k, n])], inits)
    model = helper.make_model(graph, ir_version=13, opset_imports=[helper.make_opsetid("", 25)])
    eye = {"A": np.eye(k, dtype=np.float32)}
    assert np.array_equal(run(model, eye)["Y"], weights)
    fused = run(model, eye, opt="all")["Y"]
    assert not np.allclose(fused, weights, atol=0.01), (
        "onnxruntime fuses int2 right now: 2-bit may use the blocked form"
    )


def test_matmul_nbits_8_bit_with_float_zero_points_fails_on_cpu():
    model, _ = _nbits(8, zero_points="float")
    with pytest.raises(Exception, match="Only 2b and 4b quantization is supported for unpacked compute"):
        run(model, {"A": np.eye(32, dtype=np.float32)})


def test_matmul_nbits_g_idx_ignores_uint8_zero_points():
    """With g_idx the kernel uses 2^(bits-1) whatever uint8 zero points the node gives."""
    with_zp, weights_at_given_zp = _nbits(4, zero_points="uint8", g_idx=True)
    _, weights_at_default_zp = _nbits(4)
    got = run(with_zp, {"A": np.eye(32, dtype=np.float32)})["Y"]
    # Not bit for bit (the g_idx kernel computes q * s - zp * s): within float32 rounding of the
    # weights at zero point 8, and nowhere near the weights at the zero points given.
    np.testing.assert_allclose(got, weights_at_default_zp, rtol=1e-6, atol=1e-6)
    assert np.abs(got - weights_at_given_zp).max() > 0.1


def test_rotary_embedding_interleaved_tail_rounds_two_ways():
    """float32 interleaved RotaryEmbedding, rotary dim 24 (one block of 16 values, 4 pairs after it):
    the block's 8 pairs and the tail's first are fused (x1·c in one rounding with the sum), the tail's
    other 3 pairs round both products: round(round(x1·c) - round(x2·s)) (docs/numerics.md)."""
    rng = np.random.default_rng(24)
    batch, seq, heads, width, positions = 2, 5, 2, 12, 8
    node = helper.make_node(
        "RotaryEmbedding", ["x", "p", "c", "s"], ["y"], domain="com.microsoft", interleaved=1, num_heads=heads
    )
    shape = [batch, seq, heads * 2 * width]
    inputs = [_vi("x", T.FLOAT, shape), _vi("p", T.INT64, [batch, seq])]
    inputs += [_vi(name, T.FLOAT, [positions, width]) for name in ("c", "s")]
    model = _model([node], inputs, [_vi("y", T.FLOAT, shape)], opset=17)
    x = rng.standard_normal(shape).astype(np.float32)
    p = rng.integers(0, positions, (batch, seq))
    angles = rng.uniform(0, 2 * np.pi, (positions, width))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    y = run(model, {"x": x, "p": p, "c": cos, "s": sin})["y"].reshape(batch, seq, heads, 2 * width)[..., 0::2]
    x1, x2 = (x.reshape(batch, seq, heads, -1)[..., first::2].astype(np.float64) for first in (0, 1))
    c, s = (v[p][:, :, None, :].astype(np.float64) for v in (cos, sin))
    r = np.float32
    fused = (x1 * c - (x2 * s).astype(r)).astype(r)
    plain = ((x1 * c).astype(r) - (x2 * s).astype(r)).astype(r)
    assert np.array_equal(y[..., :9], fused[..., :9]) and np.array_equal(y[..., 9:], plain[..., 9:])
    assert not np.array_equal(fused[..., 9:], plain[..., 9:])  # the two roundings differ on these values
