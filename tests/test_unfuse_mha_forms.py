"""com.microsoft MultiHeadAttention's other forms -> standard ops, against onnxruntime 1.31.1's
own CPU kernel: 4-D key/value (B, N, L, H), the qk output and cache_indirection.

The kernel (measured here):

- key and value (B, N, L, H) are used as they are (the form cross attention passes its cached keys
  in); of the bias only Q's slice is added (K's and V's are not read); present_key / present_value
  are copies of key / value, or with past_key / past_value (and both presents) the past then key /
  value, as with 3-D key/value (lowered: tested below).
- the qk output (B, N, S, T) is each row of scores the softmax reads: scale·Q·Kᵀ + attention_bias +
  the mask, the mask being the padding value (``mask_filter_value``) where a key is masked and
  float32's lowest value at the keys after the query under ``unidirectional``, in place of the
  padding value, added to the score (scores beyond 2^103 overflow to -inf there).
- cache_indirection without past_sequence_length is checked for its rank (3) but none of its
  values are read; it keeps the kernel off its flash path.

Each of these keeps the kernel off its flash (blocked softmax) path, so at query sequence > 1 the
rewrite is bit-exact (asserted); a one-query step goes through MLAS's GEMV and is within the rule's
bound (asserted, with a broken rewrite shown outside it). The packed forms (query (B, L, N, 3, H),
query alone, key (B, L, N, 2, H)) are refused by the CPU kernel itself: not lowered. The real
model: a BART decoder's cross-attention block with cached encoder keys, as transformers exports it,
fused by onnxruntime.transformers' optimizer itself into MultiHeadAttention with 4-D key/value.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from conftest import assert_bitwise_equal, rule_marker, run
from onnx import TensorProto, helper, numpy_helper
from test_unfuse_mha_state import one_mha_model

import onnx_qrewrite

RNG = np.random.default_rng(23)
RULE = "unfuse-multi-head-attention"
INFO = helper.make_tensor_value_info


def bnsh_model(
    batch,
    seq,
    kv_seq,
    hidden,
    heads,
    *,
    head_v=None,
    mask=None,
    bias=False,
    attention_bias=False,
    attrs=None,
    outputs=("y",),
    cache_indirection=False,
):
    """MultiHeadAttention with query (B, S, D) and 4-D key/value (B, N, L, H) unless ``kv_seq`` is
    given as ('3d', L): then 3-D key/value (B, L, D)."""
    three_d = isinstance(kv_seq, tuple)
    kv_seq = kv_seq[1] if three_d else kv_seq
    head = hidden // heads
    head_v = head_v or head
    inputs = ["q", "k", "v", "b" if bias else "", "m" if mask else "", "ab" if attention_bias else ""]
    inputs += ["", "", "", "ci"] if cache_indirection else []
    while not inputs[-1]:
        inputs.pop()
    values = [INFO("q", TensorProto.FLOAT, [batch, seq, hidden])]
    if three_d:
        values += [
            INFO("k", TensorProto.FLOAT, [batch, kv_seq, hidden]),
            INFO("v", TensorProto.FLOAT, [batch, kv_seq, heads * head_v]),
        ]
    else:
        values += [INFO(n, TensorProto.FLOAT, [batch, heads, kv_seq, h]) for n, h in (("k", head), ("v", head_v))]
    if bias:
        values.append(INFO("b", TensorProto.FLOAT, [2 * hidden + heads * head_v]))
    if mask:
        values.append(INFO("m", TensorProto.INT32, list(mask_shape(mask, batch, seq, kv_seq))))
    if attention_bias:
        values.append(INFO("ab", TensorProto.FLOAT, [batch, heads, seq, kv_seq]))
    if cache_indirection:
        values.append(INFO("ci", TensorProto.INT32, [batch, 1, kv_seq]))
    shapes = {
        "y": [batch, seq, heads * head_v],
        "present_key": [batch, heads, kv_seq, head],
        "present_value": [batch, heads, kv_seq, head_v],
        "qk": [batch, heads, seq, kv_seq],
    }
    return one_mha_model(inputs, outputs, values, shapes, heads, attrs)


def mask_shape(mask, batch, seq, total):
    return {"lengths": (batch,), "raw": (batch, total), "3d": (batch, seq, total)}[mask]


def feeds_for(model, scale=1.0):
    """Random feeds for every input of ``model``: masks with a fully masked entry, key lengths
    beyond the keys, cache_indirection with values out of any beam range (never read)."""
    feeds = {}
    for value in model.graph.input:
        shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
        if value.name == "m":
            total = shape[-1] if len(shape) > 1 else 8
            feeds["m"] = RNG.integers(-1, 3 if len(shape) > 1 else total + 2, shape).astype(np.int32)
            feeds["m"][0] = 0
        elif value.name == "ci":
            feeds["ci"] = RNG.integers(-7, 1000, shape).astype(np.int32)
        else:
            feeds[value.name] = (RNG.standard_normal(shape) * (scale if value.name in "qk" else 1.0)).astype(np.float32)
    return feeds


def rewrite_and_run(model, feeds):
    result = onnx_qrewrite.rewrite(model)
    assert {n.domain for n in result.model.graph.node} == {""}
    assert result.report.by_rule() == {RULE: 1}
    return result.model, run(model, feeds), run(result.model, feeds)


def assert_all_bitwise(got, want, what):
    for name in want:
        assert_bitwise_equal(got[name], want[name], f"{name}: {what}")


#: (batch, query sequence, keys, hidden, heads): cross attention has as many keys as the encoder's
#: sequence, fewer or more than the queries
BNSH_SHAPES = [(2, 4, 6, 32, 4), (1, 5, 3, 64, 2), (3, 2, 2, 128, 8), (2, 7, 100, 768, 12)]


@rule_marker("unfuse-multi-head-attention", "positive")
@pytest.mark.parametrize("mask", [None, "lengths", "raw", "3d"], ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("shape", BNSH_SHAPES, ids=str)
def test_4d_key_value_is_bit_exact(shape, bias, mask):
    """Cross attention with the keys in heads: no flash path, so bit for bit at sequence > 1,
    the presents copies of key and value, and the bias's K and V slices not read."""
    model = bnsh_model(*shape, mask=mask, bias=bias, outputs=("y", "present_key", "present_value"))
    _, want, got = rewrite_and_run(model, feeds_for(model))
    assert_all_bitwise(got, want, f"{shape}, bias {bias}, mask {mask}")


