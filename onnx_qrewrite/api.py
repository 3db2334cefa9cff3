"""The Python entry point: ``rewrite`` accepts a path, an ``onnx.ModelProto`` or an
``onnx_ir.Model`` and returns the same kind of model it was given, with a report."""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

from onnx_qrewrite import _onnx as onnx
from onnx_qrewrite.errors import InternalError, InvalidModelError, UsageError
from onnx_qrewrite.io import model_io
from onnx_qrewrite.io.encoded import EncodedModel, to_proto
from onnx_qrewrite.io.external_data import ExternalData
from onnx_qrewrite.io.toposort import sort_model
from onnx_qrewrite.progress import ProgressSink, stage
from onnx_qrewrite.rewriter import engine
from onnx_qrewrite.rewriter.catalogue import Catalogue, load_rules
from onnx_qrewrite.rewriter.report import RewriteReport

if TYPE_CHECKING:
    import onnx_ir

    from onnx_qrewrite.targets.shapes import Applied, InputShapes

__all__ = ["RewriteResult", "load_rules", "rewrite"]

#: The checker takes a ModelProto only below protobuf's 2 GB limit.
_CHECKABLE_IN_MEMORY = 2**31 - 2**26
#: Above this many nodes the rewritten model is not checked unless asked (check=True, --check):
#: onnx's checker costs ~1.4x a load+save of the same model (~0.15 s at 20k nodes, ~3 s at 400k).
AUTO_CHECK_MAX_NODES = 20_000

ModelLike = Union[str, os.PathLike, onnx.ModelProto, "onnx_ir.Model"]


class RewriteResult:
    """The rewritten model (the same kind as given) and what was done to it."""

    def __init__(
        self,
        rewritten: onnx.ModelProto | EncodedModel,
        report: RewriteReport,
        *,
        kind: str = "proto",
        external: ExternalData | None = None,
        source_path: Path | None = None,
        reads: dict[tuple[int, int], Path] | None = None,
    ):
        self.report = report
        #: The input's external data files, opened and checked once; ``save`` copies from them.
        self.external = external
        self.source_path = source_path
        #: Every file the input was read from, by (st_dev, st_ino): ``save`` never writes them.
        self.reads = dict(reads or {})
        self._rewritten = rewritten
        self._kind = kind
        self._model: Any = None

    @property
    def source_dir(self) -> Path | None:
        """Folder the model's external data is read from (the input's folder for a path input)."""
        return self.external.base_dir if self.external is not None else None

    @property
    def model(self) -> Any:
        """``onnx.ModelProto`` (or ``onnx_ir.Model`` when one was given), built on first access."""
        if self._model is None:
            proto = to_proto(self._rewritten)
            self._rewritten = proto  # from now on the objects are the truth (callers may edit them)
            if self._kind == "ir":
                import onnx_ir as ir

                self._model = ir.serde.deserialize_model(proto)
                if self.source_dir is not None:
                    _set_ir_base_dir(self._model, self.source_dir)
            else:
                self._model = proto
        return self._model

    def save(
        self,
        path: str | os.PathLike[str],
        *,
        reference_external_data: bool = False,
        progress: ProgressSink | None = None,
    ) -> model_io.SaveInfo:
        """Write the model all or nothing; see :func:`onnx_qrewrite.io.model_io.save_model`.

        Refused (UsageError) when ``path`` is, or links to, a file the input was read from."""
        out = Path(path)
        if self.source_path is not None and out.resolve() == self.source_path.resolve():
            raise UsageError(f"{out}: refusing to overwrite the input model; choose another output path")
        target: onnx.ModelProto | EncodedModel = self._rewritten
        if self._kind == "ir" and self._model is not None:
            import onnx_ir as ir

            target = ir.serde.serialize_model(self._model)
        with stage(progress, "writing model"):
            return model_io.save_model(
                target,
                out,
                external=self.external,
                reference_external_data=reference_external_data,
                progress=progress,
                reads=self.reads,
            )


def _ir_graphs(graph: Any) -> Iterator[Any]:
    yield graph
    for node in graph:
        for attr in node.attributes.values():
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _ir_graphs(attr.value)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.value:
                    yield from _ir_graphs(g)


