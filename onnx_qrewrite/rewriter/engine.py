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

import array
import collections
import dataclasses
import gc
import itertools
import logging
import operator
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from onnx_qrewrite import _onnx as onnx
from onnx_qrewrite._dataclass import dataclass
from onnx_qrewrite.errors import InternalError, InvalidModelError, LoweringError, UsageError
from onnx_qrewrite.io._protowire import NODE_INPUT, encode_metadata, encode_node_chunks, frame_nodes, replace_nodes
from onnx_qrewrite.io._wire import length_prefixed
from onnx_qrewrite.io.encoded import EncodedModel, to_proto
from onnx_qrewrite.io.external_data import ExternalData
from onnx_qrewrite.io.heap import return_freed_memory
from onnx_qrewrite.io.spool import Spool
from onnx_qrewrite.progress import ProgressSink, stage
from onnx_qrewrite.rewriter import opset as opset_mod
from onnx_qrewrite.rewriter import provenance as provenance_mod
from onnx_qrewrite.rewriter.builders import ConstantPool, Emitter, NoMatch, NotApplicable, Plan, Site
from onnx_qrewrite.rewriter.builders._facts import CheckMemo
from onnx_qrewrite.rewriter.builders._stamp import Template
from onnx_qrewrite.rewriter.catalogue import Catalogue, Rule, with_precedence
from onnx_qrewrite.rewriter.contract import APPROXIMATE, BOUNDED, EXACT, EXACTNESS
from onnx_qrewrite.rewriter.graph import NameAllocator, Scope, iter_scopes, subgraphs
from onnx_qrewrite.rewriter.report import RewriteReport, Unlowered, count_ops, op_key, rewrite_kinds

__all__ = ["DEFAULT_ALLOW", "EngineOptions", "run"]

logger = logging.getLogger(__name__)


#: Exactness levels a rewrite may use unless asked otherwise.
DEFAULT_ALLOW: frozenset[str] = frozenset({EXACT, BOUNDED})
#: Standard ops that hold subgraphs (nodes of other domains may too).
_CONTROL_FLOW = frozenset({"If", "Loop", "Scan", "SequenceMap"})


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
_PLAN_REMOVES = operator.attrgetter("plan.remove_if_dead")


@dataclass(slots=True)
class _Match:
    """Which rule rewrites the node at ``index`` of a scope, and its plan. Not the node's Site: the
    matches wait for their builds all together, and 40k Sites with the node's wrapper and its
    names read out of protobuf were ~20 MB of a 100k-node rewrite's peak memory; the build makes
    the Site again (:func:`_site_of`)."""

    index: int
    rule: Rule
    plan: Plan


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


def _match(
    model: onnx.ModelProto,
    catalogue: Catalogue,
    options: EngineOptions,
    external: ExternalData | None,
    restrict: Mapping[tuple[str, str], frozenset[str]] | None = None,
) -> tuple[list[Scope], dict[int, list[_Match]], list[Unlowered], collections.Counter[str]]:
    """Which rule rewrites which node; also counts ops on the way (one walk over the model).

    ``restrict`` (a later pass, see :func:`_run`): only the nodes it lists, keyed by (scope path,
    node name), are matched, only against ``on_replacements`` rules not in the node's lineage (the
    rules that made it and its ancestors); a node none of them lowers stays as it was made."""
    scopes = iter_scopes(model, external, op_codes=True)
    matches: dict[int, list[_Match]] = {}
    unlowered: list[Unlowered] = []
    counts: collections.Counter[tuple[str, str]] = collections.Counter()
    candidates_of: dict[tuple[str, str], list[Rule]] = {}
    same_shape_ops = catalogue.same_shape_ops
    chosen = options.node_rules
    by_id = {r.id: r for r in catalogue} if chosen is not None else {}

    def decide(s: int, site: Site, index: int, rule: Rule | None, plan: Plan | None, reasons, quiet) -> None:
        if rule is not None and plan is not None:
            matches.setdefault(s, []).append(_Match(index, rule, plan))
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
            decide(s, site, index, rule, plan, reasons, quiet)
        if pending:
            dead = _dead(scope, matches.get(s, []), pending)
            for p in pending:
                if p.index in dead:
                    matches.setdefault(s, []).append(_Match(p.index, p.rule, p.plan))
                    continue
                p.reasons.append(f"{p.rule.id}: its outputs are still read once the other rewrites are applied")
                rule, plan, _, quiet = _first_applicable(
                    p.site, p.rest, options, p.reasons, p.quiet, removal=False, memo=memo
                )
                decide(s, p.site, p.index, rule, plan, p.reasons, quiet)
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


