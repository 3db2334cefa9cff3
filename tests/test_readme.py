"""The README's Python examples run as written, against a sample model copied into a temporary
folder under the names the examples use (model.onnx). A README example that drifts from the API
fails here."""

from __future__ import annotations

import contextlib
import io
import re
import shutil
import subprocess

import onnx
from conftest import REPO, SAMPLES

BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)


def python_blocks() -> list[str]:
    return BLOCK.findall((REPO / "README.md").read_text())


def test_readme_has_python_examples():
    assert python_blocks(), "README.md lost its ```python blocks"


def test_readme_python_examples_run(tmp_path, monkeypatch):
    shutil.copy(SAMPLES / "dynamic_mlp.onnx", tmp_path / "model.onnx")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__readme__"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for i, block in enumerate(python_blocks()):
            exec(compile(block, f"README.md python block {i}", "exec"), namespace)
    # What the examples say they do, they did.
    assert namespace["result"].report.by_rule() == {"dql-expand": 3, "int-matmul-float": 3}
    assert out.getvalue().count("dql-expand") == 3
    assert namespace["report"].passed
    for name in ("model.portable.onnx", "r.json", "r.xml"):
        assert (tmp_path / name).is_file(), name
    assert isinstance(namespace["model"], onnx.ModelProto)
    assert not any(n.op_type == "DynamicQuantizeLinear" for n in namespace["model"].graph.node)


def test_readme_command_outputs_are_ignored_by_git():
    """README command 1 writes its output into the checkout: git must not offer to commit it."""
    commands = re.findall(r"(?m)^python3 -m venv .*$", (REPO / "README.md").read_text())
    outputs = [o for c in commands for o in re.findall(r"\s-o\s+(\S+)", c)]
    assert outputs, "README command 1 no longer names an output (-o)"
    for output in outputs:
        proc = subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q", output], capture_output=True, timeout=30)
        assert proc.returncode == 0, f"{output} is not ignored by git"