def _ir_tensors(model: Any) -> Iterator[Any]:
    """Every tensor an onnx_ir model holds: initializers of every graph and tensor attributes."""
    graphs = [*_ir_graphs(model.graph)]
    for fn in model.functions.values():
        for node in fn:
            for attr in node.attributes.values():
                if attr.type == onnx.AttributeProto.GRAPH:
                    graphs.extend(_ir_graphs(attr.value))
        yield from (a.value for node in fn for a in node.attributes.values() if a.type == onnx.AttributeProto.TENSOR)
    for g in graphs:
        for value in g.initializers.values():
            if value.const_value is not None:
                yield value.const_value
        for node in g:
            for attr in node.attributes.values():
                if attr.type == onnx.AttributeProto.TENSOR:
                    yield attr.value


def _set_ir_base_dir(model: Any, base_dir: Path) -> None:
    import onnx_ir as ir

    for tensor in _ir_tensors(model):
        if isinstance(tensor, ir.ExternalTensor):
            tensor.base_dir = str(base_dir)


def _ir_base_dir(model: Any) -> Path | None:
    """The one folder an onnx_ir model's external tensors live in (each names its own)."""
    import onnx_ir as ir

    folders: dict[str, str] = {}
    for tensor in _ir_tensors(model):
        if isinstance(tensor, ir.ExternalTensor):
            base = os.fspath(tensor.base_dir)
            if not base:
                raise InvalidModelError(
                    f"input model: tensor {tensor.name!r} is external data ({os.fspath(tensor.location)!r}) "
                    "without a base_dir; set the folder it lives in"
                )
            folders.setdefault(os.path.normpath(os.path.abspath(base)), tensor.name)
    if len(folders) > 1:
        (a, ta), (b, tb) = list(folders.items())[:2]
        raise InvalidModelError(
            f"input model: external data in two folders (tensor {ta!r} in {a}, tensor {tb!r} in {b}); "
            "one model's external data must live in one folder"
        )
    return Path(next(iter(folders))) if folders else None


def _to_proto(
    model: ModelLike, base_dir: str | os.PathLike[str] | None
) -> tuple[onnx.ModelProto, str, ExternalData | None, Path | None, dict[tuple[int, int], Path], int]:
    """A private copy to edit, the kind given, its external data (opened, checked), the files read,
    and how many nodes were moved into topological order (:mod:`onnx_qrewrite.io.toposort`)."""
    if isinstance(model, (str, os.PathLike)):
        loaded = model_io.open_model(Path(model))
        return loaded.proto, "path", loaded.external, loaded.path, loaded.reads(), loaded.reordered
    if isinstance(model, onnx.ModelProto):
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        label = "input model"
        if copy.ir_version == 0 or not copy.HasField("graph"):
            raise InvalidModelError(f"{label}: not a valid ONNX model (no IR version or graph)")
        external = ExternalData.for_model(copy, base_dir, label)
        try:
            if copy.ByteSize() < _CHECKABLE_IN_MEMORY:
                reordered = model_io.check_input_model(copy, what=label)
            else:  # not checked (too big to check in memory); the order is checked in one pass
                reordered = sort_model(copy, label)
        except BaseException:
            if external is not None:
                external.close()
            raise
        return copy, "proto", external, None, external.reads() if external else {}, reordered
    import onnx_ir as ir  # a core dependency, imported only when a model is not a path or proto

    if isinstance(model, ir.Model):
        folder = _ir_base_dir(model) if base_dir is None else Path(base_dir)
        proto = ir.serde.serialize_model(model)
        reordered = sort_model(proto, "input model")
        external = ExternalData.for_model(proto, folder, "input model")
        return proto, "ir", external, None, external.reads() if external else {}, reordered
    raise UsageError(f"rewrite() takes a path, onnx.ModelProto or onnx_ir.Model, not {type(model).__name__}")


def _for_target(
    proto: onnx.ModelProto,
    catalogue: Catalogue,
    opts: engine.EngineOptions,
    external: Any,
    target: str,
    source_path: Path | None,
    allow: Collection[str] | None,
) -> tuple[Catalogue, engine.EngineOptions, Any]:
    """The rules and engine options for ``target``, planned and checked (targets/plan.py) before
    anything is rewritten; a node the target would still refuse fails unless allow_unlowered."""
    import dataclasses

    from onnx_qrewrite.errors import LoweringError
    from onnx_qrewrite.targets import load_target, plan_for_model

    profile = load_target(target)
    plan = plan_for_model(
        proto,
        catalogue,
        profile,
        external=external,
        label=str(source_path) if source_path is not None else "input model",
        target_opset=opts.target_opset,
        keep_opset=opts.keep_opset,
        allow=allow,
    )
    if plan.after and not opts.allow_unlowered:
        first = plan.after[0]
        raise LoweringError(plan.refusal_error(), node=first.node)
    used = dataclasses.replace(
        opts,
        max_opset=plan.options.max_opset,
        keep_opset=plan.options.keep_opset,
        target_opset=plan.options.target_opset,
        allow=plan.options.allow,
        node_rules=plan.options.node_rules,
    )
    if profile.ir_max is not None and _provenance_needs_ir(proto, opts.provenance) > profile.ir_max:
        used = dataclasses.replace(used, provenance="none")  # _provenance_ir says so
    assert plan.catalogue is not None  # plan_for_model always records the catalogue it planned with
    return plan.catalogue, used, plan


