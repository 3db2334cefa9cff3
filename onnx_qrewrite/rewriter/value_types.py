"""The element type of a value the model does not declare, from the node that writes it.

A model without value_info records types only for its inputs, outputs and initializers; every
intermediate is undeclared. A builder that lowers a float32-only op must know that its input is
float32 (a float16 one given float32 constants makes a model onnxruntime cannot load), so
:meth:`Scope.value_type <onnx_qrewrite.rewriter.graph.Scope.value_type>` asks here when the
records say nothing: the producer's op says how its outputs' type follows from its inputs' (the table
below, from the ops' schemas), traced back until a declared value answers. Lazy (only values a
check asks about) and cheap (a bounded walk, remembered per scope). An op not in the table, or a
walk longer than :data:`MAX_STEPS`, answers None: unknown, never a guess.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from onnx_qrewrite import _onnx as onnx

if TYPE_CHECKING:
    from onnx_qrewrite.rewriter.graph import Scope

__all__ = ["MAX_STEPS", "traced_elem_type"]

_T = onnx.TensorProto
#: Producers one question may walk through (each a look-up in the scope's producer index).
MAX_STEPS = 64

#: Ops whose output 0 has the type of input 0 (their one input, or the data they move).
# fmt: off
_ONE_INPUT = (
    "Abs", "Acos", "Acosh", "Asin", "Asinh", "Atan", "Atanh", "AveragePool", "Ceil", "Celu", "Cos", "Cosh", "CumSum",
    "DepthToSpace", "Elu", "Erf", "Exp", "Expand", "Flatten", "Floor", "Gelu", "GlobalAveragePool", "GlobalLpPool",
    "GlobalMaxPool", "HardSigmoid", "HardSwish", "Hardmax", "Identity", "InstanceNormalization", "LRN", "LeakyRelu",
    "Log", "LogSoftmax", "LpNormalization", "LpPool", "MaxPool", "MeanVarianceNormalization", "Mish", "Neg", "Pad",
    "Reciprocal", "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean", "ReduceMin",
    "ReduceProd", "ReduceSum", "ReduceSumSquare", "Relu", "Reshape", "Resize", "ReverseSequence", "Round", "Selu",
    "Shrink", "Sigmoid", "Sign", "Sin", "Sinh", "Slice", "Softmax", "Softplus", "Softsign", "SpaceToDepth", "Sqrt",
    "Squeeze", "Tan", "Tanh", "ThresholdedRelu", "Tile", "TopK", "Transpose", "Trilu", "Unsqueeze", "Gather",
    "GatherElements", "GatherND", "Clip", "Dropout", "Pow", "ScatterND", "ScatterElements", "Range",
    "LayerNormalization", "BatchNormalization", "RMSNormalization", "Einsum", "Split", "Compress",
)
# fmt: on

#: Output 0 has the type of the first of these inputs whose type is known (the op's schema binds
#: them to one type variable, so any of them answers).
_FIRST_KNOWN: dict[str, tuple[int, ...]] = {
    **dict.fromkeys(_ONE_INPUT, (0,)),
    # inputs of one type variable
    **dict.fromkeys(("Add", "Sub", "Mul", "Div", "Mod", "MatMul", "PRelu", "BitShift"), (0, 1)),
    **dict.fromkeys(("Gemm", "Conv", "ConvTranspose"), (0, 1, 2)),
    "Where": (1, 2),
    "SimplifiedLayerNormalization": (1,),  # onnxruntime's, in this domain: X is T, scale and Y are V
    "OneHot": (2,),
    "CastLike": (1,),
}
#: Ops whose every output has output 0's type (Split's pieces); others: output 0 only.
_ALL_OUTPUTS = frozenset({"Split"})
#: Variadic ops: output 0 has the type of any input.
_VARIADIC = frozenset({"Concat", "Max", "Min", "Mean", "Sum"})
#: Fixed output types, per output (None: not fixed).
_FIXED: dict[str, tuple[int | None, ...]] = {
    **dict.fromkeys(("Shape", "Size", "ArgMax", "ArgMin", "NonZero", "NonMaxSuppression"), (_T.INT64,)),
    **dict.fromkeys(
        ("Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Not", "And", "Or", "Xor", "IsNaN", "IsInf"),
        (_T.BOOL,),
    ),
    **dict.fromkeys(("MatMulInteger", "ConvInteger"), (_T.INT32,)),
    "DynamicQuantizeLinear": (_T.UINT8, _T.FLOAT, _T.UINT8),
    "TopK": (None, _T.INT64),
    "MaxPool": (None, _T.INT64),
    "Dropout": (None, _T.BOOL),
}
#: com.microsoft ops the catalogue lowers (and common neighbours): output 0's type, as the first
#: known of these inputs (onnxruntime's contrib schemas).
_CONTRIB_FIRST_KNOWN: dict[str, tuple[int, ...]] = {
    **dict.fromkeys(("Gelu", "FastGelu", "QuickGelu", "BiasGelu", "BiasAdd"), (0, 1)),
    "RotaryEmbedding": (0, 2, 3),  # input 1 is the int64 position_ids
    **dict.fromkeys(("FusedMatMul", "FusedGemm", "FusedConv"), (0, 1)),
    **dict.fromkeys(("SkipLayerNormalization", "SkipSimplifiedLayerNormalization"), (0, 1)),
    **dict.fromkeys(("Attention", "MultiHeadAttention", "GroupQueryAttention", "PackedAttention"), (0,)),
    **dict.fromkeys(("BiasSoftmax", "BiasDropout", "BiasSplitGelu", "GroupNorm", "SkipGroupNorm"), (0,)),
    **dict.fromkeys(("GemmFastGelu", "NhwcConv"), (0, 1)),
    "SimplifiedLayerNormalization": (1,),  # X is T, scale and Y are V
    "EmbedLayerNormalization": (5, 6),  # gamma, beta
    "MatMulNBits": (0,),
    "MatMulIntegerToFloat": (2, 3),  # the scales
    "GatherBlockQuantized": (2,),  # the scales
    **dict.fromkeys(("QLinearAdd", "QLinearMul", "QLinearSigmoid", "QLinearLeakyRelu", "QLinearSoftmax"), (0,)),
    "QLinearConcat": (1,),  # Y's zero point
    # onnxruntime's channels-last CNN (session optimizer at level all): QLinearConv is y_zero_point's
    # type, the poolings their input's.
    "QLinearConv": (7,),
    **dict.fromkeys(("NhwcMaxPool", "QLinearAveragePool", "QLinearGlobalAveragePool"), (0,)),
}
_CONTRIB_FIXED: dict[str, tuple[int | None, ...]] = {
    **dict.fromkeys(("DynamicQuantizeMatMul", "QAttention"), (_T.FLOAT,)),
    "QEmbedLayerNormalization": (_T.FLOAT, _T.INT32),
    "EmbedLayerNormalization": (None, _T.INT32),  # mask_index
}

#: What a rule answers for one output: the inputs to ask (any known one answers), or a type.
_Derivation = tuple[int, ...] | int | None


def _attribute(node: onnx.NodeProto, name: str) -> onnx.AttributeProto | None:
    return next((a for a in node.attribute if a.name == name), None)


def _quantize(node: onnx.NodeProto, out: int) -> _Derivation:
    """QuantizeLinear: the zero point's type, else ``output_dtype``, else uint8."""
    if out:
        return None
    if len(node.input) > 2 and node.input[2]:
        return (2,)
    attr = _attribute(node, "output_dtype")
    return attr.i if attr is not None and attr.i else _T.UINT8


