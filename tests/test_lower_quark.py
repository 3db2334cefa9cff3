"""AMD Quark's Extended/Vitis quantize and dequantize ops -> standard ONNX, bit for bit.

The evidence is the 96 cases in tests/data/quark_vectors, computed by Quark's real CPU kernels: each one
is lowered as a one-node model under both names of the op (com.amd.quark Extended*, com.vai.quantize
Vitis*) and run in stock onnxruntime. NUMERICS.md's traps each have a case: the missing axis means
0, int32 dequantize subtracts in int64, float->int Cast does not saturate, float16 ignores scale and
zero point, and the x86 kernel's overflow behaviour (int64 "integer indefinite").
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import onnx
import pytest
from conftest import QUARK_VECTORS, assert_bitwise_equal, op_types, rule_marker, run
from onnx import TensorProto, helper, numpy_helper

import onnx_qrewrite

CASES = json.loads((QUARK_VECTORS / "quark_kernel_vectors.json").read_text())["cases"]
ALIASES = {"com.amd.quark": "Extended", "com.vai.quantize": "Vitis"}
BITS = {"uint8": 8, "int8": 8, "uint16": 16, "int16": 16, "uint32": 32, "int32": 32}
F16_KERNEL = {"quark-q-float16": {"float16_semantics": "kernel"}, "quark-dq-float16": {"float16_semantics": "kernel"}}


@pytest.fixture(scope="module")
def vectors():
    with np.load(QUARK_VECTORS / "quark_kernel_vectors.npz") as data:
        arrays = {k: data[k] for k in data.files}
    out = {}
    for case in CASES:
        k, dtype = case["key"], case["dtype"]
        quantize = case["op"] == "ExtendedQuantizeLinear"
        get = {n: arrays[f"{k}_{n}"] for n in ("x", "scale", "zero_point", "y")}
        if dtype == "bfloat16":  # stored as uint16 bit patterns
            get["zero_point"] = get["zero_point"].view(ml_dtypes.bfloat16)
            if not quantize:
                get["x"] = get["x"].view(ml_dtypes.bfloat16)
        out[k] = get
    return out


def quark_model(case: dict, v: dict, *, domain: str = "com.amd.quark", opset: int = 17) -> onnx.ModelProto:
    """One vendor node, x an input (an initializer for bfloat16 x, which onnxruntime's Python API
    cannot feed), scale and zero point initializers. A bfloat16 result is cast to float32 (exact)
    because onnxruntime cannot return bfloat16 to numpy."""
    quantize = case["op"] == "ExtendedQuantizeLinear"
    op = ALIASES[domain] + ("QuantizeLinear" if quantize else "DequantizeLinear")
    attrs = {} if case["axis"] is None else {"axis": case["axis"]}
    x, y = v["x"], v["y"]
    bf16_out = quantize and case["dtype"] == "bfloat16"
    nodes = [helper.make_node(op, ["x", "scale", "zp"], ["q" if bf16_out else "y"], name="n", domain=domain, **attrs)]
    inits = [numpy_helper.from_array(v["scale"], "scale"), numpy_helper.from_array(v["zero_point"], "zp")]
    inputs = [helper.make_tensor_value_info("x", helper.np_dtype_to_tensor_dtype(x.dtype), x.shape)]
    if x.dtype == ml_dtypes.bfloat16:
        inits.append(numpy_helper.from_array(x, "x"))
        inputs = []
    out_type = TensorProto.FLOAT if bf16_out or not quantize else helper.np_dtype_to_tensor_dtype(y.dtype)
    if bf16_out:
        nodes.append(helper.make_node("Cast", ["q"], ["y"], to=TensorProto.FLOAT))
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", out_type, y.shape)], inits)
    return helper.make_model(
        graph, ir_version=8, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(domain, 1)]
    )


def expected_y(case: dict, v: dict) -> np.ndarray:
    if case["op"] == "ExtendedQuantizeLinear" and case["dtype"] == "bfloat16":
        return (v["y"].astype(np.uint32) << 16).view(np.float32)  # bf16 -> f32 is exact
    return v["y"]


def broadcast(case: dict, v: dict, a: np.ndarray) -> np.ndarray:
    if a.size == 1:
        return a.reshape(())
    axis = (case["axis"] if case["axis"] is not None else 0) % v["x"].ndim
    return a.reshape([-1] + [1] * (v["x"].ndim - 1 - axis))


def overflows(case: dict, v: dict) -> np.ndarray:
    """Where x / scale (rounded, in float32) is NaN, infinite or >= 2^63 in magnitude: the x86
    kernel's float->int64 conversion gives INT64_MIN there."""
    with np.errstate(all="ignore"):
        q = np.round((v["x"] / broadcast(case, v, v["scale"])).astype(np.float32))
    return ~(np.abs(q) < np.float32(2.0**63))


