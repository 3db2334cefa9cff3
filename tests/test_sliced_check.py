"""onnx's checker in slices (io/sliced_check.py) never accepts a model onnx's checker on the whole
model refuses, and what a user sees of a refused model is the whole check's message.

The models are small and cut into slices of two nodes, so that every name, order and SSA relation
crosses slices; each invalid kind is compared with ``onnx.checker.check_model`` on the whole model.
"""

from __future__ import annotations

import random

import onnx
import pytest
from onnx import TensorProto, helper

from onnx_qrewrite.errors import InvalidModelError
from onnx_qrewrite.io import model_io, sliced_check

SLICE = 2


def _whole_ok(data: bytes) -> bool:
    try:
        onnx.checker.check_model(data)
        return True
    except Exception:  # noqa: BLE001
        return False


def _proven(data: bytes) -> bool:
    """The verdict, the same whether a slice's names are read out whole or node by node."""
    verdicts = set()
    for chunk in (sliced_check.CHUNK_NODES, 1):
        saved, sliced_check.CHUNK_NODES = sliced_check.CHUNK_NODES, chunk
        try:
            verdicts.add(sliced_check.proven_valid(data, onnx.checker.check_model, SLICE))
        finally:
            sliced_check.CHUNK_NODES = saved
    (verdict,) = verdicts
    return verdict


def _chain(n: int = 9, **graph_kw) -> onnx.ModelProto:
    """x -> Relu -> ... -> y, n nodes, an initializer w added by the middle node."""
    nodes = []
    prev = "x"
    for i in range(n):
        out = f"t{i}" if i < n - 1 else "y"
        if i == n // 2:
            nodes.append(helper.make_node("Add", [prev, "w"], [out], name=f"n{i}"))
        else:
            nodes.append(helper.make_node("Relu", [prev], [out], name=f"n{i}"))
        prev = out
    graph = helper.make_graph(
        nodes,
        graph_kw.pop("name", "g"),
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
        [helper.make_tensor("w", TensorProto.FLOAT, [1], [1.0])],
        **graph_kw,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _verdicts(model: onnx.ModelProto) -> tuple[bool, bool]:
    data = model.SerializeToString()
    return _proven(data), _whole_ok(data)


def test_field_numbers_are_onnx_s():
    graph = onnx.GraphProto.DESCRIPTOR.fields_by_name
    assert onnx.ModelProto.DESCRIPTOR.fields_by_name["graph"].number == sliced_check._MODEL_GRAPH
    assert graph["node"].number == sliced_check._GRAPH_NODE
    assert graph["output"].number == sliced_check._GRAPH_OUTPUT
    assert graph["value_info"].number == sliced_check._GRAPH_VALUE_INFO
    assert graph["input"].number == sliced_check._GRAPH_INPUT
    assert onnx.NodeProto.DESCRIPTOR.fields_by_name["op_type"].number == sliced_check._NODE_OP_TYPE
    attribute = onnx.AttributeProto.DESCRIPTOR.fields_by_name
    assert (attribute["g"].number, attribute["graphs"].number) == (6, 11)


def test_valid_models_are_proven_in_slices():
    model = _chain()
    model.graph.value_info.append(helper.make_tensor_value_info("t1", TensorProto.FLOAT, [1]))
    model.graph.output.append(helper.make_tensor_value_info("t0", TensorProto.FLOAT, [1]))  # first slice's
    model.graph.output.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, [1]))  # an initializer
    assert _verdicts(model) == (True, True)
    # a node reading a name several slices back
    model.graph.node.append(helper.make_node("Add", ["t0", "t6"], ["z"], name="late"))
    assert _verdicts(model) == (True, True)


