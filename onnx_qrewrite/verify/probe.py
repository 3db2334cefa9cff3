"""Read a MatMulNBits replacement's dequantized weights exactly: the identity probe.

verify's per-element bound for MatMulNBits (``float32-sum-order``, :mod:`.element_bounds`) must
allow any float32 summation order, about (K - 1)·u of the sum of |a·w|; a weight scale one ulp off
moves an output by at most 2^-23 of one block's sum, more than K + 1 times below it
(``tests/test_lower_matmul_nbits.py``), so no sound bound on dense inputs can see it.

With A a *selector*, rows of the identity matrix, every output element is one weight times 1 plus
zeros (plus the bias, one rounding): exact in any summation order. So the original kernel's output
is its dequantized weights, the replacement's output its own, and the two must be equal bit for
bit. The selector reads, in every K-block of every output column, a weight whose quantized value
``w / scale`` is a power of two where the block has one (so any other scale, one ulp off or more,
gives another float: exact scaling), else a nonzero weight (a zero weight does not depend on the
scale); a dropped zero point, a wrong block size or nibble order show there too. It has two rows at
least: onnxruntime's MLAS dequantizes B before its float GEMM for M > 1, the path every row count
above 1 shares (``tests/test_lower_matmul_nbits.py`` measures the probe on its battery).

The probe needs the weights, scales and zero points as constants of the original, and the float
accumulation of the bounded rules: ``accuracy_level`` 4 may quantize A to int8 (the approximate
rule), where a selector row is not read exactly, so such nodes are not probed.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnx_qrewrite.verify.compare import Tolerance, ValueComparison, compare_values
from onnx_qrewrite.verify.session import ModelRunner

__all__ = ["PROBED_FORMULA", "identity_probe", "selector"]

#: The bounded replacements probed: those whose per-element bound is a summation-order bound.
PROBED_FORMULA = "float32-sum-order"
_EXACT = Tolerance(0.0, 0.0, 0, text="exact (identity probe: the dequantized weights)")


def selector(weights: np.ndarray, scales: np.ndarray, block_size: int, dtype: np.dtype) -> np.ndarray:
    """Rows of the K x K identity ([M, K], ``dtype``) that read, in every K-block of every column
    with a nonzero weight, a weight whose quantized value ``w / scale`` is a power of two where the
    block has one (any other scale then gives another float: exact scaling), else a nonzero weight;
    chosen greedily per block, and two rows at least (M > 1: the kernel path that dequantizes B
    before its GEMM). ``weights``: the dequantized [K, N]; ``scales``: [N, blocks]."""
    k = weights.shape[0]
    per_row = np.repeat(np.asarray(scales, np.float64).reshape(weights.shape[1], -1), block_size, axis=1)[:, :k].T
    with np.errstate(divide="ignore", invalid="ignore"):
        mantissa, _ = np.frexp(np.where(per_row != 0, weights / per_row, 0.0))
    powers, nonzero = np.abs(mantissa) == 0.5, weights != 0
    chosen: list[int] = []
    for start in range(0, k, block_size):
        block = slice(start, start + block_size)
        chosen += [start + i for i in _cover(powers[block], nonzero[block])]
    while len(chosen) < 2:
        chosen.append(next((i for i in range(k) if i not in chosen), 0))
    rows = np.zeros((len(chosen), k), dtype)
    rows[np.arange(len(chosen)), chosen] = 1
    return rows


def _cover(powers: np.ndarray, nonzero: np.ndarray) -> list[int]:
    """Offsets in one block ([block, N] booleans) that give every column a power of two where it has
    one, else a nonzero weight where it has one: greedy, the offset covering most columns first."""
    chosen: list[int] = []

    def take(table: np.ndarray, wanted: np.ndarray) -> None:
        while wanted.any():
            best = int(np.argmax(table[:, wanted].sum(axis=1)))
            chosen.append(best)
            wanted = wanted & ~table[best]

    take(powers, np.asarray(powers.any(axis=0)))
    covered = nonzero[chosen].any(axis=0) if chosen else np.zeros(nonzero.shape[1], bool)
    take(nonzero, np.asarray(nonzero.any(axis=0) & ~covered))
    return sorted(set(chosen))


def _original_alone(original: onnx.ModelProto, node: onnx.NodeProto, a: np.ndarray) -> onnx.ModelProto | None:
    """The MatMulNBits node alone, every input but A an initializer of the original (else None)."""
    initializers = {t.name: t for t in original.graph.initializer}
    constants = [n for n in node.input[1:] if n]
    if any(n not in initializers for n in constants):
        return None
    graph = helper.make_graph(
        [node],
        "identity_probe",
        [helper.make_tensor_value_info(node.input[0], helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)],
        [onnx.ValueInfoProto(name=node.output[0])],
        [initializers[n] for n in dict.fromkeys(constants)],
    )
    return helper.make_model(graph, opset_imports=list(original.opset_import), ir_version=original.ir_version)


def _selector_for(original: onnx.ModelProto, node: onnx.NodeProto) -> np.ndarray | None:
    """The selector for this node (A's type is the scales' type), or None where it is not read
    exactly (``accuracy_level`` 4) or its weights, scales or zero points are not constants."""
    from onnx_qrewrite.rewriter.builders.matmul_nbits import dequantized_weights

    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    initializers = {t.name: t for t in original.graph.initializer}
    names = list(node.input[1:4])
    if int(attributes.get("accuracy_level", 0)) == 4 or len(names) < 2:
        return None
    if any(n and n not in initializers for n in names):
        return None
    packed, scales = (numpy_helper.to_array(initializers[n]) for n in names[:2])
    zero_points = numpy_helper.to_array(initializers[names[2]]) if len(names) > 2 and names[2] else None
    weights = dequantized_weights(attributes, packed, scales, zero_points).astype(np.float64)
    return selector(weights, scales, int(attributes["block_size"]), scales.dtype)


def identity_probe(
    original: onnx.ModelProto,
    node: onnx.NodeProto,
    replacement: Callable[[dict[str, np.ndarray]], onnx.ModelProto],
    label: str,
    make_runner: Callable[[onnx.ModelProto, str], ModelRunner],
) -> list[ValueComparison]:
    """One exact comparison of the original MatMulNBits ``node`` and its ``replacement`` (built for
    the given feeds) on the selector, both run by the reference runner; empty where the node
    cannot be probed (weights not constant, ``accuracy_level`` 4)."""
    a = _selector_for(original, node)
    alone = _original_alone(original, node, a) if a is not None else None
    if a is None or alone is None:
        return []
    feeds = {node.input[0]: a}
    output = node.output[0]
    expected = make_runner(alone, "original").run(feeds, [output])[output]
    actual = make_runner(replacement(feeds), "original").run(feeds, [output])[output]
    row = compare_values(label, "identity probe", expected, actual, _EXACT)
    return [row]
