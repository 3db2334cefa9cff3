"""The process that converts and runs for ``--runtime tflite`` (verify/tflite_host.py): one per
interpreter, serving every runner; its failures are the one-line errors one process per request
gave, and it is reaped whatever happens. Most of these run stand-in children in this interpreter
(no onnx2tf needed): what is checked is the parent's side."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import SAMPLES

from onnx_qrewrite.errors import InvalidModelError
from onnx_qrewrite.verify import tflite_host
from onnx_qrewrite.verify.tflite_host import TFLiteChild


def _reaped(pid: int) -> bool:
    """No process ``pid`` left to wait for: neither running nor a zombie of this process."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


def _stand_in(tmp_path: Path, body: str) -> TFLiteChild:
    """A child whose request loop is ``body`` (after reading one request line)."""
    script = tmp_path / "child.py"
    script.write_text(f"import os, signal, sys, time\nfor line in sys.stdin:\n    {body}\n")
    return TFLiteChild(sys.executable, str(script))


def test_an_exception_in_the_child_is_its_last_line_and_the_child_serves_on(tmp_path):
    """The real child script, in this interpreter: an exception of a request is quoted by its last
    traceback line (what one process per request printed last), and the same process serves on."""
    child = TFLiteChild(sys.executable)
    missing = tmp_path / "missing.tflite"
    pids = set()
    request = {"op": "run", "tflite": str(missing), "inputs": "in.npz", "outputs": "out.npz"}
    try:
        for _ in range(2):
            with pytest.raises(InvalidModelError) as caught:
                child.request("m.onnx", "(ai-edge-litert) cannot run", **request)
            assert str(caught.value) == (
                "m.onnx: tflite (ai-edge-litert) cannot run the model: "
                f"FileNotFoundError: [Errno 2] No such file or directory: '{missing}'"
            )
            pids.add(child.pid)
    finally:
        child.close()
    (pid,) = pids
    assert pid is not None and _reaped(pid)


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ("os.kill(os.getpid(), signal.SIGSEGV)", "it crashed (signal 11)"),
        ("print('boom: the last line', file=sys.stderr); sys.stderr.flush(); os._exit(3)", "boom: the last line"),
        ("os._exit(4)", "4"),
    ],
)
def test_a_child_that_dies_is_one_line_then_reaped_and_replaced(tmp_path, body, said):
    child = _stand_in(tmp_path, body)
    try:
        with pytest.raises(InvalidModelError) as caught:
            child.request("m.onnx", "(onnx2tf) cannot convert", op="convert", model="m.onnx", out_dir="out")
        assert str(caught.value) == f"m.onnx: tflite (onnx2tf) cannot convert the model: {said}"
        first = caught.value
        assert child.pid is None  # reaped with the failure
        with pytest.raises(InvalidModelError) as again:  # a new child takes the next request
            child.request("m.onnx", "(onnx2tf) cannot convert", op="convert", model="m.onnx", out_dir="out")
        assert str(again.value) == str(first)
    finally:
        child.close()


@pytest.mark.parametrize(
    "answer",
    [
        "os.write(1, b'{\"ok\": tr'); os._exit(9)",  # cut short: it died writing its answer
        "print('not json', flush=True)",
        "print('{\"ok\": false}', flush=True)",  # no code
        'print(\'{"ok": true, "path": 3}\', flush=True)',  # a convert's path that is no path
    ],
)
def test_a_garbled_answer_is_one_line_and_the_child_is_killed_and_replaced(tmp_path, answer):
    """An answer line without its newline (the child died mid-write) or that is not a well-formed
    answer: the child is taken for dead (killed, reaped), the error is one line, and the next
    request starts another child."""
    child = _stand_in(tmp_path, answer)
    try:
        for _ in range(2):  # the second request starts another child
            with pytest.raises(InvalidModelError) as caught:
                child.request("m.onnx", "(onnx2tf) cannot convert", op="convert", model="m.onnx", out_dir="out")
            said = "m.onnx: tflite (onnx2tf) cannot convert the model: the child's answer was garbled"
            assert str(caught.value) == said
            assert child.pid is None and child._home is None  # killed, reaped, its folder removed
    finally:
        child.close()


