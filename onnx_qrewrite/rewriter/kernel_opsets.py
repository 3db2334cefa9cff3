"""The one home of opset policy: the lowest default-domain opset at which stock onnxruntime (1.31,
CPU) has a kernel for a standard op the builders emit, per quantized type (NUMERICS.md), the
opset each arithmetic form needs (``FORMS``), and the op versions whose semantics a builder
relies on (``OP_VERSIONS``, from the onnx operator changelog).

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
    "OP_VERSIONS",
    "PER_AXIS",
    "QDQ_FIRST",
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
#: DequantizeLinear: the same types plus int32, and int2/uint2 from 25 (onnx 1.23.2's schema; onnxruntime
#: 1.31.1 runs them blocked, measured: tests/test_lower_matmul_nbits.py, the 2-bit battery).
DEQUANTIZE_LINEAR: dict[str, int] = {**QUANTIZE_LINEAR, "int32": 10, "int2": 25, "uint2": 25}
#: QuantizeLinear/DequantizeLinear-10, their first version: the floor of a form built from them
#: when the quantized type is not in the tables above (the builder declines such types itself).
QDQ_FIRST = 10
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
    # qlinear_integer: Round 11, Clip with bound inputs 11, Gemm's optional C 11.
    "qlinear-integer": 11,
    # GatherND, and Unsqueeze on a negative axis: 11 (Gather -> GatherND).
    "gather-nd": 11,
    # MaxPool on uint8/int8 (com.microsoft NhwcMaxPool -> Transpose, MaxPool, Transpose): MaxPool-12
    # adds the 8-bit types; onnxruntime 1.31.1 refuses them at 11 (tests/test_lower_nhwc.py).
    "max-pool-8bit": 12,
    # qdq_float_emulation: Round 11, Clip with bound inputs 11, Cast to bfloat16 13.
    "float-emulation": 13,
    # com.microsoft Gelu/BiasGelu -> Mul/Add/Erf: Erf-9 (FastGelu's Tanh form is held to the same floor).
    "gelu-decomposed": 9,
    # com.microsoft QuickGelu -> Mul(x, Sigmoid(alpha x)): Sigmoid-6, Mul-6.
    "quick-gelu": 6,
    # SimplifiedLayerNormalization below 23 -> Mul/ReduceMean/Add/Sqrt/Div, measured at 13 and up
    # (test_unfuse_contrib.py); ReduceMean's axes follow OP_VERSIONS["reduce-axes-input"].
    "rms-decomposed": 13,
    # com.microsoft Attention/QAttention/MultiHeadAttention without a mask: MatMul, Reshape,
    # Transpose, Softmax over the last axis of 4-D scores (axis 3 below Softmax-13), Unsqueeze on a
    # negative axis: 11 (measured at 11, test_unfuse_attention.py::test_attention_at_opset_11_without_a_mask).
    "attention": 11,
    # GatherBlockQuantized's packed table: Gather with negative indices 11; the unpacking (Cast to
    # int32, Div/Mul/Sub on int32) and Concat older. (BitShift is 11 but onnxruntime's Sub takes no
    # uint8, and BitwiseAnd is 18: int32 division serves every opset.)
    "gather-block-unpack": 11,
    # ... with mask_index / key_padding_mask or unidirectional: the mask and causal-fill arithmetic
    # adds Range (first version 11: the newest), Slice with inputs (10), Greater/Less on int32/int64
    # (9: Greater-7/Less-7 take floats only), Where (9), Cast, Concat, Not, And: 11, as the form
    # without a mask (onnx 1.23.2 Changelog; bit-exact at 11 and 12 for every mask,
    # test_unfuse_attention.py::test_attention_masks_at_opsets_11_and_12). It said 13, unmeasured
    # below: models at opset 11-12 with a mask were raised to 13 for nothing.
    "attention-mask": 11,
    # com.microsoft RotaryEmbedding: Range-11 (positions from a start), Equal-11 on float64 (the
    # fused multiply-add's rounding, emulated in float64; Equal-7 takes integers and bool only).
    "rotary-embedding": 11,
    # com.microsoft (Q)EmbedLayerNormalization: the mask count's ReduceSum-13 (axes an input); the
    # normalization's CumSum-11, Slice-10 with inputs, Gather-11 with a negative index, Range-11,
    # DequantizeLinear-10 per tensor (test_unfuse_attention.py::test_embed_layer_norms_at_opset_13).
    "embed-layer-norm": 13,
    # com.microsoft GroupQueryAttention: Max-12 on int64 (the present length), GatherElements-11,
    # Unsqueeze-13's axes input (the form is written once, at 13).
    "group-query-attention": 13,
}

#: Versions of standard ops whose semantics a builder relies on, from the onnx operator changelog
#: (onnx docs/Changelog.md). A builder that emits the feature needs at least this opset, or emits the
#: older form below it; changing a number changes the rewrite (tests/test_contract.py).
OP_VERSIONS: dict[str, int] = {
    # Clip-11: min and max are inputs, not attributes (FusedGemm/FusedConv's Clip activation).
    "clip-inputs": 11,
    # Gemm-11: the C input is optional (QGemm without C).
    "gemm-optional-c": 11,
    # Softmax-13: normalizes along the one axis given, not over the input flattened from it on
    # (QLinearSoftmax's opset attribute selects the same two meanings).
    "softmax-single-axis": 13,
    # Unsqueeze-13: axes an input, not an attribute.
    "unsqueeze-axes-input": 13,
    # LayerNormalization-17: the op's first version (SkipLayerNormalization, EmbedLayerNormalization).
    "layer-normalization": 17,
    # ReduceMean-18: axes an input, not an attribute.
    "reduce-axes-input": 18,
    # ReduceSum-13: axes an input (ReduceSum moved to an axes input at 13, the other reductions at 18).
    "reduce-sum-axes-input": 13,
    # Gelu-20: the op's first version, with approximate="tanh" (FastGelu).
    "gelu": 20,
    # RMSNormalization-23: the op's first version (SimplifiedLayerNormalization and its Skip form).
    "rms-normalization": 23,
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
