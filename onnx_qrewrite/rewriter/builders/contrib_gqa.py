"""onnxruntime's ``com.microsoft`` GroupQueryAttention -> standard ops (what onnxruntime-genai and
the ORT transformers optimizer write into LLM decoders: Llama, Mistral, Phi, Qwen)::

    GroupQueryAttention(query, key, value, past_key, past_value, seqlens_k, total_sequence_length)
        present_key/value = each batch entry's past (its first past_b positions), then the new
                            K/V, then zeros, over max(total_sequence_length, past buffer) positions
        output            = softmax(scale · Q·Kᵀ over the keys up to past_b + i for query i) · V,
                            query head h reading key/value head h // (num_heads / kv_num_heads)

in onnxruntime 1.31.1's CPU kernel order (``gqa_attention_base.h``): ``total_b = seqlens_k[b] + 1``;
the first prompt (``S == total_sequence_length``) has no past (``past_b = 0``), every other call
``past_b = total_b - S``. The present buffers are built with GatherElements from
``Concat(past, new, zeros)`` at each entry's own offset; the causal mask is ``Where(key < min(past_b + i
+ 1, total_b), score, -inf)``, which Softmax turns into the exact zeros the kernel writes (total_b
bounds the padding rows of a first prompt only).

``do_rotary``: Q and the new K are rotated at positions ``past_b + i`` with cos/sin cache rows, as
RotaryEmbedding's kernel (the same MLAS routine; contrib_rotary.rotate, exact), before the cache.
With ``position_ids`` (B, S) given, at those positions as the kernel reads them (measured): on the
first prompt only ``position_ids[0, 0]``, as the start of every entry's positions; on every other
call each entry's own row. Without ``do_rotary`` the kernel reads no position_ids (measured).

Packed QKV (query (B, S, (N + 2·Nkv)·H), no key and value) is sliced into Q, K and V.

The options, as the 1.31.1 CPU kernel computes them (measured in tests/test_unfuse_gqa.py):
``softcap`` c > 0: ``c · tanh(score / c)`` on the scaled scores before the mask (Div, Tanh, Mul:
onnxruntime's Tanh rounds differently from the kernel's, within the bound); ``smooth_softmax``:
``exp(x - m) / (Σ exp(x - m) + exp(-m))``, m = max(0, max x), which is Softmax over the scores with
one more logit of 0, dropped after; ``head_sink`` (N,): the same with head h's sink in place of the
0 (smooth_softmax is then not read: measured); ``attention_bias`` (B or 1, N or 1, S, total): added
to the scores after softcap and before the mask (measured), zeros over the keys of a longer present
buffer (masked anyway); a row whose every score is then float32's lowest value or -inf is zeros
without softcap, head_sink or smooth_softmax, as the kernel writes it (measured);
``local_window_size`` w > 0: query i attends the w keys up to its position (keys past_b + i - w + 1
.. past_b + i; a negative w is no window). float16: the kernel converts Q, K, V and the past to
float32, computes as for float32 and rounds the output once, and so does the rewrite (Cast in, Cast
out; the presents' round trip is exact); with ``do_rotary`` it rotates Q and the new K in float16
first (RotaryEmbedding's float16 routine: float32 products rounded to float16; measured bit for
bit), and so does the rewrite.

``qk_output`` 1 / 2 with the output_qk output (B, N, S, total_sequence_length): each score row as the
kernel copies it before the softmax (scale·Q·Kᵀ, softcapped, plus attention_bias, 0 at the keys not
attended) or after it (the probabilities). An entry's row is written only over its own keys (<
seqlens_k[b] + 1): where seqlens_k[b] + 1 is less than total_sequence_length (lengths uneven across the
batch, a padded first prompt) the kernel leaves the keys at or beyond it unwritten (they hold whatever
memory held before: -5.2e32 measured), and only those, with a past buffer longer than
total_sequence_length too (measured in a fresh interpreter), undefined there; the rewrite writes 0
there, and ``verify`` does not compare them (``verify/undefined.py``; the rewrite's note says so).

Not lowered (the node stays, with the reason): ``qk_output`` other than 0-2 or without output_qk (the
kernel refuses both), output_qk with ``qk_output`` 0 (refused too), ``local_window_size`` 0 (no key
attended), a negative ``softcap`` (the kernel's output is then neither uncapped nor capped at its
magnitude: measured), a head size not a multiple of 8 (the kernel refuses it: "head_size must be a
multiple of 8", measured), shapes that are not recorded. Query rows of a first prompt at or past an
entry's length (``i >= seqlens_k[b] + 1``, padding) attend the entry's keys (below its length; with a
local window the last w of them), as the kernel does (measured, with stale memory before: not the
padding keys up to i, which an earlier form attended and called undefined).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import onnx

from onnx_qrewrite.rewriter import kernel_opsets
from onnx_qrewrite.rewriter.builders import Emitter, NoMatch, Plan, Site, register
from onnx_qrewrite.rewriter.builders.contracts import ATTENTION_FORMULA, CONTRACTS
from onnx_qrewrite.rewriter.builders.contrib_attention import refuse_recorded_shape
from onnx_qrewrite.rewriter.builders.contrib_rotary import INTERLEAVED_BLOCK, rotate
from onnx_qrewrite.rewriter.graph import dtype_name

__all__ = ["GroupQueryAttentionBuilder"]

_T = onnx.TensorProto
_KNOWN_ATTRIBUTES = {"num_heads", "kv_num_heads", "scale", "do_rotary", "rotary_interleaved", "local_window_size"}
_KNOWN_ATTRIBUTES |= {"softcap", "smooth_softmax", "qk_output"}


def _i64(emit: Emitter, values: list[int]) -> str:
    return emit.const(np.array(values, np.int64))


def _dim(emit: Emitter, x: str, axis: int) -> str:
    return emit.op1("Gather", [emit.op1("Shape", [x]), emit.const(np.int64(axis))], axis=0)


class GroupQueryAttentionBuilder:
    """Replaces com.microsoft GroupQueryAttention (separate Q, K, V) with the rotation of
    RotaryEmbedding's form, GatherElements for the KV cache and the causal softmax attention of
    grouped heads."""

    name = "unfuse_group_query_attention"
    contract = CONTRACTS["unfuse_group_query_attention"]

    def quantized_dtype(self, site: Site) -> str | None:
        elem = site.elem_type(site.input(0))
        return dtype_name(elem) if elem else None

    def check(self, site: Site, options: Mapping[str, Any]) -> Plan:
        site.no_unknown_attributes(_KNOWN_ATTRIBUTES)
        packed = not site.input(1) and not site.input(2)
        if not packed and not (site.input(1) and site.input(2)):
            raise NoMatch("malformed node: key and value must both be given or both absent (packed QKV)")
        if not (site.input(5) and site.input(6)):
            raise NoMatch("malformed node: seqlens_k and total_sequence_length are required")
        if bool(site.input(3)) != bool(site.input(4)):
            raise NoMatch("past_key and past_value must both be given or both absent")
        if len(site.node.output) < 3 or not all(site.node.output[:3]):
            raise NoMatch("present_key and present_value are required outputs (the kernel writes them)")
        float16 = _float16(site)
        heads, kv_heads = int(site.attribute("num_heads", 0)), int(site.attribute("kv_num_heads", 0))
        if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
            raise NoMatch(f"num_heads={heads} is not a multiple of kv_num_heads={kv_heads}")
        shape = site.value_shape(site.input(0))
        if shape is None or len(shape) != 3 or shape[2] is None:
            raise NoMatch(
                f"the hidden size of query {site.input(0)!r} is not recorded; run onnx shape inference on the model "
                "first (onnx.shape_inference.infer_shapes)"
            )
        parts = heads + 2 * kv_heads if packed else heads  # packed: Q, K, V heads side by side
        if shape[2] % parts:
            raise NoMatch(f"query hidden size {shape[2]} does not split into {parts} heads")
        if (shape[2] // parts) % 8:
            raise NoMatch(f"head_size {shape[2] // parts} is not a multiple of 8: onnxruntime's kernel refuses it")
        data: dict[str, Any] = {"heads": heads, "kv_heads": kv_heads, "head": shape[2] // parts, "packed": packed}
        data["rotary"] = _rotary_dim(site, shape[2] // parts, _T.FLOAT16 if float16 else _T.FLOAT)
        position_type = site.elem_type(site.input(9)) if site.input(9) else None
        if position_type not in (None, _T.INT64):
            raise NoMatch(f"position_ids {site.input(9)!r} is {dtype_name(position_type)}; the kernel takes int64")
        _check_shapes(site, shape[0], shape[1], heads)
        data["float16"] = float16
        data |= _options(site)
        notes = (_QK_NOTE,) if data["qk_output"] else ()
        # Bounded: within 2^-20·(1 + max|score|)·max|V|, which verify evaluates at the node (contrib_bounds).
        return Plan(
            min_opset=kernel_opsets.FORMS["group-query-attention"],
            notes=notes,
            data=data,
            bound_formula=ATTENTION_FORMULA,
        )

    def build(self, site: Site, emit: Emitter, options: Mapping[str, Any], plan: Plan) -> None:
        heads, kv_heads, head = plan.data["heads"], plan.data["kv_heads"], plan.data["head"]
        q, k, v, pasts = _inputs(emit, site, plan)
        seq = _dim(emit, q, 1)
        zero, one = emit.const(np.int64(0)), emit.const(np.int64(1))
        total = emit.op1("Add", [emit.op1("Cast", [site.input(5)], to=_T.INT64), emit.const(np.int64(1))])
        requested = emit.op1("Cast", [emit.op1("Reshape", [site.input(6), _i64(emit, [])])], to=_T.INT64)
        first_prompt = emit.op1("Equal", [seq, requested])
        past = emit.op1("Where", [first_prompt, zero, emit.op1("Sub", [total, seq])], hint="PastLengths")  # (B,)
        rows = emit.op1("Add", [_unsqueeze(emit, past, [1]), emit.op1("Range", [zero, seq, one])])  # positions (B, S)
        q, k = (
            emit.op1("Reshape", [q, _i64(emit, [0, 0, heads, head])]),
            emit.op1("Reshape", [k, _i64(emit, [0, 0, kv_heads, head])]),
        )
        if plan.data["rotary"]:  # the kernel rotates Q and the new K at positions past_b + i
            positions = _position_ids(emit, site.input(9), first_prompt, seq) if site.input(9) else rows
            q, k = _rotate(emit, site, positions, plan.data["rotary"], head, q, k, float16=plan.data["float16"])
            if plan.data["float16"]:  # rotated in float16 (rounded), then attended in float32
                q, k = (emit.op1("Cast", [t], to=_T.FLOAT) for t in (q, k))
        new_k, new_v = (
            emit.op1("Transpose", [t], perm=[0, 2, 1, 3])
            for t in (k, emit.op1("Reshape", [v, _i64(emit, [0, 0, kv_heads, head])]))
        )
        buffer = _dim(emit, site.input(3), 2) if site.input(3) else zero
        length = emit.op1("Max", [requested, buffer], hint="PresentLength")
        keys = emit.op1("Range", [zero, length, emit.const(np.int64(1))])  # (T,)
        source = _present_index(emit, keys, past, seq, buffer, kv_heads, head, new_k)
        # float16: computed in float32 (the kernel's order), rounded once into the outputs
        float16 = plan.data["float16"]
        outputs = ["" if float16 else name for name in site.node.output[:3]]
        present_k, present_v = (
            _present(emit, pasts[i], new, source, outputs[1 + i]) for i, new in enumerate((new_k, new_v))
        )
        # with output_qk the kernel takes a padded first prompt's window from the entry's last key
        allowed = _allowed(emit, keys, rows, total, plan.data["window"], from_end=_window_from_end(site, plan))
        allowed = _unsqueeze(emit, allowed, [1, 2])  # (B, 1, 1, S, T)
        qk = _QKOutput(site.node.output[3], requested, plan.data["qk_output"]) if plan.data["qk_output"] else None
        context = _attend(emit, site, plan, q, present_k, present_v, allowed, outputs[0], qk)
        if float16:
            for value, name in zip((context, present_k, present_v), site.node.output[:3], strict=True):
                emit.op1("Cast", [value], name, to=_T.FLOAT16)


#: output_qk's keys past an entry's length: the kernel leaves them unwritten, verify sets them aside
_QK_NOTE = (
    "output_qk's keys at or beyond seqlens_k[b] + 1 are undefined: onnxruntime 1.31.1 leaves them unwritten "
    "where seqlens_k[b] + 1 < total_sequence_length (the rewrite writes 0); verify does not compare them"
)


def _check_shapes(site: Site, batch: int | None, seq: int | None, heads: int) -> None:
    """Refuses a recorded attention_bias shape other than (B or 1, N or 1, S, total) and a recorded
    position_ids shape other than (B, S): the kernel refuses them when it runs, and the rewrite would
    broadcast them instead. (Shapes known only at run time are not checked by the rewrite.)"""
    refuse_recorded_shape(site, 10, "attention_bias", [(1, batch), (1, heads), (seq,), None])
    refuse_recorded_shape(site, 9, "position_ids", [(batch,), (seq,)])


def _options(site: Site) -> dict[str, Any]:
    """``local_window_size``, ``softcap``, ``smooth_softmax`` and ``qk_output`` as the plan's data,
    refusing the values the kernel does not compute attention with or refuses."""
    qk_output = int(site.attribute("qk_output", 0))
    if qk_output not in (0, 1, 2):
        raise NoMatch(f"qk_output={qk_output}: the kernel refuses it (0, 1 or 2)")
    if qk_output and not (len(site.node.output) > 3 and site.node.output[3]):
        raise NoMatch(f"qk_output={qk_output} without the output_qk output: the kernel refuses it")
    if len(site.node.output) > 3 and site.node.output[3] and not qk_output:
        raise NoMatch("output_qk is used with qk_output=0: onnxruntime refuses it (qk_output not configured)")
    window = int(site.attribute("local_window_size", -1))  # negative: no window (measured, as -1)
    if window == 0:
        raise NoMatch("local_window_size=0: the kernel attends to no key (zero output); not lowered")
    softcap = float(site.attribute("softcap", 0.0))
    if softcap < 0:
        raise NoMatch(
            f"softcap={softcap}: the kernel's output then is neither uncapped nor capped at {-softcap} (measured); "
            "not lowered"
        )
    smooth = bool(site.attribute("smooth_softmax", 0))
    return {"window": window, "softcap": softcap, "smooth": smooth, "qk_output": qk_output}


def _float16(site: Site) -> bool:
    """Whether query, key, value and the past are float16 (else float32; nothing else is lowered)."""
    types = {t for i in range(5) if site.input(i) and (t := site.value_type(site.input(i))) is not None}
    if not types:
        raise NoMatch("the type of query/key/value/past is not declared and their producers do not say")
    if types - {_T.FLOAT, _T.FLOAT16} or len(types) > 1:
        names = ", ".join(dtype_name(t) for t in sorted(types))
        raise NoMatch(f"query/key/value/past are {names}; float32 or float16 alike are lowered")
    return types == {_T.FLOAT16}


def _inputs(emit: Emitter, site: Site, plan: Plan) -> tuple[str, str, str, list[str]]:
    """Q, K and V (packed QKV sliced) and the past key and value ("" without), in float32: the
    float16 kernel converts them to float32 and computes in it (exact conversions)."""
    heads, kv_heads, head = plan.data["heads"], plan.data["kv_heads"], plan.data["head"]
    q, k, v = site.input(0), site.input(1), site.input(2)
    if plan.data["packed"]:  # (B, S, (N + 2 Nkv) H): Q, then K, then V
        bounds = np.cumsum([0, heads * head, kv_heads * head, kv_heads * head])
        q, k, v = (
            emit.op1("Slice", [q, _i64(emit, [int(bounds[i])]), _i64(emit, [int(bounds[i + 1])]), _i64(emit, [2])])
            for i in range(3)
        )
    pasts = [site.input(3), site.input(4)] if site.input(3) else ["", ""]
    if not plan.data["float16"]:
        return q, k, v, pasts
    if not plan.data["rotary"]:  # else Q and K are cast once rotated (in float16, as the kernel does)
        q, k = (emit.op1("Cast", [t], to=_T.FLOAT) for t in (q, k))
    v = emit.op1("Cast", [v], to=_T.FLOAT)
    return q, k, v, [emit.op1("Cast", [t], to=_T.FLOAT) if t else "" for t in pasts]


class _QKOutput(NamedTuple):
    """Where output_qk goes: its name, total_sequence_length (its width, int64) and the
    ``qk_output`` mode (1: the scores before the softmax, 2: after)."""

    name: str
    width: str
    mode: int


def _write_qk(emit: Emitter, plan: Plan, qk: _QKOutput, rows: str) -> None:
    """``rows`` (B, Nkv, G, S, T) as output_qk (B, N, S, total_sequence_length), the kernel's
    layout (query head n·G + g), in the node's type."""
    dims = emit.op1("Shape", [rows])
    batch = emit.op1("Slice", [dims, _i64(emit, [0]), _i64(emit, [1])])
    last = emit.op1("Slice", [dims, _i64(emit, [3]), _i64(emit, [5])])
    shape = emit.op1("Concat", [batch, _i64(emit, [plan.data["heads"]]), last], axis=0)
    heads = emit.op1("Reshape", [rows, shape])
    width = emit.op1("Reshape", [qk.width, _i64(emit, [1])])
    sliced = emit.op1("Slice", [heads, _i64(emit, [0]), width, _i64(emit, [3])])
    if plan.data["float16"]:
        emit.op1("Cast", [sliced], qk.name, to=_T.FLOAT16)
    else:
        emit.op1("Identity", [sliced], qk.name)


