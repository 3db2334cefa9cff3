"""Encode ``NodeProto`` bytes directly, and splice them into graphs in one parse.

Why: building ``onnx.NodeProto`` objects from Python costs ~9 µs each (measured: 300k nodes in
2.75 s, plus 0.9 s to ``extend`` them into a graph), which alone exceeds the time budget for
rewriting a 20k-block model. Encoding the few fields a replacement node has (inputs, outputs, name,
op_type, attributes, domain, metadata) as protobuf wire bytes and parsing a whole node list in one
C++ call is 3x cheaper and keeps output byte-identical for identical input.

Field numbers come from the installed ``onnx`` descriptors, never hard-coded.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import onnx

__all__ = ["encode_node", "encode_attribute", "replace_nodes"]


def _tag(message: type, field_name: str) -> bytes:
    number = message.DESCRIPTOR.fields_by_name[field_name].number
    return _varint((number << 3) | 2)  # wire type 2: length-delimited


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_SMALL_VARINTS = [_varint(i) for i in range(1 << 14)]


def _field(tag: bytes, payload: bytes) -> bytes:
    n = len(payload)
    return tag + (_SMALL_VARINTS[n] if n < 16384 else _varint(n)) + payload


_NODE_INPUT = _tag(onnx.NodeProto, "input")
_NODE_OUTPUT = _tag(onnx.NodeProto, "output")
_NODE_NAME = _tag(onnx.NodeProto, "name")
_NODE_OP = _tag(onnx.NodeProto, "op_type")
_NODE_ATTR = _tag(onnx.NodeProto, "attribute")
_NODE_DOMAIN = _tag(onnx.NodeProto, "domain")
_NODE_META = _tag(onnx.NodeProto, "metadata_props")
_ENTRY_KEY = _tag(onnx.StringStringEntryProto, "key")
_ENTRY_VALUE = _tag(onnx.StringStringEntryProto, "value")
_GRAPH_NODE = _tag(onnx.GraphProto, "node")
_FUNCTION_NODE = _tag(onnx.FunctionProto, "node")


def encode_attribute(attribute: onnx.AttributeProto) -> bytes:
    """One attribute field of a node, ready to concatenate into ``encode_node``'s ``attributes``."""
    return _field(_NODE_ATTR, attribute.SerializeToString())


def encode_metadata(entries: Sequence[tuple[str, str]]) -> bytes:
    """Metadata entries of a node (shared by every node one rewrite creates)."""
    return b"".join(
        _field(_NODE_META, _field(_ENTRY_KEY, k.encode()) + _field(_ENTRY_VALUE, v.encode()))
        for k, v in entries
    )


def encode_node(
    op_type: str,
    inputs: Sequence[str],
    outputs: Sequence[str],
    name: str,
    *,
    domain: str = "",
    attributes: bytes = b"",
    metadata: bytes = b"",
) -> bytes:
    """Serialized ``NodeProto`` body (without the enclosing graph field)."""
    parts = [_field(_NODE_INPUT, i.encode()) for i in inputs]
    parts.extend(_field(_NODE_OUTPUT, o.encode()) for o in outputs)
    parts.append(_field(_NODE_NAME, name.encode()))
    parts.append(_field(_NODE_OP, op_type.encode()))
    parts.append(attributes)
    if domain:
        parts.append(_field(_NODE_DOMAIN, domain.encode()))
    parts.append(metadata)
    return b"".join(parts)


def replace_nodes(
    container: onnx.GraphProto | onnx.FunctionProto,
    replacements: dict[int, Iterable[bytes]],
    prepend: Iterable[bytes] = (),
) -> None:
    """Replace ``container.node[i]`` by the encoded nodes ``replacements[i]``, keeping order.

    Unchanged nodes are re-serialized (C++), the new list is parsed back in one call: the graph
    stays topologically sorted because each replacement takes its original's place.
    """
    tag = _FUNCTION_NODE if isinstance(container, onnx.FunctionProto) else _GRAPH_NODE
    chunks = [_field(tag, body) for body in prepend]
    for index, node in enumerate(container.node):
        new = replacements.get(index)
        if new is None:
            chunks.append(_field(tag, node.SerializeToString()))
        else:
            chunks.extend(_field(tag, body) for body in new)
    container.ClearField("node")
    container.MergeFromString(b"".join(chunks))
