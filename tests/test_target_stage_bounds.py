"""Bounds through a target plan's stages: a bounded rule's replacement that a later stage rewrites
with an exact rule keeps its provenance (rule, origin, bound: engine ``continue_provenance``), so
``verify`` still checks the bound at the original node on the final model and catches a broken
rewrite there; where a later stage computes through what the replacement wrote (the values of the
original node are gone), ``verify`` says plainly that the bound is not checked at the node.

The target here runs no QLinearMatMul and no QuantizeLinear: qop-matmul (bounded) lowers the
QLinearMatMul, and a second stage computes the QuantizeLinear it emitted in float (the profile's
float-emulation form, exact).
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from _verify_helpers import node_row
from onnx import TensorProto, helper, numpy_helper

from onnx_qrewrite import rewrite
from onnx_qrewrite.errors import EXIT_DISAGREE
from onnx_qrewrite.targets import load_target
from onnx_qrewrite.verify import verify

OPS = ["DequantizeLinear", "MatMul", "Relu", "Div", "Round", "Add", "Clip", "IsNaN", "Not", "Where", "Cast", "Sub"]
OPS += ["Mul", "Reshape", "Identity"]
PROFILE = f"""
[target]
id = "staged"
title = "a target without QLinearMatMul or QuantizeLinear"
version = "1"
proof = "spec"

[[source]]
id = "doc"
document = "a document"
version = "v1"

[[ops]]
names = {json.dumps(OPS)}
source = "doc"

