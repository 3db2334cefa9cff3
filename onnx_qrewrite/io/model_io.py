"""Reading and writing models built for real sizes.

- Weights stored as external data stay on disk: models are loaded with
  ``load_external_data=False`` (1 GiB of weights: 73 MiB RSS instead of 2.1 GiB, ENGINE_NOTES.md).
- Writing streams each external tensor's bytes from the input's data file to the output's, in
  bounded chunks (``os.copy_file_range`` where the kernel offers it), or, opt-in, references the
  input's data file in place when the output sits in the same folder (zero copy).
- Models whose protobuf would pass 2 GB are written with their large tensors as external data.
- Everything is written to temporary files in the destination folder and renamed into place only
  when complete: a failure never leaves a partial file, and the input is never touched.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from google.protobuf.message import DecodeError

from onnx_qrewrite import _onnx as onnx
from onnx_qrewrite._dataclass import dataclass
from onnx_qrewrite.errors import InvalidModelError, QRewriteError, UsageError, first_line
from onnx_qrewrite.io import outputs
from onnx_qrewrite.io.encoded import EncodedModel, skeleton_of, to_bytes, to_chunks
from onnx_qrewrite.io.external_data import ExternalData, all_tensors, external_tensors
from onnx_qrewrite.io.heap import return_freed_memory
from onnx_qrewrite.io.model_file import read_once as _read_once
from onnx_qrewrite.io.outputs import refuse_clash
from onnx_qrewrite.io.sliced_check import proven_valid
from onnx_qrewrite.io.toposort import sort_model
from onnx_qrewrite.progress import ProgressSink

__all__ = [
    "LoadedModel",
    "SaveInfo",
    "check_input_model",
    "check_model",
    "check_serialized",
    "external_tensors",
    "load_model",
    "open_model",
    "open_model_bytes",
    "parse_model",
    "refuse_clash",
    "save_model",
]

_PROTOBUF_LIMIT = 2**31 - 1
#: Headroom for fields other than tensor payloads when deciding whether to externalize.
_LIMIT_MARGIN = 64 * 2**20
#: Tensors at least this large move to external data when a model must be split.
_EXTERNALIZE_THRESHOLD = 1024
_ALIGN = 64
_CHUNK = 64 * 2**20


@dataclass
class LoadedModel:
    """A model parsed from the bytes of one read, with its external data opened and checked."""

    proto: onnx.ModelProto
    path: Path
    file_id: tuple[int, int]
    external: ExternalData | None
    #: Nodes moved to put the graphs into topological order (0: they were in it), see toposort.py.
    reordered: int = 0

    def reads(self) -> dict[tuple[int, int], Path]:
        """Every file this model was read from (model file and external data), by (st_dev, st_ino)."""
        found = {self.file_id: self.path}
        if self.external is not None:
            found.update(self.external.reads())
        return found


def parse_model(data: bytes, label: str) -> onnx.ModelProto:
    """Parse model bytes; anything protobuf or onnx refuses is an InvalidModelError naming ``label``."""
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise InvalidModelError(
            f"{label}: not a valid ONNX model (cannot parse the protobuf: {first_line(exc)}); "
            "is the file truncated or corrupt?"
        ) from None
    if model.ir_version == 0 or not model.HasField("graph"):
        raise InvalidModelError(
            f"{label}: not a valid ONNX model (no IR version or graph); is the file truncated or corrupt?"
        )
    return model


def open_model(path: str | os.PathLike[str], *, check: bool = True) -> LoadedModel:
    """Read ``path`` once, parse those bytes, open and check its external data (left on disk).

    With ``check``, nodes out of topological order are sorted first (onnxruntime runs such models;
    :mod:`onnx_qrewrite.io.toposort`), then onnx's checker runs.

    The checker sees the bytes that were parsed (never the path again), and every external data
    file is opened once, inside the model's folder (:mod:`onnx_qrewrite.io.external_data`).
    """
    p = Path(path)
    data, fid = _read_once(p)
    return open_model_bytes(data, fid, p, check=check)


#: Bytes every encoding of ``data_location: EXTERNAL`` in a TensorProto holds: field 14's key, 0x70
#: (or an overlong varint key: 0xf0, then a byte whose low 7 bits, bits 7-13 of the key, are 0),
#: then a varint whose low 7 bits are 1 (0x01, or 0x81 when overlong; an int32 enum keeps the low
#: 32 bits, so they are 1 however long the varint is). Two searches: each starts with a literal
#: byte, which the regex engine finds at memchr speed (one alternation of both was 8x slower).
_EXTERNAL_LOCATION = (re.compile(rb"\x70[\x01\x81]"), re.compile(rb"\xf0[\x00\x80]"))


def _no_external_data(data: bytes) -> bool:
    """Whether no tensor in the serialized model ``data`` can be stored as external data: none of
    the bytes such a tensor's encoding needs occur (large weights will often hold them by chance,
    and then the model is parsed and its tensors looked at, as always)."""
    return not any(pattern.search(data) for pattern in _EXTERNAL_LOCATION)


def open_model_bytes(data: bytes, fid: tuple[int, int], p: Path, *, check: bool = True) -> LoadedModel:
    """:func:`open_model` of bytes already read from ``p`` (whose (st_dev, st_ino) is ``fid``)."""
    if check and _no_external_data(data):
        # No external data to open: the checker runs on the bytes before anything is parsed here
        # (parsing first only to find the external tensors, then again after the check, cost a
        # parse and a walk over every node: ~5% of a 100k-node rewrite). A model the checker
        # refuses takes the path below, so every error is the one it would have been.
        try:
            check_serialized(data, what=str(p))
        except InvalidModelError:
            pass
        else:
            return LoadedModel(parse_model(data, str(p)), p, fid, None, 0)
    model = parse_model(data, str(p))
    external = ExternalData.for_model(model, p.parent if str(p.parent) else Path("."), str(p))
    reordered = 0
    if check and external is None:
        # onnx's checker parses the bytes again into its own (C++) copy, ~1.7x the parsed model:
        # with ours alive too, that was a rewrite's peak memory (173 MB on the 100k-node benchmark
        # chain, against 127 MB for the checker alone). Ours is let go meanwhile and parsed again
        # (~40 ms there); a model the checker passes parses as it did the first time.
        del model
        try:
            check_serialized(data, what=str(p))
            return LoadedModel(parse_model(data, str(p)), p, fid, external, 0)
        except InvalidModelError as exc:
            if "topologically sorted" not in str(exc):
                raise
            unsorted = exc
        model = parse_model(data, str(p))
        moved = sort_model(model, str(p))  # as check_input_model does
        if not moved:
            raise unsorted
        check_model(model, what=str(p))
        return LoadedModel(model, p, fid, external, moved)
    try:
        if check:
            reordered = check_input_model(model, what=str(p), serialized=None if external else data)
    except BaseException:
        if external is not None:
            external.close()
        raise
    return LoadedModel(model, p, fid, external, reordered)


def load_model(path: str | os.PathLike[str], *, check: bool = True) -> onnx.ModelProto:
    """Parse ``path`` without loading external weights; every failure is an InvalidModelError."""
    loaded = open_model(path, check=check)
    if loaded.external is not None:
        loaded.external.close()
    return loaded.proto


@contextlib.contextmanager
def _external_data_hidden(model: onnx.ModelProto) -> Iterator[None]:
    """Each external tensor shown to the checker as an empty tensor of the same type, then restored.

    onnx's in-memory checker resolves external data against the *working directory* and takes
    no model folder; changing the working directory is process-wide (not thread-safe). Our own
    checks (:class:`ExternalData`) already cover what it would check of those files, through the
    descriptors the bytes are read from, so the checker is shown the model without them.
    """
    saved = []
    for t in external_tensors(model):
        saved.append((t, list(t.dims), [(e.key, e.value) for e in t.external_data]))
        del t.external_data[:]
        t.data_location = onnx.TensorProto.DEFAULT
        del t.dims[:]
        t.dims.append(0)
    try:
        yield
    finally:
        for t, dims, entries in saved:
            del t.dims[:]
            t.dims.extend(dims)
            for key, value in entries:
                e = t.external_data.add()
                e.key, e.value = key, value
            t.data_location = onnx.TensorProto.EXTERNAL


def check_model(
    model: onnx.ModelProto | EncodedModel,
    *,
    what: str,
    error: type[QRewriteError] = InvalidModelError,
    serialized: bytes | None = None,
) -> None:
    """Run onnx's checker on the model in memory (``serialized``: its bytes, when already at hand).

    External data is not looked at here: it is checked where it is opened, see
    :func:`_external_data_hidden`. Thread-safe: nothing process-wide is touched.
    """
    if serialized is None:
        if byte_size(model) > _PROTOBUF_LIMIT:
            return  # cannot be checked in memory; the input was checked from its bytes
        skeleton = skeleton_of(model)
        with _external_data_hidden(skeleton):
            serialized = to_bytes(model)
    check_serialized(serialized, what=what, error=error)


def check_serialized(serialized: bytes, *, what: str, error: type[QRewriteError] = InvalidModelError) -> None:
    """onnx's checker on a serialized model (see :func:`check_model`); external data is not looked
    at by our callers' contract: pass only bytes whose tensors are all in the model.

    The checker's copy of the model is handed back to the system once it is freed (io/heap.py):
    what the caller parses next is then not placed among its freed pages."""
    try:
        _check_serialized(serialized, what, error)
    finally:
        return_freed_memory()


#: Set (to anything but "" or "0"), onnx's checker always checks a model whole, never in slices.
WHOLE_CHECK_ENV = "ONNX_QREWRITE_WHOLE_CHECK"


def _whole_check_only() -> bool:
    return os.environ.get(WHOLE_CHECK_ENV, "") not in ("", "0")


def _check_serialized(serialized: bytes, what: str, error: type[QRewriteError]) -> None:
    # A large graph is checked in slices first (io/sliced_check.py: the peak memory of the whole
    # check, 127 MB on the 100k-node benchmark chain, was a rewrite's peak); whatever the slices
    # do not prove valid is checked whole below, so every message is onnx's own.
    if not _whole_check_only() and proven_valid(serialized, onnx.checker.check_model):
        return
    try:
        onnx.checker.check_model(serialized)
    except (onnx.checker.ValidationError, ValueError, RuntimeError, UnicodeError) as exc:
        hidden = _without_ort_onnx_domain_ops(serialized) if _is_ort_onnx_domain_op_error(exc) else None
        if hidden is not None:
            try:
                onnx.checker.check_model(hidden)
                return
            except (onnx.checker.ValidationError, ValueError, RuntimeError, UnicodeError) as again:
                exc = again
        raise error(f"{what}: fails the ONNX checker: {first_line(exc)}") from None


def check_input_model(model: onnx.ModelProto, *, what: str, serialized: bytes | None = None) -> int:
    """:func:`check_model` for an input: nodes out of topological order, which onnxruntime sorts
    and runs, are sorted (:mod:`onnx_qrewrite.io.toposort`) and the model checked again; the number of
    nodes moved. Only when the checker says the order is broken: a sorted model pays nothing more.
    A name nothing provides, or a cycle, is an InvalidModelError naming the node."""
    try:
        check_model(model, what=what, serialized=serialized)
        return 0
    except InvalidModelError as exc:
        if "topologically sorted" not in str(exc):
            raise
        moved = sort_model(model, what)
        if not moved:
            raise
    check_model(model, what=what)
    return moved


#: Ops onnxruntime defines in the ONNX domain itself: its optimizer writes SimplifiedLayerNormalization
#: (RMS norms) there, and onnx's checker has no schema for it. Such models are valid for onnxruntime,
#: and a rule lowers the op; the checker checks everything else.
ORT_ONNX_DOMAIN_OPS = frozenset({"SimplifiedLayerNormalization"})
_ORT_EXTENSION_DOMAIN = "com.microsoft"


def _is_ort_onnx_domain_op_error(exc: Exception) -> bool:
    return any(f"No Op registered for {op} with domain_version" in str(exc) for op in ORT_ONNX_DOMAIN_OPS)


def _without_ort_onnx_domain_ops(serialized: bytes) -> bytes | None:
    """The model with those nodes moved to onnxruntime's own domain (whose ops the checker does not
    look up), or None when there is none. Only on the failure path: a parse and a serialization."""
    model = onnx.ModelProto()
    model.ParseFromString(serialized)
    moved = False
    graphs: list[onnx.GraphProto | onnx.FunctionProto] = [model.graph, *model.functions]
    while graphs:
        graph = graphs.pop()
        for node in graph.node:
            if node.domain in ("", "ai.onnx") and node.op_type in ORT_ONNX_DOMAIN_OPS:
                node.domain = _ORT_EXTENSION_DOMAIN
                moved = True
            for attr in node.attribute:
                graphs.extend([attr.g] if attr.HasField("g") else [])
                graphs.extend(attr.graphs)
    if not moved:
        return None
    if all(o.domain != _ORT_EXTENSION_DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(_ORT_EXTENSION_DOMAIN, 1))
    return model.SerializeToString()


def _set_external(tensor: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    del tensor.external_data[:]
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    tensor.data_location = onnx.TensorProto.EXTERNAL


def _copy_range(src_fd: int, dst, offset: int, length: int) -> None:
    """Append ``length`` bytes at ``offset`` of ``src_fd`` to ``dst`` (in the kernel when it can).

    Chunks of 64 MiB keep a SIGTERM/SIGINT waiting at most one chunk."""
    dst_fd = dst.fileno()
    remaining = length
    if hasattr(os, "copy_file_range"):
        try:
            while remaining:
                n = os.copy_file_range(src_fd, dst_fd, min(remaining, _CHUNK), offset + length - remaining)
                if n == 0:
                    break
                remaining -= n
        except OSError:
            pass  # e.g. across file systems on old kernels: fall back to plain reads
    dst.seek(0, os.SEEK_END)
    while remaining:
        chunk = os.pread(src_fd, min(remaining, _CHUNK), offset + length - remaining)
        if not chunk:
            raise InvalidModelError(f"external data ends before offset {offset + length}")
        dst.write(chunk)
        remaining -= len(chunk)


@dataclass(frozen=True)
class SaveInfo:
    """What a save wrote: the model file, its external data file and the input data it references."""

    path: Path
    data_path: Path | None  # the external data file written, if any
    referenced: tuple[str, ...]  # input data files referenced in place (zero copy)
    external_bytes: int  # bytes of external data written (or referenced)


def byte_size(model: onnx.ModelProto | EncodedModel) -> int:
    return model.byte_size() if isinstance(model, EncodedModel) else model.ByteSize()


def check_output_folder(out: Path, option: str = "-o") -> Path:
    """The folder ``out`` goes to, after checking it exists and is writable and ``out`` is usable."""
    folder = out.parent if str(out.parent) else Path(".")
    outputs.check_target(out, option)
    if not folder.is_dir():
        raise UsageError(f"{option} {out}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"{option} {out}: cannot write to the folder {folder} (permission denied)")
    return folder


def save_model(
    model: onnx.ModelProto | EncodedModel,
    path: str | os.PathLike[str],
    *,
    external: ExternalData | None = None,
    reference_external_data: bool = False,
    progress: ProgressSink | None = None,
    reads: dict[tuple[int, int], Path] | None = None,
) -> SaveInfo:
    """Write ``model`` and its weights all or nothing (see :mod:`onnx_qrewrite.io.outputs`).

    External weights are streamed from the descriptors of ``external`` (opened and checked when the
    input was read) or, with ``reference_external_data``, referenced in place. ``reads``: every
    file the invocation reads, by (st_dev, st_ino): never written, replaced or removed. ``model`` is
    left pointing at its input's data, so it can be saved again.

    In steps: every refusal before anything is written (:func:`_check_save`), the data file
    (:func:`_write_data`), the model file (:func:`_write_model_file`), then the renames that
    commit them (:func:`_commit`); whatever is left of an unfinished save is removed.
    """
    out = Path(path)
    skeleton = skeleton_of(model)
    ext = list(external_tensors(skeleton))
    folder, protected = _check_save(out, ext, external, reference_external_data, reads)
    saved = [(t, [(e.key, e.value) for e in t.external_data]) for t in ext]
    moved: list[tuple[onnx.TensorProto, bytes]] = []
    outputs.clean_leftovers(folder)
    old_data = [p for p in outputs.previous_data_files(out) if _id_of(p) not in protected]
    files = _SaveFiles()
    try:
        written = 0
        referenced: set[str] = set()
        if reference_external_data and ext:
            assert external is not None
            written, referenced = _referenced_in_place(ext, external)
        data_name: str | None = None
        too_big = byte_size(model) > _PROTOBUF_LIMIT - _LIMIT_MARGIN
        if (ext and not reference_external_data) or too_big:
            data_name = outputs.free_data_name(out)
            fd, files.data_tmp = outputs.new_temp(folder, out.name, "data")
            with os.fdopen(fd, "wb") as dst:
                written = _write_data(
                    dst, skeleton if too_big else None, ext, external, data_name, written, moved, progress
                )
        files.model_tmp = _write_model_file(model, folder, out)
        keep = {data_name, *referenced}
        _commit(out, folder, data_name, [p for p in old_data if p.name not in keep], files)
    except OSError as exc:
        raise UsageError(f"{out}: cannot write: {exc.strerror or exc}") from None
    finally:
        _restore(saved, moved)
        files.discard()
    data_path = folder / data_name if data_name is not None else None
    return SaveInfo(out, data_path, tuple(sorted(referenced)), written)


@dataclass
class _SaveFiles:
    """What an unfinished save has made (removed by :meth:`discard` unless committed)."""

    data_tmp: Path | None = None
    model_tmp: Path | None = None
    journal: Path | None = None
    #: The data file renamed into place (removed if the model's rename, the commit, did not happen).
    renamed: Path | None = None
    committed: bool = False

    def discard(self) -> None:
        if not self.committed and self.renamed is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.renamed)
        for leftover in (self.data_tmp, self.model_tmp, self.journal):
            outputs.discard(leftover)


def _check_save(
    out: Path,
    ext: list[onnx.TensorProto],
    external: ExternalData | None,
    reference_external_data: bool,
    reads: dict[tuple[int, int], Path] | None,
) -> tuple[Path, dict[tuple[int, int], Path]]:
    """Every refusal of a save, before anything is written: the output's folder and the files the
    invocation reads (returned, with the folder), external data without a source, a zero-copy
    output outside the input's folder."""
    folder = check_output_folder(out)
    protected = dict(reads or {})
    if external is not None:
        protected.update(external.reads())
    refuse_clash(out, protected)
    if ext and external is None:
        raise UsageError(f"{out}: the model references external data but its source folder is unknown")
    if reference_external_data and ext:
        assert external is not None
        if folder.resolve() != external.base_dir.resolve():
            raise UsageError(
                f"{out}: --reference-external-data needs the output in the input's folder ({external.base_dir}); "
                "elsewhere the weights are copied"
            )
    return folder, protected


