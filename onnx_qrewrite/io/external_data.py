"""External data, contained in the model's folder and read through one descriptor per file.

A model's external-data ``location`` is written by whoever made the model, so it is untrusted: a
crafted model could name ``../../home/me/.ssh/id_rsa``, an absolute path, a symlink leading out,
a FIFO (a read that never returns) or a device. :class:`ExternalData` opens every file a model
references *once*, inside the model's folder, and every later use (the engine reading a scale,
``save`` copying weights, the verifier loading them) reads from that open descriptor, so the
bytes that were checked are the bytes that are used: swapping a file or a symlink after the check
changes nothing.

Why our own walk and not onnx's or onnx_ir's checks: onnx_ir checks the path string and its
``realpath`` and then opens the path again (a symlink swapped in between wins), and checks nothing
at all for an empty ``base_dir``; onnx's C++ ``_open_external_data`` returns a descriptor but is
private API, refuses every symlink and every file with more than one hard link (stores
deduplicated by hard links could not be rewritten at all) and is absent from older onnx releases
we support. Here each path component is opened with ``O_NOFOLLOW`` relative to the descriptor of
the folder above it (``openat``), symlinks are resolved by hand and may never climb above the
model's folder, and the final file is opened ``O_NONBLOCK`` (a FIFO cannot block) and must be a
regular file according to ``fstat`` on the open descriptor.

Hard links are read: a hard link is a name inside the model's folder for a regular file, checked
through the descriptor we read from; creating one to someone else's file needs rights over that
file (``fs.protected_hardlinks``) that the model's author does not have on the user's machine.
onnx-qrewrite never writes through any existing file (outputs are renamed into place), so a hard
link to an input is never modified either.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import re
import stat
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from onnx_qrewrite import _onnx as onnx
from onnx_qrewrite.errors import InvalidModelError

__all__ = ["ExternalData", "TensorLocation", "all_tensors", "external_tensors", "tensor_location"]

#: Symlinks followed while resolving one location (Linux's own limit is 40).
_MAX_LINKS = 40
_DIGITS = re.compile(r"[0-9]{1,19}")
_OPEN_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
_OPEN_FILE = (
    os.O_RDONLY
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_NOCTTY", 0)
    | getattr(os, "O_CLOEXEC", 0)
)
_HAVE_DIR_FD = os.open in os.supports_dir_fd and hasattr(os, "O_NOFOLLOW")


def all_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Initializers of every graph and Constant values: where tensors with data live."""
    from onnx_qrewrite.rewriter.graph import iter_scopes

    for scope in iter_scopes(model):
        container = scope.container
        if isinstance(container, onnx.GraphProto):
            yield from container.initializer
        for node in map(container.node.__getitem__, scope.constant_ops):  # found by the walk
            for attr in node.attribute:
                if attr.name == "value":
                    yield attr.t


def external_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """The tensors :func:`all_tensors` finds whose data is stored in an external file."""
    for tensor in all_tensors(model):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            yield tensor


class TensorLocation:
    """Where one tensor's bytes are: ``location`` (relative), ``offset``, ``length`` (None: to the end)."""

    __slots__ = ("length", "location", "offset")

    def __init__(self, location: str, offset: int, length: int | None):
        self.location, self.offset, self.length = location, offset, length


def _tensor_label(tensor: onnx.TensorProto) -> str:
    return f"tensor {tensor.name!r}"


def tensor_location(tensor: onnx.TensorProto, label: str) -> TensorLocation:
    """The parsed ``external_data`` table of ``tensor``; malformed entries are InvalidModelError."""
    entries = {e.key: e.value for e in tensor.external_data}
    where = f"{label}: {_tensor_label(tensor)}"
    for key, value in entries.items():
        if isinstance(key, bytes) or isinstance(value, bytes):  # protobuf's form of invalid UTF-8
            raise InvalidModelError(f"{where}: external data entry {key!r} = {value!r} is not valid UTF-8")
    location = entries.get("location")
    if not location:
        raise InvalidModelError(f"{where}: external data without a location")
    numbers: dict[str, int] = {}
    for key in ("offset", "length"):
        text = entries.get(key)
        if text is None:
            continue
        if not _DIGITS.fullmatch(text):
            raise InvalidModelError(f"{where}: external data {key} {text[:40]!r} is not a non-negative integer")
        numbers[key] = int(text)
    return TensorLocation(location, numbers.get("offset", 0), numbers.get("length"))


