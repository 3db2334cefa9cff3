"""SIGTERM and SIGINT become exceptions, so that every ``finally`` removes its temporaries.

Python turns SIGINT into KeyboardInterrupt already; SIGTERM kills the process outright, leaving
the temporaries of a half-written output behind. :class:`Terminated` is raised for it instead (a
KeyboardInterrupt, so the same handlers apply), and the command line exits 143 (128 + 15) after
removing whatever temporaries are still registered (:func:`outputs.remove_registered_temps`).
"""

from __future__ import annotations

import signal
import threading

__all__ = ["Terminated", "install", "interrupt_exit_code"]


class Terminated(KeyboardInterrupt):
    """SIGTERM received."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


def install() -> None:
    """Raise :class:`Terminated` on SIGTERM (main thread only: where Python runs handlers)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_terminated)


def interrupt_exit_code(exc: BaseException) -> int:
    """143 for SIGTERM, 130 for SIGINT: 128 + the signal number, as shells report them."""
    return 128 + (signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT)
