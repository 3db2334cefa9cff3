"""Provenance modes: which created nodes carry rule/origin metadata, and that every mode that
keeps provenance lets a reader (the verifier's localiser) trace any created node back."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import helper
from test_dynamic_quantize import KERNEL_OPS, dql_model

import onnx_qrewrite
from onnx_qrewrite.cli import main
from onnx_qrewrite.io.encoded import to_proto
from onnx_qrewrite.rewriter import provenance

META = {(provenance.RULE_KEY, "dql-expand"), (provenance.ORIGIN_KEY, "dql")}


def _meta(node: onnx.NodeProto) -> set[tuple[str, str]]:
    return {(p.key, p.value) for p in node.metadata_props}


def two_dql_model() -> onnx.ModelProto:
    """Two DynamicQuantizeLinear nodes with the SAME name, back to back (names need not be unique).
    Their outputs' names are longer than the node name, so created names start with ``dql/``."""
    model = dql_model(13)
    first = model.graph.node[0]
    first.output[:] = ["hidden", "hidden_scale", "hidden_zp"]
    out = ["output", "output_scale", "output_zero_point"]
    second = helper.make_node("DynamicQuantizeLinear", ["x"], out, name="dql")
    model.graph.node.append(second)
    for value, name in zip(model.graph.output, out, strict=True):
        value.name = name
    return model


@pytest.mark.parametrize("stamp", [True, False])
def test_compact_puts_the_entries_on_the_first_created_node_only(stamp):
    from onnx_qrewrite.rewriter import engine

    model = two_dql_model()
    rewritten, report = engine.run(model, onnx_qrewrite.load_rules(), engine.EngineOptions(stamp_templates=stamp))
    nodes = list(to_proto(rewritten).graph.node)
    n = len(KERNEL_OPS)
    assert len(nodes) == 2 * n
    assert [_meta(node) for node in nodes] == ([META] + [set()] * (n - 1)) * 2
    assert provenance.model_mode(to_proto(rewritten)) == "compact"
    # Every created node is traced back, and the two same-named replacements stay apart.
    assert provenance.attribute_nodes(nodes) == [("dql-expand", "dql")] * (2 * n)
    assert {node.name.rpartition("/")[0] for node in nodes[:n]} == {"dql"}
    assert {node.name.rpartition("/")[0] for node in nodes[n:]} == {"dql"}
    assert len({node.name for node in nodes}) == 2 * n
    # The report keeps the full mapping.
    assert [list(r.created_nodes) for r in report.rewrites] == [
        [x.name for x in nodes[:n]],
        [x.name for x in nodes[n:]],
    ]


def test_full_and_none():
    full = onnx_qrewrite.rewrite(dql_model(13), provenance="full").model
    assert all(_meta(node) == META for node in full.graph.node)
    assert provenance.model_mode(full) == "full"
    none = onnx_qrewrite.rewrite(dql_model(13), provenance="none").model
    assert all(not node.metadata_props for node in none.graph.node)
    assert provenance.model_mode(none) == "none"
    assert provenance.attribute_nodes(none.graph.node) == [None] * len(KERNEL_OPS)
    sizes = [onnx_qrewrite.rewrite(dql_model(13), provenance=m).model.ByteSize() for m in ("full", "compact", "none")]
    assert sizes[0] > sizes[1] > sizes[2]


def test_an_original_node_after_a_replacement_is_not_attributed_to_it():
    model = dql_model(13)
    model.graph.node.append(helper.make_node("Identity", ["y_scale"], ["s2"], name="other"))
    model.graph.output.append(helper.make_tensor_value_info("s2", onnx.TensorProto.FLOAT, []))
    rewritten = onnx_qrewrite.rewrite(model).model
    assert provenance.attribute_nodes(rewritten.graph.node)[-1] is None


def test_unknown_mode_is_a_usage_error():
    with pytest.raises(onnx_qrewrite.UsageError, match="--provenance bogus"):
        onnx_qrewrite.rewrite(dql_model(13), provenance="bogus")


