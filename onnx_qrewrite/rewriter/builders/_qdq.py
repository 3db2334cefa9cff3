"""What the quantize/dequantize builders share: reading a vendor Q/DQ node (its inputs, quantized
dtype, granularity and axis) and emitting scale and zero point in the shape an emitted op needs.

A vendor node is read once, in ``check``; every way it can be malformed becomes a :class:`NoMatch`
naming the node's input and the reason, so the engine reports it (exit code 4) or, with
``--allow-unlowered``, leaves the node in place with that reason as the warning.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from onnx_qrewrite import _onnx as onnx
from onnx_qrewrite._dataclass import dataclass
from onnx_qrewrite.rewriter.builders import Emitter, NoMatch, Site
from onnx_qrewrite.rewriter.builders._emit import no_unknown_attributes
from onnx_qrewrite.rewriter.graph import Scope, dtype_name, known_shape

__all__ = [
    "INTEGER_RANGES",
    "STANDARD_SAME_SHAPE_OPS",
    "QDQNode",
    "broadcast_operand",
    "normalized_axis",
    "per_tensor_operand",
    "read_qdq",
    "value_shape",
]

#: Saturation bounds of the integer quantized types (the types' full ranges).
INTEGER_RANGES: dict[str, tuple[int, int]] = {
    "uint8": (0, 255),
    "int8": (-128, 127),
    "uint16": (0, 65535),
    "int16": (-32768, 32767),
    "uint32": (0, 2**32 - 1),
    "int32": (-(2**31), 2**31 - 1),
    "uint4": (0, 15),
    "int4": (-8, 7),
}

PER_TENSOR = "per-tensor"
PER_AXIS = "per-axis"
#: A scale computed at run time whose shape the model does not record: per-tensor or per-axis is
#: decided at run time by its element count, exactly as the vendor kernel and onnxruntime's
#: QuantizeLinear/DequantizeLinear both do.
DYNAMIC = "decided at run time"

_FLOAT = onnx.TensorProto.FLOAT


#: Standard ops whose output has their first input's shape. A quantized tensor between a vendor Q
#: and DQ has no value_info (shape inference cannot see through vendor ops), but its producer's
#: input does: vendor ops whose builder declares ``preserves_shape`` come from the catalogue
#: (``Site.same_shape_ops``).
STANDARD_SAME_SHAPE_OPS = frozenset({"QuantizeLinear", "DequantizeLinear", "Cast", "Identity"})


def value_shape(
    scope: Scope, name: str, same_shape_ops: frozenset[str] = STANDARD_SAME_SHAPE_OPS, _depth: int = 0
) -> tuple[int | None, ...] | None:
    """Static shape of a value visible from ``scope`` (None: unknown; None entries: unknown dims).

    Looks at Constant nodes, initializers and the value_info/input/output records of each scope
    from the innermost outwards; an unrecorded output of a shape-preserving op (Q/DQ, Cast,
    Identity, and the ``same_shape_ops`` a catalogue declares) has its input's shape.
    """
    if not name:
        return None
    current: Scope | None = scope
    while current is not None:
        producer = current.producer(name)
        op = producer.op_type if producer is not None else ""  # read once: each read is a new string
        if op == "Constant" and producer is not None and producer.domain in ("", "ai.onnx"):
            for attr in producer.attribute:
                if attr.name == "value":
                    return tuple(attr.t.dims)
                if attr.name in ("value_float", "value_int", "value_string"):
                    return ()
                if attr.name in ("value_floats", "value_ints", "value_strings"):
                    return (len(onnx.helper.get_attribute_value(attr)),)
        recorded = current.recorded_shapes
        if recorded.get(name) is not None:
            return recorded[name]
        if producer is not None:
            same_shape = op in STANDARD_SAME_SHAPE_OPS or op in same_shape_ops
            if same_shape and producer.input and _depth < 16:
                return value_shape(current, producer.input[0], same_shape_ops, _depth + 1)
            return None
        if name in recorded:
            return None
        current = current.parent
    return None


def value_shapes(
    scope: Scope,
    names: Sequence[str],
    same_shape_ops: frozenset[str],
    outputs_of: Mapping[int, Sequence[str]],
    known: dict[str, int],
) -> list[tuple[int | None, ...] | None] | None:
    """:func:`value_shape` of each of ``names`` in ``scope``, their producers found together
    (:meth:`Scope.producer_indices`, ``known`` as there) and their ops read from the walk's codes; a name whose
    producer is a Constant or a shape-preserving op is asked of :func:`value_shape` alone. None
    when the producers cannot be found together (a subgraph's scope, names written twice)."""
    if scope.parent is not None:
        return None
    owners = scope.producer_indices(names, outputs_of, known)
    codes, keys = scope._op_codes, scope._op_keys
    if owners is None or codes is None or keys is None:
        return None
    get = scope.recorded_shapes.get
    found: list[tuple[int | None, ...] | None] = []
    for name, owner in zip(names, owners, strict=True):
        if not name:
            found.append(None)
        elif owner < 0:  # no node writes it: what the records say (a root scope has no outer one)
            found.append(get(name))
        else:
            op = keys[codes[owner]][1]
            if op == "Constant" or op in STANDARD_SAME_SHAPE_OPS or op in same_shape_ops:
                found.append(value_shape(scope, name, same_shape_ops))
            else:  # any other producer: the records, else unknown
                found.append(get(name))
    return found


def normalized_axis(axis: int, rank: int, site: Site) -> int:
    if not -rank <= axis < rank:
        raise NoMatch(f"malformed node: axis {axis} is out of range for input {site.input(0)!r} of rank {rank}")
    return axis % rank


@dataclass(frozen=True)
class QDQNode:
    """A vendor quantize or dequantize node as its kernel sees it."""

    quantize: bool
    x: str
    scale: str
    zero_point: str  # '' when absent
    dtype: str  # the quantized type: y's for quantize, x's for dequantize
    granularity: str  # PER_TENSOR, PER_AXIS or DYNAMIC
    axis: int  # the axis the kernel uses (attribute, or the kernel's default), as written
    axis_given: bool
    scale_shape: tuple[int | None, ...] | None
    zp_shape: tuple[int | None, ...] | None
    site: Site = dataclasses.field(repr=False, compare=False)
    #: The float side (x of a quantize, scale and y of a dequantize): "float32" or "float16".
    float_type: str = "float32"

    # Values are read only when a decision needs them (most rewrites never do): converting every
    # scale and zero point to numpy was most of the matching time on a 20k-node model.
    @functools.cached_property
    def x_shape(self) -> tuple[int | None, ...] | None:
        return value_shape(self.site.scope, self.x, self.site.same_shape_ops)

    @functools.cached_property
    def scale_value(self) -> np.ndarray | None:
        """The scale when it is a constant (initializer or Constant node), else None."""
        return self.site.constant(self.scale)

    @functools.cached_property
    def zp_value(self) -> np.ndarray | None:
        """The zero point when it is a constant, else None (also when absent)."""
        return self.site.constant(self.zero_point) if self.zero_point else None

    @property
    def rank(self) -> int | None:
        return None if self.x_shape is None else len(self.x_shape)

    def describe(self, axis_default_origin: str) -> str:
        if self.granularity == PER_TENSOR:
            return "per-tensor"
        axis = f"axis={self.axis}" + ("" if self.axis_given else f" ({axis_default_origin} default)")
        return f"{self.granularity}, {axis}" if self.granularity == DYNAMIC else f"per-axis, {axis}"


def quantized_dtype(site: Site, *, quantize: bool) -> str:
    """The quantized type of a Q/DQ node, or NoMatch saying what the model does not record.

    Quantize: the zero point's type (the output type), uint8 when there is no zero point.
    Dequantize: x's type, else the zero point's. Kept on the Site (asked once per candidate rule).
    """
    return site.memo(("qdq-dtype", quantize), lambda: _quantized_dtype(site, quantize))


def _quantized_dtype(site: Site, quantize: bool) -> str:
    zp = site.input(2)
    candidates = [zp] if quantize else [site.input(0), zp]
    for name in candidates:
        elem = site.elem_type(name)
        if elem:
            return dtype_name(elem)
    if quantize and not zp:
        return "uint8"
    if quantize:
        elem = site.elem_type(site.node.output[0]) if site.node.output else None
        if elem:
            return dtype_name(elem)
    what = "zero point" if quantize else "input and zero point"
    names = " / ".join(repr(n) for n in candidates if n)
    raise NoMatch(
        f"the type of the {what} {names} is not recorded in the model (computed at run time, no value_info); "
        "run onnx shape inference on the model first (onnx.shape_inference.infer_shapes)"
    )


def read_qdq(site: Site, options: Mapping[str, Any], *, quantize: bool) -> QDQNode:
    """Read a vendor Q/DQ node; raises NoMatch naming the input and the reason when malformed.

    Options used: ``axis_default`` (the kernel's axis when the attribute is absent) and
    ``require_zero_point`` (the kernel takes exactly three inputs).

    Several rules try the same node (standard op, then decomposition): the reading is kept on the
    Site, which the engine creates once per node and shares between its candidate rules.
    """
    axis_default, require_zp = options["axis_default"], options["require_zero_point"]
    float16 = bool(options.get("float16", False))
    bfloat16 = bool(options.get("bfloat16", False))  # builders that compute bfloat16 too
    return site.memo(
        ("qdq-read", quantize, axis_default, require_zp, float16, bfloat16),
        lambda: _read_qdq(site, axis_default, require_zp, quantize, float16, bfloat16),
    )


def _read_qdq(
    site: Site, axis_default: int, require_zp: bool, quantize: bool, float16: bool = False, bfloat16: bool = False
) -> QDQNode:
    # In this order, so that a malformed node is told the same first problem as before.
    node = site.node
    _check_arity(node, require_zp)
    x, scale = node.input[0], node.input[1]
    zp = site.input(2)
    dtype = quantized_dtype(site, quantize=quantize)
    float_type = _float_type(site, x if quantize else None, scale, float16, bfloat16)
    if not quantize:
        for name, what in ((x, "x"), (zp, "zero point")):
            elem = site.elem_type(name)
            if elem is not None and dtype_name(elem) != dtype:
                raise NoMatch(f"malformed node: {what} {name!r} is {dtype_name(elem)}, x is {dtype}")

    scale_shape = value_shape(site.scope, scale, site.same_shape_ops)
    zp_shape = value_shape(site.scope, zp, site.same_shape_ops) if zp else None
    axis_given = site.has_attribute("axis")
    axis = int(site.attribute("axis", axis_default))
    scale_dims = known_shape(scale_shape)
    granularity = _granularity(scale, scale_dims, zp, known_shape(zp_shape))
    x_shape = value_shape(site.scope, x, site.same_shape_ops) if granularity != PER_TENSOR else None
    if x_shape is not None:
        if len(x_shape) == 0:
            raise NoMatch(f"malformed node: x {x!r} is a scalar but the scale may have several elements")
        a = normalized_axis(axis, len(x_shape), site)
        dim = x_shape[a]
        if granularity == PER_AXIS and dim is not None and scale_dims is not None and scale_dims[0] != dim:
            raise NoMatch(
                f"malformed node: scale {scale!r} has {scale_dims[0]} elements but x {x!r} has {dim} along axis {axis}"
            )
    return QDQNode(
        quantize=quantize,
        x=x,
        scale=scale,
        zero_point=zp,
        dtype=dtype,
        granularity=granularity,
        axis=axis,
        axis_given=axis_given,
        scale_shape=scale_shape,
        zp_shape=zp_shape,
        site=site,
        float_type=float_type,
    )


def _check_arity(node: onnx.NodeProto, require_zp: bool) -> None:
    """Inputs (x, scale[, zero point]; all three with ``require_zp``), one output, no attribute
    but ``axis``."""
    n_inputs = len(node.input)
    if require_zp and (n_inputs != 3 or not all(node.input)):
        raise NoMatch(
            f"malformed node: {node.op_type} takes exactly 3 inputs (x, scale, zero point), it has {n_inputs}"
            + (" with an empty one" if n_inputs == 3 else "")
        )
    if n_inputs not in (2, 3) or not node.input[0] or not node.input[1]:
        raise NoMatch(f"malformed node: {node.op_type} takes inputs (x, scale[, zero point]), it has {n_inputs}")
    if len(node.output) != 1 or not node.output[0]:
        raise NoMatch(f"malformed node: {node.op_type} has one output, it has {len(node.output)}")
    no_unknown_attributes(node, {"axis"})


def _float_type(site: Site, float_input: str | None, scale: str, float16: bool, bfloat16: bool) -> str:
    """The float type of the scale (and of a quantizer's x): one the builder computes (float32,
    float16 / bfloat16 when it says so), the same on both; refused when neither is known."""
    float_types = {_FLOAT, onnx.TensorProto.FLOAT16} if float16 else {_FLOAT}
    if bfloat16:
        float_types.add(onnx.TensorProto.BFLOAT16)
    found: set[int] = set()
    for name, what in ((float_input, "x"), (scale, "scale")):
        if not name:
            continue
        elem = site.elem_type(name)
        if elem is not None and elem not in float_types:
            kinds = (_FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
            names = [dtype_name(t) for t in kinds if t in float_types]
            supported = f"{', '.join(names[:-1])} and {names[-1]} are" if len(names) > 1 else "only float32 is"
            raise NoMatch(f"{what} {name!r} is {dtype_name(elem)}; {supported} supported")
        if elem is not None:
            found.add(elem)
    if len(found) > 1:
        raise NoMatch(f"malformed node: x and scale {scale!r} have different float types")
    if not found:  # traced (costs look-ups: only here); a guess of float32 could meet a float16 scale
        found = {t for t in (site.value_type(scale), site.value_type(float_input or "")) if t is not None}
    if not found or not found <= float_types or len(found) > 1:
        raise NoMatch(f"the type of scale {scale!r} is not declared, and its producer does not say a float type")
    return dtype_name(found.pop())


def _granularity(scale: str, scale_dims: tuple[int, ...] | None, zp: str, zp_dims: tuple[int, ...] | None) -> str:
    """Per-tensor (one scale element), per-axis (1-D) or dynamic (shape unknown), with the zero
    point's element count matching the scale's."""
    granularity = DYNAMIC
    if scale_dims is not None:
        size = math.prod(scale_dims)
        if size == 1:
            granularity = PER_TENSOR
        elif len(scale_dims) == 1:
            granularity = PER_AXIS
        else:
            raise NoMatch(
                f"malformed node: scale {scale!r} has shape {list(scale_dims)}; "
                "the kernel takes one element (per-tensor) or a 1-D tensor (per-axis)"
            )
    if zp and zp_dims is not None and scale_dims is not None:
        if math.prod(zp_dims) != math.prod(scale_dims):
            raise NoMatch(
                f"malformed node: zero point {zp!r} has shape {list(zp_dims)}, scale {scale!r} "
                f"has shape {list(scale_dims)}; they must have the same number of elements"
            )
        if granularity == PER_AXIS and len(zp_dims) != 1:
            raise NoMatch(f"malformed node: zero point {zp!r} has shape {list(zp_dims)}; per-axis needs 1-D")
    return granularity


def per_tensor_operand(
    emit: Emitter,
    name: str,
    value: Callable[[], np.ndarray | None],
    shape: tuple[int | None, ...] | None,
    *,
    scalar: bool,
) -> str:
    """A one-element scale or zero point in a form every consumer accepts.

    ``scalar=False`` (QuantizeLinear/DequantizeLinear): a scalar or a 1-D one-element tensor is
    kept as it is; anything of higher rank (onnxruntime rejects a [1, 1] scale) becomes a scalar.
    ``scalar=True`` (elementwise decompositions): always a scalar, so that broadcasting never
    changes the output's shape. ``value`` gives the constant's value (None at run time), read
    only when needed.
    """
    if shape is not None and (len(shape) == 0 or (not scalar and len(shape) == 1)):
        return name
    constant = value()
    if constant is not None:
        return emit.const(constant.reshape(()))
    return emit.op1("Reshape", [name, emit.const(np.zeros(0, np.int64))], hint="ToScalar")


def broadcast_operand(emit: Emitter, name: str, value: Callable[[], np.ndarray | None], rank: int, axis: int) -> str:
    """A 1-D (or one-element) per-axis parameter reshaped to broadcast along ``axis`` of a rank-``rank``
    tensor: shape [n, 1, ..., 1] with ``rank - 1 - axis`` trailing ones. A one-element tensor then
    broadcasts like a per-tensor one, so this also serves scales whose shape is only known at run time.
    """
    target = [-1] + [1] * (rank - 1 - axis)
    constant = value()
    if constant is not None:
        return emit.const(constant.reshape(target))
    return emit.op1("Reshape", [name, emit.const(np.asarray(target, np.int64))], hint="AlongAxis")


def scale_and_zero_point(emit: Emitter, q: QDQNode, *, for_elementwise: bool) -> tuple[str, str]:
    """Scale and zero point ready for the emitted ops ('' for an absent zero point).

    For QuantizeLinear/DequantizeLinear (``for_elementwise=False``) per-axis operands stay 1-D and
    the op's ``axis`` attribute does the broadcasting; runtime operands of unknown shape are made
    1-D (onnxruntime's kernels take a scalar or 1-D scale, the vendor kernels any one-element one).
    For decompositions they are reshaped to broadcast along the axis.
    """
    out = []
    operands = ((q.scale, lambda: q.scale_value, q.scale_shape), (q.zero_point, lambda: q.zp_value, q.zp_shape))
    for name, value, shape in operands:
        if not name:
            out.append("")
        elif q.granularity == PER_TENSOR:
            out.append(per_tensor_operand(emit, name, value, shape, scalar=for_elementwise))
        elif for_elementwise:
            assert q.rank is not None  # checked by the builder
            out.append(broadcast_operand(emit, name, value, q.rank, q.axis % q.rank))
        elif shape is not None and len(shape) == 1:
            out.append(name)
        elif (known := value()) is not None:
            out.append(emit.const(known.reshape(-1)))
        else:
            out.append(emit.op1("Reshape", [name, emit.const(np.asarray([-1], np.int64))], hint="To1D"))
    return out[0], out[1]