def _attend(
    emit: Emitter,
    site: Site,
    plan: Plan,
    q: str,
    present_k: str,
    present_v: str,
    allowed: str,
    output: str,
    qk: _QKOutput | None = None,
) -> str:
    """The grouped heads' attention over the present keys and values, (B, S, N·H) written to
    ``output`` (a fresh name if ""): query head h reads key/value head h // G, scores scaled
    [softcapped], masked, softmax [smooth], times V. ``qk``: output_qk, the kernel's row before
    the softmax (0 at the keys not attended) or after it."""
    heads, kv_heads, head = plan.data["heads"], plan.data["kv_heads"], plan.data["head"]
    scale = float(site.attribute("scale", 0.0)) or float(np.float32(1.0) / np.sqrt(np.float32(head)))
    groups = heads // kv_heads
    qh = emit.op1("Reshape", [q, _i64(emit, [0, 0, kv_heads, groups, head])])
    qh = emit.op1("Transpose", [qh], perm=[0, 2, 3, 1, 4])  # (B, Nkv, G, S, H)
    kt = emit.op1("Transpose", [_unsqueeze(emit, present_k, [2])], perm=[0, 1, 2, 4, 3])  # (B, Nkv, 1, H, T)
    scores = emit.op1("Mul", [emit.op1("MatMul", [qh, kt]), emit.const(np.float32(scale))], hint="Scale")
    if plan.data["softcap"] > 0:  # the kernel: softcap · tanh(score / softcap), before the mask
        cap = emit.const(np.float32(plan.data["softcap"]))
        scores = emit.op1("Mul", [emit.op1("Tanh", [emit.op1("Div", [scores, cap])]), cap], hint="Softcap")
    bias, sink = (_as_float32(emit, plan, site.input(i)) for i in (10, 11))
    if bias:  # the kernel adds it after softcap, before the mask (measured: before softcap is 0.1 off)
        scores = emit.op1("Add", [scores, _bias(emit, bias, scores, kv_heads, groups)], hint="Bias")
    if qk is not None and qk.mode == 1:  # the kernel zeroes the keys it does not attend, then copies the row
        _write_qk(emit, plan, qk, emit.op1("Where", [allowed, scores, emit.const(np.float32(0.0))]))
    scores = emit.op1("Where", [allowed, scores, emit.const(np.float32(-np.inf))], hint="Causal")
    if sink:  # head_sink (N,): head n·G + g's extra logit, as (1, Nkv, G, 1, 1)
        sink = emit.op1("Reshape", [sink, _i64(emit, [1, kv_heads, groups, 1, 1])], hint="HeadSink")
    elif plan.data["smooth"]:
        sink = emit.const(np.zeros((1, 1, 1, 1, 1), np.float32))
    probs = _softmax(emit, scores, sink or None)
    if bias and not sink and plan.data["softcap"] == 0:
        probs = _zero_dead_rows(emit, scores, probs)
    if plan.data["window"] > 0 and not _window_from_end(site, plan):
        probs = _zero_empty_rows(emit, allowed, probs)
    if qk is not None and qk.mode == 2:
        _write_qk(emit, plan, qk, probs)
    context = emit.op1("MatMul", [probs, _unsqueeze(emit, present_v, [2])])  # (B, Nkv, G, S, H)
    context = emit.op1("Transpose", [context], perm=[0, 3, 1, 2, 4])
    return emit.op1("Reshape", [context, _i64(emit, [0, 0, heads * head])], output or None)


