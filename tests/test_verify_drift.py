"""Approximate rewrites are judged by end-to-end drift (relative L2, cosine, argmax agreement, max
abs) against documented thresholds; exact and bounded ones keep the element-wise checks.

The approximate rewrite here is the weight-only form of a quantize_dynamic model (onnxruntime's own
quantizer made ``sample_models/dynamic_mlp.onnx``), made by the graph edit of
``benchmarks/drift.py``, the script the default thresholds were measured with."""

from __future__ import annotations

import importlib.util
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import jsonschema
import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from conftest import SAMPLES

from onnx_qrewrite.cli import main
from onnx_qrewrite.errors import EXIT_DISAGREE, EXIT_OK, UsageError
from onnx_qrewrite.verify import SCHEMA_PATH, DriftThresholds, verify
from onnx_qrewrite.verify.drift import (
    DEFAULT_ARGMAX,
    DEFAULT_COSINE,
    DEFAULT_REL_L2,
    DriftThreshold,
    is_classifier_shaped,
    measure_drift,
    merge_drifts,
)

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "drift.py"
_spec = importlib.util.spec_from_file_location("benchmarks_drift", _PATH)
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench
_spec.loader.exec_module(bench)

MLP = SAMPLES / "dynamic_mlp.onnx"
SCHEMA = json.loads(SCHEMA_PATH.read_text())


