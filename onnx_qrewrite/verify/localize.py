"""Find the first node of the rewritten model whose output differs from the original's.

The rewrite keeps the output names of the nodes it replaces (the Cast or QuantizeLinear that now
produces ``y`` is compared with the vendor node that produced ``y``), and the nodes it creates are
traceable to their rule and origin through ``metadata_props`` ``onnx_qrewrite.rule`` and
``onnx_qrewrite.origin`` (on every created node, or on the first of each replacement: see
:mod:`onnx_qrewrite.provenance`). So: expose every value the
two main graphs share as an extra graph output, run both models once on the failing sample, and
walk the rewritten graph in topological order (the order ONNX requires nodes to be listed in); the
first shared value that differs names the node and, through its provenance, the rule to blame.
A model rewritten with ``--provenance none`` still gets the node named, with a note that the rule
was not recorded in the model (the rewrite's JSON report has it).

Values are exposed without a declared type: onnxruntime infers it when it loads the model, which
covers every main-graph tensor a session can produce; non-tensor values are skipped.

With graph optimisation on, extra outputs can prevent some fusions, so the localisation run may
see slightly different numerics from the comparison run; the default level (``disable``) has no
such effect.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

import onnx

from onnx_qrewrite import provenance
from onnx_qrewrite.verify.compare import Tolerances, ValueComparison, compare_values
from onnx_qrewrite.verify.drift import DriftThreshold, DriftThresholds
from onnx_qrewrite.verify.inputs import Sample
from onnx_qrewrite.verify.session import ModelRunner

__all__ = ["ORIGIN_KEY", "RULE_KEY", "Localization", "localize", "with_outputs"]

logger = logging.getLogger(__name__)

#: metadata_props keys the rewrite engine writes on the nodes it creates (provenance.py).
RULE_KEY = provenance.RULE_KEY
ORIGIN_KEY = provenance.ORIGIN_KEY


@dataclasses.dataclass(frozen=True)
class Localization:
    """Where the rewritten model first departs from the original, on one sample."""

    sample: str
    compared_values: int
    node: str | None = None  # the rewritten node's name (or its first output when unnamed)
    op_type: str | None = None
    domain: str | None = None
    rule: str | None = None  # from metadata_props; None for a node the rewrite did not create
    origin: str | None = None  # the original node it replaces
    comparison: ValueComparison | None = None
    note: str | None = None

    @property
    def found(self) -> bool:
        """True when a first differing value was found in the rewritten model."""
        return self.comparison is not None


def with_outputs(model: onnx.ModelProto, names: Sequence[str]) -> onnx.ModelProto:
    """A copy of ``model`` that also outputs ``names``, so their values can be compared."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    present = {o.name for o in copy.graph.output}
    for name in names:
        if name not in present:
            copy.graph.output.append(onnx.ValueInfoProto(name=name))
    return copy


def _intermediate_drift(drift: DriftThresholds | None, name: str, model: onnx.ModelProto) -> DriftThreshold | None:
    """The drift thresholds of one value: a model output's own; an intermediate value is judged by
    rel L2 and cosine only (the argmax of an activation's last axis means nothing)."""
    if drift is None:
        return None
    threshold = drift.for_value(name)
    if name in {o.name for o in model.graph.output}:
        return threshold
    return dataclasses.replace(threshold, argmax=0.0)


def localize(
    original: onnx.ModelProto,
    rewritten: onnx.ModelProto,
    sample: Sample,
    tolerances: Tolerances,
    make_runner: Callable[[onnx.ModelProto, str], ModelRunner],
    drift: DriftThresholds | None = None,
) -> Localization:
    """Run both models with their shared intermediate values exposed and name the first differing
    node. ``make_runner(model, side)`` opens a session for ``side`` ("original" / "rewritten")
    with the same settings as the comparison run. With ``drift`` (an approximate rewrite, whose
    values differ by design), the first value whose drift breaks the thresholds is named instead."""
    produced_by_original = {out for node in original.graph.node for out in node.output if out}
    origins = provenance.attribute_nodes(rewritten.graph.node)
    candidates = [
        (node, out, origin)
        for node, origin in zip(rewritten.graph.node, origins, strict=True)
        for out in node.output
        if out and out in produced_by_original
    ]
    names = list(dict.fromkeys(out for _, out, _ in candidates))
    if not names:
        return Localization(sample.name, 0, note="the two models share no intermediate value names")
    original_runner = make_runner(with_outputs(original, names), "original")
    rewritten_runner = make_runner(with_outputs(rewritten, names), "rewritten")
    tensors = [
        n
        for n in names
        if original_runner.output_types.get(n, "").startswith("tensor(")
        and rewritten_runner.output_types.get(n, "").startswith("tensor(")
    ]
    expected = original_runner.run(sample.feeds, tensors)
    actual = rewritten_runner.run(sample.feeds, tensors)
    compared = 0
    for node, out, origin in candidates:
        if out not in expected:
            continue
        compared += 1
        original_value = expected[out]
        comparison = compare_values(
            out,
            sample.name,
            original_value,
            actual[out],
            tolerances.for_value(out, original_value.dtype),
            _intermediate_drift(drift, out, rewritten),
        )
        if not comparison.passed:
            logger.info("first differing value: %s (node %s)", out, node.name or out)
            note = None
            if origin is None and provenance.model_mode(rewritten) == "none":
                note = (
                    "the rewrite was made with --provenance none, so the model does not say which rule "
                    "made this node; its JSON report (--report) does"
                )
            return Localization(
                sample.name,
                compared,
                node=node.name or out,
                op_type=node.op_type,
                domain=node.domain or "ai.onnx",
                rule=origin[0] if origin else None,
                origin=origin[1] if origin else None,
                comparison=comparison,
                note=note,
            )
    return Localization(
        sample.name,
        compared,
        note=f"none of the {compared} values both models produce differs on sample {sample.name!r}; "
        "the difference arises in nodes whose outputs have no counterpart in the original",
    )
