"""``--input-shape``, one spelling for ``verify`` and ``inspect``/``rewrite --target``:
``NAME:D0,D1,...`` (an input's shape) or ``DIM=N`` (the symbolic dimension named DIM). Its own
module, importing neither onnx nor onnxruntime: ``verify`` parses it on its fast path (which does not
import onnx) and ``rewrite``/``inspect`` without the verify extra (no onnxruntime)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from onnx_qrewrite._dataclass import dataclass
from onnx_qrewrite.errors import UsageError

__all__ = ["InputShapes", "parse_input_shape", "parse_input_shapes"]


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


@dataclass(frozen=True)
class InputShapes:
    """What ``--input-shape`` gives: shapes by input name, and values by symbolic dimension name."""

    inputs: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    dims: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.inputs or self.dims)

    def to_dict(self) -> dict[str, object]:
        return {"inputs": {k: list(v) for k, v in self.inputs.items()}, "dims": dict(self.dims)}


def parse_input_shapes(texts: Iterable[str]) -> InputShapes:
    """``NAME:D0,D1,...`` (an input's shape; the name may contain ``:``) or ``DIM=N`` (a symbolic
    dimension's value) -> :class:`InputShapes`; a malformed one is a UsageError naming it."""
    inputs: dict[str, tuple[int, ...]] = {}
    dims: dict[str, int] = {}
    for text in texts:
        if ":" in text or "=" not in text:
            name, shape = parse_input_shape(text)
            inputs[name] = shape
            continue
        dim, _, value = text.rpartition("=")
        try:
            dims[dim] = int(value)
        except ValueError:
            raise UsageError(f"--input-shape {text}: expected DIM=N with N an integer") from None
        if not dim:
            raise UsageError(f"--input-shape {text}: expected DIM=N naming a symbolic dimension")
    return InputShapes(inputs, dims)
