"""Static input shapes for targets: ``--input-shape`` fixes a model's symbolic dimensions before a
target plan is made, and the shapes that follow are recorded so the rules and the target's checks
see them.

Fixing follows onnxruntime's ``make_dynamic_shape_fixed`` (``onnxruntime/tools/onnx_model_utils.py``,
onnxruntime 1.31.1): ``NAME:D0,D1,...`` sets the shape of input NAME (its rank and fixed dimensions
must match; a symbolic dimension's value then replaces that ``dim_param`` wherever it appears: the
graph's inputs, outputs and value_info, subgraphs included; an unnamed unknown dimension is set on
that input only); ``DIM=N`` replaces the symbolic dimension DIM everywhere (its ``--dim_param`` /
``--dim_value``). Values must be at least 1, as there. Graph outputs whose shape then follows get
it, as its ``fix_output_shapes`` does.

Recording: onnx's shape inference stops at ops it has no schema for (onnxruntime's com.microsoft
ops), so nothing downstream of a QLinearAdd or QLinearSoftmax gets a shape, and a rule that needs
one (qop-matmul bounding an activation product by its reduction length) gives way. Between rounds
of onnx's inference (with data propagation, for Reshape targets computed from Shape), the output
shapes of the contrib ops whose shape rule is simple (same as an input, broadcast, matmul) are
added from onnxruntime's ContribOperators.md definitions, until a round adds nothing.
onnxruntime's own ``symbolic_shape_infer`` is not used: it has no rule for QLinearSoftmax, and on
an incomplete inference it writes ``sym_shape_infer_temp.onnx`` into the current folder and raises
(onnxruntime 1.31.1); nor would the core install have it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping

import numpy as np
import onnx

from onnx_qrewrite._dataclass import dataclass
from onnx_qrewrite.errors import UsageError
from onnx_qrewrite.io.input_shape import InputShapes, parse_input_shapes  # verify's parser too

__all__ = [
    "Applied",
    "InputShapes",
    "apply_input_shapes",
    "contrib_rank",
    "drop_value_info",
    "fix_input_shapes",
    "parse_input_shapes",
    "record_shapes",
    "symbolic_dims",
]

OPTION = "--input-shape"


def _graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _graphs(attr.g)
            for sub in attr.graphs:
                yield from _graphs(sub)


def _inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """The graph inputs a caller feeds (not initializers listed as inputs, as before IR 4)."""
    constant = {t.name for t in model.graph.initializer}
    return [v for v in model.graph.input if v.name not in constant and v.type.HasField("tensor_type")]


def symbolic_dims(model: onnx.ModelProto) -> list[tuple[str, int, str]]:
    """Every dimension of a fed input that is not fixed: (input, position, its name or "")."""
    out = []
    for vi in _inputs(model):
        if not vi.type.tensor_type.HasField("shape"):
            continue
        for i, dim in enumerate(vi.type.tensor_type.shape.dim):
            if not dim.HasField("dim_value"):
                out.append((vi.name, i, dim.dim_param))
    return out


#: An ONNX dimension is an int64 (TensorShapeProto.Dimension.dim_value): a larger value cannot be written.
_DIM_MAX = 2**63 - 1


def _checked_value(value: int, what: str) -> int:
    if value < 1:
        raise UsageError(f"{OPTION}: {what} must be at least 1 to be fixed (as make_dynamic_shape_fixed), got {value}")
    if value > _DIM_MAX:
        raise UsageError(f"{OPTION}: {what} must be at most 2**63-1 (an ONNX dimension is int64), got {value}")
    return value


def _plan_fix(model: onnx.ModelProto, shapes: InputShapes, label: str) -> tuple[dict[str, int], list[tuple]]:
    """Which dim_params get which value, and which unnamed dims of which input; UsageError naming
    the input or dimension when ``shapes`` does not fit the model."""
    by_name = {vi.name: vi for vi in _inputs(model)}
    params: dict[str, int] = {}
    unnamed: list[tuple] = []

    def assign(param: str, value: int, how: str) -> None:
        if params.setdefault(param, value) != value:
            raise UsageError(f"{OPTION}: {label}: dimension {param!r} is given as {params[param]} and {value} ({how})")

    for name, shape in shapes.inputs.items():
        vi = by_name.get(name)
        if vi is None:
            raise UsageError(f"{OPTION}: {label} has no input named {name!r} (inputs: {', '.join(by_name) or 'none'})")
        dims = vi.type.tensor_type.shape.dim
        if len(dims) != len(shape):
            raise UsageError(f"{OPTION}: input {name!r} of {label} has rank {len(dims)}, {len(shape)} dimensions given")
        for i, (dim, value) in enumerate(zip(dims, shape, strict=True)):
            if dim.HasField("dim_value"):
                if dim.dim_value != value:
                    raise UsageError(f"{OPTION}: input {name!r} dimension {i} is fixed at {dim.dim_value}, got {value}")
            elif dim.dim_param:
                assign(dim.dim_param, _checked_value(value, f"input {name!r} dimension {i}"), f"input {name!r}")
            else:
                unnamed.append((dim, _checked_value(value, f"input {name!r} dimension {i}")))
    declared = {param for _, _, param in symbolic_dims(model) if param}
    for param, value in shapes.dims.items():
        if param not in declared:
            known = ", ".join(sorted(declared)) or "none"
            raise UsageError(
                f"{OPTION} {param}={value}: no input of {label} has a dimension named {param!r} (named: {known})"
            )
        assign(param, _checked_value(value, f"dimension {param!r}"), f"{param}={value}")
    return params, unnamed


def fix_input_shapes(model: onnx.ModelProto, shapes: InputShapes, label: str = "the model") -> list[str]:
    """Fix ``model``'s symbolic dimensions from ``shapes`` in place (module docstring); returns what
    was fixed, in words ("batch=1"). Nothing is changed when ``shapes`` does not fit (UsageError)."""
    params, unnamed = _plan_fix(model, shapes, label)
    for dim, value in unnamed:
        dim.Clear()
        dim.dim_value = value
    for graph in _graphs(model.graph):
        for vi in (*graph.input, *graph.output, *graph.value_info):
            if not vi.type.HasField("tensor_type"):
                continue
            for dim in vi.type.tensor_type.shape.dim:
                if dim.HasField("dim_param") and dim.dim_param in params:
                    value = params[dim.dim_param]
                    dim.Clear()
                    dim.dim_value = value
    return [f"{p}={v}" for p, v in params.items()] + [f"an unnamed dimension={v}" for _, v in unnamed]


# -- recording the shapes that follow -------------------------------------------------------------

#: com.microsoft ops whose first output has the shape of one input: op -> (that input, the input
#: whose element type the output has, or None for the zero point's type / uint8).
_SAME_SHAPE = {
    "QLinearSoftmax": (0, 0),
    "QLinearSigmoid": (0, 0),
    "QLinearLeakyRelu": (0, 0),
    "Gelu": (0, 0),
    "FastGelu": (0, 0),
    "BiasGelu": (0, 0),
    "QuickGelu": (0, 0),
    "SkipLayerNormalization": (0, 0),
    "SkipSimplifiedLayerNormalization": (0, 0),
    "BiasAdd": (0, 0),
    "DequantizeLinear": (0, 1),
    "QuantizeLinear": (0, None),
}
#: Broadcasting binary ops: op -> the two inputs broadcast.
_BROADCAST = {"QLinearAdd": (0, 3), "QLinearMul": (0, 3)}
#: Matrix products: op -> (A, B, the input whose element type the output has).
_MATMUL = {"MatMulIntegerToFloat": (0, 1, 2), "DynamicQuantizeMatMul": (0, 1, 2), "FusedMatMul": (0, 1, 0)}


def _transposed(node: onnx.NodeProto, a: tuple[int, ...] | None, b: tuple[int, ...] | None) -> tuple:
    """FusedMatMul's transA/transB (its transBatch* forms are left unknown)."""
    attrs = {x.name: x.i for x in node.attribute}
    if attrs.get("transBatchA") or attrs.get("transBatchB"):
        return None, None
    if a is not None and attrs.get("transA") and len(a) >= 2:
        a = (*a[:-2], a[-1], a[-2])
    if b is not None and attrs.get("transB") and len(b) >= 2:
        b = (*b[:-2], b[-1], b[-2])
    return a, b


