"""The target verdicts checked against the real runtimes installed here (OpenVINO, tract, QNN's
HTP simulator): every test model, as given, as today's default rewrite and as the rewrite for the
target, is loaded and run on the runtime with its recorded inputs; it "runs" when it loads, runs
and agrees with onnxruntime running the original (the recorded outputs) within the runtime's
default tolerance (verify/runtimes.py). ``inspect --target`` must say "refused" exactly when it
does not run. The runtimes are extras installed in CI (.ci/run installs the test extra, which
pulls them); elsewhere these tests skip, naming the missing package.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import REAL_MODELS, SAMPLES

from onnx_qrewrite import rewrite
from onnx_qrewrite.api import load_rules
from onnx_qrewrite.errors import QRewriteError
from onnx_qrewrite.targets import check_model, load_target, plan_for_target
from onnx_qrewrite.verify.runtimes import RUNTIMES, make_runner

MODELS = [
    SAMPLES / "dynamic_mlp.onnx",
    SAMPLES / "dynamic_cnn.onnx",
    SAMPLES / "qdq_contrib_u16.onnx",
    *sorted(REAL_MODELS.glob("*.onnx")),
]
RUNTIME_MODULES = {"openvino": "openvino", "tract": "tract", "qnn": "onnxruntime_qnn"}


def _runtime(name: str) -> str:
    if name == "tflite":
        from onnx_qrewrite.errors import MissingDependencyError
        from onnx_qrewrite.verify.runtimes import TFLITE_PYTHON_ENV, tflite_python

        try:
            tflite_python()
        except MissingDependencyError:
            pytest.skip(f"needs onnx2tf and ai-edge-litert on Python 3.12+ (${TFLITE_PYTHON_ENV})")
        return name
    pytest.importorskip(RUNTIME_MODULES[name], reason=f"needs {RUNTIMES[name].distribution} (extra [{name}])")
    return name


def _io(path: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    stem = str(path)[: -len(".onnx")]
    inputs = dict(np.load(stem + ".inputs.npz"))
    outputs = dict(np.load(stem + ".outputs.npz"))
    return inputs, outputs


def runs_on(runtime: str, model: onnx.ModelProto, inputs, expected) -> tuple[bool, str]:
    """Loads, runs and agrees with onnxruntime running the original (recorded outputs)."""
    spec = RUNTIMES[runtime]
    shapes = {k: v.shape for k, v in inputs.items()}
    try:
        runner = make_runner(runtime, model, label="model", shapes=shapes)
        got = runner.run(inputs)
    except QRewriteError as exc:
        return False, str(exc)
    worst = 0.0
    for name, recorded in expected.items():
        have = np.asarray(got[name], dtype=np.float64)
        want = np.asarray(recorded, dtype=np.float64)
        if have.shape != want.shape:
            return False, f"{name}: shape {have.shape} != {want.shape}"
        bad = np.abs(have - want) > spec.atol + spec.rtol * np.abs(want)
        worst = max(worst, float(np.max(np.abs(have - want))))
        if np.any(bad) or not np.all(np.isfinite(have) == np.isfinite(want)):
            return False, f"{name}: wrong numbers, max abs error {worst:.3g}"
    return True, f"max abs error {worst:.3g}"


def _forms(path: Path, target: str):
    """The model as given, today's default rewrite, and the rewrite for the target; a form equal
    to an earlier one (e.g. the target rewrite when no rule was left out) is not run twice."""
    plan = plan_for_target(path, load_rules(), load_target(target))
    forms = [
        ("original", onnx.load(path)),
        ("default rewrite", rewrite(onnx.load(path), allow_unlowered=True).model),
        ("target rewrite", plan.rewritten),
    ]
    seen: set[bytes] = set()
    for form, model in forms:
        key = _without_metadata(model)
        if key not in seen:
            seen.add(key)
            yield form, model


def _without_metadata(model: onnx.ModelProto) -> bytes:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    del copy.metadata_props[:]
    for node in copy.graph.node:
        del node.metadata_props[:]
    return copy.SerializeToString()


@pytest.mark.parametrize("runtime", ["openvino", "tract", "qnn", "tflite"])
@pytest.mark.parametrize("path", MODELS, ids=lambda p: Path(p).stem)
def test_verdict_agrees_with_the_runtime(runtime, path):
    _runtime(runtime)
    profile = load_target(runtime)
    inputs, expected = _io(path)
    ran_as = {}
    for form, model in _forms(path, runtime):
        refused = check_model(model, profile)
        ran, detail = runs_on(runtime, model, inputs, expected)
        ran_as[form] = ran
        why = "; ".join(f"{r.node}: {r.reasons[0]}" for r in refused[:3])
        assert ran == (not refused), f"{form}: runtime says {'runs' if ran else 'fails'} ({detail}); verdict: {why}"
    # Never make things worse: a model the runtime ran still runs after `rewrite --target`
    # (a target rewrite equal to the original is not run twice: it is the original).
    if ran_as["original"]:
        assert ran_as.get("target rewrite", True), "the target rewrite no longer runs"


# -- verify --runtime -----------------------------------------------------------------------------


def cli(*args):
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "onnx_qrewrite", *map(str, args)], capture_output=True, text=True, timeout=300
    )


def test_verify_on_openvino_passes_a_good_rewrite_and_states_its_settings(tmp_path):
    _runtime("openvino")
    out, report = tmp_path / "out.onnx", tmp_path / "r.json"
    assert cli("rewrite", SAMPLES / "dynamic_cnn.onnx", "-o", out).returncode == 0
    proc = cli("verify", SAMPLES / "dynamic_cnn.onnx", out, "--runtime", "openvino", "--report", report)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rewritten ran on openvino" in proc.stdout and "INFERENCE_PRECISION_HINT=f32" in proc.stdout
    body = __import__("json").loads(report.read_text())
    assert body["settings"]["runtime"]["name"] == "openvino"
    assert body["settings"]["runtime"]["settings"]["INFERENCE_PRECISION_HINT"] == "f32"
    jsonschema = pytest.importorskip("jsonschema")
    from onnx_qrewrite.verify import SCHEMA_PATH

    jsonschema.validate(body, __import__("json").loads(Path(SCHEMA_PATH).read_text()))


def test_openvino_wrong_numbers_on_uint16_qdq_are_an_obvious_failure(tmp_path):
    """OpenVINO 2026.4.1 runs a uint16 QDQ model and computes wrong numbers: verify must fail loudly
    (errors of thousands on the battery's wide-range sample), not pass within some tolerance."""
    _runtime("openvino")
    out = tmp_path / "out.onnx"
    assert cli("rewrite", SAMPLES / "qdq_contrib_u16.onnx", "-o", out).returncode == 0
    ok = cli("verify", SAMPLES / "qdq_contrib_u16.onnx", out)  # in onnxruntime the rewrite is exact
    assert ok.returncode == 0, ok.stdout
    proc = cli("verify", SAMPLES / "qdq_contrib_u16.onnx", out, "--runtime", "openvino")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAILED" in proc.stdout
    report = tmp_path / "r.json"
    cli("verify", SAMPLES / "qdq_contrib_u16.onnx", out, "--runtime", "openvino", "--report", report)
    (output,) = __import__("json").loads(report.read_text())["outputs"]
    assert output["max_abs_error"] > 100, output  # far outside any tolerance: an obvious failure


def test_a_runtime_refusing_the_rewrite_is_one_line_naming_it(tmp_path):
    _runtime("tract")
    out = tmp_path / "out.onnx"
    assert cli("rewrite", SAMPLES / "dynamic_mlp.onnx", "-o", out).returncode == 0
    proc = cli("verify", SAMPLES / "dynamic_mlp.onnx", out, "--runtime", "tract")
    assert proc.returncode == 3
    (line,) = proc.stderr.strip().splitlines()
    assert "tract cannot load the model" in line and "QuantizeLinear" in line


def test_providers_apply_to_onnxruntime_only(tmp_path):
    proc = cli(
        "verify", SAMPLES / "dynamic_mlp.onnx", SAMPLES / "dynamic_mlp.onnx", "--runtime", "tract", "--providers", "X"
    )
    assert proc.returncode == 2 and "--providers" in proc.stderr
    copy = tmp_path / "copy.onnx"  # another file: the same file twice compares nothing (exit 6)
    copy.write_bytes((SAMPLES / "dynamic_mlp.onnx").read_bytes())
    proc = cli("verify", SAMPLES / "dynamic_mlp.onnx", copy, "--providers", "CPUExecutionProvider")
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    ("runtime", "module"), [("openvino", "openvino"), ("tract", "tract"), ("qnn", "onnxruntime_qnn")]
)
def test_a_missing_runtime_exits_2_naming_the_extra(tmp_path, runtime, module):
    from test_optional_dependencies import without

    out = tmp_path / "out.onnx"
    proc = without(
        (module,), "verify", SAMPLES / "dynamic_mlp.onnx", SAMPLES / "dynamic_mlp.onnx", "--runtime", runtime
    )
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("import-attempt")]
    assert errors == [
        f"onnx-qrewrite: error: --runtime {runtime} needs {RUNTIMES[runtime].distribution}, which is not installed: "
        f"pip install 'onnx-qrewrite[{runtime}]'"
    ]
    assert not out.exists()


def test_inspect_target_and_targets_need_no_runtime():
    from test_optional_dependencies import without

    blocked = ("onnxruntime", "onnxruntime_extensions", "onnxscript", "openvino", "tract", "onnxruntime_qnn")
    for args in (["inspect", SAMPLES / "dynamic_cnn.onnx", "--target", "tract"], ["targets", "--long"]):
        proc = without(blocked, *args)
        assert proc.returncode == 0, (args, proc.stderr)
        assert "import-attempt" not in proc.stderr, (args, proc.stderr)
