"""The engine's first phase (:mod:`.engine`): which rule rewrites which node, and what that needs
(its plan), reading only. A node's candidate rules are tried in order of exactness; a rule that
removes its node applies only once the whole scope is matched and nothing reads the node."""

from __future__ import annotations

import array
import collections
import logging
import operator
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from onnx_qrewrite import _onnx as onnx
from onnx_qrewrite._dataclass import dataclass
from onnx_qrewrite.io.external_data import ExternalData
from onnx_qrewrite.io.heap import return_freed_memory
from onnx_qrewrite.rewriter import opset as opset_mod
from onnx_qrewrite.rewriter.builders import NoMatch, NotApplicable, Plan, Site
from onnx_qrewrite.rewriter.builders._facts import BulkAsk, CheckMemo, replay_all, structure_from
from onnx_qrewrite.rewriter.catalogue import Catalogue, Rule, is_unnamed_vendor_quant_op, with_precedence
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
    _allowed(rule, options)
    builder = rule.implementation
    _opset_allows(rule, site.scope)
    if memo is not None and getattr(builder, "memo_check", False):
        plan = memo.decide(rule, site, lambda recorded: _check(rule, builder, recorded))
    else:
        plan = _check(rule, builder, site)
    _plan_allowed(plan, site.scope, options)
    return plan


def _allowed(rule: Rule, options: EngineOptions) -> None:
    """Decline a rule whose exactness is not asked for."""
    if rule.exactness not in options.allow:
        flag = " (--allow-approximate)" if rule.exactness == APPROXIMATE else ""
        raise NotApplicable(f"{rule.exactness} rule: runs only when asked{flag}")


def _opset_allows(rule: Rule, scope: Scope) -> None:
    """Decline a rule outside its opset range in ``scope`` (the same for all the scope's nodes)."""
    current = scope.default_opset
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


def _plan_allowed(plan: Plan, scope: Scope, options: EngineOptions) -> None:
    """Decline a plan whose opset the model may not be raised to (a function of the plan and the
    scope alone: nodes sharing a recorded plan share this outcome too)."""
    needed = plan.min_opset
    current = scope.default_opset
    if needed > current:
        if options.keep_opset:
            raise NoMatch(f"needs opset {needed}, model has {current} and the opset is kept")
        if needed > options.max_opset:
            raise NoMatch(f"needs opset {needed}, above the highest allowed ({options.max_opset})")
        if scope.is_function:
            raise NoMatch(f"needs opset {needed}; raising the opset of a local function is not supported")


def _check(rule: Rule, builder: Any, site: Site) -> Plan:
    """The rule's dtype condition and its builder's check: what :class:`CheckMemo` records."""
    dtype = builder.quantized_dtype(site)
    if rule.dtypes is not None and dtype not in rule.dtypes:
        raise NoMatch(f"dtype {dtype or 'unknown'} is not one of {', '.join(sorted(rule.dtypes))}")
    plan: Plan = builder.check(site, rule.options)
    if rule.exactness == BOUNDED and plan.bound is None and plan.bound_formula is None and not plan.remove_if_dead:
        # A bounded rewrite whose node records no bound could not be checked by verify at the node,
        # and every difference it makes would be held to the exact part's tolerance downstream.
        from onnx_qrewrite.errors import InternalError

        raise InternalError(
            f"rule {rule.id} is bounded but its builder {rule.builder} gave node {site.label!r} no bound "
            "(Plan.bound or Plan.bound_formula): a bug in onnx-qrewrite"
        )
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

    # Nodes of one structure decided together (see _Grouped) unless a node's rules are chosen, a
    # later pass restricts them, each decline is to be logged, or checks are not recorded.
    grouped = chosen is None and restrict is None and options.memo_checks and not logger.isEnabledFor(logging.DEBUG)
    # Calls of the model's own functions are not vendor ops: their bodies are scopes of their own.
    local_functions = {(f.domain, f.name) for f in model.functions}
    for s, scope in enumerate(scopes):
        pending: list[_Pending] = []
        memo = CheckMemo() if options.memo_checks else None
        nodes = scope.container.node
        codes, keys = scope.op_codes()
        for code, n in collections.Counter(codes).items():
            counts[keys[code]] += n
        if restrict is None:
            unlowered.extend(_unnamed(scope, codes, keys, candidates_for, local_functions, same_shape_ops))
        one_by_one = not grouped
        if grouped and memo is not None:
            group = _Grouped(scope, memo, options, same_shape_ops)
            unlowered_before = len(unlowered)
            try:
                for chunk in _chunks(_maybe_rewritten(codes, keys, candidates_for, False)):
                    group.decide(chunk, keys, codes, candidates_for)
                    # The chunk's decisions now (chunks come in node order): kept for the whole
                    # scope, they were ~6 MB of a 100k-node rewrite's peak memory.
                    for index, site, rule, plan, why, quiet, structure in sorted(group.decided, key=_FIRST):
                        if rule is not None and plan is not None:
                            matches.setdefault(s, []).append(Match(index, rule, plan, structure))
                        elif not quiet:
                            unlowered_site = site if site is not None else Site(nodes[index], scope, same_shape_ops)
                            decide(s, unlowered_site, index, None, None, why, quiet, None)
                    group.decided.clear()
            except Exception:  # noqa: BLE001 - a check failed: matched one by one, in node order, it fails
                # for the first node that fails (taken together, another structure's node may
                # have come first); nothing of the group's decisions is kept.
                one_by_one, memo = True, CheckMemo()
                matches.pop(s, None)
                del unlowered[unlowered_before:]
            else:
                pending = group.pending
                pending.sort(key=_INDEX)
        for index in _maybe_rewritten(codes, keys, candidates_for, chosen is not None) if one_by_one else ():
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
    if grouped:
        return_freed_memory()  # the chunks' names and answers (io/heap.py): the build allocates among them
    return scopes, matches, unlowered, collections.Counter({op_key(d, o): n for (d, o), n in counts.items()})


