"""The "qdq-to-float" form: a QDQ model back to float, for debugging accuracy and for runtimes that
run only float. Applied only when asked for (``named_form("qdq-to-float")``)::

    DequantizeLinear(W: constant, s, zp)  -> Identity(W_float)       # folded at rewrite time
    DequantizeLinear(QuantizeLinear(x))   -> Clip(x, lo, hi)         # activation pair removed
    QuantizeLinear(x) read only by such DequantizeLinear nodes -> nothing (dead after the above)

Folding a constant's DequantizeLinear is **exact**: ``(float)(w - zp) * s`` in float32, per-tensor,
per-axis or blocked, the very arithmetic of onnxruntime's kernel (tested bit for bit).

Removing a Q -> DQ pair is **approximate** by design (the model's float reference, not the
quantized model), so those rules also need ``--allow-approximate``; what it drops and keeps:

- kept: the **saturation**. Quantizers fold a Relu (or Clip) into the QuantizeLinear's range:
  ``quantize_static`` removes the Relu after a Conv and quantizes its input with zero point qmin,
  so the pair *is* the Relu; an Identity would drop it (negative values pass; measured on a
  quantize_static CNN in ``tests/test_qdq_to_float.py``). The pair's output lies in
  ``[lo, hi] = [(qmin - zp) * s, (qmax - zp) * s]`` (the DequantizeLinear's scale and zero point,
  computed in float32 as its kernel computes them, so lo and hi are the pair's own extreme
  outputs), and values beyond saturate there: ``Clip(x, lo, hi)`` (attributes below opset 11), or
  ``Max(Min(x, hi), lo)`` with per-channel bounds for a per-axis scale (rank known). Where the
  scale or zero point is computed at run time, or the type has no integer range (float8), or a
  per-axis input's rank is unknown, the pair becomes ``Identity`` and the rewrite's note says the
  clamp was not kept.
- dropped: the **rounding** to the quantization grid (up to half a step, ``s / 2``, per value
  inside the range), the difference between the QuantizeLinear's and the DequantizeLinear's own
  parameters if they are not the same, and NaN (the pair gives ``lo``'s value, qmin; the
  replacement passes NaN on).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx

from onnx_qrewrite.rewriter import kernel_opsets
from onnx_qrewrite.rewriter.builders import Emitter, NoMatch, NotApplicable, Plan, Site, register
from onnx_qrewrite.rewriter.builders._qdq import INTEGER_RANGES, quantized_dtype, value_shape
from onnx_qrewrite.rewriter.builders.contracts import CONTRACTS
from onnx_qrewrite.rewriter.graph import dtype_name

__all__ = ["QDQToFloatBuilder", "dequantize_constant"]


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def dequantize_constant(
    x: np.ndarray, scale: np.ndarray, zp: np.ndarray | None, axis: int, block_size: int
) -> np.ndarray:
    """``(float)(x - zp) * scale`` in float32, as onnxruntime's DequantizeLinear computes it."""
    wide = x.astype(np.int64)
    scale = np.asarray(scale, np.float32)
    zp_wide = np.zeros((), np.int64) if zp is None else np.asarray(zp).astype(np.int64)
    if scale.size > 1 or block_size:
        axis %= x.ndim
        if block_size:  # each value's block by index: block_size is the model's, nothing is sized by it
            of_block = np.arange(x.shape[axis]) // block_size
            scale = scale.take(of_block, axis=axis)
            if zp is not None:
                zp_wide = zp_wide.take(of_block, axis=axis)
        else:
            shape = [1] * x.ndim
            shape[axis] = -1
            scale = scale.reshape(shape)
            zp_wide = zp_wide.reshape(shape) if zp_wide.size > 1 else zp_wide.reshape(())
    else:
        scale = scale.reshape(())
        zp_wide = zp_wide.reshape(())
    # exact for every type up to 16 bits; int32 (zero point 0) rounds to nearest as the kernel's cast
    difference = (wide - zp_wide).astype(np.float32)
    with np.errstate(over="ignore"):  # a product beyond float32's range is inf, as in the kernel
        return (difference * scale).astype(np.float32)


