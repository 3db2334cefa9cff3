"""Vendor quantize/dequantize ops -> standard ONNX.

Two builders, each serving several rules through options (the rules in ``rules/`` decide which
dtypes and opsets go where)::

    standard_qdq:   Vendor QuantizeLinear(x, s, zp)   -> QuantizeLinear(x, s, zp, axis=a)
                    Vendor DequantizeLinear(x, s, zp) -> DequantizeLinear(x, s, zp, axis=a)
    qdq_decompose:  Vendor QuantizeLinear / DequantizeLinear -> exact elementwise forms (below)

Options (both builders):

``direction``           "quantize" or "dequantize".
``axis_default``        the axis the vendor kernel uses when the node has no ``axis`` attribute:
                        0 for AMD Quark (measured; its documentation says 1), 1 for
                        com.microsoft. Always written out explicitly, since the standard ops'
                        default (1) is not Quark's.
``require_zero_point``  the kernel takes exactly three inputs (Quark).

``standard_qdq`` only:

``int32_in_int64``      the vendor kernel dequantizes int32 as ``(int64)x - zp`` (Quark), while
                        onnxruntime's DequantizeLinear subtracts in int32 and wraps (x = -2^31,
                        zp = 3 gives +7.9e7 instead of -7.9e7, vector c069). DequantizeLinear is
                        then only used when the zero point is a constant 0; otherwise the rule
                        gives way to the decomposition.

``qdq_decompose`` only:

``overflow``            integer quantize, where ``x / scale`` is NaN, infinite or >= 2^63 in
                        magnitude. "int64-wrap": Quark's x86 kernel converts to int64 first
                        (giving INT64_MIN, "integer indefinite") and adds the zero point with
                        wrap-around: qmin, or qmax when the zero point is negative (vectors
                        c000-c004, c016, c063). "saturate": onnxruntime's QuantizeLinear (inf
                        saturates, NaN gives qmin).
``float16_semantics``   float16, where Quark's CPU kernel and its documentation disagree (below).

Decompositions (every one bit-exact with its kernel; NUMERICS.md and tests/test_lower_quark.py)::

    integer Q   q = Round(Div(x, s))                                # float32, half to even
                y = Cast<T>(Where(Less(Abs(q), 2^63),              # (1)
                                  Clip(Add(Cast<C>(q), Cast<C>(zp)), lo, hi),   # (2)
                                  fallback))                        # overflow option
    integer DQ  y = Mul(Cast<f32>(Sub(Cast<C>(x), Cast<C>(zp))), s)    # (2)
    bfloat16 Q  y = Cast<bf16>(Add(Div(x, s), Cast<f32>(zp)))           # no rounding, no saturation
    bfloat16 DQ y = Mul(Sub(Cast<f32>(x), Cast<f32>(zp)), s)
    float16 Q   y = Cast<f16>(Clip(x, -65504, 65504))                   # kernel: scale, zp ignored
    float16 DQ  y = Cast<f32>(x)                                        # kernel: scale, zp ignored

(1) ``Less`` is false for NaN, so NaN takes the fallback too. Never saturate after a float->int
    Cast: Cast does not saturate (out of range gives INT_MIN, or wraps for narrow types).
(2) C is float32 for types up to 16 bits and float64 for 32-bit types, where every value and both
    bounds are exact (2^31 - 1 is not a float32). Never clip in int64: onnxruntime 1.31's int64
    Clip/Min/Max are wrong for 8+ elements (NUMERICS.md).

Per-axis parameters are reshaped to broadcast along the axis ([n, 1, ..., 1]); per-tensor ones
become scalars. Constants are folded at rewrite time; runtime tensors get a Reshape.

float16 (Quark): the CPU kernel ignores scale and zero point, the documentation says
``y = f16(x / scale + zp)``. With scale 1 and zero point 0 (what Quark writes) they agree and
the rewrite proceeds; otherwise ``float16_semantics`` must say which one the user wants:
"kernel" (what the model computes today on CPU) or "documented"
(``Cast<f16>(Clip(Add(Div(x, s), Cast<f32>(zp)), +-65504))`` and ``Mul(Sub(Cast<f32>(x),
Cast<f32>(zp)), s)``). The default, "strict", stops with an explanation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx

from onnx_qrewrite.rewriter import kernel_opsets
from onnx_qrewrite.rewriter.builders import Emitter, NoMatch, Plan, Site, register
from onnx_qrewrite.rewriter.builders._qdq import (
    INTEGER_RANGES,
    PER_AXIS,
    PER_TENSOR,
    QDQNode,
    quantized_dtype,
    read_qdq,
    scale_and_zero_point,
)
from onnx_qrewrite.rewriter.builders.contracts import CONTRACTS

__all__ = ["QDQDecomposeBuilder", "StandardQDQBuilder"]

_T = onnx.TensorProto

_ONNX_TYPES = {
    "uint8": _T.UINT8,
    "int8": _T.INT8,
    "uint16": _T.UINT16,
    "int16": _T.INT16,
    "uint32": _T.UINT32,
    "int32": _T.INT32,
    "float16": _T.FLOAT16,
    "bfloat16": _T.BFLOAT16,
}

_FLOAT16_MAX = 65504.0
#: Magnitude from which float32 -> int64 conversion overflows (exact in float32).
_INT64_LIMIT = np.float32(2.0**63)


def _direction(options: Mapping[str, Any]) -> bool:
    return options["direction"] == "quantize"


class StandardQDQBuilder:
    """Replaces a vendor QuantizeLinear/DequantizeLinear with the standard op of the same kind."""

    name = "standard_qdq"
    contract = CONTRACTS["standard_qdq"]

    def quantized_dtype(self, site: Site) -> str | None:
        # No options here (the Builder protocol): the op name tells the direction.
        return quantized_dtype(site, quantize="dequantize" not in site.node.op_type.lower())

    def check(self, site: Site, options: Mapping[str, Any]) -> Plan:
        quantize = _direction(options)
        q = read_qdq(site, options, quantize=quantize)
        op = "QuantizeLinear" if quantize else "DequantizeLinear"
        needed = kernel_opsets.qdq_opset(quantize, q.dtype, per_axis=q.granularity != PER_TENSOR)
        if needed is None:
            raise NoMatch(f"standard {op} has no {q.dtype} kernel in onnxruntime")
        if q.float_type == "float16":
            if quantize:
                raise NoMatch(
                    "float16 x: the standard QuantizeLinear's float16 kernel differs from the contrib one "
                    "(+inf gives 0 for unsigned types, NaN gives qmax for signed ones; measured)"
                )
            needed = max(needed, kernel_opsets.FLOAT16_SCALE)
        int32_in_int64 = not quantize and q.dtype == "int32" and options["int32_in_int64"]
        if int32_in_int64 and q.zero_point and (q.zp_value is None or np.any(q.zp_value != 0)):
            raise NoMatch(
                f"zero point {q.zero_point!r} is not a constant 0: the kernel computes (int64)x - zp, "
                "DequantizeLinear subtracts in int32 and wraps for extreme x"
            )
        origin = "Quark kernel" if options.get("axis_default") == 0 else "kernel"
        return Plan(min_opset=needed, notes=(q.describe(origin),), data={"qdq": q})

    def template_key(self, site: Site, options: Mapping[str, Any], plan: Plan) -> tuple | None:
        """Equal keys build one node with the same op, attribute and input wiring (the engine then
        stamps it, see builders/_stamp.py). None when the build derives a constant from this
        node's own values (a scale of rank > 1) or reshapes at run time: built normally."""
        q: QDQNode = plan.data["qdq"]
        if q.granularity not in (PER_TENSOR, PER_AXIS):
            return None
        for shape in (q.scale_shape, q.zp_shape if q.zero_point else ()):
            if shape is None or len(shape) > 1:
                return None
        inputs = list(site.node.input)
        wiring = tuple(inputs.index(name) for name in inputs)  # which inputs share a name
        return (q.quantize, q.granularity, q.axis if q.granularity == PER_AXIS else None, wiring)

    def build(self, site: Site, emit: Emitter, options: Mapping[str, Any], plan: Plan) -> None:
        q: QDQNode = plan.data["qdq"]
        scale, zp = scale_and_zero_point(emit, q, for_elementwise=False)
        attrs: dict[str, Any] = {}
        if q.granularity != PER_TENSOR:
            # Written even when the vendor node has none: the standard default (1) is not Quark's (0).
            attrs["axis"] = q.axis
        op = "QuantizeLinear" if q.quantize else "DequantizeLinear"
        emit.op1(op, [q.x, scale] + ([zp] if zp else []), site.node.output[0], **attrs)


