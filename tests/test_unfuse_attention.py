"""onnxruntime's com.microsoft attention fusions -> standard ops, against onnxruntime's own CPU kernels.

The fused op and its rewrite run in the same onnxruntime (1.31.1) on a battery of shapes, head
counts and masks (none, key lengths, key lengths with starts, raw 2-D and 3-D masks, causal, fully
masked rows, lengths beyond the sequence). The rules are bounded; where the measurements show the
rewrite bit-exact (input hidden size <= 128, batch·sequence > 1) that is asserted bit for bit, so a
change in either side shows, and elsewhere the stated bound is asserted and shown tight enough to
catch a broken rewrite. The real model is a tiny BERT-like encoder built here as transformers
exports it, fused by onnxruntime.transformers' optimizer itself.
"""

from __future__ import annotations

import contextlib
import copy
import math
import platform
import re
from unittest import mock

import _embed_kernel as embed_kernel
import numpy as np
import onnx
import pytest
from _int_matmul_helpers import saturating_matmul
from _verify_helpers import node_row
from conftest import assert_bitwise_equal, rule_marker, run, u8s8_saturates_here
from onnx import TensorProto, helper, numpy_helper

import onnx_qrewrite
from onnx_qrewrite.errors import EXIT_DISAGREE
from onnx_qrewrite.rewriter import u8s8
from onnx_qrewrite.verify import element_bounds, u8s8_reference, verify
from onnx_qrewrite.verify.u8s8_reference import without_saturation

RNG = np.random.default_rng(7)


def attention_model(batch, seq, hidden_in, sizes, heads, mask_shape=None, attrs=None, opset=17, outputs=("y",)):
    inputs = ["x", "w", "b"] + (["m"] if mask_shape else [])
    values = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, seq, hidden_in]),
        helper.make_tensor_value_info("w", TensorProto.FLOAT, [hidden_in, sum(sizes)]),
        helper.make_tensor_value_info("b", TensorProto.FLOAT, [sum(sizes)]),
    ]
    if mask_shape:
        values.append(helper.make_tensor_value_info("m", TensorProto.INT32, list(mask_shape)))
    node = helper.make_node(
        "Attention", inputs, list(outputs), name="attn", domain="com.microsoft", num_heads=heads, **(attrs or {})
    )
    graph = helper.make_graph(
        [node], "g", values, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, seq, sizes[2]])]
    )
    return helper.make_model(
        graph, ir_version=8, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)]
    )


def attention_feeds(batch, seq, hidden_in, sizes, mask=None, scale=1.0):
    feeds = {
        "x": (RNG.standard_normal((batch, seq, hidden_in)) * scale).astype(np.float32),
        "w": (RNG.standard_normal((hidden_in, sum(sizes))) * hidden_in**-0.5).astype(np.float32),
        "b": (RNG.standard_normal(sum(sizes)) * 0.1).astype(np.float32),
    }
    if mask == "lengths":
        feeds["m"] = RNG.integers(0, seq + 1, batch).astype(np.int32)
        feeds["m"][0] = 0  # a fully masked batch entry
    elif mask == "lengths+starts":
        ends = RNG.integers(1, seq + 1, batch)
        feeds["m"] = np.concatenate([ends, RNG.integers(0, ends)]).astype(np.int32)
    elif mask == "raw":
        feeds["m"] = RNG.integers(-1, 3, (batch, seq)).astype(np.int32)  # > 0 attends: -1 and 0 mask
        feeds["m"][0] = 0  # a fully masked batch entry
    elif mask == "3d":
        feeds["m"] = RNG.integers(0, 2, (batch, seq, seq)).astype(np.int32)
    return feeds


MASK_SHAPES = {
    None: lambda b, s: None,
    "lengths": lambda b, s: (b,),
    "lengths+starts": lambda b, s: (2 * b,),
    "raw": lambda b, s: (b, s),
    "3d": lambda b, s: (b, s, s),
}


def rewrite_and_run(model, feeds, **kw):
    result = onnx_qrewrite.rewrite(model, **kw)
    assert {n.domain for n in result.model.graph.node} == {""}
    return result, run(model, feeds)["y"], run(result.model, feeds)["y"]


@rule_marker("unfuse-attention", "positive")
@pytest.mark.parametrize("mask", list(MASK_SHAPES), ids=lambda m: m or "no-mask")
@pytest.mark.parametrize("unidirectional", [0, 1])
@pytest.mark.parametrize("shape", [(2, 8, 32, 2), (3, 7, 128, 8), (1, 16, 64, 1)], ids=str)
def test_attention_is_bit_exact_where_measured_so(mask, unidirectional, shape):
    batch, seq, hidden, heads = shape
    sizes = [hidden] * 3
    model = attention_model(
        batch, seq, hidden, sizes, heads, MASK_SHAPES[mask](batch, seq), {"unidirectional": unidirectional}
    )
    result, want, got = rewrite_and_run(model, attention_feeds(batch, seq, hidden, sizes, mask))
    assert result.report.by_rule() == {"unfuse-attention": 1}
    assert [r.exactness for r in result.report.rewrites] == ["bounded"]
    assert_bitwise_equal(got, want, f"Attention {shape}, mask {mask}, unidirectional {unidirectional}")


ATTRIBUTE_CASES = {
    "qkv_hidden_sizes": ([32, 32, 16], {"qkv_hidden_sizes": [32, 32, 16]}, "raw"),
    "scale_and_filter": ([32, 32, 32], {"scale": 0.3, "mask_filter_value": -1e9}, "raw"),
    "filter_-1": ([32, 32, 32], {"mask_filter_value": -1.0, "unidirectional": 1}, "lengths+starts"),
}


@rule_marker("unfuse-attention", "positive")
@pytest.mark.parametrize("case", list(ATTRIBUTE_CASES))
def test_attention_attributes(case):
    sizes, attrs, mask = ATTRIBUTE_CASES[case]
    model = attention_model(2, 8, 32, sizes, 4, MASK_SHAPES[mask](2, 8), attrs)
    _, want, got = rewrite_and_run(model, attention_feeds(2, 8, 32, sizes, mask))
    assert_bitwise_equal(got, want, case)


@pytest.mark.parametrize("lengths", [[0, 0], [8, 8], [9, 100]], ids=str)
def test_attention_edge_key_lengths(lengths):
    # Every key masked (softmax over equal -10000 + score values), none, and lengths past the sequence.
    model = attention_model(2, 8, 32, [32] * 3, 4, (2,))
    feeds = attention_feeds(2, 8, 32, [32] * 3) | {"m": np.array(lengths, np.int32)}
    _, want, got = rewrite_and_run(model, feeds)
    assert_bitwise_equal(got, want, f"key lengths {lengths}")


def test_attention_at_opset_11_without_a_mask():
    model = attention_model(2, 8, 32, [32] * 3, 4, opset=11)
    result, want, got = rewrite_and_run(model, attention_feeds(2, 8, 32, [32] * 3), keep_opset=True)
    assert result.model.opset_import[0].version == 11
    assert_bitwise_equal(got, want, "opset 11")


@pytest.mark.parametrize("opset", [11, 12])
@pytest.mark.parametrize("mask", [m for m in MASK_SHAPES if m], ids=str)
def test_attention_masks_at_opsets_11_and_12(opset, mask):
    # The mask and causal arithmetic's newest op is Range-11 (kernel_opsets.FORMS["attention-mask"]):
    # at 11 and 12 the model keeps its opset, passes onnx's full check, and is bit-exact.
    model = attention_model(2, 8, 32, [32] * 3, 4, MASK_SHAPES[mask](2, 8), {"unidirectional": 1}, opset=opset)
    result, want, got = rewrite_and_run(model, attention_feeds(2, 8, 32, [32] * 3, mask), keep_opset=True)
    assert result.model.opset_import[0].version == opset
    onnx.checker.check_model(result.model, full_check=True)
    assert_bitwise_equal(got, want, f"opset {opset}, mask {mask}")
    mha = mha_model(2, 8, 6, 32, 32, 4, True, {"lengths": (2,), "raw": (2, 6), "3d": (2, 8, 6)}.get(mask))
    if mha.graph.node[0].input[-1] == "m":
        mha.opset_import[0].version = opset
        result = onnx_qrewrite.rewrite(mha, keep_opset=True)
        feeds = mha_feeds(2, 8, 6, 32, 32, True, mask)
        assert_bitwise_equal(run(result.model, feeds)["y"], run(mha, feeds)["y"], f"MultiHeadAttention opset {opset}")
    if mask in ("lengths", "raw"):  # QAttention: uint8 weights (no pair of products leaves int16)
        shape = MASK_SHAPES[mask](2, 8)
        qattention = qattention_model(2, 8, 32, 4, "uint8", False, shape)
        qattention.opset_import[0].version = opset
        result = onnx_qrewrite.rewrite(qattention, keep_opset=True)
        assert result.model.opset_import[0].version == opset
        feeds = qattention_feeds(2, 8, 32, shape)
        assert_bitwise_equal(run(result.model, feeds)["y"], run(qattention, feeds)["y"], f"QAttention opset {opset}")


def _attention_bound(feeds, sizes, heads):
    """The rule's stated bound: 2^-20 · (1 + max|score|) · max|V|, score = scale · Q·Kᵀ per head."""
    x, w, b = (feeds[k].astype(np.float64) for k in ("x", "w", "b"))
    qkv = x @ w + b
    q, k, v = np.split(qkv, np.cumsum(sizes)[:2], axis=-1)
    head = sizes[0] // heads
    qh = q.reshape(*q.shape[:2], heads, head).transpose(0, 2, 1, 3)
    kh = k.reshape(*k.shape[:2], heads, head).transpose(0, 2, 3, 1)
    scores = (qh @ kh) / math.sqrt(head)
    return 2.0**-20 * (1 + np.abs(scores).max()) * np.abs(v).max()


BOUNDED_SHAPES = [(2, 33, 256, 4), (2, 5, 384, 6), (1, 64, 768, 12), (1, 1, 64, 2), (3, 1, 32, 4)]


@rule_marker("unfuse-attention", "positive")
@pytest.mark.parametrize("shape", BOUNDED_SHAPES, ids=str)
@pytest.mark.parametrize("scale", [1.0, 30.0])
def test_attention_beyond_the_bit_exact_cases_is_within_the_stated_bound(shape, scale):
    batch, seq, hidden, heads = shape
    sizes = [hidden] * 3
    model = attention_model(batch, seq, hidden, sizes, heads, (batch, seq))
    feeds = attention_feeds(batch, seq, hidden, sizes, "raw", scale)
    feeds["m"][0] = 1
    _, want, got = rewrite_and_run(model, feeds)
    diff = np.abs(got.astype(np.float64) - want)
    bound = _attention_bound(feeds, sizes, heads)
    assert diff.max() <= bound, f"{diff.max():g} > {bound:g}"
    if seq > 1 and batch * seq > 1 and hidden > 128:
        assert diff.max() > 0  # not bit-exact here: the bound is what is claimed


def test_a_broken_attention_rewrite_exceeds_the_bound_and_is_caught_at_its_node():
    sizes = [256] * 3
    model = attention_model(2, 9, 256, sizes, 4, (2, 9))
    feeds = attention_feeds(2, 9, 256, sizes, "raw")
    feeds["m"][0] = 1
    rewritten = onnx_qrewrite.rewrite(model).model
    broken = copy.deepcopy(rewritten)
    scale = next(n for n in broken.graph.node if n.op_type == "Mul" and "Scale" in n.name)
    init = next(i for i in broken.graph.initializer if i.name == scale.input[1])
    value = numpy_helper.to_array(init)
    init.CopyFrom(
        numpy_helper.from_array(np.nextafter(value, np.float32(1), dtype=np.float32) * np.float32(1.001), init.name)
    )
    got = run(broken, feeds)["y"]
    want = run(model, feeds)["y"]
    assert np.abs(got.astype(np.float64) - want).max() > _attention_bound(feeds, sizes, 4)
    assert verify(model, rewritten, inputs=feeds).passed
    report = verify(model, broken, inputs=feeds)
    assert not report.passed
    assert (report.localization.origin, report.localization.rule) == ("attn", "unfuse-attention")


def _with_input(index, name, shape):
    model = attention_model(2, 8, 32, [32] * 3, 4)
    node = model.graph.node[0]
    while len(node.input) < index:
        node.input.append("")
    node.input.append(name)
    model.graph.input.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, shape))
    return model


