"""The contract of every built-in builder, declared here and nowhere else, with the module that
implements it.

Why a module of its own: loading the rule catalogue validates every rule against its builder's
contract (:mod:`onnx_qrewrite.rewriter.catalogue`), and ``onnx-qrewrite rules`` shows the contracts, but
neither runs a builder. The builders' code imports onnx and numpy, most of a command's start-up
time; this module imports neither, so the catalogue loads without them and a builder's module is
imported only when a rule is applied (:func:`onnx_qrewrite.rewriter.builders.get_builder`).

Each builder class says ``contract = CONTRACTS[name]``: one declaration, read by both sides
(``tests/test_contract.py`` checks that every built-in builder registers with the contract declared
here, and that every module under ``builders/`` that registers a builder is declared here).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

from onnx_qrewrite.rewriter import kernel_opsets
from onnx_qrewrite.rewriter.contract import APPROXIMATE, BOUNDED, EXACT, UNREAD, Contract, Option

__all__ = [
    "ATTENTION_EMITS",
    "AXIS_DEFAULT",
    "CONTRACTS",
    "DIRECTION",
    "DYNAMIC_QDQ_QUANTIZE",
    "FLOAT16",
    "FUSED_ACTIVATIONS",
    "GELU_FORMS",
    "INTEGER_MATMUL_FLOAT_PARTS",
    "INTEGER_MATMUL_FORMS",
    "MODULES",
    "NBITS_BLOCKED",
    "NBITS_UNPACKED",
    "NORM_FORMS",
    "QDQ_TO_FLOAT_FORMS",
    "QDQ_WRAP_OPS",
    "QOPERATOR_EXACTNESS",
    "QOPERATOR_OUTPUT_TYPES",
    "REQUIRE_ZERO_POINT",
    "SEMANTICS",
    "U8S8_POLICIES",
    "U8S8_SATURATION",
    "WEIGHT_ONLY_PATTERNS",
    "WEIGHT_ONLY_ROLES",
    "WEIGHT_ONLY_WEIGHTS",
    "gelu_opset",
    "normalization_opset",
]

# --- options several builders share (the vendor and standard Q/DQ builders) --------------------

DIRECTION = Option("direction", str, allowed=("quantize", "dequantize"), doc="which op the rule replaces")
EMULATION_DIRECTION = Option(
    "direction",
    str,
    allowed=("quantize", "dequantize", "pair", "remove"),
    doc="which op the rule replaces: quantize, dequantize, pair (a DequantizeLinear of a QuantizeLinear, as one "
    "float expression) or remove (a QuantizeLinear left unread by the pair rule)",
)
EMULATION_ELEMENTWISE = Option(
    "elementwise",
    str,
    "standard",
    allowed=("standard", "comparisons"),
    doc="standard: Round and IsNaN; comparisons: Round half to even from Floor, Sub, Mul, Add, Equal, Greater, "
    "Less, Abs and Where, and IsNaN as Not(Equal(x, x)), for targets without Round and IsNaN kernels (WebGPU)",
)
AXIS_DEFAULT = Option(
    "axis_default", int, 1, doc="the axis the vendor kernel uses when the node has no axis attribute (written out)"
)
REQUIRE_ZERO_POINT = Option(
    "require_zero_point", bool, False, doc="the vendor kernel takes exactly three inputs (x, scale, zero point)"
)
FLOAT16 = Option(
    "float16",
    bool,
    False,
    doc="also x (quantize), scale and y (dequantize) in float16: onnxruntime's contrib kernels compute those "
    "in float32 (measured), the emitted ops then do too",
)

#: The one policy for onnxruntime's uint8 x int8 int16 pair saturation (x86 CPUs without AVX-VNNI;
#: onnx_qrewrite/rewriter/u8s8.py), shared by every builder whose original op has that kernel.
U8S8_POLICIES = ("decline", "bound", "ignore")
U8S8_SATURATION = Option(
    "u8s8_saturation",
    str,
    "decline",
    U8S8_POLICIES,
    doc="where onnxruntime's uint8 x int8 kernel can saturate a pair of products to int16 (x86 without "
    "AVX-VNNI): 'decline' gives way (exact rules); 'bound' rewrites to the ONNX definition and adds the "
    "largest pair excess the constant weights allow to the bound (bounded rules); 'ignore' rewrites where "
    "no bound can be computed (approximate rules)",
)

#: ``nan_guard``: where a DynamicQuantizeLinear (or DynamicQuantizeMatMul's quantization of A) takes
#: its range with NaN skipped, as onnxruntime's kernel does below 8 elements (dynamic_quantize.py).
NAN_GUARDS = ("static", "run-time")
NAN_GUARD = Option(
    "nan_guard",
    str,
    "static",
    NAN_GUARDS,
    doc="match onnxruntime's NaN-skipping range on inputs of 1-7 elements: 'static' where the shape is "
    "recorded to hold 1-7 elements (no extra op elsewhere); 'run-time' also where the shape is not "
    "recorded, testing Size(x) < 8 at run time (4 more ops per quantizer)",
)

# --- the forms each builder's options choose between --------------------------------------------

#: dynamic_quantize_linear: onnxruntime's kernel or the ONNX spec's function body.
SEMANTICS = ("onnxruntime", "spec")
#: unfuse_activation
GELU_FORMS = ("gelu", "bias_gelu", "quick_gelu", "fast_gelu_standard", "fast_gelu_decomposed")
#: unfuse_normalization
NORM_FORMS = ("skip_layer_norm", "skip_simplified", "simplified_standard", "simplified_decomposed")
#: unfuse_gemm_conv: activation name -> (standard op, its attribute names in the order of the fused
#: op's parameters).
FUSED_ACTIVATIONS: dict[str, tuple[str, tuple[str, ...]]] = {
    "Relu": ("Relu", ()),
    "LeakyRelu": ("LeakyRelu", ("alpha",)),
    "Sigmoid": ("Sigmoid", ()),
    "Tanh": ("Tanh", ()),
    "HardSigmoid": ("HardSigmoid", ("alpha", "beta")),
    "Clip": ("Clip", ()),  # min and max become inputs
}
#: unfuse_attention, unfuse_qattention, unfuse_multi_head_attention: what the attention ops become.
ATTENTION_EMITS = frozenset(
    {"MatMul", "Add", "Mul", "Slice", "Reshape", "Transpose", "Softmax", "Where", "Greater", "Less", "Not", "And"}
    | {"Range", "Shape", "Gather", "Unsqueeze", "Cast", "Concat"}
)
#: unfuse_gemm_conv: the per-element bound formula of FusedConv with a sum input
#: (onnx_qrewrite.verify.element_bounds).
FUSED_CONV_SUM_FORMULA = "fused-conv-sum"
#: The per-element bound formulas of the other bounded com.microsoft un-fuse rules
#: (onnx_qrewrite.verify.contrib_bounds states each).
LAYER_NORM_FORMULA = "layer-norm-rows"
ATTENTION_FORMULA = "attention-scores"
FAST_GELU_FORMULA = "fast-gelu-tanh"
FUSED_MATMUL_FORMULA = "fused-matmul-sum-order"
EMBED_FORMULA = "embed-layer-norm"
#: decompose: LayerNormalization in two passes (onnx_qrewrite.verify.contrib_bounds).
LAYER_NORM_TWO_PASS_FORMULA = "layer-norm-two-pass"
#: unfuse_rotary_embedding: the per-element bound formula of float32 interleaved RotaryEmbedding with a
#: rotary dim not a multiple of 16 (onnx_qrewrite.verify.element_bounds).
ROTARY_TAIL_FORMULA = "rotary-interleaved-tail"
#: integer_matmul_float_output: which node of the MatMulInteger/ConvInteger -> Cast pair a rule rewrites.
INTEGER_MATMUL_FLOAT_PARTS = ("producer", "cast")
#: integer_matmul
INTEGER_MATMUL_FORMS = ("float-exact", "int32", "float")
#: matmul_nbits
NBITS_BLOCKED = "blocked_dequantize"
NBITS_UNPACKED = "unpacked"
#: gather_block_quantized
GBQ_BLOCKED = "blocked_dequantize"
GBQ_TABLE = "dequantized_table"
GBQ_PACKED = "packed_table"
#: qdq_to_float
QDQ_TO_FLOAT_FORMS = ("fold_constant", "drop_pair_dq", "drop_pair_q")
#: weight_only, dynamic_qdq: the role of a rule in the pattern; weight_only: how the weights are written
#: and which pattern (gather: exact; matmul: approximate).
WEIGHT_ONLY_ROLES = ("rewrite", "remove_dead")
#: dynamic_qdq: how DynamicQuantizeMatMul's own activation quantization is written.
DYNAMIC_QDQ_QUANTIZE = ("expand", "keep")
WEIGHT_ONLY_WEIGHTS = ("dequantize", "float")
WEIGHT_ONLY_PATTERNS = ("matmul", "gather")
#: qoperator_to_qdq: the ops it replaces, and the exactness of each (unless ``u8s8_saturation`` is
#: "ignore"): exact where the float op cannot round (Concat, and the lookup-table ops whose
#: onnxruntime kernel is the float op then QuantizeLinear), one step otherwise.
QOPERATOR_EXACTNESS: dict[str, str] = {
    "QLinearConv": BOUNDED,
    "QLinearMatMul": BOUNDED,
    "QGemm": BOUNDED,
    "QLinearAdd": BOUNDED,
    "QLinearMul": BOUNDED,
    "QLinearConcat": EXACT,
    "QLinearAveragePool": BOUNDED,
    "QLinearGlobalAveragePool": BOUNDED,
    "QLinearLeakyRelu": EXACT,
    "QLinearSigmoid": EXACT,
    "QLinearSoftmax": BOUNDED,
}

#: qdq_wrap: the ops that only select and reorder values (the same on float as on uint8/int8; MaxPool
#: selects each window's largest, which DequantizeLinear's increasing map keeps), which it wraps in
#: DequantizeLinear -> op -> QuantizeLinear.
QDQ_WRAP_OPS = (
    "Reshape",
    "Transpose",
    "Squeeze",
    "Unsqueeze",
    "Flatten",
    "Gather",
    "Slice",
    "Concat",
    "Expand",
    "Tile",
    "DepthToSpace",
    "SpaceToDepth",
    "MaxPool",
)

# --- the contracts ------------------------------------------------------------------------------

_DQL_EMITS = frozenset(
    {
        "ReduceMin",
        "ReduceMax",
        "Min",
        "Max",
        "Sub",
        "Div",
        "Equal",
        "Where",
        "IsNaN",
        "Size",
        "Less",
        "Clip",
        "Round",
        "Cast",
        "QuantizeLinear",
        "Constant",
        "Identity",
    }
)


def _qoperator_exactness(options: Mapping[str, Any]) -> str:
    if options["u8s8_saturation"] == "ignore":
        return APPROXIMATE
    return QOPERATOR_EXACTNESS[options["op"]]


def _qoperator_opset(options: Mapping[str, Any], dtypes: Collection[str] | None) -> str:
    if options["op"] in ("QLinearConv", "QLinearMatMul", "QGemm", "QLinearSoftmax"):
        # The largest of per-axis DequantizeLinear, Gemm's optional C and Softmax's single axis.
        needed = max(
            kernel_opsets.PER_AXIS,
            kernel_opsets.OP_VERSIONS["gemm-optional-c"],
            kernel_opsets.OP_VERSIONS["softmax-single-axis"],
        )
        return f"{needed} (per-channel DequantizeLinear; Softmax's single-axis form)"
    return str(kernel_opsets.QDQ_FIRST)


def normalization_opset(form: str, decomposed: bool) -> int:
    """The opset unfuse_normalization's ``form`` needs (``decomposed``: the Mul/ReduceMean form)."""
    if form == "skip_layer_norm":
        return kernel_opsets.OP_VERSIONS["layer-normalization"]
    return kernel_opsets.FORMS["rms-decomposed"] if decomposed else kernel_opsets.OP_VERSIONS["rms-normalization"]


