"""QLinearConv, QLinearMatMul, com.microsoft QGemm (where the integer sums stay exact),
com.microsoft QLinearMul and QLinearGlobalAveragePool, bit for bit: the named form
``qlinear-exact`` (not the default, whose QDQ form backends run in 8 bits; this one computes in
float32).

onnxruntime's CPU kernels (read in its source: ``core/providers/cpu/quantization/
quantize_linear_matmul.cc``, ``qlinearconv.cc``, ``contrib_ops/cpu/quantization/qgemm.cc``, MLAS
``MlasRequantizeOutput`` and the GEMM output processors; what follows measured with 1.31.1)
compute each output in two steps:

1. the exact int32 sum ``acc = sum (a - za)(b - zb)`` (+ the int32 bias), MLAS's integer GEMM
   (zero points applied through row and column sums, exactly);
2. one float32 requantization: ``float(acc) * m``, clamped to ``[qmin - zy, qmax - zy]``, rounded
   half to even (``cvtps2dq``), ``+ zy``. The multiplier ``m`` is a float32 the kernel computes
   once per column or channel, in C++ float arithmetic, left to right: ``a_scale * b_scale[i] /
   y_scale`` (QLinearMatMul, QLinearConv), ``alpha * a_scale * b_scale[i] / y_scale`` (QGemm; without
   y_scale the output is ``float(acc) * m`` in float, ``m = alpha * a_scale * b_scale[i]``).

Both steps are standard ops: ``Cast``, ``Sub`` of the zero points and a float ``MatMul``/``Conv``/
``Gemm`` give ``acc`` exactly where every partial sum is an integer of magnitude at most 2^24
(``S = max over columns of sum |b - zb| * max |a - za| + max |bias| <= 2^24``, from the constant
weights, or for a QLinearMatMul of two run-time operands from the types and the recorded reduction
length), whatever order the float kernel sums in (the integer matmul rules' argument,
:mod:`onnx_qrewrite.rewriter.builders.integer_matmul`); then ``Mul`` by ``m`` (a float32 constant
computed here as the kernel computes it), ``Round`` (half to even), ``Add`` the output zero point,
``Clip`` to the type's range and ``Cast``. Rounding before clamping gives the same integer (the
clamp bounds are integers, rounding is monotonic). ``float(acc)`` is exact below 2^24 too.

Where it does not hold, the rule declines and the bounded QDQ rules (:mod:`.qoperator`) take the
node: sums that may pass 2^24; uint8 activations x int8 weights whose adjacent products can leave
int16 (onnxruntime's AVX2 kernel without VNNI saturates them, :mod:`onnx_qrewrite.rewriter.u8s8`;
the rule applies only where no pair can, so the result is the same on CPUs with and without VNNI)
or that are computed at run time; a multiplier that is not finite, or ``S * |m|`` at or beyond 2^30
(far from any real layer; kept away from int32 overflow in the kernel's conversion); QGemm with
y_scale but no y_zero_point (its kernel then writes float output through the uint8 path).

QLinearMul (``core/mlas/lib/qlmul.cpp``) is the same requantization of one exact product per element,
``(a - za)(b - zb)`` (at most 255^2), except that the output zero point is added in float32
*before* rounding (measured: the other order differs on a few of the 65,536 pairs of a type). The
others of the family stay bounded (:mod:`.qoperator`): QLinearAdd's x86 kernel is fixed-point
(integer multipliers and a rounding shift, chosen per CPU feature and scale ratio), QLinearSoftmax
a lookup table with ``floor(1 / y_scale)``, QLinearAveragePool float sums in the kernel's own order.
QLinearGlobalAveragePool is an integer sum per channel requantized by ``MlasRequantizeOutput``
with ``x_scale / (y_scale * float(image size))`` (float32): ``ReduceSum`` of the centred values and
the same requantization, where the image size is recorded.

The multiplier is the ``Mul``'s first input: onnxruntime's ConvMulFusion (default optimisation
level) folds a constant second input into the Conv's weights, after which the sums are no longer of
integers.

Measured bit for bit against onnxruntime 1.31.1 on an AVX2 CPU without VNNI, 1 and 2 threads
(``tests/test_lower_qlinear_integer.py``; a wider battery: ``tools/measure_qlinear_exact.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx

from onnx_qrewrite.rewriter import kernel_opsets
from onnx_qrewrite.rewriter.builders import Emitter, NoMatch, Plan, Site, register
from onnx_qrewrite.rewriter.builders import qoperator as qop
from onnx_qrewrite.rewriter.builders.contracts import CONTRACTS

__all__ = ["QLinearIntegerBuilder", "kernel_multiplier"]

_LIMIT = float(1 << 24)  # every integer up to 2^24 is a float32
_CONVERSION = float(1 << 30)  # |acc * m| kept well inside int32 (the kernel's float -> int32)
_T = onnx.TensorProto
_OUT_TYPES = {"uint8": _T.UINT8, "int8": _T.INT8}


def kernel_multiplier(a_scale: float, b_scales: np.ndarray, y_scale: float | None, alpha: float | None) -> np.ndarray:
    """The kernel's per-column float32 multiplier, rounded where it rounds: ``(alpha *) a_scale *
    b_scale[i] / y_scale``, left to right in float32 (C++ float arithmetic on x86-64)."""
    f = np.float32
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):  # inf/NaN: check() refuses them
        left = f(a_scale) if alpha is None else f(f(alpha) * f(a_scale))
        m = (left * b_scales.astype(f).reshape(-1)).astype(f)
        if y_scale is not None:
            m = (m / f(y_scale)).astype(f)
    return m


def _channel_axis(op: str, attrs: Mapping[str, Any]) -> int:
    if op == "QLinearConv":
        return 0
    if op == "QGemm":
        return 0 if attrs.get("transB") else 1
    return -1


def _centred(weights: np.ndarray, zp: np.ndarray | None, axis: int) -> np.ndarray:
    """``w - zw`` in int64, a per-column zero point along the columns' axis."""
    w = weights.astype(np.int64)
    if zp is None:
        return w
    z = zp.astype(np.int64).reshape(-1)
    if z.size == 1:
        return w - z[0]
    shape = [1] * w.ndim
    shape[axis] = z.size
    return w - z.reshape(shape)


