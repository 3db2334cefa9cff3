"""``--input-shape`` for targets (onnx_qrewrite/targets/shapes.py): symbolic input dimensions fixed
before a target plan, as onnxruntime's make_dynamic_shape_fixed does, the shapes that follow
recorded through onnxruntime's com.microsoft ops (where onnx's shape inference stops), the fixed
dimensions written to ``rewrite --target``'s output, and a target that needs static shapes (QNN)
refusing symbolic ones. That a target is then reached on its real runtime is in
test_targets_runtime.py."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import onnx
import pytest
from _cli_helpers import cli_in_process
from conftest import SAMPLES
from onnx import TensorProto, helper
from onnx.numpy_helper import from_array

from onnx_qrewrite import rewrite
from onnx_qrewrite.api import load_rules
from onnx_qrewrite.errors import UsageError
from onnx_qrewrite.targets import check_model, load_target, plan_for_target
from onnx_qrewrite.targets.profile import parse_target
from onnx_qrewrite.targets.shapes import (
    InputShapes,
    apply_input_shapes,
    fix_input_shapes,
    parse_input_shapes,
    record_shapes,
    symbolic_dims,
)

MLP = SAMPLES / "dynamic_mlp.onnx"  # input 'input' [batch, 64]


def cli(*args) -> subprocess.CompletedProcess:
    """The command line in this process (tests/_cli_helpers.py): these tests are about what
    ``--input-shape`` makes ``inspect``, ``rewrite`` and ``targets`` print, write and exit with."""
    return cli_in_process(*args)


def _dims(value: onnx.ValueInfoProto) -> list[int | str]:
    return [d.dim_value if d.HasField("dim_value") else d.dim_param for d in value.type.tensor_type.shape.dim]


def _embedding_model() -> onnx.ModelProto:
    """A QOperator BERT's embeddings in small: a Gather of a uint8 table by ids [batch, seq], the
    positions sliced to seq by a length computed from Shape, a com.microsoft QLinearAdd of the two,
    dequantized and projected by a MatMul: onnx's inference knows nothing after the QLinearAdd."""
    rng = np.random.default_rng(0)
    consts = [
        from_array(rng.integers(0, 256, (10, 4)).astype(np.uint8), "table"),
        from_array(rng.integers(0, 256, (8, 4)).astype(np.uint8), "positions"),
        from_array(np.float32(0.02), "s"),
        from_array(np.uint8(128), "z"),
        from_array(np.array([1], np.int64), "one"),
        from_array(np.array([0], np.int64), "zero"),
        from_array(rng.standard_normal((4, 3)).astype(np.float32), "w"),
    ]
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["g"]),
        helper.make_node("Shape", ["ids"], ["shape"]),
        helper.make_node("Gather", ["shape", "one"], ["seq_len"]),
        helper.make_node("Slice", ["positions", "zero", "seq_len", "zero"], ["p"]),
        helper.make_node("QLinearAdd", ["g", "s", "z", "p", "s", "z", "s", "z"], ["a"], domain="com.microsoft"),
        helper.make_node("DequantizeLinear", ["a", "s", "z"], ["d"]),
        helper.make_node("MatMul", ["d", "w"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "embeddings",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 3])],
        consts,
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


# -- parsing and fixing ---------------------------------------------------------------------------


def test_parse_takes_input_shapes_and_named_dimensions():
    shapes = parse_input_shapes(["input:1,64", "seq=16", "a:b:2"])
    assert shapes.inputs == {"input": (1, 64), "a:b": (2,)} and shapes.dims == {"seq": 16}
    for bad in ("input", "seq=x", "=3", "input:1,a"):
        with pytest.raises(UsageError, match="--input-shape"):
            parse_input_shapes([bad])