def _broadcast(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...] | None:
    try:
        return tuple(np.broadcast_shapes(a, b))
    except ValueError:
        return None


def _matmul(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...] | None:
    if len(a) < 2 or len(b) < 2 or a[-1] != b[-2]:
        return None
    batch = _broadcast(a[:-2], b[:-2])
    return None if batch is None else (*batch, a[-2], b[-1])


def _contrib_shape(node: onnx.NodeProto, shape_of, type_of) -> tuple[tuple[int, ...], int] | None:
    """The first output's (shape, element type) of a contrib op with a simple shape rule."""
    ins = list(node.input)

    def get(i: int) -> tuple[int, ...] | None:
        return shape_of(ins[i]) if len(ins) > i and ins[i] else None

    op = node.op_type
    if op in _SAME_SHAPE:
        source, typed = _SAME_SHAPE[op]
        zero_point = type_of(ins[2]) if len(ins) > 2 and ins[2] else onnx.TensorProto.UINT8
        shape, elem = get(source), type_of(ins[typed]) if typed is not None else zero_point
    elif op in _BROADCAST:
        a, b = (get(i) for i in _BROADCAST[op])
        shape, elem = (_broadcast(a, b) if a is not None and b is not None else None), type_of(ins[0])
    elif op in _MATMUL:
        ia, ib, typed = _MATMUL[op]
        a, b = _transposed(node, get(ia), get(ib))
        shape = _matmul(a, b) if a is not None and b is not None else None
        elem = type_of(ins[typed]) if len(ins) > typed else 0
    elif op == "MatMulNBits":  # A [..., K] -> [..., N]
        a, attrs = get(0), {x.name: x.i for x in node.attribute}
        shape, elem = (None if a is None or "N" not in attrs else (*a[:-1], attrs["N"])), type_of(ins[0])
    elif op == "QLinearGlobalAveragePool":  # NCHW (or NHWC with channels_last) -> spatial dims 1
        a, last = get(0), any(x.name == "channels_last" and x.i for x in node.attribute)
        spatial = None if a is None else (range(1, len(a) - 1) if last else range(2, len(a)))
        shape = None if a is None else tuple(1 if i in spatial else d for i, d in enumerate(a))  # type: ignore[operator]
        elem = type_of(ins[0])
    else:
        return None
    return (shape, elem) if shape is not None and elem else None


