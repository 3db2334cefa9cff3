"""com.microsoft RotaryEmbedding -> standard ops, bit for bit against onnxruntime 1.31.1's CPU kernel.

The kernel (MLAS's AVX2 rotary kernel on x86) rounds ``x2·sin`` / ``x2·cos`` to float32 and fuses the
``x1`` product into one rounding (fused multiply-add); the rewrite emulates that in float64 with a
correction where float64 -> float32 rounds twice. The battery covers both layouts, interleaved and
not, partial rotary dims, position ids as a start and per token, edge values, and ties built so that
plain float64 rounding gives the wrong neighbour (asserted, so the correction is what is tested).
"""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest
from _verify_helpers import node_row
from conftest import assert_bitwise_equal, rule_marker, run
from onnx import TensorProto, helper

import onnx_qrewrite
from onnx_qrewrite.verify import element_bounds, verify

RNG = np.random.default_rng(11)
RULE = "unfuse-rotary-embedding"


def rotary_model(shape, width, max_positions, attrs=None, position_shape=(1,), dtype=TensorProto.FLOAT, opset=17):
    node = helper.make_node("RotaryEmbedding", ["x", "p", "c", "s"], ["y"], domain="com.microsoft", **(attrs or {}))
    values = [
        helper.make_tensor_value_info("x", dtype, list(shape)),
        helper.make_tensor_value_info("p", TensorProto.INT64, list(position_shape)),
        helper.make_tensor_value_info("c", dtype, [max_positions, width]),
        helper.make_tensor_value_info("s", dtype, [max_positions, width]),
    ]
    graph = helper.make_graph([node], "g", values, [helper.make_tensor_value_info("y", dtype, list(shape))])
    return helper.make_model(
        graph, ir_version=8, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)]
    )


def caches(max_positions, width):
    angles = RNG.uniform(0, 2 * np.pi, (max_positions, width))
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def shapes(rank, batch, seq, heads, head):
    return (batch, seq, heads * head) if rank == 3 else (batch, heads, seq, head)


def check_bit_exact(model, feeds, what):
    result = onnx_qrewrite.rewrite(model)
    assert result.report.by_rule() == {RULE: 1}
    assert {n.domain for n in result.model.graph.node} == {""}
    assert [r.exactness for r in result.report.rewrites] == ["exact"]
    assert_bitwise_equal(run(result.model, feeds)["y"], run(model, feeds)["y"], what)
    return result


# head size, rotary_embedding_dim (0: the whole head), interleaved
GEOMETRIES = [(16, 0, 0), (22, 0, 0), (64, 24, 0), (6, 0, 0), (32, 0, 1), (64, 32, 1), (48, 16, 1)]


@rule_marker("unfuse-rotary-embedding", "positive")
@pytest.mark.parametrize("start", [True, False], ids=["start", "per-token"])
@pytest.mark.parametrize("rank", [3, 4])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=str)
def test_rotary_embedding_is_bit_exact(geometry, rank, start):
    head, rotary, interleaved = geometry
    batch, seq, heads, max_positions = 2, 5, 3, 12
    width = (rotary or head) // 2
    attrs = {"interleaved": interleaved}
    if rotary:
        attrs |= {"rotary_embedding_dim": rotary, "num_heads": heads}
    shape = shapes(rank, batch, seq, heads, head)
    positions = np.array([4], np.int64) if start else RNG.integers(0, max_positions, (batch, seq)).astype(np.int64)
    model = rotary_model(shape, width, max_positions, attrs, positions.shape)
    cos, sin = caches(max_positions, width)
    feeds = {"x": RNG.standard_normal(shape).astype(np.float32), "p": positions, "c": cos, "s": sin}
    check_bit_exact(model, feeds, f"{geometry} rank {rank} start {start}")


EDGES = np.array(
    [0.0, -0.0, 1e-45, -1e-40, 1e-38, 1.0, -3.0, 1e30, -1e30, 3e38, np.inf, -np.inf, np.nan, 0.5], np.float32
)