def test_fixing_replaces_the_dimension_wherever_it_appears():
    """As make_dim_param_fixed: the dim_param goes from the inputs, the outputs and value_info."""
    model = _embedding_model()
    model.graph.value_info.append(helper.make_tensor_value_info("g", TensorProto.UINT8, ["batch", "seq", 4]))
    assert fix_input_shapes(model, InputShapes({"ids": (2, 5)})) == ["batch=2", "seq=5"]
    assert _dims(model.graph.input[0]) == [2, 5]
    assert _dims(model.graph.output[0]) == [2, 5, 3]
    assert _dims(model.graph.value_info[0]) == [2, 5, 4]
    assert symbolic_dims(model) == []


def test_a_named_dimension_is_fixed_alone():
    model = _embedding_model()
    fix_input_shapes(model, InputShapes(dims={"seq": 6}))
    assert _dims(model.graph.input[0]) == ["batch", 6]
    assert symbolic_dims(model) == [("ids", 0, "batch")]


@pytest.mark.parametrize(
    ("shapes", "message"),
    [
        (InputShapes({"nope": (1, 2)}), "no input named 'nope'"),
        (InputShapes({"ids": (1,)}), "rank 2, 1 dimensions given"),
        (InputShapes({"ids": (0, 3)}), "must be at least 1"),
        (InputShapes(dims={"hidden": 4}), "no input of .* has a dimension named 'hidden'"),
        (InputShapes({"ids": (1, 3)}, {"seq": 4}), "'seq' is given as 3 and 4"),
    ],
)
def test_shapes_that_do_not_fit_change_nothing(shapes, message):
    model = _embedding_model()
    before = model.SerializeToString()
    with pytest.raises(UsageError, match=message):
        apply_input_shapes(model, shapes, "m.onnx")
    assert model.SerializeToString() == before


def test_a_fixed_dimension_must_match():
    model = _embedding_model()
    fix_input_shapes(model, InputShapes({"ids": (1, 5)}))
    with pytest.raises(UsageError, match="dimension 1 is fixed at 5, got 6"):
        fix_input_shapes(model, InputShapes({"ids": (1, 6)}))


# -- recording through the com.microsoft ops ------------------------------------------------------


def test_shapes_are_recorded_through_contrib_ops_and_computed_lengths():
    """onnx's inference alone: the Slice's length is computed (Shape -> Gather) and the QLinearAdd
    has no schema, so nothing after them gets a shape even with the inputs fixed."""
    model = _embedding_model()
    fix_input_shapes(model, InputShapes({"ids": (2, 5)}))
    plain = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    assert "a" not in {v.name for v in plain.graph.value_info if all(d.dim_value for d in v.type.tensor_type.shape.dim)}
    added = record_shapes(model)
    shapes = {v.name: _dims(v) for v in model.graph.value_info}
    assert shapes["p"] == [5, 4] and shapes["a"] == [2, 5, 4] and shapes["d"] == [2, 5, 4]
    assert {"p", "a", "d"} <= set(added)
    assert model.graph.value_info[[v.name for v in model.graph.value_info].index("a")].type.tensor_type.elem_type == (
        TensorProto.UINT8
    )


def test_a_chain_of_contrib_ops_is_recorded_in_a_few_whole_model_inferences(monkeypatch):
    """Past each contrib op the standard ops that follow are inferred node by node in the same
    round, so recording does not run onnx's whole-model inference once per contrib op along a path
    (a 6-layer QOperator BERT took 40 rounds, 2 now): 8 QLinearAdd -> DequantizeLinear -> Relu ->
    QuantizeLinear links, every value recorded, in at most 3 inferences (it took 10)."""
    consts = [from_array(np.float32(0.02), "s"), from_array(np.uint8(128), "z")]
    nodes, prev = [], "x"
    for i in range(8):
        nodes += [
            helper.make_node(
                "QLinearAdd", [prev, "s", "z", prev, "s", "z", "s", "z"], [f"a{i}"], domain="com.microsoft"
            ),
            helper.make_node("DequantizeLinear", [f"a{i}", "s", "z"], [f"d{i}"]),
            helper.make_node("Relu", [f"d{i}"], [f"r{i}"]),
            helper.make_node("QuantizeLinear", [f"r{i}", "s", "z"], [f"q{i}"]),
        ]
        prev = f"q{i}"
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.UINT8, ["batch", 4])],
        [helper.make_tensor_value_info(prev, TensorProto.UINT8, ["batch", 4])],
        consts,
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=8)
    fix_input_shapes(model, InputShapes({"x": (2, 4)}))
    calls = []
    infer = onnx.shape_inference.infer_shapes
    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", lambda *a, **k: calls.append(1) or infer(*a, **k))
    record_shapes(model)
    shapes = {v.name: _dims(v) for v in model.graph.value_info}
    assert all(shapes[o] == [2, 4] for n in nodes for o in n.output if o != prev), shapes
    assert _dims(model.graph.output[0]) == [2, 4]
    assert len(calls) <= 3, len(calls)


