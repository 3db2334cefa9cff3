"""Bounds that vary per element, evaluated from the original node and the values it reads.

A bounded rule whose bound depends on where in the output one looks records the name of a formula
(``Plan.bound_formula``, metadata ``onnx_qrewrite.bound_formula``) beside its scalar bound (the
largest value the formula can take). :mod:`.bounds` evaluates the formula here for every sample,
from the *original* node (found by its origin name) and the values it reads in the original
model, and checks each output element against its own bound. A scalar bound would have to be the
worst column's everywhere, too loose to see a broken rewrite in the columns that must be exact.

Formulas (``name`` or ``name:parameter``):

``u8s8-pairs:<base>``
    onnxruntime's uint8 x int8 int16 pair saturation (:mod:`onnx_qrewrite.rewriter.u8s8`). Integer
    outputs (MatMulInteger, ConvInteger): each output column's (channel's) pair excess from the
    weights the node reads, plus ``base`` (the float32 summation bound). Float outputs
    (MatMulIntegerToFloat, DynamicQuantizeMatMul): 0 where the column has no excess (bit-exact),
    else the excess times the column's scale product plus ``2^-20`` of the value and bias for the
    float roundings after the integer sum (each at most one unit roundoff of its operand).
``u8s8-attention``
    com.microsoft QAttention where the uint8 x int8 projection can saturate: each projection
    column's pair excess times its scale, carried through the scores, the softmax and the weighted
    sum of values to every output element (the derivation is on ``_u8s8_attention``).
``float32-sum-order``
    com.microsoft MatMulNBits: the same dequantized weights, the same products summed in another
    order: ``2 * gamma(K + 1) * (|A| @ |W| + |bias|)`` per element, ``gamma(n) = n u / (1 - n u)``,
    ``u = 2^-24``; float16 outputs: plus one float16 ulp of the larger of the two results (each
    side rounds its float32 result once). Not tighter, soundly: neither kernel's summation order
    is known, and the worst case of a K-term float32 sum is about ``(K - 1) u`` of the sum of
    magnitudes. A weight scale one ulp off moves an output by at most ``2^-23`` of one block's
    sum of magnitudes, more than ``K + 1`` times below this bound (measured: 365 times on K = 96,
    ``tests/test_lower_matmul_nbits.py``), so no sound per-element bound on dense inputs sees it;
    the identity-input test, where every sum is exact, does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import onnx

from onnx_qrewrite.rewriter import u8s8

__all__ = ["FORMULAS", "element_bound", "needed_inputs"]

_U = 2.0**-24
_ROUNDING = 2.0**-20  # generous: a few roundings of float32 values, each at most u

#: formula name -> the original node's input indices it reads.
_READS: dict[str, dict[str, tuple[int, ...]]] = {
    "u8s8-pairs": {
        "MatMulInteger": (0, 1),
        "ConvInteger": (0, 1),
        "MatMulIntegerToFloat": (0, 1, 2, 3, 6),
        "DynamicQuantizeMatMul": (0, 1, 2, 4),
    },
    "float32-sum-order": {"MatMulNBits": (0, 1, 2, 3, 5)},
    "u8s8-attention": {"QAttention": (0, 1, 2, 3, 4, 6, 7)},
}


def _split(formula: str) -> tuple[str, str]:
    name, _, parameter = formula.partition(":")
    return name, parameter


def needed_inputs(formula: str, node: onnx.NodeProto) -> list[str]:
    """The original node's input values the formula reads (present inputs only)."""
    indices = _READS.get(_split(formula)[0], {}).get(node.op_type, ())
    return [node.input[i] for i in indices if i < len(node.input) and node.input[i]]


def _input(node: onnx.NodeProto, values: Mapping[str, np.ndarray], index: int) -> np.ndarray | None:
    if index < len(node.input) and node.input[index]:
        return values[node.input[index]]
    return None


def _column_axis(weights: np.ndarray, conv: bool, out_ndim: int) -> Callable[[np.ndarray], np.ndarray]:
    """How per-row values of the weights (as :func:`u8s8.rows` lays them out) broadcast onto the output."""
    if conv:
        return lambda per_row: per_row.reshape((1, weights.shape[0], *(1,) * (out_ndim - 2)))
    if weights.ndim < 2:
        return lambda per_row: per_row.reshape(())
    return lambda per_row: per_row.reshape((*weights.shape[:-2], 1, weights.shape[-1]))