def expected_ops(case: dict, v: dict, variant: str) -> list[str]:
    """The exact op list of each lowering (NUMERICS.md's decompositions); zero points that are
    constant zeros need no Add/Sub."""
    dtype, quantize = case["dtype"], case["op"] == "ExtendedQuantizeLinear"
    zp = bool(np.any(np.asarray(v["zero_point"], np.float64) != 0))
    if dtype == "float16":
        return ["Clip", "Cast"] if quantize else ["Cast"]
    if dtype == "bfloat16":
        return (
            ["Div", "Cast", "Add", "Cast", "Cast"]
            if quantize
            else (["Cast", "Cast", "Sub", "Mul"] if zp else ["Cast", "Mul"])
        )
    bits = BITS[dtype]
    standard = bits == 8 or (bits == 16 and variant != "keep-opset") or (dtype == "int32" and not quantize and not zp)
    if quantize and variant == "exact":
        standard = False
    if standard:
        return ["QuantizeLinear" if quantize else "DequantizeLinear"]
    if quantize:
        wide = ["Cast"] if bits == 32 else []
        return ["Div", "Round", *wide, *(["Cast", "Add"] if zp else []), "Clip", "Abs", "Less", "Where", "Cast"]
    if not zp:
        return ["Cast", "Mul"]
    return ["Cast", "Cast", "Sub", *(["Cast"] if bits == 32 else []), "Mul"]


VARIANTS = {
    # Default rules: QuantizeLinear/DequantizeLinear where a kernel exists, the opset raised to 21
    # for 16-bit types.
    "default": {},
    # Model opset kept at 17: 16-bit types use the exact decompositions.
    "keep-opset": {"keep_opset": True},
    # Every integer quantize through the decomposition, which also reproduces the x86 kernel's
    # overflow behaviour.
    "exact": {"skip": ["quark-q-standard"]},
}


