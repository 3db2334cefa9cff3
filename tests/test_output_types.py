"""Builders declare the element type of each output they replace (``Contract.output_types``): the
catalogue refuses a declaration that cannot be satisfied when it loads, and the check the positive
tests run on every rewrite (tests/_output_types.py, conftest.py) fails when a builder emits another
type than it declares, or declares another type than the original op has."""

from __future__ import annotations

import dataclasses
import re

import onnx
import pytest
from _output_types import output_type_problems
from conftest import REAL_MODEL_NAMES, REAL_MODELS, SAMPLES
from onnx import TensorProto, helper
from test_cli import cli

import onnx_qrewrite
from onnx_qrewrite.errors import UsageError
from onnx_qrewrite.rewriter import builders
from onnx_qrewrite.rewriter.catalogue import load_catalogue, named_form, parse_rules
from onnx_qrewrite.rewriter.contract import UNREAD, output_type_problem, resolve_output_type

SHIPPED = load_catalogue()
FORMS = (
    "float-emulation",
    "weight-only",
    "qdq",
    "qdq-to-float",
    "qdq-units",
    "movement-equivalents",
    "qlinear-exact",
)


def _gelu_model(elem: int = TensorProto.FLOAT) -> onnx.ModelProto:
    node = helper.make_node("Gelu", ["x"], ["y"], name="gelu", domain="com.microsoft")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", elem, [2, 3])],
        [helper.make_tensor_value_info("y", elem, [2, 3])],
    )
    return helper.make_model(
        graph, ir_version=9, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("com.microsoft", 1)]
    )


def _problems(model: onnx.ModelProto, catalogue=SHIPPED, **kw) -> tuple[list[str], dict[str, int]]:
    result = onnx_qrewrite.rewrite(model, rules=catalogue, **kw)
    return output_type_problems(model, result.model, result.report, catalogue)


def test_every_shipped_rule_declares_its_output_types():
    catalogue = load_catalogue([named_form(f) for f in FORMS])
    for rule in catalogue:
        for ref in rule.match:
            declared = rule.contract.output_types(rule.options, ref.op)  # type: ignore[misc]
            assert declared is not None and len(declared) >= rule.contract.outputs, (rule.id, ref.op)


def test_the_grammar_resolves_as_documented():
    types = {0: "uint8", 1: "float16"}.get
    attrs = {"to": "bfloat16"}.get
    assert resolve_output_type("input 1", {}, types, attrs) == "float16"
    assert resolve_output_type("attribute output_dtype else input 2 else uint8", {}, types, attrs) == "uint8"
    assert resolve_output_type("attribute to else int8", {}, types, attrs) == "bfloat16"
    assert resolve_output_type("input 8 else uint8 if input 7 else input 1", {}, types, attrs) == "float16"
    assert resolve_output_type("input 8 else uint8 if input 0 else input 1", {}, types, attrs) == "uint8"
    assert resolve_output_type("option to", {"to": "int4"}, types, attrs) == "int4"
    assert resolve_output_type(UNREAD, {}, types, attrs) is None
    assert output_type_problem("flaot32", {}) == (
        "'flaot32' is not an element type, 'input N', 'attribute NAME' or 'option NAME' (did you mean 'float32'?)"
    )
    assert output_type_problem("input x", {}) is not None
    assert output_type_problem("option to", {"to": "nearest"}) == "'option to' is 'nearest', not an element type"
    assert output_type_problem("option to", {}).startswith("'option to': the builder has no such option")


def _rule_text(builder: str, op: str, domain: str = "com.microsoft", options: str = "") -> str:
    return (
        f'[[rule]]\nid = "mine"\nsummary = "s"\nbuilder = "{builder}"\nexactness = "exact"\n'
        f'match = {{ domain = "{domain}", op = "{op}" }}\n' + (f"options = {{ {options} }}\n" if options else "")
    )


def test_a_rule_matching_an_op_its_builder_does_not_type_is_refused_at_load(tmp_path):
    text = _rule_text("integer_matmul", "QLinearMatMul")
    with pytest.raises(UsageError, match=r"mine\.toml: rule 'mine': output types \(integer_matmul\): .*QLinearMatMul"):
        parse_rules(text, "mine.toml")
    path = tmp_path / "mine.toml"
    path.write_text(text)
    proc = cli("rules", "--rules", path)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "rule 'mine': output types (integer_matmul)" in lines[0], proc.stderr