def _u8s8_pairs(
    parameter: str, node: onnx.NodeProto, values: Mapping[str, np.ndarray], expected: np.ndarray, actual: np.ndarray
) -> np.ndarray:
    base = float(parameter or 0.0)
    conv = node.op_type == "ConvInteger"
    a, b = _input(node, values, 0), _input(node, values, 1)
    assert a is not None and b is not None
    a_type = "uint8" if node.op_type == "DynamicQuantizeMatMul" else a.dtype.name
    if not u8s8.saturating_operands(a_type, b.dtype.name, conv=conv):
        excess = np.zeros(1, np.float64)
        place = _column_axis(np.zeros(1), False, expected.ndim)
    else:
        excess = u8s8.pair_excess(u8s8.rows(b, conv), b.dtype.name).astype(np.float64)
        place = _column_axis(b, conv, expected.ndim)
    if node.op_type in ("MatMulInteger", "ConvInteger"):
        return np.floor(place(excess) + base)
    # Float outputs: the excess in the output's units, where there is one.
    if node.op_type == "DynamicQuantizeMatMul":
        a_float = a.astype(np.float32)
        low, high = min(0.0, float(a_float.min(initial=0.0))), max(0.0, float(a_float.max(initial=0.0)))
        a_scale = np.asarray((high - low) / 255.0 if high > low else 1.0, np.float64)
        b_scale, bias = _input(node, values, 2), _input(node, values, 4)
    else:
        a_scale = np.abs(np.asarray(_input(node, values, 2), np.float64)).reshape(())
        b_scale, bias = _input(node, values, 3), _input(node, values, 6)
    assert b_scale is not None
    scale = np.abs(a_scale * np.asarray(b_scale, np.float64).reshape(-1))
    scaled = place(excess) * (scale if scale.size > 1 else scale.reshape(()))  # per column: the last axis
    magnitude = np.maximum(np.abs(expected.astype(np.float64)), np.abs(actual.astype(np.float64)))
    if bias is not None:
        magnitude = magnitude + np.abs(np.asarray(bias, np.float64))
    return np.where(scaled > 0, scaled * (1 + _ROUNDING) + _ROUNDING * magnitude, 0.0)


def _float32_sum_order(
    parameter: str, node: onnx.NodeProto, values: Mapping[str, np.ndarray], expected: np.ndarray, actual: np.ndarray
) -> np.ndarray:
    from onnx_qrewrite.rewriter.builders.matmul_nbits import dequantized_weights

    a = _input(node, values, 0)
    assert a is not None
    attributes = {attr.name: onnx.helper.get_attribute_value(attr) for attr in node.attribute}
    w = dequantized_weights(attributes, values[node.input[1]], values[node.input[2]], _input(node, values, 3)).astype(
        np.float64
    )
    k = w.shape[0]
    n = (k + 1) * _U
    gamma = n / (1 - n)
    total = np.abs(a.astype(np.float64)) @ np.abs(w)
    bias = _input(node, values, 5)
    if bias is not None:
        total = total + np.abs(bias.astype(np.float64))
    bound = 2 * gamma * total
    if expected.dtype == np.float16:
        larger = np.maximum(np.abs(expected.astype(np.float64)), np.abs(actual.astype(np.float64)))
        bound = bound + np.spacing(larger.astype(np.float16)).astype(np.float64)
    return bound