#: Where a rewrite's provenance lives: node metadata (onnx_qrewrite/rewriter/provenance.py).
_PROVENANCE_FIELD = "NodeProto.metadata_props"


def _provenance_needs_ir(proto: onnx.ModelProto, mode: str) -> int:
    """The IR version the output must declare for provenance ``mode`` on ``proto``: node metadata is
    a field of IR 10 (rules/opsets/ir_versions.toml), so a model declared below it is declared at
    it; ``none`` writes no node metadata and needs nothing (0)."""
    from onnx_qrewrite.rewriter.ir_table import ir_with_field

    return ir_with_field(_PROVENANCE_FIELD) if mode != "none" else 0


def _provenance_ir(
    proto: onnx.ModelProto, rewritten: onnx.ModelProto | EncodedModel, report: RewriteReport, asked: str, used: str
) -> None:
    """Keep the output valid at the IR version it declares: a model below IR 10 whose rewrite wrote
    provenance entries on nodes is declared IR 10 (only ``ir_version`` changes; every IR 10 reader
    reads an IR 8 or 9 model's fields the same), said in the report; where the target loads no IR
    that high, its rewrite wrote no node provenance (``none``), and a warning says so."""
    from onnx_qrewrite.io.encoded import skeleton_of

    needed = _provenance_needs_ir(proto, asked)
    if used != asked:
        report.warnings.append(
            f"--provenance {asked} writes node metadata, a field of IR {needed}, above the highest IR the target "
            f"loads: the rewrite carries no node provenance (as --provenance none; the report has the mapping)"
        )
        return
    declared = skeleton_of(rewritten).ir_version
    if declared >= needed or not any(rw.created_nodes for rw in report.rewrites):
        return
    skeleton_of(rewritten).ir_version = needed
    report.ir_version_change = {
        "from": declared,
        "to": needed,
        "why": f"the provenance (--provenance {asked}) is node metadata, {_PROVENANCE_FIELD}, added in IR {needed} "
        "[opsets/onnx-proto]; --provenance none keeps the IR version",
    }


def _later_stages(
    rewritten: onnx.ModelProto | EncodedModel,
    report: RewriteReport,
    plan: Any,
    catalogue: Catalogue,
    opts: engine.EngineOptions,
    external: Any,
    progress: ProgressSink | None,
) -> onnx.ModelProto | EncodedModel:
    """The target plan's later stages (targets/plan.py): each rewrites what the one before wrote,
    with the node choice the plan made for it; ``report`` gathers every stage's rewrites. The
    result must be the model the plan checked, which _run_engine checks once after them."""
    import dataclasses

    from onnx_qrewrite.targets.plan import stage_input

    for later in plan.later:
        options = dataclasses.replace(
            opts,
            max_opset=later.max_opset,
            keep_opset=later.keep_opset,
            target_opset=later.target_opset,
            allow=later.allow,
            node_rules=later.node_rules,
            continue_provenance=later.continue_provenance,
        )
        rewritten, more = engine.run(stage_input(to_proto(rewritten)), catalogue, options, external, progress)
        report.rewrites.extend(more.rewrites)
        report.unlowered.extend(more.unlowered)
        report.opset_changes.extend(more.opset_changes)
        report.warnings.extend(more.warnings)
        report.removed_initializers.extend(more.removed_initializers)
        report.ops_after = more.ops_after
    return rewritten


def _check_as_planned(report: RewriteReport, plan: Any) -> None:
    """The rewrite must be the model the target plan checked (its op counts at least): anything
    else is a bug, not a rewrite to ship (nor one to lower the opset of: the lowering was proven
    exact on the plan's model)."""
    from onnx_qrewrite.rewriter.report import count_ops

    if plan.rewritten is not None and report.ops_after != count_ops(plan.rewritten):
        raise InternalError("the target's rewrite did not give the model its plan checked (a bug, please report it)")


