"""onnxruntime's ``com.microsoft`` fusions -> the standard ops they fuse, so that ORT-optimized and
neural-compressor models run elsewhere. Each form was measured bit for bit against onnxruntime
1.31.1's CPU kernel (tests/test_unfuse_contrib.py)::

    Gelu(x)            -> Mul(Mul(x, 0.5), Add(Erf(Mul(x, 1/sqrt(2))), 1))                exact
    BiasGelu(x, b)     -> the same on Add(x, b)                                             exact
    QuickGelu(x)       -> Mul(x, Sigmoid(Mul(x, alpha)))                                    exact
    FastGelu(x[, b])   -> Gelu(Add(x, b), approximate="tanh")            (opset 20)         exact
                       -> Mul(Mul(x, 0.5), Add(Tanh(Mul(x, x*x*kC + kB)), 1))  (below 20)   bounded
    FusedGemm          -> Gemm + the activation op                                          exact
    FusedConv(x, w[, b])  -> Conv(x, w[, b]) + the activation op                           exact
    FusedConv(x, w, [b], z) -> Add(Conv(x, w), z) [+ b] + the activation op                 bounded
    FusedMatMul        -> [Transpose] + MatMul [+ Mul(alpha)]            exact when alpha = 1 and not transA
                          (transBatchA/B: a Transpose moving axis 0 behind the batch axes)
    SkipLayerNormalization(x, s, g[, beta, bias]) -> Add(Add(x, s), bias) + LayerNormalization   bounded
                       (its Mean and InvStdDev outputs as the kernel's mean / inv_std_var)
    SkipSimplifiedLayerNormalization -> Add + RMSNormalization (opset 23)                   bounded
                                     -> Add + Mul/ReduceMean/Add/Sqrt/Div/Mul (below 23, or with
                                        mean (0, as the kernel) / inv_std_var (1 / Sqrt) read)
    SimplifiedLayerNormalization     -> RMSNormalization (opset 23)                         exact
                                     -> Mul/ReduceMean/Add/Sqrt/Div/Mul (below 23, or with
                                        inv_std_var read)                                   bounded
    BiasAdd(x, bias, skip) -> Add(Add(x, bias), skip)       exact (read from the CUDA kernel, below)

Where not exact, and why: FastGelu's kernel evaluates the tanh polynomial with roundings no
sequence of standard float ops reproduces below opset 20 (within a few ulp); the Skip*
normalizations sum sequentially in float32 inside the kernel (SkipLayerNormalization: Welford's
running mean and M2, which drift with a row's mean against its spread; the simplified form: the sum
of squares), LayerNormalization/RMSNormalization/ReduceMean with vectorised reductions; FusedMatMul
with transA or alpha != 1 lets MLAS transpose A while packing and apply alpha per K panel, a
MatMul on a transposed copy followed by Mul does not. FusedConv with a sum input Z: onnxruntime
1.31.1's ``Conv<float>`` (``core/providers/cpu/nn/conv.cc``) copies Z into the output and calls MLAS
with Beta = 1, so Z is the first term of the float32 accumulation (``MlasConvOperation`` adds each K
panel's GEMM into the output; a group with one filter takes the M = 1 kernel, which adds the products
into Z one at a time), and ``MlasActivation`` adds the bias with the activation; the rewrite adds Z to
the finished convolution (bit-exact only where K fits one panel and a group has several filters;
measured: a 64 -> 64 3x3 conv differs in 210 of 1600 outputs, every depthwise one). Its bound is per
element (``fused-conv-sum``, ``onnx_qrewrite.verify.element_bounds``). All of these differ only in float32 rounding
of the same computation.

BiasAdd has no CPU kernel in onnxruntime (CUDA only), so it is lowered from the kernel's source,
not measured: microsoft/onnxruntime ``onnxruntime/contrib_ops/cuda/diffusion/bias_add_impl.cu`` at
4bd17315afbac8992997fbe811abf83377ac6e7c computes ``output = input + bias + residual`` for ``T``
float and half, i.e. ``(input + bias) + residual`` with one rounding to ``T`` after each addition.
For half that is cuda_fp16's ``operator+`` (``__hadd``, a half result): onnxruntime's CUDA build
(``cmake/onnxruntime_providers_cuda.cmake`` at 00a744151b567ee30d4d6418e47030d018dcae42) does not
define ``__CUDA_NO_HALF_OPERATORS__``, and its kernels rely on those operators (e.g.
``contrib_ops/cuda/bert/add_bias_transpose.cu`` adds ``half2`` values with ``+``); the kernel does
not accumulate in float. A half sum of two halves is the same computed in half or in float and
rounded (float's 24 bits are at least 2·11 + 2), so numpy's float16 addition evaluates it.
``bias_add.cc`` at 38b55301b3b2141a7a2657b02f1a6bad28a16232 checks the shapes: input (N, S, C)
with C 320, 640 or 1280, bias (C), skip the input's shape. The schema (``diffusion_defs.cc`` at
113bbbe525b524d7d6319e1d309c3ee871a6142e): "Add input with bias, then add residual inputs", T
float or float16.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx

from onnx_qrewrite.rewriter import kernel_opsets
from onnx_qrewrite.rewriter.builders import Emitter, NoMatch, Plan, Site, register
from onnx_qrewrite.rewriter.builders._float_inputs import no_float16_kernel, unknown_type
from onnx_qrewrite.rewriter.builders.contracts import (
    CONTRACTS,
    FAST_GELU_FORMULA,
    FUSED_ACTIVATIONS,
    FUSED_CONV_SUM_FORMULA,
    FUSED_MATMUL_FORMULA,
    LAYER_NORM_FORMULA,
    gelu_opset,
    normalization_opset,
)
from onnx_qrewrite.rewriter.graph import dtype_name

__all__ = [
    "ActivationBuilder",
    "BiasAddBuilder",
    "FusedGemmConvBuilder",
    "FusedMatMulBuilder",
    "NormalizationBuilder",
    "matmul_operand_perm",
]

_T = onnx.TensorProto
#: What onnxruntime's CPU kernels for these ops take (float16 kernels run in float32 and round).
_FLOAT = (_T.FLOAT,)


def _float_only(site: Site, *names: str) -> None:
    """Each named input is float32, known to be: an unknown type is refused, not assumed (the
    builders emit float32 constants, which a float16 input would clash with)."""
    for name in names:
        elem = site.value_type(name) if name else _FLOAT[0]
        if elem is None:
            raise unknown_type(name)
        if elem == _T.FLOAT16:
            raise no_float16_kernel(name)
        if elem not in _FLOAT:
            raise NoMatch(f"{name!r} is {dtype_name(elem)}; only float32 was measured")


def _float_type(site: Site) -> str | None:
    elem = site.elem_type(site.input(0))
    return dtype_name(elem) if elem else None


# --- Gelu family ---------------------------------------------------------------------------------

#: FastGelu's constants, as the kernel has them: sqrt(2 / pi) and 0.044715 * sqrt(2 / pi).
_KB = np.float32(0.7978845608028654)
_KC = np.float32(0.044715 * 0.7978845608028654)


class ActivationBuilder:
    """Replaces com.microsoft Gelu, BiasGelu, QuickGelu and FastGelu with standard elementwise ops."""

    name = "unfuse_activation"
    contract = CONTRACTS["unfuse_activation"]

    def quantized_dtype(self, site: Site) -> str | None:
        return _float_type(site)

    def check(self, site: Site, options: Mapping[str, Any]) -> Plan:
        form = options["form"]
        site.no_unknown_attributes({"alpha"} if form == "quick_gelu" else set())
        _float_only(site, *site.node.input)
        if len(site.node.output) != 1:
            raise NoMatch("malformed node: one output expected")
        inputs = [i for i in site.node.input if i]
        wanted = {"gelu": 1, "bias_gelu": 2, "quick_gelu": 1}.get(form)
        if (wanted is not None and len(inputs) != wanted) or not 1 <= len(inputs) <= 2:
            raise NoMatch(f"malformed node: {len(inputs)} inputs")
        if form == "fast_gelu_standard":
            return Plan(min_opset=gelu_opset(form), bound=None)
        # A decomposed FastGelu's bound, 2^-21·(|x| + 1), is per element: verify evaluates it at the node.
        return Plan(
            min_opset=gelu_opset(form), bound_formula=FAST_GELU_FORMULA if form == "fast_gelu_decomposed" else None
        )

    def build(self, site: Site, emit: Emitter, options: Mapping[str, Any], plan: Plan) -> None:
        form, y = options["form"], site.node.output[0]
        x = site.input(0)
        if site.input(1):
            x = emit.op1("Add", [x, site.input(1)], hint="AddBias")
        if form == "quick_gelu":
            alpha = np.float32(site.attribute("alpha", 1.702))
            emit.op1("Mul", [x, emit.op1("Sigmoid", [emit.op1("Mul", [x, emit.const(alpha)])])], y)
            return
        if form == "fast_gelu_standard":
            emit.op1("Gelu", [x], y, approximate="tanh")
            return
        if form == "fast_gelu_decomposed":
            poly = emit.op1("Add", [emit.op1("Mul", [emit.op1("Mul", [x, x]), emit.const(_KC)]), emit.const(_KB)])
            inner = emit.op1("Tanh", [emit.op1("Mul", [x, poly])])
        else:  # erf GELU, as the kernel: x * M_SQRT1_2, erf, 0.5 * x * (erf + 1)
            inner = emit.op1("Erf", [emit.op1("Mul", [x, emit.const(np.float32(math.sqrt(0.5)))])])
        half_x = emit.op1("Mul", [x, emit.const(np.float32(0.5))])
        emit.op1("Mul", [half_x, emit.op1("Add", [inner, emit.const(np.float32(1.0))])], y)


register(ActivationBuilder())


# --- BiasAdd -------------------------------------------------------------------------------------

#: BiasAdd's T (com.microsoft schema, diffusion_defs.cc): float and float16; Add's kernels take both.
_BIAS_ADD_TYPES = (_T.FLOAT, _T.FLOAT16)


def _bias_add_shapes(
    x: tuple[int | None, ...] | None, bias: tuple[int | None, ...] | None, skip: tuple[int | None, ...] | None
) -> str | None:
    """Why the recorded shapes are not the kernel's (input (N, S, C), bias (C), skip as input), or
    None. Unknown shapes and dimensions pass: where a model leaves them unrecorded and they turn
    out otherwise at run time, the kernel fails and the Adds broadcast (rules/80-contrib-fusions.toml
    says so)."""

    def agree(a: int | None, b: int | None) -> bool:
        return a is None or b is None or a == b

    if x is not None and len(x) != 3:
        return f"input has rank {len(x)}; the kernel takes (N, S, C)"
    if bias is not None and (len(bias) != 1 or (x is not None and not agree(x[2], bias[0]))):
        return f"bias has shape {list(bias)}; the kernel takes (C), C the input's last dimension"
    if skip is not None and (len(skip) != 3 or (x is not None and not all(map(agree, x, skip)))):
        return f"skip has shape {list(skip)}; the kernel takes the input's shape (N, S, C)"
    return None


class BiasAddBuilder:
    """Replaces com.microsoft BiasAdd with Add(Add(input, bias), skip), the CUDA kernel's order."""

    name = "unfuse_bias_add"
    contract = CONTRACTS["unfuse_bias_add"]

    def quantized_dtype(self, site: Site) -> str | None:
        return _float_type(site)

    def check(self, site: Site, options: Mapping[str, Any]) -> Plan:
        site.no_unknown_attributes(set())
        node = site.node
        if len(node.input) != 3 or not all(node.input) or len(node.output) != 1:
            raise NoMatch("malformed node: BiasAdd takes input, bias and skip, and has one output")
        types = {site.elem_type(name) for name in node.input}
        if None in types or len(types) != 1 or not types <= set(_BIAS_ADD_TYPES):
            named = ", ".join(dtype_name(t) if t else "unknown" for t in (site.elem_type(n) for n in node.input))
            raise NoMatch(f"input types {named}: the kernel takes float32 or float16, the same for all three")
        problem = _bias_add_shapes(*(site.value_shape(name) for name in node.input))
        if problem:
            raise NoMatch(problem)
        return Plan()

    def build(self, site: Site, emit: Emitter, options: Mapping[str, Any], plan: Plan) -> None:
        x, bias, skip = site.node.input
        emit.op1("Add", [emit.op1("Add", [x, bias], hint="AddBias"), skip], site.node.output[0])


