"""A data-movement op on a quantized tensor, moved between a DequantizeLinear and a QuantizeLinear.

onnxruntime's QOperator models run Reshape, Transpose, Flatten, Squeeze, Unsqueeze and Gather
directly on the uint8 (or int8) tensors between their QLinear* ops. That is valid ONNX, but a
target that has no 8-bit tensors inside the network except on the quantized side of a Q/DQ
(TensorRT: uint8 only as a network input or output; QNN's HTP: 8-bit only as quantized tensors)
refuses the op, and once the QLinear* ops around it are lowered to Q/DQ, the op still sits between
a QuantizeLinear and a DequantizeLinear, so no rule pairing the two can reach it. This builder
writes the QDQ form onnxruntime's own quantizer writes for these ops::

    Op(u, ...) -> QuantizeLinear(Op(DequantizeLinear(u, s, zp), ...), s, zp)

with ``s``, ``zp`` the tensor's own per-tensor parameters: those of the node that produced it (a
QuantizeLinear or a QLinear* op's output, looking back through other such data-movement ops), else
those of a node that reads it (a DequantizeLinear or a QLinear* op's input). Every output element
of these ops is one input element (the other inputs are shapes, axes or indices), so the result is
``Op(Q(DQ(u)))``, which is ``Op(u)`` bit for bit exactly when ``Q(DQ(c)) = c`` for every code ``c``
of the type. ``check`` proves that per node over all codes of the type (256 for 8 bits) in float32,
as onnxruntime's kernels compute (``DequantizeLinear``: ``(c - zp) * s``; ``QuantizeLinear``:
``saturate(round_half_even(v / s) + zp)``), and declines otherwise (a scale so large that ``(c - zp) * s``
overflows, a zero or NaN scale; products with a denormal scale are exact multiples of 2^-149 and
round-trip). The rule is **exact**.

A later rule can then compute the QuantizeLinear -> DequantizeLinear pairs that now meet (float
emulation for TensorRT), or a QDQ-aware backend fuses DQ -> Op -> Q into its quantized op.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx

from onnx_qrewrite.rewriter import kernel_opsets
from onnx_qrewrite.rewriter.builders import Emitter, NotApplicable, Plan, Site, register
from onnx_qrewrite.rewriter.builders.contracts import CONTRACTS, QDQ_MOVEMENT_OPS
from onnx_qrewrite.rewriter.graph import Scope

__all__ = ["QDQMovementBuilder", "round_trips"]

_STANDARD = ("", "ai.onnx")
_RANGES = {"uint8": (0, 255), "int8": (-128, 127), "uint16": (0, 65535), "int16": (-32768, 32767)}
#: Output (scale, zero point) input positions of the QLinear ops (onnx and com.microsoft).
_OUTPUT_PARAMS = {
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
#: Quantized inputs of the QLinear ops: (x, scale, zero point) positions.
_INPUT_PARAMS = {
    "QLinearConv": ((0, 1, 2), (3, 4, 5)),
    "QLinearMatMul": ((0, 1, 2), (3, 4, 5)),
    "QGemm": ((0, 1, 2), (3, 4, 5)),
    "QLinearAdd": ((0, 1, 2), (3, 4, 5)),
    "QLinearMul": ((0, 1, 2), (3, 4, 5)),
    "QLinearAveragePool": ((0, 1, 2),),
    "QLinearGlobalAveragePool": ((0, 1, 2),),
    "QLinearLeakyRelu": ((0, 1, 2),),
    "QLinearSigmoid": ((0, 1, 2),),
    "QLinearSoftmax": ((0, 1, 2),),
}
_QDOMAINS = ("", "ai.onnx", "com.microsoft")


def round_trips(scale: np.ndarray, zero_point: np.ndarray | None, dtype: str) -> bool:
    """Whether QuantizeLinear(DequantizeLinear(c)) = c for every code c of ``dtype``, in float32 as
    onnxruntime's kernels compute them (per-tensor ``scale``, ``zero_point``)."""
    lo, hi = _RANGES[dtype]
    zp = int(np.asarray(zero_point).reshape(-1)[0]) if zero_point is not None else 0
    s = np.float32(np.asarray(scale).reshape(-1)[0])
    codes = np.arange(lo, hi + 1, dtype=np.int64)
    with np.errstate(all="ignore"):
        value = (codes - zp).astype(np.float32) * s
        back = np.rint(value / s).astype(np.float64) + zp
    return bool(np.all(np.isfinite(back)) and np.array_equal(np.clip(back, lo, hi), codes))


def _readers(scope: Scope) -> dict[str, list[onnx.NodeProto]]:
    def index() -> dict[str, list[onnx.NodeProto]]:
        found: dict[str, list[onnx.NodeProto]] = {}
        for n in scope.container.node:
            for name in n.input:
                if name:
                    found.setdefault(name, []).append(n)
        return found

    return scope.memo("qdq_movement.readers", index)


def _at(node: onnx.NodeProto, i: int) -> str:
    return node.input[i] if i < len(node.input) else ""


