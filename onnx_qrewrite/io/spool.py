"""Bytes written once, in order, then read back: the main graph's encoded nodes of a rewrite.

Why: a rewritten model is several times its input (the replacements of a 100k-node chain are
~40 MB of node bytes, as many Python objects as rewrites). Kept in memory until the model is
saved, they came on top of the parsed input, the matches and the report, and were a fifth of a
rewrite's peak memory. Written here as they are built, they cost a 1 MB buffer; saving copies
them into the output file in 1 MB reads.

The file is an unnamed temporary (``tempfile.TemporaryFile``: ``O_TMPFILE`` or unlinked at once,
in ``TMPDIR``): no process ever reads it as an input, and a kill leaves nothing behind, since the
file has no name. It lives as long as the :class:`Spool` (the model it belongs to).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

from onnx_qrewrite.errors import UsageError

__all__ = ["Spool"]

#: Pieces are gathered to this size before one write, and read back in reads of this size.
_BLOCK = 2**20


class Spool:
    """An append-only byte stream in an unnamed temporary file (see the module docstring)."""

    def __init__(self) -> None:
        try:
            self._file = tempfile.TemporaryFile(prefix="onnx-qrewrite-")  # noqa: SIM115 - owned by the spool
        except OSError as exc:
            raise UsageError(
                f"cannot create a temporary file in {tempfile.gettempdir()}: {exc.strerror or exc}"
            ) from None
        self._pending: list[bytes] = []
        self._pending_size = 0
        #: Bytes written so far (flushed or not).
        self.size = 0

    def write(self, piece: bytes) -> None:
        self._pending.append(piece)
        self._pending_size += len(piece)
        self.size += len(piece)
        if self._pending_size >= _BLOCK:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        data = b"".join(self._pending)
        self._pending = []
        self._pending_size = 0
        try:
            os.lseek(self._file.fileno(), 0, os.SEEK_END)
            view = memoryview(data)
            while view:
                view = view[os.write(self._file.fileno(), view) :]
        except OSError as exc:
            raise UsageError(
                f"cannot write a temporary file in {tempfile.gettempdir()}: {exc.strerror or exc}"
            ) from None

    def chunks(self) -> Iterator[bytes]:
        """Everything written, in order, in pieces of at most 1 MB (readable again and again)."""
        self._flush()
        fd = self._file.fileno()
        offset = 0
        while offset < self.size:
            block = os.pread(fd, min(_BLOCK, self.size - offset), offset)
            if not block:
                raise UsageError(f"a temporary file in {tempfile.gettempdir()} was truncated while in use")
            offset += len(block)
            yield block

    def close(self) -> None:
        self._pending = []
        self._file.close()