def _window_from_end(site: Site, plan: Plan) -> bool:
    """Whether the kernel takes a padded first prompt's local window from the entry's last key
    (measured: float16, or with output_qk, softcap, smooth_softmax or head_sink) or from the row's
    position (its float32 path without those; attention_bias does not change it)."""
    data = plan.data
    return bool(data["float16"] or data["qk_output"] or data["softcap"] > 0 or data["smooth"] or site.input(11))


def _zero_empty_rows(emit: Emitter, allowed: str, probs: str) -> str:
    """``probs`` with zeros in the rows that attend no key (a padded first prompt's rows whose window
    lies past the entry's length, without output_qk), whose output the kernel writes as zeros
    (measured); the softmax of no key is NaN."""
    attends = emit.reduce_last_axis("ReduceMax", emit.op1("Cast", [allowed], to=_T.FLOAT))
    empty = emit.op1("Equal", [attends, emit.const(np.float32(0.0))], hint="NoKey")
    return emit.op1("Where", [empty, emit.const(np.float32(0.0)), probs])


def _zero_dead_rows(emit: Emitter, scores: str, probs: str) -> str:
    """``probs`` with zeros in the rows whose every attended score is float32's lowest value or
    -inf (an additive mask of finfo.min over a whole row), as onnxruntime 1.31.1's CPU kernel
    writes them without softcap, head_sink or smooth_softmax (measured: a row one ulp above the
    lowest value gets the plain softmax, as it does with softcap; a sink or smooth_softmax's 0
    gives those rows exact zeros through the softmax itself)."""
    top = emit.reduce_last_axis("ReduceMax", scores)
    dead = emit.op1("Not", [emit.op1("Greater", [top, emit.const(np.finfo(np.float32).min)])], hint="MaskedRow")
    return emit.op1("Where", [dead, emit.const(np.float32(0.0)), probs])


