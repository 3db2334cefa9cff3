"""Models whose nodes are not in topological order (AMD Quark's XINT8 output is one): onnxruntime
sorts and runs them, so they are sorted on load, stably; a cycle or a name nothing provides is still
an invalid model (exit code 3, one line naming the node)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from _safety_helpers import cli
from conftest import assert_bitwise_equal, op_types, run
from onnx import TensorProto, helper

import onnx_qrewrite
from onnx_qrewrite.io.toposort import sort_model

_F = TensorProto.FLOAT


def _model(nodes, inputs, outputs, initializers=(), functions=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid("local", 1)] if functions else [])
    return helper.make_model(graph, opset_imports=opsets, ir_version=8, functions=list(functions))


def _dynamic_matmul(reverse: bool) -> onnx.ModelProto:
    """quantize_dynamic's pattern (DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul), nodes reversed."""
    rng = np.random.default_rng(3)
    w = helper.make_tensor("w", TensorProto.INT8, [8, 5], rng.integers(-128, 128, 40).tolist())
    w_scale = helper.make_tensor("w_scale", _F, [], [0.02])
    nodes = [
        helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"], name="dql"),
        helper.make_node("MatMulInteger", ["xq", "w", "xz"], ["acc"], name="mmi"),
        helper.make_node("Cast", ["acc"], ["accf"], name="cast", to=_F),
        helper.make_node("Mul", ["xs", "w_scale"], ["s"], name="scale"),
        helper.make_node("Mul", ["accf", "s"], ["y"], name="out"),
    ]
    if reverse:
        nodes.reverse()
    return _model(
        nodes,
        [helper.make_tensor_value_info("x", _F, [3, 8])],
        [helper.make_tensor_value_info("y", _F, [3, 5])],
        [w, w_scale],
    )


def test_unsorted_model_is_sorted_rewritten_and_computes_the_same():
    original = _dynamic_matmul(reverse=True)
    with pytest.raises(onnx.checker.ValidationError, match="topologically sorted"):
        onnx.checker.check_model(original)
    result = onnx_qrewrite.rewrite(original)
    assert "MatMulInteger" not in op_types(result.model) and "DynamicQuantizeLinear" not in op_types(result.model)
    onnx.checker.check_model(result.model, full_check=True)
    assert any("not in topological order: sorted" in w and "(4 moved)" in w for w in result.report.warnings)
    x = np.random.default_rng(4).standard_normal((3, 8)).astype(np.float32)
    assert_bitwise_equal(run(result.model, {"x": x})["y"], run(original, {"x": x})["y"], "y")
    # The sorted input gives the same rewrite, without the warning.
    same = onnx_qrewrite.rewrite(_dynamic_matmul(reverse=False))
    assert sorted(op_types(same.model)) == sorted(op_types(result.model))
    assert not any("topological" in w for w in same.report.warnings)


def test_sorting_is_stable_and_leaves_sorted_graphs_alone():
    nodes = [
        helper.make_node("Neg", ["a"], ["b"], name="n1"),
        helper.make_node("Relu", ["x"], ["a"], name="n0"),
        helper.make_node("Abs", ["x"], ["c"], name="n2"),
        helper.make_node("Add", ["b", "c"], ["y"], name="n3"),
    ]
    model = _model(nodes, [helper.make_tensor_value_info("x", _F, [2])], [helper.make_tensor_value_info("y", _F, [2])])
    assert sort_model(model, "m") == 2
    assert [n.name for n in model.graph.node] == ["n0", "n1", "n2", "n3"]  # only the broken pair moves
    before = model.SerializeToString()
    assert sort_model(model, "m") == 0
    assert model.SerializeToString() == before


def _if_model(branch_nodes, outer_after: bool) -> onnx.ModelProto:
    """An If whose then-branch reads 'h', produced in the main graph (after the If when outer_after)."""
    branch = helper.make_graph(branch_nodes, "then", [], [helper.make_tensor_value_info("t", _F, [2])])
    other = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["e"])], "else", [], [helper.make_tensor_value_info("e", _F, [2])]
    )
    producer = helper.make_node("Sigmoid", ["x"], ["h"], name="make_h")
    cond = helper.make_node(
        "Constant", [], ["c"], name="cond", value=helper.make_tensor("v", TensorProto.BOOL, [], [1])
    )
    node_if = helper.make_node("If", ["c"], ["y"], name="if", then_branch=branch, else_branch=other)
    nodes = [cond, node_if, producer] if outer_after else [cond, producer, node_if]
    return _model(nodes, [helper.make_tensor_value_info("x", _F, [2])], [helper.make_tensor_value_info("y", _F, [2])])


