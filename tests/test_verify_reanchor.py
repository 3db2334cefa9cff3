"""verify's re-anchored reference for bounded rewrites (onnx_qrewrite/verify/reanchor.py).

A bounded replacement may change its node's value within its bound; downstream, that difference
grows past the exact-rewrite tolerance (the "qdq" form's MLP: 3.6e-5 relative at the output on
verify's wide-range sample), so the outputs are compared with the original re-run from the
rewritten model's own values at its bounded replacements, at the default tolerances, and each
bounded value of the rewritten model is checked against the original kernel on the inputs that run
gives it. Here: the real producer models' "qdq" rewrites pass at the default tolerances; broken
rewrites still fail and are named (a bounded node's scale or zero point, an exact node after the
last bounded one, an exact node between two bounded ones); explicit tolerances keep their meaning.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import onnx_qrewrite
from onnx_qrewrite.errors import EXIT_DISAGREE
from onnx_qrewrite.rewriter.catalogue import load_catalogue, named_form
from onnx_qrewrite.verify import SCHEMA_PATH, Tolerances, verify
from onnx_qrewrite.verify.reanchor import ORIGINAL_SUFFIX, cut_at

FORM = load_catalogue([named_form("qdq")])


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[Path, onnx.ModelProto]]:
    """name -> (the producer's model, its "qdq" form rewrite)."""
    from test_weight_only_models import _producer_models

    found = _producer_models(tmp_path_factory.mktemp("reanchor"))
    return {name: (path, onnx_qrewrite.rewrite(path, rules=FORM).model) for name, path in found.items()}


def _outputs(report):
    return report.rows("output")


def _boundary_rows(report):
    return report.rows("value-read")


def _bound_rows(report):
    return report.rows("bound")


def test_rows_have_the_role_their_names_say(models):
    """Each row's role matches what its label shows (outputs plain, bounds '(node ...', values read
    '(read by the replacement of ...'), and every row has one of the three."""
    original, rewritten = models["mlp-u8"]
    report = verify(original, rewritten, samples=2)
    assert [o.name for o in _outputs(report)] == ["y"]
    assert all("(node " in o.name for o in _bound_rows(report)) and len(_bound_rows(report)) == 4
    assert all("(read by the replacement of " in o.name for o in _boundary_rows(report))
    assert len(_boundary_rows(report)) == 12
    assert len(report.outputs) == 1 + 4 + 12


def test_the_summary_counts_outputs_apart_from_the_checked_values(models):
    """The MLP has one output; the 4 bounded replacements and the 12 values they read are checked
    too, and said so, not counted as outputs (it once said "17 outputs agree"). The JSON report has
    the same counts and each row's role."""
    original, rewritten = models["mlp-u8"]
    report = verify(original, rewritten, samples=2)
    assert report.summary == (
        "PASSED | 1 output agrees on 6 samples (opt-level disable); 1 against the re-anchored original "
        "(bounded rewrites); also checked: 4 bounded replacements within their bounds, 12 values the bounded "
        "replacements read"
    )
    data = report.to_dict()
    assert data["counts"] == {
        "output": {"checked": 1, "failed": 0},
        "bound": {"checked": 4, "failed": 0},
        "value-read": {"checked": 12, "failed": 0},
    }
    assert [o["role"] for o in data["outputs"]] == [o.role for o in report.outputs]
    table = report.to_table().splitlines()
    assert any(line.startswith("output / checked value  ") for line in table), report.to_table()
    jsonschema.Draft202012Validator(json.loads(SCHEMA_PATH.read_text())).validate(json.loads(json.dumps(data)))


@pytest.mark.parametrize("name", ["mlp-u8", "mlp-s8-per-channel-fused", "cnn-u8", "cnn", "bert", "bert-fused"])
def test_qdq_form_rewrites_verify_at_the_default_tolerances(models, name):
    original, rewritten = models[name]
    report = verify(original, rewritten, samples=2)
    assert report.passed, report.to_table()
    assert _bound_rows(report) and _boundary_rows(report)
    assert all(o.reference == "re-anchored" for o in _boundary_rows(report))
    for output in _outputs(report):
        assert output.reference == "re-anchored" and output.against_original is not None, output
    data = report.to_dict()
    assert data["settings"]["re_anchored_at"]
    assert {o["reference"] for o in data["outputs"] if "(node " not in o["name"]} == {"re-anchored"}
    assert "re-anchored" in report.summary and "vs original (informational)" in report.to_table()


def test_the_mlp_is_why_a_plain_comparison_cannot_decide(models):
    """The case this exists for, measured: against the plain original at the default tolerance the
    MLP's output differs (float32 accumulation near cancellation on the wide-range sample) though
    every bounded node is within its bound; with the reference the user's explicit tolerance asks
    for (the plain original), it fails as before."""
    original, rewritten = models["mlp-u8"]
    report = verify(original, rewritten, samples=2)
    (y,) = _outputs(report)
    assert y.passed and y.against_original is not None and y.against_original.mismatches > 0
    explicit = verify(original, rewritten, samples=2, tolerances=Tolerances(rtol=1e-5))
    (plain,) = _outputs(explicit)
    assert plain.reference == "original" and plain.against_original is None
    assert explicit.exit_code == EXIT_DISAGREE and not plain.passed


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy


def _replace_initializer(model: onnx.ModelProto, node: onnx.NodeProto, index: int, value: np.ndarray) -> None:
    name = f"{node.input[index]}_broken"
    model.graph.initializer.append(numpy_helper.from_array(value, name))
    node.input[index] = name


def _initializer(model: onnx.ModelProto, name: str) -> np.ndarray:
    return numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == name))