register(BiasAddBuilder())


# --- FusedGemm / FusedConv -----------------------------------------------------------------------

#: Activation name -> (standard op, its attribute names), declared with the contract.
_ACTIVATIONS = FUSED_ACTIVATIONS
_CONV_ATTRS = {"auto_pad", "dilations", "group", "kernel_shape", "pads", "strides"}


#: Why a FusedConv rule does not take a node, by whether the node has a sum input Z.
_SUM_INPUT_REASONS = {
    True: "a sum input Z: onnxruntime's kernel starts its float32 accumulation from Z, not bit-exact as "
    "Conv + Z (the bounded rule unfuse-fused-conv-sum applies)",
    False: "no sum input Z (the exact rule lowers it)",
}


class FusedGemmConvBuilder:
    """Replaces com.microsoft FusedGemm / FusedConv with Gemm / Conv and the activation op."""

    name = "unfuse_gemm_conv"
    contract = CONTRACTS["unfuse_gemm_conv"]

    def quantized_dtype(self, site: Site) -> str | None:
        return _float_type(site)

    def _activation(self, site: Site, conv: bool) -> tuple[str, dict[str, float], list[float]]:
        name = site.attribute("activation")
        if isinstance(name, bytes):
            name = name.decode()
        if name not in _ACTIVATIONS:
            raise NoMatch(f"activation {name!r} is not one of {', '.join(_ACTIVATIONS)}")
        op, attr_names = _ACTIVATIONS[name]
        if conv:
            params = [float(p) for p in site.attribute("activation_params", [])]
        else:
            params = [
                float(site.attribute(f"activation_{k}"))
                for k in ("alpha", "beta", "gamma")
                if site.has_attribute(f"activation_{k}")
            ]
        if op == "Clip":
            if len(params) != 2:
                raise NoMatch("Clip needs two activation parameters (min, max)")
            return op, {}, params
        if len(params) < len(attr_names):
            return op, {}, []  # the standard op's defaults are the kernel's
        return op, dict(zip(attr_names, params, strict=False)), []

    def check(self, site: Site, options: Mapping[str, Any]) -> Plan:
        conv = options["op"] == "conv"
        gemm_attrs = {"alpha", "beta", "transA", "transB"}
        act_attrs = (
            {"activation", "activation_params"}
            if conv
            else {"activation", "activation_alpha", "activation_beta", "activation_gamma"}
        )
        site.no_unknown_attributes((_CONV_ATTRS if conv else gemm_attrs) | act_attrs)
        _float_only(site, *site.node.input)
        op, attrs, clip = self._activation(site, conv)
        data: dict[str, Any] = {"activation": (op, attrs, clip)}
        with_sum = conv and bool(site.input(3))
        if conv and with_sum != options["with_sum"]:
            raise NoMatch(_SUM_INPUT_REASONS[with_sum])
        if with_sum and site.input(2):
            rank = None
            shape = site.value_shape(site.input(1))
            if shape is not None:
                rank = len(shape)
            if rank is None:
                raise NoMatch(f"the rank of W {site.input(1)!r} is not recorded (needed to broadcast the bias)")
            data["rank"] = rank
        return Plan(
            min_opset=kernel_opsets.OP_VERSIONS["clip-inputs"] if op == "Clip" else 0,
            data=data,
            bound_formula=FUSED_CONV_SUM_FORMULA if with_sum else None,
        )

    def build(self, site: Site, emit: Emitter, options: Mapping[str, Any], plan: Plan) -> None:
        op, attrs, clip = plan.data["activation"]
        y = site.node.output[0]
        node_attrs: dict[str, Any] = {a.name: a for a in site.node.attribute if not a.name.startswith("activation")}
        inputs = list(site.node.input)
        if options["op"] == "gemm":
            value = emit.op1("Gemm", inputs[:3], **node_attrs)
        elif len(inputs) > 3 and inputs[3]:
            # The kernel sums Z and the products in one float32 accumulation, then adds the bias; this
            # adds Z to the finished convolution: (conv + z) + b, the bounded rule (module docstring).
            value = emit.op1("Conv", inputs[:2], **node_attrs)
            value = emit.op1("Add", [value, inputs[3]], hint="AddSum")
            if inputs[2]:
                bias = emit.op1(
                    "Reshape", [inputs[2], emit.const(np.array([-1] + [1] * (plan.data["rank"] - 2), np.int64))]
                )
                value = emit.op1("Add", [value, bias], hint="AddBias")
        else:
            value = emit.op1("Conv", inputs[:3], **node_attrs)
        extra = [emit.const(np.float32(v)) for v in clip]
        emit.op1(op, [value, *extra], y, **attrs)


