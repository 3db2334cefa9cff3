"""Where nodes live in a model: scopes (main graph, subgraphs, local functions), names, types.

A rewrite must see every node a runtime will execute: the main graph, the bodies of If/Loop/Scan
(at any depth) and model-local functions (onnx_ir's ``all_nodes()`` skips the latter). A *scope* is
one node list plus what it can see: its own values, its outer scopes' values, and its opsets.
"""

from __future__ import annotations

import array
import bisect
import collections
import dataclasses
import itertools
from collections.abc import Callable, Collection, Hashable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import numpy as np

from onnx_qrewrite import _onnx as onnx
from onnx_qrewrite._dataclass import dataclass
from onnx_qrewrite.errors import InvalidModelError
from onnx_qrewrite.rewriter.value_types import traced_elem_type

if TYPE_CHECKING:
    from onnx_qrewrite.io.external_data import ExternalData

_T = TypeVar("_T")
#: The first IR version in which an initializer need not be a graph input.
IR_INITIALIZERS_NOT_INPUTS = 4
__all__ = [
    "ConstantSlabs",
    "NameAllocator",
    "Scope",
    "default_opset",
    "dtype_name",
    "iter_scopes",
    "known_shape",
    "split_slabs",
    "subgraphs",
]

_DTYPE_NAMES: dict[int, str] = {
    onnx.TensorProto.FLOAT: "float32",
    onnx.TensorProto.DOUBLE: "float64",
    onnx.TensorProto.FLOAT16: "float16",
    onnx.TensorProto.BFLOAT16: "bfloat16",
    onnx.TensorProto.UINT8: "uint8",
    onnx.TensorProto.INT8: "int8",
    onnx.TensorProto.UINT16: "uint16",
    onnx.TensorProto.INT16: "int16",
    onnx.TensorProto.UINT32: "uint32",
    onnx.TensorProto.INT32: "int32",
    onnx.TensorProto.UINT64: "uint64",
    onnx.TensorProto.INT64: "int64",
    onnx.TensorProto.BOOL: "bool",
    onnx.TensorProto.UINT4: "uint4",
    onnx.TensorProto.INT4: "int4",
    onnx.TensorProto.FLOAT8E4M3FN: "float8e4m3fn",
    onnx.TensorProto.FLOAT8E4M3FNUZ: "float8e4m3fnuz",
    onnx.TensorProto.FLOAT8E5M2: "float8e5m2",
    onnx.TensorProto.FLOAT8E5M2FNUZ: "float8e5m2fnuz",
}


def dtype_name(elem_type: int) -> str:
    """Readable name of an ONNX element type, as used in rule files and reports."""
    name = _DTYPE_NAMES.get(elem_type)  # not .get(k, default): the default would be computed every call
    return name if name is not None else onnx.TensorProto.DataType.Name(elem_type).lower()


def known_shape(shape: Sequence[int | None] | None) -> tuple[int, ...] | None:
    """``shape`` when the model records it with every dimension known; None otherwise."""
    if shape is None or any(d is None for d in shape):
        return None
    return tuple(d for d in shape if d is not None)


def default_opset(opset_imports) -> int | None:
    """The default-domain (``""`` or ``ai.onnx``) version among ``opset_imports``, or None if absent."""
    for entry in opset_imports:
        if entry.domain in ("", "ai.onnx"):
            return entry.version
    return None


class _Records(NamedTuple):
    """What a scope's own records say about its values (indexed together: one pass over them)."""

    types: dict[str, int]
    shapes: dict[str, tuple[int | None, ...] | None]
    initializers: dict[str, onnx.TensorProto]


_NO_HASHES = np.zeros(0, dtype=np.int64)
_MISSING = object()


def _hash_in(hashes: np.ndarray, value: int) -> bool:
    """Whether the sorted array ``hashes`` holds ``value``."""
    pos = int(hashes.searchsorted(value))
    return pos < len(hashes) and int(hashes[pos]) == value


#: Slots of a :func:`_slots_of` table: a hash's low 20 bits (a 1 MB table).
_SLOT_MASK = (1 << 20) - 1


def _slots_of(arrays: Sequence[np.ndarray]) -> bytes:
    """A byte per slot, 1 where some hash of ``arrays`` has that slot's low bits: a 0 there says
    a hash is not among them at the cost of an index, where :func:`_hash_in` costs a numpy search
    (~1.5 us; once per stamped replacement, it was 3% of a chain's rewrite). A 1 says nothing:
    the array is searched."""
    table = np.zeros(_SLOT_MASK + 1, np.uint8)
    for hashes in arrays:
        table[hashes & _SLOT_MASK] = 1
    return table.tobytes()


#: Nodes read at a time when indexing their outputs (see :class:`_Producers`).
_CHUNK = 4096


