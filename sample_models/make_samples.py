"""Regenerate the small sample models in this folder from scratch.

Each sample is a small float network built with ``onnx.helper`` (random weights, fixed seeds) and then
quantized by onnxruntime's own quantizers, so the quantized graphs are exactly what a real producer
writes, not hand-made imitations. Beside each ``<name>.onnx`` the script writes ``<name>.inputs.npz``
(seeded sample inputs, keyed by input name) and ``<name>.outputs.npz`` (the quantized model's outputs
in onnxruntime CPU with graph optimisation disabled, keyed by output name): a correct rewrite of the
model must reproduce them.

Everything is deterministic: running the script twice gives byte-identical files (the .npz archives
are written with a fixed timestamp for that reason).

Usage::

    python sample_models/make_samples.py [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import io
import itertools
import logging
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import (
    CalibrationDataReader,
    QuantFormat,
    QuantType,
    quantize_dynamic,
    quantize_static,
)

HERE = Path(__file__).resolve().parent

# onnx 1.23's make_model writes IR version 14, which onnxruntime 1.31 refuses to load (it reads <= 13).
IR_VERSION = 8

# A fixed timestamp for the .npz members, so regenerating gives byte-identical archives.
_ZIP_DATE = (2020, 1, 1, 0, 0, 0)


# ---------------------------------------------------------------------------------------------------
# Float networks


def _init(name: str, array: np.ndarray) -> TensorProto:
    return numpy_helper.from_array(array, name)


def _finish(graph: onnx.GraphProto, opset: int) -> onnx.ModelProto:
    """Wrap a graph into a model at an explicit opset and an IR version onnxruntime 1.31 loads."""
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="make_samples")
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model, full_check=True)
    return model


def float_mlp(seed: int = 0, opset: int = 17) -> onnx.ModelProto:
    """[batch, 64] -> MatMul/Add/Relu -> MatMul/Add/Relu -> MatMul/Add -> [batch, 10]."""
    rng = np.random.default_rng(seed)
    sizes = [64, 96, 48, 10]
    nodes, inits = [], []
    x = "input"
    for i, (n_in, n_out) in enumerate(itertools.pairwise(sizes)):
        w = (rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)).astype(np.float32)
        b = (0.1 * rng.standard_normal(n_out)).astype(np.float32)
        inits += [_init(f"fc{i}.weight", w), _init(f"fc{i}.bias", b)]
        last = i == len(sizes) - 2
        nodes.append(helper.make_node("MatMul", [x, f"fc{i}.weight"], [f"fc{i}.mm"], name=f"fc{i}/MatMul"))
        add_out = "logits" if last else f"fc{i}.out"
        nodes.append(helper.make_node("Add", [f"fc{i}.mm", f"fc{i}.bias"], [add_out], name=f"fc{i}/Add"))
        if not last:
            nodes.append(helper.make_node("Relu", [add_out], [f"relu{i}"], name=f"relu{i}"))
            x = f"relu{i}"
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 64])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
        inits,
    )
    return _finish(graph, opset)


def float_cnn(seed: int = 1, opset: int = 13) -> onnx.ModelProto:
    """[batch, 3, 16, 16] -> (Conv/Relu/MaxPool) x2 -> Flatten -> MatMul/Add -> [batch, 10].

    The classifier is MatMul + Add rather than Gemm because onnxruntime's dynamic quantizer has an
    integer kernel for MatMul (MatMulInteger) but leaves Gemm in float.
    """
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    x, channels = "input", 3
    for i, c_out in enumerate([8, 16]):
        w = (rng.standard_normal((c_out, channels, 3, 3)) / np.sqrt(9 * channels)).astype(np.float32)
        b = (0.1 * rng.standard_normal(c_out)).astype(np.float32)
        inits += [_init(f"conv{i}.weight", w), _init(f"conv{i}.bias", b)]
        nodes += [
            helper.make_node(
                "Conv",
                [x, f"conv{i}.weight", f"conv{i}.bias"],
                [f"conv{i}.out"],
                name=f"conv{i}",
                kernel_shape=[3, 3],
                pads=[1, 1, 1, 1],
            ),
            helper.make_node("Relu", [f"conv{i}.out"], [f"relu{i}"], name=f"relu{i}"),
            helper.make_node(
                "MaxPool", [f"relu{i}"], [f"pool{i}"], name=f"pool{i}", kernel_shape=[2, 2], strides=[2, 2]
            ),
        ]
        x, channels = f"pool{i}", c_out
    flat = channels * 4 * 4  # 16x16 halved twice
    w = (rng.standard_normal((flat, 10)) / np.sqrt(flat)).astype(np.float32)
    b = (0.1 * rng.standard_normal(10)).astype(np.float32)
    inits += [_init("fc.weight", w), _init("fc.bias", b)]
    nodes += [
        helper.make_node("Flatten", [x], ["flat"], name="flatten", axis=1),
        helper.make_node("MatMul", ["flat", "fc.weight"], ["fc.mm"], name="fc/MatMul"),
        helper.make_node("Add", ["fc.mm", "fc.bias"], ["logits"], name="fc/Add"),
    ]
    graph = helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, 16, 16])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
        inits,
    )
    return _finish(graph, opset)


# ---------------------------------------------------------------------------------------------------
# Quantization


class _SeededReader(CalibrationDataReader):
    """Feeds a fixed list of calibration batches, so calibration (and thus every scale) is reproducible."""

    def __init__(self, batches: list[dict[str, np.ndarray]]) -> None:
        self._batches = batches
        self._it: Iterator[dict[str, np.ndarray]] = iter(batches)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._it, None)

    def rewind(self) -> None:
        self._it = iter(self._batches)


def _quantize(float_model: onnx.ModelProto, run: Callable[[Path, Path], None]) -> onnx.ModelProto:
    """Run an onnxruntime quantizer (which works on files) in a scratch folder and load its output."""
    with tempfile.TemporaryDirectory(prefix="make_samples.") as tmp:
        src, dst = Path(tmp) / "float.onnx", Path(tmp) / "quant.onnx"
        onnx.save(float_model, src)
        run(src, dst)
        return onnx.load(dst)


def dynamic_mlp() -> onnx.ModelProto:
    return _quantize(float_mlp(), lambda s, d: quantize_dynamic(s, d, weight_type=QuantType.QUInt8))


def dynamic_cnn() -> onnx.ModelProto:
    return _quantize(float_cnn(), lambda s, d: quantize_dynamic(s, d, weight_type=QuantType.QUInt8))


def qdq_contrib_u16() -> onnx.ModelProto:
    """The CNN quantized statically to com.microsoft Q/DQ with uint16 activations and int16 weights.

    The float model is built at opset 17, but onnxruntime's quantize_static raises any model below
    opset 21 to 21 as soon as a 16-bit type is asked for, even with UseQDQContribOps, so this sample's
    default-domain opset is 21 (as in the shared ortqdq_ms_cnn_op17_a16u_w16s model).
    """
    rng = np.random.default_rng(1234)
    calib = [{"input": rng.standard_normal((1, 3, 16, 16)).astype(np.float32)} for _ in range(8)]

    def run(src: Path, dst: Path) -> None:
        quantize_static(
            src,
            dst,
            _SeededReader(calib),
            quant_format=QuantFormat.QDQ,
            activation_type=QuantType.QUInt16,
            weight_type=QuantType.QInt16,
            extra_options={"UseQDQContribOps": True},
        )

    return _quantize(float_cnn(opset=17), run)


# name -> (builder, input shape with the batch dimension filled in)
SAMPLES: dict[str, tuple[Callable[[], onnx.ModelProto], tuple[int, ...]]] = {
    "dynamic_mlp": (dynamic_mlp, (4, 64)),
    "dynamic_cnn": (dynamic_cnn, (2, 3, 16, 16)),
    "qdq_contrib_u16": (qdq_contrib_u16, (2, 3, 16, 16)),
}


# ---------------------------------------------------------------------------------------------------
# Reference outputs and deterministic files


def run_reference(model_path: Path, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The model's outputs in onnxruntime CPU with graph optimisation off: what a rewrite must reproduce.

    Optimisation is off so the reference is the graph as the producer wrote it, not onnxruntime's
    fused version of it.
    """
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(model_path), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, inputs), strict=True))