@rule_marker("unfuse-multi-head-attention", "positive")
@pytest.mark.parametrize(
    "options",
    [
        {"attrs": {"unidirectional": 1}, "mask": "lengths"},
        {"attrs": {"scale": 0.3, "mask_filter_value": -1.0}, "mask": "raw", "attention_bias": True},
        {"bias": True, "outputs": ("y", "", "present_value")},
        {"outputs": ("y", "present_key")},
    ],
    ids=["causal", "scale-filter-attention_bias", "present_value-only", "present_key-only"],
)
def test_4d_key_value_options(options):
    model = bnsh_model(2, 4, 6, 32, 4, **options)
    _, want, got = rewrite_and_run(model, feeds_for(model))
    assert_all_bitwise(got, want, str(options))


def _past_model(seq, mask=None):
    model = _with_past(
        bnsh_model(
            2, seq, 6, 32, 4, mask=mask, attrs={"unidirectional": 1}, outputs=("y", "present_key", "present_value")
        )
    )
    for value in model.graph.input:
        if value.name == "m":
            value.CopyFrom(INFO("m", TensorProto.INT32, [2, 9]))
    for value in model.graph.output[1:]:
        value.CopyFrom(INFO(value.name, TensorProto.FLOAT, [2, 4, 9, 8]))
    return model


@rule_marker("unfuse-multi-head-attention", "positive")
@pytest.mark.parametrize("mask", [None, "raw"], ids=str)
def test_4d_key_value_after_past_with_both_presents_is_bit_exact(mask):
    """As with 3-D key/value: the new keys go after past_key / past_value and the presents are
    that concatenation."""
    model = _past_model(4, mask)
    _, want, got = rewrite_and_run(model, feeds_for(model))
    assert_all_bitwise(got, want, f"past 3, mask {mask}")


