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

Each step is a module of its own, and data flows one way through them: :mod:`.options` resolves
the keyword options, :mod:`.models` reads both models (fast: the files' bytes, parsed only when a
check needs the graphs), :mod:`.samples` gives the inputs, :mod:`.runners` opens the sessions,
:mod:`.judge` compares the outputs, :mod:`.failure` picks what to localise, and :mod:`.pipeline`
calls them in that order and makes the report; :mod:`.against_stored` serves ``--load-outputs``.
This package keeps the public API: :func:`verify` and the names it re-exports.

This is the only part of onnx-qrewrite that imports onnxruntime, an optional dependency (the
``verify`` extra; any onnxruntime flavour serves): without it, importing this package raises
:class:`~onnx_qrewrite.errors.MissingDependencyError` naming what to install (see :mod:`._ort`).
"""

from __future__ import annotations

import logging
import os
import sys
import time
import types
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from onnx_qrewrite.errors import UsageError
from onnx_qrewrite.progress import ProgressSink
from onnx_qrewrite.verify.compare import Tolerances, ValueComparison
from onnx_qrewrite.verify.drift import DriftThresholds
from onnx_qrewrite.verify.inputs import GenerationOptions, Sample
from onnx_qrewrite.verify.models import NotFast
from onnx_qrewrite.verify.options import InputsLike, ModelLike, check_stored_request, resolve_options
from onnx_qrewrite.verify.pipeline import run_comparison
from onnx_qrewrite.verify.report import SCHEMA_PATH, VerifyReport, VerifySettings
from onnx_qrewrite.verify.session import OPT_LEVELS, SessionSettings

if TYPE_CHECKING:
    from onnx_qrewrite.verify.hazards import Hazard
    from onnx_qrewrite.verify.localize import Localization

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

#: Names of this package's API whose modules load on first use (PEP 562): a verification that
#: passes never needs them, and each costs start-up time (see ``verify``'s fast path).
_LAZY = {"Hazard": "onnx_qrewrite.verify.hazards", "Localization": "onnx_qrewrite.verify.localize"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


logger = logging.getLogger(__name__)


# --- verify: the public entry point ---------------------------------------------------------------


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
    input_dims: Mapping[str, int] | None = None,
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
    ``int_range`` or by the defaults of :mod:`.inputs`; symbolic dimensions from ``input_shapes``
    (by input), else ``input_dims`` (by dimension name), else 1) plus the quantization battery
    (``battery``). ``tolerances``: see :class:`Tolerances` (default: exact for integers, tight per
    float dtype, the ``numpy`` rule).
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
    options = resolve_options(
        started=time.perf_counter(),
        inputs=inputs,
        samples=samples,
        seed=seed,
        int_range=int_range,
        value_ranges=value_ranges,
        input_shapes=input_shapes,
        input_dims=input_dims,
        battery=battery,
        tolerances=tolerances,
        opt_level=opt_level,
        threads=threads,
        custom_op_library=custom_op_library,
        localize_failures=localize_failures,
        save_inputs=save_inputs,
        save_outputs=save_outputs,
        progress=progress,
        runtime=runtime,
        providers=providers,
        drift=drift,
    )
    if load_outputs is not None:
        check_stored_request(original, options)
        from onnx_qrewrite.verify.against_stored import verify_stored

        return verify_stored(rewritten, load_outputs, options)
    if original is None:
        raise UsageError("verify needs the original model (or --load-outputs FILE)")
    same_file = _same_file(original, rewritten)
    # The fast path: onnxruntime gets the files' bytes; onnx is imported (and the models parsed)
    # only if a check needs the graphs. It serves plain onnxruntime runs of models read from files;
    # when it cannot give the answer the full path would, the full path runs from the start.
    if runtime == "onnxruntime" and options.session.custom_op_library is None:
        try:
            return run_comparison(original, rewritten, options, same_file=same_file, fast=True)
        except NotFast as why:
            logger.debug("verify: parsing the models (%s)", why)
    return run_comparison(original, rewritten, options, same_file=same_file, fast=False)


class _CallableModule(types.ModuleType):
    """``onnx_qrewrite.verify`` names both this subpackage and the top-level ``verify()`` function.
    Importing a subpackage rebinds the parent package's attribute to the module, so after the first
    import ``onnx_qrewrite.verify`` *is* this module: calling it must still verify."""

    def __call__(self, original: ModelLike | None, rewritten: ModelLike, **options: object) -> VerifyReport:
        return verify(original, rewritten, **options)  # type: ignore[arg-type]


sys.modules[__name__].__class__ = _CallableModule