@rule_marker("unfuse-rotary-embedding", "positive")
@pytest.mark.parametrize("interleaved", [0, 1])
def test_rotary_embedding_edge_values(interleaved):
    """Zeros of both signs, subnormals, overflow, ±inf and NaN in the input and both caches."""
    batch, seq, heads, head, max_positions = 3, 4, 2, 16, 6
    shape = (batch, seq, heads * head)
    model = rotary_model(shape, head // 2, max_positions, {"interleaved": interleaved}, (batch, seq))
    feeds = {
        "x": RNG.choice(EDGES, shape),
        "p": RNG.integers(0, max_positions, (batch, seq)).astype(np.int64),
        "c": RNG.choice(EDGES, (max_positions, head // 2)),
        "s": RNG.choice(EDGES, (max_positions, head // 2)),
    }
    check_bit_exact(model, feeds, f"edge values, interleaved {interleaved}")


def _ties():
    """Values whose x1 product is a float32 tie and whose rounded x2 product is tiny, so that the
    float64 sum rounds back onto the tie and float64 -> float32 (ties to even) can pick the wrong
    neighbour: 3·(1 + 2^-23) and (1 + 5·2^-23)·3 are ties; ±2^-30·2^-30 is below float64's half ulp."""
    tie_factors = np.array([3.0, 1 + 2.0**-23, 1 + 5 * 2.0**-23, -3.0], np.float32)
    tiny = np.array([2.0**-30, -(2.0**-30)], np.float32)
    return tie_factors, tiny


@rule_marker("unfuse-rotary-embedding", "positive")
def test_rotary_embedding_ties_where_plain_float64_rounding_fails():
    factors, tiny = _ties()
    batch, seq, heads, head, max_positions = 1, 16, 4, 8, 16
    shape = (batch, seq, heads * head)
    half = head // 2
    x = np.empty((batch, seq, heads, head), np.float32)
    x[..., :half] = RNG.choice(factors, (batch, seq, heads, half))
    x[..., half:] = RNG.choice(tiny, (batch, seq, heads, half))
    values = np.concatenate([factors, tiny])
    cos, sin = (RNG.choice(values, (max_positions, half)) for _ in range(2))
    positions = np.arange(seq, dtype=np.int64).reshape(1, seq)
    model = rotary_model(shape, half, max_positions, {}, positions.shape)
    feeds = {"x": x.reshape(shape), "p": positions, "c": cos, "s": sin}
    want = run(model, feeds)["y"].reshape(batch, seq, heads, head)
    # Plain float64 (no tie correction) gives another float32 at some elements: the battery has ties.
    x1, x2 = x[..., :half].astype(np.float64), x[..., half:]
    c, s = cos[positions][:, :, None, :].astype(np.float64), sin[positions][:, :, None, :].astype(np.float64)
    plain = np.concatenate(
        [
            (x1 * c - (x2 * s.astype(np.float32))).astype(np.float32),
            (x1 * s + (x2 * c.astype(np.float32))).astype(np.float32),
        ],
        axis=-1,
    )
    assert (plain.view(np.uint32) != want.view(np.uint32)).any()
    check_bit_exact(model, feeds, "ties")


@rule_marker("unfuse-rotary-embedding", "positive")
def test_rotary_embedding_at_its_lowest_opset():
    """Opset 11: Unsqueeze's axes are an attribute there."""
    shape = (2, 3, 32)
    model = rotary_model(shape, 8, 8, {"num_heads": 2}, (2, 3), opset=11)
    cos, sin = caches(8, 8)
    feeds = {"x": RNG.standard_normal(shape).astype(np.float32), "p": RNG.integers(0, 8, (2, 3)), "c": cos, "s": sin}
    result = check_bit_exact(model, feeds, "opset 11")
    assert result.model.opset_import[0].version == 11


def _refused(**kw):
    defaults = {"shape": (1, 4, 32), "width": 8, "max_positions": 8, "attrs": {"num_heads": 2}}
    return lambda: rotary_model(**(defaults | kw))


NOT_LOWERED = {
    "narrow rotary dim, wide cache": (
        _refused(attrs={"rotary_embedding_dim": 8, "num_heads": 2}),
        "rotary dim 8 with a cache of width 8",
    ),
    "double": (_refused(dtype=TensorProto.DOUBLE), "float32 or float16, is lowered"),
    "heads do not tile": (_refused(attrs={"num_heads": 3}), "3 heads of 16 values do not tile"),
    "position ids of rank 3": (_refused(position_shape=(1, 4, 1)), "position_ids of shape (1, 4, 1)"),
}


@rule_marker("unfuse-rotary-embedding", "negative")
@pytest.mark.parametrize("case", list(NOT_LOWERED))
def test_rotary_embedding_forms_not_lowered_say_why(case):
    make, reason = NOT_LOWERED[case]
    with pytest.raises(onnx_qrewrite.LoweringError, match=re.escape(reason)):
        onnx_qrewrite.rewrite(make())


@rule_marker("unfuse-rotary-embedding", "negative")
def test_rotary_embedding_needs_recorded_shapes():
    model = rotary_model(("batch", "seq", "hidden"), 8, 8, {"num_heads": 2})
    with pytest.raises(
        onnx_qrewrite.LoweringError, match=re.escape("the hidden size (or heads and head size) of the input")
    ):
        onnx_qrewrite.rewrite(model)


def _nan(payload, negative=False):
    return np.array([(0xFFC00000 if negative else 0x7FC00000) | payload], np.uint32).view(np.float32)[0]


@rule_marker("unfuse-rotary-embedding", "positive")
def test_rotary_embedding_nan_payloads_follow_the_kernel():
    """Distinct NaN payloads in x1, cos, x2, sin (with inf and 0, whose product is the default NaN):
    the result is the first NaN operand in x86's order, as the fused multiply-add gives it."""
    options = [[1.0, _nan(1), np.inf, 0.0], [1.0, _nan(2, True), np.inf, 0.0], [1.0, _nan(3), np.inf, 0.0]]
    options.append([1.0, _nan(4, True), 0.0, np.inf])
    combos = np.array(np.meshgrid(*options, indexing="ij"), np.float32).reshape(4, -1).T
    n = len(combos)
    model = rotary_model((1, n, 2), 1, n, {}, (1, n))
    feeds = {
        "x": combos[:, [0, 2]].reshape(1, n, 2),
        "p": np.arange(n, dtype=np.int64).reshape(1, n),
        "c": combos[:, [1]],
        "s": combos[:, [3]],
    }
    assert np.isnan(run(model, feeds)["y"]).sum() > n
    check_bit_exact(model, feeds, "NaN payloads")


@rule_marker("unfuse-rotary-embedding", "positive")
@pytest.mark.parametrize("edges", [False, True], ids=["normal", "edge-values"])
@pytest.mark.parametrize("geometry", [(16, 0, 0), (22, 0, 0), (64, 24, 1), (22, 0, 1)], ids=str)
def test_rotary_embedding_float16(geometry, edges):
    """float16: the kernel rotates in float32 (products of float16 values are exact there) and
    rounds to float16; interleaved tails included (their two roundings agree on exact products)."""
    head, rotary, interleaved = geometry
    batch, seq, heads, max_positions = 2, 5, 3, 12
    width = (rotary or head) // 2
    attrs = {"interleaved": interleaved} | ({"rotary_embedding_dim": rotary, "num_heads": heads} if rotary else {})
    shape = (batch, seq, heads * head)
    model = rotary_model(shape, width, max_positions, attrs, (batch, seq), dtype=TensorProto.FLOAT16)
    if edges:
        values = np.array([0.0, -0.0, 6e-8, -1e-5, 1.0, -3.0, 65504, -300.0, np.inf, -np.inf, np.nan], np.float16)
        x, cos, sin = (RNG.choice(values, size) for size in (shape, (max_positions, width), (max_positions, width)))
    else:
        x = (RNG.standard_normal(shape) * 10).astype(np.float16)
        cos, sin = (c.astype(np.float16) for c in caches(max_positions, width))
    positions = RNG.integers(0, max_positions, (batch, seq)).astype(np.int64)
    check_bit_exact(model, {"x": x, "p": positions, "c": cos, "s": sin}, f"float16 {geometry}")


# --- float32 interleaved with a rotary dim not a multiple of 16: bounded in the kernel's tail ------

TAIL = "unfuse-rotary-embedding-interleaved-tail"


def _tail_case(head, rotary, rank, start, heads=2, batch=2, seq=5, max_positions=8):
    attrs = {"interleaved": 1, "num_heads": heads} | ({"rotary_embedding_dim": rotary} if rotary != head else {})
    shape = shapes(rank, batch, seq, heads, head)
    positions = np.array([2], np.int64) if start else RNG.integers(0, max_positions, (batch, seq)).astype(np.int64)
    model = rotary_model(shape, rotary // 2, max_positions, attrs, positions.shape)
    model.graph.node[0].name = "rope"
    cos, sin = caches(max_positions, rotary // 2)
    feeds = {"x": (RNG.standard_normal(shape) * 4).astype(np.float32), "p": positions, "c": cos, "s": sin}
    return model, feeds


TAIL_FORMULA = "rotary-interleaved-tail"


def _tail_bound(model, feeds, want, got):
    return element_bounds.element_bound(TAIL_FORMULA, model.graph.node[0], feeds, want, got)


@rule_marker("unfuse-rotary-embedding-interleaved-tail", "positive")
@pytest.mark.parametrize(
    "head, rotary, rank, start", [(24, 24, 3, True), (8, 8, 4, False), (32, 20, 4, True), (40, 40, 3, False)], ids=str
)
def test_interleaved_tail_is_within_its_per_element_bound(head, rotary, rank, start):
    """Bit-exact up to the last whole block of 16 values and after the rotary dim; in the kernel's
    scalar tail (its first pair fused, the others with both products rounded, measured) within
    4·u·(|x1·c| + |x2·s|) + 2^-148, which verify checks per element at the node."""
    model, feeds = _tail_case(head, rotary, rank, start)
    result = onnx_qrewrite.rewrite(model)
    assert result.report.by_rule() == {TAIL: 1}
    assert [r.exactness for r in result.report.rewrites] == ["bounded"]
    want, got = run(model, feeds)["y"], run(result.model, feeds)["y"]
    bound = _tail_bound(model, feeds, want, got)
    diff = np.abs(want.astype(np.float64) - got.astype(np.float64))
    assert np.all(diff <= bound), np.max(diff - bound)
    assert_bitwise_equal(got[bound == 0], want[bound == 0], "outside the tail")
    if rotary > 16 or rotary == 8:  # a tail of more than one pair: the kernel's plain rounding shows
        assert np.count_nonzero(diff) > 0
    row = node_row(verify(model, result.model, inputs=feeds), "rope")
    assert row.passed and "per element (rotary-interleaved-tail)" in row.tolerance_text, row


@rule_marker("unfuse-rotary-embedding-interleaved-tail", "positive")
def test_interleaved_tail_edge_values():
    """Zeros, subnormals, ±inf and NaN in the tail: equal where a product is not finite, within
    the bound elsewhere (values that overflow float32 products are left out: only equal values pass
    there, which the kernel's two roundings need not give)."""
    model, feeds = _tail_case(24, 24, 3, False)
    small = EDGES[~np.isfinite(EDGES) | (np.abs(EDGES) < 1e19)]  # products of finite values stay finite
    feeds |= {k: RNG.choice(small, feeds[k].shape) for k in ("x", "c", "s")}
    result = onnx_qrewrite.rewrite(model)
    want, got = run(model, feeds)["y"], run(result.model, feeds)["y"]
    with np.errstate(invalid="ignore"):  # inf - inf: NaN, which the bit comparison covers
        diff = np.abs(want.astype(np.float64) - got.astype(np.float64))
        same = (want.view(np.uint32) == got.view(np.uint32)) | (diff <= _tail_bound(model, feeds, want, got))
    assert np.all(same) and np.isnan(want).any() and np.isinf(want).any()
    assert verify(model, result.model, inputs=feeds).passed


def _swap_caches(rewritten):
    """A broken rewrite: the sin rows read where the cos rows belong and back."""
    broken = copy.deepcopy(rewritten)
    for node in broken.graph.node:
        if node.op_type == "Gather" and node.input[0] in ("c", "s"):
            node.input[0] = "s" if node.input[0] == "c" else "c"
    return broken


@rule_marker("unfuse-rotary-embedding-interleaved-tail", "positive")
@pytest.mark.parametrize("head, rotary", [(24, 24), (8, 8)], ids=str)
def test_interleaved_tail_breaks_are_caught_at_the_node(head, rotary):
    """Caught in the blocks (bound 0) and, with no whole block (rotary 8), in the tail alone."""
    model, feeds = _tail_case(head, rotary, 3, False)
    rewritten = onnx_qrewrite.rewrite(model).model
    row = node_row(verify(model, _swap_caches(rewritten), inputs=feeds), "rope")
    assert not row.passed and row.mismatches > 0, row


@rule_marker("unfuse-rotary-embedding-interleaved-tail", "negative")
@rule_marker("unfuse-rotary-embedding", "negative")
def test_each_rotary_rule_leaves_the_other_its_nodes():
    """The exact rule refuses a float32 interleaved tail, naming it; the bounded one takes only
    that (a multiple of 16, or float16, whose products are exact in float32: the exact rule)."""
    tail, _ = _tail_case(24, 24, 3, True)
    with pytest.raises(onnx_qrewrite.LoweringError, match=re.escape("interleaved with rotary dim 24")):
        onnx_qrewrite.rewrite(tail, only=[RULE])
    whole, _ = _tail_case(32, 32, 3, True)
    with pytest.raises(onnx_qrewrite.LoweringError, match="no float32 interleaved tail: the exact rule applies"):
        onnx_qrewrite.rewrite(whole, only=[TAIL])
    half = rotary_model((2, 5, 48), 12, 8, {"interleaved": 1, "num_heads": 2}, (1,), dtype=TensorProto.FLOAT16)
    assert onnx_qrewrite.rewrite(half).report.by_rule() == {RULE: 1}