def gelu_opset(form: str) -> int:
    """The opset unfuse_activation's ``form`` needs."""
    if form == "fast_gelu_standard":
        return kernel_opsets.OP_VERSIONS["gelu"]
    return kernel_opsets.FORMS["quick-gelu" if form == "quick_gelu" else "gelu-decomposed"]


def _attention_opset(mask: str) -> str:
    """The attention rules' opset in words: with ``mask`` or unidirectional, and without."""
    forms = kernel_opsets.FORMS
    if forms["attention-mask"] == forms["attention"]:
        return str(forms["attention"])
    return f"{forms['attention-mask']} ({forms['attention']} without {mask} and unidirectional)"


def _qdq_decompose_opset(options: Mapping[str, Any], dtypes: Collection[str] | None) -> str:
    minimum = kernel_opsets.FORMS["qdq-decompose"]
    if options["direction"] == "dequantize":
        return f"{kernel_opsets.DECOMPOSE_DEQUANTIZE_INTEGER} (integer types; bfloat16/float16: {minimum})"
    return str(minimum)


# --- output types (onnx_qrewrite/rewriter/contract.py: OUTPUT_TYPE_GRAMMAR) ---------------------

#: QuantizeLinear's output: output_dtype (opset 21), else the zero point's type, else uint8.
QUANTIZED_OUTPUT = "attribute output_dtype else input 2 else uint8"
#: DequantizeLinear's output: the scale's type.
DEQUANTIZED_OUTPUT = "input 1"