#: The same tables' ops whose output keeps the rank of one input whatever the dims (the global
#: pool's spatial dims become 1): what a converter that guesses ranks through them sees too.
_RANK_KEPT = {**{op: (source,) for op, (source, _) in _SAME_SHAPE.items()}, **_BROADCAST}
_RANK_KEPT["QLinearGlobalAveragePool"] = (0,)


def contrib_rank(node: onnx.NodeProto, rank_of: Callable[[str], int | None]) -> int | None:
    """The rank of a com.microsoft op's first output where its shape rule keeps an input's rank
    (same shape, broadcast: the larger; a global pool), from the inputs' ranks ``rank_of`` gives:
    known even where onnx's inference, stopping at the op, records no shape (symbolic dims)."""
    if node.domain != "com.microsoft" or node.op_type not in _RANK_KEPT:
        return None
    names = [node.input[i] if len(node.input) > i else "" for i in _RANK_KEPT[node.op_type]]
    ranks = [rank_of(name) if name else None for name in names]
    known = [r for r in ranks if r is not None]
    return max(known) if known and len(known) == len(ranks) else None


def _static(vi: onnx.ValueInfoProto) -> tuple[int, ...] | None:
    t = vi.type.tensor_type
    if not vi.type.HasField("tensor_type") or not t.HasField("shape"):
        return None
    if any(not d.HasField("dim_value") for d in t.shape.dim):
        return None
    return tuple(d.dim_value for d in t.shape.dim)


