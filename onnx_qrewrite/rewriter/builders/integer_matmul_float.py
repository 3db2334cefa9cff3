"""MatMulInteger / ConvInteger and the Cast to float that reads them -> float arithmetic with no
int32 tensor: part of the named form "float-emulation" (``rules/forms/float-emulation.toml``).

The output of MatMulInteger and ConvInteger is int32 by definition, and ``quantize_dynamic``
follows each with ``Cast(to=FLOAT)``. The default lowering (``builders/integer_matmul.py``) keeps
that int32 tensor (float MatMul, then ``Cast<i32>``); targets that refuse int32 tensors inside the
network (NNAPI, WebGPU, TensorRT paths) still refuse it. Where the int32 value is observed only by
one such Cast, this builder folds the pair::

    MatMulInteger(A, B, a_zp, b_zp) -> y:int32 ; Cast<f32>(y) -> z
        =>  z = MatMul(Cast<f32>(A) - a_zp, Cast<f32>(B) - b_zp)     (ConvInteger: Conv, its attributes)

It is exact under the same proof as the ``float-exact`` form: every partial sum is an integer of
magnitude at most S = sum |products| <= 2^24 (bounded per node from the dtype ranges, the zero
points and constant weights), so the float sum is the exact integer, which is what ``Cast<f32>``
of the int32 result gives. Where that cannot be shown, or the int32 value has another reader (a
second node, a graph output, a subgraph), both parts decline and the default rules apply.

Two rules: part ``cast`` at the Cast emits the float computation under the Cast's output name
(``Plan.reads``: it reads the integer op's inputs, not its output); part ``producer`` at the
MatMulInteger/ConvInteger removes it (``Plan.remove_if_dead``), which the engine does only if
nothing reads it once the scope's rewrites are decided, and otherwise tries the node's next rules:
a skipped or declining Cast rule can never leave a Cast reading a removed value. The producer rule
``precedes`` the default integer-matmul rules (catalogue.py), which would take the node first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import onnx

from onnx_qrewrite.rewriter.builders import Emitter, NoMatch, NotApplicable, Plan, Site, register
from onnx_qrewrite.rewriter.builders.contracts import CONTRACTS
from onnx_qrewrite.rewriter.builders.integer_matmul import IntegerMatMulBuilder, _padded
from onnx_qrewrite.rewriter.graph import Scope

__all__ = ["IntegerMatMulFloatOutputBuilder"]

_T = onnx.TensorProto
_PRODUCERS = ("MatMulInteger", "ConvInteger")
_EXACT = IntegerMatMulBuilder()


def _graph_outputs(scope: Scope) -> set[str]:
    c = scope.container
    return {o.name for o in c.output} if isinstance(c, onnx.GraphProto) else set(c.output)


def _is_cast_to_float(node: onnx.NodeProto) -> bool:
    return (
        node.op_type == "Cast"
        and node.domain in ("", "ai.onnx")
        and any(a.name == "to" and a.i == _T.FLOAT for a in node.attribute)
    )


def _fold(site: Site, producer: onnx.NodeProto) -> Plan:
    """The float-exact plan of ``producer`` when its int32 output's only observer is one Cast to
    float in its scope; NotApplicable otherwise (then the default rules lower it)."""
    if producer.op_type not in _PRODUCERS or producer.domain not in ("", "ai.onnx"):
        raise NotApplicable(f"{producer.op_type} is not an integer matmul or convolution")
    y = producer.output[0] if len(producer.output) == 1 else ""
    readers = site.scope.readers(y)
    if len(readers) != 1 or not _is_cast_to_float(readers[0]) or y in _graph_outputs(site.scope):
        raise NotApplicable(f"its int32 output {y!r} is observed by more than one Cast to float")
    own = Site(producer, site.scope, site.same_shape_ops)
    try:
        # Exact only: where onnxruntime's u8 x s8 kernel can saturate, the default (bounded) rules apply.
        plan = _EXACT.check(own, {"accumulate": "float-exact", "u8s8_saturation": "decline"})
    except NoMatch as why:
        raise NotApplicable(str(why)) from None
    read = plan.data["read"]
    inputs = _padded(own)
    reads = frozenset(n for n in (*read.a.names(inputs), *read.b.names(inputs)) if n)
    notes = (*plan.notes, "int32 output folded into its Cast")
    return Plan(min_opset=plan.min_opset, notes=notes, data=plan.data, reads=reads)


class IntegerMatMulFloatOutputBuilder:
    """MatMulInteger/ConvInteger read by one Cast to float -> a float MatMul/Conv writing the Cast's output."""

    name = "integer_matmul_float_output"
    contract = CONTRACTS["integer_matmul_float_output"]

    def quantized_dtype(self, site: Site) -> str | None:
        return None

    def check(self, site: Site, options: Mapping[str, Any]) -> Plan:
        if options["part"] == "producer":
            node = site.node
            if node.op_type not in _PRODUCERS or node.domain not in ("", "ai.onnx"):
                raise NotApplicable(f"{node.op_type} is not an integer matmul or convolution")
            return Plan(notes=("removed: its Cast to float computes the product",), remove_if_dead=True)
        if not _is_cast_to_float(site.node) or not site.node.input:
            raise NotApplicable("not a Cast to float")
        producer = site.scope.producer(site.node.input[0])
        if producer is None:
            raise NotApplicable("its input is not produced by an integer matmul or convolution in this scope")
        return _fold(site, producer)

    def build(self, site: Site, emit: Emitter, options: Mapping[str, Any], plan: Plan) -> None:
        if options["part"] == "producer":
            return  # removed (the engine checked nothing reads it): its Cast computes the product
        read = plan.data["read"]
        producer = site.scope.producer(site.node.input[0])
        assert producer is not None
        inputs = _padded(Site(producer, site.scope, site.same_shape_ops))
        a = IntegerMatMulBuilder._shifted(emit, read.a, read.a.names(inputs), _T.FLOAT, per_row=True, rank=read.a_rank)
        b = IntegerMatMulBuilder._shifted(
            emit, read.b, read.b.names(inputs), _T.FLOAT, per_row=False, rank=read.b_rank, conv=read.conv
        )
        out = site.node.output[0]
        if read.conv:
            emit.op1("Conv", [a, b], out, **{attr.name: attr for attr in producer.attribute})
        else:
            emit.op1("MatMul", [a, b], out)


register(IntegerMatMulFloatOutputBuilder())
