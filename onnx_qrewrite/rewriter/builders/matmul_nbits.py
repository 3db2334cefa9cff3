"""onnxruntime's ``com.microsoft`` MatMulNBits (weight-only blocked quantization) -> standard ONNX.

``MatMulNBits(A, B, scales[, zero_points][, g_idx][, bias])`` with attributes ``K``, ``N``,
``bits`` (2, 4 or 8 on CPU: onnxruntime 1.31.1 refuses any other value when the session is created,
measured for 1-8), ``block_size`` (a power of two >= 16) and ``accuracy_level``. ``B`` holds
``[N, ceil(K / block_size), block_size * bits / 8]`` bytes, values packed low bits first; scales
are ``N * n_blocks`` floats; zero points are either packed like ``B`` (``N * ceil(n_blocks * bits /
8)`` uint8, low bits first; absent means ``2^(bits - 1)``: 2, 8 or 128) or floats, one per block
(2- and 4-bit only: 8-bit fails at run time). What onnxruntime 1.31's CPU kernel computes
(measured, tests/test_lower_matmul_nbits.py):

- the weight ``w[k, n] = (q - zp) * scale`` in float32 for integer zero points, and
  ``q * scale + (-(scale * zp))`` for float ones: with an identity matrix as A (every sum exact),
  the kernel's output equals these weights bit for bit, for bits 2, 4 and 8, block sizes 16-256,
  every kind of zero point and K not a multiple of the block size;
- then a float32 GEMM whose summation order over K is MLAS's own (blocked SQNBit kernels, or
  dequantize-then-SGEMM): it matches a standard ``MatMul`` bit for bit in most measured cases with
  K <= 256, not beyond. So the rewrite is **bounded**: the same weights, and the same sum of the
  same products in another order, which differs by at most ``2 * gamma(K) * sum_k |a_k * w_k|``
  (``gamma(K) = K * 2^-24 / (1 - K * 2^-24)``, the standard bound for float32 recursive sums);
- ``accuracy_level = 4`` with integer zero points: where the CPU has the kernels (this one does),
  A itself is quantized to int8 per block and the products summed in integers (~0.5 % relative
  difference from the float32 product, measured). The float rewrite is then **approximate**
  (option ``int8_activations``), run only when asked;
- ``g_idx`` (act-order) takes a separate naive kernel that ignores uint8 zero points; not lowered.

Forms (option ``form``)::

    blocked_dequantize:  MatMul(A, DequantizeLinear(Wq[K, N], scale[nb, N], zp[nb, N], axis=0, block_size))
                         Wq uint2/uint4/uint8 with the zero points as stored, or int2/int4/int8 holding
                         q - 2^(bits-1) with no zero point when the node has none (opset 21; 25 for 2-bit,
                         whose types DequantizeLinear takes from 25)
    unpacked:            MatMul(A, Slice(Reshape(Mul(Sub(Cast<f32>(Wq[nb, bs, N]), zp[nb, 1, N]), scale[nb, 1, N]))))
                         Wq one uint8 per weight, any opset from 10; float zero points:
                         Add(Mul(Cast<f32>(Wq), scale), -(scale * zp))

A ``bias`` becomes an ``Add`` after the MatMul. The weights stay quantized in the rewritten model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np
import onnx

from onnx_qrewrite._dataclass import dataclass
from onnx_qrewrite.rewriter import kernel_opsets
from onnx_qrewrite.rewriter.builders import Emitter, NoMatch, Plan, Site, register
from onnx_qrewrite.rewriter.builders.contracts import CONTRACTS
from onnx_qrewrite.rewriter.builders.contracts import NBITS_BLOCKED as _BLOCKED
from onnx_qrewrite.rewriter.graph import dtype_name

__all__ = ["MatMulNBitsBuilder", "dequantized_weights", "pack", "unpack"]

_T = onnx.TensorProto
#: The element types of the blocked form per ``bits``: (signed, for q - 2^(bits-1) without zero
#: points; unsigned, with the stored zero points). The bits onnxruntime's CPU kernel takes.
_TYPES: dict[int, tuple[Any, Any]] = {
    2: (ml_dtypes.int2, ml_dtypes.uint2),
    4: (ml_dtypes.int4, ml_dtypes.uint4),
    8: (np.int8, np.uint8),
}


def unpack(packed: np.ndarray, bits: int, rows: int, count: int) -> np.ndarray:
    """``rows`` rows of ``count`` ``bits``-bit values from bytes packed low bits first (uint8)."""
    data = np.ascontiguousarray(packed, np.uint8).reshape(rows, -1)
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    values = np.stack([(data >> (bits * i)) & mask for i in range(per_byte)], axis=-1).reshape(rows, -1)
    if values.shape[1] < count:
        raise ValueError(f"{values.shape[1]} values per row, {count} needed")
    return values[:, :count].astype(np.uint8)


def pack(values: np.ndarray, bits: int) -> np.ndarray:
    """The inverse of :func:`unpack` for one row per leading index (pads each row with zeros)."""
    values = np.asarray(values, np.uint8)
    rows = values.reshape(values.shape[0], -1)
    per_byte = 8 // bits
    width = -(-rows.shape[1] // per_byte) * per_byte
    padded = np.zeros((rows.shape[0], width), np.uint8)
    padded[:, : rows.shape[1]] = rows
    grouped = padded.reshape(rows.shape[0], -1, per_byte)
    return np.bitwise_or.reduce(grouped << (bits * np.arange(per_byte, dtype=np.uint8)), axis=-1).astype(np.uint8)


@dataclass(frozen=True)
class _Read:
    """One MatMulNBits node as its kernel sees it (the constants unpacked)."""

    k: int
    n: int
    bits: int
    block_size: int
    n_blocks: int
    q: np.ndarray  # uint8 [N, n_blocks * block_size], one value per weight
    scale: np.ndarray  # float32 [N, n_blocks]
    zp: np.ndarray | None  # uint8 or float32 [N, n_blocks]; None: the default 2^(bits-1)
    bias: str
    accuracy_level: int
    #: A, scales (and bias, float zero points, Y) are float16; computed in float32 as the kernel does.
    float16: bool = False

    @property
    def float_zero_point(self) -> bool:
        return self.zp is not None and self.zp.dtype == np.float32


def _attr_int(site: Site, name: str, default: int | None = None) -> int:
    value = site.attribute(name, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise NoMatch(f"malformed node: attribute {name!r} is {'missing' if value is None else repr(value)}")
    return value


def _read(site: Site) -> _Read:
    node = site.node
    if len(node.input) < 3 or not all(node.input[:3]) or len(node.output) != 1:
        raise NoMatch("malformed node: MatMulNBits takes A, B, scales[, zero_points, g_idx, bias] and gives Y")
    site.no_unknown_attributes({"K", "N", "bits", "block_size", "accuracy_level"})
    k, n = _attr_int(site, "K"), _attr_int(site, "N")
    bits, block_size = _attr_int(site, "bits", 4), _attr_int(site, "block_size")
    accuracy_level = _attr_int(site, "accuracy_level", 0)
    if bits not in _TYPES:
        raise NoMatch(f"bits={bits}: onnxruntime's CPU kernel takes 2, 4 and 8 only (nothing to be exact against)")
    if block_size < 16 or block_size & (block_size - 1):
        raise NoMatch(f"malformed node: block_size {block_size} is not a power of two >= 16")
    if k <= 0 or n <= 0:
        raise NoMatch(f"malformed node: K={k}, N={n}")
    if site.input(4):
        raise NoMatch(f"g_idx {site.input(4)!r} (act-order): its kernel ignores uint8 zero points; not lowered")
    a_type = site.elem_type(site.input(0))
    if a_type is not None and a_type not in (_T.FLOAT, _T.FLOAT16):
        raise NoMatch(f"A {site.input(0)!r} is {dtype_name(a_type)}; float32 and float16 are lowered")
    n_blocks = -(-k // block_size)
    b = site.constant(site.input(1))
    if b is None:
        raise NoMatch(f"B {site.input(1)!r} is computed at run time; only constant weights are lowered")
    blob = block_size * bits // 8
    if b.dtype != np.uint8 or b.size != n * n_blocks * blob:
        raise NoMatch(
            f"malformed node: B {site.input(1)!r} is {b.dtype} {list(b.shape)}, "
            f"expected uint8 [{n}, {n_blocks}, {blob}]"
        )
    scale = site.constant(site.input(2))
    if scale is None:
        raise NoMatch(f"scales {site.input(2)!r} are computed at run time; only constants are lowered")
    if scale.dtype not in (np.float32, np.float16) or scale.size != n * n_blocks:
        raise NoMatch(
            f"malformed node: scales {site.input(2)!r} are {scale.dtype} with {scale.size} elements, "
            f"expected float32 or float16 with N * n_blocks = {n * n_blocks}"
        )
    float16 = scale.dtype == np.float16
    if (a_type == _T.FLOAT16) != float16 and a_type is not None:
        raise NoMatch(f"malformed node: A is {dtype_name(a_type)}, scales are {scale.dtype}")
    zp: np.ndarray | None = None
    if site.input(3):
        raw = site.constant(site.input(3))
        if raw is None:
            raise NoMatch(f"zero points {site.input(3)!r} are computed at run time; only constants are lowered")
        if raw.dtype == np.uint8:
            per_row = -(-n_blocks * bits // 8)
            if raw.size != n * per_row:
                raise NoMatch(
                    f"malformed node: zero points {site.input(3)!r} have {raw.size} bytes, expected {n * per_row}"
                )
            zp = unpack(raw, bits, n, n_blocks)
        elif raw.dtype == scale.dtype and bits in (2, 4):
            if raw.size != n * n_blocks:
                raise NoMatch(
                    f"malformed node: zero points {site.input(3)!r} have {raw.size} elements, not {n * n_blocks}"
                )
            zp = raw.reshape(n, n_blocks).astype(np.float32)  # float16 ones: the kernel widens them
        else:
            raise NoMatch(f"zero points {site.input(3)!r} of type {raw.dtype} with bits={bits} are not lowered")
    bias = site.input(5)
    if bias:
        b_type = site.elem_type(bias)
        if b_type is not None and b_type != (_T.FLOAT16 if float16 else _T.FLOAT):
            raise NoMatch(f"malformed node: bias {bias!r} is {dtype_name(b_type)}, scales are {scale.dtype}")
    q = unpack(b, bits, n, n_blocks * block_size)
    # float16 scales: the CPU kernel (x86) widens A, scales, zero points and bias to float32, computes
    # in float32 and rounds the result to float16 (measured).
    scale32 = scale.reshape(n, n_blocks).astype(np.float32)
    return _Read(k, n, bits, block_size, n_blocks, q, scale32, zp, bias, accuracy_level, float16)


def dequantized_weights(
    attributes: Mapping[str, Any], packed: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None
) -> np.ndarray:
    """The kernel's float32 weights ``[K, N]`` from a node's attributes and constant inputs (what
    ``verify`` needs for the per-element bound, verify/element_bounds.py): ``(q - zp) * scale``
    for integer zero points (default 2^(bits-1)), ``q * scale + (-(scale * zp))`` for float ones."""
    k, n = int(attributes["K"]), int(attributes["N"])
    bits, block_size = int(attributes.get("bits", 4)), int(attributes["block_size"])
    n_blocks = -(-k // block_size)
    q = unpack(packed, bits, n, n_blocks * block_size).astype(np.float32).reshape(n, n_blocks, block_size)
    scale = np.asarray(scales).astype(np.float32).reshape(n, n_blocks, 1)
    if zero_points is not None and zero_points.dtype != np.uint8:
        zp = np.asarray(zero_points).astype(np.float32).reshape(n, n_blocks, 1)
        w = q * scale + (-(scale * zp))
    else:
        offset = (
            np.full((n, n_blocks, 1), 1 << (bits - 1), np.float32)
            if zero_points is None
            else unpack(zero_points, bits, n, n_blocks).astype(np.float32).reshape(n, n_blocks, 1)
        )
        w = (q - offset) * scale
    # A transposed view, not a copy: numpy copies a transpose of 2048 x 2048 float32 at 37 ms, its
    # consumers take either layout (the per-element bound's matrix product, the probe's selector).
    return w.reshape(n, -1)[:, :k].T


class MatMulNBitsBuilder:
    """Replaces com.microsoft MatMulNBits with a blocked dequantization of its weights and a MatMul."""

    name = "matmul_nbits"
    contract = CONTRACTS["matmul_nbits"]

    def quantized_dtype(self, site: Site) -> str | None:
        bits = site.attribute("bits", 4)
        return f"uint{bits}" if isinstance(bits, int) else None

    def check(self, site: Site, options: Mapping[str, Any]) -> Plan:
        read = site.memo("matmul-nbits", lambda: _read(site))
        int8_compute = read.accuracy_level == 4 and not read.float_zero_point
        if int8_compute and not options["int8_activations"]:
            raise NoMatch(
                "accuracy_level 4: onnxruntime quantizes A to int8 per block where the CPU allows; the float "
                "rewrite is approximate (--allow-approximate)"
            )
        if options["int8_activations"] and not int8_compute:
            raise NoMatch(f"accuracy_level {read.accuracy_level}: the bounded rules apply")
        form = options["form"]
        if form == _BLOCKED:
            if read.float_zero_point:
                raise NoMatch("float zero points: DequantizeLinear takes integer zero points only")
            dtype = f"{'u' if read.zp is not None else ''}int{read.bits}"
            min_opset = kernel_opsets.qdq_opset(False, dtype, blocked=True) or kernel_opsets.BLOCKED
        else:
            min_opset = kernel_opsets.NBITS_UNPACKED
        zp = "float" if read.float_zero_point else ("uint8 (packed)" if read.zp is not None else "none (2^(bits-1))")
        notes = (
            f"bits={read.bits}, block_size={read.block_size}, K={read.k}, N={read.n}, zero points: {zp}, "
            f"accuracy_level={read.accuracy_level}",
        )
        # The same weights, the same products summed in another order: bounded per element by
        # 2 gamma(K + 1) (|A| @ |W| + |bias|), which verify evaluates at the node (element_bounds.py).
        formula = None if options["int8_activations"] else "float32-sum-order"
        return Plan(min_opset=min_opset, notes=notes, data={"read": read}, bound_formula=formula)

    def build(self, site: Site, emit: Emitter, options: Mapping[str, Any], plan: Plan) -> None:
        read: _Read = plan.data["read"]
        weights = self._blocked(emit, read) if options["form"] == _BLOCKED else self._unpacked(emit, read)
        y = site.node.output[0]
        a, bias = site.input(0), read.bias
        if read.float16:
            a = emit.op1("Cast", [a], to=_T.FLOAT, hint="AToFloat")
            bias = emit.op1("Cast", [bias], to=_T.FLOAT, hint="BiasToFloat") if bias else ""
        out = None if read.float16 else y
        value = emit.op1("MatMul", [a, weights], None if bias else out)
        if bias:
            value = emit.op1("Add", [value, bias], out)
        if read.float16:
            emit.op1("Cast", [value], y, to=_T.FLOAT16, hint="ToFloat16")

    @staticmethod
    def _blocked(emit: Emitter, read: _Read) -> str:
        q = read.q[:, : read.k].T  # [K, N]
        offset = 1 << (read.bits - 1)
        if read.zp is None:
            # The default zero point folded into signed values: (q - 2^(bits-1)) * s, no zero point tensor.
            signed = (q.astype(np.int16) - offset).astype(_TYPES[read.bits][0])
            inputs = [emit.const(signed), emit.const(np.ascontiguousarray(read.scale.T))]
        else:
            dtype = _TYPES[read.bits][1]
            inputs = [
                emit.const(q.astype(dtype)),
                emit.const(np.ascontiguousarray(read.scale.T)),
                emit.const(np.ascontiguousarray(read.zp.T).astype(dtype)),
            ]
        return emit.op1("DequantizeLinear", inputs, axis=0, block_size=read.block_size, hint="DequantizeWeights")

    @staticmethod
    def _unpacked(emit: Emitter, read: _Read) -> str:
        nb, bs, n = read.n_blocks, read.block_size, read.n
        q = np.ascontiguousarray(read.q.T).reshape(nb, bs, n)  # zeros pad the last block
        scale = np.ascontiguousarray(read.scale.T).reshape(nb, 1, n)
        values = emit.op1("Cast", [emit.const(q)], to=_T.FLOAT, hint="UnpackedWeights")
        if read.float_zero_point:
            assert read.zp is not None
            adjust = -(scale * np.ascontiguousarray(read.zp.T).reshape(nb, 1, n))  # float32, as the kernel
            scaled = emit.op1(
                "Add", [emit.op1("Mul", [values, emit.const(scale)]), emit.const(adjust.astype(np.float32))]
            )
        else:
            zp = np.full((nb, 1, n), 1 << (read.bits - 1), np.float32)
            if read.zp is not None:
                zp = np.ascontiguousarray(read.zp.T).reshape(nb, 1, n).astype(np.float32)
            scaled = emit.op1("Mul", [emit.op1("Sub", [values, emit.const(zp)]), emit.const(scale)])
        weights = emit.op1("Reshape", [scaled, emit.const(np.array([nb * bs, n], np.int64))])
        if nb * bs != read.k:
            weights = emit.op1(
                "Slice",
                [weights, emit.const(np.array([0], np.int64)), emit.const(np.array([read.k], np.int64))],
                hint="DropPadding",
            )
        return weights


register(MatMulNBitsBuilder())
