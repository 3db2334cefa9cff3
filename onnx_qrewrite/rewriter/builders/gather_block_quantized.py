"""onnxruntime's ``com.microsoft`` GatherBlockQuantized (quantized embedding tables) -> Gather + blocked
DequantizeLinear::

    GatherBlockQuantized(data, indices, scales[, zero_points])
        -> DequantizeLinear(Gather(values, indices), Gather(scales, indices)[, Gather(zp, indices)],
                            axis=-1, block_size)

What onnxruntime 1.31.1's CPU kernel computes (measured, tests/test_lower_gather_block_quantized.py):
``float(q - zp) * scale`` per element, blocks along the last axis, indices gathered along axis 0
(negative indices count from the end); ``data`` is uint8 with ``bits`` 4 (two values per byte, low
nibble first) or 8, or int4/uint4; a missing zero point means 8 / 128 for uint8 storage and 0 for
int4/uint4. Gathering first and dequantizing only the gathered rows keeps the cost per lookup, not
per table.

onnxruntime's Gather takes no 4-bit tensors, so the table is stored with one byte per value (int8
holding ``q - zp_default`` when there is no zero point): twice the packed size, still quantized.
One behaviour is not reproduced: an index outside ``[-V, V)`` gives a row of zeros in the kernel and
an error in Gather; embedding lookups never produce one, and the rule's notes say so.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx

from onnx_qrewrite.rewriter import kernel_opsets
from onnx_qrewrite.rewriter.builders import Emitter, NoMatch, Plan, Site, register
from onnx_qrewrite.rewriter.builders.contracts import CONTRACTS
from onnx_qrewrite.rewriter.builders.matmul_nbits import unpack
from onnx_qrewrite.rewriter.graph import dtype_name

__all__ = ["GatherBlockQuantizedBuilder"]

_T = onnx.TensorProto


def _attr(site: Site, name: str, default: int) -> int:
    value = site.attribute(name, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise NoMatch(f"malformed node: attribute {name!r} is {value!r}")
    return value


def _values(site: Site, name: str, bits: int, what: str) -> tuple[np.ndarray, str]:
    """A constant's values as int16, one per element (4-bit ones unpacked), and its storage."""
    array = site.constant(name)
    if array is None:
        raise NoMatch(f"{what} {name!r} is computed at run time; only constant tables are lowered")
    kind = np.dtype(array.dtype).name
    if kind == "uint8" and bits == 4:
        rows = array.reshape(-1, array.shape[-1]) if array.ndim else array.reshape(1, 1)
        unpacked = unpack(rows, 4, rows.shape[0], rows.shape[1] * 2)
        return unpacked.reshape(*array.shape[:-1], array.shape[-1] * 2).astype(np.int16), "uint8-4"
    if kind == "uint8":
        return array.astype(np.int16), "uint8-8"
    if kind in ("int4", "uint4"):
        return array.astype(np.int16), kind
    raise NoMatch(f"{what} {name!r} is {kind}; uint8, int4 and uint4 are lowered")


class GatherBlockQuantizedBuilder:
    """Replaces com.microsoft GatherBlockQuantized with Gather and a blocked DequantizeLinear."""

    name = "gather_block_quantized"
    contract = CONTRACTS["gather_block_quantized"]

    def quantized_dtype(self, site: Site) -> str | None:
        elem = site.elem_type(site.input(0))
        return dtype_name(elem) if elem else None

    def check(self, site: Site, options: Mapping[str, Any]) -> Plan:
        node = site.node
        if len(node.input) < 3 or not all(node.input[:3]) or len(node.output) != 1:
            raise NoMatch("malformed node: GatherBlockQuantized takes data, indices, scales[, zero_points]")
        unknown = sorted({a.name for a in node.attribute} - {"gather_axis", "quantize_axis", "block_size", "bits"})
        if unknown:
            raise NoMatch(f"attribute(s) {', '.join(unknown)} not supported")
        bits, block = _attr(site, "bits", 4), _attr(site, "block_size", 128)
        if bits not in (4, 8) or block < 16 or block & (block - 1):
            raise NoMatch(f"bits={bits}, block_size={block}: lowered for bits 4/8 and power-of-two blocks >= 16")
        values, storage = _values(site, site.input(0), bits, "data")
        if storage in ("int4", "uint4") and bits != 4:
            raise NoMatch(f"malformed node: {storage} data with bits={bits}")
        rank = values.ndim
        gather_axis, quantize_axis = _attr(site, "gather_axis", 0), _attr(site, "quantize_axis", 1)
        if rank < 2 or gather_axis % rank != 0 or quantize_axis % rank != rank - 1:
            raise NoMatch(
                f"gather_axis={gather_axis}, quantize_axis={quantize_axis} on rank {rank}: lowered for gathering "
                "along axis 0 with blocks along the last axis"
            )
        scale_type = site.elem_type(site.input(2))
        if scale_type is not None and scale_type != _T.FLOAT:
            raise NoMatch(f"scales {site.input(2)!r} are {dtype_name(scale_type)}; only float32 is lowered")
        n_blocks = -(-values.shape[-1] // block)
        default = {"uint8-4": 8, "uint8-8": 128}.get(storage, 0)
        zp = None
        if site.input(3):
            zp, zp_storage = _values(site, site.input(3), bits, "zero points")
            zp = zp[..., :n_blocks]
            if zp_storage != storage or zp.shape != (*values.shape[:-1], n_blocks):
                raise NoMatch(f"malformed node: zero points {site.input(3)!r} do not match data and block size")
        signed = storage == "int4" or (zp is None and default != 0)
        if zp is None:
            values = values - default
        dtype = np.int8 if signed else np.uint8
        zp_note = "given" if zp is not None else f"none (kernel default {default})"
        return Plan(
            min_opset=kernel_opsets.qdq_opset(False, "uint8", blocked=True) or kernel_opsets.BLOCKED,
            notes=(f"{storage} table {list(values.shape)}, block_size={block}, zero points: {zp_note}",),
            data={"values": values.astype(dtype), "zp": None if zp is None else zp.astype(dtype), "block": block},
        )

    def build(self, site: Site, emit: Emitter, options: Mapping[str, Any], plan: Plan) -> None:
        indices = site.input(1)
        rows = emit.op1("Gather", [emit.const(plan.data["values"]), indices], axis=0, hint="GatherValues")
        inputs = [rows, emit.op1("Gather", [site.input(2), indices], axis=0, hint="GatherScales")]
        if plan.data["zp"] is not None:
            inputs.append(emit.op1("Gather", [emit.const(plan.data["zp"]), indices], axis=0, hint="GatherZeroPoints"))
        emit.op1("DequantizeLinear", inputs, site.node.output[0], axis=-1, block_size=plan.data["block"])


register(GatherBlockQuantizedBuilder())
