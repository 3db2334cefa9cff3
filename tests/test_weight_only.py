"""The "weight-only" form (rules/forms/weight-only.toml, onnx_qrewrite/rewriter/builders/weight_only.py): each
pattern on hand-made graphs, the cases where it must give way, and what the engine guarantees about
the nodes it removes. Real producer models and the measured drift: test_weight_only_models.py."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import assert_bitwise_equal, op_types, rule_marker, run
from onnx import TensorProto, helper, numpy_helper

import onnx_qrewrite
from onnx_qrewrite.rewriter.builders.qdq_to_float import dequantize_constant
from onnx_qrewrite.rewriter.catalogue import load_catalogue, named_form

FORM = load_catalogue([named_form("weight-only")])
APPROXIMATE = ("exact", "bounded", "approximate")
_GONE = {
    "DynamicQuantizeLinear",
    "MatMulInteger",
    "ConvInteger",
    "Cast",
    "MatMulIntegerToFloat",
    "DynamicQuantizeMatMul",
}


def _form(weights: str = "dequantize"):
    return FORM.with_option("weights", weights)


def _rewrite(model: onnx.ModelProto, weights: str = "dequantize", **kw) -> onnx_qrewrite.RewriteResult:
    kw.setdefault("allow", APPROXIMATE)
    return onnx_qrewrite.rewrite(model, rules=_form(weights), **kw)


def _weights(dtype, shape, per_axis: int | None, rng, zero_point: bool = True):
    info = np.iinfo(dtype)
    # int8 weights in 7 bits, as quantize_dynamic's reduce_range makes them: onnxruntime's uint8 x
    # full-range int8 kernel saturates pairs of products on x86 without VNNI (rules/50-integer-matmul.toml).
    low, high = (-64, 63) if dtype == np.int8 else (info.min, info.max)
    w = rng.integers(low, high + 1, shape).astype(dtype)
    n = shape[per_axis] if per_axis is not None else None
    scale = rng.uniform(0.002, 0.02, n).astype(np.float32) if n else np.float32(0.0123)
    if not zero_point:
        return w, np.asarray(scale), None
    zp = rng.integers(info.min // 4, info.max // 4, n).astype(dtype) if n else np.asarray(dtype(info.max // 5))
    return w, np.asarray(scale), np.asarray(zp)


def _dynamic_matmul(
    dtype=np.int8,
    per_column: bool = False,
    *,
    zero_point: bool = True,
    consumers: int = 1,
    bias: bool = False,
    swap: bool = False,
    cast_to: int = TensorProto.FLOAT,
    extra_outputs: tuple[str, ...] = (),
    opset: int = 17,
) -> onnx.ModelProto:
    """DynamicQuantizeLinear(x) -> ``consumers`` x [MatMulInteger -> Cast -> Mul(scale product)],
    as quantize_dynamic writes it (Q/K/V share the DynamicQuantizeLinear)."""
    rng = np.random.default_rng(7)
    k, n = 16, 8
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"], name="dql")]
    inits = []
    outputs = []
    for i in range(consumers):
        w, s, z = _weights(dtype, (k, n), 1 if per_column else None, rng, zero_point)
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(s, f"ws{i}")]
        if z is not None:
            inits.append(numpy_helper.from_array(z, f"wz{i}"))
        product = ["ws" + str(i), "xs"] if swap else ["xs", "ws" + str(i)]
        nodes += [
            helper.make_node("Mul", product, [f"sp{i}"], name=f"scale{i}"),
            helper.make_node("MatMulInteger", ["xq", f"w{i}", "xz", f"wz{i}" if z is not None else ""], [f"acc{i}"]),
            helper.make_node("Cast", [f"acc{i}"], [f"accf{i}"], to=cast_to, name=f"cast{i}"),
            helper.make_node(
                "Mul", [f"sp{i}", f"accf{i}"] if swap else [f"accf{i}", f"sp{i}"], [f"m{i}"], name=f"mul{i}"
            ),
        ]
        out = f"m{i}"
        if bias:
            inits.append(numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), f"b{i}"))
            nodes.append(helper.make_node("Add", [out, f"b{i}"], [f"y{i}"], name=f"add{i}"))
            out = f"y{i}"
        outputs.append(helper.make_tensor_value_info(out, TensorProto.FLOAT, [2, 5, n]))
    for name in extra_outputs:
        outputs.append(helper.make_tensor_value_info(name, TensorProto.UNDEFINED, None))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5, k])], outputs, inits
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    return onnx.shape_inference.infer_shapes(model)


def _x(shape=(2, 5, 16), seed=3) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _init(model: onnx.ModelProto, name: str) -> np.ndarray:
    return numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == name))


def _expected_matmul(model: onnx.ModelProto, x: np.ndarray, i: int, per_column: bool) -> np.ndarray:
    """The weight-only meaning: x @ ((W - zp) * scale), in float64 (the rewrite computes it in float32)."""
    names = {t.name for t in model.graph.initializer}
    zp = _init(model, f"wz{i}") if f"wz{i}" in names else None
    w = dequantize_constant(_init(model, f"w{i}"), _init(model, f"ws{i}"), zp, 1 if per_column else 0, 0)
    return x.astype(np.float64) @ w.astype(np.float64)


def _outputs_unchanged(before: onnx.ModelProto, after: onnx.ModelProto) -> None:
    assert [(o.name, o.type.SerializeToString()) for o in before.graph.output] == [
        (o.name, o.type.SerializeToString()) for o in after.graph.output
    ]


@rule_marker("weight-only-matmul", "positive")
@rule_marker("weight-only-remove-dead", "positive")
@pytest.mark.parametrize("weights", ["dequantize", "float"])
@pytest.mark.parametrize(
    ("dtype", "per_column", "zero_point", "swap"),
    [
        (np.int8, False, True, False),
        (np.int8, True, True, True),
        (np.uint8, False, True, True),
        (np.uint8, True, True, False),
        (np.int8, True, False, False),
    ],
)
def test_matmul_integer_pattern_becomes_float_matmul_of_dequantized_weights(
    dtype, per_column, zero_point, swap, weights
):
    model = _dynamic_matmul(dtype, per_column, zero_point=zero_point, swap=swap, bias=True)
    result = _rewrite(model, weights)
    out = result.model
    assert set(op_types(out)) == ({"MatMul", "Add"} | ({"DequantizeLinear"} if weights == "dequantize" else set()))
    _outputs_unchanged(model, out)
    by_rule = result.report.by_rule()
    assert by_rule["weight-only-matmul"] == 1 and by_rule["weight-only-remove-dead"] == 4
    if weights == "dequantize":
        dq = next(n for n in out.graph.node if n.op_type == "DequantizeLinear")
        assert dq.input[0] == "w0" and _init(out, "w0").dtype == dtype  # the integer weights, unchanged
        assert any(a.name == "axis" and a.i == 1 for a in dq.attribute) == per_column
    else:
        assert {t.data_type for t in out.graph.initializer} == {TensorProto.FLOAT}  # w0, scales, zp gone
    x = _x()
    got = run(out, {"x": x})["y0"]
    expected = _expected_matmul(model, x, 0, per_column) + _init(model, "b0")
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    # And it is an approximation of the original, not something else: close to onnxruntime's result.
    original = run(model, {"x": x})["y0"]
    assert 0 < np.abs(got - original).max() < 0.05 * np.abs(original).max()


@rule_marker("weight-only-matmul", "positive")
@pytest.mark.parametrize("weights", ["dequantize", "float"])
@pytest.mark.parametrize("per_channel", [False, True])
def test_conv_integer_pattern_becomes_float_conv(per_channel, weights):
    rng = np.random.default_rng(11)
    m, c = 6, 3
    w, s, z = _weights(np.uint8, (m, c, 3, 3), 0 if per_channel else None, rng)
    # The scale product must broadcast along the output's channel axis: [M, 1, 1].
    s = s.reshape(m, 1, 1) if per_channel else s
    inits = [numpy_helper.from_array(a, name) for name, a in (("w", w), ("ws", s), ("wz", z))]
    nodes = [
        helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
        helper.make_node("ConvInteger", ["xq", "w", "xz", "wz"], ["acc"], pads=[1, 1, 1, 1], strides=[2, 1]),
        helper.make_node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["xs", "ws"], ["sp"]),
        helper.make_node("Mul", ["accf", "sp"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, m, 4, 8])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    out = _rewrite(model, weights).model
    assert set(op_types(out)) == {"Conv"} | ({"DequantizeLinear"} if weights == "dequantize" else set())
    conv = next(n for n in out.graph.node if n.op_type == "Conv")
    assert {a.name: helper.get_attribute_value(a) for a in conv.attribute} == {"pads": [1, 1, 1, 1], "strides": [2, 1]}
    x = np.random.default_rng(4).standard_normal((1, c, 8, 8)).astype(np.float32)
    float_w = dequantize_constant(w, s.reshape(-1), z, 0, 0)
    reference = helper.make_model(
        helper.make_graph(
            [helper.make_node("Conv", ["x", "W"], ["y"], pads=[1, 1, 1, 1], strides=[2, 1])],
            "f",
            graph.input,
            graph.output,
            [numpy_helper.from_array(float_w, "W")],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
        ir_version=8,
    )
    np.testing.assert_allclose(run(out, {"x": x})["y"], run(reference, {"x": x})["y"], rtol=1e-6, atol=1e-6)


@rule_marker("weight-only-remove-dead", "positive")
def test_a_dynamic_quantize_linear_shared_by_qkv_goes_when_all_three_are_rewritten():
    model = _dynamic_matmul(np.int8, True, consumers=3)
    result = _rewrite(model)
    assert op_types(result.model).count("MatMul") == 3
    assert not set(op_types(result.model)) & _GONE
    assert result.report.by_rule()["weight-only-remove-dead"] == 1 + 3 * 3  # DQL, then per head Cast, MMI, Mul
    x = _x()
    got = run(result.model, {"x": x})
    for i in range(3):
        np.testing.assert_allclose(got[f"m{i}"], _expected_matmul(model, x, i, True), rtol=1e-5, atol=1e-5)


@rule_marker("weight-only-remove-dead", "negative")
@pytest.mark.parametrize("read_elsewhere", ["xz", "xs", "acc0", "accf0", "sp0"])
def test_a_pattern_node_something_else_reads_stays_and_gets_its_exact_lowering(read_elsewhere):
    """The anchor is rewritten (it reads x), but a node whose output is still read (here: a graph
    output) is not removed: the exact default rules lower it instead, and the value is unchanged."""
    model = _dynamic_matmul(np.int8, False, extra_outputs=(read_elsewhere,))
    result = _rewrite(model)
    out = result.model
    assert result.report.by_rule()["weight-only-matmul"] == 1
    assert not {"DynamicQuantizeLinear", "MatMulInteger"} & set(op_types(out))  # lowered, not left
    onnx.checker.check_model(out, full_check=True)
    _outputs_unchanged(model, out)
    x = _x()
    got, original = run(out, {"x": x}), run(model, {"x": x})
    np.testing.assert_array_equal(got[read_elsewhere], original[read_elsewhere])


@rule_marker("weight-only-matmul", "negative")
@pytest.mark.parametrize(
    "change",
    ["mul-by-non-scale", "scale-not-from-dql", "cast-to-double", "activation-zero-point-elsewhere", "runtime-weights"],
)
def test_anything_but_the_exact_pattern_gives_way_to_the_default_lowerings(change):
    model = _dynamic_matmul(np.int8, True)
    nodes = {n.name or n.output[0]: n for n in model.graph.node}
    g = model.graph
    if change == "mul-by-non-scale":  # the scale product times something else
        g.initializer.append(numpy_helper.from_array(np.float32(2.0), "two"))
        nodes["mul0"].input[1] = "two"
    elif change == "scale-not-from-dql":  # Mul(a constant, W_scale): not the activation's scale
        g.initializer.append(numpy_helper.from_array(np.float32(0.01), "other_scale"))
        nodes["scale0"].input[0] = "other_scale"
    elif change == "cast-to-double":
        nodes["cast0"].attribute[0].i = TensorProto.DOUBLE
        g.node.append(helper.make_node("Cast", ["m0"], ["m0_f"], to=TensorProto.FLOAT))
        nodes["mul0"].input[1] = "sp0_d"
        g.node.insert(2, helper.make_node("Cast", ["sp0"], ["sp0_d"], to=TensorProto.DOUBLE))
        g.output[0].name = "m0_f"
    elif change == "activation-zero-point-elsewhere":  # MatMulInteger's A zero point is a constant
        g.initializer.append(numpy_helper.from_array(np.uint8(128), "fixed_zp"))
        nodes["acc0"].input[2] = "fixed_zp"
    else:  # the weights are an input, not a constant
        g.input.append(helper.make_tensor_value_info("w0", TensorProto.INT8, [16, 8]))
        kept = [t for t in g.initializer if t.name != "w0"]
        del g.initializer[:]
        g.initializer.extend(kept)
    del g.value_info[:]
    model = onnx.shape_inference.infer_shapes(model)
    onnx.checker.check_model(model)
    result = _rewrite(model)
    assert not any(r.rule.startswith("weight-only") for r in result.report.rewrites)
    assert "MatMul" in op_types(result.model) and "DequantizeLinear" not in op_types(result.model)
    assert not {"DynamicQuantizeLinear", "MatMulInteger"} & set(op_types(result.model))  # the exact rules did


@rule_marker("weight-only-matmul", "negative")
@rule_marker("weight-only-remove-dead", "negative")
def test_the_form_runs_only_when_approximate_rules_are_allowed():
    model = _dynamic_matmul(np.int8, True)
    result = onnx_qrewrite.rewrite(model, rules=_form())
    assert not any(r.rule.startswith("weight-only") for r in result.report.rewrites)
    assert "int-matmul-float" in result.report.by_rule()


def test_skipping_the_anchor_rule_removes_nothing():
    """The removals are decided from what the other rules actually do: with the anchor rule skipped
    nothing becomes dead, and the model is lowered exactly as without the form."""
    model = _dynamic_matmul(np.uint8, False, consumers=2)
    result = onnx_qrewrite.rewrite(model, rules=FORM, skip=["weight-only-matmul"], allow=APPROXIMATE)
    assert not any(r.rule.startswith("weight-only") for r in result.report.rewrites)
    x = _x()
    np.testing.assert_array_equal(run(result.model, {"x": x})["m1"], run(model, {"x": x})["m1"])


@pytest.mark.parametrize("keep_opset", [False, True])
def test_per_column_dequantize_needs_opset_13(keep_opset):
    model = _dynamic_matmul(np.int8, True, opset=11)
    result = _rewrite(model, keep_opset=keep_opset)
    opset = next(o.version for o in result.model.opset_import if o.domain == "")
    if keep_opset:  # gives way as a whole: nothing removed, everything lowered exactly
        assert opset == 11 and not any(r.rule.startswith("weight-only") for r in result.report.rewrites)
    else:
        assert opset == 13 and result.report.by_rule()["weight-only-matmul"] == 1
    # The float weights need no opset at all.
    folded = _rewrite(model, "float", keep_opset=True)
    assert folded.report.by_rule()["weight-only-matmul"] == 1


def _fused(op: str, dtype=np.int8, per_column: bool = True, bias: bool = True, a_from: str = "dql") -> onnx.ModelProto:
    rng = np.random.default_rng(5)
    k, n = 16, 8
    w, s, z = _weights(dtype, (k, n), 1 if per_column else None, rng)
    inits = [numpy_helper.from_array(a, name) for name, a in (("w", w), ("ws", s), ("wz", z))]
    inits.append(numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), "b"))
    b = "b" if bias else ""
    if op == "DynamicQuantizeMatMul":
        nodes = [helper.make_node(op, ["x", "w", "ws", "wz", b], ["y"], domain="com.microsoft")]
    else:
        if a_from == "dql":
            nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"])]
        else:  # a static QuantizeLinear: not the dynamic pattern
            inits += [numpy_helper.from_array(np.float32(0.02), "xs"), numpy_helper.from_array(np.uint8(128), "xz")]
            nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"])]
        nodes.append(helper.make_node(op, ["xq", "w", "xs", "ws", "xz", "wz", b], ["y"], domain="com.microsoft"))
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5, n])],
        inits,
    )
    return helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
        ir_version=8,
    )


@rule_marker("weight-only-ms-matmul", "positive")
@pytest.mark.parametrize("weights", ["dequantize", "float"])
@pytest.mark.parametrize("op", ["DynamicQuantizeMatMul", "MatMulIntegerToFloat"])
@pytest.mark.parametrize(("dtype", "per_column", "bias"), [(np.int8, True, True), (np.uint8, False, False)])
def test_fused_contrib_ops_become_float_matmul_of_dequantized_weights(op, dtype, per_column, bias, weights):
    model = _fused(op, dtype, per_column, bias)
    result = _rewrite(model, weights)
    out = result.model
    assert {(n.domain, n.op_type) for n in out.graph.node} <= {("", "DequantizeLinear"), ("", "MatMul"), ("", "Add")}
    assert all(o.domain != "com.microsoft" for o in out.opset_import)
    x = _x()
    zp = _init(model, "wz")
    w = dequantize_constant(_init(model, "w"), _init(model, "ws"), zp, 1, 0)
    expected = x.astype(np.float64) @ w + (_init(model, "b") if bias else 0)
    np.testing.assert_allclose(run(out, {"x": x})["y"], expected, rtol=1e-5, atol=1e-5)
    original = run(model, {"x": x})["y"]
    assert 0 < np.abs(run(out, {"x": x})["y"] - original).max() < 0.05 * np.abs(original).max()


@rule_marker("weight-only-ms-matmul", "negative")
def test_matmul_integer_to_float_of_a_static_quantize_gives_way():
    model = _fused("MatMulIntegerToFloat", a_from="quantize_linear")
    result = _rewrite(model)
    assert not any(r.rule.startswith("weight-only") for r in result.report.rewrites)
    assert result.report.by_rule().get("ms-int-matmul-float") == 1


def test_named_form_suggests_the_closest_name():
    with pytest.raises(onnx_qrewrite.errors.UsageError, match="did you mean 'weight-only'"):
        named_form("weight-onyl")


def test_the_weights_option_is_set_on_the_whole_form_at_once():
    form = FORM.with_option("weights", "float")
    assert {r.id: r.options["weights"] for r in form if r.id.startswith("weight-only")} == {
        "weight-only-matmul": "float",
        "weight-only-ms-matmul": "float",
        "weight-only-gather": "float",
        "weight-only-gather-remove-dead": "float",
        "weight-only-remove-dead": "float",
    }
    with pytest.raises(onnx_qrewrite.errors.UsageError, match="did you mean 'weights'"):
        FORM.with_option("weight", "float")
    with pytest.raises(onnx_qrewrite.errors.UsageError, match="'flaot' is not one of"):
        FORM.with_option("weights", "flaot")


def test_a_replacement_reading_a_removed_value_is_an_internal_error_not_a_broken_model(monkeypatch):
    """The engine checks the built result against the removals it decided from the plans: a builder
    whose replacement reads more than its plan said (here: the Cast's output) is caught."""
    import dataclasses

    from onnx_qrewrite.rewriter.builders import _dynamic_patterns

    real = _dynamic_patterns._read_mul

    def lying(scope, node):
        anchor = real(scope, node)
        return dataclasses.replace(anchor, x=anchor.chain[0])  # reads the Cast, says it reads x

    monkeypatch.setattr(_dynamic_patterns, "_read_mul", lying)
    with pytest.raises(
        onnx_qrewrite.errors.InternalError, match="removed the node writing 'accf0', which is still read"
    ):
        _rewrite(_dynamic_matmul(np.int8, False))


def _gathered(dtype=np.uint8, per_axis: bool = False, axis: int = 0, table_input: bool = False) -> onnx.ModelProto:
    """quantize_dynamic's quantized embedding: DequantizeLinear(Gather(W_q, ids), scale, zp)."""
    rng = np.random.default_rng(9)
    table, scale, zp = _weights(dtype, (12, 6), 1 if per_axis else None, rng)
    inits = [numpy_helper.from_array(scale, "s"), numpy_helper.from_array(zp, "z")]
    inputs = [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 3])]
    if table_input:
        inputs.append(helper.make_tensor_value_info("table", TensorProto.UINT8, [12, 6]))
    else:
        inits.append(numpy_helper.from_array(table, "table"))
    out_shape = [2, 3, 6] if axis == 0 else [12, 2, 3]
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["looked_up"], axis=axis),
        helper.make_node("DequantizeLinear", ["looked_up", "s", "z"], ["emb"], **({"axis": 1} if per_axis else {})),
        helper.make_node("Relu", ["emb"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)], inits
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@rule_marker("weight-only-gather", "positive")
@pytest.mark.parametrize("weights", ["dequantize", "float"])
@pytest.mark.parametrize(("dtype", "axis"), [(np.uint8, 0), (np.int8, 0), (np.uint8, 1)])
def test_a_quantized_embedding_lookup_becomes_a_gather_of_the_dequantized_table(dtype, axis, weights):
    model = _gathered(dtype, axis=axis)
    result = _rewrite(model, weights)
    out = result.model
    assert result.report.by_rule() == {"weight-only-gather": 1, "weight-only-gather-remove-dead": 1}
    assert op_types(out).count("Gather") == 1 and ("DequantizeLinear" in op_types(out)) == (weights == "dequantize")
    gather = next(n for n in out.graph.node if n.op_type == "Gather")
    assert [helper.get_attribute_value(a) for a in gather.attribute if a.name == "axis"] == [axis]
    ids = np.random.default_rng(1).integers(0, 12 if axis == 0 else 6, (2, 3)).astype(np.int64)
    # Gathering the dequantized table is the same arithmetic on the same values: bit for bit.
    assert_bitwise_equal(run(out, {"ids": ids})["y"], run(model, {"ids": ids})["y"], "embedding")


