"""Targets that do not compute float64 as float64 (profile [arithmetic], observed: OpenVINO as
float32, QNN in reduced precision, LiteRT not at all): the rules whose exactness rests on float64
arithmetic (RotaryEmbedding's fused multiply-add) are named by inspect and rewrite --target, per
node and for the model; LiteRT's refusal is a refusal; a float64 target says nothing."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from _cli_helpers import cli_in_process
from onnx import TensorProto, helper

from onnx_qrewrite import rewrite
from onnx_qrewrite.api import load_rules
from onnx_qrewrite.targets import load_target, plan_for_model


def _rotary() -> onnx.ModelProto:
    """com.microsoft RotaryEmbedding on (2, 7, 128), 4 heads, a start position: float32."""
    node = helper.make_node(
        "RotaryEmbedding", ["x", "p", "c", "s"], ["y"], domain="com.microsoft", num_heads=4, interleaved=0
    )
    values = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 7, 128]),
        helper.make_tensor_value_info("p", TensorProto.INT64, [1]),
        helper.make_tensor_value_info("c", TensorProto.FLOAT, [12, 16]),
        helper.make_tensor_value_info("s", TensorProto.FLOAT, [12, 16]),
    ]
    graph = helper.make_graph([node], "g", values, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 7, 128])])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, ir_version=8, opset_imports=opsets)


def test_openvino_gets_the_rotary_rewrite_with_its_float64_named_as_float32_there(tmp_path):
    plan = plan_for_model(_rotary(), load_rules(), load_target("openvino"))
    assert plan.ok and plan.float64 is not None
    assert plan.float64["loss"] == "openvino computes float64 as float32 [openvino/float64-probe]"
    assert (
        list(plan.float64["rules"]) == ["unfuse-rotary-embedding"] and plan.float64["rules"]["unfuse-rotary-embedding"]
    )
    (verdict,) = plan.nodes
    assert verdict.rule == "unfuse-rotary-embedding" and verdict.exactness == "exact"
    assert verdict.caveats == (
        "unfuse-rotary-embedding computes in float64, which openvino computes float64 as float32 "
        "[openvino/float64-probe]",
    )
    summary = "\n".join(rewrite(_rotary(), target="openvino").report.summary_lines())
    assert "unfuse-rotary-embedding" in summary and "declared exactness does not hold there" in summary
    source = tmp_path / "rotary.onnx"
    onnx.save(_rotary(), source)
    run = ["inspect", source, "--target", "openvino"]  # in this process: tests/_cli_helpers.py
    text = cli_in_process(*run)
    assert text.returncode == 0, text.stderr
    assert "caveat: unfuse-rotary-embedding computes in float64" in text.stdout
    assert "float64: unfuse-rotary-embedding (" in text.stdout
    data = json.loads(cli_in_process(*run, "--json").stdout)
    assert data["float64"]["rules"] == plan.float64["rules"] and data["nodes"][0]["caveats"]


@pytest.mark.parametrize("target", ["tract", "onnx"])
def test_a_target_that_computes_float64_as_float64_gets_no_caveat(target):
    plan = plan_for_model(_rotary(), load_rules(), load_target(target))
    assert plan.float64 is None and all(not n.caveats for n in plan.nodes)


def test_tflite_refuses_the_float64_form_and_keeps_the_node_refused_naming_why():
    """LiteRT refuses float64 Mul/Add/Sub/Div when invoked: the rotary rewrite is no way there."""
    profile = load_target("tflite")
    assert profile.float64 == "refused"
    lowered = rewrite(_rotary()).model
    refused = plan_for_model(lowered, load_rules(), profile).after
    assert any("LiteRT refuses float64" in reason for r in refused for reason in r.reasons)
    plan = plan_for_model(_rotary(), load_rules(), profile)
    assert [r.op for r in plan.after] == ["RotaryEmbedding"] and not plan.ok


def test_openvino_runs_its_native_rotary_wrongly_and_the_rewrite_within_its_tolerance():
    """The observation behind openvino's [[refuse]] of com.microsoft RotaryEmbedding and its
    [arithmetic] float64 = "float32": native max abs 6.53 (observed), the rewrite about 2.4e-7."""
    pytest.importorskip("openvino", reason="needs openvino (extra [openvino])")
    ort = pytest.importorskip("onnxruntime")
    from onnx_qrewrite.verify.runtimes import make_runner

    rng = np.random.default_rng(5)
    angles = rng.uniform(0, 2 * np.pi, (12, 16))
    feeds = {
        "x": rng.standard_normal((2, 7, 128)).astype(np.float32),
        "p": np.array([3], np.int64),
        "c": np.cos(angles).astype(np.float32),
        "s": np.sin(angles).astype(np.float32),
    }
    reference = ort.InferenceSession(_rotary().SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    native = make_runner("openvino", _rotary(), label="native").run(feeds)["y"]
    rewritten = make_runner("openvino", rewrite(_rotary()).model, label="rewrite").run(feeds)["y"]
    assert np.abs(native - reference[0]).max() > 1e-2
    assert np.abs(rewritten - reference[0]).max() < 1e-5


def test_targets_lists_each_profiles_ir_ceiling_and_float64_arithmetic():
    data = {t["id"]: t for t in json.loads(cli_in_process("targets", "--json").stdout)}
    assert (data["openvino"]["ir_max"], data["openvino"]["float64"]) == (14, "float32")
    assert (data["tensorrt"]["ir_max"], data["tensorrt"]["float64"]) == (10, None)
    text = cli_in_process("targets", "--long", "qnn").stdout
    assert (
        "IR versions up to 13 [qnn/ort-session]" in text and "float64 arithmetic: reduced [qnn/float64-probe]" in text
    )