class QLinearIntegerBuilder:
    """Replaces QLinearConv / QLinearMatMul / QGemm with the exact integer sum in float and the
    kernel's requantization."""

    name = "qlinear_integer"
    contract = CONTRACTS["qlinear_integer"]

    def quantized_dtype(self, site: Site) -> str | None:
        return qop._dtype(site, 0, 2) if site.node.op_type in qop.SPECS else None

    def check(self, site: Site, options: Mapping[str, Any]) -> Plan:
        op = options["op"]
        if site.node.op_type != op:
            raise NoMatch(f"the rule is for {op}, not {site.node.op_type}")
        spec = qop.SPECS[op]
        attrs = qop._read_attributes(site, op)
        inputs = [qop._read_operand(site, o) for o in spec.inputs]
        y_scale, y_zp, y_dtype = qop._read_output(site, spec, inputs[0][3])
        if op == "QLinearGlobalAveragePool":
            return _check_pool(site, attrs, inputs[0], (y_scale, y_zp, y_dtype))
        (a, a_scale, a_zp, a_dtype), (b, b_scale, _, _) = inputs
        if a_scale.value.size != 1:
            raise NoMatch(f"{op}: the scale of input {a!r} must have one element (onnxruntime's kernel requires it)")
        if op == "QLinearMul":
            return _check_mul(site, inputs, (y_scale, y_zp, y_dtype))
        if attrs.get("channels_last"):  # com.microsoft's channels-last QLinearConv: the bounded rule's
            raise NoMatch(f"{op} with channels_last = 1 is not rewritten exactly (qop-conv takes it)")
        if op == "QGemm" and y_scale is not None and not site.input(spec.out_zero_point):
            raise NoMatch("QGemm with y_scale but no y_zero_point: onnxruntime's kernel writes float output there")
        lo, hi = qop._RANGES[a_dtype]
        za = int(a_zp.reshape(-1)[0]) if a_zp is not None else 0
        a_max = max(hi - za, za - lo)
        weights = site.constant(b)
        axis = _channel_axis(op, attrs)
        bias_name = site.input(qop._BIAS[op]) if op in qop._BIAS else ""
        bias = site.constant(bias_name) if bias_name else None
        if bias_name and bias is None:
            raise NoMatch(f"the int32 bias {bias_name!r} is computed at run time; only a constant bias is rewritten")
        total = _sum_bound(site, op, attrs, inputs, weights, a_max) + (
            float(np.max(np.abs(bias.astype(np.float64)), initial=0.0)) if bias is not None else 0.0
        )
        if total > _LIMIT:
            raise NoMatch(
                f"the integer sums of {site.label} may reach {total:.4g}, beyond 2^24: float32 sums are not "
                "provably exact (the bounded rule takes it)"
            )
        alpha = float(attrs["alpha"]) if op == "QGemm" else None
        m = kernel_multiplier(
            float(a_scale.value.reshape(-1)[0]),
            b_scale.value,
            None if y_scale is None else float(y_scale.reshape(-1)[0]),
            alpha,
        )
        if not np.isfinite(m).all():
            raise NoMatch(f"the requantization multiplier of {site.label} is not finite")
        if y_scale is not None and total * float(np.max(np.abs(m))) >= _CONVERSION:
            raise NoMatch(f"{site.label}: sums times the multiplier may reach 2^30 (kept clear of int32 overflow)")
        data = {"attrs": attrs, "inputs": inputs, "out": (y_zp, y_dtype, y_scale is None), "m": m, "axis": axis}
        note = f"exact integer sums (at most {total:.4g} <= 2^24) and the kernel's float32 requantization"
        return Plan(min_opset=kernel_opsets.FORMS["qlinear-integer"], notes=(note,), data=data)

    def build(self, site: Site, emit: Emitter, options: Mapping[str, Any], plan: Plan) -> None:
        op = options["op"]
        if op in _OTHERS:
            _OTHERS[op](site, emit, plan)
            return
        attrs = plan.data["attrs"]
        (a, _, a_zp, _), (b, _, b_zp, _) = plan.data["inputs"]
        y_zp, y_dtype, float_out = plan.data["out"]
        axis = plan.data["axis"]
        x = _centre(emit, a, a_zp)
        weights = site.constant(b)
        if weights is not None:
            w = emit.const(_centred(weights, b_zp, axis).astype(np.float32))
        else:  # QLinearMatMul of two run-time operands: per-column zero points along the last axis
            w = _centre(emit, b, b_zp)
        m: np.ndarray = plan.data["m"]
        if op == "QLinearConv":
            inputs = [x, w]
            if site.input(8):
                inputs.append(emit.const(np.asarray(site.constant(site.input(8))).astype(np.float32)))
            conv_attrs = {k: v for k, v in attrs.items() if k != "channels_last" and v is not None}
            acc = emit.op1("Conv", inputs, **conv_attrs)
            rank = weights.ndim if weights is not None else 2
            m_shape: tuple[int, ...] = (m.size, *([1] * (rank - 2))) if m.size > 1 else ()
        elif op == "QGemm":
            inputs = [x, w]
            if site.input(6):
                inputs.append(emit.const(np.asarray(site.constant(site.input(6))).astype(np.float32)))
            acc = emit.op1(
                "Gemm", inputs, alpha=1.0, beta=1.0, transA=int(attrs["transA"]), transB=int(attrs["transB"])
            )
            m_shape = (m.size,) if m.size > 1 else ()
        else:
            acc = emit.op1("MatMul", [x, w])
            m_shape = (m.size,) if m.size > 1 else ()
        out = site.node.output[0]
        # The multiplier first: onnxruntime's ConvMulFusion (default optimisation level) folds a Mul
        # whose *second* input is a constant into the Conv's weights, and w * m is no longer an
        # integer: the sums then round (measured: most pre-rounding values an ulp or so off).
        scaled = emit.op1("Mul", [emit.const(m.reshape(m_shape)), acc], out if float_out else None)
        if float_out:
            return
        q = emit.op1("Round", [scaled])
        if y_zp is not None and int(y_zp.reshape(-1)[0]) != 0:
            q = emit.op1("Add", [q, emit.const(np.float32(y_zp.reshape(-1)[0]))])
        lo, hi = qop._RANGES[y_dtype]
        q = emit.op1("Clip", [q, emit.const(np.float32(lo)), emit.const(np.float32(hi))])
        emit.op1("Cast", [q], out, to=_OUT_TYPES[y_dtype])