def save_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Like np.savez, but with a fixed member timestamp so the archive is byte-identical every run."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        for name in sorted(arrays):
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.asarray(arrays[name]), allow_pickle=False)
            zf.writestr(zipfile.ZipInfo(f"{name}.npy", date_time=_ZIP_DATE), buf.getvalue())


def make_sample(name: str, out_dir: Path, seed: int = 42) -> Path:
    """Build, quantize and save one sample with its inputs and reference outputs; return the model path."""
    build, shape = SAMPLES[name]
    model = build()
    model_path = out_dir / f"{name}.onnx"
    onnx.save(model, model_path)
    rng = np.random.default_rng(seed)
    inputs = {model.graph.input[0].name: rng.standard_normal(shape).astype(np.float32)}
    save_npz(out_dir / f"{name}.inputs.npz", inputs)
    save_npz(out_dir / f"{name}.outputs.npz", run_reference(model_path, inputs))
    return model_path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=HERE, help="where to write (default: this folder)")
    args = parser.parse_args(argv)
    # The quantizers log advice ("consider pre-processing", "updating to opset 21") on the root logger.
    logging.getLogger().setLevel(logging.ERROR)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name in SAMPLES:
        path = make_sample(name, args.out_dir)
        model = onnx.load(path)
        ops = sorted({f"{n.domain + '.' if n.domain else ''}{n.op_type}" for n in model.graph.node})
        opsets = {o.domain or "ai.onnx": o.version for o in model.opset_import}
        print(f"{path.name}: {path.stat().st_size} bytes, ir {model.ir_version}, opsets {opsets}, ops {ops}")


if __name__ == "__main__":
    main()
