"""Find the first node of the rewritten model whose output differs from the original's.

The rewrite keeps the output names of the nodes it replaces (the Cast or QuantizeLinear that now
produces ``y`` is compared with the vendor node that produced ``y``), and the nodes it creates are
traceable to their rule and origin through ``metadata_props`` ``onnx_qrewrite.rule`` and
``onnx_qrewrite.origin`` (on every created node, or on the first of each replacement: see
:mod:`onnx_qrewrite.rewriter.provenance`). So: expose every value the
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
from typing import TYPE_CHECKING

from onnx_qrewrite._dataclass import dataclass
from onnx_qrewrite.errors import InvalidModelError, first_line
from onnx_qrewrite.rewriter import provenance
from onnx_qrewrite.verify.compare import Tolerances, UndefinedLookup, ValueComparison, compare_values
from onnx_qrewrite.verify.drift import DriftThreshold, DriftThresholds
from onnx_qrewrite.verify.inputs import Sample
from onnx_qrewrite.verify.session import ModelRunner

if TYPE_CHECKING:
    import numpy as np
    import onnx

__all__ = ["ORIGIN_KEY", "RULE_KEY", "Localization", "localize", "with_outputs"]

logger = logging.getLogger(__name__)

#: metadata_props keys the rewrite engine writes on the nodes it creates (provenance.py).
RULE_KEY = provenance.RULE_KEY
ORIGIN_KEY = provenance.ORIGIN_KEY


@dataclass(frozen=True)
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
    import onnx

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    present = {o.name for o in copy.graph.output}
    for name in names:
        if name not in present:
            copy.graph.output.append(onnx.ValueInfoProto(name=name))
    return copy


def _drift_for(
    name: str, model: onnx.ModelProto, drift: DriftThresholds | None, runtime_drift: DriftThresholds | None
) -> DriftThreshold | None:
    """How one value is judged: a model output as in the comparison (by ``drift`` when the rewrite
    is approximate, else element-wise); an intermediate value by ``drift``, or on another runtime by
    ``runtime_drift``, on rel L2 and cosine only (the argmax of an activation's last axis means
    nothing)."""
    if name in _outputs(model):
        return None if drift is None else drift.for_value(name)
    judge = drift or runtime_drift
    return None if judge is None else dataclasses.replace(judge.for_value(name), argmax=0.0)


def localize(
    original: onnx.ModelProto,
    rewritten: onnx.ModelProto,
    sample: Sample,
    tolerances: Tolerances,
    make_runner: Callable[[onnx.ModelProto, str], ModelRunner],
    drift: DriftThresholds | None = None,
    *,
    runtime: str = "onnxruntime",
    runtime_drift: DriftThresholds | None = None,
    undefined: UndefinedLookup | None = None,
) -> Localization:
    """Run both models with their shared intermediate values exposed and name the first differing
    node. ``make_runner(model, side)`` opens a session for ``side`` ("original" / "rewritten")
    with the same settings as the comparison run. With ``drift`` (an approximate rewrite, whose
    values differ by design), the first value whose drift breaks the thresholds is named instead.

    ``runtime``: what ``make_runner`` runs the rewritten side on. The original's values always come
    from onnxruntime. Another runtime rounds differently almost everywhere (a QuantizeLinear that
    multiplies by 1/scale lands one step away on ties, and every value downstream moves by that
    step), so element-wise the first difference is noise; there intermediate values are judged by
    ``runtime_drift``, so the value named is where that runtime's numbers go wrong (a departure of
    a step or two is not localised there: verify in onnxruntime localises those). A runtime that
    cannot run the model with the extra outputs, or whose outputs agree once they are added (its
    compiler fuses differently), gives a Localization that says so and names no node.
    ``undefined``: the original's undefined elements (:mod:`.undefined`), not compared."""
    candidates = _shared_values(original, rewritten)
    names = list(dict.fromkeys(out for _, out, _ in candidates))
    if not names:
        return Localization(sample.name, 0, note="the two models share no intermediate value names")
    values = _run_exposed(original, rewritten, names, sample, make_runner, runtime)
    if isinstance(values, Localization):
        return values
    expected, actual = values
    walk = _Walk()
    for node, out, origin in candidates:
        if out not in expected:
            continue
        if out not in actual:
            walk.skipped.append(out)
            continue
        original_value = expected[out]
        tolerance = tolerances.for_value(out, original_value.dtype)
        unset = None if undefined is None else undefined(out, sample.name, original_value.shape)
        drift_here = _drift_for(out, rewritten, drift, runtime_drift)
        comparison = compare_values(
            out, sample.name, original_value, actual[out], tolerance, drift_here, undefined=unset
        )
        if comparison.problem is not None and runtime != "onnxruntime" and out not in _outputs(rewritten):
            walk.skipped.append(out)  # another runtime's choice of type for an intermediate, not a value
            continue
        walk.compared += 1
        walk.names.add(out)
        if not comparison.passed:
            return _found(sample, walk.compared, node, out, origin, comparison, rewritten, runtime)
    return _nothing_differs(sample, walk, rewritten, runtime)


_Origin = tuple[str, str] | None  # (rule, original node) from a created node's provenance


def _shared_values(original: onnx.ModelProto, rewritten: onnx.ModelProto) -> list[tuple[onnx.NodeProto, str, _Origin]]:
    """Every output of a rewritten main-graph node that the original produces too, in the rewritten
    graph's (topological) order, with that node and its provenance: the values worth comparing."""
    produced_by_original = {out for node in original.graph.node for out in node.output if out}
    origins = provenance.attribute_nodes(rewritten.graph.node)
    return [
        (node, out, origin)
        for node, origin in zip(rewritten.graph.node, origins, strict=True)
        for out in node.output
        if out and out in produced_by_original
    ]


