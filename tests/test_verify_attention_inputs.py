"""verify generates samples for attention nodes' length inputs by itself
(onnx_qrewrite/verify/attention_inputs.py): GroupQueryAttention's seqlens_k and
total_sequence_length, given directly or computed from an attention mask, and MultiHeadAttention's
past_sequence_length. Before, they took the integer default {0, 1} and onnxruntime refused the
original ("total_sequence_length must be positive, got 0"): verify needed --inputs.

Each case: the rewrite as made passes with no inputs given, one with its scale changed fails.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest
from _cli_helpers import cli_in_process
from onnx import TensorProto, helper, numpy_helper
from test_unfuse_attention import attention_model
from test_unfuse_gqa import CASES, gqa_model
from test_unfuse_gqa_qk import with_qk
from test_unfuse_mha_state import mha_model, shared_buffer_model

import onnx_qrewrite
from onnx_qrewrite.errors import UsageError
from onnx_qrewrite.verify import verify
from onnx_qrewrite.verify.inputs import GenerationOptions
from onnx_qrewrite.verify.samples import resolve_samples

TOKEN = CASES["token step, per-entry lengths"]  # batch 3, 1 query, past buffer 9, 4 heads, 2 kv heads, head 64


def token_model():
    batch, seq, past, heads, kv_heads, head, _, _ = TOKEN
    return gqa_model(batch, seq, past, heads, kv_heads, head)


def scale_changed(rewritten, factor=1.01):
    """The rewrite with its attention scale (the Mul of the scores by 1/sqrt(head)) off by ``factor``."""
    model = onnx.ModelProto()
    model.CopyFrom(rewritten)
    mul = next(n for n in model.graph.node if n.op_type == "Mul" and n.name.endswith("Scale"))
    scale = next(t for t in model.graph.initializer if t.name == mul.input[1])
    scale.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(scale) * np.float32(factor), scale.name))
    return model


def lengths(model, seed=0):
    """(seqlens_k + 1, total_sequence_length) of each generated sample of ``model``."""
    given = resolve_samples(None, model, GenerationOptions(seed=seed))
    return [(s.feeds["sl"].astype(int) + 1, int(s.feeds["tl"])) for s in given.samples]


def test_a_token_step_verifies_without_inputs_and_a_wrong_scale_fails(tmp_path):
    """The CLI with no --inputs: the correct rewrite passes, the scale changed by 1% fails (exit 1)."""
    model = token_model()
    rewritten = onnx_qrewrite.rewrite(model).model
    paths = {name: tmp_path / f"{name}.onnx" for name in ("original", "rewritten", "wrong")}
    for name, m in (("original", model), ("rewritten", rewritten), ("wrong", scale_changed(rewritten))):
        onnx.save(m, paths[name])
    passed = cli_in_process("verify", paths["original"], paths["rewritten"])
    assert passed.returncode == 0 and "PASSED" in passed.stdout, passed.stdout + passed.stderr
    failed = cli_in_process("verify", paths["original"], paths["wrong"])
    assert failed.returncode == 1 and "FAILED" in failed.stdout, failed.stdout + failed.stderr


def test_token_step_lengths_are_consistent_uneven_and_seeded():
    """total_sequence_length = past buffer + 1 query; every entry's length within [1, T] (its past
    fits the buffer); the first sample all T, every other one uneven (entry 0 at T, entry 1 below);
    the same values for the same seed, others for another."""
    batch, seq, past = TOKEN[:3]
    drawn = lengths(token_model())
    assert len(drawn) == 6  # 2 random samples and the battery
    for i, (per_entry, total) in enumerate(drawn):
        assert total == past + seq and per_entry.shape == (batch,)
        assert ((seq <= per_entry) & (per_entry <= total)).all()
        if i == 0:
            assert (per_entry == total).all()
        else:
            assert per_entry[0] == total and per_entry[1] < total
    again = lengths(token_model())
    assert all((a[0] == b[0]).all() for a, b in zip(drawn, again, strict=True))
    other = lengths(token_model(), seed=1)
    assert any((a[0] != b[0]).any() for a, b in zip(drawn, other, strict=True))


def test_a_padded_first_prompt_with_output_qk():
    """A first prompt (no past): T = S and padded entries (lengths below S); output_qk's keys the
    kernel leaves unwritten there are set aside, the rest compared: the rewrite passes, a wrong
    scale fails."""
    batch, seq, _, heads, kv_heads, head, _, _ = CASES["first prompt"]
    model = with_qk(gqa_model(batch, seq, None, heads, kv_heads, head), 1)
    drawn = lengths(model)
    assert all(total == seq and (per_entry >= 1).all() for per_entry, total in drawn)
    assert any((per_entry < seq).any() for per_entry, _ in drawn)
    rewritten = onnx_qrewrite.rewrite(model).model
    report = verify(model, rewritten)
    assert report.passed, report.to_table()
    assert next(o for o in report.outputs if o.name == "qk").undefined > 0
    assert not verify(model, scale_changed(rewritten), localize_failures=False).passed


def symbolic_masked_model():
    """A decoder's GroupQueryAttention as onnxruntime-genai exports it: symbolic batch, sequence,
    past and total dimensions; seqlens_k = ReduceSum(attention_mask, 1) - 1 and
    total_sequence_length = Shape(attention_mask)[1], each Cast to int32."""
    model = gqa_model(1, 1, 1, 4, 2, 16)
    dims = {"q": ["batch", "seq", 64], "k": ["batch", "seq", 32], "v": ["batch", "seq", 32]}
    dims |= {"pk": ["batch", 2, "past", 16], "pv": ["batch", 2, "past", 16]}
    graph = model.graph
    kept = [
        helper.make_tensor_value_info(i.name, TensorProto.FLOAT, dims[i.name]) for i in graph.input if i.name in dims
    ]
    mask = helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total"])
    del graph.input[:]
    graph.input.extend([*kept, mask])
    graph.output[0].CopyFrom(helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 64]))
    graph.initializer.extend(
        [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in (("one", 1), ("axis1", [1]), ("at1", 1))]
    )
    nodes = [
        helper.make_node("ReduceSum", ["attention_mask", "axis1"], ["count"], keepdims=0),
        helper.make_node("Sub", ["count", "one"], ["sl64"]),
        helper.make_node("Cast", ["sl64"], ["sl"], to=TensorProto.INT32),
        helper.make_node("Shape", ["attention_mask"], ["mask_shape"]),
        helper.make_node("Gather", ["mask_shape", "at1"], ["tl64"], axis=0),
        helper.make_node("Cast", ["tl64"], ["tl"], to=TensorProto.INT32),
    ]
    for node in reversed(nodes):
        graph.node.insert(0, node)
    return model


def test_lengths_computed_from_an_attention_mask():
    """The mask is generated (batch, past + seq), each entry's length in ones then zeros: with the
    dimensions at their default 1 (a step of one query after one past position) and with
    ``--input-shape batch=3 past=6`` (uneven entries); the rewrite passes, a wrong scale fails."""
    model = symbolic_masked_model()
    rewritten = onnx_qrewrite.rewrite(model).model
    for dims in ({}, {"batch": 3, "past": 6}):
        given = resolve_samples(None, model, GenerationOptions(dims=dims)).samples
        masks = [s.feeds["attention_mask"] for s in given]
        total = dims.get("past", 1) + 1
        assert all(m.shape == (dims.get("batch", 1), total) and m.dtype == np.int64 for m in masks)
        counts = [m.sum(axis=1) for m in masks]
        assert all((np.sort(m, axis=1)[:, ::-1] == m).all() for m in masks)  # ones, then zeros
        assert (counts[0] == total).all() and all((c >= 1).all() and (c <= total).all() for c in counts)
        report = verify(model, rewritten, input_dims=dims)
        assert report.passed, report.to_table()
        assert not verify(model, scale_changed(rewritten), input_dims=dims, localize_failures=False).passed
    assert any((c < total).any() for c in counts[1:])


def test_past_sequence_length_leaves_room_for_the_new_keys():
    """MultiHeadAttention's past_sequence_length over a buffer of 10 with 1 new key: within [0, 9],
    9 (the buffer's end) on the first sample; the rewrite passes, a wrong scale fails."""
    model = shared_buffer_model(2, 1, 1, 10, 64, 2)
    given = resolve_samples(None, model, GenerationOptions()).samples
    values = [int(s.feeds["psl"][0]) for s in given]
    assert values[0] == 9 and all(0 <= v <= 9 for v in values) and len(set(values)) > 1
    rewritten = onnx_qrewrite.rewrite(model).model
    report = verify(model, rewritten)
    assert report.passed, report.to_table()
    assert report.settings.value_ranges["psl"].high == 9


def test_lengths_computed_otherwise_are_named_in_the_log(caplog):
    """total_sequence_length computed by an op this does not follow: the node is named in a warning
    and its inputs take the defaults, as before."""
    model = token_model()
    graph = model.graph
    graph.initializer.append(numpy_helper.from_array(np.array(0, np.int32), "zero"))
    graph.node.insert(0, helper.make_node("Add", ["tl_in", "zero"], ["tl"]))
    next(i for i in graph.input if i.name == "tl").name = "tl_in"
    with caplog.at_level(logging.WARNING, logger="onnx_qrewrite.verify.attention_inputs"):
        given = resolve_samples(None, model, GenerationOptions()).samples
    assert "its seqlens_k or total_sequence_length is computed otherwise" in caplog.text
    assert all(int(s.feeds["tl_in"]) in (0, 1) for s in given)


def test_one_dimensional_masks_hold_key_lengths():
    """A 1-D mask holds key lengths, which {0, 1} kept at most one key long: MultiHeadAttention's
    (B) over past 3 + 4 new keys and Attention's (2B: ends, then starts) over 8 keys take lengths in
    [1, T], all T on the first sample, starts below the ends; both rewrites pass."""
    mha = mha_model(2, 4, 4, 3, 32, 4, mask="lengths")
    attention = attention_model(3, 8, 32, [32, 32, 32], 4, (6,), {"unidirectional": 1})
    for model, total in ((mha, 7), (attention, 8)):
        given = resolve_samples(None, model, GenerationOptions()).samples
        masks = [s.feeds["m"] for s in given]
        batch = model.graph.input[0].type.tensor_type.shape.dim[0].dim_value
        ends, starts = [m[:batch] for m in masks], [m[batch:] for m in masks]
        assert (ends[0] == total).all() and all(((e >= 1) & (e <= total)).all() for e in ends)
        assert any((e < total).any() for e in ends[1:])
        assert all((s < e).all() for s, e in zip(starts, ends, strict=True) if s.size)
        report = verify(model, onnx_qrewrite.rewrite(model).model)
        assert report.passed, report.to_table()


NEW_KEYS = 4  # the MultiHeadAttention case's new keys, after 3 past ones


def key_length_mask_broken(rewritten, how):
    """The rewrite of a 1-D key-length mask with one bug: the masked scores left as they are
    ("mask ignored"), one key more than the length kept ("one key more": Less(position, length) made
    LessOrEqual), the lengths cut at the new keys' count as if there were no past ("past
    forgotten"), or the attention scale 1% off."""
    if how == "scale x1.01":
        return scale_changed(rewritten)
    model = onnx.ModelProto()
    model.CopyFrom(rewritten)
    if how == "past forgotten":  # Min(lengths, new keys) after the mask's Cast
        cast = next(n for n in model.graph.node if n.name == "y/Cast")
        model.graph.initializer.append(numpy_helper.from_array(np.array(NEW_KEYS, np.int64), "new_keys"))
        at = list(model.graph.node).index(cast) + 1
        model.graph.node.insert(at, helper.make_node("Min", ["uncut", "new_keys"], [cast.output[0]], name="cut"))
        cast.output[0] = "uncut"
    elif how == "mask ignored":
        where = next(n for n in model.graph.node if n.name == "y/Mask")
        where.input[2] = where.input[1]  # the masked-out value made the kept one (0)
    else:
        next(n for n in model.graph.node if n.name == "y/Less").op_type = "LessOrEqual"
    return model


@pytest.mark.parametrize("which", ["MultiHeadAttention (B)", "Attention (2B)"])
def test_a_wrong_rewrite_of_a_one_dimensional_mask_fails_without_inputs(tmp_path, which):
    """The command line with no --inputs on a 1-D key-length mask: the correct rewrite passes (exit
    0), each broken one fails (exit 1). "past forgotten" is what the generated lengths (all T on the
    first sample, uneven on the others) catch and the old integer default {0, 1} cannot: given that
    range by hand, the same break passes."""
    breaks = ["mask ignored", "one key more", "scale x1.01"]
    if which.startswith("Multi"):
        model = mha_model(2, 4, NEW_KEYS, 3, 32, 4, mask="lengths")
        breaks.append("past forgotten")
    else:
        model = attention_model(3, 8, 32, [32, 32, 32], 4, (6,), {"unidirectional": 1})
    rewritten = onnx_qrewrite.rewrite(model).model
    original = tmp_path / "original.onnx"
    onnx.save(model, original)
    paths = {}
    for how in ["correct", *breaks]:
        paths[how] = tmp_path / f"{how.replace(' ', '_')}.onnx"
        onnx.save(rewritten if how == "correct" else key_length_mask_broken(rewritten, how), paths[how])
        result = cli_in_process("verify", original, paths[how], "--no-localize")
        verdict = (0, "PASSED") if how == "correct" else (1, "FAILED")
        assert result.returncode == verdict[0] and verdict[1] in result.stdout, (how, result.stdout + result.stderr)
    if "past forgotten" in paths:
        old_default = cli_in_process(
            "verify", original, paths["past forgotten"], "--no-localize", "--val-range", "m:[0,1]"
        )
        assert old_default.returncode == 0 and "PASSED" in old_default.stdout, old_default.stdout + old_default.stderr


def test_a_named_range_wins_and_an_input_without_a_shape_is_named():
    """--val-range NAME:[LO,HI] keeps its range for a length input (the user's call), --int-range
    does not reach them; a query that declares no shape is named by the usual UsageError (the
    lengths' reader steps aside for it, with a warning)."""
    ranged = resolve_samples(None, token_model(), GenerationOptions(value_ranges={"tl": (3, 3)}, int_range=(0, 1)))
    assert all(int(s.feeds["tl"]) == 3 for s in ranged.samples)
    assert ranged.ranges["sl"].why.startswith("seqlens_k") and ranged.ranges["tl"].why == "--val-range tl"
    model = token_model()
    model.graph.input[0].type.tensor_type.ClearField("shape")
    with pytest.raises(UsageError, match="input 'q' declares no shape"):
        resolve_samples(None, model, GenerationOptions())