@pytest.mark.parametrize("how", ["weight scale 1% off", "weight zero point dropped"])
@pytest.mark.parametrize("name", ["mlp-u8", "cnn-u8"])
def test_a_broken_bounded_node_still_fails_at_its_node(models, name, how):
    original, rewritten = models[name]
    broken = _copy(rewritten)
    dq = next(n for n in broken.graph.node if n.op_type == "DequantizeLinear" and n.name.endswith("DequantizeWeights"))
    if how == "weight scale 1% off":
        _replace_initializer(broken, dq, 1, (_initializer(broken, dq.input[1]) * np.float32(1.01)).astype(np.float32))
    else:
        assert len(dq.input) == 3 and np.any(_initializer(broken, dq.input[2]) != 0)
        del dq.input[2]
    report = verify(original, broken, samples=2)
    assert report.exit_code == EXIT_DISAGREE
    failing = [o for o in report.outputs if not o.passed]
    origin = dq.name.rpartition("/")[0]  # the replacement's prefix: the replaced node's name or output
    assert any("(node " in o.name and origin in o.name for o in failing), report.to_table()
    bad = [o for o in _bound_rows(report) if not o.passed]
    assert f"{len(bad)} of {len(_bound_rows(report))} bounded replacements beyond their bounds: " in report.summary
    assert report.to_dict()["counts"]["bound"] == {"checked": len(_bound_rows(report)), "failed": len(bad)}


def test_a_broken_exact_node_after_the_last_bounded_one_fails_at_the_output(models):
    """The CNN's bias Add after its last bounded matmul: changed by 1e-4 relative, which a
    hand-tuned rtol 1e-4 against the plain original could not tell from accumulation, fails
    against the re-anchored reference at the default tolerance and is named."""
    original, rewritten = models["cnn"]
    broken = _copy(rewritten)
    add = next(n for n in broken.graph.node if n.name == "head.out")
    bias_index = next(i for i, n in enumerate(add.input) if any(t.name == n for t in broken.graph.initializer))
    bias = _initializer(broken, add.input[bias_index])
    _replace_initializer(broken, add, bias_index, (bias * np.float32(1 + 1e-4)).astype(np.float32))
    report = verify(original, broken, samples=2)
    assert report.exit_code == EXIT_DISAGREE
    (logits,) = _outputs(report)
    assert not logits.passed and logits.reference == "re-anchored", report.to_table()
    assert all(o.passed for o in _bound_rows(report)), report.to_table()
    assert report.localization is not None and report.localization.node == "head.out", report.to_table()


def test_a_broken_exact_node_between_two_bounded_ones_fails_where_the_next_one_reads(models):
    """The MLP's bias Add between two bounded matmuls: the next matmul's output is cut and fed
    with the rewritten model's value, so the break cannot show at the output; it shows in the
    values that matmul reads (the rewritten model's against the cut original's), and localising
    against the cut original names the Add, not a bounded node upstream."""
    original, rewritten = models["mlp-u8"]
    broken = _copy(rewritten)
    add = next(n for n in broken.graph.node if n.op_type == "Add" and "b1" in n.input)
    index = list(add.input).index("b1")
    _replace_initializer(broken, add, index, (_initializer(broken, "b1") + np.float32(0.05)).astype(np.float32))
    report = verify(original, broken, samples=2)
    assert report.exit_code == EXIT_DISAGREE
    failing = [o for o in report.outputs if not o.passed]
    assert failing and all(o in _boundary_rows(report) for o in failing), report.to_table()
    assert all(o.reference == "re-anchored" and "read by the replacement of y" in o.name for o in failing)
    assert report.summary.startswith("FAILED | 0 of 1 outputs differ on 6 samples (opt-level disable); ")
    assert f"; {len(failing)} of 12 values the bounded replacements read differ: {failing[0].name}" in report.summary
    # On the wide-range sample the first bounded matmul already differs from the plain original
    # beyond the default tolerance (within its bound): localised against the plain original, it
    # would be named.
    (wide,) = [s for s in report.samples if s.name == "wide-range"]
    report = verify(original, broken, inputs=[wide])
    assert report.exit_code == EXIT_DISAGREE
    plain = verify(original, rewritten, inputs=[wide], tolerances=Tolerances(rtol=1e-5))
    assert plain.localization is not None and plain.localization.node != add.output[0], plain.to_table()
    assert report.localization is not None and report.localization.node == add.output[0], report.to_table()


def test_the_cut_original_reads_the_anchors_and_keeps_their_producers_renamed(models):
    original_path, _ = models["mlp-u8"]
    original = onnx.load(original_path)
    cut = cut_at(original, {"h1": np.dtype(np.float32)})
    assert "h1" in {i.name for i in cut.graph.input}
    produced = {o for n in cut.graph.node for o in n.output}
    assert "h1" not in produced and "h1" + ORIGINAL_SUFFIX in produced
    assert [n.input for n in cut.graph.node if "h1" in n.input] == [
        n.input for n in original.graph.node if "h1" in n.input
    ]
