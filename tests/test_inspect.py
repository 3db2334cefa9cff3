"""``onnx-qrewrite inspect``: what a rewrite would do, without writing anything.

The plan comes from the engine itself, so it is checked against what ``rewrite`` then does.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import onnx
from _cli_helpers import cli_in_process
from conftest import REAL_MODELS
from onnx import helper

import onnx_qrewrite
from onnx_qrewrite.api import load_rules
from onnx_qrewrite.cli.inspect import inspect_model

A16W8 = REAL_MODELS / "quark_cnn_op17_a16w8_ext.onnx"


def cli(*args, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The command line in this process (tests/_cli_helpers.py): these tests are about what
    ``inspect`` and ``rewrite`` print, write and exit with."""
    return cli_in_process(*args, cwd=cwd)


def test_groups_rules_and_opset_changes_agree_with_rewrite():
    report = inspect_model(A16W8, load_rules())
    groups = {(g["op"], g["dtype"]): (g["count"], g["rule"], g["becomes"]) for g in report.groups()}
    assert groups == {
        ("com.amd.quark::ExtendedDequantizeLinear", "int32"): (3, "quark-dq-standard", ["DequantizeLinear"]),
        ("com.amd.quark::ExtendedDequantizeLinear", "int8"): (3, "quark-dq-standard", ["DequantizeLinear"]),
        ("com.amd.quark::ExtendedQuantizeLinear", "int16"): (8, "quark-q-standard", ["QuantizeLinear"]),
        ("com.amd.quark::ExtendedDequantizeLinear", "int16"): (8, "quark-dq-standard", ["DequantizeLinear"]),
    }
    changes = [(c["domain"], c["before"], c["after"]) for c in report.opset_changes]
    assert changes == [("", 17, 21), ("com.amd.quark", 1, None)]
    assert report.opset_error is None
    rewritten = onnx_qrewrite.rewrite(A16W8).report
    assert {(r.node, r.rule) for r in rewritten.rewrites} == {(n.node, n.rule) for n in report.nodes}
    assert [(c.domain, c.before, c.after) for c in rewritten.opset_changes] == changes


def test_keep_opset_plans_the_decompositions():
    report = inspect_model(A16W8, load_rules(), keep_opset=True)
    rules = {(g["op"], g["dtype"]): g["rule"] for g in report.groups()}
    assert rules[("com.amd.quark::ExtendedQuantizeLinear", "int16")] == "quark-q-int-decompose"
    assert rules[("com.amd.quark::ExtendedDequantizeLinear", "int16")] == "quark-dq-int-decompose"
    assert [(c["domain"], c["after"]) for c in report.opset_changes] == [("com.amd.quark", None)]


def test_nodes_that_cannot_be_lowered_and_an_opset_that_cannot_be_raised(tmp_path):
    model = onnx.load(A16W8)
    # An int64 zero point no rule handles, and a local function the version converter refuses.
    zp = next(t for t in model.graph.initializer if t.name == "logits_zero_point")
    zp.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(zp).astype("int64"), zp.name))
    model.functions.append(
        onnx.parser.parse_function('<domain: "local", opset_import: ["" : 17]> f (a) => (b) { b = Identity(a) }')
    )
    model.opset_import.append(helper.make_opsetid("local", 1))
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    report = inspect_model(path, load_rules())
    assert "cannot raise the opset from 17 to 21" in report.opset_error and "local functions" in report.opset_error
    stuck = [n for n in report.nodes if n.reasons]
    assert [(n.node, n.dtype, n.status) for n in stuck] == [
        ("logits_QuantizeLinear", "int64", "CANNOT LOWER"),
        ("logits_DequantizeLinear", "int64", "CANNOT LOWER"),
    ]
    assert any("dtype int64 is not one of" in r for r in stuck[0].reasons)
    # With the opset kept, the int16 nodes are planned on the decompositions.
    planned = {n.rule for n in report.nodes if n.rule}
    assert "quark-q-int-decompose" in planned and "quark-q-standard" not in planned


def test_cli_prints_the_plan_and_writes_nothing(tmp_path):
    target = tmp_path / "a16w8.onnx"
    target.write_bytes(A16W8.read_bytes())
    proc = cli("inspect", target, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "default-domain opset 17" in out and "quantization ops: 22 nodes" in out
    assert "com.amd.quark::ExtendedQuantizeLinear    int16      8  quark-q-standard   QuantizeLinear" in out
    assert "ai.onnx: 17 -> 21 (rule quark-q-standard on input_QuantizeLinear)" in out
    assert "com.amd.quark: 1 -> removed" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a16w8.onnx"]
    proc = cli("inspect", target, "--json", "--keep-opset")
    data = json.loads(proc.stdout)
    assert proc.returncode == 0 and len(data["nodes"]) == 22
    assert {g["rule"] for g in data["groups"]} == {
        "quark-dq-standard",
        "quark-q-int-decompose",
        "quark-dq-int-decompose",
    }


def test_cli_float16_semantics_and_bad_input(tmp_path):
    from test_lower_quark import fp16_model

    path = tmp_path / "fp16.onnx"
    onnx.save(fp16_model(0.5, 2.0), path)
    proc = cli("inspect", path)
    assert proc.returncode == 0 and "CANNOT LOWER" in proc.stdout and "--float16-semantics" in proc.stdout
    proc = cli("inspect", path, "--float16-semantics", "kernel", "--all-nodes")
    assert (
        proc.returncode == 0 and "quark-q-float16 -> Clip, Cast [per-tensor; float16 semantics: kernel]" in proc.stdout
    )
    # rewrite: exit 4 with one line naming the node and the choice, nothing written; then the choice.
    out = tmp_path / "out.onnx"
    proc = cli("rewrite", path, "-o", out)
    assert proc.returncode == 4 and "node n (com.amd.quark::ExtendedQuantizeLinear) cannot be lowered" in proc.stderr
    assert not out.exists()
    proc = cli("rewrite", path, "-o", out, "--float16-semantics", "documented")
    assert proc.returncode == 0 and out.exists()
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not a model")
    assert cli("inspect", broken).returncode == 3
