"""Match rules against nodes and apply them: the heart of ``rewrite``.

Works on ``onnx.ModelProto`` directly. Why not onnx_ir or onnxscript's rewriter: measured on a
20k-block chain (ENGINE_NOTES.md), onnx load+save takes 0.44 s, onnx_ir load+save 3.3 s and
onnxscript's rewriter 14.5 s just to apply; our target is 1.5x the onnx floor. Rules are one-node
patterns, so an op-indexed lookup per node is all the matching we need; replacements are encoded
as wire bytes and spliced into each node list in one parse (see ``_protowire``).

Two phases: *match* decides, for every node, which rule rewrites it and what that needs (reading
only); *apply* builds the replacements. If some rewrite needs a higher default-domain opset, the
model is converted between the two phases and matched again.

The parts, each a module, called in this order: :mod:`.matching` (which rule rewrites which node,
reading only), :mod:`.apply` (each replacement built or stamped from a template, with its report
entry), :mod:`.splice` (the new node lists: spooled as they are built, checked against what is
still read, initializers no node reads any more removed, spliced in place). This module runs the
passes with them and keeps the public API (:func:`run`, :class:`EngineOptions`,
:data:`DEFAULT_ALLOW`).
"""

from __future__ import annotations

import collections
import gc
import itertools
import operator
from collections.abc import Mapping

from onnx_qrewrite import _onnx as onnx
from onnx_qrewrite._dataclass import dataclass
from onnx_qrewrite.errors import InternalError, InvalidModelError, LoweringError, UsageError
from onnx_qrewrite.io.encoded import EncodedModel, to_proto
from onnx_qrewrite.io.external_data import ExternalData
from onnx_qrewrite.io.heap import return_freed_memory
from onnx_qrewrite.progress import ProgressSink, stage
from onnx_qrewrite.rewriter import opset as opset_mod
from onnx_qrewrite.rewriter import provenance as provenance_mod
from onnx_qrewrite.rewriter.apply import Applied, apply_matches
from onnx_qrewrite.rewriter.builders import Site
from onnx_qrewrite.rewriter.catalogue import Catalogue
from onnx_qrewrite.rewriter.contract import BOUNDED, EXACT, EXACTNESS
from onnx_qrewrite.rewriter.graph import iter_scopes
from onnx_qrewrite.rewriter.matching import match_nodes
from onnx_qrewrite.rewriter.report import RewriteReport, count_ops, rewrite_kinds

__all__ = ["DEFAULT_ALLOW", "EngineOptions", "run"]


#: Exactness levels a rewrite may use unless asked otherwise.
DEFAULT_ALLOW: frozenset[str] = frozenset({EXACT, BOUNDED})


@dataclass(frozen=True)
class EngineOptions:
    """How :func:`run` rewrites: opset policy, unlowered nodes, the exactness levels allowed."""

    #: Raise the model's default-domain opset to this before rewriting (never lowers it).
    target_opset: int | None = None
    #: Never change the model's opset; rules that would need it give way to the next rule.
    keep_opset: bool = False
    #: Leave nodes that no rule can lower in place (with a warning) instead of failing.
    allow_unlowered: bool = False
    #: Highest default-domain opset a rewrite may raise to: what onnxruntime 1.31 loads.
    max_opset: int = opset_mod.MAX_RUNTIME_OPSET
    #: Stamp repeated replacements from a recorded template (builders/_stamp.py); off only to
    #: prove that stamping and building give the same bytes.
    stamp_templates: bool = True
    #: Decide a rule's check once per distinct node structure, for builders whose checks read the
    #: graph through the Site's recorded queries (builders/_facts.py); off only to prove that
    #: recorded and fresh checks give the same outcomes.
    memo_checks: bool = True
    #: Exactness levels rules may have (onnx_qrewrite.rewriter.contract). Exact rules are always tried
    #: first and bounded ones only where no exact rule applies; approximate rules run only when
    #: listed here (``--allow-approximate``; a target profile may ask too), and then first.
    allow: frozenset[str] = DEFAULT_ALLOW

    def __post_init__(self) -> None:
        unknown = set(self.allow) - set(EXACTNESS)
        if unknown or EXACT not in self.allow:
            raise UsageError(
                f"allow={sorted(self.allow)!r}: must include 'exact' and may add {', '.join(EXACTNESS[1:])}"
            )

    #: Which created nodes carry rule/origin metadata: "compact", "full" or "none" (provenance.py).
    provenance: str = provenance_mod.DEFAULT_MODE
    #: Per-node rule choice, keyed by (scope path, index of the node in its scope): the only rules
    #: tried for that node, in order (empty: leave it as it is). Nodes not listed get the usual
    #: candidates. ``rewrite --target`` uses it to rewrite each node with the rule its plan chose
    #: (targets/plan.py); the rules still have to be in the catalogue and in ``allow``.
    node_rules: Mapping[tuple[str, int], tuple[str, ...]] | None = None
    #: The model holds an earlier run's replacements (a target plan's later stage, targets/plan.py):
    #: an exact rule rewriting one of their nodes continues that replacement's provenance (rule,
    #: origin, bound, name prefix), as a later pass's rules do, so the bound the earlier rule
    #: declared for the original node is still recorded, and checked, on the final model.
    continue_provenance: bool = False