def test_recorded_shapes_are_what_onnxruntime_computes():
    ort = pytest.importorskip("onnxruntime", reason="needs onnxruntime (extra [verify])")
    model = _embedding_model()
    apply_input_shapes(model, InputShapes({"ids": (2, 5)}))
    recorded = {v.name: _dims(v) for v in model.graph.value_info}
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(onnx.ValueInfoProto(name=n) for n in ("p", "a", "d"))
    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(["p", "a", "d"], {"ids": np.zeros((2, 5), np.int64)})
    assert [list(g.shape) for g in got] == [recorded["p"], recorded["a"], recorded["d"]]


# -- targets that need static shapes ----------------------------------------------------------------


def test_qnn_refuses_symbolic_input_dimensions_naming_them():
    profile = load_target("qnn")
    assert profile.static_shapes and not load_target("tflite").static_shapes
    refused = check_model(onnx.load(MLP), profile)
    assert refused[0].node == "(model)"
    assert "input 'input' has symbolic dimension 0 ('batch')" in refused[0].reasons[0]
    fixed = onnx.load(MLP)
    fix_input_shapes(fixed, InputShapes(dims={"batch": 1}))
    assert check_model(fixed, profile) == []


def test_a_profile_shapes_table_is_checked():
    base = '[target]\nid = "t"\ntitle = "t"\nversion = "1"\nproof = "spec"\n'
    base += '[[source]]\nid = "d"\ndocument = "d"\nversion = "1"\n'
    assert parse_target(base + '[shapes]\nstatic = true\nsource = "d"\n', "t.toml").static_shapes
    with pytest.raises(UsageError, match=r"t.toml.*\[shapes\]"):
        parse_target(base + '[shapes]\nstatic = true\nsource = "d"\nbatch = 1\n', "t.toml")
    with pytest.raises(UsageError, match=r"t.toml.*\[shapes\]"):
        parse_target(base + "[shapes]\nstatic = true\n", "t.toml")


def test_planning_with_and_without_input_shapes():
    profile = load_target("qnn")
    without = plan_for_target(MLP, load_rules(), profile)
    assert not without.ok and without.after[0].node == "(model)" and without.input_shapes is None
    with_shapes = plan_for_target(MLP, load_rules(), profile, input_shapes=InputShapes(dims={"batch": 1}))
    assert with_shapes.ok and with_shapes.input_shapes["fixed"] == ["batch=1"]
    assert with_shapes.input_shapes["shapes"] == {"input": [1, 64]}


# -- the command line -------------------------------------------------------------------------------


def test_inspect_target_says_why_and_the_flag_fixes_it():
    plain = cli("inspect", MLP, "--target", "qnn")
    assert plain.returncode == 4, plain.stderr
    assert "input 'input' has symbolic dimension 0 ('batch'): the target needs static input shapes" in plain.stdout
    fixed = cli("inspect", MLP, "--target", "qnn", "--input-shape", "input:1,64", "--json")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    body = json.loads(fixed.stdout)
    assert body["ok"] and body["input_shapes"] == {
        "inputs": {"input": [1, 64]},
        "dims": {},
        "fixed": ["batch=1"],
        "shapes": {"input": [1, 64]},
    }
    text = cli("inspect", MLP, "--target", "qnn", "--input-shape", "batch=3")
    assert text.returncode == 0 and "fixed batch=3; static inputs: input [3, 64]" in text.stdout