@rule_marker("weight-only-gather", "negative")
@pytest.mark.parametrize("change", ["per-axis-scale", "table-computed-at-run-time"])
def test_a_gather_that_is_not_a_constant_per_tensor_table_gives_way(change):
    model = _gathered(per_axis=change == "per-axis-scale", table_input=change == "table-computed-at-run-time")
    result = _rewrite(model)
    assert not result.report.rewrites
    assert op_types(result.model) == op_types(model)


def test_a_zero_weight_zero_point_is_left_out_of_the_dequantize():
    """Symmetric int8 weights (quantize_dynamic's default) get DequantizeLinear(W, scale): what
    targets that take only zero points of 0 (TensorRT) read most plainly; the values are the same."""
    model = _dynamic_matmul(np.int8, True)
    for t in model.graph.initializer:
        if t.name == "wz0":
            t.CopyFrom(numpy_helper.from_array(np.zeros(8, np.int8), "wz0"))
    out = _rewrite(model).model
    dq = next(n for n in out.graph.node if n.op_type == "DequantizeLinear")
    assert list(dq.input) == ["w0", "ws0"]
    assert "wz0" not in {t.name for t in out.graph.initializer}
    x = _x()
    np.testing.assert_allclose(run(out, {"x": x})["m0"], _expected_matmul(model, x, 0, True), rtol=1e-5, atol=1e-5)


