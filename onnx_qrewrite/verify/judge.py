"""Judging a comparison: every output of every sample compared (element-wise, or by drift for
approximate rewrites), the failing samples a NaN hazard explains set aside (:mod:`.hazards`), and
each bounded replacement checked at its node (:mod:`.bounds`, against the re-anchored original of
:mod:`.reanchor`). What this decides is a :class:`Judgement`; the report is made from it."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from onnx_qrewrite.progress import ProgressSink
from onnx_qrewrite.rewriter import provenance
from onnx_qrewrite.verify.compare import (
    Tolerances,
    UndefinedLookup,
    ValueComparison,
    compare_values,
    merge_comparisons,
)
from onnx_qrewrite.verify.drift import DriftDecision, DriftThresholds, decide
from onnx_qrewrite.verify.inputs import Sample
from onnx_qrewrite.verify.models import Models, Source, provenance_key_absent
from onnx_qrewrite.verify.options import Options
from onnx_qrewrite.verify.runners import RunnerFactory
from onnx_qrewrite.verify.session import ModelRunner

if TYPE_CHECKING:
    from onnx_qrewrite.verify.hazards import Hazard
    from onnx_qrewrite.verify.reanchor import Anchored


logger = logging.getLogger(__name__)


class Judgement(NamedTuple):
    """One comparison per output (and per bounded replacement), and the samples set aside."""

    outputs: list[ValueComparison]
    hazards: list[Hazard]
    not_compared: str | None = None  # why nothing was compared, when nothing was
    #: The original cut at the bounded replacements, when it decided the outputs (verify/reanchor.py).
    anchored: Anchored | None = None
    #: Bounded replacements whose bound cannot be checked at their node (verify/bounds.py).
    unchecked: tuple[Any, ...] = ()
    #: The original's undefined elements, set aside in every comparison (verify/undefined.py).
    undefined: UndefinedLookup | None = None


def compared_with_itself(
    runner: ModelRunner, samples: Sequence[Sample], kept: dict[str, dict[str, np.ndarray]] | None
) -> Judgement:
    """ORIGINAL and REWRITTEN are one file: nothing is compared (a model agrees with itself), but
    ``--save-outputs`` still gets the outputs it asked for."""
    outputs = [_not_compared(name, type_name) for name, type_name in runner.output_types.items()]
    if kept is not None:
        kept.update({sample.name: runner.run(sample.feeds) for sample in samples})
    why = "ORIGINAL and REWRITTEN are the same file: a model compared with itself proves nothing"
    return Judgement(outputs, [], why)


def judge_outputs(
    models: Models,
    original_runner: ModelRunner,
    rewritten_runner: Any,
    make_runner: RunnerFactory,
    samples: Sequence[Sample],
    options: Options,
    drift: DriftThresholds | None,
    kept: dict[str, dict[str, np.ndarray]] | None,
) -> Judgement:
    """Every output of every sample compared (``drift``: judged by drift), the failing samples that
    a NaN hazard makes inconclusive set aside, then each bounded replacement checked at its node.
    With bounded replacements (onnxruntime, no drift), the outputs without an explicit tolerance
    are judged against the original re-anchored at their values (:func:`_reanchor`)."""
    names = list(original_runner.output_types)
    undefined = _undefined(models, samples, make_runner)
    per_output = run_samples(
        lambda sample: original_runner.run(sample.feeds),
        rewritten_runner,
        names,
        samples,
        options.tolerances,
        options.progress,
        kept,
        drift,
        undefined,
    )
    bounded = options.runtime == "onnxruntime" and not provenance_key_absent(models.rewritten, provenance.BOUND_KEY)
    anchored = _reanchor(models, names, samples, options, make_runner, undefined) if bounded and drift is None else None
    if anchored is not None:
        from onnx_qrewrite.verify.reanchor import judged_outputs

        per_output = judged_outputs(per_output, anchored, options.tolerances)
    hazards = _nan_hazards(per_output, samples, models.reference, make_runner)
    outputs = merge(
        per_output, original_runner.output_types, rewritten_runner.output_types, {h.sample for h in hazards}
    )
    if anchored is not None:
        outputs += anchored.boundary_rows()
    unchecked: tuple[Any, ...] = ()
    if bounded:
        from onnx_qrewrite.verify.bounds import check_bounds, unchecked_bounds

        # Bounded rewrites: each replacement within its recorded bound, on the original's own inputs
        # and on the cut original's (the bounds are stated against onnxruntime's kernels).
        outputs += check_bounds(models.original.proto, models.rewritten.proto, samples, make_runner, anchored)
        unchecked = tuple(unchecked_bounds(models.original.proto, models.rewritten.proto))
    return Judgement(outputs, hazards, anchored=anchored, unchecked=unchecked, undefined=undefined)


def _undefined(models: Models, samples: Sequence[Sample], make_runner: RunnerFactory) -> UndefinedLookup | None:
    """The elements of the original's values its kernels leave undefined (verify/undefined.py);
    None on the fast path, whose originals hold no vendor op (the only kernels known to)."""
    if models.original.fast:
        return None
    from onnx_qrewrite.verify.undefined import undefined_elements

    return undefined_elements(models.reference.proto, samples, lambda model: make_runner(model, "original"))


def _reanchor(
    models: Models,
    names: Sequence[str],
    samples: Sequence[Sample],
    options: Options,
    make_runner: RunnerFactory,
    undefined: UndefinedLookup | None = None,
) -> Anchored | None:
    """The original (as the outputs are compared with it) cut at the bounded replacements' outputs
    and run from the rewritten model's values there, with the outputs and the values the
    replacements read compared (verify/reanchor.py); None when no replacement is bounded."""
    from onnx_qrewrite.verify.bounds import bounded_rewrites
    from onnx_qrewrite.verify.reanchor import boundary_values, run_anchored

    rewrites = bounded_rewrites(models.original.proto, models.rewritten.proto)
    anchors = [n for r in rewrites for n in r.outputs]
    if not anchors:
        return None
    boundary = boundary_values(models.original.proto, models.rewritten.proto, rewrites)
    return run_anchored(
        models.reference.proto,
        models.rewritten_run.proto,
        anchors,
        names,
        samples,
        options.tolerances,
        make_runner,
        boundary,
        undefined,
    )


def _nan_hazards(
    per_output: Mapping[str, Sequence[tuple[str, ValueComparison]]],
    samples: Sequence[Sample],
    reference: Source,
    make_runner: RunnerFactory,
) -> list[Hazard]:
    """The failing samples whose difference a NaN reaching a kernel that is not deterministic on
    NaN explains: inconclusive, not a disagreement (see :mod:`.hazards`)."""
    failing = failing_samples(per_output)
    if not failing:
        return []
    feeds = {sample.name: sample.feeds for sample in samples}
    from onnx_qrewrite.verify.hazards import NanHazardCheck

    nan_check = NanHazardCheck(reference.proto, lambda model: make_runner(model, "original"))
    hazards = []
    for name in failing:
        hazard = nan_check.check(name, feeds[name])
        if hazard is not None:
            logger.info("sample %s is inconclusive: %s", name, hazard.describe())
            hazards.append(hazard)
    return hazards


def drift_decision(rewritten: Source, drift: DriftThresholds) -> DriftDecision:
    """Whether the outputs are judged by drift (approximate rewrites); a model whose bytes cannot
    hold the exactness key has no approximate rewrite, which spares walking its nodes."""
    no_approximate = provenance_key_absent(rewritten, provenance.EXACTNESS_KEY)
    return decide(drift.mode, rewritten.readable, {} if no_approximate else None)


Expected = Callable[[Sample], Mapping[str, np.ndarray]]


def run_samples(
    expected: Expected,
    rewritten: ModelRunner,
    names: Sequence[str],
    samples: Sequence[Sample],
    tolerances: Tolerances,
    progress: ProgressSink | None = None,
    keep: dict[str, dict[str, np.ndarray]] | None = None,
    drift: DriftThresholds | None = None,
    undefined: UndefinedLookup | None = None,
) -> dict[str, list[tuple[str, ValueComparison]]]:
    """Each shared output of each sample compared (output name -> one comparison per sample);
    ``keep``, when given, receives the expected outputs of each sample (for ``--save-outputs``);
    ``drift``, when given, judges the outputs by their drift (approximate rewrites);
    ``undefined``: the original's undefined elements, not compared."""
    shared = [n for n in names if n in rewritten.output_types]
    per_output: dict[str, list[tuple[str, ValueComparison]]] = {n: [] for n in shared}
    for done, sample in enumerate(samples, 1):
        reference = expected(sample)
        if keep is not None:
            keep[sample.name] = dict(reference)
        actual = rewritten.run(sample.feeds, shared)
        for name in shared:
            tol = tolerances.for_value(name, reference[name].dtype)
            judge = None if drift is None else drift.for_value(name)
            unset = None if undefined is None else undefined(name, sample.name, reference[name].shape)
            comparison = compare_values(name, sample.name, reference[name], actual[name], tol, judge, undefined=unset)
            per_output[name].append((sample.name, comparison))
        if progress is not None:
            progress("verifying samples", done, len(samples))
    return per_output