#: A match's plan's fields, read for every match in C (no generator frame per match: 40k on a chain).
_PLAN_MIN_OPSET = operator.attrgetter("plan.min_opset")


def _record_provenance_mode(model: onnx.ModelProto, mode: str) -> None:
    """Say in the model how its created nodes carry provenance (provenance.py), replacing what an
    earlier rewrite said."""
    kept = [e for e in model.metadata_props if e.key != provenance_mod.MODE_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    model.metadata_props.add(key=provenance_mod.MODE_KEY, value=mode)


#: The first IR version in which an initializer need not be a graph input.
_IR_INITIALIZERS_NOT_INPUTS = 4


def run(
    model: onnx.ModelProto,
    catalogue: Catalogue,
    options: EngineOptions = EngineOptions(),
    external: ExternalData | None = None,
    progress: ProgressSink | None = None,
) -> tuple[onnx.ModelProto | EncodedModel, RewriteReport]:
    """Rewrite ``model`` in place (callers pass a copy) and report what changed.

    Returns an :class:`EncodedModel` when the main graph changed (see ``encoded``), else the model.
    Python's cyclic garbage collector is paused meanwhile: the pass allocates hundreds of
    thousands of small containers and creates no cycles, and collections triggered by those
    allocations cost up to 30% of the pass (measured on a 20k-block chain; ENGINE_NOTES.md too).
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _run(model, catalogue, options, external, progress)
    except (AttributeError, TypeError, UnicodeError):
        # protobuf hands a name that is not valid UTF-8 to Python as bytes, not str; finding
        # such a name costs a walk over the whole model, so it is only looked for on failure.
        bad = first_non_utf8_name(model)
        if bad is not None:
            raise InvalidModelError(f"{bad} is not valid UTF-8; ONNX names are UTF-8 strings") from None
        raise
    finally:
        if was_enabled:
            gc.enable()


def first_non_utf8_name(model: onnx.ModelProto) -> str | None:
    """The first name (node, value, initializer, op type, domain) that is not valid UTF-8, described."""
    for scope in iter_scopes(model):
        container = scope.container
        values: list[onnx.ValueInfoProto | onnx.TensorProto] = []
        if isinstance(container, onnx.GraphProto):
            values = [*container.input, *container.output, *container.value_info, *container.initializer]
        for v in values:
            if isinstance(v.name, bytes):
                return f"{scope.path}: value name {v.name!r}"
        for node in container.node:
            for field in ("name", "op_type", "domain"):
                if isinstance(getattr(node, field), bytes):
                    return f"{scope.path}: node {field} {getattr(node, field)!r}"
            for name in (*node.input, *node.output):
                if isinstance(name, bytes):
                    return f"{scope.path}: node {node.name!r}: value name {name!r}"
            for attr in node.attribute:
                if isinstance(attr.name, bytes):
                    return f"{scope.path}: node {node.name!r}: attribute name {attr.name!r}"
    for entry in model.metadata_props:
        if isinstance(entry.key, bytes) or isinstance(entry.value, bytes):
            return f"metadata entry {entry.key!r}"
    return None


#: More later passes than this is a bug: each pass adds a rule to a node's lineage (see :func:`_run`).
_MAX_LATER_PASSES = 64


def _run(
    model: onnx.ModelProto,
    catalogue: Catalogue,
    options: EngineOptions,
    external: ExternalData | None,
    progress: ProgressSink | None,
) -> tuple[onnx.ModelProto | EncodedModel, RewriteReport]:
    """One pass over the model, then later passes while the catalogue has ``on_replacements``
    rules for ops the previous pass created (e.g. float emulation of the QuantizeLinear that a
    DynamicQuantizeLinear expansion emits). A later pass matches only the nodes the previous one
    created, against only those rules, and never a rule already in the node's lineage (the rules
    that made it and its ancestors): lineages grow by one rule a pass, so the passes end after at
    most one per such rule, however the rules' emits and matches overlap. Not with a target's
    per-node plan (``node_rules``): the plan decided every node's rules from the input model."""
    report = RewriteReport()
    return_freed_memory()  # what loading (and checking, io/heap.py) the input freed
    types_before = {t.data_type for t in model.graph.initializer}
    if options.target_opset is not None:
        report.ops_before = count_ops(model)
        model = opset_mod.raise_default_opset(model, options.target_opset, report, why="--target-opset")
    later_ops = frozenset(
        ref.op for rule in catalogue if rule.on_replacements for ref in rule.match if ref.domain in ("", "ai.onnx")
    )
    if options.node_rules is not None:
        later_ops = frozenset()
    # What each rewrite created, kept only when a later pass may need it (it costs memory per
    # created node on large models, which the default catalogue's single pass never needs).
    applied: list[Applied] | None = [] if later_ops else None
    result = _pass(model, catalogue, options, external, progress, report, applied, None)
    lineage: dict[tuple[str, str], frozenset[str]] = {}
    typed: list[str] = []
    passes = 0
    while applied and any(later_ops.intersection(a.created_ops) for a in applied):
        passes += 1
        if passes > _MAX_LATER_PASSES:
            raise InternalError(f"rules on replacements did not settle after {_MAX_LATER_PASSES} passes")
        lineage = {
            (a.scope, name): lineage.get((a.scope, a.node), frozenset()) | {a.rule}
            for a in applied
            for name in a.created
        }
        model = to_proto(result) if isinstance(result, EncodedModel) else result
        typed.extend(_record_inferred_types(model))
        applied = []
        result = _pass(model, catalogue, options, external, progress, report, applied, lineage)
    final = result.skeleton if isinstance(result, EncodedModel) else result
    if typed:
        _drop_value_info(final, set(typed))
    if report.changed and final.ir_version < _IR_INITIALIZERS_NOT_INPUTS:
        _raise_to_ir_4(final, report)
    if report.changed:
        _declare_types_ir(final, report, types_before)
    return result, report