def _as_float32(emit: Emitter, plan: Plan, value: str) -> str:
    """``value`` ("" if absent) in float32, the type the scores are computed in (float16 nodes too)."""
    return emit.op1("Cast", [value], to=_T.FLOAT) if value and plan.data["float16"] else value


def _bias(emit: Emitter, bias: str, scores: str, kv_heads: int, groups: int) -> str:
    """attention_bias (B or 1, N or 1, S, total) as (B or 1, Nkv or 1, G or 1, S, T) for the scores
    (B, Nkv, G, S, T): heads split as the query's, zeros after ``total`` (keys the mask hides)."""
    heads = _dim(emit, bias, 1)
    split = _i64(emit, [0, kv_heads, groups, 0, 0])
    single = _i64(emit, [0, 1, 1, 0, 0])
    shape = emit.op1("Where", [emit.op1("Equal", [heads, emit.const(np.int64(1))]), single, split])
    shaped = emit.op1("Reshape", [_unsqueeze(emit, bias, [2]), shape])
    missing = emit.op1("Sub", [_dim(emit, scores, 4), _dim(emit, bias, 3)])
    pads = emit.op1("Concat", [_i64(emit, [0] * 9), emit.op1("Reshape", [missing, _i64(emit, [1])])], axis=0)
    return emit.op1("Pad", [shaped, pads])


