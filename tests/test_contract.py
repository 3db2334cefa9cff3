"""The builder contract (onnx_qrewrite.rewriter.contract) does what it says: declarations are enforced, the
things derived from them follow them, opset policy has one home, and exactness orders the rules."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import onnx
import onnx.parser
import pytest
from conftest import op_types, run

import onnx_qrewrite
from onnx_qrewrite.errors import InternalError, LoweringError, UsageError
from onnx_qrewrite.rewriter import builders, kernel_opsets
from onnx_qrewrite.rewriter.builders import Emitter, NoMatch, Plan, Site
from onnx_qrewrite.rewriter.catalogue import OTHER_QUANT_OPS, load_catalogue, parse_rules
from onnx_qrewrite.rewriter.contract import APPROXIMATE, BOUNDED, EXACT, EXACTNESS, Contract, Option

SHIPPED = load_catalogue()


class _FakeBuilder:
    """Replaces ``y = com.test.Twice(x)`` by ``y = Add(x, x)`` (or an undeclared op, to test the
    Emitter), declining nodes whose name is listed in option ``decline``."""

    def __init__(self, name: str, level: str, emit: str = "Add"):
        self.name = name
        self.emit = emit
        self.contract = Contract(
            options=(Option("decline", str, ""),),
            emits=frozenset({"Add"}),
            exactness=lambda options: level,
            bound="test bound" if level == BOUNDED else "",
            output_types=lambda options, op: ("input 0",),
        )

    def quantized_dtype(self, site: Site) -> str | None:
        return None

    def check(self, site: Site, options: Mapping[str, Any]) -> Plan:
        if site.node.name in options["decline"].split(","):
            raise NoMatch("declined")
        return Plan(bound=0.5 if self.contract.exactness(options) == BOUNDED else None)

    def build(self, site: Site, emit: Emitter, options: Mapping[str, Any], plan: Plan) -> None:
        x = site.node.input[0]
        emit.op1(self.emit, [x, x], site.node.output[0])


@pytest.fixture
def fake_builders() -> Iterator[None]:
    added = {f"test_{level}": _FakeBuilder(f"test_{level}", level) for level in EXACTNESS}
    added["test_undeclared"] = _FakeBuilder("test_undeclared", EXACT, emit="Mul")
    for b in added.values():
        builders.register(b)
    try:
        yield
    finally:
        for name in added:
            builders._REGISTRY.pop(name)


def _rule(rule_id: str, level: str, builder: str | None = None, decline: str = "") -> str:
    return (
        f'[[rule]]\nid = "{rule_id}"\nsummary = "s"\nbuilder = "{builder or "test_" + level}"\n'
        f'exactness = "{level}"\nmatch = {{ domain = "com.test", op = "Twice" }}\n'
        f'options = {{ decline = "{decline}" }}\n'
    )


_TWICE = onnx.parser.parse_model(
    """
    <ir_version: 8, opset_import: ["" : 13, "com.test" : 1]>
    g (float[3] x) => (float[3] y, float[3] z)
    {
        y = com.test.Twice (x)
        z = com.test.Twice (x)
    }
    """
)
_TWICE.graph.node[0].name, _TWICE.graph.node[1].name = "first", "second"


def _rewrite(tmp_path, text: str, **kw: Any) -> onnx_qrewrite.RewriteResult:
    path = tmp_path / "fake.toml"
    path.write_text(text)
    return onnx_qrewrite.rewrite(_TWICE, rules=load_catalogue([path], include_shipped=False), **kw)


def test_bounded_rules_run_only_where_no_exact_rule_applies_and_say_so(tmp_path, fake_builders):
    # The bounded rule comes first in the file; the exact one still wins where it applies.
    text = _rule("b", BOUNDED) + _rule("e", EXACT, decline="second")
    result = _rewrite(tmp_path, text)
    assert {r.node: r.rule for r in result.report.rewrites} == {"first": "e", "second": "b"}
    bounded = next(r for r in result.report.rewrites if r.rule == "b")
    assert (bounded.exactness, bounded.bound) == (BOUNDED, 0.5)
    summary = "\n".join(result.report.summary_lines())
    assert "b: 1 node rewritten [bounded]" in summary
    assert "1 node rewritten by bounded rules (no exact rule applies there)" in summary
    assert result.report.to_dict()["rewrites"][1]["exactness"] == BOUNDED
    # The bound travels in the created node's metadata, for verify to check at that node.
    meta = {n.output[0]: {p.key: p.value for p in n.metadata_props} for n in result.model.graph.node}
    assert meta["z"][Emitter.EXACTNESS_KEY] == BOUNDED and float(meta["z"][Emitter.BOUND_KEY]) == 0.5
    assert Emitter.BOUND_KEY not in meta["y"] and Emitter.EXACTNESS_KEY not in meta["y"]
    # Bounded rules can be refused: then the node cannot be lowered, and the reason says why.
    with pytest.raises(LoweringError, match="b: bounded rule: runs only when asked"):
        _rewrite(tmp_path, text, allow=[EXACT])


def test_approximate_rules_run_only_when_asked_and_then_first(tmp_path, fake_builders):
    text = _rule("e", EXACT) + _rule("a", APPROXIMATE)
    assert _rewrite(tmp_path, text).report.by_rule() == {"e": 2}
    assert _rewrite(tmp_path, text, allow=EXACTNESS).report.by_rule() == {"a": 2}
    with pytest.raises(
        LoweringError, match=re.escape("a: approximate rule: runs only when asked (--allow-approximate)")
    ):
        _rewrite(tmp_path, _rule("a", APPROXIMATE))
    with pytest.raises(UsageError, match="must include 'exact'"):
        _rewrite(tmp_path, text, allow=["approximate"])


def test_a_rule_cannot_claim_more_exactness_than_its_builder_delivers(fake_builders):
    with pytest.raises(
        UsageError, match="'exactness' is 'exact' but builder test_bounded with these options is 'bounded'"
    ):
        parse_rules(_rule("x", EXACT, builder="test_bounded"), "mine.toml")


def test_the_emitter_refuses_ops_the_contract_does_not_declare(tmp_path, fake_builders):
    with pytest.raises(InternalError, match="rule u: its builder emitted Mul, which its contract does not declare"):
        _rewrite(tmp_path, _rule("u", EXACT, builder="test_undeclared"))


def test_every_builder_declares_a_complete_contract():
    for name in builders.builder_names():
        contract = builders.get_builder(name).contract
        assert contract.emits and all(op[:1].isupper() for op in contract.emits), name
        assert contract.output_types is not None, f"{name} declares no output types"
        names = contract.option_names()
        assert len(names) == len(set(names)), name
        for option in contract.options:
            assert option.doc, f"{name}.{option.name} has no doc"
    for rule in SHIPPED:
        emitted = {o.strip() for o in rule.emits.split(",")}
        assert emitted <= rule.implementation.contract.emits, rule.id
        assert rule.implementation.contract.opset(rule.options, rule.dtypes), rule.id


def test_each_builtin_builder_carries_the_contract_its_declaration_gives():
    """One source of truth: the catalogue validates against builders/contracts.py without importing
    the builders, and each builder class says ``contract = CONTRACTS[name]``."""
    import importlib
    import pkgutil

    from onnx_qrewrite.rewriter.builders import contracts

    for name, contract in contracts.CONTRACTS.items():
        builder = builders.get_builder(name)
        assert builder is not None and builder.name == name, name
        assert builder.contract is contract, name
        assert type(builder).__module__ == f"onnx_qrewrite.rewriter.builders.{contracts.MODULES[name]}", name
    # Every module that registers a builder is declared (so get_builder finds it by name).
    for info in pkgutil.iter_modules(builders.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"onnx_qrewrite.rewriter.builders.{info.name}")
    builtin = {
        n: b for n, b in builders._REGISTRY.items() if type(b).__module__.startswith("onnx_qrewrite.rewriter.builders.")
    }
    assert set(builtin) == set(contracts.CONTRACTS)


def test_the_qoperator_builder_lays_out_exactly_the_ops_its_contract_names():
    from onnx_qrewrite.rewriter.builders.contracts import QOPERATOR_EXACTNESS
    from onnx_qrewrite.rewriter.builders.qoperator import SPECS

    assert list(SPECS) == list(QOPERATOR_EXACTNESS)


_QDQ_UINT8 = """
    <ir_version: 8, opset_import: ["" : 10, "com.microsoft" : 1]>
    g (float[4] x) => (uint8[4] y)
    <float s = {0.5}, uint8 z = {3}>
    {
        y = com.microsoft.QuantizeLinear (x, s, z)
    }
