"""onnx's checker on a large model's main graph in slices of its nodes, instead of all at once.

Why: onnx's checker parses the whole model into its own C++ copy, ~10x the bytes of a node-heavy
model (127 MB of peak RSS for the 8.5 MB, 100k-node benchmark chain, where the rest of the rewrite
peaks lower). Checked slice by slice, it holds one slice's copy at a time.

What the user sees does not change: when the slices do not *prove* that onnx's checker accepts
the whole model, the caller runs onnx's checker on the whole model, whose message (or acceptance)
is the one reported. So a sliced check only ever says "valid"; it must never say so of a model
the whole check refuses. Why it cannot (onnx's ``check_model``, unchanged from 1.17 to 1.23+):

- *Model-level checks* (IR version, duplicate metadata keys, opset imports, local functions,
  which are checked apart from the main graph) see the same fields in every slice: every field
  of the model but its graph is copied into each.
- *Graph-level checks* (the graph's name, its inputs' and outputs' value infos, the initializers:
  unique names, valid tensors, IR <= 3's "initializer in graph input") see the same fields too:
  every field of the graph but its nodes, outputs and value_info is in each slice; outputs are in
  the last (see below); value_info, which the checker never looks at, in the first.
- *Per node* (``check_node``: op schema, attributes, opset of its domain), each node is in
  exactly one slice, with the same model-level context. Its lexical context matters only to its
  subgraphs: a main graph with any graph-valued attribute (If, Loop, Scan bodies) is not sliced.
- *Topological order*: a node's input must be a graph input, an initializer or the output of an
  earlier node. A slice declares as extra graph inputs exactly the names its nodes read that
  earlier slices' nodes produce (these are never graph inputs or initializers: a node output that
  is one fails its slice's SSA check), so an input is known in the slice iff it is in the whole.
- *SSA* (a name defined once): within a slice onnx checks it; across slices it is checked here,
  exactly (every node output of the graph, as strings, in one set). A repeated name anywhere
  means "not proven".
- *Graph outputs* must be defined somewhere in the graph: the last slice holds them, and declares
  those earlier slices produce.
- onnx prints a warning for "experimental" ops once per check: a graph whose bytes may name one
  is not sliced (so the warning is printed once, as before).

Any byte sequence this module does not expect (a field with another wire type than onnx's, the
graph field twice, a truncated varint) means "not proven" as well. ``tests/test_sliced_check.py``
feeds invalid models of each kind, split into slices of two nodes, and compares the verdict with
onnx's checker on the whole model.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from onnx_qrewrite.io._wire import length_prefixed, varint
from onnx_qrewrite.io.wire_model import WireError, read_varint

__all__ = ["EXPERIMENTAL_OPS", "SHARED_BYTES", "SLICE_NODES", "proven_valid"]

#: Nodes per slice: small enough that one slice's C++ copy is a few MB, large enough that the
#: fields copied into every slice (the graph's inputs, initializers) are paid for rarely.
SLICE_NODES = 8192

#: Ops onnx's checker calls experimental (onnx/checker.cc, ``experimental_ops``), with a few
#: more names of ops that once were: their bytes in a graph mean it is checked whole.
EXPERIMENTAL_OPS = (
    "ATen",
    "Affine",
    "ConstantFill",
    "Crop",
    "DynamicSlice",
    "GRUUnit",
    "GivenTensorFill",
    "ImageScaler",
    "ParametricSoftplus",
    "Scale",
    "ScaledTanh",
    "ThresholdedRelu",
    "Upsample",
)

# Field numbers of onnx.proto (tests/test_sliced_check.py checks them against onnx's descriptors).
_MODEL_GRAPH = 7
_GRAPH_NODE, _GRAPH_OUTPUT, _GRAPH_VALUE_INFO, _GRAPH_INPUT = 1, 12, 13, 11
_NODE_OP_TYPE = 4
_LENGTH_DELIMITED = 2

#: onnx's checker refuses more bytes than this (protobuf's limit): so must the slices.
_PROTOBUF_LIMIT = 2**31 - 1

#: The bytes every slice copies (the model's fields but its graph, the graph's fields but its
#: nodes: initializers above all), times the slices, may be a quarter of the model or this much,
#: whichever is more; above it the whole model is checked. A model whose bytes are mostly weights
#: gains nothing from slices and would pay for them: a 200 MB initializer beside 9000 nodes peaked
#: at 1028 MB in 7.4 s checked in two slices, 637 MB in 4.0 s whole.
SHARED_BYTES = 16 << 20

#: Nodes whose names are read out at a time (see :func:`_slice_names`).
CHUNK_NODES = 1024

#: Fewer bytes than any node field takes (tag, length and an op_type field of one letter).
_SMALLEST_NODE = 5

#: Where a field is in the model's bytes: (start, end).
Span = tuple[int, int]


def proven_valid(data: bytes, check: Callable[[bytes], None], slice_nodes: int = SLICE_NODES) -> bool:
    """Whether onnx's checker (``check``, which raises on a model it refuses) accepts each slice
    of the serialized model ``data`` and the checks across slices hold: then it accepts the whole
    model (see the module docstring). False means only "not proven": check the whole model."""
    if not _SMALLEST_NODE * slice_nodes <= len(data) <= _PROTOBUF_LIMIT:
        return False  # fewer nodes than one slice holds; or more bytes than onnx's checker takes
    try:
        layout = _Layout(data, slice_nodes)
    except WireError:
        return False
    if not layout.ok or len(layout.slices) < 2:
        return False  # one slice would be the whole graph
    if (len(layout.head) + _size(layout.rest)) * len(layout.slices) > max(len(data) // 4, SHARED_BYTES):
        return False  # what every slice copies (initializers above all) would cost more than it saves
    if _experimental_fields().search(data) is not None:
        return False  # a warning onnx prints per check
    import numpy as np

    rest = _joined(data, layout.rest)
    earlier = np.empty(0, np.int64)  # the hashes of every name earlier slices' nodes write, sorted
    declared: list[list[str]] = []
    chunk_hashes: list[list[Any]] = []  # per slice, per chunk: the names its nodes write, hashes sorted
    for k, chunks in enumerate(layout.slices):
        last = k == len(layout.slices) - 1
        found = _slice_names(data, chunks, earlier, layout.outputs if last else None)
        if found is None:
            return False
        maybe, per_chunk = found
        declared.append(maybe)
        chunk_hashes.append(per_chunk)
        written = np.concatenate(per_chunk)
        graph = [rest, _declared_inputs(maybe), *(_joined(data, runs) for runs in chunks)]
        if k == 0:
            graph.append(_joined(data, layout.value_info))
        if last:
            graph.append(_joined(data, layout.outputs))
        model = layout.head + _field(_MODEL_GRAPH, b"".join(graph))
        del graph
        try:
            check(model)
        except Exception:  # noqa: BLE001 - any refusal: the whole check says what it is
            return False
        del model
        earlier = np.concatenate((earlier, written))
        # Sorted runs (the earlier slices', each chunk's): a stable sort (timsort) merges them in
        # linear time, where the default sort was O(n log n) per slice, so O(slices x n log n) in
        # all: 0.45 s of CPU at 500k nodes (61 slices), against 0.02 s at 100k.
        earlier.sort(kind="stable")
        if len(earlier) > 1 and bool((earlier[1:] == earlier[:-1]).any()):
            return False  # a name written twice (or two names of one hash): not proven
    return _declared_were_written(data, layout, declared, chunk_hashes)


def _slice_names(data: bytes, chunks: list[list[Span]], earlier: Any, outputs: list[Span] | None) -> Any:
    """For one slice: the names its nodes read (and ``outputs``' names, for the last) that may
    be written by earlier slices' nodes, whose sorted hashes are ``earlier`` (by hash: confirmed
    by :func:`_declared_were_written`), and per chunk the hashes of the names its nodes write,
    sorted; None when a node holds a subgraph or the bytes do not parse.

    A chunk of nodes at a time, so that few of its names are strings at once: they were the most
    of the sliced check's memory left behind (the allocator's pages that held them). A name read
    in one chunk and written in a later one of the slice may be declared too: the slice then
    fails onnx's checker (a node output that is a graph input), as it fails out of order anyway."""
    import numpy as np

    maybe: set[str] = set()
    written = []
    for runs in chunks:
        names = _names_of(_joined(data, runs))
        if names is None:
            return None
        reads, writes = names
        wanted = set(reads).difference(writes)
        writes = [w for w in writes if w]
        written.append(np.sort(np.fromiter(map(hash, writes), np.int64, len(writes))))
        del reads, writes
        if outputs is not None and runs is chunks[-1]:
            wanted.update(_output_names(data, outputs))
        wanted.discard("")
        hashes = np.fromiter(map(hash, wanted), np.int64, len(wanted))
        maybe.update(w for w, hit in zip(wanted, _among(hashes, earlier), strict=True) if hit)
    return sorted(maybe), written


