"""Helpers for the verifier's tests: the Quark kernel vectors, one-node vendor models, and
hand-made "rewritten" models (correct and deliberately broken) that stand in for engine output.

The hand-made rewrites follow NUMERICS.md directly; they are test fixtures, not the engine's
lowering code, so a test that uses them exercises the verifier, not the engine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
from conftest import QUARK_VECTORS
from onnx import TensorProto, helper

QUARK_DOMAINS = {
    "com.amd.quark": ("ExtendedQuantizeLinear", "ExtendedDequantizeLinear"),
    "com.vai.quantize": ("VitisQuantizeLinear", "VitisDequantizeLinear"),
}
ONNX_TYPES = {
    "uint8": TensorProto.UINT8,
    "int8": TensorProto.INT8,
    "uint16": TensorProto.UINT16,
    "int16": TensorProto.INT16,
    "uint32": TensorProto.UINT32,
    "int32": TensorProto.INT32,
    "float16": TensorProto.FLOAT16,
    "bfloat16": TensorProto.BFLOAT16,
}
RULE_KEY = "onnx_qrewrite.rule"
ORIGIN_KEY = "onnx_qrewrite.origin"


# -- running the command line --------------------------------------------------------------------


def cli(*args: object, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The real program, as a user runs it (a separate process: exit codes, stderr, signals)."""
    return subprocess.run(
        [sys.executable, "-m", "onnx_qrewrite", *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=120
    )


def invoke(*args: object):
    """The command line in-process (click's CliRunner): fast, for option batteries."""
    from click.testing import CliRunner

    from onnx_qrewrite.cli import main

    return CliRunner().invoke(main, [str(a) for a in args])


def one_error_line(stderr: str | subprocess.CompletedProcess) -> str:
    """The one line a bad invocation writes on stderr (never a traceback)."""
    text = stderr.stderr if isinstance(stderr, subprocess.CompletedProcess) else stderr
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


def save_toy_models(folder: Path) -> dict[str, Path]:
    """The toy Quark model, its correct rewrite and one broken along the axis, saved in ``folder``."""
    import onnx

    original = toy_quark_model()
    paths = {"original": folder / "toy.onnx", "good": folder / "toy.good.onnx", "bad": folder / "toy.axis.onnx"}
    onnx.save(original, paths["original"])
    onnx.save(toy_rewrite(original), paths["good"])
    onnx.save(toy_rewrite(original, "axis"), paths["bad"])
    return paths


def node_row(report, origin: str):
    """The one row of a verify report that checks a bounded replacement at its node: the replaced
    node named ``origin`` (rows of model outputs and of other nodes are left out)."""
    (row,) = [o for o in report.outputs if f"(node {origin}," in o.name]
    return row


def vector_cases() -> list[dict]:
    return json.loads((QUARK_VECTORS / "quark_kernel_vectors.json").read_text())["cases"]


def vector_arrays(case: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """x, scale, zero point, expected y of one case, bfloat16 bit patterns turned into bfloat16."""
    with np.load(QUARK_VECTORS / "quark_kernel_vectors.npz") as data:
        x, scale, zp, y = (data[f"{case['key']}_{n}"] for n in ("x", "scale", "zero_point", "y"))
    if case["dtype"] == "bfloat16":
        zp = zp.view(ml_dtypes.bfloat16)
        if case["op"] == "ExtendedDequantizeLinear":
            x = x.view(ml_dtypes.bfloat16)
        else:
            y = y.view(ml_dtypes.bfloat16)
    return x, scale, zp, y


def one_node_model(
    domain: str, op_type: str, dtype: int, axis: int | None, shapes: dict[str, tuple]
) -> onnx.ModelProto:
    """A model with one vendor Q or DQ node; x, scale and zero point are graph inputs."""
    dequantize = "Dequantize" in op_type
    attrs = {} if axis is None else {"axis": axis}
    node = helper.make_node(op_type, ["x", "scale", "zp"], ["y"], domain=domain, name="vendor", **attrs)
    graph = helper.make_graph(
        [node],
        "one_node",
        [
            helper.make_tensor_value_info("x", dtype if dequantize else TensorProto.FLOAT, shapes["x"]),
            helper.make_tensor_value_info("scale", TensorProto.FLOAT, shapes["scale"]),
            helper.make_tensor_value_info("zp", dtype, shapes["zp"]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT if dequantize else dtype, shapes["x"])],
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)], ir_version=8
    )