def _with_past(model):
    model.graph.node[0].output.append("present")
    model.graph.output.append(helper.make_tensor_value_info("present", TensorProto.FLOAT, [2, 2, 4, 11, 8]))
    return model


def _without_bias():
    model = attention_model(2, 8, 32, [32] * 3, 4)
    del model.graph.node[0].input[2]
    del model.graph.input[2]
    return model


def _with_type(model, name, elem):
    next(v for v in model.graph.input if v.name == name).type.tensor_type.elem_type = elem
    return model


NOT_LOWERED = {
    "past without present": (lambda: _with_input(4, "past", [2, 2, 4, 0, 8]), "past without present"),
    "attention_bias of rank 3": (
        lambda: _with_input(5, "ab", [2, 8, 8]),
        "attention_bias is 3-D; the kernel takes 4-D",
    ),
    "past_sequence_length of int64": (
        lambda: _with_type(_with_input(6, "psl", [1]), "psl", TensorProto.INT64),
        "past_sequence_length is int64, not int32",
    ),
    "past with attention_bias (the kernel refuses it)": (
        lambda: _with_past(_with_attention_bias(_with_input(4, "past", [2, 2, 4, 3, 8]), [2, 4, 8, 11])),
        "past with attention_bias: the kernel refuses it",
    ),
    "present with K and V sizes apart": (
        lambda: attention_model(
            2, 8, 32, [32, 32, 16], 4, attrs={"qkv_hidden_sizes": [32, 32, 16]}, outputs=("y", "p")
        ),
        "past/present with K and V of different sizes [32, 16]",
    ),
    "past of another head size": (
        lambda: _with_past(_with_input(4, "past", [2, 2, 4, 3, 4])),
        "past of shape (2, 2, 4, 3, 4) is not (2, batch, 4, past length, 8)",
    ),
    "shared past/present buffer": (
        lambda: attention_model(2, 8, 32, [32] * 3, 4, attrs={"past_present_share_buffer": 1}),
        "past_present_share_buffer=1: onnxruntime's CPU kernel refuses it",
    ),
    "4-D mask": (
        lambda: attention_model(2, 8, 32, [32] * 3, 4, (2, 1, 8, 8)),
        "a 4-D mask_index (Megatron's (B, 1, max, max)): onnxruntime's CPU kernel refuses it",
    ),
    "rotary": (
        lambda: attention_model(2, 8, 32, [32] * 3, 4, attrs={"do_rotary": 1}),
        "do_rotary=1: onnxruntime's CPU kernel refuses it",
    ),
    "no bias": (
        _without_bias,
        "no bias: onnxruntime 1.31's CPU kernel crashes",
    ),
    "uneven heads": (lambda: attention_model(2, 8, 30, [30] * 3, 4), "do not split into 4 heads"),
    "float16": (
        lambda: _with_type(attention_model(2, 8, 32, [32] * 3, 4), "x", TensorProto.FLOAT16),
        "'x' is float16; onnxruntime's CPU has no float16 kernel for the op",
    ),
}


@rule_marker("unfuse-attention", "negative")
@pytest.mark.parametrize("case", list(NOT_LOWERED))
def test_attention_forms_not_lowered_say_why(case):
    make, reason = NOT_LOWERED[case]
    with pytest.raises(onnx_qrewrite.LoweringError, match=re.escape(reason)):
        onnx_qrewrite.rewrite(make())


def _shared_buffer_attention():
    """Attention with past_present_share_buffer, past (2, B, N, M, H) and past_sequence_length given
    as the schema says: the CPU kernel still asks for it."""
    model = _with_input(4, "past", [2, 2, 4, 10, 8])
    model.graph.node[0].attribute.append(helper.make_attribute("past_present_share_buffer", 1))
    model.graph.node[0].input.extend(["", "psl"])
    model.graph.input.append(helper.make_tensor_value_info("psl", TensorProto.INT32, [1]))
    return _with_past(model)


#: The forms the rules refuse because onnxruntime's CPU kernel does: what it says when run.
KERNEL_REFUSES = {
    "Attention, Megatron 4-D mask": (
        lambda: attention_model(2, 5, 16, [16] * 3, 2, (2, 1, 8, 8)),
        "4D mask in attention cpu kernel is not supported",
    ),
    "Attention, 4-D mask of another shape": (
        lambda: attention_model(2, 5, 16, [16] * 3, 2, (2, 2, 5, 5)),
        "with 4D data shall have shape batch_size x 1 x max_sequence_length x max_sequence_length",
    ),
    "Attention, do_rotary": (
        lambda: attention_model(2, 5, 16, [16] * 3, 2, attrs={"do_rotary": 1}),
        "Rotary embedding is not supported in Attention CPU kernel",
    ),
    "QAttention, Megatron 4-D mask": (
        lambda: qattention_model(2, 5, 32, 2, mask_shape=(2, 1, 8, 8)),
        "4D mask in attention cpu kernel is not supported",
    ),
    "Attention, shared past/present buffer with past_sequence_length": (
        _shared_buffer_attention,
        "past_sequence_length tensor must be of one element when past_present_share_buffer is set",
    ),
    "QAttention, shared past/present buffer": (
        lambda: _with_rotary(qattention_with_past(2, 4, 3, 32, 2), "past_present_share_buffer"),
        "past_present_share_buffer is set",
    ),
}


@rule_marker("unfuse-attention", "negative")
@rule_marker("unfuse-qattention", "negative")
@pytest.mark.parametrize("case", list(KERNEL_REFUSES))
def test_forms_the_cpu_kernel_refuses_are_refused_and_still_refused_by_the_kernel(case):
    """Nothing to measure a rewrite against: the rules refuse what onnxruntime's CPU kernel refuses
    (4-D masks, Attention's do_rotary), and this shows when a new onnxruntime starts running them."""
    make, says = KERNEL_REFUSES[case]
    model = make()
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in model.graph.input}
    init = {t.name for t in model.graph.initializer}
    feeds = {}
    for value in model.graph.input:
        if value.name in init:
            continue
        kind = helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
        feeds[value.name] = RNG.integers(0, 2, shapes[value.name]).astype(kind)
    with pytest.raises(Exception, match=re.escape(says)):
        run(model, feeds)
    with pytest.raises(onnx_qrewrite.LoweringError, match="CPU kernel refuses it"):
        onnx_qrewrite.rewrite(model)


@rule_marker("unfuse-attention", "positive")
@pytest.mark.parametrize("past", [0, 3])
def test_attention_past_sequence_length_is_not_read(past):
    """Input 6 (past_sequence_length) without past_present_share_buffer: the CPU kernel reads none of
    it (measured: any value and shape give the same outputs), nor does the rewrite: bit for bit."""
    batch, seq, hidden, heads = 2, 4, 32, 4
    model = past_attention_model(batch, seq, past, hidden, heads, (batch, past + seq), with_past=bool(past))
    node = model.graph.node[0]
    node.input.extend([""] * (6 - len(node.input)) + ["psl"])
    model.graph.input.append(helper.make_tensor_value_info("psl", TensorProto.INT32, [2]))
    feeds = past_feeds(batch, seq, past, hidden, heads, "raw")
    if not past:
        del feeds["past"]
    result = onnx_qrewrite.rewrite(model)
    assert result.report.by_rule() == {"unfuse-attention": 1}
    got = run(result.model, {**feeds, "psl": np.array([5, -1], np.int32)})
    for value in ([0, 0], [past, 9]):
        want = run(model, {**feeds, "psl": np.array(value, np.int32)})
        for name in want:
            assert_bitwise_equal(got[name], want[name], f"past_sequence_length {value}: {name}")


def _with_attention_bias(model, shape):
    node = model.graph.node[0]
    while len(node.input) < 5:
        node.input.append("")
    node.input.append("ab")
    model.graph.input.append(helper.make_tensor_value_info("ab", TensorProto.FLOAT, list(shape)))
    return model


#: attention_bias shapes onnxruntime's Attention (B 2, S 8, N 4) and MultiHeadAttention (B 2, S 8,
#: N 4, L 6) kernels refuse: (B or 1, N or 1, S, total) only; the rewrite would broadcast the others
BIAS_SHAPES_REFUSED = [
    ("Attention", [2, 4, 1, 8], 2),
    ("Attention", [2, 4, 8, 1], 3),
    ("Attention", [2, 2, 8, 8], 1),
    ("MultiHeadAttention", [2, 4, 1, 6], 2),
    ("MultiHeadAttention", [1, 1, 8, 1], 3),
    ("MultiHeadAttention", [3, 1, 8, 6], 0),
]


@rule_marker("unfuse-attention", "negative")
@rule_marker("unfuse-multi-head-attention", "negative")
@pytest.mark.parametrize(("op", "shape", "axis"), BIAS_SHAPES_REFUSED, ids=str)
def test_attention_bias_shapes_the_kernel_refuses_are_refused(op, shape, axis):
    """Refused by name where the shape is recorded, quoting the kernel's message for the sequence
    axes; and onnxruntime refuses the same shapes when it runs."""
    rng = np.random.default_rng(3)  # its own: the module's RNG feeds later tests their data
    if op == "Attention":
        model = attention_model(2, 8, 32, [32] * 3, 4)
        sizes = {"x": (2, 8, 32), "w": (32, 96), "b": (96,)}
    else:
        model = mha_model(2, 8, 6, 32, 32, 4)
        sizes = {"q": (2, 8, 32), "k": (2, 6, 32), "v": (2, 6, 32), "b": (96,)}
    model = _with_attention_bias(model, shape)
    feeds = {name: rng.standard_normal(size).astype(np.float32) for name, size in {**sizes, "ab": shape}.items()}
    kernel = {2: "sequence_length", 3: "total_sequence_length"}.get(axis)
    said = f"Input 'attention_bias' dimension {axis} should be same as {kernel}, got {shape[axis]}" if kernel else ""
    with pytest.raises(onnx_qrewrite.LoweringError, match=re.escape(f"'ab' has dimension {axis} = {shape[axis]}")) as e:
        onnx_qrewrite.rewrite(model)
    assert said in str(e.value)
    with pytest.raises(Exception, match=re.escape(said) if said else "attention_bias"):
        run(model, feeds)


@rule_marker("unfuse-attention", "positive")
@pytest.mark.parametrize("form", ["full", "heads", "one"])
@pytest.mark.parametrize("mask", [None, "raw", "lengths"], ids=str)
@pytest.mark.parametrize("unidirectional", [0, 1])
@pytest.mark.parametrize("present", [False, True], ids=["no-present", "present"])
def test_attention_bias_is_bit_exact(present, unidirectional, mask, form):
    """attention_bias (B or 1, N or 1, S, T) joins the scaled scores before the mask, as in
    MultiHeadAttention (the same kernel code): the fully masked entries show the order bit for bit.
    (The kernel refuses it with past.)"""
    batch, seq, hidden, heads = 2, 8, 32, 4
    shape = {"full": (batch, heads, seq, seq), "heads": (1, heads, seq, seq), "one": (1, 1, seq, seq)}[form]
    attrs = {"unidirectional": unidirectional}
    outputs = ("y", "present") if present else ("y",)
    model = attention_model(batch, seq, hidden, [hidden] * 3, heads, MASK_SHAPES[mask](batch, seq), attrs)
    if present:
        model = past_attention_model(batch, seq, 0, hidden, heads, MASK_SHAPES[mask](batch, seq), attrs, False)
    feeds = attention_feeds(batch, seq, hidden, [hidden] * 3, mask)
    model = _with_attention_bias(model, shape)
    feeds["ab"] = (RNG.standard_normal(shape) * 3).astype(np.float32)
    result = onnx_qrewrite.rewrite(model)
    assert result.report.by_rule() == {"unfuse-attention": 1}
    want, got = run(model, feeds), run(result.model, feeds)
    for name in outputs:
        assert_bitwise_equal(got[name], want[name], f"{name}: present {present}, mask {mask}, bias {form}")
    dropped = {**feeds, "ab": np.zeros_like(feeds["ab"])}
    assert np.abs(run(result.model, dropped)["y"] - want["y"]).max() > 1e-3  # the bias matters here