def _same_as_input_0(options: Mapping[str, Any], op: str) -> tuple[str, ...]:
    """The op's one output has input 0's element type (the contrib fusions' T, a movement op's)."""
    return ("input 0",)


def _normalization_output_types(options: Mapping[str, Any], op: str) -> tuple[str, ...]:
    """(Skip)(Simplified)LayerNormalization: output T, then mean and inv_std_var (U, float32 in
    onnxruntime's schemas and kernels), then the skip sum (T)."""
    if op.startswith("Skip"):
        return ("input 0", "float32", "float32", "input 0")
    return ("input 0", "float32", "float32")


#: MatMulInteger and ConvInteger: int32.
_INTEGER_MATMUL = ("int32",)
#: integer_matmul: per op; DynamicQuantizeMatMul's output is A's float type, MatMulIntegerToFloat's
#: its scales' (T3, input 2).
_INTEGER_MATMUL_OUTPUTS = {
    "MatMulInteger": _INTEGER_MATMUL,
    "ConvInteger": _INTEGER_MATMUL,
    "DynamicQuantizeMatMul": ("input 0",),
    "MatMulIntegerToFloat": ("input 2",),
}


def _emulation_output_types(options: Mapping[str, Any], op: str) -> tuple[str, ...]:
    """qdq_float_emulation: a QuantizeLinear's output is the quantized type (removed: unread);
    a DequantizeLinear's, also the pair's anchor, the scale's type."""
    return {
        "quantize": (QUANTIZED_OUTPUT,),
        "remove": (UNREAD,),
        "dequantize": (DEQUANTIZED_OUTPUT,),
        "pair": (DEQUANTIZED_OUTPUT,),
    }[options["direction"]]


def _pattern_output_types(options: Mapping[str, Any], op: str) -> tuple[str, ...] | None:
    """weight_only, dynamic_qdq: the anchor's output (the scale product's Mul: input 0, the Cast to
    float; a fused op as integer_matmul declares it; DequantizeLinear(Gather(W)): the scale's type);
    the pattern's other nodes are removed only once nothing reads them."""
    if options["role"] == "remove_dead":
        return (UNREAD,)
    if op == "Mul":
        return ("input 0",)
    if op == "DequantizeLinear":
        return (DEQUANTIZED_OUTPUT,)
    return _INTEGER_MATMUL_OUTPUTS.get(op)


def _qdq_output_types(options: Mapping[str, Any], op: str) -> tuple[str, ...]:
    """standard_qdq, qdq_decompose: the vendor's QuantizeLinear gives the zero point's type (uint8
    without one, as the standard op), its DequantizeLinear the scale's."""
    return (QUANTIZED_OUTPUT if options["direction"] == "quantize" else DEQUANTIZED_OUTPUT,)


#: qoperator_to_qdq: the output type of each op: QLinearConv/QLinearMatMul (T3) and QLinearConcat
#: (T8) that of y_zero_point; QGemm that of y_zero_point, uint8 with y_scale alone, float (the
#: scales' type) without y_scale; the others A's type (T).
QOPERATOR_OUTPUT_TYPES: dict[str, str] = {
    "QLinearConv": "input 7 else uint8",
    "QLinearMatMul": "input 7 else uint8",
    "QGemm": "input 8 else uint8 if input 7 else input 1",
    "QLinearAdd": "input 0",
    "QLinearMul": "input 0",
    "QLinearConcat": "input 1",
    "QLinearAveragePool": "input 0",
    "QLinearGlobalAveragePool": "input 0",
    "QLinearLeakyRelu": "input 0",
    "QLinearSigmoid": "input 0",
    "QLinearSoftmax": "input 0",
}

