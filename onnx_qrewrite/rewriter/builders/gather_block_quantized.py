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
per table. A rank-2 table with one block per row gathered by a scalar index is dequantized per
tensor (onnxruntime takes the lookup's 1-element scale as per-tensor and refuses a block_size).

onnxruntime's Gather takes no 4-bit tensors, so the table is stored with one byte per value (int8
holding ``q - zp_default`` when there is no zero point): twice the packed size, still quantized.
Form ``packed_table`` (below opset 21 with ``--keep-opset``, float16 scales, bits 2, and int4/uint4
tables on other axes): the table stays packed (``bits`` per value, rows byte-aligned, int4 offset by
8) with one byte of zero point per block; each lookup gathers its rows and unpacks them in int32
(Div, Mul, Sub: onnxruntime's Sub takes no uint8 and BitwiseAnd is opset 18), then
``T2(float32(q - zp) * float32(scale))`` with Cast, Sub, Mul, any opset from 11. A table gathered
along another axis than 0 or blocked along another than the last is stored with its axes permuted
(gathered first, blocked last) and each lookup transposed back (the indices' rank recorded). Form
``dequantized_table`` (where the indices' rank is not recorded, or asked by skipping the packed
rule): the constant table is
dequantized at rewrite time exactly as the kernel computes each element and gathered,
``Gather(T2(float32(q - zp) * scale), indices, axis=gather_axis)``: one float per value (8x a 4-bit
table's packed size in float32), any opset from 11.

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
from onnx_qrewrite.rewriter.builders.contracts import CONTRACTS, GBQ_PACKED, GBQ_TABLE
from onnx_qrewrite.rewriter.builders.matmul_nbits import pack, unpack
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


def _unpacked_uint8(site: Site, name: str, bits: int, count: int, what: str) -> np.ndarray:
    """A constant uint8 tensor's ``bits``-bit values (low bits first) along its last axis, ``count``
    per row, as int32; the kernel reads bits 2/4/8 this way (data and zero points alike)."""
    array = site.constant(name)
    if array is None:
        raise NoMatch(f"{what} {name!r} is computed at run time; only constant tables are lowered")
    if np.dtype(array.dtype).name != "uint8" or array.ndim < 1:
        raise NoMatch(f"malformed node: {what} {name!r} is not a uint8 tensor like data")
    rows = array.reshape(-1, array.shape[-1])
    try:
        values = unpack(rows, bits, rows.shape[0], count)
    except ValueError as why:
        raise NoMatch(f"malformed node: {what} {name!r}: {why}") from None
    return values.reshape(*array.shape[:-1], count).astype(np.int32)


def _table_values(site: Site, bits: int) -> tuple[np.ndarray, str]:
    """The table's quantized values as int32, one per element, and its storage name."""
    array = site.constant(site.input(0))
    if array is None:
        raise NoMatch(f"data {site.input(0)!r} is computed at run time; only constant tables are lowered")
    kind = np.dtype(array.dtype).name
    if kind == "uint8" and bits in (2, 4, 8) and array.ndim >= 1:
        count = array.shape[-1] * (8 // bits)
        return _unpacked_uint8(site, site.input(0), bits, count, "data"), f"uint8-{bits}"
    if kind in ("int4", "uint4") and bits == 4:
        return array.astype(np.int32), kind
    raise NoMatch(f"data {site.input(0)!r} is {kind} with bits={bits}; uint8 (bits 2/4/8), int4, uint4 are lowered")


def _table_axes(site: Site, storage: str, rank: int) -> tuple[int, int]:
    """gather_axis and quantize_axis, normalised, where the kernel accepts them."""
    gather_axis, quantize_axis = _attr(site, "gather_axis", 0), _attr(site, "quantize_axis", 1)
    if rank < 1 or not (-rank <= gather_axis < rank and -rank <= quantize_axis < rank):
        raise NoMatch(f"malformed node: gather_axis={gather_axis}, quantize_axis={quantize_axis} on rank {rank}")
    gather_axis, quantize_axis = gather_axis % rank, quantize_axis % rank
    uint8_axes = gather_axis == 0 and quantize_axis == rank - 1
    if gather_axis == quantize_axis or (storage.startswith("uint8") and not uint8_axes):
        raise NoMatch(
            f"malformed node: gather_axis={gather_axis}, quantize_axis={quantize_axis} on rank {rank} "
            "(onnxruntime's kernel takes distinct axes, and uint8 data gathers along 0, blocks along the last)"
        )
    return gather_axis, quantize_axis


def _table_zero_points(site: Site, storage: str, bits: int, shape: tuple[int, ...]) -> np.ndarray | int:
    """The zero points as int32 of the scales' ``shape``, or the kernel's default when absent."""
    if not site.input(3):
        return 1 << (bits - 1) if storage.startswith("uint8") else 0
    if storage.startswith("uint8"):
        zp = _unpacked_uint8(site, site.input(3), bits, shape[-1], "zero points")
    else:
        found = site.constant(site.input(3))
        if found is None:
            raise NoMatch(f"zero points {site.input(3)!r} are computed at run time; only constants are lowered")
        if np.dtype(found.dtype).name != storage:
            raise NoMatch(f"malformed node: zero points {site.input(3)!r} are not {storage} like data")
        zp = found.astype(np.int32)
    if zp.shape != shape:
        raise NoMatch(f"malformed node: zero points {site.input(3)!r} have shape {list(zp.shape)}, not {list(shape)}")
    return zp


def _read_table(site: Site) -> tuple[np.ndarray, str, int, int, int, int, np.ndarray, np.ndarray | int]:
    """The constant table as the kernel reads it: (values as int32, storage, bits, block,
    gather_axis, quantize_axis, scales, zero points as int32 of the scales' shape or the default)."""
    bits, block = _attr(site, "bits", 4), _attr(site, "block_size", 128)
    if block < 16 or block & (block - 1):
        raise NoMatch(f"malformed node: block_size={block} (the kernel takes powers of two >= 16)")
    values, storage = _table_values(site, bits)
    gather_axis, quantize_axis = _table_axes(site, storage, values.ndim)
    scales = site.constant(site.input(2))
    if scales is None:
        raise NoMatch(f"scales {site.input(2)!r} are computed at run time; only constant scales are lowered")
    if scales.dtype not in (np.float32, np.float16):
        raise NoMatch(f"scales {site.input(2)!r} are {scales.dtype}; the kernel takes float32 and float16")
    shape = list(values.shape)
    shape[quantize_axis] = -(-shape[quantize_axis] // block)
    if list(scales.shape) != shape:
        raise NoMatch(f"malformed node: scales {site.input(2)!r} have shape {list(scales.shape)}, not {shape}")
    zp = _table_zero_points(site, storage, bits, tuple(shape))
    return values, storage, bits, block, gather_axis, quantize_axis, scales, zp


def _check_table(site: Site) -> Plan:
    """The whole table dequantized at rewrite time as the kernel computes each element:
    ``T2(float32(q - zp) * float32(scale))``, numpy's float32 product and float16 cast being the
    same correctly rounded operations (with float16 scales the float32 product is exact: at most
    9 by 11 significant bits; the one rounding is to float16)."""
    values, storage, _, block, gather_axis, quantize_axis, scales, zp = _read_table(site)
    # Each value's block, by index: block_size comes from the model, so nothing is sized by it.
    of_block = np.arange(values.shape[quantize_axis]) // block
    if not isinstance(zp, int):
        zp = zp.take(of_block, axis=quantize_axis)
    wide = scales.astype(np.float32).take(of_block, axis=quantize_axis)
    with np.errstate(over="ignore", invalid="ignore"):  # 0 * inf is NaN in the kernel too
        table = ((values - zp).astype(np.float32) * wide).astype(scales.dtype)
    zp_note = "given" if site.input(3) else f"none (kernel default {zp})"
    return Plan(
        min_opset=kernel_opsets.GATHER_NEGATIVE_INDICES,
        notes=(
            f"{storage} table {list(values.shape)}, block_size={block}, zero points: {zp_note}; "
            f"dequantized {scales.dtype} table of {table.nbytes} bytes",
        ),
        data={"table": table, "axis": gather_axis},
    )


def _check_packed(site: Site) -> Plan:
    """The table kept packed (uint8, ``bits`` per value, each row starting on a byte), the zero
    points one byte per block; each lookup unpacks its rows with Div, Mul and Sub and computes
    ``T2(float32(q - zp) * float32(scale))`` as the kernel does. int4 values are stored offset by 8
    (0..15) and their zero points with them, so ``q - zp`` is unchanged. An int4/uint4 table gathered
    along another axis, or blocked along another than the last, is stored with its axes permuted
    (the gathered axis first, the blocked one last; scales and zero points alike) and the lookup
    transposed back: the indices' rank must then be recorded (the transpose depends on it)."""
    values, storage, bits, block, gather_axis, quantize_axis, scales, zp = _read_table(site)
    rank = values.ndim
    if rank < 2:
        raise NoMatch(f"a rank-{rank} table: the packed form reads rows")
    perm = [gather_axis, *(a for a in range(rank) if a not in (gather_axis, quantize_axis)), quantize_axis]
    back = None
    if perm != list(range(rank)):
        back = _transpose_back(site, perm)
        values, scales = values.transpose(perm), scales.transpose(perm)
        zp = zp if isinstance(zp, int) else zp.transpose(perm)
    bits = 4 if storage in ("int4", "uint4") else bits
    offset = -8 if storage == "int4" else 0  # stored value = value - offset
    rows = (values - offset).astype(np.uint8).reshape(-1, values.shape[-1])
    packed = pack(rows, bits).reshape(*values.shape[:-1], -1)
    count = values.shape[-1]
    zp_stored = zp - offset if isinstance(zp, int) else (zp - offset).astype(np.uint8)
    zp_note = "given" if site.input(3) else f"none (kernel default {zp})"
    stored = "" if back is None else f", stored with axes {perm} (gathered first, blocked last)"
    return Plan(
        min_opset=kernel_opsets.FORMS["gather-block-unpack"],
        notes=(
            f"{storage} table {list(values.shape)}, block_size={block}, zero points: {zp_note}; "
            f"kept packed: {packed.nbytes} bytes, unpacked per lookup{stored}",
        ),
        data={
            "packed": packed,
            "bits": bits,
            "count": count,
            "block": block,
            "zp": zp_stored,
            "dtype": scales.dtype,
            "scales": None if back is None else np.ascontiguousarray(scales),
            "back": back,
        },
    )


def _one_block_lookup(site: Site, n_blocks: int, rank: int) -> bool:
    """Whether each lookup is one row of one block with a 1-element 1-D scale: a rank-2 table with
    one block per row gathered by a scalar index. onnxruntime takes such a scale as per-tensor and
    refuses a block_size with it ("block_size must be 0 for per-tensor quantization"), so that
    lookup is dequantized per tensor, the same arithmetic. Where the indices' rank is not recorded
    it cannot be told, and the packed form (no DequantizeLinear) is left to apply."""
    if n_blocks != 1 or rank != 2:
        return False
    shape = site.value_shape(site.input(1))
    if shape is None:
        raise NoMatch(
            f"one block per row and indices {site.input(1)!r} of unrecorded rank: a scalar index's lookup has a "
            "1-element scale, which onnxruntime's blocked DequantizeLinear refuses as per-tensor"
        )
    return len(shape) == 0


def _transpose_back(site: Site, perm: list[int]) -> list[int]:
    """The Transpose that puts a lookup of the permuted table (the indices' axes, then the table's
    axes in ``perm[1:]`` order) in the kernel's order (the table's axes before the gathered one, the
    indices' axes, the table's axes after it)."""
    shape = site.value_shape(site.input(1))
    if shape is None:
        raise NoMatch(
            f"the rank of indices {site.input(1)!r} is not recorded: the packed form of a table gathered along "
            f"axis {perm[0]} or blocked along another than the last transposes by it"
        )
    r = len(shape)
    where = {axis: r + i for i, axis in enumerate(perm[1:])}  # table axis -> its place in the lookup
    gather = perm[0]
    return [where[a] for a in range(gather)] + list(range(r)) + [where[a] for a in range(gather + 1, len(perm))]


def _build_packed(site: Site, emit: Emitter, data: Mapping[str, Any]) -> None:
    """Gather the packed rows, their scales and zero points; unpack the rows' fields in int32 (field
    j of a byte: ``b // 2^(bits j) - (b // 2^(bits (j+1))) * 2^bits``), concatenated field after field, and
    put each value in its place, and each block's scale and zero point beside its values, with
    constant index Gathers along the last axis; then the kernel's arithmetic."""
    indices, bits, count, block = site.input(1), data["bits"], data["count"], data["block"]
    packed = data["packed"]
    width, per_byte = packed.shape[-1], 8 // bits
    rows = emit.op1("Gather", [emit.const(packed), indices], axis=0, hint="GatherPacked")
    fields = [rows]
    if per_byte > 1:
        # int32: onnxruntime's Sub takes no uint8, and BitwiseAnd is opset 18; Div of non-negative
        # int32 truncates, i.e. shifts right.
        wide = emit.op1("Cast", [rows], to=_T.INT32)
        shifted = [wide] + [
            emit.op1("Div", [wide, emit.const(np.array(1 << (bits * j), np.int32))], hint="Shift")
            for j in range(1, per_byte)
        ]
        radix = emit.const(np.array(1 << bits, np.int32))
        fields = [
            emit.op1("Sub", [shifted[j], emit.op1("Mul", [shifted[j + 1], radix])], hint="Field")
            for j in range(per_byte - 1)
        ] + [shifted[-1]]
        fields = [emit.op1("Concat", fields, axis=-1, hint="Fields")]
    k = np.arange(count, dtype=np.int64)
    place = emit.const((k % per_byte) * width + k // per_byte)
    q = emit.op1("Cast", [emit.op1("Gather", [fields[0], place], axis=-1, hint="Values")], to=_T.FLOAT)
    of_block = emit.const(k // block)
    if isinstance(data["zp"], int):
        zp = emit.const(np.array(data["zp"], np.float32))
    else:
        zp_rows = emit.op1("Gather", [emit.const(data["zp"]), indices], axis=0, hint="GatherZeroPoints")
        zp = emit.op1("Cast", [emit.op1("Gather", [zp_rows, of_block], axis=-1, hint="ZeroPoints")], to=_T.FLOAT)
    scales = site.input(2) if data["scales"] is None else emit.const(data["scales"])
    scale = emit.op1("Gather", [emit.op1("Gather", [scales, indices], axis=0, hint="GatherScales"), of_block], axis=-1)
    if data["dtype"] == np.float16:
        scale = emit.op1("Cast", [scale], to=_T.FLOAT)
    out = site.node.output[0]
    last = data["dtype"] != np.float16 and data["back"] is None
    product = emit.op1("Mul", [emit.op1("Sub", [q, zp]), scale], out if last else None)
    if data["dtype"] == np.float16:
        product = emit.op1("Cast", [product], None if data["back"] else out, to=_T.FLOAT16)
    if data["back"] is not None:  # the permuted table's lookup, in the kernel's axis order
        emit.op1("Transpose", [product], out, perm=data["back"])


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
        site.no_unknown_attributes({"gather_axis", "quantize_axis", "block_size", "bits"})
        if options["form"] == GBQ_TABLE:
            return _check_table(site)
        if options["form"] == GBQ_PACKED:
            return _check_packed(site)
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
        scale_type = site.value_type(site.input(2))
        if scale_type is None:
            raise NoMatch(f"the type of scales {site.input(2)!r} is not declared; only float32 is lowered")
        if scale_type != _T.FLOAT:
            raise NoMatch(f"scales {site.input(2)!r} are {dtype_name(scale_type)}; only float32 is lowered")
        n_blocks = -(-values.shape[-1] // block)
        default = {"uint8-4": 8, "uint8-8": 128}.get(storage, 0)
        zp = None
        if site.input(3):
            zp, zp_storage = _values(site, site.input(3), bits, "zero points")
            zp = zp[..., :n_blocks]
            if zp_storage != storage or zp.shape != (*values.shape[:-1], n_blocks):
                raise NoMatch(f"malformed node: zero points {site.input(3)!r} do not match data and block size")
        one_block = _one_block_lookup(site, n_blocks, rank)
        signed = storage == "int4" or (zp is None and default != 0)
        if zp is None:
            values = values - default
        dtype = np.int8 if signed else np.uint8
        zp_note = "given" if zp is not None else f"none (kernel default {default})"
        return Plan(
            min_opset=kernel_opsets.qdq_opset(False, "uint8", blocked=True) or kernel_opsets.BLOCKED,
            notes=(f"{storage} table {list(values.shape)}, block_size={block}, zero points: {zp_note}",),
            data={
                "values": values.astype(dtype),
                "zp": None if zp is None else zp.astype(dtype),
                "block": 0 if one_block else block,
            },
        )

    def build(self, site: Site, emit: Emitter, options: Mapping[str, Any], plan: Plan) -> None:
        indices = site.input(1)
        if options["form"] == GBQ_PACKED:
            _build_packed(site, emit, plan.data)
            return
        if options["form"] == GBQ_TABLE:
            table = emit.const(plan.data["table"])
            emit.op1("Gather", [table, indices], site.node.output[0], axis=plan.data["axis"])
            return
        rows = emit.op1("Gather", [emit.const(plan.data["values"]), indices], axis=0, hint="GatherValues")
        inputs = [rows, emit.op1("Gather", [site.input(2), indices], axis=0, hint="GatherScales")]
        if plan.data["zp"] is not None:
            inputs.append(emit.op1("Gather", [emit.const(plan.data["zp"]), indices], axis=0, hint="GatherZeroPoints"))
        if plan.data["block"]:
            emit.op1("DequantizeLinear", inputs, site.node.output[0], axis=-1, block_size=plan.data["block"])
        else:  # one lookup of one block: its one scale applies to the whole row (_one_block_lookup)
            emit.op1("DequantizeLinear", inputs, site.node.output[0])


register(GatherBlockQuantizedBuilder())
