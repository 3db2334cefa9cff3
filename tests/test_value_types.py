"""Element types of undeclared values, traced from their producers (rewriter/value_types.py)."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from onnx_qrewrite.rewriter import value_types
from onnx_qrewrite.rewriter.graph import iter_scopes


def _scope(nodes, inputs, inits=()):
    graph = helper.make_graph(nodes, "g", inputs, [], list(inits))
    model = helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 21)])
    return iter_scopes(model)[-1]


def test_each_kind_of_derivation_and_an_unknown_op():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2])
    scale = numpy_helper.from_array(np.array(0.5, np.float32), "scale")
    zp = numpy_helper.from_array(np.array(3, np.int8), "zp")
    nodes = [
        helper.make_node("Relu", ["x"], ["relu"]),
        helper.make_node("Add", ["relu", "x"], ["add"]),
        helper.make_node("Cast", ["add"], ["cast"], to=TensorProto.DOUBLE),
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("QuantizeLinear", ["cast", "scale", "zp"], ["q"]),
        helper.make_node("QuantizeLinear", ["cast", "scale"], ["q_default"]),
        helper.make_node("DequantizeLinear", ["q", "scale", "zp"], ["dq"]),
        helper.make_node("DynamicQuantizeLinear", ["dq"], ["dq_q", "dq_s", "dq_z"]),
        helper.make_node("TopK", ["x", "shape"], ["top", "top_i"]),
        helper.make_node("Equal", ["x", "x"], ["eq"]),
        helper.make_node("Mystery", ["x"], ["mystery"], domain="vendor"),
        helper.make_node("Relu", ["mystery"], ["after_mystery"]),
    ]
    scope = _scope(nodes, [x], [scale, zp])
    want = {
        "relu": TensorProto.FLOAT16,
        "add": TensorProto.FLOAT16,
        "cast": TensorProto.DOUBLE,
        "shape": TensorProto.INT64,
        "q": TensorProto.INT8,
        "q_default": TensorProto.UINT8,
        "dq": TensorProto.FLOAT,
        "dq_q": TensorProto.UINT8,
        "dq_s": TensorProto.FLOAT,
        "top": TensorProto.FLOAT16,
        "top_i": TensorProto.INT64,
        "eq": TensorProto.BOOL,
        "mystery": None,
        "after_mystery": None,
    }
    assert {name: scope.value_type(name) for name in want} == want
    assert scope.elem_type("relu") is None  # the records alone still say nothing


def test_a_walk_longer_than_its_budget_answers_unknown_until_nearer_values_are_known():
    n = value_types.MAX_STEPS + 10
    nodes = [helper.make_node("Relu", [f"v{i}"], [f"v{i + 1}"]) for i in range(n)]
    scope = _scope(nodes, [helper.make_tensor_value_info("v0", TensorProto.FLOAT16, [2])])
    assert scope.value_type(f"v{n}") is None  # never a guess
    assert scope.value_type(f"v{n - 20}") == TensorProto.FLOAT16
    assert scope.value_type(f"v{n}") == TensorProto.FLOAT16  # from the remembered v{n - 20}


def test_a_subgraph_value_is_traced_in_the_scope_that_writes_it():
    body = helper.make_graph(
        [helper.make_node("Neg", ["outer"], ["inner"])], "body", [], [helper.make_tensor_value_info("inner", 0, None)]
    )
    nodes = [
        helper.make_node("Cast", ["x"], ["outer"], to=TensorProto.FLOAT16),
        helper.make_node("If", ["c"], ["y"], then_branch=body, else_branch=body),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]), helper.make_tensor_value_info("c", 9, [])],
        [],
    )
    model = helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17)])
    inner = next(s for s in iter_scopes(model) if s.parent is not None)
    assert inner.value_type("outer") == TensorProto.FLOAT16
    assert inner.value_type("inner") == TensorProto.FLOAT16
