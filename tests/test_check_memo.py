"""Checks decided once per node structure (builders/_facts.py): the same outcomes as checking every
node, and two nodes that differ in one fact a check reads get their own decisions."""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnx_qrewrite
from onnx_qrewrite.io.encoded import to_bytes
from onnx_qrewrite.rewriter import engine, matching
from onnx_qrewrite.rewriter.builders import NoMatch, Plan, Site
from onnx_qrewrite.rewriter.builders._facts import CheckMemo, Name, Unrecorded
from onnx_qrewrite.rewriter.graph import iter_scopes

ROOT = Path(__file__).resolve().parent.parent
U8, I8, F = TensorProto.UINT8, TensorProto.INT8, TensorProto.FLOAT


def _model(nodes, inputs, outputs, initializers=(), value_info=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers), value_info=list(value_info))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _weights(name: str, values: np.ndarray | None = None) -> onnx.TensorProto:
    rng = np.random.default_rng(0)
    w = rng.integers(0, 256, (4, 3), dtype=np.uint8) if values is None else values
    return numpy_helper.from_array(w, name)


def _matmuls(a_types, a_shapes, *, zps=(128, 128), weights=(None, None), a_from=("input", "input")):
    """Two MatMulIntegers m0 and m1, alike but for what the arguments give each."""
    nodes, inputs, inits, outs = [], [], [], []
    for k in range(2):
        a = f"a{k}"
        if a_from[k] == "dql":
            inputs.append(helper.make_tensor_value_info(f"x{k}", F, [2, 4]))
            nodes.append(helper.make_node("DynamicQuantizeLinear", [f"x{k}"], [a, f"s{k}", f"z{k}"], name=f"q{k}"))
            a_zp = f"z{k}"
        elif a_from[k] == "identity":  # a producer whose output's type nothing records
            inputs.append(helper.make_tensor_value_info(f"x{k}", a_types[k], a_shapes[k]))
            nodes.append(helper.make_node("Identity", [f"x{k}"], [a], name=f"i{k}"))
            a_zp = ""
        else:
            inputs.append(helper.make_tensor_value_info(a, a_types[k], a_shapes[k]))
            a_zp = ""
        inits += [_weights(f"w{k}", weights[k]), numpy_helper.from_array(np.array(zps[k], np.uint8), f"wz{k}")]
        nodes.append(helper.make_node("MatMulInteger", [a, f"w{k}", a_zp, f"wz{k}"], [f"y{k}"], name=f"m{k}"))
        outs.append(helper.make_tensor_value_info(f"y{k}", TensorProto.INT32, None))
    return _model(nodes, inputs, outs, inits)


def _dqls(shapes):
    nodes = [
        helper.make_node("DynamicQuantizeLinear", [f"x{k}"], [f"y{k}", f"s{k}", f"z{k}"], name=f"q{k}")
        for k in range(2)
    ]
    inputs = [helper.make_tensor_value_info(f"x{k}", F, shapes[k]) for k in range(2)]
    outputs = [helper.make_tensor_value_info(f"y{k}", U8, shapes[k]) for k in range(2)]
    return _model(nodes, inputs, outputs)


def _decisions(model: onnx.ModelProto, memo: bool) -> dict[str, tuple[str, Plan]]:
    """Node name -> (rule, plan) as matching decides them."""
    catalogue = onnx_qrewrite.load_rules()
    scopes, matches, unlowered, _ = matching.match_nodes(model, catalogue, engine.EngineOptions(memo_checks=memo), None)
    assert not unlowered
    return {scopes[s].container.node[m.index].name: (m.rule.id, m.plan) for s, ms in matches.items() for m in ms}


def _described(decision: tuple[str, Plan]) -> str:
    return f"{decision[0]} {decision[1]!r}"


# Each: a model of two nodes of one structure (op, attributes, name pattern) that differ in one
# fact their checks read, and the two nodes.
DIFFERING = {
    "A's recorded type": (_matmuls((U8, I8), ([2, 4], [2, 4])), "m0", "m1"),
    "A's rank": (_matmuls((U8, U8), ([2, 4], [3, 2, 4])), "m0", "m1"),
    "A's producer": (_matmuls((U8, U8), ([2, 4], [2, 4]), a_from=("dql", "identity")), "m0", "m1"),
    "B's zero point bytes": (_matmuls((U8, U8), ([2, 4], [2, 4]), zps=(128, 0)), "m0", "m1"),
    "B's values": (
        _matmuls((U8, U8), ([2, 4], [2, 4]), weights=(np.full((4, 3), 128, np.uint8), None)),
        "m0",
        "m1",
    ),
    "the quantized input's shape": (_dqls(([1, 4], [1, 16])), "q0", "q1"),
}


