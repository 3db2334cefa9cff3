"""What verify's per-element bounds (verify/element_bounds.py) read of the original model comes
from a node onnxruntime has already run: a node missing an input its op requires is refused when
onnxruntime loads the original (exit 3 naming the node), before any formula asserts that input is
there. And inputs given through the API that hold no sample are a usage error, not a crash."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from _cli_helpers import cli_in_process
from onnx import TensorProto, helper

from onnx_qrewrite import rewrite
from onnx_qrewrite.errors import UsageError
from onnx_qrewrite.verify import verify

pytest.importorskip("onnxruntime")


def _qlinear_matmul() -> onnx.ModelProto:
    """Activation x activation QLinearMatMul over a symbolic K: qop-matmul bounds it with the
    run-time-k formula, which reads the original node's A (its K on each sample)."""
    f = onnx.numpy_helper.from_array
    node = helper.make_node("QLinearMatMul", ["a", "s", "z", "b", "s", "z", "s", "z"], ["y"], name="mm")
    inputs = [
        helper.make_tensor_value_info("a", TensorProto.UINT8, [2, "k"]),
        helper.make_tensor_value_info("b", TensorProto.UINT8, ["k", 3]),
    ]
    output = helper.make_tensor_value_info("y", TensorProto.UINT8, [2, 3])
    graph = helper.make_graph([node], "g", inputs, [output], [f(np.float32(0.1), "s"), f(np.uint8(128), "z")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_an_original_node_missing_the_input_a_bound_formula_reads_is_exit_3_naming_it(tmp_path):
    original = _qlinear_matmul()
    result = rewrite(original)
    assert [rw.bound_formula.split(":")[0] for rw in result.report.rewrites] == ["run-time-k"]
    rewritten = tmp_path / "mm.rewritten.onnx"
    result.save(rewritten)
    good, bad = tmp_path / "mm.onnx", tmp_path / "mm_bad.onnx"
    onnx.save(original, good)
    original.graph.node[0].input[0] = ""  # A, which the formula reads: absent
    del original.graph.input[0]
    onnx.save(original, bad)
    done = cli_in_process("verify", good, rewritten)  # in this process: tests/_cli_helpers.py
    assert done.returncode == 0 and "1 bounded replacement within its bound" in done.stdout, done.stderr
    done = cli_in_process("verify", bad, rewritten)
    assert done.returncode == 3, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "mm_bad.onnx" in line and "(mm)'s input 0 is marked single but has an empty string" in line


def test_an_empty_sequence_of_samples_is_a_usage_error():
    original = _qlinear_matmul()
    with pytest.raises(UsageError, match="an empty sequence of samples leaves nothing to run"):
        verify(original, rewrite(original).model, inputs=[])
