"""QOperator ops (``QLinear*``, ``QGemm``) -> DequantizeLinear -> float op -> QuantizeLinear.

onnxruntime's ``quantize_static(..., QuantFormat.QOperator)`` writes the quantized network as
QLinearConv / QLinearMatMul (default domain) and com.microsoft QLinearAdd, QLinearMul,
QLinearConcat, QLinearAveragePool, QLinearGlobalAveragePool, QLinearLeakyRelu, QLinearSigmoid,
QLinearSoftmax and QGemm. Most runtimes run none of them, but every backend's quantization pass
recognises the QDQ form: each quantized input dequantized, the float op, the output quantized::

    QLinearOp(x, xs, xz, ..., ys, yz) -> QuantizeLinear(Op(DequantizeLinear(x, xs, xz), ...), ys, yz)

What that costs against onnxruntime's kernels (measured, ``tests/test_lower_qoperator.py``):

- **Lookup-table kernels** (QLinearLeakyRelu, QLinearSigmoid) build their table with exactly
  dequantize -> the float op -> quantize, and QLinearConcat requantizes with exactly DQ -> Q: the
  QDQ form is **bit-exact** (every one of the 256 input values, many scales and zero points).
- **Integer accumulation** (QLinearConv, QLinearMatMul, QGemm) accumulates exactly in int32 and
  requantizes with one float multiplier; the QDQ form accumulates dequantized values in float. The
  pre-rounding values differ by at most ``d = gamma(K + 4) * sum|terms| / y_scale`` (the standard
  float summation bound, ``gamma(n) = n u / (1 - n u)``, ``u = 2^-24``, ``sum|terms|`` bounded from
  the constant weights and the activation's range), so the outputs differ by at most
  ``floor(d) + 1`` quantization steps: **one step** on every real layer (d is ~1e-3). ``Plan.bound``
  is that number, computed per node. QGemm without ``y_scale`` (float output) is bounded by
  ``d * y_scale`` units instead. A QLinearMatMul of two run-time operands (attention) bounds each
  product by the types' ranges, ``d = gamma(K + 4) · K · c``; where the model does not record K (a
  symbolic sequence length) and the rule's ``reduction_length`` is ``"run-time"``, the bound is
  that function of K (``run_time_k_steps``, formula ``run-time-k``), which ``verify`` evaluates at
  each sample's K.
- **Float requantization** (QLinearAdd, QLinearMul, QLinearAveragePool,
  QLinearGlobalAveragePool): the kernel evaluates the same real number in another float order, so
  a rounding can land on the other side of a half: **one step**.
- **QLinearSoftmax**: the kernel multiplies by ``floor(1 / y_scale)`` instead of dividing by
  ``y_scale``; with ``1 / y_scale`` an integer (1/256, what onnxruntime's quantizer writes) that is
  **one step**, otherwise two. (Its source reads as if int8 outputs above 127 wrapped around; the
  1.31.1 kernel saturates them, measured with p = 1, scale 1/256 and zero point -128.) Its uint8
  kernel is wrong over a single value (p = 1): 0 once floor(1 / y_scale) > 148. The rule leaves
  such a node where the shape shows the length-1 axis, and says so where the length is unknown.

On x86 CPUs without VNNI (AVX2), onnxruntime multiplies uint8 activations by int8 weights with
``vpmaddubsw``, which saturates the sum of two adjacent products to int16: with weights beyond
[-64, 64] its result depends on the CPU (measured: up to 23 steps off the exact value). The policy
is the integer matmul rules' (option ``u8s8_saturation``, :mod:`onnx_qrewrite.rewriter.u8s8`): the
bounded rules (``bound``) add each column's pair excess from the constant weights, times
``a_scale * b_scale / y_scale``, to ``d`` before the ``floor(d) + 1`` steps; weights computed at run
time give no useful bound and only the approximate rules (``ignore``) take such nodes. Quantizing
with ``reduce_range=True`` (7-bit weights) avoids the question.

onnxruntime's session optimizer at level all (a model saved with ``optimized_model_filepath``)
writes com.microsoft QLinearConv with ``channels_last = 1``: x and y channels-last, the weights OIHW
as ever. The same form with the dequantized x transposed to channels-first and Conv's output
transposed back (Transposes move values only: the same bound). A channels_last pooling or
QLinearConv needs the rank: recorded, from kernel_shape or the weights, or from the kernel_shape of
the convolution or pooling that writes its input (:func:`_windowed_rank`).

Scales and zero points must be constants (``quantize_static`` writes initializers); a node whose
parameters are computed at run time is left to the next rule with the reason.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import onnx

from onnx_qrewrite._dataclass import dataclass
from onnx_qrewrite.rewriter import kernel_opsets, u8s8
from onnx_qrewrite.rewriter.builders import Emitter, NoMatch, Plan, Site, register
from onnx_qrewrite.rewriter.builders._qdq import value_shape
from onnx_qrewrite.rewriter.builders.contracts import CONTRACTS, QOPERATOR_EXACTNESS
from onnx_qrewrite.rewriter.contract import EXACT, RUN_TIME_K_FORMULA
from onnx_qrewrite.rewriter.graph import dtype_name

__all__ = ["QOperatorBuilder", "run_time_k_steps", "summation_error_bound"]

_U = 2.0**-24  # unit roundoff of float32
_RANGES = {"uint8": (0, 255), "int8": (-128, 127)}
_NP = {"uint8": np.uint8, "int8": np.int8}


#: What makes a run-time reduction length known (targets/shapes.py records shapes through the
#: com.microsoft ops where onnx's inference stops, once the inputs' symbolic dimensions are fixed).
_FIX_DIMS = (
    "rewrite --target T --input-shape DIM=N fixes the input dimension it comes from (the output keeps it "
    "fixed) and records it"
)


#: ``reduction_length``: a QLinearMatMul whose reduction length is not recorded is bounded at run time.
RUN_TIME = "run-time"


def summation_error_bound(terms: int) -> float:
    """``gamma(n) = n u / (1 - n u)``: the relative bound of a float32 sum/dot product of n terms."""
    n = terms * _U
    return n / (1 - n) if n < 1 else math.inf


@dataclass(frozen=True)
class _Operand:
    """One quantized input (x, scale, zero point), by input index."""

    x: int
    scale: int
    zero_point: int


@dataclass(frozen=True)
class _Spec:
    """How one QOperator op is laid out and what it becomes."""

    inputs: tuple[_Operand, ...]
    #: Output scale and zero point input indices (scale -1: float output possible, QGemm).
    out_scale: int
    out_zero_point: int
    float_op: str


def _concat_operands(n: int) -> tuple[_Operand, ...]:
    return tuple(_Operand(2 + 3 * i, 3 + 3 * i, 4 + 3 * i) for i in range(n))


_UNARY = (_Operand(0, 1, 2),)
_BINARY = (_Operand(0, 1, 2), _Operand(3, 4, 5))

#: One per op of the contract (contracts.QOPERATOR_EXACTNESS, which also gives each op's exactness).
SPECS: dict[str, _Spec] = {
    "QLinearConv": _Spec(_BINARY, 6, 7, "Conv"),
    "QLinearMatMul": _Spec(_BINARY, 6, 7, "MatMul"),
    "QGemm": _Spec(_BINARY, 7, 8, "Gemm"),
    "QLinearAdd": _Spec(_BINARY, 6, 7, "Add"),
    "QLinearMul": _Spec(_BINARY, 6, 7, "Mul"),
    "QLinearConcat": _Spec((), 0, 1, "Concat"),
    "QLinearAveragePool": _Spec(_UNARY, 3, 4, "AveragePool"),
    "QLinearGlobalAveragePool": _Spec(_UNARY, 3, 4, "GlobalAveragePool"),
    "QLinearLeakyRelu": _Spec(_UNARY, 3, 4, "LeakyRelu"),
    "QLinearSigmoid": _Spec(_UNARY, 3, 4, "Sigmoid"),
    "QLinearSoftmax": _Spec(_UNARY, 3, 4, "Softmax"),
}

_ACCUMULATING = ("QLinearConv", "QLinearMatMul", "QGemm")
#: Input index of the optional int32 bias.
_BIAS = {"QLinearConv": 8, "QGemm": 6}

#: Attributes of each op (with onnxruntime's defaults) and which of them the float op takes.
_ATTRIBUTES: dict[str, dict[str, Any]] = {
    "QLinearConv": {
        "auto_pad": None,
        "dilations": None,
        "group": None,
        "kernel_shape": None,
        "pads": None,
        "strides": None,
        "channels_last": 0,  # com.microsoft's only (onnxruntime's NHWC optimizer)
    },
    "QLinearMatMul": {},
    "QGemm": {"alpha": 1.0, "transA": 0, "transB": 0},
    "QLinearAdd": {},
    "QLinearMul": {},
    "QLinearConcat": {"axis": None},
    "QLinearAveragePool": {
        "auto_pad": None,
        "ceil_mode": None,
        "count_include_pad": None,
        "kernel_shape": None,
        "pads": None,
        "strides": None,
        "channels_last": 0,
    },
    "QLinearGlobalAveragePool": {"channels_last": 0},
    "QLinearLeakyRelu": {"alpha": 0.01},
    "QLinearSigmoid": {},
    "QLinearSoftmax": {"axis": None, "opset": None},
}


@dataclass(frozen=True)
class _Param:
    """A constant scale or zero point, with its name and value."""

    name: str
    value: np.ndarray


class QOperatorBuilder:
    """Replaces a QOperator op with DequantizeLinear -> the float op -> QuantizeLinear."""

    name = "qoperator_to_qdq"
    contract = CONTRACTS["qoperator_to_qdq"]

    def quantized_dtype(self, site: Site) -> str | None:
        spec = SPECS.get(site.node.op_type)
        if spec is None:
            return None
        operand = spec.inputs[0] if spec.inputs else _concat_operands(1)[0]
        return _dtype(site, operand.x, operand.zero_point)

    def check(self, site: Site, options: Mapping[str, Any]) -> Plan:
        op = options["op"]
        if site.node.op_type != op:
            raise NoMatch(f"the rule is for {op}, not {site.node.op_type}")
        spec = SPECS[op]
        attrs = _read_attributes(site, op)
        operands = spec.inputs if op != "QLinearConcat" else _concat_operands(_concat_count(site))
        inputs = [_read_operand(site, o) for o in operands]
        out = _read_output(site, spec, inputs[0][3] if inputs else _dtype(site, 2, 4))
        per_axis = any(p[1].value.size > 1 for p in inputs)
        bound: float | None = None if QOPERATOR_EXACTNESS[op] == EXACT else 1.0
        min_opset = max(
            kernel_opsets.qdq_opset(False, inputs[0][3], per_axis=per_axis) or kernel_opsets.QDQ_FIRST,
            kernel_opsets.qdq_opset(True, out[2], per_axis=False) or kernel_opsets.QDQ_FIRST,
        )
        data: dict[str, Any] = {"attrs": attrs, "inputs": inputs, "out": out}
        notes: list[str] = []
        bound_u8s8 = 0.0
        formula: str | None = None
        if op in _ACCUMULATING:
            bound, note, bound_u8s8, formula = _accumulation_bound(site, op, attrs, inputs, out, options)
            notes.append(note)
            if options["u8s8_saturation"] == "ignore":
                bound, bound_u8s8, formula = None, 0.0, None  # approximate: no bound against a kernel that saturates
            if op == "QGemm":
                min_opset = max(min_opset, kernel_opsets.OP_VERSIONS["gemm-optional-c"])
        elif op == "QLinearSoftmax":
            bound, note, data["one_value_guard"] = _softmax_check(site, attrs, inputs, out)
            if data["one_value_guard"] and options["length_check"] == "softmax":
                if not np.isfinite(inputs[0][1].value).all():
                    raise NoMatch("x_scale is not finite: the length check's Softmax of x·0 would not see zeros")
                note = note.replace("(it checks the length)", "(a Softmax of zeros, 1 only over one value)")
            notes.append(note)
            min_opset = max(min_opset, kernel_opsets.OP_VERSIONS["softmax-single-axis"])
        elif op == "QLinearConcat" and "axis" not in attrs:
            raise NoMatch("malformed node: QLinearConcat needs an 'axis' attribute")
        if op in ("QLinearConv", "QLinearAveragePool", "QLinearGlobalAveragePool") and attrs["channels_last"]:
            data["rank"] = _channels_last_rank(site, attrs)
        if per_axis and op not in ("QLinearConv", "QLinearMatMul", "QGemm"):
            raise NoMatch(f"{op} takes per-tensor scales only; a scale here has more than one element")
        return Plan(
            min_opset=min_opset,
            bound=bound,
            notes=tuple(notes),
            data=data,
            bound_u8s8=bound_u8s8,
            bound_formula=formula,
        )

    def build(self, site: Site, emit: Emitter, options: Mapping[str, Any], plan: Plan) -> None:
        op = options["op"]
        attrs: dict[str, Any] = plan.data["attrs"]
        inputs = plan.data["inputs"]
        floats = [_dequantize(emit, site, op, i, operand) for i, operand in enumerate(inputs)]
        out_scale, out_zp, out_dtype = plan.data["out"]
        float_out = site.node.output[0] if out_scale is None else None
        y = _FLOAT_OPS[op](emit, site, attrs, floats, plan, float_out)
        if plan.data.get("one_value_guard", False):
            # y is 0 where the softmax normalises one value: QuantizeLinear gives the zero point there
            # (0 / y_scale rounds to 0), in float before it, so the quantization stays one
            # QuantizeLinear a target's float emulation or Q/DQ fusion recognises.
            if options["length_check"] == "softmax":
                y = emit.op1("Mul", [y, _more_than_one(emit, site, attrs, floats[0], plan)])
            else:
                y = _zero_over_one_value(emit, floats[0], attrs, y)
        if out_scale is not None:
            zp = out_zp if out_zp is not None else np.zeros((), _NP[out_dtype])
            emit.op1(
                "QuantizeLinear",
                [y, emit.const(out_scale.reshape(())), emit.const(zp.reshape(()))],
                site.node.output[0],
            )


# ---------------------------------------------------------------------------------------- reading


def _dtype(site: Site, x_index: int, zp_index: int) -> str:
    zp = site.constant(site.input(zp_index))
    if zp is not None:
        return str(zp.dtype)
    elem = site.elem_type(site.input(x_index))
    if elem is None:
        raise NoMatch(f"the type of {site.input(x_index)!r} is not recorded (no value_info and no zero point)")
    return dtype_name(elem)


def _read_attributes(site: Site, op: str) -> dict[str, Any]:
    known = _ATTRIBUTES[op]
    out: dict[str, Any] = {}
    for attr in site.node.attribute:
        if attr.name not in known:
            raise NoMatch(f"malformed node: unknown attribute {attr.name!r} for {op}")
        out[attr.name] = onnx.helper.get_attribute_value(attr)
    for name, default in known.items():
        if default is not None:
            out.setdefault(name, default)
    return out


def _concat_count(site: Site) -> int:
    n = len(site.node.input) - 2
    if n < 3 or n % 3:
        raise NoMatch(f"malformed node: QLinearConcat takes Y_scale, Y_zero_point and triples, got {n + 2} inputs")
    return n // 3


def _constant_param(site: Site, index: int, what: str) -> np.ndarray | None:
    name = site.input(index)
    if not name:
        return None
    value = site.constant(name)
    if value is None:
        raise NoMatch(f"{what} {name!r} is computed at run time; only constant quantization parameters are rewritten")
    return np.asarray(value)


def _read_operand(site: Site, o: _Operand) -> tuple[str, _Param, np.ndarray | None, str]:
    """(x, scale, zero point or None, dtype) of one quantized input."""
    x = site.input(o.x)
    if not x:
        raise NoMatch(f"malformed node: quantized input {o.x} is missing")
    scale = _constant_param(site, o.scale, "scale")
    if scale is None:
        raise NoMatch(f"malformed node: the scale of input {x!r} is missing")
    if scale.dtype != np.float32:
        raise NoMatch(f"scale {site.input(o.scale)!r} is {scale.dtype}; only float32 scales are rewritten")
    zp = _constant_param(site, o.zero_point, "zero point")
    dtype = str(zp.dtype) if zp is not None else _dtype(site, o.x, o.zero_point)
    if dtype not in _RANGES:
        raise NoMatch(f"input {x!r} is {dtype}; the QOperator kernels take uint8 and int8")
    if zp is not None and zp.size not in (scale.size, 1):
        raise NoMatch(f"malformed node: scale and zero point of {x!r} have {scale.size} and {zp.size} elements")
    if scale.size > 1 and scale.ndim != 1:
        raise NoMatch(f"malformed node: the per-channel scale of {x!r} must be 1-D, not of shape {scale.shape}")
    return x, _Param(site.input(o.scale), scale), zp, dtype


def _read_output(site: Site, spec: _Spec, default_dtype: str) -> tuple[np.ndarray | None, np.ndarray | None, str]:
    scale = _constant_param(site, spec.out_scale, "output scale")
    zp = _constant_param(site, spec.out_zero_point, "output zero point")
    if scale is None:
        if site.node.op_type != "QGemm":
            raise NoMatch("malformed node: the output scale is missing")
        if zp is not None:
            raise NoMatch("malformed node: QGemm has y_zero_point without y_scale")
        return None, None, "float32"
    if scale.size != 1 or (zp is not None and zp.size != 1):
        raise NoMatch("the output scale and zero point must have one element (onnxruntime's kernels require it)")
    if scale.dtype != np.float32:
        raise NoMatch(f"output scale is {scale.dtype}; only float32 scales are rewritten")
    dtype = str(zp.dtype) if zp is not None else default_dtype
    if dtype not in _RANGES:
        raise NoMatch(f"the output type {dtype} is not uint8 or int8")
    return scale, zp, dtype


# ------------------------------------------------------------------------------------ the bounds


def _rank(site: Site, name: str) -> int | None:
    shape = value_shape(site.scope, name, site.same_shape_ops)
    return None if shape is None else len(shape)


def _dim(site: Site, name: str, axis: int) -> int | None:
    shape = value_shape(site.scope, name, site.same_shape_ops)
    if shape is None or not -len(shape) <= axis < len(shape):
        return None
    return shape[axis]


def _accumulation_bound(
    site: Site, op: str, attrs: dict[str, Any], inputs: list, out: tuple, options: Mapping[str, Any]
) -> tuple[float | None, str, float, str | None]:
    """The bound of an integer-accumulating op: ``floor(d) + 1`` steps (float output: ``d`` units),
    the part of it that only onnxruntime's u8 x s8 pair saturation uses (``Plan.bound_u8s8``), and
    the formula ``verify`` evaluates where the bound is a function of a reduction length known only
    at run time (then no scalar bound: :func:`_run_time_operands_bound`)."""
    (a, a_scale, a_zp, a_dtype), (b, b_scale, b_zp, b_dtype) = inputs
    if a_scale.value.size != 1:
        raise NoMatch(f"{op}: the scale of input {a!r} must have one element (onnxruntime's kernel requires it)")
    lo, hi = _RANGES[a_dtype]
    a_zero = int(a_zp.reshape(-1)[0]) if a_zp is not None else 0
    a_max = max(hi - a_zero, a_zero - lo)
    weights = site.constant(b)
    if weights is None:
        if op != "QLinearMatMul":
            raise NoMatch(f"{op}: the weights {b!r} are computed at run time")
        return _run_time_operands_bound(site, inputs, out, options, a_max)
    # Per output channel: sum over the reduction of |w - zw| (the weights' L1 norms).
    if op == "QLinearConv":
        reduce_axes: tuple[int, ...] = tuple(range(1, weights.ndim))
        channel_axis = 0
    elif op == "QGemm":
        channel_axis = 0 if attrs.get("transB") else 1
        reduce_axes = (1 - channel_axis,)
    else:
        channel_axis = -1
        reduce_axes = (-2,)
    w = weights.astype(np.int64)
    zw = (b_zp if b_zp is not None else np.zeros(1, np.int64)).astype(np.int64).reshape(-1)
    n_channels = w.shape[channel_axis]
    shape = [1] * w.ndim
    shape[channel_axis] = n_channels
    centred = np.abs(w - (zw.reshape(shape) if zw.size > 1 else zw[0]))
    l1 = centred.sum(axis=tuple(ax % w.ndim for ax in reduce_axes))
    while l1.ndim > 1:  # batched MatMul weights: the worst batch
        l1 = l1.max(axis=0)
    k = int(np.prod([w.shape[ax] for ax in reduce_axes]))
    excess = _pair_excess(op, weights, channel_axis, a_dtype, b_dtype)
    at_risk = bool(excess.max(initial=0) > 0)
    _saturation(options, at_risk, bounded=True)
    if at_risk and options["u8s8_saturation"] == "decline":
        raise NoMatch(
            f"uint8 activations x int8 weights {b!r}: onnxruntime's kernel on x86 CPUs without AVX-VNNI saturates "
            f"pairs of products to int16 and can here (up to {int(excess.max())} per element): the rule with "
            "u8s8_saturation = 'bound' takes it"
        )
    alpha = float(attrs.get("alpha", 1.0))
    a_s = float(a_scale.value.reshape(-1)[0])
    b_scales = b_scale.value.astype(np.float64).reshape(-1)
    terms = float(np.max(abs(alpha) * a_s * b_scales * l1 * a_max)) if l1.size else 0.0
    bias_input = site.input(_BIAS.get(op, -1)) if op in _BIAS else ""
    if bias_input:
        bias = site.constant(bias_input)
        if bias is None:
            raise NoMatch(f"the int32 bias {bias_input!r} is computed at run time; only a constant bias is rewritten")
        if op == "QGemm" and b_scales.size > 1 and bias.ndim == 2 and bias.shape[1] == 1 and bias.shape[0] != 1:
            raise NoMatch("QGemm: a bias of shape (M, 1) with per-column scales is not rewritten")
        terms += (
            float(np.max(np.abs(bias.astype(np.float64)), initial=0.0)) * float(np.max(b_scales)) * a_s * abs(alpha)
        )
    error = summation_error_bound(k + 4) * terms
    # onnxruntime's int16 pair saturation, in the output's units: each column's excess times its scale.
    saturation = float(np.max(abs(alpha) * a_s * b_scales * excess, initial=0.0)) if excess.any() else 0.0
    note = f" (+ up to {saturation:.3g} from onnxruntime's u8 x s8 int16 pair saturation)" if saturation else ""
    out_scale = out[0]
    if out_scale is None:  # QGemm with float output: the bound in the output's units
        own = error + 4 * _U * terms
        bound = own + saturation * (1 + 4 * _U)
        part = bound - own
        while part > 0 and bound - part < own:  # verify's bound - part must not round below own
            part = math.nextafter(part, 0.0)
        return bound, f"float output, accumulation of {k} products bounded by {bound:.3g}{note}", part, None
    step = float(out_scale.reshape(-1)[0])
    d = (error + saturation * (1 + 4 * _U)) / step
    steps = math.floor(d) + 1
    return (
        float(steps),
        f"accumulation of {k} products: at most {d:.2g} of a step before rounding, bound {steps}{note}",
        float(steps - (math.floor(error / step) + 1)),
        None,
    )


def run_time_k_steps(k: int, per_k: float) -> float:
    """The bound, in steps, of a QLinearMatMul both of whose operands are computed at run time, for
    reduction length ``k``: ``floor(d) + 1`` with ``d = gamma(k + 4) · k · per_k`` (the float32
    summation bound of ``k`` products each at most ``per_k`` steps). The rule computes it where ``k``
    is recorded; ``verify`` evaluates the same function at each sample's ``k`` where it is not
    (:mod:`onnx_qrewrite.verify.element_bounds`, formula ``run-time-k``). Infinite from
    ``k + 4 >= 2^24`` on, where float32 summation has no relative bound."""
    d = summation_error_bound(k + 4) * k * per_k
    return float(math.floor(d) + 1) if math.isfinite(d) else math.inf


def _one_step_limit(per_k: float) -> int:
    """The largest reduction length whose bound is one step (run_time_k_steps increases with k, and
    is finite below 2^24 - 4)."""
    if run_time_k_steps(1, per_k) > 1:
        return 0
    low, high = 1, (1 << 24) - 5
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if run_time_k_steps(mid, per_k) <= 1 else (low, mid - 1)
    return low


def _run_time_operands_bound(
    site: Site, inputs: list, out: tuple, options: Mapping[str, Any], a_max: int
) -> tuple[float | None, str, float, str | None]:
    """QLinearMatMul of two run-time operands (attention's scores and context): each product is at
    most ``a_max · max|b - zb|`` integer units, so ``d = gamma(K + 4) · K · per_k``, ``per_k`` that
    product in output steps, whatever the values. With K recorded, the bound at K. With K not
    recorded (a symbolic sequence length, or a shape onnx's inference does not reach) and option
    ``reduction_length = 'run-time'``, no scalar bound: the formula ``run-time-k:<per_k>``, which
    ``verify`` evaluates at each sample's K, at the node's own output, as this function computes it
    for a recorded K; with ``'recorded'``, the rule declines."""
    (a, a_scale, _, a_dtype), (b, b_scale, b_zp, b_dtype) = inputs
    k_dim = _dim(site, b, -2) if (_rank(site, b) or 0) >= 2 else _dim(site, a, -1)
    if k_dim is None and options["u8s8_saturation"] == "ignore":
        # An approximate rule keeps no bound (check() drops it), so K is not needed.
        return None, f"reduction length of {site.label} known only at run time: approximate, no bound", 0.0, None
    if k_dim is None and options["reduction_length"] != RUN_TIME:
        if _rank(site, b) is not None:  # the shape is recorded, the dimension is symbolic
            raise NoMatch(
                f"the reduction length of {site.label} (a dimension of {b!r}) is not fixed in the model, and "
                f"the bound on float32 accumulation grows with it ({_FIX_DIMS}; reduction_length = 'run-time' "
                "bounds it at run time instead)"
            )
        raise NoMatch(
            f"the reduction length of {site.label} is not recorded in the model; run onnx shape inference "
            f"first, or, where it stops at com.microsoft ops, {_FIX_DIMS}"
        )
    at_risk = b_dtype == "int8" and a_dtype == "uint8"
    _saturation(options, at_risk, bounded=False)
    if at_risk and options["u8s8_saturation"] != "ignore":
        raise NoMatch(
            "uint8 x int8 weights computed at run time: onnxruntime's kernel on x86 CPUs without AVX-VNNI may "
            "saturate pairs of products to int16, and no useful bound on that can be computed from the types"
        )
    blo, bhi = _RANGES[b_dtype]
    zb = b_zp.reshape(-1).astype(np.int64) if b_zp is not None else np.zeros(1, np.int64)
    b_max = max(bhi - int(zb.min()), int(zb.max()) - blo)
    a_s = float(a_scale.value.reshape(-1)[0])
    b_s = float(np.max(b_scale.value.astype(np.float64)))
    per_k = a_s * b_s * b_max * a_max / float(out[0].reshape(-1)[0])
    if k_dim is not None:
        steps = run_time_k_steps(k_dim, per_k)
        if not math.isfinite(steps):
            raise NoMatch(f"{site.label} sums {k_dim} products: float32 accumulation has no bound at that length")
        d = summation_error_bound(k_dim + 4) * k_dim * per_k
        note = f"accumulation of {k_dim} products: at most {d:.2g} of a step before rounding, bound {steps:g}"
        return steps, note, 0.0, None
    limit = _one_step_limit(per_k)
    note = (
        f"accumulation of K products, K (the reduction length) known only at run time: the bound depends on K, "
        f"floor(gamma(K + 4)·K·{per_k:.3g}) + 1 steps (one step up to K = {limit}), which verify evaluates at "
        "each sample's K"
    )
    return None, note, 0.0, f"{RUN_TIME_K_FORMULA}:{per_k!r}"


def _saturation(options: Mapping[str, Any], at_risk: bool, *, bounded: bool) -> None:
    """The approximate form ('ignore') is only for nodes no bounded rule can take: saturation
    possible and no bound computable (weights at run time)."""
    if options["u8s8_saturation"] == "ignore" and not (at_risk and not bounded):
        raise NoMatch(
            "no int16 saturation is possible here: the bounded rule applies"
            if not at_risk
            else "the pair saturation is bounded from the constant weights here: the bounded rule applies"
        )


def _pair_excess(op: str, weights: np.ndarray, channel_axis: int, a_dtype: str, b_dtype: str) -> np.ndarray:
    """Per output column/channel (the scales' axis): the most onnxruntime's uint8 x int8 kernel can
    differ from the exact integer sum by int16 pair saturation (u8s8.py), 0 for other types.
    QLinearMatMul and QGemm: MLAS's GEMM pairs (k = 2j, 2j+1), measured. QLinearConv may take MLAS's
    symmetric convolution kernels, which pair input channels per kernel position: the bound for any
    pairing (sorted pairs) is used there."""
    if not u8s8.saturating_operands(a_dtype, b_dtype, conv=False):
        return np.zeros(1)
    w = np.moveaxis(weights, channel_axis, -1)  # [..., K..., channel]
    if op == "QLinearMatMul" and weights.ndim > 2:  # batched: per (batch, column), the worst batch
        rows = np.moveaxis(weights, -2, -1).reshape(-1, weights.shape[-2])
        return u8s8.pair_excess(rows, "int8").reshape(-1, weights.shape[-1]).max(axis=0).astype(np.float64)
    rows = w.reshape(-1, w.shape[-1]).T  # [channel, K]
    return u8s8.pair_excess(rows, "int8", any_pairing=op == "QLinearConv").astype(np.float64)


#: onnxruntime 1.31.1's uint8 QLinearSoftmax over a single value (where softmax is 1) returns 0
#: once floor(1 / y_scale) exceeds this (zero point 0: 148 -> 148, 149 -> 0, 256 -> 0), instead of
#: min(255, 1 / y_scale). Measured (tests/test_lower_qoperator.py); the int8 kernel is right there.
_UINT8_SOFTMAX_OF_ONE_LIMIT = 148


def _softmax_length(site: Site, attrs: dict[str, Any], x: str) -> int | None:
    """How many values each softmax normalises, where the recorded shape says (None: unknown)."""
    shape = value_shape(site.scope, x, site.same_shape_ops)
    if shape is None:
        return None
    legacy = int(attrs["opset"]) < kernel_opsets.OP_VERSIONS["softmax-single-axis"]
    axis = int(attrs.get("axis", 1 if legacy else -1))
    if not -len(shape) <= axis < len(shape):
        return None
    dims = shape[axis:] if legacy else (shape[axis],)  # opset < 13: flattened from axis on
    return None if any(d is None for d in dims) else math.prod(d for d in dims if d is not None)


def _softmax_check(site: Site, attrs: dict[str, Any], inputs: list, out: tuple) -> tuple[float, str, bool]:
    """The bound, the note, and whether the replacement must give the zero point where the softmax
    axis has length 1 at run time (onnxruntime's uint8 kernel does, measured; the length is not
    recorded, so the replacement checks it)."""
    if "opset" not in attrs:
        raise NoMatch("malformed node: QLinearSoftmax needs its 'opset' attribute (onnxruntime requires it)")
    y_scale = out[0]
    inverse = np.float32(1.0) / y_scale.reshape(-1)[0].astype(np.float32)  # in float32, as the kernel
    multiplier = math.floor(inverse)
    integral = float(inverse) == multiplier
    bound = 1.0 if integral else 2.0
    note = f"kernel multiplies by floor(1/y_scale) = {multiplier}{'' if integral else ' (not 1/y_scale)'}"
    if inputs[0][3] == "uint8" and multiplier > _UINT8_SOFTMAX_OF_ONE_LIMIT:
        length = _softmax_length(site, attrs, inputs[0][0])
        if length == 1:
            raise NoMatch(
                f"uint8 softmax over 1 value with 1/y_scale = {multiplier}: onnxruntime's kernel gives 0 "
                f"there (1/y_scale above {_UINT8_SOFTMAX_OF_ONE_LIMIT}, measured), not the softmax's 1"
            )
        if length is None:
            note += (
                "; where the softmax axis has length 1 at run time, onnxruntime's uint8 kernel gives the zero "
                "point, not 1: so does the replacement (it checks the length)"
            )
            return bound, note, True
    return bound, note, False


# ------------------------------------------------------------------------------------ building


def _dequantize(emit: Emitter, site: Site, op: str, index: int, operand: tuple) -> str:
    x, scale, zp, _ = operand
    attrs: dict[str, Any] = {}
    if scale.value.size > 1:
        if op == "QLinearConv":
            axis = 0
        elif op == "QGemm":
            axis = 0 if emit_attr(site, "transB", 0) else 1
        else:
            rank = _rank(site, x)
            axis = rank - 1 if rank is not None else -1
        attrs["axis"] = axis
        s = emit.const(scale.value.reshape(-1))
        z = emit.const(np.broadcast_to(zp.reshape(-1), scale.value.shape).copy()) if zp is not None else ""
    else:
        s = emit.const(scale.value.reshape(()))
        z = emit.const(zp.reshape(())) if zp is not None else ""
    return emit.op1("DequantizeLinear", [x, s] + ([z] if z else []), hint=f"dq{index}", **attrs)


def emit_attr(site: Site, name: str, default: Any) -> Any:
    return site.attribute(name, default)


def _bias(emit: Emitter, site: Site, index: int, scale: np.ndarray, n_channels_axis: int | None) -> str:
    """An int32 bias dequantized with ``scale`` (a_scale * b_scale [* alpha]), as the QDQ form has it."""
    name = site.input(index)
    bias = site.constant(name)
    assert bias is not None  # checked
    attrs: dict[str, Any] = {}
    if scale.size > 1:
        if bias.ndim == 0 or bias.size == 1:
            # One bias for every column, scaled per column: fold it (it is a constant).
            return emit.const((bias.astype(np.float32).reshape(()) * scale.reshape(-1)).astype(np.float32))
        attrs["axis"] = n_channels_axis if bias.ndim > 1 else 0
        s = emit.const(scale.reshape(-1))
    else:
        s = emit.const(scale.reshape(()))
    return emit.op1("DequantizeLinear", [name, s], hint="dq_bias", **attrs)


def _scale_product(inputs: list, alpha: float = 1.0) -> np.ndarray:
    a_scale = inputs[0][1].value.reshape(-1)[0]
    b_scale = inputs[1][1].value.reshape(-1)
    product = (a_scale * b_scale).astype(np.float32)
    return (product * np.float32(alpha)).astype(np.float32) if alpha != 1.0 else product


def _conv(emit, site, attrs, floats, plan, out):
    """Conv; com.microsoft's channels_last = 1 (x and y channels-last, the weights OIHW as ever, as
    onnxruntime's NHWC optimizer writes them) through a Transpose on each side."""
    inputs = list(floats)
    if site.input(8):
        inputs.append(_bias(emit, site, 8, _scale_product(plan.data["inputs"]), None))
    conv_attrs = {k: v for k, v in attrs.items() if k != "channels_last" and v is not None}
    if not attrs["channels_last"]:
        return emit.op1("Conv", inputs, out, **conv_attrs)
    rank = plan.data["rank"]
    y = emit.op1("Conv", [_nhwc(emit, inputs[0], rank, False), *inputs[1:]], **conv_attrs)
    return emit.op1("Transpose", [y], out, perm=[0, *range(2, rank), 1])


def _gemm(emit, site, attrs, floats, plan, out):
    alpha = float(attrs["alpha"])
    inputs = list(floats)
    if site.input(6):
        scale = _scale_product(plan.data["inputs"], alpha)
        inputs.append(_bias(emit, site, 6, scale, 1))
    return emit.op1(
        "Gemm", inputs, out, alpha=alpha, beta=1.0, transA=int(attrs["transA"]), transB=int(attrs["transB"])
    )


def _nhwc(emit: Emitter, x: str, rank: int, to_channels_last: bool) -> str:
    perm = [0, *range(2, rank), 1] if to_channels_last else [0, rank - 1, *range(1, rank - 1)]
    return emit.op1("Transpose", [x], perm=perm)


def _channels_last_rank(site: Site, attrs: dict[str, Any]) -> int:
    """The rank a channels_last pooling or QLinearConv transposes over: recorded for its input or
    output, given by its kernel_shape (or QLinearConv's constant weights), or by the kernel_shape of
    the op writing its input. Checked while planning: raised while building, the NoMatch escaped as
    an internal error (exit 5) on onnxruntime's own NHWC-optimized models, whose com.microsoft
    producers onnx shape inference cannot see through."""
    rank = _rank(site, site.input(0)) or _rank(site, site.node.output[0])
    if rank is None and attrs.get("kernel_shape"):
        rank = len(attrs["kernel_shape"]) + 2
    weights = site.constant(site.input(3)) if site.node.op_type == "QLinearConv" else None
    if rank is None and weights is not None:
        rank = weights.ndim
    if rank is None:
        rank = _windowed_rank(site.scope.producer(site.input(0)))
    if rank is None:
        raise NoMatch(
            f"channels_last {'QLinearConv' if weights is not None else 'pooling'} needs the rank of "
            f"{site.input(0)!r}, which the model does not record (a value_info; onnx shape inference does not infer "
            "through com.microsoft ops)"
        )
    return rank


#: Ops whose output has the rank len(kernel_shape) + 2 (the input's), in either layout.
_WINDOWED = frozenset({"Conv", "MaxPool", "AveragePool", "QLinearConv", "QLinearAveragePool", "NhwcMaxPool"})


def _windowed_rank(producer: onnx.NodeProto | None) -> int | None:
    """The rank of a convolution's or pooling's output, from its kernel_shape (onnxruntime's NHWC
    region: a channels_last pooling reads NhwcMaxPool or QLinearConv, which shape inference cannot
    see through)."""
    if producer is None or producer.op_type not in _WINDOWED:
        return None
    kernel = next((a.ints for a in producer.attribute if a.name == "kernel_shape"), None)
    return len(kernel) + 2 if kernel else None


def _pool(emit, site, attrs, floats, plan, out):
    op = "AveragePool" if site.node.op_type == "QLinearAveragePool" else "GlobalAveragePool"
    pool_attrs = {k: v for k, v in attrs.items() if k != "channels_last" and v is not None}
    x = floats[0]
    if not attrs["channels_last"]:
        return emit.op1(op, [x], out, **pool_attrs)
    rank = plan.data["rank"]
    y = emit.op1(op, [_nhwc(emit, x, rank, False)], **pool_attrs)
    return emit.op1("Transpose", [y], out, perm=[0, *range(2, rank), 1])


def _softmax(emit, site, attrs, floats, plan, out):
    legacy = int(attrs["opset"]) < kernel_opsets.OP_VERSIONS["softmax-single-axis"]
    axis = attrs.get("axis", 1 if legacy else -1)
    if not legacy:
        return emit.op1("Softmax", floats, out, axis=int(axis))
    # Opset < 13 semantics: softmax over the input flattened from `axis` on.
    flat = emit.op1("Flatten", floats, axis=int(axis))
    y = emit.op1("Softmax", [flat], axis=1)
    return emit.op1("Reshape", [y, emit.op1("Shape", floats)], out)


def _zero_over_one_value(emit: Emitter, x: str, attrs: dict[str, Any], y: str) -> str:
    """0 where the softmax normalises one value, else ``y`` (the float softmax): quantized, the
    zero point there, what onnxruntime's uint8 QLinearSoftmax gives once floor(1/y_scale) exceeds
    _UINT8_SOFTMAX_OF_ONE_LIMIT (measured for zero points 0, 10 and 200)."""
    legacy = int(attrs["opset"]) < kernel_opsets.OP_VERSIONS["softmax-single-axis"]
    axis = int(attrs.get("axis", 1 if legacy else -1))
    if legacy:  # softmax over the input flattened from `axis` on: the flattened length
        shape, index = emit.op1("Shape", [emit.op1("Flatten", [x], axis=axis)]), 1
    else:
        shape, index = emit.op1("Shape", [x]), axis
    length = emit.op1("Gather", [shape, emit.const(np.asarray(index, np.int64))], axis=0)
    one = emit.op1("Equal", [length, emit.const(np.asarray(1, np.int64))])
    return emit.op1("Where", [one, emit.const(np.asarray(0, np.float32)), y])


def _more_than_one(emit: Emitter, site: Site, attrs: dict[str, Any], x: str, plan: Plan) -> str:
    """1 where the softmax normalises more than one value, 0 where it normalises one, without Shape
    (which NNAPI refuses): a softmax of zeros is exactly 1 over one value (exp(0) / exp(0)) and
    1/L <= 1/2 over L >= 2, so Min(4·(1 - s), 1) is 0 or 1 even where exp is approximate. The zeros
    are x·0 (x is dequantized with a finite scale, so finite), sliced to one element along every
    axis the softmax does not normalise when the rank is recorded (the check then costs one row)."""
    legacy = int(attrs["opset"]) < kernel_opsets.OP_VERSIONS["softmax-single-axis"]
    axis = int(attrs.get("axis", 1 if legacy else -1))
    rank = _rank(site, site.input(0))
    if rank is not None and -rank <= axis < rank:
        axis %= rank
        others = list(range(axis)) if legacy else [a for a in range(rank) if a != axis]
        if others:
            ints = np.zeros(len(others), np.int64)
            x = emit.op1("Slice", [x, emit.const(ints), emit.const(ints + 1), emit.const(np.asarray(others, np.int64))])
    zeros = emit.op1("Mul", [x, emit.const(np.asarray(0, np.float32))])
    s = _softmax(emit, site, attrs, [zeros], plan, None)
    four = emit.op1(
        "Mul", [emit.op1("Sub", [emit.const(np.asarray(1, np.float32)), s]), emit.const(np.asarray(4, np.float32))]
    )
    return emit.op1("Min", [four, emit.const(np.asarray(1, np.float32))])


def _simple(op: str, **fixed: Any) -> Callable:
    def build(emit, site, attrs, floats, plan, out):
        return emit.op1(op, floats, out, **{**{k: v for k, v in attrs.items() if v is not None}, **fixed})

    return build


_FLOAT_OPS: dict[str, Callable[..., str]] = {
    "QLinearConv": _conv,
    "QLinearMatMul": _simple("MatMul"),
    "QGemm": _gemm,
    "QLinearAdd": _simple("Add"),
    "QLinearMul": _simple("Mul"),
    "QLinearConcat": _simple("Concat"),
    "QLinearAveragePool": _pool,
    "QLinearGlobalAveragePool": _pool,
    "QLinearLeakyRelu": _simple("LeakyRelu"),
    "QLinearSigmoid": _simple("Sigmoid"),
    "QLinearSoftmax": _softmax,
}


register(QOperatorBuilder())