@pytest.mark.parametrize("case", list(DIFFERING))
def test_nodes_differing_in_one_fact_read_get_their_own_decisions(case):
    model, first, second = DIFFERING[case]
    recorded, fresh = _decisions(model, memo=True), _decisions(model, memo=False)
    assert {k: _described(v) for k, v in recorded.items()} == {k: _described(v) for k, v in fresh.items()}
    assert _described(recorded[first]) != _described(recorded[second])


def test_nodes_of_one_structure_share_one_plan():
    model = _matmuls((U8, U8), ([2, 4], [2, 4]), weights=(None, None), zps=(128, 128))
    # Same weights too: one initializer read by both.
    for node in model.graph.node:
        node.input[1], node.input[3] = "w0", "wz0"
    recorded = _decisions(model, memo=True)
    assert recorded["m0"][1] is recorded["m1"][1]
    fresh = _decisions(model, memo=False)
    assert fresh["m0"][1] is not fresh["m1"][1]
    assert _described(recorded["m0"]) == _described(fresh["m0"]) == _described(fresh["m1"])


MODELS = sorted((ROOT / "sample_models").glob("*.onnx")) + sorted((ROOT / "tests/data/models").glob("*.onnx"))


@pytest.mark.parametrize("path", MODELS, ids=lambda p: p.name)
def test_recorded_checks_rewrite_as_fresh_ones(path):
    """Byte for byte, report included, on the committed models (and with every option the
    rules take at their defaults)."""
    results = []
    for memo in (True, False):
        model = onnx.load(path)
        rewritten, report = engine.run(model, onnx_qrewrite.load_rules(), engine.EngineOptions(memo_checks=memo))
        results.append((to_bytes(rewritten), report.to_dict()))
    assert results[0] == results[1]


def test_a_chain_rewrites_as_with_fresh_checks():
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from models import _chain_model_bytes

    results = []
    for memo in (True, False):
        model = onnx.ModelProto.FromString(_chain_model_bytes(30))
        rewritten, report = engine.run(model, onnx_qrewrite.load_rules(), engine.EngineOptions(memo_checks=memo))
        results.append((to_bytes(rewritten), report.to_dict()))
    assert results[0] == results[1]


def test_a_structure_decided_together_gets_what_each_node_would(monkeypatch):
    """Eight DynamicQuantizeLinears of one structure whose inputs' shapes take three values (one
    of them unknown) in no order: matching decides them together (one trace per path, each
    replayed for all the nodes still open at once) and each gets what checking it alone gives."""
    shapes = [[1, 4], [1, 16], None, [1, 4], [1, 4], None, [1, 16], [1, 4]]
    nodes = [
        helper.make_node("DynamicQuantizeLinear", [f"x{k}"], [f"y{k}", f"s{k}", f"z{k}"], name=f"q{k}")
        for k in range(len(shapes))
    ]
    inputs = [helper.make_tensor_value_info(f"x{k}", F, shape) for k, shape in enumerate(shapes)]
    outputs = [helper.make_tensor_value_info(f"y{k}", U8, shape) for k, shape in enumerate(shapes)]
    model = _model(nodes, inputs, outputs)
    together = []
    replay_all = matching.replay_all
    monkeypatch.setattr(
        matching, "replay_all", lambda traces, ins, *rest: together.append(len(ins)) or replay_all(traces, ins, *rest)
    )
    recorded, fresh = _decisions(model, memo=True), _decisions(model, memo=False)
    assert {k: _described(v) for k, v in recorded.items()} == {k: _described(v) for k, v in fresh.items()}
    assert len(recorded) == len(shapes)
    assert together and max(together) > 1  # the bulk replay ran, for several nodes at once
    assert recorded["q0"][1] is recorded["q3"][1] is recorded["q7"][1]  # one plan per path


def _external(name: str) -> onnx.TensorProto:
    """A uint8 scalar stored as external data: reading it without the model's folder fails."""
    tensor = numpy_helper.from_array(np.array(0, np.uint8), name)
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value=f"{name}.bin")
    return tensor


