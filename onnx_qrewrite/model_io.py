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
import dataclasses
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

from onnx_qrewrite.encoded import EncodedModel, skeleton_of, to_bytes
from onnx_qrewrite.errors import InvalidModelError, QRewriteError, UsageError, first_line
from onnx_qrewrite.progress import ProgressSink

__all__ = ["SaveInfo", "check_model", "external_tensors", "load_model", "save_model"]

_PROTOBUF_LIMIT = 2**31 - 1
#: Headroom for fields other than tensor payloads when deciding whether to externalize.
_LIMIT_MARGIN = 64 * 2**20
#: Tensors at least this large move to external data when a model must be split.
_EXTERNALIZE_THRESHOLD = 1024
_ALIGN = 64
_CHUNK = 64 * 2**20


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_FILE_MODE = 0o666 & ~_umask()


def load_model(path: str | os.PathLike[str], *, check: bool = True) -> onnx.ModelProto:
    """Parse ``path`` without loading external weights; every failure is an InvalidModelError."""
    p = Path(path)
    if not p.exists():
        raise InvalidModelError(f"{p}: no such file")
    if p.is_dir():
        raise InvalidModelError(f"{p}: is a directory, not an ONNX model file")
    try:
        size = p.stat().st_size
        if size == 0:
            raise InvalidModelError(f"{p}: the file is empty")
        model = onnx.load(str(p), load_external_data=False)
    except InvalidModelError:
        raise
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise InvalidModelError(
            f"{p}: not a valid ONNX model (cannot parse the protobuf: {first_line(exc)}); "
            "is the file truncated or corrupt?"
        ) from None
    except OSError as exc:
        raise InvalidModelError(f"{p}: cannot read: {exc.strerror or exc}") from None
    if model.ir_version == 0 or not model.HasField("graph"):
        raise InvalidModelError(
            f"{p}: not a valid ONNX model (no IR version or graph); is the file truncated or corrupt?"
        )
    if check:
        check_model(p, what=str(p))
    return model


_CWD_LOCK = threading.Lock()


def check_model(
    model: onnx.ModelProto | EncodedModel | Path,
    *,
    what: str,
    base_dir: str | os.PathLike[str] | None = None,
    error: type[QRewriteError] = InvalidModelError,
) -> None:
    """Run onnx's checker; a path is checked by the C++ checker directly (handles external data
    and models over 2 GB).

    onnx's in-memory checker resolves external data locations against the *working directory*
    and accepts no model folder, so for an in-memory model that references external data we point
    the working directory at ``base_dir`` for the duration of the check (under a lock). Without a
    ``base_dir`` such a model cannot be checked in memory, and is not.
    """
    if not isinstance(model, Path) and any(True for _ in external_tensors(skeleton_of(model))):
        if base_dir is None:
            return
        with _CWD_LOCK:
            previous = os.getcwd()
            os.chdir(base_dir)
            try:
                return check_model(model, what=what, error=error)
            finally:
                os.chdir(previous)
    if not isinstance(model, Path) and byte_size(model) > _PROTOBUF_LIMIT:
        return  # cannot be checked in memory; the input was checked from its file
    try:
        onnx.checker.check_model(str(model) if isinstance(model, Path) else to_bytes(model))
    except (onnx.checker.ValidationError, ValueError, RuntimeError) as exc:
        raise error(f"{what}: fails the ONNX checker: {first_line(exc)}") from None