register(FusedGemmConvBuilder())


# --- FusedMatMul ---------------------------------------------------------------------------------


def matmul_operand_perm(rank: int, trans: bool, trans_batch: bool) -> list[int]:
    """The Transpose that gives MatMul the operand the kernel reads. ``trans_batch``: the kernel reads
    (d0, b0..bn, d_last) as the stack of matrices (b0..bn, d0, d_last), d0 moved behind the batch
    dimensions (matmul_helper.h); ``trans`` then swaps the matrix's two axes."""
    perm = [*range(1, rank - 1), 0, rank - 1] if trans_batch else list(range(rank))
    if trans:
        perm[-2], perm[-1] = perm[-1], perm[-2]
    return perm


class FusedMatMulBuilder:
    """Replaces com.microsoft FusedMatMul with Transpose, MatMul and Mul."""

    name = "unfuse_matmul"
    contract = CONTRACTS["unfuse_matmul"]

    def quantized_dtype(self, site: Site) -> str | None:
        return _float_type(site)

    def check(self, site: Site, options: Mapping[str, Any]) -> Plan:
        site.no_unknown_attributes({"alpha", "transA", "transB", "transBatchA", "transBatchB"})
        _float_only(site, *site.node.input)
        alpha = float(site.attribute("alpha", 1.0))
        trans = [bool(site.attribute("transA", 0)), bool(site.attribute("transB", 0))]
        batch = [bool(site.attribute("transBatchA", 0)), bool(site.attribute("transBatchB", 0))]
        if not options["any_alpha"] and (alpha != 1.0 or trans[0]):
            raise NoMatch(
                f"alpha={alpha:g}, transA={int(trans[0])}: not bit-exact as MatMul (the bounded rule applies)"
            )
        shapes = [site.value_shape(site.input(i)) for i in range(2)]
        ranks = [len(shape) if shape is not None else 0 for shape in shapes]
        for i, t in enumerate(trans):
            if (t or any(batch)) and ranks[i] < 2:
                raise NoMatch(
                    f"the rank of input {site.input(i)!r} is not recorded (needed to transpose it); run onnx "
                    "shape inference on the model first (onnx.shape_inference.infer_shapes)"
                )
        if any(batch) and (ranks[0] != ranks[1] or ranks[0] < 3):
            # matmul_helper.h: "Two inputs should have same rank and rank >= 3 if transBatchA or
            # transBatchB is true" (measured: the kernel fails the run).
            raise NoMatch(
                f"transBatchA/transBatchB with ranks {ranks[0]} and {ranks[1]}: the kernel needs equal ranks >= 3"
            )
        # The bounded rule (any_alpha): the products summed in another order, bounded per element.
        formula = FUSED_MATMUL_FORMULA if options["any_alpha"] else None
        return Plan(data={"alpha": alpha, "trans": trans, "batch": batch, "ranks": ranks}, bound_formula=formula)

    def build(self, site: Site, emit: Emitter, options: Mapping[str, Any], plan: Plan) -> None:
        operands = []
        for i, rank in enumerate(plan.data["ranks"]):
            perm = matmul_operand_perm(rank, plan.data["trans"][i], plan.data["batch"][i])
            name = site.input(i)
            if perm != list(range(rank)):
                name = emit.op1("Transpose", [name], perm=perm)
            operands.append(name)
        y = site.node.output[0]
        if plan.data["alpha"] == 1.0:
            emit.op1("MatMul", operands, y)
        else:
            emit.op1("Mul", [emit.op1("MatMul", operands), emit.const(np.float32(plan.data["alpha"]))], y)


