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
    com.microsoft QAttention where the uint8 x int8 projection can saturate: how far each projection
    element's pairs leave int16 on the sample's own inputs, times its scale, carried through the
    scores, the softmax and the weighted sum of values to every output element; finite for any
    weights, the softmax entering only through a total variation of at most 1 (the derivation is on
    ``_u8s8_attention``).
``float32-sum-order``
    com.microsoft MatMulNBits: the same dequantized weights, the same products summed in another
    order: ``2 * gamma(K + 1) * (|A| @ |W| + |bias|)`` per element, ``gamma(n) = n u / (1 - n u)``,
    ``u = 2^-24``; float16 outputs: plus one float16 ulp of the larger of the two results (each
    side rounds its float32 result once). Not tighter, soundly: neither kernel's summation order
    is known, and the worst case of a K-term float32 sum is about ``(K - 1) u`` of the sum of
    magnitudes. A weight scale one ulp off moves an output by at most ``2^-23`` of one block's
    sum of magnitudes, more than ``K + 1`` times below this bound (measured: 365 times on K = 96,
    ``tests/test_lower_matmul_nbits.py``), so no sound per-element bound on dense inputs sees it;
    verify's identity probe (:mod:`.probe`), where every sum is exact, does.
``fused-conv-sum``
    com.microsoft FusedConv with a sum input Z. onnxruntime 1.31.1's CPU kernel (``Conv<float>``,
    ``core/providers/cpu/nn/conv.cc``) copies Z into the output and calls MLAS with ``Beta = 1``:
    ``MlasConvOperation`` adds each K panel's GEMM (``MLAS_SGEMM_STRIDEK`` = 256 products) into it,
    and a group with one filter (depthwise) takes the M = 1 kernel, which adds the products into Z one
    K step at a time; the bias joins with the activation (``MlasActivation``). So Z is a term of the
    kernel's float32 sum, where the rewrite adds it to the finished convolution. Both sides sum the
    same ``K + 2`` terms (K = C/group·prod(kernel) products, z, b) in float32, each within
    ``gamma(K + 2)·T`` of the exact sum, ``T = (|x| * |w|) + |z| + |b|`` (the convolution of the
    magnitudes, in float64); the activation moves the difference by at most its slope L (1, or
    LeakyRelu's / HardSigmoid's ``|alpha|`` where larger) and rounds once more:
    ``L·(2·gamma(K + 2) + 2^-20)·T + 2^-20·(max(|y|, |y'|) + c)``, c = 1 for Sigmoid and Tanh (MLAS's
    approximations, values within 1), ``1 + |beta|`` for HardSigmoid, else 0.
``layer-norm-rows``, ``attention-scores``, ``fast-gelu-tanh``, ``fused-matmul-sum-order``, ``embed-layer-norm``
    The ``com.microsoft`` un-fuse rules' bounds (:mod:`.contrib_bounds`, which states each). They
    bound every output of their node (:data:`EVERY_OUTPUT`), not only a node's single output.
``rotary-interleaved-tail``
    com.microsoft RotaryEmbedding, float32, interleaved, with a rotary dim R not a multiple of 16.
    onnxruntime's AVX2 kernel rotates each head's first ``16·floor(R/16)`` values in vectors, with
    one rounding for the ``x1`` product (``fma(x1, c, -round(x2·s))``), as the rewrite does: 0 there
    and after R (the values passing through). The pairs after them go through a scalar tail that
    rounds them either way (measured: its first pair fused, the others ``round(round(x1·c) -
    round(x2·s))``); the two differ by at most ``u·|x1·c|`` before the last rounding, and each
    result by ``u`` of its size, so ``4·u·(|x1·c| + |x2·s|) + 2^-148`` per even output
    (``|x1·s| + |x2·c|`` per odd one), c and s the cache rows at the token's position, in float64.
    Where a product is not finite or reaches ``2^127`` (float32 overflow within a rounding), 0:
    only equal values pass there.
``run-time-k:<c>``
    QLinearMatMul of two run-time operands whose reduction length K the model does not record (a
    symbolic sequence length): ``floor(gamma(K + 4)·K·c) + 1`` steps at every element, K the last
    dimension of the sample's own A, ``c`` the largest product in output steps (the rule's
    parameter): the bound ``qop-matmul`` computes for a recorded K
    (``onnx_qrewrite.rewriter.builders.qoperator.run_time_k_steps``), at the K this sample runs with.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx

