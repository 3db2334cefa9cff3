"""Which nodes of a model a target refuses, and why: the profile (:mod:`.profile`) applied to a model.

Each reason names what failed (op, domain, opset, element type, quantization constraint) and the
source the profile cites for it. Element types come from onnx's shape inference (run on a copy)
plus the model's own records, so a value whose type nobody can tell is not held against a node.
Nodes made by a rewrite are attributed to the rule and the node they replaced from their
provenance metadata (:mod:`onnx_qrewrite.rewriter.provenance`, compact or full); the verdict keeps both, so
``inspect --target`` can say which rewrite a remaining refusal comes from.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from fractions import Fraction
from math import gcd

import numpy as np
import onnx

from onnx_qrewrite._dataclass import dataclass
from onnx_qrewrite.rewriter.graph import Scope, dtype_name, iter_scopes, known_shape
from onnx_qrewrite.targets.profile import Refusal, TargetProfile
from onnx_qrewrite.targets.shapes import contrib_rank

__all__ = ["Refused", "check_model", "model_level_reasons", "node_label"]

_STANDARD = ("", "ai.onnx")
_QDQ = ("QuantizeLinear", "DequantizeLinear")


@dataclass(frozen=True)
class Refused:
    """One node the target refuses (``node == "(model)"`` for a model-wide reason)."""

    scope: str
    node: str
    op: str
    domain: str
    reasons: tuple[str, ...]
    rule: str | None = None  # the rule that created this node, when a rewrite did
    origin: str | None = None  # the node that rule replaced
    unlisted: bool = False  # the target does not run this op at all (vs. a type or constraint)

    @property
    def op_key(self) -> str:
        return self.op if self.domain in _STANDARD else f"{self.domain}::{self.op}"


def _type_name(elem: int | None) -> str | None:
    if not elem:
        return None
    name = dtype_name(elem)
    return "float32" if name == "float" else ("float64" if name == "double" else name)


def _iter_nodes(model: onnx.ModelProto) -> Iterator[tuple[Scope, onnx.NodeProto, tuple[str, str] | None]]:
    """Each node with the (rule, origin) that created it, if a rewrite did (provenance.py: with
    compact provenance only a replacement's first node carries the entries)."""
    from onnx_qrewrite.rewriter.provenance import attribute_nodes

    for scope in iter_scopes(model):
        nodes = scope.container.node
        yield from zip((scope,) * len(nodes), nodes, attribute_nodes(nodes), strict=True)


def node_label(node: onnx.NodeProto) -> str:
    """How check_model names a node in its refusals (the plan matches its nodes by it)."""
    return node.name or (node.output[0] if node.output else node.op_type)


def _inferred(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy with value_info filled in where onnx can infer it (never fails: types are a bonus)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False)
    except Exception:  # noqa: BLE001 - onnx raises several types for models it cannot infer
        return model
    if _type_contrib_qlinear(inferred.graph):
        # Once typed, what reads their outputs can be typed too (a Reshape -> Transpose between two
        # QLinear ops runs on uint8, which a target may refuse): infer again from the new records.
        with contextlib.suppress(Exception):  # as above
            inferred = onnx.shape_inference.infer_shapes(inferred, check_type=False, strict_mode=False)
    return inferred


def _type_contrib_qlinear(graph: onnx.GraphProto) -> bool:
    """onnx has no schemas for onnxruntime's com.microsoft QLinear* ops, so their outputs stay
    untyped and what consumes them could not be judged by type (a Flatten on their uint8 output
    looked typeless as given and was refused once rewritten). Their output is the quantized type T
    of their operands (onnxruntime's ContribOperators.md): the first 8-bit integer input's type."""
    known = {v.name: v.type.tensor_type.elem_type for v in (*graph.input, *graph.output, *graph.value_info)}
    known.update({t.name: t.data_type for t in graph.initializer})
    eight_bit = (onnx.TensorProto.UINT8, onnx.TensorProto.INT8)
    added = False
    for node in graph.node:
        if node.domain != "com.microsoft" or not node.op_type.startswith("QLinear") or not node.output:
            continue
        out = node.output[0]
        if known.get(out):
            continue
        elem = next((known[i] for i in node.input if known.get(i) in eight_bit), None)
        if elem is not None:
            graph.value_info.append(onnx.helper.make_tensor_value_info(out, elem, None))
            known[out] = elem
            added = True
    return added


def model_level_reasons(model: onnx.ModelProto, profile: TargetProfile) -> list[str]:
    """Reasons the target refuses the model as a whole (its default-domain opset, its IR version,
    symbolic input dimensions where it needs static shapes)."""
    from onnx_qrewrite.targets.lower_ir import ir_reason

    ir = ir_reason(model, profile)
    return _opset_reasons(model, profile) + ([ir] if ir else []) + _shape_reasons(model, profile)


def _shape_reasons(model: onnx.ModelProto, profile: TargetProfile) -> list[str]:
    """One reason per input with a dimension that is not fixed, naming the input and the dimension."""
    from onnx_qrewrite.targets.shapes import symbolic_dims

    if not profile.static_shapes:
        return []
    by_input: dict[str, list[str]] = {}
    for name, index, param in symbolic_dims(model):
        by_input.setdefault(name, []).append(f"{index} ({param!r})" if param else f"{index} (unnamed)")
    src = profile.cite(profile.shapes_source)
    return [
        f"input {name!r} has symbolic dimension{'s' if len(dims) > 1 else ''} {', '.join(dims)}: the target needs "
        f"static input shapes {src}; fix them with --input-shape {name}:D0,D1,... or --input-shape DIM=N"
        for name, dims in by_input.items()
    ]


def _opset_reasons(model: onnx.ModelProto, profile: TargetProfile) -> list[str]:
    opset = next((o.version for o in model.opset_import if o.domain in _STANDARD), None)
    if opset is None:
        return []
    src = profile.cite(profile.opset_source)
    if profile.opset_min is not None and opset < profile.opset_min:
        return [f"default-domain opset {opset} is below the lowest the target loads ({profile.opset_min}) {src}"]
    if profile.opset_max is not None and opset > profile.opset_max:
        return [f"default-domain opset {opset} is above the highest the target loads ({profile.opset_max}) {src}"]
    return _undescribed_opset(opset)


def _undescribed_opset(opset: int) -> list[str]:
    """A model above the highest opset onnx-qrewrite describes (its lowering table's top: 26, what
    onnxruntime 1.31.1 loads) is refused for every target, also those whose runtime loads it: what
    onnx changed at the opsets above (Range at 27; Mod, BitShift, SpaceToDepth... at 28) is in no
    table here, so no verdict on its nodes would hold."""
    from onnx import defs

    from onnx_qrewrite.rewriter.opset import MAX_RUNTIME_OPSET

    if opset <= MAX_RUNTIME_OPSET:
        return []
    return [
        f"default-domain opset {opset} is above {MAX_RUNTIME_OPSET}, the highest onnx-qrewrite describes (onnx "
        f"{onnx.__version__} defines up to {defs.onnx_opset_version()}; what changed at {MAX_RUNTIME_OPSET + 1}"
        f"{'-' + str(opset) if opset > MAX_RUNTIME_OPSET + 1 else ''} is in no rule, target table or "
        "rules/opsets/lowering.toml step)"
    ]


def _quant_type(node: onnx.NodeProto, scope: Scope) -> str | None:
    if node.op_type == "DequantizeLinear":
        return _type_name(scope.elem_type(node.input[0]))
    if len(node.input) > 2 and node.input[2]:
        return _type_name(scope.elem_type(node.input[2]))
    for attr in node.attribute:
        if attr.name == "output_dtype" and attr.i:
            return _type_name(attr.i)
    return _type_name(scope.elem_type(node.output[0])) or "uint8"


def _operand(node: onnx.NodeProto, index: int) -> str | None:
    return node.input[index] if len(node.input) > index and node.input[index] else None


def _node_reasons(node: onnx.NodeProto, scope: Scope, profile: TargetProfile, graph_io: set[str]) -> list[str]:
    domain = "" if node.domain in _STANDARD else node.domain
    opset = scope.opsets.get(domain, scope.opsets.get("ai.onnx", 0) if not domain else 0)
    entries = profile.support(domain, node.op_type)
    where = domain or "ai.onnx"
    if not entries:
        listed_domain = any(d == domain for d, _ in profile.ops)
        if listed_domain:
            return [f"{where}::{node.op_type} is not among the ops the target runs"]
        return [f"the target runs no {where} ops ({where}::{node.op_type})"]
    in_range = [
        e
        for e in entries
        if (e.min_opset is None or opset >= e.min_opset) and (e.max_opset is None or opset <= e.max_opset)
    ]
    if not in_range:
        spans = ", ".join(f"{e.min_opset or ''}..{e.max_opset or ''}" for e in entries)
        return [
            f"{node.op_type} at opset {opset}: the target runs it at opsets {spans} {profile.cite(entries[0].source)}"
        ]
    reasons: list[str] = []
    typed = [e for e in in_range if e.types is not None]
    if typed and len(typed) == len(in_range):
        allowed = frozenset[str]().union(*(e.types for e in typed if e.types is not None))
        quant = node.op_type in _QDQ
        for name in node.input:
            if not name:
                continue
            t = _type_name(scope.elem_type(name))
            if t is not None and t not in allowed:
                # Q/DQ: the quantized side is judged by [quantization], not by the float table.
                if quant and profile.quantization is not None and t in (profile.quantization.types or ()):
                    continue
                reasons.append(
                    f"{node.op_type} on {t} ({name!r}): the target takes {', '.join(sorted(allowed))} "
                    f"{profile.cite(typed[0].source)}"
                )
                break
    if domain == "" and node.op_type in _QDQ and profile.quantization is not None:
        reasons.extend(_quantization_reasons(node, scope, profile))
    for refusal in profile.refusals:
        if refusal.op != node.op_type or refusal.domain != domain:
            continue
        why = _refusal_applies(refusal, node, scope)
        if why is not None:
            reasons.append(f"{node.op_type}{why}: {refusal.reason} {profile.cite(refusal.source)}")
    reasons.extend(_network_reasons(node, scope, profile, graph_io))
    return reasons


def _is_constant(scope: Scope, name: str | None) -> bool:
    return name is None or scope.initializer(name) is not None or scope.constant(name) is not None


#: The scale inputs of the ops a `per-channel` refusal looks at.
_SCALES = {"QuantizeLinear": (1,), "DequantizeLinear": (1,), "QLinearConv": (1, 4, 6), "QLinearMatMul": (1, 4, 6)}


#: How many com.microsoft producers :func:`_rank` follows back from a value (a QOperator model's
#: chain of QLinear ops between two QLinearMatMuls is a few long).
_RANK_DEPTH = 32


def _rank(scope: Scope, name: str, depth: int = _RANK_DEPTH) -> int | None:
    """:func:`_rank_uncached` once per scope, name and depth: a chain of QLinearAdd(a, a), or of
    residual adds a + f(a), reaches each value by two paths, and without the memo the calls
    doubled per link (a 20-link chain took 71 s). The depth is in the key, so each answer is the
    one the unmemoized recursion gave."""
    return scope.memo(("target-rank", name, depth), lambda: _rank_uncached(scope, name, depth))


def _rank_uncached(scope: Scope, name: str, depth: int) -> int | None:
    """The number of dimensions of ``name`` when shape inference or a constant tells it, or its
    producer fixes it whatever its input's shape (Flatten: 2, where onnx's inference gives no
    shape for an input of unknown shape, e.g. a QOperator CNN's pooled value), or it is the output
    of com.microsoft ops that keep their input's rank (shapes.contrib_rank: onnx's inference stops
    at them, onnxruntime's symbolic inference, which onnx2tf runs, does not)."""
    shape = scope.recorded_shapes.get(name)
    if shape is not None:
        return len(shape)
    value = scope.constant(name)
    if value is not None:
        return value.ndim
    producer = scope.producer(name)
    if producer is None:
        return None
    if producer.domain in _STANDARD and producer.op_type == "Flatten":
        return 2
    if depth <= 0 or not producer.output or producer.output[0] != name:
        return None
    return contrib_rank(producer, lambda n: _rank(scope, n, depth - 1))


def _in_chain(node: onnx.NodeProto, scope: Scope, chain: tuple[str, ...]) -> bool:
    """Whether ``node`` is a link of ``chain``: standard ops, each one's first output feeding the
    next (how a runtime's own fusion finds a pattern, e.g. QNN's Div -> Erf -> Add -> Mul GELU).
    Only the op types along one direct path are matched, not the constants beside it."""

    def standard(n: onnx.NodeProto | None, op: str) -> bool:
        return n is not None and n.domain in _STANDARD and n.op_type == op

    def back(n: onnx.NodeProto, i: int) -> bool:  # n is chain[i]; chain[:i] lead to it
        if i == 0:
            return True
        producers = [scope.producer(x) for x in n.input if x]
        return any(p is not None and standard(p, chain[i - 1]) and back(p, i - 1) for p in producers)

    def ahead(n: onnx.NodeProto, i: int) -> bool:  # n is chain[i]; chain[i + 1:] follow it
        if i == len(chain) - 1:
            return True
        nxt = scope.input_readers(n.output[0]) if n.output else []
        return any(standard(c, chain[i + 1]) and ahead(c, i + 1) for c in nxt)

    return any(op == node.op_type and back(node, i) and ahead(node, i) for i, op in enumerate(chain))


def _unfused(node: onnx.NodeProto, scope: Scope, readers: frozenset[str]) -> str | None:
    """Why ``node`` cannot be the head of a runtime's node group (QNN's DQMatMulIntegerFusion,
    DQConvIntegerFusion and DqlDqFusion take a DynamicQuantizeLinear only with the group they
    fuse it into): each output read by exactly one node and not a graph output, the first output by
    one of ``readers``. None when it can be."""
    container = scope.container
    outputs = set(container.output) if isinstance(container, onnx.FunctionProto) else {o.name for o in container.output}
    for index, name in enumerate(node.output):
        if not name:
            return f" whose output {index} is not produced"
        if name in outputs:
            return f" whose output {name!r} is a graph output"
        read = scope.input_readers(name)
        if not read:
            return f" whose output {name!r} no node reads"
        if len(read) > 1:
            return f" whose output {name!r} is read by {len(read)} nodes"
        if index == 0 and (read[0].domain not in _STANDARD or read[0].op_type not in readers):
            return f" whose output {name!r} is read by a {read[0].op_type}"
    return None


#: Standard ops a runtime cannot fold at load time although every input is a constant.
_NOT_FOLDED = frozenset(
    {"Bernoulli", "Multinomial", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike"}
)


def _folded(scope: Scope) -> frozenset[str]:
    """The values of ``scope`` a runtime that folds constants at load time (OpenVINO) sees as
    constants: initializers and Constants, the Shape or Size of a value whose recorded shape is
    static (``--input-shape`` makes an input's so), and what a standard op without subgraphs
    computes from such values alone. One pass in node order: a value out of order is not folded."""

    def shape_folds(inputs: list[str]) -> bool:
        return bool(inputs) and known_shape(scope.recorded_shapes.get(inputs[0])) is not None

    return scope.memo("targets.check.folded", lambda: _computed_from_constants(scope, shape_folds))


def _quantized_from(scope: Scope, name: str) -> str | None:
    """The input of the QuantizeLinear -> DequantizeLinear pair (standard ops) whose
    DequantizeLinear gives ``name``, or None when ``name`` is not such a pair's output."""
    dq = scope.producer(name)
    if dq is None or dq.domain not in _STANDARD or dq.op_type != "DequantizeLinear" or not dq.input:
        return None
    q = scope.producer(dq.input[0])
    if q is None or q.domain not in _STANDARD or q.op_type != "QuantizeLinear" or not q.input:
        return None
    return q.input[0]


def _folded_quantize_input(node: onnx.NodeProto, scope: Scope) -> str | None:
    """Two inputs of ``node`` are Q -> DQ pairs, one of a value the runtime folds to a constant of
    more than one element, one of a value computed at run time: what it saw, else None."""
    folded = _folded(scope)
    constant, computed = None, None
    for name in node.input:
        source = _quantized_from(scope, name) if name else None
        if source is None:
            continue
        if source in folded or _is_constant(scope, source):
            dims = known_shape(scope.recorded_shapes.get(source))
            value = scope.constant(source) if dims is None else None
            size = int(np.prod(dims)) if dims is not None else (value.size if value is not None else 1)
            constant = constant or (source if size > 1 else None)
        else:
            computed = computed or source
    if constant is None or computed is None:
        return None
    return f" of a quantized run-time value ({computed!r}) and a quantized constant ({constant!r}, folded at load time)"


def _refusal_applies(refusal: Refusal, node: onnx.NodeProto, scope: Scope) -> str | None:
    """None when the refusal does not hold for this node, else a phrase saying what it saw: the
    check of its ``when`` (``_WHEN``, one function per condition profile.REFUSE_WHEN names)."""
    applies = _WHEN.get(refusal.when)
    return applies(refusal, node, scope) if applies is not None else None


def _always(refusal: Refusal, node: onnx.NodeProto, scope: Scope) -> str | None:
    """The op is refused whatever it reads (nothing more to say)."""
    return ""


def _input_from(refusal: Refusal, node: onnx.NodeProto, scope: Scope) -> str | None:
    """One of the inputs looked at is written by one of the standard ops named, directly or
    through a chain of the standard ops ``through`` names (at any of their inputs)."""
    for index in refusal.inputs:
        name = _operand(node, index)
        found = _written_by(scope, name, refusal) if name else None
        if found is not None:
            op, via = found
            through = f" through {', '.join(via)}" if via else ""
            return f" of a {op} output{through}" + (f" (input {index}, {name!r})" if index else "")
    return None


def _written_by(scope: Scope, name: str, refusal: Refusal) -> tuple[str, list[str]] | None:
    """(the op of ``refusal.ops`` that writes ``name``, the ``through`` nodes on the way), or None."""
    pending: list[tuple[str, list[str]]] = [(name, [])]
    seen = {name}
    while pending:
        value, via = pending.pop()
        producer = scope.producer(value)
        if producer is None or producer.domain not in _STANDARD:
            continue
        if producer.op_type in refusal.ops:
            return producer.op_type, via
        if producer.op_type in refusal.through and _static_where_asked(scope, producer, refusal):
            step = [*via, f"{producer.op_type} {producer.name or value!r}"]
            for x in producer.input:
                if x and x not in seen:
                    seen.add(x)
                    pending.append((x, step))
    return None


def _static_where_asked(scope: Scope, node: onnx.NodeProto, refusal: Refusal) -> bool:
    """Whether ``node`` (an op of ``refusal.through``) is looked through: always, unless
    ``through_static`` names its op, then only where that input is computed from constants and
    Shape/Size alone (tract folds it once input facts are known, as verify gives them; a Where of
    a condition read from run-time data it keeps, and computes right: rules/targets/tract.toml)."""
    for op, index in refusal.through_static:
        if node.op_type == op:
            name = _operand(node, index)
            return name is not None and (name in _shape_computed(scope) or _is_constant(scope, name))
    return True


def _shape_computed(scope: Scope) -> frozenset[str]:
    """The values of ``scope`` computed from constants and the Shape or Size of any value (static
    or not) alone, through standard ops without subgraphs: no run-time data in them."""
    return scope.memo("targets.check.shape_computed", lambda: _computed_from_constants(scope, lambda _: True))


def _computed_from_constants(scope: Scope, shape_folds: Callable[[list[str]], bool]) -> frozenset[str]:
    """The values of ``scope`` computed from constants alone through standard ops without
    subgraphs (random ops excluded), a Shape or Size counting as constant where ``shape_folds``
    says so for its inputs. One pass in node order: a value out of order is not counted."""
    found: set[str] = set()
    for node in scope.container.node:
        if node.domain not in _STANDARD or node.op_type in _NOT_FOLDED:
            continue
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            continue
        inputs = [x for x in node.input if x]
        if node.op_type in ("Shape", "Size"):
            folds = shape_folds(inputs)
        else:
            folds = node.op_type == "Constant" or (
                bool(inputs) and all(x in found or _is_constant(scope, x) for x in inputs)
            )
        if folds:
            found.update(o for o in node.output if o)
    return frozenset(found)


def _per_channel(refusal: Refusal, node: onnx.NodeProto, scope: Scope) -> str | None:
    """A constant scale of the op has more than one element."""
    for index in _SCALES.get(node.op_type, ()):
        name = _operand(node, index)
        value = scope.constant(name) if name else None
        if value is not None and value.size > 1:
            return f" with per-channel scales ({name!r})"
    return None


def _computed_scale(refusal: Refusal, node: onnx.NodeProto, scope: Scope) -> str | None:
    """The scale (input 1) is not a constant."""
    return None if _is_constant(scope, _operand(node, 1)) else " with a scale computed at run time"


def _computed_zero_point(refusal: Refusal, node: onnx.NodeProto, scope: Scope) -> str | None:
    """The zero point (input 2) is not a constant; an absent one is the constant 0."""
    return None if _is_constant(scope, _operand(node, 2)) else " with a zero point computed at run time"


def _nonzero_zero_point(refusal: Refusal, node: onnx.NodeProto, scope: Scope) -> str | None:
    """A zero point is given and is not a constant all 0 (a run-time one may be anything)."""
    zp = _operand(node, 2)
    if zp is None:
        return None
    value = scope.constant(zp)
    if value is None or np.any(value.astype(np.float64) != 0):
        return " with a non-zero (or run-time) zero point"
    return None


def _of_type(refusal: Refusal, node: onnx.NodeProto, scope: Scope) -> str | None:
    """An input or output has one of the types named."""
    for name in [*node.input, *node.output]:
        t = _type_name(scope.elem_type(name)) if name else None
        if t in refusal.types:
            return f" on {t} ({name!r})"
    return None


def _rank_above(refusal: Refusal, node: onnx.NodeProto, scope: Scope) -> str | None:
    """An input looked at has more dimensions than the target takes (a known rank only)."""
    assert refusal.rank is not None
    for index in refusal.inputs:
        name = _operand(node, index)
        rank = _rank(scope, name) if name else None
        if rank is not None and rank > refusal.rank:
            return f" with a rank-{rank} input ({name!r}; at most {refusal.rank})"
    return None


def _rank_below(refusal: Refusal, node: onnx.NodeProto, scope: Scope) -> str | None:
    """An input looked at has fewer dimensions than the target takes (a known rank only)."""
    assert refusal.rank is not None
    for index in refusal.inputs:
        name = _operand(node, index)
        rank = _rank(scope, name) if name else None
        if rank is not None and rank < refusal.rank:
            return f" with a rank-{rank} input ({name!r}; at least {refusal.rank})"
    return None


def _shape_unrecorded(refusal: Refusal, node: onnx.NodeProto, scope: Scope) -> str | None:
    """An input looked at has no recorded shape (not even its rank): a converter that infers shapes
    itself decides them, and may decide them wrongly (onnx2tf: the tflite profile)."""
    for index in refusal.inputs:
        name = _operand(node, index)
        if name and _rank(scope, name) is None:
            return f" with input {index} ({name!r}) of unrecorded shape"
    return None


def _shape_not_static(refusal: Refusal, node: onnx.NodeProto, scope: Scope) -> str | None:
    """An input looked at has no recorded shape or a dimension that is not a number (a symbolic
    one): a converter that infers shapes itself may fix such dimensions wrongly (onnx2tf)."""
    for index in refusal.inputs:
        name = _operand(node, index)
        if name and scope.constant(name) is None and known_shape(scope.recorded_shapes.get(name)) is None:
            return f" with input {index} ({name!r}) of a shape that is not fixed"
    return None


def _computed_input(refusal: Refusal, node: onnx.NodeProto, scope: Scope) -> str | None:
    """An input looked at is not a constant."""
    for index in refusal.inputs:
        name = _operand(node, index)
        if name is not None and not _is_constant(scope, name):
            return f" with input {index} ({name!r}) computed at run time"
    return None


def _outside_chain(refusal: Refusal, node: onnx.NodeProto, scope: Scope) -> str | None:
    """The node is not part of the chain of ops the target fuses (:func:`_in_chain`)."""
    return None if _in_chain(node, scope, refusal.chain) else f" outside a {' -> '.join(refusal.chain)} chain"


def _unfused_outputs(refusal: Refusal, node: onnx.NodeProto, scope: Scope) -> str | None:
    """:func:`_unfused`: what reads the node's outputs is not one of the ops it fuses with."""
    return _unfused(node, scope, refusal.ops)


def _folded_quantize(refusal: Refusal, node: onnx.NodeProto, scope: Scope) -> str | None:
    """:func:`_folded_quantize_input`."""
    return _folded_quantize_input(node, scope)


def _read_by(refusal: Refusal, node: onnx.NodeProto, scope: Scope) -> str | None:
    """The node's first output is read by one of the standard ops named (and, when types are
    named, a Q/DQ node quantizes to one of them)."""
    readers = scope.input_readers(node.output[0]) if node.output else []
    reader = next((c for c in readers if c.domain in _STANDARD and c.op_type in refusal.ops), None)
    if reader is None:
        return None
    t = _quant_type(node, scope) if node.op_type in _QDQ else None
    if refusal.types and t not in refusal.types:
        return None
    return f"{f' of {t}' if t else ''} read by a {reader.op_type} ({node_label(reader)!r})"


def _quantized_type(refusal: Refusal, node: onnx.NodeProto, scope: Scope) -> str | None:
    """The quantized type is one of those named: a Q/DQ node's quantized side, else the first
    input or output of a named type."""
    t = _quant_type(node, scope) if node.op_type in _QDQ else None
    if t is None:
        for name in [*node.input, *node.output]:
            tn = _type_name(scope.elem_type(name)) if name else None
            if tn in refusal.types:
                t = tn
                break
    return f" on {t}" if t in refusal.types else None


def _exact_ties(refusal: Refusal, node: onnx.NodeProto, scope: Scope) -> str | None:
    """A com.microsoft QLinearAdd whose exact result, ((a - a_zp)·a_scale + (b - b_zp)·b_scale) /
    c_scale with its constant float32 scales taken exactly, is k + 1/2 for some operands (the
    constant ones' own values, a run-time one's whole type range): scale ratios that are short
    binary fractions (0.02 and 0.03 over 0.04). Runtimes round such ties differently (onnxruntime to
    even). None when no operands give one, or a scale or zero point is not a per-tensor constant."""
    if node.domain != "com.microsoft" or node.op_type != "QLinearAdd" or len(node.input) < 7:
        return None
    a, b = _tie_operand(scope, node, 0), _tie_operand(scope, node, 3)
    c_scale = _scalar_constant(scope, node.input[6])
    if a is None or b is None or c_scale is None or c_scale == 0:
        return None
    if not _tie_reachable(a[0] / c_scale, a[1], b[0] / c_scale, b[1]):
        return None
    return " (its scale ratios make exact ties k + 1/2 reachable)"


def _scalar_constant(scope: Scope, name: str | None) -> Fraction | None:
    """A per-tensor constant scale or zero point, exactly (an absent zero point is 0)."""
    if not name:
        return Fraction(0)
    value = scope.constant(name)
    if value is None or value.size != 1:
        return None
    return Fraction(float(value.reshape(()).item()))


def _tie_operand(scope: Scope, node: onnx.NodeProto, at: int) -> tuple[Fraction, list[int]] | None:
    """Operand ``at`` of a QLinearAdd: its scale, and the values of (operand - zero point) it can
    take (a constant's own, else its type's range)."""
    scale = _scalar_constant(scope, node.input[at + 1])
    zero = _scalar_constant(scope, node.input[at + 2] if len(node.input) > at + 2 else "")
    if scale is None or zero is None:
        return None
    value = scope.constant(node.input[at])
    if value is not None:
        return scale, sorted({int(v) - int(zero) for v in value.ravel().tolist()})
    low, high = (0, 255) if scope.elem_type(node.input[at]) == onnx.TensorProto.UINT8 else (-128, 127)
    return scale, list(range(low - int(zero), high - int(zero) + 1))


def _tie_reachable(a_ratio: Fraction, a_values: list[int], b_ratio: Fraction, b_values: list[int]) -> bool:
    """Whether i·a_ratio + j·b_ratio has denominator 2 for some i of ``a_values`` and j of
    ``b_values``: with both ratios over a common denominator L, i·P_a + j·P_b ≡ L/2 (mod L), solved
    for i per j (a linear congruence), so a run-time operand's 256 values cost 256 steps."""
    if not a_values or not b_values:
        return False
    common = a_ratio.denominator * b_ratio.denominator // gcd(a_ratio.denominator, b_ratio.denominator)
    if common % 2:
        return False
    pa = a_ratio.numerator * (common // a_ratio.denominator) % common
    pb = b_ratio.numerator * (common // b_ratio.denominator) % common
    g = gcd(pa, common)
    modulus = common // g
    inverse = pow(pa // g, -1, modulus) if modulus > 1 else 0
    low, high = a_values[0], a_values[-1]
    dense = len(a_values) == high - low + 1
    for j in b_values:
        target = (common // 2 - j * pb) % common
        if target % g:
            continue
        first = target // g * inverse % modulus if modulus > 1 else 0
        if dense:
            i = low + (first - low) % modulus
            if i <= high:
                return True
        elif any((i - first) % modulus == 0 for i in a_values):
            return True
    return False


#: profile.REFUSE_WHEN -> whether such a refusal holds for a node (None) and what it saw.
_WHEN: dict[str, Callable[[Refusal, onnx.NodeProto, Scope], str | None]] = {
    "always": _always,
    "exact-ties": _exact_ties,
    "input-from": _input_from,
    "per-channel": _per_channel,
    "computed-scale": _computed_scale,
    "computed-zero-point": _computed_zero_point,
    "nonzero-zero-point": _nonzero_zero_point,
    "type": _of_type,
    "rank-above": _rank_above,
    "rank-below": _rank_below,
    "computed-input": _computed_input,
    "outside-chain": _outside_chain,
    "unfused-outputs": _unfused_outputs,
    "folded-quantize-input": _folded_quantize,
    "read-by": _read_by,
    "quantized-type": _quantized_type,
    "shape-unrecorded": _shape_unrecorded,
    "shape-not-static": _shape_not_static,
}


def _quantization_reasons(node: onnx.NodeProto, scope: Scope, profile: TargetProfile) -> list[str]:
    q = profile.quantization
    assert q is not None
    src = profile.cite(q.source)
    out = []
    qtype = _quant_type(node, scope)
    if q.types is not None and qtype is not None and qtype not in q.types and qtype != "int32":
        out.append(f"{node.op_type} of {qtype}: the target quantizes to {', '.join(sorted(q.types))} only {src}")
    if qtype == "int32" and q.types is not None and "int32" not in q.types:
        out.append(f"DequantizeLinear of int32 (a bias): not among {', '.join(sorted(q.types))} {src}")
    scale, zp = _operand(node, 1), _operand(node, 2)
    if q.constant_scale and not _is_constant(scope, scale):
        out.append(f"{node.op_type} with a scale computed at run time: the target needs constant scales {src}")
    if q.constant_zero_point and not _is_constant(scope, zp):
        out.append(f"{node.op_type} with a zero point computed at run time: the target needs constants {src}")
    if q.symmetric and zp is not None:
        value = scope.constant(zp)
        if value is not None and np.any(value.astype(np.float64) != 0):
            out.append(f"{node.op_type} with a non-zero zero point: the target quantizes symmetrically only {src}")
    attrs = {a.name: a for a in node.attribute}
    if not q.blocked and "block_size" in attrs and attrs["block_size"].i:
        out.append(f"{node.op_type} with block_size {attrs['block_size'].i}: no blocked quantization {src}")
    if not q.per_channel and scale is not None:
        shape = scope.recorded_shapes.get(scale)
        value = scope.constant(scale) if shape is None else None
        dims = known_shape(shape)
        size = int(np.prod(dims)) if dims else (value.size if value is not None else 1)
        if size > 1:
            out.append(f"{node.op_type} with per-channel scales: the target takes per-tensor scales only {src}")
    return out


def _network_reasons(node: onnx.NodeProto, scope: Scope, profile: TargetProfile, graph_io: set[str]) -> list[str]:
    if not (profile.io_only_types or profile.refused_types or profile.qdq_only_types):
        return []
    src = profile.cite(profile.network_source)
    exempt = (*_QDQ, "Constant", *profile.keep)  # Constants become initializers before a runtime sees them
    if profile.qdq_only_types and node.op_type not in exempt:
        # Constants (a MatMulNBits' packed weights, an embedding table) are the runtime's to
        # convert; what it cannot have is such a tensor computed at run time.
        for name in [*node.input, *node.output]:
            t = _type_name(scope.elem_type(name)) if name else None
            if t in profile.qdq_only_types and not _is_constant(scope, name):
                return [
                    f"{node.op_type} on {t} ({name!r}): the target takes {t} tensors only on the quantized "
                    f"side of a QuantizeLinear/DequantizeLinear {src}"
                ]
    for name in node.output:
        t = _type_name(scope.elem_type(name)) if name else None
        if t is None:
            continue
        if t in profile.refused_types:
            return [f"produces {t} ({name!r}): the target has no {t} tensors {src}"]
        if t in profile.io_only_types and name not in graph_io:
            return [f"produces {t} inside the network ({name!r}): {t} only as a model input or output {src}"]
    return []


def computed_differently(model: onnx.ModelProto, profile: TargetProfile) -> list[Refused]:
    """Every node of ``model`` that ``profile``'s ``[[differs]]`` entries say the target runs but
    computes otherwise than onnxruntime (observed): not refused, since no rewrite changes what the
    runtime does with it, but named, so ``inspect --target`` says it before the runtime shows it."""
    names = {entry.op for entry in profile.differences}
    # Shape inference (what the conditions read) only when a node could match: most models have none.
    if not any(node.op_type in names for _, node, _ in _iter_nodes(model)):
        return []
    out: list[Refused] = []
    for scope, node, provenance in _iter_nodes(_inferred(model)):
        domain = "" if node.domain in _STANDARD else node.domain
        reasons = [
            f"{node.op_type}{why}: {entry.reason} {profile.cite(entry.source)}"
            for entry in profile.differences
            if entry.op == node.op_type and entry.domain == domain
            for why in [_refusal_applies(entry, node, scope)]
            if why is not None
        ]
        if reasons:
            rule, origin = provenance or (None, None)
            out.append(Refused(scope.path, node_label(node), node.op_type, node.domain, tuple(reasons), rule, origin))
    return out


def check_model(
    model: onnx.ModelProto, profile: TargetProfile, *, inferred: onnx.ModelProto | None = None
) -> list[Refused]:
    """Every node ``profile`` refuses in ``model`` (plus a ``(model)`` entry for model-wide reasons).

    ``model`` is not modified; shape inference runs on a copy (``inferred``: that copy, when the
    caller has made it with :func:`_inferred` already: a plan keeps it for its next stage). Constant
    nodes are judged like any node (a target that has no Constant op folds them at load time only if
    its table says so).
    """
    if inferred is None:
        inferred = _inferred(model)
    graph_io = {v.name for v in (*inferred.graph.input, *inferred.graph.output)}
    out: list[Refused] = []
    model_reasons = model_level_reasons(inferred, profile)
    if model_reasons:
        out.append(Refused("main", "(model)", "(model)", "", tuple(model_reasons)))
    for scope, node, provenance in _iter_nodes(inferred):
        reasons = _node_reasons(node, scope, profile, graph_io)
        if reasons:
            rule, origin = provenance or (None, None)
            unlisted = not profile.support(node.domain, node.op_type)
            out.append(
                Refused(scope.path, node_label(node), node.op_type, node.domain, tuple(reasons), rule, origin, unlisted)
            )
    return out
