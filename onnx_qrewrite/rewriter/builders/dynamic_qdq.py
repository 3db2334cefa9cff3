"""The "qdq" form: dynamically quantized matmuls and convolutions to the QDQ form that backends'
quantization passes recognise, with the activation's quantization kept. Applied only when asked
for (``named_form("qdq")``, ``--form qdq``); **bounded**.

Patterns (read by ``builders/_dynamic_patterns.py``, shared with the weight-only form)::

    DynamicQuantizeLinear(x) -> y, y_scale, y_zp
    Mul(Cast<f32>(MatMulInteger|ConvInteger(y, W, y_zp, W_zp)), Mul(y_scale, W_scale))
        ==>  MatMul|Conv(DequantizeLinear(y, y_scale, y_zp), DequantizeLinear(W, W_scale, W_zp))
    com.microsoft MatMulIntegerToFloat(y, W, y_scale, W_scale, y_zp, W_zp[, bias])
        ==>  MatMul(DequantizeLinear(y, y_scale, y_zp), DequantizeLinear(W, ...)) [+ bias]
    com.microsoft DynamicQuantizeMatMul(x, W, W_scale, W_zp[, bias])
        ==>  the same after DynamicQuantizeLinear(x) (expanded as dql-expand does, or kept:
             option ``quantize``)

The DynamicQuantizeLinear of the first two stays where it is (the default rules expand it exactly,
a target that runs it keeps it); the integer op, its Cast and the scale product are removed once
nothing reads them (``Plan.remove_if_dead``; the engine decides), so a node of the pattern that
something else still reads stays, lowered exactly. A bias ``Add`` after the Mul stays as it is.

Why bounded, and by how much. The original sums the exact integer products ``p_k = (y_k - y_zp)
(W_kn - W_zp_n)`` in int32 (exact) and scales once: ``fl(fl(P) * fl(y_scale * W_scale_n))``, within
``gamma(3) * S`` of ``P * y_scale * W_scale_n`` where ``S = y_scale * W_scale_n * sum_k |p_k|``. The
rewrite multiplies the dequantized values, each within one rounding of ``y_scale * (y_k - y_zp)``
and ``W_scale_n * (W_kn - W_zp_n)``, and sums them in float32 in MLAS's order: within
``gamma(K+2) * S`` (Higham, Accuracy and Stability, 3.1 and 4.2; the same argument as
``integer_matmul.float32_sum_bound``). ``S`` depends on the run-time activation, but every
dequantized activation is at most ``max|x| * (1 + 1/255)`` in magnitude plus roundings (the
quantization range always contains 0 and the rounding adds at most half a step), so at each output

    |rewrite - original| <= (gamma(K+2) + gamma(3)) * (1 + 2^-7) * c * max|x|,
    c = max_n W_scale_n * sum_k |W_kn - W_zp_n|        (from the constant weights)

and a bias adds ``3u * (c * (1 + 2^-7) * max|x| + max|bias|)`` (one rounding of each side's Add).
``Plan.bound_scale`` records ``(x, that coefficient)``; ``verify`` evaluates it on each sample with
the original's own ``x`` and checks the replacement at the node (``verify/bounds.py``).

Where no bound holds the rule gives way (``NotApplicable``) and the default rules apply:
onnxruntime's uint8 x int8 MatMul kernel saturates the sum of each pair of products (k = 2j, 2j+1)
to int16 on x86 CPUs without AVX-VNNI (measured; ``rewriter/u8s8.py``), so with int8 weights that
can reach such a pair (some pair ``(W_2j, W_2j+1)`` along K, the kernel's pairs, of one sign with
``|W_2j| + |W_2j+1| > 128``: ``u8s8.pair_excess`` > 0; never with ``reduce_range``'s 7-bit weights)
the original's result depends on the CPU; a bias computed at run time; everything the pattern
reader refuses.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np

from onnx_qrewrite.rewriter import kernel_opsets, u8s8
from onnx_qrewrite.rewriter.builders import Emitter, NotApplicable, Plan, Site, register
from onnx_qrewrite.rewriter.builders._dynamic_patterns import (
    CHAIN_OPS,
    STANDARD,
    Anchor,
    analysis,
    anchor_weights_dtype,
    dequantize_weights,
)
from onnx_qrewrite.rewriter.builders.contracts import CONTRACTS
from onnx_qrewrite.rewriter.builders.dynamic_quantize import DynamicQuantizeLinearBuilder
from onnx_qrewrite.rewriter.graph import Scope

__all__ = ["DynamicQdqBuilder", "gamma", "per_unit_bound"]

_U = 2.0**-24
#: The largest dequantized activation is max|x| times at most this (1 + 1/255 plus roundings).
_ACTIVATION_GROWTH = 1.0 + 2.0**-7
#: The pattern's nodes this form removes (the DynamicQuantizeLinear stays).
_REMOVED_OPS = CHAIN_OPS - {"DynamicQuantizeLinear", "Gather"}
#: First outputs of the nodes some pattern of a scope removes, per scope.
_REMOVED: weakref.WeakKeyDictionary[Scope, frozenset[str]] = weakref.WeakKeyDictionary()


def gamma(n: int) -> float:
    """Higham's gamma(n) = n*u / (1 - n*u), u = 2^-24: the relative error bound of n float32 roundings."""
    return n * _U / (1 - n * _U)


