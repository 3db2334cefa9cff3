"""Engine mechanics: stamping equals building, byte for byte; op-count bookkeeping is exact."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnx.numpy_helper
import onnx.parser
import pytest

import onnx_qrewrite
from onnx_qrewrite.io.encoded import to_bytes
from onnx_qrewrite.rewriter import engine
from onnx_qrewrite.rewriter.report import count_ops

MODEL = """
<ir_version: 8, opset_import: ["" : 17, "local" : 1]>
g (float[N] x, bool cond) => (uint8[N] a, uint8[N] b, float c, uint8[N] d, uint8[N] e)
{
    a, sa, za = DynamicQuantizeLinear (x)
    b, sb, zb = DynamicQuantizeLinear (x)
    nx = Neg (x)
    d, c, zd = DynamicQuantizeLinear (nx)
    e = If (cond) <
        then_branch = t () => (uint8[N] ty) { ty, ts, tz = DynamicQuantizeLinear (x) },
        else_branch = f () => (uint8[N] fy) { fy = local.Q (x) }
    >
    u_y, u_s, u_z = DynamicQuantizeLinear (x)
}
<domain: "local", opset_import: ["" : 17]>
Q (v) => (w) { w, s, z = DynamicQuantizeLinear (v) }
"""


@pytest.mark.parametrize("semantics", ["onnxruntime", "spec"])
def test_stamped_replacements_equal_built_ones_byte_for_byte(semantics):
    model = onnx.parser.parse_model(MODEL)
    catalogue = onnx_qrewrite.load_rules(options={"dql-expand": {"semantics": semantics}})
    outputs = []
    for stamp in (True, False):
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        rewritten, report = engine.run(copy, catalogue, engine.EngineOptions(stamp_templates=stamp))
        outputs.append((to_bytes(rewritten), report.to_dict()))
    assert outputs[0] == outputs[1]
    assert len(outputs[0][1]["rewrites"]) == 6


def test_op_counts_are_bookkept_exactly():
    model = onnx.parser.parse_model(MODEL)
    result = onnx_qrewrite.rewrite(model)
    assert result.report.ops_before == count_ops(model)
    assert result.report.ops_after == count_ops(result.model)


def test_initializers_only_replaced_nodes_read_are_removed_others_kept():
    # float16 Quark quantize ignores scale and zero point, so its lowering reads neither.
    text = """
    <ir_version: 8, opset_import: ["" : 17, "com.amd.quark" : 1]>
    g (float[4] x) => (float16[4] y, float[4] scaled)
    <float s = {1.0}>
    {
        y = com.amd.quark.ExtendedQuantizeLinear (x, s, z)
        scaled = Mul (x, s)
    }
    """
    model = onnx.parser.parse_model(text)
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.zeros((), np.float16), "z"))
    result = onnx_qrewrite.rewrite(model)
    assert result.report.removed_initializers == ["z"]
    assert [t.name for t in result.model.graph.initializer if not t.name.startswith("qrw_const")] == ["s"]
    onnx.checker.check_model(result.model, full_check=True)
    assert "  removed 1 initializer no node reads any more" in result.report.summary_lines()


def test_initializers_no_node_left_reads_are_all_removed():
    # As above, but the Mul left in place reads another initializer: the main graph's written
    # nodes name neither candidate (splice._spool_reads_none), so both go without reading them.
    text = """
    <ir_version: 8, opset_import: ["" : 17, "com.amd.quark" : 1]>
    g (float[4] x) => (float16[4] y, float[4] scaled)
    <float s = {1.0}, float t = {2.0}>
    {
        y = com.amd.quark.ExtendedQuantizeLinear (x, s, z)
        scaled = Mul (x, t)
    }
    """
    model = onnx.parser.parse_model(text)
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.zeros((), np.float16), "z"))
    result = onnx_qrewrite.rewrite(model)
    assert result.report.removed_initializers == ["s", "z"]
    assert [t.name for t in result.model.graph.initializer if not t.name.startswith("qrw_const")] == ["t"]
    onnx.checker.check_model(result.model, full_check=True)


def test_shared_quark_models_leave_no_unread_initializer():
    from conftest import REAL_MODEL_NAMES, REAL_MODELS

    for path in [REAL_MODELS / f"{n}.onnx" for n in REAL_MODEL_NAMES]:
        model = onnx_qrewrite.rewrite(path).model
        read = {i for n in model.graph.node for i in n.input}
        assert [t.name for t in model.graph.initializer if t.name not in read] == [], path.name


def test_vendor_imports_of_functions_are_dropped_when_unused():
    text = """
    <ir_version: 8, opset_import: ["" : 17, "local" : 1]>
    g (float[4] x) => (uint8[4] y)
    {
        y = local.Q (x)
    }
    <domain: "local", opset_import: ["" : 17, "com.microsoft" : 1, "com.amd.quark" : 1]>
    Q (a) => (b)
    {
        s = Constant <value = float {0.5}> ()
        z = Constant <value = uint8 {3}> ()
        b = com.microsoft.QuantizeLinear (a, s, z)
    }
    """
    result = onnx_qrewrite.rewrite(onnx.parser.parse_model(text))
    (fn,) = result.model.functions
    # com.microsoft was used by the rewritten node and is gone; com.amd.quark was never ours to drop.
    assert sorted(o.domain for o in fn.opset_import) == ["", "com.amd.quark"]
    assert any("function local.Q" in c.why for c in result.report.opset_changes)


@pytest.mark.parametrize(
    "check, nodes_limit, expected_calls", [(None, 20_000, 1), (None, 10, 0), (True, 10, 1), (False, 20_000, 0)]
)
def test_output_check_policy(monkeypatch, check, nodes_limit, expected_calls):
    from onnx_qrewrite import api
    from onnx_qrewrite.io import model_io

    calls = []
    real = model_io.check_model
    monkeypatch.setattr(model_io, "check_model", lambda m, **kw: calls.append(kw.get("what")) or real(m, **kw))
    monkeypatch.setattr(api, "AUTO_CHECK_MAX_NODES", nodes_limit)
    onnx_qrewrite.rewrite(onnx.parser.parse_model(MODEL), check=check)
    assert sum("rewritten" in (w or "") for w in calls) == expected_calls


_SCOPES = """
<ir_version: 8, opset_import: ["" : 17, "local" : 1]>
agraph (float[N] x, bool cond) => (uint8[N] y1, float r, uint8[N] y_if, uint8[N] y_fn, uint8[N] y2)
{
    n = Neg (x)
    y1, s1, z1 = DynamicQuantizeLinear (n)
    r = Relu (s1)
    y_if = If (cond) <
        then_branch = then_g () => (uint8[N] t_y) {
            t_y, t_s, t_zp = DynamicQuantizeLinear (x)
        },
        else_branch = else_g () => (uint8[N] e_y) {
            e_y = Identity (y1)
        }
    >
    y_fn = local.QuantizeTwice (x)
    y2, s2, z2 = DynamicQuantizeLinear (x)
}
<domain: "local", opset_import: ["" : 17]>
QuantizeTwice (a) => (b)
{
    b, s, zp = DynamicQuantizeLinear (a)
}
"""


def test_encoded_output_is_protobufs_own_serialization_in_every_scope(tmp_path):
    """The main graph is written from framed replacement pieces (never parsed back): the bytes
    must be exactly what protobuf writes for the same model, with subgraphs, a local function
    (its constants prepended as nodes) and unchanged nodes between replaced ones; and ``save``
    must write those bytes."""
    from onnx_qrewrite.io.encoded import EncodedModel

    model = onnx.parser.parse_model(_SCOPES)
    result = onnx_qrewrite.rewrite(model)
    rewritten = result._rewritten
    assert isinstance(rewritten, EncodedModel)
    encoded = to_bytes(rewritten)
    assert onnx.ModelProto.FromString(encoded).SerializeToString() == encoded
    result.save(tmp_path / "out.onnx")
    assert (tmp_path / "out.onnx").read_bytes() == encoded
    assert result.model.SerializeToString() == encoded


def _repeated_quantizers_model() -> onnx.ModelProto:
    """Quantizers whose names repeat in length (a stamp's bytes then come from one compiled format
    per length signature, builders/_stamp.py), with "%" and multi-byte UTF-8 in them, in the main
    graph and in a local function (whose node field has another tag)."""
    h = onnx.helper
    x = h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4])

    def quantizers(names: list[str]) -> list[onnx.NodeProto]:
        return [h.make_node("DynamicQuantizeLinear", ["x"], [f"{n}y", f"{n}s", f"{n}z"], name=n) for n in names]

    main_names = [f"q{i}%é" for i in range(5)] + [f"quant{i}%%ü" for i in range(3)] + ["a%b"]
    body = quantizers([f"f{i}%" for i in range(4)])
    body.append(h.make_node("Identity", ["f0%y"], ["out"]))
    function = h.make_function("local", "F", ["x"], ["out"], body, [h.make_opsetid("", 17)])
    nodes = [*quantizers(main_names), h.make_node("F", ["x"], ["fy"], domain="local")]
    outputs = [h.make_tensor_value_info(f"{n}y", onnx.TensorProto.UINT8, [4]) for n in main_names]
    outputs.append(h.make_tensor_value_info("fy", onnx.TensorProto.UINT8, [4]))
    graph = h.make_graph(nodes, "g", [x], outputs)
    opsets = [h.make_opsetid("", 17), h.make_opsetid("local", 1)]
    return h.make_model(graph, opset_imports=opsets, functions=[function], ir_version=8)


@pytest.mark.parametrize("provenance", ["compact", "full", "none"])
def test_compiled_stamps_equal_built_replacements_byte_for_byte(provenance):
    model = _repeated_quantizers_model()
    outputs = []
    for stamp in (True, False):
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        options = engine.EngineOptions(stamp_templates=stamp, provenance=provenance)
        rewritten, report = engine.run(copy, onnx_qrewrite.load_rules(), options)
        outputs.append((to_bytes(rewritten), report.to_dict()))
    assert outputs[0] == outputs[1]
    assert len(outputs[0][1]["rewrites"]) == 13
    onnx.checker.check_model(onnx.load_from_string(outputs[0][0]), full_check=True)


_FLAT = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[N] x) => (float[N] y, uint8[N] b, float[N] z)
{
    y0 = Relu (x)
    a, sa, za = DynamicQuantizeLinear (y0)
    y1 = Neg (y0)
    y = Abs (y1)
    b, sb, zb = DynamicQuantizeLinear (y)
    z = Sigmoid (y)
}
"""


