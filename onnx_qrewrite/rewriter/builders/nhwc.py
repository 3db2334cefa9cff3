"""onnxruntime's channels-last ops -> Transpose to channels-first, the standard op, Transpose back.

onnxruntime's session optimizer at level ALL (``optimized_model_filepath``) rewrites a quantized
CNN into channels-last (NHWC) kernels of the ``com.microsoft`` domain: QLinearConv with
``channels_last = 1`` and **NhwcMaxPool** between them, a Transpose at each end of the NHWC
region. People ship such saved models (onnxruntime warns that they are "hardware specific").

**NhwcMaxPool(x)** (uint8/int8, x of shape ``[N, D1, ..., Dk, C]``, attributes ``kernel_shape``,
``strides``, ``pads``, ``dilations``, ``auto_pad``, ``ceil_mode``) is MaxPool over the spatial axes
of x transposed to ``[N, C, D1, ..., Dk]``, transposed back::

    Transpose(MaxPool(Transpose(x, perm=[0, k+1, 1, ..., k]), ...), perm=[0, 2, ..., k+1, 1])

MaxPool only selects each window's largest value and both Transposes only move values, so the
rewrite is **exact**. Standard MaxPool takes uint8/int8 from opset 12 (``kernel_opsets.FORMS``;
onnxruntime 1.31.1 refuses the types at 11). The rank is ``len(kernel_shape) + 2``. Measured bit
for bit against onnxruntime's NhwcMaxPool kernel, 1-D to 3-D, with strides, pads, dilations,
``ceil_mode`` and ``auto_pad`` (tests/test_lower_nhwc.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import onnx

from onnx_qrewrite.rewriter import kernel_opsets
from onnx_qrewrite.rewriter.builders import Emitter, NoMatch, Plan, Site, register
from onnx_qrewrite.rewriter.builders.contracts import CONTRACTS
from onnx_qrewrite.rewriter.graph import dtype_name

__all__ = ["NhwcBuilder"]

#: NhwcMaxPool's attributes (onnxruntime's contrib schema), all of which MaxPool takes as they are.
_MAX_POOL_ATTRIBUTES = frozenset({"auto_pad", "kernel_shape", "strides", "pads", "dilations", "ceil_mode"})


class NhwcBuilder:
    """Replaces a channels-last com.microsoft op with Transpose -> the standard op -> Transpose."""

    name = "nhwc_to_nchw"
    contract = CONTRACTS["nhwc_to_nchw"]

    def quantized_dtype(self, site: Site) -> str | None:
        elem = site.value_type(site.input(0))
        return dtype_name(elem) if elem else None

    def check(self, site: Site, options: Mapping[str, Any]) -> Plan:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in site.node.attribute}
        unknown = sorted(set(attrs) - _MAX_POOL_ATTRIBUTES)
        if unknown:
            raise NoMatch(f"malformed node: unknown attribute {unknown[0]!r} for NhwcMaxPool")
        kernel = attrs.get("kernel_shape")
        if not kernel:
            raise NoMatch("malformed node: NhwcMaxPool needs its 'kernel_shape' attribute")
        if len(site.node.output) > 1 and any(site.node.output[1:]):
            raise NoMatch("NhwcMaxPool has one output; a second one is not rewritten")
        return Plan(
            min_opset=kernel_opsets.FORMS["max-pool-8bit"],
            data={"attrs": attrs, "rank": len(kernel) + 2},
        )

    def build(self, site: Site, emit: Emitter, options: Mapping[str, Any], plan: Plan) -> None:
        rank: int = plan.data["rank"]
        first = emit.op1("Transpose", [site.input(0)], perm=[0, rank - 1, *range(1, rank - 1)])
        pooled = emit.op1("MaxPool", [first], **plan.data["attrs"])
        emit.op1("Transpose", [pooled], site.node.output[0], perm=[0, *range(2, rank), 1])


register(NhwcBuilder())
