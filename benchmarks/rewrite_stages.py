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
Beside each stage, the process's peak RSS when it ended (``ru_maxrss``): which stage sets the peak.
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
from onnx_qrewrite.rewriter import engine, graph  # noqa: E402
from onnx_qrewrite.rewriter.builders import dynamic_quantize, integer_matmul  # noqa: E402, F401

_T2 = time.process_time()


#: Per stage, the process's peak RSS in MB when the stage last ended.
_PEAKS: dict[str, float] = {}


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KB on Linux


def _timed(into: dict[str, float], name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.process_time()
        try:
            return func(*args, **kwargs)
        finally:
            into[name] = into.get(name, 0.0) + time.process_time() - start
            _PEAKS[name] = _peak_mb()

    return wrapper


def main(path: str) -> None:
    times: dict[str, float] = {"import onnx": _T1 - _T0, "import onnx_qrewrite": _T2 - _T1}
    data, _ = read_once(Path(path))
    _timed(times, "check input (onnx checker)", model_io.check_serialized)(data, what=path)
    proto = _timed(times, "parse input", model_io.parse_model)(data, path)
    del data
    catalogue = _timed(times, "load rules", api._catalogue)(None, None, None, None)
    # The engine's stages, timed where the engine calls them.
    engine.iter_scopes = _timed(times, "  walk (ops, producers, names)", graph.iter_scopes)
    engine._match = _timed(times, "  match (walk included)", engine._match)
    engine._apply = _timed(times, "  build and splice", engine._apply)
    rewritten, report = _timed(times, "engine", engine.run)(proto, catalogue, engine.EngineOptions(), None, None)
    with tempfile.TemporaryDirectory() as folder:
        result = api.RewriteResult(rewritten, report)
        _timed(times, "save", result.save)(Path(folder) / "out.onnx")
    total = time.process_time() - _T0
    for name, seconds in times.items():
        peak = f"  peak RSS {_PEAKS[name]:6.1f} MB" if name in _PEAKS else ""
        print(f"{name:32s} {seconds:7.3f} s  {100 * seconds / total:5.1f}%{peak}")
    print(f"{'total':32s} {total:7.3f} s  peak RSS {_peak_mb():6.1f} MB")


if __name__ == "__main__":
    main(sys.argv[1])
