"""The patterns ``onnxruntime.quantization.quantize_dynamic`` and onnxruntime's optimizer write around
integer matmuls and convolutions, read once per scope: shared by the named forms that replace them
as a whole ("weight-only", ``builders/weight_only.py``; "qdq", ``builders/dynamic_qdq.py``).

Patterns::

    DynamicQuantizeLinear(x) -> y, y_scale, y_zp
    MatMulInteger(y, W, y_zp, W_zp) | ConvInteger(y, W, y_zp, W_zp) -> Cast(to float)
    Mul(that, Mul(y_scale, W_scale))                       anchor: the Mul
    com.microsoft MatMulIntegerToFloat(y, W, y_scale, W_scale, y_zp, W_zp[, bias])
    com.microsoft DynamicQuantizeMatMul(x, W, W_scale, W_zp[, bias])
    DequantizeLinear(Gather(W, ids), W_scale, W_zp)        (quantize_dynamic's embedding lookup)

An :class:`Anchor` is the pattern's last node, whose output a replacement writes; ``chain`` names
the first outputs of the pattern's other nodes (the forms remove them once nothing reads them).
Anything that is not exactly the producer's pattern is recorded with the reason it is not (the
forms give way with ``NotApplicable``): a Cast to another type, a Mul by something that is not
``y_scale`` times a constant weight scale, an activation zero point or scale that is not the same
DynamicQuantizeLinear's, weights, scales or zero points computed at run time, a scale whose
broadcast is not per tensor or per output column/channel.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from onnx_qrewrite import _onnx as onnx
from onnx_qrewrite._dataclass import dataclass
from onnx_qrewrite.rewriter.builders import NotApplicable
from onnx_qrewrite.rewriter.graph import Scope, dtype_name

if TYPE_CHECKING:
    from onnx_qrewrite.rewriter.builders import Emitter, Site

__all__ = [
    "CHAIN_OPS",
    "STANDARD",
    "Analysis",
    "Anchor",
    "Weights",
    "analysis",
    "anchor_weights_dtype",
    "attribute",
    "dequantize_weights",
    "producer",
]

_T = onnx.TensorProto
STANDARD = ("", "ai.onnx")
_WEIGHT_TYPES: dict[int, str] = {_T.UINT8: "uint8", _T.INT8: "int8"}
#: Ops whose nodes the ``remove_dead`` role removes when the rewrite left them unread.
CHAIN_OPS = frozenset({"DynamicQuantizeLinear", "MatMulInteger", "ConvInteger", "Cast", "Mul", "Gather"})


@dataclass(frozen=True)
class Weights:
    """A constant quantized weight and how DequantizeLinear reads it."""

    name: str
    dtype: str
    scale: np.ndarray  # float32: shape () per tensor, (n,) along ``axis``
    zero_point: np.ndarray | None  # the weights' dtype, ``scale``'s shape; None: absent
    axis: int | None  # None: per tensor
    #: The model's own scale / zero point names when they already have the shape DequantizeLinear
    #: needs (reused instead of copied).
    scale_name: str = ""
    zero_point_name: str = ""


@dataclass(frozen=True)
class Anchor:
    """The last node of a matched pattern and what its rewrite needs."""

    op: str  # what the replacement computes: MatMul, Conv or Gather
    x: str  # the float activation (Gather: the indices)
    weights: Weights
    attributes: tuple[onnx.AttributeProto, ...]  # ConvInteger's or Gather's
    bias: str  # added after the MatMul (the fused ops' bias input); '' when absent
    chain: tuple[str, ...]  # first outputs of the pattern's other nodes
    reads: frozenset[str]
    what: str
    #: The DynamicQuantizeLinear outputs (y, y_scale, y_zp) the pattern's integer op reads; empty
    #: when the pattern has none (DynamicQuantizeMatMul quantizes inside, Gather is not quantized).
    activation: tuple[str, ...] = ()


@dataclass
class Analysis:
    """One scope's patterns: anchors by their first output (or why a candidate is not one), and
    the first outputs of every node some anchor's pattern contains."""

    anchors: dict[str, Anchor | str]
    chain: set[str]


