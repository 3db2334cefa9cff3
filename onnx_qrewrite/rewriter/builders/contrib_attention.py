"""onnxruntime's ``com.microsoft`` attention fusions -> the standard ops they fuse (what
onnxruntime.transformers' optimizer writes into BERT-like models)::

    Attention(x, W, bias, mask_index, past, attention_bias)
                                       -> MatMul(x, W) + bias, Slice into Q, K, V,
                                          Reshape/Transpose to heads, [Concat past K, V before them,
                                          present = their stack], MatMul(Q, Kᵀ) · scale
                                          [+ attention_bias] [+ the mask], Softmax,
                                          MatMul(·, V), Transpose/Reshape back
    MultiHeadAttention(q, k, v, bias, key_padding_mask, attention_bias, past_key, past_value,
                       past_sequence_length, cache_indirection)
                                       -> the same from Q, K, V (+ their bias slices), with
                                          present_key/value = Concat(past, new heads), 4-D key/value
                                          taken as heads, and qk = the scores the Softmax reads

in the kernel's order of operations (onnxruntime 1.31.1's CPU kernel, ``attention_cpu_base.h``):
scores are ``scale · Q·Kᵀ + attention_bias + mask`` with the mask the kernel builds (0 where a key
is attended, ``mask_filter_value``, default -10000, where not; float32's lowest value at the keys
after the query under ``unidirectional``, in place of the padding value, added to the score:
measured with scores beyond 2^103, where that sum overflows to -inf), then onnxruntime's own
Softmax, then the probabilities times V.

Masks (``mask_index``): absent; 1-D key lengths (B: keys at or after the length are masked; 2B: also
those before the start positions in the second half); 2-D raw 0/1 mask (B, T) and 3-D (B, S, T)
(a key is attended where the value is > 0); ``unidirectional`` adds the causal mask. With past state
(2, B, N, P, H) the keys and values are the past ones then the new ones (the kernel's
ConcatStateChunk; T = P + S, masks over T), query i sits at position P + i (the causal mask hides the
keys after it), and ``present`` is (2, B, N, T, H). ``attention_bias`` (B or 1, N or 1, S, T) as
MultiHeadAttention's (the same kernel code). Not lowered (the node stays, with the reason): past
without present and past with attention_bias (the kernel refuses both). ``past_sequence_length``
(input 6) is not read by the CPU kernel (measured: any value and shape give the same outputs), and
not by the rewrite. float16 is not lowered: onnxruntime 1.31.1 has no float16 Attention on CPU; it
runs the float32 kernel between Casts it inserts and keeps float32 between neighbouring nodes it runs
so (an EmbedLayerNormalization before it hands it the unrounded result), so the node's float16 result
depends on its neighbours. Refused by onnxruntime 1.31.1's CPU kernel itself, so
nothing to measure a rewrite against (measured): 4-D (Megatron) masks (B, 1, M, M) ("4D mask in
attention cpu kernel is not supported"; other 4-D shapes fail its shape check), ``do_rotary``
("Rotary embedding is not supported in Attention CPU kernel"), a missing bias (the kernel crashes),
``past_present_share_buffer`` ("past_sequence_length tensor must be of one element when
past_present_share_buffer is set", even with one given). QAttention refuses 4-D masks and
``past_present_share_buffer`` alike, but runs ``do_rotary`` without rotating anything (outputs equal
``do_rotary=0``'s bit for bit): lowered as the kernel computes it, with a note.

MultiHeadAttention (onnxruntime 1.31.1's CPU kernel, measured in tests/test_unfuse_mha_state.py and
tests/test_unfuse_mha_forms.py): past_key/past_value (B, N, P, H) go before the new keys and values
in heads, present_key/value are that concatenation (B, N, P + L, H), query i sits at P + i. The
kernel's causal loop stops before the last query (and is off at one query): that row sees every key,
which shows where there are more keys than past + queries. A 1-D key_padding_mask is read as B key
lengths (also its 3B + 2 form: only the first B). attention_bias (B or 1, N or 1, S, T) joins the
scaled scores before the mask (a fully masked row shows the order). With past but without both
present outputs the kernel does not attend to past + new keys (measured): not lowered. 4-D key and
value (B, N, L, H), as cross attention passes its cached keys, are used as they are: only Q's slice
of the bias is added (the kernel reads no other), the presents are copies of them (after the past
where past and both presents are given, as for 3-D). The qk output (B, N, S, T) is the scores the
Softmax reads, attention_bias and mask included. past_sequence_length P with the past: past and
present share one buffer of M positions, the new K/V written at P .. P + L - 1, the rest kept, the
first P + L keys attended (measured; :func:`_shared_buffer`); with cache_indirection that is the
kernel's decoder-masked beam path, not lowered. cache_indirection without past_sequence_length: its
rank is checked and no value read (measured). Packed QKV (query (B, L, N, 3, H), or query alone) and packed KV (key
(B, L, N, 2, H)) are refused by the CPU kernel itself ("not implemented for CPU"): nothing to
measure, not lowered.

Why bounded, not exact: the kernel computes each head's projection as its own GEMM whose output
starts from the bias (C = bias, then C += x·W per K block), the standard form adds the bias after the
whole MatMul. The float32 sums agree bit for bit while the input hidden size fits one MLAS K block
(<= 128) and sequence > 1 (measured, and asserted in tests/test_unfuse_attention.py); beyond that the
bias joins the sum in another place, and at sequence 1 (one row per batch entry in the kernel's
GEMMs, a decoder's step with past state) they round differently. The rest (scores, mask, Softmax,
probabilities · V, the past copied into present) is bit-exact in every measured case. The present's
new K and V are the projection itself: within 2·(K + 1)·2^-24·(|x|·|W| + |b|) of the kernel's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx

from onnx_qrewrite.rewriter import kernel_opsets, u8s8
from onnx_qrewrite.rewriter.builders import Emitter, NoMatch, Plan, Site, register
from onnx_qrewrite.rewriter.builders._float_inputs import refuse_float16, unknown_type
from onnx_qrewrite.rewriter.builders.contracts import ATTENTION_FORMULA, CONTRACTS
from onnx_qrewrite.rewriter.graph import dtype_name

__all__ = ["AttentionBuilder", "MultiHeadAttentionBuilder", "QAttentionBuilder"]

_T = onnx.TensorProto
_DEFAULT_FILTER = -10000.0


def _float32(site: Site, *names: str) -> None:
    """Each named input is float32, known to be: an unknown type is refused, not assumed."""
    for name in names:
        elem = site.value_type(name) if name else _T.FLOAT
        if elem is None:
            raise unknown_type(name)
        if elem != _T.FLOAT:
            raise NoMatch(f"{name!r} is {dtype_name(elem)}; only float32 was measured")


def _unsqueeze(emit: Emitter, x: str, axes: list[int]) -> str:
    if emit.opset >= kernel_opsets.OP_VERSIONS["unsqueeze-axes-input"]:
        return emit.op1("Unsqueeze", [x, emit.const(np.array(axes, np.int64))])
    return emit.op1("Unsqueeze", [x], axes=axes)


def _dim(emit: Emitter, x: str, axis: int) -> str:
    """Dimension ``axis`` of ``x`` at run time, as an int64 scalar."""
    return emit.op1("Gather", [emit.op1("Shape", [x]), emit.const(np.int64(axis))], axis=0)


#: QAttention's do_rotary: onnxruntime's CPU kernel reads the attribute and rotates nothing (1.31.1,
#: measured: outputs and present equal do_rotary=0's bit for bit, with and without past, causal or not).
_ROTARY_IGNORED = (
    "do_rotary is set, and onnxruntime's CPU kernel does not rotate Q and K (measured: its outputs equal "
    "do_rotary=0's); the rewrite computes what the kernel does, without rotation",
)

#: Sums of integer products stay exact in float32 up to this magnitude.
_EXACT_FLOAT_INTEGERS = 2**24


class QAttentionBuilder:
    """Replaces com.microsoft QAttention with float arithmetic on the integer values and Attention's form
    (past/present state included, as Attention's).

    ``(Cast(x) - x_zp) @ (Cast(W) - W_zp) · (x_scale · W_scale) + bias``, then the heads, mask and
    Softmax as for Attention. The integer products are exact in float32 and so is their sum while it
    stays within 2^24, which is checked per column from the constant weights."""

    name = "unfuse_qattention"
    contract = CONTRACTS["unfuse_qattention"]

    def quantized_dtype(self, site: Site) -> str | None:
        elem = site.elem_type(site.input(1))
        return dtype_name(elem) if elem else None

    def check(self, site: Site, options: Mapping[str, Any]) -> Plan:
        known = {"num_heads", "unidirectional", "mask_filter_value", "scale", "do_rotary", "past_present_share_buffer"}
        site.no_unknown_attributes(known)
        _refuse_shared_buffer(site)
        for index in range(5):
            if not site.input(index):
                raise NoMatch(f"malformed node: input {index} is required")
        _float32(site, site.input(2), site.input(3), site.input(4))
        heads = int(site.attribute("num_heads", 0))
        if heads <= 0:
            raise NoMatch(f"num_heads={heads}")
        weights = site.constant(site.input(1))
        if weights is None or weights.ndim != 2 or weights.shape[1] % 3:
            raise NoMatch("weights are not a constant (K, 3·hidden) tensor")
        hidden = weights.shape[1] // 3
        if hidden % heads:
            raise NoMatch(f"hidden size {hidden} does not split into {heads} heads")
        _uint8_input(site)
        notes: tuple[str, ...] = _ROTARY_IGNORED if site.attribute("do_rotary", 0) else ()
        formula = None
        # onnxruntime's uint8 x int8 kernel (x86 without AVX-VNNI) pairs products into int16 with
        # saturation: the policy of rules/50-integer-matmul.toml (u8s8.py), per projection column.
        excess = u8s8.pair_excess(weights.T, "int8") if weights.dtype == np.int8 else np.zeros(1, np.int64)
        if excess.max(initial=0) > 0:
            if options["u8s8_saturation"] == "decline":
                raise NoMatch(
                    "uint8 input x int8 weights: onnxruntime's kernel on x86 CPUs without AVX-VNNI saturates pairs "
                    f"of products to int16 and can here (up to {int(excess.max())} per projection element)"
                )
            notes += (
                f"onnxruntime's uint8 x int8 kernel (x86 without AVX-VNNI) may differ by up to {int(excess.max())} "
                "per projection element before x_scale * W_scale (int16 pair saturation); the rewrite computes "
                "the ONNX definition",
            )
            if options["u8s8_saturation"] == "bound":  # verify checks it at the node, per element
                formula = "u8s8-attention"
        elif options["u8s8_saturation"] == "ignore":
            raise NoMatch("no pair of products can saturate here: the bounded rule applies")
        zp = site.constant(site.input(7)) if site.input(7) else np.zeros(1, np.int64)
        if zp is None:
            raise NoMatch("weight_zero_point is not constant")
        shift = np.abs(weights.astype(np.int64) - zp.astype(np.int64).reshape(1, -1)).sum(axis=0).max()
        if 255 * int(shift) > _EXACT_FLOAT_INTEGERS:
            notes += ("integer sums may exceed 2^24: float32 rounds them (bounded)",)
        plan = _mask_plan(site, 5, "mask_index", [hidden] * 3, heads, notes)
        state = _kv_state(site, [hidden] * 3, heads, past_index=8)
        if state and formula:
            raise NoMatch("past/present with weights onnxruntime's kernel can saturate: its bound formula has no past")
        if formula is None and options["u8s8_saturation"] != "ignore":
            formula = ATTENTION_FORMULA  # no pair can saturate: the projection's rounding, Attention's bound
        return dataclasses.replace(plan, bound_formula=formula, data={**plan.data, **state})

    def build(self, site: Site, emit: Emitter, options: Mapping[str, Any], plan: Plan) -> None:
        sizes, heads = plan.data["sizes"], plan.data["heads"]

        def shifted(value: str, zero_point: str) -> str:
            as_float = emit.op1("Cast", [value], to=_T.FLOAT)
            if not zero_point:
                return as_float
            return emit.op1("Sub", [as_float, emit.op1("Cast", [zero_point], to=_T.FLOAT)])

        x = site.input(0)
        products = emit.op1("MatMul", [shifted(x, site.input(6)), shifted(site.input(1), site.input(7))])
        scale = emit.op1("Mul", [site.input(3), site.input(4)], hint="ScaleProduct")
        qkv = emit.op1("Add", [emit.op1("Mul", [products, scale]), site.input(2)], hint="AddBias")
        bounds = np.cumsum([0, *sizes])
        q, k, v = (_slice(emit, qkv, int(bounds[i]), int(bounds[i + 1]), -1) for i in range(3))
        kv, key_length, past_length = _emit_state(emit, site, plan, 8, k, v)
        keep, causal = emit_masks(
            emit, site.input(5), plan.data["mask_rank"], x, x, plan.data["causal"], key_length, past_length
        )
        scale_attr = float(site.attribute("scale", 0.0))
        emit_heads_attention(emit, q, k, v, heads, sizes, scale_attr, keep, causal, site, site.node.output[0], kv)


def _uint8_input(site: Site) -> None:
    """QAttention's input is uint8, known to be: declared, traced from its producer, or said by its
    zero point (input 6, of the same type variable); an unknown type is refused, not assumed."""
    x, x_zp = site.input(0), site.input(6)
    x_type = site.value_type(x)
    if x_type is None and x_zp:
        x_type = site.value_type(x_zp)
    if x_type is None:
        raise NoMatch(
            f"the type of {x!r} is not declared and neither its producer nor its zero point says; onnxruntime's "
            "CPU kernel takes uint8 only"
        )
    if x_type != _T.UINT8:
        raise NoMatch(f"input is {dtype_name(x_type)}: onnxruntime's CPU kernel takes uint8 only, nothing to measure")


def _refuse_shared_buffer(site: Site) -> None:
    """past_present_share_buffer: Attention's and QAttention's CPU kernels refuse it whatever the
    inputs (1.31.1, measured: their Compute does not pass past_sequence_length on to the check that
    needs it), so there is nothing to match."""
    if site.attribute("past_present_share_buffer", 0):
        raise NoMatch(
            f"past_present_share_buffer={site.attribute('past_present_share_buffer')}: onnxruntime's CPU kernel "
            "refuses it ('past_sequence_length tensor must be of one element when past_present_share_buffer is "
            "set', even with one given), nothing to measure against; not lowered"
        )


def _mask_plan(site: Site, index: int, label: str, sizes: list[int], heads: int, notes: tuple[str, ...] = ()) -> Plan:
    """The plan every attention rule shares: the mask input ``index`` (int32, of a known rank 1-3;
    EmbedLayerNormalization's mask index counts as 1-D without shape inference) and the opset
    the rewrite needs (``kernel_opsets.FORMS``: attention-mask for the mask or the causal fill, attention otherwise)."""
    mask_rank = None
    if site.input(index):
        name = site.input(index)
        elem = site.elem_type(name)
        if elem is not None and elem != _T.INT32:
            raise NoMatch(f"{label} is {dtype_name(elem)}, not int32")
        shape = site.value_shape(name)
        if shape is None and label == "mask_index" and _is_embed_mask_index(site, name):
            shape = (None,)  # EmbedLayerNormalization's mask index is (batch,)
        if shape is None:
            raise NoMatch(
                f"the rank of {label} {name!r} is not recorded; run onnx shape inference on the model first "
                "(onnx.shape_inference.infer_shapes)"
            )
        mask_rank = len(shape)
        if mask_rank == 4 and label == "mask_index":
            raise NoMatch(
                "a 4-D mask_index (Megatron's (B, 1, max, max)): onnxruntime's CPU kernel refuses it ('4D mask in "
                "attention cpu kernel is not supported', 1.31.1), nothing to measure against; not lowered"
            )
        if mask_rank not in (1, 2, 3):
            raise NoMatch(f"a {mask_rank}-D {label} is not lowered (1-D, 2-D and 3-D are)")
    causal = bool(site.attribute("unidirectional", 0))
    need = kernel_opsets.FORMS["attention-mask" if mask_rank is not None or causal else "attention"]
    data = {"sizes": sizes, "heads": heads, "mask_rank": mask_rank, "causal": causal}
    # Bounded: within 2^-20·(1 + max|score|)·max|V|, which verify evaluates at the node (contrib_bounds).
    return Plan(min_opset=need, notes=notes, data=data, bound_formula=ATTENTION_FORMULA)


register(QAttentionBuilder())


def _is_embed_mask_index(site: Site, name: str) -> bool:
    producer = site.scope.producer(name)
    return (
        producer is not None
        and producer.domain == "com.microsoft"
        and producer.op_type in ("EmbedLayerNormalization", "QEmbedLayerNormalization")
        and len(producer.output) > 1
        and producer.output[1] == name
    )


def _slice(emit: Emitter, x: str, start: int, end: int, axis: int) -> str:
    i64 = np.int64
    return emit.op1(
        "Slice",
        [x, emit.const(np.array([start], i64)), emit.const(np.array([end], i64)), emit.const(np.array([axis], i64))],
    )


def _positions(emit: Emitter, length: str) -> str:
    """0, 1, ..., length - 1 (int64)."""
    return emit.op1("Range", [emit.const(np.int64(0)), length, emit.const(np.int64(1))])


class AttentionBuilder:
    """Replaces com.microsoft Attention with MatMul, Softmax and the mask arithmetic of onnxruntime's kernel.

    Projection MatMul + bias, Slice into Q, K, V, heads by Reshape/Transpose, scaled scores plus the
    mask the kernel builds, Softmax, probabilities times V, heads merged back."""

    name = "unfuse_attention"
    contract = CONTRACTS["unfuse_attention"]

    def quantized_dtype(self, site: Site) -> str | None:
        elem = site.elem_type(site.input(0))
        return dtype_name(elem) if elem else None

    def check(self, site: Site, options: Mapping[str, Any]) -> Plan:
        known = {"num_heads", "unidirectional", "qkv_hidden_sizes", "mask_filter_value", "scale"}
        known |= {"do_rotary", "rotary_embedding_dim", "past_present_share_buffer"}
        site.no_unknown_attributes(known)
        if site.attribute("do_rotary", 0):
            raise NoMatch(
                f"do_rotary={site.attribute('do_rotary')}: onnxruntime's CPU kernel refuses it ('Rotary embedding is "
                "not supported in Attention CPU kernel', 1.31.1), nothing to measure against; not lowered"
            )
        _refuse_shared_buffer(site)
        # float16 Attention: no float16 kernel on CPU (bit for bit alone, measured; _float_inputs.py).
        refuse_float16(site, *[site.input(i) for i in (0, 1, 2, 4, 5)])
        if site.input(6):  # read by the CPU kernel only with past_present_share_buffer, which it refuses
            elem = site.elem_type(site.input(6))
            if elem is not None and elem != _T.INT32:
                raise NoMatch(f"past_sequence_length is {dtype_name(elem)}, not int32")
        if site.input(5):
            if site.input(4):
                raise NoMatch("past with attention_bias: the kernel refuses it ('cannot have both')")
            _float32(site, site.input(5))
            _check_rank(site, 5, "attention_bias", 4)
            x = site.value_shape(site.input(0)) or (None, None)
            heads = int(site.attribute("num_heads", 0))  # no past with attention_bias: total = S
            refuse_recorded_shape(site, 5, "attention_bias", [(1, x[0]), (1, heads), (x[1],), (x[1],)], True)
        if not site.input(0) or not site.input(1):
            raise NoMatch("malformed node: input and weights are required")
        if not site.input(2):
            raise NoMatch("no bias: onnxruntime 1.31's CPU kernel crashes on that, nothing to measure against")
        _float32(site, site.input(0), site.input(1), site.input(2))
        heads = int(site.attribute("num_heads", 0))
        if heads <= 0:
            raise NoMatch(f"num_heads={heads}")
        sizes = [int(s) for s in site.attribute("qkv_hidden_sizes", [])]
        if not sizes:
            w_shape = site.value_shape(site.input(1))
            if w_shape is None or len(w_shape) != 2 or w_shape[1] is None:
                raise NoMatch(
                    f"the shape of weights {site.input(1)!r} is not recorded (needed to split Q, K, V); run onnx "
                    "shape inference on the model first (onnx.shape_inference.infer_shapes)"
                )
            if w_shape[1] % 3:
                raise NoMatch(f"weights have {w_shape[1]} columns, not 3 · hidden size")
            sizes = [w_shape[1] // 3] * 3
        if len(sizes) != 3 or sizes[0] != sizes[1] or any(s <= 0 or s % heads for s in sizes):
            raise NoMatch(f"qkv_hidden_sizes {sizes} do not split into {heads} heads with Q and K alike")
        plan = _mask_plan(site, 3, "mask_index", sizes, heads)
        state = _kv_state(site, sizes, heads)
        return dataclasses.replace(plan, data={**plan.data, **state}) if state else plan

    def build(self, site: Site, emit: Emitter, options: Mapping[str, Any], plan: Plan) -> None:
        sizes, heads = plan.data["sizes"], plan.data["heads"]
        x = site.input(0)
        qkv = emit.op1("Add", [emit.op1("MatMul", [x, site.input(1)]), site.input(2)], hint="AddBias")
        bounds = np.cumsum([0, *sizes])
        q, k, v = (
            emit.op1(
                "Slice",
                [
                    qkv,
                    emit.const(np.array([bounds[i]], np.int64)),
                    emit.const(np.array([bounds[i + 1]], np.int64)),
                    emit.const(np.array([-1], np.int64)),
                ],
                hint=f"Slice{'QKV'[i]}",
            )
            for i in range(3)
        )
        scale = float(site.attribute("scale", 0.0))
        kv, key_length, past_length = _emit_state(emit, site, plan, 4, k, v)
        keep, causal = emit_masks(
            emit, site.input(3), plan.data["mask_rank"], x, x, plan.data["causal"], key_length, past_length
        )
        emit_heads_attention(
            emit, q, k, v, heads, sizes, scale, keep, causal, site, site.node.output[0], kv, site.input(5)
        )


def _emit_state(
    emit: Emitter, site: Site, plan: Plan, past_index: int, k: str, v: str
) -> tuple[tuple[str, str] | None, str | None, str | None]:
    """With past/present: K and V in heads after the past ones (present written), the key count
    and the past length for the masks; (None, None, None) without."""
    if not plan.data.get("state"):
        return None, None, None
    past = site.input(past_index)
    kv = _emit_kv_state(emit, past, k, v, plan.data["heads"], plan.data["sizes"], site.node.output[1])
    if not past:
        return kv, None, None
    # keys: the past ones, then these; query i sits at past length + i
    return kv, _dim(emit, kv[0], 2), _dim(emit, past, 3)


def _kv_state(site: Site, sizes: list[int], heads: int, past_index: int = 4) -> dict[str, Any]:
    """Attention's past (2, B, N, P, H) and present (2, B, N, P + S, H): the plan's data for them
    (empty without either), refusing what the kernel's layout does not allow."""
    past, present = site.input(past_index), len(site.node.output) > 1 and bool(site.node.output[1])
    if not past and not present:
        return {}
    if past and not present:
        raise NoMatch("past without present: onnxruntime's kernel refuses it, nothing to measure against")
    if sizes[1] != sizes[2]:
        raise NoMatch(f"past/present with K and V of different sizes {sizes[1:]}: the state stacks them")
    if past:
        _float32(site, past)
        shape = site.value_shape(past)
        want = (2, None, heads, None, sizes[1] // heads)
        if shape is not None and (
            len(shape) != 5 or any(w is not None and d not in (w, None) for d, w in zip(shape, want, strict=False))
        ):
            raise NoMatch(f"past of shape {shape} is not (2, batch, {heads}, past length, {sizes[1] // heads})")
    return {"state": True}


def _emit_kv_state(
    emit: Emitter, past: str, k: str, v: str, heads: int, sizes: list[int], present: str
) -> tuple[str, str]:
    """K and V split into heads (B, N, T, H), after the past ones when ``past`` is given (the
    kernel's ConcatStateChunk), and stacked into ``present`` when it is used."""
    head = sizes[1] // heads
    shape = emit.const(np.array([0, 0, heads, head], np.int64))
    kh, vh = (emit.op1("Transpose", [emit.op1("Reshape", [t, shape])], perm=[0, 2, 1, 3]) for t in (k, v))
    if past:
        kh, vh = (
            emit.op1("Concat", [emit.op1("Gather", [past, emit.const(np.int64(i))], axis=0), t], axis=2)
            for i, t in enumerate((kh, vh))
        )
    if present:
        emit.op1("Concat", [_unsqueeze(emit, kh, [0]), _unsqueeze(emit, vh, [0])], present, axis=0)
    return kh, vh


class MultiHeadAttentionBuilder:
    """Replaces com.microsoft MultiHeadAttention (separate Q, K, V) with Add, MatMul and Softmax.

    Q, K and V plus their slices of the optional bias, heads by Reshape/Transpose (K and V after
    past_key / past_value, written to present_key / present_value), scaled scores plus
    attention_bias and the mask the kernel builds from ``key_padding_mask``, Softmax,
    probabilities times V."""

    name = "unfuse_multi_head_attention"
    contract = CONTRACTS["unfuse_multi_head_attention"]

    def quantized_dtype(self, site: Site) -> str | None:
        elem = site.elem_type(site.input(0))
        return dtype_name(elem) if elem else None

    def check(self, site: Site, options: Mapping[str, Any]) -> Plan:
        site.no_unknown_attributes({"num_heads", "unidirectional", "mask_filter_value", "scale"})
        if site.input(8):
            _check_shared_buffer(site)
        _refuse_packed(site)
        _float32(site, *[site.input(i) for i in (0, 1, 2, 3, 5, 6, 7)])
        heads = int(site.attribute("num_heads", 0))
        if heads <= 0:
            raise NoMatch(f"num_heads={heads}")
        sizes, bnsh = _mha_sizes(site, heads)
        if site.input(8) and bnsh:
            raise NoMatch("past_sequence_length with 4-D key/value: not measured; not lowered")
        plan = _mask_plan(site, 4, "key_padding_mask", sizes, heads)
        state = _mha_state(site, sizes, heads)
        if site.input(5):
            _check_rank(site, 5, "attention_bias", 4)
            refuse_recorded_shape(site, 5, "attention_bias", _mha_bias_dims(site, heads, bnsh), True)
        if site.input(9):  # read only with past_sequence_length (the kernel's decoder-masked path)
            _check_cache_indirection(site)
        return dataclasses.replace(plan, data={**plan.data, **state, "bnsh": bnsh})

    def build(self, site: Site, emit: Emitter, options: Mapping[str, Any], plan: Plan) -> None:
        sizes, heads = plan.data["sizes"], plan.data["heads"]
        q, k, v = site.input(0), site.input(1), site.input(2)
        if site.input(3):  # the kernel adds each slice of the bias to its input before the heads split
            bounds = np.cumsum([0, *sizes])
            parts = 1 if plan.data["bnsh"] else 3  # 4-D key/value: the kernel reads Q's slice only (measured)
            q, k, v = (
                emit.op1(
                    "Add",
                    [t, _slice(emit, site.input(3), int(bounds[i]), int(bounds[i + 1]), 0)],
                    hint=f"AddBias{'QKV'[i]}",
                )
                if i < parts
                else t
                for i, t in enumerate((q, k, v))
            )
        kv, key_length, past_length = None, None, None
        if plan.data.get("state") or plan.data["bnsh"]:
            kv = _emit_mha_state(emit, site, k, v, heads, sizes, plan.data["bnsh"], site.input(8))
            key_length = _dim(emit, kv[0], 2)
            past_length = _dim(emit, site.input(6), 2) if site.input(6) else None
        keep, causal = emit_masks(
            emit,
            site.input(4),
            plan.data["mask_rank"],
            site.input(0),
            site.input(1),
            plan.data["causal"],
            key_length,
            past_length,
            starts=False,
        )
        scale = float(site.attribute("scale", 0.0))
        emit_heads_attention(
            emit,
            q,
            k,
            v,
            heads,
            sizes,
            scale,
            keep,
            causal,
            site,
            site.node.output[0],
            kv,
            site.input(5),
            qk=_output(site, 3),
        )


def _output(site: Site, index: int) -> str:
    """Output ``index`` of the node where it is used, else ''."""
    return site.node.output[index] if len(site.node.output) > index else ""


def _refuse_packed(site: Site) -> None:
    """The packed forms of MultiHeadAttention, which onnxruntime's CPU kernel refuses (measured
    with 1.31.1: nothing to measure a rewrite against)."""
    query = site.value_shape(site.input(0))
    if query is not None and len(query) == 5:
        raise NoMatch(
            "packed QKV (query of shape (B, L, N, 3, H)): onnxruntime's CPU kernel refuses it ('not implemented "
            "for CPU'), nothing to measure against; not lowered"
        )
    if not site.input(1):
        raise NoMatch(
            "packed QKV (no key or value): onnxruntime's CPU kernel refuses it ('Packed qkv of 3D BS3NH format is "
            "not support', or not implemented for CPU), nothing to measure against; not lowered"
        )
    key = site.value_shape(site.input(1))
    if (key is not None and len(key) == 5) or not site.input(2):
        raise NoMatch(
            "packed KV (key of shape (B, L, N, 2, H), no value): onnxruntime's CPU kernel refuses it ('not "
            "implemented for CPU'), nothing to measure against; not lowered"
        )


def _check_cache_indirection(site: Site) -> None:
    """cache_indirection without past_sequence_length: the CPU kernel checks its rank (3) and type
    and reads none of its values (measured: any values give the same outputs); it only keeps the
    kernel off its flash path."""
    elem = site.elem_type(site.input(9))
    if elem is not None and elem != _T.INT32:
        raise NoMatch(f"cache_indirection is {dtype_name(elem)}, not int32")
    _check_rank(site, 9, "cache_indirection", 3)


def _mha_sizes(site: Site, heads: int) -> tuple[list[int], bool]:
    """The hidden sizes of MultiHeadAttention's query (B, S, D), key and value, split into ``heads``
    heads with Q and K alike; and whether key and value are 4-D (B, N, L, H), already in heads."""
    shapes = [_mha_shape(site, index, heads) for index in range(3)]
    bnsh = len(shapes[1]) == 4
    if len(shapes[2]) != len(shapes[1]):
        raise NoMatch(f"key is {len(shapes[1])}-D and value {len(shapes[2])}-D: the kernel takes both 3-D or both 4-D")
    if bnsh and any(None not in (a, b) and a != b for a, b in zip(shapes[1], shapes[2], strict=True)):
        raise NoMatch(f"4-D key {shapes[1]} and value {shapes[2]} differ in shape: the kernel refuses it")
    last = [int(shape[-1] or 0) for shape in shapes]  # recorded: _mha_shape checks it
    sizes = [last[0], heads * last[1], heads * last[2]] if bnsh else last
    if sizes[0] != sizes[1] or any(s % heads for s in sizes):
        raise NoMatch(f"hidden sizes {sizes} do not split into {heads} heads with Q and K alike")
    return sizes, bnsh


def _mha_bias_dims(site: Site, heads: int, bnsh: bool) -> list[tuple[int | None, ...] | None]:
    """The attention_bias dimensions MultiHeadAttention's kernel takes: (B or 1, N or 1, S, P + L),
    None where a length is not recorded."""
    query = site.value_shape(site.input(0)) or (None, None)
    key = site.value_shape(site.input(1))
    new = key[2 if bnsh else 1] if key else None
    past = site.value_shape(site.input(6)) if site.input(6) else (0, 0, 0)
    total = None if new is None or past is None or past[2] is None else past[2] + new
    return [(1, query[0]), (1, heads), (query[1],), (total,)]


def _mha_shape(site: Site, index: int, heads: int) -> tuple[int | None, ...]:
    """The recorded shape of query (3-D), key or value (3-D, or 4-D with ``heads`` heads), its last
    dimension known."""
    what = ("query", "key", "value")[index]
    shape = site.value_shape(site.input(index))
    if shape is not None and len(shape) not in ((3,) if index == 0 else (3, 4)):
        raise NoMatch(
            f"{what} is {len(shape)}-D; only (batch, sequence, hidden) or, for key and value, "
            "(batch, heads, sequence, head) is lowered"
        )
    if shape is None or shape[-1] is None:
        raise NoMatch(
            f"the hidden size of {what} {site.input(index)!r} is not recorded; run onnx shape inference "
            "on the model first (onnx.shape_inference.infer_shapes)"
        )
    if len(shape) == 4 and shape[1] not in (heads, None):
        raise NoMatch(f"4-D {what} has {shape[1]} heads, not num_heads={heads}")
    return shape


#: onnxruntime's names of attention_bias's dimensions 2 and 3 in its refusal
_BIAS_AXES = {2: "sequence_length", 3: "total_sequence_length"}


def refuse_recorded_shape(
    site: Site, index: int, what: str, dims: list[tuple[int | None, ...] | None], quote: bool = False
) -> None:
    """Refuses input ``index`` if its recorded shape has another rank than ``dims`` or a dimension
    outside the values ``dims`` allows at that axis (None: any; a None among the values: not known,
    not checked): the kernel refuses those shapes when it runs, where the rewrite would broadcast.
    ``quote``: attention_bias's axes 2 and 3 quote Attention's and MultiHeadAttention's own message
    (measured). Shapes known only at run time are
    not checked."""
    recorded = site.value_shape(site.input(index)) if site.input(index) else None
    if recorded is None:
        return
    if len(recorded) != len(dims):
        raise NoMatch(f"{what} {site.input(index)!r} has rank {len(recorded)}; the kernel takes rank {len(dims)}")
    for axis, (dim, allowed) in enumerate(zip(recorded, dims, strict=True)):
        if dim is None or allowed is None or None in allowed or dim in allowed:
            continue
        expected = " or ".join(str(a) for a in allowed)
        said = (
            f" (onnxruntime: \"Input '{what}' dimension {axis} should be same as {_BIAS_AXES[axis]}, got {dim}\")"
            if quote and axis in _BIAS_AXES
            else ""
        )
        raise NoMatch(
            f"{what} {site.input(index)!r} has dimension {axis} = {dim}; the kernel requires {expected}{said}"
        )


def _check_rank(site: Site, index: int, label: str, rank: int) -> None:
    shape = site.value_shape(site.input(index))
    if shape is not None and len(shape) != rank:
        raise NoMatch(f"{label} is {len(shape)}-D; the kernel takes {rank}-D")


def _mha_state(site: Site, sizes: list[int], heads: int) -> dict[str, Any]:
    """MultiHeadAttention's past_key / past_value (B, N, P, H) and present_key / present_value
    (B, N, P + L, H): the plan's data for them (empty without any), refusing what the CPU kernel
    does not compute as the concatenation (measured)."""
    past = site.input(6), site.input(7)
    present = [len(site.node.output) > i and bool(site.node.output[i]) for i in (1, 2)]
    if bool(past[0]) != bool(past[1]):
        raise NoMatch("past_key and past_value must both be given or both absent")
    if not past[0] and not any(present):
        return {}
    if past[0] and not all(present):
        raise NoMatch(
            "past_key/past_value without both present_key and present_value: onnxruntime's CPU kernel then "
            "does not attend to the past and the new keys (measured); not lowered"
        )
    if past[0] and sizes[1] != sizes[2]:
        raise NoMatch(f"past with key and value of different sizes {sizes[1:]}: the kernel refuses it")
    head = sizes[1] // heads
    for name in past:
        shape = site.value_shape(name) if name else None
        want = (None, heads, None, head)
        if shape is not None and (
            len(shape) != 4 or any(w not in (d, None) and d is not None for d, w in zip(shape, want, strict=False))
        ):
            raise NoMatch(f"past of shape {shape} is not (batch, {heads}, past length, {head})")
    return {"state": True}


def _emit_mha_state(
    emit: Emitter, site: Site, k: str, v: str, heads: int, sizes: list[int], bnsh: bool = False, shared: str = ""
) -> tuple[str, str]:
    """K and V split into heads (B, N, T, H) (``bnsh``: given so), after past_key / past_value when
    given (the kernel's ConcatStateChunk), written to present_key / present_value where those are used.
    ``shared``: past_sequence_length, the past being a buffer of max_sequence_length (:func:`_shared_buffer`)."""
    result = []
    for i, (t, size) in enumerate(((k, sizes[1]), (v, sizes[2]))):
        present = _output(site, 1 + i)
        past = site.input(6 + i)
        if bnsh:
            split = emit.op1("Identity", [t], present) if present and not past else t
        else:
            shaped = emit.op1("Reshape", [t, emit.const(np.array([0, 0, heads, size // heads], np.int64))])
            split = emit.op1("Transpose", [shaped], None if past else present, perm=[0, 2, 1, 3])
        if shared:
            result.append(_shared_buffer(emit, past, split, shared, present))
        else:
            result.append(emit.op1("Concat", [past, split], present, axis=2) if past else split)
    return result[0], result[1]


def _shared_buffer(emit: Emitter, past: str, new: str, length: str, present: str) -> str:
    """past_sequence_length's form (the kernel's past_present_share_buffer without cache_indirection,
    measured with onnxruntime 1.31.1's CPU kernel): ``present`` is the past buffer (B, N, M, H) with the
    new heads (B, N, L, H) written at positions ``length`` .. ``length`` + L - 1 (the other positions
    kept), and the keys attended are the buffer's first ``length`` + L. Returns those keys."""
    start = emit.op1("Cast", [emit.op1("Reshape", [length, emit.const(np.array([], np.int64))])], to=_T.INT64)
    buffer, count = _dim(emit, past, 2), _dim(emit, new, 2)
    end = emit.op1("Add", [start, count])
    rows = emit.op1("Range", [emit.const(np.int64(0)), buffer, emit.const(np.int64(1))])
    written = emit.op1("And", [emit.op1("Not", [emit.op1("Less", [rows, start])]), emit.op1("Less", [rows, end])])
    source = emit.op1("Where", [written, emit.op1("Add", [rows, emit.op1("Sub", [buffer, start])]), rows])
    stacked = emit.op1("Concat", [past, new], axis=2)
    updated = emit.op1("Gather", [stacked, source], present or None, axis=2, hint="SharedBuffer")
    zero, axis = emit.const(np.array([0], np.int64)), emit.const(np.array([2], np.int64))
    return emit.op1("Slice", [updated, zero, _unsqueeze(emit, end, [0]), axis])


def _check_shared_buffer(site: Site) -> None:
    """past_sequence_length (input 8): lowered in the form measured, the past and present sharing
    one max-length buffer, past_key/past_value and both presents given, 3-D key/value, none of the
    options below; the decoder-masked beam path (with cache_indirection) is not."""
    if site.input(9):
        raise NoMatch(
            "input 8 (past_sequence_length) with cache_indirection: the kernel's decoder-masked beam path (keys "
            "read across beams); not lowered: it is written for onnxruntime's BeamSearch decoding subgraphs, "
            "whose loop op stays onnxruntime's whatever this rule does"
        )
    if not site.input(6):
        raise NoMatch("input 8 (past_sequence_length) without past_key/past_value: not lowered")
    elem = site.elem_type(site.input(8))
    if elem is not None and elem != _T.INT32:
        raise NoMatch(f"past_sequence_length is {dtype_name(elem)}, not int32")
    unmeasured = [name for index, name in ((4, "key_padding_mask"), (5, "attention_bias")) if site.input(index)]
    unmeasured += ["unidirectional"] if int(site.attribute("unidirectional", 0)) else []
    unmeasured += ["the qk output"] if _output(site, 3) else []
    if unmeasured:
        raise NoMatch(f"past_sequence_length with {', '.join(unmeasured)}: not measured; not lowered")


register(MultiHeadAttentionBuilder())


def emit_masks(
    emit: Emitter,
    mask: str,
    rank: int | None,
    query: str,
    key: str,
    causal: bool,
    key_length: str | None = None,
    past_length: str | None = None,
    *,
    starts: bool = True,
) -> tuple[str | None, str | None]:
    """Where the mask input lets a key be attended, and where the causal mask does (bool,
    broadcastable to B x N x S x T; None: everywhere). ``query`` (B, S, ...) and ``key`` (B, T, ...)
    give the lengths at run time, or ``key_length`` T; with past state query i sits at position
    ``past_length`` + i (the kernel masks keys after it). ``starts``: a 1-D mask of 2B holds start
    positions after the lengths (Attention's); without, only its first B values are read
    (MultiHeadAttention's CPU kernel, also for its 3B + 2 form: measured)."""
    keep = None
    if rank == 1:
        keep = _key_lengths_mask(emit, mask, query, _positions(emit, key_length or _dim(emit, key, 1)), starts)
    elif rank in (2, 3):
        attended = emit.op1("Greater", [mask, emit.const(np.int32(0))])
        keep = _unsqueeze(emit, attended, [1, 2] if rank == 2 else [1])
    if not causal:
        return keep, None
    seq = _dim(emit, query, 1)
    index = _positions(emit, seq)
    rows = _unsqueeze(emit, emit.op1("Add", [index, past_length]) if past_length is not None else index, [1])
    later = emit.op1("Greater", [_positions(emit, key_length or _dim(emit, key, 1)), rows])
    # The kernel's causal loop stops before the last query (and is off at sequence 1): that row
    # attends every key, which matters only where there are more keys than past + queries.
    not_last = emit.op1("Less", [_unsqueeze(emit, index, [1]), emit.op1("Add", [seq, emit.const(np.int64(-1))])])
    return keep, emit.op1("Not", [emit.op1("And", [later, not_last])])


def _key_lengths_mask(emit: Emitter, mask: str, query: str, keys: str, starts: bool) -> str:
    """A 1-D mask of key lengths (B), or with ``starts`` also of start positions (2B): keys
    before the length and at or after the start are attended; (B, 1, 1, T)."""
    batch = _unsqueeze(emit, _dim(emit, query, 0), [0])
    mask64 = emit.op1("Cast", [mask], to=_T.INT64)
    ends = emit.op1("Slice", [mask64, emit.const(np.array([0], np.int64)), batch])
    keep = emit.op1("Less", [keys, _unsqueeze(emit, ends, [1])])
    if starts:
        # Concatenating B zeros and taking [B, 2B) gives the starts for B and 2B values alike
        # (0 when absent), without knowing B statically.
        padded = emit.op1("Concat", [mask64, emit.op1("Mul", [ends, emit.const(np.int64(0))])], axis=0)
        first = emit.op1("Slice", [padded, batch, emit.op1("Add", [batch, batch])])
        before = emit.op1("Less", [keys, _unsqueeze(emit, first, [1])])
        keep = emit.op1("And", [keep, emit.op1("Not", [before])])
    return _unsqueeze(emit, keep, [1, 2])


def emit_heads_attention(
    emit: Emitter,
    q: str,
    k: str,
    v: str,
    heads: int,
    sizes: list[int],
    scale: float,
    keep: str | None,
    causal: str | None,
    site: Site,
    output: str,
    kv_heads: tuple[str, str] | None = None,
    attention_bias: str = "",
    *,
    qk: str = "",
) -> None:
    """Scaled dot-product attention over ``heads`` heads of Q (B, S, Hq), K (B, T, Hk), V (B, T, Hv),
    as onnxruntime's CPU kernel computes it; writes (B, S, Hv) to ``output``. ``kv_heads``: K and V
    already split into heads, (B, N, T, H) each (past state concatenated). ``attention_bias``
    (B or 1, N or 1, S, T) is added to the scaled scores before the mask (the kernel's order,
    measured: it shows where every key of a row is masked). ``qk``: where to write the scores the
    Softmax reads (MultiHeadAttention's qk output: the kernel copies each row there after adding
    attention_bias and the mask)."""
    head_qk, head_v = sizes[0] // heads, sizes[2] // heads
    if scale == 0.0:  # the kernel: 1.0f / sqrt(static_cast<float>(head_size))
        scale = float(np.float32(1.0) / np.sqrt(np.float32(head_qk)))

    def split(t: str, size: int, perm: list[int]) -> str:
        shaped = emit.op1("Reshape", [t, emit.const(np.array([0, 0, heads, size], np.int64))])
        return emit.op1("Transpose", [shaped], perm=perm)

    qh = split(q, head_qk, [0, 2, 1, 3])
    if kv_heads is None:
        kh, vh = split(k, head_qk, [0, 2, 3, 1]), split(v, head_v, [0, 2, 1, 3])
    else:
        kh, vh = emit.op1("Transpose", [kv_heads[0]], perm=[0, 1, 3, 2]), kv_heads[1]
    scores = emit.op1("Mul", [emit.op1("MatMul", [qh, kh]), emit.const(np.float32(scale))], hint="Scale")
    if attention_bias:
        scores = emit.op1("Add", [scores, attention_bias], hint="AddAttentionBias")
    additive = None
    if keep is not None:
        fill = np.float32(site.attribute("mask_filter_value", _DEFAULT_FILTER))
        additive = emit.op1("Where", [keep, emit.const(np.float32(0.0)), emit.const(fill)], hint="Mask")
    if causal is not None:
        # The kernel's mask holds float32's lowest value at the keys after the query, in place of the
        # padding mask's value, and is added to the score (measured: scores beyond 2^103 overflow to
        # -inf there, +inf and NaN scores stay what they were plus lowest).
        lowest = emit.const(np.float32(np.finfo(np.float32).min))
        kept = additive if additive is not None else emit.const(np.float32(0.0))
        additive = emit.op1("Where", [causal, kept, lowest], hint="Causal")
    if additive is not None:
        scores = emit.op1("Add", [scores, additive], hint="AddMask")
    if qk:
        emit.op1("Identity", [scores], qk)
    single_axis = emit.opset >= kernel_opsets.OP_VERSIONS["softmax-single-axis"]
    probs = emit.op1("Softmax", [scores], axis=-1 if single_axis else 3)  # 3: the last axis of 4-D scores
    context = emit.op1("Transpose", [emit.op1("MatMul", [probs, vh])], perm=[0, 2, 1, 3])
    emit.op1("Reshape", [context, emit.const(np.array([0, 0, sizes[2]], np.int64))], output)


register(AttentionBuilder())
