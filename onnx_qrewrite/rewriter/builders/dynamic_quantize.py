"""DynamicQuantizeLinear -> primitive ops.

``semantics = "onnxruntime"`` (default) reproduces onnxruntime's kernel bit for bit, in 13 ops::

    lo, hi   = Min(ReduceMin(x), 0), Max(ReduceMax(x), 0)
    span     = hi - lo
    y_scale  = Where(spread = Cast<bool>(span), step = span / 255, 1)      # (1)
    t        = lo / y_scale
    y_zp     = QuantizeLinear(t_ok = Where(IsNaN(t), -255, t), scale=-1)    # (2), (3)
    y        = QuantizeLinear(x, y_scale, y_zp)

(1) onnxruntime uses scale 1.0 when max == min (all zeros); the spec body divides 0/0. The guard
    tests the range (``hi == lo`` exactly when ``hi - lo`` is 0, since hi >= 0 >= lo and IEEE
    subtraction of distinct values is never 0; a bool Cast is that test in one op with one input),
    never ``scale == 0``: for tiny denormal ranges the scale underflows to 0.0 while hi != lo, and
    onnxruntime keeps that 0.0 (NUMERICS.md: 495,582 of 1,000 values differ with the wrong guard).
(2) onnxruntime computes ``zp0 = 0 - lo / scale`` and ``max(qmin, min(qmax, zp0))`` with
    std::min/max, which turns a NaN zero point (input holding -inf, a scale that underflowed to 0
    over a zero minimum: 0/0) into 255; QuantizeLinear maps NaN to 0, so NaN becomes -255 first.
(3) One QuantizeLinear does the negation, clipping, rounding and cast of the kernel's
    ``Cast(Round(Clip(0 - t, 0, 255)))``: dividing by -1 is exact (so is multiplying by -1, for
    runtimes that multiply by the reciprocal), ``0 - t`` and ``-t`` differ only in the sign of a
    zero, which rounds to the same 0, and for every t rounding half to even and then saturating
    gives what clipping to [0, 255] and then rounding gives (both monotone, and 0 and 255 are
    integers). The 16-op form this replaces (Sub, Clip, Round, Cast for the zero point) cost 3 more
    scalar ops per quantizer at inference (benchmarks/bench.py, "infer" cases).

NaN. From 8 elements on, onnxruntime's min/max search (MLAS, AVX kernel on x86-64) runs vector
min/max instructions whose NaN handling depends on the NaN's lane, and on thread count: nothing to
match. Below 8 elements it is a scalar ``std::min``/``std::max`` loop started at +-FLT_MAX, which
skips every NaN, deterministically (measured on onnxruntime 1.31.1, every NaN position, with +-inf,
1 and 2 threads: ``tests/test_dynamic_quantize.py``). When the input's shape is statically known to
hold 1-7 elements, the range is therefore taken over ``Where(IsNaN(x), 0, x)`` (0 is neutral: the
range is clamped to include 0 anyway), so an all-NaN input gives scale 1.0 and zero point 0 as in
the kernel; ``y`` still quantizes the NaN itself (to 0, as the kernel does). Larger or unknown
shapes get no extra op by default. Option ``nan_guard = "run-time"`` also guards an input whose
shape is not recorded (unless its recorded dimensions already hold 8 or more elements): the NaN
replacement is chosen at run time, ``Where(IsNaN(x), Where(Size(x) < 8, 0, NaN), x)``, which is
``Where(IsNaN(x), 0, x)`` below 8 elements and reads like ``x`` from 8 on (a NaN stays a NaN, where
nothing can be matched). It costs 4 ops per quantizer at inference (two of them scalar), so it is
asked for, not the default (``benchmarks/nan_guard_cost.py``). (MLAS's generic kernel, used on ARM
and on x86 without AVX, vectorizes from 4 elements: on those CPUs the kernel's own NaN result for
4-7 elements may differ.)

``semantics = "spec"`` emits the ONNX function body exactly as onnx defines it (taken from the
installed onnx's schema), for users who want the specification, not one runtime's behaviour.

Every op used exists with these forms at default-domain opsets 11-26: ReduceMin/ReduceMax with
keepdims=0 and no axes reduce over all dimensions at every version (axes became an input at 18,
which we never pass).
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Mapping
from typing import Any, Protocol, cast

import numpy as np

from onnx_qrewrite import _onnx as onnx
from onnx_qrewrite.errors import InvalidModelError
from onnx_qrewrite.rewriter import kernel_opsets
from onnx_qrewrite.rewriter.builders import Emitter, Plan, Site, register
from onnx_qrewrite.rewriter.builders.contracts import CONTRACTS
from onnx_qrewrite.rewriter.graph import dtype_name, known_shape

#: Below this many elements onnxruntime's x86-64 (AVX) min/max search is a scalar loop that skips
#: NaN; from it on, vector instructions make a NaN's effect position-dependent (module docstring).
SCALAR_MINMAX_BELOW = 8


#: The range's NaN guard a quantizer gets (module docstring): none, the static one (the shape is
#: recorded to hold 1-7 elements), or the run-time one (the shape is not recorded; option nan_guard).
NO_GUARD, STATIC_GUARD, RUN_TIME_GUARD = "none", "static", "run-time"


def nan_guard(site: Site, x: str, option: str) -> str:
    """Which NaN guard the range over ``x`` gets: :data:`STATIC_GUARD` where onnxruntime's min/max
    search over it is known to be its scalar loop, which skips NaN (the shape is recorded to hold
    1-7 elements); :data:`RUN_TIME_GUARD` where that is unknown and ``option`` asks for it; else
    :data:`NO_GUARD`. Shared by every expansion that computes a DynamicQuantizeLinear: this op, and
    DynamicQuantizeMatMul (whose kernel quantizes A with the same search: measured in
    tests/test_lower_integer_matmul.py)."""
    shape = site.value_shape(x)
    dims = known_shape(shape)
    if dims is not None:
        return STATIC_GUARD if 0 < math.prod(dims) < SCALAR_MINMAX_BELOW else NO_GUARD
    recorded = math.prod(d for d in shape or () if d is not None)
    if option == RUN_TIME_GUARD and recorded < SCALAR_MINMAX_BELOW:
        return RUN_TIME_GUARD
    return NO_GUARD


GUARD_NOTES = {
    STATIC_GUARD: f"at most {SCALAR_MINMAX_BELOW - 1} elements: NaN skipped by min/max, as the kernel does",
    RUN_TIME_GUARD: f"shape not recorded: NaN skipped by min/max at run time below {SCALAR_MINMAX_BELOW} elements, "
    "as the kernel does",
}


@functools.cache
class _SchemaWithFunctions(Protocol):
    """The C++ method of onnx's OpSchema that its type stubs do not list (onnx 1.17-1.23 have it)."""

    def get_function_with_opset_version(self, opset: int) -> bytes: ...


