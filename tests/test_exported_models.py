"""Real producers on networks torch exported: every producer's output rewritten to standard ONNX
and verified with the project's defaults.

tests/data/exported holds a bert-tiny-shaped encoder and a small CNN as ``torch.onnx.export``
wrote them (tools/make_exported_models.py; README.md and provenance.json there). Each case runs
one producer here, in the test, on those exports: onnxruntime.quantization's quantize_dynamic,
quantize_static in the QOperator and QDQ formats (and QDQ with the com.microsoft Q/DQ at 16-bit
activations), the MatMulNBits quantizer, and onnxruntime.transformers' optimizer (then
quantize_dynamic on what it fused). The producer's output must carry what that producer writes
(so the case tests what it says), then ``onnx-qrewrite rewrite --verify`` must leave only
default-domain ops and pass, with no tolerance or option beyond the inputs' shape (batch 2,
sequence 8: verify's default of 1 for a symbolic dimension would attend over one token).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
from _cli_helpers import cli_in_process
from conftest import DATA
from onnxruntime import quantization

FOLDER = DATA / "exported"
NETWORKS = {"encoder": FOLDER / "exported_encoder.onnx", "cnn": FOLDER / "exported_cnn.onnx"}
SHAPES = {"encoder": ("--input-shape", "batch=2", "--input-shape", "sequence=8"), "cnn": ("--input-shape", "batch=2")}
MS = "com.microsoft::"


def _feeds(network: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One calibration sample: token ids within the vocabulary (64), two segments, a padded entry."""
    if network == "cnn":
        return {"x": rng.standard_normal((2, 3, 16, 16)).astype(np.float32)}
    mask = np.array([[1] * 8, [1] * 5 + [0] * 3], np.int64)
    return {
        "input_ids": rng.integers(0, 64, (2, 8)).astype(np.int64),
        "token_type_ids": (np.arange(8)[None] >= 4).repeat(2, 0).astype(np.int64),
        "attention_mask": mask,
    }


class _Calibration(quantization.CalibrationDataReader):
    def __init__(self, network: str, n: int = 4) -> None:
        rng = np.random.default_rng(1)
        self._samples = iter([_feeds(network, rng) for _ in range(n)])

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._samples, None)


def _bert_optimized(src: Path, dst: Path) -> None:
    from onnxruntime.transformers.optimizer import optimize_model

    optimize_model(str(src), model_type="bert", num_heads=2, hidden_size=64, opt_level=0).save_model_to_file(str(dst))


def _produce(producer: str, network: str, src: Path, dst: Path) -> None:
    """Run one producer as its documentation shows, with the settings named in CASES."""
    q = quantization
    if producer == "quantize_dynamic":
        q.quantize_dynamic(src, dst)  # its defaults: int8 weights per tensor
    elif producer == "qoperator":  # uint8 activations (onnxruntime's CPU has no int8 QLinearMatMul/Conv)
        q.quantize_static(src, dst, _Calibration(network), quant_format=q.QuantFormat.QOperator,
                          activation_type=q.QuantType.QUInt8, per_channel=True)  # fmt: skip
    elif producer == "qoperator+ort-all":  # saved by onnxruntime's session optimizer: its NHWC com.microsoft ops
        _produce("qoperator", network, src, dst.with_name("qoperator.onnx"))
        options = onnxruntime.SessionOptions()
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.optimized_model_filepath = str(dst)
        onnxruntime.InferenceSession(str(dst.with_name("qoperator.onnx")), options, providers=["CPUExecutionProvider"])
    elif producer == "qdq":
        q.quantize_static(src, dst, _Calibration(network), quant_format=q.QuantFormat.QDQ)
    elif producer == "qdq-contrib-u16":
        q.quantize_static(src, dst, _Calibration(network), quant_format=q.QuantFormat.QDQ,
                          activation_type=q.QuantType.QUInt16, extra_options={"UseQDQContribOps": True})  # fmt: skip
    elif producer.startswith("matmul-nbits"):
        from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

        level = 4 if producer.endswith("-level4") else None
        config = DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=False, bits=4, accuracy_level=level)
        quantizer = MatMulNBitsQuantizer(onnx.load(src), algo_config=config)
        quantizer.process()
        onnx.save(quantizer.model.model, dst)
    elif producer == "bert-optimizer":
        _bert_optimized(src, dst)
    else:  # "bert-optimizer+quantize_dynamic": the fused ops carry no types, as the quantizer says
        _bert_optimized(src, dst.with_name("fused.onnx"))
        q.quantize_dynamic(
            dst.with_name("fused.onnx"), dst, extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT}
        )


