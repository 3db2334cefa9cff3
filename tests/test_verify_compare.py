"""Element-wise comparison and tolerance options."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from onnx_qrewrite.errors import UsageError
from onnx_qrewrite.verify.compare import (
    DEFAULT_FLOAT_TOLERANCES,
    Tolerance,
    Tolerances,
    compare_values,
    merge_comparisons,
)

EXACT = Tolerance(0.0, 0.0, 0)


def test_integers_must_match_exactly_and_the_worst_element_is_reported():
    a = np.array([[1, -128], [127, 5]], np.int8)
    b = np.array([[1, 127], [127, 6]], np.int8)
    c = compare_values("q", "s0", a, b, EXACT)
    assert c.integer and not c.passed
    assert (c.mismatches, c.exact_matches, c.elements) == (2, 2, 4)
    assert c.max_abs_error == 255.0  # no int8 wrap-around in the difference
    assert (c.worst.sample, c.worst.index, c.worst.original, c.worst.rewritten) == ("s0", (0, 1), -128, 127)


def test_lsb_allows_off_by_n_for_integers():
    a = np.array([0, 10, 4294967295], np.uint32)
    b = np.array([1, 9, 4294967294], np.uint32)
    assert not compare_values("q", "s", a, b, EXACT).passed
    c = compare_values("q", "s", a, b, Tolerance(0.0, 0.0, 1))
    assert c.passed and c.exact_matches == 0 and c.max_abs_error == 1.0


def test_floats_use_atol_plus_rtol_times_the_original():
    a = np.array([1.0, 100.0], np.float32)
    b = np.array([1.0 + 2**-20, 100.0 + 2**-10], np.float32)  # errors 9.5e-7 and 9.8e-4
    assert compare_values("f", "s", a, b, Tolerance(1e-6, 0.0, 0)).mismatches == 1
    assert compare_values("f", "s", a, b, Tolerance(1e-6, 1e-5, 0)).passed  # 1e-5 * 100 covers 9.8e-4


def test_nan_and_inf_at_the_same_place_match_exactly_and_are_counted():
    a = np.array([np.nan, np.inf, -np.inf, 2.0, 0.0], np.float32)
    b = np.array([np.nan, np.inf, -np.inf, np.nan, 1e-7], np.float32)
    c = compare_values("f", "s", a, b, Tolerance(1e-6, 0.0, 0))
    assert (c.nan_original, c.nan_rewritten, c.inf_original, c.inf_rewritten) == (1, 2, 2, 2)
    assert c.mismatches == 1  # NaN on one side only; 1e-7 vs 0 is within atol
    assert c.exact_matches == 3 and c.exact_match_rate == pytest.approx(0.6)
    assert c.worst.index == (3,) and c.max_abs_error == float("inf")


def test_opposite_infinities_are_a_mismatch():
    c = compare_values("f", "s", np.array([np.inf]), np.array([-np.inf]), Tolerance(1e9, 1e9, 0))
    assert c.mismatches == 1


def test_bfloat16_values_are_compared_as_floats():
    a = np.array([1.0, 2.0], ml_dtypes.bfloat16)
    b = np.array([1.0, 2.015625], ml_dtypes.bfloat16)  # one bf16 ulp at 2
    c = compare_values("b", "s", a, b, Tolerances().for_value("b", a.dtype))
    assert not c.integer and c.passed and c.exact_matches == 1
    assert not compare_values("b", "s", a, b, EXACT).passed


def test_dtype_or_shape_differences_are_problems_not_statistics():
    a = np.zeros((2, 3), np.float32)
    assert "dtype differs" in compare_values("v", "s", a, a.astype(np.float16), EXACT).problem
    c = compare_values("v", "s", a, np.zeros((3, 2), np.float32), EXACT)
    assert c.problem == "shape differs: original [2, 3], rewritten [3, 2]" and not c.passed


def test_merging_samples_adds_counts_and_keeps_the_worst_element():
    a = np.zeros(4, np.float32)
    first = compare_values("v", "one", a, a + np.float32(0.5), EXACT)
    second = compare_values("v", "two", a, a + np.array([0, 0, 3, 0], np.float32), EXACT)
    merged = merge_comparisons([first, second])
    assert (merged.elements, merged.mismatches, merged.exact_matches) == (8, 5, 3)
    assert merged.worst.sample == "two" and merged.worst.index == (2,) and merged.max_abs_error == 3.0
    assert merged.failed_samples == ("one", "two")


def test_tolerance_options_take_a_default_and_per_output_values():
    t = Tolerances.from_options(atol=["1e-6", "logits:0:1e-3"], rtol=["out:0.5"], lsb=["2", "yq:0"])
    assert t.for_value("logits:0", np.dtype(np.float32)) == Tolerance(1e-3, DEFAULT_FLOAT_TOLERANCES["float32"][1], 2)
    assert t.for_value("out", np.dtype(np.float32)) == Tolerance(1e-6, 0.5, 2)
    assert t.for_value("yq", np.dtype(np.int8)).lsb == 0
    assert t.output_names() == {"logits:0", "out", "yq"}


def test_default_float_tolerances_depend_on_the_dtype():
    t = Tolerances()
    assert t.for_value("x", np.dtype(np.float16)) == Tolerance(*DEFAULT_FLOAT_TOLERANCES["float16"], 0)
    assert t.for_value("x", np.dtype(ml_dtypes.bfloat16)).atol == DEFAULT_FLOAT_TOLERANCES["bfloat16"][0]


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("atol", "abc", "--atol: expected a number or NAME:VALUE, got 'abc'"),
        ("rtol", "logits:-1", "--rtol: must be a finite value >= 0, got 'logits:-1'"),
        ("atol", "nan", "--atol: must be a finite value >= 0, got 'nan'"),
        ("lsb", "0.5", "--lsb: expected an integer or NAME:VALUE, got '0.5'"),
        ("atol", ":1e-3", "--atol: empty output name in ':1e-3'"),
    ],
)
def test_bad_tolerance_options_are_usage_errors_naming_the_option(option, value, message):
    with pytest.raises(UsageError) as info:
        Tolerances.from_options(**{option: [value]})
    assert str(info.value) == message
