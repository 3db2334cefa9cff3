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

import operator
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from onnx_qrewrite.io._protowire import NODE_INPUT, NODE_NAME, NODE_OUTPUT, frame_nodes, node_field_tag
from onnx_qrewrite.io._wire import SMALL_VARINTS, length_prefixed, varint
from onnx_qrewrite.rewriter.report import CreatedNames

if TYPE_CHECKING:
    import onnx

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
        self._hints = tuple(hints)  # fresh-name suffixes, in the order the recording drew them
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
                if tag == NODE_INPUT and kind == "in":
                    inputs_read.add(value)
            indices.append(piece(spec.tail))
            indices.append(-1 if self._indices else -2)  # metadata: the first node's, then the rest's
            self._indices.append(indices)
            self._name_slots.append(spec.head[-1][1])
        self._static = static
        self._inputs_read = sorted(inputs_read)
        self._inputs_left = [i for i in range(n_inputs) if i not in inputs_read]
        if all(kind == "fresh" for kind, _ in self._name_slots):
            self._node_hints = tuple(hints[slot] for _, slot in self._name_slots)
        #: Per length signature (see :meth:`stamp_framed`): the replacement as one bytes format,
        #: and what picks its ``%b`` fields from (prefix, inputs..., outputs..., metadata x2).
        self._formats: dict[tuple, tuple[bytes, Callable[[Sequence[bytes]], tuple]]] = {}
        self._seen: set[tuple] = set()

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
            for tag, names in ((NODE_INPUT, ins), (NODE_OUTPUT, outs), (NODE_NAME, (name,))):
                for n in names:
                    r = ref(n)
                    if r is None:
                        return None
                    head.append((tag, r))
            specs.append(_NodeSpec(op_type, domain, head, tail))
        return cls(list(emit.fresh_hints), specs, len(node.input), len(node.output))

    @property
    def input_use(self) -> tuple[list[int], list[int]]:
        """The positions of the replaced node's inputs that the stamped nodes read, and the others."""
        return self._inputs_read, self._inputs_left

    def site_inputs_read(self, site: Site) -> set[str]:
        """The replaced node's inputs that the stamped nodes take as input."""
        inputs = site.inputs
        return {inputs[i] for i in self._inputs_read}

    @property
    def ops(self) -> tuple[str, ...]:
        """The op of each node a stamp creates (as reports write ops), shared by every stamp."""
        return self._ops

    def stamp_framed(
        self,
        site: Site,
        names: NameAllocator,
        prefix: str,
        metadata: tuple[bytes, bytes],
        container: onnx.GraphProto | onnx.FunctionProto,
    ) -> tuple[bytes, Sequence[str]]:
        """:meth:`stamp`, framed as the container's ``node`` fields (``tag``: its node field's tag)
        (graph or function) in one piece, as :func:`~onnx_qrewrite.io._protowire.frame_nodes` frames a build.

        Every length in the replacement (of each name, so of each node) follows from the lengths
        of the prefix, of the node's input and output names and of the metadata: per such length
        signature the whole replacement is one bytes format, and a stamp is one ``%`` over a
        mapping of those few pieces instead of a join per created node and a name per hint. A
        signature is compiled when it is met the second time (a model whose names all differ in
        length pays only a set look-up); clashing names take :meth:`stamp`."""
        inputs, outputs = site.inputs, site.outputs
        tag = node_field_tag(container)
        if (
            self._node_hints is None
            or len(inputs) != self._n_in
            or len(outputs) != self._n_out
            or not names.claim_family(prefix, self._hints)
        ):
            nodes, created = self.stamp(site, names, prefix, metadata)
            return frame_nodes(container, nodes), created
        encode = str.encode
        values = [encode(prefix), *map(encode, inputs), *map(encode, outputs), *metadata]
        signature = (tag, *map(len, values))
        compiled = self._formats.get(signature)
        if compiled is None:
            if signature not in self._seen:
                self._seen.add(signature)
                table = self._name_table(values)
                nodes = [b"".join([table[i] for i in indices]) for indices in self._indices]
                return frame_nodes(container, nodes), CreatedNames(prefix, self._node_hints)
            compiled = self._formats[signature] = self._compile(signature)
        fmt, pick = compiled
        return fmt % pick(values), CreatedNames(prefix, self._node_hints)

    def _name_table(self, values: list[bytes]) -> list[bytes]:
        """The table :meth:`stamp` joins from, for ``values`` = (prefix, inputs, outputs, metadata)
        encoded, when every fresh name is ``prefix + hint``."""
        prefix = values[0]
        encoded = [prefix + hint.encode() for hint in self._hints] + values[1:-2]
        table = [length_prefixed(e) for e in encoded]
        table += self._static
        table.extend(values[-2:])
        return table

    def _compile(self, signature: tuple) -> tuple[bytes, Callable[[Sequence[bytes]], tuple]]:
        """The bytes format of a whole framed replacement for one length signature, and what
        picks its fields: the prefix, inputs, outputs and metadata are ``%b`` fields of known
        length; everything else (hints, tags, lengths, op types, attributes) is written out,
        ``%`` escaped."""
        tag, lengths = signature[0], signature[1:]
        fresh, n_dynamic = len(self._hints), len(self._hints) + self._n_in + self._n_out
        order: list[int] = []  # per field, its index in (prefix, inputs, outputs, metadata x2)

        def escaped(b: bytes) -> bytes:
            return b.replace(b"%", b"%%")

        def named(k: int, n: int, suffix: bytes = b"") -> tuple[bytes, int]:
            """A name of ``n`` bytes: its length, field ``k``, then ``suffix``."""
            order.append(k)
            head = SMALL_VARINTS[n] if n < 16384 else varint(n)
            return escaped(head) + b"%b" + escaped(suffix), len(head) + n

        def piece(i: int) -> tuple[bytes, int]:
            """Format and byte length of table entry ``i`` (see :meth:`stamp`)."""
            if i < 0:  # metadata: -2 the first node's, -1 the others'
                k = len(lengths) + i
                order.append(k)
                return b"%b", lengths[k]
            if i < fresh:
                hint = self._hints[i].encode()
                return named(0, lengths[0] + len(hint), hint)
            if i < n_dynamic:
                return named(1 + i - fresh, lengths[1 + i - fresh])
            static = self._static[i - n_dynamic]
            return escaped(static), len(static)

        out = []
        for indices in self._indices:
            parts = [piece(i) for i in indices]
            size = sum(n for _, n in parts)
            out.append(escaped(tag + (SMALL_VARINTS[size] if size < 16384 else varint(size))))
            out.extend(f for f, _ in parts)
        pick = operator.itemgetter(*order) if len(order) > 1 else (lambda values: (values[order[0]],))
        return b"".join(out), pick

    @property
    def family_hints(self) -> tuple[str, ...] | None:
        """The hints each created node's name is drawn from, when every node name is fresh (what a
        stamp's :class:`CreatedNames` holds); None otherwise."""
        return self._node_hints

    @property
    def hints(self) -> tuple[str, ...]:
        """Every fresh name's hint, in the order the recording drew them."""
        return self._hints

    @property
    def arity(self) -> tuple[int, int]:
        """How many inputs and outputs the recorded node had (every stamped node has as many)."""
        return self._n_in, self._n_out

    def layout(
        self, tag: bytes, lengths: Sequence[int], first_meta: Sequence[bytes | int], rest_meta: Sequence[bytes | int]
    ) -> tuple[bytes, list[tuple[int, int, int]]]:
        """A whole framed replacement (what :meth:`stamp_framed` returns) as a record of fixed
        length with holes: the record's bytes with every dynamic field zero-filled, and per field
        (offset, value index, length). ``lengths``: the byte lengths of the values a stamp fills
        in, (prefix, inputs..., outputs..., then any the metadata names); ``first_meta`` and
        ``rest_meta``: the first node's and the other nodes' metadata, as static bytes and value
        indices. The same pieces, in the same order, as :meth:`_compile` writes as a format."""
        fresh, n_dynamic = len(self._hints), len(self._hints) + self._n_in + self._n_out
        out: list[bytes | int] = []
        for indices in self._indices:
            body: list[bytes | int] = []
            for i in indices:
                if i < 0:
                    body.extend(first_meta if i == -2 else rest_meta)
                elif i < fresh:
                    hint = self._hints[i].encode()
                    n = lengths[0] + len(hint)
                    body += [SMALL_VARINTS[n] if n < 16384 else varint(n), 0, hint]
                elif i < n_dynamic:
                    k = 1 + i - fresh
                    n = lengths[k]
                    body += [SMALL_VARINTS[n] if n < 16384 else varint(n), k]
                else:
                    body.append(self._static[i - n_dynamic])
            size = sum(lengths[p] if isinstance(p, int) else len(p) for p in body)
            out += [tag + (SMALL_VARINTS[size] if size < 16384 else varint(size)), *body]
        record = bytearray()
        holes = []
        for p in out:
            if isinstance(p, int):
                holes.append((len(record), p, lengths[p]))
                record += bytes(lengths[p])
            else:
                record += p
        return bytes(record), holes

    def stamp(
        self, site: Site, names: NameAllocator, prefix: str, metadata: tuple[bytes, bytes]
    ) -> tuple[list[bytes], Sequence[str]]:
        """Encoded nodes and created node names for ``site``, as a build would have produced them."""
        if len(site.inputs) != self._n_in or len(site.outputs) != self._n_out:
            raise ValueError("template_key promised a structure this node does not have")
        fresh, clashed = names.fresh_all(prefix, self._hints)
        small = SMALL_VARINTS
        encoded = [n.encode() for n in (*fresh, *site.inputs, *site.outputs)]
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