@rule_marker("quark-q-standard", "positive")
@rule_marker("quark-dq-standard", "positive")
@rule_marker("quark-q-int-decompose", "positive")
@rule_marker("quark-dq-int-decompose", "positive")
@rule_marker("quark-q-bfloat16", "positive")
@rule_marker("quark-dq-bfloat16", "positive")
@rule_marker("quark-q-float16", "positive")
@rule_marker("quark-dq-float16", "positive")
@pytest.mark.parametrize("domain", sorted(ALIASES))
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_all_96_kernel_vectors_reproduce_bit_for_bit(vectors, domain, variant):
    differing: dict[str, int] = {}
    for case in CASES:
        v = vectors[case["key"]]
        what = f"{case['key']} {case['op']} {case['dtype']} axis={case['axis']} ({case['granularity']}), {variant}"
        model = quark_model(case, v, domain=domain)
        result = onnx_qrewrite.rewrite(model, options=F16_KERNEL, **VARIANTS[variant])
        rewritten = result.model
        assert op_types(rewritten) == expected_ops(case, v, variant), what
        assert domain not in {o.domain for o in rewritten.opset_import}, what
        node = rewritten.graph.node[0]
        wants_21 = BITS.get(case["dtype"]) == 16 and node.op_type in ("QuantizeLinear", "DequantizeLinear")
        assert rewritten.opset_import[0].version == (21 if wants_21 else 17), what
        if node.op_type in ("QuantizeLinear", "DequantizeLinear") and v["scale"].size > 1:
            # The kernel's axis, written out: a missing attribute means 0, not the standard 1.
            axis = {a.name: a.i for a in node.attribute}["axis"]
            assert axis == (case["axis"] if case["axis"] is not None else 0), what
        feeds = {"x": v["x"]} if rewritten.graph.input else {}
        got = run(rewritten, feeds)["y"]
        want = expected_y(case, v)
        if node.op_type == "QuantizeLinear":
            # QuantizeLinear saturates where the x86 kernel's int64 conversion overflows.
            mask = overflows(case, v)
            differing[case["key"]] = int(np.count_nonzero(got != want))
            assert_bitwise_equal(got[~mask], want[~mask], what)
            lo, hi = np.iinfo(want.dtype).min, np.iinfo(want.dtype).max
            with np.errstate(all="ignore"):
                q = np.round((v["x"] / broadcast(case, v, v["scale"])).astype(np.float32))
                zp = broadcast(case, v, v["zero_point"]).astype(np.float64)
                saturated = np.where(np.isnan(q), lo, np.clip(q.astype(np.float64) + zp, lo, hi)).astype(want.dtype)
            assert_bitwise_equal(got[mask], np.broadcast_to(saturated, want.shape)[mask], what)
        else:
            assert_bitwise_equal(got, want, what)
    # Where standard QuantizeLinear is used it differs from the x86 kernel in exactly one element
    # of each per-tensor case (x = +-3.3e38: x / scale overflows); everywhere else all 96 agree.
    expected_differing = {
        c["key"]: 1
        for c in CASES
        if c["op"] == "ExtendedQuantizeLinear"
        and c["granularity"] == "per-tensor"
        and (BITS.get(c["dtype"]) == 8 or (BITS.get(c["dtype"]) == 16 and variant != "keep-opset"))
    }
    assert {k: n for k, n in differing.items() if n} == (expected_differing if variant != "exact" else {})


@rule_marker("quark-dq-standard", "negative")
@rule_marker("quark-dq-int-decompose", "positive")
def test_int32_dequantize_with_a_nonzero_zero_point_is_decomposed(vectors):
    # DequantizeLinear subtracts in int32 and wraps: x = -2^31, zp = 3 gives +7.9e7, the kernel -7.9e7.
    case = next(c for c in CASES if c["key"] == "c069")
    result = onnx_qrewrite.rewrite(quark_model(case, vectors["c069"]))
    assert op_types(result.model) == ["Cast", "Cast", "Sub", "Cast", "Mul"]
    assert result.report.by_rule() == {"quark-dq-int-decompose": 1}
    assert_bitwise_equal(run(result.model, {"x": vectors["c069"]["x"]})["y"], vectors["c069"]["y"], "c069")
    with pytest.raises(onnx_qrewrite.LoweringError, match=r"quark-dq-standard: zero point 'zp' is not a constant 0"):
        onnx_qrewrite.rewrite(quark_model(case, vectors["c069"]), only=["quark-dq-standard"])


# -- models written as text ----------------------------------------------------------------------


def parse(text: str, *, check: bool = True) -> onnx.ModelProto:
    """A model from ONNX text; vendor nodes are named n, n2, ... (the text format has no node names)."""
    model = onnx.parser.parse_model(text)
    vendor = [n for n in model.graph.node if n.domain]
    for i, node in enumerate(vendor):
        node.name = "n" if i == 0 else f"n{i + 1}"
    if check:
        onnx.checker.check_model(model)
    return model


HEADER = '<ir_version: 8, opset_import: ["" : {opset}, "com.amd.quark" : 1, "ai.onnx.ml" : 5]>'

INT16_Q = (
    HEADER
    + """
g (float[2, 3] x) => (int16[2, 3] y) <float s = {{0.05}}, int16 zp = {{-3}}> {{
    y = com.amd.quark.ExtendedQuantizeLinear (x, s, zp)
}}"""
)

X23 = np.array([[-1e9, -1.3, -0.025], [0.075, 2.5, 1e9]], np.float32)