def _among(values: Any, sorted_values: Any) -> Any:
    """Per value, whether the sorted array ``sorted_values`` holds it (numpy's isin hashes both)."""
    import numpy as np

    at = np.searchsorted(sorted_values, values)
    return sorted_values[np.minimum(at, len(sorted_values) - 1)] == values if len(sorted_values) else at < 0


def _declared_were_written(
    data: bytes, layout: _Layout, declared: list[list[str]], chunk_hashes: list[list[Any]]
) -> bool:
    """Whether each name a slice declared (its hash was among earlier slices' outputs) is exactly
    the output of a node of an earlier slice: a second read of the names of the chunks whose
    written hashes (``chunk_hashes``, per slice and chunk, sorted) hold a declared name's hash.
    A chunk without that hash writes no such name, so it is not read again: a chain declares a
    name or two per slice, and reading every chunk again was a tenth of the whole check's CPU
    time on the 100k-node benchmark chain."""
    asked = set().union(*declared)
    if not asked:
        return True
    import numpy as np

    wanted = np.unique(np.fromiter(map(hash, asked), np.int64, len(asked)))
    first: dict[str, int] = {}
    for k, chunks in enumerate(layout.slices):
        for runs, hashes in zip(chunks, chunk_hashes[k], strict=True):
            if not _among(hashes, wanted).any():
                continue
            names = _names_of(_joined(data, runs))
            if names is None:
                return False
            for name in asked.intersection(names[1]):
                first.setdefault(name, k)
    return all(first.get(name, k) < k for k, names in enumerate(declared) for name in names)


