"""oneDNN's DynamicDequantize -> standard ONNX.

``DynamicDequantize(src, scales[, zps])`` with attributes ``qtype`` ("per_tensor", the default, or
"per_channel") and ``axis`` (default 1) computes ``dst = (src - zps) * scales``; src is uint8 or
int8, scales float32, zps int8, uint8 or int32 whatever src is, and a missing zps means 0::

    DynamicDequantize(src, s, zps) -> DequantizeLinear(src, s, zps, axis=a)      # zps type == src type
    DynamicDequantize(src, s)      -> DequantizeLinear(src, s, axis=a)           # symmetric
    DynamicDequantize(src, s, zps) -> Mul(Cast<f32>(Sub(Cast<i32>(src), Cast<i32>(zps))), s)   # otherwise

onnxruntime's DequantizeLinear takes runtime scales and zero points, per-tensor and per-axis, and
is bit-exact with ``(x - zp) * s`` in float32, but rejects a zero point whose type differs from x
(NUMERICS.md); the arithmetic form covers that case, with per-channel scales and zero points
reshaped to broadcast along the axis. A bfloat16 or float16 scale (newer oneDNN: dst of that type)
has no DequantizeLinear kernel: the arithmetic form computes in float32 and casts the result.

Option ``form``: "dequantize_linear" (gives way when the zero point's type differs from src's, or
the scale is not float32) or "arithmetic". ``axis_default``: the axis when the attribute is absent.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import onnx

from onnx_qrewrite.rewriter import kernel_opsets
from onnx_qrewrite.rewriter.builders import Emitter, NoMatch, Plan, Site, register
from onnx_qrewrite.rewriter.builders._qdq import (
    broadcast_operand,
    normalized_axis,
    per_tensor_operand,
    value_shape,
)
from onnx_qrewrite.rewriter.builders.contracts import CONTRACTS
from onnx_qrewrite.rewriter.graph import dtype_name, known_shape

__all__ = ["DynamicDequantizeBuilder"]

_T = onnx.TensorProto
_SRC_TYPES = ("uint8", "int8")
_ZP_TYPES = ("uint8", "int8", "int32")
_SCALE_TYPES = {"float32": _T.FLOAT, "bfloat16": _T.BFLOAT16, "float16": _T.FLOAT16}
_QTYPES = ("per_tensor", "per_channel")


def _known(value: np.ndarray | None) -> Callable[[], np.ndarray | None]:
    """A value already read, in the lazy form the operand helpers of _qdq take."""
    return lambda: value


def _recorded_type(site: Site, name: str, role: str) -> str:
    """The element type the model records for input ``name`` (its ``role``: src, scales, zps); the
    rule needs it to choose a form, and says how to get it recorded when it is not."""
    elem = site.elem_type(name)
    if elem is None:
        raise NoMatch(
            f"the type of {role} {name!r} is not recorded in the model (no value_info); "
            "run onnx shape inference on the model first"
        )
    return dtype_name(elem)


def _qtype(site: Site) -> str:
    """The node's ``qtype``, once its inputs, outputs and attributes are the op's."""
    node = site.node
    if len(node.input) not in (2, 3) or not node.input[0] or not node.input[1]:
        raise NoMatch(f"malformed node: DynamicDequantize takes inputs (src, scales[, zps]), it has {len(node.input)}")
    if len(node.output) != 1:
        raise NoMatch(f"malformed node: DynamicDequantize has one output, it has {len(node.output)}")
    site.no_unknown_attributes({"qtype", "axis"})
    qtype = site.attribute("qtype", b"per_tensor")
    qtype = qtype.decode() if isinstance(qtype, bytes) else str(qtype)
    if qtype not in _QTYPES:
        raise NoMatch(f"qtype {qtype!r} is not supported (only {', '.join(_QTYPES)})")
    return qtype


def _operand_types(site: Site, src: str, scales: str, zps: str) -> tuple[str, str, str | None]:
    """The types of src, scales and zps (None: no zps), each one the op takes."""
    src_type = _recorded_type(site, src, "src")
    if src_type not in _SRC_TYPES:
        raise NoMatch(f"src {src!r} is {src_type}; DynamicDequantize takes uint8 or int8")
    scale_type = _recorded_type(site, scales, "scales")
    if scale_type not in _SCALE_TYPES:
        raise NoMatch(f"scales {scales!r} is {scale_type}; float32, bfloat16 or float16 are supported")
    zp_type = None
    if zps:
        zp_type = _recorded_type(site, zps, "zps")
        if zp_type not in _ZP_TYPES:
            raise NoMatch(f"zps {zps!r} is {zp_type}; DynamicDequantize takes int8, uint8 or int32 zero points")
    return src_type, scale_type, zp_type


def _check_one_element(operands: tuple[tuple[str, tuple | None], ...]) -> None:
    """per_tensor: each operand (name, shape if known) holds one element."""
    for name, shape in operands:
        dims = known_shape(shape)
        if dims is not None and math.prod(dims) != 1:
            raise NoMatch(
                f"malformed node: qtype per_tensor but {name!r} has shape {list(dims)} (one element expected)"
            )


def _check_channels(scales: str, scale_shape: tuple | None, dim: int | None, axis: int) -> None:
    """per_channel: a 1-D scale of known length holds one element or one per channel of the axis."""
    if (
        scale_shape is not None
        and len(scale_shape) == 1
        and None not in (dim, scale_shape[0])
        and scale_shape[0] not in (1, dim)
    ):
        raise NoMatch(
            f"malformed node: scales {scales!r} has {scale_shape[0]} elements but src has {dim} along axis {axis}"
        )


def _check_dequantize_linear_form(src_type: str, scales: str, scale_type: str, zps: str, zp_type: str | None) -> None:
    """What onnxruntime's DequantizeLinear takes: a zero point of src's type and a float32 scale;
    otherwise the arithmetic form follows."""
    if zp_type is not None and zp_type != src_type:
        raise NoMatch(
            f"zps {zps!r} is {zp_type} but src is {src_type}; DequantizeLinear needs both "
            "of one type (the arithmetic form follows)"
        )
    if scale_type != "float32":
        raise NoMatch(
            f"scales {scales!r} is {scale_type}; onnxruntime has no DequantizeLinear "
            "kernel for it (the arithmetic form follows)"
        )


class DynamicDequantizeBuilder:
    """Replaces oneDNN's DynamicDequantize with DequantizeLinear or its Cast/Sub/Mul form."""

    name = "dynamic_dequantize"
    contract = CONTRACTS["dynamic_dequantize"]

    def quantized_dtype(self, site: Site) -> str | None:
        return _recorded_type(site, site.input(0), "src")

    def check(self, site: Site, options: Mapping[str, Any]) -> Plan:
        form, axis_default = options["form"], options["axis_default"]
        qtype = _qtype(site)
        src, scales, zps = site.node.input[0], site.node.input[1], site.input(2)
        src_type, scale_type, zp_type = _operand_types(site, src, scales, zps)
        scale_value = site.constant(scales)
        zp_value = site.constant(zps) if zps else None
        scale_shape = (
            tuple(scale_value.shape)
            if scale_value is not None
            else value_shape(site.scope, scales, site.same_shape_ops)
        )
        src_shape = value_shape(site.scope, src, site.same_shape_ops)
        rank = None if src_shape is None else len(src_shape)
        axis = int(site.attribute("axis", axis_default))
        if qtype == "per_tensor":
            _check_one_element(((scales, scale_shape), (zps, tuple(zp_value.shape) if zp_value is not None else None)))
        elif src_shape is not None:
            axis = normalized_axis(axis, len(src_shape), site)
            _check_channels(scales, scale_shape, src_shape[axis], axis)
        per_channel = qtype == "per_channel"
        notes = [f"{qtype}" + (f", axis={axis}" if per_channel else ""), f"zero point: {zp_type or 'none (symmetric)'}"]
        if form == "dequantize_linear":
            _check_dequantize_linear_form(src_type, scales, scale_type, zps, zp_type)
            min_opset = kernel_opsets.qdq_opset(False, src_type, per_axis=per_channel) or 0
        else:
            if per_channel and rank is None:
                raise NoMatch(
                    f"per_channel needs the rank of src {src!r} to broadcast the scales, and the "
                    "model does not record it; run onnx shape inference on the model first"
                )
            min_opset = kernel_opsets.FORMS["dynamic-dequantize-arithmetic"]
        data = {
            "src": src,
            "scales": scales,
            "zps": zps,
            "axis": axis,
            "rank": rank,
            "per_channel": per_channel,
            "scale_type": scale_type,
            "scale_value": scale_value,
            "zp_value": zp_value,
            "scale_shape": scale_shape,
            "form": form,
            "zp_shape": tuple(zp_value.shape)
            if zp_value is not None
            else value_shape(site.scope, zps, site.same_shape_ops),
        }
        return Plan(min_opset=min_opset, notes=tuple(notes), data=data)

    def build(self, site: Site, emit: Emitter, options: Mapping[str, Any], plan: Plan) -> None:
        d = plan.data
        y = site.node.output[0]
        if d["form"] == "dequantize_linear":
            scales, zps = d["scales"], d["zps"]
            if not d["per_channel"]:
                scales = _one_element(emit, scales, d["scale_value"], d["scale_shape"])
                if zps:
                    zps = _one_element(emit, zps, d["zp_value"], d["zp_shape"])
            inputs = [d["src"], scales] + ([zps] if zps else [])
            attrs = {"axis": d["axis"]} if d["per_channel"] else {}
            emit.op1("DequantizeLinear", inputs, y, **attrs)
            return
        scales, zps = self._broadcast(emit, d)
        if d["scale_type"] != "float32":
            scales = emit.op1("Cast", [scales], to=_T.FLOAT)
        if zps:
            diff = emit.op1("Sub", [emit.op1("Cast", [d["src"]], to=_T.INT32), emit.op1("Cast", [zps], to=_T.INT32)])
        else:
            diff = d["src"]
        value = emit.op1("Cast", [diff], to=_T.FLOAT)
        if d["scale_type"] == "float32":
            emit.op1("Mul", [value, scales], y)
        else:
            emit.op1("Cast", [emit.op1("Mul", [value, scales])], y, to=_SCALE_TYPES[d["scale_type"]])

    @staticmethod
    def _broadcast(emit: Emitter, d: Mapping[str, Any]) -> tuple[str, str]:
        """Scales and zero points shaped for the elementwise form: scalars per tensor (always made
        scalar, whatever shape they had), [n, 1, ..., 1] along the axis per channel."""
        out = []
        for name, value in ((d["scales"], d["scale_value"]), (d["zps"], d["zp_value"])):
            if not name:
                out.append("")
            elif not d["per_channel"]:
                out.append(per_tensor_operand(emit, name, _known(value), None, scalar=True))
            else:
                out.append(broadcast_operand(emit, name, _known(value), d["rank"], d["axis"]))
        return out[0], out[1]


def _one_element(emit: Emitter, name: str, value: np.ndarray | None, shape: tuple | None) -> str:
    """DequantizeLinear takes a scalar or 1-D one-element scale; oneDNN any one-element tensor."""
    if shape is not None and len(shape) <= 1:
        return name
    if value is not None:
        return emit.const(value.reshape(()))
    return emit.op1("Reshape", [name, emit.const(np.asarray([-1], np.int64))], hint="To1D")


register(DynamicDequantizeBuilder())
