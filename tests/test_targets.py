"""Targets as data: the shipped profiles load, cite their sources, agree with the published tables
they transcribe (onnx-tensorrt's, onnxruntime's NNAPI/CoreML tables through onnxruntime's own
usability checker), and ``targets`` / ``inspect --target`` say what a target refuses and why.

What the runtimes installable here actually do is checked in test_targets_runtime.py.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
from _cli_helpers import cli_in_process
from conftest import REAL_MODELS, REPO, SAMPLES
from onnx import TensorProto, helper

from onnx_qrewrite.api import load_rules
from onnx_qrewrite.errors import UsageError
from onnx_qrewrite.targets import check_model, load_target, load_targets, plan_for_target
from onnx_qrewrite.targets.profile import parse_target
from onnx_qrewrite.targets.shapes import parse_input_shapes

TARGETS_DIR = REPO / "rules" / "targets"
TRT_TABLE = TARGETS_DIR / "sources" / "tensorrt_operators_10.1-GA.json"
SHIPPED = ["coreml", "nnapi", "onnx", "openvino", "qnn", "tensorrt", "tflite", "tract", "webgpu"]
MODELS = [
    SAMPLES / "dynamic_mlp.onnx",
    SAMPLES / "dynamic_cnn.onnx",
    SAMPLES / "qdq_contrib_u16.onnx",
    *sorted(REAL_MODELS.glob("*.onnx")),
]


def cli(*args) -> subprocess.CompletedProcess:
    """The command line in this process (tests/_cli_helpers.py): these tests are about what
    ``targets``, ``inspect --target`` and ``rewrite --target`` print, write and exit with."""
    return cli_in_process(*args)


MINIMAL = """
[target]
id = "mini"
title = "a test target"
version = "1"
proof = "spec"

[[source]]
id = "doc"
document = "a document"
version = "v1"

[[ops]]
names = ["Add"]
source = "doc"
"""


FORM = """
[[rewrites.form]]
name = "float-emulation"
allow = "exact"
why = "no QuantizeLinear kernel"
source = "doc"
"""


_REFUSE = '\n[[refuse]]\nop = "Add"\n{}\nreason = "x"\nsource = "doc"\n'


# -- the profiles as data -------------------------------------------------------------------------


def test_every_shipped_target_loads_and_cites_declared_sources():
    targets = load_targets()
    assert sorted(targets) == SHIPPED
    for profile in targets.values():
        assert profile.sources, profile.id
        cited = {e.source for entries in profile.ops.values() for e in entries}
        cited |= {r.source for r in profile.refusals}
        cited |= {s for s in (profile.opset_source, profile.network_source, profile.rewrites_source) if s}
        cited |= {o.source for o in profile.rule_options}
        if profile.quantization is not None:
            cited.add(profile.quantization.source)
        assert cited <= set(profile.sources), profile.id  # the loader enforces it; this proves it ran
        for source in profile.sources.values():
            assert source.document and source.version, (profile.id, source.id)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.replace('names = ["Add"]', 'names = ["Add"]\nsorce = "doc"'), "unknown key 'sorce'"),
        (lambda t: t.replace('names = ["Add"]\nsource = "doc"', 'names = ["Add"]'), "'source' is missing"),
        (
            lambda t: t.replace('names = ["Add"]\nsource = "doc"', 'names = ["Add"]\nsource = "nodoc"'),
            "'nodoc' is not a [[source]] id",
        ),
        (lambda t: t.replace('proof = "spec"', 'proof = "vibes"'), "'proof' must be one of"),
        (lambda t: t + '\n[quantization]\ntypes = ["unit8"]\nsource = "doc"\n', "unknown element type 'unit8'"),
        (
            lambda t: t + '\n[[refuse]]\nop = "Add"\nwhen = "sometimes"\nreason = "x"\nsource = "doc"\n',
            "'when' must be one of",
        ),
        (lambda t: t + FORM.replace("float-emulation", "float-emulaton"), "did you mean 'float-emulation'"),
        (lambda t: t + FORM.replace('allow = "exact"', 'allow = "roughly"'), "'allow' must be one of"),
        (lambda t: t + FORM.replace('allow = "exact"\n', ""), "'allow' must be a non-empty string"),
        (lambda t: t + FORM.replace('source = "doc"', 'source = "nodoc"'), "'nodoc' is not a [[source]] id"),
        (
            lambda t: t + FORM.replace("why =", 'options = { float-emulation-q = { direktion = "quantize" } }\nwhy ='),
            "direktion",
        ),
        (lambda t: t + FORM + FORM, "form 'float-emulation' is listed twice with the same options"),
        (lambda t: t + FORM.replace("why =", 'form_options = { wieghts = "float" }\nwhy ='), "'wieghts'"),
        (lambda t: t + FORM.replace("why =", 'consent = "maybe"\nwhy ='), "'consent' must be one of"),
        (
            lambda t: t.replace("[[ops]]", '[rewrites]\navoid = ["ms-q-decompos"]\nsource = "doc"\n\n[[ops]]'),
            "did you mean 'ms-q-decompose'",
        ),
        (
            lambda t: t.replace("[[ops]]", '[rewrites]\nkeep = ["Ad"]\nsource = "doc"\n\n[[ops]]'),
            "[rewrites] keep: 'Ad' is not a standard op the profile lists (did you mean 'Add'?)",
        ),
        (lambda t: t.replace("[[ops]]", '[rewrites]\nkeep = ["Add"]\nsource = "doc"\n\n[[ops]]'), ""),
        (
            lambda t: t + FORM.replace("float-emulation", "qdq-to-float").replace("why =", "options = {}\nwhy ="),
            "",  # qdq-to-float has an exact rule: valid at allow = "exact"
        ),
        (
            lambda t: t + _REFUSE.format('when = "rank-above"'),
            "'rank' (a number >= 0) goes with 'when' rank-above or rank-below",
        ),
        (
            lambda t: t + _REFUSE.format('when = "always"\nrank = 2'),
            "'rank' (a number >= 0) goes with 'when' rank-above or rank-below",
        ),
        (lambda t: t + _REFUSE.format('when = "always"\ninputs = [1]'), "'inputs' goes with"),
        (lambda t: t + _REFUSE.format('when = "input-from"\nops = ["Gather"]\ninputs = [0, 3]'), ""),
        (lambda t: t + _REFUSE.format('when = "input-from"\nops = ["Softmax"]\nthrough = ["Where"]'), ""),
        (lambda t: t + _REFUSE.format('when = "always"\nthrough = ["Where"]'), "'through' goes with"),
        (lambda t: t + _REFUSE.format('when = "input-from"\nops = ["Softmax"]\nthrough = "Where"'), "a list"),
        (
            lambda t: (
                t
                + _REFUSE.format(
                    'when = "input-from"\nops = ["Softmax"]\nthrough = ["Where"]\nthrough_static = { Where = 0 }'
                )
            ),
            "",
        ),
        (
            lambda t: (
                t
                + _REFUSE.format(
                    'when = "input-from"\nops = ["Softmax"]\nthrough = ["Where"]\nthrough_static = { Relu = 0 }'
                )
            ),
            "'through_static' maps ops of 'through'",
        ),
        (
            lambda t: (
                t
                + _REFUSE.format(
                    'when = "input-from"\nops = ["Softmax"]\nthrough = ["Where"]\nthrough_static = { Where = -1 }'
                )
            ),
            "'through_static' maps ops of 'through'",
        ),
        (lambda t: t + _REFUSE.format('when = "computed-input"\ninputs = [-1]'), "'inputs' must be a non-empty"),
        (lambda t: t + _REFUSE.format('when = "outside-chain"'), "'chain' goes with"),
        (lambda t: t + _REFUSE.format('when = "outside-chain"\nchain = ["Div", "Erf"]'), "must name 'op'"),
        (lambda t: t + '\n[network]\nqdq_only_types = ["unit8"]\nsource = "doc"\n', "unknown element type"),
        (lambda t: t + _REFUSE.format('when = "rank-above"\ninputs = [0, 3]\nrank = 2'), ""),
        (lambda t: t + _REFUSE.format('when = "shape-unrecorded"\ninputs = [1]'), ""),
        (
            lambda t: t + _REFUSE.format('when = "shape-unrecorded"\nrank = 2'),
            "'rank' (a number >= 0) goes with 'when' rank-above or rank-below",
        ),
        (lambda t: t + _REFUSE.format('when = "outside-chain"\nchain = ["Add", "Mul"]'), ""),
        (lambda t: t + _REFUSE.format('when = "unfused-outputs"'), "'ops' goes with"),
        (lambda t: t + _REFUSE.format('when = "always"\nops = ["MatMul"]'), "'ops' goes with"),
        (lambda t: t + _REFUSE.format('when = "unfused-outputs"\nops = ["MatMul"]'), ""),
        (lambda t: t + _REFUSE.format('when = "read-by"'), "'ops' goes with"),
        (lambda t: t + _REFUSE.format('when = "read-by"\nops = ["LayerNormalization"]\ntypes = ["int32"]'), ""),
        (lambda t: t + '\n[ir]\nmax = 13\nsource = "doc"\n', ""),
        (lambda t: t + "\n[ir]\nmax = 13\n", "'source' is missing"),
        (lambda t: t + '\n[ir]\nsource = "doc"\n', "'max' (an IR version >= 1) is required"),
        (lambda t: t + '\n[ir]\nmax = 13\nmin = 3\nsource = "doc"\n', "unknown key 'min'"),
        (lambda t: t + '\n[arithmetic]\nfloat64 = "float32"\nsource = "doc"\n', ""),
        (lambda t: t + '\n[arithmetic]\nfloat64 = "double"\nsource = "doc"\n', "'float64' must be one of"),
        (lambda t: t + '\n[arithmetic]\nfloat64 = "float32"\n', "'source' is missing"),
    ],
)
def test_a_bad_profile_is_a_usage_error_naming_file_and_key(edit, message):
    parse_target(MINIMAL, "mini.toml")  # the unedited text is valid
    if not message:
        parse_target(edit(MINIMAL), "mini.toml")
        return
    with pytest.raises(UsageError) as err:
        parse_target(edit(MINIMAL), "mini.toml")
    assert str(err.value).startswith("mini.toml: ")
    assert message in str(err.value)


def test_cli_bad_profile_exits_2_with_one_line(tmp_path):
    path = tmp_path / "mini.toml"
    path.write_text(MINIMAL.replace('names = ["Add"]', 'names = ["Add"]\nsorce = "doc"'))
    proc = cli("inspect", SAMPLES / "dynamic_mlp.onnx", "--target", path)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert str(path) in proc.stderr and "sorce" in proc.stderr and "did you mean 'source'" in proc.stderr


def test_unknown_target_exits_2_suggesting_the_closest():
    proc = cli("inspect", SAMPLES / "dynamic_mlp.onnx", "--target", "tensorrtt")
    assert proc.returncode == 2
    assert "unknown target 'tensorrtt'" in proc.stderr and "did you mean 'tensorrt'" in proc.stderr


def test_tensorrt_profile_is_exactly_the_published_table():
    """Every op the onnx-tensorrt 10.1-GA table marks supported, with its types, and nothing else."""
    table = json.loads(TRT_TABLE.read_text())
    assert table["source"]["branch"] == "10.1-GA"
    names = {"FP32": "float32", "FP16": "float16", "BF16": "bfloat16", "INT32": "int32", "INT64": "int64"}
    names |= {"BOOL": "bool", "UINT8": "uint8", "INT8": "int8", "FP8": "float8e4m3fn", "INT4": "int4"}
    profile = load_target("tensorrt")
    supported = {op for op, row in table["operators"].items() if row["supported"]}
    assert {op for (domain, op) in profile.ops if domain == ""} == supported
    assert all(domain == "" for domain, _ in profile.ops)
    for op in supported - {"QuantizeLinear", "DequantizeLinear"}:
        (entry,) = profile.support("", op)
        assert entry.types == {names[t] for t in table["operators"][op]["types"]}, op
    assert (profile.opset_min, profile.opset_max) == tuple(table["opset_range"])


# -- onnxruntime's own checker for the mobile EPs -------------------------------------------------


def _built_models() -> list[onnx.ModelProto]:
    """Small models with the ops quantized models hold: a QDQ pair, integer matmul, a QLinear op."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    inits = [
        helper.make_tensor("s", TensorProto.FLOAT, [], [0.1]),
        helper.make_tensor("z", TensorProto.UINT8, [], [128]),
    ]
    qdq = helper.make_graph(
        [
            helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], name="q"),
            helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"], name="dq"),
            helper.make_node("Round", ["d"], ["r"], name="round"),
            helper.make_node("Sigmoid", ["r"], ["y"], name="sig"),
        ],
        "qdq",
        [x],
        [y],
        inits,
    )
    xi = helper.make_tensor_value_info("a", TensorProto.UINT8, [1, 4])
    yi = helper.make_tensor_value_info("b", TensorProto.INT32, [1, 4])
    w = helper.make_tensor("w", TensorProto.UINT8, [4, 4], list(range(16)))
    mmi = helper.make_graph([helper.make_node("MatMulInteger", ["a", "w"], ["b"], name="mmi")], "mmi", [xi], [yi], [w])
    return [helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]) for g in (qdq, mmi)]


