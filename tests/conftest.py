"""Shared test helpers. Real models and Quark kernel vectors are checked in under tests/data (see the
README in each folder for where they came from)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

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


def op_types(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def rule_marker(rule_id: str, kind: str):
    """Mark a test as the positive or negative evidence for a rule (checked by test_catalogue)."""
    assert kind in ("positive", "negative")
    return pytest.mark.rule(rule_id, kind)


def pytest_configure(config):
    config.addinivalue_line("markers", "rule(rule_id, kind): positive/negative evidence for a shipped rule")