def test_declared_names_are_confirmed_by_the_chunks_their_hash_is_in():
    """The second read of names (_declared_were_written) reads only the chunks whose written
    hashes hold a declared name's: a name whose hash an earlier chunk holds without writing it (a
    collision, made here by adding its hash) is still not proven written, nor is one written by
    a later slice only, while the names a chain really declares are."""
    import numpy as np

    data = _chain().SerializeToString()
    layout = sliced_check._Layout(data, SLICE)
    earlier, declared, hashes = np.empty(0, np.int64), [], []
    for k, chunks in enumerate(layout.slices):
        outputs = layout.outputs if k == len(layout.slices) - 1 else None
        maybe, per_chunk = sliced_check._slice_names(data, chunks, earlier, outputs)
        declared.append(maybe)
        hashes.append(per_chunk)
        earlier = np.sort(np.concatenate((earlier, *per_chunk)))
    assert declared[1] == ["t1"]  # each slice reads the last output of the one before
    assert sliced_check._declared_were_written(data, layout, declared, hashes)
    collided = [list(per_chunk) for per_chunk in hashes]
    collided[0][0] = np.sort(np.append(collided[0][0], hash("nowhere")))
    unwritten = [[*names, "nowhere"] if k == 2 else names for k, names in enumerate(declared)]
    assert not sliced_check._declared_were_written(data, layout, unwritten, collided)
    later = [[*names, "t6"] if k == 1 else names for k, names in enumerate(declared)]
    assert not sliced_check._declared_were_written(data, layout, later, hashes)


def _mutated(edit) -> onnx.ModelProto:
    model = _chain()
    edit(model)
    return model


INVALID = {
    # Appended nodes: nothing else is wrong with the model.
    "output written twice across slices": lambda m: m.graph.node.append(helper.make_node("Relu", ["t5"], ["t1"])),
    "output written twice in one slice": lambda m: m.graph.node.insert(1, helper.make_node("Relu", ["x"], ["t0"])),
    "output named as a graph input": lambda m: m.graph.node.append(helper.make_node("Relu", ["t5"], ["x"])),
    "output named as an initializer": lambda m: m.graph.node.append(helper.make_node("Relu", ["t5"], ["w"])),
    "input a later slice writes": lambda m: m.graph.node[1].input.__setitem__(0, "t6"),
    "input the same slice writes later": lambda m: m.graph.node[2].input.__setitem__(0, "t3"),
    "input nothing writes": lambda m: m.graph.node[5].input.__setitem__(0, "nowhere"),
    "graph output nothing writes": lambda m: m.graph.output.append(
        helper.make_tensor_value_info("nowhere", TensorProto.FLOAT, [1])
    ),
    "graph output without a type": lambda m: m.graph.output.append(onnx.ValueInfoProto(name="t2")),
    "unknown op": lambda m: setattr(m.graph.node[7], "op_type", "NoSuchOp"),
    "attribute of a wrong type": lambda m: m.graph.node[3].attribute.append(helper.make_attribute("alpha", 1.0)),
    "node without inputs and outputs": lambda m: m.graph.node.append(helper.make_node("Relu", [], [], name="e")),
    "domain without an opset import": lambda m: setattr(m.graph.node[8], "domain", "my.domain"),
    "duplicate metadata keys": lambda m: (
        helper.set_model_props(m, {"a": "1"})
        or m.metadata_props.append(onnx.StringStringEntryProto(key="a", value="2"))
    ),
    "IR version too high": lambda m: setattr(m, "ir_version", 99),
    "no opset import": lambda m: m.ClearField("opset_import"),
    "duplicate graph inputs": lambda m: m.graph.input.append(m.graph.input[0]),
    "duplicate initializer names": lambda m: m.graph.initializer.append(m.graph.initializer[0]),
    "initializer with two value fields": lambda m: m.graph.initializer[0].int32_data.append(1),
    "graph without a name": lambda m: setattr(m.graph, "name", ""),
    "invalid local function": lambda m: m.functions.append(
        helper.make_function("local", "f", ["a"], ["b", "b"], [helper.make_node("Relu", ["a"], ["b"])], [])
    ),
}


@pytest.mark.parametrize("kind", sorted(INVALID))
def test_invalid_models_are_never_proven(kind):
    proven, whole = _verdicts(_mutated(INVALID[kind]))
    assert not whole, "the edit should make onnx's checker refuse the model"
    assert not proven


def test_subgraphs_are_checked_whole():
    """A body reads an outer name an earlier slice writes: valid, but only the whole check can
    see it (a slice declares only its nodes' own inputs); and a body that redefines an outer name."""
    model = _chain()
    body = helper.make_graph(
        [helper.make_node("Relu", ["t0"], ["b"])],
        "body",
        [],
        [helper.make_tensor_value_info("b", TensorProto.FLOAT, [1])],
    )
    cond = helper.make_tensor("c", TensorProto.BOOL, [], [True])
    model.graph.initializer.append(cond)
    model.graph.node.append(helper.make_node("If", ["c"], ["z"], then_branch=body, else_branch=body))
    assert _verdicts(model) == (False, True)
    model.graph.node[-1].attribute[0].g.node[0].output[0] = "t1"  # shadows an outer name
    assert _verdicts(model) == (False, False)


