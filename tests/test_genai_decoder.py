"""A decoder made by onnxruntime-genai's model builder itself (tests/data/genai, made by
tools/make_genai_decoder.py): rewritten to standard ops only, and verified with no --inputs.

The builder computes GroupQueryAttention's seqlens_k and total_sequence_length from the
attention mask, and names the head size of its past key/value inputs ``kv_cache_dim``: verify
generates the mask (every entry full on the first sample, uneven on the others) and gives that
dimension the head size (verify/attention_inputs.py), where before it took 1 and onnxruntime
refused the original ("past_key dimension 3 should match the packed KV head dimension").
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from _cli_helpers import cli_in_process
from conftest import DATA
from onnx import numpy_helper

import onnx_qrewrite
from onnx_qrewrite.verify.inputs import GenerationOptions
from onnx_qrewrite.verify.samples import resolve_samples

FOLDER = DATA / "genai"
FP32 = FOLDER / "genai_llama_fp32.onnx"
INT4 = FOLDER / "genai_llama_int4.onnx"
#: A first prompt of 16 tokens in a batch of 2 (padded entries), and a step after 5 past tokens.
PROMPT = (
    "--input-shape",
    "batch_size=2",
    "--input-shape",
    "sequence_length=16",
    "--input-shape",
    "past_sequence_length=0",
)
STEP = ("--input-shape", "batch_size=3", "--input-shape", "past_sequence_length=5")


@pytest.fixture(scope="module")
def rewritten_fp32(tmp_path_factory) -> dict[str, object]:
    model = onnx.load(FP32)
    result = onnx_qrewrite.rewrite(model)
    folder = tmp_path_factory.mktemp("genai")
    paths = {"rewritten": folder / "rewritten.onnx"}
    onnx.save(result.model, paths["rewritten"])
    for how in ("scale x1.01", "padding ignored"):
        paths[how] = folder / f"{how.replace(' ', '_')}.onnx"
        onnx.save(_broken(result.model, how), paths[how])
    return {"result": result, "paths": paths}


def _broken(rewritten: onnx.ModelProto, how: str) -> onnx.ModelProto:
    """The rewrite with one bug: its attention scale 1% off, or every entry's length taken as the
    mask's width (seqlens_k = total_sequence_length - 1: padding attended, as a rewrite that
    ignored the per-entry lengths would)."""
    model = onnx.ModelProto()
    model.CopyFrom(rewritten)
    if how == "scale x1.01":
        for mul in (n for n in model.graph.node if n.op_type == "Mul" and n.name.endswith("GroupQueryAttention/Scale")):
            scale = next(t for t in model.graph.initializer if t.name == mul.input[1])
            scale.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(scale) * np.float32(1.01), scale.name))
        return model
    reduce = next(n for n in model.graph.node if n.op_type == "ReduceSum")
    width = next(n for n in model.graph.node if n.op_type == "Gather" and n.input[0].endswith("Shape/output_0"))
    sub = next(n for n in model.graph.node if n.op_type == "Sub" and n.input[0] == reduce.output[0])
    sub.input[0] = width.output[0]
    return model


def test_the_fixture_is_what_the_builder_writes():
    """The mask chain verify follows, GroupQueryAttention with packed QKV and rotary, the fused
    normalizations; MatMulNBits at int4; the head size named kv_cache_dim."""
    for path, matmul in ((FP32, ("", "MatMul")), (INT4, ("com.microsoft", "MatMulNBits"))):
        model = onnx.load(path)
        ops = Counter((n.domain, n.op_type) for n in model.graph.node)
        assert ops[("com.microsoft", "GroupQueryAttention")] == 2 and ops[matmul] == 11, ops
        assert ops[("com.microsoft", "SkipSimplifiedLayerNormalization")] == 4
        assert {("", "ReduceSum"), ("", "Sub"), ("", "Shape"), ("", "Gather")} <= set(ops)
        gqa = next(n for n in model.graph.node if n.op_type == "GroupQueryAttention")
        assert not gqa.input[1] and {a.name: a.i for a in gqa.attribute}["do_rotary"] == 1
        past = next(i for i in model.graph.input if i.name == "past_key_values.0.key")
        assert [d.dim_param or d.dim_value for d in past.type.tensor_type.shape.dim][1:] == [
            2,
            "past_sequence_length",
            "kv_cache_dim",
        ]


def test_the_head_size_and_the_mask_are_generated():
    """kv_cache_dim is the head size, 16; the mask's lengths are uneven after the first sample."""
    given = resolve_samples(None, onnx.load(FP32), GenerationOptions(dims={"batch_size": 3, "past_sequence_length": 5}))
    assert given.generation is not None and given.generation.dims["kv_cache_dim"] == 16
    masks = [s.feeds["attention_mask"] for s in given.samples]
    assert all(m.shape == (3, 6) for m in masks) and (masks[0] == 1).all()
    assert all((m.sum(axis=1) >= 1).all() for m in masks) and any((m.sum(axis=1) < 6).any() for m in masks[1:])
    assert all(s.feeds["past_key_values.1.value"].shape == (3, 2, 5, 16) for s in given.samples)
    mine = resolve_samples(None, onnx.load(FP32), GenerationOptions(dims={"kv_cache_dim": 8}))
    assert mine.generation is not None and mine.generation.dims["kv_cache_dim"] == 8  # --input-shape wins


