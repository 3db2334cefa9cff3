"""Malformed inputs get one clean line and the documented exit code (issue 9, item 5): names that
are not UTF-8, IR version 3, deeply nested TOML, a closed stdout."""

from __future__ import annotations

import subprocess

import numpy as np
import onnx
import pytest
from _safety_helpers import PY, cli, one_error_line
from conftest import assert_bitwise_equal, run
from onnx import TensorProto, helper


def _dql(ir_version: int = 8, opset: int = 13) -> onnx.ModelProto:
    node = helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "s", "z"], name="dql")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8])],
        [
            helper.make_tensor_value_info("y", TensorProto.UINT8, [8]),
            helper.make_tensor_value_info("s", TensorProto.FLOAT, []),
            helper.make_tensor_value_info("z", TensorProto.UINT8, []),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir_version)


@pytest.mark.parametrize(("provenance", "declared"), [("none", 4), ("compact", 10)])
def test_ir_version_3_model_is_rewritten_as_ir_4(tmp_path, provenance, declared):
    """Before IR 4 every initializer had to be a graph input; the rewrite's constants are not.
    With node provenance (the default), a field of IR 10, the output is declared IR 10
    (tests/test_provenance_ir.py)."""
    path = tmp_path / "ir3.onnx"
    onnx.save(_dql(ir_version=3, opset=11), path)
    out = tmp_path / "o.onnx"
    proc = cli("rewrite", path, "-o", out, "--provenance", provenance)
    assert proc.returncode == 0, proc.stderr
    assert "IR version raised from 3 to 4" in proc.stdout
    assert ("IR version: 4 -> 10 (the provenance" in proc.stdout) == (declared == 10)
    rewritten = onnx.load(out)
    assert rewritten.ir_version == declared
    onnx.checker.check_model(rewritten)
    x = np.linspace(-3, 5, 8, dtype=np.float32)
    for name in ("y", "s", "z"):
        assert_bitwise_equal(run(out, {"x": x})[name], run(path, {"x": x})[name], name)


@pytest.mark.parametrize(
    ("old", "new", "what"),
    [(b"dql", b"d\xffl", "node name"), (b"\x0a\x01x", b"\x0a\x01\xff", "value name")],
)
def test_names_that_are_not_utf8_are_invalid_models(tmp_path, old, new, what):
    path = tmp_path / "bad.onnx"
    path.write_bytes(_dql().SerializeToString().replace(old, new))
    proc = cli("rewrite", path, "-o", tmp_path / "o.onnx")
    assert proc.returncode == 3, proc.stderr
    line = one_error_line(proc)
    assert str(path) in line
    # Depending on protobuf's build, its parser refuses the bytes itself (naming the field), or
    # hands them over as bytes and the engine names them.
    assert (what in line and "not valid UTF-8" in line) or ("utf-8" in line and "onnx.NodeProto" in line), line
    assert not (tmp_path / "o.onnx").exists()


@pytest.mark.parametrize("shape", ["arrays", "tables"])
def test_deeply_nested_toml_is_a_usage_error(tmp_path, shape):
    depth = 100_000 if shape == "arrays" else 5_000
    text = "a = " + ("[" * depth + "]" * depth if shape == "arrays" else "{b=" * depth + "1" + "}" * depth)
    rules = tmp_path / "deep.toml"
    rules.write_text(text + "\n")
    proc = cli("rules", "--rules", rules)
    assert proc.returncode == 2 and "nested too deeply" in one_error_line(proc)
    sample = tmp_path / "m.onnx"
    onnx.save(_dql(), sample)
    proc = cli("inspect", sample, "--target", rules)
    assert proc.returncode == 2 and "nested too deeply" in one_error_line(proc)
    value = "[" * 5000 + "]" * 5000
    proc = cli("rewrite", sample, "-o", tmp_path / "o.onnx", "--rule-option", "dql-expand.semantics=" + value)
    assert proc.returncode == 2, proc.stderr  # taken as a bare string, then refused as a value
    assert "Traceback" not in proc.stderr


def test_closed_stdout_ends_quietly():
    """``onnx-qrewrite rules | head -c1``: no traceback, no 'internal error'."""
    for _ in range(3):
        proc = subprocess.run(
            f"{PY} -m onnx_qrewrite rules | head -c1 >/dev/null; echo ${{PIPESTATUS[0]}}",
            shell=True,
            executable="/bin/bash",
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.stderr == "", proc.stderr
        assert proc.stdout.strip() in ("0", "141"), proc.stdout