def _allowed(emit: Emitter, keys: str, rows: str, total: str, window: int, from_end: bool) -> str:
    """Which keys (T,) each query at position ``rows`` (B, S) attends, (B, S, T): the keys up to its
    position and below the entry's length ``total`` (B,) (seqlens_k + 1), and with a local window only
    the last ``window`` of them (onnxruntime 1.31.1's CPU kernel, measured: window 2 attends the
    query's own key and the one before). The length matters on a padded first prompt only (elsewhere
    every position is below it): a query row at or past its entry's length attends the entry's keys
    (measured: not the padding keys up to its position); with a window, the last ``window`` keys
    before the entry's length when ``from_end`` (the kernel's path with output_qk), else those of the
    window up to the row's position that are below the length (the path without it; a row may then
    attend none: :func:`_zero_empty_rows`). Both measured, after runs leaving other data in memory."""
    ends = emit.op1("Min", [emit.op1("Add", [rows, emit.const(np.int64(1))]), _unsqueeze(emit, total, [1])])
    allowed = emit.op1("Less", [keys, _unsqueeze(emit, ends, [2])])
    if window > 0:
        last = ends if from_end else emit.op1("Add", [rows, emit.const(np.int64(1))])
        first = _unsqueeze(emit, emit.op1("Add", [last, emit.const(np.int64(-window - 1))]), [2])
        allowed = emit.op1("And", [allowed, emit.op1("Greater", [keys, first])], hint="LocalWindow")
    return allowed


