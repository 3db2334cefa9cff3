"""onnxruntime's uint8 x int8 int16 pair saturation, and how far it can move a result.

On x86 CPUs without AVX-VNNI (AVX2, AVX-512 without VNNI) MLAS multiplies uint8 by int8 with
``vpmaddubsw``: it adds the products of each *adjacent pair along the reduction axis* (k = 2j and
2j + 1) and saturates that pair's sum to int16, before adding the pairs in int32. Measured on
onnxruntime 1.31.1 (tests/test_u8s8_saturation.py, an AVX2 CPU):

- the pairs are (2j, 2j+1) along K of the GEMM: MatMulInteger's K, ConvInteger's flattened
  (channel, kernel rows, kernel columns) per output channel; an odd K leaves the last term alone;
- the products are of the *raw* stored values (uint8 in [0, 255], int8 in [-128, 127]); zero points
  are applied afterwards, exactly, through row and column sums, so they never saturate;
- which side is uint8 is what counts: MatMulInteger uint8 A x int8 B and ConvInteger with int8 x
  and uint8 w saturate; int8 A x uint8 B, ConvInteger uint8 x x int8 w, and uint8 x uint8 or
  int8 x int8 do not (measured, every combination, with extreme values);
- with that model the kernel's int32 output was reproduced bit for bit on 260 random cases up to
  K = 3000, batched A, 1 and 2 threads, graph optimisation off and on (docs/numerics.md).

So with constant weights (the side that is not the activation), each output column (MatMul) or
channel (Conv) differs from the ONNX definition by at most the sum, over its pairs, of how far the
pair's sum can leave int16 for *any* activation: :func:`pair_excess`. A pair that cannot leave
int16 contributes 0; a column all of whose pairs cannot is bit-exact.

``session.x64quantprecision = 1`` (onnxruntime's ``kOrtSessionOptionsAvx2PrecisionMode``) converts
constant int8 weights beyond [-64, 64] to uint8 at graph optimisation level 2 and above, and the
uint8 x uint8 kernel does not saturate: the ONNX definition bit for bit (measured). It is a session
setting of whoever runs the model, off by default, and inert with optimisation off (``verify``'s
default), so the rewrite's bound is stated against the default.
"""

from __future__ import annotations

import numpy as np

__all__ = ["INT16", "pair_excess", "pair_saturation", "rows", "saturating_operands"]

INT16 = (-32768, 32767)
#: Elements per step when reading large weights (bounded memory).
_CHUNK = 1 << 20


def saturating_operands(activation: str, weights: str, *, conv: bool) -> bool:
    """Whether onnxruntime's kernel pairs products into int16 for these operand types (dtype names):
    MatMul: uint8 activations (A) x int8 weights (B); Conv: int8 activations (x) x uint8 weights (w)."""
    if conv:
        return activation == "int8" and weights == "uint8"
    return activation == "uint8" and weights == "int8"


def rows(weights: np.ndarray, conv: bool) -> np.ndarray:
    """The weights as [output column or channel, K], the order the kernel pairs them along K (a view
    where possible): Conv's w flattened over (channel, kernel row, kernel column); MatMul's B
    transposed, batched B's matrices one after another."""
    if conv:
        return weights.reshape(weights.shape[0], -1)
    if weights.ndim < 2:
        return weights.reshape(1, -1)
    return np.moveaxis(weights, -2, -1).reshape(-1, weights.shape[-2])


def pair_excess(rows: np.ndarray, weights_dtype: str, *, any_pairing: bool = False) -> np.ndarray:
    """Per row of ``rows`` ([columns or channels, K], the raw constant weights along K), the largest
    amount by which the saturating kernel's result can differ from the exact one, in int32 units:
    sum over the pairs (2j, 2j+1) of max(0, most - 32767, -32768 - least), where most/least are
    the pair's largest/smallest sum over every activation value of the other type.

    int8 weights (activations uint8 in [0, 255]): most = 255 * (pos(w0) + pos(w1)), least =
    255 * (neg(w0) + neg(w1)). uint8 weights (activations int8 in [-128, 127]): most =
    127 * (w0 + w1), least = -128 * (w0 + w1).

    ``any_pairing``: the largest such sum over *every* way of pairing the K terms, for kernels whose
    pairing is not the (2j, 2j+1) of MLAS's GEMM. A pair of opposite signs never leaves int16
    (255 * 127 < 32767), the excess is convex and non-decreasing in the pair's sum, so pairing the
    positive weights in sorted order (largest two, next two, ...) and the negative ones likewise
    is the worst case."""
    if any_pairing:
        ordered = np.sort(rows.astype(np.int64), axis=1)
        positive = np.where(ordered > 0, ordered, 0)[:, ::-1]  # largest first
        negative = np.where(ordered < 0, ordered, 0)  # most negative first
        both = np.concatenate([positive, negative], axis=1)
        if both.shape[1] % 4:  # keep each half's pairs aligned: pad each half to even length
            pad = np.zeros((rows.shape[0], 1), np.int64)
            both = np.concatenate([positive, pad, negative, pad], axis=1) if rows.shape[1] % 2 else both
        return pair_excess(both, weights_dtype)
    n, k = rows.shape
    out = np.zeros(n, np.int64)
    if k < 2 or n == 0:
        return out
    if weights_dtype == "int8":
        hi, lo = 255, 0  # the activation's range, times a positive weight gives [0, 255 w]
    else:
        hi, lo = 127, -128
    pairs = k // 2
    per_step = max(1, _CHUNK // k)
    for start in range(0, n, per_step):
        w = rows[start : start + per_step, : 2 * pairs].astype(np.int64).reshape(-1, pairs, 2)
        most = np.maximum(w * hi, w * lo).sum(axis=2)
        least = np.minimum(w * hi, w * lo).sum(axis=2)
        excess = np.maximum(np.maximum(most - INT16[1], INT16[0] - least), 0)
        out[start : start + per_step] = excess.sum(axis=1)
    return out


def pair_saturation(activations: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """For these uint8 activations ([N, K], raw) times int8 weight rows ([C, K], raw, as
    :func:`rows` lays them out), per (n, c): the sum over the kernel's pairs (2j, 2j+1) of how far
    the pair's sum leaves int16, so ``|saturating kernel - exact| <= this`` for these activations,
    in int32 units (no cancellation between pairs assumed). At most :func:`pair_excess`, and 0 where
    no pair saturates: a bound of the actual inputs, not the worst ones. Only the pairs that can
    leave int16 for some activation are computed, in steps of bounded memory."""
    n, k = activations.shape
    out = np.zeros((n, rows.shape[0]), np.int64)
    pairs = k // 2
    if pairs == 0 or n == 0 or rows.shape[0] == 0:
        return out
    w = rows[:, : 2 * pairs].astype(np.int32).reshape(rows.shape[0], pairs, 2)
    most, least = (np.maximum(w, 0) * 255).sum(axis=2), (np.minimum(w, 0) * 255).sum(axis=2)
    can = np.flatnonzero(((most > INT16[1]) | (least < INT16[0])).any(axis=0))
    if can.size == 0:
        return out
    w = w[:, can, :]
    a = activations[:, : 2 * pairs].astype(np.int32).reshape(n, pairs, 2)[:, can, :]
    per_step = max(1, _CHUNK // (can.size * rows.shape[0]))
    for start in range(0, n, per_step):
        part = a[start : start + per_step, None, :, :]
        sums = part[..., 0] * w[None, :, :, 0] + part[..., 1] * w[None, :, :, 1]
        out[start : start + per_step] = np.abs(sums - np.clip(sums, *INT16)).sum(axis=2)
    return out
