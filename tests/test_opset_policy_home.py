"""Opset policy has one home (issue 10): every opset a builder needs, and every op version whose
form it chooses by, is named data in ``kernel_opsets.py``. A number written into a builder or into
a contract's ``opset`` words would drift from that table unseen; this scan catches it, and the
rewrites below show that the table, not a copy of it, decides."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np
import onnx.parser
import pytest
from conftest import op_types, run

import onnx_qrewrite
from onnx_qrewrite.errors import LoweringError
from onnx_qrewrite.rewriter import kernel_opsets
from onnx_qrewrite.rewriter.builders.contracts import CONTRACTS

BUILDERS = Path(onnx_qrewrite.__file__).parent / "rewriter" / "builders"
#: Names a builder keeps an opset in (besides any name containing "opset").
_OPSET_NAMES = {"need", "needed"}
_NUMBER = re.compile(r"\b\d+\b")


def _mentions_opset(node: ast.AST) -> bool:
    """An expression that reads a model's or a plan's opset (not the kernel_opsets table)."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and sub.attr in ("opset", "default_opset", "min_opset"):
            return True
        if (
            isinstance(sub, ast.Name)
            and sub.id != "kernel_opsets"
            and ("opset" in sub.id.lower() or sub.id in _OPSET_NAMES)
        ):
            return True
        if isinstance(sub, ast.Constant) and sub.value == "opset":  # QLinearSoftmax's opset attribute
            return True
    return False


def _literals(node: ast.AST, *, strings: bool = False) -> list[str]:
    """Integer literals other than 0 in ``node`` (and with ``strings``, numbers written in strings);
    indices (``inputs[0][3]``) are not opsets."""
    found = []
    indices = {id(i) for sub in ast.walk(node) if isinstance(sub, ast.Subscript) for i in ast.walk(sub.slice)}
    for sub in ast.walk(node):
        if id(sub) in indices:
            continue
        if isinstance(sub, ast.Constant) and type(sub.value) is int and sub.value != 0:
            found.append(str(sub.value))
        elif strings and isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            found += _NUMBER.findall(sub.value)
    return found


def _is_max_or_min(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("max", "min")


def hard_coded_opsets(source: str, filename: str = "<builder>") -> list[str]:
    """``file:line: N`` for each opset number written in ``source`` instead of read from kernel_opsets."""
    hits: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.keyword) and node.arg == "min_opset":
            hits += [(node.value.lineno, n) for n in _literals(node.value)]
        elif isinstance(node, ast.keyword) and node.arg == "opset":  # a contract's opset in words
            hits += [(node.value.lineno, n) for n in _literals(node.value, strings=True)]
        elif isinstance(node, ast.FunctionDef) and node.name.endswith("_opset"):
            hits += [(node.lineno, n) for n in _literals(node, strings=True)]
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if node.value is not None and any(_mentions_opset(t) for t in targets):
                hits += [(node.lineno, n) for n in _literals(node.value)]
        elif isinstance(node, ast.Compare) and _mentions_opset(node):
            hits += [(node.lineno, n) for n in _literals(node)]
        elif _is_max_or_min(node) and any(_mentions_opset(a) for a in node.args):
            hits += [(node.lineno, n) for a in node.args for n in _literals(a)]
    return [f"{filename}:{line}: {number}" for line, number in sorted(set(hits))]


@pytest.mark.parametrize(
    "snippet",
    [
        "Plan(min_opset=17)",
        "Plan(min_opset=9 if form != 'quick_gelu' else 6)",
        "min_opset = max(min_opset, 11)",
        "FLOAT_EMULATION_MIN_OPSET = 13",
        "need = 13 if mask else 11",
        "probs = op('Softmax', axis=-1 if emit.opset >= 13 else 3)",
        "legacy = int(attrs['opset']) < 13",
        "body = spec_body(max(11, site.scope.default_opset))",
        "Contract(opset=lambda options, dtypes: '13 (11 without mask_index and unidirectional)')",
        "def _qoperator_opset(options, dtypes):\n    return '10'",
    ],
)
def test_the_scan_finds_an_opset_written_into_a_builder(snippet):
    """Each form the builders used before issue 10 (the scan below can fail)."""
    assert hard_coded_opsets(snippet)