def _types_ir(types: set[int]) -> int:
    """The IR version that added the newest of these element types (0: none newer than the first IR
    versions), from rules/opsets/ir_versions.toml."""
    from onnx_qrewrite.rewriter.ir_table import ir_additions

    added = {name: version for version, a in ir_additions().items() for name in a.types}
    return max((added.get(onnx.TensorProto.DataType.Name(t).lower(), 0) for t in types), default=0)


def _declare_types_ir(model: onnx.ModelProto, report: RewriteReport, before: set[int]) -> None:
    """Keep the output valid at the IR version it declares: constants of a type newer than it (a
    2-bit MatMulNBits' int2/uint2 weights, IR 13; int4, IR 10) raise it to the version that added
    the type. Only for types the rewrite brought (the input's own initializers' types, ``before``,
    stay as the input declared them; the table is read only when there are such types);
    onnxruntime and onnx's checker do not hold a model to it (README, IR version), so this is the
    only check."""
    brought = {t.data_type for t in model.graph.initializer} - before
    needed = _types_ir(brought) if brought else 0
    if needed <= model.ir_version:
        return
    report.ir_version_change = {
        "from": model.ir_version,
        "to": needed,
        "why": f"the rewrite's constants use an element type added in IR {needed} [opsets/onnx-proto]",
    }
    model.ir_version = needed


def _raise_to_ir_4(model: onnx.ModelProto, report: RewriteReport) -> None:
    """Declare a rewritten model of IR < 4 at IR 4. Before IR 4 every initializer had to be a graph
    input: the constants a rewrite adds are not. IR 4 only lifts that rule, so the model means the
    same under it, once the listings the old format demanded go: the rewrite read those initializers
    as constants (graph.Scope._index_records), and from IR 4 on a listed initializer is an input a
    caller may override, which a reader (or a second rewrite) would otherwise take it for."""
    graph = model.graph
    initializers = {t.name for t in graph.initializer}
    initializers.update(t.values.name for t in graph.sparse_initializer)
    inputs = [v for v in graph.input if v.name not in initializers]
    unlisted = len(graph.input) - len(inputs)
    if unlisted:
        del graph.input[:]
        graph.input.extend(inputs)
    report.warnings.append(
        f"IR version raised from {model.ir_version} to {_IR_INITIALIZERS_NOT_INPUTS}: before IR 4 every "
        "initializer had to be a graph input, and the constants this rewrite adds are not"
        + (f"; the {unlisted} initializer(s) listed as inputs for that rule are no longer listed" if unlisted else "")
    )
    model.ir_version = _IR_INITIALIZERS_NOT_INPUTS