def _softmax(emit: Emitter, scores: str, sink: str | None) -> str:
    """Softmax over the last axis; with a ``sink`` (broadcast to (B, Nkv, G, S, 1)), with one more
    logit of that value that takes its share of the sum and is dropped: the kernel's smooth softmax
    (sink 0: exp(x - m) / (Σ exp(x - m) + exp(-m)), m = max(0, max x)) and its head sinks."""
    if sink is None:
        return emit.op1("Softmax", [scores], axis=-1)
    first = emit.op1("Slice", [scores, _i64(emit, [0]), _i64(emit, [1]), _i64(emit, [-1])])
    extra = emit.op1("Expand", [sink, emit.op1("Shape", [first])])
    probs = emit.op1("Softmax", [emit.op1("Concat", [scores, extra], axis=-1)], axis=-1, hint="SmoothSoftmax")
    return emit.op1("Slice", [probs, _i64(emit, [0]), _i64(emit, [-1]), _i64(emit, [-1])])


def _rotary_dim(site: Site, head: int, cache_type: int) -> int:
    """The rotary dim of ``do_rotary`` (cos_cache's width · 2; 0: no rotation), refusing what the
    RotaryEmbedding lowering refuses (contrib_rotary.py)."""
    if not site.attribute("do_rotary", 0):
        if site.input(7) or site.input(8):
            raise NoMatch("cos_cache/sin_cache without do_rotary: not lowered")
        return 0
    if not (site.input(7) and site.input(8)):
        raise NoMatch("do_rotary without cos_cache and sin_cache: the kernel refuses it")
    for index in (7, 8):
        elem = site.elem_type(site.input(index))
        if elem is not None and elem != cache_type:
            raise NoMatch(f"{site.input(index)!r} is {dtype_name(elem)}; the query is {dtype_name(cache_type)}")
    cache = site.value_shape(site.input(7))
    if cache is None or len(cache) != 2 or cache[1] is None:
        raise NoMatch(f"the width of cos_cache {site.input(7)!r} is not recorded (run onnx shape inference first)")
    rotary = 2 * cache[1]
    if rotary > head:
        raise NoMatch(f"cos_cache of width {cache[1]} is wider than half a head ({head})")
    if site.attribute("rotary_interleaved", 0) and rotary % INTERLEAVED_BLOCK:
        raise NoMatch(
            f"rotary_interleaved with rotary dim {rotary}: the kernel's AVX2 tail rounds pairs in two ways "
            f"(lowered for multiples of {INTERLEAVED_BLOCK})"
        )
    return rotary