def test_int16_raises_the_opset_and_drops_only_the_quark_import():
    result = onnx_qrewrite.rewrite(parse(INT16_Q.format(opset=17)))
    assert op_types(result.model) == ["QuantizeLinear"]
    assert {o.domain: o.version for o in result.model.opset_import} == {"": 21, "ai.onnx.ml": 5}
    changes = [(c.domain, c.before, c.after) for c in result.report.opset_changes]
    assert changes == [("", 17, 21), ("com.amd.quark", 1, None)]
    assert "quark-q-standard" in result.report.opset_changes[0].why
    got = run(result.model, {"x": X23})["y"]
    np.testing.assert_array_equal(got, np.array([[-32768, -29, -3], [-1, 47, 32767]], np.int16))


@rule_marker("quark-q-standard", "negative")
def test_keep_opset_makes_the_standard_rule_give_way_to_the_decomposition():
    result = onnx_qrewrite.rewrite(parse(INT16_Q.format(opset=17)), keep_opset=True)
    assert op_types(result.model) == ["Div", "Round", "Cast", "Add", "Clip", "Abs", "Less", "Where", "Cast"]
    assert result.model.opset_import[0].version == 17 and not [c for c in result.report.opset_changes if c.domain == ""]
    got = run(result.model, {"x": X23})["y"]
    np.testing.assert_array_equal(got, np.array([[-32768, -29, -3], [-1, 47, 32767]], np.int16))
    with pytest.raises(
        onnx_qrewrite.LoweringError, match=r"quark-q-standard: needs opset 21, model has 17 and the opset is kept"
    ):
        onnx_qrewrite.rewrite(parse(INT16_Q.format(opset=17)), keep_opset=True, only=["quark-q-standard"])


def test_target_opset_chooses_the_opset():
    result = onnx_qrewrite.rewrite(parse(INT16_Q.format(opset=17)), target_opset=23)
    assert result.model.opset_import[0].version == 23 and op_types(result.model) == ["QuantizeLinear"]


def test_an_opset_that_cannot_be_raised_is_an_error_naming_the_node():
    # onnx's version converter does not convert local functions: the raise fails, nothing is guessed.
    model = parse(INT16_Q.format(opset=17))
    model.functions.append(
        onnx.parser.parse_function('<domain: "local", opset_import: ["" : 17]> f (a) => (b) { b = Identity(a) }')
    )
    model.opset_import.append(helper.make_opsetid("local", 1))
    with pytest.raises(
        onnx_qrewrite.LoweringError,
        match=r"cannot raise the opset from 17 to 21 \(rule quark-q-standard on n\).*local functions.*--keep-opset",
    ) as exc:
        onnx_qrewrite.rewrite(model)
    assert exc.value.exit_code == 4
    assert op_types(onnx_qrewrite.rewrite(model, keep_opset=True).model)[0] == "Div"


def test_per_axis_without_axis_attribute_means_axis_0():
    model = parse(
        HEADER.format(opset=13)
        + """
    g (float[2, 3] x) => (uint8[2, 3] y) <float[2] s = {0.5, 0.25}, uint8[2] zp = {1, 200}> {
        y = com.amd.quark.ExtendedQuantizeLinear (x, s, zp)
    }"""
    )
    result = onnx_qrewrite.rewrite(model)
    (node,) = result.model.graph.node
    assert node.op_type == "QuantizeLinear" and helper.get_node_attr_value(node, "axis") == 0
    x = np.array([[1.0, -1.0, 2.0], [1.0, -1.0, 40.0]], np.float32)
    np.testing.assert_array_equal(run(result.model, {"x": x})["y"], np.array([[3, 0, 5], [204, 196, 255]], np.uint8))
    assert "per-axis, axis=0 (Quark kernel default)" in result.report.rewrites[0].notes


