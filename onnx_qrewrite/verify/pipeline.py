"""The comparison of two models, step by step: load (:mod:`.models`, :mod:`.samples`), run
(:mod:`.runners`), judge (:mod:`.judge`), localise a failure (:mod:`.failure`), report. The steps
pass NamedTuples one way down this list; :func:`run_comparison` is the only place that calls them all.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from onnx_qrewrite.verify.drift import DriftDecision
from onnx_qrewrite.verify.inputs import save_samples
from onnx_qrewrite.verify.judge import Judgement, compared_with_itself, drift_decision, judge_outputs
from onnx_qrewrite.verify.models import Models, load_models
from onnx_qrewrite.verify.options import ModelLike, Options, check_output_names
from onnx_qrewrite.verify.report import VerifyReport, VerifySettings
from onnx_qrewrite.verify.runners import RunnerFactory, start_sessions
from onnx_qrewrite.verify.samples import GivenSamples, resolve_samples
from onnx_qrewrite.verify.versions import versions

if TYPE_CHECKING:
    from onnx_qrewrite.verify.localize import Localization
    from onnx_qrewrite.verify.runtime_baseline import RuntimeBaseline


logger = logging.getLogger(__name__)


def run_comparison(
    original: ModelLike, rewritten: ModelLike, options: Options, *, same_file: bool, fast: bool
) -> VerifyReport:
    """The verification; ``fast``: from the files' bytes, without parsing the models unless a
    check needs their graphs (:class:`.models.NotFast` when it cannot give the full path's answer)."""
    models = load_models(original, rewritten, options, fast=fast)
    make_runner = RunnerFactory(options, models.original.label, models.rewritten.label, models.reference_kernels)
    original_runner, rewritten_runner = start_sessions(models, make_runner, options, same_file=same_file, fast=fast)
    check_output_names(options.tolerances, options.drift, original_runner.output_types, "the model has")
    decision = drift_decision(models.rewritten, options.drift)
    defaults = options.runtime == "onnxruntime"  # other runtimes' runners feed declared inputs only
    given = resolve_samples(options.inputs, models.original.readable, options.generation, defaults)
    if options.save_inputs is not None:
        save_samples(options.save_inputs, given.samples)
    logger.info("comparing %d output(s) on %d sample(s)", len(original_runner.output_types), len(given.samples))
    kept: dict[str, dict[str, np.ndarray]] | None = {} if options.save_outputs is not None else None
    if same_file:
        judgement = compared_with_itself(original_runner, given.samples, kept)
    else:
        judge = options.drift if decision.judged else None
        judgement = judge_outputs(
            models, original_runner, rewritten_runner, make_runner, given.samples, options, judge, kept
        )
    if options.save_outputs is not None and kept is not None:
        from onnx_qrewrite.verify.stored import save_outputs as save_stored_outputs

        save_stored_outputs(options.save_outputs, given.samples, kept, models.original.label)
    baseline = _runtime_baseline(models, original_runner, rewritten_runner, given, judgement, options, decision)
    localization = None
    if options.localize_failures and not all(o.passed for o in judgement.outputs):
        from onnx_qrewrite.verify.failure import localize_failure

        localization = localize_failure(models, judgement, given.samples, options, make_runner, decision)
    return _report(models, judgement, given, decision, localization, options, baseline)


def _runtime_baseline(
    models: Models,
    original_runner: Any,
    rewritten_runner: Any,
    given: GivenSamples,
    judgement: Judgement,
    options: Options,
    decision: DriftDecision,
) -> RuntimeBaseline | None:
    """On another runtime, when an output fails: the original itself run there on the failing
    samples (verify/runtime_baseline.py), so the report says whose difference it is."""
    excluded = {h.sample for h in judgement.hazards}
    failed = [s for o in judgement.outputs if o.role == "output" for s in o.failed_samples if s not in excluded]
    if options.runtime == "onnxruntime" or not failed:
        return None
    from onnx_qrewrite.verify.runtime_baseline import runtime_baseline

    drift = options.drift if decision.judged else None
    return runtime_baseline(
        models.original.proto, original_runner, rewritten_runner, given.samples, failed, options, drift
    )


def _report(
    models: Models,
    judgement: Judgement,
    given: GivenSamples,
    decision: DriftDecision,
    localization: Localization | None,
    options: Options,
    baseline: RuntimeBaseline | None = None,
) -> VerifyReport:
    """The report: the verdict's evidence and every setting that decided it."""
    return VerifyReport(
        original=models.original.label,
        rewritten=models.rewritten.label,
        outputs=tuple(judgement.outputs),
        samples=tuple(given.samples),
        settings=VerifySettings(
            options.session,
            options.tolerances,
            given.generation,
            given.inputs_file,
            models.reference_kernels,
            models.vendor_nodes,
            value_ranges=given.ranges,
            runtime=options.runtime_info,
            drift=options.drift,
            drift_decision=decision,
            u8s8_reference_nodes=models.u8s8_nodes,
            anchors=() if judgement.anchored is None else judgement.anchored.anchors,
        ),
        versions=versions(models.reference_kernels),
        localization=localization,
        duration_seconds=time.perf_counter() - options.started,
        excluded=tuple(judgement.hazards),
        not_compared=judgement.not_compared,
        unchecked_bounds=judgement.unchecked,
        runtime_baseline=baseline,
    )
