"""Keeps the rule cache's folder (rule_cache.py) to its newest entries: imported only by a command
that has just written an entry, so that a command finding every entry (every start after the
first) loads none of this.

A command that writes an entry removes, once, all but the ``keep`` written last, whatever their
format (an older layout's too), and temporary files a killed writer left over an hour ago. Several
processes may prune one folder at once: a file another removed meanwhile, or one that cannot be
removed, is passed over, and nothing here raises; an entry removed while another process uses it
only costs that process a parse (a file already open stays readable).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

__all__ = ["prune", "prune_once"]

_STALE_SECONDS = 3600  # a temporary file older than this is a killed writer's, not one in progress

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
    entries: list[tuple[float, str]] = []
    stale = time.time() - _STALE_SECONDS
    try:
        with os.scandir(folder) as found:
            for item in found:
                with contextlib.suppress(OSError):
                    if item.name.startswith(".entry-") and item.name.endswith(".tmp"):
                        if item.stat(follow_symlinks=False).st_mtime < stale:
                            os.unlink(item.path)
                    elif item.name.endswith(".json") and not item.name.startswith("."):
                        entries.append((item.stat(follow_symlinks=False).st_mtime, item.path))
    except OSError:
        return
    entries.sort(reverse=True)
    for _, path in entries[keep:]:
        with contextlib.suppress(OSError):
            os.unlink(path)
