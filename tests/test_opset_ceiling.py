"""Opsets 27 and 28 (onnx 1.23.2 defines them; onnxruntime 1.31.1 loads neither): no rule, target
table or lowering step here describes what onnx changed there, so a model declaring them is refused
by name (the opset and 26, the highest described) instead of being judged by tables that do not
hold for it, or rewritten with ops whose meaning at 27-28 nobody checked."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, defs, helper, numpy_helper

from onnx_qrewrite import rewrite
from onnx_qrewrite.errors import LoweringError
from onnx_qrewrite.rewriter.opset import MAX_RUNTIME_OPSET
from onnx_qrewrite.targets import load_target, load_targets
from onnx_qrewrite.targets.lower_opset import check_for_target, lowering_steps

ort = pytest.importorskip("onnxruntime")

#: The targets that run inside onnxruntime's session, which loads opsets up to 26.
_ORT_BASED = ("onnx", "qnn", "nnapi", "coreml", "webgpu")


def _relu(opset: int) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"], name="relu")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=13)


def test_the_highest_described_opset_is_the_lowering_tables_and_what_onnxruntime_loads():
    assert max(lowering_steps()) == MAX_RUNTIME_OPSET == 26
    assert defs.onnx_opset_version() > MAX_RUNTIME_OPSET  # else this file has nothing to test
    ort.InferenceSession(_relu(26).SerializeToString(), providers=["CPUExecutionProvider"])
    with pytest.raises(Exception, match=r"official support for domain ai\.onnx is till opset 26"):
        ort.InferenceSession(_relu(27).SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("opset", [27, 28])
@pytest.mark.parametrize("target", sorted(load_targets()))
def test_every_target_refuses_an_opset_above_26_naming_it_and_the_highest_described(target, opset):
    profile = load_target(target)
    assert [r.node for r in check_for_target(_relu(26), profile)] == []
    refused = check_for_target(_relu(opset), profile)
    assert [r.node for r in refused] == ["(model)"]
    (reason,) = refused[0].reasons
    assert f"default-domain opset {opset} is above" in reason
    if profile.opset_max is not None:  # the runtime's own ceiling, then why it was not lowered
        assert f"the highest the target loads ({profile.opset_max}) [{target}/" in reason
        assert "no exact lowering from opset" in reason
    else:  # the runtime loads it (observed), but nothing here says what it computes there
        assert "above 26, the highest onnx-qrewrite describes" in reason
    if target in _ORT_BASED:
        assert profile.opset_max == 26


def test_a_rewrite_of_a_model_above_26_is_refused_per_node_naming_the_opset():
    """A com.microsoft QuantizeLinear at opset 27: every rule would emit standard Q/DQ whose
    meaning at 27-28 is not described; the node is named with the reason (exit 4 on the CLI)."""
    inits = [numpy_helper.from_array(np.array(0.1, np.float32), "s"), numpy_helper.from_array(np.uint8(3), "z")]
    graph = helper.make_graph(
        [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"], name="q", domain="com.microsoft")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.UINT8, [4])],
        inits,
    )
    opsets = [helper.make_opsetid("", 26), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=13)
    assert rewrite(model).report.by_rule()  # at 26 it is rewritten
    model.opset_import[0].version = 27
    with pytest.raises(LoweringError, match=r"node q \(com\.microsoft::QuantizeLinear\).*model opset 27 is above 26"):
        rewrite(model)
