"""Verify's settings: its keyword options checked and resolved once, before any model is read.

Every later step (:mod:`.models`, :mod:`.runners`, :mod:`.judge`, :mod:`.pipeline`) reads its
settings from the one :class:`Options` made here, so the fast attempt and the full one see the same;
a bad option fails here with a :class:`~onnx_qrewrite.errors.UsageError`, not halfway through a run.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Union

import numpy as np

from onnx_qrewrite.errors import UsageError
from onnx_qrewrite.progress import ProgressSink
from onnx_qrewrite.verify.compare import Tolerances
from onnx_qrewrite.verify.drift import DriftThresholds
from onnx_qrewrite.verify.inputs import (
    GenerationOptions,
    Sample,
)
from onnx_qrewrite.verify.session import SessionSettings

if TYPE_CHECKING:
    import onnx

    from onnx_qrewrite.verify.runtimes import RuntimeInfo


ModelLike = Union[str, os.PathLike, "onnx.ModelProto"]
InputsLike = str | os.PathLike | Mapping[str, np.ndarray] | Sequence[Sample] | None


# The records passed between the steps are NamedTuples: defining one at import costs a tenth of
# a dataclass, and these modules are on the start-up path of every verification.
class Options(NamedTuple):
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


def resolve_options(
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
) -> Options:
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
    return Options(
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


def check_stored_request(original: ModelLike | None, options: Options) -> None:
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


def check_output_names(tolerances: Tolerances, drift: DriftThresholds, names: Iterable[str], holder: str) -> None:
    """Per-output tolerances and drift thresholds name outputs that exist: a typo would otherwise
    leave an output judged by the defaults without a word. ``holder`` names what has the outputs."""
    known = set(names)
    unknown = tolerances.output_names() - known
    if unknown:
        raise UsageError(f"--atol/--rtol/--lsb: {holder} no output named {sorted(unknown)[0]!r}")
    unknown = drift.output_names() - known
    if unknown:
        raise UsageError(f"--drift-*: {holder} no output named {sorted(unknown)[0]!r}")