_ANALYSES: weakref.WeakKeyDictionary[Scope, Analysis] = weakref.WeakKeyDictionary()


def analysis(scope: Scope) -> Analysis:
    found = _ANALYSES.get(scope)
    if found is None:
        found = _ANALYSES[scope] = _analyse(scope)
    return found


def anchor_weights_dtype(site: Site) -> str | None:
    """The weights' dtype of the pattern ``site``'s node ends, if it ends one: what the builders
    built on these patterns report as their quantized dtype."""
    anchor = analysis(site.scope).anchors.get(site.node.output[0]) if site.node.output else None
    return anchor.weights.dtype if isinstance(anchor, Anchor) else None


def _analyse(scope: Scope) -> Analysis:
    anchors: dict[str, Anchor | str] = {}
    chain: set[str] = set()
    for node in scope.container.node:
        if not node.output or not node.output[0]:
            continue
        if node.domain in STANDARD and node.op_type == "Mul":
            read = _read_mul
        elif node.domain == "com.microsoft" and node.op_type in ("MatMulIntegerToFloat", "DynamicQuantizeMatMul"):
            read = _read_fused
        elif node.domain in STANDARD and node.op_type == "DequantizeLinear":
            read = _read_gathered
        else:
            continue
        try:
            anchor = read(scope, node)
        except NotApplicable as why:
            anchors[node.output[0]] = str(why)
            continue
        anchors[node.output[0]] = anchor
        chain.update(anchor.chain)
    return Analysis(anchors, chain)


def producer(scope: Scope, name: str, op_type: str, domain: tuple[str, ...] = STANDARD) -> onnx.NodeProto | None:
    node = scope.producer(name) if name else None
    return node if node is not None and node.op_type == op_type and node.domain in domain else None


def _inputs(node: onnx.NodeProto, n: int) -> list[str]:
    return list(node.input) + [""] * (n - len(node.input))


