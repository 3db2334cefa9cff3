"""onnxruntime's uint8 x int8 int16 pair saturation (x86 CPUs without AVX-VNNI), measured against its
own kernels with crafted inputs, and the one policy every rule follows there
(onnx_qrewrite/rewriter/u8s8.py, rules/50-integer-matmul.toml): exact where the weights rule it out,
bounded by each column's pair excess elsewhere, checked per column by verify at the node; verify
compares the outputs with the original as onnxruntime's session.x64quantprecision runs it.

The kernel tests assert what this CPU does when it saturates; on a CPU with VNNI (or ARM) nothing
saturates, and they assert that instead, so the suite is honest on either. What depends on the
saturation beyond the kernel itself (the bounds, verify's verdicts at the node) is also asserted
against the saturating kernel emulated (``_int_matmul_helpers.on_a_saturating_cpu``, checked here
against the kernel where it is exact and against the int16-pair emulation everywhere), so both
halves run on any CPU."""

from __future__ import annotations

import contextlib
import copy
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from _int_matmul_helpers import on_a_saturating_cpu, saturating_matmul
from _verify_helpers import node_row
from conftest import assert_bitwise_equal, rule_marker, run
from onnx import TensorProto as T
from onnx import helper, numpy_helper

import onnx_qrewrite
from onnx_qrewrite.errors import EXIT_DISAGREE
from onnx_qrewrite.rewriter import provenance, u8s8
from onnx_qrewrite.verify import u8s8_reference, verify
from onnx_qrewrite.verify.bounds import bounded_rewrites
from onnx_qrewrite.verify.u8s8_reference import default_kernel_saturates, without_saturation

sys.path.insert(0, str(Path(__file__).parent))
from test_unfuse_attention import bert_feeds, tiny_bert


def _mmi(b: np.ndarray, za: int | None = None, zb: int | None = None) -> onnx.ModelProto:
    inits = [numpy_helper.from_array(b, "B")]
    names = ["A", "B", "", ""]
    if za is not None:
        inits.append(numpy_helper.from_array(np.array(za, np.uint8), "za"))
        names[2] = "za"
    if zb is not None:
        inits.append(numpy_helper.from_array(np.array(zb, np.int8), "zb"))
        names[3] = "zb"
    while names[-1] == "":
        names.pop()
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", names, ["Y"], name="mmi")],
        "g",
        [helper.make_tensor_value_info("A", T.UINT8, [None, b.shape[0]])],
        [helper.make_tensor_value_info("Y", T.INT32, [None, b.shape[1]])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _ort(model: onnx.ModelProto, feeds, *, level="disable", precision=False) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    }[level]
    if precision:
        options.add_session_config_entry("session.x64quantprecision", "1")
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def _definition(a, b, za=0, zb=0) -> np.ndarray:
    return ((a.astype(np.int64) - za) @ (b.astype(np.int64) - zb)).astype(np.int32)


#: verify's own measurement (one 1 x 2 x 1 MatMulInteger), which decides whether the saturation
#: part of a bound applies; the test below checks it stands for the kernels of real shapes.
SATURATES = default_kernel_saturates()


def test_verify_probe_stands_for_the_kernels_of_real_shapes():
    """The 1 x 2 x 1 probe says what onnxruntime's u8 x s8 kernels do at realistic shapes too
    (M 16, K 64, N 32, every pair at its worst): MatMulInteger and QLinearMatMul give the
    x64quantprecision (exact) result exactly where the probe says the kernel does not saturate."""
    b = np.full((64, 32), 127, np.int8)
    a = np.full((16, 64), 255, np.uint8)
    mmi, exact_mmi = _ort(_mmi(b), {"A": a}), _ort(_mmi(b), {"A": a}, level="extended", precision=True)
    assert np.array_equal(exact_mmi, _definition(a, b))
    assert np.array_equal(mmi, exact_mmi) is not SATURATES
    qmm, feeds = _qlinear_matmul(b), {"A": a[:4]}
    exact = _ort(qmm, feeds, level="extended", precision=True)
    assert np.array_equal(_ort(qmm, feeds), exact) is not SATURATES