def test_a_main_graph_without_subgraphs_is_spooled_and_written_as_protobuf_would(tmp_path, monkeypatch):
    """Without subgraphs the main graph's node list is written to a spool as its replacements are
    built (io/spool.py): kept nodes before, between and after replaced ones, in 5-byte writes and
    reads here so that pieces straddle blocks; the bytes, the saved file (twice) and the parsed model
    must all be protobuf's own serialization."""
    from onnx_qrewrite.io import spool
    from onnx_qrewrite.io.encoded import EncodedModel

    monkeypatch.setattr(spool, "_BLOCK", 5)
    result = onnx_qrewrite.rewrite(onnx.parser.parse_model(_FLAT))
    rewritten = result._rewritten
    assert isinstance(rewritten, EncodedModel) and isinstance(rewritten.graph_nodes, spool.Spool)
    encoded = to_bytes(rewritten)
    assert onnx.ModelProto.FromString(encoded).SerializeToString() == encoded
    assert rewritten.byte_size() >= len(encoded)
    for name in ("a.onnx", "b.onnx"):  # the spool reads back as often as asked
        result.save(tmp_path / name)
        assert (tmp_path / name).read_bytes() == encoded
    ops = [n.op_type for n in result.model.graph.node]
    assert ops[0] == "Relu" and ops[-1] == "Sigmoid" and "DynamicQuantizeLinear" not in ops
    assert result.model.SerializeToString() == encoded