def _lookup_model() -> onnx.ModelProto:
    """A BERT-like embedding: a Gather of a float table by run-time ids, and the sequence length
    by Shape -> Gather (what the quantize_dynamic BERTs still hold once their weights are float)."""
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 4])
    n = helper.make_tensor_value_info("n", TensorProto.INT64, [1])
    table = helper.make_tensor("table", TensorProto.FLOAT, [8, 4], [float(v) for v in range(32)])
    one = helper.make_tensor("one", TensorProto.INT64, [1], [1])
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["table", "ids"], ["y"], name="lookup"),
            helper.make_node("Shape", ["ids"], ["shape"], name="shape"),
            helper.make_node("Gather", ["shape", "one"], ["n"], name="seq_len"),
        ],
        "lookup",
        [ids],
        [y, n],
        [table, one],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _mobile_models() -> list[onnx.ModelProto]:
    from onnx_qrewrite import rewrite

    out = _built_models()
    for path in (SAMPLES / "dynamic_mlp.onnx", SAMPLES / "dynamic_cnn.onnx", REAL_MODELS / "ortdyn_cnn_op17_w8u.onnx"):
        out.append(onnx.load(path))
        out.append(rewrite(onnx.load(path)).model)
    # What rewrite --target coreml writes, Flatten and Gather as Reshape and GatherND included
    # (form movement-equivalents): the checker must find nothing it cannot place either.
    for model in (
        onnx.load(SAMPLES / "dynamic_cnn.onnx"),
        onnx.load(REAL_MODELS / "quark_cnn_op17_fp16.onnx"),
        _lookup_model(),
    ):
        out.append(model)
        out.append(rewrite(model, target="coreml").model)
    return out