def test_an_interrupt_while_the_child_works_kills_and_reaps_it(tmp_path):
    """KeyboardInterrupt (Ctrl-C) in the parent while it waits for an answer: the child is killed
    and reaped before the interrupt goes on; the next request starts another child."""
    child = _stand_in(tmp_path, "print('{\"ok\": true}', flush=True) if 'quick' in line else time.sleep(600)")
    main = threading.get_ident()
    try:
        child.request("m", "x", op="quick")
        pid = child.pid
        assert pid is not None
        timer = threading.Timer(0.5, signal.pthread_kill, (main, signal.SIGINT))
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            child.request("m", "x", op="slow")
        timer.join()
        assert child.pid is None and _reaped(pid)
        assert child.request("m", "x", op="quick") == {"ok": True}
        assert child.pid not in (None, pid)
    finally:
        child.close()


def test_close_at_exit_ends_the_child_by_closing_its_input(tmp_path):
    """The child ends when its stdin does (it is not killed: it would not remove its folder's files
    otherwise): close() waits for it and removes its private folder."""
    child = _stand_in(tmp_path, "print('{\"ok\": true}', flush=True)")
    child.request("m", "x", op="any")
    pid, home = child.pid, child._home
    assert pid is not None and home is not None and Path(home).is_dir()
    child.close()
    assert child.pid is None and _reaped(pid) and not Path(home).exists()


def test_an_interrupt_while_closing_still_reaps_the_child_and_removes_its_folder(tmp_path):
    """SIGTERM while close() waits for the child to end (a batch worker stopped as it exits): the
    interrupt goes on, but the child is killed and reaped and its folder removed first (both
    were left behind, with the atexit callback's traceback)."""
    child = _stand_in(tmp_path, "print('{\"ok\": true}', flush=True)")
    child.request("m", "x", op="any")
    proc, home = child._proc, child._home
    assert proc is not None and home is not None
    waited = proc.wait

    def interrupted(timeout: float | None = None) -> int:
        if timeout is not None:
            raise KeyboardInterrupt
        return waited()

    proc.wait = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        child.close()
    assert child.pid is None and _reaped(proc.pid) and not Path(home).exists()


def test_a_forked_process_starts_its_own_child(tmp_path):
    """A fork of a process holding a child does not write into that child's pipes: it starts its own,
    and closing it there leaves the parent's child running."""
    child = _stand_in(tmp_path, 'print(\'{"ok": true, "pid": %d}\' % os.getpid(), flush=True)')
    try:
        mine = child.request("m", "x", op="any")["pid"]
        read, write = os.pipe()
        with warnings.catch_warnings():  # Python 3.12+: fork of a process with threads (none touched here)
            warnings.simplefilter("ignore", DeprecationWarning)
            forked = os.fork()
        if forked == 0:  # pragma: no cover - the fork reports through the pipe
            try:
                theirs = child.request("m", "x", op="any")["pid"]
                child.close()
                os.write(write, str(theirs).encode())
            finally:
                os._exit(0)
        os.close(write)
        theirs = int(os.read(read, 100) or b"0")
        os.close(read)
        os.waitpid(forked, 0)
        assert theirs not in (0, mine)
        assert child.request("m", "x", op="any")["pid"] == mine
    finally:
        child.close()


def test_every_tflite_runner_of_a_process_is_served_by_one_child():
    """Two runners, two conversions, runs of both: one process, and the same numbers as a runner
    whose child converted nothing before (a conversion does not depend on the ones before it)."""
    from onnx_qrewrite.errors import MissingDependencyError
    from onnx_qrewrite.verify.runtimes import TFLITE_PYTHON_ENV, make_runner, tflite_python

    try:
        python = tflite_python()
    except MissingDependencyError:
        pytest.skip(f"needs onnx2tf and ai-edge-litert on Python 3.12+ (${TFLITE_PYTHON_ENV})")
    model = onnx.load(SAMPLES / "dynamic_mlp.onnx")
    feeds = {"input": np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)}
    first = make_runner("tflite", model, label="first")
    second = make_runner("tflite", model, label="second")
    assert first._child is second._child is tflite_host.tflite_child(python)
    pid = first._child.pid
    got = [first.run(feeds), second.run(feeds), first.run(feeds)]
    assert first._child.pid == pid
    assert Path(first._tflite).read_bytes() == Path(second._tflite).read_bytes()
    for other in got[1:]:
        assert all(np.array_equal(other[k], got[0][k]) for k in got[0])
    folder = Path(first._tmp.name)  # a process of its own runs the first runner's inputs
    alone = [python, tflite_host.CHILD, "run", first._tflite, folder / "in1.npz", folder / "fresh.npz"]
    subprocess.run(alone, check=True, capture_output=True)
    with np.load(folder / "fresh.npz") as values:
        assert all(np.array_equal(values[k], got[0][k]) for k in got[0])


