"""Nodes in every scope get rewritten: If/Loop/Scan bodies (nested), and model-local functions.

Also: generated names never collide (ONNX wants names unique across nested scopes), the output
is deterministic, and a second rewrite changes nothing.
"""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnx.parser
import pytest
from conftest import assert_bitwise_equal, run

import onnx_qrewrite
from onnx_qrewrite.rewriter.graph import iter_scopes

NESTED = """
<ir_version: 8, opset_import: ["" : 17, "local" : 1]>
agraph (float[N] x, bool cond) => (uint8[N] y_if, float s_loop, uint8[N] y_fn, float s_scan)
{
    y_if = If (cond) <
        then_branch = then_g () => (uint8[N] t_y) {
            t_y, t_s, t_zp = DynamicQuantizeLinear (x)
        },
        else_branch = else_g () => (uint8[N] e_y) {
            e_inner = If (cond) <
                then_branch = inner_t () => (uint8[N] it_y) {
                    it_y, it_s, it_zp = DynamicQuantizeLinear (x)
                },
                else_branch = inner_e () => (uint8[N] ie_y) {
                    neg = Neg (x)
                    ie_y, ie_s, ie_zp = DynamicQuantizeLinear (neg)
                }
            >
            e_y = Identity (e_inner)
        }
    >
    trip = Constant <value = int64 {3}> ()
    s0 = Constant <value = float {0.0}> ()
    s_loop = Loop (trip, cond, s0) <
        body = loop_body (int64 i, bool c, float acc) => (bool c_out, float acc_out) {
            c_out = Identity (c)
            l_y, l_s, l_zp = DynamicQuantizeLinear (x)
            acc_out = Add (acc, l_s)
        }
    >
    y_fn = local.QuantizeTwice (x)
    axes0 = Constant <value = int64[1] {0}> ()
    x2 = Unsqueeze (x, axes0)
    s_scan, scan_scales = Scan (s0, x2) <
        num_scan_inputs = 1,
        body = scan_body (float sacc, float[N] row) => (float sacc_out, float row_s) {
            sc_y, row_s, sc_zp = DynamicQuantizeLinear (row)
            sacc_out = Add (sacc, row_s)
        }
    >
}
<domain: "local", opset_import: ["" : 17]>
QuantizeTwice (a) => (b)
{
    b, s, zp = DynamicQuantizeLinear (a)
}
"""


def _nested_model() -> onnx.ModelProto:
    return onnx.parser.parse_model(NESTED)


def _all_names(model: onnx.ModelProto) -> list[str]:
    """Value names (SSA: unique across every scope) and, separately prefixed, node names (unique
    among nodes): ONNX keeps the two namespaces apart."""
    names = []
    for scope in iter_scopes(model):
        for node in scope.container.node:
            names.extend(o for o in node.output if o)
            if node.name:
                names.append(f"node:{node.name}")
        if isinstance(scope.container, onnx.GraphProto):
            names.extend(t.name for t in scope.container.initializer)
    return names


def _dql_count(model: onnx.ModelProto) -> int:
    return sum(n.op_type == "DynamicQuantizeLinear" for s in iter_scopes(model) for n in s.container.node)


@pytest.fixture(scope="module")
def nested():
    original = _nested_model()
    onnx.checker.check_model(original, full_check=True)
    return original, onnx_qrewrite.rewrite(original)


def test_every_scope_is_rewritten(nested):
    original, result = nested
    assert _dql_count(original) == 6
    assert _dql_count(result.model) == 0
    scopes = collections.Counter(r.scope.split("/")[0].split(".")[0] for r in result.report.rewrites)
    assert scopes == {"main": 5, "function:local": 1}
    onnx.checker.check_model(result.model, full_check=True)


def test_function_gets_constant_nodes_not_initializers(nested):
    _, result = nested
    (fn,) = result.model.functions
    assert [n.op_type for n in fn.node[:3]] == ["Constant"] * 3
    fn_values = {o for n in fn.node for o in n.output}
    assert not fn_values & {t.name for t in result.model.graph.initializer}


@pytest.mark.parametrize("cond", [True, False])
def test_outputs_match_the_original(nested, cond):
    original, result = nested
    feeds = {"x": np.array([-1.5, 0.25, 3.0, 7.75], np.float32), "cond": np.array(cond)}
    want, got = run(original, feeds), run(result.model, feeds)
    for name in want:
        assert_bitwise_equal(got[name], want[name], name)


def test_generated_names_are_unique_model_wide(nested):
    original, result = nested
    assert len(_all_names(original)) == len(set(_all_names(original)))
    names = _all_names(result.model)
    dupes = [n for n, c in collections.Counter(names).items() if c > 1]
    assert not dupes


def test_names_that_look_generated_do_not_collide():
    # The original already uses the names our scheme would pick first.
    text = """
    <ir_version: 8, opset_import: ["" : 13]>
    g (float[4] x) => (uint8[4] y, float[1] clash)
    {
        y, s, zp = DynamicQuantizeLinear <name_hint = 0> (x)
    }
    """
    model = onnx.parser.parse_model(text.replace(" <name_hint = 0>", ""))
    model.graph.node[0].name = "dql"
    extra = onnx.helper.make_node("Identity", ["x"], ["dql/min_output_0"], name="dql/min")
    model.graph.node.append(extra)
    model.graph.node.append(onnx.helper.make_node("ReduceMax", ["dql/min_output_0"], ["clash"], keepdims=1))
    onnx.checker.check_model(model, full_check=True)
    result = onnx_qrewrite.rewrite(model)
    names = _all_names(result.model)
    assert len(names) == len(set(names))
    x = np.array([1, -2, 3, 0.5], np.float32)
    assert_bitwise_equal(run(result.model, {"x": x})["clash"], run(model, {"x": x})["clash"], "clash")


