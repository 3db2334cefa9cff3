"""The inputs both models are run on: given (``--inputs``) or generated from the declared types.

Generated inputs are several seeded random samples plus, when the model has floating-point
inputs, a *quantization battery*: inputs chosen to hit the edge cases of quantization kernels that
random data almost never reaches:

=============  =========================================================================
sample         why
=============  =========================================================================
``zeros``      max == min: DynamicQuantizeLinear's zero-range guard (scale 1, not 0/0)
``constant``   one repeated non-zero value: a degenerate range on one side of zero
``wide-range`` magnitudes from 1e-4 to 1e4, both signs: saturation and tiny values
``negative``   negatives only: a range that does not contain the zero point's value
=============  =========================================================================

Symbolic or unknown dimensions take their value from ``--input-shape`` or default to 1 (the usual
meaning of a batch or sequence dimension for a single test case).

Sample files (``--inputs`` / ``--save-inputs``) are ``.npz`` keyed by input name, or by
``<sample>::<input>`` when they hold several samples. bfloat16 and float8 arrays are stored as
their unsigned-integer bit patterns (numpy's format has no such dtypes), as in the shared vectors.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import zipfile
from collections.abc import Mapping, Sequence

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper

from onnx_qrewrite.errors import UsageError

__all__ = [
    "BATTERY",
    "DEFAULT_DIM",
    "GenerationOptions",
    "InputSpec",
    "Sample",
    "generate_samples",
    "input_specs",
    "load_samples",
    "parse_input_shape",
    "parse_int_range",
    "save_samples",
]

logger = logging.getLogger(__name__)

#: Value of a symbolic or unknown dimension when ``--input-shape`` does not give one.
DEFAULT_DIM = 1
#: Names of the quantization battery samples, in the order they are run.
BATTERY = ("zeros", "constant", "wide-range", "negative")
_SAMPLE_SEPARATOR = "::"
_FLOAT_TYPES = (
    TensorProto.FLOAT,
    TensorProto.DOUBLE,
    TensorProto.FLOAT16,
    TensorProto.BFLOAT16,
)
_INT_TYPES = (
    TensorProto.INT8,
    TensorProto.UINT8,
    TensorProto.INT16,
    TensorProto.UINT16,
    TensorProto.INT32,
    TensorProto.UINT32,
    TensorProto.INT64,
    TensorProto.UINT64,
)
_BIT_PATTERN_DTYPES = {
    np.dtype(ml_dtypes.bfloat16),
    np.dtype(ml_dtypes.float8_e4m3fn),
    np.dtype(ml_dtypes.float8_e4m3fnuz),
    np.dtype(ml_dtypes.float8_e5m2),
    np.dtype(ml_dtypes.float8_e5m2fnuz),
}


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """A model input as declared: element type and dimensions (int, symbol name or None)."""

    name: str
    elem_type: int
    dims: tuple[int | str | None, ...] | None  # None: no shape declared at all

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(helper.tensor_dtype_to_np_dtype(self.elem_type))

    @property
    def type_name(self) -> str:
        return TensorProto.DataType.Name(self.elem_type).lower()


@dataclasses.dataclass(frozen=True)
class Sample:
    """One set of input values, named so reports can say which one failed."""

    name: str
    feeds: Mapping[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class GenerationOptions:
    """How inputs are generated when none are given."""

    samples: int = 2
    seed: int = 0
    int_range: tuple[int, int] = (0, 9)  # inclusive
    shapes: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    battery: bool = True

    def __post_init__(self) -> None:
        if self.samples < 0:
            raise UsageError(f"--samples: expected a count >= 0, got {self.samples}")
        lo, hi = self.int_range
        if lo > hi:
            raise UsageError(f"--int-range: the low end {lo} is above the high end {hi}")


def input_specs(model: onnx.ModelProto) -> list[InputSpec]:
    """The inputs a caller must feed: graph inputs that are not initializers (IR >= 4 defaults)."""
    initializers = {t.name for t in model.graph.initializer}
    specs = []
    for info in model.graph.input:
        if info.name in initializers:
            continue
        if not info.type.HasField("tensor_type"):
            raise UsageError(f"input {info.name!r} is not a tensor; only tensor inputs can be generated or loaded")
        tensor_type = info.type.tensor_type
        dims: tuple[int | str | None, ...] | None = None
        if tensor_type.HasField("shape"):
            dims = tuple(
                d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor_type.shape.dim
            )
        specs.append(InputSpec(info.name, tensor_type.elem_type, dims))
    return specs


def parse_input_shape(text: str) -> tuple[str, tuple[int, ...]]:
    """``name:d0,d1,...`` (the name may itself contain ``:``) -> (name, dims); ``name:`` is a scalar."""
    name, sep, dims = text.rpartition(":")
    if not sep or not name:
        raise UsageError(f"--input-shape: expected NAME:D0,D1,... got {text!r}")
    try:
        shape = tuple(int(d) for d in dims.split(",")) if dims.strip() else ()
    except ValueError:
        raise UsageError(f"--input-shape: dimensions must be integers, got {text!r}") from None
    if any(d < 0 for d in shape):
        raise UsageError(f"--input-shape: dimensions must be >= 0, got {text!r}")
    return name, shape


def parse_int_range(text: str) -> tuple[int, int]:
    """``lo,hi`` (inclusive) -> (lo, hi); the order is checked by :class:`GenerationOptions`."""
    try:
        lo, hi = (int(v) for v in text.split(","))
    except ValueError:
        raise UsageError(f"--int-range: expected LO,HI (two integers), got {text!r}") from None
    return lo, hi


def _resolve_shape(spec: InputSpec, shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, ...]:
    if spec.name in shapes:
        shape = shapes[spec.name]
        if spec.dims is not None:
            if len(shape) != len(spec.dims):
                raise UsageError(
                    f"--input-shape: {spec.name!r} has rank {len(spec.dims)} but {len(shape)} dimensions were given"
                )
            for i, (given, declared) in enumerate(zip(shape, spec.dims, strict=True)):
                if isinstance(declared, int) and declared > 0 and given != declared:
                    raise UsageError(f"--input-shape: {spec.name!r} dimension {i} is fixed at {declared}, got {given}")
        return shape
    if spec.dims is None:
        raise UsageError(f"input {spec.name!r} declares no shape; give one with --input-shape {spec.name}:D0,D1,...")
    return tuple(d if isinstance(d, int) and d > 0 else DEFAULT_DIM for d in spec.dims)


def _random(
    spec: InputSpec, shape: tuple[int, ...], rng: np.random.Generator, int_range: tuple[int, int]
) -> np.ndarray:
    if spec.elem_type in _FLOAT_TYPES:
        return rng.standard_normal(shape, dtype=np.float32).astype(spec.dtype)
    if spec.elem_type in _INT_TYPES:
        info = np.iinfo(spec.dtype)
        lo, hi = max(int_range[0], int(info.min)), min(int_range[1], int(info.max))
        if lo > hi:
            raise UsageError(
                f"--int-range: {int_range[0]},{int_range[1]} holds no {spec.type_name} value (input {spec.name!r})"
            )
        return rng.integers(lo, hi, size=shape, endpoint=True).astype(spec.dtype)
    if spec.elem_type == TensorProto.BOOL:
        return rng.random(shape) < 0.5
    raise UsageError(f"input {spec.name!r} has type {spec.type_name}, which cannot be generated; pass --inputs")


def _battery(kind: str, spec: InputSpec, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if kind == "zeros":
        values = np.zeros(shape, np.float32)
    elif kind == "constant":
        values = np.full(shape, 0.7, np.float32)
    elif kind == "wide-range":
        magnitudes = 10.0 ** rng.uniform(-4.0, 4.0, size=shape)
        values = (magnitudes * rng.choice([-1.0, 1.0], size=shape)).astype(np.float32)
    else:  # negative
        values = -rng.uniform(0.01, 5.0, size=shape).astype(np.float32)
    return values.astype(spec.dtype)


def generate_samples(specs: Sequence[InputSpec], options: GenerationOptions) -> list[Sample]:
    """``options.samples`` random samples, then the battery when any input is floating point."""
    unknown = set(options.shapes) - {s.name for s in specs}
    if unknown:
        raise UsageError(f"--input-shape: the model has no input named {sorted(unknown)[0]!r}")
    shapes = {spec.name: _resolve_shape(spec, options.shapes) for spec in specs}
    rng = np.random.default_rng(options.seed)
    samples = [
        Sample(f"random-{i}", {s.name: _random(s, shapes[s.name], rng, options.int_range) for s in specs})
        for i in range(options.samples)
    ]
    if options.battery and any(s.elem_type in _FLOAT_TYPES for s in specs):
        for kind in BATTERY:
            feeds = {
                s.name: _battery(kind, s, shapes[s.name], rng)
                if s.elem_type in _FLOAT_TYPES
                else _random(s, shapes[s.name], rng, options.int_range)
                for s in specs
            }
            samples.append(Sample(kind, feeds))
    if not samples:
        raise UsageError("--samples: 0 random samples and no battery leaves nothing to run")
    return samples


def _decode(array: np.ndarray, spec: InputSpec, where: str) -> np.ndarray:
    """A stored array as the input's dtype; bit patterns become bfloat16/float8 again."""
    if spec.dtype in _BIT_PATTERN_DTYPES and array.dtype.kind == "u" and array.dtype.itemsize == spec.dtype.itemsize:
        return array.view(spec.dtype)
    if array.dtype != spec.dtype:
        raise UsageError(f"--inputs: {where} has dtype {array.dtype}, but the model input is {spec.type_name}")
    if spec.dims is not None and (
        array.ndim != len(spec.dims)
        or any(isinstance(d, int) and d > 0 and d != n for d, n in zip(spec.dims, array.shape, strict=True))
    ):
        raise UsageError(f"--inputs: {where} has shape {list(array.shape)}, but the model declares {list(spec.dims)}")
    return array


