"""Batches are resilient (issue 9, item 4): a worker that dies fails only its model, naming it and
how the worker died; every message names its model; SIGTERM/SIGINT stop workers and pending
models promptly, leave no temporaries, and exit 143/130."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from _safety_helpers import INTERRUPTIBLE, PY, batch_task, cli, dql_model

from onnx_qrewrite.cli.batch import run_tasks
from onnx_qrewrite.errors import EXIT_INTERNAL
from onnx_qrewrite.io import outputs


def test_a_dead_worker_fails_only_its_model():
    args = ["a", "sigkill", "b", "segfault", "c", "exit", "d"]
    labels = [f"{a}.onnx" for a in args]
    outcomes = sorted(run_tasks(batch_task, args, labels, jobs=2), key=lambda o: o.index)
    assert [o.label for o in outcomes] == labels
    good = [o for o in outcomes if o.exit_code == 0]
    assert [o.label for o in good] == ["a.onnx", "b.onnx", "c.onnx", "d.onnx"]
    dead = {o.label: o.error for o in outcomes if o.exit_code}
    assert set(dead) == {"sigkill.onnx", "segfault.onnx", "exit.onnx"}
    assert all(o.exit_code == EXIT_INTERNAL for o in outcomes if o.exit_code)
    assert "killed by signal 9 (SIGKILL" in dead["sigkill.onnx"]
    assert "killed by signal 11 (SIGSEGV)" in dead["segfault.onnx"]
    assert "exited with status 7" in dead["exit.onnx"]


def test_every_batch_error_names_its_model(tmp_path):
    good = dql_model(tmp_path / "g", name="good.onnx")
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x08\x03not a model")
    missing = tmp_path / "missing.onnx"
    escaping = dql_model(tmp_path / "e", name="escaping.onnx")
    from _safety_helpers import set_location

    set_location(escaping, "w", "../../etc/passwd")
    out = tmp_path / "out"
    proc = cli("rewrite", good, garbage, missing, escaping, "-o", f"{out}/", "--jobs", "2")
    assert proc.returncode == 3, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 3, proc.stderr
    for model in (garbage, missing, escaping):
        assert sum(str(model) in line for line in errors) == 1, (model, errors)
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["good.onnx", "good.onnx.data"]


def _children(pid: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.add(int(entry.name))
    return found


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "?"


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_sigterm_and_sigint_stop_a_batch_promptly_and_cleanly(tmp_path):
    models = [dql_model(tmp_path / f"m{i}", name=f"m{i}.onnx", weight_bytes=16 * 2**20, seed=i) for i in range(6)]
    for sig in (signal.SIGTERM, signal.SIGINT):
        out = tmp_path / f"out{sig}"
        proc = subprocess.Popen(
            [PY, "-m", "onnx_qrewrite", "rewrite", *map(str, models), "-o", f"{out}/", "--jobs", "2"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            **INTERRUPTIBLE,
        )
        deadline = time.monotonic() + 60
        workers: set[int] = set()
        while time.monotonic() < deadline and not (out.exists() and any(out.iterdir())):
            workers |= _children(proc.pid)
            time.sleep(0.05)
        workers |= _children(proc.pid)
        assert workers, "no worker started"
        proc.send_signal(sig)
        start = time.monotonic()
        _, err = proc.communicate(timeout=60)
        stopped_in = time.monotonic() - start
        assert proc.returncode == 128 + sig, err
        assert "Traceback" not in err
        assert stopped_in < 15, stopped_in
        # Workers are gone (multiprocessing's resource tracker may take a moment to see EOF).
        linger = time.monotonic() + 10
        while [w for w in workers if _alive(w)] and time.monotonic() < linger:
            time.sleep(0.1)
        assert not [_cmdline(w) for w in workers if _alive(w)], "processes left running"
        assert [p.name for p in out.iterdir() if outputs.TEMP_MARK in p.name] == []
        written = {p.name for p in out.iterdir() if p.suffix == ".onnx"}
        assert len(written) < len(models), "the pending models were not stopped"
        for name in written:  # what was committed is complete
            assert (out / f"{name}.data").stat().st_size >= 16 * 2**20
        os.sync()
