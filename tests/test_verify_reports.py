"""Report renderings: JSON that validates against the shipped schema, JUnit XML, the table."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import jsonschema
import numpy as np
import onnx
import pytest
from _verify_helpers import toy_quark_model, toy_rewrite
from onnx import TensorProto, helper

from onnx_qrewrite.verify import SCHEMA_PATH, verify

SCHEMA = json.loads(SCHEMA_PATH.read_text())


def _validate(data: dict) -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    jsonschema.Draft202012Validator(SCHEMA).validate(data)


@pytest.fixture(scope="module")
def passing():
    original = toy_quark_model()
    return verify(original, toy_rewrite(original))


@pytest.fixture(scope="module")
def failing():
    original = toy_quark_model()
    return verify(original, toy_rewrite(original, "zero-point"))


def _div_by_zero_pair() -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """y = x versus y = x / 0: infinities and NaN on the rewritten side only."""

    def model(nodes, inits):
        graph = helper.make_graph(
            nodes,
            "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
            initializer=inits,
        )
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)

    zero = onnx.numpy_helper.from_array(np.float32(0), "zero")
    return model([helper.make_node("Identity", ["x"], ["y"])], []), model(
        [helper.make_node("Div", ["x", "zero"], ["y"])], [zero]
    )


def test_a_passing_report_validates_and_says_what_ran(passing, tmp_path):
    path = tmp_path / "report.json"
    passing.write_json(path)
    data = json.loads(path.read_text())
    _validate(data)
    assert data["tool"]["name"] == "onnx-qrewrite" and data["verdict"] == "passed"
    assert data["versions"]["onnxruntime"] and data["versions"]["onnxruntime_extensions"]
    assert data["settings"]["ort_opt_level"] == "disable" and data["settings"]["reference_kernels"] is True
    assert [s["name"] for s in data["inputs"]["samples"]][:2] == ["random-0", "random-1"]
    assert [o["name"] for o in data["outputs"]] == ["y", "yq"]
    assert data["outputs"][1]["comparison"] == "integer" and data["outputs"][1]["exact_match_rate"] == 1.0
    assert data["localization"] is None and data["summary"].startswith("PASSED | ")


def test_a_failing_report_validates_and_carries_the_localisation(failing):
    data = failing.to_dict()
    _validate(data)
    assert data["verdict"] == "failed"
    loc = data["localization"]
    assert (loc["node"], loc["rule"], loc["origin"], loc["value"]) == ("qx_q", "test.quantize", "qx", "xq")
    assert loc["comparison"]["verdict"] == "failed"
    worst = data["outputs"][1]["worst"]
    assert worst["original"] != worst["rewritten"] and len(worst["index"]) == 2


def test_non_finite_statistics_are_written_as_strings_the_schema_accepts():
    original, rewritten = _div_by_zero_pair()
    report = verify(original, rewritten, inputs={"x": np.array([1, -1, 0, 2], np.float32)})
    data = json.loads(json.dumps(report.to_dict(), allow_nan=False))  # strict JSON: no Infinity/NaN tokens
    _validate(data)
    (out,) = data["outputs"]
    assert out["max_abs_error"] == "inf" and out["worst"]["rewritten"] in ("inf", "-inf", "nan")
    assert out["inf"] == {"original": 0, "rewritten": 3} and out["nan"] == {"original": 0, "rewritten": 1}


def test_the_schema_rejects_a_report_missing_the_verdict(passing):
    data = passing.to_dict()
    del data["verdict"]
    with pytest.raises(jsonschema.ValidationError):
        _validate(data)


def test_junit_has_one_test_case_per_output_and_failures_carry_the_stats(failing, passing, tmp_path):
    path = tmp_path / "junit.xml"
    failing.write_junit(path)
    root = ET.parse(path).getroot()
    assert root.tag == "testsuites" and root.get("failures") == "2"
    (suite,) = root.findall("testsuite")
    cases = suite.findall("testcase")
    assert [c.get("name") for c in cases] == ["y", "yq"]
    failure = cases[1].find("failure")
    assert "elements differ (exact)" in failure.get("message")
    assert "worst element:" in failure.text and "first differing node: 'qx_q'" in failure.text
    assert all(c.find("failure") is None for c in passing.to_junit().iter("testcase"))


def test_the_table_lists_every_output_and_ends_with_the_verdict_line(failing):
    lines = failing.to_table().splitlines()
    assert lines[-1] == failing.summary and lines[-1].startswith("FAILED | 2 of 2 outputs differ")
    header = next(i for i, line in enumerate(lines) if line.startswith("output"))
    assert lines[header].split()[:2] == ["output", "dtype"]  # only outputs: no "checked value" rows
    assert [line.split()[0] for line in lines[header + 1 : header + 3]] == ["y", "yq"]
    assert any(line.startswith("first differing node: 'qx_q'") for line in lines)
