"""The rule catalogue: every shipped rule is valid and has evidence both ways; users extend it
with their own files; the shipped files travel inside the wheel."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import onnx
import onnx.parser
import pytest
from conftest import REPO, run

import onnx_qrewrite
from onnx_qrewrite.errors import UsageError
from onnx_qrewrite.rewriter.catalogue import load_catalogue, parse_rules, shipped_rules_dir

SHIPPED = load_catalogue()


def _rule_evidence() -> dict[str, set[str]]:
    """``@rule_marker(id, kind)`` decorators on test functions, read from the test files themselves
    (so the check holds however pytest was invoked, even on one file)."""
    found: dict[str, set[str]] = {}
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test_"):
                continue
            for deco in node.decorator_list:
                if isinstance(deco, ast.Call) and getattr(deco.func, "id", None) == "rule_marker":
                    rule_id, kind = (ast.literal_eval(a) for a in deco.args)
                    found.setdefault(rule_id, set()).add(kind)
    return found


def test_every_shipped_rule_has_a_positive_and_a_negative_test():
    # The default catalogue and the named forms (rules/forms/, applied only when asked for).
    forms = load_catalogue(sorted((shipped_rules_dir() / "forms").glob("*.toml")), include_shipped=False)
    evidence: dict[str, set[str]] = {rule.id: set() for rule in (*SHIPPED, *forms)}
    for rule_id, kinds in _rule_evidence().items():
        assert rule_id in evidence, f"a test marks unknown rule {rule_id!r}"
        evidence[rule_id] |= kinds
    missing = {
        rule_id: sorted({"positive", "negative"} - kinds)
        for rule_id, kinds in evidence.items()
        if kinds != {"positive", "negative"}
    }
    assert not missing, f"rules without evidence: {missing}"


def test_shipped_rules_are_valid_ordered_and_describable():
    assert len(SHIPPED) >= 15 and len(set(SHIPPED.ids)) == len(SHIPPED)
    for rule in SHIPPED:
        assert rule.summary and rule.emits and rule.match, rule.id
        assert Path(rule.source).parent == shipped_rules_dir()
    # Standard ops come before their exact decompositions, so --keep-opset falls through.
    ids = SHIPPED.ids
    assert ids.index("quark-q-standard") < ids.index("quark-q-int-decompose")
    assert ids.index("ms-q-standard") < ids.index("ms-q-decompose")


_HEAD = '[[rule]]\nid = "a"\nsummary = "s"\nbuilder = "dynamic_quantize_linear"\nexactness = "exact"\n'
_QDQ = '[[rule]]\nid = "q"\nsummary = "s"\nbuilder = "standard_qdq"\nexactness = "exact"\nmatch = {op = "X"}\n'


@pytest.mark.parametrize(
    "text, message",
    [
        ("[[rule]\nid=", "not valid TOML"),
        ("rules = 1", "unknown top-level key 'rules' (did you mean 'rule'?)"),
        (_HEAD + 'match = {op = "X"}\ncolour = 1', "rule 'a': unknown key 'colour'"),
        (_HEAD + 'match = {op = "X"}\nsumary = "t"', "rule 'a': unknown key 'sumary' (did you mean 'summary'?)"),
        (_HEAD.replace("dynamic_quantize_linear", "nope") + 'match = {op = "X"}', "unknown builder 'nope'"),
        (
            _HEAD.replace("dynamic_quantize_linear", "standard_qdd") + 'match = {op = "X"}',
            "unknown builder 'standard_qdd' (did you mean 'standard_qdq'?)",
        ),
        (_HEAD, "'match' must be"),
        (_HEAD + 'match = {op = "X"}\nwhen = {min_opset = "13"}', "'when.min_opset' must be an integer"),
        (_HEAD + 'match = {op = "X"}\nwhen = {dtype = ["uint8"]}', "'dtype' (did you mean 'dtypes'?)"),
        (
            _HEAD + 'match = {op = "X"}\nwhen = {dtypes = ["uint9"]}',
            "'when.dtypes': unknown dtype 'uint9' (did you mean 'uint8'?)",
        ),
        (_HEAD + 'match = {domian = "com.x", op = "X"}', "unknown key in 'match': 'domian' (did you mean 'domain'?)"),
        ('[[rule]]\nsummary = "s"\nbuilder = "dynamic_quantize_linear"\nmatch = {op = "X"}', "'id' must be"),
        (_HEAD.replace('exactness = "exact"\n', "") + 'match = {op = "X"}', "'exactness' must be one of"),
        (_HEAD.replace('"exact"', '"exactish"') + 'match = {op = "X"}', "not 'exactish' (did you mean 'exact'?)"),
        # The builder's contract: option keys, types, values, emitted ops, exactness.
        (
            _QDQ + 'options = { direction = "quantize", axis_defualt = 0 }',
            "rule 'q': option 'axis_defualt' (standard_qdq): unknown option (did you mean 'axis_default'?)",
        ),
        (_QDQ + 'options = { direction = "quantise" }', "'quantise' is not one of 'quantize', 'dequantize'"),
        (_QDQ + "options = { axis_default = 0 }", "option 'direction' (standard_qdq): required option missing"),
        (_QDQ + 'options = { direction = "quantize", axis_default = "0" }', "must be an integer, not '0'"),
        (
            _QDQ + 'options = { direction = "quantize", require_zero_point = 1 }',
            "option 'require_zero_point' (standard_qdq): must be a boolean",
        ),
        (
            _QDQ + 'emits = "QuantizeLinear, MatMul"\noptions = { direction = "quantize" }',
            "'emits' names 'MatMul'",
        ),
        (
            _QDQ.replace('"exact"', '"bounded"') + 'options = { direction = "quantize" }',
            "'exactness' is 'bounded' but builder standard_qdq with these options is 'exact'",
        ),
        (
            _QDQ + 'requires_opset = { "*" = 10 }\noptions = { direction = "quantize" }',
            "key 'requires_opset' is no longer accepted: the opset an emitted op needs is declared once",
        ),
    ],
)
def test_bad_rule_files_name_the_file_rule_and_problem(text, message):
    with pytest.raises(UsageError, match="mine.toml: .*" + re.escape(message)):
        parse_rules(text, "mine.toml")


def test_the_dtype_names_rules_may_use_are_onnxs_as_the_rewriter_spells_them():
    from onnx import TensorProto

    from onnx_qrewrite.rewriter.catalogue import DTYPE_NAMES
    from onnx_qrewrite.rewriter.graph import dtype_name

    assert set(DTYPE_NAMES) == {dtype_name(v) for _, v in TensorProto.DataType.items() if v}


def test_a_bad_option_override_is_a_usage_error_naming_rule_and_key():
    with pytest.raises(UsageError, match=re.escape("rule 'dql-expand' (overridden): option 'semantic'")):
        load_catalogue().with_options({"dql-expand": {"semantic": "spec"}})
    with pytest.raises(
        UsageError, match=re.escape("'specs' is not one of 'onnxruntime', 'spec' (did you mean 'spec'?)")
    ):
        load_catalogue().with_options({"dql-expand": {"semantics": "specs"}})


def test_duplicate_rule_id_across_files_is_refused(tmp_path):
    dup = tmp_path / "dup.toml"
    dup.write_text(
        '[[rule]]\nid = "dql-expand"\nsummary = "s"\nbuilder = "dynamic_quantize_linear"\n'
        'exactness = "exact"\nmatch = {op = "DynamicQuantizeLinear"}\n'
    )
    with pytest.raises(UsageError, match="rule 'dql-expand' is already defined"):
        load_catalogue([dup])


def test_precedes_naming_no_rule_is_refused_with_the_closest(tmp_path):
    """With the shipped rules loaded, a name in 'precedes' that no rule has would order nothing."""
    text = (
        '[[rule]]\nid = "mine"\nsummary = "s"\nbuilder = "dynamic_quantize_linear"\nexactness = "exact"\n'
        'match = {op = "DynamicQuantizeLinear"}\nprecedes = ["dql-expnd"]\n'
    )
    path = tmp_path / "mine.toml"
    path.write_text(text)
    with pytest.raises(
        UsageError, match=re.escape("rule 'mine': 'precedes' names no rule 'dql-expnd' (did you mean 'dql-expand'?)")
    ):
        load_catalogue([path])
    path.write_text(text.replace("dql-expnd", "dql-expand"))
    assert load_catalogue([path]).candidates("", "DynamicQuantizeLinear")[0].id == "mine"


def test_a_user_catalogue_lowers_a_new_vendor_op_without_touching_the_package(tmp_path):
    """A team's own quantize op with Quark-like semantics, mapped by data alone."""
    rules = tmp_path / "mycorp.toml"
    rules.write_text(
        '[[rule]]\nid = "mycorp-q"\nsummary = "MyCorp quantize -> QuantizeLinear"\nemits = "QuantizeLinear"\n'
        'builder = "standard_qdq"\nexactness = "exact"\nmatch = [{ domain = "com.mycorp", op = "MyQuantize" }]\n'
        'when = { dtypes = ["uint8", "int8"] }\n'
        'options = { direction = "quantize", axis_default = 0, require_zero_point = true }\n'
    )
    text = """
    <ir_version: 8, opset_import: ["" : 13, "com.mycorp" : 1]>
    g (float[2, 3] x) => (int8[2, 3] y)
    <float[2] s = {0.5, 0.25}, int8[2] z = {1, -2}>
    {
        y = com.mycorp.MyQuantize (x, s, z)
    }
    """
    model = onnx.parser.parse_model(text)
    result = onnx_qrewrite.rewrite(model, rules=[rules])
    assert result.report.by_rule() == {"mycorp-q": 1}
    (node,) = result.model.graph.node
    assert (node.op_type, [(a.name, a.i) for a in node.attribute]) == ("QuantizeLinear", [("axis", 0)])
    assert all(o.domain != "com.mycorp" for o in result.model.opset_import)
    x = np.array([[1.0, -1.25, 3.0], [0.5, 0.1, -7.0]], np.float32)
    expected = np.clip(np.rint(x / np.array([[0.5], [0.25]], np.float32)) + np.array([[1], [-2]]), -128, 127)
    np.testing.assert_array_equal(run(result.model, {"x": x})["y"], expected.astype(np.int8))


