"""Per-element bounds of the ``com.microsoft`` un-fuse rules (rules/80-contrib-fusions.toml), as
:mod:`.element_bounds` evaluates them at the node: each the bound its rule states (the builder's
contract, ``docs/lowerings.md``), from the original node and the values it reads on the sample.

``layer-norm-rows``
    SkipLayerNormalization, SkipSimplifiedLayerNormalization, SimplifiedLayerNormalization. With
    ``v`` the row the kernel normalizes (input + skip + bias), its mean (0 for the simplified forms)
    and ``inv_std = 1 / sqrt(var + epsilon)`` (var: of ``v - mean``; the simplified forms: the mean
    of ``v²``) in float64, ``c = 8 + h/16`` (h the row's length; the simplified forms
    ``8 + gamma(h)/u``, ``gamma(h) = h·u/(1 - h·u)``: their squares all have one sign), ``u = 2^-24``: y within
    ``c·u·(|y| + 1 + |γ|·(1 + |x̂|)·|mean|·inv_std)``, ``x̂ = (v - mean)·inv_std``; the mean output
    within ``c·u·max|v|`` over the row (the simplified forms: 0); inv_std_var within
    ``c·u·inv_std·(1 + |mean|·inv_std)``; the sum output 0 (bit-exact). float16 y: plus one float16
    ulp of the larger of the two results.
``layer-norm-two-pass``
    LayerNormalization decomposed in two passes (form elementwise-decompositions): y within
    ``16·u·(|y| + |γ|·(1 + |mean|/σ))`` over the last axis, ``σ = sqrt(var + epsilon)``.
``attention-scores``
    Attention, QAttention (the projection rounding only: no uint8 x int8 pair saturation, which
    ``u8s8-attention`` bounds), MultiHeadAttention, GroupQueryAttention: every output element within
    ``2^-20·(1 + S)·max|V|``, ``S`` the node's largest ``|score|`` and ``max|V|`` over every value
    it attends (past included), in float64 from the node's inputs: ``S = max|scale·Q·Kᵀ|`` over its
    heads and keys (past included) plus ``max|attention_bias|`` (Attention's and MultiHeadAttention's
    output: per query row, ``|score| + |attention_bias|`` over the keys within 104 of the row's largest
    biased score, whose softmax weights are not 0 in float32), and at the query rows whose every key
    is masked (Attention, MultiHeadAttention) plus ``|mask_filter_value|`` there only; GroupQueryAttention: its head
    sinks count as scores, and with do_rotary ``S`` is ``scale·r²·max‖q‖·max‖k‖`` per head
    (Cauchy-Schwarz; r = max|cos| + max|sin|, at least 1: what the rotation can stretch a pair by),
    so an upper bound of the rotated scores. float16 outputs: plus one float16 ulp. Present
    outputs: Attention's and QAttention's new keys and values within ``2·(K + 1)·u·(|x|·|W| + |b|)``
    (K the input hidden size), their past part 0; MultiHeadAttention's and GroupQueryAttention's 0
    (copies). MultiHeadAttention's qk output within ``2^-20·(1 + S)`` at query sequence 1, else 0;
    GroupQueryAttention's output_qk within ``2^-20·(1 + S)`` (float16: plus one ulp) at the keys
    ``< seqlens_k[b] + 1`` and unbounded beyond, where the kernel does not write it
    (:mod:`.undefined`).
``fast-gelu-tanh``
    FastGelu decomposed below opset 20: ``2^-21·(|x| + 1)``, x the input plus its bias.
``fused-matmul-sum-order``
    FusedMatMul with alpha != 1 or transA: ``2·gamma(K)·|alpha|·(|A|·|B|) + 2u·max(|y|, |y'|)``,
    A and B as the kernel reads them (transposed, batch axes moved), ``gamma(K) = K·u / (1 - K·u)``.
``embed-layer-norm``
    EmbedLayerNormalization and QEmbedLayerNormalization: output 0 within
    ``u·(4·(|γ·x̂| + |β| + 1) + h·|γ·x̂|)``, x̂ the normalized embedding sum (the words', positions'
    and segments' rows gathered, dequantized for the quantized form, in float64), h the hidden size;
    QEmbedLayerNormalization plus ``12·u·|γ|·(1 + |x̂|)·M/σ``, M the row's largest
    ``|w| + |p| + |s|``, σ its standard deviation; the mask index and the embedding sum 0 (bit-exact).

Each is the rule's own words; where they name a maximum, the node's largest value on the sample (the
looser reading: sound, and still far below what a broken rewrite moves, tests/test_contrib_bounds.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx

from onnx_qrewrite.rewriter.builders.contracts import (
    ATTENTION_FORMULA,
    EMBED_FORMULA,
    FAST_GELU_FORMULA,
    FUSED_MATMUL_FORMULA,
    LAYER_NORM_FORMULA,
    LAYER_NORM_TWO_PASS_FORMULA,
)

__all__ = ["READS", "evaluate"]

_U = 2.0**-24


def summation_gamma(k: int) -> float:
    """Higham's float32 summation error factor of k terms, ``k·u / (1 - k·u)``, u = 2^-24 (one
    definition for this module and :mod:`.element_bounds`)."""
    return k * _U / (1 - k * _U)


_ATTENTION_ROUNDING = 2.0**-20


#: formula -> op -> the original node's input indices it reads.
READS: dict[str, dict[str, tuple[int, ...]]] = {
    LAYER_NORM_FORMULA: {
        "SkipLayerNormalization": (0, 1, 2, 3, 4),
        "SkipSimplifiedLayerNormalization": (0, 1, 2, 3),
        "SimplifiedLayerNormalization": (0, 1),
    },
    LAYER_NORM_TWO_PASS_FORMULA: {"LayerNormalization": (0, 1)},
    ATTENTION_FORMULA: {
        "Attention": (0, 1, 2, 3, 4, 5),
        "QAttention": (0, 1, 2, 3, 4, 5, 6, 7, 8),
        "MultiHeadAttention": (0, 1, 2, 3, 4, 5, 6, 7),
        "GroupQueryAttention": (0, 1, 2, 3, 4, 5, 7, 8, 10, 11),
    },
    FAST_GELU_FORMULA: {"FastGelu": (0, 1)},
    FUSED_MATMUL_FORMULA: {"FusedMatMul": (0, 1)},
    EMBED_FORMULA: {
        "EmbedLayerNormalization": (0, 1, 2, 3, 4, 5, 6, 7, 8),
        "QEmbedLayerNormalization": tuple(range(18)),
    },
}


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _get(node: onnx.NodeProto, values: Mapping[str, np.ndarray], index: int) -> np.ndarray | None:
    """Input ``index`` in float64 (integers as they are), None where absent."""
    if index < len(node.input) and node.input[index]:
        value = np.asarray(values[node.input[index]])
        return value.astype(np.float64) if value.dtype.kind == "f" else value
    return None


def _larger(expected: np.ndarray, actual: np.ndarray) -> np.ndarray:
    return np.maximum(np.abs(expected.astype(np.float64)), np.abs(actual.astype(np.float64)))


def _float16_ulp(expected: np.ndarray, actual: np.ndarray) -> np.ndarray | float:
    """One float16 ulp of the larger result where the output is float16 (the kernel rounds once), else 0."""
    if expected.dtype != np.float16:
        return 0.0
    with np.errstate(invalid="ignore", over="ignore"):  # an infinite output: a NaN bound (only equal values pass)
        return np.spacing(_larger(expected, actual).astype(np.float16)).astype(np.float64)


def _top(value: np.ndarray | None) -> float:
    return float(np.max(np.abs(value), initial=0.0)) if value is not None and value.size else 0.0


# --- layer-norm-rows --------------------------------------------------------------------------------


def _layer_norm(node: onnx.NodeProto, values: Mapping[str, np.ndarray], expected: np.ndarray, output: int) -> Any:
    op = node.op_type
    skip = op.startswith("Skip")
    simplified = "Simplified" in op
    v = _get(node, values, 0)
    assert v is not None
    if skip:
        s = _get(node, values, 1)
        assert s is not None
        v = v + s
        bias = _get(node, values, 4 if op == "SkipLayerNormalization" else 3)
        if bias is not None:
            v = v + bias
    gamma = _get(node, values, 2 if skip else 1)
    assert gamma is not None
    eps = float(_attrs(node).get("epsilon", 1e-12 if skip else 1e-5))
    h = v.shape[-1]
    # The simplified forms sum h squares of one sign: two summation orders of rows of large, alike
    # values differ by up to gamma(h) of the sum (h/16 was exceeded 1.67x at h 2048, rows ~1e7: review
    # 5 R8), halved by the square root; the centred forms' squares are of spread-sized deviations.
    c = (8 * _U + summation_gamma(h)) if simplified else (8 + h / 16) * _U
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):  # non-finite rows: NaN bounds there
        mean = np.zeros((*v.shape[:-1], 1)) if simplified else v.mean(-1, keepdims=True)
        spread = v * v if simplified else (v - mean) ** 2
        inv_std = 1 / np.sqrt(spread.mean(-1, keepdims=True) + eps)
        # Outputs: Skip forms (y, mean, inv_std_var, sum); SimplifiedLayerNormalization (y, inv_std_var).
        role = ("y", "mean", "inv_std", "sum")[output] if skip else ("y", "inv_std")[output]
        if role == "sum" or (role == "mean" and simplified):
            return np.zeros(1)
        if role == "mean":
            return c * np.max(np.abs(v), axis=-1, keepdims=True)
        if role == "inv_std":
            return c * inv_std * (1 + np.abs(mean) * inv_std)
        x_hat = np.abs(v - mean) * inv_std
        y = np.abs(expected.astype(np.float64))
        return c * (y + 1 + np.abs(gamma) * (1 + x_hat) * np.abs(mean) * inv_std)


def _layer_norm_two_pass(node: onnx.NodeProto, values: Mapping[str, np.ndarray], expected: np.ndarray) -> Any:
    x, gamma = _get(node, values, 0), _get(node, values, 1)
    assert x is not None and gamma is not None
    eps = float(_attrs(node).get("epsilon", 1e-5))
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):  # non-finite rows: NaN bounds there
        mean = x.mean(-1, keepdims=True)
        sigma = np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps)
        return 16 * _U * (np.abs(expected.astype(np.float64)) + np.abs(gamma) * (1 + np.abs(mean) / sigma))


# --- attention-scores ------------------------------------------------------------------------------


def _heads(t: np.ndarray, heads: int) -> np.ndarray:
    """(B, S, N·H) -> (B, N, S, H)."""
    return np.moveaxis(t.reshape((*t.shape[:-1], heads, t.shape[-1] // heads)), -2, -3)


def _scores_top(q: np.ndarray, k: np.ndarray, scale: float) -> float:
    """max |scale·q·kᵀ| over (B, N, S, H) x (B, N, T, H) (or their broadcast groups)."""
    if not q.size or not k.size:
        return 0.0
    return float(np.max(np.abs(scale * (q @ np.swapaxes(k, -1, -2)))))


#: Below the row's largest score by more than this, a key's softmax weight is 0 in float32 on both
#: sides (exp(-104) is below the smallest subnormal): its score's size does not reach the output.
_DEAD_SCORE = 104.0


def _live_scores_top(q: np.ndarray, k: np.ndarray, scale: float, bias: np.ndarray | None) -> np.ndarray | float:
    """(B, S, 1): per query row and over the heads, the largest ``|scale·q·kᵀ| + |bias|`` among the
    keys whose biased score is within :data:`_DEAD_SCORE` of the row's largest; without a bias, the
    node's ``max|scale·q·kᵀ|``. An additive padding mask in the bias (-10000, or float32's lowest)
    then widens no row by its size (review 5 R6: it made the bound blind to a 1% scale error); a
    row whose every key it masks keeps the bias's size."""
    if bias is None or not q.size or not k.size:
        return _scores_top(q, k, scale)
    with np.errstate(invalid="ignore", over="ignore"):  # -inf biases: such keys are dead, NaN stays NaN
        scores = scale * (q @ np.swapaxes(k, -1, -2))
        biased = scores + bias
        live = biased >= np.max(biased, axis=-1, keepdims=True) - _DEAD_SCORE
        size = np.where(live, np.abs(scores) + np.abs(np.broadcast_to(bias, biased.shape)), 0.0)
        return np.max(size, axis=(1, -1))[..., None]


