"""The "float-emulation" form lowers what other rules emit too (``on_replacements``, the engine's
later passes): the QuantizeLinear of a DynamicQuantizeLinear expansion, the standard Q/DQ a vendor
rule writes. On the real models the tests ship, nothing quantized is left and the result is still
bit-exact with onnxruntime running the original; the passes end however rules' emits and matches
overlap, and a bounded replacement whose Q/DQ are then emulated is still checked at its output."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest
from _rule_helpers import LOOPING, ms_quantize
from conftest import REAL_MODELS, SAMPLES, assert_bitwise_equal, rule_marker, run
from onnx import TensorProto, helper, numpy_helper

import onnx_qrewrite
from onnx_qrewrite.errors import UsageError
from onnx_qrewrite.rewriter.catalogue import Catalogue, load_catalogue, named_form, parse_rules

FORM = load_catalogue([named_form("float-emulation")])
#: Ops a target without quantized kernels refuses.
QUANTIZED = {"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "MatMulInteger", "ConvInteger"}

FIXTURES = [
    REAL_MODELS / "ortdyn_cnn_op17_w8u.onnx",
    REAL_MODELS / "ortqdq_ms_cnn_op17_a16u_w16s.onnx",
    REAL_MODELS / "quark_cnn_op17_a16w8_ext.onnx",
    SAMPLES / "dynamic_cnn.onnx",
    SAMPLES / "dynamic_mlp.onnx",
    SAMPLES / "qdq_contrib_u16.onnx",
]


def _left(model: onnx.ModelProto) -> collections.Counter[str]:
    return collections.Counter(
        f"{n.domain}::{n.op_type}" if n.domain else n.op_type
        for n in model.graph.node
        if n.op_type in QUANTIZED or n.domain not in ("", "ai.onnx") or n.op_type.startswith("QLinear")
    )


@rule_marker("float-emulation-q", "positive")
@rule_marker("float-emulation-dq", "positive")
@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_no_quantized_op_is_left_on_the_fixture_models_and_results_stay_bit_exact(path):
    model = onnx.load(path)
    result = onnx_qrewrite.rewrite(model, rules=FORM)
    assert not _left(result.model), _left(result.model)
    # The emulation rules ran on what the first rules emitted (DQL expansion, vendor Q/DQ).
    by_rule = result.report.by_rule()
    assert by_rule.get("float-emulation-q", 0) + by_rule.get("float-emulation-dq", 0) > 0
    # The value_info the later passes inferred to type the created values is not left behind.
    one_pass = onnx_qrewrite.rewrite(model).model
    assert {vi.name for vi in result.model.graph.value_info} == {vi.name for vi in one_pass.graph.value_info}
    feeds = dict(np.load(path.with_suffix(".inputs.npz")))
    # The Quark originals need Quark's custom-op library: their recorded outputs.
    quark = path.stem.startswith("quark")
    expected = dict(np.load(path.with_suffix(".outputs.npz"))) if quark else run(model, feeds)
    got = run(result.model, feeds)
    for name, value in expected.items():
        assert_bitwise_equal(got[name], value, f"{path.stem}: {name}")


def _dynamic_quantize_matmul(k: int = 16) -> onnx.ModelProto:
    rng = np.random.default_rng(3)
    inits = [
        numpy_helper.from_array(rng.integers(-60, 61, (k, 6)).astype(np.int8), "B"),
        numpy_helper.from_array((rng.random(6) * 0.02 + 1e-3).astype(np.float32), "b_scale"),
        numpy_helper.from_array(rng.integers(-5, 6, 6).astype(np.int8), "b_zp"),
        numpy_helper.from_array(rng.standard_normal(6).astype(np.float32), "bias"),
    ]
    node = helper.make_node(
        "DynamicQuantizeMatMul", ["A", "B", "b_scale", "b_zp", "bias"], ["Y"], domain="com.microsoft", name="dqmm"
    )
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, [5, k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [5, 6])],
        inits,
    )
    opsets = [helper.make_opsetid("", 13), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


@rule_marker("float-emulation-q", "positive")
def test_the_quantizers_inside_a_dynamic_quantize_matmul_expansion_are_emulated_too():
    model = _dynamic_quantize_matmul()
    result = onnx_qrewrite.rewrite(model, rules=FORM)
    assert result.report.by_rule() == {"ms-int-matmul-float": 1, "float-emulation-q": 2}
    assert not _left(result.model)
    rng = np.random.default_rng(4)
    for a in (rng.standard_normal((5, 16)).astype(np.float32), np.zeros((5, 16), np.float32)):
        assert_bitwise_equal(run(result.model, {"A": a})["Y"], run(model, {"A": a})["Y"], "DynamicQuantizeMatMul")
    # Provenance: the emulated nodes continue the expansion's replacement of the original node.
    first = next(n for n in result.model.graph.node if n.metadata_props)
    assert {e.key: e.value for e in first.metadata_props}["onnx_qrewrite.origin"] == "dqmm"
    prefix = first.name.rpartition("/")[0] + "/"  # the replaced node's name or output, the shorter
    assert all(n.name.startswith(prefix) for n in result.model.graph.node)


def test_later_passes_end_when_a_rule_matches_what_it_emits():
    """Each later pass adds a rule to a created node's lineage and never applies a rule twice in one
    lineage: a rule rewriting QuantizeLinear into QuantizeLinear runs once on the node the vendor
    rule made, and the passes stop."""
    rules = Catalogue([*load_catalogue(), *parse_rules(LOOPING, "looping.toml")])
    model = ms_quantize()
    result = onnx_qrewrite.rewrite(model, rules=rules)
    assert [r.rule for r in result.report.rewrites] == ["ms-q-standard", "q-again"]
    x = np.array([0.0, -1.0, 3.3, np.nan], np.float32)
    assert_bitwise_equal(run(result.model, {"x": x})["y"], run(model, {"x": x})["y"], "quantized")


def test_on_replacements_is_for_exact_rules_only_and_must_be_a_boolean():
    bounded = LOOPING.replace('exactness = "exact"', 'exactness = "bounded"')
    with pytest.raises(UsageError, match="'on_replacements' needs an exact rule"):
        parse_rules(bounded, "bounded.toml")
    with pytest.raises(UsageError, match="'on_replacements' must be true or false"):
        parse_rules(LOOPING.replace("on_replacements = true", 'on_replacements = "yes"'), "typo.toml")
    with pytest.raises(UsageError, match="did you mean 'on_replacements'"):
        parse_rules(LOOPING.replace("on_replacements = true", "on_replacement = true"), "typo.toml")
    assert not any(rule.on_replacements for rule in load_catalogue())  # the default catalogue: one pass


def test_without_the_form_nothing_changes():
    """The default catalogue has no on_replacements rule: its rewrites are what one pass makes."""
    path = REAL_MODELS / "ortdyn_cnn_op17_w8u.onnx"
    result = onnx_qrewrite.rewrite(onnx.load(path))
    assert _left(result.model) == {"QuantizeLinear": 6}


def _int32_dequantize(zero_point: int | None) -> onnx.ModelProto:
    inits = [numpy_helper.from_array(np.float32(3.3e-7), "s")]
    if zero_point is not None:
        inits.append(numpy_helper.from_array(np.int32(zero_point), "z"))
    node = helper.make_node("DequantizeLinear", ["x", "s"] + (["z"] if zero_point is not None else []), ["y"])
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.INT32, [None])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


@rule_marker("float-emulation-dq", "positive")
@pytest.mark.parametrize("zero_point", [None, 0])
def test_int32_dequantize_with_a_zero_point_of_0_is_bit_exact(zero_point):
    model = _int32_dequantize(zero_point)
    result = onnx_qrewrite.rewrite(model, rules=FORM)
    assert result.report.by_rule() == {"float-emulation-dq": 1}
    rng = np.random.default_rng(5)
    edges = [2**31 - 1, -(2**31), 2**24 + 1, -(2**24) - 1, 2**24 + 3, 0, 1, -1]
    x = np.concatenate([rng.integers(-(2**31), 2**31, 1 << 16), edges]).astype(np.int32)
    assert_bitwise_equal(run(result.model, {"x": x})["y"], run(model, {"x": x})["y"], "int32 dequantize")


@rule_marker("float-emulation-dq", "negative")
def test_int32_dequantize_with_a_non_zero_zero_point_gives_way():
    """onnxruntime subtracts in int32, wrapping around: not what float arithmetic computes."""
    result = onnx_qrewrite.rewrite(_int32_dequantize(5), rules=FORM, allow_unlowered=True)
    assert not result.report.rewrites
    assert any("int32 with a zero point other than a constant 0" in w for w in result.report.warnings)


def test_bounded_replacements_keep_their_check_when_their_quantizers_are_emulated():
    """Form qdq writes bounded replacements holding QuantizeLinear/DequantizeLinear; emulating those
    keeps the replacement's name prefix and provenance, so verify still finds every bounded
    replacement and checks it at its output (in both provenance modes that record bounds)."""
    from onnx_qrewrite.verify import verify
    from onnx_qrewrite.verify.bounds import bounded_rewrites

    path = REAL_MODELS / "ortdyn_cnn_op17_w8u.onnx"
    model = onnx.load(path)
    qdq = load_catalogue([named_form("qdq")])
    both = load_catalogue([named_form("qdq"), named_form("float-emulation")])
    for provenance in ("compact", "full"):
        alone = onnx_qrewrite.rewrite(model, rules=qdq, provenance=provenance).model
        emulated = onnx_qrewrite.rewrite(model, rules=both, provenance=provenance).model
        assert not _left(emulated), _left(emulated)
        expected = [(r.origin, r.bound, r.outputs) for r in bounded_rewrites(model, alone)]
        assert expected and [(r.origin, r.bound, r.outputs) for r in bounded_rewrites(model, emulated)] == expected
    report = verify(model, emulated, samples=2)
    assert report.passed, report.to_table()
    assert sum("bound" in o.name for o in report.outputs) == len(expected)
