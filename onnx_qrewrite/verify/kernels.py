"""Reference kernels for the vendor ops, in plain numpy, written from NUMERICS.md.

These are the "original" side of every verification: they must compute what the vendor's own
runtime computes, not what its documentation says, and they must not share code with the lowering
rules (the same code on both sides of a comparison proves nothing).

Measured semantics reproduced here (AMD Quark 0.13 CPU kernels, oneDNN):

* ``com.amd.quark`` ExtendedQuantizeLinear / ``com.vai.quantize`` VitisQuantizeLinear

  - the output type is the zero point's type; a scale with one element is per-tensor, otherwise
    it is 1-D along ``axis``, and a missing ``axis`` attribute means **0** (not the documented 1);
  - integer types: ``saturate(int64(nearbyint(x / scale)) + zp)``, the division in float32,
    rounding half to even. Where ``x / scale`` is NaN, infinite or at least 2**63 in magnitude the
    kernel's float->int64 conversion gives INT64_MIN (x86 "integer indefinite") and the zero point
    is added to that with int64 wrap-around: +inf gives qmin, and -1.65e38 / 2 with zp -5 gives
    qmax (both in the vectors; NUMERICS.md's plain "saturate" holds for in-range values only);
  - bfloat16: ``bf16(x / scale + float(zp))``, round to nearest even, no saturation;
  - float16: scale and zero point are **ignored**: ``f16(clip(x, -65504, 65504))``.

* ExtendedDequantizeLinear / VitisDequantizeLinear

  - integer types: ``(float)((int64)x - zp) * scale`` in float32;
  - bfloat16: ``(float(x) - float(zp)) * scale`` in float32;
  - float16: a plain cast to float32 (scale and zero point ignored).

* oneDNN ``DynamicDequantize`` (any non-standard domain): ``dst = (src - zps) * scales``, the
  difference taken in integers, converted to float32 and multiplied by the float32 scale; a
  bfloat16/float16 scale makes a dst of that type (computed in float32, then rounded to nearest
  even). ``qtype`` is ``per_tensor`` or ``per_channel`` (along ``axis``, default 1).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = [
    "DYNAMIC_DEQUANTIZE_DEFAULT_AXIS",
    "QUARK_DEFAULT_AXIS",
    "dynamic_dequantize",
    "quark_dequantize",
    "quark_quantize",
]

#: Axis the Quark kernel uses when the node has no ``axis`` attribute (measured; the docs say 1).
QUARK_DEFAULT_AXIS = 0
#: oneDNN DynamicDequantize's documented default channel axis.
DYNAMIC_DEQUANTIZE_DEFAULT_AXIS = 1

_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
_FLOAT16 = np.dtype(np.float16)
_FLOAT16_MAX = np.float32(65504.0)


def _broadcastable(param: np.ndarray, ndim: int, axis: int, what: str) -> np.ndarray:
    """A per-tensor parameter as a scalar, a per-axis one reshaped to broadcast along ``axis``."""
    if param.size == 1:
        return param.reshape(())
    if param.ndim != 1:
        raise ValueError(f"{what} must be a scalar, one element or 1-D, got shape {param.shape}")
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of range for an input of rank {ndim}")
    shape = [1] * ndim
    shape[axis % ndim] = param.shape[0]
    return param.reshape(shape)


def _check_axis_length(param: np.ndarray, x: np.ndarray, axis: int, what: str) -> None:
    if param.size != 1 and x.shape[axis % x.ndim] != param.shape[0]:
        raise ValueError(
            f"{what} has {param.shape[0]} elements but the input has {x.shape[axis % x.ndim]} along axis {axis}"
        )


def quark_quantize(
    x: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, axis: int = QUARK_DEFAULT_AXIS
) -> np.ndarray:
    """ExtendedQuantizeLinear as Quark's CPU kernel computes it; the result has ``zero_point``'s dtype."""
    x = np.asarray(x, dtype=np.float32)
    scale = np.asarray(scale, dtype=np.float32)
    zero_point = np.asarray(zero_point)
    if zero_point.size != scale.size:
        raise ValueError(f"scale has {scale.size} elements but the zero point has {zero_point.size}")
    out_dtype = zero_point.dtype
    if scale.size != 1:
        _check_axis_length(scale, x, axis, "scale")
    s = _broadcastable(scale, x.ndim, axis, "scale")
    zp = _broadcastable(zero_point, x.ndim, axis, "zero point")

    if out_dtype == _FLOAT16:
        # The CPU kernel ignores scale and zero point for float16 (measured).
        return np.clip(x, -_FLOAT16_MAX, _FLOAT16_MAX).astype(np.float16)

    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        scaled = np.divide(x, s, dtype=np.float32)  # float32 division, never a reciprocal multiply
        if out_dtype == _BFLOAT16:
            # bf16(x / scale + float(zp)): float32 sum, then one round to nearest even, no saturation.
            return (scaled + zp.astype(np.float32)).astype(ml_dtypes.bfloat16)
        if out_dtype.kind not in "iu" or out_dtype.itemsize > 4:
            raise ValueError(f"ExtendedQuantizeLinear has no kernel for zero point type {out_dtype}")
        info = np.iinfo(out_dtype)
        rounded = np.rint(scaled)  # half to even, like nearbyint in the default rounding mode
        # The kernel converts to int64 the x86 way: NaN, inf and |v| >= 2**63 become INT64_MIN
        # (the "integer indefinite" value); the zero point is then added in int64, wrapping.
        in_range = np.abs(rounded) < np.float32(2.0**63)  # False for NaN and inf too
        as_int64 = np.where(in_range, np.where(in_range, rounded, 0).astype(np.int64), np.iinfo(np.int64).min)
        total = as_int64 + zp.astype(np.int64)  # numpy integer arrays wrap like the kernel
        saturated = np.clip(total, info.min, info.max)
    return saturated.astype(out_dtype)


def quark_dequantize(
    x: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, axis: int = QUARK_DEFAULT_AXIS
) -> np.ndarray:
    """ExtendedDequantizeLinear as Quark's CPU kernel computes it; always float32."""
    x = np.asarray(x)
    scale = np.asarray(scale, dtype=np.float32)
    zero_point = np.asarray(zero_point)
    if zero_point.size != scale.size:
        raise ValueError(f"scale has {scale.size} elements but the zero point has {zero_point.size}")
    if x.dtype == _FLOAT16:
        return x.astype(np.float32)  # a plain cast: scale and zero point ignored (measured)
    if scale.size != 1:
        _check_axis_length(scale, x, axis, "scale")
    s = _broadcastable(scale, x.ndim, axis, "scale")
    zp = _broadcastable(zero_point, x.ndim, axis, "zero point")
    with np.errstate(over="ignore", invalid="ignore"):
        if x.dtype == _BFLOAT16:
            return (x.astype(np.float32) - zp.astype(np.float32)) * s
        if x.dtype.kind not in "iu" or x.dtype.itemsize > 4:
            raise ValueError(f"ExtendedDequantizeLinear has no kernel for input type {x.dtype}")
        difference = x.astype(np.int64) - zp.astype(np.int64)
        return difference.astype(np.float32) * s


