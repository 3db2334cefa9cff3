"""onnxruntime sessions for both sides of a verification, created with identical settings.

The settings matter for the verdict: onnxruntime's graph optimisation changes QDQ numerics (it
fuses Q/DQ pairs into integer kernels), so the two models are always compared under the same
optimisation level and thread count. The default level is ``disable``: it compares what each op
computes, which is what a rewrite must preserve; ``all`` shows what a deployment would see.

Tensors onnxruntime's Python binding cannot exchange as numpy arrays (bfloat16, float8, int4) are
passed as OrtValues built from bit patterns and read back from raw memory.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from onnx_qrewrite._dataclass import dataclass
from onnx_qrewrite.errors import InvalidModelError, UsageError, first_line
from onnx_qrewrite.io.elem_types import np_dtype, type_name
from onnx_qrewrite.verify import _kernel_errors
from onnx_qrewrite.verify._ort import ort

if TYPE_CHECKING:
    import onnx

__all__ = ["OPT_LEVELS", "ModelRunner", "SessionSettings", "available_cpus"]

logger = logging.getLogger(__name__)

#: ``--ort-opt-level`` choices, in increasing order of rewriting by onnxruntime.
OPT_LEVELS: dict[str, ort.GraphOptimizationLevel] = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}

# ONNX types onnxruntime's numpy conversion does not handle: exchanged as raw bits.
# (TensorProto.DataType numbers: BFLOAT16, FLOAT8E4M3FN, FLOAT8E4M3FNUZ, FLOAT8E5M2, FLOAT8E5M2FNUZ.)
# The dtypes are ml_dtypes' (imported when one is first needed: most models have none).
_RAW_TYPES: dict[str, int] = {f"tensor({type_name(t).lower()})": t for t in (16, 17, 18, 19, 20)}
_PACKED_4BIT = ("tensor(int4)", "tensor(uint4)")


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class SessionSettings:
    """What both sessions share (``custom_op_library`` is registered for the original only).

    ``threads`` above the CPUs this process may use is capped to them, with a warning."""

    opt_level: str = "disable"
    threads: int = 1
    custom_op_library: Path | None = None

    def __post_init__(self) -> None:
        if self.opt_level not in OPT_LEVELS:
            raise UsageError(f"--ort-opt-level: expected one of {', '.join(OPT_LEVELS)}, got {self.opt_level!r}")
        if self.threads < 0:
            raise UsageError(f"--threads: expected a count >= 0 (0: onnxruntime's default), got {self.threads}")
        cpus = available_cpus()
        if self.threads > cpus:
            # More threads than CPUs only slows onnxruntime down, and a huge count makes it hang or
            # crash creating them: cap at what the machine has, and say so.
            logger.warning("--threads %d: this machine has %d CPU(s); using %d", self.threads, cpus, cpus)
            object.__setattr__(self, "threads", cpus)
        if self.custom_op_library is not None and not Path(self.custom_op_library).is_file():
            raise UsageError(f"--custom-op-library: {self.custom_op_library}: no such file")

    def session_options(self) -> ort.SessionOptions:
        """onnxruntime session options with these settings (the same for both models)."""
        options = ort.SessionOptions()
        options.graph_optimization_level = OPT_LEVELS[self.opt_level]
        options.intra_op_num_threads = self.threads
        options.inter_op_num_threads = 1
        # Fatal only: warnings would interleave with the report, and a kernel's failure reaches the user
        # as this package's one-line error, which carries onnxruntime's message.
        options.log_severity_level = 4
        return options


def _to_ortvalue(array: np.ndarray) -> ort.OrtValue:
    array = np.ascontiguousarray(array)
    for onnx_type in _RAW_TYPES.values() if "ml_dtypes" in sys.modules else ():  # else no array is one
        dtype = np_dtype(onnx_type)
        if array.dtype == dtype:
            bits = array.view(np.dtype(f"u{dtype.itemsize}"))
            return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(bits, onnx_type)
    return ort.OrtValue.ortvalue_from_numpy(array)


def _from_ortvalue(value: ort.OrtValue) -> np.ndarray:
    type_name = value.data_type()
    if type_name not in _RAW_TYPES and type_name not in _PACKED_4BIT:
        return value.numpy()
    shape = tuple(value.shape())
    raw = np.empty(value.tensor_size_in_bytes(), np.uint8)
    if raw.size:
        ctypes.memmove(raw.ctypes.data, value.data_ptr(), raw.size)
    if type_name in _RAW_TYPES:
        return raw.view(np_dtype(_RAW_TYPES[type_name])).reshape(shape)
    # Two 4-bit elements per byte, the first in the low nibble (ONNX's packing).
    count = int(np.prod(shape, dtype=np.int64))
    nibbles = np.empty(raw.size * 2, np.uint8)
    nibbles[0::2], nibbles[1::2] = raw & 0x0F, raw >> 4
    nibbles = nibbles[:count]
    if type_name == "tensor(int4)":
        return ((nibbles.astype(np.int8) ^ 8) - 8).astype(np_dtype(22)).reshape(shape)  # INT4
    return nibbles.astype(np_dtype(21)).reshape(shape)  # UINT4


class ModelRunner:
    """One model in one onnxruntime session; the label names the model in every error."""

    def __init__(
        self,
        model: onnx.ModelProto | bytes,
        *,
        label: str,
        settings: SessionSettings,
        reference_kernels: bool = False,
        register_custom_library: bool = False,
        providers: Sequence[str] = ("CPUExecutionProvider",),
    ) -> None:
        """``model``: a ModelProto, or the serialized model (handed to onnxruntime as it is: no
        parse in Python, see ``verify``'s fast path); ``reference_kernels``: retarget vendor
        nodes to the numpy kernels first (a ModelProto only);
        ``register_custom_library``: load ``settings.custom_op_library`` into this session;
        ``providers``: onnxruntime execution providers (``verify --providers``, rewritten side)."""
        self.label = label
        options = settings.session_options()
        if register_custom_library and settings.custom_op_library is not None:
            try:
                options.register_custom_ops_library(str(settings.custom_op_library))
            except Exception as exc:  # noqa: BLE001 - onnxruntime raises several types here
                raise UsageError(
                    f"--custom-op-library: {settings.custom_op_library}: cannot load: {first_line(exc)}"
                ) from None
        if reference_kernels:
            from onnx_qrewrite.verify import reference_ops

            assert not isinstance(model, bytes), "reference kernels retarget a parsed model"
            try:
                model = reference_ops.retarget_vendor_nodes(model)
                needs_kernels = any(o.domain == reference_ops.REFERENCE_DOMAIN for o in model.opset_import)
            except InvalidModelError as exc:
                raise InvalidModelError(f"{label}: {exc}") from None
            if needs_kernels:
                options.register_custom_ops_library(reference_ops.register_reference_kernels())
        self.model = model
        try:
            serialized = model if isinstance(model, bytes) else model.SerializeToString()
            self.session = ort.InferenceSession(serialized, options, providers=list(providers))
        except Exception as exc:  # noqa: BLE001 - onnxruntime raises Fail, InvalidGraph, ... here
            raise InvalidModelError(f"{label}: onnxruntime cannot load the model: {first_line(exc)}") from None
        self.input_names = [i.name for i in self.session.get_inputs()]
        #: Initializers the model also lists as inputs: fed when a sample gives them.
        self.overridable = [i.name for i in self.session.get_overridable_initializers()]
        #: output name -> onnxruntime type string, e.g. "tensor(float)"
        self.output_types = {o.name: o.type for o in self.session.get_outputs()}

    def run(self, feeds: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Run once; every output as a numpy array (bfloat16/float8/int4 as ml_dtypes arrays)."""
        names = list(outputs) if outputs is not None else list(self.output_types)
        _kernel_errors.take()  # start clean
        try:
            given = {name: _to_ortvalue(feeds[name]) for name in self.input_names}
            given |= {name: _to_ortvalue(feeds[name]) for name in self.overridable if name in feeds}
            values = self.session.run_with_ort_values(names, given)
        except KeyError as exc:
            raise UsageError(f"{self.label}: no value given for the input {exc.args[0]!r}") from None
        except Exception as exc:  # noqa: BLE001 - a kernel failed at run time
            kernel_errors = _kernel_errors.take()
            reason = kernel_errors[0] if kernel_errors else first_line(exc)
            raise InvalidModelError(f"{self.label}: onnxruntime failed while running the model: {reason}") from None
        kernel_errors = _kernel_errors.take()
        if kernel_errors:
            raise InvalidModelError(f"{self.label}: onnxruntime failed while running the model: {kernel_errors[0]}")
        return {name: _from_ortvalue(v) for name, v in zip(names, values, strict=True)}
