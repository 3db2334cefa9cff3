"""A read-only view of a serialized ONNX model, decoded from its protobuf wire bytes without onnx.

Why: importing onnx (and the numpy it pulls in) costs more than a whole ``polygraphy --help``
(benchmarks/bench.py, start-up case), and ``verify`` hands onnxruntime the model's bytes anyway:
what it needs of the model itself (graph inputs and their types, node domains, provenance
metadata) is a handful of fields. This module decodes those fields from the bytes already read
(:mod:`onnx_qrewrite.io.model_file`) and nothing else.

The view spells fields as onnx's Python classes do (``model.graph.node[0].op_type``,
``info.type.tensor_type.shape.dim``, ``HasField``, ``metadata_props`` entries with ``key`` and
``value``), so a reader written against ``onnx.ModelProto`` (``verify.inputs.input_specs``,
``verify.drift.approximate_rules``) reads a view unchanged: one implementation, not two that could
drift apart. Field numbers are those of onnx.proto; ``tests/test_wire_model.py`` checks them
against the installed onnx's descriptors and checks that every test model reads the same through
the view as through onnx.

Untrusted bytes: every read is bounds-checked, varints are at most 10 bytes, messages nest at most
:data:`MAX_DEPTH` deep (protobuf's own default limit), and a message is decoded only when one of
its fields is read, each at most once. Anything malformed or unexpected (a field with the wrong
wire type, a group, invalid UTF-8 in a string) raises :class:`WireError`: callers then take the
path that parses with onnx, which reports the problem as it always did.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

__all__ = ["MAX_DEPTH", "WireError", "WireMessage", "iter_graphs", "read_model", "read_varint", "tensors_of"]

#: Deepest nesting of messages accepted (protobuf's default recursion limit).
MAX_DEPTH = 100


class WireError(ValueError):
    """The bytes are not what this reader accepts (see the module docstring)."""


# Field kinds: how a field's wire value becomes its Python value.
_STR, _BYTES, _INT, _FLOAT, _MSG = "str", "bytes", "int", "float", "msg"

#: message name -> {field name: (number, kind, repeated, message name of a message field)}
_FIELDS: dict[str, dict[str, tuple[int, str, bool, str]]] = {
    "ModelProto": {
        "ir_version": (1, _INT, False, ""),
        "producer_name": (2, _STR, False, ""),
        "producer_version": (3, _STR, False, ""),
        "domain": (4, _STR, False, ""),
        "model_version": (5, _INT, False, ""),
        "doc_string": (6, _STR, False, ""),
        "graph": (7, _MSG, False, "GraphProto"),
        "opset_import": (8, _MSG, True, "OperatorSetIdProto"),
        "metadata_props": (14, _MSG, True, "StringStringEntryProto"),
        "training_info": (20, _MSG, True, "TrainingInfoProto"),
        "functions": (25, _MSG, True, "FunctionProto"),
    },
    "TrainingInfoProto": {
        "initialization": (1, _MSG, False, "GraphProto"),
        "algorithm": (2, _MSG, False, "GraphProto"),
    },
    "OperatorSetIdProto": {"domain": (1, _STR, False, ""), "version": (2, _INT, False, "")},
    "StringStringEntryProto": {"key": (1, _STR, False, ""), "value": (2, _STR, False, "")},
    "GraphProto": {
        "node": (1, _MSG, True, "NodeProto"),
        "name": (2, _STR, False, ""),
        "initializer": (5, _MSG, True, "TensorProto"),
        "doc_string": (10, _STR, False, ""),
        "input": (11, _MSG, True, "ValueInfoProto"),
        "output": (12, _MSG, True, "ValueInfoProto"),
        "value_info": (13, _MSG, True, "ValueInfoProto"),
        "sparse_initializer": (15, _MSG, True, "SparseTensorProto"),
        "metadata_props": (16, _MSG, True, "StringStringEntryProto"),
    },
    "NodeProto": {
        "input": (1, _STR, True, ""),
        "output": (2, _STR, True, ""),
        "name": (3, _STR, False, ""),
        "op_type": (4, _STR, False, ""),
        "attribute": (5, _MSG, True, "AttributeProto"),
        "doc_string": (6, _STR, False, ""),
        "domain": (7, _STR, False, ""),
        "overload": (8, _STR, False, ""),
        "metadata_props": (9, _MSG, True, "StringStringEntryProto"),
    },
    "AttributeProto": {
        "name": (1, _STR, False, ""),
        "f": (2, _FLOAT, False, ""),
        "i": (3, _INT, False, ""),
        "s": (4, _BYTES, False, ""),
        "t": (5, _MSG, False, "TensorProto"),
        "g": (6, _MSG, False, "GraphProto"),
        "floats": (7, _FLOAT, True, ""),
        "ints": (8, _INT, True, ""),
        "strings": (9, _BYTES, True, ""),
        "tensors": (10, _MSG, True, "TensorProto"),
        "graphs": (11, _MSG, True, "GraphProto"),
        "doc_string": (13, _STR, False, ""),
        "type": (20, _INT, False, ""),
        "ref_attr_name": (21, _STR, False, ""),
        "sparse_tensor": (22, _MSG, False, "SparseTensorProto"),
        "sparse_tensors": (23, _MSG, True, "SparseTensorProto"),
    },
    "TensorProto": {
        "dims": (1, _INT, True, ""),
        "data_type": (2, _INT, False, ""),
        "name": (8, _STR, False, ""),
        "external_data": (13, _MSG, True, "StringStringEntryProto"),
        "data_location": (14, _INT, False, ""),
    },
    "SparseTensorProto": {
        "values": (1, _MSG, False, "TensorProto"),
        "indices": (2, _MSG, False, "TensorProto"),
        "dims": (3, _INT, True, ""),
    },
    "ValueInfoProto": {
        "name": (1, _STR, False, ""),
        "type": (2, _MSG, False, "TypeProto"),
        "doc_string": (3, _STR, False, ""),
    },
    "TypeProto": {
        "tensor_type": (1, _MSG, False, "TypeProto.Tensor"),
        "sequence_type": (4, _MSG, False, "TypeProto.Sequence"),
        "map_type": (5, _MSG, False, "TypeProto.Map"),
        "denotation": (6, _STR, False, ""),
        "sparse_tensor_type": (8, _MSG, False, "TypeProto.SparseTensor"),
        "optional_type": (9, _MSG, False, "TypeProto.Optional"),
    },
    "TypeProto.Tensor": {"elem_type": (1, _INT, False, ""), "shape": (2, _MSG, False, "TensorShapeProto")},
    "TypeProto.SparseTensor": {"elem_type": (1, _INT, False, ""), "shape": (2, _MSG, False, "TensorShapeProto")},
    "TypeProto.Sequence": {"elem_type": (1, _MSG, False, "TypeProto")},
    "TypeProto.Optional": {"elem_type": (1, _MSG, False, "TypeProto")},
    "TypeProto.Map": {"key_type": (1, _INT, False, ""), "value_type": (2, _MSG, False, "TypeProto")},
    "TensorShapeProto": {"dim": (1, _MSG, True, "TensorShapeProto.Dimension")},
    "TensorShapeProto.Dimension": {
        "dim_value": (1, _INT, False, ""),
        "dim_param": (2, _STR, False, ""),
        "denotation": (3, _STR, False, ""),
    },
    "FunctionProto": {
        "name": (1, _STR, False, ""),
        "input": (4, _STR, True, ""),
        "output": (5, _STR, True, ""),
        "attribute": (6, _STR, True, ""),
        "node": (7, _MSG, True, "NodeProto"),
        "doc_string": (8, _STR, False, ""),
        "opset_import": (9, _MSG, True, "OperatorSetIdProto"),
        "domain": (10, _STR, False, ""),
        "attribute_proto": (11, _MSG, True, "AttributeProto"),
        "value_info": (12, _MSG, True, "ValueInfoProto"),
        "overload": (13, _STR, False, ""),
        "metadata_props": (14, _MSG, True, "StringStringEntryProto"),
    },
}

#: message name -> {field number: (field name, kind, repeated, message name)}
_BY_NUMBER = {
    message: {number: (name, kind, repeated, sub) for name, (number, kind, repeated, sub) in fields.items()}
    for message, fields in _FIELDS.items()
}
#: The wire type each kind is written with (repeated numbers may also come packed, wire type 2).
_WIRE_TYPE = {_STR: 2, _BYTES: 2, _MSG: 2, _INT: 0, _FLOAT: 5}
_DEFAULTS: dict[str, Any] = {_STR: "", _BYTES: b"", _INT: 0, _FLOAT: 0.0}


def read_varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    """The varint at ``data[pos:]`` (at most 10 bytes, within ``end``) and the position after it."""
    result = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise WireError("truncated or overlong varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


def _int64(value: int) -> int:
    """A varint read as protobuf's int64 (two's complement)."""
    value &= 0xFFFFFFFFFFFFFFFF
    return value - (1 << 64) if value >= 1 << 63 else value


def _float(data: bytes, pos: int) -> float:
    return float(struct.unpack_from("<f", data, pos)[0])


class WireMessage:
    """One message of the model, decoded on first read of any of its fields (see the module docstring)."""

    __slots__ = ("_data", "_depth", "_end", "_fields", "_message", "_start")

    def __init__(self, data: bytes, start: int, end: int, message: str, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise WireError(f"messages nested deeper than {MAX_DEPTH}")
        self._data, self._start, self._end, self._message, self._depth = data, start, end, message, depth
        self._fields: dict[str, Any] | None = None

    def _decoded(self) -> dict[str, Any]:
        fields = self._fields
        if fields is None:
            fields = self._fields = self._decode()
        return fields

    def _decode(self) -> dict[str, Any]:
        data, pos, end = self._data, self._start, self._end
        spec_of = _BY_NUMBER[self._message]
        out: dict[str, Any] = {}
        while pos < end:
            key, pos = read_varint(data, pos, end)
            number, wire_type = key >> 3, key & 7
            if number == 0:
                raise WireError("field number 0")
            if wire_type == 0:
                value, pos = read_varint(data, pos, end)
            elif wire_type == 2:
                length, pos = read_varint(data, pos, end)
                value, pos = pos, pos + length  # value: where the payload starts
                if pos > end:
                    raise WireError("length-delimited field runs past its message")
            elif wire_type == 5:
                value, pos = pos, pos + 4
            elif wire_type == 1:
                value, pos = pos, pos + 8
            else:
                raise WireError(f"wire type {wire_type} (groups are not used by ONNX)")
            if pos > end:
                raise WireError("fixed-size field runs past its message")
            spec = spec_of.get(number)
            if spec is None:
                continue  # a field this reader does not use (protobuf keeps it as unknown)
            name, kind, repeated, sub = spec
            expected = _WIRE_TYPE[kind]
            if wire_type != expected:
                if repeated and wire_type == 2 and kind in (_INT, _FLOAT):
                    out.setdefault(name, []).extend(self._packed(kind, value, pos))
                    continue
                raise WireError(f"{self._message}.{name}: wire type {wire_type}, expected {expected}")
            item: Any
            if kind == _INT:
                item = _int64(value)
            elif kind == _FLOAT:
                item = _float(data, value)
            elif kind == _STR:
                try:
                    item = data[value:pos].decode("utf-8")
                except UnicodeDecodeError:
                    raise WireError(f"{self._message}.{name}: invalid UTF-8") from None
            elif kind == _BYTES:
                item = data[value:pos]
            else:
                item = WireMessage(data, value, pos, sub, self._depth + 1)
            if repeated:
                out.setdefault(name, []).append(item)
            elif kind == _MSG and name in out:
                raise WireError(f"{self._message}.{name}: given twice (protobuf would merge them)")
            else:
                out[name] = item
        return out

    def _packed(self, kind: str, start: int, end: int) -> list[Any]:
        data = self._data
        values: list[Any] = []
        pos = start
        if kind == _FLOAT:
            if (end - start) % 4:
                raise WireError("packed floats of a length not a multiple of 4")
            return [_float(data, p) for p in range(start, end, 4)]
        while pos < end:
            value, pos = read_varint(data, pos, end)
            values.append(_int64(value))
        return values

    def __getattr__(self, name: str) -> Any:
        spec = _FIELDS[self._message].get(name)
        if spec is None:
            raise AttributeError(f"{self._message} has no field {name!r} in this reader")
        value = self._decoded().get(name)
        if value is not None:
            return value
        _, kind, repeated, sub = spec
        if repeated:
            return ()
        if kind == _MSG:  # as protobuf does: an absent message reads as an empty one
            return WireMessage(b"", 0, 0, sub, self._depth + 1)
        return _DEFAULTS[kind]

    def HasField(self, name: str) -> bool:
        """Whether a singular field is present (protobuf's ``HasField``)."""
        spec = _FIELDS[self._message].get(name)
        if spec is None or spec[2]:
            raise ValueError(f"{self._message} has no singular field {name!r}")
        return name in self._decoded()

    def decode_all(self) -> None:
        """Decode this message and every message in it (raises :class:`WireError` on bad bytes)."""
        for value in self._decoded().values():
            for item in value if isinstance(value, list) else (value,):
                if isinstance(item, WireMessage):
                    item.decode_all()


def read_model(data: bytes) -> WireMessage:
    """A view of the ``ModelProto`` serialized in ``data``; its fields decode as they are read."""
    model = WireMessage(data, 0, len(data), "ModelProto", 0)
    model._decoded()
    return model


def iter_graphs(model: WireMessage) -> Iterator[WireMessage]:
    """Every graph and function body of ``model``: the main graph, the graphs held by attributes
    at any depth (If/Loop/Scan bodies), the training graphs, and each local function (its nodes
    and their subgraphs), as objects with a ``node`` list."""
    stack: list[WireMessage] = [model.graph]
    for info in model.training_info:
        stack.extend(g for g in (info.initialization, info.algorithm))
    stack.extend(model.functions)
    while stack:
        graph = stack.pop()
        yield graph
        for node in graph.node:
            for attr in node.attribute:
                if attr.HasField("g"):
                    stack.append(attr.g)
                stack.extend(attr.graphs)


def tensors_of(model: WireMessage) -> Iterator[WireMessage]:
    """Every tensor stored in ``model``: initializers (dense and sparse) of every graph and the
    tensors of node attributes (Constant values and the like), in any graph or function."""
    for graph in iter_graphs(model):
        yield from getattr(graph, "initializer", ())
        for sparse in getattr(graph, "sparse_initializer", ()):
            yield sparse.values
            yield sparse.indices
        for node in graph.node:
            for attr in (*node.attribute, *getattr(graph, "attribute_proto", ())):
                if attr.HasField("t"):
                    yield attr.t
                yield from attr.tensors
                sparse_tensors = [attr.sparse_tensor] if attr.HasField("sparse_tensor") else []
                for sparse in (*sparse_tensors, *attr.sparse_tensors):
                    yield sparse.values
                    yield sparse.indices