class _OutputNames:
    """Gathers, node by node, what :class:`_Producers` indexes: each node's outputs and name, hashed
    a chunk of :data:`_CHUNK` nodes at a time (the names of a whole graph at once, as strings, were
    ~10 MB more at a time). Fed by whatever walk reads the nodes anyway: each node read from
    protobuf costs a new wrapper object, so the index is built in the walk that notes the nodes'
    ops for matching (:func:`_walk`) instead of a walk of its own, and the name allocator does not
    walk the nodes again for their names."""

    __slots__ = ("chunks", "counts", "names", "node_names", "start")

    def __init__(self) -> None:
        self.chunks: list[tuple[np.ndarray, ...]] = []
        self.start = 0
        self.names: list[str] = []
        self.counts: list[int] = []
        self.node_names: list[str] = []

    def add(self, node: onnx.NodeProto) -> None:
        """Note the next node's outputs and name."""
        outputs = node.output
        self.names.extend(outputs)
        self.counts.append(len(outputs))
        self.node_names.append(node.name)
        if len(self.counts) == _CHUNK:
            self._hash_chunk()

    def index(self) -> _Producers:
        """The index of every node noted."""
        if self.counts:
            self._hash_chunk()
        return _Producers(self.chunks)

    def _hash_chunk(self) -> None:
        """Of the chunk's outputs (absent optional ones left out): their hashes, the index of each
        one's node; and of those outputs and the nodes' own names, the hashes of the names and of
        their heads (see :class:`NameAllocator`)."""
        names, counts = self.names, self.counts
        found = np.fromiter(map(hash, names), np.int64, len(names))
        owners = np.repeat(np.arange(self.start, self.start + len(counts), dtype=np.int32), counts)
        if "" in names:  # an absent optional output (a search in C: most chunks have none)
            present = np.fromiter(map(bool, names), bool, len(names))
            found, owners = found[present], owners[present]
        node_names = list(filter(None, self.node_names))  # the named ones
        own = np.fromiter(map(hash, node_names), np.int64, len(node_names))
        names.extend(node_names)
        heads = np.fromiter((hash(n.rpartition("/")[0]) for n in names if "/" in n), np.int64)
        self.chunks.append((found, owners, heads, own))
        self.start += len(counts)
        # Emptied in place: :func:`_walk` holds their methods.
        del names[:], counts[:], self.node_names[:]


class _Producers:
    """Output name -> the node writing it, for one node list: the names' hashes, sorted, and the
    index of each one's node, as two arrays (12 bytes a name).

    Why not a dict of names: each name read out of protobuf is a new string object, so such a dict
    held a string and an int object per value, ~16 MB of a 100k-node rewrite's peak memory. A hash
    found is confirmed against the node's own outputs (two names may share a hash); when names
    repeat (not SSA), the last node writing one wins, as a dict built in node order would have it.
    """

    __slots__ = ("_hash_view", "_owner_view", "hashes", "heads", "node_names", "owners", "recent", "unique")

    def __init__(self, chunks: Sequence[tuple[np.ndarray, ...]]):
        """``chunks``: per chunk of nodes, in order, the output hashes, their nodes' indices, the
        heads' hashes and the node names' hashes (:class:`_OutputNames`)."""
        hashes = [c[0] for c in chunks]
        owners = [c[1] for c in chunks]
        heads = [c[2] for c in chunks]
        own = [c[3] for c in chunks]
        found = np.concatenate(hashes) if hashes else _NO_HASHES
        owners_all = np.concatenate(owners) if owners else np.zeros(0, dtype=np.int32)
        order = np.argsort(found, kind="stable")  # equal hashes stay in node order
        found = found[order]
        #: Hashes of the output names, sorted; ``owners[k]``: the index of the node writing the k-th.
        self.hashes: np.ndarray = found
        self.owners: np.ndarray = owners_all[order]
        #: No two outputs share a hash (so no name is written twice: an SSA node list, as onnx's
        #: checker demands of a graph): a node found writing one name is then the only writer of
        #: each of its outputs, which :meth:`find` remembers at once (a DynamicQuantizeLinear's
        #: quantized value and zero point are looked up by the same reader).
        self.unique: bool = not bool((found[1:] == found[:-1]).any())
        #: The two arrays as memoryviews (no copy): searched with :func:`bisect.bisect_left` and
        #: indexed, they give Python ints without a numpy scalar or a 0-d array per look-up (a
        #: look-up through the hash index was ~10 us of Python, 20k of them on a 20k-block chain).
        self._hash_view = found.data
        self._owner_view = self.owners.data
        #: Hashes of the outputs' and node names' parts before their last ``/``, and of the
        #: (non-empty) node names, each sorted (for :class:`NameAllocator`: computed here, where
        #: the nodes are read anyway).
        self.heads: np.ndarray = np.sort(np.concatenate(heads)) if heads else _NO_HASHES
        self.node_names: np.ndarray = np.sort(np.concatenate(own)) if own else _NO_HASHES
        #: The last names looked up and the node found writing each (see :data:`_RECENT`): the
        #: node object itself, since each read of ``nodes[i]`` makes a new wrapper.
        self.recent: dict[str, onnx.NodeProto | None] = {}

    @classmethod
    def of_nodes(cls, nodes: Sequence[onnx.NodeProto]) -> _Producers:
        """The index of ``nodes``, read for it alone (no walk was reading them anyway)."""
        names = _OutputNames()
        for node in nodes:
            names.add(node)
        return names.index()

    def find(self, name: str, nodes: Sequence[onnx.NodeProto]) -> onnx.NodeProto | None:
        """The last node of ``nodes`` (the list indexed) writing ``name``, or None."""
        recent = self.recent
        found = recent.get(name, _MISSING)
        if found is not _MISSING:
            return found  # type: ignore[return-value]
        if len(recent) >= _RECENT:
            recent.clear()
        found = recent[name] = self._find(name, nodes)
        return found

    def note(self, node: onnx.NodeProto, outputs: Sequence[str]) -> None:
        """Remember ``node`` (of the list indexed) as the writer of each of its ``outputs``, when
        no name is written twice (then it is the only writer: what :meth:`find` would confirm).
        Matching reads its candidates in node order, and a candidate's inputs are often the
        outputs of the candidate before it (a chain's MatMulInteger reads its quantizer's): so
        they are found here instead of through the index, which makes the node's wrapper and
        reads its outputs out of protobuf again."""
        if not self.unique:
            return
        recent = self.recent
        if len(recent) + len(outputs) > _RECENT:
            recent.clear()
        for out in outputs:
            if out:
                recent[out] = node

    def writers_of(
        self, names: Sequence[str], nodes: Sequence[onnx.NodeProto], outputs_of: Mapping[int, Sequence[str]]
    ) -> list[int] | None:
        """The index of the node writing each of ``names`` (-1: none), found for all of them in
        one search of the sorted hashes and confirmed against the nodes' outputs (``outputs_of``:
        those of nodes the caller has read already, by index; the others are read). None when a
        name may have several writers (not an SSA node list): ask :meth:`find` one by one."""
        if not self.unique:
            return None
        count = len(self.hashes)
        if not count:
            return [-1] * len(names)
        values = np.fromiter(map(hash, names), np.int64, len(names))
        at = np.minimum(self.hashes.searchsorted(values), count - 1)
        found: list[int] = np.where(self.hashes[at] == values, self.owners[at], -1).tolist()
        for k, (name, owner) in enumerate(zip(names, found, strict=True)):
            if owner < 0:
                continue
            if not name:  # an absent optional value is not indexed (see _find)
                found[k] = -1
                continue
            written = outputs_of.get(owner)
            if written is None:
                written = nodes[owner].output[:]  # a list: see _walk on protobuf's containers
            if name not in written:
                found[k] = -1  # another name with the same hash
        return found

    def _find(self, name: str, nodes: Sequence[onnx.NodeProto]) -> onnx.NodeProto | None:
        if not name:  # an absent optional value is not indexed; without this, the confirm below
            return None  # finds a node with an absent output among the names sharing hash("")
        value = hash(name)
        if self.unique:  # at most one output has this hash: no run of equal hashes to walk
            view = self._hash_view
            at = bisect.bisect_left(view, value)
            if at == len(view) or view[at] != value:
                return None
            node = nodes[self._owner_view[at]]
            outputs = node.output[:]  # a list: see _walk on iterating protobuf's containers
            if name not in outputs:
                return None  # another name with the same hash
            if len(outputs) > 1:
                recent = self.recent
                for out in outputs:
                    if out:
                        recent[out] = node
            return node
        hashes = self.hashes
        lo = int(hashes.searchsorted(value))
        hi = lo
        item = hashes.item  # a Python int, not a numpy scalar to compare
        while hi < len(hashes) and item(hi) == value:
            hi += 1
        for k in range(hi - 1, lo - 1, -1):
            node = nodes[self.owners.item(k)]
            outputs = node.output[:]  # a list: see _walk on iterating protobuf's containers
            if name in outputs:
                if self.unique and len(outputs) > 1:
                    recent = self.recent
                    for out in outputs:
                        if out:
                            recent[out] = node
                return node
        return None


