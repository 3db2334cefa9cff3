"""Form qdq-movement: a data-movement op on a quantized tensor between DequantizeLinear and
QuantizeLinear (builders/qdq_movement.py), and what it gives TensorRT on a QOperator model.

The rewrite is bit-exact by construction wherever Q(DQ(c)) = c for every code; the positive test
runs each op, uint8 and int8, with parameters from the producer and from the reader, on ordinary
and edge inputs in onnxruntime against the original. The negative ones show the rule declining
where the round trip fails (a scale that overflows) or the parameters are computed at run time."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import rule_marker
from onnx import TensorProto, helper, numpy_helper

from onnx_qrewrite import rewrite
from onnx_qrewrite.api import load_rules
from onnx_qrewrite.rewriter.builders.qdq_movement import round_trips
from onnx_qrewrite.rewriter.catalogue import load_catalogue, named_form
from onnx_qrewrite.targets import check_model, load_target, plan_for_model

RULE = "qdq-movement-sandwich"
REPO = Path(__file__).resolve().parent.parent


def _form():
    return load_catalogue([named_form("qdq-movement")], include_shipped=False)


def _run(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(None, feed)


#: op -> (extra inputs as initializers, attributes): each reads x of shape (2, 3, 4).
OPS = {
    "Reshape": ([numpy_helper.from_array(np.array([4, 6], np.int64), "shape")], {}),
    "Flatten": ([], {"axis": 2}),
    "Transpose": ([], {"perm": [2, 0, 1]}),
    "Squeeze": ([numpy_helper.from_array(np.array([0], np.int64), "axes")], {}),
    "Unsqueeze": ([numpy_helper.from_array(np.array([1], np.int64), "axes")], {}),
    "Identity": ([], {}),
    "Gather": ([numpy_helper.from_array(np.array([[2, 0], [1, 1]], np.int64), "idx")], {"axis": 1}),
}


OUT_SHAPES = {
    "Reshape": [4, 6],
    "Flatten": [6, 4],
    "Transpose": [4, 2, 3],
    "Squeeze": [3, 4],
    "Unsqueeze": [2, 1, 3, 4],
    "Identity": [2, 3, 4],
    "Gather": [2, 2, 2, 4],
}


def _moved(op: str, dtype: int, scale: float, zp: int, *, params_from: str) -> onnx.ModelProto:
    """x -> QuantizeLinear -> op (uint8/int8) -> DequantizeLinear -> y; ``params_from`` "producer"
    gives the QuantizeLinear the parameters, "reader" only the DequantizeLinear (the Q has its own)."""
    extra, attrs = OPS[op]
    x_shape = [1, 3, 4] if op == "Squeeze" else [2, 3, 4]
    own = (scale * 1.5, zp) if params_from == "reader" else (scale, zp)
    np_type = helper.tensor_dtype_to_np_dtype(dtype)
    inits = [
        *extra,
        numpy_helper.from_array(np.array(own[0], np.float32), "qs"),
        numpy_helper.from_array(np.array(own[1], np_type), "qz"),
        numpy_helper.from_array(np.array(scale, np.float32), "ds"),
        numpy_helper.from_array(np.array(zp, np_type), "dz"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "qs", "qz"], ["q"], name="q"),
        helper.make_node(op, ["q", *[t.name for t in extra]], ["moved"], name="op", **attrs),
        helper.make_node("DequantizeLinear", ["moved", "ds", "dz"], ["y"], name="dq"),
    ]
    if params_from == "reader":  # the producer is no QuantizeLinear: a Cast of integer-valued x
        nodes[0] = helper.make_node("Cast", ["x"], ["q"], name="q", to=dtype)
        inits = inits[:-4] + inits[-2:]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, OUT_SHAPES[op])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _inputs(shape: list[int], rng: np.random.Generator, integers: tuple[int, int] | None) -> list[np.ndarray]:
    if integers is not None:  # a Cast's input: integer-valued, inside the type
        return [rng.integers(integers[0], integers[1] + 1, shape).astype(np.float32) for _ in range(4)]
    edge = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 1e38, -1e38, 0.5, -0.5, 1e-45, 3.0, -7.25], np.float32)
    wide = [rng.standard_normal(shape).astype(np.float32) * s for s in (0.01, 1.0, 100.0)]
    return [*wide, np.resize(edge, shape).astype(np.float32)]


@rule_marker("qdq-movement-sandwich", "positive")
@pytest.mark.parametrize("params_from", ["producer", "reader"])
@pytest.mark.parametrize("dtype", [TensorProto.UINT8, TensorProto.INT8])
@pytest.mark.parametrize("op", list(OPS))
def test_the_op_moves_to_float_between_dq_and_q_bit_exactly(op, dtype, params_from):
    zp = 131 if dtype == TensorProto.UINT8 else -7
    model = _moved(op, dtype, 0.0325912, zp, params_from=params_from)
    result = rewrite(model, rules=_form(), only=[RULE], allow_unlowered=True)
    assert result.report.by_rule() == {RULE: 1}
    nodes = {n.op_type: n for n in result.model.graph.node}
    moved = nodes[op]
    producer = next(n for n in result.model.graph.node if moved.input[0] in n.output)
    assert producer.op_type == "DequantizeLinear"  # the op now reads float
    lo, hi = (0, 255) if dtype == TensorProto.UINT8 else (-128, 127)
    rng = np.random.default_rng(0)
    shape = [1, 3, 4] if op == "Squeeze" else [2, 3, 4]
    for x in _inputs(shape, rng, (lo, hi) if params_from == "reader" else None):
        want = _run(model, {"x": x})[0]
        got = _run(result.model, {"x": x})[0]
        assert want.tobytes() == got.tobytes(), (op, x)


@rule_marker("qdq-movement-sandwich", "negative")
def test_the_rule_declines_where_the_round_trip_or_the_parameters_fail():
    # a scale so large that (c - zp) * s overflows float32: Q(DQ(c)) != c; a zero or NaN scale
    assert not round_trips(np.float32(3e38), np.uint8(128), "uint8")
    assert not round_trips(np.float32(np.nan), np.uint8(128), "uint8")
    # denormal scales still round-trip: k * s is an exact multiple of 2^-149
    assert round_trips(np.float32(1e-42), np.uint8(128), "uint8")
    assert round_trips(np.float32(0.0325912), np.uint8(123), "uint8")
    assert round_trips(np.float32(1.0), np.int8(0), "int8") and not round_trips(np.float32(0.0), None, "uint8")
    model = _moved("Reshape", TensorProto.UINT8, 3e38, 128, params_from="producer")
    result = rewrite(model, rules=_form(), only=[RULE], allow_unlowered=True)
    assert result.report.by_rule() == {}
    # parameters computed at run time (DynamicQuantizeLinear's): nothing states them as constants
    graph = helper.make_graph(
        [
            helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "s", "z"], name="dql"),
            helper.make_node("Flatten", ["q"], ["f"], name="flat"),
            helper.make_node("DequantizeLinear", ["f", "s", "z"], ["y"], name="dq"),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [6])],
    )
    dynamic = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    assert rewrite(dynamic, rules=_form(), only=[RULE], allow_unlowered=True).report.by_rule() == {}


def test_a_transpose_between_contrib_qlinear_ops_is_judged_by_its_uint8_type():
    """onnx has no schema for com.microsoft QLinearAdd: once its output is typed, what reads it is
    inferred again, so TensorRT's check sees the Reshape and Transpose on uint8 it refuses."""
    ms = "com.microsoft"
    inits = [
        numpy_helper.from_array(np.array(0.05, np.float32), "s"),
        numpy_helper.from_array(np.array(128, np.uint8), "z"),
        numpy_helper.from_array(np.array([0, 4, 2], np.int64), "shape"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["qx"], name="qx"),
        helper.make_node("QLinearAdd", ["qx", "s", "z", "qx", "s", "z", "s", "z"], ["a"], name="add", domain=ms),
        helper.make_node("Reshape", ["a", "shape"], ["r"], name="reshape"),
        helper.make_node("Transpose", ["r"], ["t"], name="transpose", perm=[0, 2, 1]),
        helper.make_node("DequantizeLinear", ["t", "s", "z"], ["y"], name="dq"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 4])],
        inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ms, 1)], ir_version=8
    )
    refused = {r.node: r.reasons for r in check_model(model, load_target("tensorrt"))}
    assert "Transpose on uint8 ('r')" in refused["transpose"][0]
    assert "Reshape on uint8 ('a')" in refused["reshape"][0]


