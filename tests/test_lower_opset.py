"""Exact opset lowering (targets/lower_opset.py, rules/opsets/lowering.toml): a lowered model
computes bit for bit what the original does in onnxruntime; a node not valid unchanged at the
lower opset blocks the step and is named; the target plan lowers only when the target needs it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
from _cli_helpers import cli_in_process
from onnx import TensorProto, defs, helper, numpy_helper

from onnx_qrewrite import rewrite
from onnx_qrewrite.api import load_rules
from onnx_qrewrite.errors import LoweringError
from onnx_qrewrite.targets import load_target, plan_for_model, plan_for_target
from onnx_qrewrite.targets.check import _inferred
from onnx_qrewrite.targets.lower_opset import lower_default_opset, lowering_blockers, lowering_steps

REPO = Path(__file__).resolve().parent.parent
SAMPLE_U16 = REPO / "sample_models" / "qdq_contrib_u16.onnx"
ort = pytest.importorskip("onnxruntime")


def _opset(model: onnx.ModelProto) -> int:
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def _model(
    nodes: list[onnx.NodeProto],
    inits: list[onnx.TensorProto],
    shape: list[int],
    opset: int = 21,
    out: list[int] | None = None,
) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape if out is None else out)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def _changed_ops_model() -> onnx.ModelProto:
    """Opset 21, with most ops whose schema changed at 21 used with opset-20 types: int8 per-axis
    Q/DQ, Reshape, Transpose, Flatten, Squeeze/Unsqueeze, Pad, Cast, CastLike, Identity, Constant,
    Shape, Size, ConstantOfShape."""
    inits = [
        numpy_helper.from_array(np.array([0.05, 0.1, 0.02], np.float32), "s"),
        numpy_helper.from_array(np.array([3, -7, 0], np.int8), "z"),
        numpy_helper.from_array(np.array([1, 3, 4], np.int64), "shape"),
        numpy_helper.from_array(np.array([0, 0, 1, 0, 0, 1], np.int64), "pads"),
        numpy_helper.from_array(np.array([0], np.int64), "axes"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], name="q", axis=1),
        helper.make_node("Transpose", ["q"], ["t"], name="t", perm=[0, 2, 1]),
        helper.make_node("Transpose", ["t"], ["t2"], name="t2", perm=[0, 2, 1]),
        helper.make_node("DequantizeLinear", ["t2", "s", "z"], ["d"], name="dq", axis=1),
        helper.make_node("Pad", ["d", "pads"], ["p"], name="pad"),
        helper.make_node("Reshape", ["p", "shape"], ["r"], name="reshape", allowzero=0),
        helper.make_node("Squeeze", ["r", "axes"], ["sq"], name="squeeze"),
        helper.make_node("Unsqueeze", ["sq", "axes"], ["un"], name="unsqueeze"),
        helper.make_node("Flatten", ["un"], ["f"], name="flatten", axis=1),
        helper.make_node("Cast", ["f"], ["c16"], name="cast", to=TensorProto.FLOAT16),
        helper.make_node("Constant", [], ["k"], name="k", value=numpy_helper.from_array(np.array(2.5, np.float32))),
        helper.make_node("CastLike", ["c16", "k"], ["c32"], name="castlike"),
        helper.make_node("Identity", ["c32"], ["i"], name="identity"),
        helper.make_node("Shape", ["i"], ["sh"], name="shape_of"),
        helper.make_node(
            "ConstantOfShape", ["sh"], ["ones"], name="ones", value=helper.make_tensor("v", 1, [1], [1.0])
        ),
        helper.make_node("Size", ["i"], ["n"], name="size"),
        helper.make_node("Cast", ["n"], ["nf"], name="cast_n", to=TensorProto.FLOAT),
        helper.make_node("Mul", ["i", "k"], ["m"], name="mul"),
        helper.make_node("Add", ["m", "ones"], ["a"], name="add"),
        helper.make_node("Add", ["a", "nf"], ["y"], name="add_n"),
    ]
    model = _model(nodes, inits, [1, 3, 2], out=[1, 12])
    onnx.checker.check_model(model, full_check=True)
    return model


def _types(schema: defs.OpSchema) -> set[str]:
    """Every element type a schema's constraints allow (tensor(x), seq(tensor(x)) -> x)."""
    strip = lambda t: t.rsplit("(", 1)[-1].rstrip(")")  # noqa: E731
    return {strip(t) for c in schema.type_constraints for t in c.allowed_type_strs}