#: builder name -> (module under ``onnx_qrewrite.rewriter.builders`` that registers it, its contract)
_DECLARED: dict[str, tuple[str, Contract]] = {
    "dynamic_quantize_linear": (
        "dynamic_quantize",
        Contract(
            output_types=lambda options, op: ("uint8", "float32", "uint8"),
            options=(
                Option(
                    "semantics",
                    str,
                    "onnxruntime",
                    SEMANTICS,
                    doc="onnxruntime's kernel, bit for bit (degenerate cases included), or the ONNX spec's "
                    "function body",
                ),
                NAN_GUARD,
            ),
            # The spec body (onnx's own schema) uses a subset of these at every opset 11-26.
            emits=_DQL_EMITS,
            outputs=3,
            opset=lambda options, dtypes: str(kernel_opsets.FORMS["dynamic-quantize-linear"]),
        ),
    ),
    "dynamic_dequantize": (
        "dynamic_dequantize",
        Contract(
            output_types=lambda options, op: ("input 1",),
            options=(
                Option(
                    "form",
                    str,
                    "dequantize_linear",
                    ("dequantize_linear", "arithmetic"),
                    doc="DequantizeLinear (gives way for a zero point of another type than src, or a "
                    "non-float32 scale) or the Cast/Sub/Mul form",
                ),
                AXIS_DEFAULT,
            ),
            emits=frozenset({"DequantizeLinear", "Cast", "Sub", "Mul", "Reshape"}),
            preserves_shape=True,
            opset=lambda options, dtypes: (
                f"{kernel_opsets.QDQ_FIRST} (per_channel {kernel_opsets.PER_AXIS})"
                if options["form"] == "dequantize_linear"
                else str(kernel_opsets.FORMS["dynamic-dequantize-arithmetic"])
            ),
        ),
    ),
    "unfuse_activation": (
        "contrib_fusions",
        Contract(
            output_types=_same_as_input_0,
            options=(Option("form", str, allowed=GELU_FORMS, doc="which op, and for FastGelu which decomposition"),),
            emits=frozenset({"Mul", "Add", "Erf", "Sigmoid", "Tanh", "Gelu"}),
            exactness=lambda options: BOUNDED if options["form"] == "fast_gelu_decomposed" else EXACT,
            bound="the tanh approximation in other float32 roundings: within 2^-21·(|x| + 1) "
            "(measured: 4.8e-7 at |x| ~ 10), checked per element by verify (formula fast-gelu-tanh)",
            preserves_shape=True,
            opset=lambda options, dtypes: str(gelu_opset(options["form"])),
        ),
    ),
    "unfuse_gemm_conv": (
        "contrib_fusions",
        Contract(
            output_types=_same_as_input_0,
            options=(
                Option("op", str, allowed=("gemm", "conv"), doc="which fused op the rule replaces"),
                Option(
                    "with_sum",
                    bool,
                    False,
                    doc="FusedConv: only nodes with a sum input Z (bounded: onnxruntime's kernel starts its float32 "
                    "accumulation from Z, the rewrite adds Z to the finished convolution); without it, only nodes "
                    "without Z (exact)",
                ),
            ),
            emits=frozenset({"Gemm", "Conv", "Add", "Reshape", *(op for op, _ in FUSED_ACTIVATIONS.values())}),
            exactness=lambda options: BOUNDED if options["with_sum"] else EXACT,
            bound="the same K + 2 terms (the K = C/group·prod(kernel) products, Z and the bias) summed in another "
            "order: at most L·(2·γ(K + 2) + 2^-20)·(Σ|x·w| + |z| + |b|) + 2^-20·(|y| + c) per element (L: the "
            "activation's slope, at least 1; c: 1 for Sigmoid/Tanh, 1 + |beta| for HardSigmoid, else 0), "
            "checked per element by verify (formula fused-conv-sum)",
            opset=lambda options, dtypes: f"{kernel_opsets.OP_VERSIONS['clip-inputs']} (Clip with inputs)",
        ),
    ),
    "unfuse_matmul": (
        "contrib_fusions",
        Contract(
            output_types=_same_as_input_0,
            options=(
                Option(
                    "any_alpha",
                    bool,
                    False,
                    doc="also nodes with alpha != 1 or transA (bounded: MLAS applies alpha per K panel and "
                    "transposes A while packing, which changes the float32 summation)",
                ),
            ),
            emits=frozenset({"Transpose", "MatMul", "Mul"}),
            exactness=lambda options: BOUNDED if options["any_alpha"] else EXACT,
            bound="the same products summed in another order, times alpha: at most 2·γ(K)·|alpha|·Σ|a·b| + one "
            "rounding of the result (2·2^-24·|y|), checked per element by verify (formula fused-matmul-sum-order)",
            opset=lambda options, dtypes: "any",
        ),
    ),
    "unfuse_bias_add": (
        "contrib_fusions",
        Contract(
            output_types=_same_as_input_0,
            options=(),
            emits=frozenset({"Add"}),
            preserves_shape=True,
            opset=lambda options, dtypes: "any",
        ),
    ),
    "unfuse_normalization": (
        "contrib_fusions",
        Contract(
            output_types=_normalization_output_types,
            options=(
                Option(
                    "form",
                    str,
                    allowed=NORM_FORMS,
                    doc="which op, and for RMS norms the standard op or a decomposition",
                ),
            ),
            emits=frozenset(
                {"Add", "LayerNormalization", "RMSNormalization", "Mul", "ReduceMean", "Sqrt", "Div", "Shape"}
                | {"ConstantOfShape", "Cast"}
            ),
            exactness=lambda options: EXACT if options["form"] == "simplified_standard" else BOUNDED,
            bound="the kernel's sums are sequential float32 loops (SkipLayerNormalization: Welford's running mean and "
            "M2, measured bit for bit; the simplified forms: the sum of squares), the rewrite's in another order: "
            "with c = 8 + h/16 (h the normalized size; the simplified forms, whose squares all have one sign: "
            "8 + gamma(h)/2^-24, gamma(h) = h·u/(1 - h·u)), y within c·2^-24·(|y| + 1 + |γ|·(1 + |x̂|)·|mean|·inv_std), "
            "x̂ = (x - mean)·inv_std, the row's mean and inv_std (mean 0 for the simplified forms); the mean output "
            "within c·2^-24·max|x| over the row, inv_std_var within c·2^-24·inv_std·(1 + |mean|·inv_std) "
            "(worst measured 0.55 of it: rows of mean up to 4·10^4 against spreads of 0.01-3, h 64-4096); "
            "the simplified forms' mean output 0, as the kernel writes it; float16: the kernels compute in float32 "
            "and round y and the sum once (measured), as the rewrite's Casts do: y within that plus one float16 "
            "ulp, the sum bit-exact; every output checked per element by verify (formula layer-norm-rows)",
            opset=lambda options, dtypes: str(
                normalization_opset(options["form"], options["form"] == "simplified_decomposed")
            ),
        ),
    ),
    "unfuse_qattention": (
        "contrib_attention",
        Contract(
            output_types=lambda options, op: ("input 3", "input 3"),  # output, present
            options=(U8S8_SATURATION,),
            emits=ATTENTION_EMITS | {"Sub"},
            exactness=lambda options: APPROXIMATE if options["u8s8_saturation"] == "ignore" else BOUNDED,
            bound="the projection bit-exact (integer sums within 2^24, checked from the weights; else float32 "
            "rounding of them); the attention after it as Attention's: within 2^-20·(1 + max|score|)·max|V| "
            "(bit-exact on the tests' battery, hidden 32 to 768), present's new K and V within "
            "2·(K + 1)·2^-24·(|x - x_zp|·|W - W_zp|·|scales| + |b|), checked per element by verify (formula "
            "attention-scores); where onnxruntime's uint8 x int8 kernel can "
            "saturate a pair of products to int16 (x86 without AVX-VNNI), its default differs in the projection by "
            "up to each column's pair excess · x_scale · W_scale (in the notes; verify compares the outputs with "
            "onnxruntime's session.x64quantprecision form of the original, which does not saturate, and the node "
            "with the default kernel within a per-element bound from the pairs that leave int16 on each sample, "
            "through the softmax as a total variation of at most tanh(M/2): finite for any weights)",
            opset=lambda options, dtypes: _attention_opset("mask_index"),
        ),
    ),
    "unfuse_attention": (
        "contrib_attention",
        Contract(
            output_types=lambda options, op: ("input 0", "input 0"),  # output, present
            options=(),
            emits=ATTENTION_EMITS,
            exactness=lambda options: BOUNDED,
            bound="the projection's bias added after, not before, MLAS's K-blocked float32 sum (bit-exact while "
            "the input hidden size is <= 128 and sequence > 1); within 2^-20·(1 + max|score|)·max|V| "
            "at each output, score = scale·Q·Kᵀ plus attention_bias, past keys and values included (asserted on "
            "the tests' battery; worst measured 2^-22.6); present: its past part copied bit for bit, its new K and "
            "V within 2·(K + 1)·2^-24·(|x|·|W| + |b|), K the input hidden size; max|score| and max|V| the node's "
            "largest (with attention_bias, max|score| per query row over the keys within 104 of its largest "
            "biased score: the others weigh 0 in float32), plus |mask_filter_value| at the rows whose every key "
            "is masked; every output checked per "
            "element by verify (formula attention-scores)",
            opset=lambda options, dtypes: _attention_opset("mask_index"),
        ),
    ),
    "unfuse_multi_head_attention": (
        "contrib_attention",
        Contract(
            output_types=lambda options, op: ("input 0",) * 4,  # output, present K and V, qk
            options=(),
            emits=ATTENTION_EMITS | {"Identity", "Sub"},  # 4-D key/value's presents, the qk output; shared buffer
            exactness=lambda options: BOUNDED,
            bound="without key_padding_mask, attention_bias, unidirectional, present outputs, the qk output, "
            "cache_indirection and 4-D key/value the kernel takes its blocked (flash) softmax path, and at query "
            "sequence 1 MLAS's GEMV (most in a fully masked row): other float32 roundings (bit-exact otherwise: "
            "sequence > 1 with any of them, past/present included); within 2^-20·(1 + max|score|)·max|V| at each "
            "output, score = scale·Q·Kᵀ over the past and new keys plus attention_bias, and plus the filter value "
            "in rows whose every key is masked (asserted on the tests' battery; worst measured 0.091 of it, a fully "
            "masked decoder step); the qk output within 2^-20·(1 + max|score|) at sequence 1, bit-exact otherwise; "
            "present_key / present_value bit-exact (copies); max|score| and max|V| the node's largest (the output's "
            "max|score| with attention_bias per query row, over the keys within 104 of its largest biased score: "
            "the others weigh 0 in float32); every "
            "output checked per element by verify (formula attention-scores)",
            opset=lambda options, dtypes: _attention_opset("key_padding_mask"),
        ),
    ),
    "unfuse_group_query_attention": (
        "contrib_gqa",
        Contract(
            options=(),
            emits=frozenset(
                {"Reshape", "Transpose", "Concat", "Gather", "GatherElements", "Expand", "Shape", "Slice", "Range"}
                | {"Cast", "Add", "Sub", "Mul", "MatMul", "Softmax", "Where", "Less", "Equal", "Max", "Unsqueeze"}
                | {"Greater", "And", "Not"}  # do_rotary: RotaryEmbedding's form (contrib_rotary.py), local window
                | {"Tanh", "Div"}  # softcap
                | {"Pad", "ReduceMax"}  # attention_bias
                | {"Identity"}  # output_qk
                | {"Min"}  # a padded first prompt's rows attend the entry's keys
            ),
            exactness=lambda options: BOUNDED,
            bound="the kernel's products and softmax round differently from MatMul/Softmax/MatMul (a few float32 "
            "ulps measured; softcap's tanh too): within 2^-20·(1 + max|score|)·max|V| at each output, score = "
            "scale·Q·Kᵀ over the keys and values the node reads, plus attention_bias, and the head sinks "
            "(asserted on the tests' battery; worst measured 0.061 of it, scales 0.01-30, up to 201 keys, head "
            "size 128; with softcap, smooth_softmax and local_window_size 0.082), float16 outputs within that "
            "plus one float16 ulp (the kernel computes in float32 and rounds once); output_qk within "
            "2^-20·(1 + max|score|) at each entry's keys < seqlens_k[b] + 1 (worst measured 0.40 of it before the "
            "softmax, 0.057 after; float16: plus one float16 ulp; beyond them the kernel leaves output_qk "
            "unwritten: undefined, not compared by verify); present_key / present_value bit-exact (copies); "
            "max|score| and max|V| the node's largest (with do_rotary: scale·r²·max‖q‖·max‖k‖ per head, r = "
            "max|cos| + max|sin|, an upper bound of the rotated scores); every output checked per element by "
            "verify (formula attention-scores)",
            output_types=lambda options, op: ("input 0",) * 4,  # output, present K and V, output_qk
            outputs=3,
            opset=lambda options, dtypes: str(kernel_opsets.FORMS["group-query-attention"]),
        ),
    ),
    "unfuse_rotary_embedding": (
        "contrib_rotary",
        Contract(
            options=(
                Option(
                    "interleaved_tail",
                    bool,
                    False,
                    doc="only float32 interleaved nodes whose rotary dim is not a multiple of 16 (bounded: "
                    "onnxruntime's kernel rounds the pairs after the last whole block of 16 two ways)",
                ),
            ),
            emits=frozenset(
                {"Gather", "Range", "Reshape", "Shape", "Slice", "Unsqueeze", "Concat", "Cast", "Mul", "Add", "Sub"}
                | {"Equal", "Greater", "And", "Not", "Where"}
            ),
            exactness=lambda options: BOUNDED if options["interleaved_tail"] else EXACT,
            bound="bit-exact before the rotary dim's last whole block of 16 values; after it, where the kernel "
            "rounds x1·cos (x1·sin) before the sum or not, at most 4·2^-24·(|x1·cos| + |x2·sin|) "
            "(|x1·sin| + |x2·cos|) + 2^-148 per element",
            output_types=_same_as_input_0,
            preserves_shape=True,
            opset=lambda options, dtypes: str(kernel_opsets.FORMS["rotary-embedding"]),
        ),
    ),
    "unfuse_embed_layer_norm": (
        "contrib_embed",
        Contract(
            output_types=lambda options, op: (
                ("float32", "int32", "float32") if options["form"] == "quantized" else ("input 2", "int32", "input 2")
            ),
            options=(
                Option(
                    "form",
                    str,
                    "float",
                    ("float", "quantized"),
                    doc="EmbedLayerNormalization, or QEmbedLayerNormalization (8-bit tables and gamma/beta, each "
                    "with a per-tensor scale and zero point: the rows are gathered, then dequantized)",
                ),
            ),
            emits=frozenset(
                {"Gather", "Add", "Sub", "Mul", "Div", "Sqrt", "CumSum", "Range", "Shape", "Equal", "Cast"}
                | {"ReduceSum", "ConstantOfShape", "Slice", "DequantizeLinear"}
            ),
            exactness=lambda options: BOUNDED,
            bound="output 0: the kernels' two-pass normalization operation for operation, each row's sums added "
            "sequentially in float32 as the kernels do (CumSum), so bit-exact on x86-64: no difference in 480 cases "
            "per op (60 random draws of the tests' batteries x 4 forms x hidden 48 and 768, "
            "`python benchmarks/embed_bound_probe.py 60`); "
            "stated as 2^-24·(4·(|γ·x̂| + |β| + 1) + h·|γ·x̂|) at each output, x̂ the normalized sum, h the "
            "hidden size: the margin of an onnxruntime build that contracts multiply-adds (no FMA build was "
            "available: its loop emulated exactly, tests/_embed_kernel.py, `python benchmarks/embed_bound_probe.py "
            "--fma 20`): fma(x̂, γ, β) or into beta's dequantization within 1.78 of 2^-24·(|γ·x̂| + |β| + 1) "
            "measured (3 analytically), the variance's a·a + sum moves x̂ by the sequential sum's rounding, "
            "h·2^-24 relative at worst (3.70 measured, 4.09 with the output's fma too, at hidden 768); "
            "QEmbedLayerNormalization, for a build that also fuses the dequantization's multiply into the "
            "embedding sum (GCC's default where the target has FMA; 18.7 measured), plus "
            "12·2^-24·|γ|·(1 + |x̂|)·M/σ, M the row's largest |w| + |p| + |s| dequantized, σ its standard "
            "deviation (first-order worst case; 1.59 of 2^-24·|γ|·(1 + |x̂|)·M/σ measured); the mask index and "
            "the embedding sum are bit-exact; every output checked per element by verify (formula embed-layer-norm)",
            outputs=2,
            opset=lambda options, dtypes: str(kernel_opsets.FORMS["embed-layer-norm"]),
        ),
    ),
    "integer_matmul_float_output": (
        "integer_matmul_float",
        Contract(
            output_types=lambda options, op: (UNREAD,) if options["part"] == "producer" else ("attribute to",),
            options=(
                Option(
                    "part",
                    str,
                    "cast",
                    INTEGER_MATMUL_FLOAT_PARTS,
                    doc="producer: the MatMulInteger/ConvInteger (removed); cast: the Cast to float reading it "
                    "(computes the product in float)",
                ),
            ),
            emits=frozenset({"Cast", "Sub", "MatMul", "Conv", "Reshape"}),
            opset=lambda options, dtypes: str(kernel_opsets.FORMS["integer-matmul"]),
        ),
    ),
    "qdq_float_emulation": (
        "float_emulation",
        Contract(
            output_types=_emulation_output_types,
            options=(EMULATION_DIRECTION, EMULATION_ELEMENTWISE),
            emits=frozenset(
                {"Div", "Round", "Add", "Clip", "IsNaN", "Where", "Cast", "Sub", "Mul", "Reshape"}
                | {"GreaterOrEqual", "Less", "And"}
                | {"Floor", "Abs", "Equal", "Greater", "Not"}
            ),
            preserves_shape=True,
            opset=lambda options, dtypes: str(kernel_opsets.FORMS["float-emulation"]),
        ),
    ),
    "gather_block_quantized": (
        "gather_block_quantized",
        Contract(
            output_types=lambda options, op: ("input 2",),
            options=(
                Option(
                    "form",
                    str,
                    GBQ_BLOCKED,
                    (GBQ_BLOCKED, GBQ_TABLE, GBQ_PACKED),
                    doc="blocked_dequantize: Gather the quantized rows, then a blocked DequantizeLinear (opset 21); "
                    "dequantized_table: the table dequantized at rewrite time (float32 or float16 like the "
                    "scales), then Gather (opset 11); packed_table: the table kept packed, each lookup's rows "
                    "unpacked with Div/Mul/Sub and dequantized with Cast/Sub/Mul (opset 11), a table on other "
                    "axes stored with them permuted and each lookup transposed back",
                ),
            ),
            emits=frozenset({"Gather", "DequantizeLinear", "Div", "Sub", "Concat", "Cast", "Mul", "Transpose"}),
            opset=lambda options, dtypes: str(
                {
                    GBQ_BLOCKED: kernel_opsets.BLOCKED,
                    GBQ_TABLE: kernel_opsets.GATHER_NEGATIVE_INDICES,
                    GBQ_PACKED: kernel_opsets.FORMS["gather-block-unpack"],
                }[options["form"]]
            ),
        ),
    ),
    "integer_matmul": (
        "integer_matmul",
        Contract(
            output_types=lambda options, op: _INTEGER_MATMUL_OUTPUTS.get(op),
            options=(
                Option(
                    "accumulate",
                    str,
                    "float-exact",
                    INTEGER_MATMUL_FORMS,
                    doc="float-exact: float MatMul/Conv where sums provably stay below 2^24 (declines otherwise); "
                    "int32: int32 MatMul (MatMul only); float: float MatMul/Conv within a computed bound",
                ),
                U8S8_SATURATION,
                dataclasses.replace(NAN_GUARD, doc=f"DynamicQuantizeMatMul's quantization of A: {NAN_GUARD.doc}"),
            ),
            # DynamicQuantizeMatMul expands its DynamicQuantizeLinear as that builder does.
            emits=frozenset({"Cast", "Sub", "MatMul", "Conv", "Mul", "Add", "Reshape"}) | _DQL_EMITS,
            exactness=lambda options: (
                APPROXIMATE
                if options["u8s8_saturation"] == "ignore"
                else BOUNDED
                if options["accumulate"] == "float" or options["u8s8_saturation"] == "bound"
                else EXACT
            ),
            bound="float32 accumulation of the exact integer products: at most gamma(K-1) * sum |products| "
            "(computed per node from K, the dtype ranges, the zero points and constant weights); plus, where "
            "onnxruntime's uint8 x int8 kernel can saturate a pair of products to int16 (x86 without AVX-VNNI), "
            "each output column's pair excess from the weights (verify checks it per column; float outputs: "
            "times the scale product, plus 2^-20 of the value)",
            opset=lambda options, dtypes: (
                str(kernel_opsets.FORMS["integer-matmul"])
                + f" ({kernel_opsets.FORMS['dynamic-quantize-linear']} with DynamicQuantizeMatMul)"
            ),
        ),
    ),
    "matmul_nbits": (
        "matmul_nbits",
        Contract(
            output_types=_same_as_input_0,
            options=(
                Option(
                    "form",
                    str,
                    allowed=(NBITS_BLOCKED, NBITS_UNPACKED),
                    doc=f"blocked_dequantize: DequantizeLinear with block_size (opset {kernel_opsets.BLOCKED}, 4/8-bit "
                    f"types; int2/uint2 from {kernel_opsets.qdq_opset(False, 'uint2', blocked=True)}); unpacked: one "
                    f"uint8 per weight and Cast/Sub/Mul per block (any opset from {kernel_opsets.NBITS_UNPACKED})",
                ),
                Option(
                    "int8_activations",
                    bool,
                    False,
                    doc="rewrite only nodes with accuracy_level 4, where onnxruntime may quantize A to int8 per "
                    "block (approximate: the rewrite computes in float32)",
                ),
            ),
            emits=frozenset({"DequantizeLinear", "MatMul", "Add", "Cast", "Sub", "Mul", "Reshape", "Slice"}),
            exactness=lambda options: APPROXIMATE if options["int8_activations"] else BOUNDED,
            bound="bit-identical dequantized weights; the float32 sum over K in another order: at most "
            "2·γ(K)·Σ|a·w| per output (γ(K) = K·2^-24/(1 - K·2^-24))",
            opset=lambda options, dtypes: (
                f"{kernel_opsets.BLOCKED} (int2/uint2 weights: {kernel_opsets.qdq_opset(False, 'uint2', blocked=True)})"
                if options["form"] == NBITS_BLOCKED
                else str(kernel_opsets.NBITS_UNPACKED)
            ),
        ),
    ),
    "qdq_to_float": (
        "qdq_to_float",
        Contract(
            output_types=lambda options, op: (UNREAD,) if options["form"] == "drop_pair_q" else ("input 1",),
            options=(
                Option("form", str, allowed=QDQ_TO_FLOAT_FORMS, doc="which part of the QDQ form the rule removes"),
            ),
            emits=frozenset({"Identity", "Clip", "Min", "Max"}),
            exactness=lambda options: EXACT if options["form"] == "fold_constant" else APPROXIMATE,
            preserves_shape=True,
            opset=lambda options, dtypes: "any",
        ),
    ),
    "weight_only": (
        "weight_only",
        Contract(
            output_types=_pattern_output_types,
            options=(
                Option(
                    "role",
                    str,
                    allowed=WEIGHT_ONLY_ROLES,
                    doc="rewrite: the pattern's last node becomes the float MatMul/Conv; remove_dead: the "
                    "pattern's other nodes, removed once nothing reads them",
                ),
                Option(
                    "weights",
                    str,
                    "dequantize",
                    WEIGHT_ONLY_WEIGHTS,
                    doc=f"dequantize: DequantizeLinear of the integer weights (opset {kernel_opsets.PER_AXIS} for "
                    "per-channel); "
                    "float: folded to float initializers (no Q/DQ op left)",
                ),
                Option(
                    "pattern",
                    str,
                    "matmul",
                    WEIGHT_ONLY_PATTERNS,
                    doc="matmul: a dynamically quantized MatMul/Conv, computed on the float activation "
                    "(approximate); gather: DequantizeLinear(Gather(W)) -> Gather(dequantized W), the same "
                    "values (exact: DequantizeLinear is elementwise, measured bit for bit)",
                ),
            ),
            emits=frozenset({"DequantizeLinear", "MatMul", "Conv", "Add", "Gather"}),
            exactness=lambda options: EXACT if options["pattern"] == "gather" else APPROXIMATE,
            opset=lambda options, dtypes: (
                "any"
                if options.get("role") == "remove_dead" or options.get("weights") == "float"
                else kernel_opsets.describe(False, ["uint8", "int8"])
            ),
        ),
    ),
    "dynamic_qdq": (
        "dynamic_qdq",
        Contract(
            output_types=_pattern_output_types,
            options=(
                Option(
                    "role",
                    str,
                    allowed=WEIGHT_ONLY_ROLES,
                    doc="rewrite: the pattern's last node becomes DequantizeLinear of the quantized activation and "
                    "of the weights, then the float MatMul/Conv; remove_dead: the integer op, its Cast and the "
                    "scale product, removed once nothing reads them (exact: a node nothing reads computes nothing)",
                ),
                Option(
                    "quantize",
                    str,
                    "expand",
                    DYNAMIC_QDQ_QUANTIZE,
                    doc="DynamicQuantizeMatMul, which quantizes its activation itself: expand that "
                    "DynamicQuantizeLinear as dql-expand does (onnxruntime's kernel, bit for bit) or keep the "
                    "standard op (targets that run it)",
                ),
            ),
            emits=frozenset({"DequantizeLinear", "MatMul", "Conv", "Add", "DynamicQuantizeLinear"}) | _DQL_EMITS,
            exactness=lambda options: EXACT if options["role"] == "remove_dead" else BOUNDED,
            bound="float32 accumulation of the dequantized products instead of the exact integer sum: at most "
            "(γ(K+2) + γ(3) [+ 3u with a bias])·(1 + 2^-7)·max_n(w_scale_n·Σ_k|w_kn - w_zp_n|)·max|x| "
            "[+ 3u·max|bias|] at each output, x the float activation, u = 2^-24 (computed per node from the "
            "constant weights; verify evaluates it on each sample)",
            opset=lambda options, dtypes: (
                "any"
                if options.get("role") == "remove_dead"
                else kernel_opsets.describe(False, ["uint8", "int8"])
                + f" ({kernel_opsets.FORMS['dynamic-quantize-linear']} with DynamicQuantizeMatMul)"
            ),
        ),
    ),
    "qoperator_to_qdq": (
        "qoperator",
        Contract(
            output_types=lambda options, op: (QOPERATOR_OUTPUT_TYPES[options["op"]],),
            options=(
                Option("op", str, allowed=tuple(QOPERATOR_EXACTNESS), doc="which QOperator op the rule replaces"),
                U8S8_SATURATION,
                Option(
                    "reduction_length",
                    str,
                    "recorded",
                    ("recorded", "run-time"),
                    doc="QLinearMatMul of two run-time operands: bounded at the reduction length K the model "
                    "records; where K is not recorded (a symbolic sequence length), decline ('recorded') or bound it "
                    "by a function of K that verify evaluates at each sample's K ('run-time')",
                ),
                Option(
                    "length_check",
                    str,
                    "shape",
                    ("shape", "softmax"),
                    doc="QLinearSoftmax whose softmax length is not recorded: check it at run time by Shape, "
                    "Gather, Equal, Where ('shape'), or by a Softmax of zeros, which is 1 only over one value "
                    "('softmax': Slice, Mul, Softmax, Sub, Min; for targets that refuse Shape)",
                ),
            ),
            emits=frozenset(
                {
                    "DequantizeLinear",
                    "QuantizeLinear",
                    "Conv",
                    "MatMul",
                    "Gemm",
                    "Add",
                    "Mul",
                    "Concat",
                    "AveragePool",
                    "GlobalAveragePool",
                    "LeakyRelu",
                    "Sigmoid",
                    "Softmax",
                    "Transpose",
                    "Flatten",
                    "Shape",
                    "Reshape",
                    "Gather",
                    "Equal",
                    "Where",
                    "Slice",
                    "Sub",
                    "Min",
                }
            ),
            exactness=_qoperator_exactness,
            bound="one quantization step at the node's output for every op but QLinearSoftmax with a non-integral "
            "1/y_scale (two); more only where float32 accumulation of the dot products cannot be bounded below "
            "one step (computed per node from the weights: floor(d) + 1 steps; for a QLinearMatMul of two run-time "
            "operands whose reduction length K is not recorded (reduction_length 'run-time'), a function of K, "
            "floor(gamma(K + 4)·K·c) + 1, that verify evaluates at each sample's K)",
            opset=_qoperator_opset,
        ),
    ),
    "qlinear_integer": (
        "qlinear_integer",
        Contract(
            output_types=lambda options, op: (QOPERATOR_OUTPUT_TYPES[options["op"]],),
            options=(
                Option(
                    "op",
                    str,
                    allowed=("QLinearConv", "QLinearMatMul", "QGemm", "QLinearMul", "QLinearGlobalAveragePool"),
                    doc="which QOperator op the rule replaces (the integer-accumulating ones, QLinearMul and "
                    "QLinearGlobalAveragePool)",
                ),
            ),
            emits=frozenset({"Cast", "Sub", "MatMul", "Conv", "Gemm", "Mul", "Round", "Add", "Clip", "ReduceSum"}),
            exactness=lambda options: EXACT,
            opset=lambda options, dtypes: (
                f"{kernel_opsets.FORMS['qlinear-integer']} (Round; Clip's bounds and Gemm's optional C as inputs; "
                f"QLinearGlobalAveragePool {kernel_opsets.OP_VERSIONS['reduce-sum-axes-input']}: ReduceSum's axes)"
            ),
        ),
    ),
    "static_fold": (
        "static_fold",
        Contract(
            output_types=lambda options, op: (
                ("int64",) if op in ("Shape", "Size") else (QUANTIZED_OUTPUT,) if op == "QuantizeLinear" else None
            ),
            options=(),
            emits=frozenset({"Identity"}),
            opset=lambda options, dtypes: "any",
        ),
    ),
    "decompose": (
        "decompose",
        Contract(
            output_types=lambda options, op: (
                ("input 0",)
                if op == "Erf"
                else ("input 0", "float32", "float32")
                if op == "LayerNormalization"
                else None
            ),
            options=(Option("op", str, allowed=("layer_norm", "erf"), doc="which op the rule decomposes"),),
            emits=frozenset({"ReduceMean", "Sub", "Mul", "Add", "Sqrt", "Div", "Abs", "Exp", "Neg", "Clip"}),
            exactness=lambda options: BOUNDED if options["op"] == "layer_norm" else APPROXIMATE,
            bound="LayerNormalization: float32 rounding of a two-pass mean and variance in another order than the "
            "kernel's, within 16·2^-24·(|y| + |γ|·(1 + |mean(x)|/σ(x))) at each output (measured; data-dependent: "
            "verify evaluates it per element at the node, formula layer-norm-two-pass)",
            preserves_shape=True,
            opset=lambda options, dtypes: "any",
        ),
    ),
    "movement_equivalent": (
        "movement_equivalent",
        Contract(
            output_types=_same_as_input_0,
            options=(),
            emits=frozenset({"Reshape", "GatherND", "Unsqueeze", "Transpose", "Cast"}),
            opset=lambda options, dtypes: (
                f"Flatten -> Reshape: {kernel_opsets.FORMS['reshape']}; "
                f"Gather -> GatherND: {kernel_opsets.FORMS['gather-nd']}"
            ),
        ),
    ),
    "nhwc_to_nchw": (
        "nhwc",
        Contract(
            output_types=_same_as_input_0,
            options=(),
            emits=frozenset({"Transpose", "MaxPool"}),
            opset=lambda options, dtypes: str(kernel_opsets.FORMS["max-pool-8bit"]),
        ),
    ),
    "qdq_wrap": (
        "qdq_wrap",
        Contract(
            output_types=_same_as_input_0,
            options=(),
            emits=frozenset({"DequantizeLinear", "QuantizeLinear", *QDQ_WRAP_OPS}),
            opset=lambda options, dtypes: kernel_opsets.describe(True, sorted(dtypes) if dtypes is not None else None),
        ),
    ),
    "standard_qdq": (
        "vendor_qdq",
        Contract(
            output_types=_qdq_output_types,
            options=(
                DIRECTION,
                AXIS_DEFAULT,
                REQUIRE_ZERO_POINT,
                FLOAT16,
                Option(
                    "int32_in_int64",
                    bool,
                    False,
                    doc="the vendor kernel dequantizes int32 as (int64)x - zp: use DequantizeLinear only for a "
                    "constant zero point of 0",
                ),
            ),
            emits=frozenset({"QuantizeLinear", "DequantizeLinear", "Reshape"}),
            preserves_shape=True,
            opset=lambda options, dtypes: kernel_opsets.describe(
                options["direction"] == "quantize", sorted(dtypes) if dtypes is not None else None
            ),
        ),
    ),
    "qdq_decompose": (
        "vendor_qdq",
        Contract(
            output_types=_qdq_output_types,
            options=(
                DIRECTION,
                AXIS_DEFAULT,
                REQUIRE_ZERO_POINT,
                FLOAT16,
                Option(
                    "overflow",
                    str,
                    "int64-wrap",
                    ("int64-wrap", "saturate"),
                    doc="integer quantize where x / scale is NaN, infinite or >= 2^63: Quark's x86 kernel "
                    "(int64-wrap) or onnxruntime's QuantizeLinear (saturate)",
                ),
                Option(
                    "float16_semantics",
                    str,
                    "strict",
                    ("strict", "kernel", "documented"),
                    doc="float16, where Quark's CPU kernel and its documentation disagree",
                ),
            ),
            emits=frozenset(
                {"Div", "Round", "Cast", "Add", "Clip", "Abs", "Less", "Where", "IsNaN", "Not", "Sub", "Mul", "Reshape"}
            ),
            preserves_shape=True,
            opset=_qdq_decompose_opset,
        ),
    ),
}

#: builder name -> its contract.
CONTRACTS: dict[str, Contract] = {name: contract for name, (_, contract) in _DECLARED.items()}
#: builder name -> the module under ``onnx_qrewrite.rewriter.builders`` whose import registers it.
MODULES: dict[str, str] = {name: module for name, (module, _) in _DECLARED.items()}