def _known(graph: onnx.GraphProto) -> tuple[dict[str, tuple[int, ...]], dict[str, int]]:
    shapes: dict[str, tuple[int, ...]] = {}
    types: dict[str, int] = {}
    for vi in (*graph.input, *graph.output, *graph.value_info):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            types[vi.name] = vi.type.tensor_type.elem_type
        static = _static(vi)
        if static is not None:
            shapes[vi.name] = static
    for t in graph.initializer:
        shapes[t.name], types[t.name] = tuple(t.dims), t.data_type
    return shapes, types


#: Integer tensors up to this many elements are computed when their inputs are known (shape
#: arithmetic: Shape -> Gather -> Slice ...), so that a shape computed at run time becomes known.
MAX_FOLDED = 4096
#: Ops whose outputs are computed (onnx's reference implementation) when every input is known.
_FOLDED_OPS = frozenset(
    {
        "Constant",
        "Gather",
        "Slice",
        "Concat",
        "Unsqueeze",
        "Squeeze",
        "Cast",
        "Add",
        "Sub",
        "Mul",
        "Div",
        "Range",
        "Reshape",
        "Identity",
        "Equal",
        "Where",
        "ReduceProd",
        "Max",
        "Min",
        "Neg",
        "Abs",
        "Expand",
    }
)


@dataclass
class _State:
    added: list[str] = dataclasses.field(default_factory=list)
    folded: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)