def _find_params(site: Site) -> tuple[str, str, str]:
    """(scale, zero point, where they come from) for the tensor ``site`` moves; NotApplicable when
    no neighbour states them."""
    scope = site.scope
    name = site.input(0)
    producer = scope.producer(name)
    for _ in range(16):  # back through other data-movement ops on the same tensor
        if producer is None or producer.domain not in _STANDARD or producer.op_type not in QDQ_MOVEMENT_OPS:
            break
        name = _at(producer, 0)
        producer = scope.producer(name)
    if producer is not None and producer.domain in _QDOMAINS:
        if producer.op_type == "QuantizeLinear" and producer.domain in _STANDARD:
            return _at(producer, 1), _at(producer, 2), f"QuantizeLinear {producer.name or name!r}"
        if producer.op_type in _OUTPUT_PARAMS:
            s, z = _OUTPUT_PARAMS[producer.op_type]
            if _at(producer, s):
                return _at(producer, s), _at(producer, z), f"the output of {producer.op_type} {producer.name!r}"
    out = site.node.output[0]
    for reader in _readers(scope).get(out, []):
        if reader.domain in _STANDARD and reader.op_type == "DequantizeLinear" and _at(reader, 0) == out:
            return _at(reader, 1), _at(reader, 2), f"DequantizeLinear {reader.name!r}"
        if reader.domain in _QDOMAINS:
            for x, s, z in _INPUT_PARAMS.get(reader.op_type, ()):
                if _at(reader, x) == out:
                    return _at(reader, s), _at(reader, z), f"input {x} of {reader.op_type} {reader.name!r}"
    raise NotApplicable(
        f"no QuantizeLinear, DequantizeLinear or QLinear op next to {site.input(0)!r} states its scale and zero point"
    )


class QDQMovementBuilder:
    """Rewrites a data-movement op on a quantized tensor as DequantizeLinear -> op -> QuantizeLinear."""

    name = "qdq_movement"
    contract = CONTRACTS["qdq_movement"]

    def quantized_dtype(self, site: Site) -> str | None:
        try:
            return self._read(site)["dtype"]
        except NotApplicable:
            return None

    def _read(self, site: Site) -> dict[str, Any]:
        return site.memo("qdq_movement", lambda: self._params(site))

    def _params(self, site: Site) -> dict[str, Any]:
        node = site.node
        if node.op_type not in QDQ_MOVEMENT_OPS or node.domain not in _STANDARD or len(node.output) != 1:
            raise NotApplicable(f"{node.op_type} is not one of the data-movement ops {', '.join(QDQ_MOVEMENT_OPS)}")
        scale_name, zp_name, where = _find_params(site)
        scale = site.constant(scale_name)
        zp = site.constant(zp_name) if zp_name else None
        if scale is None or (zp_name and zp is None):
            raise NotApplicable(f"the scale or zero point ({where}) is computed at run time")
        if scale.size != 1 or (zp is not None and zp.size != 1):
            raise NotApplicable(f"the parameters ({where}) are not per-tensor")
        if scale.dtype != np.float32:
            raise NotApplicable(f"the scale ({where}) is {scale.dtype}; only float32 scales are moved")
        dtype = str(zp.dtype) if zp is not None else "uint8"
        if dtype not in _RANGES:
            raise NotApplicable(f"the quantized type {dtype} is not an 8- or 16-bit integer")
        elem = site.elem_type(site.input(0))
        if elem and onnx.helper.tensor_dtype_to_np_dtype(elem) != np.dtype(dtype):
            raise NotApplicable(f"{site.input(0)!r} is not {dtype} ({where} says {dtype})")
        if not round_trips(scale, zp, dtype):
            raise NotApplicable(
                f"QuantizeLinear(DequantizeLinear(c)) is not c for every {dtype} code with scale "
                f"{float(scale.reshape(-1)[0])!r} ({where}) in float32"
            )
        return {"scale": scale, "zp": zp, "dtype": dtype, "where": where}

    def check(self, site: Site, options: Mapping[str, Any]) -> Plan:
        read = self._read(site)
        opset = kernel_opsets.qdq_opset(True, read["dtype"])
        assert opset is not None
        note = f"{site.node.op_type} between DequantizeLinear and QuantizeLinear with the parameters of {read['where']}"
        return Plan(min_opset=opset, notes=(note,), data=read)

    def build(self, site: Site, emit: Emitter, options: Mapping[str, Any], plan: Plan) -> None:
        node = site.node
        scale = emit.const(plan.data["scale"])
        zp = plan.data["zp"]
        params = [scale, emit.const(zp)] if zp is not None else [scale]
        dequantized = emit.op1("DequantizeLinear", [node.input[0], *params])
        attrs: dict[str, Any] = {a.name: a for a in node.attribute}
        moved = emit.op1(node.op_type, [dequantized, *node.input[1:]], **attrs)
        emit.op1("QuantizeLinear", [moved, *params], node.output[0])


register(QDQMovementBuilder())
