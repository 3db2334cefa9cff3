"""The benchmark generators write valid models, at small sizes, that run and mean what they say.

A benchmark on a model that onnxruntime cannot run, or whose weights are not where the model says,
would measure nothing; these tests build each generator's output small and check it end to end.
"""

from __future__ import annotations

import importlib.util
import sys
import tracemalloc
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "models.py"
_spec = importlib.util.spec_from_file_location("benchmarks_models", _PATH)
assert _spec is not None and _spec.loader is not None
models = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = models
_spec.loader.exec_module(models)


def _session(path: Path) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def _dynamic_quantize(x: np.ndarray) -> tuple[np.ndarray, np.float32, np.uint8]:
    """DynamicQuantizeLinear as the ONNX spec defines it (float32 arithmetic, round half to even)."""
    x_max = np.float32(max(0.0, float(x.max())))
    x_min = np.float32(min(0.0, float(x.min())))
    scale = np.float32((x_max - x_min) / np.float32(255))
    zp = np.uint8(np.clip(np.rint(-x_min / scale), 0, 255))
    q = np.clip(np.rint(x / scale) + np.float32(zp), 0, 255).astype(np.uint8)
    return q, scale, zp


def _chain_reference(model: onnx.ModelProto, x: np.ndarray, n_blocks: int) -> np.ndarray:
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    w = inits["W_quantized"].astype(np.int32) - np.int32(inits["W_zero_point"])
    for _ in range(n_blocks):
        q, scale, zp = _dynamic_quantize(x)
        acc = (q.astype(np.int32) - np.int32(zp)) @ w
        x = (acc.astype(np.float32) * scale) * inits["W_scale"]
    return x


def test_chain_runs_and_matches_numpy(tmp_path: Path) -> None:
    path = models.make_dql_chain(3, tmp_path / "chain.onnx")
    model = onnx.load(path)
    onnx.checker.check_model(model, full_check=True)
    assert {o.domain: o.version for o in model.opset_import} == {"": 17} and model.ir_version == 8
    assert Counter(n.op_type for n in model.graph.node) == {
        "DynamicQuantizeLinear": 3,
        "MatMulInteger": 3,
        "Cast": 3,
        "Mul": 6,
    }
    x = np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32)
    (got,) = _session(path).run(None, {"input": x})
    want = _chain_reference(model, x, 3)
    assert np.isfinite(got).all() and np.abs(got).max() > 0.01
    # Bit-identical here (checked over many seeds); a loose tolerance would hide an off-by-one zero point.
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_chain_is_deterministic_and_canonically_serialized(tmp_path: Path) -> None:
    """The chain is spliced together as bytes: it must still be exactly what protobuf would write."""
    a = models.make_dql_chain(1200, tmp_path / "a.onnx").read_bytes()
    b = models.make_dql_chain(1200, tmp_path / "b.onnx").read_bytes()
    assert a == b
    model = onnx.load_from_string(a)
    assert model.SerializeToString() == a
    onnx.checker.check_model(model)
    names = [n.name for n in model.graph.node]
    assert len(names) == len(set(names)) == 6000
    assert model.graph.node[0].input == ["input"] and model.graph.node[-1].output == ["output"]
    assert model.graph.node[-1].name == "blk1199/Mul_w_scale"


def test_chain_of_one_block(tmp_path: Path) -> None:
    path = models.make_dql_chain(1, tmp_path / "one.onnx")
    onnx.checker.check_model(onnx.load(path), full_check=True)
    (got,) = _session(path).run(None, {"input": np.ones((1, 16), np.float32)})
    assert np.isfinite(got).all()


def test_llm_external_data_checks_and_runs(tmp_path: Path) -> None:
    path = tmp_path / "llm" / "model.onnx"
    info = models.make_llm(path, n_layers=2, weights_gb=0.001)
    onnx.checker.check_model(str(path), full_check=True)  # path form: resolves the external data
    model = onnx.load(path, load_external_data=False)
    external = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert len(external) == 2 * 7  # q/k/v/o/gate/up/down per layer
    entries = [{e.key: e.value for e in t.external_data} for t in external]
    assert {e["location"] for e in entries} == {"model.onnx.data"}
    assert sum(int(e["length"]) for e in entries) == info.weight_bytes
    assert abs(info.weight_bytes - 1e6) / 1e6 < 0.25
    data = info.data_path.read_bytes()
    assert len(data) == max(int(e["offset"]) + int(e["length"]) for e in entries)
    first = entries[0]
    assert any(data[int(first["offset"]) : int(first["offset"]) + int(first["length"])]), "weights are all zeros"
    assert Counter(n.op_type for n in model.graph.node)["DynamicQuantizeLinear"] == 2 * 4

    x = np.random.default_rng(0).standard_normal((2, 5, info.hidden)).astype(np.float32)
    (y,) = _session(path).run(None, {"hidden_states": x})
    assert y.shape == x.shape and np.isfinite(y).all()
    (y2,) = _session(path).run(None, {"hidden_states": x})
    np.testing.assert_array_equal(y, y2)


