"""Engine mechanics: stamping equals building, byte for byte; op-count bookkeeping is exact."""

from __future__ import annotations

import onnx
import onnx.parser
import pytest

import onnx_qrewrite
from onnx_qrewrite import engine
from onnx_qrewrite.encoded import to_bytes
from onnx_qrewrite.report import count_ops

MODEL = """
<ir_version: 8, opset_import: ["" : 17, "local" : 1]>
g (float[N] x, bool cond) => (uint8[N] a, uint8[N] b, float c, uint8[N] d, uint8[N] e)
{
    a, sa, za = DynamicQuantizeLinear (x)
    b, sb, zb = DynamicQuantizeLinear (x)
    nx = Neg (x)
    d, c, zd = DynamicQuantizeLinear (nx)
    e = If (cond) <
        then_branch = t () => (uint8[N] ty) { ty, ts, tz = DynamicQuantizeLinear (x) },
        else_branch = f () => (uint8[N] fy) { fy = local.Q (x) }
    >
    u_y, u_s, u_z = DynamicQuantizeLinear (x)
}
<domain: "local", opset_import: ["" : 17]>
Q (v) => (w) { w, s, z = DynamicQuantizeLinear (v) }
"""


@pytest.mark.parametrize("semantics", ["onnxruntime", "spec"])
def test_stamped_replacements_equal_built_ones_byte_for_byte(semantics):
    model = onnx.parser.parse_model(MODEL)
    catalogue = onnx_qrewrite.load_rules(options={"dql-expand": {"semantics": semantics}})
    outputs = []
    for stamp in (True, False):
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        rewritten, report = engine.run(copy, catalogue, engine.EngineOptions(stamp_templates=stamp))
        outputs.append((to_bytes(rewritten), report.to_dict()))
    assert outputs[0] == outputs[1]
    assert len(outputs[0][1]["rewrites"]) == 6


def test_op_counts_are_bookkept_exactly():
    model = onnx.parser.parse_model(MODEL)
    result = onnx_qrewrite.rewrite(model)
    assert result.report.ops_before == count_ops(model)
    assert result.report.ops_after == count_ops(result.model)
