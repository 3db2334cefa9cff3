"""Opset bookkeeping: raising the default-domain opset when a standard op needs it, and dropping
vendor-domain imports a rewrite left unused."""

from __future__ import annotations

import logging

from onnx_qrewrite import _onnx as onnx
from onnx_qrewrite.errors import LoweringError, UsageError, first_line
from onnx_qrewrite.rewriter.graph import default_opset, iter_scopes
from onnx_qrewrite.rewriter.report import OpsetChange, RewriteReport

__all__ = ["MAX_RUNTIME_OPSET", "drop_unused_vendor_imports", "model_default_opset", "raise_default_opset"]

logger = logging.getLogger(__name__)

#: onnxruntime 1.31.1 refuses default-domain opset 27 unless an environment flag is set (onnx 1.23
#: defines 28): never raise a model past what the runtime loads.
MAX_RUNTIME_OPSET = 26


def model_default_opset(model: onnx.ModelProto) -> int | None:
    """The model's default-domain opset version, or None if it imports none."""
    return default_opset(model.opset_import)


def raise_default_opset(model: onnx.ModelProto, target: int, report: RewriteReport, *, why: str) -> onnx.ModelProto:
    """The whole model converted to default-domain opset ``target`` with onnx's version converter.

    Only succeeds if the converter succeeds and its result passes the checker (external weights are
    checked where they are opened, see :func:`model_io.check_model`); the IR version is kept
    (onnxruntime 1.31 loads IR <= 13, and the converter does not need a newer one).
    """
    from onnx import version_converter

    from onnx_qrewrite.io import model_io

    current = model_default_opset(model) or 0
    if target <= current:
        return model
    if target > MAX_RUNTIME_OPSET:
        raise UsageError(f"--target-opset {target}: above {MAX_RUNTIME_OPSET}, the highest onnxruntime 1.31 loads")
    cannot = f"cannot raise the opset from {current} to {target} ({why})"
    hint = "use --keep-opset to keep the opset and decompose instead"
    if model.functions:
        raise LoweringError(
            f"{cannot}: the model has local functions, which onnx's version converter "
            "does not convert; use --keep-opset"
        )
    try:
        converted = version_converter.convert_version(model, target)
    except Exception as exc:  # noqa: BLE001 - onnx's C++ converter raises whatever it meets
        raise LoweringError(f"{cannot}: {first_line(exc)}; {hint}") from None
    converted.ir_version = model.ir_version
    try:
        model_io.check_model(converted, what=cannot, error=LoweringError)
    except LoweringError as exc:
        raise LoweringError(f"{exc}; {hint}") from None
    logger.info("raised default-domain opset %d -> %d (%s)", current, target, why)
    report.opset_changes.append(OpsetChange("", current, target, why))
    return converted


def drop_unused_vendor_imports(
    model: onnx.ModelProto, rewritten_domains: set[str], used_domains: set[str], report: RewriteReport
) -> None:
    """Remove opset imports of vendor domains whose nodes the rewrite replaced, if none is left.

    ``used_domains``: domains of the ops left in the model (every scope). Imports the rewrite did
    not touch stay as they were (Quark writes imports of domains it never uses; removing them is
    not our business).
    """
    candidates = {d for d in rewritten_domains if d not in ("", "ai.onnx")}
    if not candidates:
        return
    _drop_function_imports(model, candidates, report)
    used = set(used_domains)
    used.update(f.domain for f in model.functions)
    for domain in sorted(candidates - used):
        for i, entry in enumerate(model.opset_import):
            if entry.domain == domain:
                report.opset_changes.append(OpsetChange(domain, entry.version, None, "no node uses it any more"))
                del model.opset_import[i]
                break


def _drop_function_imports(model: onnx.ModelProto, candidates: set[str], report: RewriteReport) -> None:
    """The same for each local function's own opset imports."""
    if not model.functions:
        return
    used_by: dict[int, set[str]] = {}
    for scope in iter_scopes(model):
        root = scope.root.container
        if isinstance(root, onnx.FunctionProto):
            used_by.setdefault(id(root), set()).update(n.domain for n in scope.container.node)
    for fn in model.functions:
        used = used_by.get(id(fn), set())
        for i in reversed(range(len(fn.opset_import))):
            domain = fn.opset_import[i].domain
            if domain in candidates and domain not in used:
                report.opset_changes.append(
                    OpsetChange(
                        domain,
                        fn.opset_import[i].version,
                        None,
                        f"no node of function {fn.domain}.{fn.name} uses it any more",
                    )
                )
                del fn.opset_import[i]