def _dead(scope: Scope, matched: list[_Match], pending: list[_Pending]) -> set[int]:
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


def _has_external_constants(scope: Scope) -> bool:
    """Whether a Constant node of ``scope`` holds external data (from the scope's index of its
    Constant nodes, instead of a look at every node's op)."""
    nodes = scope.container.node
    return any(
        any(a.t.data_location == onnx.TensorProto.EXTERNAL for a in nodes[i].attribute) for i in scope.constant_nodes
    )


def _apply(
    model: onnx.ModelProto,
    scopes: list[Scope],
    matches: dict[int, list[_Match]],
    report: RewriteReport,
    stamp_templates: bool = True,
    progress: ProgressSink | None = None,
    provenance: str = provenance_mod.DEFAULT_MODE,
    applied: list[_Applied] | None = None,
    later: bool = False,
    earlier: bool = False,
    same_shape_ops: frozenset[str] = frozenset(),
) -> tuple[collections.Counter[str], list[bytes] | Spool | None]:
    """Build every replacement, drop initializers only replaced nodes read, then splice.

    ``applied`` collects what each rewrite replaced and created (for a later pass). ``later``: the
    nodes replaced were made by an earlier pass; their replacements continue the earlier
    replacement they belong to (its name prefix and provenance, see :func:`_inherited_metadata`).
    ``earlier``: the model holds an earlier run's replacements (``EngineOptions.continue_provenance``):
    an exact rule's replacement of one of their nodes continues it the same way.

    Returns the change in op counts and, when the main graph changed, its encoded node list (the
    main graph itself is then left without nodes; see ``encoded``). ``matches`` is consumed: each
    match is let go once its replacement is built, and each replacement is kept as one piece (its
    node fields framed and joined), so that what the matches held is reused for what the
    replacements hold instead of adding to it (a bytes object and three list slots per created
    node were ~60 bytes on top of its ~120 bytes of body).

    In steps: each scope's replacements (:func:`_build_scope`, one :func:`_replacement` each), the
    op counts' change (:func:`_op_delta`), then the checks before splicing and the splice
    (:func:`_assemble`).
    """
    total = sum(len(ms) for ms in matches.values())
    if progress is not None:
        progress("rewriting nodes", 0, total)
    build = _Build(
        NameAllocator(model, scopes, frozen=True),
        report,
        stamp_templates,
        provenance,
        applied,
        later,
        earlier,
        progress,
        total,
        guard=any(map(_PLAN_REMOVES, itertools.chain.from_iterable(matches.values()))),
        same_shape_ops=same_shape_ops,
        scopes=scopes,
    )
    pools: dict[int, ConstantPool] = {}
    built: dict[int, Mapping[int, bytes]] = {}
    #: The main graph's new node list, written out as its replacements are built instead of held
    #: (io/spool.py: they were ~40 MB of a 100k-node chain's peak), when the nodes left as they are
    #: can be encoded as they are reached: no scope is a subgraph (a node holding one is encoded
    #: only after its bodies are rewritten, at the splice) and no Constant holds external data.
    spool: Spool | None = None
    main = next(sc for sc in scopes if sc.container is model.graph)
    keep_main_encoded = not _has_external_constants(main)
    can_spool = keep_main_encoded and all(sc.parent is None for sc in scopes)
    for s, scope in enumerate(scopes):
        root = scope.root
        pool = pools.get(id(root))
        if pool is None:
            pool = pools[id(root)] = ConstantPool(root, build.names)
        pending = matches.pop(s, [])
        spooled = can_spool and bool(pending) and scope.container is model.graph
        if spooled:
            spool = Spool()
        # Which of the scope's nodes an earlier run's replacement made (their provenance).
        made = provenance_mod.attribute_nodes(scope.container.node) if earlier and pending else None
        built[s] = _build_scope(build, scope, pool, pending, spool if spooled else None, made)
    delta = _op_delta(build, pools)
    with stage(progress, "assembling the graph"):
        return delta, _assemble(model, scopes, build, built, pools, keep_main_encoded, spool)