[[rewrites.form]]
name = "float-emulation"
allow = "exact"
why = "no QuantizeLinear kernel"
source = "doc"
"""


def _model(read_by_dq: bool) -> onnx.ModelProto:
    """One QLinearMatMul (uint8 activations x constant uint8 weights, K recorded) whose output is
    the graph's (``read_by_dq``: read by a DequantizeLinear whose float output is the graph's)."""
    rng = np.random.default_rng(0)
    consts = [
        numpy_helper.from_array(np.float32(0.02), "a_s"),
        numpy_helper.from_array(np.uint8(100), "a_z"),
        numpy_helper.from_array(rng.integers(0, 256, (8, 3)).astype(np.uint8), "w"),
        numpy_helper.from_array(np.float32(0.01), "w_s"),
        numpy_helper.from_array(np.uint8(120), "w_z"),
        numpy_helper.from_array(np.float32(0.05), "y_s"),
        numpy_helper.from_array(np.uint8(128), "y_z"),
    ]
    nodes = [helper.make_node("QLinearMatMul", ["a", "a_s", "a_z", "w", "w_s", "w_z", "y_s", "y_z"], ["y"], name="mm")]
    out = helper.make_tensor_value_info("y", TensorProto.UINT8, [2, 3])
    if read_by_dq:
        nodes.append(helper.make_node("DequantizeLinear", ["y", "y_s", "y_z"], ["z"], name="dq"))
        out = helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 3])
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("a", TensorProto.UINT8, [2, 8])], [out], consts
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


@pytest.fixture
def target(tmp_path) -> str:
    path = tmp_path / "staged.toml"
    path.write_text(PROFILE)
    return str(path)


def _dropped_zero_point(model: onnx.ModelProto) -> onnx.ModelProto:
    """The rewrite with one bug: the activations' zero point dropped from mm's DequantizeLinear."""
    broken = onnx.ModelProto()
    broken.CopyFrom(model)
    dq = next(n for n in broken.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == "a")
    del dq.input[2]
    return broken


@pytest.mark.parametrize("provenance", ["compact", "full"])
def test_a_bound_survives_a_later_stage_and_a_broken_rewrite_is_caught_at_the_node(target, provenance):
    model = _model(read_by_dq=False)
    result = rewrite(model, target=target, provenance=provenance)
    assert [(r.rule, r.exactness) for r in result.report.rewrites] == [
        ("qop-matmul", "bounded"),
        ("float-emulation-q", "exact"),
    ]  # two stages: the second rewrote the QuantizeLinear the first emitted
    assert "QuantizeLinear" not in {n.op_type for n in result.model.graph.node}
    assert load_target(target).id == "staged" and result.report.target["refused_after"] == 0
    good = verify(model, result.model, samples=3)
    assert good.passed and node_row(good, "mm").passed and good.unchecked_bounds == (), good.to_table()
    bad = verify(model, _dropped_zero_point(result.model), samples=3)
    assert bad.exit_code == EXIT_DISAGREE
    row = node_row(bad, "mm")
    assert not row.passed and row.max_abs_error > 10 * row.tolerance.lsb, bad.to_table()


def test_the_bound_needs_the_later_stage_to_continue_the_provenance(target, monkeypatch):
    """Without continuing it (the later stage's rule writing its own provenance, as before), the
    replacement ends before the value of the original node: nothing at the node is checked, and
    the broken rewrite is not caught there."""
    import onnx_qrewrite.targets.stages as stages

    original = stages.engine_options

    def without(*args, **kwargs):
        return original(*args, **{**kwargs, "later_stage": False})

    monkeypatch.setattr(stages, "engine_options", without)
    model = _model(read_by_dq=False)
    result = rewrite(model, target=target)
    bad = verify(model, _dropped_zero_point(result.model), samples=3)
    assert not [o for o in bad.outputs if "(node mm," in o.name], bad.to_table()


def test_verify_says_plainly_when_a_later_stage_computes_through_the_bounded_value(target, tmp_path):
    """The QuantizeLinear -> DequantizeLinear pair is computed in float by the second stage: mm's
    uint8 output is no longer a value of the model, so its bound cannot be checked at the node.
    verify says so (table, summary, JSON) and still compares the model outputs."""
    model = _model(read_by_dq=True)
    result = rewrite(model, target=target)
    assert "y" not in {o for n in result.model.graph.node for o in n.output}
    report = verify(model, result.model, samples=3)
    (unchecked,) = report.unchecked_bounds
    assert (unchecked.origin, unchecked.rule) == ("mm", "qop-matmul")
    assert "NOT checked at the node" in report.summary
    assert "bound not checked at node mm (rule qop-matmul)" in report.to_table()
    assert report.to_dict()["unchecked_bounds"] == [{"node": "mm", "rule": "qop-matmul", "why": unchecked.why}]
    assert not [o for o in report.outputs if o.role == "bound"]


def test_verify_says_plainly_when_a_later_stage_rewrites_the_bounded_replacement_inexactly(tmp_path):
    """A later stage whose rule is not exact (qdq-to-float's approximate pair removal, for a target
    with no QuantizeLinear or DequantizeLinear) rewrites what qop-matmul wrote: it does not continue
    qop-matmul's provenance, so mm's bound describes no nodes of the model any more. verify reports
    it unchecked (table, summary, JSON), naming the later rule, instead of saying nothing."""
    folder = tmp_path / "approximate"
    folder.mkdir()
    profile = PROFILE.replace(
        'name = "float-emulation"\nallow = "exact"', 'name = "qdq-to-float"\nallow = "approximate"'
    )
    (folder / "staged.toml").write_text(profile.replace('"DequantizeLinear", ', ""))
    model = _model(read_by_dq=True)
    model.graph.node.insert(0, helper.make_node("QuantizeLinear", ["x", "a_s", "a_z"], ["a"], name="q_in"))
    del model.graph.input[:]
    model.graph.input.append(helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8]))
    result = rewrite(model, target=str(folder / "staged.toml"), allow=("exact", "bounded", "approximate"))
    levels = {r.rule: r.exactness for r in result.report.rewrites}
    assert levels["qop-matmul"] == "bounded" and levels["qdq-to-float-drop-dq"] == "approximate", levels
    assert result.report.target["refused_after"] == 0
    report = verify(model, result.model, samples=3)
    (unchecked,) = report.unchecked_bounds
    assert (unchecked.origin, unchecked.rule) == ("mm", "qop-matmul")
    assert "qdq-to-float-drop-" in unchecked.why and "(approximate)" in unchecked.why
    assert "NOT checked at the node" in report.summary
    assert "bound not checked at node mm (rule qop-matmul)" in report.to_table()
    assert report.to_dict()["unchecked_bounds"] == [{"node": "mm", "rule": "qop-matmul", "why": unchecked.why}]
    assert not [o for o in report.outputs if o.role == "bound"]