@rule_marker("unfuse-multi-head-attention", "positive")
def test_4d_key_value_after_past_at_one_query_is_within_the_stated_bound():
    model = _past_model(1)
    feeds = feeds_for(model)
    _, want, got = rewrite_and_run(model, feeds)
    assert_bitwise_equal(got["present_key"], want["present_key"], "present_key")
    assert_bitwise_equal(got["present_value"], want["present_value"], "present_value")
    keys = {"k": want["present_key"], "v": want["present_value"]}
    assert np.abs(got["y"].astype(np.float64) - want["y"]).max() <= _stated_bound({**feeds, **keys}, 4)


def _bsd(bnsh):
    batch, heads, length, head = bnsh.shape
    return np.ascontiguousarray(bnsh.transpose(0, 2, 1, 3).reshape(batch, length, heads * head))


QK_CASES = {
    "3d kv, lengths": {"kv_seq": ("3d", 6), "mask": "lengths", "bias": True},
    "3d kv, causal, raw": {"kv_seq": ("3d", 4), "mask": "raw", "attrs": {"unidirectional": 1}},
    "3d kv, causal alone": {"kv_seq": ("3d", 5), "attrs": {"unidirectional": 1}},
    "3d kv, attention_bias, 3d mask": {"kv_seq": ("3d", 6), "mask": "3d", "attention_bias": True},
    "3d kv, nothing else": {"kv_seq": ("3d", 6)},
    "4d kv, causal, lengths": {"kv_seq": 6, "mask": "lengths", "attrs": {"unidirectional": 1}},
    "filter -1e38 with causal": {
        "kv_seq": ("3d", 4),
        "mask": "raw",
        "attrs": {"unidirectional": 1, "mask_filter_value": -1e38},
    },
}


@rule_marker("unfuse-multi-head-attention", "positive")
@pytest.mark.parametrize("scale", [1.0, 1e17], ids=["unit", "scores-beyond-2^103"])
@pytest.mark.parametrize("case", list(QK_CASES))
def test_the_qk_output_is_bit_exact(case, scale):
    """The scores the softmax reads, mask and attention_bias included; scores beyond 2^103 show
    that the causal mask is float32's lowest value added to them (-inf where that overflows)."""
    options = dict(QK_CASES[case])
    kv_seq = options.pop("kv_seq")
    model = bnsh_model(2, 4, kv_seq, 32, 4, outputs=("y", "", "", "qk"), **options)
    _, want, got = rewrite_and_run(model, feeds_for(model, scale=scale))
    if scale > 1:
        assert np.isneginf(want["qk"]).any() == bool(options.get("attrs", {}).get("unidirectional"))
    assert_all_bitwise(got, want, case)


def test_the_qk_output_with_past_and_presents_is_bit_exact():
    from test_unfuse_mha_state import mha_feeds, mha_model

    model = mha_model(
        2, 4, 4, 3, 32, 4, mask="raw", attrs={"unidirectional": 1}, outputs=("y", "present_key", "present_value", "qk")
    )
    _, want, got = rewrite_and_run(model, mha_feeds(2, 4, 4, 3, 32, 4, mask="raw"))
    assert_all_bitwise(got, want, "past 3")


def test_a_causal_mask_of_minus_infinity_would_be_caught_by_the_qk_output():
    """The rewrite's causal value, float32's lowest, set to -inf: the output stays bit-exact on
    finite scores, the qk output does not."""
    model = bnsh_model(2, 4, ("3d", 5), 32, 4, outputs=("y", "", "", "qk"), attrs={"unidirectional": 1})
    feeds = feeds_for(model)
    broken = onnx_qrewrite.rewrite(model).model
    lowest = numpy_helper.from_array(np.float32(np.finfo(np.float32).min)).raw_data
    init = next(i for i in broken.graph.initializer if i.raw_data == lowest)
    init.CopyFrom(numpy_helper.from_array(np.array(-np.inf, np.float32), init.name))
    want, got = run(model, feeds), run(broken, feeds)
    assert_bitwise_equal(got["y"], want["y"], "output")
    with pytest.raises(AssertionError):
        assert_bitwise_equal(got["qk"], want["qk"], "qk")