def test_only_and_skip_select_rules():
    assert load_catalogue().select(only=["dql-expand"]).ids == ["dql-expand"]
    assert "dql-expand" not in load_catalogue().select(skip=["dql-expand"]).ids


def test_the_wheel_carries_the_rule_catalogue_and_finds_it_installed(wheel, tmp_path):
    names = zipfile.ZipFile(wheel).namelist()
    shipped = sorted(p.name for p in (REPO / "rules").glob("*.toml"))
    in_wheel = sorted(n.removeprefix("onnx_qrewrite/_rules/") for n in names if n.startswith("onnx_qrewrite/_rules/"))
    assert [n for n in in_wheel if "/" not in n and n.endswith(".toml")] == shipped
    # Data the rules refer to (target runtimes' operator tables) travels with them.
    assert "targets/sources/tensorrt_operators_10.1-GA.json" in in_wheel
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
    )
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from onnx_qrewrite.rewriter.catalogue import load_catalogue, "
        "shipped_rules_dir; print(shipped_rules_dir()); print(len(load_catalogue()))"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(target)], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    where, count = proc.stdout.split()
    assert Path(where) == target / "onnx_qrewrite" / "_rules" and int(count) == len(SHIPPED)


def _fused_matmul_scaled() -> onnx.ModelProto:
    """FusedMatMul with alpha 0.3: the bounded rule unfuse-fused-matmul-scaled."""
    node = onnx.helper.make_node("FusedMatMul", ["a", "b"], ["y"], name="fmm", domain="com.microsoft", alpha=0.3)
    graph = onnx.helper.make_graph(
        [node],
        "g",
        [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [4, 4]) for n in "ab"],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4, 4])],
    )
    opsets = [onnx.helper.make_opsetid("", 17), onnx.helper.make_opsetid("com.microsoft", 1)]
    return onnx.helper.make_model(graph, opset_imports=opsets, ir_version=8)


