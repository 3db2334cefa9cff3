"""The one process per interpreter that converts with onnx2tf and runs ai-edge-litert for
``--runtime tflite`` (_tflite_child.py, in :func:`~.runtimes.tflite_python`'s Python).

It used to be a new process per conversion and per run: 2.7 s of CPU for the sample MLP's
conversion, of which 2.3 s were the start (imports, onnx2tf's schema module), and 0.55 s for each
run. One process serves every runner of this process instead (a zoo's models, the localiser's
cut-out models), one request at a time; it is started on first use, started again when it has
died, and stopped at exit (stdin closed: it ends; killed after 10 s).

What a failure says is what it said with one process per request: the last line the request
printed on stderr (the exception), or how the process died ("it crashed (signal N)"), in one line
naming the model. An interrupt (KeyboardInterrupt, a signal turned into an exception) while a
request runs kills and reaps the process, then goes on: the next request starts another. So does
an answer line cut short (the process died writing it) or not a well-formed answer: the process
is killed and reaped, and the error says "the child's answer was garbled". A process this one
forked does not share it (the pipes are this process's): it starts its own.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

from onnx_qrewrite.errors import InvalidModelError
from onnx_qrewrite.io import outputs
from onnx_qrewrite.verify._tflite_child import HOME_PREFIX, HOST_PID_VARIABLE

__all__ = ["TFLiteChild", "tflite_child"]

#: Seconds one request (a conversion, a run) may take, as the one-shot processes had.
TIMEOUT = 1800.0
CHILD = str(Path(__file__).with_name("_tflite_child.py"))


class TFLiteChild:
    """A _tflite_child.py process serving requests (its module docstring says the protocol)."""

    def __init__(self, python: str, script: str = CHILD) -> None:
        self.command = [python, script]
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._owner = 0  # the pid that started _proc
        self._home: str | None = None  # its private folder, removed when it stops
        self._stderr: IO[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The serving process's id while it runs (tests check it is reaped)."""
        return self._proc.pid if self._proc is not None and self._owner == os.getpid() else None

    def request(self, label: str, what: str, **fields: str) -> dict[str, Any]:
        """The child's answer to ``fields``; InvalidModelError "{label}: tflite {what} the model: ..."
        when it failed or died."""
        with self._lock:
            proc = self._started()
            assert proc.stdin is not None and self._stderr is not None
            self._stderr.truncate(0)
            try:
                proc.stdin.write(json.dumps(fields).encode() + b"\n")
                proc.stdin.flush()
                line = self._answer(proc)
            except BrokenPipeError:
                line = b""
            except BaseException:
                self._stop(kill=True)
                raise
            if not line:  # it died: how, and what it said, is the message
                failure = self._failure(label, what, proc.wait())
                self._stop(kill=False)
                raise failure
            answer = _parsed(line, fields.get("op", ""))
            if answer is None:  # cut short (it died writing it) or not an answer: as dead
                self._stop(kill=True)
                raise InvalidModelError(f"{label}: tflite {what} the model: the child's answer was garbled")
            if not answer["ok"]:
                raise self._failure(label, what, answer["code"])
            return answer

    def close(self) -> None:
        """Stop the process (stdin closed: it ends its loop; killed if it has not after 10 s)."""
        with self._lock:
            if self._owner == os.getpid():
                self._stop(kill=False)
            else:
                self._forget()

    def _started(self) -> subprocess.Popen[bytes]:
        if self._owner != os.getpid():
            self._forget()
        elif self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._stop(kill=False)  # it exited between requests: reap it, remove its folder
        self._home = tempfile.mkdtemp(prefix=HOME_PREFIX)
        outputs.register_folder(self._home)  # a batch worker stopped by SIGTERM removes it too
        self._stderr = open(Path(self._home) / "stderr", "ab+")  # noqa: SIM115 - closed by _stop
        # In its private folder: onnx2tf leaves temporary files (sym_shape_infer_temp.onnx,
        # <uuid>.data) in its working directory, which would otherwise be the user's.
        self._proc = subprocess.Popen(
            self.command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            cwd=self._home,
            env=os.environ | {HOST_PID_VARIABLE: str(os.getpid())},
        )
        self._owner = os.getpid()
        return self._proc

    def _answer(self, proc: subprocess.Popen[bytes]) -> bytes:
        """Its answer line, or b"" when it died first."""
        assert proc.stdout is not None
        deadline = time.monotonic() + TIMEOUT
        while not select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.command, TIMEOUT)
        return proc.stdout.readline()

    def _failure(self, label: str, what: str, code: int) -> InvalidModelError:
        """The one-line error: the last line the request printed on stderr (progress bars and
        onnx2tf's INFO lines aside), else the exit code; or the signal that killed the process."""
        if code < 0:
            return InvalidModelError(f"{label}: tflite {what} the model: it crashed (signal {-code})")
        assert self._stderr is not None
        self._stderr.seek(0)
        said = self._stderr.read().decode(errors="replace")
        # Not tqdm's progress bars nor onnx2tf's INFO lines:
        lines = [line for line in said.splitlines() if line.strip() and "it/s" not in line]
        lines = [line for line in lines if not line.startswith("INFO:")]
        return InvalidModelError(f"{label}: tflite {what} the model: {lines[-1] if lines else code}")

    def _stop(self, kill: bool) -> None:
        """End (or kill) and reap the process, and remove its folder."""
        proc, self._proc = self._proc, None
        try:
            if proc is not None:
                if kill:
                    proc.kill()
                _close(proc.stdin, proc.stdout)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                except BaseException:  # an interrupt (SIGTERM) while waiting: still killed and reaped
                    proc.kill()
                    proc.wait()
                    raise
        finally:  # its folder goes whatever happened above
            _close(self._stderr)
            self._stderr = None
            if self._home is not None:
                shutil.rmtree(self._home, ignore_errors=True)
                outputs.forget_folder(self._home)
                self._home = None

    def _forget(self) -> None:
        """In a forked copy of the process that started it: drop this process's copies of its pipes,
        leaving the process and its folder to their owner."""
        if self._proc is not None:
            _close(self._proc.stdin, self._proc.stdout)
        _close(self._stderr)
        self._proc, self._stderr, self._home = None, None, None
        self._owner = os.getpid()


#: What an answer to each request carries besides "ok" (the child's module docstring).
_ANSWERS = {"convert": ("path",)}


def _parsed(line: bytes, op: str) -> dict[str, Any] | None:
    """The answer ``line`` holds, or None unless it is a whole line (a child dying mid-write leaves
    it without its newline) of a well-formed answer to ``op``."""
    try:
        answer = json.loads(line) if line.endswith(b"\n") else None
    except ValueError:  # not JSON, or not UTF-8
        return None
    if not isinstance(answer, dict) or not isinstance(answer.get("ok"), bool):
        return None
    wanted = _ANSWERS.get(op, ()) if answer["ok"] else ("code",)
    kinds = {"path": str, "code": int}
    if all(type(answer.get(key)) is kinds[key] for key in wanted):  # bool is no code
        return answer
    return None


def _close(*streams: IO[bytes] | None) -> None:
    for stream in streams:
        try:
            if stream is not None:
                stream.close()
        except OSError:  # a broken pipe on flushing what it never read
            pass


_CHILDREN: dict[str, TFLiteChild] = {}


def tflite_child(python: str) -> TFLiteChild:
    """The process-wide child for ``python``."""
    if python not in _CHILDREN:
        _CHILDREN[python] = TFLiteChild(python)
    return _CHILDREN[python]


@atexit.register
def _close_all() -> None:
    for child in list(_CHILDREN.values()):
        child.close()