#: How many names a :class:`_Producers` remembers the answer for: a node's rules look up the same
#: few names (its inputs, their producers' inputs) several times each.
_RECENT = 64


@dataclass(eq=False)
class Scope:
    """One node list and the values visible from it.

    ``path`` names the scope in reports: ``main``, ``main/<node>.<attr>`` for a subgraph,
    ``function:<domain>.<name>`` for a model-local function.
    """

    container: onnx.GraphProto | onnx.FunctionProto
    path: str
    opsets: dict[str, int]
    parent: Scope | None
    #: The model's external data (opened and checked), for constants stored there.
    external: ExternalData | None = None
    _records: _Records | None = dataclasses.field(default=None, repr=False)
    #: Output name -> index of the node writing it, built on first use (see :class:`_Producers`).
    _producers: _Producers | None = dataclasses.field(default=None, repr=False)
    _memo: dict[Hashable, Any] = dataclasses.field(default_factory=dict, repr=False)
    #: Indices of the nodes whose op is ``Constant`` (any domain): found by the walk that makes
    #: the scope (:func:`iter_scopes`), which reads every node's op anyway.
    _constant_ops: list[int] | None = dataclasses.field(default=None, repr=False)
    #: Per node, the index of its (domain, op_type) in ``_op_keys``, in first-seen order: noted by
    #: the walk when asked (:func:`iter_scopes`), so that matching reads no other node's op again.
    _op_codes: array.array | None = dataclasses.field(default=None, repr=False)
    _op_keys: list[tuple[str, str]] | None = dataclasses.field(default=None, repr=False)
    #: An initializer the graph also lists as an input is a constant (a model before IR 4, where
    #: every initializer had to be listed: see :meth:`_index_records`). Read on the root scope.
    listed_initializers_constant: bool = False

    @property
    def is_function(self) -> bool:
        return isinstance(self.root.container, onnx.FunctionProto)

    @property
    def root(self) -> Scope:
        scope = self
        while scope.parent is not None:
            scope = scope.parent
        return scope

    @property
    def default_opset(self) -> int:
        return self.opsets.get("", self.opsets.get("ai.onnx", 0))

    # -- values --------------------------------------------------------------------------------

    def _own(self) -> _Records:
        """This scope's own records, indexed on first use (and again after :meth:`invalidate`)."""
        records = self._records
        if records is None:
            records = self._records = self._index_records()
        return records

    def _index_records(self) -> _Records:
        types: dict[str, int] = {}
        shapes: dict[str, tuple[int | None, ...] | None] = {}
        inits: dict[str, onnx.TensorProto] = {}
        c = self.container
        value_infos = (*c.input, *c.output, *c.value_info) if isinstance(c, onnx.GraphProto) else c.value_info
        for vi in value_infos:
            tensor_type = vi.type.tensor_type if vi.type.HasField("tensor_type") else None
            if tensor_type is not None and tensor_type.elem_type:
                types[vi.name] = tensor_type.elem_type
            if tensor_type is not None and tensor_type.HasField("shape"):
                shapes[vi.name] = tuple(d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim)
            else:
                shapes.setdefault(vi.name, None)
        if isinstance(c, onnx.GraphProto):
            # An initializer the graph also takes as an input is a default a feed may replace
            # (onnxruntime: "will not be treated as constant value/weight"): folding its value in
            # would make the feed change nothing. It keeps its type and shape, not its value.
            # Before IR 4 the format demanded that listing of every initializer, so it says
            # nothing there and those stay constants (every rewrite of an old model would
            # otherwise find no constant weight, scale or zero point).
            listed = set() if self.root.listed_initializers_constant else {v.name for v in c.input}
            for t in c.initializer:
                types[t.name] = t.data_type
                shapes[t.name] = tuple(t.dims)
                if t.name not in listed:
                    inits[t.name] = t
            for sparse in c.sparse_initializer:
                types[sparse.values.name] = sparse.values.data_type
        for node in map(c.node.__getitem__, self.constant_nodes):
            if node.output:
                for attr in node.attribute:
                    if attr.name == "value":
                        types[node.output[0]] = attr.t.data_type
        return _Records(types, shapes, inits)

    def _producer_index(self) -> _Producers:
        # Separate from the records: only constant look-ups need it, and it is the costly one.
        if self._producers is None:
            self._producers = _Producers.of_nodes(self.container.node)
        return self._producers

    def add_initializer(self, tensor: onnx.TensorProto) -> None:
        """Append ``tensor`` to this graph's initializers, keeping the indexes: an added
        initializer changes only its own name's records (re-indexing the scope instead reads
        every node again, once per constant a rewrite adds)."""
        container = self.container
        assert isinstance(container, onnx.GraphProto)
        container.initializer.append(tensor)
        records = self._records
        if records is not None:
            stored = container.initializer[-1]
            records.types[stored.name] = stored.data_type
            records.shapes[stored.name] = tuple(stored.dims)
            records.initializers[stored.name] = stored

    def invalidate(self) -> None:
        """Forget cached indexes after the node list or value_info changed."""
        self._records = None
        self._producers = None
        self._constant_ops = None
        self._op_codes = self._op_keys = None
        self._memo.clear()

    def memo(self, key: Hashable, compute: Callable[[], _T]) -> _T:
        """``compute()`` once per scope and key, for facts many nodes share (statistics of one
        weight that 20k MatMulIntegers read: computed per node, they were a third of a rewrite).
        ``key`` must name everything the fact depends on; names resolve the same way anywhere
        in one scope. Forgotten by :meth:`invalidate`."""
        if key in self._memo:
            return self._memo[key]
        found = self._memo[key] = compute()
        return found

    def _outward(self) -> Iterator[Scope]:
        """This scope, then each enclosing one: the order ONNX resolves names in."""
        scope: Scope | None = self
        while scope is not None:
            yield scope
            scope = scope.parent

    def elem_type(self, name: str) -> int | None:
        """Element type of a value visible here, or None when the model does not say."""
        if self.parent is None:  # the common case, without a generator (once per node and input)
            return self._own().types.get(name)
        for scope in self._outward():
            types = scope._own().types
            if name in types:
                return types[name]
        return None

    def value_type(self, name: str, steps: list[int] | None = None) -> int | None:
        """:meth:`elem_type`, else traced from the node writing the value (:mod:`.value_types`);
        None when neither says. For checks that must know a type (a float32-only lowering): a
        trace costs producer look-ups, so the common queries stay with the records.
        ``steps``: a trace's remaining budget."""
        found = self.elem_type(name)
        if found is not None or not name:
            return found
        for scope in self._outward():
            if scope.producer(name) is not None:
                return scope._traced(name, steps)
        return None

    def _traced(self, name: str, steps: list[int] | None) -> int | None:
        """:func:`.value_types.traced_elem_type`, remembered once known (an unknown one is asked
        again: it may have been cut short by a budget another question had used up)."""
        key = ("value_type", name)
        found = self._memo.get(key)
        if found is None:
            found = traced_elem_type(self, name, steps)
            if found is not None:
                self._memo[key] = found
        return found

    @property
    def constant_ops(self) -> list[int]:
        """Indices of this scope's nodes whose op is ``Constant``, in any domain."""
        found = self._constant_ops
        if found is None:
            found = self._constant_ops = [i for i, node in enumerate(self.container.node) if node.op_type == "Constant"]
        return found

    def op_codes(self) -> tuple[array.array, list[tuple[str, str]]]:
        """Each node's (domain, op_type) as an index into the list returned with it (distinct
        keys, in the order they first occur): from the walk that made the scope when it noted
        them, else read now."""
        if self._op_codes is None or self._op_keys is None:
            codes, keys = _op_codes(self.container.node)
            self._op_codes, self._op_keys = codes, keys
        return self._op_codes, self._op_keys

    @property
    def constant_nodes(self) -> list[int]:
        """Indices of this scope's default-domain Constant nodes."""
        nodes = self.container.node
        return [i for i in self.constant_ops if nodes[i].domain in ("", "ai.onnx")]

    @property
    def declared_types(self) -> dict[str, int]:
        """Element types this scope's own records give (value_info, initializers, Constants)."""
        return self._own().types

    @property
    def recorded_shapes(self) -> dict[str, tuple[int | None, ...] | None]:
        """Static shapes this scope's own records give (inputs, outputs, value_info, initializers;
        None dims unknown). A name mapped to None is declared here with no shape."""
        return self._own().shapes

    def reads(self) -> dict[str, list[tuple[int, int]]]:
        """Every read of each value by this scope's nodes, in node order: (node index, input slot),
        the slot -1 for a read inside the node's subgraphs (once per node, at any depth).

        The one reader index of a scope: :meth:`readers`, :meth:`input_readers` and the target plan
        (targets/trials.py) read theirs from it. It describes the node list as it was when first asked:
        whatever edits the node list must call :meth:`invalidate` (as for the other indexes), which
        forgets it; an added initializer (:meth:`add_initializer`) reads nothing and keeps it."""

        def index() -> dict[str, list[tuple[int, int]]]:
            from onnx_qrewrite.io.toposort import outer_reads  # toposort imports this module

            found: dict[str, list[tuple[int, int]]] = {}
            for at, node in enumerate(self.container.node):
                for slot, name in enumerate(node.input):
                    if name:
                        found.setdefault(name, []).append((at, slot))
                for name in outer_reads(node):
                    if name:
                        found.setdefault(name, []).append((at, -1))
            return found

        return self.memo(("reads",), index)

    def readers(self, name: str) -> list[onnx.NodeProto]:
        """The nodes of this scope reading ``name``, each once, in node order (a node whose
        subgraphs read it counts): who observes the value, for a rewrite that changes it."""
        nodes = self.container.node
        found: list[onnx.NodeProto] = []
        last = -1
        for at, _slot in self.reads().get(name, ()):
            if at != last:  # a node's reads are adjacent in the index
                found.append(nodes[at])
                last = at
        return found

    def input_readers(self, name: str) -> list[onnx.NodeProto]:
        """One node per input slot reading ``name`` (a node reading it twice is listed twice), in
        node order; reads inside subgraphs do not count. What a runtime's graph links the value
        to directly, as its fusions count them (targets/check.py)."""
        nodes = self.container.node
        return [nodes[at] for at, slot in self.reads().get(name, ()) if slot >= 0]

    def producer(self, name: str) -> onnx.NodeProto | None:
        producers = self._producers
        return (producers if producers is not None else self._producer_index()).find(name, self.container.node)

    def elem_types(self, names: Sequence[str]) -> list[int | None]:
        """:meth:`Site.elem_type` of each of ``names`` (None for an empty one), in one comprehension."""
        if self.parent is None:
            get = self._own().types.get
            return [get(name) if name else None for name in names]
        return [self.elem_type(name) if name else None for name in names]

    def producer_indices(
        self, names: Sequence[str], outputs_of: Mapping[int, Sequence[str]], known: dict[str, int]
    ) -> list[int] | None:
        """The index of this scope's node writing each of ``names`` (-1: none) when the walk
        indexed the nodes' ops and no name is written twice (see :meth:`_Producers.writers_of`);
        else None (ask :meth:`producer` one by one). ``known``: the names found so far (filled
        here: a node's checks ask about the same few names several times)."""
        if self._op_codes is None:
            return None
        missing = [name for name in names if name not in known]
        if missing:
            producers = self._producers
            if producers is None:
                producers = self._producer_index()
            found = producers.writers_of(missing, self.container.node, outputs_of)
            if found is None:
                return None
            known.update(zip(missing, found, strict=True))
        return [known[name] for name in names]

    def producer_ops(
        self, names: Sequence[str], outputs_of: Mapping[int, Sequence[str]], known: dict[str, int]
    ) -> list[Any] | None:
        """:meth:`Site.producer_op` of each of ``names``, the ops read from the walk's codes
        (no node read for them); None as :meth:`producer_indices`."""
        owners = self.producer_indices(names, outputs_of, known)
        if owners is None or self._op_codes is None or self._op_keys is None:
            return None
        codes, keys = self._op_codes, self._op_keys
        return [None if owner < 0 else keys[codes[owner]] for owner in owners]

    def constants(
        self, names: Sequence[str], outputs_of: Mapping[int, Sequence[str]], known: dict[str, int]
    ) -> list[Any] | None:
        """:meth:`Site.constant` of each of ``names``: a name no initializer holds is looked for
        among the nodes' outputs for all of them at once (:meth:`producer_indices`), and only a
        Constant's is read; None (ask one by one) in a subgraph or as :meth:`producer_indices`."""
        if self.parent is not None:
            return None
        initializers = self._own().initializers
        computed = [name for name in names if name and name not in initializers]
        writers = self.producer_indices(computed, outputs_of, known) if computed else []
        if writers is None or self._op_codes is None or self._op_keys is None:
            return None
        codes, keys = self._op_codes, self._op_keys
        constant_op = {
            name: writer >= 0 and keys[codes[writer]][1] == "Constant"
            for name, writer in zip(computed, writers, strict=True)
        }
        found: list[Any] = []
        for name in names:
            if not name:
                found.append(None)
            elif name in initializers or constant_op[name]:
                found.append(self.constant(name))
            else:  # written by another op: computed at run time (or undefined)
                found.append(None)
        return found

    def note_producer(self, node: onnx.NodeProto, outputs: Sequence[str]) -> None:
        """``node``, one of this scope's nodes, writes ``outputs`` (its output names): remembered
        for :meth:`producer` when the index is made already (:meth:`_Producers.note`)."""
        producers = self._producers
        if producers is not None:
            producers.note(node, outputs)

    def initializer(self, name: str) -> onnx.TensorProto | None:
        """The initializer ``name`` visible here (own graph or an outer one), if any."""
        if self.parent is None:
            return self._own().initializers.get(name)
        for scope in self._outward():
            initializers = scope._own().initializers
            if name in initializers:
                return initializers[name]
        return None

    def initializer_names(self) -> Collection[str]:
        """The names of this scope's own graph's initializers: a view of its index, which
        :meth:`add_initializer` keeps up to date (until :meth:`invalidate` starts a new one)."""
        return self._own().initializers.keys()

    def _definition(self, name: str) -> onnx.TensorProto | onnx.NodeProto | None:
        """What defines ``name`` here, in ONNX's resolution order: the innermost initializer or
        producing node; None when a graph input shadows outer names, or nothing defines it."""
        if self.parent is None:  # the common case, without a generator (once per constant asked)
            tensor = self._own().initializers.get(name)
            return tensor if tensor is not None else self.producer(name)
        for scope in self._outward():
            tensor = scope._own().initializers.get(name)
            if tensor is not None:
                return tensor
            node = scope.producer(name)
            if node is not None:
                return node
            if isinstance(scope.container, onnx.GraphProto) and any(i.name == name for i in scope.container.input):
                return None
        return None

    def _external(self, tensor: onnx.TensorProto) -> ExternalData:
        external = self.root.external
        if external is None:
            raise InvalidModelError(
                f"tensor {tensor.name!r} is stored as external data but the model's folder is unknown"
            )
        return external

    @staticmethod
    def _node_value(node: onnx.NodeProto) -> np.ndarray | None:
        """A Constant node's ``value``; None for any other producer (computed at run time)."""
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            for attr in node.attribute:
                if attr.name == "value":
                    return onnx.numpy_helper.to_array(attr.t)
        return None

    def constant(self, name: str) -> np.ndarray | None:
        """Value of an initializer or Constant output visible here; None when computed at run time.

        Only small tensors (scales, zero points) are asked for, so reading one external tensor
        here does not defeat lazy loading of the weights.
        """
        found = self._definition(name)
        if isinstance(found, onnx.TensorProto):
            if found.data_location == onnx.TensorProto.EXTERNAL:
                return self._external(found).to_array(found)
            return onnx.numpy_helper.to_array(found)
        return None if found is None else self._node_value(found)

    def constant_slabs(self, name: str, max_bytes: int | None = None) -> ConstantSlabs | None:
        """The value of an initializer or Constant output visible here as consecutive slabs
        along its first axis, or None when it is computed at run time (as :meth:`constant`).

        For weights: external data is read one slab at a time through the checked descriptor
        (:meth:`ExternalData.iter_slabs`), so statistics of gigabytes of weights stream in bounded
        memory; an in-model tensor is cut into views of the same size.
        """
        from onnx_qrewrite.io.external_data import SLAB_BYTES

        size = SLAB_BYTES if max_bytes is None else max_bytes
        found = self._definition(name)
        if isinstance(found, onnx.TensorProto):
            if found.data_location == onnx.TensorProto.EXTERNAL:
                return ConstantSlabs(tuple(found.dims), self._external(found).iter_slabs(found, size))
            value: np.ndarray | None = onnx.numpy_helper.to_array(found)
        else:
            value = None if found is None else self._node_value(found)
        return None if value is None else ConstantSlabs(value.shape, split_slabs(value, size))


