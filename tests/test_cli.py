"""The command line: real processes, real exit codes, one-line errors, nothing half-written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from _cli_helpers import cli_in_process
from conftest import SAMPLES, run
from onnx import TensorProto, helper

SAMPLE = SAMPLES / "dynamic_mlp.onnx"


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The real program: the end-to-end rewrite, byte-identical outputs across processes (each
    with its own hash seed), ``-q`` leaving the process's stderr empty, the console script."""
    return subprocess.run(
        [sys.executable, "-m", "onnx_qrewrite", *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=120
    )


def cli_here(*args: object) -> subprocess.CompletedProcess:
    """The command line in this process (tests/_cli_helpers.py), for the batteries of bad input,
    usage errors and options: what they print, write and exit with is the command's, not the
    process's."""
    return cli_in_process(*args)


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


def test_rewrite_sample_prints_summary_and_writes_valid_model(tmp_path):
    out = tmp_path / "out.onnx"
    report = tmp_path / "report.json"
    proc = cli("rewrite", SAMPLE, "-o", out, "--report", report)
    assert proc.returncode == 0, proc.stderr
    assert "dql-expand: 3 nodes rewritten" in proc.stdout
    assert "DynamicQuantizeLinear" in proc.stdout  # op counts before/after
    model = onnx.load(out)
    onnx.checker.check_model(model, full_check=True)
    assert not any(n.op_type in ("DynamicQuantizeLinear", "MatMulInteger") for n in model.graph.node)
    data = json.loads(report.read_text())
    assert data["by_rule"] == {"dql-expand": 3, "int-matmul-float": 3} and len(data["rewrites"]) == 6
    feeds = dict(np.load(SAMPLES / "dynamic_mlp.inputs.npz"))
    want = dict(np.load(SAMPLES / "dynamic_mlp.outputs.npz"))
    got = run(model, feeds)
    for k, expected in want.items():
        np.testing.assert_array_equal(got[k], expected)


def test_output_is_byte_identical_across_runs_and_rewriting_again_changes_nothing(tmp_path):
    a, b, c = tmp_path / "a.onnx", tmp_path / "b.onnx", tmp_path / "c.onnx"
    assert cli("-q", "rewrite", SAMPLE, "-o", a).returncode == 0
    assert cli("-q", "rewrite", SAMPLE, "-o", b).returncode == 0
    assert a.read_bytes() == b.read_bytes()
    proc = cli("rewrite", a, "-o", c)
    assert proc.returncode == 0 and "no rule applied" in proc.stdout
    assert c.read_bytes() == a.read_bytes()


def test_quiet_prints_nothing(tmp_path):
    proc = cli("-q", "rewrite", SAMPLE, "-o", tmp_path / "o.onnx")
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == ""


def test_rules_lists_one_line_per_rule():
    proc = cli("rules")
    assert proc.returncode == 0
    line = next(s for s in proc.stdout.splitlines() if s.startswith("dql-expand"))
    assert "DynamicQuantizeLinear" in line and "QuantizeLinear" in line.split("->")[1]


def _dql_int_model() -> onnx.ModelProto:
    node = helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "s", "zp"], name="bad_dql")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.INT32, [4])],
        [helper.make_tensor_value_info("y", TensorProto.UINT8, [4])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def _checker_failure_model() -> onnx.ModelProto:
    """Two nodes writing one name: not single static assignment."""
    nodes = [helper.make_node("Relu", ["x"], ["y"], name="r"), helper.make_node("Neg", ["x"], ["y"], name="n")]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def _missing_input_model() -> onnx.ModelProto:
    node = helper.make_node("Relu", ["undefined_input"], ["y"], name="r")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


BAD_INPUTS = {
    "missing": (None, "no such file"),
    "empty": (b"", "the file is empty"),
    "corrupt": (bytes(range(256)) * 8, "not a valid ONNX model"),
    "truncated": (SAMPLE.read_bytes()[: len(SAMPLE.read_bytes()) // 2], "not a valid ONNX model"),
    "checker": (_checker_failure_model().SerializeToString(), "fails the ONNX checker"),
    "missing_input": (
        _missing_input_model().SerializeToString(),
        "node 'r' (Relu, main graph) reads 'undefined_input', which no node, graph input or initializer provides",
    ),
    "dql_int_input": (_dql_int_model().SerializeToString(), "node bad_dql: DynamicQuantizeLinear input 'x' is int32"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_invalid_input_model_exits_3_names_file_and_writes_nothing(tmp_path, case):
    content, message = BAD_INPUTS[case]
    model = tmp_path / f"{case}.onnx"
    if content is not None:
        model.write_bytes(content)
    out = tmp_path / "out" / "o.onnx"
    out.parent.mkdir()
    proc = cli_here("rewrite", model, "-o", out)
    assert proc.returncode == 3, proc.stderr
    line = _one_error_line(proc)
    assert message in line
    if case != "dql_int_input":
        assert str(model) in line
    assert list(out.parent.iterdir()) == []


def test_unwritable_output_exits_2_and_writes_nothing(tmp_path):
    proc = cli_here("rewrite", SAMPLE, "-o", tmp_path / "no" / "such" / "dir" / "o.onnx")
    assert proc.returncode == 2
    assert "does not exist" in _one_error_line(proc)
    assert list(tmp_path.iterdir()) == []


def test_output_folder_takes_the_input_file_name(tmp_path):
    proc = cli_here("-q", "rewrite", SAMPLE, "-o", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == [SAMPLE.name]


def test_refuses_to_overwrite_the_input(tmp_path):
    model = tmp_path / "m.onnx"
    model.write_bytes(SAMPLE.read_bytes())
    proc = cli_here("rewrite", model, "-o", model)
    assert proc.returncode == 2 and "refusing to overwrite the input" in _one_error_line(proc)
    assert model.read_bytes() == SAMPLE.read_bytes()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--only", "no-such-rule"], "--only: no rule 'no-such-rule'"),
        (["--skip", "nope"], "--skip: no rule 'nope'"),
        (["--skip", "int-matmul-int3"], "--skip: no rule 'int-matmul-int3' (did you mean 'int-matmul-int32'?)"),
        (["--only", "qop-matmull"], "--only: no rule 'qop-matmull' (did you mean 'qop-matmul'?)"),
        (["--rule-option", "garbage"], "expected RULE_ID.KEY=VALUE"),
        (["--rule-option", "nope.key=1"], "option for unknown rule 'nope'"),
        (["--rules", "/no/such/rules.toml"], "rule file not found"),
        (["--keep-opset", "--target-opset", "21"], "contradict"),
        (["--target-opset", "30"], "above 26"),
        (["--form", "weight-onyl", "--allow-approximate"], "no form named 'weight-onyl' (did you mean 'weight-only'?)"),
        (
            ["--form", "weight-only", "--allow-approximate", "--form-option", "weight=float"],
            "(did you mean 'weights'?)",
        ),
        (["--form-option", "weights=float"], "--form-option needs --form"),
    ],
)
def test_usage_errors_exit_2_with_one_line(tmp_path, args, message):
    out = tmp_path / "o.onnx"
    proc = cli_here("rewrite", SAMPLE, "-o", out, *args)
    assert proc.returncode == 2, proc.stderr
    assert message in _one_error_line(proc)
    assert not out.exists()


def test_bad_rule_file_exits_2_naming_file_and_rule(tmp_path):
    rules = tmp_path / "mine.toml"
    rules.write_text('[[rule]]\nid = "x"\nsummary = "s"\nbuilder = "no_such_builder"\nmatch = {op = "Foo"}\n')
    proc = cli_here("rewrite", SAMPLE, "-o", tmp_path / "o.onnx", "--rules", rules)
    assert proc.returncode == 2
    line = _one_error_line(proc)
    assert str(rules) in line and "rule 'x'" in line and "unknown builder 'no_such_builder'" in line


def test_cannot_lower_exits_4_and_writes_nothing(tmp_path):
    model = tmp_path / "m27.onnx"
    m = onnx.load(SAMPLE)
    m.opset_import[0].version = 27  # valid ONNX, above what onnxruntime 1.31 loads
    onnx.save(m, model)
    proc = cli_here("rewrite", model, "-o", tmp_path / "o.onnx")
    assert proc.returncode == 4
    assert "cannot be lowered" in _one_error_line(proc)
    assert not (tmp_path / "o.onnx").exists()
    proc = cli_here("rewrite", model, "-o", tmp_path / "o.onnx", "--allow-unlowered")
    assert proc.returncode == 0 and "left in place" in proc.stdout


def test_console_script_is_installed():
    exe = Path(sys.executable).parent / "onnx-qrewrite"
    proc = subprocess.run([str(exe), "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and "onnx-qrewrite" in proc.stdout


@pytest.mark.parametrize("option", ["--report", "--junit"])
def test_unwritable_report_is_a_usage_error_before_any_work(tmp_path, option):
    out = tmp_path / "o.onnx"
    extra = ["--verify"] if option == "--junit" else []
    proc = cli_here("rewrite", SAMPLE, "-o", out, *extra, option, "/no/such/folder/r.out")
    assert proc.returncode == 2, proc.stderr
    assert f"{option} /no/such/folder/r.out: the folder /no/such/folder does not exist" in _one_error_line(proc)
    assert not out.exists()
    proc = cli_here("verify", SAMPLE, SAMPLE, option, "/no/such/folder/r.out")
    assert proc.returncode == 2 and "does not exist" in _one_error_line(proc)


@pytest.mark.parametrize("name", sorted(__import__("onnx_qrewrite.cli").cli.SUBCOMMANDS))
def test_every_subcommand_takes_the_global_options_after_its_name(name):
    from click.testing import CliRunner

    from onnx_qrewrite.cli import main

    result = CliRunner().invoke(main, [name, "-h"])
    assert result.exit_code == 0 and "-q, --quiet" in result.output and "-v, --verbose" in result.output


def test_form_selects_a_named_form_and_its_options(tmp_path):
    out = tmp_path / "o.onnx"
    args = ["--form", "weight-only", "--allow-approximate", "--form-option", "weights=float"]
    proc = cli_here("rewrite", SAMPLE, "-o", out, *args)
    assert proc.returncode == 0, proc.stderr
    assert "weight-only-matmul: 3 nodes rewritten [approximate]" in proc.stdout
    ops = {n.op_type for n in onnx.load(out).graph.node}
    assert not ops & {"DynamicQuantizeLinear", "MatMulInteger", "DequantizeLinear"}, ops
    proc = cli_here("inspect", SAMPLE, "--form", "weight-only", "--allow-approximate")
    assert proc.returncode == 0 and "weight-only-matmul" in proc.stdout, proc.stdout + proc.stderr
    proc = cli_here("rules", "--form", "weight-only", "--long")
    assert proc.returncode == 0 and "weight-only-remove-dead" in proc.stdout


@pytest.mark.parametrize(
    ("where", "argv"),
    [("make_context", ["rules"]), ("make_context", ["rewrite", "--help"]), ("after the command", ["rules"])],
)
@pytest.mark.parametrize("terminate", [False, True])
def test_an_interrupt_outside_a_subcommand_exits_130_or_143_not_abort(monkeypatch, capsys, where, argv, terminate):
    """click's standalone mode turns Ctrl-C that lands while it parses the arguments, or after the
    command returned, into "Aborted!" and exit 1, our "verification disagreed". Everywhere in the
    command line an interrupt exits 128 + the signal number with our one line (seen under load:
    the SIGINT test of tests/test_safety_outputs.py got "Aborted!" and 1)."""
    import click

    from onnx_qrewrite import cli
    from onnx_qrewrite.io.signals import Terminated

    exc = Terminated() if terminate else KeyboardInterrupt()

    def interrupt(*args, **kwargs):
        raise exc

    if where == "make_context":
        monkeypatch.setattr(cli._LazyGroup, "make_context", interrupt)
    else:  # the command ran; the interrupt lands as click tears its context down
        monkeypatch.setattr(click.Context, "__exit__", interrupt)
    with pytest.raises(SystemExit) as ended:
        cli.main.main(argv, prog_name="onnx-qrewrite")
    assert ended.value.code == (143 if terminate else 130)
    err = capsys.readouterr().err
    assert "Aborted!" not in err
    assert err.strip().splitlines()[-1] == f"onnx-qrewrite: {'terminated' if terminate else 'interrupted'}"


def test_click_exits_stay_as_they_were(capsys):
    """Running click non-standalone must keep its exits: usage errors 2 with its message, --help 0."""
    from onnx_qrewrite import cli

    with pytest.raises(SystemExit) as ended:
        cli.main.main(["no-such-command"], prog_name="onnx-qrewrite")
    assert ended.value.code == 2
    assert "No such command 'no-such-command'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as ended:
        cli.main.main(["--help"], prog_name="onnx-qrewrite")
    assert ended.value.code == 0
    assert "Usage: onnx-qrewrite" in capsys.readouterr().out


def test_the_command_line_gives_sigterm_back_to_an_in_process_caller():
    """The group raises Terminated on SIGTERM while a command runs; a test or notebook that runs the
    command line in-process gets its own handler back afterwards (a pytest run that had called the
    CLI ignored a SIGTERM: it raised Terminated into pytest)."""
    import signal

    from onnx_qrewrite import cli

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as ended:
        cli.main.main(["rules"], prog_name="onnx-qrewrite")
    assert ended.value.code == 0
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_native_crash_leaves_the_python_stack_on_stderr():
    """A death in native code (exit -11) under the command line's handlers dumps where Python was."""
    code = "from onnx_qrewrite.io import signals; signals.install(); import ctypes; ctypes.string_at(0)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -11
    assert "Fatal Python error: Segmentation fault" in proc.stderr
    assert "string_at" in proc.stderr