@rule_marker("weight-only-matmul", "positive")
def test_patterns_inside_a_subgraph_and_values_read_from_one_stay_sound():
    """A pattern inside an If branch is rewritten there; a DynamicQuantizeLinear of the main graph
    whose outputs the other branch reads is not removed (the branch still reads them)."""
    inner = _dynamic_matmul(np.int8, True)
    out_info = helper.make_tensor_value_info("m0", TensorProto.FLOAT, [2, 5, 8])
    then_branch = helper.make_graph(list(inner.graph.node), "then", [], [out_info])
    else_branch = helper.make_graph(
        [
            helper.make_node("Cast", ["xz_main"], ["zf"], to=TensorProto.FLOAT),
            helper.make_node("Expand", ["zf", "shape_258"], ["z"]),
        ],
        "else",
        [],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 5, 8])],
    )
    nodes = [
        helper.make_node("DynamicQuantizeLinear", ["x"], ["xq_main", "xs_main", "xz_main"], name="dql_main"),
        helper.make_node("If", ["cond"], ["y"], then_branch=then_branch, else_branch=else_branch),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5, 16]),
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5, 8])],
        [*inner.graph.initializer, numpy_helper.from_array(np.array([2, 5, 8], np.int64), "shape_258")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    result = _rewrite(model)
    assert result.report.by_rule()["weight-only-matmul"] == 1
    out = result.model
    onnx.checker.check_model(out, full_check=True)
    assert "xz_main" in {o for n in out.graph.node for o in n.output}  # still written: the else branch reads it
    x = _x()
    for cond in (True, False):
        feeds = {"x": x, "cond": np.array(cond)}
        got, original = run(out, feeds)["y"], run(model, feeds)["y"]
        if cond:
            np.testing.assert_allclose(got, _expected_matmul(model, x, 0, True), rtol=1e-5, atol=1e-5)
        else:
            np.testing.assert_array_equal(got, original)


def _embedding(table: np.ndarray, scale: np.float32, zero_point, axis: int, ids_shape) -> onnx.ModelProto:
    inits = [
        numpy_helper.from_array(table, "table"),
        numpy_helper.from_array(np.asarray(scale, np.float32), "s"),
        numpy_helper.from_array(np.asarray(zero_point, table.dtype), "z"),
    ]
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["looked_up"], axis=axis),
        helper.make_node("DequantizeLinear", ["looked_up", "s", "z"], ["emb"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, list(ids_shape))],
        [helper.make_tensor_value_info("emb", TensorProto.FLOAT, [None] * (table.ndim + len(ids_shape) - 1))],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


