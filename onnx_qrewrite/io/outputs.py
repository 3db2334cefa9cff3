"""Outputs committed all or nothing, through temporaries that are recognisable and cleaned up.

Every file onnx-qrewrite writes is first written to a temporary in the destination folder named
``.<final name>.qrw-tmp-<pid>-<token>.<kind>`` and renamed into place when complete. Nothing is
ever written through an existing file: a hard link or a symlink at the output path is replaced,
never truncated.

A model with external data is a *pair*, and the pair must change in one step:

1. the weights are written to a temporary ``T``; the model to a temporary that references a data
   file name no file has yet (``<out>.data``, else ``<out>.1.data``, ...);
2. a temporary ``.journal`` lists that name and the data file the previous model at ``<out>``
   referenced (if it is ours: ``<out>.data`` or ``<out>.N.data``, and no input reads it);
3. ``T`` is renamed to the new name (the old model does not see it);
4. the model is renamed over ``<out>``: the single commit point;
5. the old data file, then the journal, are removed.

A kill at any moment leaves ``<out>`` with either the old pair or the new pair. What it can leave
besides are temporaries whose pid is dead; the next write into that folder removes them, and a
dead journal's data files are removed too when the model now at ``<out>`` does not reference
them (the new data of a commit that did not happen, or the old data of one that did).
SIGTERM and SIGINT are turned into exceptions (:mod:`onnx_qrewrite.io.signals`), so ``finally``
blocks remove the temporaries; steps 3-5 run with those signals blocked.

Private folders under $TMPDIR (a runner's copies, the TFLite child's home) are registered too
(:func:`private_folder`, :func:`register_folder`): a batch worker stopped by SIGTERM leaves
through ``os._exit``, skipping the finalizers and atexit hooks that would remove them, and calls
:func:`remove_registered_temps` first.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import stat
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from onnx_qrewrite.errors import UsageError

if TYPE_CHECKING:
    import tempfile

__all__ = [
    "TEMP_MARK",
    "FileId",
    "check_target",
    "clean_leftovers",
    "data_file_candidates",
    "forget_folder",
    "new_temp",
    "private_folder",
    "references",
    "refuse_clash",
    "register_folder",
    "remove_registered_temps",
    "rename_new",
    "write_atomic",
    "write_journal",
    "write_report_file",
]

TEMP_MARK = ".qrw-tmp-"
_TEMP_RE = re.compile(r"^\.(?P<base>.+)\.qrw-tmp-(?P<pid>\d+)-[0-9a-f]+\.(?P<kind>[a-z]+)$")
FileId = tuple[int, int]

_registry_lock = threading.Lock()
_registry: set[str] = set()
_folders: dict[str, int] = {}  # private folder -> the pid that made it (a fork's are not its own)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


FILE_MODE = 0o666 & ~_umask()


def file_id(st: os.stat_result) -> FileId:
    return st.st_dev, st.st_ino


def new_temp(folder: Path, final_name: str, kind: str) -> tuple[int, Path]:
    """Create ``.<final_name>.qrw-tmp-<pid>-<token>.<kind>`` in ``folder`` (registered for cleanup)."""
    while True:
        path = folder / f".{final_name}{TEMP_MARK}{os.getpid()}-{os.urandom(4).hex()}.{kind}"
        with _registry_lock:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
            except FileExistsError:
                continue
            _registry.add(str(path))
        return fd, path


def forget(path: Path) -> None:
    with _registry_lock:
        _registry.discard(str(path))


def discard(path: Path | None) -> None:
    """Remove a temporary (if it is still there) and forget it."""
    if path is None:
        return
    with contextlib.suppress(OSError):
        os.unlink(path)
    forget(path)


def register_folder(path: str) -> None:
    """A private folder of this process that :func:`remove_registered_temps` removes."""
    with _registry_lock:
        _folders[path] = os.getpid()


def forget_folder(path: str) -> None:
    """``path`` is removed (or no longer this process's to remove): no longer registered."""
    with _registry_lock:
        _folders.pop(path, None)


def private_folder(prefix: str) -> tempfile.TemporaryDirectory[str]:
    """A TemporaryDirectory that is also registered (forgotten when it is collected)."""
    import tempfile
    import weakref

    folder = tempfile.TemporaryDirectory(prefix=prefix)
    register_folder(folder.name)
    weakref.finalize(folder, forget_folder, folder.name)
    return folder


def remove_registered_temps() -> None:
    """Remove every temporary this process created and has not renamed, and its registered private
    folders (on SIGTERM/SIGINT)."""
    with _registry_lock:
        paths = list(_registry)
        _registry.clear()
        folders = [path for path, pid in _folders.items() if pid == os.getpid()]
        _folders.clear()
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)
    if folders:
        import shutil

        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def signals_blocked() -> Iterator[None]:
    """SIGINT/SIGTERM held back for a few system calls (the commit steps)."""
    if not hasattr(signal, "pthread_sigmask"):  # pragma: no cover
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def fsync_folder(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def check_target(path: str | os.PathLike[str], option: str) -> None:
    """An output goes to a regular file or a new path: a FIFO, device, socket or folder is refused."""
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise UsageError(f"{option} {p}: cannot use as an output: {exc.strerror or exc}") from None
    if stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{option} {p}: is a directory; give a file name")
    if not stat.S_ISREG(st.st_mode):
        kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a device or other special file"
        raise UsageError(f"{option} {p}: is {kind}; outputs go to regular files or new paths")


def write_atomic(path: str | os.PathLike[str], data: bytes, option: str) -> None:
    """Write ``data`` to ``path`` all or nothing (temporary + rename); failures are usage errors."""
    out = Path(path)
    folder = out.parent if str(out.parent) else Path(".")
    check_target(out, option)
    tmp: Path | None = None
    try:
        fd, tmp = new_temp(folder, out.name, "part")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            os.fchmod(f.fileno(), FILE_MODE)
        os.replace(tmp, out)
        forget(tmp)
        tmp = None
    except OSError as exc:
        raise UsageError(f"{option}: {out}: cannot write: {exc.strerror or exc}") from None
    finally:
        discard(tmp)


# -- data files of a model output -------------------------------------------------------------


def data_file_candidates(model_name: str) -> Iterator[str]:
    """Names a model's data file may take: ``<name>.data``, ``<name>.1.data``, ``<name>.2.data``..."""
    yield f"{model_name}.data"
    n = 1
    while True:
        yield f"{model_name}.{n}.data"
        n += 1


def _is_candidate(model_name: str, name: str) -> bool:
    return name == f"{model_name}.data" or re.fullmatch(re.escape(model_name) + r"\.[0-9]+\.data", name) is not None


def references(model_bytes: bytes, location: str) -> bool:
    """Whether serialized model bytes hold the external-data entry ``location = <location>``.

    The entry is ``StringStringEntryProto{key: "location", value: <location>}``, encoded exactly
    as below by every protobuf serializer; a model is only read this way to decide which of *our*
    data files an old output used, where a miss only leaves a file behind.
    """
    name = location.encode("utf-8", "surrogateescape")
    from onnx_qrewrite.io._wire import varint  # its import builds a table that reading commands never use

    return b"\x0a\x08location\x12" + varint(len(name)) + name in model_bytes


def _read_model_bytes(path: Path) -> bytes:
    """The model at ``path`` (a regular file under 2 GB), else nothing."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return b""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size >= 2**31:
            return b""
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()
    finally:
        os.close(fd)


def previous_data_files(out: Path) -> list[Path]:
    """Our data files (``<out>.data``, ``<out>.N.data``) that the model now at ``out`` references."""
    folder = out.parent
    try:
        names = [n for n in os.listdir(folder) if _is_candidate(out.name, n)]
    except OSError:
        return []
    if not names:
        return []
    current = _read_model_bytes(out)
    return [folder / n for n in sorted(names) if current and references(current, n)]


def free_data_name(out: Path, avoid: Iterable[str] = ()) -> str:
    """The first candidate data file name for ``out`` that no file has."""
    avoid = set(avoid)
    for name in data_file_candidates(out.name):
        if name in avoid:
            continue
        try:
            os.lstat(out.parent / name)
        except FileNotFoundError:
            return name
    raise AssertionError("unreachable")  # pragma: no cover


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: exists, someone else's
        return True
    return True


def write_journal(folder: Path, model_name: str, new: str | None, old: list[str]) -> Path:
    """A temporary ``.journal`` listing the data file a commit adds and the ones it removes."""
    fd, path = new_temp(folder, model_name, "journal")
    lines = ([f"new {new}"] if new else []) + [f"old {name}" for name in old]
    with os.fdopen(fd, "w", encoding="utf-8", errors="surrogateescape") as f:
        f.write("\n".join(lines) + "\n")
    return path


def rename_new(tmp: Path, final: Path) -> None:
    """Give a finished temporary its final name, which no file may have."""
    if os.path.lexists(final):
        raise UsageError(f"{final}: appeared while the output was being written; try again")
    os.rename(tmp, final)
    forget(tmp)


def clean_leftovers(folder: Path) -> list[str]:
    """Remove temporaries of dead onnx-qrewrite processes in ``folder`` (killed with SIGKILL, or
    the machine went down); a dead commit's journal also removes the data files it names that the
    model now at its output path does not reference. Returns the names removed."""
    removed: list[str] = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        m = _TEMP_RE.match(name) if TEMP_MARK in name else None
        if not m or _pid_alive(int(m["pid"])):
            continue
        path = folder / name
        if m["kind"] == "journal":
            base = m["base"]
            try:
                listed = path.read_text(encoding="utf-8", errors="surrogateescape").split("\n")
            except OSError:
                listed = []
            current = _read_model_bytes(folder / base)
            for line in listed:
                data = line.partition(" ")[2]
                if not data or not _is_candidate(base, data) or (current and references(current, data)):
                    continue
                with contextlib.suppress(OSError):
                    os.unlink(folder / data)
                    removed.append(data)
        with contextlib.suppress(OSError):
            os.unlink(path)
            removed.append(name)
    return removed


def refuse_clash(out: Path, reads: dict[tuple[int, int], Path], option: str = "-o") -> None:
    """``out`` must not be (a link to) a file the invocation reads: compared by inode."""
    try:
        st = os.stat(out)
    except OSError:
        return
    hit = reads.get(file_id(st))
    if hit is not None:
        raise UsageError(
            f"{option} {out}: refusing to overwrite the input file {hit} (the same file), which this invocation "
            "reads; choose another path"
        )


def write_report_file(path: str | os.PathLike[str], text: str, option: str) -> None:
    """Write a report (JSON, JUnit) all or nothing (temporary + rename, never through the existing
    file); a failure is a usage error naming the option and the path."""
    write_atomic(path, text.encode("utf-8"), option)