def _clamp(site: Site) -> tuple[np.ndarray, np.ndarray, tuple[int, ...] | None] | str:
    """The range of DequantizeLinear(QuantizeLinear(x)) at ``site`` (the DequantizeLinear):
    ``(qmin - zp) * s`` and ``(qmax - zp) * s`` in float32, as the kernel computes them, and the
    shape they broadcast with along a per-axis scale's axis (None: per tensor); or why not."""
    attrs = _attrs(site.node)
    if attrs.get("block_size"):
        return "blocked scales"
    scale = site.constant(site.input(1))
    if scale is None or scale.dtype != np.float32:
        return "the scale is not a float32 constant"
    zp = site.constant(site.input(2)) if site.input(2) else None
    if site.input(2) and zp is None:
        return "the zero point is computed at run time"
    try:
        dtype = quantized_dtype(site, quantize=False)
    except NoMatch:  # untyped: the QuantizeLinear's zero point (or output_dtype, or its uint8 default)
        dtype = str(zp.dtype) if zp is not None else _produced_dtype(site)
    if dtype not in INTEGER_RANGES:
        return f"{dtype} has no integer range"
    qmin, qmax = INTEGER_RANGES[dtype]
    zp_wide = np.zeros((), np.int64) if zp is None else np.asarray(zp).astype(np.int64)
    # (float)(q - zp) * s: the difference is exact in float32 for every type up to 16 bits.
    lo = (np.asarray(qmin - zp_wide).astype(np.float32) * scale).astype(np.float32)
    hi = (np.asarray(qmax - zp_wide).astype(np.float32) * scale).astype(np.float32)
    if scale.size == 1 and zp_wide.size == 1:
        return lo.reshape(1), hi.reshape(1), None
    shape = value_shape(site.scope, site.input(0), site.same_shape_ops)
    if shape is None:
        return "per-axis scale and the input's rank is not recorded"
    rank = len(shape)
    axis = int(attrs.get("axis", 1))
    if not -rank <= axis < rank:
        return f"axis {axis} is out of range for rank {rank}"
    axis %= rank
    broadcast = (-1,) + (1,) * (rank - 1 - axis)
    n = max(lo.size, hi.size)
    return np.broadcast_to(lo.ravel(), (n,)).copy(), np.broadcast_to(hi.ravel(), (n,)).copy(), broadcast


def _produced_dtype(site: Site) -> str:
    producer = site.scope.producer(site.input(0))
    if producer is None:
        return "unknown"
    if len(producer.input) > 2 and producer.input[2]:
        elem = site.elem_type(producer.input[2])
        return dtype_name(elem) if elem else "unknown"
    output_dtype = _attrs(producer).get("output_dtype", 0)
    return dtype_name(output_dtype) if output_dtype else "uint8"