class ConstantSlabs(NamedTuple):
    """A constant's shape, and its values as consecutive slabs along the first axis (a one-shot
    iterator: each slab is read when it is reached)."""

    shape: tuple[int, ...]
    slabs: Iterator[np.ndarray]


def split_slabs(array: np.ndarray, max_bytes: int) -> Iterator[np.ndarray]:
    """``array`` as views of consecutive slabs along its first axis of at most ``max_bytes``
    (or one row) each; a rank-0 array as itself."""
    if array.ndim == 0 or array.shape[0] == 0:
        yield array
        return
    row_bytes = max(1, array[:1].nbytes)
    per_slab = max(1, max_bytes // row_bytes)
    for start in range(0, array.shape[0], per_slab):
        yield array[start : start + per_slab]


def subgraphs(node: onnx.NodeProto) -> Iterator[tuple[str, onnx.GraphProto]]:
    """The graphs a node holds (If branches, Loop/Scan bodies, ...), each with its attribute label."""
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.name, attr.g
        elif attr.type == onnx.AttributeProto.GRAPHS:
            for i, g in enumerate(attr.graphs):
                yield f"{attr.name}[{i}]", g


#: Standard ops that hold subgraphs; every other standard op is skipped without looking at its
#: attributes (that look costs ~1 us a node from Python). Nodes of other domains are all looked at.
_STANDARD_CONTROL_FLOW = frozenset({"If", "Loop", "Scan", "SequenceMap"})


def _op_codes(nodes: Sequence[onnx.NodeProto]) -> tuple[array.array, list[tuple[str, str]]]:
    """(domain, op_type) of each node as codes (see :meth:`Scope.op_codes`)."""
    codes = array.array("I")
    seen: dict[tuple[str, str], int] = {}
    for node in nodes:
        key = (node.domain, node.op_type)
        code = seen.get(key)
        if code is None:
            code = seen[key] = len(seen)
        codes.append(code)
    return codes, list(seen)


def _walk(scope: Scope, op_codes: bool = False) -> Iterator[Scope]:
    """Post-order: a subgraph is visited before the scope that holds it, so that a parent node is
    serialized only after its bodies were rewritten. ``op_codes``: note each node's op as it is
    read (:meth:`Scope.op_codes`), and index the nodes' outputs (:meth:`Scope.producer`) from the
    same reads: matching looks producers up, and the name allocator of every rewrite needs that
    index of every scope."""
    constant_ops = []
    codes = array.array("I")
    seen: dict[tuple[str, str], int] = {}
    outputs = _OutputNames() if op_codes else None
    if outputs is not None:  # _OutputNames.add, without a call per node
        add_outputs, counts, add_name = outputs.names.extend, outputs.counts, outputs.node_names.append
        add_count = counts.append
    for index, node in enumerate(scope.container.node):
        op = node.op_type
        domain = node.domain
        if outputs is not None:
            key = (domain, op)
            code = seen.get(key)
            if code is None:
                code = seen[key] = len(seen)
            codes.append(code)
            # A slice, not the field: protobuf's repeated fields have no __iter__, so iterating
            # one (extend, ``in``, a for loop) ends in an IndexError raised and caught, which costs
            # more than the copy (timeit: extending a list by a slice of a node's outputs is a third
            # faster than by the field).
            written = node.output[:]
            add_outputs(written)
            add_count(len(written))
            add_name(node.name)
            if len(counts) == _CHUNK:
                outputs._hash_chunk()
        if op not in _STANDARD_CONTROL_FLOW and domain in ("", "ai.onnx"):
            if op == "Constant":
                constant_ops.append(index)
            continue
        if op == "Constant":
            constant_ops.append(index)
        for attr_name, g in subgraphs(node):
            label = node.name or (node.output[0] if node.output else node.op_type)
            child = Scope(g, f"{scope.path}/{label}.{attr_name}", scope.opsets, scope, scope.external)
            yield from _walk(child, op_codes)
    scope._constant_ops = constant_ops
    if outputs is not None:
        scope._op_codes, scope._op_keys = codes, list(seen)
        scope._producers = outputs.index()
    yield scope


def iter_scopes(model: onnx.ModelProto, external: ExternalData | None = None, *, op_codes: bool = False) -> list[Scope]:
    """Every node list of the model, innermost first, local functions included. ``op_codes``:
    each scope notes its nodes' ops as the walk reads them (:meth:`Scope.op_codes`; for
    matching, which then reads only the nodes some rule may rewrite)."""
    opsets = {o.domain: o.version for o in model.opset_import}
    old = model.ir_version < IR_INITIALIZERS_NOT_INPUTS
    scopes = list(_walk(Scope(model.graph, "main", opsets, None, external, listed_initializers_constant=old), op_codes))
    for fn in model.functions:
        fn_opsets = {o.domain: o.version for o in fn.opset_import} or opsets
        scopes.extend(_walk(Scope(fn, f"function:{fn.domain}.{fn.name}", fn_opsets, None, external), op_codes))
    return scopes


class NameAllocator:
    """Fresh names, unique across the whole model (ONNX requires uniqueness across nested scopes;
    onnx_ir's ``val_N`` names are unique only per graph) and deterministic for a given input.

    The names a stamped replacement draws (``<prefix>/<hint>`` for each of a template's hints,
    none taken yet) are kept as one *family*: the prefix and the template's shared set of hints,
    instead of one string each. On a 20k-block chain those strings and their set slots were about
    50 MB, a sixth of the rewrite's peak memory. Which names are taken does not change: a name is
    taken when the plain set holds it, or when it splits at its last ``/`` into a prefix whose
    family holds ``/<tail>``.
    """

    def __init__(self, model: onnx.ModelProto, scopes: Sequence[Scope] | None = None, *, frozen: bool = False):
        """``scopes``: the model's (:func:`iter_scopes`), when the caller has them already.

        ``frozen``: the caller promises that the model's names do not change while names are
        drawn (the engine splices its replacements only after :meth:`release`). The model's names
        are then kept as sorted arrays of their hashes (8 bytes a name, against a string and a set
        slot: ~15 MB of a 100k-node rewrite's peak memory), and read again into a plain set only
        when a name drawn hits one of those hashes (a clash, or two names sharing a hash)."""
        self._scopes = list(iter_scopes(model) if scopes is None else scopes)
        #: Names drawn so far (and, unless ``frozen``, every name of the model).
        self._used: set[str] = set()
        #: The heads (parts before the last ``/``) of the names drawn one by one into ``_used``
        #: since it was made: a family's names all have its prefix as head, so a prefix no drawn
        #: name has is checked against ``_used`` without making the family's names.
        self._used_heads: set[str] = set()
        #: Every name of the model, once read (None: only their hashes are kept).
        self._exact: set[str] | None = None
        #: Sorted arrays of the hashes of the model's names and of their heads (see _index_hashes).
        self._hashes: tuple[np.ndarray, ...] = ()
        self._heads: tuple[np.ndarray, ...] = ()
        #: :func:`_slots_of` the heads (empty: not made, the heads are searched).
        self._head_slots = b""
        if frozen:
            self._index_hashes()
        else:
            self._used = self._exact = self._model_names()
        #: prefix -> the hints (each ``/`` then no other ``/``) drawn under it as one family.
        self._families: dict[str, frozenset[str]] = {}
        #: A template's hints -> their set when they can form a family (None: they cannot).
        self._family_hints: dict[tuple[str, ...], frozenset[str] | None] = {}

    @staticmethod
    def _declared_names(scope: Scope) -> Iterator[str]:
        """The names ``scope`` declares: its inputs, outputs, value_info and initializers."""
        c = scope.container
        if isinstance(c, onnx.GraphProto):
            yield from (v.name for v in itertools.chain(c.input, c.output, c.value_info))
            yield from (t.name for t in c.initializer)
        else:
            yield from c.input
            yield from c.output

    def _model_names(self) -> set[str]:
        """Every name in the model (every value is some node's output or a declared one)."""
        used: set[str] = set()
        for scope in self._scopes:
            used.update(self._declared_names(scope))
            used.update(n.name for n in scope.container.node)
            used.update(itertools.chain.from_iterable(n.output for n in scope.container.node))
        used.discard("")
        return used

    def _index_hashes(self) -> None:
        """The hashes of every name in the model, and of each name's part before its last ``/``
        (its *head*: no name is ``<prefix>/<tail>`` unless its head is ``prefix``). The outputs'
        and node names' come from the scopes' producer indexes, which matching has usually built
        already."""
        hashes: list[np.ndarray] = []
        heads: list[np.ndarray] = []
        declared, declared_heads = [], []
        for scope in self._scopes:
            producers = scope._producer_index()
            hashes += (producers.hashes, producers.node_names)
            heads.append(producers.heads)
            names = self._declared_names(scope)
            while batch := list(itertools.islice(names, _CHUNK)):  # in chunks, as _Producers reads
                named = [name for name in batch if name]
                declared.append(np.fromiter(map(hash, named), np.int64, len(named)))
                declared_heads.append(np.fromiter((hash(n.rpartition("/")[0]) for n in named if "/" in n), np.int64))
        if len(self._scopes) == 1:
            # The producer index's sorted arrays themselves, searched one after the other: a copy of
            # them merged into one was ~3.6 MB of a 100k-node chain's peak memory.
            merged_hashes, merged_heads = [np.sort(np.concatenate(declared))], [np.sort(np.concatenate(declared_heads))]
            self._hashes, self._heads = (*hashes, *merged_hashes), (*heads, *merged_heads)
        else:  # one array each: a search per scope would cost a search per subgraph per name
            self._hashes = (np.sort(np.concatenate(hashes + declared)),)
            self._heads = (np.sort(np.concatenate(heads + declared_heads)),)
        if sum(map(len, self._heads)) >= _CHUNK:  # a small model's few stamps search the arrays
            self._head_slots = _slots_of(self._heads)

    def release(self) -> None:
        """Forget the names (when no more will be drawn): frees what is kept of every name in the model."""
        self._used = set()
        self._used_heads = set()
        self._families = {}
        self._exact = None
        self._scopes = []
        self._hashes = self._heads = ()
        self._head_slots = b""

    def _in_model(self, name: str) -> bool:
        """Whether the model had ``name`` (exactly: a hash found makes the names be read)."""
        exact = self._exact
        if exact is None:
            value = hash(name)
            if not any(_hash_in(hashes, value) for hashes in self._hashes):
                return False
            exact = self._exact = self._model_names()
        return name in exact

    def _in_model_any(self, prefix: str, hints: Sequence[str]) -> bool:
        """Whether the model had ``prefix + hint`` for some hint, each ``/`` then no other ``/``."""
        if self._exact is None:
            value = hash(prefix)
            slots = self._head_slots
            if (slots and not slots[value & _SLOT_MASK]) or not any(_hash_in(h, value) for h in self._heads):
                return False  # no name of the model has that head
        return any(self._in_model(prefix + hint) for hint in hints)

    def _taken(self, name: str) -> bool:
        if name in self._used or (self._exact is not self._used and self._in_model(name)):
            return True
        if not self._families:
            return False
        head, sep, tail = name.rpartition("/")
        family = self._families.get(head) if sep else None
        return family is not None and sep + tail in family

    def _family_of(self, hints: Sequence[str]) -> frozenset[str] | None:
        key = tuple(hints)
        found = self._family_hints.get(key, _NOT_SEEN)
        if found is _NOT_SEEN:
            # Each name must split back into (prefix, hint) at its last "/", and no two be equal.
            ok = len(set(key)) == len(key) and all(h.startswith("/") and h.count("/") == 1 for h in key)
            found = self._family_hints[key] = frozenset(key) if ok else None
        return found  # type: ignore[return-value]

    def _clashes_drawn(self, prefix: str) -> bool:
        """Whether a name ``prefix/<tail>`` may be in ``_used``: always when ``_used`` holds the
        model's names (not frozen), else when a name drawn one by one has that head."""
        return self._exact is self._used or prefix in self._used_heads

    def claim_family(self, prefix: str, hints: Sequence[str]) -> bool:
        """Take ``prefix + hint`` for every hint as one family when none of them is taken and they
        can form one (what :meth:`fresh_all` does in its common case, without making the names);
        False, with nothing taken, otherwise."""
        family = self._family_of(hints)
        if (
            family is None
            or prefix in self._families
            or (self._clashes_drawn(prefix) and not self._used.isdisjoint(map(prefix.__add__, hints)))
            or (self._exact is not self._used and self._in_model_any(prefix, hints))
        ):
            return False
        self._families[prefix] = family
        return True

    def claim_free_families(self, prefixes: Sequence[str], hints: Sequence[tuple[str, ...] | None]) -> list[bool]:
        """:meth:`claim_family` for a run of stamps at once, where its answer cannot depend on the
        others': per (prefix, hints), True when the family is free and now taken; False, with
        nothing taken, where the caller must ask :meth:`claim_family` itself, in order (a prefix
        met twice in the run or already drawn under, hints that cannot form a family, a head some
        model name may have, an allocator that is not frozen or has read the model's names). A
        family taken here is only ever looked up under its own prefix, which no other stamp of the
        run has, so taking them all first gives what claiming them in turn would. Hints None: a
        stamp the caller does in turn anyway (its prefix still counts). A run shares a few hints
        tuples: their families are found once per tuple."""
        n = len(prefixes)
        if self._exact is not None or not n:
            return [False] * n
        counts = collections.Counter(prefixes)
        families, drawn = self._families, self._used_heads
        family_of = self._family_of
        of_tuple = {id(h): (family_of(h) if h is not None else None) for h in {id(h): h for h in hints}.values()}
        wanted = list(map(of_tuple.__getitem__, map(id, hints)))
        free = [
            f is not None and counts[p] == 1 and p not in families and p not in drawn
            for p, f in zip(prefixes, wanted, strict=True)
        ]
        values = np.fromiter(map(hash, prefixes), np.int64, n)
        slots = self._head_slots  # (none on a small model: every head is searched)
        hit = np.frombuffer(slots, np.uint8)[values & _SLOT_MASK].tolist() if slots else [1] * n
        heads = self._heads
        for i in itertools.compress(range(n), hit):
            if free[i]:
                value = int(values[i])
                if any(_hash_in(h, value) for h in heads):
                    free[i] = False  # some model name may have that head: asked in turn
        families.update((p, f) for p, f, ok in zip(prefixes, wanted, free, strict=True) if ok and f is not None)
        return free

    def fresh_all(self, prefix: str, hints: Sequence[str]) -> tuple[list[str], bool]:
        """``fresh(prefix + hint)`` for each hint, and whether any name had to differ from that
        (the common case, no clash, without a call per name: this runs once per created node)."""
        names = [prefix + hint for hint in hints]
        family = self._family_of(hints)
        if family is not None and prefix not in self._families:
            used = self._used
            if not any(name in used for name in names) and not (
                self._exact is not used and self._in_model_any(prefix, hints)
            ):
                # No family has this prefix, and a family name of another prefix splits into that
                # prefix: none of these names is taken, and they are recorded as one entry.
                self._families[prefix] = family
                return names, False
        add = self._used.add
        out = []
        clashed = False
        for wanted in names:
            if self._taken(wanted):
                out.append(self.fresh(wanted))
                clashed = True
            else:
                add(wanted)
                self._used_heads.add(wanted.rpartition("/")[0])
                out.append(wanted)
        return out, clashed

    def fresh(self, base: str) -> str:
        name = base
        n = 0
        while self._taken(name):
            n += 1
            name = f"{base}_{n}"
        self._used.add(name)
        self._used_heads.add(name.rpartition("/")[0])
        return name


_NOT_SEEN = object()
