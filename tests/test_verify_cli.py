"""``onnx-qrewrite verify`` as a user runs it: real processes, exit codes, one-line errors."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import jsonschema
import onnx
import pytest
from _cli_helpers import cli_in_process
from _verify_helpers import cli, invoke, one_error_line, save_toy_models
from onnx import TensorProto, helper

from onnx_qrewrite.verify import SCHEMA_PATH


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> dict[str, Path]:
    return save_toy_models(tmp_path_factory.mktemp("toy"))


def test_agreeing_models_exit_0_and_write_every_report(toy, tmp_path):
    report, junit, saved = tmp_path / "r.json", tmp_path / "j.xml", tmp_path / "in.npz"
    proc = cli(
        "verify",
        toy["original"],
        toy["good"],
        "--report",
        report,
        "--junit",
        junit,
        "--save-inputs",
        saved,
        "--input-shape",
        "x:3,4",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "PASSED | 2 outputs agree on 6 samples (opt-level disable)"
    data = json.loads(report.read_text())
    jsonschema.validate(data, json.loads(SCHEMA_PATH.read_text()))
    assert data["settings"]["inputs"]["input_shapes"] == {"x": [3, 4]}
    assert [c.get("name") for c in ET.parse(junit).getroot().iter("testcase")] == ["y", "yq"]
    assert saved.is_file()


def test_disagreeing_models_exit_1_and_name_the_first_differing_node(toy):
    proc = cli("verify", toy["original"], toy["bad"])
    assert proc.returncode == 1, proc.stderr
    assert (
        "first differing node: 'dqw_dq' (ai.onnx::DequantizeLinear, rule test.dequantize, "
        "replacing original node 'dqw')" in proc.stdout
    )
    assert proc.stdout.splitlines()[-1].startswith("FAILED | 2 of 2 outputs differ")
    assert proc.stderr == ""


def test_quiet_prints_nothing_but_keeps_the_exit_code(toy):
    proc = cli("-q", "verify", toy["original"], toy["bad"])
    assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", "")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--atol", "tiny"], "--atol: expected a number or NAME:VALUE, got 'tiny'"),
        (["--rtol", "nope:1e-3"], "--atol/--rtol/--lsb: the model has no output named 'nope'"),
        (["--input-shape", "x:a,b"], "--input-shape: dimensions must be integers, got 'x:a,b'"),
        (["--int-range", "5"], "--int-range: expected LO,HI (two integers), got '5'"),
        (["--threads", "-1"], "--threads: expected a count >= 0 (0: onnxruntime's default), got -1"),
        (["--custom-op-library", "missing.so"], "--custom-op-library: missing.so: no such file"),
        (["--samples", "0", "--no-battery"], "--samples: 0 random samples and no battery leaves nothing to run"),
    ],
)
def test_bad_options_exit_2_with_one_line_naming_the_option(toy, args, expected):
    proc = cli_in_process("verify", toy["original"], toy["good"], *args)  # an option battery: in this process
    assert proc.returncode == 2
    assert one_error_line(proc) == f"onnx-qrewrite: error: {expected}"


def test_an_unknown_choice_is_a_click_usage_error(toy):
    proc = cli("verify", toy["original"], toy["good"], "--ort-opt-level", "fast")
    assert proc.returncode == 2 and "--ort-opt-level" in proc.stderr


def test_a_missing_model_exits_3_naming_the_file(toy, tmp_path):
    missing = tmp_path / "missing.onnx"
    proc = cli("verify", toy["original"], missing)
    assert proc.returncode == 3
    assert one_error_line(proc) == f"onnx-qrewrite: error: {missing}: no such file"


def test_a_model_onnxruntime_cannot_load_exits_3_naming_the_file(toy, tmp_path):
    node = helper.make_node("Frobnicate", ["x"], ["y"], domain="com.example")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
    )
    path = tmp_path / "strange.onnx"
    onnx.save(
        helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)], ir_version=8
        ),
        path,
    )
    proc = cli("verify", path, toy["good"])
    assert proc.returncode == 3
    line = one_error_line(proc)
    assert line.startswith(f"onnx-qrewrite: error: {path}: onnxruntime cannot load the model: ")
    assert "Frobnicate" in line


def test_a_rewritten_model_still_holding_vendor_ops_is_refused_with_the_reason(toy, tmp_path):
    copy = tmp_path / "copy.onnx"  # another file: the same file twice is "nothing compared"
    copy.write_bytes(toy["original"].read_bytes())
    proc = cli("verify", toy["original"], copy)
    assert proc.returncode == 3
    assert "must run in stock onnxruntime, but it still holds 5 non-standard node(s), the first 'qx'" in one_error_line(
        proc
    )


def test_custom_op_library_replaces_the_reference_kernels(toy):
    # onnxruntime-extensions' own library has no Quark ops: with it instead of the reference
    # kernels, the original cannot load, which shows the option took effect.
    from onnxruntime_extensions import get_library_path

    proc = cli("verify", toy["original"], toy["good"], "--custom-op-library", get_library_path())
    assert proc.returncode == 3
    line = one_error_line(proc)
    assert f"{toy['original']}: onnxruntime cannot load the model" in line and "ExtendedQuantizeLinear" in line


def test_saved_inputs_can_be_replayed(toy, tmp_path):
    saved, report = tmp_path / "in.npz", tmp_path / "r.json"
    first = invoke("verify", toy["original"], toy["bad"], "--save-inputs", saved, "--samples", "1")
    assert first.exit_code == 1, first.output
    again = invoke("verify", toy["original"], toy["bad"], "--inputs", saved, "--report", report)
    assert again.exit_code == 1, again.output
    data = json.loads(report.read_text())
    assert data["settings"]["inputs"]["source"] == "file" and data["settings"]["inputs"]["file"] == str(saved)
    assert [s["name"] for s in data["inputs"]["samples"]] == ["random-0", "zeros", "constant", "wide-range", "negative"]
    assert first.output.splitlines()[-1] == again.output.splitlines()[-1]


def test_per_output_tolerances_decide_the_verdict(toy):
    # Through the group, as a user runs it: invoking the subcommand alone made click cache its help
    # option without the group's "-h", and a later "verify -h" in the same process failed.
    args = ["verify", toy["original"], toy["bad"], "--no-localize"]
    assert invoke(*args, "--atol", "y:10").exit_code == 1  # yq still differs
    loose = invoke(*args, "--atol", "y:10", "--lsb", "yq:255")
    assert loose.exit_code == 0, loose.output
    assert "lsb 255" in loose.output and "atol 10, rtol 1e-05" in loose.output