# --- what the kernel does ------------------------------------------------------------------------


def test_the_kernel_pairs_adjacent_terms_along_k_of_the_raw_values():
    """Two weights of 127 times 255: 64770, beyond int16, where they form a pair (k = 2j, 2j+1);
    the zero points are applied after the pairs, exactly (zero point 255 makes the ONNX value 0)."""
    a = np.full((1, 16), 255, np.uint8)
    for (i, j), paired in (((0, 1), True), ((1, 2), False), ((2, 3), True), ((0, 2), False), ((14, 15), True)):
        b = np.zeros((16, 1), np.int8)
        b[[i, j], 0] = 127
        got = int(_ort(_mmi(b), {"A": a}).item())
        assert got == (32767 if paired and SATURATES else 64770), (i, j, got)
        # The emulation of the saturating kernel (what verify's tests run as a saturating CPU), on any CPU.
        assert int(saturating_matmul(a, b, None, None).item()) == (32767 if paired else 64770), (i, j)
        with on_a_saturating_cpu():
            assert int(_ort(_mmi(b), {"A": a}).item()) == (32767 if paired else 64770), (i, j)
    b = np.zeros((4, 1), np.int8)
    b[:2] = 127
    a = np.full((1, 4), 255, np.uint8)
    assert int(_ort(_mmi(b, za=255), {"A": a}).item()) == (32767 - 255 * 254 if SATURATES else 0)
    assert int(saturating_matmul(a, b, np.uint8(255), None).item()) == 32767 - 255 * 254
    with on_a_saturating_cpu():
        assert int(_ort(_mmi(b, za=255), {"A": a}).item()) == 32767 - 255 * 254


