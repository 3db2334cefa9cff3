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
(:mod:`.localize`). :mod:`.report` renders the result as a table, JSON or JUnit XML.

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
from onnx_qrewrite.progress import ProgressSink
from onnx_qrewrite.verify._ort import ort
from onnx_qrewrite.verify.compare import Tolerances, ValueComparison, compare_values, merge_comparisons
from onnx_qrewrite.verify.inputs import (
    GenerationOptions,
    Sample,
    generate_samples,
    input_specs,
    load_samples,
    save_samples,
)
from onnx_qrewrite.verify.localize import Localization, localize
from onnx_qrewrite.verify.reference_ops import find_vendor_nodes, iter_all_nodes
from onnx_qrewrite.verify.report import SCHEMA_PATH, TOOL_NAME, VerifyReport, VerifySettings
from onnx_qrewrite.verify.session import OPT_LEVELS, ModelRunner, SessionSettings

__all__ = [
    "OPT_LEVELS",
    "SCHEMA_PATH",
    "GenerationOptions",
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
    from onnx_qrewrite import model_io

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
) -> tuple[list[Sample], GenerationOptions | None, str | None]:
    specs = input_specs(model)
    if inputs is None:
        return generate_samples(specs, generation), generation, None
    if isinstance(inputs, (str, os.PathLike)):
        return load_samples(inputs, specs), None, str(inputs)
    if isinstance(inputs, Mapping):
        return [Sample("inputs", dict(inputs))], None, None
    return list(inputs), None, None


def _compare_outputs(
    original: ModelRunner,
    rewritten: ModelRunner,
    samples: Sequence[Sample],
    tolerances: Tolerances,
    progress: ProgressSink | None = None,
) -> list[ValueComparison]:
    names = list(original.output_types)
    shared = [n for n in names if n in rewritten.output_types]
    per_output: dict[str, list[ValueComparison]] = {n: [] for n in shared}
    for done, sample in enumerate(samples, 1):
        expected = original.run(sample.feeds)
        actual = rewritten.run(sample.feeds, shared)
        for name in shared:
            tol = tolerances.for_value(name, expected[name].dtype)
            per_output[name].append(compare_values(name, sample.name, expected[name], actual[name], tol))
        if progress is not None:
            progress("verifying samples", done, len(samples))
    comparisons = []
    for name in names:
        if name in per_output:
            comparisons.append(merge_comparisons(per_output[name]))
        else:
            comparisons.append(
                _interface_problem(name, original.output_types[name], "missing from the rewritten model")
            )
    for name, type_name in rewritten.output_types.items():
        if name not in original.output_types:
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


def verify(
    original: ModelLike,
    rewritten: ModelLike,
    *,
    inputs: InputsLike = None,
    samples: int = 2,
    seed: int = 0,
    int_range: tuple[int, int] = (0, 9),
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    battery: bool = True,
    tolerances: Tolerances | None = None,
    opt_level: str = "disable",
    threads: int = 1,
    custom_op_library: str | os.PathLike[str] | None = None,
    localize_failures: bool = True,
    save_inputs: str | os.PathLike[str] | None = None,
    progress: ProgressSink | None = None,
    runtime: str = "onnxruntime",
    providers: Sequence[str] | None = None,
) -> VerifyReport:
    """Run ``original`` and ``rewritten`` (paths or ModelProtos) on the same inputs and compare.

    ``inputs``: an ``.npz`` path, a mapping of input name to array (one sample) or a list of
    :class:`Sample`; when omitted, ``samples`` random samples (``seed``, integers in ``int_range``,
    symbolic dimensions from ``input_shapes`` or 1) plus the quantization battery (``battery``).
    ``tolerances``: see :class:`Tolerances` (default: exact for integers, tight per float dtype).
    ``custom_op_library``: run the original's vendor ops with the vendor's library instead of the
    reference kernels. ``progress``: a ``(phase, done, total)`` callable, called after each sample.
    Raises :class:`~onnx_qrewrite.errors.QRewriteError` subclasses for models
    that cannot be loaded or run and for bad options; a disagreement is a report with
    ``passed == False``, never an exception.

    ``runtime``: run ``rewritten`` on onnxruntime (default; ``providers`` picks its execution
    providers), ``openvino``, ``tract`` or ``qnn`` (see :mod:`.runtimes`: their settings are in the
    report, and their default float tolerances account for their arithmetic); the original always
    runs in onnxruntime on the CPU. A runtime that is not installed is a
    :class:`~onnx_qrewrite.errors.MissingDependencyError` naming the extra to install.
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
        int_range=tuple(int_range),
        shapes={k: tuple(int(d) for d in v) for k, v in (input_shapes or {}).items()},
        battery=battery,
    )
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

    original_runner = make_runner(original_model, "original")
    rewritten_runner = _open_rewritten(rewritten_model, make_runner)
    _check_interfaces(original_runner, rewritten_runner)
    unknown = tolerances.output_names() - set(original_runner.output_types)
    if unknown:
        raise UsageError(f"--atol/--rtol/--lsb: the model has no output named {sorted(unknown)[0]!r}")

    used, generation_used, inputs_file = _resolve_samples(inputs, original_model, generation)
    if save_inputs is not None:
        save_samples(save_inputs, used)
    logger.info("comparing %d output(s) on %d sample(s)", len(original_runner.output_types), len(used))
    outputs = _compare_outputs(original_runner, rewritten_runner, used, tolerances, progress)

    localization = None
    # Localising runs intermediate values of both models in onnxruntime: that says which rewrite
    # differs, not where another runtime goes wrong, so it is done for onnxruntime only.
    if localize_failures and runtime == "onnxruntime" and not all(o.passed for o in outputs):
        failing = {s for o in outputs for s in o.failed_samples}
        sample = next((s for s in used if s.name in failing), used[0])
        localization = localize(original_model, rewritten_model, sample, tolerances, make_runner)

    return VerifyReport(
        original=original_label,
        rewritten=rewritten_label,
        outputs=tuple(outputs),
        samples=tuple(used),
        settings=VerifySettings(
            session, tolerances, generation_used, inputs_file, reference_kernels, vendor_nodes, runtime=rt
        ),
        versions=_versions(reference_kernels),
        localization=localization,
        duration_seconds=time.perf_counter() - started,
    )


class _CallableModule(types.ModuleType):
    """``onnx_qrewrite.verify`` names both this subpackage and the top-level ``verify()`` function.
    Importing a subpackage rebinds the parent package's attribute to the module, so after the first
    import ``onnx_qrewrite.verify`` *is* this module: calling it must still verify."""

    def __call__(self, original: ModelLike, rewritten: ModelLike, **options: object) -> VerifyReport:
        return verify(original, rewritten, **options)  # type: ignore[arg-type]


sys.modules[__name__].__class__ = _CallableModule