register(FusedMatMulBuilder())


# --- Skip/Simplified layer normalization ---------------------------------------------------------


class NormalizationBuilder:
    """Replaces SkipLayerNormalization, SkipSimplifiedLayerNormalization and SimplifiedLayerNormalization
    with Add, LayerNormalization / RMSNormalization or their elementwise form."""

    name = "unfuse_normalization"
    contract = CONTRACTS["unfuse_normalization"]

    def quantized_dtype(self, site: Site) -> str | None:
        return _float_type(site)

    def check(self, site: Site, options: Mapping[str, Any]) -> Plan:
        form = options["form"]
        skip = form.startswith("skip")
        site.no_unknown_attributes({"epsilon"} if skip else {"epsilon", "axis", "stash_type"})
        float16 = _normalization_float16(site)
        outputs = [*site.node.output, "", "", ""]
        statistics = any(outputs[1:3]) if skip else bool(outputs[1])
        if statistics and form == "simplified_standard":
            raise NoMatch("the inv_std_var output is used: RMSNormalization has none (the decomposed rule writes it)")
        shape = site.value_shape(site.input(0))
        if skip and shape is not None and len(shape) not in (2, 3):
            raise NoMatch(f"input has rank {len(shape)}; the kernel takes 2 or 3 dimensions (it refuses others)")
        axis = int(site.attribute("axis", -1))
        if axis != -1:
            shape = site.value_shape(site.input(0))
            if shape is None or axis != len(shape) - 1:
                raise NoMatch(f"axis {axis} is not the last axis (or the rank is not recorded)")
        stash = int(site.attribute("stash_type", 1))
        if stash != 1:
            raise NoMatch(f"stash_type {stash} is not lowered")
        rms = kernel_opsets.OP_VERSIONS["rms-normalization"]
        decomposed = form == "simplified_decomposed" or (
            form == "skip_simplified" and (statistics or site.scope.default_opset < rms)
        )
        need = normalization_opset(form, decomposed)
        # float16: the kernels convert every input to float32, compute as in float32 and round y and
        # the sum once (measured bit for bit); RMSNormalization's float16 kernel is the same one.
        cast = float16 and form != "simplified_standard"
        formula = None if form == "simplified_standard" else LAYER_NORM_FORMULA  # the bounded forms
        return Plan(min_opset=need, data={"decomposed": decomposed, "float16": cast}, bound_formula=formula)

    def build(self, site: Site, emit: Emitter, options: Mapping[str, Any], plan: Plan) -> None:
        form = options["form"]
        skip = form.startswith("skip")
        default_eps = 1e-12 if skip else 1e-5
        eps = float(site.attribute("epsilon", default_eps))
        float16 = plan.data["float16"]
        inputs = [emit.op1("Cast", [i], to=_T.FLOAT) if float16 and i else i for i in site.node.input]
        inputs += [""] * (5 - len(inputs))
        outputs = [*list(site.node.output), "", "", "", ""]
        # float16 y and sum: computed in float32, rounded once into the node's outputs.
        y, total_out = ("", "") if float16 else (outputs[0], outputs[3])
        x, gamma = inputs[0], inputs[2] if skip else inputs[1]
        if skip:
            bias = inputs[4] if form == "skip_layer_norm" else inputs[3]
            # (input + skip) + bias, as the kernel; output 3 is that sum when asked for.
            x = emit.op1("Add", [x, inputs[1]], None if bias else total_out or None, hint="AddSkip")
            if bias:
                x = emit.op1("Add", [x, bias], total_out or None, hint="AddBias")
            if float16 and outputs[3]:
                emit.op1("Cast", [x], outputs[3], to=_T.FLOAT16)
        if form == "skip_layer_norm":
            # LayerNormalization's optional Mean and InvStdDev are the kernel's mean / inv_std_var
            # outputs (float32, the input's shape with the last axis 1).
            beta = [inputs[3]] if inputs[3] else []
            written = [y, *outputs[1:3]]
            while len(written) > 1 and not written[-1]:
                written.pop()
            y = emit.op("LayerNormalization", [x, gamma, *beta], written, axis=-1, epsilon=eps)[0]
        elif not plan.data["decomposed"]:
            y = emit.op1("RMSNormalization", [x, gamma], y or None, axis=-1, epsilon=eps)
        else:
            y = _rms_decomposed(emit, x, gamma, eps, y, outputs[1] if skip else "", outputs[1 + skip])
        if float16:
            emit.op1("Cast", [y], outputs[0], to=_T.FLOAT16)