def test_a_failing_check_fails_for_the_first_node_in_order():
    """Nodes taken structure by structure must not change which node's failure is reported: m1
    (its own structure, an absent input) fails before m2 (m0's structure) in node order."""
    nodes = [
        helper.make_node("MatMulInteger", ["a0", "w0", "az0", "wz0"], ["y0"], name="m0"),
        helper.make_node("MatMulInteger", ["a1", "w0", "", "wz1"], ["y1"], name="m1"),
        helper.make_node("MatMulInteger", ["a2", "w0", "az2", "wz0"], ["y2"], name="m2"),
    ]
    inputs = [helper.make_tensor_value_info(f"a{k}", U8, [2, 4]) for k in range(3)]
    outputs = [helper.make_tensor_value_info(f"y{k}", TensorProto.INT32, None) for k in range(3)]
    zero = numpy_helper.from_array(np.array(0, np.uint8), "az0")
    inits = [_weights("w0"), zero, numpy_helper.from_array(np.array(128, np.uint8), "wz0"), _external("wz1")]
    model = _model(nodes, inputs, outputs, [*inits, _external("az2")])
    catalogue = onnx_qrewrite.load_rules()
    messages = []
    for memo in (True, False):
        with pytest.raises(onnx_qrewrite.errors.InvalidModelError) as failed:
            matching.match_nodes(model, catalogue, engine.EngineOptions(memo_checks=memo), None)
        messages.append(str(failed.value))
    assert "'wz1'" in messages[1] and messages[0] == messages[1]


def _bulk_models() -> list[onnx.ModelProto]:
    """Models whose names exercise the bulk questions: initializers, Constants, a shape seen
    through Identity and Cast, recorded and unrecorded shapes, a subgraph, absent optional names."""
    const = helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.array([3], np.uint8)))
    floats = helper.make_node("Constant", [], ["cf"], value_floats=[1.0, 2.0])
    nodes = [
        const,
        floats,
        helper.make_node("Identity", ["x"], ["xi"]),
        helper.make_node("Cast", ["xi"], ["xc"], to=F),
        helper.make_node("Relu", ["xc"], ["r"]),
        helper.make_node("DynamicQuantizeLinear", ["r"], ["q", "", "zp"]),
        helper.make_node("MatMulInteger", ["q", "w", "zp", "c"], ["y"]),
    ]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", F, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, None)],
        [_weights("w")],
        [helper.make_tensor_value_info("r", F, [2, 4])],
    )
    return [model, *(onnx.load(path) for path in MODELS[:4])]


@pytest.mark.parametrize("model", _bulk_models(), ids=lambda m: m.graph.name)
def test_bulk_questions_answer_as_the_site_does(model):
    """The bulk forms matching asks recorded questions through (graph.Scope.elem_types,
    producer_ops, constants; _qdq.value_shapes) give each name the Site's own answer."""
    from onnx_qrewrite.rewriter.builders._qdq import value_shapes

    same_shape = frozenset({"Cast"})
    for scope in iter_scopes(model, None, op_codes=True):
        nodes = scope.container.node
        if not len(nodes):
            continue
        names = sorted({n for node in nodes for n in (*node.input, *node.output)} | {"", "nowhere"})
        names = names + names[::-1]  # repeats, in another order
        site = Site(nodes[0], scope, same_shape)
        handed = {k: tuple(node.output) for k, node in enumerate(nodes) if k % 2}  # some outputs handed over
        assert scope.elem_types(names) == [site.elem_type(n) for n in names]
        ops = scope.producer_ops(names, handed, {})
        assert ops is None or ops == [site.producer_op(n) for n in names]
        known: dict[str, int] = {}  # filled by the first, read by the others
        shapes = value_shapes(scope, names, same_shape, handed, known)
        assert shapes is None or shapes == [site.value_shape(n) for n in names]
        values = scope.constants(names, handed, known)
        if values is not None:
            for name, value in zip(names, values, strict=True):
                expected = site.constant(name)
                assert (value is None) == (expected is None), name
                assert value is None or (value.dtype == expected.dtype and np.array_equal(value, expected)), name


# -- the recording itself ------------------------------------------------------------------------


def _sites(model: onnx.ModelProto) -> list[Site]:
    scope = iter_scopes(model, None)[0]
    return [Site(node, scope) for node in scope.container.node]


RULE = types.SimpleNamespace(id="test-rule")


def test_a_name_gives_no_text():
    name = Name("blk1/x", ("i", 0))
    assert name == Name("blk1/x", ("o", 2)) and name != "" and bool(name)
    assert hash(name) == hash("blk1/x")
    for use in (str, repr, lambda n: f"{n}", lambda n: f"{n!r}", lambda n: n == "blk1/x"):
        with pytest.raises(Unrecorded):
            use(name)
    with pytest.raises((TypeError, AttributeError)):
        name + "/suffix"
    with pytest.raises((TypeError, AttributeError)):
        name.startswith("blk")  # type: ignore[attr-defined]


def test_a_plan_naming_its_node_is_never_shared():
    calls = []

    def check(site: Site) -> Plan:
        calls.append(type(site).__name__)
        return Plan(notes=(f"reads {site.inputs[0]}",))

    memo = CheckMemo()
    plans = [memo.decide(RULE, site, check) for site in _sites(_dqls(([4], [4])))]
    assert [p.notes for p in plans] == [("reads x0",), ("reads x1",)]
    assert calls == ["RecordingSite", "Site", "RecordingSite", "Site"]


