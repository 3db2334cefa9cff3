"""The wire view of a model (onnx_qrewrite/io/wire_model.py) reads what onnx reads, and refuses
malformed bytes with WireError only, in bounded time.

It serves ``verify``'s fast path, which must give the answers the path that parses with onnx gives:
so every field it declares is checked against onnx's descriptors, and every model the tests ship
is read both ways and compared field by field.
"""

from __future__ import annotations

import contextlib
import random
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnx_qrewrite.io import elem_types
from onnx_qrewrite.io.wire_model import _FIELDS, MAX_DEPTH, WireError, WireMessage, iter_graphs, read_model, tensors_of
from onnx_qrewrite.rewriter.graph import iter_scopes
from onnx_qrewrite.verify.drift import approximate_rules
from onnx_qrewrite.verify.inputs import gather_index_limits, input_specs

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = sorted([*ROOT.glob("sample_models/*.onnx"), *ROOT.glob("tests/data/models/*.onnx")])


def _descriptor(message: str):
    head, _, nested = message.partition(".")
    descriptor = getattr(onnx, head).DESCRIPTOR
    if nested:
        descriptor = descriptor.nested_types_by_name[nested]
    return descriptor


@pytest.mark.parametrize("message", sorted(_FIELDS))
def test_field_numbers_are_onnx_s(message: str) -> None:
    descriptor = _descriptor(message)
    for name, (number, _kind, repeated, sub) in _FIELDS[message].items():
        field = descriptor.fields_by_name[name]
        assert field.number == number, f"{message}.{name}"
        assert field.is_repeated == repeated, f"{message}.{name}"
        if sub:
            assert field.message_type.full_name == "onnx." + sub, f"{message}.{name}"


def test_element_type_table_is_onnx_s() -> None:
    for name, number in TensorProto.DataType.items():
        assert elem_types.type_name(number) == name
        if number == TensorProto.UNDEFINED:
            continue
        assert elem_types.np_dtype(number) == np.dtype(helper.tensor_dtype_to_np_dtype(number)), name


def _with_subgraphs_and_function() -> onnx.ModelProto:
    """If with two branch graphs, a Constant tensor, a local function, metadata on nodes."""
    then_out, else_out = helper.make_tensor_value_info("t", 1, [2]), helper.make_tensor_value_info("e", 1, [2])
    then = helper.make_graph([helper.make_node("Identity", ["x"], ["t"], name="then_id")], "then", [], [then_out])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["e"], name="else_neg")], "else", [], [else_out])
    const = helper.make_node("Constant", [], ["c"], value=helper.make_tensor("v", TensorProto.INT64, [3], [1, -2, 3]))
    branch = helper.make_node("If", ["cond"], ["y"], name="branch", then_branch=then, else_branch=other)
    call = helper.make_node("Twice", ["x"], ["z"], domain="local", name="call")
    entry = branch.metadata_props.add()
    entry.key, entry.value = "onnx_qrewrite.rule", "some-rule"
    function = helper.make_function(
        "local", "Twice", ["a"], ["b"], [helper.make_node("Add", ["a", "a"], ["b"])], [helper.make_opsetid("", 17)]
    )
    graph = helper.make_graph(
        [const, branch, call],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 2]),
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2]), helper.make_tensor_value_info("z", 1, None)],
        [helper.make_tensor("w", TensorProto.FLOAT, [2, 1], [0.5, -1.5])],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("local", 1)], functions=[function]
    )
    helper.set_model_props(model, {"onnx_qrewrite.provenance": "compact"})
    return model


def _entries(message) -> list[tuple[str, str]]:
    return [(e.key, e.value) for e in message.metadata_props]


def _node(node) -> tuple:
    attributes = []
    for a in node.attribute:
        tensor = (list(a.t.dims), a.t.data_type, a.t.name) if a.HasField("t") else None
        attributes.append((a.name, a.type, a.i, a.f, a.s, list(a.ints), list(a.floats), list(a.strings), tensor))
    return (node.op_type, node.domain, node.name, list(node.input), list(node.output), _entries(node), attributes)


def _models() -> list[tuple[str, bytes]]:
    out = [(p.name, p.read_bytes()) for p in SHIPPED]
    out.append(("subgraphs+function", _with_subgraphs_and_function().SerializeToString()))
    return out