def test_webgpu_profile_takes_what_its_pinned_kernel_registry_registers():
    """Pinned to onnxruntime commit 577b8d6b, where the WebGPU EP registers Identity (the last
    refusal on the quantize_dynamic and MatMulNBits models after their rewrite) but still no
    QuantizeLinear, Round or IsNaN (so no exact float emulation of the quantizers either)."""
    profile = load_target("webgpu")
    assert "577b8d6bf9a87f62b2d18f5097a3d173152caff0" in profile.sources["kernels"].version
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    ops = ["Identity", "GatherND", "Min", "Max", "QuantizeLinear", "Round", "IsNaN"]
    nodes = [helper.make_node(op, ["x"], [f"y{i}"], name=op) for i, op in enumerate(ops)]
    graph = helper.make_graph(nodes, "g", [x], [helper.make_tensor_value_info(f"y{i}", 1, [2]) for i in range(7)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    refused = {r.op for r in check_model(model, profile)}
    assert refused == {"QuantizeLinear", "Round", "IsNaN"}


def test_webgpu_reaches_static_qdq_exactly_without_round_or_isnan():
    """The float emulation with Round from Floor and comparisons: nothing the WebGPU EP lacks is
    left (no QuantizeLinear, Round, IsNaN, nor an 8/16-bit tensor computed at run time), and the
    rewrite gives the original's outputs bit for bit in onnxruntime."""
    from conftest import assert_bitwise_equal, run

    from onnx_qrewrite import rewrite

    path = SAMPLES / "qdq_contrib_u16.onnx"
    model = onnx.load(path)
    result = rewrite(model, target="webgpu")
    assert result.report.target["refused_after"] == 0
    assert not check_model(result.model, load_target("webgpu"))
    assert not {"QuantizeLinear", "Round", "IsNaN"} & {n.op_type for n in result.model.graph.node}
    assert "float-emulation-qdq-pair" in result.report.by_rule()
    feeds = dict(np.load(str(path)[: -len(".onnx")] + ".inputs.npz"))
    want, got = run(model, feeds), run(result.model, feeds)
    for name in want:
        assert_bitwise_equal(got[name], want[name], name)


def test_coreml_reaches_flatten_and_gather_through_exact_equivalents():
    """Flatten and Gather, which CoreML's ML Program format has no builder for, are rewritten by the
    exact movement-equivalents form the profile names, and nothing is refused after it."""
    from onnx_qrewrite import rewrite

    profile = load_target("coreml")
    for model, refused in (
        (onnx.load(REAL_MODELS / "quark_cnn_op17_fp16.onnx"), {"Flatten"}),
        (_lookup_model(), {"Gather"}),
    ):
        assert {r.op for r in check_model(model, profile)} >= refused
        result = rewrite(model, target="coreml")
        assert not check_model(result.model, profile), model.graph.name
        assert result.report.target["refused_after"] == 0
        assert {"flatten-as-reshape", "gather-as-gathernd"} & set(result.report.by_rule())


@pytest.mark.parametrize(
    ("target", "checker"),
    [
        ("nnapi", lambda ck, m: ck.check_nnapi_partitions(m, require_fixed_input_sizes=False)),
        (
            "coreml",
            lambda ck, m: ck.check_coreml_partitions(m, False, "coreml_supported_mlprogram_ops.md"),
        ),
    ],
)
def test_mobile_targets_agree_with_onnxruntimes_usability_checker(target, checker):
    """The ops the profile refuses outright are exactly those onnxruntime's checker reports as
    unsupported (Constant excepted: the checker folds Constants into initializers first)."""
    ck = pytest.importorskip("onnxruntime.tools.mobile_helpers.usability_checker", reason="needs onnxruntime")
    profile = load_target(target)
    import onnxruntime

    # The profile transcribes the tables of one onnxruntime release; another release ships other
    # tables (1.23.2, Python 3.10's, lists fewer CoreML ops), so only that release can agree.
    cited = {s.version.split()[1] for s in profile.sources.values() if s.version.startswith("onnxruntime ")}
    if onnxruntime.__version__ not in cited:
        pytest.skip(
            f"the {target} profile transcribes onnxruntime {sorted(cited)}'s tables, not {onnxruntime.__version__}'s"
        )
    for model in _mobile_models():
        info = checker(ck, model)
        theirs = {op for op in info.unsupported_ops if op != "ai.onnx:Constant"}
        ours = {f"{r.domain or 'ai.onnx'}:{r.op}" for r in check_model(model, profile) if r.unlisted}
        assert ours == theirs, model.graph.name


def test_nnapi_takes_a_qlinear_softmax_of_unrecorded_length_without_shape():
    """qop-softmax checks an unrecorded softmax length with Shape, which NNAPI refuses (so the
    QLinearSoftmax stayed); qop-softmax-shapeless checks it with a Softmax of zeros, which NNAPI
    runs: the plan chooses it there (onnxruntime's NNAPI checker agrees), and only there: without a
    target, and for a target that runs Shape, qop-softmax comes first."""
    from test_lower_qoperator import _softmax_model

    from onnx_qrewrite import rewrite

    model = _softmax_model(256, [2, "n"])
    result = rewrite(model, target="nnapi")
    assert result.report.by_rule() == {"qop-softmax-shapeless": 1}
    assert result.report.target["refused_after"] == 0 and not check_model(result.model, load_target("nnapi"))
    ck = pytest.importorskip("onnxruntime.tools.mobile_helpers.usability_checker", reason="needs onnxruntime")
    assert ck.check_nnapi_partitions(result.model, require_fixed_input_sizes=False).unsupported_ops == set()
    assert rewrite(model).report.by_rule() == {"qop-softmax": 1}
    assert rewrite(model, target="onnx").report.by_rule() == {"qop-softmax": 1}


def test_a_plan_infers_each_model_it_reaches_once(monkeypatch):
    """A plan tries many rewrites and reaches the same model by several choices: onnx's shape
    inference (check._inferred, which check_model and a later stage's input both need) runs once
    per distinct model, plus once more for the input's before-verdict; the plan is unchanged (the
    battery's plans compared before and after, CHANGELOG). It ran 35 times for 19 models."""
    import collections
    import hashlib

    import onnx_qrewrite.targets.check as check

    seen: collections.Counter[bytes] = collections.Counter()
    inferred = check._inferred

    def counting(model: onnx.ModelProto) -> onnx.ModelProto:
        seen[hashlib.sha256(model.SerializeToString(deterministic=True)).digest()] += 1
        return inferred(model)

    monkeypatch.setattr(check, "_inferred", counting)
    plan = plan_for_target(SAMPLES / "dynamic_mlp.onnx", load_rules(), load_target("tensorrt"))
    assert plan.ok and len(seen) > 10
    assert sum(seen.values()) <= len(seen) + 1, sorted(seen.values())


# -- inspect --target -----------------------------------------------------------------------------


def test_inspect_target_keeps_what_the_target_runs_natively():
    """Never make things worse: tract runs quantize_dynamic's ops, so nothing is expanded for it."""
    plan = plan_for_target(SAMPLES / "dynamic_cnn.onnx", load_rules(), load_target("tract"))
    assert plan.before == [] and plan.after == [] and plan.ok
    assert "dql-expand" in plan.skipped_rules


def test_inspect_target_names_rule_and_what_stays_refused():
    plan = plan_for_target(SAMPLES / "dynamic_mlp.onnx", load_rules(), load_target("tensorrt"))
    verdicts = {n.node: n for n in plan.nodes}
    dql = [n for n in plan.nodes if n.op == "DynamicQuantizeLinear"]
    assert len(dql) == 3 and all("not among the ops the target runs" in n.reasons[0] for n in dql)
    # Expanding it would leave two refused nodes (uint8 inside a TensorRT network, operators.md)
    # for one; weight-only (the profile's consent) leaves nothing refused: its uint8 weights'
    # DequantizeLinear, refused as it is, computed exactly in float in a second stage.
    assert all(n.considered[0].startswith("dql-expand (exact): leaves 2 refused nodes: ") for n in dql)
    assert all(n.rule.startswith("weight-only-remove-dead") and n.form == "weight-only" for n in dql)
    mmi = [n for n in verdicts.values() if n.op == "MatMulInteger"]
    assert len(mmi) == 3 and all(n.rule.startswith("weight-only-remove-dead") for n in mmi)
    assert plan.ok and plan.forms["weight-only"]["exactness"] == "approximate"
    assert plan.later and {f["exactness"] for n, f in plan.forms.items() if n != "weight-only"} <= {"exact"}


def test_inspect_target_names_the_nodes_a_weighed_choice_leaves_refused():
    """A weighed choice that leaves refused nodes names each (node, op) on its line, and says why
    the target refuses each: in `--json` (`weighed_left`, per rule, an index into the plan's
    `weighed_left_lists`, in the words of `after`) and in
    the text (`left:` under its `weighed:` line), not only how many."""
    dql = ("input_QuantizeLinear", "DynamicQuantizeLinear")
    mmi = ("fc0/MatMul_quant", "MatMulInteger")
    done = cli("inspect", SAMPLES / "dynamic_mlp.onnx", "--target", "tensorrt", "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    nodes = {(n["node"], n["op"]): n for n in data["nodes"]}
    lists = data["weighed_left_lists"]  # each node's weighed_left indexes these (format 2)
    # Expanding the DynamicQuantizeLinear leaves its uint8 QuantizeLinears, which TensorRT refuses.
    names = "input_quantized/zp (QuantizeLinear), input_quantized/y (QuantizeLinear)"
    assert nodes[dql]["considered"][0] == f"dql-expand (exact): leaves 2 refused nodes: {names}"
    left = lists[nodes[dql]["weighed_left"]["dql-expand"]]
    assert [line.partition("): ")[0] + ")" for line in left] == names.split(", ")
    assert all("QuantizeLinear of uint8: the target quantizes to" in line for line in left)
    assert (
        nodes[mmi]["considered"][2]
        == "int-matmul-int32 (exact): leaves 1 refused node: fc0/MatMul_quant/MatMul (MatMul)"
    )
    assert lists[nodes[mmi]["weighed_left"]["int-matmul-int32"]] == [
        "fc0/MatMul_quant/MatMul (MatMul): MatMul on int32 ('fc0/MatMul_quant/Sub'): the target takes bfloat16, "
        "float16, float32 [tensorrt/operators-md]"
    ]
    assert "int-matmul-float" not in nodes[mmi]["weighed_left"]  # it leaves nothing refused
    text = cli("inspect", SAMPLES / "dynamic_mlp.onnx", "--target", "tensorrt")
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    at = lines.index(f"      weighed: dql-expand (exact): leaves 2 refused nodes: {names}")
    assert lines[at + 1] == f"          left: {left[0]}" and lines[at + 2] == f"          left: {left[1]}"


def test_a_form_listed_twice_is_tried_in_order_per_node(tmp_path):
    """A profile may list a form again with other options: the first listing wins where it leaves
    nothing refused (int8 symmetric weights stay a DequantizeLinear on TensorRT), the next one
    elsewhere (uint8 weights become float); the rewrite is the plan's."""
    from test_weight_only import _dynamic_matmul

    from onnx_qrewrite import rewrite

    # TensorRT's profile without its float-emulation and qdq-to-float forms (which would also fix
    # the uint8 weights' DequantizeLinear, in a second stage): weight-only's two listings alone.
    text = (TARGETS_DIR / "tensorrt.toml").read_text()
    text = text[: text.index("# Static QDQ / QOperator models")].replace('id = "tensorrt"', 'id = "trtish"')
    (tmp_path / "trtish.toml").write_text(text)
    profile = load_target(str(tmp_path / "trtish.toml"))
    assert [(f.name, f.variant) for f in profile.forms] == [("weight-only", ""), ("weight-only", "weights=float")]
    int8 = plan_for_target_model(_dynamic_matmul(np.int8, zero_point=False), profile)
    assert int8.ok and {n.rule for n in int8.nodes} == {"weight-only-remove-dead"}
    uint8 = _dynamic_matmul(np.uint8)
    plan = plan_for_target_model(uint8, profile)
    assert plan.ok and {n.rule for n in plan.nodes} == {"weight-only-remove-dead[weights=float]"}
    result = rewrite(uint8, target=str(tmp_path / "trtish.toml"))
    ops = {n.op_type for n in result.model.graph.node}
    assert not ops & {"DequantizeLinear", "DynamicQuantizeLinear", "MatMulInteger"} and "MatMul" in ops
    assert result.report.target["refused_after"] == 0
    assert "weight-only-matmul[weights=float]" in result.report.by_rule()


def test_a_rule_that_would_make_things_worse_is_not_used(tmp_path):
    """A profile that runs DynamicQuantizeLinear but not what it expands into, without saying
    `keep`: the check after the rewrite finds the regression and drops the rule."""
    profile = load_target("tract")
    text = (TARGETS_DIR / "tract.toml").read_text().replace('keep = ["DynamicQuantizeLinear", ', "keep = [")
    text = text.replace('"ReduceMin", ', "").replace('id = "tract"', 'id = "tractish"', 1)
    path = tmp_path / "tractish.toml"
    path.write_text(text)
    profile = load_target(str(path))
    assert "DynamicQuantizeLinear" not in profile.keep
    plan = plan_for_target(SAMPLES / "dynamic_mlp.onnx", load_rules(), profile)
    assert plan.ok and plan.before == []
    assert "dql-expand" in plan.skipped_rules and "refuses" in plan.skipped_rules["dql-expand"]


def test_quantization_constraints_are_reported():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    graph = helper.make_graph(
        [
            helper.make_node("ReduceMax", ["x"], ["m"], keepdims=0, name="max"),
            helper.make_node("QuantizeLinear", ["x", "m", "z"], ["q"], name="q"),
            helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], name="dq"),
        ],
        "g",
        [x],
        [y],
        [helper.make_tensor("s", TensorProto.FLOAT, [], [0.5]), helper.make_tensor("z", TensorProto.UINT8, [], [3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    refused = {r.node: " | ".join(r.reasons) for r in check_model(model, load_target("tensorrt"))}
    assert "scale computed at run time" in refused["q"]
    assert "quantizes to float8e4m3fn, int4, int8 only" in refused["q"]
    assert "non-zero zero point" in refused["dq"]
    assert set(refused) == {"q", "dq"}
    assert {r.node for r in check_model(model, load_target("tract"))} == {"q"}  # y_scale must be a const


def test_opset_above_the_target_is_a_model_level_refusal():
    model = onnx.load(REAL_MODELS / "ortqdq_ms_cnn_op17_a16u_w16s.onnx")
    del model.opset_import[:]
    model.opset_import.extend([helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    refused = check_model(model, load_target("tensorrt"))
    assert refused[0].node == "(model)"
    assert "opset 21 is above the highest the target loads (20)" in refused[0].reasons[0]


def test_targets_command_lists_every_target_with_version_and_sources():
    proc = cli("targets")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines[1:]] == SHIPPED
    assert "openvino" in proc.stdout and "2026.4.1" in proc.stdout and "pip extra [openvino]" in proc.stdout
    body = json.loads(cli("targets", "--json", "tensorrt").stdout)
    assert body[0]["id"] == "tensorrt" and "96e781103cfc4adf4a6bb557e94bac8e693f6f4c" in json.dumps(body)
    long_ = cli("targets", "--long", "tract").stdout
    assert "[tract/registry] sonos/tract" in long_ and "[tract/observed]" in long_


def _det_model(tmp_path: Path) -> Path:
    """Det, which TensorRT does not run (operators.md) and no rule rewrites, after quantize_dynamic's
    MLP (sample_models/dynamic_mlp.onnx): TensorRT would still refuse one node after the rewrite."""
    model = onnx.load(SAMPLES / "dynamic_mlp.onnx")
    out = model.graph.output[0]
    model.graph.node.append(helper.make_node("Reshape", [out.name, "det_shape"], ["det_in"], name="det_reshape"))
    model.graph.node.append(helper.make_node("Det", ["det_in"], ["det"], name="det"))
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array([-1, 2, 2], np.int64), "det_shape"))
    model.graph.output.append(helper.make_tensor_value_info("det", TensorProto.FLOAT, [None]))
    path = tmp_path / "det.onnx"
    onnx.save(model, path)
    return path


def test_inspect_target_cli_exit_codes_and_json(tmp_path):
    ok = cli("inspect", SAMPLES / "dynamic_cnn.onnx", "--target", "openvino")
    assert ok.returncode == 0, ok.stderr
    assert "nothing refused after the rewrite" in ok.stdout
    reached = cli("inspect", SAMPLES / "dynamic_cnn.onnx", "--target", "tensorrt", "--json")
    assert reached.returncode == 0, reached.stderr
    body = json.loads(reached.stdout)
    assert body["target"] == "tensorrt" and body["refused_before"] == 6 and body["ok"] is True
    # weight-only with the uint8 weights as float (TensorRT's profile lists the form twice)
    statuses = {n["op"]: n["status"] for n in body["nodes"]}
    assert statuses == dict.fromkeys(("DynamicQuantizeLinear", "ConvInteger", "MatMulInteger"), "fixed by the rewrite")
    assert "tensorrt/operators-md" in body["sources"]
    # an op TensorRT does not run and no rule rewrites: exit 4, the node named
    refused = cli("inspect", _det_model(tmp_path), "--target", "tensorrt", "--json")
    assert refused.returncode == 4, refused.stderr
    body = json.loads(refused.stdout)
    assert body["ok"] is False and body["refused_after"] == len(body["after"]) == 1
    assert body["after"][0]["node"] == "det"
    assert [(n["node"], n["status"]) for n in body["nodes"] if n["op"] == "Det"] == [
        ("det", "refused after the rewrite")
    ]
    # the rewrite `inspect --target onnx` plans for a com.microsoft QDQ model removes every refusal
    onnx_ok = cli("inspect", SAMPLES / "qdq_contrib_u16.onnx", "--target", "onnx", "--json")
    assert onnx_ok.returncode == 0, onnx_ok.stderr
    body = json.loads(onnx_ok.stdout)
    assert body["refused_before"] == 22 and body["refused_after"] == 0
    assert {n["status"] for n in body["nodes"]} == {"fixed by the rewrite"}


@pytest.mark.parametrize("path", MODELS, ids=lambda p: Path(p).stem)
def test_rewrite_for_any_target_never_makes_things_worse(path):
    """Issue 11's invariant, for every shipped profile and every test model: `rewrite --target T`
    leaves T no more to refuse than the model as given, and no node it accepted is refused after
    (what `rewrite` writes is checked, not only what the plan says). The runtimes' side of it (a
    model T ran still runs) is in test_targets_runtime.py."""
    from onnx_qrewrite import rewrite

    catalogue = load_rules()
    given = onnx.load(path)
    for profile in load_targets().values():
        before = check_model(given, profile)
        # The plan rewrite made and wrote by (its report's target, TargetPlan.to_dict()): planning
        # it again here gave the same plan at the cost of a second rewrite per target.
        result = rewrite(path, rules=catalogue, target=profile.id, allow_unlowered=True, provenance="full")
        plan = result.report.target
        assert plan is not None and plan["refused_after"] == len(plan["after"]), profile.id
        assert len(plan["nodes"]) == plan["refused_before"] == len(before), profile.id
        assert np.all([n["reasons"] for n in plan["nodes"]])
        after = check_model(result.model, profile)
        assert len(after) == plan["refused_after"] <= len(before), profile.id
        accepted = {(r.scope, r.node) for r in before}
        origins = {r.origin or r.node for r in after}
        newly = [r for r in after if (r.scope, r.origin or r.node) not in accepted]
        assert not newly, (profile.id, newly[:2], origins)


# -- rewrite --target -----------------------------------------------------------------------------


def test_rewrite_for_a_target_keeps_what_it_runs_natively(tmp_path):
    out = tmp_path / "out.onnx"
    proc = cli("rewrite", SAMPLES / "dynamic_mlp.onnx", "-o", out, "--target", "tract")
    assert proc.returncode == 0, proc.stderr
    assert "target tract (0.23.9): refused before 0, after 0" in proc.stdout
    assert "rule dql-expand not used: tract runs DynamicQuantizeLinear natively" in proc.stdout
    assert [n.op_type for n in onnx.load(out).graph.node] == [
        n.op_type for n in onnx.load(SAMPLES / "dynamic_mlp.onnx").graph.node
    ]


def test_rewrite_for_a_target_that_would_still_refuse_exits_4_and_writes_nothing(tmp_path):
    out = tmp_path / "out.onnx"
    model = _det_model(tmp_path)
    proc = cli("rewrite", model, "-o", out, "--target", "tensorrt")
    assert proc.returncode == 4, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "target tensorrt would still refuse node det (Det) after the rewrite" in line
    assert not out.exists()
    report = tmp_path / "r.json"
    proc = cli(
        "rewrite",
        model,
        "-o",
        out,
        "--target",
        "tensorrt",
        "--allow-unlowered",
        "--report",
        report,
    )
    assert proc.returncode == 0, proc.stderr
    assert "warning: target tensorrt would still refuse" in proc.stdout
    body = json.loads(report.read_text())
    assert body["target"]["target"] == "tensorrt" and body["target"]["refused_after"] > 0


def test_rewrite_api_with_a_target_reports_before_and_after():
    from onnx_qrewrite import rewrite

    result = rewrite(SAMPLES / "qdq_contrib_u16.onnx", target="onnx")
    assert result.report.target["refused_before"] == 22 and result.report.target["refused_after"] == 0
    assert check_model(result.model, load_target("onnx")) == []
    kept = rewrite(SAMPLES / "dynamic_cnn.onnx", target="tract")
    assert kept.report.rewrites == [] and "dql-expand" in kept.report.target["skipped_rules"]
    # OpenVINO runs DynamicQuantizeLinear, ConvInteger and MatMulInteger itself (its rare one-step
    # differences on BERTs are float rounding, the expansion's too: rules/targets/openvino.toml).
    kept = rewrite(SAMPLES / "dynamic_cnn.onnx", target="openvino")
    assert kept.report.rewrites == []
    assert {"dql-expand", "int-matmul-float"} <= set(kept.report.target["skipped_rules"])


def test_rewrite_target_verify_says_when_the_runtime_is_missing(tmp_path):
    from test_optional_dependencies import without

    out = tmp_path / "out.onnx"
    proc = without(
        ("openvino",), "rewrite", SAMPLES / "dynamic_cnn.onnx", "-o", out, "--target", "openvino", "--verify"
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        "target openvino's runtime (openvino) is not installed (pip install 'onnx-qrewrite[openvino]')" in proc.stderr
    )
    assert "verifying in onnxruntime instead" in proc.stderr
    assert "PASSED" in proc.stdout


# -- forms a profile asks for ([[rewrites.form]]) ----------------------------------------------------

EMU_OPS = ["Relu", "Div", "Round", "Add", "Clip", "IsNaN", "Not", "Where", "Cast", "Sub", "Mul", "Reshape", "Identity"]


def _emu_profile(tmp_path, ops, form: str, allow: str) -> Path:
    text = MINIMAL.replace('id = "mini"', 'id = "emu"').replace('names = ["Add"]', f"names = {json.dumps(ops)}")
    text += FORM.replace("float-emulation", form).replace('allow = "exact"', f'allow = "{allow}"')
    path = tmp_path / "emu.toml"
    path.write_text(text)
    return path


def _qdq_relu() -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])
    graph = helper.make_graph(
        [
            helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], name="q"),
            helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"], name="dq"),
            helper.make_node("Relu", ["d"], ["y"], name="relu"),
        ],
        "g",
        [x],
        [y],
        [
            helper.make_tensor("s", TensorProto.FLOAT, [], [0.037]),
            helper.make_tensor("z", TensorProto.UINT8, [], [131]),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_a_form_the_profile_names_fixes_only_the_nodes_the_target_refuses(tmp_path):
    from onnx_qrewrite import rewrite

    path = _emu_profile(tmp_path, [*EMU_OPS, "DequantizeLinear"], "float-emulation", "exact")
    model = _qdq_relu()
    plan = plan_for_target_model(model, load_target(str(path)))
    assert [(n.node, n.rule, n.form, n.status) for n in plan.nodes] == [
        ("q", "float-emulation-q", "float-emulation", "fixed by the rewrite")
    ]
    assert plan.ok and plan.forms["float-emulation"]["nodes"] == 1
    assert plan.forms["float-emulation"]["exactness"] == "exact"
    result = rewrite(model, target=str(path))
    ops = [n.op_type for n in result.model.graph.node]
    assert "QuantizeLinear" not in ops and ops.count("DequantizeLinear") == 1  # the accepted node stays
    assert any("form float-emulation (exact) rewrote 1 node" in line for line in result.report.summary_lines())
    # exact: bit for bit what onnxruntime computes for the original
    import onnxruntime as ort

    feed = {"x": np.linspace(-6, 6, 16, dtype=np.float32).reshape(2, 8)}
    want = ort.InferenceSession(model.SerializeToString()).run(None, feed)[0]
    got = ort.InferenceSession(result.model.SerializeToString()).run(None, feed)[0]
    assert np.array_equal(want, got)


def test_a_form_that_would_leave_more_refused_nodes_is_not_used(tmp_path):
    path = _emu_profile(
        tmp_path, [op for op in EMU_OPS if op != "Round"] + ["DequantizeLinear"], "float-emulation", "exact"
    )
    plan = plan_for_target_model(_qdq_relu(), load_target(str(path)))
    (q,) = plan.nodes
    assert q.rule is None and q.status == "refused after the rewrite"
    assert q.considered == (
        "float-emulation-q-unread (exact, form float-emulation): tried with the whole form, which leaves 1 refused "
        "node(s) against 1 without it: q/Round (Round)",
        "float-emulation-q (exact): leaves 1 refused node: q/Round (Round)",  # the profile has no Round
    )
    assert plan.refused_after == len(plan.before) == 1 and plan.forms == {}


def test_an_approximate_form_runs_only_with_the_profiles_consent_and_says_so_loudly(tmp_path):
    from onnx_qrewrite import rewrite

    model = _qdq_relu()
    exact_only = load_target(str(_emu_profile(tmp_path, EMU_OPS, "qdq-to-float", "exact")))
    plan = plan_for_target_model(model, exact_only)
    assert plan.refused_after == 2 and plan.forms == {}  # only the exact fold, which does not apply
    path = _emu_profile(tmp_path, EMU_OPS, "qdq-to-float", "approximate")
    plan = plan_for_target_model(model, load_target(str(path)))
    assert plan.ok and plan.forms["qdq-to-float"]["exactness"] == "approximate"
    assert {n.exactness for n in plan.nodes} == {"approximate"}
    summary = "\n".join(rewrite(model, target=str(path)).report.summary_lines())
    assert "rewritten by approximate rules (target emu needs them): numerics changed" in summary
    assert "form qdq-to-float (approximate) rewrote 2 nodes: APPROXIMATE" in summary


def _ms_quantized_softmax() -> onnx.ModelProto:
    """Softmax -> com.microsoft QuantizeLinear -> com.microsoft DequantizeLinear."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])
    ms = "com.microsoft"
    graph = helper.make_graph(
        [
            helper.make_node("Softmax", ["x"], ["p"], name="softmax"),
            helper.make_node("QuantizeLinear", ["p", "s", "z"], ["q"], name="q", domain=ms),
            helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], name="dq", domain=ms),
        ],
        "g",
        [x],
        [y],
        [
            helper.make_tensor("s", TensorProto.FLOAT, [], [1 / 255]),
            helper.make_tensor("z", TensorProto.UINT8, [], [0]),
        ],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(ms, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def test_a_plan_applies_rules_to_what_earlier_rules_emitted(tmp_path, monkeypatch):
    """Two stages: the com.microsoft QuantizeLinear becomes a standard one (ms-q-standard), which
    this target does not run either; a second stage computes it and the DequantizeLinear that
    reads it in float (the profile's float-emulation form: its pair rule, anchored at that
    DequantizeLinear, which the target accepts but which reads the refused QuantizeLinear). The
    plan judges ms-q-standard by where the chain ends, inspect names both rules, and rewrite
    --target applies both stages: bit-exact with the original."""
    import onnxruntime as ort

    from onnx_qrewrite import rewrite

    text = MINIMAL.replace('id = "mini"', 'id = "staged"').replace(
        'names = ["Add"]', f"names = {json.dumps([*EMU_OPS, 'Softmax', 'DequantizeLinear'])}"
    )
    # ms-q-decompose would do it in one rule: avoided, so the chain is the only way
    text += '\n[rewrites]\navoid = ["ms-q-decompose"]\nsource = "doc"\n' + FORM
    path = tmp_path / "staged.toml"
    path.write_text(text)
    profile = load_target(str(path))
    model = _ms_quantized_softmax()
    plan = plan_for_target_model(model, profile)
    assert plan.ok and len(plan.before) == 2 and len(plan.later) == 1
    q = next(n for n in plan.nodes if n.node == "q")
    assert q.rule == "ms-q-standard" and q.exactness == "exact" and q.form == "float-emulation"
    assert q.then == ("float-emulation-q-unread (exact) on q/QuantizeLinear",) and q.status == "fixed by the rewrite"
    dq = next(n for n in plan.nodes if n.node == "dq")
    assert dq.then == ("float-emulation-qdq-pair (exact) on y/DequantizeLinear",)
    onnx.save(model, tmp_path / "m.onnx")
    out = cli("inspect", tmp_path / "m.onnx", "--target", path)
    assert out.returncode == 0, out.stderr
    assert "rewrite: ms-q-standard (exact), form float-emulation" in out.stdout
    assert "then: float-emulation-q-unread (exact) on q/QuantizeLinear" in out.stdout
    result = rewrite(model, target=str(path))
    ops = [n.op_type for n in result.model.graph.node]
    assert "QuantizeLinear" not in ops and result.report.by_rule()["float-emulation-qdq-pair"] == 1
    assert check_model(result.model, profile) == [] and result.report.target["refused_after"] == 0
    feed = {"x": np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32) * 4}
    want = ort.InferenceSession(model.SerializeToString()).run(None, feed)[0]
    got = ort.InferenceSession(result.model.SerializeToString()).run(None, feed)[0]
    assert np.array_equal(want, got)
    # with one stage only, the standard QuantizeLinear stays refused: ms-q-standard is not used
    monkeypatch.setattr("onnx_qrewrite.targets.stages.MAX_STAGES", 1)
    one = plan_for_target_model(model, profile)
    assert one.refused_after == 1 and next(n for n in one.nodes if n.node == "q").rule is None


def test_a_form_that_needs_the_users_consent_waits_for_allow_approximate(tmp_path):
    """consent = "user": the profile names the approximate form, but its approximate rules run only
    with --allow-approximate; without it the plan says what that would give."""
    from onnx_qrewrite import rewrite

    path = _emu_profile(tmp_path, EMU_OPS, "qdq-to-float", "approximate")
    path.write_text(path.read_text().replace('allow = "approximate"', 'allow = "approximate"\nconsent = "user"'))
    model = _qdq_relu()
    plan = plan_for_target_model(model, load_target(str(path)))
    assert plan.refused_after == 2 and plan.forms == {}
    assert plan.with_consent == {"forms": ["qdq-to-float"], "refused_after": 0, "first": ""}
    assert "with --allow-approximate (form qdq-to-float, approximate) it would refuse nothing" in plan.refusal_error()
    onnx.save(model, tmp_path / "m.onnx")
    out = cli("inspect", tmp_path / "m.onnx", "--target", path)
    assert out.returncode == 4 and "with --allow-approximate (form qdq-to-float, approximate)" in out.stdout
    consented = plan_for_model_allow(model, load_target(str(path)))
    assert consented.ok and consented.forms["qdq-to-float"]["exactness"] == "approximate"
    assert consented.with_consent is None
    result = rewrite(model, target=str(path), allow=("exact", "bounded", "approximate"))
    assert result.report.target["refused_after"] == 0


def plan_for_model_allow(model: onnx.ModelProto, profile):
    from onnx_qrewrite.targets import plan_for_model

    return plan_for_model(model, load_rules(), profile, allow=("exact", "bounded", "approximate"))


def plan_for_target_model(model: onnx.ModelProto, profile):
    from onnx_qrewrite.targets import plan_for_model

    return plan_for_model(model, load_rules(), profile)


def _quantized_softmax() -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])
    graph = helper.make_graph(
        [
            helper.make_node("Softmax", ["x"], ["p"], name="softmax"),
            helper.make_node("QuantizeLinear", ["p", "s", "z"], ["q"], name="q_probs"),
            helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"], name="dq_probs"),
            helper.make_node("QuantizeLinear", ["d", "s", "z"], ["q2"], name="q_other"),
            helper.make_node("DequantizeLinear", ["q2", "s", "z"], ["y"], name="dq_other"),
        ],
        "g",
        [x],
        [y],
        [
            helper.make_tensor("s", TensorProto.FLOAT, [], [1 / 255]),
            helper.make_tensor("z", TensorProto.UINT8, [], [0]),
        ],
    )
    # with value_info, as producers write it: the float emulation needs to know x's type
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return onnx.shape_inference.infer_shapes(model)


def test_a_refusal_after_a_producer_and_the_form_that_fixes_it():
    """tract computes the QuantizeLinear of a Softmax output wrongly (observed): refused there and
    only there, and its profile's float-emulation form rewrites that node alone, exactly."""
    from onnx_qrewrite import rewrite

    model = _quantized_softmax()
    tract = load_target("tract")
    refused = check_model(model, tract)
    assert [(r.node, r.reasons[0].split(":")[0]) for r in refused] == [
        ("q_probs", "QuantizeLinear of a Softmax output")
    ]
    result = rewrite(model, target="tract")
    assert result.report.by_rule() == {"float-emulation-q": 1}
    assert [r.node for r in result.report.rewrites] == ["q_probs"]
    assert result.report.target["forms"]["float-emulation"]["nodes"] == 1
    import onnxruntime as ort

    feed = {"x": np.linspace(-4, 4, 16, dtype=np.float32).reshape(2, 8)}
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    want = ort.InferenceSession(model.SerializeToString(), opts).run(None, feed)[0]
    got = ort.InferenceSession(result.model.SerializeToString(), opts).run(None, feed)[0]
    assert np.array_equal(want, got)


def test_per_channel_refusals_look_at_the_scales():
    text = MINIMAL.replace('names = ["Add"]', 'names = ["QuantizeLinear", "DequantizeLinear", "Relu"]') + (
        '\n[[refuse]]\nop = "DequantizeLinear"\nwhen = "per-channel"\nreason = "no per-channel"\nsource = "doc"\n'
    )
    profile = parse_target(text, "mini.toml")
    model = _qdq_relu()
    assert check_model(model, profile) == []
    scale = np.full(8, 0.037, np.float32)
    model.graph.initializer[0].CopyFrom(onnx.numpy_helper.from_array(scale, "s"))
    model.graph.initializer[1].CopyFrom(onnx.numpy_helper.from_array(np.full(8, 131, np.uint8), "z"))
    for node in model.graph.node[:2]:
        node.attribute.append(helper.make_attribute("axis", 1))
    (refused,) = check_model(model, profile)
    assert refused.node == "dq" and "per-channel scales ('s')" in refused.reasons[0]


def test_quantize_dynamic_reaches_nnapi_through_the_weight_only_form_named_loudly(tmp_path):
    """NNAPI has no DynamicQuantizeLinear/MatMulInteger and no Round for an exact emulation: its
    profile consents to the approximate weight-only form, which rewrite --target names loudly."""
    import onnxruntime as ort

    out, report = tmp_path / "out.onnx", tmp_path / "r.json"
    proc = cli("rewrite", SAMPLES / "dynamic_mlp.onnx", "-o", out, "--target", "nnapi", "--report", report)
    assert proc.returncode == 0, proc.stderr
    assert "target nnapi (onnxruntime 1.31.1 tables): refused before 6, after 0" in proc.stdout
    assert "form weight-only (approximate) rewrote" in proc.stdout and "APPROXIMATE" in proc.stdout
    assert "rewritten by approximate rules (target nnapi needs them)" in proc.stdout
    assert check_model(onnx.load(out), load_target("nnapi")) == []
    forms = json.loads(report.read_text())["target"]["forms"]
    assert forms["weight-only"]["exactness"] == "approximate" and forms["weight-only"]["allow"] == "approximate"
    # Approximate: the activation stays float. The drift is real and small (measured, not assumed).
    inputs = dict(np.load(SAMPLES / "dynamic_mlp.inputs.npz"))
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    want = ort.InferenceSession(str(SAMPLES / "dynamic_mlp.onnx"), opts).run(None, inputs)[0]
    got = ort.InferenceSession(str(out), opts).run(None, inputs)[0]
    drift = float(np.max(np.abs(got - want)))
    assert 0 < drift < 0.05, drift
    # A target that runs quantize_dynamic's ops never gets the approximate form.
    assert "weight-only" not in json.dumps(
        plan_for_target(SAMPLES / "dynamic_mlp.onnx", load_rules(), load_target("tract")).to_dict()
    )


def _graph(nodes, inputs, outputs, inits=()):
    model = helper.make_model(
        helper.make_graph(nodes, "g", inputs, outputs, list(inits)), opset_imports=[helper.make_opsetid("", 17)]
    )
    model.ir_version = 8
    return model


def test_rank_and_computed_input_refusals_look_at_the_operands():
    """onnx2tf converts QLinearMatMul only with rank-1/2 activations and constant rank-2 weights."""
    text = MINIMAL.replace('names = ["Add"]', 'names = ["QLinearMatMul"]') + _REFUSE.replace('"Add"', '"QLinearMatMul"')
    profile = parse_target(
        text.format('when = "rank-above"\ninputs = [0, 3]\nrank = 2')
        + _REFUSE.replace('"Add"', '"QLinearMatMul"').format('when = "computed-input"\ninputs = [3]'),
        "mini.toml",
    )
    f = onnx.numpy_helper.from_array
    consts = [f(np.float32(0.1), "s"), f(np.uint8(128), "z"), f(np.int8(0), "wz"), f(np.ones((4, 3), np.int8), "w")]
    names = ["x", "s", "z", "w", "s", "wz", "s", "z"]

    def matmul(rank: int, weight: str = "w") -> onnx.ModelProto:
        shape = [2, 5, 4][-rank:]
        inputs = [helper.make_tensor_value_info("x", onnx.TensorProto.UINT8, shape)]
        if weight != "w":
            inputs.append(helper.make_tensor_value_info(weight, onnx.TensorProto.INT8, [4, 3]))
        node = helper.make_node("QLinearMatMul", [*names[:3], weight, *names[4:]], ["y"], name="mm")
        return _graph([node], inputs, [helper.make_tensor_value_info("y", onnx.TensorProto.UINT8, None)], consts)

    assert check_model(matmul(2), profile) == []
    (three,) = check_model(matmul(3), profile)
    assert "with a rank-3 input ('x'; at most 2)" in three.reasons[0]
    (computed,) = check_model(matmul(2, weight="w_in"), profile)
    assert "with input 3 ('w_in') computed at run time" in computed.reasons[0]


def test_a_shape_unrecorded_refusal_looks_at_whether_the_input_has_a_shape():
    """onnx2tf infers shapes itself where the model records none, and freezes what it cannot infer
    (the tflite profile's QLinearSoftmax and QLinearMatMul refusals): refused exactly when the
    input's shape (rank at least) is neither inferred, recorded nor a constant's."""
    profile = parse_target(MINIMAL + _REFUSE.format('when = "shape-unrecorded"'), "mini.toml")
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3])
    out = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)
    one = onnx.numpy_helper.from_array(np.ones((2, 3), np.float32), "one")
    known = _graph([helper.make_node("Add", ["x", "one"], ["y"], name="add")], [x], [out], [one])
    assert check_model(known, profile) == []
    # The same Add reading the output of an op shape inference does not know (a contrib op).
    opaque = helper.make_node("Unknown", ["x"], ["r"], name="r", domain="custom.domain")
    unknown = _graph([opaque, helper.make_node("Add", ["r", "one"], ["y"], name="add")], [x], [out], [one])
    unknown.opset_import.append(helper.make_opsetid("custom.domain", 1))
    add = [v for v in check_model(unknown, profile) if v.node == "add"]
    assert len(add) == 1 and "with input 0 ('r') of unrecorded shape" in add[0].reasons[0], add
    # Its constant operand has a shape: looking at input 1 refuses nothing.
    at_one = parse_target(MINIMAL + _REFUSE.format('when = "shape-unrecorded"\ninputs = [1]'), "mini.toml")
    assert not [v for v in check_model(unknown, at_one) if v.node == "add"]
    # A Flatten's output has rank 2 whatever its input's shape (a QOperator CNN's head reads one).
    flat = helper.make_node("Flatten", ["r"], ["f"], name="flat")
    flattened = _graph([opaque, flat, helper.make_node("Add", ["f", "one"], ["y"], name="add")], [x], [out], [one])
    flattened.opset_import.append(helper.make_opsetid("custom.domain", 1))
    assert not [v for v in check_model(flattened, profile) if v.node == "add"]