def bits(array: np.ndarray) -> np.ndarray:
    """The bit pattern of every element (so -0.0 != 0.0 and NaN payloads count)."""
    return np.ascontiguousarray(array).view(np.dtype(f"u{array.dtype.itemsize}"))


def mark(node: onnx.NodeProto, rule: str, origin: str) -> onnx.NodeProto:
    """Tag a hand-made node the way the rewrite engine tags the nodes it creates."""
    for key, value in ((RULE_KEY, rule), (ORIGIN_KEY, origin)):
        entry = node.metadata_props.add()
        entry.key, entry.value = key, value
    return node


# -- a toy Quark model and hand-made rewrites of it ----------------------------------------------

TOY_INPUT_SCALE = np.float32(0.05)


def _init(name: str, array) -> onnx.TensorProto:
    return onnx.numpy_helper.from_array(np.asarray(array), name)


def toy_quark_model() -> onnx.ModelProto:
    """x -> Q/DQ (int8) -> MatMul with per-channel int8 weights (axis absent: 0) -> Add -> Q/DQ (zp 3).

    Outputs both the quantized ``yq`` (compared exactly) and the dequantized ``y`` (float)."""
    rng = np.random.default_rng(7)
    q, dq = "ExtendedQuantizeLinear", "ExtendedDequantizeLinear"
    d = "com.amd.quark"
    nodes = [
        helper.make_node(q, ["x", "sx", "zx"], ["xq"], domain=d, name="qx"),
        helper.make_node(dq, ["xq", "sx", "zx"], ["xd"], domain=d, name="dqx"),
        helper.make_node(dq, ["wq", "sw", "zw"], ["wd"], domain=d, name="dqw"),
        helper.make_node("MatMul", ["xd", "wd"], ["h"], name="mm"),
        helper.make_node("Add", ["h", "b"], ["hb"], name="add"),
        helper.make_node(q, ["hb", "sy", "zy"], ["yq"], domain=d, name="qy"),
        helper.make_node(dq, ["yq", "sy", "zy"], ["y"], domain=d, name="dqy"),
    ]
    initializers = [
        _init("sx", TOY_INPUT_SCALE),
        _init("zx", np.int8(0)),
        _init("wq", rng.integers(-127, 127, size=(4, 4)).astype(np.int8)),
        _init("sw", np.array([0.01, 0.02, 0.03, 0.04], np.float32)),
        _init("zw", np.zeros(4, np.int8)),
        _init("b", rng.standard_normal(4).astype(np.float32)),
        _init("sy", np.float32(0.04)),
        _init("zy", np.int8(3)),
    ]
    graph = helper.make_graph(
        nodes,
        "toy_quark",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4]),
            helper.make_tensor_value_info("yq", TensorProto.INT8, ["batch", 4]),
        ],
        initializer=initializers,
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid(d, 1)], ir_version=8
    )


TOY_BREAKS = ("scale-ulp", "zero-point", "axis", "round-clip")
#: The original node whose replacement each break damages.
TOY_BROKEN_ORIGIN = {"scale-ulp": "qx", "zero-point": "qx", "axis": "dqw", "round-clip": "qy"}