def _position_ids(emit: Emitter, position_ids: str, first_prompt: str, seq: str) -> str:
    """The positions ``do_rotary`` rotates at when position_ids (B, S) is given, as onnxruntime
    1.31.1's CPU kernel reads it (measured, tests/test_unfuse_gqa.py): on the first prompt only its
    first element, as the start of every entry's positions (``position_ids[0, 0] + i``); on every
    other call each entry's own row."""
    start = emit.op1("Slice", [position_ids, _i64(emit, [0, 0]), _i64(emit, [1, 1]), _i64(emit, [0, 1])])  # (1, 1)
    counted = emit.op1("Add", [start, emit.op1("Range", [emit.const(np.int64(0)), seq, emit.const(np.int64(1))])])
    return emit.op1("Where", [first_prompt, counted, position_ids], hint="PositionIds")  # (B, S)


def _rotate(
    emit: Emitter, site: Site, positions: str, rotary: int, head: int, *heads: str, float16: bool = False
) -> list[str]:
    """Each of ``heads`` (B, S, N, H) rotated as RotaryEmbedding's kernel does, at ``positions`` (B, S)."""
    cos, sin = (
        _unsqueeze(emit, emit.op1("Gather", [site.input(i), positions], axis=0, hint=hint), [2])
        for i, hint in ((7, "Cos"), (8, "Sin"))
    )
    interleaved = bool(site.attribute("rotary_interleaved", 0))
    return [
        emit.op1("Concat", rotate(emit, x, cos, sin, rotary, head, interleaved=interleaved, float16=float16), axis=-1)
        for x in heads
    ]


