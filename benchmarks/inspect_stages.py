"""Where ``inspect`` of a small model spends its start-up, in instructions: each step of what
the console script's process does, run under ``valgrind --tool=callgrind`` up to and including
that step, and the instructions each step adds to the one before (the interpreter and the command
line's own modules first, then numpy, protobuf, onnx's messages and extension module, the rule
catalogue, the model reader and the engine, reading and checking the model, the whole command).

Why instructions: the machine is shared, and other jobs move CPU time by more than a step's
share; callgrind's counts move by a percent or two (hash seed fixed, OpenBLAS held to the calling
thread, so that its pool's spinning is not counted). ``polygraphy --help`` is counted the same
way, as the floor of the start-up goal (benchmarks/bench.py --cases startup).

    python benchmarks/inspect_stages.py [MODEL]
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL = HERE.parent / "sample_models" / "dynamic_mlp.onnx"

#: (label, code run after the previous steps' code), in the order the command does them.
STEPS = [
    ("python, cli (click, logging)", "from onnx_qrewrite import cli"),
    (
        "cli.inspect",
        "from onnx_qrewrite import _onnx\n_onnx.allow_unpackaged()\ncli._PROCESS['own_process'] = True\n"
        "cli.import_quietly('onnx_qrewrite.cli.inspect')",
    ),
    ("numpy", "cli.import_quietly('numpy')"),  # as import_numpy_without_blas_threads does
    ("protobuf", "cli.import_quietly('google.protobuf.descriptor_pool')"),
    ("onnx's messages, extension", "_onnx._resolve()"),
    ("catalogue module", "cli.import_quietly('onnx_qrewrite.rewriter.catalogue')"),
    (
        "read the rule files (TOML, or its cached values)",
        "from onnx_qrewrite.rewriter.catalogue import load_rules\ncatalogue = load_rules()",
    ),
    (
        "model reader, engine modules",
        "cli.import_quietly('onnx_qrewrite.io.model_io')\ncli.import_quietly('onnx_qrewrite.rewriter.engine')",
    ),
    ("read + check the model", "from onnx_qrewrite.io import model_io\nmodel_io.open_model(MODEL)"),
]


def _count(command: list[str]) -> int:
    env = {**os.environ, "PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "1"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as an installed tool runs: from cached bytecode
    done = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *command],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    found = re.search(r"Collected : ([\d,]+)", done.stderr)
    if found is None:
        raise SystemExit(f"no count from callgrind:\n{done.stderr}")
    return int(found.group(1).replace(",", ""))


def main() -> None:
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed")
    model = Path(sys.argv[1]) if len(sys.argv) > 1 else MODEL
    py = sys.executable
    for _ in range(2):  # warm-up: bytecode caches written
        subprocess.run([py, "-m", "onnx_qrewrite", "inspect", str(model)], capture_output=True, check=False)
    rows = []
    bare = _count([py, "-c", "import os; os._exit(0)"])
    code = f"import os\nMODEL = {str(model)!r}\n"
    previous = bare
    for label, step in STEPS:
        code += step + "\n"
        total = _count([py, "-c", code + "os._exit(0)"])
        rows.append((label, total - previous))
        previous = total
    whole = _count([py, "-c", "from onnx_qrewrite.cli import console; console()", "inspect", str(model)])
    rows.append(("the rest of the command (engine, output)", whole - previous))
    poly = shutil.which("polygraphy", path=str(Path(py).parent)) or shutil.which("polygraphy")
    print(f"| step | million instructions |\n|---|---|\n| bare interpreter | {bare / 1e6:.0f} |")
    for label, count in rows:
        print(f"| {label} | {count / 1e6:.0f} |")
    print(f"| **inspect {model.name}, whole** | **{whole / 1e6:.0f}** |")
    if poly:
        floor = _count([poly, "--help"])
        print(f"| polygraphy --help (floor) | {floor / 1e6:.0f} ({whole / floor:.2f}x) |")


if __name__ == "__main__":
    main()
