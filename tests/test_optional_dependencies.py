"""The core install needs no onnxruntime (nor onnxruntime-extensions, nor onnxscript).

Building a venv without them for every run would be slow; instead each command runs in a fresh
interpreter whose import system refuses the optional modules (a meta path finder that raises
ModuleNotFoundError, as a missing distribution would), and records every attempt. Then: rewrite,
inspect and rules work and never even try to import onnxruntime; verify and rewrite --verify exit
2 with one line naming the extra to install, writing nothing.
"""

from __future__ import annotations

import subprocess
import sys

import onnx
import pytest
from conftest import REAL_MODELS, SAMPLES

import onnx_qrewrite
from onnx_qrewrite.errors import EXIT_USAGE, MissingDependencyError, UsageError

SAMPLE = SAMPLES / "dynamic_mlp.onnx"
QUARK = REAL_MODELS / "quark_cnn_op17_a16w8_ext.onnx"
RUNTIME = ("onnxruntime", "onnxruntime_extensions")

# Runs in the child: block the named top-level modules, report each attempt on stderr, then run the
# CLI (argv[2:]) or, with "--api", the Python statements in argv[2].
_SHIM = """
import sys
BLOCKED = set(sys.argv[1].split(","))
class _Absent:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            sys.stderr.write(f"import-attempt {name}\\n")
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _Absent())
if sys.argv[2] == "--api":
    exec(sys.argv[3])
else:
    from onnx_qrewrite.cli import main
    sys.argv = ["onnx-qrewrite", *sys.argv[2:]]
    main()
"""


def without(blocked: tuple[str, ...], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _SHIM, ",".join(blocked), *map(str, args)], capture_output=True, text=True, timeout=120
    )


def _attempts(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("import-attempt")]


def _errors(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("import-attempt")]


def test_rewrite_inspect_and_rules_never_import_the_runtime(tmp_path):
    out = tmp_path / "out.onnx"
    blocked = (*RUNTIME, "onnxscript")
    for args in (["rewrite", SAMPLE, "-o", out], ["inspect", QUARK], ["rules", "--long"]):
        proc = without(blocked, *args)
        assert proc.returncode == 0, (args, proc.stderr)
        assert _attempts(proc) == [], (args, proc.stderr)
    assert not any(n.op_type == "DynamicQuantizeLinear" for n in onnx.load(out).graph.node)


@pytest.mark.parametrize("args", [["verify", SAMPLE, SAMPLE], ["rewrite", SAMPLE, "-o", "{out}", "--verify"]])
def test_verify_without_onnxruntime_exits_2_naming_the_extra(tmp_path, args):
    out = tmp_path / "out.onnx"
    proc = without(RUNTIME, *(str(a).format(out=out) for a in args))
    assert proc.returncode == EXIT_USAGE, proc.stderr
    (line,) = _errors(proc)
    assert line.startswith("onnx-qrewrite: error: verify needs onnxruntime"), line
    assert "pip install 'onnx-qrewrite[verify]'" in line
    assert "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_vendor_ops_without_onnxruntime_extensions_exit_2_naming_the_extra(tmp_path):
    """An onnxruntime flavour without onnxruntime-extensions still verifies standard models; only the
    reference kernels of vendor ops need the extensions, and then verify says so."""
    out = tmp_path / "out.onnx"
    onnx_qrewrite.rewrite(QUARK).save(out)
    copy = tmp_path / "copy.onnx"  # another file: the same file twice compares nothing (exit 6)
    copy.write_bytes(SAMPLE.read_bytes())
    plain = without(("onnxruntime_extensions",), "verify", SAMPLE, copy, "--samples", "1", "--no-battery")
    assert plain.returncode == 0, plain.stderr
    proc = without(("onnxruntime_extensions",), "verify", QUARK, out, "--samples", "1", "--no-battery")
    assert proc.returncode == EXIT_USAGE, proc.stderr
    (line,) = _errors(proc)
    assert "onnxruntime-extensions" in line and "pip install 'onnx-qrewrite[verify]'" in line, line


def test_python_api_raises_an_import_error_that_is_also_a_usage_error():
    code = (
        "import onnx_qrewrite\n"
        "from onnx_qrewrite.errors import MissingDependencyError\n"
        f"by_rule = onnx_qrewrite.rewrite({str(SAMPLE)!r}).report.by_rule()\n"
        "assert by_rule == {'dql-expand': 3, 'int-matmul-float': 3}\n"
        "try:\n"
        f"    onnx_qrewrite.verify({str(SAMPLE)!r}, {str(SAMPLE)!r})\n"
        "except MissingDependencyError as exc:\n"
        "    print('verify:', exc.exit_code, exc)\n"
        "try:\n"
        "    import onnx_qrewrite.onnxscript_rules\n"
        "except ImportError as exc:\n"
        "    print('onnxscript_rules:', exc)\n"
    )
    proc = without((*RUNTIME, "onnxscript"), "--api", code)
    assert proc.returncode == 0, proc.stderr
    verify_line, rules_line = proc.stdout.splitlines()
    assert verify_line.startswith(f"verify: {EXIT_USAGE} verify needs onnxruntime")
    assert rules_line == "onnxscript_rules: onnx_qrewrite.onnxscript_rules needs onnxscript, which is not " + (
        "installed: pip install 'onnx-qrewrite[onnxscript]'"
    )
    assert issubclass(MissingDependencyError, ImportError) and issubclass(MissingDependencyError, UsageError)
