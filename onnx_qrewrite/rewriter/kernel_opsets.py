"""The one home of opset policy: the lowest default-domain opset at which stock onnxruntime (1.31,
CPU) has a kernel for a standard op the builders emit, per quantized type (NUMERICS.md).

Builders compute a node's ``Plan.min_opset`` from these tables and nothing else; rule files do not
state opsets (they may narrow where a rule applies with ``when.min_opset``/``max_opset``, which is
policy, not a fact about the emitted ops). Changing a number here changes what the rewrite does
(``tests/test_contract.py`` proves it).
"""

from __future__ import annotations

__all__ = [
    "BLOCKED",
    "DECOMPOSE_DEQUANTIZE_INTEGER",
    "DEQUANTIZE_LINEAR",
    "FLOAT16_SCALE",
    "FORMS",
    "GATHER_NEGATIVE_INDICES",
    "NBITS_UNPACKED",
    "PER_AXIS",
    "QUANTIZE_LINEAR",
    "describe",
    "qdq_opset",
]

#: QuantizeLinear: uint32, float16 and bfloat16 as the quantized type have no kernel.
QUANTIZE_LINEAR: dict[str, int] = {
    "uint8": 10,
    "int8": 10,
    "uint16": 21,
    "int16": 21,
    "uint4": 21,
    "int4": 21,
    "float8e4m3fn": 19,
    "float8e4m3fnuz": 19,
    "float8e5m2": 19,
    "float8e5m2fnuz": 19,
}
#: DequantizeLinear: the same types plus int32.
DEQUANTIZE_LINEAR: dict[str, int] = {**QUANTIZE_LINEAR, "int32": 10}
#: Per-axis scales (the ``axis`` attribute) exist from opset 13.
PER_AXIS = 13
#: Blocked quantization (``block_size``) exists from opset 21.
BLOCKED = 21
#: DequantizeLinear with a float16 scale (and output) exists from opset 19.
FLOAT16_SCALE = 19
#: The Cast/Sub/Mul dequantization of integer types (Cast to float64 included): Sub/Mul 7, Cast 6.
#: 10 so that a model kept at opset 10 (the first with DequantizeLinear) can use it.
DECOMPOSE_DEQUANTIZE_INTEGER = 10
#: MatMulNBits unpacked into Cast/Sub/Mul/Reshape/Slice/MatMul: Slice with inputs needs 10.
NBITS_UNPACKED = 10
#: Gather with negative indices (counted from the end, as GatherBlockQuantized does): from 11.
GATHER_NEGATIVE_INDICES = 11

#: The lowest opset of every op in each arithmetic form a builder emits (their CPU kernels in
#: onnxruntime for the types used).
FORMS: dict[str, int] = {
    # Round 11, Cast to bfloat16 13, float64 Clip 12.
    "qdq-decompose": 13,
    # ReduceMin/ReduceMax without axes, Round, Clip with inputs: 11.
    "dynamic-quantize-linear": 11,
    # Cast, Sub, MatMul (float and int32), Conv, Mul, Add: 10 is where MatMulInteger itself starts.
    "integer-matmul": 10,
    # Cast to bfloat16, Reshape of runtime scales.
    "dynamic-dequantize-arithmetic": 13,
    # Reshape with its shape as an input: 5 (Flatten -> Reshape).
    "reshape": 5,
    # GatherND, and Unsqueeze on a negative axis: 11 (Gather -> GatherND).
    "gather-nd": 11,
}


def qdq_opset(quantize: bool, dtype: str, *, per_axis: bool = False, blocked: bool = False) -> int | None:
    """Lowest opset of QuantizeLinear (``quantize``) or DequantizeLinear for ``dtype``; None: no kernel."""
    needed = (QUANTIZE_LINEAR if quantize else DEQUANTIZE_LINEAR).get(dtype)
    if needed is None:
        return None
    if per_axis:
        needed = max(needed, PER_AXIS)
    if blocked:
        needed = max(needed, BLOCKED)
    return needed


def describe(quantize: bool, dtypes: list[str] | None) -> str:
    """``uint8, int8: 10; uint16, int16: 21 (per-axis at least 13)`` for the docs."""
    table = QUANTIZE_LINEAR if quantize else DEQUANTIZE_LINEAR
    by_opset: dict[int, list[str]] = {}
    for dtype in dtypes if dtypes is not None else list(table):
        if dtype in table:
            by_opset.setdefault(table[dtype], []).append(dtype)
    parts = [f"{', '.join(types)}: {opset}" for opset, types in sorted(by_opset.items())]
    return "; ".join(parts) + f" (per-axis at least {PER_AXIS})"
