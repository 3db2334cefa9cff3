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
import logging
import os
import sys
import time
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Union

import numpy as np

from onnx_qrewrite.errors import InvalidModelError, UsageError
from onnx_qrewrite.progress import ProgressSink, stage
from onnx_qrewrite.rewriter import provenance
from onnx_qrewrite.verify._ort import ort
from onnx_qrewrite.verify.compare import (
    Tolerances,
    UndefinedLookup,
    ValueComparison,
    compare_values,
    merge_comparisons,
)
from onnx_qrewrite.verify.drift import DriftDecision, DriftThresholds, decide
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
from onnx_qrewrite.verify.report import SCHEMA_PATH, TOOL_NAME, VerifyReport, VerifySettings
from onnx_qrewrite.verify.session import OPT_LEVELS, ModelRunner, SessionSettings

if TYPE_CHECKING:
    import onnx

    from onnx_qrewrite.io.wire_model import WireMessage
    from onnx_qrewrite.verify.hazards import Hazard
    from onnx_qrewrite.verify.localize import Localization
    from onnx_qrewrite.verify.reanchor import Anchored
    from onnx_qrewrite.verify.runtimes import RuntimeInfo

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

ModelLike = Union[str, os.PathLike, "onnx.ModelProto"]
InputsLike = str | os.PathLike | Mapping[str, np.ndarray] | Sequence[Sample] | None


# --- reading the models: from a file (fast: its bytes and a wire view) or a ModelProto ------------


#: Domains whose ops stock onnxruntime runs: a model importing only these holds no vendor op that
#: would need the reference kernels (a node of an undeclared domain makes onnxruntime refuse it).
_STANDARD_DOMAINS = frozenset({"", "ai.onnx", "ai.onnx.ml"})


def _is_proto(model: object) -> bool:
    """Whether ``model`` is an ``onnx.ModelProto`` (without importing onnx: if it is not imported
    yet, nothing can be one)."""
    onnx_module = sys.modules.get("onnx")
    return onnx_module is not None and isinstance(model, onnx_module.ModelProto)


#: Op types (as bytes) of the uint8 x int8 integer ops whose weights verify converts as onnxruntime's
#: session.x64quantprecision does (verify/u8s8_reference.py): their presence needs the parsed model.
_U8S8_OPS = (b"MatMulInteger", b"QLinearMatMul", b"QLinearConv", b"QGemm", b"QAttention", b"DynamicQuantizeMatMul")


def _may_convert(source: _Source) -> bool:
    """Whether the model may hold a node whose weights the u8s8 reference converts: one of those
    ops by name in its bytes and an int8 initializer (the weights it converts are int8 constants)."""
    from onnx_qrewrite.io.wire_model import tensors_of

    data = source.data or b""
    if not any(op in data for op in _U8S8_OPS):
        return False
    return source.view is None or any(t.data_type == 3 for t in tensors_of(source.view))  # INT8


class _NotFast(Exception):
    """The fast path cannot give this verification's answer as the full path would: run that."""


class _Source:
    """One model of the comparison and the label that names it in messages.

    Read by the fast path, it holds the file's bytes (read once) and a wire view of them
    (:mod:`onnx_qrewrite.io.wire_model`): onnxruntime gets the bytes unparsed, and what verify
    reads of the model (inputs, provenance) comes from the view. The ``onnx.ModelProto`` is parsed
    from the same bytes only when something needs the graph itself (bounded rewrites to cut out,
    a difference to localise)."""

    def __init__(
        self,
        label: str,
        *,
        proto: onnx.ModelProto | None = None,
        data: bytes | None = None,
        view: WireMessage | None = None,
        path: Path | None = None,
        file_id: tuple[int, int] = (0, 0),
    ) -> None:
        self.label = label
        self.data = data
        self.view = view
        self._proto = proto
        self._path = path
        self._file_id = file_id

    @property
    def fast(self) -> bool:
        return self.data is not None

    @property
    def proto(self) -> onnx.ModelProto:
        """The parsed model (parsed now from the bytes already read, if it was not yet)."""
        if self._proto is None:
            from onnx_qrewrite.io import model_io

            assert self.data is not None and self._path is not None
            loaded = model_io.open_model_bytes(self.data, self._file_id, self._path, check=False)
            if loaded.external is not None:  # not on the fast path (it refuses external data)
                with loaded.external:
                    loaded.external.load_into(loaded.proto)
            self._proto = loaded.proto
        return self._proto

    @property
    def readable(self) -> Any:
        """What readers of a few fields get: the wire view, else the ModelProto (same spelling)."""
        return self.view if self.view is not None else self.proto

    @property
    def runnable(self) -> onnx.ModelProto | bytes:
        """What onnxruntime gets: the file's bytes, else the ModelProto."""
        return self.data if self.data is not None else self.proto