@dataclass(slots=True)
class _Build:
    """What building the replacements shares across scopes (see :func:`_apply`)."""

    names: NameAllocator
    report: RewriteReport
    stamp_templates: bool
    provenance: str
    applied: list[_Applied] | None
    later: bool
    #: The model holds an earlier run's replacements (``EngineOptions.continue_provenance``).
    earlier: bool
    progress: ProgressSink | None
    total: int
    #: Whether some match removes its node as dead: every rewrite's reads are then collected.
    guard: bool
    #: The catalogue's shape-preserving ops (``Site.same_shape_ops``), for the Sites made again.
    same_shape_ops: frozenset[str] = frozenset()
    done: int = 0
    templates: dict[tuple, Template | None] = dataclasses.field(default_factory=dict)
    #: rule id -> its builder (``Rule.implementation`` looks it up).
    builders: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: Initializers some replaced node read and its replacement does not: removal candidates.
    dropped: set[str] = dataclasses.field(default_factory=set)
    #: Inputs of replaced nodes that their replacements still read (and everything replacements
    #: read whose plans say they read more than their node's inputs), among the initializers: only
    #: ``dropped - still_read`` is asked, and ``dropped`` holds initializers only (every other
    #: name kept here was ~5.6 MB, set and strings, of a 100k-node chain's peak memory).
    still_read: set[str] = dataclasses.field(default_factory=set)
    #: Every scope rewritten: where an initializer may be (see :meth:`keep_read`).
    scopes: Sequence[Scope] = ()
    #: Per root scope: outputs of nodes removed as dead, and what the other replacements read
    #: (checked against each other before splicing; collected only when something is removed).
    removed: dict[int, set[str]] = dataclasses.field(default_factory=dict)
    read_by_rewrites: dict[int, set[str]] = dataclasses.field(default_factory=dict)
    #: Counted per distinct op (and per distinct tuple of created ops) while rewriting, not per node.
    replaced_ops: collections.Counter[tuple[str, str]] = dataclasses.field(default_factory=collections.Counter)
    created_counts: collections.Counter[tuple[str, ...]] = dataclasses.field(default_factory=collections.Counter)

    #: The initializer names of every scope, taken on the first :meth:`keep_read`: the one scope's
    #: own (live) index, or the union of several once. A loop over the scopes per kept name cost
    #: (kept names x scopes): 43 s instead of 2 s for 3000 Q/DQ pairs beside 3000 If subgraphs.
    #: Names a build adds later are its own constants, never a replaced node's input (``dropped``).
    initializer_names: Collection[str] | None = dataclasses.field(default=None, init=False, repr=False)

    def keep_read(self, name: str) -> None:
        """Note ``name`` as still read, if it names an initializer of any scope (see ``still_read``;
        any scope's, as ``dropped`` may hold an outer graph's)."""
        names = self.initializer_names
        if names is None:
            own = [scope.initializer_names() for scope in self.scopes]
            names = self.initializer_names = own[0] if len(own) == 1 else set().union(*own)
        if name in names:
            self.still_read.add(name)


