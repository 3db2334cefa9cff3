"""TensorRT's opset range: what inspect says when the model declares an opset above it."""

from __future__ import annotations

from pathlib import Path

from onnx_qrewrite.api import load_rules
from onnx_qrewrite.targets import load_target, plan_for_target

SAMPLES = Path(__file__).resolve().parent.parent / "sample_models"


def test_a_model_declared_above_tensorrts_opset_is_refused_as_a_whole_and_says_why():
    """qdq_contrib_u16 declares opset 21 (16-bit standard Q/DQ exist only from 21). The rewrite for
    TensorRT computes every Q/DQ in float, but the declared opset stays: the one refusal left is
    the model's, and it says that a rewrite does not lower opsets."""
    plan = plan_for_target(SAMPLES / "qdq_contrib_u16.onnx", load_rules(), load_target("tensorrt"))
    assert [r.node for r in plan.after] == ["(model)"]
    reason = plan.after[0].reasons[0]
    assert "opset 21 is above the highest the target loads (20)" in reason
    assert "a rewrite never lowers a model's opset" in reason
    assert plan.rewritten is not None
    ops = {n.op_type for n in plan.rewritten.graph.node}
    assert not ops & {"QuantizeLinear", "DequantizeLinear"}
