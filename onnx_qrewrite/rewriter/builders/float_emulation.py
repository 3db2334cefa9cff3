"""The float emulation of QuantizeLinear / DequantizeLinear: a named form for targets without Q/DQ.

Some runtimes (WebGPU/WebGL backends, older TensorRT and CoreML paths, hand-written inference
engines) have no QuantizeLinear/DequantizeLinear kernel but run float elementwise ops and Cast.
This form computes both in float32 arithmetic on integer-valued floats, as onnxruntime's kernels
do (NUMERICS.md), and converts types only at the node's boundary::

    QuantizeLinear(x, s, zp)   -> Cast<T>(Where(IsNaN(r), qmin, Clip(Add(r, zp_f), qmin, qmax)))
                                  with r = Round(Div(x_f, s_f))           # divide, never multiply
    DequantizeLinear(q, s, zp) -> Cast<out>(Mul(Sub(Cast<f32>(q), zp_f), s_f))
    DequantizeLinear(QuantizeLinear(x)) (float32) -> the two without the Casts between them: no
                                  integer tensor, for targets that refuse them inside the network
                                  (TensorRT's uint8); the QuantizeLinear goes once nothing reads it

``x_f``, ``s_f`` are float32 (float16/bfloat16 inputs and scales are cast up exactly, and the
kernel computes in float32 too; but its float16 quantize converts to int32 before it saturates,
which the form reproduces in float64, see ``_int32_path``); ``zp_f`` is the zero point as float32
(exact for every value of the 8- and 16-bit types); a float16/bfloat16 result is rounded once, to
nearest even, by the last ``Cast``. Round is half-to-even like the kernel's ``nearbyint``;
``Clip`` saturates +-inf; NaN gives qmin as in onnxruntime (a NaN through ``Cast`` to an integer
type is undefined, hence the ``Where``).

With ``elementwise = "comparisons"`` (targets that run neither Round nor IsNaN: onnxruntime's
WebGPU execution provider), ``Round(v)`` is computed from ``f = Floor(v)`` and ``d = v - f``:
``f + 1`` where ``d > 0.5``, ``f + (f - 2 * Floor(f * 0.5))`` (f's parity) where ``d == 0.5``, ``f``
otherwise, and ``v`` itself where ``|v| >= 2^23`` (already integral; +-inf and NaN pass through too).
Every step is exact in float32 for ``|v| < 2^23`` except ``d`` for ``-1 < v < 0``, where rounding
``v + 1`` cannot cross 0.5 in a way that changes the result (``d`` is exact for ``v <= -0.5``, and
above it both give 0). The value equals Round's; the sign of a zero result can differ (+0 where Round
gives -0), which every use here erases (the Cast to an integer type; ``+ zp`` or ``+ 0.0`` in the
pair). ``IsNaN(r)`` is ``Not(Equal(r, r))``. Measured in ``tests/test_float_emulation_comparisons.py``.

Exactness is measured in ``tests/test_float_emulation.py`` against onnxruntime's own kernels (bit
for bit on every float16 bit pattern and on float32 edge values: 0, -0, ties, +-inf, NaN,
1e38, denormals, with scales from 1e-45 to 3.4e38). bfloat16 has no onnxruntime kernel to be
exact against: there the form computes the ONNX definition in float32 and rounds once.

This form is not in the default catalogue (standard Q/DQ is what the tool produces): targets ask
for it by name (``onnx_qrewrite.rewriter.catalogue.named_form("float-emulation")``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx

from onnx_qrewrite.rewriter import kernel_opsets
from onnx_qrewrite.rewriter.builders import Emitter, NotApplicable, Plan, Site, register
from onnx_qrewrite.rewriter.builders._qdq import (
    INTEGER_RANGES,
    PER_TENSOR,
    broadcast_operand,
    per_tensor_operand,
    quantized_dtype,
    read_qdq,
)
from onnx_qrewrite.rewriter.builders.contracts import CONTRACTS
from onnx_qrewrite.rewriter.graph import dtype_name

__all__ = ["FloatEmulationBuilder"]

_T = onnx.TensorProto
_TYPES = {"uint8": _T.UINT8, "int8": _T.INT8, "uint16": _T.UINT16, "int16": _T.INT16}
_FLOATS = {"float32": _T.FLOAT, "float16": _T.FLOAT16, "bfloat16": _T.BFLOAT16}


class FloatEmulationBuilder:
    """Replaces a standard QuantizeLinear/DequantizeLinear with float arithmetic and Casts."""

    name = "qdq_float_emulation"
    contract = CONTRACTS["qdq_float_emulation"]

    def quantized_dtype(self, site: Site) -> str | None:
        return quantized_dtype(site, quantize=site.node.op_type == "QuantizeLinear")

    def check(self, site: Site, options: Mapping[str, Any]) -> Plan:
        direction = options["direction"]
        if direction == "pair":
            return self._check_pair(site)
        if direction == "remove":
            if site.node.op_type != "QuantizeLinear":
                raise NotApplicable(f"the rule removes QuantizeLinear nodes, not {site.node.op_type}")
            return Plan(remove_if_dead=True)  # once every DequantizeLinear reading it is a pair rewrite
        quantize = direction == "quantize"
        if site.node.op_type != ("QuantizeLinear" if quantize else "DequantizeLinear"):
            raise NotApplicable(f"the rule is for the other direction, not {site.node.op_type}")
        for attr in site.node.attribute:
            if attr.name not in ("axis",):
                raise NotApplicable(f"attribute {attr.name!r} is not emulated (blocked or float8 forms)")
        options_read = {"axis_default": 1, "require_zero_point": False, "float16": True, "bfloat16": True}
        q = read_qdq(site, options_read, quantize=quantize)
        if q.dtype == "int32" and not quantize:
            # onnxruntime: (float)(int32)(x - zp) * scale, x - zp wrapping around in int32 (1M values
            # measured); with a zero point of 0 that is Cast<f32>(x) * scale, which the emulation
            # computes. A non-zero int32 zero point (quantizers write 0 for biases) is not emulated.
            if q.zero_point and (q.zp_value is None or np.any(q.zp_value)):
                raise NotApplicable("int32 with a zero point other than a constant 0 is not emulated")
        elif q.dtype not in _TYPES:
            raise NotApplicable(f"{q.dtype} is not emulated (8- and 16-bit integer types, int32 dequantize)")
        if q.granularity != PER_TENSOR and q.rank is None:
            raise NotApplicable(f"per-axis {site.node.op_type} needs the rank of {q.x!r}; run shape inference first")
        scale_type = site.elem_type(q.scale)
        if scale_type is None and q.scale_value is not None:
            scale_type = onnx.helper.np_dtype_to_tensor_dtype(q.scale_value.dtype)
        if scale_type not in _FLOATS.values():
            raise NotApplicable(
                f"the scale's type {dtype_name(scale_type) if scale_type else 'unknown'} is not emulated"
            )
        float_type = scale_type
        if quantize:
            x_type = site.elem_type(q.x)
            if x_type is None:
                raise NotApplicable(f"the type of x {q.x!r} is not recorded; run shape inference first")
            float_type = x_type
        return Plan(
            min_opset=kernel_opsets.FORMS["float-emulation"],
            notes=(q.describe("kernel"),),
            data={"qdq": q, "float_type": float_type},
        )

    def _check_pair(self, site: Site) -> Plan:
        """DequantizeLinear(QuantizeLinear(x)), both float32 and 8/16-bit: the two in one float
        expression, with no integer tensor between them (the Casts to the quantized type and back
        are the identity on the integer-valued floats the Clip leaves)."""
        node = site.node
        if node.op_type != "DequantizeLinear":
            raise NotApplicable(f"the pair rule is anchored at DequantizeLinear, not {node.op_type}")
        producer = site.scope.producer(site.input(0))
        if producer is None or producer.op_type != "QuantizeLinear" or producer.domain not in ("", "ai.onnx"):
            raise NotApplicable("its input is not produced by a standard QuantizeLinear")
        quantize_site = Site(producer, site.scope, site.same_shape_ops)
        quantize_plan = self.check(quantize_site, {"direction": "quantize"})
        dequantize_plan = self.check(site, {"direction": "dequantize"})
        q, dq = quantize_plan.data["qdq"], dequantize_plan.data["qdq"]
        if _T.FLOAT not in (quantize_plan.data["float_type"],) or dequantize_plan.data["float_type"] != _T.FLOAT:
            raise NotApplicable("float16/bfloat16 pairs are emulated node by node (float-emulation-q, -dq)")
        if q.dtype != dq.dtype:
            raise NotApplicable(f"QuantizeLinear writes {q.dtype}, DequantizeLinear reads {dq.dtype}")
        reads = frozenset(n for n in (*producer.input, *node.input[1:]) if n)
        return Plan(
            min_opset=kernel_opsets.FORMS["float-emulation"],
            notes=(q.describe("kernel"), dq.describe("kernel")),
            data={"pair": (q, dq)},
            reads=reads,
        )

    def build(self, site: Site, emit: Emitter, options: Mapping[str, Any], plan: Plan) -> None:
        if options["direction"] == "remove":
            return  # nothing: the node is dead (the engine checked)
        if options["direction"] == "pair":
            q, dq = plan.data["pair"]
            scale, zp = _operands(emit, q)
            rounded = _round(emit, emit.op1("Div", [q.x, scale]), options["elementwise"])
            lo, hi = INTEGER_RANGES[q.dtype]
            value = emit.op1("Add", [rounded, zp]) if zp else rounded
            low = emit.const(np.float32(lo))
            clipped = emit.op1("Clip", [value, low, emit.const(np.float32(hi))], hint="Saturate")
            nan = _isnan(emit, rounded, options["elementwise"])
            chosen = emit.op1("Where", [nan, low, clipped], hint="NaNGivesQmin")
            scale, zp = _operands(emit, dq)
            # The Cast to an integer type and back turns -0.0 into +0.0; so does adding +0.0.
            value = emit.op1("Sub", [chosen, zp]) if zp else emit.op1("Add", [chosen, emit.const(np.float32(0.0))])
            emit.op1("Mul", [value, scale], site.node.output[0])
            return
        q = plan.data["qdq"]
        float_type = plan.data["float_type"]
        scale, zp = _operands(emit, q)
        if q.quantize:
            x = q.x if float_type == _T.FLOAT else emit.op1("Cast", [q.x], to=_T.FLOAT)
            rounded = _round(emit, emit.op1("Div", [x, scale]), options["elementwise"])
            lo, hi = INTEGER_RANGES[q.dtype]
            if float_type != _T.FLOAT16:  # float32; bfloat16 (no kernel) follows the definition
                value = emit.op1("Add", [rounded, zp]) if zp else rounded
                low = emit.const(np.float32(lo))
                clipped = emit.op1("Clip", [value, low, emit.const(np.float32(hi))], hint="Saturate")
                nan = _isnan(emit, rounded, options["elementwise"])
                chosen = emit.op1("Where", [nan, low, clipped], hint="NaNGivesQmin")
            else:
                chosen = _int32_path(emit, rounded, zp, lo, hi)
            emit.op1("Cast", [chosen], site.node.output[0], to=_TYPES[q.dtype])
            return
        value = emit.op1("Cast", [q.x], to=_T.FLOAT)
        if zp:
            value = emit.op1("Sub", [value, zp])
        if float_type == _T.FLOAT:
            emit.op1("Mul", [value, scale], site.node.output[0])
        else:
            emit.op1("Cast", [emit.op1("Mul", [value, scale])], site.node.output[0], to=float_type)


def _round(emit: Emitter, v: str, elementwise: str) -> str:
    """Round half to even of float32 ``v``: the Round op, or (``comparisons``) the Floor-based
    equivalent of the module docstring, equal in value (a zero's sign aside)."""
    if elementwise == "standard":
        return emit.op1("Round", [v])
    half, zero, one = (emit.const(np.float32(c)) for c in (0.5, 0.0, 1.0))
    f = emit.op1("Floor", [v])
    d = emit.op1("Sub", [v, f], hint="Fraction")
    halved = emit.op1("Floor", [emit.op1("Mul", [f, half])])
    odd = emit.op1("Sub", [f, emit.op1("Add", [halved, halved])], hint="Parity")
    tie = emit.op1("Where", [emit.op1("Equal", [d, half]), odd, zero], hint="TieToEven")
    step = emit.op1("Where", [emit.op1("Greater", [d, half]), one, tie], hint="Up")
    r = emit.op1("Add", [f, step])
    small = emit.op1("Less", [emit.op1("Abs", [v]), emit.const(np.float32(2.0**23))], hint="NotIntegral")
    return emit.op1("Where", [small, r, v], hint="Rounded")


def _isnan(emit: Emitter, x: str, elementwise: str) -> str:
    """IsNaN(x), or (``comparisons``) Not(Equal(x, x)): NaN is the one value unequal to itself."""
    if elementwise == "standard":
        return emit.op1("IsNaN", [x])
    return emit.op1("Not", [emit.op1("Equal", [x, x])], hint="IsNaN")


def _int32_path(emit: Emitter, rounded: str, zp: str, lo: int, hi: int) -> str:
    """onnxruntime's float16 QuantizeLinear converts ``nearbyint(x / s)`` to int32 first (NaN, +-inf
    and |r| >= 2^31 become INT_MIN) and adds the zero point in int32, wrapping around, before it
    saturates (measured: +inf gives qmin; with zero point -5, NaN gives qmax). Emulated exactly in
    float64, where every int32 value and every sum is exact."""
    r = emit.op1("Cast", [rounded], to=_T.DOUBLE)
    int_min, two31, two32 = (emit.const(np.float64(v)) for v in (-(2.0**31), 2.0**31, 2.0**32))
    fits = emit.op1("And", [emit.op1("GreaterOrEqual", [r, int_min]), emit.op1("Less", [r, two31])], hint="FitsInt32")
    value = emit.op1("Where", [fits, r, int_min], hint="ToInt32")
    if zp:
        value = emit.op1("Add", [value, emit.op1("Cast", [zp], to=_T.DOUBLE)])
        high = emit.op1("Sub", [value, two32], hint="WrapDown")
        low = emit.op1("Add", [value, two32], hint="WrapUp")
        value = emit.op1("Where", [emit.op1("GreaterOrEqual", [value, two31]), high, value])
        value = emit.op1("Where", [emit.op1("Less", [value, int_min]), low, value])
    return emit.op1("Clip", [value, emit.const(np.float64(lo)), emit.const(np.float64(hi))], hint="Saturate")


def _operands(emit: Emitter, q) -> tuple[str, str]:
    """Scale and zero point as float32, shaped to broadcast ('' for a zero point absent or all 0)."""
    out = []
    for name, value, shape in ((q.scale, q.scale_value, q.scale_shape), (q.zero_point, q.zp_value, q.zp_shape)):
        if not name:
            out.append("")
            continue
        if value is not None:
            if name == q.zero_point and not np.any(value):
                out.append("")
                continue
            as_float32 = np.asarray(value).astype(np.float32)  # exact: 8/16-bit integers, narrow floats
            if q.granularity == PER_TENSOR:
                out.append(emit.const(as_float32.reshape(())))
            else:
                out.append(emit.const(as_float32.reshape([-1] + [1] * (q.rank - 1 - q.axis % q.rank))))
            continue
        as_float = emit.op1("Cast", [name], to=_T.FLOAT)
        if q.granularity == PER_TENSOR:
            out.append(per_tensor_operand(emit, as_float, lambda: None, shape, scalar=True))
        else:
            out.append(broadcast_operand(emit, as_float, lambda: None, q.rank, q.axis % q.rank))
    return out[0], out[1]


register(FloatEmulationBuilder())
