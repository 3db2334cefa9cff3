"""LayerNormalization and Erf written with elementwise ops and ReduceMean (form
``elementwise-decompositions``), for targets that run those but not the two ops (onnxruntime's
NNAPI table lists neither; rules/targets/nnapi.toml).

**LayerNormalization(x, γ, β; axis, epsilon)** over the axes from ``axis`` to the last:
``d = x - ReduceMean(x)``, ``y = d / Sqrt(ReduceMean(d·d) + ε) · γ + β`` (two passes, as the
definition reads). onnxruntime's kernel sums in its own order, so the two differ by float32
rounding; how much grows with the ratio of the mean to the spread of x (cancellation in
``x - mean``): measured on a grid of means 0-1000 and spreads 1e-3-100 (hidden 64, γ ~ N(0, 1),
onnxruntime 1.31.1) within ``16·2^-24·(|y| + |γ|·(1 + |mean(x)|/σ(x)))`` at each output, the worst
at half of it (``tests/test_decompose.py``). **Bounded** by that, which depends on the data: verify
evaluates it at the node on each sample (formula ``layer-norm-two-pass``, ``verify/contrib_bounds.py``).
Given way: ``stash_type`` other than 1, the Mean / InvStdDev outputs read, an axis that is not the
last and a rank that is not recorded.

**Erf(x)** has no exact decomposition: Abramowitz and Stegun 7.1.26,
``erf(|x|) ≈ 1 - (a1·t + a2·t² + a3·t³ + a4·t⁴ + a5·t⁵)·exp(-x²)`` with ``t = 1 / (1 + p·|x|)``
(|error| ≤ 1.5e-7 in exact arithmetic), odd through ``Clip(x·2^126, -1, 1)`` (NNAPI has no Sign:
±1 from |x| ≥ 2^-126, 0 at 0; ±inf give ±1, NaN NaN). In float32 against onnxruntime's Erf: at most
6.7e-7 absolute on every float32 bit pattern with |x| ≤ 8 (measured, onnxruntime 1.31.1), and the
same values beyond (``tests/test_decompose.py`` checks a stride of them). **Approximate**:
runs only with ``--allow-approximate`` (a profile's ``consent = "user"``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from onnx import TensorProto

from onnx_qrewrite.rewriter import kernel_opsets
from onnx_qrewrite.rewriter.builders import Emitter, NoMatch, NotApplicable, Plan, Site, register
from onnx_qrewrite.rewriter.builders._qdq import value_shape
from onnx_qrewrite.rewriter.builders.contracts import CONTRACTS, LAYER_NORM_TWO_PASS_FORMULA

__all__ = ["ERF_COEFFICIENTS", "DecomposeBuilder"]

#: Abramowitz and Stegun 7.1.26: p, a1..a5.
ERF_COEFFICIENTS = (0.3275911, 0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


def _float32(site: Site, *names: str) -> None:
    """The op's inputs share one type (its schema's T): float32 by every one that is known, and at
    least one known."""
    known = [t for t in (site.value_type(n) for n in names if n) if t is not None]
    if not known or any(t != TensorProto.FLOAT for t in known):
        raise NoMatch("not float32 (the decompositions are measured on float32)")


class DecomposeBuilder:
    """LayerNormalization -> ReduceMean/Sub/Mul/Add/Sqrt/Div; Erf -> Abramowitz-Stegun 7.1.26."""

    name = "decompose"
    contract = CONTRACTS["decompose"]

    def quantized_dtype(self, site: Site) -> str | None:
        return None

    def check(self, site: Site, options: Mapping[str, Any]) -> Plan:
        op = site.node.op_type
        if op == "Erf":
            _float32(site, site.input(0))
            return Plan(notes=("Abramowitz-Stegun 7.1.26 (|error| <= 6.7e-7 measured)",))
        if op != "LayerNormalization":
            raise NotApplicable(f"{op}: this builder decomposes LayerNormalization and Erf")
        site.no_unknown_attributes({"axis", "epsilon", "stash_type"})
        _float32(site, *site.node.input)
        if any(site.node.output[1:]):
            raise NoMatch("the Mean / InvStdDev outputs are read; not decomposed")
        if int(site.attribute("stash_type", 1)) != 1:
            raise NoMatch("stash_type other than 1 is not decomposed")
        axis = int(site.attribute("axis", -1))
        if axis != -1:
            shape = value_shape(site.scope, site.input(0), site.same_shape_ops)
            if shape is None or axis not in (len(shape) - 1, -1):
                raise NoMatch(f"axis {axis} is not the last axis (or the rank is not recorded)")
        return Plan(notes=("two-pass mean and variance",), bound_formula=LAYER_NORM_TWO_PASS_FORMULA)

    def build(self, site: Site, emit: Emitter, options: Mapping[str, Any], plan: Plan) -> None:
        if site.node.op_type == "Erf":
            self._erf(site, emit)
        else:
            self._layer_norm(site, emit)

    @staticmethod
    def _mean(emit: Emitter, x: str) -> str:
        return emit.reduce_last_axis("ReduceMean", x)

    def _layer_norm(self, site: Site, emit: Emitter) -> None:
        x, gamma = site.input(0), site.input(1)
        beta = site.input(2) if len(site.node.input) > 2 else ""
        eps = np.float32(site.attribute("epsilon", 1e-5))
        d = emit.op1("Sub", [x, self._mean(emit, x)])
        variance = self._mean(emit, emit.op1("Mul", [d, d]))
        root = emit.op1("Sqrt", [emit.op1("Add", [variance, emit.const(eps)])])
        y = site.node.output[0]
        scaled = emit.op1("Mul", [emit.op1("Div", [d, root]), gamma], None if beta else y)
        if beta:
            emit.op1("Add", [scaled, beta], y)

    @staticmethod
    def _erf(site: Site, emit: Emitter) -> None:
        x = site.input(0)
        p, *a = (np.float32(c) for c in ERF_COEFFICIENTS)
        magnitude = emit.op1("Abs", [x])
        one = emit.const(np.float32(1.0))
        t = emit.op1("Div", [one, emit.op1("Add", [one, emit.op1("Mul", [magnitude, emit.const(p)])])])
        poly = emit.op1("Mul", [t, emit.const(a[4])])
        for coefficient in reversed(a[:4]):  # Horner: t·(a1 + t·(a2 + t·(a3 + t·(a4 + t·a5))))
            poly = emit.op1("Mul", [t, emit.op1("Add", [poly, emit.const(coefficient)])])
        gauss = emit.op1("Exp", [emit.op1("Neg", [emit.op1("Mul", [x, x])])])
        positive = emit.op1("Sub", [one, emit.op1("Mul", [poly, gauss])])
        # sign(x) without Sign (NNAPI has none): x·2^126 clipped to [-1, 1] is ±1 from |x| >= 2^-126,
        # 0 at 0, NaN at NaN; below 2^-126 it is smaller, where erf(x) ~ 1.13·x is below 1.5e-38.
        big = emit.op1("Mul", [x, emit.const(np.float32(2.0**126))])
        low, high = np.float32(-1.0), np.float32(1.0)
        if emit.opset >= kernel_opsets.OP_VERSIONS["clip-inputs"]:
            sign = emit.op1("Clip", [big, emit.const(low), emit.const(high)])
        else:
            sign = emit.op1("Clip", [big], min=float(low), max=float(high))
        emit.op1("Mul", [positive, sign], site.node.output[0])


register(DecomposeBuilder())
