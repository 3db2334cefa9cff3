"""Small versions of the scale cases (the timings live in benchmarks/bench.py, not here):
weights in external data are never materialised, whether copied or referenced."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import REPO, run

sys.path.insert(0, str(REPO))
from benchmarks.models import make_llm

WEIGHTS_GB = 0.4  # 400 MB of weights: far above what the rewrite may hold in memory


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llm") / "model.onnx"
    make_llm(path, n_layers=4, weights_gb=WEIGHTS_GB)
    return path


# The child reports its own peak (VmHWM, reset at exec). Not wait4's ru_maxrss: Linux carries the
# forking parent's high-water mark through fork and exec, and this pytest process may be large.
# Printed by an atexit handler: ``python -m onnx_qrewrite`` ends the process itself (cli.console).
_MEASURED = """
import atexit, runpy, sys
def peak():
    peak = next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM"))
    print(f"VmHWM {peak}", file=sys.stderr)
atexit.register(peak)
sys.argv = ["onnx-qrewrite", *sys.argv[1:]]
runpy.run_module("onnx_qrewrite", run_name="__main__")
"""


def _peak_rss_mb(args: list[str]) -> tuple[int, float, str]:
    proc = subprocess.run([sys.executable, "-c", _MEASURED, *args], capture_output=True, text=True, timeout=300)
    lines = proc.stderr.splitlines()
    peak_kb = next(int(line.split()[1]) for line in lines if line.startswith("VmHWM"))
    return proc.returncode, peak_kb / 1024, "\n".join(line for line in lines if not line.startswith("VmHWM"))


def test_streamed_output_copies_weights_with_bounded_memory(llm, tmp_path):
    data_mb = os.path.getsize(llm.with_name("model.onnx.data")) / 2**20
    assert data_mb > 350
    out = tmp_path / "portable.onnx"
    code, rss, err = _peak_rss_mb(["-q", "rewrite", str(llm), "-o", str(out)])
    assert code == 0, err
    # The process (Python, onnx, numpy) needs ~60-70 MB; the weights would add 400 MB.
    assert rss < 200, f"peak RSS {rss:.0f} MB while rewriting a model with {data_mb:.0f} MB of weights"
    assert os.path.getsize(tmp_path / "portable.onnx.data") >= data_mb * 2**20
    onnx.checker.check_model(str(out))
    name, hidden = _input(llm)
    feeds = {name: np.random.default_rng(0).standard_normal((1, 4, hidden)).astype(np.float32)}
    want, got = run(llm, feeds), run(out, feeds)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])


def test_zero_copy_output_references_the_weights_in_place(llm):
    out = llm.with_name("portable.onnx")
    code, rss, err = _peak_rss_mb(["-q", "rewrite", str(llm), "-o", str(out), "--reference-external-data"])
    assert code == 0, err
    assert rss < 200
    assert not out.with_name("portable.onnx.data").exists()
    locations = {
        e.value
        for t in onnx.load(out, load_external_data=False).graph.initializer
        for e in t.external_data
        if e.key == "location"
    }
    assert locations == {"model.onnx.data"}


def _input(path: Path) -> tuple[str, int]:
    (value,) = onnx.load(path, load_external_data=False).graph.input
    return value.name, value.type.tensor_type.shape.dim[-1].dim_value
