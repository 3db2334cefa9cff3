"""Runs in the TFLite interpreter's own Python (3.12+, with onnx2tf and ai-edge-litert), never in
onnx-qrewrite's: onnx2tf pins its own onnx and onnxruntime, so it cannot share an environment with
the verifier. Imports nothing from onnx_qrewrite.

    python _tflite_child.py                                # serve requests (verify/tflite_host.py)
    python _tflite_child.py convert MODEL.onnx OUT_DIR    # once, by hand: prints the .tflite path
                                                           # (adds it to OUT_DIR, touches nothing else)
    python _tflite_child.py run MODEL.tflite IN.npz OUT.npz

Served, it reads one JSON request a line on stdin (``{"op": "convert", "model", "out_dir"}`` or
``{"op": "run", "tflite", "inputs", "outputs"}``) and answers each with one JSON line on what was
its stdout (``{"ok": true, ...}``, or ``{"ok": false, "code": N}`` after printing the error on
stderr exactly as an uncaught exception or ``sys.exit`` would have), until stdin ends. One process
serves every model of a verification, because starting one costs more than a small model's
conversion: the interpreter with numpy and onnx (0.4 s of CPU), onnx2tf's own modules, imported
on its first conversion (1.2 s), and onnx2tf 2.6.9's compilation of the 676 kB TFLite schema
module it copies into each output folder (0.6 s; cached per folder, so every conversion here uses
one folder); a conversion of the sample MLP then takes 0.35 s instead of 2.7 s. Whatever onnx2tf or
a C library prints goes to stderr, never into the answers.

onnx2tf rewrites its input file in place (renames nodes, strips domains): the caller hands it a
copy. Inputs of rank >= 3 keep their NCHW layout (keep_ncw_or_nchw_or_ncdhw_input_names), so the
same inputs feed both models. onnx2tf also writes a float16 model beside the float32 one, which
nothing reads: onnx2tf 2.6.9 has no option to skip it (its flatbuffer_direct export writes both).
"""

from __future__ import annotations

import collections
import contextlib
import gc
import glob
import json
import os
import shutil
import signal
import sys
import traceback
from typing import Any

#: The prefix of the host's private folder this process runs in (and of a one-off conversion's):
#: the orphaned process removes only a folder named so.
HOME_PREFIX = "onnx-qrewrite-tflite-"
#: The host's process id, which it passes (it may be gone before this process starts serving).
HOST_PID_VARIABLE = "ONNX_QREWRITE_TFLITE_HOST"
#: onnx2tf's copies of the TFLite schema in its output folder: kept between conversions.
_SCHEMA_FILES = {"schema.fbs", "schema_generated.py"}
#: Interpreters kept ready (a verification runs one model a few times, then the next).
_KEEP = 4
_interpreters: collections.OrderedDict[tuple[Any, ...], Any] = collections.OrderedDict()


