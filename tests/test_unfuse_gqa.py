"""com.microsoft GroupQueryAttention -> standard ops, against onnxruntime 1.31.1's CPU kernel.

The kernel's present_key / present_value (each batch entry's past, then the new K/V, then zeros) are
asserted bit for bit; its output rounds differently from MatMul/Softmax/MatMul (measured: up to a
few float32 ulps), so the rule is bounded and the stated bound is asserted, and shown to catch a
rewrite that lets a query see one key too many. Cases: first prompts (with and without an empty
past), token steps with equal and per-entry past lengths, a subsequent prompt, 1, 2 and 4 query
heads per KV head, the scale attribute, inputs scaled by 30.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from _pairwise import pairwise
from conftest import assert_bitwise_equal, rule_marker, run
from onnx import TensorProto, helper

import onnx_qrewrite

RNG = np.random.default_rng(5)


def gqa_model(batch, seq, past, heads, kv_heads, head, attrs=None):
    """GroupQueryAttention(query, key, value, [past_key, past_value], seqlens_k, total_sequence_length)."""
    with_past = past is not None
    inputs = ["q", "k", "v", "pk" if with_past else "", "pv" if with_past else "", "sl", "tl"]
    values = [
        helper.make_tensor_value_info("q", TensorProto.FLOAT, [batch, seq, heads * head]),
        helper.make_tensor_value_info("k", TensorProto.FLOAT, [batch, seq, kv_heads * head]),
        helper.make_tensor_value_info("v", TensorProto.FLOAT, [batch, seq, kv_heads * head]),
    ]
    if with_past:
        values += [
            helper.make_tensor_value_info(name, TensorProto.FLOAT, [batch, kv_heads, past, head])
            for name in ("pk", "pv")
        ]
    values += [
        helper.make_tensor_value_info("sl", TensorProto.INT32, [batch]),
        helper.make_tensor_value_info("tl", TensorProto.INT32, []),
    ]
    node = helper.make_node(
        "GroupQueryAttention",
        inputs,
        ["y", "present_key", "present_value"],
        domain="com.microsoft",
        num_heads=heads,
        kv_num_heads=kv_heads,
        **(attrs or {}),
    )
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, seq, heads * head])]
    outputs += [
        helper.make_tensor_value_info(name, TensorProto.FLOAT, [batch, kv_heads, "total", head])
        for name in ("present_key", "present_value")
    ]
    graph = helper.make_graph([node], "g", values, outputs)
    return helper.make_model(
        graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )


def gqa_feeds(batch, seq, past, heads, kv_heads, head, lengths, total, scale=1.0):
    def normal(*shape):
        return (RNG.standard_normal(shape) * scale).astype(np.float32)

    feeds = {"q": normal(batch, seq, heads * head), "k": normal(batch, seq, kv_heads * head)}
    feeds["v"] = normal(batch, seq, kv_heads * head)
    if past is not None:
        feeds["pk"], feeds["pv"] = normal(batch, kv_heads, past, head), normal(batch, kv_heads, past, head)
    feeds["sl"] = np.array(lengths, np.int32) - 1
    feeds["tl"] = np.array(total, np.int32)
    return feeds


def gqa_bound(feeds, heads, kv_heads, head, scale):
    """Attention's stated bound: 2^-20·(1 + max|score|)·max|V|, over every key and value the node sees."""
    keys = [feeds["k"].reshape(*feeds["k"].shape[:2], kv_heads, head).transpose(0, 2, 1, 3)]
    values = [feeds["v"]]
    if "pk" in feeds:
        keys.append(feeds["pk"])
        values.append(feeds["pv"])
    q = feeds["q"].astype(np.float64).reshape(*feeds["q"].shape[:2], kv_heads, heads // kv_heads, head)
    worst = scale * max(np.abs(np.einsum("bsngh,bnth->bngst", q, k.astype(np.float64))).max(initial=0) for k in keys)
    worst = max(worst, np.abs(feeds["sink"]).max(initial=0)) if "sink" in feeds else worst  # a head sink is a logit
    worst += np.abs(feeds["bias"]).max(initial=0) if "bias" in feeds else 0  # attention_bias moves the scores
    return 2.0**-20 * (1 + worst) * max(np.abs(v).max(initial=0) for v in values)


# batch, sequence, past buffer (None: no past inputs), heads, kv heads, head size, lengths (past + new
# per entry), total_sequence_length
CASES = {
    "first prompt": (2, 5, None, 4, 2, 8, [5, 5], 5),
    "first prompt, empty past": (3, 6, 0, 6, 3, 8, [6, 6, 6], 6),
    "first prompt, 4 per group": (1, 7, None, 8, 2, 16, [7], 7),
    "token step": (2, 1, 5, 4, 2, 8, [6, 6], 6),
    "token step, per-entry lengths": (3, 1, 9, 4, 2, 64, [10, 4, 7], 10),
    "token step, buffer longer than needed": (2, 1, 12, 4, 4, 8, [6, 3], 6),
    "subsequent prompt": (1, 3, 5, 4, 1, 8, [8], 8),
    "long cache": (2, 1, 40, 4, 2, 32, [41, 17], 41),
}


def check_within_bound(model, feeds, shape, attrs_scale, rows=None):
    result = onnx_qrewrite.rewrite(model)
    assert {n.domain for n in result.model.graph.node} == {""}
    assert result.report.by_rule() == {"unfuse-group-query-attention": 1}
    assert [r.exactness for r in result.report.rewrites] == ["bounded"]
    want, got = run(model, feeds), run(result.model, feeds)
    for name in ("present_key", "present_value"):
        assert_bitwise_equal(got[name], want[name], name)
    _, _, _, heads, kv_heads, head, _, _ = shape
    scale = attrs_scale or 1 / math.sqrt(head)
    y_want, y_got = want["y"], got["y"]
    if rows is not None:
        y_want, y_got = y_want[rows], y_got[rows]
    diff = np.abs(y_got.astype(np.float64) - y_want)
    bound = gqa_bound(feeds, heads, kv_heads, head, scale)
    assert diff.max() <= bound, f"{diff.max():g} > {bound:g}"
    return diff.max()


@rule_marker("unfuse-group-query-attention", "positive")
@pytest.mark.parametrize("magnitude", [1.0, 30.0])
@pytest.mark.parametrize("case", list(CASES))
def test_group_query_attention_within_the_bound_present_bit_exact(case, magnitude):
    shape = CASES[case]
    batch, seq, past, heads, kv_heads, head, lengths, total = shape
    model = gqa_model(batch, seq, past, heads, kv_heads, head)
    feeds = gqa_feeds(batch, seq, past, heads, kv_heads, head, lengths, total, magnitude)
    check_within_bound(model, feeds, shape, 0.0)


@rule_marker("unfuse-group-query-attention", "positive")
def test_group_query_attention_scale_attribute():
    shape = CASES["token step, per-entry lengths"]
    batch, seq, past, heads, kv_heads, head, lengths, total = shape
    model = gqa_model(batch, seq, past, heads, kv_heads, head, {"scale": 0.3})
    check_within_bound(model, gqa_feeds(batch, seq, past, heads, kv_heads, head, lengths, total), shape, 0.3)


PADDED_OPTIONS = {
    "causal": {},
    "window 2": {"local_window_size": 2},
    "window 2, softcap": {"local_window_size": 2, "softcap": 5.0},
}
#: Each option with each dtype and with and without a head sink (pairwise, tests/_pairwise.py); kept
#: first: the float32 rows measured first, and a window in float16 and with a sink each alone (each
#: makes the kernel take the window from the entry's last key, as softcap does: a row with both
#: would not show one of them being lost).
PADDED = pairwise(
    tuple(PADDED_OPTIONS),
    ("float32", "float16"),
    (False, True),
    keep=[
        ("causal", "float32", False),
        ("window 2", "float32", False),
        ("window 2, softcap", "float32", False),
        ("window 2", "float16", False),
        ("window 2", "float32", True),
    ],
)


@rule_marker("unfuse-group-query-attention", "positive")
@pytest.mark.parametrize("option, dtype, sink", PADDED, ids=[f"{o}-{d}{'-sink' if s else ''}" for o, d, s in PADDED])
def test_group_query_attention_padded_first_prompt(option, dtype, sink):
    """A first prompt with entries shorter than the sequence: their rows at or past their length
    attend the entry's keys, as the kernel does (measured; after a run that leaves other data in
    memory): every row within the bound. With the window the kernel's plain path (float32 without
    softcap, smooth_softmax, head_sink or output_qk) takes the window's keys up to the row's
    position that are below the length (rows attending none are zeros), its other paths (softcap,
    float16, a head sink) the last 2 keys below the length. Attending the padding keys up to the
    row's position, as before, was 0.5 to 2.8 away there; either window for the other, 2.4."""
    shape = (3, 6, None, 4, 2, 8, [6, 3, 1], 6)
    batch, seq, past, heads, kv_heads, head, lengths, total = shape
    model = gqa_model(batch, seq, past, heads, kv_heads, head, PADDED_OPTIONS[option])
    feeds = gqa_feeds(batch, seq, past, heads, kv_heads, head, lengths, total)
    if sink:
        model = _with_head_sink(model, heads)
        feeds["sink"] = RNG.standard_normal(heads).astype(np.float32)
    if dtype == "float16":
        model = to_float16(model)
        feeds = {k: v.astype(np.float16) if v.dtype.kind == "f" else v for k, v in feeds.items()}
    run(model, {k: np.full_like(v, 7.0) if v.dtype.kind == "f" else v for k, v in feeds.items()})
    if dtype == "float16":
        check_float16(model, feeds, heads, kv_heads, head)
    else:
        check_within_bound(model, feeds, shape, 0.0)


ROTARY_CASES = {
    "first prompt": ((2, 5, None, 4, 2, 16, [5, 5], 5), 0, 8),
    "token step, per-entry lengths": ((2, 1, 7, 4, 2, 16, [8, 3], 8), 0, 8),
    "token step, interleaved, partial": ((2, 1, 7, 4, 2, 32, [8, 3], 8), 1, 8),
    "subsequent prompt, partial": ((1, 3, 5, 4, 1, 32, [8], 8), 0, 8),
}


@rule_marker("unfuse-group-query-attention", "positive")
@pytest.mark.parametrize("case", list(ROTARY_CASES))
def test_group_query_attention_do_rotary(case):
    """do_rotary: Q and the new K rotated at positions past_b + i as RotaryEmbedding's kernel does
    (its fused multiply-add emulated exactly): the rotated keys in present_key bit for bit."""
    shape, interleaved, width = ROTARY_CASES[case]
    batch, seq, past, heads, kv_heads, head, lengths, total = shape
    model = gqa_model(batch, seq, past, heads, kv_heads, head, {"do_rotary": 1, "rotary_interleaved": interleaved})
    model.graph.node[0].input.extend(["cos", "sin"])
    positions = 16
    model.graph.input.extend(
        helper.make_tensor_value_info(name, TensorProto.FLOAT, [positions, width]) for name in ("cos", "sin")
    )
    feeds = gqa_feeds(batch, seq, past, heads, kv_heads, head, lengths, total)
    angles = RNG.uniform(0, 2 * np.pi, (positions, width))
    feeds["cos"], feeds["sin"] = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    check_within_bound(model, feeds, shape, 0.0)


def _rotary_with_position_ids(case):
    """A do_rotary case of ROTARY_CASES with position_ids (B, S) int64 as input 9, and its feeds."""
    shape, interleaved, width = ROTARY_CASES[case]
    batch, seq, past, heads, kv_heads, head, lengths, total = shape
    model = gqa_model(batch, seq, past, heads, kv_heads, head, {"do_rotary": 1, "rotary_interleaved": interleaved})
    model.graph.node[0].input.extend(["cos", "sin", "pos"])
    model.graph.input.extend(
        helper.make_tensor_value_info(name, TensorProto.FLOAT, [16, width]) for name in ("cos", "sin")
    )
    model.graph.input.append(helper.make_tensor_value_info("pos", TensorProto.INT64, [batch, seq]))
    feeds = gqa_feeds(batch, seq, past, heads, kv_heads, head, lengths, total)
    angles = RNG.uniform(0, 2 * np.pi, (16, width))
    feeds["cos"], feeds["sin"] = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    feeds["pos"] = RNG.integers(0, 16 - seq, (batch, seq)).astype(np.int64)
    return model, feeds, shape


@rule_marker("unfuse-group-query-attention", "positive")
@pytest.mark.parametrize("case", list(ROTARY_CASES))
def test_group_query_attention_do_rotary_at_position_ids(case):
    """position_ids (input 9) with do_rotary, random per entry and token: Q and the new K rotated
    where the kernel rotates them, the rotated keys in present_key bit for bit, the output within
    the bound. Measured first (onnxruntime 1.31.1's CPU kernel): the positions change its result,
    and on the first prompt it reads only position_ids[0, 0], as the start of every entry's
    positions (a batch whose rows all hold position_ids[0, 0] + i gives bit for bit the same)."""
    model, feeds, shape = _rotary_with_position_ids(case)
    want = run(model, feeds)
    moved = dict(feeds, pos=feeds["pos"] + 1)
    assert not np.array_equal(run(model, moved)["present_key"], want["present_key"])
    batch, seq, _, _, _, _, _, total = shape
    if seq == total:  # the first prompt
        counted = np.broadcast_to(feeds["pos"][0, 0] + np.arange(seq), (batch, seq)).astype(np.int64)
        for name, value in run(model, dict(feeds, pos=counted)).items():
            assert_bitwise_equal(value, want[name], name)
    check_within_bound(model, feeds, shape, 0.0)


@rule_marker("unfuse-group-query-attention", "positive")
def test_group_query_attention_position_ids_without_rotary_change_nothing():
    """Without do_rotary the kernel reads no position_ids (measured: any values, out of range too,
    give bit for bit the outputs of the node without them), and neither does the rewrite."""
    shape = CASES["token step"]
    batch, seq, past, heads, kv_heads, head, lengths, total = shape
    model = gqa_model(batch, seq, past, heads, kv_heads, head)
    model.graph.node[0].input.extend(["", "", "pos"])
    model.graph.input.append(helper.make_tensor_value_info("pos", TensorProto.INT64, [batch, seq]))
    feeds = gqa_feeds(batch, seq, past, heads, kv_heads, head, lengths, total)
    plain = gqa_model(batch, seq, past, heads, kv_heads, head)
    want = run(plain, feeds)
    for pos in ([[3], [9]], [[100], [-5]]):
        for name, value in run(model, dict(feeds, pos=np.array(pos, np.int64))).items():
            assert_bitwise_equal(value, want[name], name)
    check_within_bound(model, dict(feeds, pos=np.array([[100], [-5]], np.int64)), shape, 0.0)


def packed(model, feeds, heads, kv_heads, head):
    """The same node with Q, K and V packed into its query input, (B, S, (N + 2 Nkv) H)."""
    node = model.graph.node[0]
    node.input[1] = node.input[2] = ""
    batch, seq = feeds["q"].shape[:2]
    del model.graph.input[1:3]
    width = (heads + 2 * kv_heads) * head
    model.graph.input[0].CopyFrom(helper.make_tensor_value_info("q", TensorProto.FLOAT, [batch, seq, width]))
    merged = {name: value for name, value in feeds.items() if name not in ("k", "v")}
    merged["q"] = np.concatenate([feeds["q"], feeds["k"], feeds["v"]], axis=-1)
    return model, merged


@rule_marker("unfuse-group-query-attention", "positive")
@pytest.mark.parametrize("case", ["first prompt", "token step, per-entry lengths", "subsequent prompt"])
def test_group_query_attention_packed_qkv(case):
    shape = CASES[case]
    batch, seq, past, heads, kv_heads, head, lengths, total = shape
    feeds = gqa_feeds(batch, seq, past, heads, kv_heads, head, lengths, total)
    model, merged = packed(gqa_model(batch, seq, past, heads, kv_heads, head), feeds, heads, kv_heads, head)
    result = onnx_qrewrite.rewrite(model)
    assert result.report.by_rule() == {"unfuse-group-query-attention": 1}
    want, got = run(model, merged), run(result.model, merged)
    for name in ("present_key", "present_value"):
        assert_bitwise_equal(got[name], want[name], name)
    diff = np.abs(got["y"].astype(np.float64) - want["y"]).max()
    assert diff <= gqa_bound(feeds, heads, kv_heads, head, 1 / math.sqrt(head))


def test_group_query_attention_one_key_too_many_exceeds_the_bound():
    """The causal mask lets query i see keys up to past_b + i: one more (Less -> LessOrEqual) is caught."""
    shape = CASES["first prompt"]
    batch, seq, past, heads, kv_heads, head, lengths, total = shape
    model = gqa_model(batch, seq, past, heads, kv_heads, head)
    feeds = gqa_feeds(batch, seq, past, heads, kv_heads, head, lengths, total)
    rewritten = onnx_qrewrite.rewrite(model).model
    causal = [
        n for n in rewritten.graph.node if n.op_type == "Less" and n.output[0] in _inputs_of(rewritten, "Unsqueeze")
    ]
    assert len(causal) == 1
    causal[0].op_type = "LessOrEqual"
    diff = np.abs(run(rewritten, feeds)["y"].astype(np.float64) - run(model, feeds)["y"]).max()
    assert diff > gqa_bound(feeds, heads, kv_heads, head, 1 / math.sqrt(head))


def _inputs_of(model, op_type):
    return {i for n in model.graph.node if n.op_type == op_type for i in n.input}


def _refused(attrs=None, drop=(), extra=None):
    model = gqa_model(2, 1, 5, 4, 2, 8, attrs)
    node = model.graph.node[0]
    for index in drop:
        node.input[index] = ""
    if extra:
        index, name = extra
        while len(node.input) <= index:
            node.input.append("")
        node.input[index] = name
        model.graph.input.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, [8, 4]))
    return model


