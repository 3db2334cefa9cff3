"""The original model on the rewrite's runtime: whether a disagreement is the rewrite's or the runtime's.

``verify --runtime R`` runs the rewritten model on R and compares it with the original in
onnxruntime. When that fails, the difference can be R's own computation of the model (its
arithmetic, or a bug), rewritten or not. Measured on onnxruntime-qnn 2.7.0's HTP simulator: it runs
quantize_dynamic's DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul group on the float
activation, without its 8-bit quantization; on verify's wide-range sample of
``sample_models/dynamic_mlp.onnx`` (an input step of 71) its outputs are 2.6 from the model's
weight-only form (float activation) in onnxruntime and 21 from the model, so the model compared
with a copy of itself fails (``python benchmarks/target_experiments.py qnn-dynamic``). OpenVINO
2026.4.1 computes uint16 Q/DQ models wrongly, as given and rewritten. Neither is the rewrite's
doing, and a failing verdict alone does not say so.

So when an output fails on another runtime, verify also runs the original itself on R, on the
failing samples, and reports how far it is from onnxruntime and how far the rewrite on R is from
it. The verdict does not change and no tolerance widens: the model the user deploys computes those
numbers on R, and a runtime that computes wrong numbers must fail (issue 11). What changes is that
the report says whose difference it is: the runtime's (the original on R is as far, and the rewrite
computes there what the original does), the rewrite's (the original on R agrees), or both. An
original that R cannot load (often why it was rewritten) leaves the question open, and the report
says that instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from onnx_qrewrite._dataclass import dataclass
from onnx_qrewrite.errors import QRewriteError
from onnx_qrewrite.verify.compare import ValueComparison, compare_values, merge_comparisons

if TYPE_CHECKING:
    from onnx_qrewrite.verify.drift import DriftThresholds
    from onnx_qrewrite.verify.inputs import Sample
    from onnx_qrewrite.verify.options import Options

__all__ = ["FINDINGS", "RuntimeBaseline", "runtime_baseline"]

#: What the baseline found: whose difference the failure is.
FINDINGS = ("runtime", "rewrite", "both", "not-run")


@dataclass(frozen=True)
class RuntimeBaseline:
    """The original run on the rewrite's runtime, on the samples where an output failed."""

    runtime: str
    samples: tuple[str, ...]
    #: Why the original does not load or run on the runtime (then nothing else is known).
    not_run: str | None = None
    #: Per output: the original on the runtime against the original in onnxruntime.
    original: tuple[ValueComparison, ...] = ()
    #: Per output: the rewrite on the runtime against the original on the runtime.
    rewrite: tuple[ValueComparison, ...] = ()

    @property
    def finding(self) -> str:
        """One of :data:`FINDINGS`: ``runtime`` (the original on the runtime is off too, and the
        rewrite computes there what it does), ``rewrite`` (the original on the runtime agrees with
        onnxruntime), ``both``, or ``not-run`` (the original does not run there)."""
        if self.not_run is not None:
            return "not-run"
        if all(c.passed for c in self.original):
            return "rewrite"
        return "runtime" if all(c.passed for c in self.rewrite) else "both"

    def lines(self) -> list[str]:
        """The report table's lines: the finding, then one line per output of each comparison."""
        rt, where = self.runtime, f"sample{'s' * (len(self.samples) != 1)} {', '.join(self.samples)}"
        if self.not_run is not None:
            return [f"the original on {rt}: not run ({self.not_run}); whose difference this is stays open"]
        head = {
            "runtime": f"the original itself on {rt} differs from onnxruntime too, and the rewrite on {rt} "
            f"computes what the original does there: {rt}'s own computation of this model (its arithmetic, "
            "or a bug), not the rewrite",
            "rewrite": f"the original on {rt} agrees with onnxruntime: the difference comes with the rewrite",
            "both": f"the original on {rt} differs from onnxruntime, and the rewrite on {rt} differs from it "
            f"as well: part is {rt}'s own computation, part the rewrite",
        }[self.finding]
        lines = [f"the original on {rt} ({where}): {head}"]
        for a, b in zip(self.original, self.rewrite, strict=True):
            lines.append(
                f"  {a.name}: original on {rt} vs onnxruntime {_describe(a)}; rewrite vs original, both on {rt} "
                f"{_describe(b)}"
            )
        return lines

    def to_dict(self, comparison_dict: Any) -> dict[str, Any]:
        """The JSON report's ``runtime_baseline`` (``comparison_dict`` renders one comparison)."""
        return {
            "runtime": self.runtime,
            "finding": self.finding,
            "samples": list(self.samples),
            "not_run": self.not_run,
            "original_vs_onnxruntime": [comparison_dict(c) for c in self.original],
            "rewrite_vs_original": [comparison_dict(c) for c in self.rewrite],
        }


def _describe(c: ValueComparison) -> str:
    if c.problem is not None:
        return f"not comparable ({c.problem})"
    verdict = "within" if c.passed else f"{c.mismatches} of {c.elements} elements beyond"
    return f"max abs {c.max_abs_error:.3g}, {verdict} {c.tolerance.describe(c.integer)}"


def runtime_baseline(
    original: Any,
    reference: Any,
    rewritten: Any,
    samples: Sequence[Sample],
    failed: Sequence[str],
    options: Options,
    drift: DriftThresholds | None = None,
) -> RuntimeBaseline:
    """The original model ``original`` (a ModelProto) on ``options.runtime``, run on the ``failed``
    samples beside ``reference`` (its onnxruntime runner) and ``rewritten`` (the rewrite's runner on
    the runtime). ``drift``: the rewrite is approximate and judged by drift against the original on
    the runtime too (its numerics differ by design)."""
    from onnx_qrewrite.verify.runtimes import make_runner

    chosen = [s for s in samples if s.name in set(failed)]
    names = tuple(s.name for s in chosen)
    try:
        runner = make_runner(
            options.runtime,
            original,
            label="the original",
            threads=options.threads,
            shapes=options.generation.shapes,
            dims=options.generation.dims,
        )
        on_runtime = [runner.run(s.feeds) for s in chosen]
    except QRewriteError as exc:
        return RuntimeBaseline(options.runtime, names, not_run=str(exc).splitlines()[0])
    expected = [reference.run(s.feeds) for s in chosen]
    actual = [rewritten.run(s.feeds) for s in chosen]
    return RuntimeBaseline(
        options.runtime,
        names,
        original=_per_output(names, expected, on_runtime, options),
        rewrite=_per_output(names, on_runtime, actual, options, drift),
    )


def _per_output(
    samples: Sequence[str],
    first: Sequence[Mapping[str, np.ndarray]],
    second: Sequence[Mapping[str, np.ndarray]],
    options: Options,
    drift: DriftThresholds | None = None,
) -> tuple[ValueComparison, ...]:
    """``second`` against ``first``, sample by sample, merged per output (verify's tolerances, or
    ``drift``'s thresholds)."""
    rows = []
    for name in first[0]:
        if name not in second[0]:
            continue
        parts = []
        for sample, a, b in zip(samples, first, second, strict=True):
            tol = options.tolerances.for_value(name, np.asarray(a[name]).dtype)
            judge = None if drift is None else drift.for_value(name)
            parts.append(compare_values(name, sample, a[name], b[name], tol, judge))
        rows.append(merge_comparisons(parts))
    return tuple(rows)