from onnx_qrewrite.rewriter import u8s8
from onnx_qrewrite.rewriter.builders.contracts import FUSED_CONV_SUM_FORMULA, ROTARY_TAIL_FORMULA
from onnx_qrewrite.rewriter.contract import RUN_TIME_K_FORMULA
from onnx_qrewrite.verify import contrib_bounds

__all__ = [
    "EVERY_OUTPUT",
    "FORMULAS",
    "WeightMagnitudes",
    "describe",
    "element_bound",
    "needed_inputs",
    "preparable",
    "prepare",
    "readable_ops",
    "uses_saturation",
]

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
    RUN_TIME_K_FORMULA: {"QLinearMatMul": (0,)},
    FUSED_CONV_SUM_FORMULA: {"FusedConv": (0, 1, 2, 3)},
    **contrib_bounds.READS,
    ROTARY_TAIL_FORMULA: {"RotaryEmbedding": (0, 1, 2, 3)},
}

#: The formulas that bound each output of a node of several (given the output's index); the others
#: bound a replacement of one output only.
EVERY_OUTPUT = frozenset(contrib_bounds.READS)


def _split(formula: str) -> tuple[str, str]:
    name, _, parameter = formula.partition(":")
    return name, parameter


def uses_saturation(formula: str | None) -> bool:
    """Whether ``formula``'s bound includes onnxruntime's u8 x s8 int16 pair saturation, which
    :func:`element_bound` leaves out where the kernel is measured not to saturate."""
    return formula is not None and _split(formula)[0] in _SATURATION_FORMULAS


def readable_ops(formula: str) -> frozenset[str]:
    """The ops ``formula`` (``name`` or ``name:parameter``) evaluates a bound for (none if unknown)."""
    return frozenset(_READS.get(_split(formula)[0], {}))


def needed_inputs(formula: str, node: onnx.NodeProto) -> list[str]:
    """The original node's input values the formula reads (present inputs only)."""
    indices = _READS.get(_split(formula)[0], {}).get(node.op_type, ())
    return [node.input[i] for i in indices if i < len(node.input) and node.input[i]]


def _input(node: onnx.NodeProto, values: Mapping[str, np.ndarray], index: int) -> np.ndarray | None:
    """The value of the node's input ``index``, None for an absent one. The formulas assert the
    inputs their op requires: the node is the original's, which onnxruntime has run before any
    bound is judged, and onnxruntime refuses a node missing a required input when it loads the
    model ("input 0 is marked single but has an empty string", exit 3 naming the node:
    tests/test_verify_bounds_malformed.py), so such an assert states that, not a check of data."""
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
    parameter: str,
    node: onnx.NodeProto,
    values: Mapping[str, np.ndarray],
    expected: np.ndarray,
    actual: np.ndarray,
    saturates: bool = True,
) -> np.ndarray:
    base = float(parameter or 0.0)
    conv = node.op_type == "ConvInteger"
    a, b = _input(node, values, 0), _input(node, values, 1)
    assert a is not None and b is not None
    a_type = "uint8" if node.op_type == "DynamicQuantizeMatMul" else a.dtype.name
    if not saturates or not u8s8.saturating_operands(a_type, b.dtype.name, conv=conv):
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


