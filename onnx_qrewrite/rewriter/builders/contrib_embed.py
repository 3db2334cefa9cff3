"""onnxruntime's ``com.microsoft`` EmbedLayerNormalization -> Gather, Add and LayerNormalization
(what onnxruntime.transformers' optimizer writes at the bottom of every BERT-like model), and
QEmbedLayerNormalization (what ``quantize_dynamic`` makes of it: 8-bit tables, gamma and beta with
per-tensor scales and zero points; rows are gathered, then ``DequantizeLinear``-ed, as the kernel
dequantizes each value it reads)::

    EmbedLayerNormalization(ids, segment_ids, word, position, segment, gamma, beta, mask, position_ids)
        output 0:  LayerNormalization((word[ids] + position[position_ids or 0..S-1]) + segment[segment_ids])
        output 1:  mask_index = number of mask values equal to 1 per batch row (int32; zeros without a mask)
        output 2:  the embedding sum before the normalization

in the kernel's order (onnxruntime 1.31.1's CPU kernel, measured in tests/test_unfuse_attention.py):
the sum is ``(word + position) + segment``, bit-exact. The normalization is the kernels' own
(``embed_layer_norm.cc``, ``qembed_layer_norm.cc``): two passes over each row, each a sequential
float32 sum (``mean = Σx / h``, then ``var = Σ(x - mean)² / h``), ``(x - mean) / sqrt(var + eps) · γ + β``.
Not ``LayerNormalization``: onnxruntime's computes ``sqrt(Σx²/h - mean² + eps)`` in one pass, which
cancels where a row's mean is large against its spread (a quantized table's zero point puts it
there: that was the QEmbedLayerNormalization gap, 27.4·2^-24 against 4.6 for the float battery's
near-zero means), and ``ReduceSum`` adds in another order, whose error the mean's magnitude
carries into every ``x - mean``. ``CumSum`` adds sequentially: its last element is the kernels' sum,
so the whole row is bit-exact on x86-64 (measured; ``benchmarks/embed_bound_probe.py``).
The mask index counts values equal to 1 (a 2 or a -1 does not count), bit-exact.

float16 tables, gamma and beta are not lowered: onnxruntime 1.31.1 has no float16 kernel on CPU and
runs the float32 one between Casts it inserts (alone, its outputs are the float32 kernel's rounded
once), but keeps float32 between neighbouring nodes it runs so (an Attention or a FastGelu after it
reads the unrounded result: measured), so the node's float16 output depends on its neighbours, as
for the other fusions without a float16 kernel (contrib_fusions.py). ``mask_index_type`` (0: no mask
index, in the schema) is not read by the CPU kernel: it writes the mask index output whatever the
value (measured with 0, 1 and 2), so 0 is lowered as 1.

Where they differ on invalid input: an id outside the table (or negative) is an error in the kernel;
``Gather`` errors outside ``[-V, V)`` and reads from the end for negative ids.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx

from onnx_qrewrite.rewriter import kernel_opsets
from onnx_qrewrite.rewriter.builders import Emitter, NoMatch, Plan, Site, register
from onnx_qrewrite.rewriter.builders._float_inputs import no_float16_kernel
from onnx_qrewrite.rewriter.builders.contracts import CONTRACTS, EMBED_FORMULA
from onnx_qrewrite.rewriter.graph import dtype_name

__all__ = ["EmbedLayerNormalizationBuilder"]

_T = onnx.TensorProto


def _check_float_types(site: Site, indices: tuple[int, ...]) -> None:
    """The float inputs at ``indices``: float32 only. float16 is refused: onnxruntime has no float16
    kernel on CPU and runs the float32 one between Casts it inserts, keeping float32 between
    neighbouring such nodes (an Attention or a FastGelu after it reads the unrounded sum: measured),
    so the node's float16 result depends on its neighbours. One of them must have a known type,
    declared or traced from its producer (they share one: the kernel's T), else a float16 node
    could pass for float32."""
    if all(site.value_type(site.input(index)) is None for index in indices if site.input(index)):
        raise NoMatch(
            "the element type of the tables, gamma and beta is not recorded; run onnx shape inference on the model "
            "first (onnx.shape_inference.infer_shapes)"
        )
    for index in indices:
        elem = site.value_type(site.input(index)) if site.input(index) else None
        if elem == _T.FLOAT16:
            raise no_float16_kernel(site.input(index))
        if elem is not None and elem != _T.FLOAT:
            raise NoMatch(f"{site.input(index)!r} is {dtype_name(elem)}; only float32 was measured")


class EmbedLayerNormalizationBuilder:
    """Replaces com.microsoft EmbedLayerNormalization with Gather, Add, LayerNormalization and the mask count."""

    name = "unfuse_embed_layer_norm"
    contract = CONTRACTS["unfuse_embed_layer_norm"]

    def quantized_dtype(self, site: Site) -> str | None:
        elem = site.elem_type(site.input(2))
        return dtype_name(elem) if elem else None

    def check(self, site: Site, options: Mapping[str, Any]) -> Plan:
        quantized = options["form"] == "quantized"
        known = {"epsilon"} if quantized else {"epsilon", "mask_index_type"}
        site.no_unknown_attributes(known)
        if int(site.attribute("mask_index_type", 1)) not in (0, 1):
            raise NoMatch(
                f"mask_index_type={site.attribute('mask_index_type')} is not one of the schema's values (0, 1); "
                "not lowered"
            )
        required = (2, 3, 5, 6, 8, 9, 11, 12, 13, 14, 16, 17) if quantized else (2, 3, 5, 6)
        for index in required:
            if not site.input(index):
                raise NoMatch(f"malformed node: input {index} is required")
        if bool(site.input(1)) != bool(site.input(4)):
            raise NoMatch("segment_ids and segment_embedding must both be given or both absent")
        if quantized and site.input(4) and not (site.input(10) and site.input(15)):
            raise NoMatch("malformed node: the segment embedding's scale and zero point are required")
        _check_float_types(site, (8, 9, 10, 11, 12) if quantized else (2, 3, 4, 5, 6))
        for index in (0, 1, 7) if quantized else (0, 1, 7, 8):
            elem = site.elem_type(site.input(index))
            if elem is not None and elem != _T.INT32:
                raise NoMatch(f"{site.input(index)!r} is {dtype_name(elem)}, not int32")
        if quantized:
            for index in (8, 9, 10, 11, 12, 13, 14, 15, 16, 17):
                value = site.constant(site.input(index)) if site.input(index) else None
                if site.input(index) and (value is None or value.size != 1):
                    raise NoMatch(f"{site.input(index)!r} is not a constant per-tensor scale or zero point")
        # Bounded (for builds that contract multiply-adds): per element, evaluated by verify at the node.
        return Plan(min_opset=kernel_opsets.FORMS["embed-layer-norm"], bound_formula=EMBED_FORMULA)

    def build(self, site: Site, emit: Emitter, options: Mapping[str, Any], plan: Plan) -> None:
        outputs = [*site.node.output, "", ""][:3]
        ids = site.input(0)
        quantized = options["form"] == "quantized"

        def rows(table: int, indices: str, hint: str) -> str:
            found = emit.op1("Gather", [site.input(table), indices], axis=0, hint=hint)
            if not quantized:
                return found
            # Per-tensor: dequantizing the gathered rows is dequantizing the table, row by row.
            return dequantize(found, table)

        def dequantize(value: str, index: int) -> str:
            scale, zero_point = site.input(index + 6), site.input(index + 11)
            return emit.op1("DequantizeLinear", [value, _scalar(scale), _scalar(zero_point)])

        def _scalar(name: str) -> str:
            value = site.constant(name)
            assert value is not None
            return emit.const(value.reshape(()))

        words = rows(2, ids, "Words")
        if not quantized and site.input(8):
            position_ids = site.input(8)
        else:
            length = emit.op1("Gather", [emit.op1("Shape", [ids]), emit.const(np.int64(1))], axis=0)
            position_ids = emit.op1("Range", [emit.const(np.int64(0)), length, emit.const(np.int64(1))])
        positions = rows(3, position_ids, "Positions")
        # As the kernel: (word + position) + segment.
        total = emit.op1("Add", [words, positions], None if site.input(1) else outputs[2] or None)
        if site.input(1):
            segments = rows(4, site.input(1), "Segments")
            total = emit.op1("Add", [total, segments], outputs[2] or None)
        eps = float(site.attribute("epsilon", 1e-12))
        gamma, beta = (dequantize(site.input(i), i) if quantized else site.input(i) for i in (5, 6))
        _normalize(emit, total, gamma, beta, eps, outputs[0])
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


def _row_sum(emit: Emitter, x: str) -> str:
    """Σ over the last axis (kept) in the kernels' order, each element added to the running float32
    sum in turn: CumSum's last element (onnxruntime's CumSum adds sequentially: measured)."""
    running = emit.op1("CumSum", [x, emit.const(np.int64(-1))])
    last = emit.const(np.array([-1], np.int64))
    return emit.op1("Slice", [running, last, emit.const(np.array([_INT64_MAX], np.int64)), last])


def _normalize(emit: Emitter, x: str, gamma: str, beta: str, eps: float, output: str) -> None:
    """The kernels' normalization of each row of ``x`` into ``output``, operation for operation:
    ``mean = Σx / h``; ``a = x - mean``; ``e = sqrt(Σa² / h + eps)``; ``a / e · γ + β``, h the
    hidden size as float32 (exact below 2^24)."""
    dims = emit.op1("Shape", [x])
    hidden = emit.op1("Cast", [emit.op1("Gather", [dims, emit.const(np.int64(-1))], axis=0)], to=_T.FLOAT)
    mean = emit.op1("Div", [_row_sum(emit, x), hidden], hint="Mean")
    centred = emit.op1("Sub", [x, mean])
    variance = emit.op1("Div", [_row_sum(emit, emit.op1("Mul", [centred, centred])), hidden], hint="Variance")
    root = emit.op1("Sqrt", [emit.op1("Add", [variance, emit.const(np.float32(eps))])])
    scaled = emit.op1("Mul", [emit.op1("Div", [centred, root]), gamma])
    emit.op1("Add", [scaled, beta], output)


#: The end of a Slice to the end of its axis.
_INT64_MAX = np.iinfo(np.int64).max


register(EmbedLayerNormalizationBuilder())
