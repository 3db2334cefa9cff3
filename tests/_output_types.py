"""Checks that a rewrite writes the element types its rules' contracts declare.

Each builder declares the element type of each output of the op it replaces
(``Contract.output_types``, onnx_qrewrite/rewriter/contract.py). :func:`output_type_problems`
compares, for every node a rewrite replaced in the main graph:

- the declared type, resolved with the original node's input types and attributes,
- the type onnx's shape inference gives the same output name in the rewritten model (what the
  builder really emitted; declared types of the outputs are cleared first, so inference cannot
  just repeat them), and
- the type the original model gives that output (inferred or declared), where it has one.

``conftest.py`` runs it on every in-process rewrite of the tests marked as a rule's positive
evidence; ``tests/test_output_types.py`` shows it fails on a wrong declaration and a wrong builder.

:func:`unchecked_bound_problems`, run on the same rewrites, asserts that every bounded rewrite
records a bound ``verify`` can check at its node: a scalar ``Plan.bound``, or a formula
:mod:`onnx_qrewrite.verify.element_bounds` evaluates for the op (issue 10: the bounded un-fuse
rules recorded none, and verify held their differences to the exact tolerance downstream).
"""

from __future__ import annotations

from collections.abc import Iterator

import onnx

from onnx_qrewrite.rewriter.catalogue import Catalogue
from onnx_qrewrite.rewriter.contract import UNREAD, resolve_output_type
from onnx_qrewrite.rewriter.graph import dtype_name
from onnx_qrewrite.rewriter.report import RewriteReport


def _infer(model: onnx.ModelProto) -> onnx.ModelProto | None:
    try:
        return onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False)
    except Exception:  # noqa: BLE001 - a model onnx cannot infer is not checked
        return None


def _types(model: onnx.ModelProto | None) -> dict[str, str]:
    """Element type name of every value the main graph types."""
    if model is None:
        return {}
    graph = model.graph
    out = {t.name: dtype_name(t.data_type) for t in graph.initializer}
    for vi in (*graph.input, *graph.value_info, *graph.output):
        elem = vi.type.tensor_type.elem_type if vi.type.HasField("tensor_type") else 0
        if elem:
            out[vi.name] = dtype_name(elem)
    for node in graph.node:  # Constant nodes: inference types them, but not in value_info for outputs
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            for attr in node.attribute:
                if attr.name == "value":
                    out.setdefault(node.output[0], dtype_name(attr.t.data_type))
    return out


def _originals(model: onnx.ModelProto, report: RewriteReport) -> Iterator[tuple[str, onnx.NodeProto]]:
    """(rule id, original node) for each rewrite of a main-graph node found by its label."""
    by_label: dict[str, list[onnx.NodeProto]] = {}
    for n in model.graph.node:
        label = n.name or (f"<unnamed {n.op_type} -> {n.output[0]}>" if n.output else f"<unnamed {n.op_type}>")
        by_label.setdefault(label, []).append(n)
    for r in report.rewrites:
        found = [n for n in by_label.get(r.node, []) if n.op_type == r.op_type] if r.scope == "main" else []
        if len(found) == 1:
            yield r.rule, found[0]


def _rewritten_types(rewritten: onnx.ModelProto, names: set[str]) -> dict[str, str]:
    """What shape inference finds for ``names`` in the rewritten model, their recorded types cleared."""
    copy = onnx.ModelProto()
    copy.CopyFrom(rewritten)
    kept = [vi for vi in copy.graph.value_info if vi.name not in names]
    del copy.graph.value_info[:]
    copy.graph.value_info.extend(kept)
    for vi in copy.graph.output:
        if vi.name in names:
            vi.ClearField("type")
    return _types(_infer(copy))


def output_type_problems(
    original: onnx.ModelProto, rewritten: onnx.ModelProto, report: RewriteReport, catalogue: Catalogue
) -> tuple[list[str], dict[str, int]]:
    """Every disagreement between declared, emitted and original output types, and how many
    outputs of each rule were compared."""
    rules = {r.id: r for r in catalogue}
    originals = [(rules[rule_id], node) for rule_id, node in _originals(original, report) if rule_id in rules]
    before = _types(original) | _types(_infer(original))
    after = _rewritten_types(rewritten, {o for _, node in originals for o in node.output if o})
    present = {o for n in rewritten.graph.node for o in n.output} | {i.name for i in rewritten.graph.input}
    problems: list[str] = []
    compared: dict[str, int] = {}
    for rule, node in originals:
        declared = rule.contract.output_types(rule.options, node.op_type)  # type: ignore[misc]
        assert declared is not None  # checked when the catalogue loaded
        attrs = {a.name: a for a in node.attribute}

        def input_type(i: int, node: onnx.NodeProto = node) -> str | None:
            name = node.input[i] if i < len(node.input) else ""
            return (before.get(name) or after.get(name)) if name else None

        def attribute_type(name: str, attrs: dict[str, onnx.AttributeProto] = attrs) -> str | None:
            return dtype_name(attrs[name].i) if name in attrs and attrs[name].i else None

        for index, name in enumerate(node.output):
            if not name:
                continue
            spec = UNREAD if declared == (UNREAD,) else declared[index] if index < len(declared) else None
            where = f"rule {rule.id}, {node.op_type} {node.name or name!r} output {index} ({name})"
            if spec is None:
                problems.append(f"{where}: no type declared for this output")
                continue
            if spec == UNREAD:
                compared[rule.id] = compared.get(rule.id, 0) + 1
                if name in present:
                    problems.append(f"{where}: declared unread, but the rewritten model still has it")
                continue
            want = resolve_output_type(spec, rule.options, input_type, attribute_type)
            got, had = after.get(name), before.get(name)
            if want is None or (got is None and name in present):
                continue  # the input types or the emitted type are unknown to onnx's inference
            compared[rule.id] = compared.get(rule.id, 0) + 1
            if got is None:
                problems.append(f"{where}: declared {spec!r} = {want}, the rewrite does not write it")
            elif got != want:
                problems.append(f"{where}: declared {spec!r} = {want}, the rewrite emits {got}")
            if had is not None and had != want:
                problems.append(f"{where}: declared {spec!r} = {want}, the original op's output is {had}")
    return problems, compared


def unchecked_bound_problems(report: RewriteReport) -> list[str]:
    """The bounded rewrites of ``report`` whose bound verify could not check at the node: neither a
    scalar bound nor a formula element_bounds evaluates for the op (its name, with ``_READS``
    listing the op)."""
    from onnx_qrewrite.verify import element_bounds

    problems = []
    for r in report.rewrites:
        if r.exactness != "bounded":
            continue
        formula = (r.bound_formula or "").partition(":")[0]
        if r.bound is None and not formula:
            problems.append(f"rule {r.rule}, {r.op_type} {r.node!r}: bounded, and no bound recorded")
        elif formula and r.op_type not in element_bounds.readable_ops(formula):
            problems.append(f"rule {r.rule}, {r.op_type} {r.node!r}: formula {formula!r} does not evaluate it")
    return problems