def _inference_copy(model: onnx.ModelProto, folded: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """What onnx's inference runs on, built without copying the weights: constants above
    :data:`MAX_FOLDED` elements become graph inputs of their type and shape, the computed values
    become initializers (their producers gone) so inference reads them as constants, and value_info
    shapes that are not static are left out (a producer's guess such as ``unk__2`` would otherwise
    stand: onnx keeps a recorded dimension)."""
    src = model.graph
    graph = onnx.GraphProto(name=src.name)
    graph.node.extend(n for n in src.node if not (n.output and all(o in folded for o in n.output)))
    graph.input.extend(src.input)
    graph.output.extend(src.output)
    graph.value_info.extend(src.value_info)
    for vi in graph.value_info:
        if vi.type.HasField("tensor_type") and _static(vi) is None:
            vi.type.tensor_type.ClearField("shape")
    listed = {vi.name for vi in src.input}
    for t in src.initializer:
        if t.name in folded:
            continue
        if int(np.prod(t.dims)) <= MAX_FOLDED and not t.data_location:
            graph.initializer.append(t)
        elif t.name not in listed:
            graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    graph.initializer.extend(onnx.numpy_helper.from_array(v, k) for k, v in folded.items())
    copy = onnx.ModelProto(ir_version=model.ir_version, graph=graph)
    copy.opset_import.extend(model.opset_import)
    copy.functions.extend(model.functions)
    return copy


def _merge_inferred(model: onnx.ModelProto, state: _State) -> bool:
    graph = model.graph
    shapes, _ = _known(graph)
    try:
        copy = _inference_copy(model, state.folded)
        inferred = onnx.shape_inference.infer_shapes(copy, check_type=False, strict_mode=False, data_prop=True)
    except Exception:  # noqa: BLE001 - onnx's C++ inference raises whatever it meets: only a help
        return False
    own = {vi.name: vi for vi in graph.value_info}
    grew = False
    for vi in inferred.graph.value_info:
        if vi.name in shapes or _static(vi) is None:
            continue
        if vi.name in own:  # the model's own record, with the dimensions now fixed
            own[vi.name].CopyFrom(vi)
        else:
            graph.value_info.append(vi)
            state.added.append(vi.name)
        grew = True
    return grew


def _fold(node: onnx.NodeProto, shapes: Mapping[str, tuple[int, ...]], folded: dict[str, np.ndarray]) -> bool:
    """Compute ``node``'s outputs when they are small integer tensors of known inputs."""
    if node.domain not in ("", "ai.onnx") or not node.output or node.output[0] in folded:
        return False
    if node.op_type == "Shape":
        shape = shapes.get(node.input[0])
        if shape is None:
            return False
        attrs = {a.name: a.i for a in node.attribute}
        folded[node.output[0]] = np.array(shape[attrs.get("start", 0) : attrs.get("end", len(shape))], np.int64)
        return True
    ins = [i for i in node.input if i]
    if node.op_type not in _FOLDED_OPS or not all(i in folded for i in ins):
        return False
    if _too_large(node, [folded[i] for i in ins]):
        return False
    from onnx.reference import ReferenceEvaluator

    try:
        results = ReferenceEvaluator(node).run(None, {i: folded[i] for i in ins})
    except Exception:  # noqa: BLE001 - an op the reference cannot run here stays unknown
        return False
    if any(np.asarray(r).size > MAX_FOLDED or np.asarray(r).dtype.kind not in "iub" for r in results):
        return False
    folded.update((name, np.asarray(r)) for name, r in zip(node.output, results, strict=False))
    return True


#: Folded ops whose output can be larger than their inputs: elementwise ones broadcast.
_BROADCASTING = frozenset({"Add", "Sub", "Mul", "Div", "Equal", "Where", "Max", "Min"})


def _too_large(node: onnx.NodeProto, values: list[np.ndarray]) -> bool:
    """Whether ``node``'s output could exceed MAX_FOLDED elements, decided before anything is
    computed: a model is untrusted, and Range(0, 10**10, 1) or a broadcast of two long vectors
    would allocate gigabytes before the size of the result could be looked at."""
    if node.op_type == "Range":
        if len(values) != 3 or any(np.asarray(v).size != 1 for v in values):
            return True
        start, limit, delta = (float(np.asarray(v).reshape(())) for v in values)
        if delta == 0 or not all(np.isfinite((start, limit, delta))):
            return True
        return max(0.0, np.ceil((limit - start) / delta)) > MAX_FOLDED
    if node.op_type in _BROADCASTING:
        try:
            shape = np.broadcast_shapes(*(np.shape(v) for v in values))
        except ValueError:
            return True
        return int(np.prod(shape, dtype=np.float64)) > MAX_FOLDED
    return False


def _constants(graph: onnx.GraphProto, folded: dict[str, np.ndarray]) -> None:
    for t in graph.initializer:
        if t.name not in folded and t.data_type in _INTEGER and np.prod(t.dims) <= MAX_FOLDED and not t.data_location:
            folded[t.name] = onnx.numpy_helper.to_array(t)


_INTEGER = frozenset({onnx.TensorProto.INT64, onnx.TensorProto.INT32, onnx.TensorProto.BOOL})


def _round(model: onnx.ModelProto, state: _State) -> bool:
    """One round: onnx's inference, then, node by node, the computed shape values, the contrib ops'
    shapes and the standard ops' that follow them (onnx's inference of that one node, so a round
    goes on past a contrib op instead of waiting for the next whole-model inference: a 6-layer
    QOperator BERT took 40 rounds); True when anything was added."""
    graph = model.graph
    grew = _merge_inferred(model, state)
    shapes, types = _known(graph)
    own = {vi.name: vi for vi in graph.value_info}
    opsets = {o.domain or "": o.version for o in model.opset_import}
    for node in graph.node:
        grew |= _fold(node, shapes, state.folded)
        if node.domain == "com.microsoft" and node.output and node.output[0] not in shapes:
            found = _contrib_shape(node, shapes.get, lambda n: types.get(n, 0))
            results = [(node.output[0], *found)] if found is not None else []
        elif node.domain in ("", "ai.onnx"):
            results = _node_inferred(node, shapes, types, state.folded, opsets, model.ir_version)
        else:
            continue
        for name, shape, elem in results:
            record = onnx.helper.make_tensor_value_info(name, elem, list(shape))
            if name in own:  # the model's own record, with the dimensions now known
                own[name].CopyFrom(record)
            else:
                graph.value_info.append(record)
                own[name] = graph.value_info[-1]
                state.added.append(name)
            shapes[name], types[name] = shape, elem
            grew = True
    return grew


def _node_inferred(
    node: onnx.NodeProto,
    shapes: Mapping[str, tuple[int, ...]],
    types: Mapping[str, int],
    folded: Mapping[str, np.ndarray],
    opsets: Mapping[str, int],
    ir_version: int,
) -> list[tuple[str, tuple[int, ...], int]]:
    """The static output shapes onnx's inference gives one standard node whose inputs all have
    static shapes and known types (with the computed values of its small integer inputs, as the
    whole model's inference propagates them): the outputs not known yet, else nothing."""
    outputs = [o for o in node.output if o and o not in shapes]
    inputs = [i for i in node.input if i]
    if not outputs or any(i not in shapes or not types.get(i) for i in inputs):
        return []
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
        return []
    try:
        schema = onnx.defs.get_schema(node.op_type, opsets.get("", 1), "")
        found = onnx.shape_inference.infer_node_outputs(
            schema,
            node,
            {i: onnx.helper.make_tensor_type_proto(types[i], list(shapes[i])) for i in inputs},
            {i: onnx.numpy_helper.from_array(folded[i], i) for i in inputs if i in folded},
            opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in opsets.items()],
            ir_version=ir_version,
        )
    except Exception:  # noqa: BLE001 - onnx raises whatever it meets: the next whole round may know
        return []
    out = []
    for name in outputs:
        t = found.get(name)
        if t is None or not t.HasField("tensor_type") or not t.tensor_type.elem_type:
            continue
        dims = t.tensor_type.shape.dim if t.tensor_type.HasField("shape") else None
        if dims is not None and all(d.HasField("dim_value") for d in dims):
            out.append((name, tuple(d.dim_value for d in dims), t.tensor_type.elem_type))
    return out


