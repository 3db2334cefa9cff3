"""Data movement on a quantized tensor -> DequantizeLinear -> the same op on float -> QuantizeLinear
with the tensor's own scale and zero point (form ``qdq-units``).

QOperator models (``quantize_static(..., QuantFormat.QOperator)``) move quantized activations
between QLinear ops as raw uint8/int8 tensors: the attention's Reshape/Transpose, a Flatten before
the classifier, the embedding Gather on the quantized table. Backends that keep 8-bit tensors only
as quantized (fixed-point) tensors take their encodings from the QuantizeLinear/DequantizeLinear
around each op (QNN's HTP: a "QDQ node unit"), so such an op on a raw integer tensor has no
encoding and is refused. Wrapping it as ``Q(op(DQ(x, s, zp)), s, zp)`` gives it one.

**Exact**: for an integer ``n = q - zp`` with ``|n| <= 255`` and a float32 scale ``s`` whose
multiples ``n * s`` are normal and finite (``2^-126 <= s <= FLT_MAX / 255``), onnxruntime's
DequantizeLinear gives ``f = fl(n * s)`` and its QuantizeLinear ``round(fl(f / s)) + zp``,
saturated (it divides by the scale, never multiplies by a reciprocal). Two roundings of relative
size at most 2^-24 each leave ``|fl(f / s) - n| <= 255 * 2^-23 < 0.5``, so the round gives ``n``
back and the result is ``q``: Q(DQ(q)) = q for every q. (The lower end of the range is what this
argument covers; subnormal scales were seen to round-trip too, but are left alone.) The ops moved
(Reshape, Transpose, Gather, Slice, ...) only select and reorder values, which they do the same on
float as on uint8. MaxPool selects each window's largest value (its padding is never selected):
with a positive scale, DequantizeLinear is strictly increasing in ``q`` (rounding is monotonic, and
Q(DQ(q)) = q makes it one to one), so the largest dequantized value is the dequantized largest.
Concat is exact only when every input has the output's scale and zero point (checked). Tested bit
for bit on every uint8 and int8 value in tests/test_qdq_wrap.py.

Where the scale and zero point come from: the tensor's own quantization, found by looking through
data-movement ops backwards to what wrote it (QuantizeLinear, a QOperator op's output scale and
zero point) and forwards to what reads it (DequantizeLinear, a QOperator op's input scale and zero
point). Any valid per-tensor pair would be exact; the tensor's own one makes the new Q/DQ match the
neighbours' (what a backend's node units expect). Not rewritten (the rule gives way): no constant
per-tensor float32 scale and zero point found, a scale outside the range above, a Concat whose
inputs are quantized differently, a type other than uint8/int8, and quantize_dynamic's embedding
lookup ``DequantizeLinear(Gather(constant table))``, which the weight-only form's exact gather rule
writes without any Q/DQ.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx

from onnx_qrewrite.rewriter import kernel_opsets
from onnx_qrewrite.rewriter.builders import Emitter, NotApplicable, Plan, Site, register
from onnx_qrewrite.rewriter.builders.contracts import CONTRACTS, QDQ_WRAP_OPS
from onnx_qrewrite.rewriter.graph import Scope, dtype_name

__all__ = ["SCALE_RANGE", "QdqWrapBuilder"]

_QUANTIZED = ("uint8", "int8")
_STANDARD = ("", "ai.onnx")
#: Scales whose multiples by |n| <= 255 stay normal and finite in float32 (module docstring).
SCALE_RANGE = (float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max) / 255)

#: QOperator ops: (input, scale, zero point) index triples of their quantized inputs, and the
#: output's scale and zero point indices (onnxruntime's contrib op schemas; QLinearConcat's inputs
#: are triples after Y_scale, Y_zero_point).
_QOP_OUT = {
    "QLinearConv": (6, 7),
    "QLinearMatMul": (6, 7),
    "QGemm": (7, 8),
    "QLinearAdd": (6, 7),
    "QLinearMul": (6, 7),
    "QLinearConcat": (0, 1),
    "QLinearAveragePool": (3, 4),
    "QLinearGlobalAveragePool": (3, 4),
    "QLinearLeakyRelu": (3, 4),
    "QLinearSigmoid": (3, 4),
    "QLinearSoftmax": (3, 4),
}
_BINARY_IN = ((0, 1, 2), (3, 4, 5))
_UNARY_IN = ((0, 1, 2),)
_QOP_IN = {op: (_BINARY_IN if out[0] >= 6 else _UNARY_IN) for op, out in _QOP_OUT.items() if op != "QLinearConcat"}


def _data_inputs(node: onnx.NodeProto) -> list[int]:
    """Indices of the inputs whose values the op moves (the others are indices, shapes, axes)."""
    if node.op_type == "Concat":
        return [i for i, name in enumerate(node.input) if name]
    return [0]


def _is_move(node: onnx.NodeProto) -> bool:
    return node.domain in _STANDARD and node.op_type in QDQ_WRAP_OPS


def _candidates(scope: Scope, name: str) -> list[tuple[str, str]]:
    """(scale, zero point) names that say how ``name`` is quantized, nearest first: what wrote it
    (through data movement), then what reads it (through data movement)."""
    out: list[tuple[str, str]] = []
    seen: set[str] = set()
    todo = [name]
    while todo:
        value = todo.pop(0)
        if value in seen:
            continue
        seen.add(value)
        producer = scope.producer(value)
        if producer is not None:
            op, domain = producer.op_type, producer.domain
            if op == "QuantizeLinear" and domain in (*_STANDARD, "com.microsoft") and len(producer.input) > 1:
                out.append((producer.input[1], producer.input[2] if len(producer.input) > 2 else ""))
            elif op in _QOP_OUT and domain in (*_STANDARD, "com.microsoft"):
                s, z = _QOP_OUT[op]
                if s < len(producer.input):
                    out.append((producer.input[s], producer.input[z] if z < len(producer.input) else ""))
            elif _is_move(producer) and producer.input[0]:
                todo.append(producer.input[0])
        for reader in scope.readers(value):
            op, domain = reader.op_type, reader.domain
            if domain not in (*_STANDARD, "com.microsoft"):
                continue
            if op == "DequantizeLinear" and reader.input[0] == value and len(reader.input) > 1:
                out.append((reader.input[1], reader.input[2] if len(reader.input) > 2 else ""))
            elif op == "QLinearConcat":
                for i in range(2, len(reader.input) - 2, 3):
                    if reader.input[i] == value:
                        out.append((reader.input[i + 1], reader.input[i + 2]))
            elif op in _QOP_IN:
                for x, s, z in _QOP_IN[op]:
                    if x < len(reader.input) and reader.input[x] == value and s < len(reader.input):
                        out.append((reader.input[s], reader.input[z] if z < len(reader.input) else ""))
            elif _is_move(reader) and reader.output and value in [reader.input[i] for i in _data_inputs(reader)]:
                todo.append(reader.output[0])
    return out


def _params(site: Site, name: str, dtype: str) -> tuple[float, int] | str:
    """The first usable (scale, zero point) of ``name``, or why there is none."""
    why = f"no QuantizeLinear, DequantizeLinear or QOperator op says how {name!r} is quantized"
    for scale_name, zp_name in _candidates(site.scope, name):
        scale = site.constant(scale_name)
        zp = site.constant(zp_name) if zp_name else np.zeros((), np.uint8)
        if scale is None or zp is None:
            why = f"the scale or zero point of {name!r} is computed at run time"
            continue
        if scale.size != 1 or zp.size != 1:
            why = f"{name!r} is quantized per axis"
            continue
        if scale.dtype != np.float32 or zp.dtype.name != dtype:
            why = f"{name!r}: scale {scale.dtype.name} / zero point {zp.dtype.name}, not float32 / {dtype}"
            continue
        s = float(scale.reshape(()))
        if not SCALE_RANGE[0] <= s <= SCALE_RANGE[1]:
            why = (
                f"{name!r}: scale {s!r} outside [{SCALE_RANGE[0]:g}, {SCALE_RANGE[1]:g}], where DequantizeLinear "
                "-> QuantizeLinear is proven to give every value back"
            )
            continue
        return s, int(zp.reshape(()))
    return why


def _dtype(site: Site, name: str) -> str | None:
    """The element type of ``name``: recorded, else the zero point's type of its quantization
    (QOperator models record few intermediate types)."""
    if not name:
        return None
    t = site.elem_type(name)
    if t:
        return dtype_name(t)
    for _, zp_name in _candidates(site.scope, name):
        zp = site.constant(zp_name) if zp_name else None
        if zp is not None:
            return zp.dtype.name
    return None


class QdqWrapBuilder:
    """A data-movement op on a uint8/int8 tensor -> DequantizeLinear -> the op on float -> QuantizeLinear."""

    name = "qdq_wrap"
    contract = CONTRACTS["qdq_wrap"]

    def quantized_dtype(self, site: Site) -> str | None:
        return _dtype(site, site.input(0))

    def check(self, site: Site, options: Mapping[str, Any]) -> Plan:
        node = site.node
        if len(node.output) != 1 or not node.output[0]:
            raise NotApplicable(f"{node.op_type} with {len(node.output)} outputs")
        dtype = _dtype(site, site.input(0))
        if dtype not in _QUANTIZED:
            raise NotApplicable(f"{node.op_type} on {dtype or 'a tensor of unknown type'}, not uint8/int8")
        readers = site.scope.readers(node.output[0])
        if (
            node.op_type == "Gather"
            and site.constant(node.input[0]) is not None
            and readers
            and all(r.op_type == "DequantizeLinear" and r.domain in _STANDARD for r in readers)
        ):
            # quantize_dynamic's embedding lookup, DequantizeLinear(Gather(table)): the weight-only
            # form's exact gather rule writes it with no Q/DQ at all and, with its pattern, removes
            # what the lookup's DynamicQuantizeLinear chain leaves dead. Wrapped here instead, a
            # target plan that takes that form's matmul rules per node left the chain's
            # DynamicQuantizeLinear unread, which QNN refuses (ortdyn_bert_optimized, observed).
            raise NotApplicable("DequantizeLinear(Gather(constant table)): the weight-only form's gather rule")
        found = _params(site, node.output[0], dtype)
        if isinstance(found, str):
            raise NotApplicable(found)
        for i in _data_inputs(node):
            if _dtype(site, node.input[i]) != dtype:
                raise NotApplicable(f"input {i} of {node.op_type} is not {dtype}")
            if node.op_type == "Concat":
                own = _params(site, node.input[i], dtype)
                if own != found:
                    raise NotApplicable(
                        f"Concat input {i} ({node.input[i]!r}) is quantized differently from its output: not exact"
                    )
        scale, zp = found
        opset = kernel_opsets.qdq_opset(True, dtype) or 0
        return Plan(
            min_opset=opset,
            notes=(f"{dtype}, scale {scale!r}, zero point {zp}",),
            data={"scale": scale, "zero_point": zp, "dtype": dtype},
        )

    def build(self, site: Site, emit: Emitter, options: Mapping[str, Any], plan: Plan) -> None:
        node = site.node
        scale = emit.const(np.float32(plan.data["scale"]))
        zp = emit.const(np.array(plan.data["zero_point"], dtype=plan.data["dtype"]))
        inputs = list(node.input)
        for i in _data_inputs(node):
            inputs[i] = emit.op1("DequantizeLinear", [inputs[i], scale, zp])
        attrs: dict[str, Any] = {a.name: a for a in node.attribute}
        moved = emit.op1(node.op_type, inputs, **attrs)
        emit.op1("QuantizeLinear", [moved, scale, zp], node.output[0])


register(QdqWrapBuilder())
