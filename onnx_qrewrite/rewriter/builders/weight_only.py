"""The "weight-only" form: dynamically quantized matmuls and convolutions back to float arithmetic on
the float activation, with only the weights dequantized. Applied only when asked for
(``named_form("weight-only")``, ``--form weight-only``); approximate by design.

Patterns, as ``onnxruntime.quantization.quantize_dynamic`` and onnxruntime's optimizer write them::

    DynamicQuantizeLinear(x) -> y, y_scale, y_zp
    MatMulInteger(y, W, y_zp, W_zp) | ConvInteger(y, W, y_zp, W_zp) -> Cast(to float)
    Mul(that, Mul(y_scale, W_scale))                 ==>  MatMul(x, W') | Conv(x, W')
    com.microsoft MatMulIntegerToFloat(y, W, y_scale, W_scale, y_zp, W_zp[, bias])
                                                     ==>  MatMul(x, W') [-> Add(bias)]
    com.microsoft DynamicQuantizeMatMul(x, W, W_scale, W_zp[, bias])
                                                     ==>  MatMul(x, W') [-> Add(bias)]
    DequantizeLinear(Gather(W, ids), W_scale, W_zp)  ==>  Gather(W', ids)   (per tensor; the same values)

The gather rewrite (option ``pattern = "gather"``) is **exact**, not approximate: DequantizeLinear
is elementwise, so dequantizing the table and gathering gives every value the same arithmetic,
``(float)(w - zp) * s``; bit for bit against onnxruntime (uint8/int8 tables whose sizes leave
vector tails, every gather axis, negative indices, scales from 3.7e-38 to 2.9e38, both ``weights``
forms: ``tests/test_weight_only.py``). Its dead integer Gather is removed by an exact rule too.

where ``W' = DequantizeLinear(W, W_scale, W_zp)`` (option ``weights = "dequantize"``: the model
stays small; what TensorRT's and OpenVINO's weight-only paths consume) or its value folded into a
float initializer (``weights = "float"``: for targets with no Q/DQ at all, CoreML, WebGPU, NNAPI;
the value is onnxruntime's DequantizeLinear arithmetic, ``(float)(W - zp) * scale``). A zero point
of 0 is left out of the DequantizeLinear (what symmetric-only targets such as TensorRT read).

The engine matches one node at a time, so the rule is anchored at the pattern's last node (the
``Mul`` by the scale product, or the fused op), whose output it writes: any ``Add`` of a bias after
it stays as it is. The pattern's other nodes (``Cast``, ``MatMulInteger``/``ConvInteger``, the
scale product ``Mul``, ``DynamicQuantizeLinear``) get the ``remove_dead`` role: each is removed
only if nothing reads it once every rewrite is decided (``Plan.remove_if_dead``; the engine
decides), so a ``DynamicQuantizeLinear`` shared by the Q/K/V projections goes once all three are
rewritten, and stays (lowered by the exact rules) if anything else reads one of its outputs.

Anything that is not exactly the pattern gives way (``NotApplicable``) and the default lowerings
apply: a Cast to another type, a Mul by something that is not ``y_scale`` times a constant weight
scale, an activation zero point or scale that is not the same DynamicQuantizeLinear's, weights,
scales or zero points computed at run time, a scale whose broadcast is not per-tensor or per output
column/channel. Dropping the activation's quantization is the approximation: the result is the
float network with quantized weights (drift measured in tests/test_weight_only.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from onnx_qrewrite.rewriter import kernel_opsets
from onnx_qrewrite.rewriter.builders import Emitter, NotApplicable, Plan, Site, register
from onnx_qrewrite.rewriter.builders._dynamic_patterns import (
    CHAIN_OPS,
    STANDARD,
    Analysis,
    Anchor,
    Weights,
    analysis,
    anchor_weights_dtype,
    dequantize_weights,
)
from onnx_qrewrite.rewriter.builders.contracts import CONTRACTS
from onnx_qrewrite.rewriter.builders.qdq_to_float import dequantize_constant

__all__ = ["WeightOnlyBuilder"]


def _pattern(anchor: Anchor) -> str:
    """Which rules rewrite the pattern: "gather" (exact, the same values) or "matmul" (approximate)."""
    return "gather" if anchor.op == "Gather" else "matmul"


def _chain(found: Analysis, pattern: str) -> frozenset[str]:
    """First outputs of the other nodes of every ``pattern`` pattern in the scope: what that
    pattern's remove_dead rule may remove (the gather rule is exact, so is its removal)."""
    return frozenset(
        name for a in found.anchors.values() if isinstance(a, Anchor) and _pattern(a) == pattern for name in a.chain
    )


class WeightOnlyBuilder:
    """Integer matmul/conv patterns to float MatMul/Conv of the float activation and dequantized weights."""

    name = "weight_only"
    contract = CONTRACTS["weight_only"]

    def quantized_dtype(self, site: Site) -> str | None:
        return anchor_weights_dtype(site)

    def check(self, site: Site, options: Mapping[str, Any]) -> Plan:
        node = site.node
        if not node.output or not node.output[0]:
            raise NotApplicable("the node has no output")
        found = analysis(site.scope)
        pattern = options["pattern"]
        if options["role"] == "remove_dead":
            chain = site.scope.memo(("weight-only-chain", pattern), lambda: _chain(found, pattern))
            if node.domain not in STANDARD or node.op_type not in CHAIN_OPS or node.output[0] not in chain:
                raise NotApplicable(f"not part of a weight-only {pattern} pattern")
            return Plan(remove_if_dead=True)
        anchor = found.anchors.get(node.output[0])
        if anchor is None:
            raise NotApplicable(f"{node.op_type} does not end a dynamically quantized matmul or convolution")
        if isinstance(anchor, str):
            raise NotApplicable(anchor)
        if _pattern(anchor) != pattern:
            raise NotApplicable(f"a {_pattern(anchor)} pattern; the rule rewrites {pattern} patterns")
        weights = anchor.weights
        needed = 0
        if options["weights"] == "dequantize":
            needed = kernel_opsets.qdq_opset(False, weights.dtype, per_axis=weights.axis is not None) or 0
        notes = [
            anchor.what,
            "weights folded to float" if options["weights"] == "float" else "DequantizeLinear weights",
        ]
        return Plan(min_opset=needed, notes=tuple(notes), data={"anchor": anchor}, reads=anchor.reads)

    def build(self, site: Site, emit: Emitter, options: Mapping[str, Any], plan: Plan) -> None:
        if options["role"] == "remove_dead":
            return  # nothing: the node is dead (the engine checked)
        anchor: Anchor = plan.data["anchor"]
        weights = self._weights(site, emit, anchor.weights, options["weights"])
        y = site.node.output[0]
        if anchor.op == "Conv":
            emit.op1("Conv", [anchor.x, weights], y, **{a.name: a for a in anchor.attributes})
        elif anchor.op == "Gather":
            emit.op1("Gather", [weights, anchor.x], y, **{a.name: a for a in anchor.attributes})
        elif anchor.bias:
            emit.op1("Add", [emit.op1("MatMul", [anchor.x, weights]), anchor.bias], y)
        else:
            emit.op1("MatMul", [anchor.x, weights], y)

    @staticmethod
    def _weights(site: Site, emit: Emitter, w: Weights, form: str) -> str:
        if form == "float":
            value = site.constant(w.name)
            assert value is not None  # checked: a constant
            return emit.const(dequantize_constant(value, w.scale, w.zero_point, w.axis or 0, 0))
        return dequantize_weights(emit, w)


register(WeightOnlyBuilder())