class WeightMagnitudes:
    """``|W|`` in float64, ``[K, N]``: a MatMulNBits node's dequantized weights, the part of its
    ``float32-sum-order`` bound that reads constants only (:func:`prepare` computes it once per
    node), and ``|A| @ |W|`` for the activations it was prepared with, made by one matrix product
    over all their rows: ``|W|`` (32 MB at K = N = 2048) is read from memory once per node instead
    of once per sample. Each row's product is the same dot product either way."""

    def __init__(self, magnitudes: np.ndarray, activations: Sequence[np.ndarray] = ()) -> None:
        self.magnitudes = magnitudes
        #: id(A) -> (A, |A| @ |W|): A is held so that its id is not reused while the product is.
        self._products: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        k, n = magnitudes.shape
        given = list({id(a): a for a in activations}.values())
        if not given or k == 0:  # (K = 0: nothing to batch; product() computes each)
            return
        rows = np.concatenate([np.abs(a.astype(np.float64)).reshape(-1, k) for a in given])
        products = rows @ magnitudes
        start = 0
        for a in given:
            count = a.size // k
            self._products[id(a)] = (a, products[start : start + count].reshape((*a.shape[:-1], n)))
            start += count

    def product(self, a: np.ndarray) -> np.ndarray:
        """``|A| @ |W|`` in float64 (computed now for an activation it was not prepared with)."""
        held = self._products.get(id(a))
        if held is not None and held[0] is a:
            return held[1]
        return np.abs(a.astype(np.float64)) @ self.magnitudes


def _weight_magnitudes(
    node: onnx.NodeProto, values: Mapping[str, np.ndarray], samples: Sequence[Mapping[str, np.ndarray]] = ()
) -> WeightMagnitudes:
    """The MatMulNBits node's :class:`WeightMagnitudes`, with the products of the activations (input
    0) of ``samples``, the values the bound will be evaluated on."""
    from onnx_qrewrite.rewriter.builders.matmul_nbits import dequantized_weights

    attributes = {attr.name: onnx.helper.get_attribute_value(attr) for attr in node.attribute}
    w = dequantized_weights(attributes, values[node.input[1]], values[node.input[2]], _input(node, values, 3))
    activations = [a for sample in samples if (a := _input(node, sample, 0)) is not None]
    return WeightMagnitudes(np.abs(w.astype(np.float64)), activations)


def _float32_sum_order(
    parameter: str,
    node: onnx.NodeProto,
    values: Mapping[str, np.ndarray],
    expected: np.ndarray,
    actual: np.ndarray,
    prepared: WeightMagnitudes | None = None,
) -> np.ndarray:
    a = _input(node, values, 0)
    assert a is not None
    weights = _weight_magnitudes(node, values) if prepared is None else prepared
    k = weights.magnitudes.shape[0]
    total = weights.product(a)
    bias = _input(node, values, 5)
    if bias is not None:
        total = total + np.abs(bias.astype(np.float64))
    bound = 2 * contrib_bounds.summation_gamma(k + 1) * total
    if expected.dtype == np.float16:
        larger = np.maximum(np.abs(expected.astype(np.float64)), np.abs(actual.astype(np.float64)))
        with np.errstate(invalid="ignore"):  # an infinite output: a NaN bound (only equal values pass)
            bound = bound + np.spacing(larger.astype(np.float16)).astype(np.float64)
    return bound