def test_an_op_taken_only_inside_a_chain_and_raw_integer_tensors():
    """QNN takes Erf only inside the float GELU its EP fuses (Div -> Erf -> Add -> Mul), and 8-bit
    tensors only on the quantized side of a Q/DQ (observed, rules/targets/qnn.toml)."""
    qnn = load_target("qnn")
    f = onnx.numpy_helper.from_array
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 8])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 8])
    consts = [f(np.float32(1.4142135), "r2"), f(np.float32(1.0), "one"), f(np.float32(0.5), "half")]
    gelu = [
        helper.make_node("Div", ["x", "r2"], ["d"], name="div"),
        helper.make_node("Erf", ["d"], ["e"], name="erf"),
        helper.make_node("Add", ["e", "one"], ["a"], name="add"),
        helper.make_node("Mul", ["x", "a"], ["m"], name="mul"),
        helper.make_node("Mul", ["m", "half"], ["y"], name="half"),
    ]
    assert check_model(_graph(gelu, [x], [y], consts), qnn) == []
    alone = [helper.make_node("Erf", ["x"], ["y"], name="erf")]
    (refused,) = check_model(_graph(alone, [x], [y]), qnn)
    assert refused.node == "erf" and "outside a Div -> Erf -> Add -> Mul chain" in refused.reasons[0]

    table = f(np.arange(32, dtype=np.uint8).reshape(8, 4), "table")
    ids = helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, [3])
    lookup = [
        helper.make_node("Gather", ["table", "ids"], ["g"], name="gather"),
        helper.make_node("DequantizeLinear", ["g", "s", "z"], ["y"], name="dq"),
    ]
    out = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [3, 4])
    model = _graph(lookup, [ids], [out], [table, f(np.float32(0.1), "s"), f(np.uint8(3), "z")])
    (raw,) = check_model(model, qnn)
    assert raw.node == "gather" and "Gather on uint8 ('g')" in raw.reasons[0]
    # Gathering the dequantized table is all float: taken.
    lookup = [
        helper.make_node("DequantizeLinear", ["table", "s", "z"], ["t"], name="dq"),
        helper.make_node("Gather", ["t", "ids"], ["y"], name="gather"),
    ]
    assert check_model(_graph(lookup, [ids], [out], [table, f(np.float32(0.1), "s"), f(np.uint8(3), "z")]), qnn) == []


