"""Many models at once: one task per model, in worker processes, one failure never stops the rest.

CI jobs validate model zoos: ``onnx-qrewrite rewrite a.onnx b.onnx ... -o outdir/ --jobs N``. Each
model becomes an :class:`Outcome` (its exit code, what to print, its report); the command exits
with the worst code. Workers are spawned (not forked): onnxruntime and threads do not survive a
fork reliably.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import multiprocessing
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from onnx_qrewrite.errors import EXIT_INTERNAL, QRewriteError

__all__ = ["Outcome", "guarded", "run_tasks"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
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
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=min(jobs, len(args)), mp_context=context) as pool:
        futures = [
            pool.submit(guarded, task, i, label, arg) for i, (arg, label) in enumerate(zip(args, labels, strict=True))
        ]
        for future in concurrent.futures.as_completed(futures):
            try:
                yield future.result()
            except concurrent.futures.process.BrokenProcessPool as exc:  # a worker died (crash, OOM)
                i = futures.index(future)
                yield Outcome(i, labels[i], EXIT_INTERNAL, error=f"worker process died: {exc}")
