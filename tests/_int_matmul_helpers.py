"""The integer matmul/conv battery shared by the default lowering's tests
(test_lower_integer_matmul.py) and the float-emulation form's (test_float_emulation_int_matmul.py).

One table per op in the style of onnxruntime's QDQ tests: every dtype pair, zero points absent /
zero / non-zero / extreme, per-tensor and per-column/per-channel, constant and runtime weights and
zero points, edge values (all qmin, all qmax, only extremes). Each case builds its one-node model,
its feeds and its ONNX-definition reference (int64 numpy) here, so both forms are checked on the
same cases and a case added to the table reaches both.
"""

from __future__ import annotations

import contextlib
import itertools
import zlib
from collections.abc import Iterator
from typing import NamedTuple
from unittest import mock

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


# --- a saturating CPU, emulated on any CPU ------------------------------------------------------


class _Nodes:
    """Appends nodes named under one prefix, in order."""

    def __init__(self, prefix: str) -> None:
        self.prefix, self.nodes = prefix, []

    def const(self, name: str, value) -> str:
        out = f"{self.prefix}/{name}"
        self.nodes.append(
            helper.make_node("Constant", [], [out], value=numpy_helper.from_array(np.asarray(value), out))
        )
        return out

    def op(self, kind: str, inputs: list[str], name: str, output: str | None = None, **attrs) -> str:
        out = output or f"{self.prefix}/{name}"
        self.nodes.append(helper.make_node(kind, inputs, [out], name=f"{self.prefix}/{name}", **attrs))
        return out


def saturating_matmul_nodes(node: onnx.NodeProto, b: np.ndarray, zb: np.ndarray | None) -> list[onnx.NodeProto]:
    """Standard-ONNX nodes (opset 13+) computing ``node`` (MatMulInteger, uint8 A, constant int8 B)
    as :func:`saturating_matmul` does, in int32: the products of each aligned pair along K
    (k = 2j, 2j + 1) summed and clipped to int16, the pairs summed (the last product of an odd K
    alone: within int16 whatever its values), then the zero points applied exactly."""
    g, k = _Nodes(f"{node.name or node.output[0]}/saturating"), b.shape[0]
    b32, half = b.astype(np.int32), k // 2
    i64 = lambda v: np.array([v], np.int64)  # noqa: E731
    zero, one, two, last, pair_axis = (
        g.const("0", i64(0)),
        g.const("1", i64(1)),
        g.const("2", i64(2)),
        g.const("-1", i64(-1)),
        g.const("-2", i64(-2)),
    )
    end, middle = g.const("k", i64(k)), g.const("half", i64(half))
    a = g.op("Cast", [node.input[0]], "a", to=T.INT32)
    products = []
    for start, part in ((zero, "even"), (one, "odd")):
        column = g.op("Unsqueeze", [g.op("Slice", [a, start, end, last, two], f"a_{part}"), last], f"a_{part}_col")
        products.append(g.op("Mul", [column, g.const(f"b_{part}", b32[0 if part == "even" else 1 :: 2])], f"p_{part}"))
    paired = g.op("Slice", [products[0], zero, middle, pair_axis], "p_even_paired")
    pairs = g.op("Add", [paired, products[1]], "pairs")
    clipped = g.op(
        "Clip", [pairs, g.const("lo", np.array(-32768, np.int32)), g.const("hi", np.array(32767, np.int32))], "clipped"
    )
    acc = g.op("ReduceSum", [clipped, pair_axis], "acc_pairs", keepdims=0)
    if k % 2:
        alone = g.op(
            "ReduceSum",
            [g.op("Slice", [products[0], middle, end, pair_axis], "p_last"), pair_axis],
            "acc_last",
            keepdims=0,
        )
        acc = g.op("Add", [acc, alone], "acc")
    has_za = len(node.input) > 2 and node.input[2]
    za = g.op("Cast", [node.input[2]], "za", to=T.INT32) if has_za else g.const("za", np.zeros((), np.int32))
    zb32 = g.const("zb", np.zeros((), np.int32) if zb is None else np.asarray(zb, np.int32))
    rowsum = g.op("ReduceSum", [a, last], "rowsum", keepdims=1)
    acc = g.op(
        "Sub", [acc, g.op("Mul", [za, g.const("colsum", b32.sum(axis=0).astype(np.int32))], "za_colsum")], "minus_za"
    )
    acc = g.op("Sub", [acc, g.op("Mul", [zb32, rowsum], "zb_rowsum")], "minus_zb")
    zazb = g.op("Mul", [g.op("Mul", [za, zb32], "za_zb"), g.const("k_count", np.array(k, np.int32))], "zazb_k")
    g.op("Add", [acc, zazb], "out", output=node.output[0])
    return g.nodes