class QDQToFloatBuilder:
    """Folds constant DequantizeLinear into float initializers; removes activation Q -> DQ pairs."""

    name = "qdq_to_float"
    contract = CONTRACTS["qdq_to_float"]

    def quantized_dtype(self, site: Site) -> str | None:
        name = site.node.output[0] if site.node.op_type == "QuantizeLinear" else site.input(0)
        elem = site.elem_type(name)
        if elem is None and site.node.op_type == "DequantizeLinear":
            value = site.constant(site.input(0))
            return None if value is None else str(value.dtype)
        return dtype_name(elem) if elem is not None else None

    def check(self, site: Site, options: Mapping[str, Any]) -> Plan:
        form = options["form"]
        node = site.node
        if form == "fold_constant":
            return self._check_fold(site)
        if form == "drop_pair_dq":
            producer = site.scope.producer(site.input(0))
            if producer is None or producer.op_type != "QuantizeLinear" or producer.domain not in ("", "ai.onnx"):
                raise NotApplicable("its input is not produced by a QuantizeLinear")
            # It reads x, not the quantized value: the QuantizeLinear is dead once its readers are rewritten.
            reads = frozenset((producer.input[0],))
            clamp = _clamp(site)
            if isinstance(clamp, str):
                return Plan(notes=(f"clamp not kept: {clamp}",), data={"x": producer.input[0]}, reads=reads)
            lo, hi, shape = clamp
            note = f"clamped to [{lo.min():.9g}, {hi.max():.9g}], the pair's range" + (
                "" if shape is None else " (per channel)"
            )
            return Plan(notes=(note,), data={"x": producer.input[0], "clamp": clamp}, reads=reads)
        # drop_pair_q: removed only once nothing reads it, which the engine decides after every
        # other node's rewrite (Plan.remove_if_dead): its readers must be rewritten by the pair rule
        # (which reads x, not the quantized value). A plan rewriting only some nodes (rewrite
        # --target, --skip qdq-to-float-drop-dq) left a DequantizeLinear reading a removed value.
        if node.op_type != "QuantizeLinear":
            raise NotApplicable(f"the rule removes QuantizeLinear nodes, not {node.op_type}")
        return Plan(remove_if_dead=True)

    @staticmethod
    def _check_fold(site: Site) -> Plan:
        x = site.constant(site.input(0))
        if x is None:
            raise NotApplicable("x is computed at run time (only constant weights are folded)")
        scale = site.constant(site.input(1))
        if scale is None:
            raise NotApplicable("the scale is computed at run time")
        if scale.dtype != np.float32:
            raise NotApplicable(f"the scale is {scale.dtype}; only float32 scales are folded")
        zp = site.constant(site.input(2)) if site.input(2) else None
        if site.input(2) and zp is None:
            raise NotApplicable("the zero point is computed at run time")
        if x.dtype == np.int32:
            # A bias: onnxruntime's kernel converts x - zp (in int32, wrapping) to float32, which the
            # fold reproduces where the zero point is 0 (always, for quantize_static's biases);
            # measured bit for bit over the whole int32 range, tests/test_qdq_to_float.py.
            if zp is not None and np.any(zp):
                raise NotApplicable("an int32 x with a non-zero zero point is not folded")
        elif x.dtype.kind not in "iu" or x.dtype.itemsize > 2:
            raise NotApplicable(f"x is {x.dtype}; 8- and 16-bit integer weights and int32 biases are folded")
        attrs = _attrs(site.node)
        if set(attrs) - {"axis", "block_size"}:
            raise NotApplicable(f"attribute(s) {sorted(set(attrs) - {'axis', 'block_size'})} are not folded")
        value = dequantize_constant(x, scale, zp, int(attrs.get("axis", 1)), int(attrs.get("block_size", 0)))
        return Plan(data={"value": value})

    def build(self, site: Site, emit: Emitter, options: Mapping[str, Any], plan: Plan) -> None:
        form = options["form"]
        if form == "fold_constant":
            emit.op1("Identity", [emit.const(plan.data["value"])], site.node.output[0])
        elif form == "drop_pair_dq":
            x, y = plan.data["x"], site.node.output[0]
            clamp = plan.data.get("clamp")
            if clamp is None:
                emit.op1("Identity", [x], y)
                return
            lo, hi, shape = clamp
            if shape is not None:
                low = emit.const(lo.reshape(shape))
                emit.op1("Max", [emit.op1("Min", [x, emit.const(hi.reshape(shape))]), low], y)
            elif emit.opset >= kernel_opsets.OP_VERSIONS["clip-inputs"]:
                emit.op1("Clip", [x, emit.const(lo.reshape(())), emit.const(hi.reshape(()))], y)
            else:  # min/max attributes (float32, so the same values)
                emit.op1("Clip", [x], y, min=float(lo.reshape(())), max=float(hi.reshape(())))
        # drop_pair_q: nothing; the engine removes the node only if nothing reads it any more.


register(QDQToFloatBuilder())