def _with_sin(model):
    model.graph.node[0].input.append("sin")
    model.graph.input.append(helper.make_tensor_value_info("sin", TensorProto.FLOAT, [8, 4]))
    return model


NOT_LOWERED = {
    "rotary without caches": (lambda: _refused({"do_rotary": 1}), "do_rotary without cos_cache and sin_cache"),
    "caches without rotary": (lambda: _refused(extra=(7, "cos")), "cos_cache/sin_cache without do_rotary"),
    "qk_output without output_qk": (
        lambda: _refused({"qk_output": 1}),
        "qk_output=1 without the output_qk output: the kernel refuses it",
    ),
    "window of no key": (lambda: _refused({"local_window_size": 0}), "local_window_size=0: the kernel attends to no"),
    "negative softcap": (lambda: _refused({"softcap": -1.0}), "softcap=-1.0: the kernel's output then is neither"),
    "float16 rotary, float32 caches": (
        lambda: to_float16(_with_sin(_refused({"do_rotary": 1}, extra=(7, "cos")))),
        "'cos' is float32; the query is float16",
    ),
    "key without value": (lambda: _refused(drop=(2,)), "key and value must both be given or both absent"),
    "position ids not int64": (
        lambda: _refused(extra=(9, "pos")),
        "position_ids 'pos' is float32; the kernel takes int64",
    ),
    "uneven groups": (lambda: gqa_model(2, 1, 5, 6, 4, 8), "num_heads=6 is not a multiple of kv_num_heads=4"),
    "head size 4": (lambda: gqa_model(2, 1, 5, 4, 2, 4), "head_size 4 is not a multiple of 8: onnxruntime's kernel"),
}