def _size(spans: Sequence[Span]) -> int:
    """How many bytes ``spans`` cover."""
    return sum(b - a for a, b in spans)


def _joined(data: bytes, spans: Sequence[Span]) -> bytes:
    """The bytes of ``spans`` of ``data``, in order."""
    return b"".join(data[a:b] for a, b in spans)


@functools.lru_cache(maxsize=1)
def _experimental_fields() -> re.Pattern[bytes]:
    """A search for the op_type field of any of :data:`EXPERIMENTAL_OPS`: one pass over the bytes,
    where a substring search per op was 13 (their fields all start with the same tag byte, which
    the regex engine scans for; 4x less CPU on the 100k-node chain)."""
    return re.compile(b"|".join(re.escape(_op_field(op)) for op in EXPERIMENTAL_OPS))


def _op_field(op_type: str) -> bytes:
    """How a node's ``op_type`` field holding ``op_type`` is encoded."""
    return varint(_NODE_OP_TYPE << 3 | _LENGTH_DELIMITED) + length_prefixed(op_type.encode())


def _field(number: int, payload: bytes) -> bytes:
    return varint(number << 3 | _LENGTH_DELIMITED) + length_prefixed(payload)


class _Layout:
    """Where the model's parts are in its bytes: ``head``, every field of the model but its graph
    (encoded); ``rest``, the spans of every field of the graph but its nodes, outputs and value_info;
    ``outputs`` and ``value_info``, their fields' spans; ``slices``, per slice of at most
    ``slice_nodes`` nodes, per chunk of :data:`CHUNK_NODES` of them, the spans of its runs of
    adjacent node fields. ``ok`` is False when the
    model is not laid out as this module expects (see the module docstring). Only spans are kept,
    not a tuple per node: this runs to save memory."""

    def __init__(self, data: bytes, slice_nodes: int) -> None:
        self.ok = False
        self.head = b""
        self.rest: list[Span] = []
        self.outputs: list[Span] = []
        self.value_info: list[Span] = []
        self.slices: list[list[list[Span]]] = []
        graph: Span | None = None
        head: list[bytes] = []
        pos, end = 0, len(data)
        while pos < end:
            number, wire, start, value, pos = _field_at(data, pos, end)
            if number == _MODEL_GRAPH:
                if wire != _LENGTH_DELIMITED or graph is not None:
                    return
                graph = (value, pos)
            else:
                head.append(data[start:pos])
        if graph is not None:
            self.head = b"".join(head)
            self.ok = self._walk_graph(data, *graph, slice_nodes)

    def _walk_graph(self, data: bytes, pos: int, end: int, slice_nodes: int) -> bool:
        chunks: list[list[Span]] = []
        runs: list[Span] = []
        in_slice = 0
        node_tag = _GRAPH_NODE << 3 | _LENGTH_DELIMITED
        while pos < end:
            if data[pos] == node_tag:  # a node field, the common case, inline
                start = pos
                n = data[pos + 1] if pos + 1 < end else 0x80
                pos = pos + 2 + n if n < 0x80 else sum(read_varint(data, pos + 1, end))
                if pos > end:
                    raise WireError("truncated field")
                if runs and runs[-1][1] == start:
                    runs[-1] = (runs[-1][0], pos)
                else:
                    runs.append((start, pos))
                in_slice += 1
                if in_slice % CHUNK_NODES == 0 or in_slice == slice_nodes:
                    chunks.append(runs)
                    runs = []
                if in_slice == slice_nodes:
                    self.slices.append(chunks)
                    chunks, in_slice = [], 0
                continue
            number, wire, start, _, pos = _field_at(data, pos, end)
            if number in (_GRAPH_NODE, _GRAPH_OUTPUT, _GRAPH_VALUE_INFO) and wire != _LENGTH_DELIMITED:
                return False
            if number == _GRAPH_NODE:  # (an overlong key)
                return False
            if number == _GRAPH_OUTPUT:
                self.outputs.append((start, pos))
            elif number == _GRAPH_VALUE_INFO:
                self.value_info.append((start, pos))
            else:
                self.rest.append((start, pos))
        if runs:
            chunks.append(runs)
        if chunks:
            self.slices.append(chunks)
        return True