@rule_marker("unfuse-attention", "positive")
@pytest.mark.parametrize("shape", [(2, 33, 256, 4), (3, 1, 32, 4)], ids=str)
def test_attention_bias_beyond_the_bit_exact_cases_is_within_the_stated_bound(shape):
    """Wider inputs and one query: the projection rounds differently; the output within the bound,
    its score counting attention_bias."""
    batch, seq, hidden, heads = shape
    sizes = [hidden] * 3
    model = _with_attention_bias(attention_model(batch, seq, hidden, sizes, heads), (batch, heads, seq, seq))
    feeds = attention_feeds(batch, seq, hidden, sizes)
    feeds["ab"] = (RNG.standard_normal((batch, heads, seq, seq)) * 10).astype(np.float32)
    _, want, got = rewrite_and_run(model, feeds)
    ab_top = np.abs(feeds["ab"]).max() * 2.0**-20 * np.abs(feeds["x"] @ feeds["w"] + feeds["b"]).max()
    assert np.abs(got.astype(np.float64) - want).max() <= _attention_bound(feeds, sizes, heads) + ab_top


# --- Attention with past / present state (the KV cache of GPT-2-like decoders) --------------------


def past_attention_model(batch, seq, past, hidden, heads, mask_shape=None, attrs=None, with_past=True):
    """Attention reading past (2, B, N, P, H) and writing present (2, B, N, P + S, H)."""
    model = attention_model(batch, seq, hidden, [hidden] * 3, heads, mask_shape, attrs, outputs=("y", "present"))
    head, total = hidden // heads, past + seq if with_past else seq
    if with_past:
        node = model.graph.node[0]
        while len(node.input) < 4:
            node.input.append("")
        node.input.append("past")
        model.graph.input.append(
            helper.make_tensor_value_info("past", TensorProto.FLOAT, [2, batch, heads, past, head])
        )
    model.graph.output.append(
        helper.make_tensor_value_info("present", TensorProto.FLOAT, [2, batch, heads, total, head])
    )
    return model


def past_feeds(batch, seq, past, hidden, heads, mask=None, scale=1.0):
    total = past + seq
    feeds = attention_feeds(batch, seq, hidden, [hidden] * 3, None, scale)
    feeds["past"] = (RNG.standard_normal((2, batch, heads, past, hidden // heads)) * scale).astype(np.float32)
    if mask == "raw":
        feeds["m"] = RNG.integers(-1, 3, (batch, total)).astype(np.int32)
    elif mask == "lengths":
        feeds["m"] = RNG.integers(0, total + 1, batch).astype(np.int32)
    elif mask == "lengths+starts":
        ends = RNG.integers(1, total + 1, batch)
        feeds["m"] = np.concatenate([ends, RNG.integers(0, ends)]).astype(np.int32)
    elif mask == "3d":
        feeds["m"] = RNG.integers(0, 2, (batch, seq, total)).astype(np.int32)
    return feeds


PAST_MASKS = {
    None: lambda b, s, t: None,
    "lengths": lambda b, s, t: (b,),
    "lengths+starts": lambda b, s, t: (2 * b,),
    "raw": lambda b, s, t: (b, t),
    "3d": lambda b, s, t: (b, s, t),
}


def run_past(model, feeds):
    result = onnx_qrewrite.rewrite(model)
    assert {n.domain for n in result.model.graph.node} == {""}
    assert result.report.by_rule() == {"unfuse-attention": 1}
    return run(model, feeds), run(result.model, feeds)


@rule_marker("unfuse-attention", "positive")
@pytest.mark.parametrize("mask", list(PAST_MASKS), ids=lambda m: m or "no-mask")
@pytest.mark.parametrize("unidirectional", [0, 1])
@pytest.mark.parametrize("shape", [(2, 4, 3, 32, 4), (1, 5, 0, 64, 2), (3, 2, 7, 128, 8)], ids=str)
def test_attention_with_past_and_present_is_bit_exact_where_measured_so(mask, unidirectional, shape):
    """Sequence > 1 and input hidden size <= 128, as without state: output and present bit for bit
    (past length 0 included; causal masks the keys after past length + i for query i)."""
    batch, seq, past, hidden, heads = shape
    model = past_attention_model(
        batch, seq, past, hidden, heads, PAST_MASKS[mask](batch, seq, past + seq), {"unidirectional": unidirectional}
    )
    want, got = run_past(model, past_feeds(batch, seq, past, hidden, heads, mask))
    for name in ("y", "present"):
        assert_bitwise_equal(got[name], want[name], f"{name}: {shape}, mask {mask}, unidirectional {unidirectional}")


@rule_marker("unfuse-attention", "positive")
def test_attention_present_without_past_is_bit_exact():
    model = past_attention_model(2, 6, 0, 32, 4, (2, 6), {"unidirectional": 1}, with_past=False)
    feeds = past_feeds(2, 6, 0, 32, 4, "raw")
    del feeds["past"]
    want, got = run_past(model, feeds)
    for name in ("y", "present"):
        assert_bitwise_equal(got[name], want[name], name)


def _projection_bound(feeds, hidden):
    """The present's bound: K and V are float32 sums of `hidden` products and the bias in another
    order than the kernel's, within 2·(hidden + 1)·2^-24·(|x|·|W| + |b|) at each element."""
    x, w, b = (np.abs(feeds[k].astype(np.float64)) for k in ("x", "w", "b"))
    return 2 * (hidden + 1) * 2.0**-24 * (x @ w + b)


def _past_attention_bound(feeds, hidden, heads):
    """Attention's stated bound with the past keys and values included: 2^-20·(1 + max|score|)·max|V|."""
    x, w, b = (feeds[k].astype(np.float64) for k in ("x", "w", "b"))
    q, k, v = np.split(x @ w + b, 3, axis=-1)
    head = hidden // heads
    kh, vh = (t.reshape(*t.shape[:2], heads, head).transpose(0, 2, 1, 3) for t in (k, v))
    kh, vh = (np.concatenate([feeds["past"][i], t], axis=2) for i, t in enumerate((kh, vh)))
    qh = q.reshape(*q.shape[:2], heads, head).transpose(0, 2, 1, 3)
    scores = qh @ kh.transpose(0, 1, 3, 2) / math.sqrt(head)
    return 2.0**-20 * (1 + np.abs(scores).max()) * np.abs(vh).max()


@rule_marker("unfuse-attention", "positive")
@pytest.mark.parametrize("mask", [None, "raw"], ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 9, 64, 2), (3, 1, 5, 32, 4), (2, 3, 4, 256, 4)], ids=str)
def test_attention_with_past_beyond_the_bit_exact_cases_is_within_the_stated_bounds(shape, mask):
    """One new token per step (the decoder's case) and hidden sizes > 128: the output within
    Attention's bound (past keys and values included), the present within the projection's."""
    batch, seq, past, hidden, heads = shape
    model = past_attention_model(batch, seq, past, hidden, heads, PAST_MASKS[mask](batch, seq, past + seq))
    feeds = past_feeds(batch, seq, past, hidden, heads, mask)
    if mask:
        feeds["m"][:, -1] = 1
    want, got = run_past(model, feeds)
    diff = np.abs(got["y"].astype(np.float64) - want["y"])
    assert diff.max() <= _past_attention_bound(feeds, hidden, heads)
    new = np.abs(got["present"][:, :, :, past:].astype(np.float64) - want["present"][:, :, :, past:])
    bound = _projection_bound(feeds, hidden)
    k_bound, v_bound = (t.reshape(batch, seq, heads, -1).transpose(0, 2, 1, 3) for t in np.split(bound, 3, -1)[1:])
    assert (new <= np.stack([k_bound, v_bound])).all()
    assert_bitwise_equal(got["present"][:, :, :, :past], want["present"][:, :, :, :past], "the past, copied")
    assert new.max() > 0 or diff.max() > 0  # not bit-exact here: the bounds are what is claimed


def test_attention_with_past_a_causal_mask_without_the_past_offset_is_caught():
    """The causal mask must let query i see the keys up to past length + i: masking as if there
    were no past (keys after i) changes the output far beyond the bound."""
    model = past_attention_model(2, 4, 3, 32, 4, None, {"unidirectional": 1})
    feeds = past_feeds(2, 4, 3, 32, 4)
    rewritten = onnx_qrewrite.rewrite(model).model
    broken = copy.deepcopy(rewritten)
    adds = [n for n in broken.graph.node if n.op_type == "Add" and any("Range" in i for i in n.input)]
    assert len(adds) == 1  # rows + past length
    rows = adds[0].input[0] if "Range" in adds[0].input[0] else adds[0].input[1]
    for node in broken.graph.node:
        node.input[:] = [rows if i == adds[0].output[0] else i for i in node.input]
    want, got = run(model, feeds)["y"], run(broken, feeds)["y"]
    assert np.abs(got.astype(np.float64) - want).max() > _past_attention_bound(feeds, 32, 4)
    assert_bitwise_equal(run(rewritten, feeds)["y"], want, "the rewrite itself")


# --- MultiHeadAttention ------------------------------------------------------------------------


def mha_model(batch, seq, kv_seq, hidden, hidden_v, heads, bias=True, mask_shape=None, attrs=None):
    inputs = ["q", "k", "v", "b" if bias else "", "m" if mask_shape else ""]
    while not inputs[-1]:
        inputs.pop()
    values = [
        helper.make_tensor_value_info("q", TensorProto.FLOAT, [batch, seq, hidden]),
        helper.make_tensor_value_info("k", TensorProto.FLOAT, [batch, kv_seq, hidden]),
        helper.make_tensor_value_info("v", TensorProto.FLOAT, [batch, kv_seq, hidden_v]),
    ]
    if bias:
        values.append(helper.make_tensor_value_info("b", TensorProto.FLOAT, [2 * hidden + hidden_v]))
    if mask_shape:
        values.append(helper.make_tensor_value_info("m", TensorProto.INT32, list(mask_shape)))
    node = helper.make_node(
        "MultiHeadAttention", inputs, ["y"], name="mha", domain="com.microsoft", num_heads=heads, **(attrs or {})
    )
    output = helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, seq, hidden_v])
    graph = helper.make_graph([node], "g", values, [output])
    return helper.make_model(
        graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )


def mha_feeds(batch, seq, kv_seq, hidden, hidden_v, bias=True, mask=None, scale=1.0):
    feeds = {
        "q": (RNG.standard_normal((batch, seq, hidden)) * scale).astype(np.float32),
        "k": (RNG.standard_normal((batch, kv_seq, hidden)) * scale).astype(np.float32),
        "v": RNG.standard_normal((batch, kv_seq, hidden_v)).astype(np.float32),
    }
    if bias:
        feeds["b"] = RNG.standard_normal(2 * hidden + hidden_v).astype(np.float32)
    if mask == "lengths":
        feeds["m"] = RNG.integers(0, kv_seq + 1, batch).astype(np.int32)
    elif mask == "raw":
        feeds["m"] = RNG.integers(-1, 3, (batch, kv_seq)).astype(np.int32)
        feeds["m"][0] = 0
    elif mask == "3d":
        feeds["m"] = RNG.integers(0, 2, (batch, seq, kv_seq)).astype(np.int32)
    return feeds


MHA_MASKS = {
    "lengths": lambda b, s, t: (b,),
    "raw": lambda b, s, t: (b, t),
    "3d": lambda b, s, t: (b, s, t),
}
MHA_SHAPES = [(2, 8, 8, 32, 32, 2), (2, 5, 9, 64, 32, 4), (2, 16, 16, 768, 768, 12), (3, 4, 1, 32, 32, 1)]


@rule_marker("unfuse-multi-head-attention", "positive")
@pytest.mark.parametrize("mask", list(MHA_MASKS))
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", MHA_SHAPES, ids=str)
def test_multi_head_attention_with_a_mask_is_bit_exact(mask, bias, shape):
    batch, seq, kv_seq = shape[:3]
    model = mha_model(*shape, bias=bias, mask_shape=MHA_MASKS[mask](batch, seq, kv_seq))
    result, want, got = rewrite_and_run(model, mha_feeds(*shape[:5], bias=bias, mask=mask))
    assert result.report.by_rule() == {"unfuse-multi-head-attention": 1}
    assert_bitwise_equal(got, want, f"MultiHeadAttention {shape}, mask {mask}, bias {bias}")