def _nodes(model: onnx.ModelProto) -> list[str]:
    return [n.name for n in model.graph.node if n.op_type == "MatMulInteger"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("drift")
    original = onnx.load(MLP)
    first, last = _nodes(original)[0], _nodes(original)[-1]
    made = {
        "weight_only": bench.weight_only(original),
        "zp_dropped": bench.weight_only(original, drop_zp=last),
        "scale_x1.25": bench.weight_only(original, break_scale=first, factor=1.25),
    }
    paths = {"original": MLP}
    for name, model in made.items():
        paths[name] = folder / f"{name}.onnx"
        onnx.save(model, paths[name])
    unmarked = onnx.load(paths["weight_only"])
    for node in unmarked.graph.node:
        del node.metadata_props[:]
    paths["weight_only_unmarked"] = folder / "weight_only_unmarked.onnx"
    onnx.save(unmarked, paths["weight_only_unmarked"])
    return paths


# -- the statistics --------------------------------------------------------------------------------


def test_the_statistics_are_the_documented_formulas():
    a = np.array([[3.0, 4.0], [1.0, -2.0]], np.float32)
    b = np.array([[3.0, 4.5], [-1.0, -2.0]], np.float32)
    d = measure_drift("s", a, b, DriftThreshold(), 2.0)
    diff = (a - b).astype(np.float64)
    assert d.rel_l2 == pytest.approx(np.linalg.norm(diff) / np.linalg.norm(a.astype(np.float64)))
    cos = float(np.dot(a.ravel(), b.ravel())) / (np.linalg.norm(a) * np.linalg.norm(b))
    assert d.cosine == pytest.approx(cos)
    # row 0: argmax 1 on both sides; row 1: argmax 0 (1.0) against 0 (-1.0 > -2.0): both agree
    assert (d.argmax_agree, d.argmax_rows) == (2, 2)
    flipped = measure_drift("s", a, np.array([[4.0, 3.0], [1.0, -2.0]], np.float32), DriftThreshold(), 1.0)
    assert (flipped.argmax_agree, flipped.argmax_rows, flipped.argmax_agreement) == (1, 2, 0.5)


def test_defaults_are_the_documented_ones():
    t = DriftThresholds().for_value("any")
    assert (t.rel_l2, t.cosine, t.argmax, t.max_abs) == (DEFAULT_REL_L2, DEFAULT_COSINE, DEFAULT_ARGMAX, None)
    assert (DEFAULT_REL_L2, DEFAULT_COSINE, DEFAULT_ARGMAX) == (0.05, 0.999, 0.8)


@pytest.mark.parametrize(
    ("dtype", "shape", "expected"),
    [
        (np.float32, (4, 10), True),
        (np.float32, (1, 16, 32), True),
        (np.float16, (2, 3), True),
        (np.float32, (4, 1), False),  # one score per row: no argmax to agree on
        (np.float32, (10,), False),  # a vector, not rows of scores
        (np.int64, (4, 10), False),  # class ids or tokens, not scores
    ],
)
def test_classifier_shaped_outputs_are_floating_rows_of_scores(dtype, shape, expected):
    assert is_classifier_shaped(np.dtype(dtype), shape) is expected


def test_zeros_on_both_sides_agree_and_zeros_against_values_do_not():
    zeros = np.zeros((2, 3), np.float32)
    same = measure_drift("s", zeros, zeros, DriftThreshold(), 0.0)
    assert same.passed and same.rel_l2 == 0.0 and same.cosine == 1.0
    other = measure_drift("s", zeros, np.ones((2, 3), np.float32), DriftThreshold(), 1.0)
    assert not other.passed and other.rel_l2 == np.inf and other.cosine == 0.0


def test_a_one_sided_nan_fails_whatever_the_thresholds():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = a.copy()
    b[0, 1] = np.nan
    d = measure_drift("s", a, b, DriftThreshold(rel_l2=1e9, cosine=0.0, argmax=0.0), np.inf)
    assert not d.passed and d.one_sided_non_finite == 1
    both = a.copy()
    both[0, 1] = np.nan
    assert measure_drift("s", both, both.copy(), DriftThreshold(), 0.0).passed  # NaN in the same place


def test_undefined_elements_take_no_part_in_the_statistics():
    """Elements the original's kernel leaves undefined (verify sets them to 0 on both sides) are
    measured nowhere: not in an argmax, where a filler 0 beat written negative scores and hid a
    rewrite that swapped keys 0 and 1 (every row "agreed" at the first undefined key), and a row
    with none defined is not compared; rel L2 and cosine are those of the defined elements."""
    a = np.array([[-1.0, -2.0, 0.0, 0.0], [-3.0, -1.0, -2.0, 0.0], [0.0, 0.0, 0.0, 0.0]], np.float32)
    b = a[:, [1, 0, 2, 3]]  # keys 0 and 1 swapped
    undefined = np.array([[False, False, True, True], [False, False, False, True], [True] * 4])
    whole_rows = measure_drift("s", a, b, DriftThreshold(), 1.0)
    assert (whole_rows.argmax_agree, whole_rows.argmax_rows) == (3, 3)  # the fault the mask fixes
    d = measure_drift("s", a, b, DriftThreshold(), 1.0, undefined=undefined)
    assert (d.argmax_agree, d.argmax_rows) == (0, 2) and not d.passed
    defined_a, defined_b = a[~undefined].astype(np.float64), b[~undefined].astype(np.float64)
    assert d.rel_l2 == pytest.approx(np.linalg.norm(defined_a - defined_b) / np.linalg.norm(defined_a))
    cos = np.dot(defined_a, defined_b) / (np.linalg.norm(defined_a) * np.linalg.norm(defined_b))
    assert d.cosine == pytest.approx(cos)
    assert (d.rel_l2, d.cosine) == (whole_rows.rel_l2, whole_rows.cosine)  # zeros on both sides add nothing
    # Whatever the undefined elements hold, they change nothing (verify passes them as 0s, but
    # measure_drift does not rely on it).
    garbage = np.where(undefined, np.float32(1e6), b)
    assert measure_drift("s", a, garbage, DriftThreshold(), 1.0, undefined=undefined) == d
    # A mask that broadcasts (one per key) and leaves nothing undefined: the whole-row answer.
    none = measure_drift("s", a, b, DriftThreshold(), 1.0, undefined=np.zeros(4, bool))
    assert none == whole_rows


def test_over_samples_the_worst_rel_l2_and_cosine_count_and_argmax_rows_pool():
    a = np.array([[1.0, 0.0]], np.float32)
    good = measure_drift("good", a, np.array([[1.0, 0.01]], np.float32), DriftThreshold(), 0.01)
    bad = measure_drift("bad", a, np.array([[0.0, 1.0]], np.float32), DriftThreshold(), 1.0)
    merged = merge_drifts([good, bad])
    assert (merged.rel_l2_sample, merged.cosine_sample) == ("bad", "bad")
    assert (merged.argmax_agree, merged.argmax_rows) == (1, 2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cosine": ["1.5"]}, "--drift-cosine: must be between 0 and 1"),
        ({"argmax": ["out:2"]}, "--drift-argmax: must be between 0 and 1"),
        ({"rel_l2": ["-1"]}, "--drift-rel-l2: must be a finite value >= 0"),
        ({"max_abs": ["x"]}, "--drift-atol: expected a number or NAME:VALUE"),
        ({"mode": "sometimes"}, "--drift: expected one of auto, always, never"),
    ],
)
def test_bad_thresholds_are_usage_errors_naming_the_option(kwargs, message):
    with pytest.raises(UsageError, match=message):
        DriftThresholds.from_options(**kwargs)


