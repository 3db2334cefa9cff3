"""RewriteLog (rewriter/report.py) keeps a report's rewrites compactly and reads back exactly the
rewrites appended, field for field and type for type."""

from __future__ import annotations

import pickle

import numpy as np

from onnx_qrewrite.rewriter.report import AppliedRewrite, CreatedNames, RewriteLog, RewriteReport


def _rows() -> list[AppliedRewrite]:
    hints = ("/a", "/b")
    return [
        AppliedRewrite("r1", "n0", "MatMulInteger", "", "main", CreatedNames("p0", hints), ("Cast", "MatMul")),
        AppliedRewrite("r1", "n1", "MatMulInteger", "", "main", CreatedNames("p1", hints), ("Cast", "MatMul")),
        AppliedRewrite(
            *("r2", "nœ\udc80", "DQL", "com.x", "main/If/then"),
            CreatedNames("é", hints),
            ("Div",),
            ("note",),
            "bounded",
            0.1,
        ),
        AppliedRewrite("r2", "n3", "DQL", "", "main", CreatedNames("p3", hints, {1: "p3/b_1"}), ("Div",)),
        AppliedRewrite("r3", "n4", "Op", "", "main", ("x", "y"), ("Add", "Mul"), bound=1e-300),
        AppliedRewrite("r3", "n5", "Op", "", "main", CreatedNames("p5", ()), (), bound=np.float64(2.5)),
        AppliedRewrite("r1", "", "MatMulInteger", "", "main", CreatedNames("", hints), ("Cast", "MatMul"), bound=-0.0),
    ]


def test_reads_back_what_was_appended():
    rows = _rows()
    log = RewriteLog()
    for r in rows:
        log.append(r)
    assert len(log) == len(rows) and log == rows and list(log) == rows
    for got, want in zip(log, rows, strict=True):
        for field in AppliedRewrite.__dataclass_fields__:
            a, b = getattr(got, field), getattr(want, field)
            assert a == b and type(a) is type(b), field
        assert tuple(got.created_nodes) == tuple(want.created_nodes)
    assert str(log[2].node) == "nœ\udc80" and log[-1] == rows[-1] and log[1:3] == rows[1:3]
    assert str(log[6].bound) == "-0.0"  # the sign of a zero bound survives


def test_behaves_as_the_list_it_replaces():
    rows = _rows()
    log = RewriteLog(rows[:2])
    log.extend(rows[2:])
    log.extend(log)  # extending with itself, as a list can
    assert log == rows + rows and log != rows and not RewriteLog() and RewriteLog() == []
    assert pickle.loads(pickle.dumps(log)) == log
    report = RewriteReport()
    report.rewrites.extend(rows)
    plain = RewriteReport()
    object.__setattr__(plain, "rewrites", list(rows))
    assert report.to_dict() == plain.to_dict() and report.summary_lines() == plain.summary_lines()


def test_is_smaller_than_the_objects():
    """The point of it: 10k rewrites of one kind take far less than the objects did."""
    import sys
    import tracemalloc

    tracemalloc.start()
    log = RewriteLog()
    hints = ("/a", "/b")
    for i in range(10000):
        created = CreatedNames(f"block_{i}/out", hints)
        log.append(AppliedRewrite("r", f"block_{i}/node", "Op", "", "main", created, ("A",)))
    compact, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    objects = [log[i] for i in range(len(log))]
    size = sum(sys.getsizeof(r) + sys.getsizeof(r.node) + sys.getsizeof(r.created_nodes) for r in objects)
    assert compact * 3 < size


def test_kinds_read_as_the_rewrites_do():
    """kinds(): per rewrite, its kind's fields as the rewrite has them (whole rows as they are)."""
    from onnx_qrewrite.rewriter.report import rewrite_kinds

    rows = _rows()
    for log in (
        RewriteLog(rows),
        RewriteLog(r for r in rows if type(r.created_nodes) is CreatedNames and r.rule != "r3"),
    ):
        fields = ("rule", "op_type", "domain", "scope", "exactness", "bound_formula")
        got = [tuple(getattr(k, f) for f in fields) for k in rewrite_kinds(log)]
        assert got == [tuple(getattr(r, f) for f in fields) for r in log]
    assert list(rewrite_kinds(rows)) == rows


def test_add_of_the_fields_is_append_of_the_rewrite():
    """The engine appends fields (RewriteLog.add), not objects: the same rows, field for field
    and type for type, whole rows made from the fields included."""
    import dataclasses

    rows = _rows()
    added = RewriteLog()
    for r in rows:
        added.add(*(getattr(r, f.name) for f in dataclasses.fields(AppliedRewrite)))
    assert added == RewriteLog(rows) == rows
    for got, want in zip(added, rows, strict=True):
        assert type(got) is AppliedRewrite
        for field in AppliedRewrite.__dataclass_fields__:
            a, b = getattr(got, field), getattr(want, field)
            assert a == b and type(a) is type(b), field


def test_add_kinds_is_add_of_each_rewrite():
    """A run of stamps' entries (``kind_of`` and ``add_kinds``, stamp_runs.py) read back as the
    same rewrites added one by one, interleaved kinds, bounds and non-ASCII names included."""
    rows = [r for r in _rows() if type(r.created_nodes) is CreatedNames and not r.created_nodes._exceptions]
    rows = [r for r in rows if type(r.bound) in (float, type(None))]
    one = RewriteLog()
    for r in rows:
        one.append(r)
    together = RewriteLog([rows[0]])
    kinds = [
        together.kind_of(
            *(r.rule, r.op_type, r.domain, r.scope, r.created_nodes._hints, r.created_ops, r.notes),
            *(r.exactness, r.bound_formula, r.bound is None),
        )
        for r in rows[1:]
    ]
    together.add_kinds(
        kinds,
        [r.node.encode("utf-8", "surrogatepass") for r in rows[1:]],
        [r.created_nodes._prefix.encode() for r in rows[1:]],
        [0.0 if r.bound is None else r.bound for r in rows[1:]],
    )
    assert len(rows) > 3 and together == one == rows
    assert [str(r.bound) for r in together] == [str(r.bound) for r in rows]
