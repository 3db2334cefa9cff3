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


def _ssa_model(count: int):
    """An SSA chain of nodes writing one to three outputs each (some optional ones absent)."""
    rng = random.Random(5)
    nodes, previous = [], "x"
    for k in range(count):
        outputs = [f"n{k}_o{j}" if rng.random() > 0.2 else "" for j in range(rng.randint(1, 3))]
        outputs[0] = outputs[0] or f"n{k}_o0"
        nodes.append(helper.make_node("Identity" if k % 2 else "Relu", [previous], outputs, name=f"n{k}"))
        previous = outputs[0]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    return helper.make_model(helper.make_graph(nodes, "g", [x], []))


def test_an_ssa_index_answers_a_node_s_other_outputs_from_one_look_up():
    """No output hash repeats (an SSA list): finding the writer of one output remembers it for
    the node's other outputs, and those answers are still a dict of every output's."""
    model = _ssa_model(9000)
    scope = iter_scopes(model)[0]
    expected = {out: i for i, node in enumerate(model.graph.node) for out in node.output if out}
    index = scope._producer_index()
    assert index.unique
    rng = random.Random(8)
    names = [*expected, "x", "missing", ""]
    rng.shuffle(names)
    for name in names[:3000]:
        found = scope.producer(name)
        writer = expected.get(name)
        assert (found is None) if writer is None else (found == model.graph.node[writer]), name
        for sibling in found.output if found is not None else ():
            if sibling:  # remembered with the look-up (or evicted since, and then looked up again)
                assert scope.producer(sibling) == found, sibling


def test_the_walk_for_matching_builds_the_same_index_as_a_look_up_does():
    """iter_scopes(op_codes=True) indexes the outputs in its own walk; the index equals the one
    a scope builds on first look-up."""
    model = _ssa_model(9000)
    walked = iter_scopes(model, op_codes=True)[0]._producers
    alone = iter_scopes(model)[0]._producer_index()
    assert walked is not None
    for field in ("hashes", "owners", "heads", "node_names"):
        assert getattr(walked, field).tolist() == getattr(alone, field).tolist(), field
    assert walked.unique == alone.unique


def test_a_noted_writer_is_the_answer_only_where_the_index_would_give_it():
    """Scope.note_producer (matching notes each candidate as it reads it) answers later look-ups
    of its outputs without the index, in an SSA list; where a name is written twice it is not
    remembered (the last writer, which the index gives, may be another node)."""
    model = _ssa_model(3000)
    scope = iter_scopes(model, op_codes=True)[0]
    nodes = model.graph.node
    for k in range(0, 3000, 7):
        node = nodes[k]
        scope.note_producer(node, node.output[:])
        for out in node.output:
            if out:
                assert out in scope._producers.recent and scope.producer(out) == node
    graph = model.graph
    graph.node.append(helper.make_node("Relu", ["x"], [graph.node[5].output[0]], name="again"))
    scope = iter_scopes(model, op_codes=True)[0]
    assert not scope._producers.unique
    scope.note_producer(graph.node[5], graph.node[5].output[:])
    assert scope._producers.recent == {} and scope.producer(graph.node[5].output[0]) == graph.node[-1]
