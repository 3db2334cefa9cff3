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

An interrupt must not land inside a native extension module's initialisation: onnx's C++ module
calls back into Python while it initialises, a KeyboardInterrupt raised there is not checked, and
the process dies with SIGSEGV (measured: 1 run in 150 with SIGINT at random delays into
``rewrite`` of the sample model, stack in ``onnx/__init__.py`` creating ``onnx_cpp2py_export``).
While installed, extension modules initialise with SIGINT and SIGTERM held (blocked for the
thread): a signal that arrives then is delivered the moment the module is ready, and becomes the
usual exit 130/143.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib.machinery
import signal
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["Terminated", "held", "install", "interrupt_exit_code", "uninstall"]

_saved: list[Any] = []  # the SIGTERM handler each install replaced
_HELD = frozenset({signal.SIGINT, signal.SIGTERM})
_Loader = importlib.machinery.ExtensionFileLoader
_unheld = (_Loader.create_module, _Loader.exec_module)  # the loader's own methods


class Terminated(KeyboardInterrupt):
    """SIGTERM received."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


@contextlib.contextmanager
def held() -> Iterator[None]:
    """SIGINT and SIGTERM blocked for this thread inside the block, delivered when it ends."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _create_module_held(self: Any, spec: Any) -> Any:
    with held():
        return _unheld[0](self, spec)


def _exec_module_held(self: Any, module: Any) -> None:
    with held():
        _unheld[1](self, module)


def install() -> None:
    """Raise :class:`Terminated` on SIGTERM (main thread only: where Python runs handlers), hold
    interrupts while extension modules initialise, and dump the Python stack on a native crash."""
    if threading.current_thread() is threading.main_thread():
        _saved.append(signal.signal(signal.SIGTERM, _raise_terminated))
        _Loader.create_module = _create_module_held  # type: ignore[method-assign]
        _Loader.exec_module = _exec_module_held  # type: ignore[method-assign]
        # stderr None or not a file (captured by an in-process caller): no dump, nothing else lost
        with contextlib.suppress(RuntimeError, ValueError, OSError):
            faulthandler.enable()


def uninstall() -> None:
    """Give back what :func:`install` replaced (no-op when it did not run)."""
    if _saved and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _saved.pop())
        if not _saved:
            _Loader.create_module, _Loader.exec_module = _unheld  # type: ignore[method-assign]


def interrupt_exit_code(exc: BaseException) -> int:
    """143 for SIGTERM, 130 for SIGINT: 128 + the signal number, as shells report them."""
    return 128 + (signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT)
