"""The engine's second phase (:mod:`.engine`): each match's replacement, built by its rule's
builder or stamped from the template of an earlier equal build, its report entry, and what it
leaves unread; then the new node lists assembled (:mod:`.splice`)."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import operator
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from onnx_qrewrite import _onnx as onnx
from onnx_qrewrite._dataclass import dataclass
from onnx_qrewrite.errors import InternalError
from onnx_qrewrite.io._protowire import encode_metadata, frame_nodes
from onnx_qrewrite.io.heap import return_freed_memory
from onnx_qrewrite.io.spool import Spool
from onnx_qrewrite.progress import ProgressSink, stage
from onnx_qrewrite.rewriter import provenance as provenance_mod
from onnx_qrewrite.rewriter.builders import ConstantPool, Emitter, Plan, Site
from onnx_qrewrite.rewriter.builders._stamp import Template
from onnx_qrewrite.rewriter.contract import EXACT
from onnx_qrewrite.rewriter.graph import NameAllocator, Scope
from onnx_qrewrite.rewriter.matching import Match
from onnx_qrewrite.rewriter.report import RewriteReport, op_key
from onnx_qrewrite.rewriter.splice import (
    Spooled,
    check_removed_are_unread,
    remove_unread_initializers,
    splice_replacements,
    spool_unchanged,
)
from onnx_qrewrite.rewriter.stamp_runs import RunStamper

__all__ = ["Applied", "apply_matches"]


_PLAN_REMOVES = operator.attrgetter("plan.remove_if_dead")


def _has_external_constants(scope: Scope) -> bool:
    """Whether a Constant node of ``scope`` holds external data (from the scope's index of its
    Constant nodes, instead of a look at every node's op)."""
    nodes = scope.container.node
    return any(
        any(a.t.data_location == onnx.TensorProto.EXTERNAL for a in nodes[i].attribute) for i in scope.constant_nodes
    )


def apply_matches(
    model: onnx.ModelProto,
    scopes: list[Scope],
    matches: dict[int, list[Match]],
    report: RewriteReport,
    stamp_templates: bool = True,
    progress: ProgressSink | None = None,
    provenance: str = provenance_mod.DEFAULT_MODE,
    applied: list[Applied] | None = None,
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
    """What building the replacements shares across scopes (see :func:`apply_matches`)."""

    names: NameAllocator
    report: RewriteReport
    stamp_templates: bool
    provenance: str
    applied: list[Applied] | None
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
    #: (scope, rule id, node structure, id of the plan) -> [the plan, its template key, the template
    #: recorded under that key once there is one], for builders
    #: whose key follows from those (``template_key_of_structure``): the key is made once per
    #: structure and plan instead of once per rewrite. The plan is kept and compared by identity,
    #: so a freed plan's id taken by another never finds its key.
    template_keys: dict[tuple, list[Any]] = dataclasses.field(default_factory=dict)
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
    pending: list[Match],
    spool: Spool | None,
    made: Sequence[Any] | None = None,
) -> Mapping[int, bytes]:
    """The replacements of one scope's matches (consumed), by node index; with a ``spool``, the
    scope's whole new node list is written to it as they are built (each replacement kept empty,
    as one bit: :class:`Spooled`).
    ``made``: per node, the earlier run's replacement that made it, if any (``build.earlier``)."""
    replacements: dict[int, bytes] = {}
    spooled = Spooled(len(scope.container.node)) if spool is not None else None
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

    def one(m: Match, cursor: int) -> int:
        """Build match ``m`` alone (spooling the unchanged nodes from ``cursor`` before it); the
        new cursor."""
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
                spool_unchanged(spool, container, cursor, m.index)
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
            applied.append(Applied(scope.path, name, rule.id, tuple(created_nodes), created_ops))
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
        return cursor

    # Runs of stamps of a spooled main graph are made together (stamp_runs.py), the rest alone.
    runs = (
        RunStamper(build, scope, spool, spooled, build.provenance)
        if RunStamper.usable(build, scope, spool, made)
        else None
    )
    while pending:
        if runs is not None:
            run = runs.take(pending, cursor)
            if run:
                cursor = runs.write(run, cursor, one)
                continue
        cursor = one(pending.pop(), cursor)
    if spool is not None:
        spool_unchanged(spool, container, cursor, len(container.node))
    return replacements if spooled is None else spooled


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
    m: Match,
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
    key, template = None, None
    if build.stamp_templates and hasattr(builder, "template_key"):
        key, template = _template_of(build, m, builder, site, scope, pool)
    inputs = site.inputs
    if template is not None:
        piece, created_nodes = template.stamp_framed(site, build.names, prefix, metadata, scope.container)
        # Which inputs the stamp reads is the template's: no set of names per stamp.
        kept, left = template.input_use
        if kept:
            initializers = build.initializer_names
            if initializers is None:
                build.keep_read(inputs[kept[0]])  # (takes the names)
                initializers = build.initializer_names
            for i in kept:  # build.keep_read, without a call per name
                if inputs[i] in initializers:  # type: ignore[operator]
                    build.still_read.add(inputs[i])
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


def _template_key(build: _Build, m: Match, builder: Any, site: Site, scope: Scope) -> Any:
    """The builder's template key for the match's node (what :func:`_template_of` asks for when
    it has no key for the node's structure and plan yet)."""
    return builder.template_key(site, m.rule.options, m.plan)


def _template_of(
    build: _Build, m: Match, builder: Any, site: Site, scope: Scope, pool: ConstantPool
) -> tuple[tuple | None, Template | None]:
    """The match's template key (rule id, pool, the builder's key) and the template recorded
    under it, if any. Made once per node structure and plan when the builder says its key follows
    from them (``template_key_of_structure``: the rule's options, the plan, the scope's default
    opset and the node's structure, see ``builders/_facts.structure_of``) and the match kept its
    structure, the template then kept beside it (no hash of the whole key per rewrite); else made
    for this node."""
    rule, plan, structure = m.rule, m.plan, m.structure
    if structure is None or not getattr(builder, "template_key_of_structure", False):
        key = _template_key(build, m, builder, site, scope)
        key = None if key is None else (rule.id, id(pool), key)
        return key, (build.templates.get(key) if key is not None else None)
    cache_key = (scope, rule.id, structure, id(plan))
    found = build.template_keys.get(cache_key)
    if found is None or found[0] is not plan:
        key = _template_key(build, m, builder, site, scope)
        key = None if key is None else (rule.id, id(pool), key)
        found = build.template_keys[cache_key] = [plan, key, None]
    key, template = found[1], found[2]
    if template is None and key is not None:
        template = found[2] = build.templates.get(key)
    return key, template


def _note_reads(build: _Build, site: Site, plan: Plan, root_id: int, reads: set[str] | Template) -> None:
    """What a replacement reads, where it matters: all of it stays when its plan reads more than
    its node's inputs; a node removed as dead, or any rewrite when some node is (``build.guard``),
    is noted for :func:`check_removed_are_unread`."""
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
    then splice (:func:`splice_replacements`)."""
    # Every name is drawn: the set of them is a large part of the peak memory, and the checks
    # below build sets of the names nodes read.
    build.names.release()
    if build.removed:
        check_removed_are_unread(scopes, built, build.removed, build.read_by_rewrites)
    if build.dropped - build.still_read:
        remove_unread_initializers(scopes, built, build.dropped - build.still_read, build.report, spool)
    return_freed_memory()
    return splice_replacements(model, scopes, built, pools, keep_main_encoded, spool)


@dataclass(frozen=True)
class Applied:
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
