"""The verifier: run the original and the rewritten model in onnxruntime and prove they agree.

    report = verify("model.onnx", "model.portable.onnx")
    print(report.to_table())
    assert report.passed, report.summary

The original runs with its vendor ops on numpy reference kernels written from the measured kernel
semantics (:mod:`.kernels`, registered by :mod:`.reference_ops`), or on the vendor's own library
(``custom_op_library``). The rewritten model runs in stock onnxruntime: that is what it promises.
Both sessions share the same optimisation level and thread count (:mod:`.session`), both see the
same inputs (:mod:`.inputs`), every output is compared element-wise (:mod:`.compare`) and, when
they disagree, the first differing node of the rewritten model is named with its rule of origin
(:mod:`.localize`). Every replacement made by a bounded rule is also run alone on the original's
values of its inputs and checked against its recorded bound (:mod:`.bounds`). :mod:`.report`
renders the result as a table, JSON or JUnit XML.

This is the only part of onnx-qrewrite that imports onnxruntime, an optional dependency (the
``verify`` extra; any onnxruntime flavour serves): without it, importing this package raises
:class:`~onnx_qrewrite.errors.MissingDependencyError` naming what to install (see :mod:`._ort`).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import os
import sys
import time
import types
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from onnx_qrewrite.errors import InvalidModelError, UsageError
from onnx_qrewrite.progress import ProgressSink, stage
from onnx_qrewrite.verify._ort import ort
from onnx_qrewrite.verify.bounds import check_bounds
from onnx_qrewrite.verify.compare import Tolerances, ValueComparison, compare_values, merge_comparisons
from onnx_qrewrite.verify.drift import DriftThresholds, decide
from onnx_qrewrite.verify.hazards import Hazard, NanHazardCheck
from onnx_qrewrite.verify.inputs import (
    GenerationOptions,
    Sample,
    ValueRange,
    gather_index_limits,
    generate_samples,
    input_specs,
    load_samples,
    resolve_value_ranges,
    save_samples,
)
from onnx_qrewrite.verify.localize import Localization, localize
from onnx_qrewrite.verify.reference_ops import find_vendor_nodes, iter_all_nodes
from onnx_qrewrite.verify.report import SCHEMA_PATH, TOOL_NAME, VerifyReport, VerifySettings
from onnx_qrewrite.verify.session import OPT_LEVELS, ModelRunner, SessionSettings
from onnx_qrewrite.verify.stored import load_outputs as load_stored_outputs
from onnx_qrewrite.verify.stored import save_outputs as save_stored_outputs

__all__ = [
    "OPT_LEVELS",
    "SCHEMA_PATH",
    "DriftThresholds",
    "GenerationOptions",
    "Hazard",
    "Localization",
    "Sample",
    "SessionSettings",
    "Tolerances",
    "ValueComparison",
    "VerifyReport",
    "VerifySettings",
    "verify",
]

logger = logging.getLogger(__name__)

ModelLike = str | os.PathLike | onnx.ModelProto
InputsLike = str | os.PathLike | Mapping[str, np.ndarray] | Sequence[Sample] | None


def _load(model: ModelLike, side: str) -> tuple[onnx.ModelProto, str]:
    """The model with its external data in memory, and the label that names it in messages."""
    if isinstance(model, onnx.ModelProto):
        return model, f"<{side} ModelProto>"
    if not isinstance(model, (str, os.PathLike)):
        raise UsageError(f"{side}: expected a path or an onnx.ModelProto, got {type(model).__name__}")
    from onnx_qrewrite.io import model_io

    path = Path(model)
    loaded = model_io.open_model(path, check=False)  # external data opened and checked, read once
    if loaded.external is not None:
        with loaded.external:
            loaded.external.load_into(loaded.proto)
    return loaded.proto, str(path)


def _versions(reference_kernels: bool) -> dict[str, str | None]:
    from onnx_qrewrite import __version__

    versions: dict[str, str | None] = {
        TOOL_NAME: __version__,
        "onnx": onnx.__version__,
        "onnxruntime": ort.__version__,
        "numpy": np.__version__,
        "onnxruntime_extensions": None,
    }
    if reference_kernels:
        versions["onnxruntime_extensions"] = importlib.metadata.version("onnxruntime-extensions")
    return versions


def _input_types(runner: Any) -> dict[str, str]:
    if isinstance(runner, ModelRunner):
        return {i.name: i.type for i in runner.session.get_inputs()}
    return dict(runner.input_types)  # another runtime's runner (verify/runtimes.py)


def _check_interfaces(original: ModelRunner, rewritten: Any) -> None:
    a = _input_types(original)
    b = _input_types(rewritten)
    if a != b:
        diff = sorted(set(a.items()) ^ set(b.items()))
        raise UsageError(
            f"{original.label} and {rewritten.label} have different inputs (first difference: {diff[0][0]} "
            f"{diff[0][1]}); they are not a rewrite of each other"
        )


def _resolve_samples(
    inputs: InputsLike, model: onnx.ModelProto, generation: GenerationOptions
) -> tuple[list[Sample], GenerationOptions | None, str | None, dict[str, ValueRange]]:
    specs = input_specs(model)
    if inputs is None:
        ranges = resolve_value_ranges(specs, generation, gather_index_limits(model))
        return generate_samples(specs, generation, ranges), generation, None, ranges
    if isinstance(inputs, (str, os.PathLike)):
        return load_samples(inputs, specs), None, str(inputs), {}
    if isinstance(inputs, Mapping):
        return [Sample("inputs", dict(inputs))], None, None, {}
    return list(inputs), None, None, {}


Expected = Callable[[Sample], Mapping[str, np.ndarray]]


def _run_samples(
    expected: Expected,
    rewritten: ModelRunner,
    names: Sequence[str],
    samples: Sequence[Sample],
    tolerances: Tolerances,
    progress: ProgressSink | None = None,
    keep: dict[str, dict[str, np.ndarray]] | None = None,
    drift: DriftThresholds | None = None,
) -> dict[str, list[tuple[str, ValueComparison]]]:
    """Each shared output of each sample compared (output name -> one comparison per sample);
    ``keep``, when given, receives the expected outputs of each sample (for ``--save-outputs``);
    ``drift``, when given, judges the outputs by their drift (approximate rewrites)."""
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
            comparison = compare_values(name, sample.name, reference[name], actual[name], tol, judge)
            per_output[name].append((sample.name, comparison))
        if progress is not None:
            progress("verifying samples", done, len(samples))
    return per_output


def _failing_samples(per_output: Mapping[str, Sequence[tuple[str, ValueComparison]]]) -> list[str]:
    return list(dict.fromkeys(sample for parts in per_output.values() for sample, c in parts if not c.passed))


def _merge(
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


def _open_rewritten(model: onnx.ModelProto, make_runner: Callable[[onnx.ModelProto, str], ModelRunner]) -> ModelRunner:
    """The rewritten model's session; when onnxruntime refuses it, say which op is left over."""
    try:
        return make_runner(model, "rewritten")
    except InvalidModelError as exc:
        leftover = [n for n in iter_all_nodes(model) if n.domain not in ("", "ai.onnx", "ai.onnx.ml")]
        if not leftover:
            raise
        first = leftover[0]
        raise InvalidModelError(
            f"{exc} (the rewritten model must run in stock onnxruntime, but it still holds {len(leftover)} "
            f"non-standard node(s), the first {first.name or first.output[0]!r} ({first.domain}::{first.op_type}))"
        ) from None