def _load(model: ModelLike, side: str) -> _Source:
    """The model with its external data in memory, and the label that names it in messages."""
    if _is_proto(model):
        return _Source(f"<{side} ModelProto>", proto=model)  # type: ignore[arg-type]
    if not isinstance(model, (str, os.PathLike)):
        raise UsageError(f"{side}: expected a path or an onnx.ModelProto, got {type(model).__name__}")
    from onnx_qrewrite.io import model_io

    path = Path(model)
    loaded = model_io.open_model(path, check=False)  # external data opened and checked, read once
    if loaded.external is not None:
        with loaded.external:
            loaded.external.load_into(loaded.proto)
    return _Source(str(path), proto=loaded.proto)


def _load_fast(model: ModelLike, side: str) -> _Source:
    """The model file's bytes and a wire view of them; :class:`_NotFast` unless the bytes can go
    to onnxruntime as they are (a file, no external data, a model the view reads)."""
    if not isinstance(model, (str, os.PathLike)):
        raise _NotFast(f"{side}: not a path")
    from onnx_qrewrite.io.model_file import read_once
    from onnx_qrewrite.io.wire_model import WireError, read_model, tensors_of

    path = Path(model)
    data, file_id = read_once(path)  # the same checks and messages as the full path's read
    try:
        view = read_model(data)
        if view.ir_version == 0 or not view.HasField("graph"):
            raise _NotFast(f"{side}: no IR version or graph")  # the full path says what is wrong
        # Every external tensor names its file under the key "location": bytes without that
        # string cannot make onnxruntime read another file (a tensor marked external without
        # one makes it refuse the model, and the full path then reports it).
        if b"location" in data and any(t.data_location == 1 for t in tensors_of(view)):
            raise _NotFast(f"{side}: external data")
    except WireError as exc:
        raise _NotFast(f"{side}: {exc}") from None
    return _Source(str(path), data=data, view=view, path=path, file_id=file_id)


def _vendor_free(view: WireMessage) -> bool:
    """Whether the model can hold no vendor op the reference kernels would run: it imports only
    standard domains and has no local function."""
    return not view.functions and all(o.domain in _STANDARD_DOMAINS for o in view.opset_import)


def _provenance_key_absent(source: _Source, key: str) -> bool:
    """Whether no node of the model can carry the metadata entry ``key``: its bytes do not hold the
    key's string at all (an exact test, and a search in C instead of a walk over every node)."""
    return source.data is not None and key.encode() not in source.data


# --- versions the report states -------------------------------------------------------------------


def _distribution_version(name: str) -> str | None:
    """The installed distribution's version, as ``importlib.metadata.version`` reads it (the
    ``Version`` of the first ``<name>-<version>.dist-info`` on ``sys.path``), without importing
    importlib.metadata (~0.07 s, a tenth of a small model's verification); that module answers
    when no such folder is found."""
    prefix = name.replace("-", "_").lower() + "-"
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for folder in names:
            if folder.lower().startswith(prefix) and folder.endswith(".dist-info"):
                try:
                    with open(os.path.join(entry or ".", folder, "METADATA"), encoding="utf-8") as f:
                        for line in f:
                            if line.startswith("Version:"):
                                return line.partition(":")[2].strip()
                            if not line.strip():
                                break
                except OSError:
                    pass
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _onnx_version() -> str:
    """``onnx.__version__``, without importing onnx when it is not imported yet (it reads its own
    version from the distribution, ``onnx`` then ``onnx-weekly``, else ``unknown``)."""
    onnx_module = sys.modules.get("onnx")
    if onnx_module is not None:
        return str(onnx_module.__version__)
    return _distribution_version("onnx") or _distribution_version("onnx-weekly") or "unknown"


