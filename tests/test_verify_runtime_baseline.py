"""verify --runtime's baseline (verify/runtime_baseline.py): whose difference a failure on another
runtime is, from the original run there. No runtime needed: the comparisons are made here; the
real runs are in tests/test_targets_runtime.py (QNN: the runtime's; OpenVINO: the rewrite's)."""

from __future__ import annotations

import numpy as np
import pytest

from onnx_qrewrite.verify.compare import Tolerance, compare_values
from onnx_qrewrite.verify.runtime_baseline import RuntimeBaseline

TOL = Tolerance(atol=0.05, rtol=0.05, lsb=0)
WANT = np.array([1.0, -144.625, 3.0], np.float32)
OFF = np.array([1.0, -165.625, 3.0], np.float32)  # one element 21 away, as QNN's wide-range sample


def _row(a: np.ndarray, b: np.ndarray):
    return compare_values("logits", "wide-range", a, b, TOL)


@pytest.mark.parametrize(
    ("original_on_runtime", "rewrite_on_runtime", "finding", "says"),
    [
        (OFF, OFF, "runtime", "qnn's own computation of this model (its arithmetic, or a bug), not the rewrite"),
        (WANT, OFF, "rewrite", "the difference comes with the rewrite"),
        (OFF, OFF + 10, "both", "part is qnn's own computation, part the rewrite"),
    ],
)
def test_the_finding_says_whose_difference_it_is(original_on_runtime, rewrite_on_runtime, finding, says):
    baseline = RuntimeBaseline(
        "qnn",
        ("wide-range",),
        original=(_row(WANT, original_on_runtime),),
        rewrite=(_row(original_on_runtime, rewrite_on_runtime),),
    )
    assert baseline.finding == finding
    head, detail = baseline.lines()
    assert says in head and "(sample wide-range)" in head
    assert detail.startswith("  logits: original on qnn vs onnxruntime max abs ")


def test_an_original_the_runtime_cannot_run_leaves_the_question_open():
    baseline = RuntimeBaseline("openvino", ("random-0",), not_run="openvino cannot load the model")
    assert baseline.finding == "not-run"
    assert baseline.lines() == [
        "the original on openvino: not run (openvino cannot load the model); whose difference this is stays open"
    ]
    body = baseline.to_dict(lambda c: {})
    assert body["finding"] == "not-run" and body["original_vs_onnxruntime"] == []
