"""Benchmark onnx-qrewrite against the floor, as whole processes (imports included).

    python benchmarks/bench.py                       # every case, results table on stdout
    python benchmarks/bench.py --cases chain --blocks 5000,20000 --repeat 5
    python benchmarks/bench.py --markdown results.md # also write the table as Markdown

Cases (each a whole process, timed from outside; peak RSS from the kernel's accounting, wait4):

chain-N   rewrite of an N-block DynamicQuantizeLinear -> MatMulInteger chain (5N nodes), against the
          floor of ``onnx.load`` + ``onnx.save`` of the *input* in a bare Python process; the note
          gives the output's size over the input's, peak RSS over the output file's size, the
          rewrite over a load + save of its own *output*, the ratio of CPU time (user + system,
          which other jobs on a shared machine barely move, unlike wall time) and the cost per
          node. The three commands run interleaved, round after round.
llm       rewrite of a 32-layer LLM-shaped model with 4 GB of external weights, to another folder
          (weights streamed into a new data file) against the floor of copying the data file alone
          (``cp``); and with ``--reference-external-data`` (zero copy) in the same folder.
verify    ``onnx-qrewrite verify`` of a model against its rewrite (the chain, the BERT-like
          encoder, and LLM-sized 4-bit MatMulNBits layers, K = N = 2048, 8 tokens, whose bounded
          rewrite verify checks per element and through its identity probe) on saved inputs
          (``--inputs``), against a bare script that creates the same two onnxruntime sessions
          (verify's default settings) and runs both on the same samples.
infer     onnxruntime latency of the rewritten model over the original's (a BERT-like encoder and a
          CNN, made by onnxruntime.quantization.quantize_dynamic; default session options, i.e.
          graph optimisation on, one intra-op thread), interleaved runs in one child process; the
          note lists what onnxruntime's optimiser fused in each.
startup   ``onnx-qrewrite --help``, ``rules`` and ``inspect`` of a small model, against
          ``polygraphy --help`` (when polygraphy is installed: ``pip install polygraphy``).

The verify and startup cases add reference rows: the bare-sessions floor with ``import onnx``
added, and ``python -c "import onnx"`` against ``polygraphy --help`` (what ``import onnx`` would
cost before any work: the console script's ``inspect`` of a plain model and ``verify`` do without
it, ``onnx_qrewrite/_onnx.py``); and ``verify`` and ``inspect`` run through
``cli.main`` as an in-process caller runs them, without the console script's garbage-collector
freezes (``cli.run``): what skipping the interpreter's final collections saves.

Medians of ``--repeat`` runs are reported. The verify and startup cases interleave their commands
(floor, ours, floor, ours, ...) after one warm-up round, so a load that changes during the run
weighs on both sides alike. Every command runs with Python's bytecode cache on (an inherited
PYTHONDONTWRITEBYTECODE is dropped): an installed tool runs from cached bytecode, as the floors'
packages do, and the warm-up round writes it for a source checkout. Models are generated once into
``--work-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.models import make_bert, make_cnn, make_dql_chain, make_llm, make_nbits  # noqa: E402

PY = sys.executable
CLI = [PY, "-m", "onnx_qrewrite"]


@dataclass
class Sample:
    wall: float
    rss_mb: float
    #: user + system CPU seconds (0 when unknown): unlike wall time, barely moved by other jobs
    #: sharing the machine's cores, so ratios of it are what to compare on a loaded machine.
    cpu: float = 0.0


#: GNU time reports the measured command's own peak RSS. The kernel's per-child ru_maxrss (wait4)
#: does not: a child starts from this process's high-water mark (~90 MB once onnx is imported),
#: so every small command would read as at least that.
_TIME = "/usr/bin/time" if Path("/usr/bin/time").exists() else None


#: Children run as an installed tool does: with the bytecode cache (see the module docstring).
_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def measure(cmd: list[str], repeat: int) -> Sample:
    """Median wall time, peak RSS and CPU time of ``cmd`` over ``repeat`` runs (after one warm-up)."""
    return measure_interleaved([cmd], repeat)[0]


def measure_interleaved(cmds: list[list[str]], repeat: int) -> list[Sample]:
    """:func:`measure` of each command, run in turn within each round (after one warm-up round):
    on a machine shared with other jobs, load that comes and goes then hits every command alike."""
    runs = [_run_once(cmd) for _ in range(repeat + 1) for cmd in cmds][len(cmds) :]
    out = []
    for k in range(len(cmds)):
        mine = runs[k :: len(cmds)]
        out.append(
            Sample(
                statistics.median(r.wall for r in mine),
                statistics.median(r.rss_mb for r in mine),
                statistics.median(r.cpu for r in mine),
            )
        )
    return out


def measure_named(cmds: dict[str, list[str]], repeat: int) -> dict[str, Sample]:
    """:func:`measure_interleaved`, keyed by a name per command."""
    return dict(zip(cmds, measure_interleaved(list(cmds.values()), repeat), strict=True))


def _run_once(cmd: list[str]) -> Sample:
    """One run of ``cmd``: wall time, peak RSS and CPU time (fails the benchmark if it fails)."""
    start = time.perf_counter()
    if _TIME:
        proc = subprocess.run(
            [_TIME, "-f", "%M %U %S", *cmd],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            check=False,
            env=_ENV,
        )
        elapsed = time.perf_counter() - start
        fields = proc.stderr.decode().strip().splitlines()[-1].split() if proc.returncode == 0 else ["0", "0", "0"]
        peak_kb, cpu = float(fields[0]), float(fields[1]) + float(fields[2])
        code, err = proc.returncode, proc.stderr
    else:
        child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_ENV)
        _, status, usage = os.wait4(child.pid, 0)
        elapsed = time.perf_counter() - start
        code, err, peak_kb = os.waitstatus_to_exitcode(status), b"", usage.ru_maxrss
        cpu = usage.ru_utime + usage.ru_stime
    if code != 0:
        raise SystemExit(f"benchmark command failed ({code}): {' '.join(cmd)}\n{err.decode()}")
    return Sample(elapsed, peak_kb / 1024, cpu)


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
    # Interleaved; the first (warm-up) round's rewrite writes the output its floor then loads.
    ours, floor_in, floor_out = measure_interleaved(
        [[*CLI, "-q", "rewrite", str(src), "-o", str(out)], _floor_load_save(src, work), _floor_load_save(out, work)],
        repeat,
    )
    size_in, size_out = src.stat().st_size, out.stat().st_size
    nodes = blocks * 5
    note = (
        f"{nodes} nodes in; output {size_out / size_in:.2f}x the input's bytes; "
        f"peak RSS {ours.rss_mb * 2**20 / size_out:.2f}x the output file; "
        f"{ours.wall / floor_out.wall:.2f}x a load+save of the output; "
        f"CPU time {ours.cpu / floor_in.cpu:.2f}x the floor's ({ours.cpu:.2f} s); "
        f"{ours.wall / nodes * 1e6:.1f} us/node wall, {ours.cpu / nodes * 1e6:.1f} us/node CPU"
    )
    return Row(f"chain-{blocks // 1000}k", floor_in, ours, note)


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
    # CPU time too: on a shared machine the wall clock mostly measures the other jobs.
    streamed_note = (
        f"{beyond:.2f} s beyond copying the weights; CPU {streamed.cpu:.2f} s, "
        f"{streamed.cpu / copy_floor.cpu:.2f}x cp's {copy_floor.cpu:.2f} s"
        if copy_floor.cpu
        else f"{beyond:.2f} s beyond copying the weights"
    )
    return [
        Row(f"llm-{weights_gb:g}GB streamed", copy_floor, streamed, streamed_note),
        Row(
            f"llm-{weights_gb:g}GB zero-copy",
            Sample(0.0, 0.0),
            zero_copy,
            f"references the input's data file; CPU {zero_copy.cpu:.2f} s",
        ),
    ]


def _bare_sessions(src: Path, out: Path, inputs: Path, *, import_onnx: bool = False) -> list[str]:
    """Two onnxruntime sessions with verify's default settings (no graph optimisation, one
    intra-op and one inter-op thread, errors-only logging), each run on every saved sample (keys
    ``sample::input``, as ``verify --save-inputs`` writes them). ``import_onnx``: also import onnx
    (a reference row: what reading models with onnx costs before any work)."""
    code = (
        ("import onnx\n" if import_onnx else "") + "import numpy as np, onnxruntime as ort\n"
        "so = ort.SessionOptions(); so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL\n"
        "so.intra_op_num_threads = 1; so.inter_op_num_threads = 1; so.log_severity_level = 3\n"
        "samples = {}\n"
        f"for key, value in np.load({str(inputs)!r}).items():\n"
        "    sample, _, name = key.rpartition('::'); samples.setdefault(sample, {})[name] = value\n"
        f"for path in ({str(src)!r}, {str(out)!r}):\n"
        "    s = ort.InferenceSession(path, so, providers=['CPUExecutionProvider'])\n"
        "    for feeds in samples.values(): s.run(None, feeds)\n"
    )
    return [PY, "-c", code]


def bench_verify(src: Path, label: str, work: Path, repeat: int) -> list[Row]:
    out = work / f"{src.stem}.portable.onnx"
    subprocess.run([*CLI, "-q", "rewrite", str(src), "-o", str(out)], check=True)
    inputs = work / f"{src.stem}.inputs.npz"
    subprocess.run([*CLI, "-q", "verify", str(src), str(out), "--save-inputs", str(inputs)], check=True)
    import numpy as np

    with np.load(inputs) as saved:
        samples = len({key.rpartition("::")[0] for key in saved.files})
    timed = measure_named(
        {
            "floor": _bare_sessions(src, out, inputs),
            "ours": [*CLI, "-q", "verify", str(src), str(out), "--inputs", str(inputs)],
            "onnx": _bare_sessions(src, out, inputs, import_onnx=True),
            "unfrozen": [*_UNFROZEN, "-q", "verify", str(src), str(out), "--inputs", str(inputs)],
        },
        repeat,
    )
    cpu = _cpu_ratio(timed["ours"], timed["floor"])
    note = f"two ORT sessions + runs on the same {samples} samples; interleaved; {cpu}"
    reference = f"interleaved with the above; {_cpu_ratio(timed['onnx'], timed['floor'])}"
    unfrozen = f"cli.main, no gc.freeze; interleaved with the above; {_cpu_ratio(timed['unfrozen'], timed['floor'])}"
    return [
        Row(f"verify {label}", timed["floor"], timed["ours"], note),
        Row(f"(reference) floor + import onnx, {label}", timed["floor"], timed["onnx"], reference),
        Row(f"(reference) verify without the exit freeze, {label}", timed["floor"], timed["unfrozen"], unfrozen),
    ]


#: The command line as an in-process caller runs it (``cli.main``): without the garbage-collector
#: freezes of the console script (``cli.run``), for the reference rows that show what they save.
_UNFROZEN = [PY, "-c", "from onnx_qrewrite.cli import main; main()"]


def _cpu_ratio(ours: Sample, floor: Sample) -> str:
    """The CPU-time ratio (user + system), which other jobs on a shared machine barely move."""
    return f"CPU time {ours.cpu / floor.cpu:.2f}x the floor's" if floor.cpu else "CPU time unknown"


def _small_models(work: Path) -> tuple[Path, Path]:
    bert, cnn = work / "bert_tiny.onnx", work / "cnn_small.onnx"
    if not bert.exists():
        make_bert(bert)
    if not cnn.exists():
        make_cnn(cnn)
    return bert, cnn


#: Run by the infer case in a child process: interleaved timing of several models in one process.
_INFER_CHILD = r"""
import json, statistics, sys, time
import numpy as np, onnx, onnxruntime as ort
spec = json.loads(sys.argv[1])
sessions, fused = [], []
for i, path in enumerate(spec["paths"]):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.optimized_model_filepath = spec["optimized"][i]
    so.log_severity_level = 3
    sessions.append(ort.InferenceSession(path, so, providers=["CPUExecutionProvider"]))
    ops = {}
    for n in onnx.load(spec["optimized"][i]).graph.node:
        ops[n.op_type] = ops.get(n.op_type, 0) + 1
    fused.append(ops)