def _present_index(
    emit: Emitter, keys: str, past: str, seq: str, buffer: str, kv_heads: int, head: int, new_k: str
) -> str:
    """For each present position t of entry b: where it comes from in Concat(past, new, zeros) along
    the sequence axis (t < past_b: past t; then new t - past_b; after them the zero row), expanded
    to the present's shape (B, Nkv, T, H) for GatherElements."""
    past_b = _unsqueeze(emit, past, [1])  # (B, 1)
    in_past = emit.op1("Less", [keys, past_b])
    in_new = emit.op1("Less", [keys, emit.op1("Add", [past_b, seq])])
    from_new = emit.op1("Add", [emit.op1("Sub", [keys, past_b]), buffer])
    zero_row = emit.op1("Add", [buffer, seq])
    index = emit.op1("Where", [in_past, keys, emit.op1("Where", [in_new, from_new, zero_row])])  # (B, T)
    shape = emit.op1(
        "Concat",
        [
            emit.op1("Slice", [emit.op1("Shape", [new_k]), _i64(emit, [0]), _i64(emit, [1])]),
            _i64(emit, [kv_heads]),
            emit.op1("Shape", [keys]),
            _i64(emit, [head]),
        ],
        axis=0,
    )
    return emit.op1("Expand", [_unsqueeze(emit, index, [1, 3]), shape])


def _present(emit: Emitter, past: str, new: str, source: str, output: str) -> str:
    """The kernel's present buffer: memset to 0, this entry's past, then the new keys or values."""
    row = emit.op1("Slice", [new, _i64(emit, [0]), _i64(emit, [1]), _i64(emit, [2])])  # (B, Nkv, 1, H)
    zeros = emit.op1("Expand", [emit.const(np.zeros((1, 1, 1, 1), np.float32)), emit.op1("Shape", [row])])
    parts = [past, new, zeros] if past else [new, zeros]
    return emit.op1("GatherElements", [emit.op1("Concat", parts, axis=2), source], output or None, axis=2)


def _unsqueeze(emit: Emitter, x: str, axes: list[int]) -> str:
    return emit.op1("Unsqueeze", [x, emit.const(np.array(axes, np.int64))])


register(GroupQueryAttentionBuilder())
