"""A target profile's options for catalogue rules (``[[rewrites.options]]``): checked against the
rule's builder contract when the profile loads, as a rule file's options are; used by the plan for
that target only; and overridden by an option the user sets for the rule.

The case that asked for it: LiteRT seemed not to run qop-matmul's run-time-K bound of the QOperator
BERT's attention products, so the tflite profile set ``reduction_length = "recorded"``. What tripped
onnx2tf was the model's QLinearSoftmax (tests/test_targets_runtime.py), which the tflite profile now
refuses, and no shipped profile sets rule options; the mechanism is tested here on a profile of its
own.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from _cli_helpers import cli_in_process
from onnx import TensorProto, helper, numpy_helper

from onnx_qrewrite import rewrite
from onnx_qrewrite.api import load_rules
from onnx_qrewrite.errors import LoweringError, UsageError
from onnx_qrewrite.targets import load_target, plan_for_model
from onnx_qrewrite.targets.profile import parse_target
from onnx_qrewrite.targets.shapes import InputShapes

PROFILE = """
[target]
id = "mini"
title = "a test target without run-time QLinearMatMul"
version = "1"
proof = "spec"

[[source]]
id = "doc"
document = "a document"
version = "v1"

[[ops]]
names = ["QLinearMatMul", "DequantizeLinear", "MatMul", "QuantizeLinear"]
source = "doc"

[[refuse]]
op = "QLinearMatMul"
when = "computed-input"
inputs = [3]
reason = "no run-time weights"
source = "doc"
"""

OPTIONS = """
[[rewrites.options]]
rule = "qop-matmul"
options = { reduction_length = "recorded" }
why = "the run-time bound's output is not run right: give --input-shape"
source = "doc"
"""


def _matmul() -> onnx.ModelProto:
    """One QLinearMatMul of two graph inputs whose reduction length K is symbolic ('k')."""
    consts = [
        numpy_helper.from_array(np.float32(0.02), "a_s"),
        numpy_helper.from_array(np.uint8(7), "a_z"),
        numpy_helper.from_array(np.float32(0.01), "b_s"),
        numpy_helper.from_array(np.uint8(200), "b_z"),
        numpy_helper.from_array(np.float32(0.5), "y_s"),
        numpy_helper.from_array(np.uint8(0), "y_z"),
    ]
    node = helper.make_node("QLinearMatMul", ["a", "a_s", "a_z", "b", "b_s", "b_z", "y_s", "y_z"], ["y"], name="mm")
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info("a", TensorProto.UINT8, [2, "k"]),
            helper.make_tensor_value_info("b", TensorProto.UINT8, ["k", 3]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.UINT8, [2, 3])],
        consts,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def _profile(tmp_path, text: str):
    path = tmp_path / "mini.toml"
    path.write_text(text)
    return str(path)


# -- checked when the profile loads ---------------------------------------------------------------


def _entry(rule: str = "qop-matmul", options: str = '{ reduction_length = "recorded" }') -> str:
    return OPTIONS.replace('"qop-matmul"', f'"{rule}"').replace('{ reduction_length = "recorded" }', options)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (_entry(options='{ reduction_lenght = "recorded" }'), "option 'reduction_lenght'"),
        (_entry(options='{ reduction_lenght = "recorded" }'), "did you mean 'reduction_length'"),
        (_entry(options='{ reduction_length = "sometimes" }'), "option 'reduction_length'"),
        (_entry(options='{ reduction_length = "sometimes" }'), "'run-time'"),
        (_entry(options="{ reduction_length = 3 }"), "option 'reduction_length'"),
        (_entry(rule="qop-matmull"), "no rule 'qop-matmull' in the catalogue (did you mean 'qop-matmul'?)"),
        (_entry(rule="float-emulation-q"), "is a rule of form 'float-emulation'"),
        (_entry(options="{}"), "'options' must be a non-empty table"),
        # Options that change what the rule delivers fail as they would in a rule file.
        (_entry(options='{ u8s8_saturation = "ignore" }'), "'exactness' is 'bounded'"),
        (OPTIONS + OPTIONS, "rule 'qop-matmul' is given options twice"),
        (OPTIONS.replace('source = "doc"', ""), "'source' is missing"),
        (OPTIONS.replace("why =", "wy ="), "unknown key 'wy' (did you mean 'why'?)"),
        ('\n[rewrites]\navoid = ["qop-matmul"]\nsource = "doc"\n' + OPTIONS, "is in [rewrites] avoid"),
    ],
)
def test_bad_rule_options_name_file_target_rule_and_key(extra, message):
    parse_target(PROFILE + OPTIONS, "mini.toml")  # valid as written
    with pytest.raises(UsageError) as err:
        parse_target(PROFILE + extra, "mini.toml")
    text = str(err.value)
    assert text.startswith("mini.toml: target 'mini', [[rewrites.options]] #"), text
    assert message in text, text
    if "rule =" in extra and "qop-matmull" not in extra and "float-emulation-q" not in extra:
        assert "(rule 'qop-matmul')" in text, text


def test_cli_bad_rule_option_in_a_profile_exits_2_with_one_line(tmp_path):
    path = _profile(tmp_path, PROFILE + _entry(options='{ reduction_lenght = "recorded" }'))
    model = tmp_path / "mm.onnx"
    onnx.save(_matmul(), model)
    proc = cli_in_process("inspect", model, "--target", path)  # in this process: tests/_cli_helpers.py
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip()
    assert line.count("\n") == 0 and "Traceback" not in line
    for part in (path, "target 'mini'", "rule 'qop-matmul'", "'reduction_lenght'", "did you mean 'reduction_length'"):
        assert part in line, line


# -- what the plan does with them ---------------------------------------------------------------


def test_without_the_profiles_option_the_run_time_bound_reaches_the_target(tmp_path):
    """The control: the catalogue's qop-matmul (reduction_length = 'run-time') rewrites the node."""
    plan = plan_for_model(_matmul(), load_rules(), load_target(_profile(tmp_path, PROFILE)))
    assert plan.ok and [n.rule for n in plan.nodes] == ["qop-matmul"]
    assert plan.rule_options == {}


