"""Scope.producer finds the node writing a value through hashes of the output names (graph.py):
it must answer as a dict of every output name, built in node order, would."""

from __future__ import annotations

import random

from onnx import TensorProto, helper

from onnx_qrewrite.rewriter.graph import iter_scopes


def test_producers_are_the_nodes_a_dict_of_outputs_gives():
    rng = random.Random(3)
    pool = [f"v{i}" for i in range(40)] + ["", "a/b", "a/c"]
    nodes = [
        helper.make_node(
            "Identity" if k % 2 else "Relu", ["x"], [rng.choice(pool) for _ in range(rng.randint(1, 3))], name=f"n{k}"
        )
        for k in range(9000)  # more than one chunk of nodes
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    model = helper.make_model(helper.make_graph(nodes, "g", [x], []))
    scope = iter_scopes(model)[0]
    expected = {out: i for i, node in enumerate(model.graph.node) for out in node.output if out}
    for name in [*pool, "x", "missing"] * 3:  # asked again: answered from the recent look-ups too
        found = scope.producer(name)
        if name in expected:
            assert found is not None and found == model.graph.node[expected[name]]
        else:
            assert found is None, name