def spec_body(opset: int) -> onnx.FunctionProto:
    """The function body onnx defines for DynamicQuantizeLinear, as visible at ``opset``."""
    schema = cast(_SchemaWithFunctions, onnx.defs.get_schema("DynamicQuantizeLinear", opset, ""))
    function = onnx.FunctionProto()
    function.ParseFromString(schema.get_function_with_opset_version(opset))
    return function


@functools.cache
def _plan(semantics: str, guard: str) -> Plan:
    """The plan of every node with these facts: one shared (immutable) object, not one per node."""
    notes = [f"semantics={semantics}"]
    if guard in GUARD_NOTES:
        notes.append(GUARD_NOTES[guard])
    return Plan(
        min_opset=kernel_opsets.FORMS["dynamic-quantize-linear"],
        notes=tuple(notes),
        data=types.MappingProxyType({"nan_guard": guard}),
    )


class DynamicQuantizeLinearBuilder:
    """Expands DynamicQuantizeLinear into primitive ops valid at the model's opset (11-26)."""

    name = "dynamic_quantize_linear"
    contract = CONTRACTS["dynamic_quantize_linear"]
    #: ``check`` reads the graph only through the Site's queries: decided once per structure (_facts.py).
    memo_check = True
    #: ``template_key`` reads only the rule's options, the plan, the scope's default opset and the
    #: node's structure (op, attributes, which names are empty or equal): the build makes it once
    #: per structure and plan (apply.py).
    template_key_of_structure = True

    def quantized_dtype(self, site: Site) -> str | None:
        return "uint8"  # DynamicQuantizeLinear always produces uint8

    def check(self, site: Site, options: Mapping[str, Any]) -> Plan:
        semantics = options["semantics"]
        inputs = site.inputs
        if len(inputs) != 1 or not inputs[0]:
            raise InvalidModelError(f"node {site.label}: DynamicQuantizeLinear takes exactly one input")
        elem = site.elem_type(inputs[0])
        if elem is not None and elem != onnx.TensorProto.FLOAT:
            raise InvalidModelError(
                f"node {site.label}: DynamicQuantizeLinear input {inputs[0]!r} is "
                f"{dtype_name(elem)}; the operator takes float32 only"
            )
        guard = nan_guard(site, inputs[0], options["nan_guard"]) if semantics == "onnxruntime" else NO_GUARD
        return _plan(semantics, guard)

    def template_key(self, site: Site, options: Mapping[str, Any], plan: Plan) -> tuple:
        """Same structure for every node with the same semantics, opset and present outputs."""
        present = tuple(map(bool, site.outputs))  # (no generator frame: once per stamped node)
        return (options["semantics"], site.scope.default_opset, present, plan.data.get("nan_guard", NO_GUARD))

    def build(self, site: Site, emit: Emitter, options: Mapping[str, Any], plan: Plan) -> None:
        outputs = list(site.node.output) + [""] * (3 - len(site.node.output))
        if options["semantics"] == "spec":
            self._build_spec(site, emit, outputs)
        else:
            self.expand_onnxruntime(site.node.input[0], emit, outputs, guard=plan.data.get("nan_guard", NO_GUARD))

    @staticmethod
    def expand_onnxruntime(x: str, emit: Emitter, outputs: list[str], *, guard: str = NO_GUARD) -> None:
        """The 13-op expansion; ``guard`` (see :func:`nan_guard`) takes the range over
        ``Where(IsNaN(x), 0, x)`` as the kernel's scalar min/max loop does: always (static), or
        where ``x`` holds fewer than 8 elements at run time (the NaN stays NaN from 8 on)."""
        y, y_scale, y_zero_point = outputs
        zero = emit.const(0.0, np.float32)
        ranged = x
        if guard != NO_GUARD:
            fill = zero
            if guard == RUN_TIME_GUARD:
                size = emit.op1("Size", [x], hint="size")
                small = emit.op1("Less", [size, emit.const(SCALAR_MINMAX_BELOW, np.int64)], hint="small")
                fill = emit.op1("Where", [small, zero, emit.const(np.nan, np.float32)], hint="fill")
            ranged = emit.op1("Where", [emit.op1("IsNaN", [x], hint="x_nan"), fill, x], hint="x_ok")
        one = emit.const(1.0, np.float32)
        qmax = emit.const(255.0, np.float32)
        minus_one = emit.const(-1.0, np.float32)
        minus_qmax = emit.const(-255.0, np.float32)
        # Short hints: created names are "<replaced node>/<hint>", and a chain of 20k quantizers
        # repeats each hint ~3 times per quantizer (node, value, readers); names are most of the
        # output's bytes. They follow the formula in the module docstring.
        x_min = emit.op1("ReduceMin", [ranged], keepdims=0, hint="min")
        x_max = emit.op1("ReduceMax", [ranged], keepdims=0, hint="max")
        lo = emit.op1("Min", [x_min, zero], hint="lo")
        hi = emit.op1("Max", [x_max, zero], hint="hi")
        span = emit.op1("Sub", [hi, lo], hint="span")
        step = emit.op1("Div", [span, qmax], hint="step")
        spread = emit.op1("Cast", [span], to=onnx.TensorProto.BOOL, hint="spread")
        scale = emit.op1("Where", [spread, step, one], y_scale, hint="scale")
        t = emit.op1("Div", [lo, scale], hint="t")
        t_nan = emit.op1("IsNaN", [t], hint="nan")
        guarded = emit.op1("Where", [t_nan, minus_qmax, t], hint="t_ok")
        zp = emit.op1("QuantizeLinear", [guarded, minus_one], y_zero_point, hint="zp")
        emit.op1("QuantizeLinear", [x, scale, zp], y, hint="y")

    @staticmethod
    def _build_spec(site: Site, emit: Emitter, outputs: list[str]) -> None:
        body = spec_body(max(kernel_opsets.FORMS["dynamic-quantize-linear"], site.scope.default_opset))
        rename = {body.input[0]: site.node.input[0]}
        for formal, given in zip(body.output, outputs, strict=True):
            if given:
                rename[formal] = given

        def actual(formal: str) -> str:
            if formal and formal not in rename:
                rename[formal] = emit.fresh(formal)
            return rename.get(formal, "")

        for node in body.node:
            ins = [actual(i) for i in node.input]
            outs = [actual(o) for o in node.output]
            emit.op(
                node.op_type, ins, outs, domain=node.domain, hint=node.op_type, **{a.name: a for a in node.attribute}
            )


register(DynamicQuantizeLinearBuilder())