def test_inspect_says_why_a_weighed_rule_does_not_apply(tmp_path):
    """A rule that matches a refused node but declines it is weighed with the engine's reason, so
    `inspect --target` says what would make it apply (here: the reduction length of an activation
    x activation QLinearMatMul, which qop-matmul with reduction_length = 'recorded' needs and the
    model does not record). The shipped rule bounds it at run time instead (a bound that depends on
    K, tests/test_qoperator_run_time_k.py), for TFLite too (LiteRT runs it on the QOperator BERT,
    tests/test_targets_runtime.py)."""
    f = onnx.numpy_helper.from_array
    consts = [f(np.float32(0.1), "s"), f(np.uint8(128), "z")]
    node = helper.make_node("QLinearMatMul", ["a", "s", "z", "b", "s", "z", "s", "z"], ["y"], name="mm")
    inputs = [
        helper.make_tensor_value_info("a", TensorProto.UINT8, [2, "k"]),
        helper.make_tensor_value_info("b", TensorProto.UINT8, ["k", 3]),
    ]
    model = _graph([node], inputs, [helper.make_tensor_value_info("y", TensorProto.UINT8, [2, 3])], consts)
    path = tmp_path / "mm.onnx"
    onnx.save(model, path)
    recorded = load_rules().with_options({"qop-matmul": {"reduction_length": "recorded"}})
    plan = plan_for_target(path, recorded, load_target("tflite"))
    (verdict,) = [n for n in plan.nodes if n.node == "mm"]
    assert verdict.rule is None and verdict.after
    assert any(
        c.startswith("qop-matmul (bounded): does not apply here: the reduction length of mm (a dimension of 'b')")
        and "--input-shape DIM=N" in c
        for c in verdict.considered
    ), verdict.considered
    # What the reason proposes makes the rule apply (onnx's shape inference cannot help a QOperator
    # BERT's attention: it stops at the com.microsoft ops before it).
    fixed = plan_for_target(path, recorded, load_target("tflite"), input_shapes=parse_input_shapes(("k=4",)))
    (verdict,) = [n for n in fixed.nodes if n.node == "mm"]
    assert not any("reduction length" in c for c in verdict.considered), verdict.considered
    assert verdict.rule == "qop-matmul" and not verdict.after
    shipped = plan_for_target(path, load_rules(), load_target("tflite"))
    (verdict,) = [n for n in shipped.nodes if n.node == "mm"]
    assert verdict.rule == "qop-matmul" and not verdict.after and shipped.refused_after == 0