def _field_at(data: bytes, pos: int, end: int) -> tuple[int, int, int, int, int]:
    """(number, wire type, start, start of the value, end) of the field at ``data[pos:]``;
    groups and unknown wire types raise WireError."""
    start = pos
    key, pos = read_varint(data, pos, end)
    wire = key & 7
    if wire == _LENGTH_DELIMITED:
        n, pos = read_varint(data, pos, end)
        value, pos = pos, pos + n
    elif wire == 0:
        value = pos
        _, pos = read_varint(data, pos, end)
    elif wire in (1, 5):
        value, pos = pos, pos + (8 if wire == 1 else 4)
    else:
        raise WireError(f"wire type {wire}")
    if pos > end:
        raise WireError("truncated field")
    return key >> 3, wire, start, value, pos


def _output_names(data: bytes, outputs: Sequence[Span]) -> list[str]:
    """The names of the graph's outputs (ValueInfoProto field 1)."""
    names = []
    for start, end in outputs:
        _, _, _, value, stop = _field_at(data, start, end)
        info = _Message.value_info()
        info.ParseFromString(data[value:stop])
        names.append(info.name)
    return names


def _names_of(body: bytes) -> tuple[list[str], list[str]] | None:
    """Every input and output name the encoded node fields ``body`` hold, in order; None when
    a node holds a graph-valued attribute (the slice is then not checked apart) or the bytes do
    not parse. One parse: the node fields parsed as one *singular* field merge into one message,
    whose repeated fields are all the nodes' in order (protobuf's merge of a repeated field)."""
    merged = _Message.nodes()
    try:
        merged.ParseFromString(body)
        node = merged.node
        attribute = node.attribute
        if attribute.HasField("g") or len(attribute.graphs):
            return None
        return node.input[:], node.output[:]
    except Exception:  # noqa: BLE001 - whatever protobuf refuses (e.g. invalid UTF-8): not proven
        return None