#: Bits per element of each fixed-width data type (names missing from older onnx are skipped).
_BITS = {
    value: bits
    for name, bits in {
        "FLOAT": 32,
        "UINT8": 8,
        "INT8": 8,
        "UINT16": 16,
        "INT16": 16,
        "INT32": 32,
        "INT64": 64,
        "BOOL": 8,
        "FLOAT16": 16,
        "DOUBLE": 64,
        "UINT32": 32,
        "UINT64": 64,
        "COMPLEX64": 64,
        "COMPLEX128": 128,
        "BFLOAT16": 16,
        "FLOAT8E4M3FN": 8,
        "FLOAT8E4M3FNUZ": 8,
        "FLOAT8E5M2": 8,
        "FLOAT8E5M2FNUZ": 8,
        "UINT4": 4,
        "INT4": 4,
        "FLOAT4E2M1": 4,
        "FLOAT8E8M0": 8,
        "UINT2": 2,
        "INT2": 2,
    }.items()
    if (value := getattr(onnx.TensorProto, name, None)) is not None
}


#: Bytes per slab of :meth:`ExternalData.iter_slabs`: large enough that numpy's per-call cost
#: vanishes, small enough to stay in the cache-friendly, bounded-memory range.
SLAB_BYTES = 1 << 20
#: Largest single read (Linux returns at most 0x7ffff000 bytes per read).
_MAX_READ = 1 << 30


#: Types whose raw bytes numpy views as they are (ONNX stores them little-endian).
_SLAB_TYPES = {
    getattr(onnx.TensorProto, name): np_name
    for name, np_name in {
        "FLOAT": "float32",
        "DOUBLE": "float64",
        "FLOAT16": "float16",
        "UINT8": "uint8",
        "INT8": "int8",
        "UINT16": "uint16",
        "INT16": "int16",
        "UINT32": "uint32",
        "INT32": "int32",
        "UINT64": "uint64",
        "INT64": "int64",
        "BOOL": "bool",
    }.items()
}


def _expected_bytes(tensor: onnx.TensorProto, where: str) -> int:
    """Bytes the tensor's type and shape need (external data must hold exactly that many)."""
    if tensor.data_type == onnx.TensorProto.STRING:
        raise InvalidModelError(f"{where}: string tensors cannot be stored as external data")
    bits = _BITS.get(tensor.data_type)
    if bits is None:
        raise InvalidModelError(f"{where}: data type {tensor.data_type} has no fixed width")
    if any(d < 0 for d in tensor.dims):
        raise InvalidModelError(f"{where}: negative dimension in {list(tensor.dims)}")
    return (math.prod(tensor.dims) * bits + 7) // 8


