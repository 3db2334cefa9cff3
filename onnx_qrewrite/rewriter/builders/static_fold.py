"""Values that static input shapes fix, folded to constants (form ``static-shapes``): for targets
that run no Shape op (NNAPI), or that fold such values at load time into a form they then fail on
(OpenVINO 2026.4.1: a QuantizeLinear of a constant that an Add reads beside a run-time one).

Once ``--input-shape`` fixes a model's symbolic dimensions and its shapes are recorded
(:mod:`onnx_qrewrite.targets.shapes`), ``Shape(x)`` of a value with a static recorded shape is a
constant, and so is what is computed from such values and constants alone. Two rules:

- **Shape / Size** of a value whose recorded shape is static -> that shape (its ``start`` / ``end``
  slice) or element count as an int64 constant. Exact: it is what the kernel returns for the
  recorded shape, and the recorded shape is what running the model with the fixed inputs gives
  (``--input-shape`` fixes the inputs; ``verify`` then feeds exactly those shapes).
- **QuantizeLinear** whose input is such a constant (a table sliced up to ``Shape(input_ids)[1]``,
  as the static QDQ BERT's position embeddings are) -> its quantized value as an integer constant,
  so the DequantizeLinear after it reads an integer initializer. The input is evaluated through the
  nodes that compute it, which may only select values (Gather, Slice, Reshape, Squeeze, Unsqueeze,
  Concat, Transpose, Flatten, Identity) or compute on integers (Add, Sub, Mul, Neg, Abs, Max, Min,
  and Cast between integer types): any correct kernel gives the same values. The quantization is
  onnxruntime 1.31.1's: ``x / scale`` in float32 (a division, never the reciprocal's product),
  round half to even, add the zero point, saturate; NaN gives qmin (../shared NUMERICS.md).
  Bit-exact: ``tests/test_static_fold.py`` compares it with onnxruntime's kernel on edge values
  and on the battery's BERT.

Given way (the node stays): an input that a graph input reaches other than through a Shape of a
static value, an op outside those above, a value that would exceed :data:`MAX_ELEMENTS` elements
(a model is untrusted: that is decided from the inputs' sizes before anything is computed), a
blocked, float8, 4-bit or non-float32 quantization.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx

from onnx_qrewrite.rewriter.builders import Emitter, NotApplicable, Plan, Site, register
from onnx_qrewrite.rewriter.builders._qdq import value_shape
from onnx_qrewrite.rewriter.builders.contracts import CONTRACTS
from onnx_qrewrite.rewriter.graph import known_shape

__all__ = ["StaticFoldBuilder", "quantize_like_onnxruntime", "static_value"]

#: Ops that only select or reorder values: the same result from any correct kernel, any type.
_SELECT = frozenset(
    {"Gather", "Slice", "Reshape", "Squeeze", "Unsqueeze", "Concat", "Transpose", "Flatten", "Identity"}
)
#: Integer arithmetic (wrapping as onnxruntime's C++ kernels and numpy do): folded on integers only.
_INTEGER = frozenset({"Add", "Sub", "Mul", "Neg", "Abs", "Max", "Min", "Cast"})
#: The largest value folded or computed on the way (elements): a QuantizeLinear's input is a slice
#: of a table the model holds anyway; more is not worth a copy in the output.
MAX_ELEMENTS = 1 << 24
#: How far back through the nodes computing a value the fold looks.
_MAX_DEPTH = 64
_QTYPES: dict[int, Any] = {
    onnx.TensorProto.UINT8: np.uint8,
    onnx.TensorProto.INT8: np.int8,
    onnx.TensorProto.UINT16: np.uint16,
    onnx.TensorProto.INT16: np.int16,
}


def _shape_value(node: onnx.NodeProto, shape: tuple[int, ...]) -> np.ndarray:
    if node.op_type == "Size":
        return np.array(int(np.prod(shape, dtype=np.int64)), np.int64)
    attrs = {a.name: a.i for a in node.attribute}
    return np.array(shape[attrs.get("start", 0) : attrs.get("end", len(shape))], np.int64)


def _largest(node: onnx.NodeProto, values: list[np.ndarray]) -> float:
    """How many elements ``node`` can write from ``values``, decided before computing it (a model
    is untrusted: a Gather of many indices or a broadcast would allocate first)."""
    op = node.op_type
    if op == "Gather":
        data, indices = values[0], values[1]
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        along = data.shape[axis] if -data.ndim <= axis < data.ndim else 1
        return float(indices.size) * data.size / max(along, 1)
    if op == "Concat":
        return float(sum(v.size for v in values))
    if op in _SELECT:  # Slice, Reshape, Squeeze, Unsqueeze, Transpose, Flatten, Identity
        return float(values[0].size)
    try:
        return float(np.prod(np.broadcast_shapes(*(v.shape for v in values)), dtype=np.float64))
    except ValueError:
        return float("inf")


def _evaluate(node: onnx.NodeProto, values: list[np.ndarray]) -> np.ndarray | None:
    from onnx.reference import ReferenceEvaluator

    if node.op_type in _INTEGER and any(v.dtype.kind not in "iu" for v in values):
        return None
    if node.op_type == "Cast":
        to = next((a.i for a in node.attribute if a.name == "to"), 0)
        if onnx.helper.tensor_dtype_to_np_dtype(to).kind not in "iu":
            return None
    names = [f"i{k}" for k in range(len(values))]
    probe = onnx.NodeProto()
    probe.CopyFrom(node)
    del probe.input[:]
    probe.input.extend(names)
    del probe.output[:]
    probe.output.append("y")
    try:
        with np.errstate(over="ignore"):  # integer arithmetic wraps, as onnxruntime's kernels
            results: list[Any] = list(ReferenceEvaluator(probe).run(None, dict(zip(names, values, strict=True))))
    except Exception:  # noqa: BLE001 - whatever the reference cannot run stays a node
        return None
    return np.asarray(results[0])


def static_value(site: Site, name: str, depth: int = 0) -> np.ndarray | str:
    """``name``'s value when constants and the recorded static shapes fix it (module docstring),
    else why not."""
    constant = site.constant(name)
    if constant is not None:
        return constant
    producer = site.scope.producer(name)
    if producer is None:
        return f"{name!r} is computed at run time (an input of the graph or of a subgraph)"
    if producer.domain not in ("", "ai.onnx") or depth > _MAX_DEPTH:
        return f"{name!r} is computed by {producer.op_type}, which this fold does not compute"
    op = producer.op_type
    if op in ("Shape", "Size"):
        shape = known_shape(value_shape(site.scope, producer.input[0], site.same_shape_ops))
        if shape is None:
            return f"the shape of {producer.input[0]!r} is not recorded as static (give --input-shape)"
        return _shape_value(producer, shape)
    if op not in _SELECT | _INTEGER or len(producer.output) != 1:
        return f"{name!r} is computed by {op}, which this fold does not compute"
    values = []
    for operand in producer.input:
        if not operand:
            return f"{op} {name!r} has an omitted input, which this fold does not compute"
        value = static_value(site, operand, depth + 1)
        if isinstance(value, str):
            return value
        values.append(value)
    if _largest(producer, values) > MAX_ELEMENTS:
        return f"{op} {name!r} would have more than {MAX_ELEMENTS} elements"
    result = _evaluate(producer, values)
    return result if result is not None else f"{op} {name!r} on these types is not folded"


def quantize_like_onnxruntime(x: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, dtype: Any) -> np.ndarray:
    """QuantizeLinear as onnxruntime 1.31.1 computes it on float32 (module docstring); ``scale``
    and ``zero_point`` already broadcast against ``x``."""
    info = np.iinfo(dtype)
    # IEEE: x / 0 is +-inf (saturates) and 0 / 0 NaN (qmin), as the kernel gives; overflow is inf.
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        q = np.rint(x.astype(np.float32) / scale.astype(np.float32)).astype(np.float64)
    q = q + zero_point.astype(np.float64)
    q = np.where(np.isnan(q), info.min, np.clip(q, info.min, info.max))
    return q.astype(dtype)


def _quantize_plan(site: Site) -> Plan:
    node = site.node
    if any(a.name not in ("axis", "saturate") for a in node.attribute):
        raise NotApplicable("a QuantizeLinear attribute other than axis (blocked, output_dtype) is not folded")
    x = static_value(site, site.input(0))
    if isinstance(x, str):
        raise NotApplicable(x)
    if x.dtype != np.float32:
        raise NotApplicable(f"its input is {x.dtype}, not float32")
    scale = site.constant(site.input(1))
    zp_name = site.input(2) if len(node.input) > 2 else ""
    zp = site.constant(zp_name) if zp_name else np.zeros((), np.uint8)
    if scale is None or zp is None:
        raise NotApplicable("its scale or zero point is computed at run time")
    # The zero point's declared type decides the saturation range (and must be its array's).
    elem = site.elem_type(zp_name) if zp_name else onnx.TensorProto.UINT8
    dtype = _QTYPES.get(elem) if elem is not None else None
    if scale.dtype != np.float32 or dtype is None or zp.dtype != dtype:
        raise NotApplicable("only a float32 scale and a uint8, int8, uint16 or int16 zero point are folded")
    if scale.size > 1 or zp.size > 1:
        axis = int(site.attribute("axis", 1))
        axis = axis + x.ndim if axis < 0 else axis
        if scale.ndim != 1 or not 0 <= axis < x.ndim or x.shape[axis] != scale.size:
            raise NotApplicable("per-axis scales that do not fit the input are not folded")
        shape = [1] * x.ndim
        shape[axis] = -1
        scale, zp = scale.reshape(shape), zp.reshape(shape if zp.size > 1 else ())
    value = quantize_like_onnxruntime(x, scale, zp, dtype)
    return Plan(notes=(f"folded to a {value.dtype} constant of shape {list(value.shape)}",), data={"value": value})


class StaticFoldBuilder:
    """Shape / Size of a static value, and a QuantizeLinear of a static value, as constants."""

    name = "static_fold"
    contract = CONTRACTS["static_fold"]

    def quantized_dtype(self, site: Site) -> str | None:
        return None

    def check(self, site: Site, options: Mapping[str, Any]) -> Plan:
        op = site.node.op_type
        if op == "QuantizeLinear":
            return _quantize_plan(site)
        if op in ("Shape", "Size"):
            shape = known_shape(value_shape(site.scope, site.input(0), site.same_shape_ops))
            if shape is None:
                raise NotApplicable(f"the shape of {site.input(0)!r} is not recorded as static (give --input-shape)")
            value = _shape_value(site.node, shape)
            return Plan(notes=(f"{op} = {value.tolist()}",), data={"value": value})
        raise NotApplicable(f"{op}: this builder folds Shape, Size and QuantizeLinear")

    def build(self, site: Site, emit: Emitter, options: Mapping[str, Any], plan: Plan) -> None:
        emit.op1("Identity", [emit.const(plan.data["value"])], site.node.output[0])


register(StaticFoldBuilder())