def test_readers_decide_the_unfused_outputs_and_read_by_refusals():
    """Without a runtime: QNN's DynamicQuantizeLinear only with the one MatMulInteger/ConvInteger/
    DequantizeLinear its EP fuses it with, and its LayerNormalization refusing an int32 bias
    (rules/targets/qnn.toml; tests/test_targets_runtime.py checks both on the simulator)."""
    qnn = load_target("qnn")
    f = onnx.numpy_helper.from_array
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 8])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 8])
    dql = helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "s", "z"], name="dql")
    dq = helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], name="dq")
    assert check_model(_graph([dql, dq], [x], [y]), qnn) == []
    twice = helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y2"], name="dq2")
    y2 = helper.make_tensor_value_info("y2", onnx.TensorProto.FLOAT, [1, 8])
    (shared,) = check_model(_graph([dql, dq, twice], [x], [y, y2]), qnn)
    assert shared.node == "dql" and "whose output 'q' is read by 2 nodes" in shared.reasons[0]
    (unread,) = check_model(_graph([dql, helper.make_node("Relu", ["x"], ["y"])], [x], [y]), qnn)
    assert "whose output 'q' no node reads" in unread.reasons[0]

    consts = [
        f(np.ones(8, np.float32), "w"),
        f(np.arange(8, dtype=np.int32), "bq"),
        f(np.float32(0.01), "bs"),
        f(np.arange(8, dtype=np.int8), "bq8"),
    ]
    for bias, refused in (("bq", True), ("bq8", False)):
        nodes = [
            helper.make_node("DequantizeLinear", [bias, "bs"], ["b"], name="bias"),
            helper.make_node("LayerNormalization", ["x", "w", "b"], ["y"], name="ln"),
        ]
        found = check_model(_graph(nodes, [x], [y], consts), qnn)
        assert [r.node for r in found] == (["bias"] if refused else []), found
        if refused:
            assert "DequantizeLinear of int32 read by a LayerNormalization ('ln')" in found[0].reasons[0]


