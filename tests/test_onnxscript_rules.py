"""The catalogue as an onnxscript rewrite-rule set gives exactly what onnx_qrewrite.rewrite gives."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.numpy_helper
import onnx.parser
import pytest
from conftest import REAL_MODEL_NAMES, REAL_MODELS, assert_bitwise_equal, run
from onnxscript import rewriter

import onnx_qrewrite
import onnx_qrewrite.onnxscript_rules as qrw

MODELS = list(REAL_MODEL_NAMES)


@pytest.fixture(scope="module")
def rules():
    return qrw.rule_set()


@pytest.mark.parametrize("name", MODELS)
def test_onnxscript_rewriter_with_our_rules_matches_our_rewrite(name, rules):
    path = REAL_MODELS / f"{name}.onnx"
    via_onnxscript = rewriter.rewrite(onnx.load(path), pattern_rewrite_rules=rules)
    leftover = [
        n.op_type
        for n in via_onnxscript.graph.node
        if n.domain not in ("", "ai.onnx") or n.op_type == "DynamicQuantizeLinear"
    ]
    assert leftover == []
    onnx.checker.check_model(via_onnxscript)
    ours = onnx_qrewrite.rewrite(path, keep_opset=True).model  # the pattern rewriter never raises opsets
    feeds = dict(np.load(REAL_MODELS / f"{name}.inputs.npz"))
    want, got = run(ours, feeds), run(via_onnxscript, feeds)
    for output in want:
        assert_bitwise_equal(got[output], want[output], f"{name}: {output}")


def test_a_node_the_catalogue_declines_is_left_alone(rules):
    # float16 with a scale other than 1: the engine refuses to guess (NUMERICS.md), so the match fails.
    text = """
    <ir_version: 8, opset_import: ["" : 17, "com.amd.quark" : 1]>
    g (float[4] x) => (float16[4] y)
    <float s = {0.5}>
    {
        y = com.amd.quark.ExtendedQuantizeLinear (x, s, zp)
    }
    """
    model = onnx.parser.parse_model(text)
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.zeros((), np.float16), "zp"))
    out = rewriter.rewrite(model, pattern_rewrite_rules=rules)
    assert [n.op_type for n in out.graph.node] == ["ExtendedQuantizeLinear"]