# -- verify ----------------------------------------------------------------------------------------


def test_a_weight_only_rewrite_is_judged_by_drift_and_passes(models):
    report = verify(models["original"], models["weight_only"])
    assert report.passed and report.exit_code == EXIT_OK, report.to_table()
    decision = report.settings.drift_decision
    assert decision.judged and decision.approximate_rules == {"bench.weight-only": 3}
    (logits,) = report.outputs
    assert logits.drift is not None and logits.drift.passed
    assert logits.mismatches > 0  # element by element it differs: that is why drift judges it
    assert 0 < logits.drift.rel_l2 < DEFAULT_REL_L2 and logits.drift.argmax_rows == len(report.samples)
    assert logits.worst is not None and logits.worst.original != logits.worst.rewritten
    table = report.to_table()
    assert "outputs judged by drift (approximate rules bench.weight-only x3)" in table
    assert "drift: rel L2 " in table and "judged by drift (approximate rewrite)" in report.summary


def test_element_wise_the_same_rewrite_fails(models):
    report = verify(models["original"], models["weight_only"], drift=DriftThresholds(mode="never"))
    assert report.exit_code == EXIT_DISAGREE and report.outputs[0].drift is None


@pytest.mark.parametrize("broken", ["zp_dropped", "scale_x1.25"])
def test_a_broken_approximate_rewrite_drifts_beyond_the_thresholds_and_is_localised(models, broken):
    report = verify(models["original"], models[broken])
    assert report.exit_code == EXIT_DISAGREE, report.to_table()
    (logits,) = report.outputs
    assert logits.drift is not None and logits.drift.failures
    assert any(f.startswith("rel L2 ") for f in logits.drift.failures)
    original = onnx.load(models["original"])
    culprit = _nodes(original)[-1] if broken == "zp_dropped" else _nodes(original)[0]
    loc = report.localization
    assert loc is not None and loc.found and loc.origin == culprit, report.to_table()
    assert loc.rule == "bench.weight-only" and loc.comparison.drift is not None
    assert not loc.comparison.drift.passed


def test_thresholds_are_overridable_globally_and_per_output(models):
    tight = verify(models["original"], models["weight_only"], drift=DriftThresholds(rel_l2=1e-4))
    assert tight.exit_code == EXIT_DISAGREE
    per_output = DriftThresholds.from_options(rel_l2=["1e-4", "logits:0.05"])
    assert verify(models["original"], models["weight_only"], drift=per_output).passed
    with pytest.raises(UsageError, match="--drift-\\*: the model has no output named 'nope'"):
        verify(models["original"], models["weight_only"], drift=DriftThresholds.from_options(cosine=["nope:0.9"]))


def test_a_max_abs_threshold_is_judged_only_when_given(models):
    report = verify(models["original"], models["weight_only"], drift=DriftThresholds(max_abs=1e-3))
    assert report.exit_code == EXIT_DISAGREE
    assert any(f.startswith("max abs ") for f in report.outputs[0].drift.failures)


def test_without_provenance_auto_cannot_see_it_and_always_judges_it(models):
    unseen = verify(models["original"], models["weight_only_unmarked"])
    assert unseen.exit_code == EXIT_DISAGREE and not unseen.settings.drift_decision.judged
    forced = verify(models["original"], models["weight_only_unmarked"], drift=DriftThresholds(mode="always"))
    assert forced.passed and forced.settings.drift_decision.approximate_rules == {}
    assert "(--drift always)" in forced.to_table()