@rule_marker("unfuse-multi-head-attention", "positive")
@pytest.mark.parametrize(
    "attrs", [{"unidirectional": 1}, {"unidirectional": 1, "mask_filter_value": -1.0, "scale": 0.3}]
)
def test_multi_head_attention_attributes(attrs):
    model = mha_model(2, 8, 8, 32, 32, 2, mask_shape=(2,), attrs=attrs)
    _, want, got = rewrite_and_run(model, mha_feeds(2, 8, 8, 32, 32, mask="lengths"))
    assert_bitwise_equal(got, want, str(attrs))


def _mha_bound(feeds, hidden, heads):
    q, k, v = (feeds[n].astype(np.float64) for n in "qkv")
    if "b" in feeds:
        b = feeds["b"].astype(np.float64)
        q, k, v = q + b[:hidden], k + b[hidden : 2 * hidden], v + b[2 * hidden :]
    head = hidden // heads
    qh = q.reshape(*q.shape[:2], heads, head).transpose(0, 2, 1, 3)
    kh = k.reshape(*k.shape[:2], heads, head).transpose(0, 2, 3, 1)
    return 2.0**-20 * (1 + np.abs(qh @ kh).max() / math.sqrt(head)) * np.abs(v).max()


@rule_marker("unfuse-multi-head-attention", "positive")
@pytest.mark.parametrize("shape", [*MHA_SHAPES, (1, 1, 7, 64, 64, 2), (2, 100, 100, 64, 64, 2)], ids=str)
@pytest.mark.parametrize("scale", [0.1, 1.0, 10.0])
def test_multi_head_attention_without_a_mask_is_within_the_stated_bound(shape, scale):
    model = mha_model(*shape)
    feeds = mha_feeds(*shape[:5], scale=scale)
    _, want, got = rewrite_and_run(model, feeds)
    diff = np.abs(got.astype(np.float64) - want).max()
    bound = _mha_bound(feeds, shape[3], shape[5])
    assert diff <= bound, f"{diff:g} > {bound:g}"


def test_a_broken_multi_head_attention_rewrite_exceeds_the_bound():
    shape = (2, 16, 16, 64, 64, 4)
    model = mha_model(*shape)
    feeds = mha_feeds(*shape[:5])
    broken = onnx_qrewrite.rewrite(model).model
    scale = next(n for n in broken.graph.node if n.op_type == "Mul" and "Scale" in n.name)
    init = next(i for i in broken.graph.initializer if i.name == scale.input[1])
    init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * np.float32(1.001), init.name))
    diff = np.abs(run(broken, feeds)["y"].astype(np.float64) - run(model, feeds)["y"]).max()
    assert diff > _mha_bound(feeds, 64, 4)


def _mha_with(index, name, shape, **kw):
    model = mha_model(2, 8, 8, 32, 32, 4, **kw)
    node = model.graph.node[0]
    while len(node.input) < index:
        node.input.append("")
    node.input.append(name)
    model.graph.input.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, shape))
    return model


def _packed_kv():
    model = mha_model(2, 8, 8, 32, 32, 4)
    node = model.graph.node[0]
    node.input[1] = "kv"
    node.input[2] = ""
    model.graph.input[1].CopyFrom(helper.make_tensor_value_info("kv", TensorProto.FLOAT, [2, 8, 4, 2, 8]))
    del model.graph.input[2]
    return model


MHA_NOT_LOWERED = {
    "past_sequence_length without past": (
        lambda: _mha_with(8, "psl", [1]),
        "input 8 (past_sequence_length) without past_key/past_value",
    ),
    "past_key alone": (lambda: _mha_with(6, "pk", [2, 4, 3, 8]), "past_key and past_value must both be given"),
    "packed kv": (
        _packed_kv,
        "packed KV (key of shape (B, L, N, 2, H), no value): onnxruntime's CPU kernel refuses it",
    ),
}


@rule_marker("unfuse-multi-head-attention", "negative")
@pytest.mark.parametrize("case", list(MHA_NOT_LOWERED))
def test_multi_head_attention_forms_not_lowered_say_why(case):
    make, reason = MHA_NOT_LOWERED[case]
    with pytest.raises(onnx_qrewrite.LoweringError, match=re.escape(reason)):
        onnx_qrewrite.rewrite(make())


# --- EmbedLayerNormalization ---------------------------------------------------------------------

EMB = {"batch": 3, "seq": 7, "hidden": 48, "vocab": 30, "max_pos": 16}


def embed_model(segment=True, mask=True, position_ids=False, outputs=("y", "mask_index", "sum"), attrs=None):
    b, s, h = EMB["batch"], EMB["seq"], EMB["hidden"]
    inputs = ["ids", "seg" if segment else "", "words", "positions", "segments" if segment else "", "gamma", "beta"]
    inputs += ["m" if mask else "", "pos_ids" if position_ids else ""]
    while not inputs[-1]:
        inputs.pop()
    values = [
        helper.make_tensor_value_info("ids", TensorProto.INT32, [b, s]),
        helper.make_tensor_value_info("words", TensorProto.FLOAT, [EMB["vocab"], h]),
        helper.make_tensor_value_info("positions", TensorProto.FLOAT, [EMB["max_pos"], h]),
        helper.make_tensor_value_info("gamma", TensorProto.FLOAT, [h]),
        helper.make_tensor_value_info("beta", TensorProto.FLOAT, [h]),
    ]
    if segment:
        values += [
            helper.make_tensor_value_info("seg", TensorProto.INT32, [b, s]),
            helper.make_tensor_value_info("segments", TensorProto.FLOAT, [2, h]),
        ]
    if mask:
        values.append(helper.make_tensor_value_info("m", TensorProto.INT32, [b, s]))
    if position_ids:
        values.append(helper.make_tensor_value_info("pos_ids", TensorProto.INT32, [b, s]))
    node = helper.make_node(
        "EmbedLayerNormalization", inputs, list(outputs), name="embed", domain="com.microsoft", **(attrs or {})
    )
    shapes = {"y": [b, s, h], "mask_index": [b], "sum": [b, s, h]}
    results = [
        helper.make_tensor_value_info(o, TensorProto.INT32 if o == "mask_index" else TensorProto.FLOAT, shapes[o])
        for o in outputs
        if o
    ]
    graph = helper.make_graph([node], "g", values, results)
    return helper.make_model(
        graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )


def embed_feeds(scale=1.0):
    b, s, h = EMB["batch"], EMB["seq"], EMB["hidden"]
    return {
        "ids": RNG.integers(0, EMB["vocab"], (b, s)).astype(np.int32),
        "seg": RNG.integers(0, 2, (b, s)).astype(np.int32),
        "words": (RNG.standard_normal((EMB["vocab"], h)) * scale).astype(np.float32),
        "positions": (RNG.standard_normal((EMB["max_pos"], h)) * scale).astype(np.float32),
        "segments": (RNG.standard_normal((2, h)) * scale).astype(np.float32),
        "gamma": RNG.standard_normal(h).astype(np.float32),
        "beta": RNG.standard_normal(h).astype(np.float32),
        # 1 counts; 0, 2 and -1 do not (measured); a row of zeros and a row of ones.
        "m": np.array([[1, 1, 0, 1, 2, -1, 0], [0] * 7, [1] * 7], np.int32),
        "pos_ids": RNG.integers(0, EMB["max_pos"], (b, s)).astype(np.int32),
    }


def _layer_norm_excess(got, want, total, gamma, beta, factor=4, term=0.0):
    """max(|got - want| - bound), the stated bound factor·2^-24·(|γ·x̂| + |β| + 1) at each output, x̂
    the normalized sum (float64): 4 for both forms (the margin of an onnxruntime build that contracts
    multiply-adds in the normalization: test_qembed_layer_norm_bound_where_fma_contraction_changes_rounding;
    bit-exact on x86-64, where it was measured), plus ``term`` (the dequantization's contraction)."""
    total = total.astype(np.float64)
    centred = total - total.mean(axis=-1, keepdims=True)
    normalized = centred / np.sqrt((centred**2).mean(axis=-1, keepdims=True) + 1e-12)
    bound = factor * 2.0**-24 * (np.abs(gamma * normalized) + np.abs(beta) + 1) + term
    return float(np.max(np.abs(got.astype(np.float64) - want) - bound))


def _assert_layer_norm_bound(got, want, total, gamma, beta, what):
    """Within the stated bound everywhere; bit-exact on x86-64, where the kernels' order was measured
    to be reproduced exactly (benchmarks/embed_bound_probe.py: 960 of 960 cases)."""
    excess = _layer_norm_excess(got, want, total, gamma, beta)
    assert excess <= 0, f"{what}: {excess:g} beyond the bound"
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert_bitwise_equal(got, want, what)


@rule_marker("unfuse-embed-layer-norm", "positive")
@pytest.mark.parametrize("segment", [True, False])
@pytest.mark.parametrize("mask", [True, False])
@pytest.mark.parametrize("position_ids", [False, True])
@pytest.mark.parametrize("scale", [1.0, 100.0])
def test_embed_layer_norm(segment, mask, position_ids, scale):
    model = embed_model(segment, mask, position_ids, attrs={"epsilon": 1e-5})
    feeds = {k: v for k, v in embed_feeds(scale).items() if k in {i.name for i in model.graph.input}}
    result = onnx_qrewrite.rewrite(model)
    assert result.report.by_rule() == {"unfuse-embed-layer-norm": 1}
    assert {n.domain for n in result.model.graph.node} == {""}
    want, got = run(model, feeds), run(result.model, feeds)
    assert_bitwise_equal(got["mask_index"], want["mask_index"], "mask index")
    assert_bitwise_equal(got["sum"], want["sum"], "embedding sum")
    _assert_layer_norm_bound(got["y"], want["y"], want["sum"], feeds["gamma"], feeds["beta"], "EmbedLayerNormalization")
    # A broken sum order (segment first) or a dropped position embedding is caught.
    if segment and not position_ids:
        broken = feeds["words"][feeds["ids"]] + feeds["segments"][feeds["seg"]] + feeds["positions"][: EMB["seq"]]
        assert not np.array_equal(broken, want["sum"])


def test_embed_layer_norm_with_only_its_first_output():
    model = embed_model(outputs=("y", ""))
    feeds = {k: v for k, v in embed_feeds().items() if k in {i.name for i in model.graph.input}}
    result = onnx_qrewrite.rewrite(model)
    assert "ReduceSum" not in [n.op_type for n in result.model.graph.node]
    np.testing.assert_allclose(run(result.model, feeds)["y"], run(model, feeds)["y"], rtol=1e-6, atol=1e-6)


@rule_marker("unfuse-embed-layer-norm", "positive")
@pytest.mark.parametrize("mask", [True, False])
def test_embed_layer_norm_with_mask_index_type_0(mask):
    """The CPU kernel does not read mask_index_type: with 0 (the schema's "no mask index") it still
    writes the mask index (measured), and the rewrite does as for 1, bit for bit."""
    model = embed_model(mask=mask, attrs={"mask_index_type": 0, "epsilon": 1e-5})
    feeds = {k: v for k, v in embed_feeds().items() if k in {i.name for i in model.graph.input}}
    result = onnx_qrewrite.rewrite(model)
    assert result.report.by_rule() == {"unfuse-embed-layer-norm": 1}
    want, got = run(model, feeds), run(result.model, feeds)
    assert want["mask_index"].tolist() == ([3, 0, 7] if mask else [0, 0, 0])
    assert_bitwise_equal(got["mask_index"], want["mask_index"], "mask index")
    assert_bitwise_equal(got["sum"], want["sum"], "embedding sum")
    _assert_layer_norm_bound(got["y"], want["y"], want["sum"], feeds["gamma"], feeds["beta"], "mask_index_type 0")


def _as_float16(model, feeds):
    for value in [*model.graph.input, *model.graph.output]:
        if value.type.tensor_type.elem_type == TensorProto.FLOAT:
            value.type.tensor_type.elem_type = TensorProto.FLOAT16
    return model, {k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in feeds.items()}


def _fast_gelu_after(model):
    """``model`` with a com.microsoft FastGelu reading its output y, whose result z replaces y as the
    graph's output (no float16 CPU kernel either)."""
    chained = copy.deepcopy(model)
    chained.graph.node.append(helper.make_node("FastGelu", ["y"], ["z"], domain="com.microsoft"))
    (y,) = [o for o in chained.graph.output if o.name == "y"]
    chained.graph.output.remove(y)
    chained.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT16, None))
    return chained