def _masked_rows(
    mask: np.ndarray | None, batch: int, seq: int, keys: int, past: int, causal: bool
) -> np.ndarray | None:
    """(B, S): the query rows whose every key is masked, None without a mask: 1-D key lengths (B, or
    2B with start positions, or MultiHeadAttention's 3B + 2: the first B), 2-D (B, T) and 3-D
    (B, S, T) 0/1 masks (> 0 attended), with the causal mask where ``causal``."""
    if mask is None:
        return None
    try:
        return _rows_without_keys(mask, batch, seq, keys, past, causal)
    except ValueError:  # a mask over another key count (a shared past buffer): every row may be
        return np.ones((batch, seq), bool)


def _rows_without_keys(mask: np.ndarray, batch: int, seq: int, keys: int, past: int, causal: bool) -> np.ndarray:
    positions = np.arange(keys)
    if mask.ndim == 1:
        ends = mask[:batch].reshape(batch, 1, 1)
        starts = mask[batch : 2 * batch].reshape(batch, 1, 1) if mask.size == 2 * batch else 0
        attended = (positions < ends) & (positions >= starts)
    elif mask.ndim == 2:
        attended = (mask > 0)[:, None, :]
    else:
        attended = mask > 0
    attended = np.broadcast_to(attended, (batch, seq, keys))
    if causal:
        attended = attended & (positions[None, None, :] <= past + np.arange(seq)[None, :, None])
    return np.asarray(~attended.any(axis=-1))