def test_conv_integer_pairs_along_the_flattened_channel_kernel_axis():
    """ConvInteger with int8 x and uint8 w: pairs (0, 1), (2, 3), ... of w flattened per output
    channel over (channel, kernel row, kernel column), the last of an odd K alone."""
    c, kh, kw = 3, 3, 3
    x = np.full((1, c, kh, kw), 127, np.int8)
    saturated = []
    for i, j in ((0, 1), (1, 2), (2, 3), (9, 10), (25, 26), (24, 25)):
        w = np.zeros((1, c * kh * kw), np.uint8)
        w[0, [i, j]] = 255
        graph = helper.make_graph(
            [helper.make_node("ConvInteger", ["x", "w"], ["y"])],
            "g",
            [helper.make_tensor_value_info("x", T.INT8, list(x.shape))],
            [helper.make_tensor_value_info("y", T.INT32, None)],
            [numpy_helper.from_array(w.reshape(1, c, kh, kw), "w")],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
        if int(_ort(model, {"x": x}).item()) != 127 * 510:
            saturated.append((i, j))
        # The pairs as the emulation forms them (x and w flattened per output channel), on any CPU.
        emulated = saturating_matmul(x.reshape(1, -1), w.reshape(1, -1).T, None, None).item()
        assert (emulated != 127 * 510) is ((i, j) in ((0, 1), (2, 3), (24, 25))), (i, j, emulated)
    assert saturated == ([(0, 1), (2, 3), (24, 25)] if SATURATES else [])


def test_the_pair_excess_bounds_the_kernel_and_is_reached():
    """With every activation at 255 each column differs by exactly its negative pairs' excess minus
    its positive pairs': |difference| <= the column's pair excess, with equality for one-signed
    columns. Random shapes, zero points, odd K: the bound always holds."""
    rng = np.random.default_rng(0)
    b = rng.integers(-128, 128, (9, 6)).astype(np.int8)
    b[:, 0], b[:, 1] = 127, -128
    a = np.full((2, 9), 255, np.uint8)
    got = _ort(_mmi(b), {"A": a}).astype(np.int64)
    diff = got[0] - _definition(a, b)[0]
    excess = u8s8.pair_excess(b.T, "int8")
    assert np.all(np.abs(diff) <= excess)
    # The excess is reached by the saturating kernel (emulated on any CPU; the kernel itself where it saturates).
    emulated = saturating_matmul(a, b, None, None)[0].astype(np.int64) - _definition(a, b)[0]
    assert emulated[0] == -excess[0] == -4 * 32003 and emulated[1] == excess[1] == 4 * 32512
    assert np.array_equal(diff, emulated if SATURATES else np.zeros_like(diff))
    for seed in range(20):
        rng = np.random.default_rng(seed)
        m, k, n = rng.integers(1, 9), rng.integers(1, 70), rng.integers(1, 9)
        b = rng.integers(-128, 128, (k, n)).astype(np.int8)
        a = rng.integers(0, 256, (m, k)).astype(np.uint8)
        za, zb = int(rng.integers(0, 256)), int(rng.integers(-128, 128))
        diff = _ort(_mmi(b, za, zb), {"A": a}).astype(np.int64) - _definition(a, b, za, zb)
        assert np.all(np.abs(diff) <= u8s8.pair_excess(b.T, "int8")), seed


def test_the_pair_saturation_of_given_activations_is_what_the_kernel_loses():
    """u8s8.pair_saturation, the bound for the activations at hand: the kernel's difference from the
    ONNX definition is within it (equal for one-signed saturating columns), against the int16-pair
    emulation on any CPU and against onnxruntime's kernel where it saturates; at most the worst
    case (pair_excess), and 0 where the weights cannot saturate. Odd K, batched rows, zero points."""
    for seed in range(20):
        rng = np.random.default_rng(seed)
        m, k, n = rng.integers(1, 9), rng.integers(1, 70), rng.integers(1, 9)
        b = rng.integers(-128, 128, (k, n)).astype(np.int8)
        b[:, 0] = 127  # one-signed: every pair the kernel saturates moves it the same way
        a = rng.integers(0, 256, (m, k)).astype(np.uint8)
        a[0] = 255
        za, zb = int(rng.integers(0, 256)), int(rng.integers(-128, 128))
        lost = u8s8.pair_saturation(a, b.T)
        emulated = saturating_matmul(a, b, za, zb).astype(np.int64) - _definition(a, b, za, zb)
        assert np.all(np.abs(emulated) <= lost) and np.array_equal(np.abs(emulated[:, 0]), lost[:, 0]), seed
        assert np.all(lost <= u8s8.pair_excess(b.T, "int8")), seed
        kernel = _ort(_mmi(b, za, zb), {"A": a}).astype(np.int64) - _definition(a, b, za, zb)
        assert np.array_equal(kernel, emulated if SATURATES else np.zeros_like(emulated)), seed
        if k >= 2:
            assert lost[0, 0] > 0, seed  # 255 x 127 twice leaves int16
    small = np.random.default_rng(1).integers(-64, 65, (16, 4)).astype(np.int8)
    assert not u8s8.pair_saturation(np.full((3, 16), 255, np.uint8), small.T).any()


def _ms_model(op: str, b: np.ndarray, zb: int, bias: bool) -> onnx.ModelProto:
    """com.microsoft MatMulIntegerToFloat (uint8 A, zero point 131) or DynamicQuantizeMatMul with
    constant int8 B, per-column B scales, B zero point ``zb``."""
    k, n = b.shape
    b_scale = np.linspace(0.01, 0.02, n).astype(np.float32)
    if op == "MatMulIntegerToFloat":
        values = {"B": b, "a_scale": np.float32(0.03), "b_scale": b_scale, "a_zp": np.uint8(131), "b_zp": np.int8(zb)}
    else:
        values = {"B": b, "b_scale": b_scale, "b_zp": np.int8(zb)}
    if bias:  # the input after the B zero point in both
        values["bias"] = np.linspace(-1, 1, n).astype(np.float32)
    names = list(values)
    a_type = T.UINT8 if op == "MatMulIntegerToFloat" else T.FLOAT
    graph = helper.make_graph(
        [helper.make_node(op, ["A", *names], ["Y"], name="ms", domain="com.microsoft")],
        "g",
        [helper.make_tensor_value_info("A", a_type, [2, 3, k])],
        [helper.make_tensor_value_info("Y", T.FLOAT, [2, 3, n])],
        [numpy_helper.from_array(np.asarray(v), name) for name, v in values.items()],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


@pytest.mark.parametrize("op", ["MatMulIntegerToFloat", "DynamicQuantizeMatMul"])
@pytest.mark.parametrize("k", [33, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_the_saturating_cpu_emulation_of_the_float_ops(op, k, bias):
    """tests/_int_matmul_helpers.on_a_saturating_cpu for the com.microsoft float-output ops, on any
    CPU: with weights whose pairs stay within int16 it is onnxruntime's kernel (to float32 rounding:
    the same zero points, scales and bias, in the same places); with full-range weights it moves
    each column by the saturating integer product's difference times the scale product."""
    rng = np.random.default_rng(k + bias)
    calm = rng.integers(-64, 65, (k, 5)).astype(np.int8)
    a = rng.integers(0, 256, (2, 3, k)).astype(np.uint8) if op == "MatMulIntegerToFloat" else None
    feeds = {"A": a if a is not None else rng.uniform(-2, 6, (2, 3, k)).astype(np.float32)}
    model = _ms_model(op, calm, -7, bias)
    want = _ort(model, feeds)
    with on_a_saturating_cpu():
        got = _ort(model, feeds)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    full = calm.copy()
    full[0:2, 1] = 127  # column 1: its first pair leaves int16 where A is 255 there
    full = _ms_model(op, full, -7, bias)
    feeds["A"][..., 0:2] = 255 if op == "MatMulIntegerToFloat" else 6.0
    exact = _ort(without_saturation(full)[0], feeds)  # this CPU's kernel may saturate itself
    with on_a_saturating_cpu():
        saturated = _ort(full, feeds)
    moved = np.abs(saturated - exact)
    assert np.all(moved[..., [0, 2, 3, 4]] <= 1e-5 * np.abs(exact).max()), moved
    a_scale = 0.03 if op == "MatMulIntegerToFloat" else 8.0 / 255  # DynamicQuantizeLinear of [-2, 6]
    steps = (255 * 127 * 2 - 32767) * a_scale * 0.01 * 1.25  # the pair's excess times column 1's scales
    assert np.all(moved[..., 1] >= 0.99 * steps), (moved[..., 1], steps)
    assert np.array_equal(exact, saturated) is False


def test_x64quantprecision_gives_the_onnx_definition_and_so_does_verifys_reference():
    """onnxruntime's session.x64quantprecision (optimisation level 2+) and verify's reference form of
    the original (the same weight conversion, at level disable) both compute the ONNX definition."""
    rng = np.random.default_rng(1)
    b = rng.integers(-128, 128, (40, 7)).astype(np.int8)
    a = rng.integers(0, 256, (5, 40)).astype(np.uint8)
    for za, zb in ((None, None), (17, -3)):
        model = _mmi(b, za, zb)
        spec = _definition(a, b, za or 0, zb or 0)
        assert_bitwise_equal(_ort(model, {"A": a}, level="extended", precision=True), spec)
        reference, changed = without_saturation(model)
        assert changed == 1
        assert_bitwise_equal(_ort(reference, {"A": a}), spec)
        assert np.array_equal(_ort(model, {"A": a}), spec) is not SATURATES
    calm = np.clip(b, -64, 64).astype(np.int8)  # onnxruntime converts nothing within [-64, 64]
    assert without_saturation(_mmi(calm))[1] == 0


# --- the policy on quantize_dynamic's default BERT ----------------------------------------------


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> dict[str, Path]:
    """tests/test_unfuse_attention.py's tiny BERT quantized by quantize_dynamic with its defaults
    (int8 weights, per tensor), and the same fused by onnxruntime's optimizer."""
    from onnxruntime.quantization import quantize_dynamic

    folder = tmp_path_factory.mktemp("bert")
    onnx.save(tiny_bert(), folder / "float.onnx")
    quantize_dynamic(folder / "float.onnx", folder / "dynamic.onnx")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(folder / "fused.onnx")
    ort.InferenceSession(str(folder / "dynamic.onnx"), options, providers=["CPUExecutionProvider"])
    return {"dynamic": folder / "dynamic.onnx", "fused": folder / "fused.onnx"}


def _replacement(model: onnx.ModelProto, origin: str) -> list[onnx.NodeProto]:
    """The nodes that replaced the node named ``origin`` (by provenance, the first carries it)."""
    nodes = list(model.graph.node)
    owners = provenance.attribute_nodes(nodes)
    return [n for n, owner in zip(nodes, owners, strict=True) if owner is not None and owner[1] == origin]


def _drop_a_zero_point(rewritten: onnx.ModelProto, origin: str) -> onnx.ModelProto:
    """In one replacement, what read Sub(Cast(A), Cast(a_zp)) reads Cast(A): A's zero point dropped."""
    broken = copy.deepcopy(rewritten)
    nodes = _replacement(broken, origin)
    sub = next(n for n in nodes if n.op_type == "Sub")
    for node in broken.graph.node:
        for i, name in enumerate(node.input):
            if name == sub.output[0]:
                node.input[i] = sub.input[0]
    return broken


def _scale_one_ulp_off(rewritten: onnx.ModelProto, origin: str) -> onnx.ModelProto:
    """In one replacement, the weights' scale one ulp larger in the scale product."""
    broken = copy.deepcopy(rewritten)
    mul = next(n for n in _replacement(broken, origin) if "ScaleProduct" in n.output[0])
    scale = numpy_helper.to_array(next(t for t in broken.graph.initializer if t.name == mul.input[1]))
    bumped = np.nextafter(scale, np.float32(np.inf)).astype(np.float32)
    broken.graph.initializer.append(numpy_helper.from_array(bumped, "broken_scale"))
    mul.input[1] = "broken_scale"
    return broken


@rule_marker("int-matmul-float-bounded", "positive")
@rule_marker("int-matmul-float", "negative")
@pytest.mark.parametrize("cpu", ["this", "saturating"])
def test_the_default_quantize_dynamic_bert_rewrites_by_default_and_verifies(bert, cpu):
    """The rewrite is the same on every CPU (every weight of the tiny BERT has pairs that can leave
    int16: the bounded rule everywhere). verify checks each node against the kernel it runs: on a
    saturating CPU (this one, or emulated: ``cpu="saturating"``) it differs within each column's
    excess and a dropped zero point breaks it; elsewhere it is the definition, exactly."""
    result = onnx_qrewrite.rewrite(bert["dynamic"])
    assert {n.domain for n in result.model.graph.node} == {""}
    assert result.report.by_rule() == {"dql-expand": 8, "int-matmul-float-bounded": 12}
    feeds = bert_feeds()
    with on_a_saturating_cpu() if cpu == "saturating" else contextlib.nullcontext():
        report = verify(bert["dynamic"], result.model, inputs=feeds)
        broken = verify(bert["dynamic"], _drop_a_zero_point(result.model, "l0.o.mm_quant"), inputs=feeds)
    assert report.passed, report.to_table()
    assert report.settings.u8s8_reference_nodes == 12
    row = node_row(report, "l0.o.mm_quant")
    assert "per element (u8s8-pairs)" in row.tolerance_text
    if cpu == "saturating" or SATURATES:
        # The default kernel differs at the node, within each column's excess.
        assert 0 < row.max_abs_error <= row.tolerance.lsb and row.exact_match_rate < 1, report.to_table()
    else:
        assert row.max_abs_error == 0 and row.tolerance.lsb == 0, report.to_table()
    assert broken.exit_code == EXIT_DISAGREE
    bad = node_row(broken, "l0.o.mm_quant")
    assert not bad.passed and bad.max_abs_error > row.tolerance.lsb, broken.to_table()


@rule_marker("ms-int-matmul-float-bounded", "positive")
@pytest.mark.parametrize("cpu", ["this", "saturating"])
def test_the_fused_default_bert_rewrites_by_default_and_a_scale_one_ulp_off_is_caught(bert, cpu):
    result = onnx_qrewrite.rewrite(bert["fused"])
    assert {n.domain for n in result.model.graph.node} == {""}
    assert result.report.by_rule()["ms-int-matmul-float-bounded"] == 12  # on every CPU
    feeds = bert_feeds()
    origin = "l0.o.mm_quant"
    with on_a_saturating_cpu() if cpu == "saturating" else contextlib.nullcontext():
        report = verify(bert["fused"], result.model, inputs=feeds)
        broken = verify(bert["fused"], _scale_one_ulp_off(result.model, origin), inputs=feeds)
    assert report.passed, report.to_table()
    good = node_row(report, origin)
    assert (good.max_abs_error > 0) is (cpu == "saturating" or SATURATES), report.to_table()
    assert broken.exit_code == EXIT_DISAGREE
    bad = node_row(broken, origin)
    # Columns without a pair excess are bit-exact: one ulp of a scale shows there.
    assert good.passed and not bad.passed and bad.mismatches > 0, broken.to_table()


@rule_marker("ms-int-matmul-float-bounded", "negative")
def test_the_bounded_fused_rule_leaves_unsaturable_weights_to_the_exact_one():
    rng = np.random.default_rng(2)
    b = rng.integers(-64, 65, (16, 4)).astype(np.int8)
    inits = [numpy_helper.from_array(b, "B"), numpy_helper.from_array(np.array(0.01, np.float32), "bs")]
    graph = helper.make_graph(
        [helper.make_node("DynamicQuantizeMatMul", ["A", "B", "bs"], ["Y"], domain="com.microsoft", name="dqm")],
        "g",
        [helper.make_tensor_value_info("A", T.FLOAT, [3, 16])],
        [helper.make_tensor_value_info("Y", T.FLOAT, [3, 4])],
        inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)], ir_version=8
    )
    assert onnx_qrewrite.rewrite(model).report.by_rule() == {"ms-int-matmul-float": 1}
    with pytest.raises(onnx_qrewrite.LoweringError, match="no pair of products can saturate here"):
        onnx_qrewrite.rewrite(model, only=["ms-int-matmul-float-bounded"])


# --- QLinearMatMul: the same policy, in quantization steps ---------------------------------------


def _qlinear_matmul(b: np.ndarray) -> onnx.ModelProto:
    values = {
        "a_scale": np.float32(0.02),
        "a_zp": np.uint8(120),
        "B": b,
        "b_scale": np.float32(0.01),
        "b_zp": np.int8(10),
        "y_scale": np.float32(0.2),
        "y_zp": np.uint8(128),
    }
    graph = helper.make_graph(
        [helper.make_node("QLinearMatMul", ["A", *values], ["Y"], name="qmm")],
        "g",
        [helper.make_tensor_value_info("A", T.UINT8, [4, b.shape[0]])],
        [helper.make_tensor_value_info("Y", T.UINT8, [4, b.shape[1]])],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in values.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("cpu", ["this", "saturating"])
def test_qlinear_matmul_saturating_pairs_are_bounded_and_a_dropped_zero_point_is_caught(cpu):
    """One column whose first pair can leave int16 (127 + 127): the bounded rule adds its excess
    (32003 * a_scale * b_scale / y_scale = 32 steps) to the bound; verify checks it at the node
    against the default kernel, and a dropped activation zero point (137 steps off) breaks it. A
    dropped weight zero point moves this node by 13 steps: where the kernel does not saturate (CPUs
    with AVX-VNNI), verify leaves the 32 saturation steps out of the bound (1 step) and catches that
    too; where verify is only told so (``cpu="saturating"`` on such a CPU), it is within the bound;
    where the kernel really saturates, the 13 steps add to the saturation's and it is caught."""
    rng = np.random.default_rng(3)
    b = rng.integers(-40, 41, (64, 8)).astype(np.int8)
    b[0:2, 3] = 127
    model = _qlinear_matmul(b)
    result = onnx_qrewrite.rewrite(model)
    (applied,) = result.report.rewrites
    assert applied.rule == "qop-matmul" and applied.bound == 33.0, applied
    # 32 of the 33 steps are the saturation's: verify leaves them out where the kernel does not saturate.
    (recorded,) = bounded_rewrites(model, result.model)
    assert recorded.u8s8 == 32.0 and recorded.without_u8s8().bound == 1.0
    a = rng.integers(0, 256, (4, 64)).astype(np.uint8)
    a[:, :2] = 255  # the saturating pair at its worst
    got = run(result.model, {"A": a})["Y"].astype(np.int64)
    want = run(model, {"A": a})["Y"].astype(np.int64)
    assert np.abs(got - want).max() <= applied.bound
    # The saturating kernel's integer product moves the column by 30 steps or more (emulated, any
    # CPU): the 32 steps are needed there. This CPU's kernel does so where it saturates.
    lost = saturating_matmul(a, b, np.uint8(120), np.int8(10)).astype(np.int64) - _definition(a, b, 120, 10)
    assert np.abs(lost[:, 3] * (0.02 * 0.01 / 0.2)).min() >= 30
    assert bool(np.abs(got - want)[:, 3].min() >= 30) is SATURATES
    saturating = cpu == "saturating" or SATURATES
    told = mock.patch.object(u8s8_reference, "default_kernel_saturates", lambda: True)
    with told if cpu == "saturating" else contextlib.nullcontext():
        report = verify(model, result.model, inputs={"A": a})
        assert report.passed and report.settings.u8s8_reference_nodes == 1, report.to_table()
        row = node_row(report, "qmm")
        assert ("+32 where the u8 x s8 kernel saturates" in row.name) is not saturating, row.name
        assert row.tolerance.lsb == (33 if saturating else 1), row.tolerance
        dqs = [n for n in result.model.graph.node if n.op_type == "DequantizeLinear"]
        activation = next(i for i, n in enumerate(dqs) if n.input[0] == "A")
        weights = next(i for i in range(len(dqs)) if i != activation)
        # The dropped weight zero point's 13 steps hide in the 32 saturation steps only where verify
        # is told the kernel saturates and it does not; where this CPU's kernel does saturate, they
        # add to its 30 or more (same direction here) and leave the bound.
        for index, caught in ((activation, True), (weights, SATURATES or not saturating)):
            broken = copy.deepcopy(result.model)
            del [n for n in broken.graph.node if n.op_type == "DequantizeLinear"][index].input[2]
            report = verify(model, broken, inputs={"A": a})
            assert node_row(report, "qmm").passed is not caught, report.to_table()


def test_a_saturating_node_the_rewrite_kept_runs_the_same_way_on_both_sides():
    """verify runs such nodes as x64quantprecision does on both sides: a model compared with an
    unchanged copy of itself agrees whatever the CPU."""
    b = np.full((8, 3), 127, np.int8)
    model = _mmi(b)
    report = verify(model, copy.deepcopy(model), inputs={"A": np.full((2, 8), 255, np.uint8)})
    assert report.passed and report.settings.u8s8_reference_nodes == 1, report.to_table()
    assert "session.x64quantprecision" in report.to_table()
