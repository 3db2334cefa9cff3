"""A rewritten model kept as a skeleton plus encoded main-graph nodes.

Parsing a 400k-node list back into Python protobuf objects costs ~1 s and serializing it again
another ~0.5 s; the command line never needs those objects. ``EncodedModel`` keeps the main graph's
nodes as the wire bytes the engine produced and splices them into the file when saving; the
``ModelProto`` is built only if someone asks for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from onnx_qrewrite import _onnx as onnx
from onnx_qrewrite.io._protowire import splice_graph_chunks, splice_graph_nodes
from onnx_qrewrite.io.spool import Spool

__all__ = ["EncodedModel", "skeleton_of", "to_bytes", "to_chunks", "to_proto"]


class EncodedModel:
    """A model as its skeleton plus the wire bytes of its main graph's nodes (see the module docstring)."""

    def __init__(self, skeleton: onnx.ModelProto, graph_nodes: Sequence[bytes] | Spool):
        #: The model without its main graph's nodes: initializers, I/O, functions, metadata.
        self.skeleton = skeleton
        #: Encoded ``GraphProto.node`` fields of the main graph, in order: pieces to concatenate
        #: (the engine's per-node bytes themselves: joining them would hold the nodes twice), or
        #: the :class:`Spool` the engine wrote them to as it built them (held on disk, not in memory).
        self.graph_nodes = graph_nodes

    def _nodes_size(self) -> int:
        nodes = self.graph_nodes
        return nodes.size if isinstance(nodes, Spool) else sum(map(len, nodes))

    def byte_size(self) -> int:
        """Serialized size in bytes, without serializing (an upper bound by the 16 bytes of field framing)."""
        return self.skeleton.ByteSize() + self._nodes_size() + 16

    def to_bytes(self) -> bytes:
        """The serialized ``ModelProto``: the skeleton with the encoded nodes spliced in."""
        return splice_graph_nodes(self.skeleton, self.graph_nodes)

    def to_chunks(self) -> Iterable[bytes]:
        """The serialized model as pieces to write one after another (no copy of the nodes)."""
        return splice_graph_chunks(self.skeleton, self.graph_nodes)

    def to_proto(self) -> onnx.ModelProto:
        """The model as an ``onnx.ModelProto`` (parses every node: costs time on large graphs)."""
        model = onnx.ModelProto()
        model.ParseFromString(self.to_bytes())
        return model


def to_bytes(model: onnx.ModelProto | EncodedModel) -> bytes:
    """Serialize a ``ModelProto`` or an :class:`EncodedModel` alike."""
    return model.to_bytes() if isinstance(model, EncodedModel) else model.SerializeToString()


def to_chunks(model: onnx.ModelProto | EncodedModel) -> Iterable[bytes]:
    """What :func:`to_bytes` joins, for writing without building the whole file in memory."""
    return model.to_chunks() if isinstance(model, EncodedModel) else [model.SerializeToString()]


def to_proto(model: onnx.ModelProto | EncodedModel) -> onnx.ModelProto:
    """A ``ModelProto`` from either kind of model (an ``EncodedModel`` is parsed)."""
    return model.to_proto() if isinstance(model, EncodedModel) else model


def skeleton_of(model: onnx.ModelProto | EncodedModel) -> onnx.ModelProto:
    """Where initializers, I/O and functions live (main-graph nodes excluded for an EncodedModel)."""
    return model.skeleton if isinstance(model, EncodedModel) else model
