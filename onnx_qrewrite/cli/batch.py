"""Many models at once: one task per model, in worker processes, one failure never stops the rest.

CI jobs validate model zoos: ``onnx-qrewrite rewrite a.onnx b.onnx ... -o outdir/ --jobs N``. Each
model becomes an :class:`Outcome` (its exit code, what to print, its report); the command exits
with the worst code.

Workers are spawned (not forked: onnxruntime and threads do not survive a fork reliably) and kept
by this module rather than by ``concurrent.futures``: when one process of a ProcessPoolExecutor
dies (SIGKILL, the OOM killer, a segfault in a C++ library), the executor marks the whole pool
broken and fails every pending model. Here the parent knows which model each worker holds: a
dead worker fails only that model, with how it died, and a fresh worker takes the next one.

Signals: workers ignore SIGINT (a terminal's Ctrl-C reaches the whole process group; the parent
decides) and turn SIGTERM into :class:`~onnx_qrewrite.io.signals.Terminated`, so that their
``finally`` blocks remove temporaries; on Linux they also get SIGTERM when the parent dies. When
the parent is interrupted it sends SIGTERM to its workers, waits for them briefly (SIGKILL
after 10 s) and starts nothing more.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from onnx_qrewrite._dataclass import dataclass
from onnx_qrewrite.errors import EXIT_INTERNAL, QRewriteError

__all__ = ["Outcome", "guarded", "how_it_died", "run_tasks"]

logger = logging.getLogger(__name__)

#: Seconds workers get to remove their temporaries after SIGTERM before they are killed.
_STOP_GRACE = 10.0


@dataclass
class Outcome:
    """What one model's task produced."""

    index: int
    label: str
    exit_code: int = 0
    lines: list[str] = dataclasses.field(default_factory=list)
    error: str | None = None
    payload: dict[str, Any] = dataclasses.field(default_factory=dict)


def guarded(task: Callable[[Any], Outcome], index: int, label: str, arg: Any) -> Outcome:
    """Run ``task`` turning every failure into an outcome (never an exception across processes)."""
    try:
        outcome = task(arg)
    except QRewriteError as exc:
        return Outcome(index, label, exc.exit_code, error=str(exc))
    except Exception as exc:
        logger.debug("internal error on %s", label, exc_info=True)
        return Outcome(
            index, label, EXIT_INTERNAL, error=f"internal error: {type(exc).__name__}: {exc} (a bug; please report it)"
        )
    outcome.index, outcome.label = index, label
    return outcome


def how_it_died(exitcode: int | None) -> str:
    """``killed by signal 9 (SIGKILL)``, ``exited with status 3``: a worker's end, for messages."""
    if exitcode is None:
        return "stopped responding"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "unknown signal"
        hint = "; out of memory?" if -exitcode == signal.SIGKILL else ""
        return f"killed by signal {-exitcode} ({name}{hint})"
    return f"exited with status {exitcode}"


def run_tasks(
    task: Callable[[Any], Outcome],
    args: Sequence[Any],
    labels: Sequence[str],
    jobs: int = 1,
) -> Iterator[Outcome]:
    """Outcomes as they complete; ``task`` must be a module-level function (it is pickled)."""
    if jobs <= 1 or len(args) <= 1:
        for i, (arg, label) in enumerate(zip(args, labels, strict=True)):
            yield guarded(task, i, label, arg)
        return
    yield from _Workers(task, min(jobs, len(args))).run(args, labels)


def _die_with_parent(parent: int) -> None:
    """Linux: SIGTERM when the parent dies (a SIGKILLed parent cannot stop its workers)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):  # pragma: no cover
            pass
    if os.getppid() != parent:  # the parent died before prctl: nobody waits for us
        os._exit(143)


def _worker_main(conn: multiprocessing.connection.Connection, task: Callable[[Any], Outcome], parent: int) -> None:
    """A worker: run the tasks the parent sends, one at a time, until told to stop."""
    from onnx_qrewrite.io import outputs, signals

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signals.install()
    _die_with_parent(parent)
    try:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            if message is None:
                break
            index, label, arg = message
            conn.send(guarded(task, index, label, arg))
    except KeyboardInterrupt:  # signals.Terminated: the parent is stopping us
        outputs.remove_registered_temps()
        os._exit(143)
    # Every task answered: the outcome is decided. A SIGTERM from here (the parent stopping while
    # this worker exits) would interrupt the exit's own clean-up (the TFLite child's folder, in an
    # atexit callback) and print its traceback; it is ignored, as the CLI's own exit does.
    signals.settle()


@dataclass
class _Worker:
    process: Any
    conn: multiprocessing.connection.Connection
    job: tuple[int, str] | None = None


class _Workers:
    def __init__(self, task: Callable[[Any], Outcome], size: int):
        self.task = task
        self.size = size
        self.context = multiprocessing.get_context("spawn")
        self.workers: list[_Worker] = []

    def _start(self) -> _Worker:
        parent_end, child_end = self.context.Pipe()
        process = self.context.Process(
            target=_worker_main, args=(child_end, self.task, os.getpid()), daemon=True, name="onnx-qrewrite-worker"
        )
        process.start()
        child_end.close()
        worker = _Worker(process, parent_end)
        self.workers.append(worker)
        return worker

    def run(self, args: Sequence[Any], labels: Sequence[str]) -> Iterator[Outcome]:
        pending = collections.deque(enumerate(zip(args, labels, strict=True)))
        finished = False
        try:
            while pending or any(w.job for w in self.workers):
                for worker in [w for w in self.workers if w.job is None]:
                    if not pending:
                        break
                    self._assign(worker, pending.popleft())
                while pending and len(self.workers) < self.size:
                    self._assign(self._start(), pending.popleft())
                busy = [w for w in self.workers if w.job is not None]
                ready = multiprocessing.connection.wait([w.conn for w in busy] + [w.process.sentinel for w in busy])
                for worker in busy:
                    outcome = self._collect(worker, ready)
                    if outcome is not None:
                        yield outcome
            finished = True
        finally:
            self._stop(graceful=finished)

    def _assign(self, worker: _Worker, job: tuple[int, tuple[Any, str]]) -> None:
        index, (arg, label) = job
        worker.job = (index, label)
        worker.conn.send((index, label, arg))

    def _collect(self, worker: _Worker, ready: list[Any]) -> Outcome | None:
        assert worker.job is not None
        index, label = worker.job
        if worker.conn in ready:
            try:
                outcome = worker.conn.recv()
            except (EOFError, OSError):
                outcome = None
            if outcome is not None:
                worker.job = None
                return outcome
        elif worker.process.sentinel not in ready:
            return None
        # The worker died holding this model: fail it alone, and replace the worker later.
        worker.process.join(5)
        worker.conn.close()
        self.workers.remove(worker)
        how = how_it_died(worker.process.exitcode)
        return Outcome(index, label, EXIT_INTERNAL, error=f"the worker process for this model {how}")

    def _stop(self, *, graceful: bool) -> None:
        for worker in self.workers:
            if graceful:
                with contextlib.suppress(OSError):
                    worker.conn.send(None)
            elif worker.process.is_alive():
                worker.process.terminate()  # SIGTERM: the worker removes its temporaries
        for worker in self.workers:
            worker.process.join(_STOP_GRACE)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
            worker.conn.close()
        self.workers.clear()