def attribute(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    for attr in node.attribute:
        if attr.name == name:
            return onnx.helper.get_attribute_value(attr)
    return default


def _constant_info(scope: Scope, name: str) -> tuple[int, tuple[int, ...]] | None:
    """Element type and shape of a constant (initializer or Constant node) without reading a large
    initializer's data; None when the value is computed at run time."""
    tensor = scope.initializer(name)
    if tensor is None:
        node = producer(scope, name, "Constant")
        value = attribute(node, "value") if node is not None else None
        if not isinstance(value, onnx.TensorProto):
            return None
        tensor = value
    return tensor.data_type, tuple(tensor.dims)


def _dql_of(scope: Scope, y: str, y_zp: str, y_scale: str) -> onnx.NodeProto:
    """The DynamicQuantizeLinear whose three outputs are y, y_scale and y_zp."""
    dql = producer(scope, y, "DynamicQuantizeLinear")
    if dql is None or len(dql.output) != 3 or dql.output[0] != y:
        raise NotApplicable("the quantized activation is not a DynamicQuantizeLinear output")
    if y_zp != dql.output[2]:
        raise NotApplicable("the activation zero point is not its DynamicQuantizeLinear's")
    if y_scale != dql.output[1]:
        raise NotApplicable("the activation scale is not its DynamicQuantizeLinear's")
    return dql


def _weights(scope: Scope, w: str, w_scale: str, w_zp: str, *, conv: bool, gather: bool = False) -> Weights:
    """The weights, their scale and zero point as DequantizeLinear takes them: per tensor, or along
    the output column (MatMul: axis 1 of a 2-D W) or channel (Conv: axis 0). A gathered table:
    per tensor only, any rank."""
    info = _constant_info(scope, w)
    if info is None:
        raise NotApplicable("the weights are computed at run time")
    elem, shape = info
    if elem not in _WEIGHT_TYPES:
        raise NotApplicable(f"the weights are {dtype_name(elem)}; uint8 and int8 are dequantized")
    if conv and len(shape) < 3:
        raise NotApplicable(f"the convolution weights have rank {len(shape)}")
    if gather and not shape:
        raise NotApplicable("the gathered table is a scalar")
    if not conv and not gather and len(shape) != 2:
        raise NotApplicable(f"the weights have rank {len(shape)}; 2-D weights are dequantized")
    scale = scope.constant(w_scale) if w_scale else None
    if scale is None or scale.dtype != np.float32:
        raise NotApplicable("the weight scale is not a float32 constant")
    zp = scope.constant(w_zp) if w_zp else None
    if w_zp and (zp is None or zp.dtype != np.dtype(_WEIGHT_TYPES[elem])):
        raise NotApplicable("the weight zero point is not a constant of the weights' type")
    n = shape[0] if conv or gather else shape[1]
    axis: int | None
    scale_1d: np.ndarray
    if scale.size == 1 and scale.ndim <= 1:
        axis = None
        scale_1d = scale.reshape(())
    elif gather:
        raise NotApplicable("the gathered table's scale is not per tensor")
    elif conv and scale.shape in ((n,) + (1,) * (len(shape) - 2), (1, n) + (1,) * (len(shape) - 2)):
        axis, scale_1d = 0, scale.reshape(n)  # broadcasts along the output's channel axis
    elif not conv and scale.shape == (n,):
        axis, scale_1d = 1, scale  # along the output's last axis: per column of W
    else:
        raise NotApplicable(
            f"the weight scale's shape {list(scale.shape)} is neither per tensor nor per output "
            f"{'channel' if conv else 'column'}"
        )
    zp_1d: np.ndarray | None = None
    if zp is not None:
        if zp.size == 1 and zp.ndim <= 1:
            zp_1d = zp.reshape(()) if axis is None else np.full(n, zp.reshape(()), zp.dtype)
        elif zp.shape == (n,) and not gather:
            if axis is None:  # a per-tensor scale with per-channel zero points
                axis, scale_1d = (0 if conv else 1), np.full(n, scale_1d, np.float32)
            zp_1d = zp
        else:
            raise NotApplicable(
                f"the weight zero point's shape {list(zp.shape)} is neither per tensor nor per "
                f"output {'channel' if conv else 'column'}"
            )
    if zp_1d is not None and not np.any(zp_1d):
        zp_1d = None  # zero: DequantizeLinear's default (what symmetric-only targets accept)
    return Weights(
        w,
        _WEIGHT_TYPES[elem],
        scale_1d,
        zp_1d,
        axis,
        scale_name=w_scale if scale.shape == scale_1d.shape else "",
        zero_point_name=w_zp if zp is not None and zp_1d is not None and zp.shape == zp_1d.shape else "",
    )


def _read_mul(scope: Scope, node: onnx.NodeProto) -> Anchor:
    """Mul(Cast<float>(MatMulInteger|ConvInteger(DQL(x)...)), Mul(y_scale, W_scale)), either order."""
    if len(node.input) != 2:
        raise NotApplicable("not a two-input Mul")
    first, second = node.input
    cast, product = producer(scope, first, "Cast"), second
    if cast is None:
        cast, product = producer(scope, second, "Cast"), first
    if cast is None:
        raise NotApplicable("no input is a Cast of an integer MatMul or Conv")
    if attribute(cast, "to") != _T.FLOAT:
        raise NotApplicable("the Cast is not to float32")
    integer = scope.producer(cast.input[0]) if cast.input else None
    if integer is None or integer.domain not in STANDARD or integer.op_type not in ("MatMulInteger", "ConvInteger"):
        raise NotApplicable("the Cast's input is not a MatMulInteger or ConvInteger")
    y, w, y_zp, w_zp = _inputs(integer, 4)
    scale_product = producer(scope, product, "Mul")
    if scale_product is None or len(scale_product.input) != 2:
        raise NotApplicable("the other factor is not a Mul of the activation and weight scales")
    dql = producer(scope, y, "DynamicQuantizeLinear")
    y_scale = dql.output[1] if dql is not None and len(dql.output) == 3 else "<none>"
    if y_scale not in scale_product.input:
        raise NotApplicable("the other factor does not multiply the activation's DynamicQuantizeLinear scale")
    a, b = scale_product.input
    w_scale = b if a == y_scale else a
    dql = _dql_of(scope, y, y_zp, y_scale)
    conv = integer.op_type == "ConvInteger"
    weights = _weights(scope, w, w_scale, w_zp, conv=conv)
    x = dql.input[0]
    chain = (cast.output[0], integer.output[0], scale_product.output[0], dql.output[0])
    return Anchor(
        "Conv" if conv else "MatMul",
        x,
        weights,
        tuple(integer.attribute) if conv else (),
        "",
        chain,
        frozenset(n for n in (x, w, w_scale, w_zp) if n),
        f"{integer.op_type} {weights.dtype} weights" + ("" if weights.axis is None else " per output channel"),
        tuple(dql.output),
    )


def _read_fused(scope: Scope, node: onnx.NodeProto) -> Anchor:
    """com.microsoft MatMulIntegerToFloat (A from a DynamicQuantizeLinear) / DynamicQuantizeMatMul."""
    chain: tuple[str, ...] = ()
    activation: tuple[str, ...] = ()
    if node.op_type == "MatMulIntegerToFloat":
        y, w, y_scale, w_scale, y_zp, w_zp, bias = _inputs(node, 7)
        dql = _dql_of(scope, y, y_zp, y_scale)
        x, chain, activation = dql.input[0], (dql.output[0],), tuple(dql.output)
    else:
        x, w, w_scale, w_zp, bias = _inputs(node, 5)
    if len(node.input) > (7 if node.op_type == "MatMulIntegerToFloat" else 5):
        raise NotApplicable(f"{node.op_type} has more inputs than the contrib op defines")
    weights = _weights(scope, w, w_scale, w_zp, conv=False)
    return Anchor(
        "MatMul",
        x,
        weights,
        (),
        bias,
        chain,
        frozenset(n for n in (x, w, w_scale, w_zp, bias) if n),
        f"{node.op_type} {weights.dtype} weights" + ("" if weights.axis is None else " per output column"),
        activation,
    )


def _read_gathered(scope: Scope, node: onnx.NodeProto) -> Anchor:
    """DequantizeLinear(Gather(W: constant, indices), scale, zp), per tensor: quantize_dynamic's
    quantized embedding lookup. Gathering the dequantized table computes the same values."""
    x, x_scale, x_zp = _inputs(node, 3)
    gather = producer(scope, x, "Gather")
    if gather is None or len(gather.input) != 2 or gather.output[0] != x:
        raise NotApplicable("not a DequantizeLinear of a Gather")
    attrs = {a.name: a.i for a in node.attribute}
    if (
        set(attrs) - {"axis", "block_size", "output_dtype"}
        or attrs.get("block_size")
        or attrs.get("output_dtype", 0) not in (0, _T.FLOAT)
    ):
        raise NotApplicable(
            f"DequantizeLinear attributes {sorted(attrs)}: blocked or non-float32 forms are not supported"
        )
    table, indices = gather.input
    weights = _weights(scope, table, x_scale, x_zp, conv=False, gather=True)
    return Anchor(
        "Gather",
        indices,
        weights,
        tuple(gather.attribute),
        "",
        (gather.output[0],),
        frozenset(n for n in (indices, table, x_scale, x_zp) if n),
        f"Gather of a {weights.dtype} table",
    )


def dequantize_weights(emit: Emitter, w: Weights) -> str:
    """``DequantizeLinear(W, W_scale[, W_zp])`` (per tensor, or along ``w.axis``), reusing the model's
    own scale and zero point where they already have the shape it needs; a zero point of 0 is left
    out (what symmetric-only targets read)."""
    scale = w.scale_name or emit.const(w.scale)
    inputs = [w.name, scale]
    if w.zero_point is not None:
        inputs.append(w.zero_point_name or emit.const(w.zero_point))
    if w.axis is None:
        return emit.op1("DequantizeLinear", inputs, hint="DequantizeWeights")
    return emit.op1("DequantizeLinear", inputs, hint="DequantizeWeights", axis=w.axis)