class _Opened:
    __slots__ = ("fd", "path", "size", "st")

    def __init__(self, fd: int, path: Path, st: os.stat_result):
        self.fd, self.path, self.st, self.size = fd, path, st, st.st_size


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class ExternalData:
    """The external-data files of one model, each opened once inside ``base_dir``.

    Build it with :meth:`for_model`, which validates every external tensor (contained location,
    well-formed offset and length inside the file, length matching the type and shape) before any
    byte is used. Descriptors close with :meth:`close` or when the object is collected.
    """

    def __init__(self, base_dir: str | os.PathLike[str], label: str):
        self.base_dir = Path(base_dir)
        self.label = label
        self._lock = threading.Lock()
        self._files: dict[str, _Opened] = {}
        self._fds: list[int] = []
        try:
            self._root = os.open(self.base_dir, _OPEN_DIR)
        except OSError as exc:
            raise InvalidModelError(
                f"{label}: cannot open the model's folder {self.base_dir}: {exc.strerror or exc}"
            ) from None
        self._fds.append(self._root)
        self._finalizer = weakref.finalize(self, _close_all, self._fds)

    @classmethod
    def for_model(
        cls, model: onnx.ModelProto, base_dir: str | os.PathLike[str] | None, label: str
    ) -> ExternalData | None:
        """Open and check every file ``model`` references; None when it has no external data."""
        tensors = list(external_tensors(model))
        if not tensors:
            return None
        if base_dir is None:
            first = tensors[0]
            raise InvalidModelError(
                f"{label}: {_tensor_label(first)} is stored as external data but the model's folder is "
                "unknown; pass base_dir= (the folder its external data lives in)"
            )
        store = cls(base_dir, label)
        try:
            for tensor in tensors:
                store.check(tensor)
        except BaseException:
            store.close()
            raise
        return store

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> ExternalData:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- opening -------------------------------------------------------------------------------

    def _open(self, location: str, where: str) -> _Opened:
        with self._lock:
            opened = self._files.get(location)
            if opened is None:
                fd = _open_beneath(self._root, self.base_dir, location, where)
                self._fds.append(fd)
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    kind = (
                        "a FIFO"
                        if stat.S_ISFIFO(st.st_mode)
                        else "a directory"
                        if stat.S_ISDIR(st.st_mode)
                        else "a device or other special file"
                    )
                    raise InvalidModelError(f"{where}: external data {location!r} is {kind}, not a regular file")
                opened = self._files[location] = _Opened(fd, self.base_dir / location, st)
            return opened

    def check(self, tensor: onnx.TensorProto) -> tuple[_Opened, int, int]:
        """The open file, offset and length of ``tensor``'s bytes, after checking all of them."""
        where = f"{self.label}: {_tensor_label(tensor)}"
        loc = tensor_location(tensor, self.label)
        opened = self._open(loc.location, where)
        if loc.offset > opened.size:
            raise InvalidModelError(
                f"{where}: external data offset {loc.offset} is past the end of {loc.location!r} ({opened.size} bytes)"
            )
        length = opened.size - loc.offset if loc.length is None else loc.length
        if loc.offset + length > opened.size:
            raise InvalidModelError(
                f"{where}: external data {loc.location!r} has {opened.size} bytes; offset {loc.offset} + "
                f"length {length} runs past its end"
            )
        expected = _expected_bytes(tensor, where)
        if expected != length:
            raise InvalidModelError(
                f"{where}: external data length {length} does not match its type and shape "
                f"{list(tensor.dims)} ({expected} bytes)"
            )
        return opened, loc.offset, length

    # -- reading -------------------------------------------------------------------------------

    def file_ids(self) -> set[tuple[int, int]]:
        """(st_dev, st_ino) of every file opened: what an output must never be or overwrite."""
        return {(o.st.st_dev, o.st.st_ino) for o in self._files.values()}

    def reads(self) -> dict[tuple[int, int], Path]:
        """(st_dev, st_ino) -> path of every file opened (for clash checks and messages)."""
        return {(o.st.st_dev, o.st.st_ino): o.path for o in self._files.values()}

    def locations(self) -> set[str]:
        return set(self._files)

    def read(self, tensor: onnx.TensorProto) -> bytes:
        """``tensor``'s bytes, read from the descriptor opened (and checked) for its file."""
        opened, offset, length = self.check(tensor)
        data = os.pread(opened.fd, length, offset) if length else b""
        if len(data) != length:  # the file shrank after it was opened
            raise InvalidModelError(
                f"{self.label}: {_tensor_label(tensor)}: external data {opened.path.name!r} ends before offset "
                f"{offset + length}"
            )
        return data

    def span(self, tensor: onnx.TensorProto) -> tuple[int, int, int]:
        """(descriptor, offset, length) of ``tensor``'s bytes, for streaming copies."""
        opened, offset, length = self.check(tensor)
        return opened.fd, offset, length

    def iter_slabs(self, tensor: onnx.TensorProto, max_bytes: int = SLAB_BYTES) -> Iterator[Any]:
        """``tensor``'s values as numpy arrays, consecutive slabs along its first axis (each
        ``[rows, *dims[1:]]``, at most ``max_bytes`` or one row), read one at a time through the
        checked descriptor: statistics of gigabytes of weights in bounded memory.

        A tensor of rank 0 or of a type numpy cannot view in place (sub-byte, bfloat16, float8)
        comes as one array.
        """
        import numpy as np

        np_name = _SLAB_TYPES.get(tensor.data_type)
        dims = tuple(tensor.dims)
        if tensor.data_location != onnx.TensorProto.EXTERNAL or np_name is None or not dims:
            yield self.to_array(tensor)
            return
        dtype = np.dtype(np_name).newbyteorder("<")
        opened, offset, _ = self.check(tensor)
        row_bytes = math.prod(dims[1:]) * dtype.itemsize
        if row_bytes == 0:
            yield np.zeros(dims, dtype)
            return
        per_slab = max(1, max_bytes // row_bytes)
        for start in range(0, dims[0], per_slab):
            rows = min(per_slab, dims[0] - start)
            data = self._pread_exactly(tensor, opened, rows * row_bytes, offset + start * row_bytes)
            yield np.frombuffer(data, dtype).reshape(rows, *dims[1:])

    def _pread_exactly(self, tensor: onnx.TensorProto, opened: _Opened, size: int, at: int) -> bytes:
        """``size`` bytes at ``at`` of the checked descriptor (a read may return fewer: loop)."""
        parts = []
        while size:
            chunk = os.pread(opened.fd, min(size, _MAX_READ), at)
            if not chunk:  # the file shrank after it was opened
                raise InvalidModelError(
                    f"{self.label}: {_tensor_label(tensor)}: external data {opened.path.name!r} ends before offset "
                    f"{at + size}"
                )
            parts.append(chunk)
            size -= len(chunk)
            at += len(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def to_array(self, tensor: onnx.TensorProto):
        """``tensor`` as a numpy array, its external bytes read through the checked descriptor."""
        from onnx import numpy_helper

        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            return numpy_helper.to_array(tensor)
        return numpy_helper.to_array(self.loaded(tensor))

    def loaded(self, tensor: onnx.TensorProto) -> onnx.TensorProto:
        """A copy of ``tensor`` with its external bytes in ``raw_data``."""
        copy = onnx.TensorProto()
        copy.CopyFrom(tensor)
        copy.raw_data = self.read(tensor)
        copy.data_location = onnx.TensorProto.DEFAULT
        del copy.external_data[:]
        return copy

    def load_into(self, model: onnx.ModelProto) -> None:
        """Move every external tensor of ``model`` into memory (for onnxruntime sessions)."""
        for tensor in list(external_tensors(model)):
            data = self.read(tensor)
            tensor.raw_data = data
            tensor.data_location = onnx.TensorProto.DEFAULT
            del tensor.external_data[:]


def _refuse(where: str, location: str, why: str) -> InvalidModelError:
    return InvalidModelError(f"{where}: external data location {location!r} {why}")


def _open_beneath(root: int, base_dir: Path, location: str, where: str) -> int:
    """Open ``location`` relative to the folder descriptor ``root`` without ever leaving it.

    Every component is opened with O_NOFOLLOW relative to its parent's descriptor; a symlink is
    read and its (relative) target spliced into the remaining components; ``..`` pops a folder
    and may never pop the model's folder itself.
    """
    if "\0" in location:
        raise _refuse(where, location, "contains a NUL character")
    if location.startswith("/") or os.path.isabs(location):
        raise _refuse(where, location, "is absolute; it must be relative to the model's folder")
    if not _HAVE_DIR_FD:  # pragma: no cover - platforms without openat: resolve, then compare the inode
        return _open_resolved(base_dir, location, where)
    pending = location.split("/")
    pending.reverse()
    stack: list[int] = []
    links = 0
    try:
        while pending:
            name = pending.pop()
            if name in ("", "."):
                continue
            if name == "..":
                if not stack:
                    raise _refuse(where, location, "leads outside the model's folder")
                os.close(stack.pop())
                continue
            parent = stack[-1] if stack else root
            last = not any(p not in ("", ".") for p in pending)
            try:
                fd = os.open(name, _OPEN_FILE if last else (_OPEN_DIR | os.O_NOFOLLOW), dir_fd=parent)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.EMLINK) or (exc.errno == errno.ENOTDIR and not last):
                    try:
                        target = os.readlink(name, dir_fd=parent)
                    except OSError:
                        if exc.errno == errno.ENOTDIR:
                            raise _refuse(where, location, f"names {name!r}, which is not a folder") from None
                        raise _refuse(where, location, f"cannot be opened: {exc.strerror}") from None
                    links += 1
                    if links > _MAX_LINKS:
                        raise _refuse(where, location, "has too many levels of symbolic links") from None
                    if target.startswith("/"):
                        raise _refuse(
                            where, location, f"goes through a symlink to {target!r}, outside the model's folder"
                        ) from None
                    parts = target.split("/")
                    parts.reverse()
                    pending.extend(parts)
                    continue
                if exc.errno == errno.ENOENT:
                    raise InvalidModelError(
                        f"{where}: external data file {location!r} does not exist in {base_dir}"
                    ) from None
                raise _refuse(where, location, f"cannot be opened: {exc.strerror or exc}") from None
            if last:
                return fd
            stack.append(fd)
        raise _refuse(where, location, "names the model's folder, not a file")
    finally:
        _close_all(stack)


def _open_resolved(base_dir: Path, location: str, where: str) -> int:  # pragma: no cover
    base = base_dir.resolve()
    target = (base / location).resolve()
    if base not in target.parents:
        raise _refuse(where, location, "leads outside the model's folder")
    try:
        fd = os.open(target, _OPEN_FILE & ~getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise _refuse(where, location, f"cannot be opened: {exc.strerror or exc}") from None
    st = os.fstat(fd)
    now = os.stat(target)
    if (st.st_dev, st.st_ino) != (now.st_dev, now.st_ino):
        os.close(fd)
        raise _refuse(where, location, "changed while it was opened")
    return fd
