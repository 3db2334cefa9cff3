"""com.microsoft MultiHeadAttention with past_key/past_value, present_key/present_value and
attention_bias -> standard ops, against onnxruntime 1.31.1's own CPU kernel.

The kernel (measured here): K and V split into heads (B, N, L, H) go after the past ones
(B, N, P, H) and the present outputs are that concatenation (B, N, P + L, H); query i sits at
position P + i, and under ``unidirectional`` it sees the keys up to P + i except the last query,
which sees every key (the kernel's causal loop stops before it: this matters where there are more
keys than past + queries); key_padding_mask covers the P + L keys (B lengths, of which the 3B + 2
form's first B are read, (B, P + L) or (B, S, P + L)); attention_bias (B or 1, N or 1, S, P + L) is
added to the scaled scores before the mask. With any present output the kernel does not take its
flash path, and the rewrite is bit-exact on every case of the battery (batch 1-4, heads 1-12,
head sizes 8-128, past lengths 0-100, query sequence 1 and longer, fewer and more keys than
queries, every mask form, causal, attention_bias broadcast forms, fully masked rows).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from conftest import assert_bitwise_equal, rule_marker, run
from onnx import TensorProto, helper, numpy_helper

import onnx_qrewrite

RNG = np.random.default_rng(11)
RULE = "unfuse-multi-head-attention"


def mha_model(
    batch,
    seq,
    kv_seq,
    past,
    hidden,
    heads,
    mask=None,
    bias=True,
    attention_bias=None,
    attrs=None,
    outputs=("y", "present_key", "present_value"),
):
    """MultiHeadAttention with 3-D query/key/value, past_key/past_value (B, N, P, H) unless
    ``past`` is None, and the outputs named."""
    total = kv_seq + (past or 0)
    head = hidden // heads
    inputs = ["q", "k", "v", "b" if bias else "", "m" if mask else "", "ab" if attention_bias else ""]
    inputs += ["past_key", "past_value"] if past is not None else []
    while not inputs[-1]:
        inputs.pop()
    info = helper.make_tensor_value_info
    values = [info(n, TensorProto.FLOAT, [batch, s, hidden]) for n, s in (("q", seq), ("k", kv_seq), ("v", kv_seq))]
    if bias:
        values.append(info("b", TensorProto.FLOAT, [3 * hidden]))
    if mask:
        values.append(info("m", TensorProto.INT32, list(mask_shape(mask, batch, seq, total))))
    if attention_bias:
        values.append(info("ab", TensorProto.FLOAT, list(bias_shape(attention_bias, batch, heads, seq, total))))
    if past is not None:
        values += [info(n, TensorProto.FLOAT, [batch, heads, past, head]) for n in ("past_key", "past_value")]
    shapes = {"y": [batch, seq, hidden], "present_key": [batch, heads, total, head]}
    shapes["present_value"] = shapes["present_key"]
    shapes["qk"] = [batch, heads, seq, total]
    return one_mha_model(inputs, outputs, values, shapes, heads, attrs)


def one_mha_model(inputs, outputs, values, shapes, heads, attrs=None):
    """A model of one MultiHeadAttention node named "mha": its float32 outputs of ``shapes``."""
    node = helper.make_node(
        "MultiHeadAttention",
        inputs,
        list(outputs),
        name="mha",
        domain="com.microsoft",
        num_heads=heads,
        **(attrs or {}),
    )
    results = [helper.make_tensor_value_info(o, TensorProto.FLOAT, shapes[o]) for o in outputs if o]
    graph = helper.make_graph([node], "g", values, results)
    return helper.make_model(
        graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )


def mask_shape(mask, batch, seq, total):
    return {"lengths": (batch,), "lengths_3b2": (3 * batch + 2,), "raw": (batch, total), "3d": (batch, seq, total)}[
        mask
    ]


def bias_shape(form, batch, heads, seq, total):
    return {"full": (batch, heads, seq, total), "heads": (1, heads, seq, total), "one": (1, 1, seq, total)}[form]


def mha_feeds(batch, seq, kv_seq, past, hidden, heads, mask=None, attention_bias=None, scale=1.0):
    total = kv_seq + (past or 0)
    feeds = {
        n: (RNG.standard_normal((batch, s, hidden)) * scale).astype(np.float32)
        for n, s in (("q", seq), ("k", kv_seq), ("v", kv_seq))
    }
    feeds["b"] = RNG.standard_normal(3 * hidden).astype(np.float32)
    if past is not None:
        for name in ("past_key", "past_value"):
            feeds[name] = (RNG.standard_normal((batch, heads, past, hidden // heads)) * scale).astype(np.float32)
    if mask in ("lengths", "lengths_3b2"):
        feeds["m"] = RNG.integers(0, total + 1, mask_shape(mask, batch, seq, total)).astype(np.int32)
        feeds["m"][0] = 0  # every key of an entry masked
    elif mask == "raw":
        feeds["m"] = RNG.integers(-1, 3, (batch, total)).astype(np.int32)  # > 0 attends
        feeds["m"][0] = 0
    elif mask == "3d":
        feeds["m"] = RNG.integers(0, 2, (batch, seq, total)).astype(np.int32)
    if attention_bias:
        feeds["ab"] = RNG.standard_normal(bias_shape(attention_bias, batch, heads, seq, total)).astype(np.float32)
    return feeds


def run_on(model, feeds):
    """``model`` on the feeds it takes."""
    return run(model, {i.name: feeds[i.name] for i in model.graph.input})


def rewrite_and_run(model, feeds):
    result = onnx_qrewrite.rewrite(model)
    assert {n.domain for n in result.model.graph.node} == {""}
    assert result.report.by_rule() == {RULE: 1}
    return run_on(model, feeds), run_on(result.model, feeds)


#: (batch, query sequence, new keys, past length, hidden, heads), query sequence > 1
SHAPES = [
    (2, 4, 4, 3, 32, 4),
    (1, 5, 5, 0, 64, 2),
    (3, 2, 2, 7, 128, 8),
    (2, 3, 5, 2, 32, 4),  # more keys than past + queries: the kernel's last causal row
    (2, 5, 3, 2, 32, 2),
    (4, 2, 2, 100, 768, 12),
]
#: a decoder's step: one query (MLAS's GEMV for the scores)
STEP_SHAPES = [(2, 1, 1, 6, 32, 4), (1, 1, 1, 100, 768, 12), (3, 1, 3, 4, 64, 2), (2, 1, 1, 0, 128, 1)]


@rule_marker("unfuse-multi-head-attention", "positive")
@pytest.mark.parametrize("unidirectional", [0, 1])
@pytest.mark.parametrize("mask", [None, "lengths", "lengths_3b2", "raw", "3d"], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_past_and_present_are_bit_exact(shape, mask, unidirectional):
    model = mha_model(*shape, mask=mask, attrs={"unidirectional": unidirectional})
    want, got = rewrite_and_run(model, mha_feeds(*shape, mask=mask))
    for name in ("y", "present_key", "present_value"):
        assert_bitwise_equal(got[name], want[name], f"{name}: {shape}, mask {mask}, unidirectional {unidirectional}")


@rule_marker("unfuse-multi-head-attention", "positive")
@pytest.mark.parametrize("form", ["full", "heads", "one"])
@pytest.mark.parametrize("mask", [None, "raw", "lengths"], ids=str)
@pytest.mark.parametrize("past", [None, 0, 5], ids=lambda p: f"past{p}")
def test_attention_bias_is_bit_exact(past, mask, form):
    """attention_bias goes in before the mask: the fully masked entries (mask -10000 plus bias)
    show the order bit for bit."""
    shape = (2, 4, 4, past, 32, 4)
    outputs = ("y",) if past is None else ("y", "present_key", "present_value")
    model = mha_model(*shape, mask=mask, attention_bias=form, attrs={"unidirectional": int(past == 5)}, outputs=outputs)
    want, got = rewrite_and_run(model, mha_feeds(*shape, mask=mask, attention_bias=form))
    for name in outputs:
        assert_bitwise_equal(got[name], want[name], f"{name}: past {past}, mask {mask}, bias {form}")


@rule_marker("unfuse-multi-head-attention", "positive")
@pytest.mark.parametrize(
    "outputs", [("y", "present_key", "present_value"), ("y", "present_key"), ("y", "", "present_value")], ids=str
)
def test_present_without_past_is_bit_exact(outputs):
    model = mha_model(2, 4, 6, None, 32, 4, bias=False, outputs=outputs)
    want, got = rewrite_and_run(model, mha_feeds(2, 4, 6, None, 32, 4))
    for name in filter(None, outputs):
        assert_bitwise_equal(got[name], want[name], name)


@rule_marker("unfuse-multi-head-attention", "positive")
@pytest.mark.parametrize("shape", [(2, 3, 5, None, 32, 4), (1, 1, 3, None, 16, 2)], ids=str)
def test_causal_rows_without_past_follow_the_kernel(shape):
    """Fewer queries than keys, no state: the last query row sees every key (and at sequence 1 the
    kernel has no causal mask), which a plain key <= i mask gets wrong."""
    model = mha_model(*shape, mask="lengths", attrs={"unidirectional": 1}, outputs=("y",))
    want, got = rewrite_and_run(model, mha_feeds(*shape, mask="lengths"))
    assert_bitwise_equal(got["y"], want["y"], str(shape))


def test_a_causal_mask_without_the_past_offset_is_caught():
    """Masking as if there were no past (keys after i for query i) is far from the kernel."""
    shape = (2, 4, 4, 3, 32, 4)
    model = mha_model(*shape, attrs={"unidirectional": 1})
    feeds = mha_feeds(*shape)
    broken = onnx_qrewrite.rewrite(model).model
    adds = [n for n in broken.graph.node if n.op_type == "Add" and any("Range" in i for i in n.input)]
    assert len(adds) == 1  # positions + past length
    rows = next(i for i in adds[0].input if "Range" in i)
    for node in broken.graph.node:
        node.input[:] = [rows if i == adds[0].output[0] else i for i in node.input]
    assert np.abs(run_on(broken, feeds)["y"] - run_on(model, feeds)["y"]).max() > 1e-3


def _without(model, output):
    node = model.graph.node[0]
    node.output[:] = [o if o != output else "" for o in node.output]
    while not node.output[-1]:
        node.output.pop()
    kept = [o for o in model.graph.output if o.name != output]
    del model.graph.output[:]
    model.graph.output.extend(kept)
    return model


NOT_LOWERED = {
    "past without present": (
        lambda: mha_model(2, 4, 4, 3, 32, 4, outputs=("y",)),
        "past_key/past_value without both present_key and present_value",
    ),
    "past without present_value": (
        lambda: _without(mha_model(2, 4, 4, 3, 32, 4), "present_value"),
        "past_key/past_value without both present_key and present_value",
    ),
}


@rule_marker("unfuse-multi-head-attention", "negative")
@pytest.mark.parametrize("case", list(NOT_LOWERED))
def test_state_forms_not_lowered_say_why(case):
    make, reason = NOT_LOWERED[case]
    with pytest.raises(onnx_qrewrite.LoweringError, match=re.escape(reason)):
        onnx_qrewrite.rewrite(make())


def test_past_without_present_is_not_what_the_kernel_computes_with_the_past():
    """Why that form is refused: the kernel's output then is neither attention over past + new
    keys nor over the new keys alone (measured), so there is nothing standard to lower it to."""
    shape = (2, 4, 4, 3, 32, 4)
    feeds = mha_feeds(*shape)
    alone = run_on(mha_model(*shape, outputs=("y",)), feeds)["y"]
    with_state = run_on(mha_model(*shape), feeds)["y"]
    without_past = run_on(mha_model(2, 4, 4, None, 32, 4, outputs=("y",)), feeds)["y"]
    assert np.abs(alone - with_state).max() > 1e-2
    assert np.abs(alone - without_past).max() > 1e-2


def _stated_bound(feeds, shape, mask, filter_value=-10000.0):
    """The rule's bound, 2^-20·(1 + max|score|)·max|V|: score the scaled Q·Kᵀ over the past and
    new keys, plus attention_bias, and in a row whose every key is masked plus the filter value
    (there the kernel's rounding of score + mask is what the softmax sees)."""
    batch, seq, _, past, hidden, heads = shape
    head, b = hidden // heads, feeds["b"].astype(np.float64)
    q, k, v = (feeds[n].astype(np.float64) + b[i * hidden : (i + 1) * hidden] for i, n in enumerate("qkv"))
    qh, kh, vh = (t.reshape(batch, -1, heads, head).transpose(0, 2, 1, 3) for t in (q, k, v))
    if past is not None:
        kh = np.concatenate([feeds["past_key"], kh], axis=2)
        vh = np.concatenate([feeds["past_value"], vh], axis=2)
    scores = qh @ kh.transpose(0, 1, 3, 2) / np.sqrt(head) + feeds.get("ab", 0.0)
    keep = _keep(feeds, mask, batch, seq, kh.shape[2])
    blind = ~keep.any(axis=-1, keepdims=True)
    scores = np.where(blind, scores + filter_value, scores)
    return 2.0**-20 * (1 + np.abs(scores).max()) * np.abs(vh).max()


def _keep(feeds, mask, batch, seq, total):
    keys = np.arange(total)
    if mask in ("lengths", "lengths_3b2"):
        return (keys < feeds["m"][:batch, None])[:, None, None, :]
    if mask == "raw":
        return (feeds["m"] > 0)[:, None, None, :]
    if mask == "3d":
        return (feeds["m"] > 0)[:, None]
    return np.ones((1, 1, seq, total), bool)


@rule_marker("unfuse-multi-head-attention", "positive")
@pytest.mark.parametrize("mask", [None, "lengths", "raw"], ids=str)
@pytest.mark.parametrize("shape", STEP_SHAPES, ids=str)
def test_a_decoder_step_is_within_the_stated_bound(shape, mask):
    """One query against past + new keys: the kernel's scores go through MLAS's GEMV, which rounds
    differently (a fully masked entry most: score - 10000, measured); the present outputs are
    still copies, bit for bit."""
    model = mha_model(*shape, mask=mask, attention_bias="full" if mask == "raw" else None)
    feeds = mha_feeds(*shape, mask=mask, attention_bias="full" if mask == "raw" else None)
    want, got = rewrite_and_run(model, feeds)
    for name in ("present_key", "present_value"):
        assert_bitwise_equal(got[name], want[name], name)
    diff = np.abs(got["y"].astype(np.float64) - want["y"]).max()
    assert diff <= _stated_bound(feeds, shape, mask)


def test_a_broken_rewrite_exceeds_the_stated_bound():
    """A scale off by 0.1% is caught by the bound the decoder-step test asserts."""
    shape = (2, 1, 1, 6, 32, 4)
    model = mha_model(*shape)
    feeds = mha_feeds(*shape)
    broken = onnx_qrewrite.rewrite(model).model
    scale = next(n for n in broken.graph.node if n.op_type == "Mul" and "Scale" in n.name)
    init = next(i for i in broken.graph.initializer if i.name == scale.input[1])
    init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * np.float32(1.001), init.name))
    diff = np.abs(run_on(broken, feeds)["y"].astype(np.float64) - run_on(model, feeds)["y"]).max()
    assert diff > _stated_bound(feeds, shape, None)


