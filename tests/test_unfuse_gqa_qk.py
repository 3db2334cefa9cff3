"""com.microsoft GroupQueryAttention's output_qk (``qk_output`` 1 and 2) -> standard ops, against
onnxruntime 1.31.1's CPU kernel.

The kernel (measured here) writes output_qk (B, N, S, total_sequence_length) from each score row:
with ``qk_output=1`` before the softmax (scale·Q·Kᵀ, softcapped, plus attention_bias, and 0 at the
keys the query does not attend: after its position, outside its local window), with ``qk_output=2``
the softmax's probabilities (0 at those keys). Both round as the output does (the kernel's products,
tanh and softmax differ from MatMul/Tanh/Softmax by a few ulps): the rule's bound for them is
2^-20·(1 + max|score|) (asserted, and shown to catch a rewrite whose scores are off by 0.1%).
An entry's row is written only over its own keys (< seqlens_k[b] + 1): with seqlens_k uneven across
the batch, or a padded first prompt, the keys beyond are left unwritten (stale memory: -5.2e32
measured), so only the keys < seqlens_k[b] + 1 are compared, after a throwaway run that leaves data in
the arena (stale memory then shows). A past buffer longer than total_sequence_length changes nothing
there (measured in a fresh interpreter: tests/test_verify_undefined.py).
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from conftest import assert_bitwise_equal, rule_marker, run
from onnx import TensorProto, helper, numpy_helper
from test_unfuse_gqa import (
    CASES,
    OPTIONS,
    _with_attention_bias,
    _with_head_sink,
    gqa_bound,
    gqa_feeds,
    gqa_model,
    to_float16,
)

import onnx_qrewrite

RNG = np.random.default_rng(31)
RULE = "unfuse-group-query-attention"


def with_qk(model, mode):
    """``model``'s node with ``qk_output=mode`` and the output_qk output (B, N, S, total)."""
    node = model.graph.node[0]
    node.output.append("qk")
    node.attribute.append(helper.make_attribute("qk_output", mode))
    elem = model.graph.output[0].type.tensor_type.elem_type
    batch, seq, _ = (d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim)
    heads = next(a.i for a in node.attribute if a.name == "num_heads")
    model.graph.output.append(helper.make_tensor_value_info("qk", elem, [batch, heads, seq, "total"]))
    return model


def qk_bound(feeds, heads, kv_heads, head, scale):
    """2^-20·(1 + max|score|): the stated bound of output_qk (gqa_bound without the max|V| factor)."""
    ones = {**feeds, "v": np.ones_like(feeds["v"])}
    if "pv" in feeds:
        ones["pv"] = np.ones_like(feeds["pv"])
    return gqa_bound(ones, heads, kv_heads, head, scale)


def written(qk, lengths):
    """(B, N, S, T) mask of the keys the kernel writes: < lengths[b] (= seqlens_k[b] + 1)."""
    return np.broadcast_to(np.arange(qk.shape[3]) < np.array(lengths)[:, None, None, None], qk.shape)


def throwaway(model, feeds):
    """A run on large values first: keys the kernel leaves unwritten then show stale data, not zeros."""
    run(model, {k: np.full_like(v, -1000.0) if v.dtype.kind == "f" else v for k, v in feeds.items()})


def check_qk(model, feeds, shape, scale=0.0):
    result = onnx_qrewrite.rewrite(model)
    assert {n.domain for n in result.model.graph.node} == {""}
    assert result.report.by_rule() == {RULE: 1}
    assert any("unwritten" in note for r in result.report.rewrites for note in r.notes)
    throwaway(model, feeds)
    want, got = run(model, feeds), run(result.model, feeds)
    for name in ("present_key", "present_value"):
        assert_bitwise_equal(got[name], want[name], name)
    _, _, _, heads, kv_heads, head, lengths, _ = shape
    scale = scale or 1 / math.sqrt(head)
    assert got["qk"].shape == want["qk"].shape and got["qk"].dtype == want["qk"].dtype
    keys = written(want["qk"], lengths)
    diff = np.abs(got["qk"].astype(np.float64) - want["qk"])[keys].max()
    assert diff <= qk_bound(feeds, heads, kv_heads, head, scale), diff
    assert np.abs(got["y"].astype(np.float64) - want["y"]).max() <= gqa_bound(feeds, heads, kv_heads, head, scale)
    return diff, want["qk"]


#: CASES and a padded first prompt (its rows past an entry's length attend the entry's keys)
DEFINED = {**CASES, "padded first prompt": (3, 6, None, 4, 2, 8, [6, 3, 1], 6)}


@rule_marker("unfuse-group-query-attention", "positive")
@pytest.mark.parametrize("mode", [1, 2])
@pytest.mark.parametrize("magnitude", [1.0, 30.0])
@pytest.mark.parametrize("case", DEFINED)
def test_output_qk_within_the_bound(case, magnitude, mode):
    shape = DEFINED[case]
    batch, seq, past, heads, kv_heads, head, lengths, total = shape
    model = with_qk(gqa_model(batch, seq, past, heads, kv_heads, head), mode)
    feeds = gqa_feeds(batch, seq, past, heads, kv_heads, head, lengths, total, magnitude)
    _, qk = check_qk(model, feeds, shape)
    keys = np.arange(total)
    first = seq == total  # a first prompt: position i (its padding rows attend keys below the length)
    rows = (np.arange(seq) if first else np.array(lengths)[:, None] - seq + np.arange(seq))[..., None, :, None]
    unattended = np.broadcast_to(keys > rows, qk.shape) & written(qk, lengths)
    assert (qk[unattended] == 0).all()  # the keys not attended (and written): 0


