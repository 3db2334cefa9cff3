"""The new node lists of a rewrite (:mod:`.apply`): the main graph's written to a spool as its
replacements are built, the removals checked against what is still read, the initializers no node
reads any more removed, and every replacement spliced in place."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from onnx_qrewrite import _onnx as onnx
from onnx_qrewrite.errors import InternalError
from onnx_qrewrite.io._protowire import NODE_INPUT, encode_node_chunks, frame_nodes, replace_nodes
from onnx_qrewrite.io._wire import length_prefixed
from onnx_qrewrite.io.spool import Spool
from onnx_qrewrite.rewriter.builders import ConstantPool
from onnx_qrewrite.rewriter.graph import Scope
from onnx_qrewrite.rewriter.report import RewriteReport

__all__ = [
    "Spooled",
    "check_removed_are_unread",
    "remove_unread_initializers",
    "splice_replacements",
    "spool_unchanged",
]


class Spooled(Mapping[int, bytes]):
    """Which nodes of a scope whose new node list is in a spool were replaced, one bit each (their
    replacements are in the spool: each reads as empty). A dict of them was ~1.3 MB of a 100k-node
    chain's peak memory, for the ``index in replaced`` the checks before the splice ask."""

    __slots__ = ("_bits", "_count")

    def __init__(self, nodes: int) -> None:
        self._bits = bytearray((nodes + 7) // 8)
        self._count = 0

    def add(self, index: int) -> None:
        """Note node ``index`` (one of the scope's: no type or range check, once per rewrite)."""
        bit = 1 << (index & 7)
        bits = self._bits
        if not bits[index >> 3] & bit:
            bits[index >> 3] |= bit
            self._count += 1

    def add_all(self, indices: Sequence[int]) -> None:
        """:meth:`add` of each of ``indices`` (the scope's, in increasing order), in one pass."""
        if not indices:
            return
        at = np.array(indices, np.int64)
        view = np.frombuffer(self._bits, np.uint8)
        byte, bit = at >> 3, np.left_shift(1, at & 7).astype(np.uint8)
        self._count += int(np.count_nonzero((view[byte] & bit) == 0))
        np.bitwise_or.at(view, byte, bit)

    def __contains__(self, index: object) -> bool:
        if not isinstance(index, int) or not 0 <= index < 8 * len(self._bits):
            return False
        return bool(self._bits[index >> 3] & (1 << (index & 7)))

    def __getitem__(self, index: int) -> bytes:
        if index not in self:
            raise KeyError(index)
        return b""

    def __iter__(self) -> Iterator[int]:
        return (i for i in range(8 * len(self._bits)) if i in self)

    def __len__(self) -> int:
        return self._count


#: Nodes left as they are are spooled in runs of at most this many (one frame and one write per
#: run instead of per node; bounded, so a long unchanged stretch is never one large copy).
_SPOOL_RUN = 1024


def spool_unchanged(spool: Spool, container: onnx.GraphProto | onnx.FunctionProto, start: int, stop: int) -> None:
    """Write ``container.node[start:stop]``, left as they are, to ``spool`` as node fields."""
    nodes = container.node
    for first in range(start, stop, _SPOOL_RUN):
        run = nodes[first : min(stop, first + _SPOOL_RUN)]
        spool.write(frame_nodes(container, [n.SerializeToString() for n in run]))


def check_removed_are_unread(
    scopes: list[Scope],
    built: dict[int, Mapping[int, bytes]],
    removed: dict[int, set[str]],
    read_by_rewrites: dict[int, set[str]],
) -> None:
    """Never remove a node something still reads: the nodes removed as dead (``Plan.remove_if_dead``)
    were decided from the plans; this checks the built result, so a builder whose replacement reads
    more than its plan said is a clear error instead of a broken model."""
    for s, scope in enumerate(scopes):
        gone = removed.get(id(scope.root))
        if not gone:
            continue
        replaced = built.get(s, {})
        c = scope.container
        read = set(read_by_rewrites.get(id(scope.root), ()))
        for index, node in enumerate(c.node):
            if index not in replaced:
                read.update(node.input)
        if isinstance(c, onnx.GraphProto):
            read.update(o.name for o in c.output)
        else:
            read.update(c.output)
        still = sorted(gone & read)
        if still:
            raise InternalError(f"{scope.path}: a rewrite removed the node writing {still[0]!r}, which is still read")


#: At most this many removal candidates are looked for in the spooled node bytes (one search of
#: them each); more, and the main graph's nodes are read instead.
_SEARCHED_CANDIDATES = 8


def _spool_reads_none(spool: Spool, names: set[str]) -> bool:
    """Whether no node in ``spool`` (the main graph's encoded nodes) can read any of ``names``:
    a node reading one holds its input field (tag, length, name) in its bytes, so where none of
    those byte strings occurs, no node reads them. A false alarm (the bytes inside some other
    field) only means the nodes are read to decide."""
    fields = [NODE_INPUT + length_prefixed(name.encode()) for name in names]
    overlap = max(len(f) for f in fields) - 1
    tail = b""
    for chunk in spool.chunks():
        window = tail + chunk
        if any(f in window for f in fields):
            return False
        tail = window[-overlap:] if overlap else b""
    return True


def remove_unread_initializers(
    scopes: list[Scope],
    built: dict[int, Mapping[int, bytes]],
    candidates: set[str],
    report: RewriteReport,
    spool: Spool | None = None,
) -> None:
    """Remove initializers that only replaced nodes read (a zero point of 0 a lowering left out,
    float16 scales the kernel ignores): onnxruntime warns about unused initializers, and they are
    dead weight. Only called when there are candidates, since it reads every node's inputs, except
    in a main graph already written to ``spool`` whose bytes name none of a few candidates (a
    search of its bytes: reading 100k nodes' inputs was 4% of a chain's rewrite)."""
    read: set[str] = set()
    main_unread = spool is not None and len(candidates) <= _SEARCHED_CANDIDATES and _spool_reads_none(spool, candidates)
    for s, scope in enumerate(scopes):
        replaced = built.get(s, {})
        c = scope.container
        # (With a spool, no scope is a subgraph: the only graph is the main one.)
        skip = main_unread and isinstance(c, onnx.GraphProto)
        for index, node in enumerate(() if skip else c.node):
            # Only the candidates' readers matter: no set of every name read.
            if index not in replaced and not candidates.isdisjoint(node.input[:]):
                read.update(node.input)
        if isinstance(c, onnx.GraphProto):
            read.update(o.name for o in c.output)
            if not _listing_demanded(scope):
                read.update(i.name for i in c.input)  # an initializer that is also an input stays
        else:
            read.update(c.output)
    unread = candidates - read
    for scope in scopes:
        c = scope.container
        if not isinstance(c, onnx.GraphProto) or not unread.intersection(t.name for t in c.initializer):
            continue
        kept = [t for t in c.initializer if t.name not in unread]
        removed = sorted(t.name for t in c.initializer if t.name in unread)
        del c.initializer[:]
        c.initializer.extend(kept)
        if _listing_demanded(scope):  # its listing as an input goes with it
            inputs = [v for v in c.input if v.name not in unread]
            del c.input[:]
            c.input.extend(inputs)
        scope.invalidate()
        report.removed_initializers.extend(removed)


def _listing_demanded(scope: Scope) -> bool:
    """A main graph below IR 4, whose format demanded every initializer be listed as an input: the
    listing says nothing there (the rewrite reads them as constants, and drops the listings when it
    raises the IR version, engine.py), so it keeps no initializer alive."""
    return scope.parent is None and scope.listed_initializers_constant


def splice_replacements(
    model: onnx.ModelProto,
    scopes: list[Scope],
    built: dict[int, Mapping[int, bytes]],
    pools: dict[int, ConstantPool],
    keep_main_encoded: bool,
    spool: Spool | None = None,
) -> list[bytes] | Spool | None:
    """Put the replacements in place, innermost scope first (a parent node is serialized with its
    bodies already rewritten). The main graph's nodes are returned encoded instead of parsed back
    (``keep_main_encoded``), unless a Constant there holds external data (model_io must then see
    it as an object); as the ``spool`` :func:`apply_matches` wrote them to, when it did."""
    main_nodes: list[bytes] | Spool | None = None
    for s, scope in enumerate(scopes):
        replacements = built.get(s, {})
        root = scope.root
        pool = pools.get(id(root))
        prepend = pool.constant_nodes if pool is not None and scope is root else []
        if scope.container is model.graph and spool is not None:
            if prepend:  # the main graph's pool makes initializers, never Constant nodes
                raise InternalError("constant nodes for the main graph, whose node list is already written")
            main_nodes = spool
            scope.container.ClearField("node")
            scope.invalidate()
        elif scope.container is model.graph and replacements and keep_main_encoded:
            main_nodes = encode_node_chunks(scope.container, replacements, prepend)
            scope.container.ClearField("node")
            scope.invalidate()
        elif replacements or prepend:
            replace_nodes(scope.container, replacements, prepend)
            scope.invalidate()
    return main_nodes
