"""CPU time of each stage of one rewrite, in one process: where a node-heavy rewrite spends it.

    python benchmarks/rewrite_stages.py /tmp/onnx-qrewrite-bench/chain_20000.onnx

bench.py's chain case times the whole command against ``onnx.load`` + ``onnx.save`` of the input;
this splits our side into the stages the command goes through, as process time (user + system of
this process: what other jobs on a shared machine barely move): importing onnx (and numpy, which
it imports), importing the package's modules a rewrite uses, onnx's checker on the input's bytes,
parsing them, loading the rule catalogue, the engine's walk of the scopes (ops, producer index,
names), matching (the rules' checks; the walk included), building (stamps, builds, spooling),
and saving. Stages a plain ``rewrite`` runs that are not listed (the command line, the report)
are the difference between the total and their sum. The output is written to a temporary folder.
Beside each stage, the process's peak RSS when it ended (``ru_maxrss``), and the stage's own peak:
the highest RSS while it ran (Linux: the high-water mark is reset as the stage starts, by writing
5 to ``/proc/self/clear_refs``, and read from ``VmHWM`` as it ends). The first says which stage
sets the process's peak; the second what each stage would peak at if an earlier one peaked lower.
"""

from __future__ import annotations

import resource
import sys
import time

_T0 = time.process_time()
import onnx  # noqa: E402, F401 - timed: what importing it costs

_T1 = time.process_time()
import tempfile  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from onnx_qrewrite import api  # noqa: E402
from onnx_qrewrite.io import model_io  # noqa: E402
from onnx_qrewrite.io.model_file import read_once  # noqa: E402
from onnx_qrewrite.rewriter import engine, graph, matching  # noqa: E402
from onnx_qrewrite.rewriter.builders import dynamic_quantize, integer_matmul  # noqa: E402, F401

_T2 = time.process_time()


#: Per stage, the process's peak RSS in MB when the stage last ended.
_PEAKS: dict[str, float] = {}


#: The process's peak RSS in MB so far, over the stages' own peaks: the kernel's ``ru_maxrss``
#: is the same high-water mark, so it restarts with each stage's reset (see :func:`_timed`).
_PROCESS_PEAK = [0.0]


def _peak_mb() -> float:
    """The process's peak RSS so far (``ru_maxrss`` where no stage reset the mark)."""
    return max(_PROCESS_PEAK[0], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)  # KB on Linux


#: Per stage, the highest RSS in MB while it last ran (None where Linux's reset is unavailable).
_OWN_PEAKS: dict[str, float | None] = {}
#: The stages running, outermost first, each with the highest RSS seen so far while it runs.
_RUNNING: list[list[Any]] = []


def _reset_high_water() -> bool:
    """Fold the high-water mark so far into every running stage's, then reset it."""
    try:
        seen = _high_water_mb()
        for entry in _RUNNING:
            entry[1] = max(entry[1], seen)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _high_water_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def _timed(into: dict[str, float], name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # A stage inside another resets the mark too: what the outer one saw before is folded
        # into its running highest first (_reset_high_water), so each stage's own peak is whole.
        reset = _reset_high_water()
        _RUNNING.append([name, 0.0])
        start = time.process_time()
        try:
            return func(*args, **kwargs)
        finally:
            into[name] = into.get(name, 0.0) + time.process_time() - start
            _, highest = _RUNNING.pop()
            own = max(highest, _high_water_mb()) if reset else None
            _OWN_PEAKS[name] = own
            _PROCESS_PEAK[0] = max(_PROCESS_PEAK[0], own or 0.0)
            _PEAKS[name] = _peak_mb()
            for entry in _RUNNING:  # what this stage peaked at, its outer stages saw too
                entry[1] = max(entry[1], own or 0.0)

    return wrapper


def main(path: str) -> None:
    times: dict[str, float] = {"import onnx": _T1 - _T0, "import onnx_qrewrite": _T2 - _T1}
    data, _ = read_once(Path(path))
    _timed(times, "check input (onnx checker)", model_io.check_serialized)(data, what=path)
    proto = _timed(times, "parse input", model_io.parse_model)(data, path)
    del data
    catalogue = _timed(times, "load rules", api._catalogue)(None, None, None, None)
    # The engine's stages, timed where the engine calls them (the walk where matching calls it).
    matching.iter_scopes = _timed(times, "  walk (ops, producers, names)", graph.iter_scopes)
    engine.match_nodes = _timed(times, "  match (walk included)", engine.match_nodes)
    engine.apply_matches = _timed(times, "  build and splice", engine.apply_matches)
    rewritten, report = _timed(times, "engine", engine.run)(proto, catalogue, engine.EngineOptions(), None, None)
    with tempfile.TemporaryDirectory() as folder:
        result = api.RewriteResult(rewritten, report)
        _timed(times, "save", result.save)(Path(folder) / "out.onnx")
    total = time.process_time() - _T0
    for name, seconds in times.items():
        own = _OWN_PEAKS.get(name)
        peak = f"  peak RSS {_PEAKS[name]:6.1f} MB" if name in _PEAKS else ""
        peak += f", its own {own:6.1f} MB" if own is not None else ""
        print(f"{name:32s} {seconds:7.3f} s  {100 * seconds / total:5.1f}%{peak}")
    print(f"{'total':32s} {total:7.3f} s  peak RSS {_peak_mb():6.1f} MB")


if __name__ == "__main__":
    main(sys.argv[1])