def _normalization_float16(site: Site) -> bool:
    """Whether the node's inputs are float16 (else float32): the kernels take one type for all.
    Refused when no input's type is known (declared or traced): a guess of float32 could put
    float32 constants beside float16 data."""
    known = {site.value_type(name) for name in site.node.input if name} - {None}
    if not known:
        raise NoMatch("the types of the inputs are not declared and their producers do not say")
    if not known <= {_T.FLOAT, _T.FLOAT16} or len(known) > 1:
        named = ", ".join(sorted(dtype_name(t) for t in known if t is not None))
        raise NoMatch(f"input types {named}: only float32 and float16, the same for every input, were measured")
    return known == {_T.FLOAT16}


def _rms_decomposed(emit: Emitter, x: str, gamma: str, eps: float, y: str, mean: str, inv_std: str) -> str:
    """As the kernel: x / sqrt(mean(x * x) + eps) * gamma; ``mean`` (the Skip form's output 1) 0, as
    the kernel writes it (measured), and ``inv_std`` 1 / sqrt(...), where those outputs are read."""
    square = emit.op1("Mul", [x, x])
    mean_square = emit.reduce_last_axis("ReduceMean", square)
    root = emit.op1("Sqrt", [emit.op1("Add", [mean_square, emit.const(np.float32(eps))])])
    y = emit.op1("Mul", [emit.op1("Div", [x, root]), gamma], y or None)
    if mean:
        zero = onnx.helper.make_tensor("zero", _T.FLOAT, [1], [0.0])
        emit.op1("ConstantOfShape", [emit.op1("Shape", [root])], mean, value=zero)
    if inv_std:
        emit.op1("Div", [emit.const(np.float32(1.0)), root], inv_std)
    return y


register(NormalizationBuilder())
