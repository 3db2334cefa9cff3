"""Progress for people, silence for pipes.

Long work (rewriting many thousands of nodes, streaming gigabytes of weights, verifying a model
zoo) shows a bar on stderr when stderr is a terminal, ``-q`` was not given, and the work is still
running after a moment. Library code reports through a plain callable, ``(phase, done, total)``,
and never imports tqdm; only the command line turns it into bars.

Work that cannot count its steps (loading a model, matching the rules, writing the output) is
reported as a *stage*: a phase of one step, ``(phase, 0, 1)`` when it starts and ``(phase, 1, 1)``
when it ends (:func:`stage`). A terminal shows it as the phase name and the time spent so far, so
a big model never leaves the terminal silent for seconds between two counted phases.

The moment is :data:`DELAY_SECONDS`, counted from the start of the command's work, not of each
phase: once a command has run that long, every new phase shows at once (a phase that blocks in C
code, like parsing a large protobuf, could otherwise never show). The environment variable
``ONNX_QREWRITE_PROGRESS_DELAY`` (seconds, >= 0) overrides it; tests set it to 0 so that whether a
bar appears never depends on the machine's speed.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, Protocol

__all__ = ["DELAY_ENV", "DELAY_SECONDS", "ProgressSink", "TerminalProgress", "delay_seconds", "stage"]

#: A bar appears only for work still running after this long (seconds since the work started).
DELAY_SECONDS = 0.5
#: Environment variable that overrides :data:`DELAY_SECONDS` (a number of seconds >= 0).
DELAY_ENV = "ONNX_QREWRITE_PROGRESS_DELAY"
#: How often open bars are redrawn while the work gives no news (their elapsed time moves on).
_TICK_SECONDS = 0.5


class ProgressSink(Protocol):
    """Where library code reports progress: called with a phase name, units done and units in total."""

    def __call__(self, phase: str, done: int, total: int) -> None: ...


def delay_seconds() -> float:
    """:data:`DELAY_SECONDS`, or the value of ``ONNX_QREWRITE_PROGRESS_DELAY`` when it is a number >= 0."""
    raw = os.environ.get(DELAY_ENV)
    if raw is None:
        return DELAY_SECONDS
    try:
        value = float(raw)
    except ValueError:
        return DELAY_SECONDS
    return value if math.isfinite(value) and value >= 0 else DELAY_SECONDS


@contextlib.contextmanager
def stage(progress: ProgressSink | None, phase: str) -> Iterator[None]:
    """Report ``phase`` as a one-step stage around the ``with`` body (nothing when ``progress`` is None)."""
    if progress is None:
        yield
        return
    progress(phase, 0, 1)
    try:
        yield
    finally:
        progress(phase, 1, 1)


class TerminalProgress:
    """A :class:`ProgressSink` drawing one tqdm bar per phase on stderr."""

    def __init__(self, enabled: bool | None = None, *, quiet: bool = False):
        if enabled is None:
            enabled = not quiet and sys.stderr.isatty()
        self.enabled = enabled
        self._bars: dict[str, Any] = {}
        self._started = time.monotonic()
        self._delay = delay_seconds()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def __call__(self, phase: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        with self._lock:
            bar = self._bars.get(phase)
            if bar is None:
                if done >= total:  # a phase that ends as it starts: nothing to show
                    return
                bar = self._bars[phase] = self._new_bar(phase, total)
                self._start_ticker()
            bar.update(done - bar.n)
            if done >= total:
                bar.close()
                del self._bars[phase]

    def _new_bar(self, phase: str, total: int) -> Any:
        from tqdm import tqdm

        remaining = max(0.0, self._delay - (time.monotonic() - self._started))
        unit = "B" if phase.endswith("bytes") else "it"
        options: dict[str, Any] = {
            "total": total,
            "desc": phase.removesuffix(" bytes"),
            "unit": unit,
            "unit_scale": unit == "B",
            "file": sys.stderr,
            "delay": remaining,
            "leave": False,
            "dynamic_ncols": True,
        }
        if total == 1:  # a stage: its name and the time spent, no percentage of one step
            options["bar_format"] = "{desc}... {elapsed}"
        return tqdm(**options)

    def _start_ticker(self) -> None:
        if self._ticker is None:
            self._ticker = threading.Thread(target=self._tick, name="onnx-qrewrite-progress", daemon=True)
            self._ticker.start()

    def _tick(self) -> None:
        """Redraw open bars now and then: a stage gets no updates until it ends."""
        while not self._stop.wait(_TICK_SECONDS):
            with self._lock:
                for bar in self._bars.values():
                    if time.time() >= bar.start_t + bar.delay:
                        bar.refresh()

    def close(self) -> None:
        """Stop redrawing and remove every open bar (the terminal is left as it was)."""
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
            self._ticker = None
        with self._lock:
            for bar in self._bars.values():
                bar.close()
            self._bars.clear()