def test_rewrite_target_writes_the_fixed_dimensions(tmp_path):
    out = tmp_path / "out.onnx"
    refused = cli("rewrite", MLP, "-o", out, "--target", "qnn")
    assert refused.returncode == 4 and not out.exists()
    assert "symbolic dimension 0 ('batch')" in refused.stderr
    done = cli("rewrite", MLP, "-o", out, "--target", "qnn", "--input-shape", "batch=2")
    assert done.returncode == 0, done.stderr
    assert "input dimensions fixed (--input-shape): batch=2" in done.stdout
    model, original = onnx.load(out), onnx.load(MLP)
    assert _dims(model.graph.input[0]) == [2, 64]
    assert all(isinstance(d, int) and d > 0 for d in _dims(model.graph.output[0]))
    # Only the fixed dimensions are new: the shapes recorded for the plan are not written.
    assert len(model.graph.value_info) == len(original.graph.value_info)


def test_rewrite_target_verifies_on_the_fixed_shapes(tmp_path):
    pytest.importorskip("onnxruntime", reason="needs onnxruntime (extra [verify])")
    out, report = tmp_path / "out.onnx", tmp_path / "r.json"
    args = ["rewrite", MLP, "-o", out, "--target", "tflite", "--input-shape", "batch=3", "--verify"]
    done = cli(*args, "--report", report)
    assert done.returncode == 0, done.stdout + done.stderr
    verification = json.loads(report.read_text())["verification"]
    assert verification["settings"]["inputs"]["input_shapes"] == {"input": [3, 64]}


def test_rewrite_target_verifies_a_dimension_fixed_by_name_beside_a_symbolic_one(tmp_path):
    """`--input-shape seq=5` on an input [batch, seq] leaves batch symbolic, so the output's input
    has no static shape: verify's samples must still take seq=5 (they took 1, and onnxruntime
    refused the output's input: exit 3)."""
    pytest.importorskip("onnxruntime", reason="needs onnxruntime (extra [verify])")
    node = helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "s", "z"], name="dql")
    outputs = [("y", TensorProto.UINT8, ["batch", "seq"]), ("s", TensorProto.FLOAT, []), ("z", TensorProto.UINT8, [])]
    graph = helper.make_graph(
        [node],
        "two_dims",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq"])],
        [helper.make_tensor_value_info(*o) for o in outputs],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    src, out, report = tmp_path / "m.onnx", tmp_path / "out.onnx", tmp_path / "r.json"
    onnx.save(model, src)
    done = cli("rewrite", src, "-o", out, "--target", "onnx", "--input-shape", "seq=5", "--verify", "--report", report)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _dims(onnx.load(out).graph.input[0]) == ["batch", 5]
    verification = json.loads(report.read_text())["verification"]
    assert verification["settings"]["inputs"]["input_dims"] == {"seq": 5}
    assert verification["outputs"][0]["shape"] == [1, 5]


def test_rewrite_verify_without_a_target_takes_input_shapes_for_its_samples(tmp_path):
    """Without --target nothing is planned for fixed shapes: `rewrite --verify --input-shape DIM=N`
    generates verify's samples with them, as `verify --input-shape DIM=N` does (it was exit 2), and
    the output keeps its symbolic dimensions."""
    pytest.importorskip("onnxruntime", reason="needs onnxruntime (extra [verify])")
    out, report = tmp_path / "out.onnx", tmp_path / "r.json"
    done = cli("rewrite", MLP, "-o", out, "--input-shape", "batch=3", "--verify", "--report", report)
    assert done.returncode == 0, done.stdout + done.stderr
    verification = json.loads(report.read_text())["verification"]
    assert verification["settings"]["inputs"]["input_dims"] == {"batch": 3}
    assert [o["shape"] for o in verification["outputs"]] == [[3, 10]]
    assert _dims(onnx.load(out).graph.input[0]) == _dims(onnx.load(MLP).graph.input[0])


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["inspect", MLP, "--target", "qnn", "--input-shape", "nope:1,64"], "'nope'"),
        (["inspect", MLP, "--target", "qnn", "--input-shape", "input:1"], "'input'"),
        (["inspect", MLP, "--target", "qnn", "--input-shape", "input:1,32"], "'input'"),
        (["inspect", MLP, "--target", "qnn", "--input-shape", "seq=4"], "'seq'"),
        (["inspect", MLP, "--target", "qnn", "--input-shape", "batch=0"], "'batch'"),
        # Beyond int64, what a dimension holds: it was exit 5 (protobuf's "Value out of range").
        (["inspect", MLP, "--target", "qnn", "--input-shape", f"batch={2**63}"], "'batch'"),
        (["rewrite", MLP, "-o", "{out}", "--target", "qnn", "--input-shape", f"input:{2**63},64"], "'input'"),
        (["inspect", MLP, "--input-shape", "batch=1"], "--target"),
        (["rewrite", MLP, "-o", "{out}", "--target", "qnn", "--input-shape", "nope:1,64"], "'nope'"),
        (["rewrite", MLP, "-o", "{out}", "--input-shape", "batch=1"], "--target"),
        (["rewrite", MLP, "-o", "{out}", "--input-shape", "input:1,64"], "--verify"),
        (["rewrite", MLP, "-o", "{out}", "--input-shape", "nope=2", "--verify"], "'nope'"),
    ],
)
def test_bad_input_shapes_exit_2_with_one_line(args, named, tmp_path):
    out = tmp_path / "out.onnx"
    result = cli(*[str(out) if a == "{out}" else a for a in args])
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--input-shape" in lines[0] and named in lines[0], result.stderr
    assert not out.exists()


