"""onnxruntime's ``com.microsoft`` RotaryEmbedding -> Gather, Slice and float arithmetic (what LLM
exports through onnxruntime.transformers' optimizer and onnxruntime-genai carry)::

    RotaryEmbedding(x, position_ids, cos_cache, sin_cache)
        cos, sin = cos_cache[positions], sin_cache[positions]
        x1, x2   = the halves of each head's first rotary_embedding_dim values (interleaved: even, odd)
        out1     = fma(x1, cos, -(x2 · sin))      out2 = fma(x1, sin, x2 · cos)
        the head's values after rotary_embedding_dim pass through

in onnxruntime 1.31.1's CPU kernel order (``MlasRotaryEmbedOneRow``; on x86 with AVX2 its
``RopeKernel_Avx2_fp32``): the product with ``x2`` is rounded to float32, the one with ``x1`` is not
(``_mm256_fmsub_ps`` / ``_mm256_fmadd_ps``: one rounding for ``x1·c ± round(x2·s)``). Standard ops have no
fused multiply-add, so the rewrite computes it exactly in float64 (a product of two float32 values is
exact there), recovers the float64 sum's rounding error (TwoSum) and corrects the one case where
rounding float64 to float32 rounds twice (the float64 sum is a float32 tie and the error says which
side the exact value is on); a NaN operand is the result as x86 orders them (a, b, then c, d of
``r``), whatever order onnxruntime's elementwise kernels take their operands in. float16: the kernel
converts to float32 and back; a product of float16 values is exact in float32, so plain Mul and
Sub/Add round as it does (interleaved tails included). Bit-exact with the kernel on the tests'
battery (3-D and 4-D inputs, partial rotary dims, position ids as a start or per token, zeros,
subnormals, ±inf, NaN payloads, and ties built so that plain float64 rounding fails). On x86 CPUs
without AVX2, MLAS's scalar fallback rounds both products: the rewrite matches the AVX2 kernel.
One case is not matched: a float64 sum that is exactly the tie between FLT_MAX and infinity rounds
to infinity even where the exact value lies below it.

Positions: ``position_ids`` of one element is a start (``start + 0..S-1``), (B, S) gives each token's.
Layouts: (B, S, hidden) with ``num_heads`` heads, or (B, num_heads, S, head_size). ``scale`` is not used
by the CPU kernel (only by a cache update it does not implement); ``is_packed_batching`` only lifts the
kernel's check that S fits the cache, which a position outside the cache still fails in both.

float32 interleaved with a rotary dim that is not a multiple of 16 (option ``interleaved_tail``,
**bounded**): the AVX2 kernel rotates whole blocks of 16 values (8 pairs) as above and the pairs after
the last one in a scalar tail that rounds them two ways (measured on onnxruntime 1.31.1: the tail's
first pair as the blocks, fused; the others with both products rounded, ``round(round(x1·cos) -
round(x2·sin))``). The rewrite computes the fused form everywhere: bit-exact up to the tail, and
within ``4·u·(|x1·cos| + |x2·sin|) + 2^-148`` (u = 2^-24; ``|x1·sin| + |x2·cos|`` for the odd
output) in it, the difference of the two roundings whatever order a build takes; ``verify``
checks it per element (``rotary-interleaved-tail``, onnx_qrewrite/verify/element_bounds.py).

Not lowered (the node stays, with the reason):
caches whose width is not rotary_embedding_dim / 2 (the kernel then reads them with the narrower
row stride), shapes that are not recorded. Where they differ on invalid input: a position outside
the cache is an error in the kernel; ``Gather`` reads negative positions from the end.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx

from onnx_qrewrite.rewriter import kernel_opsets
from onnx_qrewrite.rewriter.builders import Emitter, NoMatch, Plan, Site, register
from onnx_qrewrite.rewriter.builders._qdq import value_shape
from onnx_qrewrite.rewriter.builders.contracts import CONTRACTS, ROTARY_TAIL_FORMULA
from onnx_qrewrite.rewriter.graph import dtype_name

__all__ = ["INTERLEAVED_BLOCK", "RotaryEmbeddingBuilder", "emit_fma", "rotate"]

_T = onnx.TensorProto
#: The AVX2 kernel's interleaved form runs whole vectors of 16 values (8 pairs); what is left over
#: goes through a scalar tail whose pairs round in two ways (measured): exact for multiples of this,
#: bounded beyond (option ``interleaved_tail``).
INTERLEAVED_BLOCK = 16


def _static_shape(site: Site, index: int, what: str) -> tuple[int | None, ...]:
    shape = value_shape(site.scope, site.input(index), site.same_shape_ops)
    if shape is None:
        raise NoMatch(
            f"the shape of {what} {site.input(index)!r} is not recorded; run onnx shape inference on the model "
            "first (onnx.shape_inference.infer_shapes)"
        )
    return shape


def _geometry(site: Site, interleaved_tail_ok: bool) -> dict[str, Any]:
    """The kernel's head size, head count and rotary dim (rotary_embedding_helper.h's CheckInputs),
    refusing what its strides would read differently from the layout the rewrite assumes."""
    x_shape = _static_shape(site, 0, "input")
    cache = _static_shape(site, 2, "cos_cache")
    if len(x_shape) not in (3, 4) or len(cache) != 2 or cache[1] is None:
        raise NoMatch(
            f"input of rank {len(x_shape)} or cos_cache of shape {cache}: (B, S, D) or (B, N, S, H) and (M, d/2)"
        )
    if _static_shape(site, 3, "sin_cache")[1:] != cache[1:]:
        raise NoMatch("sin_cache and cos_cache differ in width")
    hidden = x_shape[2] if len(x_shape) == 3 else (x_shape[1] * x_shape[3] if x_shape[1] and x_shape[3] else None)
    if hidden is None:
        raise NoMatch("the hidden size (or heads and head size) of the input is not recorded")
    rotary, heads = int(site.attribute("rotary_embedding_dim", 0)), int(site.attribute("num_heads", 0))
    head = 2 * cache[1] if rotary == 0 else (hidden // heads if heads > 0 else 0)
    if rotary > 0 and heads <= 0:
        raise NoMatch("rotary_embedding_dim without num_heads: the kernel refuses it")
    heads = heads or (hidden // head if head else 0)
    rotary = rotary or head
    if head <= 0 or heads * head != hidden or (len(x_shape) == 4 and (x_shape[3] != head or x_shape[1] != heads)):
        raise NoMatch(f"{heads} heads of {head} values do not tile the input {x_shape} as the kernel reads it")
    if rotary % 2 or rotary > head or cache[1] * 2 != rotary:
        raise NoMatch(
            f"rotary dim {rotary} with a cache of width {cache[1]}: the kernel reads cache rows with stride "
            "rotary_embedding_dim / 2 (lowered only where that is the cache's width)"
        )
    interleaved = bool(site.attribute("interleaved", 0))
    if interleaved and rotary % INTERLEAVED_BLOCK and not interleaved_tail_ok:
        raise NoMatch(
            f"interleaved with rotary dim {rotary}: onnxruntime's AVX2 kernel rounds the pairs after the last "
            f"whole block of {INTERLEAVED_BLOCK} in two ways (measured); exact for multiples of {INTERLEAVED_BLOCK}"
        )
    return {"rank": len(x_shape), "head": head, "heads": heads, "rotary": rotary, "interleaved": interleaved}


class RotaryEmbeddingBuilder:
    """Replaces com.microsoft RotaryEmbedding with the cache look-ups and the kernel's fused
    multiply-adds, emulated exactly in float64."""

    name = "unfuse_rotary_embedding"
    contract = CONTRACTS["unfuse_rotary_embedding"]

    def quantized_dtype(self, site: Site) -> str | None:
        elem = site.elem_type(site.input(0))
        return dtype_name(elem) if elem else None

    def check(self, site: Site, options: Mapping[str, Any]) -> Plan:
        known = {"interleaved", "is_packed_batching", "num_heads", "rotary_embedding_dim", "scale"}
        site.no_unknown_attributes(known)
        if not all(site.input(i) for i in range(4)):
            raise NoMatch("malformed node: input, position_ids, cos_cache and sin_cache are required")
        types = {site.elem_type(site.input(index)) for index in (0, 2, 3)}
        if len(types) != 1 or not types <= {_T.FLOAT, _T.FLOAT16}:
            names = ", ".join(dtype_name(t) if t else "unrecorded" for t in types)
            raise NoMatch(f"input and caches are {names}: one type, float32 or float16, is lowered")
        elem = site.elem_type(site.input(1))
        if elem is not None and elem != _T.INT64:
            raise NoMatch(f"position_ids is {dtype_name(elem)}, not int64")
        positions = _static_shape(site, 1, "position_ids")
        if len(positions) == 2:
            start = False
        elif len(positions) <= 1 and all(d == 1 for d in positions):
            start = True
        else:
            raise NoMatch(f"position_ids of shape {positions}: one start or (batch, sequence) are lowered")
        half = types == {_T.FLOAT16}
        tail = options["interleaved_tail"]
        data = {**_geometry(site, interleaved_tail_ok=half or tail), "start": start, "float16": half}
        if tail and (half or not data["interleaved"] or data["rotary"] % INTERLEAVED_BLOCK == 0):
            raise NoMatch("no float32 interleaved tail: the exact rule applies")
        formula = ROTARY_TAIL_FORMULA if tail else None
        return Plan(min_opset=kernel_opsets.FORMS["rotary-embedding"], data=data, bound_formula=formula)

    def build(self, site: Site, emit: Emitter, options: Mapping[str, Any], plan: Plan) -> None:
        d = plan.data
        x, rotary = site.input(0), d["rotary"]
        heads_last = d["rank"] == 3  # (B, S, N, H) once split into heads; else (B, N, S, H)
        if heads_last:
            x = emit.op1("Reshape", [x, emit.const(np.array([0, 0, d["heads"], d["head"]], np.int64))])
        cos, sin = _cache_rows(emit, site, d["start"], heads_last)
        parts = rotate(emit, x, cos, sin, rotary, d["head"], interleaved=d["interleaved"], float16=d["float16"])
        output = site.node.output[0]
        if not heads_last:
            emit.op1("Concat", parts, output, axis=-1)
            return
        joined = emit.op1("Concat", parts, axis=-1)
        emit.op1("Reshape", [joined, emit.op1("Shape", [site.input(0)])], output)


def rotate(
    emit: Emitter, x: str, cos: str, sin: str, rotary: int, head: int, *, interleaved: bool, float16: bool
) -> list[str]:
    """The kernel's rotation of the first ``rotary`` values of each head of the 4-D ``x`` (heads on
    the last axis), ``cos``/``sin`` rows broadcastable to its (..., rotary / 2) halves; returns the
    parts whose Concat on the last axis is the result (the rest of each head passes through)."""
    half = rotary // 2
    if interleaved:
        x1, x2 = (_slice(emit, x, first, rotary, 2) for first in (0, 1))
    else:
        x1, x2 = _slice(emit, x, 0, half), _slice(emit, x, half, rotary)
    if float16:
        out1, out2 = _float16_rotation(emit, x1, x2, cos, sin)
    else:
        out1 = emit_fma(emit, x1, cos, x2, sin, subtract=True)
        out2 = emit_fma(emit, x1, sin, x2, cos)
    if interleaved:  # (..., half, 2) -> (..., rotary): even, odd, even, ...
        pairs = emit.op1("Concat", [_unsqueeze(emit, out1, [-1]), _unsqueeze(emit, out2, [-1])], axis=-1)
        parts = [emit.op1("Reshape", [pairs, emit.const(np.array([0, 0, 0, rotary], np.int64))])]
    else:
        parts = [out1, out2]
    if rotary < head:
        parts.append(_slice(emit, x, rotary, head))
    return parts


def _cache_rows(emit: Emitter, site: Site, start: bool, heads_last: bool) -> tuple[str, str]:
    """cos_cache and sin_cache rows at each token's position, broadcastable to the heads' layout."""
    positions = site.input(1)
    if start:  # the kernel: position_ids[0] + s for s in 0..S-1
        first = emit.op1("Reshape", [positions, emit.const(np.array([], np.int64))])
        x = site.input(0)
        length = emit.op1("Gather", [emit.op1("Shape", [x]), emit.const(np.int64(1 if heads_last else 2))], axis=0)
        positions = emit.op1("Range", [first, emit.op1("Add", [first, length]), emit.const(np.int64(1))])
    rows = [emit.op1("Gather", [site.input(i), positions], axis=0, hint=hint) for i, hint in ((2, "Cos"), (3, "Sin"))]
    if start:  # (S, d/2): broadcasts against (B, N, S, d/2); (B, S, N, d/2) needs (S, 1, d/2)
        return (
            (rows[0], rows[1]) if not heads_last else (_unsqueeze(emit, rows[0], [1]), _unsqueeze(emit, rows[1], [1]))
        )
    axis = [2] if heads_last else [1]  # (B, S, d/2) -> (B, S, 1, d/2) or (B, 1, S, d/2)
    return _unsqueeze(emit, rows[0], axis), _unsqueeze(emit, rows[1], axis)


def _slice(emit: Emitter, x: str, start: int, end: int, step: int = 1) -> str:
    i64 = np.int64
    bounds = [emit.const(np.array([v], i64)) for v in (start, end, -1, step)]
    return emit.op1("Slice", [x, *bounds])


def _unsqueeze(emit: Emitter, x: str, axes: list[int]) -> str:
    if emit.opset >= kernel_opsets.OP_VERSIONS["unsqueeze-axes-input"]:
        return emit.op1("Unsqueeze", [x, emit.const(np.array(axes, np.int64))])
    return emit.op1("Unsqueeze", [x], axes=axes)


def _float16_rotation(emit: Emitter, x1: str, x2: str, cos: str, sin: str) -> tuple[str, str]:
    """The float16 kernel converts to float32, rotates as for float32 and rounds to float16. A
    product of two float16 values is exact in float32, so whether it is fused does not matter:
    plain Mul and Sub/Add round once, as the kernel does, then Cast to float16 rounds again, as it does."""
    x1, x2, cos, sin = (emit.op1("Cast", [v], to=_T.FLOAT) for v in (x1, x2, cos, sin))
    rotated = []
    for a, b, c, d, op in ((x1, cos, x2, sin, "Sub"), (x1, sin, x2, cos, "Add")):
        plain = emit.op1(op, [emit.op1("Mul", [a, b]), emit.op1("Mul", [c, d])])
        nan = _nan_first(emit, [a, b, c, d], emit.const(np.float32(0.0)))
        is_nan = emit.op1("Not", [emit.op1("Equal", [nan, nan])])
        rotated.append(emit.op1("Cast", [emit.op1("Where", [is_nan, nan, plain])], to=_T.FLOAT16))
    return rotated[0], rotated[1]


def _nan_first(emit: Emitter, candidates: list[str], otherwise: str) -> str:
    """The first of ``candidates`` that is NaN, else ``otherwise``: x86's order for a NaN result
    (the first NaN operand, not the default NaN an invalid operation makes)."""
    chosen = otherwise
    for value in reversed(candidates):
        chosen = emit.op1("Where", [emit.op1("Not", [emit.op1("Equal", [value, value])]), value, chosen])
    return chosen


def emit_fma(emit: Emitter, a: str, b: str, c: str, d: str, *, subtract: bool = False) -> str:
    """float32 ``a·b + round(c·d)`` (``a·b - round(c·d)`` with ``subtract``) with one rounding for the
    ``a·b`` part, as ``_mm256_fmadd_ps(a, b, _mm256_mul_ps(c, d))`` (``fmsub``) computes it.

    In float64 the product of two float32 values is exact; the sum with ``r = round(c·d)`` is rounded
    to float64, and TwoSum recovers that rounding's error ``e`` exactly. Rounding the float64 sum
    ``s`` to float32 then gives the fused result except where ``s`` is a float32 tie and ``e`` lies
    beyond it (away from the neighbour the tie rounds to): there the other neighbour is right. A NaN
    operand is the result as x86 gives it (the first of a, b, then c, d for ``r``), quieted.
    """
    f64 = _T.DOUBLE
    r = _nan_first(emit, [c, d], emit.op1("Mul", [c, d]))
    wide_a, wide_b, addend = (emit.op1("Cast", [v], to=f64) for v in (a, b, r))  # quiets a signalling NaN
    product = emit.op1("Mul", [wide_a, wide_b])
    total = emit.op1("Sub" if subtract else "Add", [product, addend])
    # TwoSum(product, ±addend): moved = total - product; error = (product - (total - moved)) + (±addend - moved)
    moved = emit.op1("Sub", [total, product])
    first = emit.op1("Sub", [product, emit.op1("Sub", [total, moved])])
    if subtract:
        error = emit.op1("Sub", [first, emit.op1("Add", [addend, moved])])
    else:
        error = emit.op1("Add", [first, emit.op1("Sub", [addend, moved])])
    rounded = emit.op1("Cast", [total], to=_T.FLOAT)
    back = emit.op1("Cast", [rounded], to=f64)
    gap = emit.op1("Sub", [total, back])  # exact: the float32 rounding's error (Sterbenz)
    other = emit.op1("Cast", [emit.op1("Add", [back, emit.op1("Add", [gap, gap])])], to=_T.FLOAT)
    middle = emit.op1("Mul", [emit.op1("Add", [back, emit.op1("Cast", [other], to=f64)]), emit.const(np.float64(0.5))])
    tie = emit.op1("Equal", [middle, total])
    beyond = emit.op1("Greater", [emit.op1("Mul", [error, gap]), emit.const(np.float64(0.0))])
    fused = emit.op1("Where", [emit.op1("And", [tie, beyond]), other, rounded])
    nan = _nan_first(emit, [wide_a, wide_b, addend], emit.const(np.float64(0.0)))
    is_nan = emit.op1("Not", [emit.op1("Equal", [nan, nan])])
    return emit.op1("Where", [is_nan, emit.op1("Cast", [nan], to=_T.FLOAT), fused])


register(RotaryEmbeddingBuilder())
