"""Deliberately broken rewrites are caught (exit 1) and localised to the broken node; the same
rewrites without the bug pass, so each failure is the bug's doing and not the verifier's."""

from __future__ import annotations

import onnx
import pytest
from _verify_helpers import (
    ORIGIN_KEY,
    TOY_BREAKS,
    TOY_BROKEN_ORIGIN,
    dql_model,
    expand_dql,
    quark_to_standard,
    scale_ulp_inputs,
    toy_quark_model,
    toy_rewrite,
)
from conftest import REAL_MODELS

from onnx_qrewrite.errors import EXIT_DISAGREE, EXIT_OK
from onnx_qrewrite.verify import verify

QUARK_A16W8 = REAL_MODELS / "quark_cnn_op17_a16w8_ext.onnx"


def _inputs_for(broken: str | None) -> dict:
    # A one-ulp scale change moves only values sitting on a rounding tie: random inputs almost
    # never do, so that case runs on inputs made to sit there.
    return {"inputs": scale_ulp_inputs()} if broken == "scale-ulp" else {}


@pytest.mark.parametrize("inputs", ["generated", "scale-ulp ties"])
def test_the_correct_toy_rewrite_agrees(inputs):
    original = toy_quark_model()
    report = verify(original, toy_rewrite(original), **_inputs_for("scale-ulp" if inputs != "generated" else None))
    assert report.passed and report.exit_code == EXIT_OK, report.to_table()
    assert report.localization is None
    assert all(o.exact_match_rate == 1.0 for o in report.outputs)


@pytest.mark.parametrize("broken", TOY_BREAKS)
def test_a_broken_toy_rewrite_is_caught_and_localised(broken):
    original = toy_quark_model()
    rewritten = toy_rewrite(original, broken)
    report = verify(original, rewritten, **_inputs_for(broken))
    assert not report.passed and report.exit_code == EXIT_DISAGREE
    assert {o.name for o in report.outputs if not o.passed} == {"y", "yq"}
    loc = report.localization
    assert loc is not None and loc.found, report.to_table()
    assert loc.origin == TOY_BROKEN_ORIGIN[broken]
    node = next(n for n in rewritten.graph.node if n.name == loc.node)
    assert {p.key: p.value for p in node.metadata_props}[ORIGIN_KEY] == loc.origin
    # The node named is the one producing the first value both models share that differs.
    assert loc.comparison.name == {"qx": "xq", "dqw": "wd", "qy": "yq"}[loc.origin]
    assert f"first differing node {loc.node!r} (rule {loc.rule})" in report.summary


def test_a_broken_rewrite_is_localised_on_a_sample_that_fails():
    original = toy_quark_model()
    report = verify(original, toy_rewrite(original, "round-clip"))
    # Round-before-Clip only matters where values saturate: the wide-range battery sample does.
    failing = set(report.outputs[0].failed_samples)
    assert "wide-range" in failing
    assert report.localization.sample in failing


def test_the_guarded_dql_expansion_agrees_with_onnxruntimes_kernel():
    original = dql_model()
    report = verify(original, expand_dql(original))
    assert report.passed, report.to_table()


def test_a_dql_expansion_without_the_zero_range_guard_is_caught_by_the_zeros_sample():
    original = dql_model()
    report = verify(original, expand_dql(original, zero_range_guard=False))
    assert not report.passed
    by_name = {o.name: o for o in report.outputs}
    assert by_name["y"].passed  # y is the same; the scale (1.0 vs 0.0) and zero point are not
    assert set(by_name["y_scale"].failed_samples) == {"zeros"}
    assert by_name["y_scale"].worst.original == 1.0 and by_name["y_scale"].worst.rewritten == 0.0
    loc = report.localization
    assert (loc.sample, loc.comparison.name, loc.op_type, loc.rule, loc.origin) == (
        "zeros",
        "y_scale",
        "Div",
        "test.dql-expand",
        "dql",
    )


def test_without_the_battery_the_missing_guard_goes_unnoticed():
    # Why the battery exists: random data never has max == min.
    original = dql_model()
    report = verify(original, expand_dql(original, zero_range_guard=False), battery=False, samples=3)
    assert report.passed


def test_a_real_quark_model_rewritten_by_hand_agrees():
    original = onnx.load(QUARK_A16W8)
    report = verify(original, quark_to_standard(original))
    assert report.passed, report.to_table()
    assert report.settings.reference_kernels and report.settings.vendor_nodes == 22


def test_a_zero_point_off_by_one_in_a_real_model_is_localised():
    original = onnx.load(QUARK_A16W8)
    report = verify(original, quark_to_standard(original, bump_zero_point_of="input_QuantizeLinear"))
    assert report.exit_code == EXIT_DISAGREE
    loc = report.localization
    assert (loc.node, loc.origin, loc.rule) == (
        "input_QuantizeLinear_std",
        "input_QuantizeLinear",
        "test.quark-to-standard",
    )
    assert loc.comparison.integer and loc.comparison.name == "input_QuantizeLinear_Output"
