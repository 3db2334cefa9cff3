"""The float-emulation form's integer matmul/conv: MatMulInteger/ConvInteger and the Cast to float
that reads them become one float MatMul/Conv with no int32 tensor (targets that refuse int32 inside
the network), bit-exact with onnxruntime's kernels wherever the 2^24 bound is provable; elsewhere,
or where the int32 value has another observer, the rules give way to the default lowering."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from _int_matmul_helpers import (
    CONV_CASES,
    MATMUL_CASES,
    ConvCase,
    MatMulCase,
    case_id,
    matmul_model,
    rng_for,
    saturating_matmul,
    values,
)
from conftest import assert_bitwise_equal, op_types, rule_marker, run
from onnx import TensorProto as T
from onnx import helper, numpy_helper

import onnx_qrewrite
from onnx_qrewrite.errors import UsageError
from onnx_qrewrite.rewriter import u8s8
from onnx_qrewrite.rewriter.catalogue import load_catalogue, named_form, parse_rules

FORM = load_catalogue([named_form("float-emulation")])
FOLDED = {"float-emulation-int-matmul-folded": 1, "float-emulation-int-matmul-cast": 1}


def _with_cast(model: onnx.ModelProto, *, keep_int32_output: bool = False, to: int = T.FLOAT) -> onnx.ModelProto:
    """The integer op's output Y read by Cast(to) -> Z, as quantize_dynamic writes it."""
    graph = model.graph
    graph.node.append(helper.make_node("Cast", ["Y"], ["Z"], name="cast", to=to))
    rank = len(graph.output[0].type.tensor_type.shape.dim)
    z = helper.make_tensor_value_info("Z", to, [None] * rank)
    if not keep_int32_output:
        del graph.output[:]
    graph.output.append(z)
    return model


def _int32_values(model: onnx.ModelProto) -> list[str]:
    """Every int32 tensor of the model (shape inference fills in the types of intermediate values)."""
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    g = inferred.graph
    typed = [*g.input, *g.value_info, *g.output]
    found = [v.name for v in typed if v.type.tensor_type.elem_type == T.INT32]
    found += [t.name for t in g.initializer if t.data_type == T.INT32]
    casts = [
        n.name for n in g.node if n.op_type == "Cast" and any(a.name == "to" and a.i == T.INT32 for a in n.attribute)
    ]
    return found + casts


@rule_marker("float-emulation-int-matmul-cast", "positive")
@rule_marker("float-emulation-int-matmul-folded", "positive")
@pytest.mark.parametrize("case", MATMUL_CASES, ids=case_id)
def test_matmul_integer_and_its_cast_become_one_float_matmul_bit_exact(case: MatMulCase):
    model, feeds, a, b, azp, bzp, reference = case.build()
    model = _with_cast(model)
    result = onnx_qrewrite.rewrite(model, rules=FORM)
    if case.ta == "uint8" and case.tb == "int8" and (not case.b_const or u8s8.pair_excess(b.T, "int8").max() > 0):
        # onnxruntime's u8 x s8 kernel can saturate pairs here (x86 without VNNI): no exact form,
        # the default bounded rule takes the node (rules/50-integer-matmul.toml) and the Cast stays.
        assert result.report.by_rule() == {"int-matmul-float-bounded": 1}
        return
    assert result.report.by_rule() == FOLDED
    assert "MatMulInteger" not in op_types(result.model) and _int32_values(result.model) == []
    onnx.checker.check_model(result.model, full_check=True)
    got = run(result.model, feeds)["Z"]
    spec = reference.astype(np.float32)
    assert_bitwise_equal(got, spec, "rewrite vs ONNX definition")
    original = run(model, feeds)["Z"]
    if case.ta == "uint8" and case.tb == "int8" and not np.array_equal(original, spec):
        # onnxruntime's AVX2 u8 x s8 kernel saturates int16 pairs (docs/numerics.md): exactly as emulated.
        assert_bitwise_equal(original, saturating_matmul(a, b, azp, bzp).astype(np.float32), "u8s8 kernel")
    else:
        assert_bitwise_equal(got, original, "rewrite vs onnxruntime's MatMulInteger -> Cast")


@rule_marker("float-emulation-int-matmul-cast", "positive")
@rule_marker("float-emulation-int-matmul-folded", "positive")
@pytest.mark.parametrize("case", [c for c in CONV_CASES if c.edge == "random"], ids=case_id)
def test_conv_integer_and_its_cast_become_one_float_conv_bit_exact(case: ConvCase):
    model, feeds, *_, reference = case.build()
    model = _with_cast(model)
    result = onnx_qrewrite.rewrite(model, rules=FORM)
    assert result.report.by_rule() == FOLDED
    assert "ConvInteger" not in op_types(result.model) and _int32_values(result.model) == []
    got = run(result.model, feeds)["Z"]
    assert_bitwise_equal(got, reference.astype(np.float32), "rewrite vs ONNX definition")
    assert_bitwise_equal(got, run(model, feeds)["Z"], "rewrite vs onnxruntime's ConvInteger -> Cast")