def _battery_model(folder: Path, name: str) -> Path:
    path = REPO / "benchmarks" / "target_models.py"
    spec = importlib.util.spec_from_file_location("benchmarks_target_models", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return next(b.path for b in module.make_battery(folder, {name}))


def test_tensorrt_reaches_a_quantize_static_qoperator_cnn(tmp_path, monkeypatch):
    """onnxruntime's quantize_static QOperator CNN (benchmarks/target_models.py ortqop_cnn): its
    Flatten on uint8 moves between DQ and Q (qdq-movement), the model's last DequantizeLinear waits
    for the stage that lowers the QLinearAdd before it, and the float emulation computes every pair:
    TensorRT refuses nothing, and verify passes (the QOperator lowerings' one-step bounds included).
    Without either step, something stays refused."""
    pytest.importorskip("onnxruntime.quantization")
    from onnx_qrewrite.verify import verify

    path = _battery_model(tmp_path, "ortqop_cnn")
    model = onnx.load(path)
    catalogue = load_rules()
    profile = load_target("tensorrt")
    plan = plan_for_model(model, catalogue, profile)
    assert plan.ok and len(plan.before) == 8, [r.reasons for r in plan.after]
    verdicts = {n.node: n for n in plan.nodes}
    assert verdicts["flatten.out"].rule == RULE and verdicts["flatten.out"].form == "qdq-movement"
    assert verdicts["head.out_DequantizeLinear"].rule == "float-emulation-qdq-pair"
    result = rewrite(model, rules=catalogue, target="tensorrt")
    assert result.report.target["refused_after"] == 0
    assert check_model(result.model, profile) == []
    report = verify(model, result.model, samples=2)
    assert report.passed, report.to_table()
    # without the deferral the last DequantizeLinear is emulated alone and the Q before it stays uint8
    monkeypatch.setattr("onnx_qrewrite.targets.plan._deferrable", lambda *a: [])
    assert plan_for_model(model, catalogue, profile).refused_after == 1
    # without the form the Flatten stays on uint8
    monkeypatch.undo()
    text = (REPO / "rules" / "targets" / "tensorrt.toml").read_text()
    cut = text.index('[[rewrites.form]]\nname = "qdq-movement"')
    (tmp_path / "tensorrt.toml").write_text(text[:cut])
    without = plan_for_model(model, catalogue, load_target(str(tmp_path / "tensorrt.toml")))
    assert without.refused_after > 0 and any(r.op == "Flatten" for r in without.after)