def test_the_table_describes_every_step_from_21_to_26():
    assert sorted(lowering_steps()) == [21, 22, 23, 24, 25, 26]
    assert all(step.target == version - 1 for version, step in lowering_steps().items())


@pytest.mark.parametrize("version", [21, 22, 23, 24, 25, 26])
def test_the_table_lists_exactly_the_ops_onnx_changed_at_each_step(version):
    """Each step describes every op whose schema changed at its opset, and nothing else; the ops
    it calls absent are exactly those with no schema below; and a "when-valid" entry's text
    names every type and attribute the newer schema added (so the text is the schemas' diff)."""
    step = lowering_steps()[version]
    changed = {s.name for s in defs.get_all_schemas_with_history() if s.domain == "" and s.since_version == version}
    assert set(step.ops) == changed
    for op, change in step.ops.items():
        new = defs.get_schema(op, version, "")
        try:
            old = defs.get_schema(op, version - 1, "")
        except defs.SchemaError:
            assert change.exact == "absent", op
            continue
        assert change.exact != "absent", op
        if change.exact != "when-valid":
            continue
        for added in sorted(_types(new) - _types(old)):
            named = added in change.change or ("float8" in change.change and added[6:] in change.change)
            assert named, f"{op}-{version}: {added} added, not named in {change.change!r}"
        for attr in sorted(set(new.attributes) - set(old.attributes)):
            assert attr in change.change, f"{op}-{version}: attribute {attr} added, not named"


def test_the_changes_that_alter_semantics_are_marked():
    """What the Changelog says changed meaning (not only types): these block a node."""
    steps = lowering_steps()
    assert steps[21].ops["GroupNormalization"].exact == "never"
    assert steps[22].ops["MaxPool"].differs_if_attribute == (("ceil_mode", 1),)
    assert steps[22].ops["AveragePool"].differs_if_attribute == (("ceil_mode", 1),)
    assert steps[24].ops["Cast"].differs_if_type == ("float8e4m3fnuz", "float8e5m2fnuz")
    assert steps[24].ops["CastLike"].differs_if_type == ("float8e4m3fnuz", "float8e5m2fnuz")
    assert steps[24].ops["Attention"].exact == "never"
    new = {op for step in steps.values() for op, change in step.ops.items() if change.exact == "absent"}
    assert new == {"Attention", "RMSNormalization", "RotaryEmbedding", "Swish", "TensorScatter", "BitCast", "CumProd"}


def test_a_lowered_model_computes_bit_for_bit_what_the_original_does():
    model = _changed_ops_model()
    assert lowering_blockers(_inferred(model), 20) == []
    lowered = lower_default_opset(model, 20)
    assert _opset(lowered) == 20 and _opset(model) == 21  # the input is not modified
    assert [n.SerializeToString() for n in lowered.graph.node] == [n.SerializeToString() for n in model.graph.node]
    rng = np.random.default_rng(0)
    for scale in (0.1, 1.0, 10.0, 1e3):
        x = (rng.standard_normal((1, 3, 2)) * scale).astype(np.float32)
        x.flat[0] = np.nan if scale == 1e3 else x.flat[0]
        want, got = _run(model, x), _run(lowered, x)
        assert want.dtype == got.dtype and want.tobytes() == got.tobytes()


def test_the_tensorrt_rewrite_of_a_16_bit_contrib_model_is_lowered_and_still_bit_exact():
    """qdq_contrib_u16 declares 21; the TensorRT rewrite computes its Q/DQ in float, so every node
    is valid at 20: the result declares 20 and agrees bit for bit with the original."""
    result = rewrite(SAMPLE_U16, target="tensorrt")
    lowered = result.model
    assert _opset(lowered) == 20
    assert [(c.domain, c.before, c.after) for c in result.report.opset_changes if c.domain == ""] == [("", 21, 20)]
    assert any(p.key == "onnx_qrewrite.rule" for n in lowered.graph.node for p in n.metadata_props)  # provenance kept
    original = onnx.load(SAMPLE_U16)
    name = original.graph.input[0].name
    dims = [d.dim_value or 1 for d in original.graph.input[0].type.tensor_type.shape.dim]
    rng = np.random.default_rng(1)
    for _ in range(3):
        x = rng.standard_normal(dims).astype(np.float32)
        want = _session(original).run(None, {name: x})
        got = _session(lowered).run(None, {name: x})
        assert all(a.tobytes() == b.tobytes() for a, b in zip(want, got, strict=True))