def _small_matmul(**kw) -> tuple[onnx.ModelProto, dict]:
    rng = rng_for("small")
    b = np.clip(values(rng, "int8", (9, 5), "random"), -64, 64).astype(np.int8)  # 7-bit: no u8s8 saturation
    model, feeds = matmul_model("uint8", "int8", (4, 9), b, np.array(3, np.uint8), None)
    return _with_cast(model, **kw), feeds


@rule_marker("float-emulation-int-matmul-cast", "negative")
@rule_marker("float-emulation-int-matmul-folded", "negative")
def test_the_rules_give_way_where_the_int32_is_observed_or_the_bound_is_not_provable():
    a = values(rng_for("a"), "uint8", (4, 9), "random")
    # The int32 output is also a graph output: the default lowering keeps it, and the Cast.
    model, _ = _small_matmul(keep_int32_output=True)
    result = onnx_qrewrite.rewrite(model, rules=FORM)
    assert result.report.by_rule() == {"int-matmul-float": 1}
    assert op_types(result.model)[-1] == "Cast"
    assert_bitwise_equal(run(result.model, {"A": a})["Z"], run(model, {"A": a})["Z"], "Z")
    # A Cast to another type than float32 is not folded.
    model, _ = _small_matmul(to=T.DOUBLE)
    assert onnx_qrewrite.rewrite(model, rules=FORM).report.by_rule() == {"int-matmul-float": 1}
    # Beyond 2^24 (K = 2048 full-range int8 weights): not provably exact; int32 MatMul, as by default.
    k = 2048
    b = np.full((k, 3), -128, np.int8)
    model, _ = matmul_model("int8", "int8", (2, k), b, None, None)
    result = onnx_qrewrite.rewrite(_with_cast(model), rules=FORM)
    assert result.report.by_rule() == {"int-matmul-int32": 1}
    # Without the form, nothing changes: the default lowering, with its int32 tensor.
    model, _ = _small_matmul()
    plain = onnx_qrewrite.rewrite(model)
    assert plain.report.by_rule() == {"int-matmul-float": 1} and _int32_values(plain.model)


def test_quantize_dynamic_pattern_has_no_int32_tensor_left():
    """DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul (quantize_dynamic), weights in 7 bits."""
    rng = np.random.default_rng(11)
    w = rng.integers(-64, 64, (16, 8)).astype(np.int8)
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.float32(0.01), "w_scale")]
    nodes = [
        helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"], name="dql"),
        helper.make_node("MatMulInteger", ["xq", "w", "xz"], ["acc"], name="mmi"),
        helper.make_node("Cast", ["acc"], ["accf"], name="cast", to=T.FLOAT),
        helper.make_node("Mul", ["xs", "w_scale"], ["s"], name="scale"),
        helper.make_node("Mul", ["accf", "s"], ["y"], name="out"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", T.FLOAT, [3, 16])],
        [helper.make_tensor_value_info("y", T.FLOAT, [3, 8])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    result = onnx_qrewrite.rewrite(model, rules=FORM)
    assert {"float-emulation-int-matmul-folded", "float-emulation-int-matmul-cast"} <= set(result.report.by_rule())
    assert _int32_values(result.model) == []
    for x in (rng.standard_normal((3, 16)).astype(np.float32), np.zeros((3, 16), np.float32)):
        assert_bitwise_equal(run(result.model, {"x": x})["y"], run(model, {"x": x})["y"], "y")
    report = onnx_qrewrite.verify(model, result.model)
    assert report.passed


def test_precedes_must_name_rules_as_a_list_of_strings():
    text = """
[[rule]]
id = "r"
summary = "s"
builder = "integer_matmul_float_output"
exactness = "exact"
match = [{ domain = "", op = "MatMulInteger" }]
options = { part = "producer" }
precedes = "int-matmul-float"
"""
    with pytest.raises(UsageError, match=r"rule 'r': 'precedes' must be a list of rule ids"):
        parse_rules(text, "x.toml")


def test_the_producer_is_kept_and_lowered_when_its_cast_is_not_rewritten():
    """Removing MatMulInteger is only right if its Cast is rewritten: with the Cast's rule skipped the
    node is still read, and the default lowering takes it."""
    model, _ = _small_matmul()
    result = onnx_qrewrite.rewrite(model, rules=FORM.select(skip=["float-emulation-int-matmul-cast"]))
    assert result.report.by_rule() == {"int-matmul-float": 1}
    onnx.checker.check_model(result.model, full_check=True)