def _filter_term(attrs: Mapping[str, Any], rows: np.ndarray | None) -> np.ndarray | float:
    """|mask_filter_value| at the rows whose every key is masked (B, S, 1), 0 elsewhere: there the
    filter joins each score (the kernel and the rewrite each add it in float32), elsewhere the
    masked keys' weights vanish (review 5 R5: one such row must not loosen every other row's bound)."""
    if rows is None or not rows.any():
        return 0.0
    return abs(float(attrs.get("mask_filter_value", -10000.0))) * rows[:, :, None].astype(np.float64)


def _attention_projection(node: onnx.NodeProto, values: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(x·W + b, |x|·|W| + |b|) in float64 (QAttention: the dequantized integer projection)."""
    if node.op_type == "QAttention":
        from onnx_qrewrite.verify.element_bounds import qattention_projection  # (a cycle at import time)

        projection, _ = qattention_projection(node, values, saturates=False)
        x, w = (np.asarray(values[node.input[i]]).astype(np.float64) for i in (0, 1))
        x_zp, w_zp = _get(node, values, 6), _get(node, values, 7)
        x = x - (0.0 if x_zp is None else np.asarray(x_zp, np.float64).reshape(()))
        w = w - (0.0 if w_zp is None else np.asarray(w_zp, np.float64).reshape(1, -1))
        scales = [np.asarray(values[node.input[i]], np.float64).reshape(-1) for i in (3, 4)]
        step = np.abs(scales[0] * scales[1])
        magnitude = (np.abs(x) @ np.abs(w)) * step + np.abs(np.asarray(values[node.input[2]], np.float64))
        return projection, magnitude
    x_in, w_in, b_in = (_get(node, values, i) for i in range(3))
    assert x_in is not None and w_in is not None and b_in is not None
    return x_in @ w_in + b_in, np.abs(x_in) @ np.abs(w_in) + np.abs(b_in)


def _attention(node: onnx.NodeProto, values: Mapping[str, np.ndarray], expected: np.ndarray, output: int) -> Any:
    """Attention and QAttention (outputs y, present)."""
    attrs = _attrs(node)
    heads = int(attrs["num_heads"])
    projection, magnitude = _attention_projection(node, values)
    hidden = projection.shape[-1] // 3
    sizes = [int(s) for s in attrs.get("qkv_hidden_sizes", [])] or [hidden] * 3
    cut = np.cumsum(sizes)[:2]
    q, k, v = (_heads(t, heads) for t in np.split(projection, cut, axis=-1))
    past = _get(node, values, 8 if node.op_type == "QAttention" else 4)
    if output == 1:  # present (2, B, N, P + S, H): the past copied, the new K and V the projection
        _, k_bound, v_bound = (_heads(t, heads) for t in np.split(magnitude, cut, axis=-1))
        new = 2 * (values[node.input[0]].shape[-1] + 1) * _U * np.stack([k_bound, v_bound])
        if past is None:
            return new
        return np.concatenate([np.zeros(past.shape), new], axis=3)
    if past is not None:
        k, v = np.concatenate([past[0], k], axis=2), np.concatenate([past[1], v], axis=2)
    scale = float(attrs.get("scale", 0.0)) or 1 / np.sqrt(q.shape[-1])
    attention_bias = _get(node, values, 5) if node.op_type == "Attention" else None  # QAttention has none
    top = _live_scores_top(q, k, scale, attention_bias)
    mask = _get(node, values, 3 if node.op_type == "Attention" else 5)
    past_length = 0 if past is None else past.shape[3]
    rows = _masked_rows(mask, q.shape[0], q.shape[2], k.shape[2], past_length, bool(attrs.get("unidirectional", 0)))
    return _ATTENTION_ROUNDING * (1 + top + _filter_term(attrs, rows)) * _top(v)  # (B, S, 1): y (B, S, D)


def _mha_key(t: np.ndarray, bias: np.ndarray | None, heads: int) -> np.ndarray:
    """A 3-D key or value (B, L, D) plus its bias slice, as heads; a 4-D one (B, N, L, H) as it is."""
    if t.ndim == 4:
        return t
    return _heads(t if bias is None else t + bias, heads)


def _multi_head_attention(
    node: onnx.NodeProto, values: Mapping[str, np.ndarray], expected: np.ndarray, output: int
) -> Any:
    if output in (1, 2):  # present_key / present_value: copies
        return np.zeros(1)
    attrs = _attrs(node)
    heads = int(attrs["num_heads"])
    q, k, v, bias = (_get(node, values, i) for i in range(4))
    assert q is not None and k is not None and v is not None
    hidden = q.shape[-1]
    parts: list[np.ndarray | None] = [None, None, None]
    if bias is not None:
        parts = [bias[:hidden], bias[hidden : 2 * hidden], bias[2 * hidden :]]
    qh = _heads(q if parts[0] is None else q + parts[0], heads)
    kh, vh = _mha_key(k, parts[1], heads), _mha_key(v, parts[2], heads)
    past_key, past_value = _get(node, values, 6), _get(node, values, 7)
    past_length = 0
    if past_key is not None and past_value is not None:
        kh, vh = np.concatenate([past_key, kh], axis=2), np.concatenate([past_value, vh], axis=2)
        past_length = past_key.shape[2]
    scale = float(attrs.get("scale", 0.0)) or 1 / np.sqrt(qh.shape[-1])
    attention_bias = _get(node, values, 5)
    mask = _get(node, values, 4)
    batch, seq, keys = qh.shape[0], qh.shape[2], kh.shape[2]
    rows = _masked_rows(mask, batch, seq, keys, past_length, bool(attrs.get("unidirectional", 0)))
    if output == 3:  # qk (B, N, S, T): the scores, rounded differently only at one query (MLAS's GEMV)
        per_row = 1 + _scores_top(qh, kh, scale) + _top(attention_bias) + _filter_term(attrs, rows)
        rows_first = per_row[:, None] if isinstance(per_row, np.ndarray) else per_row
        return _ATTENTION_ROUNDING * rows_first if seq == 1 else np.zeros(1)
    per_row = 1 + _live_scores_top(qh, kh, scale, attention_bias) + _filter_term(attrs, rows)  # (B, S, 1)
    return _ATTENTION_ROUNDING * per_row * _top(vh)


def _norms_top(t: np.ndarray) -> float:
    return float(np.max(np.sqrt(np.sum(t * t, axis=-1)), initial=0.0)) if t.size else 0.0


def _group_query_attention(
    node: onnx.NodeProto, values: Mapping[str, np.ndarray], expected: np.ndarray, actual: np.ndarray, output: int
) -> Any:
    if output in (1, 2):  # present_key / present_value: copies
        return np.zeros(1)
    attrs = _attrs(node)
    heads, kv_heads = int(attrs["num_heads"]), int(attrs["kv_num_heads"])
    q, k, v = (_get(node, values, i) for i in range(3))
    assert q is not None
    if k is None or v is None:  # packed (B, S, (N + 2 Nkv) H)
        head = q.shape[-1] // (heads + 2 * kv_heads)
        q, k, v = np.split(q, np.cumsum([heads * head, kv_heads * head]), axis=-1)
    head = q.shape[-1] // heads
    groups = heads // kv_heads
    qh = _heads(q, heads).reshape((q.shape[0], kv_heads, groups, q.shape[1], head))
    kh, vh = _heads(k, kv_heads)[:, :, None], _heads(v, kv_heads)
    past_key, past_value = _get(node, values, 3), _get(node, values, 4)
    if past_key is not None and past_value is not None:
        kh = np.concatenate([past_key[:, :, None], kh], axis=3)
        vh = np.concatenate([past_value, vh], axis=2)
    scale = float(attrs.get("scale", 0.0)) or 1 / np.sqrt(head)
    if attrs.get("do_rotary", 0):
        cos, sin = _get(node, values, 7), _get(node, values, 8)
        stretch = max(1.0, _top(cos) + _top(sin))
        top = abs(scale) * stretch**2 * _norms_top(qh) * _norms_top(kh)
    else:
        top = _scores_top(qh, kh, scale)
    top = max(top, _top(_get(node, values, 11))) + _top(_get(node, values, 10))
    ulp = _float16_ulp(expected, actual)
    if output == 3:  # output_qk: unwritten by the kernel at the keys >= seqlens_k[b] + 1
        lengths = np.asarray(values[node.input[5]]).reshape(-1).astype(np.int64) + 1
        written = np.arange(expected.shape[-1])[None, :] < lengths[:, None]
        return np.where(written[:, None, None, :], _ATTENTION_ROUNDING * (1 + top) + ulp, np.inf)
    return _ATTENTION_ROUNDING * (1 + top) * _top(vh) + ulp


# --- fast-gelu-tanh, fused-matmul-sum-order ----------------------------------------------------------


def _fast_gelu(node: onnx.NodeProto, values: Mapping[str, np.ndarray]) -> Any:
    x, b = _get(node, values, 0), _get(node, values, 1)
    assert x is not None
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf: a NaN bound, only equal values pass
        return 2.0**-21 * (np.abs(x if b is None else x + b) + 1)


def _fused_matmul(
    node: onnx.NodeProto, values: Mapping[str, np.ndarray], expected: np.ndarray, actual: np.ndarray
) -> Any:
    from onnx_qrewrite.rewriter.builders.contrib_fusions import matmul_operand_perm  # registers its builders

    attrs = _attrs(node)
    operands = []
    for i, (trans, batch) in enumerate((("transA", "transBatchA"), ("transB", "transBatchB"))):
        t = _get(node, values, i)
        assert t is not None
        perm = matmul_operand_perm(t.ndim, bool(attrs.get(trans, 0)), bool(attrs.get(batch, 0)))
        operands.append(np.abs(np.transpose(t, perm)))
    k = operands[0].shape[-1]
    alpha = abs(float(attrs.get("alpha", 1.0)))
    with np.errstate(invalid="ignore", over="ignore"):  # non-finite inputs: NaN or infinite bounds there
        return 2 * summation_gamma(k) * alpha * (operands[0] @ operands[1]) + 2 * _U * _larger(expected, actual)


# --- embed-layer-norm ------------------------------------------------------------------------------


def _dequantized(node: onnx.NodeProto, values: Mapping[str, np.ndarray], index: int, scale: int) -> np.ndarray:
    """QEmbedLayerNormalization's table ``index`` dequantized with its scale (``scale``) and zero
    point (``scale + 5``), in float64."""
    table = np.asarray(values[node.input[index]]).astype(np.float64)
    step = float(np.asarray(values[node.input[scale]], np.float64).reshape(()))
    zero = _get(node, values, scale + 5)
    return (table - (0.0 if zero is None else float(np.asarray(zero).reshape(())))) * step


def _embed(node: onnx.NodeProto, values: Mapping[str, np.ndarray], output: int) -> Any:
    """EmbedLayerNormalization(input_ids, segment_ids, word, position, segment, gamma, beta, mask,
    position_ids); QEmbedLayerNormalization(input_ids, segment_ids, word, position, segment, gamma,
    beta, mask, then the scales of word, position, segment, gamma, beta, then their zero points)."""
    if output != 0:  # mask index, embedding sum: bit-exact
        return np.zeros(1)
    quantized = node.op_type == "QEmbedLayerNormalization"
    ids = np.asarray(values[node.input[0]]).astype(np.int64)
    if quantized:
        word, position, segment, gamma, beta = (
            _dequantized(node, values, i, i + 6) if i < len(node.input) and node.input[i] else None
            for i in (2, 3, 4, 5, 6)
        )
        position_ids = None
    else:
        word, position, segment, gamma, beta = (_get(node, values, i) for i in (2, 3, 4, 5, 6))
        position_ids = _get(node, values, 8)
    assert word is not None and position is not None and gamma is not None
    segment_ids = _get(node, values, 1)
    positions = np.broadcast_to(
        np.arange(ids.shape[1]) if position_ids is None else position_ids.astype(np.int64), ids.shape
    )
    rows = [word[ids], position[positions]]
    if segment is not None and segment_ids is not None:
        rows.append(segment[segment_ids.astype(np.int64)])
    total = rows[0] + rows[1] + (rows[2] if len(rows) > 2 else 0.0)
    h = total.shape[-1]
    mean = total.mean(-1, keepdims=True)
    sigma = np.sqrt(((total - mean) ** 2).mean(-1, keepdims=True) + float(_attrs(node).get("epsilon", 1e-12)))
    x_hat = (total - mean) / sigma
    g = np.abs(gamma * x_hat)
    b = np.abs(beta) if beta is not None else 0.0
    bound = _U * (4 * (g + b + 1) + h * g)
    if quantized:
        largest = np.max(np.sum([np.abs(r) for r in rows], axis=0), axis=-1, keepdims=True)
        bound = bound + 12 * _U * np.abs(gamma) * (1 + np.abs(x_hat)) * largest / sigma
    return bound


def evaluate(
    formula: str,
    node: onnx.NodeProto,
    values: Mapping[str, np.ndarray],
    expected: np.ndarray,
    actual: np.ndarray,
    output: int = 0,
) -> np.ndarray:
    """The bound of ``formula`` at every element of the node's output ``output`` (broadcastable)."""
    return np.asarray(_evaluate(formula, node, values, expected, actual, output), np.float64)


def _evaluate(
    formula: str,
    node: onnx.NodeProto,
    values: Mapping[str, np.ndarray],
    expected: np.ndarray,
    actual: np.ndarray,
    output: int,
) -> Any:
    if formula == LAYER_NORM_FORMULA:
        bound = _layer_norm(node, values, expected, output)
        return bound + _float16_ulp(expected, actual) if output == 0 else bound
    if formula == LAYER_NORM_TWO_PASS_FORMULA:
        return _layer_norm_two_pass(node, values, expected)
    if formula == ATTENTION_FORMULA:
        if node.op_type == "MultiHeadAttention":
            return _multi_head_attention(node, values, expected, output)
        if node.op_type == "GroupQueryAttention":
            return _group_query_attention(node, values, expected, actual, output)
        return _attention(node, values, expected, output)
    if formula == FAST_GELU_FORMULA:
        return _fast_gelu(node, values)
    if formula == FUSED_MATMUL_FORMULA:
        return _fused_matmul(node, values, expected, actual)
    assert formula == EMBED_FORMULA, formula
    return _embed(node, values, output)