def _check_mul(site: Site, inputs: list, out: tuple) -> Plan:
    """com.microsoft QLinearMul: MLAS multiplies the centred int32 values exactly (at most 255^2 in
    magnitude, exact in float32 too), converts, multiplies by ``a_scale * b_scale / y_scale`` in
    float32, adds the output zero point *in float*, rounds half to even and saturates (measured:
    rounding first and adding the zero point after differs on a few values)."""
    (_, a_scale, a_zp, a_dtype), (b, b_scale, b_zp, b_dtype) = inputs
    y_scale, y_zp, y_dtype = out
    if b_scale.value.size != 1:
        raise NoMatch(f"QLinearMul takes per-tensor scales only; the scale of {b!r} has more than one element")
    largest = 1.0
    for zp, dtype in ((a_zp, a_dtype), (b_zp, b_dtype)):
        lo, hi = qop._RANGES[dtype]
        z = int(zp.reshape(-1)[0]) if zp is not None else 0
        largest *= max(hi - z, z - lo)
    m = kernel_multiplier(float(a_scale.value.reshape(-1)[0]), b_scale.value, float(y_scale.reshape(-1)[0]), None)
    if not np.isfinite(m).all():
        raise NoMatch(f"the requantization multiplier of {site.label} is not finite")
    if largest * float(np.abs(m[0])) + 256 >= _CONVERSION:
        raise NoMatch(f"{site.label}: products times the multiplier may reach 2^30 (kept clear of int32 overflow)")
    data = {"inputs": inputs, "out": (y_zp, y_dtype, False), "m": m}
    note = "exact integer products and the kernel's float32 requantization (zero point added before rounding)"
    return Plan(min_opset=kernel_opsets.FORMS["qlinear-integer"], notes=(note,), data=data)


