"""Many models at once, rewrite --verify, and progress on a terminal only."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
import xml.etree.ElementTree as ET
from pathlib import Path

import onnx
import pytest
from _cli_helpers import cli_in_process
from conftest import SAMPLES
from onnx import TensorProto, helper

PY = sys.executable


def cli(*args) -> subprocess.CompletedProcess:
    """The command line in this process (tests/_cli_helpers.py), for what a batch prints, writes and
    exits with; :func:`cli_process` where the workers of ``--jobs`` or the process's own stderr are
    what is tested."""
    return cli_in_process(*args)


def cli_process(*args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, "-m", "onnx_qrewrite", *map(str, args)], capture_output=True, text=True, timeout=300, **kw
    )


def _dql_outputs_model(path: Path) -> Path:
    """DQL whose scale and zero point are graph outputs: the all-zeros battery input exposes the
    spec/onnxruntime difference in y_scale directly."""
    node = helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "y_scale", "y_zp"], name="dql")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8])],
        [
            helper.make_tensor_value_info("y", TensorProto.UINT8, [8]),
            helper.make_tensor_value_info("y_scale", TensorProto.FLOAT, []),
            helper.make_tensor_value_info("y_zp", TensorProto.UINT8, []),
        ],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8), path)
    return path


def test_many_models_one_failure_does_not_stop_the_others(tmp_path):
    bad = tmp_path / "broken.onnx"
    bad.write_bytes(b"not a model at all")
    out = tmp_path / "out"
    models = [SAMPLES / "dynamic_mlp.onnx", bad, SAMPLES / "dynamic_cnn.onnx"]
    proc = cli_process("rewrite", *models, "-o", f"{out}/", "--jobs", "2", "--report", tmp_path / "r.json")
    assert proc.returncode == 3, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["dynamic_cnn.onnx", "dynamic_mlp.onnx"]
    assert "3 models: 2 ok, 1 failed (worst exit code 3)" in proc.stdout
    assert f"{bad}: not a valid ONNX model" in proc.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert [m.get("error") is None for m in report["models"]] == [True, False, True]


def test_exit_code_is_the_worst_result(tmp_path):
    unlowerable = tmp_path / "opset27.onnx"
    m = onnx.load(SAMPLES / "dynamic_mlp.onnx")
    m.opset_import[0].version = 27
    onnx.save(m, unlowerable)
    corrupt = tmp_path / "corrupt.onnx"
    corrupt.write_bytes(b"\x08")
    proc = cli("-q", "rewrite", corrupt, unlowerable, "-o", tmp_path / "out")
    assert proc.returncode == 4, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 2


def test_several_models_need_an_output_folder_and_distinct_names(tmp_path):
    (tmp_path / "a").mkdir()
    twin = tmp_path / "a" / "dynamic_mlp.onnx"
    twin.write_bytes((SAMPLES / "dynamic_mlp.onnx").read_bytes())
    proc = cli("rewrite", SAMPLES / "dynamic_mlp.onnx", twin, "-o", tmp_path / "out")
    assert proc.returncode == 2 and "both named 'dynamic_mlp.onnx'" in proc.stderr
    afile = tmp_path / "file.onnx"
    afile.write_bytes(b"x")
    proc = cli("rewrite", SAMPLES / "dynamic_mlp.onnx", SAMPLES / "dynamic_cnn.onnx", "-o", afile)
    assert proc.returncode == 2 and "names a folder" in proc.stderr


def test_rewrite_verify_passes_on_a_correct_rewrite(tmp_path):
    out = tmp_path / "o.onnx"
    proc = cli(
        "rewrite",
        SAMPLES / "dynamic_mlp.onnx",
        "-o",
        out,
        "--verify",
        "--report",
        tmp_path / "r.json",
        "--junit",
        tmp_path / "j.xml",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASSED |" in proc.stdout and out.exists()
    assert json.loads((tmp_path / "r.json").read_text())["verification"]["verdict"] == "passed"
    assert len(ET.parse(tmp_path / "j.xml").getroot().findall(".//testcase")) == 1


def test_rewrite_verify_disagreement_exits_1_and_removes_the_output(tmp_path):
    model = _dql_outputs_model(tmp_path / "dql.onnx")
    out = tmp_path / "spec.onnx"
    # The spec body gives scale 0.0 on all zeros where onnxruntime's kernel gives 1.0.
    proc = cli("rewrite", model, "-o", out, "--dql-semantics", "spec", "--verify")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAILED |" in proc.stdout and "y_scale" in proc.stdout
    assert not out.exists()
    proc = cli("rewrite", model, "-o", out, "--dql-semantics", "spec", "--verify", "--keep-failed")
    assert proc.returncode == 1 and out.exists()


def test_verify_several_pairs_with_jobs_and_one_junit(tmp_path):
    out = tmp_path / "out"
    models = [SAMPLES / "dynamic_mlp.onnx", SAMPLES / "qdq_contrib_u16.onnx"]
    assert cli("-q", "rewrite", *models, "-o", out).returncode == 0
    proc = cli_process(
        "verify",
        *models,
        "--rewritten-dir",
        out,
        "--jobs",
        "2",
        "--junit",
        tmp_path / "j.xml",
        "--report",
        tmp_path / "r.json",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 models: 2 agree, 0 not" in proc.stdout
    suites = ET.parse(tmp_path / "j.xml").getroot().findall("testsuite")
    assert len(suites) == 2 and all(s.get("failures") == "0" for s in suites)
    assert len(json.loads((tmp_path / "r.json").read_text())["models"]) == 2


def test_verify_pair_missing_from_rewritten_dir_is_reported_not_fatal(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    assert cli("-q", "rewrite", SAMPLES / "dynamic_mlp.onnx", "-o", out).returncode == 0
    proc = cli(
        "verify",
        SAMPLES / "dynamic_mlp.onnx",
        SAMPLES / "dynamic_cnn.onnx",
        "--rewritten-dir",
        out,
        "--junit",
        tmp_path / "j.xml",
    )
    assert proc.returncode == 3
    assert "1 agree, 1 not" in proc.stdout
    root = ET.parse(tmp_path / "j.xml").getroot()
    assert root.get("errors") == "1" and len(root.findall("testsuite")) == 2


@pytest.fixture(scope="module")
def chain_model(tmp_path_factory) -> Path:
    """A 2000-block DynamicQuantizeLinear chain: every rewrite phase has work to show."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.models import make_dql_chain

    return make_dql_chain(2000, tmp_path_factory.mktemp("chain") / "chain.onnx")


