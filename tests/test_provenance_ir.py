"""The rewrite's provenance is node ``metadata_props``, a field IR 10 added (onnx.proto;
rules/opsets/ir_versions.toml): a rewritten model must be valid at the IR version it declares, so
a model declared below IR 10 that gets node provenance is declared IR 10, said in the report, and
one rewritten with ``--provenance none`` keeps its IR version. Neither onnx's checker nor
onnxruntime holds a model to its declaration (both take node metadata at IR 8), so the table is
the check here, as for the target IR lowering (targets/lower_ir.py)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from conftest import SAMPLES
from test_targets import EMU_OPS, MINIMAL, _qdq_relu, cli

from onnx_qrewrite import rewrite, verify
from onnx_qrewrite.targets.lower_ir import ir_additions, uses

ort = pytest.importorskip("onnxruntime")


def _newer_than_declared(model: onnx.ModelProto) -> list[str]:
    """Each use of a field or type an IR version above the model's declared one added."""
    added = {f"field:{f}": v for v, a in ir_additions().items() for f in a.fields}
    added.update({f"type:{t}": v for v, a in ir_additions().items() for t in a.types})
    return sorted({f"{use} ({where})" for use, where in uses(model) if added.get(use, 0) > model.ir_version})


def _at_ir(ir_version: int) -> onnx.ModelProto:
    model = onnx.load(SAMPLES / "dynamic_mlp.onnx")  # quantize_dynamic's MLP, opset 17
    model.ir_version = ir_version
    return model


def _node_metadata(model: onnx.ModelProto) -> int:
    return sum(len(n.metadata_props) > 0 for n in model.graph.node)


@pytest.mark.parametrize("mode", ["compact", "full"])
@pytest.mark.parametrize("ir_version", [8, 9, 10])
def test_node_provenance_is_declared_at_the_ir_version_that_has_it(ir_version, mode):
    original = _at_ir(ir_version)
    result = rewrite(original, provenance=mode)
    model = result.model
    assert _node_metadata(model) > 0
    assert model.ir_version == max(ir_version, 10)
    assert _newer_than_declared(model) == []
    change = result.report.ir_version_change
    if ir_version < 10:
        assert change is not None and (change["from"], change["to"]) == (ir_version, 10)
        assert "NodeProto.metadata_props" in change["why"] and "--provenance none" in change["why"]
        assert f"  IR version: {ir_version} -> 10 (" in "\n".join(result.report.summary_lines())
    else:
        assert change is None
    onnx.checker.check_model(model, full_check=True)
    # Only the declaration changed: it loads, computes what the original does, and verify still
    # reads the provenance (the rule of each created node).
    feed = {"input": np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)}
    want = ort.InferenceSession(original.SerializeToString()).run(None, feed)
    got = ort.InferenceSession(model.SerializeToString()).run(None, feed)
    assert all(np.array_equal(w, g) for w, g in zip(want, got, strict=True))
    assert verify(original, model).passed


@pytest.mark.parametrize("ir_version", [8, 9, 10])
def test_no_node_provenance_keeps_the_ir_version(ir_version):
    result = rewrite(_at_ir(ir_version), provenance="none")
    assert result.report.rewrites and _node_metadata(result.model) == 0
    assert result.model.ir_version == ir_version and result.report.ir_version_change is None
    assert _newer_than_declared(result.model) == []


def test_the_old_code_wrote_node_metadata_below_ir_10_which_the_table_catches():
    """The check the tests above make can fail: node metadata declared at IR 8 is named. onnx's
    checker and onnxruntime both take it (README, Models and weights), so only the table tells."""
    model = rewrite(_at_ir(8)).model
    model.ir_version = 8
    assert any(u.startswith("field:NodeProto.metadata_props") for u in _newer_than_declared(model))
    onnx.checker.check_model(model, full_check=True)
    ort.InferenceSession(model.SerializeToString())


def test_a_target_loading_no_ir_10_gets_no_node_provenance(tmp_path):
    """A profile whose runtime loads IR 9 at most: raising the IR would make the model one it
    refuses, so the rewrite writes no node provenance (a warning says so) and keeps IR 8."""
    text = MINIMAL.replace('names = ["Add"]', f"names = {json.dumps([*EMU_OPS, 'DequantizeLinear'])}")
    text += '\n[ir]\nmax = 9\nsource = "doc"\n'
    text += '\n[[rewrites.form]]\nname = "float-emulation"\nallow = "exact"\nwhy = "no Q"\nsource = "doc"\n'
    profile = tmp_path / "mini.toml"
    profile.write_text(text)
    result = rewrite(_qdq_relu(), target=str(profile))
    assert result.report.rewrites and result.model.ir_version == 8 and _node_metadata(result.model) == 0
    assert result.report.ir_version_change is None
    assert any("above the highest IR the target loads" in w for w in result.report.warnings)
    assert result.report.target is not None and result.report.target["refused_after"] == 0


def test_rewrite_cli_says_the_ir_version_changes(tmp_path):
    source = tmp_path / "mlp8.onnx"
    onnx.save(_at_ir(8), source)
    done = cli("rewrite", source, "-o", tmp_path / "out.onnx")
    assert done.returncode == 0, done.stderr
    assert "IR version: 8 -> 10 (the provenance (--provenance compact) is node metadata" in done.stdout
    assert onnx.load(tmp_path / "out.onnx").ir_version == 10