@rule_marker("unfuse-embed-layer-norm", "negative")
def test_embed_layer_norm_in_float16_is_refused_as_onnxruntime_keeps_float32_to_its_neighbour():
    """onnxruntime has no float16 EmbedLayerNormalization on CPU: it runs the float32 kernel between
    Casts it inserts and drops the Casts between two such nodes, so a FastGelu after it reads the
    unrounded float32 result (shown here: not what the node alone gives), and no rewrite of the node
    alone can match both; refused, as the other fusions without a float16 kernel."""
    model, feeds = _as_float16(embed_model(mask=False, outputs=("y", "mask_index")), embed_feeds())
    feeds = {k: v for k, v in feeds.items() if k in {i.name for i in model.graph.input}}
    alone = run(model, feeds)["y"]
    gelu = helper.make_graph(
        [helper.make_node("FastGelu", ["y"], ["z"], domain="com.microsoft")],
        "g",
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT16, None)],
    )
    after_alone = run(helper.make_model(gelu, ir_version=8, opset_imports=list(model.opset_import)), {"y": alone})["z"]
    chained = run(_fast_gelu_after(model), feeds)["z"]
    assert np.any(chained != after_alone)
    with pytest.raises(onnx_qrewrite.LoweringError, match="'words' is float16; onnxruntime's CPU has no float16"):
        onnx_qrewrite.rewrite(model)


@rule_marker("unfuse-embed-layer-norm", "negative")
def test_embed_layer_norm_forms_not_lowered_say_why():
    with pytest.raises(onnx_qrewrite.LoweringError, match=re.escape("mask_index_type=2 is not one of the schema")):
        onnx_qrewrite.rewrite(embed_model(attrs={"mask_index_type": 2}))
    model = embed_model()
    next(i for i in model.graph.input if i.name == "words").type.tensor_type.elem_type = TensorProto.DOUBLE
    with pytest.raises(onnx_qrewrite.LoweringError, match="'words' is float64; only float32 was measured"):
        onnx_qrewrite.rewrite(model)
    model = embed_model()  # the tables computed by a vendor's op: no declared type, none traced
    for name in ("words", "positions", "segments", "gamma", "beta"):
        model.graph.node.insert(0, helper.make_node("Opaque", [name], [f"{name}_"], domain="vendor"))
    model.graph.node[-1].input[2:7] = ["words_", "positions_", "segments_", "gamma_", "beta_"]
    model.opset_import.append(helper.make_opsetid("vendor", 1))
    with pytest.raises(onnx_qrewrite.LoweringError, match="the element type of the tables, gamma and beta is not"):
        onnx_qrewrite.rewrite(model)
    model, _ = _as_float16(embed_model(), {})  # float16 tables through undeclared Identity nodes: traced
    model.graph.node.insert(0, helper.make_node("Identity", ["words"], ["words_"]))
    model.graph.node[-1].input[2] = "words_"
    with pytest.raises(onnx_qrewrite.LoweringError, match="'words_' is float16; onnxruntime's CPU has no float16"):
        onnx_qrewrite.rewrite(model)
    model = embed_model(segment=True)
    model.graph.node[0].input[4] = ""
    with pytest.raises(onnx_qrewrite.LoweringError, match="segment_ids and segment_embedding must both be given"):
        onnx_qrewrite.rewrite(model)


def qembed_model(table_type=np.uint8, segment=True, mask=True):
    """QEmbedLayerNormalization over 8-bit tables, as quantize_dynamic writes it (constant per-tensor
    scales and zero points as initializers)."""
    b, s, h = EMB["batch"], EMB["seq"], EMB["hidden"]
    lo, hi = (0, 256) if table_type == np.uint8 else (-128, 128)
    inits = []

    def table(name, shape):
        inits.append(numpy_helper.from_array(RNG.integers(lo, hi, shape).astype(table_type), f"{name}_q"))
        inits.append(numpy_helper.from_array(np.array(RNG.random() * 0.02 + 0.005, np.float32), f"{name}_s"))
        inits.append(numpy_helper.from_array(np.array(RNG.integers(lo, hi), table_type), f"{name}_zp"))

    names = ["words", "positions", "segments", "gamma", "beta"]
    shapes = [(EMB["vocab"], h), (EMB["max_pos"], h), (2, h), (h,), (h,)]
    for name, shape in zip(names, shapes, strict=True):
        table(name, shape)
    present = [n if (n != "segments" or segment) else "" for n in names]
    inputs = ["ids", "seg" if segment else ""] + [f"{n}_q" if n else "" for n in present]
    inputs += (
        ["m" if mask else ""] + [f"{n}_s" if n else "" for n in present] + [f"{n}_zp" if n else "" for n in present]
    )
    values = [helper.make_tensor_value_info("ids", TensorProto.INT32, [b, s])]
    if segment:
        values.append(helper.make_tensor_value_info("seg", TensorProto.INT32, [b, s]))
    if mask:
        values.append(helper.make_tensor_value_info("m", TensorProto.INT32, [b, s]))
    node = helper.make_node(
        "QEmbedLayerNormalization", inputs, ["y", "mask_index"], name="qembed", domain="com.microsoft", epsilon=1e-12
    )
    results = [
        helper.make_tensor_value_info("y", TensorProto.FLOAT, [b, s, h]),
        helper.make_tensor_value_info("mask_index", TensorProto.INT32, [b]),
    ]
    graph = helper.make_graph([node], "g", values, results, inits)
    return helper.make_model(
        graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )


@rule_marker("unfuse-qembed-layer-norm", "positive")
@pytest.mark.parametrize("table_type", [np.uint8, np.int8], ids=["uint8", "int8"])
@pytest.mark.parametrize("segment, mask", [(True, True), (False, True), (True, False)])
def test_qembed_layer_norm(table_type, segment, mask):
    model = qembed_model(table_type, segment, mask)
    feeds = {k: v for k, v in embed_feeds().items() if k in {i.name for i in model.graph.input}}
    result = onnx_qrewrite.rewrite(model)
    assert result.report.by_rule() == {"unfuse-qembed-layer-norm": 1}
    assert {n.domain for n in result.model.graph.node} == {""}
    want, got = run(model, feeds), run(result.model, feeds)
    assert_bitwise_equal(got["mask_index"], want["mask_index"], "mask index")
    total, gamma, beta = _qembed_total(model, feeds, segment)
    _assert_layer_norm_bound(got["y"], want["y"], total, gamma, beta, "QEmbedLayerNormalization")


def _qembed_total(model, feeds, segment):
    """The dequantized embedding sum and gamma/beta of a qembed_model, in float64."""
    tables = {i.name: numpy_helper.to_array(i).astype(np.float64) for i in model.graph.initializer}

    def dequantized(name):
        return (tables[f"{name}_q"] - tables[f"{name}_zp"]) * tables[f"{name}_s"]

    total = dequantized("words")[feeds["ids"]] + dequantized("positions")[: EMB["seq"]]
    if segment:
        total = total + dequantized("segments")[feeds["seg"]]
    return total, dequantized("gamma"), dequantized("beta")


def _dequantize_fma_term(model, feeds, total, gamma):
    """2^-24·|γ|·(1 + |x̂|)·M/σ per output, M the row's largest |w| + |p| + |s| dequantized and σ its
    standard deviation: the unit of the bound's term for a build that contracts the dequantization's
    multiply into the embedding sum (a rounding of the order of 2^-24·M moved in each x, which the
    normalization divides by σ)."""
    tables = {i.name: numpy_helper.to_array(i).astype(np.float64) for i in model.graph.initializer}

    def magnitude(name, rows):
        return np.abs((tables[f"{name}_q"][rows] - tables[f"{name}_zp"]) * tables[f"{name}_s"])

    seq = feeds["ids"].shape[1]
    largest = (
        magnitude("words", feeds["ids"]) + magnitude("positions", slice(0, seq)) + magnitude("segments", feeds["seg"])
    )
    centred = total - total.mean(axis=-1, keepdims=True)
    spread = np.sqrt((centred**2).mean(axis=-1, keepdims=True) + 1e-12)
    normalized = centred / spread
    return 2.0**-24 * np.abs(gamma) * (1 + np.abs(normalized)) * largest.max(axis=-1, keepdims=True) / spread


def test_qembed_layer_norm_bound_where_fma_contraction_changes_rounding():
    """The stated bound against the kernel as builds that contract multiply-adds compute it (emulated
    exactly; the uncontracted emulation is the kernel bit for bit on x86-64, asserted): each
    contraction changes rounding at some elements and stays within the bound, 2^-24·(4·(|γ·x̂| + |β|
    + 1) + h·|γ·x̂|) + 12·2^-24·|γ|·(1 + |x̂|)·M/σ; fma(x̂, γ, β) and the fma into beta's dequantization
    within its first term alone; the variance's fma beyond it at BERT-base's hidden size 768 and
    within its first two (h·|γ·x̂| is needed: a draw where it is, rng 7; the third term would hide
    that, so these are held to the first two); the dequantization's multiply fused into the
    embedding sum beyond its first two terms (a row's magnitude over its spread carries it: the
    third is needed)."""
    changed, first, two, full = {}, {}, {}, {}
    for hidden, seed in ((EMB["hidden"], 21), (768, 7)):
        rng = np.random.default_rng(seed)
        for table_type in (np.uint8, np.int8):
            with mock.patch(f"{__name__}.RNG", rng), mock.patch.dict(EMB, hidden=hidden):
                model = qembed_model(table_type, True, True)
                feeds = {k: v for k, v in embed_feeds().items() if k in {i.name for i in model.graph.input}}
            _fma_excess(model, feeds, changed, (first, two, full))
    assert all(count > 0 for count in changed.values()), changed
    assert first[("out",)] <= 0 and first[("beta",)] <= 0, first
    assert first[("var",)] > 0 and first[("out", "var")] > 0, first
    assert all(excess <= 0 for fused, excess in two.items() if "deq" not in fused), two
    assert two[("deq",)] > 0, two
    assert all(excess <= 0 for excess in full.values()), full


def _fma_excess(model, feeds, changed, worst_of):
    """For each contraction of the kernel's loop on ``model`` and ``feeds``: add the elements it
    changes to ``changed``, and raise ``worst_of``'s three records to the rewrite's excess over the
    bound's first term, its first two, and all three."""
    got = run(onnx_qrewrite.rewrite(model).model, feeds)["y"]
    plain = embed_kernel.qembed_kernel(model, feeds)
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert_bitwise_equal(plain, run(model, feeds)["y"], "the uncontracted emulation")
    total, gamma, beta = _qembed_total(model, feeds, True)
    centred = total - total.mean(axis=-1, keepdims=True)
    normalized = centred / np.sqrt((centred**2).mean(axis=-1, keepdims=True) + 1e-12)
    variance = total.shape[-1] * 2.0**-24 * np.abs(gamma * normalized)
    dequantization = 12 * _dequantize_fma_term(model, feeds, total, gamma)
    for fused in (("out",), ("beta",), ("var",), ("out", "var"), ("deq",), ("deq", "var", "out")):
        kernel = embed_kernel.qembed_kernel(model, feeds, fused)
        changed[fused] = changed.get(fused, 0) + int(np.count_nonzero(kernel.view(np.uint32) != plain.view(np.uint32)))
        for worst, term in zip(worst_of, (0.0, variance, variance + dequantization), strict=True):
            worst[fused] = max(worst.get(fused, -1.0), _layer_norm_excess(got, kernel, total, gamma, beta, term=term))


def _as_layer_normalization(rewritten):
    """The lowering before the kernels' order was matched: LayerNormalization (one-pass variance)."""
    model = copy.deepcopy(rewritten)
    last = next(n for n in model.graph.node if "y" in n.output)
    cumsum = next(n for n in model.graph.node if n.op_type == "CumSum")
    gamma = next(n for n in model.graph.node if n.op_type == "Mul" and n.output[0] == last.input[0]).input[1]
    last.output[0] = "y_unused"
    model.graph.node.append(
        helper.make_node("LayerNormalization", [cumsum.input[0], gamma, last.input[1]], ["y"], axis=-1, epsilon=1e-12)
    )
    return model