def test_scale_and_zero_point_from_constant_nodes_and_runtime_tensors():
    # Quark's own converter crashes on Constant zero points; scales computed at run time are valid too.
    model = parse(
        HEADER.format(opset=21)
        + """
    g (float[4, 3] x, float[3] s_in) => (float[4, 3] y) {
        zp = Constant <value = int16[3] {0, -7, 9}> ()
        s = Mul (s_in, s_in)
        q = com.amd.quark.ExtendedQuantizeLinear <axis = 1> (x, s, zp)
        y = com.amd.quark.ExtendedDequantizeLinear <axis = 1> (q, s, zp)
    }"""
    )
    model.graph.value_info.extend(
        [
            helper.make_tensor_value_info("s", TensorProto.FLOAT, [3]),
            helper.make_tensor_value_info("q", TensorProto.INT16, [4, 3]),
        ]
    )
    result = onnx_qrewrite.rewrite(model)
    assert op_types(result.model) == ["Constant", "Mul", "QuantizeLinear", "DequantizeLinear"]
    x = np.linspace(-900, 900, 12, dtype=np.float32).reshape(4, 3)
    s_in = np.array([0.1, 0.2, 0.3], np.float32)
    s = s_in * s_in
    q = np.clip(np.round(x / s) + np.array([0, -7, 9]), -32768, 32767)
    want = ((q - np.array([0, -7, 9])).astype(np.float32) * s).astype(np.float32)
    assert_bitwise_equal(run(result.model, {"x": x, "s_in": s_in})["y"], want, "runtime scale")
    # Kept at opset 17 the same graph decomposes, with the runtime scale reshaped along axis 1.
    model.opset_import[0].version = 17
    kept = onnx_qrewrite.rewrite(model, keep_opset=True)
    assert "Reshape" in op_types(kept.model)
    assert_bitwise_equal(run(kept.model, {"x": x, "s_in": s_in})["y"], want, "runtime scale, opset 17")


def test_runtime_scale_of_unknown_shape_lets_the_standard_op_decide_at_run_time():
    model = parse(
        HEADER.format(opset=13)
        + """
    g (float[2, 3] x, float[N] s, uint8[N] zp) => (uint8[2, 3] y) {
        y = com.amd.quark.ExtendedQuantizeLinear (x, s, zp)
    }"""
    )
    result = onnx_qrewrite.rewrite(model)  # s has a symbolic length: one element or two
    assert op_types(result.model) == ["QuantizeLinear"]
    x = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], np.float32)
    # One element: per-tensor; two: per-axis along the kernel's default axis 0.
    one = {"x": x, "s": np.array([0.5], np.float32), "zp": np.array([3], np.uint8)}
    two = {"x": x, "s": np.array([1.0, 0.5], np.float32), "zp": np.array([3, 3], np.uint8)}
    np.testing.assert_array_equal(run(result.model, one)["y"], np.array([[5, 7, 9], [11, 13, 15]], np.uint8))
    np.testing.assert_array_equal(run(result.model, two)["y"], np.array([[4, 5, 6], [11, 13, 15]], np.uint8))


# -- float16: the kernel and the documentation disagree -----------------------------------------


def fp16_model(scale: float, zp: float, *, runtime_scale: bool = False, quantize: bool = True) -> onnx.ModelProto:
    """ONNX text cannot write float16 literals: built with helper."""
    op = "ExtendedQuantizeLinear" if quantize else "ExtendedDequantizeLinear"
    x_type, y_type = (TensorProto.FLOAT, TensorProto.FLOAT16) if quantize else (TensorProto.FLOAT16, TensorProto.FLOAT)
    inputs = [helper.make_tensor_value_info("x", x_type, [5])]
    inits = [numpy_helper.from_array(np.array(zp, np.float16), "zp")]
    if runtime_scale:
        inputs.append(helper.make_tensor_value_info("s", TensorProto.FLOAT, []))
    else:
        inits.append(numpy_helper.from_array(np.array(scale, np.float32), "s"))
    graph = helper.make_graph(
        [helper.make_node(op, ["x", "s", "zp"], ["y"], name="n", domain="com.amd.quark")],
        "g",
        inputs,
        [helper.make_tensor_value_info("y", y_type, [5])],
        inits,
    )
    return helper.make_model(
        graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.amd.quark", 1)]
    )


X5 = np.array([1.0, -70000.0, 3.3e38, 0.1, -2.5], np.float32)


def test_float16_with_scale_1_and_zero_point_0_is_a_clip_and_cast():
    result = onnx_qrewrite.rewrite(fp16_model(1.0, 0.0))
    assert op_types(result.model) == ["Clip", "Cast"]
    want = np.clip(X5, -65504, 65504).astype(np.float16)
    assert_bitwise_equal(run(result.model, {"x": X5})["y"], want, "float16")


