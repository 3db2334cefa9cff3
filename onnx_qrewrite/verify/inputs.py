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

Value ranges keep ordinary exported models valid, so that a verdict is about the rewrite and not
about inputs the model was never meant to see (an attention mask of 9s drives a softmax to NaN):

======================================  ===============================================
input                                   values
======================================  ===============================================
named by ``--val-range NAME:[LO,HI]``   that range (integers: inclusive; floats: uniform)
any, with a bare ``--val-range [LO,HI]``  that range
integer, with ``--int-range LO,HI``     that range (inclusive)
integer, feeding ``Gather`` as indices  ``[0, N-1]``, N the table's size on the gathered
                                        axis (through Cast/Reshape/Unsqueeze/... too)
attention lengths                       consistent with the sample's shapes, by
                                        :mod:`.attention_inputs`: GroupQueryAttention's
                                        seqlens_k and total_sequence_length (or the
                                        mask they are computed from), MultiHeadAttention's
                                        past_sequence_length, 1-D key-length masks
other integers                          ``{0, 1}`` (masks, token types, flags)
float                                   standard normal, plus the quantization battery
bool                                    random
======================================  ===============================================

Sizes are checked before anything is allocated: the inputs of all samples together may take at
most :data:`MAX_INPUT_BYTES` (1 GiB), and at most :data:`MAX_SAMPLES` random samples are run; a
request beyond either is refused with the size it would need.

