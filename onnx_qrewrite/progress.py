"""Progress for people, silence for pipes.

Long work (rewriting many thousands of nodes, streaming gigabytes of weights, verifying a model
zoo) shows a bar on stderr when stderr is a terminal, ``-q`` was not given, and the work is still
running after a moment. Library code reports through a plain callable, ``(phase, done, total)``,
and never imports tqdm; only the command line turns it into bars.
"""

from __future__ import annotations

import sys
from typing import Protocol

__all__ = ["DELAY_SECONDS", "ProgressSink", "TerminalProgress"]

#: A bar appears only for work still running after this long.
DELAY_SECONDS = 0.5


class ProgressSink(Protocol):
    """Where library code reports progress: called with a phase name, units done and units in total."""

    def __call__(self, phase: str, done: int, total: int) -> None: ...


class TerminalProgress:
    """A :class:`ProgressSink` drawing one tqdm bar per phase on stderr."""

    def __init__(self, enabled: bool | None = None, *, quiet: bool = False):
        if enabled is None:
            enabled = not quiet and sys.stderr.isatty()
        self.enabled = enabled
        self._bars: dict[str, object] = {}

    def __call__(self, phase: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        from tqdm import tqdm

        bar = self._bars.get(phase)
        if bar is None:
            unit = "B" if phase.endswith("bytes") else "it"
            bar = self._bars[phase] = tqdm(
                total=total,
                desc=phase.removesuffix(" bytes"),
                unit=unit,
                unit_scale=unit == "B",
                file=sys.stderr,
                delay=DELAY_SECONDS,
                leave=False,
                dynamic_ncols=True,
            )
        bar.update(done - bar.n)  # type: ignore[attr-defined]
        if done >= total:
            bar.close()  # type: ignore[attr-defined]
            del self._bars[phase]

    def close(self) -> None:
        for bar in self._bars.values():
            bar.close()  # type: ignore[attr-defined]
        self._bars.clear()