def rewrite(
    model: ModelLike,
    *,
    rules: Catalogue | Iterable[str | os.PathLike[str]] | None = None,
    only: Sequence[str] | None = None,
    skip: Sequence[str] | None = None,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    target_opset: int | None = None,
    keep_opset: bool = False,
    allow_unlowered: bool = False,
    allow: Collection[str] | None = None,
    check: bool | None = None,
    progress: ProgressSink | None = None,
    base_dir: str | os.PathLike[str] | None = None,
    provenance: str = "compact",
    target: str | os.PathLike[str] | None = None,
    input_shapes: InputShapes | Mapping[str, Sequence[int]] | None = None,
) -> RewriteResult:
    """Rewrite every node the rules match; the input is never modified.

    ``rules``: a :class:`Catalogue`, or rule files added to the shipped ones. ``options`` overrides
    rule options, e.g. ``{"dql-expand": {"semantics": "spec"}}``. ``check``: run onnx's checker
    on the result (None: when it has at most ``AUTO_CHECK_MAX_NODES`` nodes, since on bigger graphs
    the checker alone costs as much as loading and saving the model). ``base_dir``: the folder an
    ``onnx.ModelProto``'s external data lives in (a path's is its folder; an ``onnx_ir.Model``'s
    is its tensors' ``base_dir``); external data must stay inside that folder. ``allow``: the
    exactness levels rules may have (default ``("exact", "bounded")``; add ``"approximate"`` to run
    the rules that change numerics by design, see :mod:`onnx_qrewrite.rewriter.contract`). ``provenance``:
    which created nodes carry rule/origin metadata, "compact" (the first of each replacement),
    "full" (all) or "none" (see :mod:`onnx_qrewrite.rewriter.provenance`; the report always has the full
    mapping). ``target``: rewrite for that deployment target (a name from ``onnx-qrewrite
    targets`` or a profile's path, see :mod:`onnx_qrewrite.targets`): the ops it runs natively are
    kept, no rule that would make a node it accepts refused is used, the opset stays within what it
    loads, and a node it would still refuse is a :class:`~onnx_qrewrite.errors.LoweringError`
    (exit 4) unless ``allow_unlowered`` (then a warning); the report's ``target`` says what it
    refuses before and after. ``input_shapes`` (with ``target`` only; an
    :class:`~onnx_qrewrite.targets.shapes.InputShapes`, or shapes by input name): fix those
    symbolic dimensions before planning, as onnxruntime's make_dynamic_shape_fixed does, so the
    plan sees static shapes and the output has them (targets such as QNN need them). Raises
    :class:`~onnx_qrewrite.errors.QRewriteError` subclasses, each with its CLI exit code.
    """
    catalogue = _catalogue(rules, only, skip, options)
    from onnx_qrewrite.rewriter.provenance import check_mode

    check_mode(provenance)
    with stage(progress, "loading model"):
        proto, kind, external, source_path, reads, reordered = _to_proto(model, base_dir)
    levels = frozenset(allow) if allow is not None else engine.DEFAULT_ALLOW
    try:
        opts = engine.EngineOptions(
            target_opset=target_opset,
            keep_opset=keep_opset,
            allow_unlowered=allow_unlowered,
            provenance=provenance,
            allow=levels,
        )
        plan, applied = None, _apply_shapes(proto, input_shapes, target, source_path)
        if target is not None:
            catalogue, opts, plan = _for_target(proto, catalogue, opts, external, str(target), source_path, allow)
            plan.input_shapes = applied.to_dict() if applied is not None else None
        rewritten, report = _run_engine(proto, catalogue, opts, external, progress, plan, source_path)
        _provenance_ir(proto, rewritten, report, provenance, opts.provenance)
        if applied is not None:  # the output keeps the fixed dimensions, not the shapes recorded for the plan
            from onnx_qrewrite.targets.shapes import drop_value_info

            drop_value_info(rewritten.skeleton if isinstance(rewritten, EncodedModel) else rewritten, applied.added)
        _add_notes(report, reordered, plan)
        if check is None:
            check = sum(report.ops_after.values()) <= AUTO_CHECK_MAX_NODES
        if check and report.changed:
            with stage(progress, "checking the result"):
                model_io.check_model(
                    rewritten, what="the rewritten model (a bug, please report it)", error=InternalError
                )
    except BaseException:
        if external is not None:
            external.close()
        raise
    return RewriteResult(rewritten, report, kind=kind, external=external, source_path=source_path, reads=reads)


