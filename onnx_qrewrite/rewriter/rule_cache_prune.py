"""Keeps the rule cache's folder (rule_cache.py) to its newest entries: imported only by a command
that has just written an entry, so that a command finding every entry (every start after the
first) loads none of this.

A command that writes an entry removes, once, all but the ``keep`` written last, whatever their
format (an older layout's too), and temporary files a killed writer left over an hour ago. Several
processes may prune one folder at once: a file another removed meanwhile, or one that cannot be
removed, is passed over, and nothing here raises; an entry removed while another process uses it
only costs that process a parse (a file already open stays readable).

Only what the cache itself writes is ever removed: names of an entry (``v2-<16 hex>-<n>.json``,
format 1's ``<16 hex>-<n>.json``) or of a temporary file (``.entry-*.tmp``), each a regular file
of the user's, in a folder that is a real directory (not a link) of the user's that nobody else
may write; anything else in the folder, or any other folder, is left alone.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import time
from pathlib import Path

__all__ = ["prune", "prune_once"]

_STALE_SECONDS = 3600  # a temporary file older than this is a killed writer's, not one in progress

_ENTRY = re.compile(r"(?:v[0-9]+-)?[0-9a-f]{16}-[0-9]+\.json")
_TEMPORARY = re.compile(r"\.entry-[^/]*\.tmp")

_pruned: set[Path] = set()  # the folders this process has pruned (once is enough)


def prune_once(folder: Path, keep: int) -> None:
    """:func:`prune` ``folder`` the first time this process wrote an entry there."""
    if folder not in _pruned:
        _pruned.add(folder)
        prune(folder, keep)


def prune(folder: Path, keep: int) -> None:
    """Remove all but the ``keep`` entries written last in ``folder`` (any format), and temporary
    files older than an hour. Never raises: a file another process removed or replaced meanwhile,
    or one that cannot be removed, is passed over (see the module docstring)."""
    if not own_folder(folder):
        return
    entries: list[tuple[float, str]] = []
    stale = time.time() - _STALE_SECONDS
    try:
        with os.scandir(folder) as found:
            for item in found:
                with contextlib.suppress(OSError):
                    entry = _ENTRY.fullmatch(item.name)
                    if not (entry or _TEMPORARY.fullmatch(item.name)):
                        continue
                    status = item.stat(follow_symlinks=False)
                    if not (stat.S_ISREG(status.st_mode) and _owned(status)):
                        continue
                    if entry:
                        entries.append((status.st_mtime, item.path))
                    elif status.st_mtime < stale:
                        os.unlink(item.path)
    except OSError:
        return
    entries.sort(reverse=True)
    for _, path in entries[keep:]:
        with contextlib.suppress(OSError):
            os.unlink(path)


def own_folder(folder: Path) -> bool:
    """True when ``folder`` is a real directory (not a link to one) of the user's that nobody else
    may write: the only kind the cache writes in or removes from."""
    try:
        status = os.lstat(folder)
    except OSError:
        return False
    return stat.S_ISDIR(status.st_mode) and _owned(status) and not status.st_mode & 0o022


def _owned(status: os.stat_result) -> bool:
    getuid = getattr(os, "getuid", None)
    return getuid is None or status.st_uid == getuid()