#: How many candidates :class:`_Grouped` reads and decides at once: what it holds of their names
#: is bounded by this, not by the scope (the matching phase's memory is within a rewrite's peak).
_GROUP_CHUNK = 1024
_FIRST = operator.itemgetter(0)
_INDEX = operator.attrgetter("index")


def _chunks(indices: list[int] | range) -> Iterator[list[int] | range]:
    for start in range(0, len(indices), _GROUP_CHUNK):
        yield indices[start : start + _GROUP_CHUNK]


#: A node's decision as :class:`_Grouped` makes it: its index, its Site if one was made, the rule
#: and plan (None: none applies), the reasons of the rules that declined, whether every decline
#: was "not applicable", and its structure (for the build's template keys: ``Match.structure``).
_Decided = tuple[int, "Site | None", "Rule | None", "Plan | None", list[str], bool, Hashable]


class _Grouped:
    """A scope's candidates decided structure by structure instead of node by node.

    The candidates (a chunk at a time) are read once, for their names and structure
    (``_facts.structure_from``), and grouped by structure; each group goes through its candidate
    rules together. Where a rule's check was recorded for that structure (``CheckMemo``), each
    recorded question is asked of all the group's nodes at once (``_facts.replay_all``: one
    comprehension per question; producers found in one search of the producer index, their ops
    read from the walk's codes), and every node whose answers are the recorded ones gets that
    check's outcome, as :meth:`CheckMemo.decide` would give it node by node. The others (a head
    not recorded yet, another path through the check, a builder without recorded checks) are
    decided one by one as before, in node order, and the rest of the group is tried again
    against the traces that adds. The decisions are what deciding node by node gives: the same
    checks' outcomes, the same declines' reasons, in node order once sorted."""

    __slots__ = ("decided", "memo", "options", "pending", "same_shape_ops", "scope")

    def __init__(self, scope: Scope, memo: CheckMemo, options: EngineOptions, same_shape_ops: frozenset[str]):
        self.scope = scope
        self.memo = memo
        self.options = options
        self.same_shape_ops = same_shape_ops
        self.decided: list[_Decided] = []
        self.pending: list[_Pending] = []

    def decide(
        self,
        indices: list[int] | range,
        keys: list[tuple[str, str]],
        codes: array.array,
        candidates_for: Callable[[tuple[str, str]], list[Rule]],
    ) -> None:
        """Decide the nodes at ``indices`` (a chunk of the scope's candidates, in node order)."""
        nodes = self.scope.container.node
        groups: dict[Hashable, list[int]] = {}
        names: dict[int, tuple[tuple[str, ...], tuple[str, ...]]] = {}
        outputs_of: dict[int, tuple[str, ...]] = {}
        for index in indices:
            node = nodes[index]
            # Slices: see Site.__init__ (the names it would read).
            inputs, outputs = tuple(node.input[:]), tuple(node.output[:])
            domain, op_type = keys[codes[index]]
            structure = structure_from(domain, op_type, node.attribute, inputs, outputs)
            groups.setdefault(structure, []).append(index)
            names[index] = (inputs, outputs)
            outputs_of[index] = outputs
        ask = self._bulk_ask(outputs_of)
        for structure, members in groups.items():
            candidates = candidates_for((structure[0], structure[1]))  # type: ignore[index]
            if candidates:
                _Group(self, self.memo.shared_structure(structure), candidates, members, names, ask).run()

    def _bulk_ask(self, outputs_of: Mapping[int, tuple[str, ...]]) -> BulkAsk:
        """The bulk forms of the commonest recorded questions (see :func:`_facts.replay_all`)."""
        from onnx_qrewrite.rewriter.builders._qdq import value_shapes

        scope, same_shape_ops = self.scope, self.same_shape_ops
        elem_type, producer_op, value_shape, constant = (
            Site.elem_type,
            Site.producer_op,
            Site.value_shape,
            Site.constant,
        )

        known: dict[str, int] = {}  # the chunk's names whose writers were found (producer_indices)

        def ask(method: Any, names: list[str]) -> list[Any] | None:
            if method is elem_type:
                return scope.elem_types(names)
            if method is producer_op:
                return scope.producer_ops(names, outputs_of, known)
            if method is value_shape:
                return value_shapes(scope, names, same_shape_ops, outputs_of, known)
            if method is constant:
                return scope.constants(names, outputs_of, known)
            return None

        return ask