def _versions(reference_kernels: bool) -> dict[str, str | None]:
    from onnx_qrewrite import __version__

    versions: dict[str, str | None] = {
        TOOL_NAME: __version__,
        "onnx": _onnx_version(),
        "onnxruntime": ort.__version__,
        "numpy": np.__version__,
        "onnxruntime_extensions": None,
    }
    if reference_kernels:
        import importlib.metadata

        versions["onnxruntime_extensions"] = importlib.metadata.version("onnxruntime-extensions")
    return versions


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
    options = _resolve_options(
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
        _check_stored_request(original, options)
        return _verify_stored(rewritten, load_outputs, options)
    if original is None:
        raise UsageError("verify needs the original model (or --load-outputs FILE)")
    same_file = _same_file(original, rewritten)
    # The fast path: onnxruntime gets the files' bytes; onnx is imported (and the models parsed)
    # only if a check needs the graphs. It serves plain onnxruntime runs of models read from files;
    # when it cannot give the answer the full path would, the full path runs from the start.
    if runtime == "onnxruntime" and options.session.custom_op_library is None:
        try:
            return _compare(original, rewritten, options, same_file=same_file, fast=True)
        except _NotFast as why:
            logger.debug("verify: parsing the models (%s)", why)
    return _compare(original, rewritten, options, same_file=same_file, fast=False)


# --- settings: verify's keyword options, checked and resolved once --------------------------------


# The records passed between the steps are NamedTuples: defining one at import costs a tenth of
# a dataclass, and this module is on the start-up path of every verification.
class _Options(NamedTuple):
    """What one verification was asked to do, resolved from ``verify``'s keyword options: every
    step reads its settings from here, so the fast attempt and the full one see the same."""

    started: float  # time.perf_counter() when verify was called (the report's duration)
    session: SessionSettings
    tolerances: Tolerances
    drift: DriftThresholds
    generation: GenerationOptions
    runtime: str
    runtime_info: RuntimeInfo
    providers: Sequence[str] | None
    threads: int
    inputs: InputsLike
    localize_failures: bool
    save_inputs: str | os.PathLike[str] | None
    save_outputs: str | os.PathLike[str] | None
    progress: ProgressSink | None


def _resolve_options(
    *,
    started: float,
    inputs: InputsLike,
    samples: int,
    seed: int,
    int_range: tuple[int, int] | None,
    value_ranges: Mapping[str, tuple[float, float]] | None,
    input_shapes: Mapping[str, Sequence[int]] | None,
    input_dims: Mapping[str, int] | None,
    battery: bool,
    tolerances: Tolerances | None,
    opt_level: str,
    threads: int,
    custom_op_library: str | os.PathLike[str] | None,
    localize_failures: bool,
    save_inputs: str | os.PathLike[str] | None,
    save_outputs: str | os.PathLike[str] | None,
    progress: ProgressSink | None,
    runtime: str,
    providers: Sequence[str] | None,
    drift: DriftThresholds | None,
) -> _Options:
    """``verify``'s options with their defaults filled in; a bad option (providers for another
    runtime, a runtime not installed, an unknown optimisation level) fails here, before any model
    is read. A runtime's own default float tolerances apply where the caller set none."""
    from onnx_qrewrite.verify.runtimes import runtime_info

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
        int_range=None if int_range is None else (int(int_range[0]), int(int_range[1])),
        shapes={k: tuple(int(d) for d in v) for k, v in (input_shapes or {}).items()},
        battery=battery,
        value_ranges={k: (float(lo), float(hi)) for k, (lo, hi) in (value_ranges or {}).items()},
        dims={k: int(v) for k, v in (input_dims or {}).items()},
    )
    return _Options(
        started=started,
        session=session,
        tolerances=tolerances,
        drift=drift or DriftThresholds(),
        generation=generation,
        runtime=runtime,
        runtime_info=rt,
        providers=providers,
        threads=threads,
        inputs=inputs,
        localize_failures=localize_failures,
        save_inputs=save_inputs,
        save_outputs=save_outputs,
        progress=progress,
    )


def _check_stored_request(original: ModelLike | None, options: _Options) -> None:
    """``--load-outputs`` replaces the original and its inputs, and runs on onnxruntime's CPU:
    the options that would contradict it are usage errors, not silently ignored."""
    if options.runtime != "onnxruntime" or options.providers:
        raise UsageError("--load-outputs runs the model in onnxruntime on the CPU; drop --runtime/--providers")
    if original is not None:
        raise UsageError("--load-outputs compares one model with stored outputs; give only that model")
    if options.inputs is not None:
        raise UsageError("--load-outputs: the file holds the inputs its outputs came from; drop --inputs")
    if options.save_outputs is not None:
        raise UsageError("--save-outputs and --load-outputs cannot be combined")