def _build_mul(site: Site, emit: Emitter, plan: Plan) -> None:
    (a, _, a_zp, _), (b, _, b_zp, _) = plan.data["inputs"]
    y_zp, y_dtype, _ = plan.data["out"]
    product = emit.op1("Mul", [_centre(emit, a, a_zp), _centre(emit, b, b_zp)])
    q = emit.op1("Mul", [product, emit.const(plan.data["m"].reshape(()))])
    if y_zp is not None and int(y_zp.reshape(-1)[0]) != 0:
        q = emit.op1("Add", [q, emit.const(np.float32(y_zp.reshape(-1)[0]))])
    lo, hi = qop._RANGES[y_dtype]
    q = emit.op1("Clip", [emit.op1("Round", [q]), emit.const(np.float32(lo)), emit.const(np.float32(hi))])
    emit.op1("Cast", [q], site.node.output[0], to=_OUT_TYPES[y_dtype])


def _check_pool(site: Site, attrs: Mapping[str, Any], operand: tuple, out: tuple) -> Plan:
    """com.microsoft QLinearGlobalAveragePool (MLAS ``MlasQLinearGlobalAveragePoolNchw``/``Nhwc``):
    the int32 sum of each channel's values minus ``zx * ImageSize``, requantized by
    ``MlasRequantizeOutput`` with the multiplier ``x_scale / (y_scale * float(ImageSize))`` (float32,
    as written). The image size must be recorded (the multiplier is a constant); the kernel refuses
    a multiplier outside [2^-32, 256) (the original fails: nothing to reproduce)."""
    x, x_scale, x_zp, x_dtype = operand
    y_scale, y_zp, y_dtype = out
    if x_scale.value.size != 1:
        raise NoMatch("QLinearGlobalAveragePool takes a per-tensor scale only")
    shape = qop.value_shape(site.scope, x, site.same_shape_ops)
    if shape is None or len(shape) < 3:
        raise NoMatch(f"the rank of {x!r} is not recorded: the image size (the multiplier) is not known")
    axes = list(range(1, len(shape) - 1)) if attrs["channels_last"] else list(range(2, len(shape)))
    dims = [shape[a] for a in axes]
    if any(d is None for d in dims):
        raise NoMatch(f"the spatial size of {x!r} is not recorded: the multiplier depends on it")
    image = int(np.prod([d for d in dims if d is not None]))
    lo, hi = qop._RANGES[x_dtype]
    zx = int(x_zp.reshape(-1)[0]) if x_zp is not None else 0
    total = float(image) * max(hi - zx, zx - lo)
    if total > _LIMIT:
        raise NoMatch(f"the sums of {site.label} may reach {total:.4g}, beyond 2^24: float32 sums are not exact")
    f = np.float32
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):  # inf/NaN: refused below
        m = f(f(x_scale.value.reshape(-1)[0]) / f(f(y_scale.reshape(-1)[0]) * f(image)))
    if not 2.0**-32 <= float(m) < 256.0:
        raise NoMatch(
            f"{site.label}: onnxruntime's kernel refuses the multiplier {float(m):.3g} (outside [2^-32, 256))"
        )
    if total * float(m) + 256 >= _CONVERSION:
        raise NoMatch(f"{site.label}: sums times the multiplier may reach 2^30 (kept clear of int32 overflow)")
    data = {"inputs": [operand], "out": (y_zp, y_dtype, False), "m": np.asarray(m).reshape(1), "axes": axes}
    note = f"exact integer sums of {image} values and the kernel's float32 requantization"
    opset = max(kernel_opsets.FORMS["qlinear-integer"], kernel_opsets.OP_VERSIONS["reduce-sum-axes-input"])
    return Plan(min_opset=opset, notes=(note,), data=data)


