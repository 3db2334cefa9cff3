"""``onnx-qrewrite inspect``: the quantization ops of a model, which rule would rewrite each, and
which opset changes a rewrite needs, without writing a model or report (the shipped rule files'
parsed TOML may be cached, rewriter/rule_cache.py).

The answer comes from the engine itself (a rewrite in memory, with ``allow_unlowered`` so that
every node is accounted for), so ``inspect`` and ``rewrite`` cannot disagree. When raising the
opset would fail, that is reported and the plan shown is the one with the opset kept.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from pathlib import Path
from typing import Any

import click

from onnx_qrewrite import _onnx as onnx
from onnx_qrewrite._dataclass import dataclass
from onnx_qrewrite.cli.options import (
    expand_forms,
    float16_semantics_option,
    global_options,
    load_selected_rules,
    plan_options,
    rule_selection,
    target_input_shapes,
)
from onnx_qrewrite.errors import LoweringError, UsageError

__all__ = ["InspectReport", "QuantNode", "inspect_command", "inspect_model"]


@dataclass
class QuantNode:
    """One quantization-related node and what a rewrite does with it."""

    scope: str
    node: str
    op: str  # "domain::Op", or "Op" for the standard domain
    dtype: str
    rule: str | None = None  # the rule that rewrites it
    becomes: tuple[str, ...] = ()  # the op types it is replaced by
    notes: tuple[str, ...] = ()
    reasons: tuple[str, ...] = ()  # why no rule can lower it (a rule matched the op)

    @property
    def status(self) -> str:
        if self.rule:
            return self.rule
        return "CANNOT LOWER" if self.reasons else "-"


@dataclass
class InspectReport:
    """What ``inspect`` found in one model: its quantization nodes and what a rewrite does with
    each, and the opset changes it needs (the ``--json`` answer is :meth:`to_dict`)."""

    model: str
    ir_version: int
    opsets: dict[str, int]
    nodes: list[QuantNode]
    opset_changes: list[dict[str, Any]]
    #: Why raising the default-domain opset would fail (the plan shown keeps the opset), if it would.
    opset_error: str | None = None

    def groups(self) -> list[dict[str, Any]]:
        """Nodes grouped by (op, dtype, rule): count, the ops they become, where they are."""
        out: dict[tuple[str, str, str], dict[str, Any]] = {}
        for n in self.nodes:
            key = (n.op, n.dtype, n.status)
            g = out.setdefault(
                key,
                {"op": n.op, "dtype": n.dtype, "rule": n.status, "count": 0, "becomes": [], "scopes": [], "nodes": []},
            )
            g["count"] += 1
            for op in n.becomes:
                if op not in g["becomes"]:
                    g["becomes"].append(op)
            if n.scope not in g["scopes"]:
                g["scopes"].append(n.scope)
            g["nodes"].append(n.node)
        return list(out.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "ir_version": self.ir_version,
            "opsets": self.opsets,
            "groups": self.groups(),
            "nodes": [dataclasses.asdict(n) for n in self.nodes],
            "opset_changes": self.opset_changes,
            "opset_error": self.opset_error,
        }


def _node_dtype(site: Any, catalogue: Any) -> str:
    """The quantized dtype as the first rule that names the op sees it, else read off the node."""
    from onnx_qrewrite.rewriter.builders import NoMatch
    from onnx_qrewrite.rewriter.graph import dtype_name

    node = site.node
    for rule in catalogue.candidates(node.domain, node.op_type):
        try:
            dtype = rule.implementation.quantized_dtype(site)
        except NoMatch:
            return "unknown"
        if dtype:
            return dtype
    op = node.op_type.lower()
    if "dequantize" in op:
        names = [site.input(0)]
    elif "quantize" in op:
        names = [site.input(2), *node.output]
    else:
        names = [*node.input, *node.output]
    for name in names:
        elem = site.elem_type(name)
        if elem and elem not in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.INT64):
            return dtype_name(elem)
    return "-"


def inspect_model(
    path: str | Path,
    catalogue: Any,
    *,
    target_opset: int | None = None,
    keep_opset: bool = False,
    allow: Collection[str] | None = None,
) -> InspectReport:
    """What ``rewrite`` would do to the model at ``path`` with ``catalogue``; writes nothing."""
    from onnx_qrewrite.io import model_io
    from onnx_qrewrite.rewriter import engine
    from onnx_qrewrite.rewriter.builders import Site
    from onnx_qrewrite.rewriter.catalogue import is_quantization_op
    from onnx_qrewrite.rewriter.graph import iter_scopes
    from onnx_qrewrite.rewriter.report import op_key

    path = Path(path)
    loaded = model_io.open_model(path)
    model, base_dir = loaded.proto, loaded.external
    opsets = {o.domain or "ai.onnx": o.version for o in model.opset_import}
    nodes: list[QuantNode] = []
    by_label: dict[tuple[str, str], QuantNode] = {}
    for scope in iter_scopes(model, base_dir):
        for node in scope.container.node:
            if not (catalogue.candidates(node.domain, node.op_type) or is_quantization_op(node.op_type)):
                continue
            site = Site(node, scope, catalogue.same_shape_ops)
            entry = QuantNode(scope.path, site.label, op_key(node.domain, node.op_type), _node_dtype(site, catalogue))
            nodes.append(entry)
            by_label[scope.path, site.label] = entry
    ir_version = model.ir_version

    # The engine edits the model it is given; it is not needed afterwards. A failed opset raise
    # happens before anything is edited, so the same model serves the retry.
    opset_error = None
    levels = frozenset(allow) if allow is not None else engine.DEFAULT_ALLOW
    options = engine.EngineOptions(target_opset=target_opset, keep_opset=keep_opset, allow_unlowered=True, allow=levels)
    try:
        _, report = engine.run(model, catalogue, options, base_dir)
    except LoweringError as exc:
        if keep_opset:
            raise
        opset_error = str(exc)
        options = engine.EngineOptions(keep_opset=True, allow_unlowered=True, allow=levels)
        _, report = engine.run(model, catalogue, options, base_dir)
    for r in report.rewrites:
        rewritten = by_label.get((r.scope, r.node))
        if rewritten is not None:
            rewritten.rule, rewritten.becomes, rewritten.notes = r.rule, tuple(dict.fromkeys(r.created_ops)), r.notes
    for u in report.unlowered:
        unlowered = by_label.get((u.scope, u.node))
        if unlowered is not None:
            unlowered.reasons = u.reasons
    changes = [dataclasses.asdict(c) for c in report.opset_changes]
    return InspectReport(str(path), ir_version, opsets, nodes, changes, opset_error)


def _where(group: dict[str, Any], limit: int = 3) -> str:
    names = group["nodes"]
    shown = ", ".join(names[:limit]) + (f", ... (+{len(names) - limit})" if len(names) > limit else "")
    scopes = ", ".join(group["scopes"])
    return f"{scopes}: {shown}"


def _print_text(rep: InspectReport, all_nodes: bool) -> None:
    default = rep.opsets.get("ai.onnx")
    click.echo(
        f"{rep.model}: IR {rep.ir_version}, default-domain opset {default}, "
        f"imports {', '.join(f'{d} {v}' for d, v in rep.opsets.items() if d != 'ai.onnx') or 'none'}"
    )
    if not rep.nodes:
        click.echo("no quantization ops")
    else:
        click.echo(f"quantization ops: {len(rep.nodes)} node{'s' if len(rep.nodes) != 1 else ''}")
        rows = [("op", "dtype", "count", "rule", "becomes", "where")]
        for g in rep.groups():
            becomes = ", ".join(g["becomes"]) or ("(kept)" if g["rule"] == "-" else "")
            rows.append((g["op"], g["dtype"], str(g["count"]), g["rule"], becomes, _where(g)))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        for r in rows:
            cells = [r[i].rjust(widths[i]) if i == 2 else r[i].ljust(widths[i]) for i in range(5)]
            click.echo("  " + "  ".join(cells) + "  " + r[5])
    unlowered = [n for n in rep.nodes if n.reasons]
    if unlowered:
        click.echo(f"cannot be lowered ({len(unlowered)}; `rewrite` stops with exit code 4 unless --allow-unlowered):")
        for n in unlowered:
            click.echo(f"  {n.node} ({n.op}, {n.dtype}): {'; '.join(n.reasons)}")
    click.echo(
        "opset changes a rewrite needs:"
        if rep.opset_changes or rep.opset_error
        else "opset changes a rewrite needs: none"
    )
    if rep.opset_error:
        click.echo(f"  ai.onnx: raising it would fail ({rep.opset_error}); shown with the opset kept")
    for c in rep.opset_changes:
        before = "none" if c["before"] is None else c["before"]
        after = "removed" if c["after"] is None else c["after"]
        click.echo(f"  {c['domain'] or 'ai.onnx'}: {before} -> {after} ({c['why']})")
    if all_nodes and rep.nodes:
        click.echo("nodes:")
        for n in rep.nodes:
            becomes = f" -> {', '.join(n.becomes)}" if n.becomes else ""
            notes = f" [{'; '.join(n.notes)}]" if n.notes else ""
            click.echo(f"  {n.scope}  {n.node}  {n.op}  {n.dtype}  {n.status}{becomes}{notes}")


def _sources(profile: Any) -> dict[str, str]:
    return {f"{profile.id}/{s.id}": f"{s.document} ({s.version})" for s in profile.sources.values()}


def _inspect_target(
    model: str, catalogue: Any, target: str, options: tuple[Any, ...], as_json: bool, all_nodes: bool
) -> bool:
    """``inspect --target``: print the target's plan (text or JSON); True when nothing would be
    refused. ``options``: --target-opset, --keep-opset, --allow-approximate, --input-shape."""
    from onnx_qrewrite.cli.target_report import print_plan
    from onnx_qrewrite.targets import load_target, plan_for_target

    target_opset, keep_opset, allow_approximate, input_shapes = options
    profile = load_target(target)
    plan = plan_for_target(
        model,
        catalogue,
        profile,
        target_opset=target_opset,
        keep_opset=keep_opset,
        allow=("exact", "bounded", "approximate") if allow_approximate else None,
        input_shapes=target_input_shapes(input_shapes, target),
    )
    if as_json:
        import json  # only for --json: the text answer does without it

        click.echo(json.dumps({**plan.to_dict(), "sources": _sources(profile)}, indent=2))
    else:
        print_plan(plan, profile, all_nodes)
    return bool(plan.ok)


#: What the command imports once its options are read: the rule catalogue, the model reader and
#: the engine, and with them numpy, protobuf and onnx's message classes (most of the modules
#: ``inspect`` loads); ``--target`` adds the target checks.
_ENGINE_MODULES = ("onnx_qrewrite.rewriter.catalogue", "onnx_qrewrite.io.model_io", "onnx_qrewrite.rewriter.engine")


def _import_engine(targets: bool) -> None:
    """Import :data:`_ENGINE_MODULES` through :func:`onnx_qrewrite.cli.import_quietly`: in the
    command's own process, with the garbage collector paused, then the loaded objects frozen, as
    ``verify`` loads the verifier. Imported where first used instead (``inspect_model``), they
    loaded with the collector running: 60-odd collections in an ``inspect`` of the sample MLP,
    16 million instructions of its 844 million (callgrind); tests/test_startup.py checks that none
    runs while they load. In-process callers get plain imports. numpy loads first, with no
    BLAS threads: ``inspect`` multiplies no matrices (:func:`~onnx_qrewrite.cli.
    import_numpy_without_blas_threads`)."""
    from onnx_qrewrite.cli import import_numpy_without_blas_threads, import_quietly

    import_numpy_without_blas_threads()
    for module in (*_ENGINE_MODULES, "onnx_qrewrite.targets") if targets else _ENGINE_MODULES:
        import_quietly(module)


@click.command("inspect")
@global_options
@click.argument("model", type=click.Path(dir_okay=False))
@rule_selection
@float16_semantics_option
@plan_options(inspecting=True)
@click.option("-a", "--all-nodes", is_flag=True, help="Also list every quantization node, one a line.")
@click.option("--json", "as_json", is_flag=True, help="Print the whole answer as JSON.")
@click.option(
    "--target",
    "target",
    default=None,
    metavar="NAME",
    help="Say what target NAME (see `onnx-qrewrite targets`, or a .toml profile) refuses today, which "
    "rule fixes it and what it would still refuse after the rewrite; exit 4 if anything would be.",
)
@click.option(
    "--input-shape",
    "input_shapes",
    multiple=True,
    metavar="NAME:D0,D1,...|DIM=N",
    help="With --target: fix an input's symbolic dimensions (or the dimension DIM wherever it appears) "
    "before planning, as onnxruntime's make_dynamic_shape_fixed does; repeatable.",
)
@click.pass_context
def inspect_command(
    ctx,
    model,
    rule_files,
    only,
    skip,
    rule_options,
    forms,
    form_options,
    dql_semantics,
    float16_semantics,
    target_opset,
    keep_opset,
    allow_approximate,
    all_nodes,
    as_json,
    target,
    input_shapes,
) -> None:
    """List the quantization ops in MODEL (dtypes, counts, where), the rule that would rewrite each,
    and the opset changes a rewrite needs. Writes no model or report."""
    if keep_opset and target_opset is not None:
        raise UsageError("--keep-opset and --target-opset contradict each other; give one")
    _import_engine(target is not None)
    rule_files, rule_options = expand_forms(
        forms, form_options, rule_files, rule_options, allow_approximate=allow_approximate
    )
    catalogue = load_selected_rules(rule_files, only, skip, rule_options, dql_semantics, float16_semantics)
    if input_shapes and target is None:
        raise UsageError("--input-shape fixes dimensions for a target: give --target too")
    if target is not None:
        options = (target_opset, keep_opset, allow_approximate, input_shapes)
        if not _inspect_target(model, catalogue, target, options, as_json, all_nodes):
            from onnx_qrewrite.errors import EXIT_CANNOT_LOWER

            ctx.exit(EXIT_CANNOT_LOWER)
        return
    allow = ("exact", "bounded", "approximate") if allow_approximate else None
    report = inspect_model(model, catalogue, target_opset=target_opset, keep_opset=keep_opset, allow=allow)
    if as_json:
        import json

        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        _print_text(report, all_nodes)
