"""TensorRT: what inspect says when the model declares an opset above the target's (and that the
rewrite lowers it), how the plan reaches a QOperator CNN (data movement wrapped in Q/DQ, a
DequantizeLinear left to the stage that pairs it), and the uint8 types check sees between
com.microsoft QLinear ops."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_qrewrite import rewrite
from onnx_qrewrite.api import load_rules
from onnx_qrewrite.targets import check_model, load_target, plan_for_model, plan_for_target

REPO = Path(__file__).resolve().parent.parent
SAMPLES = REPO / "sample_models"


def test_a_model_declared_above_tensorrts_opset_is_refused_as_given_and_lowered_by_the_rewrite():
    """qdq_contrib_u16 declares opset 21 (16-bit standard Q/DQ exist only from 21). As given,
    TensorRT refuses it as a whole; the rewrite computes every Q/DQ in float, after which every
    node is valid unchanged at 20, so the plan lowers the opset (tests/test_lower_opset.py)."""
    plan = plan_for_target(SAMPLES / "qdq_contrib_u16.onnx", load_rules(), load_target("tensorrt"))
    (whole,) = [r for r in plan.before if r.node == "(model)"]
    assert "opset 21 is above the highest the target loads (20)" in whole.reasons[0]
    assert plan.after == []
    assert plan.rewritten is not None
    assert [o.version for o in plan.rewritten.opset_import if o.domain == ""] == [20]
    ops = {n.op_type for n in plan.rewritten.graph.node}
    assert not ops & {"QuantizeLinear", "DequantizeLinear"}


def test_a_transpose_between_contrib_qlinear_ops_is_judged_by_its_uint8_type():
    """onnx has no schema for com.microsoft QLinearAdd: once its output is typed, what reads it is
    inferred again, so TensorRT's check sees the Reshape and Transpose on uint8 it refuses."""
    ms = "com.microsoft"
    inits = [
        numpy_helper.from_array(np.array(0.05, np.float32), "s"),
        numpy_helper.from_array(np.array(128, np.uint8), "z"),
        numpy_helper.from_array(np.array([0, 4, 2], np.int64), "shape"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["qx"], name="qx"),
        helper.make_node("QLinearAdd", ["qx", "s", "z", "qx", "s", "z", "s", "z"], ["a"], name="add", domain=ms),
        helper.make_node("Reshape", ["a", "shape"], ["r"], name="reshape"),
        helper.make_node("Transpose", ["r"], ["t"], name="transpose", perm=[0, 2, 1]),
        helper.make_node("DequantizeLinear", ["t", "s", "z"], ["y"], name="dq"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 4])],
        inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ms, 1)], ir_version=8
    )
    refused = {r.node: r.reasons for r in check_model(model, load_target("tensorrt"))}
    assert "Transpose on uint8 ('r')" in refused["transpose"][0]
    assert "Reshape on uint8 ('a')" in refused["reshape"][0]


def _battery_model(folder: Path, name: str) -> Path:
    path = REPO / "benchmarks" / "target_models.py"
    spec = importlib.util.spec_from_file_location("benchmarks_target_models", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return next(b.path for b in module.make_battery(folder, {name}))


def test_tensorrt_reaches_a_quantize_static_qoperator_cnn(tmp_path, monkeypatch):
    """onnxruntime's quantize_static QOperator CNN (benchmarks/target_models.py ortqop_cnn): its
    Flatten on uint8 goes between DQ and Q (form qdq-units), the model's last DequantizeLinear waits
    for the stage that lowers the QLinearAdd before it, and the float emulation computes every pair:
    TensorRT refuses nothing, and verify passes (the QOperator lowerings' one-step bounds included).
    Without either step, something stays refused."""
    pytest.importorskip("onnxruntime.quantization")
    from onnx_qrewrite.verify import verify

    path = _battery_model(tmp_path, "ortqop_cnn")
    model = onnx.load(path)
    catalogue = load_rules()
    profile = load_target("tensorrt")
    plan = plan_for_model(model, catalogue, profile)
    assert plan.ok and len(plan.before) == 8, [r.reasons for r in plan.after]
    verdicts = {n.node: n for n in plan.nodes}
    assert verdicts["flatten.out"].rule == "qdq-wrap-move" and verdicts["flatten.out"].form == "qdq-units"
    assert verdicts["head.out_DequantizeLinear"].rule == "float-emulation-qdq-pair"
    result = rewrite(model, rules=catalogue, target="tensorrt")
    assert result.report.target["refused_after"] == 0
    assert check_model(result.model, profile) == []
    report = verify(model, result.model, samples=2)
    assert report.passed, report.to_table()
    # without the deferral the last DequantizeLinear is emulated alone and the Q before it stays uint8
    monkeypatch.setattr("onnx_qrewrite.targets.trials.deferrable", lambda *a: [])
    assert plan_for_model(model, catalogue, profile).refused_after == 1
    # without the form the Flatten stays on uint8
    monkeypatch.undo()
    text = (REPO / "rules" / "targets" / "tensorrt.toml").read_text()
    cut = text.index('[[rewrites.form]]\nname = "qdq-units"')
    (tmp_path / "tensorrt.toml").write_text(text[:cut])
    without = plan_for_model(model, catalogue, load_target(str(tmp_path / "tensorrt.toml")))
    assert without.refused_after > 0 and any(r.op == "Flatten" for r in without.after)
