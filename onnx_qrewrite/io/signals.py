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

An interruption is raised once. The first SIGINT or SIGTERM while installed raises; later ones,
and any after :func:`settle` (the command line calls it once the command's outcome is decided),
are ignored: the cleanup an interruption starts, and the exit with a decided code, are not
interrupted again. Before, a signal landing as the command line called ``sys.exit`` (or a second
one while it removed temporaries) escaped every handler as a traceback, or, once the handler was
given back, killed the process (-15) instead of its exit code.

Imports are not interrupted either. A KeyboardInterrupt raised in the middle of a module's body
leaves it half made, and a half-made module breaks what reads it: measured with SIGINT at random
delays into ``rewrite`` of the sample model, 1 run in 200 ended "internal error: RuntimeError:
Error calling __set_name__" (exit 5: Python 3.11 wraps the interrupt when it lands in a dataclass
being made), and 1 in 150 died with SIGSEGV in ``onnx/__init__.py`` creating its C++ module. While
installed, a module's body runs (and an extension module initialises) with SIGINT and SIGTERM held,
blocked for the thread: a signal arriving then is delivered as soon as the outermost import is
complete, and becomes the usual exit 130/143. Holding costs two system calls per outermost module
loaded (the modules its body imports run inside its hold).
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib.machinery
import signal
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["Terminated", "held", "install", "interrupt_exit_code", "settle", "uninstall"]

_saved: list[tuple[Any, Any]] = []  # the SIGTERM and SIGINT handlers each install replaced (None: kept)
#: Whether a signal may still raise: False once one has, or once the outcome is decided (settle).
_armed = [False]
_HELD = frozenset({signal.SIGINT, signal.SIGTERM})
#: The loader methods that run a module's code, each wrapped while installed.
_LOADING = (
    (importlib.machinery.ExtensionFileLoader, "create_module"),
    (importlib.machinery.ExtensionFileLoader, "exec_module"),
    (importlib.machinery.SourceFileLoader, "exec_module"),
    (importlib.machinery.SourcelessFileLoader, "exec_module"),
)
_unheld: list[tuple[type, str, Any]] = []  # what install replaced: (class, name, its own attribute or None)


class Terminated(KeyboardInterrupt):
    """SIGTERM received."""


def _raise_once(signum: int, frame: Any) -> None:
    """SIGTERM: Terminated; SIGINT: KeyboardInterrupt; only the first, and only before :func:`settle`."""
    if not _armed[0]:
        return
    _armed[0] = False  # before raising: a signal landing while this one unwinds is not raised
    raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def settle() -> None:
    """The outcome is decided (an exit code, or the interruption being handled): from here SIGINT
    and SIGTERM are ignored until :func:`uninstall`, so nothing interrupts the exit."""
    _armed[0] = False


#: Per thread, whether :func:`held` (or a module load it wraps) is already blocking the signals:
#: the loads nested in one (a module's imports) then run without two more system calls each, and
#: without ``signal.pthread_sigmask`` making an enum of every signal in the masks it returns
#: (a module load held was ~4 such conversions; an ``inspect`` loads ~270 modules).
_holding_now = threading.local()


@contextlib.contextmanager
def held() -> Iterator[None]:
    """SIGINT and SIGTERM blocked for this thread inside the block, delivered when the outermost
    such block ends."""
    if getattr(_holding_now, "on", False):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
    _holding_now.on = True
    try:
        yield
    finally:
        _holding_now.on = False
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _holding(method: Any) -> Any:
    def run_held(self: Any, arg: Any) -> Any:
        if getattr(_holding_now, "on", False):  # an outer load holds them: as held() does, inline
            return method(self, arg)
        with held():
            return method(self, arg)

    return run_held


def _hold_imports() -> None:
    for cls, name in _LOADING:
        _unheld.append((cls, name, cls.__dict__.get(name)))
        setattr(cls, name, _holding(getattr(cls, name)))


def _release_imports() -> None:
    while _unheld:
        cls, name, own = _unheld.pop()
        if own is None:  # inherited: uncover the base class's method again
            delattr(cls, name)
        else:
            setattr(cls, name, own)


def install() -> None:
    """Raise :class:`Terminated` on SIGTERM and KeyboardInterrupt on SIGINT, once (main thread
    only: where Python runs handlers), hold interrupts while modules load, and dump the Python
    stack on a native crash."""
    if threading.current_thread() is threading.main_thread():
        term = signal.signal(signal.SIGTERM, _raise_once)
        # SIGINT as Python's own handler raises it (a worker's SIG_IGN, a caller's own handler: kept).
        own_int = signal.getsignal(signal.SIGINT) is signal.default_int_handler
        _saved.append((term, signal.signal(signal.SIGINT, _raise_once) if own_int else None))
        _armed[0] = True
        if not _unheld:
            _hold_imports()
        # stderr None or not a file (captured by an in-process caller): no dump, nothing else lost
        with contextlib.suppress(RuntimeError, ValueError, OSError):
            faulthandler.enable()


def uninstall() -> None:
    """Give back what :func:`install` replaced (no-op when it did not run)."""
    if _saved and threading.current_thread() is threading.main_thread():
        term, sigint = _saved.pop()
        signal.signal(signal.SIGTERM, term)
        if sigint is not None:
            signal.signal(signal.SIGINT, sigint)
        if not _saved:
            _release_imports()


def interrupt_exit_code(exc: BaseException) -> int:
    """143 for SIGTERM, 130 for SIGINT: 128 + the signal number, as shells report them."""
    return 128 + (signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT)
