"""The runtimes ``verify --runtime`` can run the rewritten model on (the original always runs in
onnxruntime, where its ops run): onnxruntime itself (with ``--providers``), OpenVINO, tract and
Qualcomm QNN (onnxruntime's QNN execution provider).

Each runner has the interface the verifier uses of :class:`~.session.ModelRunner` (``label``,
``input_types``, ``output_types``, ``run``) and reports the settings that decide its numbers,
because a runtime's defaults can change the verdict:

- OpenVINO's CPU plugin runs float32 models in bfloat16 on CPUs that have it unless
  ``INFERENCE_PRECISION_HINT=f32`` is set (7e-4 to 3e-3 relative L2 on float models otherwise),
  and on CPUs with VNNI or AMX it quantizes the activations of a matmul on compressed weights
  (com.microsoft MatMulNBits) to int8 in groups of 32 unless ``DYNAMIC_QUANTIZATION_GROUP_SIZE=0``
  (max abs 0.022 on the battery's nbits_bert otherwise, 9.5e-7 with it; openvino 2026.4.1 on an
  AMD EPYC with avx512_vnni);
- tract refuses concrete inputs when ``value_info`` holds symbolic dims that quantizers renamed,
  so value_info is dropped and each input's fact (shape, type) comes from the inputs given;
- QNN needs static input shapes (symbolic dims fixed as onnxruntime's make_dynamic_shape_fixed
  does, from ``--input-shape`` or 1), a ``soc_model`` (graph finalisation fails with the default),
  onnxruntime's default optimisation level (its QDQ fusions are how QNN runs quantize_dynamic
  models) and ``session.disable_cpu_ep_fallback=1``, so a node QNN refuses is an error rather than
  a silent fallback to the CPU.

Default tolerances per runtime account for its arithmetic (float32 kernels that sum in another
order; QNN's fp16-like float path); they are wide enough for that and far below the errors of a
runtime computing wrong numbers (e.g. 0.135 on a uint16 QDQ CNN in OpenVINO 2026.4.1), which must
fail, not hide. ``--atol``/``--rtol`` override them.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from onnx_qrewrite._dataclass import dataclass

if TYPE_CHECKING:
    import onnx

from onnx_qrewrite.errors import InvalidModelError, MissingDependencyError, UsageError, first_line

__all__ = [
    "RUNTIMES",
    "RuntimeInfo",
    "check_providers",
    "install_hint",
    "make_runner",
    "require_runtime",
    "runtime_info",
]


@dataclass(frozen=True)
class RuntimeSpec:
    module: str  # what must import
    distribution: str  # what pip installs
    extra: str  # onnx-qrewrite's extra that installs it ("": none, the runtime has its own environment)
    #: default float tolerances (atol, rtol) for the rewritten model on this runtime
    atol: float
    rtol: float


RUNTIMES: dict[str, RuntimeSpec] = {
    "onnxruntime": RuntimeSpec("onnxruntime", "onnxruntime", "verify", 0.0, 0.0),
    "openvino": RuntimeSpec("openvino", "openvino", "openvino", 1e-5, 1e-4),
    "tract": RuntimeSpec("tract", "tract", "tract", 1e-5, 1e-4),
    "qnn": RuntimeSpec("onnxruntime_qnn", "onnxruntime-qnn", "qnn", 5e-2, 5e-2),
    # Runs in its own interpreter (see tflite_python): the module is looked for there. No extra:
    # onnx2tf pins onnx and onnxruntime below what this package is proven on (install_hint says how).
    "tflite": RuntimeSpec("onnx2tf", "onnx2tf", "", 1e-5, 1e-4),
}

#: The Python (3.12+) that has onnx2tf and ai-edge-litert, when it is not this one.
TFLITE_PYTHON_ENV = "ONNX_QREWRITE_TFLITE_PYTHON"
TFLITE_SETUP = (
    "python3.12 -m venv tflite-venv && tflite-venv/bin/pip install onnx2tf ai-edge-litert, "
    f"then set {TFLITE_PYTHON_ENV}=tflite-venv/bin/python"
)


def tflite_python() -> str:
    """The interpreter that converts with onnx2tf and runs ai-edge-litert: ``$ONNX_QREWRITE_TFLITE_PYTHON``,
    else this one if it has both. onnx2tf 2.x needs Python 3.12+ and pins its own onnx and
    onnxruntime, so it normally lives in an environment of its own."""
    import importlib.util
    import os
    import sys

    given = os.environ.get(TFLITE_PYTHON_ENV)
    if given:
        if not Path(given).is_file():
            raise UsageError(f"{TFLITE_PYTHON_ENV}={given}: no such file")
        return given
    try:
        here = all(importlib.util.find_spec(m) is not None for m in ("onnx2tf", "ai_edge_litert"))
    except ImportError:
        here = False
    if here:
        return sys.executable
    raise MissingDependencyError(
        "--runtime tflite needs onnx2tf 2.x and ai-edge-litert on Python 3.12+, in their own environment "
        f"(onnx2tf pins its own onnx and onnxruntime): {TFLITE_SETUP}"
    )


@dataclass(frozen=True)
class RuntimeInfo:
    """What ran the rewritten model, as the report states it."""

    name: str
    version: str | None
    settings: Mapping[str, str]
    atol: float | None  # default float tolerance on this runtime (None: onnxruntime's per-dtype ones)
    rtol: float | None


def install_hint(name: str) -> str:
    """How to install runtime ``name`` (one clause, for the messages that say it is missing)."""
    if name == "tflite":
        return TFLITE_SETUP
    return f"pip install 'onnx-qrewrite[{RUNTIMES[name].extra}]'"


def require_runtime(name: str) -> Any:
    """The module (for tflite: the interpreter) that runs ``name``; the one availability check that
    ``verify --runtime`` and ``rewrite --target --verify`` share, so they never disagree on whether a
    runtime is here. MissingDependencyError saying how to install it, else."""
    if name not in RUNTIMES:
        raise UsageError(f"--runtime: expected one of {', '.join(RUNTIMES)}, got {name!r}")
    if name == "tflite":
        return tflite_python()
    spec = RUNTIMES[name]
    try:
        return importlib.import_module(spec.module)
    except ImportError:
        raise MissingDependencyError(
            f"--runtime {name} needs {spec.distribution}, which is not installed: {install_hint(name)}"
        ) from None


def _version(distribution: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_providers(providers: Sequence[str]) -> None:
    """``--providers`` must name execution providers this onnxruntime has: given another, onnxruntime
    only warns and runs the model on the CPU, and the report would say it ran on the one asked for.
    A plugin provider (onnxruntime-qnn's QNN) is not among them: ``--runtime qnn`` registers it."""
    module = require_runtime("onnxruntime")
    available = list(module.get_available_providers())
    missing = [p for p in providers if p not in available]
    if missing:
        raise UsageError(
            f"--providers: {', '.join(missing)} is not an execution provider of this onnxruntime "
            f"(available: {', '.join(available)}; QNN: --runtime qnn)"
        )


def runtime_info(name: str, providers: Sequence[str] = (), threads: int = 1) -> RuntimeInfo:
    """Check ``name`` is installed (else exit 2 naming the extra) and say how it will be run."""
    module = require_runtime(name)
    spec = RUNTIMES[name]
    settings: dict[str, str]
    if name == "onnxruntime":
        check_providers(providers)
        settings = {"providers": ",".join(providers or ("CPUExecutionProvider",))}
        # The module's own version: any onnxruntime flavour (onnxruntime-gpu, ...) is that module,
        # and reading it costs nothing where a distribution lookup scans the installed packages.
        return RuntimeInfo(name, getattr(module, "__version__", None), settings, None, None)
    if name == "openvino":
        settings = {"device": "CPU", **_OPENVINO_CONFIG, "INFERENCE_NUM_THREADS": str(threads or 0)}
    elif name == "tract":
        settings = {"value_info": "dropped", "input facts": "from the inputs given", "optimisation": "into_model"}
    elif name == "tflite":
        python = tflite_python()
        settings = {
            "converter": "onnx2tf (default flatbuffer_direct path, NCHW inputs kept)",
            "interpreter": "ai-edge-litert, float32 model",
            "python": python,
        }
        return RuntimeInfo(name, _child_versions(python), settings, spec.atol, spec.rtol)
    else:
        settings = {
            "backend_type": "htp",
            "soc_model": "60",
            "session.disable_cpu_ep_fallback": "1",
            "graph_optimization_level": "onnxruntime default (all)",
            "input shapes": "symbolic dims fixed from --input-shape (default 1)",
        }
    return RuntimeInfo(name, _version(spec.distribution), settings, spec.atol, spec.rtol)


def _child_versions(python: str) -> str | None:
    import subprocess

    code = (
        "import importlib.metadata as m; "
        "print(f\"onnx2tf {m.version('onnx2tf')}, ai-edge-litert {m.version('ai-edge-litert')}\")"
    )
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    return done.stdout.strip() or None


def _input_types(model: onnx.ModelProto) -> dict[str, str]:
    import onnx

    init = {t.name for t in model.graph.initializer}
    out = {}
    for vi in model.graph.input:
        if vi.name in init:
            continue
        elem = vi.type.tensor_type.elem_type
        name = onnx.TensorProto.DataType.Name(elem).lower() if elem else "undefined"
        out[vi.name] = f"tensor({name})"
    return out


def _output_types(model: onnx.ModelProto) -> dict[str, str]:
    import onnx

    out = {}
    for vi in model.graph.output:
        elem = vi.type.tensor_type.elem_type
        out[vi.name] = f"tensor({onnx.TensorProto.DataType.Name(elem).lower() if elem else 'undefined'})"
    return out


class _Runner:
    """Common part: the label, the declared interface, and the temporary copy some runtimes read
    (inside a private temporary folder, never beside the user's files)."""

    def __init__(self, model: onnx.ModelProto, label: str, runtime: str) -> None:
        self.label = label
        self.runtime = runtime
        self.model = model
        self.input_types = _input_types(model)
        self.input_names = list(self.input_types)
        self.output_types = _output_types(model)
        from onnx_qrewrite.io import outputs  # registered: a stopped batch worker removes it too

        self._tmp = outputs.private_folder("onnx-qrewrite-")

    def _write(self, model: onnx.ModelProto) -> Path:
        path = Path(self._tmp.name) / "model.onnx"
        path.write_bytes(model.SerializeToString())
        return path

    def _fail(self, what: str, exc: BaseException) -> InvalidModelError:
        return InvalidModelError(f"{self.label}: {self.runtime} {what}: {first_line(exc)}")


#: OpenVINO's CPU plugin settings that decide its numbers (module docstring): float32 arithmetic,
#: and no dynamic quantization of activations.
_OPENVINO_CONFIG = {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}


#: The lines OpenVINO nests its C++ exceptions in ("Exception from src/inference/src/cpp/core.cpp:117:"),
#: which say where it was thrown, not what went wrong.
_OPENVINO_WHERE = re.compile(r"^Exception from \S+:\d+:$")


def openvino_message(exc: BaseException) -> str:
    """OpenVINO's error in one line: its first line that is not a nesting "Exception from
    file:line:" line, and the last one when they differ (the check that failed). The first line
    alone, as other runtimes are quoted, says only "Exception from src/inference/src/cpp/core.cpp"."""
    lines = [line.strip() for line in str(exc).splitlines()]
    said = [line for line in lines if line and not _OPENVINO_WHERE.match(line)]
    if not said:
        return first_line(exc)
    return said[0] if len(said) == 1 else f"{said[0]} ... {said[-1]}"


class OpenVINORunner(_Runner):
    def _fail(self, what: str, exc: BaseException) -> InvalidModelError:
        return InvalidModelError(f"{self.label}: {self.runtime} {what}: {openvino_message(exc)}")

    def __init__(self, model: onnx.ModelProto, *, label: str, threads: int = 1) -> None:
        super().__init__(model, label, "openvino")
        ov = require_runtime("openvino")
        config = dict(_OPENVINO_CONFIG)
        if threads:
            config["INFERENCE_NUM_THREADS"] = str(threads)
        try:
            core = ov.Core()
            self._compiled = core.compile_model(core.read_model(str(self._write(model))), "CPU", config)
        except Exception as exc:  # noqa: BLE001 - OpenVINO raises RuntimeError and others here
            raise self._fail("cannot load the model", exc) from None
        # An OpenVINO output can carry several tensor names; use the one the ONNX graph declares.
        declared = list(self.output_types)
        self._names = [
            next((n for n in declared if n in o.get_names()), next(iter(o.get_names()), None))
            for o in self._compiled.outputs
        ]

    def run(self, feeds: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        try:
            result = self._compiled({n: np.ascontiguousarray(feeds[n]) for n in self.input_names})
        except KeyError as exc:
            raise UsageError(f"{self.label}: no value given for the input {exc.args[0]!r}") from None
        except Exception as exc:  # noqa: BLE001 - a kernel failed at run time
            raise self._fail("failed while running the model", exc) from None
        values = {}
        for port, name in zip(self._compiled.outputs, self._names, strict=True):
            values[name] = np.asarray(result[port])
        wanted = list(outputs) if outputs is not None else list(self.output_types)
        return {n: values[n] for n in wanted if n in values}


_TRACT_TYPES = {
    np.dtype("float32"): "f32",
    np.dtype("float16"): "f16",
    np.dtype("float64"): "f64",
    np.dtype("int8"): "i8",
    np.dtype("uint8"): "u8",
    np.dtype("int16"): "i16",
    np.dtype("uint16"): "u16",
    np.dtype("int32"): "i32",
    np.dtype("int64"): "i64",
    np.dtype("bool"): "bool",
}


class TractRunner(_Runner):
    def __init__(self, model: onnx.ModelProto, *, label: str) -> None:
        super().__init__(model, label, "tract")
        self._tract = require_runtime("tract")
        import onnx

        stripped = onnx.ModelProto()
        stripped.CopyFrom(model)
        del stripped.graph.value_info[:]
        self._path = self._write(stripped)
        self._runnables: dict[tuple, Any] = {}
        try:
            self._tract.onnx().load(str(self._path))  # fail early, as the other runtimes do
        except Exception as exc:  # noqa: BLE001 - tract raises TractError and others
            raise self._fail("cannot load the model", exc) from None

    def _runnable(self, arrays: list[np.ndarray]) -> Any:
        key = tuple((a.shape, a.dtype.str) for a in arrays)
        if key not in self._runnables:
            try:
                inference = self._tract.onnx().load(str(self._path))
                for i, array in enumerate(arrays):
                    dims = ",".join(str(d) for d in array.shape)
                    fact = f"{dims},{_TRACT_TYPES[array.dtype]}" if dims else _TRACT_TYPES[array.dtype]
                    inference.set_input_fact(i, fact)
                self._runnables[key] = inference.into_model().into_runnable()
            except Exception as exc:  # noqa: BLE001
                raise self._fail("cannot load the model", exc) from None
        return self._runnables[key]

    def run(self, feeds: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        try:
            arrays = [np.ascontiguousarray(feeds[n]) for n in self.input_names]
        except KeyError as exc:
            raise UsageError(f"{self.label}: no value given for the input {exc.args[0]!r}") from None
        runnable = self._runnable(arrays)
        try:
            result = runnable.run(arrays)
        except Exception as exc:  # noqa: BLE001
            raise self._fail("failed while running the model", exc) from None
        values = {name: self._to_numpy(name, r) for name, r in zip(self.output_types, result, strict=True)}
        wanted = list(outputs) if outputs is not None else list(self.output_types)
        return {n: values[n] for n in wanted}

    def _to_numpy(self, name: str, tensor: Any) -> np.ndarray:
        """tract computes Shape and what is derived from it (Gather of a shape, Concat of dims) as
        TDim, its symbolic dimension type, which its public API does not hand out ("Unsupported
        DatumType in the public API TDim", tract 0.23.9): such a value, asked for as an output (the
        localiser asks for intermediate values, verify/localize.py), is converted to int64, the
        ONNX type it has. Found on a QOperator BERT whose embeddings slice positions by a Shape."""
        try:
            return tensor.to_numpy()
        except Exception as exc:  # noqa: BLE001 - tract raises TractError
            if "TDim" not in str(exc):
                raise self._fail(f"cannot read output {name!r}", exc) from None
            try:
                return tensor.convert_to(self._tract.DatumType.I64).to_numpy()
            except Exception as again:  # noqa: BLE001
                raise self._fail(f"cannot read output {name!r} (a tract TDim) as int64", again) from None


def fix_input_shapes(
    model: onnx.ModelProto, shapes: Mapping[str, Sequence[int]], dims: Mapping[str, int] | None = None
) -> onnx.ModelProto:
    """A copy with every symbolic input dimension fixed (``shapes`` by input name, else ``dims`` by
    dimension name, else 1: the shapes verify's samples take), as
    onnxruntime's make_dynamic_shape_fixed does: the dim_param is replaced wherever it appears."""
    import onnx
    from onnxruntime.tools.onnx_model_utils import fix_output_shapes, make_dim_param_fixed

    fixed = onnx.ModelProto()
    fixed.CopyFrom(model)
    for vi in fixed.graph.input:
        given = shapes.get(vi.name)
        for i, dim in enumerate(vi.type.tensor_type.shape.dim):
            if dim.dim_param:
                value = int(given[i]) if given is not None and i < len(given) else (dims or {}).get(dim.dim_param, 1)
                if value < 1:  # QNN then fails finalizing its graph ("QNN_COMMON_ERROR_MEM_ALLOC"), exit 3
                    raise UsageError(
                        f"--input-shape: dimension {dim.dim_param!r} of input {vi.name!r} must be at least 1 for "
                        f"--runtime qnn, which fixes it in the model (as make_dynamic_shape_fixed), got {value}"
                    )
                make_dim_param_fixed(fixed.graph, dim.dim_param, value)
    # Outputs declared without a type (the localiser's extra outputs, verify/localize.py) stay so:
    # fix_output_shapes cannot read them, and the runtime infers them.
    untyped = [o for o in fixed.graph.output if not o.type.HasField("tensor_type")]
    typed = [o for o in fixed.graph.output if o.type.HasField("tensor_type")]
    del fixed.graph.output[:]
    fixed.graph.output.extend(typed)
    fix_output_shapes(fixed)
    fixed.graph.output.extend(untyped)
    return fixed


_QNN_REGISTERED: set[str] = set()


class QnnRunner(_Runner):
    def __init__(
        self,
        model: onnx.ModelProto,
        *,
        label: str,
        shapes: Mapping[str, Sequence[int]],
        dims: Mapping[str, int] | None = None,
    ) -> None:
        qnn = require_runtime("qnn")
        from onnx_qrewrite.verify._ort import ort

        model = fix_input_shapes(model, shapes, dims)
        super().__init__(model, label, "qnn")
        name = qnn.get_ep_name()
        if name not in _QNN_REGISTERED:
            try:
                ort.register_execution_provider_library(name, qnn.get_library_path())
            except Exception as exc:  # noqa: BLE001 - already registered in this process
                if "already" not in str(exc).lower():
                    raise self._fail("cannot register the QNN execution provider", exc) from None
            _QNN_REGISTERED.add(name)
        devices = [d for d in ort.get_ep_devices() if d.ep_name == name]
        if not devices:
            raise MissingDependencyError(f"--runtime qnn: onnxruntime-qnn offers no device for {name} here")
        options = ort.SessionOptions()
        options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        options.log_severity_level = 4
        options.add_provider_for_devices(devices, {"backend_type": "htp", "soc_model": "60"})
        try:
            self.session = ort.InferenceSession(model.SerializeToString(), options)
        except Exception as exc:  # noqa: BLE001
            raise self._fail("cannot load the model (CPU fallback disabled)", exc) from None

    def run(self, feeds: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        names = list(outputs) if outputs is not None else list(self.output_types)
        try:
            values = self.session.run(names, {n: feeds[n] for n in self.input_names})
        except KeyError as exc:
            raise UsageError(f"{self.label}: no value given for the input {exc.args[0]!r}") from None
        except Exception as exc:  # noqa: BLE001
            raise self._fail("failed while running the model", exc) from None
        return dict(zip(names, values, strict=True))


class TFLiteRunner(_Runner):
    """onnx2tf converts a private copy (it rewrites its input in place), ai-edge-litert runs the
    float32 .tflite; both in :func:`tflite_python`'s interpreter, through _tflite_child.py, in the
    one process that serves every runner of this one (verify/tflite_host.py)."""

    def __init__(self, model: onnx.ModelProto, *, label: str) -> None:
        from onnx_qrewrite.verify.tflite_host import tflite_child

        super().__init__(model, label, "tflite")
        self._child = tflite_child(tflite_python())
        copy = self._write(model)
        out = str(Path(self._tmp.name) / "tflite")
        what = "(onnx2tf) cannot convert"
        self._tflite = self._child.request(label, what, op="convert", model=str(copy), out_dir=out)["path"]
        self._runs = 0

    def run(self, feeds: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        self._runs += 1
        inputs = Path(self._tmp.name) / f"in{self._runs}.npz"
        result = Path(self._tmp.name) / f"out{self._runs}.npz"
        try:
            arrays: dict[str, Any] = {n: np.ascontiguousarray(feeds[n]) for n in self.input_names}
            np.savez(inputs, **arrays)
        except KeyError as exc:
            raise UsageError(f"{self.label}: no value given for the input {exc.args[0]!r}") from None
        what = "(ai-edge-litert) cannot run"
        self._child.request(self.label, what, op="run", tflite=self._tflite, inputs=str(inputs), outputs=str(result))
        with np.load(result) as values:
            got = {k: values[k] for k in values.files}
        wanted = list(outputs) if outputs is not None else list(self.output_types)
        return {n: got[n] for n in wanted if n in got}


def make_runner(
    runtime: str,
    model: onnx.ModelProto,
    *,
    label: str,
    threads: int = 1,
    shapes: Mapping[str, Sequence[int]] | None = None,
    dims: Mapping[str, int] | None = None,
) -> Any:
    """A runner of ``model`` on ``runtime`` (not onnxruntime: :class:`~.session.ModelRunner` is);
    ``shapes``/``dims`` fix QNN's symbolic dimensions as the samples have them."""
    if runtime == "openvino":
        return OpenVINORunner(model, label=label, threads=threads)
    if runtime == "tract":
        return TractRunner(model, label=label)
    if runtime == "qnn":
        return QnnRunner(model, label=label, shapes=shapes or {}, dims=dims)
    if runtime == "tflite":
        return TFLiteRunner(model, label=label)
    raise UsageError(f"--runtime: expected one of {', '.join(RUNTIMES)}, got {runtime!r}")