def _build_pool(site: Site, emit: Emitter, plan: Plan) -> None:
    (x, _, x_zp, _) = plan.data["inputs"][0]
    y_zp, y_dtype, _ = plan.data["out"]
    axes = emit.const(np.asarray(plan.data["axes"], np.int64))
    total = emit.op1("ReduceSum", [_centre(emit, x, x_zp), axes], keepdims=1)
    _requantize(emit, site, emit.op1("Mul", [emit.const(plan.data["m"].reshape(())), total]), y_zp, y_dtype)


def _requantize(emit: Emitter, site: Site, scaled: str, y_zp: np.ndarray | None, y_dtype: str) -> None:
    """MlasRequantizeOutput after the multiplier: round half to even, + zp, saturate, Cast."""
    q = emit.op1("Round", [scaled])
    if y_zp is not None and int(y_zp.reshape(-1)[0]) != 0:
        q = emit.op1("Add", [q, emit.const(np.float32(y_zp.reshape(-1)[0]))])
    lo, hi = qop._RANGES[y_dtype]
    q = emit.op1("Clip", [q, emit.const(np.float32(lo)), emit.const(np.float32(hi))])
    emit.op1("Cast", [q], site.node.output[0], to=_OUT_TYPES[y_dtype])


def _centre(emit: Emitter, x: str, zp: np.ndarray | None) -> str:
    """``Cast<float>(x) - zp``: a per-tensor zero point, or one per column of the last axis."""
    xf = emit.op1("Cast", [x], to=_T.FLOAT)
    if zp is None or not np.any(zp):
        return xf
    z = zp.astype(np.float32).reshape(-1)
    return emit.op1("Sub", [xf, emit.const(z if z.size > 1 else z[0])])


def _sum_bound(
    site: Site, op: str, attrs: Mapping[str, Any], inputs: list, weights: np.ndarray | None, a_max: int
) -> float:
    """The largest magnitude any partial sum can take (without the bias): per column, the weights'
    L1 norm times the activation's largest centred magnitude; for two run-time operands, K times
    both types' largest centred magnitudes. Raises NoMatch where onnxruntime's uint8 x int8 kernel
    could saturate a pair of products (x86 without VNNI), so the result is every CPU's."""
    (a, _, _, a_dtype), (b, _, b_zp, b_dtype) = inputs
    axis = _channel_axis(op, attrs)
    if weights is None:
        if op != "QLinearMatMul":
            raise NoMatch(f"{op}: the weights {b!r} are computed at run time")
        if a_dtype == "uint8" and b_dtype == "int8":
            raise NoMatch(
                "uint8 x int8 operands computed at run time: onnxruntime's kernel on x86 CPUs without AVX-VNNI may "
                "saturate pairs of products to int16"
            )
        k = qop._dim(site, b, -2) if (qop._rank(site, b) or 0) >= 2 else qop._dim(site, a, -1)
        if k is None:
            raise NoMatch(f"the reduction length of {site.label} is not recorded: the sums cannot be bounded by 2^24")
        blo, bhi = qop._RANGES[b_dtype]
        zb = b_zp.reshape(-1).astype(np.int64) if b_zp is not None else np.zeros(1, np.int64)
        return float(k) * a_max * max(bhi - int(zb.min()), int(zb.max()) - blo)
    excess = qop._pair_excess(op, weights, axis, a_dtype, b_dtype)
    if excess.any():
        raise NoMatch(
            f"uint8 activations x int8 weights {b!r}: onnxruntime's kernel on x86 CPUs without AVX-VNNI can saturate "
            f"a pair of products to int16 here (up to {int(excess.max())}): not the same result on every CPU"
        )
    centred = np.abs(_centred(weights, b_zp, axis))
    if centred.ndim == 1:  # a vector B: one column
        return float(centred.sum()) * a_max
    # Per column (the axis the scales run along), the sum over the reduction; batched MatMul
    # weights: per (batch, column), the worst.
    reduce = (1 - axis % 2,) if op == "QGemm" else (-2,) if op == "QLinearMatMul" else tuple(range(1, centred.ndim))
    return float(np.max(centred.sum(axis=reduce), initial=0)) * a_max


#: The ops that are not an integer GEMM: their builders.
_OTHERS = {"QLinearMul": _build_mul, "QLinearGlobalAveragePool": _build_pool}

register(QLinearIntegerBuilder())
