"""SIGTERM and SIGINT become exceptions, so that every ``finally`` removes its temporaries.

Python turns SIGINT into KeyboardInterrupt already; SIGTERM kills the process outright, leaving
the temporaries of a half-written output behind. :class:`Terminated` is raised for it instead (a
KeyboardInterrupt, so the same handlers apply), and the command line exits 143 (128 + 15) after
removing whatever temporaries are still registered (:func:`outputs.remove_registered_temps`).

A crash in native code (exit -11) says nothing by itself: :func:`install` also turns on
:mod:`faulthandler`, so such a death leaves the Python stack on stderr for the bug report (it stays on until the
process ends: a crash while the interpreter shuts down is one too). :func:`uninstall` gives the
SIGTERM handler back when the command returns, so a process that runs the command line in-process
(a test, a notebook) is not left raising Terminated on SIGTERM.
"""

from __future__ import annotations

import contextlib
import faulthandler
import signal
import threading
from typing import Any

__all__ = ["Terminated", "install", "interrupt_exit_code", "uninstall"]

_saved: list[Any] = []  # the SIGTERM handler each install replaced


class Terminated(KeyboardInterrupt):
    """SIGTERM received."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


def install() -> None:
    """Raise :class:`Terminated` on SIGTERM (main thread only: where Python runs handlers), and
    dump the Python stack on a native crash."""
    if threading.current_thread() is threading.main_thread():
        _saved.append(signal.signal(signal.SIGTERM, _raise_terminated))
        # stderr None or not a file (captured by an in-process caller): no dump, nothing else lost
        with contextlib.suppress(RuntimeError, ValueError, OSError):
            faulthandler.enable()


def uninstall() -> None:
    """Give back what :func:`install` replaced (no-op when it did not run)."""
    if _saved and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _saved.pop())


def interrupt_exit_code(exc: BaseException) -> int:
    """143 for SIGTERM, 130 for SIGINT: 128 + the signal number, as shells report them."""
    return 128 + (signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT)
