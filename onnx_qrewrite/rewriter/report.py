"""What a rewrite did, as data: for the CLI's summary, JSON reports and pipelines that assert on it."""

from __future__ import annotations

import array
import collections
import dataclasses
import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, overload

from onnx_qrewrite._dataclass import dataclass
from onnx_qrewrite.io.outputs import write_report_file
from onnx_qrewrite.rewriter.contract import RUN_TIME_K_FORMULA

if TYPE_CHECKING:
    import onnx

__all__ = [
    "AppliedRewrite",
    "OpsetChange",
    "RewriteKind",
    "RewriteLog",
    "RewriteReport",
    "Unlowered",
    "count_ops",
    "op_key",
    "rewrite_kinds",
    "write_report_file",
]


class CreatedNames(Sequence[str]):
    """The names of the nodes one stamped replacement created, kept as its prefix, the template's
    shared hints and the few names a clash made different: ``<prefix><hint>`` each, unless listed.

    A 20k-quantizer model creates 260k names; the report holding each as a string (plus the
    allocator's set of them) was a large part of a rewrite's peak memory. Reads like a tuple.
    """

    __slots__ = ("_exceptions", "_hints", "_prefix")

    def __init__(self, prefix: str, hints: tuple[str, ...], exceptions: Mapping[int, str] | None = None):
        self._prefix = prefix
        self._hints = hints
        self._exceptions = exceptions

    def __len__(self) -> int:
        return len(self._hints)

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[str, ...]: ...

    def __getitem__(self, index: int | slice) -> str | tuple[str, ...]:
        if isinstance(index, slice):
            return tuple(self)[index]
        i = range(len(self._hints))[index]  # IndexError and negative indices as a tuple has them
        if self._exceptions and i in self._exceptions:
            return self._exceptions[i]
        return self._prefix + self._hints[i]

    def __iter__(self) -> Iterator[str]:
        return (self[i] for i in range(len(self._hints)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (CreatedNames, tuple, list)):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return repr(tuple(self))


@dataclass(frozen=True, slots=True)
class AppliedRewrite:
    """One node replaced by one rule (slotted: a large model's report holds one per rewrite)."""

    rule: str
    node: str
    op_type: str
    domain: str
    scope: str
    created_nodes: Sequence[str]  # a tuple, or a CreatedNames for stamped replacements
    created_ops: tuple[str, ...]
    notes: tuple[str, ...] = ()
    #: The rule's exactness (onnx_qrewrite.rewriter.contract) and, when bounded, this node's bound.
    exactness: str = "exact"
    bound: float | None = None
    #: Where the bound is a formula ``verify`` evaluates on each sample (``Plan.bound_formula``):
    #: its name and parameter, e.g. ``run-time-k:<c>`` (a function of a reduction length known only
    #: at run time).
    bound_formula: str | None = None


#: The member descriptors' setters of :class:`AppliedRewrite`'s fields, in field order (see
#: :func:`applied_rewrite`).
(
    _SET_RULE,
    _SET_NODE,
    _SET_OP_TYPE,
    _SET_DOMAIN,
    _SET_SCOPE,
    _SET_CREATED_NODES,
    _SET_CREATED_OPS,
    _SET_NOTES,
    _SET_EXACTNESS,
    _SET_BOUND,
    _SET_BOUND_FORMULA,
) = (AppliedRewrite.__dict__[f.name].__set__ for f in dataclasses.fields(AppliedRewrite))
_NEW = object.__new__


def applied_rewrite(
    rule: str,
    node: str,
    op_type: str,
    domain: str,
    scope: str,
    created_nodes: Sequence[str],
    created_ops: tuple[str, ...],
    notes: tuple[str, ...],
    exactness: str,
    bound: float | None,
    bound_formula: str | None,
) -> AppliedRewrite:
    """``AppliedRewrite(...)`` with every field given, in field order: the same object, made at
    about 60% of the cost. :class:`RewriteLog` makes one per rewrite it reads back (40k on a
    100k-node chain's report), and a frozen dataclass's ``__init__`` sets each field through
    ``object.__setattr__`` (a look-up of the attribute's descriptor on the class per field); this
    calls each field's slot descriptor directly. ``tests/test_engine.py`` checks it against the
    dataclass's own ``__init__``."""
    entry = _NEW(AppliedRewrite)
    _SET_RULE(entry, rule)
    _SET_NODE(entry, node)
    _SET_OP_TYPE(entry, op_type)
    _SET_DOMAIN(entry, domain)
    _SET_SCOPE(entry, scope)
    _SET_CREATED_NODES(entry, created_nodes)
    _SET_CREATED_OPS(entry, created_ops)
    _SET_NOTES(entry, notes)
    _SET_EXACTNESS(entry, exactness)
    _SET_BOUND(entry, bound)
    _SET_BOUND_FORMULA(entry, bound_formula)
    return entry


class RewriteLog(Sequence[AppliedRewrite]):
    """The rewrites of a report, kept compactly: reads like a list of :class:`AppliedRewrite`.

    Why: a 100k-node chain's report holds 40k rewrites; as objects (the rewrite, its node's name,
    its CreatedNames and that one's prefix, each a Python object) they were ~14 MB of the rewrite's
    peak memory, built while nothing else could be let go. Most fields repeat from rewrite to
    rewrite (rule, op, scope, created ops, notes, exactness): each distinct combination is kept once,
    as a *kind*, and a rewrite as its kind's number, its node's name and its created names' prefix
    (UTF-8, in one buffer) and its bound; ~80 bytes instead of ~370. Reading a rewrite makes its
    :class:`AppliedRewrite` again, equal to the one appended (the same field values). Rewrites
    whose created names are not a plain :class:`CreatedNames` (a tuple, or names a clash made
    different) or whose bound is not a float are kept as they are.
    """

    __slots__ = ("_bounds", "_ends", "_kind_ids", "_kind_views", "_kinds", "_kinds_of", "_text", "_whole")

    def __init__(self, rewrites: Iterable[AppliedRewrite] = ()) -> None:
        self._kinds: list[tuple[Any, ...]] = []
        self._kinds_of: dict[tuple[Any, ...], int] = {}
        self._kind_views: list[RewriteKind] = []
        self._kind_ids = array.array("I")
        self._text = bytearray()
        #: Per rewrite, where its node's name and its prefix end in ``_text``.
        self._ends = array.array("Q")
        self._bounds = array.array("d")
        #: Rewrites kept as they are, by position (their kind number is _WHOLE).
        self._whole: dict[int, AppliedRewrite] = {}
        self.extend(rewrites)

    _WHOLE = 2**32 - 1

    def append(self, rewrite: AppliedRewrite) -> None:
        r = rewrite
        self.add(
            r.rule,
            r.node,
            r.op_type,
            r.domain,
            r.scope,
            r.created_nodes,
            r.created_ops,
            r.notes,
            r.exactness,
            r.bound,
            r.bound_formula,
            r,
        )

    def add(
        self,
        rule: str,
        node: str,
        op_type: str,
        domain: str,
        scope: str,
        created_nodes: Sequence[str],
        created_ops: tuple[str, ...],
        notes: tuple[str, ...],
        exactness: str,
        bound: float | None,
        bound_formula: str | None,
        rewrite: AppliedRewrite | None = None,
    ) -> None:
        """Append the rewrite with these fields (:class:`AppliedRewrite`'s, in order; ``rewrite``:
        that object, when the caller has one). The engine appends its 40k rewrites of a 100k-node
        chain this way: most are kept as a kind and two names, so no object is made for them."""
        created = created_nodes
        if type(created) is not CreatedNames or created._exceptions or type(bound) not in (float, type(None)):
            if rewrite is None:
                rewrite = applied_rewrite(
                    rule, node, op_type, domain, scope, created, created_ops, notes, exactness, bound, bound_formula
                )
            self._whole[len(self._kind_ids)] = rewrite
            self._kind_ids.append(self._WHOLE)
            self._ends.extend((len(self._text), len(self._text)))
            self._bounds.append(0.0)
            return
        key: tuple[Any, ...] = (rule, op_type, domain, scope, created._hints, created_ops, notes)
        key += (exactness, bound_formula, bound is None)
        kind = self._kinds_of.get(key)
        if kind is None:
            kind = self._kinds_of[key] = len(self._kinds)
            self._kinds.append(key)
            self._kind_views.append(RewriteKind(rule, op_type, domain, scope, exactness, bound_formula))
        text = self._text
        text += node.encode("utf-8", "surrogatepass")
        self._ends.append(len(text))
        text += created._prefix.encode("utf-8", "surrogatepass")
        self._ends.append(len(text))
        self._kind_ids.append(kind)
        self._bounds.append(0.0 if bound is None else bound)

    def kind_of(
        self,
        rule: str,
        op_type: str,
        domain: str,
        scope: str,
        hints: tuple[str, ...],
        created_ops: tuple[str, ...],
        notes: tuple[str, ...],
        exactness: str,
        bound_formula: str | None,
        no_bound: bool,
    ) -> int:
        """The number of the kind :meth:`add` files a rewrite with these fields under (its created
        names a :class:`CreatedNames` of ``hints`` without clashes), made if new: for
        :meth:`add_kinds`."""
        key: tuple[Any, ...] = (rule, op_type, domain, scope, hints, created_ops, notes)
        key += (exactness, bound_formula, no_bound)
        kind = self._kinds_of.get(key)
        if kind is None:
            kind = self._kinds_of[key] = len(self._kinds)
            self._kinds.append(key)
            self._kind_views.append(RewriteKind(rule, op_type, domain, scope, exactness, bound_formula))
        return kind

    def add_kinds(
        self, kinds: Sequence[int], nodes: Sequence[bytes], prefixes: Sequence[bytes], bounds: Sequence[float]
    ) -> None:
        """:meth:`add` for many rewrites at once, in order: rewrite ``i`` of kind ``kinds[i]``
        (:meth:`kind_of`), its node named ``nodes[i]`` (UTF-8), its created names' prefix
        ``prefixes[i]`` (UTF-8), its bound ``bounds[i]`` (0.0 for a kind without one). What a run
        of stamps appends (``rewriter/stamp_runs.py``): one join of the names instead of a call
        per rewrite."""
        n = len(kinds)
        if not n:
            return
        pieces = [b""] * (2 * n)
        pieces[0::2] = nodes
        pieces[1::2] = prefixes
        text = self._text
        ends = itertools.accumulate(map(len, pieces), initial=len(text))
        next(ends)  # the text's length so far, not an end
        self._ends.extend(ends)
        text += b"".join(pieces)
        self._kind_ids.extend(kinds)
        self._bounds.extend(bounds)

    def extend(self, rewrites: Iterable[AppliedRewrite]) -> None:
        for r in list(rewrites) if rewrites is self else rewrites:
            self.append(r)

    def __len__(self) -> int:
        return len(self._kind_ids)

    def kinds(self) -> Iterator[RewriteKind | AppliedRewrite]:
        """Per rewrite, in order, what it shares with the others of its kind (rule, op, domain,
        scope, exactness, bound formula) without making the rewrite again (~7 us each): the
        summaries and op-count updates a rewrite makes read only those (4 reads of every rewrite
        made again were ~0.5 s of CPU for a 100k-node chain's 40k rewrites)."""
        if not self._whole:
            return map(self._kind_views.__getitem__, self._kind_ids)
        return (self._whole[i] if k == self._WHOLE else self._kind_views[k] for i, k in enumerate(self._kind_ids))

    @overload
    def __getitem__(self, index: int) -> AppliedRewrite: ...

    @overload
    def __getitem__(self, index: slice) -> list[AppliedRewrite]: ...

    def __getitem__(self, index: int | slice) -> AppliedRewrite | list[AppliedRewrite]:
        if isinstance(index, slice):
            return [self._row(i) for i in range(len(self))[index]]
        return self._row(range(len(self))[index])  # IndexError and negative indices as a list has them

    def __iter__(self) -> Iterator[AppliedRewrite]:
        return (self._row(i) for i in range(len(self)))

    def _row(self, i: int) -> AppliedRewrite:
        kind = self._kind_ids[i]
        if kind == self._WHOLE:
            return self._whole[i]
        rule, op_type, domain, scope, hints, created_ops, notes, exactness, formula, no_bound = self._kinds[kind]
        ends, text = self._ends, self._text
        start = ends[2 * i - 1] if i else 0
        node = text[start : ends[2 * i]].decode("utf-8", "surrogatepass")
        prefix = text[ends[2 * i] : ends[2 * i + 1]].decode("utf-8", "surrogatepass")
        bound = None if no_bound else self._bounds[i]
        return applied_rewrite(
            rule,
            node,
            op_type,
            domain,
            scope,
            CreatedNames(prefix, hints),
            created_ops,
            notes,
            exactness,
            bound,
            formula,
        )

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (RewriteLog, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable, as a list

    def __repr__(self) -> str:
        return f"RewriteLog({list(self)!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (RewriteLog, (list(self),))


@dataclass(frozen=True, slots=True)
class RewriteKind:
    """The fields :meth:`RewriteLog.kinds` reads: those of an :class:`AppliedRewrite` its kind shares."""

    rule: str
    op_type: str
    domain: str
    scope: str
    exactness: str
    bound_formula: str | None


def rewrite_kinds(rewrites: Sequence[AppliedRewrite]) -> Iterator[RewriteKind | AppliedRewrite]:
    """:meth:`RewriteLog.kinds` of ``rewrites``, or the rewrites themselves when they are a list."""
    return rewrites.kinds() if isinstance(rewrites, RewriteLog) else iter(rewrites)


@dataclass(frozen=True)
class Unlowered:
    """A node some rule matched by op but none could rewrite; kept only with ``allow_unlowered``."""

    node: str
    op_type: str
    domain: str
    scope: str
    reasons: tuple[str, ...]  # "rule-id: why it did not apply", one per candidate rule


@dataclass(frozen=True)
class OpsetChange:
    """A change to one domain's opset import that a rewrite made (``None``: no import), and why."""

    domain: str
    before: int | None
    after: int | None
    why: str


def op_key(domain: str, op_type: str) -> str:
    """How reports name an op: ``Op`` for the default domain, ``domain::Op`` otherwise."""
    return op_type if domain in ("", "ai.onnx") else f"{domain}::{op_type}"


def count_ops(model: onnx.ModelProto) -> collections.Counter[str]:
    """Op counts over every scope (subgraphs and local functions included)."""
    from onnx_qrewrite.rewriter.graph import iter_scopes

    counts: collections.Counter[str] = collections.Counter()
    for scope in iter_scopes(model):
        for node in scope.container.node:
            counts[op_key(node.domain, node.op_type)] += 1
    return counts


@dataclass
class RewriteReport:
    """What a rewrite did: each rewrite, the nodes left unlowered, opset changes, op counts before
    and after, warnings."""

    rewrites: RewriteLog = dataclasses.field(default_factory=RewriteLog)
    unlowered: list[Unlowered] = dataclasses.field(default_factory=list)
    opset_changes: list[OpsetChange] = dataclasses.field(default_factory=list)
    ops_before: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    ops_after: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    warnings: list[str] = dataclasses.field(default_factory=list)
    #: Initializers only replaced nodes read (e.g. a zero point of 0 a lowering leaves out).
    removed_initializers: list[str] = dataclasses.field(default_factory=list)
    #: ``rewrite --target``: what the target refuses before and after (targets.TargetPlan.to_dict()).
    target: dict[str, Any] | None = None
    #: ``rewrite --target``: the declared IR version lowered for the target ({"from", "to", "why"}).
    ir_version_change: dict[str, Any] | None = None

    @property
    def changed(self) -> bool:
        """True when the rewrite changed anything: a node rewritten, an opset import or the IR version changed."""
        return bool(self.rewrites or self.opset_changes or self.ir_version_change)

    def by_rule(self) -> dict[str, int]:
        """How many nodes each rule rewrote, e.g. ``{"dql-expand": 3}``."""
        counts: dict[str, int] = {}
        for r in rewrite_kinds(self.rewrites):
            counts[r.rule] = counts.get(r.rule, 0) + 1
        return counts

    def to_dict(self) -> dict[str, Any]:
        """The report as plain JSON-ready data (what ``--report`` writes)."""
        # Field by field, not dataclasses.asdict: that deep-copies every tuple (1.5 s for 20k rewrites).
        return {
            "rewrites": [
                {
                    "rule": r.rule,
                    "node": r.node,
                    "op_type": r.op_type,
                    "domain": r.domain,
                    "scope": r.scope,
                    "created_nodes": list(r.created_nodes),
                    "created_ops": list(r.created_ops),
                    "notes": list(r.notes),
                    "exactness": r.exactness,
                    "bound": r.bound,
                    "bound_formula": r.bound_formula,
                }
                for r in self.rewrites
            ],
            "by_rule": self.by_rule(),
            "unlowered": [dataclasses.asdict(u) for u in self.unlowered],
            "opset_changes": [dataclasses.asdict(c) for c in self.opset_changes],
            "ops_before": dict(sorted(self.ops_before.items())),
            "ops_after": dict(sorted(self.ops_after.items())),
            "warnings": list(self.warnings),
            "removed_initializers": list(self.removed_initializers),
            **({"target": self.target} if self.target is not None else {}),
            **({"ir_version_change": self.ir_version_change} if self.ir_version_change is not None else {}),
        }

    def summary_lines(self) -> list[str]:
        """Human-readable summary: per rule how many nodes, opset changes, op counts that moved."""
        lines = []
        by_rule = self.by_rule()
        if not by_rule:
            lines.append("no rule applied; the model is unchanged")
        levels = {r.rule: r.exactness for r in rewrite_kinds(self.rewrites)}
        for rule, n in by_rule.items():
            level = "" if levels[rule] == "exact" else f" [{levels[rule]}]"
            lines.append(f"  {rule}: {n} node{'s' if n != 1 else ''} rewritten{level}")
        inexact = [r for r in rewrite_kinds(self.rewrites) if r.exactness != "exact"]
        bounded = sum(r.exactness == "bounded" for r in inexact)
        if bounded:
            lines.append(
                f"  {bounded} node{'s' if bounded != 1 else ''} rewritten by bounded rules (no exact rule applies "
                "there): within each rule's stated bound of the original, not bit-exact"
            )
        at_run_time = sum((r.bound_formula or "").startswith(RUN_TIME_K_FORMULA + ":") for r in inexact)
        if at_run_time:
            lines.append(
                f"  {at_run_time} of them with a bound that depends on the reduction length K, known only at run "
                "time (a symbolic dimension): floor(gamma(K + 4)·K·c) + 1 steps, which verify evaluates at each "
                "sample's K"
            )
        forms = (self.target or {}).get("forms", {})
        if len(inexact) > bounded:
            n = len(inexact) - bounded
            asked = f"target {self.target['target']} needs them" if self.target and forms else "asked for"
            lines.append(
                f"  {n} node{'s' if n != 1 else ''} rewritten by approximate rules ({asked}): numerics changed"
            )
        if self.target is not None:
            t = self.target
            lines.append(
                f"  target {t['target']} ({t['target_version']}): refused before {t['refused_before']}, "
                f"after {t['refused_after']}"
            )
            if t.get("input_shapes"):
                fixed = ", ".join(t["input_shapes"]["fixed"]) or "nothing (already static)"
                lines.append(f"  target {t['target']}: input dimensions fixed (--input-shape): {fixed}")
            for name, form in forms.items():
                loud = (
                    "APPROXIMATE: changes the model's numerics by design; "
                    if form["exactness"] == "approximate"
                    else ""
                )
                lines.append(
                    f"  target {t['target']}: form {name} ({form['exactness']}) rewrote {form['nodes']} node"
                    f"{'s' if form['nodes'] != 1 else ''}: {loud}the profile asks for it {form['source']}"
                )
            lines.extend(f"  target {t['target']}: rule {r} not used: {why}" for r, why in t["skipped_rules"].items())
            if t.get("float64"):
                rules = ", ".join(f"{rule} ({n} node(s))" for rule, n in t["float64"]["rules"].items())
                lines.append(
                    f"  target {t['target']}: {rules} compute in float64, which {t['float64']['loss']}: their "
                    "declared exactness does not hold there"
                )
        for c in self.opset_changes:
            before = "none" if c.before is None else c.before
            after = "removed" if c.after is None else c.after
            lines.append(f"  opset {c.domain or 'ai.onnx'}: {before} -> {after} ({c.why})")
        if self.ir_version_change is not None:
            ir = self.ir_version_change
            lines.append(f"  IR version: {ir['from']} -> {ir['to']} ({ir['why']})")
        if self.removed_initializers:
            n = len(self.removed_initializers)
            lines.append(f"  removed {n} initializer{'s' if n != 1 else ''} no node reads any more")
        for u in self.unlowered:
            lines.append(f"  left in place: {u.node} ({op_key(u.domain, u.op_type)}): {'; '.join(u.reasons)}")
        moved = sorted(k for k in set(self.ops_before) | set(self.ops_after) if self.ops_before[k] != self.ops_after[k])
        if moved:
            width = max(len(k) for k in moved)
            lines.append(f"  {'op'.ljust(width)}  before  after")
            for k in moved:
                lines.append(f"  {k.ljust(width)}  {self.ops_before[k]:>6}  {self.ops_after[k]:>5}")
        return lines