def _qattention_heads(values: np.ndarray, part: int, heads: int) -> np.ndarray:
    """Q (part 0), K (1) or V (2) of a (B, S, 3·hidden) projection, as (B, heads, S, size)."""
    hidden = values.shape[-1] // 3
    piece = values[..., part * hidden : (part + 1) * hidden]
    return np.moveaxis(piece.reshape((*piece.shape[:-1], heads, hidden // heads)), -2, -3)


def qattention_projection(
    node: onnx.NodeProto, values: Mapping[str, np.ndarray], saturates: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """(the projection as the ONNX definition computes it, exactly, (B, S, 3·hidden); how far
    onnxruntime's saturating kernel can move each of its elements on *these* inputs, the same shape):
    ``u8s8.pair_saturation`` of the raw x and W, times the column's ``|x_scale · W_scale|``."""
    x, w, bias = _input(node, values, 0), _input(node, values, 1), _input(node, values, 2)
    x_scale, w_scale = _input(node, values, 3), _input(node, values, 4)
    assert x is not None and w is not None and bias is not None and x_scale is not None and w_scale is not None
    x_zp, w_zp = _input(node, values, 6), _input(node, values, 7)
    columns = w.shape[1]
    step = np.abs(np.asarray(x_scale, np.float64).reshape(()) * np.asarray(w_scale, np.float64).reshape(-1))
    step = np.broadcast_to(step, (columns,))
    shifted_x = x.astype(np.float64) - (0.0 if x_zp is None else float(np.asarray(x_zp).reshape(())))
    shifted_w = w.astype(np.float64) - (0.0 if w_zp is None else np.asarray(w_zp, np.float64).reshape(1, -1))
    projection = (shifted_x @ shifted_w) * step + np.asarray(bias, np.float64)
    if not saturates or not u8s8.saturating_operands(x.dtype.name, w.dtype.name, conv=False):
        return projection, np.zeros_like(projection)
    flat = x.reshape(-1, x.shape[-1])
    moved = u8s8.pair_saturation(flat, u8s8.rows(w, False)).astype(np.float64) * step
    return projection, moved.reshape(projection.shape)


def _u8s8_attention(
    parameter: str,
    node: onnx.NodeProto,
    values: Mapping[str, np.ndarray],
    expected: np.ndarray,
    actual: np.ndarray,
    saturates: bool = True,
) -> np.ndarray:
    """com.microsoft QAttention whose uint8 x int8 projection the kernel may saturate. On these
    inputs each projection element (token t, column c) moves by at most ``E_tc`` (its pairs'
    saturation, :func:`qattention_projection`); a score ``scale · q_i . k_j`` then by at most
    ``m_ij = scale · sum_d (E^q_id |k_jd| + |q_id| E^k_jd + E^q_id E^k_jd)`` (masks add the same to
    both sides; ``2^-20 (|mask_filter_value| + max|score|)`` more for the rounding where a row's
    keys are all masked). With every score of row i moved by at most ``M_i = max_j m_ij``, the
    softmax weights p' and p are within total variation ``tanh(M_i / 2)`` (the ratio p'_j / p_j
    lies in [exp(-2 M_i), exp(2 M_i)]; the worst case puts two values of the score shift on two
    sets of keys), so ``sum_j (p'_j - p_j) v_jd``, both weights summing to 1, is at most
    ``tanh(M_i / 2) · (max_j v_jd - min_j v_jd)``, and ``sum_j p'_j (v'_jd - v_jd)`` at most
    ``max_j E^v_jd``. Finite whatever the weights (tanh <= 1: the output is a convex combination of
    the values). Plus the attention's own float32 roundings (``2^-20 (1 + max|score|) max|v|``, the
    unfused Attention's bound, and ``2 gamma(2T + 4) max|v|`` for each side's rounded convex
    combination of T values, so the bound holds where the exact one is reached) and ``2^-20`` of
    the value."""
    attributes = {attr.name: onnx.helper.get_attribute_value(attr) for attr in node.attribute}
    heads = int(attributes["num_heads"])
    projection, moved = qattention_projection(node, values, saturates)
    q, k, v = (_qattention_heads(projection, i, heads) for i in range(3))
    eq, ek, ev = (_qattention_heads(moved, i, heads) for i in range(3))
    scale = float(attributes.get("scale", 0.0)) or 1.0 / np.sqrt(q.shape[-1])
    aq, ak = np.abs(q), np.abs(k)
    shift = scale * (eq @ np.swapaxes(ak, -1, -2) + aq @ np.swapaxes(ek, -1, -2) + eq @ np.swapaxes(ek, -1, -2))
    scores = scale * np.max(aq @ np.swapaxes(ak, -1, -2), axis=(-1, -2), keepdims=True)
    fill = abs(float(attributes.get("mask_filter_value", -10000.0)))
    largest = np.max(shift, axis=-1, keepdims=True)  # M_i, (B, H, S, 1)
    largest = np.where(largest > 0, largest + _ROUNDING * (fill + scores), 0.0)
    spread = np.max(v, axis=-2, keepdims=True) - np.min(v, axis=-2, keepdims=True)  # (B, H, 1, size)
    bound = np.tanh(largest / 2) * spread + np.max(ev, axis=-2, keepdims=True)
    keys = 2 * k.shape[-2] + 4  # each side's softmax weights and weighted sum of T values, in float32
    rounding = _ROUNDING * (1 + scores) + 2 * contrib_bounds.summation_gamma(keys)
    bound = bound + rounding * np.max(np.abs(v), axis=(-1, -2), keepdims=True)
    bound = np.moveaxis(bound, -3, -2).reshape(expected.shape)
    larger = np.maximum(np.abs(expected.astype(np.float64)), np.abs(actual.astype(np.float64)))
    return bound + _ROUNDING * larger


def _conv_pads(
    attributes: Mapping[str, Any], spatial: Sequence[int], out: Sequence[int], span: Sequence[int]
) -> list[int]:
    """The Conv's begin and end pads (ONNX order: all begins, then all ends), auto_pad resolved as
    onnxruntime does (SAME_UPPER puts the odd pad at the end, SAME_LOWER at the beginning)."""
    rank = len(spatial)
    auto_pad = attributes.get("auto_pad", b"NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else str(auto_pad)
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        strides = list(attributes.get("strides", [1] * rank))
        total = [max(0, (out[i] - 1) * strides[i] + span[i] - spatial[i]) for i in range(rank)]
        begin = [t // 2 if auto_pad == "SAME_UPPER" else t - t // 2 for t in total]
        return begin + [t - b for t, b in zip(total, begin, strict=True)]
    if auto_pad == "VALID":
        return [0] * (2 * rank)
    return list(attributes.get("pads", [0] * (2 * rank)))


def _abs_conv(x: np.ndarray, w: np.ndarray, attributes: Mapping[str, Any], out: Sequence[int]) -> np.ndarray:
    """``|x| * |w|``, the convolution of the magnitudes in float64, of output spatial shape ``out``.
    Accumulated one kernel offset at a time (a strided view of the padded input per offset), so
    memory stays that of the input and the output: a window per output element (the input times
    the kernel's size, in float64) reached 593 MB for a 2 MB input with a 7x7 kernel."""
    rank, group = w.ndim - 2, int(attributes.get("group", 1))
    strides = list(attributes.get("strides", [1] * rank))
    dilations = list(attributes.get("dilations", [1] * rank))
    kernel = w.shape[2:]
    span = [(kernel[i] - 1) * dilations[i] + 1 for i in range(rank)]
    pads = _conv_pads(attributes, x.shape[2:], out, span)
    padded = np.pad(np.abs(x.astype(np.float64)), [(0, 0), (0, 0)] + [(pads[i], pads[i + rank]) for i in range(rank)])
    n, c = x.shape[:2]
    padded = padded.reshape((n, group, c // group, *padded.shape[2:]))
    weights = np.abs(w.astype(np.float64)).reshape((group, w.shape[0] // group, c // group, *kernel))
    letters = "opqrstuv"[:rank]
    spec = f"ngc{letters},gfc->ngf{letters}"
    total = np.zeros((n, group, w.shape[0] // group, *out))
    for offset in np.ndindex(*kernel):
        pick = tuple(
            slice(offset[i] * dilations[i], offset[i] * dilations[i] + (out[i] - 1) * strides[i] + 1, strides[i])
            for i in range(rank)
        )
        total += np.einsum(spec, padded[(slice(None), slice(None), slice(None), *pick)], weights[(..., *offset)])
    return total.reshape((n, w.shape[0], *out))


def _fused_conv_sum(
    parameter: str, node: onnx.NodeProto, values: Mapping[str, np.ndarray], expected: np.ndarray, actual: np.ndarray
) -> np.ndarray:
    """The ``fused-conv-sum`` bound (module docstring) at every element of the FusedConv's output."""
    attributes = {attr.name: onnx.helper.get_attribute_value(attr) for attr in node.attribute}
    x, w, b, z = (_input(node, values, i) for i in range(4))
    assert x is not None and w is not None
    # An infinite or NaN input makes the bound NaN or infinite where it reaches (IEEE: inf · 0 and
    # inf - inf are NaN): only equal values pass there.
    with np.errstate(invalid="ignore", over="ignore"):
        total = _abs_conv(x, w, attributes, expected.shape[2:])
        if z is not None:
            total = total + np.abs(z.astype(np.float64))
        if b is not None:
            total = total + np.abs(b.astype(np.float64)).reshape((1, -1, *(1,) * (expected.ndim - 2)))
    terms = x.shape[1] // int(attributes.get("group", 1)) * int(np.prod(w.shape[2:])) + 2
    gamma = terms * _U / (1 - terms * _U)
    activation = attributes.get("activation", b"")
    activation = activation.decode() if isinstance(activation, bytes) else str(activation)
    params = [float(p) for p in attributes.get("activation_params", [])]
    slope, extra = 1.0, 0.0
    if activation in ("LeakyRelu", "HardSigmoid"):
        slope = max(1.0, abs(params[0] if params else (0.01 if activation == "LeakyRelu" else 0.2)))
    if activation in ("Sigmoid", "Tanh"):
        extra = 1.0
    if activation == "HardSigmoid":
        extra = 1.0 + abs(params[1] if len(params) > 1 else 0.5)
    larger = np.maximum(np.abs(expected.astype(np.float64)), np.abs(actual.astype(np.float64)))
    with np.errstate(invalid="ignore", over="ignore"):  # as above: a NaN bound, only equal values pass
        return slope * (2 * gamma + _ROUNDING) * total + _ROUNDING * (larger + extra)


#: The AVX2 rotary kernel's vector of interleaved values (contrib_rotary.INTERLEAVED_BLOCK).
_ROTARY_BLOCK = 16


def _rotary_tail(
    parameter: str, node: onnx.NodeProto, values: Mapping[str, np.ndarray], expected: np.ndarray, actual: np.ndarray
) -> np.ndarray:
    """The ``rotary-interleaved-tail`` bound (module docstring) at every element of the output."""
    attributes = {attr.name: onnx.helper.get_attribute_value(attr) for attr in node.attribute}
    x, positions, cos, sin = (_input(node, values, i) for i in range(4))
    assert x is not None and positions is not None and cos is not None and sin is not None
    width = cos.shape[1]
    rotary, heads = 2 * width, int(attributes.get("num_heads", 0))
    if x.ndim == 4:  # (B, N, S, H) -> (B, S, N, H)
        rows = np.moveaxis(x, 1, 2)
    else:
        head = x.shape[2] // heads if int(attributes.get("rotary_embedding_dim", 0)) else rotary
        rows = x.reshape((*x.shape[:2], x.shape[2] // head, head))
    if positions.size == 1:  # a start: the tokens' positions are start + 0..S-1
        positions = positions.reshape(1, 1) + np.arange(rows.shape[1]).reshape(1, -1)
    c, s = (np.asarray(cache, np.float64)[positions][:, :, None, :] for cache in (cos, sin))
    x1, x2 = (np.asarray(rows[..., first:rotary:2], np.float64) for first in (0, 1))
    # inf · 0 is NaN (IEEE): such elements get 0 below, as do products beyond float32's range.
    with np.errstate(invalid="ignore", over="ignore"):
        sums = (np.abs(x1 * c) + np.abs(x2 * s), np.abs(x1 * s) + np.abs(x2 * c))
        pairs = np.stack([np.where(m < 2.0**127, 4 * _U * m + 2.0**-148, 0.0) for m in sums], axis=-1)
    pairs[..., : (rotary // _ROTARY_BLOCK) * _ROTARY_BLOCK // 2, :] = 0.0  # the vectors: bit-exact
    bound = np.zeros(rows.shape, np.float64)
    bound[..., :rotary] = pairs.reshape((*rows.shape[:-1], rotary))
    return np.moveaxis(bound, 1, 2) if x.ndim == 4 else bound.reshape(expected.shape)


def _reduction_length(node: onnx.NodeProto, values: Mapping[str, np.ndarray]) -> int:
    """K of a QLinearMatMul on this sample: the last dimension of its A (1-D A: its length)."""
    a = _input(node, values, 0)
    assert a is not None
    return int(a.shape[-1])


def _run_time_k(
    parameter: str, node: onnx.NodeProto, values: Mapping[str, np.ndarray], expected: np.ndarray, actual: np.ndarray
) -> np.ndarray:
    from onnx_qrewrite.rewriter.builders.qoperator import run_time_k_steps

    return np.asarray(run_time_k_steps(_reduction_length(node, values), float(parameter)))


def describe(formula: str, node: onnx.NodeProto | None = None, values: Mapping[str, np.ndarray] | None = None) -> str:
    """How a row names ``formula``'s bound: the K it was evaluated at, for ``run-time-k`` (with
    ``node`` and the sample's ``values``), else the formula's name, per element."""
    name = _split(formula)[0]
    if name != RUN_TIME_K_FORMULA:
        return f"per element ({name})"
    if node is None or values is None:
        return "a function of the run-time reduction length K (run-time-k)"
    return f"at the run-time reduction length K = {_reduction_length(node, values)} (run-time-k)"


#: The formulas whose bound is onnxruntime's u8 x s8 pair saturation (they take ``saturates``).
_SATURATION_FORMULAS = frozenset({"u8s8-pairs", "u8s8-attention"})

#: formula name -> evaluation(parameter, original node, its input values, expected, actual) -> bound
FORMULAS: dict[str, Callable[..., np.ndarray]] = {
    "u8s8-pairs": _u8s8_pairs,
    "float32-sum-order": _float32_sum_order,
    "u8s8-attention": _u8s8_attention,
    RUN_TIME_K_FORMULA: _run_time_k,
    FUSED_CONV_SUM_FORMULA: _fused_conv_sum,
    **{name: functools.partial(contrib_bounds.evaluate, name) for name in contrib_bounds.READS},
    ROTARY_TAIL_FORMULA: _rotary_tail,
}


#: formula name -> op -> (the inputs of its part that reads constants only, that part): a part
#: computed once per node by :func:`prepare`, not once per sample (MatMulNBits' dequantized
#: weights: 1.4 s of 4.7 s per layer at K = N = 2048 when they were recomputed per sample).
_PREPARED: dict[str, dict[str, tuple[tuple[int, ...], Callable[..., Any]]]] = {
    "float32-sum-order": {"MatMulNBits": ((1, 2, 3), _weight_magnitudes)},
}


def preparable(formula: str | None, node: onnx.NodeProto, constants: Mapping[str, np.ndarray]) -> bool:
    """Whether ``formula`` has a part :func:`prepare` can compute once for ``node``: one that reads
    only inputs that are constants of the original model (present in ``constants``)."""
    if formula is None:
        return False
    spec = _PREPARED.get(_split(formula)[0], {}).get(node.op_type)
    if spec is None:
        return False
    return all(node.input[i] in constants for i in spec[0] if i < len(node.input) and node.input[i])


def prepare(
    formula: str,
    node: onnx.NodeProto,
    constants: Mapping[str, np.ndarray],
    samples: Sequence[Mapping[str, np.ndarray]] = (),
) -> Any:
    """The part of ``formula``'s bound at ``node`` that depends on its constant inputs only (the
    weights), for :func:`element_bound`'s ``prepared``: the same values it would compute on each
    sample, computed once. ``samples``: the values of the node's inputs on each sample the bound
    will be evaluated on, whose part that reads the weights is then computed for all of them at once
    (the same values). Only where :func:`preparable` says so."""
    return _PREPARED[_split(formula)[0]][node.op_type][1](node, constants, samples)


def element_bound(
    formula: str,
    node: onnx.NodeProto,
    values: Mapping[str, np.ndarray],
    expected: np.ndarray,
    actual: np.ndarray,
    *,
    saturates: bool = True,
    prepared: Any = None,
    output: int = 0,
) -> np.ndarray | None:
    """The bound at every element of ``expected`` (broadcastable to it), or None for a formula
    this version does not know (the scalar bound then applies). ``saturates``: whether the kernel
    the original ran with saturates u8 x s8 pairs (measured: u8s8_reference.default_kernel_saturates);
    where it does not, the u8s8 formulas leave the pair excess out. ``prepared``: :func:`prepare`'s
    value for this formula and node, or None (then computed here). ``output``: which of the node's
    outputs ``expected`` is (read by the :data:`EVERY_OUTPUT` formulas only)."""
    name, parameter = _split(formula)
    evaluate = FORMULAS.get(name)
    if evaluate is None or node.op_type not in _READS[name]:
        return None
    if name in _SATURATION_FORMULAS:
        return evaluate(parameter, node, values, expected, actual, saturates)
    if name in _PREPARED:
        return evaluate(parameter, node, values, expected, actual, prepared)
    if name in EVERY_OUTPUT:
        return evaluate(node, values, expected, actual, output)
    return evaluate(parameter, node, values, expected, actual)