def test_cli_option(tmp_path):
    src = tmp_path / "dql.onnx"
    onnx.save(dql_model(13), src)
    out = tmp_path / "out.onnx"
    result = CliRunner().invoke(main, ["-q", "rewrite", str(src), "-o", str(out), "--provenance", "full"])
    assert result.exit_code == 0, result.output
    assert all(_meta(node) == META for node in onnx.load(out).graph.node)
    result = CliRunner().invoke(main, ["-q", "rewrite", str(src), "-o", str(out), "--provenance", "bogus"])
    assert result.exit_code == 2


def _break_zero_point(model: onnx.ModelProto) -> onnx.ModelProto:
    """The zero point's QuantizeLinear (not the first node of the replacement) made to divide by +1."""
    broken = onnx.ModelProto()
    broken.CopyFrom(model)
    node = next(n for n in broken.graph.node if "y_zero_point" in n.output)
    broken.graph.initializer.append(onnx.numpy_helper.from_array(np.array(1.0, np.float32), "plus_one"))
    node.input[1] = "plus_one"
    return broken


@pytest.mark.parametrize("mode", ["compact", "full", "none"])
def test_the_localiser_traces_a_node_in_every_mode(mode):
    pytest.importorskip("onnxruntime")
    from onnx_qrewrite.verify import verify

    original = dql_model(13)
    rewritten = _break_zero_point(onnx_qrewrite.rewrite(original, provenance=mode).model)
    loc = verify(original, rewritten).localization
    assert loc is not None and loc.found and loc.comparison.name == "y_zero_point"
    if mode == "none":
        assert (loc.rule, loc.origin) == (None, None)
        assert "--provenance none" in loc.note
    else:
        assert (loc.rule, loc.origin) == ("dql-expand", "dql")
        assert loc.note is None


@pytest.mark.parametrize("stamp", [True, False])
def test_report_names_every_created_node_even_after_a_clash(stamp):
    """Stamped replacements keep their names compactly (prefix + the template's hints); a name a
    clash made different must still be reported as written."""
    from onnx_qrewrite.rewriter import engine

    model = two_dql_model()
    model.graph.node[1].name = "dql2"
    # An existing node already holds the name the second replacement's first node would get.
    model.graph.node.append(helper.make_node("Identity", ["x"], ["dql2/min"], name="dql2/min"))
    model.graph.output.append(helper.make_tensor_value_info("dql2/min", onnx.TensorProto.FLOAT, ["d0"]))
    rewritten, report = engine.run(model, onnx_qrewrite.load_rules(), engine.EngineOptions(stamp_templates=stamp))
    nodes = [n.name for n in to_proto(rewritten).graph.node]
    n = len(KERNEL_OPS)
    first, second = report.rewrites
    assert list(first.created_nodes) == nodes[:n] and list(second.created_nodes) == nodes[n : 2 * n]
    assert second.created_nodes[0] == "dql2/min_1" and second.created_nodes[-1] == nodes[2 * n - 1]
    assert len(second.created_nodes) == n and second.created_nodes == tuple(nodes[n : 2 * n])
    assert report.to_dict()["rewrites"][1]["created_nodes"] == nodes[n : 2 * n]


def test_created_names_start_with_the_shorter_of_node_name_and_first_output():
    """The prefix is written about three times per created node: the shorter original name is
    used, and the full node name stays in the first node's origin entry and in the report."""
    model = dql_model(13)
    model.graph.node[0].name = "encoder/layer.0/input/DynamicQuantizeLinear"
    result = onnx_qrewrite.rewrite(model)
    nodes = list(result.model.graph.node)
    assert all(node.name.startswith("y/") for node in nodes)
    assert _meta(nodes[0]) == {
        (provenance.RULE_KEY, "dql-expand"),
        (provenance.ORIGIN_KEY, "encoder/layer.0/input/DynamicQuantizeLinear"),
    }
    assert provenance.attribute_nodes(nodes) == [("dql-expand", "encoder/layer.0/input/DynamicQuantizeLinear")] * len(
        nodes
    )
    assert list(result.report.rewrites[0].created_nodes) == [n.name for n in nodes]
    # A node name no longer than its first output is the prefix (the common exporter case).
    assert all(n.name.startswith("dql/") for n in onnx_qrewrite.rewrite(two_dql_model()).model.graph.node)
