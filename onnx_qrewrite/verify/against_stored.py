"""``--load-outputs``: the rewritten model against outputs stored by ``--save-outputs``
(:mod:`.stored`) instead of against a run of the original. Loaded only when asked for."""

from __future__ import annotations

import os
import time

from onnx_qrewrite.errors import UsageError
from onnx_qrewrite.progress import stage
from onnx_qrewrite.verify.drift import decide
from onnx_qrewrite.verify.inputs import save_samples
from onnx_qrewrite.verify.judge import failing_samples, merge, run_samples
from onnx_qrewrite.verify.models import load_full
from onnx_qrewrite.verify.options import ModelLike, Options, check_output_names
from onnx_qrewrite.verify.report import VerifyReport, VerifySettings
from onnx_qrewrite.verify.runners import open_rewritten
from onnx_qrewrite.verify.session import ModelRunner
from onnx_qrewrite.verify.versions import versions


def verify_stored(rewritten: ModelLike, path: str | os.PathLike[str], options: Options) -> VerifyReport:
    """``--load-outputs``: the rewritten model against outputs stored by ``--save-outputs``."""
    from onnx_qrewrite.verify.localize import Localization
    from onnx_qrewrite.verify.stored import load_outputs as load_stored_outputs

    session, tolerances, drift, progress = options.session, options.tolerances, options.drift, options.progress
    stored = load_stored_outputs(path)
    with stage(progress, "loading models"):
        source = load_full(rewritten, "rewritten")
    rewritten_model, rewritten_label = source.proto, source.label
    with stage(progress, "starting onnxruntime"):
        runner = open_rewritten(source, lambda m, _side: ModelRunner(m, label=rewritten_label, settings=session))
    expected_inputs = set(runner.input_names)
    for sample in stored.samples:
        given = set(sample.feeds)
        if given != expected_inputs:
            name = sorted(given ^ expected_inputs)[0]
            where = "is not an input of the model" if name in given else "has no stored value"
            raise UsageError(f"--load-outputs: {path}: sample {sample.name!r}: input {name!r} {where}")
    names = stored.output_names
    check_output_names(tolerances, drift, names, "the stored outputs have")
    decision = decide(drift.mode, rewritten_model)
    if options.save_inputs is not None:
        save_samples(options.save_inputs, stored.samples)
    per_output = run_samples(
        stored.run, runner, names, stored.samples, tolerances, progress, drift=drift if decision.judged else None
    )
    first = stored.outputs[stored.samples[0].name]
    expected_types = {n: f"tensor({first[n].dtype.name})" for n in names}
    outputs = merge(per_output, expected_types, runner.output_types, set())
    localization = None
    if not all(o.passed for o in outputs):
        first_failing = next(iter(failing_samples(per_output)), stored.samples[0].name)
        localization = Localization(
            first_failing, 0, note="no original model to localize against: the reference is stored outputs"
        )
    return VerifyReport(
        original=f"{path} (outputs of {stored.model})",
        rewritten=rewritten_label,
        outputs=tuple(outputs),
        samples=tuple(stored.samples),
        settings=VerifySettings(session, tolerances, None, str(path), False, 0, drift=drift, drift_decision=decision),
        versions=versions(False),
        localization=localization,
        duration_seconds=time.perf_counter() - options.started,
    )