@rule_marker("quark-q-float16", "negative")
def test_float16_with_another_scale_stops_and_explains():
    model = fp16_model(0.5, 2.0)
    with pytest.raises(onnx_qrewrite.LoweringError) as exc:
        onnx_qrewrite.rewrite(model)
    message = str(exc.value)
    assert "node n (com.amd.quark::ExtendedQuantizeLinear) cannot be lowered" in message
    assert "scale is [0.5], not 1 and zero point is [2.0], not 0" in message
    assert "kernel ignores scale and zero point" in message and "--float16-semantics" in message
    assert exc.value.exit_code == 4


def test_float16_semantics_kernel_or_documented_when_chosen():
    model = fp16_model(0.5, 2.0)
    kernel = onnx_qrewrite.rewrite(model, options=F16_KERNEL)
    assert op_types(kernel.model) == ["Clip", "Cast"]
    assert_bitwise_equal(run(kernel.model, {"x": X5})["y"], np.clip(X5, -65504, 65504).astype(np.float16), "kernel")
    documented = onnx_qrewrite.rewrite(model, options={"quark-q-float16": {"float16_semantics": "documented"}})
    assert op_types(documented.model) == ["Div", "Cast", "Add", "Clip", "Cast"]
    with np.errstate(over="ignore"):
        want = np.clip(X5 / np.float32(0.5) + np.float32(2.0), -65504, 65504).astype(np.float16)
    assert_bitwise_equal(run(documented.model, {"x": X5})["y"], want, "documented")


@rule_marker("quark-dq-float16", "negative")
def test_float16_dequantize_with_a_runtime_scale_is_not_guessed():
    model = fp16_model(1.0, 0.0, runtime_scale=True, quantize=False)
    with pytest.raises(
        onnx_qrewrite.LoweringError, match=r"quark-dq-float16: float16 with scale 's' is computed at run time"
    ):
        onnx_qrewrite.rewrite(model)
    documented = onnx_qrewrite.rewrite(model, options={"quark-dq-float16": {"float16_semantics": "documented"}})
    assert op_types(documented.model) == ["Cast", "Mul"]  # zero point +0: no Sub needed
    x = np.array([1.5, -2.0, 65504, -0.0, np.inf], np.float16)
    assert_bitwise_equal(
        run(documented.model, {"x": x, "s": np.array(0.25, np.float32)})["y"],
        x.astype(np.float32) * np.float32(0.25),
        "documented",
    )


# -- what cannot be lowered ----------------------------------------------------------------------


@rule_marker("quark-q-int-decompose", "negative")
@rule_marker("quark-q-bfloat16", "negative")
def test_int64_zero_point_is_an_error_naming_the_node_and_every_rule():
    model = parse(
        HEADER.format(opset=21)
        + """
    g (float[3] x) => (int64[3] y) <float s = {0.5}, int64 zp = {0}> {
        y = com.amd.quark.ExtendedQuantizeLinear (x, s, zp)
    }"""
    )
    with pytest.raises(onnx_qrewrite.LoweringError) as exc:
        onnx_qrewrite.rewrite(model)
    message = str(exc.value)
    assert message.startswith("node n (com.amd.quark::ExtendedQuantizeLinear) cannot be lowered:")
    for rule in ("quark-q-standard", "quark-q-int-decompose", "quark-q-bfloat16", "quark-q-float16"):
        assert f"{rule}: dtype int64 is not one of" in message
    kept = onnx_qrewrite.rewrite(model, allow_unlowered=True)
    assert op_types(kept.model) == ["ExtendedQuantizeLinear"]
    assert [u.node for u in kept.report.unlowered] == ["n"]
    assert kept.report.warnings and "left n (ExtendedQuantizeLinear) in place" in kept.report.warnings[0]
    assert "com.amd.quark" in {o.domain for o in kept.model.opset_import}  # still used: kept


