"""The original model as onnxruntime runs it with ``session.x64quantprecision = 1``: no int16 pair
saturation in its uint8 x int8 kernels.

On x86 CPUs without AVX-VNNI onnxruntime's default uint8 x int8 kernels saturate each adjacent
pair of products to int16 (:mod:`onnx_qrewrite.rewriter.u8s8`), so the original's outputs there
depend on the CPU; on CPUs with VNNI, on ARM, and with the session option
``session.x64quantprecision = 1`` they are the ONNX definition. That option works by a graph
transformation (onnxruntime's ``Avx2WeightS8ToU8Transformer``, optimisation level 2 and above):
constant int8 weights with a value beyond [-64, 64] become uint8 ``w + 128`` with zero point
``zp + 128`` (the same integers after the zero point is subtracted), which the exact uint8 x uint8
kernel multiplies. ``verify`` compares every node at optimisation level ``disable`` by default,
where the option does nothing, so the same transformation is applied here, to the same ops and
inputs onnxruntime lists, and only to the original model the outputs are compared with; the report
says how many nodes it changed. Each bounded replacement is still checked against the *default*
kernel on this CPU at its node (:mod:`.bounds`), within the bound its rule declares.

Measured (tests/test_u8s8_saturation.py): for MatMulInteger the transformed model gives the ONNX
definition bit for bit, as onnxruntime with the option at level ``extended`` does.
"""

from __future__ import annotations

import functools

import numpy as np
import onnx
from onnx import numpy_helper

__all__ = ["default_kernel_saturates", "without_saturation"]

#: (domain, op) -> (weights input, weights zero point input): onnxruntime 1.31's list
#: (``s8_overflow_ops`` in avx2_weight_s8_to_u8.cc; ConvInteger takes no int8 weights there).
_OPS: dict[tuple[str, str], tuple[int, int]] = {
    ("com.microsoft", "QAttention"): (1, 7),
    ("com.microsoft", "MatMulIntegerToFloat"): (1, 5),
    ("com.microsoft", "DynamicQuantizeMatMul"): (1, 3),
    ("com.microsoft", "QGemm"): (3, 5),
    ("", "MatMulInteger"): (1, 3),
    ("", "QLinearMatMul"): (3, 5),
    ("", "QLinearConv"): (3, 5),
}


@functools.cache
def default_kernel_saturates() -> bool:
    """Whether onnxruntime's default uint8 x int8 kernel saturates pairs of products to int16 on
    this machine, measured: [255, 255] . [127, 127] is 64770, 32767 where it saturates. Bounds a
    rule raised for that saturation (``Plan.bound_u8s8``) do not apply where it does not."""
    from onnx import TensorProto, helper

    from onnx_qrewrite.verify._ort import ort  # the verifier's one import of onnxruntime

    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "b"], ["y"])],
        "probe",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, [1, 2])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, [1, 1])],
        [numpy_helper.from_array(np.full((2, 1), 127, np.int8), "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return int(session.run(None, {"a": np.full((1, 2), 255, np.uint8)})[0].item()) == 32767


def without_saturation(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """A copy of ``model`` with the int8 weights of every listed node whose constant weights leave
    [-64, 64] moved to uint8 (and their zero points), and how many nodes changed (0: ``model``
    itself is returned)."""
    initializers = {t.name: t for t in model.graph.initializer}
    changes: list[tuple[int, int, int]] = []  # (node index, weights input, zero point input)
    for index, node in enumerate(model.graph.node):
        spec = _OPS.get((node.domain if node.domain != "ai.onnx" else "", node.op_type))
        if spec is None or len(node.input) <= spec[0]:
            continue
        weights = initializers.get(node.input[spec[0]])
        if weights is None or weights.data_type != onnx.TensorProto.INT8:
            continue
        zp_name = node.input[spec[1]] if len(node.input) > spec[1] else ""
        zp = initializers.get(zp_name) if zp_name else None
        if zp_name and (zp is None or zp.data_type != onnx.TensorProto.INT8):
            continue
        values = numpy_helper.to_array(weights)
        if values.size and int(np.abs(values.astype(np.int16)).max()) > 64:
            changes.append((index, *spec))
    if not changes:
        return model, 0
    out = onnx.ModelProto()
    out.CopyFrom(model)
    taken = {t.name for t in out.graph.initializer} | {v for n in out.graph.node for v in (*n.input, *n.output)}

    def fresh(base: str) -> str:
        name, i = f"{base}_s8_2_u8", 0
        while name in taken:
            i += 1
            name = f"{base}_s8_2_u8_{i}"
        taken.add(name)
        return name

    for index, w_index, zp_index in changes:
        node = out.graph.node[index]
        shifted = (numpy_helper.to_array(initializers[node.input[w_index]]).astype(np.int16) + 128).astype(np.uint8)
        name = fresh(node.input[w_index])
        out.graph.initializer.append(numpy_helper.from_array(shifted, name))
        node.input[w_index] = name
        zp_name = node.input[zp_index] if len(node.input) > zp_index else ""
        zp_values = numpy_helper.to_array(initializers[zp_name]) if zp_name else np.zeros((), np.int8)
        zp_shifted = (zp_values.astype(np.int16) + 128).astype(np.uint8)
        new_zp = fresh(zp_name or f"{node.name or node.output[0]}_weight_zero_point")
        out.graph.initializer.append(numpy_helper.from_array(zp_shifted, new_zp))
        while len(node.input) <= zp_index:
            node.input.append("")
        node.input[zp_index] = new_zp
    return out, len(changes)
