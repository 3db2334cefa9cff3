"""``verify --runtime R`` says where R departs from onnxruntime running the original, or plainly why
it cannot: the original's intermediate values come from onnxruntime, the rewritten model's from R
run with them as extra outputs (localize.with_outputs), judged by drift (R's rounding differs from
onnxruntime's by a step almost everywhere). Each runtime test skips, naming the missing package,
where the runtime is not installed (as tests/test_targets_runtime.py does)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.numpy_helper
import pytest
from _verify_helpers import toy_quark_model, toy_rewrite
from conftest import SAMPLES
from test_targets_runtime import _runtime

from onnx_qrewrite import rewrite
from onnx_qrewrite.errors import EXIT_DISAGREE
from onnx_qrewrite.verify import Tolerances, verify

TOY_SHAPES = {"x": (2, 4)}


@pytest.fixture(scope="module")
def qdq_u16() -> tuple[onnx.ModelProto, onnx.ModelProto]:
    original = onnx.load(SAMPLES / "qdq_contrib_u16.onnx")
    return original, rewrite(original).model


@pytest.mark.parametrize("runtime", ["openvino", "tract"])
def test_a_broken_rewrite_is_localised_on_the_runtime_that_ran_it(runtime):
    _runtime(runtime)
    original = toy_quark_model()
    report = verify(original, toy_rewrite(original, "axis"), runtime=runtime, input_shapes=TOY_SHAPES)
    assert report.exit_code == EXIT_DISAGREE
    loc = report.localization
    assert loc is not None and loc.found, report.to_table()
    # The dequantized weights along the wrong axis: a gross departure, found by drift.
    assert (loc.node, loc.origin, loc.comparison.name) == ("dqw_dq", "dqw", "wd")
    assert loc.comparison.drift is not None and not loc.comparison.drift.passed
    assert f"values of the rewritten model from {runtime}" in loc.note and "this node is the rule's" in loc.note
    assert "first differing node 'dqw_dq'" in report.summary


def test_openvinos_wrong_numbers_on_uint16_qdq_are_said_to_come_from_its_compiler(qdq_u16):
    """OpenVINO 2026.4.1 computes the uint16 QDQ CNN wrongly (errors in the thousands), but right
    once its intermediate values are graph outputs: no node is to blame, and the report says so."""
    _runtime("openvino")
    original, rewritten = qdq_u16
    assert verify(original, rewritten).passed  # in onnxruntime the rewrite is exact
    report = verify(original, rewritten, runtime="openvino")
    assert report.exit_code == EXIT_DISAGREE and report.outputs[0].max_abs_error > 100
    loc = report.localization
    assert loc is not None and not loc.found
    assert loc.sample == report.outputs[0].worst.sample == "wide-range"  # the sample with the largest error
    assert loc.note.startswith("not possible on openvino: with the ") and "its outputs agree" in loc.note
    assert "localisation: not possible on openvino" in report.to_table()


def test_qnn_refusing_the_extra_outputs_is_said_plainly(qdq_u16):
    _runtime("qnn")
    original, rewritten = qdq_u16
    # QNN runs this model within its default tolerance; nothing at all forces a disagreement.
    report = verify(original, rewritten, runtime="qnn", tolerances=Tolerances(atol=0.0, rtol=0.0))
    assert report.exit_code == EXIT_DISAGREE
    loc = report.localization
    assert loc is not None and not loc.found
    assert loc.note.startswith("not possible on qnn: it needs the shared intermediate values as extra graph outputs")
    assert "CPU fallback" in loc.note


def test_tflite_localises_too():
    _runtime("tflite")
    original = onnx.load(SAMPLES / "dynamic_cnn.onnx")
    rewritten = rewrite(original, target="tflite").model
    report = verify(original, rewritten, runtime="tflite", tolerances=Tolerances(atol=0.0, rtol=0.0))
    assert report.exit_code == EXIT_DISAGREE
    loc = report.localization
    # With nothing tolerated, the first value that differs is the logits of the original's own
    # final Add: TFLite's float arithmetic, not a rule's node.
    assert loc is not None and loc.found, report.to_table()
    assert (loc.node, loc.rule, loc.comparison.name) == ("fc/Add", None, "logits")
    assert "values of the rewritten model from tflite" in loc.note and "not made by the rewrite" in loc.note


def test_a_rewrites_difference_within_the_runtimes_tolerance_upstream_is_not_blamed_on_the_runtime():
    # A bias 5% off at fc0 stays within OpenVINO's drift tolerance at fc0 and fc1, so the first value
    # beyond it is the logits (fc2/Add, not the rewrite's node): the note must not conclude that
    # OpenVINO computes fc2/Add differently, and must point to the onnxruntime localization, which
    # names fc0/Add.
    _runtime("openvino")
    original = onnx.load(SAMPLES / "dynamic_mlp.onnx")
    rewritten = rewrite(original, target="openvino").model
    (bias,) = [i for i in rewritten.graph.initializer if i.name == "fc0.bias"]
    bias.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(bias) * np.float32(1.05), bias.name))
    report = verify(original, rewritten, runtime="openvino", samples=3)
    loc = report.localization
    assert report.exit_code == EXIT_DISAGREE and loc is not None and loc.found, report.to_table()
    assert (loc.node, loc.rule) == ("fc2/Add", None)
    assert "so openvino computes it differently" not in loc.note
    assert "a difference that stayed within openvino's tolerance" in loc.note
    assert "verify without --runtime localizes" in loc.note
    assert verify(original, rewritten, samples=3).localization.node == "fc0/Add"
