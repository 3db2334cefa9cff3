"""The shipped sample models are what their README says they are, and their stored outputs still hold.

These files are the fixtures other tests rewrite and compare against, so a sample that silently lost
its quantized ops, or whose .outputs.npz no longer matches onnxruntime, would make those tests prove
nothing.
"""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

SAMPLES_DIR = Path(__file__).resolve().parent.parent / "sample_models"

# name -> (default-domain opset, {(domain, op_type): count}) as onnxruntime 1.31's quantizers write them.
EXPECTED = {
    "dynamic_mlp": (17, {("", "DynamicQuantizeLinear"): 3, ("", "MatMulInteger"): 3}),
    "dynamic_cnn": (13, {("", "DynamicQuantizeLinear"): 3, ("", "ConvInteger"): 2, ("", "MatMulInteger"): 1}),
    "qdq_contrib_u16": (21, {("com.microsoft", "QuantizeLinear"): 8, ("com.microsoft", "DequantizeLinear"): 14}),
}


def _load_npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


def _run(model_path: Path, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(model_path), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, inputs), strict=True))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_sample_is_what_it_claims(name: str) -> None:
    path = SAMPLES_DIR / f"{name}.onnx"
    assert path.stat().st_size < 200_000, "samples are meant to stay small"
    model = onnx.load(path)
    onnx.checker.check_model(model, full_check=True)
    opset, expected_ops = EXPECTED[name]
    assert {o.domain: o.version for o in model.opset_import}[""] == opset
    assert model.ir_version <= 13, "onnxruntime 1.31 loads IR versions up to 13"
    counts = Counter((n.domain, n.op_type) for n in model.graph.node)
    for op, count in expected_ops.items():
        assert counts[op] == count, f"{name}: expected {count} x {op}, found {counts[op]}"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_sample_reproduces_stored_outputs(name: str) -> None:
    inputs = _load_npz(SAMPLES_DIR / f"{name}.inputs.npz")
    expected = _load_npz(SAMPLES_DIR / f"{name}.outputs.npz")
    model = onnx.load(SAMPLES_DIR / f"{name}.onnx")
    assert set(inputs) == {i.name for i in model.graph.input}
    assert set(expected) == {o.name for o in model.graph.output}
    got = _run(SAMPLES_DIR / f"{name}.onnx", inputs)
    for key, want in expected.items():
        assert got[key].dtype == want.dtype and got[key].shape == want.shape
        # Same build of onnxruntime gives identical bits; allow float-rounding slack for other CPUs.
        np.testing.assert_allclose(got[key], want, rtol=1e-5, atol=1e-5, err_msg=f"{name}:{key}")


@pytest.mark.skipif(ort.__version__ != "1.31.1", reason="the samples were made by onnxruntime 1.31.1's quantizers")
def test_make_samples_regenerates_the_shipped_files(tmp_path: Path) -> None:
    """The committed models are exactly what the script beside them makes (so they can be regenerated)."""
    spec = importlib.util.spec_from_file_location("make_samples", SAMPLES_DIR / "make_samples.py")
    assert spec is not None and spec.loader is not None
    make_samples = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_samples)
    for name in EXPECTED:
        # make_sample, not main(): main() quietens the root logger, which would leak into other tests.
        make_samples.make_sample(name, tmp_path)
        for suffix in (".onnx", ".inputs.npz"):
            made, shipped = tmp_path / f"{name}{suffix}", SAMPLES_DIR / f"{name}{suffix}"
            assert made.read_bytes() == shipped.read_bytes(), f"{shipped.name} differs from what make_samples.py writes"