def _session(model: onnx.ModelProto):
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _uint16_qdq() -> onnx.ModelProto:
    inits = [
        numpy_helper.from_array(np.array(0.01, np.float32), "s"),
        numpy_helper.from_array(np.array(30000, np.uint16), "z"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], name="q16"),
        helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], name="dq16"),
    ]
    return _model(nodes, inits, [4])


def test_a_uint16_quantize_blocks_the_lowering_and_is_named():
    """uint16 Q/DQ came with opset 21: at 20 the same node is invalid, so the step is refused."""
    model = _uint16_qdq()
    blockers = lowering_blockers(_inferred(model), 20)
    assert len(blockers) == 2
    assert blockers[0].startswith("node q16 (QuantizeLinear): ")
    assert "is uint16, which QuantizeLinear does not take at opset 20" in blockers[0]
    assert blockers[0].endswith("[opsets/onnx-changelog]")
    with pytest.raises(LoweringError, match=r"cannot lower the opset to 20 exactly: node q16 .*\(and 1 more\)"):
        lower_default_opset(model, 20)


@pytest.mark.parametrize(
    ("node", "inits", "expected"),
    [
        (
            helper.make_node("GroupNormalization", ["x", "sc", "b"], ["y"], name="gn", num_groups=1),
            [numpy_helper.from_array(np.ones(3, np.float32), n) for n in ("sc", "b")],
            "node gn (GroupNormalization): GroupNormalization computes something else at opset 20",
        ),
        (
            helper.make_node("DequantizeLinear", ["w", "ws"], ["wd"], name="blocked", axis=1, block_size=2),
            [
                numpy_helper.from_array(np.arange(6, dtype=np.int8).reshape(3, 2), "w"),
                numpy_helper.from_array(np.ones((3, 1), np.float32), "ws"),
            ],
            "node blocked (DequantizeLinear): sets block_size, which DequantizeLinear does not have at opset 20",
        ),
    ],
)
def test_a_changed_op_used_beyond_opset_20_blocks_the_lowering(node, inits, expected):
    nodes = [node] if node.op_type == "GroupNormalization" else [node, helper.make_node("Add", ["x", "x"], ["y"])]
    model = _model(nodes, inits, [1, 3, 2])
    blockers = lowering_blockers(_inferred(model), 20)
    assert len(blockers) == 1 and blockers[0].startswith(expected)


def test_an_opset_without_a_described_step_is_not_lowered():
    """onnx 1.23.2 defines opsets 27 and 28; no step from them is described yet."""
    model = _model([helper.make_node("Relu", ["x"], ["y"])], [], [2], opset=28)
    assert lowering_blockers(_inferred(model), 20) == [
        "no exact lowering from opset 28 to 27 is described (rules/opsets/lowering.toml)"
    ]


def test_the_tensorrt_plan_lowers_only_what_it_must_and_says_so():
    catalogue, profile = load_rules(), load_target("tensorrt")
    plan = plan_for_target(SAMPLE_U16, catalogue, profile)
    assert plan.ok and plan.opset_lowering is not None
    assert (plan.opset_lowering["from"], plan.opset_lowering["to"]) == (21, 20)
    assert plan.rewritten is not None and _opset(plan.rewritten) == 20
    (model_verdict,) = [n for n in plan.nodes if n.node == "(model)"]
    assert (model_verdict.rule, model_verdict.exactness, model_verdict.status) == (
        "lower-opset",
        "exact",
        "fixed by the rewrite",
    )
    assert "(model)" in {r.node for r in plan.before}  # the model as given is refused: counted
    assert plan.to_dict()["opset_lowering"]["to"] == 20
    # --keep-opset: nothing lowered, and the refusal says why.
    kept = plan_for_target(SAMPLE_U16, catalogue, profile, keep_opset=True)
    assert kept.opset_lowering is None and [r.node for r in kept.after] == ["(model)"]
    assert "not lowered: the opset is kept (--keep-opset)" in kept.after[0].reasons[0]
    # A target that loads opset 21 gets the model at 21; a rewrite without a target never lowers.
    assert plan_for_target(SAMPLE_U16, catalogue, load_target("openvino")).opset_lowering is None
    assert _opset(rewrite(SAMPLE_U16).model) == 21


