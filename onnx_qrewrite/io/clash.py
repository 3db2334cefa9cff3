"""An invocation never writes a file it reads, nor one file twice: checked before any work.

Every path a command will write (output models, reports, JUnit, saved inputs) is compared with
every file it reads (the input models and the external data files they reference) and with the
other outputs, by real path and by (st_dev, st_ino), so symlinks and hard links are caught too.
A clash is a usage error naming both paths. Output models' data files take names no file has
yet (:mod:`onnx_qrewrite.io.outputs`), so they cannot clash with an input; a report must not take
a name from an output model's data-file family (``<out>.data``, ``<out>.N.data``).

The external data an input references is found here by scanning its bytes for ``location``
entries (cheap: no parse); the worker that then reads the model checks its own outputs again
against the descriptors it actually opened.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from onnx_qrewrite.errors import UsageError
from onnx_qrewrite.io.outputs import FileId, _read_model_bytes, check_target, file_id

__all__ = ["check_writes", "model_reads"]

_LOCATION = re.compile(rb"\x0a\x08location\x12")


def _locations(data: bytes) -> Iterator[str]:
    for m in _LOCATION.finditer(data):
        pos, length, shift = m.end(), 0, 0
        while pos < len(data) and shift < 35:
            byte = data[pos]
            length |= (byte & 0x7F) << shift
            pos += 1
            shift += 7
            if not byte & 0x80:
                break
        if 0 < length <= 4096:
            yield data[pos : pos + length].decode("utf-8", "replace")


def model_reads(path: str | os.PathLike[str]) -> dict[FileId, Path]:
    """The model file at ``path`` and the external data files it references that exist, by inode."""
    p = Path(path)
    found: dict[FileId, Path] = {}
    try:
        found[file_id(os.stat(p))] = p
    except OSError:
        return found
    folder = p.parent
    for location in set(_locations(_read_model_bytes(p))):
        if "\0" in location:
            continue
        try:
            found.setdefault(file_id(os.stat(folder / location)), folder / location)
        except (OSError, ValueError):
            continue
    return found


def check_writes(
    writes: Sequence[tuple[str, str | os.PathLike[str] | None]],
    reads: dict[FileId, Path],
    model_outputs: Iterable[str | os.PathLike[str]] = (),
) -> None:
    """Refuse (UsageError) any write that is a FIFO/device/folder, a file read, or another write.

    ``writes``: (option, path) pairs; ``model_outputs``: output model paths, whose data-file
    names other writes must not take."""
    real_reads = {os.path.realpath(p): p for p in reads.values()}
    taken: dict[str, tuple[str, str]] = {}
    taken_ids: dict[FileId, tuple[str, str]] = {}
    families = [Path(os.path.realpath(m)) for m in model_outputs]
    for option, path in writes:
        if not path:
            continue
        check_target(path, option)
        real = os.path.realpath(path)
        hit = real_reads.get(real)
        try:
            fid = file_id(os.stat(path))
        except OSError:
            fid = None
        if hit is None and fid is not None:
            hit = reads.get(fid)
        if hit is not None:
            raise UsageError(
                f"{option} {path}: refusing to overwrite the input file {hit} (the same file), which this "
                "invocation reads; choose another path"
            )
        other = taken.get(real) or (taken_ids.get(fid) if fid is not None else None)
        if other is not None:
            raise UsageError(f"{option} {path} and {other[0]} {other[1]} are the same file; give different paths")
        for model in families:
            if option != "-o" and Path(real).parent == model.parent and _in_family(model.name, Path(real).name):
                raise UsageError(
                    f"{option} {path}: is where the output model {model} keeps its external data; choose another path"
                )
        taken[real] = (option, str(path))
        if fid is not None:
            taken_ids[fid] = (option, str(path))


def _in_family(model_name: str, name: str) -> bool:
    return name == f"{model_name}.data" or re.fullmatch(re.escape(model_name) + r"\.[0-9]+\.data", name) is not None