def test_every_refusal_condition_a_profile_may_name_is_checked():
    """A profile's ``[[refuse]] when`` is validated against REFUSE_WHEN; a condition without its
    check in check._WHEN would never hold, and the target would silently accept what it refuses."""
    import onnx_qrewrite.targets.check as check
    from onnx_qrewrite.targets.profile import REFUSE_WHEN

    assert set(check._WHEN) == set(REFUSE_WHEN)


def _softmax_where_quantize(condition: str) -> onnx.ModelProto:
    """QuantizeLinear(Where(c, 0, Softmax(x))) with the condition ``c`` made as ``condition`` says."""
    init = onnx.numpy_helper.from_array
    nodes = [helper.make_node("Softmax", ["x"], ["p"], axis=-1)]
    inits = [init(np.float32(0.01), "s"), init(np.uint8(0), "z"), init(np.float32(0), "zero")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])]
    if condition == "initializer":
        inits.append(init(np.array(True), "c"))
    elif condition == "Shape":
        inits += [init(np.array([-1], np.int64), "ax"), init(np.int64(1), "one")]
        nodes += [
            helper.make_node("Shape", ["p"], ["sh"]),
            helper.make_node("Gather", ["sh", "ax"], ["g"]),
            helper.make_node("Equal", ["g", "one"], ["c"]),
        ]
    elif condition == "graph input":
        inputs.append(helper.make_tensor_value_info("c", TensorProto.BOOL, [2, 4]))
    elif condition == "IsNaN":
        nodes.append(helper.make_node("IsNaN", ["p"], ["c"]))
    elif condition == "Size of a run-time value":
        nodes += [
            helper.make_node("IsNaN", ["p"], ["n"]),
            helper.make_node("Size", ["n"], ["sz"]),
            helper.make_node("Cast", ["sz"], ["c"], to=TensorProto.BOOL),
        ]
    nodes += [
        helper.make_node("Where", ["c", "zero", "p"], ["w"]),
        helper.make_node("QuantizeLinear", ["w", "s", "z"], ["q"], name="ql"),
        helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"]),
    ]
    output = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])
    graph = helper.make_graph(nodes, "g", inputs, [output], inits)
    return onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))