def test_plans_are_slotted_and_share_equal_notes():
    """A plan waits in memory for every matched node until its replacement is built: plans have
    no per-instance dict, and equal notes (built anew for each node) are kept once."""
    from onnx_qrewrite.rewriter.builders import Plan

    k = 16
    first = Plan(notes=(f"uint8 x {'u' + 'int8'}", f"K={k}"))
    second = Plan(notes=(f"uint8 x {'ui' + 'nt8'}", f"K={k}"))
    other = Plan(notes=("uint8 x int8", "K=17"))
    assert first.notes == second.notes == ("uint8 x uint8", "K=16")
    assert first.notes is second.notes and other.notes == ("uint8 x int8", "K=17")
    assert not hasattr(first, "__dict__")


def test_applied_rewrite_factory_makes_the_dataclass_entry() -> None:
    """The fast constructor of report entries (RewriteLog reads its rewrites back through it, and
    makes its whole rows with it) sets every field (one added to the dataclass and not to the
    factory fails here) and makes the same frozen object."""
    from onnx_qrewrite.rewriter.report import AppliedRewrite, applied_rewrite

    values = ("r", "n", "Op", "d", "main", ("a", "b"), ("Mul",), ("note",), "bounded", 0.5, "f")
    assert len(values) == len(dataclasses.fields(AppliedRewrite))
    made = applied_rewrite(*values)
    assert type(made) is AppliedRewrite
    assert made == AppliedRewrite(*values)
    assert [getattr(made, f.name) for f in dataclasses.fields(AppliedRewrite)] == list(values)
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.rule = "other"  # type: ignore[misc]