def failing_samples(per_output: Mapping[str, Sequence[tuple[str, ValueComparison]]]) -> list[str]:
    return list(dict.fromkeys(sample for parts in per_output.values() for sample, c in parts if not c.passed))


def merge(
    per_output: Mapping[str, Sequence[tuple[str, ValueComparison]]],
    expected_types: Mapping[str, str],
    rewritten_types: Mapping[str, str],
    excluded: set[str],
) -> list[ValueComparison]:
    """One comparison per output over the samples not excluded, then the interface problems."""
    comparisons = []
    for name, type_name in expected_types.items():
        if name not in per_output:
            comparisons.append(_interface_problem(name, type_name, "missing from the rewritten model"))
            continue
        parts = per_output[name]
        kept = [c for sample, c in parts if sample not in excluded]
        if kept:
            comparisons.append(merge_comparisons(kept))
        else:  # every sample excluded: nothing of this output was compared
            first = parts[0][1]
            comparisons.append(ValueComparison(first.name, first.dtype, first.shape, first.tolerance, first.integer))
    for name, type_name in rewritten_types.items():
        if name not in expected_types:
            comparisons.append(_interface_problem(name, type_name, "an output of the rewritten model only"))
    return comparisons


def _interface_problem(name: str, type_name: str, problem: str) -> ValueComparison:
    from onnx_qrewrite.verify.compare import Tolerance

    dtype = type_name.removeprefix("tensor(").removesuffix(")")
    return ValueComparison(
        name=name, dtype=dtype, shape=(), tolerance=Tolerance(0.0, 0.0, 0), integer=False, problem=problem
    )


def _not_compared(name: str, type_name: str) -> ValueComparison:
    from onnx_qrewrite.verify.compare import Tolerance

    dtype = type_name.removeprefix("tensor(").removesuffix(")")
    return ValueComparison(name=name, dtype=dtype, shape=(), tolerance=Tolerance(0.0, 0.0, 0), integer=False)
