"""The catalogue as an onnxscript rewrite-rule set gives exactly what onnx_qrewrite.rewrite gives."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.numpy_helper
import onnx.parser
import onnx_ir
import pytest
from _rule_helpers import LOOPING, ms_quantize
from conftest import REAL_MODEL_NAMES, REAL_MODELS, assert_bitwise_equal, run
from onnxscript import rewriter

import onnx_qrewrite
import onnx_qrewrite.onnxscript_rules as qrw

MODELS = list(REAL_MODEL_NAMES)


@pytest.fixture(scope="module")
def rules():
    return qrw.rule_set()


@pytest.mark.parametrize("name", MODELS)
def test_onnxscript_rewriter_with_our_rules_matches_our_rewrite(name, rules):
    path = REAL_MODELS / f"{name}.onnx"
    via_onnxscript = rewriter.rewrite(onnx.load(path), pattern_rewrite_rules=rules)
    leftover = [
        n.op_type
        for n in via_onnxscript.graph.node
        if n.domain not in ("", "ai.onnx") or n.op_type == "DynamicQuantizeLinear"
    ]
    assert leftover == []
    onnx.checker.check_model(via_onnxscript)
    ours = onnx_qrewrite.rewrite(path, keep_opset=True).model  # the pattern rewriter never raises opsets
    feeds = dict(np.load(REAL_MODELS / f"{name}.inputs.npz"))
    want, got = run(ours, feeds), run(via_onnxscript, feeds)
    for output in want:
        assert_bitwise_equal(got[output], want[output], f"{name}: {output}")


def test_a_node_the_catalogue_declines_is_left_alone(rules):
    # float16 with a scale other than 1: the engine refuses to guess (NUMERICS.md), so the match fails.
    text = """
    <ir_version: 8, opset_import: ["" : 17, "com.amd.quark" : 1]>
    g (float[4] x) => (float16[4] y)
    <float s = {0.5}>
    {
        y = com.amd.quark.ExtendedQuantizeLinear (x, s, zp)
    }
    """
    model = onnx.parser.parse_model(text)
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.zeros((), np.float16), "zp"))
    out = rewriter.rewrite(model, pattern_rewrite_rules=rules)
    assert [n.op_type for n in out.graph.node] == ["ExtendedQuantizeLinear"]


# --- on_replacements: rules that lower what earlier rules created (the float-emulation form) ------


def _rule_names(model: onnx.ModelProto) -> list[str]:
    """The onnxscript rules that made each node, as onnxscript records them (latest first)."""
    tag = "pkg.onnxscript.rewriter.rule_name"
    return [next((p.value for p in n.metadata_props if p.key == tag), "") for n in model.graph.node]


@pytest.mark.parametrize("on_replacements", [True, False])
def test_on_replacements_is_honoured_as_the_engine_honours_it(on_replacements):
    """The vendor rule makes a standard QuantizeLinear; "q-again" matches it and emits another.
    Marked on_replacements it runs once on the vendor rule's node (never again on its own: it is in
    the node's lineage), as the engine's later passes do; unmarked it leaves the replacement alone,
    as the engine's single pass does. Before the rule set honoured the key, both cases looped
    forever (onnxscript visits the nodes a rewrite inserts)."""
    from onnx_qrewrite.rewriter.catalogue import Catalogue, load_catalogue, parse_rules

    text = LOOPING if on_replacements else LOOPING.replace("on_replacements = true\n", "")
    catalogue = Catalogue([*load_catalogue(), *parse_rules(text, "looping.toml")])
    engine = onnx_qrewrite.rewrite(ms_quantize(), rules=catalogue, keep_opset=True)
    expected = ["ms-q-standard", "q-again"] if on_replacements else ["ms-q-standard"]
    assert [r.rule for r in engine.report.rewrites] == expected
    out = rewriter.rewrite(ms_quantize(), pattern_rewrite_rules=qrw.rule_set(catalogue))
    assert [n.op_type for n in out.graph.node] == ["QuantizeLinear"]
    (made_by,) = _rule_names(out)
    assert [name.partition(":")[0] for name in made_by.split(", ")][::-1] == expected
    x = np.array([0.0, -1.0, 3.3, np.nan], np.float32)
    assert_bitwise_equal(run(out, {"x": x})["y"], run(ms_quantize(), {"x": x})["y"], "quantized")


def test_a_model_rewritten_again_starts_afresh():
    """The record of created nodes lasts one walk: rewriting the result again treats its nodes as
    given, as ``onnx_qrewrite.rewrite`` of a rewritten model does (its first pass tries every rule)."""
    from onnx_qrewrite.rewriter.catalogue import Catalogue, load_catalogue, parse_rules

    text = LOOPING.replace("on_replacements = true\n", "")
    catalogue = Catalogue([*load_catalogue(), *parse_rules(text, "looping.toml")])
    rules = qrw.rule_set(catalogue)
    model = onnx_ir.serde.deserialize_model(ms_quantize())
    assert rules.apply_to_model(model) == 1  # the vendor node becomes a standard QuantizeLinear
    assert rules.apply_to_model(model) == 1  # a new walk: "q-again" applies to it once
    assert rules.apply_to_model(model) == 1  # and again, once per walk: never in a loop
    engine = onnx_qrewrite.rewrite(onnx_qrewrite.rewrite(ms_quantize(), rules=catalogue).model, rules=catalogue)
    assert [r.rule for r in engine.report.rewrites] == ["q-again"]


@pytest.mark.parametrize(
    "path",
    [REAL_MODELS / "ortdyn_cnn_op17_w8u.onnx", REAL_MODELS / "ortqdq_ms_cnn_op17_a16u_w16s.onnx"],
    ids=lambda p: p.stem,
)
def test_the_float_emulation_form_leaves_nothing_quantized_and_matches_our_rewrite(path):
    """The form's Q/DQ emulation runs on the Q/DQ the DynamicQuantizeLinear expansion and the vendor
    rules emit, through onnxscript as through the engine, bit for bit."""
    from onnx_qrewrite.rewriter.catalogue import load_catalogue, named_form

    form = load_catalogue([named_form("float-emulation")])
    via_onnxscript = rewriter.rewrite(onnx.load(path), pattern_rewrite_rules=qrw.rule_set(form))
    quantized = {"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "MatMulInteger", "ConvInteger"}
    assert [n.op_type for n in via_onnxscript.graph.node if n.op_type in quantized or n.domain] == []
    ours = onnx_qrewrite.rewrite(path, rules=form, keep_opset=True).model
    feeds = dict(np.load(path.with_suffix(".inputs.npz")))
    want, got = run(ours, feeds), run(via_onnxscript, feeds)
    for output in want:
        assert_bitwise_equal(got[output], want[output], f"{path.stem}: {output}")


# --- ops with optional outputs: Attention's present, MultiHeadAttention's present_key/value -------


def _attention_with_present(outputs):
    from test_unfuse_attention import past_attention_model, past_feeds

    model = past_attention_model(2, 4, 3, 32, 4)
    if outputs == 1:  # no present: the past is refused, so the node without it and its output
        model = past_attention_model(2, 4, 0, 32, 4, with_past=False)
        del model.graph.node[0].output[1:]
        del model.graph.output[1:]
    feeds = past_feeds(2, 4, 3, 32, 4)
    return model, {i.name: feeds[i.name] for i in model.graph.input}


def _mha_with_state(outputs):
    from test_unfuse_mha_state import mha_feeds, mha_model

    past = 3 if outputs == 3 else None
    names = ("y", "present_key", "present_value")[:outputs]
    model = mha_model(2, 4, 4, past, 32, 4, mask="raw", outputs=names)
    feeds = mha_feeds(2, 4, 4, past, 32, 4, mask="raw")
    return model, {i.name: feeds[i.name] for i in model.graph.input}


OPTIONAL_OUTPUTS = {
    "attention-present": (_attention_with_present, 2),
    "attention": (_attention_with_present, 1),
    "mha-past-present": (_mha_with_state, 3),
    "mha-present-key": (_mha_with_state, 2),
    "mha": (_mha_with_state, 1),
}


@pytest.mark.parametrize("make, outputs", list(OPTIONAL_OUTPUTS.values()), ids=list(OPTIONAL_OUTPUTS))
def test_optional_outputs_are_matched_and_written_as_our_rewrite_writes_them(make, outputs, rules):
    """A node is matched by the pattern binding every output it declares, so its present outputs are
    replaced too (before, the one-output pattern bound only output 0 and the replacement's extra
    outputs failed onnxscript's count)."""
    model, feeds = make(outputs)
    via_onnxscript = rewriter.rewrite(model, pattern_rewrite_rules=rules)
    assert {n.domain for n in via_onnxscript.graph.node} <= {"", "ai.onnx"}
    ours = onnx_qrewrite.rewrite(model, keep_opset=True).model
    want, got = run(ours, feeds), run(via_onnxscript, feeds)
    assert len(want) == outputs
    for output in want:
        assert_bitwise_equal(got[output], want[output], output)


def test_a_node_with_an_omitted_output_before_its_last_is_left_alone(rules):
    """MultiHeadAttention writing present_value but not present_key: onnxscript would name the
    replacement of the omitted output '', so no pattern matches (the engine lowers it)."""
    from test_unfuse_mha_state import mha_model

    model = mha_model(2, 4, 4, None, 32, 4, outputs=("y", "", "present_value"))
    out = rewriter.rewrite(model, pattern_rewrite_rules=rules)
    assert [n.op_type for n in out.graph.node] == ["MultiHeadAttention"]