def _run_exposed(
    original: onnx.ModelProto,
    rewritten: onnx.ModelProto,
    names: list[str],
    sample: Sample,
    make_runner: Callable[[onnx.ModelProto, str], ModelRunner],
    runtime: str,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | Localization:
    """Both models' values of the tensors among ``names`` on ``sample`` (exposed as outputs). On
    another runtime than onnxruntime, a refusal to load or run the rewritten model so is not an
    error of the model: the Localization that says so."""
    original_runner = make_runner(with_outputs(original, names), "original")
    try:
        rewritten_runner = make_runner(with_outputs(rewritten, names), "rewritten")
    except InvalidModelError as exc:
        if runtime == "onnxruntime":
            raise
        return _not_possible(sample, runtime, "cannot load the rewritten model with them as outputs", exc)
    tensors = [
        n
        for n in names
        if original_runner.output_types.get(n, "").startswith("tensor(")
        and rewritten_runner.output_types.get(n, "").startswith("tensor(")
    ]
    expected = original_runner.run(sample.feeds, tensors)
    try:
        actual = rewritten_runner.run(sample.feeds, tensors)
    except InvalidModelError as exc:
        if runtime == "onnxruntime":
            raise
        return _not_possible(sample, runtime, "cannot run the rewritten model with them as outputs", exc)
    return expected, actual


@dataclass
class _Walk:
    """The walk over the shared values so far: how many were compared (and which), and the values
    another runtime did not return as onnxruntime types them (skipped, not compared)."""

    compared: int = 0
    names: set[str] = dataclasses.field(default_factory=set)
    skipped: list[str] = dataclasses.field(default_factory=list)


def _found(
    sample: Sample,
    compared: int,
    node: onnx.NodeProto,
    out: str,
    origin: _Origin,
    comparison: ValueComparison,
    rewritten: onnx.ModelProto,
    runtime: str,
) -> Localization:
    """The first differing value ``out``, named by its node and, through its provenance, its rule
    (with a note when the model records no provenance, or the values came from another runtime)."""
    logger.info("first differing value: %s (node %s)", out, node.name or out)
    notes = []
    if origin is None and provenance.model_mode(rewritten) == "none":
        notes.append(
            "the rewrite was made with --provenance none, so the model does not say which rule "
            "made this node; its JSON report (--report) does"
        )
    if runtime != "onnxruntime":
        notes.append(_runtime_note(runtime, origin is not None))
    return Localization(
        sample.name,
        compared,
        node=node.name or out,
        op_type=node.op_type,
        domain=node.domain or "ai.onnx",
        rule=origin[0] if origin else None,
        origin=origin[1] if origin else None,
        comparison=comparison,
        note="; ".join(notes) or None,
    )


def _nothing_differs(sample: Sample, walk: _Walk, rewritten: onnx.ModelProto, runtime: str) -> Localization:
    """No shared value differs: the difference arises in values the original has no counterpart
    of, or (another runtime agreeing once the values are exposed) in that runtime's compilation."""
    compared = walk.compared
    if runtime != "onnxruntime" and _outputs(rewritten) <= walk.names:
        return Localization(
            sample.name,
            compared,
            note=f"not possible on {runtime}: with the {compared} intermediate values exposed as "
            f"outputs, its outputs agree with onnxruntime's on sample {sample.name!r}, though in the comparison "
            f"they did not: {runtime} computes the model as given differently from the same model with more "
            "outputs (a fusion or precision choice of its compiler that the extra outputs prevent), so the "
            "wrong numbers come from no single node's value",
        )
    note = (
        f"none of the {compared} values both models produce differs on sample {sample.name!r}; "
        "the difference arises in nodes whose outputs have no counterpart in the original"
    )
    if walk.skipped:
        note += f"; {len(walk.skipped)} value(s) {runtime} did not return as onnxruntime types them were skipped"
    return Localization(sample.name, compared, note=note)


def _outputs(model: onnx.ModelProto) -> set[str]:
    return {o.name for o in model.graph.output}


def _runtime_note(runtime: str, made_by_rule: bool) -> str:
    """What a first differing value found on another runtime means."""
    if made_by_rule:
        return (
            f"values of the rewritten model from {runtime}, of the original from onnxruntime: this node is "
            f"the rule's; verify without --runtime tells the rule's doing from {runtime}'s"
        )
    # Not "so the runtime computes it differently": intermediate values on another runtime are
    # judged with that runtime's tolerance, so a rewrite's difference upstream that stays within it
    # at every earlier value first shows here (a rule's bias off by 5% shows at the logits).
    return (
        f"values of the rewritten model from {runtime}, of the original from onnxruntime: this node was "
        f"not made by the rewrite: either {runtime} computes it differently from onnxruntime, or a difference "
        f"that stayed within {runtime}'s tolerance at the earlier values grew through it; verify without "
        "--runtime localizes the rewrite's own differences"
    )


#: Why a runtime may refuse the model with extra outputs when it runs it without them.
_WHY_REFUSED = {
    "qnn": "; a value exposed inside a DequantizeLinear -> op -> QuantizeLinear group keeps QNN from running "
    "the group as one quantized node, and the CPU fallback is disabled so that verify proves something",
}


def _not_possible(sample: Sample, runtime: str, what: str, exc: InvalidModelError) -> Localization:
    return Localization(
        sample.name,
        0,
        note=f"not possible on {runtime}: it needs the shared intermediate values as extra "
        f"graph outputs, and {runtime} {what} ({first_line(exc)}){_WHY_REFUSED.get(runtime, '')}",
    )