def test_the_rewrite_is_standard_onnx_and_verifies_without_inputs(rewritten_fp32):
    result, paths = rewritten_fp32["result"], rewritten_fp32["paths"]
    assert {n.domain for n in result.model.graph.node} == {""}
    assert result.report.by_rule() == {
        "unfuse-group-query-attention": 2,
        "unfuse-skip-simplified-layer-norm": 4,
        "unfuse-simplified-layer-norm-decomposed": 1,
    }
    for extra in ((), STEP, PROMPT):
        passed = cli_in_process("verify", FP32, paths["rewritten"], *extra)
        assert passed.returncode == 0 and "PASSED" in passed.stdout, (extra, passed.stdout + passed.stderr)


@pytest.mark.parametrize("how", ["scale x1.01", "padding ignored"])
def test_a_broken_rewrite_fails_without_inputs(rewritten_fp32, how):
    """Both fail at the default shapes (a step after one past token: the later samples' single entry
    shorter than the mask) and at a step of a batch of 3."""
    for extra in ((), STEP):
        failed = cli_in_process("verify", FP32, rewritten_fp32["paths"][how], "--no-localize", *extra)
        assert failed.returncode == 1 and "FAILED" in failed.stdout, (how, extra, failed.stdout + failed.stderr)


def test_the_int4_decoder_with_the_approximate_form_is_within_the_drift_thresholds(tmp_path):
    """The builder's MatMulNBits carry accuracy_level 4 (onnxruntime quantizes A to int8 per
    block): only the approximate rule lowers them, when asked; end to end within the default drift
    thresholds on a padded 16-token prompt (192 rows of logits; at one row, argmax agreement is all
    or nothing)."""
    with pytest.raises(onnx_qrewrite.LoweringError, match="accuracy_level 4"):
        onnx_qrewrite.rewrite(onnx.load(INT4))
    result = onnx_qrewrite.rewrite(onnx.load(INT4), allow=["exact", "bounded", "approximate"])
    assert {n.domain for n in result.model.graph.node} == {""}
    assert result.report.by_rule()["matmul-nbits-int8-activations"] == 11
    path = tmp_path / "int4.onnx"
    onnx.save(result.model, path)
    passed = cli_in_process("verify", INT4, path, *PROMPT)
    assert passed.returncode == 0 and "within the drift thresholds" in passed.stdout, passed.stdout + passed.stderr


def test_shapes_onnxruntime_cannot_run_are_a_usage_error_not_the_originals_failure(rewritten_fp32):
    """Review 5 R7: a batch of prompts after a past (B 2, S 5, P 3) is neither a first prompt nor a
    step, and onnxruntime's kernel refuses it; verify blamed the original (exit 3). Now exit 2 naming
    --input-shape; a static-cache prompt (S <= P) still runs."""
    shapes = ("--input-shape", "batch_size=2", "--input-shape", "sequence_length=5")
    refused = cli_in_process(
        "verify", FP32, rewritten_fp32["paths"]["rewritten"], *shapes, "--input-shape", "past_sequence_length=3"
    )
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "--input-shape" in refused.stderr and "prompts of 5 tokens after 3 past" in refused.stderr
    static = (
        "--input-shape",
        "batch_size=2",
        "--input-shape",
        "sequence_length=2",
        "--input-shape",
        "past_sequence_length=3",
    )
    ran = cli_in_process("verify", FP32, rewritten_fp32["paths"]["rewritten"], *static)
    assert ran.returncode == 0, ran.stdout + ran.stderr