"""


def test_the_opset_an_emitted_op_needs_lives_in_kernel_opsets_and_changing_it_changes_the_rewrite(monkeypatch):
    model = onnx.parser.parse_model(_QDQ_UINT8)
    x = np.array([0.0, 1.0, -1.0, 200.0], np.float32)
    before = onnx_qrewrite.rewrite(model, only=["ms-q-standard"])
    assert [o.version for o in before.model.opset_import if o.domain == ""] == [10]
    assert [c.domain for c in before.report.opset_changes] == ["com.microsoft"]  # its import dropped
    monkeypatch.setitem(kernel_opsets.QUANTIZE_LINEAR, "uint8", 13)
    after = onnx_qrewrite.rewrite(model, only=["ms-q-standard"])
    assert [o.version for o in after.model.opset_import if o.domain == ""] == [13]
    assert (after.report.opset_changes[0].domain, after.report.opset_changes[0].after) == ("", 13)
    np.testing.assert_array_equal(run(after.model, {"x": x})["y"], run(before.model, {"x": x})["y"])
    # And with the opset kept, the rule now gives way, naming the opset it needs.
    with pytest.raises(LoweringError, match="needs opset 13, model has 10 and the opset is kept"):
        onnx_qrewrite.rewrite(model, only=["ms-q-standard"], keep_opset=True)


def test_shape_look_ups_see_through_the_ops_a_catalogue_declares_shape_preserving(tmp_path):
    """A per-axis decomposition needs the rank of its input; the input comes from a vendor op of a
    user's own rule file, without value_info. The builder's ``preserves_shape`` makes it known."""
    mine = tmp_path / "mycorp.toml"
    mine.write_text(
        '[[rule]]\nid = "mycorp-q"\nsummary = "s"\nbuilder = "standard_qdq"\nexactness = "exact"\n'
        'match = { domain = "com.mycorp", op = "MyQuantize" }\n'
        'options = { direction = "quantize", axis_default = 1 }\n'
    )
    model = onnx.parser.parse_model(
        """
        <ir_version: 8, opset_import: ["" : 13, "com.mycorp" : 1, "com.microsoft" : 1]>
        g (float[2, 3] x) => (float[2, 3] y)
        <float s = {0.5}, uint16 z = {7}, float[3] s2 = {0.5, 0.25, 2.0}, uint16[3] z2 = {1, 2, 3}>
        {
            q = com.mycorp.MyQuantize (x, s, z)
            y = com.microsoft.DequantizeLinear <axis = 1> (q, s2, z2)
        }
        """
    )
    kw = {"skip": ["ms-dq-standard"], "keep_opset": True, "allow_unlowered": True}
    without = onnx_qrewrite.rewrite(model, **kw)
    left = {u.op_type: u.reasons for u in without.report.unlowered}
    assert "needs the rank of x 'q'" in "; ".join(left["DequantizeLinear"])
    # MyQuantize, a vendor quantization op no rule names, is said too (review finding X2).
    assert left["MyQuantize"] == (
        "no rule of the catalogue lowers com.mycorp::MyQuantize (a quantization op of a non-standard domain; "
        "it would stay in the output)",
    )
    assert "MyQuantize" not in SHIPPED.same_shape_ops
    with_rules = onnx_qrewrite.rewrite(model, rules=[mine], **kw)
    assert with_rules.report.by_rule() == {"ms-dq-decompose": 1}
    # MyQuantize itself stays (uint16 QuantizeLinear needs opset 21, and the opset is kept).
    assert [u.op_type for u in with_rules.report.unlowered] == ["MyQuantize"]
    assert "MyQuantize" in op_types(with_rules.model)


def test_ops_a_rule_matches_are_not_listed_again_for_inspect():
    matched = {op for _, op in SHIPPED.matched_ops()}
    # Standard QuantizeLinear/DequantizeLinear are the target form: only their com.microsoft
    # namesakes are lowered, so they stay in inspect's own list.
    assert matched & OTHER_QUANT_OPS <= {"QuantizeLinear", "DequantizeLinear"}