@rule_marker("quark-dq-int-decompose", "negative")
@rule_marker("quark-dq-bfloat16", "negative")
@pytest.mark.parametrize(
    "body, reason",
    [
        (
            "y = com.amd.quark.ExtendedDequantizeLinear (x, s)",
            "malformed node: ExtendedDequantizeLinear takes exactly 3 inputs (x, scale, zero point), it has 2",
        ),
        (
            "y = com.amd.quark.ExtendedDequantizeLinear (x, s2, zp2)",
            "malformed node: scale 's2' has shape [2, 2]; the kernel takes one element (per-tensor) or a 1-D tensor",
        ),
        (
            "y = com.amd.quark.ExtendedDequantizeLinear <axis = 1> (x, s3, zp3)",
            "malformed node: scale 's3' has 3 elements but x 'x' has 4 along axis 1",
        ),
        (
            "y = com.amd.quark.ExtendedDequantizeLinear <axis = 2> (x, s3, zp3)",
            "malformed node: axis 2 is out of range for input 'x' of rank 2",
        ),
        (
            "y = com.amd.quark.ExtendedDequantizeLinear <block_size = 2> (x, s, zp)",
            "attribute(s) block_size not supported (only axis)",
        ),
    ],
)
def test_malformed_nodes_are_errors_with_the_reason(body, reason):
    model = parse(
        check=False,
        text=HEADER.format(opset=21)
        + """
    g (int8[3, 4] x) => (float[3, 4] y)
      <float s = {0.5}, int8 zp = {1}, float[2, 2] s2 = {1, 2, 3, 4}, int8[2, 2] zp2 = {0, 0, 0, 0},
       float[3] s3 = {1, 2, 3}, int8[3] zp3 = {0, 0, 0}> {
        """
        + body
        + "\n}",
    )  # some of these fail the checker: that is what they test
    with pytest.raises(onnx_qrewrite.LoweringError) as exc:
        onnx_qrewrite.rewrite(model, check=False)
    assert str(exc.value).startswith("node n (com.amd.quark::ExtendedDequantizeLinear) cannot be lowered: ")
    assert f"quark-dq-standard: {reason}" in str(exc.value)
    assert f"quark-dq-int-decompose: {reason}" in str(exc.value)
    assert "quark-dq-bfloat16: dtype int8 is not one of bfloat16" in str(exc.value)


def test_runtime_zero_point_of_unrecorded_type_is_an_error():
    model = parse(
        HEADER.format(opset=21)
        + """
    g (float[3] x, int8 zp_in) => (int8[3] y) <float s = {0.5}> {
        zp = Identity (zp_in)
        q = com.amd.quark.ExtendedQuantizeLinear (x, s, zp)
        y = Identity (q)
    }"""
    )
    with pytest.raises(
        onnx_qrewrite.LoweringError,
        match=r"the type of the zero point 'zp' is not recorded in the model .*shape inference",
    ):
        onnx_qrewrite.rewrite(model)
    inferred = onnx.shape_inference.infer_shapes(model)
    assert op_types(onnx_qrewrite.rewrite(inferred).model) == ["Identity", "QuantizeLinear", "Identity"]


def test_per_axis_decomposition_needs_the_rank_of_x():
    model = parse(
        HEADER.format(opset=17)
        + """
    g (float[2, 3] x_in) => (uint32[2, 3] y) <float[2] s = {0.5, 0.25}, uint32[2] zp = {1, 2}> {
        x = Abs (x_in)
        y = com.amd.quark.ExtendedQuantizeLinear (x, s, zp)
    }"""
    )  # no value_info for x: its rank is unknown
    with pytest.raises(onnx_qrewrite.LoweringError, match=r"needs the rank of x 'x' to broadcast the scale"):
        onnx_qrewrite.rewrite(model)