def _dequantize(node: onnx.NodeProto, out: int) -> _Derivation:
    """DequantizeLinear: ``output_dtype`` when set, else the scale's type."""
    if out:
        return None
    attr = _attribute(node, "output_dtype")
    return attr.i if attr is not None and attr.i else (1,)


def _cast(node: onnx.NodeProto, out: int) -> _Derivation:
    attr = _attribute(node, "to")
    return attr.i if attr is not None and not out else None


def _constant_of_shape(node: onnx.NodeProto, out: int) -> _Derivation:
    attr = _attribute(node, "value")
    return attr.t.data_type if attr is not None else _T.FLOAT


def _constant(node: onnx.NodeProto, out: int) -> _Derivation:
    """A Constant's value_* attribute (``value`` itself is in the scope's records)."""
    for attr in node.attribute:
        if attr.name in ("value_float", "value_floats"):
            return _T.FLOAT
        if attr.name in ("value_int", "value_ints"):
            return _T.INT64
    return None


def _qlinear(node: onnx.NodeProto, out: int) -> _Derivation:
    """QLinearMatMul / QLinearConv: y's zero point (input 7)."""
    return (7,) if not out and len(node.input) > 7 and node.input[7] else None


_SPECIAL: dict[str, Callable[[onnx.NodeProto, int], _Derivation]] = {
    "QuantizeLinear": _quantize,
    "DequantizeLinear": _dequantize,
    "Cast": _cast,
    "ConstantOfShape": _constant_of_shape,
    "Constant": _constant,
    "QLinearMatMul": _qlinear,
    "QLinearConv": _qlinear,
}
_CONTRIB_SPECIAL = {"QuantizeLinear": _quantize, "DequantizeLinear": _dequantize}


def _derivation(node: onnx.NodeProto, out: int) -> _Derivation:
    """How output ``out`` of ``node`` gets its type (see :data:`_Derivation`)."""
    op, domain = node.op_type, node.domain
    if domain in ("", "ai.onnx"):
        special, fixed, first = _SPECIAL.get(op), _FIXED.get(op), _FIRST_KNOWN.get(op)
        if op in _VARIADIC and not out:
            return tuple(range(len(node.input)))
    elif domain == "com.microsoft":
        special, fixed, first = _CONTRIB_SPECIAL.get(op), _CONTRIB_FIXED.get(op), _CONTRIB_FIRST_KNOWN.get(op)
    else:
        return None
    if special is not None:
        return special(node, out)
    if fixed is not None and out < len(fixed) and fixed[out] is not None:
        return fixed[out]
    if first is not None and (out == 0 or op in _ALL_OUTPUTS):
        return first
    return None


def traced_elem_type(scope: Scope, name: str, steps: list[int] | None = None) -> int | None:
    """The element type of ``name`` (undeclared, written by a node of ``scope``) from its
    producer, or None when no derivation reaches a known type within :data:`MAX_STEPS` producers.
    ``steps``: what is left of the walk's budget (shared by the recursion)."""
    budget = [MAX_STEPS] if steps is None else steps
    if budget[0] <= 0:
        return None
    budget[0] -= 1
    node = scope.producer(name)
    if node is None:
        return None
    outputs = node.output[:]
    how = _derivation(node, outputs.index(name))
    if how is None or isinstance(how, int):
        return how
    inputs = node.input[:]
    for index in how:
        if index < len(inputs) and inputs[index]:
            found = scope.value_type(inputs[index], budget)
            if found is not None:
                return found
    return None