def test_the_plan_refuses_a_model_whose_lowering_is_not_exact_and_names_the_node():
    """A float GroupNormalization at opset 21 (TensorRT runs the op) cannot be lowered exactly:
    the model-wide refusal says which node and why, and nothing is lowered."""
    inits = [numpy_helper.from_array(np.ones(3, np.float32), n) for n in ("sc", "b")]
    model = _model(
        [helper.make_node("GroupNormalization", ["x", "sc", "b"], ["y"], name="gn", num_groups=3)], inits, [1, 3, 2]
    )
    plan = plan_for_model(model, load_rules(), load_target("tensorrt"))
    assert plan.opset_lowering is None and plan.rewritten is not None and _opset(plan.rewritten) == 21
    assert [r.node for r in plan.after] == ["(model)"]
    reason = plan.after[0].reasons[0]
    assert "opset 21 is above the highest the target loads (20)" in reason
    assert "not lowered to 20: node gn (GroupNormalization)" in reason
    with pytest.raises(LoweringError, match="node gn"):
        rewrite(model, target="tensorrt")


def _cli(*args: object) -> subprocess.CompletedProcess:
    """The command line in this process (tests/_cli_helpers.py): what it prints, writes and exits with."""
    return cli_in_process(*args)


def test_inspect_and_rewrite_for_tensorrt_count_and_report_the_lowering(tmp_path):
    proc = _cli("inspect", SAMPLE_U16, "--target", "tensorrt", "--json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert (plan["refused_before"], plan["refused_after"]) == (23, 0)
    assert (plan["opset_lowering"]["from"], plan["opset_lowering"]["to"]) == (21, 20)
    out = tmp_path / "u16.trt.onnx"
    proc = _cli("rewrite", SAMPLE_U16, "-o", out, "--target", "tensorrt")
    assert proc.returncode == 0, proc.stderr
    assert "opset ai.onnx: 21 -> 20 (target tensorrt loads opsets up to 20" in proc.stdout
    assert _opset(onnx.load(out)) == 20
    kept = tmp_path / "kept.onnx"
    proc = _cli("rewrite", SAMPLE_U16, "-o", kept, "--target", "tensorrt", "--keep-opset")
    assert proc.returncode == 4 and not kept.exists()
    assert "not lowered: the opset is kept (--keep-opset)" in proc.stderr


def test_a_standard_uint16_qdq_model_reaches_tensorrt_through_the_float_emulation_then_the_lowering():
    """A uint16 QuantizeLinear is not valid at 20, but the catalogue's exact float emulation
    (the form TensorRT's profile names) replaces it; the result is then lowered, and computes bit
    for bit what the opset-21 original does in onnxruntime."""
    model = _uint16_qdq()
    plan = plan_for_model(model, load_rules(), load_target("tensorrt"))
    assert plan.ok and plan.opset_lowering is not None and plan.rewritten is not None
    assert {n.node: n.rule for n in plan.nodes} == {
        "(model)": "lower-opset",
        "q16": "float-emulation-q",
        "dq16": "float-emulation-qdq-pair",
    }
    assert _opset(plan.rewritten) == 20
    x = np.concatenate([np.random.default_rng(2).standard_normal(1000) * 400, [np.inf, -np.inf, np.nan, 0.005]])
    x = x.astype(np.float32)
    single = helper.make_tensor_value_info("x", TensorProto.FLOAT, [len(x)])
    for m in (model, plan.rewritten):
        m.graph.input[0].CopyFrom(single)
        m.graph.output[0].type.tensor_type.shape.dim[0].dim_value = len(x)
    assert _run(model, x).tobytes() == _run(plan.rewritten, x).tobytes()


def _qdq_matmul(opset: int) -> onnx.ModelProto:
    """Symmetric int8 Q/DQ of the activation, a per-channel int8 weight, MatMul: the form TensorRT
    runs as it is, declared at ``opset`` (with the lowest IR version onnx allows for it)."""
    rng = np.random.default_rng(opset)
    inits = [
        numpy_helper.from_array(np.array(0.02, np.float32), "xs"),
        numpy_helper.from_array(np.array(0, np.int8), "xz"),
        numpy_helper.from_array(rng.integers(-127, 128, (8, 4)).astype(np.int8), "w"),
        numpy_helper.from_array(rng.uniform(0.005, 0.02, 4).astype(np.float32), "ws"),
        numpy_helper.from_array(np.zeros(4, np.int8), "wz"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"], name="q"),
        helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"], name="dq"),
        helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wd"], name="wdq", axis=1),
        helper.make_node("MatMul", ["xd", "wd"], ["y"], name="mm"),
    ]
    model = _model(nodes, inits, [2, 8], opset=opset, out=[2, 4])
    model.ir_version = helper.find_min_ir_version_for([helper.make_opsetid("", opset)])
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize("opset", [22, 23, 24, 25, 26])
def test_a_qdq_matmul_model_above_opset_20_reaches_tensorrt_and_computes_bit_for_bit_the_same(opset):
    """Opsets 22-26 (26: the highest onnxruntime 1.31.1 loads) lowered step by step to TensorRT's
    20; the nodes are unchanged and onnxruntime computes the same bits before and after."""
    model = _qdq_matmul(opset)
    result = rewrite(model, target="tensorrt")
    lowered = result.model
    assert _opset(lowered) == 20 and _opset(model) == opset
    assert [(c.domain, c.before, c.after) for c in result.report.opset_changes] == [("", opset, 20)]
    assert [n.op_type for n in lowered.graph.node] == [
        "QuantizeLinear",
        "DequantizeLinear",
        "DequantizeLinear",
        "MatMul",
    ]
    rng = np.random.default_rng(3)
    for scale in (0.1, 1.0, 10.0):
        x = (rng.standard_normal((2, 8)) * scale).astype(np.float32)
        x.flat[:3] = [np.inf, -np.inf, np.nan] if scale == 10.0 else x.flat[:3]
        assert _run(model, x).tobytes() == _run(lowered, x).tobytes()


def test_inspect_and_rewrite_for_tensorrt_take_an_opset_26_model_down_the_chain(tmp_path):
    source = tmp_path / "qdq26.onnx"
    onnx.save(_qdq_matmul(26), source)
    proc = _cli("inspect", source, "--target", "tensorrt", "--json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert (plan["refused_before"], plan["refused_after"]) == (1, 0)  # the opset, then nothing
    assert (plan["opset_lowering"]["from"], plan["opset_lowering"]["to"]) == (26, 20)
    out = tmp_path / "qdq26.trt.onnx"
    proc = _cli("rewrite", source, "-o", out, "--target", "tensorrt")
    assert proc.returncode == 0, proc.stderr
    assert "opset ai.onnx: 26 -> 20 (target tensorrt loads opsets up to 20" in proc.stdout
    assert _opset(onnx.load(out)) == 20


def _maxpool(opset: int, ceil_mode: int) -> onnx.ModelProto:
    node = helper.make_node(
        "MaxPool", ["x"], ["y"], name="mp", kernel_shape=[1, 1], strides=[2, 2], ceil_mode=ceil_mode
    )
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 2, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "c", "h", "w"])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def test_a_maxpool_whose_meaning_changed_at_22_is_refused_naming_the_op_and_the_step(tmp_path):
    """MaxPool-22 with ceil_mode = 1 drops a window that starts in the right padding; at 21 onnx's
    shape inference keeps it (kernel 1, stride 2 on 2x2: 2x2 at 21, 1x1 at 22): the model is not
    lowered, and the refusal names the node, the op and the step."""
    model = _maxpool(22, ceil_mode=1)
    shapes = [
        [
            d.dim_value
            for d in onnx.shape_inference.infer_shapes(_maxpool(v, 1)).graph.output[0].type.tensor_type.shape.dim
        ]
        for v in (21, 22)
    ]
    assert shapes == [[1, 1, 2, 2], [1, 1, 1, 1]]  # onnx's own schemas disagree on this node
    plan = plan_for_model(model, load_rules(), load_target("tensorrt"))
    assert plan.opset_lowering is None and [r.node for r in plan.after] == ["(model)"]
    reason = plan.after[0].reasons[0]
    assert (
        "not lowered to 20: node mp (MaxPool): sets ceil_mode = 1, for which MaxPool computes something else" in reason
    )
    assert "[step 22 -> 21]" in reason
    source, out = tmp_path / "mp22.onnx", tmp_path / "mp22.trt.onnx"
    onnx.save(model, source)
    proc = _cli("rewrite", source, "-o", out, "--target", "tensorrt")
    assert proc.returncode == 4 and not out.exists()
    assert "node mp (MaxPool): sets ceil_mode = 1" in proc.stderr and "[step 22 -> 21]" in proc.stderr


def test_a_maxpool_without_ceil_mode_at_22_is_lowered_bit_for_bit():
    model = _maxpool(22, ceil_mode=0)
    lowered = lower_default_opset(model, 20)
    x = np.random.default_rng(4).standard_normal((1, 1, 2, 2)).astype(np.float32)
    assert _opset(lowered) == 20 and _run(model, x).tobytes() == _run(lowered, x).tobytes()


def _blockers(nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto], opset: int, shape: list[int]) -> list[str]:
    model = _model(nodes, inits, shape, opset=opset)
    model.ir_version = helper.find_min_ir_version_for([helper.make_opsetid("", opset)])
    return lowering_blockers(_inferred(model), 20)


