"""The command line run in the test's own process, answering as the real program does.

A real process (``python -m onnx_qrewrite``) costs about a second here before the command starts
(the interpreter, numpy, onnx, onnxruntime), and the suite ran some two hundred of them. Tests
about what a command does (its outputs, its exit code, the one line it prints for bad input) run
it with :func:`cli_in_process` instead; tests about the process itself keep a real one: start-up
and lazy imports (tests/test_startup.py), signals and crashes (tests/test_safety_outputs.py), the
console script (tests/test_cli.py), what native code prints on the process's own stderr, and
anything run with another environment.

What the program prints reaches the result as it reaches a real process's pipes: click's output,
the log records (``configure_logging`` would install a stderr handler in a fresh process; the
test process's root logger already has pytest's), warnings, under Python's default filters plus
the project's own (pyproject: a RuntimeWarning from the package is an error), and what native code
(onnxruntime's logger, a runtime's compiler) writes on file descriptors 1 and 2. An exception
that escapes the command line's own handling is raised here, failing the test, where a real
process would have printed a traceback.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

__all__ = ["cli_in_process"]

#: What ``configure_logging`` (cli/options.py) gives logging.basicConfig in a fresh process.
_LOG_FORMAT = "onnx-qrewrite: %(levelname)s: %(message)s"


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is when a record is logged (click's runner swaps it)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def _default_warning_filters() -> None:
    """Python's filters in a process started without -W, and the project's error filter."""
    warnings.resetwarnings()
    warnings.simplefilter("default")
    for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
        warnings.simplefilter("ignore", category)
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
    warnings.filterwarnings("error", category=RuntimeWarning, module="onnx_qrewrite")


def cli_in_process(*args: object, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``python -m onnx_qrewrite ARGS`` in this process: its exit code, stdout and stderr."""
    from click.testing import CliRunner

    from onnx_qrewrite.cli import main

    words = [str(a) for a in args]
    root = logging.getLogger()
    level = root.level
    handler = logging.StreamHandler(_CurrentStderr())  # type: ignore[arg-type]
    handler.setFormatter(logging.Formatter(_LOG_FORMAT))
    root.addHandler(handler)
    try:
        with (
            contextlib.chdir(cwd or os.getcwd()),
            _native(1) as native_out,
            _native(2) as native_err,
            warnings.catch_warnings(record=True) as caught,
        ):
            _default_warning_filters()
            result = CliRunner().invoke(main, words, prog_name="onnx-qrewrite")
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    shown = "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line) for w in caught)
    return subprocess.CompletedProcess(
        ["onnx-qrewrite", *words],
        result.exit_code,
        result.stdout + native_out.read(),
        result.stderr + native_err.read() + shown,
    )


class _Captured:
    """What was written on a file descriptor while :func:`_native` held it."""

    def __init__(self) -> None:
        self.text = ""

    def read(self) -> str:
        return self.text


@contextlib.contextmanager
def _native(fd: int) -> Iterator[_Captured]:
    """File descriptor ``fd`` pointed at a temporary file inside the block, as a process's pipe
    would take what native code writes there; given back (to pytest's capture) after."""
    captured = _Captured()
    saved = os.dup(fd)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), fd)
        try:
            yield captured
        finally:
            os.dup2(saved, fd)
            os.close(saved)
            sink.seek(0)
            captured.text = sink.read().decode(errors="replace")