@rule_marker("unfuse-multi-head-attention", "positive")
@pytest.mark.parametrize("kv_seq", [("3d", 6), 6], ids=["3d-kv", "4d-kv"])
def test_cache_indirection_without_past_sequence_length_is_not_read(kv_seq):
    """Its values (here out of any beam range) change nothing; it only keeps the kernel off its
    flash path, so the output is bit-exact even without a mask."""
    model = bnsh_model(2, 4, kv_seq, 32, 4, bias=True, cache_indirection=True)
    feeds = feeds_for(model)
    _, want, got = rewrite_and_run(model, feeds)
    assert_all_bitwise(got, want, "cache_indirection")
    other = {**feeds, "ci": np.zeros_like(feeds["ci"])}
    assert_bitwise_equal(run(model, other)["y"], want["y"], "other cache_indirection values")


def _stated_bound(feeds, heads, qk=None):
    """The rule's bound, 2^-20·(1 + max|score|)·max|V|, for 4-D key/value without a mask; the
    qk output's scores within 2^-20·(1 + max|score|) (their rounding alone)."""
    q = feeds["q"].astype(np.float64)
    batch, seq, hidden = q.shape
    head = hidden // heads
    qh = q.reshape(batch, seq, heads, head).transpose(0, 2, 1, 3)
    scores = qh @ feeds["k"].astype(np.float64).transpose(0, 1, 3, 2) / np.sqrt(head)
    top = 1 + np.abs(scores).max()
    return 2.0**-20 * top * (1.0 if qk else np.abs(feeds["v"]).max())


@rule_marker("unfuse-multi-head-attention", "positive")
@pytest.mark.parametrize("scale", [0.1, 1.0, 10.0])
@pytest.mark.parametrize("shape", [(2, 1, 6, 32, 4), (1, 1, 100, 768, 12), (3, 1, 1, 64, 2)], ids=str)
def test_a_one_query_step_is_within_the_stated_bound(shape, scale):
    """A decoder's step against cached cross-attention keys: MLAS's GEMV rounds the scores
    differently; output and qk within the bound, the presents still copies."""
    model = bnsh_model(*shape, outputs=("y", "present_key", "present_value", "qk"))
    feeds = feeds_for(model, scale=scale)
    _, want, got = rewrite_and_run(model, feeds)
    for name in ("present_key", "present_value"):
        assert_bitwise_equal(got[name], want[name], name)
    assert np.abs(got["y"].astype(np.float64) - want["y"]).max() <= _stated_bound(feeds, shape[4])
    assert np.abs(got["qk"].astype(np.float64) - want["qk"]).max() <= _stated_bound(feeds, shape[4], qk=True)


def test_a_broken_one_query_step_exceeds_the_stated_bound():
    """A scale off by 0.1% is caught by the bound the one-query test asserts."""
    shape = (2, 1, 6, 32, 4)
    model = bnsh_model(*shape, outputs=("y", "", "", "qk"))
    feeds = feeds_for(model)
    broken = onnx_qrewrite.rewrite(model).model
    scale = next(n for n in broken.graph.node if n.op_type == "Mul" and "Scale" in n.name)
    init = next(i for i in broken.graph.initializer if i.name == scale.input[1])
    init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * np.float32(1.001), init.name))
    want, got = run(model, feeds), run(broken, feeds)
    assert np.abs(got["y"].astype(np.float64) - want["y"]).max() > _stated_bound(feeds, 4)
    assert np.abs(got["qk"].astype(np.float64) - want["qk"]).max() > _stated_bound(feeds, 4, qk=True)


