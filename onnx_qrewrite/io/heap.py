"""Giving memory the process has freed back to the operating system.

Why: onnx's checker parses a model into its own C++ copy (~80 MB on a 100k-node model) and frees
it when done; glibc keeps such freed memory mapped, and whatever is allocated next (the parsed
model, the engine's indexes) lands among it, so that those pages never go back and the process's
peak RSS is the checker's copy plus everything after it (a 100k-node rewrite kept 8 MB more after
loading, docs/performance.md).
"""

from __future__ import annotations

__all__ = ["return_freed_memory"]


def return_freed_memory() -> None:
    """Hand memory that has been freed back to the operating system (glibc keeps it otherwise).

    A no-op where glibc is absent. ``malloc_trim`` is looked up among the symbols the process has
    loaded (``dlopen(NULL)``), where glibc's are: ``ctypes.util.find_library("c")`` would run
    ``ldconfig -p`` in a subprocess, which cost every ``inspect`` and ``rewrite`` about 0.04 s of CPU.
    """
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)