def test_api_takes_input_shapes_with_a_target():
    result = rewrite(MLP, target="qnn", input_shapes={"input": (4, 64)})
    assert _dims(result.model.graph.input[0]) == [4, 64]
    with pytest.raises(UsageError, match="--target"):
        rewrite(MLP, input_shapes={"input": (4, 64)})


def test_targets_says_which_need_static_shapes():
    body = {t["id"]: t for t in json.loads(cli("targets", "--json").stdout)}
    assert body["qnn"]["static_shapes"] and not body["tflite"]["static_shapes"]
    assert "static input shapes: give --input-shape" in cli("targets", "qnn", "--long").stdout


@pytest.mark.parametrize(
    ("op", "values", "folds"),
    [
        ("Range", [0, 10**10, 1], False),  # 10^10 int64s: 80 GB if computed
        ("Range", [0, 3, 0], False),
        ("Range", [0, 12, 3], True),
        ("Add", [np.arange(4000), np.arange(4000).reshape(-1, 1)], False),  # 16M by broadcasting
        ("Add", [np.arange(40), np.arange(40).reshape(-1, 1)], True),
    ],
)
def test_shape_values_too_large_are_not_computed(op, values, folds, monkeypatch):
    """A model is untrusted: a shape computation whose result would exceed MAX_FOLDED elements is
    refused before it runs (the reference evaluator is never called for it), not after."""
    import onnx.reference

    from onnx_qrewrite.targets import shapes

    calls = []
    real = onnx.reference.ReferenceEvaluator
    monkeypatch.setattr(onnx.reference, "ReferenceEvaluator", lambda *a, **k: calls.append(a) or real(*a, **k))
    names = [f"v{i}" for i in range(len(values))]
    node = helper.make_node(op, names, ["out"])
    folded = {n: np.asarray(v, np.int64) for n, v in zip(names, values, strict=True)}
    assert shapes._fold(node, {}, folded) is folds
    assert bool(calls) is folds
    assert ("out" in folded) is folds