def _packed(query_shape, key_shape=None):
    """MultiHeadAttention over a packed query (and key), value absent."""
    inputs = ["q"] + (["k"] if key_shape else [])
    values = [INFO("q", TensorProto.FLOAT, query_shape)] + (
        [INFO("k", TensorProto.FLOAT, key_shape)] if key_shape else []
    )
    node = helper.make_node("MultiHeadAttention", inputs, ["y"], name="mha", domain="com.microsoft", num_heads=4)
    graph = helper.make_graph([node], "g", values, [INFO("y", TensorProto.FLOAT, [2, 4, 32])])
    return helper.make_model(
        graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )


def _with_past(model):
    node = model.graph.node[0]
    node.input.extend(["", "", "", "pk", "pv"][len(node.input) - 3 :])
    model.graph.input.extend([INFO(n, TensorProto.FLOAT, [2, 4, 3, 8]) for n in ("pk", "pv")])
    return model


def _cache_indirection_of_rank(rank):
    model = bnsh_model(2, 4, ("3d", 6), 32, 4, cache_indirection=True)
    model.graph.input[-1].CopyFrom(INFO("ci", TensorProto.INT32, [2, 6][:rank] if rank < 3 else [2, 1, 6, 1]))
    return model


#: case -> (model, the reason given, whether onnxruntime's CPU kernel refuses it too)
NOT_LOWERED = {
    "packed qkv (B, L, N, 3, H)": (lambda: _packed([2, 4, 4, 3, 8]), "packed QKV (query of shape (B, L, N, 3, H))"),
    "packed qkv (B, S, 3D)": (lambda: _packed([2, 4, 96]), "packed QKV (no key or value)"),
    "packed kv (B, L, N, 2, H)": (lambda: _packed([2, 4, 32], [2, 6, 4, 2, 8]), "packed KV"),
    "4d key and value of other shapes": (
        lambda: bnsh_model(2, 4, 6, 32, 4, head_v=16),
        "differ in shape: the kernel refuses it",
    ),
    "cache_indirection of rank 2": (lambda: _cache_indirection_of_rank(2), "cache_indirection is 2-D"),
    "cache_indirection of rank 4": (lambda: _cache_indirection_of_rank(4), "cache_indirection is 4-D"),
}


@rule_marker("unfuse-multi-head-attention", "negative")
@pytest.mark.parametrize("case", list(NOT_LOWERED))
def test_forms_the_kernel_refuses_are_not_lowered(case):
    """Each is refused by name, and onnxruntime's CPU kernel refuses it too (nothing to measure)."""
    make, reason = NOT_LOWERED[case]
    model = make()
    with pytest.raises(onnx_qrewrite.LoweringError, match=re.escape(reason)):
        onnx_qrewrite.rewrite(model)
    feeds = feeds_for(model)
    with pytest.raises(Exception, match=r"not implemented|not support|same shape|expected to have"):
        run(model, feeds)


def test_4d_key_value_after_past_without_both_presents_is_not_lowered():
    """As with 3-D key/value, the kernel then attends to the new keys alone (measured, bit for bit)
    and the rule refuses the form, whose past would be an unread input."""
    model = _with_past(bnsh_model(2, 4, 6, 32, 4))
    with pytest.raises(onnx_qrewrite.LoweringError, match="without both present_key and present_value"):
        onnx_qrewrite.rewrite(model)
    feeds = feeds_for(model)
    alone = bnsh_model(2, 4, 6, 32, 4)
    assert_bitwise_equal(run(model, feeds)["y"], run(alone, {n: feeds[n] for n in "qkv"})["y"], "past ignored")