register(StandardQDQBuilder())


# --------------------------------------------------------------------------------------------------


_DECOMPOSABLE = ("uint8", "int8", "uint16", "int16", "uint32", "int32", "bfloat16", "float16")


def _all_equal(value: np.ndarray | None, target: float) -> bool:
    return value is not None and bool(np.all(np.asarray(value, np.float64) == target))


def _is_positive_zero(value: np.ndarray | None) -> bool:
    """All elements +0 (bit pattern 0): subtracting it is exact for every x, -0.0 included."""
    return value is not None and not np.ascontiguousarray(value).reshape(-1).view(np.uint8).any()


class QDQDecomposeBuilder:
    """Replaces a vendor QuantizeLinear/DequantizeLinear with its exact elementwise decomposition."""

    name = "qdq_decompose"
    MIN_OPSET = kernel_opsets.FORMS["qdq-decompose"]
    contract = CONTRACTS["qdq_decompose"]

    def quantized_dtype(self, site: Site) -> str | None:
        return quantized_dtype(site, quantize="dequantize" not in site.node.op_type.lower())

    def check(self, site: Site, options: Mapping[str, Any]) -> Plan:
        quantize = _direction(options)
        overflow, f16 = options["overflow"], options["float16_semantics"]
        q = read_qdq(site, options, quantize=quantize)
        if q.dtype not in _DECOMPOSABLE:
            raise NoMatch(f"no exact decomposition for {q.dtype}")
        notes = [q.describe("Quark kernel" if options.get("axis_default") == 0 else "kernel")]
        if q.granularity != PER_TENSOR and q.rank is None:
            raise NoMatch(
                f"{q.describe('kernel')} needs the rank of x {q.x!r} to broadcast the scale, and the model "
                "does not record it (no value_info); run onnx shape inference on the model first"
            )
        if q.float_type == "float16" and q.dtype not in INTEGER_RANGES:
            raise NoMatch(f"float16 x or scale with {q.dtype}: not lowered")
        if q.dtype == "float16":
            f16 = self._float16_semantics(site, q, f16)
            notes.append(f"float16 semantics: {f16}")
        elif q.dtype in INTEGER_RANGES and quantize:
            notes.append(f"overflow: {overflow}")
        if q.float_type == "float16":
            notes.append("float16 x/scale computed in float32, as the contrib kernel")
        integer_dequantize = not quantize and q.dtype in INTEGER_RANGES
        return Plan(
            min_opset=kernel_opsets.DECOMPOSE_DEQUANTIZE_INTEGER if integer_dequantize else self.MIN_OPSET,
            notes=tuple(notes),
            data={"qdq": q, "overflow": overflow, "float16_semantics": f16},
        )

    @staticmethod
    def _float16_semantics(site: Site, q: QDQNode, chosen: str) -> str:
        if chosen != "strict":
            return chosen
        if _all_equal(q.scale_value, 1.0) and (not q.zero_point or _all_equal(q.zp_value, 0.0)):
            return "kernel"  # the kernel and the documented formula agree
        what = []
        if q.scale_value is None:
            what.append(f"scale {q.scale!r} is computed at run time")
        elif not _all_equal(q.scale_value, 1.0):
            what.append(f"scale is {np.asarray(q.scale_value).ravel()[:4].tolist()}, not 1")
        if q.zero_point and q.zp_value is None:
            what.append(f"zero point {q.zero_point!r} is computed at run time")
        elif q.zero_point and not _all_equal(q.zp_value, 0.0):
            what.append(f"zero point is {np.asarray(q.zp_value, np.float32).ravel()[:4].tolist()}, not 0")
        formula = "float16(x / scale + zero_point)" if q.quantize else "(float(x) - zero_point) * scale"
        kernel = "float16(clip(x, -65504, 65504))" if q.quantize else "float(x)"
        raise NoMatch(
            f"float16 with {' and '.join(what)}: Quark's CPU kernel ignores scale and zero point "
            f"(y = {kernel}) but its documentation says y = {formula}, and here they disagree; "
            "the rewrite will not guess. Choose with --float16-semantics kernel (what the model computes "
            "today in onnxruntime with Quark's library) or --float16-semantics documented "
            "(rule option float16_semantics)"
        )

    def build(self, site: Site, emit: Emitter, options: Mapping[str, Any], plan: Plan) -> None:
        q: QDQNode = plan.data["qdq"]
        y = site.node.output[0]
        if q.dtype == "float16" and plan.data["float16_semantics"] == "kernel":
            if q.quantize:
                lo, hi = emit.const(-_FLOAT16_MAX, np.float32), emit.const(_FLOAT16_MAX, np.float32)
                clipped = emit.op1("Clip", [q.x, lo, hi], hint="ClipToFloat16Range")
                emit.op1("Cast", [clipped], y, to=_T.FLOAT16)
            else:
                emit.op1("Cast", [q.x], y, to=_T.FLOAT)
            return
        scale, zp = scale_and_zero_point(emit, q, for_elementwise=True)
        if q.float_type == "float16":  # onnxruntime's contrib kernels compute in float32 (measured)
            scale = emit.op1("Cast", [scale], to=_T.FLOAT, hint="ScaleToFloat")
            if q.quantize:
                q = dataclasses.replace(q, x=emit.op1("Cast", [q.x], to=_T.FLOAT, hint="ToFloat"))
        if q.dtype in INTEGER_RANGES:
            if q.quantize:
                self._quantize_integer(emit, q, scale, zp, y, plan.data["overflow"])
            elif q.float_type == "float16":
                emit.op1("Cast", [self._dequantize_integer(emit, q, scale, zp, None)], y, to=_T.FLOAT16)
            else:
                self._dequantize_integer(emit, q, scale, zp, y)
        elif q.quantize:  # bfloat16, or float16 with the documented semantics
            shifted = emit.op1("Div", [q.x, scale])
            if zp:
                shifted = emit.op1("Add", [shifted, emit.op1("Cast", [zp], to=_T.FLOAT)])
            if q.dtype == "float16":
                lo, hi = emit.const(-_FLOAT16_MAX, np.float32), emit.const(_FLOAT16_MAX, np.float32)
                shifted = emit.op1("Clip", [shifted, lo, hi], hint="SaturateToFloat16")
            emit.op1("Cast", [shifted], y, to=_ONNX_TYPES[q.dtype])
        else:
            value = emit.op1("Cast", [q.x], to=_T.FLOAT)
            if zp and not _is_positive_zero(q.zp_value):
                value = emit.op1("Sub", [value, emit.op1("Cast", [zp], to=_T.FLOAT)])
            emit.op1("Mul", [value, scale], y)

    @staticmethod
    def _compute_type(dtype: str) -> tuple[int, Any]:
        """float32 holds every value of the types up to 16 bits exactly; 32-bit types need float64."""
        return (_T.DOUBLE, np.float64) if dtype in ("int32", "uint32") else (_T.FLOAT, np.float32)

    def _quantize_integer(self, emit: Emitter, q: QDQNode, scale: str, zp: str, y: str, overflow: str) -> None:
        lo, hi = INTEGER_RANGES[q.dtype]
        onnx_c, np_c = self._compute_type(q.dtype)
        rounded = emit.op1("Round", [emit.op1("Div", [q.x, scale])])
        value = rounded if onnx_c == _T.FLOAT else emit.op1("Cast", [rounded], to=onnx_c)
        zp_c = ""
        if zp and not (q.zp_value is not None and not np.any(q.zp_value)):
            zp_c = emit.op1("Cast", [zp], to=onnx_c)
            value = emit.op1("Add", [value, zp_c])
        lo_c, hi_c = emit.const(lo, np_c), emit.const(hi, np_c)
        clipped = emit.op1("Clip", [value, lo_c, hi_c], hint="Saturate")
        if overflow == "saturate":
            # onnxruntime's QuantizeLinear: +-inf saturate through the Clip, NaN gives qmin.
            in_range = emit.op1("Not", [emit.op1("IsNaN", [rounded])])
            fallback = lo_c
        else:
            # Quark's x86 kernel: int64(q) is INT64_MIN for NaN, +-inf and |q| >= 2^63; adding the
            # zero point wraps to a huge positive number when it is negative.
            limit = emit.const(_INT64_LIMIT, np.float32)
            in_range = emit.op1("Less", [emit.op1("Abs", [rounded]), limit], hint="FitsInt64")
            if not zp or q.zp_value is not None:
                zp_values = _broadcast_constant(q, q.zp_value) if zp and q.zp_value is not None else np.zeros(())
                if not np.any(zp_values < 0):
                    fallback = lo_c
                elif np.all(zp_values < 0):
                    fallback = hi_c
                else:  # per-axis zero points of both signs
                    fallback = emit.const(np.where(zp_values < 0, hi, lo).astype(np_c))
            elif lo == 0:
                fallback = lo_c  # unsigned: the zero point is never negative
            else:
                negative = emit.op1("Less", [zp_c or emit.op1("Cast", [zp], to=onnx_c), emit.const(0, np_c)])
                fallback = emit.op1("Where", [negative, hi_c, lo_c], hint="OverflowValue")
        chosen = emit.op1("Where", [in_range, clipped, fallback])
        emit.op1("Cast", [chosen], y, to=_ONNX_TYPES[q.dtype])

    def _dequantize_integer(self, emit: Emitter, q: QDQNode, scale: str, zp: str, y: str | None) -> str:
        onnx_c, _ = self._compute_type(q.dtype)
        if not zp or (q.zp_value is not None and not np.any(q.zp_value)):
            # x - 0: a single rounding of x to float32, whichever route.
            value = emit.op1("Cast", [q.x], to=_T.FLOAT)
        else:
            # The difference is exact in the compute type ((int64)x - zp for 32-bit types), then
            # rounded once to float32, like the kernel's (float)((int64)x - zp).
            diff = emit.op1("Sub", [emit.op1("Cast", [q.x], to=onnx_c), emit.op1("Cast", [zp], to=onnx_c)])
            value = diff if onnx_c == _T.FLOAT else emit.op1("Cast", [diff], to=_T.FLOAT)
        return emit.op1("Mul", [value, scale], y)


def _broadcast_constant(q: QDQNode, values: np.ndarray) -> np.ndarray:
    """A constant zero point in the shape the decomposition broadcasts it with."""
    values = np.asarray(values)
    if q.granularity == PER_TENSOR:
        return values.reshape(())
    assert q.rank is not None
    return values.reshape([-1] + [1] * (q.rank - 1 - q.axis % q.rank))


register(QDQDecomposeBuilder())