def test_converting_by_hand_adds_the_tflite_and_touches_nothing_else(tmp_path, monkeypatch):
    """``_tflite_child.py convert MODEL OUT_DIR`` (by hand): onnx2tf works in a private folder, removed
    afterwards, and only the .tflite lands in OUT_DIR; the user's files there stay (they were all
    deleted). A stand-in onnx2tf writes what the real one does."""
    from onnx_qrewrite.verify import _tflite_child

    def fake_convert(input_onnx_file_path: str, output_folder_path: str, **_: object) -> None:
        for name in ("m_float32.tflite", "m_float16.tflite", "schema.fbs"):
            Path(output_folder_path, name).write_text(name)

    monkeypatch.setitem(sys.modules, "onnx2tf", types.SimpleNamespace(convert=fake_convert))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    out = tmp_path / "mine"
    (out / "keep").mkdir(parents=True)
    (out / "notes.txt").write_text("my notes")
    (out / "keep" / "data.bin").write_text("x")
    path = _tflite_child.convert(str(SAMPLES / "dynamic_mlp.onnx"), str(out))
    assert path == str(out / "m_float32.tflite") and Path(path).read_text() == "m_float32.tflite"
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == [
        "keep",
        "keep/data.bin",
        "m_float32.tflite",
        "notes.txt",
    ]
    assert (out / "notes.txt").read_text() == "my notes" and not list((tmp_path / "tmp").iterdir())


def test_the_folders_a_stopped_batch_worker_leaves_are_removed_with_its_temporaries(tmp_path, monkeypatch):
    """A batch worker stopped by SIGTERM exits through os._exit (no atexit, no finalizers) after
    outputs.remove_registered_temps(): that removes the child's private folder and a runner's own
    (both were left in $TMPDIR)."""
    from onnx_qrewrite.io import outputs
    from onnx_qrewrite.verify.runtimes import _Runner

    monkeypatch.setattr(outputs, "_folders", {})  # only this test's: others' live folders stay
    monkeypatch.setattr(outputs, "_registry", set())
    child = _stand_in(tmp_path, "print('{\"ok\": true}', flush=True)")
    try:
        child.request("m", "x", op="any")
        runner = _Runner(onnx.load(SAMPLES / "dynamic_mlp.onnx"), "m", "tflite")
        folders = [Path(child._home or ""), Path(runner._tmp.name)]
        assert all(folder.is_dir() for folder in folders)
        outputs.remove_registered_temps()
        assert not any(folder.exists() for folder in folders)
    finally:
        child.close()
    assert child.request("m", "x", op="any") == {"ok": True}  # closed, then a new child with a new folder
    child.close()


@pytest.mark.parametrize(
    ("name", "mid_request", "removed"),
    [("onnx-qrewrite-tflite-x1", False, True), ("onnx-qrewrite-tflite-x2", True, True), ("not-ours", False, False)],
)
def test_a_child_whose_host_was_killed_removes_its_folder(
    tmp_path: Path, name: str, mid_request: bool, removed: bool
) -> None:
    """Review 5 R2: a host killed by SIGKILL cannot remove the child's folder; the child, whose
    stdin then ends (or whose answer finds no reader), removes it, and only a folder named as the
    host names its own."""
    home = tmp_path / name
    home.mkdir()
    (home / "stderr").write_bytes(b"")
    host = (
        "import os, subprocess, sys\n"
        f"env = os.environ | {{{tflite_host.HOST_PID_VARIABLE!r}: str(os.getpid())}}\n"
        f"child = subprocess.Popen([sys.executable, {tflite_host.CHILD!r}], stdin=subprocess.PIPE,"
        f" cwd={str(home)!r}, env=env, stdout=subprocess.PIPE if {mid_request} else None)\n"
        "print(child.pid, flush=True)\n"
        + (  # a request that fails (no model) after the host is gone: its answer finds no reader
            'child.stdin.write(b\'{"op": "convert", "model": "/no/such.onnx", "out_dir": "/no/such"}\\n\')\n'
            "child.stdin.flush()\n"
            if mid_request
            else ""
        )
        + "os.kill(os.getpid(), 9)\n"
    )
    done = subprocess.run([sys.executable, "-c", host], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == -signal.SIGKILL
    child = int(done.stdout)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.05)
    assert not _alive(child), "the child did not end when its stdin did"
    assert home.exists() is not removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:  # a zombie has ended
        return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
