"""The engine's first phase (:mod:`.engine`): which rule rewrites which node, and what that needs
(its plan), reading only. A node's candidate rules are tried in order of exactness; a rule that
removes its node applies only once the whole scope is matched and nothing reads the node."""

from __future__ import annotations

import array
import collections
import logging
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from onnx_qrewrite import _onnx as onnx
from onnx_qrewrite._dataclass import dataclass
from onnx_qrewrite.io.external_data import ExternalData
from onnx_qrewrite.rewriter import opset as opset_mod
from onnx_qrewrite.rewriter.builders import NoMatch, NotApplicable, Plan, Site
from onnx_qrewrite.rewriter.builders._facts import CheckMemo
from onnx_qrewrite.rewriter.catalogue import Catalogue, Rule, with_precedence
from onnx_qrewrite.rewriter.contract import APPROXIMATE, BOUNDED, EXACT
from onnx_qrewrite.rewriter.graph import Scope, iter_scopes, subgraphs
from onnx_qrewrite.rewriter.report import Unlowered, op_key

if TYPE_CHECKING:
    from onnx_qrewrite.rewriter.engine import EngineOptions

__all__ = ["Match", "match_nodes"]


logger = logging.getLogger(__name__)


#: Standard ops that hold subgraphs (nodes of other domains may too).
_CONTROL_FLOW = frozenset({"If", "Loop", "Scan", "SequenceMap"})


@dataclass(slots=True)
class Match:
    """Which rule rewrites the node at ``index`` of a scope, and its plan. Not the node's Site: the
    matches wait for their builds all together, and 40k Sites with the node's wrapper and its
    names read out of protobuf were ~20 MB of a 100k-node rewrite's peak memory; the build makes
    the Site again (:func:`_site_of`)."""

    index: int
    rule: Rule
    plan: Plan
    #: The node's structure when its check was decided per structure (builders/_facts.py), one
    #: object shared by the nodes of that structure; else None. The build keys a builder's
    #: template key on it (``template_key_of_structure``, apply.py).
    structure: Hashable = None


def _in_order(rules: list[Rule]) -> list[Rule]:
    """A node's candidate rules in the order they are tried: approximate ones first when allowed
    (they were asked for), then exact, then bounded; catalogue order within each group, except that
    a rule's ``precedes`` puts it before the rules it names whatever their exactness (a named form
    taking over from the shipped rules: catalogue.py)."""
    rank = {APPROXIMATE: 0, EXACT: 1, BOUNDED: 2}
    ordered = sorted(rules, key=lambda r: rank[r.exactness])
    return with_precedence(ordered) if any(r.precedes for r in ordered) else ordered


def _try_rule(rule: Rule, site: Site, options: EngineOptions, memo: CheckMemo | None = None) -> Plan:
    if rule.exactness not in options.allow:
        flag = " (--allow-approximate)" if rule.exactness == APPROXIMATE else ""
        raise NotApplicable(f"{rule.exactness} rule: runs only when asked{flag}")
    builder = rule.implementation
    current = site.scope.default_opset
    if rule.min_opset is not None and current < rule.min_opset:
        raise NoMatch(f"model opset {current} is below the rule's min_opset {rule.min_opset}")
    if rule.max_opset is not None and current > rule.max_opset:
        raise NoMatch(f"model opset {current} is above the rule's max_opset {rule.max_opset}")
    if current > opset_mod.MAX_RUNTIME_OPSET:
        # The builders' ops are proven at opsets up to 26 (kernel_opsets.py); onnx changed some at
        # 27 and 28 (Range, Mod, BitShift...) and onnxruntime 1.31.1 loads neither.
        raise NoMatch(
            f"model opset {current} is above {opset_mod.MAX_RUNTIME_OPSET}, the highest the rules are written and "
            f"proven for (onnxruntime 1.31.1 loads up to {opset_mod.MAX_RUNTIME_OPSET}; what onnx changed above it "
            "is not described)"
        )
    if memo is not None and getattr(builder, "memo_check", False):
        plan = memo.decide(rule, site, lambda recorded: _check(rule, builder, recorded))
    else:
        plan = _check(rule, builder, site)
    needed = plan.min_opset
    if needed > current:
        if options.keep_opset:
            raise NoMatch(f"needs opset {needed}, model has {current} and the opset is kept")
        if needed > options.max_opset:
            raise NoMatch(f"needs opset {needed}, above the highest allowed ({options.max_opset})")
        if site.scope.is_function:
            raise NoMatch(f"needs opset {needed}; raising the opset of a local function is not supported")
    return plan