def shared_buffer_model(batch, seq, kv_seq, buffer, hidden, heads, extra=()):
    """mha_model with past_sequence_length (input 8, int32 [1]): the past a buffer of ``buffer``
    positions, the presents that buffer; ``extra``: (input index, name, elem type, shape) more."""
    model = mha_model(batch, seq, kv_seq, buffer, hidden, heads)
    node = model.graph.node[0]
    for index, name, elem, shape in (*extra, (8, "psl", TensorProto.INT32, [1])):
        while len(node.input) <= index:
            node.input.append("")
        node.input[index] = name
        model.graph.input.append(helper.make_tensor_value_info(name, elem, shape))
    for output in model.graph.output[1:]:
        output.type.tensor_type.shape.dim[2].dim_value = buffer
    return model


#: (batch, query sequence, new keys, buffer, hidden, heads), past_sequence_length
SHARED = [((2, 3, 3, 8, 32, 4), 2), ((1, 4, 4, 4, 32, 2), 0), ((2, 1, 1, 10, 64, 2), 9), ((3, 1, 1, 40, 128, 8), 17)]


@rule_marker("unfuse-multi-head-attention", "positive")
@pytest.mark.parametrize("shape, length", SHARED, ids=str)
def test_past_sequence_length_shares_one_buffer(shape, length):
    """past_sequence_length P: the kernel writes the new K/V into the buffer at P .. P + L - 1, keeps
    the rest of it (measured), and attends its first P + L keys: presents bit for bit, the output bit
    for bit at query sequence > 1 and within the stated bound at 1 (MLAS's GEMV, as without it)."""
    model = shared_buffer_model(*shape)
    feeds = mha_feeds(*shape)
    feeds["psl"] = np.array([length], np.int32)
    want, got = rewrite_and_run(model, feeds)
    end = length + shape[2]
    for name, past in (("present_key", "past_key"), ("present_value", "past_value")):
        assert_bitwise_equal(got[name], want[name], name)
        assert_bitwise_equal(want[name][:, :, end:], feeds[past][:, :, end:], f"{name} after the new keys")
    if shape[1] > 1:
        assert_bitwise_equal(got["y"], want["y"], "output")
    else:
        attended = {
            **feeds,
            "past_key": feeds["past_key"][:, :, :length],
            "past_value": feeds["past_value"][:, :, :length],
        }
        bound = _stated_bound(attended, (*shape[:3], length, *shape[4:]), None)
        assert np.abs(got["y"].astype(np.float64) - want["y"]).max() <= bound


SHARED_NOT_LOWERED = {
    "with cache_indirection": (
        [(9, "ci", TensorProto.INT32, [2, 1, 8])],
        "input 8 (past_sequence_length) with cache_indirection: the kernel's decoder-masked beam path",
    ),
    "with key_padding_mask": (
        [(4, "m", TensorProto.INT32, [2, 5])],
        "past_sequence_length with key_padding_mask: not measured; not lowered",
    ),
}


@rule_marker("unfuse-multi-head-attention", "negative")
@pytest.mark.parametrize("case", list(SHARED_NOT_LOWERED))
def test_past_sequence_length_forms_not_lowered_say_why(case):
    extra, reason = SHARED_NOT_LOWERED[case]
    with pytest.raises(onnx_qrewrite.LoweringError, match=re.escape(reason)):
        onnx_qrewrite.rewrite(shared_buffer_model(2, 3, 3, 8, 32, 4, extra))
