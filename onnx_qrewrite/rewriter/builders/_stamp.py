"""Record one replacement, stamp the rest: the engine's fast path for rules that fire thousands
of times with the same structure (a 20k-block model has 20k identical DynamicQuantizeLinear
expansions).

A builder opts in with ``template_key(site, options, plan) -> Hashable | None``: equal keys promise
an identical structure (ops, attributes, constants, wiring); only names differ. The first build
runs normally through an :class:`~onnx_qrewrite.rewriter.builders.Emitter`, which also records its nodes
symbolically; every later node with the same key is *stamped*: fresh names are drawn in the same
order from the same hints, the node's own input/output names are substituted, and the bytes are
assembled from pre-encoded pieces. The result is byte-identical to a normal build (tested), at a
fraction of the cost (no attribute encoding, no per-field function calls).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from onnx_qrewrite.io._protowire import _NODE_INPUT, _NODE_NAME, _NODE_OUTPUT
from onnx_qrewrite.io._wire import SMALL_VARINTS, length_prefixed, varint
from onnx_qrewrite.rewriter.report import CreatedNames

if TYPE_CHECKING:
    from onnx_qrewrite.rewriter.builders import Emitter, Site
    from onnx_qrewrite.rewriter.graph import NameAllocator

__all__ = ["Template"]

# A recorded name: ("fresh", slot) | ("in", i) | ("out", j) | ("static", encoded bytes)
_Ref = tuple


class _NodeSpec:
    __slots__ = ("domain", "head", "op_type", "tail")

    def __init__(self, op_type: str, domain: str, head: list, tail: bytes):
        self.op_type = op_type
        self.domain = domain
        self.head = head  # [(tag, ref)] for inputs, outputs, name, in field order
        self.tail = tail  # op_type, attributes, domain: the same for every stamp


class Template:
    """A recorded replacement, compiled to a table: per stamp, each name's length-prefixed bytes
    are computed once and every node is one ``join`` over precomputed indices into
    ``[names..., static pieces..., first node's metadata, other nodes' metadata]``."""

    def __init__(self, hints: list[str], nodes: list[_NodeSpec], n_inputs: int, n_outputs: int):
        self._hints = hints  # fresh-name suffixes, in the order the recording drew them
        self._ops = tuple((spec.op_type if not spec.domain else f"{spec.domain}::{spec.op_type}") for spec in nodes)
        self._n_in, self._n_out = n_inputs, n_outputs
        fresh, n_dynamic = len(hints), len(hints) + n_inputs + n_outputs
        static: list[bytes] = []
        static_index: dict[bytes, int] = {}

        def piece(b: bytes) -> int:
            if b not in static_index:
                static_index[b] = n_dynamic + len(static)
                static.append(b)
            return static_index[b]

        def slot(kind: str, value: Any) -> int:
            if kind == "fresh":
                return value
            if kind == "in":
                return fresh + value
            if kind == "out":
                return fresh + n_inputs + value
            return piece(length_prefixed(value))

        #: Per created node: the hint its name was drawn from (node names are always fresh).
        self._node_hints: tuple[str, ...] | None = None
        self._indices: list[list[int]] = []
        self._name_slots: list[tuple[str, Any]] = []
        inputs_read = set()
        for spec in nodes:
            indices = []
            for tag, (kind, value) in spec.head:
                indices += [piece(tag), slot(kind, value)]
                if tag == _NODE_INPUT and kind == "in":
                    inputs_read.add(value)
            indices.append(piece(spec.tail))
            indices.append(-1 if self._indices else -2)  # metadata: the first node's, then the rest's
            self._indices.append(indices)
            self._name_slots.append(spec.head[-1][1])
        self._static = static
        self._inputs_read = sorted(inputs_read)
        if all(kind == "fresh" for kind, _ in self._name_slots):
            self._node_hints = tuple(hints[slot] for _, slot in self._name_slots)

    @classmethod
    def record(cls, emit: Emitter) -> Template | None:
        """The template of what ``emit`` built, or None when some name cannot be explained."""
        node = emit.site.node
        slot_of = {name: i for i, name in enumerate(emit.fresh_names)}
        inputs = {name: i for i, name in reversed(list(enumerate(node.input))) if name}
        outputs = {name: j for j, name in reversed(list(enumerate(node.output))) if name}

        def ref(name: str) -> _Ref | None:
            if name in slot_of:
                return ("fresh", slot_of[name])
            if name in outputs:
                return ("out", outputs[name])
            if name in inputs:
                return ("in", inputs[name])
            if name in emit.constant_names or name == "":
                return ("static", name.encode())
            return None

        specs = []
        for op_type, domain, ins, outs, name, tail in emit.records:
            head = []
            for tag, names in ((_NODE_INPUT, ins), (_NODE_OUTPUT, outs), (_NODE_NAME, (name,))):
                for n in names:
                    r = ref(n)
                    if r is None:
                        return None
                    head.append((tag, r))
            specs.append(_NodeSpec(op_type, domain, head, tail))
        return cls(list(emit.fresh_hints), specs, len(node.input), len(node.output))

    def site_inputs_read(self, site: Site) -> set[str]:
        """The replaced node's inputs that the stamped nodes take as input."""
        return {site.node.input[i] for i in self._inputs_read}

    @property
    def ops(self) -> tuple[str, ...]:
        """The op of each node a stamp creates (as reports write ops), shared by every stamp."""
        return self._ops

    def stamp(
        self, site: Site, names: NameAllocator, prefix: str, metadata: tuple[bytes, bytes]
    ) -> tuple[list[bytes], Sequence[str]]:
        """Encoded nodes and created node names for ``site``, as a build would have produced them."""
        if len(site.node.input) != self._n_in or len(site.node.output) != self._n_out:
            raise ValueError("template_key promised a structure this node does not have")
        fresh, clashed = names.fresh_all(prefix, self._hints)
        small = SMALL_VARINTS
        encoded = [n.encode() for n in (*fresh, *site.node.input, *site.node.output)]
        table = [small[len(e)] + e if len(e) < 16384 else varint(len(e)) + e for e in encoded]
        table += self._static
        table.extend(metadata)
        join = b"".join
        nodes = [join([table[i] for i in indices]) for indices in self._indices]
        if self._node_hints is None:
            return nodes, tuple(fresh[v] if k == "fresh" else v.decode() for k, v in self._name_slots)
        clashes = None
        if clashed:  # rare: keep the names that differ from <prefix><hint>
            clashes = {
                i: fresh[slot]
                for i, (_, slot) in enumerate(self._name_slots)
                if fresh[slot] != prefix + self._hints[slot]
            }
        return nodes, CreatedNames(prefix, self._node_hints, clashes)