@pytest.mark.parametrize(
    ("declared", "why"),
    [
        (None, "the builder declares no output types"),
        (("float33",), "output 0 of Gelu: 'float33' is not an element type"),
        ((), "0 output type(s) declared for Gelu, which has 1 outputs"),
        (("option form",), "output 0 of Gelu: 'option form' is 'gelu', not an element type"),
    ],
)
def test_a_contract_that_cannot_be_satisfied_is_refused_at_load(monkeypatch, declared, why):
    builder = builders.get_builder("unfuse_activation")
    broken = dataclasses.replace(
        builder.contract, output_types=None if declared is None else (lambda options, op: declared)
    )
    monkeypatch.setattr(type(builder), "contract", broken)
    with pytest.raises(UsageError, match=r"rule 'mine': output types \(unfuse_activation\): " + re.escape(why)):
        parse_rules(_rule_text("unfuse_activation", "Gelu", options='form = "gelu"'), "mine.toml")


def test_a_remembered_parse_is_checked_again_once_its_builders_contract_changed(monkeypatch):
    """parse_rules remembers a file's rules (catalogue.py), but only while each rule's builder has
    the contract it was checked against: the same text, parsed first with the real contract, is
    refused once the contract is one it cannot satisfy, and parsed as before once it is back."""
    text = _rule_text("unfuse_activation", "Gelu", options='form = "gelu"')
    first = parse_rules(text, "remembered.toml")
    assert parse_rules(text, "remembered.toml") == first
    builder = builders.get_builder("unfuse_activation")
    real = builder.contract
    monkeypatch.setattr(type(builder), "contract", dataclasses.replace(real, output_types=None))
    with pytest.raises(UsageError, match=r"rule 'mine': output types \(unfuse_activation\)"):
        parse_rules(text, "remembered.toml")
    monkeypatch.setattr(type(builder), "contract", real)
    assert parse_rules(text, "remembered.toml") == first


def test_a_wrong_declaration_is_caught_on_the_rewrite(monkeypatch):
    problems, compared = _problems(_gelu_model())
    assert (problems, compared) == ([], {"unfuse-gelu": 1})
    builder = builders.get_builder("unfuse_activation")
    monkeypatch.setattr(
        type(builder), "contract", dataclasses.replace(builder.contract, output_types=lambda o, op: ("float16",))
    )
    problems, _ = _problems(_gelu_model(), catalogue=load_catalogue())
    assert problems == [
        "rule unfuse-gelu, Gelu 'gelu' output 0 (y): declared 'float16' = float16, the rewrite emits float32",
        "rule unfuse-gelu, Gelu 'gelu' output 0 (y): declared 'float16' = float16, the original op's output is float32",
    ]


def test_a_builder_emitting_another_type_is_caught(monkeypatch):
    builder = builders.get_builder("unfuse_activation")
    real_build = type(builder).build

    def build_then_cast(self, site, emit, options, plan):
        y = site.node.output[0]
        site.node.output[0] = "inner"
        try:
            real_build(self, site, emit, options, plan)
        finally:
            site.node.output[0] = y
        emit.op1("Cast", ["inner"], y, to=TensorProto.FLOAT16)

    monkeypatch.setattr(type(builder), "build", build_then_cast)
    monkeypatch.setattr(
        type(builder), "contract", dataclasses.replace(builder.contract, emits=builder.contract.emits | {"Cast"})
    )
    problems, _ = _problems(_gelu_model(), catalogue=load_catalogue())
    assert problems[:1] == [
        "rule unfuse-gelu, Gelu 'gelu' output 0 (y): declared 'input 0' = float32, the rewrite emits float16"
    ]


@pytest.mark.parametrize("form", (None, *FORMS))
def test_the_committed_real_models_rewrite_to_their_declared_types(form):
    catalogue = load_catalogue([named_form(form)] if form else [])
    paths = [REAL_MODELS / f"{n}.onnx" for n in REAL_MODEL_NAMES] + sorted(SAMPLES.glob("*.onnx"))
    total: dict[str, int] = {}
    for path in paths:
        model = onnx.load(path, load_external_data=False)
        try:
            result = onnx_qrewrite.rewrite(model, rules=catalogue, base_dir=path.parent, allow_unlowered=True)
        except onnx_qrewrite.LoweringError:
            continue
        problems, compared = output_type_problems(model, result.model, result.report, catalogue)
        assert problems == [], path.name
        for rule_id, n in compared.items():
            total[rule_id] = total.get(rule_id, 0) + n
    assert total, "no rewrite was compared"


def test_the_positive_tests_check_sees_the_apis_rewrites(monkeypatch):
    """conftest's check replaces ``engine.run`` for the positive tests: the API (and a target's
    plan) must reach the engine through that module attribute, or every positive test would go
    unchecked without a word (a ``from ...engine import run`` would do that)."""
    from onnx_qrewrite.rewriter import engine

    seen: list[str] = []
    real_run = engine.run

    def counted(model, *args, **kwargs):
        seen.append(model.graph.node[0].op_type)
        return real_run(model, *args, **kwargs)

    monkeypatch.setattr(engine, "run", counted)
    onnx_qrewrite.rewrite(_gelu_model())
    assert seen == ["Gelu"]
    onnx_qrewrite.rewrite(_gelu_model(), target="onnx")
    assert len(seen) > 1