def _referenced_in_place(ext: list[onnx.TensorProto], external: ExternalData) -> tuple[int, set[str]]:
    """Zero copy: the bytes the output references in the input's data files, and those files."""
    written = 0
    referenced: set[str] = set()
    for t in ext:
        _fd, _offset, length = external.span(t)
        referenced.add(next(e.value for e in t.external_data if e.key == "location"))
        written += length
    return written, referenced


def _write_data(
    dst: BinaryIO,
    too_big: onnx.ModelProto | None,
    ext: list[onnx.TensorProto],
    external: ExternalData | None,
    data_name: str,
    written: int,
    moved: list[tuple[onnx.TensorProto, bytes]],
    progress: ProgressSink | None,
) -> int:
    """The output's data file ``dst`` (``data_name``), from ``written`` bytes on: the external
    tensors streamed from the input's data files, then the large in-memory tensors of ``too_big``
    (the model's skeleton, when the model is past protobuf's limit; they go to ``moved``); each
    tensor is pointed at its new place. The bytes written by the end, synced."""
    spans = [external.span(t) for t in ext] if ext and external is not None else []
    total_external = sum(length for _, _, length in spans)
    copied = 0
    for t, (src_fd, offset, length) in zip(ext, spans, strict=True):
        pad = (-written) % _ALIGN
        dst.write(b"\0" * pad)
        written += pad
        dst.flush()
        _copy_range(src_fd, dst, offset, length)
        _set_external(t, data_name, written, length)
        written += length
        copied += length
        if progress is not None:
            progress("writing weights bytes", copied, total_external)
    if too_big is not None:
        written = _externalize_large(too_big, dst, data_name, written, moved)
    dst.flush()
    os.fsync(dst.fileno())
    os.fchmod(dst.fileno(), outputs.FILE_MODE)
    return written


