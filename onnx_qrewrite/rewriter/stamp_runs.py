"""Runs of stamps built together: the build's fast path for a main graph whose replacements repeat
(:mod:`.apply`; a 20k-block chain stamps 40k replacements from two templates).

Stamping one replacement at a time (``Template.stamp_framed``) costs a Site, a name claim, the
provenance entry, a ``%`` format of the whole replacement with a tuple of its ~40 fields, a report
entry and a spool write, each a few Python calls: ~120k instructions a rewrite, with the unchanged
nodes between them serialized and framed one run at a time. Here a run of up to :data:`_RUN`
consecutive matches whose template is recorded is done as one: the nodes' names read in one pass,
their name families claimed together (``NameAllocator.claim_free_families``), each (template,
length signature) group of replacements made as one numpy array of fixed-length records (the
template's bytes with the names copied into their holes column by column, ``Template.layout``:
the provenance origin is a hole too), the nodes left unchanged between them serialized in the same
pass, the report's entries appended together (``RewriteLog.add_kinds``) and the run written to the
spool as one piece. The bytes are the ones stamping each replacement gives (``tests/
test_stamp_runs.py``); whatever the fast path does not cover (a node without a name, a name some
model name may clash with, a plan that reads more than its node) is done one match at a time, in
order, as before.
"""

from __future__ import annotations

import collections
import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from onnx_qrewrite.errors import InternalError
from onnx_qrewrite.io._protowire import encode_metadata_entry, node_field_tag
from onnx_qrewrite.io._wire import SMALL_VARINTS, varint
from onnx_qrewrite.rewriter import provenance as provenance_mod
from onnx_qrewrite.rewriter.builders import Emitter
from onnx_qrewrite.rewriter.builders._stamp import Template
from onnx_qrewrite.rewriter.matching import Match
from onnx_qrewrite.rewriter.splice import spool_unchanged

__all__ = ["RunStamper"]

#: Matches per run at most, and nodes a run spans at most (its nodes' wrappers and bytes are held
#: together: bounded, so a long unchanged stretch is never read at once, and what a run holds adds
#: little to the peak memory: at 1024 matches a run the chain's peak was ~4 MB higher, at 256 ~1 MB).
_RUN = 128
_SPAN = 4096
#: Unchanged nodes before a run beyond this many are spooled first, as a build alone spools them.
_GAP = 1024
#: A group of at least this many records is filled by numpy; a smaller one by a bytes format each.
_NUMPY_AT = 8
_MODES = ("compact", "full", "none")


class _Kind:
    """What every stamp of one (rule, node structure, plan) in a run shares."""

    __slots__ = (
        "bound",
        "code",
        "formats",
        "hints",
        "kept",
        "layouts",
        "left",
        "meta",
        "n_in",
        "n_out",
        "ops",
        "report_kind",
        "template",
    )

    def __init__(self, template: Template, meta: tuple[bytes, bytes] | None, bound: float) -> None:
        self.template = template
        self.hints = template.hints
        self.n_in, self.n_out = template.arity
        self.kept, self.left = template.input_use
        self.ops = template.ops
        self.meta = meta  # (entries before the origin, after it), None: no provenance metadata
        self.bound = bound
        self.code = -1  # the replaced op's code (Scope.op_codes), set by the first match
        self.report_kind = -1
        #: length signature -> (record, holes) / (format, picker)
        self.layouts: dict[tuple[int, ...], tuple[np.ndarray, list[tuple[int, int, int]], int]] = {}
        self.formats: dict[tuple[int, ...], tuple[bytes, Callable[[Sequence[bytes]], tuple]]] = {}


