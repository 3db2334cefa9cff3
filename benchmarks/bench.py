"""Benchmark onnx-qrewrite against the floor, as whole processes (imports included).

    python benchmarks/bench.py                       # every case, results table on stdout
    python benchmarks/bench.py --cases chain --blocks 5000,20000 --repeat 5
    python benchmarks/bench.py --markdown results.md # also write the table as Markdown

Cases (each a whole process, timed from outside; peak RSS from the kernel's accounting, wait4):

chain-N   rewrite of an N-block DynamicQuantizeLinear -> MatMulInteger chain, against the floor:
          ``onnx.load`` + ``onnx.save`` of the *rewritten* model in a bare Python process.
llm       rewrite of a 32-layer LLM-shaped model with 4 GB of external weights, to another folder
          (weights streamed into a new data file) against the floor of copying the data file alone
          (``cp``); and with ``--reference-external-data`` (zero copy) in the same folder.
verify    ``onnx-qrewrite verify`` of a model against its rewrite, against a bare script that
          creates the same two onnxruntime sessions and runs them on the same inputs.

Medians of ``--repeat`` runs are reported. Models are generated once into ``--work-dir``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.models import make_dql_chain, make_llm  # noqa: E402

PY = sys.executable
CLI = [PY, "-m", "onnx_qrewrite"]


@dataclass
class Sample:
    wall: float
    rss_mb: float


def measure(cmd: list[str], repeat: int) -> Sample:
    """Median wall time and peak RSS of ``cmd`` over ``repeat`` runs (after one warm-up)."""
    walls, rss = [], []
    for i in range(repeat + 1):
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _, status, usage = os.wait4(proc.pid, 0)
        elapsed = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            raise SystemExit(
                f"benchmark command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr.read().decode()}"
            )
        if i:  # the first run warms the page cache
            walls.append(elapsed)
            rss.append(usage.ru_maxrss / 1024)
    return Sample(statistics.median(walls), statistics.median(rss))


@dataclass
class Row:
    case: str
    floor: Sample
    ours: Sample
    note: str = ""

    @property
    def ratio(self) -> float:
        return self.ours.wall / self.floor.wall


def _floor_load_save(model: Path, tmp: Path) -> list[str]:
    code = f"import onnx; m = onnx.load({str(model)!r}); onnx.save(m, {str(tmp / 'floor.onnx')!r})"
    return [PY, "-c", code]


def bench_chain(blocks: int, work: Path, repeat: int) -> Row:
    src = work / f"chain_{blocks}.onnx"
    if not src.exists():
        make_dql_chain(blocks, src)
    out = work / f"chain_{blocks}.portable.onnx"
    ours = measure([*CLI, "-q", "rewrite", str(src), "-o", str(out)], repeat)
    floor = measure(_floor_load_save(out, work), repeat)
    return Row(
        f"chain-{blocks // 1000}k", floor, ours, f"{blocks * 5} nodes in, {ours.wall / blocks * 1e6:.0f} us/block"
    )


def bench_llm(work: Path, repeat: int, weights_gb: float) -> list[Row]:
    src_dir = work / "llm"
    src = src_dir / "model.onnx"
    if not src.exists():
        src_dir.mkdir(parents=True, exist_ok=True)
        make_llm(src, n_layers=32, weights_gb=weights_gb)
    out_dir = work / "llm_out"
    out_dir.mkdir(exist_ok=True)
    copy_floor = measure(["cp", str(src_dir / "model.onnx.data"), str(out_dir / "copy.data")], repeat)
    streamed = measure([*CLI, "-q", "rewrite", str(src), "-o", str(out_dir / "model.onnx")], repeat)
    zero_copy = measure(
        [*CLI, "-q", "rewrite", str(src), "-o", str(src_dir / "model.portable.onnx"), "--reference-external-data"],
        repeat,
    )
    beyond = streamed.wall - copy_floor.wall
    return [
        Row(f"llm-{weights_gb:g}GB streamed", copy_floor, streamed, f"{beyond:.2f} s beyond copying the weights"),
        Row(f"llm-{weights_gb:g}GB zero-copy", Sample(0.0, 0.0), zero_copy, "references the input's data file"),
    ]


def bench_verify(blocks: int, work: Path, repeat: int) -> Row:
    src = work / f"chain_{blocks}.onnx"
    if not src.exists():
        make_dql_chain(blocks, src)
    out = work / f"chain_{blocks}.portable.onnx"
    subprocess.run([*CLI, "-q", "rewrite", str(src), "-o", str(out)], check=True)
    inputs = work / f"chain_{blocks}.inputs.npz"
    subprocess.run([*CLI, "-q", "verify", str(src), str(out), "--save-inputs", str(inputs)], check=True)
    ours = measure([*CLI, "-q", "verify", str(src), str(out), "--inputs", str(inputs)], repeat)
    bare = (
        "import numpy as np, onnxruntime as ort\n"
        "so = ort.SessionOptions(); so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL\n"
        f"feeds = dict(np.load({str(inputs)!r}))\n"
        "names = sorted({k.split('/')[-1] for k in feeds})\n"
        f"for path in ({str(src)!r}, {str(out)!r}):\n"
        "    s = ort.InferenceSession(path, so, providers=['CPUExecutionProvider'])\n"
        "    for k, v in feeds.items(): s.run(None, {s.get_inputs()[0].name: v})\n"
    )
    floor = measure([PY, "-c", bare], repeat)
    return Row(f"verify chain-{blocks // 1000}k", floor, ours, "two ORT sessions + runs on the same inputs")


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import numpy
    import onnx

    return (
        f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, onnx {onnx.__version__}, "
        f"numpy {numpy.__version__}"
    )


def table(rows: list[Row]) -> list[str]:
    lines = ["| case | floor (s) | ours (s) | ratio | peak RSS (MB) | note |", "|---|---|---|---|---|---|"]
    for r in rows:
        floor = f"{r.floor.wall:.2f}" if r.floor.wall else "-"
        ratio = f"{r.ratio:.2f}x" if r.floor.wall else "-"
        lines.append(f"| {r.case} | {floor} | {r.ours.wall:.2f} | {ratio} | {r.ours.rss_mb:.0f} | {r.note} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="chain,llm,verify", help="comma-separated: chain, llm, verify")
    parser.add_argument("--blocks", default="5000,20000,50000,100000", help="chain sizes")
    parser.add_argument("--verify-blocks", type=int, default=5000)
    parser.add_argument("--weights-gb", type=float, default=4.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--work-dir", type=Path, default=None, help="where models are generated (kept)")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the table here")
    args = parser.parse_args(argv)
    work = args.work_dir or Path(tempfile.gettempdir()) / "onnx-qrewrite-bench"
    work.mkdir(parents=True, exist_ok=True)
    cases = {c.strip() for c in args.cases.split(",")}
    rows: list[Row] = []
    if "chain" in cases:
        for blocks in (int(b) for b in args.blocks.split(",")):
            rows.append(bench_chain(blocks, work, args.repeat))
            print("\n".join(table(rows[-1:])[2:]), flush=True)
    if "llm" in cases:
        rows.extend(bench_llm(work, args.repeat, args.weights_gb))
    if "verify" in cases:
        rows.append(bench_verify(args.verify_blocks, work, args.repeat))
    header = f"Machine: {machine()}; medians of {args.repeat} runs after a warm-up."
    out = [header, "", *table(rows)]
    print("\n".join(out))
    if args.markdown:
        args.markdown.write_text("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