def cross_attention_with_past(batch=2, seq=3, enc=7, hidden=32, heads=4, seed=0):
    """One BART decoder cross-attention block with the encoder's keys and values cached, as
    transformers exports BartForConditionalGeneration's decoder with past (post-LayerNorm: the block's
    input normalized, Q projected and scaled, the cached (B, N, L, H) keys and values read directly,
    the output projection added back and normalized)."""
    rng = np.random.default_rng(seed)
    head = hidden // heads
    inits, nodes = [], []

    def c(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def n(op, ins, out, **kw):
        nodes.append(helper.make_node(op, ins, [out], name=out, **kw))
        return out

    def f(*shape):
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    ln0 = n(
        "LayerNormalization",
        ["x", c("g0", np.ones(hidden, np.float32)), c("b0", f(hidden))],
        "ln0",
        axis=-1,
        epsilon=1e-5,
    )
    q = n("MatMul", [ln0, c("wq", f(hidden, hidden))], "q")
    qa = n("Add", [c("bq", f(hidden)), q], "qa")
    qm = n("Mul", [qa, c("scale", np.array(head**-0.5, np.float32))], "qm")
    qr = n("Reshape", [qm, c("heads_shape", np.array([batch, seq, heads, head], np.int64))], "qr")
    qt = n("Transpose", [qr], "qt", perm=[0, 2, 1, 3])
    kt = n("Transpose", ["past_key"], "kt", perm=[0, 1, 3, 2])
    s = n("MatMul", [qt, kt], "scores")
    p = n("Softmax", [s], "probs", axis=-1)
    ctx = n("MatMul", [p, "past_value"], "ctx")
    ctx_t = n("Transpose", [ctx], "ctx_t", perm=[0, 2, 1, 3])
    ctx_r = n("Reshape", [ctx_t, c("merge_shape", np.array([batch, seq, hidden], np.int64))], "ctx_r")
    o = n("MatMul", [ctx_r, c("wo", f(hidden, hidden))], "o")
    oa = n("Add", [c("bo", f(hidden)), o], "oa")
    res = n("Add", [ln0, oa], "res")
    n("LayerNormalization", [res, c("g1", np.ones(hidden, np.float32)), c("b1", f(hidden))], "y", axis=-1, epsilon=1e-5)
    graph = helper.make_graph(
        nodes,
        "bart_cross_attention",
        [
            INFO("x", TensorProto.FLOAT, [batch, seq, hidden]),
            INFO("past_key", TensorProto.FLOAT, [batch, heads, enc, head]),
            INFO("past_value", TensorProto.FLOAT, [batch, heads, enc, head]),
        ],
        [INFO("y", TensorProto.FLOAT, [batch, seq, hidden])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_a_bart_decoder_cross_attention_fused_by_onnxruntime_transformers_runs_on_standard_ops(tmp_path):
    """onnxruntime.transformers' optimizer (model_type bart, use_multi_head_attention, as for
    Whisper/BART decoders with past) fuses the block into MultiHeadAttention with the cached 4-D keys
    and values and a bias whose K and V slices are zeros; the rewrite has only standard ops and
    verify passes, and it computes what the unfused export does."""
    import onnx
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    from onnx_qrewrite.verify import verify

    original = cross_attention_with_past()
    onnx.save(original, tmp_path / "bart.onnx")
    options = FusionOptions("bart")
    options.use_multi_head_attention = True
    optimized = optimize_model(
        str(tmp_path / "bart.onnx"),
        model_type="bart",
        num_heads=4,
        hidden_size=32,
        optimization_options=options,
        opt_level=0,
    )
    optimized.save_model_to_file(str(tmp_path / "fused.onnx"))
    fused = onnx.load(tmp_path / "fused.onnx")
    mha = [n for n in fused.graph.node if n.op_type == "MultiHeadAttention"]
    assert len(mha) == 1 and mha[0].input[1:3] == ["past_key", "past_value"]
    # The optimizer records no shape for the projection it feeds the node (as for BERT's mask index).
    with pytest.raises(onnx_qrewrite.LoweringError, match="run onnx shape inference on the model first"):
        onnx_qrewrite.rewrite(fused)
    fused = onnx.shape_inference.infer_shapes(fused)
    result = onnx_qrewrite.rewrite(fused)
    assert {n.domain for n in result.model.graph.node} == {""}
    assert result.report.by_rule()[RULE] == 1
    feeds = feeds_for(original)
    assert verify(fused, result.model, inputs=feeds).passed
    want = run(original, feeds)["y"].astype(np.float64)
    assert np.abs(run(result.model, feeds)["y"] - want).max() < 1e-5
