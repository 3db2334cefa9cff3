"""Shared test helpers. Real models and Quark kernel vectors are checked in under tests/data (see the
README in each folder for where they came from)."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnxruntime.capi import onnxruntime_pybind11_state as _ort_errors

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"
REAL_MODELS = DATA / "models"
QUARK_VECTORS = DATA / "quark_vectors"
# Listed, not globbed: a missing or renamed data file must fail the tests that read it, never shrink
# a parametrization to nothing (which pytest reports as a skip).
REAL_MODEL_NAMES = (
    "ortdyn_cnn_op17_w8u",
    "ortqdq_ms_cnn_op17_a16u_w16s",
    "quark_cnn_op17_a16w8_ext",
    "quark_cnn_op17_bf16",
    "quark_cnn_op17_fp16",
)
SAMPLES = REPO / "sample_models"

# The rule cache (onnx_qrewrite/rewriter/rule_cache.py) of this test run, in a folder of its own: the
# tests, and the console scripts they start, read and write none of the user's cache. Its name carries
# the run's process id, so that a run killed before its atexit (SIGTERM, SIGKILL) leaves a folder the
# next run removes (review 5 R2).
_CACHE_PREFIX = "onnx-qrewrite-tests-cache-"


def _remove_dead_runs_caches() -> None:
    """Remove the cache folders of test runs whose process is gone (ours, real folders only)."""
    for path in Path(tempfile.gettempdir()).glob(f"{_CACHE_PREFIX}*-*"):
        pid = path.name[len(_CACHE_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or path.is_symlink() or not path.is_dir() or path.stat().st_uid != os.getuid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:  # alive, another user's
            continue


_remove_dead_runs_caches()
_RULE_CACHE = tempfile.mkdtemp(prefix=f"{_CACHE_PREFIX}{os.getpid()}-")
os.environ["ONNX_QREWRITE_CACHE_DIR"] = _RULE_CACHE
atexit.register(shutil.rmtree, _RULE_CACHE, True)


def session(model: onnx.ModelProto | str | Path, *, opt: str = "disable", threads: int = 1) -> ort.InferenceSession:
    """An onnxruntime CPU session; graph optimisation off unless asked (it changes QDQ numerics)."""
    so = ort.SessionOptions()
    so.graph_optimization_level = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }[opt]
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    src = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])


# What onnxruntime raises when it refuses a model or a kernel refuses its inputs.
_REFUSED = (_ort_errors.Fail, _ort_errors.InvalidGraph, _ort_errors.InvalidArgument, _ort_errors.RuntimeException)


@functools.cache
def runtime_max_opset() -> int:
    """The highest default-domain opset the installed onnxruntime loads, probed with a one-node model
    (1.31 loads 26; 1.23, the last with a Python 3.10 wheel, 23)."""
    best = 0
    for opset in range(7, onnx.defs.onnx_opset_version() + 1):
        graph = helper.make_graph(
            [helper.make_node("Identity", ["x"], ["y"])],
            "probe",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
        )
        try:
            session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8))
        except _REFUSED:
            break
        best = opset
    return best


def require_runtime_opset(opset: int) -> None:
    """Skip, saying why, when the installed onnxruntime cannot load ``opset``: a limit of that runtime,
    not of the rewrite (the rewrite's validity at that opset is still checked by onnx's checker)."""
    if runtime_max_opset() < opset:
        pytest.skip(
            f"onnxruntime {ort.__version__} loads default-domain opsets up to {runtime_max_opset()}, not {opset}"
        )


@functools.cache
def runtime_runs_int32_dequantize_with_zero_point() -> bool:
    """onnxruntime 1.31 dequantizes int32 with a nonzero zero point; 1.23 refuses ("DequantizeLinear
    with type int32 or float8 should have no zero point or all zero points should be 0")."""
    graph = helper.make_graph(
        [helper.make_node("DequantizeLinear", ["x", "s", "zp"], ["y"])],
        "probe",
        [helper.make_tensor_value_info("x", TensorProto.INT32, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        [helper.make_tensor("s", TensorProto.FLOAT, [], [1.0]), helper.make_tensor("zp", TensorProto.INT32, [], [3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    try:
        run(model, {"x": np.array([5, 7], np.int32)})
    except _REFUSED:
        return False
    return True


def u8s8_saturates_here() -> bool:
    """Whether this CPU's onnxruntime uint8 x int8 kernels saturate adjacent pairs of products to
    int16: x86 without VNNI does ([255, 255] . [127, 127] = 32767), CPUs with AVX-VNNI or
    AVX512-VNNI and ARM give the definition (64770). verify's own measurement, which
    tests/test_u8s8_saturation.py checks against the kernels at realistic shapes. Tests of those
    kernels assert whichever this CPU does; the rewrite's own output is the definition either way.
    What a saturating CPU changes beyond the kernel (bounds, verify's verdicts) is tested on any CPU
    too, inside ``_int_matmul_helpers.on_a_saturating_cpu``."""
    from onnx_qrewrite.verify.u8s8_reference import default_kernel_saturates

    return default_kernel_saturates()


def run(model, feeds: dict[str, np.ndarray], **kw) -> dict[str, np.ndarray]:
    s = session(model, **kw)
    return dict(zip([o.name for o in s.get_outputs()], s.run(None, feeds), strict=True))


def assert_bitwise_equal(actual: np.ndarray, expected: np.ndarray, what: str = "") -> None:
    """Equal bit patterns (so -0.0 != 0.0 and NaN payloads count), with a useful first mismatch."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    a = actual.view(f"u{actual.dtype.itemsize}") if actual.dtype.kind == "f" else actual
    e = expected.view(f"u{expected.dtype.itemsize}") if expected.dtype.kind == "f" else expected
    bad = np.flatnonzero(a.ravel() != e.ravel())
    if bad.size:
        i = bad[0]
        raise AssertionError(
            f"{what}: {bad.size} of {a.size} elements differ; first at flat index {i}: "
            f"got {actual.ravel()[i]!r}, expected {expected.ravel()[i]!r}"
        )


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from this checkout, offline (hatchling is in the test extra), once per run."""
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(REPO)],
        check=True,
        capture_output=True,
    )
    (path,) = out.glob("onnx_qrewrite-*.whl")
    return path


def op_types(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def rule_marker(rule_id: str, kind: str):
    """Mark a test as the positive or negative evidence for a rule (checked by test_catalogue)."""
    assert kind in ("positive", "negative")
    return pytest.mark.rule(rule_id, kind)


def pytest_configure(config):
    config.addinivalue_line("markers", "rule(rule_id, kind): positive/negative evidence for a shipped rule")


#: rule id -> outputs compared by :func:`_check_output_types` this run (tests/test_output_types.py).
OUTPUT_TYPES_COMPARED: dict[str, int] = {}


@pytest.fixture(autouse=True)
def _check_output_types(request, monkeypatch):
    """In the tests that are a rule's positive evidence, every in-process rewrite writes the element
    types its rules' contracts declare (tests/_output_types.py): the emitted ops are checked on
    every rewrite by the Emitter, the emitted types here, on the same rewrites."""
    if not any(m.args[1:2] == ("positive",) for m in request.node.iter_markers("rule")):
        yield
        return
    from _output_types import output_type_problems, unchecked_bound_problems

    from onnx_qrewrite.io.encoded import to_proto
    from onnx_qrewrite.rewriter import engine

    problems: list[str] = []
    real_run = engine.run

    def checked_run(model, catalogue, *args, **kwargs):
        original = onnx.ModelProto()
        original.CopyFrom(model)
        result, report = real_run(model, catalogue, *args, **kwargs)
        found, compared = output_type_problems(original, to_proto(result), report, catalogue)
        problems.extend(found + unchecked_bound_problems(report))
        for rule_id, n in compared.items():
            OUTPUT_TYPES_COMPARED[rule_id] = OUTPUT_TYPES_COMPARED.get(rule_id, 0) + n
        return result, report

    monkeypatch.setattr(engine, "run", checked_run)
    yield
    assert not problems, "output types or bounds differ from the contracts':\n" + "\n".join(problems[:20])
