"""The shipped rule files' parsed TOML, kept as JSON beside the user's other caches.

Why: ``tomllib`` decodes TOML character by character in Python; the shipped catalogue (70 KB)
took about 55 million instructions of an ``inspect`` of a small model, 1.2x ``polygraphy --help``
being 692 million (issue 13, docs/performance.md), and importing ``tomllib`` more. ``json``
decodes the same values in C, in a few million.

Why it cannot go stale: an entry holds the text it was parsed from and is used only when that text
is the file's text as read now, character for character (its name, a checksum of the text, only
finds it). Its values are what ``tomllib.loads`` returned for that text: the TOML stays the only
source of truth, and the catalogue checks every rule read from an entry against its builder's
contract exactly as it checks one just parsed. Entries are data (JSON), never code; an entry is
used only when it is a regular file (not a link, FIFO or device) of a size its text explains,
belongs to the user and nobody else may write it (POSIX), and anything wrong with one
(unreadable, not JSON, another text) means the file is parsed as if there were none.

Where: ``$ONNX_QREWRITE_CACHE_DIR``, else ``$XDG_CACHE_HOME/onnx-qrewrite``, else
``~/.cache/onnx-qrewrite``, in a folder per Python version (``rules-py3.11``); an empty
``ONNX_QREWRITE_CACHE_DIR``, or no home folder to be found, turns the cache off. An entry is
written only where none is (never over a file this process read), atomically (a temporary file
in the same folder, then renamed), and only for values JSON gives back as they were (strings,
integers, floats, booleans, arrays, tables: TOML dates are left uncached); a cache that cannot be
written is skipped silently.

Layout: an entry's name and its ``format`` field carry :data:`FORMAT`, raised whenever what an
entry holds changes, so a package with another layout neither finds this one's entries nor
trusts one it finds (an entry of another format is treated as none: the text is parsed again).

Size: :data:`KEEP` entries, and what one command writes; a command that writes one prunes the
folder once (rule_cache_prune.py, imported only then).
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import zlib
from pathlib import Path
from typing import Any

__all__ = ["FORMAT", "KEEP", "cache_dir", "load", "store"]

_ENV = "ONNX_QREWRITE_CACHE_DIR"

#: The layout of an entry, in its name and its ``format`` field: 2, ``{"format", "text",
#: "toml"}`` (1, unnamed, had no ``format`` field).
FORMAT = 2

#: The most entries kept: the shipped rule files are about 20, so some versions of them.
KEEP = 128


def cache_dir() -> Path | None:
    """The folder entries are kept in (see the module docstring), or None when turned off."""
    chosen = os.environ.get(_ENV)
    if chosen is not None:
        base = Path(chosen) if chosen else None
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        if xdg:
            base = Path(xdg) / "onnx-qrewrite"
        else:
            try:  # no HOME and a uid without a passwd entry (containers run as any uid): no cache
                base = Path.home() / ".cache" / "onnx-qrewrite"
            except (RuntimeError, KeyError, OSError):
                return None
    if base is None:
        return None
    return base / f"rules-py{sys.version_info[0]}.{sys.version_info[1]}"


def _entry(folder: Path, text: str) -> Path:
    data = text.encode("utf-8")
    return folder / f"v{FORMAT}-{zlib.crc32(data):08x}{zlib.adler32(data):08x}-{len(data)}.json"


def load(text: str) -> dict[str, Any] | None:
    """What ``tomllib.loads(text)`` returned when ``text`` was last parsed here, or None."""
    folder = cache_dir()
    if folder is None:
        return None
    try:
        # Opened without blocking and without following a link: a FIFO or device at an entry's
        # name would otherwise hang or feed every command; only the user's own regular file of a
        # size its text can explain is read (bounded memory).
        fd = os.open(_entry(folder, text), os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as f:
            status = os.fstat(f.fileno())
            if not stat.S_ISREG(status.st_mode) or not _trusted(status) or status.st_size > _limit(text):
                return None
            raw = f.read()
        import json

        entry = json.loads(raw)
    except (OSError, ValueError, RecursionError):
        return None
    if (
        not isinstance(entry, dict)
        or entry.get("format") != FORMAT
        or entry.get("text") != text
        or not isinstance(entry.get("toml"), dict)
    ):
        return None
    return entry["toml"]


def store(text: str, parsed: dict[str, Any]) -> None:
    """Keep ``parsed`` (``tomllib.loads(text)``) for the next :func:`load` of ``text``, where no
    entry for it is yet and JSON holds every value as it is; otherwise do nothing."""
    folder = cache_dir()
    if folder is None or not _json_exact(parsed):
        return
    path = _entry(folder, text)
    if os.path.lexists(path):  # another text with the same checksum, or unreadable: left alone
        return
    import json
    import tempfile

    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        from onnx_qrewrite.rewriter.rule_cache_prune import own_folder, prune_once  # after a miss only

        if not own_folder(folder):  # a link, another's folder or one others may write: not ours to write in
            return
        fd, temporary = tempfile.mkstemp(dir=folder, prefix=".entry-", suffix=".tmp")
    except OSError:
        return
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"format": FORMAT, "text": text, "toml": parsed}, f, ensure_ascii=False)
        os.replace(temporary, path)
    except (OSError, ValueError):
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        return
    prune_once(folder, KEEP)


def _limit(text: str) -> int:
    """The largest entry ``text`` can explain: the text itself and its parsed values, each JSON
    escaped (at most 6 bytes a character, ``\\uXXXX``), and the keys around them."""
    return 12 * len(text.encode("utf-8")) + 4096


def _trusted(status: os.stat_result) -> bool:
    """The user's own file, which nobody else may write (always so where there are no uids)."""
    getuid = getattr(os, "getuid", None)
    return getuid is None or (status.st_uid == getuid() and not status.st_mode & 0o022)


def _json_exact(value: Any) -> bool:
    """True when ``json`` gives ``value`` back with the same types and values (no TOML dates)."""
    kind = type(value)
    if kind is dict:
        return all(type(k) is str and _json_exact(v) for k, v in value.items())
    if kind is list:
        return all(_json_exact(v) for v in value)
    return kind in (str, int, float, bool)
