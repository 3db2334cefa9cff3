"""Read a model file's bytes once, from a descriptor that is checked to be a regular file.

Kept apart from :mod:`onnx_qrewrite.io.model_io` (which parses with onnx) so that a command that
only needs the bytes, or a few fields of them (:mod:`onnx_qrewrite.io.wire_model`), does not pay
for importing onnx.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from onnx_qrewrite.errors import InvalidModelError

__all__ = ["MAX_MODEL_FILE", "read_once"]

#: Refuse model files whose protobuf could not be parsed anyway (protobuf's 2 GB limit).
MAX_MODEL_FILE = 2**31 - 1
_CHUNK = 64 * 2**20


def read_once(p: Path) -> tuple[bytes, tuple[int, int]]:
    """The bytes of the model file and its (st_dev, st_ino), from one descriptor that fstat says
    is a regular file; every failure is an InvalidModelError naming ``p``."""
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise InvalidModelError(f"{p}: no such file") from None
    except IsADirectoryError:
        raise InvalidModelError(f"{p}: is a directory, not an ONNX model file") from None
    except OSError as exc:
        raise InvalidModelError(f"{p}: cannot read: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise InvalidModelError(f"{p}: is a directory, not an ONNX model file")
        if not stat.S_ISREG(st.st_mode):
            raise InvalidModelError(f"{p}: is not a regular file (a FIFO or device); give an ONNX model file")
        if st.st_size == 0:
            raise InvalidModelError(f"{p}: the file is empty")
        if st.st_size > MAX_MODEL_FILE:
            raise InvalidModelError(
                f"{p}: {st.st_size} bytes, more than protobuf can parse (2 GiB); is it an ONNX model?"
            )
        os.set_blocking(fd, True)
        chunks = []
        remaining = st.st_size
        while remaining > 0:
            chunk = os.read(fd, min(remaining, _CHUNK))
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
        return b"".join(chunks), (st.st_dev, st.st_ino)
    except OSError as exc:
        raise InvalidModelError(f"{p}: cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