def _check_output_names(tolerances: Tolerances, drift: DriftThresholds, names: Iterable[str], holder: str) -> None:
    """Per-output tolerances and drift thresholds name outputs that exist: a typo would otherwise
    leave an output judged by the defaults without a word. ``holder`` names what has the outputs."""
    known = set(names)
    unknown = tolerances.output_names() - known
    if unknown:
        raise UsageError(f"--atol/--rtol/--lsb: {holder} no output named {sorted(unknown)[0]!r}")
    unknown = drift.output_names() - known
    if unknown:
        raise UsageError(f"--drift-*: {holder} no output named {sorted(unknown)[0]!r}")


# --- the comparison, step by step: load, run, judge, report ---------------------------------------


def _compare(
    original: ModelLike, rewritten: ModelLike, options: _Options, *, same_file: bool, fast: bool
) -> VerifyReport:
    """The verification; ``fast``: from the files' bytes, without parsing the models unless a
    check needs their graphs (:class:`_NotFast` when it cannot give the full path's answer)."""
    models = _load_models(original, rewritten, options, fast=fast)
    make_runner = _RunnerFactory(options, models.original.label, models.rewritten.label, models.reference_kernels)
    original_runner, rewritten_runner = _start_sessions(models, make_runner, options, same_file=same_file, fast=fast)
    _check_output_names(options.tolerances, options.drift, original_runner.output_types, "the model has")
    decision = _drift_decision(models.rewritten, options.drift)
    given = _resolve_samples(options.inputs, models.original.readable, options.generation)
    if options.save_inputs is not None:
        save_samples(options.save_inputs, given.samples)
    logger.info("comparing %d output(s) on %d sample(s)", len(original_runner.output_types), len(given.samples))
    kept: dict[str, dict[str, np.ndarray]] | None = {} if options.save_outputs is not None else None
    if same_file:
        judgement = _compared_with_itself(original_runner, given.samples, kept)
    else:
        judge = options.drift if decision.judged else None
        judgement = _judge(models, original_runner, rewritten_runner, make_runner, given.samples, options, judge, kept)
    if options.save_outputs is not None and kept is not None:
        from onnx_qrewrite.verify.stored import save_outputs as save_stored_outputs

        save_stored_outputs(options.save_outputs, given.samples, kept, models.original.label)
    localization = None
    if options.localize_failures and not all(o.passed for o in judgement.outputs):
        localization = _localize_failure(models, judgement, given.samples, options, make_runner, decision)
    return _report(models, judgement, given, decision, localization, options)


# --- load: the models, as read and as they run; the samples ---------------------------------------


class _Models(NamedTuple):
    """Both models as read (what the report names and the checks read) and as they run (the
    uint8 x int8 integer ops of either side may run converted, see :func:`_as_run`)."""

    original: _Source
    rewritten: _Source
    reference: _Source  # the original as it runs
    rewritten_run: _Source  # the rewritten model as it runs
    vendor_nodes: int
    u8s8_nodes: int
    reference_kernels: bool  # the original's vendor nodes run on the numpy reference kernels


def _load_models(original: ModelLike, rewritten: ModelLike, options: _Options, *, fast: bool) -> _Models:
    """Read both models (``fast``: their bytes, see :func:`_load_fast`) and decide how each runs."""
    with stage(options.progress, "loading models"):
        load = _load_fast if fast else _load
        original_src = load(original, "original")
        rewritten_src = load(rewritten, "rewritten")
    vendor_nodes = _count_vendor_nodes(original_src, options.session, fast=fast)
    reference_kernels = options.session.custom_op_library is None and vendor_nodes > 0
    if fast and any(_may_convert(src) for src in (original_src, rewritten_src)):
        raise _NotFast("the models may hold uint8 x int8 integer ops with int8 weights")
    reference, rewritten_run, u8s8_nodes = original_src, rewritten_src, 0
    if not fast:
        reference, rewritten_run, u8s8_nodes = _as_run(original_src, rewritten_src, options.runtime)
    return _Models(original_src, rewritten_src, reference, rewritten_run, vendor_nodes, u8s8_nodes, reference_kernels)