def toy_rewrite(original: onnx.ModelProto, broken: str | None = None) -> onnx.ModelProto:
    """The toy model in standard ONNX, as the engine would write it, optionally with one bug.

    ``qy`` is lowered as the decomposition Div -> Round -> Add(zp) -> Clip -> Cast (exact for
    int8 at in-range values); ``round-clip`` swaps the Round and Clip nodes of that chain."""
    assert broken in (None, *TOY_BREAKS)
    model = onnx.ModelProto()
    model.CopyFrom(original)
    graph = model.graph
    sx, zx = "sx", "zx"
    if broken == "scale-ulp":
        sx = "sx_next"
        graph.initializer.append(_init(sx, np.nextafter(TOY_INPUT_SCALE, np.float32(1))))
    if broken == "zero-point":
        zx = "zx_plus_one"
        graph.initializer.append(_init(zx, np.int8(1)))
    graph.initializer.extend(
        [_init("qy_zp_f", np.float32(3)), _init("qy_lo", np.float32(-128)), _init("qy_hi", np.float32(127))]
    )
    dqw_axis = {} if broken == "axis" else {"axis": 0}  # Quark's absent axis means 0; ONNX's means 1
    round_clip = [
        helper.make_node("Round", ["qy_div"], ["qy_a"], name="qy_round"),
        helper.make_node("Add", ["qy_a", "qy_zp_f"], ["qy_b"], name="qy_add_zp"),
        helper.make_node("Clip", ["qy_b", "qy_lo", "qy_hi"], ["qy_c"], name="qy_clip"),
    ]
    if broken == "round-clip":
        round_clip = [
            helper.make_node("Clip", ["qy_div", "qy_lo", "qy_hi"], ["qy_a"], name="qy_clip"),
            helper.make_node("Add", ["qy_a", "qy_zp_f"], ["qy_b"], name="qy_add_zp"),
            helper.make_node("Round", ["qy_b"], ["qy_c"], name="qy_round"),
        ]
    nodes = [
        mark(helper.make_node("QuantizeLinear", ["x", sx, zx], ["xq"], name="qx_q"), "test.quantize", "qx"),
        mark(helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xd"], name="dqx_dq"), "test.dequantize", "dqx"),
        mark(
            helper.make_node("DequantizeLinear", ["wq", "sw", "zw"], ["wd"], name="dqw_dq", **dqw_axis),
            "test.dequantize",
            "dqw",
        ),
        graph.node[3],
        graph.node[4],
        mark(helper.make_node("Div", ["hb", "sy"], ["qy_div"], name="qy_div"), "test.quantize-decomposed", "qy"),
        *(mark(n, "test.quantize-decomposed", "qy") for n in round_clip),
        mark(
            helper.make_node("Cast", ["qy_c"], ["yq"], name="qy_cast", to=TensorProto.INT8),
            "test.quantize-decomposed",
            "qy",
        ),
        mark(helper.make_node("DequantizeLinear", ["yq", "sy", "zy"], ["y"], name="dqy_dq"), "test.dequantize", "dqy"),
    ]
    del graph.node[:]
    graph.node.extend(nodes)
    del model.opset_import[:]
    model.opset_import.append(helper.make_opsetid("", 13))
    onnx.checker.check_model(model)
    return model


def scale_ulp_inputs(rows: int = 8) -> dict[str, np.ndarray]:
    """Inputs whose int8 quantization changes when the scale grows by one ulp: values at the
    rounding ties x = (k + 0.5) * scale, where x / scale and x / nextafter(scale) round apart."""
    s, s_next = TOY_INPUT_SCALE, np.nextafter(TOY_INPUT_SCALE, np.float32(1))
    candidates = ((np.arange(-120, 120, dtype=np.float32) + np.float32(0.5)) * s).astype(np.float32)
    candidates = np.concatenate(
        [candidates, np.nextafter(candidates, np.float32(np.inf)), np.nextafter(candidates, np.float32(-np.inf))]
    )
    flips = candidates[np.rint(candidates / s) != np.rint(candidates / s_next)]
    assert flips.size >= rows * 4, flips.size
    return {"x": flips[: rows * 4].reshape(rows, 4)}


# -- DynamicQuantizeLinear, expanded by hand --------------------------------------------------------


def dql_model() -> onnx.ModelProto:
    """x -> DynamicQuantizeLinear, with all three outputs as graph outputs."""
    node = helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "y_scale", "y_zero_point"], name="dql")
    graph = helper.make_graph(
        [node],
        "dql",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [
            helper.make_tensor_value_info("y", TensorProto.UINT8, ["batch", 16]),
            helper.make_tensor_value_info("y_scale", TensorProto.FLOAT, []),
            helper.make_tensor_value_info("y_zero_point", TensorProto.UINT8, []),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def expand_dql(original: onnx.ModelProto, *, zero_range_guard: bool = True) -> onnx.ModelProto:
    """The DQL expanded as NUMERICS.md prescribes (spec body + onnxruntime's two guards); without
    ``zero_range_guard`` the scale is the spec's plain (max - min) / 255."""
    model = onnx.ModelProto()
    model.CopyFrom(original)
    graph = model.graph
    (dql,) = graph.node
    x, (y, y_scale, y_zp) = dql.input[0], dql.output
    graph.initializer.extend(
        [_init(n, np.float32(v)) for n, v in (("q_zero", 0), ("q_one", 1), ("q_range", 255), ("q_nan_zp", 255))]
    )
    scale_out = y_scale if not zero_range_guard else "dql_scale_raw"
    nodes = [
        helper.make_node("ReduceMin", [x], ["dql_min0"], keepdims=0),
        helper.make_node("Min", ["dql_min0", "q_zero"], ["dql_min"]),
        helper.make_node("ReduceMax", [x], ["dql_max0"], keepdims=0),
        helper.make_node("Max", ["dql_max0", "q_zero"], ["dql_max"]),
        helper.make_node("Sub", ["dql_max", "dql_min"], ["dql_span"]),
        helper.make_node("Div", ["dql_span", "q_range"], [scale_out]),
    ]
    if zero_range_guard:
        nodes += [
            helper.make_node("Equal", ["dql_max", "dql_min"], ["dql_flat"]),
            helper.make_node("Where", ["dql_flat", "q_one", "dql_scale_raw"], [y_scale]),
        ]
    nodes += [
        helper.make_node("Div", ["dql_min", y_scale], ["dql_min_scaled"]),
        helper.make_node("Sub", ["q_zero", "dql_min_scaled"], ["dql_zp0"]),
        helper.make_node("IsNaN", ["dql_zp0"], ["dql_zp_nan"]),
        helper.make_node("Clip", ["dql_zp0", "q_zero", "q_range"], ["dql_zp_clip"]),
        helper.make_node("Where", ["dql_zp_nan", "q_nan_zp", "dql_zp_clip"], ["dql_zp_sel"]),
        helper.make_node("Round", ["dql_zp_sel"], ["dql_zp_round"]),
        helper.make_node("Cast", ["dql_zp_round"], [y_zp], to=TensorProto.UINT8),
        helper.make_node("QuantizeLinear", [x, y_scale, y_zp], [y]),
    ]
    for i, node in enumerate(nodes):
        node.name = f"dql_expanded_{i}_{node.op_type}"
        mark(node, "test.dql-expand", dql.name)
    del graph.node[:]
    graph.node.extend(nodes)
    onnx.checker.check_model(model)
    return model


def quark_to_standard(original: onnx.ModelProto, *, bump_zero_point_of: str | None = None) -> onnx.ModelProto:
    """A real Quark model with every integer Extended Q/DQ replaced by standard QuantizeLinear /
    DequantizeLinear at opset 21 (int16 needs it); ``bump_zero_point_of`` names an original Q node
    whose replacement gets its zero point off by one."""
    model = onnx.ModelProto()
    model.CopyFrom(original)
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    new_nodes = []
    for node in graph.node:
        if node.domain != "com.amd.quark":
            new_nodes.append(node)
            continue
        quantize = node.op_type == "ExtendedQuantizeLinear"
        inputs = list(node.input)
        if quantize and node.name == bump_zero_point_of:
            zp = onnx.numpy_helper.to_array(inits[inputs[2]])
            bumped = _init(f"{inputs[2]}_plus_one", (zp.astype(np.int64) + 1).astype(zp.dtype))
            graph.initializer.append(bumped)
            inputs[2] = bumped.name
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        op = "QuantizeLinear" if quantize else "DequantizeLinear"
        new_nodes.append(
            mark(
                helper.make_node(op, inputs, list(node.output), name=f"{node.name}_std", axis=axis),
                "test.quark-to-standard",
                node.name,
            )
        )
    del graph.node[:]
    graph.node.extend(new_nodes)
    kept = [o for o in model.opset_import if o.domain not in ("", "ai.onnx", "com.amd.quark")]
    del model.opset_import[:]
    model.opset_import.extend([helper.make_opsetid("", 21), *kept])
    model.ir_version = 10  # opset 21 needs IR 10
    onnx.checker.check_model(model)
    return model