#: Bars appear at once: whether one is seen never depends on how fast this machine is.
NO_DELAY = {**os.environ, "ONNX_QREWRITE_PROGRESS_DELAY": "0"}


def _run_with_terminal_stderr(args: list[str], env: dict[str, str] | None = None) -> tuple[int, str]:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a terminal has a size
    proc = subprocess.Popen(
        [PY, "-m", "onnx_qrewrite", *args], stdout=subprocess.DEVNULL, stderr=slave, env=env or NO_DELAY
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return proc.wait(timeout=120), b"".join(chunks).decode(errors="replace")


def test_progress_bar_on_a_terminal_only(chain_model, tmp_path):
    code, shown = _run_with_terminal_stderr(["rewrite", str(chain_model), "-o", str(tmp_path / "a.onnx")])
    assert code == 0
    assert "rewriting nodes" in shown and "/4000" in shown  # DynamicQuantizeLinear and MatMulInteger
    code, shown = _run_with_terminal_stderr(["-q", "rewrite", str(chain_model), "-o", str(tmp_path / "b.onnx")])
    assert code == 0 and shown == ""
    code, shown = _run_with_terminal_stderr(["rewrite", str(chain_model), "-o", str(tmp_path / "d.onnx"), "-q"])
    assert code == 0 and shown == ""  # -q after the subcommand too
    proc = subprocess.run(
        [PY, "-m", "onnx_qrewrite", "rewrite", str(chain_model), "-o", str(tmp_path / "c.onnx")],
        capture_output=True,
        text=True,
        env=NO_DELAY,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stderr == ""  # stderr is a pipe


def test_every_phase_of_a_long_rewrite_shows_on_a_terminal(chain_model, tmp_path):
    """Loading, matching, rewriting, assembling and writing each show: an 18 s rewrite spent most of
    its time outside the one counted phase and showed nothing there."""
    code, shown = _run_with_terminal_stderr(["rewrite", str(chain_model), "-o", str(tmp_path / "a.onnx")])
    assert code == 0
    stages = ["loading model", "matching rules", "rewriting nodes", "assembling the graph", "writing model"]
    positions = [shown.find(stage) for stage in stages]
    assert all(p >= 0 for p in positions), shown
    assert positions == sorted(positions)


def test_the_default_delay_hides_bars_of_short_work(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "ONNX_QREWRITE_PROGRESS_DELAY"}
    env["ONNX_QREWRITE_PROGRESS_DELAY"] = "3600"  # an hour: no phase of this rewrite gets there
    code, shown = _run_with_terminal_stderr(
        ["rewrite", str(SAMPLES / "dynamic_mlp.onnx"), "-o", str(tmp_path / "a.onnx")], env
    )
    assert code == 0 and shown == ""


def test_verify_progress_bar_on_a_terminal(tmp_path):
    out = tmp_path / "mlp.onnx"
    assert cli("-q", "rewrite", SAMPLES / "dynamic_mlp.onnx", "-o", out).returncode == 0
    args = ["verify", str(SAMPLES / "dynamic_mlp.onnx"), str(out), "--samples", "3", "--no-battery"]
    code, shown = _run_with_terminal_stderr(args)
    assert code == 0 and "verifying samples" in shown and "/3" in shown
    assert "loading models" in shown and "starting onnxruntime" in shown
    proc = cli_process(*args)  # nothing on a real process's stderr, native code's included
    assert proc.returncode == 0 and proc.stderr == ""