def _build_scope(
    build: _Build,
    scope: Scope,
    pool: ConstantPool,
    pending: list[_Match],
    spool: Spool | None,
    made: Sequence[Any] | None = None,
) -> Mapping[int, bytes]:
    """The replacements of one scope's matches (consumed), by node index; with a ``spool``, the
    scope's whole new node list is written to it as they are built (each replacement kept empty,
    as one bit: :class:`_Spooled`).
    ``made``: per node, the earlier run's replacement that made it, if any (``build.earlier``)."""
    replacements: dict[int, bytes] = {}
    spooled = _Spooled(len(scope.container.node)) if spool is not None else None
    pending.reverse()
    # Each replaced node's op, from the codes the scope walk noted: one shared string per op
    # in the report entries, not a new one read out of protobuf per rewrite (~2 MB at 100k).
    codes, keys = scope.op_codes()
    container = scope.container
    bounded = _bounded_owners(container.node, made) if made is not None else frozenset()
    nodes = container.node
    cursor = 0  # the first node of the spooled list not yet written
    builders, applied, progress = build.builders, build.applied, build.progress
    add_rewrite = build.report.rewrites.add
    root_id = id(scope.root)
    # A named node's label (Site.label) in the main graph is its name, read here once for the
    # label, the provenance origin and the name prefix (each read out of protobuf is a new string).
    main = scope.path == "main"
    while pending:
        m = pending.pop()
        rule, plan = m.rule, m.plan
        site = Site(nodes[m.index], scope, build.same_shape_ops)
        node = site.node
        name = node.name
        builder = builders.get(rule.id)
        if builder is None:
            builder = builders[rule.id] = rule.implementation
        # An exact rule's replacement of a node an earlier run made continues that replacement;
        # another rule's ends it, and says so where the earlier one declared a bound.
        earlier = made[m.index] if made is not None else None
        inherit = build.later or (earlier is not None and rule.exactness == EXACT)
        superseded = earlier if not inherit and earlier in bounded else None
        piece, created_nodes, created_ops, reads = _replacement(
            build, site, m, builder, scope, pool, inherit, superseded, name
        )
        if spool is not None:
            if cursor < m.index:  # (none between a chain's quantizer and its matmul)
                _spool_unchanged(spool, container, cursor, m.index)
            spool.write(piece)
            cursor = m.index + 1
            spooled.add(m.index)  # type: ignore[union-attr]  # (made with the spool)
        else:
            replacements[m.index] = piece
        if plan.reads is not None or plan.remove_if_dead or build.guard:
            _note_reads(build, site, plan, root_id, reads)
        build.done += 1
        if progress is not None and (build.done % 1024 == 0 or build.done == build.total):
            progress("rewriting nodes", build.done, build.total)
        domain, op_type = keys[codes[m.index]]
        build.replaced_ops[domain, op_type] += 1
        build.created_counts[created_ops] += 1
        if applied is not None:
            applied.append(_Applied(scope.path, name, rule.id, tuple(created_nodes), created_ops))
        # The fields, in order, without an AppliedRewrite (RewriteLog.add keeps most as a kind).
        add_rewrite(
            rule.id,
            name if name and main else site.label,
            op_type,
            domain,
            scope.path,
            created_nodes,
            created_ops,
            plan.notes,
            rule.exactness,
            plan.bound,
            plan.bound_formula,
        )
    if spool is not None:
        _spool_unchanged(spool, container, cursor, len(container.node))
    return replacements if spooled is None else spooled