def per_unit_bound(k: int, column_scale_sums: float, *, bias: bool) -> float:
    """The bound per unit of max|x| (module docstring): ``column_scale_sums`` is
    max_n W_scale_n * sum_k |W_kn - W_zp_n|."""
    return (gamma(k + 2) + gamma(3) + (3 * _U if bias else 0.0)) * _ACTIVATION_GROWTH * column_scale_sums


def _removed(scope: Scope) -> frozenset[str]:
    found = _REMOVED.get(scope)
    if found is None:
        names: set[str] = set()
        for anchor in analysis(scope).anchors.values():
            if isinstance(anchor, Anchor) and anchor.op != "Gather":
                names.update(c for c in anchor.chain if c not in anchor.activation)
        found = _REMOVED[scope] = frozenset(names)
    return found


#: Elements per step: statistics of large weights (LLM projections) in bounded memory.
_CHUNK = 1 << 20


def _steps(rows: np.ndarray) -> range:
    return range(0, rows.shape[0], max(1, _CHUNK // max(1, rows.shape[1])))


def _column_scale_sums(rows: np.ndarray, anchor: Anchor) -> float:
    """max over output columns/channels of W_scale_n * sum_k |W_kn - W_zp_n| (exact integer sums)."""
    w = anchor.weights
    n = rows.shape[0]
    zp = np.zeros(n, np.int16) if w.zero_point is None else np.broadcast_to(w.zero_point.astype(np.int16), (n,))
    scale = np.broadcast_to(np.asarray(w.scale, np.float64), (n,))
    per_step = _steps(rows).step
    best = 0.0
    for start in _steps(rows):
        part = rows[start : start + per_step].astype(np.int16) - zp[start : start + per_step, None]
        sums = np.abs(part).sum(axis=1, dtype=np.int64) * scale[start : start + per_step]
        best = max(best, float(sums.max(initial=0.0)))
    return best


class DynamicQdqBuilder:
    """Integer matmul/conv patterns to a float MatMul/Conv of the dequantized activation and weights."""

    name = "dynamic_qdq"
    contract = CONTRACTS["dynamic_qdq"]

    def quantized_dtype(self, site: Site) -> str | None:
        return anchor_weights_dtype(site)

    def check(self, site: Site, options: Mapping[str, Any]) -> Plan:
        node = site.node
        if not node.output or not node.output[0]:
            raise NotApplicable("the node has no output")
        if options["role"] == "remove_dead":
            if (
                node.domain not in STANDARD
                or node.op_type not in _REMOVED_OPS
                or node.output[0] not in _removed(site.scope)
            ):
                raise NotApplicable("not part of a dynamically quantized matmul or convolution pattern")
            return Plan(remove_if_dead=True)
        anchor = analysis(site.scope).anchors.get(node.output[0])
        if anchor is None or (isinstance(anchor, Anchor) and anchor.op == "Gather"):
            raise NotApplicable(f"{node.op_type} does not end a dynamically quantized matmul or convolution")
        if isinstance(anchor, str):
            raise NotApplicable(anchor)
        return site.memo(("dynamic-qdq", options["quantize"]), lambda: self._plan(site, anchor, options))

    def _plan(self, site: Site, anchor: Anchor, options: Mapping[str, Any]) -> Plan:
        weights = anchor.weights
        value = site.constant(weights.name)
        assert value is not None  # the pattern reader checked: a constant
        conv = anchor.op == "Conv"
        rows = u8s8.rows(value, conv)
        # The kernel's own pairs (2j, 2j+1) along K (u8s8.py), not every adjacent pair: weights whose
        # large values sit across two of its pairs cannot saturate and keep this form.
        if weights.dtype == "int8" and not conv and u8s8.pair_excess(rows, "int8").max(initial=0) > 0:
            raise NotApplicable(
                "uint8 x int8 weights with a pair (2j, 2j+1) along K beyond int16: onnxruntime's kernel saturates "
                "it on x86 CPUs without AVX-VNNI, so no bound holds (the default rules apply)"
            )
        bias_max = 0.0
        if anchor.bias:
            bias = site.constant(anchor.bias)
            if bias is None:
                raise NotApplicable("the bias is computed at run time: no bound can be stated")
            bias_max = float(np.max(np.abs(bias.astype(np.float64)), initial=0.0))
        k = rows.shape[1]
        per_unit = per_unit_bound(k, _column_scale_sums(rows, anchor), bias=bool(anchor.bias))
        constant = 3 * _U * bias_max
        needed = kernel_opsets.qdq_opset(False, weights.dtype, per_axis=weights.axis is not None) or 0
        if not anchor.activation and options["quantize"] == "keep":
            needed = max(needed, kernel_opsets.FORMS["dynamic-quantize-linear"])
        notes = (
            anchor.what,
            f"float32 accumulation: within {constant:.3g} + {per_unit:.3g}·max|{anchor.x}| of the integer sum (K={k})",
        )
        reads = set(anchor.reads)
        if anchor.activation:  # reads the kept DynamicQuantizeLinear's outputs, not x
            reads.discard(anchor.x)
            reads.update(anchor.activation)
        return Plan(
            min_opset=needed,
            notes=notes,
            data={"anchor": anchor},
            bound=constant,
            bound_scale=(anchor.x, per_unit),
            reads=frozenset(reads),
        )

    def build(self, site: Site, emit: Emitter, options: Mapping[str, Any], plan: Plan) -> None:
        if options["role"] == "remove_dead":
            return  # nothing: the node is dead (the engine checked)
        anchor: Anchor = plan.data["anchor"]
        if anchor.activation:
            y, y_scale, y_zp = anchor.activation
        else:  # DynamicQuantizeMatMul: quantize the activation as the kernel does
            names = [emit.fresh("A_quantized"), emit.fresh("A_scale"), emit.fresh("A_zero_point")]
            if options["quantize"] == "keep":
                emit.op("DynamicQuantizeLinear", [anchor.x], names)
            else:
                DynamicQuantizeLinearBuilder.expand_onnxruntime(anchor.x, emit, names)
            y, y_scale, y_zp = names
        x = emit.op1("DequantizeLinear", [y, y_scale, y_zp], hint="DequantizeActivation")
        w = dequantize_weights(emit, anchor.weights)
        out = site.node.output[0]
        if anchor.op == "Conv":
            emit.op1("Conv", [x, w], out, **{a.name: a for a in anchor.attributes})
        elif anchor.bias:
            emit.op1("Add", [emit.op1("MatMul", [x, w]), anchor.bias], out)
        else:
            emit.op1("MatMul", [x, w], out)


register(DynamicQdqBuilder())