def _apply_shapes(
    proto: onnx.ModelProto,
    input_shapes: InputShapes | Mapping[str, Sequence[int]] | None,
    target: object,
    source_path: Path | None,
) -> Applied | None:
    """Fix ``proto``'s dimensions from ``input_shapes`` (a target's static shapes) before planning.

    Without ``input_shapes`` nothing is imported: ``onnx_qrewrite.targets`` (the profiles, the
    planner) is a tenth of a plain rewrite's start-up (``python -X importtime``)."""
    if not input_shapes:
        return None
    from onnx_qrewrite.targets.shapes import InputShapes, apply_input_shapes

    if target is None:
        raise UsageError("--input-shape fixes dimensions for a target: give --target too")
    if not isinstance(input_shapes, InputShapes):
        input_shapes = InputShapes({k: tuple(int(d) for d in v) for k, v in input_shapes.items()})
    return apply_input_shapes(proto, input_shapes, str(source_path) if source_path is not None else "input model")


def _catalogue(
    rules: Catalogue | Iterable[str | os.PathLike[str]] | None,
    only: Sequence[str] | None,
    skip: Sequence[str] | None,
    options: Mapping[str, Mapping[str, Any]] | None,
) -> Catalogue:
    """The rules ``rewrite`` uses: a given catalogue narrowed and re-optioned, or the shipped rules
    plus the given rule files."""
    if isinstance(rules, Catalogue):
        catalogue = rules.select(only, skip)
        return catalogue.with_options(options) if options else catalogue
    return load_rules(() if rules is None else rules, only=only, skip=skip, options=options)


def _run_engine(
    proto: onnx.ModelProto,
    catalogue: Catalogue,
    opts: engine.EngineOptions,
    external: ExternalData | None,
    progress: ProgressSink | None,
    plan: Any,
    source_path: Path | None,
) -> tuple[onnx.ModelProto | EncodedModel, RewriteReport]:
    """The engine's pass(es), then a target plan's later stages; an invalid model found while
    rewriting is named as load errors name it."""
    try:
        rewritten, report = engine.run(proto, catalogue, opts, external, progress)
        if plan is not None and plan.later:
            rewritten = _later_stages(rewritten, report, plan, catalogue, opts, external, progress)
        lowers = plan is not None and (plan.opset_lowering is not None or plan.ir_lowering is not None)
        if plan is not None and (plan.later or lowers):
            _check_as_planned(report, plan)  # once, whether stages, a lowering or both follow the plan
        if plan is not None and plan.opset_lowering is not None:
            _lower_opset(rewritten, report, plan.opset_lowering)
        if plan is not None and plan.ir_lowering is not None:
            _lower_ir(rewritten, report, plan.ir_lowering)
    except InvalidModelError as exc:  # found while rewriting: name the model, as load errors do
        label = str(source_path) if source_path is not None else "input model"
        if str(exc).startswith(label):
            raise
        raise InvalidModelError(f"{label}: {exc}") from None
    return rewritten, report


def _lower_opset(rewritten: onnx.ModelProto | EncodedModel, report: RewriteReport, lowering: dict[str, Any]) -> None:
    """The target plan's opset lowering (targets/lower_opset.py), proven exact on the model the
    plan checked, which the rewrite reproduces: only the opset imports change."""
    from onnx_qrewrite.io.encoded import skeleton_of
    from onnx_qrewrite.rewriter.report import OpsetChange
    from onnx_qrewrite.targets.lower_opset import set_default_opset

    set_default_opset(skeleton_of(rewritten), lowering["to"])
    report.opset_changes.append(OpsetChange("", lowering["from"], lowering["to"], lowering["why"]))


def _lower_ir(rewritten: onnx.ModelProto | EncodedModel, report: RewriteReport, lowering: dict[str, Any]) -> None:
    """The target plan's IR version lowering (targets/lower_ir.py), proven on the model the plan
    checked (it uses nothing the versions in between added): only ``ir_version`` changes."""
    from onnx_qrewrite.io.encoded import skeleton_of

    skeleton_of(rewritten).ir_version = lowering["to"]
    report.ir_version_change = dict(lowering)


def _add_notes(report: RewriteReport, reordered: int, plan: Any) -> None:
    """What the report says beyond the engine's own: nodes sorted on load, the target's verdict."""
    if reordered:
        report.warnings.append(
            f"the input's nodes were not in topological order: sorted, as onnxruntime does ({reordered} moved)"
        )
    if plan is not None:
        report.target = plan.to_dict()
        report.warnings.extend(
            f"target {plan.target} would still refuse {r.node} ({r.op_key}): {r.reasons[0]}" for r in plan.after
        )
