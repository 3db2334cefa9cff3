"""The objects a builder works with when it rewrites one node: the :class:`Site` (the node in its
scope), the :class:`Emitter` (creates the replacement nodes) and the :class:`ConstantPool` (shared
constants). Re-exported by :mod:`onnx_qrewrite.rewriter.builders`; here, apart from the registry and the
contracts, because they need onnx and numpy, which loading the rule catalogue does not.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from onnx_qrewrite import _onnx as onnx
from onnx_qrewrite.errors import InternalError
from onnx_qrewrite.io import _protowire
from onnx_qrewrite.rewriter import kernel_opsets, provenance
from onnx_qrewrite.rewriter.builders import NoMatch
from onnx_qrewrite.rewriter.graph import ConstantSlabs, NameAllocator, Scope

__all__ = ["ConstantPool", "Emitter", "Site"]

T = TypeVar("T")
_MISSING = object()


def no_unknown_attributes(node: onnx.NodeProto, known: Collection[str]) -> None:
    """Decline a node carrying an attribute outside ``known``: a builder writes only what it was
    shown to compute, and an attribute it does not read may change what the kernel does. The
    message lists what is read, so a user sees at once which attribute stopped the rewrite."""
    unknown = sorted({a.name for a in node.attribute} - set(known))
    if unknown:
        read = f"only {', '.join(sorted(known))}" if known else "the op takes none here"
        raise NoMatch(f"attribute(s) {', '.join(unknown)} not supported ({read})")


#: :func:`_qdq.value_shape`, once :meth:`Site.value_shape` first needs it (an import statement
#: run per call costs a look-up in ``sys.modules`` and the fromlist, 60k times on a 20k-block chain).
_VALUE_SHAPE: list[Callable[..., tuple[int | None, ...] | None]] = []


class Site:
    """A node in its scope: everything a builder may look at.

    The engine makes one Site per node and hands it to every candidate rule in turn, so work
    several rules need (reading the node, resolving its dtype) is done once, through :meth:`memo`.
    A plain class with slots: one is made per candidate node (40k on a 20k-block chain), and a
    dataclass's construction was a tenth of the matching.
    """

    __slots__ = ("_memo", "inputs", "node", "outputs", "same_shape_ops", "scope")

    def __init__(self, node: onnx.NodeProto, scope: Scope, same_shape_ops: frozenset[str] = frozenset()):
        self.node = node
        self.scope = scope
        #: Op types whose output 0 has input 0's shape (from the catalogue's builder contracts,
        #: plus the standard ones): shape look-ups see through them.
        self.same_shape_ops = same_shape_ops
        #: The node's input names ('' for an empty optional one) and output names, read from the
        #: proto once: each access to ``node.input`` makes a new container and each index a new
        #: string, and the candidate rules, the template and the engine all read them.
        #: (A slice first: protobuf copies a repeated field out at once, a third faster than
        #: iterating it.)
        self.inputs: tuple[str, ...] = tuple(node.input[:])
        self.outputs: tuple[str, ...] = tuple(node.output[:])
        #: Made on the first :meth:`memo` (most nodes' rules never ask: a dict per node was ~2 MB
        #: of a 100k-node chain's peak memory while the matches wait for their builds).
        self._memo: dict[Hashable, Any] | None = None

    def __repr__(self) -> str:
        return f"Site(node={self.node.name!r}, scope={self.scope.path!r})"

    def memo(self, key: Hashable, compute: Callable[[], T]) -> T:
        """``compute()`` once per node and key; a :class:`NoMatch` is remembered and raised again."""
        memo = self._memo
        if memo is None:
            memo = self._memo = {}
        found = memo.get(key, _MISSING)
        if found is _MISSING:
            try:
                found = compute()
            except NoMatch as why:
                found = why
            memo[key] = found
        if isinstance(found, NoMatch):
            raise type(found)(str(found))
        return found

    @property
    def label(self) -> str:
        """How reports and errors name the node."""
        n = self.node
        name = n.name or (f"<unnamed {n.op_type} -> {n.output[0]}>" if n.output else f"<unnamed {n.op_type}>")
        return name if self.scope.path == "main" else f"{name} (in {self.scope.path})"

    def input(self, i: int) -> str:
        """Name of input ``i``; '' when absent (optional inputs may be missing or empty)."""
        inputs = self.inputs
        return inputs[i] if i < len(inputs) else ""

    def attribute(self, name: str, default: Any = None) -> Any:
        for attr in self.node.attribute:
            if attr.name == name:
                return onnx.helper.get_attribute_value(attr)
        return default

    def has_attribute(self, name: str) -> bool:
        return any(a.name == name for a in self.node.attribute)

    def no_unknown_attributes(self, known: Collection[str]) -> None:
        """Decline a node carrying an attribute outside ``known``: see :func:`no_unknown_attributes`."""
        no_unknown_attributes(self.node, known)

    def elem_type(self, value: str) -> int | None:
        """The type the model declares for ``value`` (None: it does not)."""
        return self.scope.elem_type(value) if value else None

    def value_type(self, value: str) -> int | None:
        """:meth:`elem_type`, else the type traced from the node writing ``value`` (see
        :mod:`onnx_qrewrite.rewriter.value_types`): for a check that refuses an unknown type."""
        return self.scope.value_type(value) if value else None

    def constant(self, value: str) -> np.ndarray | None:
        return self.scope.constant(value) if value else None

    def constant_slabs(self, value: str, max_bytes: int | None = None) -> ConstantSlabs | None:
        """A constant as slabs along its first axis, read as they are reached (for statistics of
        weights that may be gigabytes): see :meth:`Scope.constant_slabs`."""
        return self.scope.constant_slabs(value, max_bytes) if value else None

    # What a check may ask of the graph around the node without touching ``node`` or ``scope``
    # itself: a builder whose check asks only through these (and the methods above) can have its
    # decisions made once per distinct structure (``memo_check``, see ``_facts.py``).

    @property
    def op_type(self) -> str:
        return self.node.op_type

    @property
    def default_opset(self) -> int:
        return self.scope.default_opset

    def value_shape(self, value: str) -> tuple[int | None, ...] | None:
        """Static shape of ``value`` (see :func:`_qdq.value_shape`: records, Constants, seen
        through this catalogue's shape-preserving ops); None when unknown."""
        shape_of = _VALUE_SHAPE
        if not shape_of:  # _qdq imports this module: bound on first use, not imported per call
            from onnx_qrewrite.rewriter.builders._qdq import value_shape

            shape_of.append(value_shape)
        return shape_of[0](self.scope, value, self.same_shape_ops)

    def producer_op(self, value: str) -> tuple[str, str] | None:
        """(domain, op_type) of the node of this scope writing ``value``; None when none does."""
        node = self.scope.producer(value) if value else None
        return None if node is None else (node.domain, node.op_type)

    def producer_input(self, value: str, i: int) -> str:
        """Name of input ``i`` of the node writing ``value`` ('' when there is no such node or input)."""
        node = self.scope.producer(value) if value else None
        if node is None or i >= len(node.input):
            return ""
        return node.input[i]

    def scope_memo(self, key: Hashable, compute: Callable[[], T]) -> T:
        """:meth:`Scope.memo`: a fact shared by the scope's nodes, computed once."""
        return self.scope.memo(key, compute)


#: Constant names say their dtype briefly (they are read by every node that uses them).
_SHORT_DTYPES = {"float32": "f32", "float64": "f64", "float16": "f16", "int64": "i64", "int32": "i32", "uint8": "u8"}


class ConstantPool:
    """Shared constants for one root scope (the main graph, or one local function).

    The main graph gets initializers (visible to every subgraph through outer scope); a function
    gets Constant nodes at the top of its body, since functions have no initializers. Equal values
    share one name, so a model with 20k rewrites still adds only a handful of constants.
    """

    def __init__(self, root: Scope, names: NameAllocator):
        self._root = root
        self._names = names
        self._by_value: dict[tuple[str, str, tuple[int, ...], bytes], str] = {}
        self.constant_nodes: list[bytes] = []

    def get(self, array: np.ndarray) -> str:
        array = np.asarray(array)
        # The name too: ml_dtypes' int4 and uint4 share dtype.str ('<V1').
        key = (array.dtype.str, array.dtype.name, array.shape, array.tobytes())
        name = self._by_value.get(key)
        if name is not None:
            return name
        tensor = onnx.numpy_helper.from_array(array)
        flat = np.asarray(array).ravel()
        hint = "_".join(f"{v:g}" if isinstance(v, (float, np.floating)) else str(v) for v in flat[:4])
        dtype = _SHORT_DTYPES.get(array.dtype.name, array.dtype.name)
        name = self._names.fresh(f"qrw_const_{dtype}_{hint}".replace("-", "m"))
        tensor.name = name
        container = self._root.container
        if isinstance(container, onnx.GraphProto):
            # A fresh name: nothing was resolved to it before, so the scope's indexes stay valid.
            self._root.add_initializer(tensor)
        else:
            attr = onnx.helper.make_attribute("value", tensor)
            self.constant_nodes.append(
                _protowire.encode_node(
                    "Constant",
                    (),
                    (name,),
                    self._names.fresh(f"{name}_node"),
                    attributes=_protowire.encode_attribute(attr),
                )
            )
            self._root.invalidate()
        self._by_value[key] = name
        return name


def op_key_of(domain: str, op_type: str) -> str:
    """How reports name an op: ``Op`` in the standard domain, ``domain::Op`` elsewhere."""
    return op_type if domain in ("", "ai.onnx") else f"{domain}::{op_type}"


_ATTR_CACHE: dict[tuple[str, Any], bytes] = {}
#: (rule, exactness, bound, bound_scale, bound_formula, bound_u8s8) -> the encoded metadata entries before
#: and after the origin (:meth:`Emitter.metadata_for`).
_METADATA_PARTS: dict[tuple, tuple[bytes, bytes]] = {}
_METADATA_PARTS_MAX = 4096


def _encode_attributes(attrs: Mapping[str, Any]) -> bytes:
    if not attrs:
        return b""
    parts = []
    for name, value in attrs.items():
        if isinstance(value, onnx.AttributeProto):
            parts.append(_protowire.encode_attribute(value))
            continue
        key = (name, value) if isinstance(value, (int, float, str, bytes)) else None
        encoded = _ATTR_CACHE.get(key) if key is not None else None
        if encoded is None:
            encoded = _protowire.encode_attribute(onnx.helper.make_attribute(name, value))
            if key is not None:
                _ATTR_CACHE[key] = encoded
        parts.append(encoded)
    return b"".join(parts)


class Emitter:
    """Creates the replacement nodes of one rewrite, with model-wide unique, deterministic names.

    Created nodes carry metadata ``onnx_qrewrite.rule`` and ``onnx_qrewrite.origin`` so a
    verifier (or a person) can trace them back to the rule and the node they replace: on the first
    node only (``compact``, the default), on every node (``full``) or on none (``none``); see
    :mod:`onnx_qrewrite.rewriter.provenance`. Created names always start with ``<prefix>/``.
    """

    RULE_KEY = provenance.RULE_KEY
    ORIGIN_KEY = provenance.ORIGIN_KEY
    #: Only on nodes of non-exact rewrites: the rule's exactness, and the bound at the replaced
    #: node's outputs (``Plan.bound``, as ``repr(float)``) that ``verify`` checks there.
    EXACTNESS_KEY = provenance.EXACTNESS_KEY
    BOUND_KEY = provenance.BOUND_KEY
    #: With ``Plan.bound_scale``: the bound grows by ``per_unit`` (``repr(float)``) times the
    #: largest magnitude of the value named by ``BOUND_UNIT_KEY`` (in the original model).
    BOUND_PER_UNIT_KEY = "onnx_qrewrite.bound_per_unit"
    BOUND_UNIT_KEY = "onnx_qrewrite.bound_unit"
    #: Beside the bound, where it varies per element: the formula's name (``Plan.bound_formula``).
    BOUND_FORMULA_KEY = "onnx_qrewrite.bound_formula"
    #: Beside the bound: the part of it only onnxruntime's u8 x s8 pair saturation uses (``Plan.bound_u8s8``).
    BOUND_U8S8_KEY = "onnx_qrewrite.bound_u8s8"

    def __init__(
        self,
        site: Site,
        rule_id: str,
        names: NameAllocator,
        constants: ConstantPool,
        *,
        emits: frozenset[str] | None = None,
        metadata: tuple[bytes, bytes] | None = None,
        prefix: str | None = None,
    ):
        self.site = site
        self._names = names
        self._constants = constants
        self._emits = emits
        self._rule_id = rule_id
        node = site.node
        self._prefix = prefix if prefix is not None else self.prefix_for(node)
        self._meta_first, self._meta_rest = metadata if metadata is not None else self.metadata_for(rule_id, node)
        self.nodes: list[bytes] = []
        self.created: list[tuple[str, str]] = []  # (node name, op key as in reports)
        # What a template (builders/_stamp.py) needs to replay this build:
        self.records: list[tuple[str, str, list[str], list[str], str, bytes]] = []
        self.fresh_names: list[str] = []
        self.fresh_hints: list[str] = []
        self._hints_used: set[str] = set()
        self.constant_names: set[str] = set()

    @property
    def prefix(self) -> str:
        return self._prefix

    @staticmethod
    def prefix_for(node: onnx.NodeProto, name: str | None = None, first_output: str | None = None) -> str:
        """Created names start with the replaced node's name or its first output, whichever is
        shorter (the node's name on a tie).

        Either names the replaced node in the original model, and the prefix is written about
        three times per created node (its name, its output, each reader's input): names were
        over 80% of a rewritten chain's node bytes, and a chain's node names (``blk07/
        DynamicQuantizeLinear``) are often twice its output names (``blk07/x_q``), an
        exporter's output names (``/layer/MatMul_output_0``) longer than its node names. The
        full node name stays recoverable: it is the ``onnx_qrewrite.origin`` entry of the
        replacement's first node (provenance.py) and the report's mapping.

        ``name`` and ``first_output``: the node's, when the caller has read them already (each
        read out of protobuf makes a new string).
        """
        if name is None:
            name = node.name
        output = first_output if first_output is not None else (node.output[0] if node.output else "")
        if name and (not output or len(name) <= len(output)):
            return name
        return output or node.op_type

    @classmethod
    def metadata_for(
        cls,
        rule_id: str,
        node: onnx.NodeProto,
        exactness: str = "exact",
        bound: float | None = None,
        mode: str = provenance.DEFAULT_MODE,
        bound_scale: tuple[str, float] | None = None,
        bound_formula: str | None = None,
        bound_u8s8: float = 0.0,
        node_name: str | None = None,
    ) -> tuple[bytes, bytes]:
        """Encoded metadata of a replacement's first node and of its other nodes, for provenance
        ``mode`` (compact: the first node only; full: every node; none: no node). ``node_name``:
        the node's name, when the caller has read it already."""
        if mode == "none":
            return b"", b""
        parts = cls.metadata_parts(rule_id, exactness, bound, bound_scale, bound_formula, bound_u8s8)
        origin = node.name if node_name is None else node_name
        encoded = parts[0] + _protowire.encode_metadata_entry(cls.ORIGIN_KEY, origin) + parts[1]
        return encoded, (encoded if mode == "full" else b"")

    @classmethod
    def metadata_parts(
        cls,
        rule_id: str,
        exactness: str = "exact",
        bound: float | None = None,
        bound_scale: tuple[str, float] | None = None,
        bound_formula: str | None = None,
        bound_u8s8: float = 0.0,
    ) -> tuple[bytes, bytes]:
        """The encoded metadata entries before and after a replacement's origin entry (see
        :meth:`metadata_for`): the same for every rewrite of one rule and bound."""
        # Only the origin differs from node to node: the entries around it are encoded once per
        # rule and bound (this runs once per rewrite, 40k times on a 20k-block chain).
        around = (rule_id, exactness, bound, bound_scale, bound_formula, bound_u8s8)
        parts = _METADATA_PARTS.get(around)
        if parts is None:
            rest = []
            if exactness != "exact":
                rest.append((cls.EXACTNESS_KEY, exactness))
            if bound is not None:
                rest.append((cls.BOUND_KEY, repr(float(bound))))
                if bound_scale is not None:
                    rest.append((cls.BOUND_PER_UNIT_KEY, repr(float(bound_scale[1]))))
                    rest.append((cls.BOUND_UNIT_KEY, bound_scale[0]))
                if bound_u8s8:
                    rest.append((cls.BOUND_U8S8_KEY, repr(float(bound_u8s8))))
            if bound_formula:
                rest.append((cls.BOUND_FORMULA_KEY, bound_formula))
            if len(_METADATA_PARTS) >= _METADATA_PARTS_MAX:  # per-node bounds: keep it small
                _METADATA_PARTS.clear()
            parts = _METADATA_PARTS[around] = (
                _protowire.encode_metadata([(cls.RULE_KEY, rule_id)]),
                _protowire.encode_metadata(rest),
            )
        return parts

    def _fresh(self, hint: str) -> str:
        # A hint used twice in one replacement (five Casts) is numbered here, as the allocator
        # would number the names (``/Cast``, ``/Cast_1``, ...): a template whose hints are all
        # different draws its names as one family, without a look-up per name (graph.py).
        if hint in self._hints_used:
            n = 1
            while f"{hint}_{n}" in self._hints_used:
                n += 1
            hint = f"{hint}_{n}"
        self._hints_used.add(hint)
        name = self._names.fresh(self._prefix + hint)
        self.fresh_names.append(name)
        self.fresh_hints.append(hint)
        return name

    @property
    def opset(self) -> int:
        return self.site.scope.default_opset

    def fresh(self, hint: str) -> str:
        return self._fresh(f"/{hint}")

    def const(self, value: Any, dtype: Any = None) -> str:
        """Name of a shared constant holding ``value``."""
        name = self._constants.get(np.asarray(value, dtype=dtype))
        self.constant_names.add(name)
        return name

    def op(
        self,
        op_type: str,
        inputs: Sequence[str],
        outputs: Sequence[str] | int = 1,
        *,
        domain: str = "",
        hint: str | None = None,
        **attrs: Any,
    ) -> list[str]:
        """Append one node; ``outputs`` is a list of names to write, or how many fresh ones.

        A node and its fresh single output share one name (``<origin>/<hint>``): node names and
        value names are separate namespaces in ONNX, and one unique name per node is cheaper and
        easier to read in a viewer.
        """
        if self._emits is not None and (domain or op_type not in self._emits):
            raise InternalError(
                f"rule {self._rule_id}: its builder emitted {op_key_of(domain, op_type)}, which its contract "
                f"does not declare (emits: {', '.join(sorted(self._emits))})"
            )
        base = f"/{hint or op_type}"
        name = self._fresh(base)
        if isinstance(outputs, int):
            outputs = [name] if outputs == 1 else [self._fresh(f"{base}_{i}") for i in range(outputs)]
        else:
            outputs = [o if o else self._fresh(f"{base}_unused") for o in outputs]
        tail = _protowire.node_tail(op_type, domain, _encode_attributes(attrs))
        self.records.append((op_type, domain, list(inputs), list(outputs), name, tail))
        metadata = self._meta_rest if self.nodes else self._meta_first
        self.nodes.append(_protowire.encode_node_fields(inputs, outputs, name, tail + metadata))
        self.created.append((name, op_type if not domain else f"{domain}::{op_type}"))
        return list(outputs)

    def names_read(self) -> set[str]:
        """Every name the emitted nodes take as input."""
        return {name for record in self.records for name in record[2]}

    def op1(self, op_type: str, inputs: Sequence[str], output: str | None = None, **kw: Any) -> str:
        """Single-output convenience form of :meth:`op`."""
        return self.op(op_type, inputs, [output] if output else 1, **kw)[0]

    def reduce_last_axis(self, op_type: str, x: str) -> str:
        """``op_type`` (ReduceMean, ReduceMax, ...) of ``x`` over its last axis, dims kept, in the
        form the model's opset takes: the axes an input from opset 18, an attribute before."""
        if self.opset >= kernel_opsets.OP_VERSIONS["reduce-axes-input"]:
            return self.op1(op_type, [x, self.const(np.array([-1], np.int64))], keepdims=1)
        return self.op1(op_type, [x], axes=[-1], keepdims=1)