def test_the_plan_uses_the_profiles_option_and_names_input_shape(tmp_path):
    profile = load_target(_profile(tmp_path, PROFILE + OPTIONS))
    plan = plan_for_model(_matmul(), load_rules(), profile)
    assert plan.refused_after == 1
    (verdict,) = plan.nodes
    assert (verdict.node, verdict.rule, verdict.status) == ("mm", None, "refused after the rewrite")
    assert "--input-shape" in verdict.hint and "reduction_length = 'recorded'" in verdict.hint
    assert any("with reduction_length = 'recorded' for mini" in c for c in verdict.considered)
    said = plan.rule_options["qop-matmul"]
    assert said["options"] == {"reduction_length": "recorded"} and said["user"] == {}
    assert said["source"] == "[mini/doc]"
    assert plan.to_dict()["rule_options"] == plan.rule_options
    # rewrite --target: the same plan, and the one-line error carries the profile's why.
    with pytest.raises(LoweringError, match=r"would still refuse node mm .*give --input-shape"):
        rewrite(_matmul(), target=str(profile.path))


def test_with_the_reduction_length_fixed_the_profiles_option_still_reaches_the_target(tmp_path):
    path = _profile(tmp_path, PROFILE + OPTIONS)
    shapes = InputShapes({"a": (2, 16), "b": (16, 3)})
    plan = plan_for_model(_matmul(), load_rules(), load_target(path), input_shapes=shapes)
    assert plan.ok and [n.rule for n in plan.nodes] == ["qop-matmul"]
    result = rewrite(_matmul(), target=path, input_shapes=shapes)
    assert not any(p.key == "onnx_qrewrite.bound_formula" for n in result.model.graph.node for p in n.metadata_props)


@pytest.mark.parametrize("how", ["catalogue", "api"])
def test_the_users_option_wins_over_the_profiles(tmp_path, how):
    path = _profile(tmp_path, PROFILE + OPTIONS)
    user = {"qop-matmul": {"reduction_length": "run-time"}}
    if how == "catalogue":
        plan = plan_for_model(_matmul(), load_rules(options=user), load_target(path))
        assert plan.ok and [n.rule for n in plan.nodes] == ["qop-matmul"]
        said = plan.rule_options["qop-matmul"]
        assert said["options"] == {} and said["user"] == {"reduction_length": "run-time"}
        assert said["profile"] == {"reduction_length": "recorded"}
    else:
        result = rewrite(_matmul(), target=path, options=user)
        (applied,) = result.report.rewrites
        assert applied.rule == "qop-matmul" and applied.bound_formula.startswith("run-time-k:")


def test_an_option_the_user_sets_on_another_key_leaves_the_profiles_in_place(tmp_path):
    path = _profile(tmp_path, PROFILE + OPTIONS)
    user = {"qop-matmul": {"u8s8_saturation": "bound"}}  # the rule file's value, set by the user
    plan = plan_for_model(_matmul(), load_rules(options=user), load_target(path))
    assert plan.refused_after == 1 and plan.rule_options["qop-matmul"]["options"] == {"reduction_length": "recorded"}


def test_a_rule_the_user_skipped_gets_no_options(tmp_path):
    path = _profile(tmp_path, PROFILE + OPTIONS)
    plan = plan_for_model(_matmul(), load_rules(skip=["qop-matmul"]), load_target(path))
    assert plan.rule_options == {} and plan.refused_after == 1 and not plan.nodes[0].hint


def test_inspect_and_targets_show_the_profiles_options(tmp_path):
    path = _profile(tmp_path, PROFILE + OPTIONS)
    model = tmp_path / "mm.onnx"
    onnx.save(_matmul(), model)

    run = cli_in_process  # in this process: tests/_cli_helpers.py

    proc = run("inspect", str(model), "--target", path)
    assert proc.returncode == 4, proc.stderr
    assert "rule qop-matmul: options reduction_length = 'recorded' for mini [mini/doc]" in proc.stdout
    assert "hint: qop-matmul does not apply with reduction_length = 'recorded'" in proc.stdout
    proc = run("inspect", str(model), "--target", path, "--rule-option", "qop-matmul.reduction_length=run-time")
    assert proc.returncode == 0, proc.stderr
    assert "reduction_length = 'run-time' from your options, over mini's 'recorded' [mini/doc]" in proc.stdout
    proc = run("targets", path, "--long")
    assert "options of rule qop-matmul: reduction_length = 'recorded'" in proc.stdout, proc.stdout
