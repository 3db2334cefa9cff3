"""The Python entry point: what ``onnx_qrewrite.verify`` accepts, returns and refuses."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from _verify_helpers import toy_quark_model, toy_rewrite
from conftest import REAL_MODELS
from onnx import TensorProto, helper

import onnx_qrewrite
import onnx_qrewrite.verify.compare
from onnx_qrewrite.errors import InvalidModelError, UsageError
from onnx_qrewrite.verify import Sample, Tolerances, VerifyReport, verify

DYNAMIC = REAL_MODELS / "ortdyn_cnn_op17_w8u.onnx"


def _model(outputs: list[tuple[str, int, list]], *, input_type: int = TensorProto.FLOAT) -> onnx.ModelProto:
    nodes = [
        helper.make_node("Identity", ["x"], [name])
        if t == input_type
        else helper.make_node("Cast", ["x"], [name], to=t)
        for name, t, _ in outputs
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", input_type, [2, 3])],
        [helper.make_tensor_value_info(name, t, shape) for name, t, shape in outputs],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_the_top_level_function_works_after_the_subpackage_is_imported():
    # Importing onnx_qrewrite.verify.* rebinds the package attribute `verify` to the subpackage.
    for _ in range(2):
        report = onnx_qrewrite.verify(DYNAMIC, DYNAMIC, samples=1, battery=False)
        assert isinstance(report, VerifyReport)
        # The same file twice compares nothing: inconclusive, never a pass.
        assert report.verdict_key == "inconclusive" and report.exit_code == 6


def test_paths_and_protos_are_both_accepted_and_named_in_the_report():
    original = toy_quark_model()
    report = verify(original, toy_rewrite(original), samples=1)
    assert (report.original, report.rewritten) == ("<original ModelProto>", "<rewritten ModelProto>")
    assert verify(DYNAMIC, onnx.load(DYNAMIC), samples=1).original == str(DYNAMIC)


def test_the_report_holds_the_inputs_it_used():
    feeds = {"x": np.arange(16, dtype=np.float32).reshape(4, 4)}
    original = toy_quark_model()
    report = verify(original, toy_rewrite(original), inputs=[Sample("mine", feeds)])
    (sample,) = report.samples
    assert sample.name == "mine" and np.array_equal(sample.feeds["x"], feeds["x"])
    assert report.outputs[0].shape == (4, 4) and report.outputs[0].elements == 16


def test_an_output_missing_from_the_rewritten_model_fails_that_output():
    original = _model([("a", TensorProto.FLOAT, [2, 3]), ("b", TensorProto.FLOAT, [2, 3])])
    rewritten = _model([("a", TensorProto.FLOAT, [2, 3])])
    report = verify(original, rewritten, samples=1, battery=False)
    by_name = {o.name: o for o in report.outputs}
    assert by_name["a"].passed and by_name["b"].problem == "missing from the rewritten model"
    assert report.exit_code == 1


def test_a_changed_output_dtype_is_a_disagreement():
    original = _model([("a", TensorProto.FLOAT, [2, 3])])
    rewritten = _model([("a", TensorProto.DOUBLE, [2, 3])])
    (output,) = verify(original, rewritten, samples=1, battery=False).outputs
    assert output.problem == "dtype differs: original float32, rewritten float64"


def test_models_with_different_inputs_are_not_a_rewrite_of_each_other():
    original = _model([("a", TensorProto.FLOAT, [2, 3])])
    rewritten = _model([("a", TensorProto.FLOAT, [2, 3])], input_type=TensorProto.DOUBLE)
    with pytest.raises(UsageError, match="have different inputs"):
        verify(original, rewritten)


def test_tolerances_for_unknown_outputs_are_refused():
    with pytest.raises(UsageError, match="no output named 'logit'"):
        verify(DYNAMIC, DYNAMIC, tolerances=Tolerances(output_atol={"logit": 1.0}))


def test_a_bad_optimisation_level_is_a_usage_error():
    with pytest.raises(UsageError, match=r"^--ort-opt-level: expected one of disable, basic, extended, all"):
        verify(DYNAMIC, DYNAMIC, opt_level="max")


def test_a_file_that_is_not_onnx_is_an_invalid_model(tmp_path):
    path = tmp_path / "junk.onnx"
    path.write_bytes(b"\x00not a model")
    with pytest.raises(InvalidModelError, match=f"^{path}: "):
        verify(path, DYNAMIC)
