"""A profile's [[differs]] entries: nodes a target runs but computes otherwise than onnxruntime
(observed), which `inspect --target` names without refusing them. No runtime needed: the
observations behind the shipped entries are benchmarks/target_experiments.py tflite-add-ties and
qnn-dynamic, and tests/test_targets_runtime.py's verify on QNN."""

from __future__ import annotations

import importlib.util
import json
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import onnx
import pytest
from _cli_helpers import cli_in_process
from conftest import SAMPLES

from onnx_qrewrite.targets import load_target
from onnx_qrewrite.targets.check import _tie_reachable, check_model, computed_differently


def _experiments():
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "target_experiments.py"
    spec = importlib.util.spec_from_file_location("benchmarks_target_experiments", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("constant", [True, False])
def test_a_qlinear_add_whose_ties_litert_rounds_otherwise_is_named_not_refused(constant):
    """Scales 0.02 and 0.03 over 0.04 make exact ties k + 1/2 reachable, which LiteRT rounds
    otherwise than onnxruntime (measured: tflite-add-ties); calibrated-looking scales do not."""
    make = _experiments()._qlinear_add
    profile = load_target("tflite")
    ties = make((0.02, 0.03, 0.04), constant)
    (differs,) = computed_differently(ties, profile)
    assert differs.node == "add" and "exact ties k + 1/2 reachable" in differs.reasons[0]
    assert "[tflite/observed-here]" in differs.reasons[0]
    assert check_model(ties, profile) == []  # runs: not a refusal
    assert computed_differently(make((0.0123, 0.0371, 0.0297), constant), profile) == []


def test_exact_ties_are_solved_not_sampled():
    half, quarter = Fraction(1, 2), Fraction(3, 4)
    full = list(range(-128, 128))
    assert _tie_reachable(half, full, quarter, full)
    assert not _tie_reachable(Fraction(1), full, Fraction(2), full)  # integers only: no tie
    assert not _tie_reachable(half, [0, 2, 4], Fraction(1), [1, 3])  # even multiples of 1/2 only
    assert _tie_reachable(half, [0, 2, 5], Fraction(1), [1, 3])  # 5/2 + 1
    f32 = [Fraction(float(np.float32(v))) for v in (0.0123, 0.0371, 0.0297)]  # the model's float32 scales
    assert not _tie_reachable(f32[0] / f32[2], full, f32[1] / f32[2], full)


def test_exact_ties_agree_with_trying_every_pair():
    """The congruence against the plain search over every operand pair, on ratios with small
    denominators (where ties come and go) and constant operands' value sets."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        ratios = [Fraction(int(rng.integers(-40, 40)), int(rng.integers(1, 13))) for _ in range(2)]
        a_values = sorted({int(v) for v in rng.integers(-20, 20, int(rng.integers(1, 12)))})
        b_values = sorted({int(v) for v in rng.integers(-20, 20, int(rng.integers(1, 12)))})
        if rng.random() < 0.5:
            a_values = list(range(a_values[0], a_values[0] + 30))
        brute = any((i * ratios[0] + j * ratios[1]).denominator == 2 for i in a_values for j in b_values)
        assert _tie_reachable(ratios[0], a_values, ratios[1], b_values) == brute, (ratios, a_values, b_values)


def test_inspect_names_each_dynamic_quantize_linear_qnn_computes_in_float(tmp_path):
    """QNN's HTP runs quantize_dynamic's groups on the float activation (qnn-dynamic): inspect says
    so at each DynamicQuantizeLinear it keeps, in its text and its JSON, and still exits 0."""
    model = SAMPLES / "dynamic_mlp.onnx"
    proc = cli_in_process("inspect", model, "--target", "qnn", "--input-shape", "batch=1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("runs, computed otherwise than in onnxruntime") == 3
    assert "without its 8-bit quantization" in proc.stdout
    proc = cli_in_process("inspect", model, "--target", "qnn", "--input-shape", "batch=1", "--json")
    body = json.loads(proc.stdout)
    assert [d["op"] for d in body["computed_differently"]] == ["DynamicQuantizeLinear"] * 3
    assert computed_differently(onnx.load(model), load_target("tract")) == []  # no entry: nothing said