def test_llm_default_shape_has_thousands_of_nodes(tmp_path: Path) -> None:
    info = models.make_llm(tmp_path / "model.onnx", weights_gb=0.001)  # 32 layers
    assert info.n_layers == 32 and 1500 < info.n_nodes < 5000


def test_llm_streams_weights_with_bounded_memory(tmp_path: Path) -> None:
    """100 MB of weights are written while Python holds only a few MB: the generator never buffers them."""
    tracemalloc.start()
    try:
        info = models.make_llm(tmp_path / "model.onnx", n_layers=2, weights_gb=0.1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.data_path.stat().st_size >= info.weight_bytes > 90e6
    assert peak < 16e6, f"peak traced memory {peak / 1e6:.1f} MB"


@pytest.mark.parametrize(("layers", "gb"), [(32, 4.0), (32, 0.001), (4, 1.0)])
def test_llm_sizes_land_near_the_target(layers: int, gb: float) -> None:
    hidden, inter = models.llm_sizes(layers, gb)
    assert hidden % 64 == 0 and inter % 64 == 0
    total = layers * (4 * hidden * hidden + 3 * hidden * inter)
    assert abs(total - gb * 1e9) / (gb * 1e9) < 0.1


@pytest.mark.parametrize("kind", ["bert", "cnn"])
def test_small_quantized_models_run_and_their_rewrite_is_bit_exact(tmp_path: Path, kind: str) -> None:
    """The inference benchmark's models: quantize_dynamic output that runs, whose rewrite gives the
    same bits with onnxruntime's basic optimisations. With all of them on (the setting the benchmark
    times), onnxruntime fuses the original's DynamicQuantizeLinear + MatMulInteger into its own
    contrib kernels and the rewrite's float graph into other fusions: the results then differ in
    the last bits (measured: at most 6e-7 on this model)."""
    import onnx_qrewrite

    path = tmp_path / f"{kind}.onnx"
    if kind == "bert":
        models.make_bert(path, n_layers=1, hidden=64, heads=2, intermediate=128, vocab=64, max_seq=16)
        feeds = {"input_ids": np.random.default_rng(0).integers(0, 64, (2, 7)).astype(np.int64)}
    else:
        models.make_cnn(path, channels=(4, 8))
        feeds = {"pixels": np.random.default_rng(0).standard_normal((2, 3, 8, 8)).astype(np.float32)}
    model = onnx.load(path)
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["DynamicQuantizeLinear"] >= 2 and (ops["MatMulInteger"] or ops["ConvInteger"])
    rewritten = onnx_qrewrite.rewrite(model).model
    assert "DynamicQuantizeLinear" not in {n.op_type for n in rewritten.graph.node}
    for level in (ort.GraphOptimizationLevel.ORT_ENABLE_BASIC, ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        opts.graph_optimization_level = level
        run = [
            ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
            for m in (model, rewritten)
        ]
        assert np.isfinite(run[0]).all()
        if level == ort.GraphOptimizationLevel.ORT_ENABLE_BASIC:
            np.testing.assert_array_equal(run[1].view(np.uint32), run[0].view(np.uint32))
        else:
            np.testing.assert_allclose(run[1], run[0], rtol=0, atol=2e-6)


def test_nbits_layers_run_and_match_numpy(tmp_path: Path) -> None:
    """The MatMulNBits benchmark model computes ``A @ ((q - zp) * scale)`` layer after layer:
    its nibbles packed low first, its zero points two to a byte, as the kernel reads them."""
    path = models.make_nbits(tmp_path / "nbits.onnx", k=96, n=64, layers=2, tokens=3)
    model = onnx.load(path)
    onnx.checker.check_model(model, full_check=True)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    x = np.random.default_rng(1).standard_normal((1, 3, 96)).astype(np.float32)
    want = x.astype(np.float64)
    for i, (k, blocks) in enumerate(((96, 3), (64, 2))):
        packed, zp = inits[f"layer{i}.B"], inits[f"layer{i}.zero_points"].reshape(64, -1)
        q = np.stack([packed & 15, packed >> 4], axis=-1).reshape(64, blocks, 32).astype(np.float64)
        zps = np.stack([zp & 15, zp >> 4], axis=-1).reshape(64, -1)[:, :blocks, None].astype(np.float64)
        w = ((q - zps) * inits[f"layer{i}.scales"][..., None]).reshape(64, k)
        want = want @ w.T
    got = _session(path).run(None, {"A": x})[0]
    assert got.shape == (1, 3, 64)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