def test_nodes_in_subgraphs_and_local_functions_are_lowered():
    # The DQ's input is the Q's output, which has no value_info: its rank is the Q input's.
    model = parse("""<ir_version: 8, opset_import: ["" : 21, "com.amd.quark" : 1, "local" : 1]>
    g (float[2, 3] x, bool c) => (float[2, 3] y) {
        y = If (c) <then_branch = t () => (float[2, 3] a) {
                s = Constant <value = float[3] {0.5, 0.25, 2.0}> ()
                zp = Constant <value = uint32[3] {1, 2, 3}> ()
                q = com.amd.quark.ExtendedQuantizeLinear <axis = 1> (x, s, zp)
                a = com.amd.quark.ExtendedDequantizeLinear <axis = 1> (q, s, zp)
            }, else_branch = e () => (float[2, 3] b) { b = local.f (x) }>
    }
    <domain: "local", opset_import: ["" : 21, "com.amd.quark" : 1]>
    f (xx) => (yy) {
        s = Constant <value = float[3] {0.5, 0.25, 2.0}> ()
        zp = Constant <value = int16[3] {1, -2, 3}> ()
        qq = com.amd.quark.ExtendedQuantizeLinear <axis = 1> (xx, s, zp)
        yy = com.amd.quark.ExtendedDequantizeLinear <axis = 1> (qq, s, zp)
    }""")
    result = onnx_qrewrite.rewrite(model)
    assert result.report.by_rule() == {
        "quark-q-int-decompose": 1,
        "quark-dq-int-decompose": 1,
        "quark-q-standard": 1,
        "quark-dq-standard": 1,
    }
    assert {r.scope for r in result.report.rewrites} == {"main/y.then_branch", "function:local.f"}
    x = np.array([[1, 2, 3], [-1, -2, 3e9]], np.float32)
    then = run(result.model, {"x": x, "c": np.array(True)})["y"]
    np.testing.assert_array_equal(then, np.array([[1, 2, 4], [-0.5, -0.5, 3e9]], np.float32))
    other = run(result.model, {"x": x, "c": np.array(False)})["y"]
    np.testing.assert_array_equal(other, np.array([[1, 2, 4], [-1, -2, (32767 - 3) * 2.0]], np.float32))


def test_stamped_standard_replacements_equal_built_ones_byte_for_byte():
    from onnx_qrewrite.io.encoded import to_bytes
    from onnx_qrewrite.rewriter import engine

    model = parse(
        HEADER.format(opset=21)
        + """
    g (float[2, 3] x) => (float[2, 3] y, float[2, 3] z)
      <float s = {0.5}, int8 zp = {1}, float[3] sa = {1, 2, 3}, int8[3] za = {0, 1, 2}, float[1] s1 = {0.25}> {
        q1 = com.amd.quark.ExtendedQuantizeLinear (x, s, zp)
        d1 = com.amd.quark.ExtendedDequantizeLinear (q1, s, zp)
        q2 = com.amd.quark.ExtendedQuantizeLinear <axis = 1> (d1, sa, za)
        d2 = com.amd.quark.ExtendedDequantizeLinear <axis = 1> (q2, sa, za)
        q3 = com.amd.quark.ExtendedQuantizeLinear (d2, s1, zp)
        y = com.amd.quark.ExtendedDequantizeLinear (q3, s1, zp)
        q4 = com.amd.quark.ExtendedQuantizeLinear <axis = 1> (y, sa, za)
        z = com.amd.quark.ExtendedDequantizeLinear <axis = 1> (q4, sa, za)
    }"""
    )
    outputs = []
    for stamp in (True, False):
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        rewritten, report = engine.run(copy, onnx_qrewrite.load_rules(), engine.EngineOptions(stamp_templates=stamp))
        outputs.append((to_bytes(rewritten), report.to_dict()))
    assert outputs[0] == outputs[1]
    assert len(outputs[0][1]["rewrites"]) == 8


def test_rewritten_nodes_carry_rule_and_origin():
    from onnx_qrewrite.rewriter.provenance import attribute_nodes

    expected = {"onnx_qrewrite.rule": "quark-q-float16", "onnx_qrewrite.origin": "n"}
    full = onnx_qrewrite.rewrite(fp16_model(1.0, 0.0), provenance="full").model
    for node in full.graph.node:
        assert {p.key: p.value for p in node.metadata_props} == expected
    compact = onnx_qrewrite.rewrite(fp16_model(1.0, 0.0)).model  # the default: on the first node
    assert [{p.key: p.value for p in node.metadata_props} for node in compact.graph.node] == [expected, {}]
    assert attribute_nodes(compact.graph.node) == [("quark-q-float16", "n")] * 2