def _all_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Initializers of every graph and Constant values: where tensors with data live.

    onnx's ``_get_all_tensors`` visits every attribute of every node from Python (1.9 s on a
    400k-node graph); tensors sit in initializers and in Constant nodes' ``value``, so only those
    are looked at (subgraphs and local functions included).
    """
    from onnx_qrewrite.graph import iter_scopes

    for scope in iter_scopes(model):
        container = scope.container
        if isinstance(container, onnx.GraphProto):
            yield from container.initializer
        for node in container.node:
            if node.op_type == "Constant":
                for attr in node.attribute:
                    if attr.name == "value":
                        yield attr.t


def external_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    for tensor in _all_tensors(model):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            yield tensor


def _external_info(tensor: onnx.TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in tensor.external_data}


def _set_external(tensor: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    del tensor.external_data[:]
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    tensor.data_location = onnx.TensorProto.EXTERNAL


def _copy_range(src, dst, offset: int, length: int) -> None:
    src_fd, dst_fd = src.fileno(), dst.fileno()
    remaining = length
    if hasattr(os, "copy_file_range"):
        try:
            while remaining:
                n = os.copy_file_range(src_fd, dst_fd, min(remaining, 1 << 30), offset + length - remaining)
                if n == 0:
                    break
                remaining -= n
        except OSError:
            pass  # e.g. across file systems on old kernels: fall back to plain reads
    src.seek(offset + length - remaining)
    dst.seek(0, os.SEEK_END)
    while remaining:
        chunk = src.read(min(remaining, _CHUNK))
        if not chunk:
            raise InvalidModelError(f"{src.name}: external data ends before offset {offset + length}")
        dst.write(chunk)
        remaining -= len(chunk)


@dataclasses.dataclass(frozen=True)
class SaveInfo:
    path: Path
    data_path: Path | None  # the external data file written, if any
    referenced: tuple[str, ...]  # input data files referenced in place (zero copy)
    external_bytes: int  # bytes of external data written (or referenced)


def byte_size(model: onnx.ModelProto | EncodedModel) -> int:
    return model.byte_size() if isinstance(model, EncodedModel) else model.ByteSize()


def save_model(
    model: onnx.ModelProto | EncodedModel,
    path: str | os.PathLike[str],
    *,
    source_dir: str | os.PathLike[str] | None = None,
    reference_external_data: bool = False,
    progress: ProgressSink | None = None,
) -> SaveInfo:
    """Write ``model`` atomically; external weights are streamed from ``source_dir`` or referenced.

    ``model`` itself is updated to point at the data file it was written with, so that the caller's
    model and the file on disk agree.
    """
    out = Path(path)
    if out.is_dir():
        raise UsageError(f"{out}: is a directory; give a file name for the output model")
    folder = out.parent if str(out.parent) else Path(".")
    if not folder.is_dir():
        raise UsageError(f"{out}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"{out}: cannot write to the folder {folder} (permission denied)")

    skeleton = skeleton_of(model)
    ext = list(external_tensors(skeleton))
    src_dir = Path(source_dir) if source_dir is not None else None
    if ext and src_dir is None:
        raise UsageError(f"{out}: the model references external data but its source folder is unknown")
    same_folder = src_dir is not None and folder.resolve() == src_dir.resolve()
    if reference_external_data and ext and not same_folder:
        raise UsageError(
            f"{out}: --reference-external-data needs the output in the input's folder ({src_dir}); "
            "elsewhere the weights are copied"
        )

    data_name = out.name + ".data"
    temps: list[Path] = []
    try:
        data_tmp = None
        written = 0
        referenced: set[str] = set()
        too_big = byte_size(model) > _PROTOBUF_LIMIT - _LIMIT_MARGIN
        if reference_external_data:
            for t in ext:
                info = _external_info(t)
                referenced.add(info["location"])
                written += int(info.get("length", 0) or 0)
        elif ext or too_big:
            fd, name = tempfile.mkstemp(prefix=f".{data_name}.", suffix=".tmp", dir=folder)
            data_tmp = Path(name)
            temps.append(data_tmp)
            total_external = sum(int(_external_info(t).get("length", 0) or 0) for t in ext)
            copied = 0
            with os.fdopen(fd, "wb") as dst:
                handles: dict[str, object] = {}
                try:
                    for t in ext:
                        info = _external_info(t)
                        location = info["location"]
                        src = handles.get(location)
                        if src is None:
                            src_path = src_dir / location  # type: ignore[operator]
                            try:
                                src = handles[location] = open(src_path, "rb")
                            except OSError as exc:
                                raise InvalidModelError(
                                    f"{src_path}: cannot read external data of tensor {t.name!r}: {exc.strerror or exc}"
                                ) from None
                        offset = int(info.get("offset", 0) or 0)
                        length = int(info["length"]) if "length" in info else os.fstat(src.fileno()).st_size - offset
                        pad = (-written) % _ALIGN
                        dst.write(b"\0" * pad)
                        written += pad
                        dst.flush()
                        _copy_range(src, dst, offset, length)
                        _set_external(t, data_name, written, length)
                        written += length
                        copied += length
                        if progress is not None:
                            progress("writing weights bytes", copied, total_external)
                    if too_big:
                        written = _externalize_large(skeleton, dst, data_name, written)
                finally:
                    for h in handles.values():
                        h.close()  # type: ignore[attr-defined]
                dst.flush()
                os.fsync(dst.fileno())
        fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=folder)
        model_tmp = Path(name)
        temps.append(model_tmp)
        with os.fdopen(fd, "wb") as f:
            f.write(to_bytes(model))
            f.flush()
            os.fsync(f.fileno())
        data_path = None
        if data_tmp is not None:
            data_path = folder / data_name
            os.replace(data_tmp, data_path)
            temps.remove(data_tmp)
        os.replace(model_tmp, out)
        temps.remove(model_tmp)
        for written_path in (out, data_path):
            if written_path is not None:
                os.chmod(written_path, _FILE_MODE)  # mkstemp creates 0600; give what open() would
    except OSError as exc:
        raise UsageError(f"{out}: cannot write: {exc.strerror or exc}") from None
    finally:
        for tmp in temps:
            with contextlib.suppress(OSError):
                tmp.unlink()
    return SaveInfo(out, data_path, tuple(sorted(referenced)), written)


def _externalize_large(model: onnx.ModelProto, dst, data_name: str, written: int) -> int:
    """Move in-memory tensors of at least 1 KiB into the data file: the model passes 2 GB."""
    for t in _all_tensors(model):
        if (
            t.data_location == onnx.TensorProto.EXTERNAL
            or not t.HasField("raw_data")
            or len(t.raw_data) < _EXTERNALIZE_THRESHOLD
        ):
            continue
        pad = (-written) % _ALIGN
        dst.write(b"\0" * pad)
        written += pad
        dst.write(t.raw_data)
        _set_external(t, data_name, written, len(t.raw_data))
        written += len(t.raw_data)
        t.ClearField("raw_data")
    return written
