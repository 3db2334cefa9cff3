"""Match rules against nodes and apply them: the heart of ``rewrite``.

Works on ``onnx.ModelProto`` directly. Why not onnx_ir or onnxscript's rewriter: measured on a
20k-block chain (ENGINE_NOTES.md), onnx load+save takes 0.44 s, onnx_ir load+save 3.3 s and
onnxscript's rewriter 14.5 s just to apply; our target is 1.5x the onnx floor. Rules are one-node
patterns, so an op-indexed lookup per node is all the matching we need; replacements are encoded
as wire bytes and spliced into each node list in one parse (see ``_protowire``).

Two phases: *match* decides, for every node, which rule rewrites it and what that needs (reading
only); *apply* builds the replacements. If some rewrite needs a higher default-domain opset, the
model is converted between the two phases and matched again.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping

import onnx

from onnx_qrewrite import opset as opset_mod
from onnx_qrewrite._protowire import replace_nodes
from onnx_qrewrite.builders import ConstantPool, Emitter, NoMatch, Plan, Site, get_builder
from onnx_qrewrite.catalogue import Catalogue, Rule
from onnx_qrewrite.errors import LoweringError
from onnx_qrewrite.graph import NameAllocator, Scope, iter_scopes
from onnx_qrewrite.report import AppliedRewrite, RewriteReport, Unlowered, count_ops

__all__ = ["EngineOptions", "run"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    #: Raise the model's default-domain opset to this before rewriting (never lowers it).
    target_opset: int | None = None
    #: Never change the model's opset; rules that would need it give way to the next rule.
    keep_opset: bool = False
    #: Leave nodes that no rule can lower in place (with a warning) instead of failing.
    allow_unlowered: bool = False
    #: Highest default-domain opset a rewrite may raise to: what onnxruntime 1.31 loads.
    max_opset: int = opset_mod.MAX_RUNTIME_OPSET


@dataclasses.dataclass
class _Match:
    site: Site
    index: int
    rule: Rule
    plan: Plan


def _try_rule(rule: Rule, site: Site, options: EngineOptions) -> Plan:
    builder = get_builder(rule.builder)
    assert builder is not None  # validated when the catalogue was loaded
    current = site.scope.default_opset
    if rule.min_opset is not None and current < rule.min_opset:
        raise NoMatch(f"model opset {current} is below the rule's min_opset {rule.min_opset}")
    if rule.max_opset is not None and current > rule.max_opset:
        raise NoMatch(f"model opset {current} is above the rule's max_opset {rule.max_opset}")
    dtype = builder.quantized_dtype(site)
    if rule.dtypes is not None and dtype not in rule.dtypes:
        raise NoMatch(f"dtype {dtype or 'unknown'} is not one of {', '.join(sorted(rule.dtypes))}")
    plan = builder.check(site, rule.options)
    needed = max(plan.min_opset, rule.opset_needed_for(dtype))
    if needed > current:
        if options.keep_opset:
            raise NoMatch(f"needs opset {needed}, model has {current} and the opset is kept")
        if needed > options.max_opset:
            raise NoMatch(f"needs opset {needed}, above the highest allowed ({options.max_opset})")
        if site.scope.is_function:
            raise NoMatch(f"needs opset {needed}; raising the opset of a local function is not supported")
    return dataclasses.replace(plan, min_opset=needed)


def _match(
    model: onnx.ModelProto, catalogue: Catalogue, options: EngineOptions, base_dir: str | None
) -> tuple[list[Scope], dict[int, list[_Match]], list[Unlowered]]:
    scopes = iter_scopes(model, base_dir)
    matches: dict[int, list[_Match]] = {}
    unlowered: list[Unlowered] = []
    for s, scope in enumerate(scopes):
        for index, node in enumerate(scope.container.node):
            candidates = catalogue.candidates(node.domain, node.op_type)
            if not candidates:
                continue
            site = Site(node, scope)
            reasons = []
            for rule in candidates:
                try:
                    plan = _try_rule(rule, site, options)
                except NoMatch as why:
                    reasons.append(f"{rule.id}: {why}")
                    logger.debug("rule %s does not apply to %s: %s", rule.id, site.label, why)
                    continue
                matches.setdefault(s, []).append(_Match(site, index, rule, plan))
                break
            else:
                unlowered.append(
                    Unlowered(site.label, node.op_type, node.domain, scope.path, tuple(reasons))
                )
    return scopes, matches, unlowered


def _apply(
    model: onnx.ModelProto, scopes: list[Scope], matches: dict[int, list[_Match]], report: RewriteReport
) -> None:
    names = NameAllocator(model)
    pools: dict[int, ConstantPool] = {}
    for s, scope in enumerate(scopes):
        root = scope.root
        pool = pools.get(id(root))
        if pool is None:
            pool = pools[id(root)] = ConstantPool(root, names)
        replacements: dict[int, list[bytes]] = {}
        for m in matches.get(s, ()):
            emit = Emitter(m.site, m.rule.id, names, pool)
            builder = get_builder(m.rule.builder)
            builder.build(m.site, emit, m.rule.options, m.plan)  # type: ignore[union-attr]
            replacements[m.index] = emit.nodes
            report.rewrites.append(
                AppliedRewrite(
                    rule=m.rule.id,
                    node=m.site.label,
                    op_type=m.site.node.op_type,
                    domain=m.site.node.domain,
                    scope=scope.path,
                    created_nodes=tuple(n for n, _ in emit.created),
                    created_ops=tuple(op for _, op in emit.created),
                    notes=m.plan.notes,
                )
            )
        prepend = pool.constant_nodes if scope is root else []
        if replacements or prepend:
            replace_nodes(scope.container, replacements, prepend)
            scope.invalidate()


def run(
    model: onnx.ModelProto,
    catalogue: Catalogue,
    options: EngineOptions = EngineOptions(),
    base_dir: str | None = None,
) -> tuple[onnx.ModelProto, RewriteReport]:
    """Rewrite ``model`` in place (callers pass a copy) and report what changed."""
    report = RewriteReport(ops_before=count_ops(model))
    if options.target_opset is not None:
        model = opset_mod.raise_default_opset(model, options.target_opset, report, why="--target-opset")
    scopes, matches, unlowered = _match(model, catalogue, options, base_dir)
    needed = max((m.plan.min_opset for ms in matches.values() for m in ms), default=0)
    if needed > (opset_mod.model_default_opset(model) or 0):
        why_rule = next(m for ms in matches.values() for m in ms if m.plan.min_opset == needed)
        model = opset_mod.raise_default_opset(
            model, needed, report, why=f"rule {why_rule.rule.id} on {why_rule.site.label}"
        )
        scopes, matches, unlowered = _match(model, catalogue, options, base_dir)
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
    if matches:
        _apply(model, scopes, matches, report)
        opset_mod.drop_unused_vendor_imports(model, {r.domain for r in report.rewrites}, report)
    report.ops_after = count_ops(model)
    return model, report