@rule_marker("unfuse-group-query-attention", "positive")
@pytest.mark.parametrize("mode", [1, 2])
@pytest.mark.parametrize("option", [*OPTIONS, "attention_bias", "head_sink"])
def test_output_qk_with_the_options(option, mode):
    """softcap before (mode 1 holds the capped scores), the local window's keys 0, attention_bias
    added, smooth softmax and head sinks in the probabilities."""
    shape = CASES["token step, per-entry lengths"] if "window" in option else CASES["subsequent prompt"]
    batch, seq, past, heads, kv_heads, head, lengths, total = shape
    model = gqa_model(batch, seq, past, heads, kv_heads, head, OPTIONS.get(option, {}))
    feeds = gqa_feeds(batch, seq, past, heads, kv_heads, head, lengths, total)
    if option == "attention_bias":
        model = _with_attention_bias(model, [batch, heads, seq, total])
        feeds["bias"] = RNG.standard_normal((batch, heads, seq, total)).astype(np.float32)
    if option == "head_sink":
        model = _with_head_sink(model, heads)
        feeds["sink"] = RNG.standard_normal(heads).astype(np.float32)
    check_qk(with_qk(model, mode), feeds, shape)


@rule_marker("unfuse-group-query-attention", "positive")
@pytest.mark.parametrize("mode", [1, 2])
@pytest.mark.parametrize("case", ["first prompt", "token step, per-entry lengths"])
def test_output_qk_in_float16(case, mode):
    """The float16 kernel's output_qk is float16, rounded once from its float32 row: within the
    bound plus one float16 ulp."""
    shape = CASES[case]
    batch, seq, past, heads, kv_heads, head, lengths, total = shape
    model = with_qk(to_float16(gqa_model(batch, seq, past, heads, kv_heads, head)), mode)
    feeds = gqa_feeds(batch, seq, past, heads, kv_heads, head, lengths, total)
    feeds = {k: v.astype(np.float16) if v.dtype.kind == "f" else v for k, v in feeds.items()}
    result = onnx_qrewrite.rewrite(model)
    throwaway(model, feeds)
    want, got = run(model, feeds), run(result.model, feeds)
    assert got["qk"].dtype == want["qk"].dtype == np.float16
    ulp = np.spacing(np.abs(want["qk"])).astype(np.float64)
    bound = qk_bound(feeds, heads, kv_heads, head, 1 / math.sqrt(head)) + ulp
    assert (np.abs(got["qk"].astype(np.float64) - want["qk"]) <= bound)[written(want["qk"], lengths)].all()


@pytest.mark.parametrize("mode", [1, 2])
def test_a_broken_output_qk_exceeds_the_bound(mode):
    """The scale off by 0.1% shows at output_qk beyond the stated bound."""
    shape = CASES["subsequent prompt"]
    batch, seq, past, heads, kv_heads, head, lengths, total = shape
    model = with_qk(gqa_model(batch, seq, past, heads, kv_heads, head), mode)
    feeds = gqa_feeds(batch, seq, past, heads, kv_heads, head, lengths, total, 3.0)
    broken = onnx_qrewrite.rewrite(model).model
    scale = next(n for n in broken.graph.node if n.op_type == "Mul" and "Scale" in n.name)
    init = next(i for i in broken.graph.initializer if i.name == scale.input[1])
    init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * np.float32(1.001), init.name))
    diff = np.abs(run(broken, feeds)["qk"].astype(np.float64) - run(model, feeds)["qk"]).max()
    assert diff > qk_bound(feeds, heads, kv_heads, head, 1 / math.sqrt(head))


def _refused(attrs, with_output=True):
    model = gqa_model(2, 1, 5, 4, 2, 8, attrs)
    if with_output:
        model.graph.node[0].output.append("qk")
        model.graph.output.append(helper.make_tensor_value_info("qk", TensorProto.FLOAT, [2, 4, 1, 6]))
    return model


NOT_LOWERED = {
    "qk_output 3": (lambda: _refused({"qk_output": 3}), "qk_output=3: the kernel refuses it"),
    "qk_output without the output": (
        lambda: _refused({"qk_output": 1}, with_output=False),
        "qk_output=1 without the output_qk output: the kernel refuses it",
    ),
    "output_qk with qk_output 0": (lambda: _refused({}), "output_qk is used with qk_output=0: onnxruntime refuses"),
}


@rule_marker("unfuse-group-query-attention", "negative")
@pytest.mark.parametrize("case", list(NOT_LOWERED))
def test_output_qk_forms_not_lowered_say_why(case):
    """Refused by name, and by onnxruntime too."""
    make, reason = NOT_LOWERED[case]
    with pytest.raises(onnx_qrewrite.LoweringError, match=re.escape(reason)):
        onnx_qrewrite.rewrite(make())
    with pytest.raises(Exception, match=r"qk_output|QK"):
        run(make(), gqa_feeds(2, 1, 5, 4, 2, 8, [6, 6], 6))