def _with_reduce_sum(rewritten):
    """The kernels' formula with ReduceSum's summation order instead of the sequential one."""
    model = copy.deepcopy(rewritten)
    model.graph.initializer.append(numpy_helper.from_array(np.array([-1], np.int64), "last_axis"))
    for node in model.graph.node:
        if node.op_type == "CumSum":  # its Slice then reads the one element of the reduced axis
            node.op_type, node.input[1] = "ReduceSum", "last_axis"
            node.attribute.append(helper.make_attribute("keepdims", 1))
    return model


def test_qembed_layer_norm_bound_catches_the_forms_that_broke_it():
    """The stated bound (4·2^-24·(...)) is broken by the two ways the kernels' normalization is not
    matched: LayerNormalization's one-pass variance (the lowering before: 27.4·2^-24 measured) and
    another summation order of the two passes (ReduceSum: 31.7·2^-24): a row's mean far from 0 (a
    quantized table's zero point) carries the sum's rounding into every x - mean."""
    rng = np.random.default_rng(12)
    worst = {"LayerNormalization": 0.0, "ReduceSum": 0.0}
    for table_type in (np.uint8, np.int8):
        with mock.patch(f"{__name__}.RNG", rng):
            model = qembed_model(table_type, True, True)
            feeds = {k: v for k, v in embed_feeds().items() if k in {i.name for i in model.graph.input}}
        rewritten = onnx_qrewrite.rewrite(model).model
        want = run(model, feeds)["y"]
        total, gamma, beta = _qembed_total(model, feeds, True)
        assert _layer_norm_excess(run(rewritten, feeds)["y"], want, total, gamma, beta) <= 0
        for name, broken in (("LayerNormalization", _as_layer_normalization), ("ReduceSum", _with_reduce_sum)):
            got = run(broken(rewritten), feeds)["y"]
            worst[name] = max(worst[name], _layer_norm_excess(got, want, total, gamma, beta))
    assert all(excess > 0 for excess in worst.values()), worst


@rule_marker("unfuse-embed-layer-norm", "positive")
@rule_marker("unfuse-qembed-layer-norm", "positive")
def test_embed_layer_norms_at_opset_13():
    """The form's floor (kernel_opsets.FORMS["embed-layer-norm"]): both ops lowered at opset 13 as
    they are, with the same results."""
    for model in (embed_model(attrs={"epsilon": 1e-5}), qembed_model()):
        model.opset_import[0].version = 13
        feeds = {k: v for k, v in embed_feeds().items() if k in {i.name for i in model.graph.input}}
        result = onnx_qrewrite.rewrite(model, keep_opset=True)
        assert result.model.opset_import[0].version == 13
        assert {n.domain for n in result.model.graph.node} == {""}
        want, got = run(model, feeds), run(result.model, feeds)
        assert_bitwise_equal(got["mask_index"], want["mask_index"], "mask index")
        if "sum" in want:
            total, gamma, beta = want["sum"], feeds["gamma"], feeds["beta"]
        else:
            total, gamma, beta = _qembed_total(model, feeds, True)
        _assert_layer_norm_bound(got["y"], want["y"], total, gamma, beta, "at opset 13")


@rule_marker("unfuse-qembed-layer-norm", "negative")
def test_qembed_layer_norm_needs_constant_per_tensor_parameters():
    model = qembed_model()
    scale = next(i for i in model.graph.initializer if i.name == "words_s")
    model.graph.initializer.remove(scale)
    model.graph.input.append(helper.make_tensor_value_info("words_s", TensorProto.FLOAT, []))
    with pytest.raises(onnx_qrewrite.LoweringError, match="'words_s' is not a constant per-tensor scale"):
        onnx_qrewrite.rewrite(model)


# --- QAttention ----------------------------------------------------------------------------------


def qattention_model(
    batch, seq, hidden, heads, weights="int8", per_column=False, mask_shape=None, weight_range=64, rng=None
):
    rng = RNG if rng is None else rng
    columns = 3 * hidden
    scales = columns if per_column else 1
    inputs = ["x", "w", "b", "xs", "ws", "m" if mask_shape else "", "xzp", "wzp"]
    values = [
        helper.make_tensor_value_info("x", TensorProto.UINT8, [batch, seq, hidden]),
        helper.make_tensor_value_info("xs", TensorProto.FLOAT, []),
        helper.make_tensor_value_info("xzp", TensorProto.UINT8, []),
    ]
    if mask_shape:
        values.append(helper.make_tensor_value_info("m", TensorProto.INT32, list(mask_shape)))
    if weights == "int8":
        w = rng.integers(-weight_range, weight_range + 1, (hidden, columns)).astype(np.int8)
        zp = rng.integers(-5, 6, scales).astype(np.int8)
    else:
        w = rng.integers(0, 256, (hidden, columns)).astype(np.uint8)
        zp = rng.integers(120, 136, scales).astype(np.uint8)
    shape = () if scales == 1 else (scales,)
    inits = [
        numpy_helper.from_array(w, "w"),
        numpy_helper.from_array((rng.random(scales) * 0.02 + 0.001).astype(np.float32).reshape(shape), "ws"),
        numpy_helper.from_array(zp.reshape(shape), "wzp"),
        numpy_helper.from_array((rng.standard_normal(columns) * 0.1).astype(np.float32), "b"),
    ]
    node = helper.make_node("QAttention", inputs, ["y"], name="qattn", domain="com.microsoft", num_heads=heads)
    output = helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, seq, hidden])
    graph = helper.make_graph([node], "g", values, [output], inits)
    return helper.make_model(
        graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )


def qattention_feeds(batch, seq, hidden, mask_shape=None, rng=None):
    rng = RNG if rng is None else rng
    feeds = {
        "x": rng.integers(0, 256, (batch, seq, hidden)).astype(np.uint8),
        "xs": np.array(0.02, np.float32),
        "xzp": np.array(rng.integers(0, 256), np.uint8),
    }
    if mask_shape == (batch,):
        feeds["m"] = rng.integers(0, seq + 1, batch).astype(np.int32)
    elif mask_shape:
        feeds["m"] = rng.integers(0, 2, mask_shape).astype(np.int32)
    return feeds


@rule_marker("unfuse-qattention", "positive")
@pytest.mark.parametrize("shape", [(2, 8, 32, 2), (2, 7, 128, 2), (2, 5, 768, 12), (1, 1, 64, 2)], ids=str)
@pytest.mark.parametrize("weights, per_column", [("int8", False), ("int8", True), ("uint8", False), ("uint8", True)])
@pytest.mark.parametrize("mask", [None, "lengths", "raw"])
def test_qattention_is_bit_exact_on_the_battery(shape, weights, per_column, mask):
    batch, seq, hidden, heads = shape
    mask_shape = {None: None, "lengths": (batch,), "raw": (batch, seq)}[mask]
    model = qattention_model(batch, seq, hidden, heads, weights, per_column, mask_shape)
    result, want, got = rewrite_and_run(model, qattention_feeds(batch, seq, hidden, mask_shape))
    assert result.report.by_rule() == {"unfuse-qattention": 1}
    assert_bitwise_equal(got, want, f"QAttention {shape} {weights} per-column {per_column} mask {mask}")


@rule_marker("unfuse-qattention", "positive")
def test_qattention_with_weights_the_avx2_kernel_saturates():
    """The policy of rules/50-integer-matmul.toml: bounded, the projection's pair excess in the note;
    bit-exact with onnxruntime running the original as session.x64quantprecision does (verify's
    reference), and verify passes."""
    model = qattention_model(2, 8, 64, 4, "int8", weight_range=127)
    result = onnx_qrewrite.rewrite(model)
    assert result.report.by_rule() == {"unfuse-qattention": 1}
    (applied,) = result.report.rewrites
    assert applied.exactness == "bounded" and "may differ by up to" in " ".join(applied.notes)
    assert {n.domain for n in result.model.graph.node} == {""}
    feeds = qattention_feeds(2, 8, 64, None)
    reference, _ = without_saturation(model)
    assert_bitwise_equal(run(result.model, feeds)["y"], run(reference, feeds)["y"], "vs x64quantprecision form")
    report = verify(model, result.model, inputs=feeds)
    assert report.passed and report.settings.u8s8_reference_nodes == 1, report.to_table()
    # The saturation is checked at the node, against the default (saturating) kernel, per element.
    row = node_row(report, "qattn")
    assert "u8s8-attention" in row.name and row.passed and np.isfinite(row.tolerance.atol)


@rule_marker("unfuse-qattention", "positive")
def test_qattention_saturation_bound_is_checked_at_the_node_and_catches_a_dropped_zero_point():
    """One pair of one projection column beyond int16 (excess 128): the bound carried through the
    scores, softmax and values stays finite, the rewrite is within it against onnxruntime's default
    kernel, and the same rewrite with its weight zero point dropped breaks it at the node."""
    model = qattention_model(2, 8, 64, 4, "int8", weight_range=64)
    w = numpy_helper.to_array(model.graph.initializer[0]).copy()
    w[0, 5], w[1, 5] = 127, 2
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(w, "w"))
    (zp,) = [t for t in model.graph.initializer if t.name == "wzp"]
    zp.CopyFrom(numpy_helper.from_array(np.array(-3, np.int8), "wzp"))
    result = onnx_qrewrite.rewrite(model)
    feeds = qattention_feeds(2, 8, 64, None)
    report = verify(model, result.model, inputs=feeds)
    row = node_row(report, "qattn")
    assert report.passed and row.passed and np.isfinite(row.tolerance.atol), report.to_table()
    broken = onnx.ModelProto()
    broken.CopyFrom(result.model)
    (zp,) = [t for t in broken.graph.initializer if t.name == "wzp"]
    zp.CopyFrom(numpy_helper.from_array(np.zeros_like(numpy_helper.to_array(zp)), "wzp"))
    report = verify(model, broken, inputs=feeds)
    row = node_row(report, "qattn")
    assert report.exit_code == EXIT_DISAGREE and not row.passed and row.mismatches > 0, report.to_table()


@rule_marker("unfuse-qattention", "positive")
@pytest.mark.parametrize("cpu", ["this", "saturating"])
def test_qattention_bound_leaves_out_the_saturation_where_the_kernel_does_not_saturate(cpu):
    """Full-range int8 weights, as quantize_dynamic writes them: the node's per-element bound
    includes the int16 pair saturation only where onnxruntime's kernel saturates (measured; or
    verify told so: ``cpu="saturating"``). Where it does not (CPUs with VNNI), a rewrite whose value
    bias is 0.5 off in half the columns breaks the node's bound; where it does, that slack is real
    (the emulated saturating kernel moves the output by more than the break) and the bound is wider
    than the break."""
    rng = np.random.default_rng(11)
    model = qattention_model(2, 8, 64, 4, "int8", weight_range=127, rng=rng)
    feeds = qattention_feeds(2, 8, 64, None, rng=rng)
    _, saturated = _qattention_in_float64(model, feeds, saturate=True)
    _, exact = _qattention_in_float64(model, feeds, saturate=False)
    assert np.abs(saturated - exact).max() > 0.5  # a bound of 0.5 would not hold where it saturates
    result = onnx_qrewrite.rewrite(model)
    broken = copy.deepcopy(result.model)
    (bias,) = [t for t in broken.graph.initializer if t.name == "b"]
    shifted = numpy_helper.to_array(bias).copy()
    shifted[128:192:2] += np.float32(0.5)  # the value part of the projection: every other column
    bias.CopyFrom(numpy_helper.from_array(shifted, "b"))
    saturating = cpu == "saturating" or u8s8_saturates_here()
    told = mock.patch.object(u8s8_reference, "default_kernel_saturates", lambda: True)
    with told if cpu == "saturating" else contextlib.nullcontext():
        report = verify(model, result.model, inputs=feeds)
        assert report.passed, report.to_table()
        assert (node_row(report, "qattn").tolerance.atol > 0.5) is saturating
        report = verify(model, broken, inputs=feeds)
        assert node_row(report, "qattn").passed is saturating, report.to_table()