@rule_marker("weight-only-gather", "positive")
@rule_marker("weight-only-gather-remove-dead", "positive")
@pytest.mark.parametrize("weights", ["dequantize", "float"])
@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
def test_the_embedding_gather_rewrite_is_exact_and_runs_without_allow_approximate(dtype, weights):
    """DequantizeLinear is elementwise: dequantizing the whole table then gathering gives each value
    the kernel's own arithmetic. Bit for bit against onnxruntime on tables whose sizes leave vector
    tails, every gather axis, negative indices, scales from denormal-adjacent to near overflow."""
    rng = np.random.default_rng(11)
    info = np.iinfo(dtype)
    form = _form(weights)
    for shape in ((257, 37), (31, 5, 7)):
        for scale in (np.float32(0.0123), np.float32(3.7e-38), np.float32(2.9e38), np.float32(2.0**-17)):
            table = rng.integers(info.min, info.max + 1, shape).astype(dtype)
            zero_point = dtype(rng.integers(info.min, info.max + 1))
            for axis in range(len(shape)):
                ids = rng.integers(-shape[axis], shape[axis], (3, 11)).astype(np.int64)
                model = _embedding(table, scale, zero_point, axis, ids.shape)
                result = onnx_qrewrite.rewrite(model, rules=form)  # exact rules only
                assert result.report.by_rule() == {"weight-only-gather": 1, "weight-only-gather-remove-dead": 1}
                assert all(r.exactness == "exact" for r in result.report.rewrites)
                assert_bitwise_equal(
                    run(result.model, {"ids": ids})["emb"], run(model, {"ids": ids})["emb"], f"{shape} {axis}"
                )


@rule_marker("weight-only-gather-remove-dead", "negative")
def test_an_integer_gather_something_else_reads_stays():
    model = _gathered()
    model.graph.output.append(helper.make_tensor_value_info("looked_up", TensorProto.UINT8, [2, 3, 6]))
    result = onnx_qrewrite.rewrite(model, rules=_form("dequantize"))
    assert result.report.by_rule() == {"weight-only-gather": 1}
    assert op_types(result.model).count("Gather") == 2  # the integer lookup stays: it is an output
    ids = np.random.default_rng(2).integers(0, 12, (2, 3)).astype(np.int64)
    for name in ("y", "looked_up"):
        assert_bitwise_equal(run(result.model, {"ids": ids})[name], run(model, {"ids": ids})[name], name)
