"""The engine's real rewrite of every real model in tests/data/models agrees with the original, bit for bit.

The original runs on the numpy reference kernels (vendor ops) or natively; the rewrite in stock
onnxruntime. Checked under both the verifier's default settings and onnxruntime's full graph
optimisation, on the stored sample inputs and on generated inputs with the quantization battery.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import REAL_MODEL_NAMES, REAL_MODELS

import onnx_qrewrite
from onnx_qrewrite.verify import verify


@pytest.fixture(scope="module", params=REAL_MODEL_NAMES)
def rewritten(request):
    path = REAL_MODELS / f"{request.param}.onnx"
    return path, onnx_qrewrite.rewrite(path).model


@pytest.mark.parametrize("opt_level", ["disable", "all"])
def test_the_real_rewrite_agrees_exactly_on_generated_inputs(rewritten, opt_level):
    path, model = rewritten
    report = verify(path, model, opt_level=opt_level)
    assert report.passed, report.to_table()
    for output in report.outputs:
        assert output.exact_match_rate == 1.0, report.to_table()


def test_the_real_rewrite_agrees_exactly_on_the_stored_inputs(rewritten):
    path, model = rewritten
    feeds = dict(np.load(path.with_suffix(".inputs.npz")))
    report = verify(path, model, inputs=feeds)
    assert report.passed and all(o.max_abs_error == 0 for o in report.outputs), report.to_table()
