"""The integer matmul/conv battery shared by the default lowering's tests
(test_lower_integer_matmul.py) and the float-emulation form's (test_float_emulation_int_matmul.py).

One table per op in the style of onnxruntime's QDQ tests: every dtype pair, zero points absent /
zero / non-zero / extreme, per-tensor and per-column/per-channel, constant and runtime weights and
zero points, edge values (all qmin, all qmax, only extremes). Each case builds its one-node model,
its feeds and its ONNX-definition reference (int64 numpy) here, so both forms are checked on the
same cases and a case added to the table reaches both.
"""

from __future__ import annotations

import itertools
import zlib
from typing import NamedTuple

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper, numpy_helper

NP = {"uint8": np.uint8, "int8": np.int8}
ONNX = {"uint8": T.UINT8, "int8": T.INT8}
RANGE = {"uint8": (0, 255), "int8": (-128, 127)}
TYPE_PAIRS = list(itertools.product(("uint8", "int8"), repeat=2))


def rng_for(*key) -> np.random.Generator:
    """A generator seeded by the case itself (stable across runs, unlike hash())."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def values(rng: np.random.Generator, dtype: str, shape, edge: str) -> np.ndarray:
    lo, hi = RANGE[dtype]
    if edge == "min":
        return np.full(shape, lo, NP[dtype])
    if edge == "max":
        return np.full(shape, hi, NP[dtype])
    if edge == "extremes":
        return np.where(rng.random(shape) < 0.5, lo, hi).astype(NP[dtype])
    return rng.integers(lo, hi + 1, shape).astype(NP[dtype])


def zero_point(rng, dtype: str, kind: str, size: int) -> np.ndarray | None:
    lo, hi = RANGE[dtype]
    if kind == "absent":
        return None
    if kind == "zero":
        return np.zeros((), NP[dtype])
    if kind == "extreme":
        return np.array(hi, NP[dtype])
    if kind == "nonzero":
        return np.array(rng.integers(lo, hi + 1), NP[dtype])
    return rng.integers(lo, hi + 1, size).astype(NP[dtype])  # "per-channel"


def saturating_matmul(a: np.ndarray, b: np.ndarray, azp, bzp) -> np.ndarray:
    """onnxruntime's uint8 x int8 MatMulInteger on x86 without VNNI (measured on 200 random cases):
    raw products summed in aligned pairs (k = 0,1 / 2,3 / ...) with int16 saturation, then the zero
    point corrections in exact integers."""
    a64, b64 = a.astype(np.int64), b.astype(np.int64)
    k = a64.shape[-1]
    prods = a64[..., :, :, None] * b64[..., None, :, :]
    if k % 2:
        prods = np.concatenate([prods, np.zeros_like(prods[..., :, :1, :])], axis=-2)
    acc = np.clip(prods[..., :, 0::2, :] + prods[..., :, 1::2, :], -32768, 32767).sum(axis=-2)
    azp = 0 if azp is None else np.asarray(azp, np.int64)
    bzp = 0 if bzp is None else np.asarray(bzp, np.int64)
    return (acc - azp * b64.sum(axis=-2, keepdims=True) - bzp * a64.sum(axis=-1, keepdims=True) + k * azp * bzp).astype(
        np.int32
    )


def _one_node_model(op: str, node_name: str, first: tuple[str, int, list], operands, attrs: dict, rank: int):
    """``op`` reading the input ``first`` (name, type, shape) and ``operands`` (name, value, type,
    constant): initializers when constant, else graph inputs fed by the returned feeds."""
    inputs = [helper.make_tensor_value_info(*first)]
    inits, feeds, names = [], {}, [first[0], "", "", ""]
    for i, (name, value, dtype, const) in enumerate(operands):
        if value is None:
            continue
        names[i + 1] = name
        if const:
            inits.append(numpy_helper.from_array(np.asarray(value), name))
        else:
            inputs.append(helper.make_tensor_value_info(name, ONNX[dtype], list(np.shape(value))))
            feeds[name] = np.asarray(value)
    while names[-1] == "":
        names.pop()
    node = helper.make_node(op, names, ["Y"], name=node_name, **attrs)
    y = helper.make_tensor_value_info("Y", T.INT32, [None] * rank)
    graph = helper.make_graph([node], "g", inputs, [y], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8), feeds


def matmul_model(ta, tb, a_shape, b, azp, bzp, *, b_const=True, zp_const=True):
    """MatMulInteger with B (and the zero points) as initializers, or as graph inputs."""
    operands = (("B", b, tb, b_const), ("a_zp", azp, ta, zp_const), ("b_zp", bzp, tb, zp_const))
    return _one_node_model("MatMulInteger", "mmi", ("A", ONNX[ta], list(a_shape)), operands, {}, len(a_shape))


def conv_model(tx, tw, x_shape, w, xzp, wzp, attrs, *, w_const=True):
    """ConvInteger with W (and the zero points, always) as initializers, or W as a graph input."""
    operands = (("W", w, tw, w_const), ("x_zp", xzp, tx, True), ("w_zp", wzp, tw, True))
    return _one_node_model("ConvInteger", "convi", ("X", ONNX[tx], list(x_shape)), operands, attrs, 4)


def matmul_reference(a, b, azp, bzp) -> np.ndarray:
    """MatMulInteger by its definition, in int64."""
    return (a.astype(np.int64) - (0 if azp is None else azp.astype(np.int64))) @ (
        b.astype(np.int64) - (0 if bzp is None else bzp.astype(np.int64))
    )


def conv_reference(x, w, xzp, wzp, *, pads, strides, dilations, group) -> np.ndarray:
    """ConvInteger by its definition, in int64: pad (x - x_zp) with 0, correlate with (w - w_zp)."""
    x = x.astype(np.int64) - (0 if xzp is None else np.asarray(xzp, np.int64).reshape(()))
    w = w.astype(np.int64)
    if wzp is not None:
        wzp = np.asarray(wzp, np.int64)
        w = w - (wzp.reshape(-1, 1, 1, 1) if wzp.size > 1 else wzp.reshape(()))
    x = np.pad(x, ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
    n, _, h, wd = x.shape
    m, cg, kh, kw = w.shape
    oh = (h - dilations[0] * (kh - 1) - 1) // strides[0] + 1
    ow = (wd - dilations[1] * (kw - 1) - 1) // strides[1] + 1
    out = np.zeros((n, m, oh, ow), np.int64)
    mg = m // group
    for o in range(m):
        g = o // mg
        xs = x[:, g * cg : (g + 1) * cg]
        for i, j in itertools.product(range(kh), range(kw)):
            patch = xs[
                :,
                :,
                i * dilations[0] : i * dilations[0] + strides[0] * (oh - 1) + 1 : strides[0],
                j * dilations[1] : j * dilations[1] + strides[1] * (ow - 1) + 1 : strides[1],
            ]
            out[:, o] += np.einsum("nchw,c->nhw", patch, w[o, :, i, j])
    return out.astype(np.int32)


def case_id(case: tuple) -> str:
    """A short, stable test id: the case's fields joined by "-" (shapes as 4x9x5)."""
    return "-".join("x".join(map(str, v)) if isinstance(v, tuple) else str(v) for v in case)


