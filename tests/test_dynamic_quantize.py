"""DynamicQuantizeLinear expansion: bit-exact with onnxruntime's kernel, at every opset we claim.

NUMERICS.md records where onnxruntime's kernel and the ONNX function body differ (all-zero input,
NaN zero point); each trap has a case here. NaN-containing inputs are compared where the kernel is
deterministic (1-7 elements, its scalar min/max loop); from 8 elements on it depends on NaN position
and thread count, and they are not.
"""

from __future__ import annotations

import importlib

import numpy as np
import onnx
import onnx.inliner
import pytest
from conftest import assert_bitwise_equal, op_types, require_runtime_opset, rule_marker, run, session
from onnx import TensorProto, helper

import onnx_qrewrite

OPSETS = [11, 13, 17, 18, 21, 26]
KERNEL_OPS = [
    "ReduceMin",
    "ReduceMax",
    "Min",
    "Max",
    "Sub",
    "Div",
    "Cast",
    "Where",
    "Div",
    "IsNaN",
    "Where",
    "QuantizeLinear",
    "QuantizeLinear",
]


def dql_model(opset: int, rank: int = 1) -> onnx.ModelProto:
    shape = [f"d{i}" for i in range(rank)]
    node = helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "y_scale", "y_zero_point"], name="dql")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [
            helper.make_tensor_value_info("y", TensorProto.UINT8, shape),
            helper.make_tensor_value_info("y_scale", TensorProto.FLOAT, []),
            helper.make_tensor_value_info("y_zero_point", TensorProto.UINT8, []),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _f32(*v) -> np.ndarray:
    return np.array(v, dtype=np.float32)


rng = np.random.default_rng(1234)
EDGE_CASES = {
    "all_zeros": np.zeros(16, np.float32),
    "all_negative_zeros": np.full(16, -0.0, np.float32),
    "one_element": _f32(3.7),
    "one_zero": _f32(0.0),
    "one_negative": _f32(-2.5),
    "ties_k_plus_half": np.concatenate([_f32(0.0, 255.0), np.arange(255, dtype=np.float32) + 0.5]),
    "negative_ties": np.concatenate([_f32(-255.0, 0.0), -(np.arange(255, dtype=np.float32) + 0.5)]),
    "denormals": _f32(1e-40, -3e-39, 2e-45, 0.0, 1.1e-38),
    "tiny_denormals_scale_underflows": _f32(0.0, 1.4e-45, 2.8e-45),
    "tiny_denormal_negative": _f32(-1.4e-45, 0.0),
    "near_1e38": _f32(1e38, -1e38, 5e37, 0.0, 3.3e38),
    "range_overflows_to_inf": _f32(3.0e38, -3.0e38, 1.0),
    "pos_inf": _f32(1.0, np.inf, -2.0),
    "neg_inf": _f32(1.0, -np.inf, 2.0),
    "both_inf": _f32(np.inf, -np.inf, 0.5),
    "only_pos_inf": _f32(np.inf, np.inf),
    "all_negative": -rng.uniform(0.1, 50, 999).astype(np.float32),
    "all_positive": rng.uniform(0.1, 50, 999).astype(np.float32),
    "normal_large": rng.standard_normal((64, 257)).astype(np.float32),
    "uniform_large": rng.uniform(-7, 3, (3, 5, 7, 11)).astype(np.float32),
    "cauchy": rng.standard_cauchy(4096).astype(np.float32),
    "constant_positive": np.full((4, 4), 7.25, np.float32),
}


class _Pair:
    """Original and rewritten DQL model of each input rank, built once per opset."""

    def __init__(self, opset: int, semantics: str = "onnxruntime"):
        self.opset, self._semantics, self._cache = opset, semantics, {}

    def __call__(self, x: np.ndarray) -> tuple[onnx.ModelProto, onnx.ModelProto]:
        if x.ndim not in self._cache:
            original = dql_model(self.opset, x.ndim)
            options = {"dql-expand": {"semantics": self._semantics}}
            self._cache[x.ndim] = (original, onnx_qrewrite.rewrite(original, options=options).model)
        return self._cache[x.ndim]


@pytest.fixture(scope="module", params=OPSETS)
def models_at_opset(request):
    pair = _Pair(request.param)
    original, rewritten = pair(np.zeros(1, np.float32))
    return request.param, original, rewritten, pair


@rule_marker("dql-expand", "positive")
def test_expansion_is_primitive_and_valid(models_at_opset):
    opset, original, rewritten, _ = models_at_opset
    assert op_types(rewritten) == KERNEL_OPS
    onnx.checker.check_model(rewritten, full_check=True)
    onnx.shape_inference.infer_shapes(rewritten, check_type=True, strict_mode=True)
    # Declared IR 8; the provenance (node metadata) is a field of IR 10 (tests/test_provenance_ir.py).
    assert (original.ir_version, rewritten.ir_version) == (8, 10)
    assert [(o.domain, o.version) for o in rewritten.opset_import] == [("", opset)]
    assert [o.name for o in rewritten.graph.output] == ["y", "y_scale", "y_zero_point"]


@pytest.mark.parametrize("threads", [1, 2])
def test_edge_battery_bit_exact_with_onnxruntime_kernel(models_at_opset, threads):
    opset, _, _, pair = models_at_opset
    require_runtime_opset(opset)
    for name, x in EDGE_CASES.items():
        original, rewritten = pair(x)
        want = run(original, {"x": x}, threads=threads)
        got = run(rewritten, {"x": x}, threads=threads)
        for out in ("y", "y_scale", "y_zero_point"):
            assert_bitwise_equal(got[out], want[out], f"opset {opset}, {name}, {out}")


def test_bit_exact_with_graph_optimisation_on():
    pair = _Pair(17)
    for name, x in EDGE_CASES.items():
        original, rewritten = pair(x)
        want, got = run(original, {"x": x}, opt="all"), run(rewritten, {"x": x}, opt="all")
        for out in want:
            assert_bitwise_equal(got[out], want[out], f"{name}, {out}")


def test_documented_kernel_traps_hold():
    """The cases where the kernel and the spec differ: the rewrite follows the kernel."""
    rewritten = onnx_qrewrite.rewrite(dql_model(13)).model
    zeros = run(rewritten, {"x": np.zeros(8, np.float32)})
    assert zeros["y_scale"] == np.float32(1.0) and zeros["y_zero_point"] == 0
    neg_inf = run(rewritten, {"x": _f32(1.0, -np.inf)})
    assert neg_inf["y_zero_point"] == 255
    # Tiny denormal range: the scale underflows to 0.0 while max != min, and stays 0.0.
    tiny = run(rewritten, {"x": _f32(0.0, 1.4e-45)})
    assert tiny["y_scale"] == np.float32(0.0)


def _import_only_the_dql_cases(package) -> None:
    """For collect_testcases in place of importing every case module of onnx's node package: each
    generates its op's cases as it is imported (10 s of CPU for all of them, here), when only
    DynamicQuantizeLinear's module can hold cases of that op type."""
    importlib.import_module(f"{package.__name__}.dynamicquantizelinear")


def test_onnx_conformance_cases_reproduce_after_rewrite(monkeypatch):
    from onnx.backend.test.case import node

    monkeypatch.setattr(node, "import_recursive", _import_only_the_dql_cases)  # raises if onnx renames it
    cases = [c for c in node.collect_testcases(op_type="DynamicQuantizeLinear") if not c.name.endswith("_expanded")]
    assert len(cases) >= 3
    for case in cases:
        result = onnx_qrewrite.rewrite(case.model)
        assert "DynamicQuantizeLinear" not in op_types(result.model)
        for inputs, outputs in case.data_sets:
            feeds = {i.name: v for i, v in zip(case.model.graph.input, inputs, strict=True)}
            got = run(result.model, feeds)
            for o, want in zip(case.model.graph.output, outputs, strict=True):
                assert_bitwise_equal(got[o.name], np.asarray(want), f"{case.name}: {o.name}")


def test_spec_semantics_emit_the_onnx_function_body():
    original = dql_model(13, rank=1)
    spec = onnx_qrewrite.rewrite(original, options={"dql-expand": {"semantics": "spec"}}).model
    inlined = onnx.inliner.inline_selected_functions(
        original, [("", "DynamicQuantizeLinear")], inline_schema_functions=True
    )
    assert op_types(spec) == op_types(inlined)
    onnx.checker.check_model(spec, full_check=True)
    for name in ("cauchy", "all_positive", "ties_k_plus_half", "all_zeros", "neg_inf"):
        x = EDGE_CASES[name]
        want, got = run(inlined, {"x": x}), run(spec, {"x": x})
        for out in want:
            assert_bitwise_equal(got[out], want[out], f"{name}, {out}")
    # ... and the spec body really differs from the kernel where NUMERICS.md says it does.
    zeros = run(spec, {"x": np.zeros(4, np.float32)})
    assert zeros["y_scale"] == 0.0  # the kernel gives 1.0
    assert run(spec, {"x": _f32(1.0, -np.inf)})["y_zero_point"] == 0


@pytest.mark.parametrize("opset", [11, 18, 26])
def test_spec_semantics_valid_at_opset(opset):
    x = EDGE_CASES["normal_large"]
    spec = onnx_qrewrite.rewrite(dql_model(opset, 2), options={"dql-expand": {"semantics": "spec"}}).model
    onnx.checker.check_model(spec, full_check=True)
    require_runtime_opset(opset)
    assert_bitwise_equal(run(spec, {"x": x})["y"], run(dql_model(opset, 2), {"x": x})["y"], "y")


@rule_marker("dql-expand", "negative")
def test_rule_not_applied_below_its_opset_or_when_skipped():
    # Opset 27 is valid ONNX but above what onnxruntime 1.31 loads: the rule declines, and the
    # node it cannot lower is named with the reason (exit code 4 on the command line).
    with pytest.raises(onnx_qrewrite.LoweringError, match=r"node dql .*dql-expand: model opset 27 is above"):
        onnx_qrewrite.rewrite(dql_model(27))
    skipped = onnx_qrewrite.rewrite(dql_model(13), skip=["dql-expand"])
    assert op_types(skipped.model) == ["DynamicQuantizeLinear"]
    assert not skipped.report.changed


def test_non_float_input_is_rejected_with_the_node_name():
    model = dql_model(13)
    model.graph.input[0].type.tensor_type.elem_type = TensorProto.INT32
    with pytest.raises(onnx_qrewrite.InvalidModelError, match=r"node dql: .*'x' is int32.*float32 only"):
        onnx_qrewrite.rewrite(model)


def test_report_names_each_rewrite():
    result = onnx_qrewrite.rewrite(dql_model(17))
    (rw,) = result.report.rewrites
    assert (rw.rule, rw.node, rw.op_type, rw.domain, rw.scope) == (
        "dql-expand",
        "dql",
        "DynamicQuantizeLinear",
        "",
        "main",
    )
    assert list(rw.created_ops) == KERNEL_OPS
    assert result.report.by_rule() == {"dql-expand": 1}
    assert (
        result.report.ops_before["DynamicQuantizeLinear"] == 1 and result.report.ops_after["DynamicQuantizeLinear"] == 0
    )
    meta = {(p.key, p.value) for p in result.model.graph.node[0].metadata_props}
    assert meta == {("onnx_qrewrite.rule", "dql-expand"), ("onnx_qrewrite.origin", "dql")}


def _static_dql_model(shape: list[int], opset: int = 13) -> onnx.ModelProto:
    model = dql_model(opset, len(shape))
    for value in (model.graph.input[0], model.graph.output[0]):
        for dim, size in zip(value.type.tensor_type.shape.dim, shape, strict=True):
            dim.dim_value = size
    return model


def _nan_battery(n: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Inputs of n elements holding NaN: every NaN position pattern over a small value set for n <= 3,
    a random sample beyond; all-NaN, NaN with +-inf and random finite values always included."""
    values = [np.nan, 1.0, -1.0, 0.0, -0.0, np.inf, -np.inf, 2.5, -3.0, 1e-45]
    if n <= 3:
        grid = np.array(np.meshgrid(*[values] * n, indexing="ij"), np.float32).reshape(n, -1).T
    else:
        grid = rng.choice(np.array(values, np.float32), size=(400, n))
    cases = [x for x in grid if np.isnan(x).any()]
    cases += [np.full(n, np.nan, np.float32), np.where(np.arange(n) % 2 == 0, np.nan, np.inf).astype(np.float32)]
    for _ in range(20):
        x = rng.standard_normal(n).astype(np.float32) * 10
        x[rng.integers(n)] = np.nan
        cases.append(x)
    return cases


@rule_marker("dql-expand", "positive")
@pytest.mark.parametrize("opt", ["disable", "all"])
def test_nan_in_at_most_seven_elements_matches_the_kernel(opt):
    """Below 8 elements onnxruntime's min/max loop skips NaN deterministically: the rewrite does too
    (all NaN: scale 1.0, zero point 0), for every NaN position, with +-inf, 1 and 2 threads."""
    rng = np.random.default_rng(7)
    for n, shape in [(1, [1]), (2, [2]), (3, [3]), (4, [2, 2]), (5, [5]), (6, [1, 2, 3]), (7, [7])]:
        original = _static_dql_model(shape)
        rewritten = onnx_qrewrite.rewrite(original).model
        assert op_types(rewritten)[:2] == ["IsNaN", "Where"], n
        for threads in (1, 2):
            kernel = session(original, threads=threads, opt=opt)
            expansion = session(rewritten, threads=threads, opt=opt)
            for flat in _nan_battery(n, rng):
                x = flat.reshape(shape)
                want, got = kernel.run(None, {"x": x}), expansion.run(None, {"x": x})
                for out, w, g in zip(("y", "y_scale", "y_zero_point"), want, got, strict=True):
                    assert_bitwise_equal(g, w, f"{x.ravel().tolist()}, {out}, {threads} threads")
    all_nan = run(onnx_qrewrite.rewrite(_static_dql_model([3])).model, {"x": np.full(3, np.nan, np.float32)})
    assert all_nan["y_scale"] == np.float32(1.0) and all_nan["y_zero_point"] == 0


@rule_marker("dql-expand", "positive")
def test_all_nan_in_eight_or_more_elements_is_deterministic_and_matched():
    """The README's table: an all-NaN input of 8+ elements gives a NaN scale and zero point 255 in
    the kernel (vectorised min/max: NaN whatever the lanes), whatever the thread count; the
    unguarded expansion matches it bit for bit. Below 8 it is scale 1.0, zero point 0 (above)."""
    for shape in ([8], [2, 4], [100]):
        original = _static_dql_model(shape)
        rewritten = onnx_qrewrite.rewrite(original).model
        x = np.full(shape, np.nan, np.float32)
        for threads in (1, 2):
            want = session(original, threads=threads).run(None, {"x": x})
            got = session(rewritten, threads=threads).run(None, {"x": x})
            assert np.isnan(want[1]) and want[2] == 255, (shape, threads, want[1:])
            for out, w, g in zip(("y", "y_scale", "y_zero_point"), want, got, strict=True):
                assert_bitwise_equal(g, w, f"all NaN {shape}, {out}, {threads} threads")


def test_nan_guard_only_where_the_shape_is_known_to_be_small():
    """8+ elements or an unknown shape: the 13-op expansion, no extra op (from 8 elements the kernel
    is vectorised and a NaN's effect depends on its position, so nothing could be matched; an
    unknown shape holding 1-7 elements at run time is not matched: the test below)."""
    for shape in ([8], [2, 4], [1000]):
        assert op_types(onnx_qrewrite.rewrite(_static_dql_model(shape)).model) == KERNEL_OPS
    assert op_types(onnx_qrewrite.rewrite(dql_model(13)).model) == KERNEL_OPS
    # The documented reason: at 8 elements the kernel no longer skips NaN (measured, onnxruntime 1.31.1).
    x = _f32(0.0, 2.5, 0.0, 0.0, -3.0, np.nan, np.nan, -1.0)
    kernel = run(_static_dql_model([8]), {"x": x})
    skipping = run(onnx_qrewrite.rewrite(_static_dql_model([7])).model, {"x": x[[0, 1, 2, 3, 4, 5, 7]]})
    assert kernel["y_scale"] != skipping["y_scale"]


def test_nan_in_a_small_tensor_of_unrecorded_shape_is_matched_once_the_shape_is_fixed():
    """A symbolic dimension ([d0, 4], d0 = 1 at run time) hides that the tensor holds 4 elements,
    where the kernel skips NaN deterministically: the plain rewrite does not match it and verify
    excludes the sample (README, Numerics); `--target T --input-shape d0=1` records the shape, the
    guard applies and the NaN is matched bit for bit."""
    from onnx_qrewrite.io.input_shape import parse_input_shapes
    from onnx_qrewrite.verify import Sample, verify

    model = dql_model(13, rank=2)
    for value in (model.graph.input[0], model.graph.output[0]):
        value.type.tensor_type.shape.dim[1].dim_value = 4
    x = _f32(np.nan, 1.0, -2.0, 3.0).reshape(1, 4)
    kernel = run(model, {"x": x})
    plain = onnx_qrewrite.rewrite(model).model
    assert op_types(plain) == KERNEL_OPS
    assert np.isnan(run(plain, {"x": x})["y_scale"]) and not np.isnan(kernel["y_scale"])
    assert verify(model, plain, inputs=[Sample("nan", {"x": x})], localize_failures=False).verdict_key == "inconclusive"
    fixed = onnx_qrewrite.rewrite(model, target="onnx", input_shapes=parse_input_shapes(("d0=1",))).model
    assert op_types(fixed)[:2] == ["IsNaN", "Where"]
    got = run(fixed, {"x": x})
    for out in ("y", "y_scale", "y_zero_point"):
        assert_bitwise_equal(got[out], kernel[out], out)
    assert verify(model, fixed, inputs=[Sample("nan", {"x": x})]).passed


@rule_marker("dql-expand", "positive")
def test_run_time_nan_guard_matches_the_kernel_on_small_tensors_of_unrecorded_shape():
    """nan_guard = "run-time": a shape the model does not record ([d0, d1]) is guarded at run time,
    so NaN in 1-7 elements matches the kernel bit for bit (every NaN position, +-inf, all NaN, 1 and
    2 threads), and from 8 elements on the output is the unguarded expansion's, NaN-free inputs
    and NaN inputs alike (the guard leaves a NaN a NaN there)."""
    model = dql_model(13, rank=2)
    plain = onnx_qrewrite.rewrite(model).model
    result = onnx_qrewrite.rewrite(model, options={"dql-expand": {"nan_guard": "run-time"}})
    guarded = result.model
    assert op_types(guarded)[:5] == ["Size", "Less", "Where", "IsNaN", "Where"]
    assert "NaN skipped by min/max at run time" in " ".join(result.report.rewrites[0].notes)
    rng = np.random.default_rng(11)
    for threads in (1, 2):
        kernel, expansion = session(model, threads=threads), session(guarded, threads=threads)
        for n in range(1, 8):
            for flat in _nan_battery(n, rng)[::3]:
                x = flat.reshape(1, n)
                for out, w, g in zip(
                    ("y", "y_scale", "y_zero_point"),
                    kernel.run(None, {"x": x}),
                    expansion.run(None, {"x": x}),
                    strict=True,
                ):
                    assert_bitwise_equal(g, w, f"{x.ravel().tolist()}, {out}, {threads} threads")
    unguarded = session(plain)
    expansion = session(guarded)
    for x in (
        rng.standard_normal((2, 4)).astype(np.float32),
        _f32(0.0, 2.5, np.nan, 0.0, -3.0, np.nan, 1.0, -1.0).reshape(2, 4),
    ):
        for w, g in zip(unguarded.run(None, {"x": x}), expansion.run(None, {"x": x}), strict=True):
            assert_bitwise_equal(g, w, f"{x.ravel().tolist()}")


def test_run_time_nan_guard_only_where_the_shape_is_not_recorded():
    """With nan_guard = "run-time", a recorded shape still decides: 1-7 elements get the static guard
    (no run-time test), 8 or more none, and so do partly recorded shapes whose known dimensions
    already hold 8 or more; only the rest are tested at run time."""
    options = {"dql-expand": {"nan_guard": "run-time"}}
    assert op_types(onnx_qrewrite.rewrite(_static_dql_model([3]), options=options).model)[:2] == ["IsNaN", "Where"]
    assert op_types(onnx_qrewrite.rewrite(_static_dql_model([8]), options=options).model) == KERNEL_OPS
    partly = dql_model(13, rank=2)
    partly.graph.input[0].type.tensor_type.shape.dim[1].dim_value = 8
    assert op_types(onnx_qrewrite.rewrite(partly, options=options).model) == KERNEL_OPS
    partly.graph.input[0].type.tensor_type.shape.dim[1].dim_value = 4
    assert op_types(onnx_qrewrite.rewrite(partly, options=options).model)[0] == "Size"


def test_verify_names_the_nan_guard_when_a_small_tensor_of_unrecorded_shape_holds_nan():
    """Without the guard, a NaN in a 4-element tensor of unrecorded shape is a sample the kernel is
    deterministic on: verify sets it aside as inconclusive and says how to match it, not that the
    kernel is not deterministic."""
    from onnx_qrewrite.verify import Sample, verify

    model = dql_model(13, rank=2)
    x = _f32(np.nan, 1.0, -2.0, 3.0).reshape(1, 4)
    report = verify(
        model, onnx_qrewrite.rewrite(model).model, inputs=[Sample("nan", {"x": x})], localize_failures=False
    )
    assert report.verdict_key == "inconclusive"
    reason = report.to_dict()["inconclusive_reason"]
    assert "skips NaN below 8 elements" in reason and "nan_guard=run-time" in reason, reason
    assert "not deterministic" not in reason, reason
    large = _static_dql_model([8])
    x = _f32(0.0, 2.5, 0.0, 0.0, -3.0, np.nan, np.nan, -1.0)
    report = verify(
        large, onnx_qrewrite.rewrite(large).model, inputs=[Sample("nan", {"x": x})], localize_failures=False
    )
    assert "not deterministic" in report.to_dict().get("inconclusive_reason", ""), report.to_dict()


def test_nan_guard_keeps_templates_apart():
    """Small and large quantizers in one model get their own structure (template stamping)."""
    graph = helper.make_graph(
        [
            helper.make_node("DynamicQuantizeLinear", ["a"], ["ya", "sa", "za"], name="small"),
            helper.make_node("DynamicQuantizeLinear", ["b"], ["yb", "sb", "zb"], name="large"),
        ],
        "g",
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, [3]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, [16]),
        ],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, []) for n in ("sa", "sb")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    rewritten = onnx_qrewrite.rewrite(model).model
    assert op_types(rewritten).count("IsNaN") == 3  # small: guard + zero point; large: zero point only
    got = run(rewritten, {"a": _f32(np.nan, np.nan, np.nan), "b": np.arange(16, dtype=np.float32)})
    assert got["sa"] == np.float32(1.0) and got["sb"] == np.float32(15 / 255)