def test_deterministic_and_idempotent(nested, tmp_path):
    original, result = nested
    again = onnx_qrewrite.rewrite(original)
    assert again.model.SerializeToString() == result.model.SerializeToString()
    second = onnx_qrewrite.rewrite(result.model)
    assert not second.report.changed
    assert second.model.SerializeToString() == result.model.SerializeToString()


def test_input_model_object_is_not_modified(nested):
    original, _ = nested
    before = original.SerializeToString()
    onnx_qrewrite.rewrite(original)
    assert original.SerializeToString() == before


def test_onnx_ir_model_in_onnx_ir_model_out():
    import onnx_ir as ir

    model = ir.serde.deserialize_model(_nested_model())
    result = onnx_qrewrite.rewrite(model)
    assert isinstance(result.model, ir.Model)
    assert not any(n.op_type == "DynamicQuantizeLinear" for n in result.model.graph.all_nodes())
    assert sum(1 for n in model.graph.all_nodes() if n.op_type == "DynamicQuantizeLinear") == 5


def test_one_reader_index_gives_each_view_of_who_reads_a_value():
    """Scope.reads is a scope's one reader index: ``readers`` lists each reading node once (a read
    inside its subgraphs counts), ``input_readers`` one node per input slot (a runtime's graph links
    a value so; subgraph reads do not count). After an edit, ``invalidate`` makes it read again."""
    model = onnx.parser.parse_model(
        """
        <ir_version: 8, opset_import: ["" : 17]>
        agraph (float[N] x, bool c) => (float[N] y, float[N] z)
        {
            sq = Mul (x, x)
            y = If (c) <
                then_branch = t_g () => (float[N] t_y) { t_y = Add (sq, x) },
                else_branch = e_g () => (float[N] e_y) { e_y = Identity (sq) }
            >
            z = Relu (sq)
        }
        """
    )
    (main,) = [s for s in iter_scopes(model) if s.path == "main"]
    assert main.reads()["x"] == [(0, 0), (0, 1), (1, -1)]
    assert [n.op_type for n in main.readers("x")] == ["Mul", "If"]
    assert [n.op_type for n in main.input_readers("x")] == ["Mul", "Mul"]
    assert [n.op_type for n in main.readers("sq")] == ["If", "Relu"]
    assert [n.op_type for n in main.input_readers("sq")] == ["Relu"]
    assert main.readers("") == main.readers("y") == main.input_readers("") == []
    main.container.node[2].input[0] = "x"
    main.invalidate()
    assert [n.op_type for n in main.readers("sq")] == ["If"]
    assert [n.op_type for n in main.input_readers("x")] == ["Mul", "Mul", "Relu"]


def _pairs_beside_subgraphs(pairs: int, subgraphs: int) -> onnx.ModelProto:
    """``pairs`` com.microsoft Q/DQ pairs in a chain (each kept reading its scale and zero point,
    initializers of the main graph), then ``subgraphs`` If nodes reading the chain's end."""
    from onnx import TensorProto, helper, numpy_helper

    nodes, inits, x = [], [], "x"
    for i in range(pairs):
        inits += [numpy_helper.from_array(np.array(0.5, np.float32), f"s{i}")]
        inits += [numpy_helper.from_array(np.array(3, np.uint8), f"z{i}")]
        for op, src, dst in (("QuantizeLinear", x, f"q{i}"), ("DequantizeLinear", f"q{i}", f"d{i}")):
            nodes.append(helper.make_node(op, [src, f"s{i}", f"z{i}"], [dst], domain="com.microsoft"))
        x = f"d{i}"
    for j in range(subgraphs):
        branches = {
            key: helper.make_graph(
                [helper.make_node(op, [x], [f"{key}{j}"])],
                f"{key}{j}",
                [],
                [helper.make_tensor_value_info(f"{key}{j}", TensorProto.FLOAT, None)],
            )
            for key, op in (("then_branch", "Identity"), ("else_branch", "Neg"))
        }
        nodes.append(helper.make_node("If", ["c"], [f"if{j}"], **branches))
    nodes.append(helper.make_node("Sum", [*(f"if{j}" for j in range(subgraphs)), x], ["y"]))
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [4]),
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        inits,
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, ir_version=9, opset_imports=opsets)


def test_kept_initializers_are_looked_up_once_not_once_per_scope(monkeypatch):
    """Which names a replacement still reads is noted among the initializers of every scope with
    one look-up per name: a loop over the scopes per name made 3000 Q/DQ pairs beside 3000 If
    nodes take 39 s instead of 1.7 s. Counted, not timed: each scope's names are taken once, not
    once per kept name. The kept scales and zero points stay."""
    from onnx_qrewrite.rewriter.graph import Scope

    asked = collections.Counter()
    original = Scope.initializer_names

    def counted(self):
        asked["initializer_names"] += 1
        return original(self)

    monkeypatch.setattr(Scope, "initializer_names", counted)
    model = _pairs_beside_subgraphs(20, 30)
    result = onnx_qrewrite.rewrite(model)
    scopes = 1 + 2 * 30
    assert asked["initializer_names"] == scopes  # once per scope, for 40 replacements
    assert {i.name for i in result.model.graph.initializer} >= {f"{p}{i}" for p in "sz" for i in range(20)}
    feeds = {"x": np.linspace(-3, 3, 4, dtype=np.float32), "c": np.array(True)}
    assert_bitwise_equal(run(result.model, feeds)["y"], run(model, feeds)["y"])