def _same_file(original: ModelLike, rewritten: ModelLike) -> bool:
    """Both arguments name one file (or are one object): a comparison that proves nothing."""
    if original is rewritten:
        return True
    if isinstance(original, (str, os.PathLike)) and isinstance(rewritten, (str, os.PathLike)):
        try:
            return os.path.samefile(original, rewritten)
        except OSError:
            return False
    return False


def verify(
    original: ModelLike | None,
    rewritten: ModelLike,
    *,
    inputs: InputsLike = None,
    samples: int = 2,
    seed: int = 0,
    int_range: tuple[int, int] | None = None,
    value_ranges: Mapping[str, tuple[float, float]] | None = None,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    battery: bool = True,
    tolerances: Tolerances | None = None,
    opt_level: str = "disable",
    threads: int = 1,
    custom_op_library: str | os.PathLike[str] | None = None,
    localize_failures: bool = True,
    save_inputs: str | os.PathLike[str] | None = None,
    save_outputs: str | os.PathLike[str] | None = None,
    load_outputs: str | os.PathLike[str] | None = None,
    progress: ProgressSink | None = None,
    runtime: str = "onnxruntime",
    providers: Sequence[str] | None = None,
    drift: DriftThresholds | None = None,
) -> VerifyReport:
    """Run ``original`` and ``rewritten`` (paths or ModelProtos) on the same inputs and compare.

    ``inputs``: an ``.npz`` path, a mapping of input name to array (one sample) or a list of
    :class:`Sample`; when omitted, ``samples`` random samples (``seed``; value ranges from
    ``value_ranges`` (input name, or ``""`` for every input, -> (low, high)), integers in
    ``int_range`` or by the defaults of :mod:`.inputs`; symbolic dimensions from ``input_shapes`` or
    1) plus the quantization battery (``battery``). ``tolerances``: see :class:`Tolerances`
    (default: exact for integers, tight per float dtype, the ``numpy`` rule).
    ``custom_op_library``: run the original's vendor ops with the vendor's library instead of the
    reference kernels. ``save_outputs``: write the inputs and the original's outputs (see
    :mod:`.stored`); ``load_outputs``: compare ``rewritten`` with such a file instead of running an
    original (``original`` must then be None). ``progress``: a ``(phase, done, total)`` callable.
    Raises :class:`~onnx_qrewrite.errors.QRewriteError` subclasses for models
    that cannot be loaded or run and for bad options; a disagreement is a report with
    ``passed == False``, never an exception, and so is a run that compared nothing
    (``verdict == "inconclusive"``).

    ``runtime``: run ``rewritten`` on onnxruntime (default; ``providers`` picks its execution
    providers), ``openvino``, ``tract`` or ``qnn`` (see :mod:`.runtimes`: their settings are in the
    report, and their default float tolerances account for their arithmetic); the original always
    runs in onnxruntime on the CPU. A runtime that is not installed is a
    :class:`~onnx_qrewrite.errors.MissingDependencyError` naming the extra to install.

    ``drift``: when (``mode``: ``auto``, the default, when the rewritten model's provenance marks
    approximate rewrites; ``always``; ``never``) and against which thresholds (relative L2 error,
    cosine similarity, argmax agreement, optional max abs error) the outputs are judged by their
    drift instead of element by element; see :mod:`.drift`. Exact and bounded rewrites keep the
    element-wise checks (and the per-node bound check).
    """
    from onnx_qrewrite.verify.runtimes import make_runner as make_runtime_runner
    from onnx_qrewrite.verify.runtimes import runtime_info

    started = time.perf_counter()
    if providers and runtime != "onnxruntime":
        raise UsageError(
            f"--providers chooses onnxruntime's execution providers; it does not apply to --runtime {runtime}"
        )
    rt = runtime_info(runtime, providers or (), threads)
    tolerances = tolerances or Tolerances()
    drift = drift or DriftThresholds()
    if rt.atol is not None and tolerances.atol is None:
        tolerances = dataclasses.replace(tolerances, atol=rt.atol)
    if rt.rtol is not None and tolerances.rtol is None:
        tolerances = dataclasses.replace(tolerances, rtol=rt.rtol)
    session = SessionSettings(
        opt_level=opt_level,
        threads=threads,
        custom_op_library=None if custom_op_library is None else Path(custom_op_library),
    )
    generation = GenerationOptions(
        samples=samples,
        seed=seed,
        int_range=None if int_range is None else (int(int_range[0]), int(int_range[1])),
        shapes={k: tuple(int(d) for d in v) for k, v in (input_shapes or {}).items()},
        battery=battery,
        value_ranges={k: (float(lo), float(hi)) for k, (lo, hi) in (value_ranges or {}).items()},
    )
    if load_outputs is not None:
        if runtime != "onnxruntime" or providers:
            raise UsageError("--load-outputs runs the model in onnxruntime on the CPU; drop --runtime/--providers")
        if original is not None:
            raise UsageError("--load-outputs compares one model with stored outputs; give only that model")
        if inputs is not None:
            raise UsageError("--load-outputs: the file holds the inputs its outputs came from; drop --inputs")
        if save_outputs is not None:
            raise UsageError("--save-outputs and --load-outputs cannot be combined")
        return _verify_stored(rewritten, load_outputs, session, tolerances, save_inputs, progress, started, drift)
    if original is None:
        raise UsageError("verify needs the original model (or --load-outputs FILE)")
    same_file = _same_file(original, rewritten)
    with stage(progress, "loading models"):
        original_model, original_label = _load(original, "original")
        rewritten_model, rewritten_label = _load(rewritten, "rewritten")
    try:
        vendor_nodes = len(find_vendor_nodes(original_model))
    except InvalidModelError as exc:
        if session.custom_op_library is None:
            raise InvalidModelError(f"{original_label}: {exc}") from None
        vendor_nodes = 0
    reference_kernels = session.custom_op_library is None and vendor_nodes > 0

    def make_runner(model: onnx.ModelProto, side: str) -> ModelRunner:
        if side == "original":
            return ModelRunner(
                model,
                label=original_label,
                settings=session,
                reference_kernels=reference_kernels,
                register_custom_library=True,
            )
        if runtime != "onnxruntime":
            return make_runtime_runner(runtime, model, label=rewritten_label, threads=threads, shapes=generation.shapes)
        return ModelRunner(
            model, label=rewritten_label, settings=session, providers=providers or ("CPUExecutionProvider",)
        )

    with stage(progress, "starting onnxruntime"):
        original_runner = make_runner(original_model, "original")
        rewritten_runner = original_runner if same_file else _open_rewritten(rewritten_model, make_runner)
    _check_interfaces(original_runner, rewritten_runner)
    unknown = tolerances.output_names() - set(original_runner.output_types)
    if unknown:
        raise UsageError(f"--atol/--rtol/--lsb: the model has no output named {sorted(unknown)[0]!r}")
    unknown = drift.output_names() - set(original_runner.output_types)
    if unknown:
        raise UsageError(f"--drift-*: the model has no output named {sorted(unknown)[0]!r}")
    decision = decide(drift.mode, rewritten_model)
    judge = drift if decision.judged else None

    used, generation_used, inputs_file, ranges = _resolve_samples(inputs, original_model, generation)
    if save_inputs is not None:
        save_samples(save_inputs, used)
    logger.info("comparing %d output(s) on %d sample(s)", len(original_runner.output_types), len(used))
    names = list(original_runner.output_types)
    hazards: list[Hazard] = []
    not_compared = None
    kept: dict[str, dict[str, np.ndarray]] | None = {} if save_outputs is not None else None
    if same_file:
        not_compared = "ORIGINAL and REWRITTEN are the same file: a model compared with itself proves nothing"
        outputs = [_not_compared(name, type_name) for name, type_name in original_runner.output_types.items()]
        if kept is not None:
            kept.update({sample.name: original_runner.run(sample.feeds) for sample in used})
    else:
        per_output = _run_samples(
            lambda sample: original_runner.run(sample.feeds),
            rewritten_runner,
            names,
            used,
            tolerances,
            progress,
            kept,
            judge,
        )
        failing = _failing_samples(per_output)
        if failing:
            feeds = {sample.name: sample.feeds for sample in used}
            nan_check = NanHazardCheck(original_model, lambda model: make_runner(model, "original"))
            for name in failing:
                hazard = nan_check.check(name, feeds[name])
                if hazard is not None:
                    logger.info("sample %s is inconclusive: %s", name, hazard.describe())
                    hazards.append(hazard)
        outputs = _merge(
            per_output, original_runner.output_types, rewritten_runner.output_types, {h.sample for h in hazards}
        )
        if runtime == "onnxruntime":
            # Bounded rewrites: each replacement within its recorded bound, on the original's own
            # inputs (the bounds are stated against onnxruntime's kernels).
            outputs += check_bounds(original_model, rewritten_model, used, make_runner)
    if save_outputs is not None and kept is not None:
        save_stored_outputs(save_outputs, used, kept, original_label)

    localization = None
    # The original's intermediate values always come from onnxruntime; the rewritten model's from
    # the runtime that ran it, so on another runtime this names where *that runtime* departs (the
    # rewrite's node or its own arithmetic), when it can run the model with them as outputs.
    if localize_failures and not all(o.passed for o in outputs):
        excluded = {h.sample for h in hazards}
        failing_now = {s for o in outputs for s in o.failed_samples if s not in excluded}
        sample = next((s for s in used if s.name in failing_now), used[0])
        if runtime != "onnxruntime":
            # Another runtime's rounding differs a little on every sample; where it goes wrong shows
            # best on the sample with the largest error.
            worst = max((o for o in outputs if not o.passed and o.worst), key=lambda o: o.max_abs_error, default=None)
            if worst is not None and worst.worst is not None and worst.worst.sample in failing_now:
                sample = next(s for s in used if s.name == worst.worst.sample)
        with stage(progress, "localizing"):
            # On another runtime, intermediate values are judged by drift (its rounding differs
            # everywhere by a little): what is named is where its numbers go wrong.
            localization = localize(
                original_model,
                rewritten_model,
                sample,
                tolerances,
                make_runner,
                judge,
                runtime=runtime,
                runtime_drift=None if runtime == "onnxruntime" else drift,
            )

    return VerifyReport(
        original=original_label,
        rewritten=rewritten_label,
        outputs=tuple(outputs),
        samples=tuple(used),
        settings=VerifySettings(
            session,
            tolerances,
            generation_used,
            inputs_file,
            reference_kernels,
            vendor_nodes,
            value_ranges=ranges,
            runtime=rt,
            drift=drift,
            drift_decision=decision,
        ),
        versions=_versions(reference_kernels),
        localization=localization,
        duration_seconds=time.perf_counter() - started,
        excluded=tuple(hazards),
        not_compared=not_compared,
    )


