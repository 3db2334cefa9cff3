"""Removal rules under a target plan: a rule that removes its node (every output declared unread,
contract.UNREAD) is valid only once nothing reads the node, which the engine decides
(``Plan.remove_if_dead``) after every other node's rewrite.

qdq-to-float-drop-q decided it alone (every reader a DequantizeLinear) and assumed
qdq-to-float-drop-dq rewrote those readers; the target plan rewrites only the nodes it chooses,
so for a target that accepts DequantizeLinear but refuses QuantizeLinear (webgpu with
--allow-approximate, on quantize_static models) the QuantizeLinear went and its DequantizeLinear
stayed, reading a value no node wrote: exit 5. Now the rule waits for the engine's decision, and the
plan tries a refused node's removal rule together with its readers' rules of the same builder.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from _cli_helpers import cli_in_process
from conftest import op_types
from onnx import TensorProto, helper
from test_qdq_to_float import _pair, _qdq_conv
from test_target_stage_bounds import PROFILE, _model

import onnx_qrewrite
from onnx_qrewrite.errors import EXIT_CANNOT_LOWER, InternalError, LoweringError
from onnx_qrewrite.rewriter.builders import Plan
from onnx_qrewrite.rewriter.builders.qdq_to_float import QDQToFloatBuilder
from onnx_qrewrite.rewriter.catalogue import load_catalogue, named_form
from onnx_qrewrite.targets import load_targets
from onnx_qrewrite.verify import verify

APPROXIMATE = ("exact", "bounded", "approximate")
#: The stage-bounds target (no QLinearMatMul, no QuantizeLinear; DequantizeLinear accepted) with
#: the qdq-to-float form at approximate instead of the float emulation: the colleague's profile.
DROPPING = PROFILE.replace('name = "float-emulation"\nallow = "exact"', 'name = "qdq-to-float"\nallow = "approximate"')


@pytest.fixture
def dropping(tmp_path) -> str:
    path = tmp_path / "staged.toml"
    path.write_text(DROPPING)
    return str(path)


def _checked(model: onnx.ModelProto) -> None:
    onnx.checker.check_model(model, full_check=True)


def test_a_quantize_linear_an_accepted_dequantize_linear_reads_goes_with_the_pair(dropping, tmp_path):
    """The reproduction: qop-matmul emits a QuantizeLinear the target refuses, read by the model's
    DequantizeLinear, which it accepts. The later stage removes the pair (drop-q with drop-dq on its
    reader): a valid model, approximate as declared, that verify passes."""
    model = _model(read_by_dq=True)
    src, out = tmp_path / "m.onnx", tmp_path / "out.onnx"
    onnx.save(model, src)
    done = cli_in_process("rewrite", str(src), "-o", str(out), "--target", dropping, "--allow-approximate")
    assert done.returncode == 0, done.stderr
    rewritten = onnx.load(out)
    _checked(rewritten)
    assert "QuantizeLinear" not in op_types(rewritten) and "Clip" in op_types(rewritten)
    inspected = cli_in_process("inspect", str(src), "--target", dropping, "--allow-approximate", "--json")
    assert inspected.returncode == 0, inspected.stderr
    result = onnx_qrewrite.rewrite(model, target=dropping, allow=APPROXIMATE)
    levels = {r.rule: r.exactness for r in result.report.rewrites}
    assert levels == {
        "qop-matmul": "bounded",
        "qdq-to-float-drop-q": "approximate",
        "qdq-to-float-drop-dq": "approximate",
    }, levels
    assert result.report.target["refused_after"] == 0
    report = verify(model, result.model, samples=3)
    assert report.passed, report.to_table()


def test_a_quantize_linear_something_else_reads_stays_and_is_named(dropping, tmp_path):
    """The QuantizeLinear's value is also an output of the graph: nothing may remove it, so the
    target would still refuse it. rewrite --target exits 4 with one line naming the node (mm: its
    lowering would leave that QuantizeLinear refused, no fewer than mm as it is)."""
    model = _model(read_by_dq=True)
    model.graph.output.append(helper.make_tensor_value_info("y", TensorProto.UINT8, [2, 3]))
    src, out = tmp_path / "m.onnx", tmp_path / "out.onnx"
    onnx.save(model, src)
    done = cli_in_process("rewrite", str(src), "-o", str(out), "--target", dropping, "--allow-approximate")
    assert done.returncode == EXIT_CANNOT_LOWER, done.stderr
    assert "would still refuse node mm (QLinearMatMul)" in done.stderr and "Traceback" not in done.stderr
    assert not out.exists()
    inspected = cli_in_process("inspect", str(src), "--target", dropping, "--allow-approximate", "--json")
    assert inspected.returncode == EXIT_CANNOT_LOWER
    plan = json.loads(inspected.stdout)
    assert [a["node"] for a in plan["after"]] == ["mm"]


def test_the_form_without_its_pair_rule_keeps_the_quantize_linear():
    """A plain rewrite with the form but not its pair rule (--skip qdq-to-float-drop-dq): no reader
    is rewritten, so drop-q removes nothing (it removed the QuantizeLinear before: exit 5)."""
    catalogue = load_catalogue([named_form("qdq-to-float")]).select(skip=["qdq-to-float-drop-dq"])
    model = _pair(0.05, 128)
    result = onnx_qrewrite.rewrite(model, rules=catalogue, allow=APPROXIMATE)
    assert result.report.by_rule() == {}
    assert op_types(result.model) == ["QuantizeLinear", "DequantizeLinear"]
    _checked(result.model)


def test_a_builder_that_removes_a_node_itself_is_caught_by_the_engine(monkeypatch):
    """The engine's guard: a replacement that writes nothing is a removal, which only the engine
    may decide (Plan.remove_if_dead). A builder deciding it alone (drop-q as it was) is an internal
    error naming the rule, not a model whose DequantizeLinear reads a value no node writes."""
    original = QDQToFloatBuilder.check

    def deciding_alone(self, site, options):
        return Plan() if options["form"] == "drop_pair_q" else original(self, site, options)

    monkeypatch.setattr(QDQToFloatBuilder, "check", deciding_alone)
    catalogue = load_catalogue([named_form("qdq-to-float")]).select(skip=["qdq-to-float-drop-dq"])
    with pytest.raises(InternalError, match=r"rule qdq-to-float-drop-q removed the node without Plan\.remove_if_dead"):
        onnx_qrewrite.rewrite(_pair(0.05, 128), rules=catalogue, allow=APPROXIMATE)


def test_every_rule_that_declares_its_outputs_unread_emits_nothing_and_the_reverse():
    """The plan finds removal rules by their contract (every output unread); the rule files say it
    as ``emits = ""``. The two agree for every rule of the catalogue and of every named form."""
    from onnx_qrewrite.rewriter.contract import UNREAD
    from onnx_qrewrite.targets.trials import removes

    forms = sorted(p.stem for p in named_form("qdq").parent.glob("*.toml"))
    rules = list(load_catalogue([named_form(name) for name in forms]))
    removing = {r.id for r in rules if removes(r)}
    assert removing == {r.id for r in rules if not r.emits}, removing
    assert "qdq-to-float-drop-q" in removing and "float-emulation-q-unread" in removing
    for rule in rules:
        if rule.id in removing:
            assert all(rule.contract.output_types(rule.options, ref.op) == (UNREAD,) for ref in rule.match)


def _read_twice() -> onnx.ModelProto:
    """One QuantizeLinear read by two DequantizeLinear nodes and, through one of them, a graph
    output: every reader must be rewritten before the QuantizeLinear may go."""
    model = _pair(0.05, 128)
    model.graph.node.append(helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y2"], name="dq2"))
    model.graph.node.append(helper.make_node("Add", ["y", "y2"], ["sum"], name="add"))
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info("sum", TensorProto.FLOAT, [2, 3, 4]))
    return model


def _q_also_output() -> onnx.ModelProto:
    """The quantized value is an output of the graph too: its QuantizeLinear can never go."""
    model = _pair(0.05, 128)
    model.graph.output.append(helper.make_tensor_value_info("q", TensorProto.UINT8, [2, 3, 4]))
    return model


MINIMAL = {
    "pair": lambda: _pair(0.05, 128),
    "read_twice": _read_twice,
    "q_also_output": _q_also_output,
    "static_conv": lambda: _qdq_conv(True),
    "qlinear_matmul_dq": lambda: _model(read_by_dq=True),
}


@pytest.mark.parametrize("allow", [None, APPROXIMATE], ids=["default", "approximate"])
@pytest.mark.parametrize("name", sorted(MINIMAL))
def test_every_shipped_target_gives_a_valid_model_or_refuses_cleanly(name, allow):
    """Property over the shipped profiles: on models whose QuantizeLinear nodes are read by
    DequantizeLinear nodes (and, for some, by more), ``rewrite --target`` either gives a model the
    ONNX checker takes and verify passes (at the rewrite's declared exactness), or refuses with
    exit 4. Nothing else (a broken graph was exit 5 for webgpu with --allow-approximate)."""
    model = MINIMAL[name]()
    outcomes = {}
    for target in load_targets():
        try:
            result = onnx_qrewrite.rewrite(model, target=target, allow=allow)
        except LoweringError as refused:
            assert refused.exit_code == EXIT_CANNOT_LOWER
            outcomes[target] = "refused"
            continue
        _checked(result.model)
        report = verify(model, result.model, samples=2)
        assert report.passed, f"{target}: {report.to_table()}"
        outcomes[target] = sorted({r.rule for r in result.report.rewrites})
    if allow is not None and name in ("pair", "read_twice", "static_conv"):
        # CoreML runs no Q/DQ: with consent the pairs go (each reader with its QuantizeLinear).
        assert "qdq-to-float-drop-q" in outcomes["coreml"], outcomes
    if name == "q_also_output":
        assert outcomes["coreml"] == "refused", outcomes


def test_webgpu_with_consent_removes_the_pairs_of_a_quantize_static_model(tmp_path):
    """onnxruntime's quantize_static (QDQ, uint8 activations, per-channel int8 weights) for webgpu:
    without consent it stays refused (exit 4); with --allow-approximate, exit 5 before (drop-q
    weighed alone, the DequantizeLinear nodes reading its output left as they were). Now each pair
    goes whole: a valid model without QuantizeLinear that computes what the form computes."""
    from test_qdq_to_float import quantize_static_relu_cnn

    _, quantized = quantize_static_relu_cnn(tmp_path)
    with pytest.raises(LoweringError, match="target webgpu would still refuse node"):
        onnx_qrewrite.rewrite(quantized, target="webgpu")
    result = onnx_qrewrite.rewrite(quantized, target="webgpu", allow=APPROXIMATE)
    _checked(result.model)
    assert result.report.target["refused_after"] == 0
    assert "QuantizeLinear" not in op_types(result.model)
    by_rule = result.report.by_rule()
    assert by_rule["qdq-to-float-drop-q"] > 0 and by_rule["qdq-to-float-drop-dq"] >= by_rule["qdq-to-float-drop-q"]
    # The form's own rewrite of the whole model (its numerics: tests/test_qdq_to_float.py), value for value.
    from conftest import assert_bitwise_equal, run
    from test_qdq_to_float import FORM

    whole = onnx_qrewrite.rewrite(quantized, rules=FORM, allow=APPROXIMATE).model
    x = np.random.default_rng(3).standard_normal((1, 3, 16, 16)).astype(np.float32)
    assert_bitwise_equal(run(result.model, {"x": x})["y"], run(whole, {"x": x})["y"], "webgpu's rewrite")