def _qattention_in_float64(model: onnx.ModelProto, feeds: dict, *, saturate: bool) -> tuple[dict, np.ndarray]:
    """(the node's input values, its output) for a QAttention without a mask, in float64 from the
    integer projection as the ONNX definition computes it or, ``saturate``, as onnxruntime's AVX2
    kernel without VNNI does (int16 pairs: the emulation in tests/_int_matmul_helpers.py)."""
    node = model.graph.node[0]
    values = {**{t.name: numpy_helper.to_array(t) for t in model.graph.initializer}, **feeds}
    x, w, xzp, wzp = (values[n] for n in ("x", "w", "xzp", "wzp"))
    if saturate:
        acc = saturating_matmul(x, w, xzp, wzp).astype(np.float64)
    else:
        acc = (x.astype(np.float64) - float(xzp)) @ (w.astype(np.float64) - wzp.astype(np.float64))
    projection = acc * (float(values["xs"]) * values["ws"].astype(np.float64)) + values["b"]
    heads = next(a.i for a in node.attribute if a.name == "num_heads")
    hidden = w.shape[1] // 3
    q, k, v = (
        np.moveaxis(projection[..., i * hidden : (i + 1) * hidden].reshape(*x.shape[:2], heads, -1), 1, 2)
        for i in range(3)
    )
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(hidden // heads)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    out = (weights / weights.sum(axis=-1, keepdims=True)) @ v
    return values, np.moveaxis(out, 1, 2).reshape(*x.shape[:2], hidden)


@rule_marker("unfuse-qattention", "positive")
@pytest.mark.parametrize("weight_range", [90, 127])
@pytest.mark.parametrize("per_column", [False, True])
@pytest.mark.parametrize("hot", [False, True], ids=["random-x", "x-255"])
def test_qattention_saturation_bound_holds_where_the_kernel_saturates(weight_range, per_column, hot):
    """The derivation of verify's bound (element_bounds._u8s8_attention), on any CPU: the attention
    computed from the int16-pair projection of the AVX2 kernel (emulated) stays within it of the
    ONNX definition's, at every element, for weights up to the full int8 range (the bound is
    finite there: it was inf before) and activations at their worst (all 255). With uniform
    weights nearly every pair saturates and the bound is nearly reached somewhere: no sound bound
    from the inputs is much smaller there."""
    rng = np.random.default_rng(weight_range + 2 * per_column + hot)
    model = qattention_model(2, 8, 64, 4, "int8", per_column, weight_range=weight_range, rng=rng)
    feeds = qattention_feeds(2, 8, 64, None, rng=rng)
    if hot:
        feeds["x"][:] = 255
    values, saturated = _qattention_in_float64(model, feeds, saturate=True)
    _, exact = _qattention_in_float64(model, feeds, saturate=False)
    bound = element_bounds.element_bound("u8s8-attention", model.graph.node[0], values, saturated, exact)
    assert bound is not None and np.all(np.isfinite(bound))
    moved = np.abs(saturated - exact)
    assert np.all(moved <= bound)
    assert np.max(moved / bound) > 0.5, np.max(moved / bound)


def _without_x_zero_point(model: onnx.ModelProto) -> onnx.ModelProto:
    """A broken rewrite: the input's zero point read as 0."""
    broken = copy.deepcopy(model)
    for node in broken.graph.node:
        node.input[:] = ["zero_u8" if name == "xzp" else name for name in node.input]
    broken.graph.initializer.append(numpy_helper.from_array(np.array(0, np.uint8), "zero_u8"))
    return broken


def _without_weight_zero_point(model: onnx.ModelProto) -> onnx.ModelProto:
    broken = copy.deepcopy(model)
    (zp,) = [t for t in broken.graph.initializer if t.name == "wzp"]
    zp.CopyFrom(numpy_helper.from_array(np.zeros_like(numpy_helper.to_array(zp)), "wzp"))
    return broken


def _scale_off(model: onnx.ModelProto, factor: float) -> onnx.ModelProto:
    broken = copy.deepcopy(model)
    (scale,) = [t for t in broken.graph.initializer if t.name == "ws"]
    off = (numpy_helper.to_array(scale) * np.float32(factor)).astype(np.float32)
    scale.CopyFrom(numpy_helper.from_array(off, "ws"))
    return broken


def _quantize_dynamic_weights(model: onnx.ModelProto, rng: np.random.Generator) -> onnx.ModelProto:
    """The weights as quantize_dynamic writes them by default: normal weights, int8 symmetric over
    the full range (the largest magnitude is 127), so some pairs of large weights leave int16."""
    (w,) = [t for t in model.graph.initializer if t.name == "w"]
    normal = rng.standard_normal(numpy_helper.to_array(w).shape)
    w.CopyFrom(numpy_helper.from_array(np.round(normal / np.abs(normal).max() * 127).astype(np.int8), "w"))
    return model


@rule_marker("unfuse-qattention", "positive")
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_qattention_full_range_weights_have_a_finite_bound_that_catches_broken_rewrites(seed):
    """quantize_dynamic's default int8 weights, over the full range: verify checks the rewrite at
    the node against onnxruntime's default kernel within a finite per-element bound (from the pairs
    that leave int16 on these inputs), and a dropped input or weight zero point, or a weight scale
    1 % off, exceeds it."""
    rng = np.random.default_rng(seed)
    model = _quantize_dynamic_weights(qattention_model(2, 8, 64, 4, "int8", weight_range=127, rng=rng), rng)
    assert u8s8.pair_excess(numpy_helper.to_array(model.graph.initializer[0]).T, "int8").max() > 0
    feeds = qattention_feeds(2, 8, 64, None, rng=rng)
    result = onnx_qrewrite.rewrite(model)
    report = verify(model, result.model, inputs=feeds)
    row = node_row(report, "qattn")
    assert report.passed and row.passed and np.isfinite(row.tolerance.atol), report.to_table()
    broken = (_without_x_zero_point, _without_weight_zero_point, lambda m: _scale_off(m, 1.01))
    for breaking in broken:
        report = verify(model, breaking(result.model), inputs=feeds)
        row = node_row(report, "qattn")
        assert report.exit_code == EXIT_DISAGREE and not row.passed and row.mismatches > 0, report.to_table()


def qattention_with_past(batch, seq, past, hidden, heads, mask_shape=None, unidirectional=0, weight_range=20):
    """QAttention (uint8 weights unless ``weight_range`` says int8 ones that can saturate) reading
    past (2, B, N, P, H) and writing present."""
    weights = "int8" if weight_range > 64 else "uint8"
    model = qattention_model(batch, seq, hidden, heads, weights, False, mask_shape, weight_range=weight_range)
    node = model.graph.node[0]
    if unidirectional:
        node.attribute.append(helper.make_attribute("unidirectional", 1))
    while len(node.input) < 8:
        node.input.append("")
    node.input.append("past")
    node.output.append("present")
    head = hidden // heads
    model.graph.input.append(helper.make_tensor_value_info("past", TensorProto.FLOAT, [2, batch, heads, past, head]))
    model.graph.output.append(
        helper.make_tensor_value_info("present", TensorProto.FLOAT, [2, batch, heads, past + seq, head])
    )
    return model


@rule_marker("unfuse-qattention", "positive")
@pytest.mark.parametrize("unidirectional", [0, 1])
@pytest.mark.parametrize("mask", [None, "raw"], ids=str)
@pytest.mark.parametrize("shape", [(2, 4, 3, 32, 4), (1, 3, 0, 64, 2), (1, 1, 6, 64, 2)], ids=str)
def test_qattention_with_past_and_present(shape, mask, unidirectional):
    """As Attention's state: present bit for bit (the integer projection is exact), the output bit
    for bit at sequence > 1 and within Attention's bound at a one-token step."""
    batch, seq, past, hidden, heads = shape
    mask_shape = (batch, past + seq) if mask else None
    model = qattention_with_past(batch, seq, past, hidden, heads, mask_shape, unidirectional)
    feeds = qattention_feeds(batch, seq, hidden)
    feeds["past"] = RNG.standard_normal((2, batch, heads, past, hidden // heads)).astype(np.float32)
    if mask:
        feeds["m"] = RNG.integers(0, 2, mask_shape).astype(np.int32)
        feeds["m"][:, -1] = 1
    result = onnx_qrewrite.rewrite(model)
    assert result.report.by_rule() == {"unfuse-qattention": 1}
    want, got = run(model, feeds), run(result.model, feeds)
    assert_bitwise_equal(got["present"], want["present"], "present")
    if seq > 1:
        assert_bitwise_equal(got["y"], want["y"], f"QAttention with past {shape}")
    else:
        values = {**{t.name: numpy_helper.to_array(t) for t in model.graph.initializer}, **feeds}
        x = (values["x"].astype(np.float64) - float(values["xzp"])) * float(values["xs"])
        w = (values["w"].astype(np.float64) - values["wzp"].astype(np.float64)) * values["ws"].astype(np.float64)
        state = {"x": x, "w": w, "b": values["b"], "past": feeds["past"]}
        diff = np.abs(got["y"].astype(np.float64) - want["y"]).max()
        assert diff <= _past_attention_bound(state, hidden, heads)


def _with_rotary(model, attribute="do_rotary"):
    model.graph.node[0].attribute.append(helper.make_attribute(attribute, 1))
    return model


@rule_marker("unfuse-qattention", "positive")
@pytest.mark.parametrize("past", [None, 3], ids=["no-past", "past"])
def test_qattention_with_do_rotary_is_what_the_cpu_kernel_computes(past):
    """onnxruntime's CPU QAttention reads do_rotary and rotates nothing (measured: outputs equal
    do_rotary=0's): lowered as the kernel computes, bit for bit, with a note saying so. A rewrite
    that rotates (RotaryEmbedding's form at positions 0..S-1, half-split) is caught."""
    batch, seq, hidden, heads = 2, 5, 32, 2
    model = qattention_with_past(batch, seq, past, hidden, heads) if past else qattention_model(batch, seq, 32, 2)
    model = _with_rotary(model)
    feeds = qattention_feeds(batch, seq, hidden)
    if past:
        feeds["past"] = RNG.standard_normal((2, batch, heads, past, hidden // heads)).astype(np.float32)
    result = onnx_qrewrite.rewrite(model)
    assert result.report.by_rule() == {"unfuse-qattention": 1}
    (applied,) = result.report.rewrites
    assert "onnxruntime's CPU kernel does not rotate" in " ".join(applied.notes)
    want, got = run(model, feeds), run(result.model, feeds)
    for name in want:
        assert_bitwise_equal(got[name], want[name], f"QAttention do_rotary {name}")
    if not past:
        rotated = _rotated_qattention(model, feeds, heads)
        assert np.abs(rotated - want["y"]).max() > 1e-3


def _rotated_qattention(model, feeds, heads):
    """QAttention with Q and K rotated (half-split, positions 0..S-1, base 10000) in float64: what a
    rewrite that applied do_rotary would compute."""
    values = {**{t.name: numpy_helper.to_array(t) for t in model.graph.initializer}, **feeds}
    x = (values["x"].astype(np.float64) - float(values["xzp"])) * float(values["xs"])
    w = (values["w"].astype(np.float64) - values["wzp"].astype(np.float64)) * values["ws"].astype(np.float64)
    q, k, v = np.split(x @ w + values["b"], 3, axis=-1)
    batch, seq, hidden = q.shape
    head = hidden // heads
    q, k, v = (t.reshape(batch, seq, heads, head).transpose(0, 2, 1, 3) for t in (q, k, v))
    angles = np.arange(seq)[:, None] * 10000.0 ** (-np.arange(0, head, 2) / head)
    cos, sin = np.cos(angles), np.sin(angles)

    def rotate(t):
        a, b = t[..., : head // 2], t[..., head // 2 :]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    scores = rotate(q) @ rotate(k).transpose(0, 1, 3, 2) / math.sqrt(head)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    return (probs @ v).transpose(0, 2, 1, 3).reshape(batch, seq, hidden)


@rule_marker("unfuse-qattention", "negative")
def test_qattention_forms_not_lowered_say_why():
    model = qattention_model(2, 8, 32, 2)
    model.graph.node[0].input.append("past")
    model.graph.input.append(helper.make_tensor_value_info("past", TensorProto.FLOAT, [2, 2, 2, 0, 16]))
    with pytest.raises(onnx_qrewrite.LoweringError, match=re.escape("past without present")):
        onnx_qrewrite.rewrite(model, allow=("exact", "bounded", "approximate"))
    saturating = qattention_with_past(2, 4, 3, 32, 2, weight_range=127)
    with pytest.raises(onnx_qrewrite.LoweringError, match="its bound formula has no past"):
        onnx_qrewrite.rewrite(saturating, only=["unfuse-qattention"])
    model = qattention_model(2, 8, 32, 2)
    model.graph.input[0].type.tensor_type.elem_type = TensorProto.INT8
    model.graph.input[2].type.tensor_type.elem_type = TensorProto.INT8
    with pytest.raises(onnx_qrewrite.LoweringError, match="takes uint8 only"):
        onnx_qrewrite.rewrite(model)
    # The mask is read as Attention's is (one shared plan): int32, as the op's schema says.
    model = qattention_model(2, 8, 32, 2, mask_shape=(2,))
    model.graph.input[-1].type.tensor_type.elem_type = TensorProto.INT64
    with pytest.raises(onnx_qrewrite.LoweringError, match="mask_index is int64, not int32"):
        onnx_qrewrite.rewrite(model)


# --- a real model: a tiny BERT-like encoder fused by onnxruntime.transformers' optimizer ----------


def tiny_bert(hidden=32, heads=2, layers=2, ffn=64, vocab=50, max_pos=16, seed=0) -> onnx.ModelProto:
    """A BERT-like encoder as transformers exports BertModel: word + token type + position
    embeddings and LayerNormalization, the extended attention mask (1 - mask) · -10000, and per layer
    Q/K/V projections, heads via Reshape/Transpose, scaled MatMul + mask, Softmax, output projection,
    residual LayerNormalization and an erf GELU feed-forward block."""
    rng = np.random.default_rng(seed)
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []

    def c(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def w(name, *shape, std=0.2):
        return c(name, (rng.standard_normal(shape) * std).astype(np.float32))

    def n(op, inputs, out, **attrs):
        nodes.append(helper.make_node(op, inputs, [out], name=out, **attrs))
        return out

    def layer_norm(x, p):
        gamma, beta = w(f"{p}.g", hidden, std=0.1), w(f"{p}.b", hidden, std=0.1)
        return n("LayerNormalization", [x, gamma, beta], p, axis=-1, epsilon=1e-12)

    def linear(x, p, k, m):
        return n("Add", [n("MatMul", [x, w(f"{p}.w", k, m, std=k**-0.5)], f"{p}.mm"), w(f"{p}.bias", m, std=0.1)], p)

    def i64(*values):
        return np.array(values, np.int64)

    words = n("Gather", [w("word", vocab, hidden), "input_ids"], "we")
    seq = n("Gather", [n("Shape", ["input_ids"], "shape"), c("one", np.array(1, np.int64))], "seq")
    end = n("Unsqueeze", [seq, c("ax0", i64(0))], "seq1")
    ids = n(
        "Slice",
        [c("position_ids", np.arange(max_pos, dtype=np.int64)[None]), c("z", i64(0)), end, c("a1", i64(1))],
        "pos_ids",
    )
    positions = n("Gather", [w("pos", max_pos, hidden), ids], "pe")
    types = n("Gather", [w("type", 2, hidden), "token_type_ids"], "te")
    x = layer_norm(n("Add", [n("Add", [words, types], "e1"), positions], "e2"), "emb.ln")
    mask = n("Unsqueeze", [n("Unsqueeze", ["attention_mask", c("am1", i64(1))], "m3"), c("am2", i64(2))], "m4")
    inverted = n("Sub", [c("onef", np.float32(1.0)), n("Cast", [mask], "mf", to=TensorProto.FLOAT)], "inv")
    extended = n("Mul", [inverted, c("neg", np.float32(-10000.0))], "ext")
    head = hidden // heads
    split, merge = c("split", i64(0, 0, heads, head)), c("merge", i64(0, 0, hidden))
    for i in range(layers):
        p = f"l{i}"

        def heads_of(t, perm):
            return n("Transpose", [n("Reshape", [t, split], f"{t}.r")], f"{t}.t", perm=perm)

        q = heads_of(linear(x, f"{p}.q", hidden, hidden), [0, 2, 1, 3])
        k = heads_of(linear(x, f"{p}.k", hidden, hidden), [0, 2, 3, 1])
        v = heads_of(linear(x, f"{p}.v", hidden, hidden), [0, 2, 1, 3])
        scores = n("Div", [n("MatMul", [q, k], f"{p}.qk"), c(f"{p}.sqrt", np.float32(math.sqrt(head)))], f"{p}.s")
        probs = n("Softmax", [n("Add", [scores, extended], f"{p}.sm")], f"{p}.p", axis=-1)
        context = n("Transpose", [n("MatMul", [probs, v], f"{p}.ctx")], f"{p}.ctxt", perm=[0, 2, 1, 3])
        x = layer_norm(
            n("Add", [linear(n("Reshape", [context, merge], f"{p}.m"), f"{p}.o", hidden, hidden), x], f"{p}.r1"),
            f"{p}.ln1",
        )
        h = linear(x, f"{p}.i", hidden, ffn)
        erf = n("Erf", [n("Div", [h, c(f"{p}.s2", np.float32(math.sqrt(2)))], f"{p}.hd")], f"{p}.erf")
        gelu = n(
            "Mul",
            [
                n("Mul", [h, n("Add", [erf, c(f"{p}.one", np.float32(1))], f"{p}.e1")], f"{p}.gm"),
                c(f"{p}.half", np.float32(0.5)),
            ],
            f"{p}.gelu",
        )
        x = layer_norm(n("Add", [linear(gelu, f"{p}.d", ffn, hidden), x], f"{p}.r2"), f"{p}.ln2")
    nodes.append(helper.make_node("Identity", [x], ["last_hidden_state"]))
    inputs = [
        helper.make_tensor_value_info(name, TensorProto.INT64, ["batch", "seq"])
        for name in ("input_ids", "token_type_ids", "attention_mask")
    ]
    output = helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["batch", "seq", hidden])
    graph = helper.make_graph(nodes, "tiny_bert", inputs, [output], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def bert_feeds(batch=3, seq=11, vocab=50, seed=5):
    rng = np.random.default_rng(seed)
    lengths = [seq, 6, 1][:batch]
    mask = np.array([[1] * n + [0] * (seq - n) for n in lengths], np.int64)
    return {
        "input_ids": rng.integers(0, vocab, (batch, seq)).astype(np.int64),
        "token_type_ids": (np.arange(seq)[None] >= seq // 2).repeat(batch, 0).astype(np.int64),
        "attention_mask": mask,
    }


def ort_transformers_optimized(tmp_path, **fusions) -> onnx.ModelProto:
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    path = tmp_path / "tiny_bert.onnx"
    onnx.save(tiny_bert(), path)
    options = FusionOptions("bert")
    for name, value in fusions.items():
        setattr(options, name, value)
    optimized = optimize_model(
        str(path), model_type="bert", num_heads=2, hidden_size=32, optimization_options=options, opt_level=0
    )
    optimized.save_model_to_file(str(tmp_path / "fused.onnx"))  # as users get it
    return onnx.load(tmp_path / "fused.onnx")


@pytest.mark.parametrize("embed", [False, True], ids=["attention-mask-from-reducesum", "embed-layer-norm"])
def test_a_bert_fused_by_onnxruntime_transformers_runs_on_standard_ops(tmp_path, embed):
    fused = ort_transformers_optimized(tmp_path, enable_embed_layer_norm=embed)
    contrib = {n.op_type for n in fused.graph.node if n.domain == "com.microsoft"}
    assert contrib == {"Attention", "SkipLayerNormalization", "BiasGelu"} | (
        {"EmbedLayerNormalization"} if embed else set()
    )
    if not embed:
        # The optimizer records no shape for the mask index it computes with ReduceSum (the one
        # EmbedLayerNormalization outputs is known to be 1-D).
        with pytest.raises(onnx_qrewrite.LoweringError, match="run onnx shape inference on the model first"):
            onnx_qrewrite.rewrite(fused)
        fused = onnx.shape_inference.infer_shapes(fused)
    result = onnx_qrewrite.rewrite(fused)
    assert result.report.by_rule()["unfuse-attention"] == 2
    assert result.report.by_rule().get("unfuse-embed-layer-norm", 0) == int(embed)
    assert {n.domain for n in result.model.graph.node} == {""}
    feeds = bert_feeds()
    report = verify(fused, result.model, inputs=feeds)
    assert report.passed, report.to_table()
    # And against the unfused model it came from (the padded keys masked by -10000 there, by key
    # lengths in the fused model).
    got, want = run(result.model, feeds)["last_hidden_state"], run(tiny_bert(), feeds)["last_hidden_state"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weight_type", ["QUInt8", "QInt8"])
def test_a_bert_fused_and_quantized_by_onnxruntime_runs_on_standard_ops(tmp_path, weight_type):
    # onnxruntime.transformers' optimizer, then quantize_dynamic: QEmbedLayerNormalization, QAttention,
    # DynamicQuantizeLinear + MatMulInteger, SkipLayerNormalization, BiasGelu.
    from onnxruntime.quantization import QuantType, quantize_dynamic

    onnx.save(ort_transformers_optimized(tmp_path), tmp_path / "fused_bert.onnx")
    quantize_dynamic(
        tmp_path / "fused_bert.onnx",
        tmp_path / "quantized.onnx",
        weight_type=getattr(QuantType, weight_type),
        extra_options={"DefaultTensorType": TensorProto.FLOAT},  # the fused ops carry no shapes
    )
    quantized = onnx.load(tmp_path / "quantized.onnx")
    contrib = {n.op_type for n in quantized.graph.node if n.domain == "com.microsoft"}
    assert contrib == {"QEmbedLayerNormalization", "QAttention", "SkipLayerNormalization", "BiasGelu"}
    feeds = bert_feeds()
    # QInt8 (quantize_dynamic's default): full-range int8 weights, whose uint8 x int8 pairs
    # onnxruntime's kernel saturates on x86 without AVX-VNNI: bounded by the pair excess, and verify
    # compares with the original as onnxruntime's session.x64quantprecision runs it (rules/50-*).
    result = onnx_qrewrite.rewrite(quantized)
    rules = result.report.by_rule()
    assert (rules["unfuse-qattention"], rules["unfuse-qembed-layer-norm"]) == (2, 1)
    assert {n.domain for n in result.model.graph.node} == {""}
    report = verify(quantized, result.model, inputs=feeds)
    assert report.passed, report.to_table()


def _qattention_fed_by(producer: onnx.NodeProto, source: onnx.ValueInfoProto) -> onnx.ModelProto:
    """qattention_model's node with x and its zero point written by ``producer`` (from ``source``),
    so that neither is declared: their types are what the producer says, or unknown."""
    model = qattention_model(2, 8, 32, 4, "uint8")
    graph = model.graph
    kept = [v for v in graph.input if v.name not in ("x", "xzp")]
    del graph.input[:]
    graph.input.extend([*kept, source])
    graph.node.insert(0, producer)
    if producer.domain:
        model.opset_import.append(helper.make_opsetid(producer.domain, 1))
    return model


@rule_marker("unfuse-qattention", "positive")
@rule_marker("unfuse-qattention", "negative")
def test_qattention_input_type_is_traced_and_an_unknown_one_refused():
    """x undeclared: uint8 when its producer says so (DynamicQuantizeLinear, as quantize_dynamic
    writes it: lowered, bit for bit); refused, naming x, when nothing says (it was assumed uint8)."""
    source = helper.make_tensor_value_info("xf", TensorProto.FLOAT, [2, 8, 32])
    dql = helper.make_node("DynamicQuantizeLinear", ["xf"], ["x", "xs_unused", "xzp"], name="dql")
    model = _qattention_fed_by(dql, source)
    feeds = {"xf": RNG.standard_normal((2, 8, 32)).astype(np.float32), "xs": np.array(0.02, np.float32)}
    result = onnx_qrewrite.rewrite(model)
    assert result.report.by_rule()["unfuse-qattention"] == 1
    assert {n.domain for n in result.model.graph.node} == {""}
    assert_bitwise_equal(run(result.model, feeds)["y"], run(model, feeds)["y"], "after DynamicQuantizeLinear")
    opaque = helper.make_node("Opaque", ["xf"], ["x", "xzp"], name="opaque", domain="com.example")
    with pytest.raises(onnx_qrewrite.LoweringError, match="the type of 'x' is not declared and neither its producer"):
        onnx_qrewrite.rewrite(_qattention_fed_by(opaque, source))