def _check(rule: Rule, builder: Any, site: Site) -> Plan:
    """The rule's dtype condition and its builder's check: what :class:`CheckMemo` records."""
    dtype = builder.quantized_dtype(site)
    if rule.dtypes is not None and dtype not in rule.dtypes:
        raise NoMatch(f"dtype {dtype or 'unknown'} is not one of {', '.join(sorted(rule.dtypes))}")
    plan: Plan = builder.check(site, rule.options)
    return plan


@dataclass
class _Pending:
    """A node whose first applicable rule removes it if it is dead (``Plan.remove_if_dead``): decided
    once the whole scope is matched; if something still reads it, its remaining rules are tried."""

    site: Site
    index: int
    rule: Rule
    plan: Plan
    rest: list[Rule]
    reasons: list[str]
    quiet: bool


def _first_applicable(
    site: Site,
    rules: list[Rule],
    options: EngineOptions,
    reasons: list[str],
    quiet: bool,
    *,
    removal: bool,
    memo: CheckMemo | None = None,
) -> tuple[Rule | None, Plan | None, int, bool]:
    """The first of ``rules`` that applies to ``site``, its plan and its position (reasons of the
    others appended to ``reasons``), and whether every decline was "not applicable". Removal rules
    (``Plan.remove_if_dead``) count only when ``removal`` (a node is considered for removal once)."""
    for position, rule in enumerate(rules):
        try:
            plan = _try_rule(rule, site, options, memo)
        except NoMatch as why:
            # Approximate rules are extras asked for: their declining never makes a node an error.
            quiet = quiet and (isinstance(why, NotApplicable) or rule.exactness == APPROXIMATE)
            reasons.append(f"{rule.id}: {why}")
            logger.debug("rule %s does not apply to %s: %s", rule.id, site.label, why)
            continue
        if plan.remove_if_dead and not removal:
            reasons.append(f"{rule.id}: its outputs are still read once the other rewrites are applied")
            continue
        return rule, plan, position, quiet
    return None, None, len(rules), quiet


def match_nodes(
    model: onnx.ModelProto,
    catalogue: Catalogue,
    options: EngineOptions,
    external: ExternalData | None,
    restrict: Mapping[tuple[str, str], frozenset[str]] | None = None,
) -> tuple[list[Scope], dict[int, list[Match]], list[Unlowered], collections.Counter[str]]:
    """Which rule rewrites which node; also counts ops on the way (one walk over the model).

    ``restrict`` (a later pass, see :func:`_run`): only the nodes it lists, keyed by (scope path,
    node name), are matched, only against ``on_replacements`` rules not in the node's lineage (the
    rules that made it and its ancestors); a node none of them lowers stays as it was made."""
    scopes = iter_scopes(model, external, op_codes=True)
    matches: dict[int, list[Match]] = {}
    unlowered: list[Unlowered] = []
    counts: collections.Counter[tuple[str, str]] = collections.Counter()
    candidates_of: dict[tuple[str, str], list[Rule]] = {}
    same_shape_ops = catalogue.same_shape_ops
    chosen = options.node_rules
    by_id = {r.id: r for r in catalogue} if chosen is not None else {}

    def decide(
        s: int, site: Site, index: int, rule: Rule | None, plan: Plan | None, reasons, quiet, memo: CheckMemo | None
    ) -> None:
        if rule is not None and plan is not None:
            structure = memo.structure_of_site(site) if memo is not None else None
            matches.setdefault(s, []).append(Match(index, rule, plan, structure))
        elif not quiet and restrict is None:
            node = site.node
            unlowered.append(Unlowered(site.label, node.op_type, node.domain, site.scope.path, tuple(reasons)))

    def candidates_for(key: tuple[str, str]) -> list[Rule]:
        found = candidates_of.get(key)
        if found is None:
            found = candidates_of[key] = _in_order(catalogue.candidates(*key))
        return found

    for s, scope in enumerate(scopes):
        pending: list[_Pending] = []
        memo = CheckMemo() if options.memo_checks else None
        nodes = scope.container.node
        codes, keys = scope.op_codes()
        for code, n in collections.Counter(codes).items():
            counts[keys[code]] += n
        for index in _maybe_rewritten(codes, keys, candidates_for, chosen is not None):
            node = nodes[index]
            key = keys[codes[index]]
            picked = chosen.get((scope.path, index)) if chosen is not None else None
            candidates: list[Rule] | None
            if picked is not None:
                candidates = [by_id[rule_id] for rule_id in picked if rule_id in by_id]
                if not candidates:
                    continue
            else:
                candidates = candidates_for(key)
            if restrict is not None:
                lineage = restrict.get((scope.path, node.name))
                if lineage is None:
                    continue
                candidates = [r for r in candidates if r.on_replacements and r.id not in lineage]
            if not candidates:
                continue
            site = Site(node, scope, same_shape_ops)
            # The next candidates may read its outputs: they find it without the index.
            scope.note_producer(node, site.outputs)
            reasons: list[str] = []
            # A standard-domain node every candidate declines as "not applicable" is fine as it is.
            quiet = key[0] in ("", "ai.onnx")
            rule, plan, position, quiet = _first_applicable(
                site, candidates, options, reasons, quiet, removal=True, memo=memo
            )
            if plan is not None and plan.remove_if_dead:
                assert rule is not None
                pending.append(_Pending(site, index, rule, plan, candidates[position + 1 :], reasons, quiet))
                continue
            decide(s, site, index, rule, plan, reasons, quiet, memo)
        if pending:
            dead = _dead(scope, matches.get(s, []), pending)
            for p in pending:
                if p.index in dead:
                    matches.setdefault(s, []).append(Match(p.index, p.rule, p.plan))
                    continue
                p.reasons.append(f"{p.rule.id}: its outputs are still read once the other rewrites are applied")
                rule, plan, _, quiet = _first_applicable(
                    p.site, p.rest, options, p.reasons, p.quiet, removal=False, memo=memo
                )
                decide(s, p.site, p.index, rule, plan, p.reasons, quiet, memo)
            matches.get(s, []).sort(key=lambda m: m.index)
    return scopes, matches, unlowered, collections.Counter({op_key(d, o): n for (d, o), n in counts.items()})