def _declared_inputs(names: Sequence[str]) -> bytes:
    """Graph input fields declaring ``names`` (float tensors of shape [1]: the checker does not
    compare a value's type with its readers' without shape inference, which it does not run here)."""
    return b"".join(_field(_GRAPH_INPUT, _declared_value(name)) for name in names)


@functools.lru_cache(maxsize=1)
def _declared_type() -> bytes:
    """A TypeProto field: tensor_type { elem_type: FLOAT, shape { dim { dim_value: 1 } } }."""
    dim = _field(1, varint(1 << 3) + varint(1))  # Dimension.dim_value = 1
    shape = _field(1, dim)  # TensorShapeProto.dim
    tensor = varint(1 << 3) + varint(1) + _field(2, shape)  # Tensor.elem_type = FLOAT, .shape
    return _field(2, _field(1, tensor))  # ValueInfoProto.type (TypeProto.tensor_type)


def _declared_value(name: str) -> bytes:
    return _field(1, name.encode("utf-8")) + _declared_type()


class _Message:
    """Message classes of a private descriptor pool: a node holding only what is read here."""

    _classes: ClassVar[dict[str, Any]] = {}

    @classmethod
    def nodes(cls) -> Any:
        return cls._get("Nodes")()

    @classmethod
    def value_info(cls) -> Any:
        return cls._get("Named")()

    @classmethod
    def _get(cls, name: str) -> Any:
        if not cls._classes:
            cls._classes.update(_build_classes())
        return cls._classes[name]


def _build_classes() -> dict[str, Any]:
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    proto = descriptor_pb2.FileDescriptorProto(name="onnx_qrewrite_sliced_check.proto", package="qrsc")
    proto.syntax = "proto2"
    string, bytes_, message = 9, 12, 11
    optional, repeated = 1, 3
    attribute = proto.message_type.add(name="Attribute")
    attribute.field.add(name="g", number=6, type=bytes_, label=optional)
    attribute.field.add(name="graphs", number=11, type=bytes_, label=repeated)
    node = proto.message_type.add(name="Node")
    node.field.add(name="input", number=1, type=string, label=repeated)
    node.field.add(name="output", number=2, type=string, label=repeated)
    # Singular: every node's attributes merge into one, whose g is set if any of theirs is.
    node.field.add(name="attribute", number=5, type=message, label=optional, type_name=".qrsc.Attribute")
    nodes = proto.message_type.add(name="Nodes")
    nodes.field.add(name="node", number=_GRAPH_NODE, type=message, label=optional, type_name=".qrsc.Node")
    named = proto.message_type.add(name="Named")
    named.field.add(name="name", number=1, type=string, label=optional)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"qrsc.{name}")) for name in ("Nodes", "Named")
    }