class _Group:
    """One structure's nodes of a chunk, going through their candidate rules (see :class:`_Grouped`)."""

    __slots__ = (
        "ask",
        "at",
        "candidates",
        "members",
        "names",
        "owner",
        "quiet",
        "quiet_at_first",
        "reached",
        "reasons",
        "structure",
    )

    def __init__(
        self,
        owner: _Grouped,
        structure: Hashable,
        candidates: list[Rule],
        members: list[int],
        names: Mapping[int, tuple[tuple[str, ...], tuple[str, ...]]],
        ask: BulkAsk,
    ):
        self.owner = owner
        self.structure = structure
        self.candidates = candidates
        self.members = members
        self.names = names
        self.ask = ask
        quiet = structure[0] in ("", "ai.onnx")  # type: ignore[index]
        #: Per node: the reasons of the rules that declined it so far, whether all were "not
        #: applicable" (see _first_applicable), and whether a recorded check decided it once.
        self.reasons: dict[int, list[str]] = {}
        self.quiet: dict[int, bool] = {}
        self.quiet_at_first = quiet
        self.reached: set[int] = set()
        self.at: dict[int, int] = {}  # (entries made as needed: most nodes stay at 0, quiet as at first)

    def run(self) -> None:
        """Decide every member: together while recorded checks answer, else one by one."""
        left = self.members
        rounds = 0
        while left:
            left = self._together(left)
            if not left:
                return
            rounds += 1
            first, left = left[0], left[1:]
            self._alone(first)
            if rounds > _MAX_ROUNDS:  # each round's node added no trace the others replay
                for index in left:
                    self._alone(index)
                return

    def _together(self, indices: list[int]) -> list[int]:
        """Take ``indices`` (each at its own next rule) through the rules whose recorded checks
        decide them; returns those left to decide one by one, in node order."""
        owner, memo, scope, options = self.owner, self.owner.memo, self.owner.scope, self.owner.options
        by_position: dict[int, list[int]] = {}
        for index in indices:
            by_position.setdefault(self.at.get(index, 0), []).append(index)
        left: list[int] = []
        waiting: list[int] = []
        for position, rule in enumerate(self.candidates):
            waiting = sorted(waiting + by_position.pop(position, []))
            if not waiting:
                continue
            try:
                _allowed(rule, options)
                builder = rule.implementation
                _opset_allows(rule, scope)
            except NoMatch as why:
                waiting = self._declined(waiting, rule, why, position)
                continue
            traces = memo.traces_for(rule, self.structure) if getattr(builder, "memo_check", False) else None
            if not traces:
                left += waiting
                waiting = []
                continue
            try:
                found = replay_all(
                    traces,
                    [self.names[i][0] for i in waiting],
                    [self.names[i][1] for i in waiting],
                    Site(scope.container.node[waiting[0]], scope, owner.same_shape_ops),
                    self.ask,
                )
            except Exception:  # noqa: BLE001 - decided one by one, which raises it for the first node in order
                left += waiting
                waiting = []
                continue
            going_on: list[int] = []
            allowed: dict[int, NoMatch | None] = {}  # per plan (by id): _plan_allowed's outcome
            for index, trace in zip(waiting, found, strict=True):
                if trace is None:
                    left.append(index)
                    continue
                self.reached.add(index)
                plan = trace.plan
                if plan is None:
                    assert trace.declined is not None
                    self._note_decline(index, rule, type(trace.declined)(*trace.declined.args), position)
                    going_on.append(index)
                    continue
                refused = allowed.get(id(plan), _UNASKED)
                if refused is _UNASKED:
                    try:
                        _plan_allowed(plan, scope, options)
                        refused = allowed[id(plan)] = None
                    except NoMatch as why:
                        refused = allowed[id(plan)] = why
                if refused is not None:
                    self._note_decline(index, rule, refused, position)
                    going_on.append(index)
                    continue
                self._found(index, rule, plan, position, None)
            waiting = going_on
        for index in waiting:  # every rule declined
            owner.decided.append((index, None, None, None, self._reasons(index), self._quiet(index), None))
        left.sort()
        return left

    def _reasons(self, index: int) -> list[str]:
        found = self.reasons.get(index)
        if found is None:
            found = self.reasons[index] = []
        return found

    def _quiet(self, index: int) -> bool:
        return self.quiet.get(index, self.quiet_at_first)

    def _declined(self, indices: list[int], rule: Rule, why: NoMatch, position: int) -> list[int]:
        for index in indices:
            self._note_decline(index, rule, why, position)
        return indices

    def _note_decline(self, index: int, rule: Rule, why: NoMatch, position: int) -> None:
        """As :func:`_first_applicable` notes a decline."""
        self.quiet[index] = self._quiet(index) and (isinstance(why, NotApplicable) or rule.exactness == APPROXIMATE)
        self._reasons(index).append(f"{rule.id}: {why}")
        self.at[index] = position + 1

    def _found(self, index: int, rule: Rule, plan: Plan, position: int, site: Site | None) -> None:
        owner = self.owner
        if plan.remove_if_dead:
            if site is None:
                site = Site(owner.scope.container.node[index], owner.scope, owner.same_shape_ops)
            rest = self.candidates[position + 1 :]
            owner.pending.append(_Pending(site, index, rule, plan, rest, self._reasons(index), self._quiet(index)))
            return
        structure = self.structure if index in self.reached else None
        owner.decided.append(
            (index, site, rule, plan, _NO_REASONS, True, structure)
        )  # (read only when no rule applies)

    def _alone(self, index: int) -> None:
        """Decide one node as matching always did, from its next rule on."""
        owner = self.owner
        scope = owner.scope
        node = scope.container.node[index]
        site = Site(node, scope, owner.same_shape_ops)
        scope.note_producer(node, site.outputs)
        start = self.at.get(index, 0)
        rule, plan, position, quiet = _first_applicable(
            site,
            self.candidates[start:],
            owner.options,
            self._reasons(index),
            self._quiet(index),
            removal=True,
            memo=owner.memo,
        )
        self.quiet[index] = quiet
        if owner.memo.structure_of_site(site) is not None:
            self.reached.add(index)
        if rule is None or plan is None:
            owner.decided.append((index, site, None, None, self._reasons(index), quiet, None))
            return
        self._found(index, rule, plan, start + position, site)