class RunStamper:
    """Takes runs of stampable matches off a scope's pending list and writes each as one piece
    (see the module docstring). Made only for a spooled main graph whose rewrites need nothing a
    run does not do: no later pass, no earlier run's provenance, nothing removed as dead."""

    def __init__(self, build: Any, scope: Any, spool: Any, spooled: Any, mode: str) -> None:
        self.build, self.scope, self.spool, self.spooled = build, scope, spool, spooled
        self.mode = mode
        self.nodes = scope.container.node
        self.tag = node_field_tag(scope.container)
        self.codes, self.keys = scope.op_codes()
        self._kinds: dict[tuple[int, int, int], tuple[Any, Any, Any, _Kind | None]] = {}

    @staticmethod
    def usable(build: Any, scope: Any, spool: Any, made: Any) -> bool:
        """Whether a scope's build may take runs: spooled main graph, stamps on, no later pass,
        no earlier run's replacements, no rewrite collected for a later pass, nothing removed."""
        return (
            spool is not None
            and made is None
            and scope.path == "main"
            and build.stamp_templates
            and not build.later
            and build.applied is None
            and not build.guard
            and build.provenance in _MODES
        )

    def _kind(self, m: Match) -> _Kind | None:
        """The run kind of ``m``, or None when it must be built one at a time (for now: its
        template may not be recorded yet)."""
        rule, structure, plan = m.rule, m.structure, m.plan
        key = (id(rule), id(structure), id(plan))
        found = self._kinds.get(key)
        if found is not None and found[0] is rule and found[1] is structure and found[2] is plan:
            return found[3]
        if structure is None:
            self._kinds[key] = (rule, structure, plan, None)
            return None
        build = self.build
        builder = build.builders.get(rule.id)
        if builder is None or not getattr(builder, "template_key_of_structure", False):
            if builder is not None:
                self._kinds[key] = (rule, structure, plan, None)
            return None  # (no builder yet: its first match is built one at a time)
        keyed = build.template_keys.get((self.scope, rule.id, structure, id(plan)))
        if keyed is None or keyed[0] is not plan:
            return None  # (its first match is built one at a time, and keyed)
        template = keyed[2] if keyed[2] is not None or keyed[1] is None else build.templates.get(keyed[1])
        if template is None:
            if keyed[1] is None or keyed[1] in build.templates:  # no template, or none recordable
                self._kinds[key] = (rule, structure, plan, None)
            return None
        kind = None
        if (
            template.family_hints is not None
            and build.names._family_of(template.hints) is not None
            and plan.reads is None
            and not plan.remove_if_dead
            and type(plan.bound) in (float, type(None))
        ):
            meta = None
            if self.mode != "none":
                meta = Emitter.metadata_parts(
                    rule.id,
                    rule.exactness,
                    plan.bound,
                    plan.bound_scale,
                    plan.bound_formula,
                    plan.bound_u8s8,
                )
            kind = _Kind(template, meta, 0.0 if plan.bound is None else plan.bound)
            kind.code = self.codes[m.index]
            domain, op_type = self.keys[kind.code]
            kind.report_kind = build.report.rewrites.kind_of(
                rule.id,
                op_type,
                domain,
                self.scope.path,
                template.family_hints,
                template.ops,
                plan.notes,
                rule.exactness,
                plan.bound_formula,
                plan.bound is None,
            )
        self._kinds[key] = (rule, structure, plan, kind)
        return kind

    def take(self, pending: list[Match], cursor: int) -> list[tuple[Match, _Kind]]:
        """A run off the end of ``pending`` (reversed: the next match last): consecutive matches
        with a run kind, at most :data:`_RUN` of them within :data:`_SPAN` nodes; empty when the
        next match has none (the caller builds it alone)."""
        run: list[tuple[Match, _Kind]] = []
        limit = -1
        kind_of = self._kind
        while pending and len(run) < _RUN:
            m = pending[-1]
            kind = kind_of(m)
            if kind is None:
                break
            if limit < 0:
                limit = m.index + _SPAN
            elif m.index >= limit:
                break
            run.append((m, kind))
            pending.pop()
        return run

    def write(self, run: list[tuple[Match, _Kind]], cursor: int, one: Callable[[Match, int], int]) -> int:
        """Write the run's replacements and the unchanged nodes before each to the spool, in
        order; ``one(match, cursor)`` builds a match the run cannot (one at a time, as before) and
        returns the new cursor. Returns the first node not yet written."""
        first = run[0][0].index
        if first - cursor > _GAP:
            spool_unchanged(self.spool, self.scope.container, cursor, first)
            cursor = first
        base = cursor
        indices = [m.index for m, _ in run]
        chunk = self.nodes[base : indices[-1] + 1]
        sel = [chunk[i - base] for i in indices]
        names = [n.name for n in sel]
        inputs = [n.input[:] for n in sel]
        outputs = [n.output[:] for n in sel]
        kinds = [k for _, k in run]
        prefixes = [
            (
                name
                if name and (not outs or not outs[0] or len(name) <= len(outs[0]))
                else (outs[0] if outs and outs[0] else node.op_type)
            )
            for name, outs, node in zip(names, outputs, sel, strict=True)
        ]
        hints = [
            k.hints if name and len(ins) == k.n_in and len(outs) == k.n_out else None
            for name, ins, outs, k in zip(names, inputs, outputs, kinds, strict=True)
        ]
        free = self.build.names.claim_free_families(prefixes, hints)
        start = 0
        n = len(run)
        while start < n:
            if not free[start]:
                cursor = self._gap(chunk, base, cursor, indices[start])
                cursor = one(run[start][0], cursor)
                start += 1
                continue
            stop = start
            while stop < n and free[stop]:
                stop += 1
            cursor = self._segment(chunk, base, cursor, run, slice(start, stop), names, inputs, outputs, prefixes)
            start = stop
        return cursor

    def _gap(self, chunk: Sequence[Any], base: int, cursor: int, stop: int) -> int:
        """Spool the unchanged nodes from ``cursor`` to ``stop`` (from the run's chunk)."""
        if cursor < stop:
            self.spool.write(self._framed([chunk[r - base] for r in range(cursor, stop)]))
        return stop

    def _framed(self, nodes: Sequence[Any]) -> bytes:
        tag, small = self.tag, SMALL_VARINTS
        parts: list[bytes] = []
        extend = parts.extend
        for body in [node.SerializeToString() for node in nodes]:
            n = len(body)
            extend((tag, small[n] if n < 16384 else varint(n), body))
        return b"".join(parts)

    def _segment(
        self,
        chunk: Sequence[Any],
        base: int,
        cursor: int,
        run: list[tuple[Match, _Kind]],
        part: slice,
        names: list[str],
        inputs: list[list[str]],
        outputs: list[list[str]],
        prefixes: list[str],
    ) -> int:
        """Stamp run[part] (every family claimed) and spool it with the nodes before each."""
        items = run[part]
        encode = str.encode
        name_b = [encode(s) for s in names[part]]
        prefix_b = [encode(s) for s in prefixes[part]]
        ins = inputs[part]
        outs = outputs[part]
        kinds = [k for _, k in items]
        records: list[bytes | memoryview] = [b""] * len(items)
        for kind in dict.fromkeys(kinds):  # (distinct, in order)
            own = range(len(items)) if len(kinds) == 1 else [t for t, k in enumerate(kinds) if k is kind]
            # The values a stamp fills in, column by column: (prefix, inputs..., outputs..., name).
            kind_ins = [ins[t] for t in own]
            kind_outs = [outs[t] for t in own]
            columns = [[prefix_b[t] for t in own]]
            columns += [[encode(i[j]) for i in kind_ins] for j in range(kind.n_in)]
            columns += [[encode(o[j]) for o in kind_outs] for j in range(kind.n_out)]
            columns.append([name_b[t] for t in own])
            # Grouped by length signature (every length of the replacement follows from those).
            signatures = list(zip(*[list(map(len, column)) for column in columns], strict=True))
            if len(set(signatures)) == 1:
                self._records(kind, signatures[0], columns, range(len(own)), own, records)
                continue
            groups: dict[tuple[int, ...], list[int]] = collections.defaultdict(list)
            for i, signature in enumerate(signatures):
                groups[signature].append(i)
            for signature, members in groups.items():
                self._records(kind, signature, columns, members, [own[i] for i in members], records)
        # The spool's piece: the nodes from the cursor on, each replaced one as its record and
        # the others serialized and framed, all in one pass.
        stop = items[-1][0].index + 1
        pieces: list[bytes | memoryview | None] = [None] * (stop - cursor)
        for (m, _), record in zip(items, records, strict=True):
            pieces[m.index - cursor] = record
        if stop - cursor > len(items):
            unchanged = [r for r, p in enumerate(pieces) if p is None]
            offset = cursor - base
            tag, small = self.tag, SMALL_VARINTS
            bodies = [chunk[offset + r].SerializeToString() for r in unchanged]
            framed = [tag + (small[len(b)] if len(b) < 16384 else varint(len(b))) + b for b in bodies]
            for r, piece in zip(unchanged, framed, strict=True):
                pieces[r] = piece
        self.spool.write(b"".join(pieces))  # type: ignore[arg-type]  # (every slot filled)
        self._account(items, ins, name_b, prefix_b)
        return stop

    def _records(
        self,
        kind: _Kind,
        lengths: tuple[int, ...],
        columns: list[list[bytes]],
        members: Sequence[int],
        places: Sequence[int],
        records: list[bytes | memoryview],
    ) -> None:
        """The framed replacements of one group (one kind, one length signature): of rows
        ``members`` of ``columns``, into ``records[places[i]]``."""
        whole = len(members) == len(columns[0])
        if len(members) < _NUMPY_AT:
            fmt, pick = self._format(kind, lengths)
            for i, t in zip(members, places, strict=True):
                records[t] = fmt % pick([column[i] for column in columns])
            return
        record, holes, size = self._layout(kind, lengths)
        count = len(members)
        table = np.empty((count, size), np.uint8)
        table[:] = record
        filled: dict[int, np.ndarray] = {}
        for offset, k, n in holes:
            values = filled.get(k)
            if values is None:
                column = columns[k] if whole else [columns[k][i] for i in members]
                values = filled[k] = np.frombuffer(b"".join(column), np.uint8).reshape(count, n)
            table[:, offset : offset + n] = values
        # Each record a view of the table (no copy: the segment's one join copies them once).
        rows = memoryview(table.data).cast("B")
        for i, t in enumerate(places):
            records[t] = rows[i * size : (i + 1) * size]

    def _meta(self, kind: _Kind, name_length: int, k: int) -> tuple[list[bytes | int], list[bytes | int]]:
        """The first node's and the other nodes' metadata as layout pieces (the origin, value
        ``k``, a hole)."""
        if kind.meta is None:
            return [], []
        entry = encode_metadata_entry(provenance_mod.ORIGIN_KEY, "a" * name_length)
        first: list[bytes | int] = [kind.meta[0] + entry[: len(entry) - name_length], k, kind.meta[1]]
        return first, (first if self.mode == "full" else [])

    def _layout(self, kind: _Kind, lengths: tuple[int, ...]) -> tuple[np.ndarray, list[tuple[int, int, int]], int]:
        found = kind.layouts.get(lengths)
        if found is None:
            first, rest = self._meta(kind, lengths[-1], len(lengths) - 1)
            record, holes = kind.template.layout(self.tag, lengths, first, rest)
            found = kind.layouts[lengths] = (np.frombuffer(record, np.uint8), holes, len(record))
        return found

    def _format(self, kind: _Kind, lengths: tuple[int, ...]) -> tuple[bytes, Callable[[Sequence[bytes]], tuple]]:
        """The group's record as a bytes format over the values (for a few records)."""
        found = kind.formats.get(lengths)
        if found is None:
            first, rest = self._meta(kind, lengths[-1], len(lengths) - 1)
            record, holes = kind.template.layout(self.tag, lengths, first, rest)
            parts, order, at = [], [], 0
            for offset, k, n in holes:
                parts += [record[at:offset].replace(b"%", b"%%"), b"%b"]
                order.append(k)
                at = offset + n
            parts.append(record[at:].replace(b"%", b"%%"))
            pick = operator.itemgetter(*order) if len(order) > 1 else (lambda v, k=order[0]: (v[k],))
            found = kind.formats[lengths] = (b"".join(parts), pick)
        return found

    def _account(
        self, items: list[tuple[Match, _Kind]], inputs: list[list[str]], name_b: list[bytes], prefix_b: list[bytes]
    ) -> None:
        """What each stamp of a segment leaves read and unread, its report entry, the op counts,
        the spooled bits and the progress, for the whole segment."""
        build = self.build
        kinds = [k for _, k in items]
        codes = self.codes
        counts = collections.Counter(kinds)
        for kind, count in counts.items():
            build.created_counts[kind.ops] += count
            build.replaced_ops[self.keys[kind.code]] += count
        indices = [m.index for m, _ in items]
        if [codes[i] for i in indices] != [k.code for k in kinds]:
            raise InternalError("a node structure shared by nodes of different ops")
        for kind in counts:
            self._input_use(kind, [ins for ins, k in zip(inputs, kinds, strict=True) if k is kind])
        build.report.rewrites.add_kinds([k.report_kind for k in kinds], name_b, prefix_b, [k.bound for k in kinds])
        self.spooled.add_all(indices)
        done = build.done
        build.done += len(items)
        progress = build.progress
        if progress is not None:  # as after each rewrite: every 1024th and the last
            for k in range((done // 1024 + 1) * 1024, build.done + 1, 1024):
                progress("rewriting nodes", k, build.total)
            if build.done == build.total and build.total % 1024:
                progress("rewriting nodes", build.total, build.total)

    def _input_use(self, kind: _Kind, inputs: list[list[str]]) -> None:
        """``_replacement``'s notes of the node inputs a stamp still reads and leaves, for many."""
        build, scope = self.build, self.scope
        for i in kind.kept:
            column = [ins[i] for ins in inputs]
            initializers = build.initializer_names
            if initializers is None:
                build.keep_read(column[0])  # (takes the names)
                initializers = build.initializer_names
            build.still_read.update(n for n in column if n in initializers)
        initializer = scope.initializer
        for i in kind.left:
            build.dropped.update(n for n in {ins[i] for ins in inputs} if n and initializer(n) is not None)