def _write_model_file(model: onnx.ModelProto | EncodedModel, folder: Path, out: Path) -> Path:
    """The model file, as a temporary in ``folder``, written in pieces (no joined copy of the
    whole output) and synced; its path."""
    fd, model_tmp = outputs.new_temp(folder, out.name, "model")
    with os.fdopen(fd, "wb") as f:
        f.writelines(to_chunks(model))
        f.flush()
        os.fsync(f.fileno())
        os.fchmod(f.fileno(), outputs.FILE_MODE)
    return model_tmp


def _commit(out: Path, folder: Path, data_name: str | None, old_data: list[Path], files: _SaveFiles) -> None:
    """Rename the data file, then the model file (the commit point), into place and remove the
    previous output's data files ``old_data``, with the signals that would interrupt it blocked.
    A journal names the data file about to appear and the ones about to go, so that the leftovers
    of a kill between the renames are found (``outputs.clean_leftovers``)."""
    files.journal = outputs.write_journal(folder, out.name, data_name, [p.name for p in old_data])
    with outputs.signals_blocked():
        if files.data_tmp is not None and data_name is not None:
            outputs.rename_new(files.data_tmp, folder / data_name)
            files.renamed = folder / data_name
            files.data_tmp = None
        assert files.model_tmp is not None
        os.replace(files.model_tmp, out)  # the commit point
        files.committed = True
        outputs.forget(files.model_tmp)
        files.model_tmp = None
        for old in old_data:
            with contextlib.suppress(OSError):
                os.unlink(old)
        outputs.discard(files.journal)
        files.journal = None
    outputs.fsync_folder(folder)