def _count_vendor_nodes(source: _Source, session: SessionSettings, *, fast: bool) -> int:
    """How many of the original's nodes are vendor ops (that the reference kernels run unless the
    vendor's library is given). The fast path only serves models that can hold none."""
    if fast:
        if not _vendor_free(source.view):  # type: ignore[arg-type]
            raise _NotFast("the original may hold vendor ops")
        return 0
    from onnx_qrewrite.verify.reference_ops import find_vendor_nodes

    try:
        return len(find_vendor_nodes(source.proto))
    except InvalidModelError as exc:
        if session.custom_op_library is None:
            raise InvalidModelError(f"{source.label}: {exc}") from None
        return 0


def _as_run(original: _Source, rewritten: _Source, runtime: str) -> tuple[_Source, _Source, int]:
    """The original and the rewritten model as they run, and how many of the original's nodes changed.

    uint8 x int8 integer ops run as onnxruntime's session.x64quantprecision runs them, on both
    sides (.u8s8_reference): the outputs are compared with the ONNX definition, and each bounded
    replacement of such a node is checked against the default, saturating kernel at its node
    (check_bounds, on the models as they are). Another runtime runs the rewritten model as it is."""
    from onnx_qrewrite.verify.u8s8_reference import without_saturation

    reference, u8s8_nodes = without_saturation(original.proto)
    reference_src = _Source(original.label, proto=reference) if u8s8_nodes else original
    rewritten_run = rewritten
    if runtime == "onnxruntime":
        as_run, changed = without_saturation(rewritten.proto)
        rewritten_run = _Source(rewritten.label, proto=as_run) if changed else rewritten
    return reference_src, rewritten_run, u8s8_nodes


def _drift_decision(rewritten: _Source, drift: DriftThresholds) -> DriftDecision:
    """Whether the outputs are judged by drift (approximate rewrites); a model whose bytes cannot
    hold the exactness key has no approximate rewrite, which spares walking its nodes."""
    no_approximate = _provenance_key_absent(rewritten, provenance.EXACTNESS_KEY)
    return decide(drift.mode, rewritten.readable, {} if no_approximate else None)


class _GivenSamples(NamedTuple):
    """The samples both models run on, and how they came to be (for the report's settings)."""

    samples: list[Sample]
    generation: GenerationOptions | None  # None: the samples were given
    inputs_file: str | None
    ranges: dict[str, ValueRange]


def _resolve_samples(inputs: InputsLike, model: onnx.ModelProto, generation: GenerationOptions) -> _GivenSamples:
    """The caller's samples (a ``.npz`` file, one mapping, a list), else generated ones from the
    model's input specs and ``generation``."""
    specs = input_specs(model)
    if inputs is None:
        ranges = resolve_value_ranges(specs, generation, gather_index_limits(model))
        return _GivenSamples(generate_samples(specs, generation, ranges), generation, None, ranges)
    if isinstance(inputs, (str, os.PathLike)):
        return _GivenSamples(load_samples(inputs, specs), None, str(inputs), {})
    if isinstance(inputs, Mapping):
        return _GivenSamples([Sample("inputs", dict(inputs))], None, None, {})
    given = list(inputs)
    if not given:  # as `--inputs` with a file that holds no arrays: nothing to run, so nothing to prove
        raise UsageError("inputs: an empty sequence of samples leaves nothing to run")
    return _GivenSamples(given, None, None, {})


# --- run: the sessions ----------------------------------------------------------------------------


class _RunnerFactory:
    """Opens a runner for either side with the comparison's settings: ``(model, side)`` with side
    "original" or "rewritten". The checks after the main run (NaN hazards, bounds, localisation)
    open more runners on cut-out or edited models, and must run them exactly as the main run did."""

    def __init__(self, options: _Options, original_label: str, rewritten_label: str, reference_kernels: bool) -> None:
        self.options = options
        self.original_label = original_label
        self.rewritten_label = rewritten_label
        self.reference_kernels = reference_kernels

    def __call__(self, model: onnx.ModelProto | bytes, side: str) -> ModelRunner:
        options = self.options
        if side == "original":
            return ModelRunner(
                model,
                label=self.original_label,
                settings=options.session,
                reference_kernels=self.reference_kernels,
                register_custom_library=True,
            )
        if options.runtime != "onnxruntime":
            from onnx_qrewrite.verify.runtimes import make_runner as make_runtime_runner

            assert not isinstance(model, bytes)  # the fast path runs onnxruntime only
            return make_runtime_runner(
                options.runtime,
                model,
                label=self.rewritten_label,
                threads=options.threads,
                shapes=options.generation.shapes,
                dims=options.generation.dims,
            )
        return ModelRunner(
            model,
            label=self.rewritten_label,
            settings=options.session,
            providers=options.providers or ("CPUExecutionProvider",),
        )