def test_a_check_comparing_a_name_with_a_literal_is_never_shared():
    def check(site: Site) -> Plan:
        return Plan(notes=("first" if site.inputs[0] == "x0" else "other",))

    memo = CheckMemo()
    assert [memo.decide(RULE, site, check).notes for site in _sites(_dqls(([4], [4])))] == [("first",), ("other",)]


def test_a_check_reading_the_node_itself_is_never_shared():
    def check(site: Site) -> Plan:
        return Plan(notes=(site.node.op_type,))

    memo = CheckMemo()
    sites = _sites(_dqls(([4], [4])))
    assert [memo.decide(RULE, site, check).notes for site in sites] == [("DynamicQuantizeLinear",)] * 2


def test_a_recorded_decline_is_shared_only_without_names():
    def check(site: Site) -> Plan:
        if site.value_shape(site.inputs[0]) == (4,):
            raise NoMatch("four elements")
        raise NoMatch(f"{site.inputs[0]!r} has another shape")

    memo = CheckMemo()
    reasons = []
    for site in _sites(_dqls(([4], [5]))) + _sites(_dqls(([4], [6]))):
        with pytest.raises(NoMatch) as why:
            memo.decide(RULE, site, check)
        reasons.append(str(why.value))
    assert reasons == ["four elements", "'x1' has another shape", "four elements", "'x1' has another shape"]


# -- template keys made once per structure (apply._template_key) -----------------------------------


def _rewrite_checking_template_keys(model: onnx.ModelProto, monkeypatch, by_structure: bool):
    """The rewrite's bytes and report, every template key the build used compared with the
    builder's own for that node (``by_structure``: builders keep ``template_key_of_structure``)."""
    from onnx_qrewrite.rewriter import apply
    from onnx_qrewrite.rewriter.builders.dynamic_quantize import DynamicQuantizeLinearBuilder
    from onnx_qrewrite.rewriter.builders.integer_matmul import IntegerMatMulBuilder

    for cls in (DynamicQuantizeLinearBuilder, IntegerMatMulBuilder):
        monkeypatch.setattr(cls, "template_key_of_structure", by_structure)
    made = apply._template_of
    cached: list[int] = []

    def checked(build, m, builder, site, scope, pool):
        key, template = made(build, m, builder, site, scope, pool)
        # Every key the build uses, from the per-structure cache or not, against the builder's
        # own key for this node (computed here, outside the cache).
        own = builder.template_key(site, m.rule.options, m.plan)
        assert key == (None if own is None else (m.rule.id, id(pool), own)), site.label
        cached.append(m.structure is not None)
        return key, template

    monkeypatch.setattr(apply, "_template_of", checked)
    rewritten, report = engine.run(model, onnx_qrewrite.load_rules(), engine.EngineOptions())
    monkeypatch.undo()
    return to_bytes(rewritten), report.to_dict(), cached


def test_template_keys_by_structure_tell_structures_sharing_a_plan_apart(monkeypatch):
    """Two DynamicQuantizeLinears with one shared plan (``_plan`` is cached per semantics and
    guard) that differ only in an absent output: each gets its own template key, and the rewrite
    is the one made with every key made per node."""
    model = _dqls(([1, 4], [1, 4]))
    model.graph.node[1].output[2] = ""
    decided = _decisions(model, memo=True)
    assert decided["q0"][1] is decided["q1"][1]  # one plan object: only the structure differs
    data = model.SerializeToString()
    by_structure = _rewrite_checking_template_keys(onnx.ModelProto.FromString(data), monkeypatch, True)
    per_node = _rewrite_checking_template_keys(onnx.ModelProto.FromString(data), monkeypatch, False)
    assert all(by_structure[2]) and len(by_structure[2]) == 2
    assert by_structure[:2] == per_node[:2]


def test_template_keys_by_structure_rewrite_as_per_node_keys(monkeypatch):
    """A chain and integer matmuls of several wirings and facts, byte for byte."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from models import _chain_model_bytes

    models = [onnx.ModelProto.FromString(_chain_model_bytes(12)), *(m for m, _, _ in DIFFERING.values())]
    twice = _matmuls((U8, U8), ([2, 4], [2, 4]))
    twice.graph.node[1].input[3] = "wz0"  # m1 reads m0's weight zero point: another wiring, same facts
    models.append(twice)
    for model in models:
        data = model.SerializeToString()
        results = [
            _rewrite_checking_template_keys(onnx.ModelProto.FromString(data), monkeypatch, flag)
            for flag in (True, False)
        ]
        assert results[0][:2] == results[1][:2]