#: At most this many rounds (each one can only add shapes, so a chain of N contrib ops takes N+1).
MAX_ROUNDS = 200


def record_shapes(model: onnx.ModelProto) -> list[str]:
    """Record in ``model``'s main-graph value_info every static shape that follows from its inputs
    (module docstring), and give graph outputs the static shapes found for them; returns the names
    added to value_info (a caller drops them from what it writes)."""
    state = _State()
    _constants(model.graph, state.folded)
    for _ in range(MAX_ROUNDS):
        if not _round(model, state):
            break
    shapes, _ = _known(model.graph)
    recorded = {vi.name: vi for vi in model.graph.value_info}
    for out in model.graph.output:
        if _static(out) is None and out.name in shapes and out.name in recorded:
            out.type.tensor_type.shape.CopyFrom(recorded[out.name].type.tensor_type.shape)
    return state.added


@dataclass(frozen=True)
class Applied:
    """What :func:`apply_input_shapes` did: the dimensions fixed, in words, and the value_info
    entries it added (names), which a writer drops again: the output keeps only the fixed dims."""

    given: InputShapes
    fixed: tuple[str, ...]
    added: tuple[str, ...]
    #: The shape of every input that is static once fixed (what verify's samples must have).
    shapes: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        shapes = {k: list(v) for k, v in self.shapes.items()}
        return {**self.given.to_dict(), "fixed": list(self.fixed), "shapes": shapes}


def apply_input_shapes(model: onnx.ModelProto, shapes: InputShapes, label: str = "the model") -> Applied:
    """Fix ``model``'s symbolic dimensions from ``shapes`` and record the shapes that follow, in
    place (module docstring); UsageError (nothing changed) when ``shapes`` does not fit."""
    fixed = fix_input_shapes(model, shapes, label)
    added = tuple(record_shapes(model))
    static = {vi.name: _static(vi) for vi in _inputs(model)}
    return Applied(shapes, tuple(fixed), added, {k: v for k, v in static.items() if v is not None})


def drop_value_info(model: onnx.ModelProto, names: Iterable[str]) -> None:
    """Remove the main graph's value_info entries named ``names``."""
    drop = set(names)
    kept = [vi for vi in model.graph.value_info if vi.name not in drop]
    del model.graph.value_info[:]
    model.graph.value_info.extend(kept)