def _start_sessions(
    models: _Models, make_runner: _RunnerFactory, options: _Options, *, same_file: bool, fast: bool
) -> tuple[ModelRunner, Any]:
    """Both models' runners, checked to take the same inputs. On the fast path a model
    onnxruntime refuses goes to the full path, which parses it and says what is wrong."""
    with stage(options.progress, "starting onnxruntime"):
        try:
            original_runner = make_runner(models.reference.runnable, "original")
            rewritten_runner = original_runner if same_file else _open_rewritten(models.rewritten_run, make_runner)
        except InvalidModelError as exc:
            if fast:
                raise _NotFast(str(exc)) from None
            raise
    _check_interfaces(original_runner, rewritten_runner)
    return original_runner, rewritten_runner


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


def _open_rewritten(source: _Source, make_runner: Callable[[Any, str], ModelRunner]) -> ModelRunner:
    """The rewritten model's session; when onnxruntime refuses it, say which op is left over (on
    the fast path, the refusal is passed on: the full path then says it)."""
    try:
        return make_runner(source.runnable, "rewritten")
    except InvalidModelError as exc:
        if source.fast:
            raise
        from onnx_qrewrite.verify.reference_ops import iter_all_nodes

        leftover = [n for n in iter_all_nodes(source.proto) if n.domain not in ("", "ai.onnx", "ai.onnx.ml")]
        if not leftover:
            raise
        first = leftover[0]
        raise InvalidModelError(
            f"{exc} (the rewritten model must run in stock onnxruntime, but it still holds {len(leftover)} "
            f"non-standard node(s), the first {first.name or first.output[0]!r} ({first.domain}::{first.op_type}))"
        ) from None


# --- judge: compare the outputs, set aside NaN hazards, check the bounds --------------------------


class _Judgement(NamedTuple):
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


def _compared_with_itself(
    runner: ModelRunner, samples: Sequence[Sample], kept: dict[str, dict[str, np.ndarray]] | None
) -> _Judgement:
    """ORIGINAL and REWRITTEN are one file: nothing is compared (a model agrees with itself), but
    ``--save-outputs`` still gets the outputs it asked for."""
    outputs = [_not_compared(name, type_name) for name, type_name in runner.output_types.items()]
    if kept is not None:
        kept.update({sample.name: runner.run(sample.feeds) for sample in samples})
    why = "ORIGINAL and REWRITTEN are the same file: a model compared with itself proves nothing"
    return _Judgement(outputs, [], why)