def test_experimental_ops_are_checked_whole():
    for op in sliced_check.EXPERIMENTAL_OPS:  # each one's op_type field is searched for
        model = _chain()
        model.graph.node[5].op_type = op
        assert not sliced_check.proven_valid(model.SerializeToString(), onnx.checker.check_model, SLICE), op
    model = _chain()
    model.graph.node[5].name = "ATen"  # the name alone, in another field: not an experimental op
    assert _verdicts(model) == (True, True)


def test_unexpected_bytes_are_checked_whole():
    data = _chain().SerializeToString()
    graph = onnx.ModelProto()
    graph.ParseFromString(data)
    twice = data + sliced_check._field(sliced_check._MODEL_GRAPH, graph.graph.SerializeToString())
    assert not _proven(twice)  # protobuf merges the two graph fields; not sliced
    assert not _proven(data[:-3])


def test_random_renames_never_proven_unless_valid():
    """Names swapped at random among the chain's: whatever onnx says of the whole, a slice
    proof never contradicts it."""
    rng = random.Random(13)
    agree = 0
    for _ in range(60):
        model = _chain(11)
        names = ["x", "w", "nowhere"] + [f"t{i}" for i in range(10)]
        node = model.graph.node[rng.randrange(11)]
        field = node.input if rng.random() < 0.5 else node.output
        field[rng.randrange(len(field))] = rng.choice(names)
        proven, whole = _verdicts(model)
        assert whole or not proven
        agree += proven == whole
    assert agree > 30  # the slices prove most valid ones: the proof is not vacuous


def test_refused_model_reports_the_whole_check_s_message(monkeypatch):
    """What check_serialized raises is the same, sliced or whole (the message is onnx's)."""
    data = _mutated(INVALID["input a later slice writes"]).SerializeToString()
    monkeypatch.setattr(sliced_check, "SLICE_NODES", SLICE)
    monkeypatch.setattr(sliced_check.proven_valid, "__defaults__", (SLICE,))
    messages = []
    for whole in ("", "1"):
        monkeypatch.setenv(model_io.WHOLE_CHECK_ENV, whole)
        with pytest.raises(InvalidModelError) as info:
            model_io.check_serialized(data, what="m.onnx")
        messages.append(str(info.value))
    assert messages[0] == messages[1] and "topologically sorted" in messages[0]


def test_whole_check_env_checks_whole(monkeypatch):
    calls = []
    monkeypatch.setattr(sliced_check.proven_valid, "__defaults__", (SLICE,))
    monkeypatch.setattr(model_io, "proven_valid", lambda *a: calls.append(a) or False)
    data = _chain().SerializeToString()
    monkeypatch.setenv(model_io.WHOLE_CHECK_ENV, "1")
    model_io.check_serialized(data, what="m.onnx")
    assert not calls
    monkeypatch.setenv(model_io.WHOLE_CHECK_ENV, "")
    model_io.check_serialized(data, what="m.onnx")
    assert calls


def test_more_bytes_than_onnx_takes_are_never_proven(monkeypatch):
    """onnx's checker refuses a model above protobuf's 2 GiB whole: slices of it must not pass."""
    data = _chain().SerializeToString()
    assert _proven(data)
    monkeypatch.setattr(sliced_check, "_PROTOBUF_LIMIT", len(data) - 1)
    assert not _proven(data)


def test_a_model_mostly_of_weights_is_checked_whole(monkeypatch):
    """Every slice copies the initializers: where they outweigh what slicing saves (more than a
    quarter of the model, and more than SHARED_BYTES, copied over all slices), the whole model is
    checked (a 200 MB initializer beside 9000 nodes took 1028 MB and 7.4 s in slices, 637 MB and
    4.0 s whole)."""
    model = _chain()
    data = model.SerializeToString()
    assert _proven(data)
    model.graph.initializer.append(helper.make_tensor("big", TensorProto.FLOAT, [64], [0.5] * 64))
    heavy = model.SerializeToString()
    assert _proven(heavy)  # the copies are still below SHARED_BYTES
    monkeypatch.setattr(sliced_check, "SHARED_BYTES", 0)
    assert not _proven(heavy) and _whole_ok(heavy)
