"""Reference outputs on disk: ``verify --save-outputs`` writes them, ``--load-outputs`` compares a
model against them (outputs recorded on another machine, or by a previous release).

The file is one ``.npz`` (numpy's zip of ``.npy`` arrays; read with ``allow_pickle=False``):

==================================  ==========================================================
key                                 array
==================================  ==========================================================
``input::<sample>::<input name>``   the inputs of each sample, as run
``output::<sample>::<output name>`` the reference (original) model's outputs on that sample
``__meta__``                        a JSON string: ``{"format": "onnx-qrewrite-outputs",
                                    "version": 1, "model": ..., "samples": [...],
                                    "dtypes": {key: dtype}}``
==================================  ==========================================================

Sample names never contain ``::``; input and output names may. bfloat16 and float8 arrays are
stored as their unsigned-integer bit patterns and int4/uint4 as int8/uint8 (numpy's format has no
such dtypes); ``dtypes`` names the real dtype of every such key. Polygraphy's JSON RunResults are
not read or written: npz keeps every dtype exactly and needs no pickling.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from onnx_qrewrite.errors import UsageError
from onnx_qrewrite.verify.inputs import Sample, read_npz

__all__ = ["FORMAT", "VERSION", "StoredOutputs", "load_outputs", "save_outputs"]

FORMAT = "onnx-qrewrite-outputs"
VERSION = 1
_META = "__meta__"
_SEP = "::"
_ML_DTYPES = {
    name: np.dtype(getattr(ml_dtypes, name))
    for name in (
        "bfloat16",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "int4",
        "uint4",
    )
}


class StoredOutputs:
    """Loaded reference outputs: the samples (with their inputs) and each sample's outputs."""

    def __init__(self, path: str, samples: list[Sample], outputs: dict[str, dict[str, np.ndarray]], model: str):
        self.path = path
        self.samples = samples
        self.outputs = outputs
        self.model = model

    @property
    def output_names(self) -> list[str]:
        """The stored outputs' names (every sample holds the same ones)."""
        first = self.samples[0].name
        return list(self.outputs.get(first, {}))

    def run(self, sample: Sample) -> dict[str, np.ndarray]:
        """The stored outputs of ``sample`` (what the original computed on its inputs)."""
        return self.outputs[sample.name]


def _encode(array: np.ndarray) -> tuple[np.ndarray, str | None]:
    name = array.dtype.name
    if name in ("int4", "uint4"):
        return array.astype(np.int8 if name == "int4" else np.uint8), name
    if name in _ML_DTYPES:
        return array.view(np.dtype(f"u{array.dtype.itemsize}")), name
    return array, None


def _decode(array: np.ndarray, dtype_name: str | None, where: str) -> np.ndarray:
    if dtype_name is None:
        return array
    dtype = _ML_DTYPES.get(dtype_name)
    if dtype is None:
        raise UsageError(f"--load-outputs: {where}: unknown dtype {dtype_name!r}")
    if dtype_name in ("int4", "uint4"):
        return array.astype(dtype)
    if array.dtype.kind != "u" or array.dtype.itemsize != dtype.itemsize:
        raise UsageError(f"--load-outputs: {where}: {dtype_name} must be stored as u{dtype.itemsize} bit patterns")
    return array.view(dtype)


def save_outputs(
    path: str | os.PathLike[str],
    samples: Sequence[Sample],
    outputs: Mapping[str, Mapping[str, np.ndarray]],
    model: str,
) -> None:
    """Write ``samples`` and ``outputs`` (sample name -> output name -> array) in the format above."""
    arrays: dict[str, Any] = {}  # numpy's savez takes them as **kwds beside its own keywords
    dtypes: dict[str, str] = {}
    for sample in samples:
        for kind, values in (("input", sample.feeds), ("output", outputs[sample.name])):
            for name, array in values.items():
                key = f"{kind}{_SEP}{sample.name}{_SEP}{name}"
                arrays[key], dtype_name = _encode(np.asarray(array))
                if dtype_name:
                    dtypes[key] = dtype_name
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "model": model,
        "samples": [s.name for s in samples],
        "dtypes": dtypes,
    }
    arrays[_META] = np.array(json.dumps(meta))
    import io

    from onnx_qrewrite.io.outputs import write_atomic

    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    write_atomic(path, buffer.getvalue(), "--save-outputs")  # all or nothing, never through a link


def load_outputs(path: str | os.PathLike[str]) -> StoredOutputs:
    """Read a file written by :func:`save_outputs`; every problem is one UsageError naming it."""
    arrays = read_npz(path, "--load-outputs")
    raw = arrays.pop(_META, None)
    meta: Any = None
    if raw is not None and raw.dtype.kind == "U" and raw.ndim == 0:
        try:
            meta = json.loads(str(raw))
        except ValueError:
            meta = None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise UsageError(f"--load-outputs: {path}: not an onnx-qrewrite outputs file (written by --save-outputs)")
    if meta.get("version") != VERSION:
        raise UsageError(f"--load-outputs: {path}: format version {meta.get('version')!r}; this tool reads {VERSION}")
    order = meta.get("samples")
    dtypes = meta.get("dtypes")
    if not isinstance(order, list) or not order or not all(isinstance(s, str) for s in order):
        raise UsageError(f"--load-outputs: {path}: names no samples")
    if not isinstance(dtypes, dict):
        dtypes = {}
    feeds: dict[str, dict[str, np.ndarray]] = {s: {} for s in order}
    outputs: dict[str, dict[str, np.ndarray]] = {s: {} for s in order}
    for key, array in arrays.items():
        kind, sep1, rest = key.partition(_SEP)
        sample, sep2, name = rest.partition(_SEP)
        if not (sep1 and sep2 and name) or kind not in ("input", "output") or sample not in feeds:
            raise UsageError(f"--load-outputs: {path}: unexpected array {key!r}")
        value = _decode(array, dtypes.get(key), f"{path}: {key!r}")
        (feeds if kind == "input" else outputs)[sample][name] = value
    for sample in order:
        if not outputs[sample]:
            raise UsageError(f"--load-outputs: {path}: sample {sample!r} has no outputs")
    names = set(outputs[order[0]])
    for sample in order[1:]:
        if set(outputs[sample]) != names:
            raise UsageError(f"--load-outputs: {path}: sample {sample!r} holds other outputs than {order[0]!r}")
    recorded = meta.get("model")
    model = recorded if isinstance(recorded, str) else "?"
    return StoredOutputs(str(path), [Sample(s, feeds[s]) for s in order], outputs, model)