def load_samples(path: str | os.PathLike[str], specs: Sequence[InputSpec]) -> list[Sample]:
    """Samples from an ``.npz`` keyed ``<input>`` (one sample) or ``<sample>::<input>``."""
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {key: data[key] for key in data.files}
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise UsageError(f"--inputs: {path}: cannot read as .npz: {exc}") from None
    by_name = {s.name: s for s in specs}
    grouped: dict[str, dict[str, np.ndarray]] = {}
    for key, array in arrays.items():
        if key in by_name:
            sample, name = "inputs", key
        else:
            sample, sep, name = key.partition(_SAMPLE_SEPARATOR)
            if not sep or name not in by_name:
                raise UsageError(f"--inputs: {path}: {key!r} is not an input of the model ({', '.join(by_name)})")
        grouped.setdefault(sample, {})[name] = _decode(array, by_name[name], f"{path}: {key!r}")
    samples = []
    for sample, feeds in grouped.items():
        missing = [n for n in by_name if n not in feeds]
        if missing:
            raise UsageError(
                f"--inputs: {path}: no value for the input {missing[0]!r}"
                + (f" in sample {sample!r}" if len(grouped) > 1 else "")
            )
        samples.append(Sample(sample, feeds))
    if not samples:
        raise UsageError(f"--inputs: {path}: the file holds no arrays")
    return samples


def _encode(array: np.ndarray) -> np.ndarray:
    if array.dtype in _BIT_PATTERN_DTYPES:
        return array.view(np.dtype(f"u{array.dtype.itemsize}"))
    return array


def save_samples(path: str | os.PathLike[str], samples: Sequence[Sample]) -> None:
    """Write ``samples`` so that ``load_samples`` gives them back (one sample: plain input names)."""
    if len(samples) == 1:
        arrays = {name: _encode(a) for name, a in samples[0].feeds.items()}
    else:
        arrays = {f"{s.name}{_SAMPLE_SEPARATOR}{name}": _encode(a) for s in samples for name, a in s.feeds.items()}
    try:
        with open(path, "wb") as f:
            np.savez(f, **arrays)
    except OSError as exc:
        raise UsageError(f"--save-inputs: {path}: cannot write: {exc.strerror or exc}") from None
    logger.info("saved %d sample(s) to %s", len(samples), path)
