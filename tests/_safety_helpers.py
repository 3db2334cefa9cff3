"""Models with external data, canaries and digests for the safety tests (issue 9)."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

PY = sys.executable


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


#: Popen keywords for a child that a test interrupts with SIGINT. A shell without job control
#: starts background commands with SIGINT ignored, the children inherit that, and Python then
#: leaves SIGINT ignored (no KeyboardInterrupt ever): seen when the suite ran as `pytest ... &`.
INTERRUPTIBLE = {"preexec_fn": _sigint_default}
#: The bytes of a secret file outside the model's folder: must never appear in any output.
CANARY = (b"CANARY-SECRET-" * 200)[:2048]


def dql_model(folder: Path, *, name: str = "model.onnx", weight_bytes: int = 64 * 32, seed: int = 0) -> Path:
    """DQL -> MatMulInteger whose uint8 weight (and zero point) live in ``<name>.data``."""
    folder.mkdir(parents=True, exist_ok=True)
    cols = weight_bytes // 64
    rng = np.random.default_rng(seed)
    w = numpy_helper.from_array(rng.integers(0, 255, (64, cols), dtype=np.uint8), "w")
    wzp = numpy_helper.from_array(np.array(128, np.uint8), "w_zp")
    nodes = [
        helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xzp"], name="dql"),
        helper.make_node("MatMulInteger", ["xq", "w", "xzp", "w_zp"], ["acc"], name="mm"),
        helper.make_node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["accf", "xs"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, cols])],
        [w, wzp],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = folder / name
    onnx.save(model, path, save_as_external_data=True, location=f"{name}.data", size_threshold=0)
    return path


def set_location(path: Path, tensor: str, location: str, **extra: str) -> None:
    """Point ``tensor``'s external data of the model at ``path`` somewhere else (as an attacker would)."""
    model = onnx.load(path, load_external_data=False)
    for t in model.graph.initializer:
        if t.name == tensor:
            entries = {e.key: e.value for e in t.external_data}
            entries.update(location=location, **extra)
            del t.external_data[:]
            for k, v in entries.items():
                e = t.external_data.add()
                e.key, e.value = k, v
    path.write_bytes(model.SerializeToString())


def digest(folder: Path) -> dict[str, str]:
    """sha256 of every regular file under ``folder`` (symlinks and FIFOs by name only)."""
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = str(p.relative_to(folder))
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_fifo():
            out[rel] = "fifo"
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def assert_no_canary(folder: Path) -> None:
    for p in folder.rglob("*"):
        if p.is_file() and not p.is_symlink():
            assert CANARY[:64] not in p.read_bytes(), f"{p} holds the canary"


def cli(*args, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, "-m", "onnx_qrewrite", *map(str, args)], capture_output=True, text=True, timeout=timeout, **kw
    )


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


def batch_task(arg: str):
    """A run_tasks task (module level: workers import it) that dies as told, for batch tests."""
    import ctypes
    import signal as _signal

    from onnx_qrewrite.cli.batch import Outcome

    if arg == "sigkill":
        os.kill(os.getpid(), _signal.SIGKILL)
    elif arg == "segfault":
        ctypes.string_at(0)
    elif arg == "exit":
        os._exit(7)
    return Outcome(0, arg, lines=[f"done {arg} in {os.getpid()}"])