def _not_compared(name: str, type_name: str) -> ValueComparison:
    from onnx_qrewrite.verify.compare import Tolerance

    dtype = type_name.removeprefix("tensor(").removesuffix(")")
    return ValueComparison(name=name, dtype=dtype, shape=(), tolerance=Tolerance(0.0, 0.0, 0), integer=False)


def _verify_stored(
    rewritten: ModelLike,
    path: str | os.PathLike[str],
    session: SessionSettings,
    tolerances: Tolerances,
    save_inputs: str | os.PathLike[str] | None,
    progress: ProgressSink | None,
    started: float,
    drift: DriftThresholds,
) -> VerifyReport:
    """``--load-outputs``: the rewritten model against outputs stored by ``--save-outputs``."""
    stored = load_stored_outputs(path)
    with stage(progress, "loading models"):
        rewritten_model, rewritten_label = _load(rewritten, "rewritten")
    with stage(progress, "starting onnxruntime"):
        runner = _open_rewritten(
            rewritten_model, lambda m, _side: ModelRunner(m, label=rewritten_label, settings=session)
        )
    expected_inputs = set(runner.input_names)
    for sample in stored.samples:
        given = set(sample.feeds)
        if given != expected_inputs:
            name = sorted(given ^ expected_inputs)[0]
            where = "is not an input of the model" if name in given else "has no stored value"
            raise UsageError(f"--load-outputs: {path}: sample {sample.name!r}: input {name!r} {where}")
    names = stored.output_names
    unknown = tolerances.output_names() - set(names)
    if unknown:
        raise UsageError(f"--atol/--rtol/--lsb: the stored outputs have no output named {sorted(unknown)[0]!r}")
    unknown = drift.output_names() - set(names)
    if unknown:
        raise UsageError(f"--drift-*: the stored outputs have no output named {sorted(unknown)[0]!r}")
    decision = decide(drift.mode, rewritten_model)
    if save_inputs is not None:
        save_samples(save_inputs, stored.samples)
    per_output = _run_samples(
        stored.run, runner, names, stored.samples, tolerances, progress, drift=drift if decision.judged else None
    )
    first = stored.outputs[stored.samples[0].name]
    expected_types = {n: f"tensor({first[n].dtype.name})" for n in names}
    outputs = _merge(per_output, expected_types, runner.output_types, set())
    localization = None
    if not all(o.passed for o in outputs):
        first_failing = next(iter(_failing_samples(per_output)), stored.samples[0].name)
        localization = Localization(
            first_failing, 0, note="no original model to localize against: the reference is stored outputs"
        )
    return VerifyReport(
        original=f"{path} (outputs of {stored.model})",
        rewritten=rewritten_label,
        outputs=tuple(outputs),
        samples=tuple(stored.samples),
        settings=VerifySettings(session, tolerances, None, str(path), False, 0, drift=drift, drift_decision=decision),
        versions=_versions(False),
        localization=localization,
        duration_seconds=time.perf_counter() - started,
    )


class _CallableModule(types.ModuleType):
    """``onnx_qrewrite.verify`` names both this subpackage and the top-level ``verify()`` function.
    Importing a subpackage rebinds the parent package's attribute to the module, so after the first
    import ``onnx_qrewrite.verify`` *is* this module: calling it must still verify."""

    def __call__(self, original: ModelLike | None, rewritten: ModelLike, **options: object) -> VerifyReport:
        return verify(original, rewritten, **options)  # type: ignore[arg-type]


sys.modules[__name__].__class__ = _CallableModule