@pytest.mark.parametrize(
    "snippet",
    [
        "Plan(min_opset=kernel_opsets.OP_VERSIONS['gelu'])",
        "Plan(min_opset=kernel_opsets.OP_VERSIONS['clip-inputs'] if op == 'Clip' else 0)",
        "probs = op('Softmax', axis=-1 if single_axis else 3)",
        "Contract(opset=lambda options, dtypes: kernel_opsets.describe(False, ['uint8', 'int8']))",
        "x = shape[3] if len(shape) > 3 else 1",
        "min_opset = max(kernel_opsets.qdq_opset(False, inputs[0][3]), kernel_opsets.QDQ_FIRST)",
    ],
)
def test_the_scan_leaves_other_numbers_alone(snippet):
    assert hard_coded_opsets(snippet) == []


def test_no_builder_writes_an_opset_number_of_its_own():
    hits = [hit for path in sorted(BUILDERS.glob("*.py")) for hit in hard_coded_opsets(path.read_text(), path.name)]
    assert hits == [], "opset numbers belong in rewriter/kernel_opsets.py:\n" + "\n".join(hits)


_GELU = """
    <ir_version: 8, opset_import: ["" : 9, "com.microsoft" : 1]>
    g (float[4] x) => (float[4] y)
    {
        y = com.microsoft.Gelu (x)
    }
"""

_SKIP_SIMPLIFIED = """
    <ir_version: 10, opset_import: ["" : 23, "com.microsoft" : 1]>
    g (float[2, 8] x, float[2, 8] s) => (float[2, 8] y)
    <float[8] gamma = {1.0, 0.5, 2.0, 1.5, 1.0, 0.25, 3.0, 1.0}>
    {
        y = com.microsoft.SkipSimplifiedLayerNormalization <epsilon = 0.00001> (x, s, gamma)
    }
"""


def test_a_forms_opset_in_kernel_opsets_decides_the_rewrite_and_the_docs(monkeypatch):
    model = onnx.parser.parse_model(_GELU)
    x = np.array([-3.0, -0.5, 0.0, 2.0], np.float32)
    before = onnx_qrewrite.rewrite(model, keep_opset=True)
    assert [o.version for o in before.model.opset_import if o.domain == ""] == [9]
    monkeypatch.setitem(kernel_opsets.FORMS, "gelu-decomposed", 10)
    assert CONTRACTS["unfuse_activation"].opset({"form": "gelu"}, None) == "10"
    after = onnx_qrewrite.rewrite(model)
    assert [o.version for o in after.model.opset_import if o.domain == ""] == [10]
    np.testing.assert_array_equal(run(after.model, {"x": x})["y"], run(before.model, {"x": x})["y"])
    with pytest.raises(LoweringError, match="needs opset 10, model has 9 and the opset is kept"):
        onnx_qrewrite.rewrite(model, keep_opset=True)


def test_an_op_version_in_kernel_opsets_chooses_the_emitted_form(monkeypatch):
    """RMSNormalization from OP_VERSIONS: one version later, the opset-23 model gets the decomposed form."""
    model = onnx.parser.parse_model(_SKIP_SIMPLIFIED)
    rng = np.random.default_rng(10)
    feeds = {n: rng.standard_normal((2, 8)).astype(np.float32) for n in ("x", "s")}
    before = onnx_qrewrite.rewrite(model, keep_opset=True)
    assert op_types(before.model) == ["Add", "RMSNormalization"]
    monkeypatch.setitem(kernel_opsets.OP_VERSIONS, "rms-normalization", 24)
    assert CONTRACTS["unfuse_normalization"].opset({"form": "skip_simplified"}, None) == "24"
    after = onnx_qrewrite.rewrite(model, keep_opset=True)
    assert "RMSNormalization" not in op_types(after.model) and "ReduceMean" in op_types(after.model)
    want = run(before.model, feeds)["y"].astype(np.float64)
    got = run(after.model, feeds)["y"]
    assert np.all(np.abs(got - want) <= 16 * 2.0**-24 * (np.abs(want) + 1))  # the rule's stated bound