@rule_marker("unfuse-group-query-attention", "negative")
@pytest.mark.parametrize("case", list(NOT_LOWERED))
def test_group_query_attention_forms_not_lowered_say_why(case):
    make, reason = NOT_LOWERED[case]
    with pytest.raises(onnx_qrewrite.LoweringError, match=re.escape(reason)):
        onnx_qrewrite.rewrite(make())


# --- softcap, smooth_softmax, local_window_size, float16 -------------------------------------------

OPTIONS = {
    "softcap 2": {"softcap": 2.0},
    "softcap 30": {"softcap": 30.0},
    "smooth softmax": {"smooth_softmax": 1},
    "window 1": {"local_window_size": 1},
    "window 3": {"local_window_size": 3},
    "window wider than the cache": {"local_window_size": 100},
    "negative window (none)": {"local_window_size": -5},
    "all three": {"softcap": 5.0, "smooth_softmax": 1, "local_window_size": 2},
}


@rule_marker("unfuse-group-query-attention", "positive")
@pytest.mark.parametrize("magnitude", [1.0, 30.0])
@pytest.mark.parametrize("case", ["first prompt, 4 per group", "token step, per-entry lengths", "subsequent prompt"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_group_query_attention_options_within_the_bound(option, case, magnitude):
    """As onnxruntime 1.31.1's CPU kernel (measured): softcap · tanh(score / softcap) before the
    mask; smooth softmax exp(x - m) / (Σ exp(x - m) + exp(-m)), m = max(0, max x), as Softmax with
    one more logit of 0; a local window of w keys: the query's own and the w - 1 before it."""
    shape = CASES[case]
    batch, seq, past, heads, kv_heads, head, lengths, total = shape
    model = gqa_model(batch, seq, past, heads, kv_heads, head, OPTIONS[option])
    feeds = gqa_feeds(batch, seq, past, heads, kv_heads, head, lengths, total, magnitude)
    check_within_bound(model, feeds, shape, 0.0)


def _broken(model, feeds, mutate):
    """How far a rewrite changed by ``mutate`` (on its nodes) lands from the kernel."""
    rewritten = onnx_qrewrite.rewrite(model).model
    mutate(rewritten)
    return np.abs(run(rewritten, feeds)["y"].astype(np.float64) - run(model, feeds)["y"]).max()


def _drop_softcap(model):
    tanh = next(n for n in model.graph.node if n.op_type == "Tanh")
    div = next(n for n in model.graph.node if n.output[0] == tanh.input[0])
    mul = next(n for n in model.graph.node if tanh.output[0] in n.input)
    for node in model.graph.node:
        node.input[:] = [div.input[0] if i == mul.output[0] else i for i in node.input]


def _widen_window(model):
    window = next(
        n
        for n in model.graph.node
        if n.op_type == "Greater"
        and "LocalWindow" not in n.name
        and any(o in m.input for m in model.graph.node if "LocalWindow" in m.name for o in n.output)
    )
    window.op_type = "GreaterOrEqual"


def _plain_softmax(model):
    concat = next(
        n
        for n in model.graph.node
        if n.op_type == "Concat"
        and "SmoothSoftmax" in "".join(m.name for m in model.graph.node if n.output[0] in m.input)
    )
    softmax = next(n for n in model.graph.node if concat.output[0] in n.input)
    softmax.input[0] = concat.input[0]
    end = next(n for n in model.graph.node if softmax.output[0] in n.input and n.op_type == "Slice")
    end.op_type = "Identity"
    del end.input[1:]


BROKEN = {
    "softcap dropped": ({"softcap": 2.0}, _drop_softcap),
    "window one key wider": ({"local_window_size": 3}, _widen_window),
    "smooth softmax as Softmax": ({"smooth_softmax": 1}, _plain_softmax),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_group_query_attention_broken_options_exceed_the_bound(case):
    attrs, mutate = BROKEN[case]
    shape = CASES["token step, per-entry lengths"]
    batch, seq, past, heads, kv_heads, head, lengths, total = shape
    model = gqa_model(batch, seq, past, heads, kv_heads, head, attrs)
    feeds = gqa_feeds(batch, seq, past, heads, kv_heads, head, lengths, total)
    assert _broken(model, feeds, mutate) > gqa_bound(feeds, heads, kv_heads, head, 1 / math.sqrt(head))


def _with_head_sink(model, heads):
    node = model.graph.node[0]
    node.input.extend([""] * (11 - len(node.input)) + ["sink"])
    model.graph.input.append(helper.make_tensor_value_info("sink", TensorProto.FLOAT, [heads]))
    return model


@rule_marker("unfuse-group-query-attention", "positive")
@pytest.mark.parametrize("sink_scale", [1.0, 10.0])
@pytest.mark.parametrize("option", ["none", "smooth softmax", "all three"])
@pytest.mark.parametrize("case", ["first prompt, 4 per group", "token step, per-entry lengths", "subsequent prompt"])
def test_group_query_attention_head_sink(case, option, sink_scale):
    """head_sink (input 11, one logit per head): the softmax takes it as one more logit, dropped
    after, as smooth_softmax takes 0 (it replaces smooth_softmax's 0 where both are given:
    measured, onnxruntime 1.31.1). Within the bound (the sink counted among the scores), present
    bit-exact; the node without its sink is not."""
    shape = CASES[case]
    batch, seq, past, heads, kv_heads, head, lengths, total = shape
    attrs = OPTIONS.get(option, {})
    model = _with_head_sink(gqa_model(batch, seq, past, heads, kv_heads, head, attrs), heads)
    feeds = gqa_feeds(batch, seq, past, heads, kv_heads, head, lengths, total)
    feeds["sink"] = (RNG.standard_normal(heads) * sink_scale).astype(np.float32)
    check_within_bound(model, feeds, shape, 0.0)
    if attrs.get("smooth_softmax"):  # the sink replaces smooth_softmax's 0: the kernel gives the same without it
        plain = {k: v for k, v in attrs.items() if k != "smooth_softmax"}
        unsmoothed = _with_head_sink(gqa_model(batch, seq, past, heads, kv_heads, head, plain), heads)
        assert_bitwise_equal(run(unsmoothed, feeds)["y"], run(model, feeds)["y"], "smooth_softmax with a head sink")
    without = run(
        gqa_model(batch, seq, past, heads, kv_heads, head, attrs), {k: v for k, v in feeds.items() if k != "sink"}
    )
    far = np.abs(without["y"].astype(np.float64) - run(model, feeds)["y"]).max()
    assert far > gqa_bound(feeds, heads, kv_heads, head, 1 / math.sqrt(head)), far


@rule_marker("unfuse-group-query-attention", "positive")
@pytest.mark.parametrize("magnitude", [1.0, 30.0])
@pytest.mark.parametrize("with_positions", [False, True], ids=["past_b + i", "position_ids"])
@pytest.mark.parametrize("case", list(ROTARY_CASES))
def test_group_query_attention_float16_do_rotary(case, with_positions, magnitude):
    """float16 with do_rotary: the kernel rotates Q and the new K in float16 (RotaryEmbedding's
    float16 routine: float32 products, rounded to float16), then attends in float32; the rewrite
    does the same: presents bit for bit, the output within the float32 bound plus one float16 ulp
    (bit for bit on every case measured)."""
    shape, interleaved, width = ROTARY_CASES[case]
    batch, seq, past, heads, kv_heads, head, lengths, total = shape
    model = gqa_model(batch, seq, past, heads, kv_heads, head, {"do_rotary": 1, "rotary_interleaved": interleaved})
    model.graph.node[0].input.extend(["cos", "sin", "pos"] if with_positions else ["cos", "sin"])
    model.graph.input.extend(
        helper.make_tensor_value_info(name, TensorProto.FLOAT16, [16, width]) for name in ("cos", "sin")
    )
    if with_positions:
        model.graph.input.append(helper.make_tensor_value_info("pos", TensorProto.INT64, [batch, seq]))
    model = to_float16(model)
    feeds = gqa_feeds(batch, seq, past, heads, kv_heads, head, lengths, total, magnitude)
    angles = RNG.uniform(0, 2 * np.pi, (16, width))
    feeds["cos"], feeds["sin"] = np.cos(angles), np.sin(angles)
    if with_positions:
        feeds["pos"] = RNG.integers(0, 16 - seq, (batch, seq)).astype(np.int64)
    check_float16(model, feeds, heads, kv_heads, head)


def _with_attention_bias(model, dims):
    node = model.graph.node[0]
    node.input.extend([""] * (10 - len(node.input)) + ["bias"])
    model.graph.input.append(helper.make_tensor_value_info("bias", TensorProto.FLOAT, dims))
    return model


#: attention_bias shapes: (B or 1, N or 1, S, total_sequence_length)
BIAS_SHAPES = {
    "per entry and head": lambda b, n: [b, n],
    "per head": lambda b, n: [1, n],
    "per entry": lambda b, n: [b, 1],
    "shared": lambda b, n: [1, 1],
}


@rule_marker("unfuse-group-query-attention", "positive")
@pytest.mark.parametrize("option", ["none", "softcap 2"])
@pytest.mark.parametrize("bias_shape", list(BIAS_SHAPES))
@pytest.mark.parametrize(
    "case", ["first prompt, 4 per group", "token step, per-entry lengths", "token step, buffer longer than needed"]
)
def test_group_query_attention_attention_bias(case, bias_shape, option):
    """attention_bias (input 10, broadcast over entries and heads, total_sequence_length keys): added
    to the scores after softcap and before the mask, as onnxruntime 1.31.1's CPU kernel does
    (measured: added before softcap it is 0.1 off), zeros over a longer present buffer's keys
    (masked anyway). Within the bound (the bias counted in the scores), present bit-exact; the
    node without its bias is not."""
    shape = CASES[case]
    batch, seq, past, heads, kv_heads, head, lengths, total = shape
    attrs = OPTIONS.get(option, {})
    dims = [*BIAS_SHAPES[bias_shape](batch, heads), seq, total]
    model = _with_attention_bias(gqa_model(batch, seq, past, heads, kv_heads, head, attrs), dims)
    feeds = gqa_feeds(batch, seq, past, heads, kv_heads, head, lengths, total)
    feeds["bias"] = RNG.standard_normal(dims).astype(np.float32)
    check_within_bound(model, feeds, shape, 0.0)
    without = run(
        gqa_model(batch, seq, past, heads, kv_heads, head, attrs), {k: v for k, v in feeds.items() if k != "bias"}
    )
    far = np.abs(without["y"].astype(np.float64) - run(model, feeds)["y"]).max()
    assert far > gqa_bound(feeds, heads, kv_heads, head, 1 / math.sqrt(head)), far


MASKS = {
    "a head's every key at float32's lowest": lambda b: b[:, 0].fill(np.finfo(np.float32).min),
    "a head's every key at -inf": lambda b: b[:, 0].fill(-np.inf),
    "one query's keys at the lowest value": lambda b: b[:, 1, 0].fill(np.finfo(np.float32).min),
    "one ulp above the lowest value": lambda b: b[:, 0].fill(np.nextafter(np.finfo(np.float32).min, np.float32(0))),
    "one key at the lowest value": lambda b: b[:, 0, :, 0].fill(np.finfo(np.float32).min),
}


@rule_marker("unfuse-group-query-attention", "positive")
@pytest.mark.parametrize("sink", [False, True], ids=["", "head sink"])
@pytest.mark.parametrize("option", ["none", "smooth softmax", "softcap 2"])
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("opset", [17, 21])  # ReduceMax's axes: an attribute, then an input (18)
def test_group_query_attention_bias_masking_whole_rows(opset, mask, option, sink):
    """An additive mask of finfo(float32).min (or -inf) over every key of a row: without softcap,
    head_sink or smooth_softmax the kernel writes zeros there (measured, onnxruntime 1.31.1; one ulp
    above the lowest value it computes the plain softmax), and so does the rewrite; with softcap a
    row at the lowest value gets the plain softmax and one at -inf NaN, as Softmax gives; with a sink
    or smooth_softmax's 0 the softmax itself gives the zeros. Compared element by element, NaN in
    the same places (no bound applies to those rows)."""
    batch, seq, past, heads, kv_heads, head, lengths, total = CASES["token step, per-entry lengths"]
    dims = [batch, heads, seq, total]
    model = _with_attention_bias(gqa_model(batch, seq, past, heads, kv_heads, head, OPTIONS.get(option, {})), dims)
    model.opset_import[0].version = opset
    feeds = gqa_feeds(batch, seq, past, heads, kv_heads, head, lengths, total)
    if sink:
        model = _with_head_sink(model, heads)
        feeds["sink"] = RNG.standard_normal(heads).astype(np.float32)
    feeds["bias"] = RNG.standard_normal(dims).astype(np.float32)
    MASKS[mask](feeds["bias"])
    want, got = run(model, feeds)["y"], run(onnx_qrewrite.rewrite(model).model, feeds)["y"]
    assert np.array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(np.nan_to_num(got), np.nan_to_num(want), rtol=0, atol=1e-5)


SHAPE_REFUSALS = {  # on a first prompt of 2 entries, 3 tokens, 4 heads
    "bias of one query row": ("bias", [2, 4, 1, 3], "attention_bias 'bias' has dimension 2 = 1; the kernel requires 3"),
    "bias of another batch": (
        "bias",
        [3, 4, 3, 3],
        "attention_bias 'bias' has dimension 0 = 3; the kernel requires 1 or 2",
    ),
    "bias of another head count": (
        "bias",
        [2, 3, 3, 3],
        "attention_bias 'bias' has dimension 1 = 3; the kernel requires 1 or 4",
    ),
    "bias of rank 3": ("bias", [4, 3, 3], "attention_bias 'bias' has rank 3; the kernel takes rank 4"),
    "position ids of one entry": ("pos", [1, 3], "position_ids 'pos' has dimension 0 = 1; the kernel requires 2"),
}


@rule_marker("unfuse-group-query-attention", "negative")
@pytest.mark.parametrize("case", list(SHAPE_REFUSALS))
def test_group_query_attention_refuses_recorded_shapes_the_kernel_refuses(case):
    """A recorded attention_bias or position_ids shape the kernel refuses when it runs (measured:
    'dimension 2 must be equal to the sequence length', 'dimension 0 must be equal to the batch
    size'): refused by name, where the rewrite's broadcasting would compute something instead."""
    name, dims, reason = SHAPE_REFUSALS[case]
    model = gqa_model(2, 3, None, 4, 2, 8)
    if name == "bias":
        model = _with_attention_bias(model, dims)
    else:
        model.graph.node[0].input.extend(["", "", name])
        model.graph.input.append(helper.make_tensor_value_info(name, TensorProto.INT64, dims))
    with pytest.raises(onnx_qrewrite.LoweringError, match=re.escape(reason)):
        onnx_qrewrite.rewrite(model)
    with pytest.raises(Exception, match=r"must be equal to|must be a 4D tensor"):  # onnxruntime refuses it too
        feeds = gqa_feeds(2, 3, None, 4, 2, 8, [3, 3], 3)
        feeds[name] = np.zeros(dims, np.float32 if name == "bias" else np.int64)
        run(model, feeds)


@rule_marker("unfuse-group-query-attention", "positive")
def test_group_query_attention_float16_with_attention_bias_and_head_sink():
    """float16: the bias and the sinks join the float32 scores exactly (Cast), output within the
    float32 bound plus one float16 ulp, presents bit for bit."""
    shape = CASES["token step, per-entry lengths"]
    batch, seq, past, heads, kv_heads, head, lengths, total = shape
    model = gqa_model(batch, seq, past, heads, kv_heads, head)
    model = to_float16(_with_head_sink(_with_attention_bias(model, [batch, heads, seq, total]), heads))
    feeds = gqa_feeds(batch, seq, past, heads, kv_heads, head, lengths, total)
    feeds["bias"] = RNG.standard_normal((batch, heads, seq, total))
    feeds["sink"] = RNG.standard_normal(heads)
    check_float16(model, feeds, heads, kv_heads, head)


def check_float16(model, feeds, heads, kv_heads, head):
    """The float16 node and its rewrite on ``feeds`` in float16: presents bit for bit, the output
    float16 and within the float32 bound plus one float16 ulp (the kernel computes in float32 and
    rounds once; the two float32 results may round to neighbours)."""
    feeds = {k: v.astype(np.float16) if v.dtype.kind == "f" else v for k, v in feeds.items()}
    result = onnx_qrewrite.rewrite(model)
    assert result.report.by_rule() == {"unfuse-group-query-attention": 1}
    want, got = run(model, feeds), run(result.model, feeds)
    for name in ("present_key", "present_value"):
        assert_bitwise_equal(got[name], want[name], name)
    assert got["y"].dtype == np.float16
    ulp = np.spacing(np.abs(want["y"])).astype(np.float64)
    bound = gqa_bound(feeds, heads, kv_heads, head, 1 / math.sqrt(head)) + ulp
    assert (np.abs(got["y"].astype(np.float64) - want["y"]) <= bound).all()


def to_float16(model):
    """The same node on float16 query, key, value, past and outputs."""
    for value in [*model.graph.input, *model.graph.output]:
        if value.type.tensor_type.elem_type == TensorProto.FLOAT and value.name not in ("cos", "sin"):
            value.type.tensor_type.elem_type = TensorProto.FLOAT16
    return model


@rule_marker("unfuse-group-query-attention", "positive")
@pytest.mark.parametrize("option", [None, "all three"], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_group_query_attention_float16(case, option):
    """The float16 kernel converts Q, K, V and the past to float32, computes as for float32 and
    rounds the output once: the rewrite does the same, so the output is within the float32 bound
    plus one float16 ulp of it (the two float32 results may round to neighbours), and the presents
    bit for bit."""
    shape = CASES[case]
    batch, seq, past, heads, kv_heads, head, lengths, total = shape
    model = to_float16(gqa_model(batch, seq, past, heads, kv_heads, head, OPTIONS.get(option)))
    check_float16(model, gqa_feeds(batch, seq, past, heads, kv_heads, head, lengths, total), heads, kv_heads, head)