# -- the MatMulInteger table -------------------------------------------------------------------


class Built(NamedTuple):
    """One case made concrete: its operands, the model and every feed it needs (A or X included)."""

    model: onnx.ModelProto
    feeds: dict[str, np.ndarray]
    a: np.ndarray  # A or X
    b: np.ndarray  # B or W
    azp: np.ndarray | None
    bzp: np.ndarray | None
    reference: np.ndarray  # the ONNX definition (int64 numpy; int32 for ConvInteger)


class MatMulCase(NamedTuple):
    ta: str
    tb: str
    azp_kind: str
    bzp_kind: str
    edge: str  # of A's values; B's are random for "random", else only extremes
    shape: tuple[int, ...]  # (*batch, M, K, N)
    b_const: bool
    zp_const: bool

    def build(self) -> Built:
        rng = rng_for(*self)
        *batch, m, k, n = self.shape
        a = values(rng, self.ta, (*batch, m, k), self.edge)
        b = values(rng, self.tb, (k, n), "random" if self.edge == "random" else "extremes")
        azp = zero_point(rng, self.ta, self.azp_kind, m)
        bzp = zero_point(rng, self.tb, self.bzp_kind, n)
        model, feeds = matmul_model(
            self.ta, self.tb, a.shape, b, azp, bzp, b_const=self.b_const, zp_const=self.zp_const
        )
        return Built(model, {"A": a, **feeds}, a, b, azp, bzp, matmul_reference(a, b, azp, bzp))


