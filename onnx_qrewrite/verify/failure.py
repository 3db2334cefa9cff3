"""Localising a failed comparison: which failing sample to look at, and against which original
(the plain one, or the one cut at the bounded replacements), before :mod:`.localize` names the first
node of the rewritten model where the values depart. Loaded only when a comparison fails."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from onnx_qrewrite.progress import stage
from onnx_qrewrite.verify.drift import DriftDecision
from onnx_qrewrite.verify.inputs import Sample

if TYPE_CHECKING:
    from onnx_qrewrite.verify.judge import Judgement
    from onnx_qrewrite.verify.localize import Localization
    from onnx_qrewrite.verify.models import Models
    from onnx_qrewrite.verify.options import Options
    from onnx_qrewrite.verify.runners import RunnerFactory


def localize_failure(
    models: Models,
    judgement: Judgement,
    samples: Sequence[Sample],
    options: Options,
    make_runner: RunnerFactory,
    decision: DriftDecision,
) -> Localization:
    """The first node of the rewritten model where the values depart, on a failing sample.

    The original's intermediate values always come from onnxruntime; the rewritten model's from
    the runtime that ran it, so on another runtime this names where *that runtime* departs (the
    rewrite's node or its own arithmetic), when it can run the model with them as outputs."""
    from onnx_qrewrite.verify.reanchor import localize_against_cut

    sample = _sample_to_localize(judgement, samples, options.runtime)
    # Every failure seen against the cut original (reanchor.localize_against_cut): the difference is
    # in the exact part of the rewrite, found against that original (against the plain one, a bounded
    # replacement upstream, within its bound, would be named).
    cut = judgement.anchored if judgement.anchored is not None and localize_against_cut(judgement.outputs) else None
    with stage(options.progress, "localizing"):
        # On another runtime, intermediate values are judged by drift (its rounding differs
        # everywhere by a little): what is named is where its numbers go wrong.
        from onnx_qrewrite.verify.localize import localize

        return localize(
            models.reference.proto if cut is None else cut.cut,
            models.rewritten_run.proto,
            sample if cut is None else cut.sample(sample),
            options.tolerances,
            make_runner,
            options.drift if decision.judged else None,
            runtime=options.runtime,
            runtime_drift=None if options.runtime == "onnxruntime" else options.drift,
            undefined=judgement.undefined,
        )


def _sample_to_localize(judgement: Judgement, samples: Sequence[Sample], runtime: str) -> Sample:
    """The first failing sample that no hazard set aside (else the first sample); on another
    runtime, the sample with the largest error, if it fails."""
    from onnx_qrewrite.verify.reanchor import SAMPLE_SUFFIX

    excluded = {h.sample for h in judgement.hazards}
    # (a bound row names a sample checked on the cut original's inputs with a suffix)
    failing_now = {
        s.removesuffix(SAMPLE_SUFFIX) for o in judgement.outputs for s in o.failed_samples if s not in excluded
    }
    sample = next((s for s in samples if s.name in failing_now), samples[0])
    if runtime != "onnxruntime":
        # Another runtime's rounding differs a little on every sample; where it goes wrong shows
        # best on the sample with the largest error.
        worst = max(
            (o for o in judgement.outputs if not o.passed and o.worst), key=lambda o: o.max_abs_error, default=None
        )
        if worst is not None and worst.worst is not None and worst.worst.sample in failing_now:
            sample = next(s for s in samples if s.name == worst.worst.sample)
    return sample