_UNASKED: Any = object()
#: The reasons of a node a rule applies to (never read; never appended to).
_NO_REASONS: list[str] = []
#: Rounds of :meth:`_Group.run` that decide a node alone and try the rest together again: each
#: may add a trace (a check records at most this many per head), after which the rest go alone.
_MAX_ROUNDS = 9


def _unnamed(
    scope: Scope,
    codes: array.array,
    keys: list[tuple[str, str]],
    candidates_for: Callable[[tuple[str, str]], list[Rule]],
    local_functions: set[tuple[str, str]],
    same_shape_ops: frozenset[str],
) -> list[Unlowered]:
    """The scope's vendor-domain quantization nodes that no rule of the catalogue names, in node
    order: said as unlowered, not kept silently (review finding X2: onnxruntime's NHWC QLinearConv
    stayed in a rewrite that exited 0). Calls of the model's own functions are not vendor ops."""
    said = [
        code
        for code, key in enumerate(keys)
        if not candidates_for(key) and key not in local_functions and is_unnamed_vendor_quant_op(*key)
    ]
    if not said:
        return []
    out = []
    for index in np.flatnonzero(np.isin(np.frombuffer(codes, dtype=f"u{codes.itemsize}"), said)).tolist():
        domain, op = keys[codes[index]]
        why = (
            f"no rule of the catalogue lowers {domain}::{op} (a quantization op of a non-standard domain; "
            "it would stay in the output)"
        )
        site = Site(scope.container.node[index], scope, same_shape_ops)
        out.append(Unlowered(site.label, op, domain, scope.path, (why,)))
    return out


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