Sample files (``--inputs`` / ``--save-inputs``) are ``.npz`` keyed by input name, or by
``<sample>::<input>`` when they hold several samples. bfloat16 and float8 arrays are stored as
their unsigned-integer bit patterns (numpy's format has no such dtypes), as in the shared vectors.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import zipfile
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from onnx_qrewrite._dataclass import dataclass
from onnx_qrewrite.errors import UsageError
from onnx_qrewrite.io.elem_types import ml_dtypes_named, np_dtype, type_name
from onnx_qrewrite.io.input_shape import parse_input_shape

if TYPE_CHECKING:
    import onnx

    from onnx_qrewrite.verify.attention_inputs import LengthInputs

__all__ = [
    "BATTERY",
    "DEFAULT_DIM",
    "MAX_INPUT_BYTES",
    "MAX_SAMPLES",
    "GenerationOptions",
    "InputSpec",
    "Sample",
    "ValueRange",
    "gather_index_limits",
    "generate_samples",
    "input_specs",
    "load_samples",
    "parse_input_shape",
    "parse_int_range",
    "parse_val_range",
    "read_npz",
    "resolve_shape",
    "resolve_value_ranges",
    "save_samples",
]

logger = logging.getLogger(__name__)

#: Value of a symbolic or unknown dimension when ``--input-shape`` does not give one.
DEFAULT_DIM = 1
#: Most bytes the inputs of all samples may take together (generated or loaded): a sane bound for a
#: verification run on a shared machine; bigger requests are refused before any allocation.
MAX_INPUT_BYTES = 1 << 30
#: Most random samples one verification generates (each costs one run of each model).
MAX_SAMPLES = 100_000
#: Seeds are what numpy's generator takes: integers in [0, 2**64).
MAX_SEED = 2**64 - 1
#: Names of the quantization battery samples, in the order they are run.
BATTERY = ("zeros", "constant", "wide-range", "negative")
_SAMPLE_SEPARATOR = "::"
# TensorProto.DataType numbers (see onnx_qrewrite.io.elem_types: this module does not import onnx).
_BOOL = 9
_FLOAT_TYPES = (
    1,  # FLOAT
    11,  # DOUBLE
    10,  # FLOAT16
    16,  # BFLOAT16
)
_INT_TYPES = (
    3,  # INT8
    2,  # UINT8
    5,  # INT16
    4,  # UINT16
    6,  # INT32
    12,  # UINT32
    7,  # INT64
    13,  # UINT64
)
#: ml_dtypes' types stored as bit patterns (onnx_qrewrite.io.elem_types.ml_dtypes_named).
_BIT_PATTERN_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")


@dataclass(frozen=True)
class InputSpec:
    """A model input as declared: element type and dimensions (int, symbol name or None)."""

    name: str
    elem_type: int
    dims: tuple[int | str | None, ...] | None  # None: no shape declared at all
    #: An initializer the graph also lists as an input (IR >= 4): a default a feed may replace.
    #: The random samples feed it (a rewrite must read it as the input it is, not fold its
    #: value in); the battery and a loaded sample without it leave it at its value.
    default: bool = False

    @property
    def dtype(self) -> np.dtype:
        return np_dtype(self.elem_type)

    @property
    def type_name(self) -> str:
        return type_name(self.elem_type).lower()


@dataclass(frozen=True)
class Sample:
    """One set of input values, named so reports can say which one failed."""

    name: str
    feeds: Mapping[str, np.ndarray]


@dataclass(frozen=True)
class ValueRange:
    """The values one input is generated in, and why (shown in the report)."""

    low: float | None  # None with high None: standard normal (floats) or random (bool)
    high: float | None
    why: str


@dataclass(frozen=True)
class GenerationOptions:
    """How inputs are generated when none are given.

    ``int_range``: every integer input in this range (inclusive); None: the defaults of the module
    docstring. ``value_ranges``: per input name; the key ``""`` (a bare ``--val-range``) applies to
    every input without its own. ``shapes``: by input name (``--input-shape NAME:D0,D1``);
    ``dims``: the value of each symbolic dimension of that name in any input (``--input-shape
    DIM=N``, the spelling ``rewrite --target`` uses to fix a model's dimension), where no shape
    for the whole input is given.
    """

    samples: int = 2
    seed: int = 0
    int_range: tuple[int, int] | None = None  # inclusive
    shapes: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    battery: bool = True
    value_ranges: Mapping[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    dims: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for dim, value in self.dims.items():
            if value < 0:
                raise UsageError(f"--input-shape {dim}={value}: dimensions must be >= 0")
        if not 0 <= self.samples <= MAX_SAMPLES:
            raise UsageError(f"--samples: expected a count from 0 to {MAX_SAMPLES}, got {self.samples}")
        if not 0 <= self.seed <= MAX_SEED:
            raise UsageError(f"--seed: expected an integer from 0 to 2**64-1, got {self.seed}")
        if self.int_range is not None and self.int_range[0] > self.int_range[1]:
            low, high = self.int_range
            raise UsageError(f"--int-range: the low end {low} is above the high end {high}")
        for name, (lo, hi) in self.value_ranges.items():
            where = f"--val-range {name + ':' if name else ''}[{lo},{hi}]"
            if not (math.isfinite(lo) and math.isfinite(hi)):
                raise UsageError(f"{where}: both ends must be finite numbers")
            if lo > hi:
                raise UsageError(f"{where}: the low end is above the high end")


#: Overridable initializers (:attr:`InputSpec.default`) larger than this keep their value in every
#: sample: a model that lists its weights as inputs (an exporter's compatibility option) would
#: otherwise be fed random weights of any size.
MAX_FED_DEFAULT_BYTES = 1 << 16


#: Where a node reads an integer input as a zero point: an integer default is fed random values only
#: when every reader reads it there. Other integer inputs are shapes, axes, pads, sizes or indices
#: (a Reshape's shape, a Gather's indices): random values there make the ORIGINAL fail or read
#: outside a table, which says nothing about the rewrite.
_ZERO_POINT_INPUTS: dict[str, frozenset[int]] = {
    "QuantizeLinear": frozenset({2}),
    "DequantizeLinear": frozenset({2}),
    "MatMulInteger": frozenset({2, 3}),
    "ConvInteger": frozenset({2, 3}),
    "QLinearMatMul": frozenset({2, 5, 7}),
    "QLinearConv": frozenset({2, 5, 7}),
    "MatMulIntegerToFloat": frozenset({4, 5}),
    "DynamicQuantizeMatMul": frozenset({3}),
}

#: Float inputs that decide a shape (Resize's roi, scales; Upsample's scales; Range's bounds): a
#: float default read there keeps its value.
_SHAPE_FLOAT_INPUTS: dict[str, frozenset[int]] = {
    "Resize": frozenset({1, 2, 3}),
    "Upsample": frozenset({1}),
    "Range": frozenset({0, 1, 2}),
}


def _readers(graph: onnx.GraphProto, into: dict[str, list[tuple[str, int]]]) -> dict[str, list[tuple[str, int]]]:
    """Each value name -> the (op, input index) pairs that read it, subgraphs included (a subgraph
    may read an outer value)."""
    for node in graph.node:
        for index, name in enumerate(node.input):
            if name:
                into.setdefault(name, []).append((node.op_type, index))
        for attribute in node.attribute:
            for sub in (*([attribute.g] if attribute.HasField("g") else ()), *attribute.graphs):
                _readers(sub, into)
    return into


def _fed_default(tensor: onnx.TensorProto, readers: Sequence[tuple[str, int]]) -> bool:
    """Whether an initializer listed as an input is fed by the random samples: a numeric one of
    at most :data:`MAX_FED_DEFAULT_BYTES`, read only as data: a float or bool one nowhere as a shape
    (:data:`_SHAPE_FLOAT_INPUTS`), an integer one only as a zero point (:data:`_ZERO_POINT_INPUTS`).
    Anything else keeps its value: a random shape or index makes the original itself fail."""
    try:
        dtype = np_dtype(tensor.data_type)
    except (KeyError, ValueError, TypeError):  # a string or an unknown type: left at its value
        return False
    if dtype.kind not in "biuf" or _nbytes(tuple(tensor.dims), dtype) > MAX_FED_DEFAULT_BYTES or not readers:
        return False
    if dtype.kind in "bf":  # data: weights, scales, conditions
        return not any(index in _SHAPE_FLOAT_INPUTS.get(op, ()) for op, index in readers)
    return all(index in _ZERO_POINT_INPUTS.get(op, ()) for op, index in readers)


def input_specs(model: onnx.ModelProto, defaults: bool = False) -> list[InputSpec]:
    """The inputs a caller must feed: graph inputs that are not initializers; with ``defaults``,
    also the small initializers a model from IR 4 on lists as inputs (:attr:`InputSpec.default`;
    before IR 4 every initializer had to be listed, which says nothing)."""
    initializers = {t.name: t for t in model.graph.initializer}
    readers = _readers(model.graph, {}) if defaults and model.ir_version >= 4 else {}
    specs = []
    for info in model.graph.input:
        tensor = initializers.get(info.name)
        if tensor is not None:
            if defaults and model.ir_version >= 4 and _fed_default(tensor, readers.get(info.name, ())):
                specs.append(InputSpec(info.name, tensor.data_type, tuple(tensor.dims), default=True))
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


_VAL_RANGE = re.compile(r"^(?:(?P<name>.*):)?\[(?P<lo>[^,\[\]]+),(?P<hi>[^,\[\]]+)\]$")


def parse_val_range(text: str) -> tuple[str, tuple[float, float]]:
    """Polygraphy's ``NAME:[LO,HI]`` (the name may contain ``:``) or ``[LO,HI]`` for every input
    -> (name or ``""``, (lo, hi)); the order and finiteness are checked by :class:`GenerationOptions`."""
    match = _VAL_RANGE.match(text.strip())
    if match is None:
        raise UsageError(f"--val-range: expected NAME:[LO,HI] or [LO,HI], got {text!r}")
    try:
        lo, hi = float(match["lo"]), float(match["hi"])
    except ValueError:
        raise UsageError(f"--val-range: LO and HI must be numbers, got {text!r}") from None
    name = match["name"]
    if name is not None and not name:
        raise UsageError(f"--val-range: empty input name in {text!r}")
    return name or "", (lo, hi)


def parse_int_range(text: str) -> tuple[int, int]:
    """``lo,hi`` (inclusive) -> (lo, hi); the order is checked by :class:`GenerationOptions`."""
    try:
        lo, hi = (int(v) for v in text.split(","))
    except ValueError:
        raise UsageError(f"--int-range: expected LO,HI (two integers), got {text!r}") from None
    return lo, hi


#: Ops that pass an integer tensor's values through unchanged (reshaped or retyped): an input that
#: reaches a Gather's indices through them is still an index.
_VALUE_PRESERVING = frozenset(
    {"Cast", "Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Expand", "Transpose", "Tile"}
)


def _static_dims(model: onnx.ModelProto) -> dict[str, tuple[int | None, ...]]:
    """Known dimensions of main-graph values: initializers, Constant nodes, declared value_info,
    and the outputs of shape-preserving (de)quantize and cast nodes of those (a quantized
    embedding table is ``DequantizeLinear(table_q, ...)``). No shape inference: cheap on any size."""
    dims: dict[str, tuple[int | None, ...]] = {t.name: tuple(t.dims) for t in model.graph.initializer}
    for info in [*model.graph.value_info, *model.graph.input, *model.graph.output]:
        if info.type.HasField("tensor_type") and info.type.tensor_type.HasField("shape"):
            dims.setdefault(
                info.name,
                tuple(d.dim_value if d.HasField("dim_value") else None for d in info.type.tensor_type.shape.dim),
            )
    for node in model.graph.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value" and node.output:
                    dims.setdefault(node.output[0], tuple(attr.t.dims))
        elif (
            (node.op_type in ("Cast", "Identity") or node.op_type.endswith(("QuantizeLinear", "DequantizeLinear")))
            and node.input
            and node.output
            and node.input[0] in dims
        ):
            dims.setdefault(node.output[0], dims[node.input[0]])
    return dims


def gather_index_limits(model: onnx.ModelProto) -> dict[str, tuple[int, str]]:
    """Integer graph inputs that reach a main-graph ``Gather``'s indices (directly or through
    value-preserving ops) -> (the smallest table size on the gathered axis, a description). A
    table whose size is unknown there is left out (such an input gets the {0, 1} default)."""
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    dims = _static_dims(model)
    limits: dict[str, tuple[int, str]] = {}
    for spec in input_specs(model):
        if spec.elem_type not in _INT_TYPES:
            continue
        seen, frontier = {spec.name}, [spec.name]
        while frontier:
            value = frontier.pop()
            for node in consumers.get(value, ()):
                if node.op_type == "Gather" and node.domain in ("", "ai.onnx") and list(node.input[1:2]) == [value]:
                    table = dims.get(node.input[0])
                    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                    if table is None or not -len(table) <= axis < len(table):
                        continue
                    size = table[axis]
                    if size is None or size <= 0:
                        continue
                    if spec.name not in limits or size < limits[spec.name][0]:
                        what = f"indices of Gather {node.name or node.output[0]!r} (table size {size})"
                        limits[spec.name] = (size, what)
                elif node.op_type in _VALUE_PRESERVING and node.domain in ("", "ai.onnx") and node.input[0] == value:
                    for out in node.output[:1]:
                        if out and out not in seen:
                            seen.add(out)
                            frontier.append(out)
    return limits


def resolve_value_ranges(
    specs: Sequence[InputSpec], options: GenerationOptions, index_limits: Mapping[str, tuple[int, str]] | None = None
) -> dict[str, ValueRange]:
    """The range each input is generated in, by the precedence of the module docstring."""
    unknown = set(options.value_ranges) - {s.name for s in specs} - {""}
    if unknown:
        raise UsageError(f"--val-range: the model has no input named {sorted(unknown)[0]!r}")
    ranges: dict[str, ValueRange] = {}
    for spec in specs:
        integer = spec.elem_type in _INT_TYPES
        if spec.name in options.value_ranges:
            lo, hi = options.value_ranges[spec.name]
            ranges[spec.name] = ValueRange(lo, hi, f"--val-range {spec.name}")
        elif "" in options.value_ranges:
            lo, hi = options.value_ranges[""]
            ranges[spec.name] = ValueRange(lo, hi, "--val-range (every input)")
        elif integer and options.int_range is not None:
            ranges[spec.name] = ValueRange(options.int_range[0], options.int_range[1], "--int-range")
        elif integer and index_limits and spec.name in index_limits:
            size, what = index_limits[spec.name]
            ranges[spec.name] = ValueRange(0, size - 1, what)
        elif integer:
            ranges[spec.name] = ValueRange(0, 1, "integer default {0, 1}")
        elif spec.elem_type == _BOOL:
            ranges[spec.name] = ValueRange(None, None, "random booleans")
        else:
            ranges[spec.name] = ValueRange(None, None, "standard normal")
    return ranges


def _nbytes(shape: Sequence[int], dtype: np.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _human(n: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


def _check_input_bytes(total: int, what: str) -> None:
    if total > MAX_INPUT_BYTES:
        raise UsageError(
            f"{what} would need {_human(total)} ({total} bytes) of inputs, more than the "
            f"{_human(MAX_INPUT_BYTES)} bound; use smaller shapes or fewer samples"
        )


def resolve_shape(spec: InputSpec, shapes: Mapping[str, tuple[int, ...]], dims: Mapping[str, int]) -> tuple[int, ...]:
    """The shape ``spec`` is generated in: its own ``--input-shape`` (checked against the declared
    rank and fixed dimensions), else the declared one with each symbolic dimension from ``dims``
    (``--input-shape DIM=N``) or :data:`DEFAULT_DIM`; a UsageError when it declares none."""
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
    return tuple(
        d if isinstance(d, int) and d > 0 else dims.get(d, DEFAULT_DIM) if isinstance(d, str) else DEFAULT_DIM
        for d in spec.dims
    )


def _check_dims(specs: Sequence[InputSpec], dims: Mapping[str, int]) -> None:
    """A ``DIM=N`` that names no symbolic dimension of any input is a typo, not a no-op."""
    declared = {d for s in specs for d in (s.dims or ()) if isinstance(d, str)}
    for dim, value in dims.items():
        if dim not in declared:
            named = ", ".join(sorted(declared)) or "none"
            raise UsageError(
                f"--input-shape {dim}={value}: no input of the model has a dimension named {dim!r} (named: {named})"
            )


def _check_float_range(spec: InputSpec, value_range: ValueRange) -> None:
    """Refuse a range beyond the input type's finite values (values are drawn in float32, then cast):
    they would be generated as infinities, which is not what the range asked for."""
    assert value_range.low is not None and value_range.high is not None
    try:
        largest = float(np.finfo(spec.dtype).max)
    except ValueError:  # bfloat16 (ml_dtypes): numpy's finfo does not know it
        import ml_dtypes

        largest = float(ml_dtypes.finfo(spec.dtype).max)
    largest = min(largest, float(np.finfo(np.float32).max))
    if max(abs(value_range.low), abs(value_range.high)) > largest:
        option = value_range.why if value_range.why.startswith("--") else "--val-range"
        raise UsageError(
            f"{option}: [{value_range.low:g}, {value_range.high:g}] goes beyond the largest finite value generated "
            f"{spec.type_name} inputs can take, {largest:g} (input {spec.name!r})"
        )


def _integer_bounds(spec: InputSpec, value_range: ValueRange) -> tuple[int, int]:
    """The inclusive integer bounds of ``value_range`` within the input's type, or a UsageError."""
    assert value_range.low is not None and value_range.high is not None
    info = np.iinfo(spec.dtype)
    lo = max(math.ceil(value_range.low), int(info.min))
    hi = min(math.floor(value_range.high), int(info.max))
    if lo > hi:
        option = value_range.why if value_range.why.startswith("--") else "--int-range"
        raise UsageError(
            f"{option}: [{value_range.low:g}, {value_range.high:g}] holds no {spec.type_name} value "
            f"(input {spec.name!r})"
        )
    return lo, hi


def _random(spec: InputSpec, shape: tuple[int, ...], rng: np.random.Generator, value_range: ValueRange) -> np.ndarray:
    if spec.elem_type in _FLOAT_TYPES:
        if value_range.low is not None and value_range.high is not None:
            _check_float_range(spec, value_range)
            return rng.uniform(value_range.low, value_range.high, size=shape).astype(np.float32).astype(spec.dtype)
        return rng.standard_normal(shape, dtype=np.float32).astype(spec.dtype)
    if spec.elem_type in _INT_TYPES:
        lo, hi = _integer_bounds(spec, value_range)
        return rng.integers(lo, hi, size=shape, endpoint=True).astype(spec.dtype)
    if spec.elem_type == _BOOL:
        if value_range.low is not None and value_range.high is not None:
            if value_range.high < 1:
                return np.zeros(shape, np.bool_)
            if value_range.low > 0:
                return np.ones(shape, np.bool_)
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


def generate_samples(
    specs: Sequence[InputSpec],
    options: GenerationOptions,
    ranges: Mapping[str, ValueRange] | None = None,
    lengths: LengthInputs | None = None,
) -> list[Sample]:
    """``options.samples`` random samples, then the battery when any input is floating point.

    ``ranges``: from :func:`resolve_value_ranges` (default: resolved here, without Gather limits).
    ``lengths``: attention length inputs (:mod:`.attention_inputs`), their shapes and values in
    place of the generated ones, sample by sample. The total size is checked against
    :data:`MAX_INPUT_BYTES` before anything is allocated."""
    unknown = set(options.shapes) - {s.name for s in specs}
    if unknown:
        raise UsageError(f"--input-shape: the model has no input named {sorted(unknown)[0]!r}")
    _check_dims(specs, options.dims)
    if ranges is None:
        ranges = resolve_value_ranges(specs, options)
    shapes = {spec.name: resolve_shape(spec, options.shapes, options.dims) for spec in specs}
    shapes |= lengths.shapes if lengths is not None else {}
    battery = options.battery and any(s.elem_type in _FLOAT_TYPES for s in specs)
    count = options.samples + (len(BATTERY) if battery else 0)
    if count == 0:
        raise UsageError("--samples: 0 random samples and no battery leaves nothing to run")
    for spec in specs:
        option = "--input-shape" if spec.name in options.shapes else "the declared shape"
        _check_input_bytes(
            _nbytes(shapes[spec.name], spec.dtype), f"input {spec.name!r} of shape {list(shapes[spec.name])} ({option})"
        )
    per_sample = sum(_nbytes(shapes[s.name], s.dtype) for s in specs)
    _check_input_bytes(per_sample * count, f"{count} samples of {_human(per_sample)} each (--samples)")
    rng = np.random.default_rng(options.seed)
    drawn = [
        (f"random-{i}", {s.name: _random(s, shapes[s.name], rng, ranges[s.name]) for s in specs})
        for i in range(options.samples)
    ]
    for kind in BATTERY if battery else ():
        feeds = {
            s.name: _battery(kind, s, shapes[s.name], rng)
            if s.elem_type in _FLOAT_TYPES
            else _random(s, shapes[s.name], rng, ranges[s.name])
            for s in specs
            if not s.default
        }
        drawn.append((kind, feeds))
    # The attention lengths (consistent with the shapes) replace the generated values, from their own stream.
    return [Sample(name, feeds | (lengths.feeds(i) if lengths else {})) for i, (name, feeds) in enumerate(drawn)]


def _decode(array: np.ndarray, spec: InputSpec, where: str) -> np.ndarray:
    """A stored array as the input's dtype; bit patterns become bfloat16/float8 again."""
    if (
        spec.dtype in ml_dtypes_named(_BIT_PATTERN_DTYPES)
        and array.dtype.kind == "u"
        and array.dtype.itemsize == spec.dtype.itemsize
    ):
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
    arrays = read_npz(path, "--inputs")
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
        missing = [n for n, spec in by_name.items() if n not in feeds and not spec.default]
        if missing:
            raise UsageError(
                f"--inputs: {path}: no value for the input {missing[0]!r}"
                + (f" in sample {sample!r}" if len(grouped) > 1 else "")
            )
        samples.append(Sample(sample, feeds))
    if not samples:
        raise UsageError(f"--inputs: {path}: the file holds no arrays")
    return samples


def _npz_sizes(path: str | os.PathLike[str], option: str) -> dict[str, int]:
    """Bytes each array of an .npz will take once loaded, from the .npy headers alone (a small
    compressed file can declare a huge array): checked before any array is read."""
    sizes: dict[str, int] = {}
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            if not info.filename.endswith(".npy"):
                continue
            with archive.open(info) as member:
                version = np.lib.format.read_magic(member)
                if version == (1, 0):
                    shape, _, dtype = np.lib.format.read_array_header_1_0(member)
                else:
                    shape, _, dtype = np.lib.format.read_array_header_2_0(member)
            if dtype.hasobject:
                raise UsageError(f"{option}: {path}: {info.filename[:-4]!r} holds Python objects, not numbers")
            sizes[info.filename[:-4]] = _nbytes(shape, dtype)
    return sizes


def read_npz(path: str | os.PathLike[str], option: str, limit: int = MAX_INPUT_BYTES) -> dict[str, np.ndarray]:
    """Every array of an .npz file, refused with one UsageError naming ``option`` and the file when
    it cannot be read, holds objects (never unpickled), or would take more than ``limit`` bytes."""
    try:
        total = sum(_npz_sizes(path, option).values())
        if total > limit:
            raise UsageError(
                f"{option}: {path}: its arrays would take {_human(total)} ({total} bytes), more than the "
                f"{_human(limit)} bound"
            )
        with np.load(path, allow_pickle=False) as data:
            return {key: data[key] for key in data.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zipfile.LargeZipFile) as exc:
        raise UsageError(f"{option}: {path}: cannot read as .npz: {exc}") from None


def _encode(array: np.ndarray) -> np.ndarray:
    if array.dtype in ml_dtypes_named(_BIT_PATTERN_DTYPES):
        return array.view(np.dtype(f"u{array.dtype.itemsize}"))
    return array


def save_samples(path: str | os.PathLike[str], samples: Sequence[Sample]) -> None:
    """Write ``samples`` so that ``load_samples`` gives them back (one sample: plain input names)."""
    arrays: dict[str, Any]  # numpy's savez takes them as **kwds beside its own keywords
    if len(samples) == 1:
        arrays = {name: _encode(a) for name, a in samples[0].feeds.items()}
    else:
        arrays = {f"{s.name}{_SAMPLE_SEPARATOR}{name}": _encode(a) for s in samples for name, a in s.feeds.items()}
    import io

    from onnx_qrewrite.io.outputs import write_atomic

    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    write_atomic(path, buffer.getvalue(), "--save-inputs")  # all or nothing, never through a link
    logger.info("saved %d sample(s) to %s", len(samples), path)
