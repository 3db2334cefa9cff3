"""onnxruntime's ``com.microsoft`` EmbedLayerNormalization -> Gather, Add and LayerNormalization
(what onnxruntime.transformers' optimizer writes at the bottom of every BERT-like model)::

    EmbedLayerNormalization(ids, segment_ids, word, position, segment, gamma, beta, mask, position_ids)
        output 0:  LayerNormalization((word[ids] + position[position_ids or 0..S-1]) + segment[segment_ids])
        output 1:  mask_index = number of mask values equal to 1 per batch row (int32; zeros without a mask)
        output 2:  the embedding sum before the normalization

in the kernel's order (onnxruntime 1.31.1's CPU kernel, measured in tests/test_unfuse_attention.py):
the sum is ``(word + position) + segment``, bit-exact; the normalization is bounded, as for
SkipLayerNormalization, because the kernel sums the mean and the variance sequentially in float32.
The mask index counts values equal to 1 (a 2 or a -1 does not count), bit-exact.

Where they differ on invalid input: an id outside the table (or negative) is an error in the kernel;
``Gather`` errors outside ``[-V, V)`` and reads from the end for negative ids.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx

from onnx_qrewrite.builders import Emitter, NoMatch, Plan, Site, register
from onnx_qrewrite.contract import BOUNDED, Contract
from onnx_qrewrite.graph import dtype_name

__all__ = ["EmbedLayerNormalizationBuilder"]

_T = onnx.TensorProto


class EmbedLayerNormalizationBuilder:
    """Replaces com.microsoft EmbedLayerNormalization with Gather, Add, LayerNormalization and the mask count."""

    name = "unfuse_embed_layer_norm"
    contract = Contract(
        options=(),
        emits=frozenset(
            {"Gather", "Add", "LayerNormalization", "Range", "Shape", "Equal", "Cast", "ReduceSum", "ConstantOfShape"}
            | {"Slice"}
        ),
        exactness=lambda options: BOUNDED,
        bound="output 0: the mean and variance summed in float32 in another order than the kernel's sequential "
        "loop, at most 16·2^-24·(|y| + 1) at each output y (asserted on the tests' battery); the mask index and "
        "the embedding sum are bit-exact",
        outputs=2,
        opset=lambda options, dtypes: "17",
    )

    def quantized_dtype(self, site: Site) -> str | None:
        elem = site.elem_type(site.input(2))
        return dtype_name(elem) if elem else None

    def check(self, site: Site, options: Mapping[str, Any]) -> Plan:
        unknown = sorted({a.name for a in site.node.attribute} - {"epsilon", "mask_index_type"})
        if unknown:
            raise NoMatch(f"attribute(s) {', '.join(unknown)} not supported")
        if int(site.attribute("mask_index_type", 1)) != 1:
            raise NoMatch(f"mask_index_type={site.attribute('mask_index_type')} is not lowered (1 is)")
        for index in (2, 3, 5, 6):
            if not site.input(index):
                raise NoMatch(f"malformed node: input {index} is required")
        if bool(site.input(1)) != bool(site.input(4)):
            raise NoMatch("segment_ids and segment_embedding must both be given or both absent")
        for index in (2, 3, 4, 5, 6):
            elem = site.elem_type(site.input(index))
            if elem is not None and elem != _T.FLOAT:
                raise NoMatch(f"{site.input(index)!r} is {dtype_name(elem)}; only float32 was measured")
        for index in (0, 1, 7, 8):
            elem = site.elem_type(site.input(index))
            if elem is not None and elem != _T.INT32:
                raise NoMatch(f"{site.input(index)!r} is {dtype_name(elem)}, not int32")
        return Plan(min_opset=17)

    def build(self, site: Site, emit: Emitter, options: Mapping[str, Any], plan: Plan) -> None:
        outputs = [*site.node.output, "", ""][:3]
        ids = site.input(0)
        words = emit.op1("Gather", [site.input(2), ids], axis=0, hint="Words")
        if site.input(8):
            position_ids = site.input(8)
        else:
            length = emit.op1("Gather", [emit.op1("Shape", [ids]), emit.const(np.int64(1))], axis=0)
            position_ids = emit.op1("Range", [emit.const(np.int64(0)), length, emit.const(np.int64(1))])
        positions = emit.op1("Gather", [site.input(3), position_ids], axis=0, hint="Positions")
        # As the kernel: (word + position) + segment.
        total = emit.op1("Add", [words, positions], None if site.input(1) else outputs[2] or None)
        if site.input(1):
            segments = emit.op1("Gather", [site.input(4), site.input(1)], axis=0, hint="Segments")
            total = emit.op1("Add", [total, segments], outputs[2] or None)
        eps = float(site.attribute("epsilon", 1e-12))
        emit.op1("LayerNormalization", [total, site.input(5), site.input(6)], outputs[0], axis=-1, epsilon=eps)
        if outputs[1]:
            if site.input(7):
                ones = emit.op1("Cast", [emit.op1("Equal", [site.input(7), emit.const(np.int32(1))])], to=_T.INT32)
                axes = emit.const(np.array([1], np.int64))
                emit.op1("ReduceSum", [ones, axes], outputs[1], keepdims=0)
            else:
                batch = emit.op1(
                    "Slice",
                    [
                        emit.op1("Shape", [ids]),
                        emit.const(np.array([0], np.int64)),
                        emit.const(np.array([1], np.int64)),
                    ],
                )
                zero = onnx.helper.make_tensor("value", _T.INT32, [1], [0])
                emit.op1("ConstantOfShape", [batch], outputs[1], value=zero)


register(EmbedLayerNormalizationBuilder())