def _u8s8_attention(
    parameter: str, node: onnx.NodeProto, values: Mapping[str, np.ndarray], expected: np.ndarray, actual: np.ndarray
) -> np.ndarray:
    """com.microsoft QAttention whose uint8 x int8 projection the kernel may saturate: each
    projection column c moves by at most ``E_c = excess_c * |x_scale * W_scale_c|``; a score
    ``q_i . k_j * scale`` then by at most ``m_ij = scale * sum_d (E^q_d |k_jd| + |q_id| E^k_d +
    E^q_d E^k_d)``, which moves every softmax weight by a factor within ``exp(+-2 M_i)``
    (``M_i = max_j m_ij``, masks add the same to both sides), so the weights move by at most
    ``expm1(2 M_i)`` in total; the output ``sum_j p_ij v_j`` by at most ``expm1(2 M_i) *
    (max_j |v_jd| + E^v_d) + E^v_d``. Plus the attention's own float32 roundings
    (``2^-20 (1 + max|score|) max|v|``, the unfused Attention's bound) and ``2^-20`` of the value."""
    x, w, bias = _input(node, values, 0), _input(node, values, 1), _input(node, values, 2)
    x_scale, w_scale = _input(node, values, 3), _input(node, values, 4)
    assert x is not None and w is not None and bias is not None and x_scale is not None and w_scale is not None
    x_zp, w_zp = _input(node, values, 6), _input(node, values, 7)
    attributes = {attr.name: onnx.helper.get_attribute_value(attr) for attr in node.attribute}
    heads = int(attributes["num_heads"])
    columns = w.shape[1]
    hidden = columns // 3
    size = hidden // heads
    scale = float(attributes.get("scale", 0.0)) or 1.0 / np.sqrt(size)
    step = np.abs(np.asarray(x_scale, np.float64).reshape(()) * np.asarray(w_scale, np.float64).reshape(-1))
    excess = (
        u8s8.pair_excess(u8s8.rows(w, False), "int8").astype(np.float64)
        if u8s8.saturating_operands(x.dtype.name, w.dtype.name, conv=False)
        else np.zeros(columns)
    )
    moved = (excess * np.broadcast_to(step, (columns,))).reshape(1, 1, columns)  # E_c per projection column
    shifted_x = x.astype(np.float64) - (0.0 if x_zp is None else float(np.asarray(x_zp).reshape(())))
    shifted_w = w.astype(np.float64) - (0.0 if w_zp is None else np.asarray(w_zp, np.float64).reshape(1, -1))
    projection = (shifted_x @ shifted_w) * np.broadcast_to(step, (columns,)) + np.asarray(bias, np.float64)

    def heads_of(values_: np.ndarray, part: int) -> np.ndarray:  # (..., columns) -> (B, H, S, size)
        piece = values_[..., part * hidden : (part + 1) * hidden]
        return np.moveaxis(piece.reshape((*piece.shape[:-1], heads, size)), -2, -3)

    q, k, v = (np.abs(heads_of(projection, i)) for i in range(3))
    eq, ek, ev = (heads_of(moved, i) for i in range(3))  # (H, 1, size)
    largest = scale * (np.max(k @ np.swapaxes(eq, -1, -2), axis=-2, keepdims=True) + q @ np.swapaxes(ek, -1, -2))
    largest = largest + scale * np.sum(eq * ek, axis=-1, keepdims=True)  # (B, H, S, 1): M_i
    v_most = np.max(v, axis=-2, keepdims=True) + ev  # (B, H, 1, size)
    bound = np.expm1(2 * largest) * v_most + ev
    scores = scale * np.max(q @ np.swapaxes(k, -1, -2), axis=(-1, -2), keepdims=True)
    bound = bound + _ROUNDING * (1 + scores) * np.max(v, axis=(-1, -2), keepdims=True)
    bound = np.moveaxis(bound, -3, -2).reshape(expected.shape)
    larger = np.maximum(np.abs(expected.astype(np.float64)), np.abs(actual.astype(np.float64)))
    return bound + _ROUNDING * larger


#: formula name -> evaluation(parameter, original node, its input values, expected, actual) -> bound
FORMULAS: dict[str, Callable[..., np.ndarray]] = {
    "u8s8-pairs": _u8s8_pairs,
    "float32-sum-order": _float32_sum_order,
    "u8s8-attention": _u8s8_attention,
}


def element_bound(
    formula: str,
    node: onnx.NodeProto,
    values: Mapping[str, np.ndarray],
    expected: np.ndarray,
    actual: np.ndarray,
) -> np.ndarray | None:
    """The bound at every element of ``expected`` (broadcastable to it), or None for a formula
    this version does not know (the scalar bound then applies)."""
    name, parameter = _split(formula)
    evaluate = FORMULAS.get(name)
    if evaluate is None or node.op_type not in _READS[name]:
        return None
    return evaluate(parameter, node, values, expected, actual)