def test_an_engine_rewrite_with_approximate_rules_is_detected_from_its_provenance():
    from onnx_qrewrite import rewrite
    from onnx_qrewrite.rewriter.catalogue import named_form

    path = SAMPLES / "qdq_contrib_u16.onnx"
    standard = rewrite(path).model
    form = ["qdq-to-float-fold-weights", "qdq-to-float-drop-dq", "qdq-to-float-drop-q"]
    floated = rewrite(
        standard, rules=[named_form("qdq-to-float")], only=form, allow=("exact", "bounded", "approximate")
    )
    report = verify(path, floated.model, localize_failures=False)
    assert report.settings.drift_decision.approximate_rules == {"qdq-to-float-drop-dq": 8}
    assert all(o.drift is not None for o in report.outputs)


def test_exact_rewrites_keep_the_element_wise_check(models):
    report = verify(models["original"], onnx.load(models["original"]))  # the same model, not the same file
    assert not report.settings.drift_decision.judged and report.outputs[0].drift is None


# -- reports and the command line ------------------------------------------------------------------


def test_the_json_report_validates_and_carries_the_drift(models, tmp_path):
    passing = verify(models["original"], models["weight_only"]).to_dict()
    failing = verify(models["original"], models["zp_dropped"]).to_dict()
    for data in (passing, failing):
        jsonschema.Draft202012Validator(SCHEMA).validate(data)
    settings = passing["settings"]["drift"]
    assert settings["judged"] and settings["approximate_rules"] == {"bench.weight-only": 3}
    assert (settings["rel_l2"], settings["cosine"], settings["argmax"]) == (0.05, 0.999, 0.8)
    drift = passing["outputs"][0]["drift"]
    assert drift["verdict"] == "passed" and drift["failures"] == [] and drift["argmax_agreement"] == 1.0
    assert failing["outputs"][0]["drift"]["verdict"] == "failed" and failing["outputs"][0]["drift"]["failures"]
    assert failing["localization"]["comparison"]["drift"]["verdict"] == "failed"


def test_the_cli_takes_the_drift_options_and_exits_by_the_drift(models, tmp_path):
    def run(*args):
        return CliRunner().invoke(main, ["verify", str(models["original"]), *map(str, args)])

    junit = tmp_path / "r.xml"
    ok = run(models["weight_only"], "--junit", junit)
    assert ok.exit_code == EXIT_OK, ok.output
    props = {p.get("name"): p.get("value") for p in ET.parse(junit).iter("property")}
    assert props["drift"].startswith("outputs judged by drift (approximate rules bench.weight-only x3)")
    tight = run(models["weight_only"], "--drift-rel-l2", "1e-4", "--drift-cosine", "0.9999999", "--junit", junit)
    assert tight.exit_code == EXIT_DISAGREE
    failure = next(ET.parse(junit).iter("failure"))
    assert failure.get("message").startswith("drift beyond thresholds: rel L2 ")
    assert run(models["weight_only"], "--drift", "never").exit_code == EXIT_DISAGREE
    bad = run(models["weight_only"], "--drift-argmax", "1.5")
    assert bad.exit_code == 2 and "--drift-argmax: must be between 0 and 1" in bad.output


def test_the_weight_only_rule_form_is_judged_by_drift_and_drifts_as_the_benchmarks_edit(models):
    """The "weight-only" named form, as a user runs it (--form weight-only --allow-approximate):
    verify sees its approximate rules, passes it within the defaults, and it drifts exactly as the
    graph edit of benchmarks/drift.py whose broken variants set the defaults."""
    from onnx_qrewrite import rewrite
    from onnx_qrewrite.rewriter.catalogue import named_form

    form = rewrite(MLP, rules=[named_form("weight-only")], allow=("exact", "bounded", "approximate")).model
    by_form = verify(MLP, form)
    assert by_form.passed and by_form.settings.drift_decision.approximate_rules == {"weight-only-matmul": 3}
    by_edit = verify(MLP, models["weight_only"])
    assert by_form.outputs[0].drift.rel_l2 == pytest.approx(by_edit.outputs[0].drift.rel_l2, rel=1e-6)
    assert by_form.outputs[0].drift.cosine == pytest.approx(by_edit.outputs[0].drift.cosine, rel=1e-9)