#: (producer, network): (vendor-domain or integer ops the producer's output must carry, the rules
#: the rewrite applies). quantize_static's QDQ at 8 bits writes standard ONNX only: nothing to do.
CASES: dict[tuple[str, str], tuple[dict[str, int], dict[str, int]]] = {
    ("quantize_dynamic", "encoder"): (
        {"DynamicQuantizeLinear": 8, "MatMulInteger": 12},
        {"dql-expand": 8, "int-matmul-float-bounded": 12},
    ),
    ("quantize_dynamic", "cnn"): (
        {"DynamicQuantizeLinear": 3, "ConvInteger": 2, "MatMulInteger": 1},
        {"dql-expand": 3, "int-matmul-float": 2, "int-matmul-float-bounded": 1},
    ),
    ("qoperator", "encoder"): (
        {"QLinearMatMul": 16, MS + "QLinearAdd": 22, MS + "QLinearMul": 5, MS + "QLinearSoftmax": 2},
        {"qop-matmul": 16, "qop-add": 22, "qop-mul": 5, "qop-softmax": 2},
    ),
    ("qoperator", "cnn"): (
        {"QLinearConv": 2, MS + "QLinearGlobalAveragePool": 1, MS + "QGemm": 1},
        {"qop-conv": 2, "qop-global-average-pool": 1, "qop-gemm": 1},
    ),
    ("qoperator+ort-all", "cnn"): (
        {MS + "QLinearConv": 2, MS + "NhwcMaxPool": 2, MS + "QLinearGlobalAveragePool": 1, MS + "QGemm": 1},
        {"qop-conv-channels-last": 2, "qop-nhwc-max-pool": 2, "qop-global-average-pool": 1, "qop-gemm": 1},
    ),
    ("qdq", "encoder"): ({"QuantizeLinear": 83, "DequantizeLinear": 112}, {}),
    ("qdq", "cnn"): ({"QuantizeLinear": 8, "DequantizeLinear": 14}, {}),
    ("qdq-contrib-u16", "encoder"): (
        {MS + "QuantizeLinear": 83, MS + "DequantizeLinear": 112},
        {"ms-q-standard": 83, "ms-dq-standard": 112},
    ),
    ("qdq-contrib-u16", "cnn"): (
        {MS + "QuantizeLinear": 8, MS + "DequantizeLinear": 14},
        {"ms-q-standard": 8, "ms-dq-standard": 14},
    ),
    ("matmul-nbits", "encoder"): ({MS + "MatMulNBits": 12}, {"matmul-nbits-blocked-dq": 12}),
    ("bert-optimizer", "encoder"): (
        {MS + "EmbedLayerNormalization": 1, MS + "Attention": 2, MS + "SkipLayerNormalization": 4, MS + "BiasGelu": 2},
        {"unfuse-embed-layer-norm": 1, "unfuse-attention": 2, "unfuse-skip-layer-norm": 4, "unfuse-bias-gelu": 2},
    ),
    ("bert-optimizer+quantize_dynamic", "encoder"): (
        {
            MS + "QEmbedLayerNormalization": 1,
            MS + "QAttention": 2,
            "MatMulInteger": 6,
            MS + "SkipLayerNormalization": 4,
        },
        {
            "unfuse-qembed-layer-norm": 1,
            "unfuse-qattention": 2,
            "dql-expand": 8,
            "int-matmul-float-bounded": 6,
            "unfuse-skip-layer-norm": 4,
            "unfuse-bias-gelu": 2,
        },
    ),
}


def _ops(model: onnx.ModelProto) -> Counter[str]:
    return Counter((f"{n.domain}::" if n.domain not in ("", "ai.onnx") else "") + n.op_type for n in model.graph.node)


def _made(producer: str, network: str, folder: Path) -> Path:
    made = folder / f"{producer}_{network}.onnx"
    _produce(producer, network, NETWORKS[network], made)
    return made


@pytest.mark.parametrize(("producer", "network"), list(CASES), ids=[f"{p}-{n}" for p, n in CASES])
def test_a_producers_model_of_an_export_is_rewritten_to_standard_onnx_and_verifies(tmp_path, producer, network):
    carries, rules = CASES[producer, network]
    made = _made(producer, network, tmp_path)
    original = onnx.load(made)
    ops = _ops(original)
    assert {op: ops[op] for op in carries} == carries, ops
    # onnxruntime's saved models import every domain it knows, most unused: those may stay.
    unused = {o.domain for o in original.opset_import} - {n.domain for n in original.graph.node}
    out, report = tmp_path / "rewritten.onnx", tmp_path / "report.json"
    run = cli_in_process("rewrite", made, "-o", out, "--verify", "--report", report, *SHAPES[network])
    assert run.returncode == 0 and "PASSED" in run.stdout, run.stdout + run.stderr
    rewritten = onnx.load(out)
    assert all(n.domain in ("", "ai.onnx") for n in rewritten.graph.node), _ops(rewritten)
    assert {o.domain for o in rewritten.opset_import} <= {"", "ai.onnx"} | unused
    assert json.loads(report.read_text())["by_rule"] == rules


def test_matmul_nbits_at_accuracy_level_4_is_refused_by_default_and_within_drift_when_allowed(tmp_path):
    """accuracy_level 4: onnxruntime quantizes A to int8 per block, which no float rewrite repeats
    exactly: refused (exit 4, the reason named) unless --allow-approximate, and then judged by drift."""
    made = _made("matmul-nbits-level4", "encoder", tmp_path)
    assert _ops(onnx.load(made))[MS + "MatMulNBits"] == 12
    out = tmp_path / "rewritten.onnx"
    refused = cli_in_process("rewrite", made, "-o", out)
    assert refused.returncode == 4 and "accuracy_level 4" in refused.stdout + refused.stderr, refused.stderr
    assert not out.exists()
    run = cli_in_process("rewrite", made, "-o", out, "--allow-approximate", "--verify", *SHAPES["encoder"])
    assert run.returncode == 0 and "within the drift thresholds" in run.stdout, run.stdout + run.stderr
    assert all(n.domain == "" for n in onnx.load(out).graph.node)