def convert(model: str, out_dir: str, work: str | None = None) -> str:
    """The float32 .tflite of ``model``, moved into ``out_dir``. ``work`` is onnx2tf's output folder,
    one this process owns (emptied first but for the schema copies); without it (by hand), a new
    private folder, removed afterwards: nothing already in ``out_dir`` is touched but a file of
    the .tflite's name."""
    if work is None:
        import tempfile

        work = tempfile.mkdtemp(prefix=HOME_PREFIX)
        try:
            return convert(model, out_dir, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return _converted(model, out_dir, work)


def _converted(model: str, out_dir: str, work: str) -> str:
    import onnx
    import onnx2tf

    _empty(work)
    graph = onnx.load(model).graph
    keep = [i.name for i in graph.input if len(i.type.tensor_type.shape.dim) >= 3]
    onnx2tf.convert(
        input_onnx_file_path=model,
        output_folder_path=work,
        non_verbose=True,
        keep_ncw_or_nchw_or_ncdhw_input_names=keep or None,
    )
    found = sorted(glob.glob(os.path.join(work, "*float32.tflite")))
    if not found:
        raise SystemExit("onnx2tf wrote no float32 .tflite model")
    os.makedirs(out_dir, exist_ok=True)
    return shutil.move(found[0], os.path.join(out_dir, os.path.basename(found[0])))


def _empty(folder: str) -> None:
    """An earlier conversion's outputs go, so that a conversion that writes none is not mistaken
    for one that did."""
    os.makedirs(folder, exist_ok=True)
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if name in _SCHEMA_FILES:
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


def run(tflite: str, inputs: str, outputs: str) -> None:
    import numpy as np

    runner = _signature_runner(tflite)
    feeds = dict(np.load(inputs))
    result = runner(**{name: feeds[name] for name in runner.get_input_details()})
    arrays: dict[str, Any] = {name: np.asarray(value) for name, value in result.items()}
    np.savez(outputs, **arrays)


def _signature_runner(tflite: str) -> Any:
    """The model's signature runner, allocated once per file (a file rewritten in place is another
    key: its inode, size and time change)."""
    stat = os.stat(tflite)
    from ai_edge_litert.interpreter import Interpreter

    key = (tflite, stat.st_ino, stat.st_size, stat.st_mtime_ns)
    if key not in _interpreters:
        interpreter = Interpreter(model_path=tflite)
        interpreter.allocate_tensors()
        _interpreters[key] = interpreter.get_signature_runner()
        while len(_interpreters) > _KEEP:
            _interpreters.popitem(last=False)
    _interpreters.move_to_end(key)
    return _interpreters[key]


def _handle(request: dict[str, Any], work: str) -> dict[str, Any]:
    if request["op"] == "convert":
        path = convert(request["model"], request["out_dir"], work)
        if not gc.get_freeze_count():
            # onnx2tf collects garbage twice per conversion (runtime_memory.py): with its modules
            # loaded that scanned ~0.3 s of long-lived objects each time. Frozen, they are skipped.
            gc.collect()
            gc.freeze()
        return {"path": path}
    run(request["tflite"], request["inputs"], request["outputs"])
    return {}


def _exit_code(exc: SystemExit) -> int:
    """What the interpreter would exit with, printing a message as it would."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def serve() -> None:
    """Answer requests until stdin ends. SIGINT is ignored: a terminal's Ctrl-C reaches the whole
    process group, and the parent decides (it kills this process when interrupted)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    requests = os.fdopen(os.dup(0), "r", encoding="utf-8")
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)
    home, parent = os.getcwd(), int(os.environ.get(HOST_PID_VARIABLE) or os.getppid())
    work = os.path.join(home, "onnx2tf")
    try:
        for line in requests:
            answer = _answer(line, work)
            sys.stdout.flush()
            sys.stderr.flush()
            answers.write(json.dumps(answer) + "\n")
            answers.flush()
    except BrokenPipeError:  # the host is gone (killed while this request ran): nobody to answer
        pass
    finally:
        _remove_home_if_orphaned(home, parent)
    with contextlib.suppress(BrokenPipeError):  # the answer that could not be written, flushed again
        answers.close()


def _answer(line: str, work: str) -> dict[str, Any]:
    """One request's answer; a failure is printed on stderr as an uncaught exception would be."""
    try:
        return {"ok": True, **_handle(json.loads(line), work)}
    except SystemExit as exc:
        return {"ok": False, "code": _exit_code(exc)}
    except Exception:  # noqa: BLE001 - printed as an uncaught exception is, the parent quotes it
        traceback.print_exc()
        return {"ok": False, "code": 1}


def _remove_home_if_orphaned(home: str, parent: int) -> None:
    """The host removes this process's folder (its working directory) when it stops it; a host
    killed by SIGKILL cannot, and this process outlives it until stdin ends: then remove it here,
    only the host's own private folder (its name says so), only when the host is gone."""
    if os.getppid() != parent and os.path.basename(home).startswith(HOME_PREFIX):
        os.chdir(os.path.dirname(home))
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) == 1:
        serve()
    elif sys.argv[1] == "convert":
        print(convert(sys.argv[2], sys.argv[3]))
    else:
        run(sys.argv[2], sys.argv[3], sys.argv[4])