def test_a_cast_to_a_float8_fnuz_type_at_24_is_refused_at_the_step_24_to_23():
    """Cast-24 saturates +-inf to +-FLT_MAX for the *fnuz types; Cast-23 gives NaN."""
    nodes = [
        helper.make_node("Cast", ["x"], ["f8"], name="to_fnuz", to=TensorProto.FLOAT8E4M3FNUZ),
        helper.make_node("Cast", ["f8"], ["y"], name="back", to=TensorProto.FLOAT),
    ]
    blockers = _blockers(nodes, [], 24, [4])
    assert len(blockers) == 2 and blockers[0].startswith(
        "node to_fnuz (Cast): 'f8' is float8e4m3fnuz, for which Cast computes something else at opset 23"
    )
    assert all("[step 24 -> 23]" in b for b in blockers)
    plain = [
        helper.make_node("Cast", ["x"], ["h"], to=TensorProto.FLOAT16),
        helper.make_node("Cast", ["h"], ["y"], to=1),
    ]
    assert _blockers(plain, [], 24, [4]) == []  # the same op with other types lowers


def test_an_op_new_at_23_blocks_the_chain_at_its_first_step():
    nodes = [helper.make_node("RMSNormalization", ["x", "g"], ["y"], name="rms", axis=-1)]
    blockers = _blockers(nodes, [numpy_helper.from_array(np.ones(4, np.float32), "g")], 23, [2, 4])
    assert blockers == [
        "node rms (RMSNormalization): RMSNormalization does not exist at opset 22 (new at opset 23 "
        "(Attention-23, RMSNormalization-23, RotaryEmbedding-23): no such op at 22) "
        "[step 23 -> 22] [opsets/onnx-changelog]"
    ]


