"""Integer matmul and convolution -> float (or int32) MatMul/Conv on zero-point-shifted values.

Matched ops (onnxruntime's CPU kernels measured, see the rule file ``rules/50-integer-matmul.toml``)::

    MatMulInteger(A, B, a_zp, b_zp)                     -> int32 A'B'
    ConvInteger(x, w, x_zp, w_zp)                        -> int32 conv(x', w')
    com.microsoft MatMulIntegerToFloat(A, B, a_s, b_s, a_zp, b_zp, bias)
                                                         -> float(A'B') * (a_s * b_s) [+ bias]
    com.microsoft DynamicQuantizeMatMul(A, B, b_s, b_zp, bias)
                                                         -> DynamicQuantizeLinear(A), then as above

where X' = X - zero point. The last two equal, bit for bit in onnxruntime, MatMulInteger -> Cast ->
Mul by ``a_s * b_s`` -> Add bias (measured on every dtype pair, per-tensor and per-column scales).

Forms (option ``accumulate``):

``float-exact`` (exact)   ``Cast<f32>`` and ``Sub`` the zero points, float ``MatMul``/``Conv``,
                          ``Cast<i32>`` (or the scale ``Mul``). Every product of 8-bit values is
                          exact in float32 (|p| <= 65025); every partial sum, in any order, is an
                          integer of magnitude at most S = sum |products|, exact while S <= 2^24.
                          S is bounded at match time from the dtype ranges and the zero points,
                          and from the weights' values when they are constant (per output column
                          or channel); the rule declines when the bound cannot be shown.
                          Conv pads with 0.0 after the shift, which is padding with the zero
                          point: what the kernel does.
``int32`` (exact)         ``Cast<i32>``, ``Sub``, int32 ``MatMul``: exact always (MatMul only; not
                          every target runs int32 MatMul).
``float`` (bounded)       the float form without the 2^24 proof. Recursive summation in float32,
                          in any order, errs by at most gamma(K-1) * S with gamma(n) = n*u/(1-n*u),
                          u = 2^-24 (Higham, Accuracy and Stability, 4.2); every partial sum stays
                          an integer, so the Cast is exact. ``Plan.bound`` is that number, in the
                          int32 output's units, and ``verify`` checks it at the node.

onnxruntime's uint8 x int8 kernels (MatMulInteger with uint8 A and int8 B, ConvInteger with int8 x
and uint8 w; fused MatMulIntegerToFloat and DynamicQuantizeMatMul) add each adjacent pair of
products with int16 saturation on x86 CPUs without AVX-VNNI (:mod:`onnx_qrewrite.rewriter.u8s8`,
measured). Option ``u8s8_saturation``: ``decline`` (the exact rules) gives way wherever a pair can
saturate (from the constant weights; or cannot be ruled out), ``bound`` (the bounded rules) rewrites
there to the ONNX definition and adds the largest pair excess the weights allow to the bound
(``Plan.bound``), which ``verify`` checks per output column (``Plan.bound_formula`` =
``u8s8-pairs``): columns none of whose pairs can saturate bit-exact, the others within their own
excess.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from onnx_qrewrite import _onnx as onnx
from onnx_qrewrite._dataclass import dataclass
from onnx_qrewrite.rewriter import kernel_opsets, u8s8
from onnx_qrewrite.rewriter.builders import Emitter, NoMatch, Plan, Site, register
from onnx_qrewrite.rewriter.builders._qdq import INTEGER_RANGES
from onnx_qrewrite.rewriter.builders.contracts import CONTRACTS
from onnx_qrewrite.rewriter.builders.dynamic_quantize import (
    GUARD_NOTES,
    NO_GUARD,
    DynamicQuantizeLinearBuilder,
    nan_guard,
)
from onnx_qrewrite.rewriter.graph import ConstantSlabs, dtype_name

__all__ = ["IntegerMatMulBuilder", "float32_sum_bound"]

_T = onnx.TensorProto
_U = 2.0**-24
#: Largest magnitude up to which every integer is a float32.
_EXACT_FLOAT_INTEGERS = 2**24
_TYPES = ("uint8", "int8")
#: An operand whose type the model does not record (no value_info); the op's schema says 8-bit.
_UNKNOWN = "8-bit"


def float32_sum_bound(k: int, total: float) -> float:
    """Largest error of a float32 sum of ``k`` exact terms whose magnitudes add up to ``total``,
    in any summation order: gamma(k-1) * total (0 when every partial sum is an exact integer)."""
    if total <= _EXACT_FLOAT_INTEGERS or k <= 1:
        return 0.0
    n = (k - 1) * _U
    return math.ldexp(math.ceil(math.ldexp(n / (1 - n) * total, 8)), -8)  # rounded up, 1/256 steps


#: ``_Operand.zp_at`` of DynamicQuantizeMatMul's A: its zero point is computed by the rewrite.
_COMPUTED = -1


@dataclass(frozen=True)
class _Operand:
    """One integer operand of the product: where its value and zero point are among the node's
    inputs, and what is known about them. Positions, not names: a plan holds no name of its node,
    so nodes of one structure share one plan (``memo_check``, ``_facts.py``)."""

    at: int  # the value's position among the node's inputs
    zp_at: int | None  # its zero point's (None: absent; _COMPUTED: made by the rewrite)
    dtype: str
    zp_value: np.ndarray | None
    zp_size: int | None
    zp_scalar: bool = False  # a rank-0 zero point (used as it is)

    @property
    def template_key(self) -> tuple:
        """What of this operand decides the nodes a build emits (see the builder's
        ``template_key``); kept, since B's operand is shared by every node reading the weight
        (in the instance's dict, not a ``cached_property``: Python 3.11's takes a lock per read,
        and A's operand is new for every node)."""
        key = self.__dict__.get("_template_key")
        if key is None:
            zp = self.zp_value
            constant = None if zp is None else (zp.dtype.str, zp.shape, zp.tobytes())
            key = (self.dtype, self.has_zp, constant, self.zp_size, self.zp_scalar)
            object.__setattr__(self, "_template_key", key)  # frozen: a cache, not a field
        return key

    @property
    def has_zp(self) -> bool:
        return self.zp_at is not None

    def names(self, inputs: tuple[str, ...]) -> tuple[str, str]:
        """(value, zero point) among ``inputs``, the node's (the zero point '' when absent or computed)."""
        zp_at = self.zp_at
        return inputs[self.at], inputs[zp_at] if zp_at is not None and zp_at >= 0 else ""

    def largest_shift(self) -> int:
        """max |x - zp| over every x of the type (and every zero point when it is not constant)."""
        if self.dtype == _UNKNOWN:
            return 255  # uint8 or int8, with a zero point of the same type
        lo, hi = INTEGER_RANGES[self.dtype]
        if not self.has_zp:
            return max(-lo, hi)
        if self.zp_value is None:
            return hi - lo
        zps = self.zp_value.astype(np.int64).ravel()
        return int(max(np.max(np.abs(lo - zps)), np.max(np.abs(hi - zps))))


@dataclass(frozen=True)
class _Read:
    """An integer matmul or convolution node as the builder reads it: its two operands, the terms
    summed per output element and the operands' ranks."""

    conv: bool
    a: _Operand
    b: _Operand
    k: int | None  # terms per output element
    b_rank: int | None
    a_rank: int | None = None
    #: Positions of A's and B's scales and of the bias among the node's inputs (-1: none).
    a_scale: int = -1
    b_scale: int = -1
    bias: int = -1
    dynamic: bool = False  # DynamicQuantizeMatMul: A is float, quantized first
    to_float: bool = False
    #: max over output columns/channels of sum_k |b - b_zp| (None: unknown), from constant weights.
    columns: float | None = None
    #: The most onnxruntime's u8 x s8 kernel (int16 pairs, x86 without VNNI) can differ from the ONNX
    #: definition at any output element, in int32 units: 0 where no pair can saturate, None where
    #: it cannot be told (weights computed at run time: the dtype ranges give ``worst_excess``).
    excess: int | None = 0
    worst_excess: int = 0


def _recorded_or_implied_type(site: Site, name: str, zero_point: str) -> str | None:
    """The recorded type of ``name``, else its zero point's (they are one type), else what its
    producer implies: DynamicQuantizeLinear makes uint8, QuantizeLinear its zero point's type."""
    for value in (name, zero_point):
        elem = site.elem_type(value) if value else None
        if elem:
            return dtype_name(elem)
    producer = site.producer_op(name)
    if producer is not None and producer[0] in ("", "ai.onnx"):
        if producer[1] == "DynamicQuantizeLinear":
            return "uint8"
        if producer[1] == "QuantizeLinear":
            zp = site.producer_input(name, 2)
            elem = site.elem_type(zp) if zp else None
            return dtype_name(elem) if elem else ("uint8" if not zp else None)
    return None


def _zero_points(b: _Operand) -> np.ndarray:
    """B's zero point(s) as a flat int16 array (0 when there is none)."""
    return np.zeros(1, np.int16) if b.zp_value is None else b.zp_value.astype(np.int16).reshape(-1)


def _absolute_shift(part: np.ndarray, zp: np.ndarray) -> np.ndarray:
    """|part - zp| for 8-bit ``part`` (``zp``: int16, broadcastable to it), as uint8 (at most
    255): max - min in uint8, which never wraps; int8 is first moved to uint8 by flipping its
    sign bit (+128 on both sides keeps the order and the differences). Byte-wide passes instead of
    a widening to int16, a subtraction and an absolute value; ``zp`` should be a whole row, not
    a scalar, for numpy's vectorised loop (4x faster here)."""
    if part.dtype == np.int8:
        part = part.view(np.uint8) ^ np.uint8(0x80)
        centre = (zp + 128).astype(np.uint8)
    else:
        centre = zp.astype(np.uint8)
    high = np.maximum(part, centre)
    high -= np.minimum(part, centre)
    return high


_BYTES = (np.dtype(np.uint8), np.dtype(np.int8))


class _WeightStatistics:
    """What the rewrite needs from constant weights, gathered from consecutive slabs along their
    first axis (:meth:`Site.constant_slabs`) so that weights of any size stream through in
    bounded memory and are read once:

    * ``columns``: max over output columns/channels of sum_k |b - b_zp| (None: the zero point
      is not constant);
    * ``saturates``: whether onnxruntime's uint8 x int8 kernel (int16 pairs, x86 without VNNI)
      can saturate: some adjacent pair of weights along K, times the other operand's extremes,
      leaves int16 (None: cannot tell; only looked at for that pair of types).

    MatMul's B [..., K, N]: a 2-D (or 1-D) B's slabs cut K, so the column sums add up across
    slabs and the last row of each slab pairs with the first of the next; a batched B's slabs and
    Conv's w [M, C, kh, kw] (rows: output channels) hold whole rows.
    """

    def __init__(self, shape: tuple[int, ...], read: _Read):
        self._conv = read.conv
        self._k_major = not read.conv and len(shape) <= 2  # slabs cut K
        b = read.b
        self._zp: np.ndarray | None = None if (b.has_zp and b.zp_value is None) else _zero_points(b)
        self.columns: float | None = None if self._zp is None else 0.0
        self._sums: np.ndarray | None = None  # per column (k-major B)
        self._row = 0  # rows of the [column, K] view seen so far
        u8, s8 = (read.a.dtype, read.b.dtype) if not read.conv else (read.b.dtype, read.a.dtype)
        self._pairs = not (u8 == "int8" or s8 == "uint8")  # the kernel pairs (uint8, int8) only
        self.saturates: bool | None = None if self._pairs and _UNKNOWN in (u8, s8) else False
        self._a_range = INTEGER_RANGES[read.a.dtype] if self.saturates is False and self._pairs else None
        self._carry: np.ndarray | None = None  # the previous slab's last row (k-major B)

    @property
    def needs_values(self) -> bool:
        return self.columns is not None or self._a_range is not None

    def add(self, slab: np.ndarray) -> None:
        if self._k_major:
            slab = slab.reshape(slab.shape[0], -1) if slab.ndim == 2 else slab.reshape(-1, 1)
            self._add_k_major(slab)
        else:
            rows = u8s8.rows(slab, self._conv)
            self._add_rows(rows)

    def _add_k_major(self, slab: np.ndarray) -> None:
        """``slab``: [k rows, N columns], K along axis 0."""
        zp = self._zp
        if zp is not None:
            n = slab.shape[1]
            if slab.dtype in _BYTES and zp.size in (1, n):
                centre = np.full(n, zp[0], np.int16) if zp.size == 1 else zp
                wide = np.uint32 if slab.shape[0] < 1 << 24 else np.int64  # 255 * rows fits
                part = _absolute_shift(slab, centre[None, :]).sum(axis=0, dtype=wide).astype(np.int64)
            else:
                shifted = slab.astype(np.int16) - (zp if zp.size == 1 else zp[None, :])
                part = np.abs(shifted).sum(axis=0, dtype=np.int64)
            self._sums = part if self._sums is None else self._sums + part
            self.columns = float(self._sums.max(initial=0))
        if self._a_range is not None and not self.saturates:
            block = slab if self._carry is None else np.concatenate([self._carry, slab])
            self._carry = slab[-1:]
            if block.shape[0] >= 2:
                self.saturates = _pair_leaves_int16(block.astype(np.int32), 0, self._a_range)

    def _add_rows(self, rows: np.ndarray) -> None:
        """``rows``: [output column or channel, K], whole rows."""
        zp = self._zp
        if zp is not None and rows.shape[0]:
            if zp.size > 1:  # per column (MatMul: repeated over batch matrices) or per channel
                centre = zp[(np.arange(self._row, self._row + rows.shape[0]) % zp.size)][:, None]
            else:
                centre = np.full((1, rows.shape[1]), zp[0], np.int16)
            if rows.dtype in _BYTES:
                sums = _absolute_shift(rows, centre).sum(axis=1, dtype=np.int64)
            else:
                sums = np.abs(rows.astype(np.int16) - centre).sum(axis=1, dtype=np.int64)
            self.columns = max(self.columns or 0.0, float(sums.max(initial=0)))
        self._row += rows.shape[0]
        if self._a_range is not None and not self.saturates and rows.shape[1] >= 2:
            self.saturates = _pair_leaves_int16(rows.astype(np.int32), 1, self._a_range)


def _pair_leaves_int16(w: np.ndarray, axis: int, a_range: tuple[int, int]) -> bool:
    """Whether some adjacent pair of ``w`` along ``axis``, times the other operand's extremes,
    leaves int16."""
    lo, hi = a_range
    most, least = np.maximum(w * lo, w * hi), np.minimum(w * lo, w * hi)
    first = (slice(None),) * axis + (slice(None, -1),)
    second = (slice(None),) * axis + (slice(1, None),)
    return bool(
        (most[first] + most[second]).max() > u8s8.INT16[1] or (least[first] + least[second]).min() < u8s8.INT16[0]
    )


def _weight_statistics(slabs: ConstantSlabs, read: _Read) -> tuple[float | None, bool | None]:
    """(column sums, saturates) of constant weights (:class:`_WeightStatistics`), in one pass;
    the weights are not read at all when neither can be known from them."""
    stats = _WeightStatistics(slabs.shape, read)
    if stats.needs_values:
        for slab in slabs.slabs:
            stats.add(slab)
    return stats.columns, stats.saturates


def _saturation_excess(weights: np.ndarray | None, read: _Read, k: int | None) -> tuple[int | None, int]:
    """(largest pair excess over the output columns/channels from the constant weights, or None
    when they are not constant; the same for any weights of the type, from K) for onnxruntime's
    uint8 x int8 kernel, both 0 where the operand types never pair into int16."""
    a, b = read.a.dtype, read.b.dtype
    unknown = _UNKNOWN in (a, b)
    if not unknown and not u8s8.saturating_operands(a, b, conv=read.conv):
        return 0, 0
    if unknown and not any(
        u8s8.saturating_operands(x, y, conv=read.conv)
        for x in ((a,) if a != _UNKNOWN else _TYPES)
        for y in ((b,) if b != _UNKNOWN else _TYPES)
    ):
        return 0, 0
    # The weights' type: int8 for MatMul, uint8 for Conv (the saturating combinations).
    w_type = "uint8" if read.conv else "int8"
    lo, hi = INTEGER_RANGES[w_type]
    pair = int(u8s8.pair_excess(np.array([[lo, lo], [hi, hi]]), w_type).max())
    worst = pair * (k // 2) if k is not None else 0
    if weights is None or (b == _UNKNOWN and weights.dtype != np.dtype(w_type)):
        return None, worst
    if weights.dtype != np.dtype(w_type):
        return 0, 0
    return int(u8s8.pair_excess(u8s8.rows(weights, read.conv), w_type).max(initial=0)), worst


#: The per-element bound formula verify evaluates for these rewrites (verify/element_bounds.py).
_FORMULA = "u8s8-pairs"


def _reduction_length(shape: tuple[int | None, ...] | None, conv: bool) -> int | None:
    """K: the terms per output element, from the weights' shape (None: unknown)."""
    if shape is None:
        return None
    dims = shape[1:] if conv else shape[-2:-1]
    if dims and None not in dims:
        return math.prod(dims)  # type: ignore[arg-type]
    return None


def _padded(site: Site) -> tuple[str, ...]:
    """The node's inputs, absent optional ones '' up to the 7 the fused forms take."""
    inputs = site.inputs
    return inputs + ("",) * (7 - len(inputs)) if len(inputs) < 7 else inputs


#: The wiring (see ``template_key``) of n inputs whose names are all present and different.
_IN_ORDER = tuple(tuple(range(n)) for n in range(8))


class IntegerMatMulBuilder:
    """Integer MatMul/Conv (and onnxruntime's fused forms) as float or int32 arithmetic."""

    name = "integer_matmul"
    contract = CONTRACTS["integer_matmul"]
    #: ``check`` reads the graph only through the Site's queries: decided once per structure (_facts.py).
    memo_check = True
    #: ``template_key`` reads only the rule's options, the plan, the scope's default opset and the
    #: node's structure (op, attributes, which names are empty or equal): the build makes it once
    #: per structure and plan (apply.py).
    template_key_of_structure = True

    def quantized_dtype(self, site: Site) -> str | None:
        types = []
        for name in (site.input(0), site.input(1)):
            elem = site.elem_type(name)
            types.append(dtype_name(elem) if elem else "unknown")
        if site.op_type == "DynamicQuantizeMatMul":
            types[0] = "uint8"
        return "/".join(types)

    # -- reading ------------------------------------------------------------------------------

    def _operand(self, site: Site, at: int, zp_at: int, what: str) -> _Operand:
        """The operand at input ``at`` (zero point at ``zp_at``): its type and zero point (the
        weights' values are read once, in ``_read``)."""
        inputs = _padded(site)
        name, zp = inputs[at], inputs[zp_at]
        if not name:
            raise NoMatch(f"malformed node: {site.op_type} has no {what}")
        dtype: str | None
        dtype = _recorded_or_implied_type(site, name, zp)
        if dtype is None:
            # Both operand types are 8-bit (the op's schema): the forms and the bounds hold for
            # either, with |x - zp| <= 255; only the saturation check needs the type.
            dtype = _UNKNOWN
        elif dtype not in _TYPES:
            raise NoMatch(f"{what} {name!r} is {dtype}; only uint8 and int8 are supported")
        if zp:
            zp_elem = site.elem_type(zp)
            if zp_elem is not None and dtype_name(zp_elem) != dtype:
                raise NoMatch(f"malformed node: zero point {zp!r} is {dtype_name(zp_elem)}, {what} is {dtype}")
        zp_value = site.constant(zp) if zp else None
        zp_shape = tuple(zp_value.shape) if zp_value is not None else site.value_shape(zp)
        known = [d for d in zp_shape or () if d is not None]  # every dimension known: the size is too
        zp_size = math.prod(known) if zp_shape is not None and len(known) == len(zp_shape) else None
        scalar = zp_shape == ()
        producer = site.producer_op(zp) if zp and zp_shape is None else None
        if producer in (("", "DynamicQuantizeLinear"), ("ai.onnx", "DynamicQuantizeLinear")):
            zp_size, scalar = 1, True  # its zero point output is a scalar
        return _Operand(at, zp_at if zp else None, dtype, zp_value, zp_size, scalar)

    def _weights(self, site: Site, at: int, zp_at: int, what: str) -> _Operand:
        """:meth:`_operand` of B (w), once per scope: one weight often feeds many nodes, and what
        is known of it (type, zero point's value and shape) depends on the scope only (and on the
        positions the operand records)."""
        inputs = _padded(site)
        key = ("integer-matmul-operand", inputs[at], inputs[zp_at], what, at, zp_at)
        return site.scope_memo(key, lambda: self._operand(site, at, zp_at, what))

    def _read(self, site: Site) -> _Read:
        op = site.op_type
        outputs = site.outputs
        if len(outputs) != 1 or not outputs[0]:
            raise NoMatch(f"malformed node: {op} has one output, it has {len(outputs)}")
        inputs = _padded(site)
        extra: dict[str, Any] = {}
        if op == "MatMulInteger":
            conv = False
            a = self._operand(site, 0, 2, "A")
            b = self._weights(site, 1, 3, "B")
        elif op == "ConvInteger":
            conv = True
            a = self._operand(site, 0, 2, "x")
            b = self._weights(site, 1, 3, "w")
        elif op == "MatMulIntegerToFloat":
            conv = False
            a = self._operand(site, 0, 4, "A")
            b = self._weights(site, 1, 5, "B")
            extra = {"a_scale": 2, "b_scale": 3, "bias": 6 if inputs[6] else -1, "to_float": True}
            if not inputs[2] or not inputs[3]:
                raise NoMatch("malformed node: MatMulIntegerToFloat needs a_scale and b_scale")
        elif op == "DynamicQuantizeMatMul":
            conv = False
            elem = site.elem_type(inputs[0])
            if elem is not None and elem != _T.FLOAT:
                raise NoMatch(f"A {inputs[0]!r} is {dtype_name(elem)}; DynamicQuantizeMatMul takes float32")
            a = _Operand(0, _COMPUTED, "uint8", None, 1, True)
            b = self._weights(site, 1, 3, "B")
            extra = {"b_scale": 2, "bias": 4 if inputs[4] else -1, "dynamic": True, "to_float": True}
            if not inputs[2]:
                raise NoMatch("malformed node: DynamicQuantizeMatMul needs b_scale")
        else:
            raise NoMatch(f"{op} is not an integer matmul or convolution")
        # One weight often feeds many nodes (every block of a chain; a layer's weight under several
        # quantizers): its statistics are worked out once per scope, from everything they depend on
        # (the weights' own facts, and the operands' types, which decide the kernel's pairing).
        b_name, b_zp = b.names(inputs)
        weight_key = ("integer-matmul-weights", b_name, b_zp, conv, a.dtype, b.dtype)
        b_shape, columns, excess, worst_excess = site.scope_memo(
            weight_key, lambda: self._weight_facts(site, _Read(conv, a, b, None, None, **extra), b_name)
        )
        a_shape = None if extra.get("dynamic") else site.value_shape(inputs[0])
        return _Read(
            conv,
            a,
            b,
            _reduction_length(b_shape, conv),
            None if b_shape is None else len(b_shape),
            a_rank=None if a_shape is None else len(a_shape),
            columns=columns,
            excess=excess,
            worst_excess=worst_excess,
            **extra,
        )

    def _weight_facts(
        self, site: Site, read: _Read, b_name: str
    ) -> tuple[tuple[int | None, ...] | None, float | None, int | None, int]:
        """B's (``b_name``'s) shape, column sums and how far onnxruntime's u8 x s8 kernel may
        saturate on it (:func:`_saturation_excess`); the weights' values are read here and only
        these statistics of them are kept."""
        weights = site.constant_slabs(b_name)
        if weights is None:
            shape = site.value_shape(b_name)
            return (shape, None, *_saturation_excess(None, read, _reduction_length(shape, read.conv)))
        shape = tuple(weights.shape)
        columns, saturates = _weight_statistics(weights, read)
        if saturates is False:  # no adjacent pair at all can leave int16 (or the types never pair)
            return shape, columns, 0, 0
        # Some adjacent pair may: the kernel's own pairs (2j, 2j+1), per column, from the values.
        return shape, columns, *_saturation_excess(site.constant(b_name), read, _reduction_length(shape, read.conv))

    # -- deciding -----------------------------------------------------------------------------

    def check(self, site: Site, options: Mapping[str, Any]) -> Plan:
        read = site.memo("integer-matmul", lambda: self._read(site))
        form = options["accumulate"]
        notes = [f"{read.a.dtype} x {read.b.dtype}", *self._zero_point_notes(read, _padded(site))]
        excess = self._saturation(read, options["u8s8_saturation"], notes)
        opset = kernel_opsets.FORMS["dynamic-quantize-linear" if read.dynamic else "integer-matmul"]
        guard = nan_guard(site, site.input(0), options["nan_guard"]) if read.dynamic else NO_GUARD
        if guard in GUARD_NOTES:
            notes.append(f"A quantized with {GUARD_NOTES[guard]}")
        data = {"read": read, "form": form, "nan_guard": guard}
        if form == "int32":
            if read.conv:
                raise NoMatch("ONNX Conv has no int32 form")
            notes.append("int32 MatMul")
            return Plan(min_opset=opset, notes=tuple(notes), data=data)
        return self._float_plan(read, form, excess, notes, opset, data, _padded(site))

    @staticmethod
    def _zero_point_notes(read: _Read, inputs: tuple[str, ...]) -> list[str]:
        """What the zero points' shapes mean here; refuses the ones the rewrite cannot compute
        (``inputs``: the node's, named in the reasons)."""
        notes = []
        if read.a.has_zp and read.a.zp_size not in (None, 1):
            if read.conv:
                raise NoMatch(
                    f"x zero point {read.a.names(inputs)[1]!r} has {read.a.zp_size} elements; only one is supported"
                )
            notes.append("per-row A zero point (onnxruntime's kernel rejects it; computed by the ONNX definition)")
        if read.b.has_zp and read.b.zp_size not in (None, 1):
            notes.append(
                "per-channel w zero point (onnxruntime's kernel rejects it; computed by the ONNX definition)"
                if read.conv
                else "per-column B zero point"
            )
        if read.conv and read.b.has_zp and read.b.zp_size != 1 and read.b_rank is None:
            b_name, b_zp = read.b.names(inputs)
            raise NoMatch(
                f"w zero point {b_zp!r} may be per channel and the rank of w {b_name!r} is not "
                "recorded; run shape inference first"
            )
        return notes

    @staticmethod
    def _float_plan(
        read: _Read, form: str, excess: int, notes: list[str], opset: int, data: dict[str, Any], inputs: tuple[str, ...]
    ) -> Plan:
        """The plan of a float32-accumulating form: exact where the sums provably stay integers
        (|sum| <= 2^24), else bounded by float32's summation error (plus any u8 x s8 excess).
        Made in one call (not a base plan and ``dataclasses.replace``, which inspects the fields
        each time: 4% of a chain's rewrite)."""
        if read.k is None:
            raise NoMatch(
                f"the reduction length K is unknown (the shape of {inputs[read.b.at]!r} is not recorded), so no bound "
                "on the float32 sums can be shown; run shape inference first"
            )
        columns = read.columns
        worst = read.a.largest_shift() * (
            columns if columns is not None else read.k * read.b.largest_shift()
        )  # S: the largest sum of |products| any output element can have
        if not read.to_float and worst > 2**31 - 1:
            raise NoMatch(f"sums may reach {worst:.0f}, beyond int32: the kernel wraps, a float Cast does not")
        if form == "float-exact":
            if worst > _EXACT_FLOAT_INTEGERS:
                raise NoMatch(
                    f"sums of |products| may reach {worst:.0f} > 2^24 (K={read.k}"
                    + (", from the constant weights" if columns is not None else ", from the dtype ranges")
                    + "): float32 accumulation is not provably exact"
                )
            notes.append(f"float32 sums provably exact: |sum| <= {worst:.0f} <= 2^24 (K={read.k})")
            return Plan(opset, tuple(notes), data)
        if read.to_float:
            if worst > _EXACT_FLOAT_INTEGERS:
                raise NoMatch("the bounded form covers float outputs only where the float32 sums are exact")
            if not excess:
                raise NoMatch("no pair of products can saturate here: the exact rules apply")
            # The bound per element is the formula's (the excess times the scale product, which is
            # known at run time only, and the roundings after it): recorded as the excess.
            return Plan(
                opset,
                tuple(notes),
                data,
                bound=float(excess),
                bound_formula=f"{_FORMULA}:0.0",
                bound_u8s8=float(excess),
            )
        bound = float32_sum_bound(read.k, worst)
        notes.append(f"float32 sums within {bound:g} of the exact integers (K={read.k}, |sum| <= {worst:.0f})")
        # verify adds each column's own excess to the float32 part (the formula's parameter).
        formula = f"{_FORMULA}:{bound!r}" if excess else None
        return Plan(
            opset,
            tuple(notes),
            data,
            bound=bound + excess,
            bound_formula=formula,
            bound_u8s8=float(excess),
        )

    @staticmethod
    def _saturation(read: _Read, policy: str, notes: list[str]) -> int:
        """The excess onnxruntime's u8 x s8 kernel may add here (0: none can), under the rule's
        ``u8s8_saturation`` policy: ``decline`` gives way where it is not 0, ``bound`` takes it."""
        excess = read.excess if read.excess is not None else read.worst_excess
        if read.excess == 0:
            return 0
        where = (
            "from the constant weights"
            if read.excess is not None
            else "weights computed at run time, bounded from the types"
            if read.worst_excess
            else "cannot be bounded"
        )
        if policy == "ignore":
            if excess:
                raise NoMatch(f"a bound on the saturation can be computed here ({excess}): the bounded rule applies")
            notes.append(
                "onnxruntime's uint8 x int8 kernel may saturate pairs of products here: no bound (approximate)"
            )
            return 0
        if policy == "decline":
            raise NoMatch(
                "onnxruntime's uint8 x int8 kernel on x86 CPUs without AVX-VNNI saturates pairs of products to int16 "
                f"and can here (up to {excess} per element, {where}): not exact; the bounded rule takes it"
            )
        if not excess:
            raise NoMatch("onnxruntime's uint8 x int8 kernel may saturate here and K is unknown: no bound")
        notes.append(
            f"onnxruntime's uint8 x int8 kernel (x86 without AVX-VNNI) may differ by up to {excess} per element "
            f"({where}): int16 pair saturation; the rewrite computes the ONNX definition"
        )
        return excess

    def template_key(self, site: Site, options: Mapping[str, Any], plan: Plan) -> tuple | None:
        """Equal keys build the same nodes (builders/_stamp.py): everything ``build`` branches on,
        and the constants it emits (scalar zero points). The bound goes into the metadata."""
        read: _Read = plan.data["read"]
        inputs = site.inputs
        if len(inputs) < len(_IN_ORDER) and "" not in inputs and len(set(inputs)) == len(inputs):
            wiring = _IN_ORDER[len(inputs)]
        else:
            wiring = tuple(inputs.index(name) if name else -1 for name in inputs)
        attrs = site.node.attribute
        attributes = tuple([a.SerializeToString() for a in attrs]) if attrs else ()
        return (
            site.node.op_type,
            plan.data["form"],
            read.a.template_key,
            read.b.template_key,
            read.a_rank,
            read.b_rank,
            read.to_float,
            read.bias >= 0,
            read.dynamic,
            plan.data["nan_guard"],
            wiring,
            attributes,
        )

    # -- building -----------------------------------------------------------------------------

    def build(self, site: Site, emit: Emitter, options: Mapping[str, Any], plan: Plan) -> None:
        read: _Read = plan.data["read"]
        compute = _T.INT32 if plan.data["form"] == "int32" else _T.FLOAT
        inputs = _padded(site)
        a_names = read.a.names(inputs)
        if read.dynamic:
            names = [emit.fresh("A_quantized"), emit.fresh("A_scale"), emit.fresh("A_zero_point")]
            DynamicQuantizeLinearBuilder.expand_onnxruntime(a_names[0], emit, names, guard=plan.data["nan_guard"])
            a_names = (names[0], names[2])
            a_scale = names[1]
        else:
            a_scale = inputs[read.a_scale] if read.a_scale >= 0 else ""
        b_scale = inputs[read.b_scale] if read.b_scale >= 0 else ""
        a_shifted = self._shifted(emit, read.a, a_names, compute, per_row=True, rank=read.a_rank)
        b_names = read.b.names(inputs)
        b_shifted = self._shifted(emit, read.b, b_names, compute, per_row=False, rank=read.b_rank, conv=read.conv)
        y = site.node.output[0]
        direct = not read.to_float and compute == _T.INT32  # int32 MatMul writes the output itself
        target = y if direct else None
        if read.conv:
            attrs = {a.name: a for a in site.node.attribute}
            acc = emit.op1("Conv", [a_shifted, b_shifted], target, **attrs)
        else:
            acc = emit.op1("MatMul", [a_shifted, b_shifted], target)
        if direct:
            return
        if not read.to_float:
            emit.op1("Cast", [acc], y, to=_T.INT32)
            return
        if compute == _T.INT32:
            acc = emit.op1("Cast", [acc], to=_T.FLOAT)
        scale = emit.op1("Mul", [a_scale, b_scale], hint="ScaleProduct")
        if read.bias >= 0:
            scaled = emit.op1("Mul", [acc, scale])
            emit.op1("Add", [scaled, inputs[read.bias]], y)
        else:
            emit.op1("Mul", [acc, scale], y)

    @staticmethod
    def _shifted(
        emit: Emitter,
        operand: _Operand,
        names: tuple[str, str],
        compute: int,
        *,
        per_row: bool,
        rank: int | None,
        conv: bool = False,
    ) -> str:
        """``names``: the operand's value and zero point ('' when it has none)."""
        value = emit.op1("Cast", [names[0]], to=compute)
        zp = names[1]
        if not zp or (operand.zp_value is not None and not np.any(operand.zp_value)):
            return value
        if operand.zp_size == 1 or (per_row and operand.zp_size is None and (rank is None or rank < 2)):
            # (A's zero point of unknown shape and A of unknown rank: onnxruntime needs one element.)
            if operand.zp_value is not None:
                # A constant zero point is emitted already in the compute type (exact: an 8-bit
                # integer is a float32 and an int32), one shared constant instead of a Cast per node.
                dtype = np.float32 if compute == _T.FLOAT else np.int32
                return emit.op1("Sub", [value, emit.const(operand.zp_value.reshape(()).astype(dtype))])
            if operand.zp_scalar:
                zp_name = zp
            else:
                zp_name = emit.op1("Reshape", [zp, emit.const(np.zeros(0, np.int64))], hint="ToScalar")
        elif per_row:  # A's zero point per row: [M] -> [M, 1] (a 1-element one of unknown shape too)
            zp_name = emit.op1("Reshape", [zp, emit.const(np.asarray([-1, 1], np.int64))], hint="PerRow")
        elif conv:  # w's per output channel: [M] -> [M, 1, ..., 1]
            assert rank is not None
            zp_name = emit.op1(
                "Reshape", [zp, emit.const(np.asarray([-1] + [1] * (rank - 1), np.int64))], hint="PerChannel"
            )
        else:  # B's per column: [N] broadcasts along the last axis
            zp_name = emit.op1("Reshape", [zp, emit.const(np.asarray([-1], np.int64))], hint="PerColumn")
        return emit.op1("Sub", [value, emit.op1("Cast", [zp_name], to=compute)])


register(IntegerMatMulBuilder())