MATMUL_CASES = [
    *[
        MatMulCase(ta, tb, azp, bzp, edge, (4, 9, 5), True, True)
        for ta, tb in TYPE_PAIRS
        for azp, bzp in (("absent", "absent"), ("zero", "zero"), ("nonzero", "nonzero"), ("extreme", "per-channel"))
        for edge in ("random", "extremes")
    ],
    *[
        MatMulCase(ta, tb, "nonzero", "per-channel", "random", (2, 3, 7, 6), b_const, zp_const)
        for ta, tb in TYPE_PAIRS
        for b_const, zp_const in ((False, False), (True, False), (False, True))
    ],
    MatMulCase("uint8", "uint8", "nonzero", "nonzero", "min", (3, 16, 4), True, True),
    MatMulCase("int8", "int8", "extreme", "extreme", "max", (3, 16, 4), True, True),
]


# -- the ConvInteger table ---------------------------------------------------------------------

CONV_ATTRS = [
    {"pads": [1, 1, 1, 1], "group": 1},
    {"pads": [0, 1, 2, 1], "strides": [2, 1], "group": 2},
    {"pads": [1, 1, 1, 1], "dilations": [2, 2], "group": 1},
]


class ConvCase(NamedTuple):
    tx: str
    tw: str
    xzp_kind: str
    wzp_kind: str
    edge: str  # of both X and W
    attrs_i: int  # index into CONV_ATTRS

    @property
    def attrs(self) -> dict:
        return CONV_ATTRS[self.attrs_i]

    @property
    def saturable(self) -> bool:
        """int8 x uint8: onnxruntime's kernel pairs products into int16, which extremes overflow."""
        return self.tx == "int8" and self.tw == "uint8" and self.edge == "extremes"

    def build(self) -> Built:
        rng = rng_for(*self)
        attrs = self.attrs
        x = values(rng, self.tx, (2, 4, 6, 5), self.edge)
        w = values(rng, self.tw, (6, 4 // attrs["group"], 3, 3), self.edge)
        if self.tx == "int8" and self.tw == "uint8" and self.edge == "random":
            w //= 2  # w[k] + w[k+1] <= 254: no pair can saturate, so onnxruntime is exact too
        xzp, wzp = zero_point(rng, self.tx, self.xzp_kind, 1), zero_point(rng, self.tw, self.wzp_kind, 6)
        model, feeds = conv_model(self.tx, self.tw, x.shape, w, xzp, wzp, attrs)
        reference = conv_reference(
            x,
            w,
            xzp,
            wzp,
            pads=attrs["pads"],
            strides=attrs.get("strides", [1, 1]),
            dilations=attrs.get("dilations", [1, 1]),
            group=attrs["group"],
        )
        return Built(model, {"X": x, **feeds}, x, w, xzp, wzp, reference)


CONV_CASES = [
    ConvCase(tx, tw, xzp, wzp, edge, attrs_i)
    for tx, tw in TYPE_PAIRS
    for xzp, wzp in (("absent", "absent"), ("nonzero", "nonzero"), ("extreme", "zero"))
    for edge in ("random", "extremes")
    for attrs_i in range(len(CONV_ATTRS))
]