def test_subgraphs_are_sorted_and_count_as_readers_of_outer_names():
    unsorted_branch = [
        helper.make_node("Neg", ["u"], ["t"], name="b1"),
        helper.make_node("Relu", ["h"], ["u"], name="b0"),
    ]
    model = _if_model(unsorted_branch, outer_after=True)
    x = np.array([-1.5, 2.0], np.float32)
    # onnxruntime 1.31.1 sorts a main graph but refuses an unsorted subgraph; sorting it is harmless.
    want = run(_if_model(unsorted_branch[::-1], outer_after=False), {"x": x})["y"]
    assert sort_model(model, "m") == 4  # the main graph's If and Sigmoid, and the branch's two nodes
    assert [n.name for n in model.graph.node] == ["cond", "make_h", "if"]
    (then,) = [a.g for a in model.graph.node[2].attribute if a.name == "then_branch"]
    assert [n.name for n in then.node] == ["b0", "b1"]
    onnx.checker.check_model(model, full_check=True)
    assert_bitwise_equal(run(model, {"x": x})["y"], want, "y")


def test_model_local_functions_are_sorted():
    body = [helper.make_node("Neg", ["a"], ["o"]), helper.make_node("Relu", ["i"], ["a"])]
    function = helper.make_function("local", "F", ["i"], ["o"], body, [helper.make_opsetid("", 17)])
    model = _model(
        [helper.make_node("F", ["x"], ["y"], domain="local")],
        [helper.make_tensor_value_info("x", _F, [2])],
        [helper.make_tensor_value_info("y", _F, [2])],
        functions=[function],
    )
    assert sort_model(model, "m") == 2
    assert [n.op_type for n in model.functions[0].node] == ["Relu", "Neg"]
    onnx.checker.check_model(model, full_check=True)


def test_cycle_and_missing_names_are_invalid_models_naming_the_node(tmp_path):
    cycle = _model(
        [
            helper.make_node("Relu", ["x"], ["a"], name="first"),
            helper.make_node("Add", ["a", "c"], ["b"], name="loop_a"),
            helper.make_node("Neg", ["b"], ["c"], name="loop_b"),
            helper.make_node("Identity", ["b"], ["y"], name="last"),
        ],
        [helper.make_tensor_value_info("x", _F, [2])],
        [helper.make_tensor_value_info("y", _F, [2])],
    )
    with pytest.raises(
        onnx_qrewrite.InvalidModelError, match=r"input model: node 'loop_a' \(Add, main graph\) is on a cycle"
    ):
        onnx_qrewrite.rewrite(cycle)
    missing_in_branch = _if_model([helper.make_node("Neg", ["nowhere"], ["t"], name="b0")], outer_after=True)
    with pytest.raises(
        onnx_qrewrite.InvalidModelError,
        match=r"node 'if' \(If, main graph\) reads 'nowhere', which no node, graph input or initializer provides",
    ):
        onnx_qrewrite.rewrite(missing_in_branch)
    path = tmp_path / "cycle.onnx"
    path.write_bytes(cycle.SerializeToString())
    out = tmp_path / "out"
    out.mkdir()
    proc = cli("rewrite", path, "-o", out / "o.onnx")
    assert proc.returncode == 3
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and "'loop_a'" in lines[0] and "cycle" in lines[0]
    assert list(out.iterdir()) == []


def test_cli_sorts_and_warns(tmp_path):
    path = tmp_path / "unsorted.onnx"
    path.write_bytes(_dynamic_matmul(reverse=True).SerializeToString())
    proc = cli("rewrite", path, "-o", tmp_path / "o.onnx")
    assert proc.returncode == 0, proc.stderr
    assert "warning: the input's nodes were not in topological order: sorted" in proc.stdout
    onnx.checker.check_model(onnx.load(tmp_path / "o.onnx"), full_check=True)