def dynamic_dequantize(
    src: np.ndarray,
    scales: np.ndarray,
    zps: np.ndarray | None = None,
    qtype: str = "per_tensor",
    axis: int = DYNAMIC_DEQUANTIZE_DEFAULT_AXIS,
) -> np.ndarray:
    """oneDNN DynamicDequantize: ``(src - zps) * scales``; the result has ``scales``'s dtype."""
    src = np.asarray(src)
    scales = np.asarray(scales)
    if src.dtype.kind not in "iu" or src.dtype.itemsize > 4:
        raise ValueError(f"DynamicDequantize has no kernel for src type {src.dtype}")
    if qtype not in ("per_tensor", "per_channel"):
        raise ValueError(f"DynamicDequantize qtype must be per_tensor or per_channel, got {qtype!r}")
    if qtype == "per_tensor" and scales.size != 1:
        raise ValueError(f"per_tensor DynamicDequantize needs one scale, got {scales.size}")
    if qtype == "per_channel":
        _check_axis_length(scales, src, axis, "scales")
    s = _broadcastable(scales, src.ndim, axis, "scales").astype(np.float32)
    difference = src.astype(np.int64)
    if zps is not None:
        zps = np.asarray(zps)
        if zps.size not in (1, scales.size):
            raise ValueError(f"zps has {zps.size} elements but scales has {scales.size}")
        difference = difference - _broadcastable(zps, src.ndim, axis, "zps").astype(np.int64)
    with np.errstate(over="ignore"):
        dst = difference.astype(np.float32) * s
    return dst if scales.dtype == np.float32 else dst.astype(scales.dtype)
