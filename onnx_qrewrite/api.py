"""The Python entry point: ``rewrite`` accepts a path, an ``onnx.ModelProto`` or an
``onnx_ir.Model`` and returns the same kind of model it was given, with a report."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import onnx

from onnx_qrewrite import engine, model_io
from onnx_qrewrite.catalogue import Catalogue, load_catalogue
from onnx_qrewrite.encoded import EncodedModel, to_proto
from onnx_qrewrite.errors import InternalError, UsageError
from onnx_qrewrite.progress import ProgressSink
from onnx_qrewrite.report import RewriteReport

if TYPE_CHECKING:
    import onnx_ir

__all__ = ["RewriteResult", "load_rules", "rewrite"]

#: The checker takes a ModelProto only below protobuf's 2 GB limit.
_CHECKABLE_IN_MEMORY = 2**31 - 2**26
#: Above this many nodes the rewritten model is not checked unless asked (check=True, --check):
#: onnx's checker costs ~1.4x a load+save of the same model (~0.15 s at 20k nodes, ~3 s at 400k).
AUTO_CHECK_MAX_NODES = 20_000

ModelLike = Union[str, os.PathLike, onnx.ModelProto, "onnx_ir.Model"]


def load_rules(
    paths: Iterable[str | os.PathLike[str]] = (),
    *,
    only: Sequence[str] | None = None,
    skip: Sequence[str] | None = None,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    include_shipped: bool = True,
) -> Catalogue:
    """The shipped catalogue plus ``paths``, selected with ``only``/``skip``, options overridden."""
    catalogue = load_catalogue(paths, include_shipped=include_shipped)
    catalogue = catalogue.select(only, skip)
    if options:
        catalogue = catalogue.with_options(options)
    return catalogue


class RewriteResult:
    """The rewritten model (the same kind as given) and what was done to it."""

    def __init__(
        self,
        rewritten: onnx.ModelProto | EncodedModel,
        report: RewriteReport,
        *,
        kind: str = "proto",
        source_dir: Path | None = None,
        source_path: Path | None = None,
    ):
        self.report = report
        #: Folder the model's external data is read from (the input's folder for a path input).
        self.source_dir = source_dir
        self.source_path = source_path
        self._rewritten = rewritten
        self._kind = kind
        self._model: Any = None

    @property
    def model(self) -> Any:
        """``onnx.ModelProto`` (or ``onnx_ir.Model`` when one was given), built on first access."""
        if self._model is None:
            proto = to_proto(self._rewritten)
            self._rewritten = proto  # from now on the objects are the truth (callers may edit them)
            if self._kind == "ir":
                import onnx_ir as ir

                self._model = ir.serde.deserialize_model(proto)
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
        """Write the model atomically; see :func:`onnx_qrewrite.model_io.save_model`."""
        out = Path(path)
        if self.source_path is not None and out.resolve() == self.source_path.resolve():
            raise UsageError(f"{out}: refusing to overwrite the input model; choose another output path")
        target: onnx.ModelProto | EncodedModel = self._rewritten
        if self._kind == "ir" and self._model is not None:
            import onnx_ir as ir

            target = ir.serde.serialize_model(self._model)
        return model_io.save_model(
            target,
            out,
            source_dir=self.source_dir,
            reference_external_data=reference_external_data,
            progress=progress,
        )


def _to_proto(model: ModelLike) -> tuple[onnx.ModelProto, str, Path | None, Path | None]:
    """A private copy to edit, the kind given, and where external data lives."""
    if isinstance(model, (str, os.PathLike)):
        path = Path(model)
        return model_io.load_model(path), "path", path.parent, path
    if isinstance(model, onnx.ModelProto):
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        if copy.ByteSize() < _CHECKABLE_IN_MEMORY:
            model_io.check_model(copy, what="input model")
        return copy, "proto", None, None
    try:
        import onnx_ir as ir
    except ImportError:  # pragma: no cover
        ir = None
    if ir is not None and isinstance(model, ir.Model):
        proto = ir.serde.serialize_model(model)
        base = None
        for value in model.graph.initializers.values():
            tensor = value.const_value
            if isinstance(tensor, ir.ExternalTensor):
                base = Path(tensor.base_dir)
                break
        return proto, "ir", base, None
    raise UsageError(f"rewrite() takes a path, onnx.ModelProto or onnx_ir.Model, not {type(model).__name__}")


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
    check: bool | None = None,
    progress: ProgressSink | None = None,
) -> RewriteResult:
    """Rewrite every node the rules match; the input is never modified.

    ``rules``: a :class:`Catalogue`, or rule files added to the shipped ones. ``options`` overrides
    rule options, e.g. ``{"dql-expand": {"semantics": "spec"}}``. ``check``: run onnx's checker
    on the result (None: when it has at most ``AUTO_CHECK_MAX_NODES`` nodes, since on bigger graphs
    the checker alone costs as much as loading and saving the model). Raises
    :class:`~onnx_qrewrite.errors.QRewriteError` subclasses, each with its CLI exit code.
    """
    if isinstance(rules, Catalogue):
        catalogue = rules.select(only, skip)
        if options:
            catalogue = catalogue.with_options(options)
    else:
        catalogue = load_rules(rules or (), only=only, skip=skip, options=options)
    proto, kind, source_dir, source_path = _to_proto(model)
    opts = engine.EngineOptions(target_opset=target_opset, keep_opset=keep_opset, allow_unlowered=allow_unlowered)
    rewritten, report = engine.run(proto, catalogue, opts, str(source_dir) if source_dir else None, progress)
    if check is None:
        check = sum(report.ops_after.values()) <= AUTO_CHECK_MAX_NODES
    if check and report.changed:
        model_io.check_model(
            rewritten, what="the rewritten model (a bug, please report it)", base_dir=source_dir, error=InternalError
        )
    return RewriteResult(rewritten, report, kind=kind, source_dir=source_dir, source_path=source_path)
