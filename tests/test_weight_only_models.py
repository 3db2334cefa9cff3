"""The "weight-only" form on real producer models: small float networks quantized in the fixture by
onnxruntime.quantization.quantize_dynamic itself (uint8 and 7-bit int8 weights, per tensor and
per channel), the same fused by onnxruntime's optimizer (com.microsoft DynamicQuantizeMatMul,
MatMulIntegerToFloat), and the benchmarks' BERT-like encoder (Q/K/V share one
DynamicQuantizeLinear) and CNN. Each is rewritten to standard ops only, with the weights as
DequantizeLinear of the original integers or as float initializers, and its drift from onnxruntime
running the original is measured on fixed seeded inputs and held to the bound in ``DRIFT``.

Drift is measured with onnxruntime's graph optimizations off on both sides, so it is the drift of
the models as written. (With them on, onnxruntime fuses ``DequantizeLinear(uint8/int8 W) ->
MatMul`` into its own MatMulNBits kernel, which computes differently again: that is onnxruntime's
choice, not the rewrite's; see the report for the numbers.)
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import rule_marker, session
from onnxruntime.quantization import quantize_dynamic
from test_lower_quantize_dynamic_models import _VARIANTS, _optimized

import onnx_qrewrite
from onnx_qrewrite.rewriter.catalogue import load_catalogue, named_form

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "models.py"
_spec = importlib.util.spec_from_file_location("benchmarks_models_weight_only", _PATH)
assert _spec is not None and _spec.loader is not None
models = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = models
_spec.loader.exec_module(models)

APPROXIMATE = ("exact", "bounded", "approximate")
_LEFT_OVER = {"DynamicQuantizeLinear", "MatMulInteger", "ConvInteger", "MatMulIntegerToFloat", "DynamicQuantizeMatMul"}

#: Bounds on the drift from onnxruntime running the original, worst over SAMPLES seeded inputs, per
#: model family (fused variants and both weight forms alike). Measured (onnxruntime 1.31, CPU):
#: max abs 0.0275 / 0.0300 (MLP uint8 / int8 per channel; outputs up to 3.5), 0.0082 (test CNN),
#: 0.0591 (BERT-like, LayerNorm outputs up to ~4), 0.0026 (benchmark CNN, logits ~0.3); relative
#: L2 at most 0.0122; cosine similarity at least 0.99992. The bounds leave ~20% headroom and are
#: tight enough that a dropped weight zero point breaks them (test below).
DRIFT = {
    "mlp": {"max_abs": 0.036, "rel_l2": 0.012},
    "cnn-u8": {"max_abs": 0.010, "rel_l2": 0.0065},
    "bert": {"max_abs": 0.071, "rel_l2": 0.015},
    "cnn": {"max_abs": 0.0032, "rel_l2": 0.005},
}
MIN_COSINE = 0.9999
SAMPLES = 3


def _form(weights: str):
    return load_catalogue([named_form("weight-only")]).with_option("weights", weights)


def _inputs(model: Path, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for i in session(model).get_inputs():
        shape = [
            d if isinstance(d, int) else {"batch": 2, "seq": 16, "height": 32, "width": 32}.get(d, 2) for d in i.shape
        ]
        if i.type == "tensor(int64)":
            feeds[i.name] = rng.integers(0, 1024, shape).astype(np.int64)
        else:
            feeds[i.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def _producer_models(folder: Path) -> dict[str, Path]:
    out = {}
    for name, (build, options) in _VARIANTS.items():
        float_model = build(folder / f"{name}-float.onnx")
        out[name] = folder / f"{name}.onnx"
        quantize_dynamic(str(float_model), str(out[name]), **options)
        out[f"{name}-fused"] = _optimized(out[name], folder / f"{name}-fused.onnx")
    out["bert"] = models.make_bert(folder / "bert.onnx")
    out["bert-fused"] = _optimized(out["bert"], folder / "bert-fused.onnx")
    out["cnn"] = models.make_cnn(folder / "cnn.onnx")
    return out


@pytest.fixture(scope="module")
def producer_models(tmp_path_factory) -> dict[str, Path]:
    return _producer_models(tmp_path_factory.mktemp("weight-only"))


def drift(original: Path, rewritten: onnx.ModelProto) -> dict[str, float]:
    """max abs, relative L2 and cosine similarity over SAMPLES seeded inputs, worst case."""
    a, b = session(original), session(rewritten)
    worst = {"max_abs": 0.0, "rel_l2": 0.0, "cosine": 1.0}
    for seed in range(SAMPLES):
        feeds = _inputs(original, seed)
        for expected, got in zip(a.run(None, feeds), b.run(None, feeds), strict=True):
            x, y = expected.astype(np.float64).ravel(), got.astype(np.float64).ravel()
            worst["max_abs"] = max(worst["max_abs"], float(np.abs(x - y).max()))
            worst["rel_l2"] = max(worst["rel_l2"], float(np.linalg.norm(x - y) / np.linalg.norm(x)))
            worst["cosine"] = min(worst["cosine"], float(x @ y / np.linalg.norm(x) / np.linalg.norm(y)))
    return worst


def _family(name: str) -> str:
    return next(f for f in ("mlp", "cnn-u8", "bert", "cnn") if name.startswith(f))


_NAMES = [f"{v}{s}" for v in sorted(_VARIANTS) for s in ("", "-fused")] + ["bert", "bert-fused", "cnn"]


@rule_marker("weight-only-matmul", "positive")
@rule_marker("weight-only-ms-matmul", "positive")
@rule_marker("weight-only-remove-dead", "positive")
@pytest.mark.parametrize("weights", ["dequantize", "float"])
@pytest.mark.parametrize("name", _NAMES)
def test_producer_models_become_standard_onnx_within_the_measured_drift(producer_models, name, weights):
    original = producer_models[name]
    before = onnx.load(original)
    result = onnx_qrewrite.rewrite(original, rules=_form(weights), allow=APPROXIMATE)
    out = result.model
    ops = [(n.domain, n.op_type) for n in out.graph.node]
    assert all(domain in ("", "ai.onnx") for domain, _ in ops), ops
    assert not {op for _, op in ops} & _LEFT_OVER, ops
    # Every integer matmul/conv became a float one of the activation (none went the exact way).
    assert not any(r.rule.startswith(("int-matmul", "ms-int-matmul", "dql-")) for r in result.report.rewrites)
    dequantized = [n for n in out.graph.node if n.op_type == "DequantizeLinear"]
    if weights == "float":
        assert not dequantized  # BERT's quantized embedding table included
        assert all(t.data_type != onnx.TensorProto.UINT8 for t in out.graph.initializer)
    else:  # every DequantizeLinear reads an integer weight as quantize_dynamic wrote it
        initializers = {t.name: t.data_type for t in out.graph.initializer}
        assert dequantized
        for node in dequantized:
            assert initializers[node.input[0]] in (onnx.TensorProto.INT8, onnx.TensorProto.UINT8)
    assert [o.SerializeToString() for o in out.graph.output] == [o.SerializeToString() for o in before.graph.output]
    onnx.checker.check_model(out, full_check=True)
    measured = drift(original, out)
    bound = DRIFT[_family(name)]
    assert measured["max_abs"] <= bound["max_abs"], measured
    assert measured["rel_l2"] <= bound["rel_l2"], measured
    assert measured["cosine"] >= MIN_COSINE, measured


def test_the_drift_bound_catches_a_dropped_weight_zero_point(producer_models):
    """A broken rewrite (the uint8 weights' zero point left out of one DequantizeLinear) is caught."""
    original = producer_models["mlp-u8"]
    out = onnx_qrewrite.rewrite(original, rules=_form("dequantize"), allow=APPROXIMATE).model
    dq = next(n for n in out.graph.node if n.op_type == "DequantizeLinear")
    del dq.input[2:]
    measured = drift(original, out)
    assert measured["max_abs"] > DRIFT["mlp"]["max_abs"], measured


@pytest.mark.parametrize(("name", "weights"), [("mlp-s8-per-channel-fused", "dequantize"), ("bert", "float")])
def test_verify_judges_the_rewrite_by_drift_and_passes(producer_models, name, weights, tmp_path):
    """onnx_qrewrite.verify sees the approximate rules in the rewrite's provenance and judges its
    outputs by end-to-end drift (verify/drift.py): the weight-only form passes its thresholds."""
    original = producer_models[name]
    rewritten = tmp_path / "rewritten.onnx"
    onnx_qrewrite.rewrite(original, rules=_form(weights), allow=APPROXIMATE).save(rewritten)
    report = onnx_qrewrite.verify(original, rewritten, samples=2)
    assert report.passed, report.summary
    assert "drift" in report.summary


def _with_dequantized_weights(float_model: onnx.ModelProto, quantized: Path) -> onnx.ModelProto:
    """The float network with every weight quantize_dynamic quantized replaced by its dequantized
    value, (W_q - zp) * scale in float64 from the producer's own integers (the meaning of
    "weight-only", computed without the form's code)."""
    from onnx import numpy_helper

    q = {t.name: numpy_helper.to_array(t) for t in onnx.load(quantized).graph.initializer}
    replaced = 0
    for t in float_model.graph.initializer:
        wq, scale, zp = (q.get(f"{t.name}_{part}") for part in ("quantized", "scale", "zero_point"))
        if wq is None or scale is None or zp is None:
            continue
        shape = [1] * wq.ndim
        if scale.size > 1:  # per output channel (Conv, axis 0) or column (MatMul, axis 1)
            shape[0 if wq.ndim == 4 else 1] = -1
        w = (wq.astype(np.float64) - zp.astype(np.float64).reshape(shape)) * scale.astype(np.float64).reshape(shape)
        t.CopyFrom(numpy_helper.from_array(w.astype(np.float32), t.name))
        replaced += 1
    assert replaced
    return float_model


@pytest.mark.parametrize("name", ["mlp-u8", "mlp-s8-per-channel", "cnn-u8-per-channel", "bert", "cnn"])
def test_the_rewrite_is_the_float_network_with_the_producers_dequantized_weights(name, tmp_path):
    """The drift above is all activation quantization: the form computes exactly the float network
    with quantize_dynamic's dequantized weights (its bias and per-channel scales included), to
    float32 summation order. So a drift larger than another tool's on other models is the models'
    (depth, activation ranges), not something this form does differently."""
    quantized = tmp_path / "q.onnx"
    if name in _VARIANTS:
        build, options = _VARIANTS[name]
        float_path = build(tmp_path / "float.onnx")
        quantize_dynamic(str(float_path), str(quantized), **options)
        float_model = onnx.load(float_path)
    else:
        float_model = models.float_bert() if name == "bert" else models.float_cnn()
        (models.make_bert if name == "bert" else models.make_cnn)(quantized)
    reference = session(_with_dequantized_weights(float_model, quantized))
    rewritten = session(onnx_qrewrite.rewrite(quantized, rules=_form("dequantize"), allow=APPROXIMATE).model)
    for seed in range(2):
        feeds = _inputs(quantized, seed)
        for expected, got in zip(reference.run(None, feeds), rewritten.run(None, feeds), strict=True):
            np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)


def _drift_table() -> None:
    """The measurements behind DRIFT, printed: ``python tests/test_weight_only_models.py``. Also the
    drift when onnxruntime runs the rewrite with its default graph optimizations (which fuse
    DequantizeLinear -> MatMul into its own MatMulNBits kernel)."""
    import tempfile

    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as folder:
        found = _producer_models(Path(folder))
        print(
            f"{'model':28} {'weights':10} {'max abs':>9} {'rel L2':>8} {'cosine':>9}  {'max abs, ort default opt':>24}"
        )
        for name, path in found.items():
            for weights in ("dequantize", "float"):
                out = onnx_qrewrite.rewrite(path, rules=_form(weights), allow=APPROXIMATE).model
                measured = drift(path, out)
                optimized = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"])
                reference = session(path)
                feeds = _inputs(path, 0)
                default = max(
                    float(np.abs(a.astype(np.float64) - b).max())
                    for a, b in zip(reference.run(None, feeds), optimized.run(None, feeds), strict=True)
                )
                print(
                    f"{name:28} {weights:10} {measured['max_abs']:9.4g} {measured['rel_l2']:8.3g} "
                    f"{measured['cosine']:9.6f}  {default:24.4g}"
                )


if __name__ == "__main__":
    _drift_table()