@pytest.mark.parametrize(
    ("condition", "refused"),
    [
        ("initializer", True),
        ("Shape", True),
        ("Size of a run-time value", True),
        ("graph input", False),
        ("IsNaN", False),
    ],
)
def test_a_refusal_looks_through_a_where_only_where_its_condition_is_static(condition, refused):
    """tract's QuantizeLinear(Softmax) refusal looks through a Where (through_static) only where
    the condition is computed from constants and Shape/Size alone (tract folds it); a condition
    read from run-time data (a graph input, IsNaN of the Softmax) it keeps, and the node is not
    refused. Offline: the profile's data and check_model, no tract needed."""
    found = [r for r in check_model(_softmax_where_quantize(condition), load_target("tract")) if r.node == "ql"]
    assert bool(found) is refused, found


def _qlinear_chain(links: int, residual: bool, x_shape: tuple[int, ...] = (4, 16)) -> onnx.ModelProto:
    """x -> QuantizeLinear -> ``links`` QLinearAdds -> QLinearMatMul: each add reads the previous
    value twice (QLinearAdd(a, a)), or it and a QLinearLeakyRelu of it (a + f(a)). onnx's
    inference stops at the contrib ops, so the tflite check derives the MatMul input's rank back
    through the whole chain, reaching every value by two paths."""
    f = onnx.numpy_helper.from_array
    w = np.random.default_rng(0).integers(0, 255, (16, 8)).astype(np.uint8)
    inits = [f(np.array(0.05, np.float32), "s"), f(np.array(128, np.uint8), "z"), f(w, "W")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["a0"])]
    for i in range(1, links + 1):
        prev, other = f"a{i - 1}", f"a{i - 1}"
        if residual:
            other = f"r{i}"
            leaky = helper.make_node("QLinearLeakyRelu", [prev, "s", "z", "s", "z"], [other], alpha=0.1)
            nodes.append(leaky)
        add = helper.make_node("QLinearAdd", [prev, "s", "z", other, "s", "z", "s", "z"], [f"a{i}"])
        nodes.append(add)
    nodes.append(helper.make_node("QLinearMatMul", [f"a{links}", "s", "z", "W", "s", "z", "s", "z"], ["m"], name="mm"))
    nodes.append(helper.make_node("DequantizeLinear", ["m", "s", "z"], ["y"]))
    for node in nodes:
        node.domain = "com.microsoft" if node.op_type.startswith("QLinear") and node.op_type != "QLinearMatMul" else ""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(helper.make_graph(nodes, "g", [x], [y], inits), ir_version=9, opset_imports=opsets)


@pytest.mark.parametrize("residual", [False, True], ids=["a+a", "a+f(a)"])
def test_tflite_rank_derivation_is_linear_in_a_chain_that_reaches_values_twice(monkeypatch, residual):
    """The tflite check derives a QLinearMatMul input's rank back through com.microsoft ops
    (targets.check._rank): without a memo, each QLinearAdd reached its input twice and the calls
    doubled per link (a 20-link chain took 71 s). Counted, not timed: a 24-link chain's derivation
    stays within a bound linear in the links (2**24 calls before), and the verdicts are those of
    the unmemoized recursion on a chain short enough to run it."""
    from onnx_qrewrite.targets import check as check_module

    profile = load_target("tflite")
    calls = []
    counted = check_module.contrib_rank

    def counting(node, rank_of):
        calls.append(node.output[0])
        if len(calls) > 40 * 24:
            raise AssertionError(f"{len(calls)} rank derivations through a 24-link chain: not linear")
        return counted(node, rank_of)

    monkeypatch.setattr(check_module, "contrib_rank", counting)
    check_model(_qlinear_chain(24, residual), profile)
    assert 0 < len(calls) <= 40 * 24
    monkeypatch.setattr(check_module, "contrib_rank", counted)
    (beyond,) = check_model(_qlinear_chain(40, residual), profile)  # past _RANK_DEPTH: not derived
    assert "of unrecorded shape" in beyond.reasons[0], beyond
    shorts = [_qlinear_chain(8, residual, shape) for shape in ((4, 16), (2, 4, 16))]
    memoized = [[(r.node, r.reasons) for r in check_model(m, profile)] for m in shorts]
    assert memoized[0] == [] and "rank-3 input ('a8'" in memoized[1][0][1][0], memoized
    unmemoized = lambda scope, name, depth=check_module._RANK_DEPTH: check_module._rank_uncached(scope, name, depth)  # noqa: E731
    monkeypatch.setattr(check_module, "_rank", unmemoized)
    assert [[(r.node, r.reasons) for r in check_model(m, profile)] for m in shorts] == memoized