def _record_inferred_types(model: onnx.ModelProto) -> list[str]:
    """Add the main graph's value_info that onnx's shape inference finds for values the model does
    not type (the values an earlier pass created: builders read element types and shapes from
    value_info); returns their names, removed again once the passes are done. Nothing when
    inference fails (e.g. a model over protobuf's 2 GB): later rules then decline what they cannot
    type, and the nodes stay as the earlier pass made them."""
    graph = model.graph
    known = {vi.name for vi in (*graph.input, *graph.output, *graph.value_info)}
    known.update(t.name for t in graph.initializer)
    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False, data_prop=False)
    except Exception:  # noqa: BLE001 - onnx's C++ inference raises whatever it meets; it is only a help
        return []
    added = [vi for vi in inferred.graph.value_info if vi.name not in known]
    graph.value_info.extend(added)
    return [vi.name for vi in added]


def _drop_value_info(model: onnx.ModelProto, names: set[str]) -> None:
    kept = [vi for vi in model.graph.value_info if vi.name not in names]
    del model.graph.value_info[:]
    model.graph.value_info.extend(kept)


def _pass(
    model: onnx.ModelProto,
    catalogue: Catalogue,
    options: EngineOptions,
    external: ExternalData | None,
    progress: ProgressSink | None,
    report: RewriteReport,
    applied: list[Applied] | None,
    restrict: Mapping[tuple[str, str], frozenset[str]] | None,
) -> onnx.ModelProto | EncodedModel:
    """Match and apply once (``restrict``: a later pass, see :func:`match_nodes`); the report gathers
    every pass's rewrites, its ops after are the last pass's."""
    with stage(progress, "matching rules"):
        scopes, matches, unlowered, counts = match_nodes(model, catalogue, options, external, restrict)
    if not report.ops_before:
        report.ops_before = collections.Counter(counts)
    needed = max(map(_PLAN_MIN_OPSET, itertools.chain.from_iterable(matches.values())), default=0)
    if needed > (opset_mod.model_default_opset(model) or 0):
        s, why_rule = next((s, m) for s, ms in matches.items() for m in ms if m.plan.min_opset == needed)
        label = Site(scopes[s].container.node[why_rule.index], scopes[s]).label
        model = opset_mod.raise_default_opset(model, needed, report, why=f"rule {why_rule.rule.id} on {label}")
        with stage(progress, "matching rules"):
            scopes, matches, unlowered, counts = match_nodes(model, catalogue, options, external, restrict)
    if unlowered and not options.allow_unlowered:
        first = unlowered[0]
        more = f" (and {len(unlowered) - 1} more node(s))" if len(unlowered) > 1 else ""
        raise LoweringError(
            f"node {first.node} ({first.domain or 'ai.onnx'}::{first.op_type}) cannot be lowered: "
            f"{'; '.join(first.reasons)}{more}",
            node=first.node,
        )
    for u in unlowered:
        report.unlowered.append(u)
        report.warnings.append(f"left {u.node} ({u.op_type}) in place: {'; '.join(u.reasons)}")
    result: onnx.ModelProto | EncodedModel = model
    rewrote = bool(matches)  # apply_matches consumes the matches
    if rewrote:
        _record_provenance_mode(model, options.provenance)
        delta, main_nodes = apply_matches(
            model,
            scopes,
            matches,
            report,
            options.stamp_templates,
            progress,
            options.provenance,
            applied,
            later=restrict is not None,
            earlier=options.continue_provenance,
            same_shape_ops=catalogue.same_shape_ops,
        )
        counts.update(delta)
        if main_nodes is not None:
            result = EncodedModel(model, main_nodes)
    report.ops_after = collections.Counter({k: n for k, n in counts.items() if n > 0})
    if rewrote:
        used = {key.split("::")[0] if "::" in key else "" for key in report.ops_after}
        opset_mod.drop_unused_vendor_imports(model, {r.domain for r in rewrite_kinds(report.rewrites)}, used, report)
    return result