class _Spooled(Mapping[int, bytes]):
    """Which nodes of a scope whose new node list is in a spool were replaced, one bit each (their
    replacements are in the spool: each reads as empty). A dict of them was ~1.3 MB of a 100k-node
    chain's peak memory, for the ``index in replaced`` the checks before the splice ask."""

    __slots__ = ("_bits", "_count")

    def __init__(self, nodes: int) -> None:
        self._bits = bytearray((nodes + 7) // 8)
        self._count = 0

    def add(self, index: int) -> None:
        """Note node ``index`` (one of the scope's: no type or range check, once per rewrite)."""
        bit = 1 << (index & 7)
        bits = self._bits
        if not bits[index >> 3] & bit:
            bits[index >> 3] |= bit
            self._count += 1

    def __contains__(self, index: object) -> bool:
        if not isinstance(index, int) or not 0 <= index < 8 * len(self._bits):
            return False
        return bool(self._bits[index >> 3] & (1 << (index & 7)))

    def __getitem__(self, index: int) -> bytes:
        if index not in self:
            raise KeyError(index)
        return b""

    def __iter__(self) -> Iterator[int]:
        return (i for i in range(8 * len(self._bits)) if i in self)

    def __len__(self) -> int:
        return self._count


def _bounded_owners(nodes: Sequence[Any], made: Sequence[Any]) -> frozenset[tuple[str, str]]:
    """The earlier run's replacements (rule, origin) that declared a bound (on their first node,
    or every node in "full" mode)."""
    keys = (provenance_mod.BOUND_KEY, Emitter.BOUND_FORMULA_KEY)
    return frozenset(
        owner
        for node, owner in zip(nodes, made, strict=True)
        if owner is not None and any(e.key in keys for e in node.metadata_props)
    )


def _replacement(
    build: _Build,
    site: Site,
    m: _Match,
    builder: Any,
    scope: Scope,
    pool: ConstantPool,
    inherit: bool,
    superseded: tuple[str, str] | None = None,
    name: str | None = None,
) -> tuple[bytes, Sequence[str], tuple[str, ...], set[str] | Template]:
    """One match's replacement, framed as its scope's node fields: stamped from the template of an
    earlier equal build (``builders/_stamp.py``) or built (and recorded as a template); also the
    names of the nodes it created, their ops and the names the replacement reads of its node's
    inputs (for a stamp, its template, which tells them: most rewrites never ask). Notes which inputs
    of the node its replacement leaves unread (``build.dropped``) or still reads. ``inherit``: the
    replacement continues the one that made the node (its provenance and name prefix).
    ``superseded``: the earlier bounded replacement (rule, origin) this one rewrites part of.
    ``name``: the node's name, when the caller has read it."""
    rule, plan = m.rule, m.plan
    node = site.node
    if inherit:
        metadata = _inherited_metadata(node, build.provenance)
        prefix = node.name.rpartition("/")[0] or Emitter.prefix_for(node)
    else:
        if name is None:
            name = node.name  # read once for both
        metadata = Emitter.metadata_for(
            rule.id,
            node,
            rule.exactness,
            plan.bound,
            build.provenance,
            plan.bound_scale,
            plan.bound_formula,
            plan.bound_u8s8,
            name,
        )
        if superseded is not None and metadata[0]:
            mark = encode_metadata([(provenance_mod.SUPERSEDED_KEY, "\t".join(superseded))])
            metadata = (metadata[0] + mark, metadata[1] + mark if metadata[1] else b"")
        outputs = site.outputs
        prefix = Emitter.prefix_for(node, name, outputs[0] if outputs else "")
    key = None
    if build.stamp_templates and hasattr(builder, "template_key"):
        key = builder.template_key(site, rule.options, plan)
        key = None if key is None else (rule.id, id(pool), key)
    template = build.templates.get(key) if key is not None else None
    inputs = site.inputs
    if template is not None:
        piece, created_nodes = template.stamp_framed(site, build.names, prefix, metadata, scope.container)
        # Which inputs the stamp reads is the template's: no set of names per stamp.
        kept, left = template.input_use
        for i in kept:
            build.keep_read(inputs[i])
        for i in left:  # a name also read at a kept position stays: dropped - still_read
            name = inputs[i]
            if name and scope.initializer(name) is not None:
                build.dropped.add(name)
        return piece, created_nodes, template.ops, template
    emit = Emitter(site, rule.id, build.names, pool, emits=builder.contract.emits, metadata=metadata, prefix=prefix)
    builder.build(site, emit, rule.options, plan)
    nodes = emit.nodes
    if not nodes and not plan.remove_if_dead:
        # A removal is valid only once nothing reads the node, which the engine decides (Plan.remove_if_dead);
        # decided by the builder alone, a reader another rule leaves (or no rule chose) read a value no node wrote.
        raise InternalError(f"{site.label}: rule {rule.id} removed the node without Plan.remove_if_dead")
    created_nodes = tuple(n for n, _ in emit.created)
    created_ops = tuple(op for _, op in emit.created)
    reads = emit.names_read()
    if key is not None:
        build.templates[key] = Template.record(emit)
    piece = frame_nodes(scope.container, nodes)
    for name in inputs:
        if not name:
            continue
        if name in reads:
            build.keep_read(name)
        elif scope.initializer(name) is not None:
            build.dropped.add(name)
    return piece, created_nodes, created_ops, reads


def _note_reads(build: _Build, site: Site, plan: Plan, root_id: int, reads: set[str] | Template) -> None:
    """What a replacement reads, where it matters: all of it stays when its plan reads more than
    its node's inputs; a node removed as dead, or any rewrite when some node is (``build.guard``),
    is noted for :func:`_check_removed_are_unread`."""
    if isinstance(reads, Template):
        reads = reads.site_inputs_read(site)
    if plan.reads is not None:  # it reads more than its node's inputs: all of it stays
        for name in reads:
            build.keep_read(name)
    if plan.remove_if_dead:
        build.removed.setdefault(root_id, set()).update(o for o in site.outputs if o)
    elif build.guard:
        build.read_by_rewrites.setdefault(root_id, set()).update(reads)


def _op_delta(build: _Build, pools: dict[int, ConstantPool]) -> collections.Counter[str]:
    """The change in op counts: the replaced ops out, the created ones (and the Constant nodes
    the pools made in functions) in."""
    delta: collections.Counter[str] = collections.Counter()
    for (domain, op_type), n in build.replaced_ops.items():
        delta[op_key(domain, op_type)] -= n
    for ops, n in build.created_counts.items():
        for op in ops:
            delta[op] += n
    delta["Constant"] += sum(len(pool.constant_nodes) for pool in pools.values())  # in functions
    return delta


def _assemble(
    model: onnx.ModelProto,
    scopes: list[Scope],
    build: _Build,
    built: dict[int, Mapping[int, bytes]],
    pools: dict[int, ConstantPool],
    keep_main_encoded: bool,
    spool: Spool | None,
) -> list[bytes] | Spool | None:
    """Check the removals against what is still read, drop initializers nothing reads any more,
    then splice (:func:`_splice`)."""
    # Every name is drawn: the set of them is a large part of the peak memory, and the checks
    # below build sets of the names nodes read.
    build.names.release()
    if build.removed:
        _check_removed_are_unread(scopes, built, build.removed, build.read_by_rewrites)
    if build.dropped - build.still_read:
        _remove_unread_initializers(scopes, built, build.dropped - build.still_read, build.report, spool)
    return_freed_memory()
    return _splice(model, scopes, built, pools, keep_main_encoded, spool)


#: Nodes left as they are are spooled in runs of at most this many (one frame and one write per
#: run instead of per node; bounded, so a long unchanged stretch is never one large copy).
_SPOOL_RUN = 1024


def _spool_unchanged(spool: Spool, container: onnx.GraphProto | onnx.FunctionProto, start: int, stop: int) -> None:
    """Write ``container.node[start:stop]``, left as they are, to ``spool`` as node fields."""
    nodes = container.node
    for first in range(start, stop, _SPOOL_RUN):
        run = nodes[first : min(stop, first + _SPOOL_RUN)]
        spool.write(frame_nodes(container, [n.SerializeToString() for n in run]))


@dataclass(frozen=True)
class _Applied:
    """One rewrite of a pass: what a later pass needs to know of it."""

    scope: str
    node: str  # the replaced node's name
    rule: str
    created: tuple[str, ...]  # names of the nodes it created
    created_ops: tuple[str, ...]


def _inherited_metadata(node: onnx.NodeProto, mode: str) -> tuple[bytes, bytes]:
    """Metadata for the replacement of a node an earlier pass made: the same entries the node had
    (rule, origin, exactness, bound of the earlier replacement), on the first new node if it had
    them (compact) and on every new node in "full" mode. The new nodes keep the earlier
    replacement's name prefix, so the verifier still reads the whole as one replacement of the
    original node (``provenance.attribute_nodes``), with the bound it declared: the later rules are
    exact (``Rule.on_replacements`` requires it), so that bound still holds."""
    # Every entry a rewrite writes (rule, origin, exactness, bound and its unit): all "onnx_qrewrite.".
    entries = [(e.key, e.value) for e in node.metadata_props if e.key.startswith("onnx_qrewrite.")]
    if mode == "none" or not entries:
        return b"", b""
    encoded = encode_metadata(entries)
    return encoded, (encoded if mode == "full" else b"")


def _check_removed_are_unread(
    scopes: list[Scope],
    built: dict[int, Mapping[int, bytes]],
    removed: dict[int, set[str]],
    read_by_rewrites: dict[int, set[str]],
) -> None:
    """Never remove a node something still reads: the nodes removed as dead (``Plan.remove_if_dead``)
    were decided from the plans; this checks the built result, so a builder whose replacement reads
    more than its plan said is a clear error instead of a broken model."""
    for s, scope in enumerate(scopes):
        gone = removed.get(id(scope.root))
        if not gone:
            continue
        replaced = built.get(s, {})
        c = scope.container
        read = set(read_by_rewrites.get(id(scope.root), ()))
        for index, node in enumerate(c.node):
            if index not in replaced:
                read.update(node.input)
        if isinstance(c, onnx.GraphProto):
            read.update(o.name for o in c.output)
        else:
            read.update(c.output)
        still = sorted(gone & read)
        if still:
            raise InternalError(f"{scope.path}: a rewrite removed the node writing {still[0]!r}, which is still read")


#: At most this many removal candidates are looked for in the spooled node bytes (one search of
#: them each); more, and the main graph's nodes are read instead.
_SEARCHED_CANDIDATES = 8


def _spool_reads_none(spool: Spool, names: set[str]) -> bool:
    """Whether no node in ``spool`` (the main graph's encoded nodes) can read any of ``names``:
    a node reading one holds its input field (tag, length, name) in its bytes, so where none of
    those byte strings occurs, no node reads them. A false alarm (the bytes inside some other
    field) only means the nodes are read to decide."""
    fields = [NODE_INPUT + length_prefixed(name.encode()) for name in names]
    overlap = max(len(f) for f in fields) - 1
    tail = b""
    for chunk in spool.chunks():
        window = tail + chunk
        if any(f in window for f in fields):
            return False
        tail = window[-overlap:] if overlap else b""
    return True


def _remove_unread_initializers(
    scopes: list[Scope],
    built: dict[int, Mapping[int, bytes]],
    candidates: set[str],
    report: RewriteReport,
    spool: Spool | None = None,
) -> None:
    """Remove initializers that only replaced nodes read (a zero point of 0 a lowering left out,
    float16 scales the kernel ignores): onnxruntime warns about unused initializers, and they are
    dead weight. Only called when there are candidates, since it reads every node's inputs, except
    in a main graph already written to ``spool`` whose bytes name none of a few candidates (a
    search of its bytes: reading 100k nodes' inputs was 4% of a chain's rewrite)."""
    read: set[str] = set()
    main_unread = spool is not None and len(candidates) <= _SEARCHED_CANDIDATES and _spool_reads_none(spool, candidates)
    for s, scope in enumerate(scopes):
        replaced = built.get(s, {})
        c = scope.container
        # (With a spool, no scope is a subgraph: the only graph is the main one.)
        skip = main_unread and isinstance(c, onnx.GraphProto)
        for index, node in enumerate(() if skip else c.node):
            # Only the candidates' readers matter: no set of every name read.
            if index not in replaced and not candidates.isdisjoint(node.input[:]):
                read.update(node.input)
        if isinstance(c, onnx.GraphProto):
            read.update(o.name for o in c.output)
            read.update(i.name for i in c.input)  # an initializer that is also an input stays
        else:
            read.update(c.output)
    unread = candidates - read
    for scope in scopes:
        c = scope.container
        if not isinstance(c, onnx.GraphProto) or not unread.intersection(t.name for t in c.initializer):
            continue
        kept = [t for t in c.initializer if t.name not in unread]
        removed = sorted(t.name for t in c.initializer if t.name in unread)
        del c.initializer[:]
        c.initializer.extend(kept)
        scope.invalidate()
        report.removed_initializers.extend(removed)


def _splice(
    model: onnx.ModelProto,
    scopes: list[Scope],
    built: dict[int, Mapping[int, bytes]],
    pools: dict[int, ConstantPool],
    keep_main_encoded: bool,
    spool: Spool | None = None,
) -> list[bytes] | Spool | None:
    """Put the replacements in place, innermost scope first (a parent node is serialized with its
    bodies already rewritten). The main graph's nodes are returned encoded instead of parsed back
    (``keep_main_encoded``), unless a Constant there holds external data (model_io must then see
    it as an object); as the ``spool`` :func:`_apply` wrote them to, when it did."""
    main_nodes: list[bytes] | Spool | None = None
    for s, scope in enumerate(scopes):
        replacements = built.get(s, {})
        root = scope.root
        pool = pools.get(id(root))
        prepend = pool.constant_nodes if pool is not None and scope is root else []
        if scope.container is model.graph and spool is not None:
            if prepend:  # the main graph's pool makes initializers, never Constant nodes
                raise InternalError("constant nodes for the main graph, whose node list is already written")
            main_nodes = spool
            scope.container.ClearField("node")
            scope.invalidate()
        elif scope.container is model.graph and replacements and keep_main_encoded:
            main_nodes = encode_node_chunks(scope.container, replacements, prepend)
            scope.container.ClearField("node")
            scope.invalidate()
        elif replacements or prepend:
            replace_nodes(scope.container, replacements, prepend)
            scope.invalidate()
    return main_nodes


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
    applied: list[_Applied] | None = [] if later_ops else None
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
        # Before IR 4 every initializer had to be a graph input: the constants a rewrite adds are
        # not. IR 4 only lifts that rule, so the model means the same under it.
        report.warnings.append(
            f"IR version raised from {final.ir_version} to {_IR_INITIALIZERS_NOT_INPUTS}: before IR 4 every "
            "initializer had to be a graph input, and the constants this rewrite adds are not"
        )
        final.ir_version = _IR_INITIALIZERS_NOT_INPUTS
    return result, report


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
    applied: list[_Applied] | None,
    restrict: Mapping[tuple[str, str], frozenset[str]] | None,
) -> onnx.ModelProto | EncodedModel:
    """Match and apply once (``restrict``: a later pass, see :func:`_match`); the report gathers
    every pass's rewrites, its ops after are the last pass's."""
    with stage(progress, "matching rules"):
        scopes, matches, unlowered, counts = _match(model, catalogue, options, external, restrict)
    if not report.ops_before:
        report.ops_before = collections.Counter(counts)
    needed = max(map(_PLAN_MIN_OPSET, itertools.chain.from_iterable(matches.values())), default=0)
    if needed > (opset_mod.model_default_opset(model) or 0):
        s, why_rule = next((s, m) for s, ms in matches.items() for m in ms if m.plan.min_opset == needed)
        label = Site(scopes[s].container.node[why_rule.index], scopes[s]).label
        model = opset_mod.raise_default_opset(model, needed, report, why=f"rule {why_rule.rule.id} on {label}")
        with stage(progress, "matching rules"):
            scopes, matches, unlowered, counts = _match(model, catalogue, options, external, restrict)
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
    rewrote = bool(matches)  # _apply consumes the matches
    if rewrote:
        _record_provenance_mode(model, options.provenance)
        delta, main_nodes = _apply(
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