def test_a_node_valid_down_to_21_blocks_only_the_last_step_of_the_chain():
    """A uint16 Q/DQ at opset 23 is valid at 22 and 21 (uint16 came at 21): the chain stops at 21 -> 20."""
    model = _uint16_qdq()
    model.opset_import[0].version = 23
    model.ir_version = 11
    inferred = _inferred(model)
    blockers = lowering_blockers(inferred, 20)
    assert len(blockers) == 2 and all("[step 21 -> 20]" in b for b in blockers)
    assert _opset(inferred) == 23  # each step judged the model as declared at its opset, then restored
    assert lowering_blockers(inferred, 21) == []


@pytest.mark.parametrize(
    ("node", "expected"),
    [
        (
            helper.make_node("QuantizeLinear", ["h", "s", "z"], ["q"], name="q"),
            "node q (QuantizeLinear): input 's' is float and 'h' is float16, "
            "which QuantizeLinear requires to be one type (T1) at opset 22",
        ),
        (
            helper.make_node("DequantizeLinear", ["z", "s", "z"], ["d"], name="dq", output_dtype=TensorProto.FLOAT16),
            "node dq (DequantizeLinear): sets output_dtype, which DequantizeLinear does not have at opset 22",
        ),
    ],
)
def test_a_q_or_dq_using_what_opset_23_added_is_refused_at_the_step_23_to_22(node, expected):
    """At 23 QuantizeLinear's scale may differ in type from x, and DequantizeLinear has output_dtype."""
    inits = [
        numpy_helper.from_array(np.array(0.1, np.float32), "s"),
        numpy_helper.from_array(np.array(0, np.int8), "z"),
    ]
    nodes = [
        helper.make_node("Cast", ["x"], ["h"], to=TensorProto.FLOAT16),
        node,
        helper.make_node("Identity", ["x"], ["y"]),
    ]
    blockers = _blockers(nodes, inits, 23, [4])
    assert len(blockers) == 1 and blockers[0].startswith(expected) and "[step 23 -> 22]" in blockers[0]