def test_a_bounded_rule_whose_node_records_no_bound_is_our_bug(monkeypatch):
    """Every bounded rule records a bound verify checks at its node (issue 10: the bounded un-fuse
    rules recorded none, so verify neither re-anchored at them nor checked them, and held their
    rounding to the exact tolerance downstream). The engine refuses a bounded rule's plan without
    Plan.bound or Plan.bound_formula (exit 5, naming the rule), so a new bounded rule's positive
    tests (test_every_shipped_rule_has_a_positive_and_a_negative_test) fail until it records one;
    and conftest checks on each of those tests' rewrites that a recorded formula evaluates the op
    (tests/_output_types.py: unchecked_bound_problems)."""
    import dataclasses

    from _output_types import unchecked_bound_problems

    from onnx_qrewrite.errors import InternalError
    from onnx_qrewrite.rewriter.builders.contrib_fusions import FusedMatMulBuilder

    result = onnx_qrewrite.rewrite(_fused_matmul_scaled())
    assert result.report.by_rule() == {"unfuse-fused-matmul-scaled": 1}
    assert unchecked_bound_problems(result.report) == []
    check = FusedMatMulBuilder.check

    def with_formula(formula):
        return lambda self, site, options: dataclasses.replace(check(self, site, options), bound_formula=formula)

    monkeypatch.setattr(FusedMatMulBuilder, "check", with_formula(None))
    with pytest.raises(InternalError, match=r"rule unfuse-fused-matmul-scaled is bounded but .* no bound"):
        onnx_qrewrite.rewrite(_fused_matmul_scaled())
    monkeypatch.setattr(FusedMatMulBuilder, "check", with_formula("fused-conv-sum"))  # not FusedMatMul's
    problems = unchecked_bound_problems(onnx_qrewrite.rewrite(_fused_matmul_scaled()).report)
    assert problems == [
        "rule unfuse-fused-matmul-scaled, FusedMatMul 'fmm': formula 'fused-conv-sum' does not evaluate it"
    ]