inp = sessions[0].get_inputs()[0]
rng = np.random.default_rng(0)
shape = spec["shape"]
if inp.type == "tensor(int64)":
    x = rng.integers(0, 1000, shape).astype(np.int64)
else:
    x = rng.standard_normal(shape).astype(np.float32)
feeds = {inp.name: x}
outs = [s.run(None, feeds)[0] for s in sessions]
same = all(np.array_equal(o.view(np.uint8), outs[0].view(np.uint8)) for o in outs[1:])
times = [[] for _ in sessions]
budget = spec["seconds"] / spec["rounds"] / len(sessions)
t0 = time.perf_counter(); sessions[0].run(None, feeds); one = time.perf_counter() - t0
n = max(3, int(budget / max(one, 1e-6)))
for _ in range(spec["rounds"]):
    for k, s in enumerate(sessions):
        t = time.perf_counter()
        for _ in range(n):
            s.run(None, feeds)
        times[k].append((time.perf_counter() - t) / n)
print(json.dumps({"median": [statistics.median(t) for t in times], "fused": fused, "same": same}))
"""

#: Ops whose count tells what onnxruntime fused around (dynamic) quantization.
_FUSION_OPS = ("DynamicQuantizeMatMul", "MatMulIntegerToFloat", "DynamicQuantizeLinear", "QuantizeLinear")


def bench_infer(model: Path, label: str, shape: list[int], work: Path, seconds: float) -> Row:
    rewritten = work / f"{model.stem}.portable.onnx"
    subprocess.run([*CLI, "-q", "rewrite", str(model), "-o", str(rewritten)], check=True)
    spec = {
        "paths": [str(model), str(rewritten)],
        "optimized": [str(work / f"{model.stem}.ort.onnx"), str(work / f"{model.stem}.portable.ort.onnx")],
        "shape": shape,
        "rounds": 7,
        "seconds": seconds,
    }
    proc = subprocess.run([PY, "-c", _INFER_CHILD, json.dumps(spec)], check=True, capture_output=True, text=True)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    original, ours = result["median"]

    def fused(ops: dict[str, int]) -> str:
        return ", ".join(f"{ops[k]} {k}" for k in _FUSION_OPS if ops.get(k)) or "-"

    note = f"ms per run; ORT fused original: {fused(result['fused'][0])}; rewrite: {fused(result['fused'][1])}" + (
        "" if result["same"] else "; OUTPUTS DIFFER"
    )
    shape_text = "x".join(map(str, shape))
    return Row(f"infer {label} {shape_text}", Sample(original * 1e3, 0.0), Sample(ours * 1e3, 0.0), note)


def bench_startup(work: Path, repeat: int) -> list[Row]:
    tool = Path(PY).parent / "onnx-qrewrite"
    base = [str(tool)] if tool.exists() else CLI
    poly = shutil.which("polygraphy", path=str(Path(PY).parent)) or shutil.which("polygraphy")
    small = HERE.parent / "sample_models" / "dynamic_mlp.onnx"
    cases = {"--help": ["--help"], "rules": ["rules"], "inspect": ["inspect", str(small)]}
    cmds = {label: [*base, *args] for label, args in cases.items()}
    cmds["import onnx"] = [PY, "-c", "import onnx"]  # reference: what any command reading a model pays
    cmds["unfrozen inspect"] = [*_UNFROZEN, "inspect", str(small)]  # reference: without cli.run's freezes
    if poly:
        cmds = {"floor": [poly, "--help"], **cmds}
    timed = measure_named(cmds, repeat)
    floor = timed.get("floor", Sample(0.0, 0.0))
    note = "floor: polygraphy --help; interleaved" if poly else "polygraphy not installed"
    rows = [
        Row(f"start-up {label}", floor, timed[label], f"{note}; {_cpu_ratio(timed[label], floor)}") for label in cases
    ]
    reference = f"{note}; {_cpu_ratio(timed['import onnx'], floor)}"
    unfrozen = f"cli.main, no gc.freeze; {note}; {_cpu_ratio(timed['unfrozen inspect'], floor)}"
    return [
        *rows,
        Row("(reference) python -c 'import onnx'", floor, timed["import onnx"], reference),
        Row("(reference) inspect without the exit freeze", floor, timed["unfrozen inspect"], unfrozen),
    ]


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
        rss = f"{r.ours.rss_mb:.0f}" if r.ours.rss_mb else "-"
        lines.append(f"| {r.case} | {floor} | {r.ours.wall:.2f} | {ratio} | {rss} | {r.note} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--cases", default="chain,llm,verify,infer,startup", help="comma-separated: chain, llm, verify, infer, startup"
    )
    parser.add_argument("--blocks", default="20000,100000", help="chain sizes")
    parser.add_argument("--verify-blocks", type=int, default=5000, help="chain size for verify (0: skip)")
    parser.add_argument(
        "--verify-nbits-layers", type=int, default=2, help="MatMulNBits layers (K = N = 2048) for verify (0: skip)"
    )
    parser.add_argument("--weights-gb", type=float, default=4.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--infer-seconds", type=float, default=6.0, help="timing budget per infer case")
    parser.add_argument("--work-dir", type=Path, default=None, help="where models are generated (kept)")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the table here")
    args = parser.parse_args(argv)
    work = args.work_dir or Path(tempfile.gettempdir()) / "onnx-qrewrite-bench"
    work.mkdir(parents=True, exist_ok=True)
    cases = {c.strip() for c in args.cases.split(",")}
    rows: list[Row] = []
    load_before = os.getloadavg()[0]

    def add(new: list[Row]) -> None:
        rows.extend(new)
        print("\n".join(table(new)[2:]), flush=True)

    if "chain" in cases:
        for blocks in (int(b) for b in args.blocks.split(",")):
            add([bench_chain(blocks, work, args.repeat)])
    if "llm" in cases:
        add(bench_llm(work, args.repeat, args.weights_gb))
    if "verify" in cases:
        if args.verify_blocks > 0:
            chain = work / f"chain_{args.verify_blocks}.onnx"
            if not chain.exists():
                make_dql_chain(args.verify_blocks, chain)
            add(bench_verify(chain, f"chain-{args.verify_blocks // 1000}k", work, args.repeat))
        add(bench_verify(_small_models(work)[0], "bert-tiny", work, args.repeat))
        if args.verify_nbits_layers > 0:
            nbits = work / f"nbits_{args.verify_nbits_layers}x2048.onnx"
            if not nbits.exists():
                make_nbits(nbits, layers=args.verify_nbits_layers)
            add(bench_verify(nbits, f"nbits-{args.verify_nbits_layers}x2048", work, args.repeat))
    if "infer" in cases:
        bert, cnn = _small_models(work)
        for shape in ([1, 8], [1, 64], [8, 64]):
            add([bench_infer(bert, "bert-tiny", shape, work, args.infer_seconds)])
        add([bench_infer(cnn, "cnn", [1, 3, 16, 16], work, args.infer_seconds)])
    if "startup" in cases:
        add(bench_startup(work, max(args.repeat, 5)))
    header = (
        f"Machine: {machine()}; medians of {args.repeat} runs after a warm-up (start-up: "
        f"{max(args.repeat, 5)}); load average {load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end."
    )
    out = [header, "", *table(rows)]
    print("\n".join(out))
    if args.markdown:
        args.markdown.write_text("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