@pytest.mark.parametrize(("name", "data"), _models(), ids=lambda v: v if isinstance(v, str) else "")
def test_reads_what_onnx_reads(name: str, data: bytes) -> None:
    model = onnx.ModelProto.FromString(data)
    view = read_model(data)
    assert view.ir_version == model.ir_version
    assert view.HasField("graph") and model.HasField("graph")
    assert [(o.domain, o.version) for o in view.opset_import] == [(o.domain, o.version) for o in model.opset_import]
    assert _entries(view) == _entries(model)
    assert input_specs(view) == input_specs(model)
    assert gather_index_limits(view) == gather_index_limits(model)
    assert approximate_rules(view) == approximate_rules(model)
    # Every node of every graph and function, in the same order as the engine's own walk.
    ours = sorted(_node(n) for g in iter_graphs(view) for n in g.node)
    theirs = sorted(_node(n) for scope in iter_scopes(model) for n in scope.container.node)
    assert ours == theirs
    assert [i.name for i in view.graph.initializer] == [i.name for i in model.graph.initializer]
    for ours_t, theirs_t in zip(view.graph.initializer, model.graph.initializer, strict=True):
        assert (list(ours_t.dims), ours_t.data_type, ours_t.data_location) == (
            list(theirs_t.dims),
            theirs_t.data_type,
            theirs_t.data_location,
        )
        assert [(e.key, e.value) for e in ours_t.external_data] == [(e.key, e.value) for e in theirs_t.external_data]
    assert sum(1 for _ in tensors_of(view)) >= len(model.graph.initializer)


def test_external_tensors_are_seen() -> None:
    model = _with_subgraphs_and_function()
    tensor = model.graph.initializer[0]
    tensor.ClearField("float_data")
    tensor.data_location = TensorProto.EXTERNAL
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", "weights.bin"
    view = read_model(model.SerializeToString())
    marked = [(t.name, [(e.key, e.value) for e in t.external_data]) for t in tensors_of(view) if t.data_location == 1]
    assert marked == [("w", [("location", "weights.bin")])]


def _read_everything(data: bytes) -> None:
    view = read_model(data)
    view.decode_all()
    for graph in iter_graphs(view):
        for node in graph.node:
            node.decode_all()
    list(tensors_of(view))


def test_malformed_bytes_raise_wire_error_only_in_bounded_time() -> None:
    """Truncations, flipped bytes and random bytes: WireError or a view, never another exception,
    and never long (each message is decoded once, varints are at most 10 bytes)."""
    data = (ROOT / "sample_models/dynamic_mlp.onnx").read_bytes()
    rng = random.Random(0)
    cases = [data[:n] for n in range(0, len(data), max(1, len(data) // 200))]
    for _ in range(300):
        mutated = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        cases.append(bytes(mutated))
    cases += [bytes(rng.randrange(256) for _ in range(rng.randint(1, 400))) for _ in range(200)]
    cases += [b"\x80" * 100_000, b"\x0a" + b"\xff" * 20, b"\x3a\x05ab"]
    started = time.perf_counter()
    for case in cases:
        with contextlib.suppress(WireError):
            _read_everything(case)
    assert time.perf_counter() - started < 60  # generous: ~1 s on a quiet machine


def test_nesting_deeper_than_protobuf_allows_is_refused() -> None:
    """Made by hand: protobuf itself refuses to build messages this deep."""
    from onnx_qrewrite.io._wire import length_prefixed

    def field(number: int, payload: bytes) -> bytes:
        return bytes([number << 3 | 2]) + length_prefixed(payload)

    graph = b""
    for _ in range(MAX_DEPTH // 3 + 2):  # each level: graph -> node -> attribute -> graph
        graph = field(1, field(5, field(6, graph)))
    data = b"\x08\x08" + field(7, graph)  # ir_version 8, graph
    with pytest.raises(WireError, match="nested deeper"):
        _read_everything(data)
    with pytest.raises(Exception, match=r"MaxDepth|depth|recursion"):  # onnx refuses it too
        onnx.ModelProto.FromString(data)


def test_absent_fields_read_as_protobuf_defaults() -> None:
    view = read_model(helper.make_model(helper.make_graph([], "g", [], [])).SerializeToString())
    assert isinstance(view.graph, WireMessage)
    assert view.graph.node == () and view.functions == () and view.domain == ""
    assert not view.graph.HasField("doc_string")
    with pytest.raises(AttributeError):
        view.not_a_field  # noqa: B018 - the attribute access is the test