def _saturating_ms_nodes(node: onnx.NodeProto, b: np.ndarray, zb: np.ndarray | None) -> list[onnx.NodeProto]:
    """com.microsoft MatMulIntegerToFloat (uint8 A) or DynamicQuantizeMatMul as the integer
    product of :func:`saturating_matmul_nodes`, then ``float(acc) * (a_scale * b_scale) (+ bias)``
    in float32: the saturating kernel up to the order of those last float32 roundings (not bit for
    bit: for assertions coarser than an ulp)."""
    g = _Nodes(f"{node.name or node.output[0]}/saturating_float")
    inputs = list(node.input) + [""] * 7
    if node.op_type == "DynamicQuantizeMatMul":
        a, a_scale, a_zp = (f"{g.prefix}/{n}" for n in ("a_q", "a_scale", "a_zp"))
        g.nodes.append(
            helper.make_node("DynamicQuantizeLinear", [inputs[0]], [a, a_scale, a_zp], name=f"{g.prefix}/dql")
        )
        b_scale, bias = inputs[2], inputs[4]
    else:
        a, a_scale, b_scale, a_zp, bias = inputs[0], inputs[2], inputs[3], inputs[4], inputs[6]
    acc = f"{g.prefix}/acc"
    integer = helper.make_node("MatMulInteger", [a, node.input[1], a_zp], [acc], name=f"{g.prefix}/mmi")
    g.nodes += saturating_matmul_nodes(integer, b, zb)
    scaled = g.op(
        "Mul", [g.op("Cast", [acc], "acc_float", to=T.FLOAT), g.op("Mul", [a_scale, b_scale], "scale")], "scaled"
    )
    if bias:
        g.op("Add", [scaled, bias], "out", output=node.output[0])
    else:
        g.op("Identity", [scaled], "out", output=node.output[0])
    return g.nodes


#: op -> (its B input, its B zero point input, whether A is uint8 by construction)
_EMULATED = {
    ("", "MatMulInteger"): (1, 3, False),
    ("com.microsoft", "MatMulIntegerToFloat"): (1, 5, False),
    ("com.microsoft", "DynamicQuantizeMatMul"): (1, 3, True),
}


def emulate_saturating_kernels(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every uint8 x int8 product of constant int8 weights (MatMulInteger; the
    com.microsoft MatMulIntegerToFloat and DynamicQuantizeMatMul, see :func:`_saturating_ms_nodes`)
    computed as onnxruntime's kernel on x86 without VNNI computes it, so that a test can run what
    such a CPU runs on any CPU. Other nodes unchanged; ``model`` itself when there is none."""
    inits = {t.name: t for t in model.graph.initializer}
    typed = onnx.shape_inference.infer_shapes(model).graph
    types = {v.name: v.type.tensor_type.elem_type for v in (*typed.input, *typed.value_info)}
    nodes, changed = [], False
    for node in model.graph.node:
        spec = _EMULATED.get((node.domain if node.domain != "ai.onnx" else "", node.op_type))
        b = inits.get(node.input[1]) if spec else None
        if spec is None or b is None or b.data_type != T.INT8 or not (spec[2] or types.get(node.input[0]) == T.UINT8):
            nodes.append(node)
            continue
        zb_name = node.input[spec[1]] if len(node.input) > spec[1] else ""
        assert not zb_name or zb_name in inits, f"{node.name}: the emulation takes a constant B zero point"
        zb = numpy_helper.to_array(inits[zb_name]) if zb_name else None
        emulate = saturating_matmul_nodes if node.op_type == "MatMulInteger" else _saturating_ms_nodes
        nodes += emulate(node, numpy_helper.to_array(b), zb)
        changed = True
    if not changed:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    read = {name for node in nodes for name in node.input}
    kept = [t for t in out.graph.initializer if t.name in read]  # B moved into the emulation's constants
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept)
    return out


@contextlib.contextmanager
def on_a_saturating_cpu() -> Iterator[None]:
    """Inside, onnxruntime sessions run every uint8 x int8 product of constant int8 weights
    (MatMulInteger exactly, MatMulIntegerToFloat and DynamicQuantizeMatMul up to float32 rounding
    order) as x86 without VNNI runs it (:func:`emulate_saturating_kernels`), and verify's
    measurement of the kernel (``default_kernel_saturates``) says it saturates: what verify does on
    such a CPU, on any CPU. Other ops (QLinearMatMul, QGemm, QAttention) are not emulated: they run
    as this CPU runs them, and only verify's bounds take the saturating CPU's values."""
    import onnxruntime as ort

    from onnx_qrewrite.verify import u8s8_reference

    real = ort.InferenceSession

    def emulating(source, *args, **kwargs):
        model = onnx.load_from_string(source) if isinstance(source, bytes) else onnx.load(source)
        return real(emulate_saturating_kernels(model).SerializeToString(), *args, **kwargs)

    with (
        mock.patch.object(ort, "InferenceSession", emulating),
        mock.patch.object(u8s8_reference, "default_kernel_saturates", lambda: True),
    ):
        yield