def _maybe_rewritten(
    codes: array.array,
    keys: list[tuple[str, str]],
    candidates_for: Callable[[tuple[str, str]], list[Rule]],
    every: bool,
) -> list[int] | range:
    """Indices of the nodes whose op some rule of the catalogue matches, in node order (``every``:
    all of them, for a per-node rule choice that may name any node). The other nodes are never
    read again: each read of a node from protobuf makes a wrapper object, and on a chain three
    nodes in five are ops no rule rewrites."""
    if every:
        return range(len(codes))
    wanted = [code for code, key in enumerate(keys) if candidates_for(key)]
    if len(wanted) == len(keys):
        return range(len(codes))
    if not wanted:
        return []
    found: list[int] = np.flatnonzero(np.isin(np.frombuffer(codes, dtype=f"u{codes.itemsize}"), wanted)).tolist()
    return found


def _names_read_inside(node: onnx.NodeProto) -> Iterator[str]:
    """Every name the node's subgraphs (at any depth) take as input or give as output: a superset
    of the outer-scope values they read."""
    for _, graph in subgraphs(node):
        for inner in graph.node:
            yield from inner.input
            yield from _names_read_inside(inner)
        yield from (o.name for o in graph.output)


def _dead(scope: Scope, matched: list[Match], pending: list[_Pending]) -> set[int]:
    """Indices of the pending removals that nothing reads once the scope's rewrites are applied
    (rewritten nodes read what their plans say; removed nodes read nothing; subgraphs and the
    scope's outputs read what they name). Worklist over reader counts: linear in the scope."""
    container = scope.container
    reads_of = {m.index: m.plan.reads for m in matched if m.plan.reads is not None}
    count: collections.Counter[str] = collections.Counter()
    for index, node in enumerate(container.node):
        count.update(reads_of.get(index, node.input))
        if node.domain not in ("", "ai.onnx") or node.op_type in _CONTROL_FLOW:
            count.update(_names_read_inside(node))
    if isinstance(container, onnx.GraphProto):
        count.update(o.name for o in container.output)
    else:
        count.update(container.output)
    by_index = {p.index: p for p in pending}
    producer = {out: p.index for p in pending for out in p.site.node.output if out}
    dead: set[int] = set()
    work = list(by_index)
    while work:
        index = work.pop()
        node = by_index[index].site.node
        if index in dead or any(count[o] for o in node.output if o):
            continue
        dead.add(index)
        for name in node.input:
            if not name:
                continue
            count[name] -= 1
            upstream = producer.get(name)
            if upstream is not None and upstream not in dead and count[name] <= 0:
                work.append(upstream)
    return dead
