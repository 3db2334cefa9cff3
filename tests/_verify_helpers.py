"""Helpers for the verifier's tests: the Quark kernel vectors, one-node vendor models, and
hand-made "rewritten" models (correct and deliberately broken) that stand in for engine output.

The hand-made rewrites follow NUMERICS.md directly; they are test fixtures, not the engine's
lowering code, so a test that uses them exercises the verifier, not the engine.
"""

from __future__ import annotations

import json
import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper

from conftest import SHARED, SHARED_MODELS

VECTORS = SHARED / "vectors"
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


def shared_models() -> list[str]:
    return sorted(p.stem for p in SHARED_MODELS.glob("*.onnx"))


def vector_cases() -> list[dict]:
    return json.loads((VECTORS / "quark_kernel_vectors.json").read_text())["cases"]


def vector_arrays(case: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """x, scale, zero point, expected y of one case, bfloat16 bit patterns turned into bfloat16."""
    with np.load(VECTORS / "quark_kernel_vectors.npz") as data:
        x, scale, zp, y = (data[f"{case['key']}_{n}"] for n in ("x", "scale", "zero_point", "y"))
    if case["dtype"] == "bfloat16":
        zp = zp.view(ml_dtypes.bfloat16)
        if case["op"] == "ExtendedDequantizeLinear":
            x = x.view(ml_dtypes.bfloat16)
        else:
            y = y.view(ml_dtypes.bfloat16)
    return x, scale, zp, y


def one_node_model(domain: str, op_type: str, dtype: int, axis: int | None, shapes: dict[str, tuple]) -> onnx.ModelProto:
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
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)], ir_version=8)


def bits(array: np.ndarray) -> np.ndarray:
    """The bit pattern of every element (so -0.0 != 0.0 and NaN payloads count)."""
    return np.ascontiguousarray(array).view(np.dtype(f"u{array.dtype.itemsize}"))


def mark(node: onnx.NodeProto, rule: str, origin: str) -> onnx.NodeProto:
    """Tag a hand-made node the way the rewrite engine tags the nodes it creates."""
    for key, value in ((RULE_KEY, rule), (ORIGIN_KEY, origin)):
        entry = node.metadata_props.add()
        entry.key, entry.value = key, value
    return node