def _id_of(path: Path) -> tuple[int, int] | None:
    try:
        return outputs.file_id(os.stat(path))
    except OSError:
        return None


def _externalize_large(
    model: onnx.ModelProto, dst, data_name: str, written: int, moved: list[tuple[onnx.TensorProto, bytes]]
) -> int:
    """Move in-memory tensors of at least 1 KiB into the data file: the model passes 2 GB.
    Each moved tensor and its bytes go to ``moved`` (put back once the model is written)."""
    for t in all_tensors(model):
        if (
            t.data_location == onnx.TensorProto.EXTERNAL
            or not t.HasField("raw_data")
            or len(t.raw_data) < _EXTERNALIZE_THRESHOLD
        ):
            continue
        pad = (-written) % _ALIGN
        dst.write(b"\0" * pad)
        written += pad
        raw = t.raw_data
        dst.write(raw)
        moved.append((t, raw))
        _set_external(t, data_name, written, len(raw))
        written += len(raw)
        t.ClearField("raw_data")
    return written


def _restore(
    saved: list[tuple[onnx.TensorProto, list[tuple[str, str]]]], moved: list[tuple[onnx.TensorProto, bytes]]
) -> None:
    """Point the model back at its input's external data (and in-memory bytes) after writing it, so
    that the result can be saved again and still describes where its data is read from."""
    for t, entries in saved:
        del t.external_data[:]
        for key, value in entries:
            e = t.external_data.add()
            e.key, e.value = key, value
        t.data_location = onnx.TensorProto.EXTERNAL
    for t, raw in moved:
        del t.external_data[:]
        t.data_location = onnx.TensorProto.DEFAULT
        t.raw_data = raw