def _judge(
    models: _Models,
    original_runner: ModelRunner,
    rewritten_runner: Any,
    make_runner: _RunnerFactory,
    samples: Sequence[Sample],
    options: _Options,
    drift: DriftThresholds | None,
    kept: dict[str, dict[str, np.ndarray]] | None,
) -> _Judgement:
    """Every output of every sample compared (``drift``: judged by drift), the failing samples that
    a NaN hazard makes inconclusive set aside, then each bounded replacement checked at its node.
    With bounded replacements (onnxruntime, no drift), the outputs without an explicit tolerance
    are judged against the original re-anchored at their values (:func:`_reanchor`)."""
    names = list(original_runner.output_types)
    undefined = _undefined(models, samples, make_runner)
    per_output = _run_samples(
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
    bounded = options.runtime == "onnxruntime" and not _provenance_key_absent(models.rewritten, provenance.BOUND_KEY)
    anchored = _reanchor(models, names, samples, options, make_runner, undefined) if bounded and drift is None else None
    if anchored is not None:
        from onnx_qrewrite.verify.reanchor import judged_outputs

        per_output = judged_outputs(per_output, anchored, options.tolerances)
    hazards = _nan_hazards(per_output, samples, models.reference, make_runner)
    outputs = _merge(
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
    return _Judgement(outputs, hazards, anchored=anchored, unchecked=unchecked, undefined=undefined)


def _undefined(models: _Models, samples: Sequence[Sample], make_runner: _RunnerFactory) -> UndefinedLookup | None:
    """The elements of the original's values its kernels leave undefined (verify/undefined.py);
    None on the fast path, whose originals hold no vendor op (the only kernels known to)."""
    if models.original.fast:
        return None
    from onnx_qrewrite.verify.undefined import undefined_elements

    return undefined_elements(models.reference.proto, samples, lambda model: make_runner(model, "original"))


def _reanchor(
    models: _Models,
    names: Sequence[str],
    samples: Sequence[Sample],
    options: _Options,
    make_runner: _RunnerFactory,
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
    reference: _Source,
    make_runner: _RunnerFactory,
) -> list[Hazard]:
    """The failing samples whose difference a NaN reaching a kernel that is not deterministic on
    NaN explains: inconclusive, not a disagreement (see :mod:`.hazards`)."""
    failing = _failing_samples(per_output)
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


def _localize_failure(
    models: _Models,
    judgement: _Judgement,
    samples: Sequence[Sample],
    options: _Options,
    make_runner: _RunnerFactory,
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


def _sample_to_localize(judgement: _Judgement, samples: Sequence[Sample], runtime: str) -> Sample:
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


def _not_compared(name: str, type_name: str) -> ValueComparison:
    from onnx_qrewrite.verify.compare import Tolerance

    dtype = type_name.removeprefix("tensor(").removesuffix(")")
    return ValueComparison(name=name, dtype=dtype, shape=(), tolerance=Tolerance(0.0, 0.0, 0), integer=False)


# --- report ---------------------------------------------------------------------------------------


def _report(
    models: _Models,
    judgement: _Judgement,
    given: _GivenSamples,
    decision: DriftDecision,
    localization: Localization | None,
    options: _Options,
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
        versions=_versions(models.reference_kernels),
        localization=localization,
        duration_seconds=time.perf_counter() - options.started,
        excluded=tuple(judgement.hazards),
        not_compared=judgement.not_compared,
        unchecked_bounds=judgement.unchecked,
    )


# --- --load-outputs: the rewritten model against stored outputs -----------------------------------


def _verify_stored(rewritten: ModelLike, path: str | os.PathLike[str], options: _Options) -> VerifyReport:
    """``--load-outputs``: the rewritten model against outputs stored by ``--save-outputs``."""
    from onnx_qrewrite.verify.localize import Localization
    from onnx_qrewrite.verify.stored import load_outputs as load_stored_outputs

    session, tolerances, drift, progress = options.session, options.tolerances, options.drift, options.progress
    stored = load_stored_outputs(path)
    with stage(progress, "loading models"):
        source = _load(rewritten, "rewritten")
    rewritten_model, rewritten_label = source.proto, source.label
    with stage(progress, "starting onnxruntime"):
        runner = _open_rewritten(source, lambda m, _side: ModelRunner(m, label=rewritten_label, settings=session))
    expected_inputs = set(runner.input_names)
    for sample in stored.samples:
        given = set(sample.feeds)
        if given != expected_inputs:
            name = sorted(given ^ expected_inputs)[0]
            where = "is not an input of the model" if name in given else "has no stored value"
            raise UsageError(f"--load-outputs: {path}: sample {sample.name!r}: input {name!r} {where}")
    names = stored.output_names
    _check_output_names(tolerances, drift, names, "the stored outputs have")
    decision = decide(drift.mode, rewritten_model)
    if options.save_inputs is not None:
        save_samples(options.save_inputs, stored.samples)
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
        duration_seconds=time.perf_counter() - options.started,
    )


class _CallableModule(types.ModuleType):
    """``onnx_qrewrite.verify`` names both this subpackage and the top-level ``verify()`` function.
    Importing a subpackage rebinds the parent package's attribute to the module, so after the first
    import ``onnx_qrewrite.verify`` *is* this module: calling it must still verify."""

    def __call__(self, original: ModelLike | None, rewritten: ModelLike, **options: object) -> VerifyReport:
        return verify(original, rewritten, **options)  # type: ignore[arg-type]


sys.modules[__name__].__class__ = _CallableModule
